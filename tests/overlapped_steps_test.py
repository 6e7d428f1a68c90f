"""Overlapped steps: the scheduler launches the next step before handing out the last one's
tokens when the engine allows it (MTP off, one process); decode bursts (`decode_steps`) compute
several positions a launch.

The same requests (greedy and sampled, stop ids, a cancel, more requests than slots, a pool of
pages that makes requests wait) served with steps overlapped and collected one by one give the
same tokens and finish reasons, and greedy ones equal the argmax of a full forward. The
recorded calls show the overlap itself, that a request at its token budget is never launched
again, and that the pool ends with every page free. Bursts give the same tokens, finish reasons
and logprobs as single steps, write no row past a request's budget and never run while a
prompt is being prefilled.
"""

import dataclasses
import re
import tempfile
from pathlib import Path

import numpy as np
from absl.testing import absltest, parameterized

import mtpjax
from mtpjax import errors
from mtpjax.engine.contract import COUNT, burst_rows, committed_tokens
from mtpjax.engine.drafting_policy import AdaptiveDrafting
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.telemetry import MtpStats
from mtpjax.testing.tiny_glm import TinyGlmSpec, write_tiny_glm_gguf

MAX_LEN = 48
SLOTS = 2
POOL = 8               # pages of 16 rows: two requests of up to 64 rows each


class RecordingEngine:
  """The real engine, recording each launch (the slots' requests it computes) and collect;
  `overlapping` as given (False: the scheduler collects every step before the next)."""

  def __init__(self, engine, overlapping: bool):
    self.engine, self.overlapping = engine, overlapping
    self.events: list[tuple[str, int]] = []       # ("launch" | "collect", step number)
    self.rows: dict[int, int] = {}                # id(request) -> rows launched for it
    self.bursts: list[tuple[int, bool]] = []      # each launch's (decode_steps, prefilling)
    self.fixed: list[bool] = []                   # each launch's `PendingStep.fixed`
    self.scheduler: SlotScheduler | None = None

  def __getattr__(self, name):
    return getattr(self.engine, name)

  def launch(self, state, active, *args, **kwargs):
    number = sum(kind == "launch" for kind, _ in self.events)
    self.events.append(("launch", number))
    burst = kwargs.get("decode_steps", 1)
    self.bursts.append((burst, self.scheduler.prefilling is not None))
    for slot in np.flatnonzero(active):
      request = self.scheduler.slots[slot].request
      self.rows[id(request)] = self.rows.get(id(request), 0) + burst
    state, pending = self.engine.launch(state, active, *args, **kwargs)
    self.fixed.append(pending.fixed)

    def collect():
      self.events.append(("collect", number))
      return pending.collect()
    return state, dataclasses.replace(pending, collect=collect)


class TinyModelTest(parameterized.TestCase):
  """A tiny model for the class, and its requests served through a `RecordingEngine`."""
  requests: list[Request]

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory(prefix="overlapped_steps_test.")
    path = write_tiny_glm_gguf(Path(cls.tmp.name) / "tiny.gguf", TinyGlmSpec(seed=3))[0]
    cls.model = mtpjax.load(str(path))

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  @classmethod
  def serve_on(cls, engine, overlapping: bool = True, **scheduler_kwargs):
    """The class's requests served on `engine`: (results, the recording); every page is free
    after."""
    recording = RecordingEngine(engine, overlapping)
    recording.scheduler = SlotScheduler(recording, **scheduler_kwargs)
    results = recording.scheduler.run(cls.requests)
    pages = recording.scheduler.state.pages
    assert (pages.free_pages, pages.reserved) == (POOL, 0), "pages left held"
    return results, recording

  def assert_greedy_argmax(self, results):
    """Each greedy request's tokens are the argmax of a full forward over its sequence."""
    for i, (request, result) in enumerate(zip(self.requests, results)):
      if request.sampler.temperature:
        continue
      sequence = np.concatenate([request.prompt, result.tokens[:-1]])
      reference = np.argmax(self.model.logits(sequence), axis=-1)[len(request.prompt) - 1:]
      self.assertEqual(result.tokens, reference.tolist(), f"request {i}")


