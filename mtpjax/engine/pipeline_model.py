"""`mtpjax.load(..., stages=N)`: the `Model` API over pipeline stages.

Everything `Model` offers (logits, hidden, mtp_logits, engine, generate) works the same; each
process loads and runs only the stages whose devices it owns, and results that the host reads
are shared from the last stage to every process.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtpjax import api, errors, loading, sharding, speculative
from mtpjax.engine.decode import EngineConfig
from mtpjax.engine.pipeline import PipelinedEngine, PipelinePlan, make_hops, pipeline_mesh, \
    plan_pipeline, selection_like
from mtpjax.models.glm4_moe import init_kv, previous_hidden


class PipelinedModel(api.Model):
  """A `Model` whose weights are one (graphdef, state) per stage, None for other processes'."""

  def __init__(self, source, cfg, *, dtype: str, resolution, plan: PipelinePlan, config=None,
               checkpoint_dir=None):
    self.plan = plan
    self.hops = make_hops(plan)
    super().__init__(source, cfg, dtype=dtype, resolution=resolution, config=config,
                     checkpoint_dir=checkpoint_dir, stage_ranges=plan.ranges)

  @property
  def last(self) -> int:
    return self.plan.stages - 1

  def weights(self, *, with_mtp: bool) -> list:
    """Per-stage (graphdef, state), each on its stage's sub-mesh; None where not local."""
    with_mtp = with_mtp and self.has_mtp
    if with_mtp not in self._weights:
      if self._weights and with_mtp:
        self._weights.clear()       # the MTP-on weights include everything the others hold
      layouts = self.plan.layouts(self.config, with_mtp=with_mtp)
      self._weights[with_mtp] = [
          self._load_layout(layout, sharding.param_sharding_fn(self.plan.meshes[s]))
          if self.hops.local(s) else None for s, layout in enumerate(layouts)]
    return self._weights[with_mtp]

  # --- full-sequence forwards ---------------------------------------------------------------

  @functools.cached_property
  def _jit_stage(self):
    def run(graphdef, hands_selection, state, inp):
      """inp: tokens on stage 0, else the hop's (x, selection); the cache is the prompt."""
      model = nnx.merge(graphdef, state)
      x, selection = (model.embed_tokens(inp), None) if model.layout.embeddings else inp
      positions = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
      kv = init_kv(self.config, len(model.layers), 1, x.shape[1], model.dtype)
      x, _, selection = model.run_layers(x, positions, kv, selection)
      if not model.layout.output:
        return x, selection if hands_selection else None
      hidden = model.final_norm(x)
      return hidden, model.lm_logits(hidden)
    return jax.jit(run, static_argnums=(0, 1))

  def _run_stages(self, tokens: np.ndarray, weights: list):
    """(hidden, logits) on the last stage (None on other processes)."""
    dtype = loading.resolve_dtype(self.dtype)
    b, t = tokens.shape
    like = jax.ShapeDtypeStruct((b, t, self.config.hidden), dtype)
    selections = [selection_like(layout, self.config, b, t, t)
                  for layout in self.plan.layouts(self.config, with_mtp=False)] + [None]
    x = tokens
    for s, entry in enumerate(weights):
      if s > 0:
        x = self.hops.move(x, s - 1, s, like=(like, selections[s]))
      if entry is not None:
        x = self._jit_stage(entry[0], selections[s + 1] is not None, entry[1],
                            jax.device_put(x, self.hops.shardings[s]))
    return x if weights[self.last] is not None else None

  def _trunk(self, token_ids, weights=None):
    weights = weights or self._any_weights()
    tokens, n = self._padded(token_ids)
    tokens = np.asarray(tokens)
    t = tokens.shape[1]
    like = (jax.ShapeDtypeStruct((1, t, self.config.hidden), loading.resolve_dtype(self.dtype)),
            jax.ShapeDtypeStruct((1, t, self.config.vocab_size), jnp.float32))
    hidden, logits = self.hops.share(self._run_stages(tokens, weights), self.last, like=like)
    return tokens, n, hidden, logits

  def mtp_logits(self, token_ids) -> np.ndarray:
    if not self.has_mtp:
      return super().mtp_logits(token_ids)   # raises the typed "no NextN block" error
    weights = self.weights(with_mtp=True)
    tokens, n = self._padded(token_ids)
    tokens = np.asarray(tokens)
    out = self._run_stages(tokens, weights)
    if out is not None:
      hidden = out[0]
      prev = previous_hidden(hidden)
      graphdef, state = weights[self.last]
      out = self._jit_mtp(graphdef, state, jax.device_put(tokens, self.hops.shardings[self.last]),
                          prev)
    like = jax.ShapeDtypeStruct(tokens.shape + (self.config.vocab_size,), jnp.float32)
    return np.asarray(self.hops.share(out, self.last, like=like)[0, :n], np.float32)

  # --- decoding -----------------------------------------------------------------------------

  def _make_engine(self, engine_cfg: EngineConfig) -> PipelinedEngine:
    weights = self.weights(with_mtp=engine_cfg.native_mtp)
    layouts = self.plan.layouts(self.config, with_mtp=engine_cfg.native_mtp)
    return PipelinedEngine(weights, layouts, self.hops, self.config, engine_cfg,
                           dtype=loading.resolve_dtype(self.dtype))


def _mesh_settings(config, stages: int, splits) -> tuple[int, Sequence[int] | None, int]:
  """(stages, splits, tensor): explicit arguments win over `config.mesh.*`."""
  if config is None:
    return stages, splits, 1
  mesh = config.mesh
  if stages == 1 and splits is None:
    stages, splits = int(mesh.stages), mesh.splits
  return stages, splits, int(mesh.tensor)


def load_pipelined(source, *, dtype: str, stages: int, splits=None,
                   config=None) -> api.Model:
  """Check the mesh and the stage plan (typed errors before any weight is read), then load
  only the stages this process owns."""
  stages, splits, tensor = _mesh_settings(config, stages, splits)
  if splits is not None and not isinstance(splits, (list, tuple)):
    raise errors.MeshConfigError(f"splits must be a sequence of layer boundaries, got {splits!r}",
                                 field="mesh.splits", remedy="pass e.g. splits=(15, 31)")
  pipeline_mesh(stages, tensor)
  src, cfg, checkpoint_dir = api._open(source)
  plan = plan_pipeline(src.layer_count, stages, splits, tensor=tensor)
  model_name = config.model.name if config is not None else api.DEFAULT_MODEL_NAME
  resolution = speculative.resolve_for_source(config or {}, model_name, src)
  return PipelinedModel(src, cfg, dtype=dtype, resolution=resolution, plan=plan, config=config,
                        checkpoint_dir=checkpoint_dir)
