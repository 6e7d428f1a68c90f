// Elementwise float32 math the native kernels share, eight lanes at a time with AVX2: an exp
// several times cheaper than the C library's scalar one, for SwiGLU activations
// (`silu_times`, quant_matvec.cc) and softmax weights (`exp_shifted`, paged_attention.cc). Every value is computed alone, the
// same in any lane, so a result never depends on where a value sits in its array.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "quant_blocks.h"

namespace mtpjax_math {

#ifdef MTPJAX_SIMD
// exp(v) in float32, within 2 ulp for v in [-87.3, 88.7]: v = n ln2 + r with |r| <= ln2 / 2,
// exp(r) from a degree-6 polynomial, times 2^n through the exponent bits. Below -87.3 it gives
// exp(-87.3) (about 1e-38), above 88.7 infinity.
inline __m256 exp8(__m256 v) {
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);   // ln2, high part
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);       // and its low part
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i scale = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

#ifdef MTPJAX_SIMD
// out[i] = f(inputs at i) for i < n: `f(const float* const* at)` returns the eight results for
// the eight values from each `at[k]` on. A short tail is padded to eight, so each value goes
// through the same lanes' arithmetic wherever it sits. `out` may be an input.
template <int kInputs, class F>
inline void in_eights(const float* const (&inputs)[kInputs], int64_t n, float* out, F f) {
  const float* at[kInputs];
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < kInputs; ++k) at[k] = inputs[k] + i;
    _mm256_storeu_ps(out + i, f(at));
  }
  if (i == n) return;
  alignas(32) float padded[kInputs][8] = {}, results[8];
  for (int k = 0; k < kInputs; ++k) {
    std::copy(inputs[k] + i, inputs[k] + n, padded[k]);
    at[k] = padded[k];
  }
  _mm256_store_ps(results, f(at));
  std::copy(results, results + (n - i), out + i);
}
#endif

// values[i] = exp(values[i] - shift), i < n (softmax weights).
inline void exp_shifted(float* values, int64_t n, float shift) {
#ifdef MTPJAX_SIMD
  __m256 by = _mm256_set1_ps(shift);
  const float* inputs[1] = {values};
  in_eights(inputs, n, values, [by](const float* const* at) {
    return exp8(_mm256_sub_ps(_mm256_loadu_ps(at[0]), by));
  });
#else
  for (int64_t i = 0; i < n; ++i) values[i] = std::exp(values[i] - shift);
#endif
}

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i], i < n (SwiGLU).
inline void silu_times(const float* gate, const float* up, int64_t n, float* out) {
#ifdef MTPJAX_SIMD
  const float* inputs[2] = {gate, up};
  in_eights(inputs, n, out, [](const float* const* at) {
    __m256 g = _mm256_loadu_ps(at[0]);
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                         _mm256_loadu_ps(at[1]));
  });
#else
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
#endif
}

}  // namespace mtpjax_math
