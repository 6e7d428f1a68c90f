"""Feed-forward blocks: the dense (SwiGLU) MLP and the routed mixture of experts (docs/MODEL.md §6).

`Experts` owns the stacked expert weights (GGUF layout `[E, out, in]`, dense or quantized) and
hands the contraction of rows with their selected experts to `grouped_experts`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtpjax.kernels import backend
from mtpjax.models import grouped_experts, quantized
from mtpjax.models.config import ModelConfig
from mtpjax.models.primitives import Einsum, GgufWeight, Linear, zeros_param


class DenseMLP(nnx.Module):

  def __init__(self, hidden: int, ffn: int, dtype):
    self.gate = Linear(hidden, ffn, dtype)
    self.up = Linear(hidden, ffn, dtype)
    self.down = Linear(ffn, hidden, dtype)

  def __call__(self, x):
    fused = quantized.swiglu(x, self.gate.weight, self.up.weight, self.down.weight)
    if fused is not None:   # one native call (XLA:CPU decode rows of quantized weights)
      return fused
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def route(scores_in: jax.Array, bias: jax.Array, cfg: ModelConfig):
  """Router: returns (expert ids [N, K], weights [N, K]) as docs/MODEL.md §6 step 7 prescribes.

  The correction bias only chooses experts; the weights come from the unbiased scores.
  """
  if cfg.gating == "sigmoid":
    scores = jax.nn.sigmoid(scores_in)
  else:
    scores = jax.nn.softmax(scores_in, axis=-1)
  select = scores + bias
  if cfg.n_groups > 1:
    n, e = select.shape
    grouped = select.reshape(n, cfg.n_groups, e // cfg.n_groups)
    group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)                     # [N, G]
    _, keep = jax.lax.top_k(group_score, cfg.groups_used)
    group_mask = jnp.zeros((n, cfg.n_groups), bool).at[jnp.arange(n)[:, None], keep].set(True)
    expert_mask = jnp.repeat(group_mask, e // cfg.n_groups, axis=1)
    select = jnp.where(expert_mask, select, -jnp.inf)
  _, expert_ids = jax.lax.top_k(select, cfg.n_experts_used)
  weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
  if cfg.norm_topk:
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
  return expert_ids, weights * cfg.routed_scale


class Experts(nnx.Module):
  """E SwiGLU experts stored `[E, ffn, D]` (gate, up) and `[E, D, ffn]` (down), dense or
  quantized (`quantized.QuantizedTensor`, swapped in by the loader); the contraction is
  `grouped_experts.routed`: only selected experts run, each read once per call."""

  def __init__(self, n_experts: int, hidden: int, ffn: int, dtype):
    self.gate_exps = GgufWeight(jnp.zeros((n_experts, ffn, hidden), dtype))
    self.up_exps = GgufWeight(jnp.zeros((n_experts, ffn, hidden), dtype))
    self.down_exps = GgufWeight(jnp.zeros((n_experts, hidden, ffn), dtype))

  def __call__(self, x: jax.Array, expert_ids: jax.Array) -> jax.Array:
    """Each row of x [N, D] through its selected experts [N, K]: outputs [N, K, D]."""
    return grouped_experts.routed(x, expert_ids, self.gate_exps, self.up_exps, self.down_exps)


class MoE(nnx.Module):
  """Routed experts plus the always-on shared expert."""

  def __init__(self, cfg: ModelConfig, dtype):
    self.cfg = cfg
    e, f, d = cfg.n_experts, cfg.expert_ffn, cfg.hidden
    self.router = Einsum("nd,ed->ne", (e, d), jnp.float32)     # GGUF layout, float32
    self.router_bias = zeros_param((e,), jnp.float32)
    self.experts = Experts(e, d, f, dtype)
    self.shared = (DenseMLP(d, f * cfg.n_shared_experts, dtype)
                   if cfg.n_shared_experts > 0 else None)
    self.kernels = backend.default()   # a step's routing and combining row by row (primitives)

  def __call__(self, x):
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    bias = self.router_bias[...]
    expert_ids, weights = self.kernels.per_row(lambda scores: route(scores, bias, self.cfg),
                                               self.router(flat))
    expert_out = self.experts(flat, expert_ids)                              # [N, K, D]

    def combine(pair):
      weights, expert_out = pair
      return jnp.einsum("nk,nkd->nd", weights.astype(jnp.float32),
                        expert_out.astype(jnp.float32)).astype(flat.dtype)

    routed = self.kernels.per_row(combine, (weights, expert_out))
    if self.shared is not None:
      routed = routed + self.shared(flat)
    return routed.reshape(*lead, -1)
