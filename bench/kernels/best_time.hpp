// The best of `reps` timed calls of `call`, in nanoseconds, after one untimed call that warms the
// caches (the row benchmarks time kernels on data in cache); the median of a set of timings.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace batchlm::bench {

template <class F>
double best_call_ns(int reps, F&& call) {
  double best = 1e30;
  for (int rep = 0; rep < reps + 1; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0) best = std::min(best, ns);
  }
  return best;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : (v[h - 1] + v[h]) / 2;
}

}  // namespace batchlm::bench
