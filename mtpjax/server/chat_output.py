"""A chat reply's text -> the assistant message: `reasoning_content`, `content`, `tool_calls`.

Chains the two GLM parsers (thinking, then tool calls in the answer) and turns what they
settle into OpenAI chat deltas, so that streaming and whole replies share one path: a whole
reply is the merge of its deltas.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from mtpjax.server import reasoning
from mtpjax.server.reasoning import ReasoningParser
from mtpjax.server.tool_calls import OPEN as TOOL_CALL_OPEN
from mtpjax.server.tool_calls import ToolCall, ToolCallParser


def forced_call_prefix(prompt: str, function: str | None) -> str:
  """What to append to a rendered prompt so that the reply is a call (tool_choice "required":
  `function` ""; a named function: its name), closing a thinking phase the prompt opened."""
  if function is None:
    return ""
  close = reasoning.CLOSE if reasoning.prompt_opens_thinking(prompt) else ""
  return close + TOOL_CALL_OPEN + function


class ChatOutput:
  """Feed reply text deltas; get OpenAI `delta` dicts back (possibly none, possibly several)."""

  def __init__(self, *, thinking: bool, tools: Sequence[Mapping[str, Any]] | None,
               forced_prefix: str = ""):
    """`thinking`: the prompt left a `<think>` open; `tools`: parse tool calls against them;
    `forced_prefix`: text appended to the prompt for the model (`forced_call_prefix`), parsed
    as the start of the reply but never sent."""
    self._reasoning = ReasoningParser(thinking=thinking)
    self._tools = ToolCallParser(tools) if tools else None
    self.calls: list[ToolCall] = []
    self.feed(forced_prefix)             # an open call: the parsers hold it, nothing comes out

  def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
    reasoning, answer = self._reasoning.feed(text, final)
    deltas = [{"reasoning_content": reasoning}] if reasoning else []
    return deltas + self._answer(answer, final)

  def finish(self) -> list[dict[str, Any]]:
    return self.feed("", final=True)

  def _answer(self, text: str, final: bool) -> list[dict[str, Any]]:
    if self._tools is None:
      return [{"content": text}] if text else []
    deltas = []
    for piece in self._tools.feed(text, final):
      if isinstance(piece, str):
        deltas.append({"content": piece})
        continue
      index = len(self.calls)
      self.calls.append(piece)
      deltas.append({"tool_calls": [{"index": index, "id": piece.id, "type": "function",
                                     "function": {"name": piece.name, "arguments": ""}}]})
      deltas += [{"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}
                 for fragment in piece.argument_fragments()]
    return deltas

  def finish_reason(self, reason: str) -> str:
    """A reply that ended by itself after calling tools finishes with "tool_calls"."""
    return "tool_calls" if self.calls and reason == "stop" else reason


def whole_message(text: str, output: ChatOutput) -> dict[str, Any]:
  """The assistant message of a whole reply."""
  deltas = output.feed(text) + output.finish()
  reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
  content = "".join(d.get("content", "") for d in deltas)
  message: dict[str, Any] = {"role": "assistant", "content": content}
  if reasoning:
    message["reasoning_content"] = reasoning
  if output.calls:
    message["content"] = content.strip() or None
    message["tool_calls"] = [call.as_openai() for call in output.calls]
  return message
