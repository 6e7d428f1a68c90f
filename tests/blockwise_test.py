"""Attention over a cache longer than one block (the online-softmax loop) against plain numpy
softmax attention over every visible row."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from mtpjax.models import blockwise, kv_cache

LENGTH = 2 * blockwise.BLOCK + 70      # three blocks, the last one partial


def _softmax_rows(scores, visible):
  scores = np.where(visible, scores, -np.inf)
  e = np.exp(scores - scores.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


class BlockwiseAttentionTest(parameterized.TestCase):

  @parameterized.parameters((1, 0), (1, LENGTH - 1), (2, 300), (16, LENGTH - 16), (16, 5))
  def test_gqa_matches_dense_numpy(self, t, start):
    rng = np.random.default_rng(t + start)
    b, h, hkv, hd, vd = 2, 4, 2, 8, 6
    k_cache = rng.normal(size=(b, hkv, LENGTH, hd)).astype(np.float32)
    v_cache = rng.normal(size=(b, hkv, vd, LENGTH)).astype(np.float32)
    q = rng.normal(size=(b, t, h, hd)).astype(np.float32)
    k = rng.normal(size=(b, t, hkv, hd)).astype(np.float32)
    v = rng.normal(size=(b, t, hkv, vd)).astype(np.float32)
    starts = np.array([start, max(start - 40, 0)])
    positions = (starts[:, None] + np.arange(t)[None]).astype(np.int32)
    out, (k_new, v_new) = jax.jit(kv_cache.attention)((k_cache, v_cache), q, k, v,
                                                   kv_cache.AttentionMetadata(positions))
    keys, values = k_cache.copy(), v_cache.copy()
    for s in range(b):
      keys[s, :, starts[s]:starts[s] + t] = k[s].transpose(1, 0, 2)
      values[s, :, :, starts[s]:starts[s] + t] = v[s].transpose(1, 2, 0)
    np.testing.assert_array_equal(k_new, keys)
    want = np.zeros((b, t, h, vd), np.float32)
    for s in range(b):
      for i in range(t):
        for head in range(h):
          kv = head // (h // hkv)
          scores = keys[s, kv] @ q[s, i, head] / np.sqrt(hd)
          probs = _softmax_rows(scores, np.arange(LENGTH) <= positions[s, i])
          want[s, i, head] = values[s, kv] @ probs
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)

  def test_latent_with_a_selection_matches_dense_numpy(self):
    rng = np.random.default_rng(3)
    b, t, h, c, r = 1, 2, 2, 8, 4
    cache = rng.normal(size=(b, LENGTH, 1, c + r)).astype(np.float32)
    row = rng.normal(size=(b, t, 1, c + r)).astype(np.float32)
    q_lat = rng.normal(size=(b, t, h, c)).astype(np.float32)
    q_pe = rng.normal(size=(b, t, h, r)).astype(np.float32)
    positions = np.array([[400, 401]], np.int32)
    selected = rng.random((b, t, LENGTH)) < 0.3
    out, _ = jax.jit(kv_cache.latent_attention, static_argnums=5)(
        cache, row, q_lat, q_pe, kv_cache.AttentionMetadata(positions), 0.5, selected)
    rows = cache[0, :, 0].copy()
    rows[400:402] = row[0, :, 0]
    for i in range(t):
      visible = (np.arange(LENGTH) <= positions[0, i]) & selected[0, i]
      for head in range(h):
        scores = (rows[:, :c] @ q_lat[0, i, head] + rows[:, c:] @ q_pe[0, i, head]) * 0.5
        want = rows[:, :c].T @ _softmax_rows(scores, visible)
        np.testing.assert_allclose(out[0, i, head], want, atol=2e-5, rtol=2e-5)


if __name__ == "__main__":
  absltest.main()
