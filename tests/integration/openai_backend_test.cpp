// The real OpenAI backend (libcurl multi on Asio, SSE parsing) against the fake server:
// successful answers, every injected fault mapped to its Error, cancellation, and many
// concurrent streams on one thread.

#include <chrono>
#include <cstddef>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <gtest/gtest.h>

#include "integration_support.hpp"

namespace {

namespace asio = boost::asio;
using batchlm::ErrorKind;
using batchlm::Outcome;
using batchlm::Request;
using batchlm::client::OpenAIBackend;
using batchlm::client::OpenAIOptions;
using batchlm::integration::backend_options;
using batchlm::integration::chat_request;
using batchlm::integration::run_on;
using batchlm::integration::wait_on;
using batchlm::testing::FakeOpenAIOptions;
using batchlm::testing::FakeOpenAIServer;
using batchlm::testing::FaultRule;
using batchlm::testing::FaultSpec;
using namespace std::chrono_literals;

constexpr int kTokens = 8;

FakeOpenAIOptions small_answers() {
  FakeOpenAIOptions options;
  options.tokens = kTokens;
  options.ttft_ms = 2;
  options.token_delay_ms = 1;
  return options;
}

class OpenAIBackendTest : public ::testing::Test {
 protected:
  struct Result {
    Outcome outcome;
    std::vector<std::string> deltas;
  };

  Result complete(const OpenAIOptions& options, const Request& request) {
    OpenAIBackend backend(ioc_.get_executor(), options);
    Result result;
    batchlm::TokenSink sink = [&result](std::string_view delta, std::span<const batchlm::TokenLogprob>, batchlm::TextPart part) {
      if (part != batchlm::TextPart::kContent) return;
      result.deltas.emplace_back(delta);
    };
    result.outcome = run_on(ioc_, backend.complete(request, sink));
    return result;
  }

  Result complete_with_fault(const std::string& fault, bool stream = true) {
    return complete(backend_options(server_, fault), chat_request("item", stream));
  }

  batchlm::Error error_of(const Result& result) {
    EXPECT_FALSE(result.outcome.ok());
    if (!result.outcome.error) throw std::runtime_error("expected an error, got a completion");
    return *result.outcome.error;
  }

  asio::io_context ioc_;
  FakeOpenAIServer server_{small_answers()};
};

std::string joined(const std::vector<std::string>& pieces) {
  std::string out;
  for (const auto& p : pieces) out += p;
  return out;
}

std::size_t non_empty(const std::vector<std::string>& pieces) {
  std::size_t n = 0;
  for (const auto& p : pieces) n += p.empty() ? 0 : 1;
  return n;
}

// ---- successes --------------------------------------------------------------------------------

TEST_F(OpenAIBackendTest, StreamingAnswerCarriesTextFinishReasonUsageAndTimings) {
  auto result = complete(backend_options(server_), chat_request("item"));
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  const auto& c = *result.outcome.completion;
  EXPECT_EQ(c.text, FakeOpenAIServer::generated_text(kTokens));
  EXPECT_EQ(c.finish_reason, "stop");
  EXPECT_TRUE(c.usage.reported);
  EXPECT_EQ(c.usage.completion_tokens, kTokens);
  EXPECT_EQ(c.usage.prompt_tokens, 3);  // "Answer briefly." + "item", in words
  EXPECT_GT(c.timings.ttft_ms, 0);
  EXPECT_GE(c.timings.total_ms, c.timings.ttft_ms);
  EXPECT_GT(result.outcome.timings.total_ms, 0);
}

TEST_F(OpenAIBackendTest, SeveralChoicesInAStreamKeepTheFirstOnly) {
  // A server asked for n = 2 interleaves the choices' chunks; the answer is choice 0's.
  Request request = chat_request("item");
  request.extra = {{"n", 2}};
  auto result = complete(backend_options(server_), request);
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
  EXPECT_EQ(joined(result.deltas), result.outcome.completion->text);
  EXPECT_EQ(result.outcome.completion->finish_reason, "stop");
}

TEST_F(OpenAIBackendTest, StreamingAnswerCallsTheSinkOncePerDelta) {
  auto result = complete(backend_options(server_), chat_request("item"));
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(non_empty(result.deltas), static_cast<std::size_t>(kTokens));
  EXPECT_EQ(joined(result.deltas), result.outcome.completion->text);
}

TEST_F(OpenAIBackendTest, NonStreamingAnswerCarriesTextFinishReasonAndUsage) {
  auto result = complete(backend_options(server_), chat_request("item", false));
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  const auto& c = *result.outcome.completion;
  EXPECT_EQ(c.text, FakeOpenAIServer::generated_text(kTokens));
  EXPECT_EQ(c.finish_reason, "stop");
  EXPECT_TRUE(c.usage.reported);
  EXPECT_EQ(c.usage.completion_tokens, kTokens);
  EXPECT_GT(c.timings.ttft_ms, 0);
  EXPECT_GT(c.timings.total_ms, 0);
}

TEST_F(OpenAIBackendTest, MaxTokensCutsTheAnswerWithFinishReasonLength) {
  Request request = chat_request("item");
  request.max_tokens = 3;
  auto result = complete(backend_options(server_), request);
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(3));
  EXPECT_EQ(result.outcome.completion->finish_reason, "length");
}

