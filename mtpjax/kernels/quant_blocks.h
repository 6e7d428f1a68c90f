// GGUF quantized blocks on the CPU: type codes, field access, and each type's block
// unpacked, either to float32 values equal to gguf-py's `dequantize` (the portable path) or,
// with AVX2, to 32-value runs of small integers and their scales (what quant_matvec.cc
// multiplies into rows). Included by quant_matvec.cc, and by paged_attention.cc for
// `half_to_float` (every function here is inline).

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace mtpjax_blocks {

enum TypeCode { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, NUM_TYPES };

constexpr int kBlock[NUM_TYPES] = {32, 32, 32, 32, 32, 256, 256, 256, 256, 256};
constexpr int kFields[NUM_TYPES] = {2, 2, 3, 3, 4, 4, 4, 5, 6, 4};
// Types whose values carry a min (w = s * q - m, q >= 0): their products need the sums of x.
constexpr bool kHasMin[NUM_TYPES] = {false, false, true, false, true,
                                     false, false, true, true, false};

// The float16 value nearest a finite float (ties to even; |f| < 65504), as a float: llama.cpp
// keeps its 32-value Q8 rows' scales and sums in float16.
inline float round_to_half(float f) {
  float magnitude = std::fabs(f);
  if (magnitude < 6.103515625e-05f) {   // float16 subnormals: steps of 2^-24
    return std::copysign(std::nearbyint(magnitude * 16777216.0f) / 16777216.0f, f);
  }
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x0FFFu + ((bits >> 13) & 1u);   // round the low 13 mantissa bits away, to even
  bits &= ~0x1FFFu;
  std::memcpy(&f, &bits, 4);
  return f;
}

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
      bool has_min = kHasMin[t];
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
      bool has_min = kHasMin[t], five = t == Q5_0 || t == Q5_1;
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



#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
// AVX-512's integer multiplies run on two ports at 512 bits (one at 256 on the same core), so
// K-quant blocks multiply as pairs of runs: runs 2p and 2p + 1 in one 64-byte register.
#define MTPJAX_AVX512 1

// Lane picks of Q6_K's 16 sub-block scales (as 16-bit values) for run pair p: scales 4p,
// 4p + 1 (run 2p), 4p + 2, 4p + 3 (run 2p + 1), 8 lanes each.
alignas(64) constexpr int16_t kPairScales[4][32] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
     2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5,
     6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9,
     10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13,
     14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};

inline __m512i twice(const uint8_t* p) {   // 32 bytes in both halves
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// Shifts each 16-bit lane of the low half by `low`, of the high half by `high` (to the right
// where `right`).
inline __m512i shift_halves(__m512i v, int low, int high, bool right) {
  __m512i counts = _mm512_inserti64x4(_mm512_set1_epi16(short(low)),
                                      _mm256_set1_epi16(short(high)), 1);
  return right ? _mm512_srlv_epi16(v, counts) : _mm512_sllv_epi16(v, counts);
}

// Runs 2p and 2p + 1 (p 0-3) of a Q6_K block as unsigned 6-bit values (q6_run's, side by
// side): low nibbles of ql[64g .. 64g + 63] for even p, high ones for odd p (g = p / 2), and
// crumbs s = 2 (p % 2) and s + 1 of qh[32g + i].
inline __m512i q6_pair(const uint8_t* ql, const uint8_t* qh, int p) {
  int g = p >> 1;
  __m512i low = _mm512_loadu_si512(ql + 64 * g);
  if (p & 1) low = _mm512_srli_epi16(low, 4);
  __m512i high = (p & 1) ? shift_halves(twice(qh + 32 * g), 0, 2, true)
                         : shift_halves(twice(qh + 32 * g), 4, 2, false);
  return _mm512_or_si512(_mm512_and_si512(low, _mm512_set1_epi8(0x0F)),
                         _mm512_and_si512(high, _mm512_set1_epi8(0x30)));
}

// Runs 2p and 2p + 1 of a Q4_K / Q5_K block (k_run's, side by side): the low and high nibbles
// of qs[32p .. 32p + 31], with Q5_K's fifth bits 2p and 2p + 1.
inline __m512i k_pair(const KBlock& kb, int p) {
  __m512i q = _mm512_and_si512(shift_halves(twice(kb.qs + 32 * p), 0, 4, true),
                               _mm512_set1_epi8(0x0F));
  if (kb.five) {
    __m512i qh = _mm512_broadcast_i64x4(kb.qh);
    __m512i bit = _mm512_and_si512(shift_halves(qh, 2 * p, 2 * p + 1, true),
                                   _mm512_set1_epi8(1));
    q = _mm512_or_si512(q, _mm512_slli_epi16(bit, 4));
  }
  return q;
}
#endif

inline float horizontal_sum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

}  // namespace mtpjax_blocks
