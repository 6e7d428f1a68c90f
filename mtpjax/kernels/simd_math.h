// Elementwise float32 math the native kernels share, eight lanes at a time with AVX2: an exp
// several times cheaper than the C library's scalar one, for SwiGLU activations
// (quant_matvec.cc) and softmax weights (paged_attention.cc). Every value is computed alone, the
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

// values[i] = exp(values[i] - shift), i < n (eight at a time, a short tail padded to eight).
inline void exp_shifted(float* values, int64_t n, float shift) {
#ifdef MTPJAX_SIMD
  __m256 by = _mm256_set1_ps(shift);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(values + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(values + i), by)));
  }
  if (i < n) {
    alignas(32) float tail[8] = {};
    std::copy(values + i, values + n, tail);
    _mm256_store_ps(tail, exp8(_mm256_sub_ps(_mm256_load_ps(tail), by)));
    std::copy(tail, tail + (n - i), values + i);
  }
#else
  for (int64_t i = 0; i < n; ++i) values[i] = std::exp(values[i] - shift);
#endif
}

}  // namespace mtpjax_math
