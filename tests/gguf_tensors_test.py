"""Tests for mtpjax.gguf.tensors: per-tensor dequantization of real GGUF files.

Every tensor goes through a real file (gguf.GGUFWriter -> gguf.GGUFReader). References: the
original arrays, hand-written Q8_0/Q4_0 block decoders, gguf-py's own dequantizer (the ground
truth llama.cpp agrees with, docs/MODEL.md §10-§11) and the llama.cpp-made glm4moe-tiny fixtures.
"""

import tempfile
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from mtpjax import errors
from mtpjax.gguf import tensors
from fixtures import FIXTURES

FIXTURE = FIXTURES / "glm4moe-tiny"

# Types gguf-py can quantize: (numpy element shape [.., out, in]).
_QUANTIZABLE = {
    T.BF16: (5, 64), T.Q8_0: (2, 8, 64), T.Q4_0: (6, 96), T.Q4_1: (6, 64), T.Q5_0: (4, 64),
    T.Q5_1: (4, 128), T.TQ1_0: (2, 256), T.TQ2_0: (2, 256), T.MXFP4: (3, 64),
}
# Types built from random blocks: byte offset of the f16 `d` (and `dmin`) fields.
_RANDOM_BLOCKS = {
    T.Q2_K: ((2, 3, 512), (80, 82)), T.Q3_K: ((4, 256), (108,)), T.Q4_K: ((4, 256), (0, 2)),
    T.Q5_K: ((3, 512), (0, 2)), T.Q6_K: ((2, 2, 256), (208,)), T.IQ4_NL: ((4, 64), (0,)),
    T.IQ4_XS: ((4, 256), (0,)), T.IQ2_XXS: ((2, 256), (0,)), T.IQ2_XS: ((2, 256), (0,)),
    T.IQ2_S: ((2, 256), (0,)), T.IQ3_XXS: ((2, 256), (0,)), T.IQ3_S: ((2, 256), (0,)),
    T.IQ1_S: ((2, 256), (0,)),
}
_UNSUPPORTED = {T.Q8_K: (2, 256), T.Q8_1: (2, 64)}


