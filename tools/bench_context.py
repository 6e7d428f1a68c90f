"""Long-context benchmark: one JSON line per measurement, side by side in one run.

  python -m tools.bench_context --modes=start          # server launch to ready, 1st vs 2nd
  python -m tools.bench_context --modes=stall          # a long prompt's stall of a live stream
  python -m tools.bench_context --modes=steps          # step time against tokens held
  python -m tools.bench_context --modes=steps --held=128,1024 --context=32768   # #17's ratio
  python -m tools.bench_context --modes=steps --held=128,1024 --context=32768 \
      --kv_cache_dtype=auto,bfloat16          # and with a bfloat16 KV cache, side by side
  python -m tools.bench_context --modes=steps --source=/tmp/flash4.gguf --dtype=bfloat16 \
      --context=32768 --held=128,1024,4096,16384,32000 --steps=5     # a real-shape model
  python -m tools.bench_context --modes=ttft           # TTFT cold vs a cached 1,900 tokens
  python -m tools.bench_context --modes=steps --held=128,1024 --context=32768 \
      --llama_bench=/tmp/llama.cpp-0c1e570/llama-bench   # and llama.cpp on the same GGUF

`start`: launches `python -m mtpjax.serve --config=configs/glm.py` twice on one fresh cache
directory: the first start compiles everything, the second loads the compiled steps from the
persistent compilation cache (`warm_start.py`).
`steps`: decode step time at 128 ... 32K tokens held, blockwise attention vs reading the
whole cache (on a CPU with the native kernels, GQA decode steps attend through
`kernels/paged_attention.cc`, which reads only the rows held, so both read alike there), the
KV pool's bytes and the bytes of the pages the slot holds at each point; with --llama_bench, llama.cpp's decode step on the same GGUF after contexts of the same lengths
(`llama-bench -d`), in the same rounds: the peer's own cost of the tokens held.
`ttft`: time to first token of a 2,000-token prompt cold and with its first 1,900 tokens
shared with an earlier prompt (prefix cache; one scheduler, whose engine state holds it).
`stall`: a stream decodes while a prompt of --long_prompt tokens arrives; reports the longest
gap between the stream's tokens with the long prompt's chunks interleaved with decode steps,
and with its whole prefill run at once.
"""

from __future__ import annotations

import dataclasses
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
from tools.llama_cpp import after_context, one_gguf, run_llama_bench

REPO = pathlib.Path(__file__).resolve().parents[1]

_MODES = flags.DEFINE_list("modes", ["steps", "ttft", "stall", "start"], "measurements to run")
_SERVE_FLAGS = flags.DEFINE_list("serve_flags", [], "extra flags for the servers (start)")
_LONG_PROMPT = flags.DEFINE_integer("long_prompt", 2000, "tokens of the long prompt (stall)")
_MAX_LEN = flags.DEFINE_integer("max_len", 4096, "engine context length (stall)")
_BUCKETS = flags.DEFINE_list("prefill_buckets", ["16", "32", "64", "128", "256"],
                             "prefill chunk buckets (stall, ttft); the largest is the chunk a "
                             "long prompt is prefilled and cached in")
_HELD = flags.DEFINE_list("held", ["128", "1024", "4096", "16384", "32768"],
                          "tokens held by the slot (steps)")
_STEPS = flags.DEFINE_integer("steps", 20, "timed steps per point (steps)")
_STEP_ROUNDS = flags.DEFINE_integer("step_rounds", 2, "rounds over every point (steps)")
_CONTEXT = flags.DEFINE_integer("context", 0, "engine context length (steps); 0: the largest "
                                "--held + 64. #17 compares 128 and 1,024 held at 32768")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "activation dtype of --source (steps)")
_KV_DTYPES = flags.DEFINE_list(
    "kv_cache_dtype", ["auto"], "KV cache dtypes (steps): the first for both reads, each "
    "further one a blockwise engine of its own, e.g. auto,bfloat16 on the float32 demo")
_KV_PAGES = flags.DEFINE_list(
    "kv_page", ["16"], "rows per KV page (steps): the first for both reads, each further one "
    "a blockwise engine of its own, e.g. 16,64")
_LLAMA_BENCH = flags.DEFINE_string(
    "llama_bench", "", "steps: llama.cpp's llama-bench, run on the same GGUF (the demo and "
    "packages joined into one) at each --held depth; empty: mtpjax only")
