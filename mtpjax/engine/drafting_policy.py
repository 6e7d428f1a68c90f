"""When drafting pays: the per-slot accept-rate pauses and the batch-level cost policy the
scheduler applies to every strategy (native MTP, n-gram host drafts, composites), and the step
prices it decides from."""

from __future__ import annotations

import collections
import dataclasses
import statistics
import weakref

from mtpjax import errors
from mtpjax.engine.state import CATCH_UP_ROWS


@dataclasses.dataclass(frozen=True)
class AdaptiveDrafting:
  """When to draft, so that MTP on is not slower than MTP off.

  Per slot: after `window` verified drafts with an accept rate below `min_accept_rate`, the
  slot stops asking for drafting steps for `cooldown` steps, doubling (up to `max_backoff`
  times) while its windows keep failing: a short dip costs a few drafts, a slot whose drafts
  stay poor soon pauses for long. A drafting step computes both rows and the MTP block for
  every slot, so it costs the same whichever slots use their drafts: while any live slot
  drafts, every live slot verifies its draft (a paused one too), and only when every slot is
  paused does the batch take a plain step.
  Per batch (`cost_aware`): drafting pays when (1 + accepted drafts) tokens per drafting step
  beat one token per plain step in wall time, the plain steps of a pause being charged the
  catch-up passes that resuming after them runs. Prices and verdicts are kept per slot
  bucket (the live slots a step computes, rounded up to a power of two): a step's cost
  follows its slots, so drafting may pay at batch 1 and not at 8 on the same engine. With a
  multi-token window the same verdict
  chooses the window: a depth that does not pay lowers the batch's cap on every slot's window
  by one (repriced at the new depth) before drafting pauses at the minimum, and a depth that
  pays raises the cap again unless the deeper one was last measured to pay less. The scheduler
  times both kinds of steps (a few plain steps are sampled first, once per engine: the prices
  and the verdict, `BatchVerdict`, carry over to later schedulers of the same engine); when
  drafting does not pay, every slot pauses the same way, for `cooldown` steps doubling up to
  `max_backoff` times while it keeps not paying, and after such a pause `probe_steps` drafting
  steps (not a whole `window`) re-price it. When drafting could not pay even with every
  draft accepted (a compute-bound device at a large batch), no acceptance can change the
  verdict, only the prices (a change of load, rarely): the pause is `hopeless_pause` steps at
  once, doubling (up to `hopeless_doublings` times) while the probe after it finds the same,
  so the probes and catch-up after it stay a small share of a long run. A step in which
  no slot drafts costs what a step with MTP off costs (no MTP block, see `Engine.step`, and
  launched while the last computes, see `SlotScheduler.step`), so drafting goes on only
  where it beats pausing by `required_gain`: within that margin the two are noise apart,
  and a pause is the side that cannot be slower than MTP off.
  """
  window: int = 8
  min_accept_rate: float = 0.3
  cooldown: int = 8
  cost_aware: bool = True
  max_backoff: int = 16
  probe_steps: int = 4          # plain steps sampled to price a step without drafting
  hopeless_pause: int = 1024
  hopeless_doublings: int = 4
  required_gain: float = 1.05

  MODES = ("cost", "accept_rate", "off")
  DEFAULT_MODE = "cost"     # the mode `AdaptiveDrafting()` is (the library's and the server's)

  @classmethod
  def from_mode(cls, mode: str) -> "AdaptiveDrafting | None":
    """`config.engine.adaptive_drafting`: "cost" (the default policy), "accept_rate" (per-slot
    pauses only) or "off" (every step drafts)."""
    if mode not in cls.MODES:
      raise errors.MtpjaxError(
          f"unknown adaptive drafting mode {mode!r}", field="engine.adaptive_drafting",
          remedy=f"choose one of {', '.join(cls.MODES)}")
    return None if mode == "off" else cls(cost_aware=mode == "cost")

  def pause(self, backoff: int) -> tuple[int, int]:
    """(steps of the pause due at `backoff`, the backoff after it): the same doubling rule for
    a slot and for the batch."""
    return self.cooldown * backoff, min(2 * backoff, self.max_backoff)


