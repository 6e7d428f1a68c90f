"""GLM-4.x MoE (llama.cpp archs `glm4moe`, `deepseek2`, `glm-dsa`) with its NextN/MTP head.

One class serves a whole model and a pipeline stage alike: its `StageLayout` says which layers
and which boundary parts (embeddings, output head, MTP head) this instance owns. No I/O and no
sharding here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtpjax.kernels import backend
from mtpjax.models.config import ModelConfig
from mtpjax.models.interface import StageLayout
from mtpjax.models.kv_cache import AttentionMetadata
from mtpjax.models.layers import DecoderBlock
from mtpjax.models import quantized
from mtpjax.models.primitives import GgufWeight, Linear, RMSNorm


class MtpHead(nnx.Module):
  """The NextN block: [enorm(E[x_p]); hnorm(h_{p-1})] -> eh_proj -> decoder block -> head norm."""

  def __init__(self, cfg: ModelConfig, dtype):
    self.cfg = cfg
    d = cfg.hidden
    self.enorm = RMSNorm(d, cfg.eps)
    self.hnorm = RMSNorm(d, cfg.eps)
    self.eh_proj = Linear(2 * d, d, dtype)
    self.block = DecoderBlock(cfg, cfg.mtp_layer, dtype)
    self.head_norm = RMSNorm(d, cfg.eps) if cfg.mtp_head_norm else None
    self.embed = GgufWeight(jnp.zeros((cfg.vocab_size, d), dtype)) if cfg.mtp_embed else None
    self.head = Linear(d, cfg.vocab_size, dtype) if cfg.mtp_head else None


class GlmModel(nnx.Module):
  """Trunk layers, boundary parts and optional MTP head for one `StageLayout` (a `CausalLM`)."""

  def __init__(self, cfg: ModelConfig, layout: StageLayout, *, dtype=jnp.float32):
    self.cfg = cfg
    self.layout = layout
    self.dtype = dtype
    d, v = cfg.hidden, cfg.vocab_size
    self.embed = (GgufWeight(jnp.zeros((v, d), dtype)) if layout.needs_token_embedding(cfg)
                  else None)
    self.layers = nnx.List([DecoderBlock(cfg, i, dtype)
                            for i in range(layout.layer_start, layout.layer_end)])
    self.output_norm = RMSNorm(d, cfg.eps) if layout.output else None
    self.head = Linear(d, v, dtype) if layout.output and not cfg.tied_head else None
    self.mtp = MtpHead(cfg, dtype) if layout.mtp else None
    # Which kernels attend and run a tied head (its other modules carry their own):
    # `quantized.with_kernels`.
    self.kernels = backend.default()

  @staticmethod
  def cache_shapes(cfg: ModelConfig, n_layers: int, batch: int, length: int) -> list:
    """Shapes of the (k, v)-like cache pair of each of `n_layers` blocks (the NextN block's
    too: it is a decoder block of the same kind)."""
    return [DecoderBlock.cache_shapes(cfg, batch, length) for _ in range(n_layers)]

  # --- trunk -----------------------------------------------------------------------------------

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    return quantized.rows(self.embed, tokens).astype(self.dtype)

  def run_layers(self, x: jax.Array, positions: jax.Array, kv: list,
                 selection: jax.Array | None = None, page_table: jax.Array | None = None
                 ) -> tuple[jax.Array, list, jax.Array | None]:
    """Run this instance's trunk layers; `kv` holds one cache pair per owned layer (page pools
    read through `page_table`, or per-slot caches without one).

    `selection` is the glm-dsa row mask [B, T, S] in force before layer_start (None: dense),
    given to a stage that `takes_selection`; the mask in force after the last layer comes back
    so the next stage can take it, and the pipelined model equals the single-stage one.
    """
    new_kv = []
    meta = AttentionMetadata(positions, page_table, self.kernels)
    for layer, cache in zip(self.layers, kv):
      x, cache, selection = layer(x, meta, cache, selection)
      new_kv.append(cache)
    return x, new_kv, selection

  def final_norm(self, x: jax.Array) -> jax.Array:
    return self.output_norm(x)

  def lm_logits(self, hidden: jax.Array) -> jax.Array:
    if self.head is None:   # tied: the embedding table [V, D] is the head
      if isinstance(self.embed, quantized.QuantizedTensor):
        return quantized.matmul(hidden, self.embed).astype(jnp.float32)
      table = self.embed[...].astype(hidden.dtype)
      return self.kernels.per_row(lambda rows: jnp.einsum("...d,vd->...v", rows, table),
                                  hidden, hidden.ndim - 1).astype(jnp.float32)
    return self.head(hidden).astype(jnp.float32)

  # --- MTP head ----------------------------------------------------------------------------------

  def mtp_rows(self, tokens, prev_hidden, positions, mtp_kv, page_table=None):
    """MTP rows (token x_p at position p, trunk hidden h_{p-1}) -> (normed draft hidden z, the
    block's output y before the head norm that a draft chain feeds back, new cache).

    `prev_hidden` is the trunk hidden AFTER output_norm (zero for row 0), per docs/MODEL.md §7.
    The NextN block's cache is a page pool read through the trunk's `page_table` (its rows
    are the same positions), or per slot without one.
    """
    mtp = self.mtp
    table = mtp.embed if mtp.embed is not None else self.embed
    e = quantized.rows(table, tokens).astype(self.dtype)
    u = jnp.concatenate([mtp.enorm(e), mtp.hnorm(prev_hidden.astype(self.dtype))], axis=-1)
    meta = AttentionMetadata(positions, page_table, self.kernels)
    y, mtp_kv, _ = mtp.block(mtp.eh_proj(u), meta, mtp_kv)
    norm = mtp.head_norm if mtp.head_norm is not None else self.output_norm
    return norm(y), y, mtp_kv

  def mtp_logits(self, z: jax.Array) -> jax.Array:
    mtp = self.mtp
    if mtp.head is not None:
      return mtp.head(z).astype(jnp.float32)
    return self.lm_logits(z)
