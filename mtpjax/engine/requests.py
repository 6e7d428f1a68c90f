"""What a request is and gets back (`Request`, `Result`, `TokenLogprob`), and the scheduler's
record of one while it holds a slot (`LiveRequest`): its tokens so far, counters and drafting
state.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import numpy as np

from mtpjax.engine.composite import CompositeDraft, NgramDrafter
from mtpjax.engine.sampling import SamplerParams
from mtpjax.telemetry import MtpStats


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
  """One committed token's log-probability under the target's raw distribution, and the
  engine's top-n alternatives (`EngineConfig.logprobs`), most likely first."""
  token: int
  logprob: float
  top: tuple[tuple[int, float], ...]


@dataclasses.dataclass
class Request:
  prompt: np.ndarray
  max_new_tokens: int
  sampler: SamplerParams = SamplerParams()
  stop_ids: frozenset[int] = frozenset()
  on_tokens: Callable[[list[int]], None] | None = None   # called with each batch of new tokens
  cancelled: Callable[[], bool] | None = None            # polled every step (client gone)
  logprobs: bool = False                                 # needs an engine with logprobs > 0
  # With `logprobs`: called with each batch's TokenLogprobs just before `on_tokens`.
  on_logprobs: Callable[[list[TokenLogprob]], None] | None = None


class RequestFailed(Exception):
  """Admitting one request raised (its prefill); the decode state and other slots are as
  before, so only this request fails."""

  def __init__(self, request: Request, error: Exception):
    super().__init__(f"{type(error).__name__}: {error}")
    self.request = request
    self.error = error


@dataclasses.dataclass
class Result:
  tokens: list[int]
  finish_reason: str               # "stop" | "length" | "cancelled"
  stats: MtpStats
  prompt_tokens: int
  time_to_first_token_s: float
  total_time_s: float
  logprobs: list[TokenLogprob] | None = None      # one per token, when the request asked
  cached_tokens: int = 0           # prompt tokens taken from the prefix cache, not prefilled


@dataclasses.dataclass
class LiveRequest:
  request: Request
  done: Callable[[Result], None]
  started: float
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
  counts: dict = dataclasses.field(default_factory=lambda: collections.Counter())
  first_token_s: float = 0.0
  cached_tokens: int = 0
  recent: collections.deque = dataclasses.field(default_factory=collections.deque)
  paused_steps: int = 0           # steps left without drafting
  backoff: int = 1                # the next pause is cooldown x backoff steps
  window: int = 1                 # native MTP drafts this slot asks for (DraftWindow bounds)
  ngram: NgramDrafter | None = None       # the request's host drafting (n-gram, composite)
  mtp_chain: list = dataclasses.field(default_factory=list)   # its next MTP chain (composite)
  proposed: CompositeDraft | None = None  # the host draft this step verifies
  # Per draft position: windows that included it, and how often it was accepted.
  verified_at: list = dataclasses.field(default_factory=list)
  accepted_at: list = dataclasses.field(default_factory=list)
  detached: bool = False          # it never drafts again (`Engine.detach`)
  launched: int = 0               # steps in flight over it, a token each at least

  @property
  def drafting(self) -> bool:
    return self.paused_steps == 0

  def tokens_left(self, max_len: int) -> int:
    """The most tokens it can still take: its token budget or the context, whichever ends
    first."""
    return min(self.request.max_new_tokens - len(self.tokens),
               max_len - len(self.request.prompt) - len(self.tokens))


def token_logprobs(request: Request, rows, slot: int,
                    tokens: list[int]) -> list[TokenLogprob] | None:
  """A slot's committed `tokens` (one per row) with the logprobs a prefill or step returned
  (`DecodeEngine`); None when the request asked for none."""
  if not request.logprobs:
    return None
  chosen, top_ids, top_lps = (a[slot].tolist() for a in rows)
  return [TokenLogprob(token, chosen[r], tuple(zip(top_ids[r], top_lps[r])))
          for r, token in enumerate(tokens)]
