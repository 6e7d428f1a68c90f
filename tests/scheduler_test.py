"""Tests for mtpjax.engine.scheduler: continuous batching, MTP on vs off, stops, budgets, stats.

The reference for every request is the same request served alone with MTP off. The counters are
checked against identities and against a replay of the draft rule over the final output, with
drafts taken from a from-scratch MTP pass (`Model.mtp_logits`), not from the engine.
"""

import collections
import functools
import tempfile
import time
from pathlib import Path

import numpy as np
from absl.testing import absltest, parameterized

import mtpjax
from mtpjax import errors
from mtpjax.draft_window import DraftWindow
from mtpjax.engine.contract import warm_up
from mtpjax.engine import requests as requests_lib
from mtpjax.engine.drafting_policy import AdaptiveDrafting, DraftingCost
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.engine.sampling import SamplerParams
from mtpjax.telemetry import MtpStats
from mtpjax.testing.tiny_glm import TinyGlmSpec, write_tiny_glm_gguf

MAX_LEN = 64
SLOTS = 4
SAMPLED = dict(temperature=0.8, top_k=0, top_p=0.9)


@functools.cache
def tiny_model():
  """One generated model (MTP head copying the trunk) shared by every class in this file."""
  tmp = tempfile.TemporaryDirectory(prefix="scheduler_test.")
  path = write_tiny_glm_gguf(Path(tmp.name) / "tiny.gguf",
                             TinyGlmSpec(mtp_copies_trunk=True, seed=7))[0]
  return mtpjax.load(str(path)), tmp


def engine(native_mtp: bool, slots: int = SLOTS, decode_steps: int = 1):
  """Cached by the model, so every class reuses the same compiled steps."""
  return tiny_model()[0].engine(native_mtp=native_mtp, slots=slots, max_len=MAX_LEN,
                                prefill_buckets=(16,), decode_steps=decode_steps)


def serve(native_mtp: bool, requests, slots: int = SLOTS, adaptive=None, decode_steps: int = 1):
  """Without an adaptive policy every step drafts, so the counters follow the plain rule."""
  scheduler = SlotScheduler(engine(native_mtp, slots, decode_steps), adaptive=adaptive)
  return scheduler.run(requests), scheduler


def replay_counts(model, prompt, tokens) -> dict:
  """The counters the docs/DECODE.md §3 rule implies for `tokens`, drafts from a scratch MTP pass."""
  committed = list(prompt) + list(tokens)
  padded = np.zeros(MAX_LEN, np.int32)
  padded[:len(committed)] = committed
  drafts = model.mtp_logits(padded).argmax(-1)    # row q drafts position q + 1; causal rows
  pos, emitted, accepted, rejected = len(prompt), 1, 0, 0
  while emitted < len(tokens):
    if committed[pos + 1] == drafts[pos]:
      accepted, pos, emitted = accepted + 1, pos + 2, emitted + 2
    else:
      rejected, pos, emitted = rejected + 1, pos + 1, emitted + 1
  passes = 1 + accepted + rejected
  return dict(accepted=accepted, rejected=rejected, target_passes=passes, drafted=passes,
              committed_tokens=passes + accepted)


