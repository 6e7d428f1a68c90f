"""GGUF / layer package -> orbax checkpoint (`mtpjax.convert`), restored onto a sharded mesh.

The references are the model loaded straight from the GGUF (same dequantized weights, so
restored arrays and logits must agree), `param_sharding_fn` for placement, and the file system
for the all-or-nothing rule (no record, no temp folder after a failure).
"""

import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from absl.testing import absltest

import mtpjax
from mtpjax import checkpoint, disk_space, errors, loading, sharding, staging
from mtpjax.convert import convert
from mtpjax.package.writer import split_gguf
from mtpjax.testing.gguf_rewrite import rewrite_gguf
from mtpjax.testing.tiny_glm import TinyGlmSpec, build_tiny_glm_tensors, write_tiny_glm_gguf

REPO = pathlib.Path(__file__).resolve().parents[1]
# Every tensor-split dimension (heads x head_dim, experts, vocab, FFN widths) divides by 4.
SPEC = TinyGlmSpec(vocab_size=320, hidden=32, n_heads=4, n_kv_heads=2, head_dim=16,
                   n_trunk_layers=3, leading_dense=1, ffn=64, n_experts=8, n_experts_used=2,
                   expert_ffn=16, rope_dims=8, nextn_embed=True, seed=5)
IDS = np.random.default_rng(11).integers(0, SPEC.vocab_size, size=13)

_tmp: tempfile.TemporaryDirectory
WORK: pathlib.Path
SRC: pathlib.Path        # the generated GGUF
CKPT: pathlib.Path       # its float32 conversion, shared by the tests below


def setUpModule():
  global _tmp, WORK, SRC, CKPT
  _tmp = tempfile.TemporaryDirectory()
  WORK = pathlib.Path(_tmp.name)
  SRC = WORK / "tiny.gguf"
  write_tiny_glm_gguf(SRC, SPEC)
  CKPT = convert(SRC, WORK / "ckpt", show_progress=False)


def tearDownModule():
  _tmp.cleanup()


def _leftovers(out: pathlib.Path) -> list[str]:
  """Anything next to `out` that a conversion into `out` may have left behind."""
  return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}"))


def _kept_f32(path: tuple) -> bool:
  """Parameters kept in float32 whatever the parameter dtype: norm weights, biases, the router
  (a projection's matrix is also a `weight`, of a module not named for a norm)."""
  if path[-1] == "weight":
    return "norm" in str(path[-2]) or path[-2] == "router"
  return path[-1] in ("bias", "router_bias")


def _leaves(model, *, with_mtp=True) -> dict:
  return loading.flat_paths(model.weights(with_mtp=with_mtp)[1])


class CliTest(absltest.TestCase):

  def test_cli_converts_then_refuses_a_non_empty_output(self):
    out = WORK / "cli-out"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    run = lambda *args: subprocess.run(
        [sys.executable, "-m", "mtpjax.convert", str(SRC), str(out), *args], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=300)
    first = run()
    self.assertEqual(first.returncode, 0, first.stderr)
    self.assertTrue(checkpoint.is_checkpoint(out))
    record = checkpoint.read_record(out)
    self.assertEqual(record["dtype"], "float32")
    self.assertEqual(record["source"]["kind"], "gguf")
    self.assertEqual(record["model_config"]["n_layers"], SPEC.n_trunk_layers)
    self.assertEqual(sorted(record["parts"]),
                     ["embed", "layer-000", "layer-001", "layer-002", "mtp", "output"])
    self.assertEqual(record["metadata"]["glm4moe.embedding_length"], SPEC.hidden)
    self.assertEqual(_leftovers(out), [])

    before = (out / checkpoint.RECORD_NAME).read_bytes()
    second = run()
    self.assertNotEqual(second.returncode, 0)
    self.assertIn("not empty", second.stderr)
    self.assertIn("--overwrite", second.stderr)
    self.assertIn(str(out), second.stderr)
    self.assertNotIn("Traceback", second.stderr)
    self.assertEqual((out / checkpoint.RECORD_NAME).read_bytes(), before)


