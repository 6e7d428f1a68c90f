"""Draft bookkeeping and MTP counters (docs/SPECULATIVE.md §8, docs/DECODE.md §5, docs/LAYER_PACKAGES.md §11)."""

from __future__ import annotations

import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import draft_tracker
from draft_tracker import DraftTracker
from mtpjax import telemetry
from mtpjax.telemetry import MtpStats

STAT_KEYS = {"enabled", "drafted", "accepted", "rejected", "pending", "verifications",
             "accept_rate", "proposal_compute_us", "verification_compute_us", "target_passes",
             "committed_tokens", "tokens_per_target_pass", "tokens_per_verify"}
DICT_KEYS = STAT_KEYS | {"accept_rate_by_position"}


class VerifyTest(absltest.TestCase):

  def test_accept_emits_both_target_tokens(self):
    # Verify pass over [current=10, draft=11]; the target's tokens are [11, 99].
    self.assertEqual(draft_tracker.accept_draft(11, [11, 99]), (True, (11, 99)))
    tracker = DraftTracker()
    tracker.record_draft(11)
    self.assertEqual(tracker.verify([11, 99]), (11, 99))
    stats = tracker.stats
    self.assertEqual((stats.accepted, stats.rejected, stats.pending), (1, 0, 0))

  def test_reject_emits_the_correction_only(self):
    # Verify pass over [current=10, draft=12] against target [11, 99].
    self.assertEqual(draft_tracker.accept_draft(12, [11, 99]), (False, (11,)))
    tracker = DraftTracker()
    tracker.record_draft(12)
    self.assertEqual(tracker.verify([11, 99]), (11,))
    stats = tracker.stats
    self.assertEqual((stats.accepted, stats.rejected, stats.pending), (0, 1, 0))

  def test_numpy_tokens(self):
    tracker = DraftTracker()
    tracker.record_draft(np.int32(11))
    emitted = tracker.verify(np.array([11, 99], np.int32))
    self.assertEqual(emitted, (11, 99))
    self.assertTrue(all(type(t) is int for t in emitted))

  def test_verify_needs_two_target_tokens_when_drafting(self):
    tracker = DraftTracker()
    tracker.record_draft(5)
    with self.assertRaises(ValueError):
      tracker.verify([5])


