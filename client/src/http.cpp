#include "batchlm/client/http.hpp"


#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <curl/curl.h>

namespace batchlm::client {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

const std::string* HttpResponse::header(std::string_view lower_name) const {
  for (const auto& [name, value] : headers) {
    if (name == lower_name) return &value;
  }
  return nullptr;
}

namespace {

// libcurl's global state must be set up once before any handle exists, and not concurrently.
void ensure_curl_global_init() {
  static const bool initialized = [] { return curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK; }();
  (void)initialized;
}

struct EasyDeleter {
  void operator()(CURL* easy) const { curl_easy_cleanup(easy); }
};
struct MultiDeleter {
  void operator()(CURLM* multi) const { curl_multi_cleanup(multi); }
};
struct SlistDeleter {
  void operator()(curl_slist* list) const { curl_slist_free_all(list); }
};
using EasyHandle = std::unique_ptr<CURL, EasyDeleter>;
using MultiHandle = std::unique_ptr<CURLM, MultiDeleter>;
using Slist = std::unique_ptr<curl_slist, SlistDeleter>;

void append_header(Slist& list, const std::string& line) {
  curl_slist* grown = curl_slist_append(list.get(), line.c_str());
  if (grown != nullptr) {
    (void)list.release();
    list.reset(grown);
  }
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r' || s.back() == '\n'))
    s.remove_suffix(1);
  return s;
}

// Where a URL leads: its scheme, host (lower-cased) and port (the scheme's when not given).
struct Origin {
  std::string scheme, host, port;
};

// The origin of `url`, or of `reference` resolved against it (a Location may be relative);
// nullopt when curl cannot parse them.
std::optional<Origin> origin_of(const std::string& url, const std::string& reference = {}) {
  std::unique_ptr<CURLU, decltype(&curl_url_cleanup)> u(curl_url(), &curl_url_cleanup);
  if (!u || curl_url_set(u.get(), CURLUPART_URL, url.c_str(), 0) != CURLUE_OK) return std::nullopt;
  if (!reference.empty() && curl_url_set(u.get(), CURLUPART_URL, reference.c_str(), 0) != CURLUE_OK)
    return std::nullopt;
  const auto part = [&](CURLUPart which, unsigned flags) -> std::optional<std::string> {
    char* text = nullptr;
    if (curl_url_get(u.get(), which, &text, flags) != CURLUE_OK) return std::nullopt;
    std::string piece(text);
    curl_free(text);
    return piece;
  };
  auto scheme = part(CURLUPART_SCHEME, 0), host = part(CURLUPART_HOST, 0), port = part(CURLUPART_PORT, CURLU_DEFAULT_PORT);
  if (!scheme || !host || !port) return std::nullopt;
  std::transform(host->begin(), host->end(), host->begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return Origin{std::move(*scheme), std::move(*host), std::move(*port)};
}

// Whether headers meant for `from` may go to `to`: the same origin, or from's host over https
// on from's port or https's (a gateway's upgrade); another port there may be another service.
bool may_carry_headers(const Origin& from, const Origin& to) {
  if (from.host != to.host) return false;
  if (from.scheme == to.scheme) return from.port == to.port;
  return from.scheme == "http" && to.scheme == "https" && (to.port == from.port || to.port == "443");
}

std::string ms_text(std::chrono::milliseconds ms) { return std::to_string(ms.count()) + " ms"; }

// Redirects followed before a transfer gives up: enough for a gateway's http -> https and
// trailing-slash hops, few enough that a loop ends at once.
constexpr long kMaxRedirects = 5;

Error make_error(ErrorKind kind, std::string message) {
  Error error;
  error.kind = kind;
  error.message = std::move(message);
  return error;
}

}  // namespace

// One transfer: its easy handle, what it sends, and what has arrived. Owned by the coroutine
// that awaits it; the multi handle only refers to it while it is attached.
struct Transfer {
  explicit Transfer(asio::any_io_executor executor) : wakeup(std::move(executor)) {}

  EasyHandle easy;
  Slist header_list;
  HttpRequest request;
  BodyHandler on_body;
  HttpResponse response;
  char error_buffer[CURL_ERROR_SIZE] = {};

  std::size_t upload_offset = 0;
  std::size_t body_bytes = 0;
  bool attached = false;
  bool done = false;
  bool rearm = false;  // the wake-up was cancelled because the next deadline moved earlier
  bool redirect_refused = false;  // stopped at a redirect that would turn the request into a GET
  bool decode = true;             // undo a Content-Encoding the server applied (gzip, deflate, ...)
  CURLcode result = CURLE_OK;
  std::optional<Error> local_error;  // set by a callback that aborts the transfer

