"""Pipelined loading and decoding on 1, 2 and 4 simulated CPU devices.

The reference is the plain single-device `mtpjax.load`; every pipeline must give the same
logits (1e-5), hiddens, MTP logits and greedy tokens with MTP on and off, and each device must
hold exactly the tensors of its stage (counted independently from the GGUF with gguf-py).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools  # noqa: E402  (the device count must be set before jax loads)
import tempfile  # noqa: E402

from absl.testing import absltest
import gguf
import jax
import numpy as np

import mtpjax
from configs import glm as glm_config
from mtpjax import errors
from mtpjax.engine.contract import ACCEPTED
from mtpjax.engine.state import CATCH_UP_ROWS
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.api import load_pipelined
from mtpjax.engine.sampling import SamplerParams
from mtpjax.testing.tiny_glm import TinyGlmSpec, write_tiny_glm_gguf
from engine_test import slot_caches

SPEC = TinyGlmSpec(mtp_copies_trunk=True)     # 3 trunk layers + NextN: layer_count 4
PROMPT = [3, 17, 42, 99, 7, 250, 11]
NEW_TOKENS = 10
_TMP = tempfile.TemporaryDirectory()


@functools.cache
def gguf_path() -> str:
  path = os.path.join(_TMP.name, "tiny.gguf")
  write_tiny_glm_gguf(path, SPEC)
  return path


@functools.cache
def single_device():
  return mtpjax.load(gguf_path())


@functools.cache
def reference():
  """Single-device results every pipeline must reproduce."""
  model = single_device()
  return dict(
      logits=model.logits(PROMPT), hidden=model.hidden(PROMPT),
      mtp_logits=model.mtp_logits(PROMPT),
      on=model.generate(PROMPT, max_new_tokens=NEW_TOKENS, speculative="native-mtp-n1"),
      off=model.generate(PROMPT, max_new_tokens=NEW_TOKENS, speculative="disabled"),
      sampled=model.generate(PROMPT[:4], max_new_tokens=NEW_TOKENS, temperature=0.9, seed=5,
                             speculative="native-mtp-n1"),
      short=model.generate(PROMPT[2:], max_new_tokens=NEW_TOKENS,
                           speculative="native-mtp-n1"))


def expected_stage_bytes(layer_start: int, layer_end: int, *, last: bool, first: bool,
                         mtp: bool) -> int:
  """float32 bytes of the GGUF tensors a stage must hold, read with gguf-py."""
  total = 0
  for tensor in gguf.GGUFReader(gguf_path()).tensors:
    name = tensor.name
    if name.startswith("blk."):
      index = int(name.split(".")[1])
      take = layer_start <= index < layer_end and (index < SPEC.n_trunk_layers or mtp)
    elif name == "token_embd.weight":
      take = first or (last and mtp)       # the tiny NextN block has no embed_tokens of its own
    else:                                  # output_norm, output
      take = last
    total += 4 * int(tensor.n_elements) if take else 0
  return total


def device_bytes(stage_weights) -> dict:
  """Sum of addressable shard bytes per device over every stage's parameters."""
  out = {d: 0 for d in jax.devices()}
  for _, state in stage_weights:
    for leaf in jax.tree.leaves(state):
      for shard in leaf.addressable_shards:
        out[shard.device] += shard.data.nbytes
  return out


class _PipelineCase:
  """Tests every pipeline configuration runs; subclasses pick the stages (not collected)."""
  STAGES = 2
  SPLITS = None
  RANGES = None          # expected plan ranges over layer_count 4

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.ref = reference()
    cls.model = load_pipelined(gguf_path(), dtype="float32", stages=cls.STAGES,
                               splits=cls.SPLITS)

  def test_plan(self):
    ranges = [(r.layer_start, r.layer_end) for r in self.model.plan.ranges]
    self.assertEqual(ranges, self.RANGES)
    layouts = self.model.plan.layouts(self.model.config, with_mtp=True)
    self.assertTrue(layouts[0].embeddings and layouts[-1].output and layouts[-1].mtp)
    self.assertFalse(any(l.mtp or l.output for l in layouts[:-1]))

  def test_forwards_match_single_device(self):
    np.testing.assert_allclose(self.model.logits(PROMPT), self.ref["logits"], atol=1e-5)
    np.testing.assert_allclose(self.model.hidden(PROMPT), self.ref["hidden"], atol=1e-5)
    np.testing.assert_allclose(self.model.mtp_logits(PROMPT), self.ref["mtp_logits"], atol=1e-5)

  def test_greedy_tokens_match_with_mtp_on_and_off(self):
    on = self.model.generate(PROMPT, max_new_tokens=NEW_TOKENS, speculative="native-mtp-n1")
    off = self.model.generate(PROMPT, max_new_tokens=NEW_TOKENS, speculative="disabled")
    self.assertEqual(on.tokens, self.ref["on"].tokens)
    self.assertEqual(off.tokens, self.ref["off"].tokens)
    self.assertEqual(on.tokens, off.tokens)
    self.assertEqual(on.stats.accepted, self.ref["on"].stats.accepted)
    self.assertGreater(on.stats.accepted, 0)
    self.assertFalse(off.stats.native_mtp)

  def test_each_device_holds_only_its_stage(self):
    for mtp in (True, False):
      per_device = device_bytes(self.model.weights(with_mtp=mtp))
      expected = {d: 0 for d in jax.devices()}
      last = self.model.plan.stages - 1
      for s, (r, mesh) in enumerate(zip(self.model.plan.ranges, self.model.plan.meshes)):
        (device,) = mesh.devices.flat
        expected[device] = expected_stage_bytes(r.layer_start, r.layer_end, first=s == 0,
                                                last=s == last, mtp=mtp)
      self.assertEqual(per_device, expected)
      whole = expected_stage_bytes(0, 4, first=True, last=True, mtp=mtp)
      if self.STAGES > 1:
        self.assertLess(max(per_device.values()), whole)


