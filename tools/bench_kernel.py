"""What one call of the native CPU kernel costs, per weight type, matrix shape and row count;
one JSON line.

`quantized.native_contract` (the call a decode step's projection makes on XLA:CPU) over a
`QuantizedTensor` of random valid blocks for each --matrices entry, against --rows
rows of x, with int8 rows (llama.cpp's arithmetic, the default on a CPU) and float32 rows. A
decode step makes one call per projection inside one XLA program, so each variant is --calls
calls in a row inside one jitted loop (each call's x depends on the last result), timed
alternately in one process (bench_moe's timing, the best of --repeats each), and a call's time
is the loop's over --calls: a jitted call of its own would add JAX's dispatch (tens of
microseconds, more than a small matrix's work). Beside each time: nanoseconds per 32 weights per
row (the kernel's unit of work) and the weight bytes read per second. The demo's matrices are
256 wide (Q8_0), GLM-4.7-Flash's 2048 (Q4_K, Q6_K).

  python -m tools.bench_kernel --matrices=Q8_0:256x256,Q8_0:4096x256,Q4_K:2048x2048 --rows=1,2,8
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from mtpjax.gguf import quant_blocks
from mtpjax.kernels import native
from mtpjax.models.quantized import QuantizedTensor, native_contract
from mtpjax.testing.random_blocks import random_valid_blocks
# bench_moe's timing (the variants alternated in one process, the best of --repeats each) and
# its --repeats flag (absl flags are global: read, not redefined).
from tools.bench_moe import _REPEATS, _best_ms

_MATRICES = flags.DEFINE_list(
    "matrices", ["Q8_0:256x256", "Q8_0:768x256", "Q8_0:4096x256", "Q4_K:2048x2048",
                 "Q6_K:2048x2048"],
    "TYPE:OUTxIN matrices (GGUF type, output rows x input width)")
_ROWS = flags.DEFINE_list("rows", ["1", "2", "8"], "rows of x per call")
_CALLS = flags.DEFINE_integer("calls", 20, "calls in a row per timed loop")
_SEED = flags.DEFINE_integer("seed", 0, "random blocks and rows")


def _matrix(spec: str) -> tuple[str, int, int]:
  try:
    type_name, shape = spec.split(":")
    out, width = (int(v) for v in shape.lower().split("x"))
  except ValueError:
    raise app.UsageError(f"--matrices takes TYPE:OUTxIN, not {spec!r}") from None
  if type_name not in native.TYPE_NAMES:
    raise app.UsageError(f"--matrices: {type_name} is not one of {native.TYPE_NAMES}")
  if width % quant_blocks.block_size(type_name):
    raise app.UsageError(f"--matrices: {spec}'s width is not a multiple of "
                         f"{type_name}'s {quant_blocks.block_size(type_name)}-value blocks")
  return type_name, out, width


def cases():
  """(spec, type name, fields, weight bytes, rows, x) for each --matrices entry and --rows
  count: random valid blocks (small scales, so a loop of calls stays finite) and rows."""
  rng = np.random.default_rng(_SEED.value)
  for spec in _MATRICES.value:
    type_name, out, width = _matrix(spec)
    tensor = QuantizedTensor.from_raw(
        type_name, random_valid_blocks(rng, type_name, (out, width), max_scale=1e-3),
        (out, width))
    for rows in (int(r) for r in _ROWS.value):
      x = jnp.asarray(rng.standard_normal((rows, width)).astype(np.float32))
      yield spec, type_name, tensor.fields(), tensor.device_bytes(), rows, x


def calls_in_a_row(contract):
  """A jitted loop of --calls calls `contract(x, type_name, fields, option)` in a row, each
  feeding the next (so none is skipped); `type_name` and `option` static."""
  def loop(x, type_name, fields, option):
    def one(_, x):
      return x + 1e-30 * contract(x, type_name, fields, option)[:, :1]
    return jax.lax.fori_loop(0, _CALLS.value, one, x)
  return jax.jit(loop, static_argnums=(1, 3))


def main(argv):
  del argv
  if not native.available():
    raise app.UsageError("the native CPU kernel is not available here (see the log)")
  loop = calls_in_a_row(lambda x, type_name, fields, int8:
                        native_contract(x, None, type_name, fields, int8))
  results = {}
  for spec, type_name, fields, weight_bytes, rows, x in cases():
    fns = {mode: (lambda x, f, int8=int8: loop(x, type_name, f, int8))
           for mode, int8 in (("int8_rows", True), ("float32_rows", False))}
    best = {mode: ms / _CALLS.value
            for mode, ms in _best_ms(fns, {mode: (x, fields) for mode in fns}).items()}
    runs_of_32 = fields["d"].shape[0] * x.shape[1] / 32
    results[f"{spec}_rows{rows}"] = {
        f"{mode}_{unit}": value for mode, ms in best.items() for unit, value in (
            ("us", 1e3 * ms), ("ns_per_32_weights_per_row", 1e6 * ms / (runs_of_32 * rows)),
            ("weight_gb_s", weight_bytes / (ms * 1e-3) / 1e9))}
  print(json.dumps({
      "flags": {f.name: f.value for f in (_MATRICES, _ROWS, _CALLS, _REPEATS, _SEED)},
      "device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
      "calls": results}), flush=True)


if __name__ == "__main__":
  app.run(main)
