"""Connection limits: idle and slow clients cannot hold the server's sockets.

uvicorn times out a kept-alive connection between requests, but a connection that never sends
a request, or sends its headers a byte at a time, stays open for ever; 1,000 such sockets
against a file limit of 1,200 left /health failing until the clients gave up. Here each
connection must deliver a request's headers within `server.header_timeout_s` of opening (or of
its previous response), and the open connections are capped at `server.max_connections`: at
the cap, a new connection closes the one that has waited longest without a request in
progress, so idle sockets cannot lock out new clients; only when every connection is serving
a request is the newcomer turned away with 503. A request's body has a deadline of its own,
`server.body_timeout_s` (`guards.RequestGuards`).
"""

from __future__ import annotations

import asyncio
import json
import resource

from uvicorn.protocols.http.h11_impl import H11Protocol

from mtpjax.server import schemas
from mtpjax.server.limits import ServerLimits

# File descriptors kept back from connections for the model's files, logs and the runtime.
_RESERVED_FILES = 128


def _refusal() -> bytes:
  """The 503 a connection over the cap gets before it is closed."""
  body = json.dumps(schemas.error_body(
      "too many open connections; try again shortly (server.max_connections)",
      type=schemas.SERVER_ERROR, code="too_many_connections")).encode()
  return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
          b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


def connection_cap(limits: ServerLimits) -> int:
  """`server.max_connections`, or (0) what the process's file limit leaves for sockets."""
  if limits.max_connections:
    return limits.max_connections
  soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
  return max(16, soft - _RESERVED_FILES) if soft != resource.RLIM_INFINITY else 65536


def guarded_protocol(limits: ServerLimits) -> type[H11Protocol]:
  """uvicorn's h11 protocol with the header deadline and the connection cap of `limits`."""
  cap = connection_cap(limits)
  refusal = _refusal()

  class GuardedProtocol(H11Protocol):
    _deadline: asyncio.TimerHandle | None = None
    _waiting_since = 0.0
    _served = None                       # the cycle whose response came last

    def connection_made(self, transport) -> None:
      super().connection_made(transport)
      if len(self.connections) > cap and not self._evict_one():
        transport.write(refusal)
        transport.close()
        return
      self._await_request()

    def _evict_one(self) -> bool:
      """Closes the connection waiting longest for a request; False if none is waiting."""
      waiting = [c for c in self.connections if c is not self and c._deadline is not None
                 and not c.transport.is_closing()]
      if not waiting:
        return False
      min(waiting, key=lambda c: c._waiting_since)._close_waiting()
      return True

    def _await_request(self) -> None:
      """Arms the deadline for the next request's headers."""
      self._cancel_deadline()
      self._served = self.cycle
      self._waiting_since = self.loop.time()
      self._deadline = self.loop.call_later(limits.header_timeout_s, self._close_waiting)

    def _cancel_deadline(self) -> None:
      if self._deadline is not None:
        self._deadline.cancel()
        self._deadline = None

    def _close_waiting(self) -> None:
      self._cancel_deadline()
      if not self.transport.is_closing():
        self.transport.close()

    def data_received(self, data: bytes) -> None:
      super().data_received(data)
      if self._deadline is not None and self.cycle is not self._served:
        self._cancel_deadline()          # a request's headers arrived

    def on_response_complete(self) -> None:
      completed = self.cycle
      super().on_response_complete()
      if self.cycle is completed and not self.transport.is_closing():
        self._await_request()            # (a pipelined request may have started already)

    def connection_lost(self, exc) -> None:
      self._cancel_deadline()
      super().connection_lost(exc)

  return GuardedProtocol