class _PausedDraftingCase:
  """Paused drafting over stages (a plan of one stage is the single-device engine itself, and
  another split of two stages changes nothing on the last stage, where the catch-up runs)."""

  def test_paused_drafting_takes_plain_steps_and_catches_up(self):
    """Drafting, a pause longer than one catch-up pass, drafting again: every step, the
    drafts and the MTP cache rows the catch-up wrote equal the single-device engine's (whose
    paused steps engine_test checks against from-scratch passes)."""
    kwargs = dict(native_mtp=True, slots=2, max_len=64, prefill_buckets=(16,))
    engines = [self.model.engine(**kwargs), single_device().engine(**kwargs)]
    states = []
    for engine in engines:
      state = engine.init_state()
      for slot, prompt in enumerate((PROMPT, PROMPT[2:])):
        state = engine.insert(engine.prefill(np.asarray(prompt), SamplerParams(), state=state),
                              state, slot)
      states.append(state)
    active = np.ones(2, bool)
    pause = CATCH_UP_ROWS + 4            # two catch-up passes before drafting resumes
    schedule = [True] * 3 + [False] * pause + [True] * 4
    for i, drafting in enumerate(schedule):
      results = []
      for e, engine in enumerate(engines):
        states[e], result, _ = engine.step(states[e], active, np.full(2, drafting))
        results.append(result)
      np.testing.assert_array_equal(results[0], results[1], err_msg=f"step {i}")
      if not drafting:
        self.assertEqual(results[0][:, ACCEPTED].sum(), 0)
    self.assertFalse(any(lag.any() for lag in states[0].mtp_lag))   # all caught up
    # The MTP KV rows the catch-up wrote (a head that copies the trunk drafts the same tokens
    # without them, so the tokens alone would not show a missing pass).
    piped_head = jax.tree.map(lambda *groups: np.concatenate(groups),
                              *[group.head for group in states[0].groups])
    single = states[1].groups[0].head
    np.testing.assert_array_equal(piped_head.slots.pos, single.slots.pos)
    np.testing.assert_array_equal(piped_head.slots.draft, single.slots.draft)
    mtp = [slot_caches(state, pools=[state.mtp.kv])[0] for state in states]
    for slot, pos in enumerate(np.asarray(single.slots.pos)):
      for axis, (piped, alone) in zip((1, 2), zip(*mtp)):
        rows = lambda cache: np.take(np.asarray(cache)[slot], np.arange(pos + 1), axis=axis)
        np.testing.assert_allclose(rows(piped), rows(alone), atol=1e-5, err_msg=f"slot {slot}")
    self.assertGreater(results[0][:, ACCEPTED].sum(), 0)   # the caught-up head drafts
    counts = engines[0].trace_counts
    self.assertEqual((counts["plain"], counts["catch_up"]), (len(self.model.plan.ranges), 1))


class OneStageTest(_PipelineCase, absltest.TestCase):
  STAGES = 1
  RANGES = [(0, 4)]


