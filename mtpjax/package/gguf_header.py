"""A bounded walk of a GGUF header, run before gguf-py parses the file.

gguf-py trusts every declared count: an array that claims 2^62 items makes it loop and allocate
without bound, and tensor data ranges are never compared with each other. This walk reads the
header through a read-only mmap and checks, before anything is allocated, that every count and
length fits in the bytes the file has, that each tensor's type and shape give a byte size whose
range lies inside the data section, and that no two tensor ranges overlap. It decodes nothing
but the few fields it needs, so it costs one pass over the header.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import pathlib
import struct

import gguf

from mtpjax import errors
from mtpjax.package.gguf_kv import LIMIT_REMEDY, MAX_ARRAY_NESTING, MAX_STRING_BYTES

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4                  # GGML_MAX_DIMS
MAX_TENSOR_NAME_BYTES = 1024
_VT = gguf.GGUFValueType
_SCALAR_BYTES = {_VT.UINT8: 1, _VT.INT8: 1, _VT.UINT16: 2, _VT.INT16: 2, _VT.UINT32: 4,
                 _VT.INT32: 4, _VT.FLOAT32: 4, _VT.BOOL: 1, _VT.UINT64: 8, _VT.INT64: 8,
                 _VT.FLOAT64: 8}
_VALUE_TYPES = frozenset(int(kind) for kind in _VT)
_U64 = struct.Struct("<Q")
_KV_MIN_BYTES = 8 + 4 + 1              # key length, value type, the smallest value
_TENSOR_INFO_MIN_BYTES = 8 + 4 + 8 + 4 + 8   # name length, n_dims, one dim, type, offset
_REMEDY = "the file is corrupt or not a GGUF: re-download it or re-export it from the source"


@dataclasses.dataclass(frozen=True)
class TensorExtent:
  """Where one tensor's bytes lie: [start, start + n_bytes) as absolute file offsets."""
  name: str
  ggml_type: gguf.GGMLQuantizationType
  ne: tuple[int, ...]
  start: int
  n_bytes: int


@dataclasses.dataclass(frozen=True)
class HeaderLayout:
  version: int
  alignment: int
  data_offset: int
  file_bytes: int
  tensors: tuple[TensorExtent, ...]
  keys: tuple[tuple[str, int, int], ...] = ()   # (key, value type, offset of its value)


