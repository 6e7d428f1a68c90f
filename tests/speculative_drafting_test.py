"""What drafts for each requested strategy (docs/SPECULATIVE.md §11): native MTP, n-gram proposers
and composites, against every package era and direct GGUFs, with the kill switch and the
errors. Fixtures are speculative_test's."""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized

import package_examples
from mtpjax.errors import PackageError, SpeculativeConfigError
from mtpjax.package.manifest import parse_manifest
from mtpjax.runtime_options import consumers_from_resolution
from speculative_test import (ERR_PACKAGE, SOURCES, ConsumerAssertions, Source, _tensors,
                              resolve)

CACHE_PROPOSER = ("ngram-cache", 2, 3, 6, 'package proposer "cache"')
SUFFIX_PROPOSER = ("ngram-suffix", 3, 32, 8, 'package proposer "suffix"')
SIMPLE_DEFAULTS = ("ngram-simple", 2, 4, 4, "built-in defaults")
CACHE_DEFAULTS = ("ngram-cache", 2, 4, 4, "built-in defaults")
SUFFIX_DEFAULTS = ("ngram-suffix", 3, 16, 8, "built-in defaults")

DRAFTING = [
    # (case, strategy, source, native MTP, what drafts, package strategy served,
    #  n-gram (type, n min, n max, tokens, source), extension (max, initial, back-off))
    ("auto_composite_default", "auto", "pkg_composite", True, "composite", "mtp-cache",
     CACHE_PROPOSER, (4, 2, 6)),
    ("auto_composite_all_policy_fields", "auto", "pkg_composite_old_policy", True, "composite",
     "mtp-cache", CACHE_PROPOSER, (5, 1, 3)),
    ("auto_composite_primary_depth_2", "auto", "pkg_composite_depth2", False, None, None, None,
     None),
    ("auto_native_mtp_default", "auto", "pkg_mtp", True, "native-mtp", "native-mtp-n1", None,
     None),
    ("auto_suffix_default", "auto", "pkg_suffix_default", False, "ngram-suffix", "lookup",
     SUFFIX_PROPOSER, None),
    ("auto_first_era_ngram_default", "auto", "pkg_ngram_default", False, "ngram-simple", "ngram",
     SIMPLE_DEFAULTS, None),
    ("auto_gguf", "auto", "gguf_proof", False, None, None, None, None),
    ("named_mtp_beside_composite", "native-mtp-n1", "pkg_composite", True, "native-mtp", "mtp",
     None, None),
    ("id_composite", "mtp-cache", "pkg_composite", True, "composite", "mtp-cache",
     CACHE_PROPOSER, (4, 2, 6)),
    ("id_ignoring_case", "MTP-Cache", "pkg_composite", True, "composite", "mtp-cache",
     CACHE_PROPOSER, (4, 2, 6)),
    ("id_ngram_strategy", "ngram", "pkg_composite", False, "ngram-cache", "ngram",
     CACHE_PROPOSER, None),
    ("ngram_cache_package_proposer", "ngram-cache", "pkg_composite", False, "ngram-cache", None,
     CACHE_PROPOSER, None),
    ("ngram_suffix_declared_proposer", "ngram-suffix", "pkg_composite", False, "ngram-suffix",
     None, SUFFIX_PROPOSER, None),
    ("ngram_simple_package_without_one", "ngram-simple", "pkg_composite", False, "ngram-simple",
     None, SIMPLE_DEFAULTS, None),
    ("ngram_simple_gguf_without_head", "ngram-simple", "gguf_plain", False, "ngram-simple", None,
     SIMPLE_DEFAULTS, None),
    ("ngram_cache_gguf_with_head", "ngram-cache", "gguf_proof", False, "ngram-cache", None,
     CACHE_DEFAULTS, None),
    ("ngram_suffix_package_without_generation", "ngram-suffix", "pkg_no_generation", False,
     "ngram-suffix", None, SUFFIX_DEFAULTS, None),
    ("ngram_simple_package_without_head", "ngram-simple", "pkg_composite_no_head", False,
     "ngram-simple", None, SIMPLE_DEFAULTS, None),
    ("disabled_composite", "disabled", "pkg_composite", False, None, None, None, None),
]

