#pragma once
// The one retry policy: what is retried, how long to wait, and a budget that keeps retries a
// fraction of traffic when a server is failing.

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

// Retries allowed = ratio * first attempts + min_per_second * elapsed seconds, minus retries
// already spent. Not thread-safe: used from the runner's one thread.
class RetryBudget {
 public:
  RetryBudget(double ratio, double min_per_second,
              std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now());
  void on_first_attempt();
  // Takes one retry from the budget if there is one.
  bool try_spend(std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now());

 private:
  double ratio_, min_per_second_;
  std::chrono::steady_clock::time_point start_;
  double first_attempts_ = 0;
  double spent_ = 0;
};

}  // namespace batchlm::runner
