"""Schema v2 layer packages (docs/LAYER_PACKAGES.md §10): the llama.cpp-made GLM fixture and the demo
model split as v1 and as v2 read the same (tensor bytes, metadata, stage plans, speculative
resolution), and hostile v2 roots and carriers give typed errors naming the field."""

import copy
import dataclasses
import functools
import hashlib
import json
import pathlib
import shutil
import struct
import subprocess
import sys

import gguf
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from configs import glm
from mtpjax import embedded, errors, speculative
import package_examples as examples
from mtpjax.package import (carrier as carrier_lib, gguf_header, manifest as manifest_lib,
                            planning, preflight, reader, writer, writer_v2)
from mtpjax.testing import package_mutations
from fixtures import FIXTURES

FIXTURE = FIXTURES / "glm4moe-tiny/glm4moe_h64-Q8_0.gguf"
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL_ID = "zai-org/glm4moe-tiny:Q8_0"
# (model, v2 layout): "split" keeps embeddings and output apart, "common" holds every non-layer
# tensor in one artifact (upstream's newer writer)
MODELS = (("glm", "split"), ("glm", "common"), ("demo", "split"))


def _reassemble(package: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
  """One GGUF holding a v1 package's key/values and tensors: the demo model's source."""
  with reader.open_source(package) as source:
    out_file = writer.FragmentWriter(out, source.arch)
    writer.copy_key_values(out_file, source.key_values)
    for name, info in source.tensors.items():
      data = source.raw(name)
      out_file.add_tensor(name, data, raw_shape=data.shape, raw_dtype=info.ggml_type)
    out_file.write_header_to_file()
    out_file.write_kv_data_to_file()
    out_file.write_tensors_to_file()
    out_file.close()
  return out


def _contents(package: pathlib.Path) -> tuple[dict, dict]:
  with reader.open_source(package, verify="sha256") as source:
    return source.metadata, {name: (info.ggml_type, info.ne, np.asarray(source.raw(name)).tobytes())
                             for name, info in source.tensors.items()}


def _expected_package_id(root: dict) -> str:
  """The §10 identity, computed here from the rules (not by manifest_v2)."""
  normal = json.loads(json.dumps(root))
  normal["package_id"], normal["created_at_unix_secs"] = "", 0
  normal["source_model"]["files"].sort(key=lambda entry: entry["path"])
  normal["artifact_catalog"]["entries"].sort(key=lambda entry: entry["id"])
  text = json.dumps(normal, separators=(",", ":"), ensure_ascii=False)
  return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


class RoundTripTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = examples.temporary_directory(cls)
    demo_source = _reassemble(embedded.DEMO_PACKAGE, cls.tmp / "demo.gguf")
    cls.sources = {"glm": FIXTURE, "demo": demo_source}
    # the shipped demo package is the demo model's v1 form: its v2 twin declares the same
    demo_block = json.loads((embedded.DEMO_PACKAGE / "model-package.json").read_text())[
        "generation"]["speculative_decoding"]
    demo_strategy = demo_block["strategies"][demo_block["default"]]
    cls.packages = {
        ("glm", 1): writer.split_gguf(FIXTURE, cls.tmp / "glm-v1", model_id=MODEL_ID,
                                      generation_format="mtp"),
        ("glm", "split"): writer_v2.split_gguf_v2(FIXTURE, cls.tmp / "glm-v2",
                                                  model_id=MODEL_ID),
        ("glm", "common"): writer_v2.split_gguf_v2(FIXTURE, cls.tmp / "glm-v2-common",
                                                   model_id=MODEL_ID, common=True),
        ("demo", 1): embedded.DEMO_PACKAGE,
        ("demo", "split"): writer_v2.split_gguf_v2(demo_source, cls.tmp / "demo-v2",
                                                   model_id=MODEL_ID,
                                                   generation_format=demo_block["default"],
                                                   window_policy=demo_strategy["window_policy"])}

  @parameterized.parameters(*MODELS)
  def test_v2_layout_and_identity(self, model, layout):
    package = self.packages[model, layout]
    root = json.loads((package / "model-package.json").read_text())
    self.assertEqual(root["package_id"], _expected_package_id(root))
    layer_count = root["layer_count"]
    self.assertEqual(sorted(path.name for path in (package / "layers").iterdir()),
                     [f"layer-{index:05d}.gguf" for index in range(layer_count)])
    carrier = package / "shared/metadata.gguf"
    layout = gguf_header.check_header(carrier, payload_free=True)
    self.assertEqual(layout.file_bytes, layout.data_offset)
    self.assertEqual(preflight.preflight(package, check_sha=True)["issues"], [])

  @parameterized.parameters(*MODELS[:2])     # the demo's bytes are compared stage by stage
  def test_same_tensors_and_metadata_as_v1_and_the_source(self, model, layout):
    v1, v2 = _contents(self.packages[model, 1]), _contents(self.packages[model, layout])
    self.assertEqual(v1, v2)
    # the source read by the real gguf library, not by mtpjax
    source = gguf.GGUFReader(self.sources[model])
    self.assertEqual({tensor.name: np.asarray(tensor.data).tobytes() for tensor in source.tensors},
                     {name: data for name, (_, _, data) in v2[1].items()})

  @parameterized.parameters(*MODELS)
  def test_same_stage_plans_and_streams(self, model, layout):
    with reader.open_source(self.packages[model, 1]) as v1, \
         reader.open_source(self.packages[model, layout]) as v2:
      self.assertEqual((v1.layer_count, v1.activation_width, v1.metadata),
                       (v2.layer_count, v2.activation_width, v2.metadata))
      # two stages stream every tensor once (plus the MTP head's extra); one per layer too
      for stages in sorted({2, v1.layer_count}) if model == "glm" else (2,):
        plan = planning.plan_stages(v1.layer_count, stages)
        self.assertEqual(plan, planning.plan_stages(v2.layer_count, stages))
        for stage in plan:
          extra = ["token_embd.weight"] if stage.includes_output else []
          streams = [{info.name: (info.ggml_type, info.ne, np.asarray(data).tobytes())
                      for info, data in source.iter_stage_tensors(
                          stage.layer_start, stage.layer_end,
                          embeddings=stage.includes_embeddings, output=stage.includes_output,
                          extra=extra)} for source in (v1, v2)]
          self.assertEqual(streams[0], streams[1], (stages, stage))
    reports = [preflight.preflight(self.packages[model, version], stages=2)["stages"]
               for version in (1, layout)]
    self.assertEqual([stage["parts"] for stage in reports[0]],
                     [stage["parts"] for stage in reports[1]])

  @parameterized.parameters(*MODELS)
  def test_same_speculative_resolution(self, model, layout):
    def resolve(source, strategy, env):
      config = glm.get_config()
      config.defaults.speculative.strategy = strategy
      resolution = speculative.resolve_for_source(config, "glm", source, env=env)
      return (resolution.native_mtp, resolution.mtp_layer_index, resolution.window_policy,
              resolution.requested, resolution.strategy_type, resolution.strategy_id,
              resolution.disabled_by_env)

    with reader.open_source(self.packages[model, 1]) as v1, \
         reader.open_source(self.packages[model, layout]) as v2:
      for strategy in (None, "mtp", "native-mtp-n1", "disabled", "ngram-simple"):
        for env in ({}, {"MTPJAX_NATIVE_MTP": "0"}):
          self.assertEqual(resolve(v1, strategy, env), resolve(v2, strategy, env),
                           (strategy, env))
      self.assertTrue(resolve(v2, None, {})[0])

  def test_command_line_writes_v2(self):
    out = self.tmp / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "mtpjax.package.split", str(FIXTURE), str(out), "--model-id",
         MODEL_ID, "--schema-version", "2"], capture_output=True, text=True, cwd=REPO_ROOT)
    self.assertEqual(result.returncode, 0, result.stderr)
    summary = json.loads(result.stdout)
    root = json.loads((out / "model-package.json").read_text())
    self.assertEqual((root["schema_version"], summary["package_id"]), (2, root["package_id"]))
    self.assertEqual(_contents(out), _contents(self.packages["glm", "split"]))

  def test_root_alone_gives_identity_and_generation(self):
    """What a converted checkpoint keeps is the root JSON, without the package (and with its
    keys re-ordered: the identity follows the schema's field order, not the file's)."""
    text = (self.packages["glm", "split"] / "model-package.json").read_text()
    raw = json.loads(json.dumps(json.loads(text), sort_keys=True))
    root_only = manifest_lib.parse_manifest(raw, path="model-package.json")
    with reader.open_source(self.packages["glm", "split"]) as source:
      full = source.manifest
    self.assertEqual((root_only.model_id, root_only.generation, root_only.package_id),
                     (full.model_id, full.generation, full.package_id))
    self.assertEqual((root_only.layers, root_only.tensor_locator), ((), None))
    raw["package_id"] = "sha256:" + "0" * 64
    with self.assertRaisesRegex(errors.ManifestError, "package_identity_mismatch"):
      manifest_lib.parse_manifest(raw, path="model-package.json")

  def test_v2_demo_package_loads(self):
    """The one jax load (generation from identical tensors is the loader's own tests' job): the
    demo model loads from its v2 package with native MTP on."""
    import mtpjax  # pylint: disable=import-outside-toplevel
    model = mtpjax.load(str(self.packages["demo", "split"]))
    self.assertTrue(model.resolution.native_mtp)
    with reader.open_source(self.packages["demo", 1]) as v1:
      self.assertEqual(model.resolution.mtp_layer_index, v1.layer_count - 1)


