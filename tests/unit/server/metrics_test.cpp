// The Prometheus text of `batchlm serve`'s GET /metrics without a socket: histogram buckets,
// route labels, label escaping, and the families present with and without an engine.

#include "batchlm/server/metrics.hpp"

#include <chrono>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>

namespace batchlm::server {
namespace {

// Every line of an exposition: "# HELP"/"# TYPE" comments and "series value" samples, checked
// for the shape the text format asks for; returns the samples by series (name and labels).
std::map<std::string, std::string> samples_of(const std::string& text) {
  std::map<std::string, std::string> samples;
  std::map<std::string, std::string> types;  // family -> type
  std::set<std::string> helped;
  std::istringstream in(text);
  std::string line;
  EXPECT_TRUE(text.empty() || text.back() == '\n') << "the last line ends with a line feed";
  while (std::getline(in, line)) {
    if (line.starts_with("# HELP ")) {
      const std::string name = line.substr(7, line.find(' ', 7) - 7);
      EXPECT_TRUE(helped.insert(name).second) << "HELP twice for " << name;
      continue;
    }
    if (line.starts_with("# TYPE ")) {
      const std::string rest = line.substr(7);
      const std::string name = rest.substr(0, rest.find(' '));
      EXPECT_TRUE(helped.count(name)) << "TYPE before HELP for " << name;
      EXPECT_TRUE(types.emplace(name, rest.substr(rest.find(' ') + 1)).second) << "TYPE twice for " << name;
      continue;
    }
    const auto space = line.rfind(' ');
    EXPECT_NE(space, std::string::npos) << line;
    if (space == std::string::npos) continue;
    const std::string series = line.substr(0, space);
    const std::string name = series.substr(0, series.find('{'));
    // The family a sample belongs to: its own name, or a histogram's without the suffix.
    std::string family = name;
    for (const std::string suffix : {"_bucket", "_sum", "_count"})
      if (!types.count(family) && family.ends_with(suffix)) family = family.substr(0, family.size() - suffix.size());
    EXPECT_TRUE(types.count(family)) << "a sample without a TYPE: " << line;
    EXPECT_TRUE(samples.emplace(series, line.substr(space + 1)).second) << "a series twice: " << line;
  }
  return samples;
}

TEST(Histogram, BucketsAreCumulativeAndABoundaryValueCountsInItsBucket) {
  Histogram h({0.25, 1, 10});
  for (const double v : {0.125, 0.25, 0.5, 1.0, 3.0, 50.0}) h.observe(v);
  std::string out;
  h.render(out, "x");
  EXPECT_EQ(out,
            "x_bucket{le=\"0.25\"} 2\n"
            "x_bucket{le=\"1\"} 4\n"
            "x_bucket{le=\"10\"} 5\n"
            "x_bucket{le=\"+Inf\"} 6\n"
            "x_sum 54.875\n"
            "x_count 6\n");
}

TEST(Histogram, EmptyRendersZeros) {
  std::string out;
  Histogram({1}).render(out, "y");
  EXPECT_EQ(out, "y_bucket{le=\"1\"} 0\ny_bucket{le=\"+Inf\"} 0\ny_sum 0\ny_count 0\n");
}

TEST(Histogram, BoundsMustAscend) {
  EXPECT_THROW(Histogram({1, 0.5}), std::invalid_argument);
  EXPECT_THROW(Histogram({1, 1}), std::invalid_argument);
}

TEST(Metrics, RoutesAreTheServersOwnOrOther) {
  EXPECT_EQ(route_label("/v1/chat/completions"), "/v1/chat/completions");
  EXPECT_EQ(route_label("/v1/completions"), "/v1/completions");
  EXPECT_EQ(route_label("/v1/models"), "/v1/models");
  EXPECT_EQ(route_label("/v1/models/some-model"), "/v1/models");
  EXPECT_EQ(route_label("/health"), "/health");
  EXPECT_EQ(route_label("/metrics"), "/metrics");
  EXPECT_EQ(route_label("/v1/chat/completions/x"), "other");
  EXPECT_EQ(route_label("/"), "other");
  EXPECT_EQ(route_label(""), "other");
  EXPECT_EQ(route_label("/\xff\"{}"), "other");
}

TEST(Metrics, CountsResponsesAndCompletionsBySeries) {
  Metrics m;
  m.response("/v1/chat/completions", 200);
  m.response("/v1/chat/completions", 200);
  m.response("/v1/chat/completions", 400);
  m.response("/v1/models/x", 404);
  m.response("/anything", 404);
  m.response("/else", 404);
  m.completion("chat", "stop");
  m.completion("chat", "stop");
  m.completion("chat", "invalid");
  m.completion("completions", "length");
  const auto s = samples_of(m.render({}));
  EXPECT_EQ(s.at(R"(batchlm_http_responses_total{route="/v1/chat/completions",code="200"})"), "2");
  EXPECT_EQ(s.at(R"(batchlm_http_responses_total{route="/v1/chat/completions",code="400"})"), "1");
  EXPECT_EQ(s.at(R"(batchlm_http_responses_total{route="/v1/models",code="404"})"), "1");
  EXPECT_EQ(s.at(R"(batchlm_http_responses_total{route="other",code="404"})"), "2");
  EXPECT_EQ(s.at(R"(batchlm_completions_total{endpoint="chat",result="stop"})"), "2");
  EXPECT_EQ(s.at(R"(batchlm_completions_total{endpoint="chat",result="invalid"})"), "1");
  EXPECT_EQ(s.at(R"(batchlm_completions_total{endpoint="completions",result="length"})"), "1");
  EXPECT_EQ(s.at("batchlm_requests_in_flight"), "0");
}

TEST(Metrics, FinishedCompletionsFeedTheHistogramsAndTokenCounts) {
  Metrics m;
  Completion a;
  a.usage = Usage{100, 20, true};
  a.timings = Timings{.ttft_ms = 40, .tpot_ms = 5, .total_ms = 125};
  Completion b;  // one token: no time per output token
  b.usage = Usage{50, 1, true};
  b.timings = Timings{.ttft_ms = 30, .tpot_ms = 0, .total_ms = 62.5};
  m.finished(a);
  m.finished(b);
  const auto s = samples_of(m.render({}));
  EXPECT_EQ(s.at("batchlm_prompt_tokens_total"), "150");
  EXPECT_EQ(s.at("batchlm_completion_tokens_total"), "21");
  EXPECT_EQ(s.at("batchlm_request_duration_seconds_count"), "2");
  EXPECT_EQ(s.at(R"(batchlm_request_duration_seconds_bucket{le="0.1"})"), "1");
  EXPECT_EQ(s.at(R"(batchlm_request_duration_seconds_bucket{le="0.25"})"), "2");
  EXPECT_EQ(s.at("batchlm_request_duration_seconds_sum"), "0.1875");
  EXPECT_EQ(s.at(R"(batchlm_time_to_first_token_seconds_bucket{le="0.025"})"), "0");
  EXPECT_EQ(s.at(R"(batchlm_time_to_first_token_seconds_bucket{le="0.05"})"), "2");
  EXPECT_EQ(s.at("batchlm_time_per_output_token_seconds_count"), "1");
  EXPECT_EQ(s.at(R"(batchlm_time_per_output_token_seconds_bucket{le="0.005"})"), "1");

  // Several one-token choices: tokens, but no time per output token to record.
  Completion c;
  c.usage = Usage{10, 2, true};
  c.timings = Timings{.ttft_ms = 30, .tpot_ms = 0, .total_ms = 31};
  m.finished(c);
  const auto after = samples_of(m.render({}));
  EXPECT_EQ(after.at("batchlm_time_per_output_token_seconds_count"), "1");
  EXPECT_EQ(after.at("batchlm_request_duration_seconds_count"), "3");
}

TEST(Metrics, LabelValuesAreEscaped) {
  Metrics m;
  const auto s = samples_of(m.render({.model = "a\"b\\c\nd"}));
  EXPECT_EQ(s.at(R"(batchlm_info{model="a\"b\\c\nd"})"), "1");
}

TEST(Metrics, TheEngineSectionFollowsItsStats) {
  Metrics m;
  EXPECT_EQ(m.render({}).find("batchlm_engine_"), std::string::npos) << "no engine, no engine metrics";

  EngineStats e;
  e.running = 3;
  e.waiting = 2;
  e.preemptions = 1;
  e.prompt_tokens_computed = 500;
  e.prompt_tokens_cached = 1500;
  e.generated_tokens = 77;
  e.steps = 40;
  e.blocks_used = 12;
  e.blocks_total = 1024;
  e.block_size = 16;
  auto s = samples_of(m.render({.in_flight = 5, .connections = 6, .model = "m", .engine = e}));
  EXPECT_EQ(s.at("batchlm_requests_in_flight"), "5");
  EXPECT_EQ(s.at("batchlm_open_connections"), "6");
  EXPECT_EQ(s.at("batchlm_engine_running_sequences"), "3");
  EXPECT_EQ(s.at("batchlm_engine_waiting_sequences"), "2");
  EXPECT_EQ(s.at("batchlm_engine_preemptions_total"), "1");
  EXPECT_EQ(s.at("batchlm_engine_prompt_tokens_computed_total"), "500");
  EXPECT_EQ(s.at("batchlm_engine_prompt_tokens_cached_total"), "1500");
  EXPECT_EQ(s.at("batchlm_engine_generated_tokens_total"), "77");
  EXPECT_EQ(s.at("batchlm_engine_steps_total"), "40");
  EXPECT_EQ(s.at("batchlm_engine_kv_blocks_used"), "12");
  EXPECT_EQ(s.at("batchlm_engine_kv_blocks_total"), "1024");
  EXPECT_EQ(s.at("batchlm_engine_kv_block_size_tokens"), "16");
  EXPECT_EQ(s.count("batchlm_engine_draft_tokens_total"), 0u) << "no speculation, no draft counters";

  e.speculative = "ngram";
  e.drafted_tokens = 30;
  e.accepted_tokens = 18;
  e.decode_passes = 25;
  s = samples_of(m.render({.engine = e}));
  EXPECT_EQ(s.at(R"(batchlm_engine_speculative_info{method="ngram"})"), "1");
  EXPECT_EQ(s.at("batchlm_engine_draft_tokens_total"), "30");
  EXPECT_EQ(s.at("batchlm_engine_accepted_draft_tokens_total"), "18");
  EXPECT_EQ(s.at("batchlm_engine_decode_passes_total"), "25");
}

TEST(Metrics, StartTimeIsNow) {
  const auto before = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  Metrics m;
  const double start = std::stod(samples_of(m.render({})).at("batchlm_start_time_seconds"));
  EXPECT_GE(start, before - 1);
  EXPECT_LE(start, before + 60);
}

}  // namespace
}  // namespace batchlm::server
