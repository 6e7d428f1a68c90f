"""Native-MTP draft bookkeeping and counters (SPECULATIVE.md §8, DECODE.md §5).

The engine keeps int32 counters on device and reduces them here (`MtpStats.from_counts`);
`DraftTracker` is the host-side statement of the same rules, one request at a time, which the
fake engine and the tests use as the reference. Totals are Python ints, so they cannot overflow.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Iterable, Sequence

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


def accept_draft(draft: int, target_tokens: Sequence[int]) -> tuple[bool, tuple[int, ...]]:
  """(accepted, emitted) for a verify pass over `[current, draft]` giving `[t_a, t_b]`.

  The draft is accepted iff it equals the target's own token t_a; then t_b was computed on the
  committed prefix and is emitted too. On reject only the target's correction t_a is emitted.
  """
  if len(target_tokens) < 2:
    raise ValueError(f"a verify pass gives 2 target tokens; got {list(target_tokens)}")
  t_a, t_b = int(target_tokens[0]), int(target_tokens[1])
  if t_a == int(draft):
    return True, (t_a, t_b)
  return False, (t_a,)


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

  @classmethod
  def from_counts(cls, *, native_mtp: bool, drafted: Any, accepted: Any, rejected: Any,
                  target_passes: Any, committed_tokens: Any, proposal_compute_us: Any = 0,
                  verification_compute_us: Any = 0) -> MtpStats:
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
               verification_compute_us=clamp_duration_us(verification_compute_us))

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
  def tokens_per_verify(self) -> float:
    """For n = 1 the only per-position figure: each verify yields 1 + P(accept) tokens."""
    return 1.0 + self.accept_rate

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
        verification_compute_us=self.verification_compute_us + other.verification_compute_us)

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
    }

  def as_metrics(self) -> dict[str, float]:
    """`/metrics` names (`mtpjax_native_mtp_<name>`) with numeric values."""
    return {METRIC_PREFIX + name: float(value) for name, value in self.as_dict().items()}


class DraftTracker:
  """One request's draft bookkeeping: a draft stays pending until the next target pass."""

  def __init__(self, native_mtp: bool = True):
    self._native_mtp = native_mtp
    self._pending_draft: int | None = None
    self._counts = dict(drafted=0, accepted=0, rejected=0, target_passes=0, committed_tokens=0)
    self._proposal_us = 0
    self._verification_us = 0

  @property
  def pending_draft(self) -> int | None:
    return self._pending_draft

  def record_draft(self, token: int) -> None:
    """Stores the next draft; the previous one must have been verified first."""
    if not self._native_mtp:
      raise RuntimeError("record_draft called on a request with native MTP off")
    if self._pending_draft is not None:
      raise RuntimeError(f"draft {self._pending_draft} is still pending; verify it before "
                         f"storing draft {token}")
    self._pending_draft = int(token)
    self._counts["drafted"] += 1

  def verify(self, target_tokens: Sequence[int]) -> tuple[int, ...]:
    """Consumes one target pass and returns the tokens it commits.

    Without a pending draft this is a plain decode step: only the first target token counts.
    """
    if self._pending_draft is None:
      if not target_tokens:
        raise ValueError("a target pass gives at least one token")
      emitted: tuple[int, ...] = (int(target_tokens[0]),)
    else:
      accepted, emitted = accept_draft(self._pending_draft, target_tokens)
      self._counts["accepted" if accepted else "rejected"] += 1
      self._pending_draft = None
    self._counts["target_passes"] += 1
    self._counts["committed_tokens"] += len(emitted)
    return emitted

  def clear_pending(self) -> None:
    """The request ended: its last draft is dropped unverified (it still counts as drafted)."""
    self._pending_draft = None

  def record_proposal_us(self, duration_us: Any) -> None:
    self._proposal_us += clamp_duration_us(duration_us)

  def record_verification_us(self, duration_us: Any) -> None:
    self._verification_us += clamp_duration_us(duration_us)

  @property
  def stats(self) -> MtpStats:
    return MtpStats(native_mtp=self._native_mtp, **self._counts,
                    proposal_compute_us=self._proposal_us,
                    verification_compute_us=self._verification_us)
