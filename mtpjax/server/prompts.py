"""Prompt preparation (chat-template rendering, tokenization) off the event loop.

Both can take long on hostile input (a huge message, a template that loops), and the event
loop must keep answering /health and streaming tokens meanwhile. They run on small thread
pools, requests up to 64 KiB on threads of their own so that large prompts cannot hold up short
ones. A prompt is tokenized with a bound on the work (`gguf/prompt_tokens`) through
`encode_batch`, which releases the GIL while the Rust tokenizer works (plain `encode` holds it:
a 1 MB prompt stalled every other thread for ~0.6 s); templates render under their budget in
child processes killed at its end (`gguf/template_process`); and a chat's request text never
becomes control tokens (`gguf/control_tokens`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Mapping, Sequence

from mtpjax.gguf.control_tokens import RequestText
from mtpjax.gguf.tokenizer import GgufTokenizer
from mtpjax.gguf.template_budget import BudgetedChatTemplate
from mtpjax.gguf.template_process import TemplateProcesses

SMALL_REQUEST_BYTES = 64 * 2**10


class PromptBuilder:
  """Turns prompt text or chat messages into token ids on `workers` threads for large requests
  and as many for small ones."""

  def __init__(self, tokenizer: GgufTokenizer, template: BudgetedChatTemplate, workers: int = 2):
    self.tokenizer = tokenizer
    self.template = TemplateProcesses(template, 2 * workers)     # one child per thread
    self._large = concurrent.futures.ThreadPoolExecutor(workers,
                                                        thread_name_prefix="mtpjax-prompt")
    self._small = concurrent.futures.ThreadPoolExecutor(workers,
                                                        thread_name_prefix="mtpjax-prompt-small")

  def _run(self, size: int, fn, *args):
    """`fn(*args)` on a prompt thread: requests of up to SMALL_REQUEST_BYTES have their own
    threads, so a short chat never queues behind large prompts."""
    pool = self._small if size <= SMALL_REQUEST_BYTES else self._large
    return asyncio.get_running_loop().run_in_executor(pool, fn, *args)

  async def encode(self, text: str, request: RequestText | None = None, *,
                   limit: int | None = None, size: int) -> list[int]:
    """Ids of `text`: a completions prompt (control-token text matched), or a rendered chat
    with its `request`'s text kept plain; PromptTooLong past `limit` ids, found early. `size`:
    the request's body bytes."""
    encode = self.tokenizer.control.encode if request is None else request.encode
    return await self._run(size, encode, text, limit)

  async def render(self, messages: Sequence[Mapping[str, Any]], template_vars: Mapping[str, Any],
                   tools: Sequence[Mapping[str, Any]] | None = None, also: Sequence[Any] = (),
                   *, size: int) -> tuple[str, RequestText]:
    """The conversation rendered for generation (with `tools` when given), the request's text
    marked (`gguf/control_tokens`; `also`: more request strings to mark with it); raises the
    template's ConversionError."""
    render = lambda: self.tokenizer.control.render(self.template, messages, tools=tools,
                                                   template_vars=template_vars, also=also)
    return await self._run(size, render)

  def close(self) -> None:
    for pool in (self._small, self._large):
      pool.shutdown(wait=False, cancel_futures=True)
    self.template.close()
