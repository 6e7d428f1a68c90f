"""OpenAI-compatible routes over the engine worker (FastAPI).

Handlers run on the asyncio loop and never touch the engine: they validate the body, turn it
into token ids and a `Request`, submit it to the worker and turn the token batches that come
back into text, either all at once or as server-sent events ending in `data: [DONE]`. Stop
strings are matched on the text here (holding back a tail that could still become a stop
string), and a match cancels the request so that its slot frees at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
import uuid
from typing import Any, AsyncIterator, Callable

import fastapi
import numpy as np
from fastapi import responses
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from mtpjax import errors
from mtpjax.engine.contract import EngineConfig
from mtpjax.engine.scheduler import Request
from mtpjax.engine.sampling import SamplerParams
from mtpjax.gguf.control_tokens import RequestText
from mtpjax.gguf.prompt_tokens import PromptTooLong
from mtpjax.gguf.tokenizer import GgufTokenizer
from mtpjax.runtime_options import GenerationSettings
from mtpjax.server import logprobs as logprob_format
from mtpjax.server import reasoning, schemas, tool_calls
from mtpjax.server.admission import Admission, Ticket
from mtpjax.server.chat_output import ChatOutput, forced_call_prefix, whole_message
from mtpjax.server.guards import RequestGuards
from mtpjax.server.limits import ServerLimits
from mtpjax.server.metrics import CONTENT_TYPE, ServerMetrics
from mtpjax.server.prompts import PromptBuilder
from mtpjax.server.schemas import ApiError
from mtpjax.gguf.template_budget import TemplateBudgetExceeded
from mtpjax.server.worker import EngineFailure, EngineWorker, Finished, Generation, LogprobBatch
from mtpjax.speculative import SpeculativeResolution

@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
  """Used for fields a request leaves unset (config.sampling)."""
  temperature: float
  top_k: int
  top_p: float
  max_new_tokens: int


@dataclasses.dataclass
class Service:
  """Everything the routes need; built once at startup by `mtpjax.server.build_service`."""
  model_name: str
  settings: GenerationSettings
  resolution: SpeculativeResolution
  tokenizer: GgufTokenizer
  worker: EngineWorker
  metrics: ServerMetrics
  defaults: SamplingDefaults
  max_prompt_tokens: int
  seeds: random.Random            # seeds for requests that do not give one (config.engine.seed)
  limits: ServerLimits
  admission: Admission
  prompts: PromptBuilder          # template rendering and tokenization, off the event loop
  engine_cfg: EngineConfig        # the engine's: its KV page pool, logprobs and draft window
  created: int = dataclasses.field(default_factory=lambda: int(time.time()))

  @property
  def max_len(self) -> int:
    return self.settings.max_len

  @property
  def top_logprobs(self) -> int:
    """Alternatives per token the engine computes (0: no logprobs)."""
    return self.engine_cfg.logprobs

  @property
  def draft_tokens(self) -> int:
    """The most drafts a step verifies, any strategy (0: none)."""
    return self.engine_cfg.draft_tokens if self.engine_cfg.drafts else 0

  def model_card(self) -> dict[str, Any]:
    r = self.resolution
    return {
        "id": self.model_name, "object": "model", "created": self.created, "owned_by": "mtpjax",
        "max_model_len": self.max_len, "max_prompt_tokens": self.max_prompt_tokens,
        "native_mtp": self.settings.native_mtp,
        "speculative": {"strategy": r.requested, "scope": r.scope,
                        "native_mtp": self.settings.native_mtp, "mtp_layer_index":
                        r.mtp_layer_index, "disabled_by_env": r.disabled_by_env,
                        "reason": r.reason, **r.summary(),
                        "draft_window": self.settings.draft_window.as_dict()
                        if self.settings.native_mtp else None,
                        "max_draft_tokens_per_step": self.draft_tokens},
    }


@dataclasses.dataclass
class _Job:
  """A validated request, ready to submit."""
  request: Request
  stop_strings: tuple[str, ...]
  include_usage: bool
  top_logprobs: int | None        # None: the request asked for no logprobs
  output: ChatOutput | None = None      # chat: parses reasoning and tool calls


class _TextAssembler:
  """Token batches -> text deltas, cut at the first stop string; counts completion tokens."""

  def __init__(self, tokenizer: GgufTokenizer, stop_ids: frozenset[int],
               stop_strings: tuple[str, ...]):
    self._detok = tokenizer.stream_decoder()
    # Control tokens do not show, except the tags of thinking and tool calls (special tokens
    # in GLM vocabularies) that the chat parsers read.
    self._hidden = tokenizer.control_ids - _tag_ids(tokenizer)
    self._stop_ids = stop_ids
    self._stops = stop_strings
    self._longest = max((len(s) for s in stop_strings), default=0)
    self.text = ""
    self.sent = 0
    self.tokens = 0
    self.hit_stop_string = False
    self.logprobs: list = []      # TokenLogprobs of the counted tokens
    self._logprobs_sent = 0

  def feed(self, tokens: list[int], logprobs: list | None = None) -> str:
    for i, token in enumerate(tokens):
      if self.hit_stop_string:
        break
      self.tokens += 1
      if logprobs is not None:
        self.logprobs.append(logprobs[i])
      if token not in self._stop_ids and token not in self._hidden:   # a stop id ends the
        self._append(self._detok.push(token))                         # text, unshown
    return self._release(final=False)

  def finish(self) -> str:
    if not self.hit_stop_string:
      self._append(self._detok.flush())
    return self._release(final=True)

  def new_logprobs(self) -> list:
    """The TokenLogprobs fed since the last call (streamed with the next chunk)."""
    entries = self.logprobs[self._logprobs_sent:]
    self._logprobs_sent = len(self.logprobs)
    return entries

  def _append(self, piece: str) -> None:
    if not piece:
      return
    start = max(0, len(self.text) - self._longest + 1)
    self.text += piece
    if not self._stops:
      return
    hits = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
    if hits:
      self.text = self.text[:min(hits)]
      self.hit_stop_string = True

  def _held_back(self) -> int:
    """Length of the longest tail of the text that is a proper prefix of a stop string."""
    for size in range(min(self._longest - 1, len(self.text) - self.sent), 0, -1):
      tail = self.text[-size:]
      if any(s.startswith(tail) for s in self._stops):
        return size
    return 0

  def _release(self, final: bool) -> str:
    end = len(self.text) if final or self.hit_stop_string else len(self.text) - self._held_back()
    delta = self.text[self.sent:end]
    self.sent = max(self.sent, end)
    return delta


def _tag_ids(tokenizer: GgufTokenizer) -> frozenset[int]:
  tags = (reasoning.OPEN, reasoning.CLOSE) + tool_calls.TAGS
  return frozenset(i for i in map(tokenizer.token_to_id, tags) if i is not None)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


async def _client_gone(http: fastapi.Request) -> None:
  """Returns when the client closes the connection (its body has been read already)."""
  while (await http.receive())["type"] != "http.disconnect":
    pass


async def _parse(model: type[schemas._GenerationRequest], http: fastapi.Request):
  """The validated body, parsed on a worker thread: validating 100,000 messages held the event
  loop (and /health) for ~0.3-2 s; off it, the loop keeps running between the parser's steps."""
  return await asyncio.to_thread(schemas.parse_body, model, await http.body())


