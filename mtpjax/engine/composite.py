"""Host drafting for one request: an n-gram proposer alone, or a composite's n-gram tail after
the native-MTP draft (docs/SPECULATIVE.md §11).

The n-gram tail is a cheap bet on top of a healthy MTP draft, so it starts short
(`initial_tokens`), grows by one after each fully accepted draft up to `max_tokens`, and after
a failed tail (the target took every MTP token but not the whole tail) drops back to
`initial_tokens` and sits out the next `tail_backoff_proposals` drafts. A rejection inside the
MTP part says nothing about the tail and changes nothing here. One `NgramDrafter` per request holds the proposer and, for a composite, its `TailExtension`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

from mtpjax.draft_window import MAX_DRAFT_TOKENS, DraftWindow
from mtpjax.engine.ngram import NgramProposer, proposer_for


@dataclasses.dataclass(frozen=True)
class CompositeDraft:
  """The tokens to verify: `mtp_count` native-MTP tokens, then `tail_count` n-gram tokens."""
  tokens: tuple[int, ...]
  mtp_count: int

  @property
  def tail_count(self) -> int:
    return len(self.tokens) - self.mtp_count


class TailExtension:
  """Per-request state of the n-gram tail, fed the accept count of each verified draft."""

  def __init__(self, *, max_tokens: int, initial_tokens: int, tail_backoff_proposals: int):
    if not 1 <= initial_tokens <= max_tokens or tail_backoff_proposals < 0:
      raise ValueError("TailExtension needs 1 <= initial_tokens <= max_tokens and "
                       f"tail_backoff_proposals >= 0; got {initial_tokens}, {max_tokens}, "
                       f"{tail_backoff_proposals}")
    self.max_tokens, self.initial_tokens = max_tokens, initial_tokens
    self.tail_backoff_proposals = tail_backoff_proposals
    self.tail_tokens = initial_tokens       # the tail budget of the next extended draft
    self.backoff_left = 0                   # drafts still to go without a tail

  @classmethod
  def from_settings(cls, settings) -> TailExtension:
    """From a resolution's `ExtensionSettings`."""
    return cls(max_tokens=settings.max_tokens, initial_tokens=settings.initial_tokens,
               tail_backoff_proposals=settings.tail_backoff_proposals)

  def budget(self, mtp_count: int) -> int:
    """How many n-gram tokens may follow `mtp_count` MTP tokens in this draft. Without MTP
    tokens (none drafted) the n-gram proposer drafts alone, up to `max_tokens`; a draft during
    back-off uses one back-off turn and gets no tail."""
    if mtp_count == 0:
      return self.max_tokens
    if self.backoff_left > 0:
      self.backoff_left -= 1
      return 0
    return self.tail_tokens

  def observe(self, draft: CompositeDraft, accepted: int) -> None:
    """`accepted`: how many of `draft.tokens` the target accepted, in order."""
    if draft.mtp_count == 0 or draft.tail_count == 0:
      return
    if accepted >= len(draft.tokens):
      self.tail_tokens = min(self.tail_tokens + 1, self.max_tokens)
    elif accepted >= draft.mtp_count:
      self.tail_tokens = self.initial_tokens
      self.backoff_left = self.tail_backoff_proposals


def compose_draft(mtp_tokens: Sequence[int], proposer: NgramProposer, extension: TailExtension,
                  window: int) -> CompositeDraft:
  """The MTP draft (cut to `window`), extended by the n-gram proposer within the budget and the
  window. The proposer looks past the MTP tokens without indexing them."""
  mtp = tuple(int(token) for token in mtp_tokens[:window])
  room = min(window - len(mtp), extension.budget(len(mtp)))
  tail = proposer.propose(room, prefix=mtp) if room > 0 else []
  return CompositeDraft(tokens=mtp + tuple(tail), mtp_count=len(mtp))


class NgramDrafter:
  """What the draft step calls for one request: `draft` before a verify pass, `verified` after
  it, `commit` for tokens committed without a draft (the prompt, a step that drafted nothing)."""

  def __init__(self, ngram_settings, extension_settings=None, prompt: Sequence[int] = ()):
    self.proposer = proposer_for(ngram_settings)
    self.extension = (None if extension_settings is None
                      else TailExtension.from_settings(extension_settings))
    self.proposer.commit(prompt)

  def draft(self, window: int, mtp_tokens: Sequence[int] = ()) -> CompositeDraft:
    """Up to `window` tokens: the MTP tokens (composite only) and the n-gram tokens after them."""
    if self.extension is None:
      return CompositeDraft(tokens=tuple(self.proposer.propose(window)), mtp_count=0)
    return compose_draft(mtp_tokens, self.proposer, self.extension, window)

  def verified(self, draft: CompositeDraft, accepted: int, committed: Sequence[int]) -> None:
    """The target accepted `accepted` draft tokens and committed `committed` (the accepted ones
    and its own next token)."""
    if self.extension is not None:
      self.extension.observe(draft, accepted)
    self.proposer.commit(committed)

  def commit(self, tokens: Sequence[int]) -> None:
    self.proposer.commit(tokens)


@dataclasses.dataclass(frozen=True)
class HostDrafting:
  """What a resolved strategy asks of an engine and its scheduler: the deepest window a step
  verifies (`EngineConfig.draft_tokens`) and, where an n-gram proposer drafts (alone or as a
  composite's tail), one `NgramDrafter` per request (`drafter(prompt)`)."""
  draft_tokens: int
  drafter: Callable[[Sequence[int]], NgramDrafter] | None = None

  @property
  def host(self) -> bool:
    """Whether the host proposes drafts (`EngineConfig.host_drafts`)."""
    return self.drafter is not None

  @classmethod
  def of(cls, resolution, window: DraftWindow) -> HostDrafting:
    """From a `SpeculativeResolution` and native MTP's `window` (its resolved one, or the one a
    caller chose): native MTP drafts up to window.max, an n-gram proposer alone up to its
    `max_proposal_tokens` (and the strategy's `window_policy.max_window`), a composite's tail
    up to `extension.max_tokens` after the MTP tokens; all within MAX_DRAFT_TOKENS."""
    ngram, extension = resolution.ngram, resolution.extension   # no extension without MTP
    if ngram is None:
      return cls(window.max if resolution.native_mtp else 1)
    if extension is not None:
      deepest = window.max + extension.max_tokens
    else:
      policy = resolution.window_policy or {}
      deepest = min(ngram.max_proposal_tokens, policy.get("max_window") or MAX_DRAFT_TOKENS)
    return cls(min(deepest, MAX_DRAFT_TOKENS),
               functools.partial(NgramDrafter, ngram, extension))
