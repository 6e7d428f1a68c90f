"""Decode benchmark: native MTP off and on over the same prompts, in one process, one JSON line.

Both engines are compiled and run once over the prompts in a warm-up first (so that the
drafting policy has priced its steps, as in a long-running server), then the measured passes
alternate (off, on, off, on, ...) so that drift of the machine (clocks, other load) hits both
modes alike.

  python -m tools.bench_decode --source=/path/to/model.gguf --new_tokens=64 --prompts=8
  python -m tools.bench_decode --mtp_copies_trunk     # a generated tiny model (high acceptance)
  python -m tools.bench_decode --source=mtpjax/assets/glm-demo --slots=1,8
  python -m tools.bench_decode --source=mtpjax/assets/glm-demo --draft_tokens=1,2,3,5,adaptive
  python -m tools.bench_decode --source=mtpjax/assets/glm-demo --prompt_len=96 \
      --strategy=native-mtp-n1,ngram-simple,ngram-cache,ngram-suffix,composite

MTP on runs with the default adaptive drafting (what `generate` and the server use, which
pauses drafting where it does not pay); `*_always_drafting` is MTP on with every step drafting,
the raw cost of the verify + draft step. `--draft_tokens` gives one JSON line per draft window
(k drafts a step, fixed; `adaptive`: each slot's window moves within 1..the largest k given,
starting at 2; `package`, the default: the window the source's strategy resolves to) and slot
count. The ideal speedup of a window is tokens per verify /
(1 + c_draft), where c_draft is what drafting adds to a step: the wall time of a verify + draft
step (always drafting) over that of a plain MTP-off step, minus one; `accept_rate_by_position`
is the fraction of verified windows reaching draft position i that accepted it, and
`draft_ms_per_draft_token` the draft half of the timing pass per drafted token.
`achieved_fraction` is the measured speedup of always drafting over that ideal (the rest is
lost to prefill and to the passes that commit a request's last token). `draft_ms_per_step` and
`verify_ms_per_step` come from a separate pass with `engine.timing` on, which syncs the device
between the two halves of a step, so they include one more dispatch. `weights_mb_per_step` is
what each kind of step reads from the weights; where steps are bound by memory bandwidth (a
CPU host), `bandwidth_bound_speedup` (tokens per target pass x their ratio) is the ceiling.
`policy` is the cost policy's state on the MTP-on engine after the timed passes, per slot
bucket: its step prices and its verdict (the window cap, the pause left, its backoff and the gain
it last measured per cap). `overlap_fraction` is, per mode, the share of the scheduler's host
time between steps spent while a launched step computed (`SlotScheduler.overlap_fraction`):
hidden under the device's time rather than added to it. `--background_load=N` keeps N other
processes spinning on the host during the timed passes (MTP off and on alike), to see how the
policy holds when the machine is busy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

import mtpjax
from mtpjax import errors, loading
from mtpjax.draft_window import MAX_DRAFT_TOKENS, DraftWindow
from mtpjax.engine.contract import pow2_bucket, warm_up
from mtpjax.engine.drafting_policy import AdaptiveDrafting, DraftingCost
from mtpjax.engine.scheduler import Request, Result, SlotScheduler, overlap_fraction
from mtpjax.engine.sampling import SamplerParams
from mtpjax.gguf.tokenizer import GgufTokenizer
from mtpjax.models.traffic import weight_mb_per_step
from mtpjax.telemetry import MtpStats
from mtpjax.testing.corpus import held_out_prompts
from mtpjax.testing.tiny_glm import TinyGlmSpec, write_tiny_glm_gguf
from tools import bench_strategies

_SOURCE = flags.DEFINE_string("source", "", "GGUF or layer package; empty: a generated model")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "tokens generated per prompt")
_PROMPTS = flags.DEFINE_integer("prompts", 8, "prompts per pass")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "tokens per (random) prompt")
_SLOTS = flags.DEFINE_list("slots", ["1"], "decode slots (batch / concurrency); one JSON line "
                           "per value, e.g. --slots=1,8")
_MTP_COPIES_TRUNK = flags.DEFINE_bool(
    "mtp_copies_trunk", False, "generated model only: an MTP head that drafts what the trunk says")
_SEED = flags.DEFINE_integer("seed", 0, "prompt (and generated model) seed")
_PROMPTS_FROM = flags.DEFINE_enum(
    "prompts_from", "random", ["random", "held_out"],
    "random token ids, or text cut from the held-out standard-library corpus (trained models)")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "measured (off, on) pairs")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 is greedy")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "nucleus mass")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weight dtype")
_WEIGHTS = flags.DEFINE_enum("weights", "quantized", list(loading.WEIGHTS),
                             "quantized: GGUF quantization kept on the device; dense: dequantized")
_DRAFT_TOKENS = flags.DEFINE_list(
    "draft_tokens", ["package"], "draft windows to measure: draft tokens per step (1..8), "
    "`adaptive` or `package` (the window the source's strategy resolves to, what the server "
    "runs); one JSON line per value and slot count, e.g. --draft_tokens=1,2,3,5,adaptive")

_STRATEGY = flags.DEFINE_list(
    "strategy", [], "compare speculative strategies instead of MTP off/on: any value "
    "`speculative.strategy` takes, or `composite` (the package's, or the package copied with "
    "one declared), e.g. --strategy=native-mtp-n1,ngram-simple,ngram-cache,ngram-suffix,"
    "composite; each beside `disabled`, over held-out text and repeated code "
    "(tools/bench_strategies.py), one JSON line per slot count")

_BACKGROUND_LOAD = flags.DEFINE_integer(
    "background_load", 0, "processes kept spinning on the host during the timed passes")

_REPORTED_FLAGS = (_BACKGROUND_LOAD, _SOURCE, _NEW_TOKENS, _PROMPTS, _PROMPT_LEN, _SLOTS,
                   _MTP_COPIES_TRUNK, _SEED, _PROMPTS_FROM, _ROUNDS, _TEMPERATURE, _TOP_P, _DTYPE,
                   _WEIGHTS, _DRAFT_TOKENS, _STRATEGY)


def _open_model(tmp: pathlib.Path):
  """(model, description): the given source, or a generated tiny model written into `tmp`."""
  if _SOURCE.value:
    return mtpjax.load(_SOURCE.value, dtype=_DTYPE.value, weights=_WEIGHTS.value), _SOURCE.value
  spec = TinyGlmSpec(mtp_copies_trunk=_MTP_COPIES_TRUNK.value, seed=_SEED.value)
  path = write_tiny_glm_gguf(tmp / "bench-tiny.gguf", spec)[0]
  return mtpjax.load(str(path), dtype=_DTYPE.value, weights=_WEIGHTS.value), (
      f"generated tiny glm4moe (seed={spec.seed}, mtp_copies_trunk={spec.mtp_copies_trunk})")


def _requests(prompts: list[np.ndarray], new_tokens: int) -> list[Request]:
  return [Request(prompt=p, max_new_tokens=new_tokens,
                  sampler=SamplerParams(_TEMPERATURE.value, 0, _TOP_P.value, seed=_SEED.value + i))
          for i, p in enumerate(prompts)]


def _prompts(model) -> list[np.ndarray]:
  if _PROMPTS_FROM.value == "held_out":
    tokenizer = GgufTokenizer.from_metadata(model.metadata)
    return [np.asarray(p, np.int32) for p in held_out_prompts(
        tokenizer.encode, _PROMPTS.value, _PROMPT_LEN.value, seed=_SEED.value)]
  rng = np.random.default_rng(_SEED.value)
  return [rng.integers(0, model.config.vocab_size, size=_PROMPT_LEN.value).astype(np.int32)
          for _ in range(_PROMPTS.value)]


def _check_windows(values: list[str]) -> None:
  for value in values:
    if value not in ("adaptive", "package") and not (
        value.isdigit() and 1 <= int(value) <= MAX_DRAFT_TOKENS):
      raise app.UsageError(f"--draft_tokens takes 1..{MAX_DRAFT_TOKENS}, adaptive or package, "
                           f"got {value}")


def _windows(values: list[str], package: DraftWindow) -> list[DraftWindow]:
  """The `--draft_tokens` windows; `adaptive` spans 1..the largest fixed value (3 without),
  `package` is the source's resolved window."""
  top = max((int(v) for v in values if v.isdigit()), default=3)
  named = {"adaptive": DraftWindow(1, min(2, top), top, adaptive=True), "package": package}
  return [named[v] if v in named else DraftWindow.fixed(int(v)) for v in values]


