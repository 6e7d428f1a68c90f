"""The built-in model sources, so that every entry point works offline on a fresh machine.

- `model.source = ""` (`configs/glm.py` without a variant): the trained demo package shipped in
  `mtpjax/assets/glm-demo` (tools/train_demo.py, MODEL_CARD.md beside it): a small GLM-4.x MoE
  whose NextN head really predicts, so native MTP is worth something.
- a named source registered with `register_source` (e.g. `embedded:tiny`, the generated tiny
  model of `mtpjax/testing/embedded_tiny.py` that `configs/glm.py` registers): built on first use
  into the cache folder.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Callable

from mtpjax import errors
from mtpjax.package import manifest as manifest_lib

DEMO_PACKAGE = pathlib.Path(__file__).resolve().parent / "assets" / "glm-demo"

# source name -> builder(cache_dir) returning the package directory (built if missing).
_NAMED_SOURCES: dict[str, Callable[[str | None], pathlib.Path]] = {}


def cache_root(cache_dir: str | None = None) -> pathlib.Path:
  """`cache_dir`, else `$XDG_CACHE_HOME`, else `~/.cache`; packages go under `mtpjax/`."""
  if cache_dir:
    return pathlib.Path(cache_dir).expanduser()
  xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
  return pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"


def register_source(name: str, build: Callable[[str | None], pathlib.Path]) -> None:
  """Make `model.source = name` serve the package `build(cache_dir)` returns."""
  _NAMED_SOURCES[name] = build


def resolve_source(config: Any) -> str:
  """The model path the config names: "" is the shipped demo, a registered name its package."""
  source = config.model.source
  if source is None:
    raise errors.MtpjaxError(
        "this config has no model: model.source is unset", field="model.source",
        remedy="pass --config.model.source=/path/to/package-or.gguf, or use configs/glm.py "
        "without a variant for the built-in demo model")
  if source.strip() == "":
    if not (DEMO_PACKAGE / manifest_lib.MANIFEST_NAME).is_file():
      raise errors.PackageError(
          "the demo package is missing from this installation", path=str(DEMO_PACKAGE),
          field="model.source", remedy="reinstall mtpjax, or rebuild it with "
          "`python tools/train_demo.py --out mtpjax/assets/glm-demo`")
    return str(DEMO_PACKAGE)
  if source.strip() in _NAMED_SOURCES:
    return str(_NAMED_SOURCES[source.strip()](config.cache_dir))
  return source
