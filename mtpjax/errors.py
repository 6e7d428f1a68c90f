"""Typed errors for mtpjax.

Every error names the file, the field and a remedy, so a user can act on the message alone.
Upstream message phrases (mesh-llm, llama.cpp) are kept as substrings so that a search for an
upstream message finds ours too.
"""

from __future__ import annotations


class MtpjaxError(Exception):
  """Base class: carries where the problem is and what to do about it."""

  def __init__(self, message: str, *, path: str | None = None, field: str | None = None,
               remedy: str | None = None):
    self.message = message
    self.path = None if path is None else str(path)
    self.field = field
    self.remedy = remedy
    super().__init__(self._render())

  def _render(self) -> str:
    parts = [self.message]
    if self.path:
      parts.append(f"file: {self.path}")
    if self.field:
      parts.append(f"field: {self.field}")
    if self.remedy:
      parts.append(f"remedy: {self.remedy}")
    return "; ".join(parts)


class PackageError(MtpjaxError):
  """A layer package or GGUF source cannot be used as it is."""


class ManifestError(PackageError):
  """`model-package.json` breaks a rule of the v1 schema.

  `issues` holds every problem found (preflight issue dicts), not just the first.
  """

  def __init__(self, message: str, *, issues: list[dict] | tuple = (), **kwargs):
    self.issues = list(issues)
    super().__init__(message, **kwargs)


class IntegrityError(PackageError):
  """An artifact's size or SHA-256 does not match the manifest."""


class AbiError(PackageError):
  """The package was written for an incompatible layer-package ABI."""


class PlanningError(PackageError):
  """A stage split is impossible for this package or mesh."""


class SpeculativeConfigError(MtpjaxError):
  """The speculative strategy is malformed or cannot be honoured by this model."""


class ConversionError(MtpjaxError):
  """A GGUF tensor or key cannot be turned into model parameters."""


class UnsupportedArchitectureError(ConversionError):
  """`general.architecture` names a model family mtpjax does not implement."""


class UnsupportedTensorTypeError(ConversionError):
  """A tensor uses a ggml type that cannot be dequantized here."""


class DiskSpaceError(MtpjaxError):
  """A write needs more disk space (or a larger file size limit) than there is."""


class CheckpointError(MtpjaxError):
  """An orbax checkpoint is missing, incomplete or from another source."""


class MeshConfigError(MtpjaxError):
  """The device mesh or stage split in the config cannot be built."""


class ContextLengthError(MtpjaxError):
  """A request does not fit the engine's context length (`engine.max_len`); the server answers
  it 400 with code `context_length_exceeded`."""


class KvPagesError(MtpjaxError):
  """The KV page pool (`engine.kv_pages`) is too small for a request, or for the engine."""


class MemoryBudgetError(MtpjaxError):
  """The engine's caches would not fit the memory of the devices that hold them."""
