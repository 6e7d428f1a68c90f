"""The layer-package manifest (`model-package.json`): validation and parsing, every schema.

v1 is validated and parsed here (docs/LAYER_PACKAGES.md §2, §5); a v2 root and its metadata carrier
(§10) go to `manifest_v2`, dispatched on `schema_version` in `manifest_issues` and
`parse_manifest` only. Both give the same `Manifest` (`manifest_types`).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re

from mtpjax import errors
from mtpjax.package import generation_rules, integrity, manifest_types, manifest_v2
# The types live in manifest_types (both schemas build them); callers keep reading them here.
from mtpjax.package.manifest_types import (  # noqa: F401
    Artifact, ExtensionPolicy, Generation, HfReference, Manifest, Proposer, SourceFile,
    SourceModel, SpeculativeDecoding, Strategy, TensorLocation, WindowPolicy)
from mtpjax.package.issues import WARNING, errors_of, is_blank, is_int, issue

PACKAGE_ABI_VERSION = (0, 1, 0)
MANIFEST_NAME = "model-package.json"
FORMAT = "layer-package"
SHARED_ROLES = ("metadata", "embeddings", "output")
NATIVE_MTP_TYPE = manifest_types.NATIVE_MTP_TYPE
PROJECTOR_KIND = "mmproj"
HF_SCHEME = "hf://"


# --- ABI (§2.6) -------------------------------------------------------------------------------

_ABI_PART = re.compile(r"[0-9]+")
_ABI_REMEDY = "upgrade mtpjax or re-split the GGUF with `python -m mtpjax.package.split`"


def parse_abi_version(text: object) -> tuple[int, int, int]:
  """`"MAJ.MIN[.PATCH]"` of decimal integers; PATCH defaults to 0. Raises AbiError."""
  if not isinstance(text, str) or not text.strip():
    raise errors.AbiError("package ABI version must not be empty", field="skippy_abi_version",
                          remedy=_ABI_REMEDY)
  parts = text.strip().split(".")
  if len(parts) < 2:
    raise errors.AbiError(f"package ABI version is missing a minor version: {text!r}",
                          field="skippy_abi_version", remedy=_ABI_REMEDY)
  if len(parts) > 3 or not all(_ABI_PART.fullmatch(part) for part in parts):
    raise errors.AbiError(f"package ABI version {text!r} must be MAJ.MIN[.PATCH] of decimal "
                          "integers", field="skippy_abi_version", remedy=_ABI_REMEDY)
  major, minor, patch = (int(part) for part in parts + ["0"] * (3 - len(parts)))
  return major, minor, patch


def check_abi_version(text: object) -> tuple[int, int, int]:
  """Parses and checks compatibility: same major and a minor no newer than ours."""
  version = parse_abi_version(text)
  if version[0] != PACKAGE_ABI_VERSION[0] or version[1] > PACKAGE_ABI_VERSION[1]:
    runtime = ".".join(str(part) for part in PACKAGE_ABI_VERSION)
    raise errors.AbiError(f"package ABI version {text} is not compatible with runtime ABI "
                          f"{runtime}", field="skippy_abi_version", remedy=_ABI_REMEDY)
  return version


# --- validation: the one issue list (§2-§5, §7) ---------------------------------------------

_IDENTITY_FIELDS = ("repo", "revision", "primary_file", "canonical_ref", "distribution_id")
_MAX_LISTED_MISSING_LAYERS = 16
U32_MAX = 2**32 - 1


def _artifact_issues(entry: object, role: str, where: str,
                     package_root: pathlib.Path | None) -> list[dict]:
  """Rules of §2.3/§2.4 for one artifact entry; `where` locates it in the manifest."""
  if not isinstance(entry, dict):
    return [issue("missing_artifact", f"package manifest {where} must be an artifact object")]
  found = []
  path = entry.get("path")
  shown_path = path if isinstance(path, str) else None
  reason = integrity.unsafe_path_reason(path)
  if reason is None and package_root is not None:
    reason = integrity.escape_reason(package_root, path)
  if reason is not None:
    found.append(issue("unsafe_artifact_path", integrity.unsafe_path_message(role, path, reason),
                       path=shown_path))
  tensor_count, tensor_bytes = entry.get("tensor_count"), entry.get("tensor_bytes")
  if not is_int(tensor_count) or tensor_count < 0:
    found.append(issue("invalid_tensor_bytes",
                       f"package {role} tensor_count must be a non-negative integer",
                       path=shown_path))
  if not is_int(tensor_bytes) or tensor_bytes < 0:
    found.append(issue("invalid_tensor_bytes",
                       f"package {role} tensor_bytes must be a non-negative integer",
                       path=shown_path))
  elif is_int(tensor_count) and tensor_count == 0 and tensor_bytes != 0:
    found.append(issue("invalid_tensor_bytes",
                       f"package {role} tensor_bytes must be zero when tensor_count is zero",
                       path=shown_path))
  elif is_int(tensor_count) and tensor_count > 0 and tensor_bytes == 0:
    found.append(issue("invalid_tensor_bytes",
                       f"package {role} tensor_bytes must be greater than zero when tensors are "
                       "present", path=shown_path))
  artifact_bytes = entry.get("artifact_bytes")
  if not is_int(artifact_bytes) or artifact_bytes <= 0:
    found.append(issue("empty_artifact", f"package {role} artifact_bytes must be greater than zero",
                       path=shown_path))
  if not integrity.is_hex_sha256(entry.get("sha256")):
    found.append(issue("invalid_artifact_sha256",
                       f"package {role} sha256 must be a hex SHA-256 digest", path=shown_path))
  return found


def _source_model_issues(source: object) -> list[dict]:
  if not isinstance(source, dict):
    return [issue("empty_source_model_path",
                  "package manifest source_model must be an object with path and sha256")]
  found = []
  if is_blank(source.get("path")):
    found.append(issue("empty_source_model_path",
                       "package manifest source_model path must not be empty"))
  if not integrity.is_hex_sha256(source.get("sha256")):
    found.append(issue("invalid_source_model_sha256",
                       "source_model sha256 must be a hex SHA-256 digest"))
  for name in _IDENTITY_FIELDS:
    if source.get(name) is not None and is_blank(source[name]):
      found.append(issue("empty_source_model_identity",
                         "package manifest source_model identity fields must not be empty "
                         f"(source_model.{name})"))
  files = source.get("files") or []
  if not isinstance(files, list):
    return found + [issue("invalid_source_model_file", "source_model files must be an array")]
  for position, entry in enumerate(files):
    where = f"source_model.files[{position}]"
    if not isinstance(entry, dict) or is_blank(entry.get("path")):
      found.append(issue("invalid_source_model_file",
                         f"source_model file path must not be empty ({where})"))
      continue
    if entry.get("sha256") is not None and not integrity.is_hex_sha256(entry["sha256"]):
      found.append(issue("invalid_source_model_file",
                         f"source_model file sha256 must be a hex SHA-256 digest ({where})"))
    size = entry.get("size_bytes")
    if size is not None and (not is_int(size) or size < 0):
      found.append(issue("invalid_source_model_file",
                         f"source_model file size_bytes must be a non-negative integer ({where})"))
  return found


def _layers_issues(layers: object, layer_count: int | None,
                   package_root: pathlib.Path | None) -> list[dict]:
  if not isinstance(layers, list):
    return [issue("missing_layer", "package manifest layers must be an array of artifact entries")]
  found = []
  counts: dict[int, int] = {}
  for position, entry in enumerate(layers):
    index = entry.get("layer_index") if isinstance(entry, dict) else None
    if not is_int(index) or index < 0:
      found.append(issue("layer_index_out_of_range",
                         f"package manifest layers[{position}].layer_index must be a non-negative "
                         "integer"))
      role = f"layers[{position}]"
    else:
      counts[index] = counts.get(index, 0) + 1
      role = f"layer {index}"
      if layer_count is not None and index >= layer_count:
        found.append(issue("layer_index_out_of_range",
                           f"package layer index {index} exceeds layer_count {layer_count}"))
    found.extend(_artifact_issues(entry, role, f"layers[{position}]", package_root))
  duplicates = sorted(index for index, count in counts.items() if count > 1)
  if duplicates:
    found.append(issue("duplicate_layer",
                       f"package manifest contains duplicate layers: {duplicates}"))
  if layer_count is not None:
    missing_total = layer_count - sum(1 for index in counts if index < layer_count)
    listed = 0
    index = 0
    while listed < min(missing_total, _MAX_LISTED_MISSING_LAYERS):
      if index not in counts:
        found.append(issue("missing_layer", f"package is missing layer {index}"))
        listed += 1
      index += 1
    if missing_total > listed:
      found.append(issue("missing_layer", f"package is missing {missing_total - listed} more "
                         f"layers after layer {index - 1}"))
  return found


def _projector_issues(projectors: object, package_root: pathlib.Path | None) -> list[dict]:
  if projectors is None:
    return []
  if not isinstance(projectors, list):
    return [issue("unsupported_projector_kind", "package manifest projectors must be an array")]
  found = []
  for position, entry in enumerate(projectors):
    kind = entry.get("kind") if isinstance(entry, dict) else None
    if is_blank(kind):
      found.append(issue("empty_projector_kind", "package projector kind must not be empty"))
    elif kind != PROJECTOR_KIND:
      found.append(issue("unsupported_projector_kind",
                         f"unsupported package projector kind {kind}"))
    found.extend(_artifact_issues(entry, "mmproj projector", f"projectors[{position}]",
                                  package_root))
  return found


def manifest_issues(raw: object, package_root: pathlib.Path | None = None) -> list[dict]:
  """Every problem of a manifest, as preflight issues (errors and warnings); for v2 with
  `package_root`, its metadata carrier's too.

  With `package_root`, artifact paths are also resolved against it so that a symlink leaving the
  package is caught. File presence, sizes and hashes are checked by `integrity.inspect_part`.
  """
  if not isinstance(raw, dict):
    return [issue("invalid_manifest_json", "package manifest must be a JSON object")]
  root = None if package_root is None else pathlib.Path(package_root)
  schema = raw.get("schema_version")
  if schema == manifest_v2.SCHEMA_VERSION and is_int(schema):
    return check_v2(raw, root)[1]
  if schema != 1 or not is_int(schema):
    return [issue("unsupported_schema_version",
                  f"unsupported package manifest schema_version {schema} (mtpjax reads 1 and 2)")]
  found = []
  if raw.get("format") != FORMAT:
    found.append(issue("invalid_format", "package manifest format must be layer-package"))
  if is_blank(raw.get("model_id")):
    found.append(issue("empty_model_id", "package manifest model_id must not be empty"))
  found.extend(_source_model_issues(raw.get("source_model")))
  layer_count = raw.get("layer_count")
  if not is_int(layer_count) or layer_count < 1:
    found.append(issue("invalid_layer_count",
                       "package manifest layer_count must be an integer >= 1, got "
                       f"{layer_count!r}"))
    layer_count = None
  width = raw.get("activation_width")
  if width is None:
    found.append(issue("missing_activation_width",
                       "package manifest has no activation_width", severity=WARNING))
  elif not is_int(width) or not 0 < width <= U32_MAX:
    found.append(issue("invalid_activation_width",
                       f"package manifest activation_width must be in 1..{U32_MAX}, got {width!r}"))
  abi = raw.get("skippy_abi_version")
  if is_blank(abi):
    found.append(issue("missing_skippy_abi_version",
                       "package manifest skippy_abi_version must not be empty"))
  else:
    try:
      check_abi_version(abi)
    except errors.AbiError as error:
      found.append(issue("incompatible_skippy_abi_version", error.message))
  shared = raw.get("shared")
  shared = shared if isinstance(shared, dict) else {}
  for role in SHARED_ROLES:
    found.extend(_artifact_issues(shared.get(role), role, f"shared.{role}", root))
  found.extend(_layers_issues(raw.get("layers"), layer_count, root))
  found.extend(_projector_issues(raw.get("projectors"), root))
  found.extend(generation_rules.generation_issues(raw.get("generation"), layer_count))
  return found


# --- parsing into dataclasses -----------------------------------------------------------------

def manifest_sha256(data: bytes) -> str:
  """The manifest's identity: lowercase hex SHA-256 of its raw bytes."""
  return hashlib.sha256(data).hexdigest()


