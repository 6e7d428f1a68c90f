"""`generation.speculative_decoding` of every package era: proposers, n-gram and composite
strategies, extension and window policies (docs/LAYER_PACKAGES.md §5, upstream's preflight codes).

The manifests are the §9 example (3 layers, NextN block at layer 2) with their generation block
replaced; expected values are written out by hand from the JSON.
"""

import copy

from absl.testing import absltest
from absl.testing import parameterized

import package_examples as examples
from mtpjax.package import manifest as manifest_lib
from mtpjax.package.manifest import ExtensionPolicy, Proposer, Strategy, WindowPolicy

_FIXED = {"default": "fixed", "initial_window": 1, "min_window": 1, "max_window": 1}

# A newer-era block using every field: the shape of upstream's published GLM example (with an
# ngram-cache window upstream's own preflight accepts), plus every n-gram type and a composite
# in the later form (only max_tokens, a pipelined window).
NEWER = {
    "default": "mtp-cache",
    "proposers": {
        "mtp": {"type": "native-mtp", "prediction_depth": 1, "layer_indices": [2]},
        "simple": {"type": "ngram-simple", "ngram_min": 2, "ngram_max": 6,
                   "max_proposal_tokens": 6},
        "cache": {"type": "ngram-cache", "ngram_min": 2, "ngram_max": 4,
                  "max_proposal_tokens": 10, "history_scope": "request"},
        "suffix": {"type": "ngram-suffix", "ngram_min": 5, "ngram_max": 32,
                   "max_proposal_tokens": 48, "history_scope": "request"},
    },
    "strategies": {
        "mtp": {"type": "native-mtp", "proposer": "mtp", "window_policy": _FIXED},
        "ngram-simple": {"type": "ngram-simple", "proposer": "simple"},
        "ngram-cache": {"type": "ngram-cache", "proposer": "cache",
                        "window_policy": {"default": "fixed", "initial_window": 6,
                                          "min_window": 1, "max_window": 6}},
        "ngram-suffix": {"type": "ngram-suffix", "proposer": "suffix",
                         "window_policy": {"default": "fixed", "initial_window": 32,
                                           "min_window": 1, "max_window": 32,
                                           "pipeline_depth": 2}},
        "mtp-cache": {"type": "composite", "primary": "mtp", "extender": "cache",
                      "extension_policy": {"initial_tokens": 2, "max_tokens": 8,
                                           "tail_backoff_proposals": 5}},
        "mtp-suffix": {"type": "composite", "primary": "mtp", "extender": "suffix",
                       "extension_policy": {"max_tokens": 48},
                       "window_policy": {"default": "adaptive", "initial_window": 2,
                                         "min_window": 1, "max_window": 6,
                                         "pipeline_depth": 2}},
    },
}

_P = ("generation", "speculative_decoding", "proposers")
_S = ("generation", "speculative_decoding", "strategies")


def _manifest(block=None):
  manifest = examples.example_manifest()
  manifest["generation"]["speculative_decoding"] = copy.deepcopy(NEWER if block is None else block)
  return manifest


def _at(manifest, path):
  for key in path:
    manifest = manifest[key]
  return manifest


def _set(path, value):
  return lambda manifest: _at(manifest, path[:-1]).__setitem__(path[-1], value)


def _delete(path):
  return lambda manifest: _at(manifest, path[:-1]).pop(path[-1])


def _add_proposer(name, body):
  return _set(_P + (name,), body)


def _issues(manifest):
  return [(item["code"], item["severity"]) for item in manifest_lib.manifest_issues(manifest)]


