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

// An error event inside a stream whose code says the request itself is wrong (a server may find
// that out after the answer began: the prompt past the context, a parameter it refuses): the
// same request would meet it again. Codes as OpenAI, vLLM and batchlm serve write them, or an
// HTTP status given as the code.
bool request_at_fault(const std::string& code) {
  for (const char* c : {"context_length_exceeded", "invalid_request_error", "invalid_request", "unsupported_parameter",
                        "invalid_value", "model_not_found", "insufficient_quota", "invalid_api_key", "BadRequestError"})
    if (code == c) return true;
  if (code.size() == 3 && std::all_of(code.begin(), code.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    const int status = std::stoi(code);
    return status >= 400 && status <= 499 && !retryable_status(status, "");
  }
  return false;
}

}  // namespace

bool RetryPolicy::retryable(const Error& error) const {
  if (error.should_retry.has_value()) return *error.should_retry;
  switch (error.kind) {
    case ErrorKind::Http:
      return retryable_status(error.http_status, error.code);
    case ErrorKind::StreamError:
      return !request_at_fault(error.code);
    case ErrorKind::Timeout:
    case ErrorKind::Connection:
    case ErrorKind::Truncated:
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

RetryBudget::RetryBudget(double ratio, double min_per_second) : ratio_(ratio), min_per_second_(min_per_second) {}

void RetryBudget::forget(Clock::time_point now) {
  while (!first_attempts_.empty() && first_attempts_.front() <= now - kWindow) first_attempts_.pop_front();
  while (!retries_.empty() && retries_.front() <= now - kWindow) retries_.pop_front();
}

void RetryBudget::on_first_attempt(Clock::time_point now) {
  forget(now);
  first_attempts_.push_back(now);
}

double RetryBudget::allowance() const {
  return ratio_ * static_cast<double>(first_attempts_.size()) +
         min_per_second_ * std::chrono::duration<double>(kWindow).count();
}

bool RetryBudget::spent() const {
  // The epsilon absorbs rounding in ratio * count (0.29 * 100 must allow 29 retries).
  return allowance() - static_cast<double>(retries_.size()) + 1e-9 < 1.0;
}

RetryBudget::Clock::time_point RetryBudget::next_allowed() const {
  // Spread over the window: one retry per window / allowance at most.
  return retries_.back() + std::chrono::duration_cast<Clock::duration>(kWindow / allowance());
}

bool RetryBudget::try_spend(Clock::time_point now) {
  forget(now);
  if (spent() || (!retries_.empty() && now < next_allowed())) return false;
  retries_.push_back(now);
  return true;
}

std::chrono::milliseconds RetryBudget::time_until_refill(Clock::time_point now) {
  using std::chrono::milliseconds;
  forget(now);
  if (retries_.empty()) return milliseconds{1000};
  // Rounded up, so that the wait ends after the moment it waits for.
  const Clock::time_point at = spent() ? retries_.front() + kWindow : next_allowed();
  return std::max(milliseconds{1}, std::chrono::ceil<milliseconds>(at - now));
}

}  // namespace batchlm::runner
