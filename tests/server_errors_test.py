"""Bad input to `python -m mtpjax.serve`: OpenAI-style 4xx errors, and the server serves on.

Every case sends a malformed or unsupported request with raw `httpx` (or the `openai` client,
which must raise its typed errors), checks the `{"error": {message, type, param, code}}` body
and then sends a good request that must succeed. Bad configurations must stop the server
before it listens, with the typed error's message and no traceback.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import openai
from absl.testing import absltest, parameterized

import server_test
from server_test import MODEL, REPO, metric

_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
_MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(**fields):
  return {"model": MODEL, "messages": _MESSAGES, "max_tokens": 4, **fields}


def _completion(**fields):
  return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}


def _without(body, key):
  return {k: v for k, v in body.items() if k != key}


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (name, path, body (bytes are sent raw), status, param, code); max_len is 128 here.
_BAD_REQUESTS = (
    ("invalid_json", _COMPLETIONS, b'{"model": "mtpjax-tiny", "prompt": ', 400, None,
     "invalid_json"),
    ("body_not_an_object", _CHAT, b"[1, 2]", 400, None, "invalid_json"),
    ("empty_body", _COMPLETIONS, b"", 400, None, "invalid_json"),
    ("unknown_model", _COMPLETIONS, _completion(model="gpt-4"), 404, "model", "model_not_found"),
    ("unknown_model_chat", _CHAT, _chat(model="glm-4.7"), 404, "model", "model_not_found"),
    ("max_tokens_string", _COMPLETIONS, _completion(max_tokens="ten"), 400, "max_tokens",
     "invalid_value"),
    ("max_tokens_float", _CHAT, _chat(max_tokens=4.5), 400, "max_tokens", "invalid_value"),
    ("temperature_string", _CHAT, _chat(temperature="hot"), 400, "temperature", "invalid_value"),
    ("stream_string", _CHAT, _chat(stream="yes"), 400, "stream", "invalid_value"),
    ("messages_string", _CHAT, _chat(messages="hi"), 400, "messages", "invalid_value"),
    ("content_number", _CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400,
     "messages.0.content", "invalid_value"),
    ("unknown_role", _CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages.0.role", "invalid_value"),
    ("prompt_number", _COMPLETIONS, _completion(prompt=5), 400, "prompt", "invalid_value"),
    ("negative_max_tokens", _COMPLETIONS, _completion(max_tokens=-5), 400, "max_tokens",
     "invalid_value"),
    ("zero_max_tokens", _CHAT, _chat(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("huge_max_tokens", _COMPLETIONS, _completion(max_tokens=10**12), 400, "max_tokens",
     "context_length_exceeded"),
    ("max_tokens_past_the_context", _CHAT, _chat(max_tokens=125), 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt_ids_too_long", _COMPLETIONS, _completion(prompt=[65] * 128), 400, "prompt",
     "context_length_exceeded"),
    ("chat_too_long", _CHAT, _chat(messages=[{"role": "user", "content": "word " * 200}]), 400,
     "messages", "context_length_exceeded"),
    ("n_two", _CHAT, _chat(n=2), 400, "n", "unsupported_value"),
    ("temperature_too_high", _COMPLETIONS, _completion(temperature=2.5), 400, "temperature",
     "invalid_value"),
    ("temperature_negative", _CHAT, _chat(temperature=-0.1), 400, "temperature",
     "invalid_value"),
    ("top_p_zero", _COMPLETIONS, _completion(top_p=0), 400, "top_p", "invalid_value"),
    ("top_p_above_one", _CHAT, _chat(top_p=1.5), 400, "top_p", "invalid_value"),
    ("missing_messages", _CHAT, _without(_chat(), "messages"), 400, "messages",
     "missing_field"),
    ("empty_messages", _CHAT, _chat(messages=[]), 400, "messages", "invalid_value"),
    ("missing_prompt", _COMPLETIONS, _without(_completion(), "prompt"), 400, "prompt",
     "missing_field"),
    ("missing_model", _COMPLETIONS, _without(_completion(), "model"), 400, "model",
     "missing_field"),
    ("empty_prompt", _COMPLETIONS, _completion(prompt=""), 400, "prompt", None),
    ("token_id_outside_vocab", _COMPLETIONS, _completion(prompt=[1, 99999]), 400, "prompt",
     "invalid_value"),
    ("stop_token_id_outside_vocab", _CHAT, _chat(stop_token_ids=[-1]), 400, "stop_token_ids",
     "invalid_value"),
    ("empty_stop_string", _CHAT, _chat(stop=[""]), 400, "stop", None),
    ("batch_of_prompts", _COMPLETIONS, _completion(prompt=["a", "b"]), 400, "prompt",
     "unsupported_value"),
    ("logprobs_above_20", _COMPLETIONS, _completion(logprobs=21), 400, "logprobs",
     "invalid_value"),
    ("top_logprobs_above_20", _CHAT, _chat(logprobs=True, top_logprobs=21), 400,
     "top_logprobs", "invalid_value"),
    ("top_logprobs_without_logprobs", _CHAT, _chat(top_logprobs=2), 400, "top_logprobs", None),
    ("tools_the_template_does_not_render", _CHAT, _chat(tools=[_TOOL]), 400, "tools",
     "unsupported_value"),
    ("tool_choice_without_tools", _CHAT, _chat(tool_choice="required"), 400, "tool_choice",
     None),
    ("tool_choice_not_offered", _CHAT, _chat(tools=[_TOOL], tool_choice={
        "type": "function", "function": {"name": "other"}}), 400, "tool_choice", None),
    ("tool_without_function", _CHAT, _chat(tools=[{"type": "function"}]), 400,
     "tools.0.function", "missing_field"),
    ("parallel_tool_calls_false", _CHAT, _chat(parallel_tool_calls=False), 400,
     "parallel_tool_calls", "unsupported_value"),
    ("tool_call_arguments_not_json", _CHAT, _chat(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "not json"}}]}]), 400, "messages", "invalid_value"),
    ("unknown_field", _CHAT, _chat(repetition_penalty=1.1), 400, "repetition_penalty",
     "unsupported_field"),
    ("unknown_field_completions", _COMPLETIONS, _completion(min_p=0.1), 400, "min_p",
     "unsupported_field"),
    ("unknown_message_field", _CHAT, _chat(messages=[{"role": "user", "content": "x",
                                                      "audio": {}}]), 400,
     "messages.0.audio", "unsupported_field"),
    ("presence_penalty", _CHAT, _chat(presence_penalty=0.5), 400, "presence_penalty",
     "unsupported_value"),
    ("stream_options_without_stream", _CHAT, _chat(stream_options={"include_usage": True}),
     400, "stream_options", None),
    # Bounded to what the engine represents (issue 20): top_k past int32 used to fail every
    # live request inside the engine step.
    ("top_k_past_int32", _COMPLETIONS, _completion(top_k=2**31, temperature=1.0), 400, "top_k",
     "invalid_value"),
    ("seed_past_int64", _CHAT, _chat(seed=2**63), 400, "seed", "invalid_value"),
    ("too_many_stop_strings", _CHAT, _chat(stop=[f"s{i}" for i in range(17)]), 400, "stop",
     "invalid_value"),
    ("stop_string_too_long", _COMPLETIONS, _completion(stop="x" * 257), 400, "stop",
     "invalid_value"),
    ("too_many_stop_token_ids", _CHAT, _chat(stop_token_ids=[1] * 257), 400, "stop_token_ids",
     "invalid_value"),
    # Bounded preparation (issue 52 item 1): refused before the work grows with the input.
    ("too_many_messages", _CHAT, _chat(messages=[{"role": "user", "content": "x"}] * 4097), 400,
     "messages", "invalid_value"),
    ("too_many_tools", _CHAT, _chat(tools=[_TOOL] * 129), 400, "tools", "invalid_value"),
    ("a_prompt_of_4m_characters", _COMPLETIONS, _completion(prompt="word " * 800_000), 400,
     "prompt", "context_length_exceeded"),
)

class BadInputTest(server_test.ServerTestBase):
  """One server (MTP on, max_len 128) receiving every kind of bad request."""

  FLAGS = ("--config.engine.max_len=128", "--config.engine.slots=2")

  @parameterized.named_parameters(*_BAD_REQUESTS)
  def test_bad_request_gets_an_openai_error_and_the_server_keeps_serving(
      self, path, body, status, param, code):
    if isinstance(body, bytes):
      response = self.http.post(path, content=body, headers={"content-type": "application/json"})
    else:
      response = self.http.post(path, json=body)
    self.assertEqual(response.status_code, status, response.text)
    error = response.json()["error"]
    self.assertEqual(set(response.json()), {"error"})
    self.assertEqual(set(error), {"message", "type", "param", "code"})
    self.assertIsInstance(error["message"], str)
    self.assertNotEqual(error["message"], "")
    self.assertEqual(error["type"], "not_found_error" if status == 404 else "invalid_request_error")
    self.assertEqual((error["param"], error["code"]), (param, code), error["message"])
    self.assert_good_request_works()

  def test_wrong_route_and_method(self):
    self.assertEqual(self.http.get("/v1/completions").status_code, 405)
    missing = self.http.get("/v1/nothing")
    self.assertEqual(missing.status_code, 404)
    self.assertEqual(set(missing.json()["error"]), {"message", "type", "param", "code"})
    self.assert_good_request_works()

  def test_openai_client_sees_typed_errors(self):
    with self.assertRaises(openai.NotFoundError):
      self.client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with self.assertRaises(openai.BadRequestError) as raised:
      self.chat("hi", n=2)
    self.assertEqual(raised.exception.body["param"], "n")
    before = metric(self.metrics(), "mtpjax_request_errors_total", status="400",
                    code="unsupported_value")
    with self.assertRaises(openai.BadRequestError):
      self.chat("hi", stream=True, n=3)
    after = metric(self.metrics(), "mtpjax_request_errors_total", status="400",
                   code="unsupported_value")
    self.assertEqual(after - before, 1)
    self.assert_good_request_works()


class StartupErrorTest(parameterized.TestCase):
  """Bad configurations stop the server before it listens, with the typed error's message."""

  @parameterized.named_parameters(
      ("real_variant_without_source", ("--config=configs/glm.py:glm-4.7",),
       "model.source is unset"),
      ("bad_strategy", ("--config=configs/glm.py",
                        "--config.defaults.speculative.strategy=ngram/simple"),
       "defaults.speculative.strategy must be one of: auto, native-mtp-n1, disabled"),
      ("missing_source_path", ("--config=configs/glm.py", "--config.model.source=/nonexistent"),
       "/nonexistent does not exist"),
      ("bad_drafting_mode", ("--config=configs/glm.py",
                             "--config.engine.adaptive_drafting=sometimes"),
       "unknown adaptive drafting mode 'sometimes'"),
      ("bad_kv_cache_dtype", ("--config=configs/glm.py",
                              "--config.engine.kv_cache_dtype=int8"),
       "engine.kv_cache_dtype 'int8' is not one of"),
  )
  def test_exits_with_the_message(self, flags, message):
    tmp = tempfile.mkdtemp(prefix="mtpjax-startup-test-")
    self.addCleanup(shutil.rmtree, tmp, True)
    result = subprocess.run(
        [sys.executable, "-m", "mtpjax.serve", *flags, f"--config.cache_dir={tmp}",
         "--config.server.port=0"], cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    self.assertEqual(result.returncode, 1, result.stderr[-3000:])
    self.assertIn(message, result.stderr)
    self.assertNotIn("Traceback", result.stderr)
    self.assertNotIn("mtpjax ready", result.stderr)

  def test_a_busy_port_fails_before_the_model_loads(self):
    # The port is checked first: a missing source would be the error after it.
    busy = socket.socket()
    self.addCleanup(busy.close)
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="mtpjax-startup-test-")
    self.addCleanup(shutil.rmtree, tmp, True)
    result = subprocess.run(
        [sys.executable, "-m", "mtpjax.serve", "--config=configs/glm.py",
         "--config.model.source=/nonexistent", f"--config.cache_dir={tmp}",
         "--config.server.host=127.0.0.1", f"--config.server.port={port}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    self.assertEqual(result.returncode, 1, result.stderr[-3000:])
    self.assertIn(f"cannot listen on 127.0.0.1:{port}", result.stderr)
    self.assertIn("server.port", result.stderr)
    self.assertNotIn("does not exist", result.stderr)
    self.assertNotIn("Traceback", result.stderr)


if __name__ == "__main__":
  absltest.main()
