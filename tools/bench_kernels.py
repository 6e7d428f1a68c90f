"""A step's rows against one quantized matrix, per kernels, weight type and row count; one JSON
line.

Each of this platform's kernels (`xla`, `pallas`, and on a CPU `native`) contracts --rows rows
with `quantized.contract` as a decode or verify step traces it (`Kernels.for_steps`), --calls
calls in a row inside one jitted loop, the kernels alternated in one process (bench_kernel's
timing). Beside each time: the quantized weight bytes read per second, and on a device that
rate as a fraction of --peak_gb_s. On a CPU `pallas` runs in Pallas' interpreter: its time says
nothing of a device's (the JSON marks it "interpret", for correctness only).

  python -m tools.bench_kernels --matrices=Q8_0:2048x2048,Q4_K:2048x2048,Q6_K:2048x2048 \\
      --rows=1,8,32 --peak_gb_s=3350
"""

from __future__ import annotations

import json
import os

import jax
from absl import app, flags

from mtpjax.kernels import backend
from mtpjax.models.quantized import contract
# bench_kernel's cases, timed loop and flags, bench_moe's timing (absl flags are global: read,
# not redefined).
from tools.bench_kernel import _CALLS, _MATRICES, _ROWS, _SEED, calls_in_a_row, cases
from tools.bench_moe import _REPEATS, _best_ms

_PEAK = flags.DEFINE_float("peak_gb_s", 0.0,
                           "the device's memory bandwidth, GB/s (0: no roofline fraction)")


def _kernels_here() -> dict[str, backend.Kernels]:
  names = ["xla", "pallas"] + (["native"] if backend.default().native else [])
  return {name: backend.resolve(name).for_steps() for name in names}


def main(argv):
  del argv
  loop = calls_in_a_row(lambda x, type_name, fields, kernels:
                        contract(x, type_name, fields, kernels=kernels))
  kernels = _kernels_here()
  results = {}
  for spec, type_name, fields, weight_bytes, rows, x in cases():
    fns = {name: (lambda x, f, k=k: loop(x, type_name, f, k)) for name, k in kernels.items()}
    for name, ms in _best_ms(fns, {name: (x, fields) for name in fns}).items():
      gb_s = weight_bytes / (ms / _CALLS.value * 1e-3) / 1e9
      results[f"{name}:{spec}:rows{rows}"] = {
          "us": 1e3 * ms / _CALLS.value, "weight_gb_s": gb_s,
          "of_peak": gb_s / _PEAK.value if _PEAK.value else None,
          "interpret": kernels[name].interpret}
  print(json.dumps({
      "flags": {f.name: f.value for f in (_MATRICES, _ROWS, _CALLS, _REPEATS, _SEED, _PEAK)},
      "platform": backend.platform(), "device": jax.devices()[0].device_kind,
      "cpu_count": os.cpu_count(), "calls": results}), flush=True)


if __name__ == "__main__":
  app.run(main)
