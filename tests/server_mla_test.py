"""`python -m mtpjax.serve` serves the two MLA architectures with native MTP on, like glm4moe.

One server per class on a llama.cpp-converted tiny GGUF (arch `deepseek2`, the GLM-4.7-Flash
layout, and arch `glm-dsa`, the GLM-5 layout), both with a NextN block. A plain GGUF carries
no publisher recommendation, so native MTP is opted into with
`--config.defaults.speculative.strategy=native-mtp-n1`. The greedy answers must equal those of
`mtpjax.load(gguf).generate(..., speculative="disabled")` in this process (MTP off: a draft
never changes a greedy answer), decoded with the GGUF's own tokenizer, and `/metrics` must show
that drafts were made and verified.
"""

from __future__ import annotations

import pathlib

from absl.testing import absltest

from fixtures import FIXTURES
from server_test import close_server, metric, package_tokenizer, serve_gguf

NEW_TOKENS = 8
PROMPTS = ("The quick brown fox", "Hello, world!")   # 14 and 10 tokens: the 16 bucket holds them
CHAT = [{"role": "user", "content": "Hello"}]
NEXTN_LAYER = 3                                       # 3 trunk layers + the NextN block blk.3
# Small engine: one slot, one prefill bucket, so the server compiles few programs.
ENGINE_FLAGS = ("--config.engine.slots=1", "--config.engine.max_len=32",
                "--config.engine.prefill_buckets=(16,)")


class _MlaServerChecks:
  """The checks; each subclass names its fixture (a mixin, so it is not collected alone)."""

  GGUF: pathlib.Path
  ARCH: str
  MODEL: str

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    serve_gguf(cls, cls.GGUF, cls.MODEL, "--config.defaults.speculative.strategy=native-mtp-n1",
               *ENGINE_FLAGS)

  @classmethod
  def prepare_references(cls):
    """Greedy tokens of each prompt alone, in this process, with native MTP off."""
    import mtpjax  # jax loads here, while the server compiles
    cls.tokenizer, cls.template = package_tokenizer(cls.GGUF)
    model = mtpjax.load(str(cls.GGUF))
    if model.resolution.native_mtp:
      raise AssertionError(f"a plain GGUF must resolve to MTP off: {model.resolution.reason}")
    cls.eos = cls.tokenizer.special_ids["eos"]
    cls.references = {}
    for prompt in PROMPTS:
      result = model.generate(cls.tokenizer.encode(prompt), max_new_tokens=NEW_TOKENS,
                              stop_ids=[cls.eos], speculative="disabled")
      cls.references[prompt] = [int(t) for t in result.tokens]
    cls.chat_ids = cls.tokenizer.encode(cls.template.render(CHAT, add_generation_prompt=True))
    result = model.generate(cls.chat_ids, max_new_tokens=NEW_TOKENS,
                            stop_ids=cls.tokenizer.stop_ids, speculative="disabled")
    cls.chat_reference = [int(t) for t in result.tokens]

  @classmethod
  def tearDownClass(cls):
    close_server(cls)
    super().tearDownClass()

  def decode(self, tokens: list[int], stops) -> str:
    """What the server shows: a final stop id ends the text without appearing in it."""
    shown = tokens[:-1] if tokens and tokens[-1] in stops else tokens
    return self.tokenizer.decode(shown, skip_special=True)

  def metrics(self) -> str:
    response = self.http.get("/metrics")
    self.assertEqual(response.status_code, 200)
    return response.text

  def test_native_mtp_is_on_for_the_gguf_nextn_head(self):
    self.assertRegex(self.server.log(), (
        r"native MTP on: native-mtp-n1 \(from defaults\.speculative\.strategy\): the GGUF "
        rf"proves a NextN head \({self.ARCH}\.nextn_predict_layers = 1, "))
    card = self.http.get("/v1/models").json()["data"][0]
    self.assertEqual(card["id"], self.MODEL)
    self.assertTrue(card["native_mtp"])
    self.assertEqual(card["speculative"]["strategy"], "native-mtp-n1")
    self.assertEqual(card["speculative"]["scope"], "defaults.speculative.strategy")
    self.assertEqual(card["speculative"]["mtp_layer_index"], NEXTN_LAYER)

  def test_greedy_completions_equal_the_reference_and_mtp_drafts(self):
    before = self.metrics()
    completion_tokens = 0
    for prompt in PROMPTS:
      tokens = self.references[prompt]
      response = self.client.completions.create(model=self.MODEL, prompt=prompt,
                                                max_tokens=NEW_TOKENS, temperature=0)
      self.assertEqual(response.choices[0].text, self.decode(tokens, {self.eos}), prompt)
      self.assertEqual(response.usage.prompt_tokens, len(self.tokenizer.encode(prompt)), prompt)
      self.assertEqual(response.usage.completion_tokens, len(tokens), prompt)
      expected = "stop" if tokens[-1] == self.eos else "length"
      self.assertEqual(response.choices[0].finish_reason, expected, prompt)
      completion_tokens += response.usage.completion_tokens
    after = self.metrics()
    delta = lambda name: metric(after, name) - metric(before, name)
    self.assertEqual(metric(after, "mtpjax_native_mtp_enabled"), 1)
    self.assertEqual(metric(after, "mtpjax_model_info", native_mtp="true"), 1)
    drafted = delta("mtpjax_native_mtp_drafted")
    verified = delta("mtpjax_native_mtp_accepted") + delta("mtpjax_native_mtp_rejected")
    self.assertGreater(drafted, 0)
    self.assertGreater(verified, 0)
    # At most one draft per request is left unverified when it ends.
    self.assertBetween(drafted - verified, 0, len(PROMPTS))
    self.assertEqual(delta("mtpjax_native_mtp_committed_tokens"), completion_tokens)
    self.assertEqual(delta("mtpjax_generation_tokens_total"), completion_tokens)

  def test_chat_equals_the_reference(self):
    response = self.client.chat.completions.create(model=self.MODEL, messages=CHAT,
                                                   max_tokens=NEW_TOKENS, temperature=0)
    choice = response.choices[0]
    self.assertEqual(choice.message.role, "assistant")
    self.assertEqual(choice.message.content,
                     self.decode(self.chat_reference, self.tokenizer.stop_ids))
    self.assertEqual(response.usage.prompt_tokens, len(self.chat_ids))
    self.assertEqual(response.usage.completion_tokens, len(self.chat_reference))
    expected = "stop" if self.chat_reference[-1] in self.tokenizer.stop_ids else "length"
    self.assertEqual(choice.finish_reason, expected)


class Deepseek2ServerTest(_MlaServerChecks, absltest.TestCase):
  """GLM-4.7-Flash layout: MLA, converted by llama.cpp as arch deepseek2."""

  GGUF = FIXTURES / "glm4moelite-tiny" / "glm4moelite_h64-F32.gguf"
  ARCH = "deepseek2"
  MODEL = "glm-4.7-flash-tiny"


class GlmDsaServerTest(_MlaServerChecks, absltest.TestCase):
  """GLM-5 layout: MLA plus the sparse-attention indexer, arch glm-dsa."""

  GGUF = FIXTURES / "glmdsa-tiny" / "glmdsa_h64-F32.gguf"
  ARCH = "glm-dsa"
  MODEL = "glm-5-tiny"


if __name__ == "__main__":
  absltest.main()
