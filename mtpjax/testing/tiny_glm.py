"""Deterministic tiny synthetic GLM-4.x MoE GGUFs (arch `glm4moe`) for tests.

Files are written with the real gguf-py writer using llama.cpp's tensor names, tensor order,
key/value set and dtype policy, so they read exactly like `convert_hf_to_gguf.py` output
(compare tests/fixtures/glm4moe-tiny/glm4moe_h64-F32.gguf). No jax here: numpy only.

Weights are random but tuned for testing (docs/MODEL.md §11, §13): unit-scale embeddings and
logits with a clear argmax, and larger router weights plus a spread `exp_probs_b` so that
top-k expert choices are not near-ties. Each tensor's values depend only on (seed, name),
so toggling an optional tensor does not reshuffle the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import shutil
import tempfile
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType, TokenType

from mtpjax.gguf.tensors import keeps_f32
from mtpjax.gguf.tokenizer import DEFAULT_GLM_CHAT_TEMPLATE, glm_pre_tokenizer

ARCH = "glm4moe"

# The 10 GLM special tokens, in the order GLM's tokenizer (and the fixture) appends them.
SPECIAL_TOKENS = ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
                  "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")

# The minimal GLM chat template, as the glm4moe-tiny fixture carries it.
CHAT_TEMPLATE = DEFAULT_GLM_CHAT_TEMPLATE

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiny model is still a model: it has an
embedding, a stack of attention layers, a mixture of experts and an output head. Each token
is routed to the experts with the highest scores, and the shared expert is always on.
Speculative decoding drafts the next token with the multi-token prediction head, then the
trunk verifies the draft in one step; accepted tokens are committed to the cache.
def forward(self, tokens, positions):
    hidden = self.embed(tokens)
    for layer in self.layers:
        hidden = layer(hidden, positions)
    return self.head(self.norm(hidden))
Numbers such as 2024, 3.14159 and 1000000 are split into groups of three digits.
Hello, world! How are you today? I'm fine, thanks; we'll see what they've done.
Weights are stored in GGUF files, quantized to Q8_0 or Q4_K, and read back with numpy.
The router computes sigmoid scores, adds a bias to choose the experts, and normalises the
selected weights before scaling them by the routed scaling factor of two and a half.
"""

# Per-tensor init scales (std of the normal draw), chosen for a well-behaved tiny model.
_NORM_JITTER = 0.1       # norm weights are 1 + N(0, 0.1)
_BIAS_STD = 0.1
_ROUTER_GAIN = 3.0       # router logits have std ~3: sigmoid scores spread over (0, 1)
_EXP_BIAS_SPAN = 1.5     # exp_probs_b: a permuted Sidon set over [-0.75, 0.75]
_HEAD_GAIN = 2.0         # logits have std ~2
_COPY_TRUNK_MIX = 0.01   # mtp_copies_trunk: trunk residual branches scaled down by this

_FILE_TYPES = {
    "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16, "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": LlamaFileType.MOSTLY_Q5_0, "Q5_1": LlamaFileType.MOSTLY_Q5_1,
    "Q2_K": LlamaFileType.MOSTLY_Q2_K, "Q3_K": LlamaFileType.MOSTLY_Q3_K_S,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_S, "Q5_K": LlamaFileType.MOSTLY_Q5_K_S,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K,
}
# gguf-py cannot quantize K-quants: these get random blocks with sane f16 scales (docs/MODEL.md
# §11). Value: byte offsets of the f16 `d` and `dmin` fields in a block (None: no dmin).
KQUANT_SCALE_FIELDS = {
    GGMLQuantizationType.Q2_K: (80, 82), GGMLQuantizationType.Q3_K: (108, None),
    GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208, None),
}


