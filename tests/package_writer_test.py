"""The writer: GGUF -> v1 package (docs/LAYER_PACKAGES.md §6), checked with gguf-py and the fixture."""

import collections
import hashlib
import json
import pathlib
import subprocess
import sys

import gguf
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from gguf import quants

from configs import glm
from mtpjax import errors, speculative
import package_examples as examples
from mtpjax.package import preflight, reader, writer
from mtpjax.testing import tiny_glm
from fixtures import FIXTURES

FIXTURE = FIXTURES / "glm4moe-tiny/glm4moe_h64-Q4_K_M.gguf"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
_VT = gguf.GGUFValueType
_RNG = np.random.default_rng(1)


def _norm(n=4):
  return _RNG.standard_normal(n).astype(np.float32)


def _gguf_contents(path):
  """(key/values without GGUF.*/split.*, {name: (type, ne, bytes)}) read by gguf-py itself."""
  file = gguf.GGUFReader(path)
  key_values = {}
  for name, field in file.fields.items():
    if not name.startswith(("GGUF.", "split.")):
      key_values[name] = field.contents()
  tensors = {t.name: (t.tensor_type, tuple(int(d) for d in t.shape), np.asarray(t.data).tobytes())
             for t in file.tensors}
  return key_values, tensors


def _package_files(root):
  manifest = json.loads((root / "model-package.json").read_text())
  entries = list(manifest["shared"].values()) + manifest["layers"]
  return manifest, [root / entry["path"] for entry in entries]


