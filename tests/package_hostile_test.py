"""Bounded parsing: crafted GGUF headers, manifests and metadata values get typed errors
(issue 20, item 5). Cases that hang or allocate without bound on a broken build run in a child
process under a deadline and an address-space limit, so they fail instead of stalling the suite."""

import json
import math
import os
import pathlib
import resource
import struct
import subprocess
import sys
import textwrap

import gguf
import package_examples as examples
from absl.testing import absltest, parameterized

import mtpjax
from mtpjax import errors
from mtpjax.gguf.tokenizer import ChatTemplate, GgufTokenizer
from mtpjax.models.config import config_from_gguf
from mtpjax.package import gguf_header, manifest as manifest_lib, preflight, reader
from mtpjax.testing import package_mutations

DEMO = pathlib.Path(mtpjax.__file__).resolve().parent / "assets" / "glm-demo"
METADATA = "shared/metadata.gguf"
REPO = pathlib.Path(__file__).resolve().parent.parent


def _run_bounded(code: str, *, memory_mb: int = 2048, timeout_s: float = 120) -> str:
  """stdout of `code` in a fresh interpreter limited to `memory_mb` of address space."""
  def limit():
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
  env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
  done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                        text=True, timeout=timeout_s, preexec_fn=limit, cwd=REPO, env=env)
  return done.stdout + done.stderr


