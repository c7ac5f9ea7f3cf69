// The fake OpenAI server itself, seen through the real client: its endpoints and statistics,
// the GSM8K script with its known accuracy, fault rules, and the executable.

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "integration_support.hpp"

extern char** environ;

namespace {

namespace asio = boost::asio;
using batchlm::ErrorKind;
using batchlm::Outcome;
using batchlm::Request;
using batchlm::client::HttpClient;
using batchlm::client::HttpRequest;
using batchlm::client::HttpResponse;
using batchlm::client::OpenAIBackend;
using batchlm::integration::backend_options;
using batchlm::integration::chat_request;
using batchlm::integration::run_on;
using batchlm::testing::FakeOpenAIOptions;
using batchlm::testing::FakeOpenAIServer;
using batchlm::testing::FaultRule;
using batchlm::testing::FaultSpec;
using json = nlohmann::json;
using namespace std::chrono_literals;

class FakeOpenAIServerTest : public ::testing::Test {
 protected:
  Outcome ask(FakeOpenAIServer& server, const std::string& message, std::string fault = {},
              bool stream = true) {
    OpenAIBackend backend(ioc_.get_executor(), backend_options(server, std::move(fault)));
    Request request = chat_request(message, stream);
    return run_on(ioc_, backend.complete(request, {}));
  }

  HttpResponse http(FakeOpenAIServer& server, std::string method, std::string path) {
    HttpClient client(ioc_.get_executor());
    HttpRequest request;
    request.url = "http://127.0.0.1:" + std::to_string(server.port()) + path;
    request.method = std::move(method);
    return run_on(ioc_, client.perform(std::move(request)));
  }