def _sse(payload: dict | str) -> str:
  data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
  return f"data: {data}\n\n"


class _Routes:
  """The request handlers, bound to one Service."""

  def __init__(self, service: Service):
    self.service = service

  # --- validation ---------------------------------------------------------------------------

  def _check_model(self, model: str) -> None:
    if model != self.service.model_name:
      raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                     f"{self.service.model_name!r} (see GET /v1/models)", type=schemas.NOT_FOUND,
                     param="model", code="model_not_found")

  def _check_ids(self, ids: list[int], param: str) -> None:
    vocab = self.service.tokenizer.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
      raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                     param=param, code="invalid_value")

  def _too_long(self, tokens: str, param: str) -> ApiError:
    s = self.service
    return ApiError(400, f"the prompt has {tokens} tokens but this server's context holds at "
                    f"most {s.max_prompt_tokens} prompt tokens (engine.max_len {s.max_len}); "
                    "shorten the prompt", param=param, code="context_length_exceeded")

  async def _encode(self, text: str, param: str, size: int, request: RequestText | None = None
                    ) -> list[int]:
    """Ids of a prompt, refused as soon as it is seen to be over the context."""
    try:
      return await self.service.prompts.encode(text, request, size=size,
                                               limit=self.service.max_prompt_tokens)
    except PromptTooLong as e:
      raise self._too_long(f"at least {e.at_least}", param) from None

  def _job(self, body: schemas._GenerationRequest, prompt_ids: list[int], *, budget: int | None,
           budget_param: str, stop_ids: frozenset[int], prompt_param: str) -> _Job:
    s = self.service
    n = len(prompt_ids)
    if n > s.max_prompt_tokens:
      raise self._too_long(str(n), prompt_param)
    room = s.max_len - n
    if budget is None:
      budget = min(s.defaults.max_new_tokens, room)
    elif budget > room:
      raise ApiError(400, f"{budget_param} = {budget} does not fit: the context length is "
                     f"{s.max_len} tokens and the prompt uses {n}; ask for at most {room}",
                     param=budget_param, code="context_length_exceeded")
    try:   # refused here, as a 400: in the engine thread it would fail as an engine failure
      s.engine_cfg.check_fits(n, budget)
    except errors.KvPagesError as e:
      raise ApiError(400, str(e), param=budget_param, code="kv_pages_exceeded") from None
    extra_ids = list(body.stop_token_ids or ())
    self._check_ids(extra_ids, "stop_token_ids")
    top_k = s.defaults.top_k if body.top_k is None else max(body.top_k, 0)
    if top_k >= s.tokenizer.vocab_size:     # keeps every token, as top-k off does
      top_k = 0
    sampler = SamplerParams(
        temperature=s.defaults.temperature if body.temperature is None else body.temperature,
        top_k=top_k, top_p=s.defaults.top_p if body.top_p is None else body.top_p,
        seed=s.seeds.getrandbits(32) if body.seed is None else body.seed)
    try:
      sampler.validate()
    except errors.MtpjaxError as e:
      raise ApiError(400, e.message, param=e.field, code="invalid_value") from None
    request = Request(prompt=np.asarray(prompt_ids, np.int32), max_new_tokens=budget,
                      sampler=sampler, stop_ids=stop_ids | frozenset(extra_ids))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    top_logprobs = body.top_logprobs_wanted()
    if top_logprobs is not None:
      if not s.top_logprobs:
        raise schemas.unsupported("logprobs", "this server computes no logprobs "
                                  "(engine.logprobs = 0); leave logprobs unset")
      request = dataclasses.replace(request, logprobs=True)
    return _Job(request, body.stop_strings(), include_usage, top_logprobs)

  async def _completion_job(self, body: schemas.CompletionRequest) -> _Job:
    self._check_model(body.model)
    prompt = body.prompt_input()
    if isinstance(prompt, str):
      ids = await self._encode(prompt, "prompt", body.body_bytes)
    else:
      ids = list(prompt)
      self._check_ids(ids, "prompt")
    eos = self.service.tokenizer.special_ids.get("eos")
    stop_ids = frozenset() if eos is None else frozenset([eos])
    return self._job(body, ids, budget=body.max_tokens, budget_param="max_tokens",
                     stop_ids=stop_ids, prompt_param="prompt")

  async def _render(self, body: schemas.ChatCompletionRequest, tools: list | None,
                    function: str | None) -> tuple[str, RequestText]:
    try:
      return await self.service.prompts.render([m.template_dict() for m in body.messages],
                                               body.chat_template_kwargs or {}, tools,
                                               also=(function,), size=body.body_bytes)
    except errors.MtpjaxError as e:
      over = isinstance(e.__cause__, TemplateBudgetExceeded)
      raise ApiError(400, e.message, param="messages",
                     code="template_budget_exceeded" if over else "invalid_value") from None

  async def _chat_job(self, body: schemas.ChatCompletionRequest) -> _Job:
    self._check_model(body.model)
    tools = body.template_tools()
    function = body.forced_function() if tools else None
    marked, request = await self._render(body, tools, function)
    text = request.plain(marked)
    if tools:
      untooled, untooled_request = await self._render(body, None, function)
      if text == untooled_request.plain(untooled):
        raise schemas.unsupported("tools", "this model's chat template does not render tools, "
                                  "so the model would never see them; leave tools unset")
    suffix = forced_call_prefix(text, function)
    output = ChatOutput(thinking=reasoning.prompt_opens_thinking(text), tools=tools,
                        forced_prefix=suffix)
    ids = await self._encode(marked + forced_call_prefix(text, request(function)), "messages",
                             body.body_bytes, request)
    if not ids:
      raise ApiError(400, "the messages render to an empty prompt", param="messages")
    budget_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    job = self._job(body, ids, budget=body.token_budget, budget_param=budget_param,
                    stop_ids=self.service.tokenizer.stop_ids, prompt_param="messages")
    return dataclasses.replace(job, output=output)

  # --- generation ---------------------------------------------------------------------------

  def _check_alive(self) -> None:
    if not self.service.worker.alive:
      raise ApiError(503, "the engine is not running", type=schemas.SERVER_ERROR,
                     code="engine_unavailable")

  def _submit(self, job: _Job, label: str, ticket: Ticket) -> tuple[Generation, _TextAssembler]:
    generation = self.service.worker.submit(job.request, label)
    ticket.attach(generation)
    return generation, _TextAssembler(self.service.tokenizer, job.request.stop_ids,
                                      job.stop_strings)

  @staticmethod
  def _finish_reason(text: _TextAssembler, finished: Finished | None) -> str:
    return "stop" if text.hit_stop_string or finished is None else finished.finish_reason

  async def _next_event(self, generation: Generation, ticket: Ticket):
    """The generation's next event, or 504 once the request's deadline has passed."""
    try:
      return await generation.next_event(ticket.remaining())
    except TimeoutError:
      raise ApiError(504, "the request ran past its deadline of "
                     f"{self.service.limits.request_timeout_s:g} s (server.request_timeout_s); "
                     "ask for fewer tokens or retry later", type=schemas.SERVER_ERROR,
                     code="deadline_exceeded") from None

  async def _collect(self, job: _Job, label: str, http: fastapi.Request, ticket: Ticket
                     ) -> tuple[str, str, dict[str, int], list]:
    """(text, finish_reason, usage, TokenLogprobs) of a whole generation; a client that
    leaves cancels it at once (a watcher awaits the connection's disconnect message)."""
    self._check_alive()
    generation, text = self._submit(job, label, ticket)
    gone = asyncio.ensure_future(_client_gone(http))
    gone.add_done_callback(lambda task: task.cancelled() or generation.cancel())
    finished = None
    logprobs = None
    try:
      while finished is None and not text.hit_stop_string:
        event = await self._next_event(generation, ticket)
        if isinstance(event, Finished):
          finished = event
        elif isinstance(event, LogprobBatch):
          logprobs = event.entries
        else:
          text.feed(event, logprobs)
    except EngineFailure as e:
      raise ApiError(500, str(e), type=schemas.SERVER_ERROR, code="engine_failure") from None
    finally:
      client_left = gone.done() and not gone.cancelled()
      gone.cancel()
      if finished is None:              # stop string, deadline, or the handler cancelled
        generation.cancel("stop" if text.hit_stop_string else "cancelled")
    if client_left:
      raise ApiError(499, "the client closed the connection", code="client_closed")
    text.finish()
    return (text.text, self._finish_reason(text, finished),
            _usage(len(job.request.prompt), text.tokens), text.logprobs)

  async def _stream(self, job: _Job, label: str, envelope: dict,
                    chunk: Callable[..., list[dict]], ticket: Ticket) -> AsyncIterator[str]:
    """SSE events; `chunk(delta, finish_reason, logprobs)` builds the payloads of each text
    delta (delta None: the opener); `logprobs` are the TokenLogprobs of the tokens since the
    last call; `envelope` (id, object, created, model) starts the usage payload.

    Starlette cancels this generator when the client disconnects; `finally` then frees the slot.
    """
    generation, text = self._submit(job, label, ticket)
    finished = None
    logprobs = None
    try:
      for payload in chunk(None, None, []):
        yield _sse(payload)
      while finished is None and not text.hit_stop_string:
        event = await self._next_event(generation, ticket)
        if isinstance(event, LogprobBatch):
          logprobs = event.entries
          continue
        if isinstance(event, Finished):
          finished = event
          delta = text.finish()
        else:
          delta = text.feed(event, logprobs)
          if text.hit_stop_string:
            generation.cancel("stop")   # free the slot now, not after the last sends
        if delta:
          for payload in chunk(delta, None, text.new_logprobs()):
            yield _sse(payload)
      for payload in chunk("", self._finish_reason(text, finished), text.new_logprobs()):
        yield _sse(payload)
      if job.include_usage:
        yield _sse({**envelope, "choices": [],
                    "usage": _usage(len(job.request.prompt), text.tokens)})
    except EngineFailure as e:
      self.service.metrics.on_error(500, "engine_failure")
      yield _sse(schemas.error_body(str(e), type=schemas.SERVER_ERROR, code="engine_failure"))
    except ApiError as e:               # the deadline passed
      self.service.metrics.on_error(e.status, e.code)
      yield _sse(e.body())
    finally:
      if finished is None:              # the client went away (no-op after a stop string)
        generation.cancel()
    yield _sse("[DONE]")

  # --- routes -------------------------------------------------------------------------------

  async def completions(self, http: fastapi.Request):
    body = await _parse(schemas.CompletionRequest, http)
    with self.service.admission.enter() as ticket:
      return await self._completion(http, body, ticket)

  async def _completion(self, http: fastapi.Request, body: schemas.CompletionRequest,
                        ticket: Ticket):
    job = await self._completion_job(body)
    envelope = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.service.model_name}
    offset = 0

    def logprobs(entries: list, start: int) -> dict | None:
      if job.top_logprobs is None:
        return None
      return logprob_format.completion_logprobs(entries, self.service.tokenizer,
                                                job.top_logprobs, start)

    def chunk(delta: str | None, finish_reason: str | None, entries: list) -> list[dict]:
      nonlocal offset
      if delta is None:
        return []
      choice = {"index": 0, "text": delta, "logprobs": logprobs(entries, offset),
                "finish_reason": finish_reason}
      offset += len(delta)
      return [{**envelope, "choices": [choice]}]

    if body.stream:
      self._check_alive()
      return ticket.stream(self._stream(job, "completions", envelope, chunk, ticket))
    content, reason, usage, entries = await self._collect(job, "completions", http, ticket)
    return {**envelope, "choices": [{"index": 0, "text": content, "logprobs": logprobs(entries, 0),
                         "finish_reason": reason}], "usage": usage}

  async def chat_completions(self, http: fastapi.Request):
    body = await _parse(schemas.ChatCompletionRequest, http)
    with self.service.admission.enter() as ticket:
      return await self._chat_completion(http, body, ticket)

  async def _chat_completion(self, http: fastapi.Request, body: schemas.ChatCompletionRequest,
                             ticket: Ticket):
    job = await self._chat_job(body)
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.service.model_name
    envelope = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    output = job.output
    unsent: list = []                   # logprobs of tokens whose text the parsers still hold

    def logprobs(entries: list) -> dict | None:
      if job.top_logprobs is None or not entries:
        return None
      return logprob_format.chat_logprobs(entries, self.service.tokenizer, job.top_logprobs)

    def payload(delta: dict, finish_reason: str | None = None) -> dict:
      entries = list(unsent)
      unsent.clear()
      return {**envelope, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs(entries),
                                       "finish_reason": finish_reason}]}

    def chunk(text: str | None, finish_reason: str | None, entries: list) -> list[dict]:
      if text is None:
        return [payload({"role": "assistant", "content": ""})]
      unsent.extend(entries)
      deltas = output.feed(text) + (output.finish() if finish_reason is not None else [])
      payloads = [payload(delta) for delta in deltas]
      if finish_reason is not None:
        payloads.append(payload({}, output.finish_reason(finish_reason)))
      return payloads

    if body.stream:
      self._check_alive()
      return ticket.stream(self._stream(job, "chat", envelope, chunk, ticket))
    content, reason, usage, entries = await self._collect(job, "chat", http, ticket)
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": whole_message(content, output),
                         "logprobs": logprobs(entries),
                         "finish_reason": output.finish_reason(reason)}],
            "usage": usage}

  async def models(self):
    return {"object": "list", "data": [self.service.model_card()]}

  async def model(self, model_id: str):
    self._check_model(model_id)
    return self.service.model_card()

  async def health(self):
    if not self.service.worker.alive:
      raise ApiError(503, "the engine thread is not running", type=schemas.SERVER_ERROR,
                     code="engine_unavailable")
    if self.service.admission.draining:
      raise ApiError(503, "the server is shutting down", type=schemas.SERVER_ERROR,
                     code="shutting_down")
    return {"status": "ok", "model": self.service.model_name,
            "native_mtp": self.service.settings.native_mtp,
            "requests_in_flight": self.service.worker.running,
            "requests_queued": self.service.admission.queued}

  async def metrics(self):
    return responses.Response(self.service.metrics.render(), media_type=CONTENT_TYPE)


