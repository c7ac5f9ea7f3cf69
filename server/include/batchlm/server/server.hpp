#pragma once
// `batchlm serve`: an OpenAI-compatible HTTP/1.1 server (Boost.Beast) over a Backend — the
// embedded engine in practice. Every request becomes one Backend::complete() call, so the
// engine's continuous batching serves concurrent clients together.
//
//   GET  /health                 200 {"status": "ok", ...}; shutting down, the server accepts no
//                                connection and keeps none idle, so a probe sees it gone
//   GET  /metrics                counters, gauges and latency histograms, Prometheus text format
//   GET  /v1/models[/ID]         the served model
//   POST /v1/chat/completions    chat, streaming (SSE) or not
//   POST /v1/completions         raw text completion, streaming or not
//
// HEAD on the GET endpoints answers as GET without the body; OPTIONS * lists the methods and
// CONNECT gets 405 (no proxy). A browser's CORS preflight (OPTIONS)
// is answered for the allowed origins without the API key, and every response to such an origin
// says it may read it.
// A request may ask for n choices, each its own engine sequence.
// Errors are OpenAI error objects naming the bad field. Beyond max_in_flight choices a new one
// gets 429 with Retry-After. A client that goes away cancels its request, freeing its KV blocks;
// so does one that stops reading for write_timeout. Out of file descriptors, the connection idle
// the longest is closed to make room for a new one.
// shutdown() stops accepting, lets requests in flight finish for the grace period, then cancels
// the rest, answering each with a 503 error (an error event and [DONE] mid-stream).

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>

#include "batchlm/core/backend.hpp"

namespace batchlm::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  unsigned short port = 8000;      // 0: any free port (see Server::port())
  std::string model_name;          // the id in /v1/models and in responses
  std::int64_t context = 0;        // tokens per sequence, reported as max_model_len
  // A prompt of this many bytes or more cannot fit the context (0: not known). A request for
  // several choices with such a prompt is refused before its choices are made.
  std::size_t prompt_bytes_limit = 0;
  std::string api_key;             // non-empty: /v1/* requires "Authorization: Bearer KEY"
  // Origins whose web pages may call the server from a browser (CORS): "*" for any, else each
  // as the browser sends it ("http://localhost:3000"). Empty: no CORS headers, and OPTIONS is
  // answered like any other method the server does not serve.
  std::vector<std::string> allowed_origins = {"*"};
  int max_in_flight = 256;         // choices served at once (running and queued); then 429
  std::size_t max_body_bytes = 8u << 20;
  // Request bodies held at once, over every connection: those being received and those of
  // requests being served. A request whose body would go past it is refused with 503 and
  // Retry-After, so that many large uploads at once cannot exhaust the memory.
  std::size_t max_held_body_bytes = 256u << 20;
  std::chrono::milliseconds keep_alive{std::chrono::seconds(60)};  // idle connection timeout
  // From a request's first byte, the time to receive all of it; then the connection closes.
  std::chrono::milliseconds request_timeout{std::chrono::seconds(60)};
  std::chrono::milliseconds shutdown_grace{std::chrono::seconds(30)};
  // A write to a client that makes no progress this long (a client that stopped reading but
  // keeps its socket open) closes the connection and cancels its request.
  std::chrono::milliseconds write_timeout{std::chrono::seconds(30)};
};

class Server {
 public:
  // Binds and listens; throws std::runtime_error naming host:port when it cannot.
  Server(boost::asio::io_context& io, Backend& backend, ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  unsigned short port() const;  // the bound port
  void start();                 // starts accepting on the io_context
  // Graceful stop (idempotent); `done` runs on the io_context once every connection is closed.
  // A second call cuts the grace period short.
  void shutdown(std::function<void()> done = {});
  std::int64_t in_flight() const;  // choices being served (a request with n choices counts n)
  std::int64_t aborted() const;    // requests cancelled by shutdown() after the grace period

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace batchlm::server
