"""Grouped MoE (`models/grouped_experts.py`) equals every expert on every row, then selecting.

Reference: a plain numpy SwiGLU per (row, selected expert) on the same weights (dense, and
gguf-py's dequantization of quantized experts), plus the module's own all-experts path.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from gguf import quants
from gguf.constants import GGMLQuantizationType
from flax import nnx

from mtpjax.kernels import backend
from mtpjax.models import grouped_experts
from mtpjax.models.quantized import QuantizedTensor

E, D, F = 8, 64, 32


def _numpy_reference(x, ids, gate, up, down):
  out = np.zeros(ids.shape + (x.shape[1],), np.float64)
  for n in range(ids.shape[0]):
    for k, e in enumerate(ids[n]):
      g, u = gate[e] @ x[n], up[e] @ x[n]
      out[n, k] = down[e] @ (g / (1 + np.exp(-g)) * u)
  return out


def _rounded(v, block=32):
  """Rows rounded per 32-value block to int8 times amax / 127 kept in float16, as llama.cpp's
  Q8_0 vectors (the kernel's int8 rows against Q8_0)."""
  v = np.asarray(v, np.float32)
  amax = np.abs(v).reshape(v.shape[0], -1, block).max(-1, keepdims=True)
  q = np.rint(v.reshape(v.shape[0], -1, block) * (np.float32(127) / amax))
  scale = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
  return (q * scale).reshape(v.shape).astype(np.float64)


def _int8_reference(x, ids, gate, up, down):
  """The SwiGLU of `_numpy_reference` with every projection's input rounded to int8 rows, and
  which rows [N] are ties, which float32 arithmetic other than this float64 may round the other
  way: a SwiGLU value within 1e-4 of a rounding boundary (x.5 steps), or a block's scale
  amax / 127 within 1e-5 (relative) of a float16 rounding boundary."""
  out = np.zeros(ids.shape + (x.shape[1],), np.float64)
  ties = np.zeros(ids.shape[0], bool)
  xr = _rounded(x)
  for n in range(ids.shape[0]):
    for k, e in enumerate(ids[n]):
      g, u = gate[e] @ xr[n], up[e] @ xr[n]
      act = (g / (1 + np.exp(-g)) * u).astype(np.float32)
      out[n, k] = down[e] @ _rounded(act[None])[0]
      amax = np.abs(act.reshape(-1, 32)).max(-1)
      steps = act.reshape(-1, 32) * (127 / amax[:, None])
      ties[n] |= bool(np.any(np.abs(np.abs(steps - np.floor(steps)) - 0.5) < 1e-4))
      scale = lambda f: (amax / 127 * f).astype(np.float16)
      ties[n] |= bool(np.any(scale(1 - 1e-5) != scale(1 + 1e-5)))
  return out, ties


def _quantized(rng, shape):
  """A Q8_0 expert stack from real quantization of random values, and its dequantization."""
  values = rng.standard_normal(shape).astype(np.float32) * 0.2
  raw = quants.quantize(values, GGMLQuantizationType.Q8_0)
  tensor = QuantizedTensor.from_raw("Q8_0", raw, shape)
  return tensor, quants.dequantize(raw, GGMLQuantizationType.Q8_0).reshape(shape)


class GroupedExpertsTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    rng = np.random.default_rng(0)
    cls.quantized, cls.dense = zip(*(_quantized(rng, s) for s in ((E, F, D), (E, F, D),
                                                                   (E, D, F))))
    cls.rng = rng

  def _rows(self, n, k, rng=None):
    rng = rng or self.rng
    x = rng.standard_normal((n, D)).astype(np.float32)
    # rows choose distinct experts, skewed so some experts get many rows and some none
    ids = np.stack([rng.choice(E, k, replace=False, p=np.r_[[0.4, 0.2], [0.4 / 6] * 6])
                    for _ in range(n)]).astype(np.int32)
    return x, ids

  @parameterized.product(rows=(3, 40), quantized=(False, True))
  def test_routed_equals_the_numpy_reference(self, rows, quantized):
    x, ids = self._rows(rows, 3)
    weights = (self.quantized if quantized else
               tuple(nnx.Param(jnp.asarray(w)) for w in self.dense))
    got = jax.jit(grouped_experts.routed)(jnp.asarray(x), jnp.asarray(ids), *weights)
    want = _numpy_reference(x, ids, *self.dense)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=1e-4)
    ref = jax.jit(grouped_experts.every_expert)(jnp.asarray(x), jnp.asarray(ids), *weights)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-4, rtol=1e-4)

  def test_int8_rows_of_a_prefill_take_the_kernel_and_equal_each_row_alone(self):
    # With int8 rows the native kernel takes any number of rows (40 here, past PAIR_ROWS):
    # the int8 numpy reference, and each row bit for bit as a decode step of one row gets it.
    x, ids = self._rows(40, 3)
    weights = tuple(QuantizedTensor.from_raw("Q8_0", quants.quantize(d, GGMLQuantizationType.Q8_0),
                                             d.shape) for d in self.dense)
    for w in weights:
      w.int8_activations = True
    routed = jax.jit(grouped_experts.routed)
    # one SwiGLU call over every (row, expert) pair
    self.assertIn("mtpjax_quant_swiglu", routed.lower(jnp.asarray(x), jnp.asarray(ids),
                                                      *weights).as_text())
    got = np.asarray(routed(jnp.asarray(x), jnp.asarray(ids), *weights))
    want, ties = _int8_reference(x, ids, *self.dense)
    self.assertLessEqual(ties.sum(), 4)
    np.testing.assert_allclose(got[~ties], want[~ties], atol=2e-4, rtol=1e-4)
    for n in (0, 17, 39):
      alone = routed(jnp.asarray(x[n:n + 1]), jnp.asarray(ids[n:n + 1]), *weights)
      np.testing.assert_array_equal(np.asarray(alone)[0], got[n])

  @parameterized.parameters("xla", "pallas")
  def test_a_steps_pairs_equal_the_reference_and_each_row_alone(self, kernels):
    # A decode or verify step's rows (any count, past PAIR_ROWS here) go pair by pair, the
    # Pallas kernel by expert id under `pallas` (run by its interpreter here).
    x, ids = self._rows(20, 3, np.random.default_rng(7))   # the class's draws left as they were
    weights = tuple(QuantizedTensor.from_raw("Q8_0", quants.quantize(d, GGMLQuantizationType.Q8_0),
                                             d.shape) for d in self.dense)
    for w in weights:
      w.kernels = backend.Kernels(kernels, "cpu", steps=True)
    routed = jax.jit(grouped_experts.routed)
    jaxpr = str(jax.make_jaxpr(grouped_experts.routed)(jnp.asarray(x), jnp.asarray(ids),
                                                        *weights))
    self.assertEqual("pallas_call" in jaxpr, kernels == "pallas")
    got = np.asarray(routed(jnp.asarray(x), jnp.asarray(ids), *weights))
    np.testing.assert_allclose(got, _numpy_reference(x, ids, *self.dense), atol=2e-4, rtol=1e-4)
    for n in (0, 11, 19):
      alone = routed(jnp.asarray(x[n:n + 1]), jnp.asarray(ids[n:n + 1]), *weights)
      np.testing.assert_array_equal(np.asarray(alone)[0], got[n])

  def test_small_tiles_span_several_tiles_per_expert(self):
    x, ids = self._rows(40, 2)
    weights = tuple(nnx.Param(jnp.asarray(w)) for w in self.dense)
    got = jax.jit(grouped_experts.grouped, static_argnames="tile")(
        jnp.asarray(x), jnp.asarray(ids), *weights, tile=4)
    np.testing.assert_allclose(np.asarray(got), _numpy_reference(x, ids, *self.dense),
                               atol=2e-4, rtol=1e-4)


if __name__ == "__main__":
  absltest.main()