# (case, mutation of NEWER, code, message substring): every code of the newer eras, and the old
# native-MTP codes reached through a proposer.
_ERROR_CASES = [
    ("proposer_name_empty", _add_proposer("  ", NEWER["proposers"]["simple"]),
     "empty_speculative_proposer_name", "speculative proposer names must not be empty"),
    ("proposer_type_blank", _add_proposer("odd", {"type": " "}),
     "unsupported_speculative_proposer_type", "proposer odd must be an object with a non-empty"),
    ("proposer_not_object", _add_proposer("odd", "ngram-cache"),
     "unsupported_speculative_proposer_type", "proposer odd must be an object"),
    ("proposer_depth_two", _set(_P + ("mtp", "prediction_depth"), 2),
     "unsupported_native_mtp_prediction_depth",
     "native MTP proposer mtp must use prediction_depth 1"),
    ("proposer_depth_missing", _delete(_P + ("mtp", "prediction_depth")),
     "unsupported_native_mtp_prediction_depth", "proposer mtp must use prediction_depth 1"),
    ("proposer_layers_empty", _set(_P + ("mtp", "layer_indices"), []),
     "missing_native_mtp_layers", "native MTP proposer mtp must declare MTP layer_indices"),
    ("proposer_layer_out_of_range", _set(_P + ("mtp", "layer_indices"), [3]),
     "native_mtp_layer_out_of_range",
     "native MTP proposer mtp references layer 3, but layer_count is 3"),
    ("strategy_proposer_missing", _set(_S + ("mtp", "proposer"), "nextn"),
     "missing_speculative_proposer", "strategy mtp proposer names proposer 'nextn'"),
    ("strategy_proposer_not_a_string", _set(_S + ("ngram-cache", "proposer"), ["cache"]),
     "missing_speculative_proposer", "strategy ngram-cache proposer names proposer ['cache']"),
    ("strategy_type_missing", _delete(_S + ("mtp", "type")), "empty_speculative_strategy_type",
     "speculative strategy mtp type must not be empty"),
    ("native_proposer_is_ngram", _set(_S + ("mtp", "proposer"), "cache"),
     "native_mtp_strategy_proposer_type_mismatch",
     "native MTP strategy mtp names proposer cache, whose type is ngram-cache"),
    ("ngram_without_proposer", _delete(_S + ("ngram-simple", "proposer")),
     "missing_ngram_strategy_proposer", "n-gram strategy ngram-simple must name its proposer"),
    ("ngram_type_mismatch", _set(_S + ("ngram-simple", "proposer"), "cache"),
     "ngram_strategy_proposer_type_mismatch",
     "n-gram strategy ngram-simple has type ngram-simple, but its proposer cache has type "
     "ngram-cache"),
    ("composite_no_primary", _delete(_S + ("mtp-cache", "primary")),
     "missing_composite_primary", "composite strategy mtp-cache must declare primary"),
    ("composite_no_extender", _delete(_S + ("mtp-cache", "extender")),
     "missing_composite_extender", "composite strategy mtp-cache must declare extender"),
    ("composite_no_extension_policy", _delete(_S + ("mtp-cache", "extension_policy")),
     "missing_composite_extension_policy",
     "composite strategy mtp-cache must declare extension_policy"),
    ("composite_primary_undeclared", _set(_S + ("mtp-cache", "primary"), "nextn"),
     "missing_speculative_proposer", "strategy mtp-cache primary names proposer 'nextn'"),
    ("composite_extender_undeclared", _set(_S + ("mtp-cache", "extender"), "lookup"),
     "missing_speculative_proposer", "strategy mtp-cache extender names proposer 'lookup'"),
    ("composite_primary_is_ngram", _set(_S + ("mtp-cache", "primary"), "simple"),
     "invalid_composite_primary_type",
     "composite strategy mtp-cache primary simple has type ngram-simple; it must be native-mtp"),
    ("composite_extender_is_mtp", _set(_S + ("mtp-cache", "extender"), "mtp"),
     "invalid_composite_extender_type",
     "composite strategy mtp-cache extender mtp has type native-mtp; it must be an n-gram"),
    ("extension_max_zero", _set(_S + ("mtp-cache", "extension_policy", "max_tokens"), 0),
     "invalid_extension_policy_tokens",
     "mtp-cache extension_policy.max_tokens must be an integer greater than zero, got 0"),
    ("extension_max_missing", _delete(_S + ("mtp-suffix", "extension_policy", "max_tokens")),
     "invalid_extension_policy_tokens", "mtp-suffix extension_policy.max_tokens must be"),
    ("extension_initial_above_max",
     _set(_S + ("mtp-cache", "extension_policy", "initial_tokens"), 9),
     "invalid_extension_policy_tokens",
     "must satisfy 1 <= initial_tokens <= max_tokens, got initial_tokens 9 and max_tokens 8"),
    ("extension_initial_zero", _set(_S + ("mtp-cache", "extension_policy", "initial_tokens"), 0),
     "invalid_extension_policy_tokens", "got initial_tokens 0 and max_tokens 8"),
    ("extension_backoff_negative",
     _set(_S + ("mtp-cache", "extension_policy", "tail_backoff_proposals"), -1),
     "invalid_extension_policy_tokens", "tail_backoff_proposals must be a non-negative integer"),
    ("extension_backoff_fraction",
     _set(_S + ("mtp-cache", "extension_policy", "tail_backoff_proposals"), 1.5),
     "invalid_extension_policy_tokens", "got 1.5"),
    ("extension_not_object", _set(_S + ("mtp-cache", "extension_policy"), 8),
     "invalid_extension_policy_tokens", "mtp-cache extension_policy must be an object"),
    ("extension_on_ngram_strategy",
     _set(_S + ("ngram-cache", "extension_policy"), {"max_tokens": -2}),
     "invalid_extension_policy_tokens", "ngram-cache extension_policy.max_tokens"),
    ("ngram_min_zero", _set(_P + ("simple", "ngram_min"), 0), "invalid_ngram_proposer_window",
     "n-gram proposer simple needs integers 1 <= ngram_min <= ngram_max, got ngram_min 0"),
    ("ngram_min_above_max", _set(_P + ("cache", "ngram_min"), 5),
     "invalid_ngram_proposer_window", "got ngram_min 5 and ngram_max 4"),
    ("ngram_max_missing", _delete(_P + ("suffix", "ngram_max")), "invalid_ngram_proposer_window",
     "n-gram proposer suffix needs integers"),
    ("ngram_max_tokens_zero", _set(_P + ("simple", "max_proposal_tokens"), 0),
     "invalid_ngram_proposer_max_tokens",
     "n-gram proposer simple max_proposal_tokens must be an integer greater than zero, got 0"),
    ("ngram_max_tokens_missing", _delete(_P + ("cache", "max_proposal_tokens")),
     "invalid_ngram_proposer_max_tokens", "got None"),
    ("cache_window_above_four", _set(_P + ("cache", "ngram_max"), 5),
     "unsupported_ngram_cache_max_window",
     "n-gram cache proposer cache has ngram_max 5, above the 4-token match window"),
    ("cache_history_shared", _set(_P + ("cache", "history_scope"), "shared"),
     "invalid_ngram_cache_history_scope",
     "n-gram cache proposer cache must set history_scope to 'request', got 'shared'"),
    ("cache_history_missing", _delete(_P + ("cache", "history_scope")),
     "invalid_ngram_cache_history_scope", "got None"),
    ("suffix_min_below_three", _set(_P + ("suffix", "ngram_min"), 2),
     "unsupported_ngram_suffix_window",
     "n-gram suffix proposer suffix needs 3 <= ngram_min <= ngram_max <= 64, got 2..32"),
    ("suffix_max_above_64", _set(_P + ("suffix", "ngram_max"), 65),
     "unsupported_ngram_suffix_window", "got 5..65"),
    ("suffix_history_missing", _delete(_P + ("suffix", "history_scope")),
     "invalid_ngram_suffix_history_scope",
     "n-gram suffix proposer suffix must set history_scope to 'request'"),
    ("pipeline_depth_zero", _set(_S + ("ngram-suffix", "window_policy", "pipeline_depth"), 0),
     "invalid_window_policy_pipeline_depth",
     "ngram-suffix window_policy.pipeline_depth must be an integer from 1 to 64, got 0"),
    ("pipeline_depth_65", _set(_S + ("mtp-suffix", "window_policy", "pipeline_depth"), 65),
     "invalid_window_policy_pipeline_depth", "got 65"),
    ("pipeline_depth_string", _set(_S + ("mtp", "window_policy", "pipeline_depth"), "2"),
     "invalid_window_policy_pipeline_depth", "got '2'"),
    ("pipeline_depth_bool", _set(_S + ("mtp", "window_policy", "pipeline_depth"), True),
     "invalid_window_policy_pipeline_depth", "got True"),
    ("composite_window_bounds", _set(_S + ("mtp-suffix", "window_policy", "min_window"), 7),
     "invalid_window_policy_bounds", "min_window 7 > max_window 6"),
    ("default_undeclared", _set(("generation", "speculative_decoding", "default"), "mtp-ngram"),
     "missing_speculative_default_strategy", "'mtp-ngram' is not one of the strategies"),
]

