"""Strategy resolution (docs/SPECULATIVE.md §4-§7 and §10, docs/LAYER_PACKAGES.md §11)."""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized

from configs import glm
from mtpjax import speculative
from mtpjax.draft_window import DraftWindow
from mtpjax.errors import PackageError, SpeculativeConfigError
from mtpjax.package import planning
from mtpjax.package.manifest import (Artifact, ExtensionPolicy, Generation, Manifest, Proposer,
                                     SourceModel, SpeculativeDecoding, Strategy, WindowPolicy)
from mtpjax.engine.plan import PipelinePlan
from mtpjax.runtime_options import consumers_from_resolution

FIXED = WindowPolicy("fixed", 1, 1, 1)
NEXTN_PARTS = ("eh_proj", "enorm", "hnorm", "shared_head_norm")
ERR_PACKAGE = "requires package generation metadata advertising native-mtp-n1"
ERR_GGUF = "requires proven native-mtp-n1 support"


def _artifact(role: str, path: str, layer_index: int | None = None) -> Artifact:
  return Artifact(role, path, 1, 4, 100, "0" * 64, layer_index)


def _manifest(layer_count: int, generation: Generation | None) -> Manifest:
  return Manifest(
      schema_version=1, model_id="org/tiny-glm:F32",
      source_model=SourceModel("/models/tiny.gguf", "a" * 64), format="layer-package",
      layer_count=layer_count, activation_width=64,
      shared_metadata=_artifact("metadata", "shared/metadata.gguf"),
      shared_embeddings=_artifact("embeddings", "shared/embeddings.gguf"),
      shared_output=_artifact("output", "shared/output.gguf"),
      layers=tuple(_artifact("layer", f"layers/layer-{i:03d}.gguf", i) for i in range(layer_count)),
      skippy_abi_version="0.1.0", generation=generation)


def _generation(default: str, *strategies: Strategy, proposers: tuple[Proposer, ...] = ()):
  return Generation(SpeculativeDecoding(
      default=default, strategies={s.name: s for s in strategies},
      proposers={p.name: p for p in proposers}))


def _mtp(name: str = "native-mtp-n1", layers: tuple[int, ...] = (3,), depth: int | None = 1,
         policy: WindowPolicy | None = FIXED) -> Strategy:
  return Strategy(name, "native-mtp", depth, layers, policy)


NGRAM = Strategy("ngram", "ngram-simple")
NEXTN = Proposer("nextn", "native-mtp", 1, (3,))
CACHE = Proposer("cache", "ngram-cache", ngram_min=2, ngram_max=3, max_proposal_tokens=6,
                 history_scope="request")
SUFFIX = Proposer("suffix", "ngram-suffix", ngram_min=3, ngram_max=32, max_proposal_tokens=8,
                  history_scope="request")


def _newer(default="mtp-cache", policy=ExtensionPolicy(4), nextn=NEXTN, **extra_strategies):
  """The newer era: proposers, a composite default, native MTP and n-gram strategies by
  reference (depth and layers left to the proposer, as the parser leaves them for a composite
  built by hand)."""
  strategies = [Strategy("mtp-cache", "composite", window_policy=FIXED, primary="nextn",
                         extender="cache", extension_policy=policy),
                Strategy("mtp", "native-mtp", window_policy=FIXED, proposer="nextn"),
                Strategy("ngram", "ngram-cache", proposer="cache"),
                *extra_strategies.values()]
  return _generation(default, *strategies, proposers=(nextn, CACHE, SUFFIX))


def _tensors(layer_count: int, nextn_layers: tuple[int, ...] = (),
             parts: tuple[str, ...] = NEXTN_PARTS) -> dict[str, dict]:
  names = [f"blk.{i}.attn_norm.weight" for i in range(layer_count)]
  names += [f"blk.{i}.nextn.{part}.weight" for i in nextn_layers for part in parts]
  names += ["token_embd.weight", "output_norm.weight", "output.weight"]
  return {name: {} for name in names}


@dataclasses.dataclass(frozen=True)
class Source:
  """Stands in for `mtpjax.package.reader.ModelSource`: resolution reads only these attributes."""
  kind: str
  manifest: Manifest | None
  metadata: dict[str, Any]
  tensors: dict[str, dict]
  layer_count: int
  path: str


def package(generation: Generation | None, nextn_layers=(3,), parts=NEXTN_PARTS, layer_count=4):
  return Source("package", _manifest(layer_count, generation), {"general.architecture": "glm4moe"},
                _tensors(layer_count, nextn_layers, parts), layer_count, "/pkgs/tiny")


