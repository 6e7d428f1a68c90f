"""Real-shape synthetic GLM GGUFs: a named variant's dimensions, few trunk layers + NextN.

A GLM-4.7-Flash-shaped model with 4 trunk layers is ~3.4B parameters, so unlike the tiny
builders this one never holds the model: tensor infos are declared first and each tensor is
generated in row chunks, encoded and written before the next is made (peak memory ~ the largest
tensor in its stored type). Names, shapes, order and key/values are llama.cpp's converter output
for each arch (compare the fixtures in tests/fixtures/: glm4moe-tiny, glm4moelite-tiny
(`deepseek2`), glmdsa-tiny (`glm-dsa`)); the common keys, the tokenizer and the per-tensor type
policy are `tiny_glm`'s. Weights are random with a sane scale (N(0, 1/fan_in), unit norms, unit
embeddings) so activations stay finite through the few layers.
"""

from __future__ import annotations

import functools
import math
import os
import zlib
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from mtpjax.gguf.tensors import keeps_f32
from mtpjax.testing.glm_variants import GlmVariant
from mtpjax.testing.tiny_glm import (KQUANT_SCALE_FIELDS, TinyGlmSpec, add_model_keys,
                                     random_kquant, set_f16, add_tokenizer, staged_gguf_writer,
                                     encode_tiny_glm_tensor, tensor_type_for,
                                     tiny_tokenizer_metadata)

# Key/values of the source variant, so that a benchmark can extrapolate to its real depth.
VARIANT_KEY = "mtpjax.synthetic.variant"
REAL_LAYERS_KEY = "mtpjax.synthetic.real_block_count"

_CHUNK_ELEMENTS = 1 << 22      # rows generated per step: ~16 MB of float32
_HEAD_GAIN = 2.0               # logits with std ~2
_ROUTER_GAIN = 3.0             # router logits with std ~3: sigmoid scores spread over (0, 1)


def tensor_shapes(v: GlmVariant, n_trunk_layers: int) -> dict[str, tuple[int, ...]]:
  """GGUF name -> numpy shape ([out, in], experts [E, out, in]) in llama.cpp's file order."""
  D, V, E, Fe = v.hidden, v.vocab_size, v.n_experts, v.expert_ffn
  sh = Fe * v.n_shared_experts
  t: dict[str, tuple[int, ...]] = {"output.weight": (V, D), "token_embd.weight": (V, D)}
  for i in range(n_trunk_layers + v.nextn_layers):
    p = f"blk.{i}."
    nextn = i >= n_trunk_layers
    if nextn:
      t[p + "nextn.eh_proj.weight"] = (D, 2 * D)
      if v.is_mla:
        t[p + "nextn.embed_tokens.weight"] = (V, D)
      t[p + "nextn.enorm.weight"] = (D,)
      t[p + "nextn.hnorm.weight"] = (D,)
    t[p + "attn_norm.weight"] = (D,)
    if i < v.leading_dense and not nextn:
      t.update({p + "ffn_down.weight": (D, v.ffn), p + "ffn_gate.weight": (v.ffn, D),
                p + "ffn_up.weight": (v.ffn, D)})
    else:
      t.update({p + "ffn_down_exps.weight": (E, D, Fe), p + "ffn_gate_exps.weight": (E, Fe, D),
                p + "ffn_up_exps.weight": (E, Fe, D), p + "exp_probs_b.bias": (E,),
                p + "ffn_gate_inp.weight": (E, D)})
      if sh:
        t.update({p + "ffn_down_shexp.weight": (D, sh), p + "ffn_gate_shexp.weight": (sh, D),
                  p + "ffn_up_shexp.weight": (sh, D)})
    if v.is_mla:
      t.update(_mla_block(v, p))
      heads = ("nextn.shared_head_head.weight",) if v.arch == "glm-dsa" else ()
    else:
      t.update(_gqa_block(v, p))
      heads = ("nextn.shared_head_head.weight",)
    if nextn:
      t.update({p + name: (V, D) for name in heads})
      t[p + "nextn.shared_head_norm.weight"] = (D,)
  t["output_norm.weight"] = (D,)
  return t


