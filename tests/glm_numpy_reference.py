"""A float32 plain-numpy GLM-4.x MoE forward (trunk + NextN head), the oracle for model tests.

Written from the math in docs/MODEL.md §5-§7 only, independently of
`mtpjax.models`, so that a shared misreading cannot make both agree. Weights are a dict of
float32 arrays by GGUF name in numpy `[out, in]` order (experts `[E, out, in]`), as
`build_tiny_glm_tensors` returns them or as `gguf.quants.dequantize` decodes them. Which
optional parts exist (bias, q/k norm, tied head, NextN fallbacks) is read from the dict.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

Weights = Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class HParams:
  """The hyper-parameters the math needs; everything else is implied by the weights."""
  n_trunk: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  rope_dims: int
  rope_theta: float
  eps: float
  leading_dense: int
  n_experts_used: int
  n_groups: int = 1
  groups_used: int = 1
  gating: str = "sigmoid"          # "sigmoid" | "softmax"
  routed_scale: float = 1.0
  norm_topk: bool = True

  @classmethod
  def from_spec(cls, spec: Any) -> "HParams":
    """From a `mtpjax.testing.tiny_glm.TinyGlmSpec`."""
    return cls(n_trunk=spec.n_trunk_layers, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
               head_dim=spec.head_dim, rope_dims=spec.rope_dims, rope_theta=spec.rope_theta,
               eps=spec.eps, leading_dense=spec.leading_dense,
               n_experts_used=spec.n_experts_used, n_groups=spec.n_groups,
               groups_used=spec.groups_used, routed_scale=spec.routed_scale,
               norm_topk=spec.norm_topk)

  @classmethod
  def from_gguf_metadata(cls, kv: Mapping[str, Any]) -> "HParams":
    """From GGUF key/values (`glm4moe.*`), with the defaults docs/MODEL.md §2 gives."""
    a = "glm4moe."
    n_heads = int(kv[a + "attention.head_count"])
    head_dim = int(kv.get(a + "attention.key_length",
                          int(kv[a + "embedding_length"]) // n_heads))
    scale = float(kv.get(a + "expert_weights_scale", 1.0))
    return cls(
        n_trunk=int(kv[a + "block_count"]) - int(kv.get(a + "nextn_predict_layers", 0)),
        n_heads=n_heads, n_kv_heads=int(kv.get(a + "attention.head_count_kv", n_heads)),
        head_dim=head_dim, rope_dims=int(kv.get(a + "rope.dimension_count", head_dim)),
        rope_theta=float(kv.get(a + "rope.freq_base", 10000.0)),
        eps=float(kv[a + "attention.layer_norm_rms_epsilon"]),
        leading_dense=int(kv.get(a + "leading_dense_block_count", 0)),
        n_experts_used=int(kv.get(a + "expert_used_count", 0)),
        n_groups=int(kv.get(a + "expert_group_count", 1)),
        groups_used=int(kv.get(a + "expert_group_used_count", 1)),
        gating="softmax" if int(kv.get(a + "expert_gating_func", 2)) == 1 else "sigmoid",
        routed_scale=1.0 if scale == 0.0 else scale,
        norm_topk=bool(kv.get(a + "expert_weights_norm", False)))


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
  x = x.astype(np.float32)
  return (w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))).astype(np.float32)


def _silu(x: np.ndarray) -> np.ndarray:
  return x / (1.0 + np.exp(-x))


def _swiglu(m: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
  return (_silu(m @ gate.T) * (m @ up.T)) @ down.T


def rope_neox(x: np.ndarray, positions: np.ndarray, rope_dims: int, theta: float) -> np.ndarray:
  """x [T, heads, hd]: rotate-half on the first `rope_dims` dims of each head, rest untouched."""
  half = rope_dims // 2
  j = np.arange(half, dtype=np.float64)
  angle = positions.astype(np.float64)[:, None] * theta ** (-2.0 * j / rope_dims)   # [T, half]
  cos = np.cos(angle)[:, None, :].astype(np.float32)
  sin = np.sin(angle)[:, None, :].astype(np.float32)
  lo, hi = x[..., :half], x[..., half:rope_dims]
  out = x.copy()
  out[..., :half] = lo * cos - hi * sin
  out[..., half:rope_dims] = hi * cos + lo * sin
  return out


def attention(w: Weights, p: str, hp: HParams, a: np.ndarray, positions: np.ndarray) -> np.ndarray:
  """Causal GQA self-attention of one block over all rows of `a` [T, D]."""
  T = a.shape[0]
  H, Hkv, hd = hp.n_heads, hp.n_kv_heads, hp.head_dim

  def proj(kind):
    out = a @ w[f"{p}attn_{kind}.weight"].T
    if f"{p}attn_{kind}.bias" in w:
      out = out + w[f"{p}attn_{kind}.bias"]
    return out

  q = proj("q").reshape(T, H, hd)
  k = proj("k").reshape(T, Hkv, hd)
  v = proj("v").reshape(T, Hkv, -1)
  if f"{p}attn_q_norm.weight" in w:
    q = rms(q, w[f"{p}attn_q_norm.weight"], hp.eps)
    k = rms(k, w[f"{p}attn_k_norm.weight"], hp.eps)
  q = rope_neox(q, positions, hp.rope_dims, hp.rope_theta)
  k = rope_neox(k, positions, hp.rope_dims, hp.rope_theta)
  group = H // Hkv
  causal = positions[None, :] <= positions[:, None]        # [query, key]
  heads = []
  for h in range(H):
    kv_head = h // group
    scores = (q[:, h] @ k[:, kv_head].T) / np.sqrt(hd)
    scores = np.where(causal, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    heads.append(probs @ v[:, kv_head])
  o = np.concatenate(heads, axis=-1)                        # [T, H * value_dim]
  return o @ w[f"{p}attn_output.weight"].T


def route(w: Weights, p: str, hp: HParams, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(expert ids [T, K], weights [T, K]) per docs/MODEL.md §6 step 7 (MoE 1-6)."""
  logits = (m @ w[f"{p}ffn_gate_inp.weight"].T).astype(np.float32)
  if hp.gating == "sigmoid":
    s = 1.0 / (1.0 + np.exp(-logits))
  else:
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    s = e / e.sum(axis=-1, keepdims=True)
  sel = s + w[f"{p}exp_probs_b.bias"] if f"{p}exp_probs_b.bias" in w else s.copy()
  T, E = sel.shape
  if hp.n_groups > 1:
    grouped = sel.reshape(T, hp.n_groups, E // hp.n_groups)
    group_score = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)      # [T, G]
    keep = np.argsort(-group_score, axis=-1, kind="stable")[:, :hp.groups_used]
    mask = np.zeros((T, hp.n_groups), bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    sel = np.where(np.repeat(mask, E // hp.n_groups, axis=-1), sel, -np.inf)
  idx = np.argsort(-sel, axis=-1, kind="stable")[:, :hp.n_experts_used]
  weights = np.take_along_axis(s, idx, axis=-1)
  if hp.norm_topk:
    weights = weights / weights.sum(axis=-1, keepdims=True)
  return idx, (weights * hp.routed_scale).astype(np.float32)


def moe(w: Weights, p: str, hp: HParams, m: np.ndarray) -> np.ndarray:
  idx, weights = route(w, p, hp, m)
  gate, up, down = (w[f"{p}ffn_{n}_exps.weight"] for n in ("gate", "up", "down"))
  out = np.zeros_like(m)
  for t in range(m.shape[0]):
    for e, wt in zip(idx[t], weights[t]):
      out[t] += wt * _swiglu(m[t:t + 1], gate[e], up[e], down[e])[0]
  if f"{p}ffn_gate_shexp.weight" in w:
    out += _swiglu(m, w[f"{p}ffn_gate_shexp.weight"], w[f"{p}ffn_up_shexp.weight"],
                   w[f"{p}ffn_down_shexp.weight"])
  return out


def block(w: Weights, layer: int, hp: HParams, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
  p = f"blk.{layer}."
  x = x + attention(w, p, hp, rms(x, w[p + "attn_norm.weight"], hp.eps), positions)
  m = rms(x, w[p + "post_attention_norm.weight"], hp.eps)
  if layer < hp.leading_dense:
    f = _swiglu(m, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])
  else:
    f = moe(w, p, hp, m)
  return (x + f).astype(np.float32)


def _head(w: Weights) -> np.ndarray:
  return w["output.weight"] if "output.weight" in w else w["token_embd.weight"]


def trunk_forward(w: Weights, hp: HParams, ids) -> tuple[np.ndarray, np.ndarray]:
  """(hidden after output_norm [T, D], logits [T, V]) of a causal pass at positions 0..T-1."""
  ids = np.asarray(ids).reshape(-1)
  positions = np.arange(ids.size)
  x = w["token_embd.weight"][ids].astype(np.float32)
  for layer in range(hp.n_trunk):
    x = block(w, layer, hp, x, positions)
  h = rms(x, w["output_norm.weight"], hp.eps)
  return h, h @ _head(w).T


def mtp_forward(w: Weights, hp: HParams, ids, hidden: np.ndarray) -> np.ndarray:
  """NextN logits [T, V]: row k = token ids[k] at position k with hidden[k-1] (zeros for k=0).

  `hidden` is the trunk hidden after output_norm (docs/MODEL.md §7); the NextN block attends
  causally over its own rows.
  """
  ids = np.asarray(ids).reshape(-1)
  L = hp.n_trunk
  p = f"blk.{L}.nextn."
  embed = w.get(p + "embed_tokens.weight", w["token_embd.weight"])
  prev = np.concatenate([np.zeros_like(hidden[:1]), hidden[:-1]], axis=0)
  u = np.concatenate([rms(embed[ids], w[p + "enorm.weight"], hp.eps),
                      rms(prev, w[p + "hnorm.weight"], hp.eps)], axis=-1)
  u = u @ w[p + "eh_proj.weight"].T
  y = block(w, L, hp, u.astype(np.float32), np.arange(ids.size))
  z = rms(y, w.get(p + "shared_head_norm.weight", w["output_norm.weight"]), hp.eps)
  return z @ w.get(p + "shared_head_head.weight", _head(w)).T


def read_gguf(path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """(key/values, float32 weights by name) of a single-file GGUF, via gguf-py only."""
  import gguf
  reader = gguf.GGUFReader(str(path))
  kv = {name: field.contents() for name, field in reader.fields.items()}
  weights = {}
  for t in reader.tensors:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    weights[t.name] = np.asarray(
        gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
  return kv, weights
