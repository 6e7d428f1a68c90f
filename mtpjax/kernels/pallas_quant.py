"""Pallas: rows against GGUF-quantized matrices, each block read once for all rows.

The grid walks tiles of output rows (and, for a prefill's many rows, tiles of rows). A program
loads its tile's quantized fields (the GGUF's own bytes: f16 scales, packed integers) and its
input rows, computes the tile's float32 values in registers / VMEM with the caller's
`dequantize` (the model's exact gguf-py arithmetic, so this module imports nothing of the
package), and contracts them with a float32 dot, on the MXU or tensor cores where there is
one. Rows come `backend.ROW_TILE` at a time from the caller (`backend.in_row_tiles`), so every call has one shape and a row's value does not
depend on how many rows share a step. Rows by matrix id (routed experts' pairs, per-head
matrices) take one program per row (`contract(ids=...)`). On CPU the kernels run in Pallas'
interpreter: for checking only, never for speed.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pallas_triton

GPU_PLATFORMS = ("gpu", "cuda", "rocm")
TRITON_TYPES = ("Q8_0",)
# Output rows per program at most: a Q4_K tile of 128 rows by 4096 inputs is 288 KB of blocks
# and 2 MB of float32 values, within a TPU core's VMEM and a GPU's shared memory budget.
OUT_TILE = 128


def out_tile(out: int) -> int:
  """Output rows per program: the largest power of two up to OUT_TILE dividing `out`, or all
  of them when none does (a matrix too odd to tile is small)."""
  tile = min(out & -out, OUT_TILE)
  return tile if tile >= 8 else out


def lowers(type_name: str, platform: str) -> bool:
  """Whether the kernel compiles for `type_name` on `platform`: everywhere but GPUs, where
  Triton's lowering takes Q8_0 only (the other types' planes stack along inner axes)."""
  return platform not in GPU_PLATFORMS or type_name in TRITON_TYPES


def contract(x: jax.Array, fields: dict[str, jax.Array],
             dequantize: Callable[[dict[str, jax.Array]], jax.Array], *,
             platform: str, interpret: bool, ids: jax.Array | None = None,
             row_tile: int | None = None) -> jax.Array:
  """Rows `x [R, in]` against quantized `[out, in]` fields (`quant_blocks.field_specs`
  layout, blocks on axis 1): `[R, out]` float32. `dequantize(tile_fields)` gives a tile's
  float32 values `[tile, in]`. On GPUs the kernel compiles with Triton (Mosaic GPU's copies
  take at most 256 elements along an axis, fewer than a row of inputs).

  `row_tile` (a divisor of R; default all of them) splits the rows too, for a prefill's many:
  the grid is (row tile, output tile), a tile of weights dequantized for each row tile.

  With `ids [R]` the fields are a stack `[E, out, in]` (routed experts, per-head matrices) and
  row r contracts against matrix `ids[r]`, one program per row and output tile, the ids
  prefetched as scalars to address the blocks. Rows of one matrix next to each other (experts'
  pairs sorted by expert) read its tile once: the pipeline skips a copy whose block did not
  move (TPU)."""
  if ids is not None:
    return _by_id(x, ids, fields, dequantize, interpret=interpret)
  names, arrays = _sorted_fields(fields)
  out = arrays[0].shape[0]
  tile = out_tile(out)
  rows, width = x.shape
  row_tile = row_tile or rows
  kernel = _kernel(names, dequantize)
  field_specs = [pl.BlockSpec((tile,) + a.shape[1:],
                              lambda i, j, rank=a.ndim: (j,) + (0,) * (rank - 1))
                 for a in arrays]
  return pl.pallas_call(
      kernel, grid=(rows // row_tile, out // tile),
      in_specs=[pl.BlockSpec((row_tile, width), lambda i, j: (i, 0))] + field_specs,
      out_specs=pl.BlockSpec((row_tile, tile), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((rows, out), jnp.float32),
      compiler_params=(pallas_triton.CompilerParams()
                       if platform in GPU_PLATFORMS else None),
      interpret=interpret)(x, *arrays)


def _by_id(x, ids, fields, dequantize, *, interpret):
  """`contract` with `ids`: the grid is (output tile, row), rows innermost, so consecutive rows
  of one matrix ask for the same blocks. Rows travel as `[R, 1, in]` blocks of one row (a
  block's last two axes are whole)."""
  names, arrays = _sorted_fields(fields)
  out = arrays[0].shape[1]
  tile = out_tile(out)
  rows, width = x.shape
  contract_tile = _kernel(names, dequantize)
  kernel = lambda ids_ref, *refs: contract_tile(*refs)   # the ids are read by the index maps
  field_specs = [pl.BlockSpec((None, tile) + a.shape[2:],
                              lambda j, r, ids, rank=a.ndim: (ids[r], j) + (0,) * (rank - 2))
                 for a in arrays]
  grid = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(out // tile, rows),
      in_specs=[pl.BlockSpec((None, 1, width), lambda j, r, ids: (r, 0, 0))] + field_specs,
      out_specs=pl.BlockSpec((None, 1, tile), lambda j, r, ids: (r, 0, j)))
  y = pl.pallas_call(kernel, grid_spec=grid, interpret=interpret,
                     out_shape=jax.ShapeDtypeStruct((rows, 1, out), jnp.float32)
                     )(ids.astype(jnp.int32), x[:, None, :], *arrays)
  return y[:, 0, :]


def _sorted_fields(fields):
  names = sorted(fields)
  return names, [fields[name] for name in names]


def _kernel(names, dequantize):
  """The program body both grids run: its rows against its tile's values, a float32 dot."""
  def kernel(x_ref, *refs):
    *field_refs, out_ref = refs
    values = dequantize({name: ref[...] for name, ref in zip(names, field_refs)})
    out_ref[...] = jax.lax.dot_general(x_ref[...].astype(jnp.float32), values,
                                       (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)
  return kernel
