// One product of the native CPU kernel: rows against one GGUF-quantized tensor's matrices,
// reading the integers once (included by quant_matvec.cc, whose calls plan and run products).
//
// XLA:CPU cannot keep the unpacking of packed nibbles and bits in a vectorized loop beside the
// multiply-add, so a decode step there ran at 1-5 G weights/s. This kernel unpacks one block
// (32 or 256 weights, `quant_blocks.h`) at a time and multiplies it into every row that reads
// that matrix, before the next block:
// - float32 rows: each 32-value run's integers times the row, the run's scales applied to the
//   partial sums (s * sum(q x) - m * sum(x)); a unit row reads gguf-py's value exactly;
// - int8 rows (`int8_x`): each row rounded per block to int8 and a scale, multiplied as
//   integers (maddubs / madd, or VNNI's fused forms; K-quants two runs a 512-bit register
//   with AVX-512), as llama.cpp does: the exact weights' product with the row rounded as
//   llama.cpp's Q8 vectors round and keep it;
// - without AVX2, and for Q2_K / Q3_K: the block's float32 values (`dequantize_block`).
// A row's arithmetic is fixed, so its result does not depend on the other rows of the call or
// on the thread count.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int8_rows.h"
#include "quant_blocks.h"
#include "xla/ffi/api/ffi.h"

namespace mtpjax_product {

namespace ffi = xla::ffi;
using namespace mtpjax_blocks;

constexpr int kMaxRows = 4096;  // native.MAX_ROWS
constexpr int kScalarRows = 64;  // rows a scalar pass keeps accumulators for
constexpr int kChunkRows = 32;
// Rows of x a chunk multiplies (a tile of its group): a tile's int8 rows (32 x K bytes) and a
// chunk's blocks stay in a core's L2 while every output row of the chunk reads them.
constexpr int kTileRows = 32;
// K-quant blocks ahead that a pass prefetches (each field's block: its first cache line, and
// the second of Q4_K / Q5_K / Q6_K's 128 bytes of values): against 8 rows a block's arithmetic
// outlasts what the hardware prefetcher fetches ahead on its own.
constexpr int kPrefetchBlocks = 4;


// Whether `type` takes the AVX2 paths in this build (runs of integers; its int8 rows then
// multiply as integers): all types but Q2_K and Q3_K, which keep `dequantize_block`.
constexpr bool simd_type(int type) {
#ifdef MTPJAX_SIMD
  return type != Q2_K && type != Q3_K;
#else
  return false;
#endif
}

#ifdef MTPJAX_SIMD
// Keeps `v` in a register here: GCC otherwise reassociates a block's 32 products of four rows
// into trees, computing them all first and spilling them (about 2x the instructions).
// ("v": any of AVX-512's 32 registers, "x": the first 16, all AVX2 has.)
#ifdef __AVX512VL__
inline void in_register(__m256i& v) { __asm__("" : "+v"(v)); }
inline void in_register(__m512i& v) { __asm__("" : "+v"(v)); }
#else
inline void in_register(__m256i& v) { __asm__("" : "+x"(v)); }
#endif

// Int8 rows a pass takes: a block's integers are unpacked once for a decode step's 8 rows over
// 8 slots (AVX-512's 32 registers hold all their accumulators; with AVX2's 16 the integer sums
// stay in registers and the float ones go to L1 once a block: still ~20% faster than two passes
// of 4 for the head). Float32 rows keep 4 accumulators a row, so they pass 4 at a time.
constexpr int kPassRows = 8;

// A row's int32 sums of a K-quant block, and their 8 lanes as add_run adds them: with AVX-512
// runs go in pairs (add_run_pair) into 16 lanes, and lanes m and m + 8 hold values
// 4m .. 4m + 3 of runs 2p and 2p + 1, so folding them gives lane m add_run's integers.
#ifdef MTPJAX_AVX512
using RunSums = __m512i;
inline __m256i folded(__m512i wide) {
  return _mm256_add_epi32(_mm512_castsi512_si256(wide), _mm512_extracti64x4_epi64(wide, 1));
}
#else
using RunSums = __m256i;
inline __m256i folded(__m256i lanes) { return lanes; }
#endif

// sums + madd(a, b) (16-bit pairs multiplied and added into int32 lanes): one instruction
// where the CPU has VNNI, the same integers.
inline __m256i madd_add(__m256i sums, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(sums, a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(sums, a, b);
#else
  return _mm256_add_epi32(sums, _mm256_madd_epi16(a, b));
#endif
}

// The int32 sums of each 4 products of unsigned `u` and signed `v` bytes: one instruction
// with VNNI, else maddubs then madd (which never saturates here: |u| <= 128, |v| <= 127).
inline __m256i quad_sums(__m256i u, __m256i v) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, v);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
#endif
}
#endif

