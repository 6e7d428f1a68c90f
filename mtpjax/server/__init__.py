"""The OpenAI-compatible server: `build_service(config)` loads and warms up, `serve` listens.

`python -m mtpjax.serve` is a thin absl wrapper over `serve`; tests and notebooks can call
`build_service` + `create_app` directly.
"""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import time

import uvicorn
from absl import logging

import mtpjax
from mtpjax import distributed, embedded, errors, speculative, warm_start
from mtpjax.engine.contract import EngineConfig, check_kv_cache_dtype, warm_up
from mtpjax.engine.drafting_policy import AdaptiveDrafting
from mtpjax.engine.sampling import MAX_TOP_LOGPROBS
from mtpjax.engine.scheduler import SlotScheduler
from mtpjax.gguf.tokenizer import GgufTokenizer
from mtpjax.server import connections
from mtpjax.server.admission import Admission
from mtpjax.server.app import SamplingDefaults, Service, create_app
from mtpjax.server.limits import ServerLimits
from mtpjax.server.metrics import ServerMetrics
from mtpjax.server.prompts import PromptBuilder
from mtpjax.gguf.template_budget import BudgetedChatTemplate, TemplateBudget
from mtpjax.server.worker import EngineWorker

__all__ = ["Service", "build_service", "create_app", "serve"]


def _max_prompt_tokens(settings: EngineConfig) -> int:
  """The longest prompt the engine accepts: one short of the context, prefilled in chunks of
  the largest bucket that fits the cache."""
  if not settings.fitting_buckets():
    raise errors.MtpjaxError(
        f"no prefill bucket in {settings.prefill_buckets} fits engine.max_len "
        f"{settings.max_len}", field="engine.prefill_buckets",
        remedy="add a bucket no larger than engine.max_len + 2")
  return settings.max_len - 1


def _warm_up(scheduler: SlotScheduler) -> float:
  """Compile every prefill bucket and step variant, so no client pays for a compile."""
  started = time.perf_counter()
  warm_up(scheduler.engine)
  return time.perf_counter() - started


def _refuse_multi_process(config) -> None:
  """Every process of a multi-host job must run the same steps; one HTTP front cannot yet."""
  job = distributed.settings_from(config)
  if job is not None and job.num_processes > 1:
    raise errors.MeshConfigError(
        f"serving from {job.num_processes} processes is not supported yet",
        field="distributed.num_processes",
        remedy="serve from one process: leave distributed.* and the COORDINATOR_ADDRESS / "
        "NUM_PROCESSES / PROCESS_ID variables unset (--config.mesh.stages still pipelines the "
        "model over this host's devices)")


def build_service(config) -> Service:
  """Loads the model the config names, resolves MTP once, warms up and starts the engine."""
  _refuse_multi_process(config)
  speculative.strategy_from_config(config, config.model.name)   # a bad value fails before I/O
  speculative.max_draft_tokens_from_config(config, config.model.name)
  drafting_policy = AdaptiveDrafting.from_mode(config.engine.adaptive_drafting)
  limits = ServerLimits.from_config(config.server)
  engine_cfg = EngineConfig.from_config(config.engine)   # checked before any I/O
  max_prompt = _max_prompt_tokens(engine_cfg)
  if not 0 <= engine_cfg.logprobs <= MAX_TOP_LOGPROBS:
    raise errors.MtpjaxError(f"engine.logprobs = {engine_cfg.logprobs} is out of range",
                             field="engine.logprobs",
                             remedy=f"choose 0 (no logprobs) to {MAX_TOP_LOGPROBS}")
  check_kv_cache_dtype(engine_cfg.kv_cache_dtype)
  source = embedded.resolve_source(config)
  cache = warm_start.enable_compilation_cache(config)
  if cache is not None:
    logging.info("compilation cache: %s", cache)
  started = time.perf_counter()
  model = mtpjax.load(source, dtype=config.model.dtype, config=config)
  resolution = model.resolution
  logging.info("loaded %s in %.1f s", source, time.perf_counter() - started)
  logging.info("native MTP %s: %s", "on" if resolution.native_mtp else "off", resolution.reason)
  if resolution.native_mtp:
    window = resolution.draft_window
    logging.info("draft window in force: %d to %d tokens a step, starting at %d%s", window.min,
                 window.max, window.initial, " (adaptive)" if window.adaptive else "")
  logging.info("speculative drafting: %s", resolution.summary())

  settings = model.generation_settings
  engine, drafting = model.drafting_engine(resolution, settings.draft_window,
                                           settings=model.engine_settings)
  tokenizer = GgufTokenizer.from_metadata(model.metadata, path=source)
  chat_template = BudgetedChatTemplate.from_metadata(
      model.metadata, path=source,
      budget=TemplateBudget(seconds=limits.template_timeout_s, max_chars=limits.template_max_chars))

  scheduler = SlotScheduler(engine, adaptive=drafting_policy, window=settings.draft_window,
                            drafter=drafting.drafter)
  with warm_start.CacheUse() as cache_use:
    warm_s = _warm_up(scheduler)
  logging.info("warmed up the engine in %.1f s (%d slots, max_len %d): %s", warm_s,
               settings.slots, settings.max_len, cache_use.summary())

  model_name = config.server.model_name
  metrics = ServerMetrics(model_name=model_name, settings=settings)
  worker = EngineWorker(scheduler, metrics)
  sampling = config.sampling
  defaults = SamplingDefaults(temperature=float(sampling.temperature), top_k=int(sampling.top_k),
                              top_p=float(sampling.top_p),
                              max_new_tokens=int(sampling.max_new_tokens))
  worker.start()
  return Service(model_name=model_name, settings=settings, resolution=resolution,
                 tokenizer=tokenizer, worker=worker,
                 metrics=metrics, defaults=defaults, max_prompt_tokens=max_prompt,
                 seeds=random.Random(config.engine.seed), limits=limits,
                 admission=Admission(settings.slots, limits),
                 prompts=PromptBuilder(tokenizer, chat_template),
                 engine_cfg=engine.engine_cfg)