@dataclasses.dataclass(frozen=True)
class TinyGlmSpec:
  """Shape and options of a tiny GLM-4.x MoE model; defaults mirror the glm4moe-tiny fixture."""
  vocab_size: int = 512
  hidden: int = 64
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  n_trunk_layers: int = 3
  leading_dense: int = 1
  ffn: int = 128
  n_experts: int = 8
  n_experts_used: int = 2
  n_shared_experts: int = 1
  expert_ffn: int = 32
  n_groups: int = 2
  groups_used: int = 1
  rope_dims: int = 16
  rope_theta: float = 10000.0
  eps: float = 1e-5
  attn_bias: bool = True
  qk_norm: bool = True
  tied_head: bool = False
  mtp: bool = True
  nextn_embed: bool = False
  nextn_head: bool = True
  nextn_head_norm: bool = True
  routed_scale: float = 2.5
  norm_topk: bool = True
  context_length: int = 4096
  # Type of 2-D/3-D weights. 1-D tensors, *_norm and ffn_gate_inp stay F32; a tensor whose
  # row (ne[0]) is not a multiple of the type's block falls back to Q8_0 (or F16).
  tensor_type: str = "F32"
  # Trunk mixing scaled down and the NextN block set so that its draft equals the trunk's
  # argmax for the current token alone: an MTP head with a high acceptance rate.
  mtp_copies_trunk: bool = False
  seed: int = 0

  @property
  def block_count(self) -> int:
    return self.n_trunk_layers + (1 if self.mtp else 0)

  @property
  def nextn_block(self) -> int | None:
    """Index of the NextN block `blk.L`, or None without MTP."""
    return self.n_trunk_layers if self.mtp else None