class BookkeepingTest(absltest.TestCase):

  def test_no_draft_is_the_baseline(self):
    """A request that never drafts emits and counts exactly like MTP off."""
    target_passes = [[7, 1], [8, 2], [9, 3]]
    mtp_on, mtp_off = DraftTracker(native_mtp=True), DraftTracker(native_mtp=False)
    outputs_on = [mtp_on.verify(t) for t in target_passes]
    outputs_off = [mtp_off.verify(t[:1]) for t in target_passes]
    self.assertEqual(outputs_on, [(7,), (8,), (9,)])
    self.assertEqual(outputs_on, outputs_off)
    self.assertEqual(mtp_on.stats.as_dict(), mtp_off.stats.as_dict())
    self.assertEqual(mtp_on.stats.as_dict(), {
        "enabled": False, "drafted": 0, "accepted": 0, "rejected": 0, "pending": 0,
        "verifications": 0, "accept_rate": 0.0, "proposal_compute_us": 0,
        "verification_compute_us": 0, "target_passes": 3, "committed_tokens": 3,
        "tokens_per_target_pass": 1.0, "tokens_per_verify": 1.0,
        "accept_rate_by_position": []})

  def test_draft_stays_pending_until_the_next_target_pass(self):
    tracker = DraftTracker()
    tracker.record_draft(4)
    self.assertEqual(tracker.pending_draft, 4)
    stats = tracker.stats
    self.assertEqual((stats.drafted, stats.pending, stats.verifications), (1, 1, 0))
    self.assertTrue(stats.enabled)
    tracker.verify([4, 6])
    self.assertIsNone(tracker.pending_draft)
    self.assertEqual(tracker.stats.pending, 0)

  def test_previous_draft_is_verified_before_the_next_is_stored(self):
    tracker = DraftTracker()
    tracker.record_draft(4)
    with self.assertRaisesRegex(RuntimeError, "still pending"):
      tracker.record_draft(5)
    tracker.verify([3, 6])                # rejected
    tracker.record_draft(5)
    self.assertEqual(tracker.verify([5, 9]), (5, 9))
    stats = tracker.stats
    self.assertEqual((stats.drafted, stats.accepted, stats.rejected), (2, 1, 1))

  def test_clear_pending_keeps_accepted_and_rejected(self):
    tracker = DraftTracker()
    tracker.record_draft(1)
    tracker.verify([1, 2])
    tracker.record_draft(3)
    tracker.verify([0, 2])
    tracker.record_draft(8)
    before = tracker.stats
    tracker.clear_pending()
    after = tracker.stats
    self.assertIsNone(tracker.pending_draft)
    self.assertEqual((after.accepted, after.rejected, after.drafted), (1, 1, 3))
    self.assertEqual(before, after)
    self.assertEqual(after.pending, 1)    # the dropped draft counts as drafted, never verified
    # After the clear, a target pass is a plain step again.
    self.assertEqual(tracker.verify([4, 4]), (4,))
    self.assertEqual((tracker.stats.accepted, tracker.stats.rejected), (1, 1))

  def test_disabled_request_cannot_draft(self):
    with self.assertRaises(RuntimeError):
      DraftTracker(native_mtp=False).record_draft(1)

  def test_full_request_counters(self):
    """Hand-computed: prefill draft + 4 steps (A, R, A, A), then the request ends."""
    tracker = DraftTracker()
    emitted = []
    tracker.record_draft(11)                       # prefill
    for target, next_draft in (([11, 20], 21), ([5, 6], 7), ([7, 8], 9), ([9, 10], 30)):
      emitted.extend(tracker.verify(target))
      tracker.record_draft(next_draft)
    tracker.clear_pending()
    self.assertEqual(emitted, [11, 20, 5, 7, 8, 9, 10])
    stats = tracker.stats
    self.assertEqual(stats.as_dict(), {
        "enabled": True, "drafted": 5, "accepted": 3, "rejected": 1, "pending": 1,
        "verifications": 4, "accept_rate": 0.75, "proposal_compute_us": 0,
        "verification_compute_us": 0, "target_passes": 4, "committed_tokens": 7,
        "tokens_per_target_pass": 1.75, "tokens_per_verify": 1.75,
        "accept_rate_by_position": []})

  def test_accept_rate_is_one_when_all_accepted(self):
    tracker = DraftTracker()
    for token in range(5):
      tracker.record_draft(token)
      tracker.verify([token, 100])
    self.assertEqual(tracker.stats.accept_rate, 1.0)
    self.assertEqual(tracker.stats.tokens_per_target_pass, 2.0)


class DurationTest(parameterized.TestCase):

  @parameterized.parameters((-5, 0), (-0.5, 0), (float("nan"), 0), (0, 0), (12, 12),
                            (12.9, 12), (np.int64(-3), 0), (np.float32(7.0), 7),
                            (float("inf"), 2**63 - 1), (10**40, 2**63 - 1),
                            (1e300, 2**63 - 1), (2**63 - 1, 2**63 - 1))
  def test_clamp(self, value, expected):
    clamped = telemetry.clamp_duration_us(value)
    self.assertEqual(clamped, expected)
    self.assertIs(type(clamped), int)

  def test_sums_are_python_ints(self):
    tracker = DraftTracker()
    for value in (np.int32(2**31 - 1), np.int32(2**31 - 1), -100, 10**40):
      tracker.record_proposal_us(value)
    tracker.record_verification_us(np.int32(-1))
    tracker.record_verification_us(3.7)
    stats = tracker.stats
    self.assertEqual(stats.proposal_compute_us, 2 * (2**31 - 1) + 2**63 - 1)
    self.assertIs(type(stats.proposal_compute_us), int)
    self.assertEqual(stats.verification_compute_us, 3)