TEST_F(OpenAIBackendTest, CrlfLineEndsGiveTheSameText) {
  auto result = complete_with_fault("crlf");
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
  EXPECT_EQ(result.outcome.completion->finish_reason, "stop");
}

TEST_F(OpenAIBackendTest, LoneCrLineEndsGiveTheSameText) {
  auto result = complete_with_fault("cr");
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
  EXPECT_EQ(result.outcome.completion->finish_reason, "stop");
}

TEST_F(OpenAIBackendTest, OneByteChunksGiveTheSameText) {
  auto result = complete_with_fault("byte_chunks");
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
  EXPECT_TRUE(result.outcome.completion->usage.reported);
}

TEST_F(OpenAIBackendTest, JsonAnswerToAStreamingRequestIsAccepted) {
  // A server that ignores `stream: true` and answers with a chat.completion body.
  auto result = complete_with_fault("ignore_stream");
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
  EXPECT_EQ(result.outcome.completion->finish_reason, "stop");
  EXPECT_TRUE(result.outcome.completion->usage.reported);
  EXPECT_EQ(joined(result.deltas), FakeOpenAIServer::generated_text(kTokens));
}

TEST_F(OpenAIBackendTest, OneByteChunksWithCrlfGiveTheSameText) {
  // A CR ending one read and its LF starting the next must count as one line end.
  auto result = complete_with_fault("crlf;byte_chunks");
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
}

TEST_F(OpenAIBackendTest, OneByteChunksWithLoneCrGiveTheSameText) {
  auto result = complete_with_fault("cr;byte_chunks");
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
}

// ---- HTTP errors and their hints ------------------------------------------------------------

TEST_F(OpenAIBackendTest, Status429WithRetryAfterSecondsIsHttpWithRetryAfter) {
  const auto e = error_of(complete_with_fault("status=429;retry_after=2"));
  EXPECT_EQ(e.kind, ErrorKind::Http);
  EXPECT_EQ(e.http_status, 429);
  ASSERT_TRUE(e.retry_after.has_value());
  EXPECT_EQ(*e.retry_after, 2000ms);
}

TEST_F(OpenAIBackendTest, RetryAfterMsWinsOverRetryAfter) {
  const auto e = error_of(complete_with_fault("status=429;retry_after=5;retry_after_ms=1500"));
  EXPECT_EQ(e.http_status, 429);
  ASSERT_TRUE(e.retry_after.has_value());
  EXPECT_EQ(*e.retry_after, 1500ms);
}

