"""Grouped MoE vs the all-experts path, and a decode step over N slots vs 1, side by side.

One routed-experts layer with random weights (dense float32, or GGUF-quantized experts kept on
the device), random rows and router choices (distinct experts per row, uniform):

  python -m tools.bench_moe --experts=64 --top_k=4,8 --hidden=512 --ffn=256 --type=Q8_0

For each top-k: a `--prefill`-token prefill through `grouped_experts.routed` (the grouped
matmul) and through `grouped_experts.every_expert` (every expert on every row, the old path),
with their max difference; a decode step over 1 slot and over `--slots` slots (rows), with the
expert weight bytes each reads (each selected expert once). Timings are the best of
`--repeats`, the variants alternated in one process. One JSON line.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from mtpjax.models import grouped_experts
from mtpjax.models.quantized import QuantizedTensor
from mtpjax.testing.random_blocks import random_valid_blocks

_EXPERTS = flags.DEFINE_integer("experts", 64, "routed experts")
_TOP_K = flags.DEFINE_list("top_k", ["4", "8"], "experts per row")
_HIDDEN = flags.DEFINE_integer("hidden", 512, "model width")
_FFN = flags.DEFINE_integer("ffn", 256, "expert width")
_PREFILL = flags.DEFINE_integer("prefill", 512, "prefill rows")
_SLOTS = flags.DEFINE_integer("slots", 8, "decode rows compared with 1")
_TYPE = flags.DEFINE_string("type", "Q8_0", "F32 (dense) or a ggml type with a device form")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed calls per variant (best is reported)")


def _weight(rng, shape):
  if _TYPE.value == "F32":
    return nnx.Param(jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 0.05))
  raw = random_valid_blocks(rng, _TYPE.value, shape, max_scale=1e-3)
  return QuantizedTensor.from_raw(_TYPE.value, raw, shape)


def _rows(rng, n, k):
  x = jnp.asarray(rng.standard_normal((n, _HIDDEN.value)).astype(np.float32))
  ids = np.stack([rng.choice(_EXPERTS.value, k, replace=False) for _ in range(n)])
  return x, jnp.asarray(ids.astype(np.int32))


def _best_ms(fns: dict, args: dict) -> dict:
  for name, fn in fns.items():
    jax.block_until_ready(fn(*args[name]))          # compile
  best = {name: float("inf") for name in fns}
  for _ in range(_REPEATS.value):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args[name]))
      best[name] = min(best[name], 1e3 * (time.perf_counter() - start))
  return best


def _expert_bytes(weights) -> int:
  return sum(w.device_bytes() if isinstance(w, QuantizedTensor) else w[...].nbytes
             for w in weights) // _EXPERTS.value


def main(argv):
  del argv
  rng = np.random.default_rng(0)
  e, d, f = _EXPERTS.value, _HIDDEN.value, _FFN.value
  weights = (_weight(rng, (e, f, d)), _weight(rng, (e, f, d)), _weight(rng, (e, d, f)))
  per_expert = _expert_bytes(weights)
  routed = jax.jit(grouped_experts.routed)
  every = jax.jit(grouped_experts.every_expert)
  line = {"flags": {flag.name: flag.value for flag in (_EXPERTS, _TOP_K, _HIDDEN, _FFN, _PREFILL,
                                                       _SLOTS, _TYPE, _REPEATS)},
          "device": jax.devices()[0].device_kind, "expert_bytes": per_expert, "top_k": {}}
  for k in (int(v) for v in _TOP_K.value):
    x, ids = _rows(rng, _PREFILL.value, k)
    one, one_ids = _rows(rng, 1, k)
    many, many_ids = _rows(rng, _SLOTS.value, k)
    ms = _best_ms({"grouped": routed, "all_experts": every, "decode_1": routed,
                   f"decode_{_SLOTS.value}": routed},
                  {"grouped": (x, ids, *weights), "all_experts": (x, ids, *weights),
                   "decode_1": (one, one_ids, *weights),
                   f"decode_{_SLOTS.value}": (many, many_ids, *weights)})
    got, want = routed(x, ids, *weights), every(x, ids, *weights)
    diff = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    line["top_k"][k] = {
        **{f"{name}_ms": round(v, 3) for name, v in ms.items()},
        "prefill_speedup": round(ms["all_experts"] / ms["grouped"], 2),
        "decode_slots_over_1": round(ms[f"decode_{_SLOTS.value}"] / ms["decode_1"], 2),
        "decode_1_expert_mb": per_expert * len(np.unique(one_ids)) / 1e6,
        f"decode_{_SLOTS.value}_expert_mb": per_expert * len(np.unique(many_ids)) / 1e6,
        "max_diff_over_max_abs": diff,
    }
  print(json.dumps(line))


if __name__ == "__main__":
  app.run(main)
