"""The KV cache: its layouts, its row writes and the attention that reads it, in one place.

Every attention module calls one function here per step (`attention` for GQA, `latent_attention`
for MLA's latent rows, `append_rows` for other per-token rows such as the glm-dsa indexer keys),
so a paged layout or a fused kernel is chosen here and nowhere else.

A cache comes in two layouts of the same arrays, chosen by the step's `AttentionMetadata`:
- paged (`page_table` set; the engine's trunk and NextN caches): a pool of fixed-size
  pages, [P, ...] with R rows on the sequence axis, and a page table [b, max_pages] per slot, so memory
  follows the tokens held. Row p of a slot lives at row p % R of page table[p // R]. A
  table entry of P (past the pool) is a page not allocated: writes there are dropped (a
  padded prefill tail, a draft row past what the slot holds) and reads, clipped to a real
  page, are masked by position;
- per slot (`page_table` None; full forwards and their references): [B, ...] with rows on a
  sequence axis.
The shapes are `gqa_cache_shapes` / `row_cache_shape` for both, pages in place of slots and R
in place of the length. Rows past a slot's position are stale and masked, which is the whole
rollback mechanism of speculative decoding: a rejected draft's rows are rewritten before
anything reads them.

On XLA:CPU a bfloat16 cache is stored as its uint16 bits (`storage_dtype`; every write and
read here converts): XLA:CPU has no bfloat16 scatter or dynamic-update-slice, and writing one
row into a bfloat16 pool converts the whole pool to float32 and back (1.0 ms a step for a 4 MB
pool, 0.012 ms for its bits), so a step would cost the pool's size, not the rows held.
Accelerators write bfloat16 natively and keep it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mtpjax.kernels import backend, native, pallas_attention
from mtpjax.models import blockwise


class AttentionMetadata(NamedTuple):
  """What every attention call of a step reads besides its cache: the rows' absolute
  positions [b, T], the slots' page tables [b, max_pages] (None: per-slot caches), and the
  model's kernels (None: this platform's default), `steps` set in a decode or verify step."""
  positions: jax.Array
  page_table: jax.Array | None = None
  kernels: backend.Kernels | None = None


def storage_dtype(dtype) -> jnp.dtype:
  """The dtype a cache of `dtype` values is stored in: uint16 bits for bfloat16 on XLA:CPU
  (which writes float16 rows in place, but converts a whole bfloat16 pool per write)."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.bfloat16 and backend.stores_bfloat16_as_bits():
    return jnp.dtype(jnp.uint16)
  return dtype


def _stored(rows: jax.Array, cache_dtype) -> jax.Array:
  """`rows` as a cache of `cache_dtype` (a `storage_dtype`) stores them."""
  if cache_dtype == jnp.uint16:
    return jax.lax.bitcast_convert_type(rows.astype(jnp.bfloat16), jnp.uint16)
  return rows.astype(cache_dtype)


def _values(rows: jax.Array) -> jax.Array:
  """Rows read from a cache as the values they hold (bfloat16 from stored bits)."""
  return jax.lax.bitcast_convert_type(rows, jnp.bfloat16) if rows.dtype == jnp.uint16 else rows


def gqa_cache_shapes(batch: int, kv_heads: int, head_dim: int, value_dim: int,
                     length: int) -> tuple[tuple, tuple]:
  """(k, v) shapes: [B, Hkv, S, head_dim] and [B, Hkv, value_dim, S] (see `attention` for why)."""
  return (batch, kv_heads, length, head_dim), (batch, kv_heads, value_dim, length)


def row_cache_shape(batch: int, length: int, width: int) -> tuple:
  """One MQA-like row of `width` values per position: [B, S, 1, width] (MLA latents, indexer
  keys; a zero width makes an empty cache for a layer that needs none)."""
  return (batch, length, 1, width)


def tiles_blocks(page_rows: int) -> bool:
  """Whether pages of `page_rows` rows tile `blockwise` blocks (a power of two up to BLOCK),
  as the paged reads need: every block is whole pages."""
  return 0 < page_rows <= blockwise.BLOCK and not page_rows & (page_rows - 1)