TEST_F(OpenAIBackendTest, RetryAfterAsHttpDateIsMeasuredFromNow) {
  const auto e = error_of(complete_with_fault("status=503;retry_after_date=30"));
  EXPECT_EQ(e.kind, ErrorKind::Http);
  EXPECT_EQ(e.http_status, 503);
  ASSERT_TRUE(e.retry_after.has_value());
  // The date has whole seconds: up to one second is lost to truncation.
  EXPECT_GE(*e.retry_after, 28'000ms);
  EXPECT_LE(*e.retry_after, 30'000ms);
}

TEST_F(OpenAIBackendTest, StatusWithoutRetryAfterHasNoRetryAfter) {
  const auto e = error_of(complete_with_fault("status=500", false));
  EXPECT_EQ(e.kind, ErrorKind::Http);
  EXPECT_EQ(e.http_status, 500);
  EXPECT_FALSE(e.retry_after.has_value());
  EXPECT_FALSE(e.should_retry.has_value());
}

TEST_F(OpenAIBackendTest, InsufficientQuotaCodeAndMessageAreCarried) {
  const auto& e =
      error_of(complete_with_fault("status=429;code=insufficient_quota;message=no credit left"));
  EXPECT_EQ(e.kind, ErrorKind::Http);
  EXPECT_EQ(e.http_status, 429);
  EXPECT_EQ(e.code, "insufficient_quota");
  EXPECT_NE(e.message.find("no credit left"), std::string::npos) << e.message;
}

TEST_F(OpenAIBackendTest, ShouldRetryFalseIsCarried) {
  const auto e = error_of(complete_with_fault("status=500;should_retry=false"));
  ASSERT_TRUE(e.should_retry.has_value());
  EXPECT_FALSE(*e.should_retry);
}

TEST_F(OpenAIBackendTest, ShouldRetryTrueIsCarried) {
  const auto e = error_of(complete_with_fault("status=409;should_retry=true", false));
  EXPECT_EQ(e.http_status, 409);
  ASSERT_TRUE(e.should_retry.has_value());
  EXPECT_TRUE(*e.should_retry);
}

TEST_F(OpenAIBackendTest, ErrorStatusWithEmptyBodyIsHttp) {
  const auto e = error_of(complete_with_fault("status=502;no_body"));
  EXPECT_EQ(e.kind, ErrorKind::Http);
  EXPECT_EQ(e.http_status, 502);
}

// ---- broken transports and streams ----------------------------------------------------------

TEST_F(OpenAIBackendTest, ConnectionResetMidStreamIsConnectionError) {
  auto result = complete_with_fault("reset_after=3");
  const auto e = error_of(result);
  EXPECT_EQ(e.kind, ErrorKind::Connection) << e.message;
}

TEST_F(OpenAIBackendTest, ConnectionResetBeforeAnyByteIsConnectionError) {
  const auto e = error_of(complete_with_fault("reset_after=0", false));
  EXPECT_EQ(e.kind, ErrorKind::Connection) << e.message;
}

TEST_F(OpenAIBackendTest, StalledStreamIsIdleTimeout) {
  auto options = backend_options(server_, "stall_ms=3000;after=2");
  options.timeouts.idle = 200ms;
  auto result = complete(options, chat_request("item"));
  const auto e = error_of(result);
  EXPECT_EQ(e.kind, ErrorKind::Timeout);
  EXPECT_NE(e.message.find("idle"), std::string::npos) << e.message;
}

// A steady stream (a chunk every 100 ms, 8 chunks) runs past both deadlines: the first-byte one
// ends with the first byte, and the idle one counts from the last data, not the first.
TEST_F(OpenAIBackendTest, StreamLongerThanItsDeadlinesSucceedsWhileDataKeepsComing) {
  FakeOpenAIOptions steady = small_answers();
  steady.token_delay_ms = 100;
  FakeOpenAIServer server(steady);
  for (const auto& [first_byte, idle] : {std::pair{200ms, 2'000ms}, std::pair{60'000ms, 250ms}}) {
    auto options = backend_options(server);
    options.timeouts.first_byte = first_byte;
    options.timeouts.idle = idle;
    const auto start = std::chrono::steady_clock::now();
    auto result = complete(options, chat_request("item"));
    ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
    EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
    EXPECT_GT(std::chrono::steady_clock::now() - start, 600ms) << "the stream was too short to test anything";
  }
}

TEST_F(OpenAIBackendTest, SlowFirstByteIsFirstByteTimeout) {
  auto options = backend_options(server_, "slow_first_byte=5000");
  options.timeouts.first_byte = 200ms;
  auto result = complete(options, chat_request("item"));
  const auto e = error_of(result);
  EXPECT_EQ(e.kind, ErrorKind::Timeout);
  EXPECT_NE(e.message.find("first"), std::string::npos) << e.message;
}

// A complete answer (finish reason and usage) followed by a reset, or by a connection held
// open without [DONE], is kept.
TEST_F(OpenAIBackendTest, ResetAfterTheFinishReasonKeepsTheAnswer) {
  auto result = complete_with_fault("reset_after=0;at_end");
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
  EXPECT_EQ(result.outcome.completion->finish_reason, "stop");
  EXPECT_TRUE(result.outcome.completion->usage.reported);
}

TEST_F(OpenAIBackendTest, SilenceAfterTheFinishReasonKeepsTheAnswerAtTheIdleTimeout) {
  auto options = backend_options(server_, "stall_ms=5000;at_end");
  options.timeouts.idle = 200ms;
  auto result = complete(options, chat_request("item"));
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
  EXPECT_EQ(result.outcome.completion->finish_reason, "stop");
  EXPECT_EQ(result.outcome.completion->usage.completion_tokens, kTokens);
}

// Once the answer is whole, a server that falls silent is waited for timeouts.after_answer,
// not the idle timeout: a proxy that never sends [DONE] costs seconds an item, not a minute.
TEST_F(OpenAIBackendTest, SilenceAfterTheFinishReasonIsWaitedForBriefly) {
  auto options = backend_options(server_, "stall_ms=5000;at_end");
  options.timeouts.idle = 30s;
  options.timeouts.after_answer = 200ms;
  const auto start = std::chrono::steady_clock::now();
  auto result = complete(options, chat_request("item"));
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 4s);  // not the 5 s stall, nor the 30 s idle
}

// A server that keeps the stream open after the answer with comments (or empty chunks) is
// waited for timeouts.after_answer from the answer on: the bytes do not extend it.
TEST_F(OpenAIBackendTest, KeepAlivesAfterTheFinishReasonDoNotHoldTheAnswer) {
  auto options = backend_options(server_, "pings=60;ping_ms=100");  // six seconds of `: ping`
  options.timeouts.idle = 30s;
  options.timeouts.after_answer = 300ms;
  const auto start = std::chrono::steady_clock::now();
  auto result = complete(options, chat_request("item"));
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
  EXPECT_EQ(result.outcome.completion->finish_reason, "stop");
  EXPECT_EQ(result.outcome.completion->usage.completion_tokens, kTokens);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 4s);  // not the six seconds of pings
}

