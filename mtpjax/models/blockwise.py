"""Softmax attention over cache rows read in blocks, so a step costs what the sequences hold.

A cache of S rows is read only up to the block holding the highest query position: a loop of
BLOCK rows at a time with an online softmax (running max, running sum and rescaled partial
output per query, the FlashAttention recurrence), whose trip count is a traced value. One
compiled step then serves every length, and a slot holding 128 tokens in a 32K cache reads one
block instead of 32K rows. A cache of at most BLOCK rows is read whole in one softmax.

The caller describes its attention by three functions of a window of rows [first, first + n):
`scores(first, n)` (float32 [..., n]), `visible(first, n)` (bool, broadcastable to the scores:
causal and any sparse selection) and `weighted(first, n, probs)` (the probability-weighted
value sum [..., width]).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

# Rows a loop iteration reads. 256 against 512 (bench_context --modes=steps, 32K context, one
# slot): demo model 1.29 / 1.99 / 4.62 ms at 128 / 1K / 4K tokens held against 1.37 / 2.25 /
# 5.19 ms; GLM-4.7-Flash shape within noise. 128 was faster at 1K, slower at 4K.
BLOCK = 256


def attend(scores: Callable, visible: Callable, weighted: Callable, positions: jax.Array,
           length: int, align: Callable = lambda a: a) -> jax.Array:
  """softmax(scores over visible rows) . values, for a cache of `length` rows; queries at
  `positions` (any shape) never see rows past the highest one. `align` maps a per-query array
  (the scores' leading axes) to the leading axes of `weighted`'s output."""
  if length <= BLOCK:
    probs = jax.nn.softmax(jnp.where(visible(0, length), scores(0, length), -jnp.inf), axis=-1)
    return weighted(0, length, probs)
  blocks = jnp.minimum(jnp.max(positions) // BLOCK + 1, -(-length // BLOCK))

  def body(i, carry):
    peak, total, out = carry
    # The last block may start early to stay inside the cache; rows it re-reads are masked.
    first = jnp.minimum(i * BLOCK, length - BLOCK)
    fresh = first + jnp.arange(BLOCK) >= i * BLOCK
    seen = visible(first, BLOCK) & fresh
    s = jnp.where(seen, scores(first, BLOCK), -jnp.inf)
    new_peak = jnp.maximum(peak, jnp.max(s, axis=-1))
    finite = jnp.isfinite(new_peak)
    shift = jnp.where(finite, new_peak, 0.0)
    probs = jnp.where(seen, jnp.exp(s - shift[..., None]), 0.0)
    rescale = jnp.where(finite, jnp.exp(peak - shift), 0.0)
    total = total * rescale + jnp.sum(probs, axis=-1)
    out = out * align(rescale)[..., None] + weighted(first, BLOCK, probs)
    return new_peak, total, out

  per_query = jax.eval_shape(lambda: scores(0, BLOCK)).shape[:-1]
  shape = jax.eval_shape(lambda: weighted(0, BLOCK, scores(0, BLOCK))).shape
  init = (jnp.full(per_query, -jnp.inf, jnp.float32), jnp.zeros(per_query, jnp.float32),
          jnp.zeros(shape, jnp.float32))
  _, total, out = jax.lax.fori_loop(0, blocks, body, init)
  return out / align(total)[..., None]
