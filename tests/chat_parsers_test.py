"""The GLM reply parsers: thinking -> reasoning_content, tool-call blocks -> OpenAI tool_calls.

Replies are written by hand in the formats the public GLM chat templates instruct (GLM-4.5 /
4.6: name and each tag on its own line; GLM-4.7 / GLM-5: no newlines, the name running into
the first `<arg_key>`), including truncated and malformed calls. Every reply is also fed one
character at a time and in two halves at every split point: the streamed deltas must merge
into exactly the whole reply's message.
"""

import json

from absl.testing import absltest, parameterized

from mtpjax.server import reasoning
from mtpjax.server.chat_output import ChatOutput, forced_call_prefix, whole_message
from mtpjax.server.tool_calls import parse_tool_calls

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "units": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "now"}},
]

GLM45_CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
GLM47_CALL = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>123</arg_value>"
              "<arg_key>units</arg_key><arg_value>{\"t\": \"C\"}</arg_value></tool_call>")


def merge(deltas: list[dict]) -> dict:
  """OpenAI clients' merge of streamed deltas into one message."""
  message = {"content": "", "reasoning_content": "", "tool_calls": {}}
  for delta in deltas:
    message["content"] += delta.get("content", "")
    message["reasoning_content"] += delta.get("reasoning_content", "")
    for call in delta.get("tool_calls", ()):
      entry = message["tool_calls"].setdefault(call["index"], {"arguments": ""})
      entry.update({k: call[k] for k in ("id",) if k in call})
      function = call["function"]
      if "name" in function:
        entry["name"] = function["name"]
      entry["arguments"] += function["arguments"]
  return message


def streamed(text: str, pieces: list[str], **kwargs) -> dict:
  output = ChatOutput(**kwargs)
  deltas = [d for piece in pieces for d in output.feed(piece)] + output.finish()
  return merge(deltas)


