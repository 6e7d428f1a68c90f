"""Schema v2 layer packages: the JSON root, its canonical identity, and the `Manifest` it gives.

A v2 root (docs/LAYER_PACKAGES.md §10) names an artifact catalog and a payload-free metadata
carrier (`carrier.py`); the tensors' roles, per-artifact counts and byte ranges come from the
carrier. Both together parse into the same `Manifest` as v1 (one payload artifact per layer; the
embeddings and output slots name the artifacts that own those tensors, which may be one common
artifact) with a tensor locator, so stage planning, streaming and strategy resolution do not
know which schema they read. Validation codes are upstream's
(`skippy-package-format`); the root and its generation block reject unknown fields.
"""

from __future__ import annotations

import copy
import hashlib
import json
import pathlib
import re

from mtpjax.package import carrier as carrier_lib, generation_rules, integrity, manifest_types
from mtpjax.package.issues import errors_of, is_blank, is_int, issue
from mtpjax.package.roles import ROLE_LAYER, tensor_role

SCHEMA_VERSION = 2
PACKAGE_ID_PREFIX = "sha256:"
SIDECAR_KIND = "mmproj"
_ROOT_REQUIRED = ("schema_version", "package_id", "model_id", "source_model", "format",
                  "layer_count", "artifact_catalog", "native_abi_version", "generator_version",
                  "created_at_unix_secs")
_ROOT_OPTIONAL = ("sidecars", "generation")
_DERIVED_FIELDS = ("model_metadata", "tensor_catalog")   # rebuilt from the carrier, never JSON
_SOURCE_REQUIRED = ("sha256", "metadata_artifact_id")
_SOURCE_OPTIONAL = ("repo", "revision", "primary_file", "canonical_ref", "distribution_id",
                    "files")
_FILE_FIELDS = ("path", "byte_size", "sha256")
_ARTIFACT_FIELDS = ("id", "path", "byte_size", "sha256")
_IDENTIFIER = re.compile(r"[A-Za-z0-9._-]+")
_LOWER_SHA256 = re.compile(r"[0-9a-f]{64}")
# generation is strict in v2: the fields each object may hold, per `type` where tagged
_WINDOW_FIELDS = {"default", "initial_window", "min_window", "max_window", "pipeline_depth"}
_EXTENSION_FIELDS = {"max_tokens", "initial_tokens", "tail_backoff_proposals"}
_NGRAM_PROPOSER_FIELDS = {"type", "ngram_min", "ngram_max", "max_proposal_tokens",
                          "history_scope"}
_PROPOSER_FIELDS = {"native-mtp": {"type", "prediction_depth", "layer_indices"},
                    "ngram-cache": _NGRAM_PROPOSER_FIELDS, "ngram-suffix": _NGRAM_PROPOSER_FIELDS}
_STRATEGY_FIELDS = {
    "native-mtp": {"type", "proposer", "prediction_depth", "layer_indices", "window_policy"},
    "ngram-cache": {"type", "proposer", "window_policy"},
    "ngram-suffix": {"type", "proposer", "window_policy"},
    "composite": {"type", "primary", "extender", "extension_policy", "window_policy"}}


def _text(value: object) -> str | None:
  """A JSON string, else None: hostile roots put lists and objects where ids and paths go."""
  return value if isinstance(value, str) else None


def _unknown(body: dict, allowed, where: str) -> list[dict]:
  return [issue("unknown_field", f"{where}: unknown field {key!r} (schema v2 rejects unknown "
                "fields)", path=f"{where}.{key}") for key in body if key not in allowed]


def _digest_issue(value: object, where: str) -> list[dict]:
  if isinstance(value, str) and _LOWER_SHA256.fullmatch(value):
    return []
  return [issue("invalid_digest", f"{where}: digest must contain 64 lowercase hexadecimal "
                "characters", path=where)]


def _path_issue(value: object, where: str, root: pathlib.Path | None) -> list[dict]:
  reason = integrity.unsafe_path_reason(value)
  if reason is None and value.endswith("/"):
    reason = "it ends in '/'"
  if reason is None and root is not None:
    reason = integrity.escape_reason(root, value)
  if reason is None:
    return []
  return [issue("invalid_path", f"{where}: path {value!r} must be a normalized relative package "
                f"path ({reason})", path=where)]