class CopiedTensorsTest(absltest.TestCase):
  """Upstream's first v2 writer copied model-wide tensors (`rope_freqs.weight`) into every
  payload file while the carrier names one owner: the copies are checked and skipped."""

  def test_copies_load_once_with_the_owners_bytes(self):
    tmp = examples.temporary_directory(self)
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": rng.standard_normal((8, 4), dtype=np.float32),
               "rope_freqs.weight": rng.standard_normal(2, dtype=np.float32),
               "output_norm.weight": rng.standard_normal(4, dtype=np.float32),
               **{f"blk.{i}.attn_norm.weight": rng.standard_normal(4, dtype=np.float32)
                  for i in range(2)}}
    source = examples.write_gguf(tmp / "src.gguf", tensors,
                                 key_values=[("llama.embedding_length", 4,
                                              gguf.GGUFValueType.UINT32)])[0]
    plan = {artifact_id: dataclasses.replace(fragment, metadata_tensors=True)
            for artifact_id, fragment in writer_v2.fragment_plan(2, common=True).items()}
    package = writer.split_with(functools.partial(writer_v2.write_package, plan=plan), source,
                                tmp / "pkg", model_id=MODEL_ID, revision=None, overwrite=False,
                                primary_file=None, generation_format="mtp")
    copies = [name for name in (package / "layers").iterdir()
              if "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(name).tensors}]
    self.assertLen(copies, 2)
    with reader.open_source(package, verify="sha256") as opened:
      streamed = [info.name for info, _ in opened.iter_stage_tensors(1, 2, embeddings=False,
                                                                    output=False)]
      self.assertEqual(sorted(streamed), ["blk.1.attn_norm.weight", "rope_freqs.weight"])
      self.assertEqual(np.asarray(opened.raw("rope_freqs.weight")).tobytes(),
                       tensors["rope_freqs.weight"].tobytes())
      self.assertEqual(opened.tensors["rope_freqs.weight"].path,
                       str(package / "shared/common.gguf"))


def _rewrite_root(package: pathlib.Path, mutate, *, reidentify: bool = True) -> None:
  path = package / "model-package.json"
  root = json.loads(path.read_text())
  mutate(root)
  if reidentify:
    root["package_id"] = _expected_package_id(root)
  path.write_text(json.dumps(root))


def _patch_carrier(package: pathlib.Path, key: str, index: int, value: int,
                   *, item_offset: int = 0) -> None:
  """Overwrites one entry of a carrier key/value in place, then re-binds the catalog digest and
  the package identity so that the carrier's content is the only thing wrong."""
  carrier = package / "shared/metadata.gguf"
  data = bytearray(carrier.read_bytes())
  layout = gguf_header.walk_header(bytes(data), carrier, payload_free=True)
  value_type, offset = next((kind, offset) for name, kind, offset in layout.keys if name == key)
  if value_type == gguf.GGUFValueType.ARRAY:
    (item_type,) = struct.unpack_from("<I", data, offset)
    size = {gguf.GGUFValueType.UINT32: 4, gguf.GGUFValueType.UINT64: 8}[item_type]
    if item_offset:            # patch the array's element type instead of an element
      struct.pack_into("<I", data, offset, value)
    else:
      struct.pack_into("<I" if size == 4 else "<Q", data, offset + 12 + size * index, value)
  else:
    struct.pack_into("<I", data, offset, value)
  carrier.write_bytes(bytes(data))

  def rebind(root):
    for entry in root["artifact_catalog"]["entries"]:
      if entry["id"] == writer_v2.CARRIER_ID:
        entry["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
        entry["byte_size"] = len(data)
  _rewrite_root(package, rebind)


def _locator(package: pathlib.Path) -> list[tuple[str, int, int, int]]:
  """(name, part, offset, size) per carrier tensor, read with gguf-py's field parser."""
  carrier = package / "shared/metadata.gguf"
  layout = gguf_header.check_header(carrier, payload_free=True)
  data = carrier.read_bytes()
  columns = {}
  for name, _, offset in layout.keys:
    if name in carrier_lib.LOCATOR_ARRAYS:
      item_type, count = struct.unpack_from("<IQ", data, offset)
      dtype = "<u4" if item_type == gguf.GGUFValueType.UINT32 else "<u8"
      columns[name] = np.frombuffer(data, dtype, count, offset + 12).tolist()
  return [(extent.name, columns[carrier_lib.TENSOR_PART_KEY][i],
           columns[carrier_lib.TENSOR_OFFSET_KEY][i], columns[carrier_lib.TENSOR_SIZE_KEY][i])
          for i, extent in enumerate(layout.tensors)]


def _duplicate_first_artifact(root):
  root["artifact_catalog"]["entries"].append(dict(root["artifact_catalog"]["entries"][0]))


def _same_path_twice(root):
  entries = root["artifact_catalog"]["entries"]
  entries.append({**entries[0], "id": "another"})


def _generation(root):
  return root["generation"]["speculative_decoding"]


# (case, mutation of the root, code, text in the message)
_ROOT_CASES = [
    ("unknown_root_field", lambda root: root.update(activation_width=64), "unknown_field",
     "unknown field 'activation_width'"),
    ("tensor_catalog_in_json", lambda root: root.update(tensor_catalog={"entries": []}),
     "unknown_field", "rebuilt from the metadata carrier"),
    ("unknown_artifact_field", lambda root: root["artifact_catalog"]["entries"][0].update(
        tensor_count=1), "unknown_field", "unknown field 'tensor_count'"),
    ("uppercase_digest", lambda root: root["artifact_catalog"]["entries"][0].update(
        sha256=root["artifact_catalog"]["entries"][0]["sha256"].upper()), "invalid_digest",
     "64 lowercase hexadecimal"),
    ("duplicate_id", _duplicate_first_artifact, "duplicate_artifact", "appears more than once"),
    ("duplicate_path", _same_path_twice, "duplicate_artifact_path", "appears more than once"),
    ("parent_path", lambda root: root["artifact_catalog"]["entries"][1].update(
        path="../layer.gguf"), "invalid_path", "normalized relative package path"),
    ("backslash_path", lambda root: root["artifact_catalog"]["entries"][1].update(
        path="layers\\layer-00000.gguf"), "invalid_path", "backslash"),
    ("absolute_path", lambda root: root["artifact_catalog"]["entries"][1].update(
        path="/etc/passwd"), "invalid_path", "absolute"),
    ("bad_identifier", lambda root: root["artifact_catalog"]["entries"][1].update(id="layer 0"),
     "invalid_identifier", "unsupported characters"),
    ("unknown_primary", lambda root: root["source_model"].update(primary_file="other.gguf"),
     "unknown_source_file", "absent from source files"),
    ("source_digest", lambda root: root["source_model"].update(sha256="0" * 64),
     "source_identity_mismatch", "does not match the primary source file"),
    ("unknown_carrier", lambda root: root["source_model"].update(metadata_artifact_id="nope"),
     "unknown_artifact", "absent from artifact catalog"),
    ("carrier_not_gguf", lambda root: root["source_model"].update(
        metadata_artifact_id="embeddings") or root["artifact_catalog"]["entries"][0].update(
            path="shared/embeddings.bin"), "invalid_metadata_artifact", "not a GGUF artifact"),
    ("layer_count_zero", lambda root: root.update(layer_count=0), "invalid_field_type",
     "layer_count must be an integer >= 1"),
    ("generation_policy", lambda root: root["generation"].update(policy={}), "unknown_field",
     "unknown field 'policy'"),
    ("strategy_field", lambda root: _generation(root)["strategies"]["mtp"].update(note="x"),
     "unknown_field", "unknown field 'note'"),
    ("ngram_simple_is_v1_only", lambda root: _generation(root)["strategies"].update(
        simple={"type": "ngram-simple", "proposer": "x"}), "invalid_generation_value",
     "unknown type 'ngram-simple'"),
    ("proposer_and_inline", lambda root: _generation(root).update(
        proposers={"mtp": {"type": "native-mtp", "prediction_depth": 1, "layer_indices": [3]}})
     or _generation(root)["strategies"]["mtp"].update(proposer="mtp"),
     "invalid_generation_value", "never both"),
    ("mtp_layer_out_of_range", lambda root: _generation(root)["strategies"]["mtp"].update(
        layer_indices=[9]), "native_mtp_layer_out_of_range", "references layer 9"),
]


class HostileTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.package = writer_v2.split_gguf_v2(FIXTURE, examples.temporary_directory(cls) / "v2",
                                          model_id=MODEL_ID)

  def setUp(self):
    super().setUp()
    self.copy = examples.package_copy(self, self.package)

  def _assert_rejected(self, code: str, message: str) -> None:
    with self.assertRaises(errors.ManifestError) as raised:
      reader.open_source(self.copy)
    codes = [item["code"] for item in raised.exception.issues]
    self.assertIn(code, codes, raised.exception.issues)
    self.assertIn(message, " ".join(item["message"] for item in raised.exception.issues))
    report = preflight.preflight(self.copy)
    self.assertFalse(report["valid"])
    self.assertIn(code, [item["code"] for item in report["issues"]])

  @parameterized.named_parameters(*_ROOT_CASES)
  def test_root(self, mutate, code, message):
    _rewrite_root(self.copy, mutate)
    self._assert_rejected(code, message)

  def test_every_root_field_with_a_hostile_value_gives_issues(self):
    """Each JSON value of the root replaced by (or stripped of) each hostile value: validation
    reports an error and never raises (a new creation time alone is no error)."""
    raw = json.loads((self.package / "model-package.json").read_text())
    self.assertEqual(manifest_lib.manifest_issues(raw), [])
    for path in package_mutations._json_paths(raw):  # pylint: disable=protected-access
      for value in package_mutations.HOSTILE_JSON:
        for delete in (False, True):
          mutated = package_mutations._set_path(  # pylint: disable=protected-access
              copy.deepcopy(raw), path, value, delete)
          provenance_only = (path == ("created_at_unix_secs",) and not delete
                             and type(value) is int and value >= 0)  # outside the identity
          if mutated != raw and not provenance_only:
            found = manifest_lib.manifest_issues(mutated)
            self.assertTrue(any(item["severity"] == "error" for item in found),
                            (path, value, delete))

  def test_package_id_is_recomputed(self):
    _rewrite_root(self.copy, lambda root: root.update(model_id="someone/else:Q8_0"),
                  reidentify=False)
    self._assert_rejected("package_identity_mismatch", "does not match canonical identity")
    _rewrite_root(self.copy, lambda root: root.update(package_id="sha256:xyz"), reidentify=False)
    self._assert_rejected("invalid_digest", "package_id")

  def test_symlink_out_of_the_package(self):
    outside = examples.temporary_directory(self) / "outside.gguf"
    shutil.copy(self.copy / "layers/layer-00001.gguf", outside)
    (self.copy / "layers/layer-00001.gguf").unlink()
    (self.copy / "layers/layer-00001.gguf").symlink_to(outside)
    self._assert_rejected("invalid_path", "outside the package")

  def test_corrupt_payload_fails_before_any_tensor(self):
    path = self.copy / "layers/layer-00002.gguf"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with reader.open_source(self.copy) as source:
      stream = source.iter_stage_tensors(2, 3, embeddings=False, output=False)
      with self.assertRaisesRegex(errors.IntegrityError, "checksum mismatch"):
        next(stream)
    with self.assertRaisesRegex(errors.IntegrityError, "checksum mismatch"):
      reader.open_source(self.copy, verify="sha256")

  def test_corrupt_carrier(self):
    path = self.copy / "shared/metadata.gguf"
    data = bytearray(path.read_bytes())
    data[40] ^= 0xFF
    path.write_bytes(bytes(data))
    with self.assertRaisesRegex(errors.IntegrityError, "checksum mismatch"):
      reader.open_source(self.copy)
    self.assertIn("invalid_metadata_artifact",
                  [item["code"] for item in preflight.preflight(self.copy)["issues"]])

  def test_carrier_with_payload_bytes(self):
    path = self.copy / "shared/metadata.gguf"
    data = path.read_bytes() + b"\0" * 32
    path.write_bytes(data)
    _rewrite_root(self.copy, lambda root: [entry.update(
        byte_size=len(data), sha256=hashlib.sha256(data).hexdigest())
        for entry in root["artifact_catalog"]["entries"] if entry["id"] == "metadata"])
    with self.assertRaisesRegex(errors.PackageError, "payload-free metadata carrier"):
      reader.open_source(self.copy)

  def _same_part_pair(self):
    """Two tensors of one payload part, in offset order."""
    entries = _locator(self.copy)
    by_part = {}
    for position, (name, part, offset, size) in enumerate(entries):
      by_part.setdefault(part, []).append((offset, position, size))
    members = sorted(max(by_part.values(), key=len))
    return members[0], members[1]

  def test_overlapping_ranges(self):
    (first_offset, _, _), (_, second, _) = self._same_part_pair()
    _patch_carrier(self.copy, carrier_lib.TENSOR_OFFSET_KEY, second, first_offset)
    self._assert_rejected("overlapping_storage", "overlaps")

  def test_part_index_out_of_range(self):
    _patch_carrier(self.copy, carrier_lib.TENSOR_PART_KEY, 0, 99)
    self._assert_rejected("unknown_artifact", "missing payload part 99")

  def test_misaligned_and_out_of_bounds_ranges(self):
    entries = _locator(self.copy)
    _patch_carrier(self.copy, carrier_lib.TENSOR_OFFSET_KEY, 0, entries[0][2] + 1)
    self._assert_rejected("misaligned_offset", "not aligned")
    _patch_carrier(self.copy, carrier_lib.TENSOR_OFFSET_KEY, 0, 1 << 40)
    self._assert_rejected("storage_out_of_bounds", "exceeds artifact")

  def test_bad_alignment_size_schema_and_types(self):
    for key, index, value, code, message in (
        (carrier_lib.TENSOR_ALIGNMENT_KEY, 0, 3, "invalid_alignment", "power of two"),
        (carrier_lib.TENSOR_SIZE_KEY, 0, 4, "invalid_stored_length", "stored length 4"),
        (carrier_lib.LOCATOR_SCHEMA_KEY, 0, 2, "invalid_metadata_artifact", "locator schema"),
        (carrier_lib.PART_COUNT_KEY, 0, 5, "invalid_metadata_artifact", "part count")):
      self.copy = examples.package_copy(self, self.package)
      _patch_carrier(self.copy, key, index, value)
      self._assert_rejected(code, message)
    self.copy = examples.package_copy(self, self.package)
    _patch_carrier(self.copy, carrier_lib.TENSOR_PART_KEY, 0, int(gguf.GGUFValueType.INT32),
                   item_offset=1)
    self._assert_rejected("invalid_metadata_artifact", "must be an array of UINT32")

  def test_payload_owning_two_layers(self):
    entries = _locator(self.copy)
    layer0_part = next(part for name, part, _, _ in entries if name.startswith("blk.0."))
    small = next(index for index, (name, _, _, size) in enumerate(entries)
                 if name.startswith("blk.1.") and size <= 256)
    # a blk.1 tensor placed in layer 0's file, over its header bytes (a range no tensor uses)
    _patch_carrier(self.copy, carrier_lib.TENSOR_PART_KEY, small, layer0_part)
    _patch_carrier(self.copy, carrier_lib.TENSOR_OFFSET_KEY, small, 32)
    self._assert_rejected("unsupported_artifact_layout", "owns tensors of")

  def test_locator_that_disagrees_with_the_payload_directory(self):
    entries = _locator(self.copy)
    first, second = next((i, j) for i in range(len(entries)) for j in range(i + 1, len(entries))
                         if entries[i][1] == entries[j][1] and entries[i][3] == entries[j][3])
    # swap two same-size tensors' ranges: the carrier alone is consistent, the payload is not
    _patch_carrier(self.copy, carrier_lib.TENSOR_OFFSET_KEY, first, entries[second][2])
    _patch_carrier(self.copy, carrier_lib.TENSOR_OFFSET_KEY, second, entries[first][2])
    with reader.open_source(self.copy) as source:
      with self.assertRaisesRegex(errors.PackageError, "disagrees with the metadata carrier"):
        dict(source.tensors)


if __name__ == "__main__":
  absltest.main()