class FailureTest(absltest.TestCase):
  """A conversion that fails leaves nothing that looks like a checkpoint."""

  def _assert_nothing_left(self, out: pathlib.Path):
    self.assertFalse(checkpoint.is_checkpoint(out))
    self.assertFalse(out.exists())
    self.assertEqual(_leftovers(out), [])

  def test_missing_tensor_in_a_late_layer(self):
    bad = WORK / "missing.gguf"
    rewrite_gguf(SRC, bad, tensors=lambda ts: ((t.name, t) for t in ts
                                               if t.name != "blk.2.ffn_up_exps.weight"))
    out = WORK / "missing-out"
    # Earlier parts (embed, layer-000, layer-001) are written before layer 2 fails.
    with self.assertRaisesRegex(errors.ConversionError, r"blk\.2: ffn/experts/up_exps"):
      convert(bad, out, show_progress=False)
    self._assert_nothing_left(out)

  def test_corrupt_tensor_shape_in_a_late_layer(self):
    bad = WORK / "corrupt.gguf"
    name = "blk.2.attn_q.weight"
    wrong = np.zeros((SPEC.n_heads * SPEC.head_dim, SPEC.hidden // 2), np.float32)
    rewrite_gguf(SRC, bad, tensors=lambda ts: ((t.name, wrong if t.name == name else t)
                                               for t in ts))
    out = WORK / "corrupt-out"
    with self.assertRaises(errors.ConversionError) as ctx:
      convert(bad, out, show_progress=False)
    self.assertIn(name, str(ctx.exception))
    self._assert_nothing_left(out)

  def test_truncated_file(self):
    bad = WORK / "truncated.gguf"
    data = SRC.read_bytes()
    bad.write_bytes(data[:len(data) - 4096])
    out = WORK / "truncated-out"
    with self.assertRaises(errors.MtpjaxError) as ctx:
      convert(bad, out, show_progress=False)
    self.assertIn(str(bad), str(ctx.exception))
    self._assert_nothing_left(out)

  def test_overwrite_replaces_an_existing_output(self):
    out = WORK / "overwrite-out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with self.assertRaises(errors.CheckpointError):
      convert(SRC, out, show_progress=False)
    self.assertTrue((out / "stale.txt").exists())
    convert(SRC, out, overwrite=True, show_progress=False)
    self.assertTrue(checkpoint.is_checkpoint(out))
    self.assertFalse((out / "stale.txt").exists())
    self.assertEqual(_leftovers(out), [])


def _with_small_file_limit(code: str) -> subprocess.CompletedProcess:
  """`code` run in a child whose files cannot grow past 4 KiB (a write past it fails with
  EFBIG instead of killing the child)."""
  limit = ("import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
           "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n")
  return subprocess.run([sys.executable, "-c", limit + code], cwd=REPO, capture_output=True,
                        text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO)))


class DiskSpaceTest(absltest.TestCase):
  """A conversion that runs out of disk gets one typed error naming the path and the bytes."""

  def test_a_write_past_the_file_size_limit_is_a_typed_error(self):
    """The process's file size limit (`ulimit -f`, EFBIG) stands in for a full disk (ENOSPC):
    both reach orbax as the same failed write. Before, the CLI ended in orbax's untyped
    ValueError under a ~350-line traceback."""
    out = WORK / "full-out"
    done = _with_small_file_limit(
        f"import runpy, sys; sys.argv = ['convert', {str(SRC)!r}, {str(out)!r}]; "
        "runpy.run_module('mtpjax.convert', run_name='__main__')")
    self.assertEqual(done.returncode, 1, done.stderr[-2000:])
    last = done.stderr.strip().splitlines()[-1]       # (orbax's own threads log theirs above)
    self.assertRegex(last, r"^error: the disk ran out of space while writing the checkpoint, "
                     r"which needs about [\d,]+ bytes \(File too large\)")
    self.assertIn(f"file: {out};", last)
    self.assertFalse(out.exists())
    self.assertEqual(_leftovers(out), [])

  def test_a_full_cache_disk_is_a_typed_error(self):
    """The embedded tiny package built into a cache whose writes fail (the same stand-in):
    before, an untyped OSError from the GGUF writer."""
    cache = tempfile.mkdtemp(dir=WORK)
    done = _with_small_file_limit(
        "from mtpjax import errors; from mtpjax.testing import embedded_tiny\n"
        f"try:\n  embedded_tiny.embedded_package_dir({cache!r})\n"
        "except errors.DiskSpaceError as e:\n  print('typed:', e)")
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertRegex(done.stdout, r"typed: the disk ran out of space while writing the "
                     r"embedded tiny package \(File too large\)")
    self.assertEqual(list(pathlib.Path(cache, "mtpjax").iterdir()), [])   # staging removed

  def test_a_disk_without_room_is_refused_before_writing(self):
    out = WORK / "no-room-out"
    needed = shutil.disk_usage(WORK).free * 2 + 2**30
    with self.assertRaisesRegex(errors.DiskSpaceError, f"needs about {needed:,} bytes") as ctx:
      disk_space.check_room(out, needed, what="the checkpoint")
    self.assertEqual(ctx.exception.path, str(out))


