"""Integrity on load: a corrupted or crafted layer artifact never loads (issue 20, item 4).

Every edit is made on a copy of the demo package at offsets located by gguf-py's own parser
(mtpjax/testing/package_mutations.py), and the expected layouts come from gguf-py too, so the
checks under test are compared with an independent reader.
"""

import os
import pathlib

import gguf
import package_examples as examples
from absl.testing import absltest

import mtpjax
from mtpjax import errors
from mtpjax.package import gguf_header, reader
from mtpjax.testing import package_mutations

DEMO = pathlib.Path(mtpjax.__file__).resolve().parent / "assets" / "glm-demo"
LAYER = "layers/layer-001.gguf"
# Q8_0 tensors of the same byte size, DOWN first in the file; as F32, DOWN's bytes would still
# end inside the file (on gguf-py alone the edit loads, reading its neighbours' bytes)
DOWN = "blk.1.ffn_down_exps.weight"
GATE = "blk.1.ffn_gate_exps.weight"


def _read_stage(root, layer):
  with reader.open_source(root) as source:
    return [info.name for info, _ in source.iter_stage_tensors(layer, layer + 1, embeddings=False,
                                                                 output=False)]


class IntegrityOnLoadTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.root = examples.package_copy(self, DEMO)
    self.layer = self.root / LAYER

  def test_pristine_package_reads(self):
    self.assertIn(GATE, _read_stage(self.root, 1))

  def test_type_id_change_is_refused_by_the_hash(self):
    stored = {t.name: t for t in gguf.GGUFReader(self.layer).tensors}
    self.assertEqual(stored[DOWN].tensor_type, gguf.GGMLQuantizationType.Q8_0)
    self.assertLess(stored[DOWN].data_offset + 4 * stored[DOWN].n_elements,
                    self.layer.stat().st_size)
    package_mutations.set_tensor_type(self.layer, DOWN, gguf.GGMLQuantizationType.F32)
    with self.assertRaisesRegex(errors.IntegrityError, "checksum mismatch") as ctx:
      _read_stage(self.root, 1)
    self.assertEqual(ctx.exception.field, "layer:1")
    self.assertEqual(ctx.exception.path, str(self.layer))

  def test_type_id_change_refuses_mtpjax_load(self):
    package_mutations.set_tensor_type(self.layer, DOWN, gguf.GGMLQuantizationType.F32)
    with self.assertRaises(errors.IntegrityError):
      mtpjax.load(str(self.root))

  def test_rehashed_type_id_change_is_refused_by_the_byte_size_check(self):
    """A manifest that re-records the edited file's hash: the tensor's type and shape no
    longer fit its byte range, which the header check sees before any tensor is read."""
    package_mutations.set_tensor_type(self.layer, DOWN, gguf.GGMLQuantizationType.F32)
    package_mutations.rehash(self.root, LAYER)
    with self.assertRaisesRegex(errors.PackageError, "overlap") as ctx:
      _read_stage(self.root, 1)
    self.assertEqual(ctx.exception.field, GATE)

  def test_flipped_tensor_bytes_are_refused(self):
    package_mutations.flip_tensor_byte(self.layer, "blk.1.attn_q.weight", 100)
    with self.assertRaises(errors.IntegrityError):
      _read_stage(self.root, 1)
    with reader.open_source(self.root) as source, self.assertRaises(errors.IntegrityError):
      source.raw("blk.1.attn_q.weight")

  def test_flipped_bytes_refused_with_verify_sha256_too(self):
    package_mutations.flip_tensor_byte(self.layer, "blk.1.attn_q.weight", 7)
    with self.assertRaises(errors.IntegrityError):
      reader.open_source(self.root, verify="sha256")

  def test_overlapping_tensor_ranges_are_refused(self):
    offsets = package_mutations.tensor_field_offsets(self.layer)
    layout = gguf.GGUFReader(self.layer)
    down = offsets[DOWN]["data"] - layout.data_offset
    package_mutations.set_tensor_offset(self.layer, GATE, down)
    package_mutations.rehash(self.root, LAYER)
    with self.assertRaisesRegex(errors.PackageError, "overlap"):
      _read_stage(self.root, 1)

  def test_bytes_past_the_last_tensor_are_refused_before_hashing(self):
    """8 GiB of sparse zeros appended to a layer, the manifest's size updated to match (its
    hash left as it was): refused by the header's extent, not after hashing the hole."""
    os.truncate(self.layer, 8 * 2**30)
    manifest = package_mutations.read_manifest(self.root)
    for entry in manifest["layers"]:
      if entry["path"] == LAYER:
        entry["artifact_bytes"] = 8 * 2**30
    package_mutations.write_manifest(self.root, manifest)
    with self.assertRaisesRegex(errors.IntegrityError, "past its last tensor's data") as ctx:
      _read_stage(self.root, 1)
    self.assertEqual(ctx.exception.path, str(self.layer))
    with self.assertRaisesRegex(errors.IntegrityError, "past its last tensor's data"):
      reader.open_source(self.root, verify="sha256")

  def test_metadata_artifact_is_hashed_at_open(self):
    metadata = self.root / "shared/metadata.gguf"
    data = bytearray(metadata.read_bytes())
    data[-1] ^= 0x01
    metadata.write_bytes(bytes(data))
    with self.assertRaises(errors.IntegrityError):
      reader.open_source(self.root)


class HeaderLayoutTest(absltest.TestCase):
  """The bounded walk agrees with gguf-py on every demo file."""

  def test_layout_matches_gguf_py(self):
    for path in sorted(DEMO.rglob("*.gguf")):
      with self.subTest(path=path.name):
        layout = gguf_header.check_header(path)
        parsed = gguf.GGUFReader(path)
        self.assertEqual(layout.data_offset, parsed.data_offset)
        self.assertEqual([(t.name, t.ggml_type, t.ne, t.start, t.n_bytes) for t in layout.tensors],
                         [(t.name, t.tensor_type, tuple(int(d) for d in t.shape),
                           int(t.data_offset), int(t.n_bytes)) for t in parsed.tensors])


if __name__ == "__main__":
  absltest.main()
