"""The reader: tensor roles, plain/split GGUF and package sources, stages, integrity, paths."""

import hashlib
import json
import os
import pathlib
import shutil

import gguf
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from mtpjax import errors
import package_examples as examples
from mtpjax.package import integrity, planning, reader, writer

# A tiny llama-like source: every docs/LAYER_PACKAGES.md §3 role, several ggml types, a NextN
# tensor in the last block.
_RNG = np.random.default_rng(0)
TENSORS = {
    "rope_freqs.weight": _RNG.standard_normal(2).astype(np.float32),
    "token_embd.weight": _RNG.standard_normal((8, 4)).astype(np.float32),
    "blk.0.attn_norm.weight": _RNG.standard_normal(4).astype(np.float32),
    "blk.0.ffn_up.weight": _RNG.standard_normal((6, 4)).astype(np.float16),
    "blk.1.attn_norm.weight": _RNG.standard_normal(4).astype(np.float32),
    "blk.1.nextn.eh_proj.weight": _RNG.standard_normal((4, 8)).astype(np.float32),
    "output_norm.weight": _RNG.standard_normal(4).astype(np.float32),
    "output.weight": _RNG.standard_normal((8, 4)).astype(np.float32),
}
KEY_VALUES = [("llama.embedding_length", 4, gguf.GGUFValueType.UINT32),
              ("llama.block_count", 2, gguf.GGUFValueType.UINT32),
              ("general.name", "tiny", gguf.GGUFValueType.STRING),
              ("tokenizer.ggml.tokens", ["a", "b", "c"], gguf.GGUFValueType.ARRAY)]


def _independent_tensors(paths):
  """name -> (type, ne, bytes) straight from gguf-py, over every file given."""
  found = {}
  for path in paths:
    for tensor in gguf.GGUFReader(path).tensors:
      found[tensor.name] = (tensor.tensor_type, tuple(int(d) for d in tensor.shape),
                            np.asarray(tensor.data).tobytes())
  return found


def _flip_byte(path, offset=-1):
  data = bytearray(path.read_bytes())
  data[offset] ^= 0xFF
  path.write_bytes(bytes(data))


def _rewrite_manifest(root, mutate):
  path = root / "model-package.json"
  manifest = json.loads(path.read_text())
  mutate(manifest)
  path.write_text(json.dumps(manifest))


class TensorRoleTest(parameterized.TestCase):

  @parameterized.parameters(
      ("blk.0.attn_norm.weight", ("layer", 0)), ("blk.47.nextn.eh_proj.weight", ("layer", 47)),
      ("cache_k_l12", ("layer", 12)), ("cache_k_l", ("metadata", None)),
      ("token_embd.weight", ("embedding", None)),
      ("per_layer_token_embd.weight", ("embedding", None)),
      ("output.weight", ("output", None)), ("output.bias", ("output", None)),
      ("output_norm.weight", ("final_norm", None)), ("output_norm.bias", ("final_norm", None)),
      ("rope_freqs.weight", ("metadata", None)), ("blk.x.attn_norm.weight", ("metadata", None)),
      ("xblk.0.attn_norm.weight", ("metadata", None)), ("token_embd.bias", ("metadata", None)))
  def test_role(self, name, expected):
    self.assertEqual(reader.tensor_role(name), expected)

  def test_stage_selection(self):
    select = reader.stage_selects
    self.assertTrue(select("blk.3.x", 3, 4, embeddings=False, output=False))
    self.assertFalse(select("blk.4.x", 3, 4, embeddings=False, output=False))
    self.assertTrue(select("token_embd.weight", 0, 0, embeddings=True, output=False))
    self.assertFalse(select("token_embd.weight", 0, 1, embeddings=False, output=True))
    self.assertTrue(select("output_norm.weight", 4, 4, embeddings=False, output=True))
    self.assertTrue(select("rope_freqs.weight", 0, 0, embeddings=False, output=False))


