"""The engine contract the scheduler, `warm_up` and the server rely on (JetStream's
`prefill` -> `insert` -> `step` -> `free`), and the settings an engine compiles for.

Everything that varies per request (positions, sampler settings, drafts, keys) is an array, so
each prefill bucket compiles once and a step compiles once per slot bucket.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Protocol

import jax.numpy as jnp
import numpy as np
from absl import logging

from mtpjax import errors
from mtpjax.draft_window import MAX_DRAFT_TOKENS
from mtpjax.engine.sampling import MAX_TOP_LOGPROBS, SamplerParams
from mtpjax.models import kv_cache
from mtpjax.models.config import ModelConfig

# ResultTokens columns: one int32 [B, result_width] array per step means one device->host copy.
# A step's `step_width` columns: the first two committed tokens, their count and the accepted
# drafts; a window of k drafts commits up to k + 1 tokens, the third one on in the columns
# after ACCEPTED. A burst's steps come one after another (`burst_rows`). An engine
# whose host extends native MTP's drafts (`EngineConfig.mtp_chain_columns`) appends the slot's
# next MTP chain, draft_tokens more columns.
TOKEN_A, TOKEN_B, COUNT, ACCEPTED = range(4)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")   # `EngineConfig.kv_cache_dtype`
# The longest burst (`EngineConfig.decode_steps`): past a few steps a dispatch's cost is
# already amortized, and a burst delays admitting a waiting request by its length.
MAX_DECODE_STEPS = 32


def check_kv_cache_dtype(name: str) -> None:
  """Refuse a `kv_cache_dtype` not in KV_CACHE_DTYPES (the server asks before it loads)."""
  if name not in KV_CACHE_DTYPES:
    raise errors.MtpjaxError(f"engine.kv_cache_dtype {name!r} is not one of {KV_CACHE_DTYPES}",
                             field="engine.kv_cache_dtype",
                             remedy="choose auto (the activation dtype), bfloat16, float16 or "
                                    "float32")


def kv_dtype(name: str, activation_dtype) -> jnp.dtype:
  """The dtype of the attention caches' values for `kv_cache_dtype` `name` ("auto": the
  activations'). bfloat16 or float16 halve a float32 model's KV bytes; float16, llama.cpp's
  default cache, keeps 3 more bits of each value than bfloat16."""
  check_kv_cache_dtype(name)
  return jnp.dtype(activation_dtype if name == "auto" else name)


def pow2_bucket(n: int, minimum: int = 16) -> int:
  """The smallest power-of-two length >= n (and >= minimum): padded shapes compile once each."""
  size = minimum
  while size < n:
    size *= 2
  return size


def counted(trace_counts: dict[str, int], name: str, fn: Callable) -> Callable:
  """`fn`, counting its traces under `name` (tests assert one trace per shape).

  `wraps` keeps fn's signature visible to jax.jit: without it `donate_argnames` cannot find
  the donated arguments among positional ones and silently donates nothing.
  """
  @functools.wraps(fn)
  def traced(*args, **kwargs):
    trace_counts[name] = trace_counts.get(name, 0) + 1
    return fn(*args, **kwargs)
  return traced


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """An engine's settings, resolved once (`from_config` for a config's `engine` group). Its
  defaults are THE defaults: the server config (`mtpjax/configs/glm.py`), `Model.engine` and
  the benchmarks read them from here."""
  slots: int = 4                           # sequences decoded together (continuous batching)
  max_len: int = 8192                      # prompt + generated tokens per sequence
  # Compiled prompt chunk sizes: longer prompts are prefilled in chunks of the largest that
  # fits, between the live streams' steps (a larger chunk would delay them longer).
  prefill_buckets: tuple[int, ...] = (16, 32, 64, 128, 256)
  native_mtp: bool = False
  timing: bool = False                     # sync after verify and draft to time them
  logprobs: int = MAX_TOP_LOGPROBS         # top logprobs a step computes (0: none computed)
  prefix_cache: int = 8                    # cached prompt prefixes kept (0: no prefix caching)
  draft_tokens: int = 1                    # most drafts a step verifies (window max)
  host_drafts: bool = False                # the host proposes drafts (n-gram, alone or after MTP)
  kv_page: int = 16                        # trunk cache rows per page (a power of two)
  kv_pages: int = 0                        # pages per layer's pool (0: every slot at max_len)
  kv_cache_dtype: str = "auto"             # attention caches' values (auto: the activations')
  decode_steps: int = 4                    # steps a burst runs in one dispatch

  # The fields a config's `engine` group sets (the rest follow from the model and strategy).
  SETTINGS = ("slots", "max_len", "prefill_buckets", "timing", "logprobs", "prefix_cache",
              "kv_page", "kv_pages", "kv_cache_dtype", "decode_steps")

  @classmethod
  def from_config(cls, engine) -> "EngineConfig":
    """The settings of a config's `engine` group (an ml_collections group or a mapping)."""
    values = {name: engine[name] for name in cls.SETTINGS}   # typed by the config already
    return cls(**dict(values, prefill_buckets=tuple(values["prefill_buckets"])))

  def fitting_buckets(self) -> tuple[int, ...]:
    """This config's prefill buckets that fit its cache (a default set for a short context
    keeps only its smaller sizes)."""
    return tuple(b for b in self.prefill_buckets if b <= self.max_len + 2)

  @property
  def cache_len(self) -> int:
    """Rows a sequence can hold, whole pages: spare rows hold the verify rows of the last step
    (the current token and its drafts)."""
    return -(-(self.max_len + 1 + self.draft_tokens) // self.kv_page) * self.kv_page

  @property
  def max_pages(self) -> int:
    """Pages of one sequence at full context: the page table's width."""
    return self.cache_len // self.kv_page

  @property
  def pool_pages(self) -> int:
    """Pages in each trunk layer's pool: `kv_pages`, or by default every slot at full context
    (the memory of per-slot caches)."""
    return self.kv_pages or self.slots * self.max_pages

  def pages_for(self, rows: int) -> int:
    """Pages holding a sequence's first `rows` rows (at most a whole table)."""
    return min(-(-rows // self.kv_page), self.max_pages)

  def request_pages(self, prompt_tokens: int, new_tokens: int) -> int:
    """Every page a request can reach: its prompt, `new_tokens` more and the deepest window
    of verify rows its last step writes."""
    return self.pages_for(prompt_tokens + new_tokens + self.draft_tokens)

  def check_fits(self, prompt_tokens: int, new_tokens: int) -> None:
    """Refuse a request the whole pool could never hold (`errors.KvPagesError`): it would
    wait for pages forever."""
    need = self.request_pages(prompt_tokens, new_tokens)
    if need > self.pool_pages:
      raise errors.KvPagesError(
          f"a request of {prompt_tokens} prompt + {new_tokens} new tokens needs {need} KV "
          f"pages of {self.kv_page} rows; the pool holds {self.pool_pages}",
          field="engine.kv_pages",
          remedy="raise engine.kv_pages, or lower max_new_tokens or the prompt length")

  @property
  def window_buckets(self) -> tuple[int, ...]:
    """The draft windows a verifying step compiles for: a step pads every slot's window up to
    the smallest of these that holds them all (one compile per bucket and slot bucket)."""
    return slot_buckets(self.draft_tokens) if self.drafts else ()

  def windows(self, drafting) -> np.ndarray:
    """Each slot's draft window from a step's `drafting` (see `DecodeEngine.step`)."""
    if drafting is None:
      return np.full(self.slots, self.draft_tokens, np.int32)
    drafting = np.asarray(drafting)
    if drafting.dtype == bool:
      return np.where(drafting, self.draft_tokens, 0).astype(np.int32)
    return np.clip(drafting, 0, self.draft_tokens).astype(np.int32)

  def window_bucket(self, windows: np.ndarray, active: np.ndarray) -> int:
    """The window bucket of a step: the smallest that holds every active slot's window (0:
    no active slot drafts, a plain step)."""
    live = windows[active] if active.any() else windows
    deepest = int(live.max()) if live.size else 0
    return next((k for k in self.window_buckets if k >= deepest), 0) if deepest else 0

  @property
  def drafts(self) -> bool:
    """Whether steps verify drafts: native MTP's, the host's, or both (a composite)."""
    return self.native_mtp or self.host_drafts

  @property
  def mtp_chain_columns(self) -> bool:
    """Whether ResultTokens end with each slot's next MTP chain: a composite's host extends
    the chain, so it must see it."""
    return self.native_mtp and self.host_drafts

  @property
  def step_width(self) -> int:
    """One step's ResultTokens columns: TOKEN_A, TOKEN_B, COUNT, ACCEPTED, then tokens
    3 .. k + 1 of a window of k drafts."""
    return 3 + max(self.draft_tokens, 1)

  @property
  def result_width(self) -> int:
    """ResultTokens columns: a burst's steps (`step_width` each), then the MTP chain
    (`mtp_chain_columns`)."""
    width = self.step_width * self.decode_steps
    return width + self.draft_tokens if self.mtp_chain_columns else width

  def prefill_chunks(self, prompt, start: int = 0
                     ) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """(the prompt as int32 ids, (start, tokens, bucket) of each chunk it is prefilled in from
    token `start` on, the tokens before it being cached).

    Chunks take the largest bucket's worth of tokens at a time; the last one keeps a row of its
    bucket for the first sampled token's MTP row, so a chunk that would end the prompt exactly
    leaves its last token to a final chunk. An empty prompt or one without room to generate
    is refused (`ContextLengthError`).
    """
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    if prompt.size == 0:
      raise errors.MtpjaxError("the prompt is empty", field="prompt",
                               remedy="pass at least one token id")
    if prompt.size >= self.max_len:
      raise errors.ContextLengthError(
          f"a prompt of {prompt.size} tokens leaves no room in the context length "
          f"(engine.max_len {self.max_len})", field="prompt",
          remedy="shorten the prompt or raise engine.max_len")
    largest = self.page
    chunks, rest = [], int(prompt.size) - start
    while rest + 1 > largest:
      take = min(largest, rest - 1)
      chunks.append((start, take, self.bucket_for(take)))
      start, rest = start + take, rest - take
    chunks.append((start, rest, self.bucket_for(rest + 1)))
    return prompt, chunks

  @property
  def page(self) -> int:
    """The largest bucket that fits the cache: the chunk size of long prompts."""
    return self.bucket_for(max((b for b in self.prefill_buckets if b <= self.cache_len),
                               default=self.prefill_buckets[0]))

  def kv_dtype(self, activation_dtype) -> jnp.dtype:
    """The dtype of the attention caches' values (module `kv_dtype`)."""
    return kv_dtype(self.kv_cache_dtype, activation_dtype)

  def check_model(self, cfg: ModelConfig) -> None:
    check_kv_cache_dtype(self.kv_cache_dtype)
    if not kv_cache.tiles_blocks(self.kv_page):
      raise errors.MtpjaxError(
          f"engine.kv_page must be a power of two up to {kv_cache.blockwise.BLOCK}, got "
          f"{self.kv_page}", field="engine.kv_page",
          remedy="choose 16, 32, 64 ... (attention reads blocks of whole pages)")
    if self.page % self.kv_page:
      raise errors.MtpjaxError(
          f"a prefill chunk of {self.page} rows is not whole pages of {self.kv_page}",
          field="engine.kv_page",
          remedy="choose a kv_page that divides the largest prefill bucket")
    if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
      raise errors.SpeculativeConfigError(
          f"draft_tokens must be in 1..{MAX_DRAFT_TOKENS}, got {self.draft_tokens}",
          field="speculative.max_draft_tokens", remedy=f"choose 1..{MAX_DRAFT_TOKENS}")
    if not 1 <= self.decode_steps <= MAX_DECODE_STEPS:
      raise errors.MtpjaxError(
          f"engine.decode_steps must be in 1..{MAX_DECODE_STEPS}, got {self.decode_steps}",
          field="engine.decode_steps",
          remedy="choose 1 (a dispatch a token) or a few (4-8: one dispatch for that many)")
    if self.native_mtp and not cfg.has_mtp:
      raise errors.SpeculativeConfigError(
          "native MTP requested but the model has no NextN block", field="native_mtp",
          remedy="set the speculative strategy to disabled")

  def bucket_for(self, length: int) -> int:
    for bucket in self.prefill_buckets:
      if bucket >= length and bucket <= self.cache_len:
        return bucket
    raise errors.MtpjaxError(
        f"a prompt of {length - 1} tokens does not fit the prefill buckets "
        f"{self.prefill_buckets} (max_len {self.max_len})", field="engine.prefill_buckets",
        remedy="shorten the prompt or raise engine.max_len and engine.prefill_buckets")


def committed_tokens(row) -> list[int]:
  """The tokens one ResultTokens row commits, in order."""
  row = list(row)
  return ([row[TOKEN_A], row[TOKEN_B]] + row[ACCEPTED + 1:])[:row[COUNT]]


def burst_rows(row, steps: int, width: int) -> list[list[int]]:
  """The ResultTokens row of each of a burst's `steps` steps (`width` columns each) in one
  slot's row."""
  row = list(row)
  return [row[j * width:(j + 1) * width] for j in range(steps)]


def mtp_chain(row, draft_tokens: int) -> list[int]:
  """The next native-MTP draft chain a ResultTokens row ends with (`mtp_chain_columns`)."""
  return list(row)[-draft_tokens:]


def slot_buckets(slots: int) -> tuple[int, ...]:
  """The slot counts a step compiles for over `slots` slots: powers of two below it, and it."""
  return tuple(sorted({min(2 ** i, slots) for i in range(slots.bit_length() + 1)}))


class DecodeEngine(Protocol):
  """What runs requests over a fixed set of slots.

  A prefix (`prefill`) is inserted into a slot of the state; `step` advances every active slot
  and returns ResultTokens [slots, 3 + draft_tokens] (`committed_tokens` reads a row) and a dict of
  timings (us) and, when `logprobs` was asked of an engine with `engine_cfg.logprobs`,
  "logprobs": (chosen [slots, R], top ids and top logprobs [slots, R, n]) of the rows a step can
  commit (R = window + 1 verifying, else 1); a prefix then carries its first token's as
  `logprobs`. `free` releases a finished slot. With drafts, `drafting` [slots] says which
  slots use their drafts (bool) or how many (int, each slot's window), and `catch_up` brings
  paused slots' MTP caches up to date. With `host_drafts`, `drafts` [slots, draft_tokens] are
  the host's proposals (a composite's starts with the MTP chain the last result returned).
  `decode_steps` (1 or `decode_burst`): that many steps of the same kind and window in one
  dispatch, each committing as its own step would (the host drops what follows a stop); the
  result holds each step's row one after another (`burst_rows`).
  """
  engine_cfg: EngineConfig
  trace_counts: dict[str, int]
  # The steps one dispatch can run (`EngineConfig.decode_steps` where the engine runs bursts,
  # else 1).
  decode_burst: int

  def warm_up_schedule(self) -> list[np.ndarray]:
    """Active-slot masks whose steps compile every step shape this engine can run."""

  def init_state(self) -> Any: ...

  def prefill(self, prompt: np.ndarray, sampler: SamplerParams, *, state: Any,
              logprobs: bool = False, nextn: bool = True) -> Any: ...

  def start_prefill(self, prompt: np.ndarray, sampler: SamplerParams, *, state: Any,
                    logprobs: bool = False, new_tokens: int = 1, nextn: bool = True) -> Any:
    """A prefill job into `state`'s KV pages to run chunk by chunk: `prefill_chunk` until it
    returns True, then the job's `prefix` is what `prefill` returns. None when the page pool
    cannot reserve the prompt and `new_tokens` more now (a sequence growing past its
    reservation takes free pages while there are). `nextn` False: without the NextN block's
    rows, for a slot that will not draft (`detach`)."""

  def prefill_chunk(self, job: Any) -> bool: ...

  def drop_prefill(self, job: Any) -> None:
    """Give back a job's pages when it will not be inserted."""

  def insert(self, prefix: Any, state: Any, slot: int) -> Any: ...

  def detach(self, state: Any, slot: int) -> Any:
    """Native MTP: the slot never drafts again before it is freed (nothing records its MTP
    inputs; steps over detached slots alone are steps with MTP off)."""

  def step(self, state: Any, active: np.ndarray, drafting: np.ndarray | None = None, *,
           drafts: np.ndarray | None = None, logprobs: bool = False,
           decode_steps: int = 1) -> tuple[Any, np.ndarray, dict]: ...

  # Whether `launch` may start a step before the last one is collected, where that one is
  # `fixed` (it commits exactly the rows it was launched for).
  overlapping: bool

  def launch(self, state: Any, active: np.ndarray, drafting: np.ndarray | None = None, *,
             drafts: np.ndarray | None = None, logprobs: bool = False,
             decode_steps: int = 1) -> tuple[Any, Any]:
    """`step` without waiting: (state, a pending step whose `collect()` returns what `step`
    returns beside the state, and whose `fixed` says whether the next step may be launched
    before it is collected)."""

  def catch_up(self, state: Any, active: np.ndarray) -> Any: ...

  def free(self, state: Any, slot: int) -> Any: ...


def warm_up(engine: DecodeEngine, log: Callable[..., None] = logging.info) -> None:
  """Compile every prefill bucket and every step variant of an engine now, not under the first
  requests, logging each with its seconds ("warm-up 3 of 14: ..."), so a long first start shows
  its progress. Runs on a throwaway state with every slot inactive but the one that sets a
  step's slot count."""
  plan = _warm_up_plan(engine)
  state = engine.init_state()
  started = time.perf_counter()
  for i, (label, action) in enumerate(plan, 1):
    state = action(state)
    log("warm-up %d of %d: %s (%.1f s so far)", i, len(plan), label,
        time.perf_counter() - started)


def _warm_up_plan(engine: DecodeEngine) -> list[tuple[str, Callable[[Any], Any]]]:
  """`warm_up`'s calls in order, each a (label, state -> state) that compiles one program (the
  slots it borrows given back: each schedule's slot frees its pages after each window's steps
  and after its last, so the warm-up needs no more of a small KV pool than one short request
  does, bursts and window buckets however many)."""
  ec = engine.engine_cfg
  plan = []

  def prefill(bucket: int, nextn: bool):
    def action(state):
      state = engine.free(state, 0)    # its pages back first: a small pool may need them
      prefix = engine.prefill(np.zeros(bucket - 1, np.int32), SamplerParams(), state=state,
                              nextn=nextn)
      return engine.insert(prefix, state, 0)
    return action

  # With native MTP, a prompt is prefilled with or without its NextN rows (`detach`).
  for bucket in ec.prefill_buckets:
    if bucket - 1 >= ec.max_len or bucket > ec.cache_len:
      continue
    for nextn in (True, False) if ec.native_mtp else (True,):
      plan.append((f"prefill bucket {bucket}{'' if nextn else ' without NextN rows'}",
                   prefill(bucket, nextn)))
  drafts = np.zeros((ec.slots, ec.draft_tokens), np.int32) if ec.host_drafts else None
  bursts = sorted({1, engine.decode_burst})   # a step, and a decode burst where it runs them
  no_drafts = np.zeros(ec.slots, np.int32)

  def released(state, reach):
    for slot in np.flatnonzero(reach):
      state = engine.free(state, int(slot))
    return state

  def step(reach, windows, burst: int, release: bool = False):
    def action(state):
      if windows is None:
        state, _, _ = engine.step(state, reach, decode_steps=burst)
      else:
        state, _, _ = engine.step(state, reach, windows, drafts=drafts, decode_steps=burst)
      return released(state, reach) if release else state
    return action

  def detached(reach):
    def action(state):
      state = engine.catch_up(state, reach)   # the missing MTP rows, before drafting again
      for slot in np.flatnonzero(reach):       # and the steps of detached slots alone
        state = engine.detach(state, int(slot))
      return state
    return action

  plan_steps = []
  for reach in engine.warm_up_schedule():
    name = f"{int(np.flatnonzero(reach).max()) + 1} slots:"
    if not ec.drafts:
      plan_steps += [(f"{name} step, {burst} a dispatch",
                      step(reach, None, burst, burst == bursts[-1])) for burst in bursts]
      continue
    for window in ec.window_buckets:           # every window bucket, then plain steps
      plan_steps += [(f"{name} step, window {window}, {burst} a dispatch",
                      step(reach, np.full(ec.slots, window, np.int32), burst,
                           burst == bursts[-1])) for burst in bursts]
    plan_steps += [(f"{name} step without drafts, {burst} a dispatch",
                    step(reach, no_drafts, burst, burst == bursts[-1] and not ec.native_mtp))
                   for burst in bursts]
    if ec.native_mtp:
      plan_steps.append((f"{name} NextN catch-up", detached(reach)))
      plan_steps += [(f"{name} step of detached slots, {burst} a dispatch",
                      step(reach, no_drafts, burst, burst == bursts[-1])) for burst in bursts]
  if plan_steps:   # the prefills' slot back before the first step
    label, first = plan_steps[0]
    plan_steps[0] = (label, lambda state: first(engine.free(state, 0)))
  return plan + plan_steps
