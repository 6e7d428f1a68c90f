"""Overlapped steps: the scheduler launches the next step before handing out the last one's
tokens when the engine allows it (MTP off, one process).

The same requests (greedy and sampled, stop ids, a cancel, more requests than slots, a pool of
pages that makes requests wait) served with steps overlapped and collected one by one give the
same tokens and finish reasons, and greedy ones equal the argmax of a full forward. The
recorded calls show the overlap itself, that a request at its token budget is never launched
again, and that the pool ends with every page free.
"""

import tempfile
from pathlib import Path

import numpy as np
from absl.testing import absltest

import mtpjax
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.scheduler import Request, SlotScheduler
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
    self.scheduler: SlotScheduler | None = None

  def __getattr__(self, name):
    return getattr(self.engine, name)

  def launch(self, state, active, *args, **kwargs):
    number = sum(kind == "launch" for kind, _ in self.events)
    self.events.append(("launch", number))
    for slot in np.flatnonzero(active):
      request = self.scheduler.slots[slot].request
      self.rows[id(request)] = self.rows.get(id(request), 0) + 1
    state, pending = self.engine.launch(state, active, *args, **kwargs)

    def collect():
      self.events.append(("collect", number))
      return pending.collect()
    return state, type(pending)(collect)


class OverlappedStepsTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory(prefix="overlapped_steps_test.")
    path = write_tiny_glm_gguf(Path(cls.tmp.name) / "tiny.gguf", TinyGlmSpec(seed=3))[0]
    cls.model = mtpjax.load(str(path))
    cls.engine = cls.model.engine(native_mtp=False, slots=SLOTS, max_len=MAX_LEN,
                                  prefill_buckets=(16,), kv_pages=POOL)
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
    first = cls.serve(True)[0]
    cls.stops_at = {}
    for i, start in ((1, 3), (4, 1)):
      tokens = first[i].tokens
      j = next(j for j in range(start, len(tokens) - 1) if tokens[j] not in tokens[:j])
      cls.requests[i].stop_ids = frozenset({tokens[j]})
      cls.stops_at[i] = j
    seen = []
    cls.requests[2].on_tokens = seen.extend
    cls.requests[2].cancelled = lambda: len(seen) >= 5
    cls.overlapped, cls.recorded = cls.serve(True)
    seen.clear()
    cls.collected, cls.one_by_one = cls.serve(False)

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  @classmethod
  def serve(cls, overlapping: bool):
    engine = RecordingEngine(cls.engine, overlapping)
    engine.scheduler = SlotScheduler(engine)
    results = engine.scheduler.run(cls.requests)
    pages = engine.scheduler.state.pages
    assert (pages.free_pages, pages.reserved) == (POOL, 0), "pages left held"
    return results, engine

  def test_the_engine_overlaps_steps_with_mtp_off_only(self):
    self.assertTrue(self.engine.overlapping)
    self.assertFalse(self.model.engine(native_mtp=True, slots=SLOTS, max_len=MAX_LEN,
                                       prefill_buckets=(16,)).overlapping)

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
    for i, (request, result) in enumerate(zip(self.requests, self.overlapped)):
      if request.sampler.temperature:
        continue
      sequence = np.concatenate([request.prompt, result.tokens[:-1]])
      reference = np.argmax(self.model.logits(sequence), axis=-1)[len(request.prompt) - 1:]
      self.assertEqual(result.tokens, reference.tolist(), f"request {i}")

  def test_a_request_at_its_budget_is_not_launched_again(self):
    for i, (request, result) in enumerate(zip(self.requests, self.overlapped)):
      rows = self.recorded.rows[id(request)]
      # The prefill makes the first token and each step one more; a request that stopped
      # (a stop id, the cancel) may have had one more step launched before it was seen.
      wasted = {"length": 0, "stop": 1, "cancelled": 1}[result.finish_reason]
      self.assertBetween(rows - (len(result.tokens) - 1), 0, wasted, f"request {i}")
      self.assertEqual(self.one_by_one.rows[id(request)], len(result.tokens) - 1)


if __name__ == "__main__":
  absltest.main()
