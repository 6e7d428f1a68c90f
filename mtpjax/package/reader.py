"""Open a model source (layer package, plain GGUF or split GGUF) and read its tensors by stage.

Nothing is read into RAM at open: gguf-py memory-maps each file, and a stage's tensors are
yielded one artifact at a time so a converter never holds more than one fragment
(docs/LAYER_PACKAGES.md §3-§4). A package artifact is hashed as it is opened for its tensors (the
pass that brings it into the page cache for the mapping), before any tensor is handed out.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
from collections.abc import Iterable, Iterator
from typing import Any

import gguf
import numpy as np

from mtpjax import errors
from mtpjax.package import gguf_header, integrity, manifest as manifest_lib, planning
from mtpjax.package.gguf_kv import KeyValue, read_key_values
from mtpjax.package.issues import is_int
from mtpjax.package.roles import (OWNED_ROLES, ROLE_EMBEDDING, ROLE_FINAL_NORM, ROLE_LAYER,  # noqa: F401
                                  ROLE_METADATA, ROLE_OUTPUT, stage_selects, tensor_role)

_SPLIT_NAME = re.compile(r"(?P<prefix>.+)-(?P<index>[0-9]{5})-of-(?P<count>[0-9]{5})\.gguf")
VERIFY_MODES = ("size", "sha256")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  name: str
  ggml_type: gguf.GGMLQuantizationType
  ne: tuple[int, ...]      # GGUF order, fastest axis first; the numpy shape is reversed(ne)
  n_bytes: int
  path: str                # the file that holds it


def infer_activation_width(tensors: Iterable[TensorInfo]) -> int:
  """§2.7: elements of the first layer's `.attn_norm.weight` (`.hc_attn_norm.weight` preferred)."""
  layered = sorted((tensor_role(info.name)[1], position, info) for position, info in
                   enumerate(tensors) if tensor_role(info.name)[0] == ROLE_LAYER)
  for suffix in (".hc_attn_norm.weight", ".attn_norm.weight"):
    for _, _, info in layered:
      if info.name.endswith(suffix):
        width = math.prod(info.ne)
        if width > manifest_lib.U32_MAX:
          raise errors.PackageError(
              f"activation_width inferred from {info.name} is {width}, above the u32 limit",
              path=info.path, field="activation_width",
              remedy="set activation_width in the manifest or re-split the source GGUF")
        return width
  raise errors.PackageError("activation_width cannot be inferred: no layer tensor ends in "
                            ".attn_norm.weight", field="activation_width",
                            remedy="set activation_width ({arch}.embedding_length)")


def open_gguf(path: pathlib.Path | str) -> gguf.GGUFReader:
  """gguf-py's memory-mapped reader, with its untyped parse failures turned into PackageError.

  The header is walked with every count, length and tensor range bounded first
  (`gguf_header.check_header`), so a crafted file cannot make gguf-py loop or allocate without
  bound, and no tensor's bytes overlap another's.
  """
  gguf_header.check_header(path)
  try:
    reader = gguf.GGUFReader(path)
  except Exception as error:  # gguf-py raises ValueError, KeyError, IndexError ... on bad files
    raise errors.PackageError(f"cannot read GGUF {path}: {error!r}", path=str(path),
                              remedy="check that the file is a complete GGUF (re-download it)"
                              ) from error
  if reader.byte_order != "I":
    raise errors.PackageError(f"GGUF {path} is big-endian; mtpjax reads little-endian GGUFs",
                              path=str(path), remedy="convert the file to little-endian")
  return reader


def split_shard_paths(path: pathlib.Path) -> list[pathlib.Path] | None:
  """Every sibling `{prefix}-{k:05d}-of-{n:05d}.gguf` of a shard, or None for a plain file."""
  match = _SPLIT_NAME.fullmatch(path.name)
  if match is None:
    return None
  count = int(match["count"])
  if not 1 <= int(match["index"]) <= count:
    raise errors.PackageError(f"split GGUF shard {path} has index {match['index']} outside "
                              f"1..{count}", path=str(path), remedy="rename the shard")
  shards = [path.with_name(f"{match['prefix']}-{k:05d}-of-{count:05d}.gguf")
            for k in range(1, count + 1)]
  for shard in shards:
    if not shard.is_file():
      raise errors.PackageError(f"split GGUF shard {path} is missing sibling {shard}",
                                path=str(shard), remedy="download every shard into one folder")
  return shards


