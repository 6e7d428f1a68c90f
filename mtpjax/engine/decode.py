"""Jitted prefill, insert and decode/verify steps over a fixed set of slots (DECODE.md §1-§3).

The contract follows JetStream: `prefill` -> `insert(prefix, state, slot)` -> `step(state)`.
Everything that varies per request (positions, sampler settings, drafts, keys) is an array, so
each prefill bucket compiles once and the step compiles once. The state is donated, so caches
are updated in place.

With native MTP the step verifies `[current, draft]` in one target pass, samples both
positions with position-keyed keys, accepts the draft iff the target's own token equals it,
and drafts the next token from the MTP head over the two new rows. Rows past the committed
length are never read before they are rewritten, so a rejection needs no rollback.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtpjax import errors
from mtpjax.engine.sampling import SamplerParams, greedy_tokens, request_key, sample
from mtpjax.models.config import ModelConfig
from mtpjax.models.glm4_moe import init_kv, previous_hidden

# ResultTokens columns: one int32 [B, 4] array per step means one device->host copy.
TOKEN_A, TOKEN_B, COUNT, ACCEPTED = range(4)


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

  @property
  def cache_len(self) -> int:
    """Two spare rows hold the verify and draft rows of the last step."""
    return self.max_len + 2

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
  pos: jax.Array          # [B] position of `current`
  current: jax.Array      # [B] sampled token not yet in the target KV
  draft: jax.Array        # [B] MTP draft for position pos + 1
  h_prev: jax.Array       # [B, D] post-norm target hidden at pos - 1
  keys: jax.Array         # [B, 2] raw request keys
  temperature: jax.Array  # [B]
  top_k: jax.Array        # [B]
  top_p: jax.Array        # [B]


def _sampler_arrays(sampler: SamplerParams):
  return (jnp.asarray([request_key(sampler.seed)], jnp.uint32),
          jnp.asarray([sampler.temperature], jnp.float32),
          jnp.asarray([sampler.top_k], jnp.int32),
          jnp.asarray([sampler.top_p], jnp.float32))


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
    self._prefill = jax.jit(self._counted("prefill", self._prefill_fn))
    self._insert = jax.jit(self._counted("insert", self._insert_fn), donate_argnames=("state",))
    if engine_cfg.native_mtp:
      self._verify = jax.jit(self._counted("verify", self._verify_fn), donate_argnames=("state",))
      self._draft = jax.jit(self._counted("draft", self._draft_fn), donate_argnames=("state",))
      self._fused = jax.jit(self._counted("verify_draft", self._fused_fn),
                            donate_argnames=("state",))
      self._maintain = jax.jit(self._counted("maintain", self._maintain_fn),
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
    mtp_kv = (init_kv(cfg, 1, b, ec.cache_len, self.dtype)[0] if ec.native_mtp else None)
    return DecodeState(
        kv=init_kv(cfg, cfg.n_layers, b, ec.cache_len, self.dtype), mtp_kv=mtp_kv,
        pos=jnp.zeros((b,), jnp.int32), current=jnp.zeros((b,), jnp.int32),
        draft=jnp.zeros((b,), jnp.int32), h_prev=jnp.zeros((b, cfg.hidden), self.dtype),
        keys=jnp.zeros((b, 2), jnp.uint32), temperature=jnp.zeros((b,), jnp.float32),
        top_k=jnp.zeros((b,), jnp.int32), top_p=jnp.ones((b,), jnp.float32))

  # --- prefill ------------------------------------------------------------------------------

  def prefill(self, prompt: np.ndarray, sampler: SamplerParams) -> DecodeState:
    """Run a prompt; the bucket leaves one row for the first sampled token's MTP row."""
    tokens, length = self.engine_cfg.padded_prompt(prompt)
    keys, temperature, top_k, top_p = _sampler_arrays(sampler.validate())
    return self._prefill(self._leaves, jnp.asarray(tokens), jnp.int32(length), keys,
                         temperature, top_k, top_p)

  def _prefill_fn(self, leaves, tokens, length, keys, temperature, top_k, top_p) -> DecodeState:
    model = self._model(leaves)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    kv = init_kv(self.cfg, self.cfg.n_layers, 1, self.engine_cfg.cache_len, self.dtype)
    hidden, kv = model.forward(tokens, positions, kv)
    prefix = prefill_commit(model, self.engine_cfg, tokens, hidden, length,
                            (keys, temperature, top_k, top_p))
    return prefix.replace(kv=kv)

  def insert(self, prefix: DecodeState, state: DecodeState, slot: int) -> DecodeState:
    return self._insert(prefix, state, jnp.int32(slot))

  @staticmethod
  def _insert_fn(prefix: DecodeState, state: DecodeState, slot) -> DecodeState:
    put = lambda dst, src: jax.lax.dynamic_update_index_in_dim(dst, src[0], slot, axis=0)
    return jax.tree.map(put, state, prefix)

  # --- steps --------------------------------------------------------------------------------

  def step(self, state: DecodeState, active: np.ndarray, drafting: np.ndarray | None = None
           ) -> tuple[DecodeState, np.ndarray, dict]:
    """One decode step for every slot; returns the new state, ResultTokens and timings (us).

    With native MTP, `drafting` [B] says which slots use their draft this step (None: all).
    A slot that does not draft only commits the target's token, so its output is unchanged;
    when no active slot drafts, a cheaper step decodes one position and only keeps the MTP
    KV cache in step (no second position, no MTP head).
    """
    active = jnp.asarray(active, bool)
    if not self.engine_cfg.native_mtp:
      state, result = self._decode(self._leaves, state, active)
      return state, np.asarray(result), {}
    drafting = np.ones(active.shape, bool) if drafting is None else np.asarray(drafting, bool)
    live = np.asarray(active)
    if not (drafting[live].any() if live.any() else drafting.any()):
      state, result = self._maintain(self._leaves, state, active)
      return state, np.asarray(result), {}
    drafting = jnp.asarray(drafting)
    if not self.engine_cfg.timing:
      state, result = self._fused(self._leaves, state, active, drafting)
      return state, np.asarray(result), {}
    start = time.perf_counter()
    state, verified = self._verify(self._leaves, state, active)
    jax.block_until_ready(verified)
    mid = time.perf_counter()
    state, result = self._draft(self._leaves, state, verified, active, drafting)
    result = np.asarray(result)
    end = time.perf_counter()
    return state, result, {"verification_compute_us": int((mid - start) * 1e6),
                           "proposal_compute_us": int((end - mid) * 1e6)}

  def _decode_fn(self, leaves, state: DecodeState, active):
    model = self._model(leaves)
    hidden, kv = model.forward(
        *step_inputs(state.current, state.draft, state.pos, native_mtp=False), state.kv)
    state, result = decode_commit(model, state, hidden, active)
    return state.replace(kv=kv), result

  def _verify_fn(self, leaves, state: DecodeState, active):
    """Target pass over [current, draft]; returns the sampled tokens and hiddens."""
    model = self._model(leaves)
    hidden, kv = model.forward(
        *step_inputs(state.current, state.draft, state.pos, native_mtp=True), state.kv)
    return state.replace(kv=kv), verify_tokens(model, state, hidden)

  def _draft_fn(self, leaves, state: DecodeState, verified, active, drafting):
    return draft_commit(self._model(leaves), state, verified, active, drafting)

  def _fused_fn(self, leaves, state: DecodeState, active, drafting):
    state, verified = self._verify_fn(leaves, state, active)
    return self._draft_fn(leaves, state, verified, active, drafting)

  def _maintain_fn(self, leaves, state: DecodeState, active):
    """Plain decode that still writes the committed token's MTP KV row (no MTP head)."""
    model = self._model(leaves)
    hidden, kv = model.forward(
        *step_inputs(state.current, state.draft, state.pos, native_mtp=False), state.kv)
    return mtp_maintain_commit(model, state.replace(kv=kv), hidden, active)


