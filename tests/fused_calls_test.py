"""One native call for the projections that read the same rows, and for a whole SwiGLU.

`native.quant_matvecs` contracts rows with several quantized tensors in one call (q, k and v of
one hidden state), `native.quant_swiglu` runs down(silu(gate(x)) * up(x)) in one call (the
dense MLP, the shared expert, every (row, expert) pair of the routed experts). References:
each tensor's own `quant_matvec` call (bit for bit), float64 numpy over gguf-py's dequantized
values, and the rows taken one at a time.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from gguf import quants
from gguf.constants import GGMLQuantizationType

from mtpjax.gguf import quant_blocks
from mtpjax.kernels import backend, native
from mtpjax.models import primitives, quantized
from mtpjax.models.ffn import DenseMLP
from mtpjax.testing.random_blocks import random_valid_blocks


def _tensor(type_name, shape, seed, max_scale=0.02):
  """(float64 values as gguf-py dequantizes them, the kernel's (type, fields), the tensor)."""
  raw = random_valid_blocks(np.random.default_rng(seed), type_name, shape, max_scale=max_scale)
  values = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(shape)
  tensor = quantized.QuantizedTensor.from_raw(type_name, raw, shape)
  fields = [tensor.fields()[n] for n in quant_blocks.field_specs(type_name, shape)]
  return values.astype(np.float64), (type_name, fields), tensor


def _as_a_steps_rows(test, *tensors):
  """Make `tensors` contract as a decode or verify step's rows do (their kernels `for_steps`)
  for the rest of `test`."""
  for tensor in tensors:
    test.addCleanup(setattr, tensor, "kernels", tensor.kernels)
    tensor.kernels = tensor.kernels.for_steps()


def _silu(v):
  return v / (1.0 + np.exp(-v))


class FusedCallsTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    if not native.available():
      raise AssertionError("the native kernel did not build here (see the log)")
    # Three experts: gate and up [3, 96, 256], down [3, 256, 96], of three types
    cls.gate = _tensor("Q4_K", (3, 96, 256), seed=1)
    cls.up = _tensor("Q6_K", (3, 96, 256), seed=2)
    cls.down = _tensor("Q8_0", (3, 256, 96), seed=3)
    rng = np.random.default_rng(4)
    cls.x = rng.standard_normal((7, 256)).astype(np.float32)
    cls.ids = np.array([2, 0, 2, 1, 0, 0, 2], np.int32)

  def _matvecs(self, x, ids, tensors, int8):
    call = jax.jit(lambda x, ids, *fields: native.quant_matvecs(
        x, ids, [(t[0], f) for t, f in zip(tensors, fields)], [int8] * len(tensors)))
    return [np.asarray(y) for y in call(x, ids, *[t[1] for t in tensors])]

  def _swiglu(self, x, ids, int8):
    kernel = [self.gate[1], self.up[1], self.down[1]]
    call = jax.jit(lambda x, ids, g, u, d: native.quant_swiglu(
        x, ids, (kernel[0][0], g), (kernel[1][0], u), (kernel[2][0], d), [int8] * 3))
    return np.asarray(call(x, ids, *[t[1] for t in kernel]))

  @parameterized.parameters(False, True)
  def test_products_in_one_call_equal_their_own_calls_bit_for_bit(self, int8):
    tensors = [self.gate[1], self.up[1], _tensor("Q8_0", (3, 40, 256), seed=5)[1]]
    together = self._matvecs(self.x, self.ids, tensors, int8)
    self.assertEqual([y.shape for y in together], [(7, 96), (7, 96), (7, 40)])
    for (type_name, fields), got in zip(tensors, together):
      alone = np.asarray(native.quant_matvec(jnp.asarray(self.x), jnp.asarray(self.ids),
                                             type_name, fields, int8))
      np.testing.assert_array_equal(got, alone, err_msg=type_name)

  def test_a_swiglu_call_matches_float64_through_each_rows_expert(self):
    g, u, d = (t[0][self.ids] for t in (self.gate, self.up, self.down))
    x = self.x.astype(np.float64)
    act = _silu(np.einsum("ri,rfi->rf", x, g)) * np.einsum("ri,rfi->rf", x, u)
    want = np.einsum("rf,rdf->rd", act, d)
    got = self._swiglu(self.x, self.ids, int8=False)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())

  def test_int8_rows_round_the_activations_as_the_down_call_would(self):
    # int8 rows: the same as gate and up calls, silu(g) * u, then a down call of its own
    g, u = (np.asarray(native.quant_matvec(jnp.asarray(self.x), jnp.asarray(self.ids), *t[1],
                                           True)) for t in (self.gate, self.up))
    act = (_silu(g.astype(np.float64)) * u).astype(np.float32)
    want = np.asarray(native.quant_matvec(jnp.asarray(act), jnp.asarray(self.ids),
                                          *self.down[1], True))
    got = self._swiglu(self.x, self.ids, int8=True)
    # an activation a rounding step away from its reference may round to the next int8
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * np.abs(want).max())

  def test_silu_holds_its_precision_over_the_whole_range(self):
    # Diagonal Q8_0 matrices make every value one product, so the kernel's silu(g) * u is read
    # back over gate values from -100 (exp(-g) overflows a float32) to 100. The reference starts
    # from the kernel's own g (a gate call of its own, the same arithmetic): silu's relative
    # error grows with |g| times g's rounding, which is not silu's doing.
    width = 64
    x = jnp.asarray(np.linspace(-100.0, 100.0, width, dtype=np.float32)[None])
    raw = quants.quantize(np.eye(width, dtype=np.float32), GGMLQuantizationType.Q8_0)
    diagonal = np.diag(quants.dequantize(raw, GGMLQuantizationType.Q8_0)).astype(np.float64)
    tensor = quantized.QuantizedTensor.from_raw("Q8_0", raw, (width, width))
    fields = [f[None] for f in tensor.fields().values()]
    ids = jnp.zeros(1, jnp.int32)
    got = np.asarray(native.quant_swiglu(x, ids, *[("Q8_0", fields)] * 3, [False] * 3))[0]
    g = np.asarray(native.quant_matvec(x, ids, "Q8_0", fields))[0].astype(np.float64)
    want = diagonal * (_silu(g) * g)
    # past g = -88.7 exp(-g) leaves float32 and silu(g) flushes to 0 (|silu(g) g| < 1e-34)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-34)

  @parameterized.parameters(False, True)
  def test_a_rows_result_does_not_depend_on_the_other_rows(self, int8):
    # What keeps MTP on (k + 1 rows a slot) equal to MTP off (one row) bit for bit.
    together = self._swiglu(self.x, self.ids, int8)
    for r in range(len(self.x)):
      alone = self._swiglu(self.x[r:r + 1], self.ids[r:r + 1], int8)
      np.testing.assert_array_equal(alone[0], together[r], err_msg=f"row {r}")

  def test_bad_fields_are_an_error_not_a_read_out_of_bounds(self):
    (type_name, fields) = self.gate[1]
    with self.assertRaisesRegex(Exception, "wrong number of fields"):
      np.asarray(jax.ffi.ffi_call(native._TARGET, jax.ShapeDtypeStruct((7, 96), jnp.float32))(
          jnp.asarray(self.x), jnp.asarray(self.ids), *fields, fields[0],
          type_codes=np.array([native.TYPE_NAMES.index(type_name)], np.int32),
          int8_x=np.array([0], np.int32)))


