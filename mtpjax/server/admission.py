"""Who gets in: a bounded queue (429 with Retry-After), per-request deadlines, and draining.

Every generation request holds a `Ticket` from arrival until its answer has been sent (a
stream's ticket travels with its response). At most `slots + server.max_queue` tickets exist;
beyond that a request is refused with 429 and a `Retry-After` estimated from recent request
durations, so a burst queues only as deep as the operator allows. While the server shuts down
(`drain`) new requests get 503, and `cancel_all` ends the ones still running.
"""

from __future__ import annotations

import collections
import math
import time
from typing import AsyncIterator

from fastapi import responses

from mtpjax.server import schemas
from mtpjax.server.limits import ServerLimits
from mtpjax.server.schemas import ApiError
from mtpjax.server.worker import Generation


class QueueFull(ApiError):
  """429 with the `Retry-After` header OpenAI clients honour."""

  def __init__(self, message: str, retry_after_s: int):
    super().__init__(429, message, type=schemas.RATE_LIMIT, code="queue_full")
    self.headers = {"Retry-After": str(retry_after_s)}


class Ticket:
  """One admitted request; use as a context manager, or hand it to `stream`."""

  def __init__(self, admission: Admission):
    self._admission = admission
    self.arrived = time.monotonic()
    timeout = admission.limits.deadline_s
    self.deadline = None if timeout is None else self.arrived + timeout
    self.generation: Generation | None = None
    self._handed_over = False
    self._released = False

  def attach(self, generation: Generation) -> None:
    """The ticket's generation, cancelled at once if shutdown already cancelled the rest."""
    self.generation = generation
    if self._admission.cancel_reason is not None:
      generation.cancel(self._admission.cancel_reason)

  def remaining(self) -> float | None:
    """Seconds to the deadline (None: no deadline)."""
    return None if self.deadline is None else self.deadline - time.monotonic()

  def release(self) -> None:
    if not self._released:
      self._released = True
      self._admission._release(self)

  def stream(self, events: AsyncIterator[str]) -> responses.StreamingResponse:
    """A server-sent-events response that releases this ticket when it ends, however it ends."""
    self._handed_over = True
    return _TicketedStream(self, events)

  def __enter__(self) -> Ticket:
    return self

  def __exit__(self, *exc) -> None:
    if not self._handed_over:
      self.release()


class _TicketedStream(responses.StreamingResponse):
  def __init__(self, ticket: Ticket, events: AsyncIterator[str]):
    super().__init__(events, media_type="text/event-stream")
    self._ticket = ticket

  async def __call__(self, scope, receive, send) -> None:
    try:
      await super().__call__(scope, receive, send)
    finally:
      self._ticket.release()


class Admission:
  """Counts tickets on the event loop (not thread-safe: call only from handlers)."""

  def __init__(self, slots: int, limits: ServerLimits):
    self.slots = slots
    self.limits = limits
    self.draining = False
    self.cancel_reason: str | None = None   # set by cancel_all: later generations end at once
    self._tickets: set[Ticket] = set()
    self._durations = collections.deque(maxlen=64)    # seconds of recently answered requests

  @property
  def active(self) -> int:
    return len(self._tickets)

  @property
  def queued(self) -> int:
    """Requests admitted beyond the slots (waiting for one, or being prepared)."""
    return max(0, self.active - self.slots)

  def enter(self) -> Ticket:
    """A ticket, or 503 while draining / 429 when the queue is full."""
    if self.draining:
      raise ApiError(503, "the server is shutting down; retry on another replica or later",
                     type=schemas.SERVER_ERROR, code="shutting_down")
    if self.active >= self.slots + self.limits.max_queue:
      raise QueueFull(f"the server is at capacity: {self.slots} slots busy and "
                      f"{self.queued} requests queued (server.max_queue "
                      f"{self.limits.max_queue}); retry later", self._retry_after_s())
    ticket = Ticket(self)
    self._tickets.add(ticket)
    return ticket

  def _retry_after_s(self) -> int:
    """About when a slot frees: the queue ahead, served `slots` at a time."""
    if not self._durations:
      return 1
    mean = sum(self._durations) / len(self._durations)
    return max(1, min(60, math.ceil((self.queued + 1) * mean / self.slots)))

  def _release(self, ticket: Ticket) -> None:
    self._tickets.discard(ticket)
    self._durations.append(time.monotonic() - ticket.arrived)

  def drain(self) -> None:
    """Refuse new requests from now on."""
    self.draining = True

  def cancel_all(self, reason: str = "cancelled") -> int:
    """Cancels every admitted generation, and any submitted later; returns how many."""
    self.cancel_reason = reason
    live = [t.generation for t in self._tickets if t.generation is not None]
    for generation in live:
      generation.cancel(reason)
    return len(live)
