"""Atomic directory output: build in a sibling staging folder, swap it in, clean up after the dead.

A writer builds `.NAME.tmp-PID@HOST.XXXX` next to the target and swaps it in with
`replace_dir`: an existing target is first renamed aside to `.NAME.old-PID@HOST.XXXX` and
removed only after the new one is in place, so a kill at any moment leaves either the old or
the new directory (the old one possibly aside, where `remove_stale` puts it back if that
writer's staging folder is still there, i.e. the new one never landed; once it has landed, a
target the user deletes stays deleted).

`remove_stale` removes such folders of writers that are gone. A folder is stale when its name
says it was made on this host by a process that no longer exists, or, whatever its name, when
it has not been modified for STALE_AFTER_S (a writer on another host, or a name without a
process id, cannot be checked otherwise). A live writer's folder on this host is never touched
before that age, so concurrent writers to the same target stay safe.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import socket
import tempfile
import time

STALE_AFTER_S = 24 * 3600
_KINDS = ("tmp", "old")


def _owner() -> str:
  return f"{os.getpid()}@{socket.gethostname()}"


def _prefix(target: pathlib.Path, kind: str) -> str:
  return f".{target.name}.{kind}-"


def make_staging_dir(target: str | os.PathLike) -> pathlib.Path:
  """A new empty sibling folder of `target` whose name records this process."""
  target = pathlib.Path(target)
  target.parent.mkdir(parents=True, exist_ok=True)
  return pathlib.Path(tempfile.mkdtemp(prefix=f"{_prefix(target, 'tmp')}{_owner()}.",
                                       dir=target.parent))


def replace_dir(staging: pathlib.Path, target: str | os.PathLike) -> None:
  """Moves `staging` to `target`; an existing target is renamed aside first and removed last."""
  target = pathlib.Path(target)
  aside = None
  if target.exists():
    aside = pathlib.Path(tempfile.mkdtemp(prefix=f"{_prefix(target, 'old')}{_owner()}.",
                                          dir=target.parent))
    os.replace(target, aside)      # an empty directory is replaced atomically
  try:
    os.replace(staging, target)
  except BaseException:
    if aside is not None:
      os.replace(aside, target)
    raise
  if aside is not None:
    shutil.rmtree(aside, ignore_errors=True)


def _process_gone(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  except PermissionError:          # alive, another user's
    return False
  return False


def _is_stale(folder: pathlib.Path, owner: str | None, now: float) -> bool:
  try:
    age = now - folder.stat().st_mtime
  except OSError:
    return False
  if age > STALE_AFTER_S:
    return True
  match = re.fullmatch(r"(\d+)@(.*)", owner or "")
  return (match is not None and match[2] == socket.gethostname()
          and int(match[1]) != os.getpid() and _process_gone(int(match[1])))


def remove_stale(target: str | os.PathLike) -> list[pathlib.Path]:
  """Removes the staging folders of dead writers to `target`, and puts back an old target a
  dead writer had renamed aside when no target is there and that writer's new one never
  landed. Returns what it removed or restored."""
  target = pathlib.Path(target)
  if not target.parent.is_dir():
    return []
  now = time.time()
  ours = [(folder, kind, folder.name[len(_prefix(target, kind)):].rpartition(".")[0] or None)
          for folder in sorted(target.parent.iterdir()) for kind in _KINDS
          if folder.name.startswith(_prefix(target, kind)) and folder.is_dir()]
  # A writer killed mid-swap still has its staging folder: its new target never landed.
  unswapped = {owner for _, kind, owner in ours if kind == "tmp" and owner is not None}
  done = []
  for folder, kind, owner in ours:
    if not _is_stale(folder, owner, now):
      continue
    if kind == "old" and owner in unswapped and not target.exists():
      os.replace(folder, target)
    else:
      shutil.rmtree(folder, ignore_errors=True)
    done.append(folder)
  return done
