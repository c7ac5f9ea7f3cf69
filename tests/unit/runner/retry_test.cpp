#include "batchlm/runner/retry.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <vector>

namespace batchlm::runner {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

Error http(int status, std::string code = "") {
  Error e;
  e.kind = ErrorKind::Http;
  e.http_status = status;
  e.code = std::move(code);
  return e;
}

Error of_kind(ErrorKind kind) {
  Error e;
  e.kind = kind;
  return e;
}

RetrySpec spec(milliseconds base, milliseconds cap, milliseconds max_retry_after = milliseconds{120'000}) {
  RetrySpec s;
  s.base = base;
  s.cap = cap;
  s.max_retry_after = max_retry_after;
  return s;
}

// An error event in a stream is retried, unless its code says the request itself is wrong
// (found after the answer began): the same request would meet it again.
TEST(RetryPolicy, StreamErrorsThatBlameTheRequestAreNotRetried) {
  RetryPolicy policy{RetrySpec{}};
  Error e = of_kind(ErrorKind::StreamError);
  for (const char* code : {"", "server_error", "overloaded", "500", "503", "429", "408"}) {
    e.code = code;
    EXPECT_TRUE(policy.retryable(e)) << code;
  }
  for (const char* code : {"context_length_exceeded", "invalid_request_error", "unsupported_parameter", "400", "422",
                           "BadRequestError"}) {
    e.code = code;
    EXPECT_FALSE(policy.retryable(e)) << code;
  }
  e.should_retry = true;  // the server's x-should-retry still wins
  EXPECT_TRUE(policy.retryable(e));
}

TEST(RetryPolicy, RetriesTransientHttpStatuses) {
  RetryPolicy policy{RetrySpec{}};
  for (int status : {408, 409, 429, 500, 501, 502, 503, 504, 529, 599}) {
    EXPECT_TRUE(policy.retryable(http(status))) << status;
  }
}

TEST(RetryPolicy, NeverRetriesClientErrors) {
  RetryPolicy policy{RetrySpec{}};
  for (int status = 400; status <= 499; ++status) {
    if (status == 408 || status == 409 || status == 429) continue;
    EXPECT_FALSE(policy.retryable(http(status))) << status;
  }
  for (int status : {400, 401, 403, 404, 422}) EXPECT_FALSE(policy.retryable(http(status))) << status;
}

TEST(RetryPolicy, NeverRetriesStatusesOutsideErrorRanges) {
  RetryPolicy policy{RetrySpec{}};
  for (int status : {0, 200, 301, 600}) EXPECT_FALSE(policy.retryable(http(status))) << status;
}

TEST(RetryPolicy, NeverRetriesA429ForInsufficientQuota) {
  RetryPolicy policy{RetrySpec{}};
  EXPECT_FALSE(policy.retryable(http(429, "insufficient_quota")));
  EXPECT_TRUE(policy.retryable(http(429, "rate_limit_exceeded")));
}

TEST(RetryPolicy, ClassifiesEveryErrorKind) {
  RetryPolicy policy{RetrySpec{}};
  EXPECT_TRUE(policy.retryable(of_kind(ErrorKind::Timeout)));
  EXPECT_TRUE(policy.retryable(of_kind(ErrorKind::Connection)));
  EXPECT_TRUE(policy.retryable(of_kind(ErrorKind::Protocol)));
  EXPECT_TRUE(policy.retryable(of_kind(ErrorKind::Truncated)));
  EXPECT_TRUE(policy.retryable(of_kind(ErrorKind::StreamError)));
  EXPECT_FALSE(policy.retryable(of_kind(ErrorKind::TooLarge)));
  EXPECT_FALSE(policy.retryable(of_kind(ErrorKind::Cancelled)));
  EXPECT_FALSE(policy.retryable(of_kind(ErrorKind::Internal)));
}

TEST(RetryPolicy, ShouldRetryHeaderTrueOverridesAFatalError) {
  RetryPolicy policy{RetrySpec{}};
  for (Error e : {http(400), http(401), http(429, "insufficient_quota"), of_kind(ErrorKind::TooLarge),
                  of_kind(ErrorKind::Internal)}) {
    e.should_retry = true;
    EXPECT_TRUE(policy.retryable(e)) << e.to_json().dump();
  }
}

TEST(RetryPolicy, ShouldRetryHeaderFalseOverridesATransientError) {
  RetryPolicy policy{RetrySpec{}};
  for (Error e : {http(429), http(503), http(408), of_kind(ErrorKind::Timeout), of_kind(ErrorKind::Connection)}) {
    e.should_retry = false;
    EXPECT_FALSE(policy.retryable(e)) << e.to_json().dump();
  }
}

TEST(RetryPolicy, FullJitterStaysWithinTheExponentialWindow) {
  RetryPolicy policy{spec(milliseconds{100}, milliseconds{10'000})};
  std::mt19937_64 rng(7);
  const Error e = http(503);
  for (int attempt = 2; attempt <= 6; ++attempt) {
    const milliseconds window{100 << (attempt - 2)};  // 100, 200, 400, 800, 1600
    milliseconds lowest = milliseconds::max(), highest = milliseconds::min();
    for (int i = 0; i < 4000; ++i) {
      const auto d = policy.delay(attempt, e, rng);
      ASSERT_GE(d, milliseconds{0});
      ASSERT_LE(d, window) << "attempt " << attempt;
      lowest = std::min(lowest, d);
      highest = std::max(highest, d);
    }
    // Full jitter spreads over the whole window, not just near its top.
    EXPECT_LT(lowest, window / 10) << "attempt " << attempt;
    EXPECT_GT(highest, window * 9 / 10) << "attempt " << attempt;
  }
}

TEST(RetryPolicy, MeanDelayDoublesWithEachAttempt) {
  RetryPolicy policy{spec(milliseconds{100}, milliseconds{100'000})};
  std::mt19937_64 rng(11);
  auto mean = [&](int attempt) {
    double sum = 0;
    for (int i = 0; i < 4000; ++i) sum += static_cast<double>(policy.delay(attempt, http(500), rng).count());
    return sum / 4000;
  };
  double previous = mean(2);
  EXPECT_NEAR(previous, 50, 5);
  for (int attempt = 3; attempt <= 7; ++attempt) {
    const double current = mean(attempt);
    EXPECT_NEAR(current / previous, 2.0, 0.25) << "attempt " << attempt;
    previous = current;
  }
}

TEST(RetryPolicy, DelayNeverExceedsTheCap) {
  RetryPolicy policy{spec(milliseconds{500}, milliseconds{2'000})};
  std::mt19937_64 rng(3);
  bool reached_near_cap = false;
  for (int attempt : {5, 10, 40, 100, 1000, 1 << 30}) {
    for (int i = 0; i < 500; ++i) {
      const auto d = policy.delay(attempt, of_kind(ErrorKind::Timeout), rng);
      ASSERT_LE(d, milliseconds{2'000}) << "attempt " << attempt;
      if (d > milliseconds{1'800}) reached_near_cap = true;
    }
  }
  EXPECT_TRUE(reached_near_cap);
}

TEST(RetryPolicy, HonoursServerRetryAfter) {
  RetryPolicy policy{spec(milliseconds{500}, milliseconds{30'000})};
  std::mt19937_64 rng(1);
  Error e = http(429);
  e.retry_after = milliseconds{7'250};
  for (int attempt : {2, 3, 6}) EXPECT_EQ(policy.delay(attempt, e, rng), milliseconds{7'250});
  e.retry_after = milliseconds{0};
  EXPECT_EQ(policy.delay(2, e, rng), milliseconds{0});
}

TEST(RetryPolicy, CapsServerRetryAfterAtMaxRetryAfter) {
  RetryPolicy policy{spec(milliseconds{500}, milliseconds{30'000}, milliseconds{60'000})};
  std::mt19937_64 rng(1);
  Error e = http(503);
  e.retry_after = std::chrono::duration_cast<milliseconds>(std::chrono::hours{1});
  EXPECT_EQ(policy.delay(2, e, rng), milliseconds{60'000});
  // The cap on backoff does not shorten a server's hint below it.
  e.retry_after = milliseconds{45'000};
  EXPECT_EQ(policy.delay(2, e, rng), milliseconds{45'000});
}

TEST(RetryPolicy, SameSeedGivesSameDelays) {
  RetryPolicy policy{RetrySpec{}};
  std::mt19937_64 a(42), b(42);
  for (int i = 2; i < 8; ++i) EXPECT_EQ(policy.delay(i, http(500), a), policy.delay(i, http(500), b));
}

TEST(RetryPolicy, ReportsMaxAttempts) {
  RetrySpec s;
  s.max_attempts = 3;
  EXPECT_EQ(RetryPolicy{s}.max_attempts(), 3);
}

TEST(RetryBudget, AllowsRetriesInProportionToFirstAttempts) {
  const auto start = std::chrono::steady_clock::now();
  RetryBudget budget(0.2, 0.0);
  for (int i = 0; i < 10; ++i) budget.on_first_attempt(start);
  // 2 in the window, one every 5 s.
  EXPECT_TRUE(budget.try_spend(start));
  EXPECT_FALSE(budget.try_spend(start + seconds{4}));
  EXPECT_TRUE(budget.try_spend(start + seconds{5}));
  EXPECT_FALSE(budget.try_spend(start + seconds{9}));
  for (int i = 0; i < 5; ++i) budget.on_first_attempt(start + seconds{9});
  // 3 in the window, one every 3.3 s: 3.3 s after the last (at 5 s) has passed.
  EXPECT_TRUE(budget.try_spend(start + seconds{9}));
  EXPECT_FALSE(budget.try_spend(start + milliseconds{9'900}));
}

TEST(RetryBudget, RoundingInTheRatioStillAllowsTheWholeRetry) {
  const auto start = std::chrono::steady_clock::now();
  RetryBudget budget(0.29, 0.0);  // 0.29 * 100 is 28.999999999999996 in doubles: 29 retries
  for (int i = 0; i < 100; ++i) budget.on_first_attempt(start);
  int spent = 0;
  for (int ms = 0; ms < 10'000; ms += 10) spent += budget.try_spend(start + milliseconds{ms}) ? 1 : 0;
  EXPECT_EQ(spent, 29);
}

// Without traffic, min_per_second: the retries held back come out at that rate, not at once.
TEST(RetryBudget, SpreadsTheMinimumRateOverTheWindow) {
  const auto start = std::chrono::steady_clock::now();
  RetryBudget budget(0.2, 2.0);  // 2/s over a 10 s window: 20, one every 500 ms
  EXPECT_TRUE(budget.try_spend(start));
  EXPECT_FALSE(budget.try_spend(start));
  EXPECT_FALSE(budget.try_spend(start + milliseconds{499}));
  EXPECT_EQ(budget.time_until_refill(start + milliseconds{100}), milliseconds{400});
  for (int i = 1; i < 20; ++i) EXPECT_TRUE(budget.try_spend(start + milliseconds{500} * i)) << i;
  EXPECT_FALSE(budget.try_spend(start + milliseconds{9'999}));
  // Ten seconds after it was sent, the first leaves the window.
  EXPECT_EQ(budget.time_until_refill(start + milliseconds{9'999}), milliseconds{1});
  EXPECT_TRUE(budget.try_spend(start + milliseconds{10'001}));
}

TEST(RetryBudget, FirstAttemptsOutsideTheWindowNoLongerCount) {
  const auto start = std::chrono::steady_clock::now();
  RetryBudget budget(0.5, 0.0);
  for (int i = 0; i < 10; ++i) budget.on_first_attempt(start);
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(budget.try_spend(start + seconds{1 + 2 * i})) << i;
  EXPECT_FALSE(budget.try_spend(start + milliseconds{9'500}));
  const auto later = start + seconds{20};
  EXPECT_FALSE(budget.try_spend(later));
  budget.on_first_attempt(later);
  budget.on_first_attempt(later);
  EXPECT_TRUE(budget.try_spend(later));
}

// A spent budget refills when its oldest retry leaves the window.
TEST(RetryBudget, RefillsWhenTheOldestRetryLeavesTheWindow) {
  const auto start = std::chrono::steady_clock::now();
  RetryBudget budget(0.0, 0.2);  // 2 in any 10 s, one every 5 s
  EXPECT_EQ(budget.time_until_refill(start), milliseconds{1000});  // nothing to wait for yet
  EXPECT_TRUE(budget.try_spend(start));
  EXPECT_FALSE(budget.try_spend(start + seconds{3}));
  EXPECT_EQ(budget.time_until_refill(start + seconds{3}), milliseconds{2000});
  EXPECT_TRUE(budget.try_spend(start + seconds{5}));
  EXPECT_FALSE(budget.try_spend(start + seconds{6}));
  EXPECT_EQ(budget.time_until_refill(start + seconds{6}), milliseconds{4000});
  EXPECT_TRUE(budget.try_spend(start + seconds{10} + milliseconds{1}));
}

// Whatever arrives, at each retry the 10 s before it hold at most the allowance.
TEST(RetryBudget, NoTenSecondWindowHoldsMoreThanTheAllowance) {
  const auto start = std::chrono::steady_clock::now();
  const double ratio = 0.2, floor = 1.0;
  RetryBudget budget(ratio, floor);
  std::mt19937 rng(3);
  std::vector<std::chrono::steady_clock::time_point> firsts, retries;
  auto now = start;
  for (int i = 0; i < 20'000; ++i) {
    now += milliseconds{std::uniform_int_distribution<int>(0, 20)(rng)};
    if (rng() % 3 == 0) {
      budget.on_first_attempt(now);
      firsts.push_back(now);
    } else if (budget.try_spend(now)) {
      retries.push_back(now);
      const auto in_window = [&](const auto& times) {
        return std::count_if(times.begin(), times.end(), [&](auto t) { return t > now - seconds{10} && t <= now; });
      };
      const double allowed = ratio * static_cast<double>(in_window(firsts)) + floor * 10;
      ASSERT_LE(static_cast<double>(in_window(retries)), allowed + 1e-9) << "at " << (now - start).count();
      if (retries.size() > 1) {  // and spread: one per window / allowance at most
        ASSERT_GE(std::chrono::duration<double>(now - retries[retries.size() - 2]).count(), 10.0 / allowed - 1e-9);
      }
    }
  }
  EXPECT_GT(retries.size(), 100u);
}

}  // namespace
}  // namespace batchlm::runner
