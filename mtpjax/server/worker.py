"""The engine thread: one thread owns the SlotScheduler, HTTP handlers talk to it via queues.

The scheduler and the donated device state are not thread-safe, so exactly one thread touches
them. Handlers (on the asyncio loop) put requests in a thread-safe inbox; the engine thread
admits them whenever a slot is free (continuous batching), loops `step()` while anything is
live, and hands each batch of tokens back to the handler's asyncio queue with
`loop.call_soon_threadsafe`. A handler never blocks the loop and the engine never waits for a
slow client: a request's tokens are what it would get alone, whatever the schedule.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from typing import Any, Protocol

from absl import logging

from mtpjax.engine.scheduler import Request, RequestFailed, Result, SlotScheduler, TokenLogprob
from mtpjax.telemetry import MtpStats


class EngineFailure(Exception):
  """The engine raised while this request was live; the worker restarted with a fresh state."""


@dataclasses.dataclass
class Finished:
  """The last event of a generation. `finish_reason` already maps a server-side cancel."""
  result: Result
  finish_reason: str


@dataclasses.dataclass
class LogprobBatch:
  """The logprobs of the token batch that follows it in the event queue."""
  entries: list[TokenLogprob]


class Generation:
  """One request's handle: the handler awaits `next_event()`, and may `cancel()` at any time."""

  def __init__(self, request: Request, loop: asyncio.AbstractEventLoop, label: str):
    self.label = label                      # metrics label (the endpoint)
    self.arrived = time.perf_counter()
    self.first_token_at: float | None = None
    self.finished_at: float | None = None
    self._loop = loop
    self._events: asyncio.Queue = asyncio.Queue()
    self._cancelled = threading.Event()
    self._cancel_reason = "cancelled"
    self.request = dataclasses.replace(request, on_tokens=self._on_tokens,
                                       on_logprobs=lambda e: self._put(LogprobBatch(list(e))),
                                       cancelled=self._cancelled.is_set)

  def cancel(self, reason: str = "cancelled") -> None:
    """Frees the slot at the next step; `reason` is the finish reason metrics will record."""
    if not self._cancelled.is_set():
      self._cancel_reason = reason
      self._cancelled.set()

  @property
  def cancelled(self) -> bool:
    return self._cancelled.is_set()

  def _put(self, event: Any) -> None:
    """Engine thread -> asyncio loop. A closed loop (server shutting down) drops the event."""
    try:
      self._loop.call_soon_threadsafe(self._events.put_nowait, event)
    except RuntimeError:
      pass

  def _on_tokens(self, tokens: list[int]) -> None:
    if self.first_token_at is None:
      self.first_token_at = time.perf_counter()
    self._put(list(tokens))

  def finish(self, result: Result) -> Finished:
    self.finished_at = time.perf_counter()
    reason = result.finish_reason
    if reason == "cancelled":
      reason = self._cancel_reason
    finished = Finished(result, reason)
    self._put(finished)
    return finished

  def fail(self, error: BaseException) -> Finished:
    """Tells the handler the request failed; returns the record metrics keep of it."""
    self.finished_at = time.perf_counter()
    self._put(EngineFailure(f"the engine failed while generating: {error!r}"))
    return Finished(self.unserved_result("error"), "error")

  def unserved_result(self, reason: str) -> Result:
    """The Result of a request that produced no tokens (cancelled in the queue, or failed)."""
    return Result(tokens=[], finish_reason=reason, stats=MtpStats(),
                  prompt_tokens=len(self.request.prompt), time_to_first_token_s=0.0,
                  total_time_s=0.0)

  async def next_event(self, timeout: float | None = None
                       ) -> list[int] | LogprobBatch | Finished:
    """The next token batch (preceded by its LogprobBatch when the request asked for
    logprobs) or the final `Finished`; raises EngineFailure or TimeoutError."""
    event = await asyncio.wait_for(self._events.get(), timeout)
    if isinstance(event, EngineFailure):
      raise event
    return event


