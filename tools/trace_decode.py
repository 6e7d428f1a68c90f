"""Where a batch-1 decode step's time goes: device busy time against its wall time; one JSON line.

Runs `--new_tokens` decode steps (MTP off) per `--weight_modes` mode under `jax.profiler`, reads
the Perfetto trace JAX writes beside its own (`create_perfetto_trace`), and sums each trace
line's events per step: on a GPU the device's compute stream shows every kernel, on a CPU the
XLA worker threads. A device line busy for much less than the step's wall time means the host
(the scheduler and engine in Python, the dispatch of the jitted step) bounds the step, not the
kernels. The largest kernels per step come with it, and on a CPU the XLA threads' time by kind
of operation (`kinds`: the native kernel's `ffi_call`, XNNPACK's `ynn_fusion`, copies, loops'
own time, ...; `perfetto.kinds_per_line`), summed over those threads, with events per step.
One trace per `--weight_modes` mode and `--slots` count (that many requests decoded at once).

  python -m tools.trace_decode --source=/tmp/flash4.gguf --dtype=bfloat16   # on a GPU host
  python -m tools.trace_decode --source=mtpjax/assets/glm-demo --weight_modes=quantized

The traces are kept under --trace_dir when it is set (open them in ui.perfetto.dev).
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import tempfile

import jax
import numpy as np
from absl import app, flags

import mtpjax
from mtpjax.engine.contract import pow2_bucket, warm_up
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.scheduler import Request, SlotScheduler
from tools import perfetto
# bench_decode's --source, --dtype, --new_tokens (the tokens decoded under the trace) and
# --slots (one trace per count, a request a slot), and its step time (absl flags are global:
# read, not redefined, as bench_gpu_roofline does).
from tools.bench_decode import _DTYPE, _NEW_TOKENS, _SLOTS, _SOURCE, _step_ms

_WEIGHT_MODES = flags.DEFINE_list("weight_modes", ["quantized", "dense"],
                                  "mtpjax.load(weights=...) modes, one trace each")
_TOP = flags.DEFINE_integer("top", 12, "largest events reported per trace line")
_TRACE_DIR = flags.DEFINE_string("trace_dir", None, "keep the traces here (default: dropped)")
_PROMPT_TOKENS = 8   # each traced request's (random) prompt


def _trace(engine, requests: list[Request], directory: str) -> tuple[float, list[dict]]:
  """(mean decode step ms, the trace's events) of traced requests decoded together."""
  jax.profiler.start_trace(directory, create_perfetto_trace=True)
  try:
    results = SlotScheduler(engine).run(requests)
  finally:
    jax.profiler.stop_trace()
  (path,) = glob.glob(f"{directory}/plugins/profile/*/perfetto_trace.json.gz")
  return _step_ms(results), perfetto.read_events(path)


def _kinds(events: list[dict], steps: int) -> dict[str, list[float]]:
  """`perfetto.kinds_per_line` summed over the XLA:CPU executor lines, largest first."""
  total: dict[str, list[float]] = {}
  for kinds in perfetto.kinds_per_line(events, steps).values():
    for kind, (us, count) in kinds.items():
      mine = total.setdefault(kind, [0.0, 0.0])
      mine[0] += us
      mine[1] += count
  return {kind: [round(us, 1), round(count, 1)]
          for kind, (us, count) in sorted(total.items(), key=lambda item: -item[1][0])}


def main(argv):
  del argv
  if not _SOURCE.value:
    raise app.UsageError("--source is required: the GGUF or layer package to trace")
  os.environ["MTPJAX_NATIVE_MTP"] = "0"   # MTP off: the NextN block is not loaded
  steps = _NEW_TOKENS.value - 1
  modes = {}
  with tempfile.TemporaryDirectory(prefix="trace_decode.") as tmp:
    root = pathlib.Path(_TRACE_DIR.value or tmp)
    for mode in _WEIGHT_MODES.value:
      model = mtpjax.load(_SOURCE.value, dtype=_DTYPE.value, weights=mode)
      modes[mode] = {}
      for slots in map(int, _SLOTS.value):
        rng = np.random.default_rng(0)
        requests = [Request(prompt=rng.integers(0, model.config.vocab_size,
                                                _PROMPT_TOKENS).astype(np.int32),
                            max_new_tokens=_NEW_TOKENS.value,
                            sampler=SamplerParams(0.0, 0, 1.0, seed=slot))
                    for slot in range(slots)]
        engine = model.engine(native_mtp=False, slots=slots, max_len=_PROMPT_TOKENS + steps + 3,
                              prefill_buckets=(pow2_bucket(_PROMPT_TOKENS + 1),))
        warm_up(engine)
        SlotScheduler(engine).run(requests)            # untimed: device caches, first runs
        step_ms, events = _trace(engine, requests, str(root / f"{mode}-{slots}"))
        modes[mode][str(slots)] = {"traced_step_ms": step_ms,
                                   "lines": perfetto.busy_per_line(events, steps, _TOP.value),
                                   "kinds": _kinds(events, steps)}
  device = jax.devices()[0]
  print(json.dumps({"source": _SOURCE.value, "dtype": _DTYPE.value, "steps": steps,
                    "device": f"{device.platform}:{device.device_kind}", "modes": modes}),
        flush=True)


if __name__ == "__main__":
  app.run(main)
