"""Shared test setup: simulated CPU devices and fast compiles (`xla_flags.py`) must be
configured before jax is imported, compiles go to the run's shared cache, and each module's
compiled programs are released after it."""

import gc
import inspect
import os
import unittest

import xla_flags

os.environ.setdefault("XLA_FLAGS", xla_flags.for_tests())
os.environ.setdefault("JAX_PLATFORMS", "cpu")
xla_flags.share_compiled_programs(os.environ)

import jax  # noqa: E402  (after the flags above)
import pytest  # noqa: E402

_COMPILED_HOLDERS = ("mtpjax", "jax", "jaxlib", "flax")


def _holds_programs(value) -> bool:
  """Whether a class attribute holds models, engines or arrays (directly or in a dict/list)."""
  if isinstance(value, dict):
    return any(_holds_programs(v) for v in value.values())
  if isinstance(value, list):
    return any(_holds_programs(v) for v in value)
  return type(value).__module__.split(".")[0] in _COMPILED_HOLDERS


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
  """Every XLA:CPU program holds memory maps; one process running the whole suite passed the
  kernel's limit (vm.max_map_count, 65530) and crashed inside a compile. After a module, drop
  the models and engines its test classes built in setUpClass and JAX's caches, so their
  programs are freed."""
  yield
  for _, cls in inspect.getmembers(request.module, inspect.isclass):
    if issubclass(cls, unittest.TestCase) and cls.__module__ == request.module.__name__:
      for name, value in list(vars(cls).items()):
        if not name.startswith("__") and _holds_programs(value):
          delattr(cls, name)
  jax.clear_caches()
  gc.collect()


# The longest files (`pytest --durations=60`, Session 19), longest first. `--dist loadfile`
# hands files to the two workers in collection order; starting these first keeps one long file
# from running alone at the end while the other worker idles.
_LONGEST_FIRST = ("notebooks_test.py", "host_drafting_test.py", "draft_window_test.py",
                  "server_demo_test.py", "server_context_test.py", "server_lifecycle_test.py",
                  "demo_model_test.py", "paged_kv_test.py", "server_test.py",
                  "train_demo_test.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the rest in order
