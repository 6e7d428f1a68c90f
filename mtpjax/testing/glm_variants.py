"""The published shapes of the named GLM MoE models, for real-shape synthetic models and sizing.

Dimensions are those of each model's Hugging Face `config.json` (hidden_size,
num_attention_heads, num_key_value_heads / head_dim or the MLA ranks q_lora_rank, kv_lora_rank,
qk_nope_head_dim, qk_rope_head_dim, v_head_dim, n_routed_experts, moe_intermediate_size,
num_experts_per_tok, n_shared_experts, first_k_dense_replace, intermediate_size, vocab_size,
rope_theta, max_position_embeddings, num_hidden_layers, num_nextn_predict_layers,
routed_scaling_factor). They were written from those configs as we know them and cross-checked
against public copies of them found with a search (no network access here to fetch the files):
  - GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air: huggingface.co/zai-org/GLM-4.5{,-Air}, GLM-4.6, GLM-4.7
    config.json; the same numbers appear in slime's scripts/models/glm4.5-355B-A32B.sh and
    glm4.5-106B-A12B.sh (GitHub zyzshishui/slime) (hidden 5120/4096, 96 heads, 8 KV groups, head dim 128, rotary 0.5,
    160/128 experts of 1536/1408, top-8, 3/1 dense layers, vocab 151552, theta 1e6).
  - GLM-4.7-Flash: huggingface.co/zai-org/GLM-4.7-Flash config.json (`glm4_moe_lite`, written
    by llama.cpp as arch `deepseek2`): hidden 2048, 47 layers, 64 experts of 1536, top-4,
    vocab 154880 (also in the NeMo Megatron-Bridge GLM-4.7 page: ~30B total, ~3B active).
  - GLM-5: huggingface.co/zai-org/GLM-5 config.json (`glm_moe_dsa`, arch `glm-dsa`): hidden
    6144, 78 layers, 64 heads, 256 experts of 2048, top-8, 3 dense layers, vocab 154880, as in
    jd-opensource/xllm's glm5.h defaults and slime's GLM-5 script.
The MLA ranks of GLM-4.7-Flash and GLM-5 (q_lora 768 / 2048, kv_lora 512, qk_nope 192, qk_rope
64, v_head 256) and GLM-5's indexer (32 heads x 128, top 2048) are from our knowledge of those
configs, not re-read from the files this session.
"""

from __future__ import annotations

import dataclasses

from mtpjax.models.config import MLA_ARCHS


@dataclasses.dataclass(frozen=True)
class GlmVariant:
  """One model's shape; `real_layers` is its trunk depth (num_hidden_layers, NextN excluded)."""
  name: str
  arch: str                      # llama.cpp arch: glm4moe, deepseek2 or glm-dsa
  hf_repo: str
  real_layers: int
  hidden: int
  n_heads: int
  ffn: int                       # intermediate_size of the leading dense layers
  expert_ffn: int                # moe_intermediate_size
  n_experts: int
  n_experts_used: int
  n_shared_experts: int
  leading_dense: int             # first_k_dense_replace
  vocab_size: int
  context_length: int
  routed_scale: float
  rope_theta: float = 1e6
  nextn_layers: int = 1
  eps: float = 1e-5
  # glm4moe (grouped-query attention)
  n_kv_heads: int = 0
  head_dim: int = 0
  rope_dims: int = 0             # head_dim x partial_rotary_factor
  attn_bias: bool = False
  qk_norm: bool = False
  # MLA (deepseek2, glm-dsa)
  q_lora: int = 0
  kv_lora: int = 0
  qk_nope: int = 0
  qk_rope: int = 0
  v_head: int = 0
  # glm-dsa lightning indexer
  indexer_heads: int = 0
  indexer_dim: int = 0
  index_topk: int = 0

  @property
  def is_mla(self) -> bool:
    return self.arch in MLA_ARCHS


_GLM45 = dict(arch="glm4moe", real_layers=92, hidden=5120, n_heads=96, n_kv_heads=8,
              head_dim=128, rope_dims=64, ffn=12288, expert_ffn=1536, n_experts=160,
              n_experts_used=8, n_shared_experts=1, leading_dense=3, vocab_size=151552,
              routed_scale=2.5, attn_bias=True, qk_norm=True)

VARIANTS: dict[str, GlmVariant] = {v.name: v for v in (
    GlmVariant(name="glm-4.7-flash", arch="deepseek2", hf_repo="zai-org/GLM-4.7-Flash",
               real_layers=47, hidden=2048, n_heads=20, ffn=10240, expert_ffn=1536,
               n_experts=64, n_experts_used=4, n_shared_experts=1, leading_dense=1,
               vocab_size=154880, context_length=202752, routed_scale=1.8, q_lora=768,
               kv_lora=512, qk_nope=192, qk_rope=64, v_head=256),
    GlmVariant(name="glm-4.5-air", arch="glm4moe", hf_repo="zai-org/GLM-4.5-Air",
               real_layers=46, hidden=4096, n_heads=96, n_kv_heads=8, head_dim=128,
               rope_dims=64, ffn=10944, expert_ffn=1408, n_experts=128, n_experts_used=8,
               n_shared_experts=1, leading_dense=1, vocab_size=151552, context_length=131072,
               routed_scale=1.0, attn_bias=True),
    GlmVariant(name="glm-4.5", hf_repo="zai-org/GLM-4.5", context_length=131072, **_GLM45),
    GlmVariant(name="glm-4.6", hf_repo="zai-org/GLM-4.6", context_length=202752, **_GLM45),
    GlmVariant(name="glm-4.7", hf_repo="zai-org/GLM-4.7", context_length=202752, **_GLM45),
    GlmVariant(name="glm-5", arch="glm-dsa", hf_repo="zai-org/GLM-5", real_layers=78,
               hidden=6144, n_heads=64, ffn=12288, expert_ffn=2048, n_experts=256,
               n_experts_used=8, n_shared_experts=1, leading_dense=3, vocab_size=154880,
               context_length=202752, routed_scale=2.5, q_lora=2048, kv_lora=512, qk_nope=192,
               qk_rope=64, v_head=256, indexer_heads=32, indexer_dim=128, index_topk=2048),
)}


def with_dims(variant: GlmVariant, overrides: dict[str, str]) -> GlmVariant:
  """`variant` with some fields replaced (values parsed as the field's type), e.g. for a small
  model of the same shape family in tests: {"hidden": "64", "n_experts": "8"}."""
  fields = {f.name: f for f in dataclasses.fields(GlmVariant)}
  parsed = {}
  for key, text in overrides.items():
    if key not in fields or key in ("name", "arch", "hf_repo"):
      raise ValueError(f"unknown dimension {key!r}; one of "
                       f"{sorted(set(fields) - {'name', 'arch', 'hf_repo'})}")
    kind = type(getattr(variant, key))
    parsed[key] = text.lower() in ("1", "true") if kind is bool else kind(text)
  return dataclasses.replace(variant, **parsed)
