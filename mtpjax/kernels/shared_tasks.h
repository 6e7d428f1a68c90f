// Tasks of one kernel call shared with XLA's intra-op threads: helpers and the calling thread
// take task numbers from one counter, and the calling thread waits only for tasks already
// taken, so no wait depends on a task that has not started. A helper may start after the call
// returned; it finds no task left and touches nothing else, which is why the call's state is
// held by a shared_ptr. Included by quant_matvec.cc and paged_attention.cc.

#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace mtpjax_tasks {

struct Counter {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Runs work->run_task(t) for every t < total on the calling thread and `helpers` of the pool's
// threads (`work->tasks` is the Counter), returning when all are done.
template <class Work>
void run_shared(xla::ffi::ThreadPool& pool, const std::shared_ptr<Work>& work, int64_t total,
                int64_t helpers) {
  auto drain = [total](Work& w, bool wait) {
    for (int64_t t; (t = w.tasks.next.fetch_add(1)) < total;) {
      w.run_task(t);
      w.tasks.done.fetch_add(1);
    }
    if (wait) {
      while (w.tasks.done.load() < total) std::this_thread::yield();
    }
  };
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([work, drain] { drain(*work, false); });
  }
  drain(*work, true);
}

}  // namespace mtpjax_tasks
