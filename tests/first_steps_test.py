"""A new user's first steps, each of which once tripped: relative paths from convert to load,
a context that cannot fit memory, `--help`, and the shipped config found from any folder."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from absl.testing import absltest

import mtpjax
from fixtures import FIXTURES
from mtpjax import errors, serve
from mtpjax.configs import glm
from mtpjax.engine.contract import EngineConfig

REPO = pathlib.Path(__file__).resolve().parent.parent
GGUF = FIXTURES / "glm4moe-tiny" / "glm4moe_h64-Q8_0.gguf"
IDS = np.load(FIXTURES / "glm4moe-tiny" / "hf_ref.npz")["token_ids"][:8]


def _python(*args: str, cwd, timeout: int = 300) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                        timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


class RelativePathsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.folder = pathlib.Path(tempfile.mkdtemp(prefix="mtpjax-first-steps-"))
    self.addCleanup(shutil.rmtree, self.folder, ignore_errors=True)
    self.addCleanup(os.chdir, os.getcwd())

  def test_convert_to_a_relative_folder_then_load_it_by_that_path(self):
    shutil.copy(GGUF, self.folder / "model.gguf")
    # The README's form: `python -m mtpjax.convert SRC OUT_DIR`, both relative.
    run = _python("-m", "mtpjax.convert", "model.gguf", "out/ckpt", cwd=self.folder)
    self.assertEqual(run.returncode, 0, run.stderr[-3000:])
    self.assertTrue((self.folder / "out" / "ckpt" / "parts").is_dir())
    os.chdir(self.folder)
    from_checkpoint = mtpjax.load("out/ckpt").logits(IDS)
    from_gguf = mtpjax.load(str(GGUF)).logits(IDS)
    np.testing.assert_array_equal(from_checkpoint, from_gguf)


class ImpossibleSettingsTest(absltest.TestCase):

  def test_an_engine_without_settings_has_the_servers_defaults(self):
    model = mtpjax.load(str(GGUF))
    self.assertEqual(model.engine_settings, EngineConfig())
    self.assertEqual(model.engine(native_mtp=False).engine_cfg, dataclasses.replace(
        EngineConfig(), kv_cache_dtype=model.kv_cache_name("auto")))
    self.assertEqual(mtpjax.load(str(GGUF), config=glm.get_config()).engine_settings,
                     EngineConfig())

  def test_a_context_that_cannot_fit_memory_is_a_typed_error_naming_the_field(self):
    model = mtpjax.load(str(GGUF))
    engine = model.engine(native_mtp=True, max_len=100_000_000)
    with self.assertRaises(errors.MemoryBudgetError) as caught:
      engine.init_state()
    self.assertEqual(caught.exception.field, "engine.max_len")
    message = str(caught.exception)
    self.assertIn("engine.max_len 100000000", message)
    self.assertRegex(message, r"needs [0-9.]+ GiB of KV cache on the host .* has [0-9.]+ GiB free")
    self.assertIn("engine.kv_pages", caught.exception.remedy)

  def test_the_server_refuses_it_in_one_line_before_warming_up(self):
    cache = tempfile.mkdtemp(prefix="mtpjax-first-steps-cache-")
    self.addCleanup(shutil.rmtree, cache, ignore_errors=True)
    run = _python("-m", "mtpjax.serve", "--config=configs/glm.py",
                  f"--config.model.source={GGUF}", f"--config.cache_dir={cache}",
                  "--config.engine.max_len=100000000", cwd=REPO)
    self.assertEqual(run.returncode, 1, run.stderr[-3000:])
    self.assertIn("cannot serve: engine.max_len 100000000", run.stderr)
    self.assertIn("field: engine.max_len", run.stderr)
    self.assertNotIn("Traceback", run.stderr)
    self.assertNotIn("warmed up", run.stderr)


class ServeCommandTest(absltest.TestCase):

  def test_help_exits_0_and_lists_every_config_field_with_its_default(self):
    run = _python("-m", "mtpjax.serve", "--help", cwd=REPO, timeout=120)
    self.assertEqual(run.returncode, 0, run.stderr[-3000:])
    config = glm.get_config()
    self.assertIn(f"--config.engine.max_len = {config.engine.max_len!r}", run.stdout)
    self.assertIn(f"--config.server.port = {config.server.port!r}", run.stdout)
    self.assertIn(f"--config.model.int8_activations = {config.model.int8_activations!r}",
                  run.stdout)
    tiny = _python("-m", "mtpjax.serve", "--config=configs/glm.py:tiny", "--help", cwd=REPO,
                   timeout=120)
    self.assertIn("--config.engine.max_len = 64", tiny.stdout)

  def test_the_config_path_of_the_readme_is_the_shipped_config_in_any_folder(self):
    folder = tempfile.mkdtemp(prefix="mtpjax-first-steps-cwd-")
    self.addCleanup(shutil.rmtree, folder, ignore_errors=True)
    self.addCleanup(os.chdir, os.getcwd())
    os.chdir(folder)
    self.assertEqual(serve.resolve_config_argument(["serve", "--config=configs/glm.py:tiny"]),
                     ["serve", f"--config={serve.SHIPPED_CONFIG}:tiny"])
    # A folder with its own configs/glm.py keeps it.
    os.chdir(REPO)
    self.assertEqual(serve.resolve_config_argument(["serve", "--config=configs/glm.py"]),
                     ["serve", "--config=configs/glm.py"])


if __name__ == "__main__":
  absltest.main()
