"""Jitted prefill, insert and decode/verify steps over a fixed set of slots (DECODE.md §1-§3).

The contract follows JetStream: `prefill` -> `insert(prefix, state, slot)` -> `step(state)`.
Everything that varies per request (positions, sampler settings, drafts, keys) is an array, so
each prefill bucket compiles once and the step compiles once per slot bucket: a step computes
only the slots up to the highest active one, rounded up to a power of two (`Engine.slots_for`).
The state is donated, so caches are updated in place.

With native MTP the step verifies `[current, draft]` in one target pass, samples both
positions with position-keyed keys, accepts the draft iff the target's own token equals it,
and drafts the next token from the MTP head over the two new rows. Rows past the committed
length are never read before they are rewritten, so a rejection needs no rollback.

While no slot drafts (the scheduler paused drafting), a plain step costs what a step with MTP
off costs: the MTP block does not run, each committed row's MTP inputs (token, trunk hidden)
go to a history buffer and the slot's MTP KV falls behind. Before drafting resumes, catch-up
passes run the MTP block over the missing rows, CATCH_UP_ROWS at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtpjax import errors
from mtpjax.engine.sampling import (SamplerParams, greedy_tokens, request_key, sample,
                                    token_logprobs)
from mtpjax.models.config import ModelConfig
from mtpjax.models.glm4_moe import init_kv, kv_cache_shapes, previous_hidden
from mtpjax.models.layers import live_slots, write_rows

# ResultTokens columns: one int32 [B, 4] array per step means one device->host copy.
TOKEN_A, TOKEN_B, COUNT, ACCEPTED = range(4)
# MTP rows one catch-up pass writes per slot; the MTP cache and history keep this many spare rows.
CATCH_UP_ROWS = 16


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


def pow2_bucket(n: int, minimum: int = 16) -> int:
  """The smallest power-of-two length >= n (and >= minimum): padded shapes compile once each."""
  size = minimum
  while size < n:
    size *= 2
  return size


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  slots: int = 1
  max_len: int = 512                       # prompt + generated tokens per sequence
  prefill_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
  native_mtp: bool = False
  timing: bool = False                     # sync after draft and verify to time them
  logprobs: int = 0                        # top logprobs per committed token (0: none computed)

  @property
  def cache_len(self) -> int:
    """Two spare rows hold the verify and draft rows of the last step."""
    return self.max_len + 2

  @property
  def mtp_cache_len(self) -> int:
    """MTP KV and history rows: a catch-up pass writes a whole window past the last row."""
    return self.cache_len + CATCH_UP_ROWS

  def padded_prompt(self, prompt) -> tuple[np.ndarray, int]:
    """(tokens [1, bucket], prompt length): the bucket leaves one row for the first sampled
    token's MTP row; an empty prompt or one without room to generate is refused."""
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    if prompt.size == 0:
      raise errors.MtpjaxError("the prompt is empty", field="prompt",
                               remedy="pass at least one token id")
    if prompt.size >= self.max_len:
      raise errors.MtpjaxError(
          f"a prompt of {prompt.size} tokens leaves no room in max_len {self.max_len}",
          field="prompt", remedy="shorten the prompt or raise engine.max_len")
    tokens = np.zeros((1, self.bucket_for(prompt.size + 1)), np.int32)
    tokens[0, :prompt.size] = prompt
    return tokens, int(prompt.size)

  def check_model(self, cfg: ModelConfig) -> None:
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


@flax.struct.dataclass
class DecodeState:
  """Per-slot decode state; see DECODE.md §3 for the invariant it keeps.

  A prefilled prompt is a DecodeState with one slot, copied into a slot by `insert`.
  """
  kv: list
  mtp_kv: tuple | None
  # Native MTP only (else None): the MTP block's inputs (token x_p, trunk hidden h_{p-1}) of
  # the rows plain steps committed, and how many rows up to `pos` the MTP KV still lacks.
  history_tokens: jax.Array | None   # [B, S'] int32
  history_hidden: jax.Array | None   # [B, S', D]
  mtp_lag: jax.Array | None          # [B] int32
  pos: jax.Array          # [B] position of `current`
  current: jax.Array      # [B] sampled token not yet in the target KV
  draft: jax.Array        # [B] MTP draft for position pos + 1
  h_prev: jax.Array       # [B, D] post-norm target hidden at pos - 1
  keys: jax.Array         # [B, 2] raw request keys
  temperature: jax.Array  # [B]
  top_k: jax.Array        # [B]
  top_p: jax.Array        # [B]