@dataclasses.dataclass(frozen=True)
class _Part:
  """One file a source reads: a package artifact (with its manifest entry) or a GGUF shard."""
  label: str                                   # "metadata", "embeddings", "layer:3", "output", ...
  path: pathlib.Path
  artifact: manifest_lib.Artifact | None = None


class _OpenFile:
  def __init__(self, reader: gguf.GGUFReader, part: _Part | None = None,
               located: dict[str, tuple[bool, Any]] | None = None):
    """`part`: a package artifact, whose manifest tensor_count / tensor_bytes must describe the
    file (a type id rewritten to a smaller type would otherwise still fit its byte range).
    `located`: for a v2 payload, the carrier's locator (`ModelSource._located`); the file's own
    directory must agree with it (`_check_located`)."""
    self.reader = reader
    self.index = {tensor.name: tensor for tensor in reader.tensors}
    if located is not None:          # v2: the locator, not the manifest counts, describes it
      _check_located(self.index, located, part)
    elif part is not None and part.artifact is not None:
      found = (len(reader.tensors), sum(int(tensor.n_bytes) for tensor in reader.tensors))
      declared = (part.artifact.tensor_count, part.artifact.tensor_bytes)
      if found != declared:
        raise errors.PackageError(
            f"package artifact {part.path} holds {found[0]} tensors of {found[1]} bytes, but the "
            f"manifest says {declared[0]} of {declared[1]}", path=str(part.path),
            field=part.label, remedy="re-download the package or re-split the source GGUF")


def _check_located(index: dict[str, Any], located: dict[str, tuple[bool, Any]],
                   part: _Part) -> None:
  """Every tensor the locator places in this payload is in its directory with that type, shape
  and byte range; any other tensor in the file is a copy of one owned elsewhere (same type and
  shape), which the reader skips."""
  found = {name: (int(tensor.tensor_type), tuple(int(dim) for dim in tensor.shape),
                  int(tensor.data_offset), int(tensor.n_bytes)) for name, tensor in index.items()}
  differ = []
  for name, (owned, where) in located.items():
    if owned and found.get(name) != where:
      differ.append(name)
  differ += [name for name, (kind, ne, _, _) in found.items()
             if name not in located or (kind, ne) != located[name][1][:2]]
  if differ:
    raise errors.PackageError(
        f"payload artifact {part.path} disagrees with the metadata carrier's locator for "
        f"{sorted(set(differ))[:5]} (name, type, shape or byte range)", path=str(part.path),
        field=part.label,
        remedy="re-download the package or re-split the source GGUF")