class ToolCallParserTest(parameterized.TestCase):

  def test_glm45_call_with_typed_arguments(self):
    content, calls = parse_tool_calls("Let me look.\n" + GLM45_CALL, TOOLS)
    self.assertEqual(content, "Let me look.")
    self.assertEqual([(c.name, c.arguments) for c in calls],
                     [("get_weather", {"city": "Paris", "days": 3})])
    self.assertEqual(json.loads(calls[0].as_openai()["function"]["arguments"]),
                     {"city": "Paris", "days": 3})

  def test_glm47_call_without_newlines_and_a_call_without_arguments(self):
    content, calls = parse_tool_calls(GLM47_CALL + "\n<tool_call>now</tool_call>", TOOLS)
    self.assertEqual(content, "")
    # "123" stays a string: the schema says city is a string; units is JSON.
    self.assertEqual([(c.name, c.arguments) for c in calls],
                     [("get_weather", {"city": "123", "units": {"t": "C"}}), ("now", {})])
    self.assertEqual(calls[1].as_openai()["function"]["arguments"], "{}")
    self.assertNotEqual(calls[0].id, calls[1].id)

  @parameterized.named_parameters(
      ("unknown_function", "<tool_call>rm_rf\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n"
       "</tool_call>"),
      ("no_name", "<tool_call>\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"),
      ("text_between_pairs", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>P"
       "</arg_value>\nand then\n<arg_key>days</arg_key><arg_value>1</arg_value></tool_call>"),
      ("value_without_key", "<tool_call>get_weather\n<arg_value>P</arg_value>\n</tool_call>"),
      ("unclosed_value", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>P\n"
       "</tool_call>"),
      ("truncated", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"),
      ("truncated_open_tag", "Sure <tool_ca"),
  )
  def test_malformed_or_truncated_calls_stay_content(self, text):
    content, calls = parse_tool_calls(text, TOOLS)
    self.assertEqual(calls, [])
    self.assertEqual(content, text.strip())

  def test_a_malformed_call_does_not_spoil_a_good_one(self):
    bad = "<tool_call>nope</tool_call>"
    content, calls = parse_tool_calls(f"{bad}\n{GLM45_CALL}", TOOLS)
    self.assertEqual(content, bad)
    self.assertEqual([c.name for c in calls], ["get_weather"])


class ReasoningTest(absltest.TestCase):

  def test_glm45_reply_opens_thinking_itself(self):
    self.assertEqual(reasoning.split_reasoning("<think>Paris is in France.</think>\nIt rains."),
                     ("Paris is in France.", "It rains."))

  def test_glm47_prompt_opens_thinking(self):
    prompt = "<|user|>\nHi<|assistant|><think>"
    self.assertTrue(reasoning.prompt_opens_thinking(prompt))
    self.assertFalse(reasoning.prompt_opens_thinking(prompt + "</think>"))
    self.assertFalse(reasoning.prompt_opens_thinking("<|assistant|>\n<think></think>"))
    self.assertEqual(reasoning.split_reasoning("Short.</think>Hello", thinking=True),
                     ("Short.", "Hello"))

  def test_answer_text_is_kept_as_written(self):
    self.assertEqual(reasoning.split_reasoning("    def f(): return '<think>'"),
                     ("", "    def f(): return '<think>'"))

  def test_truncated_thinking_is_all_reasoning(self):
    self.assertEqual(reasoning.split_reasoning("<think>Let me see, the </thi"),
                     ("Let me see, the </thi", ""))


REPLIES = (
    ("plain", "  Plain answer < with brackets <tool", {}),
    ("thinking_then_call", "<think>Need weather.</think>\nChecking.\n" + GLM45_CALL,
     {"tools": TOOLS}),
    ("glm47_open_thinking", "hmm</think>" + GLM47_CALL + "<tool_call>now</tool_call>",
     {"tools": TOOLS, "thinking": True}),
    ("malformed", "<tool_call>get_weather\n<arg_value>x</arg_value></tool_call> ok",
     {"tools": TOOLS}),
    ("truncated", "<think>a</think>" + GLM45_CALL[:40], {"tools": TOOLS}),
)


class ChatOutputTest(parameterized.TestCase):

  @parameterized.named_parameters(*REPLIES)
  def test_streaming_in_any_pieces_merges_into_the_whole_message(self, text, kwargs):
    kwargs = {"thinking": False, "tools": None, **kwargs}
    message = whole_message(text, ChatOutput(**kwargs))
    expected = {"content": message["content"] or "",
                "reasoning_content": message.get("reasoning_content", ""),
                "tool_calls": [(c["function"]["name"], c["function"]["arguments"])
                               for c in message.get("tool_calls", ())]}
    splits = [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for pieces in splits:
      merged = streamed(text, pieces, **kwargs)
      calls = [(c["name"], c["arguments"]) for _, c in sorted(merged["tool_calls"].items())]
      self.assertEqual(calls, expected["tool_calls"], pieces)
      self.assertEqual(merged["reasoning_content"], expected["reasoning_content"], pieces)
      self.assertEqual(merged["content"].strip() if calls else merged["content"],
                       expected["content"], pieces)

  def test_whole_message_fields_and_finish_reason(self):
    output = ChatOutput(thinking=False, tools=TOOLS)
    message = whole_message("<think>Need weather.</think>\n" + GLM45_CALL, output)
    self.assertEqual(message["reasoning_content"], "Need weather.")
    self.assertIsNone(message["content"])
    self.assertEqual(json.loads(message["tool_calls"][0]["function"]["arguments"]),
                     {"city": "Paris", "days": 3})
    self.assertEqual(output.finish_reason("stop"), "tool_calls")
    self.assertEqual(output.finish_reason("length"), "length")
    plain = ChatOutput(thinking=False, tools=TOOLS)
    self.assertEqual(whole_message("No tools needed.", plain),
                     {"role": "assistant", "content": "No tools needed."})
    self.assertEqual(plain.finish_reason("stop"), "stop")

  def test_forced_call_prefix_is_parsed_but_not_sent(self):
    prompt = "<|assistant|><think>"
    suffix = forced_call_prefix(prompt, "get_weather")
    self.assertEqual(suffix, "</think><tool_call>get_weather")
    self.assertEqual(forced_call_prefix("<|assistant|>", ""), "<tool_call>")
    self.assertEqual(forced_call_prefix("<|assistant|>", None), "")
    output = ChatOutput(thinking=True, tools=TOOLS, forced_prefix=suffix)
    message = whole_message("\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
                            "</tool_call>", output)
    self.assertEqual(message["tool_calls"][0]["function"]["name"], "get_weather")
    self.assertNotIn("reasoning_content", message)
    self.assertIsNone(message["content"])


if __name__ == "__main__":
  absltest.main()
