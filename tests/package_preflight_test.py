"""Preflight (docs/LAYER_PACKAGES.md §7, §11): the JSON report, stage parts, file checks and the
command."""

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading

import gguf
import numpy as np
from absl.testing import absltest

import package_examples as examples
from mtpjax import errors
from mtpjax.package import manifest as manifest_lib, writer
from mtpjax.package.preflight import preflight
from fixtures import FIXTURES

FIXTURE = FIXTURES / "glm4moe-tiny/glm4moe_h64-Q4_K_M.gguf"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
REPORT_KEYS = {"schema_version", "package_path", "valid", "model_id", "layer_count",
               "activation_width", "generation", "manifest_sha256", "checked_artifact_count",
               "missing_artifact_count", "issue_count", "issues", "artifacts", "stages"}
ISSUE_KEYS = {"severity", "code", "message", "path", "remediation"}


def _codes(report):
  return [item["code"] for item in report["issues"]]


def _command(*args):
  return subprocess.run([sys.executable, "-m", "mtpjax.package.preflight", *map(str, args)],
                        capture_output=True, text=True, cwd=REPO_ROOT)


class ExamplePackageTest(absltest.TestCase):
  """The §9 synthetic package (artifacts hold their own names, not GGUFs)."""

  def setUp(self):
    super().setUp()
    self.root = examples.write_example_package(examples.temporary_directory(self) / "pkg")

  def _with(self, mutate, files=None):
    manifest = examples.example_manifest()
    mutate(manifest)
    return examples.write_example_package(examples.temporary_directory(self) / "pkg", manifest,
                                          files)

  def test_valid_report(self):
    report = preflight(self.root)
    self.assertTrue(report["valid"])
    self.assertEqual(set(report), REPORT_KEYS)
    self.assertEqual((report["schema_version"], report["package_path"], report["model_id"],
                      report["layer_count"], report["activation_width"]),
                     (1, str(self.root), "meshllm/GLM-4.7-Flash-MTP-GGUF:Q4_K_M", 3, 2048))
    self.assertEqual(report["manifest_sha256"], hashlib.sha256(
        (self.root / "model-package.json").read_bytes()).hexdigest())
    self.assertEqual((report["checked_artifact_count"], report["missing_artifact_count"],
                      report["issue_count"], report["issues"], report["stages"]),
                     (6, 0, 0, [], []))
    self.assertEqual(report["artifacts"][3], {
        "role": "layer", "layer_index": 0, "path": "layers/layer-000.gguf", "present": True,
        "declared_artifact_bytes": 6, "actual_artifact_bytes": 6, "size_matches_manifest": True})
    self.assertEqual([a["role"] for a in report["artifacts"]],
                     ["metadata", "embeddings", "output", "layer", "layer", "layer"])

  def test_native_mtp_defaults_are_echoed(self):
    self.assertEqual(preflight(self.root)["generation"], {"speculative_decoding": {
        "default": "native-mtp-n1", "strategies": [{
            "name": "native-mtp-n1", "type": "native-mtp", "prediction_depth": 1,
            "layer_indices": [2], "window_policy": {"default": "fixed", "initial_window": 1,
                                                    "min_window": 1, "max_window": 1}}]}})

  def test_newer_generation_is_echoed(self):
    fixed = {"default": "fixed", "initial_window": 1, "min_window": 1, "max_window": 1,
             "pipeline_depth": 2}
    def newer(manifest):
      manifest["generation"]["speculative_decoding"] = {
          "default": "mtp-cache",
          "proposers": {"mtp": {"type": "native-mtp", "prediction_depth": 1,
                                "layer_indices": [2]},
                        "cache": {"type": "ngram-cache", "ngram_min": 2, "ngram_max": 4,
                                  "max_proposal_tokens": 10, "history_scope": "request"}},
          "strategies": {"mtp": {"type": "native-mtp", "proposer": "mtp", "window_policy": fixed},
                         "mtp-cache": {"type": "composite", "primary": "mtp", "extender": "cache",
                                       "extension_policy": {"max_tokens": 8}}}}
    report = preflight(self._with(newer))
    self.assertTrue(report["valid"], report["issues"])
    self.assertEqual(report["generation"], {"speculative_decoding": {
        "default": "mtp-cache",
        "proposers": [
            {"name": "mtp", "type": "native-mtp", "prediction_depth": 1, "layer_indices": [2]},
            {"name": "cache", "type": "ngram-cache", "ngram_min": 2, "ngram_max": 4,
             "max_proposal_tokens": 10, "history_scope": "request"}],
        "strategies": [
            {"name": "mtp", "type": "native-mtp", "prediction_depth": None, "layer_indices": None,
             "window_policy": fixed, "proposer": "mtp"},
            {"name": "mtp-cache", "type": "composite", "prediction_depth": None,
             "layer_indices": None, "window_policy": None, "primary": "mtp",
             "extender": "cache", "extension_policy": {"max_tokens": 8}}]}})

  def test_stage_parts(self):
    report = preflight(self.root, stages=2)
    self.assertEqual(report["stages"], [
        {"stage_index": 0, "layer_start": 0, "layer_end": 2, "includes_embeddings": True,
         "includes_output": False, "part_count": 4, "artifact_bytes": 8 + 10 + 6 + 6,
         "parts": ["metadata", "embeddings", "layer:0", "layer:1"], "missing_parts": []},
        {"stage_index": 1, "layer_start": 2, "layer_end": 3, "includes_embeddings": False,
         "includes_output": True, "part_count": 3, "artifact_bytes": 8 + 6 + 6,
         "parts": ["metadata", "layer:2", "output"], "missing_parts": []}])

  def test_stage_count_checks(self):
    report = preflight(self.root, stages=4)
    self.assertFalse(report["valid"])
    self.assertEqual(_codes(report), ["stage_count_exceeds_layer_count"])
    report = preflight(self.root, stages=0)
    self.assertEqual(_codes(report), ["invalid_stage_count"])
    self.assertIn("--stages must be greater than zero", report["issues"][0]["message"])

  def test_missing_width_and_missing_embeddings_are_reported(self):
    root = self._with(lambda manifest: manifest.pop("activation_width"))
    (root / "shared/embeddings.gguf").unlink()
    report = preflight(root, stages=2)
    self.assertFalse(report["valid"])
    self.assertEqual(_codes(report), ["missing_activation_width", "missing_artifact"])
    self.assertEqual(report["issues"][1]["path"], "shared/embeddings.gguf")
    self.assertIsNone(report["activation_width"])
    self.assertEqual(report["missing_artifact_count"], 1)
    self.assertFalse(report["artifacts"][1]["present"])
    self.assertEqual(report["stages"][0]["missing_parts"], ["embeddings"])
    for item in report["issues"]:
      self.assertLessEqual(set(item), ISSUE_KEYS)
      self.assertTrue(item["remediation"])

  def test_sha_mismatch_is_found_with_check_sha(self):
    (self.root / "layers/layer-001.gguf").write_bytes(b"layerX")  # same size
    self.assertTrue(preflight(self.root)["valid"])
    report = preflight(self.root, check_sha=True)
    self.assertFalse(report["valid"])
    self.assertEqual(_codes(report), ["artifact_sha256_mismatch"])
    self.assertEqual(report["issues"][0]["path"], "layers/layer-001.gguf")
    self.assertIn("package artifact checksum mismatch for", report["issues"][0]["message"])
    self.assertEqual([a["sha256_matches_manifest"] for a in report["artifacts"]],
                     [True, True, True, True, False, True])

  def test_size_mismatch(self):
    (self.root / "shared/output.gguf").write_bytes(b"output!")
    report = preflight(self.root, check_sha=True)
    self.assertEqual(_codes(report), ["artifact_size_mismatch"])
    self.assertEqual((report["artifacts"][2]["actual_artifact_bytes"],
                      report["artifacts"][2]["size_matches_manifest"]), (7, False))
    self.assertIn("package part size mismatch", report["issues"][0]["message"])

  def test_directory_in_place_of_a_file(self):
    (self.root / "layers/layer-002.gguf").unlink()
    (self.root / "layers/layer-002.gguf").mkdir()
    self.assertEqual(_codes(preflight(self.root)), ["artifact_not_file"])

  def test_mtp_layer_out_of_range(self):
    def two_layers(manifest):
      manifest["layer_count"] = 2
      manifest["layers"] = manifest["layers"][:2]
    report = preflight(self._with(two_layers))
    self.assertFalse(report["valid"])
    self.assertEqual(_codes(report), ["native_mtp_layer_out_of_range"])
    self.assertIn("references layer 2, but layer_count is 2", report["issues"][0]["message"])

  def test_unknown_strategy_is_a_warning_and_stays_valid(self):
    def draft_model(manifest):
      manifest["generation"]["speculative_decoding"] = {
          "default": "draft", "strategies": {"draft": {"type": "draft-model"}}}
    report = preflight(self._with(draft_model))
    self.assertTrue(report["valid"])
    self.assertEqual([(i["code"], i["severity"]) for i in report["issues"]],
                     [("unsupported_speculative_strategy_type", "warning")])

  def test_unsafe_paths_are_reported_and_never_read(self):
    outside = self.root.parent / "secret"
    outside.write_bytes(b"layer1")
    (self.root / "layers/layer-001.gguf").unlink()
    os.symlink(outside, self.root / "layers/layer-001.gguf")
    report = preflight(self.root, check_sha=True)
    self.assertEqual(_codes(report), ["unsafe_artifact_path"])
    self.assertNotIn("layers/layer-001.gguf", [a["path"] for a in report["artifacts"]])

  def test_broken_manifests(self):
    empty = examples.temporary_directory(self)
    report = preflight(empty)
    self.assertEqual((report["valid"], _codes(report)), (False, ["missing_manifest"]))
    (empty / "model-package.json").write_text("{ nope")
    self.assertEqual(_codes(preflight(empty)), ["invalid_manifest_json"])
    root = self._with(lambda manifest: manifest.update(schema_version=3))
    report = preflight(root)
    self.assertEqual(_codes(report), ["unsupported_schema_version"])
    self.assertEqual(report["artifacts"], [])

  def test_a_manifest_that_is_not_a_regular_file_inside_the_package_is_refused(self):
    # A FIFO used to block preflight forever; a symlink out of the package was read.
    fifo_root = examples.temporary_directory(self)
    os.mkfifo(fifo_root / "model-package.json")
    directory_root = examples.temporary_directory(self)
    (directory_root / "model-package.json").mkdir()
    outside = self.root.parent / "elsewhere.json"
    (self.root / "model-package.json").rename(outside)
    os.symlink(outside, self.root / "model-package.json")
    for root, code in ((fifo_root, "manifest_not_file"), (directory_root, "manifest_not_file"),
                       (self.root, "unsafe_manifest_path")):
      reports = []
      worker = threading.Thread(target=lambda: reports.append(preflight(root)), daemon=True)
      worker.start()
      worker.join(30)
      self.assertFalse(worker.is_alive(), f"preflight of {root} hangs")
      self.assertEqual((reports[0]["valid"], _codes(reports[0])), (False, [code]))
      with self.assertRaises(errors.ManifestError) as raised:
        manifest_lib.load_manifest(root)
      self.assertEqual([item["code"] for item in raised.exception.issues], [code])
      self.assertIn("re-download the package", raised.exception.remedy)


