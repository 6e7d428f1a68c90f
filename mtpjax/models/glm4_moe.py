"""GLM-4.x MoE (llama.cpp arch `glm4moe`) with its NextN/MTP head, as Flax NNX modules.

One class serves a whole model and a pipeline stage alike: `StageLayout` says which layers and
which boundary parts (embeddings, output head, MTP head) this instance owns. A single-device
model is the one stage that owns everything. No I/O and no sharding here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mtpjax.models.config import ModelConfig
from mtpjax.models.layers import DecoderBlock, RMSNorm, _param, linear, linear_param
from mtpjax.models.mla import mla_cache_shapes


@dataclasses.dataclass(frozen=True)
class StageLayout:
  """Which parts of the model one instance holds; trunk layers are [layer_start, layer_end)."""
  layer_start: int
  layer_end: int
  embeddings: bool
  output: bool
  mtp: bool

  @classmethod
  def whole(cls, cfg: ModelConfig, *, mtp: bool) -> "StageLayout":
    return cls(0, cfg.n_layers, True, True, mtp and cfg.has_mtp)

  def needs_token_embedding(self, cfg: ModelConfig) -> bool:
    """The embedding table is also read by a tied head and by an MTP head without its own."""
    return (self.embeddings or (self.output and cfg.tied_head)
            or (self.mtp and not cfg.mtp_embed))

  def takes_selection(self, cfg: ModelConfig, cache_len: int) -> bool:
    """Whether the first trunk layer reuses a glm-dsa row selection made on an earlier stage.

    Such a layer has no indexer of its own (`ModelConfig.indexer_full`) and attends to the rows
    the last indexer before it chose, so that selection must hop in with the activations; it
    exists only when an indexer runs before this stage and the cache exceeds top_k.
    """
    start = self.layer_start
    return (0 < start < min(self.layer_end, cfg.n_layers) and cfg.sparse_at(cache_len)
            and not cfg.layer_has_indexer(start)
            and any(cfg.layer_has_indexer(i) for i in range(start)))


class MtpHead(nnx.Module):
  """The NextN block: [enorm(E[x_p]); hnorm(h_{p-1})] -> eh_proj -> decoder block -> head norm."""

  def __init__(self, cfg: ModelConfig, dtype):
    self.cfg = cfg
    d = cfg.hidden
    self.enorm = RMSNorm(d, cfg.eps, dtype)
    self.hnorm = RMSNorm(d, cfg.eps, dtype)
    self.eh_proj = linear_param(2 * d, d, dtype)
    self.block = DecoderBlock(cfg, cfg.mtp_layer, dtype)
    self.head_norm = RMSNorm(d, cfg.eps, dtype) if cfg.mtp_head_norm else None
    self.embed = _param((cfg.vocab_size, d), dtype) if cfg.mtp_embed else None
    self.head = linear_param(d, cfg.vocab_size, dtype) if cfg.mtp_head else None


class GlmModel(nnx.Module):
  """Trunk layers, boundary parts and optional MTP head for one `StageLayout`."""

  def __init__(self, cfg: ModelConfig, layout: StageLayout, *, dtype=jnp.float32):
    self.cfg = cfg
    self.layout = layout
    self.dtype = dtype
    d, v = cfg.hidden, cfg.vocab_size
    self.embed = _param((v, d), dtype) if layout.needs_token_embedding(cfg) else None
    self.layers = nnx.List([DecoderBlock(cfg, i, dtype)
                            for i in range(layout.layer_start, layout.layer_end)])
    self.output_norm = RMSNorm(d, cfg.eps, dtype) if layout.output else None
    self.head = linear_param(d, v, dtype) if layout.output and not cfg.tied_head else None
    self.mtp = MtpHead(cfg, dtype) if layout.mtp else None

  # --- trunk -----------------------------------------------------------------------------------

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    return jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)

  def run_layers(self, x: jax.Array, positions: jax.Array, kv: list,
                 selection: jax.Array | None = None) -> tuple[jax.Array, list, jax.Array | None]:
    """Run this instance's trunk layers; `kv` holds one (k, v) cache pair per owned layer.

    `selection` is the glm-dsa row mask [B, T, S] in force before layer_start (None: dense),
    given to a stage that `takes_selection`; the mask in force after the last layer comes back
    so the next stage can take it, and the pipelined model equals the single-stage one.
    """
    new_kv = []
    for layer, cache in zip(self.layers, kv):
      x, cache, selection = layer(x, positions, cache, selection)
      new_kv.append(cache)
    return x, new_kv, selection

  def final_norm(self, x: jax.Array) -> jax.Array:
    return self.output_norm(x)

  def lm_logits(self, hidden: jax.Array) -> jax.Array:
    if self.head is None:   # tied: the embedding table [V, D] is the head
      return jnp.einsum("...d,vd->...v", hidden, self.embed[...].astype(hidden.dtype)
                        ).astype(jnp.float32)
    return linear(hidden, self.head[...]).astype(jnp.float32)

  def forward(self, tokens, positions, kv):
    """Whole-model pass (one stage owning everything): post-norm hidden and the new cache."""
    x, kv, _ = self.run_layers(self.embed_tokens(tokens), positions, kv)
    return self.final_norm(x), kv

  # --- MTP head ----------------------------------------------------------------------------------

  def mtp_hidden(self, tokens, prev_hidden, positions, mtp_kv):
    """MTP rows (token x_p at position p, trunk hidden h_{p-1}) -> normed draft hidden z.

    `prev_hidden` is the trunk hidden AFTER output_norm (zero for row 0), per MODEL.md §7.
    """
    mtp = self.mtp
    table = mtp.embed if mtp.embed is not None else self.embed
    e = jnp.take(table[...], tokens, axis=0).astype(self.dtype)
    u = jnp.concatenate([mtp.enorm(e), mtp.hnorm(prev_hidden.astype(self.dtype))], axis=-1)
    u = linear(u, mtp.eh_proj[...])
    y, mtp_kv, _ = mtp.block(u, positions, mtp_kv)
    norm = mtp.head_norm if mtp.head_norm is not None else self.output_norm
    return norm(y), mtp_kv

  def mtp_logits(self, z: jax.Array) -> jax.Array:
    mtp = self.mtp
    if mtp.head is not None:
      return linear(z, mtp.head[...]).astype(jnp.float32)
    return self.lm_logits(z)


def previous_hidden(hidden: jax.Array) -> jax.Array:
  """The MTP head's hidden input for every row of a sequence: row p gets h_{p-1}, row 0 zeros.

  This pairing (MODEL.md §7, llama.cpp's convention) is what makes MTP rows comparable with
  llama.cpp's and keeps row 0 of the MTP KV cache well defined. hidden: [B, T, D].
  """
  return jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)


def kv_cache_shapes(cfg: ModelConfig, n_layers: int, batch: int, max_len: int) -> list:
  """Shapes of the per-layer (k, v) caches: [B, Hkv, S, head_dim] and [B, Hkv, value_dim, S]
  (see `layers.causal_attention` for why).

  MLA archs cache [B, S, 1, kv_lora + qk_rope] plus the indexer keys (zero-size without one).
  """
  if cfg.is_mla:
    return [mla_cache_shapes(cfg, batch, max_len) for _ in range(n_layers)]
  return [((batch, cfg.n_kv_heads, max_len, cfg.head_dim),
           (batch, cfg.n_kv_heads, cfg.value_dim, max_len)) for _ in range(n_layers)]


def init_kv(cfg: ModelConfig, n_layers: int, batch: int, max_len: int, dtype) -> list:
  return [(jnp.zeros(ks, dtype), jnp.zeros(vs, dtype))
          for ks, vs in kv_cache_shapes(cfg, n_layers, batch, max_len)]


__all__ = ["GlmModel", "MtpHead", "StageLayout", "init_kv", "kv_cache_shapes",
           "previous_hidden"]