  Clock::time_point started_at;
  std::optional<Clock::time_point> sent_at;       // the request body fully handed to curl
  std::optional<Clock::time_point> last_body_at;  // the latest body chunk
  std::optional<Clock::time_point> answered_at;   // when request.answered() first said yes

  // The awaiting coroutine sleeps on this timer until the next stage deadline; completion
  // cancels it early. A timer doubles as the wake-up signal because its wait also carries
  // the coroutine's cancellation slot.
  asio::steady_timer wakeup;

  // The earliest deadline still ahead, and which stage it belongs to.
  std::pair<Clock::time_point, std::string> next_deadline() const {
    const HttpTimeouts& t = request.timeouts;
    std::pair<Clock::time_point, std::string> best{Clock::time_point::max(), {}};
    auto consider = [&](std::chrono::milliseconds limit, Clock::time_point from,
                        std::string message) {
      if (limit.count() <= 0) return;
      if (from + limit < best.first) best = {from + limit, std::move(message)};
    };
    consider(t.total, started_at, "transfer exceeded " + ms_text(t.total) + " (total timeout)");
    if (answered_at) {
      // The rest of the stream (its usage, [DONE]) has after_answer from the answer on, however
      // its bytes are spaced: a server that keeps the stream open with comments or empty
      // chunks after the finish reason does not hold a finished answer for the total timeout.
      consider(t.after_answer, *answered_at, "the stream went on for " + ms_text(t.after_answer) + " after the answer");
      consider(t.idle, *last_body_at, "no data for " + ms_text(t.idle) + " after the answer (idle timeout)");
    } else if (last_body_at) {
      consider(t.idle, *last_body_at, "no data for " + ms_text(t.idle) + " (idle timeout)");
    } else {
      consider(t.first_byte, sent_at.value_or(started_at),
               "no response body within " + ms_text(t.first_byte) + " (first-byte timeout)");
    }
    return best;
  }
};

struct HttpClient::Impl : std::enable_shared_from_this<HttpClient::Impl> {
  // One socket curl asked us to watch. Asio only borrows the descriptor: it is released, never
  // closed, because curl owns it (and may keep it open in its connection cache).
  struct Watch {
    Watch(asio::any_io_executor executor, curl_socket_t fd)
        : fd(fd), descriptor(std::move(executor), fd) {}
    curl_socket_t fd;
    asio::posix::stream_descriptor descriptor;
    int wanted = 0;  // CURL_POLL_IN / CURL_POLL_OUT bits
    bool read_armed = false;
    bool write_armed = false;
    bool removed = false;
  };

  Impl(asio::any_io_executor executor, HttpClientOptions options)
      : executor(executor), options(std::move(options)), timer(executor) {}

  ~Impl() {
    for (auto& [fd, watch] : watches) release(*watch);
    watches.clear();
    if (multi) {
      // The connection cache closes its sockets during cleanup; nothing may call back into
      // this object by then.
      curl_multi_setopt(multi.get(), CURLMOPT_SOCKETFUNCTION, nullptr);
      curl_multi_setopt(multi.get(), CURLMOPT_TIMERFUNCTION, nullptr);
    }
  }

  bool start() {
    ensure_curl_global_init();
    multi.reset(curl_multi_init());
    if (!multi) return false;
    CURLM* m = multi.get();
    curl_multi_setopt(m, CURLMOPT_SOCKETFUNCTION, &Impl::on_socket);
    curl_multi_setopt(m, CURLMOPT_SOCKETDATA, this);
    curl_multi_setopt(m, CURLMOPT_TIMERFUNCTION, &Impl::on_timer);
    curl_multi_setopt(m, CURLMOPT_TIMERDATA, this);
    curl_multi_setopt(m, CURLMOPT_PIPELINING, long{CURLPIPE_MULTIPLEX});
    // curl sizes its idle-connection cache by the transfers active at the moment, so after a
    // burst the connections of finished transfers would be closed instead of reused by the
    // next wave. Keep as many as the caller may run at once.
    curl_multi_setopt(m, CURLMOPT_MAXCONNECTS, options.max_cached_connections);
    if (options.max_host_connections > 0)
      curl_multi_setopt(m, CURLMOPT_MAX_HOST_CONNECTIONS, options.max_host_connections);
    if (options.max_total_connections > 0)
      curl_multi_setopt(m, CURLMOPT_MAX_TOTAL_CONNECTIONS, options.max_total_connections);
    return true;
  }

  // --- curl -> Asio -------------------------------------------------------------------------

