"""GGUF-quantized weights kept on the device as integers plus per-block scales.

A `QuantizedTensor` holds one GGUF tensor (numpy layout, `[out, in]` or `[E, out, in]`, blocks
along the last axis) as the block fields of `gguf/quant_blocks.py`. Its values are computed on
the device by mirroring `gguf.quants.dequantize` operation for operation in float32, so they are
bit-identical to it. Fusing a multiply into a following add (FMA, which XLA does on CPU and GPU)
cannot change them either: every product here is exact in float32 (an f16 scale times a 6-bit
sub-scale times a small integer needs at most 22 significant bits), except Q6_K's, which is not
followed by an add.

What each backend stores: every field as its GGUF bytes (f16 scales, int8 / uint8 with two
4-bit values packed per byte, unpacked by shifts on the fly). That is portable (CPU, GPU, TPU)
and costs 1.00x-1.04x the file's bytes; no backend gets a wider copy.

Contraction (`matmul`, `contract`), by the tensor's kernels (`kernels/backend.py`, a static
attribute each tensor carries, so a trace reads it from the graph definition):
- a decode or verify step's rows (`Kernels.steps`) on `xla`: multiply and reduce against the
  values computed from the integers inside one XLA loop at any row count, so no dense weight is
  materialized and a row's value does not depend on how many rows share the step (MTP on equals
  MTP off); a prefill's rows on accelerators do so up to FUSED_ROWS, and more dequantize the
  matrix once and use the backend's GEMM;
- `native` (XLA:CPU): up to NATIVE_ROWS rows a matrix go to the native kernel
  (`kernels/quant_matvec.cc`), which unpacks each block's integers once and multiplies them
  into every row (`native_contract`), and so do a prefill's int8 rows (`int8_activations`)
  against per-head matrices and routed experts; more rows, or where the kernel cannot be
  built, a tile of output rows at a time (2 MB of float32 values) is dequantized (in cache)
  and contracted by a dot (`tiled_contract`). XLA's own fused reduction vectorizes badly
  there (0.5-2 G elements/s on 2 cores) and a whole-matrix dequantize writes the float32
  matrix to memory (1.3 GB for a 155K-row vocabulary head) before the GEMM reads it back.
  Where several weights read the same decode rows, one kernel call takes them all
  (`matmuls`: q, k and v; `swiglu`: a whole SwiGLU feed-forward), which saves a call and an
  XLA operation or two each.
"""

from __future__ import annotations

import math
from typing import Iterable

import jax
import jax.numpy as jnp
from flax import nnx

from mtpjax.gguf import quant_blocks
from mtpjax.kernels import backend, native, pallas_quant

F32 = jnp.float32
# On accelerators, row counts up to this contract in a fused loop against the integers (it
# reads 4-8x fewer bytes than a dense weight); more rows dequantize once and run a GEMM.
FUSED_ROWS = 16
# On XLA:CPU, up to this many rows per matrix (decode and verify rows of every slot, per
# head for per-head projections) contract in the native kernel, which unpacks each block once
# for all of them; prefill-sized counts dequantize tiles for a GEMM.
NATIVE_ROWS = 64
# A prefill's rows per program of the Pallas kernel: a tile of weights dequantized in VMEM /
# shared memory serves this many rows on the MXU / tensor cores.
PREFILL_ROW_TILE = 128
# Float32 values per tile of `tiled_contract` (at most): 2 MB, about a core's L2. A matrix
# that small is one tile: a loop over tiles of a few hundred rows costs more than it saves.
TILE_ELEMENTS = 1 << 19


