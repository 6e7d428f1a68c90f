"""What engines, loaders and checkpoints may ask of a model, whatever its architecture.

A model instance holds one `StageLayout`: a contiguous range of trunk layers plus the boundary
parts it owns (embeddings, final norm and head, MTP head). A single-device model is the one
stage that owns everything. Architectures implement `CausalLM` and register in `registry.py`;
nothing outside `models/` imports an architecture module.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp

from mtpjax.models.config import ModelConfig


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


class CausalLM(Protocol):
  """The calls engines and loaders make on a model instance (one stage of it)."""
  cfg: ModelConfig
  layout: StageLayout
  dtype: jnp.dtype

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """[B, T] ids -> [B, T, D] activations (stages with `layout.embeddings`)."""

  def run_layers(self, x: jax.Array, positions: jax.Array, kv: list,
                 selection: jax.Array | None = None, page_table: jax.Array | None = None
                 ) -> tuple[jax.Array, list, jax.Array | None]:
    """This stage's trunk layers over x at `positions` [B, T], one cache per owned layer:
    page pools read through `page_table` [B, max_pages], or per-slot caches (None)."""

  def final_norm(self, x: jax.Array) -> jax.Array:
    """The trunk output after the final norm (stages with `layout.output`)."""

  def lm_logits(self, hidden: jax.Array) -> jax.Array:
    """float32 logits of post-norm hiddens."""

  def mtp_rows(self, tokens: jax.Array, prev_hidden: jax.Array, positions: jax.Array,
               mtp_kv, page_table: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, object]:
    """The NextN block over rows (token x_p, post-norm trunk hidden h_{p-1}): its normed
    output z, its output y before the head norm, and the new MTP cache (a page pool read
    through the trunk's `page_table`, or per slot without one).

    A recursive draft chain feeds y back as the next row's hidden, as vLLM's MTP proposer
    does (`DeepSeekMultiTokenPredictorLayer.forward` returns the residual stream before
    `shared_head`'s norm, and its proposer loop passes that output back as
    `previous_hidden_states`), so one GGUF drafts alike in both."""

  def mtp_logits(self, z: jax.Array) -> jax.Array:
    """float32 draft logits of the NextN block's output."""


def stage_forward(model: CausalLM, inp, positions: jax.Array, kv: list,
                  page_table: jax.Array | None = None
                  ) -> tuple[jax.Array, list, jax.Array | None]:
  """One stage's part of a pass: `inp` is token ids on the embedding stage, else the hop's
  (activations, glm-dsa selection); `kv` page pools with `page_table`, or per-slot caches.
  Returns (activations, post-norm on the output stage; the new caches; the selection in force
  after the stage)."""
  x, selection = (model.embed_tokens(inp), None) if model.layout.embeddings else inp
  x, kv, selection = model.run_layers(x, positions, kv, selection, page_table)
  return (model.final_norm(x) if model.layout.output else x), kv, selection


def previous_hidden(hidden: jax.Array, before: jax.Array | None = None) -> jax.Array:
  """The MTP head's hidden input for every row of a sequence: row p gets h_{p-1}, row 0 zeros.

  This pairing (docs/MODEL.md §7, llama.cpp's convention) is what makes MTP rows comparable with
  llama.cpp's and keeps row 0 of the MTP KV cache well defined. hidden: [B, T, D]; `before`
  [B, D]: the hidden before the first row when the rows continue a sequence (a prompt chunk).
  """
  first = jnp.zeros_like(hidden[:, :1]) if before is None else before[:, None].astype(hidden.dtype)
  return jnp.concatenate([first, hidden[:, :-1]], axis=1)