class GenerationAndWidthTest(parameterized.TestCase):

  def _split(self, tensors, key_values, arch="llama", **options):
    tmp = examples.temporary_directory(self)
    src = examples.write_gguf(tmp / "src.gguf", tensors, arch=arch, key_values=key_values)[0]
    out = writer.split_gguf(src, tmp / "pkg", model_id="org/repo:F32", **options)
    return json.loads((out / "model-package.json").read_text())

  def test_no_nextn_tensors_no_generation(self):
    manifest = self._split({"blk.0.attn_norm.weight": _norm()},
                           [("llama.embedding_length", 4, _VT.UINT32)])
    self.assertNotIn("generation", manifest)
    self.assertEqual(manifest["layer_count"], 1)

  def test_nextn_tensors_advertise_native_mtp(self):
    tensors = {"blk.0.attn_norm.weight": _norm(),
               "blk.47.nextn.eh_proj.weight": _RNG.standard_normal((4, 8)).astype(np.float32),
               "blk.47.nextn.enorm.weight": _norm(), "blk.47.nextn.hnorm.weight": _norm()}
    manifest = self._split(tensors, [("llama.embedding_length", 4, _VT.UINT32)])
    self.assertEqual(manifest["generation"], {"speculative_decoding": {
        "default": "native-mtp-n1", "strategies": {"native-mtp-n1": {
            "type": "native-mtp", "prediction_depth": 1, "layer_indices": [47],
            "window_policy": {"default": "fixed", "initial_window": 1, "min_window": 1,
                              "max_window": 1}}}}})
    self.assertEqual(manifest["layer_count"], 48)
    self.assertEqual([entry["layer_index"] for entry in manifest["layers"]], list(range(48)))
    self.assertEqual(manifest["layers"][47]["tensor_count"], 3)
    self.assertEqual(manifest["layers"][5]["tensor_count"], 0)
    self.assertEqual(manifest["layers"][5]["tensor_bytes"], 0)

  @parameterized.named_parameters(
      ("inline_mtp_id", "mtp", {"default": "mtp", "strategies": {"mtp": {
          "type": "native-mtp", "prediction_depth": 1, "layer_indices": [47],
          "window_policy": {"default": "fixed", "initial_window": 1, "min_window": 1,
                            "max_window": 1}}}}),
      ("proposers", "proposers", {
          "default": "mtp",
          "proposers": {"mtp": {"type": "native-mtp", "prediction_depth": 1,
                                "layer_indices": [47]}},
          "strategies": {"mtp": {"type": "native-mtp", "proposer": "mtp", "window_policy": {
              "default": "fixed", "initial_window": 1, "min_window": 1, "max_window": 1}}}}))
  def test_newer_generation_formats(self, generation_format, expected):
    tensors = {"blk.0.attn_norm.weight": _norm(),
               "blk.47.nextn.eh_proj.weight": _RNG.standard_normal((4, 8)).astype(np.float32),
               "blk.47.nextn.enorm.weight": _norm(), "blk.47.nextn.hnorm.weight": _norm()}
    manifest = self._split(tensors, [("llama.embedding_length", 4, _VT.UINT32)],
                           generation_format=generation_format)
    self.assertEqual(manifest["generation"], {"speculative_decoding": expected})
    plain = self._split({"blk.0.attn_norm.weight": _norm()},
                        [("llama.embedding_length", 4, _VT.UINT32)],
                        generation_format=generation_format)
    self.assertNotIn("generation", plain)

  def test_unknown_generation_format_is_refused_before_writing(self):
    tmp = examples.temporary_directory(self)
    src = examples.write_gguf(tmp / "src.gguf", {"blk.0.attn_norm.weight": _norm()},
                              key_values=[("llama.embedding_length", 4, _VT.UINT32)])[0]
    with self.assertRaisesRegex(errors.PackageError, "generation format 'v2' is not one of "
                                "native-mtp-n1, mtp, proposers"):
      writer.split_gguf(src, tmp / "pkg", model_id="org/repo:F32", generation_format="v2")
    self.assertEqual(sorted(path.name for path in tmp.iterdir()), ["src.gguf"])

  def test_window_policy_is_written_in_every_form(self):
    tensors = {"blk.0.attn_norm.weight": _norm(),
               "blk.47.nextn.eh_proj.weight": _RNG.standard_normal((4, 8)).astype(np.float32),
               "blk.47.nextn.enorm.weight": _norm(), "blk.47.nextn.hnorm.weight": _norm()}
    adaptive = {"default": "adaptive", "min_window": 1, "initial_window": 2, "max_window": 3}
    for generation_format in writer.GENERATION_FORMATS:
      manifest = self._split(tensors, [("llama.embedding_length", 4, _VT.UINT32)],
                             generation_format=generation_format, window_policy=adaptive)
      block = manifest["generation"]["speculative_decoding"]
      self.assertEqual(block["strategies"][block["default"]]["window_policy"], adaptive,
                       generation_format)

  @parameterized.named_parameters(
      ("initial_above_max", {"default": "adaptive", "min_window": 1, "initial_window": 4,
                             "max_window": 3}, "initial_window 4 is outside \\[1, 3\\]"),
      ("min_above_max", {"default": "fixed", "min_window": 3, "initial_window": 3,
                         "max_window": 2}, "min_window 3 > max_window 2"),
      ("zero", {"default": "fixed", "min_window": 0, "initial_window": 1, "max_window": 1},
       "must be integers greater than zero"),
      ("no_default", {"default": "", "min_window": 1, "initial_window": 1, "max_window": 1},
       "default must not be empty"))
  def test_bad_window_policy_is_refused_before_writing(self, policy, message):
    tmp = examples.temporary_directory(self)
    src = examples.write_gguf(tmp / "src.gguf", {"blk.0.attn_norm.weight": _norm()},
                              key_values=[("llama.embedding_length", 4, _VT.UINT32)])[0]
    with self.assertRaisesRegex(errors.PackageError, message) as caught:
      writer.split_gguf(src, tmp / "pkg", model_id="org/repo:F32", window_policy=policy)
    self.assertEqual(caught.exception.field, "window_policy")
    self.assertEqual(sorted(path.name for path in tmp.iterdir()), ["src.gguf"])

  @parameterized.parameters("adaptive:1:2", "adaptive:1:x:3", "adaptive:1:2:3:4", "")
  def test_window_policy_text_must_have_four_parts(self, text):
    with self.assertRaisesRegex(errors.PackageError, "is not DEFAULT:MIN:INITIAL:MAX"):
      writer.parse_window_policy(text)

  @parameterized.parameters(("qwen2", 3584, _VT.UINT32), ("llama", 1024, _VT.UINT16),
                            ("llama", 4096, _VT.INT32), ("llama", 64, _VT.UINT64))
  def test_activation_width_from_embedding_length(self, arch, width, value_type):
    manifest = self._split({"blk.0.attn_norm.weight": _norm()},
                           [(f"{arch}.embedding_length", width, value_type)], arch=arch)
    self.assertEqual(manifest["activation_width"], width)

  def test_zero_embedding_length_is_rejected(self):
    with self.assertRaisesRegex(errors.PackageError, "embedding_length is 0"):
      self._split({"blk.0.attn_norm.weight": _norm()},
                  [("llama.embedding_length", 0, _VT.UINT32)])

  def test_string_over_one_megabyte_is_rejected(self):
    with self.assertRaisesRegex(errors.PackageError, "exceeds safety limit"):
      self._split({"blk.0.attn_norm.weight": _norm()},
                  [("llama.embedding_length", 4, _VT.UINT32),
                   ("tokenizer.chat_template", "x" * (3 << 19), _VT.STRING)])

  def test_array_nesting_deeper_than_64_is_rejected(self):
    nested = [1]
    for _ in range(64):
      nested = [nested]  # 65 levels of arrays
    with self.assertRaisesRegex(errors.PackageError, "array nesting exceeds 64"):
      self._split({"blk.0.attn_norm.weight": _norm()},
                  [("llama.embedding_length", 4, _VT.UINT32), ("x.nested", nested, _VT.ARRAY)])

  def test_array_nesting_of_64_round_trips(self):
    tmp = examples.temporary_directory(self)
    nested = [[7], [8, 9]]   # ragged: gguf-py's reader would flatten it
    deep = [5]
    for _ in range(63):
      deep = [deep]          # exactly 64 levels of arrays
    key_values = [("llama.embedding_length", 4, _VT.UINT32), ("x.ragged", nested, _VT.ARRAY),
                  ("x.deep", deep, _VT.ARRAY)]
    src = examples.write_gguf(tmp / "src.gguf", {"blk.0.attn_norm.weight": _norm()},
                              key_values=key_values)[0]
    out = writer.split_gguf(src, tmp / "pkg", model_id="org/repo:F32")
    with reader.open_source(out) as package:
      self.assertEqual(package.metadata["x.ragged"], [[7], [8, 9]])
      self.assertEqual(package.metadata["x.deep"], deep)
    self.assertEqual((out / "shared/metadata.gguf").read_bytes().count(b"x.deep"), 1)


