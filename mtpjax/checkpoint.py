"""Converted checkpoints: orbax parts per model piece plus one JSON record of provenance.

Layout of a checkpoint directory:
  mtpjax-checkpoint.json   model config, GGUF key/values (tokenizer, template), manifest_sha256,
                           source, dtype, mtpjax version, and the list of parts
  parts/embed/             orbax checkpoint of token_embd
  parts/layer-000/ ...     one per trunk layer
  parts/output/            output_norm (+ head)
  parts/mtp/               the NextN block, when the source has one
With `weights` "quantized" (the default), a GGUF-quantized tensor is saved as its block fields,
so the checkpoint's bytes are about the GGUF's tensor bytes.
Parts mirror the package's artifacts, so a pipeline stage restores only the parts it owns,
each array straight onto its target sharding.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from mtpjax import errors
from mtpjax.models.config import ModelConfig
from mtpjax.models.interface import StageLayout

RECORD_NAME = "mtpjax-checkpoint.json"
# 2: projection matrices are stored [in, out] (`models.primitives.LinearWeight`); a version 1
# checkpoint holds them [out, in], which square matrices would restore silently transposed.
# 3: projections and experts are modules, so their parameters sit one level deeper
# (`attn/wq/weight`, `ffn/experts/up_exps`).
# 4: weights may be quantized (the record's `weights`): a quantized parameter is its block
# fields (`attn/wq/weight/qs`, `.../d`), typed by the record's `source.tensor_types`.
# 5: MLA's per-head `attn/wk_b` / `attn/wv_b` are quantized like projections; a version 4
# checkpoint of an MLA model holds them dense.
FORMAT_VERSION = 5


def is_checkpoint(path) -> bool:
  return (pathlib.Path(path) / RECORD_NAME).is_file()


def part_layouts(cfg: ModelConfig) -> dict[str, StageLayout]:
  """Each part as the smallest StageLayout that holds exactly its parameters."""
  n = cfg.n_layers
  parts = {"embed": StageLayout(0, 0, True, False, False)}
  for i in range(n):
    parts[f"layer-{i:03d}"] = StageLayout(i, i + 1, False, False, False)
  parts["output"] = StageLayout(n, n, False, True, False)
  if cfg.has_mtp:
    parts["mtp"] = StageLayout(n, n, False, False, True)
  return parts


def part_of(path: tuple, layout: StageLayout) -> tuple[str, tuple]:
  """(part name, path inside that part) of a parameter of a stage model."""
  head = path[0]
  if head == "embed":
    return "embed", path
  if head == "layers":
    return f"layer-{layout.layer_start + path[1]:03d}", ("layers", 0) + path[2:]
  if head in ("output_norm", "head"):
    return "output", path
  return "mtp", path


def _key(path: tuple) -> str:
  return "/".join(str(p) for p in path)


def save_part(directory: pathlib.Path, name: str, leaves: dict[tuple, jax.Array]) -> None:
  checkpointer = ocp.StandardCheckpointer()   # orbax takes absolute paths only
  checkpointer.save(pathlib.Path(directory).absolute() / "parts" / name,
                    {_key(p): a for p, a in leaves.items()})
  checkpointer.wait_until_finished()


def write_record(directory: pathlib.Path, record: dict[str, Any]) -> None:
  (directory / RECORD_NAME).write_text(json.dumps(record, indent=1, sort_keys=True))


def read_record(directory) -> dict[str, Any]:
  path = pathlib.Path(directory) / RECORD_NAME
  try:
    record = json.loads(path.read_text())
  except (OSError, json.JSONDecodeError) as exc:
    raise errors.CheckpointError(f"cannot read the checkpoint record: {exc}", path=str(path),
                                 remedy="re-run python -m mtpjax.convert") from exc
  if record.get("format_version") != FORMAT_VERSION:
    raise errors.CheckpointError(
        f"checkpoint format {record.get('format_version')} is not {FORMAT_VERSION} (this "
        f"mtpjax reads version {FORMAT_VERSION} only)", path=str(path), field="format_version",
        remedy="convert the source again: python -m mtpjax.convert SRC OUT_DIR "
               "[--weights=quantized|dense]")
  return record


def restore_leaves(directory, layout: StageLayout, expected: dict[tuple, Any],
                   sharding_fn=None) -> dict[tuple, jax.Array]:
  """Restore the parameters at `expected` paths, each read directly onto its sharding."""
  by_part: dict[str, dict[str, tuple]] = {}
  for path in expected:
    part, inner = part_of(path, layout)
    by_part.setdefault(part, {})[_key(inner)] = path
  out: dict[tuple, jax.Array] = {}
  checkpointer = ocp.StandardCheckpointer()
  for part, keys in by_part.items():
    part_dir = pathlib.Path(directory).absolute() / "parts" / part
    if not part_dir.exists():
      raise errors.CheckpointError(
          f"checkpoint part {part} is missing", path=str(part_dir), field=part,
          remedy="re-run python -m mtpjax.convert on the source")
    metadata = checkpointer.metadata(part_dir)
    tree = getattr(metadata, "item_metadata", metadata)
    target = {}
    for key, path in keys.items():
      want = expected[path]
      sharding = sharding_fn(path, tuple(want.shape)) if sharding_fn else None
      if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      target[key] = jax.ShapeDtypeStruct(want.shape, want.dtype, sharding=sharding)
    if set(tree) != set(target):
      raise errors.CheckpointError(
          f"checkpoint part {part} holds {sorted(tree)} but the model needs {sorted(target)}",
          path=str(part_dir), field=part,
          remedy="re-run python -m mtpjax.convert (the checkpoint is from another model)")
    restored = checkpointer.restore(part_dir, target)
    for key, path in keys.items():
      out[path] = restored[key]
  return out

