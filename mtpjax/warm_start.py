"""A warm start: JAX's persistent compilation cache under the mtpjax cache directory.

Compiling every prefill bucket and step variant is most of a server's start-up; with the cache
on, a second start of the same config (same model shapes, engine settings, jax and backend)
loads the compiled executables instead. `config.compilation_cache = False` turns it off.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax

from mtpjax import embedded


def compilation_cache_dir(cache_dir: str | None) -> pathlib.Path:
  """Where compiled executables go: `<cache root>/mtpjax/jax-compilation`."""
  return embedded.cache_root(cache_dir) / "mtpjax" / "jax-compilation"


def enable_compilation_cache(config: Any) -> pathlib.Path | None:
  """Turn on the persistent cache for this process as the config says; its folder, or None.

  Every compile is cached, however short: a tiny model's steps compile in well under JAX's
  default one-second threshold, yet a start compiles dozens of them.
  """
  if not config.compilation_cache:
    return None
  folder = compilation_cache_dir(config.cache_dir)
  folder.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(folder))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return folder
