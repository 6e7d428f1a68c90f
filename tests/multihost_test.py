"""Two real processes joined by jax.distributed on 127.0.0.1 run one 2-stage pipeline.

Each process has 2 simulated CPU devices and owns one stage (so it loads only that stage's
tensors); hops cross the processes through gloo collectives. Their tokens must equal a
single-process run of the same model.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap

from absl.testing import absltest

import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPT = [3, 17, 42, 99, 7, 250]

WORKER = textwrap.dedent("""
    import json, sys
    from mtpjax import distributed
    if not distributed.initialize():
        raise SystemExit("no coordinator configured")
    import jax
    import numpy as np
    import mtpjax
    model = mtpjax.load(sys.argv[1], stages=2)
    owned = [s for s in range(2) if model.hops.local(s)]
    loaded = [w is not None for w in model.weights(with_mtp=True)]
    on = model.generate({prompt}, max_new_tokens=10, speculative="native-mtp-n1")
    off = model.generate({prompt}, max_new_tokens=10, speculative="disabled")
    # Long enough for the drafting policy to probe plain steps, then catch up and draft again.
    paused = model.generate({prompt}, max_new_tokens=40, speculative="native-mtp-n1")
    logits = model.logits({prompt})
    print("RESULT " + json.dumps(dict(
        process=jax.process_index(), devices=len(jax.devices()), owned=owned, loaded=loaded,
        on=on.tokens, off=off.tokens, accepted=on.stats.accepted, paused=paused.tokens,
        plain_passes=paused.stats.target_passes - paused.stats.verifications,
        logits_argmax=np.argmax(logits, -1).tolist(), logits_sum=float(np.abs(logits).sum()))))
""").format(prompt=PROMPT)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class MultiHostTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    from mtpjax.testing.tiny_glm import TinyGlmSpec, write_tiny_glm_gguf
    cls.tmp = tempfile.TemporaryDirectory()
    cls.path = os.path.join(cls.tmp.name, "tiny.gguf")
    write_tiny_glm_gguf(cls.path, TinyGlmSpec(mtp_copies_trunk=True))
    port = _free_port()
    procs = []
    for pid in range(2):
      env = dict(os.environ, XLA_FLAGS=xla_flags.for_tests(devices=2),
                 JAX_PLATFORMS="cpu", COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                 NUM_PROCESSES="2", PROCESS_ID=str(pid),
                 PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
      env.pop("JAX_COORDINATOR_ADDRESS", None)
      procs.append(subprocess.Popen([sys.executable, "-c", WORKER, cls.path], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    cls.results = []
    for proc in procs:
      try:
        out, err = proc.communicate(timeout=400)
      except subprocess.TimeoutExpired:
        for p in procs:
          p.kill()
        raise
      lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
      if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker failed (rc {proc.returncode}):\n{err[-4000:]}")
      cls.results.append(json.loads(lines[-1][len("RESULT "):]))

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def test_each_process_owns_and_loads_one_stage(self):
    for pid, result in enumerate(self.results):
      self.assertEqual(result["process"], pid)
      self.assertEqual(result["devices"], 4)           # 2 local + 2 remote
      self.assertEqual(result["owned"], [pid])
      self.assertEqual(result["loaded"], [s == pid for s in range(2)])

  def test_tokens_match_a_single_process(self):
    import numpy as np
    import mtpjax
    model = mtpjax.load(self.path)
    on = model.generate(PROMPT, max_new_tokens=10, speculative="native-mtp-n1")
    off = model.generate(PROMPT, max_new_tokens=10, speculative="disabled")
    self.assertEqual(off.tokens, on.tokens)           # MTP is lossless under greedy decoding
    self.assertGreater(on.stats.accepted, 0)
    longer = model.generate(PROMPT, max_new_tokens=40, speculative="disabled")
    logits = model.logits(PROMPT)
    for result in self.results:
      self.assertEqual(result["paused"], longer.tokens)
      self.assertGreater(result["plain_passes"], 1)      # the prefill, then the probe's steps
      self.assertEqual(result["on"], on.tokens)
      self.assertEqual(result["off"], off.tokens)
      self.assertEqual(result["accepted"], on.stats.accepted)
      self.assertEqual(result["logits_argmax"], np.argmax(logits, -1).tolist())
      self.assertAlmostEqual(result["logits_sum"], float(np.abs(logits).sum()), places=2)


class DistributedSettingsTest(absltest.TestCase):
  """Where `distributed.initialize` reads its settings from, and its typed errors."""

  def test_env_vars(self):
    from mtpjax import distributed
    got = distributed.settings_from(None, {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
                                           "NUM_PROCESSES": "4", "PROCESS_ID": "3"})
    self.assertEqual(got, distributed.DistributedSettings("10.0.0.1:1234", 4, 3))
    self.assertIsNone(distributed.settings_from(None, {}))

  def test_config_wins_over_env(self):
    from configs import glm
    from mtpjax import distributed
    config = glm.get_config()
    config.distributed.coordinator_address = "127.0.0.1:9999"
    config.distributed.num_processes = 2
    config.distributed.process_id = 1
    got = distributed.settings_from(config, {"COORDINATOR_ADDRESS": "x:1", "NUM_PROCESSES": "8",
                                             "PROCESS_ID": "0"})
    self.assertEqual(got, distributed.DistributedSettings("127.0.0.1:9999", 2, 1))

  def test_incomplete_or_bad_settings(self):
    from mtpjax import distributed, errors
    with self.assertRaisesRegex(errors.MeshConfigError, "PROCESS_ID"):
      distributed.settings_from(None, {"COORDINATOR_ADDRESS": "h:1", "NUM_PROCESSES": "2"})
    with self.assertRaisesRegex(errors.MeshConfigError, r"outside \[0, 2\)"):
      distributed.settings_from(None, {"COORDINATOR_ADDRESS": "h:1", "NUM_PROCESSES": "2",
                                       "PROCESS_ID": "2"})
    with self.assertRaisesRegex(errors.MeshConfigError, "must be an integer"):
      distributed.settings_from(None, {"COORDINATOR_ADDRESS": "h:1", "NUM_PROCESSES": "two",
                                       "PROCESS_ID": "0"})


if __name__ == "__main__":
  absltest.main()
