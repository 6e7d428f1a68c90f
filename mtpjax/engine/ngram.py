"""Model-free draft proposers over one request's own tokens: `ngram-simple`, `ngram-cache` and
`ngram-suffix` (docs/SPECULATIVE.md §11).

Each proposer mirrors the request's committed tokens (prompt, then every token the target
committed) in an index updated in O(new tokens): a rejected draft is never committed, so the
index only grows. `propose(limit, prefix)` drafts up to `limit` tokens to follow the committed
tokens plus `prefix` (a composite's native-MTP draft, read-only: it is never indexed). Pure
Python on the host: a lookup is a few dict probes, far cheaper than a device round trip.
"""

from __future__ import annotations

import abc
from typing import Iterable, Sequence

from mtpjax.package import generation_rules

SUFFIX_MAX_SEED = 8               # the suffix index keys on at most this many tokens
SUFFIX_MAX_CANDIDATES = 64        # seed occurrences a suffix lookup examines, newest first


class NgramProposer(abc.ABC):
  """Committed tokens of one request, and the lookups a draft step makes on them."""

  def __init__(self, ngram_min: int, ngram_max: int, max_proposal_tokens: int):
    if not 1 <= ngram_min <= ngram_max or max_proposal_tokens < 1:
      raise ValueError(f"{type(self).__name__} needs 1 <= ngram_min <= ngram_max and "
                       f"max_proposal_tokens >= 1; got {ngram_min}, {ngram_max}, "
                       f"{max_proposal_tokens}")
    self.ngram_min, self.ngram_max = ngram_min, ngram_max
    self.max_proposal_tokens = max_proposal_tokens
    self.tokens: list[int] = []

  def commit(self, tokens: Iterable[int]) -> None:
    """Appends tokens the target committed; indexes the n-grams that now have a follower."""
    for token in tokens:
      self.tokens.append(int(token))
      if len(self.tokens) > 1:
        self._index_follower(len(self.tokens) - 1)

  def propose(self, limit: int, prefix: Sequence[int] = ()) -> list[int]:
    """Up to min(limit, max_proposal_tokens) tokens to follow `tokens + prefix`; [] if none."""
    limit = min(int(limit), self.max_proposal_tokens)
    if limit <= 0:
      return []
    return self._propose(limit, [int(token) for token in prefix])

  def _tail(self, prefix: list[int], count: int) -> list[int]:
    """The last `count` tokens of the query `tokens + prefix`."""
    if len(prefix) >= count:
      return prefix[len(prefix) - count:]
    return self.tokens[max(0, len(self.tokens) - (count - len(prefix))):] + prefix

  @abc.abstractmethod
  def _index_follower(self, position: int) -> None:
    """Indexes the n-grams ending at `position - 1`, whose follower is `tokens[position]`."""

  @abc.abstractmethod
  def _propose(self, limit: int, prefix: list[int]) -> list[int]:
    """The draft for `tokens + prefix`, `limit` >= 1 already capped."""


class SimpleNgramProposer(NgramProposer):
  """`ngram-simple`: the last n tokens (n from ngram_max down to ngram_min) matched against their
  most recent earlier occurrence; proposes the tokens that followed it.

  The table maps each n-gram to the end of its latest occurrence that has a committed follower,
  so a lookup is one dict probe per n.
  """

  def __init__(self, ngram_min: int, ngram_max: int, max_proposal_tokens: int):
    super().__init__(ngram_min, ngram_max, max_proposal_tokens)
    self._latest_end: dict[tuple[int, ...], int] = {}

  def _index_follower(self, position: int) -> None:
    end = position - 1
    for n in range(self.ngram_min, min(self.ngram_max, end + 1) + 1):
      self._latest_end[tuple(self.tokens[end - n + 1:end + 1])] = end

  def _propose(self, limit: int, prefix: list[int]) -> list[int]:
    tail = self._tail(prefix, self.ngram_max)
    for n in range(min(self.ngram_max, len(tail)), self.ngram_min - 1, -1):
      end = self._latest_end.get(tuple(tail[len(tail) - n:]))
      if end is not None:
        return self.tokens[end + 1:end + 1 + limit]
    return []


class _Followers:
  """Counts of the tokens that followed one n-gram; `best` is the most frequent, ties going to
  the most recently seen (counts only grow, so the newest token to reach the top count wins)."""
  __slots__ = ("counts", "best", "best_count")

  def __init__(self):
    self.counts: dict[int, int] = {}
    self.best, self.best_count = -1, 0

  def add(self, token: int) -> None:
    count = self.counts.get(token, 0) + 1
    self.counts[token] = count
    if count >= self.best_count:
      self.best, self.best_count = token, count