DRAFTING_ERRORS = [
    # (case, strategy, source, error type, substrings)
    ("auto_unknown_default", "auto", "pkg_unknown_default", SpeculativeConfigError,
     ['the package default strategy "draft" has type draft-model, which mtpjax does not run',
      "the package strategies mtpjax runs: mtp"]),
    ("id_not_declared", "nope", "pkg_composite", SpeculativeConfigError,
     ['"nope" is not a strategy the package declares (declared: mtp, mtp-cache, ngram)']),
    ("id_on_gguf", "mtp-cache", "gguf_proof", SpeculativeConfigError,
     ['"mtp-cache" names a package strategy, but a direct GGUF declares none']),
    ("id_of_unknown_type", "draft", "pkg_unknown_default", SpeculativeConfigError,
     ['strategy "draft" has type draft-model, which mtpjax does not run']),
    ("id_composite_primary_depth_2", "mtp-cache", "pkg_composite_depth2", SpeculativeConfigError,
     ['requires package generation metadata advertising native MTP for it; strategy "mtp-cache" '
      'has prediction_depth 2 (from primary "nextn")']),
    ("named_strategy_is_composite", "native-mtp-n1", "pkg_mtp_is_composite",
     SpeculativeConfigError, [ERR_PACKAGE, 'strategy "mtp" with type composite']),
    ("composite_without_nextn_tensors", "auto", "pkg_composite_no_head", PackageError,
     ["blk.3.nextn.eh_proj.weight is missing"]),
]


def _ngram_tuple(settings):
  return None if settings is None else (settings.type, settings.ngram_min, settings.ngram_max,
                                        settings.max_proposal_tokens, settings.source)


def _extension_tuple(settings):
  return None if settings is None else (settings.max_tokens, settings.initial_tokens,
                                        settings.tail_backoff_proposals)


class DraftingTest(ConsumerAssertions, parameterized.TestCase):
  """Every requested value against every era's package and direct GGUFs (docs/SPECULATIVE.md §11)."""

  def assert_drafting(self, resolution, native, kind, strategy_id, ngram, extension):
    self.assertIs(resolution.native_mtp, native)
    self.assertEqual(resolution.mtp_layer_index, 3 if native else None)
    self.assertEqual((resolution.strategy_type, resolution.strategy_id), (kind, strategy_id))
    self.assertEqual(_ngram_tuple(resolution.ngram), ngram)
    self.assertEqual(_extension_tuple(resolution.extension), extension)
    self.assert_consumers(resolution, native)
    settings = consumers_from_resolution(resolution, dtype="float32", max_len=64, slots=2,
                                         prefill_buckets=(16,))[1]
    self.assertEqual(settings.speculative_type, kind or "off")
    summary = resolution.summary()
    self.assertEqual((summary["type"], summary["strategy_id"]), (kind, strategy_id))
    self.assertEqual(summary["ngram"] and tuple(summary["ngram"].values()), ngram)
    self.assertEqual(summary["extension"] and tuple(summary["extension"].values()), extension)

  @parameterized.named_parameters(*DRAFTING)
  def test_row(self, strategy, source_name, native, kind, strategy_id, ngram, extension):
    resolution = resolve(SOURCES[source_name](), strategy)
    self.assert_drafting(resolution, native, kind, strategy_id, ngram, extension)
    self.assertIn("defaults.speculative.strategy", resolution.reason)
    self.assertFalse(resolution.disabled_by_env)

  @parameterized.named_parameters(*DRAFTING_ERRORS)
  def test_error(self, strategy, source_name, error, substrings):
    for env in ({}, {"MTPJAX_NATIVE_MTP": "0"}):            # the kill switch hides no error
      with self.assertRaises(error) as caught:
        resolve(SOURCES[source_name](), strategy, env=env)
      for text in substrings:
        self.assertIn(text, str(caught.exception))

  @parameterized.named_parameters(
      ("composite_keeps_its_extender", "auto", "pkg_composite", "ngram-cache", "mtp-cache",
       CACHE_PROPOSER),
      ("composite_by_id", "mtp-cache", "pkg_composite", "ngram-cache", "mtp-cache",
       CACHE_PROPOSER),
      ("ngram_is_untouched", "ngram-simple", "gguf_plain", "ngram-simple", None, SIMPLE_DEFAULTS),
      ("composite_with_every_policy_field", "auto", "pkg_composite_old_policy", "ngram-cache",
       "mtp-cache", CACHE_PROPOSER),
      ("native_mtp_strategy", "mtp", "pkg_composite", None, None, None),
  )
  def test_kill_switch_turns_only_native_mtp_off(self, strategy, source_name, kind, strategy_id,
                                                 ngram):
    resolution = resolve(SOURCES[source_name](), strategy, env={"MTPJAX_NATIVE_MTP": "off"})
    self.assert_drafting(resolution, False, kind, strategy_id, ngram, None)
    self.assertTrue(resolution.disabled_by_env)
    self.assertIn("MTPJAX_NATIVE_MTP turns native MTP off", resolution.reason)
    if resolution.ngram is not None and strategy_id is not None:
      self.assertIn("its n-gram extender drafts alone", resolution.reason)

  def test_the_composite_carries_its_window_policy(self):
    resolution = resolve(SOURCES["pkg_composite"](), "auto")
    self.assertEqual(resolution.window_policy, {"default": "fixed", "initial_window": 1,
                                                "min_window": 1, "max_window": 1,
                                                "pipeline_depth": None})
    self.assertIn('default "mtp-cache" (composite: native-mtp, prediction_depth 1, extended by '
                  '"cache")', resolution.reason)