def _sampler_arrays(sampler: SamplerParams):
  return (np.asarray([request_key(sampler.seed)], np.uint32),
          np.asarray([sampler.temperature], np.float32),
          np.asarray([sampler.top_k], np.int32),
          np.asarray([sampler.top_p], np.float32))


class Engine:
  """Compiled steps for one model (one stage owning everything) and a fixed slot count."""

  def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, cfg: ModelConfig,
               engine_cfg: EngineConfig, *, dtype=jnp.float32):
    engine_cfg.check_model(cfg)
    self.graphdef = graphdef
    self.params = params
    # Steps take the parameters as a flat list of arrays: flattening the nnx.State (Python
    # callbacks per Variable) on every call costs a few hundred microseconds per step.
    self._leaves, self._treedef = jax.tree.flatten(params)
    self.cfg = cfg
    self.engine_cfg = engine_cfg
    self.dtype = dtype
    self.trace_counts: dict[str, int] = {}
    # With engine.logprobs: the last prefill's or step's (chosen [B, R], top ids [B, R, n],
    # top logprobs [B, R, n]) on the host, R the rows it committed at most (1 or 2).
    self.last_logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    # The slot counts a step compiles for (`slots_for`): powers of two below `slots`, and it.
    self.slot_buckets = tuple(sorted({min(2 ** i, engine_cfg.slots)
                                      for i in range(engine_cfg.slots.bit_length() + 1)}))
    # The host's copy of `mtp_lag` for the last state this engine returned (by identity), so a
    # drafting step need not read the lag back from the device before it catches up.
    self._lag_state: weakref.ref | None = None
    self._lag: np.ndarray | None = None
    self._prefill = jax.jit(self._counted("prefill", self._prefill_fn))
    self._insert = jax.jit(self._counted("insert", self._insert_fn), donate_argnames=("state",))
    if engine_cfg.native_mtp:
      self._verify = jax.jit(self._counted("verify", self._verify_fn), donate_argnames=("state",))
      self._draft = jax.jit(self._counted("draft", self._draft_fn), donate_argnames=("state",))
      self._fused = jax.jit(self._counted("verify_draft", self._fused_fn),
                            donate_argnames=("state",))
      self._plain = jax.jit(self._counted("plain", self._plain_fn), donate_argnames=("state",))
      self._catch_up = jax.jit(self._counted("catch_up", self._catch_up_fn),
                               donate_argnames=("state",))
    else:
      self._decode = jax.jit(self._counted("decode", self._decode_fn), donate_argnames=("state",))

  def _counted(self, name: str, fn: Callable) -> Callable:
    return counted(self.trace_counts, name, fn)

  def _model(self, leaves):
    return nnx.merge(self.graphdef, jax.tree.unflatten(self._treedef, leaves))

  # --- state --------------------------------------------------------------------------------

  def init_state(self) -> DecodeState:
    cfg, ec = self.cfg, self.engine_cfg
    b = ec.slots
    return self._with_lag(np.zeros((b,), np.int32), DecodeState(
        kv=init_kv(cfg, cfg.n_layers, b, ec.cache_len, self.dtype),
        **mtp_fields(cfg, ec, b, self.dtype, np.zeros), pos=jnp.zeros((b,), jnp.int32),
        current=jnp.zeros((b,), jnp.int32),
        draft=jnp.zeros((b,), jnp.int32), h_prev=jnp.zeros((b, cfg.hidden), self.dtype),
        keys=jnp.zeros((b, 2), jnp.uint32), temperature=jnp.zeros((b,), jnp.float32),
        top_k=jnp.zeros((b,), jnp.int32), top_p=jnp.ones((b,), jnp.float32)))

  def _with_lag(self, lag: np.ndarray | None, state: DecodeState) -> DecodeState:
    """Remember `lag` (None: unknown) as the host's copy of `state.mtp_lag`."""
    if self.engine_cfg.native_mtp:
      self._lag_state = weakref.ref(state) if lag is not None else None
      self._lag = lag
    return state

  def _known_lag(self, state: DecodeState) -> np.ndarray | None:
    """The host's copy of `state.mtp_lag`, if `state` is the last state this engine returned."""
    if self._lag_state is not None and self._lag_state() is state:
      return self._lag
    return None

  # --- prefill ------------------------------------------------------------------------------

  def prefill(self, prompt: np.ndarray, sampler: SamplerParams, *,
              logprobs: bool = False) -> DecodeState:
    """Run a prompt; the bucket leaves one row for the first sampled token's MTP row.
    `logprobs`: keep the first token's in `last_logprobs` (needs engine logprobs > 0)."""
    tokens, length = self.engine_cfg.padded_prompt(prompt)
    keys, temperature, top_k, top_p = _sampler_arrays(sampler.validate())
    prefix, computed = self._prefill(self._leaves, tokens, np.int32(length), keys,
                                     temperature, top_k, top_p, np.bool_(logprobs))
    self._keep_logprobs(computed, logprobs)
    return prefix

  def _prefill_fn(self, leaves, tokens, length, keys, temperature, top_k, top_p,
                  want=False):
    model = self._model(leaves)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    kv = init_kv(self.cfg, self.cfg.n_layers, 1, self.engine_cfg.cache_len, self.dtype)
    hidden, kv = model.forward(tokens, positions, kv)
    logits = None
    if self.engine_cfg.logprobs:
      logits = model.lm_logits(jax.lax.dynamic_index_in_dim(hidden, length - 1, axis=1,
                                                           keepdims=False))
    prefix = prefill_commit(model, self.engine_cfg, tokens, hidden, length,
                            (keys, temperature, top_k, top_p), logits)
    return prefix.replace(kv=kv), self._logprobs(logits, prefix.current, want)

  def insert(self, prefix: DecodeState, state: DecodeState, slot: int) -> DecodeState:
    lag = self._known_lag(state)
    if lag is not None:
      lag = lag.copy()
      lag[slot] = 0          # a prefilled prompt's MTP KV is complete
    return self._with_lag(lag, self._insert(prefix, state, np.int32(slot)))

  @staticmethod
  def _insert_fn(prefix: DecodeState, state: DecodeState, slot) -> DecodeState:
    put = lambda dst, src: jax.lax.dynamic_update_index_in_dim(dst, src[0], slot, axis=0)
    return jax.tree.map(put, state, prefix)

  # --- steps --------------------------------------------------------------------------------

  def step(self, state: DecodeState, active: np.ndarray, drafting: np.ndarray | None = None,
           *, logprobs: bool = False) -> tuple[DecodeState, np.ndarray, dict]:
    """One decode step for every slot; returns the new state, ResultTokens and timings (us).

    With native MTP, `drafting` [B] says which slots use their draft this step (None: all).
    A slot that does not draft only commits the target's token, so its output is unchanged;
    when no active slot drafts, a plain step decodes one position without the MTP block, and
    the next drafting step first catches the MTP KV up (`catch_up`).
    """
    # Host arrays go to the compiled steps as they are: jit's own transfer is far cheaper than
    # a jnp.asarray per argument (a few hundred microseconds a step on a CPU host).
    active = np.asarray(active, bool)
    k = self.slots_for(active)          # the step runs over slots [0, k) only
    want = np.bool_(logprobs)           # `last_logprobs` of the committed tokens, if asked
    if not self.engine_cfg.native_mtp:
      state, result, computed = self._decode(self._leaves, state, active[:k], want)
      self._keep_logprobs(computed, logprobs)
      return state, self._all_slots(result), {}
    drafting = np.ones(active.shape, bool) if drafting is None else np.asarray(drafting, bool)
    if not (drafting[active].any() if active.any() else drafting.any()):
      lag = self._known_lag(state)
      state, result, computed = self._plain(self._leaves, state, active[:k], want)
      self._keep_logprobs(computed, logprobs)
      return (self._with_lag(None if lag is None else lag + active, state),
              self._all_slots(result), {})
    state = self.catch_up(state, active)
    lag = self._known_lag(state)       # a drafting step leaves the lag as it is
    if not self.engine_cfg.timing:
      state, result, computed = self._fused(self._leaves, state, active[:k], drafting[:k],
                                            want)
      self._keep_logprobs(computed, logprobs)
      return self._with_lag(lag, state), self._all_slots(result), {}
    start = time.perf_counter()
    state, verified, computed = self._verify(self._leaves, state, active[:k], want)
    jax.block_until_ready(verified)
    self._keep_logprobs(computed, logprobs)
    mid = time.perf_counter()
    state, result = self._draft(self._leaves, state, verified, active[:k], drafting[:k])
    result = self._all_slots(result)
    end = time.perf_counter()
    return self._with_lag(lag, state), result, {
        "verification_compute_us": int((mid - start) * 1e6),
        "proposal_compute_us": int((end - mid) * 1e6)}

  @property
  def computes_logprobs(self) -> bool:
    return self.engine_cfg.logprobs > 0

  def _logprobs(self, logits, tokens, want):
    """`token_logprobs` of the committed rows (logits [B, R, V] or [B, V], tokens [B, R] or
    [B]) as [B, R] arrays, or None when the engine computes no logprobs. Only a step some
    request wants them from pays for them (`want`, a traced bool: zeros otherwise); the
    log-softmax and top-n cost a fifth of a plain step of the demo model on a CPU."""
    if logits is None:
      return None
    if tokens.ndim == 1:
      logits, tokens = logits[:, None], tokens[:, None]
    n = self.engine_cfg.logprobs
    skipped = lambda: (jnp.zeros(tokens.shape, jnp.float32),
                       jnp.zeros(tokens.shape + (n,), jnp.int32),
                       jnp.zeros(tokens.shape + (n,), jnp.float32))
    return jax.lax.cond(want, lambda: token_logprobs(logits, tokens, n), skipped)

  def _keep_logprobs(self, computed, wanted: bool) -> None:
    self.last_logprobs = tuple(jax.device_get(computed)) if wanted and computed else None

  def slots_for(self, active: np.ndarray) -> int:
    """How many leading slots a step computes: the smallest bucket that holds every active
    slot. A step costs what its slots cost, live or not (one stream on a 4-slot CPU engine
    took 2.1-3.5 ms a step instead of 0.8), and the scheduler fills the lowest slots first."""
    live = np.flatnonzero(active)
    need = int(live[-1]) + 1 if live.size else 1
    return next(k for k in self.slot_buckets if k >= need)

  def _all_slots(self, result) -> np.ndarray:
    """ResultTokens [B, 4] from a step over the first k slots (zeros past them)."""
    result = np.asarray(result)
    if result.shape[0] == self.engine_cfg.slots:
      return result
    full = np.zeros((self.engine_cfg.slots, result.shape[1]), result.dtype)
    full[:result.shape[0]] = result
    return full

  def catch_up(self, state: DecodeState, active) -> DecodeState:
    """Bring every active slot's MTP KV (and draft) up to its position after paused steps."""
    lag = self._known_lag(state)
    if lag is not None and not lag.any():
      return state          # the common case while drafting: no host work beyond this check
    live = np.asarray(active, bool)
    if lag is None:
      lag = np.asarray(state.mtp_lag)
    passes, caught_up = catch_up_passes(lag, live)
    k = self.slots_for(live)
    for _ in range(passes):
      state = self._catch_up(self._leaves, state, live[:k])
    return self._with_lag(caught_up, state)

  # Each step function runs over the first active.shape[0] slots (`first_slots`): the caches
  # stay whole and the model writes and reads only those slots' rows.

  def _decode_fn(self, leaves, state: DecodeState, active, want=False):
    model = self._model(leaves)
    part = first_slots(state, active.shape[0])
    hidden, kv = model.forward(
        *step_inputs(part.current, part.draft, part.pos, native_mtp=False), state.kv)
    logits = model.lm_logits(hidden[:, 0]) if self.engine_cfg.logprobs else None
    part, result = decode_commit(model, part, hidden, active, logits)
    return (with_slots(state, part.replace(kv=kv)), result,
            self._logprobs(logits, result[:, TOKEN_A], want))

  def _verify_fn(self, leaves, state: DecodeState, active, want=False):
    """Target pass over [current, draft]; returns the sampled tokens and hiddens."""
    model = self._model(leaves)
    part = first_slots(state, active.shape[0])
    hidden, kv = model.forward(
        *step_inputs(part.current, part.draft, part.pos, native_mtp=True), state.kv)
    logits = model.lm_logits(hidden) if self.engine_cfg.logprobs else None
    verified = verify_tokens(model, part, hidden, logits)
    return (state.replace(kv=kv), verified,
            self._logprobs(logits, jnp.stack(verified[:2], axis=1), want))

  def _draft_fn(self, leaves, state: DecodeState, verified, active, drafting):
    part = first_slots(state, active.shape[0])
    part, result = draft_commit(self._model(leaves), part, verified, active, drafting)
    return with_slots(state, part), result

  def _fused_fn(self, leaves, state: DecodeState, active, drafting, want=False):
    state, verified, logprobs = self._verify_fn(leaves, state, active, want)
    return (*self._draft_fn(leaves, state, verified, active, drafting), logprobs)

  def _plain_fn(self, leaves, state: DecodeState, active, want=False):
    """A step without drafting: decode one position, record the row's MTP inputs."""
    model = self._model(leaves)
    part = first_slots(state, active.shape[0])
    hidden, kv = model.forward(
        *step_inputs(part.current, part.draft, part.pos, native_mtp=False), state.kv)
    logits = model.lm_logits(hidden[:, 0]) if self.engine_cfg.logprobs else None
    part, result = plain_commit(model, part.replace(kv=kv), hidden, active, logits)
    return with_slots(state, part), result, self._logprobs(logits, result[:, TOKEN_A], want)

  def _catch_up_fn(self, leaves, state: DecodeState, active):
    part = first_slots(state, active.shape[0])
    return with_slots(state, catch_up_commit(self._model(leaves), part, active))


