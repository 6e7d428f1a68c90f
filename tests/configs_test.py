"""configs/glm.py and configs/tiny.py through ml_collections' command-line flags (docs/STYLE.md)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

from absl import flags
from absl.testing import absltest
from absl.testing import parameterized
from ml_collections import config_flags

from configs import glm
from configs import tiny
from mtpjax import api
from mtpjax.engine.contract import EngineConfig
from mtpjax.engine.drafting_policy import AdaptiveDrafting
from mtpjax.engine.sampling import DEFAULT_MAX_NEW_TOKENS, SamplerParams
from mtpjax import speculative
from mtpjax.errors import SpeculativeConfigError
from mtpjax.server.limits import ServerLimits

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLM = os.path.join(REPO, "configs", "glm.py")
TINY = os.path.join(REPO, "configs", "tiny.py")


def parse(*args: str):
  """Parses a command line the way `mtpjax.serve` will: a fresh FlagValues, config locked."""
  argv = ["serve", *args]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=flag_values, lock_config=True,
                                  sys_argv=argv)
  flag_values(argv)
  return flag_values.config


class OneSetOfDefaultsTest(absltest.TestCase):
  """The server config sets the library's defaults: the engine's (`EngineConfig`), the
  sampler's (`SamplerParams`, `Model.generate`), the drafting policy's and the token limit."""

  def test_every_engine_setting_of_the_config_is_the_library_default(self):
    config = glm.get_config()
    self.assertEqual(set(config.engine.keys()),
                     set(EngineConfig.SETTINGS) | {"seed", "adaptive_drafting", "kernels"})
    self.assertEqual(EngineConfig.from_config(config.engine), EngineConfig())
    self.assertEqual(AdaptiveDrafting.from_mode(config.engine.adaptive_drafting),
                     AdaptiveDrafting())
    self.assertEqual(config.engine.seed, SamplerParams().seed)

  def test_every_sampling_default_of_the_config_is_the_library_default(self):
    config = glm.get_config()
    sampling = config.sampling
    generate = inspect.signature(api.Model.generate).parameters
    for name in ("temperature", "top_k", "top_p"):
      self.assertEqual(sampling[name], getattr(SamplerParams(), name), name)
      self.assertEqual(generate[name].default, getattr(SamplerParams(), name), name)
    self.assertEqual(generate["seed"].default, SamplerParams().seed)
    self.assertEqual(generate["decode_steps"].default, EngineConfig().decode_steps)
    self.assertEqual(sampling.max_new_tokens, DEFAULT_MAX_NEW_TOKENS)
    self.assertEqual(set(sampling.keys()), {"temperature", "top_k", "top_p", "max_new_tokens"})


  def test_every_server_limit_of_the_config_is_the_library_default(self):
    self.assertEqual(ServerLimits.from_config(glm.get_config().server), ServerLimits())


class GetConfigTest(parameterized.TestCase):

  def test_default_is_the_embedded_demo(self):
    config = glm.get_config()
    self.assertEqual(config.model.source, "")
    self.assertEqual((config.model.name, config.model.arch, config.model.dtype),
                     ("glm", "glm4moe", "float32"))
    self.assertEqual((config.mesh.stages, config.mesh.splits, config.mesh.tensor), (1, None, 1))
    self.assertEqual((config.engine.slots, config.engine.max_len, config.engine.timing,
                      config.engine.seed), (4, 8192, False, 0))
    self.assertEqual(config.engine.prefill_buckets, (16, 32, 64, 128, 256))
    self.assertEqual((config.sampling.temperature, config.sampling.top_k, config.sampling.top_p,
                      config.sampling.max_new_tokens), (0.0, 0, 1.0, 128))
    self.assertIsNone(config.defaults.speculative.strategy)
    self.assertIsNone(config.models.glm.speculative.strategy)
    self.assertEqual((config.server.host, config.server.port), ("127.0.0.1", 8000))
    self.assertIsNone(config.distributed.coordinator_address)
    self.assertIsNone(config.distributed.num_processes)
    self.assertIsNone(config.distributed.process_id)
    self.assertIsNone(config.cache_dir)
    self.assertTrue(config.compilation_cache)

  @parameterized.parameters(("glm-4.5-air", "glm4moe"), ("glm-4.7", "glm4moe"),
                            ("glm-4.7-flash", "deepseek2"), ("glm-5", "glm-dsa"))
  def test_real_variants_need_a_source(self, variant, arch):
    config = glm.get_config(variant)
    self.assertIsNone(config.model.source)
    self.assertEqual(config.model.arch, arch)
    self.assertEqual(config.server.model_name, variant)
    self.assertEqual(config.engine.max_len, 32768)
    self.assertEqual(config.model.name, "glm")
    config.model.source = "/models/pkg"     # the field exists and takes a string
    self.assertEqual(config.model.source, "/models/pkg")

  def test_tiny_is_small(self):
    config = tiny.get_config()
    self.assertEqual(config.to_dict(), glm.get_config("tiny").to_dict())
    self.assertEqual(config.model.source, "embedded:tiny")
    self.assertLess(config.engine.max_len, glm.get_config().engine.max_len)
    self.assertLessEqual(max(config.engine.prefill_buckets), config.engine.max_len)

  def test_unknown_variant(self):
    with self.assertRaisesRegex(ValueError, "unknown variant 'glm-9'"):
      glm.get_config("glm-9")

  def test_locked_rejects_unknown_fields(self):
    config = glm.get_config()
    for group, field in ((config.defaults.speculative, "mode"),
                         (config.defaults.speculative, "spec_default"),
                         (config.engine, "draft_model")):
      with self.assertRaises(AttributeError):
        setattr(group, field, "x")

  def test_placeholders_are_typed(self):
    config = glm.get_config()
    with self.assertRaises(TypeError):
      config.defaults.speculative.strategy = 3
    with self.assertRaises(TypeError):
      config.distributed.num_processes = "two"


class CommandLineTest(absltest.TestCase):

  def test_override_speculative_strategy(self):
    config = parse(f"--config={GLM}:tiny", "--config.defaults.speculative.strategy=disabled")
    self.assertEqual(config.engine.max_len, 64)
    self.assertEqual(speculative.strategy_from_config(config, config.model.name),
                     ("disabled", "defaults.speculative.strategy"))

  def test_per_model_override_and_other_groups(self):
    config = parse(f"--config={GLM}:glm-4.7-flash", "--config.model.source=/models/flash",
                   "--config.models.glm.speculative.strategy= MTP",
                   "--config.defaults.speculative.strategy=disabled",
                   "--config.mesh.stages=3", "--config.mesh.splits=15,31",
                   "--config.engine.timing=true", "--config.distributed.num_processes=2")
    self.assertEqual(speculative.strategy_from_config(config, "glm"),
                     ("native-mtp-n1", "models.glm.speculative.strategy"))
    self.assertEqual((config.model.source, config.mesh.stages, config.mesh.splits),
                     ("/models/flash", 3, (15, 31)))
    self.assertTrue(config.engine.timing)
    self.assertEqual(config.distributed.num_processes, 2)

  def test_tiny_config_file(self):
    config = parse(f"--config={TINY}", "--config.engine.slots=1")
    self.assertEqual((config.engine.slots, config.engine.max_len), (1, 64))

  def test_invalid_strategy_loads_then_fails_validation(self):
    config = parse(f"--config={GLM}", "--config.defaults.speculative.strategy=ngram/simple")
    with self.assertRaisesRegex(SpeculativeConfigError, "must be one of"):
      speculative.strategy_from_config(config, "glm")

  def test_ngram_strategy_from_the_command_line(self):
    config = parse(f"--config={GLM}", "--config.defaults.speculative.strategy=ngram-simple",
                   "--config.models.glm.speculative.strategy=mtp-cache")
    self.assertEqual(speculative.strategy_from_config(config, "glm"),
                     ("mtp-cache", "models.glm.speculative.strategy"))
    config.models.glm.speculative.strategy = None
    self.assertEqual(speculative.strategy_from_config(config, "glm"),
                     ("ngram-simple", "defaults.speculative.strategy"))

  def test_unknown_fields_are_rejected(self):
    for override in ("--config.defaults.speculative.mode=ngram",
                     "--config.defaults.speculative.draft_max=4",
                     "--config.engine.spec_default=ngram",
                     "--config.models.other.speculative.strategy=auto"):
      with self.assertRaises((AttributeError, KeyError), msg=override):
        parse(f"--config={GLM}", override)

  def test_subprocess_command_line(self):
    """The real `sys.argv` path, as `python -m mtpjax.serve` will see it."""
    script = (
        "import json, sys\n"
        "from absl import app, flags\n"
        "from ml_collections import config_flags\n"
        "from mtpjax import speculative\n"
        "CONFIG = config_flags.DEFINE_config_file('config', None, lock_config=True)\n"
        "def main(_):\n"
        "  c = CONFIG.value\n"
        "  print(json.dumps([list(speculative.strategy_from_config(c, c.model.name)),\n"
        "                    c.engine.max_len, c.server.port]))\n"
        "app.run(main)\n")
    result = subprocess.run(
        [sys.executable, "-c", script, "--config=configs/glm.py:tiny",
         "--config.defaults.speculative.strategy=disabled", "--config.server.port=9001"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": REPO})
    self.assertEqual(result.returncode, 0, msg=result.stderr)
    self.assertEqual(json.loads(result.stdout.strip().splitlines()[-1]),
                     [["disabled", "defaults.speculative.strategy"], 64, 9001])


if __name__ == "__main__":
  absltest.main()