class ModelSource:
  """A package, plain GGUF or split GGUF behind one interface; build it with `open_source`."""

  def __init__(self, *, kind: str, path: pathlib.Path, parts: list[_Part],
               key_values: list[KeyValue], manifest: manifest_lib.Manifest | None = None,
               manifest_sha256: str | None = None, open_files: dict | None = None,
               verified_artifacts: tuple[str, ...] = (),
               hashed: frozenset[pathlib.Path] = frozenset()):
    self.kind = kind
    self.path = path
    self.manifest = manifest
    self.manifest_sha256 = manifest_sha256
    self.key_values = key_values
    self.metadata: dict[str, Any] = {item.key: item.value for item in key_values}
    self.verified_artifacts = verified_artifacts   # artifacts checked at open (size or sha256)
    self.files = tuple(part.path for part in parts)
    arch = self.metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
      raise errors.PackageError(f"model source {path} has no general.architecture",
                                path=str(parts[0].path), field="general.architecture",
                                remedy="re-export the GGUF with its architecture key")
    self.arch = arch
    self._parts = parts
    self._open: dict[pathlib.Path, _OpenFile] = dict(open_files or {})
    self._hashed = set(hashed)   # artifacts whose SHA-256 matched (once per source)
    self._tensors: dict[str, TensorInfo] | None = None
    self._locations: dict[str, _Part] = {}
    if manifest is None:
      for part in parts:
        for name in self._open[part.path].index:
          if name in self._locations:
            raise errors.PackageError(f"tensor {name} appears in both {self._locations[name].path} "
                                      f"and {part.path}", path=str(part.path),
                                      remedy="re-split the GGUF")
          self._locations[name] = part
      self.layer_count = 1 + max((tensor_role(name)[1] for name in self._locations
                                  if tensor_role(name)[0] == ROLE_LAYER), default=-1)
    else:
      self.layer_count = manifest.layer_count
      self._by_label = {part.label: part for part in parts}

  # -- parts ---------------------------------------------------------------------------------

  def _file(self, part: _Part, *, keep: bool, tensor_data: bool) -> _OpenFile:
    """Opens a part, checking a package artifact's path and size each time it is opened; when
    its tensor data will be read (`tensor_data`), its SHA-256 too (once per source), in the
    pass that brings the file into the page cache just before its tensors are mapped."""
    opened = self._open.get(part.path)
    check_sha = tensor_data and part.artifact is not None and part.path not in self._hashed
    if part.artifact is not None and (opened is None or check_sha):
      self._verify(part, check_sha=check_sha)
    if opened is None:
      try:
        opened = _OpenFile(open_gguf(part.path), part, self._located(part))
      except errors.PackageError:
        if part.artifact is not None and not check_sha:   # corruption is named as such first
          self._verify(part, check_sha=True)
        raise
      if keep:
        self._open[part.path] = opened
    return opened

  def _verify(self, part: _Part, *, check_sha: bool) -> None:
    integrity.verify_part(self.path, part.artifact.path, role=part.label,
                          artifact_bytes=part.artifact.artifact_bytes,
                          sha256=part.artifact.sha256, check_sha=check_sha)
    if check_sha:
      self._hashed.add(part.path)

  def _located(self, part: _Part) -> dict[str, tuple[bool, Any]] | None:
    """For a v2 payload: every carrier tensor as (owned by this part, its (type, ne, start,
    n_bytes)); None for v1 and GGUFs."""
    locator = self.manifest.tensor_locator if self.manifest is not None else None
    if locator is None or part.artifact is None:
      return None
    return {name: (where.label == part.label,
                   (where.ggml_type, where.ne, where.start, where.n_bytes))
            for name, where in locator.items()}

  def _part_of(self, name: str) -> _Part:
    locator = self.manifest.tensor_locator if self.manifest is not None else None
    if locator is not None:
      if name not in locator:
        raise errors.PackageError(f"tensor {name} is not in {self.path}", path=str(self.path),
                                  remedy="check the tensor name against the source's tensors")
      return self._by_label[locator[name].label]
    if self.manifest is None:
      if name not in self._locations:
        raise errors.PackageError(f"tensor {name} is not in {self.path}", path=str(self.path),
                                  remedy="check the tensor name against the source's tensors")
      return self._locations[name]
    role, index = tensor_role(name)
    if role == ROLE_LAYER:
      if index >= self.layer_count:
        raise errors.PackageError(f"tensor {name} names layer {index}, but layer_count is "
                                  f"{self.layer_count}", path=str(self.path),
                                  remedy="check the tensor name against the package's layers")
      return self._by_label[f"layer:{index}"]
    label = {ROLE_EMBEDDING: "embeddings", ROLE_OUTPUT: "output", ROLE_FINAL_NORM: "output",
             ROLE_METADATA: "metadata"}[role]
    return self._by_label[label]

  def _info(self, tensor: Any, part: _Part) -> TensorInfo:
    return TensorInfo(name=tensor.name, ggml_type=tensor.tensor_type,
                      ne=tuple(int(dim) for dim in tensor.shape), n_bytes=int(tensor.n_bytes),
                      path=str(part.path))

  def _is_replica(self, name: str, part: _Part) -> bool:
    """v1 repeats metadata-role tensors in every fragment (only shared.metadata's count); a v2
    payload may hold copies of tensors the locator places in another payload."""
    if self.manifest is None:
      return False
    if self.manifest.tensor_locator is not None:
      return self.manifest.tensor_locator[name].label != part.label
    return part.label != "metadata" and tensor_role(name)[0] == ROLE_METADATA

  def _tensor_parts(self) -> list[_Part]:
    """Parts that store tensors: not projectors, and not a v2 metadata carrier (payload-free)."""
    carrier = self.manifest is not None and self.manifest.tensor_locator is not None
    return [part for part in self._parts if not part.label.startswith("projector")
            and not (carrier and part.label == "metadata")]

  # -- public interface ------------------------------------------------------------------------

  @property
  def tensors(self) -> dict[str, TensorInfo]:
    """Every tensor by name; for a package the union over artifacts (opened on first use)."""
    if self._tensors is None:
      found = {}
      for part in self._tensor_parts():
        opened = self._file(part, keep=self.manifest is None, tensor_data=False)
        for tensor in opened.reader.tensors:
          if not self._is_replica(tensor.name, part):
            found[tensor.name] = self._info(tensor, part)
      self._tensors = found
    return self._tensors

  @property
  def activation_width(self) -> int:
    """The manifest's value, else `{arch}.embedding_length`, else inferred (§2.7)."""
    if self.manifest is not None and self.manifest.activation_width is not None:
      return self.manifest.activation_width
    declared = self.metadata.get(f"{self.arch}.embedding_length")
    if declared is not None:
      if not is_int(declared) or declared <= 0:
        raise errors.PackageError(f"{self.arch}.embedding_length is {declared!r}; it must be a "
                                  "positive integer", path=str(self.path),
                                  field=f"{self.arch}.embedding_length",
                                  remedy="fix the GGUF metadata")
      return declared
    return infer_activation_width(self.tensors.values())

  def raw(self, name: str) -> np.ndarray:
    """A tensor's bytes as gguf-py types them (F32/F16/I*; uint8 for BF16 and quants), copied
    out of the file's mapping (`_private`)."""
    part = self._part_of(name)
    opened = self._file(part, keep=True, tensor_data=True)
    if name not in opened.index:
      raise errors.PackageError(f"tensor {name} is not in {part.path}", path=str(part.path),
                                remedy="check the tensor name against the source's tensors")
    return _private(opened.index[name].data)

  def _check_request(self, layer_start: int, layer_end: int) -> None:
    if not 0 <= layer_start < layer_end:
      raise errors.PackageError("stage layer_start must be less than layer_end (and >= 0), got "
                                f"[{layer_start}, {layer_end})", path=str(self.path),
                                remedy="request a non-empty layer range")
    if layer_end > self.layer_count:
      raise errors.PackageError(f"stage layer_end {layer_end} exceeds package layer_count "
                                f"{self.layer_count}", path=str(self.path),
                                remedy="plan stages with mtpjax.package.planning.plan_stages")

  def _stage_parts(self, layer_start: int, layer_end: int, embeddings: bool, output: bool,
                   extra: set[str]) -> list[_Part]:
    if self.manifest is None:
      holders = {self._part_of(name).path for name in extra}
      holders.update(part.path for name, part in self._locations.items()
                     if stage_selects(name, layer_start, layer_end, embeddings=embeddings,
                                      output=output))
      return [part for part in self._parts if part.path in holders]
    labels = {"metadata"} | {self._part_of(name).label for name in extra}
    if self.manifest.tensor_locator is not None:     # v2: where the selected tensors are stored
      labels.update(where.label for name, where in self.manifest.tensor_locator.items()
                    if stage_selects(name, layer_start, layer_end, embeddings=embeddings,
                                     output=output))
    labels.update(f"layer:{index}" for index in range(layer_start, layer_end))
    if embeddings:
      labels.add("embeddings")
    if output:
      labels.add("output")
    return [part for part in self._tensor_parts() if part.label in labels]

  def _walk(self, layer_start: int, layer_end: int, embeddings: bool, output: bool,
            extra: Iterable[str]) -> Iterator[tuple[TensorInfo, Any]]:
    """Checks the request now (not on the first `next`) and returns the stage's tensors."""
    self._check_request(layer_start, layer_end)
    extra = set(extra)
    parts = self._stage_parts(layer_start, layer_end, embeddings, output, extra)

    def walk() -> Iterator[tuple[TensorInfo, Any]]:
      for part in parts:
        opened = self._file(part, keep=False, tensor_data=True)
        for tensor in opened.reader.tensors:
          if self._is_replica(tensor.name, part):
            continue
          if tensor.name in extra or stage_selects(tensor.name, layer_start, layer_end,
                                                   embeddings=embeddings, output=output):
            yield self._info(tensor, part), tensor
        absent = sorted(name for name in extra if self._part_of(name) is part
                        and name not in opened.index)
        if absent:
          raise errors.PackageError(f"tensors {absent} needed by this stage are not in "
                                    f"{part.path}", path=str(part.path),
                                    remedy="check that the source has them")
        del opened

    return walk()

  def stage_tensor_names(self, layer_start: int, layer_end: int, *, embeddings: bool,
                         output: bool, extra: Iterable[str] = ()) -> list[str]:
    """The names a stage loads: package artifact order (metadata, embeddings, layers, output),
    or file order for a GGUF."""
    return [info.name for info, _ in self._walk(layer_start, layer_end, embeddings, output, extra)]

  def iter_stage_tensors(self, layer_start: int, layer_end: int, *, embeddings: bool,
                         output: bool, extra: Iterable[str] = ()
                         ) -> Iterator[tuple[TensorInfo, np.ndarray]]:
    """(info, raw bytes as `raw` gives them) for a stage, one artifact at a time; `extra`
    names tensors owned by other parts that the stage needs too (e.g. token_embd.weight for
    the MTP head)."""
    return ((info, _private(tensor.data))
            for info, tensor in self._walk(layer_start, layer_end, embeddings, output, extra))

  def close(self) -> None:
    """Drops the cached memory maps (views already handed out stay valid)."""
    self._open.clear()

  def __enter__(self) -> ModelSource:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()


