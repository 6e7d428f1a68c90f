"""Split a GGUF (plain or split) into a v1 layer package (docs/LAYER_PACKAGES.md §6).

Tensor bytes are copied raw with their ggml type and `ne`, never requantized, and key/values are
re-emitted byte for byte. The package is built in a sibling temporary folder, re-opened and
checked against the source (manifest, sizes, hashes, exactly-once), and only then renamed into
place, so a failed or interrupted split never leaves a manifest at the destination.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import posixpath
import re
import shutil
import tempfile
import time
from typing import Any

import gguf
import numpy as np

from mtpjax import errors
from mtpjax.package import generation_rules, integrity, manifest as manifest_lib
from mtpjax.package.gguf_kv import KeyValue
from mtpjax.package.reader import ModelSource, open_gguf, open_source
from mtpjax.package.roles import OWNED_ROLES, ROLE_LAYER, ROLE_METADATA, stage_selects, tensor_role

ABI_STAMP = "0.1.0"
DEFAULT_STRATEGY = "native-mtp-n1"
# How `generation` declares native MTP, one per package era: the first writer's inline
# `native-mtp-n1`, the later inline `mtp`, and the newer `proposers` form (a `mtp` strategy that
# refers to a `mtp` proposer). All three resolve the same.
GENERATION_FORMATS = (DEFAULT_STRATEGY, "mtp", "proposers")
# What native MTP's strategy advertises unless told: one draft token, as the seed's packages do.
FIXED_WINDOW = {"default": "fixed", "initial_window": 1, "min_window": 1, "max_window": 1}
_COMPARE_CHUNK_BYTES = 16 << 20
_SHARD_SUFFIX = re.compile(r"-[0-9]{5}-of-[0-9]{5}$")
_MODEL_ID = re.compile(r"[^\s/:@]+/[^\s/:@]+(:[^\s/:@]+)?")
_REMEDY = "fix the source GGUF or the arguments and run the split again"


@dataclasses.dataclass(frozen=True)
class Encoded:
  """A key/value payload that is already in GGUF encoding."""
  payload: bytes


class FragmentWriter(gguf.GGUFWriter):
  """GGUFWriter that re-emits source key/values byte for byte.

  gguf-py re-infers the element types of nested arrays and refuses empty ones, so values are
  passed through in their source encoding instead of being decoded and re-encoded.
  """

  def _pack_val(self, val: Any, vtype: gguf.GGUFValueType, add_vtype: bool,
                sub_type: gguf.GGUFValueType | None = None) -> bytes:
    if isinstance(val, Encoded):
      return (self._pack("I", vtype) if add_vtype else b"") + val.payload
    return super()._pack_val(val, vtype, add_vtype, sub_type)


@dataclasses.dataclass(frozen=True)
class Fragment:
  label: str
  path: str
  layer_start: int
  layer_end: int
  embeddings: bool = False
  output: bool = False
  # v1 repeats the key/values and metadata-role tensors in every fragment; v2 keeps both in its
  # carrier and stores each tensor once
  metadata_tensors: bool = True
  key_values: bool = True


def fragment_plan(layer_count: int) -> list[Fragment]:
  """The writer's fragments (§3): metadata, embeddings, one per layer, output."""
  return ([Fragment("metadata", "shared/metadata.gguf", 0, 0),
           Fragment("embeddings", "shared/embeddings.gguf", 0, 0, embeddings=True)]
          + [Fragment(f"layer {index}", f"layers/layer-{index:03d}.gguf", index, index + 1)
             for index in range(layer_count)]
          + [Fragment("output", "shared/output.gguf", layer_count, layer_count, output=True)])


def copy_key_values(writer: FragmentWriter, key_values: list[KeyValue]) -> None:
  """Every key except GGUF.*, split.* and general.architecture (the constructor writes it)."""
  for item in key_values:
    if item.key == "general.architecture" or item.key.startswith(("GGUF.", "split.")):
      continue
    if item.key == "general.alignment":
      writer.add_custom_alignment(item.value)   # also makes the writer pad tensors to it
      continue
    writer.add_key_value(item.key, Encoded(item.payload), item.type)


