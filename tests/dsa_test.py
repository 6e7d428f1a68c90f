"""GLM-5-style glm-dsa: MLA + lightning indexer, on the fixture and on a sparse tiny model."""

import pathlib
import tempfile

import numpy as np
from absl.testing import absltest

import mtpjax
from mtpjax.models.dsa_indexer import select_top_rows
from mtpjax.models.registry import cache_shapes
from mtpjax.testing.tiny_mla import TinyDsaSpec, write_tiny_dsa_gguf
from fixture_checks import ReferenceFixtureChecks
from fixtures import FIXTURES

FIXTURE = FIXTURES / "glmdsa-tiny"


# --- plain-numpy reference (float64, expanded per-head keys/values, not the absorbed form) ----

def _rms(x, w, eps):
  return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope_pairs(x, pos, theta):
  """Adjacent-pair rotation of the last axis; x [T, ..., R]."""
  r = x.shape[-1]
  out = x.copy()
  for j in range(r // 2):
    ang = pos * theta ** (-2.0 * j / r)
    ang = ang.reshape((-1,) + (1,) * (x.ndim - 2))
    a, b = x[..., 2 * j], x[..., 2 * j + 1]
    out[..., 2 * j] = a * np.cos(ang) - b * np.sin(ang)
    out[..., 2 * j + 1] = b * np.cos(ang) + a * np.sin(ang)
  return out


def _keep_rule(scores, top_k):
  """Selection rule: per query t, the top_k highest-scoring rows among 0..t (all if fewer);
  equal scores keep the lower row first (as `lax.top_k` does). Also returns the margins that
  decide each selection, so a test can rule out float32 flips."""
  t_len = scores.shape[0]
  keep = np.zeros((t_len, t_len), bool)
  margins = []
  for t in range(t_len):
    order = np.argsort(-scores[t, :t + 1], kind="stable")
    keep[t, order[:top_k]] = True
    if t + 1 > top_k:
      s = np.sort(scores[t, :t + 1])[::-1]
      if s[top_k - 1] == s[top_k] == 0.0:
        # ReLU ties at exactly zero: both sides keep the lowest rows first; nothing may sit
        # just above zero, where float32 could round it either way.
        positive = s[s > 0]
        margins.append(positive.min() if positive.size else np.inf)
      else:
        margins.append(s[top_k - 1] - s[top_k])
  return keep, margins


def reference_logits(w, spec: TinyDsaSpec, ids, *, sparse=True):
  """Returns (logits [T, V], smallest top-k score margin seen)."""
  g = {k: v.astype(np.float64) for k, v in w.items()}
  t_len = len(ids)
  pos = np.arange(t_len, dtype=np.float64)
  x = g["token_embd.weight"][ids]
  h, nope = spec.n_heads, spec.qk_nope
  causal = np.tril(np.ones((t_len, t_len), bool))
  keep, margins = causal, [np.inf]
  for i in range(spec.n_layers):
    p = f"blk.{i}."
    a = _rms(x, g[p + "attn_norm.weight"], spec.eps)
    cq = _rms(a @ g[p + "attn_q_a.weight"].T, g[p + "attn_q_a_norm.weight"], spec.eps)
    q = (cq @ g[p + "attn_q_b.weight"].T).reshape(t_len, h, nope + spec.qk_rope)
    q_nope, q_pe = q[..., :nope], _rope_pairs(q[..., nope:], pos, spec.rope_theta)
    kv = a @ g[p + "attn_kv_a_mqa.weight"].T
    c = _rms(kv[:, :spec.kv_lora], g[p + "attn_kv_a_norm.weight"], spec.eps)
    k_pe = _rope_pairs(kv[:, spec.kv_lora:], pos, spec.rope_theta)
    k_nope = np.einsum("sc,hcn->shn", c, g[p + "attn_k_b.weight"])
    v = np.einsum("sc,hvc->shv", c, g[p + "attn_v_b.weight"])
    if spec.indexer_types[i]:
      iq = (cq @ g[p + "indexer.attn_q_b.weight"].T).reshape(t_len, spec.indexer_heads, -1)
      iq[..., :spec.qk_rope] = _rope_pairs(iq[..., :spec.qk_rope], pos, spec.rope_theta)
      ik = a @ g[p + "indexer.attn_k.weight"].T
      mu, var = ik.mean(-1, keepdims=True), ik.var(-1, keepdims=True)
      ik = (ik - mu) / np.sqrt(var + 1e-6) * g[p + "indexer.k_norm.weight"] + g[
          p + "indexer.k_norm.bias"]
      ik[:, :spec.qk_rope] = _rope_pairs(ik[:, :spec.qk_rope], pos, spec.rope_theta)
      hw = (a @ g[p + "indexer.proj.weight"].T) / np.sqrt(spec.indexer_heads)
      dots = np.maximum(np.einsum("thd,sd->ths", iq, ik) / np.sqrt(spec.indexer_dim), 0.0)
      scores = np.einsum("ths,th->ts", dots, hw)
      if sparse:
        keep, m = _keep_rule(scores, spec.index_topk)
        margins += m
    # a layer without its own indexer reuses the previous layer's `keep`
    s = (np.einsum("thn,shn->hts", q_nope, k_nope) + np.einsum("thr,sr->hts", q_pe, k_pe))
    s = np.where(keep & causal, s / np.sqrt(nope + spec.qk_rope), -np.inf)
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    o = np.einsum("hts,shv->thv", prob, v).reshape(t_len, -1)
    x = x + o @ g[p + "attn_output.weight"].T
    m_in = _rms(x, g[p + "ffn_norm.weight"], spec.eps)
    gate = m_in @ g[p + "ffn_gate.weight"].T
    x = x + ((gate / (1 + np.exp(-gate))) * (m_in @ g[p + "ffn_up.weight"].T)) @ g[
        p + "ffn_down.weight"].T
  hidden = _rms(x, g["output_norm.weight"], spec.eps)
  return hidden @ g["output.weight"].T, min(margins)


class SelectTopRowsTest(absltest.TestCase):

  def test_matches_the_numpy_rule(self):
    rng = np.random.default_rng(3)
    scores = rng.standard_normal((1, 9, 9)).astype(np.float32)
    got = np.asarray(select_top_rows(scores, np.arange(9)[None], 3))[0]
    want, _ = _keep_rule(scores[0].astype(np.float64), 3)
    np.testing.assert_array_equal(got, want)
    self.assertEqual(got.sum(1).tolist(), [1, 2, 3, 3, 3, 3, 3, 3, 3])


class SparseTinyModelTest(absltest.TestCase):
  """index_topk (4) well below the context: the sparse path runs in prefill and decode."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    cls.spec = TinyDsaSpec()
    path = pathlib.Path(cls.tmp.name) / "tiny-dsa.gguf"
    cls.weights = write_tiny_dsa_gguf(path, cls.spec)
    cls.model = mtpjax.load(path)

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def test_config_reads_the_indexer_keys(self):
    cfg = self.model.config
    self.assertEqual((cfg.arch, cfg.indexer_heads, cfg.indexer_dim, cfg.indexer_topk),
                     ("glm-dsa", 2, 16, 4))
    self.assertEqual(cfg.indexer_full, (True, False))
    self.assertFalse(cfg.has_mtp)

  def test_sparse_logits_match_the_numpy_selection_rule(self):
    ids = (np.arange(20) * 37 + 11) % self.spec.vocab_size
    want, margin = reference_logits(self.weights, self.spec, ids)
    self.assertGreater(margin, 1e-3)      # no near-ties: float32 picks the same rows
    dense, _ = reference_logits(self.weights, self.spec, ids, sparse=False)
    self.assertGreater(np.abs(dense - want).max(), 0.05)   # the selection matters here
    np.testing.assert_allclose(self.model.logits(ids), want, atol=1e-4, rtol=0)

  def test_decode_with_cached_indexer_keys_matches_reference_greedy(self):
    prompt = np.array([5, 77, 140, 9, 201, 33], np.int64)
    ids = list(prompt)
    for _ in range(8):
      logits, _ = reference_logits(self.weights, self.spec, np.array(ids))
      ids.append(int(np.argmax(logits[-1])))
    result = self.model.generate(prompt, max_new_tokens=8, speculative="disabled")
    self.assertEqual(result.tokens, ids[len(prompt):])

  def test_cache_shapes(self):
    cfg = self.model.config
    for k, v in cache_shapes(cfg, cfg.n_layers, 1, 64):
      self.assertEqual(k, (1, 64, 1, cfg.kv_lora_rank + cfg.rope_dims))
      self.assertEqual(v, (1, 64, 1, cfg.indexer_dim))


class GlmDsaFixtureTest(ReferenceFixtureChecks, absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.ref = np.load(FIXTURE / "hf_ref.npz")
    cls.model = mtpjax.load(FIXTURE / "glmdsa_h64-F32.gguf")

  def test_config(self):
    cfg = self.model.config
    self.assertEqual((cfg.arch, cfg.indexer_heads, cfg.indexer_dim, cfg.indexer_topk),
                     ("glm-dsa", 2, 32, 2048))
    self.assertEqual(cfg.indexer_full, (True, True, True))
    self.assertTrue(cfg.has_mtp and cfg.mtp_head)
    self.assertFalse(cfg.layer_has_indexer(cfg.mtp_layer))   # the MTP block attends densely

  def test_kv_cache_holds_latent_plus_rope_key_per_token(self):
    cfg = self.model.config
    state = self.model.engine(native_mtp=True, max_len=64).init_state()
    for latent, index_keys in list(state.kv[0]) + [state.mtp.kv]:
      self.assertEqual(latent.shape[2:], (1, cfg.kv_lora_rank + cfg.rope_dims))
      self.assertEqual(index_keys.shape[2:], (1, cfg.indexer_dim))


if __name__ == "__main__":
  absltest.main()
