"""The shipped demo package (mtpjax/assets/glm-demo): valid, advertises native MTP, and its
NextN head really predicts on held-out text while leaving greedy output unchanged."""

import json

import numpy as np
from absl.testing import absltest

import mtpjax
from mtpjax import embedded
from mtpjax.gguf.tokenizer import GgufTokenizer
from mtpjax.package.preflight import preflight
from mtpjax.telemetry import MtpStats
from mtpjax.testing.corpus import held_out_prompts

PROMPTS, PROMPT_LEN, NEW_TOKENS = 6, 32, 48


class DemoModelTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = mtpjax.load(str(embedded.DEMO_PACKAGE))
    tokenizer = GgufTokenizer.from_metadata(cls.model.metadata)
    cls.prompts = held_out_prompts(tokenizer.encode, PROMPTS, PROMPT_LEN, seed=1)

  def test_package_passes_preflight_and_advertises_native_mtp(self):
    report = preflight(embedded.DEMO_PACKAGE, check_sha=True)
    self.assertTrue(report["valid"], report["issues"])
    speculative = report["generation"]["speculative_decoding"]
    self.assertEqual(speculative["default"], "native-mtp-n1")
    self.assertEqual(speculative["strategies"][0]["layer_indices"], [report["layer_count"] - 1])
    self.assertTrue(self.model.resolution.native_mtp)

  def test_model_card_records_the_held_out_metrics(self):
    card = (embedded.DEMO_PACKAGE / "MODEL_CARD.md").read_text()
    record = json.loads(card[card.index("```json") + len("```json"):card.rindex("```")])
    self.assertGreaterEqual(record["metrics"]["mtp_agreement"], 0.6)
    self.assertIn("python tools/train_demo.py --steps=", card)

  def test_greedy_mtp_on_equals_off_and_held_out_acceptance(self):
    stats = []
    for prompt in self.prompts:
      off = self.model.generate(prompt, max_new_tokens=NEW_TOKENS, speculative="disabled")
      on = self.model.generate(prompt, max_new_tokens=NEW_TOKENS, adaptive_drafting=False)
      self.assertEqual(on.tokens, off.tokens)
      stats.append(on.stats)
    total = MtpStats.total(stats)
    self.assertGreaterEqual(total.accept_rate, 0.6, total.as_dict())
    np.testing.assert_allclose(total.tokens_per_target_pass,
                               total.committed_tokens / total.target_passes)


if __name__ == "__main__":
  absltest.main()