def _gqa_block(v: GlmVariant, p: str) -> dict[str, tuple[int, ...]]:
  D, hd = v.hidden, v.head_dim
  q_dim, kv_dim = v.n_heads * hd, v.n_kv_heads * hd
  t: dict[str, tuple[int, ...]] = {p + "post_attention_norm.weight": (D,)}
  if v.qk_norm:
    t[p + "attn_k_norm.weight"] = (hd,)
  if v.attn_bias:
    t[p + "attn_k.bias"] = (kv_dim,)
  t[p + "attn_k.weight"] = (kv_dim, D)
  t[p + "attn_output.weight"] = (D, q_dim)
  if v.qk_norm:
    t[p + "attn_q_norm.weight"] = (hd,)
  if v.attn_bias:
    t[p + "attn_q.bias"] = (q_dim,)
  t[p + "attn_q.weight"] = (q_dim, D)
  if v.attn_bias:
    t[p + "attn_v.bias"] = (kv_dim,)
  t[p + "attn_v.weight"] = (kv_dim, D)
  return t


def _mla_block(v: GlmVariant, p: str) -> dict[str, tuple[int, ...]]:
  D, H = v.hidden, v.n_heads
  t: dict[str, tuple[int, ...]] = {p + "ffn_norm.weight": (D,)}
  if v.arch == "glm-dsa":
    t.update({p + "indexer.k_norm.bias": (v.indexer_dim,),
              p + "indexer.k_norm.weight": (v.indexer_dim,),
              p + "indexer.proj.weight": (v.indexer_heads, D),
              p + "indexer.attn_k.weight": (v.indexer_dim, D),
              p + "indexer.attn_q_b.weight": (v.indexer_heads * v.indexer_dim, v.q_lora)})
  t.update({p + "attn_kv_a_norm.weight": (v.kv_lora,),
            p + "attn_kv_a_mqa.weight": (v.kv_lora + v.qk_rope, D),
            p + "attn_k_b.weight": (H, v.kv_lora, v.qk_nope),
            p + "attn_v_b.weight": (H, v.v_head, v.kv_lora),
            p + "attn_output.weight": (D, H * v.v_head),
            p + "attn_q_a_norm.weight": (v.q_lora,),
            p + "attn_q_a.weight": (v.q_lora, D),
            p + "attn_q_b.weight": (H * (v.qk_nope + v.qk_rope), v.q_lora)})
  return t


def type_spec(v: GlmVariant, n_trunk_layers: int, tensor_type: str) -> TinyGlmSpec:
  """The `tiny_glm` spec whose keys and type policy this variant's file uses.

  For MLA archs the attention fields hold what llama.cpp writes there: one KV head of width
  kv_lora + qk_rope (`attention.key_length`); the MLA keys are added separately.
  """
  mla = v.is_mla
  return TinyGlmSpec(
      vocab_size=v.vocab_size, hidden=v.hidden, n_heads=v.n_heads,
      n_kv_heads=1 if mla else v.n_kv_heads,
      head_dim=v.kv_lora + v.qk_rope if mla else v.head_dim,
      n_trunk_layers=n_trunk_layers, leading_dense=min(v.leading_dense, n_trunk_layers),
      ffn=v.ffn, n_experts=v.n_experts, n_experts_used=v.n_experts_used,
      n_shared_experts=v.n_shared_experts, expert_ffn=v.expert_ffn, n_groups=1, groups_used=1,
      rope_dims=v.qk_rope if mla else v.rope_dims, rope_theta=v.rope_theta, eps=v.eps,
      attn_bias=v.attn_bias, qk_norm=v.qk_norm, mtp=v.nextn_layers > 0,
      routed_scale=v.routed_scale, context_length=v.context_length, tensor_type=tensor_type)


