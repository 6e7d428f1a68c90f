"""The consumers of the native-MTP flag, built from ONE resolution (docs/SPECULATIVE.md §6).

The loader, every pipeline stage and the server must never disagree on `native_mtp`: verify
passes carry 2 positions per sequence through all stages, and the server's loop and metrics
depend on it. The loader's options and the server's settings are built here from the same
`SpeculativeResolution`; the stages get their layouts and their engine from `load_options`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from mtpjax.draft_window import DraftWindow
from mtpjax.speculative import SpeculativeResolution


@dataclasses.dataclass(frozen=True)
class ModelLoadOptions:
  """What the loader builds: with `native_mtp` false, no MTP head and no MTP KV cache."""
  dtype: str
  native_mtp: bool


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
  speculative_type: str = "off"    # what drafts: native-mtp, ngram-*, composite, or off
  draft_window: DraftWindow = DraftWindow()    # the engine compiles for its max


def consumers_from_resolution(
    resolution: SpeculativeResolution, *, dtype: str, max_len: int, slots: int,
    prefill_buckets: Sequence[int], timing: bool = False,
) -> tuple[ModelLoadOptions, GenerationSettings]:
  """Load options and server settings, both carrying `resolution.native_mtp`."""
  flag = resolution.native_mtp
  settings = GenerationSettings(
      native_mtp=flag, max_len=int(max_len), slots=int(slots),
      prefill_buckets=tuple(int(b) for b in prefill_buckets), timing=bool(timing),
      speculative_strategy=resolution.requested, speculative_reason=resolution.reason,
      speculative_type=resolution.strategy_type or "off",
      draft_window=resolution.draft_window)
  return ModelLoadOptions(dtype=dtype, native_mtp=flag), settings
