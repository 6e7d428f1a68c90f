"""The v1 layer-package manifest (`model-package.json`) as typed dataclasses.

Parsing and validation live here too (see ../shared/design/LAYER_PACKAGES.md §2, §5).
"""

from __future__ import annotations

import dataclasses
from typing import Any

PACKAGE_ABI_VERSION = (0, 1, 0)
MANIFEST_NAME = "model-package.json"
FORMAT = "layer-package"


@dataclasses.dataclass(frozen=True)
class SourceFile:
  path: str
  size_bytes: int | None = None
  sha256: str | None = None


@dataclasses.dataclass(frozen=True)
class SourceModel:
  path: str
  sha256: str
  repo: str | None = None
  revision: str | None = None
  primary_file: str | None = None
  canonical_ref: str | None = None
  distribution_id: str | None = None
  files: tuple[SourceFile, ...] = ()


@dataclasses.dataclass(frozen=True)
class Artifact:
  """One GGUF fragment: `shared.*`, `layers[]` or `projectors[]`."""
  role: str                    # "metadata" | "embeddings" | "output" | "layer" | "projector"
  path: str
  tensor_count: int
  tensor_bytes: int
  artifact_bytes: int
  sha256: str
  layer_index: int | None = None
  kind: str | None = None      # projectors only: "mmproj"


@dataclasses.dataclass(frozen=True)
class WindowPolicy:
  default: str
  initial_window: int
  min_window: int
  max_window: int


@dataclasses.dataclass(frozen=True)
class Strategy:
  name: str
  type: str
  prediction_depth: int | None = None
  layer_indices: tuple[int, ...] = ()
  window_policy: WindowPolicy | None = None
  proposer: str | None = None


@dataclasses.dataclass(frozen=True)
class Proposer:
  name: str
  type: str
  prediction_depth: int | None = None
  layer_indices: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class SpeculativeDecoding:
  default: str
  strategies: dict[str, Strategy]
  proposers: dict[str, Proposer] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Generation:
  speculative_decoding: SpeculativeDecoding | None = None


@dataclasses.dataclass(frozen=True)
class Manifest:
  schema_version: int
  model_id: str
  source_model: SourceModel
  format: str
  layer_count: int
  activation_width: int | None
  shared_metadata: Artifact
  shared_embeddings: Artifact
  shared_output: Artifact
  layers: tuple[Artifact, ...]          # sorted by layer_index
  skippy_abi_version: str
  generation: Generation | None = None
  projectors: tuple[Artifact, ...] = ()
  created_at_unix_secs: int | None = None
  raw: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