  static int on_socket(CURL*, curl_socket_t fd, int what, void* self_ptr, void*) {
    auto* self = static_cast<Impl*>(self_ptr);
    if (what == CURL_POLL_REMOVE) {
      if (auto it = self->watches.find(fd); it != self->watches.end()) {
        self->release(*it->second);
        self->watches.erase(it);
      }
      return 0;
    }
    auto& watch = self->watches[fd];
    if (!watch) {
      try {
        watch = std::make_shared<Watch>(self->executor, fd);
      } catch (const std::exception&) {
        self->watches.erase(fd);
        return -1;  // curl fails the transfers on this socket
      }
    }
    watch->wanted = what;
    self->arm(watch);
    return 0;
  }

  static int on_timer(CURLM*, long timeout_ms, void* self_ptr) {
    auto* self = static_cast<Impl*>(self_ptr);
    if (timeout_ms < 0) {
      self->timer.cancel();
      return 0;
    }
    // Even a zero timeout goes through the timer: curl must not be re-entered from inside
    // its own callback.
    self->timer.expires_after(std::chrono::milliseconds(timeout_ms));
    self->timer.async_wait([weak = self->weak_from_this()](boost::system::error_code ec) {
      if (ec) return;
      if (auto impl = weak.lock()) impl->socket_action(CURL_SOCKET_TIMEOUT, 0);
    });
    return 0;
  }

  void release(Watch& watch) {
    watch.removed = true;
    boost::system::error_code ignored;
    watch.descriptor.cancel(ignored);
    (void)watch.descriptor.release();
  }

  // curl may stop reading before a socket is drained, and Asio's epoll reactor is
  // edge-triggered, so a wait must fire for a socket that is readable already. It does:
  // Asio starts every descriptor wait with EPOLL_CTL_MOD, and the kernel re-checks readiness
  // on a MOD and reports a ready socket at once. (A poll() probe here would cost one more
  // system call per received chunk.)
  void arm(const std::shared_ptr<Watch>& watch) {
    if ((watch->wanted & CURL_POLL_IN) != 0 && !watch->read_armed)
      wait(watch, asio::posix::descriptor_base::wait_read);
    if ((watch->wanted & CURL_POLL_OUT) != 0 && !watch->write_armed)
      wait(watch, asio::posix::descriptor_base::wait_write);
  }

  void wait(const std::shared_ptr<Watch>& watch, asio::posix::descriptor_base::wait_type type) {
    const bool read = type == asio::posix::descriptor_base::wait_read;
    (read ? watch->read_armed : watch->write_armed) = true;
    watch->descriptor.async_wait(
        type, [weak = weak_from_this(), watch, read](boost::system::error_code ec) {
          (read ? watch->read_armed : watch->write_armed) = false;
          if (watch->removed || ec == asio::error::operation_aborted) return;
          auto impl = weak.lock();
          if (!impl) return;
          const int flags = ec ? CURL_CSELECT_ERR : (read ? CURL_CSELECT_IN : CURL_CSELECT_OUT);
          impl->on_ready(watch, flags);
        });
  }

  void on_ready(const std::shared_ptr<Watch>& watch, int flags) {
    // Interest may have changed since the wait began; curl is only told what it asked for.
    const int relevant = flags & (CURL_CSELECT_ERR | ((watch->wanted & CURL_POLL_IN) ? CURL_CSELECT_IN : 0) |
                                  ((watch->wanted & CURL_POLL_OUT) ? CURL_CSELECT_OUT : 0));
    if (relevant != 0) socket_action(watch->fd, relevant);
    if (!watch->removed) arm(watch);
  }

  void socket_action(curl_socket_t fd, int flags) {
    int running = 0;
    curl_multi_socket_action(multi.get(), fd, flags, &running);
    collect_finished();
  }

  void collect_finished() {
    int queued = 0;
    while (CURLMsg* message = curl_multi_info_read(multi.get(), &queued)) {
      if (message->msg != CURLMSG_DONE) continue;
      Transfer* transfer = nullptr;
      curl_easy_getinfo(message->easy_handle, CURLINFO_PRIVATE, &transfer);
      const CURLcode result = message->data.result;  // `message` dies with the removal
      if (transfer == nullptr) continue;
      finish(*transfer, result, std::nullopt);
    }
  }

  // Detaches a transfer and wakes its coroutine. `error` overrides what curl reported.
  void finish(Transfer& transfer, CURLcode result, std::optional<Error> error) {
    if (transfer.done) return;
    detach(transfer);
    transfer.result = result;
    if (error && !transfer.local_error) transfer.local_error = std::move(error);
    transfer.done = true;
    transfer.wakeup.cancel();
  }