class CacheNgramProposer(NgramProposer):
  """`ngram-cache`: a per-request table n-gram -> follower counts (n <= 4, as llama.cpp's n-gram
  cache). Drafting walks token by token: the longest n-gram of the running context that the
  table knows gives its most frequent follower; the walk stops at the first miss."""

  def __init__(self, ngram_min: int, ngram_max: int, max_proposal_tokens: int):
    if ngram_max > generation_rules.NGRAM_CACHE_MAX_NGRAM:
      raise ValueError(f"ngram-cache matches at most {generation_rules.NGRAM_CACHE_MAX_NGRAM} "
                       f"tokens; got ngram_max {ngram_max}")
    super().__init__(ngram_min, ngram_max, max_proposal_tokens)
    self._followers: dict[tuple[int, ...], _Followers] = {}

  def _index_follower(self, position: int) -> None:
    end, token = position - 1, self.tokens[position]
    for n in range(self.ngram_min, min(self.ngram_max, end + 1) + 1):
      key = tuple(self.tokens[end - n + 1:end + 1])
      followers = self._followers.get(key)
      if followers is None:
        followers = self._followers[key] = _Followers()
      followers.add(token)

  def _propose(self, limit: int, prefix: list[int]) -> list[int]:
    context = self._tail(prefix, self.ngram_max)
    draft: list[int] = []
    while len(draft) < limit:
      followers = None
      for n in range(min(self.ngram_max, len(context)), self.ngram_min - 1, -1):
        followers = self._followers.get(tuple(context[len(context) - n:]))
        if followers is not None:
          break
      if followers is None:
        break
      draft.append(followers.best)
      context.append(followers.best)
      if len(context) > self.ngram_max:
        del context[0]
    return draft


class SuffixNgramProposer(NgramProposer):
  """`ngram-suffix`: the longest earlier match of the query's suffix (ngram_min <= length <=
  ngram_max, 3 <= ngram_min, ngram_max <= 64), the most recent among equals; a match of m tokens
  proposes at most max(2m, 4) of the tokens that followed it.

  Occurrences are indexed by their last min(ngram_min, 8) tokens; a lookup extends each
  candidate backwards, newest first, and stops at a full-length match or after
  `max_candidates` candidates (None: all), which bounds its cost on very repetitive text.
  """

  def __init__(self, ngram_min: int, ngram_max: int, max_proposal_tokens: int,
               max_candidates: int | None = SUFFIX_MAX_CANDIDATES):
    if not (generation_rules.NGRAM_SUFFIX_MIN_NGRAM <= ngram_min
            and ngram_max <= generation_rules.NGRAM_SUFFIX_MAX_NGRAM):
      raise ValueError(f"ngram-suffix needs {generation_rules.NGRAM_SUFFIX_MIN_NGRAM} <= "
                       f"ngram_min <= ngram_max <= {generation_rules.NGRAM_SUFFIX_MAX_NGRAM}; "
                       f"got {ngram_min}..{ngram_max}")
    super().__init__(ngram_min, ngram_max, max_proposal_tokens)
    self.max_candidates = max_candidates
    self._seed = min(ngram_min, SUFFIX_MAX_SEED)
    self._ends: dict[tuple[int, ...], list[int]] = {}

  def _index_follower(self, position: int) -> None:
    end = position - 1
    if end + 1 >= self._seed:
      self._ends.setdefault(tuple(self.tokens[end - self._seed + 1:end + 1]), []).append(end)

  def _propose(self, limit: int, prefix: list[int]) -> list[int]:
    query = self._tail(prefix, self.ngram_max)
    if len(query) < self._seed:
      return []
    ends = self._ends.get(tuple(query[len(query) - self._seed:]), ())
    best_length = best_end = 0
    for examined, end in enumerate(reversed(ends), start=1):
      length = self._seed
      while (length < self.ngram_max and length <= end and length < len(query)
             and self.tokens[end - length] == query[len(query) - 1 - length]):
        length += 1
      if length > best_length:
        best_length, best_end = length, end
      if best_length >= self.ngram_max or examined == self.max_candidates:
        break
    if best_length < self.ngram_min:
      return []
    count = min(limit, max(2 * best_length, 4))
    return self.tokens[best_end + 1:best_end + 1 + count]


PROPOSERS = {
    generation_rules.NGRAM_SIMPLE_TYPE: SimpleNgramProposer,
    generation_rules.NGRAM_CACHE_TYPE: CacheNgramProposer,
    generation_rules.NGRAM_SUFFIX_TYPE: SuffixNgramProposer,
}


def proposer_for(settings) -> NgramProposer:
  """A fresh proposer for one request, from a resolution's `NgramSettings`."""
  return PROPOSERS[settings.type](settings.ngram_min, settings.ngram_max,
                                  settings.max_proposal_tokens)
