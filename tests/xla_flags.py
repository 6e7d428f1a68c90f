"""The XLA flags of the test processes (this one, and the servers and workers they launch).

Tests run tiny models a few steps each, so their time is compiling, not running: XLA:CPU's
LLVM backend at optimization level 0, without its expensive passes, compiles the suite's
programs ~40% faster. XLA's own graph passes still run, so a program computes the same
operations; the README's serve command is still tested as users run it (`production_env`,
server_demo_test).
"""

from __future__ import annotations

FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def for_tests(devices: int = 4) -> str:
  """XLA_FLAGS of a test process simulating `devices` CPU devices."""
  return " ".join((f"--xla_force_host_platform_device_count={devices}", *FAST_COMPILE))


def production_env(env: dict[str, str]) -> dict[str, str]:
  """`env` with XLA's default optimization (the fast-compile flags removed)."""
  flags = [f for f in env.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE]
  return {**env, "XLA_FLAGS": " ".join(flags)}