  void detach(Transfer& transfer) {
    if (!transfer.attached) return;
    transfer.attached = false;
    curl_multi_remove_handle(multi.get(), transfer.easy.get());
    --attached_count;
  }

  // --- per-transfer curl callbacks ----------------------------------------------------------

  static size_t on_header(char* data, size_t size, size_t count, void* user) {
    auto& t = *static_cast<Transfer*>(user);
    const std::string_view line(data, size * count);
    if (line.rfind("HTTP/", 0) == 0) {
      // A new status line starts a new response (after a 1xx, a redirect, or a proxy's CONNECT
      // reply): only the final one's headers and body are kept.
      t.response.headers.clear();
      t.response.body.clear();
      const std::size_t space = line.find(' ');
      t.response.status = space == std::string_view::npos ? 0 : std::atoi(std::string(line.substr(space + 1, 3)).c_str());
      return size * count;
    }
    if (trim(line).empty()) {
      // The end of a response's headers. curl follows every redirect with a Location, and
      // re-sends a POST as a GET without its body on 301, 302 and 303: such a redirect ends the
      // transfer here and is the response (307 and 308 keep the method and the body).
      const int status = t.response.status;
      const std::string* location = t.response.header("location");
      if (status >= 300 && status < 400 && status != 307 && status != 308 && t.request.method != "GET" &&
          location != nullptr) {
        t.redirect_refused = true;
        return 0;  // curl aborts with CURLE_WRITE_ERROR
      }
      // curl keeps only Authorization and Cookie from another origin: a header of the caller's
      // own (an `api-key`, say) would go along, so such a redirect is not followed.
      if ((status == 307 || status == 308) && location != nullptr && t.request.same_origin_redirects) {
        char* current = nullptr;
        curl_easy_getinfo(t.easy.get(), CURLINFO_EFFECTIVE_URL, &current);
        const auto target = origin_of(current != nullptr ? current : t.request.url, *location);
        const auto origin = origin_of(t.request.url);
        if (!target || !origin || !may_carry_headers(*origin, *target)) {
          t.redirect_refused = true;
          return 0;
        }
      }
      return size * count;
    }
    const std::size_t colon = line.find(':');
    if (colon == std::string_view::npos) return size * count;
    std::string name(trim(line.substr(0, colon)));
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    t.response.headers.emplace_back(std::move(name), std::string(trim(line.substr(colon + 1))));
    return size * count;
  }

  static size_t on_body_bytes(char* data, size_t size, size_t count, void* user) {
    auto& t = *static_cast<Transfer*>(user);
    const std::size_t n = size * count;
    const auto now = Clock::now();
    if (!t.last_body_at) {
      t.response.first_byte_at = now;
      // The idle deadline usually comes sooner than the first-byte one the coroutine sleeps
      // on: wake it to re-arm. Later chunks only push the deadline back, which needs no wake.
      t.rearm = true;
      t.wakeup.cancel();
    }
    t.last_body_at = now;
    if (t.body_bytes + n > t.request.max_response_bytes) {
      t.local_error = make_error(ErrorKind::TooLarge, "response body exceeds " +
                                                          std::to_string(t.request.max_response_bytes) +
                                                          " bytes");
      return 0;  // curl aborts with CURLE_WRITE_ERROR
    }
    t.body_bytes += n;
    const bool success = t.response.status >= 200 && t.response.status < 300;
    if (success && t.on_body) {
      // The handler is caller code running inside curl: nothing may unwind through curl.
      try {
        if (!t.on_body(std::string_view(data, n))) {
          t.local_error = make_error(ErrorKind::Internal, "transfer aborted by the body handler");
          return 0;
        }
        if (!t.answered_at && t.request.answered && t.request.answered()) {
          // The deadline comes sooner now: wake the coroutine to re-arm.
          t.answered_at = Clock::now();
          t.rearm = true;
          t.wakeup.cancel();
        }
      } catch (const std::exception& e) {
        t.local_error = make_error(ErrorKind::Internal, std::string("body handler threw: ") + e.what());
        return 0;
      } catch (...) {
        t.local_error = make_error(ErrorKind::Internal, "body handler threw");
        return 0;
      }
    } else {
      t.response.body.append(data, n);
    }
    return n;
  }

  static int on_upload_seek(void* user, curl_off_t offset, int origin) {
    auto& t = *static_cast<Transfer*>(user);
    if (origin != SEEK_SET || offset < 0 || static_cast<std::size_t>(offset) > t.request.body.size())
      return CURL_SEEKFUNC_CANTSEEK;
    t.upload_offset = static_cast<std::size_t>(offset);
    return CURL_SEEKFUNC_OK;
  }

