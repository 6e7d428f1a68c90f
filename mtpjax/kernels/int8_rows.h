// Rows of x rounded to int8 as llama.cpp's Q8 vectors round them, for the native kernel's
// integer paths (included by quant_product.h).
//
// Each row is rounded per weight block to int8 times a scale, in the bits llama.cpp keeps:
// 32-value blocks as Q8_0 / Q8_1 (scale amax / 127 in float16 and, for the types with a min,
// the block's sum in float16), 256-value blocks as Q8_K (scale 1 / (127 / amax) in float32,
// with the sums of each 32 rounded values for Q4_K / Q5_K's mins and of each 16 for Q6_K's
// offset of 32). A product of these integers with a block's is then llama.cpp's.
//
// The blocks are stored block-major in the plan's row order: block b of the row at position i
// of `order` is record b x rows + i. A tile's rows are consecutive positions, so for each block
// they lie at fixed distances from one pointer (no per-row addresses to keep in registers).

#pragma once

#include <cstdint>
#include <vector>

#include "quant_blocks.h"

namespace mtpjax_product {

using namespace mtpjax_blocks;

#ifdef MTPJAX_SIMD
struct Int8Rows {
  int64_t rows = 0;
  std::vector<int8_t> q;        // [blocks, rows, block]
  std::vector<float> scale;     // [blocks, rows]
  std::vector<float> sum32;     // [blocks, rows, block / 32]: types with a min
  std::vector<int16_t> sum16;   // [blocks, rows, 16]: Q6_K

  // The first record of block b for the rows from plan position `position` on.
  int64_t record(int64_t b, int64_t position) const { return b * rows + position; }

  // x [R, width] rounded for weight type `type`, its rows in `order`.
  void round(int type, const float* x, int64_t width, const std::vector<int>& order) {
    int block = kBlock[type];
    int64_t blocks = width / block;
    rows = int64_t(order.size());
    q.resize(rows * width);
    scale.resize(rows * blocks);
    if (kHasMin[type]) sum32.resize(rows * width / 32);
    if (type == Q6_K) sum16.resize(rows * width / 16);
    for (int64_t i = 0; i < rows; ++i) {
      const float* row = x + int64_t(order[i]) * width;
      for (int64_t b = 0; b < blocks; ++b) {
        int64_t r = record(b, i);
        const float* v = row + b * block;
        int8_t* rounded = &q[r * block];
        float amax = largest_magnitude(v, block);
        float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        round_to_int8(v, block, inverse, rounded);
        if (block == 32) {
          scale[r] = round_to_half(amax / 127.0f);
          if (kHasMin[type]) sum32[r] = round_to_half(amax / 127.0f * float(sum(rounded, 32)));
          continue;
        }
        scale[r] = amax > 0.0f ? 1.0f / inverse : 0.0f;
        if (kHasMin[type]) {
          for (int j = 0; j < 8; ++j) {
            sum32[r * 8 + j] = scale[r] * float(sum(rounded + 32 * j, 32));
          }
        }
        if (type == Q6_K) {
          for (int j = 0; j < 16; ++j) sum16[r * 16 + j] = int16_t(sum(rounded + 16 * j, 16));
        }
      }
    }
  }

 private:
  static int sum(const int8_t* v, int n) {
    int total = 0;
    for (int i = 0; i < n; ++i) total += v[i];
    return total;
  }

  // max |v[i]| of n values (a multiple of 32; NaNs skipped, as std::max(amax, |v|) skips them).
  static float largest_magnitude(const float* v, int n) {
    __m256 amax = _mm256_setzero_ps();
    __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int i = 0; i < n; i += 8) {
      amax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + i), magnitude), amax);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }

  // v[i] x inverse rounded to the nearest integer, ties to even (nearbyint's, and the
  // conversion's under the default rounding mode), as int8: |v[i] x inverse| <= 127.
  static void round_to_int8(const float* v, int n, float inverse, int8_t* out) {
    __m256 scale = _mm256_set1_ps(inverse);
    auto eight = [&](int i) {
      return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), scale));
    };
    for (int i = 0; i < n; i += 32) {
      // packs interleave 128-bit lanes: 4-byte groups come out as 0, 2, 4, 6, 1, 3, 5, 7
      __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(eight(i), eight(i + 8)),
                                          _mm256_packs_epi32(eight(i + 16), eight(i + 24)));
      packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
    }
  }
};
#endif

}  // namespace mtpjax_product