def write_rows(cache: jax.Array, rows: jax.Array, start: jax.Array,
               seq_axis: int = 1) -> jax.Array:
  """Write `rows` into a per-slot `cache` at per-slot row `start` [B] along `seq_axis` (a full
  forward's caches: one slot per sequence, every row inside the cache)."""
  put = lambda c, r, s: jax.lax.dynamic_update_slice_in_dim(c, _stored(r, c.dtype), s,
                                                            axis=seq_axis - 1)
  return jax.vmap(put)(cache, rows, start)


def append_rows(cache: jax.Array, rows: jax.Array, meta: AttentionMetadata
                ) -> tuple[jax.Array, jax.Array]:
  """Write a row cache's new rows [b, T, 1, width] at `meta.positions` [b, T]; returns (the live
  slots' rows [b, S, width] to read, the whole updated cache)."""
  read, length, cache = _row_reader(cache, rows, meta)
  return read(0, length), cache


def sequence_length(row_cache: jax.Array, meta: AttentionMetadata) -> int:
  """S, the rows a slot's sequence can hold in a row cache (pages x rows a page, paged)."""
  if meta.page_table is None:
    return row_cache.shape[1]
  return meta.page_table.shape[1] * row_cache.shape[1]


def _row_reader(cache: jax.Array, rows: jax.Array, meta: AttentionMetadata):
  """Write rows [b, T, 1, width] into a row cache; returns (read(first, n) -> float32 rows
  [b, n, width] of every slot's sequence, the sequence length S, the new cache)."""
  b = rows.shape[0]
  if meta.page_table is None:
    cache = write_rows(cache, rows, meta.positions[:, 0])
    seq = cache[:, :, 0]
    return (lambda first, n: _values(window_rows(seq, first, n, 1)).astype(jnp.float32),
            seq.shape[1], cache)
  page_rows = cache.shape[1]
  cache = scatter_rows(cache, rows, meta)
  read = lambda first, n: _gather_pages(cache, meta.page_table, first, n, page_rows).reshape(
      b, n, cache.shape[-1]).astype(jnp.float32)
  return read, sequence_length(cache, meta), cache


def scatter_rows(pool: jax.Array, rows: jax.Array, meta: AttentionMetadata) -> jax.Array:
  """Write rows [b, T, ...] at `meta.positions` into pages [P, R, ...] through the table (a
  row cache, or the NextN block's history); a row on no page is dropped."""
  pages, offsets = _pages_of(meta, pool.shape[1], pool.shape[0])
  return pool.at[pages, offsets].set(_stored(rows, pool.dtype), mode="drop")


def gather_rows(pool: jax.Array, meta: AttentionMetadata) -> jax.Array:
  """The rows [b, T, ...] at `meta.positions` of pages [P, R, ...]; a row on no page reads as
  some page's row (past the slot's position: callers mask or rewrite it)."""
  pages, offsets = _pages_of(meta, pool.shape[1], pool.shape[0])
  return _values(pool.at[pages, offsets].get(mode="clip"))


def _pages_of(meta: AttentionMetadata, page_rows: int, pool_pages: int
              ) -> tuple[jax.Array, jax.Array]:
  """(page, row in the page) [b, T] of each written row; a row past the table or on a page
  not allocated gets page P, past the pool, so a `mode="drop"` scatter skips it."""
  table = meta.page_table
  index = meta.positions // page_rows
  pages = jnp.take_along_axis(table, jnp.minimum(index, table.shape[1] - 1), axis=1)
  return jnp.where(index < table.shape[1], pages, pool_pages), meta.positions % page_rows


