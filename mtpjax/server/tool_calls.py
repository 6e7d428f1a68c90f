"""GLM tool calls in a reply -> OpenAI `tool_calls`, whole or as streamed deltas.

GLM-4.5 / 4.6 write one block per call (as their chat templates instruct):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

GLM-4.7 and GLM-5 drop the newlines, so the name runs straight into the first key:
`<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>`; a call
without arguments is `<tool_call>NAME</tool_call>`. Values are raw text: a string argument as
written, any other as JSON (the templates write non-strings with `tojson`), so a value is
decoded as JSON unless the tool's schema declares the argument a string.

A block that does not parse (no name, a function the request did not offer, text between the
pairs, an unclosed tag, a reply cut off inside it) stays in the content as the model wrote it:
a malformed call is never an error. A call streams once its `</tool_call>` arrives: a delta
with its id and name, then one `arguments` fragment per argument, whose concatenation is the
JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Iterator, Mapping, Sequence

from mtpjax.server.reasoning import partial_tag

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_NAME = re.compile(r"[A-Za-z0-9_.:\-]+")
# Every tag of the format: GLM tokenizers make them special tokens, which replies must show.
TAGS = (OPEN, CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


@dataclasses.dataclass
class ToolCall:
  name: str
  arguments: dict[str, Any]
  id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

  def argument_fragments(self) -> list[str]:
    """JSON text of the arguments in pieces (one per argument) that concatenate to the whole."""
    items = [json.dumps({k: v}, ensure_ascii=False)[1:-1] for k, v in self.arguments.items()]
    if not items:
      return ["{}"]
    return ["{" + items[0]] + [", " + item for item in items[1:]] + ["}"]

  def as_openai(self) -> dict[str, Any]:
    return {"id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": "".join(self.argument_fragments())}}


def _string_arguments(tools: Sequence[Mapping[str, Any]]) -> dict[str, set[str] | None]:
  """Function name -> its arguments the schema declares strings (None: no schema)."""
  names = {}
  for tool in tools:
    function = tool.get("function") or {}
    properties = (function.get("parameters") or {}).get("properties")
    names[function.get("name")] = None if not isinstance(properties, dict) else {
        key for key, schema in properties.items()
        if isinstance(schema, dict) and schema.get("type") == "string"}
  return names


def _value(raw: str, as_string: bool) -> Any:
  if as_string:
    return raw
  try:
    return json.loads(raw)
  except ValueError:
    return raw


def parse_call(block: str, tools: Sequence[Mapping[str, Any]]) -> ToolCall | None:
  """The call written between `<tool_call>` and `</tool_call>`, or None when malformed."""
  split = min(i for i in (block.find("\n"), block.find("<arg_key>"), len(block)) if i >= 0)
  name = block[:split].strip()
  strings = _string_arguments(tools)
  if not _NAME.fullmatch(name) or name not in strings:
    return None
  rest, declared = block[split:], strings[name]
  arguments, position = {}, 0
  for match in _PAIR.finditer(rest):
    if match.start() != position:
      return None                        # text between pairs
    key = match.group(1).strip()
    arguments[key] = _value(match.group(2), declared is not None and key in declared)
    position = match.end()
  if rest[position:].strip():
    return None                          # a dangling tag or text after the last pair
  return ToolCall(name, arguments)


class ToolCallParser:
  """Answer text deltas -> content text and complete ToolCalls, in order."""

  def __init__(self, tools: Sequence[Mapping[str, Any]]):
    self._tools = tools
    self._buffer = ""
    self.calls: list[ToolCall] = []

  def feed(self, text: str, final: bool = False) -> Iterator[str | ToolCall]:
    """Content pieces (str) and calls, as far as `text` settles them."""
    self._buffer += text
    while self._buffer:
      start = self._buffer.find(OPEN)
      if start < 0:
        hold = 0 if final else partial_tag(self._buffer, OPEN)
        content = self._buffer[:len(self._buffer) - hold]
        self._buffer = self._buffer[len(content):]
        if content:
          yield content
        return
      if start:
        yield self._buffer[:start]
        self._buffer = self._buffer[start:]
      end = self._buffer.find(CLOSE)
      if end < 0:
        if final:                        # cut off inside a call: the text stays content
          yield self._buffer
          self._buffer = ""
        return
      block = self._buffer[:end + len(CLOSE)]
      self._buffer = self._buffer[len(block):]
      call = parse_call(block[len(OPEN):-len(CLOSE)], self._tools)
      if call is None:
        yield block
      else:
        self.calls.append(call)
        yield call

  def finish(self) -> Iterator[str | ToolCall]:
    return self.feed("", final=True)


def parse_tool_calls(text: str, tools: Sequence[Mapping[str, Any]]) -> tuple[str, list[ToolCall]]:
  """(content, calls) of a whole answer; the content is stripped of the calls' blocks."""
  parser = ToolCallParser(tools)
  pieces = [*parser.feed(text), *parser.finish()]
  return "".join(p for p in pieces if isinstance(p, str)).strip(), parser.calls
