"""Host drafts (n-gram proposers alone, and a composite's n-gram tail after the native-MTP
chain) give exactly the tokens of no speculation, greedy and sampled.

Two tiny glm4moe models: one with a NextN block that copies the trunk (`mtp_copies_trunk`, so
its chains are mostly accepted and a composite's tail is verified behind accepted MTP tokens)
and one without a NextN block. The real proposers (every `ngram-*` strategy, and a composite a
layer package declares) run through `SlotScheduler` against the same model with speculation
disabled. Random tiny models rarely repeat themselves, so the real proposers' drafts are mostly
rejected; an oracle drafter that proposes the reference continuation with some positions
corrupted makes long accepted runs and rejections at every depth, through the same engine path.
One engine per model and stage count (host drafts, the deepest window) serves every strategy.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools  # noqa: E402  (the device count must be set before jax loads)
import json  # noqa: E402
import tempfile  # noqa: E402

import numpy as np
from absl.testing import absltest, parameterized

import mtpjax
from mtpjax.draft_window import MAX_DRAFT_TOKENS, DraftWindow
from mtpjax.engine.composite import CompositeDraft, HostDrafting
from mtpjax.engine.drafting_policy import AdaptiveDrafting
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.gguf.tokenizer import GgufTokenizer
from mtpjax.testing import corpus, strategies
from mtpjax.testing.tiny_glm import TinyGlmSpec, write_tiny_glm_gguf

_TMP = tempfile.TemporaryDirectory()
NEW_TOKENS = 16
ENGINE = dict(slots=2, max_len=96, prefill_buckets=(32, 64))
COMPOSITE = "mtp-simple"
CAPPED = "ngram-capped"
DEMO = os.path.join(os.path.dirname(mtpjax.__file__), "assets", "glm-demo")
DEMO_TOKENS = 32


def _requests(vocab: int) -> list[Request]:
  """A prompt that repeats itself (n-gram matches in the prompt) and a random one; greedy and
  sampled (temperature 0.8, top-p 0.9)."""
  rng = np.random.default_rng(5)
  phrase = rng.integers(0, vocab, size=9)
  repeated = np.concatenate([phrase, phrase, phrase, phrase[:4]]).astype(np.int32)
  random = rng.integers(0, vocab, size=13).astype(np.int32)
  return [Request(prompt=repeated, max_new_tokens=NEW_TOKENS, sampler=SamplerParams()),
          Request(prompt=random, max_new_tokens=NEW_TOKENS,
                  sampler=SamplerParams(temperature=0.8, top_p=0.9, seed=11)),
          Request(prompt=repeated.copy(), max_new_tokens=NEW_TOKENS,
                  sampler=SamplerParams(temperature=0.8, top_p=0.9, seed=12))]


@functools.cache
def source(kind: str) -> str:
  """`nextn`: a layer package of a model whose NextN block copies the trunk; `plain`: a GGUF
  without a NextN block."""
  path = os.path.join(_TMP.name, f"{kind}.gguf")
  write_tiny_glm_gguf(path, TinyGlmSpec(mtp_copies_trunk=True) if kind == "nextn"
                      else TinyGlmSpec(mtp=False))
  if kind == "plain":
    return path
  package = strategies.composite_package(
      path, os.path.join(_TMP.name, "composite-package"), strategy_id=COMPOSITE,
      extender={"type": "ngram-simple", "ngram_min": 1, "ngram_max": 3,
                "max_proposal_tokens": 4})
  # An n-gram strategy whose window policy caps its proposer's 6 tokens at 3 a step.
  manifest_path = package / "model-package.json"
  manifest = json.loads(manifest_path.read_text())
  block = manifest["generation"]["speculative_decoding"]
  block["proposers"]["six"] = {"type": "ngram-simple", "ngram_min": 2, "ngram_max": 4,
                               "max_proposal_tokens": 6}
  block["strategies"][CAPPED] = {"type": "ngram-simple", "proposer": "six", "window_policy": {
      "default": "fixed", "initial_window": 3, "min_window": 1, "max_window": 3}}
  manifest_path.write_text(json.dumps(manifest, indent=1))
  return str(package)


@functools.cache
def loaded(kind: str, stages: int):
  """(model, tokens of `_requests` with speculation disabled, the host-drafting engines)."""
  model = mtpjax.load(source(kind), stages=stages)
  reference = SlotScheduler(model.engine(native_mtp=False, **ENGINE)).run(
      _requests(model.config.vocab_size))
  return model, [r.tokens for r in reference]


def _engine(model, native_mtp: bool):
  return model.engine(native_mtp=native_mtp, host_drafts=True, draft_tokens=MAX_DRAFT_TOKENS,
                      **ENGINE)


class OracleDrafter:
  """Proposes the tokens the target will commit (known from a reference run), with the
  positions `corrupt` selects replaced by a wrong token: accepted runs of every length and
  rejections at every depth. A composite's MTP tokens lead its draft, the oracle tail follows."""

  def __init__(self, prompt, reference: list[int], corrupt):
    self.expected = [int(t) for t in prompt] + reference
    self.committed = len(prompt)
    self.corrupt = corrupt
    self.proposals = 0

  def draft(self, window: int, mtp_tokens=()) -> CompositeDraft:
    self.proposals += 1
    start = self.committed + len(mtp_tokens)
    tail = [t + 1 if self.corrupt(start + i) else t
            for i, t in enumerate(self.expected[start:start + window - len(mtp_tokens)])]
    return CompositeDraft(tokens=tuple(int(t) for t in mtp_tokens) + tuple(tail),
                          mtp_count=len(mtp_tokens))

  def verified(self, draft, accepted: int, committed) -> None:
    self.commit(committed)

  def commit(self, tokens) -> None:
    self.committed += len(tokens)


