"""The native CPU kernel (`kernels/quant_matvec.cc`) against gguf-py and numpy references.

References: `gguf.quants.dequantize` of random valid blocks (the exact values, picked out by unit
rows), float64 numpy products of those values, the rounding bound of int8 rows written out here,
and rows that int8 holds exactly. Fresh processes check the portable path (built without AVX2,
as on a CPU without it) and the fallback to XLA's paths when the kernel cannot build or is off.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from gguf import quants
from gguf.constants import GGMLQuantizationType

import mtpjax
from fixtures import FIXTURES
from mtpjax.gguf import quant_blocks
from mtpjax.kernels import backend, native
from mtpjax.models import quantized
from mtpjax.testing.random_blocks import random_valid_blocks

_WIDTH = {name: 64 if quant_blocks.block_size(name) == 32 else 512 for name in native.TYPE_NAMES}
_INT8_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def _raw(type_name, shape, seed, max_scale=None) -> np.ndarray:
  """Random valid GGUF blocks of a tensor of numpy `shape`."""
  return random_valid_blocks(np.random.default_rng(seed), type_name, shape, max_scale=max_scale)


def _tensor(type_name, shape, seed, max_scale=None):
  """(exact float32 values, device fields in the kernel's order) of random valid blocks."""
  raw = _raw(type_name, shape, seed, max_scale)
  values = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(shape)
  fields = quant_blocks.unpack(type_name, raw, shape)
  return values, [jnp.asarray(fields[n]) for n in quant_blocks.field_specs(type_name, shape)]


_REPO = pathlib.Path(__file__).resolve().parents[1]   # where `python -m tools...` runs
_matvec = jax.jit(native.quant_matvec, static_argnums=(2, 4))


def _q4k_fields() -> dict:
  """A Q4_K [512, 256] matrix's fields by name, for the lowering checks."""
  _, fields = _tensor("Q4_K", (512, 256), seed=10)
  return dict(zip(quant_blocks.field_specs("Q4_K", (512, 256)), fields))


def _call(x, ids, type_name, fields, int8=False):
  return np.asarray(_matvec(jnp.asarray(x, jnp.float32), jnp.asarray(ids, jnp.int32), type_name,
                            fields, int8))


class NativeKernelTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.assertTrue(native.available(), "the native kernel did not build here (see the log)")

  @parameterized.parameters(*native.TYPE_NAMES)
  def test_unit_rows_read_the_exact_values_of_every_matrix(self, type_name):
    # x = e_i against matrix m gives column i of matrix m exactly (every other product is an
    # exact zero), so the kernel's unpacked values are compared bit for bit.
    width = _WIDTH[type_name]
    values, fields = _tensor(type_name, (3, 40, width), seed=sum(map(ord, type_name)))
    eye = np.eye(width, dtype=np.float32)
    for matrix in range(3):
      got = _call(eye, np.full(width, matrix), type_name, fields)
      np.testing.assert_array_equal(got.T, values[matrix])

  @parameterized.parameters(*native.TYPE_NAMES)
  def test_rows_against_their_matrices_match_float64(self, type_name):
    width = _WIDTH[type_name]
    values, fields = _tensor(type_name, (4, 96, width), seed=1, max_scale=0.01)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, width)).astype(np.float32)
    ids = np.array([3, 0, 3, 1, 2, 0, 3])
    want = np.einsum("ri,roi->ro", x.astype(np.float64), values[ids].astype(np.float64))
    got = _call(x, ids, type_name, fields)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())

  def test_a_rows_result_does_not_depend_on_the_other_rows(self):
    # What makes MTP on (a verify of k rows) equal MTP off (one row a step) bit for bit, with
    # the work split over threads in both.
    # 70 rows: matrix 1's 45 rows span two tiles of the kernel's rows (32 a tile).
    ids = np.random.default_rng(3).permutation(np.repeat([1, 0], [45, 25]))
    for type_name in ("Q4_K", "Q6_K", "Q8_0"):
      _, fields = _tensor(type_name, (2, 2048, 256), seed=4, max_scale=0.01)
      x = np.random.default_rng(5).standard_normal((len(ids), 256)).astype(np.float32)
      for int8 in (False, True):
        together = _call(x, ids, type_name, fields, int8)
        for r in range(len(ids)):
          alone = _call(x[r:r + 1], ids[r:r + 1], type_name, fields, int8)
          np.testing.assert_array_equal(alone[0], together[r], err_msg=f"{type_name} {int8}")

  def test_one_or_two_rows_equal_the_same_rows_among_many(self):
    # One or two int8 rows against 32-value blocks take four or two output rows at once (their
    # own compiled copies); 38 output rows leave a tail of 6 that goes one at a time.
    x = np.random.default_rng(7).standard_normal((9, 64)).astype(np.float32)
    ids = np.zeros(len(x))
    for type_name in ("Q8_0", "Q4_1"):
      _, fields = _tensor(type_name, (1, 38, 64), seed=6, max_scale=0.01)
      together = _call(x, ids, type_name, fields, True)
      for r in range(len(x) - 1):
        for rows in (1, 2):
          few = _call(x[r:r + rows], ids[r:r + rows], type_name, fields, True)
          np.testing.assert_array_equal(few, together[r:r + rows], err_msg=f"{type_name} {r}")

  def test_more_rows_than_one_call_takes_are_split_exactly(self):
    values, fields = _tensor("Q8_0", (2, 8, 64), seed=12)
    rows = native.MAX_ROWS + 3
    x = np.random.default_rng(13).standard_normal((rows, 64)).astype(np.float32)
    ids = np.arange(rows) % 2
    want = np.einsum("ri,roi->ro", x.astype(np.float64), values[ids].astype(np.float64))
    for int8 in (False, True):
      got = _call(x, ids, "Q8_0", fields, int8)
      tolerance = 0.02 if int8 else 2e-6   # int8 rows: their rounding (bounded above)
      np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * np.abs(want).max())
      for r in (0, native.MAX_ROWS - 1, native.MAX_ROWS, rows - 1):
        alone = _call(x[r:r + 1], ids[r:r + 1], "Q8_0", fields, int8)
        np.testing.assert_array_equal(alone[0], got[r], err_msg=f"row {r}, int8 {int8}")

  @parameterized.product(type_name=_INT8_TYPES, magnitude=(1.0, 1e-3))
  def test_int8_rows_give_llama_cpps_product_with_the_rows_rounded(self, type_name, magnitude):
    # Each row is rounded per weight block to int8 (x * (127 / amax) in float32, ties to even)
    # times a scale kept as llama.cpp keeps it: float16 amax / 127 for 32-value blocks (Q8_0,
    # Q8_1), float32 1 / (127 / amax) for 256 (Q8_K). The result is the exact weights' product
    # with that rounded row, except that Q4_1 / Q5_1 take their mins' term from Q8_1's float16
    # sum of the block (amax / 127 * sum(q)) rather than from the rounded values' sum.
    # Rows of magnitude 1e-3 have float16 scales below its normal range (2^-14).
    width = _WIDTH[type_name]
    block = quant_blocks.block_size(type_name)
    raw = _raw(type_name, (1, 64, width), seed=6, max_scale=0.01)
    values, fields = _tensor(type_name, (1, 64, width), seed=6, max_scale=0.01)
    x = (magnitude * np.random.default_rng(7).standard_normal((3, width))).astype(np.float32)
    amax = np.abs(x).reshape(3, -1, block).max(-1, keepdims=True)
    q = np.rint(x.reshape(3, -1, block) * (np.float32(127) / amax))
    if block == 32:
      scale = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    else:
      scale = np.float32(1) / (np.float32(127) / amax)
    rounded = (q * scale).reshape(3, width).astype(np.float64)
    want = rounded @ values[0].T.astype(np.float64)
    min_shift = np.zeros_like(want)
    if type_name in ("Q4_1", "Q5_1"):   # block bytes: d, m (float16), then the integers
      mins = raw.reshape(64, width // 32, -1)[..., 2:4].copy().view(np.float16)[..., 0]
      sums = q.sum(-1)
      q8_1_sums = ((amax[..., 0] / np.float32(127)) * sums).astype(np.float16)
      min_shift = (q8_1_sums.astype(np.float64) - scale[..., 0] * sums) @ mins.T.astype(
          np.float64)
      self.assertGreater(np.abs(min_shift).max(), 0.0)
    got = _call(x, np.zeros(3), type_name, fields, int8=True)
    np.testing.assert_allclose(got, want + min_shift, rtol=0, atol=2e-6 * np.abs(want).max())
    # Rounding moves each value by at most half a step plus the float16 scale's error
    # (127 * scale * 2^-11), so the product moves from the float row's by at most that bound.
    exact = x.astype(np.float64) @ values[0].T.astype(np.float64)
    step = np.repeat(amax[..., 0] / 127.0, block, axis=1) * (0.5 + 127 * 2.0**-11)
    bound = step @ np.abs(values[0]).T + np.abs(min_shift)
    self.assertTrue(np.all(np.abs(got - exact) <= bound + 1e-5 * np.abs(exact).max()))
    self.assertGreater(np.abs(got - exact).max(), 0.0)   # the rows were rounded

  @parameterized.parameters(*_INT8_TYPES)
  def test_int8_rows_that_int8_holds_exactly_give_the_exact_products(self, type_name):
    # Integer rows in [-127, 127] whose every 256-value run holds +-127 have scale 1 and round
    # to themselves, so the integer path must give the float64 products.
    width = _WIDTH[type_name]
    values, fields = _tensor(type_name, (1, 64, width), seed=8, max_scale=0.01)
    x = np.random.default_rng(9).integers(-127, 128, (2, width)).astype(np.float32)
    x[:, ::32] = 127.0
    want = x.astype(np.float64) @ values[0].T.astype(np.float64)
    got = _call(x, np.zeros(2), type_name, fields, int8=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())

  @parameterized.product(int8=(False, True), rows_native=(
      (1, True), (quantized.NATIVE_ROWS, True), (quantized.NATIVE_ROWS + 1, False)))
  def test_a_projection_takes_the_kernel_for_decode_rows(self, int8, rows_native):
    # Decode and verify rows go to the kernel on XLA:CPU; a prefill's rows keep XLA's GEMM
    # (with int8 rows too: even on K-quants, faster on 32-value blocks and small matrices).
    rows, native_call = rows_native
    named = _q4k_fields()
    x = jax.ShapeDtypeStruct((rows, 256), jnp.float32)
    text = jax.jit(quantized.contract, static_argnums=(1, 3)).lower(
        x, "Q4_K", named, int8).as_text()
    self.assertEqual("mtpjax_quant_matvec" in text, native_call)

  @parameterized.parameters(False, True)
  def test_a_decode_step_takes_the_kernel_at_any_row_count(self, int8):
    # A decode or verify step's rows keep one path past NATIVE_ROWS (MTP on equals off).
    named = _q4k_fields()
    x = jax.ShapeDtypeStruct((quantized.NATIVE_ROWS + 1, 256), jnp.float32)
    kernels = backend.Kernels("native", "cpu")
    lowered = lambda kernels: jax.jit(
        lambda x, f: quantized.contract(x, "Q4_K", f, int8, kernels)).lower(x, named).as_text()
    self.assertNotIn("mtpjax_quant_matvec", lowered(kernels))
    self.assertIn("mtpjax_quant_matvec", lowered(kernels.for_steps()))

  @parameterized.parameters(
      # rows per head: up to NATIVE_ROWS float32 rows, any number of int8 rows
      ("Q4_K", False, quantized.NATIVE_ROWS, True),
      ("Q4_K", False, quantized.NATIVE_ROWS + 1, False),
      ("Q4_K", True, 600, True), ("Q6_K", True, 600, True),
      # Q2_K keeps float32 rows in the kernel, so a prefill's stay with XLA
      ("Q2_K", True, quantized.NATIVE_ROWS, True),
      ("Q2_K", True, quantized.NATIVE_ROWS + 1, False))
  def test_per_head_matrices_take_the_kernel_for_any_int8_rows(self, type_name, int8, rows,
                                                               native_call):
    self.assertTrue(native.integer_rows("Q4_K"))   # this machine's build has AVX2
    shape = (8, 64, 256)
    weight = quantized.QuantizedTensor.from_raw(type_name, random_valid_blocks(
        np.random.default_rng(10), type_name, shape), shape)
    weight.int8_activations = int8
    x = jax.ShapeDtypeStruct((rows, 8, 256), jnp.float32)
    text = jax.jit(quantized.contract_heads).lower(x, weight).as_text()
    self.assertEqual("mtpjax_quant_matvec" in text, native_call)

  def test_bad_matrix_ids_are_an_error_not_a_read_out_of_bounds(self):
    _, fields = _tensor("Q8_0", (2, 8, 64), seed=11)
    with self.assertRaisesRegex(Exception, "matrix id out of range"):
      _call(np.ones((1, 64)), np.array([2]), "Q8_0", fields)


class BenchKernelTest(absltest.TestCase):

  def test_prints_every_matrix_row_count_and_row_kind_in_one_json_line(self):
    run = subprocess.run(
        [sys.executable, "-m", "tools.bench_kernel", "--matrices=Q8_0:64x64,Q4_K:32x256",
         "--rows=1,3", "--calls=2", "--repeats=1"],
        cwd=_REPO, capture_output=True, text=True,
        timeout=600)
    self.assertEqual(run.returncode, 0, run.stderr[-3000:])
    calls = json.loads(run.stdout.strip().splitlines()[-1])["calls"]
    self.assertEqual(set(calls), {"Q8_0:64x64_rows1", "Q8_0:64x64_rows3", "Q4_K:32x256_rows1",
                                  "Q4_K:32x256_rows3"})
    for timings in calls.values():
      self.assertEqual(set(timings), {f"{rows}_rows_{unit}" for rows in ("int8", "float32")
                                      for unit in ("us", "ns_per_32_weights_per_row",
                                                   "weight_gb_s")})
      self.assertTrue(all(value > 0 for value in timings.values()), timings)

  def test_a_width_that_is_not_whole_blocks_is_a_usage_error(self):
    run = subprocess.run(
        [sys.executable, "-m", "tools.bench_kernel", "--matrices=Q4_K:32x64"],
        cwd=_REPO, capture_output=True, text=True,
        timeout=300)
    self.assertNotEqual(run.returncode, 0)
    self.assertIn("not a multiple of Q4_K's 256-value blocks", run.stderr)


# A fresh process: the portable path (built without AVX2) against gguf-py's values, float32
# and int8 rows (which it keeps in float32), and the model's logits with the kernel off.
_PORTABLE_CHECK = """
import numpy as np, jax.numpy as jnp
from gguf import quants
from gguf.constants import GGMLQuantizationType
from mtpjax.gguf import quant_blocks
from mtpjax.kernels import native
from mtpjax.testing.random_blocks import random_valid_blocks
assert native.available()
assert not any(map(native.integer_rows, native.TYPE_NAMES))   # no integer path to prefer
for name in native.TYPE_NAMES:
  width = 64 if quant_blocks.block_size(name) == 32 else 256
  raw = random_valid_blocks(np.random.default_rng(0), name, (16, width))
  want = quants.dequantize(raw, GGMLQuantizationType[name]).reshape(16, width)
  f = quant_blocks.unpack(name, raw, (16, width))
  fields = [jnp.asarray(f[n])[None] for n in quant_blocks.field_specs(name, (16, width))]
  for int8 in (False, True):
    got = native.quant_matvec(jnp.eye(width), jnp.zeros(width, jnp.int32), name, fields, int8)
    np.testing.assert_array_equal(np.asarray(got).T, want, err_msg=name)
print("portable ok")
"""


# A fresh process built for AVX2 alone (no VNNI, no AVX-512: 256-bit runs, maddubs then madd):
# its int8 products, which this CPU's build may make with VNNI's fused multiply-adds and
# K-quant runs in 512-bit pairs.
_AVX2_INT8 = """
import numpy as np, jax.numpy as jnp
from mtpjax.kernels import native
assert native.available()
data = np.load({inputs!r})
out = {{}}
for name in {types!r}:
  fields = [jnp.asarray(data[f"{{name}}/{{i}}"]) for i in range(int(data[f"{{name}}/n"]))]
  out[name] = np.asarray(native.quant_matvec(jnp.asarray(data["x"]), jnp.asarray(data["ids"]),
                                             name, fields, True))
np.savez({outputs!r}, **out)
"""


class NativeBuildTest(absltest.TestCase):
  """Fresh processes, since a process builds and registers the kernel once."""

  def _run_fresh(self, code, **env) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as cache:
      return subprocess.run(
          [sys.executable, "-c", code],
          env={**os.environ, "MTPJAX_CACHE_DIR": cache, "JAX_PLATFORMS": "cpu", **env},
          capture_output=True, text=True, timeout=300, check=True)

  def _available_in_a_fresh_process(self, **env) -> tuple[bool, str]:
    run = self._run_fresh("from mtpjax.kernels import native; print(native.available())", **env)
    return run.stdout.strip() == "True", run.stderr

  def test_the_portable_path_reads_the_exact_values(self):
    machine = os.uname().machine
    self.assertIn(machine, ("x86_64", "aarch64", "arm64"))
    arch = "x86-64" if machine == "x86_64" else "armv8-a"
    self.assertIn("portable ok", self._run_fresh(_PORTABLE_CHECK, MTPJAX_NATIVE_MARCH=arch).stdout)

  def test_an_avx2_build_gives_the_same_int8_products_bit_for_bit(self):
    # Integer sums are the same whichever instructions add them (the pairs' 16 lanes fold to
    # the runs' 8), and a row's float arithmetic is the same: so VNNI and AVX-512 builds (where
    # this CPU has them) equal the AVX2 build, which a CPU without them runs. 19 rows over two
    # matrices (12 and 7: passes of 8, 4 and 7 rows). Off x86 (no AVX2) the other build is the
    # portable one, as `test_the_portable_path_reads_the_exact_values` picks it.
    machine = os.uname().machine
    self.assertIn(machine, ("x86_64", "aarch64", "arm64"))
    other = "haswell" if machine == "x86_64" else "armv8-a"
    x = np.random.default_rng(21).standard_normal((19, 512)).astype(np.float32)
    ids = np.random.default_rng(22).integers(0, 2, len(x)).astype(np.int32)
    with tempfile.TemporaryDirectory() as out:
      arrays = {"x": x, "ids": ids}
      here = {}
      for type_name in _INT8_TYPES:
        _, fields = _tensor(type_name, (2, 96, 512), seed=23, max_scale=0.01)
        arrays[f"{type_name}/n"] = np.array(len(fields))
        arrays.update({f"{type_name}/{i}": np.asarray(f) for i, f in enumerate(fields)})
        here[type_name] = _call(x, ids, type_name, fields, True)
      np.savez(f"{out}/in.npz", **arrays)
      self._run_fresh(_AVX2_INT8.format(inputs=f"{out}/in.npz", types=_INT8_TYPES,
                                        outputs=f"{out}/avx2.npz"), MTPJAX_NATIVE_MARCH=other)
      avx2 = np.load(f"{out}/avx2.npz")
      for type_name in _INT8_TYPES:
        np.testing.assert_array_equal(avx2[type_name], here[type_name], err_msg=type_name)

  def test_no_compiler_falls_back_with_a_warning(self):
    available, log = self._available_in_a_fresh_process(CXX="/bin/false")
    self.assertFalse(available)
    self.assertIn("native CPU kernels unavailable", log)

  def test_a_cached_build_that_does_not_load_is_built_again_and_old_builds_pruned(self):
    run = self._run_fresh(
        "import os, time\n"
        "from mtpjax.kernels import native\n"
        "path = native.library_path()\n"
        "path.parent.mkdir(parents=True, exist_ok=True)\n"
        "path.write_bytes(b'not a library')\n"
        "old, recent = path.parent / 'quant_matvec-old.so', path.parent / 'quant_matvec-new.so'\n"
        "for build, age in ((old, 60 * 86400), (recent, 86400)):\n"
        "  build.write_bytes(b'x'); os.utime(build, (time.time() - age,) * 2)\n"
        "print(native.available(), old.exists(), recent.exists(), path.stat().st_size > 1000)")
    self.assertEqual(run.stdout.split(), ["True", "False", "True", "True"], run.stderr)
    self.assertIn("do not load", run.stderr)

  def test_int8_rows_asked_for_without_the_kernel_are_a_typed_error(self):
    # Float32 rows in their place would give other tokens than a machine with the kernel:
    # asked for, that is refused; by default it is a warning and float32 rows.
    path = FIXTURES / "glm4moe-tiny" / "glm4moe_h64-Q8_0.gguf"
    run = self._run_fresh(
        "import mtpjax\nfrom mtpjax import errors\n"
        f"path = {str(path)!r}\n"
        "try:\n  mtpjax.load(path, int8_activations=True)\n"
        "except errors.MtpjaxError as e:\n  print('refused', e.field)\n"
        "print('default', mtpjax.load(path).int8_activations)", MTPJAX_NATIVE="0")
    self.assertEqual(run.stdout.splitlines(), ["refused model.int8_activations", "default False"])
    self.assertIn("int8 rows cannot run here", run.stderr)

  def test_the_compiler_is_part_of_the_build_key(self):
    with tempfile.TemporaryDirectory() as folder:
      other = pathlib.Path(folder) / "other-g++"
      other.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "other 1.0" && exit 0\n'
                       'exec g++ "$@"\n')
      other.chmod(0o755)
      key = "from mtpjax.kernels import native; print(native.library_path().name)"
      self.assertNotEqual(self._run_fresh(key).stdout, self._run_fresh(key, CXX=str(other)).stdout)

  def test_switched_off_by_the_environment_a_model_keeps_its_logits(self):
    available, _ = self._available_in_a_fresh_process(MTPJAX_NATIVE="0")
    self.assertFalse(available)
    # XLA's paths (the fused loop's and tiles' exact values) against the kernel's, on the
    # llama.cpp-made fixture: the same logits up to float rounding (float32 rows both ways:
    # XLA's paths have no int8 rows).
    path = FIXTURES / "glm4moe-tiny" / "glm4moe_h64-Q8_0.gguf"
    ids = np.load(FIXTURES / "glm4moe-tiny" / "hf_ref.npz")["token_ids"][:12]
    with tempfile.TemporaryDirectory() as out:
      self._run_fresh(
          f"import mtpjax, numpy as np; np.save({out!r} + '/l.npy', "
          f"mtpjax.load({str(path)!r}, int8_activations=False).logits(np.array({ids.tolist()})))",
          MTPJAX_NATIVE="0")
      xla = np.load(f"{out}/l.npy")
    np.testing.assert_allclose(xla, mtpjax.load(path, int8_activations=False).logits(ids),
                               rtol=0, atol=1e-4)


if __name__ == "__main__":
  absltest.main()