class QuantizedTensor(nnx.Module):
  """One GGUF tensor of `shape` (numpy layout) kept as `type_name` blocks (static metadata).

  `int8_activations`: where the native kernel contracts it (XLA:CPU), rows are rounded to int8
  per block and multiplied as integers, as llama.cpp does (see `native.quant_matvec`); the
  stored values stay exact either way. `kernels`: the implementations its contractions use
  (default: this platform's `auto`)."""

  def __init__(self, type_name: str, shape: tuple[int, ...], int8_activations: bool = False,
               kernels: backend.Kernels | None = None):
    self.type_name = type_name
    self.shape = tuple(int(d) for d in shape)
    self.int8_activations = bool(int8_activations)
    self.kernels = kernels or backend.default()
    for name, (field_shape, dtype) in quant_blocks.field_specs(type_name, shape).items():
      setattr(self, name, nnx.Param(jnp.zeros(field_shape, dtype)))

  @classmethod
  def from_raw(cls, type_name: str, raw, shape: tuple[int, ...]) -> "QuantizedTensor":
    """A tensor holding the GGUF blocks `raw` (bytes of a `shape` tensor, in file order)."""
    tensor = cls(type_name, shape)
    for name, array in quant_blocks.unpack(type_name, raw, shape).items():
      getattr(tensor, name)[...] = jnp.asarray(array)
    return tensor

  @property
  def field_names(self) -> tuple[str, ...]:
    return tuple(quant_blocks.field_specs(self.type_name, self.shape))

  def fields(self) -> dict[str, jax.Array]:
    return {name: getattr(self, name)[...] for name in self.field_names}

  def dequantize(self) -> jax.Array:
    return dequantize_fields(self.type_name, self.fields())

  def device_bytes(self) -> int:
    return sum(math.prod(s) * d.itemsize
               for s, d in quant_blocks.field_specs(self.type_name, self.shape).values())

  def gguf_bytes(self) -> int:
    return quant_blocks.gguf_nbytes(self.type_name, self.shape)


def _with_static(graphdef: nnx.GraphDef, state: nnx.State, attribute: str, value
                 ) -> tuple[nnx.GraphDef, nnx.State]:
  """The same weights with `attribute` set on every module that has it (a static setting, so
  the graphdef changes and the arrays are shared); `value(old)` gives the new setting."""
  model = nnx.merge(graphdef, state)
  for _, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module) and hasattr(node, attribute):
      setattr(node, attribute, value(getattr(node, attribute)))
  return nnx.split(model)


def with_int8_activations(graphdef: nnx.GraphDef, state: nnx.State
                          ) -> tuple[nnx.GraphDef, nnx.State]:
  """The same weights with every `QuantizedTensor` contracting int8 rows."""
  return _with_static(graphdef, state, "int8_activations", lambda _: True)


def with_kernels(graphdef: nnx.GraphDef, state: nnx.State, kernels: backend.Kernels
                 ) -> tuple[nnx.GraphDef, nnx.State]:
  """The same weights contracting (and, the model, attending) with `kernels`: every module with
  a `kernels` attribute (each `QuantizedTensor`, norm and dense weight, the model) takes it."""
  return _with_static(graphdef, state, "kernels", lambda _: kernels)


def for_steps(graphdef: nnx.GraphDef, state: nnx.State) -> nnx.GraphDef:
  """The graphdef a decode or verify step traces: each module's kernels `for_steps()`."""
  return _with_static(graphdef, state, "kernels", lambda old: old.for_steps())[0]


def _f32(a):
  return a.astype(F32)


def _centered(q, offset):
  """float32 `q - offset` of unsigned integers `q` (and `offset`), subtracted in float32.

  The same values as subtracting in int8 and converting (every operand is a small integer,
  exact in float32), but XLA:CPU offloads an int8 -> float32 convert in these fusions to
  YNNPACK (jaxlib 0.10.2), whose int8 convert segfaulted on an XLA worker thread in about a
  third of the warm-ups of a GLM-4.7-Flash Q4_K_M model (Q6_K planes); no int8 -> no crash."""
  return _f32(q) - _f32(jnp.asarray(offset, jnp.uint8))


def _signed(flipped):
  """float32 values of a signed field the host stored sign-flipped as uint8 (x + 128)."""
  return _centered(flipped, 128)


# Shifts are written one scalar at a time (stacked), not as a vector of shift counts: a Pallas
# kernel cannot capture an array constant, and these run inside one (`pallas_quant.py`).

