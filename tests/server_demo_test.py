"""The README's first command: `python -m mtpjax.serve --config=configs/glm.py`, nothing else.

It serves the trained demo package shipped in the repository, offline; a chat completion
returns text and `/metrics` shows the native-MTP accept rate of the demo's real NextN head.
"""

import pathlib
import tempfile

import httpx
import openai
from absl.testing import absltest

from mtpjax import embedded
from server_test import ServerProcess, metric

DEMO_MODEL = "mtpjax-glm-demo"


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


if __name__ == "__main__":
  absltest.main()
