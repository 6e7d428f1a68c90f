"""Disk space for what mtpjax writes: checked before a large write, and a write that runs out of
it anyway becomes one typed error naming the path and the bytes it needed.

A full disk during `convert` surfaced as orbax's untyped `ValueError` (tensorstore's "Failed to
write ... No space left on device [os_error_code='28']") under a 460-line traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import re
import shutil
from typing import Iterator

from mtpjax import errors

# ENOSPC (disk full), EDQUOT (quota), EFBIG (the process's file size limit).
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_TENSORSTORE_CODE = re.compile(r"os_error_code='(\d+)'")


def _existing(path: pathlib.Path) -> pathlib.Path:
  """`path` or its nearest existing ancestor (where the free space is measured)."""
  path = path.absolute()
  while not path.exists() and path != path.parent:
    path = path.parent
  return path


def check_room(target: str | os.PathLike, needed: int, *, what: str) -> None:
  """Raises DiskSpaceError unless the disk holding `target` has `needed` bytes free."""
  free = shutil.disk_usage(_existing(pathlib.Path(target))).free
  if needed > free:
    raise errors.DiskSpaceError(
        f"{what} needs about {needed:,} bytes but the disk has {free:,} free", path=str(target),
        remedy="free disk space or write to another disk")


def ran_out(exc: BaseException) -> int | None:
  """The errno of a write that found no space in `exc` or an exception it chains, or None."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
      return exc.errno
    code = _TENSORSTORE_CODE.search(str(exc))
    if code is not None and int(code[1]) in _NO_SPACE:
      return int(code[1])
    exc = exc.__cause__ or exc.__context__
  return None


@contextlib.contextmanager
def typed_when_full(target: str | os.PathLike, needed: int | None, *, what: str
                    ) -> Iterator[None]:
  """Runs a write; one that runs out of space raises DiskSpaceError instead of the writer's
  own error (`needed`: the bytes the write takes, if known)."""
  try:
    yield
  except Exception as exc:
    code = ran_out(exc)
    if code is None:
      raise
    size = "" if needed is None else f", which needs about {needed:,} bytes"
    raise errors.DiskSpaceError(
        f"the disk ran out of space while writing {what}{size} ({os.strerror(code)})",
        path=str(target),
        remedy="free disk space, raise the file size limit (ulimit -f) or write to another "
        "disk") from None
