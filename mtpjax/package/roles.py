"""Tensor roles by name, as upstream's stage runtime classifies them (docs/LAYER_PACKAGES.md §3).

Both manifest schemas and the reader share these rules: which layer a tensor belongs to, and
which tensors a stage for layers [start, end) selects.
"""

from __future__ import annotations

import re

ROLE_LAYER = "layer"
ROLE_EMBEDDING = "embedding"
ROLE_OUTPUT = "output"
ROLE_FINAL_NORM = "final_norm"
ROLE_METADATA = "metadata"
OWNED_ROLES = frozenset({ROLE_LAYER, ROLE_EMBEDDING, ROLE_OUTPUT, ROLE_FINAL_NORM})

EMBEDDING_NAMES = frozenset({"token_embd.weight", "per_layer_token_embd.weight"})
OUTPUT_NAMES = frozenset({"output.weight", "output.bias"})
FINAL_NORM_NAMES = frozenset({"output_norm.weight", "output_norm.bias"})

_LAYER_NAME = re.compile(r"blk\.([0-9]+)\.")
_CACHE_NAME = re.compile(r"cache_.*_l([0-9]+)")


def tensor_role(name: str) -> tuple[str, int | None]:
  """(role, layer index) by name, as upstream's stage runtime classifies tensors (§3)."""
  match = _LAYER_NAME.match(name) or _CACHE_NAME.fullmatch(name)
  if match:
    return ROLE_LAYER, int(match.group(1))
  if name in EMBEDDING_NAMES:
    return ROLE_EMBEDDING, None
  if name in OUTPUT_NAMES:
    return ROLE_OUTPUT, None
  if name in FINAL_NORM_NAMES:
    return ROLE_FINAL_NORM, None
  return ROLE_METADATA, None


def stage_selects(name: str, layer_start: int, layer_end: int, *, embeddings: bool,
                  output: bool) -> bool:
  """Whether a fragment for layers [start, end) with flags E/O holds this tensor (§3)."""
  role, index = tensor_role(name)
  if role == ROLE_LAYER:
    return layer_start <= index < layer_end
  if role == ROLE_EMBEDDING:
    return embeddings
  if role in (ROLE_OUTPUT, ROLE_FINAL_NORM):
    return output
  return True