// Text a server sends for choice 0 after its finish reason is not part of the answer.
TEST_F(OpenAIBackendTest, TextAfterTheFinishReasonIsNotPartOfTheAnswer) {
  auto result = complete_with_fault("late_text=LATE");
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
  EXPECT_EQ(result.outcome.completion->finish_reason, "stop");
  EXPECT_TRUE(result.outcome.completion->usage.reported);
}

// A body compressed though the request did not ask for it (as some proxies do) is decoded.
TEST_F(OpenAIBackendTest, AnUnaskedForGzipBodyIsDecoded) {
  auto result = complete_with_fault("gzip", false);
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
  EXPECT_EQ(result.outcome.completion->finish_reason, "stop");
}

// A Content-Encoding that is no encoding (a misconfigured server's "UTF-8") is read as other
// clients read it: the body as it comes, not an error.
TEST_F(OpenAIBackendTest, AContentEncodingThatIsNoEncodingLeavesTheBodyAsItIs) {
  for (const char* encoding : {"UTF-8", "identity"}) {
    auto result = complete_with_fault(std::string("content_encoding=") + encoding, false);
    ASSERT_TRUE(result.outcome.ok()) << encoding << ": " << result.outcome.error->message;
    EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens)) << encoding;
  }
}

TEST_F(OpenAIBackendTest, StreamEndingWithoutDoneOrFinishReasonIsTruncated) {
  const auto e = error_of(complete_with_fault("truncate;after=3"));
  EXPECT_EQ(e.kind, ErrorKind::Truncated) << e.message;
}