_LLAMA_THREADS = flags.DEFINE_list("llama_threads", ["2"], "llama.cpp thread counts (steps)")
_LLAMA_GEN = flags.DEFINE_integer("llama_gen", 32, "tokens llama-bench decodes after each depth "
                                  "(steps): its step time is their mean")
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
                        prefill_buckets=_buckets())
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
  pages = [int(rows) for rows in _KV_PAGES.value]
  engine_cfg = EngineConfig(slots=1, max_len=context, prefill_buckets=(max(pages),),
                            kv_cache_dtype=_KV_DTYPES.value[0], kv_page=pages[0])
  variants = [("blockwise", blockwise.BLOCK, engine_cfg),
              ("whole_cache", 2 * engine_cfg.cache_len, engine_cfg)]
  variants += [(f"blockwise_kv_{kv_dtype}", blockwise.BLOCK,
                dataclasses.replace(engine_cfg, kv_cache_dtype=kv_dtype))
               for kv_dtype in _KV_DTYPES.value[1:]]
  variants += [(f"blockwise_page_{rows}", blockwise.BLOCK,
                dataclasses.replace(engine_cfg, kv_page=rows)) for rows in pages[1:]]
  block = blockwise.BLOCK
  engines = {}
  for name, rows, cfg in variants:
    blockwise.BLOCK = rows       # read at trace time: each engine compiles with its own
    engines[name] = Engine(model.stage_weights(with_mtp=False),
                           model.stage_layouts(with_mtp=False), model.hops, model.config,
                           cfg, dtype=loading.resolve_dtype(model.dtype))
    engines[name].step(engines[name].init_state(), np.ones(1, bool))     # compile now
  blockwise.BLOCK = block
  active = np.ones(1, bool)
  out = {"mode": "steps", "source": _SOURCE.value or "demo", "max_len": engine_cfg.max_len,
         "held": held, "kv_cache_dtype": _KV_DTYPES.value, "kv_page": pages}
  # Bytes of a page over every layer's pool, per engine; the blockwise engine's are reported
  # as kv_pool_bytes and kv_bytes_held, another KV dtype's or page size's under its own name.
  page_bytes = {}
  for name, engine in engines.items():
    pool_bytes = sum(a.nbytes for a in jax.tree.leaves(engine.init_state().kv))
    page_bytes[name] = pool_bytes / engine.engine_cfg.pool_pages
    if name == "blockwise":
      out["kv_pool_bytes"] = pool_bytes
  held_keys = {name: "kv_bytes_held" if name == "blockwise" else f"{name}_kv_bytes_held"
               for name in engines if name != "whole_cache"}
  for key in held_keys.values():
    out[key] = [0] * len(held)   # the pages the slot holds at each point, in bytes
  medians = {name: [[] for _ in held] for name in engines}
  peer = (_LlamaSteps(held, _SOURCE.value or str(embedded.DEMO_PACKAGE))
          if _LLAMA_BENCH.value else None)
  # Rounds over every point and engine in turn: a noisy machine slows every point alike.
  for _ in range(_STEP_ROUNDS.value):
    if peer:
      peer.round()
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
        if name in held_keys:
          out[held_keys[name]][point] = int(len(state.pages.slots[0].pages) * page_bytes[name])
  for name, points in medians.items():
    out[f"{name}_step_ms"] = [round(min(values), 3) for values in points]
  # #17's figure: a step at each point over a step at the first (128 held at a 32K context).
  for name in held_keys:
    out[f"{name}_step_vs_first"] = [round(ms / out[f"{name}_step_ms"][0], 3)
                                    for ms in out[f"{name}_step_ms"]]
  if peer:
    out["llama_cpp"] = peer.report()
  return out


class _LlamaSteps:
  """llama.cpp's decode step after contexts of each held length, `llama-bench -p 0 -n G -d
  held...` on the GGUF mtpjax loaded: the peer's figure for what the tokens held cost."""

  def __init__(self, held: list[int], source: str):
    self.held, self.source = held, source
    self._joined = tempfile.TemporaryDirectory(prefix="bench_context.")   # a package's GGUF
    self.gguf = one_gguf(source, self._joined.name)
    self.threads = [int(t) for t in _LLAMA_THREADS.value]
    self.step_ms = {t: [[] for _ in held] for t in self.threads}

  def round(self) -> None:
    for t in self.threads:
      rates = run_llama_bench(_LLAMA_BENCH.value, self.gguf, t, 0, _LLAMA_GEN.value, 2,
                              depths=tuple(self.held))
      for point, depth in enumerate(self.held):
        test = after_context(f"tg{_LLAMA_GEN.value}", depth)
        self.step_ms[t][point].append(1e3 / rates[(test, t)])

  def report(self) -> dict:
    """The figures, once the rounds are done; a joined GGUF is removed."""
    self._joined.cleanup()
    out = {"gguf": self.gguf if self.gguf == self.source else "(joined from source)",
           "tg_tokens": _LLAMA_GEN.value}
    for t, points in self.step_ms.items():
      ms = [round(min(values), 3) for values in points]
      out[f"step_ms_t{t}"] = ms
      out[f"step_vs_first_t{t}"] = [round(m / ms[0], 3) for m in ms]
    return out


def _buckets() -> tuple[int, ...]:
  return tuple(sorted(int(b) for b in _BUCKETS.value))


def measure_ttft() -> dict:
  """Time to first token of a --long_prompt prompt cold, and of one sharing its first
  --shared tokens with it (prefix cache), alternated over fresh random prompts."""
  import mtpjax
  from mtpjax import embedded
  from mtpjax.engine.contract import warm_up
  from mtpjax.engine.scheduler import Request, SlotScheduler
  model = mtpjax.load(embedded.DEMO_PACKAGE)
  engine = model.engine(native_mtp=True, slots=1, max_len=_MAX_LEN.value,
                        prefill_buckets=_buckets(), prefix_cache=4)
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
