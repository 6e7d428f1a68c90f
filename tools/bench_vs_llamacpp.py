"""mtpjax against llama.cpp on one GGUF: decode and a 512-token prefill, one JSON line.

Each round runs llama.cpp's `llama-bench` (`tg128` and `pp512`, at each --threads value) and
then mtpjax (MTP off, batch 1, greedy unless --temperature is set: the mean decode step over
--decode_tokens tokens at each --decode_steps burst, and one prefill of a --prefill_tokens
bucket) in each --activations mode, so that drift of this shared machine hits every side
alike. mtpjax runs on XLA's CPU client with its default threads (every core).

Reported beside the ratios: the weight bytes each side reads per decoded token. mtpjax: the
parameter bytes of a plain decode step (`models/traffic.py`: routed experts counted at top-k of
E, the embedding table not counted, the NextN block not loaded). llama.cpp: the GGUF tensor
bytes of the same tensors (the active experts only: top-k of E of each expert tensor; no
`token_embd`, which is gathered by row; no NextN block, which `llama-bench` does not run).

  python -m tools.bench_vs_llamacpp --llama_bench=/tmp/llama.cpp-0c1e570/llama-bench
      # the shipped demo package, joined into one GGUF for llama-bench
  python -m tools.bench_vs_llamacpp --gguf=/tmp/flash4.gguf --llama_bench=... --dtype=bfloat16
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

import mtpjax
from mtpjax.embedded import DEMO_PACKAGE
from mtpjax.engine.contract import KV_CACHE_DTYPES, pow2_bucket, warm_up
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.scheduler import Request
from mtpjax.models.traffic import weight_mb_per_step
from tools.llama_cpp import gguf_bytes_per_token, one_gguf, run_llama_bench
# bench_decode's decode timing, and its --rounds, --dtype, --weights, --seed, --temperature and
# --top_p flags (absl flags are global: this tool reads them rather than defining its own of
# the same names).
from tools.bench_decode import (_DTYPE, _ROUNDS, _SEED, _TEMPERATURE, _TOP_P, _WEIGHTS,
                                _step_ms, _timed_run)

_GGUF = flags.DEFINE_string("gguf", "", "GGUF file or layer package (joined into one GGUF for "
                            "llama-bench); empty: the shipped demo package")
_LLAMA_BENCH = flags.DEFINE_string("llama_bench", None, "path of llama.cpp's llama-bench (its "
                                   "folder goes on LD_LIBRARY_PATH)", required=True)
_THREADS = flags.DEFINE_list("threads", ["1", "2"], "llama.cpp thread counts")
_LLAMA_REPS = flags.DEFINE_integer("llama_reps", 2, "llama-bench -r per round")
_DECODE_TOKENS = flags.DEFINE_integer("decode_tokens", 128, "tokens decoded (llama.cpp tg128)")
_PREFILL_TOKENS = flags.DEFINE_integer("prefill_tokens", 512, "prefill bucket (llama.cpp pp512)")
_ACTIVATIONS = flags.DEFINE_list(
    "activations", ["float32", "int8"],
    "mtpjax's activation modes, each measured in every round: float32 "
    "(mtpjax.load(int8_activations=False): rows multiply the weights' exact values in float), "
    "int8 (mtpjax.load's default: rows rounded to int8 per block and multiplied as integers, "
    "as llama.cpp does)")

_DECODE_STEPS = flags.DEFINE_list(
    "decode_steps", ["1", "4"],
    "mtpjax's decode bursts (engine.decode_steps: steps one dispatch runs), each "
    "measured in every round; rates of a burst k > 1 are reported as decode_<mode>_burst<k>")
_KV_CACHE_DTYPE = flags.DEFINE_enum(
    "kv_cache_dtype", "float16", list(KV_CACHE_DTYPES),
    "mtpjax's KV cache values (engine.kv_cache_dtype); float16 is llama-bench's default cache")

_REPORTED_FLAGS = (_GGUF, _LLAMA_BENCH, _THREADS, _ROUNDS, _LLAMA_REPS, _DECODE_TOKENS,
                   _PREFILL_TOKENS, _DTYPE, _WEIGHTS, _ACTIVATIONS, _DECODE_STEPS,
                   _KV_CACHE_DTYPE, _SEED, _TEMPERATURE, _TOP_P)


def _load(source: str, activations: str):
  if activations not in ("float32", "int8"):
    raise app.UsageError(f"--activations takes float32 and int8, not {activations!r}")
  return mtpjax.load(source, dtype=_DTYPE.value, weights=_WEIGHTS.value,
                     int8_activations=activations == "int8")


def _decode_rate(engine, request: Request) -> float:
  """Decode tokens/s of one request."""
  return 1e3 / _step_ms(_timed_run(engine, [request], None)[0])


def _prefill_rate(engine, request: Request) -> float:
  """Prefill tokens/s of one request."""
  return request.prompt.size / _timed_run(engine, [request], None)[0][0].time_to_first_token_s


def _decode_name(mode: str, steps: int) -> str:
  return f"decode_{mode}" if steps == 1 else f"decode_{mode}_burst{steps}"


def main(argv):
  del argv
  threads = [int(t) for t in _THREADS.value]
  os.environ["MTPJAX_NATIVE_MTP"] = "0"   # MTP off: the NextN block is not loaded
  source = _GGUF.value or str(DEMO_PACKAGE)
  load_avg = os.getloadavg()
  with tempfile.TemporaryDirectory(prefix="bench_vs_llamacpp.") as tmp:
    gguf_path = one_gguf(source, tmp)
    start = time.perf_counter()
    modes = list(dict.fromkeys(_ACTIVATIONS.value))
    models = {mode: _load(source, mode) for mode in modes}
    model = models[modes[0]]
    rng = np.random.default_rng(_SEED.value)
    vocab = model.config.vocab_size
    # The prefill bucket computes prompt + 1 rows (the first sampled token's row).
    prefill_prompt = rng.integers(0, vocab, _PREFILL_TOKENS.value - 1).astype(np.int32)
    decode_prompt = rng.integers(0, vocab, 8).astype(np.int32)
    # llama-bench samples nothing; --temperature / --top_p price mtpjax's sampler beside it.
    sampler = SamplerParams(_TEMPERATURE.value, 0, _TOP_P.value, seed=_SEED.value)
    engines = {}      # (mode, decode steps) -> engine
    bursts = list(dict.fromkeys(int(k) for k in _DECODE_STEPS.value))
    for mode, loaded in models.items():
      for steps in bursts:
        engines[mode, steps] = loaded.engine(
            native_mtp=False, slots=1,
            max_len=max(_PREFILL_TOKENS.value, 8 + _DECODE_TOKENS.value + 1),
            prefill_buckets=(pow2_bucket(9), _PREFILL_TOKENS.value),
            kv_cache_dtype=_KV_CACHE_DTYPE.value, decode_steps=steps)
        warm_up(engines[mode, steps])
    load_s = time.perf_counter() - start
    decode_request = Request(prompt=decode_prompt, max_new_tokens=_DECODE_TOKENS.value + 1,
                             sampler=sampler)
    prefill_request = Request(prompt=prefill_prompt, max_new_tokens=1, sampler=sampler)
    for (mode, steps), engine in engines.items():   # untimed: device caches
      _decode_rate(engine, decode_request)
      if steps == bursts[0]:
        _prefill_rate(engine, prefill_request)
    llama: dict[tuple[str, int], list[float]] = {}
    ours: dict[str, list[float]] = {}
    for _ in range(_ROUNDS.value):
      for t in threads:
        for key, rate in run_llama_bench(_LLAMA_BENCH.value, gguf_path, t,
                                         _PREFILL_TOKENS.value, _DECODE_TOKENS.value,
                                         _LLAMA_REPS.value).items():
          llama.setdefault(key, []).append(rate)
      for (mode, steps), engine in engines.items():
        ours.setdefault(_decode_name(mode, steps), []).append(
            _decode_rate(engine, decode_request))
        if steps == bursts[0]:   # a prefill is the same at every burst
          ours.setdefault(f"prefill_{mode}", []).append(_prefill_rate(engine, prefill_request))
    llama_bytes = gguf_bytes_per_token(gguf_path)

  mean = lambda xs: float(np.mean(xs))
  tg, pp = f"tg{_DECODE_TOKENS.value}", f"pp{_PREFILL_TOKENS.value}"
  llama_rates = {f"{test}_t{t}": mean(v) for (test, t), v in sorted(llama.items())}
  rates = {name: mean(values) for name, values in ours.items()}
  mtpjax_mb = weight_mb_per_step(model.weights(with_mtp=False)[1], model.config, 1)["plain"]
  device = jax.devices()[0]
  print(json.dumps({
      "flags": {flag.name: flag.value for flag in _REPORTED_FLAGS},
      "source": source, "gguf": gguf_path if gguf_path == source else "(joined from source)",
      "device": f"{device.platform}:{device.device_kind}", "cpu_count": os.cpu_count(),
      "load_avg_at_start": [round(x, 2) for x in load_avg],
      "llama_cpp_tok_s": llama_rates,
      "mtpjax_tok_s": {**rates, "prefill_prompt_tokens": int(prefill_prompt.size)},
      "ratios": {f"{name}_vs_{tg if name.startswith('decode') else pp}_t{t}":
                     rate / llama_rates[f"{tg if name.startswith('decode') else pp}_t{t}"]
                 for name, rate in rates.items() for t in threads},
      "weight_mb_per_token": {
          "mtpjax": mtpjax_mb, "llama_cpp": llama_bytes / 1e6,
          "note": "MoE: active experts only (top-k of E) on both sides; embeddings and the "
                  "NextN block not counted"},
      "mtpjax_rounds": ours, "load_s": load_s,
  }), flush=True)


if __name__ == "__main__":
  app.run(main)