TEST_F(OpenAIBackendTest, NonStreamingBodyCutShortIsAnError) {
  const auto e = error_of(complete_with_fault("truncate", false));
  EXPECT_TRUE(e.kind == ErrorKind::Connection || e.kind == ErrorKind::Truncated ||
              e.kind == ErrorKind::Protocol)
      << batchlm::to_string(e.kind) << ": " << e.message;
}

TEST_F(OpenAIBackendTest, ErrorObjectInsideA200StreamIsStreamError) {
  const auto e = error_of(complete_with_fault("error_event;code=overloaded;message=busy"));
  EXPECT_EQ(e.kind, ErrorKind::StreamError);
  EXPECT_EQ(e.code, "overloaded");
  EXPECT_NE(e.message.find("busy"), std::string::npos) << e.message;
}

TEST_F(OpenAIBackendTest, ErrorEventInsideA200StreamIsStreamError) {
  const auto e = error_of(complete_with_fault("event_error;code=overloaded"));
  EXPECT_EQ(e.kind, ErrorKind::StreamError);
  EXPECT_EQ(e.code, "overloaded");
}

TEST_F(OpenAIBackendTest, MalformedJsonInADataLineIsProtocolError) {
  const auto e = error_of(complete_with_fault("malformed"));
  EXPECT_EQ(e.kind, ErrorKind::Protocol) << e.message;
}

// A base URL that answers with a web page (a UI, a captive proxy) rather than the API.
TEST_F(OpenAIBackendTest, HtmlPageInsteadOfAnAnswerIsProtocolErrorNamingTypeAndStart) {
  for (const bool stream : {true, false}) {
    SCOPED_TRACE(stream ? "streaming" : "not streaming");
    const auto e = error_of(complete_with_fault("html", stream));
    EXPECT_EQ(e.kind, ErrorKind::Protocol) << e.message;
    EXPECT_EQ(e.http_status, 200);
    EXPECT_NE(e.message.find(stream ? "expected text/event-stream, got text/html; charset=utf-8: <!DOCTYPE html>"
                                    : "expected JSON, got text/html; charset=utf-8: <!DOCTYPE html>"),
              std::string::npos)
        << e.message;
    EXPECT_NE(e.message.find("Sign in"), std::string::npos) << e.message;
  }
}

TEST_F(OpenAIBackendTest, GiantSseLineIsTooLarge) {
  auto options = backend_options(server_, "oversize=4000000");
  options.sse_limits.max_line_bytes = 1 << 20;
  const auto e = error_of(complete(options, chat_request("item")));
  EXPECT_EQ(e.kind, ErrorKind::TooLarge) << e.message;
}

TEST_F(OpenAIBackendTest, OversizedBodyIsTooLarge) {
  auto options = backend_options(server_, "oversize=3000000");
  options.max_response_bytes = 1 << 20;
  const auto e = error_of(complete(options, chat_request("item", false)));
  EXPECT_EQ(e.kind, ErrorKind::TooLarge) << e.message;
}

TEST_F(OpenAIBackendTest, ConnectionRefusedIsConnectionError) {
  OpenAIOptions options = backend_options(server_);
  {
    // A port that was just free: nothing listens there any more.
    FakeOpenAIServer gone;
    options.base_url = gone.base_url();
  }
  const auto e = error_of(complete(options, chat_request("item")));
  EXPECT_EQ(e.kind, ErrorKind::Connection) << e.message;
}

