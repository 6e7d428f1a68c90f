"""The Colab notebooks run top to bottom on CPU, from the repository root, as a user runs them.

Each notebook is executed by nbclient in a real python3 kernel (which inherits the 4 simulated
CPU devices of conftest.py, so the pipeline notebook uses 2 stages). The notebooks assert their
own claims (MTP on = off, pipelined = single device); this test checks that no cell failed, that
the plots were drawn, that the printed evidence is there, and that the committed files carry no
outputs.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

import nbclient
import nbformat
from absl.testing import absltest, parameterized

REPO = pathlib.Path(__file__).resolve().parent.parent
CELL_TIMEOUT_S = 300

# notebook -> lines its outputs must contain (what the notebook shows the user).
NOTEBOOKS = {
    "quickstart": ("valid: True", "identical with MTP off: True", "has an MTP head: True",
                   "text in, text out: ", "chat: "),
    "convert_and_serve": ("same tokens as the single-device model: True",
                          "serving at http://127.0.0.1:", "server stopped, exit status"),
}


def _path(name: str) -> pathlib.Path:
  return REPO / "colab" / f"{name}.ipynb"


def _outputs(nb) -> list[dict]:
  return [output for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs]


def _text(outputs: list[dict]) -> str:
  parts = []
  for output in outputs:
    if output.output_type == "stream":
      parts.append(output.text)
    elif output.output_type in ("execute_result", "display_data"):
      parts.append(output.data.get("text/plain", ""))
  return "".join(parts)


class NotebooksTest(parameterized.TestCase):

  @parameterized.parameters(*NOTEBOOKS)
  def test_saved_without_outputs(self, name):
    nb = nbformat.read(_path(name), as_version=4)
    nbformat.validate(nb)
    # The install cell names no placeholder source and keeps the runtime's own jax.
    install = next(c.source for c in nb.cells if c.cell_type == "code" and "%pip" in c.source)
    self.assertNotIn("OWNER", install)
    self.assertIn('"jax=={jax.__version__}"', install)
    for cell in nb.cells:
      if cell.cell_type == "code":
        self.assertEqual(cell.outputs, [], f"{name}: a cell was saved with outputs")
        self.assertIsNone(cell.execution_count, f"{name}: a cell was saved executed")

  @parameterized.parameters(*NOTEBOOKS)
  def test_runs_top_to_bottom(self, name):
    nb = nbformat.read(_path(name), as_version=4)
    with tempfile.TemporaryDirectory(prefix="mtpjax-notebook-test-") as cache:
      client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                                       resources={"metadata": {"path": str(REPO)}})
      # CellExecutionError names the failing cell and its traceback.
      client.execute(env={**os.environ, "XDG_CACHE_HOME": cache})
    outputs = _outputs(nb)
    self.assertEqual([o for o in outputs if o.output_type == "error"], [])
    images = [o for o in outputs if o.output_type in ("display_data", "execute_result")
              and "image/png" in o.data]
    self.assertNotEmpty(images, f"{name}: no plot was drawn")
    text = _text(outputs)
    for expected in NOTEBOOKS[name]:
      self.assertIn(expected, text)


if __name__ == "__main__":
  absltest.main()
