"""Pallas: a step's rows against one GGUF-quantized matrix, each block read once for all rows.

The grid walks tiles of output rows. A program loads its tile's quantized fields (the GGUF's
own bytes: f16 scales, packed integers) and every input row, computes the tile's float32
values in registers / VMEM with the caller's `dequantize` (the model's exact gguf-py
arithmetic, so this module imports nothing of the package), and contracts them with a float32
dot, on the MXU or tensor cores where there is one. Rows come ROW_TILE at a time from the
caller (`quantized._in_row_tiles`), so every call has one shape and a row's value does not
depend on how many rows share a step. On CPU the kernel runs in Pallas' interpreter: for
checking only, never for speed.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

# Output rows per program at most: a Q4_K tile of 128 rows by 4096 inputs is 288 KB of blocks
# and 2 MB of float32 values, within a TPU core's VMEM and a GPU's shared memory budget.
OUT_TILE = 128


def out_tile(out: int) -> int:
  """Output rows per program: the largest power of two up to OUT_TILE dividing `out`, or all
  of them when none does (a matrix too odd to tile is small)."""
  tile = min(out & -out, OUT_TILE)
  return tile if tile >= 8 else out


def contract(x: jax.Array, fields: dict[str, jax.Array],
             dequantize: Callable[[dict[str, jax.Array]], jax.Array], *,
             platform: str, interpret: bool) -> jax.Array:
  """Rows `x [R, in]` against quantized `[out, in]` fields (`quant_blocks.field_specs`
  layout, blocks on axis 1): `[R, out]` float32. `dequantize(tile_fields)` gives a tile's
  float32 values `[tile, in]`. On GPUs the kernel compiles with Triton (Mosaic GPU's copies
  take at most 256 elements along an axis, fewer than a row of inputs)."""
  names = sorted(fields)
  arrays = [fields[name] for name in names]
  out = arrays[0].shape[0]
  tile = out_tile(out)
  rows, width = x.shape

  def kernel(x_ref, *refs):
    *field_refs, out_ref = refs
    values = dequantize({name: ref[...] for name, ref in zip(names, field_refs)})
    out_ref[...] = jax.lax.dot_general(
        x_ref[...].astype(jnp.float32), values, (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32)

  field_specs = [pl.BlockSpec((tile,) + a.shape[1:],
                              lambda j, rank=a.ndim: (j,) + (0,) * (rank - 1))
                 for a in arrays]
  return pl.pallas_call(
      kernel, grid=(out // tile,),
      in_specs=[pl.BlockSpec((rows, width), lambda j: (0, 0))] + field_specs,
      out_specs=pl.BlockSpec((rows, tile), lambda j: (0, j)),
      out_shape=jax.ShapeDtypeStruct((rows, out), jnp.float32),
      compiler_params=(pallas_triton.CompilerParams()
                       if platform in ("gpu", "cuda", "rocm") else None),
      interpret=interpret)(x, *arrays)
