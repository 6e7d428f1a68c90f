"""The engine: jitted prefill, insert and decode / verify+draft steps over the stages of a plan.

A single device (or a tensor-sharded mesh) is the plan of one stage that owns everything; a
pipeline splits the model over several (docs/DECODE.md §7 form B). Each stage is jitted on its own
sub-mesh; activations hop stage to stage (`pipeline_hops.py`), with the glm-dsa row selection
when the next stage starts on a layer that reuses it (`StageLayout.takes_selection`). Slots are
split into one group per stage (microbatches), and JAX's asynchronous dispatch lets stage s work
on one group while s + 1 works on the previous one.

A step computes only each group's slots up to its highest active one, rounded up to a power of
two (`slots_for`): one compile per slot bucket, all made by `warm_up`. Caches and the head state
are donated, so they are updated in place. The head side of a step (sampling, verify, draft,
commit, paused drafting with catch-up) is `steps.py`; prefill is `prefill.py`. On one stage, a
burst runs `decode_steps` steps of one kind in one dispatch (`steps.burst`), paying the host's
dispatch once for all of them.

The trunk caches, and the NextN block's cache and MTP history, are page pools
(`page_pool.py`): a prompt is prefilled straight into its own pages (a cached prefix's pages
are shared, not copied), `insert` hands them to the slot with its small per-slot head fields,
and before each step every active slot gets the pages for the rows that step may write.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from mtpjax.engine import memory, steps
from mtpjax.engine.contract import COUNT, EngineConfig, counted, slot_buckets
from mtpjax.engine.page_pool import PagePool
from mtpjax.engine.pipeline_hops import LocalHops
from mtpjax.engine.plan import group_bounds, int_like, selection_like
from mtpjax.engine.prefill import PrefillSteps
from mtpjax.engine.prefix_cache import PrefixCache
from mtpjax.engine.state import EngineState, Group, HeadState, Prefix
from mtpjax.kernels import backend
from mtpjax.models import kv_cache, quantized, registry
from mtpjax.models.config import ModelConfig
from mtpjax.models.interface import StageLayout, stage_forward


def _insert_fn(prefix, state, slot):
  """A head state with slot `slot` replaced by the one-slot `prefix` (same tree structure)."""
  put = lambda dst, src: jax.lax.dynamic_update_index_in_dim(dst, src[0], slot, axis=0)
  return jax.tree.map(put, state, prefix)


class Engine(PrefillSteps):
  """Compiled steps for one model over its stages and a fixed slot count (a `DecodeEngine`).

  `stage_weights` holds each stage's (graphdef, state), None for stages another process owns.
  """

  def __init__(self, stage_weights: Sequence, layouts: Sequence[StageLayout], hops,
               cfg: ModelConfig, engine_cfg: EngineConfig, *, dtype=jnp.float32):
    engine_cfg.check_model(cfg)
    self.layouts = list(layouts)
    self.hops = hops
    self.cfg = cfg
    self.engine_cfg = engine_cfg
    self.dtype = dtype
    self.kv_dtype = engine_cfg.kv_dtype(dtype)
    self.last = len(self.layouts) - 1
    self.bounds = group_bounds(engine_cfg.slots, len(self.layouts))
    self._buckets = {hi - lo: slot_buckets(hi - lo) for lo, hi in self.bounds}
    self.slot_buckets = self._buckets[max(self._buckets)]
    self._result_like = [int_like(hi - lo, engine_cfg.result_width)    # ResultTokens per group
                         for lo, hi in self.bounds]
    # Steps take each stage's parameters as a flat list of arrays: flattening an nnx.State
    # (Python callbacks per Variable) on every call costs a few hundred microseconds a step.
    self._graphdefs = [None if w is None else w[0] for w in stage_weights]
    # Decode and verify steps trace with their kernels `for_steps`: a row takes one path
    # whatever the rows' count, so MTP on (k + 1 rows a slot) equals MTP off (one).
    self._step_graphdefs = [None if w is None else quantized.for_steps(*w)
                            for w in stage_weights]
    flat = [None if w is None else jax.tree.flatten(w[1]) for w in stage_weights]
    self._leaves = [None if f is None else f[0] for f in flat]
    self._treedefs = [None if f is None else f[1] for f in flat]
    self.trace_counts: dict[str, int] = {}
    jit = lambda name, fn, donate=(): jax.jit(counted(self.trace_counts, name, fn),
                                              donate_argnames=donate,
                                              compiler_options=backend.COMPILER_OPTIONS)
    per_stage = lambda name, fn, donate=(): [jit(name, functools.partial(fn, s), donate)
                                             for s in range(len(self.layouts))]
    self._prefill = per_stage("prefill", self._prefill_fn, ("kv", "mtp"))
    self._insert = jit("insert", _insert_fn, ("state",))
    # Native MTP's plain step records the MTP inputs; a step over detached slots alone is
    # the step with MTP off.
    kinds = ("plain", "decode") if engine_cfg.native_mtp else ("decode",)
    self._steps = {kind: per_stage(kind, functools.partial(self._step_fn, kind=kind),
                                   ("kv", "head")) for kind in kinds}
    # A drafting step compiles once per window bucket: it verifies k + 1 rows and, with native
    # MTP, drafts k; without, it commits the host's accepted drafts.
    self._verify_kind = "verify_draft" if engine_cfg.native_mtp else "verify_host"
    self._draft_steps = {
        k: per_stage(self._verify_kind, functools.partial(self._step_fn, kind=self._verify_kind,
                                                          depth=k), ("kv", "head"))
        for k in engine_cfg.window_buckets}
    # Timing splits a drafting step's last stage in two jits, synced after each.
    self._verify = {k: jit("verify", functools.partial(self._step_fn, self.last, kind="verify",
                                                       depth=k), ("kv",))
                    for k in engine_cfg.window_buckets}
    self._draft = jit("draft", self._draft_fn, ("head",))
    self._catch_up = jit("catch_up", self._catch_up_fn, ("head",))
    # Bursts run on one stage in this process (the host's drafts come a step at a time, and
    # timing syncs inside a step): MTP off's steps, native MTP's plain and drafting ones.
    single = (self.last == 0 and isinstance(self.hops, LocalHops) and not engine_cfg.host_drafts
              and not engine_cfg.timing)
    self.decode_burst = engine_cfg.decode_steps if single else 1
    if engine_cfg.decode_steps > 1 and not single:
      logging.info("engine.decode_steps %d: this engine (%s) runs one step a dispatch",
                   engine_cfg.decode_steps, "host drafting" if engine_cfg.host_drafts else
                   "timing" if engine_cfg.timing else "a pipeline")
    self._bursts = {}       # by (the kind of step a burst repeats, its window bucket)
    if self.decode_burst > 1:
      shapes = [(kind, 0) for kind in kinds] + [
          ("verify_draft", k) for k in self._draft_steps if engine_cfg.native_mtp]
      self._bursts = {(kind, k): jit(f"{kind}_burst", functools.partial(
          self._burst_fn, kind=kind, depth=k, count=self.decode_burst), ("kv", "head"))
          for kind, k in shapes}

  def _model(self, s: int, leaves, *, steps: bool = False):
    """Stage `s`'s model over its weights `leaves`, as a decode or verify step traces it
    (`steps`) or as a prefill does."""
    graphdef = (self._step_graphdefs if steps else self._graphdefs)[s]
    return nnx.merge(graphdef, jax.tree.unflatten(self._treedefs[s], leaves))

  def _width(self, batch: int, tokens: int) -> tuple:
    """Shapes of one hop: the activation [B, T, D] and its positions [B, T]."""
    return (jax.ShapeDtypeStruct((batch, tokens, self.cfg.hidden), self.dtype),
            int_like(batch, tokens))

  def _selection_like(self, s: int, batch: int, tokens: int):
    return selection_like(self.layouts[s], self.cfg, batch, tokens, self.engine_cfg.cache_len)

  def _hands_selection(self, s: int) -> bool:
    """Whether stage `s` passes its last row selection on (the next stage reuses it)."""
    return s < self.last and self.layouts[s + 1].takes_selection(self.cfg,
                                                                 self.engine_cfg.cache_len)

  # --- state --------------------------------------------------------------------------------

  def _zero_pools(self, s: int) -> list | None:
    """Stage `s`'s empty trunk page pools, allocated on its devices (a long context's caches
    never pass through the host); None where another process owns it. A pool has the layout
    of a per-slot cache with pages for slots and a page's rows for the sequence."""
    if not self.hops.local(s):
      return None
    layout, ec = self.layouts[s], self.engine_cfg
    zeros = functools.partial(jnp.zeros, dtype=kv_cache.storage_dtype(self.kv_dtype),
                              device=self.hops.shardings[s])
    return [(zeros(k), zeros(v)) for k, v in registry.cache_shapes(
        self.cfg, layout.layer_end - layout.layer_start, ec.pool_pages, ec.kv_page)]

  def _last_zeros(self, shape, dtype) -> jax.Array:
    """Zeros allocated on the last stage's devices."""
    return jnp.zeros(shape, dtype, device=self.hops.shardings[self.last])

  def _cache_needs(self) -> list[tuple[object, int]]:
    """(devices, bytes) of every page pool this process allocates: each local stage's trunk
    pools, and the NextN block's pools and MTP history on the last stage."""
    ec, kv = self.engine_cfg, kv_cache.storage_dtype(self.kv_dtype)
    needs = []
    for s, layout in enumerate(self.layouts):
      if self.hops.local(s):
        shapes = registry.cache_shapes(self.cfg, layout.layer_end - layout.layer_start,
                                       ec.pool_pages, ec.kv_page)
        needs.append((self.hops.shardings[s].device_set,
                      memory.array_bytes([shape for pair in shapes for shape in pair], kv)))
    if ec.native_mtp and self.hops.local(self.last):
      (k, v), = registry.cache_shapes(self.cfg, 1, ec.pool_pages, ec.kv_page)
      rows = (ec.pool_pages, ec.kv_page)
      needs.append((self.hops.shardings[self.last].device_set,
                    memory.array_bytes([k, v], kv) + memory.array_bytes([rows], np.int32)
                    + memory.array_bytes([rows + (self.cfg.hidden,)],
                                         kv_cache.storage_dtype(self.dtype))))
    return needs

  def init_state(self) -> EngineState:
    """Empty slots and page pools, refused up front when the pools cannot fit the memory."""
    ec = self.engine_cfg
    slots = f"{ec.slots} slot{'s' if ec.slots != 1 else ''}"
    memory.check_fits(self._cache_needs(), setting=(
        f"engine.max_len {ec.max_len} with {slots} ({ec.pool_pages} KV pages of {ec.kv_page} "
        f"rows a layer, {jnp.dtype(self.kv_dtype).name} values)"))
    here = self.hops.local(self.last)
    groups = [Group(head=jax.device_put(steps.empty_head(self.cfg, ec, hi - lo, self.dtype),
                                        self.hops.shardings[self.last]) if here else None)
              for lo, hi in self.bounds]
    pages = PagePool(ec.pool_pages, ec.kv_page, ec.max_pages, ec.slots)
    prefixes = PrefixCache(ec.page, ec.prefix_cache, pages) if ec.prefix_cache else None
    lag = [np.zeros(hi - lo, np.int32) for lo, hi in self.bounds] if ec.native_mtp else None
    mtp = (steps.empty_mtp_pages(self.cfg, ec, self.dtype, self.kv_dtype, self._last_zeros)
           if here else None)
    detached = np.zeros(ec.slots, bool) if ec.native_mtp else None
    return EngineState(groups, [self._zero_pools(s) for s in range(len(self.layouts))], pages,
                       prefixes, np.zeros(ec.slots, np.int64), lag, mtp, detached)

  def warm_up_schedule(self) -> list[np.ndarray]:
    """One live slot at k - 1 of a group makes a step over its first k slots."""
    masks = []
    for lo, hi in self.bounds:
      for k in self._buckets[hi - lo]:
        reach = np.zeros(self.engine_cfg.slots, bool)
        reach[lo + k - 1] = True
        masks.append(reach)
    return masks

  def slots_for(self, live: np.ndarray) -> int:
    """How many leading slots of a group a step computes: the smallest bucket that holds every
    active one. A step costs what its slots cost, live or not, and the scheduler fills the
    lowest slots first."""
    index = np.flatnonzero(live)
    need = int(index[-1]) + 1 if index.size else 1
    return next(k for k in self._buckets[len(live)] if k >= need)

  def _group_of(self, slot: int) -> tuple[int, int]:
    """(the group holding `slot`, its index within the group)."""
    g = next(i for i, (lo, hi) in enumerate(self.bounds) if lo <= slot < hi)
    return g, slot - self.bounds[g][0]

  def insert(self, prefix: Prefix, state: EngineState, slot: int) -> EngineState:
    """Run a prefilled prompt in `slot`: the slot takes its pages (no KV is copied) and its
    head state."""
    g, local_slot = self._group_of(slot)
    group = state.groups[g]
    local_slot = np.int32(local_slot)
    state.pages.assign(slot, prefix.pages)
    state.positions[slot] = prefix.length
    if self.hops.local(self.last):
      group.head = self._insert(prefix.head, group.head, local_slot)
    if state.mtp_lag is not None:
      state.mtp_lag[g][local_slot] = 0      # a prefilled prompt's MTP KV is complete
      state.detached[slot] = not prefix.nextn
    return state

  def detach(self, state: EngineState, slot: int) -> EngineState:
    """Detach a live slot from native MTP until it is freed: it never drafts again (its draft
    windows count as 0), so its MTP inputs need no recording, and a step whose active slots
    are all detached costs what a step with MTP off costs."""
    state.detached[slot] = True
    return state

  def free(self, state: EngineState, slot: int) -> EngineState:
    """Release a finished slot: its pages go back to the pool (their rows need no clearing:
    a sequence's rows past its position are masked); a freed slot owes no catch-up and holds
    no position."""
    state.pages.free_slot(slot)
    state.positions[slot] = 0
    if state.mtp_lag is not None:
      g, local_slot = self._group_of(slot)
      state.mtp_lag[g][local_slot] = 0
      state.detached[slot] = False
    return state

  # --- steps --------------------------------------------------------------------------------

  def _step_fn(self, s: int, leaves, inp, kv, table, head: HeadState | None, active, drafting,
               drafts, want, *, kind: str, depth: int = 0):
    """Stage `s` of one step of `kind` over the first active.shape[0] slots of a group.

    `decode` (MTP off) and `plain` (native MTP, no slot drafting) decode one position per
    slot; `plain` records the row's MTP inputs instead of running the NextN block.
    `verify_draft` verifies [current, d1 .. d_depth] and drafts the next chain (`drafting`:
    each slot's window); `verify_host` verifies the host's drafts without native MTP;
    `verify` only samples the target's tokens (timing mode, `_draft_fn` commits). `drafts`:
    the host's drafts [k, draft_tokens] (None: the MTP chain in the head state). The pools
    `kv` stay whole: the model writes and reads only the computed slots' pages (`table`
    [k, max_pages]). Returns (kv, the stage's output): jit aliases donated inputs to outputs
    of the same shape in order, and the NextN pools in `head` have the trunk pools' shapes.
    """
    model = self._model(s, leaves, steps=True)
    layout = self.layouts[s]
    k = active.shape[0]
    drafts = drafts if depth else None      # a step that verifies nothing keeps its chain
    part = head.first(k).with_drafts(drafts) if layout.output else None
    if layout.embeddings:
      if layout.output:     # a single stage reads its inputs from the head state it donates
        current = (part.slots.current, part.slots.draft, part.slots.pos)
      else:                 # stage 0 of a pipeline from the hop, verifying the host's drafts
        current = tuple(a[:k] for a in inp)
        if drafts is not None:
          current = (current[0], drafts, current[2])
      inp, positions = steps.step_inputs(*current, depth)
    else:
      x, positions, selection = inp
      inp = (x, selection)
    x, kv, selection = stage_forward(model, inp, positions, kv, table)
    if not layout.output:
      return kv, (x, positions, selection if self._hands_selection(s) else None)
    if kind == "verify":
      return kv, steps.verify_tokens(model, part, x, self.engine_cfg.logprobs, want)
    part, result, logprobs = self._commit(kind, model, part, x, table, active, drafting, want)
    return kv, (head.merge(part), self._columns(result, part), logprobs)

  def _commit(self, kind: str, model, part: HeadState, x, table, active, drafting, want):
    """The head side of a step of `kind` from the trunk's output `x`: (the head state, its
    ResultTokens, its logprobs)."""
    top_n = self.engine_cfg.logprobs
    if kind in ("verify_draft", "verify_host"):
      verified, logprobs = steps.verify_tokens(model, part, x, top_n, want)
      part, result = (steps.draft_commit(model, part, table, verified, active, drafting)
                      if kind == "verify_draft" else
                      steps.host_verify_commit(part, verified, active, drafting))
      return part, result, logprobs
    if kind == "plain":
      return steps.plain_commit(model, part, table, x, active, top_n, want)
    return steps.decode_commit(model, part, x, active, top_n, want)

  def _burst_fn(self, leaves, inp, kv, table, head: HeadState, active, drafting, drafts, want,
                *, kind: str, depth: int, count: int):
    """`count` steps of `kind` (decode, plain, or verify_draft of window bucket `depth`) in one
    program (`steps.burst`) over the first active.shape[0] slots of the single stage: the
    arguments and outputs of `_step_fn`, the steps' ResultTokens one after another."""
    del inp, drafts     # a single stage reads its inputs (and drafts) from the head state
    model = self._model(0, leaves, steps=True)

    def one_step(kv, part):
      s = part.slots
      x, kv, _ = stage_forward(model, *steps.step_inputs(s.current, s.draft, s.pos, depth), kv,
                               table)
      part, result, logprobs = self._commit(kind, model, part, x, table, active, drafting, want)
      return (kv, part), (result, logprobs)
    kv, part, result, logprobs = steps.burst(one_step, kv, head.first(active.shape[0]), count)
    return kv, (head.merge(part), self._columns(result, part), logprobs)

  def _columns(self, result, part: HeadState):
    """ResultTokens of `result_width` columns: a step's (or a burst's steps') padded to a
    burst's, then the slots' next MTP chain (`mtp_chain_columns`)."""
    ec = self.engine_cfg
    chain = ec.draft_tokens if ec.mtp_chain_columns else 0
    result = jnp.pad(result, ((0, 0), (0, ec.result_width - chain - result.shape[1])))
    if not chain:
      return result
    return jnp.concatenate([result, part.slots.draft.astype(result.dtype)], axis=1)

  def _draft_fn(self, leaves, head: HeadState, table, verified, active, drafting, drafts):
    part, result = steps.draft_commit(self._model(self.last, leaves),
                                      head.first(active.shape[0]).with_drafts(drafts), table,
                                      verified, active, drafting)
    return head.merge(part), self._columns(result, part)

  def _catch_up_fn(self, leaves, head: HeadState, table, active):
    part = steps.catch_up_commit(self._model(self.last, leaves), head.first(active.shape[0]),
                                 table, active)
    return head.merge(part)

  def catch_up(self, state: EngineState, active) -> EngineState:
    """Bring every active slot's MTP KV (and draft) up to its position after plain steps: the
    NextN block sits on the last stage, so only that stage's process runs the passes."""
    if not any(lag.any() for lag in state.mtp_lag):
      return state          # the common case while drafting: no host work beyond this check
    active = np.asarray(active, bool)
    for g, ((lo, hi), group) in enumerate(zip(self.bounds, state.groups)):
      live = active[lo:hi]
      passes, state.mtp_lag[g] = steps.catch_up_passes(state.mtp_lag[g], live)
      if not passes:
        continue
      for slot in lo + np.flatnonzero(live):     # pages for the fresh chain's rows
        pos = int(state.positions[slot])
        state.pages.grow_slot(slot, pos, self.engine_cfg.draft_tokens)
      if self.hops.local(self.last):
        k = self.slots_for(live)
        table = state.pages.table[lo:lo + k].copy()     # jit may alias a host array
        for _ in range(passes):
          state.keep(group, self._catch_up(self._leaves[self.last], state.joined(group),
                                           table, live[:k]))
    return state

  @property
  def overlapping(self) -> bool:
    """Whether `launch` may start a step before the last one's tokens are read, where that
    step is `PendingStep.fixed`: one process runs every stage, and no host drafter waits for
    the tokens (native MTP's drafts stay on the device)."""
    return not self.engine_cfg.host_drafts and isinstance(self.hops, LocalHops)

  def step(self, state: EngineState, active: np.ndarray, drafting: np.ndarray | None = None,
           *, drafts: np.ndarray | None = None, logprobs: bool = False, decode_steps: int = 1
           ) -> tuple[EngineState, np.ndarray, dict]:
    """One step for every group: the state, ResultTokens [slots, result_width] and an info
    dict (timings in us, and logprobs; see `DecodeEngine`): `launch`, then its `collect`."""
    state, pending = self.launch(state, active, drafting, drafts=drafts, logprobs=logprobs,
                                 decode_steps=decode_steps)
    return (state, *pending.collect())

  def launch(self, state: EngineState, active: np.ndarray, drafting: np.ndarray | None = None,
             *, drafts: np.ndarray | None = None, logprobs: bool = False, decode_steps: int = 1
             ) -> tuple[EngineState, "PendingStep"]:
    """Start one step for every group: (state, its `PendingStep`). An `overlapping` engine may
    launch the next step before collecting a `fixed` one (MTP off's, or native MTP's while no
    slot drafts): its positions advance here and a step reads a copy of the page table, so
    freeing or admitting a slot meanwhile changes nothing it computes. Otherwise collect each
    step before launching the next.

    With drafts (native MTP or `host_drafts`), `drafting` [B] gives each slot's draft window
    this step: ints, or bools (True: `draft_tokens`); None: every slot at `draft_tokens`. The
    step verifies the smallest window bucket holding every active slot's window, each slot
    accepting within its own. A slot that does not draft only commits the target's token, so
    its output is unchanged; when no active slot drafts, a plain step decodes one position
    without the MTP block, and the next drafting step first catches the MTP KV up
    (`catch_up`). `drafts` [B, draft_tokens]: the host's drafts (an engine with `host_drafts`
    needs them; a composite's start with the MTP chain). `logprobs`: some live request wants
    the committed rows' logprobs. `decode_steps` (1 or `decode_burst`): the steps of this kind
    and window bucket this dispatch runs (`steps.burst`), their ResultTokens rows one after
    another (`contract.burst_rows`); the caller makes sure every active slot has tokens left
    for all their rows (what follows a stop is dropped by the host).
    """
    want = self._traced_flag(logprobs)
    # Host arrays go to the compiled steps as they are: jit's own transfer is far cheaper than
    # a device_put per argument (a few hundred microseconds a step on a CPU host).
    active = np.asarray(active, bool)
    ec = self.engine_cfg
    if ec.host_drafts != (drafts is not None):
      raise ValueError("an engine with host_drafts takes drafts at every step, and only it")
    if decode_steps not in (1, self.decode_burst):
      can = (f"1 or {self.decode_burst} positions" if self.decode_burst > 1 else
             "one position")
      raise ValueError(f"decode_steps {decode_steps}: this engine decodes {can} a dispatch")
    kind, depth = "decode", 0
    if ec.drafts:
      drafting = ec.windows(drafting)
      if ec.native_mtp:
        drafting = np.where(state.detached, 0, drafting).astype(np.int32)
      depth = ec.window_bucket(drafting, active)
      kind = self._verify_kind if depth else "decode"
      if not depth and ec.native_mtp and not (active.any() and state.detached[active].all()):
        kind = "plain"
    if drafts is not None:
      drafts = np.asarray(drafts, np.int32).reshape(ec.slots, ec.draft_tokens)
    if kind == "verify_draft":
      state = self.catch_up(state, active & ~state.detached)
    tokens = (depth + 1) * decode_steps        # the rows each slot may write
    ahead = steps.mtp_rows_ahead(depth) if ec.native_mtp else 0
    for slot in np.flatnonzero(active):     # pages for every row this step may write
      state.pages.grow_slot(slot, int(state.positions[slot]) + tokens, ahead)
    if decode_steps > 1:
      step_fns = [self._bursts[kind, depth]]
    else:
      step_fns = self._draft_steps[depth] if depth else self._steps[kind]
    info: dict = {}
    results, rows = [], []
    for (lo, hi), group in zip(self.bounds, state.groups):
      live = active[lo:hi]
      k = self.slots_for(live)
      act = live[:k]
      draft_mask = drafting[lo:hi][:k] if ec.drafts else None
      group_drafts = None if drafts is None else drafts[lo:hi][:k]
      table = state.pages.table[lo:lo + k].copy()     # jit may alias a host array on a CPU
      out = None
      if self.last > 0:   # stage 0 embeds the last stage's tokens
        slots = None if group.head is None else group.head.slots
        out = self.hops.move(None if slots is None else (slots.current, slots.draft, slots.pos),
                             self.last, 0, like=(int_like(hi - lo),
                                                 int_like(hi - lo, ec.draft_tokens),
                                                 int_like(hi - lo)))
      for s in range(len(self.layouts)):
        if s > 0:
          out = self.hops.move(out, s - 1, s, like=self._width(k, tokens) + (
              self._selection_like(s, k, tokens),))
        if not self.hops.local(s):
          continue
        if s < self.last:
          state.kv[s], out = step_fns[s](self._leaves[s], out, state.kv[s], table, None, act,
                                         None, group_drafts if s == 0 else None, want)
          continue
        if kind == "verify_draft" and ec.timing:
          head, result, committed = self._timed_last_stage(
              state, group, out, table, act, draft_mask, group_drafts, want, info, depth)
        else:   # the NextN pools stay out of a decode step, which does not touch them
          state.kv[s], (head, result, committed) = step_fns[s](
              self._leaves[s], out, state.kv[s], table,
              group.head if kind == "decode" else state.joined(group), act, draft_mask,
              group_drafts, want)
        state.keep(group, head)
        results.append(result)
        rows.append(committed)
    if kind == "plain":
      state.mtp_lag = [lag + active[lo:hi] * tokens
                       for lag, (lo, hi) in zip(state.mtp_lag, self.bounds)]
    fixed = kind in ("decode", "plain")      # every active slot commits exactly `tokens`
    if fixed:
      state.positions += active * tokens

    def collect() -> tuple[np.ndarray, dict]:
      shared = [self.hops.share(_padded(results[i], hi - lo) if results else None, self.last,
                                like=like) for i, ((lo, hi), like) in
                enumerate(zip(self.bounds, self._result_like))]
      if self._wants(logprobs):
        info["logprobs"] = self._shared_logprobs(rows, self.bounds, tokens)
      result = np.concatenate([np.asarray(r) for r in shared])
      if not fixed:
        counts = result[:, COUNT:decode_steps * ec.step_width:ec.step_width].sum(axis=1)
        state.positions += np.where(active, counts, 0)
      return result, info
    return state, PendingStep(collect, fixed)

  def _wants(self, logprobs: bool) -> bool:
    """Whether a prefill or step returns logprobs: asked for, of an engine that computes them.
    Every process decides it alike, so the shares below stay in step across hosts."""
    return bool(logprobs) and self.engine_cfg.logprobs > 0

  def _traced_flag(self, logprobs: bool):
    """The traced flag a prefill or step takes: whether to compute logprobs (None, so nothing
    is transferred, on an engine that computes none)."""
    return np.bool_(logprobs) if self.engine_cfg.logprobs else None

  def _shared_logprobs(self, per_group: list, bounds, rows: int):
    """Each group's committed-row logprobs, padded to its slots, joined and readable on every
    process: (chosen [B, R], top ids [B, R, n], top logprobs [B, R, n])."""
    n = self.engine_cfg.logprobs
    joined = []
    for i, (lo, hi) in enumerate(bounds):
      b = hi - lo
      like = (jax.ShapeDtypeStruct((b, rows), jnp.float32), int_like(b, rows, n),
              jax.ShapeDtypeStruct((b, rows, n), jnp.float32))
      mine = (tuple(_padded(np.asarray(a), b) for a in per_group[i]) if per_group else None)
      joined.append(self.hops.share(mine, self.last, like=like))
    return tuple(np.concatenate([np.asarray(g[j]) for g in joined]) for j in range(3))

  def _timed_last_stage(self, state: EngineState, group: Group, inp, table, active, drafting,
                        drafts, want, timings: dict, depth: int):
    """The last stage of a drafting step as two synced jits: verify, then draft and commit."""
    leaves = self._leaves[self.last]
    start = time.perf_counter()
    state.kv[self.last], (verified, logprobs) = self._verify[depth](
        leaves, inp, state.kv[self.last], table, group.head, active, drafting, drafts, want)
    jax.block_until_ready(verified)
    mid = time.perf_counter()
    head, result = self._draft(leaves, state.joined(group), table, verified, active, drafting,
                               drafts)
    result = np.asarray(result)
    end = time.perf_counter()
    for name, seconds in (("verification_compute_us", mid - start),
                          ("proposal_compute_us", end - mid)):
      timings[name] = timings.get(name, 0) + int(seconds * 1e6)
    return head, result, logprobs


@dataclasses.dataclass(frozen=True)
class PendingStep:
  """A launched step: `collect()` waits for its tokens and returns (ResultTokens, info) as
  `Engine.step` does. `fixed`: every active slot commits exactly the rows it was launched for
  (no drafts verified), so the host knows the positions before collecting it."""
  collect: Callable[[], tuple[np.ndarray, dict]]
  fixed: bool


def _padded(result, slots: int) -> np.ndarray:
  """A step's per-slot output over a group's first k slots, as [slots, ...] (zeros past them)."""
  result = np.asarray(result)
  if result.shape[0] == slots:
    return result
  full = np.zeros((slots,) + result.shape[1:], result.dtype)
  full[:result.shape[0]] = result
  return full
