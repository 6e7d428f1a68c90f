"""The XLA flags and compile cache of the test processes (this one, and the servers and workers
they launch).

Tests run tiny models a few steps each, so their time is compiling, not running: XLA:CPU's
LLVM backend at optimization level 0, without its expensive passes, compiles the suite's
programs ~40% faster. XLA's own graph passes still run, so a program computes the same
operations.

Test files build the same tiny models, engines and servers again and again, so the run shares
one persistent compilation cache (`share_compiled_programs`): a program compiled once is loaded,
not compiled, by every later file, worker and test server. A cache entry is keyed by the
program, the XLA flags and the backend, so nothing runs a program other than its own; an entry
read while another process writes it fails to load and is compiled again.
"""

from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import tempfile

FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def for_tests(devices: int = 4) -> str:
  """XLA_FLAGS of a test process simulating `devices` CPU devices."""
  return " ".join((f"--xla_force_host_platform_device_count={devices}", *FAST_COMPILE))


_CACHE_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"


def share_compiled_programs(env: dict[str, str]) -> None:
  """Send every compile of this process and the processes it starts (xdist workers, notebook
  kernels, trainers, distributed workers) to the run's compilation cache, however short the
  compile: JAX reads these variables when it is imported. The first process (pytest's) makes
  the folder and removes it at exit; the processes it starts inherit its path."""
  if _CACHE_DIR_ENV not in env:
    env[_CACHE_DIR_ENV] = tempfile.mkdtemp(prefix="mtpjax-test-compiles-")
    atexit.register(shutil.rmtree, env[_CACHE_DIR_ENV], ignore_errors=True)
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def share_with_server(server_folder: pathlib.Path) -> None:
  """Make a test server compile into the run's cache too: the folder it sets for itself
  (`mtpjax.warm_start.compilation_cache_dir`) becomes a link to the run's."""
  folder = os.environ.get(_CACHE_DIR_ENV)
  if folder and not server_folder.exists():
    server_folder.parent.mkdir(parents=True, exist_ok=True)
    server_folder.symlink_to(folder, target_is_directory=True)
