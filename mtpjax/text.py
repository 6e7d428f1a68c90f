"""Text in, text out: a loaded model's own tokenizer and chat template around `generate`.

`mtpjax.load(...)` gives token ids in and out; `model.tokenizer`, `model.generate_text` and
`model.chat` (thin methods over this module) spare every caller from rebuilding the tokenizer
from the GGUF metadata and choosing the stop tokens by hand.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from mtpjax.engine.scheduler import Result, TokenLogprob
from mtpjax.gguf.template_budget import BudgetedChatTemplate, TemplateBudget
from mtpjax.gguf.tokenizer import GgufTokenizer
from mtpjax.telemetry import MtpStats

Messages = Sequence[Mapping[str, Any]]


class Tokenizer(GgufTokenizer):
  """A model's tokenizer (encode, decode) with its chat template, both from GGUF metadata.

  The package's template is untrusted code: it compiles and renders under the server's
  default budget, so a hostile one raises a typed error instead of hanging the caller.
  """

  chat_template: BudgetedChatTemplate

  @classmethod
  def from_metadata(cls, metadata: Mapping[str, Any], *, path: str | None = None) -> Tokenizer:
    tokenizer = super().from_metadata(metadata, path=path)
    tokenizer.chat_template = BudgetedChatTemplate.from_metadata(metadata, path=path,
                                                                 budget=TemplateBudget())
    return tokenizer

  def apply_chat_template(self, messages: Messages, *, add_generation_prompt: bool = True,
                          tools: Sequence[Mapping[str, Any]] | None = None,
                          **template_vars: Any) -> str:
    """The prompt text the model's template renders for `messages` (and `tools`)."""
    return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools, **template_vars)


@dataclasses.dataclass
class TextResult:
  """What `generate` returns, plus the text of the tokens (stop tokens and control tokens
  left out) and the prompt it decoded."""
  text: str
  prompt: str
  tokens: list[int]
  finish_reason: str
  stats: MtpStats
  prompt_tokens: int
  time_to_first_token_s: float
  total_time_s: float
  logprobs: list[TokenLogprob] | None = None


def _text_result(tokenizer: Tokenizer, prompt: str, result: Result) -> TextResult:
  shown = [t for t in result.tokens if t not in tokenizer.stop_ids]
  return TextResult(text=tokenizer.decode(shown, skip_special=True), prompt=prompt,
                    tokens=result.tokens, finish_reason=result.finish_reason,
                    stats=result.stats, prompt_tokens=result.prompt_tokens,
                    time_to_first_token_s=result.time_to_first_token_s,
                    total_time_s=result.total_time_s, logprobs=result.logprobs)


def generate_text(model, prompt: str | Messages, *, max_new_tokens: int = 64,
                  **generate_kwargs: Any) -> TextResult:
  """Continue `prompt` (text; stops at eos) or answer chat `messages` (see `chat`).

  `generate_kwargs` are `Model.generate`'s: temperature, top_k, top_p, seed, speculative, ...
  """
  if not isinstance(prompt, str):
    return chat(model, prompt, max_new_tokens=max_new_tokens, **generate_kwargs)
  tokenizer = model.tokenizer
  eos = tokenizer.special_ids.get("eos")
  stop_ids = generate_kwargs.pop("stop_ids", () if eos is None else (eos,))
  result = model.generate(tokenizer.encode(prompt), max_new_tokens=max_new_tokens,
                          stop_ids=stop_ids, **generate_kwargs)
  return _text_result(tokenizer, prompt, result)


def chat(model, messages: Messages, *, max_new_tokens: int = 64,
         tools: Sequence[Mapping[str, Any]] | None = None,
         chat_template_kwargs: Mapping[str, Any] | None = None,
         **generate_kwargs: Any) -> TextResult:
  """The assistant's reply to `messages`, rendered by the model's own chat template; stops at
  the end-of-turn tokens (eos, eot, eom). `chat_template_kwargs` reach the template (e.g.
  `{"enable_thinking": False}` for GLM). Control-token text inside messages stays text
  (`gguf/control_tokens`)."""
  tokenizer = model.tokenizer
  marked, request = tokenizer.control.render(tokenizer.chat_template, messages, tools=tools,
                                             template_vars=chat_template_kwargs)
  generate_kwargs.setdefault("stop_ids", tuple(tokenizer.stop_ids))
  result = model.generate(request.encode(marked), max_new_tokens=max_new_tokens,
                          **generate_kwargs)
  return _text_result(tokenizer, request.plain(marked), result)
