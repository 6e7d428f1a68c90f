// Decode and verify rows attending over a paged GQA cache on the CPU.
//
// XLA:CPU runs a step's few query rows against the cache as two batched dots a layer through
// XNNPACK (~20 us a call however small), after converting the block's float16 keys and values
// to float32 in a copy of their own, and at long contexts the blockwise passes read the cache
// several times. This kernel reads each key and value row once, straight from the pool (float16,
// bfloat16 bits or float32), a page at a time converted to float32 once for all the query
// heads that share it (12 a kv head in GLM-4.5-Air).
//
// Call (see mtpjax/kernels/native.py): q f32 [b, T, Hkv, g, hd] (scaled), the pools k
// [P, Hkv, R, hd] and v [P, Hkv, vd, R] (one dtype: F16, U16 = bfloat16 bits, or F32), the page
// table s32 [b, max_pages] and positions s32 [b, T]; result f32 [b, T, Hkv, g, vd]. Query row
// (s, t) attends to rows j <= positions[s, t] of slot s (row j on page table[s, j / R], row
// j % R), with a two-pass softmax in float32: the scores, their max, exp(score - max)
// (`simd_math.h`) and their sum, then the values weighted by the exps over the sum. A row's
// result depends on nothing but its query and the rows it reads, so it is the same in a
// decode step (T = 1) and in a verify step (T = k + 1). The (slot, row, kv head) tasks are shared with XLA's
// intra-op threads from one counter, as quant_matvec.cc shares its chunks.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "quant_blocks.h"
#include "shared_tasks.h"
#include "simd_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Below this many cache rows read in all, a call runs on the calling thread alone.
constexpr int64_t kParallelRows = 1024;

enum class Stored { kF32, kF16, kBf16 };

inline float stored_value(const void* base, int64_t i, Stored kind) {
  switch (kind) {
    case Stored::kF32: return static_cast<const float*>(base)[i];
    case Stored::kF16: return mtpjax_blocks::half_to_float(static_cast<const uint16_t*>(base)[i]);
    default: {
      uint32_t bits = uint32_t(static_cast<const uint16_t*>(base)[i]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
  }
}

#if defined(MTPJAX_SIMD) && defined(__F16C__)
#define MTPJAX_ATTENTION_SIMD 1
using mtpjax_blocks::horizontal_sum;

// Eight stored values from `i` on, as floats.
inline __m256 stored8(const void* base, int64_t i, Stored kind) {
  switch (kind) {
    case Stored::kF32: return _mm256_loadu_ps(static_cast<const float*>(base) + i);
    case Stored::kF16:
      return _mm256_cvtph_ps(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i)));
    default:
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i))), 16));
  }
}
#endif

// sum_k a[k] b[k], k < n: sixteen lanes at a time where AVX2 is built (two independent chains
// of multiply-adds), then the lanes summed and the tail added in order (the same arithmetic for
// every call).
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t k = 0;
  float sum = 0.0f;
#ifdef MTPJAX_ATTENTION_SIMD
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  for (; k + 16 <= n; k += 16) {
    even = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), even);
    odd = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), odd);
  }
  if (k + 8 <= n) {
    even = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), even);
    k += 8;
  }
  sum = horizontal_sum(_mm256_add_ps(even, odd));
#endif
  for (; k < n; ++k) sum += a[k] * b[k];
  return sum;
}

struct Attend {
  int64_t slots = 0, rows = 0, kv_heads = 0, group = 0, head_dim = 0, value_dim = 0;
  int64_t pool_pages = 0, page_rows = 0, max_pages = 0;
  const float* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  Stored kind = Stored::kF32;
  const int32_t* table = nullptr;
  const int32_t* positions = nullptr;
  float* out = nullptr;
  mtpjax_tasks::Counter tasks;    // the (slot, row, kv head) tasks taken and done

  int64_t total() const { return slots * rows * kv_heads; }

  int64_t page_of(int64_t slot, int64_t j) const {
    int64_t page = table[slot * max_pages + j / page_rows];
    return std::min<int64_t>(std::max<int64_t>(page, 0), pool_pages - 1);
  }

  void run_task(int64_t task) {
    switch (kind) {   // each storage kind its own copy, the conversions inlined in the loops
      case Stored::kF32: return attend<Stored::kF32>(task);
      case Stored::kF16: return attend<Stored::kF16>(task);
      default: return attend<Stored::kBf16>(task);
    }
  }

