"""Multi-token native MTP drafts: every draft window gives exactly the tokens of MTP off.

On glm4moe, deepseek2 (MLA) and glm-dsa tiny models on one device, and glm4moe over a 2-stage
pipeline, greedy and sampled (temperature 0.8, top-p 0.9), against the same model with MTP off,
for windows k = 1..5 (fixed) and an adaptive window. The MLA archs' pipelines are
mla_pipeline_test's (native-mtp-n1 against transformers): what a pipeline adds to a deeper
window is the engine's, the same for every arch.
The glm4moe model's NextN block copies the trunk (`mtp_copies_trunk`), so its chains are mostly
accepted at every depth; the fixtures' random heads are mostly rejected, so both outcomes run
through the caches. One engine per model and stage count serves every window, compiled by
warm_up (one drafting step per window bucket); the test budget keeps one slot on one device
(engine_test runs two slots of different windows in one step).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools  # noqa: E402  (the device count must be set before jax loads)
import tempfile  # noqa: E402

import numpy as np
from absl.testing import absltest, parameterized

import mtpjax
from fixtures import FIXTURES
from mtpjax.draft_window import DraftWindow
from mtpjax.engine.contract import warm_up
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.testing.tiny_glm import TinyGlmSpec, write_tiny_glm_gguf

_TMP = tempfile.TemporaryDirectory()
MAX_DRAFT = 5
NEW_TOKENS = 14
ENGINE = dict(max_len=48, prefill_buckets=(16,))


@functools.cache
def model_path(arch: str) -> str:
  if arch == "glm4moe":
    path = os.path.join(_TMP.name, "copies-trunk.gguf")
    write_tiny_glm_gguf(path, TinyGlmSpec(mtp_copies_trunk=True))
    return path
  folder, name = {"deepseek2": ("glm4moelite-tiny", "glm4moelite_h64-F32.gguf"),
                  "glm-dsa": ("glmdsa-tiny", "glmdsa_h64-F32.gguf")}[arch]
  return str(FIXTURES / folder / name)


def slots(stages: int) -> int:
  return 1 if stages == 1 else 2


@functools.cache
def loaded(arch: str, stages: int):
  """(model, MTP-off tokens of `requests`): one load per model and stage count."""
  model = mtpjax.load(model_path(arch), stages=stages)
  off = SlotScheduler(model.engine(native_mtp=False, slots=slots(stages), **ENGINE)).run(
      requests(model.config.vocab_size))
  return model, [r.tokens for r in off]


def requests(vocab: int) -> list[Request]:
  rng = np.random.default_rng(3)
  return [Request(prompt=rng.integers(0, vocab, size=n).astype(np.int32),
                  max_new_tokens=NEW_TOKENS, sampler=sampler)
          for n, sampler in ((6, SamplerParams()),
                             (11, SamplerParams(temperature=0.8, top_p=0.9, seed=7)))]


class DraftWindowEquivalenceTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("glm4moe_one_device", "glm4moe", 1),
      ("deepseek2_one_device", "deepseek2", 1),
      ("glm_dsa_one_device", "glm-dsa", 1),
      ("glm4moe_two_stages", "glm4moe", 2))
  def test_every_window_gives_the_tokens_of_mtp_off(self, arch, stages):
    model, expected = loaded(arch, stages)
    vocab = model.config.vocab_size
    self.assertEqual([len(t) for t in expected], [NEW_TOKENS] * 2)
    top = MAX_DRAFT
    engine = model.engine(native_mtp=True, draft_tokens=top, slots=slots(stages), **ENGINE)
    warm_up(engine)     # every window bucket: no window below compiles anything
    traces = dict(engine.trace_counts)
    self.assertEqual(traces["verify_draft"], len(engine.engine_cfg.window_buckets) * stages)
    windows = [DraftWindow.fixed(k) for k in range(1, top + 1)]
    windows.append(DraftWindow(1, 2, top, adaptive=True))
    deep_accepts = 0
    for window in windows:
      results = SlotScheduler(engine, adaptive=None, window=window).run(requests(vocab))
      self.assertEqual([r.tokens for r in results], expected, f"{arch} {window}")
      for r in results:
        stats = r.stats
        self.assertLen(stats.verified_by_position, window.max)
        self.assertEqual(sum(stats.verified_by_position), stats.verifications)
        self.assertEqual(stats.committed_tokens, stats.target_passes + stats.accepted)
        if not window.adaptive:        # every step verified the whole window
          self.assertEqual(stats.verified_by_position[window.max - 1], stats.target_passes - 1)
        deep_accepts += sum(stats.accepted_by_position[1:])
    # The default cost-aware policy too: its pauses and catch-ups were compiled as well.
    results = SlotScheduler(engine, window=windows[-1]).run(requests(vocab))
    self.assertEqual([r.tokens for r in results], expected)
    self.assertEqual(engine.trace_counts, traces)
    if arch == "glm4moe":     # the copied trunk's chains go deep
      self.assertGreater(deep_accepts, 5)


if __name__ == "__main__":
  absltest.main()