def _validate(spec: TinyGlmSpec) -> None:
  problems = []
  if spec.tensor_type not in _FILE_TYPES:
    problems.append(f"tensor_type {spec.tensor_type!r} is not one of {sorted(_FILE_TYPES)}")
  if spec.n_heads % spec.n_kv_heads:
    problems.append("n_heads must be a multiple of n_kv_heads")
  if spec.rope_dims % 2 or not 0 < spec.rope_dims <= spec.head_dim:
    problems.append("rope_dims must be even and in (0, head_dim]")
  if spec.n_experts % spec.n_groups:
    problems.append("n_experts must be a multiple of n_groups")
  elif spec.n_groups > 1 and spec.n_experts // spec.n_groups < 2:
    problems.append("group-limited routing ranks groups by their top-2 experts: "
                    "need >= 2 experts per group")
  if not 1 <= spec.groups_used <= spec.n_groups:
    problems.append("groups_used must be in [1, n_groups]")
  elif spec.n_experts_used > spec.groups_used * (spec.n_experts // spec.n_groups):
    problems.append("n_experts_used exceeds the experts in the kept groups")
  if not 0 <= spec.leading_dense <= spec.n_trunk_layers:
    problems.append("leading_dense must be in [0, n_trunk_layers]")
  if spec.vocab_size < 256 + 1 + len(SPECIAL_TOKENS):
    problems.append(f"vocab_size must be >= {256 + 1 + len(SPECIAL_TOKENS)} "
                    "(byte alphabet + one merge + the GLM special tokens)")
  if spec.mtp_copies_trunk and not spec.mtp:
    problems.append("mtp_copies_trunk needs mtp=True")
  if problems:
    raise ValueError(f"invalid TinyGlmSpec: {'; '.join(problems)}")


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _byte_alphabet() -> list[str]:
  """GPT-2 byte-level alphabet: printable bytes map to themselves, others to U+0100 onwards.

  Returned sorted by code point, which is the order HF's BPE trainer gives the 256 base tokens.
  """
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  chars = [chr(b) for b in printable]
  chars += [chr(0x100 + i) for i in range(256 - len(printable))]
  return sorted(chars)


@functools.lru_cache(maxsize=8)
def _learn_vocab(n_regular: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """Byte alphabet + merges learned greedily from `_CORPUS` (ties broken lexicographically)."""
  words = Counter(piece for piece, _ in glm_pre_tokenizer().pre_tokenize_str(_CORPUS))
  words = {tuple(w): n for w, n in words.items()}
  tokens = _byte_alphabet()
  merges = []
  while len(tokens) < n_regular:
    pairs = Counter()
    for w, n in words.items():
      for pair in zip(w, w[1:]):
        pairs[pair] += n
    if not pairs:
      break
    best = min(pairs, key=lambda p: (-pairs[p], p))
    merged = best[0] + best[1]
    merges.append(f"{best[0]} {best[1]}")
    tokens.append(merged)
    new_words = {}
    for w, n in words.items():
      out, i = [], 0
      while i < len(w):
        if i + 1 < len(w) and (w[i], w[i + 1]) == best:
          out.append(merged)
          i += 2
        else:
          out.append(w[i])
          i += 1
      new_words[tuple(out)] = new_words.get(tuple(out), 0) + n
    words = new_words
  return tuple(tokens), tuple(merges)


def tiny_tokenizer_metadata(vocab_size: int = 512) -> dict[str, Any]:
  """GGUF tokenizer key/values of a small byte-level BPE vocab (gpt2 model, pre `glm4`).

  Regular tokens first (256 bytes, then one token per merge, `[PAD{i}]` UNUSED fillers if the
  corpus runs out of merges), then the 10 GLM specials as CONTROL tokens, as the fixture has
  them. Values are plain Python, as `ReaderField.contents()` returns them.
  """
  if vocab_size < 256 + 1 + len(SPECIAL_TOKENS):
    raise ValueError(f"vocab_size must be >= {256 + 1 + len(SPECIAL_TOKENS)}: the byte alphabet, "
                     "one merge (llama.cpp needs one) and the GLM special tokens")
  n_regular = vocab_size - len(SPECIAL_TOKENS)
  learned, merges = _learn_vocab(n_regular)
  tokens = list(learned) + [f"[PAD{i}]" for i in range(len(learned), n_regular)]
  types = [int(TokenType.NORMAL)] * len(learned)
  types += [int(TokenType.UNUSED)] * (n_regular - len(learned))
  return glm_tokenizer_metadata(tokens, types, merges)


def glm_tokenizer_metadata(tokens: list[str], token_types: list[int],
                           merges: list[str]) -> dict[str, Any]:
  """GGUF tokenizer key/values for a byte-level BPE vocab followed by the 10 GLM specials.

  `tokens` and `token_types` are the regular vocabulary in id order; the specials are appended
  as CONTROL tokens with GLM's bos/eos/eot/eom roles, plus the GLM chat template.
  """
  n_regular = len(tokens)
  ids = {tok: n_regular + i for i, tok in enumerate(SPECIAL_TOKENS)}
  return {
      "tokenizer.ggml.model": "gpt2",
      "tokenizer.ggml.pre": "glm4",
      "tokenizer.ggml.tokens": list(tokens) + list(SPECIAL_TOKENS),
      "tokenizer.ggml.token_type": (list(token_types)
                                    + [int(TokenType.CONTROL)] * len(SPECIAL_TOKENS)),
      "tokenizer.ggml.merges": list(merges),
      "tokenizer.ggml.eos_token_id": ids["<|endoftext|>"],
      "tokenizer.ggml.unknown_token_id": ids["<|endoftext|>"],
      "tokenizer.ggml.padding_token_id": ids["<|endoftext|>"],
      "tokenizer.ggml.bos_token_id": ids["[gMASK]"],
      "tokenizer.ggml.eot_token_id": ids["<|user|>"],
      "tokenizer.ggml.eom_token_id": ids["<|observation|>"],
      "tokenizer.chat_template": CHAT_TEMPLATE,
  }


def add_tokenizer(w: gguf.GGUFWriter, meta: dict[str, Any]) -> None:
  w.add_tokenizer_model(meta["tokenizer.ggml.model"])
  w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
  w.add_token_list(meta["tokenizer.ggml.tokens"])
  w.add_token_types(meta["tokenizer.ggml.token_type"])
  w.add_token_merges(meta["tokenizer.ggml.merges"])
  w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
  w.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
  w.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
  w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
  w.add_eot_token_id(meta["tokenizer.ggml.eot_token_id"])
  w.add_eom_token_id(meta["tokenizer.ggml.eom_token_id"])
  w.add_chat_template(meta["tokenizer.chat_template"])


# ---------------------------------------------------------------------------------------------
# Weights


def _sidon_grid(n: int, span: float) -> np.ndarray:
  """n values in [-span/2, span/2] whose pairwise sums are all distinct (Erdos-Turan marks).

  Group-limited routing ranks groups by the sum of their top-2 scores; with an evenly spaced
  bias two groups could tie exactly, with a Sidon set they never do.
  """
  prime = next(q for q in range(max(n, 2), 4 * n + 4) if all(q % d for d in range(2, q)))
  marks = np.array([2 * prime * k + (k * k) % prime for k in range(n)], np.float64)
  return (marks / max(marks[-1], 1.0) - 0.5) * span


def build_tiny_glm_tensors(spec: TinyGlmSpec = TinyGlmSpec()) -> dict[str, np.ndarray]:
  """Float32 master weights, numpy `[out, in]` (experts `[E, out, in]`), GGUF names.

  The dict is in llama.cpp's converter order (the order the file is written in).
  """
  _validate(spec)
  D, V, hd = spec.hidden, spec.vocab_size, spec.head_dim
  q_dim, kv_dim = spec.n_heads * hd, spec.n_kv_heads * hd
  E, FFe = spec.n_experts, spec.expert_ffn
  sh = FFe * spec.n_shared_experts
  t: dict[str, np.ndarray] = {}

  def rng(name):
    return np.random.default_rng([spec.seed, zlib.crc32(name.encode())])

  def linear(name, out_dim, in_dim, *lead, gain=1.0):
    std = gain / math.sqrt(in_dim)
    t[name] = (rng(name).standard_normal((*lead, out_dim, in_dim)) * std).astype(np.float32)

  def norm(name, n):
    t[name] = (1.0 + _NORM_JITTER * rng(name).standard_normal(n)).astype(np.float32)

  def bias(name, n):
    t[name] = (_BIAS_STD * rng(name).standard_normal(n)).astype(np.float32)

  if not spec.tied_head:
    linear("output.weight", V, D, gain=_HEAD_GAIN)
  t["token_embd.weight"] = rng("token_embd.weight").standard_normal((V, D)).astype(np.float32)
  for i in range(spec.block_count):
    p = f"blk.{i}."
    nextn = i == spec.nextn_block
    if nextn:
      linear(p + "nextn.eh_proj.weight", D, 2 * D)
      if spec.nextn_embed:
        t[p + "nextn.embed_tokens.weight"] = (
            rng(p + "nextn.embed_tokens.weight").standard_normal((V, D)).astype(np.float32))
      norm(p + "nextn.enorm.weight", D)
      norm(p + "nextn.hnorm.weight", D)
    norm(p + "attn_norm.weight", D)
    if i < spec.leading_dense and not nextn:
      linear(p + "ffn_down.weight", D, spec.ffn)
      linear(p + "ffn_gate.weight", spec.ffn, D)
      linear(p + "ffn_up.weight", spec.ffn, D)
    else:
      linear(p + "ffn_down_exps.weight", D, FFe, E)
      linear(p + "ffn_gate_exps.weight", FFe, D, E)
      linear(p + "ffn_up_exps.weight", FFe, D, E)
      t[p + "exp_probs_b.bias"] = rng(p + "exp_probs_b.bias").permutation(
          _sidon_grid(E, _EXP_BIAS_SPAN)).astype(np.float32)
      linear(p + "ffn_gate_inp.weight", E, D, gain=_ROUTER_GAIN)
      if sh:
        linear(p + "ffn_down_shexp.weight", D, sh)
        linear(p + "ffn_gate_shexp.weight", sh, D)
        linear(p + "ffn_up_shexp.weight", sh, D)
    norm(p + "post_attention_norm.weight", D)
    if spec.qk_norm:
      norm(p + "attn_k_norm.weight", hd)
    if spec.attn_bias:
      bias(p + "attn_k.bias", kv_dim)
    linear(p + "attn_k.weight", kv_dim, D)
    linear(p + "attn_output.weight", D, q_dim)
    if spec.qk_norm:
      norm(p + "attn_q_norm.weight", hd)
    if spec.attn_bias:
      bias(p + "attn_q.bias", q_dim)
    linear(p + "attn_q.weight", q_dim, D)
    if spec.attn_bias:
      bias(p + "attn_v.bias", kv_dim)
    linear(p + "attn_v.weight", kv_dim, D)
    if nextn and spec.nextn_head:
      linear(p + "nextn.shared_head_head.weight", V, D, gain=_HEAD_GAIN)
    if nextn and spec.nextn_head_norm:
      norm(p + "nextn.shared_head_norm.weight", D)
  norm("output_norm.weight", D)
  if spec.mtp_copies_trunk:
    _make_mtp_copy_trunk(spec, t)
  return t


def _make_mtp_copy_trunk(spec: TinyGlmSpec, t: dict[str, np.ndarray]) -> None:
  """Trunk logits ~ f(current token); NextN draft == argmax f(token) (docs/MODEL.md §7 rows).

  Trunk residual branches shrink, so the final hidden is ~ the token's embedding. The NextN
  block passes rms(embedding) straight through: eh_proj = [I | 0], zero attention output and
  FFN down weights, unit norms, and the trunk's own head.
  """
  D = spec.hidden
  for i in range(spec.n_trunk_layers):
    for suffix in ("attn_output", "ffn_down", "ffn_down_exps", "ffn_down_shexp"):
      name = f"blk.{i}.{suffix}.weight"
      if name in t:
        t[name] = (t[name] * _COPY_TRUNK_MIX).astype(np.float32)
  p = f"blk.{spec.nextn_block}."
  t[p + "nextn.eh_proj.weight"] = np.concatenate(
      [np.eye(D, dtype=np.float32), np.zeros((D, D), np.float32)], axis=1)
  for name in ("nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight"):
    if p + name in t:
      t[p + name] = np.ones(D, np.float32)
  t["output_norm.weight"] = np.ones(D, np.float32)
  for suffix in ("attn_output", "ffn_down_exps", "ffn_down_shexp"):
    if p + suffix + ".weight" in t:
      t[p + suffix + ".weight"] = np.zeros_like(t[p + suffix + ".weight"])
  head = t["token_embd.weight"] if spec.tied_head else t["output.weight"]
  if p + "nextn.shared_head_head.weight" in t:
    t[p + "nextn.shared_head_head.weight"] = head.copy()
  if p + "nextn.embed_tokens.weight" in t:
    t[p + "nextn.embed_tokens.weight"] = t["token_embd.weight"].copy()


# ---------------------------------------------------------------------------------------------
# Encoding


def tensor_type_for(spec: TinyGlmSpec, name: str, shape: tuple[int, ...]) -> GGMLQuantizationType:
  """The ggml type `name` is stored as, following llama.cpp's per-tensor policy."""
  if keeps_f32(name, len(shape)):
    return GGMLQuantizationType.F32
  want = GGMLQuantizationType[spec.tensor_type]
  if spec.mtp_copies_trunk and name.endswith("nextn.eh_proj.weight") and (
      want in KQUANT_SCALE_FIELDS):
    want = GGMLQuantizationType.Q8_0  # random K-quant blocks would destroy the identity
  if shape[-1] % GGML_QUANT_SIZES[want][0] == 0:
    return want
  q8_block = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][0]
  return GGMLQuantizationType.Q8_0 if shape[-1] % q8_block == 0 else GGMLQuantizationType.F16


def set_f16(blocks: np.ndarray, offset: int, values) -> np.ndarray:
  out = blocks.copy()
  half = np.broadcast_to(np.asarray(values, np.float16), (len(blocks),)).copy()
  out[:, offset:offset + 2] = half.view(np.uint8).reshape(-1, 2)
  return out


def random_kquant(a: np.ndarray, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
  """Random K-quant bytes whose blocks match `a`'s per-block std with ~zero mean.

  Dequantized values are linear in the f16 `d`/`dmin` fields, so decode the random block once
  with d=1 and once with dmin=1, then pick dmin/d to cancel the mean and d to set the std.
  The bytes depend only on `a`'s contents, so copied tensors stay byte-identical.
  """
  block, type_size = GGML_QUANT_SIZES[qtype]
  d_off, m_off = KQUANT_SCALE_FIELDS[qtype]
  x = a.reshape(-1, block).astype(np.float64)
  rng = np.random.default_rng([seed, zlib.crc32(a.tobytes())])
  raw = rng.integers(0, 256, size=(x.shape[0], type_size), dtype=np.uint8)
  zero = set_f16(raw, d_off, 0.0)
  if m_off is not None:
    zero = set_f16(zero, m_off, 0.0)
  base = gguf.quants.dequantize(set_f16(zero, d_off, 1.0), qtype).astype(np.float64)
  ratio = np.zeros(len(x))
  if m_off is not None:
    offset = gguf.quants.dequantize(set_f16(zero, m_off, 1.0), qtype).astype(np.float64)
    mean_off = offset.mean(axis=1)
    ratio = np.divide(base.mean(axis=1), -mean_off, out=np.zeros(len(x)), where=mean_off != 0)
    base = base + ratio[:, None] * offset
  spread = base.std(axis=1)
  d = np.divide(x.std(axis=1), spread, out=np.zeros(len(x)), where=spread > 0)
  out = set_f16(zero, d_off, d)
  if m_off is not None:
    out = set_f16(out, m_off, d * ratio)
  return out.reshape(*a.shape[:-1], a.shape[-1] // block * type_size)


def encode_tiny_glm_tensor(spec: TinyGlmSpec, name: str, a: np.ndarray
                           ) -> tuple[np.ndarray, GGMLQuantizationType]:
  """(array to hand to GGUFWriter.add_tensor, its ggml type) for one master weight."""
  qtype = tensor_type_for(spec, name, a.shape)
  if qtype == GGMLQuantizationType.F32:
    return a.astype(np.float32), qtype
  if qtype == GGMLQuantizationType.F16:
    return a.astype(np.float16), qtype
  if qtype in KQUANT_SCALE_FIELDS:
    return random_kquant(a, qtype, spec.seed), qtype
  return gguf.quants.quantize(a, qtype), qtype


def stored_tiny_glm_tensors(spec: TinyGlmSpec = TinyGlmSpec()) -> dict[str, np.ndarray]:
  """Float32 values a correct reader must get back from the file (dequantized storage)."""
  out = {}
  for name, a in build_tiny_glm_tensors(spec).items():
    data, qtype = encode_tiny_glm_tensor(spec, name, a)
    out[name] = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(a.shape)
  return out


# ---------------------------------------------------------------------------------------------
# Writing


def add_model_keys(w: gguf.GGUFWriter, spec: TinyGlmSpec, model_name: str, *,
                   value_length: int | None = None) -> None:
  """Key/values in the order llama.cpp's converter writes them for glm4moe (`value_length`:
  an MLA model's latent width instead of the head width).

  Call after the tensors are added: `general.size_label` is computed from them.
  """
  w.add_type("model")
  w.add_name(model_name)
  w.add_size_label(gguf.size_label(*w.get_total_parameter_count()))
  w.add_block_count(spec.block_count)
  w.add_context_length(spec.context_length)
  w.add_embedding_length(spec.hidden)
  w.add_feed_forward_length(spec.ffn)
  w.add_head_count(spec.n_heads)
  w.add_head_count_kv(spec.n_kv_heads)
  w.add_rope_freq_base(spec.rope_theta)
  w.add_layer_norm_rms_eps(spec.eps)
  w.add_expert_count(spec.n_experts)
  w.add_expert_used_count(spec.n_experts_used)
  w.add_expert_group_count(spec.n_groups)
  w.add_expert_group_used_count(spec.groups_used)
  w.add_key_length(spec.head_dim)
  w.add_value_length(spec.head_dim if value_length is None else value_length)
  w.add_file_type(_FILE_TYPES[spec.tensor_type])
  w.add_rope_dimension_count(spec.rope_dims)
  w.add_expert_feed_forward_length(spec.expert_ffn)
  w.add_expert_shared_count(spec.n_shared_experts)
  w.add_leading_dense_block_count(spec.leading_dense)
  w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
  w.add_expert_weights_scale(spec.routed_scale)
  w.add_expert_weights_norm(spec.norm_topk)
  if spec.mtp:
    w.add_nextn_predict_layers(1)
  w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_tiny_glm_gguf(path: str | os.PathLike, spec: TinyGlmSpec = TinyGlmSpec(), *,
                        split_max_tensors: int | None = None) -> list[Path]:
  """Writes the generated model (weights + tokenizer) and returns the written paths."""
  return write_glm_gguf(path, spec, build_tiny_glm_tensors(spec),
                        tiny_tokenizer_metadata(spec.vocab_size),
                        split_max_tensors=split_max_tensors)


@contextlib.contextmanager
def staged_gguf_writer(path: str | os.PathLike, arch: str):
  """A `GGUFWriter` on a temporary file next to `path`, renamed into place when the block
  finishes without error (so a crash never leaves a partial GGUF) and removed otherwise."""
  path = Path(path)
  fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
  os.close(fd)
  w = gguf.GGUFWriter(tmp, arch)
  try:
    yield w
    w.close()
    os.replace(tmp, path)
  finally:
    w.close()
    if os.path.exists(tmp):
      os.unlink(tmp)


def write_glm_gguf(path: str | os.PathLike, spec: TinyGlmSpec, tensors: dict[str, np.ndarray],
                   tokenizer_metadata: dict[str, Any], *, split_max_tensors: int | None = None,
                   model_name: str = "tiny-glm4moe") -> list[Path]:
  """Writes float32 `tensors` (GGUF names, [out, in]) stored as `spec.tensor_type`, with the
  glm4moe keys of `spec` and the given tokenizer key/values; returns the written paths.

  With `split_max_tensors`, gguf-py's own splitting writes `stem-0000k-of-0000n.gguf` shards
  (shard 1 holds every key/value; all carry `split.*`). Files are written into a temporary
  folder next to `path` and renamed into place, so a crash never leaves a partial GGUF.
  """
  path = Path(path)
  tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
  w = gguf.GGUFWriter(tmp_dir / path.name, ARCH, split_max_tensors=split_max_tensors or 0)
  try:
    for name, a in tensors.items():
      data, qtype = encode_tiny_glm_tensor(spec, name, a)
      if data.dtype == np.uint8:
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
      else:
        w.add_tensor(name, data)
    add_model_keys(w, spec, model_name)
    add_tokenizer(w, tokenizer_metadata)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()  # flushes every shard before the rename
    written = w.format_shard_names(path)
    for final in written:
      os.replace(tmp_dir / final.name, final)
  finally:
    w.close()
    shutil.rmtree(tmp_dir, ignore_errors=True)
  return written
