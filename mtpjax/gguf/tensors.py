"""Per-tensor dequantization of GGUF data into numpy arrays (numpy only, no jax).

Community GGUFs mix ggml types per tensor, so every tensor is dispatched on its own type.
Layout convention (docs/MODEL.md §3): the result is shaped `reversed(ne)`, i.e. `[out, in]` for a
Linear weight and `[E, out, in]` for an expert stack, exactly as gguf-py returns it. Nothing
is transposed here: the loader stores a `Linear` weight as the transpose `[in, out]` (see
`models/primitives.py` for why), experts and embeddings as they are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import ml_dtypes
import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from mtpjax import errors

# Types stored as plain IEEE floats: a typed view is exact and free.
_TYPED_VIEWS = {
    GGMLQuantizationType.F32: np.dtype(np.float32),
    GGMLQuantizationType.F16: np.dtype(np.float16),
    GGMLQuantizationType.F64: np.dtype(np.float64),
    GGMLQuantizationType.BF16: np.dtype(ml_dtypes.bfloat16),
}
_INTEGER_TYPES = frozenset({GGMLQuantizationType.I8, GGMLQuantizationType.I16,
                            GGMLQuantizationType.I32, GGMLQuantizationType.I64})
_OUT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_REMEDY = ("re-quantize the model with llama-quantize to a type gguf-py can dequantize "
           "(F16, BF16, Q8_0, Q4_K_M, Q6_K, IQ4_XS, ...) or use an F16/BF16 export")

# llama.cpp keeps these F32 whatever the file type (docs/MODEL.md §4 "Dtype policy").
_F32_NAME_SUFFIXES = ("_norm.weight", ".bias", "ffn_gate_inp.weight")


def numpy_shape(ne: Sequence[int]) -> tuple[int, ...]:
  """GGUF dims (`ne[0]` fastest) -> row-major numpy shape: `reversed(ne)`."""
  return tuple(int(d) for d in reversed(tuple(ne)))


def keeps_f32(name: str, n_dims: int) -> bool:
  """Whether llama.cpp stores this tensor as F32 regardless of the file type.

  1-D tensors, every `*_norm.weight`, biases and the MoE router (`ffn_gate_inp`) stay F32.
  """
  return n_dims <= 1 or name.endswith(_F32_NAME_SUFFIXES)


def tensor_nbytes(ggml_type: GGMLQuantizationType, ne: Sequence[int]) -> int:
  """Bytes a tensor of this type and shape occupies in a GGUF file."""
  block, type_size = GGML_QUANT_SIZES[ggml_type]
  return math.prod(int(d) for d in ne) // block * type_size


def _as_type(name: str, ggml_type) -> GGMLQuantizationType:
  try:
    return GGMLQuantizationType(int(ggml_type))
  except ValueError as e:
    raise errors.UnsupportedTensorTypeError(
        f"tensor {name!r} has unknown ggml type id {int(ggml_type)}", field=name,
        remedy="update gguf-py/mtpjax, or re-convert the model with a current llama.cpp") from e


def dequantize(name: str, ggml_type, ne: Sequence[int], raw: np.ndarray,
               dtype: str = "float32") -> np.ndarray:
  """Decodes one GGUF tensor into a `reversed(ne)`-shaped float32 or bfloat16 array.

  `raw` is what `gguf.GGUFReader` gives as `tensor.data`: typed for F32/F16, uint8 bytes for
  BF16 and the quant types (any shape whose bytes are the tensor, in file order). F32 with
  dtype float32 and BF16 with dtype bfloat16 come back as zero-copy (read-only) views of `raw`.
  Float32 results are bit-identical to `gguf.quants.dequantize`.
  """
  qtype = _as_type(name, ggml_type)
  if dtype not in _OUT_DTYPES:
    raise errors.ConversionError(
        f"cannot dequantize tensor {name!r} to dtype {dtype!r}", field="dtype",
        remedy=f"pass one of {sorted(_OUT_DTYPES)}")
  out_dtype = _OUT_DTYPES[dtype]
  shape = numpy_shape(ne)
  if qtype in _INTEGER_TYPES or qtype not in GGML_QUANT_SIZES:
    raise errors.UnsupportedTensorTypeError(
        f"tensor {name!r} has ggml type {qtype.name}, which is not a float weight type",
        field=name, remedy=_REMEDY)
  block, type_size = GGML_QUANT_SIZES[qtype]
  if shape and shape[-1] % block:
    raise errors.ConversionError(
        f"tensor {name!r} ({qtype.name}) has a row of {shape[-1]} elements, not a multiple of "
        f"the {block}-element block", field=name, remedy="re-convert the GGUF; the file is corrupt")
  data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
  expected = tensor_nbytes(qtype, ne)
  if data.size != expected:
    raise errors.ConversionError(
        f"tensor {name!r} ({qtype.name}, ne={list(map(int, ne))}) holds {data.size} bytes, "
        f"expected {expected}", field=name,
        remedy="the GGUF is truncated or corrupt; download or convert it again")

  view_dtype = _TYPED_VIEWS.get(qtype)
  if view_dtype is not None:
    arr = data.view(view_dtype).reshape(shape)
    return arr if arr.dtype == out_dtype else arr.astype(out_dtype)

  rows = data.reshape(*shape[:-1], shape[-1] // block * type_size) if shape else data
  try:
    out = quants.dequantize(rows, qtype)
  except NotImplementedError as e:
    raise errors.UnsupportedTensorTypeError(
        f"tensor {name!r} has ggml type {qtype.name}, which gguf-py cannot dequantize",
        field=name, remedy=_REMEDY) from e
  out = out.reshape(shape)
  return out if out.dtype == out_dtype else out.astype(out_dtype)