# Values at the edges of every bound, which must stay valid.
_VALID_EDGES = [
    ("pipeline_depth_1", _set(_S + ("mtp", "window_policy", "pipeline_depth"), 1)),
    ("pipeline_depth_64", _set(_S + ("mtp-suffix", "window_policy", "pipeline_depth"), 64)),
    ("cache_ngram_max_4_min_1", _set(_P + ("cache", "ngram_min"), 1)),
    ("suffix_3_to_64", lambda m: _at(m, _P + ("suffix",)).update(ngram_min=3, ngram_max=64)),
    ("simple_window_of_one", lambda m: _at(m, _P + ("simple",)).update(ngram_min=1,
                                                                        ngram_max=1)),
    ("initial_equals_max",
     _set(_S + ("mtp-cache", "extension_policy"), {"initial_tokens": 8, "max_tokens": 8,
                                                   "tail_backoff_proposals": 0})),
    ("extension_max_only", _set(_S + ("mtp-cache", "extension_policy"), {"max_tokens": 1})),
    ("simple_history_request", _set(_P + ("simple", "history_scope"), "request")),
    ("unused_proposer", _add_proposer("spare", {"type": "ngram-simple", "ngram_min": 3,
                                                "ngram_max": 3, "max_proposal_tokens": 2})),
    ("native_both_forms", lambda m: _at(m, _S + ("mtp",)).update(prediction_depth=1,
                                                                 layer_indices=[2])),
]


