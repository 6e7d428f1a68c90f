"""What integrity on load costs: SHA-256 of every artifact and the bounded header walk, against
the reader's whole open-and-read of a package.

  python -m tools.bench_integrity [--package=mtpjax/assets/glm-demo] [--repeats=5]

Prints one JSON line (best of --repeats, files warm in the page cache): `read_s` opens the
package and reads every tensor as a load does (hashing included), `sha256_s` and `header_s` time
the two checks alone over the same files, and `sha256_share` is their part of `read_s`.
"""

from __future__ import annotations

import json
import pathlib
import time

from absl import app, flags

import mtpjax
from mtpjax.package import gguf_header, integrity, manifest as manifest_lib, reader

_DEMO = pathlib.Path(mtpjax.__file__).resolve().parent / "assets" / "glm-demo"
_PACKAGE = flags.DEFINE_string("package", str(_DEMO), "a layer package directory")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed repetitions (the best is reported)")


def _best(work, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    work()
    times.append(time.perf_counter() - start)
  return min(times)


def main(argv):
  del argv
  root = pathlib.Path(_PACKAGE.value)
  manifest = manifest_lib.load_manifest(root)
  files = [root / artifact.path for artifact in (
      manifest.shared_metadata, manifest.shared_embeddings, *manifest.layers,
      manifest.shared_output)]
  total_bytes = sum(path.stat().st_size for path in files)

  def read_all():
    with reader.open_source(root) as source:
      for _, data in source.iter_stage_tensors(0, source.layer_count, embeddings=True,
                                               output=True):
        data.sum()      # touch every byte, as dequantization does

  read_all()            # warm the page cache
  read_s = _best(read_all, _REPEATS.value)
  sha_s = _best(lambda: [integrity.sha256_file(path) for path in files], _REPEATS.value)
  header_s = _best(lambda: [gguf_header.check_header(path) for path in files], _REPEATS.value)
  print(json.dumps({
      "package": str(root), "files": len(files), "mb": round(total_bytes / 1e6, 2),
      "read_s": round(read_s, 4), "sha256_s": round(sha_s, 4), "header_s": round(header_s, 4),
      "sha256_mb_per_s": round(total_bytes / 1e6 / sha_s, 1),
      "sha256_share": round(sha_s / read_s, 4), "header_share": round(header_s / read_s, 4)}))


if __name__ == "__main__":
  app.run(main)
