"""The server's reliability limits (`config.server.*`), checked once at startup.

One hostile or unlucky request must not hurt the others: bodies, queue length, time per
request, chat-template work and shutdown are all bounded by these values.
"""

from __future__ import annotations

import dataclasses
import math
import os

from mtpjax import errors
from mtpjax.gguf.template_budget import TemplateBudget

API_KEY_ENV = "MTPJAX_API_KEY"


@dataclasses.dataclass(frozen=True)
class ServerLimits:
  """Defaults are the config's; 0 for `request_timeout_s` means no deadline, 0 for
  `max_connections` what the process's file limit allows (`connections.py`)."""
  max_body_bytes: int = 4 * 2**20
  max_queue: int = 256
  request_timeout_s: float = 600.0
  shutdown_timeout_s: float = 10.0
  template_timeout_s: float = TemplateBudget.seconds
  template_max_chars: int = TemplateBudget.max_chars
  header_timeout_s: float = 10.0
  body_timeout_s: float = 60.0
  idle_timeout_s: float = 5.0
  max_connections: int = 0
  api_key: str | None = None
  cors_origins: tuple[str, ...] = ()

  @classmethod
  def from_config(cls, server) -> "ServerLimits":
    """`server` is `config.server`; the API key falls back to $MTPJAX_API_KEY."""
    limits = cls(
        max_body_bytes=int(server.max_body_bytes), max_queue=int(server.max_queue),
        request_timeout_s=float(server.request_timeout_s),
        shutdown_timeout_s=float(server.shutdown_timeout_s),
        template_timeout_s=float(server.template_timeout_s),
        template_max_chars=int(server.template_max_chars),
        header_timeout_s=float(server.header_timeout_s),
        body_timeout_s=float(server.body_timeout_s),
        idle_timeout_s=float(server.idle_timeout_s),
        max_connections=int(server.max_connections),
        api_key=server.api_key or os.environ.get(API_KEY_ENV) or None,
        cors_origins=tuple(server.cors_origins))
    limits.check()
    return limits

  def check(self) -> None:
    positive = {"max_body_bytes": self.max_body_bytes, "shutdown_timeout_s":
                self.shutdown_timeout_s, "template_timeout_s": self.template_timeout_s,
                "template_max_chars": self.template_max_chars,
                "header_timeout_s": self.header_timeout_s,
                "body_timeout_s": self.body_timeout_s, "idle_timeout_s": self.idle_timeout_s}
    for name, value in positive.items():
      if not (math.isfinite(value) and value > 0):
        raise errors.MtpjaxError(f"server.{name} must be > 0, got {value}",
                                 field=f"server.{name}", remedy="set a positive value")
    if self.max_connections < 0:
      raise errors.MtpjaxError(
          f"server.max_connections must be >= 0, got {self.max_connections}",
          field="server.max_connections", remedy="set 0 to stay below the process's file limit")
    if self.max_queue < 0:
      raise errors.MtpjaxError(f"server.max_queue must be >= 0, got {self.max_queue}",
                               field="server.max_queue",
                               remedy="set 0 to refuse requests while every slot is busy")
    if not (math.isfinite(self.request_timeout_s) and self.request_timeout_s >= 0):
      raise errors.MtpjaxError(
          f"server.request_timeout_s must be >= 0, got {self.request_timeout_s}",
          field="server.request_timeout_s", remedy="set 0 for no deadline")

  @property
  def deadline_s(self) -> float | None:
    return self.request_timeout_s or None