class NewerEraTest(parameterized.TestCase):

  def test_every_field_is_valid_and_typed(self):
    manifest = _manifest()
    self.assertEqual(manifest_lib.manifest_issues(manifest), [])
    speculative = manifest_lib.parse_manifest(manifest, path="m.json").generation \
        .speculative_decoding
    self.assertEqual(speculative.default, "mtp-cache")
    self.assertEqual(speculative.proposers, {
        "mtp": Proposer("mtp", "native-mtp", 1, (2,)),
        "simple": Proposer("simple", "ngram-simple", ngram_min=2, ngram_max=6,
                           max_proposal_tokens=6),
        "cache": Proposer("cache", "ngram-cache", ngram_min=2, ngram_max=4,
                          max_proposal_tokens=10, history_scope="request"),
        "suffix": Proposer("suffix", "ngram-suffix", ngram_min=5, ngram_max=32,
                           max_proposal_tokens=48, history_scope="request")})
    fixed = WindowPolicy("fixed", 1, 1, 1)
    self.assertEqual(speculative.strategies, {
        "mtp": Strategy("mtp", "native-mtp", 1, (2,), fixed, proposer="mtp"),
        "ngram-simple": Strategy("ngram-simple", "ngram-simple", proposer="simple"),
        "ngram-cache": Strategy("ngram-cache", "ngram-cache", None, (),
                                WindowPolicy("fixed", 6, 1, 6), proposer="cache"),
        "ngram-suffix": Strategy("ngram-suffix", "ngram-suffix", None, (),
                                 WindowPolicy("fixed", 32, 1, 32, pipeline_depth=2),
                                 proposer="suffix"),
        "mtp-cache": Strategy("mtp-cache", "composite", 1, (2,), primary="mtp", extender="cache",
                              extension_policy=ExtensionPolicy(8, 2, 5)),
        "mtp-suffix": Strategy("mtp-suffix", "composite", 1, (2,),
                               WindowPolicy("adaptive", 2, 1, 6, pipeline_depth=2),
                               primary="mtp", extender="suffix",
                               extension_policy=ExtensionPolicy(48))})

  def test_what_each_strategy_drafts_with(self):
    speculative = manifest_lib.parse_manifest(_manifest(), path="m.json").generation \
        .speculative_decoding
    drafts = {name: (strategy.uses_native_mtp,
                     getattr(speculative.ngram_proposer(strategy), "name", None))
              for name, strategy in speculative.strategies.items()}
    self.assertEqual(drafts, {"mtp": (True, None), "ngram-simple": (False, "simple"),
                              "ngram-cache": (False, "cache"), "ngram-suffix": (False, "suffix"),
                              "mtp-cache": (True, "cache"), "mtp-suffix": (True, "suffix")})
    self.assertTrue(all(strategy.known for strategy in speculative.strategies.values()))

  @parameterized.named_parameters(*_ERROR_CASES)
  def test_error_rule(self, mutate, code, message):
    manifest = _manifest()
    mutate(manifest)
    examples.assert_error_rule(self, manifest, code, message)

  @parameterized.named_parameters(*_VALID_EDGES)
  def test_edges_stay_valid(self, mutate):
    manifest = _manifest()
    mutate(manifest)
    self.assertEqual(manifest_lib.manifest_issues(manifest), [])
    manifest_lib.parse_manifest(manifest, path="m.json")

  def test_both_native_forms_read_the_proposer(self):
    """Upstream's v1 reader takes depth and layers from `proposer` when a strategy has both."""
    manifest = _manifest()
    _at(manifest, _S + ("mtp",)).update(prediction_depth=7, layer_indices=[9])
    self.assertEqual(_issues(manifest), [])
    strategy = manifest_lib.parse_manifest(manifest, path="m.json").generation \
        .speculative_decoding.strategies["mtp"]
    self.assertEqual((strategy.prediction_depth, strategy.layer_indices), (1, (2,)))

  def test_fields_a_type_does_not_define_are_not_read(self):
    baseline = manifest_lib.parse_manifest(_manifest(), path="m.json")
    manifest = _manifest()
    _at(manifest, _P + ("simple",)).update(layer_indices=5, prediction_depth="deep")
    _at(manifest, _P + ("mtp",)).update(ngram_max="big", history_scope=7)
    _at(manifest, _S + ("ngram-cache",)).update(layer_indices=5, primary=[1])
    self.assertEqual(_issues(manifest), [])
    parsed = manifest_lib.parse_manifest(manifest, path="m.json")
    self.assertEqual(parsed.generation.speculative_decoding.proposers,
                     baseline.generation.speculative_decoding.proposers)
    self.assertEqual(parsed.generation.speculative_decoding.strategies,
                     baseline.generation.speculative_decoding.strategies)

  def test_published_example_exceeds_the_cache_window(self):
    """Upstream's design note shows an ngram-cache proposer with ngram_max 6, which upstream's
    own preflight rejects (its n-gram cache matches at most 4 tokens); so do we."""
    manifest = _manifest({
        "default": "mtp-cache",
        "proposers": {"mtp": {"type": "native-mtp", "prediction_depth": 1, "layer_indices": [2]},
                      "cache": {"type": "ngram-cache", "ngram_min": 2, "ngram_max": 6,
                                "max_proposal_tokens": 10, "history_scope": "request"}},
        "strategies": {"mtp-cache": {"type": "composite", "primary": "mtp", "extender": "cache",
                                     "extension_policy": {"initial_tokens": 2, "max_tokens": 8,
                                                          "tail_backoff_proposals": 5}}}})
    self.assertEqual(_issues(manifest), [("unsupported_ngram_cache_max_window", "error")])
    _at(manifest, _P + ("cache",))["ngram_max"] = 4
    self.assertEqual(_issues(manifest), [])