def _private(mapped: np.ndarray) -> np.ndarray:
  """A tensor copied out of its file's memory map. Arrays made from a view can alias it (XLA:CPU
  takes aligned host arrays without a copy), and then a served model would read the file for
  ever after its hash was checked: a truncated file killed the server with SIGBUS, a rewritten
  one changed its answers. One tensor at a time, so the copy adds a tensor to peak memory."""
  return np.array(mapped, copy=True)


# -- open_source -----------------------------------------------------------------------------

def _package_parts(root: pathlib.Path, manifest: manifest_lib.Manifest) -> list[_Part]:
  if manifest.tensor_locator is not None:      # v2: the carrier, then each payload once
    return ([_Part("metadata", root / manifest.shared_metadata.path, manifest.shared_metadata)]
            + [_Part(artifact.label, root / artifact.path, artifact)
               for artifact in manifest.payloads]
            + [_Part(f"projector:{position}", root / projector.path, projector)
               for position, projector in enumerate(manifest.projectors)])
  parts = [_Part("metadata", root / manifest.shared_metadata.path, manifest.shared_metadata),
           _Part("embeddings", root / manifest.shared_embeddings.path, manifest.shared_embeddings)]
  parts += [_Part(f"layer:{layer.layer_index}", root / layer.path, layer)
            for layer in manifest.layers]
  parts.append(_Part("output", root / manifest.shared_output.path, manifest.shared_output))
  parts += [_Part(f"projector:{position}", root / projector.path, projector)
            for position, projector in enumerate(manifest.projectors)]
  return parts