def write_fragment(source: ModelSource, fragment: Fragment, root: pathlib.Path) -> dict:
  """Writes one fragment from memory-mapped source views and returns its manifest entry."""
  target = root / fragment.path
  target.parent.mkdir(parents=True, exist_ok=True)
  writer = FragmentWriter(target, source.arch)
  tensor_count = tensor_bytes = 0
  try:
    copy_key_values(writer, source.key_values if fragment.key_values else
                    [item for item in source.key_values if item.key == "general.alignment"])
    for name, info in source.tensors.items():
      if stage_selects(name, fragment.layer_start, fragment.layer_end,
                       embeddings=fragment.embeddings, output=fragment.output) and (
                           fragment.metadata_tensors or tensor_role(name)[0] != ROLE_METADATA):
        data = source.raw(name)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=info.ggml_type)
        tensor_count += 1
        tensor_bytes += info.n_bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
  finally:
    writer.close()
  return {"path": fragment.path, "tensor_count": tensor_count, "tensor_bytes": tensor_bytes,
          "artifact_bytes": target.stat().st_size, "sha256": integrity.sha256_file(target)}


def _check_model_id(model_id: str | None) -> str:
  if model_id is None or not model_id.strip():
    raise errors.PackageError("a local GGUF needs --model-id (a coordinate such as "
                              "org/repo:Q4_K_M); package manifest model_id must not be empty",
                              field="model_id", remedy="pass --model-id ORG/REPO:QUANT")
  if not _MODEL_ID.fullmatch(model_id.strip()):
    raise errors.PackageError(f"model_id {model_id!r} is not a model coordinate such as "
                              "org/repo:Q4_K_M", field="model_id",
                              remedy="pass --model-id ORG/REPO[:QUANT], not a path")
  return model_id.strip()


def _source_model(source: ModelSource, model_id: str, revision: str | None,
                  primary_file: str | None) -> dict:
  """§2.2 provenance; each source file is hashed in one streaming pass of 1 MiB chunks."""
  if primary_file is not None and integrity.unsafe_path_reason(primary_file):
    raise errors.PackageError(f"--file {primary_file!r} must be the source's relative path inside "
                              "its repository", field="primary_file", remedy=_REMEDY)
  first = source.files[0]
  subdir = posixpath.dirname(primary_file or "")
  if source.kind == "split-gguf" or primary_file is None:
    names = [posixpath.join(subdir, shard.name) for shard in source.files]
  else:
    names = [primary_file]
  files = [{"path": name, "size_bytes": shard.stat().st_size,
            "sha256": integrity.sha256_file(shard)} for name, shard in zip(names, source.files)]
  repo = model_id.split(":", 1)[0]
  record = {"path": str(first.absolute()), "sha256": files[0]["sha256"], "repo": repo}
  if revision is not None:
    if not revision.strip():
      raise errors.PackageError("--revision must not be blank", field="revision", remedy=_REMEDY)
    record["revision"] = revision
  record["primary_file"] = names[0]
  if revision is not None:
    record["canonical_ref"] = f"{repo}@{revision}/{names[0]}"
  record["distribution_id"] = _SHARD_SUFFIX.sub("", pathlib.PurePosixPath(names[0]).stem)
  record["files"] = files
  return record


def parse_window_policy(text: str) -> dict:
  """`adaptive:1:2:3` (DEFAULT:MIN:INITIAL:MAX) -> a window_policy object; its bounds are
  checked when a package is written with it."""
  parts = text.split(":")
  if len(parts) != 4 or not all(part.isdigit() for part in parts[1:]):
    raise errors.PackageError(f"window policy {text!r} is not DEFAULT:MIN:INITIAL:MAX",
                              field="window_policy", remedy="write it as e.g. adaptive:1:2:3")
  return {"default": parts[0], "min_window": int(parts[1]), "initial_window": int(parts[2]),
          "max_window": int(parts[3])}


def check_window_policy(window: dict) -> dict:
  """`window`, refused (PackageError) where preflight would flag the package written with it."""
  flaws = generation_rules.window_policy_issues("native MTP", window)
  if flaws:
    raise errors.PackageError(f"window policy {window!r}: {flaws[0]['message']}",
                              field="window_policy", remedy="give positive integer windows with "
                              "min_window <= initial_window <= max_window and a default")
  # In the schema's field order (WindowPolicy's), which v2's package identity serialises.
  return {field.name: window[field.name] for field in dataclasses.fields(manifest_lib.WindowPolicy)
          if field.name in window}


