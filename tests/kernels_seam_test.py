"""The kernel seam (`mtpjax/kernels/backend.py`): one place picks the implementations, and
every backend's decode and verify rows get one arithmetic whatever their count.

MTP on must give MTP off's tokens on every backend (the mission's lossless promise). On
`native` that holds because every step row goes to the C++ kernel. The `xla` dispatch is what
GPUs and TPUs run; forced here on CPU, a step of 8 slots verifying a window of 3 (32 rows a
matrix, 8 rows a slot's experts) must give each row the value it has alone.
"""

import ast
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

import mtpjax
from mtpjax import errors
from mtpjax.configs import glm
from mtpjax.draft_window import DraftWindow
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.kernels import backend, native
from mtpjax.models import ffn, primitives, quantized

from fixtures import FIXTURES

PACKAGE = pathlib.Path(mtpjax.__file__).parent
MODELS = {"glm4moe": FIXTURES / "glm4moe-tiny" / "glm4moe_h64-Q4_K_M.gguf",
          "deepseek2": FIXTURES / "glm4moelite-tiny" / "glm4moelite_h64-Q4_K_M.gguf"}
IDS = np.load(FIXTURES / "glm4moe-tiny" / "hf_ref.npz")["token_ids"]
NEW_TOKENS = 10


def _requests(count: int) -> list[Request]:
  """`count` prompts of different lengths, greedy and sampled ones alternating (a batch mixes
  them, as a server's does)."""
  requests = []
  for i in range(count):
    prompt = np.take(IDS, range(3 * i, 3 * i + 4 + i % 3), mode="wrap").astype(np.int32)
    sampler = (SamplerParams(temperature=0.0) if i % 2 == 0 else
               SamplerParams(temperature=0.9, top_k=40, top_p=0.95, seed=11 + i))
    requests.append(Request(prompt=prompt, max_new_tokens=NEW_TOKENS, sampler=sampler))
  return requests


class ResolveTest(absltest.TestCase):

  def test_auto_is_native_on_a_cpu_where_the_kernels_build(self):
    self.assertEqual(jax.default_backend(), "cpu")
    want = "native" if native.available() else "xla"
    self.assertEqual(backend.resolve("auto"), backend.Kernels(want, "cpu"))
    self.assertEqual(backend.resolve(None).name, want)
    self.assertEqual(backend.resolve("xla"), backend.Kernels("xla", "cpu"))
    pallas = backend.resolve("pallas")
    self.assertEqual(pallas, backend.Kernels("pallas", "cpu"))
    self.assertTrue(pallas.interpret)            # no accelerator here: Pallas' interpreter

  def test_a_choice_that_cannot_run_is_a_typed_error_naming_the_field(self):
    for choice, words in (("cuda", "unknown kernels"), ("NATIVE", "unknown kernels")):
      with self.assertRaisesRegex(errors.MtpjaxError, words) as caught:
        backend.resolve(choice, field="engine.kernels")
      self.assertEqual(caught.exception.field, "engine.kernels")
      self.assertIn("auto", caught.exception.remedy)

  def test_load_takes_the_argument_over_the_config(self):
    config = glm.get_config()
    config.engine.kernels = "xla"
    model = mtpjax.load(MODELS["glm4moe"], config=config)
    self.assertEqual(model.kernels.name, "xla")
    self.assertFalse(model.int8_activations)      # float32 rows: no kernel multiplies int8
    self.assertEqual(mtpjax.load(MODELS["glm4moe"], config=config, kernels="auto").kernels,
                     backend.default())
    config.engine.kernels = "tpu"
    with self.assertRaisesRegex(errors.MtpjaxError, "engine.kernels"):
      mtpjax.load(MODELS["glm4moe"], config=config)

  def test_a_steps_graphdef_differs_only_in_its_kernels(self):
    model = mtpjax.load(MODELS["glm4moe"], kernels="xla")
    graphdef, state = model.weights(with_mtp=False)
    steps = quantized.for_steps(graphdef, state)
    self.assertEqual({node.kernels for node in nnx_nodes(steps, state)},
                     {backend.Kernels("xla", "cpu", steps=True)})
    self.assertEqual({node.kernels for node in nnx_nodes(graphdef, state)},
                     {backend.Kernels("xla", "cpu")})


def nnx_nodes(graphdef, state) -> list:
  """The modules of a model that carry kernels."""
  model = nnx.merge(graphdef, state)
  return [node for _, node in nnx.iter_graph(model)
          if isinstance(node, nnx.Module) and hasattr(node, "kernels")]


class NoOtherModuleAsksThePlatformTest(absltest.TestCase):

  def test_only_the_seam_reads_the_platform(self):
    # `jax.default_backend()` decides kernels only in kernels/backend.py, and no trace reads
    # an ambient context variable.
    askers, ambient = [], []
    for path in PACKAGE.rglob("*.py"):
      text = path.read_text()
      rel = path.relative_to(PACKAGE).as_posix()
      for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr == "default_backend":
          askers.append(rel)
        if isinstance(node, ast.Attribute) and node.attr == "ContextVar":
          ambient.append(rel)
    self.assertEqual(sorted(set(askers)), ["kernels/backend.py"])
    self.assertNotIn("models/quantized.py", ambient)
    self.assertNotIn("models/kv_cache.py", ambient)


