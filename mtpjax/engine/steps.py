"""The head side of every step: sampling, verifying, drafting and committing (docs/DECODE.md §1-§3).

Everything here runs after the trunk's final norm, on the stage that owns the output head and
the NextN block (the whole model on a single stage), against a `HeadState` over the slots a
step computes.

With native MTP a drafting step verifies `[current, d1..dk]` in one target pass (k, the
window, is static per compile), samples every position with position-keyed keys, accepts the
longest prefix of drafts equal to the target's own tokens plus the target's next token, runs
the MTP head over the k + 1 new rows and drafts the next chain from the row of the new
`current` (`draft_chain`). Rows past the committed length are never read before they are
rewritten, in the trunk caches and the MTP cache alike, so a rejection needs no rollback.

Host drafts (an n-gram proposer's, alone or extending the MTP chain: `composite.py`) are
verified the same way, in place of the slot's chain; without native MTP `host_verify_commit`
commits them with no NextN block at all.

While no slot drafts, a plain step costs what a step with MTP off costs: the MTP block does not
run, each committed row's MTP inputs (token, trunk hidden) go to a history buffer and the
slot's MTP KV falls behind. Before drafting resumes, catch-up passes run the MTP block over the
missing rows, CATCH_UP_ROWS at a time.

The NextN cache and the history are page pools (`MtpPages`) read through the trunk's page
table, since MTP row p is the trunk's position p; a row written on no page (a catch-up window
or a draft chain past what the slot holds) is dropped, and only ever feeds drafts for
positions past it, which nothing reads before rewriting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.engine.contract import EngineConfig
from mtpjax.engine.sampling import greedy_tokens, sample, token_logprobs
from mtpjax.engine.state import CATCH_UP_ROWS, HeadState, MtpPages, Slots
from mtpjax.models import registry
from mtpjax.models.config import ModelConfig
from mtpjax.models.interface import CausalLM, previous_hidden, stage_forward
from mtpjax.models.kv_cache import (AttentionMetadata, gather_rows, scatter_rows,
                                    storage_dtype)


def empty_head(cfg: ModelConfig, engine_cfg: EngineConfig, batch: int, dtype) -> HeadState:
  """A head state of `batch` empty slots (host arrays; without the NextN pools)."""
  return HeadState(slots=Slots.empty(batch, cfg.hidden, dtype, engine_cfg.draft_tokens))


def empty_mtp_pages(cfg: ModelConfig, engine_cfg: EngineConfig, dtype, kv_dtype, zeros
                    ) -> MtpPages | None:
  """The NextN block's empty pools, the trunk's pages of rows (None without native MTP): its
  KV cache of `kv_dtype` values and the history of `dtype` hidden rows; `zeros(shape, dtype)`
  allocates them."""
  if not engine_cfg.native_mtp:
    return None
  pages, rows = engine_cfg.pool_pages, engine_cfg.kv_page
  (k, v), = registry.cache_shapes(cfg, 1, pages, rows)
  kv_stored = storage_dtype(kv_dtype)
  return MtpPages(kv=(zeros(k, kv_stored), zeros(v, kv_stored)),
                  tokens=zeros((pages, rows), np.int32),
                  hidden=zeros((pages, rows, cfg.hidden), storage_dtype(dtype)))


def mtp_rows_ahead(depth: int) -> int:
  """Rows past a step's trunk rows (pos .. pos + depth) that its NextN rows write and read
  back: the verify rows' MTP rows end one further (pos + depth + 1) and the next chain runs
  depth - 1 past the last; a plain step records the new current's history row, pos + 1."""
  return max(depth, 1)


def step_inputs(current, draft, pos, depth: int) -> tuple[jax.Array, jax.Array]:
  """Tokens [B, T] and positions [B, T] of one step: [current] (depth 0) or, verifying a
  window of `depth` drafts, [current, d1 .. d_depth]."""
  tokens = jnp.concatenate([current[:, None], draft[:, :depth]], axis=1)
  return tokens, pos[:, None] + jnp.arange(depth + 1, dtype=jnp.int32)[None]


