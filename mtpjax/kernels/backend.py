"""The kernel seam: which implementation runs the hot operations, chosen once per model.

- `xla`: XLA's own fusions, portable to every platform; the reference the others are checked
  against. Decode and verify rows contract against the integers in one fused loop whatever their
  count, so a row's value never depends on how many rows share a step.
- `native`: XLA:CPU with the C++ kernels of `native.py` (quantized rows, a SwiGLU, paged GQA
  attention), llama.cpp's arithmetic when rows are int8.
- `pallas`: Pallas kernels where one is written (a step's rows against quantized matrices,
  and by id against experts and heads, `pallas_quant.py`; a step's paged attention,
  `pallas_attention.py`), `xla`'s paths elsewhere; on CPU run by Pallas' interpreter, for checking
  only.

`auto` is `native` on CPU where the kernels build, else `xla`. A model's choice is a static
attribute of its quantized tensors and of the model (`quantized.with_kernels`), and a step's
programs trace with `for_steps()`, so what a trace needs rides in its graph definition; no other
module asks which platform it runs on.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from mtpjax import errors
from mtpjax.kernels import native, pallas_quant

# XLA may keep a bfloat16 value in float32 where a fusion lets it ("excess precision"), and
# fusions change with a program's shapes: a step's row would round one way alone and another
# beside other rows (measured: one bfloat16 ulp of a logit, 8 rows against 1). The engine's
# programs compile with it off, so every value rounds as written, on every backend.
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}
# A decode or verify step's rows run this many at a time through one program (`in_row_tiles`):
# XLA vectorizes a reduction and picks a dot's algorithm by its shape, so rows computed four at
# a time round otherwise than one alone (measured: Q5_0 rows on `xla`; RMSNorm and the MoE
# router at GLM-4.7-Flash's widths on `native`); one tile shape gives every row the same code,
# wherever it sits in whatever step.
ROW_TILE = 8
CHOICES = ("auto", "xla", "native", "pallas")
DEFAULT = "auto"
NAMES = ("xla", "native", "pallas")


@dataclasses.dataclass(frozen=True)
class Kernels:
  """The implementations a trace uses (hashable: static in a graph definition).

  `steps`: the rows are a decode or verify step's, which must get one arithmetic at any row
  count (MTP on's k + 1 rows a slot equal MTP off's one); prefill rows may take another path."""
  name: str
  platform: str
  steps: bool = False

  def __post_init__(self):
    if self.name not in NAMES:
      raise ValueError(f"no kernels named {self.name!r}; one of {NAMES}")

  def for_steps(self) -> "Kernels":
    """These kernels tracing a decode or verify step's rows."""
    return dataclasses.replace(self, steps=True)

  def per_row(self, fn, xs, row_dims: int = 1):
    """`fn` over the rows of `xs` (an array or a tuple of them sharing their first `row_dims`
    axes): a step's rows in fixed tiles (`in_row_tiles`), so a row's value is the same alone
    or beside others; other rows (a prefill's) in one call."""
    return in_row_tiles(fn, xs, row_dims) if self.steps else fn(xs)

  @property
  def native(self) -> bool:
    """Whether the native CPU kernels run (resolved at load, so they built)."""
    return self.name == "native"

  @property
  def interpret(self) -> bool:
    """Whether Pallas kernels run in Pallas' interpreter (no accelerator to compile for)."""
    return self.name == "pallas" and self.platform == "cpu"

  @property
  def scalar_prefetch(self) -> bool:
    """Whether the Pallas kernels that address blocks by prefetched scalars run (rows by matrix
    id: routed experts, per-head matrices; paged attention): Mosaic takes them (TPU, and the
    interpreter here), Triton's lowering for GPUs does not, so there those run as `xla`."""
    return self.name == "pallas" and self.platform not in pallas_quant.GPU_PLATFORMS

  @property
  def on_cpu(self) -> bool:
    """XLA:CPU: prefill rows contract in tiles that stay in cache (`quantized.tiled_contract`)
    instead of a whole dequantized matrix."""
    return self.platform == "cpu"


def in_row_tiles(fn, xs, row_dims: int):
  """`fn` over the rows of `xs` (their first `row_dims` axes, flattened) ROW_TILE at a time, the
  last tile padded with zeros: one compiled program for every tile, fenced so nothing around it
  fuses in, so a row's value depends on that row alone. `xs` and `fn`'s result may be tuples."""
  lead = jax.tree.leaves(xs)[0].shape[:row_dims]
  n = math.prod(lead)

  def tiled(x):
    flat = x.reshape((n,) + x.shape[row_dims:])
    flat = jnp.pad(flat, ((0, -n % ROW_TILE),) + ((0, 0),) * (flat.ndim - 1))
    return flat.reshape((-1, ROW_TILE) + flat.shape[1:])

  fenced = lambda tile: jax.lax.optimization_barrier(fn(jax.lax.optimization_barrier(tile)))
  out = jax.lax.map(fenced, jax.tree.map(tiled, xs))
  return jax.tree.map(lambda y: y.reshape((-1,) + y.shape[2:])[:n].reshape(lead + y.shape[2:]),
                      out)


def platform() -> str:
  """The platform this process computes on (`jax.default_backend()`)."""
  return jax.default_backend()


def resolve(choice: str | None = DEFAULT, *, field: str = "engine.kernels") -> Kernels:
  """The kernels `choice` names on this platform ("auto" or None: `native` on CPU where the
  kernels build, else `xla`). A choice that cannot run here is a typed error naming `field`."""
  choice = DEFAULT if choice is None else str(choice)
  here = platform()
  if choice not in CHOICES:
    raise errors.MtpjaxError(
        f"unknown kernels {choice!r}", field=field,
        remedy=f"use one of {', '.join(CHOICES)}")
  if choice == "auto":
    choice = "native" if here == "cpu" and native.available() else "xla"
  elif choice == "native" and not (here == "cpu" and native.available()):
    why = (f"this process runs on {here}" if here != "cpu" else
           "the native CPU kernel did not build (MTPJAX_NATIVE=0, or no working C++ compiler)")
    raise errors.MtpjaxError(f"kernels 'native' cannot run here: {why}", field=field,
                             remedy="use kernels 'auto' or 'xla'")
  return Kernels(choice, here)


@functools.cache
def default() -> Kernels:
  """`resolve("auto")`: what a model built without a choice uses."""
  return resolve("auto")


def stores_bfloat16_as_bits() -> bool:
  """Whether a bfloat16 KV cache is kept as its uint16 bits: XLA:CPU has no bfloat16 scatter
  (see `kv_cache.storage_dtype`)."""
  return platform() == "cpu"