class ActivationWidthTest(absltest.TestCase):

  def _info(self, name, ne):
    return reader.TensorInfo(name, gguf.GGMLQuantizationType.F32, ne, 4, "x.gguf")

  def test_first_layer_attn_norm(self):
    infos = [self._info("blk.1.attn_norm.weight", (32,)), self._info("blk.0.attn_norm.weight",
                                                                      (4096,))]
    self.assertEqual(reader.infer_activation_width(infos), 4096)

  def test_above_u32_is_rejected(self):
    with self.assertRaisesRegex(errors.PackageError, "u32"):
      reader.infer_activation_width([self._info("blk.0.attn_norm.weight", (2**32,))])

  def test_only_the_exact_suffix_counts(self):
    infos = [self._info("blk.0.cross_attn_norm.weight", (1000,)),
             self._info("blk.0.attn_norm.weight.scale", (7,)),
             self._info("blk.0.attn_norm.weight", (64,))]
    self.assertEqual(reader.infer_activation_width(infos), 64)
    with self.assertRaisesRegex(errors.PackageError, "cannot be inferred"):
      reader.infer_activation_width(infos[:2])

  def test_hc_attn_norm_is_preferred(self):
    infos = [self._info("blk.0.attn_norm.weight", (64,)),
             self._info("blk.0.hc_attn_norm.weight", (128,))]
    self.assertEqual(reader.infer_activation_width(infos), 128)


class GgufSourceTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = examples.temporary_directory(cls)
    cls.plain = examples.write_gguf(cls.tmp / "tiny.gguf", TENSORS, key_values=KEY_VALUES)[0]
    cls.shards = examples.write_gguf(cls.tmp / "split" / "tiny.gguf", TENSORS,
                                     key_values=KEY_VALUES, split_max_tensors=3)

  def test_plain_gguf(self):
    with reader.open_source(self.plain) as source:
      self.assertEqual((source.kind, source.arch, source.layer_count), ("gguf", "llama", 2))
      self.assertIsNone(source.manifest)
      self.assertEqual(source.metadata["llama.embedding_length"], 4)
      self.assertEqual(source.metadata["tokenizer.ggml.tokens"], ["a", "b", "c"])
      self.assertFalse([key for key in source.metadata if key.startswith("GGUF.")])
      self.assertEqual(source.activation_width, 4)
      expected = _independent_tensors([self.plain])
      self.assertEqual(list(source.tensors), list(expected))
      for name, (ggml_type, ne, data) in expected.items():
        info = source.tensors[name]
        self.assertEqual((info.ggml_type, info.ne, info.n_bytes, info.path),
                         (ggml_type, ne, len(data), str(self.plain)))
        self.assertEqual(np.asarray(source.raw(name)).tobytes(), data)
        np.testing.assert_array_equal(source.raw(name), TENSORS[name])

  def test_split_gguf_from_any_shard(self):
    self.assertLen(self.shards, 3)
    with reader.open_source(self.shards[1]) as source:
      self.assertEqual(source.kind, "split-gguf")
      self.assertEqual(source.files, tuple(self.shards))
      self.assertEqual(source.metadata["split.count"], 3)
      self.assertEqual(source.metadata["general.name"], "tiny")
      expected = _independent_tensors(self.shards)
      self.assertCountEqual(source.tensors, TENSORS)
      for name, (ggml_type, ne, data) in expected.items():
        self.assertEqual((source.tensors[name].ggml_type, source.tensors[name].ne),
                         (ggml_type, ne))
        self.assertEqual(np.asarray(source.raw(name)).tobytes(), data)
      names = source.stage_tensor_names(1, 2, embeddings=False, output=True,
                                        extra=["token_embd.weight"])
      self.assertCountEqual(names, ["rope_freqs.weight", "token_embd.weight",
                                    "blk.1.attn_norm.weight", "blk.1.nextn.eh_proj.weight",
                                    "output_norm.weight", "output.weight"])

  def test_missing_sibling_is_named(self):
    folder = self.tmp / "broken"
    shutil.copytree(self.tmp / "split", folder)
    (folder / "tiny-00002-of-00003.gguf").unlink()
    with self.assertRaisesRegex(errors.PackageError,
                                "split GGUF shard .* is missing sibling .*tiny-00002-of-00003"):
      reader.open_source(folder / "tiny-00003-of-00003.gguf")

  def test_not_a_gguf(self):
    (self.tmp / "junk.gguf").write_bytes(b"not a gguf at all")
    with self.assertRaisesRegex(errors.PackageError, "cannot read GGUF"):
      reader.open_source(self.tmp / "junk.gguf")
    with self.assertRaisesRegex(errors.PackageError, "does not exist"):
      reader.open_source(self.tmp / "absent.gguf")


class PackageSourceTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = examples.temporary_directory(cls)
    source = examples.write_gguf(cls.tmp / "tiny.gguf", TENSORS, key_values=KEY_VALUES)[0]
    cls.package = writer.split_gguf(source, cls.tmp / "pkg", model_id="org/tiny:F32")
    cls.expected = _independent_tensors([source])

  def _copy(self):
    target = examples.temporary_directory(self) / "pkg"
    shutil.copytree(self.package, target)
    return target

  def test_identity_and_tensors(self):
    with reader.open_source(self.package) as source:
      self.assertEqual((source.kind, source.arch, source.layer_count), ("package", "llama", 2))
      self.assertEqual(source.manifest_sha256, hashlib.sha256(
          (self.package / "model-package.json").read_bytes()).hexdigest())
      self.assertEqual(source.metadata["general.name"], "tiny")
      self.assertCountEqual(source.tensors, self.expected)
      homes = {name: pathlib.Path(info.path).relative_to(self.package).as_posix()
               for name, info in source.tensors.items()}
      self.assertEqual(homes, {
          "rope_freqs.weight": "shared/metadata.gguf",
          "token_embd.weight": "shared/embeddings.gguf",
          "blk.0.attn_norm.weight": "layers/layer-000.gguf",
          "blk.0.ffn_up.weight": "layers/layer-000.gguf",
          "blk.1.attn_norm.weight": "layers/layer-001.gguf",
          "blk.1.nextn.eh_proj.weight": "layers/layer-001.gguf",
          "output_norm.weight": "shared/output.gguf", "output.weight": "shared/output.gguf"})
      for name, (ggml_type, ne, data) in self.expected.items():
        self.assertEqual((source.tensors[name].ggml_type, source.tensors[name].ne),
                         (ggml_type, ne))
        self.assertEqual(np.asarray(source.raw(name)).tobytes(), data)

  def test_stage_tensors_in_artifact_order(self):
    with reader.open_source(self.package) as source:
      self.assertEqual(source.stage_tensor_names(0, 1, embeddings=True, output=False),
                       ["rope_freqs.weight", "token_embd.weight", "blk.0.attn_norm.weight",
                        "blk.0.ffn_up.weight"])
      last = list(source.iter_stage_tensors(1, 2, embeddings=False, output=True,
                                            extra=["token_embd.weight"]))
      self.assertEqual([info.name for info, _ in last],
                       ["rope_freqs.weight", "token_embd.weight", "blk.1.attn_norm.weight",
                        "blk.1.nextn.eh_proj.weight", "output_norm.weight", "output.weight"])
      self.assertEqual([pathlib.Path(info.path).name for info, _ in last],
                       ["metadata.gguf", "embeddings.gguf", "layer-001.gguf", "layer-001.gguf",
                        "output.gguf", "output.gguf"])
      for info, data in last:
        self.assertEqual(np.asarray(data).tobytes(), self.expected[info.name][2])

  def test_request_errors(self):
    with reader.open_source(self.package) as source:
      with self.assertRaisesRegex(errors.PackageError,
                                  "stage layer_start must be less than layer_end"):
        source.iter_stage_tensors(1, 1, embeddings=False, output=False)
      with self.assertRaisesRegex(errors.PackageError,
                                  "stage layer_end 3 exceeds package layer_count 2"):
        source.iter_stage_tensors(0, 3, embeddings=True, output=True)
      with self.assertRaisesRegex(errors.PackageError, r"\['nope.weight'\].* not in"):
        source.stage_tensor_names(0, 1, embeddings=True, output=False, extra=["nope.weight"])

  def test_sha_mismatch_in_a_selected_artifact(self):
    root = self._copy()
    layer = root / "layers/layer-001.gguf"
    _flip_byte(layer)
    reader.open_source(root).close()  # sizes are right: verify="size" does not notice
    with self.assertRaisesRegex(errors.IntegrityError,
                                f"checksum mismatch for {layer}"):
      reader.open_source(root, verify="sha256")
    stages = planning.plan_stages(2, 2)
    reader.open_source(root, verify="sha256", verify_scope=stages[0]).close()
    with self.assertRaisesRegex(errors.IntegrityError, "checksum mismatch.*layer-001.gguf"):
      reader.open_source(root, verify="sha256", verify_scope=stages[1])

  def test_size_mismatch_fails_without_hashing(self):
    root = self._copy()
    layer = root / "layers/layer-001.gguf"
    layer.write_bytes(layer.read_bytes() + b"\0")
    with self.assertRaises(errors.IntegrityError) as raised:
      reader.open_source(root, verify="sha256")
    self.assertIn(f"package part size mismatch for {layer}", str(raised.exception))
    self.assertNotIn("checksum", str(raised.exception))
    # Outside the verified scope, the size is still checked when the part is opened.
    with reader.open_source(root, verify_scope="metadata") as source:
      with self.assertRaisesRegex(errors.IntegrityError, "size mismatch"):
        source.raw("blk.1.attn_norm.weight")

  def test_metadata_scope_verifies_exactly_the_metadata_artifact(self):
    root = self._copy()
    (root / "projectors").mkdir()
    (root / "projectors/mmproj.gguf").write_bytes(b"projector")

    def add_projector(manifest):
      manifest["projectors"] = [{"kind": "mmproj", "path": "projectors/mmproj.gguf",
                                 "tensor_count": 1, "tensor_bytes": 1, "artifact_bytes": 9,
                                 "sha256": hashlib.sha256(b"projector").hexdigest()}]
    _rewrite_manifest(root, add_projector)
    _flip_byte(root / "layers/layer-000.gguf")
    _flip_byte(root / "projectors/mmproj.gguf")
    with reader.open_source(root, verify="sha256", verify_scope="metadata") as source:
      self.assertEqual(source.verified_artifacts, ("shared/metadata.gguf",))
    with self.assertRaisesRegex(errors.IntegrityError, "checksum mismatch"):
      reader.open_source(root, verify="sha256")

    def wrong_metadata_hash(manifest):
      manifest["shared"]["metadata"]["sha256"] = "0" * 64
    _rewrite_manifest(root, wrong_metadata_hash)
    with self.assertRaisesRegex(errors.IntegrityError, "checksum mismatch.*metadata.gguf"):
      reader.open_source(root, verify="sha256", verify_scope="metadata")

  def test_symlink_out_of_the_package_is_rejected_when_a_layer_is_opened(self):
    root = self._copy()
    outside = root.parent / "outside.gguf"
    with reader.open_source(root, verify_scope="metadata") as source:
      shutil.move(root / "layers/layer-001.gguf", outside)
      os.symlink(outside, root / "layers/layer-001.gguf")
      with self.assertRaisesRegex(errors.ManifestError, "safe relative"):
        source.raw("blk.1.attn_norm.weight")
      with self.assertRaisesRegex(errors.ManifestError, "safe relative"):
        list(source.iter_stage_tensors(1, 2, embeddings=False, output=True))
    with self.assertRaisesRegex(errors.ManifestError, "safe relative"):
      reader.open_source(root)
    for path in ("../x", "/abs", "a/./b"):
      with self.assertRaisesRegex(errors.ManifestError, "safe relative"):
        integrity.resolve_part(root, path, "layer 1")

  def test_missing_activation_width_is_inferred_from_layer_zero(self):
    root = self._copy()
    _rewrite_manifest(root, lambda manifest: manifest.pop("activation_width"))
    with reader.open_source(root) as source:
      self.assertIsNone(source.manifest.activation_width)
      self.assertEqual(source.activation_width, 4)

  def test_open_through_the_manifest_path_and_bad_arguments(self):
    with reader.open_source(self.package / "model-package.json") as source:
      self.assertEqual(source.kind, "package")
    with self.assertRaisesRegex(errors.PackageError, "verify="):
      reader.open_source(self.package, verify="md5")
    with self.assertRaisesRegex(errors.PackageError, "verify_scope"):
      reader.open_source(self.package, verify_scope="layers")


if __name__ == "__main__":
  absltest.main()