def draft_chain(model: CausalLM, mtp_kv, table, z, y, pos, depth: int
                ) -> tuple[jax.Array, object]:
  """`depth` greedy drafts after the MTP row at `pos` [B] whose NextN outputs are z (normed)
  and y (before the head norm), [B, D] each, and the MTP cache with the chain's rows.

  d1 comes from z; d_{i+1} from the MTP row (d_i, y of the previous row) at position pos + i,
  written to the MTP cache at that position: the block applied to its own output, as vLLM's
  MTP proposer chains it (`CausalLM.mtp_rows`). Those rows lie past the committed length, so
  the next step's pass over the committed rows rewrites them before any query reads them.
  `table`: the slots' page table over the MTP cache's pages.
  """
  drafts = [greedy_tokens(model.mtp_logits(z))]
  for i in range(1, depth):
    z, y, mtp_kv = model.mtp_rows(drafts[-1][:, None], y[:, None], (pos + i)[:, None], mtp_kv,
                                  table)
    z, y = z[:, 0], y[:, 0]
    drafts.append(greedy_tokens(model.mtp_logits(z)))
  return jnp.stack(drafts, axis=1), mtp_kv


def result_rows(tokens, count, accepted, drafts: int) -> jax.Array:
  """ResultTokens [B, 3 + drafts] (`contract.committed_tokens` reads them) of committed
  `tokens` [B, R <= drafts + 1]."""
  tokens = jnp.pad(tokens, ((0, 0), (0, drafts + 1 - tokens.shape[1])))
  return jnp.concatenate([tokens[:, :2], count[:, None], accepted[:, None], tokens[:, 2:]],
                         axis=1).astype(jnp.int32)


def _at(a, index):
  """a[b, index[b]] for every row b of a [B, T, ...]."""
  index = index.reshape((-1,) + (1,) * (a.ndim - 1))
  return jnp.take_along_axis(a, index, axis=1)[:, 0]


def _sequence_positions(batch: int, length: int) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (batch, length))


def fresh_forward(model: CausalLM, inp, cache_len: int, kv_dtype=None
                  ) -> tuple[jax.Array, list, jax.Array | None]:
  """One stage's pass over whole sequences from position 0 on empty caches of `cache_len` rows
  of `kv_dtype` values (None: the model's dtype), a prompt's prefill or a full-sequence check;
  `inp` as `interface.stage_forward` takes it."""
  layout = model.layout
  batch, length = (inp if layout.embeddings else inp[0]).shape[:2]
  kv = registry.init_cache(model.cfg, layout.layer_end - layout.layer_start, batch, cache_len,
                           kv_dtype or model.dtype)
  return stage_forward(model, inp, _sequence_positions(batch, length), kv)


def fresh_mtp_rows(model: CausalLM, tokens, prev_hidden, kv_dtype=None
                   ) -> tuple[jax.Array, jax.Array]:
  """The NextN block over whole sequences [B, T] from position 0 on an empty cache of
  `kv_dtype` values (rows as `interface.previous_hidden` pairs them): (z, y) as
  `CausalLM.mtp_rows` gives them."""
  batch, length = tokens.shape
  mtp_kv = registry.init_cache(model.cfg, 1, batch, length, kv_dtype or model.dtype)[0]
  z, y, _ = model.mtp_rows(tokens, prev_hidden, _sequence_positions(batch, length), mtp_kv)
  return z, y


def committed_logprobs(logits, tokens, top_n: int, want):
  """`token_logprobs` of committed rows (logits [B, R, V], tokens [B, R]); None when the
  engine computes none (`EngineConfig.logprobs` 0). Only a step some request wants them from
  pays for the log-softmax and top-n (`want`, a traced bool; zeros otherwise)."""
  if not top_n:
    return None
  skipped = lambda: (jnp.zeros(tokens.shape, jnp.float32),
                     jnp.zeros(tokens.shape + (top_n,), jnp.int32),
                     jnp.zeros(tokens.shape + (top_n,), jnp.float32))
  return jax.lax.cond(want, lambda: token_logprobs(logits, tokens, top_n), skipped)


