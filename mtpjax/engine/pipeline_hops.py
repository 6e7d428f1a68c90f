"""How activations and tokens move between pipeline stages (docs/DECODE.md §7 form B, §8).

A stage is a sub-mesh of one process's devices. On one host a hop is a `jax.device_put` to the
next stage's replicated sharding. Across hosts the stages live in different processes, so a hop
is a tiny global `shard_map` over one lead device per stage whose body is a `lax.ppermute`
(a broadcast is a `psum`). Every process calls every collective hop, in the same order, with
the same shapes: callers pass `like` (the payload's shapes) so a process that does not own the
sending stage can contribute zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtpjax.sharding import STAGE


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def owns(mesh: Mesh) -> bool:
  """Whether this process drives the stage: every device of the sub-mesh is addressable."""
  here = jax.process_index()
  return all(d.process_index == here for d in mesh.devices.flat)


class LocalHops:
  """Single process: every stage is local and a hop is an asynchronous device-to-device copy."""

  def __init__(self, stage_meshes: list[Mesh]):
    self.shardings = [replicated(m) for m in stage_meshes]

  def local(self, stage: int) -> bool:
    return True

  def move(self, tree, src: int, dst: int, like=None):
    """`tree` (on stage `src`) placed on stage `dst`."""
    return jax.device_put(tree, self.shardings[dst])

  def share(self, tree, src: int, like=None):
    """`tree` from stage `src`, readable on every process (here: as it is)."""
    return tree


class CollectiveHops:
  """Several processes: hops are collectives over a ('stage',) mesh of one lead device per stage."""

  def __init__(self, stage_meshes: list[Mesh]):
    self.shardings = [replicated(m) for m in stage_meshes]
    self._local = [owns(m) for m in stage_meshes]
    leads = np.array([m.devices.flat[0] for m in stage_meshes])
    self.mesh = Mesh(leads, (STAGE,), axis_types=(jax.sharding.AxisType.Auto,))
    self._row = NamedSharding(self.mesh, P(STAGE))

  def local(self, stage: int) -> bool:
    return self._local[stage]

  def _global(self, leaf, like, src: int) -> jax.Array:
    """A [stages, ...] array whose row `src` is `leaf` and whose other rows are zeros."""
    shape, dtype = tuple(like.shape), like.dtype
    pieces = []
    for index, device in enumerate(self.mesh.devices.flat):
      if device.process_index != jax.process_index():
        continue
      row = leaf if (index == src and leaf is not None) else np.zeros(shape, dtype)
      pieces.append(jax.device_put(jnp.asarray(row, dtype)[None], device))
    return jax.make_array_from_single_device_arrays((len(self.shardings),) + shape, self._row,
                                                    pieces)

  @functools.lru_cache(maxsize=None)
  def _permute(self, src: int, dst: int):
    def body(rows):
      return jax.tree.map(lambda r: jax.lax.ppermute(r, STAGE, perm=[(src, dst)]), rows)
    return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P(STAGE), out_specs=P(STAGE)))

  @functools.lru_cache(maxsize=None)
  def _broadcast(self):
    def body(rows):
      return jax.tree.map(lambda r: jax.lax.psum(r, STAGE)[0], rows)
    return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P(STAGE), out_specs=P()))

  def _rows(self, tree, like, src: int):
    leaves = jax.tree.leaves(like)
    given = jax.tree.leaves(tree) if self._local[src] else [None] * len(leaves)
    return [self._global(leaf, want, src) for leaf, want in zip(given, leaves)], leaves

  def move(self, tree, src: int, dst: int, like=None):
    if src == dst:
      return tree if self._local[src] else None
    rows, leaves = self._rows(tree, like, src)
    moved = self._permute(src, dst)(rows)
    if not self._local[dst]:
      return None
    lead = self.mesh.devices.flat[dst]
    out = []
    for array in moved:
      shard = next(s for s in array.addressable_shards if s.device == lead)
      out.append(jax.device_put(shard.data[0], self.shardings[dst]))
    return jax.tree.unflatten(jax.tree.structure(like), out)

  def share(self, tree, src: int, like=None):
    rows, _ = self._rows(tree, like, src)
    shared = self._broadcast()(rows)
    return jax.tree.unflatten(jax.tree.structure(like),
                              [np.asarray(a.addressable_data(0)) for a in shared])
