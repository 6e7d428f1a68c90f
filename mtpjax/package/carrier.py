"""The metadata carrier of a v2 layer package: a payload-free GGUF (docs/LAYER_PACKAGES.md §10).

It holds the model's key/values and its full tensor directory, plus the `skippy.package.*`
locator arrays that say, per directory entry, which payload artifact stores the tensor and at
which absolute byte range. The carrier is untrusted: it is hashed in the same read that brings
it into memory, its header goes through the bounded walk, and every locator entry is checked
(part index, alignment, range inside the artifact, no overlap) before any payload byte is read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import re
import struct

import gguf

from mtpjax import errors
from mtpjax.package import gguf_header, integrity
from mtpjax.package.gguf_kv import KeyValue, decode_key_value
from mtpjax.package.issues import errors_of, is_int, issue
from mtpjax.package.roles import ROLE_LAYER, tensor_role

LOCATOR_PREFIX = "skippy.package."
METADATA_ONLY_KEY = "skippy.package.metadata_only"
PART_COUNT_KEY = "skippy.package.part_count"
LOCATOR_SCHEMA_KEY = "skippy.package.locator_schema"
TENSOR_PART_KEY = "skippy.package.tensor_part"
TENSOR_OFFSET_KEY = "skippy.package.tensor_offset"
TENSOR_SIZE_KEY = "skippy.package.tensor_size"
TENSOR_ALIGNMENT_KEY = "skippy.package.tensor_alignment"
LOCATOR_SCHEMA = 1
# Each locator array and the element type upstream writes (a different type is rejected).
LOCATOR_ARRAYS = {TENSOR_PART_KEY: gguf.GGUFValueType.UINT32,
                  TENSOR_OFFSET_KEY: gguf.GGUFValueType.UINT64,
                  TENSOR_SIZE_KEY: gguf.GGUFValueType.UINT64,
                  TENSOR_ALIGNMENT_KEY: gguf.GGUFValueType.UINT32}
_LAYER_PATH = re.compile(r"layers/layer-([0-9]+)\.gguf")


@dataclasses.dataclass(frozen=True)
class PayloadArtifact:
  """One payload artifact of the root's catalog, in part-index order."""
  id: str
  path: str
  byte_size: int


@dataclasses.dataclass(frozen=True)
class LocatedTensor:
  name: str
  ggml_type: int
  ne: tuple[int, ...]
  part: int                 # index into the payload artifacts
  start: int                # absolute offset in that artifact
  n_bytes: int
  alignment: int


@dataclasses.dataclass(frozen=True)
class Carrier:
  key_values: tuple[KeyValue, ...]          # the model's, the skippy.package.* keys removed
  tensors: tuple[LocatedTensor, ...]        # directory order


def layer_ordinal(path: str) -> int | None:
  """The layer a payload path names (`layers/layer-NNNNN.gguf`), as upstream derives it."""
  match = _LAYER_PATH.fullmatch(path)
  return int(match.group(1)) if match else None


def _read_verified(root: pathlib.Path, path: str, byte_size: int, sha256: str) -> bytes:
  """The carrier's bytes, its size and SHA-256 checked in the one read that loads it."""
  file_path = integrity.verify_part(root, path, role="metadata carrier", artifact_bytes=byte_size,
                                    sha256=sha256, check_sha=False)
  data = file_path.read_bytes()
  digest = hashlib.sha256(data).hexdigest()
  if len(data) != byte_size or digest != sha256:
    raise errors.IntegrityError(
        f"package artifact checksum mismatch for {file_path}: expected {sha256}, got {digest}",
        path=str(file_path), field="metadata carrier",
        remedy="the file is corrupt or replaced: re-download the package")
  return data


def _locator_arrays(values: dict[str, KeyValue], count: int) -> tuple[dict, list[dict]]:
  found, arrays = [], {}
  for key, item_type in LOCATOR_ARRAYS.items():
    item = values.get(key)
    if item is None or item.type != gguf.GGUFValueType.ARRAY:
      found.append(issue("invalid_metadata_artifact",
                         f"metadata carrier is missing typed array {key!r}"))
      continue
    (declared,) = struct.unpack_from("<I", item.payload, 0)
    if declared != item_type:
      found.append(issue("invalid_metadata_artifact",
                         f"metadata carrier {key} must be an array of {item_type.name}, got "
                         f"{gguf.GGUFValueType(declared).name}"))
    elif len(item.value) != count:
      found.append(issue("invalid_metadata_artifact",
                         f"metadata carrier tensor locator array {key} has {len(item.value)} "
                         f"entries but the tensor directory has {count}"))
    else:
      arrays[key] = item.value
  return arrays, found