def _decode_json(data: dict | bytes, path: str) -> object:
  if isinstance(data, dict):
    return data
  raw, record = decode_manifest_bytes(bytes(data))
  if record is not None:
    raise errors.ManifestError(record["message"], issues=[record], path=path,
                               remedy=record["remediation"])
  return raw


def decode_manifest_bytes(data: bytes) -> tuple[object, dict | None]:
  """(decoded JSON, None), or (None, the invalid_manifest_json issue): bad UTF-8, bad JSON and
  nesting too deep for the decoder (RecursionError) are all reported the same way."""
  try:
    return json.loads(data.decode("utf-8")), None
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
    reason = "it nests too deeply" if isinstance(error, RecursionError) else str(error)
    return None, issue("invalid_manifest_json",
                       f"package manifest is not valid UTF-8 JSON: {reason}",
                       path=MANIFEST_NAME)


def manifest_error(path: str, found: list[dict]) -> errors.ManifestError:
  """One ManifestError carrying every error issue; the message lists the first few."""
  failing = errors_of(found)
  shown = "; ".join(f"[{item['code']}] {item['message']}" for item in failing[:5])
  if len(failing) > 5:
    shown += f"; and {len(failing) - 5} more"
  return errors.ManifestError(
      f"package manifest is invalid ({len(failing)} error(s)): {shown}", issues=failing,
      path=path, remedy=failing[0]["remediation"] + "; run `python -m mtpjax.package.preflight "
      "PACKAGE_DIR` for the full report")


