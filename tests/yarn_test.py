"""YaRN / linear RoPE scaling of the MLA archs (mtpjax/models/yarn.py), as llama.cpp does it.

References: a plain-numpy transcription of HF transformers' `_compute_yarn_parameters` and
DeepSeek's `yarn_get_mscale` softmax scale, hand-computed values, and, end to end, a numpy
forward of the glm4moelite-tiny fixture (deepseek2) rewritten with `rope.scaling.*` keys.
"""

import dataclasses
import math
import pathlib
import tempfile

import gguf
import numpy as np
from absl.testing import absltest, parameterized

import mtpjax
from mtpjax import errors
from mtpjax.models import config as config_lib
from mtpjax.models import yarn
from mtpjax.testing.gguf_rewrite import rewrite_gguf
from fixtures import FIXTURES
from glm_numpy_reference import HParams, moe, rms

FIXTURE = FIXTURES / "glm4moelite-tiny"
GGUF = FIXTURE / "glm4moelite_h64-F32.gguf"


# --- plain-numpy references, written from HF transformers / DeepSeek's code -------------------

def hf_yarn_inv_freq(dim, base, factor, orig_ctx, beta_fast=32.0, beta_slow=1.0):
  """HF `_compute_yarn_parameters` (truncate=True): inverse frequencies [dim // 2]."""
  def correction_dim(rotations):
    return dim * math.log(orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))
  low = max(math.floor(correction_dim(beta_fast)), 0)
  high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
  extrapolation_factor = 1 - ramp
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  return ((1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor)
          + (1.0 / pos_freqs) * extrapolation_factor)


def yarn_get_mscale(scale=1.0, mscale=1.0):
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def hf_attention_factor(factor, mscale=None, mscale_all_dim=None):
  """The factor HF multiplies cos/sin by."""
  if mscale and mscale_all_dim:
    return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
  return yarn_get_mscale(factor)


def deepseek_softmax_scale(head_dim, factor, mscale_all_dim):
  scale = head_dim ** -0.5
  if mscale_all_dim:
    scale *= yarn_get_mscale(factor, mscale_all_dim) ** 2
  return scale


def rotate_pairs(x, pos, inv_freq, magnitude=1.0):
  """Adjacent-pair rotation of the last axis; x [T, ..., R], pos [T]."""
  out = np.array(x, np.float64)
  for j, f in enumerate(inv_freq):
    ang = (pos * f).reshape((-1,) + (1,) * (x.ndim - 2))
    a, b = x[..., 2 * j], x[..., 2 * j + 1]
    out[..., 2 * j] = (a * np.cos(ang) - b * np.sin(ang)) * magnitude
    out[..., 2 * j + 1] = (b * np.cos(ang) + a * np.sin(ang)) * magnitude
  return out


# --- configs -----------------------------------------------------------------------------------

def mla_metadata(arch="deepseek2", **rope_keys):
  a = arch + "."
  meta = {
      "general.architecture": arch, a + "block_count": 2, a + "context_length": 4096,
      a + "embedding_length": 64, a + "feed_forward_length": 128,
      a + "attention.head_count": 4, a + "attention.head_count_kv": 1,
      a + "attention.key_length": 48, a + "attention.value_length": 32,
      a + "attention.key_length_mla": 48, a + "attention.value_length_mla": 32,
      a + "attention.q_lora_rank": 32, a + "attention.kv_lora_rank": 32,
      a + "rope.dimension_count": 16, a + "rope.freq_base": 10000.0, a + "vocab_size": 512,
      a + "expert_gating_func": 2,
  }
  if arch == "glm-dsa":
    meta.update({a + "attention.indexer.head_count": 2, a + "attention.indexer.key_length": 16,
                 a + "attention.indexer.top_k": 8})
  meta.update({a + "rope.scaling." + k: v for k, v in rope_keys.items()})
  return meta


def parse(meta):
  return config_lib.config_from_gguf(meta, [])


def scaled(cfg, **fields):
  return dataclasses.replace(cfg, **fields)


class YarnFormulaTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.base = parse(mla_metadata())

  @parameterized.parameters((64, 10000.0, 40.0, 4096), (16, 10000.0, 4.0, 64),
                            (16, 1e6, 8.0, 4096), (32, 50000.0, 2.5, 1024))
  def test_inverse_frequencies_match_hf(self, dim, base, factor, orig_ctx):
    cfg = scaled(self.base, rope_dims=dim, rope_theta=base, rope_scaling="yarn",
                 rope_scaling_factor=factor, rope_orig_context=orig_ctx)
    np.testing.assert_allclose(yarn.inv_freq(cfg), hf_yarn_inv_freq(dim, base, factor, orig_ctx),
                               rtol=1e-6)

  def test_deepseek_v3_hand_values(self):
    # DeepSeek-V3: factor 40, original context 4096, mscale = mscale_all_dim = 1, qk_rope 64.
    cfg = scaled(self.base, head_dim=192, rope_dims=64, rope_scaling="yarn",
                 rope_scaling_factor=40.0, rope_orig_context=4096, yarn_log_mul=1.0)
    # 64 ln(4096 / (32 * 2pi)) / (2 ln 1e4) = 10.47 -> 10; with beta 1: 22.51 -> 23
    self.assertEqual(yarn.corr_dims(64, 4096, 10000.0), (10.0, 23.0))
    self.assertAlmostEqual(yarn.rope_magnitude(cfg), 1.0, places=12)
    # (1 + 0.1 ln 40)^2 / sqrt(192) = 1.3688879454^2 / 13.8564064606
    self.assertAlmostEqual(yarn.score_scale(cfg), 0.1352337788608801, places=12)
    self.assertAlmostEqual(yarn.score_scale(cfg), deepseek_softmax_scale(192, 40.0, 1.0),
                           places=12)
    inv = yarn.inv_freq(cfg)
    j = np.arange(32)
    plain = 10000.0 ** (-2.0 * j / 64)
    np.testing.assert_allclose(inv[:11], plain[:11], rtol=1e-6)           # extrapolated
    np.testing.assert_allclose(inv[23:], plain[23:] / 40.0, rtol=1e-6)    # interpolated

  def test_factor_one_is_plain_rope(self):
    cfg = scaled(self.base, rope_scaling="yarn", rope_scaling_factor=1.0, rope_orig_context=64,
                 yarn_log_mul=0.707)
    np.testing.assert_allclose(yarn.inv_freq(cfg), 10000.0 ** (-np.arange(8) / 8.0), rtol=1e-7)
    self.assertEqual(yarn.rope_magnitude(cfg), 1.0)
    self.assertEqual(yarn.score_scale(cfg), 1.0 / math.sqrt(48))
    self.assertEqual(yarn.score_scale(self.base), 1.0 / math.sqrt(48))

  def test_deepseek2_mscale_ratio_matches_hf(self):
    # DeepSeek-V2-Lite: mscale = mscale_all_dim = 0.707; HF's cos/sin factor is 1 and its
    # softmax scale carries yarn_get_mscale(40, 0.707)^2.
    cfg = scaled(self.base, rope_scaling="yarn", rope_scaling_factor=40.0,
                 rope_orig_context=4096, yarn_log_mul=0.707)
    self.assertAlmostEqual(yarn.rope_magnitude(cfg), hf_attention_factor(40.0, 0.707, 0.707),
                           places=12)
    self.assertAlmostEqual(yarn.score_scale(cfg), deepseek_softmax_scale(48, 40.0, 0.707),
                           places=12)

  def test_glm_dsa_uses_the_plain_mscale_ratio(self):
    # llama.cpp's special case (mscale := mscale_all_dim) is for deepseek2 only; other archs
    # take HF's ratio with mscale 1.
    cfg = scaled(parse(mla_metadata("glm-dsa")), rope_scaling="yarn", rope_scaling_factor=4.0,
                 rope_orig_context=64, yarn_log_mul=0.5)
    ratio = hf_attention_factor(4.0, 1.0, 0.5)
    self.assertAlmostEqual(yarn.rope_magnitude(cfg), ratio, places=12)
    self.assertAlmostEqual(yarn.score_scale(cfg), (ratio * (1 + 0.05 * math.log(4.0))) ** 2
                           / math.sqrt(48), places=12)

  def test_yarn_without_log_multiplier_as_llama_cpp(self):
    # No mscale_all_dim: the rope carries 1 + 0.1 ln f (as HF's attention_factor), and
    # llama.cpp's deepseek2 graph also scales every score by its square.
    cfg = scaled(self.base, rope_scaling="yarn", rope_scaling_factor=4.0, rope_orig_context=64)
    m = 1 + 0.1 * math.log(4.0)
    self.assertAlmostEqual(yarn.rope_magnitude(cfg), hf_attention_factor(4.0), places=12)
    self.assertAlmostEqual(yarn.rope_magnitude(cfg), m, places=12)
    self.assertAlmostEqual(yarn.score_scale(cfg), m * m / math.sqrt(48), places=12)

  def test_linear_scaling(self):
    cfg = scaled(self.base, rope_scaling="linear", rope_scaling_factor=4.0, rope_orig_context=64)
    np.testing.assert_allclose(yarn.inv_freq(cfg), 10000.0 ** (-np.arange(8) / 8.0) / 4.0,
                               rtol=1e-7)
    self.assertEqual(yarn.rope_magnitude(cfg), 1.0)
    # deepseek2.cpp's kq_scale keeps (1 + 0.1 ln f)^2 for linear scaling as well
    self.assertAlmostEqual(yarn.score_scale(cfg), (1 + 0.1 * math.log(4.0)) ** 2 / math.sqrt(48),
                           places=12)

  def test_scaled_rope_rotates_by_the_yarn_frequencies(self):
    cfg = scaled(self.base, rope_scaling="yarn", rope_scaling_factor=4.0, rope_orig_context=64)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 5, 3, 16)).astype(np.float32)
    pos = np.array([[0, 1, 7, 30, 200]], np.int32)
    got = np.asarray(yarn.scaled_rope(x, pos, cfg))
    want = rotate_pairs(x[0], pos[0].astype(np.float64), hf_yarn_inv_freq(16, 1e4, 4.0, 64),
                        hf_attention_factor(4.0))
    np.testing.assert_allclose(got[0], want, atol=2e-5)


