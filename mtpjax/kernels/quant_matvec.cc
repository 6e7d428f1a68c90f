// Rows against GGUF-quantized matrices on the CPU, reading the integers once.
//
// XLA:CPU cannot keep the unpacking of packed nibbles and bits in a vectorized loop beside the
// multiply-add, so a decode step there ran at 1-5 G weights/s. This kernel unpacks one block
// (32 or 256 weights) at a time into float32 values equal to gguf-py's `dequantize` (the same
// operations in the same order), keeps it in L1, and multiplies it into every row that reads
// that matrix. Products accumulate in float32, 8 lanes per row in a fixed order, so a row's
// result does not depend on the other rows of the call or on the thread count.
//
// Call (see mtpjax/kernels/native.py): x f32 [R, K], ids s32 [R] (the matrix each row reads:
// an expert, a head, or 0), then the tensor's fields in `quant_blocks.field_specs` order, each
// [E, N, nb, ...]; attribute `type_code` (TYPE_NAMES in native.py); result f32 [R, N].
// Output rows are split into chunks that XLA's intra-op threads take from one counter; the
// calling thread takes chunks too and waits only for chunks already taken, so no wait depends
// on a task that has not started.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum TypeCode { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, NUM_TYPES };

constexpr int kBlock[NUM_TYPES] = {32, 32, 32, 32, 32, 256, 256, 256, 256, 256};
constexpr int kFields[NUM_TYPES] = {2, 2, 3, 3, 4, 4, 4, 5, 6, 4};
constexpr int kMaxRows = 4096;  // native.MAX_ROWS
constexpr int kScalarRows = 64;  // rows a scalar pass keeps accumulators for
constexpr int kChunkRows = 32;
// Below this many weight bytes a call runs on the calling thread alone.
constexpr int64_t kParallelBytes = 1 << 18;