def _header_issues(values: dict[str, KeyValue], payloads: list[PayloadArtifact]) -> list[dict]:
  found = []
  marker = values.get(METADATA_ONLY_KEY)
  if marker is None or marker.type != gguf.GGUFValueType.BOOL or marker.value is not True:
    found.append(issue("invalid_metadata_artifact",
                       "metadata carrier is missing its typed metadata-only marker "
                       f"({METADATA_ONLY_KEY} = true)"))
  schema = values.get(LOCATOR_SCHEMA_KEY)
  if schema is None or not is_int(schema.value) or schema.value != LOCATOR_SCHEMA:
    found.append(issue("invalid_metadata_artifact",
                       "metadata carrier has an unsupported locator schema "
                       f"{None if schema is None else schema.value!r} (mtpjax reads "
                       f"{LOCATOR_SCHEMA})"))
  parts = values.get(PART_COUNT_KEY)
  if parts is None or not is_int(parts.value) or parts.value != len(payloads):
    found.append(issue("invalid_metadata_artifact",
                       "metadata carrier payload part count "
                       f"{None if parts is None else parts.value!r} differs from the package "
                       f"root's {len(payloads)} payload artifacts"))
  return found


def _tensor_issues(tensor: LocatedTensor, position: int, payloads: list[PayloadArtifact],
                   layer_count: int) -> list[dict]:
  where = f"tensor #{position} {tensor.name!r}"
  if tensor.part >= len(payloads):
    return [issue("unknown_artifact", f"metadata carrier {where} references missing payload "
                  f"part {tensor.part} (the root has {len(payloads)})")]
  artifact = payloads[tensor.part]
  found = []
  alignment = tensor.alignment
  if alignment <= 0 or alignment & (alignment - 1):
    found.append(issue("invalid_alignment", f"metadata carrier {where}: alignment {alignment} is "
                       "not a non-zero power of two"))
  elif tensor.start % alignment:
    found.append(issue("misaligned_offset", f"metadata carrier {where}: offset {tensor.start} is "
                       f"not aligned to {alignment} bytes"))
  if tensor.n_bytes <= 0:
    found.append(issue("invalid_stored_length",
                       f"metadata carrier {where}: owned tensor storage must not be empty"))
  if tensor.start + tensor.n_bytes > artifact.byte_size:
    found.append(issue("storage_out_of_bounds", f"metadata carrier {where}: range "
                       f"{tensor.start}+{tensor.n_bytes} exceeds artifact {artifact.id!r} size "
                       f"{artifact.byte_size}"))
  ordinal = layer_ordinal(artifact.path)
  role, index = tensor_role(tensor.name)
  for value, what in ((ordinal, f"artifact {artifact.path}"), (index if role == ROLE_LAYER
                                                               else None, "its name")):
    if value is not None and value >= layer_count:
      found.append(issue("layer_out_of_bounds", f"metadata carrier {where}: layer ordinal "
                         f"{value} (from {what}) is outside model layer count {layer_count}"))
  return found


def _overlap_issues(tensors: list[LocatedTensor], payloads: list[PayloadArtifact]) -> list[dict]:
  found, by_part = [], {}
  for tensor in tensors:
    by_part.setdefault(tensor.part, []).append(tensor)
  for part, members in by_part.items():
    members.sort(key=lambda item: (item.start, item.n_bytes))
    for previous, current in zip(members, members[1:]):
      if current.start < previous.start + previous.n_bytes:
        found.append(issue("overlapping_storage", f"metadata carrier tensor {current.name!r}: "
                           f"storage overlaps {previous.name!r} in artifact "
                           f"{payloads[part].id!r}"))
  return found


def read_carrier(root: pathlib.Path, path: str, *, byte_size: int, sha256: str,
                 payloads: list[PayloadArtifact], layer_count: int) -> tuple[Carrier | None,
                                                                            list[dict]]:
  """(the carrier, []) or (None, every locator issue). A file that is missing, corrupt or not a
  bounded payload-free GGUF raises PackageError / IntegrityError naming it."""
  data = _read_verified(root, path, byte_size, sha256)
  layout = gguf_header.walk_header(data, root / path, payload_free=True)
  buffer = memoryview(data)
  key_values = [decode_key_value(buffer, key, value_type, offset, root / path)
                for key, value_type, offset in layout.keys]
  values = {item.key: item for item in key_values}
  found = _header_issues(values, payloads)
  arrays, array_issues = _locator_arrays(values, len(layout.tensors))
  found.extend(array_issues)
  if errors_of(found):
    return None, found
  tensors = [LocatedTensor(name=extent.name, ggml_type=int(extent.ggml_type), ne=extent.ne,
                           part=arrays[TENSOR_PART_KEY][i], start=arrays[TENSOR_OFFSET_KEY][i],
                           n_bytes=arrays[TENSOR_SIZE_KEY][i],
                           alignment=arrays[TENSOR_ALIGNMENT_KEY][i])
             for i, extent in enumerate(layout.tensors)]
  for position, (tensor, extent) in enumerate(zip(tensors, layout.tensors)):
    found.extend(_tensor_issues(tensor, position, payloads, layer_count))
    if tensor.n_bytes != extent.n_bytes:
      found.append(issue("invalid_stored_length", f"metadata carrier tensor #{position} "
                         f"{tensor.name!r}: stored length {tensor.n_bytes} differs from the "
                         f"{extent.n_bytes} bytes its type and shape need"))
  found.extend(_overlap_issues([tensor for tensor in tensors if tensor.part < len(payloads)],
                               payloads))
  if errors_of(found):
    return None, found
  model_values = tuple(item for item in key_values if not item.key.startswith(LOCATOR_PREFIX))
  return Carrier(key_values=model_values, tensors=tuple(tensors)), []
