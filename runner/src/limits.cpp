#include "batchlm/runner/limits.hpp"

#include <algorithm>
#include <cmath>

#include <boost/asio/cancellation_state.hpp>
#include <boost/asio/cancellation_type.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/system/system_error.hpp>

namespace batchlm::runner {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;
using Waiter = std::shared_ptr<asio::steady_timer>;

namespace {

// Waiters sleep on a timer that never expires by itself; moving its expiry into the past
// wakes it whether or not its wait has started yet, which a plain cancel() would not.
void wake(const Waiter& waiter) { waiter->expires_at(asio::steady_timer::time_point{}); }

bool contains(const std::deque<Waiter>& queue, const Waiter& waiter) {
  return std::find(queue.begin(), queue.end(), waiter) != queue.end();
}

void erase(std::deque<Waiter>& queue, const Waiter& waiter) {
  queue.erase(std::remove(queue.begin(), queue.end(), waiter), queue.end());
}

[[noreturn]] void throw_aborted() {
  throw boost::system::system_error(asio::error::operation_aborted);
}

}  // namespace

// --- AsyncSemaphore ---------------------------------------------------------------------

AsyncSemaphore::AsyncSemaphore(asio::any_io_executor executor, std::size_t permits)
    : executor_(std::move(executor)), permits_(permits) {}

asio::awaitable<void> AsyncSemaphore::acquire() {
  if (permits_ > 0 && waiters_.empty()) {
    --permits_;
    co_return;
  }
  auto timer = std::make_shared<asio::steady_timer>(executor_, asio::steady_timer::time_point::max());
  waiters_.push_back(timer);
  // release() hands a permit over by taking the waiter out of the queue, so "not queued any
  // more" means "owns a permit". Leaving must give that permit on, or it is lost for good.
  auto leave = [this, &timer] {
    if (contains(waiters_, timer)) {
      erase(waiters_, timer);
    } else {
      release();
    }
  };
  for (;;) {
    boost::system::error_code ec;
    try {
      co_await timer->async_wait(asio::redirect_error(asio::use_awaitable, ec));
    } catch (...) {  // the coroutine was already cancelled before it could wait
      leave();
      throw;
    }
    const bool granted = !contains(waiters_, timer);
    // Asked directly rather than through a helper coroutine: awaiting another awaitable
    // throws once cancelled, which would skip leaving the queue.
    const auto state = co_await asio::this_coro::cancellation_state;
    if (state.cancelled() != asio::cancellation_type::none) {
      // Also when a release() and the cancellation raced: the caller has given up, so the
      // permit it was just handed goes to the next in line.
      leave();
      throw_aborted();
    }
    if (granted) co_return;
  }
}

void AsyncSemaphore::release() {
  if (waiters_.empty()) {
    ++permits_;
    return;
  }
  // Handing the permit straight to the oldest waiter keeps a newcomer from overtaking it.
  auto next = std::move(waiters_.front());
  waiters_.pop_front();
  wake(next);
}

// --- TokenBucket ------------------------------------------------------------------------

TokenBucket::TokenBucket(asio::any_io_executor executor, double rate_per_second, double burst)
    : executor_(std::move(executor)),
      rate_(std::max(0.0, rate_per_second)),
      burst_(std::max(0.0, burst)),
      level_(burst_),
      last_(Clock::now()) {}

void TokenBucket::refill(Clock::time_point now) {
  if (now <= last_) return;  // an older clock reading adds nothing
  const double elapsed = std::chrono::duration<double>(now - last_).count();
  level_ = std::min(burst_, level_ + rate_ * elapsed);
  last_ = now;
}

double TokenBucket::level(Clock::time_point now) {
  refill(now);
  return level_;
}

bool TokenBucket::try_acquire(double tokens, Clock::time_point now) {
  if (unlimited()) return true;
  if (!queue_.empty()) return false;  // first come, first served
  refill(now);
  // A request bigger than the bucket could never be satisfied; it waits for a full bucket and
  // runs the level negative, so the debt delays whoever comes next.
  const double need = std::min(tokens, burst_);
  // The slack absorbs rounding in rate * elapsed after sleeping exactly the computed time.
  if (level_ + 1e-9 < need) return false;
  level_ -= tokens;
  return true;
}

Clock::duration TokenBucket::wait_time(double tokens, Clock::time_point now) {
  if (unlimited()) return Clock::duration::zero();
  refill(now);
  const double missing = std::min(tokens, burst_) - level_;
  if (missing <= 1e-9) return Clock::duration::zero();  // same slack as try_acquire
  // At most a day at a time (the waiter looks again then): years of waiting, at a rate the job
  // file allows, would overflow the clock's nanoseconds and wake it at once, over and over.
  constexpr double kLongestWait = 86400.0;
  return std::chrono::ceil<Clock::duration>(std::chrono::duration<double>(std::min(missing / rate_, kLongestWait)));
}

void TokenBucket::adjust(double delta) {
  if (unlimited()) return;
  refill(Clock::now());
  level_ = std::min(burst_, level_ - delta);
  // Tokens given back may let the first waiter go sooner than its timer says.
  if (delta < 0) wake_front();
}

void TokenBucket::wake_front() {
  if (!queue_.empty()) wake(queue_.front());
}

void TokenBucket::leave(const Waiter& waiter) {
  const bool was_front = !queue_.empty() && queue_.front() == waiter;
  erase(queue_, waiter);
  if (was_front) wake_front();
}

asio::awaitable<void> TokenBucket::acquire(double tokens) {
  if (try_acquire(tokens, Clock::now())) co_return;
  auto timer = std::make_shared<asio::steady_timer>(executor_, asio::steady_timer::time_point::max());
  queue_.push_back(timer);
  for (;;) {
    // Only the head of the queue watches the clock; the others sleep until the one before
    // them is served or leaves.
    if (queue_.front() == timer) {
      const auto now = Clock::now();
      const auto wait = wait_time(tokens, now);
      if (wait == Clock::duration::zero()) {
        queue_.pop_front();
        level_ -= tokens;
        wake_front();
        co_return;
      }
      timer->expires_at(now + wait);
    }
    boost::system::error_code ec;
    try {
      co_await timer->async_wait(asio::redirect_error(asio::use_awaitable, ec));
    } catch (...) {  // the coroutine was already cancelled before it could wait
      leave(timer);
      throw;
    }
    // Asked directly rather than through a helper coroutine: awaiting another awaitable
    // throws once cancelled, which would skip leaving the queue.
    const auto state = co_await asio::this_coro::cancellation_state;
    if (state.cancelled() != asio::cancellation_type::none) {
      leave(timer);
      throw_aborted();
    }
  }
}

}  // namespace batchlm::runner