def gguf(nextn_predict_layers: int | None, nextn_layers=(3,), kind="gguf", layer_count=4):
  metadata = {"general.architecture": "glm4moe", "glm4moe.block_count": layer_count}
  if nextn_predict_layers is not None:
    metadata["glm4moe.nextn_predict_layers"] = nextn_predict_layers
  return Source(kind, None, metadata, _tensors(layer_count, nextn_layers), layer_count,
                "/models/tiny.gguf")


SOURCES = {
    "pkg_mtp": lambda: package(_generation("native-mtp-n1", _mtp())),
    "pkg_mtp_alias": lambda: package(_generation("mtp", _mtp("mtp"))),
    "pkg_proposer": lambda: package(_generation(
        "mtp", Strategy("mtp", "native-mtp", window_policy=FIXED, proposer="nextn"),
        proposers=(Proposer("nextn", "native-mtp", 1, (3,)),))),
    "pkg_no_generation": lambda: package(None, nextn_layers=()),
    "pkg_null_sd": lambda: package(Generation(None)),
    "pkg_ngram_default": lambda: package(_generation("ngram", NGRAM), nextn_layers=()),
    "pkg_ngram_default_with_mtp": lambda: package(_generation("ngram", NGRAM, _mtp())),
    "pkg_depth2": lambda: package(_generation("native-mtp-n1", _mtp(depth=2))),
    "pkg_empty_layers": lambda: package(_generation("native-mtp-n1", _mtp(layers=()))),
    "pkg_missing_proposer": lambda: package(_generation(
        "mtp", Strategy("mtp", "native-mtp", proposer="nextn"))),
    "pkg_composite": lambda: package(_newer()),
    "pkg_composite_old_policy": lambda: package(_newer(policy=ExtensionPolicy(5, 1, 3))),
    "pkg_composite_no_head": lambda: package(_newer(), nextn_layers=()),
    "pkg_suffix_default": lambda: package(_generation(
        "lookup", Strategy("lookup", "ngram-suffix", proposer="suffix"),
        proposers=(SUFFIX,)), nextn_layers=()),
    "pkg_unknown_default": lambda: package(_generation(
        "draft", Strategy("draft", "draft-model"), _mtp("mtp"))),
    "pkg_composite_depth2": lambda: package(_newer(nextn=Proposer("nextn", "native-mtp", 2,
                                                                  (3,)))),
    "pkg_mtp_is_composite": lambda: package(_generation(
        "mtp", Strategy("mtp", "composite", primary="nextn", extender="cache",
                        extension_policy=ExtensionPolicy(4)), proposers=(NEXTN, CACHE))),
    "gguf_proof": lambda: gguf(1),
    "split_gguf_proof": lambda: gguf(1, kind="split-gguf"),
    "gguf_metadata_only": lambda: gguf(1, nextn_layers=()),
    "gguf_tensors_only": lambda: gguf(None),
    "gguf_zero": lambda: gguf(0),
    "gguf_plain": lambda: gguf(None, nextn_layers=()),
}


def resolve(source: Source, requested: str | None, env: dict | None = None,
            scope: str = "defaults.speculative.strategy", max_draft_tokens: int | None = None):
  model_id = source.manifest.model_id if source.manifest else source.path
  return speculative.resolve_speculative(
      model_id=model_id, requested=requested, scope=scope, source_kind=source.kind,
      manifest=source.manifest, layer_count=source.layer_count, gguf_metadata=source.metadata,
      tensor_names=source.tensors, env={} if env is None else env, source_path=source.path,
      max_draft_tokens=max_draft_tokens)


class ConsumerAssertions:
  """Shared by the matrix, kill-switch and source tests (a mixin for absltest cases)."""

  def assert_consumers(self, resolution, expected: bool, layer_count: int = 4):
    """The flag must reach the loader, every stage and the server unchanged."""
    load, settings = consumers_from_resolution(resolution, dtype="float32", max_len=64, slots=2,
                                               prefill_buckets=(16, 32))
    self.assertIs(load.native_mtp, expected)
    cfg = types.SimpleNamespace(n_layers=layer_count - 1, has_mtp=True)   # what layouts read
    for ranges in (planning.plan_stages(layer_count, 2),
                   planning.plan_stages(layer_count, 2, splits=[1]),
                   planning.plan_stages(layer_count, 3), planning.plan_stages(layer_count, 1)):
      layouts = PipelinePlan(tuple(ranges), meshes=()).layouts(cfg, with_mtp=load.native_mtp)
      self.assertIs(layouts[-1].mtp, expected)        # the NextN block runs on the last stage
      self.assertFalse(any(layout.mtp for layout in layouts[:-1]))
      self.assertTrue(layouts[0].embeddings and layouts[-1].output)
    self.assertIs(settings.native_mtp, expected)
    self.assertEqual(settings.speculative_strategy, resolution.requested)
    self.assertEqual(settings.speculative_reason, resolution.reason)


