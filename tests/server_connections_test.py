"""Connection limits (mtpjax/server/connections.py, the body deadline in guards.py): idle and
slow clients are closed, and a capped server keeps answering new clients.

The server's own connection layer runs here in a real uvicorn on loopback, in front of a
small ASGI app behind the server's request guards, so each case needs no model and runs in
seconds; the served app's wiring is checked in server_test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import uvicorn
from absl.testing import absltest

from mtpjax.server.connections import guarded_protocol
from mtpjax.server.guards import RequestGuards
from mtpjax.server.limits import ServerLimits


class _App:
  """GET /health answers at once; GET /hold answers when `release` is set; POST echoes."""

  def __init__(self):
    self.release = threading.Event()

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return
    if scope["path"] == "/hold":
      while not self.release.is_set():
        await asyncio.sleep(0.02)
    body = b""
    if scope["method"] == "POST":
      body = (await receive())["body"]
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps({"got": len(body)}).encode()})


@contextlib.contextmanager
def serving(**limits):
  """(url, app) of a server with these `ServerLimits` fields, stopped on exit."""
  settings = ServerLimits(**limits)
  app = _App()
  config = uvicorn.Config(RequestGuards(app, settings, on_error=lambda *_: None),
                          http=guarded_protocol(settings), lifespan="off", log_level="error",
                          timeout_keep_alive=settings.idle_timeout_s)
  server = uvicorn.Server(config)
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  while not server.started:
    time.sleep(0.01)
  try:
    yield sock.getsockname(), app
  finally:
    app.release.set()
    server.should_exit = True
    thread.join(10)
    sock.close()


def closed_within(conn: socket.socket, seconds: float) -> bool:
  """Whether the server closes `conn` within `seconds` (whatever it sends first is read)."""
  conn.settimeout(seconds)
  try:
    while conn.recv(4096):
      pass
    return True
  except (TimeoutError, socket.timeout):
    return False
  except ConnectionResetError:
    return True


def request_line(path: str = "/health") -> bytes:
  return f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode()


class ConnectionLimitsTest(absltest.TestCase):

  def test_a_connection_that_sends_nothing_is_closed_at_the_header_deadline(self):
    with serving(header_timeout_s=0.5) as (address, _):
      conn = socket.create_connection(address)
      self.assertTrue(closed_within(conn, 5))

  def test_headers_sent_a_line_at_a_time_do_not_extend_the_deadline(self):
    with serving(header_timeout_s=1.0) as (address, _):
      conn = socket.create_connection(address)
      conn.sendall(b"GET /health HTTP/1.1\r\n")
      started = time.monotonic()
      closed = False
      while time.monotonic() - started < 6 and not closed:
        try:
          conn.sendall(b"x-slow: 1\r\n")
        except OSError:
          closed = True
        closed = closed or closed_within(conn, 0.2)
      self.assertTrue(closed, "a slowloris client kept its connection for 6 s")

  def test_a_kept_alive_connection_without_a_request_is_closed(self):
    with serving(idle_timeout_s=0.5, header_timeout_s=30) as (address, _):
      conn = socket.create_connection(address)
      conn.sendall(request_line())
      self.assertIn(b" 200 ", conn.recv(4096))
      self.assertTrue(closed_within(conn, 5))

  def test_at_the_cap_idle_connections_make_room_for_new_clients(self):
    cap = 8
    with serving(max_connections=cap, header_timeout_s=60) as (address, _):
      idle = [socket.create_connection(address) for _ in range(3 * cap)]
      self.assertEqual(httpx.get(f"http://{address[0]}:{address[1]}/health").status_code, 200)
      still_open = [conn for conn in idle if not closed_within(conn, 0.05)]
      self.assertLessEqual(len(still_open), cap - 1)     # the rest were closed to make room

  def test_at_the_cap_with_every_connection_busy_a_new_client_gets_503(self):
    cap = 4
    with serving(max_connections=cap, header_timeout_s=60) as (address, app):
      busy = [socket.create_connection(address) for _ in range(cap)]
      for conn in busy:
        conn.sendall(request_line("/hold"))
      time.sleep(0.3)                                     # each request is in the app
      response = httpx.get(f"http://{address[0]}:{address[1]}/health")
      self.assertEqual(response.status_code, 503)
      self.assertEqual(response.json()["error"]["code"], "too_many_connections")
      app.release.set()
      for conn in busy:
        self.assertIn(b" 200 ", conn.recv(4096))

  def test_a_body_that_stops_arriving_gets_408(self):
    with serving(body_timeout_s=0.5, header_timeout_s=30) as (address, _):
      conn = socket.create_connection(address)
      conn.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   b"content-length: 100\r\n\r\n{\"a\":")
      conn.settimeout(5)
      self.assertIn(b" 408 ", conn.recv(4096))

  def test_a_whole_request_is_served(self):
    with serving(header_timeout_s=0.5, body_timeout_s=0.5) as (address, _):
      response = httpx.post(f"http://{address[0]}:{address[1]}/echo", json={"a": 1})
      self.assertEqual(response.json(), {"got": len(b'{"a":1}')})


if __name__ == "__main__":
  absltest.main()
