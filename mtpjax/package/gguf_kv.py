"""GGUF key/values decoded straight from the file bytes, with the source encoding kept.

gguf-py's `ReaderField.contents()` flattens nested arrays, so we walk the bytes ourselves: the
decoded value feeds `ModelSource.metadata`, and the encoded payload lets the writer copy a key
byte for byte (nested and empty arrays included). The walk enforces the writer's safety limits
(docs/LAYER_PACKAGES.md §2.7).
"""

from __future__ import annotations

import dataclasses
import pathlib
import struct
from typing import Any

import gguf
import numpy as np

from mtpjax import errors

MAX_STRING_BYTES = 1 << 20
MAX_ARRAY_NESTING = 64
LIMIT_REMEDY = ("remove or shorten this key in the source GGUF (gguf-py's gguf_set_metadata / "
                "gguf_new_metadata)")

_VT = gguf.GGUFValueType
_SCALAR_DTYPES = {
    _VT.UINT8: np.dtype("<u1"), _VT.INT8: np.dtype("<i1"), _VT.UINT16: np.dtype("<u2"),
    _VT.INT16: np.dtype("<i2"), _VT.UINT32: np.dtype("<u4"), _VT.INT32: np.dtype("<i4"),
    _VT.FLOAT32: np.dtype("<f4"), _VT.BOOL: np.dtype("?"), _VT.UINT64: np.dtype("<u8"),
    _VT.INT64: np.dtype("<i8"), _VT.FLOAT64: np.dtype("<f8"),
}


@dataclasses.dataclass(frozen=True)
class KeyValue:
  key: str
  type: gguf.GGUFValueType
  value: Any                                          # str | int | float | bool | list
  payload: bytes = dataclasses.field(repr=False)      # the encoded value after its type tag


class _Walker:
  """Decodes one key's value from the mapped file, checking the safety limits on the way."""

  def __init__(self, buffer: memoryview, key: str, path: str):
    self.buffer, self.key, self.path = buffer, key, path

  def _limit_error(self, message: str) -> errors.PackageError:
    return errors.PackageError(f"GGUF metadata {self.key}: {message}", path=self.path,
                               field=self.key, remedy=LIMIT_REMEDY)

  def _string(self, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", self.buffer, offset)
    if length > MAX_STRING_BYTES:
      raise self._limit_error(f"a {length}-byte string exceeds safety limit of "
                              f"{MAX_STRING_BYTES} bytes")
    start = offset + 8
    try:
      return str(self.buffer[start:start + length], "utf-8"), start + length
    except UnicodeDecodeError as error:
      raise self._limit_error(f"a string is not valid UTF-8 ({error})") from error

  def value(self, offset: int, value_type: int, depth: int = 0) -> tuple[Any, int]:
    value_type = _VT(value_type)
    if value_type == _VT.STRING:
      return self._string(offset)
    if value_type in _SCALAR_DTYPES:
      dtype = _SCALAR_DTYPES[value_type]
      return np.frombuffer(self.buffer, dtype, 1, offset)[0].item(), offset + dtype.itemsize
    if depth + 1 > MAX_ARRAY_NESTING:
      raise self._limit_error(f"array nesting exceeds {MAX_ARRAY_NESTING} levels")
    item_type, count = struct.unpack_from("<IQ", self.buffer, offset)
    offset += 12
    if item_type in _SCALAR_DTYPES:
      dtype = _SCALAR_DTYPES[_VT(item_type)]
      items = np.frombuffer(self.buffer, dtype, count, offset).tolist()
      return items, offset + dtype.itemsize * count
    items = []
    for _ in range(count):
      item, offset = self.value(offset, item_type, depth + 1)
      items.append(item)
    return items, offset


def decode_key_value(buffer: memoryview, key: str, value_type: int, value_offset: int,
                     path: str | pathlib.Path) -> KeyValue:
  """One key/value whose value starts at `value_offset` (after its type tag)."""
  try:
    value, end = _Walker(buffer, key, str(path)).value(value_offset, value_type)
  except (struct.error, ValueError) as error:
    raise errors.PackageError(f"GGUF metadata {key} cannot be decoded: {error}", path=str(path),
                              field=key, remedy="re-export the GGUF") from error
  return KeyValue(key, _VT(value_type), value, bytes(buffer[value_offset:end]))


def read_key_values(reader: gguf.GGUFReader, path: str | pathlib.Path) -> list[KeyValue]:
  """Every real key/value of an opened GGUF in file order (the `GGUF.*` pseudo keys excluded)."""
  buffer = memoryview(reader.data)
  found = []
  for name, field in reader.fields.items():
    if name.startswith("GGUF."):
      continue
    (key_length,) = struct.unpack_from("<Q", buffer, field.offset)
    type_offset = field.offset + 8 + key_length
    (value_type,) = struct.unpack_from("<I", buffer, type_offset)
    found.append(decode_key_value(buffer, name, value_type, type_offset + 4, path))
  return found
