#include "batchlm/runner/retry.hpp"

#include <algorithm>
#include <cmath>

namespace batchlm::runner {

namespace {

bool retryable_status(int status, const std::string& code) {
  // A 429 for an exhausted quota will not clear by waiting; retrying only burns the budget.
  if (status == 429) return code != "insufficient_quota";
  if (status == 408 || status == 409) return true;  // request timeout, lock conflict
  if (status >= 500 && status <= 599) return true;
  return false;  // every other status: the request itself is wrong, resending changes nothing
}

}  // namespace

bool RetryPolicy::retryable(const Error& error) const {
  if (error.should_retry.has_value()) return *error.should_retry;
  switch (error.kind) {
    case ErrorKind::Http:
      return retryable_status(error.http_status, error.code);
    case ErrorKind::Timeout:
    case ErrorKind::Connection:
    case ErrorKind::Truncated:
    case ErrorKind::StreamError:
    case ErrorKind::Protocol:
      return true;
    case ErrorKind::TooLarge:   // the same request produces the same oversized answer
    case ErrorKind::Cancelled:  // the user asked to stop
    case ErrorKind::Internal:   // a local bug does not go away on a second try
      return false;
  }
  return false;
}

std::chrono::milliseconds RetryPolicy::delay(int next_attempt, const Error& error,
                                             std::mt19937_64& rng) const {
  using std::chrono::milliseconds;
  if (error.retry_after.has_value()) {
    return std::clamp(*error.retry_after, milliseconds{0}, std::max(spec_.max_retry_after, milliseconds{0}));
  }
  // Computed in double so that a large attempt number saturates at the cap instead of
  // overflowing the shift.
  const int exponent = std::max(0, next_attempt - 2);
  const double grown = static_cast<double>(spec_.base.count()) * std::pow(2.0, std::min(exponent, 62));
  const double ceiling = std::max(0.0, std::min(static_cast<double>(spec_.cap.count()), grown));
  // Full jitter: spreading retries over the whole window keeps a crowd of failed requests
  // from coming back at the same instant.
  std::uniform_int_distribution<std::int64_t> draw(0, static_cast<std::int64_t>(ceiling));
  return milliseconds{draw(rng)};
}

RetryBudget::RetryBudget(double ratio, double min_per_second, Clock::time_point start)
    : ratio_(ratio), min_per_second_(min_per_second), start_(start) {}

RetryBudget::Bucket& RetryBudget::bucket(Clock::time_point now) {
  const long long second =
      std::max<long long>(0, std::chrono::duration_cast<std::chrono::seconds>(now - start_).count());
  Bucket& b = buckets_[static_cast<std::size_t>(second % kWindowSeconds)];
  if (b.second != second) b = Bucket{second, 0, 0};  // a bucket from an older window
  return b;
}

void RetryBudget::on_first_attempt(Clock::time_point now) { bucket(now).first_attempts += 1; }

bool RetryBudget::try_spend(Clock::time_point now) {
  const long long current = bucket(now).second;
  double first_attempts = 0, retries = 0;
  for (const Bucket& b : buckets_) {
    if (b.second < 0 || b.second <= current - kWindowSeconds) continue;
    first_attempts += b.first_attempts;
    retries += b.retries;
  }
  const double allowed = ratio_ * first_attempts + min_per_second_ * kWindowSeconds - retries;
  // The epsilon absorbs rounding in ratio * count (0.1 * 10 must allow one retry).
  if (allowed + 1e-9 < 1.0) return false;
  bucket(now).retries += 1;
  return true;
}

std::chrono::milliseconds RetryBudget::time_until_refill(Clock::time_point now) const {
  const auto since = std::chrono::duration_cast<std::chrono::milliseconds>(now - start_);
  return std::chrono::milliseconds(1000 - since.count() % 1000);
}

}  // namespace batchlm::runner
