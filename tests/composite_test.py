"""The composite draft's n-gram tail (engine/composite.py): budgets worked out by hand."""

from __future__ import annotations

from absl.testing import absltest

from mtpjax import speculative
from mtpjax.engine import composite, ngram
from mtpjax.engine.composite import CompositeDraft, HostDrafting, NgramDrafter, TailExtension


def _extension(max_tokens=4, initial_tokens=2, backoff=2) -> TailExtension:
  return TailExtension(max_tokens=max_tokens, initial_tokens=initial_tokens,
                       tail_backoff_proposals=backoff)


class TailExtensionTest(absltest.TestCase):

  def test_full_accepts_grow_the_tail_up_to_max_tokens(self):
    extension = _extension(max_tokens=4, initial_tokens=2)
    budgets = []
    for _ in range(4):
      budget = extension.budget(1)
      budgets.append(budget)
      extension.observe(CompositeDraft((9,) * (1 + budget), mtp_count=1), accepted=1 + budget)
    self.assertEqual(budgets, [2, 3, 4, 4])

  def test_a_failed_tail_resets_and_backs_off(self):
    extension = _extension(max_tokens=4, initial_tokens=2, backoff=2)
    extension.observe(CompositeDraft((1, 2, 3), 1), accepted=3)      # grows to 3
    extension.observe(CompositeDraft((1, 2, 3, 4), 1), accepted=2)   # MTP ok, tail failed
    self.assertEqual([extension.budget(1) for _ in range(4)], [0, 0, 2, 2])

  def test_pure_ngram_drafts_ignore_and_keep_the_back_off(self):
    extension = _extension(max_tokens=5, initial_tokens=2, backoff=1)
    extension.observe(CompositeDraft((1, 2, 3), 1), accepted=1)      # tail failed
    self.assertEqual(extension.budget(0), 5)                         # no MTP draft: n-gram alone
    self.assertEqual((extension.budget(2), extension.budget(2)), (0, 2))

  def test_an_mtp_rejection_or_a_draft_without_tail_changes_nothing(self):
    extension = _extension(max_tokens=4, initial_tokens=3, backoff=6)
    extension.observe(CompositeDraft((1, 2, 3, 4), 2), accepted=1)   # rejected inside MTP
    extension.observe(CompositeDraft((1,), 1), accepted=0)           # no tail
    extension.observe(CompositeDraft((1, 2), 0), accepted=0)         # pure n-gram
    self.assertEqual(extension.budget(1), 3)

  def test_no_back_off(self):
    extension = _extension(max_tokens=3, initial_tokens=1, backoff=0)
    extension.observe(CompositeDraft((1, 2), 1), accepted=2)
    extension.observe(CompositeDraft((1, 2, 3), 1), accepted=1)
    self.assertEqual(extension.budget(1), 1)

  def test_from_resolved_settings(self):
    extension = TailExtension.from_settings(speculative.ExtensionSettings(8, 2, 5))
    self.assertEqual((extension.max_tokens, extension.tail_tokens,
                      extension.tail_backoff_proposals), (8, 2, 5))
    with self.assertRaises(ValueError):
      _extension(max_tokens=2, initial_tokens=3)


class ComposeDraftTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.proposer = ngram.SimpleNgramProposer(2, 2, 8)
    self.proposer.commit([0, 0, 2, 3, 9, 1, 7, 8, 2, 3])

  def test_the_tail_continues_after_the_mtp_tokens(self):
    draft = composite.compose_draft([9], self.proposer, _extension(max_tokens=4), window=8)
    self.assertEqual((draft.tokens, draft.mtp_count, draft.tail_count), ((9, 1, 7), 1, 2))

  def test_the_window_bounds_mtp_and_tail(self):
    extension = _extension(max_tokens=4, initial_tokens=4)
    self.assertEqual(composite.compose_draft([9], self.proposer, extension, window=3).tokens,
                     (9, 1, 7))
    self.assertEqual(composite.compose_draft([9, 1, 7, 8], self.proposer, extension,
                                             window=2).tokens, (9, 1))

  def test_backing_off_drafts_mtp_alone(self):
    extension = _extension(backoff=1)
    extension.observe(CompositeDraft((9, 1, 7), 1), accepted=1)
    self.assertEqual(composite.compose_draft([9], self.proposer, extension, window=8).tokens,
                     (9,))
    self.assertEqual(composite.compose_draft([9], self.proposer, extension, window=8).tokens,
                     (9, 1, 7))

  def test_without_mtp_tokens_the_proposer_drafts_alone(self):
    draft = composite.compose_draft([], self.proposer, _extension(max_tokens=3), window=8)
    self.assertEqual((draft.tokens, draft.mtp_count), ((9, 1, 7), 0))


def _resolution(strategy):
  """A real resolution on a direct GGUF without a NextN head."""
  return speculative.resolve_speculative(
      model_id="m", requested=strategy, scope="test", source_kind="gguf",
      manifest=None, layer_count=2, gguf_metadata={"general.architecture": "glm4moe"},
      tensor_names=["blk.0.attn_norm.weight", "blk.1.attn_norm.weight"], env={})


class NgramDrafterTest(absltest.TestCase):
  """A decode loop against a known target stream, driven the way the engine will drive it."""

  TARGET = [7, 8, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 2]

  def run_loop(self, drafter, mtp_oracle_tokens: int, window: int = 4):
    """Each verify pass accepts the longest correct draft prefix and commits one more target
    token; returns the passes. The proposer's history must always be the committed stream."""
    committed, passes = 3, 0                              # a 3-token prompt
    while committed < len(self.TARGET):
      truth = self.TARGET[committed:]
      draft = drafter.draft(window, mtp_tokens=truth[:mtp_oracle_tokens])
      accepted = 0
      while accepted < min(len(draft.tokens), len(truth) - 1) and (
          draft.tokens[accepted] == truth[accepted]):
        accepted += 1
      drafter.verified(draft, accepted, truth[:accepted + 1])
      committed += accepted + 1
      passes += 1
      self.assertEqual(drafter.proposer.tokens, self.TARGET[:committed])
    return passes

  def test_ngram_strategy(self):
    resolution = _resolution("ngram-simple")
    drafter = HostDrafting.of(resolution, resolution.draft_window).drafter(self.TARGET[:3])
    self.assertIsNone(drafter.extension)
    self.assertLess(self.run_loop(drafter, mtp_oracle_tokens=0), len(self.TARGET) - 3)

  def test_composite_extends_a_correct_mtp_token(self):
    settings = speculative.NgramSettings("ngram-simple", 2, 2, 8, source="test")
    drafter = NgramDrafter(settings, speculative.ExtensionSettings(3, 2, 1), self.TARGET[:3])
    # MTP alone, one correct token per pass, commits 2 tokens a pass: 12 passes for the 24.
    self.assertLess(self.run_loop(drafter, mtp_oracle_tokens=1), 12)

  def test_no_ngram_proposer_no_drafter(self):
    resolution = _resolution("disabled")
    self.assertIsNone(HostDrafting.of(resolution, resolution.draft_window).drafter)


if __name__ == "__main__":
  absltest.main()
