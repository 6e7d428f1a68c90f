"""The README's first command: `python -m mtpjax.serve --config=configs/glm.py`, nothing else.

It serves the trained demo package shipped in the repository, offline; a chat completion
returns text and `/metrics` shows the native-MTP accept rate of the demo's real NextN head.
Every README example that talks to that server (curl and Python) runs here verbatim, with only
the port replaced by the free one the server picked.
"""

import contextlib
import io
import pathlib
import re
import subprocess
import tempfile

import httpx
import openai
from absl.testing import absltest

from mtpjax import embedded
from server_test import REPO, ServerProcess, metric

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
    cls.server = ServerProcess(cls.tmp, pathlib.Path(cls.tmp) / "server.log", tiny=False)
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
    self.assertIn(str(embedded.DEMO_PACKAGE), self.server.log())
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
