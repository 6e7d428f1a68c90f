"""Logprobs are the target's own: equal with MTP on and off, and equal to a full forward's.

The reference is `log_softmax(model.logits(prompt + generated))` from one causal forward over
the whole sequence (no cache, no engine), in numpy; the engine's values come from its decode
steps, which with MTP on verify [current, draft] and commit one or two rows per step.
"""

import numpy as np
from absl.testing import absltest, parameterized

import mtpjax
from mtpjax import embedded
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.engine.sampling import MAX_TOP_LOGPROBS, SamplerParams


def log_softmax(logits: np.ndarray) -> np.ndarray:
  logits = logits.astype(np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


class LogprobsTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # Float32 rows: a decode step's attention and a full forward's sum in different orders, and
    # under int8 rows (the default on a CPU) a last-bit difference can round a value of x to
    # the next int8 and move a logprob by ~4e-3, so the full-forward reference holds to 2e-5
    # only for float rows. MTP on == off with int8 rows: quantized_model_test.
    cls.model = mtpjax.load(str(embedded.DEMO_PACKAGE), int8_activations=False)
    cls.prompt = np.array([40, 262, 1006, 13, 291, 4, 1700, 10, 88, 31, 400, 17], np.int32)

  def generate(self, speculative: str, temperature: float):
    return self.model.generate(self.prompt, max_new_tokens=24, temperature=temperature, seed=7,
                               speculative=speculative, adaptive_drafting=False, logprobs=True)

  @parameterized.named_parameters(("greedy", 0.0), ("sampled", 0.9))
  def test_equal_with_mtp_on_and_off_and_to_a_full_forward(self, temperature):
    off = self.generate("disabled", temperature)
    on = self.generate("native-mtp-n1", temperature)
    self.assertEqual(on.tokens, off.tokens)
    self.assertGreater(on.stats.accepted, 0)      # some steps committed two rows
    reference = log_softmax(self.model.logits(np.concatenate([self.prompt, off.tokens])))
    rows = reference[len(self.prompt) - 1:][:len(off.tokens)]   # row p predicts token p + 1
    for result in (off, on):
      self.assertLen(result.logprobs, len(result.tokens))
      self.assertEqual([e.token for e in result.logprobs], result.tokens)
      chosen = np.array([e.logprob for e in result.logprobs])
      np.testing.assert_allclose(chosen, rows[np.arange(len(rows)), result.tokens], atol=2e-5)
      for entry, row in zip(result.logprobs, rows):
        ids, values = zip(*entry.top)
        self.assertLen(ids, MAX_TOP_LOGPROBS)
        np.testing.assert_allclose(values, np.sort(row)[::-1][:MAX_TOP_LOGPROBS], atol=2e-5)
        np.testing.assert_allclose(row[list(ids)], values, atol=2e-5)
    np.testing.assert_allclose([e.logprob for e in on.logprobs],
                               [e.logprob for e in off.logprobs], atol=2e-5)

  def test_a_pipeline_gives_the_single_device_logprobs(self):
    """The last stage computes them and every process reads the same (one engine for both)."""
    piped = mtpjax.load(str(embedded.DEMO_PACKAGE), stages=2, int8_activations=False)
    kwargs = dict(max_new_tokens=12, seed=7, speculative="native-mtp-n1",
                  adaptive_drafting=False, logprobs=True)
    want, got = self.model.generate(self.prompt, **kwargs), piped.generate(self.prompt, **kwargs)
    self.assertEqual(got.tokens, want.tokens)
    np.testing.assert_allclose([e.logprob for e in got.logprobs],
                               [e.logprob for e in want.logprobs], atol=2e-5)
    np.testing.assert_allclose([[v for _, v in e.top] for e in got.logprobs],
                               [[v for _, v in e.top] for e in want.logprobs], atol=2e-5)

  def test_batched_with_a_request_without_logprobs(self):
    """Steps compute logprobs only while a live request asks; a batch mate changes nothing."""
    engine = self.model.engine(native_mtp=True, slots=2, max_len=128,
                               logprobs=MAX_TOP_LOGPROBS)
    sampler = SamplerParams(temperature=0.9, seed=7)
    asking = Request(prompt=self.prompt, max_new_tokens=24, sampler=sampler, logprobs=True)
    other = Request(prompt=self.prompt[:5], max_new_tokens=40)
    with_logprobs, without = SlotScheduler(engine, adaptive=None).run([asking, other])
    solo = self.generate("disabled", 0.9)
    self.assertEqual(with_logprobs.tokens, solo.tokens)
    np.testing.assert_allclose([e.logprob for e in with_logprobs.logprobs],
                               [e.logprob for e in solo.logprobs], atol=2e-5)
    self.assertIsNone(without.logprobs)

  def test_an_engine_returns_logprobs_only_when_asked(self):
    """A logprobs-capable engine hands back (and copies to the host) no logprobs from a prefill
    or step nobody asked them of; asked, it does, row for row."""
    engine = self.model.engine(native_mtp=False, slots=2, max_len=128,
                               logprobs=MAX_TOP_LOGPROBS)
    state = engine.init_state()
    for asked in (False, True):
      state = engine.free(state, 0)
      prefix = engine.prefill(self.prompt, SamplerParams(), state=state, logprobs=asked)
      state = engine.insert(prefix, state, 0)
      state, _, info = engine.step(state, np.array([True, False]), logprobs=asked)
      self.assertEqual(prefix.logprobs is not None, asked)
      self.assertEqual("logprobs" in info, asked)
    chosen, top_ids, top_lps = info["logprobs"]
    self.assertEqual((chosen.shape, top_ids.shape), ((2, 1), (2, 1, MAX_TOP_LOGPROBS)))

  def test_without_logprobs_the_result_has_none(self):
    result = self.model.generate(self.prompt, max_new_tokens=4)
    self.assertIsNone(result.logprobs)


if __name__ == "__main__":
  absltest.main()