# --- head-side step logic ---------------------------------------------------------------------
# Everything after the trunk's final norm, written against the model that owns the output head
# (and the MTP head): the whole model here, the last stage in a pipeline (engine/pipeline.py).
# Both engines therefore share one sampling, accept and commit rule. The returned states keep
# whatever `kv` they were given; the caller owns the trunk caches.

# The per-slot fields of a DecodeState; the others (caches, MTP history) stay whole in a step
# over the first slots, and the model writes and reads only those slots' rows in them.
_SLOT_FIELDS = ("pos", "current", "draft", "h_prev", "keys", "temperature", "top_k", "top_p",
                "mtp_lag")


def first_slots(state: DecodeState, k: int) -> DecodeState:
  """`state` with its per-slot fields cut to the first k slots."""
  if k == state.pos.shape[0]:
    return state
  return state.replace(**{name: getattr(state, name)[:k] for name in _SLOT_FIELDS
                          if getattr(state, name) is not None})


def with_slots(state: DecodeState, part: DecodeState) -> DecodeState:
  """`state` updated by `part`, a step's result over its first slots (`first_slots`)."""
  k = part.pos.shape[0]
  if k == state.pos.shape[0]:
    return part
  return part.replace(**{name: getattr(state, name).at[:k].set(getattr(part, name))
                         for name in _SLOT_FIELDS if getattr(state, name) is not None})


