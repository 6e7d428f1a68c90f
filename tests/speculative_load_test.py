"""The resolved native-MTP flag reaches all three consumers of a real `mtpjax.load`.

docs/SPECULATIVE.md §6: the loader (`load_options`, and whether the MTP head is in memory), every
pipeline stage (the layouts and the engine the stages run) and the server's generation settings
carry one value, for a real layer package (with its generation block) and a real direct GGUF.
"""

import os
import pathlib
import tempfile
from unittest import mock

from absl.testing import absltest, parameterized

import mtpjax
from configs import glm
from mtpjax import errors
from mtpjax.package.writer import split_gguf
from mtpjax.testing.tiny_glm import TinyGlmSpec, write_tiny_glm_gguf


def config_with(strategy: str | None):
  config = glm.get_config()
  with config.unlocked():
    config.defaults.speculative.strategy = strategy
  return config


class LoadPropagationTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    root = pathlib.Path(cls.tmp.name)
    cls.gguf = write_tiny_glm_gguf(root / "with-head.gguf", TinyGlmSpec(seed=2))[0]
    cls.headless = write_tiny_glm_gguf(root / "no-head.gguf", TinyGlmSpec(seed=2, mtp=False))[0]
    cls.package = split_gguf(cls.gguf, root / "pkg", model_id="mtpjax/tests:F32")

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def assert_everywhere(self, model, expected: bool):
    self.assertEqual(model.resolution.native_mtp, expected)
    self.assertEqual(model.load_options.native_mtp, expected)
    self.assertEqual(model.mtp_head_loaded, expected)
    layouts = model.stage_layouts(with_mtp=model.load_options.native_mtp)
    self.assertNotEmpty(layouts)
    self.assertEqual(layouts[-1].mtp, expected)     # the NextN block rides on the last stage
    self.assertFalse(any(layout.mtp for layout in layouts[:-1]))
    self.assertEqual(model.generation_settings.native_mtp, expected)

  @parameterized.named_parameters(
      ("auto_with_package_metadata", "package", None, True, 1),
      ("auto_with_package_metadata_two_stages", "package", "auto", True, 2),
      ("auto_on_a_direct_gguf", "gguf", None, False, 1),
      ("explicit_with_gguf_proof", "gguf", "native-mtp-n1", True, 1),
      ("disabled", "package", "disabled", False, 2),
  )
  def test_flag_reaches_loader_stages_and_server(self, kind, strategy, expected, stages):
    source = self.package if kind == "package" else self.gguf
    model = mtpjax.load(str(source), stages=stages, config=config_with(strategy))
    self.assert_everywhere(model, expected)
    self.assertLen(model.stage_layouts(with_mtp=expected), stages)

  def test_explicit_without_a_head_fails_before_loading(self):
    with self.assertRaisesRegex(errors.SpeculativeConfigError,
                                "requires proven native-mtp-n1 support"):
      mtpjax.load(str(self.headless), config=config_with("native-mtp-n1"))

  def test_kill_switch_turns_it_off_everywhere(self):
    with mock.patch.dict(os.environ, {"MTPJAX_NATIVE_MTP": "0"}):
      model = mtpjax.load(str(self.package), config=config_with(None))
    self.assert_everywhere(model, False)
    self.assertTrue(model.resolution.disabled_by_env)


if __name__ == "__main__":
  absltest.main()