// IEEE half bits -> float, exact (normals, subnormals, inf, nan).
inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F;
  uint32_t mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: renormalize
    int shift = 0;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      ++shift;
    }
    bits = sign | (uint32_t(113 - shift) << 23) | ((mantissa & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One field of a tensor: base pointer and bytes per block, per matrix row and per matrix.
struct Field {
  const uint8_t* data;
  int64_t block_bytes;
};

inline const uint8_t* at(const Field& f, int64_t block) { return f.data + block * f.block_bytes; }
inline float f16_at(const Field& f, int64_t block) {
  uint16_t h;
  std::memcpy(&h, at(f, block), 2);
  return half_to_float(h);
}
// Signed fields are stored sign-flipped (x + 128) as uint8.
inline float signed_at(const uint8_t* p, int i) { return float(int(p[i]) - 128); }

// Block `b` (a global block index) of type `t` -> its float32 values in w.
inline void dequantize_block(int t, const Field* f, int64_t b, float* w) {
  switch (t) {
    case Q8_0: {  // d, qs
      float d = f16_at(f[0], b);
      const uint8_t* qs = at(f[1], b);
      for (int j = 0; j < 32; ++j) w[j] = d * float(int(qs[j]) - 128);
      return;
    }
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {  // d, [m], [qh], qs
      float d = f16_at(f[0], b);
      bool has_min = t == Q4_1 || t == Q5_1;
      bool five = t == Q5_0 || t == Q5_1;
      float m = has_min ? f16_at(f[1], b) : 0.0f;
      const uint8_t* qh = five ? at(f[has_min ? 2 : 1], b) : nullptr;
      const uint8_t* qs = at(f[kFields[t] - 1], b);
      uint8_t q[32];
      for (int j = 0; j < 16; ++j) {
        q[j] = qs[j] & 0x0F;
        q[j + 16] = qs[j] >> 4;
      }
      if (five) {
        for (int j = 0; j < 32; ++j) q[j] |= ((qh[j >> 3] >> (j & 7)) & 1) << 4;
      }
      if (has_min) {
        for (int j = 0; j < 32; ++j) w[j] = d * float(q[j]) + m;
      } else {
        float offset = five ? 16.0f : 8.0f;
        for (int j = 0; j < 32; ++j) w[j] = d * (float(q[j]) - offset);
      }
      return;
    }
    case Q2_K: {  // scales, qs, d, dmin
      const uint8_t* sc = at(f[0], b);
      const uint8_t* qs = at(f[1], b);
      float d = f16_at(f[2], b), dmin = f16_at(f[3], b);
      for (int s = 0; s < 16; ++s) {
        float dl = d * float(sc[s] & 0x0F), ml = dmin * float(sc[s] >> 4);
        for (int j = 0; j < 16; ++j) {
          int e = 16 * s + j, g = e >> 7, shift = 2 * ((e & 127) >> 5), i = e & 31;
          w[e] = dl * float((qs[32 * g + i] >> shift) & 3) - ml;
        }
      }
      return;
    }
    case Q3_K: {  // hmask, qs, d, scales
      const uint8_t* hmask = at(f[0], b);
      const uint8_t* qs = at(f[1], b);
      float d = f16_at(f[2], b);
      const uint8_t* sc = at(f[3], b);
      for (int s = 0; s < 16; ++s) {
        float dl = d * signed_at(sc, s);
        for (int j = 0; j < 16; ++j) {
          int e = 16 * s + j, g = e >> 7, shift = 2 * ((e & 127) >> 5), i = e & 31;
          int low = (qs[32 * g + i] >> shift) & 3;
          int high = ((hmask[i] >> (e >> 5)) & 1) ^ 1;
          w[e] = dl * (float(low) - float(high << 2));
        }
      }
      return;
    }
    case Q4_K:
    case Q5_K: {  // d, dmin, [qh], qs, sc, m
      bool five = t == Q5_K;
      float d = f16_at(f[0], b), dmin = f16_at(f[1], b);
      const uint8_t* qh = five ? at(f[2], b) : nullptr;
      const uint8_t* qs = at(f[five ? 3 : 2], b);
      const uint8_t* sc = at(f[five ? 4 : 3], b);
      const uint8_t* mn = at(f[five ? 5 : 4], b);
      for (int c = 0; c < 4; ++c) {
        #pragma GCC unroll 8
        for (int h = 0; h < 2; ++h) {
          int s = 2 * c + h;
          float dl = d * float(sc[s]), ml = dmin * float(mn[s]);
          float* out = w + 32 * s;
          const uint8_t* bytes = qs + 32 * c;
          if (five) {
            for (int i = 0; i < 32; ++i) {
              int q = ((bytes[i] >> (4 * h)) & 0x0F) | (((qh[i] >> s) & 1) << 4);
              out[i] = dl * float(q) - ml;
            }
          } else {
            for (int i = 0; i < 32; ++i) out[i] = dl * float((bytes[i] >> (4 * h)) & 0x0F) - ml;
          }
        }
      }
      return;
    }
    case Q6_K: {  // ql, qh, scales, d
      const uint8_t* ql = at(f[0], b);
      const uint8_t* qh = at(f[1], b);
      const uint8_t* sc = at(f[2], b);
      float d = f16_at(f[3], b);
      for (int g = 0; g < 2; ++g) {
        for (int s = 0; s < 4; ++s) {      // 32 elements: 128g + 32s + i
          float* out = w + 128 * g + 32 * s;
          const uint8_t* low = ql + 64 * g + 32 * (s & 1);
          const uint8_t* high = qh + 32 * g;
          int low_shift = 4 * (s >> 1), high_shift = 2 * s;
          float d0 = d * signed_at(sc, 8 * g + 2 * s), d1 = d * signed_at(sc, 8 * g + 2 * s + 1);
          for (int i = 0; i < 32; ++i) {
            int q = ((low[i] >> low_shift) & 0x0F) | (((high[i] >> high_shift) & 3) << 4);
            out[i] = (i < 16 ? d0 : d1) * (float(q) - 32.0f);
          }
        }
      }
      return;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#define MTPJAX_SIMD 1
#include <immintrin.h>

inline float f16_fast(const Field& f, int64_t block) {
  uint16_t h;
  std::memcpy(&h, at(f, block), 2);
  return _cvtsh_ss(h);
}

// Byte shuffles picking Q6_K's scales 2k (8 times) and 2k + 1 (8 times), for run k.
alignas(16) constexpr int8_t kScalePairs[8][16] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
    {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
    {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},
    {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
    {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};

// Q6_K's 2-bit high parts of run s (bits 2s, 2s + 1 of each byte) at bits 4-5.
inline __m256i high_crumbs(__m256i high, int s) {
  __m256i mask = _mm256_set1_epi8(0x30);
  switch (s) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(high, 4), mask);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(high, 2), mask);
    case 2: return _mm256_and_si256(high, mask);
    default: return _mm256_and_si256(_mm256_srli_epi16(high, 2), mask);
  }
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline __m256i nibbles(__m256i v, int shift) {
  return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(0x0F));
}

// Run k (0-7) of a Q6_K block, elements 32k .. 32k + 31 as unsigned 6-bit values: with g = k / 4
// and s = k % 4, the low 4 bits are nibble s / 2 of ql[64g + 32 (s % 2) + i] and the high 2 bits
// are bits 2s, 2s + 1 of qh[32g + i].
inline __m256i q6_run(const uint8_t* ql, const uint8_t* qh, int k) {
  int g = k >> 2, s = k & 3;
  __m256i low = load32(ql + 64 * g + 32 * (s & 1));
  __m256i q = s < 2 ? _mm256_and_si256(low, _mm256_set1_epi8(0x0F)) : nibbles(low, 4);
  return _mm256_or_si256(q, high_crumbs(load32(qh + 32 * g), s));
}
// A Q4_K / Q5_K block's fields: d, dmin, the packed 4-bit values, the 8 sub-block scales and
// mins, and Q5_K's fifth bits (32 bytes, bit k for run k).
struct KBlock {
  float d, dmin;
  const uint8_t *qs, *sc, *mn;
  __m256i qh;
  bool five;
};

inline KBlock k_block(const Field* f, int64_t b, bool five) {
  return {f16_fast(f[0], b), f16_fast(f[1], b), at(f[five ? 3 : 2], b), at(f[five ? 4 : 3], b),
          at(f[five ? 5 : 4], b), five ? load32(at(f[2], b)) : _mm256_setzero_si256(), five};
}

// Run k (0-7) of the block: its 32 4-bit values (the low nibbles of bytes 32 (k / 2) .. + 31
// for even k, the high ones for odd k), with Q5_K's fifth bit.
inline __m256i k_run(const KBlock& kb, int k) {
  __m256i v = load32(kb.qs + 32 * (k >> 1));
  __m256i q = (k & 1) ? nibbles(v, 4) : _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
  if (kb.five) {
    __m256i bit = _mm256_and_si256(_mm256_srli_epi16(kb.qh, k), _mm256_set1_epi8(1));
    q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
  }
  return q;
}

// 16 packed bytes -> 32 bytes: low nibbles (elements 0-15), then high nibbles (16-31).
inline __m256i split_nibbles16(const uint8_t* p) {
  __m128i v = _mm_loadu_si128((const __m128i*)p), mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}
// Bit j of 4 little-endian bytes -> byte j: 0x10 where set, else 0.
inline __m256i high_bits32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// A run of 32 weights of a block, w_k = s * q_k - m (s0 for elements 0-15, s1 for 16-31):
// `q` 32 int8, non-negative for the types with a min (`m` != 0 only there).
struct Run {
  __m256i q;
  float s0, s1, m;
};

// Block `b` as runs (8 for K-quants, 1 for 32-blocks): their count, or 0 for the types left to
// the scalar path (Q2_K, Q3_K).
inline int simd_runs(int t, const Field* f, int64_t b, Run* runs) {
  switch (t) {
    case Q8_0: {
      float d = f16_fast(f[0], b);
      runs[0] = {_mm256_xor_si256(load32(at(f[1], b)), _mm256_set1_epi8(char(0x80))), d, d, 0.0f};
      return 1;
    }
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
      bool has_min = t == Q4_1 || t == Q5_1, five = t == Q5_0 || t == Q5_1;
      float d = f16_fast(f[0], b);
      float m = has_min ? -f16_fast(f[1], b) : 0.0f;
      __m256i q = split_nibbles16(at(f[kFields[t] - 1], b));
      if (five) q = _mm256_or_si256(q, high_bits32(at(f[has_min ? 2 : 1], b)));
      if (!has_min) q = _mm256_sub_epi8(q, _mm256_set1_epi8(five ? 16 : 8));
      runs[0] = {q, d, d, m};
      return 1;
    }
    case Q4_K:
    case Q5_K: {
      KBlock kb = k_block(f, b, t == Q5_K);
      #pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        float dl = kb.d * float(kb.sc[k]);
        runs[k] = {k_run(kb, k), dl, dl, kb.dmin * float(kb.mn[k])};
      }
      return 8;
    }
    case Q6_K: {
      const uint8_t* ql = at(f[0], b);
      const uint8_t* qhp = at(f[1], b);
      const uint8_t* sc = at(f[2], b);
      float d = f16_fast(f[3], b);
      #pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        int g = k >> 2, s = k & 3;
        runs[k] = {_mm256_sub_epi8(q6_run(ql, qhp, k), _mm256_set1_epi8(32)),
                   d * signed_at(sc, 8 * g + 2 * s), d * signed_at(sc, 8 * g + 2 * s + 1), 0.0f};
      }
      return 8;
    }
  }
  return 0;
}



inline float horizontal_sum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// The state of one call, shared with helper tasks that may start after the call returned
// (they find no chunk left and touch nothing else).
struct Work {
  int type = 0;
  int64_t rows = 0, width = 0, out_rows = 0, blocks_per_row = 0, blocks_per_matrix = 0;
  const float* x = nullptr;
  float* y = nullptr;
  Field fields[6];
  // Rows grouped by the matrix they read: group g is rows order[starts[g] .. starts[g+1]).
  std::vector<int> order, starts, matrix;
  int64_t chunks_per_group = 0, total_chunks = 0;
  // int8 activations (`int8_x`): each row of x rounded per 32 values to int8 times a float32
  // scale (amax / 127), as llama.cpp's Q8 vectors, with the exact float sum of each 32 values
  // for the types with a min. Blocks then multiply as integers.
  bool int8_x = false;
  std::vector<int8_t> xq;
  std::vector<float> xscale, xsum;
  std::vector<int16_t> xbsum;   // [R, K / 16] sums of the int8 values (K-quants)
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void run_chunk(int64_t chunk) {
    int64_t g = chunk / chunks_per_group;
    int64_t n0 = (chunk % chunks_per_group) * kChunkRows;
    int64_t n1 = std::min(out_rows, n0 + kChunkRows);
    const int* group = order.data() + starts[g];
    int count = starts[g + 1] - starts[g];
    for (int64_t n = n0; n < n1; ++n) {
      int64_t first = matrix[g] * blocks_per_matrix + n * blocks_per_row;
#ifdef MTPJAX_SIMD
      if (type != Q2_K && type != Q3_K) {
        if (int8_x) {
          simd_row<true>(first, group, count, n);
        } else {
          simd_row<false>(first, group, count, n);
        }
        continue;
      }
#endif
      scalar_row(first, group, count, n);
    }
  }

  // The float sums of each 32 values of every row (the mins' term), xsum [R, K / 32].
  void sum_rows() {
    xsum.resize(rows * width / 32);
    for (int64_t g = 0; g < rows * width / 32; ++g) {
      float sum = 0.0f;
      for (int i = 0; i < 32; ++i) sum += x[g * 32 + i];
      xsum[g] = sum;
    }
  }

  // x rounded per block of the weight type (32, or 256 for K-quants as llama.cpp's Q8_K) to
  // int8 times xscale [R, K / block], and xbsum [R, K / 16] the sums of the int8 values.
  void quantize_rows() {
    int block = kBlock[type];
    int64_t groups = width / block;
    xq.resize(rows * width);
    xscale.resize(rows * groups);
    for (int64_t g = 0; g < rows * groups; ++g) {
      const float* v = x + g * block;
      float amax = 0.0f;
      for (int i = 0; i < block; ++i) amax = std::max(amax, std::fabs(v[i]));
      float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int i = 0; i < block; ++i) xq[g * block + i] = int8_t(std::nearbyint(v[i] * inverse));
      xscale[g] = amax / 127.0f;
    }
    xbsum.resize(rows * width / 16);
    for (int64_t g = 0; g < rows * width / 16; ++g) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += xq[g * 16 + i];
      xbsum[g] = int16_t(sum);
    }
  }

