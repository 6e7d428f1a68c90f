"""glm-dsa pipeline stages that start on a layer without its own indexer.

Such a layer reuses the row selection of the last indexer before it (docs/MODEL.md §9), so a stage
that starts there must receive that selection with the activations. The model is a generated
glm-dsa GGUF with index_topk 4 (well below the context, so the selection matters) whose layers
1 and 2 reuse layer 0's selection. Every pipeline split must equal the single-stage model, whose
logits are anchored on the plain-numpy sparse reference of `dsa_test.py`.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402  (the device count must be set before jax loads)
import functools  # noqa: E402
import tempfile  # noqa: E402

from absl.testing import absltest, parameterized
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mtpjax
from dsa_test import reference_logits
from mtpjax.engine.pipeline_hops import CollectiveHops
from mtpjax.models.interface import StageLayout
from mtpjax.models.registry import init_cache
from mtpjax.testing.tiny_mla import TinyDsaSpec, build_tiny_dsa_tensors, write_tiny_dsa_gguf

SPEC = TinyDsaSpec(n_layers=3, indexer_types=(True, False, False), mtp=True)  # layer_count 4
IDS = (np.arange(20) * 37 + 11) % SPEC.vocab_size     # bucket 32 > index_topk 4
PROMPT = [5, 77, 140, 9, 201, 33]
NEW_TOKENS = 8
_TMP = tempfile.TemporaryDirectory()


@functools.cache
def gguf_path() -> str:
  path = os.path.join(_TMP.name, "tiny-dsa-mtp.gguf")
  write_tiny_dsa_gguf(path, SPEC)
  return path


@functools.cache
def pipelined(stages: int, splits: tuple[int, ...], collective: bool):
  """One loaded pipeline per configuration, shared by the tests that use it.

  `collective` swaps in the multi-process hop (shard_map + ppermute), which also runs within
  one process, so the selection crosses a real collective.
  """
  model = mtpjax.load(gguf_path(), stages=stages, splits=splits)
  if collective:
    model.hops = CollectiveHops(list(model.plan.meshes))
  return model


class PipelineSelectionTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    single = mtpjax.load(gguf_path())
    cls.cfg = single.config
    cls.ref = dict(
        logits=single.logits(IDS), mtp_logits=single.mtp_logits(IDS),
        on=single.generate(PROMPT, max_new_tokens=NEW_TOKENS, speculative="native-mtp-n1"),
        off=single.generate(PROMPT, max_new_tokens=NEW_TOKENS, speculative="disabled"))

  def test_single_stage_matches_the_numpy_sparse_reference(self):
    weights = build_tiny_dsa_tensors(SPEC)
    want, margin = reference_logits(weights, SPEC, IDS)
    self.assertGreater(margin, 1e-3)      # no near-ties: every compiled program picks the same rows
    dense, _ = reference_logits(weights, SPEC, IDS, sparse=False)
    self.assertGreater(np.abs(dense - want).max(), 0.05)
    np.testing.assert_allclose(self.ref["logits"], want, atol=1e-4, rtol=0)
    self.assertEqual(self.ref["on"].tokens, self.ref["off"].tokens)   # MTP is lossless

  def test_which_stages_take_a_selection(self):
    cfg = self.cfg
    self.assertEqual(cfg.indexer_full, (True, False, False))
    layout = lambda start, end: StageLayout(start, end, start == 0, end == 3, False)
    cases = {(0, 3): False,      # stage 0: nothing runs before it
             (1, 3): True, (2, 3): True, (1, 2): True,
             (3, 3): False}      # only the NextN block, which attends densely
    for (start, end), want in cases.items():
      self.assertEqual(layout(start, end).takes_selection(cfg, 32), want, (start, end))
    self.assertFalse(layout(1, 3).takes_selection(cfg, 4))      # cache fits top_k: dense
    no_index_before = dataclasses.replace(cfg, indexer_full=(False, True, False))
    self.assertFalse(layout(1, 3).takes_selection(no_index_before, 32))
    self.assertFalse(layout(1, 3).takes_selection(
        dataclasses.replace(cfg, indexer_full=()), 32))         # every layer has its indexer
    self.assertFalse(layout(1, 3).takes_selection(
        dataclasses.replace(cfg, arch="deepseek2", indexer_heads=0, indexer_full=()), 32))

  @parameterized.named_parameters(
      ("split_at_1", 2, (1,), False),
      ("split_at_2", 2, (2,), False),
      ("split_before_nextn", 2, (3,), False),
      ("three_stages_collective_hops", 3, (1, 2), True))
  def test_pipeline_equals_single_stage(self, stages, splits, collective):
    model = pipelined(stages, splits, collective)
    np.testing.assert_allclose(model.logits(IDS), self.ref["logits"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(model.mtp_logits(IDS), self.ref["mtp_logits"], atol=1e-5, rtol=0)
    on = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, speculative="native-mtp-n1")
    off = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, speculative="disabled")
    self.assertEqual(on.tokens, self.ref["on"].tokens)
    self.assertEqual(off.tokens, self.ref["off"].tokens)
    self.assertEqual(on.stats.accepted, self.ref["on"].stats.accepted)

  def test_a_stage_without_the_selection_would_differ(self):
    """Running stage 1 (layers 1-2) with the selection dropped, as before the fix, gives
    different logits, so the pipeline test above can fail; handing it on reproduces them."""
    model = pipelined(2, (1,), False)
    stages = [nnx.merge(*w) for w in model.weights(with_mtp=False)]
    tokens = np.zeros((1, 32), np.int32)
    tokens[0, :IDS.size] = IDS
    positions = jnp.arange(32, dtype=jnp.int32)[None]

    def logits(hand_on: bool) -> np.ndarray:
      x, selection = stages[0].embed_tokens(jax.device_put(tokens, model.hops.shardings[0])), None
      for s, stage in enumerate(stages):
        x, selection, pos = jax.device_put((x, selection, positions), model.hops.shardings[s])
        kv = jax.device_put(init_cache(self.cfg, len(stage.layers), 1, 32, jnp.float32),
                            model.hops.shardings[s])
        x, _, selection = stage.run_layers(x, pos, kv, selection if hand_on else None)
      return np.asarray(stages[-1].lm_logits(stages[-1].final_norm(x)))[0, :IDS.size]

    np.testing.assert_allclose(logits(True), self.ref["logits"], atol=1e-5, rtol=0)
    self.assertGreater(np.abs(logits(False) - self.ref["logits"]).max(), 0.05)


if __name__ == "__main__":
  absltest.main()
