"""Prompt preparation (chat-template rendering, tokenization) off the event loop.

Both can take long on hostile input (a huge message, a template that loops), and the event
loop must keep answering /health and streaming tokens meanwhile. They run on a small thread
pool; tokenization goes through `encode_batch`, which releases the GIL while the Rust tokenizer
works (plain `encode` holds it: a 1 MB prompt stalled every other thread for ~0.6 s), and
templates render under their budget (`gguf/template_budget`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Mapping, Sequence

from mtpjax.gguf.tokenizer import GgufTokenizer
from mtpjax.gguf.template_budget import BudgetedChatTemplate


class PromptBuilder:
  """Turns prompt text or chat messages into token ids on `workers` threads."""

  def __init__(self, tokenizer: GgufTokenizer, template: BudgetedChatTemplate, workers: int = 2):
    self.tokenizer = tokenizer
    self.template = template
    self._pool = concurrent.futures.ThreadPoolExecutor(workers,
                                                       thread_name_prefix="mtpjax-prompt")

  def _encode(self, text: str) -> list[int]:
    """`GgufTokenizer.encode`, without holding the GIL."""
    return self.tokenizer.hf_tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

  async def encode(self, text: str) -> list[int]:
    return await asyncio.get_running_loop().run_in_executor(self._pool, self._encode, text)

  async def render(self, messages: Sequence[Mapping[str, Any]], template_vars: Mapping[str, Any],
                   tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The conversation rendered for generation (with `tools` when given); raises the
    template's ConversionError."""
    render = lambda: self.template.render(messages, add_generation_prompt=True, tools=tools,
                                          **template_vars)
    return await asyncio.get_running_loop().run_in_executor(self._pool, render)

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)
