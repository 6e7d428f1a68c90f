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
//   integers (maddubs / madd), as llama.cpp does: the exact weights' product with the row
//   rounded as llama.cpp's Q8 vectors round and keep it;
// - without AVX2, and for Q2_K / Q3_K: the block's float32 values (`dequantize_block`).
// A row's arithmetic is fixed, so its result does not depend on the other rows of the call or
// on the thread count.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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
inline void in_register(__m256i& v) { __asm__("" : "+x"(v)); }
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
  // int8 activations (`int8_x`): each row of x rounded per weight block to int8 times a
  // scale, and for the types with a min the sums of each 32 rounded values, in the bits
  // llama.cpp's Q8 vectors keep (`quantize_rows`): a result is then llama.cpp's product of
  // the weights with the rounded row. Blocks multiply as integers.
  bool int8_x = false;
  std::vector<int8_t> xq;
  std::vector<float> xscale, xsum;
  std::vector<int16_t> xbsum;   // [R, K / 16] sums of the int8 values (Q6_K)

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

  // The float sums of each 32 values of every row (the mins' term), xsum [R, K / 32]
  // (`quantize_rows` replaces them by the rounded rows' sums).
  void sum_rows() {
    xsum.resize(rows * width / 32);
    for (int64_t g = 0; g < rows * width / 32; ++g) {
      float sum = 0.0f;
      for (int i = 0; i < 32; ++i) sum += x[g * 32 + i];
      xsum[g] = sum;
    }
  }

  static int int8_sum(const int8_t* v, int n) {
    int sum = 0;
    for (int i = 0; i < n; ++i) sum += v[i];
    return sum;
  }

  // x rounded per block of the weight type to int8 times xscale [R, K / block], as llama.cpp
  // rounds it: 32-value blocks as Q8_0 / Q8_1 (scale amax / 127 and, for Q4_1 / Q5_1, the
  // block's sum in float16), 256-value blocks as Q8_K (scale 1 / (127 / amax) in float32);
  // for Q6_K (whose offset of 32 they take off) xbsum [R, K / 16], the sums of the int8 values.
  void quantize_rows() {
    int block = kBlock[type];
    int64_t groups = width / block;
    xq.resize(rows * width);
    xscale.resize(rows * groups);
    if (kHasMin[type]) xsum.resize(rows * width / 32);
    for (int64_t g = 0; g < rows * groups; ++g) {
      const float* v = x + g * block;
      float amax = 0.0f;
      for (int i = 0; i < block; ++i) amax = std::max(amax, std::fabs(v[i]));
      float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int i = 0; i < block; ++i) xq[g * block + i] = int8_t(std::nearbyint(v[i] * inverse));
      if (block == 32) {   // Q8_0 / Q8_1: the scale, and the sum of the row's values, in float16
        xscale[g] = round_to_half(amax / 127.0f);
        if (kHasMin[type]) {
          xsum[g] = round_to_half(amax / 127.0f * float(int8_sum(&xq[g * 32], 32)));
        }
      } else {             // Q8_K: the float32 inverse of the multiplier
        xscale[g] = amax > 0.0f ? 1.0f / inverse : 0.0f;
      }
    }
    if (kHasMin[type] && block != 32) {   // Q4_K, Q5_K: the mins' term reads 32-value sums
      for (int64_t g = 0; g < rows * width / 32; ++g) {
        xsum[g] = xscale[g * 32 / block] * float(int8_sum(&xq[g * 32], 32));
      }
    }
    if (type != Q6_K) return;
    xbsum.resize(rows * width / 16);
    for (int64_t g = 0; g < rows * width / 16; ++g) xbsum[g] = int16_t(int8_sum(&xq[g * 16], 16));
  }

