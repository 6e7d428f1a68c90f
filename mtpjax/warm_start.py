"""A warm start: JAX's persistent compilation cache under the mtpjax cache directory.

Compiling every prefill bucket and step variant is most of a server's start-up; with the cache
on, a second start of the same config (same model shapes, engine settings, jax and backend)
loads the compiled executables instead. `config.compilation_cache = False` turns it off.
"""

from __future__ import annotations

import pathlib
import warnings
from typing import Any

import jax
from absl import logging

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


class CacheUse:
  """Counts the persistent-cache lookups of a span of this process (JAX's monitoring events),
  so a start-up log says how many programs were compiled and how many came from the cache, and
  the entries JAX could not read (a corrupted or truncated file: JAX compiles the program
  again and says so only in a Python warning, easily lost) or write (a full disk); here each
  one is logged."""

  _REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
  _HITS = "/jax/compilation_cache/cache_hits"
  _UNREADABLE = "Error reading persistent compilation cache entry"
  _UNWRITTEN = "Error writing persistent compilation cache entry"   # e.g. a full disk

  def __init__(self):
    self.requests = self.hits = 0
    self.unreadable: list[str] = []
    self.unwritten: list[str] = []
    self._warnings = warnings.catch_warnings(record=True)

  def _count(self, event: str, **_) -> None:
    if event == self._REQUESTS:
      self.requests += 1
    elif event == self._HITS:
      self.hits += 1

  def __enter__(self) -> "CacheUse":
    self._caught = self._warnings.__enter__()
    warnings.simplefilter("always")
    jax.monitoring.register_event_listener(self._count)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_listener(self._count)
    self._warnings.__exit__(*exc)
    for caught in self._caught:
      message = str(caught.message)
      if message.startswith(self._UNREADABLE):
        self.unreadable.append(message)
        logging.warning("compilation cache: %s; compiled it again", message)
      elif message.startswith(self._UNWRITTEN):
        self.unwritten.append(message)
        logging.warning("compilation cache: %s; the next start compiles it again", message)
      else:                             # not ours to swallow
        warnings.warn_explicit(caught.message, caught.category, caught.filename, caught.lineno)

  def summary(self) -> str:
    if not self.requests:
      return "no compilation cache lookups (the cache is off)"
    unreadable = (f" ({len(self.unreadable)} failed cache reads, those programs compiled "
                  "again)" if self.unreadable else "")
    unwritten = (f"; {len(self.unwritten)} could not be written to the cache"
                 if self.unwritten else "")
    return (f"{self.requests - self.hits} programs compiled{unreadable}, {self.hits} loaded "
            f"from the compilation cache{unwritten}")