class HostDraftingTest(parameterized.TestCase):

  @parameterized.product(kind=("nextn", "plain"),
                         strategy=("ngram-simple", "ngram-cache", "ngram-suffix"))
  def test_each_ngram_strategy_gives_the_tokens_of_no_speculation(self, kind, strategy):
    model, expected = loaded(kind, 1)
    resolution = model.resolve(strategy)
    self.assertFalse(resolution.native_mtp)          # n-gram drafting needs no NextN block
    drafting = HostDrafting.of(resolution, resolution.draft_window)
    self.assertTrue(drafting.host)
    results = SlotScheduler(_engine(model, False), adaptive=None,
                            drafter=drafting.drafter).run(_requests(model.config.vocab_size))
    self.assertEqual([r.tokens for r in results], expected)

  @parameterized.named_parameters(("one_device", 1), ("two_stages", 2))
  def test_a_package_composite_gives_the_tokens_of_no_speculation(self, stages):
    model, expected = loaded("nextn", stages)
    resolution = model.resolve(COMPOSITE)
    self.assertEqual(resolution.strategy_type, "composite")
    self.assertTrue(resolution.native_mtp)
    drafting = HostDrafting.of(resolution, resolution.draft_window)
    self.assertEqual(drafting.draft_tokens, 1 + 4)   # the MTP window, then the tail's max_tokens
    engine = model.engine(native_mtp=True, host_drafts=True, draft_tokens=drafting.draft_tokens,
                          **ENGINE)
    # Every step drafting; on one device also the default policy (its pauses and catch-ups).
    for adaptive in (None, AdaptiveDrafting()) if stages == 1 else (None,):
      results = SlotScheduler(engine, adaptive=adaptive, window=resolution.draft_window,
                              drafter=drafting.drafter).run(_requests(model.config.vocab_size))
      self.assertEqual([r.tokens for r in results], expected, f"adaptive={adaptive}")
      if adaptive is None:     # the copied trunk's MTP tokens are mostly accepted
        self.assertGreater(results[0].stats.accepted_by_position[0], NEW_TOKENS // 4)

  @parameterized.parameters(("nextn", 1), ("plain", 1), ("nextn", 2))
  def test_oracle_drafts_are_accepted_and_rejected_losslessly(self, kind, stages):
    model, expected = loaded(kind, stages)
    native = kind == "nextn"
    requests = _requests(model.config.vocab_size)
    oracles = []

    def drafter(prompt):
      index = next(i for i, r in enumerate(requests) if r.prompt is prompt)
      oracles.append(OracleDrafter(prompt, expected[index], lambda p, i=index: (p + i) % 5 == 0))
      return oracles[-1]

    # A composite: two MTP tokens (mostly right: the NextN block copies the trunk), the
    # oracle's tail after them; runs past position 2 are accepted tails.
    window = DraftWindow.fixed(2) if native else None
    results = SlotScheduler(_engine(model, native), adaptive=None, window=window,
                            drafter=drafter).run(requests)
    self.assertEqual([r.tokens for r in results], expected)
    # Runs of 3 and more (for the composite: tails accepted after its two MTP tokens).
    self.assertGreater(sum(sum(r.stats.accepted_by_position[2:]) for r in results), 0)
    for result in results:
      stats = result.stats
      self.assertEqual(stats.committed_tokens, stats.target_passes + stats.accepted)
      self.assertGreater(stats.rejected, 0)
    # Fewer target passes than tokens: the accepted drafts were committed in the verify pass.
    self.assertLess(sum(r.stats.target_passes for r in results),
                    0.75 * sum(len(r.tokens) for r in results))

  def test_an_engine_with_host_drafts_needs_its_drafter(self):
    model, _ = loaded("plain", 1)
    with self.assertRaisesRegex(Exception, "host_drafts"):
      SlotScheduler(_engine(model, False))
    with self.assertRaisesRegex(Exception, "host_drafts"):
      SlotScheduler(model.engine(native_mtp=False, **ENGINE),
                    drafter=HostDrafting.of(model.resolve("ngram-simple"),
                                            model.resolution.draft_window).drafter)


class DemoModelStrategiesTest(parameterized.TestCase):
  """The shipped demo model (trained on standard-library code), through `Model.generate`: every
  strategy gives the tokens of no speculation, and over a prompt that repeats earlier text the
  composite (MTP, then an n-gram tail) commits more tokens per target pass than MTP alone."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = mtpjax.load(str(strategies.composite_copy(
        DEMO, os.path.join(_TMP.name, "demo-composite"))))
    tokenizer = GgufTokenizer.from_metadata(cls.model.metadata)
    cls.prompts = corpus.repeated_code_prompts(tokenizer.encode, 2, 60, seed=1)

  def _run(self, strategy: str, new_tokens: int = DEMO_TOKENS, **kwargs) -> list:
    return [self.model.generate(p, max_new_tokens=new_tokens, speculative=strategy,
                                adaptive_drafting=False, **kwargs) for p in self.prompts]

  def test_every_strategy_gives_the_tokens_of_no_speculation(self):
    # Greedy (the tiny models above check sampling): repeated code, every strategy's drafts
    # are taken.
    expected = [r.tokens for r in self._run("disabled")]
    for strategy in ("ngram-simple", "ngram-cache", "ngram-suffix", "native-mtp-n1",
                     strategies.COMPOSITE_ID):
      results = self._run(strategy)
      self.assertEqual([r.tokens for r in results], expected, strategy)
      self.assertGreater(sum(r.stats.accepted for r in results), 0, strategy)

  def test_the_composite_beats_mtp_alone_on_repeated_text(self):
    # MTP alone at the composite's own MTP window (the demo's package strategy drafts up to 3;
    # the composite declares no window_policy, so its MTP part drafts 1): the tail's gain,
    # over enough tokens for the reply to reach text the prompt repeats (32: none yet).
    mtp_window = self.model.resolve(strategies.COMPOSITE_ID).draft_window
    per_pass = {strategy: np.mean([r.stats.tokens_per_target_pass for r in self._run(
                    strategy, 2 * DEMO_TOKENS, draft_window=mtp_window)])
                for strategy in ("native-mtp-n1", strategies.COMPOSITE_ID)}
    self.assertGreater(per_pass[strategies.COMPOSITE_ID], per_pass["native-mtp-n1"] + 0.1,
                       per_pass)


class HostDraftingWindowTest(parameterized.TestCase):
  """How deep a step verifies for each strategy (`HostDrafting.of`), worked out by hand."""

  def test_windows(self):
    nextn = mtpjax.load(source("nextn"))
    plain = mtpjax.load(source("plain"))
    cases = {"ngram-simple": (plain, 4, True), "ngram-cache": (plain, 4, True),
             "ngram-suffix": (plain, 8, True), "disabled": (plain, 1, False),
             "native-mtp-n1": (nextn, 1, False), COMPOSITE: (nextn, 5, True),
             CAPPED: (nextn, 3, True)}
    for strategy, (model, deepest, host) in cases.items():
      resolution = model.resolve(strategy)
      drafting = HostDrafting.of(resolution, resolution.draft_window)
      self.assertEqual((drafting.draft_tokens, drafting.host), (deepest, host), strategy)


if __name__ == "__main__":
  absltest.main()