MATRIX_ON_OFF = [
    # (case name, strategy, source, native MTP)
    ("disabled_package_with_head", "disabled", "pkg_mtp", False),
    ("disabled_gguf_with_proof", "disabled", "gguf_proof", False),
    ("disabled_package_without_generation", "disabled", "pkg_no_generation", False),
    ("auto_pkg_default", "auto", "pkg_mtp", True),
    ("auto_pkg_default_mtp_id", "auto", "pkg_mtp_alias", True),
    ("auto_pkg_default_via_proposer", "auto", "pkg_proposer", True),
    ("auto_no_generation", "auto", "pkg_no_generation", False),
    ("auto_null_speculative_decoding", "auto", "pkg_null_sd", False),
    ("auto_ngram_default", "auto", "pkg_ngram_default", False),
    ("auto_ngram_default_beside_mtp", "auto", "pkg_ngram_default_with_mtp", False),
    ("auto_depth_2", "auto", "pkg_depth2", False),
    ("auto_empty_layers", "auto", "pkg_empty_layers", False),
    ("auto_gguf_with_head", "auto", "gguf_proof", False),
    ("auto_split_gguf_with_head", "auto", "split_gguf_proof", False),
    ("named_pkg", "native-mtp-n1", "pkg_mtp", True),
    ("named_pkg_mtp_id", "native-mtp-n1", "pkg_mtp_alias", True),
    ("named_pkg_non_default", "native-mtp-n1", "pkg_ngram_default_with_mtp", True),
    ("named_pkg_via_proposer", "native-mtp-n1", "pkg_proposer", True),
    ("alias_pkg", "mtp", "pkg_mtp", True),
    ("named_gguf_proof", "native-mtp-n1", "gguf_proof", True),
    ("named_split_gguf_proof", "native-mtp-n1", "split_gguf_proof", True),
]

MATRIX_ERRORS = [
    # (case name, source, required substrings)
    ("no_generation", "pkg_no_generation",
     [ERR_PACKAGE, "the package advertises no generation block"]),
    ("null_sd", "pkg_null_sd", [ERR_PACKAGE, "no speculative_decoding block"]),
    ("ngram_default", "pkg_ngram_default",
     [ERR_PACKAGE, 'no strategy named native-mtp-n1 or mtp (default "ngram", type ngram-simple)']),
    ("depth_2", "pkg_depth2", [ERR_PACKAGE, 'strategy "native-mtp-n1" with prediction_depth 2']),
    ("empty_layers", "pkg_empty_layers",
     [ERR_PACKAGE, 'strategy "native-mtp-n1" with no layer_indices']),
    ("missing_proposer", "pkg_missing_proposer", [ERR_PACKAGE, 'proposer "nextn" is not declared']),
    ("gguf_metadata_only", "gguf_metadata_only",
     [ERR_GGUF, "glm4moe.nextn_predict_layers = 1, 0 blk.N.nextn.* tensors found"]),
    ("gguf_tensors_only", "gguf_tensors_only",
     [ERR_GGUF, "glm4moe.nextn_predict_layers = absent, 4 blk.N.nextn.* tensors found"]),
    ("gguf_zero", "gguf_zero", [ERR_GGUF, "glm4moe.nextn_predict_layers = 0, 4 blk.N.nextn.*"]),
    ("gguf_plain", "gguf_plain", [ERR_GGUF, "= absent, 0 blk.N.nextn.* tensors found"]),
]