class OverlappedStepsTest(TinyModelTest):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # Single steps and no prefix cache: the recording counts each step's rows, and every
    # page is free after.
    cls.engine = cls.model.engine(native_mtp=False, slots=SLOTS, max_len=MAX_LEN,
                                  prefill_buckets=(16,), kv_pages=POOL, decode_steps=1,
                                  prefix_cache=0)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 512, size=int(n)).astype(np.int32)
               for n in rng.integers(2, 20, size=7)]
    # Budgets ending on a page boundary (prompt + budget = 32) and past it; the context end.
    budgets = [32 - len(prompts[0]), 9, 14, 5, 11, MAX_LEN, 7]
    cls.requests = [Request(prompt=p, max_new_tokens=b,
                            sampler=SamplerParams(temperature=0.9 * (i % 2), top_p=0.9, seed=i))
                    for i, (p, b) in enumerate(zip(prompts, budgets))]
    # Stop ids from a first run: request 1 stops at its 4th token or later, request 4 at its
    # 2nd or later (a token's first occurrence there).
    first = cls.serve_on(cls.engine)[0]
    cls.stops_at = {}
    for i, start in ((1, 3), (4, 1)):
      tokens = first[i].tokens
      j = next(j for j in range(start, len(tokens) - 1) if tokens[j] not in tokens[:j])
      cls.requests[i].stop_ids = frozenset({tokens[j]})
      cls.stops_at[i] = j
    seen = []
    cls.requests[2].on_tokens = seen.extend
    cls.requests[2].cancelled = lambda: len(seen) >= 5
    cls.overlapped, cls.recorded = cls.serve_on(cls.engine)
    seen.clear()
    cls.collected, cls.one_by_one = cls.serve_on(cls.engine, overlapping=False)

  def test_the_engine_overlaps_steps_unless_the_host_drafts(self):
    self.assertTrue(self.engine.overlapping)
    # Native MTP's fixed steps (while no slot drafts) overlap: its drafts stay on the device.
    self.assertTrue(self.model.engine(native_mtp=True, slots=SLOTS, max_len=MAX_LEN,
                                      prefill_buckets=(16,)).overlapping)
    self.assertFalse(self.model.engine(native_mtp=False, host_drafts=True, slots=SLOTS,
                                       max_len=MAX_LEN, prefill_buckets=(16,)).overlapping)

  def test_steps_are_launched_before_the_last_one_is_collected(self):
    events = self.recorded.events
    launches = [n for kind, n in events if kind == "launch"]
    self.assertEqual(sorted(n for kind, n in events if kind == "collect"), launches)
    in_flight, deepest = set(), 0
    for kind, number in events:
      if kind == "launch":
        in_flight.add(number)
      else:
        in_flight.remove(number)
      deepest = max(deepest, len(in_flight))
    self.assertEqual(deepest, 2)
    steps = len(self.one_by_one.events) // 2
    self.assertEqual(self.one_by_one.events,
                     [(kind, n) for n in range(steps) for kind in ("launch", "collect")])

  def test_outputs_equal_steps_collected_one_by_one(self):
    for i, (over, one) in enumerate(zip(self.overlapped, self.collected)):
      self.assertEqual(over.tokens, one.tokens, f"request {i}")
      self.assertEqual(over.finish_reason, one.finish_reason, f"request {i}")
    reasons = [r.finish_reason for r in self.overlapped]
    self.assertEqual(reasons, ["length", "stop", "cancelled", "length", "stop", "length",
                               "length"])
    for i, j in self.stops_at.items():
      self.assertLen(self.overlapped[i].tokens, j + 1)
    self.assertLen(self.overlapped[2].tokens, 5)
    self.assertLen(self.overlapped[5].tokens, MAX_LEN - len(self.requests[5].prompt))

  def test_greedy_outputs_are_a_full_forwards_argmax(self):
    self.assert_greedy_argmax(self.overlapped)

  def test_a_request_at_its_budget_is_not_launched_again(self):
    for i, (request, result) in enumerate(zip(self.requests, self.overlapped)):
      rows = self.recorded.rows[id(request)]
      # The prefill makes the first token and each step one more; a request that stopped
      # (a stop id, the cancel) may have had one more step launched before it was seen.
      wasted = {"length": 0, "stop": 1, "cancelled": 1}[result.finish_reason]
      self.assertBetween(rows - (len(result.tokens) - 1), 0, wasted, f"request {i}")
      self.assertEqual(self.one_by_one.rows[id(request)], len(result.tokens) - 1)


