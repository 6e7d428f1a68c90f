"""Tests for detached slots: a request the cost policy's batch pause outlasts is prefilled
without the NextN block and steps without recording MTP inputs, as with MTP off.

The reference is the same requests served by the MTP-off engine; that the NextN pools were not
touched is read from the engine state (a step that donates them hands back new arrays).
"""

import collections

import numpy as np
from absl.testing import absltest

from mtpjax.engine.drafting_policy import AdaptiveDrafting, DraftingCost
from mtpjax.engine.page_pool import PageList, PagePool
from mtpjax.engine.prefix_cache import PrefixCache
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.telemetry import MtpStats

from scheduler_test import SAMPLED, SLOTS, engine, serve


def _requests(seed: int, budgets) -> list[Request]:
  rng = np.random.default_rng(seed)
  requests = []
  for i, budget in enumerate(budgets):
    prompt = rng.integers(0, 502, size=int(rng.integers(2, 14))).astype(np.int32)
    sampler = SamplerParams(**SAMPLED, seed=i) if i % 2 else SamplerParams()
    requests.append(Request(prompt=prompt, max_new_tokens=budget, sampler=sampler))
  return requests


def _paused_scheduler(steps: int) -> SlotScheduler:
  """A cost-aware scheduler on fresh prices whose batch pause lasts `steps` at every bucket."""
  scheduler = SlotScheduler(engine(True), adaptive=AdaptiveDrafting())
  scheduler.costs = collections.defaultdict(DraftingCost)
  for bucket in (1, 2, 4):
    scheduler.costs[bucket].verdict.paused_steps = steps
  return scheduler


class DetachedEngineTest(absltest.TestCase):

  def test_detached_prefill_and_steps_leave_the_nextn_pools_and_match_mtp_off(self):
    on, off = engine(True), engine(False)
    prompt = np.arange(3, 12, dtype=np.int32)
    tokens = {}
    for name, eng in (("on", on), ("off", off)):
      state = eng.init_state()
      pools = state.mtp
      for slot, sampler in enumerate((SamplerParams(), SamplerParams(**SAMPLED, seed=3))):
        prefix = eng.prefill(prompt, sampler, state=state, nextn=False)
        self.assertIs(state.mtp, pools)             # no NextN rows were written
        state = eng.insert(prefix, state, slot)
      active = np.array([True, True] + [False] * (SLOTS - 2))
      rows = [[int(np.asarray(prefix.current)[0])]]
      for _ in range(6):
        state, result, _ = eng.step(state, active, np.full(SLOTS, 1, np.int32)
                                    if eng.engine_cfg.native_mtp else None)
        rows.append(result[:2, 0].tolist())
        self.assertIs(state.mtp, pools)             # windows of detached slots are 0
      tokens[name] = rows
      if name == "on":
        np.testing.assert_array_equal(state.detached, active)
        state = eng.free(state, 0)
        self.assertFalse(state.detached[0])
    self.assertEqual(tokens["on"], tokens["off"])

  def test_an_attached_slot_records_and_drafts_beside_a_detached_one(self):
    eng = engine(True)
    state = eng.init_state()
    prompt = np.arange(5, 13, dtype=np.int32)
    state = eng.insert(eng.prefill(prompt, SamplerParams(), state=state), state, 0)
    state = eng.insert(eng.prefill(prompt, SamplerParams(), state=state, nextn=False), state, 1)
    active = np.array([True, True] + [False] * (SLOTS - 2))
    pools = state.mtp
    state, result, _ = eng.step(state, active, np.zeros(SLOTS, np.int32))
    self.assertIsNot(state.mtp, pools)              # a plain step records slot 0's inputs
    state, result, _ = eng.step(state, active, np.full(SLOTS, 1, np.int32))
    # The MTP head copies the trunk: the attached slot's draft is accepted, two tokens; the
    # detached one verifies none and commits the target's own.
    self.assertEqual(result[:2, 2].tolist(), [2, 1])
    self.assertEqual(result[0, 0], result[1, 0])    # the same prompt, the same next token


class DetachedSchedulerTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.requests = _requests(11, [20, 9, 30, 14, 6, 25])
    cls.off = serve(False, cls.requests)[0]

  def test_requests_the_pause_outlasts_never_draft_and_equal_mtp_off(self):
    scheduler = _paused_scheduler(1000)
    results = scheduler.run(self.requests)
    self.assertEqual([r.tokens for r in results], [r.tokens for r in self.off])
    self.assertEqual(MtpStats.total(r.stats for r in results).drafted, 0)

  def test_live_slots_detach_when_a_pause_comes_to_outlast_them(self):
    scheduler = _paused_scheduler(0)
    for request in self.requests[:SLOTS]:
      scheduler.submit(request, lambda result: None)
    for _ in range(3):
      scheduler.step()
    self.assertFalse(any(live.detached for live in scheduler.slots if live is not None))
    scheduler.batch_paused_steps = 16       # outlasts the requests with 16 or fewer tokens left
    scheduler.step()
    max_len = scheduler.engine.engine_cfg.max_len
    left = {i: live.tokens_left(max_len) + 1 for i, live in enumerate(scheduler.slots) if live}
    for index, live in enumerate(scheduler.slots):
      if live is not None:
        self.assertEqual(live.detached, left[index] <= 16, index)
        self.assertEqual(scheduler.state.detached[index], live.detached)

  def test_a_hopeless_pause_detaches_every_slot_however_short(self):
    scheduler = _paused_scheduler(0)
    for request in self.requests[:SLOTS]:
      scheduler.submit(request, lambda result: None)
    scheduler.step()
    self.assertFalse(any(live.detached for live in scheduler.slots if live is not None))
    scheduler.batch_paused_steps = 2        # outlasts none of them, but drafting could never
    scheduler.verdict.hopeless = 1          # pay: the probe after it needs no catch-up
    scheduler.step()
    live = [live for live in scheduler.slots if live is not None]
    self.assertTrue(live and all(slot.detached for slot in live))

  def test_outputs_hold_when_drafting_resumes_beside_detached_slots(self):
    scheduler = _paused_scheduler(12)       # of the first four, outlasts the 9-token one only
    results = {}
    for i, request in enumerate(self.requests):
      scheduler.submit(request, lambda result, i=i: results.__setitem__(i, result))
    while scheduler.busy:
      scheduler.step()
    self.assertEqual([results[i].tokens for i in range(len(self.requests))],
                     [r.tokens for r in self.off])
    self.assertEqual(results[1].stats.drafted, 0)   # admitted while the pause outlasted it
    self.assertGreater(results[2].stats.drafted, 0)   # the 30-token one drafted after it


class PrefixWithoutNextnRowsTest(absltest.TestCase):

  def test_only_prefills_without_nextn_rows_reuse_it_and_one_with_them_replaces_it(self):
    pool = PagePool(pages=6, page_rows=4, max_pages=4, slots=1)
    cache = PrefixCache(page=4, capacity=4, pool=pool)
    keys = [(8, b"prefix")]
    plain = PageList()
    pool.grow(plain, 8)
    cache.store(b"prefix", plain.pages, before=None, mtp_rows=False)
    self.assertEqual(cache.longest(keys), (0, None))
    self.assertEqual(cache.longest(keys, mtp_rows=False)[1][0], plain.pages)
    self.assertIsNone(cache.to_save(keys, 0, mtp_rows=False))
    self.assertEqual(cache.to_save(keys, 0), keys[0])
    full = PageList()
    pool.grow(full, 8)
    cache.store(b"prefix", full.pages, before=None)
    self.assertEqual(cache.longest(keys)[1][0], full.pages)
    pool.release(plain)
    pool.release(full)
    np.testing.assert_array_equal(pool.refs[plain.pages], 0)   # the replaced entry let go
    np.testing.assert_array_equal(pool.refs[full.pages], 1)


if __name__ == "__main__":
  absltest.main()
