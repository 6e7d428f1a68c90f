"""What an engine's caches need against what their devices have, checked before allocating.

Allocating a KV pool larger than memory fails inside XLA with an allocator traceback, or on a
CPU host gets the process killed; `check_fits` turns it into a typed error that names the
setting, what it needs and what is there. CPU devices (simulated ones included) share the host's
memory, so their needs add up against it; an accelerator's count against its own.
"""

from __future__ import annotations

import os
from typing import Iterable

import numpy as np

from mtpjax import errors


def array_bytes(shapes: Iterable[tuple[int, ...]], dtype) -> int:
  """Bytes of arrays of these shapes and `dtype`."""
  return sum(int(np.prod(shape, dtype=np.int64)) for shape in shapes) * np.dtype(dtype).itemsize


def host_available_bytes() -> int | None:
  """Memory the host can still give (Linux's MemAvailable; free pages elsewhere)."""
  try:
    with open("/proc/meminfo") as info:
      for line in info:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


def device_available_bytes(device) -> int | None:
  """Free memory of an accelerator from its allocator's statistics (None where unknown)."""
  try:
    stats = device.memory_stats() or {}
  except Exception:   # backends without statistics raise various errors
    return None
  if "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def _gib(n: int) -> str:
  return f"{n / 2**30:.2f} GiB"


def check_fits(needs: Iterable[tuple[object, int]], *, setting: str) -> None:
  """Refuse (`errors.MemoryBudgetError`) when the (devices, bytes) `needs` exceed the memory
  there: bytes spread evenly over each entry's devices. `setting` names what sized them."""
  host, per_device = 0, {}
  for devices, n_bytes in needs:
    devices = list(devices)
    for device in devices:
      if device.platform == "cpu":
        host += n_bytes // len(devices)
      else:
        per_device[device] = per_device.get(device, 0) + n_bytes // len(devices)
  places = [("the host (CPU devices)", host, host_available_bytes())] if host else []
  places += [(str(d), n, device_available_bytes(d)) for d, n in per_device.items()]
  for where, need, have in places:
    if have is not None and need > have:
      raise errors.MemoryBudgetError(
          f"{setting} needs {_gib(need)} of KV cache on {where}, which has {_gib(have)} free",
          field="engine.max_len",
          remedy="lower engine.max_len or engine.slots, cap the pool with engine.kv_pages, or "
                 "store the cache in fewer bytes (engine.kv_cache_dtype=float16)")
