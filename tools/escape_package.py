"""A copy of a v1 layer package whose chat template has a slow branch, for load tests.

The template renders as the original for every conversation except one whose last message is
`--trigger`: then a single `sum` filter call over 3,000 lists runs for about a minute, which
the render budget's clock cannot interrupt (tools/load_test.py --template_escape=TRIGGER sends
it; the server must stop it at server.template_timeout_s). Prints one JSON line.

  python -m tools.escape_package --out=/tmp/escape-pkg
"""

from __future__ import annotations

import json
import pathlib
import shutil

import gguf
from absl import app, flags

import mtpjax
from mtpjax.testing import package_mutations
from mtpjax.testing.gguf_rewrite import rewrite_gguf

_SOURCE = flags.DEFINE_string(
    "source", str(pathlib.Path(mtpjax.__file__).parent / "assets" / "glm-demo"),
    "the v1 package to copy")
_OUT = flags.DEFINE_string("out", None, "where the copy goes (replaced)", required=True)
_TRIGGER = flags.DEFINE_string("trigger", "render-escape", "the message that takes the branch")

_SLOW = "{{ ([[1] * 1000] * 3000)|sum(start=[])|length }}"


def main(argv):
  del argv
  out = pathlib.Path(_OUT.value)
  shutil.rmtree(out, ignore_errors=True)
  shutil.copytree(_SOURCE.value, out)
  metadata = package_mutations.read_manifest(out)["shared"]["metadata"]["path"]
  path = out / metadata
  reader = gguf.GGUFReader(path)
  template = reader.fields["tokenizer.chat_template"].contents()
  escaped = (f"{{% if messages[-1]['content'] == {_TRIGGER.value!r} %}}{_SLOW}{{% endif %}}"
             + template)
  rewritten = path.with_name(path.name + ".new")
  rewrite_gguf(reader, rewritten,
               keys={"tokenizer.chat_template": (escaped, gguf.GGUFValueType.STRING)})
  rewritten.replace(path)
  package_mutations.rehash(out, metadata)
  print(json.dumps({"package": str(out), "template_escape": _TRIGGER.value}))


if __name__ == "__main__":
  app.run(main)