def _scope_parts(parts: list[_Part], scope: Any, layer_count: int) -> list[_Part]:
  """The artifacts `verify_scope` covers: all, shared.metadata only, or one stage's parts."""
  if scope == "all":
    return parts
  if scope == "metadata":
    return parts[:1]
  if isinstance(scope, planning.StageRange):
    planning.check_stage(scope, layer_count)
    labels = {"metadata"} | {f"layer:{i}" for i in range(scope.layer_start, scope.layer_end)}
    labels |= {part.label for part in parts if part.label.startswith("shared:")}   # v2
    if scope.includes_embeddings:
      labels |= {"embeddings", "projector:0"}
    if scope.includes_output:
      labels.add("output")
    return [part for part in parts if part.label in labels]
  raise errors.PackageError(f"verify_scope {scope!r} is not 'all', 'metadata' or a StageRange",
                            field="verify_scope", remedy="pass one of those")


def _open_package(root: pathlib.Path, verify: str, verify_scope: Any) -> ModelSource:
  manifest, digest = manifest_lib.read_manifest(root)
  parts = _package_parts(root, manifest)
  verified = []
  v2 = manifest.tensor_locator is not None
  hashed = {parts[0].path} if v2 else set()      # a v2 carrier was hashed as it was read
  for part in _scope_parts(parts, verify_scope, manifest.layer_count):
    # shared.metadata is always hashed: its key/values configure everything else
    check_sha = verify == "sha256" or (part is parts[0] and not v2)
    integrity.verify_part(root, part.artifact.path, role=part.label,
                          artifact_bytes=part.artifact.artifact_bytes, sha256=part.artifact.sha256,
                          check_sha=check_sha)
    verified.append(part.artifact.path)
    if check_sha:
      hashed.add(part.path)
  metadata_part = parts[0]
  if v2:
    key_values, open_files = list(manifest.carrier_key_values), {}
  else:
    opened = _OpenFile(open_gguf(metadata_part.path), metadata_part)
    key_values = read_key_values(opened.reader, metadata_part.path)
    open_files = {metadata_part.path: opened}
  return ModelSource(kind="package", path=root, parts=parts, manifest=manifest,
                     manifest_sha256=digest, key_values=key_values, open_files=open_files,
                     verified_artifacts=tuple(verified), hashed=frozenset(hashed))


