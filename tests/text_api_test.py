"""`model.tokenizer`, `model.generate_text` and `model.chat`: text in, text out.

References are built by hand from the pieces the text API wraps: the GGUF metadata's tokenizer
and chat template (`GgufTokenizer` / `ChatTemplate.from_metadata`) around the token-id API.
"""

from absl.testing import absltest

import mtpjax
from mtpjax import embedded, errors, text
from mtpjax.gguf.template_budget import TemplateBudgetExceeded
from mtpjax.gguf.tokenizer import CHAT_TEMPLATE_KEY, ChatTemplate, GgufTokenizer


class TextApiTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = mtpjax.load(str(embedded.DEMO_PACKAGE))
    cls.reference_tokenizer = GgufTokenizer.from_metadata(cls.model.metadata)
    cls.template = ChatTemplate.from_metadata(cls.model.metadata)

  def test_tokenizer_encodes_decodes_and_renders_the_chat_template(self):
    tokenizer = self.model.tokenizer
    text = "def main():\n    return 0\n"
    self.assertEqual(tokenizer.encode(text), self.reference_tokenizer.encode(text))
    self.assertEqual(tokenizer.decode(tokenizer.encode(text)), text)
    messages = [{"role": "user", "content": "hi"}]
    self.assertEqual(tokenizer.apply_chat_template(messages),
                     self.template.render(messages, add_generation_prompt=True))
    self.assertIs(self.model.tokenizer, tokenizer)        # built once per model

  def test_generate_text_continues_a_prompt(self):
    prompt = "import os\nimport sys\n"
    reply = self.model.generate_text(prompt, max_new_tokens=12, temperature=0.7, seed=3)
    eos = self.reference_tokenizer.special_ids["eos"]
    expected = self.model.generate(self.reference_tokenizer.encode(prompt), max_new_tokens=12,
                                   temperature=0.7, seed=3, stop_ids=(eos,))
    self.assertEqual(reply.tokens, expected.tokens)
    self.assertEqual(reply.text, self.reference_tokenizer.decode(
        [t for t in expected.tokens if t != eos], skip_special=True))
    self.assertEqual(reply.finish_reason, expected.finish_reason)
    self.assertEqual(reply.stats.committed_tokens, expected.stats.committed_tokens)
    self.assertTrue(reply.text)

  def test_chat_answers_messages_with_the_model_template(self):
    messages = [{"role": "user", "content": "def parse_args(argv):"}]
    reply = self.model.chat(messages, max_new_tokens=12)
    prompt = self.template.render(messages, add_generation_prompt=True)
    expected = self.model.generate(self.reference_tokenizer.encode(prompt), max_new_tokens=12,
                                   stop_ids=self.reference_tokenizer.stop_ids)
    self.assertEqual(reply.prompt, prompt)
    self.assertEqual(reply.tokens, expected.tokens)
    self.assertEqual(reply.text, self.reference_tokenizer.decode(
        [t for t in expected.tokens if t not in self.reference_tokenizer.stop_ids],
        skip_special=True))
    self.assertEqual(self.model.generate_text(messages, max_new_tokens=12).text, reply.text)

  def test_a_hostile_package_template_raises_instead_of_hanging(self):
    """The package's template is untrusted: a constant expression jinja would fold while
    compiling, or an unbounded loop, gives a typed error under the default budget."""
    for source in ("{{ 10 ** 1000000000 }}",
                   "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                   "{% endfor %}"):
      tokenizer = text.Tokenizer.from_metadata({**self.model.metadata,
                                                CHAT_TEMPLATE_KEY: source})
      with self.assertRaises(errors.ConversionError) as raised:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
      self.assertIsInstance(raised.exception.__cause__, TemplateBudgetExceeded, source)


if __name__ == "__main__":
  absltest.main()