class RoundTripTest(absltest.TestCase):
  """Mixed ggml types, a custom alignment, typed and nested arrays: bytes in = bytes out."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = examples.temporary_directory(cls)
    rows = _RNG.standard_normal((4, 64)).astype(np.float32)
    cls.tensors = {
        "token_embd.weight": _RNG.standard_normal((8, 32)).astype(np.float32),
        "rope_freqs.weight": _norm(2),
        "blk.0.attn_norm.weight": _norm(32),
        "blk.0.attn_q.weight": _RNG.standard_normal((32, 32)).astype(np.float16),
        "blk.1.attn_norm.weight": _norm(32),
        "output_norm.weight": _norm(32),
    }
    path = cls.tmp / "src.gguf"
    file = gguf.GGUFWriter(path, "llama")
    file.add_custom_alignment(64)
    file.add_uint32("llama.embedding_length", 32)
    file.add_key_value("llama.u16s", [1, 2, 65535], _VT.ARRAY, sub_type=_VT.UINT16)
    file.add_key_value("x.nested", [[1, 2], [3]], _VT.ARRAY)
    file.add_key_value("x.flag", True, _VT.BOOL)
    file.add_key_value("x.f64", 0.125, _VT.FLOAT64)
    file.add_array("tokenizer.ggml.tokens", ["<s>", "é", "🙂"])
    for name, array in cls.tensors.items():
      file.add_tensor(name, array)
    for name, qtype in (("blk.1.ffn_up.weight", gguf.GGMLQuantizationType.Q8_0),
                        ("output.weight", gguf.GGMLQuantizationType.BF16)):
      data = quants.quantize(rows, qtype)
      file.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    file.write_header_to_file()
    file.write_kv_data_to_file()
    file.write_tensors_to_file()
    file.close()
    cls.source = path
    cls.out = writer.split_gguf(path, cls.tmp / "pkg", model_id="org/repo:MIX")
    cls.source_kv, cls.source_tensors = _gguf_contents(path)

  def test_every_fragment_repeats_the_key_values_and_alignment(self):
    _, files = _package_files(self.out)
    for path in files:
      key_values, _ = _gguf_contents(path)
      self.assertEqual(key_values, self.source_kv, path)
      self.assertEqual(gguf.GGUFReader(path).alignment, 64)
    self.assertEqual(self.source_kv["x.nested"], [1, 2, 3])  # gguf-py flattens; we do not:
    with reader.open_source(self.out) as package:
      self.assertEqual(package.metadata["x.nested"], [[1, 2], [3]])
      self.assertEqual(package.metadata["llama.u16s"], [1, 2, 65535])
      self.assertEqual(package.metadata["tokenizer.ggml.tokens"], ["<s>", "é", "🙂"])

  def test_tensors_are_byte_identical_and_in_exactly_one_artifact(self):
    manifest, files = _package_files(self.out)
    homes = collections.defaultdict(list)
    for path in files:
      _, tensors = _gguf_contents(path)
      for name, record in tensors.items():
        self.assertEqual(record, self.source_tensors[name], name)
        homes[name].append(path.relative_to(self.out).as_posix())
    self.assertEqual(homes["rope_freqs.weight"],  # metadata role: replicated everywhere
                     [entry.relative_to(self.out).as_posix() for entry in files])
    del homes["rope_freqs.weight"]
    self.assertEqual(dict(homes), {
        "token_embd.weight": ["shared/embeddings.gguf"],
        "blk.0.attn_norm.weight": ["layers/layer-000.gguf"],
        "blk.0.attn_q.weight": ["layers/layer-000.gguf"],
        "blk.1.attn_norm.weight": ["layers/layer-001.gguf"],
        "blk.1.ffn_up.weight": ["layers/layer-001.gguf"],
        "output_norm.weight": ["shared/output.gguf"], "output.weight": ["shared/output.gguf"]})
    for entry in list(manifest["shared"].values()) + manifest["layers"]:
      content = (self.out / entry["path"]).read_bytes()
      _, tensors = _gguf_contents(self.out / entry["path"])
      self.assertEqual((entry["artifact_bytes"], entry["sha256"]),
                       (len(content), hashlib.sha256(content).hexdigest()))
      self.assertEqual((entry["tensor_count"], entry["tensor_bytes"]),
                       (len(tensors), sum(len(record[2]) for record in tensors.values())))

  def test_manifest_fields(self):
    manifest, _ = _package_files(self.out)
    self.assertEqual((manifest["schema_version"], manifest["format"], manifest["layer_count"],
                      manifest["activation_width"], manifest["skippy_abi_version"],
                      manifest["projectors"]), (1, "layer-package", 2, 32, "0.1.0", []))
    self.assertIsInstance(manifest["created_at_unix_secs"], int)
    source = manifest["source_model"]
    digest = hashlib.sha256(self.source.read_bytes()).hexdigest()
    self.assertEqual(source, {"path": str(self.source.absolute()), "sha256": digest,
                              "repo": "org/repo", "primary_file": "src.gguf",
                              "distribution_id": "src",
                              "files": [{"path": "src.gguf",
                                         "size_bytes": self.source.stat().st_size,
                                         "sha256": digest}]})
    self.assertTrue(preflight.preflight(self.out, check_sha=True)["valid"])


class SourceModelTest(absltest.TestCase):

  def test_explicit_coordinate_gives_canonical_ref(self):
    tmp = examples.temporary_directory(self)
    src = examples.write_gguf(tmp / "Qwen3-8B-Q4_K_M.gguf", {"blk.0.attn_norm.weight": _norm()},
                              key_values=[("llama.embedding_length", 4, _VT.UINT32)])[0]
    out = writer.split_gguf(src, tmp / "pkg", model_id="org/repo:Q4_K_M", revision="abc123")
    source = json.loads((out / "model-package.json").read_text())["source_model"]
    self.assertEqual(source["canonical_ref"], "org/repo@abc123/Qwen3-8B-Q4_K_M.gguf")
    self.assertEqual((source["repo"], source["revision"], source["primary_file"],
                      source["distribution_id"]),
                     ("org/repo", "abc123", "Qwen3-8B-Q4_K_M.gguf", "Qwen3-8B-Q4_K_M"))

  def test_local_input_without_model_id_is_refused(self):
    tmp = examples.temporary_directory(self)
    src = examples.write_gguf(tmp / "a.gguf", {"blk.0.attn_norm.weight": _norm()},
                              key_values=[("llama.embedding_length", 4, _VT.UINT32)])[0]
    for model_id in (None, "  "):
      with self.assertRaisesRegex(errors.PackageError, "--model-id"):
        writer.split_gguf(src, tmp / "pkg", model_id=model_id)
    with self.assertRaisesRegex(errors.PackageError, "not a model coordinate"):
      writer.split_gguf(src, tmp / "pkg", model_id="a")  # a path stem
    result = subprocess.run([sys.executable, "-m", "mtpjax.package.split", str(src),
                             str(tmp / "pkg")], capture_output=True, text=True, cwd=REPO_ROOT)
    self.assertEqual(result.returncode, 1)
    self.assertIn("--model-id", result.stderr)
    self.assertNotIn("Traceback", result.stderr)
    self.assertFalse((tmp / "pkg").exists())

  def test_package_input_and_unsafe_primary_file_are_refused(self):
    tmp = examples.temporary_directory(self)
    src = examples.write_gguf(tmp / "a.gguf", {"blk.0.attn_norm.weight": _norm()},
                              key_values=[("llama.embedding_length", 4, _VT.UINT32)])[0]
    with self.assertRaisesRegex(errors.PackageError, "--file"):
      writer.split_gguf(src, tmp / "pkg", model_id="org/repo:F32", primary_file="../a.gguf")
    package = writer.split_gguf(src, tmp / "pkg", model_id="org/repo:F32")
    with self.assertRaisesRegex(errors.PackageError, "already a layer package"):
      writer.split_gguf(package, tmp / "again", model_id="org/repo:F32")


class SplitGgufTest(absltest.TestCase):
  """A split GGUF written by gguf-py's own splitting, via the tiny GLM builder."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = examples.temporary_directory(cls)
    folder = cls.tmp / "UD-IQ2_M"
    folder.mkdir()
    cls.shards = tiny_glm.write_tiny_glm_gguf(folder / "tiny-UD-IQ2_M.gguf",
                                              tiny_glm.TinyGlmSpec(tensor_type="Q8_0"),
                                              split_max_tensors=25)
    cls.out = writer.split_gguf(cls.shards[1], cls.tmp / "pkg", model_id="org/tiny:UD-IQ2_M",
                                primary_file="UD-IQ2_M/tiny-UD-IQ2_M-00001-of-00004.gguf")
    cls.manifest = json.loads((cls.out / "model-package.json").read_text())

  def test_siblings_are_listed_with_their_subdirectory(self):
    self.assertLen(self.shards, 4)
    source = self.manifest["source_model"]
    self.assertEqual(source["files"], [
        {"path": f"UD-IQ2_M/{shard.name}", "size_bytes": shard.stat().st_size,
         "sha256": hashlib.sha256(shard.read_bytes()).hexdigest()} for shard in self.shards])
    self.assertEqual(source["distribution_id"], "tiny-UD-IQ2_M")
    self.assertEqual(source["primary_file"], "UD-IQ2_M/tiny-UD-IQ2_M-00001-of-00004.gguf")
    self.assertEqual(source["sha256"], source["files"][0]["sha256"])

  def test_tensors_and_key_values_round_trip(self):
    source_tensors, source_kv = {}, {}
    for shard in self.shards:
      key_values, tensors = _gguf_contents(shard)
      source_kv.update(key_values)
      source_tensors.update(tensors)
    with reader.open_source(self.out) as package:
      self.assertEqual(set(package.tensors), set(source_tensors))
      for name, (ggml_type, ne, data) in source_tensors.items():
        info = package.tensors[name]
        self.assertEqual((info.ggml_type, info.ne), (ggml_type, ne), name)
        self.assertEqual(np.asarray(package.raw(name)).tobytes(), data, name)
    self.assertEqual(_gguf_contents(self.out / "shared/metadata.gguf")[0], source_kv)
    self.assertEqual(self.manifest["generation"]["speculative_decoding"]["strategies"][
        "native-mtp-n1"]["layer_indices"], [3])