def prefill_commit(model: CausalLM, engine_cfg: EngineConfig, tokens, hidden, length,
                   sampler: tuple, want=False, *, start=0, before=None,
                   mtp: MtpPages | None = None, table=None) -> tuple[HeadState, tuple | None]:
  """Sample the first token from the prompt's last hidden and, with MTP, draft the next one.

  `hidden` [1, bucket, D] is the post-norm trunk output of the prompt `tokens` [1, bucket].
  A chunk of a longer prompt (`Engine.prefill_chunk`) starts at position `start` with `length`
  of its rows real; its MTP rows continue from `before` (h_{start-1}), written into the
  prompt's pages (`table` [1, max_pages]) of the NextN pools `mtp` (None: no NextN rows, as
  with MTP off). Only the last chunk's
  sample and draft are used: an earlier chunk's pass leaves its `h_prev` (the next chunk's
  `before`) and MTP rows, whose row past the chunk the next one rewrites. Returns the head
  state (with the pools) and the first token's logprobs (`committed_logprobs`).
  """
  keys, temperature, top_k, top_p = sampler
  index = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  positions = start + index
  last = jax.lax.dynamic_index_in_dim(hidden, length - 1, axis=1, keepdims=False)  # [1, D]
  logits = model.lm_logits(last)
  first = sample(logits, keys, (start + length)[None], temperature, top_k, top_p)
  head = empty_head(model.cfg, engine_cfg, 1, model.dtype)
  draft = head.slots.draft
  if mtp is not None:
    mtp_tokens = jnp.where(index == length, first[:, None], tokens)
    z, y, mtp_kv = model.mtp_rows(mtp_tokens, previous_hidden(hidden, before), positions,
                                  mtp.kv, table)
    row = lambda a: jax.lax.dynamic_index_in_dim(a, length, axis=1, keepdims=False)
    draft, mtp_kv = draft_chain(model, mtp_kv, table, row(z), row(y), (start + length)[None],
                                engine_cfg.draft_tokens)
    head = head.replace(mtp=mtp.replace(kv=mtp_kv))
  return head.replace(slots=Slots(
      pos=(start + length)[None], current=first, draft=draft, h_prev=last, keys=keys,
      temperature=temperature, top_k=top_k, top_p=top_p, mtp_lag=jnp.zeros((1,), jnp.int32))
  ), committed_logprobs(logits[:, None], first[:, None], engine_cfg.logprobs, want)


def decode_commit(model: CausalLM, head: HeadState, hidden, active, top_n: int = 0,
                  want=False) -> tuple[HeadState, jax.Array, tuple | None]:
  """Plain decoding: sample one token per slot from `hidden` [B, 1, D] and commit it; with
  `top_n`, also the committed row's logprobs (`committed_logprobs`)."""
  s = head.slots
  logits = model.lm_logits(hidden[:, 0])
  token = sample(logits, s.keys, s.pos + 1, s.temperature, s.top_k, s.top_p)
  result = result_rows(token[:, None], jnp.ones_like(token), jnp.zeros_like(token),
                       s.draft.shape[1])
  slots = s.replace(pos=jnp.where(active, s.pos + 1, s.pos),
                    current=jnp.where(active, token, s.current), h_prev=hidden[:, 0])
  return (head.replace(slots=slots), result,
          committed_logprobs(logits[:, None], token[:, None], top_n, want))


def burst(step, kv, head: HeadState, count: int) -> tuple[list, HeadState, jax.Array, tuple | None]:
  """`count` steps of a single-stage model in one program (a burst, `EngineConfig.decode_steps`):
  `step(kv, head)` -> ((kv, head), (its ResultTokens [B, W], its logprobs [B, R, ...] or
  None)), each step feeding the next from the head state it commits (its tokens sampled with
  their positions' keys), so the tokens are those of `count` separate steps; only the host's
  dispatch is paid once. Returns (kv, head, the steps' ResultTokens one after another
  [B, count * W], their logprobs [B, count * R, ...])."""
  (kv, head), (results, logprobs) = jax.lax.scan(lambda carry, _: step(*carry), (kv, head),
                                                 length=count)
  batch = results.shape[1]
  joined = lambda a: jnp.moveaxis(a, 0, 1).reshape((batch, -1) + a.shape[3:])
  return kv, head, joined(results), None if logprobs is None else tuple(map(joined, logprobs))


