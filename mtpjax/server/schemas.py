"""OpenAI request bodies as pydantic models, and the OpenAI error body every failure maps to.

Models are strict (`"5"` is not an int, `true` is not a number) so that a client bug shows up
as a 400 naming the field instead of a silently coerced value. Fields the OpenAI API defines
but mtpjax does not implement are accepted only at their neutral value: a client that asks for
penalties gets a clear 400, never an answer that quietly ignored the request. A field mtpjax
does not know at all (another server's extension, a typo) is a 400 `unsupported_field` naming
it, for the same reason.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from mtpjax.engine.sampling import MAX_TOP_LOGPROBS

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
RATE_LIMIT = "rate_limit_error"

# Bounds on list-valued fields (each stop string is matched against the text at every token).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# A conversation's validation time grows with its messages (100,000 took ~2 s on the event
# loop); OpenAI caps tools at 128.
MAX_MESSAGES = 4096
MAX_TOOLS = 128


class ApiError(Exception):
  """An error that reaches the client as `{"error": {message, type, param, code}}`."""

  def __init__(self, status: int, message: str, *, type: str = INVALID_REQUEST,
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status = status
    self.message = message
    self.type = type
    self.param = param
    self.code = code

  def body(self) -> dict[str, Any]:
    return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
  return {"error": {"message": message, "type": type, "param": param, "code": code}}


def unsupported(param: str, message: str) -> ApiError:
  return ApiError(400, message, param=param, code="unsupported_value")


class _Strict(BaseModel):
  model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
  include_usage: bool = False


class _GenerationRequest(_Strict):
  """Fields shared by /v1/completions and /v1/chat/completions; None means the server default."""
  model: str
  max_tokens: int | None = Field(default=None, ge=1)
  temperature: float | None = Field(default=None, ge=0.0, le=2.0)
  top_p: float | None = Field(default=None, gt=0.0, le=1.0)
  # extension (vLLM): -1 or 0 = off; beyond the vocabulary = off; beyond int32: refused
  top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
  seed: int | None = Field(default=None, ge=-2**63, le=2**63 - 1)   # OpenAI's int64
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)  # vLLM
  n: int | None = Field(default=None, ge=1)
  stream: bool = False
  _body_bytes: int = PrivateAttr(default=0)

  @property
  def body_bytes(self) -> int:
    """The size of the JSON body the request came in (prompt work is scheduled by it)."""
    return self._body_bytes
  stream_options: StreamOptions | None = None
  user: str | None = None
  # Defined by OpenAI, not implemented: only the neutral value is accepted (see `check`).
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  logit_bias: dict[str, Any] | None = None

  def stop_strings(self) -> tuple[str, ...]:
    stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
    if any(s == "" for s in stops):
      raise ApiError(400, "stop strings must not be empty", param="stop")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
      raise ApiError(400, f"send at most {MAX_STOP_STRINGS} stop strings of at most "
                     f"{MAX_STOP_CHARS} characters each", param="stop", code="invalid_value")
    return tuple(stops)

  def check(self) -> None:
    """Rejects values that are well-typed but not supported here."""
    if self.n not in (None, 1):
      raise unsupported("n", f"n = {self.n} is not supported: mtpjax returns one choice per "
                        "request; send n requests instead")
    for name in ("presence_penalty", "frequency_penalty"):
      if getattr(self, name) not in (None, 0, 0.0):
        raise unsupported(name, f"{name} is not supported; leave it unset or 0")
    if self.logit_bias:
      raise unsupported("logit_bias", "logit_bias is not supported; leave it unset")
    if self.stream_options is not None and not self.stream:
      raise ApiError(400, "stream_options is only allowed with stream: true",
                     param="stream_options")
    self.stop_strings()


class CompletionRequest(_GenerationRequest):
  prompt: str | list[int] | list[str] | list[list[int]]
  echo: bool = False
  logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
  best_of: int | None = None
  suffix: str | None = None

  def check(self) -> None:
    super().check()
    if self.echo:
      raise unsupported("echo", "echo is not supported; leave it false")
    if self.best_of not in (None, 1):
      raise unsupported("best_of", "best_of is not supported; leave it unset or 1")
    if self.suffix:
      raise unsupported("suffix", "suffix (insertion) is not supported; leave it unset")

  def top_logprobs_wanted(self) -> int | None:
    return self.logprobs

  def prompt_input(self) -> str | list[int]:
    """The single prompt, as text or token ids; a batch of prompts is rejected."""
    prompt = self.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
      if len(prompt) != 1:
        raise unsupported("prompt", f"a batch of {len(prompt)} prompts is not supported; send "
                          "one prompt per request")
      prompt = prompt[0]
    if len(prompt) == 0:
      raise ApiError(400, "the prompt is empty; send at least one character or token id",
                     param="prompt")
    return prompt


# Variables ChatTemplate.render sets itself.
_RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})


class TextPart(_Strict):
  type: Literal["text"]
  text: str


class FunctionCall(_Strict):
  name: str
  arguments: str                          # JSON text, as OpenAI sends it


class ToolCallItem(_Strict):
  id: str
  type: Literal["function"]
  function: FunctionCall


class ChatMessage(_Strict):
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[TextPart] | None = None
  name: str | None = None
  tool_calls: list[ToolCallItem] | None = None           # an assistant's earlier calls
  tool_call_id: str | None = None                        # a tool result's call
  reasoning_content: str | None = None                   # an assistant's earlier thinking

  def template_dict(self) -> dict[str, Any]:
    """What the chat template sees: OpenAI's `developer` is the system turn of older APIs;
    call arguments are objects, as GLM templates iterate them (`arguments.items()`)."""
    if isinstance(self.content, list):
      text = "".join(part.text for part in self.content)
    else:
      text = self.content or ""
    message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": text}
    for field in ("name", "tool_call_id", "reasoning_content"):
      if getattr(self, field) is not None:
        message[field] = getattr(self, field)
    if self.tool_calls:
      message["tool_calls"] = [
          {"id": call.id, "type": "function",
           "function": {"name": call.function.name,
                        "arguments": _arguments(call.function.arguments)}}
          for call in self.tool_calls]
    return message


def _arguments(text: str) -> dict[str, Any]:
  try:
    arguments = json.loads(text)
  except ValueError:
    arguments = None
  if not isinstance(arguments, dict):
    raise ApiError(400, f"tool call arguments must be a JSON object, got {text[:80]!r}",
                   param="messages", code="invalid_value")
  return arguments


class FunctionDefinition(_Strict):
  name: str = Field(pattern=r"^[A-Za-z0-9_.:\-]{1,64}$")
  description: str | None = None
  parameters: dict[str, Any] | None = None
  strict: bool | None = None


class Tool(_Strict):
  type: Literal["function"]
  function: FunctionDefinition


class NamedFunction(_Strict):
  name: str


class NamedToolChoice(_Strict):
  type: Literal["function"]
  function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
  messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
  max_completion_tokens: int | None = Field(default=None, ge=1)
  logprobs: bool = False
  top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
  tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
  tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
  parallel_tool_calls: bool | None = None
  response_format: dict[str, Any] | None = None
  chat_template_kwargs: dict[str, Any] | None = None      # extension (vLLM): e.g. enable_thinking

  def check(self) -> None:
    super().check()
    if (self.max_tokens is not None and self.max_completion_tokens is not None
        and self.max_tokens != self.max_completion_tokens):
      raise ApiError(400, "max_tokens and max_completion_tokens disagree; send one of them",
                     param="max_completion_tokens")
    if self.top_logprobs is not None and not self.logprobs:
      raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    offered = [tool.function.name for tool in self.tools or ()]
    choice = self.tool_choice
    if choice not in (None, "none", "auto") and not offered:
      raise ApiError(400, "tool_choice requires tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in offered:
      raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not among "
                     f"the tools {offered}", param="tool_choice")
    if self.parallel_tool_calls is False:
      raise unsupported("parallel_tool_calls", "parallel_tool_calls: false is not supported "
                        "(GLM may call several tools in one reply); leave it unset")
    reserved = sorted(_RESERVED_TEMPLATE_VARIABLES & set(self.chat_template_kwargs or ()))
    if reserved:
      raise ApiError(400, f"chat_template_kwargs may not set {reserved}: the server sets them",
                     param="chat_template_kwargs")
    if self.response_format and self.response_format.get("type", "text") != "text":
      raise unsupported("response_format", "only response_format {\"type\": \"text\"} is "
                        "supported")

  def top_logprobs_wanted(self) -> int | None:
    return (self.top_logprobs or 0) if self.logprobs else None

  def template_tools(self) -> list[dict[str, Any]] | None:
    """The tools the template renders (none with tool_choice "none")."""
    if not self.tools or self.tool_choice == "none":
      return None
    return [tool.model_dump(exclude_none=True) for tool in self.tools]

  def forced_function(self) -> str | None:
    """The function tool_choice forces: "" for any (required), its name, or None."""
    if self.tool_choice == "required":
      return ""
    if isinstance(self.tool_choice, NamedToolChoice):
      return self.tool_choice.function.name
    return None

  @property
  def token_budget(self) -> int | None:
    return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _param(loc: tuple) -> str | None:
  """`messages.0.content` from a pydantic location, without the union branch tags."""
  parts = [str(p) for p in loc if isinstance(p, int) or "[" not in str(p) and str(p) not in (
      "str", "int", "float", "bool")]
  return ".".join(parts) or None


def parse_body(model: type[_GenerationRequest], body: bytes) -> _GenerationRequest:
  """Validates a raw JSON body; every problem becomes a 400 `ApiError` naming the field."""
  try:
    request = model.model_validate_json(body or b"")
  except pydantic.ValidationError as e:
    problems = e.errors(include_url=False)
    # Of a union's per-branch errors the deepest is the telling one ("Input should be 'text'"
    # inside a content part, not "Input should be a valid string" for the whole content).
    first = max(problems, key=lambda problem: len(problem["loc"]))
    if first["type"] == "json_invalid":
      raise ApiError(400, f"the request body is not valid JSON: {first['msg']}",
                     code="invalid_json") from None
    if first["type"] == "model_type":
      raise ApiError(400, "the request body must be a JSON object", code="invalid_json") from None
    param = _param(first["loc"])
    unknown = [_param(p["loc"]) for p in problems if p["type"] == "extra_forbidden"]
    if unknown:
      raise ApiError(400, f"{unknown[0]} is not supported by this server; remove it",
                     param=unknown[0], code="unsupported_field") from None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    if len(problems) > 1:
      more = len(problems) - 1
      message += f" (and {more} more problem{'s' if more > 1 else ''})"
    raise ApiError(400, message, param=param,
                   code="missing_field" if first["type"] == "missing" else "invalid_value") from None
  request.check()
  request._body_bytes = len(body)
  return request
