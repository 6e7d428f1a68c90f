"""Manifest v1 validation: the rules and issue codes of docs/LAYER_PACKAGES.md §2, §5; the §9 example."""

import hashlib
import os
import re

from absl.testing import absltest
from absl.testing import parameterized

from mtpjax import errors
import package_examples as examples
from mtpjax.package import manifest as manifest_lib


def _set(path, value):
  """A mutation that sets manifest[path...] = value (path is a tuple of keys / indices)."""
  def mutate(manifest):
    target = manifest
    for key in path[:-1]:
      target = target[key]
    target[path[-1]] = value
  return mutate


def _delete(path):
  def mutate(manifest):
    target = manifest
    for key in path[:-1]:
      target = target[key]
    del target[path[-1]]
  return mutate


_STRATEGY = ("generation", "speculative_decoding", "strategies", "native-mtp-n1")
_WINDOW = _STRATEGY + ("window_policy",)


def _rename_strategy(manifest):
  strategies = manifest["generation"]["speculative_decoding"]["strategies"]
  strategies[""] = strategies.pop("native-mtp-n1")
  manifest["generation"]["speculative_decoding"]["default"] = ""


def _draft_model_default(manifest):
  manifest["generation"]["speculative_decoding"] = {
      "default": "draft", "strategies": {"draft": {"type": "draft-model"}}}


