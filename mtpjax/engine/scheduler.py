"""The host loop: slots, requests, stop conditions and statistics (continuous batching).

A request joins as soon as a slot is free (prefill, then insert), every step advances all
slots at once, and a finished request frees its slot for the next. Each request's tokens are
those it would get alone: sampling is keyed by (request seed, position), never by slot or
schedule. Streaming consumers get each request's tokens through `on_tokens`. What a request is
and gets back, and the record of a live one, are `requests.py`.

Before each step the scheduler decides every slot's draft window (the drafting policy,
`drafting_policy.py`) and, with host drafting, asks each request's drafter for the tokens the
step verifies (a composite's start with the MTP chain the previous step returned); after it,
each drafter learns what was accepted and committed.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Iterable

import numpy as np

from mtpjax import errors
from mtpjax.draft_window import DraftWindow
from mtpjax.engine.composite import NgramDrafter
from mtpjax.engine.contract import (ACCEPTED, COUNT, DecodeEngine, burst_rows, committed_tokens,
                                   mtp_chain, slot_buckets)
from mtpjax.engine.drafting_policy import AdaptiveDrafting, DraftingCost
# Request, RequestFailed, Result and TokenLogprob are imported from here by the server, the
# API and the tools: the scheduler is where requests go in and results come out.
from mtpjax.engine.requests import (LiveRequest, Request, RequestFailed, Result, TokenLogprob,
                                    token_logprobs)
from mtpjax.telemetry import MtpStats


def overlap_fraction(host_seconds: dict[bool, float]) -> float:
  """The share of the host's time between steps (launching them, handing out their tokens)
  spent while a launched step computed, from seconds keyed by that (`host_seconds`): hidden
  under the device's time, not added to it."""
  total = host_seconds[True] + host_seconds[False]
  return host_seconds[True] / total if total else 0.0


@dataclasses.dataclass(frozen=True)
class _Launched:
  """A step in flight: the engine's pending step, the live request of each slot it computes
  (None: not computed), their draft windows, whether any drafted, when it started and the
  steps it runs (a burst's, else 1)."""
  pending: object
  slots: list
  windows: list[int]
  drafted: bool
  started: float
  decode_steps: int = 1


@dataclasses.dataclass
class _Prefilling:
  """A request being prefilled into a free slot, between the chunks of a long prompt."""
  slot: int
  request: Request
  done: Callable[[Result], None]
  started: float
  job: object = None              # the engine's prefill job, once started


