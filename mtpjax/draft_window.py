"""Native MTP's draft window: how many tokens one step drafts, per slot, as (min, initial, max).

Resolved once with the strategy (`speculative.resolve_speculative`) and carried by its result:

- a package's `native-mtp-n1` strategy with the seed's `fixed` 1/1/1 policy (or none), and a
  direct GGUF, draft 1/1/1;
- the newer packages' strategy id `mtp`, or a `window_policy` that allows more than one token,
  default to at most DEFAULT_MAX_DRAFT_TOKENS (the policy's own `min_window` when that is more),
  following mesh-llm's later package eras;
- `speculative.max_draft_tokens` (defaults or per-model scope) sets the maximum, within
  1..MAX_DRAFT_TOKENS and within the package policy's bounds; anything else is refused with a
  `SpeculativeConfigError` naming the field.

`adaptive` (the policy's `default`, or `mtp` without a policy) lets each slot's window move
within the bounds (`engine/scheduler.py`); `fixed` keeps it at `initial`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mtpjax.errors import SpeculativeConfigError
from mtpjax.package.manifest import WindowPolicy

MAX_DRAFT_TOKENS = 8            # the deepest window mtpjax runs (mesh-llm's cap)
DEFAULT_MAX_DRAFT_TOKENS = 3    # a package that allows more drafts this many unless told
MULTI_TOKEN_ID = "mtp"          # the strategy id whose packages default to multi-token windows


@dataclasses.dataclass(frozen=True)
class DraftWindow:
  """Draft tokens per step: a slot's window starts at `initial` and, `adaptive`, moves within
  [min, max]; `max` is what the engine compiles for."""
  min: int = 1
  initial: int = 1
  max: int = 1
  adaptive: bool = False

  @classmethod
  def fixed(cls, tokens: int) -> "DraftWindow":
    return cls(tokens, tokens, tokens, False)

  def as_dict(self) -> dict:
    return {"policy": "adaptive" if self.adaptive else "fixed", "min_window": self.min,
            "initial_window": self.initial, "max_window": self.max}


def check_max_draft_tokens(value: Any, field: str) -> int | None:
  """A configured `max_draft_tokens` (None: unset), refused outside 1..MAX_DRAFT_TOKENS."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or not (
      1 <= value <= MAX_DRAFT_TOKENS):
    raise SpeculativeConfigError(
        f"{field} must be an integer in 1..{MAX_DRAFT_TOKENS}; got {value!r}", field=field,
        remedy=f"set 1..{MAX_DRAFT_TOKENS}, or leave it unset for the package's window")
  return value


def resolve_window(strategy_id: str | None, policy: WindowPolicy | None,
                   max_draft_tokens: int | None, field: str, model_id: str) -> DraftWindow:
  """The window for the strategy a package (or a GGUF: id and policy None) enables.

  `max_draft_tokens` comes from the config scope `field` (already checked)."""
  if policy is None:
    adaptive = strategy_id == MULTI_TOKEN_ID
    default = DEFAULT_MAX_DRAFT_TOKENS if adaptive else 1
    top = default if max_draft_tokens is None else max_draft_tokens
    return DraftWindow(1, top, top, adaptive)
  low, high = policy.min_window, min(policy.max_window, MAX_DRAFT_TOKENS)
  if max_draft_tokens is None:
    top = max(min(high, DEFAULT_MAX_DRAFT_TOKENS), low)
  elif not low <= max_draft_tokens <= policy.max_window:
    bound = "min_window" if max_draft_tokens < low else "max_window"
    raise SpeculativeConfigError(
        f"model {model_id}: {field} = {max_draft_tokens} is outside the package's "
        f"window_policy bounds (min_window {policy.min_window}, max_window "
        f"{policy.max_window}): window_policy.{bound} refuses it", field=f"window_policy.{bound}",
        remedy=f"set {field} within {policy.min_window}..{policy.max_window}, or unset it")
  else:
    top = max_draft_tokens
  return DraftWindow(low, min(max(policy.initial_window, low), top), top,
                     policy.default == "adaptive")
