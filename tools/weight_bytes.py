"""Weight bytes of a loaded model per GGUF tensor type, and of every named GLM variant at its
real depth extrapolated from them, with the KV cache a token takes and how many tokens of it
fit beside the weights (tools/bench_memory.py is the command). No flags, so tests import
it."""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import jax.numpy as jnp
from flax import nnx

from mtpjax import loading
from mtpjax.gguf.tensors import keeps_f32, numpy_shape
from mtpjax.models.glm_names import targets_for
from mtpjax.testing.glm_variants import VARIANTS, GlmVariant
from mtpjax.testing.synthetic_glm import REAL_LAYERS_KEY, VARIANT_KEY, tensor_shapes

# Weight memory of each target, in bytes (GB = 1e9, as the vendors quote them).
TARGETS = {"h200": 141e9, "tpu_v5e_8": 8 * 16e9, "tpu_v6e_8": 8 * 32e9}
SEQUENCE = 32768           # `sequences_of_32768`: whole sequences of this context that fit

_BLK = re.compile(r"blk\.(\d+)\.(.+)")


def role(name: str) -> str:
  """A tensor's name without its layer index: the unit bytes per element are measured per."""
  match = _BLK.fullmatch(name)
  return match.group(2) if match else name


@dataclasses.dataclass
class Measured:
  """Per GGUF type: [GGUF bytes, device bytes, elements]; per role the same and the rank."""
  by_type: dict[str, list[int]]
  by_role: dict[str, list[int]]
  unmatched_device_bytes: int


def measure(model) -> Measured:
  """Bytes of every source tensor and of the state leaves loaded from it (NextN included)."""
  layout = model.stage_layouts(with_mtp=True)[0]
  leaves = {tuple(path): leaf[...].nbytes
            for path, leaf in nnx.to_flat_state(model.weights(with_mtp=True)[1])}
  claimed: set[tuple] = set()
  by_type: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
  by_role: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])
  for name, info in model.source.tensors.items():
    paths = [t.path for t in targets_for(name, model.config, layout)]
    owned = [p for p in leaves if p not in claimed
             and any(p[:len(target)] == tuple(target) for target in paths)]
    claimed.update(owned)
    device = sum(leaves[p] for p in owned)
    elements = math.prod(numpy_shape(info.ne))
    by_role[role(name)][3] = len(info.ne)
    for row in (by_type[info.ggml_type.name], by_role[role(name)]):
      row[0] += info.n_bytes
      row[1] += device
      row[2] += elements
  unmatched = sum(size for path, size in leaves.items() if path not in claimed)
  return Measured(dict(by_type), dict(by_role), unmatched)


def _per_element(measured: Measured, name: str, ndim: int) -> tuple[float, float, bool]:
  """(GGUF, device) bytes per element for a tensor of `name`, and whether it was estimated."""
  row = measured.by_role.get(role(name))
  if row and row[2]:
    return row[0] / row[2], row[1] / row[2], False
  pool = [r for key, r in measured.by_role.items()
          if keeps_f32(key, r[3]) == keeps_f32(name, ndim) and r[2]]
  return (sum(r[0] for r in pool) / sum(r[2] for r in pool),
          sum(r[1] for r in pool) / sum(r[2] for r in pool), True)


def kv_bytes_per_token(variant: GlmVariant, value_bytes: int, hidden_bytes: int) -> dict:
  """Cache bytes one token takes in the engine's pools at the variant's real depth: the trunk's
  K/V (GQA keys and values; MLA's latent + rope row, and glm-dsa's indexer key), and with
  native MTP the NextN block's K/V and its history row (a hidden row and a token id)."""
  if variant.is_mla:
    per_layer = variant.kv_lora + variant.qk_rope + variant.indexer_dim
  else:
    per_layer = 2 * variant.n_kv_heads * variant.head_dim
  trunk = variant.real_layers * per_layer * value_bytes
  mtp = variant.nextn_layers * (per_layer * value_bytes + variant.hidden * hidden_bytes + 4)
  return {"trunk": trunk, "mtp": mtp, "total": trunk + mtp}


