"""The generated tiny model as a named source (`embedded:tiny`, the `tiny` config variant).

A deterministic random tiny model with an MTP head that copies the trunk, built on first use
and cached per build recipe. The build happens in a temporary folder renamed into place, so
concurrent first runs are safe: one rename wins and the others use the winner's package.
Importing this module registers the source (`configs/glm.py` does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import shutil
import tempfile

from absl import logging

from mtpjax import disk_space, embedded, errors
from mtpjax.gguf import tensors as gguf_tensors
from mtpjax.gguf import tokenizer as gguf_tokenizer
from mtpjax.package import gguf_kv, reader, writer
from mtpjax.package import manifest as manifest_lib
from mtpjax.testing import tiny_glm

TINY_SOURCE = "embedded:tiny"
EMBEDDED_SPEC = tiny_glm.TinyGlmSpec(mtp_copies_trunk=True)
EMBEDDED_MODEL_ID = "mtpjax/embedded-tiny-glm:F32"
# The modules whose code decides the package's bytes: a change to any of them (new weights
# recipe, tokenizer, package layout) must not be served from a stale cache.
_RECIPE_MODULES = (tiny_glm, writer, reader, manifest_lib, gguf_kv, gguf_tensors,
                   gguf_tokenizer)


def _recipe_key(spec: tiny_glm.TinyGlmSpec) -> str:
  """Names the cache entry after everything that determines the package."""
  digest = hashlib.sha256(json.dumps({"model_id": EMBEDDED_MODEL_ID,
                                      "spec": dataclasses.asdict(spec)}, sort_keys=True).encode())
  for module in _RECIPE_MODULES:
    digest.update(pathlib.Path(module.__file__).read_bytes())
  return digest.hexdigest()[:16]


def embedded_package_dir(cache_dir: str | None = None,
                         spec: tiny_glm.TinyGlmSpec = EMBEDDED_SPEC) -> pathlib.Path:
  """Path of the cached tiny package (a directory), building it if it is missing."""
  root = embedded.cache_root(cache_dir) / "mtpjax"
  final = root / f"embedded-{_recipe_key(spec)}"
  if (final / manifest_lib.MANIFEST_NAME).is_file():
    return final
  try:
    root.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.build-", dir=root))
  except OSError as e:
    raise errors.PackageError(f"cannot create the embedded model's cache folder: {e}",
                              path=str(root), field="cache_dir",
                              remedy="set --config.cache_dir to a writable folder") from e
  try:
    with disk_space.typed_when_full(final, None, what="the embedded tiny package"):
      logging.info("building the embedded tiny GLM package in %s (first run only)", final)
      gguf_path = staging / "source" / "tiny-glm.gguf"
      gguf_path.parent.mkdir()
      tiny_glm.write_tiny_glm_gguf(gguf_path, spec)
      built = writer.split_gguf(gguf_path, staging / "package", model_id=EMBEDDED_MODEL_ID)
      try:
        built.rename(final)
      except OSError:
        if not (final / manifest_lib.MANIFEST_NAME).is_file():
          raise                          # not a lost race: a real failure to install
        logging.info("another process built %s first; using it", final)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return final


embedded.register_source(TINY_SOURCE, embedded_package_dir)