class MatrixTest(ConsumerAssertions, parameterized.TestCase):

  @parameterized.named_parameters(*MATRIX_ON_OFF)
  def test_row(self, strategy, source_name, expected):
    resolution = resolve(SOURCES[source_name](), strategy)
    self.assertIs(resolution.native_mtp, expected)
    self.assertFalse(resolution.disabled_by_env)
    self.assertEqual(resolution.scope, "defaults.speculative.strategy")
    self.assertIn("defaults.speculative.strategy", resolution.reason)
    self.assertEqual(resolution.mtp_layer_index, 3 if expected else None)
    if expected and source_name.startswith("pkg"):
      self.assertEqual(resolution.window_policy, {"default": "fixed", "initial_window": 1,
                                                  "min_window": 1, "max_window": 1,
                                                  "pipeline_depth": None})
    else:
      self.assertIsNone(resolution.window_policy)
    self.assert_consumers(resolution, expected)

  @parameterized.named_parameters(*MATRIX_ERRORS)
  def test_named_strategy_without_support_fails(self, source_name, substrings):
    with self.assertRaises(SpeculativeConfigError) as caught:
      resolve(SOURCES[source_name](), "native-mtp-n1")
    for text in substrings:
      self.assertIn(text, str(caught.exception))

  def test_package_error_text(self):
    with self.assertRaises(SpeculativeConfigError) as caught:
      resolve(SOURCES["pkg_ngram_default"](), "native-mtp-n1",
              scope="models.glm.speculative.strategy")
    self.assertEqual(
        caught.exception.message,
        'model org/tiny-glm:F32: speculative.strategy = "native-mtp-n1" requires package '
        "generation metadata advertising native-mtp-n1; the package advertises no strategy named "
        'native-mtp-n1 or mtp (default "ngram", type ngram-simple) (from '
        "models.glm.speculative.strategy). Remedy: set the strategy to auto or disabled, or "
        "re-split the source GGUF with `python -m mtpjax.package.split`.")
    self.assertEqual(caught.exception.path, "/pkgs/tiny")

  def test_gguf_error_text(self):
    with self.assertRaises(SpeculativeConfigError) as caught:
      resolve(SOURCES["gguf_metadata_only"](), "native-mtp-n1")
    self.assertEqual(
        caught.exception.message,
        'model /models/tiny.gguf: speculative.strategy = "native-mtp-n1" requires proven '
        "native-mtp-n1 support: glm4moe.nextn_predict_layers = 1, 0 blk.N.nextn.* tensors found.")
    self.assertIn("remedy:", str(caught.exception))

  def test_auto_off_reasons_say_why(self):
    self.assertIn('default "ngram" (ngram-simple)',
                  resolve(SOURCES["pkg_ngram_default"](), "auto").reason)
    self.assertIn("no generation block", resolve(SOURCES["pkg_no_generation"](), "auto").reason)
    gguf_reason = resolve(SOURCES["gguf_proof"](), "auto").reason
    self.assertIn("direct GGUF", gguf_reason)
    self.assertIn("native-mtp-n1 to opt in", gguf_reason)

  def test_auto_with_layer_46_of_47(self):
    """docs/LAYER_PACKAGES.md §11: default native-mtp-n1 with layers [46] turns all three on."""
    source = package(_generation("native-mtp-n1", _mtp(layers=(46,))), nextn_layers=(46,),
                     layer_count=47)
    resolution = resolve(source, None, scope=speculative.BUILTIN_SCOPE)
    self.assertTrue(resolution.native_mtp)
    self.assertEqual(resolution.requested, "auto")
    self.assertEqual(resolution.mtp_layer_index, 46)
    self.assert_consumers(resolution, True, layer_count=47)

  def test_unknown_source_kind_is_rejected(self):
    with self.assertRaises(ValueError):
      speculative.resolve_speculative(
          model_id="m", requested="auto", scope="s", source_kind="safetensors", manifest=None,
          layer_count=1, gguf_metadata={}, tensor_names=(), env={})


