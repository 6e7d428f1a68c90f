"""Tests for mtpjax.engine.sampling: greedy, top-k, top-p, position-keyed draws, validation.

Distributions are checked against a plain-numpy (float64) statement of the rule, by drawing
many samples at distinct positions and comparing frequencies within a few standard errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from mtpjax import errors
from mtpjax.engine.sampling import SamplerParams, greedy_tokens, request_key, sample

_sample = jax.jit(sample)


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
         seed: int = 0, first_position: int = 0) -> np.ndarray:
  """n samples of one request, one per position first_position .. first_position + n - 1."""
  logits = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
  keys = jnp.broadcast_to(jnp.asarray(request_key(seed)), (n, 2))
  positions = jnp.arange(first_position, first_position + n, dtype=jnp.int32)
  full = lambda value, dtype: jnp.full((n,), value, dtype)
  return np.asarray(_sample(logits, keys, positions, full(temperature, jnp.float32),
                            full(top_k, jnp.int32), full(top_p, jnp.float32)))


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

  def assert_matches(self, samples: np.ndarray, probs: np.ndarray):
    freq = np.bincount(samples, minlength=probs.size) / samples.size
    self.assertTrue(np.all(freq[probs == 0] == 0), f"sampled outside the support: {freq}")
    sigma = np.sqrt(probs * (1 - probs) / samples.size)
    np.testing.assert_array_less(np.abs(freq - probs), 5 * sigma + 1e-3,
                                 err_msg=f"freq {freq} vs probs {probs}")

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
    self.assert_matches(samples, probs)

  def test_nucleus_is_the_smallest_set(self):
    """Six tokens; the nucleus boundary moves one token at a time as top_p grows."""
    logits = np.array([2.0, -1.0, 1.0, 0.5, 0.0, -3.0])
    for top_p, support in ((0.5, 1), (0.7, 2), (0.85, 3), (0.95, 4), (0.99, 5)):
      probs = reference_probs(logits, 1.0, 0, top_p)
      self.assertEqual(int((probs > 0).sum()), support)
      samples = draw(logits, n=self.N, temperature=1.0, top_p=top_p, seed=11)
      self.assert_matches(samples, probs)


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
