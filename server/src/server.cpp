#include "batchlm/server/server.hpp"

#include <algorithm>
#include <chrono>
#include <exception>
#include <list>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <variant>
#include <vector>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/deferred.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/experimental/parallel_group.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/buffers_suffix.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/chunk_encode.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/write.hpp>

#include "batchlm/server/metrics.hpp"
#include "batchlm/server/openai_api.hpp"

namespace batchlm::server {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using nlohmann::json;
using namespace asio::experimental::awaitable_operators;

namespace {

constexpr auto use_tuple = asio::as_tuple(asio::use_awaitable);
using HttpRequest = http::request<http::string_body>;
using Header = std::optional<std::pair<http::field, std::string>>;

std::int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string sse(const json& data) { return "data: " + data.dump() + "\n\n"; }

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The request's path, percent-decoded: its target without the query, and without the scheme and
// authority of an absolute-form target ("http://host:port/v1/models", as proxies send it, RFC
// 9112 3.2.2). Nothing when an escape is malformed or encodes '/', which would route the path
// differently decoded than the client split it.
std::optional<std::string> path_of(const HttpRequest& req) {
  std::string_view target(req.target().data(), req.target().size());
  if (!target.starts_with('/')) {
    if (const std::size_t scheme_end = target.find("://"); scheme_end != std::string_view::npos) {
      const std::size_t path_start = target.find_first_of("/?", scheme_end + 3);
      target = path_start == std::string_view::npos ? "/" : target.substr(path_start);
      if (target.starts_with('?')) target = "/";
    }
  }
  target = target.substr(0, target.find('?'));
  std::string path;
  path.reserve(target.size());
  for (std::size_t i = 0; i < target.size(); ++i) {
    if (target[i] != '%') {
      path.push_back(target[i]);
      continue;
    }
    const int high = i + 2 < target.size() ? hex_digit(target[i + 1]) : -1;
    const int low = high >= 0 ? hex_digit(target[i + 2]) : -1;
    // An encoded '/' is refused where it would change which endpoint is meant, and taken in a
    // model's id: a client sends "org/name" as org%2Fname there.
    if (low < 0 || ((high << 4 | low) == '/' && !path.starts_with("/v1/models/"))) return std::nullopt;
    path.push_back(static_cast<char>(high << 4 | low));
    i += 2;
  }
  return path;
}

// Compares without an early exit, so the time taken says nothing about the key.
bool same_secret(std::string_view given, std::string_view key) {
  if (key.empty()) return false;
  std::size_t diff = given.size() ^ key.size();
  for (std::size_t i = 0; i < given.size(); ++i)
    diff |= static_cast<unsigned char>(given[i] ^ key[i % key.size()]);
  return diff == 0;
}

}  // namespace

struct Server::Impl : std::enable_shared_from_this<Impl> {
  asio::io_context& io;
  Backend& backend;
  ServerOptions options;
  tcp::acceptor acceptor;
  std::int64_t created = unix_seconds();
  std::int64_t in_flight = 0;
  bool draining = false;
  std::function<void()> on_drained;
  asio::steady_timer grace;

  struct Connection {
    explicit Connection(tcp::socket socket) : stream(std::move(socket)), abort(stream.get_executor()) {
      abort.expires_at(asio::steady_timer::time_point::max());
    }
    beast::tcp_stream stream;
    beast::flat_buffer buffer;
    bool busy = false;
    bool receiving = false;  // part of a request has arrived, not yet all of it
    bool refusing = false;   // answering a request with an error, then draining what it still sends
    // Cancelled when the server stops waiting for this connection's request (shutdown grace
    // over): the request is cancelled and the client told why.
    asio::steady_timer abort;
    bool aborted = false;
  };
  std::int64_t aborted_requests = 0;
  std::size_t held_body_bytes = 0;  // bodies received or being received, all connections
  // A request's share of held_body_bytes, given back when it is done with.
  struct HeldBody {
    std::size_t& total;
    std::size_t bytes = 0;
    void grow_to(std::size_t n) {
      total += n - bytes;
      bytes = n;
    }
    ~HeldBody() { total -= bytes; }
  };
  std::list<Connection*> connections;
  Metrics metrics;
  // Large bodies are read into requests here, off the thread that serves every connection: the
  // largest (8 MB) take a few hundred milliseconds, a pause in every stream.
  asio::thread_pool parsing{1};
  static constexpr std::size_t kParsedAside = 64 << 10;

  Impl(asio::io_context& io_, Backend& backend_, ServerOptions options_)
      : io(io_), backend(backend_), options(std::move(options_)), acceptor(io_), grace(io_) {}

  // --- responses ---------------------------------------------------------------------------

  asio::awaitable<void> send(Connection& c, const HttpRequest& req, http::status status,
                             const json& body,
                             Header header = std::nullopt) {
    // Messages may quote the request (its path): bytes that are not UTF-8 there become U+FFFD
    // rather than an exception that would close the connection unanswered.
    co_await send_text(c, req, status, body.dump(-1, ' ', false, json::error_handler_t::replace),
                       "application/json", std::move(header));
  }

  asio::awaitable<void> send_text(Connection& c, const HttpRequest& req, http::status status, std::string body,
                                  std::string_view content_type, Header header = std::nullopt) {
    http::response<http::string_body> res{status, req.version()};
    res.set(http::field::server, "batchlm");
    res.set(http::field::content_type, content_type);
    if (header) res.set(header->first, header->second);
    allow_origin(req, res);
    res.keep_alive(req.keep_alive() && !draining);
    res.body() = std::move(body);
    res.prepare_payload();
    metrics.response(path_of(req).value_or(""), static_cast<int>(status));
    c.stream.expires_after(options.write_timeout);
    if (req.method() == http::verb::head) {
      // The header GET gets, its Content-Length included, without the body (RFC 9110 9.3.2).
      http::response_serializer<http::string_body> sr{res};
      co_await http::async_write_header(c.stream, sr, asio::use_awaitable);
    } else {
      co_await http::async_write(c.stream, res, asio::use_awaitable);
    }
  }

  // --- CORS ----------------------------------------------------------------------------------

  // What Access-Control-Allow-Origin says to a request from this Origin: "*" when every origin
  // is allowed, the origin itself when it is one of those allowed, else nothing (no CORS header;
  // a browser then keeps the response from the page).
  std::optional<std::string> allowed_origin(const HttpRequest& req) const {
    const auto origin = req.find(http::field::origin);
    if (origin == req.end()) return std::nullopt;
    const std::string_view value(origin->value().data(), origin->value().size());
    for (const std::string& allowed : options.allowed_origins)
      if (allowed == "*" || allowed == value) return allowed;
    return std::nullopt;
  }

