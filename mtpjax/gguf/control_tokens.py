"""Control tokens only where the chat template puts them.

A chat prompt is one string: the template's markup (`<|user|>`, `<|assistant|>`, `[gMASK]`)
around text from the request. Tokenized as it stands, a user who types `<|assistant|>` gets the
control token itself and can close their own turn and write the assistant's. So every string
of the request (message text, names, tool results, tool schemas, a forced call's name) is
*marked* before rendering: a private-use character, absent from the request, goes inside each
control token's text it holds (`<` + mark + `|user|>`), where no template looks and no token
matches. After rendering, the unmarked control-token texts are the template's: they become
control tokens, and the text between them, marks removed, is tokenized with special tokens as
plain text (docs/MODEL.md §12). A request without control-token text is tokenized exactly as
before. Completions prompts are the caller's own markup and keep matching control tokens; token
ids can be sent as a list where a caller means them.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Iterable, Mapping

import tokenizers

from mtpjax.errors import ConversionError
from mtpjax.gguf.prompt_tokens import BoundedEncoder, PromptTooLong

# Private-use code points (the BMP's, then plane 15's): no tokenizer, template or language
# gives them a meaning.
_MARKS = (*range(0xE000, 0xF900), *range(0xF0000, 0xFFFFE))


def plain_text_tokenizer(hf_tokenizer: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
  """A copy of `hf_tokenizer` that reads control-token text as ordinary text (a copy, since
  the flag is the tokenizer's and other threads encode with the original)."""
  plain = tokenizers.Tokenizer.from_str(hf_tokenizer.to_str())
  plain.encode_special_tokens = True
  return plain


def _strings(value: Any) -> Iterable[str]:
  if isinstance(value, str):
    yield value
  elif isinstance(value, dict):
    for key, item in value.items():
      yield from _strings(key)
      yield from _strings(item)
  elif isinstance(value, (list, tuple)):
    for item in value:
      yield from _strings(item)


@dataclasses.dataclass(frozen=True)
class RequestText:
  """One request's mark (None when no string of it holds control-token text)."""
  mark: str | None
  control: "ControlTokens"

  def __call__(self, value: Any) -> Any:
    """`value` (a string, or lists and dicts of them) with every control-token text marked."""
    if self.mark is None:
      return value
    if isinstance(value, str):
      return self.control.pattern.sub(lambda m: m[0][0] + self.mark + m[0][1:], value)
    if isinstance(value, dict):
      return {self(key): self(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
      return type(value)(self(item) for item in value)
    return value

  def plain(self, text: str) -> str:
    """Rendered text as the model reads it (marks removed)."""
    return text if self.mark is None else text.replace(self.mark, "")

  def encode(self, text: str, limit: int | None = None) -> list[int]:
    """Token ids of rendered `text`: unmarked control-token texts are control tokens, the rest
    (marked request text included) is plain text; PromptTooLong past `limit` ids."""
    control = self.control
    if self.mark is None:
      return control.encode(text, limit)
    ids: list[int] = []
    start = 0
    for match in [*control.pattern.finditer(text), None]:
      end = len(text) if match is None else match.start()
      left = None if limit is None else max(limit - len(ids), 0)
      try:
        ids += control.encode_plain(self.plain(text[start:end]), left)
      except PromptTooLong as e:
        raise PromptTooLong(len(ids) + e.at_least, limit) from None
      if match is not None:
        ids.append(control.ids[match[0]])
        start = match.end()
    if limit is not None and len(ids) > limit:
      raise PromptTooLong(len(ids), limit)
    return ids


class ControlTokens:
  """A tokenizer's control tokens, and requests' text marked against them."""

  def __init__(self, hf_tokenizer: tokenizers.Tokenizer, ids: dict[str, int]):
    """`ids`: each control token's text -> id."""
    self.hf_tokenizer = hf_tokenizer
    self.ids = ids
    # Longest first: at one position the regex takes the longest text, as the tokenizer does.
    self.pattern = re.compile("|".join(re.escape(text) for text in
                                       sorted(ids, key=len, reverse=True)) or r"(?!)")

  @functools.cached_property
  def _matched(self) -> BoundedEncoder:
    return BoundedEncoder(self.hf_tokenizer)

  @functools.cached_property
  def _plain(self) -> BoundedEncoder:
    return BoundedEncoder(plain_text_tokenizer(self.hf_tokenizer))

  def encode(self, text: str, limit: int | None = None) -> list[int]:
    """Ids of `text`, control-token texts matched; PromptTooLong past `limit` ids."""
    return self._matched.encode(text, limit)

  def encode_plain(self, text: str, limit: int | None = None) -> list[int]:
    """Ids of `text` with control-token texts read as ordinary text."""
    return self._plain.encode(text, limit)

  def render(self, template: Any, messages: Any, *, tools: Any = None,
             template_vars: Mapping[str, Any] | None = None, also: Iterable[Any] = ()
             ) -> tuple[str, RequestText]:
    """`template` (a ChatTemplate) rendered for generation over the marked request, and the
    request's marking (`also`: more request strings to mark with it, e.g. a forced call)."""
    template_vars = dict(template_vars or {})
    request = self.request(messages, tools, template_vars, *also)
    text = template.render(request(messages), add_generation_prompt=True, tools=request(tools),
                           **request(template_vars))
    return text, request

  def request(self, *values: Any) -> RequestText:
    """The marking for a request made of `values`: a mark that none of their strings holds,
    or none at all when none holds control-token text."""
    strings = list(_strings(values))
    if not any(self.pattern.search(s) for s in strings):
      return RequestText(None, self)
    used = set().union(*map(set, strings))
    mark = next((chr(c) for c in _MARKS if chr(c) not in used), None)
    if mark is None:
      raise ConversionError("the request's text holds control-token text and every "
                            "private-use character, so its turns cannot be kept apart",
                            field="messages", remedy="leave private-use characters out")
    return RequestText(mark, self)