class WorkerObserver(Protocol):
  """What the worker reports, from the engine thread (the server's metrics implement it)."""

  def on_submit(self, generation: Generation) -> None: ...
  def on_tokens(self, generation: Generation, count: int) -> None: ...
  def on_finish(self, generation: Generation, finished: Finished) -> None: ...
  def on_step(self, occupancy: list[float], seconds: float, window: float = 0.0) -> None: ...


class EngineWorker:
  """Runs the scheduler on a dedicated thread until `stop()`."""

  def __init__(self, scheduler: SlotScheduler, observer: WorkerObserver):
    self.scheduler = scheduler
    self._observer = observer
    self._inbox: queue.SimpleQueue[Generation | None] = queue.SimpleQueue()
    self._live: dict[int, Generation] = {}
    self._stopping = False
    self._thread = threading.Thread(target=self._run, name="mtpjax-engine", daemon=True)

  # --- handler side (asyncio loop) ----------------------------------------------------------

  def submit(self, request: Request, label: str) -> Generation:
    """Queues a request; call from the event loop, then await `Generation.next_event()`."""
    generation = Generation(request, asyncio.get_running_loop(), label)
    self._observer.on_submit(generation)
    self._inbox.put(generation)
    return generation

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  @property
  def running(self) -> int:
    return len(self._live)

  def start(self) -> None:
    self._thread.start()

  def stop(self, timeout: float = 10.0) -> None:
    self._stopping = True
    self._inbox.put(None)
    if self._thread.is_alive():
      self._thread.join(timeout)

  # --- engine thread ------------------------------------------------------------------------

  def _admit(self, generation: Generation) -> None:
    if generation.cancelled:          # the client left while the request was queued
      self._observer.on_finish(generation,
                               generation.finish(generation.unserved_result("cancelled")))
      return
    on_tokens = generation.request.on_tokens

    def counted(tokens: list[int]) -> None:
      self._observer.on_tokens(generation, len(tokens))
      on_tokens(tokens)

    scheduled = dataclasses.replace(generation.request, on_tokens=counted)
    key = id(scheduled)          # what the scheduler hands back in a RequestFailed

    def done(result: Result) -> None:
      self._live.pop(key, None)
      self._observer.on_finish(generation, generation.finish(result))

    try:
      self.scheduler.submit(scheduled, done)
    except Exception as error:  # a request the scheduler refuses fails alone
      self._observer.on_finish(generation, generation.fail(error))
      return
    self._live[key] = generation

  def _drain_inbox(self, block: bool) -> None:
    """Moves queued requests to the scheduler; blocks for the first one when idle."""
    try:
      item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
    except queue.Empty:
      return
    while True:
      if item is None:
        return
      self._admit(item)
      try:
        item = self._inbox.get_nowait()
      except queue.Empty:
        return

  def _run(self) -> None:
    while not self._stopping:
      try:
        self._drain_inbox(block=not self.scheduler.busy)
        if self._stopping or not self.scheduler.busy:
          continue
        started = time.perf_counter()
        self.scheduler.step()
        samples = self.scheduler.occupancy_samples
        self._observer.on_step(list(samples), time.perf_counter() - started,
                               self.scheduler.window_in_use)
        samples.clear()                 # the scheduler keeps every sample; bound its memory
      except RequestFailed as failure:  # one request's prefill raised: the state is intact
        logging.warning("a request failed on admission: %s", failure)
        generation = self._live.pop(id(failure.request), None)
        if generation is not None:
          self._observer.on_finish(generation, generation.fail(failure.error))
      except Exception as error:  # one bad step must not take the server down
        logging.exception("engine step failed; failing %d live requests and restarting "
                          "with a fresh decode state", len(self._live))
        self._fail_live(error)
        self.scheduler = SlotScheduler(self.scheduler.engine, adaptive=self.scheduler.adaptive,
                                       window=self.scheduler.window,
                                       drafter=self.scheduler.drafter)
    self._fail_live(RuntimeError("the server is shutting down"))

  def _fail_live(self, error: BaseException) -> None:
    for generation in self._live.values():
      self._observer.on_finish(generation, generation.fail(error))
    self._live.clear()
