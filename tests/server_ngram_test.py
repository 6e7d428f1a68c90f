"""`python -m mtpjax.serve --config.defaults.speculative.strategy=ngram-simple` drafts on a
model without a NextN block.

One server on a tiny glm4moe GGUF without a NextN block; drafting runs on every step where the
proposer has a match (`adaptive_drafting=off`), so `/metrics` must count the same drafts and
accepted tokens as `Model.generate(..., speculative="ngram-simple", adaptive_drafting=False)`
in this process, and the answers must equal those with speculation disabled.
"""

from __future__ import annotations

import pathlib
import tempfile

import numpy as np
from absl.testing import absltest

from server_test import close_server, metric, package_tokenizer, serve_gguf

MODEL = "tiny-no-nextn"
NEW_TOKENS = 48
_TMP = tempfile.TemporaryDirectory()
ENGINE_FLAGS = ("--config.engine.slots=1", "--config.engine.max_len=96",
                "--config.engine.prefill_buckets=(32,)", "--config.engine.adaptive_drafting=off")


def _prompts(vocab: int) -> list[list[int]]:
  """Token prompts that repeat a phrase, and one that does not."""
  rng = np.random.default_rng(8)
  phrase = rng.integers(0, vocab, size=7).tolist()
  return [phrase * 3 + phrase[:2], rng.integers(0, vocab, size=20).tolist()]


class NgramServerTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    from mtpjax.testing.tiny_glm import TinyGlmSpec, write_tiny_glm_gguf
    cls.gguf = pathlib.Path(_TMP.name) / "no-nextn.gguf"
    write_tiny_glm_gguf(cls.gguf, TinyGlmSpec(mtp=False))
    serve_gguf(cls, cls.gguf, MODEL, "--config.defaults.speculative.strategy=ngram-simple",
               *ENGINE_FLAGS)

  @classmethod
  def prepare_references(cls):
    import mtpjax  # jax loads here, while the server compiles
    cls.tokenizer = package_tokenizer(cls.gguf)[0]
    cls.eos = cls.tokenizer.special_ids["eos"]
    model = mtpjax.load(str(cls.gguf))
    cls.prompts = _prompts(model.config.vocab_size)
    cls.references, cls.drafted, cls.accepted = [], 0, 0
    for prompt in cls.prompts:
      off = model.generate(prompt, max_new_tokens=NEW_TOKENS, stop_ids=[cls.eos],
                           speculative="disabled")
      on = model.generate(prompt, max_new_tokens=NEW_TOKENS, stop_ids=[cls.eos],
                          speculative="ngram-simple", adaptive_drafting=False)
      if on.tokens != off.tokens:
        raise AssertionError("ngram-simple changed the greedy tokens in process")
      cls.references.append(off.tokens)
      cls.drafted += on.stats.drafted
      cls.accepted += on.stats.accepted
    if not cls.drafted:
      raise AssertionError("the prompts give the n-gram proposer nothing to draft")

  @classmethod
  def tearDownClass(cls):
    close_server(cls)
    super().tearDownClass()

  def test_the_model_card_and_log_show_ngram_drafting(self):
    self.assertIn("native MTP off", self.server.log())
    card = self.http.get("/v1/models").json()["data"][0]
    self.assertFalse(card["native_mtp"])
    self.assertEqual(card["speculative"]["strategy"], "ngram-simple")
    self.assertEqual(card["speculative"]["type"], "ngram-simple")
    self.assertEqual(card["speculative"]["ngram"]["max_proposal_tokens"], 4)
    self.assertEqual(card["speculative"]["max_draft_tokens_per_step"], 4)
    self.assertIsNone(card["speculative"]["draft_window"])     # no native-MTP window

  def test_greedy_answers_equal_no_speculation_and_drafts_are_counted(self):
    before = self.http.get("/metrics").text
    for prompt, reference in zip(self.prompts, self.references):
      response = self.http.post("/v1/completions", json={
          "model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0})
      self.assertEqual(response.status_code, 200, response.text)
      body = response.json()
      self.assertEqual(body["usage"]["completion_tokens"], len(reference))
      shown = reference[:-1] if reference[-1] == self.eos else reference
      self.assertEqual(body["choices"][0]["text"],
                       self.tokenizer.decode(shown, skip_special=True))
    after = self.http.get("/metrics").text
    delta = lambda name: metric(after, name) - metric(before, name)
    self.assertEqual(metric(after, "mtpjax_model_info", speculative_type="ngram-simple"), 1)
    self.assertEqual(delta("mtpjax_native_mtp_drafted"), self.drafted)
    self.assertEqual(delta("mtpjax_native_mtp_accepted"), self.accepted)


if __name__ == "__main__":
  absltest.main()
