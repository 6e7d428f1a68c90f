"""Real-shape synthetic models and the scale tools (make_synthetic, bench_memory,
bench_vs_llamacpp, join_gguf), at small dimensions of the same shape families.

References are independent of the code under test: the tensor names and key/values of the
fixtures llama.cpp's own converter wrote, the real gguf reader, parameter counts worked out by
hand from the published dimensions, and a captured `llama-bench -o json` output.
"""

import inspect
import math
import pathlib
import re
import tempfile

import gguf
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

import mtpjax
from mtpjax.embedded import DEMO_PACKAGE
from mtpjax.package.reader import open_source
from mtpjax.package.writer import join_gguf
from mtpjax.testing.glm_variants import VARIANTS, with_dims
from mtpjax.testing.synthetic_glm import REAL_LAYERS_KEY, VARIANT_KEY, write_synthetic_gguf
from tools import llama_cpp, weight_bytes

from fixtures import FIXTURES

# Small dims that keep every family's structure (MLA ranks, GQA heads, indexer, experts).
SMALL = {"hidden": "256", "n_heads": "4", "ffn": "512", "expert_ffn": "256", "n_experts": "8",
         "n_experts_used": "2", "vocab_size": "1024"}
SMALL_GQA = {"head_dim": "64", "n_kv_heads": "2", "rope_dims": "32"}
SMALL_MLA = {"q_lora": "256", "kv_lora": "256", "qk_nope": "64", "qk_rope": "32", "v_head": "64",
             "indexer_heads": "2", "indexer_dim": "64", "index_topk": "8"}

# (variant, the fixture llama.cpp's converter wrote for its arch: 3 trunk layers, 1 dense, + NextN)
FAMILIES = (("glm-4.5", "glm4moe-tiny/glm4moe_h64-F32.gguf"),
            ("glm-4.7-flash", "glm4moelite-tiny/glm4moelite_h64-F32.gguf"),
            ("glm-5", "glmdsa-tiny/glmdsa_h64-F32.gguf"))


def small(name: str, **extra: str):
  variant = VARIANTS[name]
  return with_dims(variant, {**SMALL, **(SMALL_MLA if variant.is_mla else SMALL_GQA),
                             "leading_dense": "1", **extra})


def _dense_kwargs() -> dict:
  """weights="dense" where this build's loader has the switch (dense is the only mode before)."""
  return {"weights": "dense"} if "weights" in inspect.signature(mtpjax.load).parameters else {}


def _layer_roles(reader: gguf.GGUFReader) -> dict[str, set[str]]:
  """'top' -> non-block tensor names; 'blk.N' -> that block's tensor suffixes."""
  roles: dict[str, set[str]] = {}
  for tensor in reader.tensors:
    match = re.fullmatch(r"(blk\.\d+)\.(.+)", tensor.name)
    key, suffix = (match.group(1), match.group(2)) if match else ("top", tensor.name)
    roles.setdefault(key, set()).add(suffix)
  return roles


class SyntheticGgufTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = pathlib.Path(
        cls.enterClassContext(tempfile.TemporaryDirectory(prefix="synthetic_tools_test.")))
    cls.paths = {}
    for name, _ in FAMILIES:
      cls.paths[name] = cls.tmp / f"{name}.gguf"
      write_synthetic_gguf(cls.paths[name], small(name), 3, tensor_type="Q4_K")

  @parameterized.parameters(*FAMILIES)
  def test_names_and_keys_match_llama_cpp_converter(self, name, fixture):
    """Same tensor names per block and same key set as llama.cpp's converter writes."""
    ours = gguf.GGUFReader(self.paths[name])
    reference = gguf.GGUFReader(FIXTURES / fixture)
    self.assertEqual(_layer_roles(ours), _layer_roles(reference))
    synthetic_keys = {VARIANT_KEY, REAL_LAYERS_KEY}
    self.assertEqual(set(ours.fields) - synthetic_keys, set(reference.fields))
    arch = reference.fields["general.architecture"].contents()
    for key in ("block_count", "nextn_predict_layers", "leading_dense_block_count",
                "expert_gating_func"):
      self.assertEqual(ours.fields[f"{arch}.{key}"].contents(),
                       reference.fields[f"{arch}.{key}"].contents(), key)
    self.assertEqual(ours.fields[REAL_LAYERS_KEY].contents(), VARIANTS[name].real_layers)
    self.assertEqual(ours.fields[VARIANT_KEY].contents(), name)

  @parameterized.parameters(*FAMILIES)
  def test_quantized_blocks_are_finite_and_scaled(self, name, _):
    reader = gguf.GGUFReader(self.paths[name])
    types = set()
    for tensor in reader.tensors:
      values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
      self.assertTrue(np.isfinite(values).all(), tensor.name)
      types.add(tensor.tensor_type.name)
      if tensor.tensor_type.name != "Q4_K":
        continue
      if tensor.name.endswith(("token_embd.weight", "embed_tokens.weight")):
        std = 1.0                     # unit embeddings
      else:                           # N(0, gain^2 / fan_in); logits with std ~2
        head = tensor.name == "output.weight" or tensor.name.endswith("shared_head_head.weight")
        std = (2.0 if head else 1.0) / math.sqrt(int(tensor.shape[0]))
      self.assertBetween(float(values.std()) / std, 0.7, 1.4, tensor.name)
    self.assertIn("Q4_K", types)
    self.assertIn("F32", types)   # norms, biases and the router stay F32 (llama.cpp's policy)

  def test_loads_and_decodes(self):
    # float32 rows: the dense model below has no int8 rows to compare with.
    model = mtpjax.load(str(self.paths["glm-4.7-flash"]), int8_activations=False)
    self.assertTrue(model.has_mtp)
    logits = model.logits(np.arange(6))
    self.assertEqual(logits.shape, (6, 1024))
    self.assertTrue(np.isfinite(logits).all())
    self.assertLen(model.generate(np.arange(6), max_new_tokens=3).tokens, 3)
    # MLA's per-head attn_k_b (Q8_0 here) and attn_v_b (Q4_K) stay in their GGUF blocks and
    # compute what the float32 values dequantized at load compute.
    graphdef, state = model.weights(with_mtp=True)
    attn = nnx.merge(graphdef, state).layers[1].attn
    self.assertEqual((attn.wk_b.weight.type_name, attn.wv_b.weight.type_name), ("Q8_0", "Q4_K"))
    dense = mtpjax.load(str(self.paths["glm-4.7-flash"]), weights="dense")
    np.testing.assert_allclose(logits, dense.logits(np.arange(6)), rtol=0,
                               atol=1e-4 * np.abs(logits).max())


class BenchMemoryTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = pathlib.Path(
        cls.enterClassContext(tempfile.TemporaryDirectory(prefix="bench_memory_test.")))
    path = cls.tmp / "air.gguf"
    write_synthetic_gguf(path, small("glm-4.5-air"), 2, tensor_type="F16")
    model = mtpjax.load(str(path), dtype="float32", **_dense_kwargs())
    cls.report = weight_bytes.report(model, weight_bytes.measure(model), 0.15, kv_bytes=2,
                                     utilization=0.9)

  def test_device_bytes_per_type(self):
    """Dense float32 on the device: F16 tensors take twice their GGUF bytes, F32 the same."""
    per_type = self.report["per_type"]
    self.assertEqual(set(per_type), {"F16", "F32"})
    self.assertEqual(per_type["F16"]["device_over_gguf"], 2.0)
    self.assertEqual(per_type["F32"]["device_over_gguf"], 1.0)
    self.assertEqual(self.report["unmatched_device_bytes"], 0)
    self.assertEqual(self.report["real_block_count"], 46)

  def test_extrapolation_matches_hand_count(self):
    """GLM-4.5-Air and GLM-4.7-Flash at their real depth, counted by hand from their configs:
    in float32 each parameter takes 4 bytes on the device; in the F16 file the matrices take 2,
    norms, biases and the router (F32 in llama.cpp's policy) 4."""
    # GLM-4.5-Air: D 4096, 96 heads x 128, 8 KV heads, vocab 151552, dense ffn 10944,
    # 128 experts of 1408 + 1 shared, 46 layers (1 dense) + NextN.
    D, V, q, kv = 4096, 151552, 96 * 128, 8 * 128
    attn_mat = q * D + 2 * kv * D + D * q
    attn_f32 = q + 2 * kv + 2 * D                         # q/k/v biases, two norms
    moe_mat, moe_f32 = 3 * 128 * 1408 * D + 3 * 1408 * D, 128 * D + 128
    dense_mat = 3 * D * 10944
    nextn_mat = 2 * D * D + V * D + attn_mat + moe_mat     # eh_proj, shared head
    nextn_f32 = 3 * D + attn_f32 + moe_f32                 # enorm, hnorm, shared_head_norm
    mat = 2 * V * D + nextn_mat + dense_mat + attn_mat + 45 * (attn_mat + moe_mat)
    f32 = D + nextn_f32 + 46 * attn_f32 + 45 * moe_f32
    air = self.report["extrapolated"]["glm-4.5-air"]
    self.assertAlmostEqual(air["device_gb"], 4 * (mat + f32) / 1e9, places=6)
    self.assertAlmostEqual(air["gguf_gb"], (2 * mat + 4 * f32) / 1e9, places=6)
    self.assertEqual(air["fits"], {"h200": False, "tpu_v5e_8": False, "tpu_v6e_8": False})

    # GLM-4.7-Flash: D 2048, 20 heads, MLA q_lora 768, kv_lora 512, nope 192, rope 64, v 256,
    # vocab 154880, dense ffn 10240, 64 experts of 1536 + 1 shared, 47 layers (1 dense) + NextN
    # (with its own embedding, no shared head).
    D, V, H = 2048, 154880, 20
    attn = (768 * D + 768 + H * 256 * 768 + (512 + 64) * D + 512 + H * 512 * 192
            + H * 256 * 512 + D * H * 256 + 2 * D)          # + attn_norm, ffn_norm
    moe = 3 * 64 * 1536 * D + 64 * D + 64 + 3 * 1536 * D
    params = (2 * V * D + D + (attn + 3 * D * 10240) + 46 * (attn + moe)
              + (2 * D * D + V * D + 3 * D + attn + moe))
    flash = self.report["extrapolated"]["glm-4.7-flash"]
    self.assertAlmostEqual(flash["device_gb"], 4 * params / 1e9, places=6)
    # ~125 GB: over 85% of an H200 (119.85 GB) and of a v5e-8 (108.8), under a v6e-8's (217.6).
    self.assertEqual(flash["fits"], {"h200": False, "tpu_v5e_8": False, "tpu_v6e_8": True})

  def test_kv_cache_per_token_matches_hand_count(self):
    """Bytes a token takes in the pools (bfloat16 K/V, the float32 model's MTP history row and
    token id), and the tokens that fit beside the float32 weights in 90% of each target."""
    extrapolated = self.report["extrapolated"]
    # GLM-4.5-Air: 46 layers of 8 KV heads x (128 keys + 128 values); NextN the same, history
    # a 4096-wide float32 row and an int32 token.
    self.assertEqual(extrapolated["glm-4.5-air"]["kv_bytes_per_token"],
                     {"trunk": 46 * 2048 * 2, "mtp": 2048 * 2 + 4096 * 4 + 4,
                      "total": 47 * 2048 * 2 + 4096 * 4 + 4})
    # GLM-4.7-Flash: 47 layers of one 512 + 64 latent row; GLM-5 adds its 128-wide indexer key.
    flash = extrapolated["glm-4.7-flash"]
    self.assertEqual(flash["kv_bytes_per_token"]["total"], 48 * 576 * 2 + 2048 * 4 + 4)
    self.assertEqual(extrapolated["glm-5"]["kv_bytes_per_token"]["trunk"], 78 * 704 * 2)
    per_token = 48 * 576 * 2 + 2048 * 4 + 4
    want = {target: max(0, int((0.9 * capacity - flash["device_gb"] * 1e9) // per_token))
            for target, capacity in (("h200", 141e9), ("tpu_v5e_8", 128e9),
                                     ("tpu_v6e_8", 256e9))}
    self.assertEqual(flash["kv_tokens"], want)
    self.assertGreater(want["tpu_v6e_8"], 32768)
    # GLM-4.5-Air in float32 (~440 GB) fits nowhere: no room for any cache.
    self.assertEqual(extrapolated["glm-4.5-air"]["kv_tokens"],
                     {"h200": 0, "tpu_v5e_8": 0, "tpu_v6e_8": 0})
    self.assertEqual(flash["sequences_of_32768"],
                     {target: n // 32768 for target, n in want.items()})


# Captured from `llama-bench -m demo.gguf -p 512 -n 128 -t 1 -r 2 -o json` (llama.cpp 0c1e570,
# the demo package joined into one Q8_0 GGUF); fields the parser ignores are left out.
_LLAMA_BENCH_SAMPLE = """[
  {"build_commit": "0c1e570", "model_type": "glm4moe ?B Q8_0", "model_size": 7856256,
   "n_threads": 1, "n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ns": 145820659,
   "stddev_ns": 5067909, "avg_ts": 3513.284089, "stddev_ts": 122.102074,
   "samples_ns": [ 142237106, 149404212 ], "samples_ts": [ 3599.62, 3426.94 ]},
  {"build_commit": "0c1e570", "model_type": "glm4moe ?B Q8_0", "model_size": 7856256,
   "n_threads": 1, "n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ns": 88781805,
   "stddev_ns": 10494813, "avg_ts": 1451.880693, "stddev_ts": 171.625453,
   "samples_ns": [ 96202759, 81360851 ], "samples_ts": [ 1330.52, 1573.24 ]}
]"""

# Captured from `llama-bench -m demo.gguf -p 0 -n 4 -d 0,16 -t 1 -r 2 -o json` (the same build
# and GGUF): a decode after a context of 16 tokens (`-d`, bench_context --llama_bench).
_LLAMA_BENCH_DEPTH_SAMPLE = """[
  {"build_commit": "0c1e570", "model_type": "glm4moe ?B Q8_0", "n_threads": 1, "type_k": "f16",
   "n_prompt": 0, "n_gen": 4, "n_depth": 0, "avg_ns": 3740993, "avg_ts": 1425.072857,
   "samples_ts": [ 2137.18, 712.967 ]},
  {"build_commit": "0c1e570", "model_type": "glm4moe ?B Q8_0", "n_threads": 1, "type_k": "f16",
   "n_prompt": 0, "n_gen": 4, "n_depth": 16, "avg_ns": 3293873, "avg_ts": 1873.014336,
   "samples_ts": [ 2983.71, 762.321 ]}
]"""

# The end of `llama-speculative-simple ... --spec-type draft-mtp --spec-draft-n-max 3` (stderr,
# llama.cpp 0c1e570, the demo joined into one Q8_0 GGUF); perf lines after it left out.
_SPECULATIVE_SAMPLE = """0.00.103.274 I common_speculative_init_result: creating MTP draft context
0.00.257.838 I encoded   20 tokens in    0.009 seconds, speed: 2128.112 t/s
0.00.257.850 I decoded   67 tokens in    0.139 seconds, speed:  482.921 t/s
0.00.257.857 I
0.00.257.863 I n_draft   = 3
0.00.257.869 I n_predict = 67
0.00.257.875 I n_drafted = 76
0.00.257.881 I n_accept  = 41
0.00.257.888 I accept    = 53.947%
0.00.257.894 I
0.00.257.900 I draft:
"""


class BenchVsLlamaCppTest(absltest.TestCase):

  def test_parses_the_speculative_counters(self):
    self.assertEqual(llama_cpp.parse_speculative(_SPECULATIVE_SAMPLE),
                     {"n_draft": 3, "n_predict": 67, "n_drafted": 76, "n_accept": 41})

  def test_a_log_without_the_counters_is_refused(self):
    cut = _SPECULATIVE_SAMPLE[:_SPECULATIVE_SAMPLE.index("0.00.257.875")]
    with self.assertRaisesRegex(ValueError, "lacks n_drafted, n_accept"):
      llama_cpp.parse_speculative(cut)

  def test_parses_llama_bench_json(self):
    self.assertEqual(llama_cpp.parse_llama_bench(_LLAMA_BENCH_SAMPLE),
                     {("pp512", 1): 3513.284089, ("tg128", 1): 1451.880693})

  def test_parses_a_decode_after_a_context(self):
    self.assertEqual(llama_cpp.parse_llama_bench(_LLAMA_BENCH_DEPTH_SAMPLE),
                     {("tg4", 1): 1425.072857, ("tg4 @ d16", 1): 1873.014336})

  def test_gguf_bytes_per_token_by_hand(self):
    """glm4moe-tiny F32 (hidden 64, 4/2 heads x 32, 3 layers: 1 dense (ffn 128) + 2 MoE with
    8 experts of 32, top-2, 1 shared; vocab 512): a token reads the head, the final norm and
    the trunk with 2 of 8 experts; not token_embd, not the NextN block."""
    attn = 64 + 128 * 64 + 128 + 2 * (64 * 64 + 64) + 64 * 128 + 2 * 32 + 64
    moe = 3 * 8 * 32 * 64 * 2 // 8 + 8 * 64 + 8 + 3 * 32 * 64
    elements = 512 * 64 + 64 + 3 * attn + 3 * 64 * 128 + 2 * moe
    self.assertEqual(llama_cpp.gguf_bytes_per_token(
        str(FIXTURES / "glm4moe-tiny/glm4moe_h64-F32.gguf")), 4 * elements)


class JoinGgufTest(absltest.TestCase):

  def test_demo_package_joins_into_one_gguf(self):
    with tempfile.TemporaryDirectory() as tmp:
      joined = join_gguf(DEMO_PACKAGE, pathlib.Path(tmp) / "demo.gguf")
      reader = gguf.GGUFReader(joined)
      with open_source(DEMO_PACKAGE) as package:
        self.assertEqual({t.name for t in reader.tensors}, set(package.tensors))
        for tensor in reader.tensors:
          self.assertEqual(tensor.data.tobytes(), package.raw(tensor.name).tobytes(), tensor.name)
        self.assertEqual(reader.fields["general.architecture"].contents(), package.arch)


if __name__ == "__main__":
  absltest.main()
