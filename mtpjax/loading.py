"""Stream GGUF tensors of one stage into model parameters, placed on their devices.

The reader yields one artifact at a time and each tensor is dequantized, cast and put on its
target sharding before the next is read, so peak host memory is about one tensor plus what is
already on the devices, never the whole model twice.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtpjax import errors
from mtpjax.gguf.tensors import dequantize
from mtpjax.models import registry
from mtpjax.models.config import ModelConfig
from mtpjax.models.interface import StageLayout
from mtpjax.models.primitives import LinearWeight

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

ShardingFn = Callable[[tuple, tuple], jax.sharding.Sharding | None]


def resolve_dtype(dtype) -> jnp.dtype:
  if isinstance(dtype, str):
    if dtype not in DTYPES:
      raise errors.ConversionError(
          f"unsupported dtype {dtype!r}", field="dtype",
          remedy=f"choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]
  return jnp.dtype(dtype)


def abstract_model(cfg: ModelConfig, layout: StageLayout, dtype) -> tuple[nnx.GraphDef, nnx.State]:
  """The model's structure and parameter shapes, without allocating any parameter."""
  model = nnx.eval_shape(lambda: registry.build(cfg, layout, resolve_dtype(dtype)))
  return nnx.split(model)


def flat_paths(state: nnx.State) -> dict[tuple, jax.ShapeDtypeStruct]:
  """State leaves by path tuple (dict keys and list indices), e.g. ('layers', 0, 'attn', 'wq')."""
  pure = nnx.to_pure_dict(state)
  out = {}
  def walk(node, prefix):
    if isinstance(node, dict):
      for key, child in node.items():
        walk(child, prefix + (key,))
    else:
      out[prefix] = node
  walk(pure, ())
  return out


def linear_weight_paths(state: nnx.State) -> frozenset[tuple]:
  """Paths of the `LinearWeight` leaves: each holds the transpose of its GGUF tensor."""
  return frozenset(tuple(path) for path, leaf in nnx.to_flat_state(state)
                   if isinstance(leaf, LinearWeight))


def unflatten(leaves: dict[tuple, object]) -> dict:
  root: dict = {}
  for path, value in leaves.items():
    node = root
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return root


def stage_gguf_range(cfg: ModelConfig, layout: StageLayout) -> tuple[int, int]:
  """GGUF block indices a stage reads: its trunk layers, plus the NextN block with the head."""
  end = layout.layer_end + 1 if layout.mtp else layout.layer_end
  return layout.layer_start, end


def _describe(path: tuple, cfg: ModelConfig, layout: StageLayout) -> str:
  """A parameter path with its GGUF block, e.g. `blk.2: ffn/up_exps` (stage indices are local)."""
  if path[0] == "layers":
    return f"blk.{layout.layer_start + path[1]}: {'/'.join(map(str, path[2:]))}"
  if path[0] == "mtp":
    return f"blk.{cfg.mtp_layer} (NextN): {'/'.join(map(str, path[1:]))}"
  return "/".join(map(str, path))


def load_leaves(source, cfg: ModelConfig, layout: StageLayout, *, dtype="float32",
                sharding_fn: ShardingFn | None = None, keep: Callable[[tuple], bool] | None = None,
                progress: Callable[[int], None] | None = None):
  """Read, dequantize and place the parameters of a stage (those `keep` accepts).

  Returns (graphdef, abstract state, {path: array}); tensors the stage does not use are never
  dequantized.
  """
  graphdef, abstract = abstract_model(cfg, layout, dtype)
  expected = {p: s for p, s in flat_paths(abstract).items() if keep is None or keep(p)}
  transposed = linear_weight_paths(abstract)
  filled: dict[tuple, jax.Array] = {}
  start, end = stage_gguf_range(cfg, layout)
  extra = ["token_embd.weight"] if (("embed",) in expected and not layout.embeddings) else []
  if start < end:
    stream = source.iter_stage_tensors(start, end, embeddings=layout.embeddings,
                                       output=layout.output, extra=extra)
  else:
    # A boundary-only part (embeddings, output head) has no layer range, and the reader only
    # streams non-empty stage ranges: fetch its few tensors by name instead.
    stream = ((source.tensors[n], source.raw(n)) for n in source.tensors
              if registry.tensor_targets(n, cfg, layout))
  for info, raw in stream:
    targets = [t for t in registry.tensor_targets(info.name, cfg, layout)
               if keep is None or keep(t.path)]
    if not targets:
      continue
    leaf_dtype = np.dtype(expected[targets[0].path].dtype)
    deq_dtype = "bfloat16" if leaf_dtype == jnp.bfloat16 else "float32"
    array = dequantize(info.name, info.ggml_type, info.ne, raw, dtype=deq_dtype)
    for target in targets:
      part = target.take(array)
      if target.path in transposed:
        part = part.T
      want = expected.get(target.path)
      if want is None or tuple(part.shape) != tuple(want.shape):
        raise errors.ConversionError(
            f"tensor {info.name} has shape {tuple(part.shape)} but the model expects "
            f"{None if want is None else tuple(want.shape)} at {'/'.join(map(str, target.path))}",
            path=info.path, field=info.name,
            remedy="check that the GGUF metadata matches its tensors (re-convert the model)")
      part = np.asarray(part, dtype=want.dtype)
      sharding = sharding_fn(target.path, part.shape) if sharding_fn else None
      filled[target.path] = (jax.device_put(part, sharding) if sharding is not None
                             else jnp.asarray(part))
    if progress is not None:
      progress(info.n_bytes)
  missing = sorted(_describe(p, cfg, layout) for p in expected if p not in filled)
  if missing:
    raise errors.ConversionError(
        f"the source lacks tensors for {len(missing)} parameters: {', '.join(missing[:8])}",
        path=str(source.path), field=missing[0],
        remedy="use a complete GGUF or package (see MODEL.md §4 for required tensors)")
  return graphdef, abstract, filled


def assemble(graphdef: nnx.GraphDef, abstract: nnx.State,
             leaves: dict[tuple, jax.Array]) -> tuple[nnx.GraphDef, nnx.State]:
  """Put loaded arrays into the abstract state; (graphdef, state) feed `nnx.merge` or jit."""
  nnx.replace_by_pure_dict(abstract, unflatten(leaves))
  return graphdef, abstract


def load_state(source, cfg: ModelConfig, layout: StageLayout, *, dtype="float32",
               sharding_fn: ShardingFn | None = None,
               progress: Callable[[int], None] | None = None):
  """(graphdef, state) of a stage read straight from a GGUF source."""
  graphdef, abstract, leaves = load_leaves(source, cfg, layout, dtype=dtype,
                                           sharding_fn=sharding_fn, progress=progress)
  return assemble(graphdef, abstract, leaves)