// ---- redirects -------------------------------------------------------------------------------

// 307 and 308 keep the method and the body: the request is sent again where they point, with
// its API key while that is the same server.
TEST_F(OpenAIBackendTest, TemporaryAndPermanentRedirectsAreFollowedWithTheBody) {
  for (const int status : {307, 308}) {
    for (const bool stream : {true, false}) {
      const std::string item = "item-" + std::to_string(status) + (stream ? "-stream" : "");
      SCOPED_TRACE(item);
      server_.set_rules({FaultRule{{FaultSpec::parse("redirect=" + std::to_string(status))}, 1.0, 1, 0}});
      server_.reset_stats();
      auto result = complete(backend_options(server_), chat_request(item, stream));
      ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
      EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
      // Both requests carried the messages (the server counts them by the last user message).
      EXPECT_EQ(server_.requests_for(item), 2u);
      EXPECT_EQ(server_.stats().authorized, 2u);
    }
  }
}

// The error of a 307/308 to another origin that carries credentials: the redirect is the answer.
std::string not_followed(int status, const std::string& location) {
  return "HTTP " + std::to_string(status) + " redirect to " + location +
         ", not followed: it leads to another host or port, and the API key and the backend's own headers go to "
         "the base URL's only (set base_url to where it leads)";
}

// With an API key, a redirect to another host is the answer, naming where it leads: followed,
// the key would either go along or be dropped there (a 401 for a key that is right). Without
// one there is nothing to keep, and it is followed.
TEST_F(OpenAIBackendTest, RedirectToAnotherHostIsNotFollowedWithAnApiKey) {
  FakeOpenAIServer other(small_answers());
  const std::string elsewhere = other.base_url() + "/chat/completions";
  server_.set_rules({FaultRule{{FaultSpec::parse("redirect=307;location=" + elsewhere)}, 1.0, 0, 0}});
  auto result = complete(backend_options(server_), chat_request("item"));
  ASSERT_FALSE(result.outcome.ok());
  EXPECT_EQ(result.outcome.error->http_status, 307);
  EXPECT_EQ(result.outcome.error->message, not_followed(307, elsewhere));
  EXPECT_EQ(other.requests(), 0u);
  OpenAIOptions keyless = backend_options(server_);
  keyless.api_key.clear();
  result = complete(keyless, chat_request("keyless"));
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(result.outcome.completion->text, FakeOpenAIServer::generated_text(kTokens));
  EXPECT_EQ(other.requests_for("keyless"), 1u);
}

// A header the job gives replaces the client's own of that name: an Authorization of its own in
// place of the key's, a Content-Type; sent twice, a server takes the first or refuses both.
TEST_F(OpenAIBackendTest, TheBackendsOwnHeadersReplaceTheClientsOfTheSameName) {
  OpenAIOptions options = backend_options(server_);
  options.extra_headers.emplace_back("authorization", "Bearer from-the-job");
  options.extra_headers.emplace_back("Content-Type", "application/json; charset=utf-8");
  auto result = complete(options, chat_request("item"));
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(server_.stats().last_authorization, "Bearer from-the-job\n");
  EXPECT_EQ(server_.stats().last_content_type, "application/json; charset=utf-8\n");
  result = complete(backend_options(server_), chat_request("plain"));
  ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
  EXPECT_EQ(server_.stats().last_authorization, "Bearer test-key\n");
  EXPECT_EQ(server_.stats().last_content_type, "application/json\n");
}

