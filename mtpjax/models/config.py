"""Model configuration resolved from GGUF metadata and tensor presence.

Some facts are not stored as keys (bias, q/k norm, tied head, MTP block): llama.cpp infers them
from which tensors exist, and so do we (docs/MODEL.md §2).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import Any, Iterable, Mapping

from mtpjax import errors

SUPPORTED_ARCHS = ("glm4moe", "deepseek2", "glm-dsa")
MLA_ARCHS = ("deepseek2", "glm-dsa")   # multi-head latent attention (docs/MODEL.md §8-§9)

_log = logging.getLogger(__name__)


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
  # MLA (deepseek2, glm-dsa); head_dim = qk_nope + qk_rope and value_dim = v_head there.
  q_lora_rank: int = 0          # 0: plain attn_q
  kv_lora_rank: int = 0
  # glm-dsa lightning indexer
  indexer_heads: int = 0
  indexer_dim: int = 0
  indexer_topk: int = 0
  indexer_full: tuple[bool, ...] = ()   # per trunk layer: runs its own indexer (else reuses)
  # RoPE scaling of the MLA archs, from `rope.scaling.*` as llama.cpp reads them (yarn.py)
  rope_scaling: str = "none"    # "none" | "linear" | "yarn"
  rope_scaling_factor: float = 1.0    # context extension; positions interpolate by 1/factor
  rope_orig_context: int = 0          # YaRN original context length (0: context_length)
  yarn_log_mul: float = 0.0           # HF mscale_all_dim (the GGUF value / 0.1; 0: unset)
  rope_attn_factor: float = 1.0       # rope.scaling.attn_factor

  @property
  def is_mla(self) -> bool:
    return self.arch in MLA_ARCHS

  @property
  def has_indexer(self) -> bool:
    return self.indexer_heads > 0

  def layer_has_indexer(self, layer: int) -> bool:
    """Trunk layers marked full run an indexer; the NextN block attends densely (no indexer)."""
    if not self.has_indexer or layer >= self.n_layers:
      return False
    return not self.indexer_full or self.indexer_full[layer]

  def sparse_at(self, cache_len: int) -> bool:
    """Whether the indexer narrows attention over a cache of `cache_len` rows; with no more
    rows than top_k it keeps every visible row, so attention is exactly dense (docs/MODEL.md §9)."""
    return self.has_indexer and cache_len > self.indexer_topk

  @property
  def mtp_layer(self) -> int:
    """GGUF block index of the NextN block: it follows the trunk."""
    return self.n_layers

  def is_moe_layer(self, layer: int) -> bool:
    return layer >= self.leading_dense and self.n_experts > 0

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> "ModelConfig":
    values = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
    if "indexer_full" in values:    # JSON turns the tuple into a list; keep the config hashable
      values["indexer_full"] = tuple(values["indexer_full"])
    return cls(**values)


_MTP_REQUIRED = ("eh_proj.weight", "enorm.weight", "hnorm.weight")


# Range rules for the keys read below: ("int", minimum) or ("float", minimum, inclusive).
# A stored value that breaks its rule is refused before it can divide by zero, overflow or
# size an allocation; the engine indexes with int32, so no count may exceed it.
_INT_LIMIT = 2**31 - 1
_KEY_RULES: dict[str, tuple] = {
    **{key: ("int", 1) for key in (
        "block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
        "attention.key_length", "attention.value_length", "vocab_size", "context_length",
        "attention.kv_lora_rank", "attention.key_length_mla", "attention.value_length_mla",
        "attention.indexer.head_count", "attention.indexer.key_length",
        "attention.indexer.top_k")},
    **{key: ("int", 0) for key in (
        "nextn_predict_layers", "expert_gating_func", "rope.dimension_count",
        "feed_forward_length", "leading_dense_block_count", "expert_count", "expert_used_count",
        "expert_shared_count", "expert_feed_forward_length", "expert_group_count",
        "expert_group_used_count", "attention.q_lora_rank",
        "rope.scaling.original_context_length")},
    **{key: ("float", 0.0, False) for key in (
        "rope.freq_base", "attention.layer_norm_rms_epsilon", "rope.scaling.attn_factor")},
    **{key: ("float", None, True) for key in (
        "expert_weights_scale", "rope.scaling.factor", "rope.scale_linear",
        "rope.scaling.yarn_log_multiplier")},
    "attention.indexer.types": ("list",),
}


def _checked(value: Any, key: str, field: str, source: str) -> Any:
  """`value` if it obeys `_KEY_RULES[key]`, else a ConversionError naming the field."""
  rule = _KEY_RULES.get(key)
  if rule is None:
    return value
  fail = lambda what: errors.ConversionError(
      f"GGUF key {field} is {value!r:.80}; it must be {what}", path=source, field=field,
      remedy="fix the value in the GGUF metadata or re-convert the model with llama.cpp")
  if rule[0] == "list":
    if not isinstance(value, list):
      raise fail("an array")
    return value
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise fail("a number")
  if rule[0] == "int":
    if not isinstance(value, int) or not rule[1] <= value <= _INT_LIMIT:
      raise fail(f"an integer in {rule[1]}..{_INT_LIMIT}")
    return value
  minimum, inclusive = rule[1], rule[2]
  if not math.isfinite(value) or (minimum is not None and (
      value < minimum or (value == minimum and not inclusive))):
    bound = "" if minimum is None else f" {'>=' if inclusive else '>'} {minimum}"
    raise fail(f"a finite number{bound}")
  return value


def _get(metadata: Mapping[str, Any], arch: str, key: str, default: Any = dataclasses.MISSING,
         *, source: str) -> Any:
  full = f"{arch}.{key}"
  if full in metadata:
    return _checked(metadata[full], key, full, source)
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
        remedy="use a GLM GGUF (llama.cpp arch glm4moe, deepseek2 or glm-dsa)")
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
    if not isinstance(tokens, list) or not tokens:
      raise errors.ConversionError(
          "tokenizer.ggml.tokens must be a non-empty array of strings", path=source,
          field="tokenizer.ggml.tokens", remedy="re-convert the model with llama.cpp")
    vocab_size = len(tokens)
  elif "token_embd.weight" in names or f"{arch}.vocab_size" in metadata:
    vocab_size = int(get("vocab_size"))
  else:
    raise errors.ConversionError(
        "cannot determine the vocabulary size", path=source, field="tokenizer.ggml.tokens",
        remedy="use a GGUF that carries its tokenizer metadata")
  if arch in MLA_ARCHS and f"{arch}.expert_gating_func" not in metadata:
    # llama.cpp falls back to softmax for deepseek2-style files; a GLM file without the key
    # was converted badly, so say so (docs/MODEL.md §8).
    _log.warning("%s: %s.expert_gating_func is absent; using softmax routing as llama.cpp "
                 "does (re-convert the model if it is a GLM sigmoid-router model)", source, arch)
  gating_id = int(get("expert_gating_func", 1 if arch in MLA_ARCHS else 2))
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

  mla = _mla_fields(metadata, arch, get, source) if arch in MLA_ARCHS else {}
  if mla:
    head_dim, value_dim = mla.pop("head_dim"), mla.pop("value_dim")

  return _check_relations(ModelConfig(
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
      **mla,
  ), source)


def _check_relations(cfg: ModelConfig, source: str) -> ModelConfig:
  """Facts between keys that each passed its own range rule, but that no model can have."""
  arch = cfg.arch
  rules = (
      (cfg.n_layers >= 1, "block_count", "block_count must exceed nextn_predict_layers"),
      (cfg.head_dim >= 1, "attention.key_length",
       "the head size (key_length, else embedding_length / head_count) must be positive"),
      (cfg.n_heads % cfg.n_kv_heads == 0, "attention.head_count_kv",
       "head_count must be a multiple of head_count_kv"),
      (cfg.rope_dims <= cfg.head_dim and cfg.rope_dims % 2 == 0, "rope.dimension_count",
       "rope.dimension_count must be even and at most the head size"),
      (cfg.n_experts_used <= cfg.n_experts, "expert_used_count",
       "expert_used_count must not exceed expert_count"),
      (cfg.leading_dense <= cfg.n_layers, "leading_dense_block_count",
       "leading_dense_block_count must not exceed the trunk's blocks"),
      (cfg.groups_used <= cfg.n_groups, "expert_group_used_count",
       "expert_group_used_count must not exceed expert_group_count"),
  )
  for holds, key, message in rules:
    if not holds:
      raise errors.ConversionError(f"GGUF metadata is inconsistent: {message}", path=source,
                                   field=f"{arch}.{key}",
                                   remedy="fix the GGUF metadata or re-convert the model")
  return cfg


def _mla_fields(metadata: Mapping[str, Any], arch: str, get, source: str) -> dict[str, Any]:
  """MLA and indexer fields: the converter stores MLA as MQA over the latent (docs/MODEL.md §8),
  so the per-head sizes come from the `*_mla` keys, not from key_length/value_length."""
  kv_lora = int(get("attention.kv_lora_rank"))
  fields = dict(
      **_rope_scaling_fields(metadata, arch, get, source),
      head_dim=int(get("attention.key_length_mla")),
      value_dim=int(get("attention.value_length_mla")),
      q_lora_rank=int(get("attention.q_lora_rank", 0)),
      kv_lora_rank=kv_lora,
  )
  if arch == "glm-dsa":
    if fields["q_lora_rank"] == 0:
      raise errors.ConversionError(
          "a glm-dsa model needs attention.q_lora_rank > 0: its indexer reads the q latent",
          path=source, field=f"{arch}.attention.q_lora_rank",
          remedy="re-convert the model with a current llama.cpp convert_hf_to_gguf.py")
    types = get("attention.indexer.types", None)
    fields.update(
        indexer_heads=int(get("attention.indexer.head_count")),
        indexer_dim=int(get("attention.indexer.key_length")),
        indexer_topk=int(get("attention.indexer.top_k")),
        indexer_full=_indexer_types(types, int(get("block_count")) - int(get(
            "nextn_predict_layers", 0)), int(get("context_length", 4096))))
  return fields


_ROPE_SCALING_TYPES = ("none", "linear", "yarn")
# Keys llama.cpp's deepseek2/glm-dsa loaders never read (it uses its defaults), so neither do we.
_IGNORED_YARN_KEYS = ("yarn_beta_fast", "yarn_beta_slow", "yarn_ext_factor", "yarn_attn_factor")


def _rope_scaling_fields(metadata: Mapping[str, Any], arch: str, get,
                         source: str) -> dict[str, Any]:
  """`rope.scaling.*` as llama.cpp's loader resolves them: the type defaults to "linear", a
  factor of 0 or none means 1, type "none" ignores the factor. The converter stores
  `yarn_log_multiplier` as 0.1 * HF mscale_all_dim and llama.cpp divides it back for
  deepseek2 only; its glm-dsa loader never reads the key."""
  kind = str(get("rope.scaling.type", "linear"))
  if kind not in _ROPE_SCALING_TYPES:
    raise errors.UnsupportedArchitectureError(
        f"RoPE scaling type {kind!r} is not implemented (supported: "
        f"{', '.join(_ROPE_SCALING_TYPES)})", path=source, field=f"{arch}.rope.scaling.type",
        remedy="use a GGUF converted from a model with YaRN, linear or no RoPE scaling")
  factor = float(get("rope.scaling.factor", get("rope.scale_linear", 0.0)))
  if factor < 0.0:
    raise errors.ConversionError(
        f"negative RoPE scaling factor {factor}", path=source, field=f"{arch}.rope.scaling.factor",
        remedy="re-convert the model with a current llama.cpp convert_hf_to_gguf.py")
  factor = 1.0 if factor == 0.0 or kind == "none" else factor
  if kind == "linear" and factor == 1.0:
    kind = "none"                  # identical math, and the default of every unscaled file
  log_mul = float(get("rope.scaling.yarn_log_multiplier", 0.0))
  if arch != "deepseek2" and log_mul != 0.0:
    _log.warning("%s: %s.rope.scaling.yarn_log_multiplier is ignored, as llama.cpp's %s loader "
                 "does", source, arch, arch)
    log_mul = 0.0
  for key in _IGNORED_YARN_KEYS:
    if f"{arch}.rope.scaling.{key}" in metadata:
      _log.warning("%s: %s.rope.scaling.%s is ignored, as llama.cpp's %s loader does",
                   source, arch, key, arch)
  return dict(
      rope_scaling=kind,
      rope_scaling_factor=factor,
      rope_orig_context=int(get("rope.scaling.original_context_length",
                                get("context_length", 4096))) if kind != "none" else 0,
      yarn_log_mul=log_mul / 0.1,
      rope_attn_factor=float(get("rope.scaling.attn_factor", 1.0)),
  )


def _indexer_types(types, n_layers: int, context_length: int) -> tuple[bool, ...]:
  """Per-layer "full" flags; without the key, llama.cpp assumes GLM-5/5.1 (all full) below a
  1M-token context and GLM-5.2's pattern (layers 0, 1, then every 4th from 2) above it."""
  if types is not None:
    return tuple(bool(t) for t in types)
  if context_length < 1048576:
    return ()
  return tuple(i < 2 or (i - 2) % 4 == 0 for i in range(n_layers))
