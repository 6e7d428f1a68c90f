"""tools/train_demo.py end to end on a small budget: train, export, split, reload, evaluate.

The reference for the export is the trainer's own held-out cross-entropy: the package reloaded
through `mtpjax.load` must score the held-out text about as well, which fails if any tensor is
exported under the wrong name or layout.
"""

import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
from absl.testing import absltest

import mtpjax
from mtpjax.draft_window import DraftWindow
from mtpjax.gguf.tokenizer import GgufTokenizer
from mtpjax.package.preflight import preflight
from mtpjax.telemetry import MtpStats
from mtpjax.testing.corpus import held_out_prompts, split_corpus

REPO = pathlib.Path(__file__).resolve().parents[1]
CORPUS_FILES, BATCH, SEQ_LEN, EVAL_BATCHES = 60, 8, 64, 2
CARD_NEW_TOKENS = 8
FLAGS = ["--steps=120", f"--batch={BATCH}", f"--seq_len={SEQ_LEN}", "--vocab=512", "--hidden=64",
         "--layers=2", "--experts=4", "--expert_ffn=32", f"--corpus_files={CORPUS_FILES}",
         f"--eval_batches={EVAL_BATCHES}", "--tensor_type=F32", "--lr=0.01",
         "--mtp_depth_weights=1,0.5", "--window_policy=adaptive:1:2:2", "--card_windows=1,2",
         f"--card_new_tokens={CARD_NEW_TOKENS}"]


class TrainDemoTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    cls.package = pathlib.Path(cls.tmp.name) / "demo"
    # `-m` from the checkout: the trainer imports mtpjax whether or not it is installed.
    command = [sys.executable, "-m", "tools.train_demo", f"--out={cls.package}", *FLAGS]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
      raise AssertionError(f"train_demo failed:\n{run.stderr[-3000:]}")
    cls.card = json.loads(run.stdout.strip().splitlines()[-1])

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def test_package_is_valid_and_advertises_native_mtp(self):
    report = preflight(self.package, check_sha=True)
    self.assertTrue(report["valid"], report["issues"])
    strategy = report["generation"]["speculative_decoding"]["strategies"][0]
    # More than one draft token: declared as the later eras' `mtp`, with the given window.
    self.assertEqual((strategy["name"], strategy["layer_indices"]), ("mtp", [2]))
    self.assertEqual(strategy["window_policy"], {"default": "adaptive", "initial_window": 2,
                                                 "min_window": 1, "max_window": 2})
    card = (self.package / "MODEL_CARD.md").read_text()
    self.assertIn(f"{self.card['metrics']['mtp_agreement']:.3f}", card)
    self.assertIn("--mtp_depth_weights=1,0.5", card)
    metrics = self.card["metrics"]
    self.assertLen(metrics["ce_mtp_by_depth"], 2)            # the recursive depth trained too
    self.assertEqual(metrics["ce_mtp_by_depth"][0], metrics["ce_mtp"])

  def test_card_decode_figures_match_generate(self):
    """The card's window-1 figures (8 prompts batched by the scheduler) against `generate`
    decoding each prompt alone, drafting every step."""
    decode = self.card["decode"]
    self.assertEqual(sorted(decode), ["1", "2"])
    self.assertLen(decode["2"]["accept_rate_by_depth"], 2)
    self.assertGreaterEqual(decode["2"]["accept_rate_by_depth"][0],
                            decode["2"]["accept_rate_by_depth"][1])   # depth 2 needs depth 1
    model = mtpjax.load(str(self.package))
    self.assertEqual(model.resolution.draft_window.as_dict(), {
        "policy": "adaptive", "min_window": 1, "initial_window": 2, "max_window": 2})
    # The trainer's card prompts (CARD_PROMPTS, CARD_PROMPT_LEN; importing the tool here would
    # define its absl flags in this process).
    prompts = held_out_prompts(GgufTokenizer.from_metadata(model.metadata).encode, 8, 64,
                               seed=0)
    alone = MtpStats.total(
        model.generate(p, max_new_tokens=CARD_NEW_TOKENS, adaptive_drafting=False,
                       draft_window=DraftWindow.fixed(1)).stats for p in prompts)
    self.assertGreater(alone.verifications, 0)
    self.assertAlmostEqual(decode["1"]["accept_rate"], alone.accept_rate)
    self.assertAlmostEqual(decode["1"]["tokens_per_target_pass"], alone.tokens_per_target_pass)
    card = (self.package / "MODEL_CARD.md").read_text()
    self.assertIn(f"| 2 | {decode['2']['accept_rate_by_depth'][0]:.3f}, ", card)
    self.assertIn("not run |", card)        # no --llama_speculative given

  def test_reloaded_package_scores_the_held_out_windows_as_the_trainer_did(self):
    """The trainer's evaluation windows (its seed, batch and length), re-scored on the package."""
    model = mtpjax.load(str(self.package))
    self.assertTrue(model.resolution.native_mtp)    # auto + the package's recommendation
    tokenizer = GgufTokenizer.from_metadata(model.metadata)
    eos = tokenizer.special_ids["eos"]
    ids = np.concatenate([tokenizer.encode(t) + [eos] for t in split_corpus(CORPUS_FILES)[1]])
    rng = np.random.default_rng(12345)
    trunk, mtp, agree = [], [], []
    for _ in range(EVAL_BATCHES):
      for start in rng.integers(0, len(ids) - SEQ_LEN - 1, size=BATCH):
        window = ids[start:start + SEQ_LEN]
        logits, mtp_logits = model.logits(window)[:-1], model.mtp_logits(window)[:-1]
        trunk.append(cross_entropy(logits, window[1:]))
        mtp.append(cross_entropy(mtp_logits, window[1:]))
        agree.append(np.mean(logits.argmax(-1) == mtp_logits.argmax(-1)))
    metrics = self.card["metrics"]
    self.assertLess(metrics["ce_trunk"], np.log(512) - 1.5)     # it learned something
    np.testing.assert_allclose(np.mean(trunk), metrics["ce_trunk"], atol=2e-3)
    np.testing.assert_allclose(np.mean(mtp), metrics["ce_mtp"], atol=2e-3)
    np.testing.assert_allclose(np.mean(agree), metrics["mtp_agreement"], atol=1e-2)


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  return float(-log_probs[np.arange(len(targets)), targets].mean())


if __name__ == "__main__":
  absltest.main()
