"""Safe artifact paths and size/SHA-256 checks of package parts (docs/LAYER_PACKAGES.md §2.4-§2.5).

The lexical path rules follow upstream; the symlink check is ours: a package must never make us
read a file outside its own directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import re
import stat

from mtpjax import errors
from mtpjax.package import gguf_header, issues as issues_lib

SHA256_CHUNK_BYTES = 1 << 20
_HEX_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_DRIVE_PREFIX = re.compile(r"[A-Za-z]:")


def is_hex_sha256(value: object) -> bool:
  """True for 64 hex digits in either case (compared lowercase elsewhere)."""
  return isinstance(value, str) and _HEX_SHA256.fullmatch(value) is not None


def sha256_file(path: pathlib.Path | str) -> str:
  """Lowercase hex SHA-256 of a file, read in 1 MiB chunks so memory stays flat."""
  digest = hashlib.sha256()
  with open(path, "rb") as handle:
    while chunk := handle.read(SHA256_CHUNK_BYTES):
      digest.update(chunk)
  return digest.hexdigest()


def unsafe_path_reason(path: object) -> str | None:
  """Why `path` breaks the lexical safe-relative-path rules (1-3 of §2.4), or None if it is safe."""
  if not isinstance(path, str) or not path:
    return "it is empty"
  if "\x00" in path:
    return "it contains a NUL byte"
  if "\\" in path:
    return "it contains a backslash"
  if path.startswith("/"):
    return "it is absolute (or a UNC path)"
  if _DRIVE_PREFIX.match(path):
    return "it has a drive prefix"
  for component in path.split("/"):
    if component in ("", ".", ".."):
      return f"it has an empty, '.' or '..' component ({component!r})"
  return None


def escape_reason(root: pathlib.Path, path: str) -> str | None:
  """Why `root/path`, symlinks resolved, is not inside the resolved root (rule 4), or None."""
  try:
    resolved_root = root.resolve()
    target = (root / path).resolve()
  except (OSError, RuntimeError) as error:  # symlink loops
    return f"it cannot be resolved ({error})"
  if not target.is_relative_to(resolved_root):
    return f"it resolves to {target}, outside the package {resolved_root}"
  return None


def unsafe_path_message(role: str, path: object, reason: str) -> str:
  """The message for an unsafe artifact path; it keeps both upstream phrases as substrings."""
  if not isinstance(path, str) or not path:
    return f"package {role} artifact path must not be empty"
  return (f"package {role} artifact path must be a safe relative path: manifest file path must be "
          f"a safe relative path: {path!r} ({reason})")


def resolve_part(root: pathlib.Path, path: str, role: str) -> pathlib.Path:
  """The file of an artifact, after every §2.4 rule; raises ManifestError when a rule fails.

  Called each time a part is opened, so a symlink planted after the manifest was validated is
  still caught.
  """
  reason = unsafe_path_reason(path) or escape_reason(root, path)
  if reason is not None:
    record = issues_lib.issue("unsafe_artifact_path", unsafe_path_message(role, path, reason),
                              path=str(path))
    raise errors.ManifestError(record["message"], issues=[record], path=str(root), field=role,
                               remedy=record["remediation"])
  return root / path


class ManifestUnreadable(Exception):
  """The manifest cannot be read safely; `record` is the issue that says why."""

  def __init__(self, record: dict):
    super().__init__(record["message"])
    self.record = record


def read_manifest_bytes(root: pathlib.Path, name: str) -> bytes:
  """`root/name`'s bytes, read only when it is a regular file inside the package: a FIFO would
  block the read forever, a device never end, and a symlink out of the package would make us
  read a file the package does not hold. Opened without blocking, then checked by `fstat`, so
  a file swapped after a check is caught too. Raises `ManifestUnreadable`."""
  path = root / name
  reason = escape_reason(root, name)
  if reason is not None:
    raise ManifestUnreadable(issues_lib.issue(
        "unsafe_manifest_path", f"package manifest {path} is not read: {reason}", path=name))
  try:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
  except OSError as error:
    raise ManifestUnreadable(issues_lib.issue(
        "missing_manifest", f"package manifest {path} cannot be read: {error.strerror or error}",
        path=name)) from error
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    raise ManifestUnreadable(issues_lib.issue(
        "manifest_not_file", f"package manifest {path} is not a regular file", path=name))
  with os.fdopen(fd, "rb") as handle:
    return handle.read()


@dataclasses.dataclass(frozen=True)
class PartCheck:
  """What was found on disk for one artifact; `issue` is None when it passed."""
  path: pathlib.Path
  present: bool
  actual_bytes: int | None = None
  size_matches: bool | None = None
  sha256_matches: bool | None = None
  issue: dict | None = None


def inspect_part(root: pathlib.Path, path: str, *, role: str, artifact_bytes: int | None,
                 sha256: str | None, check_sha: bool) -> PartCheck:
  """Checks one (already path-validated) artifact: a regular file, of the declared size, and
  with the declared SHA-256 when `check_sha`. A size mismatch is reported without hashing.

  A declared size or hash that is itself malformed (None / not hex) is not compared: manifest
  validation reports it already.
  """
  file_path = root / path
  try:
    status = file_path.stat()
  except (FileNotFoundError, NotADirectoryError):
    return PartCheck(file_path, present=False, issue=issues_lib.issue(
        "missing_artifact", f"package {role} artifact is missing: {file_path}", path=path))
  except OSError as error:      # a name too long, a symlink loop, no permission ...
    return PartCheck(file_path, present=False, issue=issues_lib.issue(
        "missing_artifact", f"package {role} artifact cannot be opened: {file_path}: "
        f"{error.strerror or error}", path=path))
  if not stat.S_ISREG(status.st_mode):
    return PartCheck(file_path, present=False, issue=issues_lib.issue(
        "artifact_not_file", f"package part is not a file: {file_path}", path=path))
  actual = status.st_size
  if artifact_bytes is not None and actual != artifact_bytes:
    return PartCheck(file_path, present=True, actual_bytes=actual, size_matches=False,
                     issue=issues_lib.issue(
                         "artifact_size_mismatch",
                         f"package part size mismatch for {file_path}: expected {artifact_bytes}, "
                         f"got {actual}", path=path))
  size_matches = None if artifact_bytes is None else True
  if not check_sha or not is_hex_sha256(sha256):
    return PartCheck(file_path, present=True, actual_bytes=actual, size_matches=size_matches)
  excess = _trailing_bytes(file_path)
  if excess > 0:
    return PartCheck(file_path, present=True, actual_bytes=actual, size_matches=size_matches,
                     issue=issues_lib.issue(
                         "artifact_trailing_bytes",
                         f"package artifact {file_path} has {excess} bytes past its last "
                         "tensor's data", path=path))
  try:
    digest = sha256_file(file_path)
  except OSError as error:
    return PartCheck(file_path, present=True, actual_bytes=actual, size_matches=size_matches,
                     sha256_matches=False, issue=issues_lib.issue(
                         "artifact_sha256_unreadable",
                         f"package artifact {file_path} cannot be hashed: {error}", path=path))
  expected = sha256.lower()
  if digest != expected:
    return PartCheck(file_path, present=True, actual_bytes=actual, size_matches=size_matches,
                     sha256_matches=False, issue=issues_lib.issue(
                         "artifact_sha256_mismatch",
                         f"package artifact checksum mismatch for {file_path}: expected "
                         f"{expected}, got {digest}", path=path))
  return PartCheck(file_path, present=True, actual_bytes=actual, size_matches=size_matches,
                   sha256_matches=True)


def _trailing_bytes(file_path: pathlib.Path) -> int:
  """Bytes past the data a GGUF's header describes, found before hashing: 8 GiB of sparse
  zeros appended to a layer cost 35 s of hashing before a checksum mismatch. A header that does
  not walk (a corrupt file, a payload-free carrier) counts 0 here: the hash names the first."""
  try:
    return gguf_header.trailing_bytes(gguf_header.check_header(file_path))
  except errors.PackageError:
    return 0


def verify_part(root: pathlib.Path, path: str, *, role: str, artifact_bytes: int, sha256: str,
                check_sha: bool) -> pathlib.Path:
  """`resolve_part` + `inspect_part`, raising: the reader's check each time it opens a part."""
  resolve_part(root, path, role)
  check = inspect_part(root, path, role=role, artifact_bytes=artifact_bytes, sha256=sha256,
                       check_sha=check_sha)
  if check.issue is not None:
    error_type = errors.PackageError if not check.present else errors.IntegrityError
    raise error_type(check.issue["message"], path=str(check.path), field=role,
                     remedy=check.issue["remediation"])
  return check.path