  // Stored values [first, first + n) of a pool as floats in `out` (each converted once, then
  // read by every query head of the group).
  template <Stored kKind>
  static void to_floats(const void* base, int64_t first, int64_t n, float* out) {
    int64_t i = 0;
#ifdef MTPJAX_ATTENTION_SIMD
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, stored8(base, first + i, kKind));
#endif
    for (; i < n; ++i) out[i] = stored_value(base, first + i, kKind);
  }

  // Query rows (slot, t) of kv head h's group, against rows 0 .. positions[slot, t]: the scores
  // page by page (a page's keys converted once for the group), the softmax, then the values
  // page by page (converted once too).
  template <Stored kKind>
  void attend(int64_t task) {
    int64_t h = task % kv_heads, st = task / kv_heads, slot = st / rows;
    int64_t seen = std::min<int64_t>(int64_t(positions[st]) + 1, max_pages * page_rows);
    if (seen < 1) seen = 1;
    const float* query = q + (st * kv_heads + h) * group * head_dim;
    std::vector<float> scores(group * seen);
    std::vector<float> page(page_rows * std::max(head_dim, value_dim));
    for (int64_t first = 0; first < seen; first += page_rows) {
      int64_t n = std::min(page_rows, seen - first);
      to_floats<kKind>(k, (page_of(slot, first) * kv_heads + h) * page_rows * head_dim,
                       n * head_dim, page.data());
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          scores[g * seen + first + r] =
              dot(page.data() + r * head_dim, query + g * head_dim, head_dim);
        }
      }
    }
    std::vector<float> total(group);
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores.data() + g * seen;
      mtpjax_math::exp_shifted(s, seen, *std::max_element(s, s + seen));
      float sum = 0.0f;
      for (int64_t j = 0; j < seen; ++j) sum += s[j];
      total[g] = sum;
    }
    float* result = out + (st * kv_heads + h) * group * value_dim;
    weighted_values<kKind>(slot, h, seen, scores.data(), page.data(), result);
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t d = 0; d < value_dim; ++d) result[g * value_dim + d] /= total[g];
    }
  }

  // result[g, d] = sum_j weights[g, j] v[j, d] over rows j < seen, page by page (a page's values
  // are [vd, R]: each value index's rows are contiguous, converted once into `page`). With
  // AVX2 each (g, d) keeps eight lanes over the rows, summed once at the end, so a page of 16
  // rows costs two multiply-adds per (g, d) and no horizontal sum; a page's rows past a
  // multiple of eight are added in order beside them.
  template <Stored kKind>
  void weighted_values(int64_t slot, int64_t h, int64_t seen, const float* weights, float* page,
                       float* result) {
    std::vector<float> tail(group * value_dim, 0.0f);
#ifdef MTPJAX_ATTENTION_SIMD
    std::vector<float> lanes(group * value_dim * 8, 0.0f);
#endif
    for (int64_t first = 0; first < seen; first += page_rows) {
      int64_t n = std::min(page_rows, seen - first);
      to_floats<kKind>(v, (page_of(slot, first) * kv_heads + h) * value_dim * page_rows,
                       value_dim * page_rows, page);
      for (int64_t g = 0; g < group; ++g) {
        const float* w = weights + g * seen + first;
        for (int64_t d = 0; d < value_dim; ++d) {
          const float* values = page + d * page_rows;
          int64_t full = 0;
#ifdef MTPJAX_ATTENTION_SIMD
          float* lane = lanes.data() + (g * value_dim + d) * 8;
          __m256 acc = _mm256_loadu_ps(lane);
          for (; full + 8 <= n; full += 8) {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + full), _mm256_loadu_ps(values + full), acc);
          }
          _mm256_storeu_ps(lane, acc);
#endif
          float sum = 0.0f;
          for (int64_t r = full; r < n; ++r) sum += w[r] * values[r];
          tail[g * value_dim + d] += sum;
        }
      }
    }
    for (int64_t i = 0; i < group * value_dim; ++i) {
      result[i] = tail[i];
#ifdef MTPJAX_ATTENTION_SIMD
      result[i] += horizontal_sum(_mm256_loadu_ps(lanes.data() + i * 8));
#endif
    }
  }
};

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::Buffer<ffi::S32> table,
                          ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  auto td = table.dimensions(), pd = positions.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || td.size() != 2 || pd.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: wrong ranks");
  if (k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("paged_attention: keys and values differ in dtype");
  auto work = std::make_shared<Attend>();
  switch (k.element_type()) {
    case ffi::DataType::F32: work->kind = Stored::kF32; break;
    case ffi::DataType::F16: work->kind = Stored::kF16; break;
    case ffi::DataType::U16: work->kind = Stored::kBf16; break;
    default: return ffi::Error::InvalidArgument("paged_attention: pools must be f32, f16 or u16");
  }
  work->slots = qd[0];
  work->rows = qd[1];
  work->kv_heads = qd[2];
  work->group = qd[3];
  work->head_dim = qd[4];
  work->pool_pages = kd[0];
  work->page_rows = kd[2];
  work->value_dim = vd[2];
  work->max_pages = td[1];
  if (kd[1] != work->kv_heads || kd[3] != work->head_dim || vd[0] != kd[0] ||
      vd[1] != work->kv_heads || vd[3] != work->page_rows || td[0] != work->slots ||
      pd[0] != work->slots || pd[1] != work->rows || work->pool_pages < 1)
    return ffi::Error::InvalidArgument("paged_attention: shapes disagree");
  work->q = q.typed_data();
  work->k = k.untyped_data();
  work->v = v.untyped_data();
  work->table = table.typed_data();
  work->positions = positions.typed_data();
  work->out = out->typed_data();
  int64_t read = 0;
  for (int64_t i = 0; i < work->slots * work->rows; ++i) read += positions.typed_data()[i] + 1;
  read *= work->kv_heads;
  int64_t helpers = read < kParallelRows
                        ? 0 : std::min<int64_t>(pool.num_threads(), work->total() - 1);
  mtpjax_tasks::run_shared(pool, work, work->total(), helpers);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpjaxPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