  // Lets the page of an allowed origin read the response; a response that names the origin
  // varies with it, which caches must know.
  void allow_origin(const HttpRequest& req, http::fields& res) const {
    const std::optional<std::string> origin = allowed_origin(req);
    if (!origin) return;
    res.set(http::field::access_control_allow_origin, *origin);
    if (*origin != "*") res.set(http::field::vary, "Origin");
  }

  // A browser's preflight (OPTIONS with Origin and Access-Control-Request-Method): whether its
  // page may send the request it describes. Answered before the API key is checked, as browsers
  // send no credentials with it.
  asio::awaitable<void> preflight(Connection& c, const HttpRequest& req) {
    if (!allowed_origin(req)) {
      const auto origin = req.find(http::field::origin);
      co_await send_error(c, req,
                          ApiError(403, "invalid_request_error", "",
                                   "the origin '" + std::string(origin->value()) +
                                       "' may not call this server (see batchlm serve --allowed-origins)"));
      co_return;
    }
    http::response<http::empty_body> res{http::status::no_content, req.version()};
    res.set(http::field::server, "batchlm");
    allow_origin(req, res);
    res.set(http::field::access_control_allow_methods, kMethods);
    std::string headers = "Authorization, Content-Type";
    if (const auto asked = req.find(http::field::access_control_request_headers); asked != req.end())
      headers += ", " + std::string(asked->value());
    res.set(http::field::access_control_allow_headers, headers);
    res.set(http::field::access_control_max_age, "600");
    res.keep_alive(req.keep_alive() && !draining);
    metrics.response(path_of(req).value_or(""), 204);
    c.stream.expires_after(options.write_timeout);
    co_await http::async_write(c.stream, res, asio::use_awaitable);
  }

  // Writes all of `buffers`, each write given write_timeout to make progress; on a timeout the
  // stream closes the socket. Without it a client that stops reading, its socket open, would hold
  // its request, its engine sequence and the connection for ever.
  template <typename Buffers>
  asio::awaitable<boost::system::error_code> write_all(Connection& c, const Buffers& buffers) {
    beast::buffers_suffix<Buffers> rest(buffers);
    while (beast::buffer_bytes(rest) > 0) {
      c.stream.expires_after(options.write_timeout);
      auto [ec, n] = co_await c.stream.async_write_some(rest, use_tuple);
      if (ec) co_return ec;
      rest.consume(n);
    }
    co_return boost::system::error_code{};
  }

  asio::awaitable<void> send_error(Connection& c, const HttpRequest& req, const ApiError& e,
                                   Header header = std::nullopt) {
    co_await send(c, req, static_cast<http::status>(e.status()), e.body(), header);
  }

  json model_json() const {
    json m = {{"id", options.model_name}, {"object", "model"}, {"created", created}, {"owned_by", "batchlm"}};
    if (options.context > 0) m["max_model_len"] = options.context;
    return m;
  }

  // Completes when the peer closes or breaks the connection. Bytes it sends meanwhile (a
  // pipelined request) are kept in the buffer for the next read, up to kReadAhead: beyond that
  // they wait in the socket and the client's sends block, so a client sending ahead of its answer
  // cannot grow the server's memory. A hang-up is then noticed when the answer is written (an
  // error, or the write timeout).
  static constexpr std::size_t kReadAhead = 64 * 1024;
  static asio::awaitable<void> watch_peer(Connection& c) {
    while (c.buffer.size() < kReadAhead) {
      auto [ec, n] = co_await c.stream.socket().async_read_some(c.buffer.prepare(4096), use_tuple);
      if (ec) co_return;
      c.buffer.commit(n);
    }
    // Until the race this is part of ends: a timer that never expires.
    asio::steady_timer never(c.stream.get_executor(), asio::steady_timer::time_point::max());
    co_await never.async_wait(use_tuple);
  }

  // Completes when the server gives up on the connection's request (abort_all cancels the
  // timer, which never expires), or when the race it is part of is cancelled.
  static asio::awaitable<void> wait_abort(Connection& c) {
    if (!c.aborted) co_await c.abort.async_wait(use_tuple);
  }

  // The methods the server answers (Allow, CORS, the 501's message).
  static constexpr const char* kMethods = "GET, HEAD, POST, OPTIONS";

  // Why abort_all cancelled a request: the grace period ended, or a second signal came.
  std::string abort_reason = "its grace period for requests in flight ended";
  // What a request cancelled by the shutdown is told: to try again in a second, when a
  // restarted server (or another behind the same address) may take it.
  static inline const Header kRetrySoon = std::pair(http::field::retry_after, std::string("1"));
  ApiError shutting_down() const {
    return ApiError(503, "server_error", "",
                    "the server is shutting down and " + abort_reason +
                        "; the request was cancelled, retry it against a running server",
                    "server_shutting_down");
  }

  // --- completions ------------------------------------------------------------------------

  // --- several choices (n) ------------------------------------------------------------------

  // The backend request of each choice: the first as asked, the others with the seeds after the
  // asked one, so that seeded choices differ from each other and repeat from run to run.
  static std::vector<Request> choice_requests(const ApiRequest& api) {
    std::vector<Request> requests(static_cast<std::size_t>(api.n), api.request);
    for (std::size_t i = 1; i < requests.size(); ++i)
      if (requests[i].seed)
        requests[i].seed = static_cast<std::int64_t>(static_cast<std::uint64_t>(*requests[i].seed) + i);
    return requests;
  }