def _timed_run(engine, requests: list[Request], adaptive: AdaptiveDrafting | None,
               window: DraftWindow | None = None) -> tuple[list[Result], float, dict]:
  """(results, seconds, the scheduler's host seconds by whether a step computed meanwhile)."""
  start = time.perf_counter()
  scheduler = SlotScheduler(engine, adaptive=adaptive, window=window)
  results = scheduler.run(requests)
  return results, time.perf_counter() - start, scheduler.host_seconds


@contextlib.contextmanager
def _background_load(processes: int):
  """`processes` busy loops on the host for the duration (another tenant of the machine)."""
  spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
              for _ in range(processes)]
  try:
    yield
  finally:
    for process in spinning:
      process.kill()
      process.wait()


def _drafting_share(results: list[Result]) -> float:
  """Fraction of target passes that verified drafts (adaptive drafting pauses the rest)."""
  total = MtpStats.total(r.stats for r in results)
  return total.verified_windows / max(total.target_passes, 1)


def _step_ms(results: list[Result]) -> float:
  """Mean wall time of a decode step (a target pass after the prefill), in milliseconds."""
  steps = [(r.total_time_s - r.time_to_first_token_s) / (r.stats.target_passes - 1)
           for r in results if r.stats.target_passes > 1]
  return 1e3 * float(np.mean(steps)) if steps else 0.0