def extrapolate(variant: GlmVariant, measured: Measured, headroom: float, kv_bytes: int,
                hidden_bytes: int, utilization: float) -> dict:
  """Full-model bytes of `variant` at its real depth from the measured bytes per element, and
  the tokens of KV cache that fit beside them in `utilization` of each target's memory."""
  sample_layers = variant.leading_dense + 1          # every kind of trunk layer once
  parts = {"shared": [0.0, 0.0], "dense_layer": [0.0, 0.0], "moe_layer": [0.0, 0.0]}
  estimated = set()
  for name, shape in tensor_shapes(variant, sample_layers).items():
    gguf_bpe, device_bpe, guessed = _per_element(measured, name, len(shape))
    if guessed:
      estimated.add(role(name))
    match = _BLK.fullmatch(name)
    layer = int(match.group(1)) if match else None
    part = ("shared" if layer is None or layer >= sample_layers
            else "dense_layer" if layer < variant.leading_dense else "moe_layer")
    parts[part][0] += math.prod(shape) * gguf_bpe
    parts[part][1] += math.prod(shape) * device_bpe
  moe_layers = variant.real_layers - variant.leading_dense
  total = [parts["shared"][i] + parts["dense_layer"][i] * variant.leading_dense
           + parts["moe_layer"][i] * moe_layers for i in range(2)]
  kv = kv_bytes_per_token(variant, kv_bytes, hidden_bytes)
  tokens = {target: max(0, math.floor((utilization * capacity - total[1]) / kv["total"]))
            for target, capacity in TARGETS.items()}
  return {
      "real_layers": variant.real_layers, "dense_layers": variant.leading_dense,
      "gguf_gb": total[0] / 1e9, "device_gb": total[1] / 1e9,
      "parts_device_gb": {k: v[1] / 1e9 for k, v in parts.items()},
      "fits": {target: total[1] <= (1 - headroom) * capacity
               for target, capacity in TARGETS.items()},
      "estimated_roles": sorted(estimated),
      "kv_bytes_per_token": kv,
      "kv_tokens": tokens,
      f"sequences_of_{SEQUENCE}": {target: n // SEQUENCE for target, n in tokens.items()},
  }


def report(model, measured: Measured, headroom: float, *, kv_bytes: int,
           utilization: float) -> dict:
  """The measured bytes per type and every variant extrapolated (`extrapolate`); `kv_bytes`
  per cached K/V value (the engine's `kv_cache_dtype`), the MTP history in the model's
  activation dtype."""
  hidden_bytes = jnp.dtype(loading.resolve_dtype(model.dtype)).itemsize
  meta = model.source.metadata
  gguf_total = sum(r[0] for r in measured.by_type.values())
  device_total = sum(r[1] for r in measured.by_type.values()) + measured.unmatched_device_bytes
  return {
      "variant": meta.get(VARIANT_KEY), "real_block_count": meta.get(REAL_LAYERS_KEY),
      "loaded_layers": model.config.n_layers,
      "per_type": {t: {"gguf_bytes": r[0], "device_bytes": r[1],
                       "device_over_gguf": r[1] / r[0] if r[0] else None}
                   for t, r in sorted(measured.by_type.items())},
      "gguf_bytes": gguf_total, "device_bytes": device_total,
      "device_over_gguf": device_total / gguf_total,
      "unmatched_device_bytes": measured.unmatched_device_bytes,
      "headroom": headroom, "targets_gb": {k: v / 1e9 for k, v in TARGETS.items()},
      "kv_value_bytes": kv_bytes, "memory_utilization": utilization,
      "extrapolated": {name: extrapolate(v, measured, headroom, kv_bytes, hidden_bytes,
                                         utilization) for name, v in VARIANTS.items()},
  }