  static size_t on_upload(char* buffer, size_t size, size_t count, void* user) {
    auto& t = *static_cast<Transfer*>(user);
    const std::size_t n = std::min(size * count, t.request.body.size() - t.upload_offset);
    std::copy_n(t.request.body.data() + t.upload_offset, n, buffer);
    t.upload_offset += n;
    if (t.upload_offset == t.request.body.size() && !t.sent_at) t.sent_at = Clock::now();
    return n;
  }

  // --- setup --------------------------------------------------------------------------------

  bool configure(Transfer& t) {
    t.easy.reset(curl_easy_init());
    if (!t.easy) return false;
    CURL* e = t.easy.get();
    const HttpRequest& r = t.request;
    curl_easy_setopt(e, CURLOPT_URL, r.url.c_str());
    curl_easy_setopt(e, CURLOPT_PRIVATE, &t);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, t.error_buffer);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    // Redirects are followed (a gateway moving its API to https or to another path), a POST
    // with its body on 307 and 308 only (on_header stops at the others). A request with
    // credentials (same_origin_redirects: an API key, headers of the caller's own) follows
    // only those to its own host, the same port or an upgrade to https, and carries its
    // Authorization there: curl would drop it on the upgrade, which the server then answers
    // with a 401 for a key that is right. Without credentials there is nothing to keep.
    curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(e, CURLOPT_MAXREDIRS, kMaxRedirects);
    curl_easy_setopt(e, CURLOPT_UNRESTRICTED_AUTH, r.same_origin_redirects ? 1L : 0L);
    curl_easy_setopt(e, CURLOPT_SSL_VERIFYPEER, options.verify_tls ? 1L : 0L);
    curl_easy_setopt(e, CURLOPT_SSL_VERIFYHOST, options.verify_tls ? 2L : 0L);
    if (!options.ca_info.empty()) curl_easy_setopt(e, CURLOPT_CAINFO, options.ca_info.c_str());
    if (!options.ca_path.empty()) curl_easy_setopt(e, CURLOPT_CAPATH, options.ca_path.c_str());
    curl_easy_setopt(e, CURLOPT_USERAGENT, options.user_agent.c_str());
    curl_easy_setopt(e, CURLOPT_TCP_KEEPALIVE, 1L);
    // Asks for no compression (a compressing proxy may hold back a stream's events), but
    // decodes a body a server or proxy compressed anyway (gzip, deflate, and whatever else
    // this libcurl was built with): without this, curl hands the compressed bytes over. A
    // Content-Encoding curl does not know (a misconfigured "UTF-8") is then an error, on
    // which perform() sends the request again without decoding.
    if (t.decode) curl_easy_setopt(e, CURLOPT_ACCEPT_ENCODING, "identity");
    if (options.http2) {
      curl_easy_setopt(e, CURLOPT_HTTP_VERSION, long{CURL_HTTP_VERSION_2TLS});
      // Waiting for the first TLS connection to show whether it multiplexes keeps a burst of
      // requests from opening one connection each. Plain http never multiplexes here.
      if (r.url.rfind("https://", 0) == 0) curl_easy_setopt(e, CURLOPT_PIPEWAIT, 1L);
    } else {
      curl_easy_setopt(e, CURLOPT_HTTP_VERSION, long{CURL_HTTP_VERSION_1_1});
    }
    if (r.timeouts.connect.count() > 0)
      curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(r.timeouts.connect.count()));
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, &Impl::on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, &t);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, &Impl::on_body_bytes);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, &t);

    // "Name:" alone would tell curl to send no such header: an empty value is written "Name;".
    for (const auto& [name, value] : r.headers)
      append_header(t.header_list, trim(value).empty() ? name + ";" : name + ": " + value);
    // An empty Expect header stops curl from waiting on `100 Continue` for larger bodies.
    append_header(t.header_list, "Expect:");
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, t.header_list.get());

    if (r.method == "GET") {
      curl_easy_setopt(e, CURLOPT_HTTPGET, 1L);
      t.sent_at = t.started_at;
    } else {
      // The body goes through the read callback rather than POSTFIELDS so the moment it has
      // been handed over is known: the first-byte deadline counts from there.
      curl_easy_setopt(e, CURLOPT_POST, 1L);
      curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(r.body.size()));
      curl_easy_setopt(e, CURLOPT_READFUNCTION, &Impl::on_upload);
      curl_easy_setopt(e, CURLOPT_READDATA, &t);
      // A reused keep-alive connection the server had closed makes curl send the request again
      // on a new one; it rewinds the body through this.
      curl_easy_setopt(e, CURLOPT_SEEKFUNCTION, &Impl::on_upload_seek);
      curl_easy_setopt(e, CURLOPT_SEEKDATA, &t);
      if (r.body.empty()) t.sent_at = t.started_at;
      if (r.method != "POST") curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, r.method.c_str());
    }
    return true;
  }

  // Whether the transfer got as far as a connection to the server.
  static bool connected(Transfer& t) {
    char* address = nullptr;
    return curl_easy_getinfo(t.easy.get(), CURLINFO_PRIMARY_IP, &address) == CURLE_OK && address != nullptr &&
           *address != '\0';
  }

  // The URL the transfer ended at: the request's, or where its redirects led.
  static std::string last_url(Transfer& t) {
    char* url = nullptr;
    if (curl_easy_getinfo(t.easy.get(), CURLINFO_EFFECTIVE_URL, &url) == CURLE_OK && url != nullptr && *url != '\0')
      return url;
    return t.request.url;
  }

  // Turns what the transfer saw into the response handed back.
  HttpResponse result_of(Transfer& t) {
    HttpResponse response = std::move(t.response);
    if (t.local_error) {
      response.error = std::move(t.local_error);
      return response;
    }
    if (t.result == CURLE_OK || t.redirect_refused) return response;
    std::string detail = t.error_buffer[0] != '\0' ? t.error_buffer : curl_easy_strerror(t.result);
    switch (t.result) {
      case CURLE_TOO_MANY_REDIRECTS: {
        // A loop, most likely: the same request would go round it again, so it is the
        // redirect's failure rather than the connection's.
        std::string message = "more than " + std::to_string(kMaxRedirects) + " redirects";
        if (const std::string* location = response.header("location")) message += ", the last to " + *location;
        response.error = make_error(ErrorKind::Http, std::move(message));
        response.error->http_status = response.status;
        break;
      }
      case CURLE_OPERATION_TIMEDOUT:
        // Only the connect stage is left to curl's own clock.
        response.error = make_error(ErrorKind::Timeout, "could not connect within " +
                                                            ms_text(t.request.timeouts.connect) +
                                                            " (connect timeout): " + detail);
        response.error->code = "connect_timeout";  // the server was never reached
        break;
      case CURLE_UNSUPPORTED_PROTOCOL:
        // A redirect to a scheme curl lacks ('Protocol "gopher" not supported') also comes here
        // after a connection: that is no reply in another protocol, and not worth a retry.
        if (connected(t) && detail.find("not supported") == std::string::npos) {
          // Not a scheme curl lacks (that fails before connecting) but the reply: no HTTP
          // status line at all (curl's "HTTP/0.9", from an SSH server's banner, a TLS port
          // spoken to in plain http, any other service), or an HTTP version it does not know.
          // The address is wrong, not batchlm: the message names it.
          const std::string why =
              detail.find("HTTP/0.9") != std::string::npos ? "its reply has no HTTP status line" : detail;
          response.error = make_error(ErrorKind::Protocol, last_url(t) + " does not answer in HTTP: " + why);
          response.error->code = "not_http";
          break;
        }
        response.error = make_error(ErrorKind::Internal, detail);
        break;
      case CURLE_WEIRD_SERVER_REPLY:
        // A reply that starts like HTTP but breaks its form (a header without a colon, a
        // status line curl cannot read): another service, or something between, not a server
        // that went away; "cannot reach" would send the user looking in the wrong place.
        response.error = make_error(ErrorKind::Protocol, last_url(t) + " does not answer in HTTP: its reply is not "
                                                                       "well-formed HTTP (" + detail + ")");
        response.error->code = "not_http";
        break;
      case CURLE_BAD_CONTENT_ENCODING:
        response.error = make_error(ErrorKind::Connection, detail);
        // Before any of the body reached the caller: perform() may send it again undecoded.
        if (t.body_bytes == 0 && t.decode) response.error->code = kUndecodable;
        break;
      case CURLE_URL_MALFORMAT:
      case CURLE_BAD_FUNCTION_ARGUMENT:
      case CURLE_OUT_OF_MEMORY:
        response.error = make_error(ErrorKind::Internal, detail);
        break;
      case CURLE_PEER_FAILED_VERIFICATION:
      case CURLE_SSL_CONNECT_ERROR:
      case CURLE_SSL_CERTPROBLEM:
      case CURLE_SSL_CACERT_BADFILE:
      case CURLE_SSL_ISSUER_ERROR:
      case CURLE_SSL_PINNEDPUBKEYNOTMATCH:
        // No TLS connection could be made: every request to this server meets it alike.
        response.error = make_error(
            ErrorKind::Connection,
            detail + (t.result == CURLE_PEER_FAILED_VERIFICATION
                          ? " (a server whose certificate a private CA signed is trusted with SSL_CERT_FILE or "
                            "CURL_CA_BUNDLE set to that CA's certificate file)"
                      : t.result == CURLE_SSL_CONNECT_ERROR
                          ? " (if the server speaks plain HTTP, the base URL starts with http://)"
                          : ""));
        response.error->code = "tls_failed";
        break;
      case CURLE_COULDNT_RESOLVE_PROXY:
      case CURLE_COULDNT_RESOLVE_HOST:
      case CURLE_COULDNT_CONNECT:
        // Never connected (no such host, nothing listening, refused): told apart from a
        // connection that broke after it was made, which a flaky server gives.
        response.error = make_error(ErrorKind::Connection, detail);
        response.error->code = "connect_failed";
        break;
      case CURLE_GOT_NOTHING:
      case CURLE_RECV_ERROR:
      case CURLE_SEND_ERROR:
        response.error = make_error(ErrorKind::Connection, detail);
        // Taken and closed without a status line: told apart, since a port published for a
        // server that is gone (a container restarting behind it) does just that.
        if (response.status == 0 && connected(t)) response.error->code = "no_reply";
        break;
      default:
        response.error = make_error(ErrorKind::Connection, detail);
        break;
    }
    return response;
  }

  // One transfer, start to finish, in the awaiting coroutine. `request` and `on_body` are lent to
  // it and given back when it ends, so that the caller can send the request again.
  static asio::awaitable<HttpResponse> run(std::shared_ptr<Impl> impl, HttpRequest& request,
                                           BodyHandler& on_body, bool decode);
  // The error code of a response whose Content-Encoding curl could not undo, before any body.
  static constexpr const char* kUndecodable = "undecodable_content_encoding";

  asio::any_io_executor executor;
  HttpClientOptions options;
  MultiHandle multi;
  asio::steady_timer timer;  // curl's one timer
  std::unordered_map<curl_socket_t, std::shared_ptr<Watch>> watches;
  std::unordered_map<Transfer*, std::weak_ptr<Transfer>> transfers;  // attached ones
  std::size_t attached_count = 0;
  bool shut_down = false;
};

