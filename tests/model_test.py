"""The GLM-4.x MoE forward and NextN head, loaded from GGUF, against independent references.

References: the llama.cpp/transformers glm4moe-tiny fixture, and `glm_numpy_reference` (a plain
numpy forward written from docs/MODEL.md) on generated models covering the optional parts.
"""

import dataclasses
import tempfile
from pathlib import Path

import gguf
import numpy as np
from absl.testing import absltest, parameterized

import glm_numpy_reference as ref
import mtpjax
from mtpjax import errors
from mtpjax.models.config import config_from_gguf
from mtpjax.testing.tiny_glm import TinyGlmSpec, build_tiny_glm_tensors, write_tiny_glm_gguf
from fixtures import FIXTURES

FIXTURE = FIXTURES / "glm4moe-tiny"
TOL = 1e-4

# Small enough that each case compiles in about a second.
SMALL = TinyGlmSpec(vocab_size=288, hidden=32, n_heads=4, n_kv_heads=2, head_dim=16,
                    n_trunk_layers=2, leading_dense=1, ffn=64, n_experts=4, n_experts_used=2,
                    expert_ffn=16, n_groups=2, groups_used=1, rope_dims=8, seed=3)


def _fixture_ids() -> np.ndarray:
  return np.load(FIXTURE / "hf_ref.npz")["token_ids"]


def _gguf_metadata(path) -> dict:
  reader = gguf.GGUFReader(str(path))
  return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _argmax_agreement(a: np.ndarray, b: np.ndarray) -> float:
  return float(np.mean(a.argmax(-1) == b.argmax(-1)))


class FixtureF32Test(absltest.TestCase):
  """Against transformers (float32, eager) and llama.cpp's MTP logits on the F32 file."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.ref = np.load(FIXTURE / "hf_ref.npz")
    cls.model = mtpjax.load(FIXTURE / "glm4moe_h64-F32.gguf")
    ids = cls.ref["token_ids"]
    cls.mtp = cls.model.mtp_logits(ids)     # loads the head first: one weight set, fewer compiles
    cls.logits = cls.model.logits(ids)
    cls.hidden = cls.model.hidden(ids)

  def test_config_matches_hf_config(self):
    cfg = self.model.config
    self.assertEqual((cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim), (64, 4, 2, 32))
    self.assertEqual((cfg.n_layers, cfg.leading_dense, cfg.rope_dims), (3, 1, 16))
    self.assertEqual((cfg.n_experts, cfg.n_experts_used, cfg.n_groups, cfg.groups_used),
                     (8, 2, 2, 1))
    self.assertTrue(cfg.attn_bias and cfg.qk_norm and cfg.has_mtp and cfg.mtp_head)
    self.assertFalse(cfg.tied_head or cfg.mtp_embed)
    self.assertAlmostEqual(cfg.routed_scale, 2.5)

  def test_logits_match_transformers(self):
    want = self.ref["logits"]
    self.assertEqual(self.logits.shape, want.shape)
    np.testing.assert_allclose(self.logits, want, atol=TOL, rtol=0)
    np.testing.assert_array_equal(self.logits.argmax(-1), want.argmax(-1))

  def test_hidden_is_post_norm_trunk_output(self):
    np.testing.assert_allclose(self.hidden, self.ref["mtp_h_nextn"], atol=TOL, rtol=0)

  def test_mtp_logits_match_llamacpp_row_convention(self):
    want = self.ref["mtp_logits_llamacpp"]
    np.testing.assert_allclose(self.mtp, want, atol=TOL, rtol=0)
    np.testing.assert_array_equal(self.mtp.argmax(-1), want.argmax(-1))

  def test_numpy_reference_matches_transformers(self):
    """The oracle used for generated models is itself checked against transformers here."""
    kv, weights = ref.read_gguf(FIXTURE / "glm4moe_h64-F32.gguf")
    hidden, logits = ref.trunk_forward(weights, ref.HParams.from_gguf_metadata(kv),
                                       self.ref["token_ids"])
    np.testing.assert_allclose(logits, self.ref["logits"], atol=TOL, rtol=0)
    mtp = ref.mtp_forward(weights, ref.HParams.from_gguf_metadata(kv), self.ref["token_ids"],
                          hidden)
    np.testing.assert_allclose(mtp, self.ref["mtp_logits_llamacpp"], atol=TOL, rtol=0)


class FixtureQuantizedTest(parameterized.TestCase):
  """Quantized files: llama.cpp on the same bytes (argmax), numpy on the same dequantized data."""

  @parameterized.parameters("Q8_0", "Q4_K_M")
  def test_quantized_file(self, qtype):
    path = FIXTURE / f"glm4moe_h64-{qtype}.gguf"
    llama = np.load(FIXTURE / f"llama_{qtype}.npz")
    ids = _fixture_ids()
    model = mtpjax.load(path, int8_activations=False)   # float32 rows, as the reference
    mtp = model.mtp_logits(ids)
    logits = model.logits(ids)
    self.assertGreaterEqual(_argmax_agreement(logits, llama["logits"]), 0.9)
    self.assertGreaterEqual(_argmax_agreement(mtp, llama["mtp_logits"]), 0.9)
    # Same dequantized weights, both float32: only summation order differs.
    kv, weights = ref.read_gguf(path)
    hp = ref.HParams.from_gguf_metadata(kv)
    hidden, want = ref.trunk_forward(weights, hp, ids)
    np.testing.assert_allclose(logits, want, atol=TOL, rtol=0)
    np.testing.assert_allclose(mtp, ref.mtp_forward(weights, hp, ids, hidden), atol=TOL, rtol=0)


# (name, overrides of SMALL). Together they toggle every optional part and fallback.
_CASES = (
    dict(testcase_name="gqa4_2_bias_qknorm_groups2", overrides={}),
    dict(testcase_name="gqa4_1_tied_nextn_embed_no_groups",
         overrides=dict(n_kv_heads=1, attn_bias=False, qk_norm=False, tied_head=True,
                        nextn_embed=True, nextn_head=False, nextn_head_norm=False, n_groups=1,
                        groups_used=1)),
    dict(testcase_name="mha_full_rope_4groups_unnormed",
         overrides=dict(n_kv_heads=4, qk_norm=False, rope_dims=16, nextn_head=False,
                        n_experts=8, n_experts_used=3, n_groups=4, groups_used=2,
                        norm_topk=False, routed_scale=1.0, rope_theta=1e6)),
    dict(testcase_name="no_mtp_no_shared_all_moe",
         overrides=dict(mtp=False, n_shared_experts=0, leading_dense=0, attn_bias=False,
                        n_experts_used=1)),
)


class GeneratedModelTest(parameterized.TestCase):
  """mtpjax.load(GGUF) vs the numpy reference on the exact float32 master weights."""

  @parameterized.named_parameters(*_CASES)
  def test_matches_numpy_reference(self, overrides):
    spec = dataclasses.replace(SMALL, **overrides)
    with tempfile.TemporaryDirectory() as tmp:
      path = Path(tmp) / "tiny.gguf"
      write_tiny_glm_gguf(path, spec)
      model = mtpjax.load(path)
      cfg = model.config
      self.assertEqual((cfg.n_kv_heads, cfg.attn_bias, cfg.qk_norm, cfg.tied_head, cfg.has_mtp),
                       (spec.n_kv_heads, spec.attn_bias, spec.qk_norm, spec.tied_head, spec.mtp))
      self.assertEqual((cfg.mtp_embed, cfg.mtp_head, cfg.mtp_head_norm),
                       (spec.mtp and spec.nextn_embed, spec.mtp and spec.nextn_head,
                        spec.mtp and spec.nextn_head_norm))
      weights = build_tiny_glm_tensors(spec)
      hp = ref.HParams.from_spec(spec)
      ids = np.random.default_rng(7).integers(0, spec.vocab_size, size=11)
      want_hidden, want_logits = ref.trunk_forward(weights, hp, ids)
      if spec.mtp:
        mtp = model.mtp_logits(ids)   # first, so the trunk compiles once with the head's weights
        np.testing.assert_allclose(mtp, ref.mtp_forward(weights, hp, ids, want_hidden),
                                   atol=TOL, rtol=0)
      else:
        with self.assertRaisesRegex(errors.SpeculativeConfigError, "no NextN"):
          model.mtp_logits(ids)
      logits = model.logits(ids)
      np.testing.assert_allclose(model.hidden(ids), want_hidden, atol=TOL, rtol=0)
      np.testing.assert_allclose(logits, want_logits, atol=TOL, rtol=0)
      np.testing.assert_array_equal(logits.argmax(-1), want_logits.argmax(-1))

  def test_reference_detects_a_wrong_mtp_convention(self):
    """The tolerance is meaningful: swapping eh_proj's halves moves the MTP logits far away."""
    weights = dict(build_tiny_glm_tensors(SMALL))
    hp = ref.HParams.from_spec(SMALL)
    ids = np.arange(5, 16)
    hidden, _ = ref.trunk_forward(weights, hp, ids)
    good = ref.mtp_forward(weights, hp, ids, hidden)
    name = f"blk.{SMALL.n_trunk_layers}.nextn.eh_proj.weight"
    eh = weights[name]
    weights[name] = np.concatenate([eh[:, SMALL.hidden:], eh[:, :SMALL.hidden]], axis=1)
    self.assertGreater(np.abs(ref.mtp_forward(weights, hp, ids, hidden) - good).max(), 100 * TOL)


