"""GGUF tensor name -> model parameter path (llama.cpp `glm4moe`, `deepseek2`, `glm-dsa` names).

Paths index the NNX state of the GLM model (`models/glm4_moe.py`) for one `StageLayout`: a
projection is a `Linear` module (`.../wq/weight`, `.../wq/bias`), experts an `Experts` module. A
fused `attn_qkv` tensor maps to three targets, each a row slice of the source (rows ordered q,
k, v).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from mtpjax.models.config import ModelConfig
from mtpjax.models.interface import StageLayout

_BLOCK = {
    "attn_norm.weight": ("attn_norm", "weight"),
    "attn_q.weight": ("attn", "wq", "weight"),
    "attn_q.bias": ("attn", "wq", "bias"),
    "attn_k.weight": ("attn", "wk", "weight"),
    "attn_k.bias": ("attn", "wk", "bias"),
    "attn_v.weight": ("attn", "wv", "weight"),
    "attn_v.bias": ("attn", "wv", "bias"),
    "attn_output.weight": ("attn", "wo", "weight"),
    "attn_q_norm.weight": ("attn", "q_norm", "weight"),
    "attn_k_norm.weight": ("attn", "k_norm", "weight"),
    "post_attention_norm.weight": ("ffn_norm", "weight"),
    "ffn_norm.weight": ("ffn_norm", "weight"),          # deepseek2 / glm-dsa name
    # MLA (deepseek2, glm-dsa; docs/MODEL.md §8)
    "attn_q_a.weight": ("attn", "wq_a", "weight"),
    "attn_q_a_norm.weight": ("attn", "q_a_norm", "weight"),
    "attn_q_b.weight": ("attn", "wq_b", "weight"),
    "attn_kv_a_mqa.weight": ("attn", "wkv_a", "weight"),
    "attn_kv_a_norm.weight": ("attn", "kv_a_norm", "weight"),
    "attn_k_b.weight": ("attn", "wk_b", "weight"),
    "attn_v_b.weight": ("attn", "wv_b", "weight"),
    "ffn_gate.weight": ("ffn", "gate", "weight"),
    "ffn_up.weight": ("ffn", "up", "weight"),
    "ffn_down.weight": ("ffn", "down", "weight"),
    "ffn_gate_inp.weight": ("ffn", "router", "weight"),
    "exp_probs_b.bias": ("ffn", "router_bias"),
    "ffn_gate_exps.weight": ("ffn", "experts", "gate_exps"),
    "ffn_up_exps.weight": ("ffn", "experts", "up_exps"),
    "ffn_down_exps.weight": ("ffn", "experts", "down_exps"),
    "ffn_gate_shexp.weight": ("ffn", "shared", "gate", "weight"),
    "ffn_up_shexp.weight": ("ffn", "shared", "up", "weight"),
    "ffn_down_shexp.weight": ("ffn", "shared", "down", "weight"),
}

# glm-dsa lightning indexer (docs/MODEL.md §9); only layers that run their own indexer load these.
_INDEXER = {
    "indexer.attn_q_b.weight": ("attn", "indexer", "wq_b", "weight"),
    "indexer.attn_k.weight": ("attn", "indexer", "wk", "weight"),
    "indexer.k_norm.weight": ("attn", "indexer", "k_norm_weight"),
    "indexer.k_norm.bias": ("attn", "indexer", "k_norm_bias"),
    "indexer.proj.weight": ("attn", "indexer", "proj", "weight"),
}

_NEXTN = {
    "eh_proj.weight": ("mtp", "eh_proj", "weight"),
    "enorm.weight": ("mtp", "enorm", "weight"),
    "hnorm.weight": ("mtp", "hnorm", "weight"),
    "shared_head_norm.weight": ("mtp", "head_norm", "weight"),
    "embed_tokens.weight": ("mtp", "embed"),
    "shared_head_head.weight": ("mtp", "head", "weight"),
}

_BLK = re.compile(r"blk\.(\d+)\.(.+)")


@dataclasses.dataclass(frozen=True)
class Target:
  """Where (part of) a source tensor goes: a state path, an optional row range and, for a
  fused MLA `attn_kv_b`, which half of each head it keeps (`kv_b`: "k" or "v")."""
  path: tuple
  rows: tuple[int, int] | None = None
  kv_b: str | None = None
  heads: int = 0
  nope: int = 0

  def take(self, array: np.ndarray) -> np.ndarray:
    """The part of the dequantized source tensor (numpy layout) this target holds."""
    if self.rows is not None:
      array = array[self.rows[0]:self.rows[1]]
    if self.kv_b is None:
      return array
    # HF kv_b_proj [H * (nope + v), kv_lora]: per head, the nope key rows then the value rows.
    per_head = array.reshape(self.heads, -1, array.shape[-1])
    if self.kv_b == "k":
      return per_head[:, :self.nope].transpose(0, 2, 1)     # attn_k_b: [H, kv_lora, nope]
    return per_head[:, self.nope:]                          # attn_v_b: [H, v, kv_lora]


def _block_targets(prefix: tuple, suffix: str, cfg: ModelConfig, layer: int) -> list[Target]:
  if suffix in _INDEXER:
    return [Target(prefix + _INDEXER[suffix])] if cfg.layer_has_indexer(layer) else []
  if suffix in ("attn_qkv.weight", "attn_qkv.bias"):
    kind = suffix.split(".")[1]
    q = cfg.n_heads * cfg.head_dim
    k = cfg.n_kv_heads * cfg.head_dim
    v = cfg.n_kv_heads * cfg.value_dim
    bounds = ((0, q), (q, q + k), (q + k, q + k + v))
    return [Target(prefix + ("attn", n, kind), b) for n, b in zip(("wq", "wk", "wv"), bounds)]
  if suffix == "attn_kv_b.weight" and cfg.is_mla:
    nope = cfg.head_dim - cfg.rope_dims
    return [Target(prefix + ("attn", name, "weight"), kv_b=half, heads=cfg.n_heads, nope=nope)
            for name, half in (("wk_b", "k"), ("wv_b", "v"))]
  if suffix in _BLOCK:
    return [Target(prefix + _BLOCK[suffix])]
  return []


def targets_for(name: str, cfg: ModelConfig, layout: StageLayout) -> list[Target]:
  """The parameters of `layout` that tensor `name` fills; [] when this stage does not use it."""
  if name == "token_embd.weight":
    return [Target(("embed",))] if layout.needs_token_embedding(cfg) else []
  if name == "output_norm.weight":
    return [Target(("output_norm", "weight"))] if layout.output else []
  if name == "output.weight":
    return [Target(("head", "weight"))] if layout.output else []
  match = _BLK.fullmatch(name)
  if not match:
    return []
  layer, suffix = int(match.group(1)), match.group(2)
  if layer == cfg.mtp_layer and cfg.has_mtp:
    if not layout.mtp:
      return []
    if suffix.startswith("nextn."):
      path = _NEXTN.get(suffix[len("nextn."):])
      return [Target(path)] if path else []
    return _block_targets(("mtp", "block"), suffix, cfg, layer)
  if layout.layer_start <= layer < layout.layer_end:
    return _block_targets(("layers", layer - layout.layer_start), suffix, cfg, layer)
  return []