class StatsTest(absltest.TestCase):

  def test_shape_disabled_and_enabled(self):
    disabled = MtpStats().as_dict()
    enabled = MtpStats(native_mtp=True, drafted=3, accepted=1, rejected=1, target_passes=2,
                       committed_tokens=3).as_dict()
    self.assertEqual(set(disabled), DICT_KEYS)
    self.assertEqual(set(enabled), DICT_KEYS)
    self.assertFalse(disabled["enabled"])
    self.assertEqual({k: v for k, v in disabled.items() if k != "enabled"},
                     {k: (1.0 if k == "tokens_per_verify" else [] if k not in STAT_KEYS else 0)
                      for k in DICT_KEYS - {"enabled"}})
    self.assertTrue(enabled["enabled"])
    self.assertEqual((enabled["pending"], enabled["verifications"], enabled["accept_rate"]),
                     (1, 2, 0.5))

  def test_enabled_needs_mtp_on_and_a_draft(self):
    self.assertFalse(MtpStats(native_mtp=True).enabled)
    self.assertFalse(MtpStats(native_mtp=False, target_passes=4, committed_tokens=4).enabled)
    self.assertTrue(MtpStats(native_mtp=True, drafted=1).enabled)

  def test_metrics_names(self):
    metrics = MtpStats(native_mtp=True, drafted=2, accepted=1).as_metrics()
    self.assertEqual(set(metrics), {"mtpjax_native_mtp_" + k for k in STAT_KEYS})
    self.assertEqual(metrics["mtpjax_native_mtp_enabled"], 1.0)
    self.assertEqual(metrics["mtpjax_native_mtp_drafted"], 2.0)

  def test_per_position_acceptance_of_multi_token_windows(self):
    """Hand-computed: windows of 3 accepting 3, 1 and 0 drafts, then one of 1 accepting 1."""
    stats = MtpStats.from_counts(native_mtp=True, drafted=10, accepted=5, rejected=5,
                                 target_passes=4, committed_tokens=9,
                                 verified_by_position=(4, 3, 3), accepted_by_position=(3, 1, 1))
    self.assertEqual(stats.accept_rate_by_position, [0.75, 1 / 3, 1 / 3])
    self.assertEqual(stats.tokens_per_verify, 1 + 5 / 4)
    merged = stats.merge(MtpStats.from_counts(
        native_mtp=True, drafted=1, accepted=1, rejected=0, target_passes=1,
        committed_tokens=2, verified_by_position=(1,), accepted_by_position=(1,)))
    self.assertEqual((merged.verified_by_position, merged.accepted_by_position),
                     ((5, 3, 3), (4, 1, 1)))
    metrics = merged.as_metrics()
    self.assertEqual(metrics["mtpjax_native_mtp_accept_rate_position_1"], 0.8)
    self.assertEqual(metrics["mtpjax_native_mtp_accept_rate_position_3"], 1 / 3)
    self.assertNotIn("mtpjax_native_mtp_accept_rate_position_4", metrics)

  def test_from_counts_matches_tracker(self):
    tracker = DraftTracker()
    tracker.record_draft(1)
    tracker.verify([1, 2])
    tracker.record_draft(3)
    tracker.verify([4, 5])
    tracker.record_draft(6)
    tracker.record_proposal_us(40)
    tracker.record_verification_us(60)
    reduced = MtpStats.from_counts(
        native_mtp=True, drafted=np.int32(3), accepted=np.array(1, np.int32),
        rejected=np.int32(1), target_passes=np.int64(2), committed_tokens=3,
        proposal_compute_us=40, verification_compute_us=np.int64(60))
    self.assertEqual(reduced, tracker.stats)
    self.assertIs(type(reduced.drafted), int)

  def test_from_counts_clamps_durations_and_rejects_bad_counts(self):
    stats = MtpStats.from_counts(native_mtp=True, drafted=1, accepted=0, rejected=0,
                                 target_passes=0, committed_tokens=0, proposal_compute_us=-9,
                                 verification_compute_us=float("inf"))
    self.assertEqual((stats.proposal_compute_us, stats.verification_compute_us), (0, 2**63 - 1))
    with self.assertRaisesRegex(ValueError, "negative"):
      MtpStats.from_counts(native_mtp=True, drafted=-1, accepted=0, rejected=0,
                           target_passes=0, committed_tokens=0)
    with self.assertRaisesRegex(ValueError, "exceeds drafted"):
      MtpStats.from_counts(native_mtp=True, drafted=1, accepted=1, rejected=1,
                           target_passes=2, committed_tokens=3)

  def test_merge_across_requests(self):
    first = DraftTracker()
    first.record_draft(1)
    first.verify([1, 2])
    first.record_draft(3)
    first.record_proposal_us(5)
    second = DraftTracker()
    second.record_draft(7)
    second.verify([8, 9])
    second.record_verification_us(11)
    baseline = DraftTracker(native_mtp=False)
    baseline.verify([1])
    total = MtpStats.total([first.stats, second.stats, baseline.stats])
    self.assertEqual(total, MtpStats(native_mtp=True, drafted=3, accepted=1, rejected=1,
                                     target_passes=3, committed_tokens=4, proposal_compute_us=5,
                                     verification_compute_us=11))
    self.assertEqual(total.pending, 1)
    self.assertEqual(total.accept_rate, 0.5)
    self.assertEqual(MtpStats.total([]), MtpStats())
    self.assertEqual(first.stats.merge(second.stats), second.stats.merge(first.stats))


if __name__ == "__main__":
  absltest.main()
