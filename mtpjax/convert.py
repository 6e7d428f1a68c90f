"""GGUF / split GGUF / layer package -> orbax checkpoint of the model's parameters.

`python -m mtpjax.convert SRC OUT_DIR [--weights quantized|dense] [--dtype bfloat16|float32]
[--stages N] [--overwrite]`

`--weights=quantized` (the default) keeps GGUF-quantized tensors as their integer and scale
fields (`loading.py`), `dense` dequantizes them to `--dtype`.

The conversion streams part by part (one trunk layer, the embeddings, the output head, the
NextN block): each part is dequantized, saved and dropped before the next is read, so peak host
memory is about one part. Every artifact is SHA-256 checked in the same pass. Everything is
written to a sibling staging directory that is renamed into place only when complete, so a
killed conversion leaves nothing that looks like a checkpoint; `--overwrite` renames the old
checkpoint aside and removes it only after the new one is in place, and staging folders of
dead conversions are removed first (`mtpjax.staging`).
"""

from __future__ import annotations

import math
import pathlib
import shutil
import sys

from absl import app, flags
from tqdm import tqdm

import mtpjax
from mtpjax import checkpoint, disk_space, errors, loading, staging
from mtpjax.models.registry import config_from_gguf
from mtpjax.package import planning
from mtpjax.package.reader import open_source


def convert(src, out_dir, *, dtype: str = "float32", weights: str = "quantized", stages: int = 1,
            overwrite: bool = False, show_progress: bool = True) -> pathlib.Path:
  out_dir = pathlib.Path(out_dir)
  staging.remove_stale(out_dir)
  if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
    raise errors.CheckpointError(
        "the output directory is not empty", path=str(out_dir),
        remedy="choose an empty directory or pass --overwrite")
  loading.resolve_dtype(dtype)
  loading.resolve_weights(weights)
  with open_source(src, verify="sha256") as source:
    cfg = config_from_gguf(source.metadata, source.tensors, source=str(source.path))
    plan = planning.plan_stages(source.layer_count, stages)
    total = sum(info.n_bytes for info in source.tensors.values())
    needed = _checkpoint_bytes(source, weights, dtype)
    disk_space.check_room(out_dir, needed, what="the checkpoint")
    tmp = staging.make_staging_dir(out_dir)
    with disk_space.typed_when_full(out_dir, needed, what="the checkpoint"):
      try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="convert",
                  disable=not show_progress) as bar:
          for name, layout in checkpoint.part_layouts(cfg).items():
            keep = lambda path, name=name, layout=layout: (
                checkpoint.part_of(path, layout)[0] == name)
            _, _, leaves = loading.load_leaves(source, cfg, layout, dtype=dtype, weights=weights,
                                               keep=keep, progress=bar.update)
            checkpoint.save_part(tmp, name, {checkpoint.part_of(p, layout)[1]: a
                                             for p, a in leaves.items()})
            del leaves
        checkpoint.write_record(tmp, {
            "format_version": checkpoint.FORMAT_VERSION,
            "mtpjax_version": mtpjax.__version__,
            "dtype": dtype,
            "weights": weights,
            "model_config": cfg.to_dict(),
            "metadata": source.metadata,
            "source": {
                "kind": source.kind, "path": str(source.path),
                "manifest": None if source.manifest is None else source.manifest.raw,
                "manifest_sha256": source.manifest_sha256,
                "layer_count": source.layer_count,
                "tensor_names": sorted(source.tensors),
                "tensor_types": loading.tensor_types(source),
            },
            "stage_plan": [[s.layer_start, s.layer_end] for s in plan],
            "parts": sorted(checkpoint.part_layouts(cfg)),
        })
        staging.replace_dir(tmp, out_dir)
      except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
  return out_dir


def _checkpoint_bytes(source, weights: str, dtype: str) -> int:
  """About what the checkpoint takes: the GGUF's bytes kept quantized (1.00-1.04x of them, as
  docs/benchmarks.md measures), every element at `dtype`'s width dense."""
  if weights == "quantized":
    return sum(info.n_bytes for info in source.tensors.values()) * 105 // 100
  width = 2 if dtype == "bfloat16" else 4
  return sum(math.prod(info.ne) * width for info in source.tensors.values())


_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "activation dtype, and that of dense parameters")
_WEIGHTS = flags.DEFINE_enum("weights", "quantized", list(loading.WEIGHTS),
                             "quantized: keep GGUF quantization on the device; dense: dequantize")
_STAGES = flags.DEFINE_integer("stages", 1, "pipeline stages recorded in the stage plan")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "replace a non-empty OUT_DIR")


def main(argv):
  if len(argv) != 3:
    raise app.UsageError("usage: python -m mtpjax.convert SRC OUT_DIR [--weights ...] "
                         "[--dtype ...] [--stages N]")
  try:
    out = convert(argv[1], argv[2], dtype=_DTYPE.value, weights=_WEIGHTS.value,
                  stages=_STAGES.value, overwrite=_OVERWRITE.value)
  except errors.MtpjaxError as exc:
    print(f"error: {exc}", file=sys.stderr)
    return 1
  print(out)
  return 0


if __name__ == "__main__":
  app.run(main)