def verify_tokens(model: CausalLM, head: HeadState, hidden, top_n: int = 0, want=False
                  ) -> tuple[tuple[jax.Array, jax.Array], tuple | None]:
  """Sample the target's tokens at every verify position: ((tokens [B, k + 1], hidden), and
  with `top_n` every row's logprobs)."""
  s = head.slots
  logits = model.lm_logits(hidden)                                       # [B, k + 1, V]
  batch, rows, vocab = logits.shape
  # Every position in one `sample` call: one greedy-or-sampled branch per step (a GPU reads a
  # conditional's predicate back on the host).
  per_row = lambda a: jnp.repeat(a, rows, axis=0)
  positions = s.pos[:, None] + jnp.arange(1, rows + 1, dtype=jnp.int32)[None]
  tokens = sample(logits.reshape(batch * rows, vocab), per_row(s.keys), positions.reshape(-1),
                  per_row(s.temperature), per_row(s.top_k), per_row(s.top_p)
                  ).reshape(batch, rows)
  return (tokens, hidden), committed_logprobs(logits, tokens, top_n, want)


def accepted_drafts(tokens, draft, window) -> jax.Array:
  """Per slot, how many leading drafts equal the target's own tokens at their positions
  (`tokens` [B, k + 1] sampled after [current, d1 .. dk]), within its `window` [B]."""
  depth = tokens.shape[1] - 1
  match = ((tokens[:, :depth] == draft[:, :depth])
           & (jnp.arange(depth)[None] < window[:, None]))
  return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)


def _keep(active, new, old):
  """`new` in the active slots, `old` in the others."""
  return jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)


def _commit_accepted(head: HeadState, tokens, hidden, accepted, active
                     ) -> tuple[HeadState, jax.Array]:
  """Commit each active slot's `accepted` drafts and the target's next token (`tokens`,
  `hidden` [B, k + 1, ...] of the verified rows): the slot moves to the new `current`."""
  s = head.slots
  result = result_rows(tokens, accepted + 1, accepted, s.draft.shape[1])
  slots = s.replace(pos=_keep(active, s.pos + accepted + 1, s.pos),
                    current=_keep(active, _at(tokens, accepted), s.current),
                    h_prev=_keep(active, _at(hidden, accepted), s.h_prev))
  return head.replace(slots=slots), result


def host_verify_commit(head: HeadState, verified, active, window
                       ) -> tuple[HeadState, jax.Array]:
  """Commit the accepted host drafts (an n-gram proposer's, without native MTP) and the
  target's next token per slot: `draft_commit` without the NextN block."""
  tokens, hidden = verified
  return _commit_accepted(head, tokens, hidden, accepted_drafts(tokens, head.slots.draft, window),
                          active)


def draft_commit(model: CausalLM, head: HeadState, table, verified, active, window
                 ) -> tuple[HeadState, jax.Array]:
  """MTP pass over the k + 1 new rows, commit the accepted drafts and the target's next token
  per slot, then draft the next chain of k from the new `current`'s row.

  `window` [B] caps each slot's accepted drafts (slots of a smaller window share the step,
  padded; 0: the slot does not draft and commits only the target's own token). Drafts past
  the chain a previous, shorter step made are stale: they are only ever rejected or, equal
  to the target's token by chance, accepted losslessly. Every active slot must be caught up
  (`mtp_lag` 0), see `Engine.catch_up`. `table`: the slots' pages of the NextN pools.
  """
  s = head.slots
  tokens, hidden = verified
  depth = tokens.shape[1] - 1
  accepted = accepted_drafts(tokens, s.draft, window)
  committed, result = _commit_accepted(head, tokens, hidden, accepted, active)
  positions = s.pos[:, None] + jnp.arange(1, depth + 2, dtype=jnp.int32)[None]
  z, y, mtp_kv = model.mtp_rows(tokens, hidden, positions, head.mtp.kv, table)
  # Only the row of the new `current` drafts; the chain runs the head once per draft.
  chain, mtp_kv = draft_chain(model, mtp_kv, table, _at(z, accepted), _at(y, accepted),
                              s.pos + accepted + 1, depth)
  draft = jnp.concatenate([chain, s.draft[:, depth:]], axis=1)
  return committed.replace(mtp=head.mtp.replace(kv=mtp_kv), slots=committed.slots.replace(
      draft=_keep(active, draft, s.draft))), result


