"""Every code block of the README runs verbatim.

The two commands at the top are CI's own (`.ci/run`) and the demo server's
(`server_demo_test.py`, which also runs every block that talks to the server at :8000); a block
preceded by `<!-- not run: reason -->` says why it is not run here, and ```text blocks are
illustrations (real models at paths the reader supplies). Everything else runs here, in the
repository root, as a reader would paste it.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

from absl.testing import absltest

REPO = pathlib.Path(__file__).resolve().parent.parent
SERVER_URL = "http://127.0.0.1:8000"
_BLOCK = re.compile(r"(<!-- not run: [^>]*-->\n)?```(bash|python)\n(.*?)```", re.S)


def readme_blocks() -> list[tuple[str, str, bool]]:
  """(language, code, marked not run) of every bash and python block."""
  text = (REPO / "README.md").read_text()
  return [(lang, code, bool(mark)) for mark, lang, code in _BLOCK.findall(text)]


def runnable_here(blocks) -> list[tuple[str, str]]:
  return [(lang, code) for lang, code, not_run in blocks
          if not not_run and SERVER_URL not in code and "pip install" not in code]


class ReadmeTest(absltest.TestCase):

  def test_the_readme_is_a_guide_of_about_300_lines_opening_with_the_two_commands(self):
    text = (REPO / "README.md").read_text()
    self.assertLessEqual(len(text.splitlines()), 320)
    first, second = [code.strip() for _, code, _ in readme_blocks()[:2]]
    self.assertEqual(first, "pip install -e '.[serve]' && python -m mtpjax.serve "
                            "--config=configs/glm.py")
    self.assertEqual(second, "pip install -e '.[test]' && python -m pytest -q tests")
    self.assertIn(second, (REPO / ".ci" / "run").read_text())

  def test_every_other_block_runs_verbatim(self):
    blocks = runnable_here(readme_blocks())
    self.assertGreaterEqual(len(blocks), 4)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for lang, code in blocks:
      with self.subTest(code=code[:70]):
        command = ["bash", "-ec", code] if lang == "bash" else ["python", "-c", code]
        run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=900)
        self.assertEqual(run.returncode, 0, f"{code}\n{run.stdout[-2000:]}{run.stderr[-4000:]}")
        self.assertTrue(run.stdout.strip(), code)


if __name__ == "__main__":
  absltest.main()