namespace {

bool cancellation_requested(const asio::cancellation_state& state) {
  return state.cancelled() != asio::cancellation_type::none;
}

}  // namespace

asio::awaitable<HttpResponse> HttpClient::Impl::run(std::shared_ptr<Impl> impl, HttpRequest& request,
                                                    BodyHandler& on_body, bool decode) {
  auto transfer = std::make_shared<Transfer>(impl->executor);
  Transfer& t = *transfer;
  t.decode = decode;
  t.request = std::move(request);
  t.on_body = std::move(on_body);
  struct GiveBack {
    Transfer& t;
    HttpRequest& request;
    BodyHandler& on_body;
    ~GiveBack() {
      request = std::move(t.request);
      on_body = std::move(t.on_body);
    }
  } give_back{t, request, on_body};
  t.started_at = Clock::now();

  if (impl->shut_down) {
    t.response.error = make_error(ErrorKind::Cancelled, "HTTP client shut down");
    co_return std::move(t.response);
  }
  if (cancellation_requested(co_await asio::this_coro::cancellation_state)) {
    t.response.error = make_error(ErrorKind::Cancelled, "request cancelled");
    co_return std::move(t.response);
  }
  if (!impl->configure(t)) {
    t.response.error = make_error(ErrorKind::Internal, "could not create a transfer");
    co_return std::move(t.response);
  }
  if (const CURLMcode code = curl_multi_add_handle(impl->multi.get(), t.easy.get()); code != CURLM_OK) {
    t.response.error = make_error(ErrorKind::Internal, curl_multi_strerror(code));
    co_return std::move(t.response);
  }
  t.attached = true;
  ++impl->attached_count;
  impl->transfers.emplace(&t, transfer);

  while (!t.done) {
    t.wakeup.expires_at(t.next_deadline().first);
    auto [ec] = co_await t.wakeup.async_wait(asio::as_tuple(asio::use_awaitable));
    if (t.done) break;
    const bool rearm = std::exchange(t.rearm, false);
    if (cancellation_requested(co_await asio::this_coro::cancellation_state) || (ec && !rearm)) {
      impl->finish(t, CURLE_OK, make_error(ErrorKind::Cancelled, "request cancelled"));
      break;
    }
    if (ec) continue;
    // The deadline as it stands now: body data that arrived while we slept (or the request
    // being sent) moved it later, and the loop sleeps again until the new one.
    auto [deadline, reason] = t.next_deadline();
    if (Clock::now() >= deadline) impl->finish(t, CURLE_OK, make_error(ErrorKind::Timeout, reason));
  }
  impl->transfers.erase(&t);
  co_return impl->result_of(t);
}