def _object_issues(body: object, where: str, required, optional=()) -> list[dict]:
  """Present and typed as an object, every required field there, no unknown field."""
  if not isinstance(body, dict):
    return [issue("invalid_field_type", f"{where} must be an object", path=where)]
  found = [issue("missing_value", f"{where}.{key} is required", path=f"{where}.{key}")
           for key in required if key not in body]
  return found + _unknown(body, (*required, *optional), where)


def _count_issue(value: object, where: str, minimum: int) -> list[dict]:
  if is_int(value) and value >= minimum:
    return []
  return [issue("invalid_field_type", f"{where} must be an integer >= {minimum}, got {value!r}",
                path=where)]


def _catalog_issues(catalog: object, root: pathlib.Path | None) -> list[dict]:
  found = _object_issues(catalog, "artifact_catalog", ("entries",))
  entries = catalog.get("entries") if isinstance(catalog, dict) else None
  if not isinstance(entries, list) or not entries:
    return found + [issue("missing_value", "artifact_catalog.entries: artifact catalog must not "
                          "be empty", path="artifact_catalog.entries")]
  ids, paths = set(), set()
  for index, entry in enumerate(entries):
    where = f"artifact_catalog.entries[{index}]"
    found.extend(_object_issues(entry, where, _ARTIFACT_FIELDS))
    if not isinstance(entry, dict):
      continue
    artifact_id, path = _text(entry.get("id")), _text(entry.get("path"))
    if not isinstance(artifact_id, str) or not _IDENTIFIER.fullmatch(artifact_id):
      found.append(issue("invalid_identifier", f"{where}.id: identifier {artifact_id!r} contains "
                         "unsupported characters", path=f"{where}.id"))
    elif artifact_id in ids:
      found.append(issue("duplicate_artifact", f"{where}.id: artifact id {artifact_id!r} appears "
                         "more than once", path=f"{where}.id"))
    ids.add(artifact_id)
    found.extend(_path_issue(path, f"{where}.path", root))
    if path is not None and path in paths:
      found.append(issue("duplicate_artifact_path", f"{where}.path: artifact path {path!r} "
                         "appears more than once", path=f"{where}.path"))
    paths.add(path)
    found.extend(_count_issue(entry.get("byte_size"), f"{where}.byte_size", 1))
    found.extend(_digest_issue(entry.get("sha256"), f"{where}.sha256"))
  return found


def _artifacts_by_id(raw: dict) -> dict[str, dict]:
  catalog = raw.get("artifact_catalog")
  entries = catalog.get("entries") if isinstance(catalog, dict) else None
  return {entry["id"]: entry for entry in (entries if isinstance(entries, list) else ())
          if isinstance(entry, dict) and isinstance(entry.get("id"), str)}


