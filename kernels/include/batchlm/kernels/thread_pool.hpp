#pragma once
// A fixed set of worker threads for the kernels. parallel_for splits a range over the workers
// and the calling thread and returns when every part is done. Workers spin briefly between
// jobs (a decode step runs hundreds of small jobs) and then sleep.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace batchlm::kernels {

class ThreadPool {
 public:
  // n_threads counts the caller: 1 means no workers. 0 means the number of hardware threads.
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // fn(begin, end, thread_index) over [0, n) in contiguous parts of at least `grain` items,
  // handed out to the threads as they become free.
  using Body = std::function<void(std::int64_t, std::int64_t, int)>;
  void parallel_for(std::int64_t n, std::int64_t grain, const Body& fn);

 private:
  void worker(int index);
  void run_chunks(int index);

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  const Body* body_ = nullptr;
  std::int64_t n_ = 0;
  std::int64_t chunk_ = 0;
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<std::int64_t> next_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace batchlm::kernels
