"""Pallas: a step's query rows attending over their slot's pages, each page read once.

The grid is (slot, KV head, page), pages innermost: a program takes one page of keys and values
that the slot's page table names (prefetched as scalars) and folds it into the slot's running
softmax (max, sum and weighted values in scratch memory, the FlashAttention recurrence); the
last page writes the rows out. Pages past the slot's highest position repeat the last page's
block index, so the pipeline copies nothing for them, and their programs do no work: a step
reads the pages its slots hold, not the table's length.

One layout serves both of GLM's attentions:
- GQA (GLM-4.5-Air): a KV head's group of query heads by the step's rows are its query rows;
  keys `[P, Hkv, R, d]`, values `[P, Hkv, vd, R]` (`models/kv_cache.py`'s pools).
- MLA latent rows (GLM-4.7-Flash): one "KV head" whose keys are the latent rows `[P, 1, R, c+r]`
  and whose values are their first `c` columns (`values=None`, `value_width=c`).

A program folds its query rows into the softmax ROW_TILE at a time through one loop body, so
a row's value does not depend on how many rows share the step (a verify's k + 1 rows a slot
against a decode's one). On CPU it runs in Pallas' interpreter: checking only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Query rows a fold computes at once (a sublane tile): every step's rows go through this one
# shape, so a row's value is its own whatever rows share its slot's step.
ROW_TILE = 8
# A masked score: finite, so a running max over a page with no visible row stays a number
# (every row sees page 0's row 0, so it is never the max once the first page is folded in).
_MASKED = -1e30


def paged(q: jax.Array, q_positions: jax.Array, keys: jax.Array, values: jax.Array | None,
          table: jax.Array, *, value_width: int, interpret: bool) -> jax.Array:
  """softmax(q . keys over rows j <= the query's position) . values, per slot and KV head.

  q: float32 `[b, Hkv, M, d]`, already scaled; q_positions: int32 `[b, M]` (each query row's
  absolute position); keys: pages `[P, Hkv, R, d]`; values: pages `[P, Hkv, vd, R]`, or None
  to take the keys' first `value_width` columns; table: int32 `[b, max_pages]` (an entry past
  the pool is a page not allocated, masked by position). Pools of uint16 hold bfloat16 bits.
  Returns float32 `[b, Hkv, M, value_width]`."""
  b, hkv, rows, d = q.shape
  # query rows padded to whole tiles (a padded row sees row 0; its output is dropped)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, -rows % ROW_TILE), (0, 0)))
  q_positions = jnp.pad(q_positions, ((0, 0), (0, -rows % ROW_TILE)))
  m = q.shape[2]
  pool, _, page_rows, _ = keys.shape
  max_pages = table.shape[1]
  # the last page a slot's rows can see, clamped into the table and the pool
  last = jnp.minimum(jnp.max(q_positions, axis=1) // page_rows, max_pages - 1).astype(jnp.int32)
  table = jnp.minimum(table, pool - 1).astype(jnp.int32)

  def page_of(s, p, table, last):
    return table[s, jnp.minimum(p, last[s])]

  def kernel(table_ref, last_ref, q_ref, pos_ref, k_ref, *rest):
    del table_ref   # read by the index maps
    v_ref = rest[0] if values is not None else None
    out_ref, peak, total, acc = rest[-4:]
    s, p = pl.program_id(0), pl.program_id(2)

    @pl.when(p == 0)
    def _():
      peak[...] = jnp.full(peak.shape, _MASKED, jnp.float32)
      total[...] = jnp.zeros(total.shape, jnp.float32)
      acc[...] = jnp.zeros(acc.shape, jnp.float32)

    @pl.when(p <= last_ref[s])
    def _():
      k = _float32(k_ref[...])                                          # [R, d]
      v = k[:, :value_width].T if v_ref is None else _float32(v_ref[...])   # [vd, R]

      def fold(i, carry):   # ROW_TILE query rows: one shape for every tile, so row by row
        rows = pl.ds(pl.multiple_of(i * ROW_TILE, ROW_TILE), ROW_TILE)
        scores = jax.lax.dot_general(q_ref[rows, :], k, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)   # [ROW_TILE, R]
        key_pos = p * page_rows + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        seen = key_pos <= pos_ref[rows, :]
        scores = jnp.where(seen, scores, _MASKED)
        new_peak = jnp.maximum(peak[rows, :], jnp.max(scores, axis=1, keepdims=True))
        probs = jnp.where(seen, jnp.exp(scores - new_peak), 0.0)
        rescale = jnp.exp(peak[rows, :] - new_peak)
        weighted = jax.lax.dot_general(probs, v, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)
        total[rows, :] = total[rows, :] * rescale + jnp.sum(probs, axis=1, keepdims=True)
        acc[rows, :] = acc[rows, :] * rescale + weighted
        peak[rows, :] = new_peak
        return carry

      jax.lax.fori_loop(0, m // ROW_TILE, fold, 0)

    @pl.when(p == max_pages - 1)
    def _():
      out_ref[...] = acc[...] / total[...]

  page_map = lambda s, h, p, table, last: (page_of(s, p, table, last), h, 0, 0)
  in_specs = [pl.BlockSpec((None, None, m, d), lambda s, h, p, *_: (s, h, 0, 0)),
              pl.BlockSpec((None, m, 1), lambda s, h, p, *_: (s, 0, 0)),
              pl.BlockSpec((None, None, page_rows, d), page_map)]
  operands = [q, q_positions.astype(jnp.int32)[..., None], keys]
  if values is not None:
    in_specs.append(pl.BlockSpec((None, None) + values.shape[2:], page_map))
    operands.append(values)
  grid = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(b, hkv, max_pages), in_specs=in_specs,
      out_specs=pl.BlockSpec((None, None, m, value_width), lambda s, h, p, *_: (s, h, 0, 0)),
      scratch_shapes=[pltpu.VMEM((m, 1), jnp.float32), pltpu.VMEM((m, 1), jnp.float32),
                      pltpu.VMEM((m, value_width), jnp.float32)])
  out = pl.pallas_call(
      kernel, grid_spec=grid, interpret=interpret,
      out_shape=jax.ShapeDtypeStruct((b, hkv, m, value_width), jnp.float32),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
  )(table, last, *operands)
  return out[:, :, :rows]


def _float32(rows: jax.Array) -> jax.Array:
  """Cache rows as float32 values (a uint16 pool holds bfloat16 bits: XLA:CPU's storage)."""
  if rows.dtype == jnp.uint16:
    rows = jax.lax.bitcast_convert_type(rows, jnp.bfloat16)
  return rows.astype(jnp.float32)
