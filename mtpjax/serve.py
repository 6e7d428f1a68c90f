"""`python -m mtpjax.serve [--config=configs/glm.py[:variant]]`: the OpenAI-compatible server.

Any config field can be overridden, e.g. `--config.model.source=/path/to/package`,
`--config.defaults.speculative.strategy=disabled`, `--config.server.port=8080`. Without a
variant the server serves the trained demo package shipped in `mtpjax/assets/glm-demo`
(offline); `configs/glm.py:tiny` serves a generated tiny model. `--help` lists every field
with its default.
"""

from __future__ import annotations

import pathlib
import sys

from absl import app
from absl import logging
from ml_collections import config_dict, config_flags

from mtpjax import errors
from mtpjax.configs import glm

# The config shipped in the package: the default, and what `configs/glm.py` names wherever
# the working directory has no such file (an installed mtpjax, run from any folder).
SHIPPED_CONFIG = pathlib.Path(glm.__file__)
_SHIPPED_NAME = "configs/glm.py"

_CONFIG = config_flags.DEFINE_config_file(
    "config", str(SHIPPED_CONFIG), "config file, e.g. configs/glm.py or configs/glm.py:glm-4.7",
    lock_config=True)


def resolve_config_argument(argv: list[str]) -> list[str]:
  """`argv` with `--config=configs/glm.py[:variant]` pointing at the shipped config when the
  working directory holds no `configs/glm.py`."""
  out = []
  for arg in argv:
    name, sep, value = arg.partition("=")
    if name == "--config" and sep:
      path, colon, variant = value.partition(":")
      if path == _SHIPPED_NAME and not pathlib.Path(path).is_file():
        arg = f"--config={SHIPPED_CONFIG}{colon}{variant}"
    out.append(arg)
  return out


def _fields(config, prefix: str = "") -> list[str]:
  """`--config.group.field = default` lines for every leaf of `config`."""
  lines = []
  for key in sorted(config.keys()):
    value = config[key]
    if isinstance(value, config_dict.ConfigDict):
      lines += _fields(value, f"{prefix}{key}.")
    else:
      lines.append(f"  --config.{prefix}{key} = {value!r}")
  return lines


def help_text(argv: list[str]) -> str:
  """The module's usage, the variants and every config field with its default (for the
  variant `argv` names, if any)."""
  variant = next((a.partition("=")[2].partition(":")[2] for a in argv
                  if a.startswith("--config=")), "")
  return "\n".join([__doc__.strip(), "", "Variants (--config=configs/glm.py:VARIANT): "
                    + ", ".join(glm.VARIANTS), "",
                    f"Config fields and their defaults{f' ({variant})' if variant else ''}:",
                    *_fields(glm.get_config(variant or None)), ""])


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from mtpjax import server  # jax and the model code load only after the flags parse
  try:
    server.serve(_CONFIG.value)
  except errors.MtpjaxError as e:   # typed errors carry file, field and remedy: no traceback
    logging.error("cannot serve: %s", e)
    sys.exit(1)


def run() -> None:
  argv = resolve_config_argument(sys.argv)
  if any(a in ("--help", "-h", "--helpshort", "--helpfull", "-?") for a in argv[1:]):
    print(help_text(argv))
    sys.exit(0)
  app.run(main, argv=argv)


if __name__ == "__main__":
  run()
