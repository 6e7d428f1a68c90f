"""Stage split planning (docs/LAYER_PACKAGES.md §8): even and explicit splits, flags, typed errors."""

from absl.testing import absltest
from absl.testing import parameterized

from mtpjax import errors
from mtpjax.package import planning


class EvenSplitTest(parameterized.TestCase):

  @parameterized.parameters(
      (48, 3, [(0, 16), (16, 32), (32, 48)]),
      (10, 3, [(0, 4), (4, 7), (7, 10)]),      # the first L % S stages take one more
      (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),  # the last stage holds only the NextN block
      (5, 1, [(0, 5)]),
      (7, 2, [(0, 4), (4, 7)]))
  def test_ranges(self, layer_count, stages, expected):
    self.assertEqual(planning.even_split(layer_count, stages), expected)

  def test_more_stages_than_layers(self):
    with self.assertRaisesRegex(errors.PlanningError, "stage_count_exceeds_layer_count") as raised:
      planning.even_split(3, 4)
    self.assertEqual(raised.exception.code, "stage_count_exceeds_layer_count")

  @parameterized.parameters(0, -2)
  def test_non_positive_stage_count(self, stages):
    with self.assertRaisesRegex(errors.PlanningError, "--stages must be greater than zero"):
      planning.even_split(4, stages)


class ExplicitSplitTest(parameterized.TestCase):

  def test_glm_4_7_flash(self):
    self.assertEqual(planning.explicit_split(48, [15, 31], 3), [(0, 15), (15, 31), (31, 48)])

  @parameterized.parameters(([0, 31], "InvalidSplitBoundary"), ([15, 48], "InvalidSplitBoundary"),
                            ([49], "InvalidSplitBoundary"), ([-1], "InvalidSplitBoundary"),
                            ([31, 15], "NonAscendingSplitBoundary"),
                            ([15, 15], "NonAscendingSplitBoundary"))
  def test_bad_boundaries(self, splits, code):
    with self.assertRaisesRegex(errors.PlanningError, code) as raised:
      planning.explicit_split(48, splits, len(splits) + 1)
    self.assertEqual(raised.exception.code, code)
    self.assertEqual(raised.exception.field, "splits")

  @parameterized.parameters(([15, 31], 2), ([15, 31], 4), ([], 2))
  def test_boundaries_must_match_the_stage_axis(self, splits, stages):
    with self.assertRaisesRegex(errors.PlanningError, "NotEnoughNodesForSplits"):
      planning.explicit_split(48, splits, stages)


class PlanStagesTest(absltest.TestCase):

  def test_flags_and_coverage(self):
    plan = planning.plan_stages(48, 3, splits=[15, 31])
    self.assertEqual(plan, [planning.StageRange(0, 0, 15, True, False),
                            planning.StageRange(1, 15, 31, False, False),
                            planning.StageRange(2, 31, 48, False, True)])
    single = planning.plan_stages(4, 1)
    self.assertEqual(single, [planning.StageRange(0, 0, 4, True, True)])
    even = planning.plan_stages(4, 4)
    self.assertEqual([(s.layer_start, s.layer_end) for s in even], [(0, 1), (1, 2), (2, 3), (3, 4)])
    self.assertEqual([s.includes_output for s in even], [False, False, False, True])

  def test_errors(self):
    with self.assertRaisesRegex(errors.PlanningError, "stage_count_exceeds_layer_count"):
      planning.plan_stages(2, 3)
    with self.assertRaisesRegex(errors.PlanningError, "--stages must be greater than zero"):
      planning.plan_stages(2, 0, splits=[])
    with self.assertRaisesRegex(errors.PlanningError, "NotEnoughNodesForSplits"):
      planning.plan_stages(48, 2, splits=[15, 31])

  def test_admission_rules(self):
    check = planning.check_stage
    check(planning.StageRange(1, 31, 48, False, True), 48)
    for stage, message in (
        (planning.StageRange(0, 3, 3, True, False), "layer_start must be less than layer_end"),
        (planning.StageRange(1, 40, 49, False, True), "layer_end exceeds model layer count"),
        (planning.StageRange(0, 0, 15, False, False), "must include token embeddings"),
        (planning.StageRange(0, 0, 15, True, True), "only the final runtime slice")):
      with self.assertRaisesRegex(errors.PlanningError, message):
        check(stage, 48)


if __name__ == "__main__":
  absltest.main()
