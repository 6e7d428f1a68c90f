"""Fuzz harness: mutate a copy of a package, then preflight and load it in a bounded child.

Each case runs in a forked child under RLIMIT_AS and a wall-clock deadline, so a hang or an
unbounded allocation is an outcome, not a stuck run. The child runs what a load runs without
touching JAX: preflight (with --stages and SHA-256), `open_source`, `config_from_gguf`, the
tokenizer and chat template, and the tensors of the part that was edited (all of them after a
manifest edit). The tensor bytes it read are compared with the pristine package's, read
independently through gguf-py, so a corrupt package that loads is caught.

Outcomes: "refused" (a typed MtpjaxError), "loaded" (unchanged tensors), "loaded_rewrite"
(changed tensors, but the edit re-recorded the file's hash: a self-consistent package),
and the failures "silent_change", "untyped", "hang", "memory", "crash"; "harness_error" when
the mutation itself could not be made.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import resource
import shutil
import tempfile
import time
import traceback
from typing import Any

import gguf
import numpy as np

from mtpjax import errors
from mtpjax.gguf.tokenizer import ChatTemplate, GgufTokenizer
from mtpjax.models.config import config_from_gguf
from mtpjax.package import carrier, preflight, reader
from mtpjax.testing import package_mutations

FAILURES = ("silent_change", "untyped", "hang", "memory", "crash")
# A case's copy and mutation past this is a stalled harness ("harness_error"), not a hang.
HARNESS_DEADLINE_S = 600.0
OUTCOMES = ("refused", "loaded", "loaded_rewrite", *FAILURES, "harness_error")


@dataclasses.dataclass(frozen=True)
class CaseResult:
  seed: int
  outcome: str
  mutation: str
  detail: str = ""


def tensor_digests(paths) -> dict[str, tuple[int, tuple[int, ...], str]]:
  """name -> (ggml type, ne, SHA-256 of the bytes) straight from gguf-py."""
  found = {}
  for path in paths:
    for tensor in gguf.GGUFReader(path).tensors:
      found[tensor.name] = (int(tensor.tensor_type), tuple(int(d) for d in tensor.shape),
                            _digest(tensor.data))
  return found


def package_digests(root: pathlib.Path) -> dict[str, tuple[int, tuple[int, ...], str]]:
  manifest = package_mutations.read_manifest(root)
  return tensor_digests(root / path for path in package_mutations.artifact_paths(manifest))


def _digest(data: Any) -> str:
  return hashlib.sha256(np.ascontiguousarray(data).view(np.uint8)).hexdigest()


def _stage_of(manifest: dict, target: str | None) -> tuple[int, int, bool, bool] | None:
  """(layer_start, layer_end, embeddings, output) that reads `target`; None: everything."""
  if target is None:
    return None
  if package_mutations.is_v2(manifest):
    return _v2_stage_of(manifest, target)
  shared = manifest["shared"]
  if target == shared["embeddings"]["path"]:
    return 0, 1, True, False
  if target == shared["output"]["path"]:
    return manifest["layer_count"] - 1, manifest["layer_count"], False, True
  for entry in manifest["layers"]:
    if entry["path"] == target:
      return entry["layer_index"], entry["layer_index"] + 1, False, False
  return 0, 1, False, False


def _v2_stage_of(manifest: dict, target: str) -> tuple[int, int, bool, bool]:
  ordinal = carrier.layer_ordinal(target)
  if ordinal is not None:
    return ordinal, ordinal + 1, False, False
  ids = {entry["path"]: entry["id"] for entry in manifest["artifact_catalog"]["entries"]}
  if ids.get(target) == "output":
    return manifest["layer_count"] - 1, manifest["layer_count"], False, True
  return 0, 1, ids.get(target) == "embeddings", False


def exercise(root: pathlib.Path, stage: tuple[int, int, bool, bool] | None,
             tensor_names: list[str]) -> dict[str, tuple]:
  """Preflight and load what a server would: config, tokenizer, template and the stage's
  tensors (all when `stage` is None). Returns the digests of the tensors read."""
  preflight.preflight(root, stages=2, check_sha=True)
  with reader.open_source(root) as source:
    names = list(source.tensors) if stage is None else tensor_names
    config_from_gguf(source.metadata, names, source=str(root))
    GgufTokenizer.from_metadata(source.metadata, path=str(root))
    ChatTemplate.from_metadata(source.metadata, path=str(root))
    start, end, embeddings, output = stage or (0, source.layer_count, True, True)
    return {info.name: (int(info.ggml_type), tuple(info.ne), _digest(data))
            for info, data in source.iter_stage_tensors(start, end, embeddings=embeddings,
                                                        output=output)}


def _address_space_bytes() -> int:
  with open("/proc/self/status") as status:
    for line in status:
      if line.startswith("VmSize:"):
        return int(line.split()[1]) * 1024
  return 0


def _child(conn, source: pathlib.Path, work: pathlib.Path, seed: int, memory_bytes: int,
           tensor_names: list[str], kinds: tuple[str, ...] | None) -> None:
  try:
    shutil.copytree(source, work, dirs_exist_ok=True)
    manifest = package_mutations.read_manifest(work)
    mutation = package_mutations.mutate(seed, work, kinds)
  except Exception as error:  # the harness failed, not the code under test
    conn.send(("harness_error", "", repr(error)))
    return
  conn.send(("mutation", dataclasses.asdict(mutation), ""))
  limit = _address_space_bytes() + memory_bytes     # bounds the code under test, not the edit
  resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  try:
    digests = exercise(work, _stage_of(manifest, mutation.target), tensor_names)
  except MemoryError as error:
    conn.send(("memory", "", repr(error)))
  except errors.MtpjaxError as error:
    # A typed error raised while handling an allocation failure (a MemoryError, or an mmap
    # refused with ENOMEM under the limit) is still that failure.
    cause = error.__cause__ or error.__context__
    memory = isinstance(cause, MemoryError) or (isinstance(cause, OSError)
                                                and cause.errno == errno.ENOMEM)
    conn.send(("memory" if memory else "refused", "", f"{type(error).__name__}: {error}"[:300]))
  except BaseException as error:  # anything else is what the fuzzer hunts
    conn.send(("untyped", "", "".join(traceback.format_exception(error))[-1500:]))
  else:
    conn.send(("ok", digests, ""))


class _Running:
  def __init__(self, context, source, base, seed, memory_bytes, tensor_names, timeout_s,
               kinds=None):
    self.seed = seed
    self.work = base / f"case-{seed}"
    self.conn, child_conn = context.Pipe(duplex=False)
    self.process = context.Process(target=_child, args=(child_conn, source, self.work, seed,
                                                        memory_bytes, tensor_names, kinds))
    self.process.start()
    child_conn.close()
    # The case's deadline runs from the mutation made: copying and editing the package is the
    # harness's own work (~20 s a case on a loaded machine), never the code under test's hang.
    self.timeout_s = timeout_s
    self.deadline = time.monotonic() + HARNESS_DEADLINE_S
    self.mutation: dict | None = None
    self.result: tuple | None = None

  def drain(self) -> None:
    try:
      while self.conn.poll():
        message = self.conn.recv()
        if message[0] == "mutation":
          self.mutation = message[1]
          self.deadline = time.monotonic() + self.timeout_s
        else:
          self.result = message
    except (EOFError, OSError):
      pass


def _classify(running: _Running, reference: dict, timed_out: bool) -> CaseResult:
  mutation = running.mutation or {}
  label = f"{mutation.get('kind', '?')}: {mutation.get('detail', '')}"
  if timed_out and running.mutation is None:
    return CaseResult(running.seed, "harness_error", label,
                      f"copying and mutating the package took over {HARNESS_DEADLINE_S} s")
  if timed_out:
    return CaseResult(running.seed, "hang", label)
  if running.result is None:
    return CaseResult(running.seed, "crash", label, f"exit code {running.process.exitcode}")
  status, payload, detail = running.result
  if status != "ok":
    return CaseResult(running.seed, status, label, detail)
  if mutation.get("must_refuse"):
    return CaseResult(running.seed, "silent_change", label, "loaded what must be refused")
  changed = sorted(name for name, value in payload.items() if reference.get(name) != value)
  if not changed:
    return CaseResult(running.seed, "loaded", label)
  outcome = "loaded_rewrite" if mutation.get("rehashed") else "silent_change"
  return CaseResult(running.seed, outcome, label, f"changed tensors: {changed[:5]}")


def run_cases(source: str | os.PathLike, seeds, *, workers: int = 2, timeout_s: float = 30.0,
              memory_bytes: int = 2 << 30, kinds: tuple[str, ...] | None = None
              ) -> list[CaseResult]:
  """Every seed's case, `workers` children at a time (mutations of `kinds`, default all);
  results in seed order."""
  source = pathlib.Path(source)
  reference = package_digests(source)
  package_mutations.warm_parse_cache(source)
  tensor_names = sorted(reference)
  context = multiprocessing.get_context("fork")
  pending = list(seeds)[::-1]
  active: list[_Running] = []
  results = []
  with tempfile.TemporaryDirectory(prefix="mtpjax-fuzz-") as base:
    while pending or active:
      while pending and len(active) < workers:
        active.append(_Running(context, source, pathlib.Path(base), pending.pop(), memory_bytes,
                               tensor_names, timeout_s, kinds))
      multiprocessing.connection.wait([item.process.sentinel for item in active], timeout=0.05)
      for item in list(active):
        item.drain()
        timed_out = item.process.is_alive() and time.monotonic() > item.deadline
        if item.process.is_alive() and not timed_out:
          continue
        if timed_out:
          item.process.kill()
        item.process.join()
        item.drain()
        item.conn.close()
        results.append(_classify(item, reference, timed_out))
        shutil.rmtree(item.work, ignore_errors=True)
        active.remove(item)
  return sorted(results, key=lambda result: result.seed)


def counts(results: list[CaseResult]) -> dict[str, int]:
  found = {outcome: 0 for outcome in OUTCOMES}
  for result in results:
    found[result.outcome] += 1
  return found
