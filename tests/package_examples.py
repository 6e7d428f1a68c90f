"""Small package fixtures for tests: the docs/LAYER_PACKAGES.md §9 example and tiny GGUFs.

The §9 example's artifacts are not GGUFs: each file holds the ASCII bytes of its own name, so it
exercises manifest, path and integrity handling only. `write_gguf` writes real GGUFs with
gguf-py for reader and writer round trips.
"""

from __future__ import annotations

import copy
import json
import pathlib
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

import gguf
import numpy as np

from mtpjax import errors
from mtpjax.package import manifest as manifest_lib
from mtpjax.package.manifest import MANIFEST_NAME

_A64 = "a" * 64

# docs/LAYER_PACKAGES.md §9, verbatim: a 3-layer package whose last block (index 2) is the NextN block.
EXAMPLE_MANIFEST: dict[str, Any] = {
    "schema_version": 1,
    "model_id": "meshllm/GLM-4.7-Flash-MTP-GGUF:Q4_K_M",
    "source_model": {
        "path": "/models/GLM-4.7-Flash-Q4_K_M-mtp.gguf",
        "sha256": _A64,
        "repo": "meshllm/GLM-4.7-Flash-MTP-GGUF",
        "revision": "0123456789abcdef0123456789abcdef01234567",
        "primary_file": "GLM-4.7-Flash-Q4_K_M-mtp.gguf",
        "canonical_ref": "meshllm/GLM-4.7-Flash-MTP-GGUF@0123456789abcdef0123456789abcdef01234567"
                         "/GLM-4.7-Flash-Q4_K_M-mtp.gguf",
        "distribution_id": "GLM-4.7-Flash-Q4_K_M-mtp",
        "files": [{"path": "GLM-4.7-Flash-Q4_K_M-mtp.gguf", "size_bytes": 123, "sha256": _A64}],
    },
    "format": "layer-package",
    "layer_count": 3,
    "activation_width": 2048,
    "generation": {"speculative_decoding": {"default": "native-mtp-n1", "strategies": {
        "native-mtp-n1": {
            "type": "native-mtp", "prediction_depth": 1, "layer_indices": [2],
            "window_policy": {"default": "fixed", "initial_window": 1, "min_window": 1,
                              "max_window": 1}}}}},
    "shared": {
        "metadata": {"path": "shared/metadata.gguf", "tensor_count": 0, "tensor_bytes": 0,
                     "artifact_bytes": 8, "sha256":
                     "45447b7afbd5e544f7d0f1df0fccd26014d9850130abd3f020b89ff96b82079f"},
        "embeddings": {"path": "shared/embeddings.gguf", "tensor_count": 1, "tensor_bytes": 1,
                       "artifact_bytes": 10, "sha256":
                       "302049d75567a9b3a1f9a359e27ffd4eb303d7a51e4dd302d6051e73aa6f6482"},
        "output": {"path": "shared/output.gguf", "tensor_count": 2, "tensor_bytes": 2,
                   "artifact_bytes": 6, "sha256":
                   "e0ee8bb50685e05fa0f47ed04203ae953fdfd055f5bd2892ea186504254f8c3a"},
    },
    "layers": [
        {"layer_index": 0, "path": "layers/layer-000.gguf", "tensor_count": 1, "tensor_bytes": 1,
         "artifact_bytes": 6,
         "sha256": "4fbec69b941195fd56f8212a5000e304129451d82efca94ff0e0fb2d5355472e"},
        {"layer_index": 1, "path": "layers/layer-001.gguf", "tensor_count": 1, "tensor_bytes": 1,
         "artifact_bytes": 6,
         "sha256": "77ea7eee3d80b1a38f83906dd3048e2689457eb90e18a7d12f839c5ae37106a2"},
        {"layer_index": 2, "path": "layers/layer-002.gguf", "tensor_count": 1, "tensor_bytes": 1,
         "artifact_bytes": 6,
         "sha256": "95cf1a2e1698fe3ca1fcc3f653119146b271d0b62e487ec264441e886a11bd06"},
    ],
    "skippy_abi_version": "0.1.0",
    "created_at_unix_secs": 1790000000,
}

# The bytes of each example artifact: the ASCII of its own name.
EXAMPLE_FILE_BYTES = {
    "shared/metadata.gguf": b"metadata", "shared/embeddings.gguf": b"embeddings",
    "shared/output.gguf": b"output", "layers/layer-000.gguf": b"layer0",
    "layers/layer-001.gguf": b"layer1", "layers/layer-002.gguf": b"layer2",
}


def example_manifest() -> dict[str, Any]:
  """A fresh deep copy of the §9 manifest, safe to mutate."""
  return copy.deepcopy(EXAMPLE_MANIFEST)


def assert_error_rule(test: Any, manifest: dict, code: str, message: str) -> None:
  """`code` is an error issue of `manifest` (one of its messages holds `message`, every one has
  a remedy), and parsing the manifest's bytes raises a ManifestError that carries it."""
  found = manifest_lib.manifest_issues(manifest)
  matching = [item for item in found if item["code"] == code]
  test.assertNotEmpty(matching, f"{code} not in {found}")
  test.assertTrue(any(message in item["message"] for item in matching), matching)
  test.assertTrue(all(item["severity"] == "error" and item["remediation"] for item in matching))
  with test.assertRaises(errors.ManifestError) as raised:
    manifest_lib.parse_manifest(json.dumps(manifest).encode(), path="pkg/model-package.json")
  test.assertIn(code, [item["code"] for item in raised.exception.issues])
  test.assertIn("pkg/model-package.json", str(raised.exception))


def write_example_package(root: str | pathlib.Path, manifest: dict | None = None,
                          files: Mapping[str, bytes] | None = None) -> pathlib.Path:
  """Writes the §9 package (or a variant: another manifest, other file contents) under root."""
  root = pathlib.Path(root)
  for relative, content in (EXAMPLE_FILE_BYTES if files is None else files).items():
    (root / relative).parent.mkdir(parents=True, exist_ok=True)
    (root / relative).write_bytes(content)
  (root / MANIFEST_NAME).write_text(json.dumps(example_manifest() if manifest is None
                                               else manifest, indent=2), encoding="utf-8")
  return root


def write_gguf(path: str | pathlib.Path, tensors: Mapping[str, np.ndarray], *,
               arch: str = "llama",
               key_values: Iterable[tuple[str, Any, gguf.GGUFValueType]] = (),
               split_max_tensors: int = 0) -> list[pathlib.Path]:
  """A real GGUF written by gguf-py (F32/F16 arrays as given); returns the written paths.

  With `split_max_tensors`, gguf-py's own splitting writes `stem-0000k-of-0000n.gguf` shards.
  """
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
  for key, value, value_type in key_values:
    writer.add_key_value(key, value, value_type)   # array element types are inferred by gguf-py
  for name, array in tensors.items():
    writer.add_tensor(name, array)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return writer.format_shard_names(path)


def package_copy(test: Any, package: pathlib.Path) -> pathlib.Path:
  """A writable copy of `package` (a folder), removed when the test ends: hostile edits go to
  the copy, never the shipped files."""
  root = temporary_directory(test) / "pkg"
  shutil.copytree(package, root)
  return root


def temporary_directory(test: Any) -> pathlib.Path:
  """A fresh folder removed when the test (or, given a class, the test class) ends.

  absltest's create_tempdir needs parsed absl flags, which pytest does not provide.
  """
  holder = tempfile.TemporaryDirectory(prefix="mtpjax-package-")
  (test.addClassCleanup if isinstance(test, type) else test.addCleanup)(holder.cleanup)
  return pathlib.Path(holder.name)
