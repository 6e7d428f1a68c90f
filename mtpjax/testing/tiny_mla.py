"""A deterministic tiny `glm-dsa` GGUF (MLA + lightning indexer, dense FFN) for sparse tests.

The fixtures' index_topk (2048) exceeds any test context, so they never exercise the sparse
selection. This builder writes a small model whose `index_topk` is a few rows, with llama.cpp's
tensor names and numpy shapes (docs/MODEL.md §8-§9), through the real gguf-py writer. It has no
experts, so a plain-numpy reference of the whole forward stays short; `mtp=True` adds a dense
NextN block (no indexer, as llama.cpp runs it) for native-MTP decoding tests.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from pathlib import Path

import gguf
import numpy as np

from mtpjax.testing.tiny_glm import add_tokenizer, staged_gguf_writer, tiny_tokenizer_metadata

ARCH = "glm-dsa"


@dataclasses.dataclass(frozen=True)
class TinyDsaSpec:
  hidden: int = 32
  n_heads: int = 2
  q_lora: int = 16
  kv_lora: int = 16
  qk_nope: int = 8
  qk_rope: int = 8
  v_head: int = 8
  ffn: int = 48
  n_layers: int = 2
  indexer_heads: int = 2
  indexer_dim: int = 16
  index_topk: int = 4
  indexer_types: tuple[bool, ...] = (True, False)   # layer 1 reuses layer 0's selection
  mtp: bool = False                                  # add NextN block blk.{n_layers}
  vocab_size: int = 300
  rope_theta: float = 10000.0
  eps: float = 1e-5
  seed: int = 0


def build_tiny_dsa_tensors(spec: TinyDsaSpec = TinyDsaSpec()) -> dict[str, np.ndarray]:
  """GGUF name -> float32 array in numpy (reversed-ne) shape; values depend on (seed, name)."""
  d, h = spec.hidden, spec.n_heads
  shapes = {"token_embd.weight": (spec.vocab_size, d), "output_norm.weight": (d,),
            "output.weight": (spec.vocab_size, d)}
  for i in range(spec.n_layers + (1 if spec.mtp else 0)):
    p = f"blk.{i}."
    shapes.update({
        p + "attn_norm.weight": (d,),
        p + "attn_q_a.weight": (spec.q_lora, d),
        p + "attn_q_a_norm.weight": (spec.q_lora,),
        p + "attn_q_b.weight": (h * (spec.qk_nope + spec.qk_rope), spec.q_lora),
        p + "attn_kv_a_mqa.weight": (spec.kv_lora + spec.qk_rope, d),
        p + "attn_kv_a_norm.weight": (spec.kv_lora,),
        p + "attn_k_b.weight": (h, spec.kv_lora, spec.qk_nope),
        p + "attn_v_b.weight": (h, spec.v_head, spec.kv_lora),
        p + "attn_output.weight": (d, h * spec.v_head),
        p + "ffn_norm.weight": (d,),
        p + "ffn_gate.weight": (spec.ffn, d),
        p + "ffn_up.weight": (spec.ffn, d),
        p + "ffn_down.weight": (d, spec.ffn),
    })
    if i == spec.n_layers:
      shapes.update({
          p + "nextn.eh_proj.weight": (d, 2 * d),
          p + "nextn.enorm.weight": (d,),
          p + "nextn.hnorm.weight": (d,),
          p + "nextn.shared_head_head.weight": (spec.vocab_size, d),
          p + "nextn.shared_head_norm.weight": (d,),
      })
    elif spec.indexer_types[i]:
      shapes.update({
          p + "indexer.attn_q_b.weight": (spec.indexer_heads * spec.indexer_dim, spec.q_lora),
          p + "indexer.attn_k.weight": (spec.indexer_dim, d),
          p + "indexer.k_norm.weight": (spec.indexer_dim,),
          p + "indexer.k_norm.bias": (spec.indexer_dim,),
          p + "indexer.proj.weight": (spec.indexer_heads, d),
      })
  out = {}
  for name, shape in shapes.items():
    rng = np.random.default_rng([spec.seed, zlib.crc32(name.encode())])
    if len(shape) == 1:
      base = 0.0 if name.endswith(".bias") else 1.0
      out[name] = (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    else:
      fan_in = shape[-1]
      scale = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(fan_in)
      out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
  return out


def write_tiny_dsa_gguf(path: str | os.PathLike, spec: TinyDsaSpec = TinyDsaSpec()
                        ) -> dict[str, np.ndarray]:
  """Write the model (weights + tokenizer) to `path` atomically; returns the tensors."""
  path = Path(path)
  tensors = build_tiny_dsa_tensors(spec)
  with staged_gguf_writer(path, ARCH) as w:
    for name, a in tensors.items():
      w.add_tensor(name, a)
    w.add_type("model")
    w.add_name("tiny-glm-dsa")
    w.add_block_count(spec.n_layers + (1 if spec.mtp else 0))
    if spec.mtp:
      w.add_nextn_predict_layers(1)
    w.add_context_length(4096)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.eps)
    w.add_leading_dense_block_count(spec.n_layers)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_vocab_size(spec.vocab_size)
    u32 = gguf.GGUFValueType.UINT32
    w.add_key_value(f"{ARCH}.attention.q_lora_rank", spec.q_lora, u32)
    w.add_key_value(f"{ARCH}.attention.kv_lora_rank", spec.kv_lora, u32)
    w.add_key_length(spec.kv_lora + spec.qk_rope)
    w.add_value_length(spec.kv_lora)
    w.add_key_value(f"{ARCH}.attention.key_length_mla", spec.qk_nope + spec.qk_rope, u32)
    w.add_key_value(f"{ARCH}.attention.value_length_mla", spec.v_head, u32)
    w.add_rope_dimension_count(spec.qk_rope)
    w.add_key_value(f"{ARCH}.attention.indexer.head_count", spec.indexer_heads, u32)
    w.add_key_value(f"{ARCH}.attention.indexer.key_length", spec.indexer_dim, u32)
    w.add_key_value(f"{ARCH}.attention.indexer.top_k", spec.index_topk, u32)
    w.add_array(f"{ARCH}.attention.indexer.types", list(spec.indexer_types))
    add_tokenizer(w, tiny_tokenizer_metadata(spec.vocab_size))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
  return tensors
