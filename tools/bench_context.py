"""Long-context benchmark: one JSON line per measurement, side by side in one run.

  python -m tools.bench_context --modes=start          # server launch to ready, 1st vs 2nd
  python -m tools.bench_context --modes=stall          # a long prompt's stall of a live stream
  python -m tools.bench_context --modes=steps          # step time against tokens held
  python -m tools.bench_context --modes=steps --held=128,1024 --context=32768   # #17's ratio
  python -m tools.bench_context --modes=steps --source=/tmp/flash4.gguf --dtype=bfloat16 \
      --context=32768 --held=128,1024,4096,16384,32000 --steps=5     # a real-shape model
  python -m tools.bench_context --modes=ttft           # TTFT cold vs a cached 1,900 tokens

`start`: launches `python -m mtpjax.serve --config=configs/glm.py` twice on one fresh cache
directory: the first start compiles everything, the second loads the compiled steps from the
persistent compilation cache (`warm_start.py`).
`steps`: decode step time at 128 ... 32K tokens held, blockwise attention vs reading the
whole cache, the KV pool's bytes and the bytes of the pages the slot holds at each point.
`ttft`: time to first token of a 2,000-token prompt cold and with its first 1,900 tokens
shared with an earlier prompt (prefix cache; one scheduler, whose engine state holds it).
`stall`: a stream decodes while a prompt of --long_prompt tokens arrives; reports the longest
gap between the stream's tokens with the long prompt's chunks interleaved with decode steps,
and with its whole prefill run at once.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

# bench_serve's --source (absl flags are global): here the model of the steps, e.g. a
# real-shape one from tools/make_synthetic.py; empty: the demo.
from tools.bench_serve import _SOURCE, READY

REPO = pathlib.Path(__file__).resolve().parents[1]

_MODES = flags.DEFINE_list("modes", ["steps", "ttft", "stall", "start"], "measurements to run")
_SERVE_FLAGS = flags.DEFINE_list("serve_flags", [], "extra flags for the servers (start)")
_LONG_PROMPT = flags.DEFINE_integer("long_prompt", 2000, "tokens of the long prompt (stall)")
_MAX_LEN = flags.DEFINE_integer("max_len", 4096, "engine context length (stall)")
_HELD = flags.DEFINE_list("held", ["128", "1024", "4096", "16384", "32768"],
                          "tokens held by the slot (steps)")
_STEPS = flags.DEFINE_integer("steps", 20, "timed steps per point (steps)")
_STEP_ROUNDS = flags.DEFINE_integer("step_rounds", 2, "rounds over every point (steps)")
_CONTEXT = flags.DEFINE_integer("context", 0, "engine context length (steps); 0: the largest "
                                "--held + 64. #17 compares 128 and 1,024 held at 32768")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "activation dtype of --source (steps)")
_SHARED = flags.DEFINE_integer("shared", 1900, "tokens the second prompt shares (ttft)")
_ROUNDS = flags.DEFINE_integer("ttft_rounds", 3, "cold / cached pairs (ttft)")


def launch_to_ready(cache_dir: str) -> float:
  """Seconds from launching a server to its ready line."""
  log_path = pathlib.Path(cache_dir) / f"server-{time.time_ns()}.log"
  launched = time.perf_counter()
  with open(log_path, "wb") as log:
    server = subprocess.Popen(
        [sys.executable, "-m", "mtpjax.serve", "--config=configs/glm.py",
         f"--config.cache_dir={cache_dir}", "--config.server.port=0", *_SERVE_FLAGS.value],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
  try:
    while not READY.search(log_path.read_text(errors="replace")):
      if server.poll() is not None:
        raise SystemExit(log_path.read_text(errors="replace"))
      time.sleep(0.05)
    return time.perf_counter() - launched
  finally:
    server.terminate()
    server.wait(30)


def measure_start() -> dict:
  with tempfile.TemporaryDirectory(prefix="mtpjax-bench-context-") as cache_dir:
    first = launch_to_ready(cache_dir)
    second = launch_to_ready(cache_dir)
  return {"mode": "start", "flags": _SERVE_FLAGS.value, "first_start_s": round(first, 2),
          "second_start_s": round(second, 2), "second_over_first": round(second / first, 3)}


def measure_stall() -> dict:
  """The live stream's longest gap between tokens while the long prompt is prefilled."""
  import mtpjax
  from mtpjax import embedded
  from mtpjax.engine.contract import warm_up
  from mtpjax.engine.scheduler import Request, SlotScheduler
  model = mtpjax.load(embedded.DEMO_PACKAGE)
  engine = model.engine(native_mtp=False, slots=2, max_len=_MAX_LEN.value,
                        prefill_buckets=(16, 32, 64, 128, 256))
  warm_up(engine)
  rng = np.random.default_rng(0)
  vocab = model.config.vocab_size
  short = rng.integers(0, vocab, size=8).astype(np.int32)
  long = rng.integers(0, vocab, size=_LONG_PROMPT.value).astype(np.int32)
  out = {"mode": "stall", "long_prompt_tokens": _LONG_PROMPT.value,
         "chunks": len(engine.engine_cfg.prefill_chunks(long)[1])}
  for interleave in (True, False, True, False):
    stamps = []
    requests = [Request(prompt=short, max_new_tokens=64,
                        on_tokens=lambda t: stamps.append(time.perf_counter())),
                Request(prompt=long, max_new_tokens=4)]
    started = time.perf_counter()
    results = SlotScheduler(engine, interleave_prefill=interleave).run(requests)
    gap = float(np.max(np.diff(stamps)))
    key = "interleaved" if interleave else "whole_prefill"
    out[f"{key}_max_gap_s"] = round(min(gap, out.get(f"{key}_max_gap_s", gap)), 4)
    out[f"{key}_long_ttft_s"] = round(results[1].time_to_first_token_s, 3)
    out[f"{key}_total_s"] = round(time.perf_counter() - started, 3)
  return out