# (case name, mutation, code, message substring)
_ERROR_CASES = [
    ("schema_v3", _set(("schema_version",), 3), "unsupported_schema_version",
     "unsupported package manifest schema_version 3"),
    # a v1 body stamped 2 is read as a v2 root, which rejects the v1-only fields
    ("schema_v2_with_v1_body", _set(("schema_version",), 2), "unknown_field",
     "unknown field 'layers'"),
    ("schema_string", _set(("schema_version",), "1"), "unsupported_schema_version",
     "unsupported package manifest schema_version 1"),
    ("format", _set(("format",), "gguf"), "invalid_format",
     "package manifest format must be layer-package"),
    ("model_id_blank", _set(("model_id",), "   "), "empty_model_id",
     "package manifest model_id must not be empty"),
    ("source_path_blank", _set(("source_model", "path"), " "), "empty_source_model_path",
     "source_model path must not be empty"),
    ("source_missing", _delete(("source_model",)), "empty_source_model_path", "source_model"),
    ("source_sha_not_hex", _set(("source_model", "sha256"), "g" * 64),
     "invalid_source_model_sha256", "source_model sha256 must be a hex SHA-256 digest"),
    ("source_sha_short", _set(("source_model", "sha256"), "a" * 63),
     "invalid_source_model_sha256", "source_model sha256 must be a hex SHA-256 digest"),
    ("identity_blank", _set(("source_model", "canonical_ref"), ""), "empty_source_model_identity",
     "package manifest source_model identity fields must not be empty"),
    ("file_sha_not_hex", _set(("source_model", "files", 0, "sha256"), "xyz"),
     "invalid_source_model_file", "source_model file sha256 must be a hex SHA-256 digest"),
    ("file_path_blank", _set(("source_model", "files", 0, "path"), ""),
     "invalid_source_model_file", "source_model file path must not be empty"),
    ("layer_count_zero", _set(("layer_count",), 0), "invalid_layer_count", "layer_count"),
    ("width_zero", _set(("activation_width",), 0), "invalid_activation_width", "activation_width"),
    ("width_above_u32", _set(("activation_width",), 2**32), "invalid_activation_width",
     "activation_width"),
    ("abi_missing", _delete(("skippy_abi_version",)), "missing_skippy_abi_version",
     "skippy_abi_version"),
    ("abi_major", _set(("skippy_abi_version",), "1.1.0"), "incompatible_skippy_abi_version",
     "package ABI version 1.1.0 is not compatible with runtime ABI 0.1.0"),
    ("abi_minor", _set(("skippy_abi_version",), "0.2.0"), "incompatible_skippy_abi_version",
     "is not compatible with runtime ABI 0.1.0"),
    ("abi_no_minor", _set(("skippy_abi_version",), "0"), "incompatible_skippy_abi_version",
     "package ABI version is missing a minor version"),
    ("abi_not_numeric", _set(("skippy_abi_version",), "0.one"), "incompatible_skippy_abi_version",
     "decimal integers"),
    ("layer_out_of_range", _set(("layers", 1, "layer_index"), 5), "layer_index_out_of_range",
     "package layer index 5 exceeds layer_count 3"),
    ("layer_duplicate", _set(("layers", 1, "layer_index"), 0), "duplicate_layer",
     "package manifest contains duplicate layers: [0]"),
    ("layer_missing", _delete(("layers", 2)), "missing_layer", "package is missing layer 2"),
    ("tensor_bytes_zero_count", _set(("shared", "metadata", "tensor_bytes"), 5),
     "invalid_tensor_bytes",
     "package metadata tensor_bytes must be zero when tensor_count is zero"),
    ("tensor_bytes_missing", _set(("layers", 0, "tensor_bytes"), 0), "invalid_tensor_bytes",
     "package layer 0 tensor_bytes must be greater than zero when tensors are present"),
    ("artifact_bytes_zero", _set(("shared", "output", "artifact_bytes"), 0), "empty_artifact",
     "package output artifact_bytes must be greater than zero"),
    ("artifact_sha", _set(("shared", "embeddings", "sha256"), "zz"), "invalid_artifact_sha256",
     "package embeddings sha256 must be a hex SHA-256 digest"),
    ("path_empty", _set(("layers", 0, "path"), ""), "unsafe_artifact_path",
     "package layer 0 artifact path must not be empty"),
    ("shared_missing", _delete(("shared", "output")), "missing_artifact", "shared.output"),
    ("projector_kind_empty", _set(("projectors",), [
        {"kind": "", "path": "projectors/mmproj.gguf", "tensor_count": 1, "tensor_bytes": 1,
         "artifact_bytes": 1, "sha256": "a" * 64}]), "empty_projector_kind",
     "package projector kind must not be empty"),
    ("projector_kind_other", _set(("projectors",), [
        {"kind": "audio", "path": "projectors/audio.gguf", "tensor_count": 1, "tensor_bytes": 1,
         "artifact_bytes": 1, "sha256": "a" * 64}]), "unsupported_projector_kind",
     "unsupported package projector kind audio"),
    ("default_empty", _set(("generation", "speculative_decoding", "default"), ""),
     "empty_speculative_default", "default must not be empty"),
    ("default_unknown", _set(("generation", "speculative_decoding", "default"), "mtp"),
     "missing_speculative_default_strategy", "'mtp' is not one of the strategies"),
    ("strategy_name_empty", _rename_strategy, "empty_speculative_strategy_name",
     "speculative strategy names must not be empty"),
    ("strategy_type_empty", _set(_STRATEGY + ("type",), ""), "empty_speculative_strategy_type",
     "type must not be empty"),
    ("depth_two", _set(_STRATEGY + ("prediction_depth",), 2),
     "unsupported_native_mtp_prediction_depth",
     "native MTP strategy native-mtp-n1 must use prediction_depth 1"),
    ("layers_empty", _set(_STRATEGY + ("layer_indices",), []), "missing_native_mtp_layers",
     "native MTP strategy native-mtp-n1 must declare MTP layer_indices"),
    ("mtp_layer_out_of_range", _set(_STRATEGY + ("layer_indices",), [3]),
     "native_mtp_layer_out_of_range",
     "native MTP strategy native-mtp-n1 references layer 3, but layer_count is 3"),
    ("window_default_empty", _set(_WINDOW + ("default",), ""), "empty_window_policy_default",
     "default must not be empty"),
    ("window_zero", _set(_WINDOW + ("min_window",), 0), "invalid_window_policy_zero",
     "min_window"),
    ("window_bounds", _set(_WINDOW, {"default": "adaptive", "initial_window": 2,
                                     "min_window": 3, "max_window": 2}),
     "invalid_window_policy_bounds", "min_window 3 > max_window 2"),
    ("window_initial", _set(_WINDOW, {"default": "adaptive", "initial_window": 5,
                                      "min_window": 1, "max_window": 4}),
     "invalid_window_policy_initial", "initial_window 5 is outside [1, 4]"),
]

_UNSAFE_PATHS = ["../x", "/abs/layer.gguf", "a/./b", "a//b", "layers/../../x", "C:/x.gguf",
                 "//host/share/x", "layers\\layer-000.gguf", "layers/\x00x", ".", "layers/"]


class ExampleManifestTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.root = examples.write_example_package(examples.temporary_directory(self))

  def test_example_hashes_and_sizes_are_those_of_the_files(self):
    manifest = examples.example_manifest()
    entries = list(manifest["shared"].values()) + manifest["layers"]
    for entry in entries:
      content = (self.root / entry["path"]).read_bytes()
      self.assertEqual(hashlib.sha256(content).hexdigest(), entry["sha256"], entry["path"])
      self.assertLen(content, entry["artifact_bytes"])

  def test_example_is_valid_with_no_issue(self):
    self.assertEqual(manifest_lib.manifest_issues(examples.example_manifest(), self.root), [])

  def test_load_returns_the_typed_manifest(self):
    manifest = manifest_lib.load_manifest(self.root)
    self.assertEqual(manifest.model_id, "meshllm/GLM-4.7-Flash-MTP-GGUF:Q4_K_M")
    self.assertEqual((manifest.layer_count, manifest.activation_width), (3, 2048))
    self.assertEqual([layer.layer_index for layer in manifest.layers], [0, 1, 2])
    self.assertEqual(manifest.layers[2].path, "layers/layer-002.gguf")
    self.assertEqual(manifest.shared_embeddings.role, "embeddings")
    self.assertEqual(manifest.source_model.files[0].size_bytes, 123)
    self.assertEqual(manifest_lib.source_size_bytes(manifest.source_model), 123)
    speculative = manifest.generation.speculative_decoding
    self.assertEqual(speculative.default, "native-mtp-n1")
    strategy = speculative.strategies["native-mtp-n1"]
    self.assertEqual((strategy.type, strategy.prediction_depth, strategy.layer_indices),
                     ("native-mtp", 1, (2,)))
    self.assertEqual(strategy.window_policy, manifest_lib.WindowPolicy("fixed", 1, 1, 1))

  def test_manifest_sha256_is_the_hash_of_the_raw_bytes(self):
    data = (self.root / manifest_lib.MANIFEST_NAME).read_bytes()
    _, digest = manifest_lib.read_manifest(self.root)
    self.assertEqual(digest, hashlib.sha256(data).hexdigest())
    self.assertRegex(digest, r"^[0-9a-f]{64}$")
    # Same JSON, different bytes: a different identity.
    self.assertNotEqual(manifest_lib.manifest_sha256(data + b"\n"), digest)

  def test_layers_come_back_sorted_by_index(self):
    manifest = examples.example_manifest()
    manifest["layers"].reverse()
    parsed = manifest_lib.parse_manifest(manifest, path="m.json")
    self.assertEqual([layer.layer_index for layer in parsed.layers], [0, 1, 2])

  def test_uppercase_hex_is_accepted_and_compared_lowercase(self):
    manifest = examples.example_manifest()
    manifest["source_model"]["sha256"] = "A" * 64
    manifest["layers"][0]["sha256"] = manifest["layers"][0]["sha256"].upper()
    parsed = manifest_lib.parse_manifest(manifest, path="m.json")
    self.assertEqual(parsed.source_model.sha256, "a" * 64)
    self.assertEqual(parsed.layers[0].sha256, examples.EXAMPLE_MANIFEST["layers"][0]["sha256"])

  def test_newer_mtp_id_and_unknown_keys_are_accepted(self):
    manifest = examples.example_manifest()
    speculative = manifest["generation"]["speculative_decoding"]
    speculative["strategies"] = {"mtp": speculative["strategies"].pop("native-mtp-n1")}
    speculative["default"] = "mtp"
    manifest["generation"]["policy"] = {"anything": True}
    manifest["some_future_key"] = 1
    self.assertEqual(manifest_lib.manifest_issues(manifest), [])

  def test_strategy_with_proposer_takes_its_depth_and_layers(self):
    manifest = examples.example_manifest()
    manifest["generation"]["speculative_decoding"] = {
        "default": "mtp", "strategies": {"mtp": {"type": "native-mtp", "proposer": "nextn"}},
        "proposers": {"nextn": {"type": "native-mtp", "prediction_depth": 1,
                                "layer_indices": [2]}}}
    parsed = manifest_lib.parse_manifest(manifest, path="m.json")
    strategy = parsed.generation.speculative_decoding.strategies["mtp"]
    self.assertEqual((strategy.type, strategy.prediction_depth, strategy.layer_indices,
                      strategy.proposer), ("native-mtp", 1, (2,), "nextn"))
    manifest["generation"]["speculative_decoding"]["proposers"]["nextn"]["layer_indices"] = [7]
    self.assertIn("native_mtp_layer_out_of_range",
                  [item["code"] for item in manifest_lib.manifest_issues(manifest)])

  def test_inspection_identity(self):
    """§11: model_id, layer_count 1, activation_width 4096, source bytes 123, one mmproj."""
    manifest = examples.example_manifest()
    manifest["layer_count"] = 1
    manifest["activation_width"] = 4096
    manifest["layers"] = manifest["layers"][:1]
    del manifest["generation"]
    manifest["projectors"] = [{"kind": "mmproj", "path": "projectors/mmproj.gguf",
                               "tensor_count": 1, "tensor_bytes": 1, "artifact_bytes": 6,
                               "sha256": hashlib.sha256(b"mmproj").hexdigest()}]
    files = dict(examples.EXAMPLE_FILE_BYTES, **{"projectors/mmproj.gguf": b"mmproj"})
    root = examples.write_example_package(examples.temporary_directory(self), manifest, files)
    parsed, digest = manifest_lib.read_manifest(root)
    self.assertEqual(parsed.model_id, "meshllm/GLM-4.7-Flash-MTP-GGUF:Q4_K_M")
    self.assertEqual((parsed.layer_count, parsed.activation_width), (1, 4096))
    self.assertEqual(manifest_lib.source_size_bytes(parsed.source_model), 123)
    self.assertEqual([(p.kind, p.path) for p in parsed.projectors],
                     [("mmproj", "projectors/mmproj.gguf")])
    self.assertRegex(digest, r"^[0-9a-f]{64}$")

  def test_source_size_is_unknown_when_an_entry_lacks_it(self):
    manifest = examples.example_manifest()
    manifest["source_model"]["files"].append({"path": "second.gguf"})
    parsed = manifest_lib.parse_manifest(manifest, path="m.json")
    self.assertIsNone(manifest_lib.source_size_bytes(parsed.source_model))


