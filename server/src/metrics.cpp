#include "batchlm/server/metrics.hpp"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <initializer_list>
#include <stdexcept>

namespace batchlm::server {

namespace {

// A sample value: integers as digits, others in the shortest form that reads back the same.
std::string number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

std::string number(std::int64_t v) { return std::to_string(v); }

// `name="value",...` with each value's backslashes, double quotes and line feeds escaped.
std::string labels(std::initializer_list<std::pair<std::string_view, std::string_view>> pairs) {
  std::string out;
  for (const auto& [name, value] : pairs) {
    if (!out.empty()) out += ',';
    out.append(name).append("=\"");
    for (const char ch : value) {
      if (ch == '\\') {
        out += "\\\\";
      } else if (ch == '"') {
        out += "\\\"";
      } else if (ch == '\n') {
        out += "\\n";
      } else {
        out += ch;
      }
    }
    out += '"';
  }
  return out;
}

void family(std::string& out, std::string_view name, std::string_view type, std::string_view help) {
  out.append("# HELP ").append(name).append(" ").append(help).append("\n");
  out.append("# TYPE ").append(name).append(" ").append(type).append("\n");
}

template <typename T>
void sample(std::string& out, std::string_view name, T value, std::string_view labels = {}) {
  out.append(name);
  if (!labels.empty()) out.append("{").append(labels).append("}");
  out.append(" ").append(number(value)).append("\n");
}

template <typename T>
void single(std::string& out, std::string_view name, std::string_view type, std::string_view help, T value) {
  family(out, name, type, help);
  sample(out, name, value);
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {
  if (!std::is_sorted(bounds_.begin(), bounds_.end()) ||
      std::adjacent_find(bounds_.begin(), bounds_.end()) != bounds_.end())
    throw std::invalid_argument("histogram bounds must ascend strictly");
}

void Histogram::observe(double value) {
  // Buckets are "less than or equal": the first bound not below the value.
  const auto at = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  ++counts_[static_cast<std::size_t>(at)];
  sum_ += value;
  ++count_;
}

void Histogram::render(std::string& out, std::string_view name) const {
  const std::string bucket = std::string(name) + "_bucket";
  std::int64_t cumulative = 0;
  for (std::size_t i = 0; i < counts_.size(); ++i) {
    cumulative += counts_[i];
    const std::string le = i < bounds_.size() ? number(bounds_[i]) : "+Inf";
    sample(out, bucket, cumulative, labels({{"le", le}}));
  }
  sample(out, std::string(name) + "_sum", sum_);
  sample(out, std::string(name) + "_count", count_);
}

std::string_view route_label(std::string_view path) {
  for (const std::string_view known : {"/health", "/metrics", "/v1/chat/completions", "/v1/completions", "/v1/models"})
    if (path == known) return known;
  if (path.starts_with("/v1/models/")) return "/v1/models";
  return "other";
}

Metrics::Metrics()
    : e2e_({0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300}),
      ttft_({0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      tpot_({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}),
      start_seconds_(unix_now()) {}

void Metrics::response(std::string_view path, int status) {
  ++responses_[{std::string(route_label(path)), status}];
}

void Metrics::completion(std::string_view endpoint, std::string_view result) {
  ++completions_[{std::string(endpoint), std::string(result)}];
}

void Metrics::finished(const Completion& c) {
  e2e_.observe(c.timings.total_ms / 1000.0);
  ttft_.observe(c.timings.ttft_ms / 1000.0);
  if (c.usage.completion_tokens > 1 && c.timings.tpot_ms > 0) tpot_.observe(c.timings.tpot_ms / 1000.0);
  prompt_tokens_ += c.usage.prompt_tokens;
  completion_tokens_ += c.usage.completion_tokens;
}

std::string Metrics::render(const Gauges& g) const {
  std::string out;
  family(out, "batchlm_info", "gauge", "The served model (always 1).");
  sample(out, "batchlm_info", std::int64_t{1}, labels({{"model", g.model}}));
  single(out, "batchlm_start_time_seconds", "gauge", "When the server started, in seconds since the Unix epoch.",
         start_seconds_);
  single(out, "batchlm_requests_in_flight", "gauge", "Completion choices being served, running or queued (a request with n choices counts n).",
         g.in_flight);
  single(out, "batchlm_open_connections", "gauge", "Open client connections.", g.connections);

  family(out, "batchlm_http_responses_total", "counter", "HTTP responses sent, by route and status code.");
  for (const auto& [key, n] : responses_)
    sample(out, "batchlm_http_responses_total", n,
           labels({{"route", key.first}, {"code", std::to_string(key.second)}}));

  family(out, "batchlm_completions_total", "counter",
         "Completion requests by endpoint and how they ended: the finish reason (stop, length) when they "
         "completed, else invalid (refused with a 4xx), rejected (429), error, disconnected (the client went away) or "
         "shutdown.");
  for (const auto& [key, n] : completions_)
    sample(out, "batchlm_completions_total", n, labels({{"endpoint", key.first}, {"result", key.second}}));

  family(out, "batchlm_request_duration_seconds", "histogram", "Time from a completed request's arrival to its last token.");
  e2e_.render(out, "batchlm_request_duration_seconds");
  family(out, "batchlm_time_to_first_token_seconds", "histogram",
         "Time from a completed request's arrival to its first output token.");
  ttft_.render(out, "batchlm_time_to_first_token_seconds");
  family(out, "batchlm_time_per_output_token_seconds", "histogram",
         "Mean time per output token after the first, per completed request of two or more tokens.");
  tpot_.render(out, "batchlm_time_per_output_token_seconds");
  single(out, "batchlm_prompt_tokens_total", "counter", "Prompt tokens of completed requests.", prompt_tokens_);
  single(out, "batchlm_completion_tokens_total", "counter", "Output tokens of completed requests.", completion_tokens_);

  if (g.engine) {
    const EngineStats& e = *g.engine;
    single(out, "batchlm_engine_running_sequences", "gauge", "Sequences being prefilled or decoded.", e.running);
    single(out, "batchlm_engine_waiting_sequences", "gauge", "Sequences waiting for admission, preempted ones included.",
           e.waiting);
    single(out, "batchlm_engine_preemptions_total", "counter",
           "Sequences preempted when KV blocks ran out (their blocks freed, recomputed later).", e.preemptions);
    single(out, "batchlm_engine_prompt_tokens_computed_total", "counter",
           "Prompt tokens run through the model (the first time).", e.prompt_tokens_computed);
    single(out, "batchlm_engine_recomputed_tokens_total", "counter",
           "Tokens run through the model again after their sequence was preempted.", e.recomputed_tokens);
    single(out, "batchlm_engine_prompt_tokens_cached_total", "counter", "Prompt tokens taken from the prefix cache.",
           e.prompt_tokens_cached);
    single(out, "batchlm_engine_generated_tokens_total", "counter", "Tokens the engine generated.", e.generated_tokens);
    single(out, "batchlm_engine_steps_total", "counter", "Batched forward passes.", e.steps);
    single(out, "batchlm_engine_kv_blocks_used", "gauge", "KV cache blocks held by sequences.", e.blocks_used);
    single(out, "batchlm_engine_kv_blocks_total", "gauge", "KV cache blocks in the pool.", e.blocks_total);
    single(out, "batchlm_engine_kv_block_size_tokens", "gauge", "Tokens per KV cache block.", e.block_size);
    if (!e.speculative.empty()) {
      family(out, "batchlm_engine_speculative_info", "gauge", "The speculative decoding method (always 1).");
      sample(out, "batchlm_engine_speculative_info", std::int64_t{1}, labels({{"method", e.speculative}}));
      single(out, "batchlm_engine_draft_tokens_total", "counter", "Draft tokens scored by the model.", e.drafted_tokens);
      single(out, "batchlm_engine_accepted_draft_tokens_total", "counter", "Draft tokens accepted.", e.accepted_tokens);
      single(out, "batchlm_engine_decode_passes_total", "counter",
             "Decoding sequence-steps (each yields its accepted drafts and one more token).", e.decode_passes);
    }
  }
  return out;
}

}  // namespace batchlm::server
