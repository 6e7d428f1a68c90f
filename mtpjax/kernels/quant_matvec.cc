// Rows against GGUF-quantized matrices on the CPU, reading the integers once: the FFI calls.
// What one product (rows against one tensor) computes, and how, is quant_product.h.
//
// Calls (see mtpjax/kernels/native.py):
// - `MtpjaxQuantMatvec`: x f32 [R, K], ids s32 [R] (the matrix each row reads: an expert, a
//   head, or 0), then the fields of one or more tensors ("products": q, k and v of one x), each
//   tensor's in `quant_blocks.field_specs` order, each field [E, N, nb, ...]; attributes
//   `type_codes` and `int8_x` (one each a product; TYPE_NAMES in native.py); results f32
//   [R, N] a product. One call for the projections that read the same rows saves a call's
//   fixed cost each and lets their chunks share the threads.
// - `MtpjaxQuantSwiglu`: the same x and ids through gate, up (the first call's two products),
//   silu(gate) * up, then down: a SwiGLU feed-forward (dense, or each row's expert) in one call.
// The rows of each matrix are cut into tiles of up to 32 and its output rows into chunks of
// 32; XLA's intra-op threads take (tile, chunk) pairs of all products from one counter, the
// calling thread too, and it waits only for pairs already taken, so no wait depends on a task
// that has not started. Tiles keep a prefill's rows (hundreds against one matrix) in cache.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "quant_product.h"
#include "shared_tasks.h"
#include "simd_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace mtpjax_product;

// Below this many weight bytes a call runs on the calling thread alone.
constexpr int64_t kParallelBytes = 1 << 18;

// One call's products, their chunks numbered one after another and shared with helper tasks
// that may start after the call returned (they find no chunk left and touch nothing else).
struct Call {
  std::vector<std::unique_ptr<Work>> products;
  std::vector<int64_t> first_chunk{0};   // of each product, then the total
  mtpjax_tasks::Counter tasks;            // the chunks taken and done (`run_shared`)
  std::vector<float> scratch;             // a SwiGLU's gate and up results, then its activations

  Work& add() {
    products.push_back(std::make_unique<Work>());
    return *products.back();
  }
  void run_task(int64_t t) {
    size_t p = std::upper_bound(first_chunk.begin(), first_chunk.end(), t) - first_chunk.begin();
    products[p - 1]->run_task(t - first_chunk[p - 1]);
  }
};

std::atomic<int> active_calls{0};

// Runs every chunk of the call's planned products.
void run(ffi::ThreadPool& pool, const std::shared_ptr<Call>& call) {
  int64_t bytes = 0;
  for (const auto& product : call->products) {
    call->first_chunk.push_back(call->first_chunk.back() + product->total_chunks);
    bytes += product->bytes();
  }
  int64_t total = call->first_chunk.back();
  if (total == 0) return;
  // XLA runs independent thunks at once (a gate and an up projection): a call that starts
  // while another runs keeps to its own thread, so the cores are not oversubscribed.
  struct Running {
    int before = active_calls.fetch_add(1);
    ~Running() { active_calls.fetch_sub(1); }
  } running;
  int64_t helpers = bytes < kParallelBytes || running.before > 0
                        ? 0 : std::min<int64_t>(pool.num_threads(), total - 1);
  mtpjax_tasks::run_shared(pool, call, total, helpers);
}

// x [R, K] and ids [R], the dimensions every product reads.
ffi::Error rows_of_call(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::S32>& ids,
                        int64_t* rows, int64_t* width) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("quant_matvec: x must be [R, K]");
  if (xd[0] > kMaxRows) return ffi::Error::InvalidArgument("quant_matvec: too many rows");
  if (ids.element_count() != size_t(xd[0]))
    return ffi::Error::InvalidArgument("quant_matvec: ids must be [R]");
  *rows = xd[0];
  *width = xd[1];
  return ffi::Error::Success();
}