class FixtureTest(absltest.TestCase):
  """The llama.cpp-made glm4moe-tiny Q4_K_M file (mixed quant types, a NextN block)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = examples.temporary_directory(cls)
    cls.out = writer.split_gguf(FIXTURE, cls.tmp / "pkg", model_id="zai-org/glm4moe-tiny:Q4_K_M")

  def test_preflight_is_valid_and_advertises_mtp(self):
    report = preflight.preflight(self.out, stages=2, check_sha=True)
    self.assertTrue(report["valid"], report["issues"])
    self.assertEqual(report["issues"], [])
    strategies = report["generation"]["speculative_decoding"]["strategies"]
    self.assertEqual(report["generation"]["speculative_decoding"]["default"], "native-mtp-n1")
    self.assertEqual([(s["name"], s["type"], s["layer_indices"]) for s in strategies],
                     [("native-mtp-n1", "native-mtp", [3])])
    self.assertEqual((report["layer_count"], report["activation_width"]), (4, 64))

  def test_tensors_read_back_byte_identical(self):
    expected = {t.name: t for t in gguf.GGUFReader(FIXTURE).tensors}
    with reader.open_source(self.out, verify="sha256") as package:
      self.assertEqual(set(package.tensors), set(expected))
      self.assertLen(expected, 79)
      for name, tensor in expected.items():
        info = package.tensors[name]
        self.assertEqual((info.ggml_type, info.ne), (tensor.tensor_type,
                                                     tuple(int(d) for d in tensor.shape)), name)
        self.assertEqual(np.asarray(package.raw(name)).tobytes(),
                         np.asarray(tensor.data).tobytes(), name)


class GenerationFormatTest(absltest.TestCase):
  """The llama.cpp-made fixture (NextN block at layer 3) split in every era's generation form:
  each package opens byte-identical and resolves to the same native MTP as the first era's."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = examples.temporary_directory(cls)
    cls.packages = {form: writer.split_gguf(FIXTURE, cls.tmp / form, generation_format=form,
                                            model_id="zai-org/glm4moe-tiny:Q4_K_M")
                    for form in writer.GENERATION_FORMATS}

  def _resolve(self, source, strategy, env):
    config = glm.get_config()
    config.defaults.speculative.strategy = strategy
    resolution = speculative.resolve_for_source(config, "glm", source, env=env)
    return (resolution.native_mtp, resolution.mtp_layer_index, resolution.window_policy,
            resolution.requested, resolution.disabled_by_env)

  def test_every_form_is_valid_and_differs_only_in_generation(self):
    manifests = {}
    for form, package in self.packages.items():
      report = preflight.preflight(package, check_sha=True)
      self.assertEqual((report["valid"], report["issues"]), (True, []), form)
      manifest = json.loads((package / "model-package.json").read_text())
      for varying in ("generation", "created_at_unix_secs"):
        manifest.pop(varying)
      manifests[form] = manifest
    self.assertEqual(manifests["mtp"], manifests["native-mtp-n1"])
    self.assertEqual(manifests["proposers"], manifests["native-mtp-n1"])

  def test_every_form_opens_the_same_tensors_and_metadata(self):
    contents = {}
    for form, package in self.packages.items():
      with reader.open_source(package, verify="sha256") as source:
        contents[form] = (source.metadata, {name: (info.ggml_type, info.ne,
                                                   np.asarray(source.raw(name)).tobytes())
                                            for name, info in source.tensors.items()})
    self.assertEqual(contents["mtp"], contents["native-mtp-n1"])
    self.assertEqual(contents["proposers"], contents["native-mtp-n1"])

  def test_every_form_resolves_like_the_first_era(self):
    fixed = {"default": "fixed", "initial_window": 1, "min_window": 1, "max_window": 1,
             "pipeline_depth": None}
    expected = {None: (True, 3, fixed, "auto", False),
                "mtp": (True, 3, fixed, "native-mtp-n1", False),
                "native-mtp-n1": (True, 3, fixed, "native-mtp-n1", False),
                "disabled": (False, None, None, "disabled", False)}
    for form, package in self.packages.items():
      with reader.open_source(package) as source:
        for strategy, want in expected.items():
          self.assertEqual(self._resolve(source, strategy, {}), want, (form, strategy))
        self.assertEqual(self._resolve(source, None, {"MTPJAX_NATIVE_MTP": "0"}),
                         (False, None, None, "auto", True), form)

  def test_command_line_writes_the_proposers_form(self):
    out = self.tmp / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "mtpjax.package.split", str(FIXTURE), str(out),
         "--model-id", "zai-org/glm4moe-tiny:Q4_K_M", "--generation-format", "proposers"],
        capture_output=True, text=True, cwd=REPO_ROOT)
    self.assertEqual(result.returncode, 0, result.stderr)
    written = json.loads((out / "model-package.json").read_text())["generation"]
    expected = json.loads((self.packages["proposers"] / "model-package.json").read_text())
    self.assertEqual(written, expected["generation"])
    self.assertEqual(written["speculative_decoding"]["proposers"]["mtp"]["layer_indices"], [3])


  def test_command_line_writes_a_window_policy_and_refuses_a_bad_one(self):
    command = [sys.executable, "-m", "mtpjax.package.split", str(FIXTURE),
               "--model-id", "zai-org/glm4moe-tiny:Q4_K_M", "--generation-format", "mtp"]
    good = subprocess.run(command + [str(self.tmp / "cli-window"), "--window-policy",
                                     "adaptive:1:2:3"],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    self.assertEqual(good.returncode, 0, good.stderr)
    written = json.loads((self.tmp / "cli-window" / "model-package.json").read_text())
    self.assertEqual(written["generation"]["speculative_decoding"]["strategies"]["mtp"][
        "window_policy"], {"default": "adaptive", "min_window": 1, "initial_window": 2,
                           "max_window": 3})
    with reader.open_source(self.tmp / "cli-window") as source:
      resolution = speculative.resolve_for_source(glm.get_config(), "glm", source, env={})
    self.assertEqual(resolution.draft_window.as_dict(), {   # adaptive, up to 3 drafts a step
        "policy": "adaptive", "min_window": 1, "initial_window": 2, "max_window": 3})
    bad = subprocess.run(command + [str(self.tmp / "cli-bad"), "--window-policy",
                                    "adaptive:2:1:3"],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    self.assertEqual(bad.returncode, 1)
    self.assertIn("initial_window 1 is outside [2, 3]", bad.stderr)
    self.assertFalse((self.tmp / "cli-bad").exists())


class DestinationTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.tmp = examples.temporary_directory(self)
    self.good = examples.write_gguf(self.tmp / "good.gguf", {"blk.0.attn_norm.weight": _norm()},
                                    key_values=[("llama.embedding_length", 4, _VT.UINT32)])[0]
    self.bad = examples.write_gguf(self.tmp / "bad.gguf", {"blk.0.attn_norm.weight": _norm()},
                                   key_values=[("llama.embedding_length", 0, _VT.UINT32)])[0]

  def _leftovers(self):
    return sorted(path.name for path in self.tmp.iterdir() if path.name.startswith("."))

  def test_non_empty_destination_is_refused_unless_overwrite(self):
    out = self.tmp / "pkg"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with self.assertRaisesRegex(errors.PackageError, "is not empty"):
      writer.split_gguf(self.good, out, model_id="org/repo:F32")
    self.assertEqual([path.name for path in out.iterdir()], ["keep.txt"])
    writer.split_gguf(self.good, out, model_id="org/repo:F32", overwrite=True)
    self.assertFalse((out / "keep.txt").exists())
    self.assertTrue(preflight.preflight(out, check_sha=True)["valid"])
    self.assertEqual(self._leftovers(), [])

  def test_empty_destination_folder_is_used(self):
    (self.tmp / "pkg").mkdir()
    writer.split_gguf(self.good, self.tmp / "pkg", model_id="org/repo:F32")
    self.assertTrue((self.tmp / "pkg/model-package.json").is_file())

  def test_failed_write_leaves_no_manifest_and_keeps_the_old_package(self):
    out = self.tmp / "pkg"
    with self.assertRaises(errors.PackageError):
      writer.split_gguf(self.bad, out, model_id="org/repo:F32")
    self.assertFalse(out.exists())
    self.assertEqual(self._leftovers(), [])
    writer.split_gguf(self.good, out, model_id="org/repo:F32")
    before = (out / "model-package.json").read_bytes()
    with self.assertRaises(errors.PackageError):
      writer.split_gguf(self.bad, out, model_id="org/repo:F32", overwrite=True)
    self.assertEqual((out / "model-package.json").read_bytes(), before)
    self.assertEqual(self._leftovers(), [])

  def test_command_line(self):
    result = subprocess.run(
        [sys.executable, "-m", "mtpjax.package.split", str(self.good), str(self.tmp / "pkg"),
         "--model-id", "org/repo:F32", "--revision", "r1"],
        capture_output=True, text=True, cwd=REPO_ROOT)
    self.assertEqual(result.returncode, 0, result.stderr)
    summary = json.loads(result.stdout)
    self.assertEqual((summary["model_id"], summary["layer_count"]), ("org/repo:F32", 1))
    self.assertEqual(summary["manifest_sha256"], hashlib.sha256(
        (self.tmp / "pkg/model-package.json").read_bytes()).hexdigest())


if __name__ == "__main__":
  absltest.main()
