"""Tokenizing a prompt with a bound on the work: no more text is read than the context holds.

A 4,000,000-character prompt took 18 s to tokenize before the server found it too long; two
clients repeating it held both prompt threads. Here a prompt is refused at once when its length
alone proves it too long (a token covers at most the vocabulary's longest token text, so a
text of n characters has at least n / longest tokens), and otherwise tokenized in chunks that
stop as soon as the count passes the limit. Chunks are cut only where the GLM split regex
(docs/MODEL.md §12) always ends a piece, so the ids are exactly those of the whole text:
between a line break and a letter, or between a letter and a space before a letter (no piece
holds a letter and the character next to it on such a cut, and BPE merges only inside a
piece). Vocabularies with spaces or line breaks inside an added token are never cut.
"""

from __future__ import annotations

import re
from typing import Iterator

import tokenizers

from mtpjax.errors import MtpjaxError

CHUNK_CHARS = 1 << 15
# Candidate cuts (Python's [^\W\d_] is letters plus a few numerals, so each is checked with
# str.isalpha): after a line break before a letter, or after a letter before " " + letter.
_CANDIDATE_CUT = re.compile(r"(?<=\n)(?=[^\W\d_])|(?<=[^\W\d_])(?= [^\W\d_])")


class PromptTooLong(MtpjaxError):
  """The prompt has more tokens than `limit`; `at_least` is how many were counted."""

  def __init__(self, at_least: int, limit: int):
    super().__init__(f"the prompt has at least {at_least} tokens, over the {limit} the context "
                     "holds", field="prompt", remedy="shorten the prompt or raise engine.max_len")
    self.at_least = at_least


def _is_cut(text: str, at: int) -> bool:
  if text[at - 1] == "\n":
    return text[at].isalpha()
  return text[at - 1].isalpha() and text[at + 1].isalpha()


def _chunks(text: str) -> Iterator[str]:
  """`text` in pieces of about CHUNK_CHARS cut at safe places (the rest whole where there is
  none within a chunk's length)."""
  start = 0
  while len(text) - start > 2 * CHUNK_CHARS:
    cut = next((m.start() for m in _CANDIDATE_CUT.finditer(
        text, start + CHUNK_CHARS, start + 2 * CHUNK_CHARS) if _is_cut(text, m.start())), None)
    if cut is None:
      break
    yield text[start:cut]
    start = cut
  yield text[start:]


class BoundedEncoder:
  """`tokenizer`'s ids of a text, refusing one over a limit with bounded work."""

  def __init__(self, tokenizer: tokenizers.Tokenizer):
    self.tokenizer = tokenizer
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    self.longest_token = max(map(len, vocab), default=1)
    added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
    self._may_cut = not any(" " in t or "\n" in t for t in added)

  def _encode(self, text: str) -> list[int]:
    """`encode_batch` releases the GIL while the Rust tokenizer works."""
    return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids if text else []

  def encode(self, text: str, limit: int | None = None) -> list[int]:
    """Ids of `text`; with `limit`, raises PromptTooLong past it, having read at most about
    `limit` tokens' worth of text beyond a chunk."""
    if limit is None:
      return self._encode(text)
    if len(text) > limit * self.longest_token:
      raise PromptTooLong(-(-len(text) // self.longest_token), limit)
    ids: list[int] = []
    for chunk in (_chunks(text) if self._may_cut else (text,)):
      ids += self._encode(chunk)
      if len(ids) > limit:
        raise PromptTooLong(len(ids), limit)
    return ids
