"""Multi-head latent attention as llama.cpp's `deepseek2` / `glm-dsa` GGUFs store it (MODEL.md §8).

RoPE rotates adjacent pairs (llama.cpp NORM): the converter stores the rope rows in that order
for both archs (HF's interleave/NeoX conventions give the same scores; the glmdsa-tiny fixture
misses HF by 5 logits with NeoX on the GGUF weights).

The KV cache holds only what MLA needs per token: the normalised latent `c` [kv_lora] and the
rotated shared rope key `k_pe` [qk_rope], as one MQA-like row of `kv_lora + qk_rope` values.
Attention always runs in the absorbed form: `q_nope` is multiplied into the latent through
`attn_k_b`, and `attn_v_b` is applied after the weighted sum, so no per-head key or value is
ever materialised over the context. The second cache slot is zero-size for deepseek2 and holds
the lightning indexer's keys for glm-dsa (`dsa_indexer.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtpjax.models import yarn
from mtpjax.models.config import ModelConfig
from mtpjax.models.dsa_indexer import Indexer
from mtpjax.models.layers import (RMSNorm, _param, linear, linear_param, live_slots,
                                  write_rows)


def latent_attention(q_lat: jax.Array, q_pe: jax.Array, latent_cache: jax.Array,
                     positions: jax.Array, scale: float,
                     selected: jax.Array | None = None) -> jax.Array:
  """Absorbed MLA scores and weighted sum over cached latent rows.

  q_lat: [B, T, H, kv_lora] (q_nope already through attn_k_b); q_pe: [B, T, H, rope];
  latent_cache: [B, S, 1, kv_lora + rope]; `selected` [B, T, S] (sparse attention) further
  restricts the causal rows j <= position. Returns the latent output [B, T, H, kv_lora].
  """
  kv_lora = q_lat.shape[-1]
  cache = latent_cache[:, :, 0].astype(jnp.float32)
  c, k_pe = cache[..., :kv_lora], cache[..., kv_lora:]
  scores = (jnp.einsum("bthc,bsc->bhts", q_lat.astype(jnp.float32), c)
            + jnp.einsum("bthr,bsr->bhts", q_pe.astype(jnp.float32), k_pe)) * scale
  key_pos = jnp.arange(cache.shape[1])
  visible = key_pos[None, None, :] <= positions[:, :, None]                     # [B, T, S]
  if selected is not None:
    visible = visible & selected
  scores = jnp.where(visible[:, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  return jnp.einsum("bhts,bsc->bthc", probs, c)


class MlaAttention(nnx.Module):
  """MLA with an optional glm-dsa lightning indexer choosing which cached rows to attend."""

  def __init__(self, cfg: ModelConfig, layer: int, dtype):
    self.cfg = cfg
    d, h = cfg.hidden, cfg.n_heads
    rope, nope = cfg.rope_dims, cfg.head_dim - cfg.rope_dims
    if cfg.q_lora_rank > 0:
      self.wq_a = linear_param(d, cfg.q_lora_rank, dtype)
      self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.eps, dtype)
      self.wq_b = linear_param(cfg.q_lora_rank, h * cfg.head_dim, dtype)
      self.wq = None
    else:
      self.wq_a = self.q_a_norm = self.wq_b = None
      self.wq = linear_param(d, h * cfg.head_dim, dtype)
    self.wkv_a = linear_param(d, cfg.kv_lora_rank + rope, dtype)
    self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, cfg.eps, dtype)
    self.wk_b = _param((h, cfg.kv_lora_rank, nope), dtype)
    self.wv_b = _param((h, cfg.value_dim, cfg.kv_lora_rank), dtype)
    self.wo = linear_param(h * cfg.value_dim, d, dtype)
    self.indexer = Indexer(cfg, dtype) if cfg.layer_has_indexer(layer) else None
    # A glm-dsa trunk layer without its own indexer reuses the previous layer's selection.
    self.reuses_selection = cfg.has_indexer and layer < cfg.n_layers and self.indexer is None

  def __call__(self, x, positions, cache, selection=None):
    """x: [B, T, D]; cache: (latent [B, S, 1, kv_lora+rope], indexer keys [B, S, 1, d_idx|0]).

    Returns (output, new cache, the row selection this layer used or None when dense).
    """
    cfg = self.cfg
    b, t, _ = x.shape
    nope = cfg.head_dim - cfg.rope_dims
    if self.wq_a is not None:
      q_resid = self.q_a_norm(linear(x, self.wq_a[...]))
      q = linear(q_resid, self.wq_b[...])
    else:
      q_resid, q = None, linear(x, self.wq[...])
    q = q.reshape(b, t, cfg.n_heads, cfg.head_dim)
    q_nope, q_pe = q[..., :nope], yarn.scaled_rope(q[..., nope:], positions, cfg)
    kv = linear(x, self.wkv_a[...])
    c = self.kv_a_norm(kv[..., :cfg.kv_lora_rank])
    k_pe = yarn.scaled_rope(kv[..., None, cfg.kv_lora_rank:], positions, cfg)[:, :, 0]
    latent_cache, index_cache = cache
    start = positions[:, 0]
    latent_cache = write_rows(latent_cache, jnp.concatenate([c, k_pe], -1)[:, :, None], start)
    if self.indexer is not None:
      selection, index_cache = self.indexer(x, q_resid, positions, index_cache)
    elif not self.reuses_selection:
      selection = None
    q_lat = jnp.einsum("bthn,hcn->bthc", q_nope.astype(jnp.float32),
                       self.wk_b[...].astype(jnp.float32))
    scale = yarn.score_scale(cfg)      # 1/sqrt(head_dim) times the YaRN mscale^2
    out_lat = latent_attention(q_lat, q_pe, live_slots(latent_cache, b), positions, scale,
                               selection)
    out = jnp.einsum("bthc,hvc->bthv", out_lat, self.wv_b[...].astype(jnp.float32))
    out = out.reshape(b, t, cfg.n_heads * cfg.value_dim).astype(x.dtype)
    return linear(out, self.wo[...]), (latent_cache, index_cache), selection


def mla_cache_shapes(cfg: ModelConfig, batch: int, max_len: int) -> tuple[tuple, tuple]:
  """Per layer: the latent+rope rows, and the indexer key rows (zero-size without indexer)."""
  return ((batch, max_len, 1, cfg.kv_lora_rank + cfg.rope_dims),
          (batch, max_len, 1, cfg.indexer_dim if cfg.has_indexer else 0))