def _nibbles(qs, groups: int, width: int):
  """[..., nb, groups*width] bytes -> [..., nb, groups, 2, width]: low nibbles, then high."""
  packed = qs.reshape(qs.shape[:-1] + (groups, width))
  return jnp.stack([packed & jnp.uint8(0x0F), packed >> jnp.uint8(4)], axis=-2)


def _bits(mask, shifts: int):
  """[..., nb, n] bytes -> [..., nb, shifts, n]: bit s of each byte in row s."""
  return jnp.stack([(mask >> jnp.uint8(s)) & jnp.uint8(1) for s in range(shifts)], axis=-2)


def _crumbs(qs, groups: int):
  """[..., nb, groups*32] bytes of 2-bit values -> [..., nb, groups, 4, 32]."""
  packed = qs.reshape(qs.shape[:-1] + (groups, 32))
  return jnp.stack([(packed >> jnp.uint8(s)) & jnp.uint8(3) for s in (0, 2, 4, 6)], axis=-2)


def _blocks(f: dict[str, jax.Array], t: str) -> jax.Array:
  """[..., nb, block] float32 values of one type, in gguf-py's order of operations."""
  nb = f["d"].shape
  if t == "Q8_0":
    return _signed(f["qs"]) * _f32(f["d"])[..., None]
  if t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
    q = _nibbles(f["qs"], 1, 16).reshape(nb + (32,))
    if t in ("Q5_0", "Q5_1"):
      q = q | (_bits(f["qh"], 8).swapaxes(-1, -2).reshape(nb + (32,)) << jnp.uint8(4))
    d = _f32(f["d"])[..., None]
    if t == "Q4_0":
      return d * _centered(q, 8)
    if t == "Q5_0":
      return d * _centered(q, 16)
    return d * _f32(q) + _f32(f["m"])[..., None]
  if t == "Q2_K":
    d, dmin, sc = _f32(f["d"])[..., None], _f32(f["dmin"])[..., None], f["scales"]
    dl = (d * _f32(sc & jnp.uint8(0xF)))[..., None]
    ml = (dmin * _f32(sc >> jnp.uint8(4)))[..., None]
    q = _f32(_crumbs(f["qs"], 2).reshape(nb + (16, 16)))
    return (dl * q - ml).reshape(nb + (256,))
  if t == "Q3_K":
    dl = (_f32(f["d"])[..., None] * _signed(f["scales"]))[..., None]
    ql = _crumbs(f["qs"], 2).reshape(nb + (16, 16))
    qh = _bits(f["hmask"], 8).reshape(nb + (16, 16)) ^ jnp.uint8(1)
    q = _centered(ql, qh << jnp.uint8(2))
    return (dl * q).reshape(nb + (256,))
  if t in ("Q4_K", "Q5_K"):
    d = (_f32(f["d"])[..., None] * _f32(f["sc"]))[..., None]
    dm = (_f32(f["dmin"])[..., None] * _f32(f["m"]))[..., None]
    q = _nibbles(f["qs"], 4, 32).reshape(nb + (8, 32))
    if t == "Q5_K":
      q = q | (_bits(f["qh"], 8) << jnp.uint8(4))
    return (d * _f32(q) - dm).reshape(nb + (256,))
  if t == "Q6_K":
    d = (_f32(f["d"])[..., None] * _signed(f["scales"]))[..., None]
    ql = _nibbles(f["ql"], 2, 64).reshape(nb + (8, 32))
    qh = _crumbs(f["qh"], 2).reshape(nb + (8, 32))
    q = _centered(ql | (qh << jnp.uint8(4)), 32).reshape(nb + (16, 16))
    return (d * q).reshape(nb + (256,))
  raise ValueError(f"no device dequantization for ggml type {t}")


def dequantize_fields(type_name: str, fields: dict[str, jax.Array]) -> jax.Array:
  """float32 values `[..., in]` of quantized fields (any leading dims, e.g. gathered experts)."""
  values = _blocks(fields, type_name)
  return values.reshape(values.shape[:-2] + (-1,))


