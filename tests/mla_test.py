"""GLM-4.7-Flash-style MLA (GGUF arch `deepseek2`) against the glm4moelite-tiny fixture."""

import pathlib
import tempfile

import gguf
import numpy as np
from absl.testing import absltest

import mtpjax
from mtpjax import errors
from mtpjax.models import config as config_lib
from mtpjax.models.registry import cache_shapes
from mtpjax.models.primitives import rope_interleaved
from mtpjax.testing.gguf_rewrite import rewrite_gguf
from fixture_checks import ReferenceFixtureChecks
from fixtures import FIXTURES

FIXTURE = FIXTURES / "glm4moelite-tiny"
GGUF = FIXTURE / "glm4moelite_h64-F32.gguf"


class RopeInterleavedTest(absltest.TestCase):

  def test_adjacent_pairs_match_hand_rotation(self):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 2, 8)).astype(np.float32)
    pos = np.array([[0, 5, 17]], np.int32)
    got = np.asarray(rope_interleaved(x, pos, 10000.0))
    want = x.astype(np.float64).copy()
    for t in range(3):
      for j in range(4):
        ang = pos[0, t] * 10000.0 ** (-2 * j / 8)
        a, b = x[0, t, :, 2 * j], x[0, t, :, 2 * j + 1]
        want[0, t, :, 2 * j] = a * np.cos(ang) - b * np.sin(ang)
        want[0, t, :, 2 * j + 1] = b * np.cos(ang) + a * np.sin(ang)
    np.testing.assert_allclose(got, want, atol=1e-5)


class DeepseekConfigTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.meta = {
        "general.architecture": "deepseek2", "deepseek2.block_count": 2,
        "deepseek2.embedding_length": 64, "deepseek2.feed_forward_length": 128,
        "deepseek2.attention.head_count": 4, "deepseek2.attention.head_count_kv": 1,
        "deepseek2.attention.key_length": 48, "deepseek2.attention.value_length": 32,
        "deepseek2.attention.key_length_mla": 48, "deepseek2.attention.value_length_mla": 32,
        "deepseek2.attention.q_lora_rank": 32, "deepseek2.attention.kv_lora_rank": 32,
        "deepseek2.rope.dimension_count": 16, "deepseek2.vocab_size": 512,
    }

  def test_mla_sizes_come_from_the_mla_keys(self):
    cfg = config_lib.config_from_gguf(self.meta | {"deepseek2.expert_gating_func": 2}, [])
    self.assertTrue(cfg.is_mla)
    self.assertEqual((cfg.head_dim, cfg.value_dim, cfg.kv_lora_rank, cfg.q_lora_rank),
                     (48, 32, 32, 32))
    self.assertEqual(cfg.gating, "sigmoid")
    self.assertEqual(config_lib.ModelConfig.from_dict(cfg.to_dict()), cfg)

  def test_missing_gating_func_falls_back_to_softmax_with_a_warning(self):
    with self.assertLogs(config_lib.__name__, level="WARNING") as logs:
      cfg = config_lib.config_from_gguf(self.meta, [])
    self.assertEqual(cfg.gating, "softmax")
    self.assertIn("expert_gating_func", logs.output[0])

  def test_unsupported_rope_scaling_is_refused_by_name(self):
    # YaRN and linear scaling are implemented (yarn_test.py); other types are refused.
    meta = self.meta | {"deepseek2.rope.scaling.type": "longrope",
                        "deepseek2.rope.scaling.factor": 40.0}
    with self.assertRaisesRegex(errors.UnsupportedArchitectureError, "rope.scaling.type"):
      config_lib.config_from_gguf(meta, [])


class Glm4MoeLiteFixtureTest(ReferenceFixtureChecks, absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.ref = np.load(FIXTURE / "hf_ref.npz")
    cls.model = mtpjax.load(GGUF)

  def test_config(self):
    cfg = self.model.config
    self.assertEqual((cfg.arch, cfg.n_layers, cfg.kv_lora_rank, cfg.rope_dims),
                     ("deepseek2", 3, 32, 16))
    self.assertTrue(cfg.has_mtp)
    self.assertAlmostEqual(cfg.routed_scale, 1.8, places=6)

  def test_kv_cache_holds_latent_plus_rope_key_per_token(self):
    cfg = self.model.config
    per_token = cfg.kv_lora_rank + cfg.rope_dims
    self.assertEqual(per_token, 48)
    for k, v in cache_shapes(cfg, cfg.n_layers, 2, 40):
      self.assertEqual(k, (2, 40, 1, per_token))
      self.assertEqual(v, (2, 40, 1, 0))
    state = self.model.engine(native_mtp=True, max_len=64).init_state()
    for cache in list(state.kv[0]) + [state.mtp.kv]:
      self.assertEqual(sum(int(np.prod(a.shape[2:])) for a in cache), per_token)



def write_fused_kv_b(source: pathlib.Path, path: pathlib.Path) -> None:
  """Rewrite a deepseek2 GGUF the way older converters did: each layer's attn_k_b and attn_v_b
  merged back into HF's kv_b_proj, `attn_kv_b` [H * (nope + v), kv_lora] (numpy order)."""
  def fuse(tensors):
    by_name = {t.name: t for t in tensors}
    for name, t in by_name.items():
      if name.endswith("attn_v_b.weight"):
        continue
      if name.endswith("attn_k_b.weight"):
        k_b = np.asarray(t.data)
        v_b = np.asarray(by_name[name.replace("attn_k_b", "attn_v_b")].data)
        fused = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)   # [H, nope + v, kv_lora]
        yield (name.replace("attn_k_b", "attn_kv_b"),
               fused.reshape(-1, fused.shape[-1]).astype(np.float32))
      else:
        yield name, t
  rewrite_gguf(source, path, tensors=fuse)


class FusedKvBTest(absltest.TestCase):
  """Older deepseek2 GGUFs store attn_kv_b; the loader splits it into the per-head k_b / v_b."""

  def test_fused_file_gives_the_same_logits(self):
    ref = np.load(FIXTURE / "hf_ref.npz")
    with tempfile.TemporaryDirectory() as tmp:
      fused = pathlib.Path(tmp) / "fused.gguf"
      write_fused_kv_b(GGUF, fused)
      names = {t.name for t in gguf.GGUFReader(fused).tensors}
      self.assertIn("blk.0.attn_kv_b.weight", names)
      self.assertNotIn("blk.0.attn_k_b.weight", names)
      model = mtpjax.load(str(fused))
      np.testing.assert_allclose(model.logits(ref["token_ids"]), ref["logits"], atol=1e-4,
                                 rtol=0)
      np.testing.assert_allclose(model.mtp_logits(ref["token_ids"]), ref["mtp_logits_llamacpp"],
                                 atol=1e-4, rtol=0)


if __name__ == "__main__":
  absltest.main()