class RuleTest(parameterized.TestCase):

  @parameterized.named_parameters(*_ERROR_CASES)
  def test_error_rule(self, mutate, code, message):
    manifest = examples.example_manifest()
    mutate(manifest)
    examples.assert_error_rule(self, manifest, code, message)

  @parameterized.parameters(*_UNSAFE_PATHS)
  def test_unsafe_path_is_rejected(self, path):
    manifest = examples.example_manifest()
    manifest["layers"][1]["path"] = path
    found = [item for item in manifest_lib.manifest_issues(manifest)
             if item["code"] == "unsafe_artifact_path"]
    self.assertLen(found, 1)
    self.assertIn("package layer 1 artifact path must be a safe relative path", found[0]["message"])
    self.assertIn("manifest file path must be a safe relative path", found[0]["message"])

  def test_unknown_strategy_type_is_only_a_warning(self):
    manifest = examples.example_manifest()
    _draft_model_default(manifest)
    found = manifest_lib.manifest_issues(manifest)
    self.assertEqual([(item["code"], item["severity"]) for item in found],
                     [("unsupported_speculative_strategy_type", "warning")])
    parsed = manifest_lib.parse_manifest(manifest, path="m.json")
    self.assertEqual(parsed.generation.speculative_decoding.strategies["draft"].type,
                     "draft-model")

  def test_missing_activation_width_is_a_warning_and_loads(self):
    manifest = examples.example_manifest()
    del manifest["activation_width"]
    found = manifest_lib.manifest_issues(manifest)
    self.assertEqual([(item["code"], item["severity"]) for item in found],
                     [("missing_activation_width", "warning")])
    self.assertIsNone(manifest_lib.parse_manifest(manifest, path="m.json").activation_width)

  def test_null_speculative_decoding_is_no_strategy(self):
    manifest = examples.example_manifest()
    manifest["generation"]["speculative_decoding"] = None
    parsed = manifest_lib.parse_manifest(manifest, path="m.json")
    self.assertIsNone(parsed.generation.speculative_decoding)

  def test_one_error_carries_every_issue(self):
    manifest = examples.example_manifest()
    manifest["format"] = "other"
    manifest["layers"][0]["path"] = "../escape"
    manifest["generation"]["speculative_decoding"]["strategies"]["native-mtp-n1"][
        "prediction_depth"] = 3
    with self.assertRaises(errors.ManifestError) as raised:
      manifest_lib.parse_manifest(manifest, path="m.json")
    self.assertCountEqual([item["code"] for item in raised.exception.issues],
                          ["invalid_format", "unsafe_artifact_path",
                           "unsupported_native_mtp_prediction_depth"])
    self.assertIn("3 error(s)", str(raised.exception))

  def test_many_missing_layers_are_summarised(self):
    manifest = examples.example_manifest()
    manifest["layer_count"] = 10**9
    del manifest["generation"]
    found = [item for item in manifest_lib.manifest_issues(manifest)
             if item["code"] == "missing_layer"]
    self.assertLen(found, 17)
    self.assertIn("package is missing layer 3", found[0]["message"])
    self.assertIn(f"{10**9 - 3 - 16} more", found[-1]["message"])

  def test_not_json_and_not_an_object(self):
    with self.assertRaises(errors.ManifestError) as raised:
      manifest_lib.parse_manifest(b"{not json", path="m.json")
    self.assertEqual([item["code"] for item in raised.exception.issues], ["invalid_manifest_json"])
    self.assertEqual([item["code"] for item in manifest_lib.manifest_issues([1, 2])],
                     ["invalid_manifest_json"])

  def test_missing_manifest(self):
    with self.assertRaises(errors.ManifestError) as raised:
      manifest_lib.load_manifest(examples.temporary_directory(self))
    self.assertEqual([item["code"] for item in raised.exception.issues], ["missing_manifest"])


