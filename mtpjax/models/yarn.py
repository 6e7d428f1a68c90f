"""RoPE scaling (YaRN and linear) for the MLA archs, computed as llama.cpp does (docs/MODEL.md §8).

llama.cpp splits the work in three places, and the numbers only come out right together:
  * `llama_context` turns the file's keys into `freq_scale = 1/factor`, `ext_factor` (1 for
    YaRN, else 0) and the `attn_factor` it hands to `ggml_rope_ext` (`attn_factor` below). With
    YaRN it divides by `1 + 0.1 ln(factor)` up front, because the rope kernel multiplies that
    back in; for `deepseek2` with `yarn_log_multiplier` set it also cancels the HF mscale ratio.
  * the ggml rope kernel mixes interpolated (`freq_scale * theta`) and extrapolated angles per
    rotated pair along a ramp between the "correction dims", and scales cos/sin by
    `attn_factor * (1 + 0.1 ln(1/freq_scale))` when `ext_factor != 0` (`rope_magnitude`).
  * the deepseek2/glm-dsa graph undoes the context's adjustment and scales the scores by
    `mscale^2 / sqrt(head_dim)` with `mscale = attn_factor_org * (1 + 0.1 L ln(1/freq_scale))`
    and L = HF `mscale_all_dim` (`score_scale`).
For DeepSeek-style files (deepseek2 with `mscale == mscale_all_dim`) this equals HF's
`_compute_yarn_parameters` frequencies with unit cos/sin and DeepSeek's softmax scale
`yarn_get_mscale(factor, mscale_all_dim)^2 / sqrt(head_dim)`.

The angle stays linear in the position (`theta = pos * inv_freq[j]`), so precomputed inverse
frequencies reproduce the kernel exactly. Everything here is plain numpy on the static config.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from mtpjax.models.config import ModelConfig
from mtpjax.models.primitives import rope_interleaved

# llama.cpp's defaults; its deepseek2/glm-dsa loaders read no `yarn_beta_*` keys.
BETA_FAST = 32.0
BETA_SLOW = 1.0


def freq_scale(cfg: ModelConfig) -> float:
  """Position interpolation factor `1/factor` (1 without scaling)."""
  return 1.0 / cfg.rope_scaling_factor if cfg.rope_scaling != "none" else 1.0


def ext_factor(cfg: ModelConfig) -> float:
  """llama.cpp's default `yarn_ext_factor`: 1 for YaRN, 0 otherwise."""
  return 1.0 if cfg.rope_scaling == "yarn" else 0.0


def _get_mscale(scale: float, mscale: float) -> float:
  return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def attn_factor(cfg: ModelConfig) -> float:
  """The `attn_factor` llama.cpp passes to `ggml_rope_ext` (its `cparams.yarn_attn_factor`)."""
  factor = 1.0 / freq_scale(cfg)
  value = 1.0
  if ext_factor(cfg) != 0.0:
    log_mul = cfg.yarn_log_mul
    if log_mul != 0.0:
      # HF's mscale / mscale_all_dim ratio; llama.cpp reads no mscale key and assumes
      # mscale == mscale_all_dim for deepseek2 (as DeepSeek's configs have it), 1 elsewhere.
      mscale = log_mul if cfg.arch == "deepseek2" else 1.0
      value = _get_mscale(factor, mscale) / _get_mscale(factor, log_mul)
    else:
      value = _get_mscale(factor, 1.0)
    value /= 1.0 + 0.1 * math.log(factor)        # the rope kernel multiplies this back in
  return value * cfg.rope_attn_factor


def rope_magnitude(cfg: ModelConfig) -> float:
  """The factor on cos/sin inside the ggml rope kernel."""
  if ext_factor(cfg) == 0.0:
    return attn_factor(cfg)
  return attn_factor(cfg) * (1.0 + 0.1 * math.log(1.0 / freq_scale(cfg)))


def score_scale(cfg: ModelConfig) -> float:
  """deepseek2/glm-dsa `kq_scale`. For linear scaling llama.cpp still applies the
  `1 + 0.1 ln(factor)` it assumes the context removed; we follow the source."""
  log_inv = math.log(1.0 / freq_scale(cfg))
  attn_factor_org = attn_factor(cfg) * (1.0 + 0.1 * log_inv)
  mscale = attn_factor_org * (1.0 + 0.1 * cfg.yarn_log_mul * log_inv)
  return mscale * mscale / math.sqrt(cfg.head_dim)


def corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float = BETA_FAST,
              beta_slow: float = BETA_SLOW) -> tuple[float, float]:
  """ggml_rope_yarn_corr_dims: the pair range over which the ramp goes from extrapolated
  (below `low`) to interpolated (above `high`) angles."""
  def dim(n_rot: float) -> float:
    return n_dims * math.log(n_ctx_orig / (n_rot * 2.0 * math.pi)) / (2.0 * math.log(base))
  return max(0.0, math.floor(dim(beta_fast))), min(n_dims - 1.0, math.ceil(dim(beta_slow)))


def inv_freq(cfg: ModelConfig) -> np.ndarray:
  """float32 [rope_dims // 2]: pair j turns by `pos * inv_freq[j]` radians."""
  n = cfg.rope_dims
  j = np.arange(n // 2, dtype=np.float64)
  base = cfg.rope_theta ** (-2.0 * j / n)
  fs, ext = freq_scale(cfg), ext_factor(cfg)
  mix = np.zeros_like(j)
  if ext != 0.0:
    low, high = corr_dims(n, cfg.rope_orig_context or cfg.context_length, cfg.rope_theta)
    mix = (1.0 - np.clip((j - low) / max(0.001, high - low), 0.0, 1.0)) * ext
  return (base * (fs * (1.0 - mix) + mix)).astype(np.float32)


def scaled_rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Adjacent-pair RoPE over the last axis (`cfg.rope_dims` wide) with the file's scaling."""
  if cfg.rope_scaling == "none" and cfg.rope_attn_factor == 1.0:
    return rope_interleaved(x, positions, cfg.rope_theta)
  return rope_interleaved(x, positions, cfg.rope_theta, inv_freq(cfg), rope_magnitude(cfg))