class PackageEraTest(parameterized.TestCase):
  """Manifests of each era, parsed from JSON: the newer forms of the same model resolve like
  the first era's (docs/LAYER_PACKAGES.md §5, §10)."""

  FIXED_JSON = {"default": "fixed", "initial_window": 1, "min_window": 1, "max_window": 1}
  NEXTN_JSON = {"type": "native-mtp", "prediction_depth": 1, "layer_indices": [2]}
  BLOCKS = {
      "first_era": {"default": "native-mtp-n1", "strategies": {"native-mtp-n1": {
          **NEXTN_JSON, "window_policy": FIXED_JSON}}},
      "mtp_id": {"default": "mtp", "strategies": {"mtp": {**NEXTN_JSON,
                                                          "window_policy": FIXED_JSON}}},
      "proposers": {"default": "mtp", "proposers": {"nextn": NEXTN_JSON}, "strategies": {
          "mtp": {"type": "native-mtp", "proposer": "nextn", "window_policy": FIXED_JSON}}},
      "composite": {"default": "mtp-cache", "proposers": {
          "nextn": NEXTN_JSON,
          "cache": {"type": "ngram-cache", "ngram_min": 1, "ngram_max": 4,
                    "max_proposal_tokens": 5, "history_scope": "request"}},
          "strategies": {
              "mtp": {"type": "native-mtp", "proposer": "nextn", "window_policy": FIXED_JSON},
              "mtp-cache": {"type": "composite", "primary": "nextn", "extender": "cache",
                            "extension_policy": {"max_tokens": 3},
                            "window_policy": FIXED_JSON}}},
  }

  def _resolve(self, form, strategy):
    raw = package_examples.example_manifest()
    raw["generation"]["speculative_decoding"] = self.BLOCKS[form]
    manifest = parse_manifest(raw, path="model-package.json")
    source = Source("package", manifest, {"general.architecture": "glm4moe"},
                    _tensors(3, (2,)), 3, "/pkgs/example")
    return resolve(source, strategy)

  @parameterized.product(form=["mtp_id", "proposers", "composite"],
                         strategy=["auto", "native-mtp-n1", "mtp", "disabled", "ngram-cache"])
  def test_same_native_mtp_as_the_first_era(self, form, strategy):
    first, newer = self._resolve("first_era", strategy), self._resolve(form, strategy)
    self.assertEqual((newer.native_mtp, newer.mtp_layer_index),
                     (first.native_mtp, first.mtp_layer_index))
    composite = form == "composite" and strategy == "auto"
    if not composite:
      self.assertEqual((newer.strategy_type, newer.window_policy, newer.extension),
                       (first.strategy_type, first.window_policy, first.extension))
    if strategy == "ngram-cache":
      declared = ("ngram-cache", 1, 4, 5, 'package proposer "cache"')
      self.assertEqual(_ngram_tuple(newer.ngram),
                       declared if form == "composite" else CACHE_DEFAULTS)

  def test_composite_default_extends_mtp(self):
    resolution = self._resolve("composite", "auto")
    self.assertEqual((resolution.strategy_type, resolution.mtp_layer_index,
                      _extension_tuple(resolution.extension)), ("composite", 2, (3, 2, 6)))


if __name__ == "__main__":
  absltest.main()