class AStepsRowIsTheSameAloneAsBesideOthersTest(parameterized.TestCase):
  """The modules between the quantized kernels, at GLM-4.7-Flash's widths (hidden 2048, 64
  experts): XLA:CPU computes a [1, 2048] row's float32 router dot and RMSNorm reduction with
  other code than [8, 2048] rows' (the old modules: 8 of 8 router rows and 1 of 8 normed rows
  differ), which made MTP on != off on the Flash shape. In a step (`Kernels.steps`) each row
  must get the value it has alone; a prefill's rows may take any path."""

  HIDDEN, EXPERTS = 2048, 64

  def _rows_alone_and_together(self, module, x):
    module_def, state = nnx.split(module)
    call = jax.jit(lambda state, rows: nnx.merge(module_def, state)(rows))
    alone = np.concatenate([np.asarray(call(state, x[i:i + 1])) for i in range(x.shape[0])])
    return alone, np.asarray(call(state, x))

  def _steps(self, module):
    for _, node in nnx.iter_graph(module):
      if isinstance(node, nnx.Module) and hasattr(node, "kernels"):
        node.kernels = backend.default().for_steps()
    return module

  def _filled(self, module, seed: int):
    rng = np.random.default_rng(seed)
    for _, param in nnx.iter_graph(module):
      if isinstance(param, nnx.Param):
        param.value = jnp.asarray(rng.standard_normal(param.value.shape), param.value.dtype)
    return module

  def _moe(self):
    cfg = mtpjax.load(MODELS["deepseek2"]).config
    cfg = dataclasses.replace(cfg, hidden=self.HIDDEN, n_experts=self.EXPERTS, n_experts_used=4,
                              expert_ffn=32, n_shared_experts=1, n_groups=1, groups_used=1)
    return ffn.MoE(cfg, jnp.float32)

  @parameterized.named_parameters(
      (name, name) for name in ("rms_norm", "router", "dense_linear", "head_projection", "moe"))
  def test_each_row_of_a_step_equals_the_row_alone(self, name):
    d = self.HIDDEN
    module = {"rms_norm": lambda: primitives.RMSNorm(d, 1e-5),
              "router": lambda: primitives.Einsum("nd,ed->ne", (self.EXPERTS, d), jnp.float32),
              "dense_linear": lambda: primitives.Linear(d, 256, jnp.float32),
              "head_projection": lambda: primitives.HeadProjection(4, 64, d, jnp.float32),
              "moe": self._moe}[name]()
    x = np.random.default_rng(0).standard_normal((8, d)).astype(np.float32) * 3
    if name == "head_projection":
      x = x.reshape(8, 1, d).repeat(4, axis=1)
    alone, together = self._rows_alone_and_together(self._steps(self._filled(module, 1)), x)
    np.testing.assert_array_equal(together, alone)


class MtpOnEqualsOffOnEveryBackendTest(parameterized.TestCase):
  """Token for token, greedy and sampled requests sharing a batch, at slots 1 and 8 and draft
  windows 1 and 3, with each backend's dispatch forced on CPU (the accelerators' `xla`, and
  `pallas` in Pallas' interpreter), in bfloat16: the old dispatch (a fused loop up to 16 rows,
  a GEMM over bfloat16 weights past it) fails at 8 slots and window 3."""

  @parameterized.product(arch=tuple(MODELS), kernels=("xla", "pallas"))
  def test_mtp_on_equals_off(self, arch, kernels):
    # `native` is checked by quantized_model_test and the engine suites (its default here).
    model = mtpjax.load(MODELS[arch], kernels=kernels, dtype="bfloat16")
    # One step a dispatch: the bursts' programs repeat the same step (and cost compiles).
    settings = dict(max_len=48, prefill_buckets=(16,), prefix_cache=0, decode_steps=1)
    for slots in (1, 8):
      requests = _requests(max(slots, 2))
      run = lambda engine, window=None: SlotScheduler(
          engine, adaptive=None, window=window).run(requests)
      off = [r.tokens for r in run(model.engine(native_mtp=False, slots=slots, **settings))]
      self.assertTrue(all(len(tokens) == NEW_TOKENS for tokens in off))
      on_engine = model.engine(native_mtp=True, draft_tokens=3, slots=slots, **settings)
      for window in (1, 3):
        with self.subTest(slots=slots, window=window):
          on = run(on_engine, DraftWindow.fixed(window))
          self.assertEqual([r.tokens for r in on], off)
          self.assertGreater(sum(r.stats.drafted for r in on), 0)


if __name__ == "__main__":
  absltest.main()
