"""Models loaded with weights="quantized": the llama.cpp fixtures, MTP, checkpoints, sharding.

References: llama.cpp's logits on the same GGUF bytes (argmax), the same file loaded from its
GGUF and from its checkpoint, the GGUF's own tensor byte counts (read with the real `gguf`
library) and MTP off.
"""

import pathlib
import tempfile

import gguf
import jax
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

import mtpjax
from configs import glm
from mtpjax import checkpoint, errors, loading, sharding
from mtpjax.convert import convert
from mtpjax.draft_window import DraftWindow
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.models import quantized
from mtpjax.models.interface import StageLayout
from mtpjax.models.quantized import QuantizedTensor
from fixtures import FIXTURES

FIXTURE = FIXTURES / "glm4moe-tiny"
IDS = np.load(FIXTURE / "hf_ref.npz")["token_ids"]


def _agreement(a, b) -> float:
  return float(np.mean(a.argmax(-1) == b.argmax(-1)))


def _gguf_tensor_bytes(path) -> int:
  return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


class QuantizedFixtureTest(parameterized.TestCase):

  @parameterized.product(qtype=("Q8_0", "Q4_K_M"), int8_activations=(None, False))
  def test_agrees_with_llama_cpp_within_the_byte_budget(self, qtype, int8_activations):
    # The default, llama.cpp's CPU arithmetic: every row rounded to int8 per block in the bits
    # llama.cpp's Q8 vectors keep (on XLA:CPU the native kernel's integer path, prefill
    # included) over its float16 KV cache ("auto" resolves to it; over a float32 cache the
    # int8 rows flip near-ties: 22 of 24 MTP positions on Q8_0). And the exact float32 rows
    # over a float32 cache.
    path = FIXTURE / f"glm4moe_h64-{qtype}.gguf"
    llama = np.load(FIXTURE / f"llama_{qtype}.npz")
    model = mtpjax.load(path, weights="quantized", int8_activations=int8_activations)
    self.assertEqual(model.kv_cache_name("auto"),
                     "auto" if int8_activations is False else "float16")
    logits = model.logits(IDS)
    mtp = model.mtp_logits(IDS)
    self.assertTrue(model.mtp_head_loaded)
    self.assertGreaterEqual(_agreement(logits, llama["logits"]), 0.95)
    self.assertGreaterEqual(_agreement(mtp, llama["mtp_logits"]), 0.95)
    # Every parameter the GGUF holds quantized is on the device as integers + scales, and the
    # whole model (MTP head included) takes at most 1.25x the file's tensor bytes.
    by_type = model.weight_bytes_by_type()
    device = sum(entry[0] for entry in by_type.values())
    self.assertLessEqual(device / _gguf_tensor_bytes(path), 1.25, by_type)
    for name, (device_bytes, gguf_bytes) in by_type.items():
      if gguf_bytes is not None:
        self.assertLessEqual(device_bytes, 1.04 * gguf_bytes, name)
    self.assertEqual(set(by_type), {"float32", "Q8_0"} if qtype == "Q8_0"
                     else {"float32", "Q8_0", "Q5_0", "Q5_1"})

  @parameterized.parameters((False, "auto"), (True, "auto"), (True, "float32"))
  def test_mtp_on_equals_off_greedy_and_sampled(self, int8_activations, kv_cache_dtype):
    # The float32 rows, llama.cpp's arithmetic (the default: int8 rows, a float16 cache), and
    # int8 rows over a float32 cache.
    model = mtpjax.load(FIXTURE / "glm4moe_h64-Q4_K_M.gguf", weights="quantized",
                        int8_activations=int8_activations)
    prompt = IDS[:12]
    for sampling in (dict(temperature=0.0), dict(temperature=0.9, top_k=40, seed=7)):
      off = model.generate(prompt, max_new_tokens=12, speculative="disabled",
                           kv_cache_dtype=kv_cache_dtype, **sampling)
      on = model.generate(prompt, max_new_tokens=12, speculative="native-mtp-n1",
                          adaptive_drafting=False, kv_cache_dtype=kv_cache_dtype, **sampling)
      self.assertEqual(on.tokens, off.tokens, sampling)
      self.assertGreater(on.stats.drafted, 0)

  def test_mtp_on_equals_off_when_a_step_holds_more_rows_than_native_rows(self):
    # 36 slots verifying a draft each: 72 rows a matrix in one step, past NATIVE_ROWS (where
    # a prefill's rows leave the native kernel), against one row a slot with MTP off. With
    # int8 rows a switch of path there changes the arithmetic, not only its rounding: without
    # the steps' kernels (`Kernels.for_steps`) the tokens differ.
    slots = quantized.NATIVE_ROWS // 2 + 4
    model = mtpjax.load(FIXTURE / "glm4moe_h64-Q4_K_M.gguf", weights="quantized",
                        int8_activations=True)
    prompts = [np.take(IDS, range(i, i + 3), mode="wrap") for i in range(slots)]
    requests = [Request(prompt=np.asarray(p, np.int32), max_new_tokens=4) for p in prompts]
    tokens = {}
    for native_mtp in (False, True):
      engine = model.engine(native_mtp=native_mtp, slots=slots, max_len=16)
      window = DraftWindow.fixed(1) if native_mtp else None
      results = SlotScheduler(engine, adaptive=None, window=window).run(requests)
      tokens[native_mtp] = [r.tokens for r in results]
      if native_mtp:
        self.assertGreater(sum(r.stats.drafted for r in results), 0)
    self.assertEqual(tokens[True], tokens[False])

  def test_types_without_a_device_form_fall_back_to_dense_with_a_log_line(self):
    model = mtpjax.load(FIXTURE / "glm4moe_h64-Q8_0.gguf", weights="dense")
    layout = StageLayout.whole(model.config, mtp=False)
    types = {"blk.0.attn_q.weight": "IQ4_NL", "blk.0.attn_k.weight": "Q4_K",
             "blk.0.attn_norm.weight": "F32", "blk.1.ffn_up_exps.weight": "Q6_K",
             "token_embd.weight": "TQ2_0"}
    with self.assertLogs(level="INFO") as logs:
      formats = loading.weight_formats(types, model.config, layout, "quantized")
    self.assertEqual(formats, {("layers", 0, "attn", "wk", "weight"): "Q4_K",
                               ("layers", 1, "ffn", "experts", "up_exps"): "Q6_K"})
    fallbacks = [line for line in logs.output if "kept dense" in line]
    self.assertLen(fallbacks, 2)
    self.assertIn("blk.0.attn_q.weight", fallbacks[0] + fallbacks[1])
    self.assertEqual(loading.weight_formats(types, model.config, layout, "dense"), {})

  def test_int8_activations_from_the_config_reach_every_quantized_tensor(self):
    # configs/glm.py's switch (unset there and by default: int8 rows where the native kernel
    # runs them, as it does here), read by mtpjax.load; an explicit argument wins over it.
    config = glm.get_config()
    self.assertIsNone(config.model.int8_activations)
    path = FIXTURE / "glm4moe_h64-Q4_K_M.gguf"
    config.model.int8_activations = False
    for kwargs, want in ((dict(config=config), False),
                         (dict(config=config, int8_activations=True), True),
                         ({}, True), (dict(int8_activations=False), False)):
      model = mtpjax.load(path, **kwargs)
      graphdef, state = model.weights(with_mtp=model.has_mtp)
      tensors = [node for _, node in nnx.iter_graph(nnx.merge(graphdef, state))
                 if isinstance(node, QuantizedTensor)]
      self.assertNotEmpty(tensors)
      self.assertEqual({t.int8_activations for t in tensors}, {want}, kwargs.keys())

  def test_auto_kv_cache_is_float16_only_under_llama_cpp_arithmetic(self):
    # int8 rows against quantized weights (the default here) keep llama.cpp's float16 cache;
    # float32 rows, dense weights and a GGUF with no quantized tensor keep the activations'
    # dtype, and a named dtype is kept as named.
    for name, kwargs, want in (("Q4_K_M", {}, np.float16),
                               ("Q4_K_M", dict(int8_activations=False), np.float32),
                               ("Q8_0", dict(weights="dense"), np.float32),
                               ("F32", {}, np.float32)):
      model = mtpjax.load(FIXTURE / f"glm4moe_h64-{name}.gguf", **kwargs)
      self.assertEqual(model.engine(native_mtp=False, max_len=32).kv_dtype, want, (name, kwargs))
      self.assertEqual(model.engine(native_mtp=False, max_len=32, kv_cache_dtype="bfloat16"
                                    ).kv_dtype, jax.numpy.bfloat16)

  def test_bad_weights_value_is_a_typed_error(self):
    with self.assertRaisesRegex(errors.ConversionError, "weights"):
      mtpjax.load(FIXTURE / "glm4moe_h64-Q8_0.gguf", weights="int4")


class QuantizedCheckpointTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    cls.src = FIXTURE / "glm4moe_h64-Q4_K_M.gguf"
    cls.ckpt = convert(cls.src, pathlib.Path(cls.tmp.name) / "q", show_progress=False)
    # float32 rows: on a tensor mesh int8 rows are rounded from rows that differ by float
    # rounding, so a quantum moves and the logits differ by more than that rounding.
    cls.want = mtpjax.load(cls.src, int8_activations=False).logits(IDS)

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def test_round_trip_restores_the_quantized_form_exactly(self):
    record = checkpoint.read_record(self.ckpt)
    self.assertEqual(record["weights"], "quantized")
    stored = sum(f.stat().st_size for f in (self.ckpt / "parts").rglob("*") if f.is_file())
    self.assertLess(stored, 2 * _gguf_tensor_bytes(self.src))     # dense float32 is ~3.2x
    restored = mtpjax.load(self.ckpt, int8_activations=False)
    np.testing.assert_array_equal(restored.logits(IDS), self.want)
    wq = _module(restored, ("layers", 0, "attn", "wq", "weight"))
    self.assertIsInstance(wq, QuantizedTensor)
    self.assertEqual(wq.type_name, "Q5_0")

  def test_a_form_other_than_the_checkpoint_is_refused_with_the_remedy(self):
    with self.assertRaisesRegex(errors.CheckpointError, "holds quantized weights.*--weights"):
      mtpjax.load(self.ckpt, weights="dense")

  def test_restores_onto_a_tensor_mesh_keeping_whole_blocks(self):
    mesh = sharding.make_mesh(stages=1, tensor=2)
    restored = mtpjax.load(self.ckpt, mesh=mesh, int8_activations=False)
    np.testing.assert_allclose(restored.logits(IDS), self.want, atol=2e-4, rtol=0)
    wq = _module(restored, ("layers", 0, "attn", "wq", "weight"))   # [128, 64] Q5_0: out split
    self.assertEqual(wq.qs[...].sharding.spec, jax.sharding.PartitionSpec("tensor", None, None))
    wo = _module(restored, ("layers", 0, "attn", "wo", "weight"))   # [64, 128]: 4 blocks a row
    self.assertEqual(wo.d[...].sharding.spec, jax.sharding.PartitionSpec(None, "tensor"))
    self.assertEqual(wo.d[...].addressable_shards[0].data.shape, (64, 2))


