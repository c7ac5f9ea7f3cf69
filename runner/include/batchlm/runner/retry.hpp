#pragma once
// The one retry policy: what is retried, how long to wait, and a budget that keeps retries a
// fraction of traffic when a server is failing.

#include <chrono>
#include <deque>
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

// Keeps retries a fraction of traffic over a sliding window of 10 s: with a retry, the retries
// of the 10 s before it are at most ratio * first attempts of those 10 s + min_per_second * 10,
// and they are spread over the window (one every 10 s / that allowance at most), so that a
// crowd of failed requests does not come back at once. A retry that finds the budget spent
// waits for it rather than failing its item: a failing server sees a trickle of retries (10 a
// second by default), and every item still gets its attempts. Not thread-safe: used from the
// runner's one thread.
class RetryBudget {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr Clock::duration kWindow = std::chrono::seconds(10);

  RetryBudget(double ratio, double min_per_second);
  void on_first_attempt(Clock::time_point now = Clock::now());
  // Takes one retry from the budget if there is one.
  bool try_spend(Clock::time_point now = Clock::now());
  // When the budget can next allow a retry: the end of the spacing after the last one, or,
  // with the window's allowance spent, when the oldest retry in it leaves (a second from now
  // when there is none, waiting for first attempts).
  std::chrono::milliseconds time_until_refill(Clock::time_point now = Clock::now());

 private:
  void forget(Clock::time_point now);  // drops what is older than the window
  double allowance() const;            // retries the window may hold now
  bool spent() const;                  // the window holds all its allowance
  Clock::time_point next_allowed() const;  // the end of the spacing after the last retry
  double ratio_, min_per_second_;
  std::deque<Clock::time_point> first_attempts_, retries_;
};

}  // namespace batchlm::runner
