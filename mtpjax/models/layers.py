"""Building blocks of the GLM-4.x MoE forward pass (../shared/design/MODEL.md §5-§6).

Projection matrices are `LinearWeight`s stored `[in, out]`, the transpose of GGUF's `[out, in]`
(the loader transposes them): `x @ W` over row-major `[in, out]` keeps a verify pass of 2 rows
(and any small batch) about as cheap as 1 row on XLA:CPU, where `[out, in]` takes a slower
GEMM path. Experts, the router and embeddings keep the GGUF layout (`[E, out, in]`, `[E, D]`,
`[V, D]`): they are gathered or contracted whole. Norms, RoPE, router and softmax run in
float32 whatever the weight dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtpjax.models.config import ModelConfig


class LinearWeight(nnx.Param):
  """A projection matrix stored `[in, out]`: the transpose of its GGUF tensor."""


def _param(shape, dtype) -> nnx.Param:
  return nnx.Param(jnp.zeros(shape, dtype))


def linear_param(in_dim: int, out_dim: int, dtype) -> LinearWeight:
  return LinearWeight(jnp.zeros((in_dim, out_dim), dtype))


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
  """`x @ weight` for a `LinearWeight` [in, out]."""
  y = jnp.einsum("...i,io->...o", x, weight.astype(x.dtype))
  return y if bias is None else y + bias.astype(y.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """HF/llama.cpp RMSNorm: normalise in float32, cast back, then scale."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * normed.astype(x.dtype)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, dtype):
    self.weight = _param((dim,), jnp.float32)
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.weight[...], self.eps)


def rope_neox(x: jax.Array, positions: jax.Array, rope_dims: int, theta: float) -> jax.Array:
  """Rotate-half RoPE on the first `rope_dims` dims of each head; the rest pass through.

  x: [B, T, heads, head_dim]; positions: [B, T] absolute, 0-based.
  """
  half = rope_dims // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / rope_dims)
  angle = positions.astype(jnp.float32)[..., None] * inv_freq          # [B, T, half]
  cos = jnp.cos(angle)[:, :, None, :]
  sin = jnp.sin(angle)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2, rest = x32[..., :half], x32[..., half:rope_dims], x32[..., rope_dims:]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
  return rotated.astype(x.dtype)