class UnknownTypeTest(absltest.TestCase):
  """A consumer ignores a strategy or proposer type it does not know, unless it is the default
  it must serve: preflight warns, and resolution decides (docs/SPECULATIVE.md)."""

  def _with_draft_model(self, default):
    manifest = _manifest()
    speculative = manifest["generation"]["speculative_decoding"]
    speculative["proposers"]["small"] = {"type": "draft-model", "model": "org/small:Q4_0",
                                         "max_proposal_tokens": "lots"}
    speculative["strategies"]["draft"] = {"type": "draft-model", "proposer": "small",
                                          "window_policy": "whatever", "future_field": [1]}
    speculative["default"] = default
    return manifest

  def test_unknown_types_are_ignored_with_warnings(self):
    manifest = self._with_draft_model("mtp-cache")
    found = manifest_lib.manifest_issues(manifest)
    self.assertEqual([(item["code"], item["severity"]) for item in found],
                     [("unsupported_speculative_proposer_type", "warning"),
                      ("unsupported_speculative_strategy_type", "warning")])
    self.assertIn("speculative strategy draft has type draft-model, which mtpjax does not run; "
                  "it is ignored", found[1]["message"])
    speculative = manifest_lib.parse_manifest(manifest, path="m.json").generation \
        .speculative_decoding
    self.assertEqual(speculative.strategies["draft"], Strategy("draft", "draft-model"))
    self.assertEqual(speculative.proposers["small"], Proposer("small", "draft-model"))
    self.assertFalse(speculative.strategies["draft"].known)
    self.assertFalse(speculative.strategies["draft"].uses_native_mtp)
    self.assertIsNone(speculative.ngram_proposer(speculative.strategies["draft"]))

  def test_an_unknown_default_says_auto_cannot_serve_it(self):
    found = manifest_lib.manifest_issues(self._with_draft_model("draft"))
    strategy_issue = [item for item in found
                      if item["code"] == "unsupported_speculative_strategy_type"]
    self.assertLen(strategy_issue, 1)
    self.assertEqual(strategy_issue[0]["severity"], "warning")
    self.assertIn("speculative strategy draft is the package default but has type draft-model",
                  strategy_issue[0]["message"])
    self.assertIn("`auto` cannot serve it", strategy_issue[0]["message"])
    self.assertIn("speculative.strategy set to disabled", strategy_issue[0]["remediation"])

  def test_a_known_strategy_may_not_use_an_unknown_proposer(self):
    manifest = self._with_draft_model("mtp-cache")
    _at(manifest, _S + ("mtp-cache",))["extender"] = "small"
    _at(manifest, _S + ("mtp",))["proposer"] = "small"
    codes = [code for code, severity in _issues(manifest) if severity == "error"]
    self.assertCountEqual(codes, ["invalid_composite_extender_type",
                                  "native_mtp_strategy_proposer_type_mismatch"])


