"""Sampling inside jit, with per-slot parameters as arrays and position-keyed randomness.

The key for the token at absolute position p is `fold_in(request_key, p)`, whatever the
schedule: MTP on and MTP off therefore draw the same sample from the same logits, which is what
makes speculative decoding reproducible as well as lossless (docs/DECODE.md §2, §4).
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
DEFAULT_MAX_NEW_TOKENS = 128    # tokens a request that names no limit may generate (the server's)


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


# Rows whose top-k / top-p rules are decided among their largest logits only (`jax.lax.top_k`):
# a row whose top-k set or nucleus ends within these never reads the rest of the vocabulary
# sorted. Sorting a 155K-token row cost ~60 ms on a 2-core CPU, more than a Flash-shaped
# decode step.
CANDIDATES = 256
# A draw picks a block of this many tokens, then a token in it (`_draw`).
DRAW_BLOCK = 1024


def _ordered_bits(x: jax.Array) -> jax.Array:
  """float32 -> uint32 with the same order (a float's sign bit flips the rest)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_ordered_bits(u: jax.Array) -> jax.Array:
  bits = jnp.where(u >> 31 == 1, u & jnp.uint32(0x7FFFFFFF), ~u)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_reaching(rows: jax.Array, weights: jax.Array, need: jax.Array) -> jax.Array:
  """Per row, the largest value c of `rows` [B, V] with sum(weights[rows >= c]) >= need [B],
  built bit by bit over the values' ordered bits (32 masked sums; no sort). With unit
  weights and need k it is the k-th largest value; with probabilities and need top_p, the
  smallest value of the nucleus. Where no value reaches `need`: the row's smallest value."""
  ordered = _ordered_bits(rows)

  def next_bit(i, found):
    trial = found | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
    reach = jnp.sum(jnp.where(ordered >= trial[:, None], weights, 0), axis=-1)
    return jnp.where(reach >= need, trial, found)
  found = jax.lax.fori_loop(0, 32, next_bit, jnp.zeros(rows.shape[:1], jnp.uint32))
  return jnp.where(found > 0, _from_ordered_bits(found), jnp.min(rows, axis=-1))


def _kept_weights(rows, top, kth):
  """exp(row - max) of the values the top-k rule keeps (>= kth), 0 elsewhere."""
  return jnp.where(rows >= kth[:, None], jnp.exp(rows - top[:, None]), 0.0)


def _thresholds(rows: jax.Array, top_k: jax.Array, top_p: jax.Array, candidates: int
                ) -> jax.Array:
  """The smallest value each row keeps [B]: top-k (ties at the k-th value kept), then the
  smallest nucleus of mass >= top_p among them (in descending order; ties at its last value
  kept).

  Decided among the `candidates` largest values, as the full sort would, where the top-k set
  or the nucleus ends within them; the other rows (a top_k above `candidates`, a nucleus
  wider than them) search the whole row (`_largest_reaching`), only when some row needs it.
  Which way a row goes depends on that row alone, so a token never depends on its batch.
  """
  vocab = rows.shape[-1]
  width = min(candidates, vocab)
  # The barrier keeps XLA's TopK: where the values have several users XLA:CPU rewrites it to
  # a sort of the whole row and slices (100x slower over a 155K vocabulary).
  values = jax.lax.optimization_barrier(jax.lax.top_k(rows, width)[0])   # [B, width]
  top = values[:, 0]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth_known = (k <= width) | (k >= vocab)
  kth = jnp.where(k >= vocab, -jnp.inf,
                  jnp.take_along_axis(values, jnp.clip(k - 1, 0, width - 1)[:, None], 1)[:, 0])
  total = jnp.sum(_kept_weights(rows, top, kth), axis=-1)
  probs = _kept_weights(values, top, kth) / total[:, None]
  before = jnp.cumsum(probs, axis=-1) - probs
  # The top value always: XLA:CPU flushes a subnormal top_p to 0, which would keep nothing.
  kept = ((before < top_p[:, None]) | (jnp.arange(width) == 0)) & (values >= kth[:, None])
  nucleus = top_p < 1.0
  cutoff = jnp.where(nucleus, jnp.min(jnp.where(kept, values, jnp.inf), axis=-1), -jnp.inf)
  fast = jnp.maximum(kth, cutoff)
  closed = (width == vocab) | ~kept[:, -1]
  search = ~kth_known | (nucleus & ~closed)

  def searched(row, top_r, k_r, kth_r, top_p_r):
    row = row[None]
    kth_r = jax.lax.cond((k_r <= width) | (k_r >= vocab), lambda: kth_r[None],
                         lambda: _largest_reaching(row, jnp.ones(row.shape, jnp.int32), k_r[None]))
    weights = _kept_weights(row, top_r[None], kth_r)
    cut = jax.lax.cond(top_p_r < 1.0, lambda: _largest_reaching(
        row, weights, top_p_r * jnp.sum(weights, axis=-1)), lambda: jnp.full((1,), -jnp.inf))
    return jnp.maximum(kth_r, cut)[0]

  def per_row(args):   # a loop, not a batch: only the rows that need a search pay for it
    needs_search, fast_r, *row = args
    return jax.lax.cond(needs_search, lambda: searched(*row), lambda: fast_r)
  return jax.lax.cond(jnp.any(search), lambda: jax.lax.map(
      per_row, (search, fast, rows, top, k, kth, top_p)), lambda: fast)


def _draw(rows: jax.Array, threshold: jax.Array, keys: jax.Array) -> jax.Array:
  """Per row, a token of softmax(row) restricted to the values >= threshold, by Gumbel-max in
  two levels: a block of `DRAW_BLOCK` tokens (its log-sum-exp plus one Gumbel), then a token
  of that block (its value plus one Gumbel), each keyed by the row's `keys` [B] (request and
  position). Exact, as one Gumbel per token is, and as steady: logits that move by e (a
  verify row's may differ from a decode row's in the last bits) move a token with a
  probability of order e, where an inverse CDF would sum the moves of every token before it.
  It draws ~1,200 Gumbels, not a vocabulary's."""
  batch, vocab = rows.shape
  block = min(DRAW_BLOCK, vocab)
  blocks = -(-vocab // block)
  kept = jnp.where(rows >= threshold[:, None], rows, -jnp.inf)
  kept = jnp.pad(kept, ((0, 0), (0, blocks * block - vocab)), constant_values=-jnp.inf)
  kept = kept.reshape(batch, blocks, block)
  block_mass = jax.nn.logsumexp(kept, axis=-1)                            # [B, blocks]

  def one(key, mass, values):
    chosen = jnp.argmax(mass + jax.random.gumbel(jax.random.fold_in(key, 0), mass.shape))
    inside = values[chosen] + jax.random.gumbel(jax.random.fold_in(key, 1 + chosen), (block,))
    return chosen * block + jnp.argmax(inside)
  return jax.vmap(one)(keys, block_mass, kept).astype(jnp.int32)


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
           top_k: jax.Array, top_p: jax.Array, *, candidates: int = CANDIDATES) -> jax.Array:
  """Tokens [B] for logits [B, V] at absolute `positions` [B], one sampler per row.

  A batch of greedy rows only takes the argmax; a sampled row scales by its temperature,
  keeps its top-k set and nucleus (`_thresholds`, skipped when no row filters) and draws
  with Gumbels keyed by (request, position) (`_draw`).
  """
  def sampled():
    rows = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[:, None]
    filters = ((top_k > 0) & (top_k < rows.shape[-1])) | (top_p < 1.0)
    threshold = jax.lax.cond(jnp.any(filters),
                             lambda: _thresholds(rows, top_k, top_p, candidates),
                             lambda: jnp.full(rows.shape[:1], -jnp.inf))
    row_keys = jax.vmap(lambda key_data, position: jax.random.fold_in(
        jax.random.wrap_key_data(key_data), position))(keys, positions)
    return jnp.where(temperature > 0, _draw(rows, threshold, row_keys), greedy_tokens(logits))
  return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: greedy_tokens(logits))


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