# --- head-side step logic ---------------------------------------------------------------------
# Everything after the trunk's final norm, written against the model that owns the output head
# (and the MTP head): the whole model here, the last stage in a pipeline (engine/pipeline.py).
# Both engines therefore share one sampling, accept and commit rule. The returned states keep
# whatever `kv` they were given; the caller owns the trunk caches.

def step_inputs(current, draft, pos, *, native_mtp: bool) -> tuple[jax.Array, jax.Array]:
  """Tokens [B, T] and positions [B, T] of one step: [current] or, verifying, [current, draft]."""
  if not native_mtp:
    return current[:, None], pos[:, None]
  tokens = jnp.stack([current, draft], axis=1)
  return tokens, pos[:, None] + jnp.arange(2, dtype=jnp.int32)[None]


def prefill_commit(model, engine_cfg: EngineConfig, tokens, hidden, length,
                   sampler: tuple) -> DecodeState:
  """Sample the first token from the prompt's last hidden and, with MTP, draft the next one.

  `hidden` [1, bucket, D] is the post-norm trunk output; the result has `kv=[]`.
  """
  keys, temperature, top_k, top_p = sampler
  positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  last = jax.lax.dynamic_index_in_dim(hidden, length - 1, axis=1, keepdims=False)  # [1, D]
  first = sample(model.lm_logits(last), keys, length[None], temperature, top_k, top_p)
  mtp_kv, draft = None, jnp.zeros((1,), jnp.int32)
  if engine_cfg.native_mtp:
    mtp_tokens = jax.lax.dynamic_update_index_in_dim(tokens, first, length, axis=1)
    prev = previous_hidden(hidden)
    mtp_kv = init_kv(model.cfg, 1, 1, engine_cfg.cache_len, model.dtype)[0]
    z, mtp_kv = model.mtp_hidden(mtp_tokens, prev, positions, mtp_kv)
    z_last = jax.lax.dynamic_index_in_dim(z, length, axis=1, keepdims=False)
    draft = greedy_tokens(model.mtp_logits(z_last))
  return DecodeState(kv=[], mtp_kv=mtp_kv, pos=length[None], current=first, draft=draft,
                     h_prev=last, keys=keys, temperature=temperature, top_k=top_k, top_p=top_p)