def _random_blocks(rng, qtype, shape, scale_offsets=()):
  block, type_size = GGML_QUANT_SIZES[qtype]
  raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block, type_size), dtype=np.uint8)
  for off in scale_offsets:
    scales = rng.uniform(1e-3, 1e-2, size=raw.shape[:-1]).astype(np.float16)
    raw[..., off:off + 2] = scales.view(np.uint8).reshape(*scales.shape, 2)
  return raw.reshape(*shape[:-1], shape[-1] // block * type_size)


def _decode_q8_0(raw, shape):
  """Independent Q8_0 decoder: per 32 elements, an f16 scale then 32 int8 quants."""
  b = raw.reshape(-1, 34)
  d = b[:, :2].copy().view(np.float16).astype(np.float32)
  return (d * b[:, 2:].view(np.int8).astype(np.float32)).reshape(shape)


def _decode_q4_0(raw, shape):
  """Independent Q4_0 decoder: f16 scale, low nibbles = elements 0..15, high = 16..31, minus 8."""
  b = raw.reshape(-1, 18)
  d = b[:, :2].copy().view(np.float16).astype(np.float32)
  q = np.concatenate([b[:, 2:] & 0x0F, b[:, 2:] >> 4], axis=1).astype(np.float32) - 8.0
  return (d * q).reshape(shape)


class DequantizeFileTest(parameterized.TestCase):
  """One GGUF holding a tensor of every buildable type, read back with GGUFReader."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    rng = np.random.default_rng(0)
    cls.originals, cls.raw_written = {}, {}
    cls.tmp = tempfile.TemporaryDirectory()
    path = Path(cls.tmp.name) / "types.gguf"
    w = gguf.GGUFWriter(path, "glm4moe")
    cls.originals["f32"] = rng.standard_normal((3, 64)).astype(np.float32)
    w.add_tensor("f32", cls.originals["f32"])
    cls.originals["f32_1d"] = rng.standard_normal(64).astype(np.float32)
    w.add_tensor("f32_1d", cls.originals["f32_1d"])
    cls.originals["f16"] = rng.standard_normal((2, 4, 32)).astype(np.float16)
    w.add_tensor("f16", cls.originals["f16"])
    for qtype, shape in _QUANTIZABLE.items():
      a = rng.standard_normal(shape).astype(np.float32)
      if qtype == T.BF16:  # exactly representable, so the round trip must be exact
        a = a.astype(ml_dtypes.bfloat16).astype(np.float32)
      cls.originals[qtype.name] = a
      q = gguf.quants.quantize(a, qtype)
      cls.raw_written[qtype.name] = q
      w.add_tensor(qtype.name, q, raw_shape=q.shape, raw_dtype=qtype)
    for qtype, (shape, offsets) in {**_RANDOM_BLOCKS,
                                    **{k: (v, ()) for k, v in _UNSUPPORTED.items()}}.items():
      raw = _random_blocks(rng, qtype, shape, offsets)
      cls.originals[qtype.name] = np.zeros(shape, np.float32)  # element shape only
      cls.raw_written[qtype.name] = raw
      w.add_tensor(qtype.name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.add_tensor("i32", np.arange(8, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cls.reader = gguf.GGUFReader(path)
    cls.by_name = {t.name: t for t in cls.reader.tensors}

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def _deq(self, name, dtype="float32"):
    t = self.by_name[name]
    return tensors.dequantize(t.name, t.tensor_type, t.shape, t.data, dtype)

  def test_float_types_are_exact(self):
    np.testing.assert_array_equal(self._deq("f32"), self.originals["f32"])
    np.testing.assert_array_equal(self._deq("f32_1d"), self.originals["f32_1d"])
    f16 = self._deq("f16")
    self.assertEqual(f16.dtype, np.float32)
    np.testing.assert_array_equal(f16, self.originals["f16"].astype(np.float32))
    np.testing.assert_array_equal(self._deq("BF16"), self.originals["BF16"])

  def test_every_type_matches_gguf_bit_for_bit_with_numpy_shape(self):
    names = ["f32", "f16", *(q.name for q in _QUANTIZABLE), *(q.name for q in _RANDOM_BLOCKS)]
    for name in names:
      t = self.by_name[name]
      got = self._deq(name)
      want = gguf.quants.dequantize(t.data, t.tensor_type)
      self.assertEqual(got.dtype, np.float32, name)
      self.assertEqual(got.shape, self.originals[name].shape, name)
      self.assertEqual(got.shape, tuple(int(d) for d in reversed(t.shape)), name)
      np.testing.assert_array_equal(got.view(np.uint32), want.reshape(got.shape).view(np.uint32),
                                    err_msg=name)
      self.assertTrue(np.isfinite(got).all(), name)

  def test_q8_0_and_q4_0_match_independent_decoders(self):
    for name, decode, tol in (("Q8_0", _decode_q8_0, 0.02), ("Q4_0", _decode_q4_0, 0.3)):
      shape = self.originals[name].shape
      got = self._deq(name)
      np.testing.assert_array_equal(got, decode(self.raw_written[name], shape), err_msg=name)
      np.testing.assert_allclose(got, self.originals[name], atol=tol * 4, err_msg=name)

  def test_quantized_types_approximate_their_source(self):
    tol = {"Q4_1": 0.3, "Q5_0": 0.15, "Q5_1": 0.15, "MXFP4": 0.6}
    for name, atol in tol.items():
      np.testing.assert_allclose(self._deq(name), self.originals[name], atol=atol, err_msg=name)

  def test_bf16_to_bfloat16_is_a_zero_copy_view(self):
    t = self.by_name["BF16"]
    got = self._deq("BF16", "bfloat16")
    self.assertEqual(got.dtype, ml_dtypes.bfloat16)
    self.assertEqual(got.shape, (5, 64))
    self.assertTrue(np.shares_memory(got, t.data))
    np.testing.assert_array_equal(got.view(np.uint16),
                                  self.raw_written["BF16"].view(np.uint16).reshape(5, 64))

  def test_f32_view_is_zero_copy(self):
    self.assertTrue(np.shares_memory(self._deq("f32"), self.by_name["f32"].data))

  def test_bfloat16_output_rounds_the_float32_result(self):
    for name in ("f32", "f16", "Q8_0", "Q4_K"):
      got = self._deq(name, "bfloat16")
      self.assertEqual(got.dtype, ml_dtypes.bfloat16, name)
      np.testing.assert_array_equal(got, self._deq(name).astype(ml_dtypes.bfloat16), name)

  @parameterized.parameters("Q8_K", "Q8_1", "i32")
  def test_unsupported_type_raises_typed_error_naming_tensor(self, name):
    with self.assertRaises(errors.UnsupportedTensorTypeError) as cm:
      self._deq(name)
    message = str(cm.exception)
    self.assertIn(repr(name), message)
    self.assertIn(self.by_name[name].tensor_type.name, message)
    self.assertIn("remedy:", message)
    self.assertIsInstance(cm.exception, errors.ConversionError)

  def test_unknown_type_id_raises(self):
    t = self.by_name["f32"]
    with self.assertRaisesRegex(errors.UnsupportedTensorTypeError, "'weird'.*99"):
      tensors.dequantize("weird", 99, t.shape, t.data)

  def test_wrong_byte_count_raises(self):
    t = self.by_name["Q8_0"]
    with self.assertRaisesRegex(errors.ConversionError, "'Q8_0'.*bytes"):
      tensors.dequantize("Q8_0", t.tensor_type, [64, 8, 3], t.data)

  def test_row_not_multiple_of_block_raises(self):
    t = self.by_name["Q8_0"]
    with self.assertRaisesRegex(errors.ConversionError, "multiple of the 32-element block"):
      tensors.dequantize("Q8_0", t.tensor_type, [48, 16, 2], t.data)

  def test_bad_output_dtype_raises(self):
    t = self.by_name["f32"]
    with self.assertRaisesRegex(errors.ConversionError, "float16"):
      tensors.dequantize("f32", t.tensor_type, t.shape, t.data, "float16")


class FixtureTest(absltest.TestCase):
  """llama.cpp-written files: mixed per-tensor types, and the F32 policy on its own names."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.readers = {k: gguf.GGUFReader(FIXTURE / f"glm4moe_h64-{k}.gguf")
                   for k in ("F32", "Q8_0", "Q4_K_M")}

  def test_quantized_fixtures_dequantize_like_gguf_and_near_f32(self):
    f32 = {t.name: np.asarray(t.data) for t in self.readers["F32"].tensors}
    for kind, tol in (("Q8_0", 0.02), ("Q4_K_M", 0.2)):
      types = set()
      for t in self.readers[kind].tensors:
        got = tensors.dequantize(t.name, t.tensor_type, t.shape, t.data)
        types.add(t.tensor_type)
        np.testing.assert_array_equal(
            got, gguf.quants.dequantize(t.data, t.tensor_type).reshape(got.shape), t.name)
        self.assertEqual(got.shape, f32[t.name].shape, t.name)
        scale = np.abs(f32[t.name]).max()
        np.testing.assert_allclose(got, f32[t.name], atol=tol * scale, err_msg=t.name)
      if kind == "Q4_K_M":
        self.assertGreaterEqual(len(types), 3)  # F32 + several quant types in one file

  def test_keeps_f32_matches_llama_quantize_policy(self):
    for t in self.readers["Q8_0"].tensors:
      self.assertEqual(tensors.keeps_f32(t.name, len(t.shape)), t.tensor_type == T.F32, t.name)

  def test_numpy_shape_and_nbytes(self):
    self.assertEqual(tensors.numpy_shape([64, 32, 8]), (8, 32, 64))
    self.assertEqual(tensors.numpy_shape(np.array([128, 64], np.uint64)), (64, 128))
    for t in self.readers["Q4_K_M"].tensors:
      self.assertEqual(tensors.tensor_nbytes(t.tensor_type, t.shape), t.n_bytes, t.name)


if __name__ == "__main__":
  absltest.main()
