#pragma once
// Asynchronous admission control for the dispatcher: a counting semaphore for concurrency and
// token buckets for requests/min and tokens/min. All are used from one Asio thread.

#include <chrono>
#include <cstddef>
#include <deque>
#include <memory>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/steady_timer.hpp>

namespace batchlm::runner {

// Waiters are served first come, first served. acquire() is cancellable (per-operation
// cancellation): a cancelled waiter takes no permit.
class AsyncSemaphore {
 public:
  AsyncSemaphore(boost::asio::any_io_executor executor, std::size_t permits);
  boost::asio::awaitable<void> acquire();
  void release();
  std::size_t available() const { return permits_; }
  std::size_t waiting() const { return waiters_.size(); }

 private:
  boost::asio::any_io_executor executor_;
  std::size_t permits_;
  std::deque<std::shared_ptr<boost::asio::steady_timer>> waiters_;
};

// A token bucket: `rate` tokens per second, holding at most `burst`. acquire(n) waits until n
// tokens are there and takes them (n larger than the burst waits for a full bucket and takes
// all, going negative). adjust(delta) corrects after the fact (an estimate replaced by the
// actual usage: positive delta takes more, negative gives back). Rate 0: unlimited.
class TokenBucket {
 public:
  TokenBucket(boost::asio::any_io_executor executor, double rate_per_second, double burst);
  boost::asio::awaitable<void> acquire(double tokens);
  // The clock-driven core of acquire(), callable with any clock reading: takes the tokens
  // when nobody is queued and they are there now.
  bool try_acquire(double tokens, std::chrono::steady_clock::time_point now);
  // How long until `tokens` would be there (zero when they are), ignoring queued waiters.
  std::chrono::steady_clock::duration wait_time(double tokens, std::chrono::steady_clock::time_point now);
  void adjust(double delta);
  double level(std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now());
  bool unlimited() const { return rate_ <= 0; }

 private:
  void refill(std::chrono::steady_clock::time_point now);
  void wake_front();
  void leave(const std::shared_ptr<boost::asio::steady_timer>& waiter);
  boost::asio::any_io_executor executor_;
  double rate_, burst_, level_;
  std::chrono::steady_clock::time_point last_;
  std::deque<std::shared_ptr<boost::asio::steady_timer>> queue_;  // FIFO fairness
};

}  // namespace batchlm::runner