def create_app(service: Service) -> fastapi.FastAPI:
  """The FastAPI app; every error, ours or the framework's, leaves in the OpenAI error shape."""
  app = fastapi.FastAPI(title="mtpjax", version="0.1.0")
  routes = _Routes(service)
  app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
  app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
  app.add_api_route("/v1/models", routes.models, methods=["GET"])
  app.add_api_route("/v1/models/{model_id:path}", routes.model, methods=["GET"])
  app.add_api_route("/health", routes.health, methods=["GET"])
  app.add_api_route("/metrics", routes.metrics, methods=["GET"])

  def reply(status: int, body: dict, headers: dict | None = None) -> responses.JSONResponse:
    service.metrics.on_error(status, body["error"]["code"])
    return responses.JSONResponse(body, status_code=status, headers=headers)

  @app.exception_handler(ApiError)
  async def api_error(_, e: ApiError):
    return reply(e.status, e.body(), getattr(e, "headers", None))

  @app.exception_handler(StarletteHTTPException)
  async def http_error(_, e: StarletteHTTPException):
    error_type = schemas.NOT_FOUND if e.status_code == 404 else schemas.INVALID_REQUEST
    return reply(e.status_code, schemas.error_body(str(e.detail), type=error_type,
                                                   code=f"http_{e.status_code}"))

  @app.exception_handler(Exception)
  async def internal_error(_, e: Exception):
    return reply(500, schemas.error_body(f"internal error: {type(e).__name__}: {e}",
                                         type=schemas.SERVER_ERROR, code="internal_error"))

  limits = service.limits
  app.add_middleware(RequestGuards, limits=limits, on_error=service.metrics.on_error)
  if limits.cors_origins:             # outermost, so preflights are answered before the guards
    app.add_middleware(CORSMiddleware, allow_origins=list(limits.cors_origins),
                       allow_methods=["GET", "POST"], allow_headers=["*"])
  return app