def _std(name: str, shape: tuple[int, ...]) -> float:
  """Standard deviation of a 2-D/3-D weight: unit embeddings, N(0, gain^2 / fan_in) else."""
  if name.endswith(("token_embd.weight", "nextn.embed_tokens.weight")):
    return 1.0
  gain = 1.0
  if name == "output.weight" or name.endswith("shared_head_head.weight"):
    gain = _HEAD_GAIN
  elif name.endswith("ffn_gate_inp.weight"):
    gain = _ROUTER_GAIN
  return gain / math.sqrt(shape[-1])


def _rng(seed: int, name: str, rows: slice) -> np.random.Generator:
  return np.random.default_rng([seed, zlib.crc32(name.encode()), rows.start])


def _values(seed: int, name: str, shape: tuple[int, ...], rows: slice) -> np.ndarray:
  """float32 rows `rows` of the flattened [-1, shape[-1]] tensor; depends on (seed, name, row)."""
  n, rng = rows.stop - rows.start, _rng(seed, name, rows)
  if len(shape) == 1:
    base = 0.0 if name.endswith(".bias") else 1.0
    return base + 0.1 * rng.standard_normal((n, shape[-1]), np.float32)
  return rng.standard_normal((n, shape[-1]), np.float32) * np.float32(_std(name, shape))


@functools.cache
def _unit_kquant_scales(qtype: GGMLQuantizationType) -> tuple[float, float]:
  """(d, dmin) that give random blocks of `qtype` ~zero mean and unit std: the medians of
  tiny_glm's per-block fit over a sample of unit-normal blocks."""
  block = GGML_QUANT_SIZES[qtype][0]
  sample = np.random.default_rng(0).standard_normal((1024, block)).astype(np.float32)
  fitted = random_kquant(sample, qtype, 0).reshape(1024, -1)
  d_off, m_off = KQUANT_SCALE_FIELDS[qtype]
  field = lambda off: float(np.median(
      fitted[:, off:off + 2].copy().view(np.float16).astype(np.float64)))
  return field(d_off), (field(m_off) if m_off is not None else 0.0)


