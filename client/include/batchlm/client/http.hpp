#pragma once
// HTTP on libcurl's multi interface, driven by Asio: curl_multi_socket_action with Asio
// watching curl's sockets and its one timer. One thread holds thousands of transfers; there
// is no thread per request and no polling loop. Connections are reused across requests and
// HTTP/2 is used when the server offers it (ALPN over TLS).

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/awaitable.hpp>

#include "batchlm/core/types.hpp"

namespace batchlm::client {

using Headers = std::vector<std::pair<std::string, std::string>>;

// One deadline per stage. Zero disables a stage.
struct HttpTimeouts {
  std::chrono::milliseconds connect{10'000};     // TCP + TLS handshake
  std::chrono::milliseconds first_byte{120'000}; // request sent -> first response body byte
  std::chrono::milliseconds idle{60'000};        // between two received chunks
  std::chrono::milliseconds total{900'000};      // the whole transfer
  // Once the body handler says the answer is whole (HttpRequest::answered): how long the rest
  // of the stream (a usage chunk, [DONE]) is waited for, counted from the answer, before the
  // transfer ends with a timeout (which the answer survives).
  std::chrono::milliseconds after_answer{5'000};
};

struct HttpRequest {
  std::string url;
  Headers headers;         // sent as given
  std::string body;        // POST body (the request is a GET when method == "GET")
  std::string method = "POST";
  HttpTimeouts timeouts;
  std::size_t max_response_bytes = 64 << 20;  // whole body; larger is ErrorKind::TooLarge
  // Asked after each body chunk: whether what came is a whole answer already, so that a server
  // that then falls silent is waited for timeouts.after_answer, not timeouts.idle.
  std::function<bool()> answered;
  // Set when `headers` carry credentials (an API key, headers of the caller's own): a 307/308
  // to another host or port is not followed (the redirect is the response), since they would
  // go there; one to the same host (an upgrade to https included) is, with them.
  bool same_origin_redirects = false;
};

struct HttpResponse {
  int status = 0;
  Headers headers;   // names lower-cased, in arrival order, of the final response
  std::string body;  // the body when no body handler consumed it (always for non-2xx)
  // A transport failure: Timeout, Connection, TooLarge, Cancelled; Http for too many
  // redirects (the message names the last Location); Protocol with code "not_http" for a
  // server that answered in something other than HTTP (the message names the URL).
  std::optional<Error> error;
  std::chrono::steady_clock::time_point first_byte_at{};  // of the body; {} if none arrived

  const std::string* header(std::string_view lower_name) const;
};

// Called with each chunk of a 2xx response body as it arrives. Return false to abort the
// transfer (the response then carries whatever error the handler recorded on its side).
using BodyHandler = std::function<bool(std::string_view chunk)>;

struct HttpClientOptions {
  bool verify_tls = true;            // never off by default
  long max_host_connections = 0;     // 0: unlimited
  long max_total_connections = 0;    // 0: unlimited
  long max_cached_connections = 8192; // idle connections kept open for reuse
  bool http2 = true;                 // offer h2 via ALPN (TLS) — plain http stays HTTP/1.1
  std::string user_agent = "batchlm";
  // CA certificates to trust instead of the system's: a bundle file, a hashed directory (as
  // SSL_CERT_FILE / CURL_CA_BUNDLE and SSL_CERT_DIR name them); empty: the system's.
  std::string ca_info;
  std::string ca_path;
};

// The proxy libcurl takes for `url` from the environment, as "NAME=URL" with any password
// left out; empty when none applies (no_proxy read as curl reads it: "*", or host names that
// match the URL's host or end it after a dot). For messages: curl finds its proxy itself.
std::string proxy_for(const std::string& url);

class HttpClient {
 public:
  // All transfers run on `executor`, which must be single-threaded (one io_context thread or a
  // strand).
  HttpClient(boost::asio::any_io_executor executor, HttpClientOptions options = {});
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // One transfer. Follows up to 5 redirects: 307 and 308 with the same method and body, 301,
  // 302 and 303 only for a GET (for another method they are the response); the Authorization
  // header goes to the original host only. Never throws for transfer failures (see
  // HttpResponse::error). Honours per-operation cancellation: the transfer is removed at once
  // and the result carries ErrorKind::Cancelled.
  boost::asio::awaitable<HttpResponse> perform(HttpRequest request, BodyHandler on_body = {});

  std::size_t in_flight() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace batchlm::client