class CompletePackageTest(absltest.TestCase):

  def test_two_layers_in_two_stages(self):
    tmp = examples.temporary_directory(self)
    norm = np.ones(4, np.float32)
    tensors = {"token_embd.weight": np.ones((8, 4), np.float32), "blk.0.attn_norm.weight": norm,
               "blk.1.attn_norm.weight": norm, "output_norm.weight": norm}
    src = examples.write_gguf(tmp / "two.gguf", tensors, key_values=[
        ("llama.embedding_length", 4, gguf.GGUFValueType.UINT32)])[0]
    package = writer.split_gguf(src, tmp / "pkg", model_id="org/two:F32")
    report = preflight(package, stages=2, check_sha=True)
    self.assertTrue(report["valid"], report["issues"])
    self.assertEqual([stage["parts"] for stage in report["stages"]],
                     [["metadata", "embeddings", "layer:0"], ["metadata", "layer:1", "output"]])
    sizes = {a["path"]: a["actual_artifact_bytes"] for a in report["artifacts"]}
    self.assertEqual(report["stages"][1]["artifact_bytes"],
                     sizes["shared/metadata.gguf"] + sizes["layers/layer-001.gguf"]
                     + sizes["shared/output.gguf"])
    self.assertNotIn("generation", report)


class CommandTest(absltest.TestCase):
  """`python -m mtpjax.package.preflight` as a real subprocess, on the split fixture."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = examples.temporary_directory(cls)
    cls.package = writer.split_gguf(FIXTURE, cls.tmp / "pkg", model_id="zai-org/glm-tiny:Q4_K_M")

  def _copy(self):
    target = examples.temporary_directory(self) / "pkg"
    shutil.copytree(self.package, target)
    return target

  def _edit_manifest(self, root, mutate):
    path = root / "model-package.json"
    manifest = json.loads(path.read_text())
    mutate(manifest)
    path.write_text(json.dumps(manifest))

  def test_valid_package_exits_zero(self):
    result = _command(self.package, "--stages", 2, "--verify-sha")
    self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
    report = json.loads(result.stdout)
    self.assertTrue(report["valid"])
    self.assertEqual([stage["parts"] for stage in report["stages"]],
                     [["metadata", "embeddings", "layer:0", "layer:1"],
                      ["metadata", "layer:2", "layer:3", "output"]])

  def test_corrupt_layer_byte_fails_verify_sha(self):
    root = self._copy()
    layer = root / "layers/layer-001.gguf"
    content = bytearray(layer.read_bytes())
    content[len(content) // 2] ^= 0x01
    layer.write_bytes(bytes(content))
    for flag in ("--verify-sha", "--check_sha"):
      result = _command(root, flag)
      self.assertEqual(result.returncode, 1)
      self.assertNotIn("Traceback", result.stderr)
      report = json.loads(result.stdout)
      self.assertEqual(_codes(report), ["artifact_sha256_mismatch"])
      self.assertEqual(report["issues"][0]["path"], "layers/layer-001.gguf")
      self.assertIn(str(layer), report["issues"][0]["message"])
    self.assertEqual(_command(root).returncode, 0)  # sizes alone cannot see it

  def test_dotdot_path_is_unsafe(self):
    root = self._copy()
    self._edit_manifest(root, lambda m: m["layers"][1].update(path="../layer-001.gguf"))
    result = _command(root)
    self.assertEqual(result.returncode, 1)
    self.assertNotIn("Traceback", result.stderr)
    self.assertIn("unsafe_artifact_path", _codes(json.loads(result.stdout)))

  def test_mtp_layer_out_of_range(self):
    root = self._copy()
    self._edit_manifest(root, lambda m: m["generation"]["speculative_decoding"]["strategies"][
        "native-mtp-n1"].update(layer_indices=[4]))
    result = _command(root)
    self.assertEqual(result.returncode, 1)
    self.assertEqual(_codes(json.loads(result.stdout)), ["native_mtp_layer_out_of_range"])

  def test_garbage_never_gives_a_traceback(self):
    root = self._copy()
    (root / "model-package.json").write_bytes(b"\xff\xfe not json")
    for args in ((root,), (root.parent / "absent",), (root, "--stages", 0)):
      result = _command(*args)
      self.assertEqual(result.returncode, 1)
      self.assertNotIn("Traceback", result.stderr)
      self.assertFalse(json.loads(result.stdout)["valid"])
    (root / "model-package.json").write_text(json.dumps({"schema_version": 1, "layers": "x",
                                                         "shared": [], "generation": 5}))
    result = _command(root, "--stages", 3)
    self.assertEqual(result.returncode, 1)
    self.assertNotIn("Traceback", result.stderr)


if __name__ == "__main__":
  absltest.main()
