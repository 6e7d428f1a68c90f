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
from mtpjax.gguf.tokenizer import GgufTokenizer
from mtpjax.package.preflight import preflight
from mtpjax.testing.corpus import split_corpus

REPO = pathlib.Path(__file__).resolve().parents[1]
CORPUS_FILES, BATCH, SEQ_LEN, EVAL_BATCHES = 60, 8, 64, 2
FLAGS = ["--steps=200", f"--batch={BATCH}", f"--seq_len={SEQ_LEN}", "--vocab=512", "--hidden=64",
         "--layers=2", "--experts=4", "--expert_ffn=32", f"--corpus_files={CORPUS_FILES}",
         f"--eval_batches={EVAL_BATCHES}", "--tensor_type=F32", "--lr=0.01",
         "--mtp_depth_weights=1,0.5"]


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
    self.assertEqual((strategy["name"], strategy["layer_indices"]), ("native-mtp-n1", [2]))
    card = (self.package / "MODEL_CARD.md").read_text()
    self.assertIn(f"{self.card['metrics']['mtp_agreement']:.3f}", card)
    self.assertIn("--mtp_depth_weights=1,0.5", card)
    metrics = self.card["metrics"]
    self.assertLen(metrics["ce_mtp_by_depth"], 2)            # the recursive depth trained too
    self.assertEqual(metrics["ce_mtp_by_depth"][0], metrics["ce_mtp"])

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
