"""Split a GGUF into a schema v2 layer package (docs/LAYER_PACKAGES.md §10).

The payload artifacts are the v1 fragments with each tensor stored once (metadata-role tensors
such as `rope_freqs.weight` go with the embeddings), no repeated key/values (only
`general.alignment`, which places their data) and layer files named with 5 digits. A
payload-free carrier GGUF holds every key/value, the full tensor directory and the
`skippy.package.*` locator arrays; the root lists the artifacts and carries the canonical
`package_id`. The steps every schema shares (arguments, staging, exactly-once check, atomic
install) are `writer.split_with`.
"""

from __future__ import annotations

import functools
import json
import pathlib
import struct
import time

import gguf
import numpy as np

from mtpjax.package import carrier as carrier_lib, gguf_header, integrity, manifest as manifest_lib
from mtpjax.package import manifest_v2, writer
from mtpjax.package.reader import open_source

CARRIER_ID = "metadata"
CARRIER_PATH = "shared/metadata.gguf"
GENERATOR = "mtpjax"
DEFAULT_GENERATION_FORMAT = "mtp"       # what upstream's v2 writer emits
FORMAT = "gguf"                         # upstream's v2 writer's `format` (v1: layer-package)


def fragment_plan(layer_count: int, common: bool = False) -> dict[str, writer.Fragment]:
  """Payload artifacts by id: embeddings (with the metadata-role tensors), layers, output; with
  `common`, one `common` artifact instead of embeddings and output (upstream's newer layout)."""
  if common:
    plan = {"common": writer.Fragment("common", "shared/common.gguf", layer_count, layer_count,
                                      embeddings=True, output=True, key_values=False)}
  else:
    plan = {"embeddings": writer.Fragment("embeddings", "shared/embeddings.gguf", 0, 0,
                                          embeddings=True, key_values=False)}
  plan.update({f"layer-{index:05d}": writer.Fragment(
      f"layer {index}", f"layers/layer-{index:05d}.gguf", index, index + 1,
      metadata_tensors=False, key_values=False) for index in range(layer_count)})
  if not common:
    plan["output"] = writer.Fragment("output", "shared/output.gguf", layer_count, layer_count,
                                     output=True, metadata_tensors=False, key_values=False)
  return plan


def _array(item_type: gguf.GGUFValueType, values: list[int]) -> writer.Encoded:
  dtype = {gguf.GGUFValueType.UINT32: "<u4", gguf.GGUFValueType.UINT64: "<u8"}[item_type]
  return writer.Encoded(struct.pack("<IQ", item_type, len(values))
                         + np.asarray(values, dtype=dtype).tobytes())


def _write_carrier(inputs: writer.PackageInputs, locations: dict[str, tuple[int, int, int, int]],
                   part_count: int) -> dict:
  """The payload-free carrier: key/values, the source's tensor directory, the locator arrays;
  padded so the file ends exactly at its data offset."""
  source = inputs.source
  target = inputs.staging / CARRIER_PATH
  target.parent.mkdir(parents=True, exist_ok=True)
  out = writer.FragmentWriter(target, source.arch)
  try:
    writer.copy_key_values(out, source.key_values)
    out.add_bool(carrier_lib.METADATA_ONLY_KEY, True)
    out.add_uint32(carrier_lib.PART_COUNT_KEY, part_count)
    out.add_uint32(carrier_lib.LOCATOR_SCHEMA_KEY, carrier_lib.LOCATOR_SCHEMA)
    names = list(source.tensors)
    for column, (key, item_type) in enumerate(carrier_lib.LOCATOR_ARRAYS.items()):
      out.add_key_value(key, _array(item_type, [locations[name][column] for name in names]),
                        gguf.GGUFValueType.ARRAY)
    for name, info in source.tensors.items():
      data = source.raw(name)
      out.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=info.ggml_type)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_ti_data_to_file()
    handle = out.fout[0]
    out.write_padding(handle, handle.tell())
  finally:
    out.close()
  return {"id": CARRIER_ID, "path": CARRIER_PATH, "byte_size": target.stat().st_size,
          "sha256": integrity.sha256_file(target)}


def _source_model(record: dict) -> dict:
  """The v2 `source_model` from the v1 record: no local path, files with byte_size."""
  source = {"sha256": record["sha256"], "metadata_artifact_id": CARRIER_ID}
  for field in ("repo", "revision", "primary_file", "canonical_ref", "distribution_id"):
    if record.get(field) is not None:
      source[field] = record[field]
  source["files"] = [{"path": entry["path"], "byte_size": entry["size_bytes"],
                      "sha256": entry["sha256"]} for entry in record["files"]]
  return source


def write_package(inputs: writer.PackageInputs, common: bool = False,
                  plan: dict[str, writer.Fragment] | None = None) -> None:
  """Writes the payload artifacts, then the carrier that locates their tensors, then the root.

  `plan` (default `fragment_plan`) may put a tensor in several payloads, as upstream's first v2
  writer copied model-wide tensors into every file: the first payload by id owns it.
  """
  source, staging = inputs.source, inputs.staging
  plan = plan or fragment_plan(source.layer_count, common)
  part_ids = sorted(plan)                                   # part index = position by id
  entries, locations = [], {}
  for part, artifact_id in enumerate(part_ids):
    written = writer.write_fragment(source, plan[artifact_id], staging)
    layout = gguf_header.check_header(staging / written["path"])
    for extent in layout.tensors:
      locations.setdefault(extent.name, (part, extent.start, extent.n_bytes, layout.alignment))
    entries.append({"id": artifact_id, "path": written["path"],
                    "byte_size": written["artifact_bytes"], "sha256": written["sha256"]})
  entries.append(_write_carrier(inputs, locations, len(part_ids)))
  root = {"schema_version": manifest_v2.SCHEMA_VERSION, "package_id": "",
          "model_id": inputs.model_id, "source_model": _source_model(inputs.source_model),
          "format": FORMAT, "layer_count": source.layer_count,
          "artifact_catalog": {"entries": sorted(entries, key=lambda entry: entry["id"])}}
  if inputs.generation is not None:
    root["generation"] = inputs.generation
  root.update({"native_abi_version": writer.ABI_STAMP, "generator_version": GENERATOR,
               "created_at_unix_secs": int(time.time())})
  root["package_id"] = manifest_v2.canonical_package_id(root)
  (staging / manifest_lib.MANIFEST_NAME).write_text(json.dumps(root, indent=2) + "\n",
                                                    encoding="utf-8")
  with open_source(staging) as built:     # every payload's directory agrees with the locator
    built.tensors  # noqa: B018


def split_gguf_v2(src: str | pathlib.Path, out_dir: str | pathlib.Path, *,
                  model_id: str | None, revision: str | None = None, overwrite: bool = False,
                  primary_file: str | None = None,
                  generation_format: str = DEFAULT_GENERATION_FORMAT,
                  window_policy: dict | None = None, common: bool = False) -> pathlib.Path:
  """`writer.split_gguf` for schema v2; the package loads exactly like its v1 twin. `common`
  puts every non-layer tensor in one artifact, as upstream's newer writer does."""
  return writer.split_with(functools.partial(write_package, common=common), src, out_dir,
                           model_id=model_id, revision=revision,
                           overwrite=overwrite, primary_file=primary_file,
                           generation_format=generation_format, window_policy=window_policy)