#ifdef MTPJAX_SIMD
  // int8 rows, 32-value blocks: each block's integers times each row's int8 values, scaled by
  // the block's and the row's scales, into one accumulator a row and output row (as llama.cpp
  // sums); output rows n .. n + outs - 1 (blocks `first` + o x blocks_per_row) go together.
  template <int T, int count, int outs>
  void small_block_rows_of(int64_t first, const int* group, int64_t n) {
    constexpr bool nonneg = kHasMin[T];
    __m256 acc[outs][count];
    float mins[outs][count];
    const int8_t* xr[count];
    const float* xd[count];
    #pragma GCC unroll 4
    for (int r = 0; r < count; ++r) {
      xr[r] = xq.data() + group[r] * width;
      xd[r] = xscale.data() + group[r] * blocks_per_row;
      #pragma GCC unroll 4
      for (int o = 0; o < outs; ++o) {
        acc[o][r] = _mm256_setzero_ps();
        mins[o][r] = 0.0f;
      }
    }
    for (int64_t b = 0; b < blocks_per_row; ++b) {
      #pragma GCC unroll 4
      for (int o = 0; o < outs; ++o) {
        Run run;
        simd_runs(T, fields, first + o * blocks_per_row + b, &run);
        __m256i magnitude = nonneg ? run.q : _mm256_sign_epi8(run.q, run.q);
        #pragma GCC unroll 4
        for (int r = 0; r < count; ++r) {
          __m256i xv = load32(reinterpret_cast<const uint8_t*>(xr[r] + b * 32));
          __m256i pairs =
              _mm256_maddubs_epi16(magnitude, nonneg ? xv : _mm256_sign_epi8(xv, run.q));
          __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
          acc[o][r] = _mm256_fmadd_ps(sums, _mm256_set1_ps(run.s0 * xd[r][b]), acc[o][r]);
          if (nonneg) mins[o][r] += run.m * xsum[group[r] * blocks_per_row + b];
        }
      }
    }
    #pragma GCC unroll 4
    for (int o = 0; o < outs; ++o) {
      #pragma GCC unroll 4
      for (int r = 0; r < count; ++r) {
        y[group[r] * out_rows + n + o] = horizontal_sum(acc[o][r]) - mins[o][r];
      }
    }
  }

  // Run k's unsigned integers `q` times each row's int8 values, weighted by the run's 16-bit
  // sub-block scales, added to the rows' int32 sums (under 2^24 a lane).
  template <int count>
  static void add_run(__m256i q, __m256i scale, const int8_t* const* xr, int k,
                      __m256i* sums) {
    #pragma GCC unroll 4
    for (int r = 0; r < count; ++r) {
      __m256i xv = load32(reinterpret_cast<const uint8_t*>(xr[r] + 32 * k));
      sums[r] = _mm256_add_epi32(sums[r],
                                 _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scale));
      in_register(sums[r]);
    }
  }

  // The same for K-quants (256-value blocks, one x scale a block). Each run's integers are
  // unpacked once and multiplied into every row as they come (`add_run`; unsigned, so Q6_K's
  // offset of 32 is taken off once a block through the rows' 16-value sums of x), then one
  // float multiply-add a block and row. The mins' term (Q4_K, Q5_K) comes from the rounded
  // rows' sums.
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
          __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(bsums, all_scales), 5);
          sums[r] = _mm256_sub_epi32(sums[r], offset);
        }
        #pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          add_run<count>(q6_run(ql, qhp, k), _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
              scales, _mm_load_si128(reinterpret_cast<const __m128i*>(kScalePairs[k])))),
              xr, k, sums);
        }
      } else {
        KBlock kb = k_block(fields, block, five);
        d = kb.d;
        #pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          add_run<count>(k_run(kb, k), _mm256_set1_epi16(short(kb.sc[k])), xr, k, sums);
        }
        __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(kb.mn));
        dmins = _mm256_mul_ps(_mm256_set1_ps(kb.dmin),
                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8)));
      }
      #pragma GCC unroll 4
      for (int r = 0; r < count; ++r) {
        int64_t g = group[r] * blocks_per_row + b;
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(d * xscale[g]),
                                 acc[r]);
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
  // fours or fewer, each count its own compiled copy with its accumulators in registers; a
  // row's arithmetic is the same in every copy.
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
    for (int r = 0; r < count; r += 4) {
      switch (std::min(4, count - r)) {
        case 1: rows_of<kInt8, T, 1>(first, group + r, n); break;
        case 2: rows_of<kInt8, T, 2>(first, group + r, n); break;
        case 3: rows_of<kInt8, T, 3>(first, group + r, n); break;
        default: rows_of<kInt8, T, 4>(first, group + r, n); break;
      }
    }
    return 1;
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
    if (int8_x) {
      quantize_rows();
    } else if (kHasMin[type] && simd_type(type)) {
      sum_rows();
    }
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
