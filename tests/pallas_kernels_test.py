"""The Pallas quantized contraction (`mtpjax/kernels/pallas_quant.py`), run here by Pallas'
interpreter: against gguf-py's dequantized values in float64, row independence, and whether it
lowers for TPU (Mosaic) and CUDA (Triton) with `jax.export` on this CPU machine.

The kernel contracts with a float32 dot, not the XLA fused loop's plane-by-plane sums, so it
is compared within a stated bound: |error| <= 4 * 2^-24 * sum_i |x_i w_i| * sqrt(in) (float32
rounding of a sum of `in` products), with gguf-py's float64 values of the same blocks.
"""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from gguf import quants
from gguf.constants import GGMLQuantizationType
from jax import export

from mtpjax.gguf import quant_blocks
from mtpjax.kernels import backend, pallas_quant
from mtpjax.models import quantized
from mtpjax.testing.random_blocks import random_valid_blocks

# One shape per type: K-quants need rows of 256, the rest of 32; an output count that is not a
# multiple of OUT_TILE (96) and one that is several tiles (512) are among them.
SHAPES = {"Q8_0": (96, 128), "Q4_0": (64, 64), "Q4_1": (64, 64), "Q5_0": (160, 96),
          "Q5_1": (64, 64), "Q2_K": (64, 256), "Q3_K": (64, 256), "Q4_K": (256, 256),
          "Q5_K": (128, 512), "Q6_K": (512, 256)}
# What GLM users' files hold (Q4_K_M / Q5_K_M / Q6_K / Q8_0, and Flash's MLA tensors).
GLM_TYPES = ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
STEPS = backend.Kernels("pallas", "cpu", steps=True)
REPO = pathlib.Path(__file__).resolve().parent.parent


def _case(type_name: str, seed: int = 0):
  shape = SHAPES[type_name]
  rng = np.random.default_rng(seed)
  raw = random_valid_blocks(rng, type_name, shape)
  values = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(shape)
  fields = {n: jnp.asarray(a) for n, a in quant_blocks.unpack(type_name, raw, shape).items()}
  x = rng.standard_normal((20, 1, shape[1])).astype(np.float32)
  return values.astype(np.float64), fields, x


def _contract(type_name: str):
  return jax.jit(lambda x, f: quantized.contract(x, type_name, f, kernels=STEPS))