def _program(engine, kind: str) -> tuple[int, float, float]:
  """A one-slot step's compiled program, by what it computes: (instructions, flops, bytes
  accessed) as XLA counts them."""
  state = engine.init_state()
  group = state.groups[0]
  active = np.ones(1, bool)
  fns = engine._draft_steps[1] if kind == "verify_draft" else engine._steps[kind]
  compiled = fns[0].lower(engine._leaves[0], None, state.kv[0], state.pages.table[:1],
                          group.head if kind == "decode" else state.joined(group), active,
                          active.astype(np.int32) if engine.engine_cfg.drafts else None,
                          None, np.bool_(False)).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost    # a list of one on older jax
  instructions = len(re.findall(r"\n\s+\S+ = ", compiled.as_text()))
  return instructions, cost["flops"], cost["bytes accessed"]


class PausedDraftingTest(TinyModelTest):
  """Native MTP while no slot drafts: the step computes what MTP off's does (the NextN block
  does not run; only the row's MTP inputs are recorded) and is launched before the last one
  is collected, as MTP off's are; drafting resumed after pauses still gives MTP off's
  tokens. References: MTP off's compiled step and outputs."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    settings = dict(slots=SLOTS, max_len=MAX_LEN, prefill_buckets=(16,), kv_pages=POOL,
                    decode_steps=1, prefix_cache=0)
    cls.on = cls.model.engine(native_mtp=True, **settings)
    cls.off = cls.model.engine(native_mtp=False, **settings)
    rng = np.random.default_rng(8)
    cls.requests = [Request(prompt=rng.integers(0, 512, size=int(n)).astype(np.int32),
                            max_new_tokens=b, sampler=SamplerParams(temperature=0.8 * (i % 2),
                                                                    seed=i))
                    for i, (n, b) in enumerate(zip((5, 12, 3, 9), (30, 14, 24, 9)))]
    # Every slot pauses for 3 steps after each 2 verified drafts (no accept rate passes).
    policy = AdaptiveDrafting(window=2, min_accept_rate=1.01, cooldown=3, max_backoff=1,
                              cost_aware=False)
    cls.results, cls.recorded = cls.serve_on(cls.on, cls.on.overlapping, adaptive=policy)
    cls.reference = cls.serve_on(cls.off)[0]

  def test_a_paused_step_computes_what_an_mtp_off_step_does(self):
    off = _program(self.off, "decode")
    # Over detached slots alone: MTP off's very program.
    self.assertEqual(_program(self.on, "decode"), off)
    # While drafting is paused: that program and the record of a row's MTP inputs.
    paused = _program(self.on, "plain")
    for measure, (ours, reference) in zip(("instructions", "flops", "bytes"), zip(paused, off)):
      self.assertBetween(ours, reference, 1.05 * reference, measure)
    self.assertGreater(_program(self.on, "verify_draft")[1], 1.3 * off[1])

  def test_paused_steps_overlap_and_outputs_equal_mtp_off(self):
    self.assertEqual([r.tokens for r in self.results], [r.tokens for r in self.reference])
    self.assertEqual([r.finish_reason for r in self.results],
                     [r.finish_reason for r in self.reference])
    stats = MtpStats.total(r.stats for r in self.results)
    self.assertBetween(stats.verifications, 1, stats.target_passes - 10)   # both kinds ran
    # A step is launched while another computes only after a fixed one, and that happened.
    in_flight, overlapped = set(), 0
    for kind, number in self.recorded.events:
      if kind == "collect":
        in_flight.remove(number)
        continue
      self.assertTrue(all(self.recorded.fixed[n] for n in in_flight), f"step {number}")
      overlapped += bool(in_flight)
      in_flight.add(number)
    self.assertGreater(overlapped, 5)
    self.assertGreater(self.recorded.scheduler.overlap_fraction, 0.0)


BURST = 4


class DecodeBurstTest(TinyModelTest):
  """The same requests through an engine of single steps and one of bursts of BURST."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    settings = dict(native_mtp=False, slots=SLOTS, max_len=MAX_LEN, prefill_buckets=(16,),
                    kv_pages=POOL, logprobs=3, prefix_cache=0)
    cls.single = cls.model.engine(decode_steps=1, **settings)
    cls.burst = cls.model.engine(decode_steps=BURST, **settings)
    rng = np.random.default_rng(11)
    # The 40-token prompt is prefilled in three chunks, beside the request before it.
    lengths = [3, 9, 5, 2, 40, 12]
    prompts = [rng.integers(0, 512, size=n).astype(np.int32) for n in lengths]
    # Budgets below, at and between bursts, and the context end.
    budgets = [13, 2, 5, MAX_LEN, 8, 10]
    cls.requests = [Request(prompt=p, max_new_tokens=b, logprobs=i % 2 == 0,
                            sampler=SamplerParams(temperature=0.8 * (i % 3 > 0), top_k=20 * (i % 2),
                                                  seed=i))
                    for i, (p, b) in enumerate(zip(prompts, budgets))]
    first, _ = cls.serve_on(cls.single)
    tokens = first[0].tokens          # request 0 stops at its 7th token or later
    j = next(j for j in range(6, len(tokens) - 1) if tokens[j] not in tokens[:j])
    cls.requests[0].stop_ids = frozenset({tokens[j]})
    cls.stop_at = j
    cls.single_results, cls.single_recorded = cls.serve_on(cls.single)
    cls.burst_results, cls.burst_recorded = cls.serve_on(cls.burst)

  def test_bursts_give_the_tokens_of_single_steps(self):
    reasons = [r.finish_reason for r in self.burst_results]
    self.assertEqual(reasons, ["stop"] + ["length"] * 5)
    self.assertLen(self.burst_results[0].tokens, self.stop_at + 1)
    self.assertLen(self.burst_results[3].tokens, MAX_LEN - len(self.requests[3].prompt))
    for i, (one, burst) in enumerate(zip(self.single_results, self.burst_results)):
      self.assertEqual(burst.tokens, one.tokens, f"request {i}")
      self.assertEqual(burst.finish_reason, one.finish_reason, f"request {i}")
      if not self.requests[i].logprobs:
        self.assertIsNone(burst.logprobs)
        continue
      self.assertLen(burst.logprobs, len(burst.tokens))
      for a, b in zip(one.logprobs, burst.logprobs):
        self.assertEqual((a.token, [t for t, _ in a.top]), (b.token, [t for t, _ in b.top]))
        np.testing.assert_allclose([b.logprob] + [lp for _, lp in b.top],
                                   [a.logprob] + [lp for _, lp in a.top], atol=1e-5)

  def test_greedy_bursts_are_a_full_forwards_argmax(self):
    self.assert_greedy_argmax(self.burst_results)

  def test_bursts_run_but_never_past_a_budget_nor_beside_a_prefill(self):
    bursts = self.burst_recorded.bursts
    self.assertGreater(sum(n == BURST for n, _ in bursts), len(bursts) // 3)
    self.assertTrue(any(prefilling for _, prefilling in bursts), "no step beside a prefill")
    self.assertEqual({n for n, prefilling in bursts if prefilling}, {1})
    self.assertEqual({n for n, _ in self.single_recorded.bursts}, {1})
    for i, (request, result) in enumerate(zip(self.requests, self.burst_results)):
      rows = self.burst_recorded.rows[id(request)]
      # A stop is seen when its burst lands: the rest of that burst and the one in flight
      # are wasted; a request at its budget never is.
      wasted = 2 * BURST - 1 if result.finish_reason == "stop" else 0
      self.assertBetween(rows - (len(result.tokens) - 1), 0, wasted, f"request {i}")
    self.assertEqual(self.burst.trace_counts["decode_burst"], len(self.burst.slot_buckets))

  def test_a_burst_is_its_single_steps(self):
    prompt = self.requests[1].prompt
    sampler = SamplerParams(temperature=0.7, seed=5)
    outputs = []
    for steps in ([BURST], [1] * BURST):
      state = self.burst.init_state()
      state = self.burst.insert(self.burst.prefill(prompt, sampler, state=state), state, 1)
      active = np.array([False, True])
      tokens = []
      for n in steps:
        state, result, _ = self.burst.step(state, active, decode_steps=n)
        self.assertEqual(result.shape, (SLOTS, 4 * BURST))   # a step's 4 columns a step
        for part in burst_rows(result[1], n, 4):
          tokens += committed_tokens(part)
      outputs.append((tokens, state.positions.tolist()))
    self.assertEqual(outputs[0], outputs[1])
    self.assertEqual(outputs[0][1], [0, len(prompt) + BURST])

  @parameterized.parameters(0, 33)
  def test_a_burst_out_of_range_is_refused(self, steps):
    with self.assertRaises(errors.MtpjaxError) as caught:
      self.model.engine(native_mtp=False, max_len=MAX_LEN, prefill_buckets=(16,),
                        decode_steps=steps)
    self.assertEqual(caught.exception.field, "engine.decode_steps")

  def test_only_the_engines_burst_is_taken(self):
    state = self.burst.init_state()
    with self.assertRaisesRegex(ValueError, "1 or 4 positions"):
      self.burst.step(state, np.array([True, False]), decode_steps=2)
    with self.assertRaisesRegex(ValueError, "one position"):
      self.single.step(self.single.init_state(), np.array([True, False]), decode_steps=BURST)

  def test_native_mtp_bursts_are_their_steps(self):
    # Native MTP: a burst of plain steps records each row's MTP inputs as plain steps do, so
    # the catch-up and the drafting steps after it see the same rows; a burst of drafting
    # steps verifies, accepts and drafts as its steps do one by one.
    native = self.model.engine(native_mtp=True, slots=SLOTS, max_len=MAX_LEN,
                               prefill_buckets=(16,), decode_steps=BURST)
    self.assertEqual(native.decode_burst, BURST)
    width = native.engine_cfg.step_width
    prompt = self.requests[2].prompt
    active, plain = np.array([True, False]), np.zeros(SLOTS, np.int32)
    drafting = np.full(SLOTS, 1, np.int32)
    outputs = []
    for n in (BURST, 1):
      state = native.init_state()
      state = native.insert(native.prefill(prompt, SamplerParams(), state=state), state, 0)
      rows, lags = [], []
      for windows in (plain, drafting):
        for _ in range(BURST // n):
          state, result, _ = native.step(state, active, windows, decode_steps=n)
          rows += burst_rows(result[0], n, width)
        lags.append(state.mtp_lag[0].tolist())
      outputs.append((rows, lags, state.positions.tolist(),
                      np.asarray(state.groups[0].head.slots.draft).tolist()))
    self.assertEqual(outputs[0], outputs[1])
    rows, lags, positions, _ = outputs[0]
    self.assertEqual(lags, [[BURST, 0], [0, 0]])
    self.assertEqual([r[COUNT] for r in rows[:BURST]], [1] * BURST)
    self.assertEqual(positions[0], len(prompt) + sum(r[COUNT] for r in rows))

  def test_a_host_drafting_engine_decodes_one_position_a_dispatch(self):
    host = self.model.engine(native_mtp=False, host_drafts=True, slots=SLOTS, max_len=MAX_LEN,
                             prefill_buckets=(16,), decode_steps=BURST)
    self.assertEqual((host.decode_burst, self.burst.decode_burst), (1, BURST))


if __name__ == "__main__":
  absltest.main()