def measure_steps() -> dict:
  """Decode step time against the tokens a slot holds, blockwise attention vs reading the whole
  cache (the old contiguous path: one block as long as the cache), alternated in one run; and
  the cache bytes per slot. The slot's position is set directly after a short prefill: a step's
  cost depends on the rows it reads, not on their values."""
  import jax
  import mtpjax
  from mtpjax import embedded, loading
  from mtpjax.engine.contract import EngineConfig
  from mtpjax.engine.engine import Engine
  from mtpjax.engine.sampling import SamplerParams
  from mtpjax.models import blockwise
  held = [int(h) for h in _HELD.value]
  context = _CONTEXT.value or max(held) + 64
  if context < max(held) + 64:
    raise app.UsageError(f"--context={context} cannot hold --held up to {max(held)} and the "
                         "timed steps; raise --context or drop the largest --held")
  model = (mtpjax.load(_SOURCE.value, dtype=_DTYPE.value) if _SOURCE.value
           else mtpjax.load(embedded.DEMO_PACKAGE))
  engine_cfg = EngineConfig(slots=1, max_len=context, prefill_buckets=(16,))
  engines = {}
  for name, block in (("blockwise", blockwise.BLOCK), ("whole_cache", 2 * engine_cfg.cache_len)):
    blockwise.BLOCK = block      # read at trace time: each engine compiles with its own
    engines[name] = Engine(model.stage_weights(with_mtp=False),
                           model.stage_layouts(with_mtp=False), model.hops, model.config,
                           engine_cfg, dtype=loading.resolve_dtype(model.dtype))
    state = engines[name].init_state()
    engines[name].step(state, np.ones(1, bool))          # compile now
  active = np.ones(1, bool)
  out = {"mode": "steps", "source": _SOURCE.value or "demo", "max_len": engine_cfg.max_len,
         "held": held}
  state = engines["blockwise"].init_state()
  pool_bytes = sum(a.nbytes for a in jax.tree.leaves(state.kv))
  out["kv_pool_bytes"] = pool_bytes
  page_bytes = pool_bytes / engine_cfg.pool_pages
  out["kv_bytes_held"] = [0] * len(held)   # the pages the slot holds at each point, in bytes
  medians = {name: [[] for _ in held] for name in engines}
  # Rounds over every point and engine in turn: a noisy machine slows every point alike.
  for _ in range(_STEP_ROUNDS.value):
    for point, tokens in enumerate(held):
      for name, engine in engines.items():
        state = engine.init_state()
        state = engine.insert(engine.prefill(np.arange(8, dtype=np.int32), SamplerParams(),
                                             state=state), state, 0)
        state.positions[0] = tokens          # the pages of a slot holding `tokens`
        head = state.groups[0].head
        state.groups[0].head = head.replace(slots=head.slots.replace(
            pos=jax.numpy.full_like(head.slots.pos, tokens)))
        times = []
        for _ in range(_STEPS.value):
          started = time.perf_counter()
          state, _, _ = engine.step(state, active)
          times.append(time.perf_counter() - started)
        medians[name][point].append(float(np.median(times)) * 1e3)
        # The slot's pages follow the rows it holds, whichever way attention read them.
        out["kv_bytes_held"][point] = int(len(state.pages.slots[0].pages) * page_bytes)
  for name, points in medians.items():
    out[f"{name}_step_ms"] = [round(min(values), 3) for values in points]
  # #17's figure: a step at each point over a step at the first (128 held at a 32K context).
  out["blockwise_step_vs_first"] = [round(ms / out["blockwise_step_ms"][0], 3)
                                    for ms in out["blockwise_step_ms"]]
  return out