def gather(weight, ids: jax.Array):
  """Rows `ids` of axis 0 of a dense array or a `QuantizedTensor`, still in its storage form:
  (type name or None, fields). Experts and embedding rows are read by id this way."""
  if isinstance(weight, QuantizedTensor):
    return weight.type_name, {n: jnp.take(a, ids, axis=0) for n, a in weight.fields().items()}
  return None, {"w": jnp.take(weight[...], ids, axis=0)}


def values(type_name: str | None, fields: dict[str, jax.Array]) -> jax.Array:
  """The float values of a `gather` result (dense fields come back as stored)."""
  return fields["w"] if type_name is None else dequantize_fields(type_name, fields)


def rows(weight, ids: jax.Array) -> jax.Array:
  """Embedding lookup: rows `ids` of a `[V, D]` table, dense or quantized."""
  return values(*gather(weight, ids))


def matmul(x: jax.Array, weight: QuantizedTensor) -> jax.Array:
  """`x [..., in]` times a quantized `[out, in]` weight, transposed: `[..., out]` in x's dtype."""
  return contract(x, weight.type_name, weight.fields(), weight.int8_activations, weight.kernels)


def _fused(kernels: backend.Kernels, rows: int) -> bool:
  """Whether a prefill's `rows` rows contract in the fused loop against the integers
  (`fused_contract`): a few, off XLA:CPU."""
  return not kernels.on_cpu and rows <= FUSED_ROWS


def contract(x: jax.Array, type_name: str, fields: dict[str, jax.Array],
             int8_activations: bool = False, kernels: backend.Kernels | None = None
             ) -> jax.Array:
  """`x [..., in]` against one quantized `[out, in]` matrix's fields: `[..., out]` in x's dtype,
  read the way `kernels` (default: this platform's) read the integers fastest (see the module
  docstring)."""
  kernels = kernels or backend.default()
  rows = math.prod(x.shape[:-1])
  if takes_native(type_name, rows, kernels=kernels):   # a prefill's rows: as float32 ones
    y = native_contract(x.reshape(-1, x.shape[-1]), None, type_name, fields, int8_activations)
    return y.reshape(x.shape[:-1] + (-1,)).astype(x.dtype)
  if kernels.steps:
    return backend.in_row_tiles(_step_tile(kernels, type_name, fields), x, x.ndim - 1)
  if _pallas(kernels, type_name):
    return _pallas_prefill(x, type_name, fields, kernels)
  if _fused(kernels, rows):
    return fused_contract(x, type_name, fields)
  if kernels.on_cpu:
    tile = _tile_rows(fields["d"].shape[0], x.shape[-1])
    if tile:
      return tiled_contract(x, type_name, fields, tile)
  return jnp.einsum("...i,oi->...o", x, dequantize_fields(type_name, fields).astype(x.dtype))