def _policy(engine) -> dict:
  """The cost policy's prices and standing verdict (`BatchVerdict`'s fields) per slot bucket
  after the timed passes: why MTP on drafted (at which window cap) or paused."""
  report = {}
  for bucket, cost in sorted(DraftingCost.table(engine).items()):
    prices = {kind: 1e3 * cost.price(drafting)
              for kind, drafting in (("drafting", True), ("plain", False))
              if len(cost.seconds[drafting]) > 1}     # a price drops the slowest of its steps
    report[str(bucket)] = {"step_ms": prices, **dataclasses.asdict(cost.verdict)}
  return report


def _latency_ms(results: list[Result]) -> dict:
  """Mean time to first token and mean time per later token, in milliseconds."""
  ttft = [r.time_to_first_token_s for r in results]
  tpot = [(r.total_time_s - r.time_to_first_token_s) / (len(r.tokens) - 1)
          for r in results if len(r.tokens) > 1]
  return {"ttft_ms": 1e3 * float(np.mean(ttft)),
          "tpot_ms": 1e3 * float(np.mean(tpot)) if tpot else 0.0}


def main(argv):
  del argv
  for flag in (_NEW_TOKENS, _PROMPTS, _PROMPT_LEN, _ROUNDS):
    if flag.value < 1:
      raise app.UsageError(f"--{flag.name} must be >= 1, got {flag.value}")
  if _BACKGROUND_LOAD.value < 0:
    raise app.UsageError(f"--background_load must be >= 0, got {_BACKGROUND_LOAD.value}")
  try:
    slot_counts = [int(v) for v in _SLOTS.value]
  except ValueError as exc:
    raise app.UsageError(f"--slots takes integers, got {_SLOTS.value}") from exc
  if not slot_counts or min(slot_counts) < 1:
    raise app.UsageError(f"--slots values must be >= 1, got {_SLOTS.value}")
  _check_windows(_DRAFT_TOKENS.value)
  with tempfile.TemporaryDirectory(prefix="bench_decode.") as tmp:
    start = time.perf_counter()
    model, source = _open_model(pathlib.Path(tmp))
    load_s = time.perf_counter() - start
    if _STRATEGY.value:
      _compare_strategies(model, source, slot_counts, pathlib.Path(tmp))
      return
    resolution = model.resolve("native-mtp-n1")   # fails loudly on a source without proof
    if not resolution.native_mtp:
      raise errors.SpeculativeConfigError(
          f"native MTP is off for this source: {resolution.reason}", field="speculative",
          remedy="unset MTPJAX_NATIVE_MTP to compare MTP on against MTP off")
    windows = _windows(_DRAFT_TOKENS.value, resolution.draft_window)
    for slots in slot_counts:
      for window in windows:
        print(json.dumps(_measure(model, source, load_s, slots, window)), flush=True)
        # Each line compiles three engines: dropping their executables keeps a long grid
        # within the host's memory maps (LLVM's code allocation failed, then segfaulted, by
        # the fifth line of --slots=1,8 --draft_tokens=1,3,adaptive).
        jax.clear_caches()