#ifdef MTPJAX_SIMD
  // int8 rows, 32-value blocks: each block's integers times each row's int8 values, scaled by
  // the block's and the row's scales.
  template <int T, int count>
  void small_block_rows_of(int64_t first, const int* group, int64_t n) {
    constexpr bool nonneg = T == Q4_1 || T == Q5_1;
    __m256 acc[count][2];
    float mins[count];
    const int8_t* xr[count];
    const float* xd[count];
    #pragma GCC unroll 4
    for (int r = 0; r < count; ++r) {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      mins[r] = 0.0f;
      xr[r] = xq.data() + group[r] * width;
      xd[r] = xscale.data() + group[r] * blocks_per_row;
    }
    for (int64_t b = 0; b < blocks_per_row; ++b) {
      Run run;
      simd_runs(T, fields, first + b, &run);
      __m256i magnitude = nonneg ? run.q : _mm256_sign_epi8(run.q, run.q);
      #pragma GCC unroll 4
      for (int r = 0; r < count; ++r) {
        __m256i xv = load32(reinterpret_cast<const uint8_t*>(xr[r] + b * 32));
        __m256i pairs = _mm256_maddubs_epi16(magnitude, nonneg ? xv : _mm256_sign_epi8(xv, run.q));
        __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
        acc[r][b & 1] = _mm256_fmadd_ps(sums, _mm256_set1_ps(run.s0 * xd[r][b]), acc[r][b & 1]);
        if (nonneg) mins[r] += run.m * xsum[group[r] * blocks_per_row + b];
      }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < count; ++r) {
      y[group[r] * out_rows + n] = horizontal_sum(_mm256_add_ps(acc[r][0], acc[r][1])) - mins[r];
    }
  }

  // The same for K-quants (256-value blocks, one x scale a block). Each run's integers are
  // unpacked once and multiplied into every row as they come (unsigned, so Q6_K's offset of 32
  // is taken off once a block through the rows' 16-value sums of x); products are weighted by
  // the integer sub-block scales in int32 (under 2^24 a lane), then one float multiply-add a
  // block and row. The mins' term (Q4_K, Q5_K) comes from the float sums of x.
  template <int T, int count>
  void kquant_rows_of(int64_t first, const int* group, int64_t n) {
    constexpr bool six = T == Q6_K, five = T == Q5_K;
    __m256 acc[count], mins[count];
    __m256i sums[count];
    const int8_t* xr[count];
    #pragma GCC unroll 4
    for (int r = 0; r < count; ++r) acc[r] = mins[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks_per_row; ++b) {
      int64_t block = first + b;
      #pragma GCC unroll 4
      for (int r = 0; r < count; ++r) {
        sums[r] = _mm256_setzero_si256();
        xr[r] = xq.data() + (group[r] * blocks_per_row + b) * 256;
      }
      float d;
      __m256 dmins = _mm256_setzero_ps();
      if (six) {
        const uint8_t* ql = at(fields[0], block);
        const uint8_t* qhp = at(fields[1], block);
        d = f16_fast(fields[3], block);
        __m128i scales = _mm_xor_si128(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(at(fields[2], block))),
            _mm_set1_epi8(char(0x80)));
        // the offset: 32 x the scales' products with the rows' 16-value sums of x
        __m256i all_scales = _mm256_cvtepi8_epi16(scales);
        #pragma GCC unroll 4
        for (int r = 0; r < count; ++r) {
          __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
              xbsum.data() + (group[r] * blocks_per_row + b) * 16));
          sums[r] = _mm256_sub_epi32(sums[r], _mm256_slli_epi32(_mm256_madd_epi16(bsums, all_scales), 5));
        }
        #pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          __m256i q = q6_run(ql, qhp, k);
          __m256i scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
              scales, _mm_load_si128(reinterpret_cast<const __m128i*>(kScalePairs[k]))));
          #pragma GCC unroll 4
          for (int r = 0; r < count; ++r) {
            __m256i xv = load32(reinterpret_cast<const uint8_t*>(xr[r] + 32 * k));
            sums[r] = _mm256_add_epi32(sums[r],
                                       _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scale));
          }
        }
      } else {
        KBlock kb = k_block(fields, block, five);
        d = kb.d;
        #pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          __m256i q = k_run(kb, k);
          __m256i scale = _mm256_set1_epi16(short(kb.sc[k]));
          #pragma GCC unroll 4
          for (int r = 0; r < count; ++r) {
            __m256i xv = load32(reinterpret_cast<const uint8_t*>(xr[r] + 32 * k));
            sums[r] = _mm256_add_epi32(sums[r],
                                       _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scale));
          }
        }
        __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(kb.mn));
        dmins = _mm256_mul_ps(_mm256_set1_ps(kb.dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8)));
      }
      #pragma GCC unroll 4
      for (int r = 0; r < count; ++r) {
        int64_t g = group[r] * blocks_per_row + b;
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(d * xscale[g]), acc[r]);
        if (!six) mins[r] = _mm256_fmadd_ps(dmins, _mm256_loadu_ps(xsum.data() + g * 8), mins[r]);
      }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < count; ++r) {
      y[group[r] * out_rows + n] = horizontal_sum(acc[r]) - horizontal_sum(mins[r]);
    }
  }

  // Float32 rows: each run's integers converted once, multiplied into every row, and the
  // run's scales applied to the row's partial sums (per 16 values), so the weights' values
  // are never formed: s * sum(q x) - m * sum(x). A unit row still reads back exactly
  // gguf-py's value, s * q - m with one rounding.
  template <int T, int count>
  void simd_rows_of(int64_t first, const int* group, int64_t n) {
    constexpr int block = kBlock[T];
    constexpr bool has_min = T == Q4_1 || T == Q5_1 || T == Q4_K || T == Q5_K;
    __m256 acc[count][4];
    float mins[count];
    const float* xs[count];
    #pragma GCC unroll 4
    for (int r = 0; r < count; ++r) {
      xs[r] = x + group[r] * width;
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm256_setzero_ps();
      mins[r] = 0.0f;
    }
    alignas(32) int8_t qb[32];
    for (int64_t b = 0; b < blocks_per_row; ++b) {
      Run runs[8];
      int n_runs = simd_runs(T, fields, first + b, runs);
      for (int k = 0; k < n_runs; ++k) {
        const Run& run = runs[k];
        _mm256_store_si256(reinterpret_cast<__m256i*>(qb), run.q);
        __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)qb)));
        __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qb + 8))));
        __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qb + 16))));
        __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qb + 24))));
        __m256 s0 = _mm256_set1_ps(run.s0), s1 = _mm256_set1_ps(run.s1);
        int lane = 2 * (int(b * n_runs + k) & 1);
        int64_t off = b * block + 32 * k;
        #pragma GCC unroll 4
        for (int r = 0; r < count; ++r) {
          const float* xr = xs[r] + off;
          __m256 lo = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xr + 8), _mm256_mul_ps(q0, _mm256_loadu_ps(xr)));
          __m256 hi = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xr + 24),
                                      _mm256_mul_ps(q2, _mm256_loadu_ps(xr + 16)));
          acc[r][lane] = _mm256_fmadd_ps(lo, s0, acc[r][lane]);
          acc[r][lane + 1] = _mm256_fmadd_ps(hi, s1, acc[r][lane + 1]);
          if (has_min) mins[r] += run.m * xsum[(group[r] * width + off) / 32];
        }
      }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < count; ++r) {
      __m256 a = _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                               _mm256_add_ps(acc[r][2], acc[r][3]));
      y[group[r] * out_rows + n] = horizontal_sum(a) - mins[r];
    }
  }
  // One output row for the rows of a group, by type and path. Rows go through in fours or
  // fewer, each count its own compiled copy with its accumulators in registers; a row's
  // arithmetic is the same in every copy.
  template <bool kInt8, int T, int count>
  void rows_of(int64_t first, const int* group, int64_t n) {
    if constexpr (!kInt8) {
      simd_rows_of<T, count>(first, group, n);
    } else if constexpr (kBlock[T] == 256) {
      kquant_rows_of<T, count>(first, group, n);
    } else {
      small_block_rows_of<T, count>(first, group, n);
    }
  }

  template <bool kInt8, int T>
  void rows_in_fours(int64_t first, const int* group, int count, int64_t n) {
    for (int r = 0; r < count; r += 4) {
      switch (std::min(4, count - r)) {
        case 1: rows_of<kInt8, T, 1>(first, group + r, n); break;
        case 2: rows_of<kInt8, T, 2>(first, group + r, n); break;
        case 3: rows_of<kInt8, T, 3>(first, group + r, n); break;
        default: rows_of<kInt8, T, 4>(first, group + r, n); break;
      }
    }
  }

  template <bool kInt8>
  void simd_row(int64_t first, const int* group, int count, int64_t n) {
    switch (type) {
      case Q8_0: return rows_in_fours<kInt8, Q8_0>(first, group, count, n);
      case Q4_0: return rows_in_fours<kInt8, Q4_0>(first, group, count, n);
      case Q4_1: return rows_in_fours<kInt8, Q4_1>(first, group, count, n);
      case Q5_0: return rows_in_fours<kInt8, Q5_0>(first, group, count, n);
      case Q5_1: return rows_in_fours<kInt8, Q5_1>(first, group, count, n);
      case Q4_K: return rows_in_fours<kInt8, Q4_K>(first, group, count, n);
      case Q5_K: return rows_in_fours<kInt8, Q5_K>(first, group, count, n);
      default: return rows_in_fours<kInt8, Q6_K>(first, group, count, n);
    }
  }
