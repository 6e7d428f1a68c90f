"""Prefix caching: a prompt's prefilled state at a page boundary, reused by later prompts that
start with the same pages (a shared system prompt, the earlier turns of a chat).

A page is the largest prefill bucket's worth of tokens, so a cached prefix ends where a chunk
ends. Each entry is keyed by a hash chain over the prompt's pages (page i's key hashes page i's
tokens and page i - 1's key), so one key names a whole prefix. An entry holds one slot's trunk
caches and, on the last stage, the carry into the next chunk (h_{n-1} and the NextN block's
KV), so native MTP continues from a reused prefix exactly as from its own prefill. Entries are
evicted least recently used past `capacity`.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np


class PrefixCache:

  def __init__(self, page: int, capacity: int):
    self.page = page
    self.capacity = capacity
    self._entries: collections.OrderedDict[bytes, object] = collections.OrderedDict()

  def page_keys(self, prompt: np.ndarray) -> list[tuple[int, bytes]]:
    """(tokens, key) of each whole-page prefix that leaves at least one token of the prompt
    to prefill (the last chunk samples from the prompt's last token)."""
    keys, chain = [], b""
    for end in range(self.page, len(prompt), self.page):
      chain = hashlib.sha256(chain + prompt[end - self.page:end].astype("<i4").tobytes()).digest()
      keys.append((end, chain))
    return keys

  def longest(self, keys: list[tuple[int, bytes]]) -> tuple[int, object]:
    """(tokens, entry) of the longest cached prefix among a prompt's `page_keys`; (0, None)
    when none is."""
    for end, key in reversed(keys):
      if key in self._entries:
        self._entries.move_to_end(key)
        return end, self._entries[key]
    return 0, None

  def to_save(self, keys: list[tuple[int, bytes]], cached: int) -> tuple[int, bytes] | None:
    """(tokens, key) of the prefix a prefill should cache on its way, from its prompt's
    `page_keys`: its longest whole-page prefix, unless that is cached already (None then). A
    long prompt's last full chunk ends there (`EngineConfig.prefill_chunks`)."""
    if not keys or keys[-1][0] <= cached or keys[-1][1] in self._entries:
      return None
    return keys[-1]

  def store(self, key: bytes, entry: object) -> None:
    self._entries[key] = entry
    self._entries.move_to_end(key)
    while len(self._entries) > self.capacity:
      self._entries.popitem(last=False)
