"""Prometheus metrics for the server (`GET /metrics`), one registry per server.

Request counters are updated from the engine thread as tokens are produced, so a long
generation shows progress before it ends. The native-MTP counters are the summed `MtpStats` of
finished requests, exported under the names `MtpStats.as_metrics` defines
(`mtpjax_native_mtp_<name>`, docs/SPECULATIVE.md §8), with the same keys whether MTP is on or off.
"""

from __future__ import annotations

import threading

import prometheus_client
from prometheus_client.core import GaugeMetricFamily

from mtpjax.draft_window import DraftWindow
from mtpjax.runtime_options import GenerationSettings
from mtpjax.server.worker import Finished, Generation
from mtpjax.telemetry import METRIC_PREFIX, MtpStats

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RATE_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)


class _DerivedCollector:
  """Gauges computed at scrape time from totals the server keeps."""

  def __init__(self, metrics: ServerMetrics):
    self._metrics = metrics

  def collect(self):
    m = self._metrics
    with m.lock:
      stats, tokens, busy = m.mtp_total, m.generated_tokens, m.busy_seconds
    for name, value in stats.as_metrics().items():
      yield GaugeMetricFamily(name, f"native MTP {name[len(METRIC_PREFIX):]} over finished "
                              "requests (MtpStats totals)", value=value)
    yield GaugeMetricFamily(
        "mtpjax_generation_tokens_per_second",
        "generated tokens per second of engine busy time, since start",
        value=tokens / busy if busy > 0 else 0.0)


class ServerMetrics:
  """Every series `/metrics` exports; methods are safe to call from any thread."""

  def __init__(self, *, model_name: str, settings: GenerationSettings):
    self.registry = prometheus_client.CollectorRegistry()
    self.lock = threading.Lock()
    self.mtp_total = MtpStats(native_mtp=settings.native_mtp)
    self.generated_tokens = 0
    self.busy_seconds = 0.0
    r = self.registry
    info = prometheus_client.Info("mtpjax_model", "the served model and its speculative "
                                  "resolution", registry=r)
    info.info({"model": model_name, "native_mtp": str(settings.native_mtp).lower(),
               "speculative_strategy": settings.speculative_strategy,
               "speculative_type": settings.speculative_type,
               "speculative_reason": settings.speculative_reason})
    prometheus_client.Gauge("mtpjax_slots", "decode slots (engine.slots)",
                            registry=r).set(settings.slots)
    bounds = prometheus_client.Gauge(
        "mtpjax_native_mtp_draft_window_bounds", "the resolved draft window (draft tokens per "
        "step): min, initial and max", ("bound",), registry=r)
    window = settings.draft_window if settings.native_mtp else DraftWindow(0, 0, 0)
    for bound in ("min", "initial", "max"):
      bounds.labels(bound).set(getattr(window, bound))
    self.window_in_use = prometheus_client.Gauge(
        "mtpjax_native_mtp_draft_window", "draft tokens per live slot in the last engine step "
        "(0: no slot drafted)", registry=r)
    self.requests = prometheus_client.Counter(
        "mtpjax_requests", "finished generation requests", ("endpoint", "finish_reason"),
        registry=r)
    self.errors = prometheus_client.Counter(
        "mtpjax_request_errors", "requests answered with an error", ("status", "code"),
        registry=r)
    self.in_flight = prometheus_client.Gauge(
        "mtpjax_requests_in_flight", "requests queued or generating", registry=r)
    self.prompt_tokens = prometheus_client.Counter(
        "mtpjax_prompt_tokens", "prompt tokens of submitted requests", registry=r)
    self.cached_prompt_tokens = prometheus_client.Counter(
        "mtpjax_prompt_cached_tokens", "prompt tokens of finished requests taken from the "
        "prefix cache instead of prefilled (engine.prefix_cache)", registry=r)
    self.generation_tokens = prometheus_client.Counter(
        "mtpjax_generation_tokens", "generated tokens", registry=r)
    self.ttft = prometheus_client.Histogram(
        "mtpjax_time_to_first_token_seconds", "arrival to first token, queueing included",
        buckets=_LATENCY_BUCKETS, registry=r)
    self.duration = prometheus_client.Histogram(
        "mtpjax_request_duration_seconds", "arrival to last token", buckets=_LATENCY_BUCKETS,
        registry=r)
    self.decode_rate = prometheus_client.Histogram(
        "mtpjax_request_tokens_per_second", "per request: tokens after the first over the "
        "time after the first", buckets=_RATE_BUCKETS, registry=r)
    self.steps = prometheus_client.Counter(
        "mtpjax_engine_steps", "engine steps (one decode or verify+draft for every slot)",
        registry=r)
    self.step_seconds = prometheus_client.Counter(
        "mtpjax_engine_step_seconds", "time spent in engine steps (admission included)",
        registry=r)
    slots = max(settings.slots, 1)
    self.occupancy = prometheus_client.Histogram(
        "mtpjax_batch_occupancy", "fraction of slots active in each engine step",
        buckets=tuple((k + 0.5) / slots for k in range(slots)) + (1.0,), registry=r)
    r.register(_DerivedCollector(self))

  # --- engine-thread hooks (the EngineWorker's observer) ----------------------------------

  def on_submit(self, generation: Generation) -> None:
    self.in_flight.inc()
    self.prompt_tokens.inc(len(generation.request.prompt))

  def on_tokens(self, generation: Generation, count: int) -> None:
    self.generation_tokens.inc(count)
    with self.lock:
      self.generated_tokens += count

  def on_step(self, occupancy: list[float], seconds: float, window: float = 0.0) -> None:
    self.window_in_use.set(window)
    self.steps.inc()
    self.step_seconds.inc(seconds)
    for sample in occupancy:
      self.occupancy.observe(sample)
    with self.lock:
      self.busy_seconds += seconds

  def on_finish(self, generation: Generation, finished: Finished) -> None:
    self.in_flight.dec()
    self.requests.labels(generation.label, finished.finish_reason).inc()
    end = generation.finished_at
    self.duration.observe(end - generation.arrived)
    self.cached_prompt_tokens.inc(finished.result.cached_tokens)
    first = generation.first_token_at
    if first is not None:
      self.ttft.observe(first - generation.arrived)
      tokens = len(finished.result.tokens)
      if tokens > 1 and end > first:
        self.decode_rate.observe((tokens - 1) / (end - first))
    with self.lock:
      self.mtp_total = self.mtp_total.merge(finished.result.stats)

  # --- HTTP side ----------------------------------------------------------------------------

  def on_error(self, status: int, code: str | None) -> None:
    self.errors.labels(str(status), code or "none").inc()

  def render(self) -> bytes:
    return prometheus_client.generate_latest(self.registry)