namespace {

// The CA certificates the environment names, as the curl and OpenSSL command-line tools read
// them (libcurl itself reads none): a private or corporate CA is trusted without root.
HttpClientOptions with_ca_from_environment(HttpClientOptions options) {
  const auto env = [](const char* name) {
    const char* value = std::getenv(name);
    return value != nullptr && *value != '\0' ? std::string(value) : std::string();
  };
  if (options.ca_info.empty()) options.ca_info = env("CURL_CA_BUNDLE");
  if (options.ca_info.empty()) options.ca_info = env("SSL_CERT_FILE");
  if (options.ca_path.empty()) options.ca_path = env("SSL_CERT_DIR");
  return options;
}

}  // namespace

std::string proxy_for(const std::string& url) {
  const std::optional<Origin> origin = origin_of(url);
  if (!origin) return {};
  const auto lower = [](std::string text) {
    std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return text;
  };
  std::string host = origin->host;  // lower-cased; an IPv6 address in brackets
  if (host.starts_with('[') && host.ends_with(']')) host = host.substr(1, host.size() - 2);
  // curl reads the lower-case no_proxy first, the upper-case one when it is unset.
  const char* exempt = std::getenv("no_proxy");
  if (exempt == nullptr) exempt = std::getenv("NO_PROXY");
  if (exempt != nullptr) {
    const std::string list = lower(exempt);
    for (std::size_t start = 0; start <= list.size();) {
      const std::size_t comma = std::min(list.find(',', start), list.size());
      std::string_view entry = trim(std::string_view(list).substr(start, comma - start));
      if (entry.starts_with('.')) entry.remove_prefix(1);
      if (entry == "*" || (!entry.empty() && (host == entry || host.ends_with("." + std::string(entry))))) return {};
      start = comma + 1;
    }
  }
  // libcurl reads http_proxy in lower case only; the others in either case.
  const std::vector<const char*> names = origin->scheme == "https"
                                             ? std::vector<const char*>{"https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"}
                                             : std::vector<const char*>{"http_proxy", "all_proxy", "ALL_PROXY"};
  for (const char* name : names)
    if (const char* value = std::getenv(name); value != nullptr && *value != '\0')
      return std::string(name) + "=" + without_password(value);
  return {};
}

