// crew.h's crew: one OpenMP region a step, its threads handed parts by an epoch counter.
#include "crew.h"

#include <omp.h>

#include <atomic>
#include <exception>
#include <mutex>

#include <immintrin.h>

namespace bucketserve {
namespace {
struct Crew {
  int size = 1;
  // The job: written by the driver before it bumps `epoch`, read by the members after.
  crew::Part part = nullptr;
  const void* body = nullptr;
  int64_t begin = 0, end = 0, chunk = 0;
  std::atomic<uint64_t> epoch{0};
  std::atomic<int> pending{0};  // members yet to finish the current job (all of them answer)
  std::atomic<bool> finished{false};
  std::mutex error_mutex;
  std::exception_ptr error;  // the first exception of a part or of the driver

  void keep(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (!error) error = e;
  }

  void run_piece(int member) {
    const int64_t first = begin + member * chunk;
    if (first >= end) return;
    try {
      part(body, first, std::min(end, first + chunk));
    } catch (...) {
      keep(std::current_exception());
    }
  }

  // A member's life: wait for each job (or the end of the step), do its piece, answer.
  void serve(int member) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t now;
      while ((now = epoch.load(std::memory_order_acquire)) == seen) {
        if (finished.load(std::memory_order_acquire)) return;
        _mm_pause();
      }
      seen = now;
      run_piece(member);
      pending.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
};

thread_local Crew* driven = nullptr;  // the crew this thread drives
}  // namespace

namespace crew {
bool driving() { return driven != nullptr; }

void hand_out(int64_t begin, int64_t end, int64_t grain, Part part, const void* body) {
  if (end <= begin) return;
  Crew& c = *driven;
  const int64_t items = end - begin, least = std::max<int64_t>(grain, 1);
  const int64_t pieces = std::min<int64_t>(c.size, (items + least - 1) / least);
  if (pieces <= 1) {
    part(body, begin, end);
    return;
  }
  c.part = part;
  c.body = body;
  c.begin = begin;
  c.end = end;
  c.chunk = (items + pieces - 1) / pieces;
  c.pending.store(c.size - 1, std::memory_order_relaxed);
  c.epoch.fetch_add(1, std::memory_order_release);
  driven = nullptr;  // a parallel_for inside the piece runs it whole: the crew is busy
  c.run_piece(0);
  driven = &c;
  while (c.pending.load(std::memory_order_acquire) > 0) _mm_pause();
  if (c.error) std::rethrow_exception(c.error);
}
}  // namespace crew

void with_crew(const std::function<void()>& drive) {
  const int threads = at::get_num_threads();
  if (threads <= 1 || omp_in_parallel() || driven != nullptr) {
    drive();
    return;
  }
  Crew c;
#pragma omp parallel num_threads(threads)
  {
    const int member = omp_get_thread_num();
#pragma omp single
    c.size = omp_get_num_threads();  // the runtime may grant fewer threads than asked
    // (the single's barrier: every member sees the size before the driver hands out a job)
    if (member == 0) {
      driven = &c;
      try {
        drive();
      } catch (...) {
        c.keep(std::current_exception());
      }
      driven = nullptr;
      c.finished.store(true, std::memory_order_release);
    } else {
      c.serve(member);
    }
  }
  if (c.error) std::rethrow_exception(c.error);
}

torch::Tensor crew_members(int64_t items, int64_t grain, int64_t failing_item) {
  auto members = torch::full({items}, -1, torch::kLong);
  auto* out = members.data_ptr<int64_t>();
  with_crew([&] {
    parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        TORCH_CHECK(i != failing_item, "item ", i, " failed");
        // a parallel_for inside a piece runs whole on the piece's thread
        parallel_for(0, 4, 1, [&](int64_t, int64_t) { out[i] = omp_get_thread_num(); });
      }
    });
  });
  return members;
}
}  // namespace bucketserve
