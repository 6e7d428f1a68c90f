"""Perfetto traces as JAX writes them (`jax.profiler.start_trace(create_perfetto_trace=True)`):
reading one, and the busy time of each trace line. A library of `tools/trace_decode.py`, kept
free of flags so tests can import it."""

from __future__ import annotations

import collections
import gzip
import json
import re


def read_events(path: str) -> list[dict]:
  """The events of a `perfetto_trace.json.gz`."""
  with gzip.open(path) as f:
    trace = json.load(f)
  return trace["traceEvents"] if isinstance(trace, dict) else trace


def _lines(events: list[dict]) -> tuple[dict, dict]:
  """(process names by pid, thread names by (pid, tid)) from the trace's metadata events."""
  process = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
  thread = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}
  return process, thread


def _line(e: dict, process: dict, thread: dict) -> str:
  return f"{process.get(e['pid'], e['pid'])} | {thread.get((e['pid'], e.get('tid')), e.get('tid'))}"


def busy_per_line(events: list[dict], steps: int, top: int) -> dict[str, dict]:
  """Per trace line ('process | thread'): the summed duration of its complete ('X') events per
  step in microseconds, and its `top` largest event names by that sum, largest line first.
  Nested events (a host function and its callees) are each counted, so a host line can exceed
  the wall time; a device stream's kernels do not nest."""
  process, thread = _lines(events)
  sums: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  for e in events:
    if e.get("ph") == "X":
      sums[_line(e, process, thread)][e["name"]] += e.get("dur", 0.0)
  lines = {line: {"us_per_step": sum(c.values()) / steps,
                  "top": [[name, total / steps] for name, total in c.most_common(top)]}
           for line, c in sums.items()}
  return dict(sorted(lines.items(), key=lambda item: -item[1]["us_per_step"]))


# Events an XLA:CPU executor line wraps its operations in (they nest the operations' events).
_WRAPPERS = ("ThunkExecutor::", "ThreadpoolListener::")
_INSTANCE = re.compile(r"\.\d+$")   # an HLO name's instance number: `ffi_call.77`


def kinds_per_line(events: list[dict], steps: int, prefix: str = "tf_XLA"
                   ) -> dict[str, dict[str, list[float]]]:
  """Per XLA:CPU executor line (threads named `prefix`...): each kind of operation (its HLO
  name without the instance number: `ffi_call` for the native kernel, `ynn_fusion` /
  `xnn_fusion` for XNNPACK's, `copy_bitcast_fusion`, `while`, ...) as [us per step, events
  per step], largest first. Times are self times: a loop's event less the operations of its
  body, which count under their own kinds, so a line's kinds sum to its busy time. The
  executor's wrapping events and the `end: ` marks of asynchronous operations are left out."""
  process, thread = _lines(events)
  per_line: dict[str, list[dict]] = collections.defaultdict(list)
  for e in events:
    name = e.get("name", "")
    if (e.get("ph") == "X" and not name.startswith(("end: ",) + _WRAPPERS)
        and thread.get((e["pid"], e.get("tid")), "").startswith(prefix)):
      per_line[_line(e, process, thread)].append(e)
  sums: dict[str, collections.Counter] = {}
  counts: dict[str, collections.Counter] = {}
  for line, line_events in per_line.items():
    sums[line], counts[line] = collections.Counter(), collections.Counter()
    open_events: list[tuple[float, str]] = []    # (end, kind) of the events enclosing this one
    for e in sorted(line_events, key=lambda e: (e["ts"], -e.get("dur", 0.0))):
      start, dur = e["ts"], e.get("dur", 0.0)
      while open_events and open_events[-1][0] <= start:
        open_events.pop()
      kind = _INSTANCE.sub("", e["name"])
      if open_events:
        sums[line][open_events[-1][1]] -= dur     # the parent's time, less this child's
      sums[line][kind] += dur
      counts[line][kind] += 1
      open_events.append((start + dur, kind))
  return {line: {kind: [total / steps, counts[line][kind] / steps]
                 for kind, total in sums[line].most_common()}
          for line in sorted(sums, key=lambda line: -sum(sums[line].values()))}
