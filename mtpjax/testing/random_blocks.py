"""Random valid GGUF quantized blocks (numpy only): for exactness tests and kernel benchmarks.

gguf-py cannot quantize the K-quants, so blocks are random bytes whose f16 fields are finite
f16 values of any sign and magnitude (zeros, negative zeros and subnormals included), which is
every block a file could hold.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from mtpjax.gguf import quant_blocks


def random_valid_blocks(rng: np.random.Generator, type_name: str, shape, *,
                        max_scale: float | None = None) -> np.ndarray:
  """Raw bytes `[*shape[:-1], row bytes]` of a `type_name` tensor of numpy `shape`.

  `max_scale`: f16 fields drawn uniformly from [-max_scale, max_scale] instead of from every
  finite bit pattern (values of a trained model's magnitude, for benchmarks).
  """
  block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
  raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, type_size), dtype=np.uint8)
  for _, start, count, dtype in quant_blocks.LAYOUTS[type_name]:
    if dtype != np.float16:
      continue
    if max_scale is None:
      bits = rng.integers(0, 1 << 16, raw.shape[:-1], dtype=np.uint16)
      bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).astype(np.uint16)
    else:
      bits = rng.uniform(-max_scale, max_scale, raw.shape[:-1]).astype(np.float16).view(
          np.uint16)
    raw[..., start:start + count] = bits.view(np.uint8).reshape(*bits.shape, 2)
  return raw.reshape(*shape[:-1], -1)
