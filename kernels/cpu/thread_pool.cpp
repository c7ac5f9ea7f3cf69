#include "batchlm/kernels/thread_pool.hpp"

#include <algorithm>
#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BATCHLM_PAUSE() _mm_pause()
#else
#define BATCHLM_PAUSE() ((void)0)
#endif

namespace batchlm::kernels {

namespace {
// How long an idle worker spins for the next job before it sleeps. A decode step issues a job
// every few tens of microseconds; a pause between requests is far longer.
constexpr auto kSpin = std::chrono::microseconds(2000);
}  // namespace

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  n_threads_ = n_threads;
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stop_.store(true);
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::parallel_for(std::int64_t n, std::int64_t grain, const Body& fn) {
  if (n <= 0) return;
  grain = std::max<std::int64_t>(grain, 1);
  const std::int64_t parts = std::min<std::int64_t>(n_threads_, (n + grain - 1) / grain);
  if (parts <= 1) {
    fn(0, n, 0);
    return;
  }
  // Threads take chunks from a shared counter, each a share of what is left (a quarter of it
  // per thread pair, never below `grain`): large contiguous parts first, then smaller and
  // smaller ones, so uneven items (the causal attention of a prompt: later tokens see more) and
  // item counts that do not divide by the threads still end at about the same time.
  body_ = &fn;
  n_ = n;
  chunk_ = grain;
  next_.store(0);
  pending_.store(n_threads_ - 1);
  generation_.fetch_add(1);
  if (sleepers_.load() > 0) {
    { std::lock_guard lock(mutex_); }
    wake_.notify_all();
  }
  run_chunks(0);
  // Wait for the workers. On a machine with more runnable threads than cores a worker may be
  // descheduled; yielding now and then lets it run instead of spinning against it.
  for (int spins = 0; pending_.load(std::memory_order_acquire) != 0;) {
    BATCHLM_PAUSE();
    if (++spins == 256) {
      spins = 0;
      std::this_thread::yield();
    }
  }
  body_ = nullptr;
}

void ThreadPool::run_chunks(int index) {
  const std::int64_t divisor = 2 * static_cast<std::int64_t>(n_threads_);
  std::int64_t begin = next_.load(std::memory_order_relaxed);
  for (;;) {
    std::int64_t size = 0;
    do {
      if (begin >= n_) return;
      size = std::max(chunk_, (n_ - begin) / divisor);
    } while (!next_.compare_exchange_weak(begin, begin + size, std::memory_order_relaxed));
    (*body_)(begin, std::min(n_, begin + size), index);
    begin = next_.load(std::memory_order_relaxed);
  }
}

void ThreadPool::worker(int index) {
  // Generation 0 is the state at construction; a job published before this thread got going
  // is still generation 1 and must not be missed.
  std::uint64_t seen = 0;
  for (;;) {
    // Spin, then sleep, until a new job (or stop) is published.
    const auto spin_until = std::chrono::steady_clock::now() + kSpin;
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen) {
      BATCHLM_PAUSE();
      if (++spins == 256) {
        spins = 0;
        std::this_thread::yield();
        if (std::chrono::steady_clock::now() > spin_until) {
          sleepers_.fetch_add(1);
          std::unique_lock lock(mutex_);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleepers_.fetch_sub(1);
        }
      }
    }
    seen = generation_.load();
    if (stop_.load()) return;
    run_chunks(index);
    pending_.fetch_sub(1, std::memory_order_release);
  }
}

}  // namespace batchlm::kernels
