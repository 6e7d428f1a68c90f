"""Tool calls and reasoning end to end: the real server, the official `openai` client, and a
model whose greedy replies are GLM thinking and GLM tool calls (mtpjax.testing.scripted_glm).

The server runs with native MTP on (the GGUF has a NextN block), so every reply below went
through drafting and verification. Expected values come from the script the model was built
to follow, not from the server's parsers.
"""

from __future__ import annotations

import json
import pathlib
import tempfile

import openai
from absl.testing import absltest, parameterized

from mtpjax.testing import scripted_glm
from server_test import ServerProcess, close_server, open_clients

MODEL = "scripted-glm"
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [scripted_glm.TOOL]


def merge_stream(chunks) -> tuple[dict, str | None]:
  """A streamed reply merged the way OpenAI clients merge it: (message fields, finish)."""
  message = {"content": "", "reasoning_content": "", "tool_calls": {}}
  reason = None
  for chunk in chunks:
    for choice in chunk.choices:
      delta = choice.delta
      message["content"] += delta.content or ""
      message["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
      for call in delta.tool_calls or ():
        entry = message["tool_calls"].setdefault(call.index, {"id": None, "name": "",
                                                              "arguments": ""})
        entry["id"] = call.id or entry["id"]
        entry["name"] += (call.function.name or "") if call.function else ""
        entry["arguments"] += (call.function.arguments or "") if call.function else ""
      reason = choice.finish_reason or reason
  return message, reason


class ToolCallServerTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp(prefix="mtpjax-tools-test-")
    gguf_path = scripted_glm.write_scripted_glm_gguf(pathlib.Path(cls.tmp) / "scripted.gguf")
    cls.server = ServerProcess(cls.tmp, pathlib.Path(cls.tmp) / "server.log",
                               f"--config.model.source={gguf_path}",
                               f"--config.server.model_name={MODEL}",
                               "--config.defaults.speculative.strategy=native-mtp-n1",
                               "--config.engine.prefill_buckets=(128,512)",
                               "--config.engine.slots=2", tiny=False)
    try:
      cls.url = cls.server.wait_ready()
    except BaseException:
      cls.server.stop()
      raise
    open_clients(cls)

  @classmethod
  def tearDownClass(cls):
    close_server(cls)
    super().tearDownClass()

  def chat(self, messages, **kwargs):
    return self.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                               **kwargs)

  def test_round_trip_with_reasoning(self):
    self.assertIn("native MTP on", self.server.log())
    first = self.chat(QUESTION, tools=TOOLS).choices[0]
    self.assertEqual(first.finish_reason, "tool_calls")
    self.assertEqual(first.message.reasoning_content, "Checking_the_weather.")
    self.assertIsNone(first.message.content)
    call, = first.message.tool_calls
    self.assertEqual((call.type, call.function.name), ("function", "get_weather"))
    self.assertEqual(json.loads(call.function.arguments), {"city": "Paris"})
    history = QUESTION + [first.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "rain, 12 C"}]
    final = self.chat(history, tools=TOOLS).choices[0]
    self.assertEqual(final.finish_reason, "stop")
    self.assertEqual(final.message.content, "It_rains_in_Paris.")
    self.assertEqual(final.message.reasoning_content, "The_tool_answered.")
    self.assertIsNone(final.message.tool_calls)

  def test_streamed_round_trip(self):
    message, reason = merge_stream(self.chat(QUESTION, tools=TOOLS, stream=True))
    self.assertEqual(reason, "tool_calls")
    self.assertEqual(message["reasoning_content"], "Checking_the_weather.")
    self.assertEqual(message["content"], "")
    call = message["tool_calls"][0]
    self.assertEqual(call["name"], "get_weather")
    self.assertEqual(json.loads(call["arguments"]), {"city": "Paris"})
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call["id"], "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "rain, 12 C"}]
    message, reason = merge_stream(self.chat(history, tools=TOOLS, stream=True))
    self.assertEqual((message["content"], message["reasoning_content"], reason),
                     ("It_rains_in_Paris.", "The_tool_answered.", "stop"))

  def test_streamed_tool_call_arrives_as_name_then_argument_fragments(self):
    deltas = [call for chunk in self.chat(QUESTION, tools=TOOLS, stream=True)
              for choice in chunk.choices for call in choice.delta.tool_calls or ()]
    self.assertGreater(len(deltas), 1)
    self.assertEqual(deltas[0].function.name, "get_weather")
    self.assertTrue(deltas[0].id)
    self.assertTrue(all(d.index == 0 and d.id is None for d in deltas[1:]))

  def test_enable_thinking_false_skips_the_thinking_phase(self):
    reply = self.chat(QUESTION, tools=TOOLS,
                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    self.assertIsNone(getattr(message, "reasoning_content", None))
    self.assertEqual(message.tool_calls[0].function.name, "get_weather")

  @parameterized.named_parameters(
      ("required", "required"),
      ("named", {"type": "function", "function": {"name": "get_weather"}}))
  def test_tool_choice_forcing_a_call(self, tool_choice):
    reply = self.chat(QUESTION, tools=TOOLS, tool_choice=tool_choice).choices[0]
    self.assertEqual(reply.finish_reason, "tool_calls")
    self.assertIsNone(getattr(reply.message, "reasoning_content", None))
    self.assertEqual(json.loads(reply.message.tool_calls[0].function.arguments),
                     {"city": "Paris"})

  def test_tool_choice_none_leaves_the_reply_as_content(self):
    reply = self.chat(QUESTION, tools=TOOLS, tool_choice="none").choices[0]
    self.assertEqual(reply.finish_reason, "stop")
    self.assertIsNone(reply.message.tool_calls)
    self.assertIn("<tool_call>get_weather", reply.message.content)

  def test_a_call_cut_off_by_max_tokens_stays_content(self):
    reply = self.client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                                max_tokens=7).choices[0]
    self.assertEqual(reply.finish_reason, "length")
    self.assertIsNone(reply.message.tool_calls)
    self.assertEqual(reply.message.content, "<tool_call>get_weather<arg_key>city")

  def test_unknown_tool_choice_is_a_400(self):
    with self.assertRaises(openai.BadRequestError) as raised:
      self.chat(QUESTION, tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_time"}})
    self.assertEqual(raised.exception.body["param"], "tool_choice")


if __name__ == "__main__":
  absltest.main()
