#pragma once
// The embedded engine behind the Backend seam. The model runs on the engine's own thread with
// continuous batching (all requests in flight share each forward pass, their prompts' common
// prefixes share cache blocks); complete() queues the request and awaits its text through an
// Asio channel, so the runner cannot tell it from a remote API.

#include <filesystem>
#include <memory>
#include <string>

#include <boost/asio/any_io_executor.hpp>

#include "batchlm/core/backend.hpp"

namespace batchlm::local_engine {

struct LocalBackendOptions {
  std::filesystem::path model;  // a GGUF file
  int threads = 0;              // compute threads; 0: one per hardware thread
  std::int64_t context = 0;     // tokens per sequence; 0: min(training context, 4096)
  int max_sequences = 32;       // sequences decoded together (continuous batching)
};

class LocalBackend final : public Backend {
 public:
  // Loads the model (throws gguf::Error naming the file and the problem) and starts the
  // engine thread.
  LocalBackend(boost::asio::any_io_executor executor, const LocalBackendOptions& options);
  ~LocalBackend() override;

  boost::asio::awaitable<Outcome> complete(const Request& request, TokenSink sink) override;
  std::string describe() const override;

 private:
  struct State;
  boost::asio::any_io_executor executor_;
  std::shared_ptr<State> state_;
};

}  // namespace batchlm::local_engine
