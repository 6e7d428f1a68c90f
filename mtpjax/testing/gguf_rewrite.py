"""Copy a GGUF through gguf-py's own reader and writer with some keys or tensors changed.

Tests use it to make the files other converters (older llama.cpp, YaRN-scaled models, broken
exports) would have written, starting from a fixture: every key is copied with its stored type,
every tensor with its stored bytes (quantized ones included) unless the caller edits it.
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable, Iterable, Mapping

import gguf
import numpy as np

TensorEdit = Callable[[list], Iterable[tuple[str, Any]]]


def rewrite_gguf(source: str | pathlib.Path | gguf.GGUFReader, path: str | pathlib.Path, *,
                 keys: Mapping[str, tuple[Any, gguf.GGUFValueType]] | None = None,
                 tensors: TensorEdit | None = None) -> pathlib.Path:
  """Write `path` as a copy of `source` (a file, or gguf-py's reader of one).

  `keys`: {name: (value, type)} added, or replacing the stored value. `tensors`: maps the
  reader's tensor list to the (name, value) pairs to write, in order; a value that is one of
  the reader's tensors is copied as stored, an ndarray is written as float data.
  """
  reader = source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(str(source))
  writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
  keys = dict(keys or {})
  for name, field in reader.fields.items():
    if name.startswith("GGUF.") or name == "general.architecture" or name in keys:
      continue
    kind = field.types[0]
    sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(name, field.contents(), kind, sub_type=sub_type)
  for name, (value, kind) in keys.items():
    writer.add_key_value(name, value, kind)
  pairs = tensors(list(reader.tensors)) if tensors else ((t.name, t) for t in reader.tensors)
  for name, value in pairs:
    if isinstance(value, np.ndarray):
      writer.add_tensor(name, value)
    else:
      writer.add_tensor(name, np.asarray(value.data), raw_shape=value.data.shape,
                        raw_dtype=value.tensor_type)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return pathlib.Path(path)