def decode_commit(model, state: DecodeState, hidden, active) -> tuple[DecodeState, jax.Array]:
  """Plain decoding: sample one token per slot from `hidden` [B, 1, D] and commit it."""
  token = sample(model.lm_logits(hidden[:, 0]), state.keys, state.pos + 1, state.temperature,
                 state.top_k, state.top_p)
  zeros = jnp.zeros_like(token)
  result = jnp.stack([token, zeros, jnp.ones_like(token), zeros], axis=1)
  state = state.replace(
      pos=jnp.where(active, state.pos + 1, state.pos),
      current=jnp.where(active, token, state.current), h_prev=hidden[:, 0])
  return state, result


def verify_tokens(model, state: DecodeState, hidden) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sample the target's tokens at both verify positions; (token_a, token_b, hidden)."""
  logits = model.lm_logits(hidden)                                       # [B, 2, V]
  sampler = (state.temperature, state.top_k, state.top_p)
  token_a = sample(logits[:, 0], state.keys, state.pos + 1, *sampler)
  token_b = sample(logits[:, 1], state.keys, state.pos + 2, *sampler)
  return token_a, token_b, hidden


def draft_commit(model, state: DecodeState, verified, active,
                 drafting=None) -> tuple[DecodeState, jax.Array]:
  """MTP pass over the two new rows, then commit one or two tokens per slot.

  A slot outside `drafting` never accepts: it commits only the target's own token.
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


def mtp_maintain_commit(model, state: DecodeState, hidden,
                        active) -> tuple[DecodeState, jax.Array]:
  """Commit one sampled token per slot and write its MTP KV row (t, h_pos) at pos + 1.

  The MTP KV must hold a row for every committed position, so drafting can resume at any
  step; the draft itself is left as it was (a stale draft is only ever rejected).
  """
  committed, result = decode_commit(model, state, hidden, active)
  _, mtp_kv = model.mtp_hidden(committed.current[:, None], hidden, state.pos[:, None] + 1,
                               state.mtp_kv)
  return committed.replace(mtp_kv=mtp_kv), result


def warm_up(engine) -> None:
  """Compile every prefill bucket and every step variant of an engine (single or pipelined)
  now, not under the first requests. Runs on a throwaway state with every slot inactive."""
  ec = engine.engine_cfg
  state = engine.init_state()
  for bucket in ec.prefill_buckets:
    if bucket - 1 < ec.max_len and bucket <= ec.cache_len:
      state = engine.insert(engine.prefill(np.zeros(bucket - 1, np.int32), SamplerParams()),
                            state, 0)
  inactive = np.zeros(ec.slots, bool)
  if not ec.native_mtp:
    engine.step(state, inactive)
    return
  for drafting in (np.ones(ec.slots, bool), np.zeros(ec.slots, bool)):
    state, _, _ = engine.step(state, inactive, drafting)