def _source_issues(source: object, artifacts: dict[str, dict], sidecar_ids: set) -> list[dict]:
  found = _object_issues(source, "source_model", _SOURCE_REQUIRED, _SOURCE_OPTIONAL)
  if not isinstance(source, dict):
    return found
  found.extend(_digest_issue(source.get("sha256"), "source_model.sha256"))
  for name in _SOURCE_OPTIONAL[:-1]:
    if name in source and is_blank(source[name]):
      found.append(issue("missing_value", f"source_model.{name} must not be empty",
                         path=f"source_model.{name}"))
  files = source.get("files")
  if not isinstance(files, list) or not files:
    found.append(issue("missing_value", "source_model.files: source file inventory must not be "
                       "empty", path="source_model.files"))
    files = []
  digests = {}
  for index, entry in enumerate(files):
    where = f"source_model.files[{index}]"
    found.extend(_object_issues(entry, where, _FILE_FIELDS))
    if not isinstance(entry, dict):
      continue
    found.extend(_path_issue(entry.get("path"), f"{where}.path", None))
    found.extend(_count_issue(entry.get("byte_size"), f"{where}.byte_size", 0))
    found.extend(_digest_issue(entry.get("sha256"), f"{where}.sha256"))
    path = _text(entry.get("path"))
    if path in digests:
      found.append(issue("invalid_path", f"{where}.path: source file path {path!r} appears more "
                         "than once", path=f"{where}.path"))
    digests[path] = entry.get("sha256")
  primary = source.get("primary_file")
  if primary is not None and _text(primary) is None:
    found.append(issue("invalid_field_type", "source_model.primary_file must be a string",
                       path="source_model.primary_file"))
    primary = None
  if primary is None:
    found.append(issue("missing_value", "source_model.primary_file: primary source file is "
                       "required", path="source_model.primary_file"))
  elif primary not in digests:
    found.append(issue("unknown_source_file", f"source_model.primary_file: primary file "
                       f"{primary!r} is absent from source files", path="source_model.primary_file"))
  elif digests[primary] != source.get("sha256"):
    found.append(issue("source_identity_mismatch", "source_model.sha256: source model digest does "
                       "not match the primary source file", path="source_model.sha256"))
  carrier_id = _text(source.get("metadata_artifact_id"))
  where = "source_model.metadata_artifact_id"
  if is_blank(carrier_id):
    found.append(issue("missing_value", f"{where} must not be empty", path=where))
  elif carrier_id not in artifacts:
    found.append(issue("unknown_artifact", f"{where}: metadata artifact {carrier_id!r} is absent "
                       "from artifact catalog", path=where))
  else:
    if not str(artifacts[carrier_id].get("path", "")).endswith(".gguf"):
      found.append(issue("invalid_metadata_artifact", f"{where}: metadata artifact "
                         f"{carrier_id!r} is not a GGUF artifact", path=where))
    if carrier_id in sidecar_ids:
      found.append(issue("invalid_metadata_artifact", f"{where}: metadata artifact "
                         f"{carrier_id!r} has a sidecar role", path=where))
  return found


def _sidecar_issues(sidecars: object, artifacts: dict[str, dict]) -> list[dict]:
  if sidecars is None:
    return []
  if not isinstance(sidecars, list):
    return [issue("invalid_field_type", "sidecars must be an array", path="sidecars")]
  found, seen = [], set()
  for index, entry in enumerate(sidecars):
    where = f"sidecars[{index}]"
    found.extend(_object_issues(entry, where, ("kind", "artifact_id"), ("name",)))
    if not isinstance(entry, dict):
      continue
    if entry.get("kind") != SIDECAR_KIND:
      found.append(issue("unsupported_projector_kind", f"{where}.kind: unsupported sidecar kind "
                         f"{entry.get('kind')!r} (only {SIDECAR_KIND!r})", path=f"{where}.kind"))
    if _text(entry.get("artifact_id")) not in artifacts:
      found.append(issue("unknown_artifact", f"{where}.artifact_id: artifact "
                         f"{entry.get('artifact_id')!r} does not exist", path=f"{where}.artifact_id"))
    if "name" in entry and is_blank(entry["name"]):
      found.append(issue("missing_value", f"{where}.name must not be empty", path=f"{where}.name"))
    identity = (str(entry.get("kind")), str(entry.get("name")))
    if identity in seen:
      found.append(issue("duplicate_sidecar", f"{where}: sidecar identity {identity} appears more "
                         "than once", path=where))
    seen.add(identity)
  return found


