"""Multi-host start-up: `jax.distributed.initialize` from the config or the standard env vars.

It must run before any other JAX call (docs/DECODE.md §8): every process then runs the same program
and sees every host's devices in `jax.devices()`, and a pipelined `mtpjax.load` loads only the
stages on this process's devices. On CPU the cross-process collectives go through gloo.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from mtpjax import errors

ADDRESS_VARS = ("COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS")
COUNT_VAR = "NUM_PROCESSES"
ID_VAR = "PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
  coordinator_address: str
  num_processes: int
  process_id: int


def _int(value: Any, field: str) -> int:
  try:
    return int(value)
  except (TypeError, ValueError):
    raise errors.MeshConfigError(f"{field} must be an integer, got {value!r}", field=field,
                                 remedy="set it to a whole number") from None


def settings_from(config: Any = None,
                  env: Mapping[str, str] | None = None) -> DistributedSettings | None:
  """Settings from `config.distributed.*`, else the env vars; None means a single process."""
  env = os.environ if env is None else env
  section = getattr(config, "distributed", None) if config is not None else None
  address = getattr(section, "coordinator_address", None)
  count = getattr(section, "num_processes", None)
  pid = getattr(section, "process_id", None)
  source = "config.distributed"
  if address is None:
    address = next((env[v] for v in ADDRESS_VARS if env.get(v)), None)
    count, pid = env.get(COUNT_VAR), env.get(ID_VAR)
    source = "env"
  if address is None:
    return None
  fields = (f"{source}.num_processes", f"{source}.process_id") if source != "env" else (
      COUNT_VAR, ID_VAR)
  if count is None or pid is None:
    raise errors.MeshConfigError(
        f"a coordinator address is set ({address}) but {fields[0]} or {fields[1]} is not",
        field=fields[0] if count is None else fields[1],
        remedy="set the coordinator address, the process count and this process's id together")
  count, pid = _int(count, fields[0]), _int(pid, fields[1])
  if count < 1 or not 0 <= pid < count:
    raise errors.MeshConfigError(
        f"process_id {pid} is outside [0, {count})", field=fields[1],
        remedy="number the processes 0 .. num_processes - 1")
  return DistributedSettings(str(address), count, pid)


def initialize(config: Any = None, env: Mapping[str, str] | None = None) -> bool:
  """Join the multi-process job if one is configured; returns whether it did.

  Call it first thing: JAX's backend must not be initialised yet.
  """
  settings = settings_from(config, env)
  if settings is None:
    return False
  import jax  # only now: importing earlier is harmless, using a backend is not
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=settings.coordinator_address,
                             num_processes=settings.num_processes,
                             process_id=settings.process_id)
  return True
