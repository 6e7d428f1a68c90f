"""Native-MTP draft bookkeeping and counters (docs/SPECULATIVE.md §8, docs/DECODE.md §5).

The scheduler counts per request and reduces the counts here (`MtpStats.from_counts`); the
tests state the same rules host-side, one request at a time (`tests/draft_tracker.py`). Totals
are Python ints, so they cannot overflow.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Iterable

METRIC_PREFIX = "mtpjax_native_mtp_"
# One measurement above i64 microseconds is a broken clock, and other languages' JSON readers
# could not hold it; clamp it instead of letting it poison a sum.
_MAX_DURATION_US = 2**63 - 1


def clamp_duration_us(value: Any) -> int:
  """A duration as a non-negative int of microseconds; negative or NaN is 0, huge is capped."""
  if isinstance(value, numbers.Integral):
    return min(max(int(value), 0), _MAX_DURATION_US)
  number = float(value)
  if math.isnan(number) or number <= 0:
    return 0
  return _MAX_DURATION_US if number >= _MAX_DURATION_US else int(number)


@dataclasses.dataclass(frozen=True)
class MtpStats:
  """Counters for one request or summed over many; derived figures are properties."""
  native_mtp: bool = False
  drafted: int = 0
  accepted: int = 0
  rejected: int = 0
  target_passes: int = 0
  committed_tokens: int = 0
  proposal_compute_us: int = 0
  verification_compute_us: int = 0
  # Per draft position i: verified windows that reached it, and those that accepted it.
  verified_by_position: tuple[int, ...] = ()
  accepted_by_position: tuple[int, ...] = ()

  @classmethod
  def from_counts(cls, *, native_mtp: bool, drafted: Any, accepted: Any, rejected: Any,
                  target_passes: Any, committed_tokens: Any, proposal_compute_us: Any = 0,
                  verification_compute_us: Any = 0, verified_by_position: Iterable = (),
                  accepted_by_position: Iterable = ()) -> MtpStats:
    """From reduced device counters (numpy or Python integers)."""
    counts = {"drafted": drafted, "accepted": accepted, "rejected": rejected,
              "target_passes": target_passes, "committed_tokens": committed_tokens}
    ints = {name: int(value) for name, value in counts.items()}
    negative = sorted(name for name, value in ints.items() if value < 0)
    if negative:
      raise ValueError(f"MTP counters must not be negative: {negative} in {ints}")
    if ints["accepted"] + ints["rejected"] > ints["drafted"]:
      raise ValueError(f"accepted + rejected exceeds drafted: {ints}")
    return cls(native_mtp=bool(native_mtp), **ints,
               proposal_compute_us=clamp_duration_us(proposal_compute_us),
               verification_compute_us=clamp_duration_us(verification_compute_us),
               verified_by_position=tuple(int(n) for n in verified_by_position),
               accepted_by_position=tuple(int(n) for n in accepted_by_position))

  @property
  def accept_rate_by_position(self) -> list[float]:
    """Per draft position: accepted / verified windows that reached it (0 where none did)."""
    return [a / v if v else 0.0
            for a, v in zip(self.accepted_by_position, self.verified_by_position)]

  @property
  def verifications(self) -> int:
    return self.accepted + self.rejected

  @property
  def pending(self) -> int:
    """Drafts never verified: at most 1 per request (the last one, dropped when it ends)."""
    return self.drafted - self.verifications

  @property
  def accept_rate(self) -> float:
    return self.accepted / self.verifications if self.verifications else 0.0

  @property
  def tokens_per_target_pass(self) -> float:
    return self.committed_tokens / self.target_passes if self.target_passes else 0.0

  @property
  def verified_windows(self) -> int:
    """Verify steps: windows reaching draft position 1 (one verification each for n = 1)."""
    return self.verified_by_position[0] if self.verified_by_position else self.verifications

  @property
  def tokens_per_verify(self) -> float:
    """Tokens a verified window yields: 1 + accepted drafts per window (for n = 1, 1 + the
    accept rate)."""
    windows = self.verified_windows
    return 1.0 + (self.accepted / windows if windows else 0.0)

  @property
  def enabled(self) -> bool:
    return self.native_mtp and (self.drafted > 0 or self.verifications > 0)

  def merge(self, other: MtpStats) -> MtpStats:
    """Sum of two requests' (or servers') counters."""
    return MtpStats(
        native_mtp=self.native_mtp or other.native_mtp,
        drafted=self.drafted + other.drafted, accepted=self.accepted + other.accepted,
        rejected=self.rejected + other.rejected,
        target_passes=self.target_passes + other.target_passes,
        committed_tokens=self.committed_tokens + other.committed_tokens,
        proposal_compute_us=self.proposal_compute_us + other.proposal_compute_us,
        verification_compute_us=self.verification_compute_us + other.verification_compute_us,
        verified_by_position=_summed(self.verified_by_position, other.verified_by_position),
        accepted_by_position=_summed(self.accepted_by_position, other.accepted_by_position))

  @classmethod
  def total(cls, stats: Iterable[MtpStats]) -> MtpStats:
    result = cls()
    for item in stats:
      result = result.merge(item)
    return result

  def as_dict(self) -> dict[str, Any]:
    """The same keys whether MTP is on or off, so dashboards and JSON lines never change shape."""
    return {
        "enabled": self.enabled,
        "drafted": self.drafted,
        "accepted": self.accepted,
        "rejected": self.rejected,
        "pending": self.pending,
        "verifications": self.verifications,
        "accept_rate": self.accept_rate,
        "proposal_compute_us": self.proposal_compute_us,
        "verification_compute_us": self.verification_compute_us,
        "target_passes": self.target_passes,
        "committed_tokens": self.committed_tokens,
        "tokens_per_target_pass": self.tokens_per_target_pass,
        "tokens_per_verify": self.tokens_per_verify,
        "accept_rate_by_position": self.accept_rate_by_position,
    }

  def as_metrics(self) -> dict[str, float]:
    """`/metrics` names (`mtpjax_native_mtp_<name>`) with numeric values; per-position
    acceptance as `..._accept_rate_position_<i>` (1-based), one per draft position seen."""
    metrics = {METRIC_PREFIX + name: float(value) for name, value in self.as_dict().items()
               if name != "accept_rate_by_position"}
    for i, rate in enumerate(self.accept_rate_by_position, 1):
      metrics[f"{METRIC_PREFIX}accept_rate_position_{i}"] = rate
    return metrics


def _summed(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
  """Element-wise sum of two per-position counts of possibly different depths."""
  width = max(len(a), len(b))
  pad = lambda t: tuple(t) + (0,) * (width - len(t))
  return tuple(x + y for x, y in zip(pad(a), pad(b)))
