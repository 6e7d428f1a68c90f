"""Times GET /health every `interval` seconds from a process of its own until stdin closes.

A probe inside a busy client process measures that process's own GIL waits as much as the
server; running it apart keeps the numbers the server's. Prints "probing" after the first
probe, then one JSON line when stdin closes: count, statuses, p50/p99/max seconds. Used by tools/load_test.py and the server tests:

  python -m tools.health_probe http://127.0.0.1:8000 < /dev/null
"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx


def main() -> None:
  url = sys.argv[1]
  interval = float(sys.argv[2]) if len(sys.argv) > 2 else 0.02
  stop = threading.Event()
  threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
  latencies, statuses = [], set()
  with httpx.Client(base_url=url, timeout=30) as http:
    while not stop.is_set():
      started = time.perf_counter()
      statuses.add(http.get("/health").status_code)
      latencies.append(time.perf_counter() - started)
      if len(latencies) == 1:
        print("probing", flush=True)       # the caller may start its load now
      stop.wait(interval)
  ordered = sorted(latencies) or [float("nan")]
  print(json.dumps({"count": len(latencies), "statuses": sorted(statuses),
                    "p50": ordered[len(ordered) // 2],
                    "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
                    "max": ordered[-1]}), flush=True)


if __name__ == "__main__":
  main()
