"""Pipeline sharding, form B: per-stage params, KV and jitted step functions (DECODE.md §7).

The package's stage plan (`package/planning.py`) splits trunk layers + NextN block over the
stages; stage 0 embeds, the last stage holds the final norm, the head and the NextN block, so
it samples, verifies and drafts with the Engine's own head-side functions (`decode.py`), and a
last stage that holds only the NextN block runs just those. Each stage is jitted on its own
sub-mesh; activations hop stage to stage (`pipeline_hops.py`), with the glm-dsa row selection
when the next stage starts on a layer that reuses it (`StageLayout.takes_selection`). Slots
are split into microbatches, and JAX's asynchronous dispatch lets stage s work on one group
while s + 1 works on the previous one. With native MTP, a step in which no slot drafts is a
plain one-row step without the NextN block, and the last stage catches its MTP cache up before
drafting resumes, as in the single-device engine.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from mtpjax import errors, sharding
from mtpjax.engine import decode
from mtpjax.engine.decode import DecodeState, Engine, EngineConfig
from mtpjax.engine.pipeline_hops import CollectiveHops, LocalHops
from mtpjax.engine.sampling import SamplerParams
from mtpjax.models.config import ModelConfig
from mtpjax.models.glm4_moe import StageLayout, init_kv, kv_cache_shapes
from mtpjax.package import planning


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
  """Stage ranges over the package's layer_count (NextN included) and each stage's sub-mesh."""
  ranges: tuple[planning.StageRange, ...]
  meshes: tuple[Mesh, ...]

  @property
  def stages(self) -> int:
    return len(self.ranges)

  def layouts(self, cfg: ModelConfig, *, with_mtp: bool) -> list[StageLayout]:
    """Model layouts: trunk layers clipped to the trunk; the NextN block rides on the last."""
    n = cfg.n_layers
    return [StageLayout(min(r.layer_start, n), min(r.layer_end, n), r.includes_embeddings,
                        r.includes_output, with_mtp and cfg.has_mtp and r.includes_output)
            for r in self.ranges]


def pipeline_mesh(stages: int, tensor: int = 1, devices=None) -> Mesh:
  """A ('stage', 'tensor') mesh whose stages are spread evenly over the device list.

  Devices are ordered by process, so spreading puts consecutive stages on different hosts
  when there are as many hosts as stages, and keeps a stage inside one host.
  """
  devices = list(jax.devices() if devices is None else devices)
  sharding.make_mesh(stages=stages, tensor=tensor, devices=devices)   # typed size checks
  per = len(devices) // stages
  picks = [devices[s * per + t] for s in range(stages) for t in range(tensor)]
  mesh = sharding.make_mesh(stages=stages, tensor=tensor, devices=picks)
  for s in range(stages):
    if len({d.process_index for d in mesh.devices[s]}) > 1:
      raise errors.MeshConfigError(
          f"stage {s} would span several processes", field="mesh.tensor",
          remedy="use a mesh.tensor no larger than the devices of one process")
  return mesh


def plan_pipeline(layer_count: int, stages: int, splits: Sequence[int] | None = None, *,
                  tensor: int = 1, devices=None) -> PipelinePlan:
  """Validate the mesh and the split (typed errors, before any weight is read)."""
  mesh = pipeline_mesh(stages, tensor, devices)
  ranges = planning.plan_stages(layer_count, stages, None if splits is None else list(splits))
  return PipelinePlan(tuple(ranges),
                      tuple(sharding.stage_submesh(mesh, s) for s in range(stages)))


def make_hops(plan: PipelinePlan):
  return CollectiveHops(list(plan.meshes)) if jax.process_count() > 1 else LocalHops(
      list(plan.meshes))


def group_bounds(slots: int, groups: int) -> list[tuple[int, int]]:
  """Contiguous slot groups (microbatches), sizes differing by at most one."""
  return planning.even_split(slots, min(slots, groups))


@dataclasses.dataclass
class GroupState:
  """One microbatch: trunk KV per stage (None where another process owns the stage), and the
  head-side DecodeState (`kv=[]`) on the last stage."""
  kv: list
  control: DecodeState | None


@dataclasses.dataclass
class PipelineState:
  """The groups, and (native MTP) the host's copy of each group's `mtp_lag`: every process
  runs the same schedule, so each one knows how many catch-up passes the last stage needs
  without reading the lag back from it."""
  groups: list[GroupState]
  mtp_lag: list[np.ndarray] | None = None


@dataclasses.dataclass
class PipelinePrefix:
  """A prefilled prompt; `current` (the first token) is readable on every process."""
  kv: list
  control: DecodeState | None
  current: np.ndarray


def _ints(*shape) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, jnp.int32)


def selection_like(layout: StageLayout, cfg: ModelConfig, batch: int, tokens: int,
                   cache_len: int) -> jax.ShapeDtypeStruct | None:
  """The glm-dsa row selection [B, T, cache_len] that hops into a stage with `layout` beside
  its activations (`StageLayout.takes_selection`), or None: the hop then carries none."""
  if not layout.takes_selection(cfg, cache_len):
    return None
  return jax.ShapeDtypeStruct((batch, tokens, cache_len), jnp.bool_)


class PipelinedEngine:
  """The Engine's prefill/insert/step contract over pipeline stages (SlotScheduler runs it)."""

  def __init__(self, stage_weights: list, layouts: list[StageLayout], hops, cfg: ModelConfig,
               engine_cfg: EngineConfig, *, dtype=jnp.float32):
    engine_cfg.check_model(cfg)
    self.graphdefs = [None if w is None else w[0] for w in stage_weights]
    self.params = [None if w is None else w[1] for w in stage_weights]
    self.layouts = layouts
    self.hops = hops
    self.cfg = cfg
    self.engine_cfg = engine_cfg
    self.dtype = dtype
    self.last = len(layouts) - 1
    self.bounds = group_bounds(engine_cfg.slots, len(layouts))
    self.trace_counts: dict[str, int] = {}
    self._prefill = [jax.jit(self._counted("prefill", functools.partial(self._prefill_fn, s)))
                     for s in range(len(layouts))]
    # The caches and the last stage's control state (with MTP: its cache and history) are
    # donated, i.e. updated in place.
    donated = ("kv", "control")
    self._step = [jax.jit(self._counted("step", functools.partial(self._step_fn, s, False)),
                          donate_argnames=donated) for s in range(len(layouts))]
    if engine_cfg.native_mtp:   # steps in which no slot drafts, and the catch-up before drafting
      self._plain = [jax.jit(self._counted("plain", functools.partial(self._step_fn, s, True)),
                             donate_argnames=donated) for s in range(len(layouts))]
      self._catch_up = jax.jit(self._counted("catch_up", self._catch_up_fn),
                               donate_argnames=("control",))
    self._insert = jax.jit(self._counted("insert", Engine._insert_fn), donate_argnames=("state",))

  def _counted(self, name: str, fn):
    return decode.counted(self.trace_counts, name, fn)

  def _width(self, batch: int, tokens: int) -> tuple:
    """Shapes of one hop: the activation [B, T, D] and its positions [B, T]."""
    return (jax.ShapeDtypeStruct((batch, tokens, self.cfg.hidden), self.dtype),
            _ints(batch, tokens))

  def _selection_like(self, s: int, batch: int, tokens: int):
    return selection_like(self.layouts[s], self.cfg, batch, tokens, self.engine_cfg.cache_len)

  def _hands_selection(self, s: int) -> bool:
    """Whether stage `s` passes its last row selection on (the next stage reuses it)."""
    return s < self.last and self.layouts[s + 1].takes_selection(self.cfg,
                                                                 self.engine_cfg.cache_len)

  def _stage_kv(self, s: int, batch: int) -> list:
    layout = self.layouts[s]
    shapes = kv_cache_shapes(self.cfg, layout.layer_end - layout.layer_start, batch,
                             self.engine_cfg.cache_len)
    zeros = [(np.zeros(k, self.dtype), np.zeros(v, self.dtype)) for k, v in shapes]
    return jax.device_put(zeros, self.hops.shardings[s])

  # --- state --------------------------------------------------------------------------------

  def init_state(self) -> PipelineState:
    cfg, ec = self.cfg, self.engine_cfg
    groups = []
    for lo, hi in self.bounds:
      b = hi - lo
      kv = [self._stage_kv(s, b) if self.hops.local(s) else None
            for s in range(len(self.layouts))]
      control = None
      if self.hops.local(self.last):
        control = jax.device_put(DecodeState(
            kv=[], **decode.mtp_fields(cfg, ec, b, self.dtype, np.zeros),
            pos=np.zeros((b,), np.int32),
            current=np.zeros((b,), np.int32), draft=np.zeros((b,), np.int32),
            h_prev=np.zeros((b, cfg.hidden), self.dtype), keys=np.zeros((b, 2), np.uint32),
            temperature=np.zeros((b,), np.float32), top_k=np.zeros((b,), np.int32),
            top_p=np.ones((b,), np.float32)), self.hops.shardings[self.last])
      groups.append(GroupState(kv=kv, control=control))
    lag = ([np.zeros(hi - lo, np.int32) for lo, hi in self.bounds] if ec.native_mtp else None)
    return PipelineState(groups, lag)

  # --- prefill ------------------------------------------------------------------------------

  def _prefill_fn(self, s: int, params, inp, extra):
    """Stage `s` over a whole prompt (tokens, or the hop's (x, selection)); the last stage
    also samples and drafts (`extra`)."""
    model = nnx.merge(self.graphdefs[s], params)
    layout = self.layouts[s]
    x, selection = (model.embed_tokens(inp), None) if layout.embeddings else inp
    positions = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
    kv = init_kv(self.cfg, len(model.layers), 1, self.engine_cfg.cache_len, self.dtype)
    x, kv, selection = model.run_layers(x, positions, kv, selection)
    if not layout.output:
      return (x, selection if self._hands_selection(s) else None), kv
    tokens, length, sampler = extra
    return decode.prefill_commit(model, self.engine_cfg, tokens, model.final_norm(x), length,
                                 sampler), kv

  def prefill(self, prompt: np.ndarray, sampler: SamplerParams) -> PipelinePrefix:
    tokens, length = self.engine_cfg.padded_prompt(prompt)
    sampler_arrays = decode._sampler_arrays(sampler.validate())
    kv = [None] * len(self.layouts)
    x, control, t = tokens, None, tokens.shape[1]
    for s in range(len(self.layouts)):
      if s > 0:
        x = self.hops.move(x, s - 1, s,
                           like=(self._width(1, t)[0], self._selection_like(s, 1, t)))
      if not self.hops.local(s):
        continue
      here = self.hops.shardings[s]
      inp = jax.device_put(x, here)
      if s < self.last:
        x, kv[s] = self._prefill[s](self.params[s], inp, None)
      else:
        extra = jax.device_put((tokens, np.int32(length), sampler_arrays), here)
        control, kv[s] = self._prefill[s](self.params[s], inp, extra)
    current = self.hops.share(None if control is None else control.current, self.last,
                              like=_ints(1))
    return PipelinePrefix(kv=kv, control=control, current=current)

  def insert(self, prefix: PipelinePrefix, state: PipelineState, slot: int) -> PipelineState:
    g = next(i for i, (lo, hi) in enumerate(self.bounds) if lo <= slot < hi)
    group = state.groups[g]
    local_slot = np.int32(slot - self.bounds[g][0])
    for s in range(len(self.layouts)):
      if self.hops.local(s):
        group.kv[s] = self._insert(prefix.kv[s], group.kv[s], local_slot)
    if self.hops.local(self.last):
      group.control = self._insert(prefix.control, group.control, local_slot)
    if state.mtp_lag is not None:
      state.mtp_lag[g][local_slot] = 0      # a prefilled prompt's MTP KV is complete
    return state

  # --- steps --------------------------------------------------------------------------------

  def _step_fn(self, s: int, plain: bool, params, inp, kv, control, active, drafting):
    """Stage `s` of one decode/verify step for one group; the last stage commits tokens.

    A `plain` step (native MTP, no slot drafting) decodes one position per slot, as MTP off
    does, and the last stage records the row's MTP inputs instead of running the NextN block
    (`decode.plain_commit`)."""
    model = nnx.merge(self.graphdefs[s], params)
    layout = self.layouts[s]
    verify = self.engine_cfg.native_mtp and not plain
    if layout.embeddings:
      # A single stage reads (current, draft, pos) from the control state it donates.
      current = (control.current, control.draft, control.pos) if layout.output else inp
      tokens, positions = decode.step_inputs(*current, native_mtp=verify)
      x, selection = model.embed_tokens(tokens), None
    else:
      x, positions, selection = inp
    x, kv, selection = model.run_layers(x, positions, kv, selection)
    if not layout.output:
      return (x, positions, selection if self._hands_selection(s) else None), kv
    hidden = model.final_norm(x)
    if verify:
      verified = decode.verify_tokens(model, control, hidden)
      control, result = decode.draft_commit(model, control, verified, active, drafting)
    elif plain:
      control, result = decode.plain_commit(model, control, hidden, active)
    else:
      control, result = decode.decode_commit(model, control, hidden, active)
    return (control, result), kv

  def _catch_up_fn(self, params, control, active):
    return decode.catch_up_commit(nnx.merge(self.graphdefs[self.last], params), control, active)

  def catch_up(self, state: PipelineState, active) -> PipelineState:
    """Bring every active slot's MTP KV (and draft) up to its position after plain steps: the
    NextN block sits on the last stage, so only that stage's process runs the passes."""
    active = np.asarray(active, bool)
    for g, ((lo, hi), group) in enumerate(zip(self.bounds, state.groups)):
      live = active[lo:hi]
      passes, state.mtp_lag[g] = decode.catch_up_passes(state.mtp_lag[g], live)
      if passes and self.hops.local(self.last):
        act = jax.device_put(live, self.hops.shardings[self.last])
        for _ in range(passes):
          group.control = self._catch_up(self.params[self.last], group.control, act)
    return state

  def step(self, state: PipelineState, active: np.ndarray, drafting: np.ndarray | None = None
           ) -> tuple[PipelineState, np.ndarray, dict]:
    """One step for every slot, group after group; dispatch is asynchronous, so stages overlap.

    `drafting` [B] (native MTP) says which slots use their draft, as in `Engine.step`.
    """
    active = np.asarray(active, bool)
    drafting = np.ones_like(active) if drafting is None else np.asarray(drafting, bool)
    mtp = self.engine_cfg.native_mtp
    plain = mtp and not (drafting[active].any() if active.any() else drafting.any())
    if mtp and not plain:
      state = self.catch_up(state, active)
    steps = self._plain if plain else self._step
    width = 2 if mtp and not plain else 1
    results = []
    for (lo, hi), group in zip(self.bounds, state.groups):
      b = hi - lo
      c = group.control
      out = None
      if self.last > 0:   # stage 0 embeds the last stage's tokens
        out = self.hops.move(None if c is None else (c.current, c.draft, c.pos), self.last, 0,
                             like=(_ints(b),) * 3)
      for s in range(len(self.layouts)):
        if s > 0:
          out = self.hops.move(out, s - 1, s, like=self._width(b, width) + (
              self._selection_like(s, b, width),))
        if not self.hops.local(s):
          continue
        if s < self.last:
          out, group.kv[s] = steps[s](self.params[s], out, group.kv[s], None, None, None)
        else:
          act = jax.device_put(active[lo:hi], self.hops.shardings[s])
          draft_mask = jax.device_put(drafting[lo:hi], self.hops.shardings[s])
          (group.control, result), group.kv[s] = steps[s](
              self.params[s], out, group.kv[s], group.control, act, draft_mask)
          results.append(result)
    if plain:
      state.mtp_lag = [lag + active[lo:hi] for lag, (lo, hi) in zip(state.mtp_lag, self.bounds)]
    shared = [self.hops.share(results[i] if results else None, self.last, like=_ints(hi - lo, 4))
              for i, (lo, hi) in enumerate(self.bounds)]
    return state, np.concatenate([np.asarray(r) for r in shared]), {}
