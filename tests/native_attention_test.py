"""The native paged decode attention (`kernels/paged_attention.cc`) against a float64 numpy
reference written here, against the blockwise XLA path it replaces in decode and verify steps,
and for the property MTP on == off rests on: a query row's result does not depend on the other
rows of its call."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from mtpjax.kernels import backend, native
from mtpjax.models import kv_cache, quantized

_POOL_DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


def reference(q, k_pool, v_pool, table, positions):
  """float64: each query row's softmax over rows j <= its position, read through the table."""
  b, t, hkv, g, _ = q.shape
  page_rows = k_pool.shape[2]
  out = np.zeros((b, t, hkv, g, v_pool.shape[2]))
  for s in range(b):
    for r in range(t):
      rows = np.arange(positions[s, r] + 1)
      pages, offsets = table[s, rows // page_rows], rows % page_rows
      for h in range(hkv):
        keys = k_pool[pages, h, offsets].astype(np.float64)             # [n, hd]
        values = v_pool[pages, h, :, offsets].astype(np.float64)        # [n, vd]
        scores = q[s, r, h].astype(np.float64) @ keys.T                 # [g, n]
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[s, r, h] = (weights / weights.sum(axis=1, keepdims=True)) @ values
  return out


def case(seed, *, slots=2, rows=3, kv_heads=2, group=3, head_dim=16, value_dim=8, page_rows=4,
         pool_pages=11, max_pages=5, positions=((9, 10, 11), (0, 17, 19)), dtype="float32"):
  """Random pools (values as the pool's dtype holds them), a table whose pages past each
  slot's last position are the out-of-pool page P (not allocated), and scaled queries."""
  rng = np.random.default_rng(seed)
  hold = lambda a: np.asarray(jnp.asarray(a).astype(_POOL_DTYPES[dtype]).astype(jnp.float32))
  k_pool = hold(rng.standard_normal((pool_pages, kv_heads, page_rows, head_dim)))
  v_pool = hold(rng.standard_normal((pool_pages, kv_heads, value_dim, page_rows)))
  positions = np.asarray(positions, np.int32)
  table = np.full((slots, max_pages), pool_pages, np.int32)
  for s in range(slots):
    used = positions[s].max() // page_rows + 1
    table[s, :used] = rng.choice(pool_pages, size=used, replace=False)
  q = rng.standard_normal((slots, rows, kv_heads, group, head_dim)).astype(np.float32) / 4
  return q, k_pool, v_pool, table, positions


def stored(pool, dtype):
  return kv_cache._stored(jnp.asarray(pool), kv_cache.storage_dtype(_POOL_DTYPES[dtype]))


@absltest.skipUnless(native.available(), "the native CPU kernels did not build here")
class NativeAttentionTest(parameterized.TestCase):

  @parameterized.parameters("float32", "float16", "bfloat16")
  def test_matches_a_float64_reference(self, dtype):
    q, k_pool, v_pool, table, positions = case(1, dtype=dtype)
    out = native.paged_attention(jnp.asarray(q), stored(k_pool, dtype), stored(v_pool, dtype),
                                 jnp.asarray(table), jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(out), reference(q, k_pool, v_pool, table, positions),
                               rtol=1e-5, atol=1e-5)

  @parameterized.parameters("float16", "bfloat16")
  def test_a_wide_group_and_widths_past_the_vector_lanes(self, dtype):
    # GLM-4.5-Air's 12 query heads a kv head share each converted page; head and value widths
    # of 24 and 20 take the 16-lane, 8-lane and scalar parts of the dots and value sums, and
    # 16-row pages with positions mid-page the eight-row lanes and their tails.
    q, k_pool, v_pool, table, positions = case(
        4, group=12, head_dim=24, value_dim=20, page_rows=16, pool_pages=9, max_pages=6,
        positions=((37, 38, 40), (5, 16, 77)), dtype=dtype)
    out = native.paged_attention(jnp.asarray(q), stored(k_pool, dtype), stored(v_pool, dtype),
                                 jnp.asarray(table), jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(out), reference(q, k_pool, v_pool, table, positions),
                               rtol=1e-5, atol=1e-5)

  def test_a_long_context_shared_with_helper_threads(self):
    # 2 slots x 2 kv heads reading ~3,000 rows each: past the threshold where helpers join.
    q, k_pool, v_pool, table, positions = case(
        2, rows=1, page_rows=16, pool_pages=400, max_pages=200, head_dim=64, value_dim=64,
        positions=((3001,), (2890,)), dtype="float16")
    out = native.paged_attention(jnp.asarray(q), stored(k_pool, "float16"),
                                 stored(v_pool, "float16"), jnp.asarray(table),
                                 jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(out), reference(q, k_pool, v_pool, table, positions),
                               rtol=1e-4, atol=1e-5)

  def test_a_rows_result_does_not_depend_on_the_other_rows(self):
    q, k_pool, v_pool, table, positions = case(3, dtype="float16")
    pools = stored(k_pool, "float16"), stored(v_pool, "float16")
    together = np.asarray(native.paged_attention(jnp.asarray(q), *pools, jnp.asarray(table),
                                                 jnp.asarray(positions)))
    for s in range(q.shape[0]):
      for r in range(q.shape[1]):
        alone = native.paged_attention(jnp.asarray(q[s:s + 1, r:r + 1]), *pools,
                                       jnp.asarray(table[s:s + 1]),
                                       jnp.asarray(positions[s:s + 1, r:r + 1]))
        np.testing.assert_array_equal(np.asarray(alone)[0, 0], together[s, r])

  @parameterized.parameters("float32", "float16", "bfloat16")
  def test_decode_steps_take_it_and_agree_with_the_blockwise_path(self, dtype):
    q, k_pool, v_pool, table, positions = case(4, dtype=dtype)
    rng = np.random.default_rng(5)
    b, t, hkv, g, hd = q.shape
    query = jnp.asarray(rng.standard_normal((b, t, hkv * g, hd)).astype(np.float32))
    keys = jnp.asarray(rng.standard_normal((b, t, hkv, hd)).astype(np.float32))
    values = jnp.asarray(rng.standard_normal((b, t, hkv, v_pool.shape[2])).astype(np.float32))
    kernels = backend.Kernels("native", "cpu")
    pools = (stored(k_pool, dtype), stored(v_pool, dtype))

    def attend(kernels):
      meta = kv_cache.AttentionMetadata(jnp.asarray(positions), jnp.asarray(table), kernels)
      fn = lambda pools, query, keys, values: kv_cache.attention(pools, query, keys, values, meta)
      return jax.jit(fn)(pools, query, keys, values), kv_cache.native_decode_attention(meta)

    (blockwise, (k_ref, v_ref)), prefill_native = attend(kernels)
    (native_out, (k_new, v_new)), step_native = attend(kernels.for_steps())
    self.assertEqual((prefill_native, step_native), (False, True))   # a step's rows take it
    np.testing.assert_array_equal(np.asarray(k_new), np.asarray(k_ref))
    np.testing.assert_array_equal(np.asarray(v_new), np.asarray(v_ref))
    np.testing.assert_allclose(np.asarray(native_out), np.asarray(blockwise), rtol=2e-5,
                               atol=2e-6)


if __name__ == "__main__":
  absltest.main()