def _generation(source: ModelSource, generation_format: str, window: dict) -> dict | None:
  """Native MTP iff the source has `.nextn.` tensors (§6 step 5), in the chosen era's form,
  with `window` as its strategy's window_policy."""
  layers = sorted({tensor_role(name)[1] for name in source.tensors if ".nextn." in name
                   and tensor_role(name)[0] == ROLE_LAYER})
  if not layers:
    return None
  native = {"type": manifest_lib.NATIVE_MTP_TYPE, "prediction_depth": 1, "layer_indices": layers}
  if generation_format == "proposers":
    return {"speculative_decoding": {"default": "mtp", "proposers": {"mtp": native},
                                     "strategies": {"mtp": {
                                         "type": manifest_lib.NATIVE_MTP_TYPE, "proposer": "mtp",
                                         "window_policy": window}}}}
  return {"speculative_decoding": {"default": generation_format, "strategies": {
      generation_format: {**native, "window_policy": window}}}}


def _same_bytes(left: np.ndarray, right: np.ndarray) -> bool:
  left, right = left.reshape(-1).view(np.uint8), right.reshape(-1).view(np.uint8)
  if left.size != right.size:
    return False
  return all(np.array_equal(left[start:start + _COMPARE_CHUNK_BYTES],
                            right[start:start + _COMPARE_CHUNK_BYTES])
             for start in range(0, left.size, _COMPARE_CHUNK_BYTES))


def check_exactly_once(package_dir: pathlib.Path, source: ModelSource) -> None:
  """§3: every owned source tensor is in exactly one artifact, and every artifact tensor is in
  the source with the same type, `ne` and bytes; the manifest's counts match the files."""
  # The hashes were taken from these very files as they were written, and every tensor's
  # bytes are compared with the source below, so re-hashing here would catch nothing new.
  manifest = manifest_lib.load_manifest(package_dir)
  artifacts = list(manifest.payloads) or [manifest.shared_metadata, manifest.shared_embeddings,
                                          *manifest.layers, manifest.shared_output]
  seen: collections.Counter[str] = collections.Counter()
  problems = []
  for artifact in artifacts:
    reader = open_gguf(package_dir / artifact.path)
    total = 0
    for tensor in reader.tensors:
      total += int(tensor.n_bytes)
      if tensor_role(tensor.name)[0] in OWNED_ROLES:
        seen[tensor.name] += 1
      info = source.tensors.get(tensor.name)
      if (info is None or info.ggml_type != tensor.tensor_type
          or info.ne != tuple(int(dim) for dim in tensor.shape)
          or not _same_bytes(source.raw(tensor.name), tensor.data)):
        problems.append(f"{artifact.path}: {tensor.name} differs from the source")
    # (v2 counts only the tensors a payload owns; its copies are checked by the locator)
    if (not manifest.payloads
        and (len(reader.tensors), total) != (artifact.tensor_count, artifact.tensor_bytes)):
      problems.append(f"{artifact.path}: manifest counts disagree with the file")
    del reader
  for name in source.tensors:
    if tensor_role(name)[0] in OWNED_ROLES and seen[name] != 1:
      problems.append(f"{name} is in {seen[name]} artifacts instead of exactly one")
  if problems:
    raise errors.PackageError(f"package {package_dir} failed the exactly-once check: "
                              + "; ".join(problems[:10]), path=str(package_dir), remedy=_REMEDY)


def _prepare_destination(out_dir: pathlib.Path, overwrite: bool) -> None:
  if out_dir.exists() and not out_dir.is_dir():
    raise errors.PackageError(f"destination {out_dir} is a file, not a folder", path=str(out_dir),
                              remedy="choose a folder path for the package")
  if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
    raise errors.PackageError(f"destination {out_dir} is not empty", path=str(out_dir),
                              remedy="pass --overwrite to replace it, or choose an empty folder")
  out_dir.parent.mkdir(parents=True, exist_ok=True)


def _install(built: pathlib.Path, out_dir: pathlib.Path) -> None:
  """Renames the finished package into place; an old package is removed only afterwards."""
  retired = None
  if out_dir.exists():
    retired = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    out_dir.rename(retired / "package")
  built.rename(out_dir)
  if retired is not None:
    shutil.rmtree(retired)