def _dead_writer() -> str:
  """The owner tag of a conversion process that is gone (a real child that has exited)."""
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  child.wait()
  return f"{child.pid}@{socket.gethostname()}"


class InterruptedConversionTest(absltest.TestCase):
  """What a killed conversion leaves is cleaned up (or put back) by the next one."""

  def test_dead_conversions_staging_folders_are_removed(self):
    out = WORK / "after-kill-out"
    dead = WORK / f".{out.name}.tmp-{_dead_writer()}.k2j3h4"
    unnamed = WORK / f".{out.name}.tmp-a1b2c3"         # a name without a writer, a day old
    for folder in (dead, unnamed):
      (folder / "parts").mkdir(parents=True)
    day_ago = time.time() - staging.STALE_AFTER_S - 60
    os.utime(unnamed, (day_ago, day_ago))
    convert(SRC, out, show_progress=False)
    self.assertTrue(checkpoint.is_checkpoint(out))
    self.assertEqual(_leftovers(out), [])

  def test_checkpoint_set_aside_by_a_killed_overwrite_is_put_back(self):
    # Killed mid-swap: the old checkpoint aside, the new one still in its staging folder.
    out = WORK / "killed-overwrite-out"
    writer = _dead_writer()
    shutil.copytree(CKPT, WORK / f".{out.name}.old-{writer}.q9w8e7")
    (WORK / f".{out.name}.tmp-{writer}.k2j3h4" / "parts").mkdir(parents=True)
    with self.assertRaisesRegex(errors.CheckpointError, "not empty"):
      convert(SRC, out, show_progress=False)
    self.assertTrue(checkpoint.is_checkpoint(out))
    self.assertEqual(_leftovers(out), [])

  def test_a_checkpoint_deleted_after_a_killed_overwrite_landed_stays_deleted(self):
    # Killed while removing the old checkpoint (the new one had landed); the user deleted the
    # target: converting again writes a new checkpoint, not the older one back.
    out = WORK / "deleted-after-overwrite-out"
    stale = WORK / f".{out.name}.old-{_dead_writer()}.q9w8e7"
    shutil.copytree(CKPT, stale)
    convert(SRC, out, show_progress=False)
    self.assertTrue(checkpoint.is_checkpoint(out))
    self.assertFalse(stale.exists())
    self.assertEqual(_leftovers(out), [])


class FormatVersionTest(absltest.TestCase):

  def test_a_checkpoint_of_the_older_format_is_refused_with_the_remedy(self):
    # Version 1 stored projections [out, in] (restoring it would transpose square matrices);
    # version 3 had no quantized fields and no tensor types; version 4 kept MLA's per-head
    # projections dense.
    for version in (1, 3, 4):
      old = WORK / f"format-{version}"
      shutil.copytree(CKPT, old)
      record = checkpoint.read_record(old) | {"format_version": version}
      checkpoint.write_record(old, record)
      with self.assertRaisesRegex(
          errors.CheckpointError,
          rf"format {version} is not {checkpoint.FORMAT_VERSION}.*python -m mtpjax.convert"):
        mtpjax.load(old)