class TwoStagesTest(_PipelineCase, _PausedDraftingCase, absltest.TestCase):
  STAGES = 2
  RANGES = [(0, 2), (2, 4)]

  def test_microbatched_slots_match_requests_alone(self):
    """4 slots in 2 microbatches; sampled and greedy requests keep their solo tokens."""
    engine = self.model.engine(native_mtp=True, slots=4, max_len=128)
    self.assertEqual(engine.bounds, [(0, 2), (2, 4)])
    requests = [
        Request(prompt=np.asarray(PROMPT), max_new_tokens=NEW_TOKENS),
        Request(prompt=np.asarray(PROMPT[:4]), max_new_tokens=NEW_TOKENS,
                sampler=SamplerParams(temperature=0.9, seed=5)),
        Request(prompt=np.asarray(PROMPT[2:]), max_new_tokens=NEW_TOKENS)]
    results = SlotScheduler(engine).run(requests)
    self.assertEqual([r.tokens for r in results],
                     [self.ref["on"].tokens, self.ref["sampled"].tokens,
                      self.ref["short"].tokens])

  def test_steps_update_the_stage_caches_in_place(self):
    """Drafting and plain steps donate each stage's KV cache and the last stage's MTP cache and
    history, as the single-device engine donates its state."""
    engine = self.model.engine(native_mtp=True, slots=4, max_len=128)
    state = engine.init_state()
    for drafting in (True, False):
      head = state.groups[0].head
      before = jax.tree.leaves([state.kv, head, state.mtp])
      state, _, _ = engine.step(state, np.zeros(4, bool), np.full(4, drafting))
      self.assertTrue(all(leaf.is_deleted() for leaf in before), f"drafting {drafting}")


class FourStagesTest(_PipelineCase, _PausedDraftingCase, absltest.TestCase):
  """3 trunk layers + NextN over 4 stages: the last stage holds only the NextN block."""
  STAGES = 4
  RANGES = [(0, 1), (1, 2), (2, 3), (3, 4)]


class ExplicitSplitTest(_PipelineCase, absltest.TestCase):
  """splits=(3,): with MTP off the last stage runs only the final norm and the head."""
  STAGES = 2
  SPLITS = (3,)
  RANGES = [(0, 3), (3, 4)]

  def test_last_stage_without_mtp_has_no_layers(self):
    layouts = self.model.plan.layouts(self.model.config, with_mtp=False)
    self.assertEqual((layouts[1].layer_start, layouts[1].layer_end, layouts[1].mtp), (3, 3, False))


class TensorAxisTest(absltest.TestCase):
  """2 stages x 2 tensor shards: the stage's heads/experts/vocab split over its two devices."""

  def test_logits_and_device_bytes(self):
    config = glm_config.get_config()
    config.mesh.stages = 2
    config.mesh.tensor = 2
    model = mtpjax.load(gguf_path(), config=config)
    np.testing.assert_allclose(model.logits(PROMPT), reference()["logits"], atol=1e-5)
    per_device = device_bytes(model.weights(with_mtp=False))
    for s, (r, mesh) in enumerate(zip(model.plan.ranges, model.plan.meshes)):
      stage_total = expected_stage_bytes(r.layer_start, r.layer_end, first=s == 0, last=s == 1,
                                         mtp=False)
      devices = list(mesh.devices.flat)
      self.assertLen(devices, 2)
      held = [per_device[d] for d in devices]
      # Split tensors are halved and replicated ones are copied: between half and all of it.
      self.assertTrue(all(stage_total / 2 < b < stage_total for b in held), (held, stage_total))
      self.assertEqual(held[0], held[1])


class MeshErrorsTest(absltest.TestCase):
  """Bad mesh configs fail with typed errors before any weight reaches a device."""

  def assert_nothing_loaded(self, error_type, code=None, **kwargs):
    before = len(jax.live_arrays())
    with self.assertRaises(error_type) as ctx:
      mtpjax.load(kwargs.pop("path", None) or gguf_path(), **kwargs)
    self.assertEqual(len(jax.live_arrays()), before)
    if code is not None:
      self.assertEqual(ctx.exception.code, code)
    self.assertIn("remedy", str(ctx.exception))
    return ctx.exception

  def test_more_stages_than_devices_is_checked_before_opening(self):
    error = self.assert_nothing_loaded(errors.MeshConfigError, stages=8,
                                       path=os.path.join(_TMP.name, "missing.gguf"))
    self.assertIn("8 devices", str(error))

  def test_more_stages_than_layers(self):
    path = os.path.join(_TMP.name, "one-layer.gguf")
    write_tiny_glm_gguf(path, TinyGlmSpec(n_trunk_layers=1, mtp=False))
    self.assert_nothing_loaded(errors.PlanningError, "stage_count_exceeds_layer_count",
                               path=path, stages=2)

  def test_splits_not_ascending(self):
    self.assert_nothing_loaded(errors.PlanningError, "NonAscendingSplitBoundary", stages=3,
                               splits=(3, 1))

  def test_splits_outside_the_layers(self):
    self.assert_nothing_loaded(errors.PlanningError, "InvalidSplitBoundary", stages=2,
                               splits=(4,))

  def test_splits_and_stages_disagree(self):
    self.assert_nothing_loaded(errors.PlanningError, "NotEnoughNodesForSplits", stages=2,
                               splits=(1, 2))


if __name__ == "__main__":
  absltest.main()