  asio::io_context ioc_;
};

// ---- endpoints and statistics ---------------------------------------------------------------

TEST_F(FakeOpenAIServerTest, StatsCountRequestsPerLastUserMessage) {
  FakeOpenAIServer server;
  ASSERT_TRUE(ask(server, "apple").ok());
  ASSERT_TRUE(ask(server, "apple", {}, false).ok());
  ASSERT_FALSE(ask(server, "pear", "status=500").ok());

  HttpResponse response = http(server, "GET", "/_stats");
  ASSERT_EQ(response.status, 200);
  json stats = json::parse(response.body);
  EXPECT_EQ(stats["requests"], 3);
  EXPECT_EQ(stats["per_item"]["apple"], 2);
  EXPECT_EQ(stats["per_item"]["pear"], 1);
  EXPECT_EQ(stats["authorized"], 3);  // the test backend sends an API key
  EXPECT_EQ(server.requests(), 3u);
  EXPECT_EQ(server.requests_for("apple"), 2u);
  EXPECT_EQ(server.stats().per_item.size(), 2u);
}

TEST_F(FakeOpenAIServerTest, ResetEndpointClearsStats) {
  FakeOpenAIServer server;
  ASSERT_TRUE(ask(server, "apple").ok());
  HttpResponse reset = http(server, "POST", "/_reset");
  EXPECT_EQ(reset.status, 200);
  EXPECT_EQ(server.requests(), 0u);
  EXPECT_EQ(server.requests_for("apple"), 0u);
  json stats = json::parse(http(server, "GET", "/_stats").body);
  EXPECT_EQ(stats["requests"], 0);
  EXPECT_EQ(stats["authorized"], 0);
  EXPECT_TRUE(stats["per_item"].empty());
}

TEST_F(FakeOpenAIServerTest, ModelsEndpointListsAModel) {
  FakeOpenAIServer server;
  HttpResponse response = http(server, "GET", "/v1/models");
  ASSERT_EQ(response.status, 200);
  json models = json::parse(response.body);
  EXPECT_EQ(models["object"], "list");
  ASSERT_FALSE(models["data"].empty());
  EXPECT_EQ(models["data"][0]["object"], "model");
}

TEST_F(FakeOpenAIServerTest, UnknownRouteIs404) {
  FakeOpenAIServer server;
  EXPECT_EQ(http(server, "GET", "/v2/nothing").status, 404);
}

TEST_F(FakeOpenAIServerTest, BaseUrlNamesLoopbackAndPort) {
  FakeOpenAIServer server;
  EXPECT_NE(server.port(), 0);
  EXPECT_EQ(server.base_url(), "http://127.0.0.1:" + std::to_string(server.port()) + "/v1");
}

TEST_F(FakeOpenAIServerTest, TokensOptionSetsTheNumberOfWords) {
  FakeOpenAIOptions options;
  options.tokens = 5;
  FakeOpenAIServer server(options);
  Outcome outcome = ask(server, "words");
  ASSERT_TRUE(outcome.ok());
  EXPECT_EQ(outcome.completion->text, "the quick brown fox jumps");
  options.tokens = 2;
  server.set_options(options);
  outcome = ask(server, "words");
  ASSERT_TRUE(outcome.ok());
  EXPECT_EQ(outcome.completion->text, "the quick");
}

// ---- fault specs --------------------------------------------------------------------------------

TEST(FaultSpec, ParsesEveryKey) {
  FaultSpec f = FaultSpec::parse(
      "status=429; retry_after=2;retry_after_ms=1500;retry_after_date=7;should_retry=false;"
      "code=insufficient_quota;message=quota gone;no_body;after=4;reset_after=3;stall_ms=50;"
      "truncate;error_event;event_error;malformed;crlf;cr;byte_chunks;oversize=1000;"
      "slow_first_byte=9;at_end;html;redirect=308;location=http://127.0.0.1:1/v1/chat/completions");
  EXPECT_EQ(f.status, 429);
  EXPECT_EQ(f.retry_after, "2");
  EXPECT_EQ(f.retry_after_ms, 1500);
  EXPECT_EQ(f.retry_after_date_s, 7);
  EXPECT_EQ(f.should_retry, false);
  EXPECT_EQ(f.code, "insufficient_quota");
  EXPECT_EQ(f.message, "quota gone");
  EXPECT_TRUE(f.no_body);
  EXPECT_EQ(f.after, 4);
  EXPECT_EQ(f.reset_after, 3);
  EXPECT_EQ(f.stall_ms, 50);
  EXPECT_TRUE(f.truncate && f.error_event && f.event_error && f.malformed);
  EXPECT_TRUE(f.crlf && f.cr && f.byte_chunks);
  EXPECT_EQ(f.oversize_bytes, 1000u);
  EXPECT_EQ(f.slow_first_byte_ms, 9);
  EXPECT_TRUE(f.at_end && f.html);
  EXPECT_EQ(f.redirect, 308);
  EXPECT_EQ(f.location, "http://127.0.0.1:1/v1/chat/completions");
  EXPECT_EQ(FaultSpec::parse("oversize").oversize_bytes, std::size_t{100} << 20);
}

TEST(FaultSpec, RejectsUnknownKeysAndBadValues) {
  EXPECT_THROW(FaultSpec::parse("explode"), std::invalid_argument);
  EXPECT_THROW(FaultSpec::parse("status=abc"), std::invalid_argument);
  EXPECT_THROW(FaultSpec::parse("status=42"), std::invalid_argument);
  EXPECT_THROW(FaultSpec::parse("should_retry=maybe"), std::invalid_argument);
  EXPECT_THROW(FaultSpec::parse("stall_ms"), std::invalid_argument);
  EXPECT_THROW(FaultSpec::parse("redirect=200"), std::invalid_argument);
}

TEST_F(FakeOpenAIServerTest, BadFaultHeaderIsAnswered400) {
  FakeOpenAIServer server;
  Outcome outcome = ask(server, "x", "explode");
  ASSERT_FALSE(outcome.ok());
  EXPECT_EQ(outcome.error->http_status, 400);
  EXPECT_EQ(outcome.error->code, "bad_fault");
}

// ---- fault rules ------------------------------------------------------------------------------

TEST_F(FakeOpenAIServerTest, RuleFaultsOnlyTheFirstAttemptsOfEachItem) {
  FakeOpenAIServer server;
  server.set_rules({FaultRule{{FaultSpec::parse("status=500")}, 1.0, 2, 0}});
  for (const std::string item : {"a", "b"}) {
    EXPECT_EQ(ask(server, item).error.value_or(batchlm::Error{}).http_status, 500);
    EXPECT_EQ(ask(server, item).error.value_or(batchlm::Error{}).http_status, 500);
    EXPECT_TRUE(ask(server, item).ok());
    EXPECT_EQ(server.requests_for(item), 3u);
  }
}

TEST_F(FakeOpenAIServerTest, HeaderFaultTakesPrecedenceOverRules) {
  FakeOpenAIServer server;
  server.set_rules({FaultRule{{FaultSpec::parse("status=500")}, 1.0, 0, 0}});
  EXPECT_TRUE(ask(server, "x", "crlf").ok());
  EXPECT_FALSE(ask(server, "x").ok());
  server.clear_rules();
  EXPECT_TRUE(ask(server, "x").ok());
}

TEST_F(FakeOpenAIServerTest, SeededRuleFaultsTheSameItemsWhateverTheServer) {
  auto faulted_items = [&](std::uint64_t seed) {
    FakeOpenAIServer server;
    server.set_rules({FaultRule{{FaultSpec::parse("status=503")}, 0.5, 0, seed}});
    std::set<int> faulted;
    for (int i = 0; i < 40; ++i) {
      if (!ask(server, "item-" + std::to_string(i), {}, false).ok()) faulted.insert(i);
    }
    return faulted;
  };
  auto first = faulted_items(7);
  EXPECT_EQ(faulted_items(7), first);
  EXPECT_NE(faulted_items(8), first);
  EXPECT_GT(first.size(), 5u);
  EXPECT_LT(first.size(), 35u);
}

TEST_F(FakeOpenAIServerTest, RuleChoosesAmongItsFaults) {
  FakeOpenAIServer server;
  server.set_rules(
      {FaultRule{{FaultSpec::parse("status=500"), FaultSpec::parse("status=503")}, 1.0, 0, 1}});
  std::set<int> statuses;
  for (int i = 0; i < 30; ++i) {
    Outcome outcome = ask(server, "item-" + std::to_string(i), {}, false);
    ASSERT_FALSE(outcome.ok());
    statuses.insert(outcome.error->http_status);
  }
  EXPECT_EQ(statuses, (std::set<int>{500, 503}));
}

// ---- GSM8K script -----------------------------------------------------------------------------

class Gsm8kScriptTest : public FakeOpenAIServerTest {
 protected:
  void SetUp() override {
    path_ = std::filesystem::path(::testing::TempDir()) /
            ("gsm8k_script_" + std::to_string(::getpid()) + ".jsonl");
    std::ofstream out(path_);
    for (const auto& [q, a] : rows_) {
      out << json{{"question", q}, {"answer", "Reasoning here.\n#### " + a}}.dump() << "\n";
    }
  }
  void TearDown() override { std::filesystem::remove(path_); }