class ShardedRestoreTest(absltest.TestCase):
  """Checkpoint restored on a 1 x 4 mesh vs the GGUF loaded on one device."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.mesh = sharding.make_mesh(stages=1, tensor=4)
    cls.direct = mtpjax.load(SRC)
    cls.restored = mtpjax.load(CKPT, mesh=cls.mesh)

  def test_mesh_uses_four_devices(self):
    self.assertEqual(len(jax.devices()), 4)
    self.assertEqual(dict(self.mesh.shape), {sharding.STAGE: 1, sharding.TENSOR: 4})

  def test_same_logits_and_mtp_logits(self):
    want_mtp, got_mtp = self.direct.mtp_logits(IDS), self.restored.mtp_logits(IDS)
    np.testing.assert_allclose(got_mtp, want_mtp, atol=1e-5, rtol=0)
    np.testing.assert_allclose(self.restored.logits(IDS), self.direct.logits(IDS),
                               atol=1e-5, rtol=0)

  def test_restored_arrays_equal_the_gguf_weights(self):
    want, got = _leaves(self.direct), _leaves(self.restored)
    self.assertEqual(sorted(got), sorted(want))
    for path, array in got.items():
      np.testing.assert_array_equal(np.asarray(array), np.asarray(want[path]), err_msg=str(path))

  def test_restored_arrays_carry_the_requested_shardings(self):
    fn = sharding.param_sharding_fn(self.mesh)
    leaves = _leaves(self.restored)
    for path, array in leaves.items():
      self.assertEqual(array.sharding, fn(path, array.shape), msg=str(path))
    # The roles the rules name are all there, and really split four ways. Projections are
    # stored [in, out]: q heads split on dim 1, o heads (its inputs) on dim 0.
    for path, dim in ((("layers", 0, "attn", "wq", "weight"), 1),
                      (("layers", 1, "ffn", "experts", "gate_exps"), 0),
                      (("embed",), 0), (("mtp", "embed"), 0),
                      (("layers", 2, "attn", "wo", "weight"), 0),
                      (("mtp", "block", "ffn", "experts", "down_exps"), 0),
                      (("head", "weight"), 1)):
      array = leaves[path]
      self.assertLen(array.sharding.device_set, 4, msg=str(path))
      shard_shapes = {s.data.shape[dim] for s in array.addressable_shards}
      self.assertEqual(shard_shapes, {array.shape[dim] // 4}, msg=str(path))
    # Norms are replicated: every device holds the whole vector.
    norm = leaves[("output_norm", "weight")]
    self.assertTrue(norm.sharding.is_fully_replicated)


class PackageAndDtypeTest(absltest.TestCase):

  def test_package_converts_to_the_same_checkpoint(self):
    package = split_gguf(SRC, WORK / "package", model_id="test/tiny-glm")
    out = convert(package, WORK / "package-ckpt", show_progress=False)
    record = checkpoint.read_record(out)
    self.assertEqual(record["source"]["kind"], "package")
    self.assertIsNotNone(record["source"]["manifest_sha256"])
    self.assertEqual(record["model_config"], checkpoint.read_record(CKPT)["model_config"])
    from_package, from_gguf = mtpjax.load(out), mtpjax.load(CKPT)
    want, got = _leaves(from_gguf), _leaves(from_package)
    self.assertEqual(sorted(got), sorted(want))
    for path, array in got.items():
      np.testing.assert_array_equal(np.asarray(array), np.asarray(want[path]), err_msg=str(path))

  def test_bfloat16_conversion_restores_bfloat16(self):
    out = convert(SRC, WORK / "bf16-ckpt", dtype="bfloat16", show_progress=False)
    self.assertEqual(checkpoint.read_record(out)["dtype"], "bfloat16")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    # Stored as bfloat16 on disk, not just cast on restore; norms, biases and the router stay
    # float32 (docs/MODEL.md §4 dtype policy).
    meta = ocp.StandardCheckpointer().metadata(out / "parts" / "layer-001")
    stored = {key: np.dtype(m.dtype) for key, m in getattr(meta, "item_metadata", meta).items()}
    self.assertEqual({k for k, d in stored.items() if d != bf16},
                     {k for k in stored if _kept_f32(tuple(k.split("/")))})
    self.assertEqual(stored["layers/0/ffn/experts/gate_exps"], bf16)
    self.assertEqual(stored["layers/0/attn/wq/weight"], bf16)
    model = mtpjax.load(out, dtype="bfloat16")
    master = build_tiny_glm_tensors(SPEC)
    leaves = _leaves(model)
    for path, array in leaves.items():
      want = np.float32 if _kept_f32(path) else bf16
      self.assertEqual(np.dtype(array.dtype), want, msg=str(path))
    # GGUF [out, in] tensors; projections (eh_proj) are stored transposed.
    for path, name, layout in ((("layers", 1, "ffn", "experts", "gate_exps"),
                                "blk.1.ffn_gate_exps.weight", lambda a: a),
                               (("embed",), "token_embd.weight", lambda a: a),
                               (("mtp", "eh_proj", "weight"), "blk.3.nextn.eh_proj.weight",
                                np.transpose)):
      np.testing.assert_array_equal(np.asarray(leaves[path]),
                                    layout(master[name].astype(ml_dtypes.bfloat16)),
                                    err_msg=str(path))


if __name__ == "__main__":
  absltest.main()
