"""Every speculative strategy side by side, for `bench_decode --strategy=...`.

Over two kinds of prompts (held-out text, and code-like text that repeats earlier text, as
editing a file does), each strategy runs the same requests with the default drafting policy,
the strategies alternating round by round so that drift of the machine hits them alike, beside
`disabled` (no speculation). Per strategy and kind: tokens/s, its ratio to `disabled`, tokens
per target pass and accept rate with every step drafting (what the strategy's drafts are worth
before the policy decides when to use them), and whether the tokens equal `disabled`'s.

`composite` names the package's composite strategy; a v1 package that declares none (the
shipped demo) is copied with one added (`testing.strategies.declare_composite`: native MTP,
then an ngram-simple tail of up to 4 tokens).
"""

from __future__ import annotations

import pathlib
import time

import numpy as np

import mtpjax
from mtpjax.engine.contract import pow2_bucket, warm_up
from mtpjax.engine.drafting_policy import AdaptiveDrafting
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.gguf.tokenizer import GgufTokenizer
from mtpjax.package import generation_rules
from mtpjax.telemetry import MtpStats
from mtpjax.testing import corpus, strategies

COMPOSITE = "composite"
BASELINE = "disabled"


def composite_source(model, source: str, tmp: pathlib.Path) -> tuple[object, str]:
  """(model, the strategy id `composite` stands for): the package's own composite, or a copy of
  the package with one declared."""
  manifest = model.source.manifest
  generation = None if manifest is None else manifest.generation
  block = None if generation is None else generation.speculative_decoding
  for name, strategy in (block.strategies.items() if block is not None else ()):
    if strategy.type == generation_rules.COMPOSITE_TYPE:
      return model, name
  if manifest is None:
    raise ValueError(f"{source}: `composite` needs a layer package (a GGUF declares no "
                     "strategies)")
  copy = strategies.composite_copy(source, tmp / "composite-package")
  return mtpjax.load(str(copy), dtype=model.dtype, weights=model.weight_mode), (
      strategies.COMPOSITE_ID)


def prompt_sets(model, count: int, length: int, seed: int) -> dict[str, list[np.ndarray]]:
  encode = GgufTokenizer.from_metadata(model.metadata).encode
  return {kind: [np.asarray(p, np.int32) for p in make(encode, count, length, seed=seed)]
          for kind, make in (("text", corpus.held_out_prompts),
                             ("code", corpus.repeated_code_prompts))}


def measure(model, strategy_ids: dict[str, str], prompts: dict[str, list[np.ndarray]], *,
            slots: int, new_tokens: int, rounds: int, temperature: float, top_p: float,
            seed: int) -> dict:
  """One JSON-ready record: per prompt kind, per strategy (shown name -> strategy id)."""
  length = max(len(p) for group in prompts.values() for p in group)
  bucket = pow2_bucket(length + 1)
  engine_kwargs = dict(slots=slots, max_len=max(length + new_tokens + 1, bucket - 2),
                       prefill_buckets=(bucket,))
  runs = {}
  for shown, strategy_id in {BASELINE: BASELINE, **strategy_ids}.items():
    resolution = model.resolve(strategy_id)
    engine, drafting = model.drafting_engine(resolution, **engine_kwargs)
    start = time.perf_counter()
    warm_up(engine)
    runs[shown] = dict(engine=engine, window=resolution.draft_window, drafter=drafting.drafter,
                       type=resolution.strategy_type, draft_tokens=drafting.draft_tokens,
                       compile_s=time.perf_counter() - start)

  def run(shown: str, requests: list[Request], adaptive) -> tuple[list, float]:
    spec = runs[shown]
    start = time.perf_counter()
    results = SlotScheduler(spec["engine"], adaptive=adaptive, window=spec["window"],
                            drafter=spec["drafter"]).run(requests)
    return results, time.perf_counter() - start

  record = {}
  for kind, group in prompts.items():
    requests = [Request(prompt=p, max_new_tokens=new_tokens,
                        sampler=SamplerParams(temperature, 0, top_p, seed=seed + i))
                for i, p in enumerate(group)]
    always = {shown: MtpStats.total(r.stats for r in run(shown, requests, None)[0])
              for shown in runs}                       # untimed: also warms each engine
    seconds = dict.fromkeys(runs, 0.0)
    tokens = dict.fromkeys(runs, 0)
    outputs = {}
    for _ in range(rounds):
      for shown in runs:
        results, elapsed = run(shown, requests, AdaptiveDrafting())
        seconds[shown] += elapsed
        tokens[shown] += sum(len(r.tokens) for r in results)
        outputs[shown] = [r.tokens for r in results]
    rate = {shown: tokens[shown] / seconds[shown] for shown in runs}
    record[kind] = {shown: {
        "strategy_id": strategy_id if shown != BASELINE else None,
        "type": runs[shown]["type"],
        "draft_tokens": runs[shown]["draft_tokens"] if runs[shown]["type"] else 0,
        "tokens_per_s": rate[shown],
        "speedup": rate[shown] / rate[BASELINE],
        "tokens_per_target_pass": always[shown].tokens_per_target_pass,
        "accept_rate": always[shown].accept_rate,
        # The host's n-gram lookups and index updates (0 for native MTP's on-device chain).
        "host_draft_us_per_step": (always[shown].proposal_compute_us
                                   / max(always[shown].target_passes, 1)),
        "outputs_identical": outputs[shown] == outputs[BASELINE],
    } for shown, strategy_id in {BASELINE: BASELINE, **strategy_ids}.items()}
  record["compile_s"] = {shown: spec["compile_s"] for shown, spec in runs.items()}
  return record