  std::string final_answer(const std::string& text) {
    auto mark = text.rfind("#### ");
    return mark == std::string::npos ? std::string() : text.substr(mark + 5);
  }

  std::filesystem::path path_;
  const std::vector<std::pair<std::string, std::string>> rows_ = {
      {"How many eggs are left if 16 are laid and 7 eaten?", "9"},
      {"A robe takes 2 bolts of blue fiber and half that much white. How many bolts?", "3"},
      {"A farm sells 1,600 apples a week. How many does it sell?", "1,600"},
      {"A house costs 1,450,000 dollars. What does it cost?", "1,450,000"},
  };
};

TEST_F(Gsm8kScriptTest, AnswersGoldExceptOnEveryWrongEveryLine) {
  FakeOpenAIOptions options;
  options.gsm8k_path = path_.string();
  options.wrong_every = 2;
  FakeOpenAIServer server(options);
  const std::vector<std::string> expected = {"9", "4", "1,600", "1450001"};
  for (std::size_t i = 0; i < rows_.size(); ++i) {
    // Wrapped in a prompt, as a job's template would: matched by containment.
    Outcome outcome = ask(server, "Solve this.\nQuestion: " + rows_[i].first + "\nAnswer:");
    ASSERT_TRUE(outcome.ok()) << outcome.error->message;
    EXPECT_EQ(final_answer(outcome.completion->text), expected[i]) << "line " << i + 1;
  }
}

TEST_F(Gsm8kScriptTest, AnswersGoldEverywhereWhenWrongEveryIsZero) {
  FakeOpenAIOptions options;
  options.gsm8k_path = path_.string();
  FakeOpenAIServer server(options);
  for (const auto& [question, gold] : rows_) {
    Outcome outcome = ask(server, question, {}, false);
    ASSERT_TRUE(outcome.ok()) << outcome.error->message;
    EXPECT_EQ(final_answer(outcome.completion->text), gold);
  }
}

TEST_F(Gsm8kScriptTest, UnknownQuestionGetsGeneratedText) {
  FakeOpenAIOptions options;
  options.gsm8k_path = path_.string();
  options.tokens = 4;
  FakeOpenAIServer server(options);
  Outcome outcome = ask(server, "What is the capital of France?");
  ASSERT_TRUE(outcome.ok());
  EXPECT_EQ(outcome.completion->text, FakeOpenAIServer::generated_text(4));
}

// ---- threads ----------------------------------------------------------------------------------

TEST_F(FakeOpenAIServerTest, SeveralServerThreadsServeConcurrentStreams) {
  FakeOpenAIOptions options;
  options.tokens = 6;
  options.token_delay_ms = 1;
  FakeOpenAIServer server(options, 4);
  OpenAIBackend backend(ioc_.get_executor(), backend_options(server));
  constexpr int kStreams = 200;
  std::vector<Request> requests;
  for (int i = 0; i < kStreams; ++i) requests.push_back(chat_request("item-" + std::to_string(i)));
  std::vector<std::future<Outcome>> results;
  for (const auto& r : requests) {
    results.push_back(asio::co_spawn(ioc_, backend.complete(r, {}), asio::use_future));
  }
  int ok = 0;
  for (auto& r : results) ok += batchlm::integration::wait_on(ioc_, r).ok() ? 1 : 0;
  EXPECT_EQ(ok, kStreams);
  EXPECT_EQ(server.stats().per_item.size(), static_cast<std::size_t>(kStreams));
}

// ---- the executable ---------------------------------------------------------------------------

TEST_F(FakeOpenAIServerTest, ExecutableServesWritesItsPortAndExitsOnSigterm) {
  const std::string binary = BATCHLM_BINARY_DIR "/bin/fake_openai_server";
  if (!std::filesystem::exists(binary)) GTEST_SKIP() << binary << " is not built";
  const auto port_file = std::filesystem::path(::testing::TempDir()) /
                         ("fake_port_" + std::to_string(::getpid()));
  std::filesystem::remove(port_file);
  std::vector<std::string> args = {binary, "--port-file", port_file.string(), "--tokens", "3",
                                   "--faults", "status=500", "--fault-first-attempts", "1"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, binary.c_str(), nullptr, nullptr, argv.data(), environ), 0);

  std::string port;
  for (int i = 0; i < 500 && port.empty(); ++i) {
    std::ifstream in(port_file);
    if (!(in >> port)) {
      port.clear();
      std::this_thread::sleep_for(10ms);
    }
  }
  if (port.empty()) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    FAIL() << "no port file within 5 s";
  }

  batchlm::client::OpenAIOptions options;
  options.base_url = "http://127.0.0.1:" + port + "/v1";
  options.timeouts.total = 10s;
  OpenAIBackend backend(ioc_.get_executor(), options);
  Request request = chat_request("exe");
  Outcome first = run_on(ioc_, backend.complete(request, {}));
  Outcome second = run_on(ioc_, backend.complete(request, {}));

  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::filesystem::remove(port_file);

  ASSERT_FALSE(first.ok());
  EXPECT_EQ(first.error->http_status, 500);
  ASSERT_TRUE(second.ok()) << second.error->message;
  EXPECT_EQ(second.completion->text, "the quick brown");
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
