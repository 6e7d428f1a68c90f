"""The GLM decoder block: pre-norm attention (GQA or MLA) + dense or MoE FFN (docs/MODEL.md §5-§6).

Each attention module declares the shape of the cache it uses (`cache_shapes`, as flax's gemma
`init_cache`) and reads and writes it only through `kv_cache`.
"""

from __future__ import annotations

import jax
from flax import nnx

from mtpjax.models import kv_cache
from mtpjax.models.config import ModelConfig
from mtpjax.models.ffn import DenseMLP, MoE
from mtpjax.models.mla import MlaAttention
from mtpjax.models.primitives import Linear, RMSNorm, project, rope_neox


class Attention(nnx.Module):
  """GQA with optional q/k/v bias and per-head q/k RMSNorm before partial NeoX RoPE."""

  def __init__(self, cfg: ModelConfig, dtype):
    self.cfg = cfg
    d, h, hkv, hd, vd = cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.value_dim
    self.wq = Linear(d, h * hd, dtype, bias=cfg.attn_bias)
    self.wk = Linear(d, hkv * hd, dtype, bias=cfg.attn_bias)
    self.wv = Linear(d, hkv * vd, dtype, bias=cfg.attn_bias)
    self.wo = Linear(h * vd, d, dtype)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(hd, cfg.eps)
      self.k_norm = RMSNorm(hd, cfg.eps)
    else:
      self.q_norm = self.k_norm = None

  @staticmethod
  def cache_shapes(cfg: ModelConfig, batch: int, length: int) -> tuple[tuple, tuple]:
    return kv_cache.gqa_cache_shapes(batch, cfg.n_kv_heads, cfg.head_dim, cfg.value_dim, length)

  def __call__(self, x, meta: kv_cache.AttentionMetadata, cache):
    cfg = self.cfg
    positions = meta.positions
    b, t, _ = x.shape
    q, k, v = project(x, self.wq, self.wk, self.wv)
    q = q.reshape(b, t, cfg.n_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.n_kv_heads, cfg.value_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q = rope_neox(q, positions, cfg.rope_dims, cfg.rope_theta)
    k = rope_neox(k, positions, cfg.rope_dims, cfg.rope_theta)
    out, cache = kv_cache.attention(cache, q, k, v, meta)
    return self.wo(out.reshape(b, t, -1)), cache


class DecoderBlock(nnx.Module):
  """Pre-norm attention + (dense | MoE) FFN.

  glm4moe names the pre-FFN norm `post_attention_norm`, deepseek2/glm-dsa `ffn_norm`; both load
  into `ffn_norm` (glm_names.py). MLA archs use `mla.MlaAttention`, which also passes the
  glm-dsa row selection on to a layer that reuses it.
  """

  def __init__(self, cfg: ModelConfig, layer: int, dtype):
    self.attn_norm = RMSNorm(cfg.hidden, cfg.eps)
    self.attn = MlaAttention(cfg, layer, dtype) if cfg.is_mla else Attention(cfg, dtype)
    self.mla = cfg.is_mla
    self.ffn_norm = RMSNorm(cfg.hidden, cfg.eps)
    self.ffn = MoE(cfg, dtype) if cfg.is_moe_layer(layer) else DenseMLP(cfg.hidden, cfg.ffn, dtype)

  @staticmethod
  def cache_shapes(cfg: ModelConfig, batch: int, length: int) -> tuple[tuple, tuple]:
    """The shapes of one block's cache pair, from the attention it uses."""
    attention = MlaAttention if cfg.is_mla else Attention
    return attention.cache_shapes(cfg, batch, length)

  def __call__(self, x: jax.Array, meta: kv_cache.AttentionMetadata, cache, selection=None):
    """Returns (x, cache, selection); selection is the glm-dsa sparse row mask or None."""
    if self.mla:
      attn_out, cache, selection = self.attn(self.attn_norm(x), meta, cache, selection)
    else:
      attn_out, cache = self.attn(self.attn_norm(x), meta, cache)
    x = x + attn_out
    x = x + self.ffn(self.ffn_norm(x))
    return x, cache, selection
