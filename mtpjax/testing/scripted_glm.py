"""A tiny GLM-4.x GGUF whose greedy replies are written in advance: GLM thinking and tool calls.

For end-to-end tests of the chat API (reasoning_content, tool calls, tool results sent back)
through the real engine, server and `openai` client, without a trained model. The weights are
built, not trained:

- the trunk is one dense layer whose FFN writes nothing, so the hidden state at a position is
  its own token's embedding (one basis vector per scripted token), plus one signal;
- the attention's queries are zero, so it averages the values of all earlier positions, and
  only `<|observation|>` (GLM's tool-result turn) has a value: the signal is on exactly when a
  tool result is in the context;
- the output head maps each scripted token to its successor in `BEFORE_TOOL_RESULT`, and with
  the signal on, more strongly to its successor in `AFTER_TOOL_RESULT`.

So greedy decoding answers a first request with thinking and a GLM tool call, and the request
that carries the tool result with thinking and a final answer. The chat template renders tools,
tool calls and tool results in GLM-4.7's layout. The NextN block keeps the random weights of
`tiny_glm`: its drafts are verified and mostly rejected, which changes no token.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf.constants import TokenType

from mtpjax.testing import tiny_glm

# Tool-call tags are control tokens here (as in GLM's HF tokenizer); thinking tags and the
# scripted words are user-defined tokens, matched whole.
CONTROL_TAGS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                "</arg_value>")
WORDS = ("<think>", "</think>", "Checking_the_weather.", "get_weather", "city", "Paris",
         "The_tool_answered.", "It_rains_in_Paris.")

BEFORE_TOOL_RESULT = ("<|assistant|>", "<think>", "Checking_the_weather.", "</think>",
                      "<tool_call>", "get_weather", "<arg_key>", "city", "</arg_key>",
                      "<arg_value>", "Paris", "</arg_value>", "</tool_call>", "<|observation|>")
AFTER_TOOL_RESULT = ("<|assistant|>", "<think>", "The_tool_answered.", "</think>",
                     "It_rains_in_Paris.", "<|endoftext|>")

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% if tools %}<|system|>\n# Tools\n\nYou may call functions. Their signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call one as <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>"
    "</tool_call>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{% elif m.role == 'system' %}<|system|>\n{{ m.content }}"
    "{% elif m.role == 'tool' %}<|observation|>\n<tool_response>{{ m.content }}</tool_response>"
    "{% elif m.role == 'assistant' %}<|assistant|><think>{{ m.reasoning_content or '' }}</think>"
    "{{ m.content or '' }}"
    "{% for call in m.tool_calls or [] %}<tool_call>{{ call.function.name }}"
    "{% for k, v in call.function.arguments.items() %}<arg_key>{{ k }}</arg_key>"
    "<arg_value>{{ v if v is string else v | tojson }}</arg_value>{% endfor %}</tool_call>"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}")

_SIGNAL_GAIN = 1000.0


def _tokenizer_metadata() -> dict:
  meta = tiny_glm.tiny_tokenizer_metadata()
  meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], *CONTROL_TAGS, *WORDS]
  meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"],
                                       *[int(TokenType.CONTROL)] * len(CONTROL_TAGS),
                                       *[int(TokenType.USER_DEFINED)] * len(WORDS)]
  meta["tokenizer.chat_template"] = CHAT_TEMPLATE
  return meta


def _scripted_tensors(spec: tiny_glm.TinyGlmSpec, ids: dict[str, int]) -> dict[str, np.ndarray]:
  t = tiny_glm.build_tiny_glm_tensors(spec)
  D, signal = spec.hidden, spec.hidden - 1
  before = [ids[s] for s in BEFORE_TOOL_RESULT]
  after = [ids[s] for s in AFTER_TOOL_RESULT]
  scripted = sorted(set(before[:-1] + after[:-1]))
  if len(scripted) >= signal:
    raise ValueError("more scripted tokens than hidden dimensions")
  dim = {token: i for i, token in enumerate(scripted)}
  embed = np.random.default_rng(0).standard_normal(t["token_embd.weight"].shape) * 0.1
  embed[:, signal] = 0.0
  for token, i in dim.items():
    embed[token] = np.eye(D)[i]
  embed[ids["<|observation|>"]] = np.eye(D)[signal]
  head = np.zeros_like(t["output.weight"])
  for chain, weight in ((before, 1.0), (after, 0.5)):
    for current, following in zip(chain, chain[1:]):
      head[following, dim[current]] += weight
  head[after[1:], signal] = 1.0       # with a tool result in context, the second script wins
  t["token_embd.weight"] = embed.astype(np.float32)
  t["output.weight"] = head
  for name in ("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias", "attn_v.bias",
               "ffn_down.weight"):
    t[f"blk.0.{name}"] = np.zeros_like(t[f"blk.0.{name}"])
  value = np.zeros_like(t["blk.0.attn_v.weight"])
  value[0, signal] = 1.0
  output = np.zeros_like(t["blk.0.attn_output.weight"])
  output[signal, 0] = _SIGNAL_GAIN
  t["blk.0.attn_v.weight"], t["blk.0.attn_output.weight"] = value, output
  for name in ("blk.0.attn_norm.weight", "output_norm.weight"):
    t[name] = np.ones_like(t[name])
  return t


def write_scripted_glm_gguf(path: str | os.PathLike) -> Path:
  """Writes the scripted model as one F32 GGUF at `path` and returns it."""
  meta = _tokenizer_metadata()
  tokens = meta["tokenizer.ggml.tokens"]
  ids = {token: i for i, token in enumerate(tokens)}
  spec = tiny_glm.TinyGlmSpec(vocab_size=len(tokens), n_trunk_layers=1, leading_dense=1)
  tensors = _scripted_tensors(spec, ids)
  written, = tiny_glm.write_glm_gguf(path, spec, tensors, meta, model_name="scripted-glm")
  return written