def _generation_strict_issues(generation: object) -> list[dict]:
  """The unknown-field and unknown-type rules v2 adds to the era-neutral generation rules."""
  found = _object_issues(generation, "generation", (), ("request_defaults",
                                                          "speculative_decoding"))
  speculative = generation.get("speculative_decoding") if isinstance(generation, dict) else None
  if not isinstance(speculative, dict):
    return found
  where = "generation.speculative_decoding"
  found.extend(_unknown(speculative, ("default", "proposers", "strategies"), where))
  for group, allowed in (("proposers", _PROPOSER_FIELDS), ("strategies", _STRATEGY_FIELDS)):
    members = speculative.get(group)
    for name, body in (members.items() if isinstance(members, dict) else ()):
      place = f"{where}.{group}.{name}"
      if not isinstance(body, dict):
        continue
      kind = _text(body.get("type"))
      if kind not in allowed:
        found.append(issue("invalid_generation_value", f"{place}: unknown type {kind!r} (schema "
                           f"v2 allows {', '.join(allowed)})", path=f"{place}.type"))
        continue
      found.extend(_unknown(body, allowed[kind], place))
      if isinstance(body.get("window_policy"), dict):
        found.extend(_unknown(body["window_policy"], _WINDOW_FIELDS, f"{place}.window_policy"))
      if isinstance(body.get("extension_policy"), dict):
        found.extend(_unknown(body["extension_policy"], _EXTENSION_FIELDS,
                              f"{place}.extension_policy"))
      inline = "prediction_depth" in body or "layer_indices" in body
      if group == "strategies" and kind == "native-mtp" and inline and "proposer" in body:
        found.append(issue("invalid_generation_value", f"{place}: a native-mtp strategy carries "
                           "either a proposer or inline prediction_depth/layer_indices, never "
                           "both", path=place))
  return found


# Field order of each object in upstream's schema (serde writes struct fields in declaration
# order and maps sorted by key), so the identity does not depend on how a copy of the root was
# re-serialised (a checkpoint record, an editor). `None`: a map, sorted.
_FIELD_ORDER = {
    "root": ("schema_version", "package_id", "model_id", "source_model", "format", "layer_count",
             "artifact_catalog", "sidecars", "generation", "native_abi_version",
             "generator_version", "created_at_unix_secs"),
    "source_model": ("sha256", "metadata_artifact_id", "repo", "revision", "primary_file",
                     "canonical_ref", "distribution_id", "files"),
    "file": _FILE_FIELDS, "artifact": _ARTIFACT_FIELDS, "artifact_catalog": ("entries",),
    "sidecar": ("kind", "artifact_id", "name"),
    "generation": ("request_defaults", "speculative_decoding"),
    "speculative_decoding": ("default", "proposers", "strategies"),
    "proposer": ("type", "prediction_depth", "layer_indices", "ngram_min", "ngram_max",
                 "max_proposal_tokens", "history_scope"),
    "strategy": ("type", "proposer", "prediction_depth", "layer_indices", "primary", "extender",
                 "extension_policy", "window_policy"),
    "window_policy": ("default", "initial_window", "min_window", "max_window", "pipeline_depth"),
    "extension_policy": ("max_tokens", "initial_tokens", "tail_backoff_proposals"),
    "request_defaults": ("selection", "profiles"),
    "selection": ("default", "reasoning_enabled", "reasoning_disabled"),
    "profile": ("max_tokens", "stop", "temperature", "top_p", "top_k", "min_p", "typical_p",
                "top_nsigma", "presence_penalty", "frequency_penalty", "seed", "logit_bias",
                "repeat_penalty", "repeat_last_n", "dynatemp_range", "dynatemp_exponent", "dry",
                "xtc", "mirostat_mode", "mirostat_entropy", "mirostat_learning_rate",
                "samplers", "sampler_sequence", "ignore_eos", "reasoning", "provenance"),
    "dry": ("multiplier", "base", "allowed_length", "penalty_last_n", "sequence_breakers"),
    "xtc": ("probability", "threshold"), "reasoning": ("enabled", "format", "budget"),
    "provenance": ("source_repo", "revision", "file", "section", "url"),
}
# what each field of an object holds: an object kind, or ("list"/"map", the element's kind)
_CHILDREN = {
    ("root", "source_model"): "source_model", ("root", "artifact_catalog"): "artifact_catalog",
    ("root", "sidecars"): ("list", "sidecar"), ("root", "generation"): "generation",
    ("source_model", "files"): ("list", "file"),
    ("artifact_catalog", "entries"): ("list", "artifact"),
    ("generation", "request_defaults"): "request_defaults",
    ("generation", "speculative_decoding"): "speculative_decoding",
    ("speculative_decoding", "proposers"): ("map", "proposer"),
    ("speculative_decoding", "strategies"): ("map", "strategy"),
    ("strategy", "window_policy"): "window_policy",
    ("strategy", "extension_policy"): "extension_policy",
    ("request_defaults", "selection"): "selection",
    ("request_defaults", "profiles"): ("map", "profile"),
    ("profile", "logit_bias"): ("map", None), ("profile", "dry"): "dry", ("profile", "xtc"): "xtc",
    ("profile", "reasoning"): "reasoning", ("profile", "provenance"): "provenance",
}


