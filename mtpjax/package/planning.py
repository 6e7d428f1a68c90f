"""Stage split planning: the contiguous layer range each pipeline stage owns (docs/LAYER_PACKAGES.md §8).

Ranges are half-open, non-empty, contiguous and cover `0..layer_count` with the NextN block
included, so the MTP block always lands on the last stage next to the output head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mtpjax import errors


@dataclasses.dataclass(frozen=True)
class StageRange:
  stage_index: int
  layer_start: int
  layer_end: int               # exclusive
  includes_embeddings: bool    # stage 0 owns the input boundary
  includes_output: bool        # the last stage owns the final norm and head


def planning_error(code: str, message: str, *, field: str, remedy: str) -> errors.PlanningError:
  """A PlanningError whose message starts with the upstream code and that carries it as `.code`."""
  error = errors.PlanningError(f"{code}: {message}", field=field, remedy=remedy)
  error.code = code
  return error


def _check_stage_count(layer_count: int, stages: int) -> None:
  if stages <= 0:
    raise planning_error("invalid_stage_count", "--stages must be greater than zero",
                         field="stages", remedy="pass a positive stage count")
  if stages > layer_count:
    raise planning_error("stage_count_exceeds_layer_count",
                         f"stage count {stages} exceeds layer_count {layer_count}",
                         field="stages", remedy=f"use at most {layer_count} stages")


def even_split(layer_count: int, stages: int) -> list[tuple[int, int]]:
  """`base = L // S`; the first `L % S` stages take one layer more."""
  _check_stage_count(layer_count, stages)
  base, extra = divmod(layer_count, stages)
  ranges, start = [], 0
  for stage in range(stages):
    end = start + base + (1 if stage < extra else 0)
    ranges.append((start, end))
    start = end
  return ranges


def explicit_split(layer_count: int, splits: Sequence[int], stages: int) -> list[tuple[int, int]]:
  """Boundaries `b1 < b2 < ...` strictly inside `(0, layer_count)`, one fewer than the stages."""
  remedy = f"pass strictly ascending boundaries inside (0, {layer_count}), one per stage boundary"
  for boundary in splits:
    if not 0 < boundary < layer_count:
      raise planning_error("InvalidSplitBoundary",
                           f"split boundary {boundary} must be inside (0, {layer_count})",
                           field="splits", remedy=remedy)
  for previous, boundary in zip(splits, splits[1:]):
    if boundary <= previous:
      raise planning_error("NonAscendingSplitBoundary",
                           f"split boundary {boundary} does not follow {previous} in ascending "
                           "order", field="splits", remedy=remedy)
  if len(splits) + 1 != stages:
    raise planning_error("NotEnoughNodesForSplits",
                         f"{len(splits)} split boundaries make {len(splits) + 1} stages, but the "
                         f"mesh has {stages} stages", field="splits",
                         remedy="give one boundary fewer than the mesh `stage` axis size")
  edges = [0, *splits, layer_count]
  return list(zip(edges[:-1], edges[1:]))


def plan_stages(layer_count: int, stages: int,
                splits: Sequence[int] | None = None) -> list[StageRange]:
  """The stage plan: explicit boundaries when given, else an even split."""
  if layer_count < 1:
    raise planning_error("invalid_layer_count", f"layer_count {layer_count} must be at least 1",
                         field="layer_count", remedy="plan a package with at least one layer")
  _check_stage_count(layer_count, stages)
  ranges = even_split(layer_count, stages) if splits is None else explicit_split(
      layer_count, list(splits), stages)
  return [StageRange(stage_index=index, layer_start=start, layer_end=end,
                     includes_embeddings=index == 0, includes_output=index == len(ranges) - 1)
          for index, (start, end) in enumerate(ranges)]


def check_stage(stage: StageRange, layer_count: int) -> None:
  """Admission rules of upstream's slice loader, for a stage built by hand."""
  remedy = "build stage ranges with plan_stages()"
  if stage.layer_start >= stage.layer_end:
    raise planning_error("invalid_stage_range", "stage layer_start must be less than layer_end",
                         field="layer_start", remedy=remedy)
  if stage.layer_end > layer_count:
    raise planning_error("invalid_stage_range",
                         f"layer_end exceeds model layer count: stage layer_end {stage.layer_end} "
                         f"exceeds package layer_count {layer_count}", field="layer_end",
                         remedy=remedy)
  if stage.layer_start == 0 and not stage.includes_embeddings:
    raise planning_error("invalid_stage_range",
                         "the first runtime slice must include token embeddings",
                         field="includes_embeddings", remedy=remedy)
  if stage.includes_output and stage.layer_end != layer_count:
    raise planning_error("invalid_stage_range",
                         "only the final runtime slice may include output tensors",
                         field="includes_output", remedy=remedy)
