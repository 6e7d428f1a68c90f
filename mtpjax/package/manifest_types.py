"""The typed description of a layer package that every manifest schema parses into.

Stage planning, tensor streaming and strategy resolution read only these types, so a v1
manifest and a v2 root plus its metadata carrier (docs/LAYER_PACKAGES.md §2, §10) load the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mtpjax.package import generation_rules

NATIVE_MTP_TYPE = generation_rules.NATIVE_MTP_TYPE


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
  """One GGUF fragment: `shared.*`, `layers[]` or `projectors[]` (v1), or one v2 catalog
  artifact (the carrier, a payload or a sidecar)."""
  role: str                    # "metadata" | "embeddings" | "output" | "layer" | "projector"
                               # | "shared" (a v2 payload that is no layer: common tensors)
  path: str
  tensor_count: int
  tensor_bytes: int
  artifact_bytes: int
  sha256: str
  layer_index: int | None = None
  kind: str | None = None      # projectors only: "mmproj"
  label: str | None = None     # v2 payloads: the reader's part label ("layer:3", "shared:<id>")


@dataclasses.dataclass(frozen=True)
class WindowPolicy:
  default: str
  initial_window: int
  min_window: int
  max_window: int
  pipeline_depth: int | None = None      # newer packages: verify windows in flight


@dataclasses.dataclass(frozen=True)
class ExtensionPolicy:
  """How far a composite's n-gram extender continues the primary's draft, and when it backs off
  (older writers always wrote all three fields, newer ones only `max_tokens`)."""
  max_tokens: int
  initial_tokens: int | None = None
  tail_backoff_proposals: int | None = None


@dataclasses.dataclass(frozen=True)
class Strategy:
  """One package strategy, whichever era's form declared it.

  `prediction_depth` and `layer_indices` describe its native-MTP drafting: inline, taken from
  its `proposer`, or from a composite's `primary`; they stay empty for n-gram strategies. A type
  mtpjax does not know keeps only its name and type (`known` is False): its fields are ignored.
  """
  name: str
  type: str
  prediction_depth: int | None = None
  layer_indices: tuple[int, ...] = ()
  window_policy: WindowPolicy | None = None
  proposer: str | None = None
  primary: str | None = None
  extender: str | None = None
  extension_policy: ExtensionPolicy | None = None

  @property
  def known(self) -> bool:
    return self.type in generation_rules.STRATEGY_TYPES

  @property
  def uses_native_mtp(self) -> bool:
    """True when the NextN head drafts (alone, or as a composite's primary)."""
    return self.type in (NATIVE_MTP_TYPE, generation_rules.COMPOSITE_TYPE)


@dataclasses.dataclass(frozen=True)
class Proposer:
  name: str
  type: str
  prediction_depth: int | None = None
  layer_indices: tuple[int, ...] = ()
  ngram_min: int | None = None
  ngram_max: int | None = None
  max_proposal_tokens: int | None = None
  history_scope: str | None = None


@dataclasses.dataclass(frozen=True)
class SpeculativeDecoding:
  default: str
  strategies: dict[str, Strategy]
  proposers: dict[str, Proposer] = dataclasses.field(default_factory=dict)

  def ngram_proposer(self, strategy: Strategy) -> Proposer | None:
    """The n-gram proposer a strategy drafts with: its `proposer` for an n-gram type, its
    `extender` for a composite; None for native MTP alone and for unknown types."""
    if strategy.type in generation_rules.NGRAM_TYPES:
      return self.proposers.get(strategy.proposer)
    if strategy.type == generation_rules.COMPOSITE_TYPE:
      return self.proposers.get(strategy.extender)
    return None


@dataclasses.dataclass(frozen=True)
class Generation:
  speculative_decoding: SpeculativeDecoding | None = None


@dataclasses.dataclass(frozen=True)
class TensorLocation:
  """Where a v2 package stores one tensor: a byte range of one payload artifact (its label in
  the reader: "layer:3" or "shared:<artifact id>"), as the metadata carrier's locator says."""
  label: str
  start: int                  # absolute offset in the artifact file
  n_bytes: int
  alignment: int
  ggml_type: int
  ne: tuple[int, ...]


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
  # schema v2 only: the canonical identity, and what the metadata carrier holds (its key/values
  # feed the model configuration; the locator says where each tensor's bytes are)
  package_id: str | None = None
  payloads: tuple[Artifact, ...] = ()   # v2: every payload artifact, in part-index order
  tensor_locator: dict[str, TensorLocation] | None = dataclasses.field(
      default=None, compare=False, repr=False)
  carrier_key_values: tuple[Any, ...] = dataclasses.field(default=(), compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class HfReference:
  repo: str                  # "namespace/repo"
  revision: str | None = None


def _window_policy(policy: dict | None) -> WindowPolicy | None:
  if policy is None:
    return None
  return WindowPolicy(default=policy["default"], initial_window=policy["initial_window"],
                      min_window=policy["min_window"], max_window=policy["max_window"],
                      pipeline_depth=policy.get("pipeline_depth"))


def _proposer(name: str, body: dict) -> Proposer:
  """A validated proposer; only the fields its type defines are read (the others are unchecked)."""
  kind = body["type"]
  if kind == NATIVE_MTP_TYPE:
    return Proposer(name=name, type=kind, prediction_depth=body["prediction_depth"],
                    layer_indices=tuple(body["layer_indices"]))
  if kind not in generation_rules.NGRAM_TYPES:
    return Proposer(name=name, type=kind)
  scope = body.get("history_scope")
  return Proposer(name=name, type=kind, ngram_min=body["ngram_min"], ngram_max=body["ngram_max"],
                  max_proposal_tokens=body["max_proposal_tokens"],
                  history_scope=scope if isinstance(scope, str) else None)


def _strategy(name: str, body: dict, proposers: dict[str, Proposer]) -> Strategy:
  """A validated strategy, its native-MTP depth and layers taken from wherever they live."""
  kind = body["type"]
  if kind not in generation_rules.STRATEGY_TYPES:
    return Strategy(name=name, type=kind)
  composite = kind == generation_rules.COMPOSITE_TYPE
  source = body["primary"] if composite else body.get("proposer")
  if source is not None:
    depth, layers = proposers[source].prediction_depth, proposers[source].layer_indices
  else:                                   # only native-mtp strategies are valid without one
    depth, layers = body["prediction_depth"], tuple(body["layer_indices"])
  extension = body.get("extension_policy")
  return Strategy(
      name=name, type=kind, prediction_depth=depth, layer_indices=layers,
      window_policy=_window_policy(body.get("window_policy")), proposer=body.get("proposer"),
      primary=body["primary"] if composite else None,
      extender=body["extender"] if composite else None,
      extension_policy=None if extension is None else ExtensionPolicy(
          max_tokens=extension["max_tokens"], initial_tokens=extension.get("initial_tokens"),
          tail_backoff_proposals=extension.get("tail_backoff_proposals")))


def parse_speculative(raw: dict | None) -> SpeculativeDecoding | None:
  if raw is None:
    return None
  proposers = {name: _proposer(name, body) for name, body in (raw.get("proposers") or {}).items()}
  strategies = {name: _strategy(name, body, proposers)
                for name, body in (raw.get("strategies") or {}).items()}
  return SpeculativeDecoding(default=raw["default"], strategies=strategies, proposers=proposers)