def _in_schema_order(value, kind):
  if kind is None or not isinstance(value, dict):
    return value
  order = _FIELD_ORDER[kind]
  ordered = {}
  for key in sorted(value, key=lambda key: (order.index(key) if key in order else len(order),
                                             key)):
    child = _CHILDREN.get((kind, key))
    item = value[key]
    if isinstance(child, tuple) and child[0] == "list" and isinstance(item, list):
      item = [_in_schema_order(element, child[1]) for element in item]
    elif isinstance(child, tuple) and isinstance(item, dict):
      item = {name: _in_schema_order(item[name], child[1]) for name in sorted(item)}
    elif isinstance(child, str):
      item = _in_schema_order(item, child)
    ordered[key] = item
  return ordered


def canonical_package_id(raw: dict) -> str:
  """`sha256:` + SHA-256 of the root with `package_id` blank, `created_at_unix_secs` 0, source
  files sorted by path, artifacts by id and sidecars by (kind, name, artifact_id), serialised
  compactly with every object's fields in the schema's order and maps sorted by key (what
  upstream's serde serialisation gives)."""
  normal = copy.deepcopy(raw)
  normal["package_id"] = ""
  normal["created_at_unix_secs"] = 0
  normal["source_model"]["files"].sort(key=lambda entry: entry["path"])
  normal["artifact_catalog"]["entries"].sort(key=lambda entry: entry["id"])
  if "sidecars" in normal:
    normal["sidecars"].sort(key=lambda entry: (entry["kind"], "name" in entry,
                                               entry.get("name", ""), entry["artifact_id"]))
  text = json.dumps(_in_schema_order(normal, "root"), separators=(",", ":"), ensure_ascii=False)
  return PACKAGE_ID_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()


def root_issues(raw: dict, package_root: pathlib.Path | None = None) -> list[dict]:
  """Every problem of a v2 root, before its carrier is opened."""
  found = _object_issues(raw, "root", _ROOT_REQUIRED, (*_ROOT_OPTIONAL, *_DERIVED_FIELDS))
  found.extend(issue("unknown_field", f"{field} is rebuilt from the metadata carrier and must not "
                     "appear in model-package.json", path=field)
               for field in _DERIVED_FIELDS if field in raw)
  for field in ("model_id", "format", "native_abi_version", "generator_version"):
    if field in raw and is_blank(raw[field]):
      found.append(issue("missing_value", f"{field} must not be empty", path=field))
  layer_count = raw.get("layer_count")
  found.extend(_count_issue(layer_count, "layer_count", 1))
  found.extend(_count_issue(raw.get("created_at_unix_secs", 0), "created_at_unix_secs", 0))
  package_id = raw.get("package_id")
  if not isinstance(package_id, str) or not package_id.startswith(PACKAGE_ID_PREFIX):
    found.append(issue("invalid_digest", "package_id: digest must use the sha256:<hex> form",
                       path="package_id"))
  else:
    found.extend(_digest_issue(package_id[len(PACKAGE_ID_PREFIX):], "package_id"))
  found.extend(_catalog_issues(raw.get("artifact_catalog"), package_root))
  artifacts = _artifacts_by_id(raw)
  sidecars = raw.get("sidecars")
  sidecar_ids = {_text(entry.get("artifact_id")) for entry in sidecars or ()
                 if isinstance(entry, dict)} if isinstance(sidecars, list) else set()
  found.extend(_source_issues(raw.get("source_model"), artifacts, sidecar_ids))
  found.extend(_sidecar_issues(sidecars, artifacts))
  if raw.get("generation") is not None:
    found.extend(_generation_strict_issues(raw["generation"]))
    found.extend(generation_rules.generation_issues(
        raw["generation"], layer_count if is_int(layer_count) else None))
  if not errors_of(found):
    expected = canonical_package_id(raw)
    if package_id != expected:
      found.append(issue("package_identity_mismatch", f"package identity {package_id!r} does not "
                         f"match canonical identity {expected!r}", path="package_id"))
  return found