def measure_ttft() -> dict:
  """Time to first token of a --long_prompt prompt cold, and of one sharing its first
  --shared tokens with it (prefix cache), alternated over fresh random prompts."""
  import mtpjax
  from mtpjax import embedded
  from mtpjax.engine.contract import warm_up
  from mtpjax.engine.scheduler import Request, SlotScheduler
  model = mtpjax.load(embedded.DEMO_PACKAGE)
  engine = model.engine(native_mtp=True, slots=1, max_len=_MAX_LEN.value,
                        prefill_buckets=(16, 32, 64, 128, 256), prefix_cache=4)
  warm_up(engine)
  rng = np.random.default_rng(1)
  vocab = model.config.vocab_size
  size, shared = _LONG_PROMPT.value, _SHARED.value
  times = {"cold": [], "cached": []}
  reused = {"cold": [], "cached": []}     # prompt tokens each took from the prefix cache
  scheduler = SlotScheduler(engine)     # its engine state holds the prefix cache
  for _ in range(_ROUNDS.value):
    first = rng.integers(0, vocab, size=size).astype(np.int32)
    second = np.concatenate([first[:shared], rng.integers(0, vocab, size - shared)]).astype(
        np.int32)
    for prompt, kind in ((first, "cold"), (second, "cached")):
      result = scheduler.run([Request(prompt=prompt, max_new_tokens=1)])[0]
      times[kind].append(result.time_to_first_token_s)
      reused[kind].append(result.cached_tokens)
  cold_s, cached_s = float(np.median(times["cold"])), float(np.median(times["cached"]))
  return {"mode": "ttft", "prompt_tokens": size, "shared_tokens": shared,
          "cached_tokens": min(reused["cached"]), "cold_cached_tokens": max(reused["cold"]),
          "cold_ttft_s": round(cold_s, 4), "cached_ttft_s": round(cached_s, 4),
          "cached_over_cold": round(cached_s / cold_s, 3)}


def main(argv):
  del argv
  for mode in _MODES.value:
    result = {"start": measure_start, "stall": measure_stall, "steps": measure_steps,
              "ttft": measure_ttft}[mode]()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
  app.run(main)
