"""Quantized weights on the device equal gguf-py's dequantization bit for bit.

Reference: `gguf.quants.dequantize` (the real library llama.cpp agrees with) on random valid
blocks (every f16 field a finite f16, random bits elsewhere) and on the llama.cpp-made fixture
tensors, against the jitted device path (`models/quantized.py`) over the host fields
(`gguf/quant_blocks.py`).
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from gguf import GGUFReader, quants
from gguf.constants import GGMLQuantizationType

from mtpjax.gguf import quant_blocks
from mtpjax.models import quantized
from mtpjax.testing.random_blocks import random_valid_blocks
from fixtures import FIXTURES

# numpy shapes with several leading dims, so gathers and block reshapes are exercised.
_SHAPES = {"Q8_0": (3, 4, 64), "Q4_0": (5, 96), "Q4_1": (2, 3, 64), "Q5_0": (4, 64),
           "Q5_1": (3, 128), "Q2_K": (2, 3, 512), "Q3_K": (4, 256), "Q4_K": (3, 2, 256),
           "Q5_K": (3, 512), "Q6_K": (2, 2, 256)}


_device_values = jax.jit(quantized.dequantize_fields, static_argnums=0)


class ExactnessTest(parameterized.TestCase):

  @parameterized.parameters(*sorted(_SHAPES))
  def test_random_blocks_bit_for_bit(self, type_name):
    rng = np.random.default_rng(sum(map(ord, type_name)))
    shape = _SHAPES[type_name]
    raw = random_valid_blocks(rng, type_name, shape)
    want = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(shape)
    got = np.asarray(_device_values(type_name, quant_blocks.unpack(type_name, raw, shape)))
    self.assertEqual(got.dtype, np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))

  def test_llama_cpp_fixture_tensors_bit_for_bit(self):
    seen = set()
    for name in ("glm4moe-tiny/glm4moe_h64-Q4_K_M.gguf", "glm4moe-tiny/glm4moe_h64-Q8_0.gguf"):
      for tensor in GGUFReader(FIXTURES / name).tensors:
        type_name = tensor.tensor_type.name
        if type_name not in quant_blocks.DEVICE_TYPES:
          continue
        seen.add(type_name)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        want = quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        got = np.asarray(_device_values(type_name,
                                        quant_blocks.unpack(type_name, tensor.data, shape)))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=name)
    self.assertEqual(seen, {"Q8_0", "Q5_0", "Q5_1"})

  @parameterized.product(type_name=sorted(_SHAPES), path=("fused", "tiled"))
  def test_contraction_reads_the_exact_values(self, type_name, path):
    # Unit rows pick single weights out of the contraction: x = e_i gives column i exactly.
    # Accelerators' fused reduction over 3 rows; XLA:CPU's tiles, 96 rows in 3 tiles of 32.
    rng = np.random.default_rng(1 + sum(map(ord, type_name)))
    shape = ((3,) if path == "fused" else (96,)) + _SHAPES[type_name][-1:]
    raw = random_valid_blocks(rng, type_name, shape)
    want = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(shape)
    fields = {n: jnp.asarray(a) for n, a in quant_blocks.unpack(type_name, raw, shape).items()}
    eye = jnp.eye(shape[-1], dtype=jnp.float32)
    if path == "fused":
      got = jax.jit(quantized.fused_contract, static_argnums=1)(eye, type_name, fields)
    else:
      got = jax.jit(quantized.tiled_contract, static_argnums=(1, 3))(eye, type_name, fields, 32)
    np.testing.assert_array_equal(np.asarray(got).T, want)

  @parameterized.product(type_name=("Q5_0", "Q4_K"), path=("fused", "dense"))
  def test_per_head_contraction_reads_each_heads_exact_values(self, type_name, path):
    # MLA's attn_k_b / attn_v_b ([H, out, in]; GLM-4.7-Flash's types). Unit rows per head pick
    # single weights: x[.., h] = e_i against head h gives column i of head h exactly (the fused
    # loop is the accelerators' few-row path, the dense one XLA:CPU's and prefill's).
    rng = np.random.default_rng(7 + sum(map(ord, type_name)))
    shape = (3, 5) + _SHAPES[type_name][-1:]
    raw = random_valid_blocks(rng, type_name, shape)
    want = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(shape)
    fields = {n: jnp.asarray(a) for n, a in quant_blocks.unpack(type_name, raw, shape).items()}
    eye = jnp.broadcast_to(jnp.eye(shape[-1], dtype=jnp.float32)[:, None],
                           (shape[-1], 3, shape[-1]))
    if path == "fused":
      got = jax.jit(quantized.fused_contract, static_argnums=1)(eye, type_name, fields)
    else:
      weight = quantized.QuantizedTensor.from_raw(type_name, raw, shape)
      got = jax.jit(quantized.contract_heads)(eye, weight)
    self.assertEqual(got.shape, (shape[-1], 3, 5))
    np.testing.assert_array_equal(np.asarray(got).transpose(1, 2, 0), want)

  def test_tiles_divide_the_rows_or_are_not_used(self):
    self.assertEqual(quantized._tile_rows(154880, 2048), 256)   # GLM's head: 605 tiles
    self.assertEqual(quantized._tile_rows(5120, 768), 512)      # 512 x 768 <= 2^19 values
    self.assertEqual(quantized._tile_rows(768, 256), 768)       # small enough for one tile
    self.assertEqual(quantized._tile_rows(16 * 9, 4096), 0)     # 16-row tiles: not tiled

  @parameterized.parameters(*sorted(_SHAPES))
  def test_int8_is_converted_only_where_stored(self, type_name):
    # XLA:CPU hands an int8 -> float32 convert in these fusions to YNNPACK, whose convert
    # crashed (SIGSEGV) in a GLM-4.7-Flash Q4_K_M decode step; centred integers are therefore
    # subtracted in float32. Only stored int8 fields (Q8_0 quants, Q3_K/Q6_K scales) may be
    # converted from int8, and only as read.
    shape = (3,) + _SHAPES[type_name][-1:]
    fields = {n: jax.ShapeDtypeStruct(s, d)
              for n, (s, d) in quant_blocks.field_specs(type_name, shape).items()}
    x = jax.ShapeDtypeStruct((1, shape[-1]), jnp.float32)
    for jaxpr in (jax.make_jaxpr(quantized.fused_contract, static_argnums=1)(x, type_name, fields),
                  jax.make_jaxpr(quantized.dequantize_fields, static_argnums=0)(type_name, fields)):
      # (tiled_contract dequantizes tiles with dequantize_fields, checked here)
      inputs = set(jaxpr.jaxpr.invars)
      computed = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"
                  and e.invars[0].aval.dtype == np.int8 and e.invars[0] not in inputs]
      self.assertEqual(computed, [])

  def test_a_biased_one_tile_row_keeps_its_weight_in_the_dot(self):
    # A bias added to a one-tile contraction used to fuse into the dot on XLA:CPU, which then
    # wrote the whole dequantized matrix to memory (f32[in, out]) at every decode step.
    shape = (96, 256)
    rng = np.random.default_rng(3)
    raw = random_valid_blocks(rng, "Q8_0", shape)
    fields = {n: jnp.asarray(a) for n, a in quant_blocks.unpack("Q8_0", raw, shape).items()}
    x = jnp.asarray(rng.standard_normal((1, shape[1])), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(shape[0]), jnp.float32)
    biased = jax.jit(lambda x, f, b: quantized.contract(x, "Q8_0", f) + b)
    entry = biased.lower(x, fields, bias).compile().as_text().split("\nENTRY ")[1]
    if jax.default_backend() == "cpu":   # no buffer of the step holds the float32 matrix
      self.assertNotRegex(entry, r"= f32\[(96,256|256,96)\]")
    dense = quants.dequantize(raw, GGMLQuantizationType.Q8_0).reshape(shape).astype(np.float64)
    want = np.asarray(x, np.float64) @ dense.T + np.asarray(bias, np.float64)
    np.testing.assert_allclose(np.asarray(biased(x, fields, bias)), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())

  def test_device_bytes_near_file_bytes(self):
    for type_name, shape in _SHAPES.items():
      tensor = quantized.QuantizedTensor(type_name, shape)
      ratio = tensor.device_bytes() / tensor.gguf_bytes()
      self.assertBetween(ratio, 1.0, 1.04, msg=type_name)

  def test_matmul_few_and_many_rows_use_the_exact_values(self):
    # On XLA:CPU 48 x 512 is one tile and 1,024 x 1,024 two tiles of 512. Rows past
    # FUSED_ROWS take the dequantize + GEMM path on accelerators.
    rng = np.random.default_rng(0)
    for shape in ((48, 512), (1024, 1024)):
      self._check_matmul(rng, shape)

  def _check_matmul(self, rng, shape):
    raw = random_valid_blocks(rng, "Q4_K", shape)
    dense = quants.dequantize(raw, GGMLQuantizationType.Q4_K).reshape(shape)
    tensor = quantized.QuantizedTensor.from_raw("Q4_K", raw, shape)
    for rows in (1, quantized.FUSED_ROWS + 4):
      x = rng.standard_normal((rows, shape[1])).astype(np.float32) * 1e-3
      got = np.asarray(jax.jit(quantized.matmul)(jnp.asarray(x), tensor))
      want = x.astype(np.float64) @ dense.T.astype(np.float64)
      np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-4 * np.abs(want).max())


if __name__ == "__main__":
  absltest.main()