class RopeScalingConfigTest(absltest.TestCase):

  def test_yarn_keys(self):
    cfg = parse(mla_metadata(**{"type": "yarn", "factor": 40.0, "original_context_length": 256,
                                "yarn_log_multiplier": 0.0707}))
    self.assertEqual((cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_orig_context),
                     ("yarn", 40.0, 256))
    self.assertAlmostEqual(cfg.yarn_log_mul, 0.707, places=9)     # the GGUF value / 0.1
    self.assertEqual(cfg.rope_attn_factor, 1.0)
    self.assertEqual(config_lib.ModelConfig.from_dict(cfg.to_dict()), cfg)

  def test_no_keys_keep_the_defaults_and_old_dicts_load(self):
    cfg = parse(mla_metadata())
    self.assertEqual((cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_orig_context,
                      cfg.yarn_log_mul, cfg.rope_attn_factor), ("none", 1.0, 0, 0.0, 1.0))
    old = {k: v for k, v in cfg.to_dict().items()
           if not k.startswith(("rope_scaling", "rope_orig", "yarn_", "rope_attn"))}
    self.assertEqual(config_lib.ModelConfig.from_dict(old), cfg)

  def test_original_context_defaults_to_the_context_length(self):
    cfg = parse(mla_metadata(**{"type": "yarn", "factor": 4.0}))
    self.assertEqual(cfg.rope_orig_context, 4096)

  def test_factor_without_type_is_linear_and_type_none_ignores_the_factor(self):
    self.assertEqual(parse(mla_metadata(factor=4.0)).rope_scaling, "linear")
    none = parse(mla_metadata(type="none", factor=4.0))
    self.assertEqual((none.rope_scaling, none.rope_scaling_factor), ("none", 1.0))
    self.assertEqual(parse(mla_metadata(type="linear", factor=0.0)).rope_scaling, "none")

  def test_glm_dsa_ignores_the_log_multiplier_like_llama_cpp(self):
    with self.assertLogs(config_lib.__name__, level="WARNING") as logs:
      cfg = parse(mla_metadata("glm-dsa", type="yarn", factor=4.0, yarn_log_multiplier=0.1))
    self.assertEqual((cfg.rope_scaling, cfg.yarn_log_mul), ("yarn", 0.0))
    self.assertIn("yarn_log_multiplier", "".join(logs.output))

  def test_beta_keys_are_ignored_with_a_warning(self):
    with self.assertLogs(config_lib.__name__, level="WARNING") as logs:
      parse(mla_metadata(type="yarn", factor=4.0, yarn_beta_fast=16.0))
    self.assertIn("yarn_beta_fast", "".join(logs.output))

  def test_unsupported_type_is_refused_by_name(self):
    with self.assertRaises(errors.UnsupportedArchitectureError) as ctx:
      parse(mla_metadata(type="longrope", factor=4.0))
    self.assertEqual(ctx.exception.field, "deepseek2.rope.scaling.type")
    self.assertIn("longrope", ctx.exception.message)
    self.assertTrue(ctx.exception.remedy)

  def test_negative_factor_is_refused(self):
    with self.assertRaises(errors.ConversionError) as ctx:
      parse(mla_metadata(type="yarn", factor=-2.0))
    self.assertEqual(ctx.exception.field, "deepseek2.rope.scaling.factor")


