"""Tokenizer and chat template rebuilt from GGUF metadata, checked against the fixture's
HF `tokenizer.json` (written by transformers) and a plain jinja2 render of its template."""

from __future__ import annotations

import json
import os
import random

import gguf
import jinja2
import tokenizers
from absl.testing import absltest, parameterized
from fixtures import FIXTURES

from mtpjax.errors import ConversionError
from mtpjax.gguf import tokenizer as gguf_tokenizer
from mtpjax.gguf.tokenizer import ChatTemplate, GgufTokenizer

FIXTURE = str(FIXTURES / "glm4moe-tiny")
GGUF_PATH = os.path.join(FIXTURE, "glm4moe_h64-F32.gguf")

TEXTS = (
    "Hello world",
    "I'll say DON'T, we've 'Re 'd",
    "a  b   c\n\n\n  d\t\te\r\n\r\nf",
    "    ",
    "\n",
    "  leading and trailing   ",
    "1 12 123 1234 12345 123456 1234567",
    "x1234567y 3.14159 -42 1e10",
    "def f(x):\n    return x**2  # ok!!!\n\t}",
    "punctuation: ,.;:!?()[]{}<>/\\|@#$%^&*_+=~`\"'--...",
    "<|user|>\nhi<|assistant|>\nthere[gMASK]<sop>done<|endoftext|>",
    "text[gMASK]inside<|observation|>words<|user|><|user|>",
    "naïve café façade Ünïcödé",
    "日本語のテキスト 中文文本 한국어",
    "emoji 😀👍🏽👨‍👩‍👧 flags 🇩🇪 ∑∫√ ≠ ≤",
    "Ελληνικά Русский עברית العربية",
    "bytearray towards Valid truncate bases __().",
    "",
)
MULTIBYTE_TEXTS = (
    "naïve café",
    "日本語のテキスト 中文",
    "emoji 😀👍🏽👨‍👩‍👧 🇩🇪",
    "mixed ∑ text 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 end",
)
MESSAGES = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": "Count 1 2 3, then say 日本 😀."},
)


def read_metadata(path: str) -> dict:
  """GGUF key/values decoded to python str/int/list, as ModelSource.metadata gives them."""
  reader = gguf.GGUFReader(path)
  return {name: field.contents() for name, field in reader.fields.items()}


class TokenizerFixtureTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.metadata = read_metadata(GGUF_PATH)
    cls.tok = GgufTokenizer.from_metadata(cls.metadata, path=GGUF_PATH)
    cls.ref = tokenizers.Tokenizer.from_file(os.path.join(FIXTURE, "tokenizer.json"))
    with open(os.path.join(FIXTURE, "special_ids.json")) as f:
      cls.special = json.load(f)

  @parameterized.parameters(*TEXTS)
  def test_encode_matches_reference(self, text):
    self.assertEqual(self.tok.encode(text), self.ref.encode(text, add_special_tokens=False).ids)

  def test_pre_tokenizer_splits_like_chatglm4(self):
    """Digits go in groups of three, contractions and newline runs stay whole."""
    pieces = [p for p, _ in self.tok.hf_tokenizer.pre_tokenizer.pre_tokenize_str(
        "1234567 I'll\n\n  x")]
    self.assertEqual(pieces, ["123", "456", "7", "ĠI", "'ll", "ĊĊ", "Ġ", "Ġx"])

  def test_table_exercises_merges_and_specials(self):
    """Guards the table itself: a table that never merges could not catch a merge bug."""
    ids = self.tok.encode(" bytearray the <|user|>")
    self.assertEqual(ids, [self.tok.token_to_id("Ġbytearray"), self.tok.token_to_id("Ġthe"),
                           self.tok.token_to_id("Ġ"), 509])

  def test_vocab_matches_reference(self):
    self.assertEqual(self.tok.vocab_size, 512)
    for token, token_id in self.ref.get_vocab().items():
      self.assertEqual(self.tok.token_to_id(token), token_id, msg=token)
      self.assertEqual(self.tok.id_to_token(token_id), token)
    self.assertIsNone(self.tok.token_to_id("no-such-token"))

  def test_special_and_stop_ids(self):
    self.assertEqual(self.tok.special_ids,
                     {"bos": 504, "eos": 502, "eot": 509, "eom": 511, "pad": 502, "unk": 502})
    self.assertEqual(self.tok.special_ids["bos"], self.special["[gMASK]"])
    self.assertEqual(self.tok.stop_ids, {self.special["<|endoftext|>"], self.special["<|user|>"],
                                         self.special["<|observation|>"]})
    self.assertEqual(self.tok.control_ids, frozenset(self.special.values()))

  def test_no_bos_added(self):
    self.assertEqual(self.tok.encode("Hi"), self.ref.encode("Hi", add_special_tokens=False).ids)
    self.assertNotIn(504, self.tok.encode("Hi"))
    self.assertEqual(self.tok.encode(""), [])

  @parameterized.parameters(*TEXTS)
  def test_decode_round_trip(self, text):
    self.assertEqual(self.tok.decode(self.tok.encode(text)), text)

  def test_decode_skips_control_tokens(self):
    ids = self.tok.encode("[gMASK]<sop><|user|>\nhi 日本<|assistant|>")
    self.assertEqual(self.tok.decode(ids, skip_special=True), "\nhi 日本")
    self.assertEqual(self.tok.decode(ids), "[gMASK]<sop><|user|>\nhi 日本<|assistant|>")

  def test_decode_matches_reference_on_random_ids(self):
    """Random ids include broken UTF-8; both sides must replace it the same way."""
    rng = random.Random(0)
    for _ in range(200):
      ids = [rng.randrange(self.tok.vocab_size) for _ in range(rng.randrange(1, 12))]
      for skip in (False, True):
        self.assertEqual(self.tok.decode(ids, skip_special=skip),
                         self.ref.decode(ids, skip_special_tokens=skip), msg=str(ids))

  def test_token_bytes_cover_every_byte(self):
    """The 256 single-byte tokens stand for 256 distinct bytes, as HF decodes them."""
    single = [self.tok.token_bytes(i) for i in range(256)]
    self.assertEqual(sorted(b[0] for b in single if len(b) == 1), list(range(256)))
    for token_id in range(self.tok.vocab_size):
      self.assertEqual(self.tok.token_bytes(token_id).decode("utf-8", errors="replace"),
                       self.ref.decode([token_id], skip_special_tokens=False), msg=str(token_id))

  @parameterized.parameters(*MULTIBYTE_TEXTS)
  def test_streaming_equals_full_decode(self, text):
    ids = self.tok.encode(text)
    stream = self.tok.stream_decoder()
    deltas = [stream.push(i) for i in ids]
    self.assertEqual(stream.flush(), "")
    self.assertEqual("".join(deltas), self.tok.decode(ids))
    self.assertEqual("".join(deltas), text)
    for delta in deltas:
      self.assertNotIn("\ufffd", delta)
    # Some character spans several byte tokens here, so some push must have held bytes back.
    self.assertIn("", deltas)

  def test_streaming_skip_special(self):
    ids = self.tok.encode("<|user|>\n日本<|assistant|>ok")
    stream = self.tok.stream_decoder(skip_special=True)
    text = "".join(stream.push(i) for i in ids) + stream.flush()
    self.assertEqual(text, self.tok.decode(ids, skip_special=True))
    self.assertEqual(text, "\n日本ok")

  def test_streaming_random_ids_equal_full_decode(self):
    rng = random.Random(1)
    for _ in range(200):
      ids = [rng.randrange(self.tok.vocab_size) for _ in range(rng.randrange(1, 12))]
      stream = self.tok.stream_decoder()
      text = "".join(stream.push(i) for i in ids) + stream.flush()
      self.assertEqual(text, self.ref.decode(ids, skip_special_tokens=False), msg=str(ids))

  def test_glm5_pre_tokenizes_like_glm4(self):
    glm5 = GgufTokenizer.from_metadata({**self.metadata, gguf_tokenizer.PRE_KEY: "glm5"})
    for text in TEXTS:
      self.assertEqual(glm5.encode(text), self.tok.encode(text))

  def test_user_defined_tokens_match_whole_and_stay_text(self):
    metadata = dict(self.metadata)
    metadata[gguf_tokenizer.TOKENS_KEY] = [*self.metadata[gguf_tokenizer.TOKENS_KEY], "<think>"]
    metadata[gguf_tokenizer.TOKEN_TYPE_KEY] = [*self.metadata[gguf_tokenizer.TOKEN_TYPE_KEY],
                                               int(gguf.TokenType.USER_DEFINED)]
    tok = GgufTokenizer.from_metadata(metadata)
    ref = tokenizers.Tokenizer.from_file(os.path.join(FIXTURE, "tokenizer.json"))
    ref.add_tokens([tokenizers.AddedToken("<think>", normalized=False)])
    text = "a<think>b c</think><|user|>"
    ids = tok.encode(text)
    self.assertEqual(ids, ref.encode(text, add_special_tokens=False).ids)
    self.assertIn(512, ids)
    self.assertEqual(tok.decode(ids, skip_special=True), "a<think>b c</think>")


class TokenizerErrorTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.metadata = read_metadata(GGUF_PATH)

  def assert_conversion_error(self, metadata, field):
    with self.assertRaises(ConversionError) as ctx:
      GgufTokenizer.from_metadata(metadata, path="model.gguf")
    self.assertEqual(ctx.exception.field, field)
    self.assertEqual(ctx.exception.path, "model.gguf")
    self.assertIn(f"field: {field}", str(ctx.exception))
    self.assertIn("remedy:", str(ctx.exception))
    return ctx.exception

  @parameterized.parameters("llama", "bert", "t5", "rwkv")
  def test_unsupported_model(self, model):
    error = self.assert_conversion_error({**self.metadata, gguf_tokenizer.MODEL_KEY: model},
                                         gguf_tokenizer.MODEL_KEY)
    self.assertIn(repr(model), str(error))

  def test_unsupported_pre(self):
    self.assert_conversion_error({**self.metadata, gguf_tokenizer.PRE_KEY: "llama-bpe"},
                                 gguf_tokenizer.PRE_KEY)

  def test_missing_keys(self):
    for key in (gguf_tokenizer.MODEL_KEY, gguf_tokenizer.TOKENS_KEY, gguf_tokenizer.MERGES_KEY):
      metadata = {k: v for k, v in self.metadata.items() if k != key}
      self.assert_conversion_error(metadata, key)

  def test_empty_or_malformed_merges(self):
    self.assert_conversion_error({**self.metadata, gguf_tokenizer.MERGES_KEY: []},
                                 gguf_tokenizer.MERGES_KEY)
    self.assert_conversion_error({**self.metadata, gguf_tokenizer.MERGES_KEY: ["ab"]},
                                 gguf_tokenizer.MERGES_KEY)
    self.assert_conversion_error({**self.metadata, gguf_tokenizer.MERGES_KEY: ["zz qq"]},
                                 gguf_tokenizer.MERGES_KEY)

  def test_token_type_length_mismatch(self):
    self.assert_conversion_error({**self.metadata, gguf_tokenizer.TOKEN_TYPE_KEY: [1, 1]},
                                 gguf_tokenizer.TOKEN_TYPE_KEY)

  def test_special_id_outside_vocab(self):
    key = gguf_tokenizer.SPECIAL_ID_KEYS["eot"]
    self.assert_conversion_error({**self.metadata, key: 512}, key)


def reference_render(source: str, **variables) -> str:
  """An independent render: plain jinja2 with HF's whitespace settings."""
  env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
  return env.from_string(source).render(**variables)


class ChatTemplateTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.metadata = read_metadata(GGUF_PATH)
    cls.template = ChatTemplate.from_metadata(cls.metadata, path=GGUF_PATH)
    with open(os.path.join(FIXTURE, "chat_template.jinja")) as f:
      cls.fixture_source = f.read()

  @parameterized.parameters(True, False)
  def test_fixture_template_matches_plain_jinja(self, add_generation_prompt):
    self.assertEqual(self.template.source, self.fixture_source)
    messages = [dict(m) for m in MESSAGES]
    rendered = self.template.render(messages, add_generation_prompt=add_generation_prompt)
    self.assertEqual(rendered, reference_render(self.fixture_source, messages=messages,
                                                add_generation_prompt=add_generation_prompt))
    self.assertTrue(rendered.startswith("[gMASK]<sop><|system|>\nYou are"))
    self.assertEqual(rendered.endswith("<|assistant|>\n"), add_generation_prompt)

  def test_rendered_prompt_tokenizes_with_prefix(self):
    tok = GgufTokenizer.from_metadata(self.metadata)
    ids = tok.encode(self.template.render(list(MESSAGES), add_generation_prompt=True))
    self.assertEqual(ids[:3], [504, 506, 508])
    self.assertEqual(ids[-2:], [510, tok.token_to_id("Ċ")])

  def test_bos_eos_variables(self):
    self.assertEqual(self.template.bos_token, "[gMASK]")
    self.assertEqual(self.template.eos_token, "<|endoftext|>")
    template = ChatTemplate("{{ bos_token }}|{{ eos_token }}", bos_token="[gMASK]",
                            eos_token="<|endoftext|>")
    self.assertEqual(template.render([]), "[gMASK]|<|endoftext|>")

  def test_default_template_when_missing(self):
    metadata = {k: v for k, v in self.metadata.items() if k != gguf_tokenizer.CHAT_TEMPLATE_KEY}
    template = ChatTemplate.from_metadata(metadata)
    rendered = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    self.assertEqual(rendered, "[gMASK]<sop><|user|>\nHi<|assistant|>\n")
    self.assertEqual(template.render(list(MESSAGES), add_generation_prompt=True),
                     self.template.render(list(MESSAGES), add_generation_prompt=True))

  def test_tools_and_tojson(self):
    source = ("{% if tools is defined %}{% for t in tools %}{{ t | tojson(ensure_ascii=False) }}\n"
              "{% endfor %}{% endif %}{{ {'b': 1, 'a': [1, 2]} | tojson(sort_keys=True) }}"
              "{% if enable_thinking is defined %}/nothink{% endif %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "天気 <&>",
                                               "parameters": {"type": "object"}}}]
    template = ChatTemplate(source)
    expected = (json.dumps(tools[0], ensure_ascii=False) + "\n"
                + json.dumps({"a": [1, 2], "b": 1}, sort_keys=True))
    self.assertEqual(template.render([], tools=tools), expected)
    self.assertEqual(template.render([]), json.dumps({"a": [1, 2], "b": 1}))
    self.assertEqual(template.render([], enable_thinking=False), expected.split("\n")[1]
                     + "/nothink")

  def test_loop_controls(self):
    template = ChatTemplate("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                            "{{ m.role }},{% endfor %}")
    self.assertEqual(template.render(list(MESSAGES)), "system,user,")

  @parameterized.parameters(
      "{{ ''.__class__.__mro__[1].__subclasses__() }}",
      "{{ ''.__class__ }}",
      "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
      "{{ cycler.__init__.__globals__ }}",
      "{{ raise_exception.__globals__ }}",
      "{{ messages.append({'role': 'user', 'content': 'injected'}) }}",
      "{{ messages[0].update({'content': 'x'}) }}",
  )
  def test_sandbox_violation_is_typed(self, source):
    messages = [dict(m) for m in MESSAGES]
    with self.assertRaises(ConversionError) as ctx:
      ChatTemplate(source, path="model.gguf").render(messages)
    self.assertIn("unsafe", str(ctx.exception))
    self.assertEqual(ctx.exception.field, gguf_tokenizer.CHAT_TEMPLATE_KEY)
    self.assertEqual(ctx.exception.path, "model.gguf")
    self.assertEqual(messages, [dict(m) for m in MESSAGES])

  def test_raise_exception_surfaces_message(self):
    template = ChatTemplate("{% if messages[0].role != 'user' %}"
                            "{{ raise_exception('Conversation must start with a user turn') }}"
                            "{% endif %}ok")
    with self.assertRaises(ConversionError) as ctx:
      template.render(list(MESSAGES))
    self.assertIn("Conversation must start with a user turn", str(ctx.exception))
    self.assertEqual(template.render([{"role": "user", "content": "x"}]), "ok")

  def test_syntax_and_runtime_errors_are_typed(self):
    with self.assertRaises(ConversionError) as ctx:
      ChatTemplate("{% for m in messages %}{{ m }")
    self.assertEqual(ctx.exception.field, gguf_tokenizer.CHAT_TEMPLATE_KEY)
    for source in ("{{ 1 / 0 }}", "{{ 'a' + 1 }}", "{{ messages[0].content.nope() }}"):
      with self.assertRaises(ConversionError):
        ChatTemplate(source).render(list(MESSAGES))


if __name__ == "__main__":
  absltest.main()