ffi::Error QuantMatvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                       ffi::RemainingArgs fields, ffi::RemainingRets results,
                       ffi::Span<const int32_t> type_codes, ffi::Span<const int32_t> int8_x) {
  int64_t rows, width;
  if (auto e = rows_of_call(x, ids, &rows, &width); e.failure()) return e;
  if (type_codes.size() != results.size() || int8_x.size() != results.size())
    return ffi::Error::InvalidArgument("quant_matvec: one type code and int8_x a result");
  auto call = std::make_shared<Call>();
  size_t first = 0;
  for (size_t p = 0; p < results.size(); ++p) {
    auto y = results.get<ffi::Buffer<ffi::F32>>(p);
    if (!y.has_value()) return y.error();
    Work& product = call->add();
    if (auto e = product.plan(x.typed_data(), rows, width, ids.typed_data(), type_codes[p],
                              int8_x[p] != 0, fields, first, (*y)->typed_data());
        e.failure())
      return e;
    if ((*y)->element_count() != size_t(rows * product.out_rows))
      return ffi::Error::InvalidArgument("quant_matvec: a result is not [R, N]");
    first += kFields[product.type];
  }
  if (first != fields.size())
    return ffi::Error::InvalidArgument("quant_matvec: wrong number of fields for the types");
  run(pool, call);
  return ffi::Error::Success();
}

ffi::Error QuantSwiglu(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                       ffi::RemainingArgs fields, ffi::ResultBuffer<ffi::F32> y,
                       ffi::Span<const int32_t> type_codes, ffi::Span<const int32_t> int8_x) {
  int64_t rows, width;
  if (auto e = rows_of_call(x, ids, &rows, &width); e.failure()) return e;
  if (type_codes.size() != 3 || int8_x.size() != 3)
    return ffi::Error::InvalidArgument("quant_swiglu: three type codes and int8_x (gate, up, down)");
  // gate and up into the first call's scratch, [2, R, F]
  auto gate_up = std::make_shared<Call>();
  Work& gate = gate_up->add();
  Work& up = gate_up->add();
  auto plan_gate = gate.plan(x.typed_data(), rows, width, ids.typed_data(), type_codes[0],
                             int8_x[0] != 0, fields, 0, nullptr);
  if (plan_gate.failure()) return plan_gate;
  int64_t ffn = gate.out_rows;
  gate_up->scratch.resize(2 * rows * ffn);
  gate.y = gate_up->scratch.data();
  size_t first = kFields[gate.type];
  if (auto e = up.plan(x.typed_data(), rows, width, ids.typed_data(), type_codes[1],
                       int8_x[1] != 0, fields, first, gate_up->scratch.data() + rows * ffn);
      e.failure())
    return e;
  if (up.out_rows != ffn)
    return ffi::Error::InvalidArgument("quant_swiglu: gate and up differ in output rows");
  first += kFields[up.type];
  run(pool, gate_up);
  auto down_call = std::make_shared<Call>();
  down_call->scratch.resize(rows * ffn);
  mtpjax_math::silu_times(gate.y, up.y, rows * ffn, down_call->scratch.data());
  Work& down = down_call->add();
  if (auto e = down.plan(down_call->scratch.data(), rows, ffn, ids.typed_data(), type_codes[2],
                         int8_x[2] != 0, fields, first, y->typed_data());
      e.failure())
    return e;
  if (first + kFields[down.type] != fields.size())
    return ffi::Error::InvalidArgument("quant_swiglu: wrong number of fields for the types");
  if (y->element_count() != size_t(rows * down.out_rows))
    return ffi::Error::InvalidArgument("quant_swiglu: the result is not [R, D]");
  run(pool, down_call);
  return ffi::Error::Success();
}

}  // namespace

// Whether int8 rows against `type_code` multiply as integers in this build (`simd_type`):
// where they do, a prefill's rows against per-head matrices and routed experts take this
// kernel (`native.integer_rows`, `quantized.takes_native`).
extern "C" int MtpjaxIntegerRows(int type_code) {
  return type_code >= 0 && type_code < NUM_TYPES && simd_type(type_code);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpjaxQuantMatvec, QuantMatvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int32_t>>("type_codes")
                                  .Attr<ffi::Span<const int32_t>>("int8_x"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpjaxQuantSwiglu, QuantSwiglu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<ffi::Span<const int32_t>>("type_codes")
                                  .Attr<ffi::Span<const int32_t>>("int8_x"));