def plain_commit(model: CausalLM, head: HeadState, table, hidden, active, top_n: int = 0,
                 want=False) -> tuple[HeadState, jax.Array, tuple | None]:
  """Commit one sampled token per slot without the MTP block: the new row's MTP inputs
  (token, h_pos) go to the history and the slot's MTP KV falls one more row behind.
  The draft is left as it was (a stale draft is only ever rejected).

  Only these steps write the history: the rows a catch-up reads are exactly the rows committed
  by plain steps since the slot was last caught up. `table`: the slots' pages of the history.
  """
  committed, result, logprobs = decode_commit(model, head, hidden, active, top_n, want)
  s = committed.slots
  row = AttentionMetadata((head.slots.pos + 1)[:, None], table)
  return committed.replace(
      mtp=head.mtp.replace(tokens=scatter_rows(head.mtp.tokens, s.current[:, None], row),
                           hidden=scatter_rows(head.mtp.hidden, hidden, row)),
      slots=s.replace(mtp_lag=jnp.where(active, s.mtp_lag + 1, s.mtp_lag))), result, logprobs


def catch_up_passes(lag: np.ndarray, live: np.ndarray) -> tuple[int, np.ndarray]:
  """(catch-up passes that bring every live slot's MTP KV up to date, the lag after them):
  the host's side of `catch_up_commit`, so no engine reads the lag back from the device."""
  passes = -(-int(lag[live].max()) // CATCH_UP_ROWS) if live.any() else 0
  return passes, np.where(live, np.maximum(lag - passes * CATCH_UP_ROWS, 0), lag).astype(np.int32)


def catch_up_commit(model: CausalLM, head: HeadState, table, active) -> HeadState:
  """Run the MTP block over the next CATCH_UP_ROWS missing rows of each lagging slot.

  Rows past `pos` in the window are read from stale history (or, past the slot's pages, some
  page's rows) and written where the slot has pages; like every row past the committed length
  they are rewritten before they are read. The slot whose window reaches `pos` drafts a fresh
  chain from its last row. `table`: the slots' pages of the NextN pools.
  """
  s = head.slots
  start = s.pos + 1 - s.mtp_lag                                            # first missing row
  rows = AttentionMetadata(start[:, None] + jnp.arange(CATCH_UP_ROWS, dtype=jnp.int32)[None],
                           table)
  z, y, mtp_kv = model.mtp_rows(gather_rows(head.mtp.tokens, rows),
                                gather_rows(head.mtp.hidden, rows), rows.positions,
                                head.mtp.kv, table)
  last = jnp.clip(s.pos - start, 0, CATCH_UP_ROWS - 1)
  chain, mtp_kv = draft_chain(model, mtp_kv, table, _at(z, last), _at(y, last), s.pos,
                              s.draft.shape[1])
  lagging = active & (s.mtp_lag > 0)
  done = lagging & (s.mtp_lag <= CATCH_UP_ROWS)
  return head.replace(mtp=head.mtp.replace(kv=mtp_kv), slots=s.replace(
      mtp_lag=jnp.where(lagging, jnp.maximum(s.mtp_lag - CATCH_UP_ROWS, 0), s.mtp_lag),
      draft=jnp.where(done[:, None], chain, s.draft)))
