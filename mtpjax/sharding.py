"""Device meshes and the partition rules for parameters, in one place.

Rules are role-named (as in tpu-inference): a parameter's role comes from its leaf name and
picks which axis is split over the mesh's `tensor` axis. A dimension that the axis size does
not divide stays replicated, so any mesh works, only less evenly.

A quantized parameter (`models/quantized.py`) is its block fields, each shaped like the GGUF
tensor with the last axis counted in blocks (`[out, n_blocks, ...]`): its split dimension is the
weight's, in GGUF layout, so an input split divides whole blocks between devices.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtpjax import errors
from mtpjax.gguf.quant_blocks import FIELD_NAMES

STAGE, TENSOR = "stage", "tensor"

# role -> index of the dimension split over `tensor` (negative: from the end). A parameter's
# role is its leaf name, or for a module's `weight` / `bias` the module's name (`role`).
# Projections are `Linear` weights stored [in, out] (bias [out]), so an output split is the
# last dimension of both.
_SPLIT_DIM = {
    "wq": -1, "wk": -1, "wv": -1,                            # attention heads (outputs)
    "wq_b": -1, "wk_b": 0, "wv_b": 0,                         # MLA per-head up-projections
    "wo": 0,                                                 # attention heads (inputs)
    "gate": -1, "up": -1, "down": 0,                          # dense / shared-expert FFN width
    "gate_exps": 0, "up_exps": 0, "down_exps": 0,            # experts
    "embed": 0, "head": -1,                                   # vocabulary
}
# Roles whose `weight` is held in its GGUF layout, dense or quantized (MLA's per-head
# [H, out, in] projections); every other module's `weight` is a Linear's, transposed when dense.
_GGUF_LAYOUT_WEIGHTS = ("wk_b", "wv_b")


def make_mesh(*, stages: int = 1, tensor: int | None = None, devices=None) -> Mesh:
  """A ('stage', 'tensor') mesh; `tensor` defaults to every device left after the stages."""
  devices = list(jax.devices() if devices is None else devices)
  if stages < 1:
    raise errors.MeshConfigError(f"mesh.stages must be >= 1, got {stages}", field="mesh.stages",
                                 remedy="use 1 for no pipelining")
  if tensor is None:
    tensor = max(1, len(devices) // stages)
  if stages * tensor > len(devices):
    raise errors.MeshConfigError(
        f"a mesh of {stages} stages x {tensor} tensor shards needs {stages * tensor} devices, "
        f"but {len(devices)} are available", field="mesh.stages",
        remedy="lower mesh.stages or mesh.tensor, or add devices")
  grid = np.array(devices[:stages * tensor]).reshape(stages, tensor)
  return Mesh(grid, (STAGE, TENSOR), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def role(path: tuple) -> str:
  """What a parameter does: `('attn', 'wq', 'weight')` -> `wq`, `('ffn', 'experts', 'up_exps')`
  -> `up_exps`."""
  if len(path) > 1 and path[-1] in ("weight", "bias"):
    return path[-2]
  return path[-1]


def _quantized_split(path: tuple) -> int | None:
  """The split dimension of a quantized field at `path` (weight path + field name)."""
  weight = path[:-1]
  split = _SPLIT_DIM.get(role(weight))
  if split is None:
    return None
  if weight[-1] == "weight" and role(weight) not in _GGUF_LAYOUT_WEIGHTS:
    return 0 if split % 2 == 1 else 1  # a Linear: dense [in, out], quantized [out, in]
  return split % (3 if role(weight).endswith("_exps") else 2)


def param_spec(path: tuple, shape: tuple, tensor_size: int) -> P:
  """The PartitionSpec of one parameter of a stage's model."""
  dims = [None] * len(shape)
  quantized = len(path) > 1 and path[-1] in FIELD_NAMES
  split = _quantized_split(path) if quantized else _SPLIT_DIM.get(role(path))
  if split is not None and tensor_size > 1 and len(shape) > 0:
    dim = split if quantized else split % len(shape)
    if shape[dim] % tensor_size == 0:
      dims[dim] = TENSOR
  return P(*dims)


def param_sharding_fn(mesh: Mesh):
  """`(path, shape) -> NamedSharding` for the loader and checkpoint restore."""
  tensor_size = mesh.shape[TENSOR]
  def fn(path: tuple, shape: tuple) -> NamedSharding:
    return NamedSharding(mesh, param_spec(path, shape, tensor_size))
  return fn


def stage_submesh(mesh: Mesh, stage: int) -> Mesh:
  """The devices of one pipeline stage, as a ('stage', 'tensor') mesh with one stage."""
  grid = mesh.devices[stage:stage + 1]
  return Mesh(grid, (STAGE, TENSOR), axis_types=(jax.sharding.AxisType.Auto,) * 2)
