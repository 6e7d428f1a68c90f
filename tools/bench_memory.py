"""Weight memory: parameter bytes on the device / GGUF tensor bytes, and full-model sizes.

Loads a model (a synthetic one from tools/make_synthetic.py, or any GGUF/package), measures per
GGUF tensor type the bytes of the source tensors and of the parameter arrays loaded from them
(each state leaf under a tensor's target paths, models/glm_names.py), then sizes every named
variant (mtpjax/testing/glm_variants.py) at its real depth: shared parts (embeddings, head, final
norm, NextN block) + per-layer bytes x layers (first-k dense layers and MoE layers apart), with
the GGUF and device bytes per element of each tensor role measured on the loaded model (a role
the model lacks, e.g. GQA projections when an MLA model was measured, takes the mean of its
quantized tensors). One JSON line.

A configuration fits when the weights take at most (1 - --headroom) of its memory; the rest is
left for the KV cache, activations and the runtime. TPU slices are counted as their total HBM,
assuming the weights are sharded evenly over the chips. Each variant also gets the cache bytes
a token takes (trunk K/V at --kv_cache_dtype; with native MTP the NextN block's K/V and its
history row), and `kv_tokens`: the tokens of cache, over all slots, that fit beside the weights
in --memory_utilization of each target (`sequences_of_32768`: whole 32K sequences).

  python -m tools.bench_memory --source=/tmp/flash4.gguf --dtype=bfloat16
"""

from __future__ import annotations

import json

from absl import app, flags

import mtpjax
from mtpjax import loading
from mtpjax.engine.contract import KV_CACHE_DTYPES, EngineConfig
from tools import weight_bytes

_SOURCE = flags.DEFINE_string("source", None, "GGUF or layer package to load", required=True)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "mtpjax dtype")
_WEIGHTS = flags.DEFINE_enum("weights", "quantized", list(loading.WEIGHTS),
                             "mtpjax.load(weights=...)")
_HEADROOM = flags.DEFINE_float("headroom", 0.15, "share of a target's memory kept for the KV "
                               "cache, activations and the runtime")
_KV_DTYPE = flags.DEFINE_enum("kv_cache_dtype", "auto", list(KV_CACHE_DTYPES),
                              "the engine's KV cache dtype (auto: --dtype)")
_UTILIZATION = flags.DEFINE_float(
    "memory_utilization", 0.9, "share of a target's memory the weights and the KV cache take "
    "together (as vLLM's gpu_memory_utilization): kv_tokens is what fits in it")


def main(argv):
  del argv
  if not 0 <= _HEADROOM.value < 1:
    raise app.UsageError(f"--headroom must be in [0, 1), got {_HEADROOM.value}")
  if not 0 < _UTILIZATION.value <= 1:
    raise app.UsageError(f"--memory_utilization must be in (0, 1], got {_UTILIZATION.value}")
  model = mtpjax.load(_SOURCE.value, dtype=_DTYPE.value, weights=_WEIGHTS.value)
  kv_dtype = EngineConfig(kv_cache_dtype=_KV_DTYPE.value).kv_dtype(_DTYPE.value)
  line = {"flags": {f.name: f.value for f in (_SOURCE, _DTYPE, _WEIGHTS, _HEADROOM, _KV_DTYPE,
                                              _UTILIZATION)},
          **weight_bytes.report(model, weight_bytes.measure(model), _HEADROOM.value,
                                kv_bytes=kv_dtype.itemsize, utilization=_UTILIZATION.value)}
  print(json.dumps(line), flush=True)


if __name__ == "__main__":
  app.run(main)
