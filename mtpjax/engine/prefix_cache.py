"""Prefix caching: a prompt's prefilled pages at a chunk boundary, shared by later prompts
that start with the same tokens (a shared system prompt, the earlier turns of a chat).

A key page is the largest prefill bucket's worth of tokens, so a cached prefix ends where a
chunk ends, on a KV page boundary: a sequence that starts with an entry's pages only ever
writes the pages after them, so they are shared, never copied. Each entry is keyed by a hash
chain over the prompt's key pages (page i's key hashes page i's tokens and page i - 1's key),
so one key names a whole prefix. An entry holds a reference on its KV pages (`page_pool.py`),
which hold the NextN block's rows of the prefix too, and, on the last stage, the trunk hidden
h_{n-1} the next chunk's MTP rows start from, so native MTP continues from a reused prefix
exactly as from its own prefill. A prompt prefilled without the NextN block (its request
will never draft, `Engine.start_prefill`) caches a prefix without those rows: only prefills
that skip them too reuse it, and a prefill that computes them replaces it. Past `capacity` entries, the least recently used goes; the pool reclaims entries no
sequence uses, least recently used first, when a reservation needs their pages.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from mtpjax.engine.page_pool import PagePool


class PrefixCache:

  def __init__(self, page: int, capacity: int, pool: PagePool):
    self.page = page
    self.capacity = capacity
    self.pool = pool
    pool.reclaim = self._reclaim
    self._entries: collections.OrderedDict[bytes, tuple[list[int], object]] = (
        collections.OrderedDict())
    self._without_mtp: set[bytes] = set()   # entries whose pages hold no NextN rows

  def page_keys(self, prompt: np.ndarray) -> list[tuple[int, bytes]]:
    """(tokens, key) of each whole-page prefix that leaves at least one token of the prompt
    to prefill (the last chunk samples from the prompt's last token)."""
    keys, chain = [], b""
    for end in range(self.page, len(prompt), self.page):
      chain = hashlib.sha256(chain + prompt[end - self.page:end].astype("<i4").tobytes()).digest()
      keys.append((end, chain))
    return keys

  def _usable(self, key: bytes, mtp_rows: bool) -> bool:
    return key in self._entries and not (mtp_rows and key in self._without_mtp)

  def longest(self, keys: list[tuple[int, bytes]], mtp_rows: bool = True
              ) -> tuple[int, tuple[list[int], object]]:
    """(tokens, (page ids, h_{n-1})) of the longest cached prefix among a prompt's `page_keys`
    (with its NextN rows, unless `mtp_rows` is False); (0, None) when none is."""
    for end, key in reversed(keys):
      if self._usable(key, mtp_rows):
        self._entries.move_to_end(key)
        return end, self._entries[key]
    return 0, None

  def to_save(self, keys: list[tuple[int, bytes]], cached: int, mtp_rows: bool = True
              ) -> tuple[int, bytes] | None:
    """(tokens, key) of the prefix a prefill should cache on its way, from its prompt's
    `page_keys`: its longest whole-page prefix, unless that is cached already as this prefill
    would cache it (None then). A long prompt's last full chunk ends there
    (`EngineConfig.prefill_chunks`)."""
    if not keys or keys[-1][0] <= cached or self._usable(keys[-1][1], mtp_rows):
      return None
    return keys[-1]

  def store(self, key: bytes, pages: list[int], before: object, mtp_rows: bool = True) -> None:
    """Keep a prefix: its KV pages (one more reference each) and h_{n-1}; `mtp_rows`: whether
    the pages hold its NextN rows. It replaces an entry of the same key."""
    self.pool.retain(pages)
    if key in self._entries:
      self._forget(key)
    if not mtp_rows:
      self._without_mtp.add(key)
    self._entries[key] = (list(pages), before)
    self._entries.move_to_end(key)
    while len(self._entries) > self.capacity:
      self._forget(next(iter(self._entries)))

  def _forget(self, key: bytes) -> None:
    self.pool.drop(self._entries.pop(key)[0])
    self._without_mtp.discard(key)

  def _reclaim(self) -> bool:
    """Drop the least recently used entry that alone holds one of its pages (dropping one
    whose pages sequences still use frees nothing); False when there is none."""
    for key, (pages, _) in self._entries.items():
      if any(self.pool.refs[p] == 1 for p in pages):
        self._forget(key)
        return True
    return False
