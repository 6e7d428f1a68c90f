"""Checks every HTTP request passes before a route sees it: API key, JSON content type, body size.

A pure ASGI middleware, so a refused request costs no parsing: a missing or wrong API key gets
401 (only /v1/* routes need one; /health and /metrics stay open for probes), a POST that is not
`application/json` gets 415 (a web page can send `text/plain` without a CORS preflight, so a
local server must refuse it), a body over `server.max_body_bytes` gets 413 as soon as its
declared length or its received bytes show it, and one still arriving after
`server.body_timeout_s` gets 408. The body is read here, with the limit, and
replayed to the route; later `receive` calls (client disconnects) pass through.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any, Awaitable, Callable

from fastapi import responses
from starlette.datastructures import Headers

from mtpjax.server import schemas
from mtpjax.server.limits import ServerLimits

_OPEN_PATHS = ("/health", "/metrics")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class RequestGuards:
  """ASGI middleware; `on_error(status, code)` counts each refusal (the server's metrics)."""

  def __init__(self, app, limits: ServerLimits, on_error: Callable[[int, str], None]):
    self.app = app
    self.limits = limits
    self.on_error = on_error

  async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
      await self.app(scope, receive, send)
      return
    headers = Headers(scope=scope)
    refusal = self._refusal(scope, headers)
    if refusal is None and scope["method"] == "POST":
      body, refusal = await self._read_body(receive, headers)
      if body is None and refusal is None:
        return                        # the client left while sending its body
      receive = _replay(body, receive)
    if refusal is not None:
      status, message, code = refusal
      self.on_error(status, code)
      await responses.JSONResponse(schemas.error_body(message, code=code),
                                   status_code=status)(scope, receive, send)
      return
    await self.app(scope, receive, send)

  def _refusal(self, scope: Scope, headers: Headers) -> tuple[int, str, str] | None:
    key = self.limits.api_key
    if key and scope["path"] not in _OPEN_PATHS:
      given = headers.get("authorization", "")
      scheme, _, token = given.partition(" ")
      if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                               key.encode()):
        message = ("Incorrect API key provided." if given else "You didn't provide an API "
                   "key. Send it as 'Authorization: Bearer <key>' (server.api_key).")
        return 401, message, "invalid_api_key"
    if scope["method"] != "POST":
      return None
    media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
      return (415, f"the request body must be JSON sent as 'Content-Type: application/json', "
              f"not {media_type or 'no content type'!r}", "unsupported_media_type")
    declared = headers.get("content-length")
    if declared is not None and (not declared.isdigit()
                                 or int(declared) > self.limits.max_body_bytes):
      return self._too_large(declared)
    return None

  def _too_large(self, size: str) -> tuple[int, str, str]:
    return (413, f"the request body ({size} bytes) is larger than this server accepts "
            f"({self.limits.max_body_bytes} bytes, server.max_body_bytes)",
            "request_too_large")

  async def _read_body(self, receive: Receive, headers: Headers
                       ) -> tuple[bytes | None, tuple[int, str, str] | None]:
    body = bytearray()
    try:
      async with asyncio.timeout(self.limits.body_timeout_s):
        while True:
          message = await receive()
          if message["type"] == "http.disconnect":
            return None, None
          body += message.get("body", b"")
          if len(body) > self.limits.max_body_bytes:
            return b"", self._too_large(f"more than {self.limits.max_body_bytes}")
          if not message.get("more_body", False):
            return bytes(body), None
    except TimeoutError:
      return b"", (408, f"the request body did not arrive within "
                   f"{self.limits.body_timeout_s:g} s (server.body_timeout_s)", "request_timeout")


def _replay(body: bytes, receive: Receive) -> Receive:
  """A `receive` that gives the buffered body once, then the connection's own messages."""
  sent = False

  async def replayed() -> dict[str, Any]:
    nonlocal sent
    if not sent:
      sent = True
      return {"type": "http.request", "body": body, "more_body": False}
    return await receive()

  return replayed
