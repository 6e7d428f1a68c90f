"""The prefill half of the engine: a prompt runs chunk by chunk into its own KV pages, over
the stages of the plan, and its last chunk samples the first token (and, with native MTP,
drafts from the NextN rows it writes into the same pages).

`PrefillSteps` is mixed into `Engine`, which builds the jitted `_prefill` per stage and owns
the layouts, hops and weights these methods read.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from mtpjax import errors
from mtpjax.engine import steps
from mtpjax.engine.page_pool import PageList
from mtpjax.engine.plan import int_like
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.state import EngineState, Prefix, PrefillJob, sampler_arrays
from mtpjax.models.interface import stage_forward


class PrefillSteps:
  """`Engine`'s prefill, `start_prefill`, `prefill_chunk` and `drop_prefill` (`DecodeEngine`)."""

  def _prefill_fn(self, s: int, leaves, inp, start, kv, table, before, mtp, extra):
    """Stage `s` over one chunk of a prompt at positions start... (tokens, or the hop's
    (x, selection)) into the prompt's pages (`table` [1, max_pages]) of the pools `kv`; the
    last stage also samples and drafts (`extra`), continuing the MTP rows from `before`
    (h_{start-1}) into the same pages of the NextN pools `mtp`. Returns (kv, output), in the
    order of the donated inputs (see `_step_fn`)."""
    model = self._model(s, leaves)
    width = (inp if self.layouts[s].embeddings else inp[0]).shape[1]
    positions = start + jnp.arange(width, dtype=jnp.int32)[None]
    x, kv, selection = stage_forward(model, inp, positions, kv, table)
    if not self.layouts[s].output:
      return kv, (x, selection if self._hands_selection(s) else None)
    tokens, length, sampler, want = extra
    return kv, steps.prefill_commit(model, self.engine_cfg, tokens, x, length, sampler, want,
                                    start=start, before=before, mtp=mtp, table=table)

  def prefill(self, prompt: np.ndarray, sampler: SamplerParams, *, state: EngineState,
              logprobs: bool = False, nextn: bool = True) -> Prefix:
    """Run a whole prompt into pages of `state`'s pools, chunk after chunk (`start_prefill`).
    `logprobs`: the prefix carries the first token's (needs `engine_cfg.logprobs`)."""
    job = self.start_prefill(prompt, sampler, state=state, logprobs=logprobs, nextn=nextn)
    if job is None:
      raise errors.KvPagesError(
          f"the KV page pool has no room for a sequence now ({state.pages.available} of "
          f"{state.pages.pages} pages free)", field="engine.kv_pages",
          remedy="free a slot first, or raise engine.kv_pages")
    while not self.prefill_chunk(job):
      pass
    return job.prefix

  def start_prefill(self, prompt: np.ndarray, sampler: SamplerParams, *, state: EngineState,
                    logprobs: bool = False, new_tokens: int = 1,
                    nextn: bool = True) -> PrefillJob | None:
    """A prompt's prefill into pages of `state`'s pools, to run one chunk at a time
    (`prefill_chunk`) so that a scheduler can step other slots between the chunks of a long
    prompt. Reserves every page the sequence can reach (the prompt, `new_tokens` more and a
    draft window), or returns None when the pool cannot promise that now; past it, the
    sequence takes pages while some are free (`page_pool.PagePool.grow`).
    Refuses a prompt that does not fit the context (`errors.ContextLengthError`) before any
    work. With a prefix cache, the longest cached whole-page prefix's pages start the
    sequence and only the rest is prefilled.

    `nextn` False (native MTP): the prompt's NextN rows are not computed, as with MTP off, and
    the slot it is inserted into is detached (`detach`): for a request that cannot draft
    before it ends (the scheduler's cost policy paused drafting for longer)."""
    ec = self.engine_cfg
    prompt, chunks = ec.prefill_chunks(prompt)
    job = PrefillJob(prompt=prompt, chunks=chunks, sampler=sampler_arrays(sampler.validate()),
                     logprobs=logprobs, state=state, pages=PageList(), before=None,
                     nextn=nextn and ec.native_mtp)
    entry = None
    if state.prefixes is not None:
      keys = state.prefixes.page_keys(prompt)
      job.cached, entry = state.prefixes.longest(keys, mtp_rows=job.nextn)
      job.save = state.prefixes.to_save(keys, job.cached, mtp_rows=job.nextn)
    if entry is not None:
      state.pages.share(job.pages, entry[0])
    need = ec.request_pages(prompt.size, new_tokens)
    if not state.pages.reserve(job.pages, need - len(job.pages.pages)):
      state.pages.release(job.pages)
      return None
    if entry is not None:   # h_{n-1}; the prefix's MTP rows are on its shared pages
      job.before = entry[1]
      job.chunks = ec.prefill_chunks(prompt, job.cached)[1]
    elif self.hops.local(self.last):
      job.before = self._last_zeros((1, self.cfg.hidden), self.dtype)
    return job

  def drop_prefill(self, job: PrefillJob) -> None:
    """Give back the pages of a prefill that will not be inserted (it failed, or was only
    looked at)."""
    job.state.pages.release(job.pages)

  def prefill_chunk(self, job: PrefillJob) -> bool:
    """Run the next chunk of `job`; True once the prompt is done and `job.prefix` is set."""
    start, count, bucket = job.chunks.pop(0)
    final = not job.chunks
    state = job.state
    # A padded tail past the pages is dropped; the last chunk's MTP rows run to its chain's.
    mtp_rows = self.engine_cfg.draft_tokens if final and job.nextn else 0
    state.pages.grow(job.pages, start + count + mtp_rows)
    table = state.pages.row(job.pages)[None]
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :count] = job.prompt[start:start + count]
    extra = (tokens, np.int32(count), job.sampler, self._traced_flag(job.logprobs and final))
    x, head, rows = tokens, None, None
    for s in range(len(self.layouts)):
      if s > 0:
        x = self.hops.move(x, s - 1, s,
                           like=(self._width(1, bucket)[0], self._selection_like(s, 1, bucket)))
      if not self.hops.local(s):
        continue
      last = s == self.last
      state.kv[s], out = self._prefill[s](self._leaves[s], x, np.int32(start), state.kv[s],
                                          table, job.before if last else None,
                                          state.mtp if last and job.nextn else None,
                                          extra if last else None)
      if last:
        head, rows = out
        if job.nextn:
          state.mtp, head = head.mtp, head.replace(mtp=None)
        job.before = head.slots.h_prev
      else:
        x = out
    if not final:
      if job.save is not None and job.save[0] == start + count:
        state.prefixes.store(job.save[1], job.pages.pages, job.before, mtp_rows=job.nextn)
      return False
    current = self.hops.share(None if head is None else head.slots.current, self.last,
                              like=int_like(1))
    chain = None
    if self.engine_cfg.mtp_chain_columns:   # a composite's host extends the first MTP chain
      chain = self.hops.share(None if head is None else head.slots.draft, self.last,
                              like=int_like(1, self.engine_cfg.draft_tokens))
    shared = (self._shared_logprobs([rows] if head is not None else [], [(0, 1)], 1)
              if self._wants(job.logprobs) else None)
    job.prefix = Prefix(pages=job.pages, length=int(job.prompt.size), head=head,
                        current=current, logprobs=shared, mtp_chain=chain, nextn=job.nextn)
    return True
