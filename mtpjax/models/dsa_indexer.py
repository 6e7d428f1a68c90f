"""The glm-dsa lightning indexer: which cached rows each query attends to (docs/MODEL.md §9).

Math as in HF transformers' `glm_moe_dsa` and llama.cpp `glm-dsa` (DeepSeek-V3.2 DSA without
the FP8/Hadamard optimisations, which preserve dot products):
  q = wq_b(q_resid) -> [H_i, d_i], RoPE on the first qk_rope dims (layout [rope, rest]); as in
    the main attention, GGUF weights take adjacent-pair RoPE (llama.cpp NORM; HF's NeoX order
    is permuted away by the converter);
  k = LayerNorm(wk(x)) (with bias, eps 1e-6) -> [d_i], the same RoPE; one key per token;
  w = proj(x) * H_i^-1/2;  score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] * d_i^-1/2);
  keep the top `index_topk` visible rows (all of them when fewer are visible).
The indexer keys are cached beside the MLA latent, one [d_i] row per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtpjax.models import kv_cache, yarn
from mtpjax.models.config import ModelConfig
from mtpjax.models.primitives import Linear, zeros_param

K_NORM_EPS = 1e-6   # HF's indexer LayerNorm eps; GGUF stores no key for it


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  return ((x32 - mean) * jax.lax.rsqrt(var + eps) * weight + bias).astype(x.dtype)


def index_scores(q: jax.Array, k_cache: jax.Array, weights: jax.Array) -> jax.Array:
  """q [B, T, H_i, d_i], k_cache [B, S, d_i], weights [B, T, H_i] -> scores [B, T, S] (f32)."""
  scale = 1.0 / float(q.shape[-1]) ** 0.5
  per_head = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32),
                        k_cache.astype(jnp.float32)) * scale
  return jnp.einsum("bths,bth->bts", jax.nn.relu(per_head), weights.astype(jnp.float32))


def select_top_rows(scores: jax.Array, positions: jax.Array, top_k: int) -> jax.Array:
  """Boolean [B, T, S]: the `top_k` best-scoring rows j <= position of each query."""
  b, t, s = scores.shape
  visible = jnp.arange(s)[None, None, :] <= positions[:, :, None]
  masked = jnp.where(visible, scores, -jnp.inf)
  _, idx = jax.lax.top_k(masked, min(top_k, s))                                # [B, T, k]
  bi = jnp.arange(b)[:, None, None]
  ti = jnp.arange(t)[None, :, None]
  chosen = jnp.zeros((b, t, s), bool).at[bi, ti, idx].set(True)
  return chosen & visible


def _rope_front(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Adjacent-pair RoPE on the leading qk_rope dims of each indexer head ([rope, rest]), with
  the same RoPE scaling as the attention (llama.cpp passes the indexer the same YaRN params)."""
  rot = yarn.scaled_rope(x[..., :cfg.rope_dims], positions, cfg)
  return jnp.concatenate([rot, x[..., cfg.rope_dims:]], axis=-1)


class Indexer(nnx.Module):
  """Per-layer lightning indexer; dense (returns no selection) when the cache fits top_k."""

  def __init__(self, cfg: ModelConfig, dtype):
    self.cfg = cfg
    hi, di = cfg.indexer_heads, cfg.indexer_dim
    self.wq_b = Linear(cfg.q_lora_rank, hi * di, dtype)
    self.wk = Linear(cfg.hidden, di, dtype)
    self.k_norm_weight = zeros_param((di,), jnp.float32)
    self.k_norm_bias = zeros_param((di,), jnp.float32)
    self.proj = Linear(cfg.hidden, hi, dtype)

  def __call__(self, x, q_resid, meta: kv_cache.AttentionMetadata, key_cache):
    """x: attention input [B, T, D]; q_resid: normalised q latent [B, T, q_lora].

    Returns (selection [B, T, S] or None for dense, updated key cache [B, S, 1, d_i], or its
    pages: scores over a slot's pages gathered through its table, masked past its position).
    """
    cfg = self.cfg
    positions = meta.positions
    if not cfg.sparse_at(kv_cache.sequence_length(key_cache, meta)):
      return None, key_cache     # every visible row is kept: exactly dense MLA
    b, t, _ = x.shape
    q = self.wq_b(q_resid).reshape(b, t, cfg.indexer_heads, cfg.indexer_dim)
    q = _rope_front(q, positions, cfg)
    k = layer_norm(self.wk(x), self.k_norm_weight[...], self.k_norm_bias[...], K_NORM_EPS)
    keys, key_cache = kv_cache.append_rows(key_cache, _rope_front(k[:, :, None], positions, cfg),
                                           meta)
    weights = self.proj(x).astype(jnp.float32) * cfg.indexer_heads ** -0.5
    scores = index_scores(q, keys, weights)
    return select_top_rows(scores, positions, cfg.indexer_topk), key_cache
