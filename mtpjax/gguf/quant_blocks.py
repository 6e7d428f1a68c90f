"""GGUF quantized blocks -> the integer and scale arrays a device keeps (numpy only, no jax).

A quantized tensor stays quantized on the device (`models/quantized.py` does the arithmetic):
its raw blocks are split here into one array per block field, every field shaped
`lead + (n_blocks,) + per_block` where `lead + (n_blocks * block,)` is the tensor's numpy shape
(`reversed(ne)`), so a row split over devices keeps whole blocks. Fields keep the file's bytes
(f16 scales stay f16, nibbles stay packed two per uint8) except where a packed scale layout
would cost the device a dozen bit operations per weight: Q3_K's 12 bytes of 6-bit scales become
16 int8, Q4_K/Q5_K's become 8 scales + 8 mins (uint8). Device bytes are therefore 1.00x-1.04x
the file's for every type here.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

U8, I8, F16 = np.dtype(np.uint8), np.dtype(np.int8), np.dtype(np.float16)

# type name -> ((field, byte offset, byte count, dtype) in block order). Fields with a derived
# layout (Q3_K/Q4_K/Q5_K scales) are listed with their derived shape in `_DERIVED`.
LAYOUTS: dict[str, tuple[tuple[str, int, int, np.dtype], ...]] = {
    "Q8_0": (("d", 0, 2, F16), ("qs", 2, 32, I8)),
    "Q4_0": (("d", 0, 2, F16), ("qs", 2, 16, U8)),
    "Q4_1": (("d", 0, 2, F16), ("m", 2, 2, F16), ("qs", 4, 16, U8)),
    "Q5_0": (("d", 0, 2, F16), ("qh", 2, 4, U8), ("qs", 6, 16, U8)),
    "Q5_1": (("d", 0, 2, F16), ("m", 2, 2, F16), ("qh", 4, 4, U8), ("qs", 8, 16, U8)),
    "Q2_K": (("scales", 0, 16, U8), ("qs", 16, 64, U8), ("d", 80, 2, F16),
             ("dmin", 82, 2, F16)),
    "Q3_K": (("hmask", 0, 32, U8), ("qs", 32, 64, U8), ("d", 108, 2, F16)),
    "Q4_K": (("d", 0, 2, F16), ("dmin", 2, 2, F16), ("qs", 16, 128, U8)),
    "Q5_K": (("d", 0, 2, F16), ("dmin", 2, 2, F16), ("qh", 16, 32, U8), ("qs", 48, 128, U8)),
    "Q6_K": (("ql", 0, 128, U8), ("qh", 128, 64, U8), ("scales", 192, 16, I8),
             ("d", 208, 2, F16)),
}
# Derived fields: name -> (per-block shape, dtype), built from the packed scale bytes.
_DERIVED: dict[str, dict[str, tuple[tuple[int, ...], np.dtype]]] = {
    "Q3_K": {"scales": ((16,), I8)},
    "Q4_K": {"sc": ((8,), U8), "m": ((8,), U8)},
    "Q5_K": {"sc": ((8,), U8), "m": ((8,), U8)},
}

DEVICE_TYPES = frozenset(LAYOUTS)
FIELD_NAMES = frozenset(f[0] for layout in LAYOUTS.values() for f in layout) | frozenset(
    name for derived in _DERIVED.values() for name in derived)


def block_size(type_name: str) -> int:
  return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]


def gguf_nbytes(type_name: str, shape: Sequence[int]) -> int:
  """Bytes a tensor of this type and numpy shape occupies in a GGUF file."""
  block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
  return math.prod(int(d) for d in shape) // block * type_size


def field_specs(type_name: str,
                shape: Sequence[int]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """{field: (shape, dtype)} of a tensor of numpy `shape` kept as `type_name` blocks.

  Signed (int8) fields are kept sign-flipped as uint8 (`x ^ 0x80`, i.e. x + 128), and the
  device centres them by 128 in float32: XLA:CPU's YNNPACK fusions segfaulted converting int8
  (jaxlib 0.10.2; see `models/quantized.py` `_centered`), and no int8 reaches the device so."""
  lead, n_blocks = tuple(shape[:-1]), int(shape[-1]) // block_size(type_name)
  out = {}
  for name, _, count, dtype in LAYOUTS[type_name]:
    per_block = () if dtype == F16 and count == 2 else (count // dtype.itemsize,)
    out[name] = (lead + (n_blocks,) + per_block, U8 if dtype == I8 else dtype)
  for name, (per_block, dtype) in _DERIVED.get(type_name, {}).items():
    out[name] = (lead + (n_blocks,) + per_block, U8 if dtype == I8 else dtype)
  return out


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
  """Q3_K's 12 bytes of 6-bit scales -> 16 signed scales, unpacked as gguf-py does."""
  n = packed.shape[0]
  low = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], U8).reshape(1, 2, 1)).reshape(n, 16)
  high = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], U8).reshape(1, 4, 1))
  scales = (low & np.uint8(0x0F)) | ((high.reshape(n, 16) & np.uint8(0x03)) << np.uint8(4))
  return scales.astype(I8) - np.int8(32)


def unpack(type_name: str, raw: np.ndarray, shape: Sequence[int]) -> dict[str, np.ndarray]:
  """Raw GGUF bytes of a tensor of numpy `shape` -> its device fields (see `field_specs`)."""
  block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
  specs = field_specs(type_name, shape)
  blocks = np.ascontiguousarray(raw).reshape(-1).view(U8).reshape(-1, type_size)
  out = {}
  for name, start, count, dtype in LAYOUTS[type_name]:
    out[name] = np.ascontiguousarray(blocks[:, start:start + count]).view(dtype)
  if type_name == "Q3_K":
    out["scales"] = _q3_k_scales(blocks[:, 96:108])
  elif type_name in ("Q4_K", "Q5_K"):
    sc, m = quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    out["sc"], out["m"] = sc.reshape(-1, 8), m.reshape(-1, 8)
  flipped = {name: a.view(U8) ^ np.uint8(0x80) if a.dtype == I8 else a for name, a in out.items()}
  return {name: flipped[name].reshape(specs[name][0]) for name in specs}
