"""The int8 rows are llama.cpp's, shown on the deepseek2 (MLA) fixtures quantized by
llama-quantize, where llama.cpp's own logits are the reference.

This random tiny model routes by expert groups, so a difference of one float16 rounding can
flip a group and move a logit by ~3: with mtpjax's float32 attention, int8 rows over a float16
cache are 3.9 from llama.cpp at one of 24 positions (the rest within 0.1). That difference is
the attention's, not the rows': llama.cpp's CPU flash attention for a batch of fewer than 64
rows (ggml-cpu's one-chunk path) rounds the query to float16 and adds each key's weighted value
row into a float16 accumulator, one key after another. `_llama_flash_attention` below is that
arithmetic in plain numpy, written from its description; with it in place of mtpjax's
attention, the int8 rows give llama.cpp's logits to float rounding at every position, so any
fault in how the rows are rounded or multiplied would show. mtpjax keeps its float32
attention: the float16 accumulator is slower and less exact, and llama.cpp itself switches to
float32 tiles for 64 rows or more.
"""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import mtpjax
from fixtures import FIXTURES
from mtpjax.models import kv_cache

FIXTURE = FIXTURES / "glm4moelite-tiny"
IDS = np.load(FIXTURE / "hf_ref.npz")["token_ids"]
f16, f32, f64 = np.float16, np.float32, np.float64


def _dot_f16(q, k):
  """ggml's float16 dot on AVX2 for 48 columns: the first 32 products in four 8-lane float32
  accumulators reduced pairwise, the 16 left over added in double."""
  p = q.astype(f32) * k.astype(f32)                # a float16 product is exact in float32
  lanes = ((p[..., 0:8] + p[..., 16:24]) + (p[..., 8:16] + p[..., 24:32])).astype(f32)
  quads = (lanes[..., 0:4] + lanes[..., 4:8]).astype(f32)
  total = ((quads[..., 0] + quads[..., 1]) + (quads[..., 2] + quads[..., 3])).astype(f64)
  for i in range(32, p.shape[-1]):
    total = total + p[..., i].astype(f64)
  return total.astype(f32)


def _fma(a, b, c):
  return (a.astype(f64) * b.astype(f64) + c.astype(f64)).astype(f32)


def _llama_flash_attention(rows, q, positions, scale, width):
  """Query rows `q [b, T, H, W]` over cache rows `[b, S, W]` (values as stored), keys in order
  with a running max: a new max rescales the float16 accumulator, each key adds its first
  `width` values times exp(score - max), rounded to float16; the sum of weights in float32."""
  rows, positions, scale = np.asarray(rows), np.asarray(positions), f32(scale)
  q = np.asarray(q, f32).astype(f16)
  top = np.full(q.shape[:3], -np.inf, f32)
  weights = np.zeros(q.shape[:3], f32)
  acc = np.zeros(q.shape[:3] + (width,), f16)
  for j in range(int(positions.max()) + 1):
    key = np.broadcast_to(rows[:, j][:, None, None, :], q.shape)
    score = (_dot_f16(q, key) * scale).astype(f32)
    live = (j <= positions)[:, :, None]
    new = live & (score > top)
    old, top = top, np.where(new, score, top)
    with np.errstate(invalid="ignore", over="ignore"):
      rescale = np.where(new, np.exp((old - top).astype(f64)).astype(f32), f32(1))
      weight = np.where(new, f32(1), np.exp((score - top).astype(f64)).astype(f32))
    kept = (acc.astype(f32) * rescale[..., None]).astype(f16)
    added = _fma(key[..., :width].astype(f32), np.broadcast_to(weight[..., None], acc.shape),
                 kept.astype(f32)).astype(f16)
    acc = np.where(live[..., None], added, acc)
    weights = np.where(live, _fma(weights, rescale, weight), weights)
  return (acc.astype(f32) * (f32(1) / weights)[..., None]).astype(f32)


def _latent_attention_as_llama(cache, row, q_lat, q_pe, meta, scale, selected=None):
  """`kv_cache.latent_attention` with llama.cpp's arithmetic (per-slot caches, no selection)."""
  assert selected is None and meta.page_table is None
  window, length, cache = kv_cache._row_reader(cache, row, meta)
  q = jnp.concatenate([q_lat.astype(jnp.float32), q_pe.astype(jnp.float32)], -1)
  out = jax.pure_callback(
      lambda rows, queries, positions: _llama_flash_attention(rows, queries, positions, scale,
                                                              q_lat.shape[-1]),
      jax.ShapeDtypeStruct(q_lat.shape, jnp.float32), window(0, length), q, meta.positions)
  return out, cache


class LlamaArithmeticTest(parameterized.TestCase):

  @parameterized.parameters("Q8_0", "Q4_K_M")
  def test_int8_rows_give_llama_cpps_logits_with_its_attention_arithmetic(self, qtype):
    llama = np.load(FIXTURE / f"llama_{qtype}.npz")["logits"]
    model = mtpjax.load(FIXTURE / f"glm4moelite_h64-{qtype}.gguf")
    self.assertTrue(model.llama_cpp_arithmetic)
    self.assertEqual(model.kv_cache_name("auto"), "float16")
    with mock.patch.object(kv_cache, "latent_attention", _latent_attention_as_llama):
      as_llama = model.logits(IDS)
    np.testing.assert_allclose(as_llama, llama, rtol=0, atol=1e-3)

  @parameterized.parameters("Q8_0", "Q4_K_M")
  def test_float32_rows_agree_with_llama_cpp(self, qtype):
    llama = np.load(FIXTURE / f"llama_{qtype}.npz")["logits"]
    logits = mtpjax.load(FIXTURE / f"glm4moelite_h64-{qtype}.gguf",
                         int8_activations=False).logits(IDS)
    self.assertGreaterEqual(np.mean(logits.argmax(-1) == llama.argmax(-1)), 0.95)


if __name__ == "__main__":
  absltest.main()