def step_inputs(current, draft, pos, *, native_mtp: bool) -> tuple[jax.Array, jax.Array]:
  """Tokens [B, T] and positions [B, T] of one step: [current] or, verifying, [current, draft]."""
  if not native_mtp:
    return current[:, None], pos[:, None]
  tokens = jnp.stack([current, draft], axis=1)
  return tokens, pos[:, None] + jnp.arange(2, dtype=jnp.int32)[None]


def mtp_fields(cfg: ModelConfig, engine_cfg: EngineConfig, batch: int, dtype, zeros) -> dict:
  """The DecodeState fields native MTP adds, empty (`zeros`: np.zeros or jnp.zeros)."""
  if not engine_cfg.native_mtp:
    return dict(mtp_kv=None, history_tokens=None, history_hidden=None, mtp_lag=None)
  rows = engine_cfg.mtp_cache_len
  (k, v), = kv_cache_shapes(cfg, 1, batch, rows)
  return dict(mtp_kv=(zeros(k, dtype), zeros(v, dtype)),
              history_tokens=zeros((batch, rows), np.int32),
              history_hidden=zeros((batch, rows, cfg.hidden), dtype),
              mtp_lag=zeros((batch,), np.int32))


def prefill_commit(model, engine_cfg: EngineConfig, tokens, hidden, length,
                   sampler: tuple, logits=None) -> DecodeState:
  """Sample the first token from the prompt's last hidden and, with MTP, draft the next one.

  `hidden` [1, bucket, D] is the post-norm trunk output; the result has `kv=[]`. `logits`:
  the head's output for the last row, when the caller already has it (the commit functions
  take it so that logprobs cost no second head pass).
  """
  keys, temperature, top_k, top_p = sampler
  positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  last = jax.lax.dynamic_index_in_dim(hidden, length - 1, axis=1, keepdims=False)  # [1, D]
  logits = model.lm_logits(last) if logits is None else logits
  first = sample(logits, keys, length[None], temperature, top_k, top_p)
  fields = mtp_fields(model.cfg, engine_cfg, 1, model.dtype, jnp.zeros)
  draft = jnp.zeros((1,), jnp.int32)
  if engine_cfg.native_mtp:
    mtp_tokens = jax.lax.dynamic_update_index_in_dim(tokens, first, length, axis=1)
    prev = previous_hidden(hidden)
    z, mtp_kv = model.mtp_hidden(mtp_tokens, prev, positions, fields["mtp_kv"])
    z_last = jax.lax.dynamic_index_in_dim(z, length, axis=1, keepdims=False)
    draft = greedy_tokens(model.mtp_logits(z_last))
    fields["mtp_kv"] = mtp_kv
  return DecodeState(kv=[], **fields, pos=length[None], current=first, draft=draft,
                     h_prev=last, keys=keys, temperature=temperature, top_k=top_k, top_p=top_p)