class QuantizedShardingRulesTest(absltest.TestCase):

  def test_per_head_projections_split_by_head_dense_or_quantized(self):
    # MLA's attn_k_b / attn_v_b are [H, out, in] in GGUF layout either way (no transpose, unlike
    # a Linear), so both forms split their head axis; a Linear's quantized [out, n_blocks, 32]
    # splits out for an output-split role.
    spec = lambda *path, shape: sharding.param_spec(("layers", 1, "attn") + path, shape, 2)
    P = jax.sharding.PartitionSpec
    self.assertEqual(spec("wk_b", "weight", "qs", shape=(4, 256, 2, 32)),
                     P("tensor", None, None, None))
    self.assertEqual(spec("wv_b", "weight", "d", shape=(4, 64, 1)), P("tensor", None, None))
    self.assertEqual(spec("wv_b", "weight", shape=(4, 64, 256)), P("tensor", None, None))
    self.assertEqual(spec("wq_b", "weight", "qs", shape=(384, 1, 144)), P("tensor", None, None))


def _module(model, path):
  graphdef, state = model.weights(with_mtp=model.load_options.native_mtp)
  node = nnx.merge(graphdef, state)
  for key in path:
    node = node[key] if isinstance(key, int) else getattr(node, key)
  return node


if __name__ == "__main__":
  absltest.main()