def payload_artifacts(raw: dict) -> list[carrier_lib.PayloadArtifact]:
  """Payload artifacts in part-index order: by id, without the carrier and the sidecars."""
  skip = {raw["source_model"]["metadata_artifact_id"]}
  skip |= {entry["artifact_id"] for entry in raw.get("sidecars") or ()}
  return [carrier_lib.PayloadArtifact(id=entry["id"], path=entry["path"],
                                      byte_size=entry["byte_size"])
          for entry in sorted(raw["artifact_catalog"]["entries"], key=lambda item: item["id"])
          if entry["id"] not in skip]


def _part_label(payload: carrier_lib.PayloadArtifact, roles: set) -> str | None:
  """A payload's part label from the roles of the tensors it owns: `layer:i` when they all
  belong to layer i, `shared:<id>` when none is a layer tensor (embeddings, output, norms and
  model-wide tensors, together or apart), None for a mix mtpjax does not stage."""
  layers = {index for role, index in roles if role == ROLE_LAYER}
  if not layers:
    return f"shared:{payload.id}"
  if len(layers) == 1 and all(role == ROLE_LAYER for role, _ in roles):
    return f"layer:{layers.pop()}"
  return None


def resolve(raw: dict, package_root: pathlib.Path) -> tuple[manifest_types.Manifest | None,
                                                            list[dict]]:
  """(the Manifest, []) for a valid root (`root_issues` empty) and carrier, else (None, issues).

  The carrier is read and verified here; payload artifacts are only size- and hash-checked
  when the reader opens them.
  """
  artifacts = _artifacts_by_id(raw)
  source = raw["source_model"]
  carrier_entry = artifacts[source["metadata_artifact_id"]]
  payloads = payload_artifacts(raw)
  if not payloads:
    return None, [issue("missing_value", "package root has no payload artifacts",
                        path="artifact_catalog.entries")]
  carrier, found = carrier_lib.read_carrier(
      package_root, carrier_entry["path"], byte_size=carrier_entry["byte_size"],
      sha256=carrier_entry["sha256"], payloads=payloads, layer_count=raw["layer_count"])
  if carrier is None:
    return None, found
  roles: dict[int, set] = {part: set() for part in range(len(payloads))}
  for tensor in carrier.tensors:
    roles[tensor.part].add(tensor_role(tensor.name))
  labels = {}
  for part, payload in enumerate(payloads):
    label = _part_label(payload, roles[part])
    if label is None or label in labels.values():
      found.append(issue("unsupported_artifact_layout", f"payload artifact {payload.id!r} "
                         f"({payload.path}) owns tensors of {sorted(map(str, roles[part]))}; "
                         "mtpjax stages v2 packages whose payload artifacts each hold one layer "
                         "or no layer at all", path=payload.path))
    labels[part] = label
  missing = sorted(set(range(raw["layer_count"])) - {
      int(label.split(":")[1]) for label in labels.values() if label and label[:6] == "layer:"})
  found.extend(issue("missing_layer", f"package is missing layer {index}: no payload artifact "
                     "owns its tensors") for index in missing[:16])
  if not any(label and label.startswith("shared:") for label in labels.values()):
    found.append(issue("missing_artifact", "package has no payload artifact for the "
                       "embeddings and output tensors"))
  if errors_of(found):
    return None, found
  return _manifest(raw, carrier, payloads, labels), []


def _carrier_artifact(raw: dict) -> manifest_types.Artifact:
  entry = _artifacts_by_id(raw)[raw["source_model"]["metadata_artifact_id"]]
  return manifest_types.Artifact(role="metadata", path=entry["path"], tensor_count=0,
                                 tensor_bytes=0, artifact_bytes=entry["byte_size"],
                                 sha256=entry["sha256"])