class NormalizeTest(parameterized.TestCase):

  @parameterized.parameters((" Auto ", "auto"), ("MTP", "native-mtp-n1"),
                            ("native-MTP-n1", "native-mtp-n1"), ("DISABLED\n", "disabled"),
                            ("mtp", "native-mtp-n1"), ("auto", "auto"))
  def test_accepted(self, value, canonical):
    self.assertEqual(speculative.normalize_strategy(value, "a.b"), canonical)

  def test_empty(self):
    for value in ("", "   "):
      with self.assertRaises(SpeculativeConfigError) as caught:
        speculative.normalize_strategy(value, "defaults.speculative.strategy")
      self.assertEqual(caught.exception.message,
                       "defaults.speculative.strategy must not be empty when set")

  @parameterized.parameters(("NGRAM-Simple", "ngram-simple"), (" ngram-cache", "ngram-cache"),
                            ("Ngram-Suffix ", "ngram-suffix"), (" mtp-cache ", "mtp-cache"),
                            ("My_Strategy.v2", "My_Strategy.v2"), ("ngram", "ngram"))
  def test_ngram_values_and_package_ids(self, value, canonical):
    """Built-in values are matched ignoring case; anything else is a package strategy id, kept
    as written (the package is not open yet: resolution checks that it declares it)."""
    self.assertEqual(speculative.normalize_strategy(value, "a.b"), canonical)

  @parameterized.parameters("ngram simple", "-mtp", "mtp/cache", "x" * 129, 3, None)
  def test_unknown(self, value):
    with self.assertRaises(SpeculativeConfigError) as caught:
      speculative.normalize_strategy(value, "models.glm.speculative.strategy")
    self.assertEqual(caught.exception.message,
                     "models.glm.speculative.strategy must be one of: auto, native-mtp-n1, "
                     "disabled, ngram-simple, ngram-cache, ngram-suffix (alias: mtp), or a "
                     "strategy id the package declares (letters, digits, '.', '_', '-'); got "
                     f"{value!r}")

  def test_validation_and_resolution_agree(self):
    """A value the config rejects, resolution rejects with the same message; one it accepts
    resolves to the same canonical value, or, naming no strategy of this package, fails at
    resolution naming the ones it declares (before any weight is read)."""
    table = [" Auto ", "AUTO", "MTP", "Mtp", "native-MTP-n1", " disabled", "", " ", "ngram",
             "native-mtp-n2", "native_mtp_n1", "draft-model", "on", "1", "NGRAM-cache",
             "ngram simple", "a/b"]
    for value in table:
      config = glm.get_config()
      config.defaults.speculative.strategy = value
      try:
        validated = speculative.strategy_from_config(config, "glm")[0]
      except SpeculativeConfigError as error:
        validated = error.message
      try:
        resolved = resolve(SOURCES["pkg_mtp"](), value).requested
      except SpeculativeConfigError as error:
        resolved = error.message
        if validated == value.strip():
          self.assertIn(f'"{validated}" is not a strategy the package declares (declared: '
                        "native-mtp-n1)", resolved)
          continue
      self.assertEqual(validated, resolved, msg=repr(value))


class PrecedenceTest(absltest.TestCase):

  def test_builtin_auto(self):
    self.assertEqual(speculative.strategy_from_config(glm.get_config(), "glm"),
                     ("auto", "built-in default"))

  def test_defaults_beat_builtin(self):
    config = glm.get_config()
    config.defaults.speculative.strategy = "Disabled"
    self.assertEqual(speculative.strategy_from_config(config, "glm"),
                     ("disabled", "defaults.speculative.strategy"))

  def test_model_beats_defaults(self):
    config = glm.get_config()
    config.defaults.speculative.strategy = "disabled"
    config.models.glm.speculative.strategy = "mtp"
    self.assertEqual(speculative.strategy_from_config(config, "glm"),
                     ("native-mtp-n1", "models.glm.speculative.strategy"))

  def test_model_not_in_config_uses_defaults(self):
    config = glm.get_config()
    config.defaults.speculative.strategy = "native-mtp-n1"
    self.assertEqual(speculative.strategy_from_config(config, "other"),
                     ("native-mtp-n1", "defaults.speculative.strategy"))

  def test_set_but_empty_is_an_error_not_unset(self):
    config = glm.get_config()
    config.models.glm.speculative.strategy = ""
    with self.assertRaisesRegex(SpeculativeConfigError, "models.glm.speculative.strategy must"):
      speculative.strategy_from_config(config, "glm")

  def test_bad_defaults_fail_even_when_model_overrides(self):
    config = glm.get_config()
    config.defaults.speculative.strategy = "ngram simple"
    config.models.glm.speculative.strategy = "auto"
    with self.assertRaisesRegex(SpeculativeConfigError, "defaults.speculative.strategy"):
      speculative.strategy_from_config(config, "glm")


FALSE_SPELLINGS = ["0", "false", "OFF", " no ", "Disabled"]
TRUE_SPELLINGS = ["1", "TRUE", " on", "yes", "Enabled", "", "  "]