class _PackageCopy(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.root = examples.package_copy(self, DEMO)


class GgufHeaderTest(_PackageCopy):

  def test_array_count_of_2_62_is_refused_without_a_hang(self):
    metadata = self.root / METADATA
    package_mutations.set_array_count(metadata, "tokenizer.ggml.tokens", 2**62)
    package_mutations.rehash(self.root, METADATA)
    out = _run_bounded(f"""
        from mtpjax import errors
        from mtpjax.package import reader
        try:
          reader.open_source({str(self.root)!r})
        except errors.PackageError as error:
          print("refused", error.field)
        """)
    self.assertIn("refused tokenizer.ggml.tokens", out)

  def test_string_array_claiming_more_strings_than_it_has(self):
    metadata = self.root / METADATA
    merges = len(gguf.GGUFReader(metadata).fields["tokenizer.ggml.merges"].data)
    count_at = package_mutations.key_field_offsets(metadata)["tokenizer.ggml.merges"]["count"]
    for extra in (5, 5000):     # the next keys' bytes read as string lengths, or past the end
      package_mutations.patch(metadata, count_at, struct.pack("<Q", merges + extra))
      with self.subTest(extra=extra), self.assertRaises(errors.PackageError) as ctx:
        gguf_header.check_header(metadata)
      self.assertEqual(ctx.exception.field, "tokenizer.ggml.merges")

  @parameterized.named_parameters(
      ("string_length", "general.name", "length", "<Q", 2**40, "general.name"),
      ("kv_count", None, "kv_count", "<Q", 2**50, "GGUF.kv_count"),
      ("tensor_count", None, "tensor_count", "<Q", 2**50, "GGUF.tensor_count"),
      ("nested_item_type", "tokenizer.ggml.merges", "item_type", "<I", 9,
       "tokenizer.ggml.merges"),
      ("unknown_value_type", "general.name", "type", "<I", 77, "general.name"),
  )
  def test_key_value_bounds(self, key, field, fmt, value, expected_field):
    path = self.root / "layers/layer-000.gguf"
    offset = (package_mutations.header_counts_offset()[field] if key is None
              else package_mutations.key_field_offsets(path)[key][field])
    package_mutations.patch(path, offset, struct.pack(fmt, value))
    with self.assertRaises(errors.PackageError) as ctx:
      gguf_header.check_header(path)
    self.assertEqual(ctx.exception.field, expected_field)
    self.assertEqual(ctx.exception.path, str(path))
    self.assertIsNotNone(ctx.exception.remedy)

  @parameterized.named_parameters(
      ("five_dims", "n_dims", "<I", 5, "dimensions"),
      ("zero_dim", "dims", "<Q", 0, "zero dimension"),
      ("huge_dim", "dims", "<Q", 2**62, "more bytes than the whole file"),
      ("unknown_type", "type", "<I", 1000, "unknown ggml type"),
      ("misaligned_offset", "offset", "<Q", 3, "alignment"),
      ("offset_past_the_end", "offset", "<Q", 2**40, "past the end"),
  )
  def test_tensor_info_bounds(self, field, fmt, value, message):
    path = self.root / "layers/layer-000.gguf"
    name = "blk.0.attn_q.weight"
    package_mutations.patch(path, package_mutations.tensor_field_offsets(path)[name][field],
                            struct.pack(fmt, value))
    with self.assertRaisesRegex(errors.PackageError, message) as ctx:
      gguf_header.check_header(path)
    self.assertEqual(ctx.exception.field, name)

  def test_truncated_and_empty_files(self):
    path = self.root / "layers/layer-000.gguf"
    for size in (0, 3, 30, 200):
      path.write_bytes((DEMO / "layers/layer-000.gguf").read_bytes()[:size])
      with self.subTest(size=size), self.assertRaises(errors.PackageError):
        gguf_header.check_header(path)


class ManifestTest(_PackageCopy):

  def _manifest(self):
    return json.loads((self.root / manifest_lib.MANIFEST_NAME).read_text())

  def test_deeply_nested_manifest(self):
    manifest = self._manifest()
    manifest["generation"] = "NEST"
    text = json.dumps(manifest).replace('"NEST"', "[" * 100000 + "]" * 100000)
    (self.root / manifest_lib.MANIFEST_NAME).write_text(text)
    report = preflight.preflight(self.root, stages=2)
    self.assertEqual([item["code"] for item in report["issues"]], ["invalid_manifest_json"])
    with self.assertRaises(errors.ManifestError):
      reader.open_source(self.root)

  def test_over_long_path_component(self):
    manifest = self._manifest()
    manifest["layers"][1]["path"] = "layers/" + "a" * 300 + ".gguf"
    package_mutations.write_manifest(self.root, manifest)
    report = preflight.preflight(self.root, stages=2, check_sha=True)
    self.assertFalse(report["valid"])
    self.assertIn("missing_artifact", [item["code"] for item in report["issues"]])
    with self.assertRaises(errors.MtpjaxError):
      with reader.open_source(self.root) as source:
        list(source.iter_stage_tensors(1, 2, embeddings=False, output=False))

  def test_huge_layer_count_with_stages_is_bounded(self):
    manifest = self._manifest()
    manifest["layer_count"] = 2**40
    package_mutations.write_manifest(self.root, manifest)
    out = _run_bounded(f"""
        import json
        from mtpjax.package import preflight
        report = preflight.preflight({str(self.root)!r}, stages=2)
        print("codes", json.dumps(sorted({{item["code"] for item in report["issues"]}})))
        """, memory_mb=2048)
    self.assertIn('codes ["missing_layer"', out)


class MetadataValueTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    with reader.open_source(DEMO) as source:
      cls.metadata = dict(source.metadata)
      cls.names = list(source.tensors)

  def test_pristine_metadata_resolves(self):
    self.assertEqual(config_from_gguf(self.metadata, self.names).n_heads,
                     self.metadata["glm4moe.attention.head_count"])

  @parameterized.named_parameters(
      ("eps_inf", "glm4moe.attention.layer_norm_rms_epsilon", math.inf),
      ("eps_nan", "glm4moe.attention.layer_norm_rms_epsilon", math.nan),
      ("eps_zero", "glm4moe.attention.layer_norm_rms_epsilon", 0.0),
      ("rope_base_negative", "glm4moe.rope.freq_base", -1.0),
      ("zero_heads", "glm4moe.attention.head_count", 0),
      ("kv_heads_not_a_divisor", "glm4moe.attention.head_count_kv", 3),
      ("key_length_array", "glm4moe.attention.key_length", [1, 2]),
      ("block_count_huge", "glm4moe.block_count", 2**40),
      ("leading_dense_nan", "glm4moe.leading_dense_block_count", math.nan),
      ("head_count_kv_string", "glm4moe.attention.head_count_kv", "glm4moe"),
      ("experts_used_above_experts", "glm4moe.expert_used_count", 1000),
      ("rope_dims_odd", "glm4moe.rope.dimension_count", 7),
      ("scale_inf", "glm4moe.expert_weights_scale", math.inf),
      ("tokens_not_an_array", "tokenizer.ggml.tokens", 5),
  )
  def test_out_of_range_values_are_refused(self, key, value):
    with self.assertRaises(errors.ConversionError) as ctx:
      config_from_gguf(self.metadata | {key: value}, self.names, source="demo.gguf")
    self.assertEqual(ctx.exception.path, "demo.gguf")
    self.assertEqual(ctx.exception.field, key)

  @parameterized.named_parameters(
      ("nan_special_id", "tokenizer.ggml.eos_token_id", math.nan),
      ("float_special_id", "tokenizer.ggml.bos_token_id", 3.0),
      ("string_special_id", "tokenizer.ggml.eos_token_id", "3"),
      ("tokens_of_ints", "tokenizer.ggml.tokens", [1, 2, 3]),
      ("merges_not_strings", "tokenizer.ggml.merges", [[1, 2]]),
      ("token_types_of_strings", "tokenizer.ggml.token_type", ["a"]),
      ("pre_tokenizer_array", "tokenizer.ggml.pre", [1, 2, 3]),
      ("model_array", "tokenizer.ggml.model", [1]),
  )
  def test_tokenizer_values_are_refused(self, key, value):
    with self.assertRaises(errors.ConversionError) as ctx:
      GgufTokenizer.from_metadata(self.metadata | {key: value}, path="demo.gguf")
    self.assertEqual(ctx.exception.field, key)

  def test_template_of_the_wrong_type_and_nan_ids(self):
    with self.assertRaises(errors.ConversionError):
      ChatTemplate.from_metadata(self.metadata | {"tokenizer.chat_template": 5})
    template = ChatTemplate.from_metadata(self.metadata | {"tokenizer.ggml.eos_token_id": math.nan})
    self.assertEqual(template.eos_token, "")


if __name__ == "__main__":
  absltest.main()