class ContinuousBatchingTest(absltest.TestCase):
  """24 prompts, each greedy and sampled, served 4 at a time with MTP on and off, and alone."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = tiny_model()[0]
    rng = np.random.default_rng(0)
    cls.requests = []
    for i in range(24):
      length = 15 if i == 5 else int(rng.integers(1, 16))   # prompt 5 reaches max_len
      budget = 60 if i == 5 else int(rng.integers(3, 30))
      prompt = rng.integers(0, 502, size=length).astype(np.int32)
      cls.requests.append(Request(prompt=prompt, max_new_tokens=budget))
      cls.requests.append(Request(prompt=prompt, max_new_tokens=budget,
                                  sampler=SamplerParams(**SAMPLED, seed=i)))
    cls.on, cls.on_scheduler = serve(True, cls.requests)
    cls.adaptive, _ = serve(True, cls.requests,
                            adaptive=AdaptiveDrafting(window=4, min_accept_rate=0.9, cooldown=3))
    cls.off, _ = serve(False, cls.requests)
    # Bursts of 4 drafting steps a dispatch (2 slots: the cost tests' engine).
    cls.bursts, _ = serve(True, cls.requests, slots=2, decode_steps=4)
    cls.alone = [serve(False, [r], slots=1)[0][0] for r in cls.requests]

  def test_mtp_on_equals_mtp_off(self):
    for i, (on, off) in enumerate(zip(self.on, self.off)):
      self.assertEqual(on.tokens, off.tokens, f"request {i}")
      self.assertEqual(on.finish_reason, off.finish_reason, f"request {i}")

  def test_bursts_of_drafting_steps_equal_single_steps(self):
    for i, (burst, on) in enumerate(zip(self.bursts, self.on)):
      self.assertEqual(burst.tokens, on.tokens, f"request {i}")
      self.assertEqual(burst.finish_reason, on.finish_reason, f"request {i}")
      self.assertEqual(burst.stats, on.stats, f"request {i}")

  def test_adaptive_drafting_keeps_outputs_and_counters_consistent(self):
    paused = 0
    for i, (adaptive, off) in enumerate(zip(self.adaptive, self.off)):
      self.assertEqual(adaptive.tokens, off.tokens, f"request {i}")
      s = adaptive.stats
      self.assertLessEqual(s.verifications, s.target_passes - 1, f"request {i}")
      self.assertEqual(s.committed_tokens, s.target_passes + s.accepted, f"request {i}")
      self.assertEqual(s.drafted, s.verifications + s.pending, f"request {i}")
      self.assertIn(s.pending, (0, 1))
      paused += s.verifications < s.target_passes - 1
    self.assertGreater(paused, 0)    # the strict policy paused some slots

  def test_batching_does_not_change_outputs(self):
    self.assertEqual(max(self.on_scheduler.occupancy_samples), 1.0)   # all 4 slots were busy
    for i, (batched, alone) in enumerate(zip(self.off, self.alone)):
      self.assertEqual(batched.tokens, alone.tokens, f"request {i}")
      self.assertEqual(batched.finish_reason, alone.finish_reason, f"request {i}")

  def test_budgets_and_context_limit(self):
    for i, (request, result) in enumerate(zip(self.requests, self.on)):
      if i // 2 == 5:
        self.assertEqual(len(result.tokens), MAX_LEN - 15)
      else:
        self.assertEqual(len(result.tokens), request.max_new_tokens)
      self.assertEqual(result.finish_reason, "length")

  def test_sampling_differs_from_greedy(self):
    differ = sum(g.tokens != s.tokens for g, s in zip(self.on[0::2], self.on[1::2]))
    self.assertGreater(differ, 18)

  def test_stats_identities(self):
    for i, (on, off) in enumerate(zip(self.on, self.off)):
      s = on.stats
      self.assertTrue(s.enabled)
      self.assertEqual(s.verifications, s.target_passes - 1, f"request {i}")
      self.assertEqual(s.committed_tokens, s.target_passes + s.accepted, f"request {i}")
      self.assertEqual(s.drafted, s.verifications + s.pending, f"request {i}")
      self.assertEqual(s.pending, 1)
      self.assertIn(s.committed_tokens - len(on.tokens), (0, 1))
      self.assertEqual(off.stats, MtpStats(target_passes=len(off.tokens),
                                           committed_tokens=len(off.tokens)))

  def test_stats_match_a_replay_of_the_drafts(self):
    for i, (request, result) in enumerate(zip(self.requests, self.on)):
      got = {k: getattr(result.stats, k) for k in ("accepted", "rejected", "target_passes",
                                                  "drafted", "committed_tokens")}
      self.assertEqual(got, replay_counts(self.model, request.prompt, result.tokens),
                       f"request {i}")

  def test_accept_rate(self):
    greedy = MtpStats.total(r.stats for r in self.on[0::2])
    sampled = MtpStats.total(r.stats for r in self.on[1::2])
    self.assertGreater(greedy.accept_rate, 0.5)
    self.assertGreater(greedy.tokens_per_target_pass, 1.4)
    self.assertGreater(sampled.accepted, 0)    # both branches of the rule ran
    self.assertGreater(sampled.rejected, 0)


class StopAndBudgetTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    rng = np.random.default_rng(1)
    cls.prompts = [rng.integers(0, 502, size=int(rng.integers(2, 14))).astype(np.int32)
                   for _ in range(12)]
    requests = [Request(prompt=p, max_new_tokens=24) for p in cls.prompts]
    cls.ref = [r.tokens for r in serve(False, requests)[0]]
    cls.on_stats = [r.stats for r in serve(True, requests)[0]]

  def first_occurrence(self, *, odd: bool, all_accepted: bool) -> tuple[int, int]:
    """(prompt, j >= 3) with ref[j] seen first at j; odd j is a t_a when every draft is accepted."""
    for k, ref in enumerate(self.ref):
      if all_accepted and self.on_stats[k].rejected:
        continue
      for j in range(3, len(ref)):
        if ref.index(ref[j]) == j and (j % 2 == 1 or not odd):
          return k, j
    self.fail("no prompt has a suitable stop token")

  def run_one(self, native_mtp: bool, prompt_index: int, **kwargs):
    batches = []
    request = Request(prompt=self.prompts[prompt_index], on_tokens=batches.append, **kwargs)
    return serve(native_mtp, [request])[0][0], batches

  @parameterized.parameters(True, False)
  def test_stop_id_is_included_and_finishes_with_stop(self, native_mtp):
    k, j = self.first_occurrence(odd=False, all_accepted=False)
    result, batches = self.run_one(native_mtp, k, max_new_tokens=24,
                                   stop_ids=frozenset({self.ref[k][j]}))
    self.assertEqual(result.tokens, self.ref[k][:j + 1])
    self.assertEqual(result.finish_reason, "stop")
    self.assertEqual(sum(batches, []), result.tokens)

  @parameterized.parameters(True, False)
  def test_stop_at_the_first_token(self, native_mtp):
    result, _ = self.run_one(native_mtp, 0, max_new_tokens=24,
                             stop_ids=frozenset({self.ref[0][0]}))
    self.assertEqual(result.tokens, self.ref[0][:1])
    self.assertEqual(result.finish_reason, "stop")

  def test_accepted_pair_whose_first_token_stops_emits_only_it(self):
    k, j = self.first_occurrence(odd=True, all_accepted=True)
    result, batches = self.run_one(True, k, max_new_tokens=24,
                                   stop_ids=frozenset({self.ref[k][j]}))
    self.assertEqual(result.tokens, self.ref[k][:j + 1])
    self.assertEqual(result.finish_reason, "stop")
    self.assertEqual([len(b) for b in batches], [1] + [2] * ((j - 1) // 2) + [1])
    self.assertEqual(result.stats.rejected, 0)
    self.assertEqual(result.stats.committed_tokens, len(result.tokens) + 1)

  def test_budget_of_one_left_emits_one_token(self):
    k, _ = self.first_occurrence(odd=True, all_accepted=True)
    result, batches = self.run_one(True, k, max_new_tokens=4)
    self.assertEqual(result.tokens, self.ref[k][:4])
    self.assertEqual(result.finish_reason, "length")
    self.assertEqual([len(b) for b in batches], [1, 2, 1])
    self.assertEqual(result.stats.committed_tokens, 5)

  @parameterized.parameters(True, False)
  def test_budget_of_one_is_the_prefill_token(self, native_mtp):
    result, _ = self.run_one(native_mtp, 2, max_new_tokens=1)
    self.assertEqual(result.tokens, self.ref[2][:1])
    self.assertEqual(result.finish_reason, "length")
    self.assertEqual(result.stats.target_passes, 1)
    self.assertEqual(result.stats.verifications, 0)
    self.assertEqual(result.stats.drafted, 1 if native_mtp else 0)

  @parameterized.parameters(True, False)
  def test_cancelled_request_stops(self, native_mtp):
    seen = []
    request = Request(prompt=self.prompts[3], max_new_tokens=24, on_tokens=seen.extend,
                      cancelled=lambda: len(seen) >= 3)
    result = serve(native_mtp, [request])[0][0]
    self.assertEqual(result.finish_reason, "cancelled")
    self.assertBetween(len(result.tokens), 3, 4)
    self.assertEqual(result.tokens, self.ref[3][:len(result.tokens)])

  def test_zero_budget_is_rejected(self):
    scheduler = SlotScheduler(engine(True))
    with self.assertRaises(errors.MtpjaxError) as ctx:
      scheduler.submit(Request(prompt=self.prompts[0], max_new_tokens=0), lambda r: None)
    self.assertEqual(ctx.exception.field, "max_new_tokens")


class SlotPauseTest(absltest.TestCase):
  """Per-slot pauses: free drafts while another slot drafts, and the backoff of a poor slot."""

  def test_a_paused_slot_verifies_while_another_slot_drafts(self):
    rng = np.random.default_rng(9)
    requests = [Request(prompt=rng.integers(0, 502, size=5).astype(np.int32), max_new_tokens=24)
                for _ in range(2)]
    scheduler = SlotScheduler(engine(True, slots=2), adaptive=AdaptiveDrafting(cost_aware=False))
    done = {}
    for i, request in enumerate(requests):
      scheduler.submit(request, lambda r, i=i: done.__setitem__(i, r))
    scheduler.step()                                  # admit both, one drafting step
    first, second = scheduler.slots
    drafted = lambda: (first.counts["drafted"], second.counts["drafted"])
    passes = first.counts["target_passes"]
    first.paused_steps = 2
    before = drafted()
    scheduler.step()                                  # slot 1 drafts: slot 0's draft is free
    self.assertEqual(drafted(), (before[0] + 1, before[1] + 1))
    self.assertEqual(first.paused_steps, 1)
    second.paused_steps = 2
    before = drafted()
    scheduler.step()                  # both paused: a plain step, launched ahead (fixed)
    self.assertTrue(scheduler.in_flight.pending.fixed)
    self.assertEqual(first.counts["target_passes"], passes + 1)       # not landed yet
    scheduler.step()                  # decided on pauses a step old: plain again; one lands
    self.assertEqual(drafted(), before)
    self.assertEqual(first.counts["target_passes"], passes + 2)
    self.assertEqual((first.paused_steps, second.paused_steps), (0, 1))
    while scheduler.busy:
      scheduler.step()
      # The state keeps the lag on the host too: no read-back before drafting.
      state = scheduler.state
      np.testing.assert_array_equal(
          np.concatenate(state.mtp_lag),
          np.concatenate([np.asarray(g.head.slots.mtp_lag) for g in state.groups]))
    reference = [r.tokens for r in serve(False, requests, slots=2)[0]]
    self.assertEqual([done[0].tokens, done[1].tokens], reference)

  def test_a_failing_slot_backs_off_and_a_passing_window_resets_it(self):
    policy = AdaptiveDrafting(window=2, min_accept_rate=0.5, cooldown=3, max_backoff=4,
                              cost_aware=False)
    scheduler = SlotScheduler(engine(True), adaptive=policy)
    live = requests_lib.LiveRequest(
        request=Request(prompt=np.ones(1, np.int32), max_new_tokens=1), done=lambda r: None,
        started=0.0, verified_at=[0], accepted_at=[0])
    pauses = []
    outcomes = [False] * 8 + [True, True, False, False]
    for accepted in outcomes:
      scheduler._account_draft(live, 1, int(accepted), {})
      if not live.drafting:
        pauses.append(live.paused_steps)
        while not live.drafting:     # rejected drafts verified while paused do not count
          scheduler._account_draft(live, 1, 0, {})
    # 3, doubled up to cooldown x max_backoff = 12; after the passing window [T, T] the
    # window [T, F] still passes, [F, F] fails and pauses for 3 again.
    self.assertEqual(pauses, [3, 6, 12, 12, 3])
    self.assertEqual(live.counts["drafted"], len(outcomes) + sum(pauses))


class DraftWindowPolicyTest(absltest.TestCase):
  """Each slot's adaptive window, and the cost policy's cap on it (hand-computed prices)."""

  def test_a_window_grows_after_full_accepts_and_shrinks_after_a_first_rejection(self):
    scheduler = SlotScheduler(engine(True), adaptive=None)
    scheduler.window = DraftWindow(1, 2, 4, adaptive=True)   # bounds only: no step runs
    live = requests_lib.LiveRequest(
        request=Request(prompt=np.ones(1, np.int32), max_new_tokens=1), done=lambda r: None,
        started=0.0, window=2, verified_at=[0] * 4, accepted_at=[0] * 4)
    windows = []
    for accepted in (2, 3, 4, 4, 0, 1, 0, 0, 0):
      scheduler._account_draft(live, live.window, min(accepted, live.window), {})
      windows.append(live.window)
    self.assertEqual(windows, [3, 4, 4, 4, 3, 3, 2, 1, 1])
    self.assertEqual(live.verified_at, [9, 8, 6, 3])
    self.assertEqual(live.accepted_at, [5, 4, 3, 2])
    scheduler.window = DraftWindow.fixed(2)
    scheduler._account_draft(live, 2, 2, {})
    self.assertEqual(live.window, 1)                 # a fixed window never moves

  def test_the_cost_policy_lowers_the_cap_before_pausing(self):
    scheduler = SlotScheduler(engine(True), adaptive=AdaptiveDrafting(window=1, probe_steps=2))
    scheduler.window = DraftWindow(1, 3, 3)
    scheduler.costs = collections.defaultdict(DraftingCost)   # this test's prices alone
    cost = scheduler.cost
    scheduler.window_cap = 3
    price = lambda drafting_s, accepted, steps=3: (
        [cost.observe_step(True, drafting_s) for _ in range(steps)], cost.observe_draft(accepted))
    for _ in range(3):
      cost.observe_step(False, 1.0)
    price(3.0, 1)                       # (1 + 1) x 1 s / 3 s: pays 0.67, so a shallower cap
    scheduler._price_drafting(True)
    self.assertEqual((scheduler.window_cap, len(cost.seconds[True])), (2, 0))
    price(1.5, 1)                       # 2 / 1.5 pays; cap 3 was measured worse: stay
    scheduler._price_drafting(True)
    self.assertEqual((scheduler.window_cap, scheduler.batch_paused_steps), (2, 0))
    price(9.0, 0, steps=5)              # median 9 s, 1.5 tokens: down to the minimum ...
    scheduler._price_drafting(True)
    self.assertEqual(scheduler.window_cap, 1)
    price(1.5, 0)                       # ... where 1 token per 1.5 s pauses drafting
    scheduler._price_drafting(True)
    self.assertEqual((scheduler.window_cap, scheduler.batch_paused_steps), (1, 8))

  def test_drafting_that_could_never_pay_pauses_long_at_once(self):
    policy = AdaptiveDrafting(window=1, probe_steps=2, hopeless_pause=100)
    scheduler = SlotScheduler(engine(True), adaptive=policy)
    scheduler.costs = collections.defaultdict(DraftingCost)
    cost = scheduler.cost
    for _ in range(3):
      cost.observe_step(False, 1.0)
      cost.observe_step(True, 1.9)
    cost.observe_draft(0)
    scheduler._price_drafting(True)     # (1 + 0) x 1 s / 1.9 s, but 2 tokens would pay
    self.assertEqual((scheduler.batch_paused_steps, scheduler.verdict.backoff), (8, 2))
    scheduler.batch_paused_steps = 0
    for _ in range(5):
      cost.observe_step(True, 2.5)      # median 2.5 s: even (1 + 1) x 1 s / 2.5 s loses
    scheduler._price_drafting(True)
    self.assertEqual((scheduler.batch_paused_steps, scheduler.verdict.backoff),
                     (100, policy.max_backoff))
    for _ in range(10):
      scheduler._price_drafting(False)
    self.assertEqual(scheduler.batch_paused_steps, 90)
    # Each probe that finds the same doubles the next pause, up to 2**4 times.
    pauses = []
    for _ in range(6):
      scheduler.batch_paused_steps = 0
      scheduler._price_drafting(True)
      pauses.append(scheduler.batch_paused_steps)
    self.assertEqual(pauses, [200, 400, 800, 1600, 1600, 1600])
    cost.observe_draft(1)
    for _ in range(16):
      cost.observe_step(True, 1.0)      # drafting pays again: the doubling starts over
    scheduler.batch_paused_steps = 0
    scheduler._price_drafting(True)
    self.assertEqual((scheduler.batch_paused_steps, scheduler.verdict.hopeless), (0, 0))

  def test_prices_and_verdicts_are_kept_per_slot_bucket(self):
    scheduler = SlotScheduler(engine(True, slots=4), adaptive=AdaptiveDrafting())
    scheduler.costs = collections.defaultdict(DraftingCost)
    scheduler.bucket = 4
    scheduler.batch_paused_steps = 7
    scheduler.bucket = 1
    self.assertEqual(scheduler.batch_paused_steps, 0)
    self.assertIsNot(scheduler.cost, scheduler.costs[4])
    self.assertEqual(scheduler.costs[4].verdict.paused_steps, 7)


class SlowStepEngine:
  """The real engine on a device where one kind of step costs `delay` seconds more: drafting
  steps (as on a compute-bound device, where verifying two rows costs two steps) or plain ones
  (as on a bandwidth-bound one, where a verify pass costs about one step)."""

  def __init__(self, engine, *, slow_drafting: bool, delay: float = 0.02):
    self.engine, self.slow_drafting, self.delay = engine, slow_drafting, delay
    self.engine_cfg = engine.engine_cfg
    self.bursts = 0         # launches of a decode burst

  def init_state(self):
    return self.engine.init_state()

  def prefill(self, prompt, sampler, *, state, logprobs=False, nextn=True):
    return self.engine.prefill(prompt, sampler, state=state, logprobs=logprobs, nextn=nextn)

  def start_prefill(self, prompt, sampler, *, state, logprobs=False, new_tokens=None,
                    nextn=True):
    return self.engine.start_prefill(prompt, sampler, state=state, logprobs=logprobs,
                                     new_tokens=new_tokens, nextn=nextn)

  def prefill_chunk(self, job):
    return self.engine.prefill_chunk(job)

  def drop_prefill(self, job):
    return self.engine.drop_prefill(job)

  def insert(self, prefix, state, slot):
    return self.engine.insert(prefix, state, slot)

  def detach(self, state, slot):
    return self.engine.detach(state, slot)

  @property
  def overlapping(self):
    return self.engine.overlapping

  @property
  def decode_burst(self):
    return self.engine.decode_burst

  def launch(self, state, active, drafting, *, drafts=None, logprobs=False, decode_steps=1):
    if bool(np.asarray(drafting)[np.asarray(active)].any()) == self.slow_drafting:
      time.sleep(self.delay)
    self.bursts += decode_steps > 1
    return self.engine.launch(state, active, drafting, drafts=drafts, logprobs=logprobs,
                              decode_steps=decode_steps)

  def free(self, state, slot):
    return self.engine.free(state, slot)


class CostAwareDraftingTest(parameterized.TestCase):
  """The batch-level policy drafts only while drafting beats plain steps in wall time."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    rng = np.random.default_rng(4)
    cls.requests = [Request(prompt=rng.integers(0, 502, size=6).astype(np.int32),
                            max_new_tokens=48) for _ in range(2)]
    cls.reference = [r.tokens for r in serve(False, cls.requests, slots=2)[0]]
    for decode_steps in (1, 4):   # no compile among the timed steps the policy prices
      warm_up(engine(True, slots=2, decode_steps=decode_steps))

  # Three plain samples: the price drops the slowest, so one host hiccup cannot flip it.
  POLICY = AdaptiveDrafting(window=4, probe_steps=3, cooldown=32)

  def run_on(self, slow_drafting: bool, decode_steps: int = 1):
    slow = SlowStepEngine(engine(True, slots=2, decode_steps=decode_steps),
                          slow_drafting=slow_drafting)
    scheduler = SlotScheduler(slow, adaptive=self.POLICY)
    results = scheduler.run(self.requests)
    self.assertEqual([r.tokens for r in results], self.reference)   # lossless either way
    self.assertEqual(slow.bursts > 0, decode_steps > 1 and slow_drafting)
    return MtpStats.total(r.stats for r in results)

  @parameterized.parameters(1, 4)
  def test_drafting_that_costs_more_than_it_gains_is_paused(self, decode_steps):
    stats = self.run_on(slow_drafting=True, decode_steps=decode_steps)
    # The head copies the trunk (accept rate ~1), yet 2 tokens per 20 ms step lose to 1 token
    # per ~1 ms step: a window, the probe, one more window, then a 32-step pause to the end,
    # in bursts of plain steps where the engine runs them (each step of a burst counts).
    self.assertGreater(stats.accept_rate, 0.9)
    self.assertEqual(stats.verifications, len(self.requests) * 2 * self.POLICY.window)
    self.assertLess(stats.verifications, 0.3 * stats.target_passes)

  def test_drafting_that_pays_keeps_going(self):
    stats = self.run_on(slow_drafting=False)
    # Only the probe's plain steps (per request) go without drafting, and the one after them
    # (decided while the last of them was still computing).
    self.assertGreaterEqual(stats.verifications, stats.target_passes
                            - len(self.requests) * (2 + self.POLICY.probe_steps))

  def test_prices_carry_over_to_the_next_scheduler(self):
    slow_plain = SlowStepEngine(engine(True, slots=2), slow_drafting=False)
    first = SlotScheduler(slow_plain, adaptive=self.POLICY)
    first.run(self.requests)
    self.assertLen(first.cost.catch_up_pass, 1)   # the one resume, after the probe
    second = SlotScheduler(slow_plain, adaptive=self.POLICY)
    self.assertIs(second.cost, first.cost)
    stats = MtpStats.total(r.stats for r in second.run(self.requests))
    # Already priced: no probe, every step after each prefill drafts.
    self.assertEqual(stats.verifications, stats.target_passes - len(self.requests))
    other = SlotScheduler(SlowStepEngine(engine(True, slots=2), slow_drafting=False))
    self.assertIsNot(other.cost, first.cost)     # prices belong to one engine

  def test_a_pause_carries_over_to_the_next_scheduler(self):
    slow = SlowStepEngine(engine(True, slots=2), slow_drafting=True)
    policy = AdaptiveDrafting(window=4, probe_steps=3, cooldown=64)
    first = SlotScheduler(slow, adaptive=policy)
    first_stats = MtpStats.total(r.stats for r in first.run(self.requests))
    left = first.batch_paused_steps
    # A window, the probe, one more window, then a 64-step pause that outlasts the requests.
    self.assertGreater(left, 16)
    second = SlotScheduler(slow, adaptive=policy)
    self.assertEqual(second.batch_paused_steps, left)     # no window of drafting to relearn it
    results = second.run(self.requests)
    self.assertEqual([r.tokens for r in results], self.reference)
    self.assertLess(MtpStats.total(r.stats for r in results).verifications,
                    first_stats.verifications)
    # The pause binds the cost policy only: a scheduler without it drafts at once.
    self.assertEqual(SlotScheduler(slow, adaptive=None).batch_paused_steps, 0)
    self.assertEqual(SlotScheduler(slow, adaptive=AdaptiveDrafting(cost_aware=False)
                                   ).batch_paused_steps, 0)

  def test_modes(self):
    self.assertIsNone(AdaptiveDrafting.from_mode("off"))
    self.assertFalse(AdaptiveDrafting.from_mode("accept_rate").cost_aware)
    self.assertEqual(AdaptiveDrafting.from_mode("cost"), AdaptiveDrafting())
    with self.assertRaisesRegex(errors.MtpjaxError, "engine.adaptive_drafting"):
      AdaptiveDrafting.from_mode("always")

  def test_the_verdict_by_hand(self):
    cost = DraftingCost()
    for _ in range(4):
      cost.observe_step(True, 2.0)
      cost.observe_step(False, 1.0)
    self.assertTrue(cost.priced(4))
    self.assertFalse(cost.priced(5))
    cost.observe_draft(True)
    cost.observe_draft(False)
    self.assertLess(cost.drafting_gain(8), 1.0)     # (1 + 0.5) x 1.0 s < 2.0 s
    cost.observe_draft(True)
    cost.observe_draft(True)
    self.assertLess(cost.drafting_gain(8), 1.0)     # (1 + 0.75) x 1.0 s < 2.0 s
    for _ in range(61):
      cost.observe_draft(True)                 # the window keeps the last 64 drafts
    self.assertLess(cost.drafting_gain(8), 1.0)     # (1 + 63/64) x 1.0 s < 2.0 s
    cost.observe_draft(True)                   # the rejected draft leaves the window
    self.assertGreaterEqual(cost.drafting_gain(8), 1.0)      # (1 + 1) x 1.0 s >= 2.0 s

  def test_the_catch_up_is_charged_to_paused_steps(self):
    cost = DraftingCost()
    for _ in range(4):
      cost.observe_step(True, 1.5)
      cost.observe_step(False, 1.0)
    for accepted in (True, False, False, False):
      cost.observe_draft(accepted)
    self.assertLess(cost.drafting_gain(8), 1.0)    # (1 + 0.25) x 1.0 s < 1.5 s
    cost.observe_step(True, 1.5 + 2.4, caught_up_rows=8)   # resumed after 8 paused steps
    self.assertLen(cost.seconds[True], 4)      # not a drafting step's price
    self.assertAlmostEqual(cost.catch_up_pass[0], 2.4)     # 8 rows: one pass
    # (1 + 0.25) x (1.0 + 2.4 / 8) s >= 1.5 s
    self.assertGreaterEqual(cost.drafting_gain(8), 1.0)
    # A 64-step pause needs 4 passes of 16 rows: (1 + 0.25) x (1.0 + 4 x 2.4 / 64) s < 1.5 s
    self.assertLess(cost.drafting_gain(64), 1.0)
    cost.observe_step(True, 1.5 + 2.4, caught_up_rows=32)  # two passes
    self.assertAlmostEqual(cost.catch_up_pass[-1], 1.2)
    cost.observe_step(True, 1.0, caught_up_rows=4)         # faster than a drafting step
    self.assertEqual(cost.catch_up_pass[-1], 0.0)


if __name__ == "__main__":
  absltest.main()