class FusedModulesTest(absltest.TestCase):
  """Where the model takes the fused calls: decode rows of quantized weights on XLA:CPU."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.linears = []
    for seed, (out, bias) in enumerate(((256, True), (64, False), (64, True))):
      linear = primitives.Linear(256, out, jnp.float32, bias=bias)
      linear.weight = _tensor("Q8_0", (out, 256), seed=10 + seed)[2]
      if bias:
        linear.bias[...] = jnp.arange(out, dtype=jnp.float32) / 7
      cls.linears.append(linear)

  def _lowered(self, fn, rows):
    return jax.jit(fn).lower(jax.ShapeDtypeStruct((1, rows, 256), jnp.float32)).as_text()

  def test_q_k_and_v_of_decode_rows_are_one_call_with_their_biases(self):
    x = jnp.asarray(np.random.default_rng(20).standard_normal((1, 3, 256)), jnp.float32)
    _as_a_steps_rows(self, *(linear.weight for linear in self.linears))
    text = self._lowered(lambda x: primitives.project(x, *self.linears), 3)
    got = jax.jit(lambda x: primitives.project(x, *self.linears))(x)
    self.assertEqual(text.count("mtpjax_quant_matvec"), 1)
    for linear, y in zip(self.linears, got):
      np.testing.assert_array_equal(y, linear(x))   # 3 rows take the kernel alone too

  def test_a_prefills_rows_keep_a_call_each_on_xlas_path(self):
    text = self._lowered(lambda x: primitives.project(x, *self.linears),
                         quantized.NATIVE_ROWS + 1)
    self.assertNotIn("mtpjax_quant", text)

  def test_a_dense_mlp_of_decode_rows_is_one_swiglu_call(self):
    mlp = DenseMLP(256, 96, jnp.float32)
    mlp.gate.weight = _tensor("Q4_K", (96, 256), seed=30)[2]
    mlp.up.weight = _tensor("Q4_K", (96, 256), seed=31)[2]
    mlp.down.weight = _tensor("Q8_0", (256, 96), seed=32)[2]
    x = jnp.asarray(np.random.default_rng(33).standard_normal((1, 2, 256)), jnp.float32)
    _as_a_steps_rows(self, mlp.gate.weight, mlp.up.weight, mlp.down.weight)
    text = self._lowered(mlp, 2)
    got = np.asarray(jax.jit(mlp)(x))
    self.assertIn("mtpjax_quant_swiglu", text)
    self.assertNotIn("mtpjax_quant_matvec", text)
    # the separate calls with XLA's silu between them
    want = np.asarray(mlp.down(jax.nn.silu(mlp.gate(x)) * mlp.up(x)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


if __name__ == "__main__":
  absltest.main()
