"""Decode tokens/s and the fraction of the HBM roofline, quantized vs dense weights; one JSON line.

Made to run unattended in one call on an accelerator host: without --source it writes its own
synthetic model (tools/make_synthetic.py's library: a named variant's real dimensions, --layers
trunk layers + NextN, random valid --type blocks; no llama.cpp needed), loads it once per
--weight_modes mode, and alternates the measured rounds between the modes. A decode step at batch 1
(MTP off) reads every weight it multiplies by once, so its time is bounded below by
weight bytes / HBM bandwidth: `fraction_of_roofline` = (bytes per step / step time) / --hbm_gb_s.

  python -m tools.bench_gpu_roofline --dtype=bfloat16     # H200: 4.8 TB/s HBM3e
  python -m tools.bench_gpu_roofline --source=/data/flash4.gguf --weight_modes=quantized,dense

Weight bytes per step are `models/traffic.py`'s (routed experts at top-k of E, embeddings not
counted).
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

import mtpjax
from mtpjax.engine.contract import pow2_bucket, warm_up
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.scheduler import Request
from mtpjax.models.traffic import weight_mb_per_step
from mtpjax.testing.glm_variants import VARIANTS, with_dims
from mtpjax.testing.synthetic_glm import write_synthetic_gguf
# bench_decode's decode timing, and its --source, --rounds, --dtype and --seed flags (absl
# flags are global: this tool reads them rather than defining its own of the same names).
from tools.bench_decode import _DTYPE, _ROUNDS, _SEED, _SOURCE, _step_ms, _timed_run

_VARIANT = flags.DEFINE_enum("variant", "glm-4.7-flash", sorted(VARIANTS),
                             "synthetic model's variant (without --source)")
_LAYERS = flags.DEFINE_integer("layers", 4, "synthetic model's trunk layers (without --source)")
_TYPE = flags.DEFINE_string("type", "Q4_K", "synthetic model's tensor type (without --source)")
_DIMS = flags.DEFINE_list("dims", [], "synthetic model's dimension overrides name=value (a "
                          "smaller model of the same shape family, e.g. for a CPU dry run)")
_WEIGHT_MODES = flags.DEFINE_list("weight_modes", ["quantized", "dense"],
                                  "mtpjax.load(weights=...) modes, alternated")
_DECODE_TOKENS = flags.DEFINE_integer("decode_tokens", 128, "tokens decoded per round")
_HBM_GB_S = flags.DEFINE_float("hbm_gb_s", 4800.0, "peak memory bandwidth, GB/s (H200: 4800)")


def main(argv):
  del argv
  os.environ["MTPJAX_NATIVE_MTP"] = "0"   # MTP off: the NextN block is not loaded
  with tempfile.TemporaryDirectory(prefix="bench_gpu_roofline.") as tmp:
    path, made_s = _SOURCE.value, 0.0
    if not path:
      start = time.perf_counter()
      path = str(pathlib.Path(tmp) / f"{_VARIANT.value}-L{_LAYERS.value}-{_TYPE.value}.gguf")
      variant = with_dims(VARIANTS[_VARIANT.value],
                          dict(item.split("=", 1) for item in _DIMS.value))
      write_synthetic_gguf(path, variant, _LAYERS.value,
                           tensor_type=_TYPE.value, seed=_SEED.value)
      made_s = time.perf_counter() - start
    models, load_s = {}, {}
    for mode in _WEIGHT_MODES.value:
      start = time.perf_counter()
      models[mode] = mtpjax.load(path, dtype=_DTYPE.value, weights=mode)
      load_s[mode] = time.perf_counter() - start
    prompt = np.random.default_rng(_SEED.value).integers(
        0, next(iter(models.values())).config.vocab_size, 8).astype(np.int32)
    request = Request(prompt=prompt, max_new_tokens=_DECODE_TOKENS.value + 1,
                      sampler=SamplerParams(0.0, 0, 1.0, seed=_SEED.value))
    engines = {}
    for mode, model in models.items():
      engines[mode] = model.engine(native_mtp=False, slots=1,
                                   max_len=prompt.size + _DECODE_TOKENS.value + 2,
                                   prefill_buckets=(pow2_bucket(prompt.size + 1),))
      warm_up(engines[mode])
      _timed_run(engines[mode], [request], None)   # untimed: device caches
    steps: dict[str, list[float]] = {mode: [] for mode in models}
    tokens = {}
    for _ in range(_ROUNDS.value):
      for mode, engine in engines.items():
        results, _ = _timed_run(engine, [request], None)
        steps[mode].append(_step_ms(results))
        tokens[mode] = results[0].tokens

  device = jax.devices()[0]
  per_mode = {}
  for mode, model in models.items():
    step_ms = float(np.median(steps[mode]))
    mb = weight_mb_per_step(model.weights(with_mtp=False)[1], model.config, 1)["plain"]
    achieved = mb / 1e3 / (step_ms / 1e3)            # GB/s
    per_mode[mode] = {
        "tokens_per_s": 1e3 / step_ms, "step_ms": step_ms, "step_ms_rounds": steps[mode],
        "weight_mb_per_step": mb, "achieved_gb_s": achieved,
        "fraction_of_roofline": achieved / _HBM_GB_S.value,
        "roofline_tokens_per_s": _HBM_GB_S.value * 1e3 / mb, "load_s": load_s[mode]}
  line = {
      "flags": {f.name: f.value for f in (_SOURCE, _VARIANT, _LAYERS, _TYPE, _DIMS, _WEIGHT_MODES,
                                          _DTYPE,
                                          _DECODE_TOKENS, _ROUNDS, _HBM_GB_S, _SEED)},
      "device": f"{device.platform}:{device.device_kind}", "synthetic_write_s": made_s,
      "modes": per_mode,
      "same_tokens": len({tuple(t) for t in tokens.values()}) == 1,
  }
  if {"quantized", "dense"} <= models.keys():
    line["quantized_over_dense_speed"] = (per_mode["quantized"]["tokens_per_s"]
                                          / per_mode["dense"]["tokens_per_s"])
  print(json.dumps(line), flush=True)


if __name__ == "__main__":
  app.run(main)
