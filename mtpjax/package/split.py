"""GGUF -> layer package: `python -m mtpjax.package.split SRC.gguf OUT_DIR --model-id ORG/REPO:Q`.

A thin command over `writer.split_gguf`; a refused input prints one error line and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys

from mtpjax import errors
from mtpjax.package import manifest as manifest_lib, writer, writer_v2


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m mtpjax.package.split",
                                   description="Split a GGUF (or any shard of a split GGUF) into "
                                               "a layer package (manifest schema v1 or v2).")
  parser.add_argument("src", help="the .gguf file, or any shard NAME-0000k-of-0000n.gguf")
  parser.add_argument("out_dir", help="the package folder to create")
  parser.add_argument("--model-id", "--model_id", dest="model_id", default=None,
                      help="model coordinate ORG/REPO[:QUANT] (required for a local file)")
  parser.add_argument("--revision", default=None, help="the repository revision of the source")
  parser.add_argument("--file", "--primary-file", dest="primary_file", default=None,
                      help="the source's path inside its repository (default: its file name)")
  parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
  parser.add_argument("--generation-format", "--generation_format", dest="generation_format",
                      choices=writer.GENERATION_FORMATS, default=None,
                      help="how generation.speculative_decoding declares native MTP: the first "
                           "era's inline native-mtp-n1 (v1's default), the later inline mtp "
                           "(v2's default), or the newer proposers form")
  parser.add_argument("--window-policy", "--window_policy", dest="window_policy", default=None,
                      metavar="DEFAULT:MIN:INITIAL:MAX",
                      help="native MTP's draft window, e.g. adaptive:1:2:3 (default "
                           "fixed:1:1:1, one token per step)")
  parser.add_argument("--schema-version", "--schema_version", dest="schema_version", type=int,
                      choices=(1, 2), default=1,
                      help="manifest schema: 1 (shared/ + layers/, default) or 2 (artifact "
                           "catalog + metadata carrier, what published meshllm packages use)")
  args = parser.parse_args(argv)
  split, default_format = ((writer.split_gguf, writer.DEFAULT_STRATEGY) if args.schema_version == 1
                           else (writer_v2.split_gguf_v2, writer_v2.DEFAULT_GENERATION_FORMAT))
  try:
    out = split(args.src, args.out_dir, model_id=args.model_id, revision=args.revision,
                overwrite=args.overwrite, primary_file=args.primary_file,
                generation_format=args.generation_format or default_format,
                window_policy=(None if args.window_policy is None
                               else writer.parse_window_policy(args.window_policy)))
  except errors.MtpjaxError as error:
    print(f"error: {error}", file=sys.stderr)
    return 1
  manifest, digest = manifest_lib.read_manifest(out)
  summary = {"package_path": str(out), "model_id": manifest.model_id,
             "layer_count": manifest.layer_count, "manifest_sha256": digest}
  if manifest.package_id is not None:
    summary["package_id"] = manifest.package_id
  print(json.dumps(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
