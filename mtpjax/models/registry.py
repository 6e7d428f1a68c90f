"""GGUF `general.architecture` -> the config parser, model class and tensor-name map serving it.

Engines, loaders and checkpoints reach a model only through this module and `interface.py`, so
a new architecture is its model module, its name map and one entry here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping

import jax.numpy as jnp

from mtpjax import errors
from mtpjax.models import config as config_lib
from mtpjax.models import glm_names, kv_cache
from mtpjax.models.config import ModelConfig
from mtpjax.models.glm4_moe import GlmModel
from mtpjax.models.interface import CausalLM, StageLayout


@dataclasses.dataclass(frozen=True)
class Architecture:
  """How one GGUF architecture becomes a model.

  `model(cfg, layout, dtype=...)` builds a `CausalLM` for a stage, and its static
  `cache_shapes(cfg, n_layers, batch, length)` gives the per-layer cache shapes;
  `tensor_targets(name, cfg, layout)` maps a GGUF tensor to the parameters it fills.
  """
  parse_config: Callable[..., ModelConfig]
  model: type
  tensor_targets: Callable[[str, ModelConfig, StageLayout], list]


_GLM = Architecture(config_lib.config_from_gguf, GlmModel, glm_names.targets_for)
ARCHITECTURES: dict[str, Architecture] = {arch: _GLM for arch in config_lib.SUPPORTED_ARCHS}


def lookup(arch: str | None, *, source: str = "<gguf>") -> Architecture:
  if arch not in ARCHITECTURES:
    raise errors.UnsupportedArchitectureError(
        f"unsupported architecture {arch!r}; mtpjax supports {', '.join(ARCHITECTURES)}",
        path=source, field="general.architecture",
        remedy=f"use a GGUF of a registered architecture ({', '.join(ARCHITECTURES)})")
  return ARCHITECTURES[arch]


def config_from_gguf(metadata: Mapping[str, Any], tensor_names: Iterable[str], *,
                     source: str = "<gguf>") -> ModelConfig:
  """The model config of a GGUF, parsed by its architecture's parser."""
  arch = lookup(metadata.get("general.architecture"), source=source)
  return arch.parse_config(metadata, tensor_names, source=source)


def build(cfg: ModelConfig, layout: StageLayout, dtype) -> CausalLM:
  return lookup(cfg.arch).model(cfg, layout, dtype=dtype)


def tensor_targets(name: str, cfg: ModelConfig, layout: StageLayout) -> list:
  return lookup(cfg.arch).tensor_targets(name, cfg, layout)


def cache_shapes(cfg: ModelConfig, n_layers: int, batch: int, length: int) -> list:
  """Per-layer cache pair shapes for `n_layers` blocks (the NextN block counts as one)."""
  return lookup(cfg.arch).model.cache_shapes(cfg, n_layers, batch, length)


def init_cache(cfg: ModelConfig, n_layers: int, batch: int, length: int, dtype) -> list:
  """Zeroed caches for `n_layers` blocks, `length` rows per slot, of `dtype` values."""
  dtype = kv_cache.storage_dtype(dtype)
  return [(jnp.zeros(ks, dtype), jnp.zeros(vs, dtype))
          for ks, vs in cache_shapes(cfg, n_layers, batch, length)]
