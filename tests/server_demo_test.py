"""The README's first command: `python -m mtpjax.serve --config=configs/glm.py`, nothing else.

The server runs from a non-editable install of the repository (`pip install .`, into a venv
that sees this interpreter's dependencies) in a folder that holds no checkout, so the shipped
config, demo package and kernel sources must come from the installed package data.
It serves the trained demo package shipped in the repository, offline; a chat completion
returns text and `/metrics` shows the native-MTP accept rate of the demo's real NextN head.
Every README example that talks to that server (curl and Python) runs here verbatim, with only
the port replaced by the free one the server picked. The server compiles with the suite's fast
XLA flags (`xla_flags.py`), as every test process does: at XLA's default optimization its
compile alone took ~200 s of the suite's 20 minutes.
"""

import contextlib
import io
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import httpx
import numpy as np
import openai
from absl.testing import absltest

import mtpjax
from mtpjax import embedded
from server_test import REPO, ServerProcess, metric, package_tokenizer

DEMO_MODEL = "mtpjax-glm-demo"
README_URL = "http://127.0.0.1:8000"
SERVE_COMMAND = "python -m mtpjax.serve --config=configs/glm.py"


def readme_examples(readme: str) -> list[tuple[str, str]]:
  """(language, code) of every README block that talks to the served model at :8000."""
  blocks = re.findall(r"```(bash|python)\n(.*?)```", readme, flags=re.S)
  return [(lang, code) for lang, code in blocks if README_URL in code]


class DemoServerTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp(prefix="mtpjax-demo-server-")
    cls.addClassCleanup(shutil.rmtree, cls.tmp, ignore_errors=True)
    venv = pathlib.Path(cls.tmp) / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(REPO)], check=True,
                   cwd=cls.tmp)
    cls.installed = pathlib.Path(subprocess.run(
        [python, "-c", "import mtpjax; print(mtpjax.__file__)"], check=True, cwd=cls.tmp,
        capture_output=True, text=True).stdout.strip()).parent
    cls.server = ServerProcess(cls.tmp, pathlib.Path(cls.tmp) / "server.log", tiny=False,
                               python=python, cwd=pathlib.Path(cls.tmp))
    try:
      cls.url = cls.server.wait_ready()
    except BaseException:
      cls.server.stop()
      raise
    cls.client = openai.OpenAI(base_url=cls.url + "/v1", api_key="unused", max_retries=0,
                               timeout=300)

  @classmethod
  def tearDownClass(cls):
    cls.server.stop()
    super().tearDownClass()

  def test_chat_answers_with_the_demo_and_metrics_show_its_accept_rate(self):
    # The installed copy's demo package, not the checkout's.
    self.assertNotEqual(self.installed, REPO / "mtpjax")
    self.assertIn(str(self.installed / "assets" / "glm-demo"), self.server.log())
    # The log says what warm-up compiled or loaded, and the demo's draft window.
    self.assertRegex(self.server.log(), r"warmed up the engine in [0-9.]+ s \(4 slots, max_len "
                     r"8192\): \d+ programs compiled, \d+ loaded from the compilation cache")
    self.assertIn("draft window in force: 1 to 3 tokens a step", self.server.log())
    self.assertEqual([m.id for m in self.client.models.list().data], [DEMO_MODEL])
    reply = self.client.chat.completions.create(
        model=DEMO_MODEL, max_tokens=24,
        messages=[{"role": "user", "content": "def parse_args(argv):"}])
    self.assertTrue(reply.choices[0].message.content.strip())
    completion = self.client.completions.create(
        model=DEMO_MODEL, max_tokens=48, prompt="import os\nimport sys\n\n\ndef main():\n")
    self.assertEqual(completion.usage.completion_tokens, 48)
    text = httpx.get(self.url + "/metrics", timeout=30).text
    self.assertGreater(metric(text, "mtpjax_native_mtp_accepted"), 0)
    self.assertGreater(metric(text, "mtpjax_native_mtp_accept_rate"), 0.3)

  def test_logprobs_with_mtp_on_equal_the_model_with_mtp_off(self):
    """The server drafts (MTP on); the reference decodes in this process with MTP off."""
    tokenizer, template = package_tokenizer(embedded.DEMO_PACKAGE)
    messages = [{"role": "user", "content": "def parse_args(argv):"}]
    prompt = tokenizer.encode(template.render(messages, add_generation_prompt=True))
    model = mtpjax.load(str(embedded.DEMO_PACKAGE))
    reference = model.generate(prompt, max_new_tokens=16, stop_ids=tokenizer.stop_ids,
                               speculative="disabled", logprobs=True).logprobs
    expected = np.array([e.logprob for e in reference])
    reply = self.client.chat.completions.create(model=DEMO_MODEL, max_tokens=16,
                                                messages=messages, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    np.testing.assert_allclose([c.logprob for c in content], expected, atol=1e-4)
    self.assertEqual([c.bytes for c in content],
                     [list(tokenizer.token_bytes(e.token)) for e in reference])
    for item, entry in zip(content, reference):
      self.assertEqual([t.bytes for t in item.top_logprobs],
                       [list(tokenizer.token_bytes(t)) for t, _ in entry.top[:3]])
    streamed = [c.logprob for chunk in self.client.chat.completions.create(
        model=DEMO_MODEL, max_tokens=16, messages=messages, logprobs=True, stream=True)
                for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    np.testing.assert_allclose(streamed, expected, atol=1e-4)
    completion = self.client.completions.create(model=DEMO_MODEL, max_tokens=16, logprobs=2,
                                                prompt=prompt)
    legacy = completion.choices[0].logprobs
    np.testing.assert_allclose(legacy.token_logprobs, expected, atol=1e-4)
    self.assertEqual(len(legacy.top_logprobs[0]), 2)
    self.assertEqual("".join(legacy.tokens), completion.choices[0].text)

  def test_readme_examples_run_verbatim_against_the_readme_serve_command(self):
    readme = (REPO / "README.md").read_text()
    examples = readme_examples(readme)
    self.assertIn(SERVE_COMMAND, readme[:readme.index(examples[0][1])])
    self.assertEqual(sorted({lang for lang, _ in examples}), ["bash", "python"])
    for lang, code in examples:
      code = code.replace(README_URL, self.url)
      with self.subTest(lang=lang, code=code[:60]):
        if lang == "bash":
          run = subprocess.run(["bash", "-ec", code.replace("curl ", "curl -sS --fail-with-body ")],
                               capture_output=True, text=True, timeout=300)
          self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
          self.assertIn("data: [DONE]", run.stdout)
        else:
          out = io.StringIO()
          with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})
          self.assertTrue(out.getvalue().strip())


if __name__ == "__main__":
  absltest.main()
