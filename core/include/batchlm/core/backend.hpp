#pragma once
// The one seam between the runner and whatever produces text. The runner calls complete()
// once per attempt; it owns retries, rate limits and concurrency, a backend owns none of them.

#include <optional>
#include <string>

#include <boost/asio/awaitable.hpp>

#include "batchlm/core/types.hpp"

namespace batchlm {

class Backend {
 public:
  virtual ~Backend() = default;

  // One attempt. Never throws for request-level failures: they come back as Outcome::error.
  // Honours Asio per-operation cancellation (the runner cancels on a hard stop); a cancelled
  // attempt returns ErrorKind::Cancelled.
  virtual boost::asio::awaitable<Outcome> complete(const Request& request, TokenSink sink) = 0;

  // A short description for logs and the summary: "openai http://127.0.0.1:8000/v1".
  virtual std::string describe() const = 0;

  // A snapshot of the engine's state, for backends that run one; callable from any thread.
  virtual std::optional<EngineStats> engine_stats() const { return std::nullopt; }

  // The tokens a request's prompt and output may hold together, where the backend has such a
  // context of its own (the embedded engine); 0 where it does not say.
  virtual std::int64_t context() const { return 0; }
};

}  // namespace batchlm
