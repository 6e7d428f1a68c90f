"""`python -m mtpjax.serve --config=configs/glm.py[:variant]`: the OpenAI-compatible server.

Any config field can be overridden, e.g. `--config.model.source=/path/to/package`,
`--config.defaults.speculative.strategy=disabled`, `--config.server.port=8080`. Without a
variant the server serves the trained demo package shipped in `mtpjax/assets/glm-demo`
(offline); `configs/glm.py:tiny` serves a generated tiny model.
"""

from __future__ import annotations

import sys

from absl import app
from absl import logging
from ml_collections import config_flags

from mtpjax import errors

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "config file, e.g. configs/glm.py or configs/glm.py:glm-4.7",
    lock_config=True)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/glm.py")
  from mtpjax import server  # jax and the model code load only after the flags parse
  try:
    server.serve(_CONFIG.value)
  except errors.MtpjaxError as e:   # typed errors carry file, field and remedy: no traceback
    logging.error("cannot serve: %s", e)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
