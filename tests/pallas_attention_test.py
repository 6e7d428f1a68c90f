"""The Pallas paged attention (`mtpjax/kernels/pallas_attention.py`), run by Pallas' interpreter:
against a plain numpy softmax over each slot's rows read through its page table, a row's value
alone and beside other rows, the cache's entry points with `pallas` against `xla`, and its
lowering for TPU with `jax.export` on this CPU machine.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax import export

from mtpjax.kernels import backend, pallas_attention
from mtpjax.models import kv_cache

R, POOL, MAX_PAGES = 4, 16, 5
# slot 1 holds a single row; slot 2 reaches into its last page
POSITIONS = np.array([[6, 7], [0, 0], [17, 18]])


def _table(rng):
  """Each slot's pages, distinct, the ones past its rows not allocated (POOL)."""
  pages = rng.permutation(POOL)[:3 * MAX_PAGES].reshape(3, MAX_PAGES)
  held = POSITIONS.max(axis=1) // R
  return np.where(np.arange(MAX_PAGES)[None] <= held[:, None], pages, POOL).astype(np.int32)


def _reference(q, positions, keys, values, table):
  """numpy float64: q [b, Hkv, M, d]; keys [P, Hkv, R, d]; values [P, Hkv, R, vd]."""
  b, hkv, m, _ = q.shape
  out = np.zeros((b, hkv, m, values.shape[-1]))
  for s in range(b):
    for h in range(hkv):
      for i in range(m):
        n = positions[s, i] + 1
        rows = [table[s, j // R] for j in range(n)]
        k = np.stack([keys[p, h, j % R] for j, p in zip(range(n), rows)]).astype(np.float64)
        v = np.stack([values[p, h, j % R] for j, p in zip(range(n), rows)]).astype(np.float64)
        scores = k @ q[s, h, i]
        probs = np.exp(scores - scores.max())
        out[s, h, i] = probs @ v / probs.sum()
  return out


def _paged(q, positions, keys, values, table, value_width):
  return jax.jit(lambda *a: pallas_attention.paged(*a, value_width=value_width,
                                                   interpret=True))(
      jnp.asarray(q), jnp.asarray(positions), jnp.asarray(keys),
      None if values is None else jnp.asarray(values), jnp.asarray(table))


class PagedAttentionKernelTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.rng = np.random.default_rng(0)
    self.table = _table(self.rng)

  def _gqa(self, hkv=2, group=3, hd=16, vd=8):
    q = self.rng.standard_normal((3, hkv, 2 * group, hd)).astype(np.float32)
    keys = self.rng.standard_normal((POOL, hkv, R, hd)).astype(np.float32)
    values = self.rng.standard_normal((POOL, hkv, vd, R)).astype(np.float32)
    return q, np.repeat(POSITIONS, group, axis=1), keys, values

  def test_gqa_rows_equal_a_numpy_softmax_over_their_pages(self):
    q, positions, keys, values = self._gqa()
    got = np.asarray(_paged(q, positions, keys, values, self.table, values.shape[2]))
    want = _reference(q, positions, keys, values.swapaxes(2, 3), self.table)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)

  def test_latent_rows_are_their_own_values(self):
    # MLA: one KV head whose values are the latent rows' first columns
    latent, rope = 12, 4
    q = self.rng.standard_normal((3, 1, 8, latent + rope)).astype(np.float32)
    rows = self.rng.standard_normal((POOL, 1, R, latent + rope)).astype(np.float32)
    positions = np.repeat(POSITIONS, 4, axis=1)
    got = np.asarray(_paged(q, positions, rows, None, self.table, latent))
    want = _reference(q, positions, rows, rows[..., :latent], self.table)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)

  def test_bfloat16_bits_read_as_their_values(self):
    q, positions, keys, values = self._gqa()
    as_bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(
        jnp.asarray(a, jnp.bfloat16), jnp.uint16))
    got = np.asarray(_paged(q, positions, as_bits(keys), as_bits(values), self.table, 8))
    rounded = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
    want = _reference(q, positions, rounded(keys), rounded(values).swapaxes(2, 3), self.table)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)

  def test_a_rows_value_does_not_depend_on_the_rows_beside_it(self):
    # slot 2's last step row (a verify's k + 1 rows against a decode's one)
    q, positions, keys, values = self._gqa(group=1)
    beside = np.asarray(_paged(q, positions, keys, values, self.table, 8))
    alone = np.asarray(_paged(q[2:, :, 1:], positions[2:, 1:], keys, values, self.table[2:], 8))
    np.testing.assert_array_equal(beside[2, :, 1], alone[0, :, 0])

  @parameterized.parameters(False, True)
  def test_it_lowers_for_tpu(self, latent):
    shape = jax.ShapeDtypeStruct
    if latent:   # GLM-4.7-Flash: 20 heads by 4 rows, 512 + 64 latent columns, 64-row pages
      args = (shape((8, 1, 80, 576), jnp.float32), shape((8, 80), jnp.int32),
              shape((64, 1, 64, 576), jnp.bfloat16), None, shape((8, 16), jnp.int32))
      width = 512
    else:        # GLM-4.5-Air: 8 KV heads of 12 query heads, 128 wide
      args = (shape((8, 8, 48, 128), jnp.float32), shape((8, 48), jnp.int32),
              shape((64, 8, 64, 128), jnp.bfloat16), shape((64, 8, 128, 64), jnp.bfloat16),
              shape((8, 16), jnp.int32))
      width = 128
    paged = jax.jit(lambda q, pos, k, v, t: pallas_attention.paged(
        q, pos, k, v, t, value_width=width, interpret=False))
    exported = export.export(paged, platforms=("tpu",))(*args)
    self.assertIn("tpu_custom_call", exported.mlir_module())


class CacheEntryPointsTest(absltest.TestCase):
  """`kv_cache.attention` and `latent_attention` of a step with `pallas` equal `xla`."""

  def _run(self, entry_point, name, *args, **static):
    meta = kv_cache.AttentionMetadata(jnp.asarray(POSITIONS), jnp.asarray(_table(
        np.random.default_rng(0))), backend.Kernels(name, "cpu", steps=True))
    return jax.jit(lambda *a: entry_point(*a, meta, **static))(*args)

  def test_gqa(self):
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((3, 2, h, 16)), jnp.float32) for h in (6, 2, 2))
    k_pool, v_pool = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                      for s in ((POOL, 2, R, 16), (POOL, 2, 16, R)))
    want, want_cache = self._run(kv_cache.attention, "xla", (k_pool, v_pool), q, k, v)
    got, got_cache = self._run(kv_cache.attention, "pallas", (k_pool, v_pool), q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    for a, b in zip(got_cache, want_cache):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  def test_latent(self):
    rng = np.random.default_rng(2)
    pool = jnp.asarray(rng.standard_normal((POOL, R, 1, 20)), jnp.float32)
    row = jnp.asarray(rng.standard_normal((3, 2, 1, 20)), jnp.float32)
    q_lat = jnp.asarray(rng.standard_normal((3, 2, 4, 16)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((3, 2, 4, 4)), jnp.float32)
    attend = lambda name: self._run(kv_cache.latent_attention, name, pool, row, q_lat, q_pe,
                                    scale=0.2)
    (want, want_cache), (got, got_cache) = attend("xla"), attend("pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))


if __name__ == "__main__":
  absltest.main()
