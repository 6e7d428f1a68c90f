"""Model configuration resolved from GGUF metadata and tensor presence.

Some facts are not stored as keys (bias, q/k norm, tied head, MTP block): llama.cpp infers them
from which tensors exist, and so do we (../shared/design/MODEL.md §2).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping

from mtpjax import errors

SUPPORTED_ARCHS = ("glm4moe",)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Everything the forward pass needs; hashable so it can be a static jit argument."""
  arch: str
  vocab_size: int
  hidden: int
  n_layers: int                 # trunk blocks (NextN block excluded)
  n_heads: int
  n_kv_heads: int
  head_dim: int
  value_dim: int
  rope_dims: int
  rope_theta: float
  eps: float
  ffn: int
  leading_dense: int
  n_experts: int
  n_experts_used: int
  n_shared_experts: int
  expert_ffn: int
  n_groups: int
  groups_used: int
  gating: str                   # "sigmoid" | "softmax"
  routed_scale: float
  norm_topk: bool
  context_length: int
  attn_bias: bool
  qk_norm: bool
  tied_head: bool
  has_mtp: bool                 # a usable NextN block is present in the source
  mtp_embed: bool               # blk.L.nextn.embed_tokens present
  mtp_head: bool                # blk.L.nextn.shared_head_head present
  mtp_head_norm: bool           # blk.L.nextn.shared_head_norm present

  @property
  def mtp_layer(self) -> int:
    """GGUF block index of the NextN block: it follows the trunk."""
    return self.n_layers

  @property
  def partial_rotary_factor(self) -> float:
    return self.rope_dims / self.head_dim

  def is_moe_layer(self, layer: int) -> bool:
    return layer >= self.leading_dense and self.n_experts > 0

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> "ModelConfig":
    return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


_MTP_REQUIRED = ("eh_proj.weight", "enorm.weight", "hnorm.weight")


def _get(metadata: Mapping[str, Any], arch: str, key: str, default: Any = dataclasses.MISSING,
         *, source: str) -> Any:
  full = f"{arch}.{key}"
  if full in metadata:
    return metadata[full]
  if default is dataclasses.MISSING:
    raise errors.ConversionError(
        f"required GGUF key {full} is missing", path=source, field=full,
        remedy="re-convert the model with a current llama.cpp convert_hf_to_gguf.py")
  return default


def config_from_gguf(metadata: Mapping[str, Any], tensor_names: Iterable[str], *,
                     source: str = "<gguf>") -> ModelConfig:
  """Resolve a ModelConfig from decoded key/values and the names of the tensors present."""
  arch = metadata.get("general.architecture")
  if arch not in SUPPORTED_ARCHS:
    raise errors.UnsupportedArchitectureError(
        f"unsupported architecture {arch!r}; mtpjax supports {', '.join(SUPPORTED_ARCHS)}",
        path=source, field="general.architecture",
        remedy="use a GLM-4.x MoE GGUF (llama.cpp arch glm4moe)")
  names = set(tensor_names)
  get = lambda key, default=dataclasses.MISSING: _get(metadata, arch, key, default, source=source)

  block_count = int(get("block_count"))
  nextn = int(get("nextn_predict_layers", 0))
  n_layers = block_count - nextn
  hidden = int(get("embedding_length"))
  n_heads = int(get("attention.head_count"))
  n_kv_heads = int(get("attention.head_count_kv", n_heads))
  head_dim = int(get("attention.key_length", hidden // n_heads))
  value_dim = int(get("attention.value_length", head_dim))
  tokens = metadata.get("tokenizer.ggml.tokens")
  if tokens is not None:
    vocab_size = len(tokens)
  elif "token_embd.weight" in names or f"{arch}.vocab_size" in metadata:
    vocab_size = int(get("vocab_size"))
  else:
    raise errors.ConversionError(
        "cannot determine the vocabulary size", path=source, field="tokenizer.ggml.tokens",
        remedy="use a GGUF that carries its tokenizer metadata")
  gating_id = int(get("expert_gating_func", 2))
  if gating_id not in (1, 2):
    raise errors.ConversionError(
        f"unsupported expert_gating_func {gating_id}", path=source,
        field=f"{arch}.expert_gating_func", remedy="expected 1 (softmax) or 2 (sigmoid)")
  scale = float(get("expert_weights_scale", 1.0))

  mtp_prefix = f"blk.{n_layers}.nextn."
  has_mtp = nextn == 1 and all(mtp_prefix + t in names for t in _MTP_REQUIRED)
  if nextn > 1:
    raise errors.ConversionError(
        f"{nextn} NextN blocks declared; mtpjax supports exactly one", path=source,
        field=f"{arch}.nextn_predict_layers", remedy="use a GLM model with one MTP module")

  return ModelConfig(
      arch=arch,
      vocab_size=vocab_size,
      hidden=hidden,
      n_layers=n_layers,
      n_heads=n_heads,
      n_kv_heads=n_kv_heads,
      head_dim=head_dim,
      value_dim=value_dim,
      rope_dims=int(get("rope.dimension_count", head_dim)),
      rope_theta=float(get("rope.freq_base", 10000.0)),
      eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
      ffn=int(get("feed_forward_length")),
      leading_dense=int(get("leading_dense_block_count", 0)),
      n_experts=int(get("expert_count", 0)),
      n_experts_used=int(get("expert_used_count", 0)),
      n_shared_experts=int(get("expert_shared_count", 0)),
      expert_ffn=int(get("expert_feed_forward_length", 0)),
      n_groups=max(1, int(get("expert_group_count", 1))),
      groups_used=max(1, int(get("expert_group_used_count", 1))),
      gating="sigmoid" if gating_id == 2 else "softmax",
      routed_scale=1.0 if scale == 0.0 else scale,
      norm_topk=bool(get("expert_weights_norm", False)),
      context_length=int(get("context_length", 4096)),
      attn_bias="blk.0.attn_q.bias" in names or any(
          re.fullmatch(r"blk\.\d+\.attn_q\.bias", n) for n in names),
      qk_norm=any(re.fullmatch(r"blk\.\d+\.attn_q_norm\.weight", n) for n in names),
      tied_head="output.weight" not in names,
      has_mtp=has_mtp,
      mtp_embed=mtp_prefix + "embed_tokens.weight" in names,
      mtp_head=mtp_prefix + "shared_head_head.weight" in names,
      mtp_head_norm=mtp_prefix + "shared_head_norm.weight" in names,
  )