  // Runs the choices together and completes when every one has. The first to fail cancels the
  // rest (they would fail alike, or be thrown away), and so does cancelling this; one that throws
  // counts as failed.
  static asio::awaitable<std::vector<Outcome>> all_of(std::vector<asio::awaitable<Outcome>> tasks) {
    auto ex = co_await asio::this_coro::executor;
    using Op = decltype(asio::co_spawn(ex, std::move(tasks.front()), asio::deferred));
    std::vector<Op> ops;
    for (auto& task : tasks) ops.push_back(asio::co_spawn(ex, std::move(task), asio::deferred));
    const auto stop_on_failure = [](const std::exception_ptr& e, const Outcome& o) {
      return e || !o.ok() ? asio::cancellation_type::all : asio::cancellation_type::none;
    };
    auto [order, errors, results] = co_await asio::experimental::make_parallel_group(std::move(ops))
                                        .async_wait(stop_on_failure, asio::use_awaitable);
    for (std::size_t i = 0; i < errors.size(); ++i) {
      if (!errors[i]) continue;
      std::string what = "unknown error";
      try {
        std::rethrow_exception(errors[i]);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      results[i] = Outcome::failure(Error{ErrorKind::Internal, 0, "", "server: " + what, std::nullopt, false});
    }
    co_return std::move(results);
  }

  // One outcome for a request's choices: the first failure (one that is not a cancellation
  // first), else a completion whose usage covers every choice, whose times run from the first
  // token of any choice to the last of all (the time per output token: the mean over choices of
  // two tokens or more), and whose finish reason is "length" if any choice was cut short.
  static Outcome combined(const std::vector<Outcome>& outcomes) {
    const Outcome* cancelled = nullptr;
    std::vector<Completion> done;
    for (const Outcome& o : outcomes) {
      if (o.ok()) {
        done.push_back(*o.completion);
      } else if (o.error->kind != ErrorKind::Cancelled) {
        return o;
      } else if (!cancelled) {
        cancelled = &o;
      }
    }
    if (cancelled) return *cancelled;
    if (done.size() == 1) return outcomes.front();
    Completion all = done.front();
    all.usage = total_usage(done);
    double tpot = 0;
    int timed = 0;  // choices of two tokens or more, which have a time per output token
    for (const Completion& c : done) {
      all.timings.ttft_ms = std::min(all.timings.ttft_ms, c.timings.ttft_ms);
      all.timings.total_ms = std::max(all.timings.total_ms, c.timings.total_ms);
      if (c.usage.completion_tokens > 1) {
        tpot += c.timings.tpot_ms;
        ++timed;
      }
      if (c.finish_reason == "length") all.finish_reason = "length";
    }
    all.timings.tpot_ms = timed > 0 ? tpot / timed : 0;
    return Outcome::success(std::move(all));
  }

  // A streamed response: SSE bytes the engine's tokens produced, written by one writer.
  struct Stream {
    explicit Stream(asio::any_io_executor ex) : wake(ex) {}
    std::string pending;
    bool started = false;  // headers written
    bool done = false;
    std::optional<ApiError> error;  // failed before any output: a plain error response
    std::vector<Outcome> outcomes;  // the engine's, one per choice, once all have ended
    asio::steady_timer wake;
  };

  // One choice of a streamed response: its text chunks as the engine gives them, then the
  // chunk that ends it.
  asio::awaitable<Outcome> produce_choice(Stream& s, const ApiRequest& api, const Request& request,
                                          const ResponseContext& ctx, int index) {
    bool first = true;
    std::int64_t text_offset = ctx.prompt_chars;
    Outcome o = co_await complete_one(request, [&](std::string_view delta, std::span<const TokenLogprob> logprobs,
                                                       TextPart part) {
      json lp = api.logprobs ? choice_logprobs(ctx.endpoint, logprobs, text_offset) : json(nullptr);
      s.pending += sse(text_chunk(ctx, delta, first, api.include_usage, index, std::move(lp), part));
      first = false;
      s.wake.cancel();
    });
    if (o.ok()) {
      // The calls, whole, once the answer is (the engine held their text back).
      if (!o.completion->tool_calls.is_null() && ctx.endpoint == Endpoint::kChat) {
        s.pending += sse(tool_calls_chunk(ctx, o.completion->tool_calls, first, api.include_usage, index));
        first = false;
      }
      // A chat choice with no text (a stop string at its very start) still says its role first.
      if (first && ctx.endpoint == Endpoint::kChat) s.pending += sse(text_chunk(ctx, "", true, api.include_usage, index));
      s.pending += sse(finish_chunk(ctx, o.completion->finish_reason, api.include_usage, index));
      s.wake.cancel();
    }
    co_return o;
  }

  asio::awaitable<void> produce(Stream& s, const ApiRequest& api, const ResponseContext& ctx) {
    const std::vector<Request> requests = choice_requests(api);
    if (requests.size() == 1) {
      s.outcomes.push_back(co_await produce_choice(s, api, requests.front(), ctx, 0));
    } else {
      std::vector<asio::awaitable<Outcome>> choices;
      for (std::size_t i = 0; i < requests.size(); ++i)
        choices.push_back(produce_choice(s, api, requests[i], ctx, static_cast<int>(i)));
      s.outcomes = co_await all_of(std::move(choices));
    }
    const Outcome o = combined(s.outcomes);
    if (o.ok()) {
      if (api.include_usage) s.pending += sse(usage_chunk(ctx, o.completion->usage));
      s.pending += "data: [DONE]\n\n";
    } else if (o.error->kind != ErrorKind::Cancelled) {
      ApiError e = error_from_outcome(*o.error, api.endpoint, api.max_tokens_param);
      if (!s.started && s.pending.empty()) {
        s.error = std::move(e);
      } else {
        // As at shutdown: the error event, then [DONE], which a reader of the raw events waits for.
        s.pending += sse(e.body());
        s.pending += "data: [DONE]\n\n";
      }
    }
    s.done = true;
    s.wake.cancel();
  }

  // A stream's status line and headers go out with its first event, or once kStreamStart has
  // passed without one (a long prompt, requests queued ahead): a client or proxy then sees the
  // answer begun rather than a silent connection for as long as the first token takes. An error
  // the engine gives before then is still a plain error response, with its status. While no
  // event comes, a comment every kKeepAlive keeps proxies from closing an idle stream.
  static constexpr std::chrono::milliseconds kStreamStart{1000};
  static constexpr std::chrono::seconds kKeepAlive{15};

  // Writes `out` to the stream, the status and headers first if they have not gone.
  asio::awaitable<void> write_events(Connection& c, const HttpRequest& req, Stream& s, std::string out) {
    boost::system::error_code ec;
    // HTTP/1.1: chunked, the connection stays open; HTTP/1.0: the events as they are, and the
    // end of the connection ends the stream.
    const bool chunked = req.version() >= 11;
    if (!s.started) {
      s.started = true;
      http::response<http::empty_body> res{http::status::ok, req.version()};
      res.set(http::field::server, "batchlm");
      res.set(http::field::content_type, "text/event-stream");
      res.set(http::field::cache_control, "no-cache");
      allow_origin(req, res);
      res.keep_alive(chunked && req.keep_alive() && !draining);
      res.chunked(chunked);
      metrics.response(path_of(req).value_or(""), 200);
      http::response_serializer<http::empty_body> sr{res};
      c.stream.expires_after(options.write_timeout);
      std::tie(ec, std::ignore) = co_await http::async_write_header(c.stream, sr, use_tuple);
    }
    if (!ec && !out.empty() && chunked) {
      ec = co_await write_all(c, http::make_chunk(asio::buffer(out)));
    } else if (!ec && !out.empty()) {
      ec = co_await write_all(c, asio::buffer(out));
    }
    if (ec) {
      // The client went away: closing ends watch_peer, which cancels the request.
      c.stream.socket().close(ec);
      throw boost::system::system_error(asio::error::connection_aborted);
    }
  }

  asio::awaitable<void> write_stream(Connection& c, const HttpRequest& req, Stream& s) {
    for (;;) {
      if (!s.pending.empty()) {
        std::string out;
        out.swap(s.pending);
        co_await write_events(c, req, s, std::move(out));
        continue;
      }
      if (s.done) break;
      // Woken early by cancel() when there is more; a real cancellation throws.
      if (s.started) {
        s.wake.expires_after(kKeepAlive);
      } else {
        s.wake.expires_after(kStreamStart);
      }
      const auto [ec] = co_await s.wake.async_wait(use_tuple);
      if (!ec && s.pending.empty() && !s.done) co_await write_events(c, req, s, s.started ? ": keep-alive\n\n" : "");
    }
    if (s.started && req.version() >= 11) {
      if (const auto ec = co_await write_all(c, http::make_chunk_last())) throw boost::system::system_error(ec);
    }
  }

  // One choice, as the backend gives it. What it throws comes back as an error Outcome: the
  // awaitable operators the handlers wait with (||: the first to succeed) would otherwise wait
  // on past a thrown error, for the client to give up.
  asio::awaitable<Outcome> complete_one(const Request& request, TokenSink sink) {
    try {
      co_return co_await backend.complete(request, std::move(sink));
    } catch (const boost::system::system_error& e) {
      co_return Outcome::failure(
          Error{e.code() == asio::error::operation_aborted ? ErrorKind::Cancelled : ErrorKind::Internal, 0, "", e.what()});
    } catch (const std::exception& e) {
      co_return Outcome::failure(Error{ErrorKind::Internal, 0, "", e.what()});
    }
  }

  // Every choice of a request that is not streamed.
  asio::awaitable<std::vector<Outcome>> complete_whole(const ApiRequest& api) {
    const std::vector<Request> requests = choice_requests(api);
    std::vector<Outcome> outcomes;
    if (requests.size() == 1) {
      outcomes.push_back(co_await complete_one(requests.front(), {}));
      co_return outcomes;
    }
    std::vector<asio::awaitable<Outcome>> choices;
    for (const Request& r : requests) choices.push_back(complete_one(r, {}));
    co_return co_await all_of(std::move(choices));
  }

  // Counts how a completion request the engine ran ended.
  void count(Endpoint endpoint, const Outcome& o) {
    if (o.ok()) {
      metrics.completion(label(endpoint), o.completion->finish_reason);
      metrics.finished(*o.completion);
    } else {
      const bool refused = o.error->kind == ErrorKind::Http && o.error->http_status >= 400 && o.error->http_status < 500;
      metrics.completion(label(endpoint), o.error->kind == ErrorKind::Cancelled ? "disconnected"
                                          : refused                            ? "invalid"
                                                                               : "error");
    }
  }
  static std::string_view label(Endpoint endpoint) { return endpoint == Endpoint::kChat ? "chat" : "completions"; }

  // Returns false when the connection must close.
  asio::awaitable<bool> completion(Connection& c, const HttpRequest& req, Endpoint endpoint) {
    if (req.method() != http::verb::post) {
      co_await send_error(c, req, ApiError(405, "invalid_request_error", "", "use POST for this endpoint"),
                          std::pair(http::field::allow, std::string("POST")));
      co_return true;
    }
    // A compressed body is refused by name (RFC 9110 8.4: 415); it would read as bad JSON.
    // Every Content-Encoding field counts: "identity" and an empty value are no coding.
    const auto [first, last] = req.equal_range(http::field::content_encoding);
    const auto coding = std::find_if(first, last, [](const auto& f) {
      return !f.value().empty() && !beast::iequals(f.value(), "identity");
    });
    if (coding != last) {
      const std::string_view value = coding->value();
      metrics.completion(label(endpoint), "invalid");
      co_await send_error(c, req,
                          ApiError(415, "invalid_request_error", "",
                                   "the body's Content-Encoding '" + utf8_excerpt(value, 40) +
                                       "' is not supported: send it uncompressed"),
                          std::pair(http::field::accept_encoding, std::string("identity")));
      co_return true;
    }
    std::optional<ApiRequest> parsed;
    std::optional<ApiError> invalid;
    try {
      if (req.body().size() < kParsedAside) {
        parsed = parse_request_body(endpoint, req.body(), options.model_name);
      } else {
        // The session waits for it (a cancellation does not end the wait), so req outlives it.
        parsed = co_await asio::co_spawn(
            parsing,
            [&]() -> asio::awaitable<ApiRequest> { co_return parse_request_body(endpoint, req.body(), options.model_name); },
            asio::use_awaitable);
      }
    } catch (const ApiError& e) {
      invalid = e;
    }
    if (invalid) {
      metrics.completion(label(endpoint), "invalid");
      co_await send_error(c, req, *invalid);
      co_return true;
    }
    if (parsed->n > options.max_in_flight) {
      metrics.completion(label(endpoint), "invalid");
      co_await send_error(c, req,
                          ApiError(400, "invalid_request_error", "n",
                                   "'n' is " + std::to_string(parsed->n) + ", more choices than this server serves at once (" +
                                       std::to_string(options.max_in_flight) + ")"));
      co_return true;
    }
    if (parsed->n > 1 && options.prompt_bytes_limit > 0) {
      // Checked once here rather than by each choice: the request is copied for every choice.
      const std::size_t bytes = parsed->request.text_bytes();
      if (bytes >= options.prompt_bytes_limit) {
        metrics.completion(label(endpoint), "invalid");
        co_await send_error(c, req,
                            ApiError(400, "invalid_request_error", prompt_param(endpoint),
                                     "the prompt (" + std::to_string(bytes) + " bytes) cannot fit the context of " +
                                         std::to_string(options.context) + " tokens",
                                     "context_length_exceeded"));
        co_return true;
      }
    }
    if (in_flight + parsed->n > options.max_in_flight) {
      metrics.completion(label(endpoint), "rejected");
      co_await send_error(c, req,
                          ApiError(429, "rate_limit_error", "",
                                   "the server is at capacity (" + std::to_string(in_flight) +
                                       " choices in flight); retry after 1 s",
                                   "rate_limit_exceeded"),
                          std::pair(http::field::retry_after, std::string("1")));
      co_return true;
    }
    in_flight += parsed->n;
    struct Release {
      std::int64_t& in_flight;
      int n;
      ~Release() { in_flight -= n; }
    } release{in_flight, parsed->n};

    const ResponseContext ctx{endpoint, new_response_id(endpoint), unix_seconds(), options.model_name,
                              parsed->request.prompt ? utf8_chars(*parsed->request.prompt) : 0};
    if (!parsed->stream) {
      auto result = co_await (complete_whole(*parsed) || watch_peer(c) || wait_abort(c));
      if (result.index() == 2) {
        metrics.completion(label(endpoint), "shutdown");
        co_await send_error(c, req, shutting_down(), kRetrySoon);
        co_return false;
      }
      if (result.index() != 0) {  // the client went away; the request is cancelled
        metrics.completion(label(endpoint), "disconnected");
        co_return false;
      }
      const std::vector<Outcome>& outcomes = std::get<0>(result);
      const Outcome o = combined(outcomes);
      count(endpoint, o);
      if (!o.ok()) {
        if (o.error->kind == ErrorKind::Cancelled) co_return false;
        co_await send_error(c, req, error_from_outcome(*o.error, endpoint, parsed->max_tokens_param));
        co_return true;
      }
      std::vector<Completion> choices;
      for (const Outcome& one : outcomes) choices.push_back(*one.completion);
      co_await send(c, req, http::status::ok, completion_body(ctx, choices));
      co_return true;
    }

    Stream s(co_await asio::this_coro::executor);
    bool counted = false;  // the request's result is in the metrics
    try {
      auto result = co_await ((produce(s, *parsed, ctx) && write_stream(c, req, s)) || watch_peer(c) ||
                              wait_abort(c));
      if (result.index() == 2) {
        metrics.completion(label(endpoint), "shutdown");
        counted = true;
        if (!s.started) {
          co_await send_error(c, req, shutting_down(), kRetrySoon);
          co_return false;
        }
        // Mid-stream: what the engine gave, then the error as an event and the end of the stream.
        std::string out;
        out.swap(s.pending);
        out += sse(shutting_down().body());
        out += "data: [DONE]\n\n";
        if (req.version() >= 11) {
          if (!(co_await write_all(c, http::make_chunk(asio::buffer(out)))))
            co_await write_all(c, http::make_chunk_last());
        } else {
          co_await write_all(c, asio::buffer(out));
        }
        co_return false;
      }
      if (result.index() != 0) {
        metrics.completion(label(endpoint), "disconnected");
        co_return false;
      }
    } catch (const boost::system::system_error&) {
      // Unless the shutdown answer itself could not be written (the request is counted then).
      if (!counted) metrics.completion(label(endpoint), "disconnected");
      co_return false;
    }
    count(endpoint, combined(s.outcomes));
    if (s.error) {
      co_await send_error(c, req, *s.error);
      co_return true;
    }
    co_return s.started && req.version() >= 11;
  }

  // --- routing -----------------------------------------------------------------------------

  static ApiError no_such_endpoint(std::string_view path) {
    return ApiError(404, "invalid_request_error", "", "no such endpoint: " + std::string(path));
  }

  // The paths the server answers on.
  static bool endpoint(std::string_view path) {
    return path == "/health" || path == "/metrics" || path == "/v1/chat/completions" || path == "/v1/completions" ||
           path == "/v1/models" || path.starts_with("/v1/models/");
  }

  asio::awaitable<bool> handle(Connection& c, const HttpRequest& req) {
    // Requests about the server rather than a path (RFC 9110 9.3.6, 9.3.7): OPTIONS * lists
    // the methods; CONNECT asks for a tunnel, which a server that is no proxy does not make.
    if (req.method() == http::verb::connect) {
      co_await send_error(c, req,
                          ApiError(405, "invalid_request_error", "", "this server is not a proxy: it makes no tunnels"),
                          std::pair(http::field::allow, std::string(kMethods)));
      co_return true;
    }
    if (req.target() == "*") {
      if (req.method() == http::verb::options) {
        co_await send_text(c, req, http::status::ok, "", "text/plain; charset=utf-8",
                           std::pair(http::field::allow, std::string(kMethods)));
      } else {
        co_await send_error(c, req,
                            ApiError(400, "invalid_request_error", "", "the request target '*' is for OPTIONS only"));
      }
      co_return true;
    }
    const std::optional<std::string> decoded = path_of(req);
    if (!decoded) {
      co_await send_error(c, req,
                          ApiError(400, "invalid_request_error", "",
                                   "the request target '" + std::string(req.target()) +
                                       "' has a malformed percent-escape or an encoded '/'"));
      co_return true;
    }
    const std::string_view path = *decoded;
    if (req.method() == http::verb::unknown) {
      // A method HTTP does not define (RFC 9110 9.1: 501); a defined one that the endpoint does
      // not serve is a 405 below.
      co_await send_error(c, req,
                          ApiError(501, "invalid_request_error", "",
                                   "the method '" + utf8_excerpt(req.method_string(), 40) +
                                       "' is not one this server implements (" + kMethods + ")"));
      co_return true;
    }
    if (req.method() == http::verb::options && req.count(http::field::origin) > 0 &&
        req.count(http::field::access_control_request_method) > 0 && !options.allowed_origins.empty()) {
      if (endpoint(path)) {
        co_await preflight(c, req);
      } else {
        co_await send_error(c, req, no_such_endpoint(path));
      }
      co_return true;
    }
    // HEAD is GET without the body (send_text leaves it out).
    const bool get = req.method() == http::verb::get || req.method() == http::verb::head;

    if (path == "/health") {
      if (!get) {
        co_await send_error(c, req, ApiError(405, "invalid_request_error", "", "use GET for /health"),
                            std::pair(http::field::allow, std::string("GET, HEAD")));
        co_return true;
      }
      // Only a running server answers: shutting down, it accepts no connection and keeps none idle.
      json body = {{"status", "ok"}, {"model", options.model_name}, {"in_flight", in_flight}};
      if (auto stats = backend.engine_stats()) body["engine"] = stats->to_json();
      co_await send(c, req, http::status::ok, body);
      co_return true;
    }
    if (path == "/metrics") {
      if (!get) {
        co_await send_error(c, req, ApiError(405, "invalid_request_error", "", "use GET for /metrics"),
                            std::pair(http::field::allow, std::string("GET, HEAD")));
        co_return true;
      }
      const Metrics::Gauges gauges{in_flight, static_cast<std::int64_t>(connections.size()), options.model_name,
                                   backend.engine_stats()};
      co_await send_text(c, req, http::status::ok, metrics.render(gauges), "text/plain; version=0.0.4; charset=utf-8");
      co_return true;
    }
    if (!path.starts_with("/v1/")) {
      co_await send_error(c, req, no_such_endpoint(path));
      co_return true;
    }
    if (!options.api_key.empty()) {
      const auto it = req.find(http::field::authorization);
      std::string_view given = it == req.end() ? std::string_view{} : std::string_view(it->value().data(), it->value().size());
      // The scheme is case-insensitive (RFC 9110), the key is not.
      const bool bearer = given.size() > 7 && beast::iequals(given.substr(0, 7), "bearer ");
      const bool ok = bearer && same_secret(given.substr(7), options.api_key);
      if (!ok) {
        // A completion request refused for its key counts with the other refusals.
        if (path == "/v1/chat/completions") metrics.completion(label(Endpoint::kChat), "invalid");
        if (path == "/v1/completions") metrics.completion(label(Endpoint::kCompletions), "invalid");
        co_await send_error(c, req,
                            ApiError(401, "invalid_request_error", "",
                                     it == req.end() ? "missing API key: send 'Authorization: Bearer KEY'"
                                                     : "incorrect API key",
                                     "invalid_api_key"),
                            std::pair(http::field::www_authenticate, std::string("Bearer")));
        co_return true;
      }
    }
    if (path == "/v1/chat/completions") co_return co_await completion(c, req, Endpoint::kChat);
    if (path == "/v1/completions") co_return co_await completion(c, req, Endpoint::kCompletions);
    if (path == "/v1/models" || path.starts_with("/v1/models/")) {
      if (!get) {
        co_await send_error(c, req, ApiError(405, "invalid_request_error", "", "use GET for /v1/models"),
                            std::pair(http::field::allow, std::string("GET, HEAD")));
        co_return true;
      }
      if (path == "/v1/models" || path == "/v1/models/") {  // a trailing slash names no model
        json list = json::object();
        list["object"] = "list";
        list["data"] = json::array();
        list["data"].push_back(model_json());
        co_await send(c, req, http::status::ok, list);
      } else if (path.substr(std::string_view("/v1/models/").size()) == options.model_name) {
        co_await send(c, req, http::status::ok, model_json());
      } else {
        co_await send_error(c, req, ApiError(404, "invalid_request_error", "model",
                                             "the model '" + std::string(path.substr(11)) +
                                                 "' does not exist; this server serves '" + options.model_name + "'",
                                             "model_not_found"));
      }
      co_return true;
    }
    co_await send_error(c, req, no_such_endpoint(path));
    co_return true;
  }

  static constexpr std::uint32_t kHeaderLimit = 64 * 1024;  // bytes of request line and header fields

  static void skip_empty_lines(beast::flat_buffer& buffer) {
    const auto data = buffer.data();
    const auto* bytes = static_cast<const char*>(data.data());
    std::size_t n = 0;
    while (n < data.size() && (bytes[n] == '\r' || bytes[n] == '\n')) ++n;
    buffer.consume(n);
  }

  // A request's time to arrive: at its end the socket's reads are cancelled (not the socket
  // closed, as the stream's own expiry does), so the session can still answer 408. The handler
  // touches the socket only while the clock runs, which is inside the session that owns it.
  class RequestClock {
   public:
    RequestClock(tcp::socket& socket, std::chrono::milliseconds limit)
        : state_(std::make_shared<State>(State{&socket})), timer_(socket.get_executor()) {
      timer_.expires_after(limit);
      timer_.async_wait([state = state_](boost::system::error_code ec) {
        if (ec || !state->running) return;
        state->expired = true;
        boost::system::error_code ignored;
        state->socket->cancel(ignored);
      });
    }
    RequestClock(const RequestClock&) = delete;
    RequestClock& operator=(const RequestClock&) = delete;
    ~RequestClock() { stop(); }
    void stop() {
      state_->running = false;
      timer_.cancel();
    }
    bool expired() const { return state_->expired; }

   private:
    struct State {
      tcp::socket* socket;
      bool running = true;
      bool expired = false;
    };
    std::shared_ptr<State> state_;
    asio::steady_timer timer_;
  };

  asio::awaitable<void> session(tcp::socket socket) {
    auto self = shared_from_this();
    Connection c(std::move(socket));
    connections.push_back(&c);
    const auto me = std::prev(connections.end());
    bool unread_body = false;  // the client may still be sending a body we refused
    try {
      for (;;) {
        if (draining) break;
        http::request_parser<http::string_body> parser;
        parser.body_limit(options.max_body_bytes);
        parser.header_limit(kHeaderLimit);
        // Empty lines before a request line are skipped (RFC 9112 2.2): some clients send a
        // CRLF after a body, which would otherwise read as a malformed next request.
        skip_empty_lines(c.buffer);
        if (c.buffer.size() == 0) {
          // Idle until the next request's first byte, for up to keep_alive in all: empty lines
          // do not start the time again.
          c.stream.expires_after(options.keep_alive);
          boost::system::error_code idle_ec;
          while (!idle_ec && c.buffer.size() == 0) {
            std::size_t first = 0;
            std::tie(idle_ec, first) = co_await c.stream.async_read_some(c.buffer.prepare(4096), use_tuple);
            c.buffer.commit(first);
            skip_empty_lines(c.buffer);
          }
          if (idle_ec) break;
        }
        // From its first byte the whole request (line, fields, body) has request_timeout, however
        // the bytes are spaced: a client trickling them one at a time cannot hold the connection.
        // Then the reads are cancelled rather than the connection closed, so that the client is
        // told why (408); the stream's own expiry, a little later, closes it if even that stalls.
        c.stream.expires_after(options.request_timeout + std::chrono::seconds(5));
        RequestClock clock(c.stream.socket(), options.request_timeout);
        c.receiving = true;
        HeldBody held{held_body_bytes};
        // The header in pieces, as the body below: the clock's cancel reaches only a read that
        // is waiting, so each piece checks it (one that had just completed would read on).
        boost::system::error_code ec;
        std::size_t n = 0;
        while (!ec && !parser.is_header_done()) {
          std::tie(ec, n) = co_await http::async_read_some(c.stream, c.buffer, parser, use_tuple);
          if (!ec && clock.expired()) ec = beast::error::timeout;
        }
        const auto coding = parser.get().find(http::field::transfer_encoding);
        if (!ec && coding != parser.get().end() &&
            (parser.get().count(http::field::transfer_encoding) > 1 || !beast::iequals(coding->value(), "chunked"))) {
          // A transfer coding besides chunked, which the server cannot undo (RFC 9112 6.1: 501).
          // Before chunked, the body would be read as if it had not been applied; after it or
          // alone, the body's length cannot be known (6.3), and read as having none, its bytes
          // would be taken for the next request.
          HttpRequest head = parser.release();
          head.keep_alive(false);
          unread_body = true;
          c.refusing = true;
          co_await send_error(c, head,
                              ApiError(501, "invalid_request_error", "",
                                       "a Transfer-Encoding other than chunked is not supported: send the body with a "
                                       "Content-Length, or chunked"));
          break;
        }
        const std::size_t hosts = ec ? 0 : parser.get().count(http::field::host);
        if (!ec && (parser.get().version() < 11 ? parser.get().count(http::field::transfer_encoding) > 0 || hosts > 1
                                                  : hosts != 1)) {
          // HTTP/1.0 has no transfer codings: a body framed by one is faulty framing (RFC 9112
          // 6.1), which a proxy in front may have read otherwise. HTTP/1.1 requires exactly one
          // Host field, and no request may have two (RFC 9112 3.2).
          HttpRequest head = parser.release();
          const bool framing = head.version() < 11 && hosts <= 1;
          head.keep_alive(false);
          unread_body = true;
          c.refusing = true;
          co_await send_error(c, head,
                              ApiError(400, "invalid_request_error", "",
                                       framing ? "an HTTP/1.0 request may not use Transfer-Encoding: send the body "
                                                 "with a Content-Length"
                                               : hosts > 1 ? "a request may have only one Host header field"
                                                           : "an HTTP/1.1 request needs one Host header field"));
          break;
        }
        // A body's declared length is held from the start (the parser reserves it at its first
        // byte); a chunked one as it grows. Past the cap, the request is refused before its body
        // is read, so a client waiting for "100 Continue" sends none.
        const std::size_t declared =
            !ec && parser.content_length() ? static_cast<std::size_t>(std::min<std::uint64_t>(*parser.content_length(), options.max_body_bytes)) : 0;
        held.grow_to(declared);
        if (!ec && held_body_bytes > options.max_held_body_bytes) ec = asio::error::no_buffer_space;
        if (!ec && !parser.is_done()) {
          // A client that waits for "100 Continue" before sending the body gets it at once
          // (an HTTP/1.1 client only: RFC 9110 10.1.1).
          const auto expect = parser.get().find(http::field::expect);
          if (parser.get().version() >= 11 && expect != parser.get().end() &&
              beast::iequals(expect->value(), "100-continue")) {
            http::response<http::empty_body> go_on{http::status::continue_, 11};
            std::tie(ec, n) = co_await http::async_write(c.stream, go_on, use_tuple);
          }
          // The body in pieces, each counted against what all connections hold at once.
          while (!ec && !parser.is_done()) {
            std::tie(ec, n) = co_await http::async_read_some(c.stream, c.buffer, parser, use_tuple);
            if (!ec && !parser.is_done() && clock.expired()) ec = beast::error::timeout;
            held.grow_to(std::max(declared, parser.get().body().size()));
            if (!ec && held_body_bytes > options.max_held_body_bytes) ec = asio::error::no_buffer_space;
          }
        }
        c.receiving = false;
        clock.stop();
        if (ec) {
          c.refusing = true;
          if (clock.expired()) {
            HttpRequest head{http::verb::unknown, "", 11};
            head.keep_alive(false);
            unread_body = true;  // the client may still be sending: drain before closing
            char limit[32];
            std::snprintf(limit, sizeof limit, "%g", std::chrono::duration<double>(options.request_timeout).count());
            co_await send_error(c, head,
                                ApiError(408, "invalid_request_error", "",
                                         std::string("the request did not arrive whole within ") + limit +
                                             " s (the server's --request-timeout)"));
          } else if (ec == asio::error::no_buffer_space) {
            HttpRequest head = parser.release();
            head.keep_alive(false);
            unread_body = true;
            const std::size_t others = held_body_bytes - held.bytes;
            held.grow_to(0);
            co_await send_error(c, head,
                                ApiError(503, "server_error", "",
                                         "the server holds " + std::to_string(others >> 20) +
                                             " MiB of other requests' bodies, its limit; retry after 1 s",
                                         "server_overloaded"),
                                std::pair(http::field::retry_after, std::string("1")));
          } else if (ec == http::error::body_limit) {
            HttpRequest head = parser.release();
            head.keep_alive(false);
            unread_body = true;
            co_await send_error(c, head,
                                ApiError(413, "invalid_request_error", "",
                                         "the request body exceeds " + std::to_string(options.max_body_bytes) + " bytes"));
          } else if (ec == http::error::header_limit) {
            HttpRequest head{http::verb::unknown, "", 11};
            head.keep_alive(false);
            unread_body = true;  // the client may still be sending fields: drain before closing
            co_await send_error(c, head,
                                ApiError(431, "invalid_request_error", "",
                                         "the request line and header fields exceed " +
                                             std::to_string(kHeaderLimit) + " bytes"));
          } else if (ec != http::error::end_of_stream && ec != beast::error::timeout &&
                     ec != asio::error::operation_aborted && ec != asio::error::connection_reset &&
                     ec != asio::error::eof && ec != asio::error::bad_descriptor) {
            HttpRequest bad{http::verb::unknown, "", 11};
            bad.keep_alive(false);
            co_await send_error(c, bad, ApiError(400, "invalid_request_error", "", "malformed HTTP request: " + ec.message()));
          }
          break;
        }
        c.stream.expires_never();
        HttpRequest req = parser.release();
        c.busy = true;
        const bool keep = co_await handle(c, req);
        c.busy = false;
        if (!keep || !req.keep_alive()) break;
        // Idle again from now: to the back of the list, which close_longest_idle() reads from the front.
        connections.splice(connections.end(), connections, me);
      }
    } catch (const std::exception&) {
      // A write to a client that went away: nothing to answer.
    }
    boost::system::error_code ignored;
    c.stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
    if (unread_body) {
      // Closing with unread bytes in the socket makes the system reset the connection, and a
      // client still sending its body may then lose the answer before reading it. Read and drop
      // what it sends until it stops (or for a few seconds) first: a lingering close.
      c.stream.expires_after(std::chrono::seconds(3));
      for (std::size_t dropped = 0; dropped <= 4 * options.max_body_bytes;) {
        auto [ec, n] = co_await c.stream.async_read_some(c.buffer.prepare(64 * 1024), use_tuple);
        if (ec) break;
        dropped += n;
      }
    }
    c.stream.socket().close(ignored);
    connections.erase(me);
    if (draining) maybe_drained();
  }

  asio::awaitable<void> accept_loop() {
    auto self = shared_from_this();
    for (;;) {
      auto [ec, socket] = co_await acceptor.async_accept(use_tuple);
      if (ec) {
        if (!acceptor.is_open()) co_return;
        // Out of descriptors with connections idle: make room for the new client.
        if ((ec == asio::error::no_descriptors || ec == boost::system::errc::too_many_files_open_in_system) &&
            close_longest_idle())
          continue;
        // E.g. too many open files: keep serving the connections we have, and try again after
        // a pause (at once would spin a core until a descriptor frees up).
        asio::steady_timer pause(io, std::chrono::milliseconds(100));
        co_await pause.async_wait(use_tuple);
        continue;
      }
      socket.set_option(tcp::no_delay(true), ec);
      asio::co_spawn(io, session(std::move(socket)), asio::detached);
    }
  }

  // Closes the connection idle the longest, if any, so a flood of idle connections cannot lock
  // new clients out until the keep-alive timeout ends theirs: one that has sent nothing of a next
  // request if there is one, else one partway through sending it. One whose request is being
  // served, or is being answered with an error, is never chosen. Returns whether one was closed.
  bool close_longest_idle() {
    for (const bool receiving_too : {false, true}) {
      for (Connection* c : connections) {
        if (!c->busy && !c->refusing && (receiving_too || !c->receiving) && c->stream.socket().is_open()) {
          boost::system::error_code ignored;
          c->stream.socket().close(ignored);
          return true;
        }
      }
    }
    return false;
  }

  void maybe_drained() {
    if (!connections.empty() || !on_drained) return;
    grace.cancel();
    auto done = std::move(on_drained);
    on_drained = nullptr;
    done();
  }

  void close_all() {
    for (Connection* c : connections) {
      boost::system::error_code ignored;
      c->stream.socket().close(ignored);
    }
  }

  // The grace period is over (or a second signal came): every request still running is
  // cancelled and answered with a 503 (an error event mid-stream); a connection that cannot
  // take even that within a few seconds is closed.
  void abort_all() {
    for (Connection* c : connections) {
      if (c->busy && !c->aborted) {
        c->aborted = true;
        ++aborted_requests;
        c->abort.cancel();
      } else if (!c->busy) {
        boost::system::error_code ignored;
        c->stream.socket().close(ignored);
      }
    }
    grace.expires_after(std::chrono::seconds(3));
    grace.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (!ec) self->close_all();
    });
  }
};