class ConfigErrorsTest(parameterized.TestCase):
  """config_from_gguf on real GGUF metadata with one fact broken."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.metadata = _gguf_metadata(FIXTURE / "glm4moe_h64-F32.gguf")
    cls.names = [t.name for t in gguf.GGUFReader(str(FIXTURE / "glm4moe_h64-F32.gguf")).tensors]

  def test_fixture_metadata_resolves(self):
    cfg = config_from_gguf(self.metadata, self.names, source="fixture.gguf")
    self.assertEqual((cfg.vocab_size, cfg.n_layers, cfg.mtp_layer), (512, 3, 3))

  def test_unsupported_architecture(self):
    metadata = dict(self.metadata, **{"general.architecture": "llama"})
    with self.assertRaises(errors.UnsupportedArchitectureError) as ctx:
      config_from_gguf(metadata, self.names, source="other.gguf")
    self.assertEqual(ctx.exception.field, "general.architecture")
    self.assertIn("'llama'", str(ctx.exception))
    self.assertIn("other.gguf", str(ctx.exception))
    self.assertIsInstance(ctx.exception, errors.ConversionError)

  @parameterized.parameters("block_count", "embedding_length", "attention.head_count",
                            "feed_forward_length")
  def test_missing_required_key(self, key):
    metadata = {k: v for k, v in self.metadata.items() if k != f"glm4moe.{key}"}
    with self.assertRaises(errors.ConversionError) as ctx:
      config_from_gguf(metadata, self.names, source="broken.gguf")
    self.assertEqual(ctx.exception.field, f"glm4moe.{key}")
    self.assertIn(f"glm4moe.{key}", str(ctx.exception))
    self.assertIn("broken.gguf", str(ctx.exception))
    self.assertIsNotNone(ctx.exception.remedy)


if __name__ == "__main__":
  absltest.main()