HttpClient::HttpClient(asio::any_io_executor executor, HttpClientOptions options)
    : impl_(std::make_shared<Impl>(executor, with_ca_from_environment(std::move(options)))) {
  if (!impl_->start()) impl_->shut_down = true;
}

HttpClient::~HttpClient() {
  // In-flight transfers end now with Cancelled; their coroutines resume later and still hold
  // the Impl, so nothing they touch is freed under them.
  impl_->shut_down = true;
  auto transfers = std::move(impl_->transfers);
  for (auto& [raw, weak] : transfers) {
    if (auto transfer = weak.lock()) {
      impl_->finish(*transfer, CURLE_OK, make_error(ErrorKind::Cancelled, "HTTP client shut down"));
    }
  }
  impl_->timer.cancel();
  for (auto& [fd, watch] : impl_->watches) impl_->release(*watch);
  impl_->watches.clear();
}

std::size_t HttpClient::in_flight() const { return impl_->attached_count; }

asio::awaitable<HttpResponse> HttpClient::perform(HttpRequest request, BodyHandler on_body) {
  // The cancellation state belongs to the whole coroutine stack: the caller's setting is
  // restored on the way out so that this function only changes how it waits itself.
  const bool caller_throws = co_await asio::this_coro::throw_if_cancelled();
  co_await asio::this_coro::throw_if_cancelled(false);
  HttpResponse response = co_await Impl::run(impl_, request, on_body, true);
  if (response.error && response.error->code == Impl::kUndecodable) {
    // A Content-Encoding curl does not know, which a misconfigured server sends for a body it
    // did not encode (as other HTTP clients, which skip encodings they do not know, read it):
    // once more, the body taken as it comes.
    response = co_await Impl::run(impl_, request, on_body, false);
  }
  co_await asio::this_coro::throw_if_cancelled(caller_throws);
  co_return response;
}

}  // namespace batchlm::client
