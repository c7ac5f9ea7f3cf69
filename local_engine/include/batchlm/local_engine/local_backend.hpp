#pragma once
// The embedded engine behind the Backend seam. The model runs on the engine's own thread with
// continuous batching (all requests in flight share each forward pass, their prompts' common
// prefixes share cache blocks); a second thread renders and tokenizes each prompt before it
// joins the engine's queue. complete() hands the request over and awaits its text through an
// Asio channel, so the runner cannot tell it from a remote API, and the caller's thread never
// does the model's work.

#include <filesystem>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <boost/asio/any_io_executor.hpp>

#include "batchlm/core/backend.hpp"
#include "batchlm/local_engine/batch_engine.hpp"

namespace batchlm::local_engine {

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
  std::int64_t context() const override;
  std::int64_t vocab_size() const;  // token ids are below it
  // Why this model cannot take tools or a conversation's calls and results (its chat template
  // does not list tools), or nullopt when it can.
  std::optional<std::string> tools_problem() const;
  // Whether the engine samples on a GPU (BatchEngine::samples_on_device).
  bool samples_on_device() const;
  // The KV pool's bytes, and the memory available at start where the pool was set larger than
  // it (on the CPU), else 0.
  std::int64_t pool_bytes() const;
  std::int64_t pool_past_memory() const;
  // A prompt of this many bytes or more cannot fit the context whatever its tokens (no token
  // stands for more bytes than the longest in the vocabulary); complete() refuses it at once.
  std::size_t prompt_bytes_limit() const;

 private:
  struct State;
  boost::asio::any_io_executor executor_;
  std::shared_ptr<State> state_;
};

}  // namespace batchlm::local_engine
