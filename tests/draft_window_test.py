"""Multi-token native MTP drafts: every draft window gives exactly the tokens of MTP off.

For windows k = 1..5 (fixed) and an adaptive window, on glm4moe, deepseek2 (MLA) and glm-dsa
tiny models, on one device and over a 2-stage pipeline, greedy and sampled (temperature 0.8,
top-p 0.9): the reference is the same engine's model with MTP off. The glm4moe model's NextN
block copies the trunk (`mtp_copies_trunk`), so its chains are mostly accepted at every depth;
the fixtures' random heads are mostly rejected, so both outcomes run through the caches.
One engine per model and stage count serves every window (one compile per window bucket).
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
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.testing.tiny_glm import TinyGlmSpec, write_tiny_glm_gguf

_TMP = tempfile.TemporaryDirectory()
MAX_DRAFT = 5
NEW_TOKENS = 14


@functools.cache
def model_path(arch: str) -> str:
  if arch == "glm4moe":
    path = os.path.join(_TMP.name, "copies-trunk.gguf")
    write_tiny_glm_gguf(path, TinyGlmSpec(mtp_copies_trunk=True))
    return path
  folder, name = {"deepseek2": ("glm4moelite-tiny", "glm4moelite_h64-F32.gguf"),
                  "glm-dsa": ("glmdsa-tiny", "glmdsa_h64-F32.gguf")}[arch]
  return str(FIXTURES / folder / name)


def requests(vocab: int) -> list[Request]:
  rng = np.random.default_rng(3)
  return [Request(prompt=rng.integers(0, vocab, size=n).astype(np.int32),
                  max_new_tokens=NEW_TOKENS, sampler=sampler)
          for n, sampler in ((6, SamplerParams()),
                             (11, SamplerParams(temperature=0.8, top_p=0.9, seed=7)))]


class DraftWindowEquivalenceTest(parameterized.TestCase):

  @parameterized.product(arch=("glm4moe", "deepseek2", "glm-dsa"), stages=(1, 2))
  def test_every_window_gives_the_tokens_of_mtp_off(self, arch, stages):
    model = mtpjax.load(model_path(arch), stages=stages)
    kwargs = dict(slots=2, max_len=48, prefill_buckets=(16,))
    vocab = model.config.vocab_size
    off = SlotScheduler(model.engine(native_mtp=False, **kwargs)).run(requests(vocab))
    expected = [r.tokens for r in off]
    self.assertEqual([len(t) for t in expected], [NEW_TOKENS] * 2)
    engine = model.engine(native_mtp=True, draft_tokens=MAX_DRAFT, **kwargs)
    windows = [DraftWindow.fixed(k) for k in range(1, MAX_DRAFT + 1)]
    windows.append(DraftWindow(1, 2, MAX_DRAFT, adaptive=True))
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
    # One compile per window bucket (1, 2, 4, 5) and slot bucket, whichever window ran.
    self.assertLessEqual(engine.trace_counts["verify_draft"], 4 * 2 * stages)
    if arch == "glm4moe":     # the copied trunk's chains go deep
      self.assertGreater(deep_accepts, 20)


if __name__ == "__main__":
  absltest.main()