class KillSwitchTest(ConsumerAssertions, parameterized.TestCase):

  @parameterized.parameters(*FALSE_SPELLINGS)
  def test_false_turns_every_consumer_off(self, value):
    for source_name, strategy in (("pkg_mtp", "auto"), ("gguf_proof", "native-mtp-n1")):
      resolution = resolve(SOURCES[source_name](), strategy, env={"MTPJAX_NATIVE_MTP": value})
      self.assertFalse(resolution.native_mtp)
      self.assertTrue(resolution.disabled_by_env)
      self.assertIsNone(resolution.mtp_layer_index)
      self.assertIn("MTPJAX_NATIVE_MTP", resolution.reason)
      self.assert_consumers(resolution, False)

  @parameterized.parameters(*TRUE_SPELLINGS)
  def test_true_never_turns_mtp_on(self, value):
    env = {"MTPJAX_NATIVE_MTP": value}
    for source_name, strategy, expected in (
        ("pkg_mtp", "auto", True), ("pkg_no_generation", "auto", False),
        ("gguf_proof", "auto", False), ("pkg_ngram_default", "auto", False),
        ("pkg_mtp", "disabled", False)):
      resolution = resolve(SOURCES[source_name](), strategy, env=env)
      self.assertEqual(resolution, resolve(SOURCES[source_name](), strategy, env={}))
      self.assertIs(resolution.native_mtp, expected)
      self.assertFalse(resolution.disabled_by_env)
      self.assert_consumers(resolution, expected)

  @parameterized.parameters("2", "maybe", "nope", "offf")
  def test_invalid_spelling_raises(self, value):
    with self.assertRaises(SpeculativeConfigError) as caught:
      resolve(SOURCES["pkg_mtp"](), "auto", env={"MTPJAX_NATIVE_MTP": value})
    self.assertIn("MTPJAX_NATIVE_MTP must be one of", str(caught.exception))
    self.assertEqual(caught.exception.field, "MTPJAX_NATIVE_MTP")

  def test_bad_configuration_still_fails_when_off(self):
    with self.assertRaisesRegex(SpeculativeConfigError, ERR_PACKAGE):
      resolve(SOURCES["pkg_no_generation"](), "native-mtp-n1", env={"MTPJAX_NATIVE_MTP": "0"})

  def test_reads_os_environ_by_default(self):
    source = SOURCES["pkg_mtp"]()
    kwargs = dict(model_id="m", requested="auto", scope="s", source_kind="package",
                  manifest=source.manifest, layer_count=4, gguf_metadata=source.metadata,
                  tensor_names=source.tensors)
    with mock.patch.dict(os.environ, {"MTPJAX_NATIVE_MTP": "off"}):
      self.assertFalse(speculative.resolve_speculative(**kwargs).native_mtp)
    with mock.patch.dict(os.environ, {"MTPJAX_NATIVE_MTP": "on"}):
      self.assertTrue(speculative.resolve_speculative(**kwargs).native_mtp)


class ConsistencyTest(parameterized.TestCase):
  """An MTP advertisement the model cannot back fails at load, never as a silent off."""

  @parameterized.parameters("eh_proj", "enorm", "hnorm")
  def test_missing_nextn_tensor(self, missing):
    parts = tuple(p for p in NEXTN_PARTS if p != missing)
    for strategy in ("auto", "native-mtp-n1"):
      source = package(_generation("native-mtp-n1", _mtp()), parts=parts)
      with self.assertRaises(PackageError) as caught:
        resolve(source, strategy)
      text = str(caught.exception)
      self.assertIn(f"blk.3.nextn.{missing}.weight", text)
      self.assertIn("python -m mtpjax.package.split", text)
      self.assertIn("disabled", text)

  def test_advertised_layer_without_any_nextn_tensor(self):
    with self.assertRaisesRegex(PackageError, r"blk\.3\.nextn\.eh_proj\.weight is missing"):
      resolve(package(_generation("native-mtp-n1", _mtp()), nextn_layers=()), "auto")

  def test_not_the_last_layer(self):
    source = package(_generation("native-mtp-n1", _mtp(layers=(2,))), nextn_layers=(2,))
    with self.assertRaisesRegex(PackageError, r"exactly one NextN block at the last layer \(3"):
      resolve(source, "native-mtp-n1")

  def test_two_nextn_blocks(self):
    source = package(_generation("native-mtp-n1", _mtp(layers=(2, 3))), nextn_layers=(2, 3))
    with self.assertRaisesRegex(PackageError, r"NextN layers \[2, 3\]"):
      resolve(source, "auto")

  def test_gguf_head_not_last(self):
    with self.assertRaisesRegex(PackageError, "exactly one NextN block"):
      resolve(gguf(1, nextn_layers=(2,)), "native-mtp-n1")

  def test_gguf_two_predict_layers(self):
    with self.assertRaisesRegex(PackageError, "nextn_predict_layers = 2"):
      resolve(gguf(2), "native-mtp-n1")

  def test_fails_even_with_the_kill_switch_off(self):
    source = package(_generation("native-mtp-n1", _mtp()), parts=("eh_proj",))
    with self.assertRaises(PackageError):
      resolve(source, "auto", env={"MTPJAX_NATIVE_MTP": "0"})

  def test_disabled_never_inspects_the_head(self):
    source = package(_generation("native-mtp-n1", _mtp()), nextn_layers=())
    self.assertFalse(resolve(source, "disabled").native_mtp)


