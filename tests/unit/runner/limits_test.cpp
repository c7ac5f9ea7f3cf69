#include "batchlm/runner/limits.hpp"

#include <gtest/gtest.h>

#include <exception>
#include <vector>

#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/system/system_error.hpp>

namespace batchlm::runner {
namespace {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// How one spawned coroutine ended.
struct Result {
  bool finished = false;
  bool aborted = false;  // ended with operation_aborted
  bool other_error = false;
};

auto record(Result& result) {
  return [&result](std::exception_ptr error) {
    result.finished = true;
    if (!error) return;
    try {
      std::rethrow_exception(error);
    } catch (const boost::system::system_error& e) {
      (e.code() == asio::error::operation_aborted ? result.aborted : result.other_error) = true;
    } catch (...) {
      result.other_error = true;
    }
  };
}

asio::awaitable<void> take_permit(AsyncSemaphore& semaphore, std::vector<int>& order, int id) {
  co_await semaphore.acquire();
  order.push_back(id);
}

asio::awaitable<void> take_tokens(TokenBucket& bucket, double tokens, std::vector<int>& order, int id) {
  co_await bucket.acquire(tokens);
  order.push_back(id);
}

// Spawns `work` so that emitting `signal` cancels whatever it awaits at that moment.
template <typename Work>
void spawn_cancellable(asio::io_context& io, Work work, asio::cancellation_signal& signal, Result& result) {
  asio::co_spawn(io, std::move(work), asio::bind_cancellation_slot(signal.slot(), record(result)));
}

// Runs `f` on the io_context, as the dispatcher's own code would run: a cancellation emitted
// from outside is queued behind completions already pending, one emitted inside takes effect
// at once, which is what the races below need.
template <typename F>
void inside(asio::io_context& io, F f) {
  asio::post(io, std::move(f));
  io.poll();
}

// Drives the io_context until `done` holds, failing after a generous limit instead of hanging.
template <typename Done>
bool run_until(asio::io_context& io, Done done, milliseconds limit = milliseconds{3000}) {
  const auto deadline = Clock::now() + limit;
  while (!done() && Clock::now() < deadline) {
    io.restart();
    io.run_for(milliseconds{5});
  }
  return done();
}

// --- AsyncSemaphore ---------------------------------------------------------------------

TEST(AsyncSemaphore, GrantsPermitsAtOnceWhileTheyLast) {
  asio::io_context io;
  AsyncSemaphore semaphore(io.get_executor(), 2);
  std::vector<int> order;
  for (int i = 0; i < 3; ++i) asio::co_spawn(io, take_permit(semaphore, order, i), asio::detached);
  io.poll();
  EXPECT_EQ(order, (std::vector<int>{0, 1}));
  EXPECT_EQ(semaphore.available(), 0u);
  EXPECT_EQ(semaphore.waiting(), 1u);
  semaphore.release();
  io.poll();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(semaphore.waiting(), 0u);
}

TEST(AsyncSemaphore, ServesWaitersFirstComeFirstServed) {
  asio::io_context io;
  AsyncSemaphore semaphore(io.get_executor(), 0);
  std::vector<int> order;
  for (int i = 0; i < 5; ++i) asio::co_spawn(io, take_permit(semaphore, order, i), asio::detached);
  io.poll();
  ASSERT_EQ(semaphore.waiting(), 5u);
  for (int served = 1; served <= 5; ++served) {
    semaphore.release();
    io.poll();
    ASSERT_EQ(order.size(), static_cast<std::size_t>(served));
    EXPECT_EQ(order.back(), served - 1);
  }
  EXPECT_EQ(semaphore.available(), 0u);
}

TEST(AsyncSemaphore, NewcomerDoesNotOvertakeAWokenWaiter) {
  asio::io_context io;
  AsyncSemaphore semaphore(io.get_executor(), 0);
  std::vector<int> order;
  asio::co_spawn(io, take_permit(semaphore, order, 0), asio::detached);
  io.poll();
  // The permit goes to waiter 0 even though it has not run yet when the newcomer arrives.
  semaphore.release();
  asio::co_spawn(io, take_permit(semaphore, order, 1), asio::detached);
  io.poll();
  EXPECT_EQ(order, (std::vector<int>{0}));
  EXPECT_EQ(semaphore.waiting(), 1u);
  EXPECT_EQ(semaphore.available(), 0u);
}

TEST(AsyncSemaphore, ReleaseWithoutWaitersAddsAPermit) {
  asio::io_context io;
  AsyncSemaphore semaphore(io.get_executor(), 1);
  semaphore.release();
  EXPECT_EQ(semaphore.available(), 2u);
}

TEST(AsyncSemaphore, CancelledWaiterTakesNoPermitAndLeavesTheQueue) {
  asio::io_context io;
  AsyncSemaphore semaphore(io.get_executor(), 0);
  std::vector<int> order;
  asio::cancellation_signal signals[3];
  Result results[3];
  for (int i = 0; i < 3; ++i) spawn_cancellable(io, take_permit(semaphore, order, i), signals[i], results[i]);
  io.poll();
  ASSERT_EQ(semaphore.waiting(), 3u);

  inside(io, [&] { signals[1].emit(asio::cancellation_type::terminal); });
  EXPECT_TRUE(results[1].aborted);
  EXPECT_EQ(semaphore.waiting(), 2u);

  semaphore.release();
  semaphore.release();
  io.poll();
  EXPECT_EQ(order, (std::vector<int>{0, 2}));
  EXPECT_EQ(semaphore.available(), 0u);
  semaphore.release();
  EXPECT_EQ(semaphore.available(), 1u);
}

TEST(AsyncSemaphore, PermitReleasedToACancelledWaiterPassesToTheNext) {
  asio::io_context io;
  AsyncSemaphore semaphore(io.get_executor(), 0);
  std::vector<int> order;
  asio::cancellation_signal signals[2];
  Result results[2];
  for (int i = 0; i < 2; ++i) spawn_cancellable(io, take_permit(semaphore, order, i), signals[i], results[i]);
  io.poll();
  // Both happen before waiter 0 runs again: it is handed the permit and cancelled at once.
  inside(io, [&] {
    semaphore.release();
    signals[0].emit(asio::cancellation_type::terminal);
  });
  EXPECT_TRUE(results[0].aborted);
  EXPECT_EQ(order, (std::vector<int>{1}));
  EXPECT_EQ(semaphore.waiting(), 0u);
  semaphore.release();
  EXPECT_EQ(semaphore.available(), 1u);  // one permit in all, none lost
}

TEST(AsyncSemaphore, PermitReleasedToTheOnlyCancelledWaiterReturnsToThePool) {
  asio::io_context io;
  AsyncSemaphore semaphore(io.get_executor(), 0);
  std::vector<int> order;
  asio::cancellation_signal signal;
  Result result;
  spawn_cancellable(io, take_permit(semaphore, order, 0), signal, result);
  io.poll();
  inside(io, [&] {
    semaphore.release();
    signal.emit(asio::cancellation_type::terminal);
  });
  EXPECT_TRUE(result.aborted);
  EXPECT_TRUE(order.empty());
  EXPECT_EQ(semaphore.available(), 1u);
}

asio::awaitable<bool> acquire_within(AsyncSemaphore& semaphore, milliseconds limit) {
  using namespace asio::experimental::awaitable_operators;
  asio::steady_timer timer(co_await asio::this_coro::executor, limit);
  auto winner = co_await (semaphore.acquire() || timer.async_wait(asio::use_awaitable));
  co_return winner.index() == 0;
}

TEST(AsyncSemaphore, AcquireRacedAgainstATimeoutLeaksNoPermit) {
  asio::io_context io;
  AsyncSemaphore semaphore(io.get_executor(), 0);
  bool acquired = true;
  Result result;
  asio::co_spawn(io, acquire_within(semaphore, milliseconds{10}),
                 [&](std::exception_ptr e, bool got) {
                   result.finished = true;
                   result.other_error = e != nullptr;
                   acquired = got;
                 });
  ASSERT_TRUE(run_until(io, [&] { return result.finished; }));
  EXPECT_FALSE(result.other_error);
  EXPECT_FALSE(acquired);
  EXPECT_EQ(semaphore.waiting(), 0u);
  semaphore.release();
  EXPECT_EQ(semaphore.available(), 1u);
}

// --- TokenBucket: the clock-driven core, with a clock the test moves --------------------

TEST(TokenBucket, StartsFullAndRefillsByElapsedTime) {
  asio::io_context io;
  TokenBucket bucket(io.get_executor(), 10, 5);  // 10 tokens/s
  const auto t0 = Clock::now() + std::chrono::hours{1};  // ahead of the real clock
  EXPECT_DOUBLE_EQ(bucket.level(t0), 5);
  EXPECT_TRUE(bucket.try_acquire(5, t0));
  EXPECT_FALSE(bucket.try_acquire(1, t0));
  EXPECT_EQ(bucket.wait_time(1, t0), milliseconds{100});
  EXPECT_FALSE(bucket.try_acquire(1, t0 + milliseconds{99}));
  EXPECT_TRUE(bucket.try_acquire(1, t0 + milliseconds{100}));
  EXPECT_NEAR(bucket.level(t0 + milliseconds{350}), 2.5, 1e-9);
}

// A rate so small that the wait is centuries (tokens_per_minute: 1e-12) waits a day at a time:
// the wait does not overflow the clock and come out as no wait at all, every time.
TEST(TokenBucket, AnAbsurdlyLongWaitIsADayAtATime) {
  asio::io_context io;
  TokenBucket bucket(io.get_executor(), 1e-14, 1e-13);
  const auto t0 = Clock::now() + std::chrono::hours{1};
  EXPECT_TRUE(bucket.try_acquire(100, t0));  // the first goes, and runs the level far below zero
  EXPECT_EQ(bucket.wait_time(1, t0), std::chrono::hours{24});
}

TEST(TokenBucket, NeverHoldsMoreThanTheBurst) {
  asio::io_context io;
  TokenBucket bucket(io.get_executor(), 10, 5);
  const auto t0 = Clock::now() + std::chrono::hours{1};
  EXPECT_DOUBLE_EQ(bucket.level(t0 + std::chrono::hours{5}), 5);
}

TEST(TokenBucket, PacesASteadyStreamAtTheRate) {
  asio::io_context io;
  TokenBucket bucket(io.get_executor(), 50, 1);  // one token every 20 ms
  auto now = Clock::now() + std::chrono::hours{1};
  const auto t0 = now;
  for (int i = 0; i < 100; ++i) {
    now += bucket.wait_time(1, now);
    ASSERT_TRUE(bucket.try_acquire(1, now)) << i;
  }
  // The first came from the full bucket; 99 more at 20 ms each.
  EXPECT_NEAR(std::chrono::duration<double>(now - t0).count(), 99 * 0.020, 1e-6);
}

TEST(TokenBucket, RequestLargerThanTheBurstWaitsForAFullBucketAndGoesNegative) {
  asio::io_context io;
  TokenBucket bucket(io.get_executor(), 10, 5);
  const auto t0 = Clock::now() + std::chrono::hours{1};
  ASSERT_TRUE(bucket.try_acquire(2, t0));
  EXPECT_FALSE(bucket.try_acquire(8, t0));
  EXPECT_EQ(bucket.wait_time(8, t0), milliseconds{200});  // until the bucket is full again
  EXPECT_TRUE(bucket.try_acquire(8, t0 + milliseconds{200}));
  EXPECT_NEAR(bucket.level(t0 + milliseconds{200}), -3, 1e-9);
  // The debt delays the next request: 3 to repay plus the 1 it asks for.
  EXPECT_EQ(bucket.wait_time(1, t0 + milliseconds{200}), milliseconds{400});
}

TEST(TokenBucket, AdjustTakesMoreOrGivesBackUpToTheBurst) {
  asio::io_context io;
  TokenBucket bucket(io.get_executor(), 1, 10);
  const auto t0 = Clock::now() + std::chrono::hours{1};
  ASSERT_DOUBLE_EQ(bucket.level(t0), 10);
  bucket.adjust(3);  // the request used 3 more than estimated
  EXPECT_DOUBLE_EQ(bucket.level(t0), 7);
  bucket.adjust(-1);  // ...or 1 fewer
  EXPECT_DOUBLE_EQ(bucket.level(t0), 8);
  bucket.adjust(-100);
  EXPECT_DOUBLE_EQ(bucket.level(t0), 10);
  bucket.adjust(25);
  EXPECT_DOUBLE_EQ(bucket.level(t0), -15);
}

TEST(TokenBucket, RateZeroIsUnlimited) {
  asio::io_context io;
  TokenBucket bucket(io.get_executor(), 0, 0);
  EXPECT_TRUE(bucket.unlimited());
  const auto now = Clock::now();
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(bucket.try_acquire(1e9, now));
  EXPECT_EQ(bucket.wait_time(1e9, now), Clock::duration::zero());
  std::vector<int> order;
  asio::co_spawn(io, take_tokens(bucket, 1e12, order, 0), asio::detached);
  io.poll();
  EXPECT_EQ(order, (std::vector<int>{0}));
}

// --- TokenBucket: waiting, on the real clock with small rates and generous bounds ---------

TEST(TokenBucket, AcquireTakesAvailableTokensWithoutWaiting) {
  asio::io_context io;
  TokenBucket bucket(io.get_executor(), 0.001, 100);
  std::vector<int> order;
  for (int i = 0; i < 4; ++i) asio::co_spawn(io, take_tokens(bucket, 25, order, i), asio::detached);
  io.poll();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
}

TEST(TokenBucket, AcquireWaitsForTheRefill) {
  asio::io_context io;
  TokenBucket bucket(io.get_executor(), 200, 1);  // a token every 5 ms
  std::vector<int> order;
  const auto start = Clock::now();
  for (int i = 0; i < 9; ++i) asio::co_spawn(io, take_tokens(bucket, 1, order, i), asio::detached);
  ASSERT_TRUE(run_until(io, [&] { return order.size() == 9; }));
  // Eight of them had to wait 5 ms each; no upper bound beyond the run limit.
  EXPECT_GE(Clock::now() - start, milliseconds{39});
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
}

TEST(TokenBucket, LargeRequestAtTheFrontIsNotOvertakenBySmallOnes) {
  asio::io_context io;
  TokenBucket bucket(io.get_executor(), 400, 10);
  ASSERT_TRUE(bucket.try_acquire(10, Clock::now()));
  std::vector<int> order;
  asio::co_spawn(io, take_tokens(bucket, 10, order, 0), asio::detached);
  asio::co_spawn(io, take_tokens(bucket, 1, order, 1), asio::detached);
  io.poll();
  EXPECT_FALSE(bucket.try_acquire(0.5, Clock::now()));  // others are queued: no cutting in
  ASSERT_TRUE(run_until(io, [&] { return order.size() == 2; }));
  EXPECT_EQ(order, (std::vector<int>{0, 1}));
}

TEST(TokenBucket, GivingTokensBackWakesTheFirstWaiter) {
  asio::io_context io;
  TokenBucket bucket(io.get_executor(), 0.01, 1);  // a refill would take 100 s
  ASSERT_TRUE(bucket.try_acquire(1, Clock::now()));
  std::vector<int> order;
  asio::co_spawn(io, take_tokens(bucket, 1, order, 0), asio::detached);
  io.poll();
  ASSERT_TRUE(order.empty());
  bucket.adjust(-1);
  ASSERT_TRUE(run_until(io, [&] { return order.size() == 1; }, milliseconds{2000}));
}

TEST(TokenBucket, CancelledWaiterLeavesTheQueueAndTheNextMovesUp) {
  asio::io_context io;
  TokenBucket bucket(io.get_executor(), 0.01, 1);
  ASSERT_TRUE(bucket.try_acquire(1, Clock::now()));
  std::vector<int> order;
  asio::cancellation_signal signals[2];
  Result results[2];
  for (int i = 0; i < 2; ++i) spawn_cancellable(io, take_tokens(bucket, 1, order, i), signals[i], results[i]);
  io.poll();
  inside(io, [&] { signals[0].emit(asio::cancellation_type::terminal); });
  EXPECT_TRUE(results[0].aborted);
  bucket.adjust(-1);
  ASSERT_TRUE(run_until(io, [&] { return order.size() == 1; }, milliseconds{2000}));
  EXPECT_EQ(order, (std::vector<int>{1}));
  // Nobody is queued any more, so tokens given back can be taken directly.
  bucket.adjust(-1);
  EXPECT_TRUE(bucket.try_acquire(1, Clock::now()));
}

}  // namespace
}  // namespace batchlm::runner