class _Walk:
  """One pass over the header bytes; every read is checked against the file's end first."""

  def __init__(self, buffer, path: str, payload_free: bool = False):
    self.buffer, self.path, self.size = buffer, path, len(buffer)
    self.payload_free = payload_free
    self.keys: list[tuple[str, int, int]] = []

  def error(self, message: str, field: str | None = None,
            remedy: str = _REMEDY) -> errors.PackageError:
    return errors.PackageError(f"cannot read GGUF {self.path}: {message}", path=self.path,
                               field=field,
                               remedy=remedy)

  def need(self, offset: int, n_bytes: int, field: str, what: str) -> None:
    if n_bytes > self.size - offset:
      raise self.error(f"{what} needs {n_bytes} bytes at offset {offset}, but the file has "
                       f"{self.size} bytes", field)

  def take(self, fmt: str, offset: int, field: str, what: str) -> tuple[tuple, int]:
    n_bytes = struct.calcsize(fmt)
    self.need(offset, n_bytes, field, what)
    return struct.unpack_from(fmt, self.buffer, offset), offset + n_bytes

  def string(self, offset: int, field: str, what: str, limit: int) -> tuple[int, int]:
    """(start, end) of a length-prefixed string, its length checked before it is read."""
    (length,), offset = self.take("<Q", offset, field, f"the length of {what}")
    if length > limit:
      raise self.error(f"{what}: a {length}-byte string exceeds safety limit of {limit} bytes",
                       field, remedy=LIMIT_REMEDY)
    self.need(offset, length, field, f"{what} ({length} bytes)")
    return offset, offset + length

  def text(self, offset: int, field: str, what: str, limit: int) -> tuple[str, int]:
    start, end = self.string(offset, field, what, limit)
    try:
      return str(self.buffer[start:end], "utf-8"), end
    except UnicodeDecodeError as error:
      raise self.error(f"{what} is not valid UTF-8 ({error})", field) from error

  def skip_value(self, offset: int, value_type: int, key: str, depth: int = 0) -> int:
    if value_type not in _VALUE_TYPES:
      raise self.error(f"metadata {key} has unknown value type {value_type}", key)
    value_type = _VT(value_type)
    if value_type == _VT.STRING:
      return self.string(offset, key, f"a string of {key}", MAX_STRING_BYTES)[1]
    if value_type in _SCALAR_BYTES:
      self.need(offset, _SCALAR_BYTES[value_type], key, f"the value of {key}")
      return offset + _SCALAR_BYTES[value_type]
    if depth + 1 > MAX_ARRAY_NESTING:
      raise self.error(f"metadata {key}: array nesting exceeds {MAX_ARRAY_NESTING} levels", key,
                       remedy=LIMIT_REMEDY)
    (item_type, count), offset = self.take("<IQ", offset, key, f"the array header of {key}")
    if item_type not in _VALUE_TYPES:
      raise self.error(f"metadata {key} is an array of unknown value type {item_type}", key)
    item_bytes = _SCALAR_BYTES.get(_VT(item_type), 8 if item_type == _VT.STRING else 12)
    if count * item_bytes > self.size - offset:
      raise self.error(f"metadata {key} declares {count} array items (at least "
                       f"{count * item_bytes} bytes), but only {self.size - offset} bytes "
                       "remain", key)
    if item_type in _SCALAR_BYTES:
      return offset + count * item_bytes
    if item_type == _VT.STRING:
      return self._skip_strings(offset, count, key)
    for _ in range(count):
      offset = self.skip_value(offset, item_type, key, depth + 1)
    return offset

  def _skip_strings(self, offset: int, count: int, key: str) -> int:
    """`skip_value` for a string array (a vocabulary: the header's bulk), inlined for speed."""
    unpack, buffer, size = _U64.unpack_from, self.buffer, self.size
    for _ in range(count):
      if offset + 8 > size:
        break
      (length,) = unpack(buffer, offset)
      if length > MAX_STRING_BYTES:
        raise self.error(f"a string of {key}: a {length}-byte string exceeds safety limit of "
                         f"{MAX_STRING_BYTES} bytes", key, remedy=LIMIT_REMEDY)
      offset += 8 + length
    else:
      if offset <= size:
        return offset
    raise self.error(f"metadata {key}: its {count} strings run past the end of the file "
                     f"({size} bytes)", key)

  def key_values(self, offset: int, count: int) -> tuple[int, int]:
    """(offset after the key/values, general.alignment)."""
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    seen = set()
    for index in range(count):
      key, offset = self.text(offset, f"key #{index}", f"metadata key #{index}", MAX_STRING_BYTES)
      if key in seen:
        raise self.error(f"metadata key {key} appears twice", key)
      seen.add(key)
      (value_type,), offset = self.take("<I", offset, key, f"the value type of {key}")
      self.keys.append((key, value_type, offset))
      if key == "general.alignment":
        if value_type != _VT.UINT32:
          raise self.error("general.alignment must be a UINT32", key)
        (alignment,), _ = self.take("<I", offset, key, "general.alignment")
        if alignment == 0 or alignment & (alignment - 1):
          raise self.error(f"general.alignment {alignment} is not a power of two", key)
      offset = self.skip_value(offset, value_type, key)
    return offset, alignment

  def tensor_info(self, offset: int, index: int, alignment: int
                  ) -> tuple[str, int, tuple[int, ...], int, int]:
    """(name, type, ne, relative data offset, n_bytes) of tensor info #index."""
    name, offset = self.text(offset, f"tensor #{index}", f"the name of tensor #{index}",
                             MAX_TENSOR_NAME_BYTES)
    (n_dims,), offset = self.take("<I", offset, name, f"the dimension count of {name}")
    if not 1 <= n_dims <= MAX_DIMS:
      raise self.error(f"tensor {name} declares {n_dims} dimensions; GGUF allows 1..{MAX_DIMS}",
                       name)
    ne, offset = self.take(f"<{n_dims}Q", offset, name, f"the dimensions of {name}")
    (type_id, relative), offset = self.take("<IQ", offset, name, f"the type and offset of {name}")
    if any(dim == 0 for dim in ne):
      raise self.error(f"tensor {name} has a zero dimension {list(ne)}", name)
    try:
      ggml_type = gguf.GGMLQuantizationType(type_id)
      block, type_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
      raise self.error(f"tensor {name} has unknown ggml type id {type_id}", name) from None
    if ne[0] % block:
      raise self.error(f"tensor {name} of type {ggml_type.name} has a first dimension {ne[0]} "
                       f"that is not a multiple of its block size {block}", name)
    elements = 1
    for dim in ne:      # Python ints: no overflow, and each dim >= 1 so the product only grows
      elements *= dim
      if elements // block * type_bytes > (1 << 63 if self.payload_free else self.size):
        raise self.error(f"tensor {name} of type {ggml_type.name} and shape {list(ne)} needs "
                         f"more bytes than the whole file has ({self.size})", name)
    if relative % alignment:
      raise self.error(f"tensor {name} has data offset {relative}, not a multiple of the "
                       f"alignment {alignment}", name)
    return name, ggml_type, tuple(ne), relative, elements // block * type_bytes

  def walk(self) -> HeaderLayout:
    (magic, version), offset = self.take("<II", 0, "GGUF.magic", "the GGUF magic and version")
    if magic != gguf.GGUF_MAGIC:
      raise self.error("the file does not start with the GGUF magic", "GGUF.magic")
    if version & 0xFFFF == 0:
      raise self.error("the file is big-endian; mtpjax reads little-endian GGUFs",
                       "GGUF.version", remedy="convert the file to little-endian")
    if version not in SUPPORTED_VERSIONS:
      raise self.error(f"GGUF version {version} is not supported (supported: "
                       f"{SUPPORTED_VERSIONS})", "GGUF.version",
                       remedy="re-export the file with a current llama.cpp")
    (n_tensors, n_kv), offset = self.take("<QQ", offset, "GGUF.tensor_count", "the counts")
    if n_kv * _KV_MIN_BYTES > self.size - offset:
      raise self.error(f"the header declares {n_kv} metadata keys, more than the file can hold",
                       "GGUF.kv_count")
    if n_tensors * _TENSOR_INFO_MIN_BYTES > self.size - offset:
      raise self.error(f"the header declares {n_tensors} tensors, more than the file can hold",
                       "GGUF.tensor_count")
    offset, alignment = self.key_values(offset, n_kv)
    infos, names = [], set()
    for index in range(n_tensors):
      info = self.tensor_info(offset, index, alignment)
      offset = self._after_info(offset, info)
      if info[0] in names:
        raise self.error(f"tensor {info[0]} appears twice", info[0])
      names.add(info[0])
      infos.append(info)
    data_offset = -(-offset // alignment) * alignment
    extents = tuple(TensorExtent(name, kind, ne, data_offset + relative, n_bytes)
                    for name, kind, ne, relative, n_bytes in infos)
    if self.payload_free:
      if self.size != data_offset:
        raise self.error(f"a payload-free metadata carrier must end at its data offset "
                         f"{data_offset}, but the file has {self.size} bytes (it carries tensor "
                         "payload bytes)", "GGUF.data_offset")
    else:
      self._check_ranges(extents)
    return HeaderLayout(version=version, alignment=alignment, data_offset=data_offset,
                        file_bytes=self.size, tensors=extents, keys=tuple(self.keys))

  @staticmethod
  def _after_info(offset: int, info: tuple) -> int:
    name, _, ne, _, _ = info
    return offset + 8 + len(name.encode("utf-8")) + 4 + 8 * len(ne) + 4 + 8

  def _check_ranges(self, extents: tuple[TensorExtent, ...]) -> None:
    previous = None
    for extent in sorted(extents, key=lambda item: item.start):
      if extent.start + extent.n_bytes > self.size:
        raise self.error(f"tensor {extent.name} ({extent.ggml_type.name}, shape {list(extent.ne)}"
                         f") occupies bytes [{extent.start}, {extent.start + extent.n_bytes}), "
                         f"past the end of the file ({self.size} bytes)", extent.name)
      if previous is not None and extent.start < previous.start + previous.n_bytes:
        raise self.error(f"tensors {previous.name} and {extent.name} overlap: "
                         f"[{previous.start}, {previous.start + previous.n_bytes}) and "
                         f"[{extent.start}, {extent.start + extent.n_bytes})", extent.name)
      previous = extent


def trailing_bytes(layout: HeaderLayout) -> int:
  """How many bytes the file has past its last tensor's data and the alignment padding after
  it, where a GGUF writer ends the file."""
  end = max((t.start + t.n_bytes for t in layout.tensors), default=layout.data_offset)
  return layout.file_bytes - -(-end // layout.alignment) * layout.alignment


def walk_header(buffer, path: str | os.PathLike, *, payload_free: bool = False) -> HeaderLayout:
  """`check_header` over bytes already in memory (the carrier, hashed in the same read)."""
  if len(buffer) == 0:
    raise errors.PackageError(f"GGUF {path} is empty", path=str(path), remedy=_REMEDY)
  return _Walk(buffer, str(path), payload_free).walk()


def check_header(path: str | os.PathLike, *, payload_free: bool = False) -> HeaderLayout:
  """The header's layout, every count, length and tensor range checked against the file size.

  Raises PackageError (naming the file, the key or tensor, and a remedy) on anything a reader
  could not safely allocate or map. `payload_free`: a v2 metadata carrier, whose tensor
  directory describes bytes stored elsewhere: the file must end exactly at its data offset.
  """
  path = pathlib.Path(path)
  try:
    with open(path, "rb") as handle:
      size = os.fstat(handle.fileno()).st_size
      if size == 0:
        raise errors.PackageError(f"GGUF {path} is empty", path=str(path), remedy=_REMEDY)
      with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        return _Walk(buffer, str(path), payload_free).walk()
  except OSError as error:
    raise errors.PackageError(f"cannot read GGUF {path}: {error}", path=str(path),
                              remedy="check that the file exists and is readable") from error