def _artifact(entry: dict, role: str) -> Artifact:
  return Artifact(role=role, path=entry["path"], tensor_count=entry["tensor_count"],
                  tensor_bytes=entry["tensor_bytes"], artifact_bytes=entry["artifact_bytes"],
                  sha256=entry["sha256"].lower(), layer_index=entry.get("layer_index"),
                  kind=entry.get("kind"))


def _source_model(raw: dict) -> SourceModel:
  files = tuple(SourceFile(path=entry["path"], size_bytes=entry.get("size_bytes"),
                           sha256=entry.get("sha256")) for entry in raw.get("files") or ())
  return SourceModel(path=raw["path"], sha256=raw["sha256"].lower(), repo=raw.get("repo"),
                     revision=raw.get("revision"), primary_file=raw.get("primary_file"),
                     canonical_ref=raw.get("canonical_ref"),
                     distribution_id=raw.get("distribution_id"), files=files)


def check_v2(raw: dict, root: pathlib.Path | None) -> tuple[Manifest | None, list[dict]]:
  """A v2 root's issues and, with `root` and no error, its Manifest: the metadata carrier is
  read and hashed once for both (preflight needs the two; `manifest_issues` the issues)."""
  found = manifest_v2.root_issues(raw, root)
  if root is None or errors_of(found):
    return None, found
  try:
    manifest, more = manifest_v2.resolve(raw, root)
  except errors.MtpjaxError as error:      # the carrier is missing, corrupt or not a GGUF
    return None, found + [issue("invalid_metadata_artifact", error.message,
                                path="source_model.metadata_artifact_id")]
  return manifest, found + more


