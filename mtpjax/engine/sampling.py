"""Sampling inside jit, with per-slot parameters as arrays and position-keyed randomness.

The key for the token at absolute position p is `fold_in(request_key, p)`, whatever the
schedule: MTP on and MTP off therefore draw the same sample from the same logits, which is what
makes speculative decoding reproducible as well as lossless (DECODE.md §2, §4).
Greedy is temperature 0, chosen with `jnp.where`, so greedy and sampled requests share one
compiled step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax import errors

# top_k lives in an int32 array inside the compiled step.
MAX_TOP_K = 2**31 - 1
# The most alternatives per token an engine computes (OpenAI's limit for top_logprobs).
MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplerParams:
  """One request's sampler; validated on the host before it reaches a compiled step."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0

  def validate(self) -> "SamplerParams":
    if not np.isfinite(self.temperature) or self.temperature < 0:
      raise errors.MtpjaxError(f"temperature must be >= 0, got {self.temperature}",
                               field="temperature", remedy="use 0 for greedy decoding")
    if not 0 <= self.top_k <= MAX_TOP_K:
      raise errors.MtpjaxError(f"top_k must be in [0, {MAX_TOP_K}], got {self.top_k}",
                               field="top_k", remedy="use 0 to disable top-k")
    if not (0.0 < self.top_p <= 1.0):
      raise errors.MtpjaxError(f"top_p must be in (0, 1], got {self.top_p}", field="top_p",
                               remedy="use 1.0 to disable nucleus sampling")
    return self


def request_key(seed: int) -> np.ndarray:
  """The raw uint32[2] key a request's samples derive from."""
  return np.asarray(jax.random.key_data(jax.random.key(int(seed) & 0xFFFFFFFF)))


def _filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Mask logits outside the top-k set and outside the smallest nucleus of mass >= top_p."""
  vocab = logits.shape[-1]
  sorted_desc = jnp.sort(logits)[::-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth = sorted_desc[k - 1]
  logits = jnp.where(logits >= kth, logits, -jnp.inf)
  sorted_desc = jnp.where(jnp.arange(vocab) < k, sorted_desc, -jnp.inf)
  probs = jax.nn.softmax(sorted_desc)
  mass_before = jnp.cumsum(probs) - probs
  kept = mass_before < top_p
  cutoff = jnp.min(jnp.where(kept, sorted_desc, jnp.inf))
  # top_p = 1 keeps everything: a float32 running sum may reach 1 before the tail.
  cutoff = jnp.where(top_p >= 1.0, -jnp.inf, cutoff)
  return jnp.where(logits >= cutoff, logits, -jnp.inf)


def greedy_tokens(logits: jax.Array) -> jax.Array:
  """`argmax` over the last axis (the first maximal index), as int32.

  A max, a compare and a min-reduce: XLA:CPU runs `jnp.argmax`'s variadic (value, index)
  reduction about 3x slower over a vocabulary row, and this runs at every step and draft.
  A row with a NaN yields token 0.
  """
  vocab = logits.shape[-1]
  top = jnp.max(logits, axis=-1, keepdims=True)
  index = jnp.arange(vocab, dtype=jnp.int32)
  first = jnp.min(jnp.where(logits == top, index, vocab), axis=-1)
  return jnp.where(first < vocab, first, 0).astype(jnp.int32)


def sample(logits: jax.Array, keys: jax.Array, positions: jax.Array, temperature: jax.Array,
           top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Tokens [B] for logits [B, V] at absolute `positions` [B], one sampler per row.

  A batch of greedy rows skips the sort that top-k/top-p filtering needs.
  """
  def one(row, key_data, position, temp, k, p):
    greedy = greedy_tokens(row)
    key = jax.random.fold_in(jax.random.wrap_key_data(key_data), position)
    scaled = _filter_logits(row.astype(jnp.float32) / jnp.maximum(temp, 1e-6), k, p)
    drawn = jax.random.categorical(key, scaled).astype(jnp.int32)
    return jnp.where(temp > 0, drawn, greedy)
  sampled = lambda: jax.vmap(one)(logits, keys, positions, temperature, top_k, top_p)
  greedy = lambda: greedy_tokens(logits)
  return jax.lax.cond(jnp.any(temperature > 0), sampled, greedy)


def token_logprobs(logits: jax.Array, tokens: jax.Array, top_n: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(logprob of each token, top-n ids, top-n logprobs) for logits [..., V], tokens [...].

  The raw model distribution, log_softmax(logits) in float32, whatever the request's
  temperature, top-k or top-p (what OpenAI and vLLM report by default): a committed position's
  logits are the target's own with MTP on or off, so its logprobs are too.
  """
  logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(logprobs, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  top_lp, top_ids = jax.lax.top_k(logprobs, top_n)
  return chosen, top_ids.astype(jnp.int32), top_lp