class EveryEraTest(absltest.TestCase):
  """The same model's native MTP, declared in each era's form, reads the same."""

  FORMS = {
      "native-mtp-n1": {"default": "native-mtp-n1", "strategies": {"native-mtp-n1": {
          "type": "native-mtp", "prediction_depth": 1, "layer_indices": [2],
          "window_policy": _FIXED}}},
      "mtp": {"default": "mtp", "strategies": {"mtp": {
          "type": "native-mtp", "prediction_depth": 1, "layer_indices": [2],
          "window_policy": _FIXED}}},
      "proposers": {"default": "mtp", "proposers": {"mtp": NEWER["proposers"]["mtp"]},
                    "strategies": {"mtp": {"type": "native-mtp", "proposer": "mtp",
                                           "window_policy": _FIXED}}},
  }

  def test_every_form_gives_the_same_native_mtp(self):
    for form, block in self.FORMS.items():
      manifest = _manifest(block)
      self.assertEqual(manifest_lib.manifest_issues(manifest), [], form)
      speculative = manifest_lib.parse_manifest(manifest, path="m.json").generation \
          .speculative_decoding
      default = speculative.strategies[speculative.default]
      self.assertEqual((default.type, default.prediction_depth, default.layer_indices,
                        default.window_policy, default.uses_native_mtp),
                       ("native-mtp", 1, (2,), WindowPolicy("fixed", 1, 1, 1), True), form)

  def test_an_era_field_in_the_wrong_place_is_still_caught(self):
    manifest = _manifest(self.FORMS["proposers"])
    _at(manifest, _P + ("mtp",))["layer_indices"] = [7]
    self.assertEqual(_issues(manifest), [("native_mtp_layer_out_of_range", "error")])


if __name__ == "__main__":
  absltest.main()