#endif

  // One output row for the rows of a group, through `dequantize_block` (every type), up to
  // kScalarRows rows a pass.
  void scalar_row(int64_t first, const int* group, int count, int64_t n) {
    int block = kBlock[type];
    alignas(64) float w[256];
    float acc[kScalarRows][8];
    for (int r0 = 0; r0 < count; r0 += kScalarRows) {
      int rows_now = std::min(kScalarRows, count - r0);
      for (int r = 0; r < rows_now; ++r) std::fill(acc[r], acc[r] + 8, 0.0f);
      for (int64_t b = 0; b < blocks_per_row; ++b) {
        dequantize_block(type, fields, first + b, w);
        for (int r = 0; r < rows_now; ++r) {
          const float* xr = x + group[r0 + r] * width + b * block;
          float* a = acc[r];
          for (int j = 0; j < block; j += 8) {
            for (int l = 0; l < 8; ++l) a[l] += w[j + l] * xr[j + l];
          }
        }
      }
      for (int r = 0; r < rows_now; ++r) {
        const float* a = acc[r];
        y[group[r0 + r] * out_rows + n] =
            ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
      }
    }
  }


  // Takes chunks until none is left; returns when every chunk taken by anyone is finished.
  void drain(bool wait) {
    for (int64_t c; (c = next.fetch_add(1)) < total_chunks;) {
      run_chunk(c);
      done.fetch_add(1);
    }
    if (wait) {
      while (done.load() < total_chunks) std::this_thread::yield();
    }
  }
};

