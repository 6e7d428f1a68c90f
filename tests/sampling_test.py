"""Tests for mtpjax.engine.sampling: greedy, top-k, top-p, position-keyed draws, validation.

Distributions are checked against a plain-numpy (float64) statement of the rule, by drawing
many samples at distinct positions and comparing frequencies within a few standard errors.
"""

import functools
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from mtpjax import errors
from mtpjax.engine import sampling
from mtpjax.engine.sampling import SamplerParams, greedy_tokens, request_key, sample

_sample = jax.jit(sample)
_narrow = jax.jit(functools.partial(sample, candidates=4))   # most rows search the whole row


def reference_probs(logits, temperature: float, top_k: int, top_p: float) -> np.ndarray:
  """Numpy statement of the rule: scale, keep the top-k, then the smallest nucleus >= top_p."""
  scaled = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-scaled, kind="stable")
  keep = np.zeros(scaled.size, bool)
  k = top_k if 0 < top_k <= scaled.size else scaled.size
  keep[order[:k]] = True
  probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
  probs /= probs.sum()
  mass = 0.0
  nucleus = np.zeros(scaled.size, bool)
  for token in order:
    if not keep[token] or mass >= top_p:
      break
    nucleus[token] = True
    mass += probs[token]
  probs = np.where(nucleus, probs, 0.0)
  return probs / probs.sum()


def draw(logits, *, n: int, temperature: float, top_k: int = 0, top_p: float = 1.0,
         seed: int = 0, first_position: int = 0, fn=_sample) -> np.ndarray:
  """n samples of one request, one per position first_position .. first_position + n - 1."""
  logits = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
  keys = jnp.broadcast_to(jnp.asarray(request_key(seed)), (n, 2))
  positions = jnp.arange(first_position, first_position + n, dtype=jnp.int32)
  full = lambda value, dtype: jnp.full((n,), value, dtype)
  return np.asarray(fn(logits, keys, positions, full(temperature, jnp.float32),
                       full(top_k, jnp.int32), full(top_p, jnp.float32)))


def assert_frequencies(samples: np.ndarray, probs: np.ndarray):
  """No sample outside the support; each token's frequency within 5 standard errors."""
  freq = np.bincount(samples, minlength=probs.size) / samples.size
  np.testing.assert_array_equal(freq[probs == 0], 0, err_msg="sampled outside the support")
  sigma = np.sqrt(probs * (1 - probs) / samples.size)
  np.testing.assert_array_less(np.abs(freq - probs), 5 * sigma + 1e-3,
                               err_msg=f"freq {freq} vs probs {probs}")


class ReferenceRuleTest(absltest.TestCase):
  """The numpy reference itself, on hand-computed cases."""

  def test_hand_computed_nucleus(self):
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    np.testing.assert_allclose(reference_probs(logits, 1.0, 0, 0.69), [4 / 7, 3 / 7, 0, 0])
    np.testing.assert_allclose(reference_probs(logits, 1.0, 0, 0.71), [4 / 9, 3 / 9, 2 / 9, 0])
    np.testing.assert_allclose(reference_probs(logits, 1.0, 0, 1.0), [0.4, 0.3, 0.2, 0.1])
    np.testing.assert_allclose(reference_probs(logits, 1.0, 1, 1.0), [1, 0, 0, 0])


