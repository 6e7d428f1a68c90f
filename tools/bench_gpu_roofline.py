"""Decode tokens/s and the fraction of the HBM roofline, quantized vs dense weights; one JSON line.

Made to run unattended in one call on an accelerator host: without --source it writes its own
synthetic model (tools/make_synthetic.py's library: a named variant's real dimensions, --layers
trunk layers + NextN, random valid --type blocks; no llama.cpp needed), loads it once per
--weight_modes mode, and alternates the measured rounds between the modes. A decode step at batch 1
(MTP off) reads every weight it multiplies by once, so its time is bounded below by
weight bytes / HBM bandwidth: `fraction_of_roofline` = (bytes per step / step time) / --hbm_gb_s.
A step's time is the median of the steps run once every request holds its slot (no prefill in
them).

  python -m tools.bench_gpu_roofline --dtype=bfloat16     # H200: 4.8 TB/s HBM3e
  python -m tools.bench_gpu_roofline --source=/data/flash4.gguf --weight_modes=quantized,dense
  python -m tools.bench_gpu_roofline --source=/tmp/flash4.gguf --weight_modes=quantized \
      --slot_counts=1,8      # a step over 8 slots against one (#16's grouped-MoE decode figure)
  python -m tools.bench_gpu_roofline --source=/tmp/flash4.gguf --weight_modes=quantized-int8 \
      --slot_counts=1,8 --llama_bench=/tmp/llama.cpp/llama-bench   # with llama.cpp's, on a CPU

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
from mtpjax.engine.scheduler import Request, Result, SlotScheduler
from mtpjax.models.traffic import weight_mb_per_step
from mtpjax.testing.glm_variants import VARIANTS, with_dims
from mtpjax.testing.synthetic_glm import write_synthetic_gguf
# bench_decode's --source, --rounds, --dtype and --seed flags (absl
# flags are global: this tool reads them rather than defining its own of the same names).
from tools.bench_decode import _DTYPE, _ROUNDS, _SEED, _SOURCE
from tools.llama_cpp import one_gguf, run_llama_bench

_VARIANT = flags.DEFINE_enum("variant", "glm-4.7-flash", sorted(VARIANTS),
                             "synthetic model's variant (without --source)")
_LAYERS = flags.DEFINE_integer("layers", 4, "synthetic model's trunk layers (without --source)")
_TYPE = flags.DEFINE_string("type", "Q4_K", "synthetic model's tensor type (without --source)")
_DIMS = flags.DEFINE_list("dims", [], "synthetic model's dimension overrides name=value (a "
                          "smaller model of the same shape family, e.g. for a CPU dry run)")
_WEIGHT_MODES = flags.DEFINE_list(
    "weight_modes", ["quantized", "dense"],
    "mtpjax.load(weights=...) modes, alternated; quantized-int8 is quantized with "
    "int8_activations=True (rows rounded to int8 on a CPU, as llama.cpp multiplies)")
_DECODE_TOKENS = flags.DEFINE_integer("decode_tokens", 128, "tokens decoded per round")
_SLOT_COUNTS = flags.DEFINE_list("slot_counts", ["1"], "decode slots, one request each (the "
                                 "first is the reference of `step_vs_first`), e.g. 1,8")
_HBM_GB_S = flags.DEFINE_float("hbm_gb_s", 4800.0, "peak memory bandwidth, GB/s (H200: 4800)")
_LLAMA_BENCH = flags.DEFINE_string(
    "llama_bench", None, "path of llama.cpp's llama-bench (CPU): each round also times its "
    "step over as many rows as each --slot_counts entry, on the same GGUF (1 row: tg16; N: a "
    "prompt of N rows in one batch, -p N -b N -ub N)")
_LLAMA_THREADS = flags.DEFINE_integer("llama_threads", 2, "llama.cpp threads (--llama_bench)")


def _llama_steps_ms(gguf_path: str, row_counts: list[int]) -> dict[int, float]:
  """llama.cpp's step over each count of rows, ms, from one llama-bench run: a decode (tg16)
  for one row, else a batch of that many prompt rows (whose vocabulary head runs for its last
  row only)."""
  threads, batches = _LLAMA_THREADS.value, tuple(n for n in row_counts if n > 1)
  # A prompt of 0 (one row only): llama-bench runs no prompt test.
  rates = run_llama_bench(_LLAMA_BENCH.value, gguf_path, threads, batches or 0, 16, 2,
                          batch=max(batches, default=None))
  return {n: n * 1e3 / rates[(f"pp{n}" if n > 1 else "tg16", threads)] for n in row_counts}


def _steady_steps(engine, requests: list[Request]) -> tuple[list[Result], float]:
  """(results, median ms of a decode step once every request holds its slot): the steps
  that also prefill later requests are left out, so N slots' step is N rows' decode alone."""
  scheduler, results = SlotScheduler(engine), {}
  for i, request in enumerate(requests):
    scheduler.submit(request, lambda r, i=i: results.__setitem__(i, r))
  seconds = []
  while scheduler.busy:
    steady = scheduler.prefilling is None and not scheduler.waiting and all(
        slot is not None for slot in scheduler.slots[:len(requests)])
    started = time.perf_counter()
    scheduler.step()
    if steady:
      seconds.append(time.perf_counter() - started)
  return [results[i] for i in range(len(requests))], 1e3 * float(np.median(seconds))


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
      models[mode] = mtpjax.load(path, dtype=_DTYPE.value, weights=mode.removesuffix("-int8"),
                                 int8_activations=mode.endswith("-int8"))
      load_s[mode] = time.perf_counter() - start
    slot_counts = [int(n) for n in _SLOT_COUNTS.value]
    rng = np.random.default_rng(_SEED.value)
    vocab = next(iter(models.values())).config.vocab_size
    requests = [Request(prompt=rng.integers(0, vocab, 8).astype(np.int32),
                        max_new_tokens=_DECODE_TOKENS.value + 1,
                        sampler=SamplerParams(0.0, 0, 1.0, seed=_SEED.value))
                for _ in range(max(slot_counts))]
    engines = {}
    for mode, model in models.items():
      for slots in slot_counts:
        engines[mode, slots] = model.engine(native_mtp=False, slots=slots,
                                            max_len=8 + _DECODE_TOKENS.value + 2,
                                            prefill_buckets=(pow2_bucket(8 + 1),))
        warm_up(engines[mode, slots])
        _steady_steps(engines[mode, slots], requests[:slots])   # untimed: device caches
    steps: dict[tuple, list[float]] = {key: [] for key in engines}
    tokens = {}
    llama_steps: dict[int, list[float]] = {n: [] for n in slot_counts}
    gguf_path = one_gguf(path, tmp) if _LLAMA_BENCH.value else None
    for _ in range(_ROUNDS.value):
      if gguf_path:
        for n, ms in _llama_steps_ms(gguf_path, slot_counts).items():
          llama_steps[n].append(ms)
      for (mode, slots), engine in engines.items():
        results, step_ms = _steady_steps(engine, requests[:slots])
        steps[mode, slots].append(step_ms)
        tokens[mode, slots] = [list(r.tokens) for r in results]

  device = jax.devices()[0]
  per_mode = {}
  for mode, model in models.items():
    per_mode[mode] = {"load_s": load_s[mode]}
    params = model.weights(with_mtp=False)[1]
    for slots in slot_counts:
      step_ms = float(np.median(steps[mode, slots]))
      mb = weight_mb_per_step(params, model.config, slots)["plain"]
      achieved = mb / 1e3 / (step_ms / 1e3)            # GB/s
      figures = {
          "tokens_per_s": slots * 1e3 / step_ms, "step_ms": step_ms,
          "step_ms_rounds": steps[mode, slots], "weight_mb_per_step": mb,
          "achieved_gb_s": achieved, "fraction_of_roofline": achieved / _HBM_GB_S.value,
          "roofline_tokens_per_s": slots * _HBM_GB_S.value * 1e3 / mb,
          "step_vs_first": step_ms / float(np.median(steps[mode, slot_counts[0]]))}
      # One slot count keeps the flat layout of the figures; several nest them by count.
      if len(slot_counts) == 1:
        per_mode[mode].update(figures)
      else:
        per_mode[mode][f"slots_{slots}"] = figures
  line = {
      "flags": {f.name: f.value for f in (_SOURCE, _VARIANT, _LAYERS, _TYPE, _DIMS, _WEIGHT_MODES,
                                          _DTYPE, _DECODE_TOKENS, _SLOT_COUNTS, _ROUNDS,
                                          _HBM_GB_S, _SEED, _LLAMA_BENCH, _LLAMA_THREADS)},
      "device": f"{device.platform}:{device.device_kind}", "synthetic_write_s": made_s,
      "modes": per_mode,
      "same_tokens": all(len({str(tokens[mode, n]) for mode in models}) == 1
                         for n in slot_counts),
  }
  if _LLAMA_BENCH.value:
    first = float(np.median(llama_steps[slot_counts[0]]))
    line["llama_cpp"] = {f"rows_{n}": {"step_ms": float(np.median(ms)), "step_ms_rounds": ms,
                                       "step_vs_first": float(np.median(ms)) / first}
                         for n, ms in llama_steps.items()}
  if {"quantized", "dense"} <= models.keys() and len(slot_counts) == 1:
    line["quantized_over_dense_speed"] = (per_mode["quantized"]["tokens_per_s"]
                                          / per_mode["dense"]["tokens_per_s"])
  print(json.dumps(line), flush=True)


if __name__ == "__main__":
  app.run(main)
