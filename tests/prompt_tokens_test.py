"""Tokenizing with a bound on the work (mtpjax/gguf/prompt_tokens.py): chunked ids equal the
whole text's, and a prompt over the limit is refused having read about the limit's worth.

The reference is the fixture's `tokenizer.json` (written by transformers) encoding each whole
text in one call.
"""

from __future__ import annotations

import os
import random

import tokenizers
from absl.testing import absltest, parameterized
from fixtures import FIXTURES
from gguf_tokenizer_test import read_metadata

from mtpjax.gguf import prompt_tokens
from mtpjax.gguf.control_tokens import plain_text_tokenizer
from mtpjax.gguf.prompt_tokens import BoundedEncoder, PromptTooLong
from mtpjax.gguf.tokenizer import ChatTemplate, GgufTokenizer

FIXTURE = str(FIXTURES / "glm4moe-tiny")
GGUF_PATH = os.path.join(FIXTURE, "glm4moe_h64-F32.gguf")
# Pieces whose neighbours test the cuts: letters of several scripts, numerals that are not
# letters (², Ⅻ, ½), punctuation before line breaks, runs of spaces and line breaks, specials.
_PIECES = ("word", " word", "Wörd", " 日本語", " ελληνικά", "x²", " Ⅻ", "½", " 42", "123456",
           ".\n", "!\n\n", "\n", "\r\n", "  ", "   \n", "\t", "'s", " don't", "<|user|>",
           "[gMASK]", "<think>", "😀", " a", "b", "\nc", " \nd", "_e", "-f")


def random_text(seed: int, chars: int) -> str:
  rng = random.Random(seed)
  parts, size = [], 0
  while size < chars:
    piece = rng.choice(_PIECES)
    parts.append(piece)
    size += len(piece)
  return "".join(parts)


class BoundedEncoderTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tok = GgufTokenizer.from_metadata(read_metadata(GGUF_PATH), path=GGUF_PATH)
    cls.reference = tokenizers.Tokenizer.from_file(os.path.join(FIXTURE, "tokenizer.json"))
    cls.plain_reference = plain_text_tokenizer(cls.reference)

  @parameterized.parameters(0, 1, 2, 3)
  def test_chunked_ids_equal_the_whole_texts(self, seed):
    text = random_text(seed, 5 * prompt_tokens.CHUNK_CHARS)
    self.assertGreater(len(list(prompt_tokens._chunks(text))), 1)    # it was cut
    for encoder, reference in ((BoundedEncoder(self.tok.hf_tokenizer), self.reference),
                               (BoundedEncoder(plain_text_tokenizer(self.tok.hf_tokenizer)),
                                self.plain_reference)):
      self.assertEqual(encoder.encode(text, limit=10**9),
                       reference.encode(text, add_special_tokens=False).ids)

  def test_a_long_prompt_is_refused_having_read_about_the_limit(self):
    text = random_text(7, 40 * prompt_tokens.CHUNK_CHARS)
    total = len(self.reference.encode(text, add_special_tokens=False).ids)
    encoder = BoundedEncoder(self.tok.hf_tokenizer)
    limit = len(text) // encoder.longest_token + 1        # its length alone does not refuse it
    with self.assertRaises(PromptTooLong) as raised:
      encoder.encode(text, limit=limit)
    # At most the limit plus the two chunks it was reading, far from the whole text's count.
    self.assertGreater(raised.exception.at_least, limit)
    self.assertLess(raised.exception.at_least, limit + 2 * prompt_tokens.CHUNK_CHARS)
    self.assertLess(raised.exception.at_least, total // 5)
    self.assertEqual(raised.exception.field, "prompt")

  def test_a_prompt_its_length_proves_too_long_is_refused_unread(self):
    encoder = BoundedEncoder(self.tok.hf_tokenizer)
    longest = max(map(len, self.reference.get_vocab(with_added_tokens=True)))
    self.assertEqual(encoder.longest_token, longest)
    text = "a" * (10 * longest + 1)                    # at least 11 tokens, whatever they are
    with self.assertRaises(PromptTooLong) as raised:
      encoder.encode(text, limit=10)
    self.assertEqual(raised.exception.at_least, 11)

  def test_a_prompt_within_the_limit_keeps_its_ids(self):
    text = random_text(11, 3 * prompt_tokens.CHUNK_CHARS)
    ids = self.reference.encode(text, add_special_tokens=False).ids
    self.assertEqual(BoundedEncoder(self.tok.hf_tokenizer).encode(text, limit=len(ids)), ids)
    with self.assertRaises(PromptTooLong):
      BoundedEncoder(self.tok.hf_tokenizer).encode(text, limit=len(ids) - 1)

  def test_a_chat_over_the_limit_is_refused_across_its_segments(self):
    """A chat's plain segments and the template's control tokens count against one limit."""
    messages = [{"role": "user", "content": "<|user|> hi " * 400}]
    marked, request = self.tok.control.render(ChatTemplate(), messages)
    ids = request.encode(marked)
    self.assertEqual(request.encode(marked, limit=len(ids)), ids)
    with self.assertRaises(PromptTooLong):
      request.encode(marked, limit=len(ids) - 1)


if __name__ == "__main__":
  absltest.main()
