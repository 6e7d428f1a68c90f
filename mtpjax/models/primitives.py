"""The numeric building blocks every architecture shares: norms, RoPE and weight-owning modules.

Projection and expert weights live in modules that do their own contraction (`Linear`,
`HeadProjection`, `Einsum`, `ffn.Experts`), so a new weight representation (integers with
scales) or kernel is a swap of these modules plus a loader rule, never a hunt through call
sites. A `Linear` or `HeadProjection` weight may be a `quantized.QuantizedTensor` instead (the
loader swaps it in), kept in GGUF layout (`[out, in]`, `[H, out, in]`).

`Linear` stores its matrix `[in, out]`, the transpose of GGUF's `[out, in]` (the loader
transposes it): `x @ W` over row-major `[in, out]` keeps a verify pass of 2 rows (and any small
batch) about as cheap as 1 row on XLA:CPU, where `[out, in]` takes a slower GEMM path. Norms,
RoPE, router and softmax run in float32 whatever the weight dtype.

Each module that contracts or reduces over a row (norms, dense weights) holds the model's
`kernels` (`quantized.with_kernels`): in a decode or verify step it computes its rows in fixed
tiles (`Kernels.per_row`), since XLA picks a dot's or a reduction's code by its shape and a
row would otherwise round one way alone and another beside a verify pass's rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtpjax.kernels import backend
from mtpjax.models import quantized


class LinearWeight(nnx.Param):
  """A projection matrix stored `[in, out]`: the transpose of its GGUF tensor."""


class GgufWeight(nnx.Param):
  """A matrix (or stack) stored in its GGUF layout, blocks along the last axis: embeddings and
  experts. The loader may replace it (like a `LinearWeight`) by a `quantized.QuantizedTensor`."""


def zeros_param(shape, dtype) -> nnx.Param:
  """A parameter to be filled by the loader (shapes only matter until then)."""
  return nnx.Param(jnp.zeros(shape, dtype))


class Linear(nnx.Module):
  """`x @ weight (+ bias)` with `weight` [in, out] (a `LinearWeight`), or a quantized
  `[out, in]` GGUF tensor, and a float32 bias."""

  def __init__(self, in_dim: int, out_dim: int, dtype, *, bias: bool = False):
    self.weight = LinearWeight(jnp.zeros((in_dim, out_dim), dtype))
    self.bias = zeros_param((out_dim,), jnp.float32) if bias else None
    self.kernels = backend.default()

  def __call__(self, x: jax.Array) -> jax.Array:
    if isinstance(self.weight, quantized.QuantizedTensor):
      y = quantized.matmul(x, self.weight)
    else:
      w = self.weight[...].astype(x.dtype)
      y = self.kernels.per_row(lambda rows: jnp.einsum("...i,io->...o", rows, w), x, x.ndim - 1)
    return self.plus_bias(y)

  def plus_bias(self, y: jax.Array) -> jax.Array:
    return y if self.bias is None else y + self.bias[...].astype(y.dtype)


def project(x: jax.Array, *linears: Linear) -> list[jax.Array]:
  """`x` through several `Linear`s that read the same rows (q, k and v): one native kernel call
  for them all where each would take the kernel on its own (XLA:CPU decode rows of quantized
  weights; `quantized.matmuls`), which saves a call's fixed cost each, else a call each."""
  ys = quantized.matmuls(x, [linear.weight for linear in linears])
  if ys is None:
    return [linear(x) for linear in linears]
  return [linear.plus_bias(y) for linear, y in zip(linears, ys)]


class Einsum(nnx.Module):
  """A dense weight contracted with rows by a fixed einsum `spec` ("nd,weight->n..."), in
  float32 (the MoE router)."""

  def __init__(self, spec: str, shape: tuple[int, ...], dtype):
    self.spec = spec
    self.weight = zeros_param(shape, dtype)
    self.kernels = backend.default()

  def __call__(self, x: jax.Array) -> jax.Array:
    w = self.weight[...].astype(jnp.float32)
    return self.kernels.per_row(
        lambda rows: jnp.einsum(self.spec, rows.astype(jnp.float32), w), x, x.ndim - 1)


class HeadProjection(nnx.Module):
  """One `[out, in]` matrix per head, `[H, out, in]` in GGUF layout (MLA's absorbed `attn_k_b`
  / `attn_v_b`), applied to `x [..., H, in]`: `[..., H, out]` in float32.

  The loader may swap in a `quantized.QuantizedTensor`, as for a `Linear`: GLM-4.7-Flash's
  are Q5_0 / Q4_K, about 30% of their bfloat16 bytes at every decode step, and exact.
  """

  def __init__(self, heads: int, out_dim: int, in_dim: int, dtype):
    self.weight = GgufWeight(jnp.zeros((heads, out_dim, in_dim), dtype))
    self.kernels = backend.default()

  def __call__(self, x: jax.Array) -> jax.Array:
    if isinstance(self.weight, quantized.QuantizedTensor):
      return quantized.contract_heads(x, self.weight)
    w = self.weight[...].astype(jnp.float32)
    return self.kernels.per_row(
        lambda rows: jnp.einsum("...hi,hoi->...ho", rows.astype(jnp.float32), w), x, x.ndim - 2)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """HF/llama.cpp RMSNorm: normalise in float32, cast back, then scale."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * normed.astype(x.dtype)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float):
    self.weight = zeros_param((dim,), jnp.float32)
    self.eps = eps
    self.kernels = backend.default()

  def __call__(self, x: jax.Array) -> jax.Array:
    weight = self.weight[...]
    return self.kernels.per_row(lambda rows: rms_norm(rows, weight, self.eps), x, x.ndim - 1)


def rope_neox(x: jax.Array, positions: jax.Array, rope_dims: int, theta: float) -> jax.Array:
  """Rotate-half RoPE on the first `rope_dims` dims of each head; the rest pass through.

  x: [B, T, heads, head_dim]; positions: [B, T] absolute, 0-based.
  """
  half = rope_dims // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / rope_dims)
  angle = positions.astype(jnp.float32)[..., None] * inv_freq          # [B, T, half]
  cos = jnp.cos(angle)[:, :, None, :]
  sin = jnp.sin(angle)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2, rest = x32[..., :half], x32[..., half:rope_dims], x32[..., rope_dims:]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
  return rotated.astype(x.dtype)


def rope_interleaved(x: jax.Array, positions: jax.Array, theta: float,
                     inv_freq: jax.typing.ArrayLike | None = None,
                     magnitude: float = 1.0) -> jax.Array:
  """RoPE over adjacent pairs (2j, 2j+1) of the whole last axis (llama.cpp NORM, GPT-J).

  x: [B, T, heads, R]; positions: [B, T]. Pair j turns by pos * theta^(-2j/R), or by
  pos * inv_freq[j] with cos/sin times `magnitude` when RoPE scaling supplies them (yarn.py).
  """
  rope_dims = x.shape[-1]
  if inv_freq is None:
    inv_freq = theta ** (-jnp.arange(rope_dims // 2, dtype=jnp.float32) * 2.0 / rope_dims)
  angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  cos = jnp.cos(angle)[:, :, None, :] * magnitude
  sin = jnp.sin(angle)[:, :, None, :] * magnitude
  x32 = x.astype(jnp.float32)
  even, odd = x32[..., 0::2], x32[..., 1::2]
  rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
  return rotated.reshape(x.shape).astype(x.dtype)