class WindowPolicyTest(absltest.TestCase):

  def test_policy_is_echoed(self):
    adaptive = WindowPolicy("adaptive", 1, 1, 4)
    resolution = resolve(package(_generation("mtp", _mtp("mtp", policy=adaptive))), "auto")
    self.assertEqual(resolution.window_policy, {"default": "adaptive", "initial_window": 1,
                                                "min_window": 1, "max_window": 4,
                                                "pipeline_depth": None})

  def test_other_policy_logs_that_mtpjax_drafts_one(self):
    adaptive = WindowPolicy("adaptive", 2, 1, 4)
    with self.assertLogs("absl", level="INFO") as logs:
      resolve(package(_generation("mtp", _mtp("mtp", policy=adaptive))), "auto")
    self.assertLen([line for line in logs.output if "mtpjax drafts with" in line], 1)

  def test_fixed_policy_is_silent(self):
    with self.assertNoLogs("absl", level="INFO"):
      resolve(SOURCES["pkg_mtp"](), "auto")

  def test_missing_policy(self):
    resolution = resolve(package(_generation("mtp", _mtp("mtp", policy=None))), "auto")
    self.assertTrue(resolution.native_mtp)
    self.assertIsNone(resolution.window_policy)


def _mtp_package(policy: WindowPolicy | None, name: str = "mtp") -> Source:
  return package(_generation(name, _mtp(name, policy=policy)))


class DraftWindowTest(parameterized.TestCase):
  """(min, initial, max, adaptive) per package policy and `max_draft_tokens`, hand-derived from
  draft_window.py's rules; every refusal names its field."""

  @parameterized.named_parameters(
      ("n1_fixed_1", lambda: SOURCES["pkg_mtp"](), None, DraftWindow(1, 1, 1, False)),
      ("mtp_without_policy_defaults_to_3", lambda: _mtp_package(None), None,
       DraftWindow(1, 3, 3, True)),
      ("adaptive_policy_capped_at_3", lambda: _mtp_package(WindowPolicy("adaptive", 2, 1, 6)),
       None, DraftWindow(1, 2, 3, True)),
      ("adaptive_policy_raised_by_config", lambda: _mtp_package(WindowPolicy("adaptive", 2, 1, 6)),
       5, DraftWindow(1, 2, 5, True)),
      ("fixed_policy_above_the_default", lambda: _mtp_package(WindowPolicy("fixed", 4, 4, 4)),
       None, DraftWindow(4, 4, 4, False)),
      ("policy_beyond_8_is_capped", lambda: _mtp_package(WindowPolicy("adaptive", 1, 1, 12)), 8,
       DraftWindow(1, 1, 8, True)),
      ("gguf_fixed_1", lambda: SOURCES["gguf_proof"](), None, DraftWindow(1, 1, 1, False)),
      ("gguf_set_by_config", lambda: SOURCES["gguf_proof"](), 4, DraftWindow(1, 4, 4, False)),
  )
  def test_window(self, source, max_draft_tokens, expected):
    resolution = resolve(source(), "native-mtp-n1", max_draft_tokens=max_draft_tokens)
    self.assertEqual(resolution.draft_window, expected)
    _, settings = consumers_from_resolution(resolution, dtype="float32", max_len=64, slots=2,
                                            prefill_buckets=(16,))
    self.assertEqual(settings.draft_window, expected)

  def test_off_drafts_one(self):
    resolution = resolve(_mtp_package(None), "disabled", max_draft_tokens=4)
    self.assertEqual(resolution.draft_window, DraftWindow())

  @parameterized.named_parameters(
      ("above_the_package_max", lambda: SOURCES["pkg_mtp"](), 3, "window_policy.max_window"),
      ("below_the_package_min", lambda: _mtp_package(WindowPolicy("fixed", 2, 2, 2)), 1,
       "window_policy.min_window"),
      ("zero", lambda: SOURCES["gguf_proof"](), 0, "speculative.max_draft_tokens"),
      ("nine", lambda: SOURCES["gguf_proof"](), 9, "speculative.max_draft_tokens"),
  )
  def test_refused(self, source, max_draft_tokens, field):
    with self.assertRaises(SpeculativeConfigError) as caught:
      resolve(source(), "native-mtp-n1", max_draft_tokens=max_draft_tokens)
    self.assertEqual(caught.exception.field, field)
    self.assertIn(field.split(".")[-1], caught.exception.message)

  def test_config_scopes(self):
    config = glm.get_config()
    config.defaults.speculative.max_draft_tokens = 2
    self.assertEqual(speculative.max_draft_tokens_from_config(config, "glm"),
                     (2, "defaults.speculative.max_draft_tokens"))
    config.models.glm.speculative.max_draft_tokens = 4
    self.assertEqual(speculative.max_draft_tokens_from_config(config, "glm"),
                     (4, "models.glm.speculative.max_draft_tokens"))
    config.defaults.speculative.max_draft_tokens = 9     # checked though the model overrides
    with self.assertRaises(SpeculativeConfigError) as caught:
      speculative.max_draft_tokens_from_config(config, "glm")
    self.assertEqual(caught.exception.field, "defaults.speculative.max_draft_tokens")
    config.defaults.speculative.max_draft_tokens = None
    resolution = speculative.resolve_for_source(config, "glm", _mtp_package(None), env={})
    self.assertEqual(resolution.draft_window, DraftWindow(1, 4, 4, True))
    config.models.glm.speculative.max_draft_tokens = 3
    with self.assertRaises(SpeculativeConfigError) as caught:
      speculative.resolve_for_source(config, "glm", SOURCES["pkg_mtp"](), env={})
    self.assertEqual(caught.exception.field, "window_policy.max_window")
    self.assertIn("models.glm.speculative.max_draft_tokens = 3", caught.exception.message)