def parse_manifest(data: dict | bytes, *, path: str | pathlib.Path,
                   package_root: pathlib.Path | None = None) -> Manifest:
  """Validates a manifest (raw bytes or decoded JSON) and returns it typed.

  Raises one ManifestError carrying every error issue. A strategy that names a native-MTP
  proposer (or a composite's primary) carries that proposer's depth and layers, so every era's
  form reads the same through `Strategy`. A v2 root with `package_root` has its metadata carrier
  read (and hashed) to build the full Manifest (a corrupt carrier raises IntegrityError);
  without it (a converted checkpoint's record) it gives `manifest_v2.root_manifest`.
  """
  raw = _decode_json(data, str(path))
  if isinstance(raw, dict) and raw.get("schema_version") == manifest_v2.SCHEMA_VERSION:
    return _parse_v2(raw, str(path), package_root)
  found = manifest_issues(raw, package_root)
  if errors_of(found):
    raise manifest_error(str(path), found)
  generation = raw.get("generation")
  return Manifest(
      schema_version=raw["schema_version"], model_id=raw["model_id"],
      source_model=_source_model(raw["source_model"]), format=raw["format"],
      layer_count=raw["layer_count"], activation_width=raw.get("activation_width"),
      shared_metadata=_artifact(raw["shared"]["metadata"], "metadata"),
      shared_embeddings=_artifact(raw["shared"]["embeddings"], "embeddings"),
      shared_output=_artifact(raw["shared"]["output"], "output"),
      layers=tuple(sorted((_artifact(entry, "layer") for entry in raw["layers"]),
                          key=lambda artifact: artifact.layer_index)),
      skippy_abi_version=raw["skippy_abi_version"],
      generation=None if generation is None else Generation(
          speculative_decoding=manifest_types.parse_speculative(generation.get("speculative_decoding"))),
      projectors=tuple(_artifact(entry, "projector") for entry in raw.get("projectors") or ()),
      created_at_unix_secs=raw.get("created_at_unix_secs"), raw=raw)