Server::Server(asio::io_context& io, Backend& backend, ServerOptions options)
    : impl_(std::make_shared<Impl>(io, backend, std::move(options))) {
  Impl& s = *impl_;
  const std::string where = s.options.host + ":" + std::to_string(s.options.port);
  boost::system::error_code ec;
  tcp::endpoint endpoint;
  if (const auto address = asio::ip::make_address(s.options.host, ec); !ec) {
    endpoint = tcp::endpoint(address, s.options.port);
  } else {
    // A host name ("localhost"): its first address.
    tcp::resolver resolver(io);
    const auto results = resolver.resolve(s.options.host, std::to_string(s.options.port),
                                          tcp::resolver::passive | tcp::resolver::numeric_service, ec);
    if (ec || results.empty())
      throw std::runtime_error("cannot listen on " + where + ": cannot resolve '" + s.options.host + "'" +
                               (ec ? ": " + ec.message() : std::string()));
    endpoint = results.begin()->endpoint();
  }
  s.acceptor.open(endpoint.protocol(), ec);
  if (!ec) s.acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) s.acceptor.bind(endpoint, ec);
  if (!ec) s.acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) throw std::runtime_error("cannot listen on " + where + ": " + ec.message());
}

Server::~Server() {
  boost::system::error_code ignored;
  impl_->acceptor.close(ignored);
}