class GreedyTest(parameterized.TestCase):

  def test_temperature_zero_is_argmax_whatever_the_filters(self):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 50)).astype(np.float32) * 3
    n = logits.shape[0]
    keys = jnp.asarray(np.stack([request_key(s) for s in range(n)]))
    got = _sample(jnp.asarray(logits), keys, jnp.arange(n, dtype=jnp.int32),
                  jnp.zeros((n,), jnp.float32), jnp.asarray(rng.integers(0, 5, n), jnp.int32),
                  jnp.asarray(rng.uniform(0.05, 1.0, n), jnp.float32))
    np.testing.assert_array_equal(np.asarray(got), logits.argmax(-1))

  @parameterized.parameters(0.3, 1.0, 7.0, 100.0)
  def test_top_k_one_equals_greedy_at_any_temperature(self, temperature):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((32, 20)).astype(np.float32)
    n = logits.shape[0]
    keys = jnp.asarray(np.stack([request_key(1000 + s) for s in range(n)]))
    got = _sample(jnp.asarray(logits), keys, jnp.arange(n, dtype=jnp.int32) * 7,
                  jnp.full((n,), temperature, jnp.float32), jnp.ones((n,), jnp.int32),
                  jnp.ones((n,), jnp.float32))
    np.testing.assert_array_equal(np.asarray(got), logits.argmax(-1))

  @parameterized.parameters(1e-38, 1.1e-38, 1e-45, 1e-7)
  def test_a_top_p_near_zero_keeps_the_top_token(self, top_p):
    # A subnormal top_p is flushed to 0 on XLA:CPU; the nucleus still holds the top token
    # (the old rule kept nothing and drew token 0 forever). `_narrow` searches whole rows.
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((16, 300)).astype(np.float32) * 2
    n = logits.shape[0]
    keys = jnp.asarray(np.stack([request_key(70 + s) for s in range(n)]))
    for fn in (_sample, _narrow):
      got = fn(jnp.asarray(logits), keys, jnp.arange(n, dtype=jnp.int32),
               jnp.ones((n,), jnp.float32), jnp.zeros((n,), jnp.int32),
               jnp.full((n,), top_p, jnp.float32))
      np.testing.assert_array_equal(np.asarray(got), logits.argmax(-1))

  def test_greedy_and_sampled_rows_share_one_call(self):
    logits = np.array([[0.0, 3.0, 1.0, 2.0]] * 2, np.float32)
    keys = jnp.asarray(np.stack([request_key(5)] * 2))
    got = []
    for position in range(200):
      got.append(np.asarray(_sample(
          jnp.asarray(logits), keys, jnp.full((2,), position, jnp.int32),
          jnp.asarray([0.0, 1.0], jnp.float32), jnp.zeros((2,), jnp.int32),
          jnp.ones((2,), jnp.float32))))
    got = np.stack(got)
    self.assertTrue((got[:, 0] == 1).all())         # the greedy row never moves
    self.assertGreater(len(set(got[:, 1])), 2)     # the sampled row does