def _root_fields(raw: dict) -> dict:
  """The Manifest fields a valid root gives by itself (identity, source, generation)."""
  source = raw["source_model"]
  generation = raw.get("generation")
  return dict(
      schema_version=SCHEMA_VERSION, model_id=raw["model_id"],
      source_model=manifest_types.SourceModel(
          path=source["primary_file"], sha256=source["sha256"], repo=source.get("repo"),
          revision=source.get("revision"), primary_file=source["primary_file"],
          canonical_ref=source.get("canonical_ref"),
          distribution_id=source.get("distribution_id"),
          files=tuple(manifest_types.SourceFile(path=entry["path"], size_bytes=entry["byte_size"],
                                                sha256=entry["sha256"])
                      for entry in source["files"])),
      format=raw["format"], layer_count=raw["layer_count"], activation_width=None,
      skippy_abi_version=raw["native_abi_version"],
      generation=None if generation is None else manifest_types.Generation(
          speculative_decoding=manifest_types.parse_speculative(
              generation.get("speculative_decoding"))),
      created_at_unix_secs=raw["created_at_unix_secs"], raw=raw, package_id=raw["package_id"])


def root_manifest(raw: dict) -> manifest_types.Manifest:
  """A valid root read without its package (a converted checkpoint's record): identity,
  source and generation only. The artifact slots are not resolved (`layers` is empty, the
  other slots name the carrier), so it can resolve strategies but never open tensors."""
  carrier = _carrier_artifact(raw)
  return manifest_types.Manifest(shared_metadata=carrier, shared_embeddings=carrier,
                                 shared_output=carrier, layers=(), **_root_fields(raw))


def _manifest(raw: dict, carrier: carrier_lib.Carrier, payloads: list[carrier_lib.PayloadArtifact],
              labels: dict[int, str]) -> manifest_types.Manifest:
  locator = {tensor.name: manifest_types.TensorLocation(
      label=labels[tensor.part], start=tensor.start, n_bytes=tensor.n_bytes,
      alignment=tensor.alignment, ggml_type=tensor.ggml_type, ne=tensor.ne)
      for tensor in carrier.tensors}
  artifacts = _artifacts_by_id(raw)
  parts = []
  for part, payload in enumerate(payloads):
    label = labels[part]
    stored = [tensor.n_bytes for tensor in carrier.tensors if tensor.part == part]
    layer = label.startswith("layer:")
    parts.append(manifest_types.Artifact(
        role="layer" if layer else "shared", path=payload.path, tensor_count=len(stored),
        tensor_bytes=sum(stored), artifact_bytes=payload.byte_size,
        sha256=artifacts[payload.id]["sha256"],
        layer_index=int(label.split(":")[1]) if layer else None, label=label))
  by_label = {artifact.label: artifact for artifact in parts}
  shared = [artifact for artifact in parts if artifact.role == "shared"]

  def holder(names: tuple[str, ...]) -> manifest_types.Artifact:
    labels_held = [locator[name].label for name in names if name in locator]
    return by_label[labels_held[0]] if labels_held else shared[0]

  projectors = tuple(manifest_types.Artifact(
      role="projector", path=artifacts[entry["artifact_id"]]["path"], tensor_count=0,
      tensor_bytes=0, artifact_bytes=artifacts[entry["artifact_id"]]["byte_size"],
      sha256=artifacts[entry["artifact_id"]]["sha256"], kind=entry["kind"])
      for entry in raw.get("sidecars") or ())
  return manifest_types.Manifest(
      shared_metadata=_carrier_artifact(raw),
      shared_embeddings=holder(("token_embd.weight",)),
      shared_output=holder(("output_norm.weight", "output.weight")),
      layers=tuple(by_label[f"layer:{i}"] for i in range(raw["layer_count"])),
      projectors=projectors, tensor_locator=locator, carrier_key_values=carrier.key_values,
      payloads=tuple(parts), **_root_fields(raw))