class SlotScheduler:
  """Runs requests over the engine's slots until all are done.

  `interleave_prefill`: a long prompt's chunks alternate with steps of the live slots (else
  its whole prefill runs at once, stalling every stream meanwhile). `window`: each request's
  native-MTP draft window (default: fixed at the engine's `draft_tokens`). `drafter`: a
  request's host drafting from its prompt (`HostDrafting.drafter`), for an engine with
  `host_drafts`: each step verifies what it proposes (after the MTP chain, for a composite)."""

  def __init__(self, engine: DecodeEngine, adaptive: AdaptiveDrafting | None = AdaptiveDrafting(),
               window: DraftWindow | None = None, *, interleave_prefill: bool = True,
               drafter: Callable[[np.ndarray], NgramDrafter] | None = None):
    self.engine = engine
    if engine.engine_cfg.host_drafts != (drafter is not None):
      raise errors.MtpjaxError(
          "an engine with host_drafts needs a drafter, and only it takes one",
          field="speculative", remedy="build the engine and the scheduler from one HostDrafting")
    self.drafter = drafter
    self.interleave_prefill = interleave_prefill
    self.prefilling: _Prefilling | None = None
    self.adaptive = adaptive
    top = engine.engine_cfg.draft_tokens
    self.window = DraftWindow.fixed(top) if window is None else window
    if self.native_mtp and self.window.max > top:
      raise errors.MtpjaxError(
          f"a draft window of up to {self.window.max} tokens needs an engine compiled for it "
          f"(draft_tokens {top})", field="engine.draft_tokens",
          remedy="build the engine with draft_tokens = the window's max")
    self.window_in_use = 0.0            # the last step's mean draft window over live slots
    # The cost policy's prices and verdicts per slot bucket, carried over with the engine.
    self.costs = DraftingCost.table(engine)
    self._buckets = slot_buckets(engine.engine_cfg.slots)
    self.bucket = self._buckets[-1]     # the slot bucket of the step being decided
    self._plain_steps = 0           # plain steps since the last drafting step (rows to catch up)
    self.state = engine.init_state()
    self.slots: list[LiveRequest | None] = [None] * engine.engine_cfg.slots
    self.waiting: collections.deque[tuple[Request, Callable[[Result], None]]] = (
        collections.deque())
    self.occupancy_samples: list[float] = []
    self.in_flight: _Launched | None = None   # a launched step not yet landed (overlapping)
    self.host_seconds = {True: 0.0, False: 0.0}   # host time between steps, by overlapped
    self._landed_at = 0.0                         # when the last step's tokens were read

  @property
  def native_mtp(self) -> bool:
    return self.engine.engine_cfg.native_mtp

  @property
  def cost(self) -> DraftingCost:
    """The prices of steps over this step's slot bucket."""
    return self.costs[self.bucket]

  @property
  def verdict(self):
    """The cost policy's standing decision for this step's slot bucket."""
    return self.cost.verdict

  @property
  def cost_aware(self) -> bool:
    return self.adaptive is not None and self.adaptive.cost_aware

  @property
  def window_cap(self) -> int:
    """The cost policy's cap on every slot's native-MTP window: none without the policy, nor
    while the verdict's cap (another scheduler's, perhaps) lies outside this window."""
    cap = self.verdict.window_cap
    if self.cost_aware and cap is not None and self.window.min <= cap <= self.window.max:
      return cap
    return self.window.max

  @window_cap.setter
  def window_cap(self, cap: int) -> None:
    self.verdict.window_cap = cap

  @property
  def batch_paused_steps(self) -> int:
    """Steps left in which no slot drafts (the cost policy's pause; none without it)."""
    return self.verdict.paused_steps if self.cost_aware else 0

  @batch_paused_steps.setter
  def batch_paused_steps(self, steps: int) -> None:
    self.verdict.paused_steps = steps

  @property
  def speculating(self) -> bool:
    """Whether steps verify drafts (native MTP's, the host's or both)."""
    return self.engine.engine_cfg.drafts

  def submit(self, request: Request, done: Callable[[Result], None]) -> None:
    if request.max_new_tokens < 1:
      raise errors.MtpjaxError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}",
                               field="max_new_tokens", remedy="ask for at least one token")
    if request.logprobs and not self.engine.engine_cfg.logprobs:
      raise errors.MtpjaxError("this engine computes no logprobs", field="engine.logprobs",
                               remedy="build the engine with logprobs > 0")
    self.engine.engine_cfg.check_fits(len(request.prompt), request.max_new_tokens)
    self.waiting.append((request, done))

  @property
  def busy(self) -> bool:
    return (bool(self.waiting) or self.prefilling is not None or self.in_flight is not None
            or any(s is not None for s in self.slots))

  def _admit(self) -> None:
    """Prefill waiting requests into free slots. A prompt of several chunks runs one chunk per
    scheduler step (`interleave_prefill`), so the live slots keep decoding between its chunks;
    requests behind it wait for it, in order. A request whose pages the KV pool cannot
    reserve now (`engine.start_prefill` returns None) waits at the head of the queue until
    finished requests give pages back; `submit` refused those that could never fit."""
    if self.prefilling is not None and not self._prefill_more(self.prefilling):
      return
    for index, live in enumerate(self.slots):
      if live is not None or not self.waiting:
        continue
      request, done = self.waiting.popleft()
      pending = _Prefilling(index, request, done, time.perf_counter())
      # A request the batch pause outlasts never drafts: its prompt needs no NextN rows.
      nextn = not self._outlasted(request.max_new_tokens)
      try:   # nothing of the decode state is touched before the insert: fail this one alone
        pending.job = self.engine.start_prefill(
            request.prompt, request.sampler, state=self.state, logprobs=request.logprobs,
            new_tokens=request.max_new_tokens, nextn=nextn)
      except Exception as error:
        raise RequestFailed(request, error) from error
      if pending.job is None:
        self.waiting.appendleft((request, done))
        return
      if not self._prefill_more(pending):
        self.prefilling = pending
        return

  def _prefill_more(self, pending: "_Prefilling") -> bool:
    """Run the next chunk of a pending prefill (every chunk without interleaving); once the
    prompt is done, insert it into its slot and emit the first token. True when inserted."""
    request = pending.request
    try:   # the pools' other pages are untouched before the insert: fail this one alone
      while not self.engine.prefill_chunk(pending.job):
        if self.interleave_prefill:
          return False
    except Exception as error:
      self.prefilling = None
      self.engine.drop_prefill(pending.job)
      raise RequestFailed(request, error) from error
    self.prefilling = None
    prefix = pending.job.prefix
    index = pending.slot
    self.state = self.engine.insert(prefix, self.state, index)
    positions = self.engine.engine_cfg.draft_tokens if self.drafter else self.window.max
    live = LiveRequest(request=request, done=pending.done, started=pending.started,
                 window=self.window.initial, verified_at=[0] * positions,
                 accepted_at=[0] * positions, cached_tokens=pending.job.cached,
                 detached=self.native_mtp and not pending.job.nextn)
    live.counts["target_passes"] += 1
    live.counts["committed_tokens"] += 1
    first = int(np.asarray(prefix.current)[0])
    if self.drafter is not None:
      live.ngram = self.drafter(request.prompt)
      live.ngram.commit([first])
      if prefix.mtp_chain is not None:
        live.mtp_chain = np.asarray(prefix.mtp_chain)[0].tolist()
    live.first_token_s = time.perf_counter() - pending.started
    self.slots[index] = live
    self._emit(index, [first], token_logprobs(request, prefix.logprobs, 0, [first]))
    return True

  def _emit(self, index: int, tokens: list[int],
            logprobs: list[TokenLogprob] | None = None) -> None:
    """Append tokens, stopping at a stop id, the token budget or the context length."""
    live = self.slots[index]
    request = live.request
    out = []
    reason = None
    for token in tokens:
      if logprobs is not None:
        live.logprobs.append(logprobs[len(out)])
      out.append(token)
      live.tokens.append(token)
      if token in request.stop_ids:
        reason = "stop"
        break
      if len(live.tokens) >= request.max_new_tokens:
        reason = "length"
        break
      if len(request.prompt) + len(live.tokens) >= self.engine.engine_cfg.max_len:
        reason = "length"
        break
    if out and logprobs is not None and request.on_logprobs is not None:
      request.on_logprobs(live.logprobs[-len(out):])
    if out and request.on_tokens is not None:
      request.on_tokens(out)
    if reason is None and request.cancelled is not None and request.cancelled():
      reason = "cancelled"
    if reason is not None:
      self._finish(index, reason)

  def _finish(self, index: int, reason: str) -> None:
    live = self.slots[index]
    self.slots[index] = None
    self.state = self.engine.free(self.state, index)
    c = live.counts
    if self.native_mtp and self._drafts(live):
      c["drafted"] += 1             # the last draft, dropped unverified
    stats = MtpStats.from_counts(
        native_mtp=self.speculating, drafted=c["drafted"], accepted=c["accepted"],
        rejected=c["rejected"], target_passes=c["target_passes"],
        committed_tokens=c["committed_tokens"], proposal_compute_us=c["proposal_us"],
        verification_compute_us=c["verification_us"],
        verified_by_position=live.verified_at if self.speculating else (),
        accepted_by_position=live.accepted_at if self.speculating else ())
    live.done(Result(tokens=live.tokens, finish_reason=reason, stats=stats,
                     prompt_tokens=len(live.request.prompt),
                     time_to_first_token_s=live.first_token_s,
                     total_time_s=time.perf_counter() - live.started,
                     logprobs=live.logprobs if live.request.logprobs else None,
                     cached_tokens=live.cached_tokens))

  def step(self) -> None:
    """Admit waiting requests, then advance every live slot by one engine step. On an engine
    that overlaps steps (`DecodeEngine.overlapping`) the step after a fixed one (MTP off's,
    or native MTP's while no slot drafts) is launched before the last one's tokens are handed
    out, so the host's work on them runs while the device computes: a request that stopped
    in the last step (a stop id, a cancel) costs the launched step its wasted rows (one, or a
    decode burst's), whose tokens are dropped; one at its token budget or context end is left
    out. The drafting policy then decides each step from verdicts a step old."""
    self._admit()
    started = time.perf_counter()
    launched = self._launch()
    self.host_seconds[self.in_flight is not None] += time.perf_counter() - started
    if self.in_flight is not None:
      self._land(self.in_flight, overlapped=launched is not None)
    self.in_flight = launched
    if launched is not None and not (self.engine.overlapping and launched.pending.fixed):
      self.in_flight = None
      self._land(launched, overlapped=False)

  @property
  def overlap_fraction(self) -> float:
    return overlap_fraction(self.host_seconds)

  def _launch(self) -> "_Launched | None":
    """Start a step over every live slot with tokens left to make (None: no such slot)."""
    # The host's work between steps is plain Python on lists: on a fast accelerator it is part
    # of every step's wall time, and numpy's per-call overhead on [B]-sized arrays dominates it.
    max_len = self.engine.engine_cfg.max_len
    due = [s if s is not None and s.tokens_left(max_len) > s.launched else None
           for s in self.slots]
    occupied = [s is not None for s in due]
    if not any(occupied):
      return None
    self._detach_outlasted()
    self.occupancy_samples.append(sum(occupied) / len(occupied))
    active = np.array(occupied)
    highest = len(occupied) - occupied[::-1].index(True)
    self.bucket = next(b for b in self._buckets if b >= highest)
    # One drafting slot makes this a drafting step, and then every live slot's draft is free.
    drafted = self.native_mtp and any(s is not None and self._drafts(s) for s in due)
    started = time.perf_counter()
    # Logprobs cost a step something only while a live request asks for them.
    wants = any(s is not None and s.request.logprobs for s in due)
    # Each live slot's window, capped by the cost policy; without native MTP `drafted` is
    # False and the engine ignores the windows.
    cap = self.window_cap
    windows = [min(s.window, cap) if s is not None and drafted and not s.detached else 0
               for s in due]
    drafts = None
    if self.drafter is not None:
      drafts, windows = self._host_drafts(windows)
      drafted = any(windows)
    self.window_in_use = sum(windows) / sum(occupied)
    drafting = np.array(windows, np.int32)
    burst = self._burst(due, max_len, drafting if drafted else None, active)
    self.state, pending = self.engine.launch(
        self.state, active, drafting, drafts=drafts, logprobs=wants, decode_steps=burst)
    for live in due:
      if live is not None:
        live.launched += burst
    return _Launched(pending, due, windows, drafted, started, burst)

  def _burst(self, due: list, max_len: int, windows: np.ndarray | None,
             active: np.ndarray) -> int:
    """The steps this dispatch runs (`windows`: the slots' draft windows of a drafting step):
    the engine's burst while no prompt is being prefilled or waits beside a free slot (for
    pages), whose first token a burst would delay, and every slot it computes has tokens left
    for all their rows beyond those in flight (a request's last few run a step at a time, so
    no row is written past its pages), else 1."""
    burst = self.engine.decode_burst
    if burst == 1 or self.prefilling is not None or (self.waiting and None in self.slots):
      return 1
    # The rows a step may write a slot: its verify rows at the window bucket, or one.
    rows = 1 if windows is None else self.engine.engine_cfg.window_bucket(windows, active) + 1
    if all(live is None or live.tokens_left(max_len) - live.launched >= burst * rows
           for live in due):
      return burst
    return 1

  def _land(self, step: "_Launched", overlapped: bool) -> None:
    """Hand out a launched step's tokens to the slots it computed whose requests still run
    (`overlapped`: while the next step computes)."""
    result, info = step.pending.collect()
    collected = time.perf_counter()
    width = self.engine.engine_cfg.step_width
    logprobs = info.get("logprobs")
    # Each step's logprob rows: a burst's steps committed the same number of rows each.
    per_step = None if logprobs is None else logprobs[0].shape[1] // step.decode_steps
    for index, (live, row) in enumerate(zip(step.slots, result.tolist())):
      if live is None:
        continue
      live.launched -= step.decode_steps
      for j, part in enumerate(burst_rows(row, step.decode_steps, width)):
        if self.slots[index] is not live:
          break             # it stopped in an earlier step: these rows are past its end
        c = live.counts
        c["target_passes"] += 1
        c["committed_tokens"] += part[COUNT]
        tokens = committed_tokens(part)
        if self.speculating:
          self._account_draft(live, step.windows[index], part[ACCEPTED],
                              info if j == 0 else {})
        if live.ngram is not None:
          self._host_verified(live, row, tokens)
        rows = (None if logprobs is None else
                tuple(a[:, j * per_step:(j + 1) * per_step] for a in logprobs))
        self._emit(index, tokens, token_logprobs(live.request, rows, index, tokens))
    landed, self._landed_at = self._landed_at, time.perf_counter()
    self.host_seconds[overlapped] += self._landed_at - collected
    if self.speculating:
      # The step's wall time with the host's per-step work, from its launch or, launched
      # while the last one computed, from when that one landed: what it adds to a stream.
      drafted, steps = step.drafted, step.decode_steps
      # Only native MTP catches up after plain steps (an n-gram proposer has no cache).
      self.cost.observe_step(drafted, self._landed_at - max(step.started, landed),
                             caught_up_rows=self._plain_steps if drafted and self.native_mtp
                             else 0, steps=steps)
      self._plain_steps = 0 if drafted else self._plain_steps + steps
      self._price_drafting(drafted, steps)

  def _host_drafts(self, mtp_windows: list[int]) -> tuple[np.ndarray, list[int]]:
    """Each live slot's host draft for this step, [slots, draft_tokens], and its length. A
    composite's starts with the slot's MTP chain cut to its MTP window (`mtp_windows`), then
    the n-gram tail; an n-gram proposer alone drafts up to the engine's window while the slot
    and the batch are not paused."""
    top = self.engine.engine_cfg.draft_tokens
    drafts = np.zeros((len(self.slots), top), np.int32)
    windows = [0] * len(self.slots)
    for index, live in enumerate(self.slots):
      if live is None:
        continue
      live.proposed = None
      if not (self.native_mtp or self._drafts(live)):
        continue
      started = time.perf_counter()
      proposed = live.ngram.draft(top, live.mtp_chain[:mtp_windows[index]])
      live.counts["proposal_us"] += int((time.perf_counter() - started) * 1e6)
      if proposed.tokens:
        live.proposed = proposed
        windows[index] = len(proposed.tokens)
        drafts[index, :windows[index]] = proposed.tokens
    return drafts, windows

  def _host_verified(self, live: LiveRequest, row: list[int], tokens: list[int]) -> None:
    """Feed a step's outcome to the request's drafter: what it accepted of the host draft and
    the tokens committed, and (a composite) the next MTP chain. The host's time drafting counts
    as the request's proposal compute."""
    started = time.perf_counter()
    if live.proposed is None:
      live.ngram.commit(tokens)
    else:
      live.ngram.verified(live.proposed, row[ACCEPTED], tokens)
    live.counts["proposal_us"] += int((time.perf_counter() - started) * 1e6)
    if self.engine.engine_cfg.mtp_chain_columns:
      live.mtp_chain = mtp_chain(row, self.engine.engine_cfg.draft_tokens)

  def _outlasted(self, steps: int) -> bool:
    """Whether the cost policy's batch pause lasts `steps` more steps, or is a pause for
    drafting that could never pay: a request that ends within it, or that would draft only
    to be priced again, native MTP detaches (`Engine.detach`), so its steps and prefill cost
    what they cost with MTP off and no catch-up is owed; the probe after a hopeless pause
    drafts with requests that come after it. Only without host drafting, whose drafts do not
    wait for the pause."""
    paused = self.batch_paused_steps
    return (self.native_mtp and self.drafter is None and paused > 0
            and (paused >= steps or self.verdict.hopeless > 0))

  def _detach_outlasted(self) -> None:
    if not self.batch_paused_steps:
      return
    max_len = self.engine.engine_cfg.max_len
    for index, live in enumerate(self.slots):
      if live is not None and not live.detached and self._outlasted(live.tokens_left(max_len)):
        live.detached = True
        self.state = self.engine.detach(self.state, index)

  def _drafts(self, live: LiveRequest) -> bool:
    """Whether a slot uses its draft at the next step (neither it nor the batch is paused, and
    it is not detached)."""
    return live.drafting and not live.detached and self.batch_paused_steps == 0

  def _price_drafting(self, drafted: bool, steps: int = 1) -> None:
    """The batch-level cost policy of `AdaptiveDrafting` (see there), after a drafting step or
    `steps` plain ones."""
    policy = self.adaptive
    if not self.cost_aware:
      return
    cost, verdict = self.cost, self.verdict
    if not drafted:
      verdict.paused_steps = max(0, verdict.paused_steps - steps)
      return
    verdict.drafting_steps += steps
    # Resuming after a pause for not paying, `probe_steps` drafting steps re-price drafting
    # (the rest of the prices are recent): a full window each time would cost more than the
    # pause saves where drafting keeps not paying.
    if verdict.drafting_steps < (policy.window if verdict.backoff == 1 else
                                 min(policy.probe_steps, policy.window)):
      return
    verdict.drafting_steps = 0
    if not cost.priced(policy.probe_steps):
      verdict.paused_steps = policy.probe_steps
      return
    cap = self.window_cap
    pause = policy.pause(verdict.backoff)[0]
    gain = verdict.cap_gain[cap] = cost.drafting_gain(pause)
    hopeless, verdict.hopeless = verdict.hopeless, 0
    if gain >= policy.required_gain:
      verdict.backoff = 1
      if cap < self.window.max and verdict.cap_gain.get(cap + 1, gain + 1.0) > gain:
        self._set_window_cap(cap + 1)
    elif cap > self.window.min:
      self._set_window_cap(cap - 1)
    elif cost.drafting_gain(policy.hopeless_pause, accepted=cap) < policy.required_gain:
      verdict.paused_steps = policy.hopeless_pause << min(hopeless, policy.hopeless_doublings)
      verdict.backoff, verdict.hopeless = policy.max_backoff, hopeless + 1
    else:
      verdict.paused_steps, verdict.backoff = policy.pause(verdict.backoff)

  def _set_window_cap(self, cap: int) -> None:
    self.window_cap = cap
    self.cost.reprice_drafting()

  def _account_draft(self, live: LiveRequest, window: int, accepted: int, info: dict) -> None:
    """Count a verified window of drafts (`window` 0: none) and apply the adaptive policy to
    the slot. A paused slot's pause counts down every step; drafts it verified meanwhile count
    in the statistics but not towards its own accept-rate window or its draft window."""
    c = live.counts
    c["proposal_us"] += info.get("proposal_compute_us", 0)
    c["verification_us"] += info.get("verification_compute_us", 0)
    paused = not live.drafting
    if paused:
      live.paused_steps -= 1
    if not window:
      return
    c["drafted"] += window
    c["accepted"] += accepted
    c["rejected"] += window - accepted
    for position in range(window):
      live.verified_at[position] += 1
      live.accepted_at[position] += position < accepted
    self.cost.observe_draft(accepted)
    if paused:
      return
    if live.proposed is not None and live.proposed.mtp_count:
      # A composite's MTP window and pauses follow its MTP part (the tail backs off itself).
      window, accepted = live.proposed.mtp_count, min(accepted, live.proposed.mtp_count)
    self._adapt_window(live, window, accepted)
    policy = self.adaptive
    if policy is None:
      return
    live.recent.append(accepted / window)
    if len(live.recent) > policy.window:
      live.recent.popleft()
    if len(live.recent) < policy.window:
      return
    if sum(live.recent) >= policy.min_accept_rate * policy.window:
      live.backoff = 1
      return
    live.paused_steps, live.backoff = policy.pause(live.backoff)
    live.recent.clear()

  def _adapt_window(self, live: LiveRequest, window: int, accepted: int) -> None:
    """An adaptive window grows by one after a fully accepted window and shrinks by one when
    its first draft is rejected, within the `DraftWindow` bounds."""
    if not self.window.adaptive:
      return
    if accepted == window == live.window:
      live.window = min(live.window + 1, self.window.max)
    elif accepted == 0:
      live.window = max(live.window - 1, self.window.min)

  def run(self, requests: Iterable[Request]) -> list[Result]:
    """Generate every request to completion; results in request order."""
    results: dict[int, Result] = {}
    for i, request in enumerate(requests):
      self.submit(request, lambda r, i=i: results.__setitem__(i, r))
    while self.busy:
      self.step()
    return [results[i] for i in range(len(results))]
