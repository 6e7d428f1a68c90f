"""The draft rule stated host-side, one request at a time: the reference the telemetry tests
check `MtpStats` against (docs/SPECULATIVE.md §8, docs/DECODE.md §5)."""

from __future__ import annotations

from typing import Any, Sequence

from mtpjax.telemetry import MtpStats, clamp_duration_us


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