// One product's plan: rows of x against one tensor's matrices, into y.
struct Work {
  int type = 0;
  int64_t rows = 0, width = 0, out_rows = 0, blocks_per_row = 0, blocks_per_matrix = 0;
  const float* x = nullptr;
  float* y = nullptr;
  Field fields[6];
  // Rows grouped by the matrix they read: group g is rows order[starts[g] .. starts[g+1]),
  // cut into tiles of at most kTileRows rows (tile t: rows order[tile_start[t] ..
  // tile_start[t + 1]) of group tile_group[t]).
  std::vector<int> order, starts, matrix, tile_start, tile_group;
  int64_t chunks_per_tile = 0, total_chunks = 0;
  // float32 rows of the types with a min: the sums of each 32 values of every row
  std::vector<float> xsum;
  // int8 activations (`int8_x`): the rows rounded as llama.cpp rounds them (`Int8Rows`), so a
  // result is llama.cpp's product of the weights with the rounded row.
  bool int8_x = false;
#ifdef MTPJAX_SIMD
  Int8Rows x8;
#endif

  void run_task(int64_t chunk) {
    int64_t t = chunk / chunks_per_tile;
    int64_t n0 = (chunk % chunks_per_tile) * kChunkRows;
    int64_t n1 = std::min(out_rows, n0 + kChunkRows);
    int g = tile_group[t];
    const int* group = order.data() + tile_start[t];
    int count = tile_start[t + 1] - tile_start[t];
    for (int64_t n = n0; n < n1;) {
      int64_t first = matrix[g] * blocks_per_matrix + n * blocks_per_row;
#ifdef MTPJAX_SIMD
      if (simd_type(type)) {
        n += int8_x ? simd_row<true>(first, group, count, n, n1 - n)
                    : simd_row<false>(first, group, count, n, n1 - n);
        continue;
      }
#endif
      scalar_row(first, group, count, n);
      ++n;
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

#ifdef MTPJAX_SIMD
  // int8 rows, 32-value blocks: each block's integers times each row's int8 values, scaled by
  // the block's and the row's scales, into one accumulator a row and output row (as llama.cpp
  // sums); output rows n .. n + outs - 1 (blocks `first` + o x blocks_per_row) go together.
  template <int T, int count, int outs>
  void small_block_rows_of(int64_t first, const int* group, int64_t n) {
    constexpr bool nonneg = kHasMin[T];
    const int64_t position = group - order.data();
    __m256 acc[outs][count];
    float mins[outs][count];
    #pragma GCC unroll 8
    for (int r = 0; r < count; ++r) {
      #pragma GCC unroll 8
      for (int o = 0; o < outs; ++o) {
        acc[o][r] = _mm256_setzero_ps();
        mins[o][r] = 0.0f;
      }
    }
    for (int64_t b = 0; b < blocks_per_row; ++b) {
      int64_t record = x8.record(b, position);   // row r's: record + r
      const int8_t* xb = x8.q.data() + record * 32;
      #pragma GCC unroll 8
      for (int o = 0; o < outs; ++o) {
        Run run;
        simd_runs(T, fields, first + o * blocks_per_row + b, &run);
        __m256i magnitude = nonneg ? run.q : _mm256_sign_epi8(run.q, run.q);
        #pragma GCC unroll 8
        for (int r = 0; r < count; ++r) {
          __m256i xv = load32(reinterpret_cast<const uint8_t*>(xb + 32 * r));
          __m256 sums = _mm256_cvtepi32_ps(
              quad_sums(magnitude, nonneg ? xv : _mm256_sign_epi8(xv, run.q)));
          acc[o][r] = _mm256_fmadd_ps(sums, _mm256_set1_ps(run.s0 * x8.scale[record + r]),
                                      acc[o][r]);
          if (nonneg) mins[o][r] += run.m * x8.sum32[record + r];
        }
      }
    }
    #pragma GCC unroll 8
    for (int o = 0; o < outs; ++o) {
      #pragma GCC unroll 8
      for (int r = 0; r < count; ++r) {
        y[group[r] * out_rows + n + o] = horizontal_sum(acc[o][r]) - mins[o][r];
      }
    }
  }

  // Run k's unsigned integers `q` times each row's int8 values (row r's block at xb + 256 r),
  // weighted by the run's 16-bit sub-block scales, added to the rows' int32 sums (under 2^24 a
  // lane).
  template <int count>
  static void add_run(__m256i q, __m256i scale, const int8_t* xb, int k, __m256i* sums) {
    #pragma GCC unroll 8
    for (int r = 0; r < count; ++r) {
      __m256i xv = load32(reinterpret_cast<const uint8_t*>(xb + 256 * r + 32 * k));
      sums[r] = madd_add(sums[r], _mm256_maddubs_epi16(q, xv), scale);
      in_register(sums[r]);
    }
  }

#ifdef MTPJAX_AVX512
  // add_run for runs 2p and 2p + 1 side by side (`q6_pair`, `k_pair`) into 16 lanes a row.
  template <int count>
  static void add_run_pair(__m512i q, __m512i scale, const int8_t* xb, int p, __m512i* sums) {
    #pragma GCC unroll 8
    for (int r = 0; r < count; ++r) {
      __m512i xv = _mm512_loadu_si512(xb + 256 * r + 64 * p);
      sums[r] = _mm512_dpwssd_epi32(sums[r], _mm512_maddubs_epi16(q, xv), scale);
      in_register(sums[r]);
    }
  }
#endif

  // The same for K-quants (256-value blocks, one x scale a block). Each run's integers are
  // unpacked once and multiplied into every row as they come (`add_run`; unsigned, so Q6_K's
  // offset of 32 is taken off once a block through the rows' 16-value sums of x), then one
  // float multiply-add a block and row. The mins' term (Q4_K, Q5_K) comes from the rounded
  // rows' sums.
  template <int T, int count>
  void kquant_rows_of(int64_t first, const int* group, int64_t n) {
    constexpr bool six = T == Q6_K, five = T == Q5_K;
    const int64_t position = group - order.data();
    __m256 acc[count], mins[count];
    RunSums sums[count];   // folded to add_run's 8 lanes at the block's end
    #pragma GCC unroll 8
    for (int r = 0; r < count; ++r) acc[r] = mins[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks_per_row; ++b) {
      int64_t block = first + b;
      #pragma GCC unroll 6
      for (int i = 0; i < kFields[T]; ++i) {   // a hint: past the end it reads nothing
        const char* ahead = reinterpret_cast<const char*>(at(fields[i], block + kPrefetchBlocks));
        _mm_prefetch(ahead, _MM_HINT_T0);
        if (fields[i].block_bytes > 64) _mm_prefetch(ahead + 64, _MM_HINT_T0);
      }
      #pragma GCC unroll 8
      for (int r = 0; r < count; ++r) {
        sums[r] = RunSums();
      }
      int64_t record = x8.record(b, position);   // row r's: record + r
      const int8_t* xb = x8.q.data() + record * 256;
      float d;
      __m256 dmins = _mm256_setzero_ps();
      __m256i all_scales = _mm256_setzero_si256();   // Q6_K's 16, as 16-bit values
      if (six) {
        const uint8_t* ql = at(fields[0], block);
        const uint8_t* qhp = at(fields[1], block);
        d = f16_fast(fields[3], block);
        __m128i scales = _mm_xor_si128(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(at(fields[2], block))),
            _mm_set1_epi8(char(0x80)));
        all_scales = _mm256_cvtepi8_epi16(scales);
#ifdef MTPJAX_AVX512
        #pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          add_run_pair<count>(q6_pair(ql, qhp, p), _mm512_permutexvar_epi16(
              _mm512_load_si512(kPairScales[p]), _mm512_castsi256_si512(all_scales)),
              xb, p, sums);
        }
#else
        #pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          add_run<count>(q6_run(ql, qhp, k), _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
              scales, _mm_load_si128(reinterpret_cast<const __m128i*>(kScalePairs[k])))),
              xb, k, sums);
        }