# --- end to end on the deepseek2 fixture ------------------------------------------------------

def write_with_rope_keys(source: pathlib.Path, path: pathlib.Path, keys: dict) -> None:
  """Copy a GGUF through the real gguf-py writer, adding `{arch}.rope.scaling.*` keys."""
  arch = gguf.GGUFReader(source).fields["general.architecture"].contents()
  def typed(value):
    kind = (gguf.GGUFValueType.STRING if isinstance(value, str) else
            gguf.GGUFValueType.UINT32 if isinstance(value, int) else gguf.GGUFValueType.FLOAT32)
    return value, kind
  rewrite_gguf(source, path, keys={f"{arch}.rope.scaling.{name}": typed(value)
                                   for name, value in keys.items()})


def reference_logits(w, meta, ids, inv_freq, magnitude, scale):
  """Trunk logits [T, V] of a deepseek2 GGUF: MLA written out per head (not absorbed), the
  MoE from glm_numpy_reference; RoPE by `inv_freq`, cos/sin times `magnitude`, scores times
  `scale`."""
  a = "deepseek2."
  hp = HParams(
      n_trunk=int(meta[a + "block_count"]) - int(meta[a + "nextn_predict_layers"]),
      n_heads=int(meta[a + "attention.head_count"]), n_kv_heads=1, head_dim=0, rope_dims=0,
      rope_theta=0.0, eps=float(meta[a + "attention.layer_norm_rms_epsilon"]),
      leading_dense=int(meta[a + "leading_dense_block_count"]),
      n_experts_used=int(meta[a + "expert_used_count"]),
      n_groups=int(meta[a + "expert_group_count"]),
      groups_used=int(meta[a + "expert_group_used_count"]),
      gating="sigmoid" if int(meta[a + "expert_gating_func"]) == 2 else "softmax",
      routed_scale=float(meta[a + "expert_weights_scale"]),
      norm_topk=bool(meta[a + "expert_weights_norm"]))
  kv_lora, rope = int(meta[a + "attention.kv_lora_rank"]), int(meta[a + "rope.dimension_count"])
  nope = int(meta[a + "attention.key_length_mla"]) - rope
  ids = np.asarray(ids).reshape(-1)
  t_len, h, eps = ids.size, hp.n_heads, hp.eps
  pos = np.arange(t_len, dtype=np.float64)
  causal = np.tril(np.ones((t_len, t_len), bool))
  x = w["token_embd.weight"][ids].astype(np.float32)
  for i in range(hp.n_trunk):
    p = f"blk.{i}."
    n = rms(x, w[p + "attn_norm.weight"], eps)
    cq = rms(n @ w[p + "attn_q_a.weight"].T, w[p + "attn_q_a_norm.weight"], eps)
    q = (cq @ w[p + "attn_q_b.weight"].T).reshape(t_len, h, nope + rope)
    q_pe = rotate_pairs(q[..., nope:], pos, inv_freq, magnitude)
    kv = n @ w[p + "attn_kv_a_mqa.weight"].T
    c = rms(kv[:, :kv_lora], w[p + "attn_kv_a_norm.weight"], eps)
    k_pe = rotate_pairs(kv[:, kv_lora:], pos, inv_freq, magnitude)
    k_nope = np.einsum("sc,hcn->shn", c, w[p + "attn_k_b.weight"])
    v = np.einsum("sc,hvc->shv", c, w[p + "attn_v_b.weight"])
    s = (np.einsum("thn,shn->hts", q[..., :nope], k_nope)
         + np.einsum("thr,sr->hts", q_pe, k_pe)) * scale
    s = np.where(causal, s, -np.inf)
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    o = np.einsum("hts,shv->thv", prob, v).reshape(t_len, -1)
    x = (x + o @ w[p + "attn_output.weight"].T).astype(np.float32)
    m = rms(x, w[p + "ffn_norm.weight"], eps)
    if i < hp.leading_dense:
      gate = m @ w[p + "ffn_gate.weight"].T
      f = (gate / (1 + np.exp(-gate)) * (m @ w[p + "ffn_up.weight"].T)) @ w[
          p + "ffn_down.weight"].T
    else:
      f = moe(w, p, hp, m)
    x = (x + f).astype(np.float32)
  head = w.get("output.weight", w["token_embd.weight"])
  return rms(x, w["output_norm.weight"], eps) @ head.T


