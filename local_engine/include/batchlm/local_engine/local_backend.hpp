#pragma once
// The embedded engine behind the Backend seam. The model runs on the engine's own thread with
// continuous batching (all requests in flight share each forward pass, their prompts' common
// prefixes share cache blocks); complete() queues the request and awaits its text through an
// Asio channel, so the runner cannot tell it from a remote API.

#include <filesystem>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <boost/asio/any_io_executor.hpp>

#include "batchlm/core/backend.hpp"

namespace batchlm::local_engine {

struct LocalBackendOptions {
  std::filesystem::path model;  // a GGUF file
  int threads = 0;              // compute threads; 0: one per hardware thread
  std::int64_t context = 0;     // tokens per sequence; 0: min(training context, 4096)
  int max_sequences = 32;       // sequences decoded together (continuous batching)
  std::int64_t token_budget = 0;  // tokens in one batched forward pass; 0: the model's maximum
                                  // (512); at least max_sequences
  int block_size = 16;          // tokens per KV block
  // The KV pool: kv_tokens if set, else kv_bytes if set, else enough for max_sequences full
  // contexts but at most a quarter of the memory available now. Never less than one context.
  std::int64_t kv_tokens = 0;
  std::int64_t kv_bytes = 0;
};

// The pool size in tokens those options give for a model with `bytes_per_token` of keys and
// values (all layers); `available_bytes` is the memory free now. Throws std::invalid_argument
// when the options are out of range (the message names the option).
std::int64_t kv_pool_tokens(const LocalBackendOptions& options, std::int64_t context,
                            std::int64_t bytes_per_token, std::int64_t available_bytes);
// MemAvailable from /proc/meminfo (0 when unknown).
std::int64_t available_memory_bytes();

class LocalBackend final : public Backend {
 public:
  // Loads the model (throws gguf::Error naming the file and the problem) and starts the
  // engine thread.
  LocalBackend(boost::asio::any_io_executor executor, const LocalBackendOptions& options);
  ~LocalBackend() override;

  boost::asio::awaitable<Outcome> complete(const Request& request, TokenSink sink) override;
  std::string describe() const override;
  std::optional<EngineStats> engine_stats() const override;

  // The model's id for APIs (the file name without .gguf) and the context per sequence.
  std::string model_name() const;
  std::int64_t context() const;

 private:
  struct State;
  boost::asio::any_io_executor executor_;
  std::shared_ptr<State> state_;
};

}  // namespace batchlm::local_engine
