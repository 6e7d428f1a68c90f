"""GLM's thinking phase, split from the answer: `<think>...</think>` -> `reasoning_content`.

GLM-4.5 writes `<think>` itself at the start of its reply; GLM-4.7 and later templates open it
in the prompt (the generation prompt ends with `<think>`), and `enable_thinking: false` closes
it there (`<think></think>` / `</think>`). So the parser starts inside the thinking phase
exactly when the rendered prompt leaves a `<think>` open, and otherwise treats a `<think>`
before any answer text as the start of one. Text after `</think>` (or with no thinking) is the
answer. Deltas come out as they arrive; only a tail that could still become a tag is held back.
"""

from __future__ import annotations

OPEN = "<think>"
CLOSE = "</think>"


def prompt_opens_thinking(prompt: str) -> bool:
  """Whether the rendered prompt ends inside a thinking phase (GLM-4.7's generation prompt)."""
  return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def partial_tag(text: str, tag: str) -> int:
  """Length of the longest tail of `text` that is a proper prefix of `tag` (text to hold back
  while streaming: it may still become the tag)."""
  for size in range(min(len(tag) - 1, len(text)), 0, -1):
    if tag.startswith(text[-size:]):
      return size
  return 0


class ReasoningParser:
  """Text deltas of a reply -> (reasoning delta, answer delta) pairs."""

  def __init__(self, *, thinking: bool = False):
    self.thinking = thinking
    self._thought = thinking         # a thinking phase began: no second one, trim the answer
    self._answer_started = False     # a <think> after answer text is answer text
    self._pending = ""

  def feed(self, text: str, final: bool = False) -> tuple[str, str]:
    buffer = self._pending + text
    self._pending = ""
    reasoning, answer = [], []
    while buffer:
      if self.thinking:
        end = buffer.find(CLOSE)
        if end < 0:
          hold = 0 if final else partial_tag(buffer, CLOSE)
          reasoning.append(buffer[:len(buffer) - hold])
          self._pending = buffer[len(buffer) - hold:]
          break
        reasoning.append(buffer[:end])
        buffer = buffer[end + len(CLOSE):]
        self.thinking = False
        continue
      if not self._answer_started:
        stripped = buffer.lstrip()
        could_open = not self._thought and OPEN.startswith(stripped)
        if not final and (not stripped or could_open):
          self._pending = buffer         # leading whitespace, or what may become <think>
          break
        if not self._thought and stripped.startswith(OPEN):
          buffer = stripped[len(OPEN):]
          self.thinking = self._thought = True
          continue
        if self._thought:
          buffer = stripped              # GLM puts a newline between </think> and the answer
        self._answer_started = bool(buffer)
      answer.append(buffer)
      break
    return "".join(reasoning), "".join(answer)

  def finish(self) -> tuple[str, str]:
    """The held-back tail, at the end of the reply."""
    return self.feed("", final=True)


def split_reasoning(text: str, *, thinking: bool = False) -> tuple[str, str]:
  """(reasoning, answer) of a whole reply."""
  parser = ReasoningParser(thinking=thinking)
  reasoning, answer = parser.feed(text)
  tail_reasoning, tail_answer = parser.finish()
  return reasoning + tail_reasoning, answer + tail_answer
