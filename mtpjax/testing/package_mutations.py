"""Hostile edits of a layer package: its manifest, GGUF headers, metadata values, tensor bytes.

Tests and `tools/fuzz_packages.py` use them to prove that a corrupted or crafted package is
refused with a typed error. Field offsets are located through gguf-py's own reader, so the
edits do not depend on the header walk they attack. Every edit is driven by a seeded
`random.Random`, so a failing case is reproduced from its seed alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import random
import shutil
import stat
import struct
from typing import Any, Callable

import gguf

from mtpjax.package import manifest_v2
from mtpjax.testing.gguf_rewrite import rewrite_gguf

MANIFEST_NAME = "model-package.json"
_VT = gguf.GGUFValueType

HOSTILE_INTS = (0, 1, 2, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62,
                2**63 - 1, 2**64 - 1)
HOSTILE_JSON = (None, True, False, -1, 0, 1, 2**31, 2**62, 2**64 + 1, 10**12, 1.5, 1e308,
                math.inf, -math.inf, math.nan, "", " ", "a" * 300 + ".gguf", "../outside.gguf",
                "/etc/passwd", "x\\y", "shared/../../z", "layers/" + "b" * 5000, [], {}, [1, 2],
                {"a": 1}, "0.1.0", "9.9", "native-mtp", "sha")
HOSTILE_METADATA = ((0, _VT.UINT32), (1, _VT.UINT32), (2**32 - 1, _VT.UINT32),
                    (2**31 - 1, _VT.INT32), (-1, _VT.INT32), (-(2**31), _VT.INT32),
                    (2**63 - 1, _VT.INT64), (2**64 - 1, _VT.UINT64), (-1, _VT.INT64),
                    (math.nan, _VT.FLOAT32), (math.inf, _VT.FLOAT32), (-math.inf, _VT.FLOAT32),
                    (0.0, _VT.FLOAT32), (-1.0, _VT.FLOAT32), (1e-45, _VT.FLOAT32),
                    (3e38, _VT.FLOAT32), (math.nan, _VT.FLOAT64), (True, _VT.BOOL),
                    ("", _VT.STRING), ("glm4moe", _VT.STRING), ("x" * 1000, _VT.STRING),
                    ([1, 2, 3], _VT.ARRAY), (["a", "b"], _VT.ARRAY))


@dataclasses.dataclass(frozen=True)
class Mutation:
  """What a case changed; `rehashed` when the manifest re-records the edited file's size and
  SHA-256 (a self-consistent rewrite rather than corruption), `target` the edited artifact
  (None: the manifest or several)."""
  kind: str
  detail: str
  target: str | None = None
  rehashed: bool = False
  must_refuse: bool = False        # loading it at all is a failure, whatever the bytes read


# -- helpers over a package copy -----------------------------------------------------------------

def read_manifest(root: pathlib.Path) -> dict:
  return json.loads((root / MANIFEST_NAME).read_text())


_DEEP = "__deeply_nested__"


def write_manifest(root: pathlib.Path, manifest: Any, depth: int = 0) -> None:
  """Writes the manifest; a `_DEEP` string value becomes an array nested `depth` levels (as
  text: json.dumps itself would hit the recursion limit)."""
  text = json.dumps(manifest)
  (root / MANIFEST_NAME).write_text(text.replace(json.dumps(_DEEP), "[" * depth + "]" * depth))


def is_v2(manifest: dict) -> bool:
  return manifest.get("schema_version") == manifest_v2.SCHEMA_VERSION


def artifact_paths(manifest: dict) -> list[str]:
  """Every artifact path of a well-formed manifest that gguf-py parses: v1's shared parts, then
  layers; v2's payload artifacts (its payload-free carrier is not a GGUF gguf-py can open;
  tests/package_v2_test.py attacks it)."""
  if is_v2(manifest):
    carrier = manifest["source_model"]["metadata_artifact_id"]
    return [entry["path"] for entry in manifest["artifact_catalog"]["entries"]
            if entry["id"] != carrier]
  return ([manifest["shared"][role]["path"] for role in ("metadata", "embeddings", "output")]
          + [entry["path"] for entry in manifest["layers"]])


def tensor_paths(manifest: dict) -> list[str]:
  """The artifacts that store tensor bytes (v1's shared.metadata only repeats key/values)."""
  paths = artifact_paths(manifest)
  return paths if is_v2(manifest) else paths[1:]


def rehash(root: pathlib.Path, path: str) -> None:
  """Re-records `path`'s size and SHA-256 in every manifest entry that names it."""
  data = (root / path).read_bytes()
  manifest = read_manifest(root)
  size_field = "byte_size" if is_v2(manifest) else "artifact_bytes"
  for entry in _artifact_entries(manifest):
    if entry.get("path") == path:
      entry[size_field] = len(data)
      entry["sha256"] = hashlib.sha256(data).hexdigest()
  if is_v2(manifest):            # a v2 root binds every digest into its package_id
    manifest["package_id"] = manifest_v2.canonical_package_id(manifest)
  write_manifest(root, manifest)


def _artifact_entries(manifest: dict) -> list[dict]:
  if is_v2(manifest):
    return manifest["artifact_catalog"]["entries"]
  return [*manifest["shared"].values(), *manifest["layers"], *manifest.get("projectors", [])]


_PARSED: dict[bytes, gguf.GGUFReader] = {}


def _parse(path: pathlib.Path) -> gguf.GGUFReader:
  """gguf-py's parse of a file, remembered by content: the fuzzer edits copies of the same few
  pristine files, and parsing one costs far more than the edit (warm it before forking)."""
  key = hashlib.sha256(path.read_bytes()).digest()
  if key not in _PARSED:
    _PARSED[key] = gguf.GGUFReader(path)
  return _PARSED[key]


def warm_parse_cache(root: pathlib.Path) -> None:
  """Parses every artifact of the pristine package once, so forked cases share the parses."""
  for path in artifact_paths(read_manifest(root)):
    _parse(root / path)


def tensor_field_offsets(path: pathlib.Path) -> dict[str, dict[str, int]]:
  """tensor name -> file offsets of its header fields ("n_dims", "dims", "type", "offset") and
  of its data ("data", "n_bytes"), as gguf-py parses them."""
  reader = _parse(path)
  found = {}
  for tensor in reader.tensors:
    start = tensor.field.offset + 8 + len(tensor.name.encode("utf-8"))
    n_dims = len(tensor.shape)
    found[tensor.name] = {"n_dims": start, "dims": start + 4, "type": start + 4 + 8 * n_dims,
                          "offset": start + 8 + 8 * n_dims, "data": int(tensor.data_offset),
                          "n_bytes": int(tensor.n_bytes)}
  return found


def key_field_offsets(path: pathlib.Path) -> dict[str, dict[str, int]]:
  """key -> file offsets of its value type, and of its string length or array count."""
  reader = _parse(path)
  found = {}
  for name, field in reader.fields.items():
    if name.startswith("GGUF."):
      continue
    type_at = field.offset + 8 + len(name.encode("utf-8"))
    entry = {"key_length": field.offset, "type": type_at}
    if field.types[0] == _VT.STRING:
      entry["length"] = type_at + 4
    elif field.types[0] == _VT.ARRAY:
      entry["item_type"], entry["count"] = type_at + 4, type_at + 8
      if field.types[-1] == _VT.STRING and field.data:
        entry["first_item_length"] = type_at + 16
    found[name] = entry
  return found


def header_counts_offset() -> dict[str, int]:
  return {"version": 4, "tensor_count": 8, "kv_count": 16}


def patch(path: pathlib.Path, offset: int, data: bytes) -> None:
  with open(path, "r+b") as handle:
    handle.seek(offset)
    handle.write(data)


def set_tensor_type(path: pathlib.Path, name: str, ggml_type: gguf.GGMLQuantizationType) -> None:
  """The issue's 4-byte edit: a tensor's type id rewritten in place."""
  patch(path, tensor_field_offsets(path)[name]["type"], struct.pack("<I", int(ggml_type)))


def set_tensor_offset(path: pathlib.Path, name: str, relative_offset: int) -> None:
  patch(path, tensor_field_offsets(path)[name]["offset"], struct.pack("<Q", relative_offset))


def set_array_count(path: pathlib.Path, key: str, count: int) -> None:
  patch(path, key_field_offsets(path)[key]["count"], struct.pack("<Q", count))


def flip_tensor_byte(path: pathlib.Path, name: str, position: int = 0) -> None:
  fields = tensor_field_offsets(path)[name]
  offset = fields["data"] + position % fields["n_bytes"]
  data = bytearray(path.read_bytes()[offset:offset + 1])
  patch(path, offset, bytes([data[0] ^ 0xFF]))


# -- the mutators: each edits the copy at `root` and says what it did ---------------------------

def _json_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
  paths = [prefix]
  if isinstance(node, dict):
    for key, value in node.items():
      paths += _json_paths(value, prefix + (key,))
  elif isinstance(node, list):
    for index, value in enumerate(node):
      paths += _json_paths(value, prefix + (index,))
  return paths


def _set_path(node: Any, path: tuple, value: Any, delete: bool) -> Any:
  if not path:
    return value
  parent = node
  for step in path[:-1]:
    parent = parent[step]
  if delete:
    del parent[path[-1]]
  else:
    parent[path[-1]] = value
  return node


def mutate_manifest_value(rng: random.Random, root: pathlib.Path) -> Mutation:
  manifest = read_manifest(root)
  path = rng.choice(_json_paths(manifest)[1:])
  roll = rng.random()
  depth = 0
  if roll < 0.1:
    depth = rng.choice((100, 5000, 100000))
    value, shown = _DEEP, f"an array nested {depth} deep"
  elif roll < 0.25 and path and path[-1] in ("layer_count", "layer_index", "artifact_bytes",
                                             "tensor_count", "tensor_bytes"):
    value = rng.choice((10**6, 10**9, 2**40, 2**62, -(2**63)))
    shown = repr(value)
  else:
    value = rng.choice(HOSTILE_JSON)
    shown = repr(value)[:60]
  delete = rng.random() < 0.1 and len(path) > 0
  manifest = _set_path(manifest, path, value, delete)
  write_manifest(root, manifest, depth)
  return Mutation("manifest_value", f"{'delete' if delete else 'set'} {path} {shown}")


def mutate_manifest_layer_count(rng: random.Random, root: pathlib.Path) -> Mutation:
  """A huge layer_count (optionally with matching fake layer entries elsewhere)."""
  manifest = read_manifest(root)
  manifest["layer_count"] = rng.choice((6, 10**6, 10**9, 2**40, 2**62, 2**63))
  write_manifest(root, manifest)
  return Mutation("manifest_layer_count", f"layer_count {manifest['layer_count']}")


def mutate_manifest_bytes(rng: random.Random, root: pathlib.Path) -> Mutation:
  path = root / MANIFEST_NAME
  data = bytearray(path.read_bytes())
  roll = rng.random()
  if roll < 0.3:
    cut = rng.randrange(len(data))
    data = data[:cut]
    detail = f"truncated at {cut}"
  elif roll < 0.6:
    position = rng.randrange(len(data))
    data[position] = rng.randrange(256)
    detail = f"byte {position} replaced"
  elif roll < 0.8:
    data = bytearray(b"[" * 200000 + b"]" * 200000)
    detail = "nested 200000 deep"
  else:
    position = rng.randrange(len(data))
    data[position:position] = rng.randbytes(rng.randrange(1, 64))
    detail = f"garbage inserted at {position}"
  path.write_bytes(bytes(data))
  return Mutation("manifest_bytes", detail)


def _pick_artifact(rng: random.Random, root: pathlib.Path) -> str:
  return rng.choice(artifact_paths(read_manifest(root)))


def mutate_header_field(rng: random.Random, root: pathlib.Path) -> Mutation:
  """A count, length, dimension, type id or offset in a GGUF header set to a hostile integer."""
  target = _pick_artifact(rng, root)
  path = root / target
  candidates = [(f"header.{name}", offset, 8 if name != "version" else 4)
                for name, offset in header_counts_offset().items()]
  for key, fields in key_field_offsets(path).items():
    candidates += [(f"{key}.{name}", offset, 4 if name in ("type", "item_type") else 8)
                   for name, offset in fields.items()]
  for name, fields in tensor_field_offsets(path).items():
    candidates += [(f"{name}.{field}", fields[field], 4 if field in ("n_dims", "type") else 8)
                   for field in ("n_dims", "dims", "type", "offset")]
  label, offset, width = rng.choice(candidates)
  value = rng.choice(HOSTILE_INTS + tuple(range(0, 40)))
  value &= (1 << (8 * width)) - 1
  patch(path, offset, value.to_bytes(width, "little"))
  rehashed = rng.random() < 0.7
  if rehashed:
    rehash(root, target)
  return Mutation("header_field", f"{target}: {label} = {value}", target, rehashed)


def mutate_header_bytes(rng: random.Random, root: pathlib.Path) -> Mutation:
  target = _pick_artifact(rng, root)
  path = root / target
  data_start = min((fields["data"] for fields in tensor_field_offsets(path).values()),
                   default=path.stat().st_size)
  positions = [rng.randrange(24, data_start) for _ in range(rng.randrange(1, 8))]
  for position in positions:
    patch(path, position, bytes([rng.randrange(256)]))
  rehashed = rng.random() < 0.7
  if rehashed:
    rehash(root, target)
  return Mutation("header_bytes", f"{target}: bytes {positions}", target, rehashed)


_METADATA_KEYS = (
    "glm4moe.block_count", "glm4moe.context_length", "glm4moe.embedding_length",
    "glm4moe.feed_forward_length", "glm4moe.attention.head_count",
    "glm4moe.attention.head_count_kv", "glm4moe.rope.freq_base",
    "glm4moe.attention.layer_norm_rms_epsilon", "glm4moe.expert_count",
    "glm4moe.expert_used_count", "glm4moe.expert_group_count", "glm4moe.expert_group_used_count",
    "glm4moe.attention.key_length", "glm4moe.attention.value_length",
    "glm4moe.rope.dimension_count", "glm4moe.expert_feed_forward_length",
    "glm4moe.expert_shared_count", "glm4moe.leading_dense_block_count",
    "glm4moe.expert_gating_func", "glm4moe.expert_weights_scale", "glm4moe.expert_weights_norm",
    "glm4moe.nextn_predict_layers", "glm4moe.vocab_size", "general.alignment", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.chat_template")


def mutate_metadata_value(rng: random.Random, root: pathlib.Path) -> Mutation:
  """shared.metadata rewritten by gguf-py with one key given a hostile value (and re-hashed,
  so the value itself reaches the config and tokenizer); in a v2 package the first payload
  artifact, whose key/values a loader must ignore."""
  manifest = read_manifest(root)
  target = (artifact_paths(manifest)[0] if is_v2(manifest)
            else manifest["shared"]["metadata"]["path"])
  key = rng.choice(_METADATA_KEYS)
  value, kind = rng.choice(HOSTILE_METADATA)
  path = root / target
  rewritten = path.with_name(path.name + ".new")
  rewrite_gguf(_parse(path), rewritten, keys={key: (value, kind)})
  rewritten.replace(path)
  rehash(root, target)
  return Mutation("metadata_value", f"{key} = {value!r:.40} ({kind.name})", target, True)


def mutate_tensor_bytes(rng: random.Random, root: pathlib.Path) -> Mutation:
  """Tensor data changed and the manifest left alone: corruption that must never load."""
  target = rng.choice(tensor_paths(read_manifest(root)))
  path = root / target
  tensors = tensor_field_offsets(path)
  name = rng.choice(sorted(tensors))
  count = rng.choice((1, 1, 4, 64))
  for _ in range(count):
    flip_tensor_byte(path, name, rng.randrange(tensors[name]["n_bytes"]))
  return Mutation("tensor_bytes", f"{target}: {count} byte(s) of {name} flipped", target)


def mutate_file_size(rng: random.Random, root: pathlib.Path) -> Mutation:
  target = _pick_artifact(rng, root)
  path = root / target
  data = path.read_bytes()
  if rng.random() < 0.5:
    data = data[:rng.randrange(len(data))]
  else:
    data = data + rng.randbytes(rng.randrange(1, 4096))
  path.write_bytes(data)
  rehashed = rng.random() < 0.5
  if rehashed:
    rehash(root, target)
  return Mutation("file_size", f"{target}: now {len(data)} bytes", target, rehashed)


def mutate_file_kind(rng: random.Random, root: pathlib.Path) -> Mutation:
  """The manifest or an artifact replaced by what is not a regular file of the package: a
  FIFO (opening it blocks), a character device (/dev/zero's numbers where this process may make
  one, else a symlink to /dev/zero), or a symlink to an identical copy outside the package.
  Each must be refused, before anything is opened that could block."""
  manifest = read_manifest(root)
  target = rng.choice([MANIFEST_NAME, *artifact_paths(manifest)])
  path = root / target
  form = rng.choice(("fifo", "device", "outside_symlink"))
  if form == "outside_symlink":
    outside = root.parent / f"{root.name}-outside-{path.name}"
    shutil.copyfile(path, outside)
    path.unlink()
    path.symlink_to(outside)
  else:
    path.unlink()
    if form == "fifo":
      os.mkfifo(path)
    else:
      try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))
      except PermissionError:
        form = "symlink to /dev/zero"
        path.symlink_to("/dev/zero")
  return Mutation("file_kind", f"{target}: {form}", None if target == MANIFEST_NAME else target,
                  must_refuse=True)


MUTATORS: dict[str, Callable[[random.Random, pathlib.Path], Mutation]] = {
    "manifest_value": mutate_manifest_value,
    "manifest_layer_count": mutate_manifest_layer_count,
    "manifest_bytes": mutate_manifest_bytes,
    "header_field": mutate_header_field,
    "header_bytes": mutate_header_bytes,
    "metadata_value": mutate_metadata_value,
    "tensor_bytes": mutate_tensor_bytes,
    "file_size": mutate_file_size,
    "file_kind": mutate_file_kind,
}
_WEIGHTS = {"manifest_value": 3, "manifest_layer_count": 1, "manifest_bytes": 1,
            "header_field": 4, "header_bytes": 2, "metadata_value": 3, "tensor_bytes": 2,
            "file_size": 1, "file_kind": 1}


def mutate(seed: int, root: pathlib.Path, kinds: tuple[str, ...] | None = None) -> Mutation:
  """One seeded mutation of the package copy at `root` (of one of `kinds`, default all)."""
  rng = random.Random(seed)
  chosen = list(kinds or _WEIGHTS)
  kind = rng.choices(chosen, weights=[_WEIGHTS[k] for k in chosen])[0]
  return MUTATORS[kind](rng, root)