std::atomic<int> active_calls{0};

ffi::Error QuantMatvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                       ffi::RemainingArgs fields, ffi::ResultBuffer<ffi::F32> y,
                       int32_t type_code, int32_t int8_x) {
  if (type_code < 0 || type_code >= NUM_TYPES)
    return ffi::Error::InvalidArgument("quant_matvec: unknown type code");
  if (int(fields.size()) != kFields[type_code])
    return ffi::Error::InvalidArgument("quant_matvec: wrong number of fields for the type");
  auto work = std::make_shared<Work>();
  work->type = type_code;
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("quant_matvec: x must be [R, K]");
  work->rows = xd[0];
  work->width = xd[1];
  if (work->rows > kMaxRows) return ffi::Error::InvalidArgument("quant_matvec: too many rows");
  int64_t matrices = 0;
  for (size_t i = 0; i < fields.size(); ++i) {
    auto field = fields.get<ffi::AnyBuffer>(i);
    if (!field.has_value()) return field.error();
    auto dims = field->dimensions();
    if (dims.size() < 3) return ffi::Error::InvalidArgument("quant_matvec: field rank < 3");
    if (i == 0) {
      matrices = dims[0];
      work->out_rows = dims[1];
      work->blocks_per_row = dims[2];
    } else if (dims[0] != matrices || dims[1] != work->out_rows ||
               dims[2] != work->blocks_per_row) {
      return ffi::Error::InvalidArgument("quant_matvec: fields disagree on [E, N, nb]");
    }
    int64_t per_block = ffi::ByteWidth(field->element_type());
    for (size_t k = 3; k < dims.size(); ++k) per_block *= dims[k];
    work->fields[i] = {static_cast<const uint8_t*>(field->untyped_data()), per_block};
  }
  if (work->blocks_per_row * kBlock[type_code] != work->width)
    return ffi::Error::InvalidArgument("quant_matvec: x width != blocks x block size");
  work->blocks_per_matrix = work->out_rows * work->blocks_per_row;
  work->x = x.typed_data();
  work->y = y->typed_data();
  // Group rows by matrix (stable), so a matrix's blocks are unpacked once for all its rows.
  const int32_t* id = ids.typed_data();
  std::vector<int> order(work->rows);
  for (int r = 0; r < work->rows; ++r) {
    if (id[r] < 0 || id[r] >= matrices)
      return ffi::Error::InvalidArgument("quant_matvec: matrix id out of range");
    order[r] = r;
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return id[a] < id[b]; });
  for (int r = 0; r < work->rows; ++r) {
    if (r == 0 || id[order[r]] != id[order[r - 1]]) {
      work->starts.push_back(r);
      work->matrix.push_back(id[order[r]]);
    }
  }
  work->starts.push_back(int(work->rows));
  work->order = std::move(order);
  work->int8_x = int8_x != 0;
  work->sum_rows();
  if (work->int8_x) work->quantize_rows();
  work->chunks_per_group = (work->out_rows + kChunkRows - 1) / kChunkRows;
  work->total_chunks = work->chunks_per_group * int64_t(work->matrix.size());
  if (work->total_chunks == 0) return ffi::Error::Success();

  int64_t bytes = 0;
  for (int i = 0; i < kFields[type_code]; ++i)
    bytes += work->fields[i].block_bytes * work->blocks_per_matrix;
  bytes *= int64_t(work->matrix.size());
  // XLA runs independent thunks at once (a gate and an up projection): a call that starts
  // while another runs keeps to its own thread, so the cores are not oversubscribed.
  struct Running {
    int before = active_calls.fetch_add(1);
    ~Running() { active_calls.fetch_sub(1); }
  } running;
  int64_t helpers = bytes < kParallelBytes || running.before > 0
                        ? 0 : std::min<int64_t>(pool.num_threads(), work->total_chunks - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([work] { work->drain(false); });
  }
  work->drain(true);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpjaxQuantMatvec, QuantMatvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("type_code")
                                  .Attr<int32_t>("int8_x"));