def contract_heads(x: jax.Array, weight: QuantizedTensor) -> jax.Array:
  """`x [..., H, in]` against a quantized per-head `[H, out, in]` weight: `[..., H, out]`
  float32. A step's rows, and a prefill's few rows on accelerators, take the fused loop (the
  heads broadcast like gathered experts); `native` takes a step's rows and a prefill's int8
  rows, a matrix per head (`takes_native`); other rows contract the exact float32 values of
  all heads at once."""
  type_name, fields, kernels = weight.type_name, weight.fields(), weight.kernels
  x = x.astype(F32)
  rows = math.prod(x.shape[:-2])
  if takes_native(type_name, rows, weight.int8_activations, kernels):
    flat = x.reshape(-1, x.shape[-1])
    ids = jnp.tile(jnp.arange(x.shape[-2], dtype=jnp.int32), flat.shape[0] // x.shape[-2])
    return native_contract(flat, ids, type_name, fields,
                           weight.int8_activations).reshape(x.shape[:-1] + (-1,))
  if kernels.steps and kernels.scalar_prefetch:   # each (row, head) pair, heads outermost
    by_head = jnp.moveaxis(x, -2, 0)
    ids = jnp.repeat(jnp.arange(x.shape[-2], dtype=jnp.int32), rows)
    y = pallas_contract(by_head.reshape(-1, x.shape[-1]), type_name, fields, kernels, ids)
    return jnp.moveaxis(y.reshape(by_head.shape[:-1] + (-1,)), 0, -2)
  if kernels.steps:
    return backend.in_row_tiles(lambda tile: fused_contract(tile, type_name, fields), x,
                                x.ndim - 2)
  if _fused(kernels, rows):
    return fused_contract(x, type_name, fields)
  return jnp.einsum("...hi,hoi->...ho", x, dequantize_fields(type_name, fields))


def _step_tile(kernels: backend.Kernels, type_name: str, fields: dict[str, jax.Array]):
  """A step's tile of rows `[backend.ROW_TILE, in]` against one matrix's fields, as `kernels`
  contract it: the Pallas kernel (`pallas`), else the fused XLA loop."""
  if _pallas(kernels, type_name):
    return lambda tile: pallas_contract(tile, type_name, fields, kernels).astype(tile.dtype)
  return lambda tile: fused_contract(tile, type_name, fields)


def _pallas(kernels: backend.Kernels, type_name: str) -> bool:
  """Whether rows against a `type_name` matrix run the Pallas kernel: `pallas` kernels, where
  it compiles for the type (`pallas_quant.lowers`; elsewhere as `xla`)."""
  return kernels.name == "pallas" and pallas_quant.lowers(type_name, kernels.platform)


def _pallas_prefill(x: jax.Array, type_name: str, fields: dict[str, jax.Array],
                    kernels: backend.Kernels) -> jax.Array:
  """A prefill's rows through the Pallas kernel, PREFILL_ROW_TILE rows a program (fewer rows:
  one tile of them, padded to a multiple of 8)."""
  flat = x.reshape(-1, x.shape[-1])
  n = flat.shape[0]
  tile = min(PREFILL_ROW_TILE, -(-n // 8) * 8)
  y = pallas_contract(jnp.pad(flat, ((0, -n % tile), (0, 0))), type_name, fields, kernels,
                      row_tile=tile)
  return y[:n].reshape(x.shape[:-1] + (-1,)).astype(x.dtype)


def pallas_contract(x: jax.Array, type_name: str, fields: dict[str, jax.Array],
                    kernels: backend.Kernels, ids: jax.Array | None = None,
                    row_tile: int | None = None) -> jax.Array:
  """Rows `x [R, in]` against quantized fields `[out, in]` (ids None) or `[E, out, in]`, row r
  against matrix `ids[r]` (a head, an expert), by the Pallas kernel with the model's exact
  dequantization: `[R, out]` float32 (`pallas_quant.contract`)."""
  return pallas_quant.contract(x, fields, lambda f: dequantize_fields(type_name, f),
                               platform=kernels.platform, interpret=kernels.interpret, ids=ids,
                               row_tile=row_tile)


def takes_native(type_name: str, rows: int, int8_activations: bool = False,
                 kernels: backend.Kernels | None = None) -> bool:
  """Whether `rows` rows a matrix of `type_name` take the native kernel (`native` kernels;
  default: this platform's): up to NATIVE_ROWS rows; any number in a decode or verify step
  (`Kernels.steps`: one arithmetic whatever the count, so MTP on's k + 1 rows a slot equal
  MTP off's one); and any number of int8 rows that multiply as integers where a caller passes
  `int8_activations`: the per-head matrices and routed experts, whose XLA paths dequantize
  every head or loop over experts (a Flash-shaped prefill 1.7x faster). A plain projection's
  prefill keeps XLA's GEMM: even with the kernel on K-quants, 2-4x faster on 32-value blocks
  and small matrices."""
  kernels = kernels or backend.default()
  if not kernels.native or rows <= 0 or type_name not in native.TYPE_NAMES:
    return False
  if kernels.steps or (int8_activations and native.integer_rows(type_name)):
    return True
  return rows <= NATIVE_ROWS


def int8_rows_here(kernels: backend.Kernels | None = None) -> bool:
  """Whether `kernels` (default: this platform's) multiply int8 rows as integers: `native`,
  built with its AVX2 paths."""
  return (kernels or backend.default()).native and native.integer_rows("Q8_0")


def int8_rows_missing(kernels: backend.Kernels | None = None) -> str:
  """Why `int8_rows_here` is False, for errors and logs."""
  kernels = kernels or backend.default()
  if kernels.platform != "cpu":
    return f"the {kernels.platform} backend contracts in float32"
  if not kernels.native:
    return ("the native CPU kernel is not in use (kernels 'xla', MTPJAX_NATIVE=0, or no "
            "working C++ compiler)")
  return "the native CPU kernel's build has no AVX2 integer paths (the portable build)"


def multiplies_int8_rows(type_names: Iterable[str],
                         kernels: backend.Kernels | None = None) -> bool:
  """Whether int8 rows multiply as integers against any of these weight types with `kernels`
  (`native` on XLA:CPU): llama.cpp's CPU arithmetic."""
  return ((kernels or backend.default()).native
          and any(native.integer_rows(name) for name in set(type_names)))


def native_contract(x: jax.Array, ids: jax.Array | None, type_name: str,
                    fields: dict[str, jax.Array], int8_activations: bool = False) -> jax.Array:
  """Rows `x [R, in]` against quantized fields `[out, in]` (ids None) or `[E, out, in]`, row r
  against matrix `ids[r]` (a head, an expert): `[R, out]` float32, from the native kernel."""
  return native.quant_matvec(x, ids, *_kernel_tensor(type_name, fields, ids is not None),
                             int8_activations)


def _kernel_tensor(type_name: str, fields: dict[str, jax.Array], stacked: bool
                   ) -> native.Tensor:
  """Quantized fields as the native kernel reads them: in `field_specs` order, each
  `[E, N, nb, ...]` (a single matrix `[out, in]`, not `stacked`, becomes E = 1)."""
  names = quant_blocks.field_specs(type_name, (1, quant_blocks.block_size(type_name)))
  return type_name, [fields[n] if stacked else fields[n][None] for n in names]


def _weight_tensor(weight: QuantizedTensor) -> native.Tensor:
  return _kernel_tensor(weight.type_name, weight.fields(), len(weight.shape) == 3)


def _one_call(x: jax.Array, weights) -> bool:
  """Whether one native call can contract x's rows with every weight: each is quantized and
  takes the kernel at this row count, as it would in a call of its own (`takes_native`)."""
  rows = math.prod(x.shape[:-1])
  return all(isinstance(w, QuantizedTensor)
             and takes_native(w.type_name, rows, kernels=w.kernels) for w in weights)


def matmuls(x: jax.Array, weights) -> list[jax.Array] | None:
  """`matmul(x, w)` for each of several quantized weights that read the same rows (q, k, v) in
  one native call (the same results, one call's fixed cost: XLA:CPU decode rows), or None
  where that call does not apply (`_one_call`)."""
  if not _one_call(x, weights):
    return None
  ys = native.quant_matvecs(x.reshape(-1, x.shape[-1]), None,
                            [_weight_tensor(w) for w in weights],
                            [w.int8_activations for w in weights])
  return [y.reshape(x.shape[:-1] + (-1,)).astype(x.dtype) for y in ys]


def native_swiglu(x: jax.Array, ids: jax.Array | None, gate: QuantizedTensor,
                  up: QuantizedTensor, down: QuantizedTensor) -> jax.Array:
  """Rows `x [R, in]` through a SwiGLU feed-forward of quantized matrices (`[E, ...]` stacks,
  row r through expert `ids[r]`; or single matrices, ids None) in one native call: `[R, out]`
  float32."""
  weights = (gate, up, down)
  return native.quant_swiglu(x, ids, *map(_weight_tensor, weights),
                             [w.int8_activations for w in weights])


def swiglu(x: jax.Array, gate, up, down) -> jax.Array | None:
  """`down(silu(gate(x)) * up(x))` of quantized `[out, in]` weights in one native call, in x's
  dtype, or None where that call does not apply (`_one_call`)."""
  if not _one_call(x, (gate, up, down)):
    return None
  y = native_swiglu(x.reshape(-1, x.shape[-1]), None, gate, up, down)
  return y.reshape(x.shape[:-1] + (-1,)).astype(x.dtype)


def _tile_rows(out: int, width: int) -> int:
  """Rows per tile of an `[out, width]` matrix: all of them if it holds at most TILE_ELEMENTS
  values, else the largest power of two dividing `out` whose tile does, or 0 when that is
  under 32 rows (tiles too small to pay for their loop)."""
  if out * width <= TILE_ELEMENTS:
    return out
  tile = min(out & -out, 1 << (TILE_ELEMENTS // width).bit_length() - 1)
  return tile if tile >= 32 else 0


def tiled_contract(x: jax.Array, type_name: str, fields: dict[str, jax.Array],
                   tile: int) -> jax.Array:
  """`x [..., in]` against quantized `[out, in]` fields, `tile` output rows at a time (a
  divisor of out; `contract` takes `_tile_rows`): each tile's exact float32 values, then a
  float32 dot with every row of x. The tile stays in cache between the two, so the weights
  cross memory once, as their integers."""
  out = fields["d"].shape[0]
  rows = x.reshape(-1, x.shape[-1]).astype(F32)
  if tile == out:
    # The barrier keeps a following add (a bias, the shared expert's sum) out of the dot's
    # fusion: fused there, it pushes the dequantization out into a float32 copy of the whole
    # matrix each step (39 against 19 us a 256x256 Q8_0 projection with a bias).
    y = jax.lax.optimization_barrier(rows @ dequantize_fields(type_name, fields).T)
  else:
    tiles = {name: a.reshape((out // tile, tile) + a.shape[1:]) for name, a in fields.items()}
    _, y = jax.lax.scan(lambda _, f: (None, rows @ dequantize_fields(type_name, f).T), None,
                        tiles)
    y = y.transpose(1, 0, 2)
  return y.reshape(x.shape[:-1] + (out,)).astype(x.dtype)


def _shifted(byte, shifts):
  """`byte [..., n]` shifted right by each of `shifts` (a list): [..., len(shifts), n]."""
  return byte[..., None, :] >> jnp.array(shifts, jnp.uint8).reshape(-1, 1)


def _planes(f: dict[str, jax.Array], t: str):
  """(view, [(index, values)]): x viewed as `[..., nb, *view]` and the weight's float32 values
  plane by plane, `values` lining up with `x_view[..., index]`.

  The same element arithmetic as `_blocks`, but each plane is one shift of the packed bytes in
  their stored order: no interleaving of nibbles or bits, which XLA:CPU cannot keep in a
  vectorized reduction (~10x slower).
  """
  nb = f["d"].shape
  d = _f32(f["d"])[..., None]
  if t == "Q8_0":
    return (32,), [((), _signed(f["qs"]) * d)]
  if t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
    planes = []
    for h in range(2):                                  # low nibbles: elements 0-15, high: 16-31
      for b in range(2):                                # 8 elements per qh byte
        q = (f["qs"][..., 8 * b:8 * b + 8] >> jnp.uint8(4 * h)) & jnp.uint8(0x0F)
        if t in ("Q5_0", "Q5_1"):
          bits = _shifted(f["qh"][..., 2 * h + b:2 * h + b + 1], list(range(8)))[..., 0]
          q = q | ((bits & jnp.uint8(1)) << jnp.uint8(4))
        if t == "Q4_0":
          w = d * _centered(q, 8)
        elif t == "Q5_0":
          w = d * _centered(q, 16)
        else:
          w = d * _f32(q) + _f32(f["m"])[..., None]
        planes.append(((h, b), w))
    return (2, 2, 8), planes
  if t in ("Q4_K", "Q5_K"):
    # element 64c + 32h + i: nibble h of qs[32c + i], sub-block 2c + h (Q5_K: bit 2c+h of qh[i])
    dl = (d * _f32(f["sc"])).reshape(nb + (4, 2))
    ml = (_f32(f["dmin"])[..., None] * _f32(f["m"])).reshape(nb + (4, 2))
    qs = f["qs"].reshape(nb + (4, 32))
    planes = []
    for h in range(2):
      q = (qs >> jnp.uint8(4 * h)) & jnp.uint8(0x0F)
      if t == "Q5_K":
        q = q | ((_shifted(f["qh"], [h, 2 + h, 4 + h, 6 + h]) & jnp.uint8(1)) << jnp.uint8(4))
      planes.append(((slice(None), h), dl[..., h, None] * _f32(q) - ml[..., h, None]))
    return (4, 2, 32), planes
  # Q2_K, Q3_K, Q6_K: element 128c + 32s + 16g + j, sub-block 8c + 2s + g
  planes = []
  for s in range(4):
    sub = lambda a: a.reshape(nb + (2, 4, 2))[..., s, :][..., None]   # [..., nb, 2, 2, 1]
    if t == "Q6_K":
      ql = f["ql"].reshape(nb + (2, 2, 2, 16))[..., s % 2, :, :]
      qh = f["qh"].reshape(nb + (2, 2, 16))
      q = ((ql >> jnp.uint8(4 * (s // 2))) & jnp.uint8(0x0F)) | (
          ((qh >> jnp.uint8(2 * s)) & jnp.uint8(3)) << jnp.uint8(4))
      w = sub(d * _signed(f["scales"])) * _centered(q, 32)
    else:
      q2 = (f["qs"].reshape(nb + (2, 2, 16)) >> jnp.uint8(2 * s)) & jnp.uint8(3)
      if t == "Q2_K":
        sc = f["scales"]
        w = (sub(d * _f32(sc & jnp.uint8(0xF))) * _f32(q2)
             - sub(_f32(f["dmin"])[..., None] * _f32(sc >> jnp.uint8(4))))
      else:                                             # Q3_K: high bit 4c + s of hmask[32g + j]
        hbit = (f["hmask"][..., None, :] >> jnp.array([s, 4 + s], jnp.uint8).reshape(2, 1))
        hbit = (hbit & jnp.uint8(1)).reshape(nb + (2, 2, 16)) ^ jnp.uint8(1)
        q = _centered(q2, hbit << jnp.uint8(2))
        w = sub(d * _signed(f["scales"])) * q
    planes.append(((slice(None), s), w))
  return (2, 4, 2, 16), planes


def fused_contract(x: jax.Array, type_name: str, fields: dict[str, jax.Array]) -> jax.Array:
  """`x [..., in]` against quantized `[..., out, in]` fields without a dense weight: `[..., out]`
  (x's leading dims broadcast against the fields' leading dims, e.g. one row per gathered expert).

  The values are computed from the integers inside the reduction, plane by plane (`_planes`).
  XLA:CPU vectorizes a reduce over a short contiguous run well and a reduce over a whole row
  badly (~70x slower), so each plane sums its innermost run first, then the rest.
  """
  view, planes = _planes(fields, type_name)
  nb = fields["d"].shape[-1]
  xs = x.astype(F32).reshape(x.shape[:-1] + (1, nb) + view)            # [..., 1, nb, *view]
  total = None
  for index, w in planes:
    xv = xs[(...,) + index + (slice(None),) * (len(view) - len(index))] if index else xs
    part = jnp.sum(xv * w, axis=-1)
    part = jnp.sum(part, axis=tuple(range(-(part.ndim - x.ndim), 0)))
    total = part if total is None else total + part
  return total.astype(x.dtype)
