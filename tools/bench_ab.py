"""A/B a benchmark across two checkouts: alternating processes, one JSON line of ratios.

Runs `python -m tools.bench_decode ARGS` in the baseline checkout and in this one, alternately
(baseline first in even rounds, candidate first in odd ones), `--rounds` times each, so drift of
a noisy machine hits both alike; each process prints one JSON line per slot count. Reports, per slot count, the
median MTP-off and MTP-on tokens/s of each side, their ratios (candidate / baseline) and whether
both sides generated the same tokens (`outputs_sha256`).

  git worktree add /tmp/base <previous-main-commit>
  python -m tools.bench_ab --baseline=/tmp/base -- --source=mtpjax/assets/glm-demo \\
      --prompts_from=held_out --slots=1,8
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys

from absl import app, flags

_BASELINE = flags.DEFINE_string("baseline", None, "checkout to compare against", required=True)
_ROUNDS = flags.DEFINE_integer("rounds", 2, "processes per side")
_BENCH = flags.DEFINE_string("bench", "tools.bench_decode", "benchmark module to run")

CANDIDATE = pathlib.Path(__file__).resolve().parent.parent
RATES = ("tokens_per_s_off", "tokens_per_s_on")


def _run(tree: pathlib.Path, args: list[str]) -> list[dict]:
  env = dict(os.environ, PYTHONPATH=str(tree))
  done = subprocess.run([sys.executable, "-m", _BENCH.value, *args], cwd=tree, env=env,
                        capture_output=True, text=True, check=False)
  if done.returncode:
    raise RuntimeError(f"{_BENCH.value} failed in {tree}:\n{done.stderr[-4000:]}")
  return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main(argv):
  args = argv[1:]
  sides = {"baseline": pathlib.Path(_BASELINE.value).resolve(), "candidate": CANDIDATE}
  lines: dict[str, list[dict]] = {side: [] for side in sides}
  for round_ in range(_ROUNDS.value):
    # Each side goes first every other round, so a machine that drifts within a pair of runs
    # favours neither.
    order = list(sides.items()) if round_ % 2 == 0 else list(sides.items())[::-1]
    for side, tree in order:
      lines[side] += _run(tree, args)
  report = {"args": args, "rounds": _ROUNDS.value, "baseline": str(sides["baseline"])}
  for slots in sorted({line["slots"] for line in lines["candidate"]}):
    row = {}
    for side in sides:
      mine = [line for line in lines[side] if line["slots"] == slots]
      for rate in RATES:
        row[f"{side}_{rate}"] = statistics.median(line[rate] for line in mine)
      row[f"{side}_outputs"] = sorted({line.get("outputs_sha256", "") for line in mine})
    for rate in RATES:
      row[f"ratio_{rate}"] = row[f"candidate_{rate}"] / row[f"baseline_{rate}"]
    row["outputs_identical"] = (row["candidate_outputs"] == row["baseline_outputs"]
                                and len(row["candidate_outputs"]) == 1)
    report[f"slots_{slots}"] = row
  print(json.dumps(report))


if __name__ == "__main__":
  app.run(main)