def _random_kquant_rows(qtype: GGMLQuantizationType, std: float, n_rows: int, row: int,
                        rng: np.random.Generator) -> np.ndarray:
  """Random K-quant blocks with the same f16 scales everywhere, scaled to `std`: fitting each
  block (tiny_glm's `random_kquant`) runs gguf-py's dequantizer twice per block, minutes for a
  real-shape model, and a benchmark only needs finite, sanely scaled weights."""
  block, type_size = GGML_QUANT_SIZES[qtype]
  d, dmin = _unit_kquant_scales(qtype)
  d_off, m_off = KQUANT_SCALE_FIELDS[qtype]
  blocks = rng.integers(0, 256, size=(n_rows * row // block, type_size), dtype=np.uint8)
  blocks = set_f16(blocks, d_off, std * d)
  if m_off is not None:
    blocks = set_f16(blocks, m_off, std * dmin)
  return blocks.reshape(n_rows, row // block * type_size)


def _stored(spec: TinyGlmSpec, name: str, shape: tuple[int, ...]
            ) -> tuple[GGMLQuantizationType, tuple[int, ...], np.dtype]:
  """(ggml type, stored array shape, stored numpy dtype) of one tensor."""
  qtype = (GGMLQuantizationType.F32 if keeps_f32(name, len(shape))
           else tensor_type_for(spec, name, shape))
  if qtype == GGMLQuantizationType.F32:
    return qtype, shape, np.dtype(np.float32)
  if qtype == GGMLQuantizationType.F16:
    return qtype, shape, np.dtype(np.float16)
  block, type_size = GGML_QUANT_SIZES[qtype]
  return qtype, (*shape[:-1], shape[-1] // block * type_size), np.dtype(np.uint8)


def _generate(spec: TinyGlmSpec, name: str, shape: tuple[int, ...],
              stored: tuple[GGMLQuantizationType, tuple[int, ...], np.dtype], seed: int
              ) -> np.ndarray:
  """The stored bytes of one tensor, made and encoded a chunk of rows at a time."""
  qtype, stored_shape, dtype = stored
  out = np.empty(stored_shape, dtype)
  flat = out.reshape(-1, stored_shape[-1])
  rows_total = flat.shape[0]
  step = max(1, _CHUNK_ELEMENTS // shape[-1])
  for start in range(0, rows_total, step):
    rows = slice(start, min(start + step, rows_total))
    if qtype in KQUANT_SCALE_FIELDS:
      flat[rows] = _random_kquant_rows(qtype, _std(name, shape), rows.stop - rows.start,
                                       shape[-1], _rng(seed, name, rows))
    elif dtype == np.uint8:
      flat[rows] = encode_tiny_glm_tensor(spec, name, _values(seed, name, shape, rows))[0]
    else:
      flat[rows] = _values(seed, name, shape, rows)   # F32 or F16: a cast
  return out


def _add_mla_keys(w: gguf.GGUFWriter, v: GlmVariant, n_trunk_layers: int) -> None:
  arch, u32 = v.arch, gguf.GGUFValueType.UINT32

  def put(key: str, value, vtype=u32) -> None:
    w.add_key_value(f"{arch}.{key}", value, vtype)

  put("vocab_size", v.vocab_size)
  put("attention.q_lora_rank", v.q_lora)
  put("attention.kv_lora_rank", v.kv_lora)
  put("attention.key_length_mla", v.qk_nope + v.qk_rope)
  put("attention.value_length_mla", v.v_head)
  if arch == "glm-dsa":
    put("attention.indexer.head_count", v.indexer_heads)
    put("attention.indexer.key_length", v.indexer_dim)
    put("attention.indexer.top_k", v.index_topk)
    w.add_array(f"{arch}.attention.indexer.types", [True] * n_trunk_layers)


def write_synthetic_gguf(path: str | os.PathLike, v: GlmVariant, n_trunk_layers: int, *,
                         tensor_type: str = "F16", seed: int = 0) -> dict[str, int]:
  """Writes the variant at `n_trunk_layers` trunk layers (+ NextN) to `path`, atomically.

  `tensor_type` is a `tiny_glm` type (F32, F16, Q8_0, Q4_K, ...): K-quants get random blocks
  with sane f16 scales. Returns {ggml type name: tensor bytes} of what was written.
  """
  path = Path(path)
  spec = type_spec(v, n_trunk_layers, tensor_type)
  shapes = tensor_shapes(v, n_trunk_layers)
  by_type: dict[str, int] = {}
  with staged_gguf_writer(path, v.arch) as w:
    stored = {name: _stored(spec, name, shape) for name, shape in shapes.items()}
    for name, (qtype, stored_shape, dtype) in stored.items():
      nbytes = math.prod(stored_shape) * dtype.itemsize
      w.add_tensor_info(name, stored_shape, dtype, nbytes,
                        raw_dtype=qtype if dtype == np.uint8 else None)
      by_type[qtype.name] = by_type.get(qtype.name, 0) + nbytes
    add_model_keys(w, spec, f"synthetic-{v.name}", value_length=v.kv_lora if v.is_mla else None)
    if v.is_mla:
      _add_mla_keys(w, v, n_trunk_layers)
    w.add_string(VARIANT_KEY, v.name)
    w.add_uint32(REAL_LAYERS_KEY, v.real_layers)
    add_tokenizer(w, tiny_tokenizer_metadata(v.vocab_size))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, layout in stored.items():
      w.write_tensor_data(_generate(spec, name, shapes[name], layout, seed))
  return by_type
