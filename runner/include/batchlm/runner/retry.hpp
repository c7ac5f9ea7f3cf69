#pragma once
// The one retry policy: what is retried, how long to wait, and a budget that keeps retries a
// fraction of traffic when a server is failing.

#include <array>
#include <chrono>
#include <random>
#include <string>

#include "batchlm/core/types.hpp"
#include "batchlm/runner/job.hpp"

namespace batchlm::runner {

class RetryPolicy {
 public:
  explicit RetryPolicy(RetrySpec spec) : spec_(spec) {}

  // x-should-retry wins when present. Otherwise: retry 408, 409, 429, 5xx, connection errors,
  // timeouts, truncated streams, error events in a stream, malformed bodies; never 400, 401,
  // 403, 404, 422 (nor other 4xx), a 429 whose code is insufficient_quota, a response too
  // large, or a cancellation.
  bool retryable(const Error& error) const;

  // The wait before attempt number `next_attempt` (2 for the first retry): the server's
  // retry-after hint when it has one (capped at max_retry_after), else full jitter over
  // min(cap, base * 2^(next_attempt - 2)).
  std::chrono::milliseconds delay(int next_attempt, const Error& error, std::mt19937_64& rng) const;

  int max_attempts() const { return spec_.max_attempts; }

 private:
  RetrySpec spec_;
};

// Keeps retries a fraction of traffic over a sliding window (10 s, in 1 s buckets): retries in
// the window may be at most ratio * first attempts in the window + min_per_second * 10. A
// retry that finds the budget spent waits for it rather than failing its item: a failing
// server then sees a trickle of retries, and every item still gets its attempts. Not
// thread-safe: used from the runner's one thread.
class RetryBudget {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr int kWindowSeconds = 10;

  RetryBudget(double ratio, double min_per_second, Clock::time_point start = Clock::now());
  void on_first_attempt(Clock::time_point now = Clock::now());
  // Takes one retry from the budget if there is one.
  bool try_spend(Clock::time_point now = Clock::now());
  // When a spent budget can next change: the start of the next 1 s bucket.
  std::chrono::milliseconds time_until_refill(Clock::time_point now = Clock::now()) const;

 private:
  struct Bucket {
    long long second = -1;  // seconds since start_ this bucket counts; -1: unused
    double first_attempts = 0;
    double retries = 0;
  };
  Bucket& bucket(Clock::time_point now);
  double ratio_, min_per_second_;
  Clock::time_point start_;
  std::array<Bucket, kWindowSeconds> buckets_{};
};

}  // namespace batchlm::runner
