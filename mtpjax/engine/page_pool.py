"""The host side of the paged KV cache: which pages of the pools each sequence holds.

Every trunk layer (on every stage) and the NextN block's cache and MTP history (on the last
stage) have a pool of `EngineConfig.pool_pages` pages of `kv_page` rows; one page id names
the same page in every pool, so one table per slot ([slots, max_pages] int32) serves every
layer and every stage. Every process of a pipeline
runs the same schedule through this deterministic allocator (lowest free page first), so each
builds the same tables without exchanging them.

A sequence (`PageList`) takes pages as it grows. Admission reserves, up front, every page a
request can reach (prompt + max_new_tokens + the deepest draft window): a running sequence
then never waits for a page, and nothing is ever preempted. Pages are refcounted: a prefix
cache entry (`prefix_cache.py`) shares its pages with every sequence that starts with it, and
a page returns to the free list when its last holder lets it go. Entries not in use give their
pages back when a reservation needs them (`reclaim`, least recently used first).

A table entry of `pages` (one past the pool) is a page not allocated: the model drops writes
there and masks its reads (`models/kv_cache.py`), so padded prefill tails, draft rows past
what a slot holds and the rows of computed but empty slots cost nothing.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Callable

import numpy as np

from mtpjax import errors


@dataclasses.dataclass
class PageList:
  """One sequence's pages in row order, and how many more its reservation promises it."""
  pages: list[int] = dataclasses.field(default_factory=list)
  reserved: int = 0


class PagePool:

  def __init__(self, pages: int, page_rows: int, max_pages: int, slots: int):
    self.pages = pages
    self.page_rows = page_rows
    self.max_pages = max_pages
    self.refs = np.zeros(pages, np.int32)
    self._free = list(range(pages))                 # a heap: the lowest free id first
    self.reserved = 0                               # pages promised, not yet taken
    self.slots = [PageList() for _ in range(slots)]
    self.table = np.full((slots, max_pages), pages, np.int32)
    # Drops one unused cached prefix and returns True, or False when none is left (set by the
    # prefix cache over this pool).
    self.reclaim: Callable[[], bool] = lambda: False

  @property
  def free_pages(self) -> int:
    return len(self._free)

  @property
  def available(self) -> int:
    """Free pages no reservation has promised."""
    return len(self._free) - self.reserved

  def _pages_for(self, rows: int) -> int:
    """Pages holding a sequence's first `rows` rows (at most a whole table)."""
    return min(-(-rows // self.page_rows), self.max_pages)

  def row(self, held: PageList) -> np.ndarray:
    """A sequence's page table row [max_pages] (pages not allocated: `pages`)."""
    row = np.full(self.max_pages, self.pages, np.int32)
    row[:len(held.pages)] = held.pages
    return row

  def share(self, held: PageList, pages: list[int]) -> None:
    """Start `held` with pages another holder keeps (a cached prefix): one more reference."""
    held.pages = list(pages)
    self.retain(pages)

  def retain(self, pages: list[int]) -> None:
    np.add.at(self.refs, pages, 1)

  def drop(self, pages: list[int]) -> None:
    """One reference fewer on each page; a page nothing refers to is free again."""
    np.add.at(self.refs, pages, -1)
    for page in set(pages):
      if self.refs[page] == 0:
        heapq.heappush(self._free, page)

  def reserve(self, held: PageList, count: int) -> bool:
    """Promise `held` `count` more pages, reclaiming unused cached prefixes if needed; False
    (nothing promised) when the pool cannot, even then."""
    while self.available < count:
      if not self.reclaim():
        return False
    held.reserved += count
    self.reserved += count
    return True

  def grow(self, held: PageList, rows: int) -> bool:
    """Give `held` the pages for its first `rows` rows (at most a whole table), from its
    reservation first; True when its pages changed."""
    need = self._pages_for(rows) - len(held.pages)
    for _ in range(need):
      if held.reserved:
        held.reserved -= 1
        self.reserved -= 1
      elif self.available < 1 and not self.reclaim():
        raise errors.KvPagesError(
            f"no free KV page for a sequence of {rows} rows ({self.pages} pages)",
            field="engine.kv_pages",
            remedy="raise engine.kv_pages, or admit requests through the scheduler, whose "
            "reservations never run out")
      page = heapq.heappop(self._free)
      self.refs[page] += 1
      held.pages.append(page)
    return need > 0

  def release(self, held: PageList) -> None:
    """Let go of every page and the rest of the reservation of `held`."""
    self.drop(held.pages)
    self.reserved -= held.reserved
    held.pages, held.reserved = [], 0

  # --- slots ----------------------------------------------------------------------------------

  def assign(self, slot: int, held: PageList) -> None:
    """Slot `slot` now runs the sequence `held` (a prefilled prompt's pages)."""
    self.release(self.slots[slot])
    self.slots[slot] = held
    self.table[slot] = self.row(held)

  def free_slot(self, slot: int) -> None:
    """Return a finished slot's pages; its table row points nowhere, so the steps that still
    compute the empty slot write nothing."""
    self.release(self.slots[slot])
    self.table[slot] = self.pages

  def grow_slot(self, slot: int, rows: int, ahead: int = 0) -> None:
    """Give slot `slot` the pages for its first `rows` rows, and for `ahead` rows more while its
    reservation or unpromised free pages allow (no reclaim, no error): the NextN block's rows
    run ahead of the trunk's, and a row past every page its request can reach only drafts a
    position past the request's end, so it may be dropped."""
    held, wanted = self.slots[slot], self._pages_for(rows + ahead)
    if len(held.pages) >= wanted:
      return       # every step but about one in `page_rows`: the pages are there already
    grown = self.grow(held, rows)
    extra = min(wanted - len(held.pages), held.reserved + max(self.available, 0))
    if extra > 0:
      grown |= self.grow(held, (len(held.pages) + extra) * self.page_rows)
    if grown:
      self.table[slot] = self.row(held)