#endif
      } else {
        KBlock kb = k_block(fields, block, five);
        d = kb.d;
#ifdef MTPJAX_AVX512
        #pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          add_run_pair<count>(k_pair(kb, p), _mm512_inserti64x4(
              _mm512_set1_epi16(short(kb.sc[2 * p])), _mm256_set1_epi16(short(kb.sc[2 * p + 1])),
              1), xb, p, sums);
        }
#else
        #pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          add_run<count>(k_run(kb, k), _mm256_set1_epi16(short(kb.sc[k])), xb, k, sums);
        }
#endif
        __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(kb.mn));
        dmins = _mm256_mul_ps(_mm256_set1_ps(kb.dmin),
                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8)));
      }
      #pragma GCC unroll 8
      for (int r = 0; r < count; ++r) {
        __m256i lanes = folded(sums[r]);
        if (six) {   // Q6_K's offset: 32 x the scales' products with the row's 16-value sums
          __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
              x8.sum16.data() + (record + r) * 16));
          lanes = _mm256_sub_epi32(lanes,
                                   _mm256_slli_epi32(_mm256_madd_epi16(bsums, all_scales), 5));
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes),
                                 _mm256_set1_ps(d * x8.scale[record + r]), acc[r]);
        if (!six) {
          mins[r] = _mm256_fmadd_ps(dmins, _mm256_loadu_ps(x8.sum32.data() + (record + r) * 8),
                                    mins[r]);
        }
      }
    }
    #pragma GCC unroll 8
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
    constexpr bool has_min = kHasMin[T];
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
        auto eight = [&](int i) {
          return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + i))));
        };
        __m256 q0 = eight(0), q1 = eight(8), q2 = eight(16), q3 = eight(24);
        __m256 s0 = _mm256_set1_ps(run.s0), s1 = _mm256_set1_ps(run.s1);
        int lane = 2 * (int(b * n_runs + k) & 1);
        int64_t off = b * block + 32 * k;
        #pragma GCC unroll 4
        for (int r = 0; r < count; ++r) {
          const float* xr = xs[r] + off;
          __m256 lo = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xr + 8),
                                      _mm256_mul_ps(q0, _mm256_loadu_ps(xr)));
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
  // Output rows n .. n + outs - 1 for the rows of a group, by type and path. Rows go through in
  // passes of kPassRows (int8) or 4 (float32) or fewer, each count its own compiled copy with
  // its accumulators in registers; a row's arithmetic is the same in every copy.
  template <bool kInt8, int T, int count, int outs = 1>
  void rows_of(int64_t first, const int* group, int64_t n) {
    if constexpr (!kInt8) {
      simd_rows_of<T, count>(first, group, n);
    } else if constexpr (kBlock[T] == 256) {
      kquant_rows_of<T, count>(first, group, n);
    } else {
      small_block_rows_of<T, count, outs>(first, group, n);
    }
  }

  // The output rows from n on (`left` of them in the chunk) for the rows of a group: how many
  // it did. One int8 row against 32-value blocks takes four output rows at once, two rows take
  // two: their independent accumulators hide the multiply-adds' latency a lone row waits on.
  template <bool kInt8, int T>
  int rows_in_fours(int64_t first, const int* group, int count, int64_t n, int64_t left) {
    if constexpr (kInt8 && kBlock[T] == 32) {
      if (count == 1 && left >= 4) {
        rows_of<kInt8, T, 1, 4>(first, group, n);
        return 4;
      }
      if (count == 2 && left >= 2) {
        rows_of<kInt8, T, 2, 2>(first, group, n);
        return 2;
      }
    }
    constexpr int pass = kInt8 ? kPassRows : 4;
    for (int r = 0; r < count; r += pass) {
      rows_by_count<kInt8, T, pass>(std::min(pass, count - r), first, group + r, n);
    }
    return 1;
  }

  // rows_of's copy for `count` (1 .. most) rows.
  template <bool kInt8, int T, int most, int c = 1>
  void rows_by_count(int count, int64_t first, const int* group, int64_t n) {
    if constexpr (c < most) {
      if (count > c) return rows_by_count<kInt8, T, most, c + 1>(count, first, group, n);
    }
    rows_of<kInt8, T, c>(first, group, n);
  }

  template <bool kInt8>
  int simd_row(int64_t first, const int* group, int count, int64_t n, int64_t left) {
    switch (type) {
      case Q8_0: return rows_in_fours<kInt8, Q8_0>(first, group, count, n, left);
      case Q4_0: return rows_in_fours<kInt8, Q4_0>(first, group, count, n, left);
      case Q4_1: return rows_in_fours<kInt8, Q4_1>(first, group, count, n, left);
      case Q5_0: return rows_in_fours<kInt8, Q5_0>(first, group, count, n, left);
      case Q5_1: return rows_in_fours<kInt8, Q5_1>(first, group, count, n, left);
      case Q4_K: return rows_in_fours<kInt8, Q4_K>(first, group, count, n, left);
      case Q5_K: return rows_in_fours<kInt8, Q5_K>(first, group, count, n, left);
      default: return rows_in_fours<kInt8, Q6_K>(first, group, count, n, left);
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


  // Plans x [rows, width] against the tensor of `type_code` whose fields are `args`[first ..
  // first + kFields), row r against matrix id[r], into y [rows, N]: checks the shapes, groups the
  // rows by matrix (stably, so a matrix's blocks are unpacked once for all its rows), rounds or
  // sums the rows as its path reads them, and cuts the chunks.
  ffi::Error plan(const float* x_in, int64_t rows_in, int64_t width_in, const int32_t* id,
                  int type_code, bool int8, const ffi::RemainingArgs& args, size_t first,
                  float* y_out) {
    if (type_code < 0 || type_code >= NUM_TYPES)
      return ffi::Error::InvalidArgument("quant_matvec: unknown type code");
    if (first + kFields[type_code] > args.size())
      return ffi::Error::InvalidArgument("quant_matvec: too few fields for the types");
    type = type_code;
    rows = rows_in;
    width = width_in;
    x = x_in;
    y = y_out;
    int64_t matrices = 0;
    for (int i = 0; i < kFields[type]; ++i) {
      auto field = args.get<ffi::AnyBuffer>(first + i);
      if (!field.has_value()) return field.error();
      auto dims = field->dimensions();
      if (dims.size() < 3) return ffi::Error::InvalidArgument("quant_matvec: field rank < 3");
      if (i == 0) {
        matrices = dims[0];
        out_rows = dims[1];
        blocks_per_row = dims[2];
      } else if (dims[0] != matrices || dims[1] != out_rows || dims[2] != blocks_per_row) {
        return ffi::Error::InvalidArgument("quant_matvec: fields disagree on [E, N, nb]");
      }
      int64_t per_block = ffi::ByteWidth(field->element_type());
      for (size_t k = 3; k < dims.size(); ++k) per_block *= dims[k];
      fields[i] = {static_cast<const uint8_t*>(field->untyped_data()), per_block};
    }
    if (blocks_per_row * kBlock[type] != width)
      return ffi::Error::InvalidArgument("quant_matvec: x width != blocks x block size");
    blocks_per_matrix = out_rows * blocks_per_row;
    order.resize(rows);
    for (int r = 0; r < rows; ++r) {
      if (id[r] < 0 || id[r] >= matrices)
        return ffi::Error::InvalidArgument("quant_matvec: matrix id out of range");
      order[r] = r;
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return id[a] < id[b]; });
    for (int r = 0; r < rows; ++r) {
      if (r == 0 || id[order[r]] != id[order[r - 1]]) {
        starts.push_back(r);
        matrix.push_back(id[order[r]]);
      }
    }
    starts.push_back(int(rows));
    // Rows are rounded only where the integer paths read them, and summed only for the float32
    // paths that read the sums; `dequantize_block`'s path reads x alone.
    int8_x = int8 && simd_type(type);
#ifdef MTPJAX_SIMD
    if (int8_x) x8.round(type, x, width, order);
#endif
    if (!int8_x && kHasMin[type] && simd_type(type)) sum_rows();
    plan_chunks();
    return ffi::Error::Success();
  }

  // The weight bytes this product reads.
  int64_t bytes() const {
    int64_t per_block = 0;
    for (int i = 0; i < kFields[type]; ++i) per_block += fields[i].block_bytes;
    return per_block * blocks_per_matrix * int64_t(matrix.size());
  }

  // Cuts each group of rows into tiles and counts the chunks (tiles x output-row chunks).
  void plan_chunks() {
    for (size_t g = 0; g + 1 < starts.size(); ++g) {
      for (int r = starts[g]; r < starts[g + 1]; r += kTileRows) {
        tile_start.push_back(r);
        tile_group.push_back(int(g));
      }
    }
    tile_start.push_back(starts.back());
    chunks_per_tile = (out_rows + kChunkRows - 1) / kChunkRows;
    total_chunks = chunks_per_tile * int64_t(tile_group.size());
  }
};

}  // namespace mtpjax_product
