"""The shipped demo package (mtpjax/assets/glm-demo): valid, advertises native MTP with an
adaptive window of up to 3 drafts, and its NextN head, trained for depth, really predicts on
held-out text (prompts the card did not measure) while leaving greedy output unchanged."""

import json

import numpy as np
from absl.testing import absltest

import mtpjax
from mtpjax import embedded
from mtpjax.draft_window import DraftWindow
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.gguf.tokenizer import GgufTokenizer
from mtpjax.package.preflight import preflight
from mtpjax.telemetry import MtpStats
from mtpjax.testing.corpus import held_out_prompts

# Seed 1: the card decodes seed 0's prompts; these are others from the same held-out files.
PROMPTS, PROMPT_LEN, NEW_TOKENS = 16, 64, 96


class DemoModelTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = mtpjax.load(str(embedded.DEMO_PACKAGE))
    tokenizer = GgufTokenizer.from_metadata(cls.model.metadata)
    cls.prompts = held_out_prompts(tokenizer.encode, PROMPTS, PROMPT_LEN, seed=1)
    cls.off = [cls.model.generate(p, max_new_tokens=NEW_TOKENS, speculative="disabled").tokens
               for p in cls.prompts]
    # One drafting engine for both windows, 8 prompts a step (greedy tokens do not depend on
    # the batch): fewer compiles and steps than a `generate` per prompt and window.
    cls.drafting = cls.model.engine(native_mtp=True, draft_tokens=3, slots=8, max_len=256)

  def test_package_passes_preflight_and_advertises_an_adaptive_window(self):
    report = preflight(embedded.DEMO_PACKAGE, check_sha=True)
    self.assertTrue(report["valid"], report["issues"])
    speculative = report["generation"]["speculative_decoding"]
    self.assertEqual(speculative["default"], "mtp")
    self.assertEqual(speculative["strategies"][0]["layer_indices"], [report["layer_count"] - 1])
    self.assertTrue(self.model.resolution.native_mtp)
    self.assertEqual(self.model.resolution.draft_window, DraftWindow(1, 2, 3, adaptive=True))

  def test_model_card_records_the_held_out_metrics_and_decode_figures(self):
    card = (embedded.DEMO_PACKAGE / "MODEL_CARD.md").read_text()
    record = json.loads(card[card.index("```json") + len("```json"):card.rindex("```")])
    self.assertGreaterEqual(record["metrics"]["mtp_agreement"], 0.55)
    self.assertIn("python tools/train_demo.py --steps=", card)
    self.assertIn("--window_policy=adaptive:1:2:3", card)
    self.assertEqual(sorted(record["decode"]), ["1", "2", "3"])
    self.assertEqual(sorted(record["llama_cpp_draft_mtp"]), ["1", "2", "3"])
    self.assertLen(record["decode"]["3"]["accept_rate_by_depth"], 3)

  def _decode(self, window: DraftWindow) -> MtpStats:
    requests = [Request(prompt=np.asarray(p, np.int32), max_new_tokens=NEW_TOKENS)
                for p in self.prompts]
    results = SlotScheduler(self.drafting, adaptive=None, window=window).run(requests)
    self.assertEqual([r.tokens for r in results], self.off)
    total = MtpStats.total([r.stats for r in results])
    np.testing.assert_allclose(total.tokens_per_target_pass,
                               total.committed_tokens / total.target_passes)
    return total

  def test_one_draft_a_step_accepts_at_depth_one(self):
    total = self._decode(DraftWindow.fixed(1))
    self.assertGreaterEqual(total.accept_rate_by_position[0], 0.7, total.as_dict())

  def test_three_drafts_a_step_commit_more_than_two_tokens_a_pass(self):
    total = self._decode(DraftWindow.fixed(3))
    self.assertGreaterEqual(total.tokens_per_target_pass, 2.2, total.as_dict())
    depth = total.accept_rate_by_position
    self.assertGreater(depth[1], 0.4, total.as_dict())   # the chain's second draft is useful


if __name__ == "__main__":
  absltest.main()
