#pragma once
// What `batchlm serve` has done since it started, for GET /metrics in the Prometheus text
// format (version 0.0.4): HTTP responses by route and status, completion requests by how they
// ended, latency histograms, token counts, and the engine's counters (running and waiting
// sequences, preemptions, prefix-cache tokens, KV blocks, speculative drafts).
//
// Not thread-safe: the server records and renders on its one I/O thread.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "batchlm/core/types.hpp"

namespace batchlm::server {

// Observations counted into fixed buckets (upper bounds, ascending; +Inf is implied).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  // `name`_bucket{le=...} (cumulative), `name`_sum and `name`_count lines.
  void render(std::string& out, std::string_view name) const;

 private:
  std::vector<double> bounds_;
  std::vector<std::int64_t> counts_;  // per bucket, not cumulative; the last is +Inf
  double sum_ = 0;
  std::int64_t count_ = 0;
};

// The route a response is counted under: the server's own paths, "/v1/models" for a model by
// id, and "other" for anything else (so that clients cannot grow the label set).
std::string_view route_label(std::string_view path);

class Metrics {
 public:
  Metrics();

  // An HTTP response sent, by the request's path (counted as its status line is written,
  // whether or not the client still takes it).
  void response(std::string_view path, int status);
  // A completion request ended: `endpoint` "chat" or "completions"; `result` the finish reason
  // ("stop", "length") when it completed, else "invalid" (refused with a 4xx, by the server or
  // the engine), "rejected" (429), "error", "disconnected", "shutdown".
  void completion(std::string_view endpoint, std::string_view result);
  // A completion that finished: its latencies and tokens.
  void finished(const Completion& completion);

  struct Gauges {
    std::int64_t in_flight = 0;    // completion choices being served
    std::int64_t connections = 0;  // open client connections
    std::string model;             // the served model id
    std::optional<EngineStats> engine;
  };
  std::string render(const Gauges& gauges) const;

 private:
  std::map<std::pair<std::string, int>, std::int64_t> responses_;
  std::map<std::pair<std::string, std::string>, std::int64_t> completions_;
  Histogram e2e_;
  Histogram ttft_;
  Histogram tpot_;
  std::int64_t prompt_tokens_ = 0;
  std::int64_t completion_tokens_ = 0;
  double start_seconds_;  // Unix time the server started
};

}  // namespace batchlm::server