class PallasQuantTest(parameterized.TestCase):

  @parameterized.parameters(*SHAPES)
  def test_rows_equal_gguf_values_within_float32_rounding(self, type_name):
    values, fields, x = _case(type_name)
    got = np.asarray(_contract(type_name)(jnp.asarray(x), fields))[:, 0]
    rows = x[:, 0].astype(np.float64)
    want = rows @ values.T
    bound = 4 * 2.0**-24 * (np.abs(rows) @ np.abs(values).T) * np.sqrt(values.shape[1])
    self.assertTrue(np.all(np.abs(got - want) <= bound),
                    f"{type_name}: worst error / bound {np.max(np.abs(got - want) / bound):.3f}")

  @parameterized.parameters("Q8_0", "Q4_K")
  def test_prefill_rows_in_row_tiles_equal_gguf_values(self, type_name):
    # 300 rows: three programs' row tiles, the last padded
    values, fields, _ = _case(type_name)
    x = np.random.default_rng(3).standard_normal((300, values.shape[1])).astype(np.float32)
    prefill = backend.Kernels("pallas", "cpu")
    got = np.asarray(jax.jit(lambda x, f: quantized.contract(x, type_name, f, kernels=prefill))(
        jnp.asarray(x), fields))
    rows = x.astype(np.float64)
    bound = 4 * 2.0**-24 * (np.abs(rows) @ np.abs(values).T) * np.sqrt(values.shape[1])
    self.assertTrue(np.all(np.abs(got - rows @ values.T) <= bound))

  @parameterized.parameters("Q5_0", "Q4_K", "Q6_K")
  def test_a_rows_value_does_not_depend_on_the_rows_beside_it(self, type_name):
    _, fields, x = _case(type_name, seed=1)
    contract = _contract(type_name)
    alone = np.asarray(contract(jnp.asarray(x[3:4]), fields))[0]
    for rows in (slice(0, 8), slice(0, 9), slice(0, 20), slice(3, 5)):
      beside = np.asarray(contract(jnp.asarray(x[rows]), fields))
      np.testing.assert_array_equal(beside[3 - (rows.start or 0)], alone)

  @parameterized.parameters("Q8_0", "Q5_0", "Q4_K", "Q6_K")
  def test_rows_by_id_equal_their_matrix_within_float32_rounding(self, type_name):
    # three stacked matrices (experts, heads); each row against the one its id names
    out, width = SHAPES[type_name]
    rng = np.random.default_rng(2)
    raw = random_valid_blocks(rng, type_name, (3 * out, width))
    values = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(3, out, width)
    fields = {n: jnp.asarray(a)
              for n, a in quant_blocks.unpack(type_name, raw, (3, out, width)).items()}
    ids = np.array([2, 0, 0, 1, 2])
    x = rng.standard_normal((5, width)).astype(np.float32)
    by_id = jax.jit(lambda x, ids, f: quantized.pallas_contract(x, type_name, f, STEPS, ids))
    got = np.asarray(by_id(jnp.asarray(x), jnp.asarray(ids), fields))
    rows, chosen = x.astype(np.float64), values[ids].astype(np.float64)
    want = np.einsum("ri,roi->ro", rows, chosen)
    bound = 4 * 2.0**-24 * np.einsum("ri,roi->ro", np.abs(rows), np.abs(chosen)) * np.sqrt(width)
    self.assertTrue(np.all(np.abs(got - want) <= bound),
                    f"{type_name}: worst error / bound {np.max(np.abs(got - want) / bound):.3f}")
    # a row's value is its own: the same row and id alone
    alone = np.asarray(by_id(jnp.asarray(x[3:4]), jnp.asarray(ids[3:4]), fields))[0]
    np.testing.assert_array_equal(got[3], alone)

  def test_out_tiles_divide_the_rows(self):
    self.assertEqual(pallas_quant.out_tile(154880), 128)     # GLM's vocabulary head
    self.assertEqual(pallas_quant.out_tile(96), 32)
    self.assertEqual(pallas_quant.out_tile(20), 20)          # too odd to tile: one program

  @parameterized.parameters(*GLM_TYPES)
  def test_it_lowers_for_tpu(self, type_name):
    self.assertIn("tpu_custom_call", self._exported(type_name, "tpu").mlir_module())

  @parameterized.parameters("Q4_K", "Q6_K")
  def test_rows_by_id_lower_for_tpu(self, type_name):
    kernels = backend.Kernels("pallas", "tpu", steps=True)
    fields = {n: jax.ShapeDtypeStruct(s, d)
              for n, (s, d) in quant_blocks.field_specs(type_name, (4, 256, 512)).items()}
    by_id = jax.jit(lambda x, ids, f: quantized.pallas_contract(x, type_name, f, kernels, ids))
    exported = export.export(by_id, platforms=("tpu",))(
        jax.ShapeDtypeStruct((6, 512), jnp.float32), jax.ShapeDtypeStruct((6,), jnp.int32),
        fields)
    self.assertIn("tpu_custom_call", exported.mlir_module())

  def test_q8_0_lowers_for_cuda_through_triton(self):
    # The other types' nibble and bit planes stack along inner axes, which Triton's
    # lowering does not take yet (README, "Kernels").
    self.assertIn("xla.gpu.triton", self._exported("Q8_0", "cuda").mlir_module())
    # and the types it cannot take contract as `xla` there, not fail to compile
    self.assertNotIn("xla.gpu.triton", self._exported("Q4_K", "cuda").mlir_module())

  def _exported(self, type_name, platform):
    kernels = backend.Kernels("pallas", platform, steps=True)
    shape = (256, 512)
    fields = {n: jax.ShapeDtypeStruct(s, d)
              for n, (s, d) in quant_blocks.field_specs(type_name, shape).items()}
    x = jax.ShapeDtypeStruct((8, shape[1]), jnp.float32)
    contract = jax.jit(lambda x, f: quantized.contract(x, type_name, f, kernels=kernels))
    # a Triton kernel's call has no serialization guarantee across jaxlib versions: fine for
    # a check that it lowers, which is all this is
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    return export.export(contract, platforms=(platform,), disabled_checks=checks)(x, fields)


class BenchKernelsTest(absltest.TestCase):

  def test_prints_every_kernels_type_and_row_count_in_one_json_line(self):
    run = subprocess.run(
        [sys.executable, "-m", "tools.bench_kernels", "--matrices=Q8_0:64x64,Q4_K:32x256",
         "--rows=1,9", "--calls=2", "--repeats=1"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    self.assertEqual(run.returncode, 0, run.stderr[-3000:])
    line = json.loads(run.stdout.strip().splitlines()[-1])
    names = ["xla", "pallas"] + (["native"] if backend.default().native else [])
    self.assertEqual(set(line["calls"]), {f"{name}:{spec}:rows{rows}" for name in names
                                          for spec in ("Q8_0:64x64", "Q4_K:32x256")
                                          for rows in (1, 9)})
    for key, call in line["calls"].items():
      self.assertGreater(call["us"], 0, key)
      self.assertGreater(call["weight_gb_s"], 0, key)
      self.assertEqual(call["interpret"], key.startswith("pallas"), key)   # on this CPU


if __name__ == "__main__":
  absltest.main()