def _open_gguf_files(path: pathlib.Path) -> ModelSource:
  shards = split_shard_paths(path)
  paths = shards or [path]
  opened = {shard: _OpenFile(open_gguf(shard)) for shard in paths}
  key_values = read_key_values(opened[paths[0]].reader, paths[0])
  metadata = {item.key: item.value for item in key_values}
  declared = metadata.get("split.count")
  remedy = "download every shard of the same split into one folder"
  if shards is None and declared not in (None, 0, 1):
    raise errors.PackageError(f"GGUF {path} says split.count {declared} but its name does not end "
                              "in -0000k-of-0000n.gguf", path=str(path), field="split.count",
                              remedy="restore the shard's original file name")
  if shards is not None:
    if declared is not None and declared != len(shards):
      raise errors.PackageError(f"split GGUF {paths[0]} says split.count {declared}, but its name "
                                f"says {len(shards)} shards", path=str(paths[0]),
                                field="split.count", remedy=remedy)
    total = sum(len(item.index) for item in opened.values())
    declared_total = metadata.get("split.tensors.count")
    if declared_total is not None and declared_total != total:
      raise errors.PackageError(f"split GGUF {paths[0]} says split.tensors.count "
                                f"{declared_total}, but the shards hold {total} tensors",
                                path=str(paths[0]), field="split.tensors.count", remedy=remedy)
    for number, shard in enumerate(shards):
      field = opened[shard].reader.get_field("split.no")
      if field is not None and field.contents() != number:
        raise errors.PackageError(f"split GGUF shard {shard} says split.no {field.contents()}, "
                                  f"expected {number}", path=str(shard), field="split.no",
                                  remedy=remedy)
  return ModelSource(kind="gguf" if shards is None else "split-gguf", path=path,
                     parts=[_Part(shard.name, shard) for shard in paths], key_values=key_values,
                     open_files=opened)


def open_source(path: str | pathlib.Path, *, verify: str = "size",
                verify_scope: str | planning.StageRange = "all") -> ModelSource:
  """Opens a package directory (or its model-package.json), a plain GGUF or any split shard.

  For a package, the manifest is validated and the artifacts in `verify_scope` ("all",
  "metadata", or a StageRange) are checked now: their size, and with verify="sha256" their hash.
  Every other artifact's path and size are checked when it is first opened, and whatever the
  mode, an artifact's SHA-256 is checked when it is opened for its tensors, before any is read
  (shared.metadata's at open): a corrupt artifact never loads. GGUF inputs carry no expected
  sizes or hashes, so `verify` does not apply to them; every GGUF's header is bounds-checked.
  """
  if verify not in VERIFY_MODES:
    raise errors.PackageError(f"verify={verify!r} must be one of {VERIFY_MODES}", field="verify",
                              remedy="pass 'size' or 'sha256'")
  path = pathlib.Path(path)
  if path.name == manifest_lib.MANIFEST_NAME and path.is_file():
    path = path.parent
  if path.is_dir():
    return _open_package(path, verify, verify_scope)
  if path.is_file():
    return _open_gguf_files(path)
  raise errors.PackageError(f"model source {path} does not exist", path=str(path),
                            remedy="pass a layer-package directory, a .gguf file or a split shard")
