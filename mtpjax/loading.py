"""Stream GGUF tensors of one stage into model parameters, placed on their devices.

The reader yields one artifact at a time and each tensor is dequantized (or, kept quantized,
split into its block fields), cast and put on its target sharding before the next is read, so
peak host memory is about one tensor plus what is already on the devices, never the whole model
twice.

Weights (`WEIGHTS`): "quantized" keeps every projection, expert stack and embedding table whose
GGUF type has a device block form (`gguf/quant_blocks.py`) as a `quantized.QuantizedTensor`;
other types (IQ*, TQ*) fall back to dense with one log line per tensor, and float tensors stay
dense. "dense" dequantizes everything at load, as before.
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from gguf.constants import GGMLQuantizationType

from mtpjax import errors
from mtpjax.gguf import quant_blocks
from mtpjax.gguf.tensors import dequantize, numpy_shape
from mtpjax.models import registry
from mtpjax.models.config import ModelConfig
from mtpjax.models.interface import StageLayout
from mtpjax.models.primitives import GgufWeight, LinearWeight
from mtpjax.models.quantized import QuantizedTensor

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
WEIGHTS = ("quantized", "dense")
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})

ShardingFn = Callable[[tuple, tuple], jax.sharding.Sharding | None]


def resolve_dtype(dtype) -> jnp.dtype:
  if isinstance(dtype, str):
    if dtype not in DTYPES:
      raise errors.ConversionError(
          f"unsupported dtype {dtype!r}", field="dtype",
          remedy=f"choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]
  return jnp.dtype(dtype)


def resolve_weights(weights: str) -> str:
  if weights not in WEIGHTS:
    raise errors.ConversionError(
        f"unsupported weights {weights!r}", field="weights",
        remedy=f"choose one of {', '.join(WEIGHTS)}")
  return weights


def tensor_types(source) -> dict[str, str]:
  """GGUF tensor name -> ggml type name of a GGUF / package source."""
  return {name: GGMLQuantizationType(int(info.ggml_type)).name
          for name, info in source.tensors.items()}


def _quantizable(leaf) -> tuple[int, ...] | None:
  """The GGUF-layout shape of a leaf the loader may keep quantized, else None."""
  if isinstance(leaf, LinearWeight):
    return tuple(reversed(leaf.shape))
  if isinstance(leaf, GgufWeight):
    return tuple(leaf.shape)
  return None


def weight_formats(types: Mapping[str, str], cfg: ModelConfig, layout: StageLayout,
                   weights: str, model=None) -> dict[tuple, str]:
  """{parameter path: ggml type} of the parameters a stage keeps quantized (`model`: the
  stage's abstract model when the caller has built it already)."""
  if resolve_weights(weights) == "dense":
    return {}
  if model is None:
    model = nnx.eval_shape(lambda: registry.build(cfg, layout, jnp.float32))
  leaves = {tuple(p): leaf for p, leaf in nnx.to_flat_state(nnx.state(model))}
  formats = {}
  for name, type_name in types.items():
    if type_name in _FLOAT_TYPES:
      continue
    for target in registry.tensor_targets(name, cfg, layout):
      if _quantizable(leaves.get(target.path)) is None or target.kv_b is not None:
        continue
      if type_name not in quant_blocks.DEVICE_TYPES:
        logging.info("tensor %s: ggml type %s has no device block form; kept dense", name,
                     type_name)
        continue
      formats[target.path] = type_name
  return formats


def _module_at(model, path: tuple):
  for key in path:
    model = model[key] if isinstance(key, int) else getattr(model, key)
  return model


def abstract_model(cfg: ModelConfig, layout: StageLayout, dtype
                   ) -> tuple[nnx.GraphDef, nnx.State]:
  """The model's structure and parameter shapes, without allocating any parameter."""
  graphdef, abstract, _ = abstract_stage(cfg, layout, dtype, {}, "dense")
  return graphdef, abstract


def abstract_stage(cfg: ModelConfig, layout: StageLayout, dtype, types: Mapping[str, str],
                   weights: str) -> tuple[nnx.GraphDef, nnx.State, dict[tuple, str]]:
  """`abstract_model` with the parameters `weight_formats` keeps quantized as
  `QuantizedTensor`s of their ggml type, and those formats; the model is built once."""
  model = nnx.eval_shape(lambda: registry.build(cfg, layout, resolve_dtype(dtype)))
  formats = weight_formats(types, cfg, layout, weights, model)
  for path, type_name in formats.items():
    parent = _module_at(model, path[:-1])
    shape = _quantizable(getattr(parent, path[-1]))
    setattr(parent, path[-1], nnx.eval_shape(lambda: QuantizedTensor(type_name, shape)))
  return (*nnx.split(model), formats)


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


def _place(part: np.ndarray, path: tuple, info, want, sharding_fn: ShardingFn | None):
  if want is None or tuple(part.shape) != tuple(want.shape):
    raise errors.ConversionError(
        f"tensor {info.name} has shape {tuple(part.shape)} but the model expects "
        f"{None if want is None else tuple(want.shape)} at {'/'.join(map(str, path))}",
        path=info.path, field=info.name,
        remedy="check that the GGUF metadata matches its tensors (re-convert the model)")
  part = np.asarray(part, dtype=want.dtype)
  sharding = sharding_fn(path, part.shape) if sharding_fn else None
  return jax.device_put(part, sharding) if sharding is not None else jnp.asarray(part)


def load_leaves(source, cfg: ModelConfig, layout: StageLayout, *, dtype="float32",
                weights: str = "quantized", sharding_fn: ShardingFn | None = None,
                keep: Callable[[tuple], bool] | None = None,
                progress: Callable[[int], None] | None = None):
  """Read, dequantize (or split into block fields) and place the parameters of a stage (those
  `keep` accepts).

  Returns (graphdef, abstract state, {path: array}); tensors the stage does not use are never
  read further than their bytes.
  """
  graphdef, abstract, formats = abstract_stage(cfg, layout, dtype, tensor_types(source), weights)
  expected = {p: s for p, s in flat_paths(abstract).items() if keep is None or keep(p)}
  transposed = linear_weight_paths(abstract)
  filled: dict[tuple, jax.Array] = {}
  start, end = stage_gguf_range(cfg, layout)
  needs_embedding = any(path[0] == "embed" for path in expected)   # dense, or quantized fields
  extra = ["token_embd.weight"] if (needs_embedding and not layout.embeddings) else []
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
    dense = [t for t in targets if t.path not in formats]
    if dense:
      leaf_dtype = np.dtype(expected[dense[0].path].dtype)
      deq_dtype = "bfloat16" if leaf_dtype == jnp.bfloat16 else "float32"
      array = dequantize(info.name, info.ggml_type, info.ne, raw, dtype=deq_dtype)
    for target in dense:
      part = target.take(array)
      if target.path in transposed:
        part = part.T
      filled[target.path] = _place(part, target.path, info, expected.get(target.path),
                                   sharding_fn)
    quantized_targets = [t for t in targets if t.path in formats]
    if quantized_targets:
      fields = quant_blocks.unpack(formats[quantized_targets[0].path], raw, numpy_shape(info.ne))
    for target in quantized_targets:
      for field, array in fields.items():
        path = target.path + (field,)
        filled[path] = _place(target.take(array), path, info, expected.get(path), sharding_fn)
    if progress is not None:
      progress(info.n_bytes)
  missing = sorted(_describe(p, cfg, layout) for p in expected if p not in filled)
  if missing:
    raise errors.ConversionError(
        f"the source lacks tensors for {len(missing)} parameters: {', '.join(missing[:8])}",
        path=str(source.path), field=missing[0],
        remedy="use a complete GGUF or package (see docs/MODEL.md §4 for required tensors)")
  return graphdef, abstract, filled


def bytes_by_type(weights) -> dict[str, tuple[int, int | None]]:
  """{ggml type: (device bytes, GGUF bytes)} over the `QuantizedTensor`s of (graphdef, state)
  pairs, and {dtype name: (device bytes, None)} over the dense parameters."""
  out: dict[str, list] = {}
  for graphdef, state in weights:
    model = nnx.merge(graphdef, state)
    quantized_fields = set()
    for path, module in nnx.iter_modules(model):
      if isinstance(module, QuantizedTensor):
        entry = out.setdefault(module.type_name, [0, 0])
        entry[0] += module.device_bytes()
        entry[1] += module.gguf_bytes()
        quantized_fields.update(tuple(path) + (f,) for f in module.field_names)
    for path, leaf in nnx.to_flat_state(state):
      if tuple(path) not in quantized_fields:
        entry = out.setdefault(np.dtype(leaf.dtype).name, [0, None])
        entry[0] += int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
  return {name: tuple(entry) for name, entry in out.items()}


def assemble(graphdef: nnx.GraphDef, abstract: nnx.State,
             leaves: dict[tuple, jax.Array]) -> tuple[nnx.GraphDef, nnx.State]:
  """Put loaded arrays into the abstract state; (graphdef, state) feed `nnx.merge` or jit."""
  nnx.replace_by_pure_dict(abstract, unflatten(leaves))
  return graphdef, abstract


def load_state(source, cfg: ModelConfig, layout: StageLayout, *, dtype="float32",
               weights: str = "quantized", sharding_fn: ShardingFn | None = None,
               progress: Callable[[int], None] | None = None):
  """(graphdef, state) of a stage read straight from a GGUF source."""
  graphdef, abstract, leaves = load_leaves(source, cfg, layout, dtype=dtype, weights=weights,
                                           sharding_fn=sharding_fn, progress=progress)
  return assemble(graphdef, abstract, leaves)