// curl would send headers of the backend's own (Azure's `api-key`, say) to the other host:
// with such headers, a redirect to another origin is the answer. To the same origin it is
// followed with them.
TEST_F(OpenAIBackendTest, RedirectToAnotherHostIsNotFollowedWithTheBackendsOwnHeaders) {
  FakeOpenAIServer other(small_answers());
  OpenAIOptions options = backend_options(server_);
  options.extra_headers.emplace_back("api-key", "secret");
  const std::string elsewhere = other.base_url() + "/chat/completions";
  server_.set_rules({FaultRule{{FaultSpec::parse("redirect=308;location=" + elsewhere)}, 1.0, 0, 0}});
  auto result = complete(options, chat_request("item"));
  ASSERT_FALSE(result.outcome.ok());
  EXPECT_EQ(result.outcome.error->kind, ErrorKind::Http);
  EXPECT_EQ(result.outcome.error->http_status, 308);
  EXPECT_EQ(result.outcome.error->message, not_followed(308, elsewhere));
  EXPECT_EQ(other.requests(), 0u);
  // The same host over https is followed (this plain server then fails the TLS handshake).
  std::string secure = server_.base_url();
  secure.replace(0, 4, "https");
  server_.set_rules({FaultRule{{FaultSpec::parse("redirect=308;location=" + secure + "/chat/completions")}, 1.0, 0, 0}});
  result = complete(options, chat_request("upgrade"));
  ASSERT_FALSE(result.outcome.ok());
  EXPECT_NE(result.outcome.error->kind, ErrorKind::Http) << result.outcome.error->message;
  // ... where no TLS connection can be made: said as such, with what to do.
  EXPECT_EQ(result.outcome.error->code, "tls_failed") << result.outcome.error->message;
  EXPECT_NE(result.outcome.error->message.find("if the server speaks plain HTTP, the base URL starts with http://"), std::string::npos)
      << result.outcome.error->message;
  // But https on another port of that host may be another service: not followed.
  server_.set_rules({FaultRule{{FaultSpec::parse("redirect=308;location=https://127.0.0.1:1/v1/chat/completions")},
                               1.0, 0, 0}});
  result = complete(options, chat_request("elsewhere"));
  ASSERT_FALSE(result.outcome.ok());
  EXPECT_EQ(result.outcome.error->http_status, 308) << result.outcome.error->message;
  // The same host under another path (relative or absolute): followed, headers and all.
  for (const std::string& location : {std::string("/v1/chat/completions"), server_.base_url() + "/chat/completions"}) {
    SCOPED_TRACE(location);
    server_.set_rules({FaultRule{{FaultSpec::parse("redirect=307;location=" + location)}, 1.0, 1, 0}});
    server_.reset_stats();
    result = complete(options, chat_request("same-" + location));
    ASSERT_TRUE(result.outcome.ok()) << result.outcome.error->message;
    EXPECT_EQ(server_.requests_for("same-" + location), 2u);
  }
}

// 301, 302 and 303 would turn the POST into a GET without its body: the redirect is the answer,
// and its error names where it pointed.
TEST_F(OpenAIBackendTest, RedirectThatWouldDropThePostIsAnHttpErrorNamingItsLocation) {
  for (const int status : {301, 302, 303}) {
    SCOPED_TRACE(status);
    server_.reset_stats();
    const auto e = error_of(
        complete_with_fault("redirect=" + std::to_string(status) + ";location=https://elsewhere.example/v1/chat/completions"));
    EXPECT_EQ(e.kind, ErrorKind::Http);
    EXPECT_EQ(e.http_status, status);
    EXPECT_EQ(e.message, "HTTP " + std::to_string(status) +
                             " redirect to https://elsewhere.example/v1/chat/completions, not followed");
    EXPECT_EQ(server_.requests(), 1u);
  }
}

TEST_F(OpenAIBackendTest, RedirectLoopEndsAfterFiveRedirects) {
  const auto e = error_of(complete_with_fault("redirect=307;location=/v1/chat/completions"));
  EXPECT_EQ(e.kind, ErrorKind::Http);
  EXPECT_EQ(e.http_status, 307);
  EXPECT_EQ(e.message, "more than 5 redirects, the last to /v1/chat/completions");
  EXPECT_EQ(server_.requests(), 6u);
}

// ---- cancellation ----------------------------------------------------------------------------