class SymlinkTest(absltest.TestCase):

  def test_symlink_out_of_the_package_is_unsafe(self):
    base = examples.temporary_directory(self)
    root = examples.write_example_package(base / "pkg")
    (base / "outside.gguf").write_bytes(b"layer1")
    (root / "layers/layer-001.gguf").unlink()
    os.symlink(base / "outside.gguf", root / "layers/layer-001.gguf")
    manifest = examples.example_manifest()
    self.assertEqual(manifest_lib.manifest_issues(manifest), [])  # lexically the path is fine
    found = manifest_lib.manifest_issues(manifest, root)
    self.assertEqual([item["code"] for item in found], ["unsafe_artifact_path"])
    self.assertIn("safe relative", found[0]["message"])
    with self.assertRaisesRegex(errors.ManifestError, "safe relative"):
      manifest_lib.load_manifest(root)

  def test_symlink_inside_the_package_is_fine(self):
    root = examples.write_example_package(examples.temporary_directory(self))
    (root / "store").mkdir()
    (root / "layers/layer-001.gguf").rename(root / "store/l1")
    os.symlink("../store/l1", root / "layers/layer-001.gguf")
    self.assertEqual(manifest_lib.manifest_issues(examples.example_manifest(), root), [])


class AbiTest(parameterized.TestCase):
  MAJOR, MINOR, _ = manifest_lib.PACKAGE_ABI_VERSION

  @parameterized.parameters(f"{MAJOR}.{MINOR}.0", f"{MAJOR}.{MINOR}", f"{MAJOR}.{MINOR}.55",
                            f"{MAJOR}.{MINOR - 1}.9")
  def test_same_major_and_no_newer_minor_is_accepted(self, version):
    self.assertEqual(manifest_lib.check_abi_version(version)[:2],
                     tuple(int(part) for part in version.split(".")[:2]))

  @parameterized.parameters(f"{MAJOR + 1}.{MINOR}.0", f"{MAJOR}.{MINOR + 1}.0")
  def test_newer_major_or_minor_is_rejected(self, version):
    with self.assertRaisesRegex(errors.AbiError, re.escape(
        f"package ABI version {version} is not compatible with runtime ABI 0.1.0")):
      manifest_lib.check_abi_version(version)

  @parameterized.parameters(("0", "missing a minor version"), ("0.x", "decimal integers"),
                            ("0.1.0.1", "MAJ.MIN"), ("", "must not be empty"),
                            ("-1.1", "decimal integers"))
  def test_malformed_is_rejected(self, version, message):
    with self.assertRaisesRegex(errors.AbiError, message):
      manifest_lib.check_abi_version(version)

  def test_patch_defaults_to_zero(self):
    self.assertEqual(manifest_lib.parse_abi_version("0.1"), (0, 1, 0))


class HfReferenceTest(parameterized.TestCase):

  @parameterized.parameters(
      ("hf://meshllm/GLM-4.7-Flash-MTP-GGUF", "meshllm/GLM-4.7-Flash-MTP-GGUF", None),
      ("hf://ns/repo:main", "ns/repo", "main"),
      ("hf://ns/repo@0123abc", "ns/repo", "0123abc"),
      ("hf://ns/repo@v1:2", "ns/repo", "v1:2"))  # "@" is parsed first
  def test_accepted(self, ref, repo, revision):
    self.assertEqual(manifest_lib.parse_hf_reference(ref),
                     manifest_lib.HfReference(repo=repo, revision=revision))

  @parameterized.parameters("hf://", "hf://namespace-only", "hf://namespace/repo@",
                            "hf://namespace/repo:", "hf://a/b/c", "hf:///repo", "hf://ns/:rev",
                            "https://ns/repo", "ns/repo")
  def test_rejected(self, ref):
    with self.assertRaises(errors.PackageError):
      manifest_lib.parse_hf_reference(ref)


if __name__ == "__main__":
  absltest.main()
