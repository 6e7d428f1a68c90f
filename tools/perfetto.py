"""Perfetto traces as JAX writes them (`jax.profiler.start_trace(create_perfetto_trace=True)`):
reading one, and the busy time of each trace line. A library of `tools/trace_decode.py`, kept
free of flags so tests can import it."""

from __future__ import annotations

import collections
import gzip
import json


def read_events(path: str) -> list[dict]:
  """The events of a `perfetto_trace.json.gz`."""
  with gzip.open(path) as f:
    trace = json.load(f)
  return trace["traceEvents"] if isinstance(trace, dict) else trace


def busy_per_line(events: list[dict], steps: int, top: int) -> dict[str, dict]:
  """Per trace line ('process | thread'): the summed duration of its complete ('X') events per
  step in microseconds, and its `top` largest event names by that sum, largest line first.
  Nested events (a host function and its callees) are each counted, so a host line can exceed
  the wall time; a device stream's kernels do not nest."""
  process = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
  thread = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}
  sums: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  for e in events:
    if e.get("ph") == "X":
      line = f"{process.get(e['pid'], e['pid'])} | {thread.get((e['pid'], e.get('tid')), e.get('tid'))}"
      sums[line][e["name"]] += e.get("dur", 0.0)
  lines = {line: {"us_per_step": sum(c.values()) / steps,
                  "top": [[name, total / steps] for name, total in c.most_common(top)]}
           for line, c in sums.items()}
  return dict(sorted(lines.items(), key=lambda item: -item[1]["us_per_step"]))
