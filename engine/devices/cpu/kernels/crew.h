// A decode step's threads held between its kernels. at::parallel_for opens an OpenMP parallel
// region per call, about 2 microseconds of fork and join on this project's 2-core machines, and a
// fused decode step makes about five such calls a layer (the products and attention), some 10% of
// a lone int4 row's step. with_crew opens one region for the whole step: its first thread drives
// the step, the others spin until parallel_for hands them a part (well under a microsecond).
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <functional>

namespace bucketserve {
namespace crew {
using Part = void (*)(const void* body, int64_t begin, int64_t end);

// Whether this thread drives a crew now: then hand_out runs part(body, ...) over [begin, end) in
// at most one piece a crew member, each of at least `grain` items, and returns when all are done.
bool driving();
void hand_out(int64_t begin, int64_t end, int64_t grain, Part part, const void* body);
}  // namespace crew

// at::parallel_for's contract (parts of at least `grain` items, f(begin, end) on each), run by the
// crew where this thread drives one, else by at::parallel_for.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (!crew::driving()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  crew::hand_out(
      begin, end, grain,
      [](const void* body, int64_t first, int64_t last) {
        (*static_cast<const F*>(body))(first, last);
      },
      &f);
}

// Runs `drive` on this thread with the process's other torch threads as its crew; an exception
// of `drive` or of a part comes out of here, after every thread has stopped.
void with_crew(const std::function<void()>& drive);

// For the tests: `items` handed out in parts of at least `grain` inside one crew, each item's
// OpenMP thread number (a nested parallel_for sets it); item `failing_item` raises instead.
torch::Tensor crew_members(int64_t items, int64_t grain, int64_t failing_item);
}  // namespace bucketserve
