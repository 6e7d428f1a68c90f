"""Fuzz the package reader: mutated copies of a layer package must be refused with a typed error.

  python -m tools.fuzz_packages --cases=5000 [--package=mtpjax/assets/glm-demo] [--seed=0]

Each case (seed `seed + i`) edits a copy of the package (manifest values and bytes, GGUF header
fields and bytes, metadata values, tensor bytes, file sizes; mtpjax/testing/package_mutations.py),
then preflights and loads it in a forked child under an address-space limit and a deadline
(mtpjax/testing/package_fuzz.py). Prints one JSON line: the count per outcome and the first
failing cases; exits 1 on any untyped exception, hang, unbounded allocation, crash or silent
load of changed tensor bytes.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time

from absl import app, flags

import mtpjax
from mtpjax.testing import package_fuzz, package_mutations

_DEMO = pathlib.Path(mtpjax.__file__).resolve().parent / "assets" / "glm-demo"
_CASES = flags.DEFINE_integer("cases", 1000, "number of mutated packages to try")
_PACKAGE = flags.DEFINE_string("package", str(_DEMO), "the pristine layer package to mutate")
_SEED = flags.DEFINE_integer("seed", 0, "the first case's seed; case i uses seed + i")
_WORKERS = flags.DEFINE_integer("workers", os.cpu_count() or 1, "cases run at once")
_TIMEOUT = flags.DEFINE_float("timeout_s", 60.0,
                              "per-case deadline from the mutation made; then it is a hang")
_MEMORY_MB = flags.DEFINE_integer("memory_mb", 2048, "address space a case may add (RLIMIT_AS)")
_SHOWN = flags.DEFINE_integer("show", 20, "failing cases listed in the report")
_KINDS = flags.DEFINE_list("kinds", None, "mutation kinds to draw from (default: all of "
                           "package_mutations.MUTATORS)")


def main(argv):
  del argv
  unknown = set(_KINDS.value or ()) - set(package_mutations.MUTATORS)
  if unknown:
    raise app.UsageError(f"--kinds: unknown {sorted(unknown)}; choose from "
                         f"{sorted(package_mutations.MUTATORS)}")
  os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # children are forked
  logging.getLogger("gguf").setLevel(logging.WARNING)          # the writer logs every rewrite
  start = time.monotonic()
  results = package_fuzz.run_cases(_PACKAGE.value, range(_SEED.value, _SEED.value + _CASES.value),
                                   workers=_WORKERS.value, timeout_s=_TIMEOUT.value,
                                   memory_bytes=_MEMORY_MB.value << 20,
                                   kinds=tuple(_KINDS.value) if _KINDS.value else None)
  counts = package_fuzz.counts(results)
  failing = [result for result in results if result.outcome in package_fuzz.FAILURES]
  print(json.dumps({
      "package": _PACKAGE.value, "cases": len(results), "first_seed": _SEED.value,
      "seconds": round(time.monotonic() - start, 1), "counts": counts,
      "failures": [{"seed": result.seed, "outcome": result.outcome,
                    "mutation": result.mutation, "detail": result.detail[-400:]}
                   for result in failing[:_SHOWN.value]]}))
  return 1 if failing else 0


if __name__ == "__main__":
  app.run(main)