def rope_interleaved(x: jax.Array, positions: jax.Array, theta: float,
                     inv_freq: jax.typing.ArrayLike | None = None,
                     magnitude: float = 1.0) -> jax.Array:
  """RoPE over adjacent pairs (2j, 2j+1) of the whole last axis (llama.cpp NORM, GPT-J).

  x: [B, T, heads, R]; positions: [B, T]. Pair j turns by pos * theta^(-2j/R), or by
  pos * inv_freq[j] with cos/sin times `magnitude` when RoPE scaling supplies them (yarn.py).
  """
  rope_dims = x.shape[-1]
  if inv_freq is None:
    inv_freq = theta ** (-jnp.arange(rope_dims // 2, dtype=jnp.float32) * 2.0 / rope_dims)
  angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  cos = jnp.cos(angle)[:, :, None, :] * magnitude
  sin = jnp.sin(angle)[:, :, None, :] * magnitude
  x32 = x.astype(jnp.float32)
  even, odd = x32[..., 0::2], x32[..., 1::2]
  rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
  return rotated.reshape(x.shape).astype(x.dtype)


def write_rows(cache: jax.Array, rows: jax.Array, start: jax.Array,
               seq_axis: int = 1) -> jax.Array:
  """Write `rows` into `cache` at per-slot row `start` [b] along `seq_axis`.

  `rows` may cover only the first b of the cache's B slots (an engine stepping the slots that
  hold requests, see `Engine.step`); the other slots then get a zero row at 0, which is
  harmless because a slot past the live ones is free and admission rewrites it whole.
  """
  pad = cache.shape[0] - rows.shape[0]
  if pad:
    rows = jnp.pad(rows, [(0, pad)] + [(0, 0)] * (rows.ndim - 1))
    start = jnp.pad(start, (0, pad))
  def one(c, r, s):
    return jax.lax.dynamic_update_slice_in_dim(c, r.astype(c.dtype), s, axis=seq_axis - 1)
  return jax.vmap(one)(cache, rows, start)


def live_slots(cache: jax.Array, batch: int) -> jax.Array:
  """The first `batch` slots of a cache: what a step over fewer slots than the cache reads."""
  return cache if cache.shape[0] == batch else cache[:batch]


def write_head_rows(cache: jax.Array, rows: jax.Array, start: jax.Array,
                    seq_axis: int) -> jax.Array:
  """`write_rows` for a per-head cache [B, Hkv, ...], written as B * Hkv single-head caches.

  Why: with one slot, writing the row through the [B, ...] view makes XLA:CPU duplicate the
  write into the attention's read of the cache (the batch dimension is degenerate there), and
  every cache is then copied four times a step: a decode step at 2048 rows took 3.2 ms
  instead of 1.8. Through the merged view the write stays in place at any slot count.
  """
  heads = cache.shape[1]
  merge = lambda a: a.reshape((a.shape[0] * heads,) + a.shape[2:])
  written = write_rows(merge(cache), merge(rows), jnp.repeat(start, heads), seq_axis - 1)
  return written.reshape(cache.shape)


def causal_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     positions: jax.Array) -> jax.Array:
  """Attend from queries at absolute `positions` to cache rows j <= position.

  Rows past a slot's position are stale and masked, which is the whole rollback mechanism of
  speculative decoding. q: [B, T, H, hd]; k_cache: [B, Hkv, S, hd]; v_cache: [B, Hkv, vd, S].
  With these layouts XLA:CPU reads both caches in place; with any other (e.g. [B, S, Hkv, d]
  or values [B, Hkv, S, vd]) it transposes, i.e. copies, every layer's whole cache at every
  step. The caches must be written with `write_head_rows` for the same reason.
  Returns [B, T, H, vd].
  """
  b, t, h, hd = q.shape
  hkv = k_cache.shape[1]
  q = q.reshape(b, t, hkv, h // hkv, hd)
  scores = jnp.einsum("btkgd,bksd->bkgts", q.astype(jnp.float32),
                      k_cache.astype(jnp.float32)) / jnp.sqrt(jnp.float32(hd))
  key_pos = jnp.arange(k_cache.shape[2])
  visible = key_pos[None, None, None, None, :] <= positions[:, None, None, :, None]
  scores = jnp.where(visible, scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgts,bkds->btkgd", probs, v_cache.astype(jnp.float32))
  return out.reshape(b, t, h, v_cache.shape[2]).astype(q.dtype)


class Attention(nnx.Module):
  """GQA with optional q/k/v bias and per-head q/k RMSNorm before partial NeoX RoPE."""

  def __init__(self, cfg: ModelConfig, dtype):
    self.cfg = cfg
    d, h, hkv, hd, vd = cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.value_dim
    self.wq = linear_param(d, h * hd, dtype)
    self.wk = linear_param(d, hkv * hd, dtype)
    self.wv = linear_param(d, hkv * vd, dtype)
    self.wo = linear_param(h * vd, d, dtype)
    if cfg.attn_bias:
      self.bq = _param((h * hd,), jnp.float32)
      self.bk = _param((hkv * hd,), jnp.float32)
      self.bv = _param((hkv * vd,), jnp.float32)
    else:
      self.bq = self.bk = self.bv = None
    if cfg.qk_norm:
      self.q_norm = RMSNorm(hd, cfg.eps, dtype)
      self.k_norm = RMSNorm(hd, cfg.eps, dtype)
    else:
      self.q_norm = self.k_norm = None

  def __call__(self, x, positions, cache):
    cfg = self.cfg
    b, t, _ = x.shape
    bias = lambda p: None if p is None else p[...]
    q = linear(x, self.wq[...], bias(self.bq)).reshape(b, t, cfg.n_heads, cfg.head_dim)
    k = linear(x, self.wk[...], bias(self.bk)).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    v = linear(x, self.wv[...], bias(self.bv)).reshape(b, t, cfg.n_kv_heads, cfg.value_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q = rope_neox(q, positions, cfg.rope_dims, cfg.rope_theta)
    k = rope_neox(k, positions, cfg.rope_dims, cfg.rope_theta)
    k_cache, v_cache = cache
    start = positions[:, 0]
    k_cache = write_head_rows(k_cache, k.transpose(0, 2, 1, 3), start, seq_axis=2)
    v_cache = write_head_rows(v_cache, v.transpose(0, 2, 3, 1), start, seq_axis=3)
    out = causal_attention(q, live_slots(k_cache, b), live_slots(v_cache, b), positions)
    return linear(out.reshape(b, t, -1), self.wo[...]), (k_cache, v_cache)


class DenseMLP(nnx.Module):

  def __init__(self, hidden: int, ffn: int, dtype):
    self.gate = linear_param(hidden, ffn, dtype)
    self.up = linear_param(hidden, ffn, dtype)
    self.down = linear_param(ffn, hidden, dtype)

  def __call__(self, x):
    return linear(jax.nn.silu(linear(x, self.gate[...])) * linear(x, self.up[...]), self.down[...])


def route(scores_in: jax.Array, bias: jax.Array, cfg: ModelConfig):
  """Router: returns (expert ids [N, K], weights [N, K]) as MODEL.md §6.7 prescribes.

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


class MoE(nnx.Module):
  """Routed experts plus the always-on shared expert."""

  def __init__(self, cfg: ModelConfig, dtype):
    self.cfg = cfg
    e, f, d = cfg.n_experts, cfg.expert_ffn, cfg.hidden
    self.router = _param((e, d), jnp.float32)
    self.router_bias = _param((e,), jnp.float32)
    self.gate_exps = _param((e, f, d), dtype)
    self.up_exps = _param((e, f, d), dtype)
    self.down_exps = _param((e, d, f), dtype)
    self.shared = (DenseMLP(d, f * cfg.n_shared_experts, dtype)
                   if cfg.n_shared_experts > 0 else None)

  def __call__(self, x):
    cfg = self.cfg
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    logits = jnp.einsum("nd,ed->ne", flat.astype(jnp.float32), self.router[...])
    expert_ids, weights = route(logits, self.router_bias[...], cfg)
    if n * cfg.n_experts_used <= cfg.n_experts:
      # Few tokens (decode): each (token, expert) pair reads only that expert's weights.
      def one_expert(x, e):
        act = jax.nn.silu(self.gate_exps[...][e].astype(x.dtype) @ x)
        act = act * (self.up_exps[...][e].astype(x.dtype) @ x)
        return self.down_exps[...][e].astype(x.dtype) @ act
      expert_out = jax.vmap(lambda x, ids: jax.vmap(lambda e: one_expert(x, e))(ids))(
          flat, expert_ids)                                                 # [N, K, D]
    else:
      # Many tokens (prefill): run every expert once, then pick the selected outputs.
      act = jax.nn.silu(jnp.einsum("nd,efd->nef", flat, self.gate_exps[...].astype(flat.dtype)))
      act = act * jnp.einsum("nd,efd->nef", flat, self.up_exps[...].astype(flat.dtype))
      all_out = jnp.einsum("nef,edf->ned", act, self.down_exps[...].astype(flat.dtype))
      expert_out = jnp.take_along_axis(all_out, expert_ids[..., None], axis=1)
    routed = jnp.einsum("nk,nkd->nd", weights.astype(jnp.float32),
                        expert_out.astype(jnp.float32)).astype(flat.dtype)
    if self.shared is not None:
      routed = routed + self.shared(flat)
    return routed.reshape(*lead, -1)


class DecoderBlock(nnx.Module):
  """Pre-norm attention + (dense | MoE) FFN.

  glm4moe names the pre-FFN norm `post_attention_norm`, deepseek2/glm-dsa `ffn_norm`; both load
  into `ffn_norm` (gguf/names.py). MLA archs use `mla.MlaAttention`, which also passes the
  glm-dsa row selection on to a layer that reuses it.
  """

  def __init__(self, cfg: ModelConfig, layer: int, dtype):
    self.attn_norm = RMSNorm(cfg.hidden, cfg.eps, dtype)
    if cfg.is_mla:
      from mtpjax.models.mla import MlaAttention   # mla.py builds on this module
      self.attn = MlaAttention(cfg, layer, dtype)
    else:
      self.attn = Attention(cfg, dtype)
    self.mla = cfg.is_mla
    self.ffn_norm = RMSNorm(cfg.hidden, cfg.eps, dtype)
    self.ffn = MoE(cfg, dtype) if cfg.is_moe_layer(layer) else DenseMLP(cfg.hidden, cfg.ffn, dtype)

  def __call__(self, x, positions, cache, selection=None):
    """Returns (x, cache, selection); selection is the glm-dsa sparse row mask or None."""
    if self.mla:
      attn_out, cache, selection = self.attn(self.attn_norm(x), positions, cache, selection)
    else:
      attn_out, cache = self.attn(self.attn_norm(x), positions, cache)
    x = x + attn_out
    x = x + self.ffn(self.ffn_norm(x))
    return x, cache, selection