def decode_commit(model, state: DecodeState, hidden, active,
                  logits=None) -> tuple[DecodeState, jax.Array]:
  """Plain decoding: sample one token per slot from `hidden` [B, 1, D] and commit it."""
  logits = model.lm_logits(hidden[:, 0]) if logits is None else logits
  token = sample(logits, state.keys, state.pos + 1, state.temperature,
                 state.top_k, state.top_p)
  zeros = jnp.zeros_like(token)
  result = jnp.stack([token, zeros, jnp.ones_like(token), zeros], axis=1)
  state = state.replace(
      pos=jnp.where(active, state.pos + 1, state.pos),
      current=jnp.where(active, token, state.current), h_prev=hidden[:, 0])
  return state, result


def verify_tokens(model, state: DecodeState, hidden,
                  logits=None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sample the target's tokens at both verify positions; (token_a, token_b, hidden)."""
  logits = model.lm_logits(hidden) if logits is None else logits         # [B, 2, V]
  batch, rows, vocab = logits.shape
  # Both positions in one `sample` call: one greedy-or-sampled branch per step (a GPU reads a
  # conditional's predicate back on the host).
  per_row = lambda a: jnp.repeat(a, rows, axis=0)
  positions = state.pos[:, None] + jnp.arange(1, rows + 1, dtype=jnp.int32)[None]
  tokens = sample(logits.reshape(batch * rows, vocab), per_row(state.keys),
                  positions.reshape(-1), per_row(state.temperature), per_row(state.top_k),
                  per_row(state.top_p)).reshape(batch, rows)
  return tokens[:, 0], tokens[:, 1], hidden


def draft_commit(model, state: DecodeState, verified, active,
                 drafting=None) -> tuple[DecodeState, jax.Array]:
  """MTP pass over the two new rows, then commit one or two tokens per slot.

  A slot outside `drafting` never accepts: it commits only the target's own token.
  Every active slot must be caught up (`mtp_lag` 0), see `Engine.catch_up`.
  """
  token_a, token_b, hidden = verified
  accept = token_a == state.draft
  if drafting is not None:
    accept = accept & drafting
  rows = jnp.stack([token_a, token_b], axis=1)
  positions = state.pos[:, None] + jnp.arange(1, 3, dtype=jnp.int32)[None]
  z, mtp_kv = model.mtp_hidden(rows, hidden, positions, state.mtp_kv)
  # Only the row of the new `current` drafts; the head (the draft's largest cost) runs once.
  z_next = jnp.where(accept[:, None], z[:, 1], z[:, 0])
  draft = greedy_tokens(model.mtp_logits(z_next))                          # [B]
  step = jnp.where(accept, 2, 1)
  result = jnp.stack([token_a, token_b, step, accept.astype(jnp.int32)], axis=1)
  keep = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
  state = state.replace(
      mtp_kv=mtp_kv,
      pos=keep(state.pos + step, state.pos),
      current=keep(jnp.where(accept, token_b, token_a), state.current),
      draft=keep(draft, state.draft),
      h_prev=keep(jnp.where(accept[:, None], hidden[:, 1], hidden[:, 0]), state.h_prev))
  return state, result


def plain_commit(model, state: DecodeState, hidden, active,
                 logits=None) -> tuple[DecodeState, jax.Array]:
  """Commit one sampled token per slot without the MTP block: the new row's MTP inputs
  (token, h_pos) go to the history and the slot's MTP KV falls one more row behind.
  The draft is left as it was (a stale draft is only ever rejected).

  Only these steps write the history: the rows a catch-up reads are exactly the rows committed
  by plain steps since the slot was last caught up.
  """
  committed, result = decode_commit(model, state, hidden, active, logits)
  start = state.pos + 1
  return committed.replace(
      history_tokens=write_rows(state.history_tokens, committed.current[:, None], start),
      history_hidden=write_rows(state.history_hidden, hidden, start),
      mtp_lag=jnp.where(active, state.mtp_lag + 1, state.mtp_lag)), result


def catch_up_passes(lag: np.ndarray, live: np.ndarray) -> tuple[int, np.ndarray]:
  """(catch-up passes that bring every live slot's MTP KV up to date, the lag after them):
  the host's side of `catch_up_commit`, so no engine reads the lag back from the device."""
  passes = -(-int(lag[live].max()) // CATCH_UP_ROWS) if live.any() else 0
  return passes, np.where(live, np.maximum(lag - passes * CATCH_UP_ROWS, 0), lag).astype(np.int32)


def catch_up_commit(model, state: DecodeState, active) -> DecodeState:
  """Run the MTP block over the next CATCH_UP_ROWS missing rows of each lagging slot.

  Rows past `pos` in the window are written from stale history; like every row past the
  committed length they are rewritten before they are read. The slot whose window reaches
  `pos` drafts afresh from its last row.
  """
  start = state.pos + 1 - state.mtp_lag                                    # first missing row
  window = lambda a, s: jax.lax.dynamic_slice_in_dim(a, s, CATCH_UP_ROWS, axis=0)
  k = start.shape[0]
  tokens = jax.vmap(window)(live_slots(state.history_tokens, k), start)
  hidden = jax.vmap(window)(live_slots(state.history_hidden, k), start)
  positions = start[:, None] + jnp.arange(CATCH_UP_ROWS, dtype=jnp.int32)[None]
  z, mtp_kv = model.mtp_hidden(tokens, hidden, positions, state.mtp_kv)
  last = jnp.clip(state.pos - start, 0, CATCH_UP_ROWS - 1)
  z_last = jnp.take_along_axis(z, last[:, None, None], axis=1)[:, 0]
  lagging = active & (state.mtp_lag > 0)
  done = lagging & (state.mtp_lag <= CATCH_UP_ROWS)
  return state.replace(
      mtp_kv=mtp_kv,
      mtp_lag=jnp.where(lagging, jnp.maximum(state.mtp_lag - CATCH_UP_ROWS, 0), state.mtp_lag),
      draft=jnp.where(done, greedy_tokens(model.mtp_logits(z_last)), state.draft))


def warm_up(engine) -> None:
  """Compile every prefill bucket and every step variant of an engine (single or pipelined)
  now, not under the first requests. Runs on a throwaway state with every slot inactive."""
  ec = engine.engine_cfg
  state = engine.init_state()
  for bucket in ec.prefill_buckets:
    if bucket - 1 < ec.max_len and bucket <= ec.cache_len:
      state = engine.insert(engine.prefill(np.zeros(bucket - 1, np.int32), SamplerParams()),
                            state, 0)
  # One live slot at k - 1 makes a step over the first k slots (`Engine.slot_buckets`).
  for k in getattr(engine, "slot_buckets", (ec.slots,)):
    reach = np.arange(ec.slots) == k - 1
    if not ec.native_mtp:
      state, _, _ = engine.step(state, reach)
      continue
    for drafting in (np.ones(ec.slots, bool), np.zeros(ec.slots, bool)):
      state, _, _ = engine.step(state, reach, drafting)
    state = engine.catch_up(state, reach)   # the missing MTP rows, before drafting again
