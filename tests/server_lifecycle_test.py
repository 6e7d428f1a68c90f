"""Slow multi-process server tests (issue 20): API key, deadlines, SIGTERM with streams in flight.

Each class starts the real server (`python -m mtpjax.serve`, embedded tiny model) with its own
`server.*` limits and talks to it with `httpx` and the `openai` client.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import shutil
import signal
import tempfile
import threading
import time
from unittest import mock

import httpx
import openai
from absl.testing import absltest

import server_test
from configs import glm
from mtpjax import errors
from mtpjax.server.limits import API_KEY_ENV, ServerLimits
from server_test import MODEL

_KEY = "sk-test-0123456789"
_ORIGIN = "http://ok.example"
_LONG = {"model": MODEL, "prompt": "The router computes", "max_tokens": 4000}


def _events(response: httpx.Response) -> list[dict | str]:
  """The SSE payloads of a streamed response: dicts, and the final "[DONE]"."""
  events = []
  for line in response.iter_lines():
    if line.startswith("data: "):
      data = line[len("data: "):]
      events.append(data if data == "[DONE]" else json.loads(data))
  return events


class LimitsConfigTest(absltest.TestCase):
  """`ServerLimits.from_config`: the key's fallback and the checks (no server needed)."""

  def test_api_key_from_the_environment_unless_configured(self):
    server = glm.get_config().server
    self.enter_context(mock.patch.dict(os.environ, {API_KEY_ENV: "from-env"}))
    self.assertEqual(ServerLimits.from_config(server).api_key, "from-env")
    configured = glm.get_config().server
    configured.api_key = "from-config"
    self.assertEqual(ServerLimits.from_config(configured).api_key, "from-config")
    del os.environ[API_KEY_ENV]
    self.assertIsNone(ServerLimits.from_config(server).api_key)

  def test_bad_values_name_the_field(self):
    server = glm.get_config().server
    server.max_body_bytes = 0
    with self.assertRaisesRegex(errors.MtpjaxError, "server.max_body_bytes"):
      ServerLimits.from_config(server)


class ApiKeyAndDeadlineTest(absltest.TestCase):
  """A server with an API key, a 1 s deadline per request and one CORS origin."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp(prefix="mtpjax-lifecycle-test-")
    cls.server = server_test.ServerProcess(
        cls.tmp, pathlib.Path(cls.tmp) / "server.log", f"--config.server.api_key={_KEY}",
        "--config.server.request_timeout_s=1", f"--config.server.cors_origins={_ORIGIN}", "--config.engine.max_len=8192",
        "--config.engine.slots=2")
    try:
      cls.url = cls.server.wait_ready()
    except BaseException:
      cls.server.stop()
      raise
    cls.http = httpx.Client(base_url=cls.url, timeout=120,
                            headers={"authorization": f"Bearer {_KEY}"})
    cls.client = openai.OpenAI(base_url=cls.url + "/v1", api_key=_KEY, max_retries=0)

  @classmethod
  def tearDownClass(cls):
    server_test.close_server(cls)
    super().tearDownClass()

  def test_requests_without_the_key_get_401(self):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": _KEY}):
      response = httpx.post(self.url + "/v1/completions", headers=headers,
                            json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
      self.assertEqual(response.status_code, 401, headers)
      self.assertEqual(response.json()["error"]["code"], "invalid_api_key")
      self.assertEqual(response.json()["error"]["type"], "invalid_request_error")
      self.assertEqual(httpx.get(self.url + "/v1/models", headers=headers).status_code, 401)
    with self.assertRaises(openai.AuthenticationError):
      openai.OpenAI(base_url=self.url + "/v1", api_key="wrong",
                    max_retries=0).models.list()
    self.assertEqual(httpx.get(self.url + "/health").status_code, 200)   # probes stay open
    self.assertEqual(httpx.get(self.url + "/metrics").status_code, 200)
    answer = self.client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    self.assertEqual(answer.usage.completion_tokens, 2)

  def test_cors_answers_only_the_configured_origin(self):
    for origin, allowed in ((_ORIGIN, True), ("http://evil.example", False)):
      preflight = httpx.options(self.url + "/v1/chat/completions", headers={
          "origin": origin, "access-control-request-method": "POST",
          "access-control-request-headers": "authorization,content-type"})
      self.assertEqual(preflight.headers.get("access-control-allow-origin") == origin, allowed,
                       preflight.headers)
      response = self.http.get("/v1/models", headers={"origin": origin})
      self.assertEqual(response.status_code, 200)
      self.assertEqual(response.headers.get("access-control-allow-origin") == origin, allowed)

  def test_a_request_past_its_deadline_gets_504(self):
    started = time.monotonic()
    response = self.http.post("/v1/completions", json=_LONG)
    self.assertLess(time.monotonic() - started, 10)
    self.assertEqual(response.status_code, 504, response.text[:300])
    self.assertEqual(response.json()["error"]["code"], "deadline_exceeded")
    with self.http.stream("POST", "/v1/completions", json={**_LONG, "stream": True}) as stream:
      events = _events(stream)
    self.assertEqual(events[-1], "[DONE]")
    self.assertEqual(events[-2]["error"]["code"], "deadline_exceeded")
    short = self.http.post("/v1/completions", json={**_LONG, "max_tokens": 4})
    self.assertEqual(short.status_code, 200, short.text)


class GracefulShutdownTest(absltest.TestCase):
  """SIGTERM with 16 streams in flight on 2 slots: every stream ends cleanly, exit code 0 (2
  slots, not 4: fewer step shapes to compile before the server is ready)."""

  SHUTDOWN_S = 3.0

  def test_sigterm_with_sixteen_streams_in_flight(self):
    tmp = tempfile.mkdtemp(prefix="mtpjax-shutdown-test-")
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)   # after the server stops
    server = server_test.ServerProcess(
        tmp, pathlib.Path(tmp) / "server.log", "--config.engine.max_len=8192",
        "--config.engine.slots=2", f"--config.server.shutdown_timeout_s={self.SHUTDOWN_S}")
    self.addCleanup(server.stop)
    url = server.wait_ready()

    answered = threading.Semaphore(0)   # released once per stream whose headers arrived

    def stream(_):
      with httpx.stream("POST", url + "/v1/completions", json={**_LONG, "stream": True},
                        timeout=120) as response:
        answered.release()
        return response.status_code, _events(response)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
      streams = [pool.submit(stream, i) for i in range(16)]
      # SIGTERM only once every request holds its answer: a connection the server has not
      # read yet when it stops listening is reset, which is not what this test is about.
      for _ in range(16):
        self.assertTrue(answered.acquire(timeout=60), "a stream got no response headers")
      signalled = time.monotonic()
      server.process.send_signal(signal.SIGTERM)
      results = [s.result() for s in streams]
      code = server.process.wait(60)
      exited_s = time.monotonic() - signalled
    reasons = []
    for status, events in results:
      self.assertEqual(status, 200)
      self.assertEqual(events[-1], "[DONE]")
      reasons.append(events[-2]["choices"][0]["finish_reason"])
    self.assertTrue(set(reasons) <= {"cancelled", "length", "stop"}, reasons)
    self.assertIn("cancelled", reasons)
    self.assertEqual(code, 0, server.log()[-3000:])
    # The deadline, then uvicorn's margin for the last sends; process teardown is extra.
    self.assertLess(exited_s, self.SHUTDOWN_S + 5 + 10, server.log()[-3000:])
    print(f"SIGTERM to exit: {exited_s:.2f} s (shutdown_timeout_s {self.SHUTDOWN_S})")


if __name__ == "__main__":
  absltest.main()