class GreedyTokensTest(absltest.TestCase):

  def test_first_maximal_index_like_numpy_argmax(self):
    rng = np.random.default_rng(3)
    logits = rng.integers(-3, 4, size=(64, 37)).astype(np.float32)   # many ties
    logits[5] = -np.inf
    logits[6, 11] = np.inf
    got = np.asarray(jax.jit(greedy_tokens)(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    self.assertEqual(got.dtype, np.int32)
    self.assertEqual((got[5], got[6]), (0, 11))

  def test_a_nan_row_gives_token_zero(self):
    row = np.array([[1.0, np.nan, 3.0]], np.float32)
    self.assertEqual(int(greedy_tokens(jnp.asarray(row))[0]), 0)


class DistributionTest(parameterized.TestCase):
  """Frequencies of many position-keyed draws equal the reference probabilities."""

  N = 40_000

  @parameterized.named_parameters(
      ("softmax", 1.0, 0, 1.0),
      ("cold", 0.5, 0, 1.0),
      ("hot", 2.0, 0, 1.0),
      ("top_k", 1.0, 2, 1.0),
      ("top_p_two", 1.0, 0, 0.69),
      ("top_p_three", 1.0, 0, 0.71),
      ("top_p_after_temperature", 0.8, 0, 0.9),
      ("top_k_then_top_p", 1.3, 3, 0.8),
  )
  def test_frequencies(self, temperature, top_k, top_p):
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    probs = reference_probs(logits, temperature, top_k, top_p)
    samples = draw(logits, n=self.N, temperature=temperature, top_k=top_k, top_p=top_p, seed=3)
    assert_frequencies(samples, probs)

  def test_nucleus_is_the_smallest_set(self):
    """Six tokens; the nucleus boundary moves one token at a time as top_p grows."""
    logits = np.array([2.0, -1.0, 1.0, 0.5, 0.0, -3.0])
    for top_p, support in ((0.5, 1), (0.7, 2), (0.85, 3), (0.95, 4), (0.99, 5)):
      probs = reference_probs(logits, 1.0, 0, top_p)
      self.assertEqual(int((probs > 0).sum()), support)
      samples = draw(logits, n=self.N, temperature=1.0, top_p=top_p, seed=11)
      assert_frequencies(samples, probs)


class WholeRowSearchTest(parameterized.TestCase):
  """Rows whose top-k set or nucleus reaches past the largest `candidates` values search the
  whole row; they must keep the same tokens as the candidates-only rule would."""

  LOGITS = np.random.default_rng(21).standard_normal(64).astype(np.float32)

  @parameterized.named_parameters(
      ("top_k_past_the_candidates", 1.0, 20, 1.0),
      ("wide_nucleus", 1.0, 0, 0.9),
      ("top_k_and_wide_nucleus", 0.7, 30, 0.95),
      ("narrow_nucleus", 0.5, 0, 0.3),
      ("top_k_within", 1.0, 3, 0.8),
      ("temperature_only", 1.3, 0, 1.0),
  )
  def test_frequencies_and_tokens_match_the_sorted_rule(self, temperature, top_k, top_p):
    kwargs = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=17)
    narrow = draw(self.LOGITS, n=20_000, fn=_narrow, **kwargs)
    assert_frequencies(narrow, reference_probs(self.LOGITS, temperature, top_k, top_p))
    # The default candidates (256) hold all 64 values: every rule is decided among them.
    np.testing.assert_array_equal(narrow, draw(self.LOGITS, n=20_000, **kwargs))

  def test_a_token_does_not_depend_on_the_rows_beside_it(self):
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((4, 64)).astype(np.float32) * np.array([[4.0], [0.3], [4.0],
                                                                          [0.3]], np.float32)
    keys = jnp.asarray(np.stack([request_key(s) for s in range(4)]))
    temperature = jnp.asarray([1.0, 1.0, 0.0, 0.8], jnp.float32)
    top_k = jnp.asarray([2, 40, 0, 0], jnp.int32)     # row 1: a top-k past the candidates
    top_p = jnp.asarray([1.0, 1.0, 1.0, 0.97], jnp.float32)   # row 3: a wide nucleus
    for position in range(0, 400, 7):
      positions = jnp.full((4,), position, jnp.int32)
      together = np.asarray(_narrow(jnp.asarray(logits), keys, positions, temperature, top_k,
                                    top_p))
      for r in range(4):
        alone = _narrow(jnp.asarray(logits[r:r + 1]), keys[r:r + 1], positions[r:r + 1],
                        temperature[r:r + 1], top_k[r:r + 1], top_p[r:r + 1])
        self.assertEqual(int(alone[0]), together[r], (position, r))

  def test_largest_reaching_against_numpy(self):
    row = np.array([3.5, -0.0, 0.0, -2.0, np.inf, -np.inf, 3.5, 1e-30, -1e-30, 7.25],
                   np.float32)
    order = np.sort(row)[::-1]
    fn = jax.jit(sampling._largest_reaching)
    for k in range(1, row.size + 1):   # unit weights: the k-th largest value
      got = float(fn(jnp.asarray(row[None]), jnp.ones((1, row.size), jnp.int32),
                     jnp.asarray([k], jnp.int32))[0])
      self.assertEqual(got, order[k - 1], k)
    weights = np.array([0.1, 0.05, 0.05, 0.2, 0.15, 0.0, 0.1, 0.1, 0.05, 0.2], np.float32)
    # Descending, the running masses are inf 0.15, 7.25 0.35, 3.5 0.55, 1e-30 0.65, 0.0 0.7,
    # -0.0 0.75 (below +0.0 in this order), -1e-30 0.8, -2.0 1.0: the value where it reaches
    # `need`.
    for need, want in ((0.1, np.inf), (0.3, 7.25), (0.5, 3.5), (0.6, 1e-30), (0.68, 0.0),
                       (0.72, -0.0), (0.78, -1e-30), (0.9, -2.0)):
      got = np.float32(fn(jnp.asarray(row[None]), jnp.asarray(weights[None]),
                          jnp.asarray([need], jnp.float32))[0])
      self.assertEqual((got, np.signbit(got)), (np.float32(want), np.signbit(want)), need)

  def test_logits_that_move_in_the_last_bits_keep_their_tokens(self):
    """A verify row's logits may differ from a decode row's by a rounding (bfloat16 models):
    MTP on equals MTP off only if such a change rarely moves a draw. One Gumbel per token
    moves it with a probability of about the change; an inverse CDF over the vocabulary
    would sum the changes of every token before it."""
    logits = np.random.default_rng(8).standard_normal(2500).astype(np.float32) * 2
    rounded = np.asarray(jnp.asarray(logits).astype(jnp.bfloat16).astype(jnp.float32))
    self.assertGreater(np.abs(rounded - logits).max(), 1e-3)
    a, b = (draw(row, n=4000, temperature=1.0, seed=6) for row in (logits, rounded))
    self.assertLess(np.mean(a != b), 0.03)

  def test_a_vocabulary_of_several_draw_blocks(self):
    """2,500 tokens: three blocks of the draw, the last one partial, mass in each."""
    logits = np.full(2500, -4.0, np.float32)
    logits[[3, 1500, 2499, 1023, 1024]] = [2.0, 2.5, 1.5, 1.0, 0.5]
    probs = reference_probs(logits, 1.0, 0, 1.0)
    samples = np.concatenate([draw(logits, n=4000, temperature=1.0, seed=2,
                                   first_position=4000 * i) for i in range(5)])
    assert_frequencies(samples, probs)


class KeyingTest(absltest.TestCase):

  def test_same_seed_and_position_give_the_same_sample(self):
    logits = np.zeros(64, np.float32)
    a = draw(logits, n=256, temperature=1.0, seed=9)
    b = draw(logits, n=256, temperature=1.0, seed=9)
    np.testing.assert_array_equal(a, b)
    # Position 100 drawn inside another batch (different row, different neighbours).
    c = draw(logits, n=16, temperature=1.0, seed=9, first_position=90)
    np.testing.assert_array_equal(c, a[90:106])

  def test_the_sample_does_not_depend_on_the_row(self):
    logits = jnp.zeros((3, 64), jnp.float32)
    keys = jnp.asarray(np.stack([request_key(1), request_key(2), request_key(1)]))
    got = np.asarray(_sample(logits, keys, jnp.asarray([5, 5, 5], jnp.int32),
                             jnp.ones((3,), jnp.float32), jnp.zeros((3,), jnp.int32),
                             jnp.ones((3,), jnp.float32)))
    self.assertEqual(got[0], got[2])

  def test_positions_and_seeds_give_independent_draws(self):
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    a = draw(logits, n=20_000, temperature=1.0, seed=4)
    b = draw(logits, n=20_000, temperature=1.0, seed=5)
    p_same = float(np.sum(np.exp(logits) ** 2))   # P(two independent draws agree) = 0.3
    sigma = np.sqrt(p_same * (1 - p_same) / a.size)
    self.assertLess(abs(np.mean(a[1:] == a[:-1]) - p_same), 5 * sigma)  # adjacent positions
    self.assertLess(abs(np.mean(a == b) - p_same), 5 * sigma)           # two seeds
    self.assertLess(abs(np.mean(a == a[::-1]) - p_same), 5 * sigma)


class BenchSamplingTest(absltest.TestCase):

  def test_prints_every_sampler_and_profile_in_one_json_line(self):
    run = subprocess.run(
        [sys.executable, "-m", "tools.bench_sampling", "--vocab=3000", "--rows=2",
         "--samplers=1.0:0:0.9,0.7:300:1.0", "--repeats=1"],
        cwd=pathlib.Path(__file__).resolve().parents[1], capture_output=True, text=True,
        timeout=600)
    self.assertEqual(run.returncode, 0, run.stderr[-3000:])
    line = json.loads(run.stdout.strip().splitlines()[-1])
    self.assertEqual(set(line["ms"]), {"peaked_rows2", "flat_rows2"})
    for timings in line["ms"].values():
      self.assertEqual(set(timings), {"greedy_ms", "sampled_1.0:0:0.9_ms",
                                      "sampled_0.7:300:1.0_ms", "sort_of_the_rows_ms"})
      self.assertTrue(all(ms > 0 for ms in timings.values()), timings)


class ValidateTest(parameterized.TestCase):

  @parameterized.parameters(
      dict(), dict(temperature=0.8, top_k=40, top_p=0.9, seed=7), dict(top_p=1.0),
      dict(temperature=1e-3, top_p=1e-3))
  def test_accepts(self, **kwargs):
    params = SamplerParams(**kwargs)
    self.assertIs(params.validate(), params)

  @parameterized.parameters(
      ("temperature", dict(temperature=-0.1)), ("temperature", dict(temperature=float("nan"))),
      ("temperature", dict(temperature=float("inf"))), ("top_k", dict(top_k=-1)),
      ("top_p", dict(top_p=0.0)), ("top_p", dict(top_p=-0.5)), ("top_p", dict(top_p=1.01)),
      ("top_p", dict(top_p=float("nan"))))
  def test_rejects_with_a_typed_error(self, field, kwargs):
    with self.assertRaises(errors.MtpjaxError) as ctx:
      SamplerParams(**kwargs).validate()
    self.assertEqual(ctx.exception.field, field)
    self.assertIn("remedy", str(ctx.exception))


if __name__ == "__main__":
  absltest.main()