def _gather_pages(pool: jax.Array, table: jax.Array, first, n: int, page_rows: int
                  ) -> jax.Array:
  """The pages holding rows [first, first + n) of every slot, [b, n // R, ...] (R rows a page;
  `first` and `n` are multiples of R: blocks are whole pages), as the values they hold. A page
  not allocated reads as the pool's last page: its rows lie past the slot's position and are
  masked."""
  count = n // page_rows
  ids = table if count == table.shape[1] else jax.lax.dynamic_slice_in_dim(
      table, first // page_rows, count, axis=1)
  return _values(jnp.take(pool, ids, axis=0, mode="clip"))


def window_rows(cache: jax.Array, first, n: int, axis: int) -> jax.Array:
  """Rows [first, first + n) along `axis`; the whole array, unsliced, when n covers it (a
  full-length dynamic slice makes XLA:CPU copy the cache)."""
  if n == cache.shape[axis]:
    return cache
  return jax.lax.dynamic_slice_in_dim(cache, first, n, axis=axis)


def attention(cache: tuple[jax.Array, jax.Array], q: jax.Array, k: jax.Array, v: jax.Array,
              meta: AttentionMetadata) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """Write the step's keys and values, then attend from `q` to cache rows j <= position (GQA).

  q: [b, T, H, hd]; k: [b, T, Hkv, hd]; v: [b, T, Hkv, vd]; `meta.positions` [b, T] absolute.
  The cache is k [B, Hkv, S, hd] and v [B, Hkv, vd, S] (pages: [P, Hkv, R, hd] and
  [P, Hkv, vd, R]): with these layouts XLA:CPU reads a per-slot cache in place; with any
  other (e.g. [B, S, Hkv, d] or values [B, Hkv, S, vd]) it transposes, i.e. copies, every
  layer's whole cache at every step, and a block of pages gathers into the einsums' order.
  Returns ([b, T, H, vd], the new cache).
  """
  if meta.page_table is not None:
    return _paged_attention(cache, q, k, v, meta)
  positions = meta.positions
  k_cache, v_cache = cache
  start = positions[:, 0]
  k_cache = write_rows(k_cache, k.transpose(0, 2, 1, 3), start, seq_axis=2)
  v_cache = write_rows(v_cache, v.transpose(0, 2, 3, 1), start, seq_axis=3)
  b, t, h, hd = q.shape
  hkv, vd = k_cache.shape[1], v_cache.shape[2]
  dtype = q.dtype
  q = q.reshape(b, t, hkv, h // hkv, hd).astype(jnp.float32) / jnp.sqrt(jnp.float32(hd))
  rows = lambda cache, first, n, axis: _values(window_rows(cache, first, n, axis)).astype(
      jnp.float32)
  out = blockwise.attend(
      lambda first, n: jnp.einsum("btkgd,bksd->bkgts", q, rows(k_cache, first, n, 2)),
      lambda first, n: _causal(first, n, positions),
      # Summed straight into [b, T, k, g, vd]: a transpose after it makes XLA:CPU copy the
      # key cache of a one-slot step.
      lambda first, n, probs: jnp.einsum("bkgts,bkds->btkgd", probs, rows(v_cache, first, n, 3)),
      positions, k_cache.shape[2], align=lambda a: a.transpose(0, 3, 1, 2))
  return out.reshape(b, t, h, vd).astype(dtype), (k_cache, v_cache)


def _causal(first, n: int, positions: jax.Array) -> jax.Array:
  """Rows [first, first + n) visible to each query, [b, 1, 1, T, n] (GQA's score axes)."""
  return (first + jnp.arange(n))[None, None, None, None, :] <= positions[:, None, None, :, None]


def native_decode_attention(meta: AttentionMetadata) -> bool:
  """Whether paged GQA attention takes the native kernel: the rows of a decode or verify step
  (`Kernels.steps`, so a row attends alike in both) with `native` kernels. Prefill chunks keep
  the blockwise einsums, whose GEMMs suit many rows."""
  kernels = meta.kernels or backend.default()
  return kernels.native and kernels.steps


def _pallas_steps(meta: AttentionMetadata) -> bool:
  """Whether a step's paged attention takes the Pallas kernel (`pallas` kernels where it
  lowers): its rows attend alike however many share the step."""
  kernels = meta.kernels or backend.default()
  return kernels.steps and kernels.scalar_prefetch


def _paged_attention(cache, q, k, v, meta: AttentionMetadata):
  """`attention` over page pools: rows are scattered through the table, and each block of
  rows is its pages gathered, so a step reads the pages up to the highest position."""
  k_pool, v_pool = cache
  page_rows, table, positions = k_pool.shape[2], meta.page_table, meta.positions
  pages, offsets = _pages_of(meta, page_rows, k_pool.shape[0])
  k_pool = k_pool.at[pages, :, offsets].set(_stored(k, k_pool.dtype), mode="drop")
  v_pool = v_pool.at[pages, :, :, offsets].set(_stored(v, v_pool.dtype), mode="drop")
  b, t, h, hd = q.shape
  hkv, vd, dtype = k_pool.shape[1], v_pool.shape[2], q.dtype
  q = q.reshape(b, t, hkv, h // hkv, hd).astype(jnp.float32) / jnp.sqrt(jnp.float32(hd))
  if native_decode_attention(meta):
    out = native.paged_attention(q, k_pool, v_pool, table, positions)
    return out.reshape(b, t, h, vd).astype(dtype), (k_pool, v_pool)
  if _pallas_steps(meta):   # a KV head's query rows: its group's heads, row by row
    rows = q.transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * (h // hkv), hd)
    out = pallas_attention.paged(rows, jnp.repeat(positions, h // hkv, axis=1), k_pool, v_pool,
                                 table, value_width=vd, interpret=meta.kernels.interpret)
    out = out.reshape(b, hkv, t, h // hkv, vd).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, h, vd).astype(dtype), (k_pool, v_pool)
  gather = lambda pool, first, n: _gather_pages(pool, table, first, n, page_rows).astype(
      jnp.float32)

  def scores(first, n):         # keys [b, n / R, Hkv, R, hd]
    s = jnp.einsum("btkgd,bnkrd->bkgtnr", q, gather(k_pool, first, n))
    return s.reshape(s.shape[:4] + (n,))

  def weighted(first, n, probs):   # values [b, n / R, Hkv, vd, R]
    probs = probs.reshape(probs.shape[:4] + (n // page_rows, page_rows))
    return jnp.einsum("bkgtnr,bnkdr->btkgd", probs, gather(v_pool, first, n))

  out = blockwise.attend(scores, lambda first, n: _causal(first, n, positions), weighted,
                         positions, table.shape[1] * page_rows,
                         align=lambda a: a.transpose(0, 3, 1, 2))
  return out.reshape(b, t, h, vd).astype(dtype), (k_pool, v_pool)


def latent_attention(cache: jax.Array, row: jax.Array, q_lat: jax.Array, q_pe: jax.Array,
                     meta: AttentionMetadata, scale: float, selected: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array]:
  """MLA in the absorbed form: write the step's latent rows, then score and sum over them.

  row: [b, T, 1, kv_lora + rope] (normalised latent, rotated shared rope key); q_lat:
  [b, T, H, kv_lora] (q_nope already through attn_k_b); q_pe: [b, T, H, rope]; `selected`
  [b, T, S] (sparse attention) further restricts the causal rows j <= position.
  Returns (the latent output [b, T, H, kv_lora], the new cache).
  """
  positions = meta.positions
  kv_lora = q_lat.shape[-1]
  if meta.page_table is not None and selected is None and _pallas_steps(meta):
    cache = scatter_rows(cache, row, meta)
    b, t, h, _ = q_lat.shape
    rows = jnp.concatenate([q_lat, q_pe], axis=-1).astype(jnp.float32) * scale
    pool = cache.reshape(cache.shape[0], 1, cache.shape[1], cache.shape[-1])
    out = pallas_attention.paged(rows.reshape(b, 1, t * h, -1), jnp.repeat(positions, h, axis=1),
                                 pool, None, meta.page_table, value_width=kv_lora,
                                 interpret=meta.kernels.interpret)
    return out.reshape(b, t, h, kv_lora), cache
  window, length, cache = _row_reader(cache, row, meta)
  q_lat, q_pe = q_lat.astype(jnp.float32), q_pe.astype(jnp.float32)

  def scores(first, n):
    block = window(first, n)
    return (jnp.einsum("bthc,bsc->bhts", q_lat, block[..., :kv_lora])
            + jnp.einsum("bthr,bsr->bhts", q_pe, block[..., kv_lora:])) * scale

  def visible(first, n):
    seen = (first + jnp.arange(n))[None, None, :] <= positions[:, :, None]       # [b, T, n]
    if selected is not None:
      seen = seen & window_rows(selected, first, n, 2)
    return seen[:, None]

  out = blockwise.attend(
      scores, visible,
      lambda first, n, probs: jnp.einsum("bhts,bsc->bthc", probs, window(first, n)[..., :kv_lora]),
      positions, length, align=lambda a: a.transpose(0, 2, 1))
  return out, cache
