"""Checks every reference fixture gets: transformers' logits, hidden and MTP logits, and its
greedy continuation with MTP off and on. A test class mixes this in and sets `model`, `ref`."""

import numpy as np


class ReferenceFixtureChecks:

  def test_logits_hidden_and_mtp_match_hf(self):
    ids = self.ref["token_ids"]
    np.testing.assert_allclose(self.model.logits(ids), self.ref["logits"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(self.model.hidden(ids), self.ref["mtp_h_nextn"], atol=1e-4,
                               rtol=0)
    np.testing.assert_allclose(self.model.mtp_logits(ids), self.ref["mtp_logits_llamacpp"],
                               atol=1e-4, rtol=0)

  def test_greedy_generation_with_and_without_mtp(self):
    want = list(self.ref["greedy_ids"])
    for strategy in ("disabled", "native-mtp-n1"):
      result = self.model.generate(self.ref["prompt_ids"], max_new_tokens=len(want),
                                   speculative=strategy)
      self.assertEqual(result.tokens, want, strategy)