def _parse_v2(raw: dict, path: str, package_root: pathlib.Path | None) -> Manifest:
  root = None if package_root is None else pathlib.Path(package_root)
  found = manifest_v2.root_issues(raw, root)
  if not errors_of(found) and root is None:
    return manifest_v2.root_manifest(raw)
  if not errors_of(found):
    manifest, found = manifest_v2.resolve(raw, root)
    if manifest is not None:
      return manifest
  raise manifest_error(path, found)


def read_manifest(package_dir: str | pathlib.Path) -> tuple[Manifest, str]:
  """Loads `model-package.json` of a package directory: (manifest, manifest_sha256)."""
  root = pathlib.Path(package_dir)
  path = root / MANIFEST_NAME
  try:
    data = integrity.read_manifest_bytes(root, MANIFEST_NAME)
  except integrity.ManifestUnreadable as unreadable:
    record = unreadable.record
    raise errors.ManifestError(record["message"], issues=[record], path=str(path),
                               remedy=record["remediation"]) from unreadable
  return parse_manifest(data, path=path, package_root=root), manifest_sha256(data)


def load_manifest(package_dir: str | pathlib.Path) -> Manifest:
  """`read_manifest` without the hash."""
  return read_manifest(package_dir)[0]


def source_size_bytes(source: SourceModel) -> int | None:
  """The source size: the sum of `files[].size_bytes`, unknown (None) if any entry lacks it."""
  if not source.files or any(entry.size_bytes is None for entry in source.files):
    return None
  return sum(entry.size_bytes for entry in source.files)


# --- hf:// references (§2.5; parsed only, downloads come later) --------------------------------

def parse_hf_reference(ref: str) -> HfReference:
  """`hf://ns/repo`, `hf://ns/repo:rev` or `hf://ns/repo@rev` (`@` wins, else the last `:`)."""
  remedy = "write the reference as hf://namespace/repo, hf://namespace/repo@rev or ...:rev"
  if not isinstance(ref, str) or not ref.startswith(HF_SCHEME):
    raise errors.PackageError(f"package reference {ref!r} does not start with {HF_SCHEME}",
                              remedy=remedy)
  body = ref[len(HF_SCHEME):]
  revision = None
  if "@" in body:
    body, revision = body.split("@", 1)
  elif ":" in body:
    body, revision = body.rsplit(":", 1)
  if revision is not None and not revision.strip():
    raise errors.PackageError(f"package reference {ref!r} has an empty revision", remedy=remedy)
  parts = body.split("/")
  if len(parts) != 2 or not all(part.strip() for part in parts) or ":" in body or "@" in body:
    raise errors.PackageError(f"package reference {ref!r} must name exactly namespace/repo",
                              remedy=remedy)
  return HfReference(repo=body, revision=revision)
