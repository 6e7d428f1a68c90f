"""Engine TokenLogprobs -> the OpenAI `logprobs` objects of chat and legacy completions.

The values are the target's raw distribution (log_softmax of its logits, before temperature,
top-k or top-p), as OpenAI and vLLM report by default; the engine computes the top
MAX_TOP_LOGPROBS alternatives of every committed token and a request gets its first n.
"""

from __future__ import annotations

from typing import Any, Sequence

from mtpjax.engine.scheduler import TokenLogprob
from mtpjax.gguf.tokenizer import GgufTokenizer


def _text(tokenizer: GgufTokenizer, token: int) -> str:
  return tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def chat_logprobs(entries: Sequence[TokenLogprob], tokenizer: GgufTokenizer,
                  top_n: int) -> dict[str, Any]:
  """`choices[].logprobs` of a chat completion (or of one streamed chunk)."""
  def item(token: int, logprob: float) -> dict[str, Any]:
    return {"token": _text(tokenizer, token), "logprob": logprob,
            "bytes": list(tokenizer.token_bytes(token))}
  return {"content": [{**item(e.token, e.logprob),
                       "top_logprobs": [item(t, lp) for t, lp in e.top[:top_n]]}
                      for e in entries], "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], tokenizer: GgufTokenizer, top_n: int,
                        offset: int) -> dict[str, Any]:
  """`choices[].logprobs` of a legacy completion; `offset`: text length before these tokens."""
  tokens = [_text(tokenizer, e.token) for e in entries]
  offsets = []
  for token in tokens:
    offsets.append(offset)
    offset += len(token)
  return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
          "top_logprobs": [{_text(tokenizer, t): lp for t, lp in e.top[:top_n]}
                           for e in entries],
          "text_offset": offsets}