def _compare_strategies(model, source: str, slot_counts: list[int], tmp: pathlib.Path) -> None:
  """`--strategy`: every named strategy beside `disabled`, one JSON line per slot count."""
  names = {value: value for value in _STRATEGY.value}
  if bench_strategies.COMPOSITE in names:
    model, names[bench_strategies.COMPOSITE] = bench_strategies.composite_source(
        model, _SOURCE.value, tmp)
  prompts = bench_strategies.prompt_sets(model, _PROMPTS.value, _PROMPT_LEN.value, _SEED.value)
  device = jax.devices()[0]
  for slots in slot_counts:
    record = bench_strategies.measure(
        model, names, prompts, slots=slots, new_tokens=_NEW_TOKENS.value, rounds=_ROUNDS.value,
        temperature=_TEMPERATURE.value, top_p=_TOP_P.value, seed=_SEED.value)
    print(json.dumps({"flags": {flag.name: flag.value for flag in _REPORTED_FLAGS},
                      "slots": slots, "source": source,
                      "device": f"{device.platform}:{device.device_kind}", **record}),
          flush=True)


def _measure(model, source: str, load_s: float, slots: int, window: DraftWindow) -> dict:
  """MTP off and on, alternating, at one slot count and draft window; returns the JSON line."""
  bucket = pow2_bucket(_PROMPT_LEN.value + 1)
  max_len = max(_PROMPT_LEN.value + _NEW_TOKENS.value + 1, bucket - 2)
  engine_kwargs = dict(slots=slots, max_len=max_len, prefill_buckets=(bucket,))
  engines = {mode: model.engine(native_mtp=mode == "on", draft_tokens=window.max,
                                **engine_kwargs) for mode in ("off", "on")}
  engines["timing"] = model.engine(native_mtp=True, timing=True, draft_tokens=window.max,
                                   **engine_kwargs)

  prompts = _prompts(model)
  requests = _requests(prompts, _NEW_TOKENS.value)

  compile_s = {}
  for mode, engine in engines.items():   # every prefill bucket and step variant
    start = time.perf_counter()
    warm_up(engine)
    compile_s[mode] = time.perf_counter() - start

  runs = {"off": ("off", AdaptiveDrafting()), "on": ("on", AdaptiveDrafting()),
          "always": ("on", None)}
  for engine_mode, adaptive in runs.values():    # untimed: device caches, the policy's prices
    _timed_run(engines[engine_mode], requests, adaptive, window)
  seconds = {mode: 0.0 for mode in runs}
  tokens = {mode: 0 for mode in runs}
  host = {mode: {True: 0.0, False: 0.0} for mode in runs}
  last: dict[str, list[Result]] = {}
  identical = True
  with _background_load(_BACKGROUND_LOAD.value):
    for _ in range(_ROUNDS.value):
      for mode, (engine_mode, adaptive) in runs.items():
        results, elapsed, host_seconds = _timed_run(engines[engine_mode], requests, adaptive,
                                                    window)
        seconds[mode] += elapsed
        tokens[mode] += sum(len(r.tokens) for r in results)
        for overlapped, spent in host_seconds.items():
          host[mode][overlapped] += spent
        last[mode] = results
      identical &= all(a.tokens == b.tokens == c.tokens
                       for a, b, c in zip(last["off"], last["on"], last["always"]))

  timed = _timed_run(engines["timing"], requests, None, window)[0]
  timing = MtpStats.total(r.stats for r in timed)
  # Each live request adds its step's duration and one verified window, so this ratio is the
  # occupancy-weighted mean duration of one step's draft / verify half.
  per_step = max(timing.verified_windows, 1) * 1e3
  stats = MtpStats.total(r.stats for r in last["always"])
  rate = {mode: tokens[mode] / seconds[mode] for mode in seconds}
  step_ms = {mode: _step_ms(last[mode]) for mode in ("off", "always")}
  c_draft = step_ms["always"] / step_ms["off"] - 1.0 if step_ms["off"] else 0.0
  ideal = stats.tokens_per_verify / (1.0 + c_draft)
  weights_mb = weight_mb_per_step(model.weights(with_mtp=True)[1], model.config, slots)
  device = jax.devices()[0]
  line = {
      "flags": {flag.name: flag.value for flag in _REPORTED_FLAGS},
      "slots": slots,
      "draft_window": window.as_dict(),
      "source": source,
      "device": f"{device.platform}:{device.device_kind}",
      "model": {"vocab": model.config.vocab_size, "hidden": model.config.hidden,
                "layers": model.config.n_layers},
      "tokens_per_s_off": rate["off"],
      "tokens_per_s_on": rate["on"],
      "speedup": rate["on"] / rate["off"],
      "tokens_per_s_on_always_drafting": rate["always"],
      "speedup_always_drafting": rate["always"] / rate["off"],
      "drafting_share_on": _drafting_share(last["on"]),
      "accept_rate": stats.accept_rate,
      "accept_rate_by_position": stats.accept_rate_by_position,
      "tokens_per_target_pass": stats.tokens_per_target_pass,
      "tokens_per_verify": stats.tokens_per_verify,
      "ideal_speedup_free_draft": stats.tokens_per_verify,
      "c_draft": c_draft,
      "ideal_speedup": ideal,
      "achieved_fraction": (rate["always"] / rate["off"]) / ideal,
      "step_ms_off": step_ms["off"],
      "step_ms_always_drafting": step_ms["always"],
      "weights_mb_per_step": weights_mb,
      "bandwidth_bound_speedup": stats.tokens_per_target_pass * weights_mb["plain"]
                                 / weights_mb["verify_draft"],
      "draft_ms_per_step": timing.proposal_compute_us / per_step,
      "draft_ms_per_draft_token": timing.proposal_compute_us / max(timing.drafted, 1) / 1e3,
      "verify_ms_per_step": timing.verification_compute_us / per_step,
      "latency_off": _latency_ms(last["off"]),
      "latency_on": _latency_ms(last["on"]),
      "outputs_identical": identical,
      # The same digest from two builds means the same tokens (tools/bench_ab.py compares them).
      "outputs_sha256": hashlib.sha256(json.dumps([r.tokens for r in last["off"]]).encode()
                                       ).hexdigest(),
      "load_s": load_s,
      "compile_s": compile_s,
      "native_mtp": timing.as_dict(),   # the timing pass: same counters, durations filled
      "policy": _policy(engines["on"]),
      "overlap_fraction": {mode: overlap_fraction(spent) for mode, spent in host.items()},
  }
  return line


if __name__ == "__main__":
  app.run(main)
