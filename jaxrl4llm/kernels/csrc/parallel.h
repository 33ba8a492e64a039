// Work sharing for the CPU kernels: items [0, n) are handed out in chunks from an atomic
// counter to the calling thread and to helpers scheduled on XLA's intra-op thread pool.
//
// The calling thread always takes part, so the call finishes even if no helper ever starts
// (a busy pool); it waits only for chunks that a helper has already claimed. Helpers that
// start late find no chunk left and return. The shared state is reference-counted so a late
// helper never touches freed memory.
#pragma once

#include <algorithm>
#include <atomic>
#include <utility>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxrl4llm {

struct WorkShare {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  std::mutex mu;
  std::condition_variable cv;
};

// Calls body(begin, end) over [0, n) in chunks of `grain` items, on up to the pool's threads.
template <typename Body>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, int64_t grain, const Body& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = (n + grain - 1) / grain;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks - 1);
  if (helpers <= 0) {
    body(0, n);
    return;
  }
  auto share = std::make_shared<WorkShare>();
  // `body` lives on the caller's stack: helpers reach it only through chunks they claim
  // before the caller stops waiting, i.e. while the caller is still inside this function.
  auto run = [share, n, grain, chunks, &body]() {
    for (int64_t c; (c = share->next.fetch_add(1)) < chunks;) {
      body(c * grain, std::min(n, (c + 1) * grain));
      if (share->finished.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(share->mu);
        share->cv.notify_all();
      }
    }
  };
  for (int64_t i = 0; i < helpers; ++i) {
    auto task = run;
    pool.Schedule(std::move(task));
  }
  run();
  std::unique_lock<std::mutex> lock(share->mu);
  share->cv.wait(lock, [&] { return share->finished.load() == chunks; });
}

}  // namespace jaxrl4llm
