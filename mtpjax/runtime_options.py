"""The three consumers of the native-MTP flag, built from ONE resolution (SPECULATIVE.md §6).

The loader, every pipeline stage and the server must never disagree on `native_mtp`: verify
passes carry 2 positions per sequence through all stages, and the server's loop and metrics
depend on it. Building all three here from the same `SpeculativeResolution` makes a stale or
default value impossible by construction.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from mtpjax.speculative import SpeculativeResolution


@dataclasses.dataclass(frozen=True)
class ModelLoadOptions:
  """What the loader builds: with `native_mtp` false, no MTP head and no MTP KV cache."""
  dtype: str
  native_mtp: bool
  stages: int = 1
  splits: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class StageConfig:
  """One pipeline stage; the NextN block stays in the plan even when MTP is off."""
  stage_index: int
  layer_start: int
  layer_end: int
  includes_embeddings: bool
  includes_output: bool
  native_mtp: bool

  @property
  def step_positions(self) -> int:
    """Positions per sequence in one decode step: 2 for a verify pass, else 1."""
    return 2 if self.native_mtp else 1

  @property
  def runs_draft(self) -> bool:
    """The last stage holds the NextN block and the head, so it runs the draft."""
    return self.native_mtp and self.includes_output


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
  """The server's view: which engine loop runs, what `/v1/models` says, which metrics exist."""
  native_mtp: bool
  max_len: int
  slots: int
  prefill_buckets: tuple[int, ...]
  timing: bool
  speculative_strategy: str
  speculative_reason: str


def _stage(index: int, count: int, stage_range: Any, native_mtp: bool) -> StageConfig:
  """A planner stage (attributes) or a plain `(layer_start, layer_end)` tuple."""
  if isinstance(stage_range, tuple):
    start, end = stage_range
    return StageConfig(index, int(start), int(end), index == 0, index == count - 1, native_mtp)
  return StageConfig(int(stage_range.stage_index), int(stage_range.layer_start),
                     int(stage_range.layer_end), bool(stage_range.includes_embeddings),
                     bool(stage_range.includes_output), native_mtp)


def consumers_from_resolution(
    resolution: SpeculativeResolution, *, dtype: str, stage_ranges: Sequence[Any], max_len: int,
    slots: int, prefill_buckets: Sequence[int], timing: bool = False,
) -> tuple[ModelLoadOptions, list[StageConfig], GenerationSettings]:
  """Load options, per-stage configs and server settings, all carrying `resolution.native_mtp`."""
  if not stage_ranges:
    raise ValueError("stage_ranges must hold at least one stage")
  flag = resolution.native_mtp
  stages = [_stage(i, len(stage_ranges), r, flag) for i, r in enumerate(stage_ranges)]
  splits = tuple(stage.layer_end for stage in stages[:-1]) or None
  load = ModelLoadOptions(dtype=dtype, native_mtp=flag, stages=len(stages), splits=splits)
  settings = GenerationSettings(
      native_mtp=flag, max_len=int(max_len), slots=int(slots),
      prefill_buckets=tuple(int(b) for b in prefill_buckets), timing=bool(timing),
      speculative_strategy=resolution.requested, speculative_reason=resolution.reason)
  return load, stages, settings
