"""Multi-head latent attention as llama.cpp's `deepseek2` / `glm-dsa` GGUFs store it (docs/MODEL.md §8).

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

import jax.numpy as jnp
from flax import nnx

from mtpjax.models import kv_cache, yarn
from mtpjax.models.config import ModelConfig
from mtpjax.models.dsa_indexer import Indexer
from mtpjax.models.primitives import HeadProjection, Linear, RMSNorm, project


class MlaAttention(nnx.Module):
  """MLA with an optional glm-dsa lightning indexer choosing which cached rows to attend."""

  def __init__(self, cfg: ModelConfig, layer: int, dtype):
    self.cfg = cfg
    d, h = cfg.hidden, cfg.n_heads
    rope, nope = cfg.rope_dims, cfg.head_dim - cfg.rope_dims
    if cfg.q_lora_rank > 0:
      self.wq_a = Linear(d, cfg.q_lora_rank, dtype)
      self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.eps)
      self.wq_b = Linear(cfg.q_lora_rank, h * cfg.head_dim, dtype)
      self.wq = None
    else:
      self.wq_a = self.q_a_norm = self.wq_b = None
      self.wq = Linear(d, h * cfg.head_dim, dtype)
    self.wkv_a = Linear(d, cfg.kv_lora_rank + rope, dtype)
    self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, cfg.eps)
    # q_nope into the latent, and the latent output out to per-head values (absorbed form).
    self.wk_b = HeadProjection(h, cfg.kv_lora_rank, nope, dtype)
    self.wv_b = HeadProjection(h, cfg.value_dim, cfg.kv_lora_rank, dtype)
    self.wo = Linear(h * cfg.value_dim, d, dtype)
    self.indexer = Indexer(cfg, dtype) if cfg.layer_has_indexer(layer) else None
    # A glm-dsa trunk layer without its own indexer reuses the previous layer's selection.
    self.reuses_selection = cfg.has_indexer and layer < cfg.n_layers and self.indexer is None

  def __call__(self, x, meta: kv_cache.AttentionMetadata, cache, selection=None):
    """x: [B, T, D]; cache: (latent [B, S, 1, kv_lora+rope], indexer keys [B, S, 1, d_idx|0];
    pages of R rows in place of S rows per slot with a page table).

    Returns (output, new cache, the row selection this layer used or None when dense).
    """
    cfg = self.cfg
    b, t, _ = x.shape
    positions = meta.positions
    nope = cfg.head_dim - cfg.rope_dims
    q, kv = project(x, self.wq if self.wq_a is None else self.wq_a, self.wkv_a)
    q_resid = None
    if self.wq_a is not None:
      q_resid = self.q_a_norm(q)
      q = self.wq_b(q_resid)
    q = q.reshape(b, t, cfg.n_heads, cfg.head_dim)
    q_nope, q_pe = q[..., :nope], yarn.scaled_rope(q[..., nope:], positions, cfg)
    c = self.kv_a_norm(kv[..., :cfg.kv_lora_rank])
    k_pe = yarn.scaled_rope(kv[..., None, cfg.kv_lora_rank:], positions, cfg)[:, :, 0]
    latent_cache, index_cache = cache
    row = jnp.concatenate([c, k_pe], -1)[:, :, None]
    if self.indexer is not None:
      selection, index_cache = self.indexer(x, q_resid, meta, index_cache)
    elif not self.reuses_selection:
      selection = None
    scale = yarn.score_scale(cfg)      # 1/sqrt(head_dim) times the YaRN mscale^2
    out_lat, latent_cache = kv_cache.latent_attention(latent_cache, row, self.wk_b(q_nope), q_pe,
                                                      meta, scale, selection)
    out = self.wv_b(out_lat).reshape(b, t, cfg.n_heads * cfg.value_dim).astype(x.dtype)
    return self.wo(out), (latent_cache, index_cache), selection

  @staticmethod
  def cache_shapes(cfg: ModelConfig, batch: int, length: int) -> tuple[tuple, tuple]:
    """The latent+rope rows, and the indexer key rows (zero-size without an indexer)."""
    return (kv_cache.row_cache_shape(batch, length, cfg.kv_lora_rank + cfg.rope_dims),
            kv_cache.row_cache_shape(batch, length, cfg.indexer_dim if cfg.has_indexer else 0))
