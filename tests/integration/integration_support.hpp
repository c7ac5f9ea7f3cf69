#pragma once
// Shared pieces of the integration tests: running a coroutine to completion on a test's own
// io_context, and building backends and requests aimed at the fake server.

#include <chrono>
#include <future>
#include <stdexcept>
#include <string>
#include <utility>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>
#include <gtest/gtest.h>

#include "batchlm/client/openai.hpp"
#include "fake_openai_server.hpp"

namespace batchlm::integration {

// Runs `ioc` on this thread until `result` is ready. A hang fails the test after `limit`
// instead of blocking the whole suite.
template <class T>
T wait_on(boost::asio::io_context& ioc, std::future<T>& result,
          std::chrono::seconds limit = std::chrono::seconds(30)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  // run_one_for rather than run: the client may keep idle work (cached connections) registered.
  while (result.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << "the operation did not finish within " << limit.count() << " s";
      throw std::runtime_error("test operation hung");
    }
    // An io_context that ran out of work stops itself (e.g. between two requests, when the
    // client watches no socket and no timer); the next request must find it running again.
    if (ioc.stopped()) ioc.restart();
    ioc.run_one_for(std::chrono::milliseconds(50));
  }
  return result.get();
}

// Runs the coroutine `work` on `ioc` (on this thread) to completion.
template <class T>
T run_on(boost::asio::io_context& ioc, boost::asio::awaitable<T> work,
         std::chrono::seconds limit = std::chrono::seconds(30)) {
  auto result = boost::asio::co_spawn(ioc, std::move(work), boost::asio::use_future);
  return wait_on(ioc, result, limit);
}

inline client::OpenAIOptions backend_options(const testing::FakeOpenAIServer& server,
                                             std::string fault = {}) {
  client::OpenAIOptions options;
  options.base_url = server.base_url();
  options.api_key = "test-key";
  if (!fault.empty()) options.extra_headers.emplace_back("x-fake-fault", std::move(fault));
  // Short enough that a hung test fails quickly, long enough never to fire on a loaded machine.
  options.timeouts.connect = std::chrono::milliseconds(5'000);
  options.timeouts.first_byte = std::chrono::milliseconds(10'000);
  options.timeouts.idle = std::chrono::milliseconds(10'000);
  options.timeouts.total = std::chrono::milliseconds(20'000);
  return options;
}

inline Request chat_request(std::string user_message, bool stream = true) {
  Request request;
  request.model = "fake-model";
  request.messages = {{"system", "Answer briefly."}, {"user", std::move(user_message)}};
  request.stream = stream;
  return request;
}

}  // namespace batchlm::integration
