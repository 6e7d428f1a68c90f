"""A loaded model no longer reads its package's files (issue 52, item 3).

Before, weights could stay memory-mapped to the files after their hash was checked: truncating a
layer file while serving killed the process with SIGBUS, and writing into one changed the
answers. The model here runs in a child process, so a crash is a test failure, not a lost
test worker.
"""

import json
import pathlib
import subprocess
import sys
import textwrap

import package_examples as examples
from absl.testing import absltest

import mtpjax

DEMO = pathlib.Path(mtpjax.__file__).resolve().parent / "assets" / "glm-demo"
REPO = pathlib.Path(__file__).resolve().parent.parent

# Loads the package, answers, then truncates, rewrites (random bytes, same size) and deletes
# its files in turn, and answers again: the tokens, or the signal that killed it.
_CHILD = """
import json, os, pathlib, random, sys
import mtpjax
root = pathlib.Path(sys.argv[1])
model = mtpjax.load(str(root), int8_activations=False)
ask = lambda: model.generate([5, 17, 42, 7], max_new_tokens=8, temperature=0.0).tokens
before = ask()
rng = random.Random(0)
files = sorted(p for p in root.rglob("*") if p.is_file())
for index, path in enumerate(files):
  action = ("truncate", "rewrite", "delete")[index % 3]
  if action == "truncate":
    os.truncate(path, 0)
  elif action == "rewrite":
    path.write_bytes(rng.randbytes(path.stat().st_size))
  else:
    path.unlink()
print(json.dumps({"before": before, "after": ask(), "files": len(files)}))
"""


class ServedFilesTest(absltest.TestCase):

  def test_truncating_rewriting_and_deleting_the_files_changes_nothing(self):
    root = examples.package_copy(self, DEMO)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD), str(root)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    self.assertEqual(done.returncode, 0, done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    self.assertGreaterEqual(result["files"], 8)
    self.assertLen(result["before"], 8)
    self.assertEqual(result["after"], result["before"])


if __name__ == "__main__":
  absltest.main()
