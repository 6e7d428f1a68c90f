"""Routed SwiGLU experts over (row, expert) pairs: only the selected experts run.

Pairs are grouped by expert, so each selected expert's weights are read once per call however
many rows chose it, and arithmetic is proportional to rows x top-k, not rows x experts. On
XLA:CPU with quantized experts every pair goes through one native SwiGLU call, which groups
them itself (`quantized.native_swiglu`).

- Few rows (decode, verify, small batches): a loop over the pairs, each contracting its row
  against its expert's weights read by id from the store (dense, or quantized integers via
  `quantized.contract`), pairs of one expert adjacent so a repeated expert is re-read from
  cache, not memory.
- Many rows (prefill): a loop over experts dequantizes each selected expert once and runs its
  rows through dense GEMMs in tiles (a grouped matmul). `jax.lax.ragged_dot` is the same
  operation, but XLA:CPU lowers it to a dense product over every group (measured ~85x one
  group's GEMM), so the loop is written here.

`every_expert` is the old all-experts contraction, kept as the reference tests and the
`tools/bench_moe.py` comparison use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtpjax.models import quantized

# Rows at or below this take the per-pair path (decode steps of up to 8 slots with a 2-row
# verify); so do a decode or verify step's rows at any count, and on XLA:CPU any number of
# int8 rows (the native kernel's grouped pairs).
PAIR_ROWS = 16


def _sorted_pairs(expert_ids: jax.Array):
  """(order, sorted expert per pair, source row per pair) of the flattened [N, K] selection."""
  k = expert_ids.shape[1]
  flat = expert_ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  return order, flat[order], order // k


def _unsort(sorted_out: jax.Array, order: jax.Array, n: int, k: int) -> jax.Array:
  return jnp.zeros_like(sorted_out).at[order].set(sorted_out).reshape(n, k, -1)


def _one_pair(x_row, weight, e):
  """One row against expert `e`'s `[out, in]` matrix, read from the store by id: [out]. Each
  pair is one row through one program (the loop's), so its value is that row's alone."""
  type_name, fields = quantized.gather(weight, e)
  if type_name is not None:
    return quantized.fused_contract(x_row, type_name, fields)
  return fields["w"].astype(x_row.dtype) @ x_row


def _native_pairs(x, expert_ids, gate, up, down):
  """XLA:CPU with quantized experts: every (row, expert) pair through its expert's SwiGLU in one
  native call, which groups the pairs by expert itself (each selected expert's blocks unpacked
  once), so they need no sorting here."""
  n, k = expert_ids.shape
  y = quantized.native_swiglu(jnp.repeat(x, k, axis=0), expert_ids.reshape(-1), gate, up, down)
  return y.reshape(n, k, -1).astype(x.dtype)


def _takes_native(expert_ids, *weights) -> bool:
  return all(isinstance(w, quantized.QuantizedTensor)
             and quantized.takes_native(w.type_name, expert_ids.size, w.int8_activations,
                                        w.kernels)
             for w in weights)


def _steps_rows(weight) -> bool:
  """Whether a decode or verify step's rows are traced (quantized experts say so): they keep
  the pairwise path at any count, one row's arithmetic whatever rows share the step."""
  return isinstance(weight, quantized.QuantizedTensor) and weight.kernels.steps


def _pallas_steps(*weights) -> bool:
  """Whether a step's pairs run the Pallas kernel: quantized experts with `pallas` kernels."""
  return all(isinstance(w, quantized.QuantizedTensor) and w.kernels.steps
             and w.kernels.scalar_prefetch for w in weights)


def _pallas_pairs(x_pairs, experts, gate, up, down):
  """Pairs sorted by expert through the Pallas kernel by id, one program per pair and output
  tile, so a pair's value is its own and a run of one expert's pairs reads its blocks once."""
  def by_id(rows, weight):
    return quantized.pallas_contract(rows, weight.type_name, weight.fields(), weight.kernels,
                                     experts).astype(x_pairs.dtype)
  act = jax.nn.silu(by_id(x_pairs, gate)) * by_id(x_pairs, up)
  return by_id(act, down)


def pairwise(x, expert_ids, gate, up, down):
  """A loop over the pairs sorted by expert: each iteration reads one expert by id (a repeat of
  the previous pair's expert is still in cache) and contracts one row against its integers,
  so no per-pair weight copies or broadcast rows are materialized."""
  if _takes_native(expert_ids, gate, up, down):
    return _native_pairs(x, expert_ids, gate, up, down)
  order, experts, rows = _sorted_pairs(expert_ids)
  if _pallas_steps(gate, up, down):
    return _unsort(_pallas_pairs(x[rows], experts, gate, up, down), order, *expert_ids.shape)

  def one(pair):
    e, row = pair
    xr = x[row]
    act = jax.nn.silu(_one_pair(xr, gate, e)) * _one_pair(xr, up, e)
    return _one_pair(act, down, e)

  return _unsort(jax.lax.map(one, (experts, rows)), order, *expert_ids.shape)


def _expert_matrix(weight, e, dtype):
  """One expert's dense `[out, in]` values (dequantized once), for the GEMM tiles."""
  return quantized.values(*quantized.gather(weight, e)).astype(dtype)


def grouped(x, expert_ids, gate, up, down, tile: int | None = None):
  """Grouped-matmul MoE: pairs sorted by expert, each non-empty expert's rows in `tile`-row
  GEMMs against that expert's weights, dequantized once per call."""
  n, k = expert_ids.shape
  n_experts = gate.shape[0]
  pairs = n * k
  if tile is None:   # about one tile per expert on average, within [8, 128]
    tile = int(min(128, max(8, 1 << max(0, (pairs // n_experts - 1).bit_length()))))
  order, experts, rows = _sorted_pairs(expert_ids)
  d = x.shape[-1]
  xs = jnp.concatenate([x[rows], jnp.zeros((tile, d), x.dtype)])
  max_tiles = -(-pairs // tile)
  sizes = jnp.bincount(experts, length=n_experts)
  starts = jnp.cumsum(sizes) - sizes

  def one_expert(out, e):
    start, size = starts[e], sizes[e]

    def run(out):
      g = _expert_matrix(gate, e, x.dtype)
      u = _expert_matrix(up, e, x.dtype)
      dn = _expert_matrix(down, e, x.dtype)

      def one_tile(j, out):
        s = start + j * tile
        xt = jax.lax.dynamic_slice_in_dim(xs, s, tile)
        y = (jax.nn.silu(xt @ g.T) * (xt @ u.T)) @ dn.T
        keep = (jnp.arange(tile) + j * tile < size)[:, None]
        old = jax.lax.dynamic_slice_in_dim(out, s, tile)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y, old), s, 0)

      # A static trip count (an expert holds at most every pair) keeps the loop differentiable
      # for the demo trainer; tiles past the expert's rows are skipped, not computed.
      return jax.lax.fori_loop(
          0, max_tiles,
          lambda j, out: jax.lax.cond(j * tile < size, one_tile, lambda j, out: out, j, out), out)

    return jax.lax.cond(size > 0, run, lambda out: out, out), None

  out, _ = jax.lax.scan(one_expert, jnp.zeros((pairs + tile, d), x.dtype),
                        jnp.arange(n_experts))
  return _unsort(out[:pairs], order, n, k)


def routed(x, expert_ids, gate, up, down):
  """Rows x [N, D] through their selected experts [N, K]: outputs [N, K, D]."""
  if (x.shape[0] <= PAIR_ROWS or _steps_rows(gate)
      or _takes_native(expert_ids, gate, up, down)):
    return pairwise(x, expert_ids, gate, up, down)
  return grouped(x, expert_ids, gate, up, down)


def every_expert(x, expert_ids, gate, up, down):
  """Reference: every expert on every row, then the selected outputs (rows x experts work)."""
  def dense(w):
    return (w.dequantize() if isinstance(w, quantized.QuantizedTensor) else w[...]).astype(x.dtype)
  act = jax.nn.silu(jnp.einsum("nd,efd->nef", x, dense(gate)))
  act = act * jnp.einsum("nd,efd->nef", x, dense(up))
  every = jnp.einsum("nef,edf->ned", act, dense(down))
  return jnp.take_along_axis(every, expert_ids[..., None], axis=1)