class _Server(uvicorn.Server):
  """Logs the ready line once serving; shuts down gracefully on SIGTERM/SIGINT.

  Shutdown stops admitting (new requests get 503, the listening socket closes), lets in-flight
  requests finish for `server.shutdown_timeout_s`, then cancels the rest: each stream ends with
  finish_reason "cancelled" and `data: [DONE]`, each non-streaming request gets its text so far.
  """

  def __init__(self, config: uvicorn.Config, ready_message: str, service: Service):
    super().__init__(config)
    self._ready_message = ready_message
    self._service = service

  async def startup(self, sockets=None) -> None:
    await super().startup(sockets=sockets)
    if self.started:
      logging.info("%s", self._ready_message)

  async def shutdown(self, sockets=None) -> None:
    admission = self._service.admission
    admission.drain()
    timeout = self._service.limits.shutdown_timeout_s
    logging.info("shutting down: %d requests in flight get %g s to finish", admission.active,
                 timeout)

    async def cancel_late() -> None:
      await asyncio.sleep(timeout)
      logging.info("shutdown deadline: cancelling %d requests", admission.cancel_all())

    late = asyncio.ensure_future(cancel_late())
    try:
      await super().shutdown(sockets=sockets)
    finally:
      late.cancel()


def _bind(host: str, port: int) -> socket.socket:
  """Binds before serving, so that port 0 picks a free port the ready line can report."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise errors.MtpjaxError(f"cannot listen on {host}:{port}: {e}", field="server.port",
                             remedy="choose a free port with --config.server.port "
                             "(0 picks one)") from e
  return sock


def serve(config) -> None:
  """Builds the service and serves it until interrupted (SIGINT/SIGTERM). The port is taken
  first: a busy one fails at once, not after minutes of loading and warm-up."""
  sock = _bind(config.server.host, config.server.port)
  try:
    service = build_service(config)
  except BaseException:
    sock.close()
    raise
  try:
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    ready = (f"mtpjax ready: serving {service.model_name!r} at {url}/v1 (native MTP "
             f"{'on' if service.settings.native_mtp else 'off'})")
    # Cancelled requests end within an engine step; the margin covers their last sends.
    limits = service.limits
    server = _Server(uvicorn.Config(create_app(service), log_level="warning",
                                    http=connections.guarded_protocol(limits),
                                    timeout_keep_alive=limits.idle_timeout_s,
                                    timeout_graceful_shutdown=limits.shutdown_timeout_s + 5),
                     ready, service)
    # uvicorn re-raises the signal that stopped it once it has shut down; after a graceful
    # shutdown that must not kill the process, which exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run(sockets=[sock])
  finally:
    service.worker.stop()
    service.prompts.close()
