"""Where each part of a model runs: stage ranges, their sub-meshes and the slot groups
(docs/DECODE.md §7 form B).

The package's stage plan (`package/planning.py`) splits trunk layers + NextN block over the
stages; stage 0 embeds, and the last stage holds the final norm, the head and the NextN block.
A single-device (or tensor-sharded) model is the plan of one stage owning everything.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mtpjax import errors, sharding
from mtpjax.engine.pipeline_hops import CollectiveHops, LocalHops
from mtpjax.models.config import ModelConfig
from mtpjax.models.interface import StageLayout
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


def make_hops(meshes: Sequence[Mesh]):
  return CollectiveHops(list(meshes)) if jax.process_count() > 1 else LocalHops(list(meshes))


def group_bounds(slots: int, groups: int) -> list[tuple[int, int]]:
  """Contiguous slot groups (microbatches), sizes differing by at most one."""
  return planning.even_split(slots, min(slots, groups))


def int_like(*shape) -> jax.ShapeDtypeStruct:
  """An int32 array's shape, as a hop or a share is told to expect it."""
  return jax.ShapeDtypeStruct(shape, jnp.int32)


def selection_like(layout: StageLayout, cfg: ModelConfig, batch: int, tokens: int,
                   cache_len: int) -> jax.ShapeDtypeStruct | None:
  """The glm-dsa row selection [B, T, cache_len] that hops into a stage with `layout` beside
  its activations (`StageLayout.takes_selection`), or None: the hop then carries none."""
  if not layout.takes_selection(cfg, cache_len):
    return None
  return jax.ShapeDtypeStruct((batch, tokens, cache_len), jnp.bool_)