class ResolveForSourceTest(ConsumerAssertions, absltest.TestCase):

  def test_package_from_config(self):
    config = glm.get_config()
    config.models.glm.speculative.strategy = "MTP"
    resolution = speculative.resolve_for_source(config, "glm", SOURCES["pkg_mtp"](), env={})
    self.assertEqual((resolution.model_id, resolution.requested, resolution.scope),
                     ("org/tiny-glm:F32", "native-mtp-n1", "models.glm.speculative.strategy"))
    self.assertTrue(resolution.native_mtp)
    self.assert_consumers(resolution, True)

  def test_gguf_uses_its_path(self):
    config = glm.get_config()
    config.defaults.speculative.strategy = "native-mtp-n1"
    with self.assertRaises(SpeculativeConfigError) as caught:
      speculative.resolve_for_source(config, "glm", SOURCES["gguf_metadata_only"](), env={})
    self.assertTrue(caught.exception.message.startswith(
        'model /models/tiny.gguf: speculative.strategy = "native-mtp-n1" requires proven'))
    resolution = speculative.resolve_for_source(config, "glm", SOURCES["gguf_proof"](), env={})
    self.assertEqual(resolution.model_id, "/models/tiny.gguf")
    self.assertTrue(resolution.native_mtp)

  def test_ngram_simple_serves_a_model_without_nextn(self):
    """`--config.defaults.speculative.strategy=ngram-simple`, and a per-model value beating it."""
    config = glm.get_config()
    config.defaults.speculative.strategy = "ngram-simple"
    for source_name in ("gguf_plain", "pkg_no_generation"):
      resolution = speculative.resolve_for_source(config, "glm", SOURCES[source_name](), env={})
      self.assertEqual((resolution.strategy_type, resolution.native_mtp, resolution.scope),
                       ("ngram-simple", False, "defaults.speculative.strategy"))
      self.assert_consumers(resolution, False)
    config.models.glm.speculative.strategy = "NGRAM-suffix"
    resolution = speculative.resolve_for_source(config, "glm", SOURCES["gguf_plain"](), env={})
    self.assertEqual((resolution.strategy_type, resolution.scope),
                     ("ngram-suffix", "models.glm.speculative.strategy"))

  def test_builtin_auto_on_gguf_stays_off(self):
    resolution = speculative.resolve_for_source(glm.get_config(), "glm", SOURCES["gguf_proof"](),
                                                env={})
    self.assertEqual((resolution.requested, resolution.scope), ("auto", "built-in default"))
    self.assertFalse(resolution.native_mtp)
    self.assert_consumers(resolution, False)


if __name__ == "__main__":
  absltest.main()