TEST_F(OpenAIBackendTest, CancellationByARacingTimerYieldsPromptly) {
  using namespace asio::experimental::awaitable_operators;
  OpenAIBackend backend(ioc_.get_executor(), backend_options(server_, "slow_first_byte=10000"));
  Request request = chat_request("item");
  const auto started = std::chrono::steady_clock::now();
  auto winner = run_on(ioc_, [&]() -> asio::awaitable<std::size_t> {
    asio::steady_timer timer(co_await asio::this_coro::executor, 100ms);
    auto raced = co_await (backend.complete(request, {}) || timer.async_wait(asio::use_awaitable));
    co_return raced.index();
  }());
  const auto elapsed = std::chrono::steady_clock::now() - started;
  EXPECT_EQ(winner, 1u);  // the timer
  // Far below the server's 10 s: the transfer was dropped, not waited for.
  EXPECT_LT(elapsed, 5s);
  EXPECT_EQ(backend.http().in_flight(), 0u);
}

TEST_F(OpenAIBackendTest, CancelledAttemptReturnsCancelled) {
  OpenAIBackend backend(ioc_.get_executor(), backend_options(server_, "stall_ms=10000;after=1"));
  Request request = chat_request("item");
  asio::cancellation_signal cancel;
  auto result = asio::co_spawn(ioc_, backend.complete(request, {}),
                               asio::bind_cancellation_slot(cancel.slot(), asio::use_future));
  asio::steady_timer timer(ioc_, 100ms);
  timer.async_wait([&](boost::system::error_code) { cancel.emit(asio::cancellation_type::terminal); });
  Outcome outcome = wait_on(ioc_, result, 5s);
  ASSERT_FALSE(outcome.ok());
  EXPECT_EQ(outcome.error->kind, ErrorKind::Cancelled) << outcome.error->message;
  EXPECT_EQ(backend.http().in_flight(), 0u);
}

// ---- connections -----------------------------------------------------------------------------

TEST_F(OpenAIBackendTest, SequentialRequestsReuseOneConnection) {
  OpenAIBackend backend(ioc_.get_executor(), backend_options(server_));
  for (int i = 0; i < 5; ++i) {
    SCOPED_TRACE("request " + std::to_string(i));
    Request request = chat_request("item-" + std::to_string(i), i % 2 == 0);
    Outcome outcome = run_on(ioc_, backend.complete(request, {}));
    ASSERT_TRUE(outcome.ok()) << outcome.error->message;
  }
  EXPECT_EQ(server_.requests(), 5u);
  EXPECT_EQ(server_.connections(), 1u);
}

TEST_F(OpenAIBackendTest, ManyConcurrentStreamsOnOneThreadAllSucceedAndReuseConnections) {
  constexpr int kStreams = 300;
  OpenAIBackend backend(ioc_.get_executor(), backend_options(server_));
  auto wave = [&](int wave_number) {
    std::vector<Request> requests;
    for (int i = 0; i < kStreams; ++i) {
      requests.push_back(chat_request("wave-" + std::to_string(wave_number) + "-" + std::to_string(i)));
    }
    std::vector<std::future<Outcome>> results;
    for (const auto& request : requests) {
      results.push_back(asio::co_spawn(ioc_, backend.complete(request, {}), asio::use_future));
    }
    int ok = 0;
    for (auto& r : results) {
      Outcome outcome = wait_on(ioc_, r);
      if (outcome.ok() && outcome.completion->text == FakeOpenAIServer::generated_text(kTokens)) {
        ++ok;
      } else if (!outcome.ok()) {
        ADD_FAILURE() << batchlm::to_string(outcome.error->kind) << ": " << outcome.error->message;
      }
    }
    return ok;
  };
  EXPECT_EQ(wave(1), kStreams);
  const auto after_first = server_.connections();
  EXPECT_LE(after_first, static_cast<std::uint64_t>(kStreams));
  EXPECT_EQ(wave(2), kStreams);
  EXPECT_EQ(server_.requests(), 2u * kStreams);
  // The second wave rides mostly on the first wave's connections.
  EXPECT_LT(server_.connections(), after_first + kStreams / 2)
      << "first wave opened " << after_first << " connections";
}

}  // namespace