def split_gguf(src: str | pathlib.Path, out_dir: str | pathlib.Path, *, model_id: str | None,
               revision: str | None = None, overwrite: bool = False,
               primary_file: str | None = None,
               generation_format: str = DEFAULT_STRATEGY,
               window_policy: dict | None = None) -> pathlib.Path:
  """Writes a v1 layer package for a plain GGUF or any shard of a split GGUF; returns OUT_DIR.

  `primary_file` is the source's path inside its repository (default: the local file name); its
  folder is kept in `source_model.files`, e.g. `UD-IQ2_M/GLM-5.1-UD-IQ2_M-00001-of-00006.gguf`.
  `generation_format` picks the era's form of the native-MTP declaration (GENERATION_FORMATS),
  `window_policy` its draft window (default FIXED_WINDOW, 1/1/1).
  """
  return split_with(_write_v1, src, out_dir, model_id=model_id, revision=revision,
                    overwrite=overwrite, primary_file=primary_file,
                    generation_format=generation_format, window_policy=window_policy)


@dataclasses.dataclass(frozen=True)
class PackageInputs:
  """What every schema's package writer gets: the open source and the manifest's parts that do
  not depend on the schema."""
  source: ModelSource
  staging: pathlib.Path
  model_id: str
  source_model: dict             # the v1 record (§2.2)
  generation: dict | None
  activation_width: int


def _write_v1(inputs: PackageInputs) -> None:
  source, staging = inputs.source, inputs.staging
  entries = {fragment.label: write_fragment(source, fragment, staging)
             for fragment in fragment_plan(source.layer_count)}
  manifest: dict[str, Any] = {
      "schema_version": 1, "model_id": inputs.model_id, "source_model": inputs.source_model,
      "format": manifest_lib.FORMAT, "layer_count": source.layer_count,
      "activation_width": inputs.activation_width}
  if inputs.generation is not None:
    manifest["generation"] = inputs.generation
  manifest["shared"] = {role: entries[role] for role in manifest_lib.SHARED_ROLES}
  manifest["projectors"] = []
  manifest["layers"] = [{"layer_index": index, **entries[f"layer {index}"]}
                        for index in range(source.layer_count)]
  manifest["skippy_abi_version"] = ABI_STAMP
  manifest["created_at_unix_secs"] = int(time.time())
  (staging / manifest_lib.MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n",
                                                    encoding="utf-8")


def split_with(write_package, src: str | pathlib.Path, out_dir: str | pathlib.Path, *,
               model_id: str | None, revision: str | None, overwrite: bool,
               primary_file: str | None, generation_format: str,
               window_policy: dict | None = None) -> pathlib.Path:
  """The steps every schema shares (§6): check the arguments, open the source, let
  `write_package(PackageInputs)` write the artifacts and manifest into a staging folder, check
  it exactly-once against the source, then rename it into place."""
  model_id = _check_model_id(model_id)
  if generation_format not in GENERATION_FORMATS:
    raise errors.PackageError(f"generation format {generation_format!r} is not one of "
                              f"{', '.join(GENERATION_FORMATS)}", field="generation_format",
                              remedy="pass --generation-format " + "|".join(GENERATION_FORMATS))
  window = check_window_policy(FIXED_WINDOW if window_policy is None else window_policy)
  out_dir = pathlib.Path(out_dir)
  _prepare_destination(out_dir, overwrite)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
  staging.chmod(0o755)   # mkdtemp's 0700 would otherwise become the package's mode
  try:
    with open_source(src) as source:
      if source.kind == "package":
        raise errors.PackageError(f"{src} is already a layer package; split its source GGUF",
                                  path=str(src), remedy="pass the .gguf file (or a shard)")
      if source.layer_count < 1:
        raise errors.PackageError(f"source {src} has no blk.N tensors; a layer package needs at "
                                  "least one layer", path=str(src), remedy=_REMEDY)
      write_package(PackageInputs(
          source=source, staging=staging, model_id=model_id,
          source_model=_source_model(source, model_id, revision, primary_file),
          generation=_generation(source, generation_format, window),
          activation_width=source.activation_width))
      check_exactly_once(staging, source)
    _install(staging, out_dir)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return out_dir


def join_gguf(src: str | pathlib.Path, out_path: str | pathlib.Path) -> pathlib.Path:
  """Writes a package (or a split GGUF) back as one GGUF file, for tools that read only one
  file (llama.cpp's llama-bench); key/values and tensor bytes are copied unchanged."""
  out_path = pathlib.Path(out_path)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
  try:
    with open_source(src) as source:
      whole = Fragment("joined", out_path.name, 0, source.layer_count, embeddings=True,
                       output=True)
      write_fragment(source, whole, staging)
    os.replace(staging / out_path.name, out_path)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return out_path
