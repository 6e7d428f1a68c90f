"""The decode state: per-slot fields declared once, the last stage's head state, and the
host-side structure over pipeline stages and slot groups (docs/DECODE.md §3 for the invariant).

Slots are split into groups (microbatches, one per stage in a pipeline, one in all for a single
stage). Each group holds, on the last stage, a `HeadState`: what sampling, verifying and
drafting need. Every stage's trunk caches, and the last stage's NextN cache and MTP history
(`MtpPages`), are page pools shared by all groups (a stage runs its groups one after the
other), read through the slots' page tables (`page_pool.py`).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import numpy as np

from mtpjax.engine.page_pool import PageList, PagePool
from mtpjax.engine.prefix_cache import PrefixCache
from mtpjax.engine.sampling import SamplerParams, request_key

# MTP rows one catch-up pass writes per slot.
CATCH_UP_ROWS = 16


@flax.struct.dataclass
class Slots:
  """Everything a step keeps per slot, [B, ...] each. A step over the first k slots cuts and
  writes back exactly these (`first`, `merge`)."""
  pos: jax.Array          # [B] position of `current`
  current: jax.Array      # [B] sampled token not yet in the target KV
  draft: jax.Array        # [B, K] MTP drafts for positions pos + 1 .. pos + K (a chain)
  h_prev: jax.Array       # [B, D] post-norm target hidden at pos - 1
  keys: jax.Array         # [B, 2] raw request keys
  temperature: jax.Array  # [B]
  top_k: jax.Array        # [B]
  top_p: jax.Array        # [B]
  mtp_lag: jax.Array      # [B] rows up to `pos` the MTP KV still lacks (native MTP)

  @classmethod
  def empty(cls, batch: int, hidden: int, dtype, drafts: int = 1) -> "Slots":
    zeros = lambda *shape, dt=np.int32: np.zeros(shape, dt)
    return cls(pos=zeros(batch), current=zeros(batch), draft=zeros(batch, drafts),
               h_prev=zeros(batch, hidden, dt=dtype), keys=zeros(batch, 2, dt=np.uint32),
               temperature=zeros(batch, dt=np.float32), top_k=zeros(batch),
               top_p=np.ones((batch,), np.float32), mtp_lag=zeros(batch))

  def first(self, k: int) -> "Slots":
    """The first k slots."""
    if k == self.pos.shape[0]:
      return self
    return jax.tree.map(lambda a: a[:k], self)

  def merge(self, part: "Slots") -> "Slots":
    """These slots with the first ones replaced by `part` (a step's result over them)."""
    k = part.pos.shape[0]
    if k == self.pos.shape[0]:
      return part
    return jax.tree.map(lambda whole, new: whole.at[:k].set(new), self, part)


def sampler_arrays(sampler: SamplerParams) -> tuple[np.ndarray, ...]:
  """(keys, temperature, top_k, top_p) of one request, as [1]-shaped arrays."""
  return (np.asarray([request_key(sampler.seed)], np.uint32),
          np.asarray([sampler.temperature], np.float32),
          np.asarray([sampler.top_k], np.int32),
          np.asarray([sampler.top_p], np.float32))


@flax.struct.dataclass
class MtpPages:
  """The NextN block's page pools (native MTP), on the last stage: its cache pair, and the MTP
  inputs (token x_p, trunk hidden h_{p-1}) of the rows plain steps committed, which a catch-up
  reads back. Row p of a slot is on the trunk's page for row p, so this memory follows the
  tokens held and a cached prefix's rows are shared with its pages."""
  kv: tuple
  tokens: jax.Array   # [P, R] int32
  hidden: jax.Array   # [P, R, D]


@flax.struct.dataclass
class HeadState:
  """The last stage's state: the slots and, inside a step with native MTP (else None), the
  NextN pools; the engine keeps one `MtpPages` for all groups (`EngineState.joined`)."""
  slots: Slots
  mtp: MtpPages | None = None

  def first(self, k: int) -> "HeadState":
    """The first k slots; the caches stay whole (a step writes and reads only their rows)."""
    return self.replace(slots=self.slots.first(k))

  def merge(self, part: "HeadState") -> "HeadState":
    return part.replace(slots=self.slots.merge(part.slots))

  def with_drafts(self, drafts) -> "HeadState":
    """Verifying the host's `drafts` [k, K] instead of its own chain (None: its own)."""
    return self if drafts is None else self.replace(slots=self.slots.replace(draft=drafts))


@dataclasses.dataclass
class Group:
  """One group of slots: the head state (None off the last stage's process)."""
  head: HeadState | None


@dataclasses.dataclass
class EngineState:
  """The groups; each stage's trunk page pools (one cache pair per layer; None where another
  process owns the stage) and the last stage's NextN pools; the host's page allocator with its page tables, the prefix cache
  over it and each slot's position (every process runs the same schedule, so each knows what
  pages a step needs without reading the positions back); and (native MTP) the host's copy of
  each group's `mtp_lag`, for the catch-up passes the last stage needs, and which slots are
  detached from native MTP (`Engine.detach`: they never draft again, so nothing records their
  MTP inputs and a step over detached slots alone is a step with MTP off)."""
  groups: list[Group]
  kv: list
  pages: PagePool
  prefixes: PrefixCache | None
  positions: np.ndarray                   # [slots] each slot's `pos`
  mtp_lag: list[np.ndarray] | None = None
  mtp: MtpPages | None = None             # the last stage's NextN pools (native MTP)
  detached: np.ndarray | None = None      # [slots] bool (native MTP)

  def joined(self, group: Group) -> HeadState:
    """A group's head state with the NextN pools, as a step donates and returns it."""
    return group.head.replace(mtp=self.mtp)

  def keep(self, group: Group, head: HeadState) -> None:
    """Take a step's `joined` head state back apart (a head without the pools, from a step
    they were kept out of, leaves them as they are)."""
    if head.mtp is not None:
      self.mtp = head.mtp
    group.head = head.replace(mtp=None)


@dataclasses.dataclass
class Prefix:
  """A prefilled prompt: its KV pages and head state; `current` (the first sampled token) is
  readable on every process."""
  pages: PageList
  length: int                          # prompt tokens: the slot's first position
  head: HeadState | None
  current: np.ndarray
  logprobs: tuple | None = None      # the first token's, as a step's (engine_cfg.logprobs)
  mtp_chain: np.ndarray | None = None   # [1, K] the first MTP chain (`mtp_chain_columns`)
  nextn: bool = True                    # whether its NextN rows were computed (native MTP)


@dataclasses.dataclass
class PrefillJob:
  """A prompt being prefilled chunk by chunk (`Engine.start_prefill`) straight into its pages
  of `state`'s pools (the NextN block's too), on the last stage the trunk hidden before the
  next chunk (h_{start-1}), and the (start, tokens, bucket) chunks still to run; `prefix` is
  set once the last one has run."""
  prompt: np.ndarray
  chunks: list[tuple[int, int, int]]
  sampler: tuple
  logprobs: bool
  state: EngineState
  pages: PageList
  before: jax.Array | None
  prefix: Prefix | None = None
  save: tuple[int, bytes] | None = None   # (tokens, key) of the prefix to cache on the way
  cached: int = 0                         # prompt tokens taken from the prefix cache
  nextn: bool = False                     # the NextN block runs over the prompt too