FACTOR, ORIG_CTX, MSCALE_ALL_DIM = 4.0, 64, 0.707


class YarnFixtureTest(absltest.TestCase):
  """glm4moelite-tiny (deepseek2, MoE, NextN) with DeepSeek-V2-style YaRN keys written in."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    tmp = pathlib.Path(cls.tmp.name)
    keys = {"type": "yarn", "original_context_length": ORIG_CTX,
            "yarn_log_multiplier": 0.1 * MSCALE_ALL_DIM}
    write_with_rope_keys(GGUF, tmp / "yarn.gguf", keys | {"factor": FACTOR})
    write_with_rope_keys(GGUF, tmp / "yarn1.gguf", keys | {"factor": 1.0})
    cls.plain = mtpjax.load(GGUF)
    cls.yarn = mtpjax.load(tmp / "yarn.gguf")
    cls.yarn1 = mtpjax.load(tmp / "yarn1.gguf")
    cls.ref = np.load(FIXTURE / "hf_ref.npz")
    reader = gguf.GGUFReader(GGUF)
    cls.meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    cls.weights = {t.name: np.asarray(t.data) for t in reader.tensors}

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def _reference(self, ids, factor):
    if factor == 1.0:
      inv = 10000.0 ** (-np.arange(8, dtype=np.float64) / 8.0)
    else:
      inv = hf_yarn_inv_freq(16, 10000.0, factor, ORIG_CTX)
    return reference_logits(self.weights, self.meta, ids, inv,
                            hf_attention_factor(factor, MSCALE_ALL_DIM, MSCALE_ALL_DIM),
                            deepseek_softmax_scale(48, factor, MSCALE_ALL_DIM))

  def test_config(self):
    cfg = self.yarn.config
    self.assertEqual((cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_orig_context),
                     ("yarn", FACTOR, ORIG_CTX))
    self.assertAlmostEqual(cfg.yarn_log_mul, MSCALE_ALL_DIM, places=6)

  def test_numpy_reference_matches_transformers_without_scaling(self):
    ids = self.ref["token_ids"]
    np.testing.assert_allclose(self._reference(ids, 1.0), self.ref["logits"], atol=1e-4)

  def test_factor_one_matches_the_file_without_keys(self):
    ids = self.ref["token_ids"]
    np.testing.assert_allclose(self.yarn1.logits(ids), self.plain.logits(ids), atol=1e-5, rtol=0)

  def test_yarn_logits_match_the_numpy_reference(self):
    ids = self.ref["token_ids"]
    got = self.yarn.logits(ids)
    np.testing.assert_allclose(got, self._reference(ids, FACTOR), atol=1e-4, rtol=0)
    self.assertGreater(np.abs(got - self.plain.logits(ids)).max(), 0.05)

  def test_greedy_decode_with_and_without_mtp_follows_the_reference(self):
    prompt = self.ref["prompt_ids"]
    on = self.yarn.generate(prompt, max_new_tokens=12, speculative="native-mtp-n1",
                            adaptive_drafting=False)
    off = self.yarn.generate(prompt, max_new_tokens=12, speculative="disabled")
    self.assertEqual(on.tokens, off.tokens)
    self.assertGreater(on.stats.drafted, 0)         # NextN drafts were made and verified
    seq = np.concatenate([np.asarray(prompt).reshape(-1), on.tokens[:-1]])
    want = self._reference(seq, FACTOR)[len(prompt) - 1:].argmax(-1)
    self.assertEqual(on.tokens, want.tolist())


if __name__ == "__main__":
  absltest.main()