@dataclasses.dataclass
class BatchVerdict:
  """The batch-level cost policy's standing decision on one engine. It is kept with the
  engine's prices, so a new scheduler (one per `generate` call, or a benchmark pass) goes on
  from it: a pause that drafting earned runs out before drafting is tried again, instead of
  every scheduler paying a window of drafting steps to find out again."""
  paused_steps: int = 0           # steps left in which no slot drafts
  backoff: int = 1                # the next pause is cooldown x backoff steps
  window_cap: int | None = None   # the cap on every slot's window (None: the window's max)
  cap_gain: dict = dataclasses.field(default_factory=dict)   # last gain measured per cap
  drafting_steps: int = 0         # drafting steps since the last verdict
  hopeless: int = 0               # verdicts in a row that drafting could never pay


class DraftingCost:
  """Recent wall time of drafting and plain steps, of a catch-up pass when drafting resumes,
  the accept rate of recent drafts, and the batch policy's verdict on them."""

  SAMPLES = 16

  def __init__(self):
    self.seconds = {True: collections.deque(maxlen=self.SAMPLES),
                    False: collections.deque(maxlen=self.SAMPLES)}
    self.catch_up_pass = collections.deque(maxlen=self.SAMPLES)
    self.accepted = collections.deque(maxlen=4 * self.SAMPLES)
    self.verdict = BatchVerdict()

  @classmethod
  def table(cls, engine) -> "collections.defaultdict[int, DraftingCost]":
    """The prices observed on `engine` so far, per slot bucket: step costs belong to the engine
    and the slots a step computes, so a new scheduler (one per `generate` call) does not pay
    for probing plain steps again, nor for drafting through a pause its predecessor decided
    on."""
    table = _ENGINE_COSTS.get(engine)
    if table is None:
      table = _ENGINE_COSTS[engine] = collections.defaultdict(cls)
    return table

  def observe_step(self, drafting: bool, seconds: float, caught_up_rows: int = 0,
                   steps: int = 1) -> None:
    """A drafting step that first caught up `caught_up_rows` paused rows prices a catch-up
    pass (its time beyond a drafting step's price, per pass) instead of the drafting step. A
    burst of `steps` steps prices each at its share of the burst's `seconds`."""
    if not (drafting and caught_up_rows):
      self.seconds[drafting].extend([seconds / steps] * steps)
    elif len(self.seconds[True]) >= 2:
      extra = seconds - steps * self.price(True)
      self.catch_up_pass.append(max(extra, 0.0) / -(-caught_up_rows // CATCH_UP_ROWS))

  def observe_draft(self, accepted: int) -> None:
    """One slot's verified window: how many of its drafts were accepted."""
    self.accepted.append(int(accepted))

  def reprice_drafting(self) -> None:
    """Forget drafting steps' prices and acceptance: the window depth changed."""
    self.seconds[True].clear()
    self.accepted.clear()

  def priced(self, steps: int) -> bool:
    """Both kinds of steps have at least `steps` timings."""
    return min(len(self.seconds[True]), len(self.seconds[False])) >= steps

  def price(self, drafting: bool) -> float:
    """The median of recent steps of one kind without the slowest (a compile, a hiccup).

    Plain Python: these run on the host between steps, where numpy's per-call overhead on a
    16-element deque costs more than the arithmetic."""
    return statistics.median(sorted(self.seconds[drafting])[:-1])

  def drafting_gain(self, pause_steps: int, accepted: float | None = None) -> float:
    """Tokens per second with drafting over without (both must be priced), over a pause of
    `pause_steps` plain steps and the catch-up passes that resuming after them runs, at the
    recent accept rate or `accepted` drafts per step."""
    rate = accepted
    if rate is None:
      rate = sum(self.accepted) / len(self.accepted) if self.accepted else 0.0
    passes = -(-pause_steps // CATCH_UP_ROWS)
    catch_up = passes * statistics.median(self.catch_up_pass) if self.catch_up_pass else 0.0
    paused = self.price(False) + catch_up / pause_steps
    return (1.0 + rate) * paused / self.price(True)


_ENGINE_COSTS: "weakref.WeakKeyDictionary[object, collections.defaultdict]" = (
    weakref.WeakKeyDictionary())