unsigned short Server::port() const { return impl_->acceptor.local_endpoint().port(); }

void Server::start() { asio::co_spawn(impl_->io, impl_->accept_loop(), asio::detached); }

std::int64_t Server::in_flight() const { return impl_->in_flight; }

std::int64_t Server::aborted() const { return impl_->aborted_requests; }

void Server::shutdown(std::function<void()> done) {
  Impl& s = *impl_;
  if (s.draining) {
    // A second request to stop: cancel what is still running.
    s.abort_reason = "was told to stop at once";
    s.abort_all();
    return;
  }
  s.draining = true;
  s.on_drained = done ? std::move(done) : [] {};
  boost::system::error_code ignored;
  s.acceptor.close(ignored);
  // Idle keep-alive connections close now; busy ones after their response. One partway through
  // sending a request (its first bytes came before the signal) may finish sending it, within
  // the request timeout, and is answered as the others are; the grace period bounds it too.
  for (auto* c : s.connections) {
    if (!c->busy && !c->receiving) c->stream.socket().close(ignored);
  }
  s.grace.expires_after(s.options.shutdown_grace);
  s.grace.async_wait([impl = impl_](boost::system::error_code ec) {
    if (!ec) impl->abort_all();
  });
  s.maybe_drained();
}

}  // namespace batchlm::server
