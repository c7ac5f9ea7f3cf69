#include "fake_openai_server.hpp"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <ctime>
#include <exception>
#include <fstream>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <utility>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/http/field.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/status.hpp>
#include <boost/beast/http/string_body.hpp>
#include <nlohmann/json.hpp>

namespace batchlm::testing {
namespace {

namespace asio = boost::asio;
namespace http = boost::beast::http;
using tcp = asio::ip::tcp;
using json = nlohmann::json;
constexpr auto use_tuple = asio::as_tuple(asio::use_awaitable);

// ---------------------------------------------------------------------------------------------
// Fault specs

int parse_int(std::string_view key, std::string_view value) {
  int out = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), out);
  if (ec != std::errc{} || end != value.data() + value.size() || out < 0) {
    throw std::invalid_argument("fault spec: bad number for " + std::string(key) + ": " +
                                std::string(value));
  }
  return out;
}

long long parse_ll(std::string_view key, std::string_view value) {
  long long out = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), out);
  if (ec != std::errc{} || end != value.data() + value.size() || out < 0) {
    throw std::invalid_argument("fault spec: bad number for " + std::string(key) + ": " +
                                std::string(value));
  }
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// ---------------------------------------------------------------------------------------------
// Answers

// Splits text into tokens of leading whitespace plus one word, so that the tokens concatenate
// back to the text exactly.
std::vector<std::string> split_words(std::string_view text) {
  std::vector<std::string> out;
  std::size_t i = 0;
  while (i < text.size()) {
    std::size_t start = i;
    while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
    while (i < text.size() && !std::isspace(static_cast<unsigned char>(text[i]))) ++i;
    out.emplace_back(text.substr(start, i - start));
  }
  return out;
}

std::int64_t count_words(std::string_view text) {
  std::int64_t n = 0;
  bool in_word = false;
  for (char c : text) {
    bool space = std::isspace(static_cast<unsigned char>(c)) != 0;
    if (!space && !in_word) ++n;
    in_word = !space;
  }
  return n;
}

struct GsmQuestion {
  std::string question;
  std::string answer;  // what the server says after "####"
};

struct GsmScript {
  std::vector<GsmQuestion> questions;
  mutable std::mutex cache_mutex;
  // Items are retried and re-asked: remember which question a prompt held.
  mutable std::unordered_map<std::string, int> cache;

  const GsmQuestion* find(const std::string& prompt) const {
    {
      std::lock_guard lock(cache_mutex);
      if (auto it = cache.find(prompt); it != cache.end()) {
        return it->second < 0 ? nullptr : &questions[static_cast<std::size_t>(it->second)];
      }
    }
    int best = -1;
    std::size_t best_len = 0;
    for (std::size_t i = 0; i < questions.size(); ++i) {
      const auto& q = questions[i].question;
      // The longest contained question wins, in case one question is a prefix of another.
      if (q.size() > best_len && prompt.find(q) != std::string::npos) {
        best = static_cast<int>(i);
        best_len = q.size();
      }
    }
    std::lock_guard lock(cache_mutex);
    if (cache.size() > 200'000) cache.clear();
    cache.emplace(prompt, best);
    return best < 0 ? nullptr : &questions[static_cast<std::size_t>(best)];
  }
};

std::shared_ptr<const GsmScript> load_gsm8k(const std::string& path, int wrong_every) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open GSM8K file " + path);
  auto script = std::make_shared<GsmScript>();
  std::string line;
  long line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (trim(line).empty()) continue;
    json row = json::parse(line, nullptr, false);
    if (!row.is_object() || !row.contains("question") || !row.contains("answer")) {
      throw std::runtime_error(path + ":" + std::to_string(line_number) + ": not a GSM8K row");
    }
    std::string answer = row["answer"].get<std::string>();
    auto mark = answer.rfind("####");
    std::string gold(trim(mark == std::string::npos ? std::string_view{}
                                                    : std::string_view(answer).substr(mark + 4)));
    std::string said = gold;
    if (wrong_every > 0 && line_number % wrong_every == 0) {
      std::string digits;
      for (char c : gold) {
        if (c != ',') digits += c;
      }
      long long n = 0;
      auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), n);
      said = (ec == std::errc{} && end == digits.data() + digits.size()) ? std::to_string(n + 1)
                                                                         : gold + "1";
    }
    script->questions.push_back({row["question"].get<std::string>(), std::move(said)});
  }
  return script;
}

std::string gsm_reasoning(const std::string& answer) {
  return "Let me solve this step by step. I read the problem, write down each quantity it "
         "gives, and combine them in the order the question asks. The answer is " +
         answer + ".\n#### " + answer;
}

// A stateless mix of the seed, the item and its attempt: the same run always draws the same.
std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

std::string http_date(std::chrono::system_clock::time_point when) {
  std::time_t t = std::chrono::system_clock::to_time_t(when);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%a, %d %b %Y %H:%M:%S GMT", &tm);
  return buf;
}

std::string status_line(int status) {
  auto reason = http::obsolete_reason(http::int_to_status(static_cast<unsigned>(status)));
  std::string out = "HTTP/1.1 " + std::to_string(status) + " ";
  out.append(reason.data(), reason.size());
  out += "\r\n";
  return out;
}

std::string last_user_message(const json& body) {
  std::string out;
  auto messages = body.find("messages");
  if (messages == body.end() || !messages->is_array()) return out;
  for (const auto& m : *messages) {
    if (!m.is_object() || m.value("role", "") != "user") continue;
    out.clear();
    auto content = m.find("content");
    if (content == m.end()) continue;
    if (content->is_string()) {
      out = content->get<std::string>();
    } else if (content->is_array()) {  // content parts: join the text ones
      for (const auto& part : *content) {
        if (part.is_object() && part.value("type", "") == "text") {
          out += part.value("text", "");
        }
      }
    }
  }
  return out;
}

std::int64_t prompt_words(const json& body) {
  std::int64_t n = 0;
  if (auto messages = body.find("messages"); messages != body.end() && messages->is_array()) {
    for (const auto& m : *messages) {
      if (m.is_object() && m.contains("content") && m["content"].is_string()) {
        n += count_words(m["content"].get_ref<const std::string&>());
      }
    }
  }
  return std::max<std::int64_t>(n, 1);
}

// What the API would refuse in a conversation's tool-calling fields (an empty string when
// nothing): an assistant's call without an id, a name or string arguments; a tool message that
// answers no call made before it.
std::string tool_message_problem(const json& body) {
  auto messages = body.find("messages");
  if (messages == body.end() || !messages->is_array()) return {};
  std::set<std::string> called;
  for (std::size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    if (!m.is_object()) continue;
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (auto calls = m.find("tool_calls"); calls != m.end() && calls->is_array()) {
      for (const json& call : *calls) {
        if (!call.is_object() || !call.contains("id") || !call["id"].is_string() || !call.contains("function") ||
            !call["function"].is_object() || !call["function"].contains("name") ||
            !call["function"].contains("arguments") || !call["function"]["arguments"].is_string())
          return "Invalid value for '" + where + ".tool_calls': expected {id, type, function: {name, arguments}}.";
        called.insert(call["id"].get<std::string>());
      }
    }
    if (m.value("role", "") == "tool") {
      auto id = m.find("tool_call_id");
      if (id == m.end() || !id->is_string() || !called.contains(id->get<std::string>()))
        return "Invalid parameter: messages with role 'tool' must be a response to a preceding message with "
               "'tool_calls' (" + where + ").";
    }
  }
  return {};
}

// The content of the last message when it is a tool's result, else null.
const json* last_tool_result(const json& body) {
  auto messages = body.find("messages");
  if (messages == body.end() || !messages->is_array() || messages->empty()) return nullptr;
  const json& last = messages->back();
  if (!last.is_object() || last.value("role", "") != "tool" || !last.contains("content") || !last["content"].is_string())
    return nullptr;
  return &last["content"];
}

// The calls an answer makes: one per function tool (only the first with parallel_tool_calls:
// false), each with the arguments {"query": the last user message, "call": its index} as JSON
// text; none when the request has no tools or the conversation ends with a tool's result.
json tool_calls_for(const json& body, const std::string& item, const std::string& response_id) {
  json calls = json::array();
  auto tools = body.find("tools");
  if (tools == body.end() || !tools->is_array() || last_tool_result(body) != nullptr) return calls;
  const bool parallel = body.value("parallel_tool_calls", true);
  for (const json& tool : *tools) {
    if (!tool.is_object() || !tool.contains("function") || !tool["function"].is_object()) continue;
    const std::string name = tool["function"].value("name", "");
    if (name.empty()) continue;
    const int k = static_cast<int>(calls.size());
    // ASCII (non-ASCII escaped), so the stream may split it anywhere.
    const std::string arguments = json{{"query", item}, {"call", k}}.dump(-1, ' ', true);
    calls.push_back({{"id", "call_" + response_id.substr(response_id.rfind('-') + 1) + "_" + std::to_string(k)},
                     {"type", "function"},
                     {"function", {{"name", name}, {"arguments", arguments}}}});
    if (!parallel) break;
  }
  return calls;
}

// The stream of `calls` as the API sends it: each call's id, type and name with empty
// arguments, then its arguments a few characters at a time, each fragment naming its index.
std::vector<json> tool_call_deltas(const json& calls) {
  std::vector<json> deltas;
  constexpr std::size_t kFragment = 7;
  for (std::size_t k = 0; k < calls.size(); ++k) {
    const json& call = calls[k];
    deltas.push_back({{"tool_calls", json::array({{{"index", k},
                                                   {"id", call["id"]},
                                                   {"type", "function"},
                                                   {"function", {{"name", call["function"]["name"]}, {"arguments", ""}}}}})}});
    const std::string& arguments = call["function"]["arguments"].get_ref<const std::string&>();
    for (std::size_t at = 0; at < arguments.size(); at += kFragment)
      deltas.push_back({{"tool_calls", json::array({{{"index", k},
                                                     {"function", {{"arguments", arguments.substr(at, kFragment)}}}}})}});
  }
  return deltas;
}

const std::string& filler() {
  static const std::string block(1 << 20, 'x');
  return block;
}

}  // namespace

FaultSpec FaultSpec::parse(std::string_view spec) {
  FaultSpec f;
  while (!spec.empty()) {
    auto semi = spec.find(';');
    std::string_view item = trim(spec.substr(0, semi));
    spec = semi == std::string_view::npos ? std::string_view{} : spec.substr(semi + 1);
    if (item.empty()) continue;
    auto eq = item.find('=');
    std::string_view key = trim(item.substr(0, eq));
    std::string_view value = eq == std::string_view::npos ? std::string_view{}
                                                          : trim(item.substr(eq + 1));
    bool has_value = eq != std::string_view::npos;
    auto need_value = [&] {
      if (!has_value) throw std::invalid_argument("fault spec: " + std::string(key) + " needs =value");
    };
    if (key == "status") {
      need_value();
      f.status = parse_int(key, value);
      if (f.status < 100 || f.status > 599) throw std::invalid_argument("fault spec: bad status");
    } else if (key == "retry_after") {
      need_value();
      f.retry_after = std::string(value);
    } else if (key == "retry_after_date") {
      need_value();
      f.retry_after_date_s = parse_int(key, value);
    } else if (key == "retry_after_ms") {
      need_value();
      f.retry_after_ms = parse_ll(key, value);
    } else if (key == "should_retry") {
      need_value();
      if (value != "true" && value != "false") throw std::invalid_argument("fault spec: should_retry=true|false");
      f.should_retry = value == "true";
    } else if (key == "code") {
      need_value();
      f.code = std::string(value);
    } else if (key == "message") {
      need_value();
      f.message = std::string(value);
    } else if (key == "no_body") {
      f.no_body = true;
    } else if (key == "after") {
      need_value();
      f.after = parse_int(key, value);
    } else if (key == "reset_after") {
      need_value();
      f.reset_after = parse_int(key, value);
    } else if (key == "stall_ms") {
      need_value();
      f.stall_ms = parse_int(key, value);
    } else if (key == "truncate") {
      f.truncate = true;
    } else if (key == "error_event") {
      f.error_event = true;
    } else if (key == "event_error") {
      f.event_error = true;
    } else if (key == "malformed") {
      f.malformed = true;
    } else if (key == "crlf") {
      f.crlf = true;
    } else if (key == "cr") {
      f.cr = true;
    } else if (key == "byte_chunks") {
      f.byte_chunks = true;
    } else if (key == "ignore_stream") {
      f.ignore_stream = true;
    } else if (key == "no_usage") {
      f.no_usage = true;
    } else if (key == "oversize") {
      f.oversize_bytes = has_value ? static_cast<std::size_t>(parse_ll(key, value))
                                   : std::size_t{100} << 20;
    } else if (key == "slow_first_byte") {
      need_value();
      f.slow_first_byte_ms = parse_int(key, value);
    } else if (key == "at_end") {
      f.at_end = true;
    } else if (key == "pings") {
      need_value();
      f.pings = parse_int(key, value);
    } else if (key == "ping_ms") {
      need_value();
      f.ping_ms = parse_int(key, value);
    } else if (key == "late_text") {
      need_value();
      f.late_text = std::string(value);
    } else if (key == "gzip") {
      f.gzip = true;
    } else if (key == "content_encoding") {
      need_value();
      f.content_encoding = std::string(value);
    } else if (key == "html") {
      f.html = true;
    } else if (key == "redirect") {
      need_value();
      f.redirect = parse_int(key, value);
      if (f.redirect < 300 || f.redirect > 399) throw std::invalid_argument("fault spec: redirect needs a 3xx status");
    } else if (key == "location") {
      need_value();
      f.location = std::string(value);
    } else {
      throw std::invalid_argument("fault spec: unknown key " + std::string(key));
    }
  }
  return f;
}

// ---------------------------------------------------------------------------------------------

struct FakeOpenAIServer::Impl {
  // Declared before the io_context so that they outlive the coroutine frames it destroys.
  mutable std::mutex mutex;
  FakeOpenAIOptions options;
  std::shared_ptr<const GsmScript> gsm8k;
  std::vector<FaultRule> rules;
  FakeOpenAIStats stats;
  // What /_reset and reset_stats() both do.
  void reset_stats() {
    std::lock_guard lock(mutex);
    stats.requests = 0;
    stats.authorized = 0;
    stats.per_item.clear();
    stats.arrival_ms.clear();
    stats.last_body.clear();
    started = std::chrono::steady_clock::now();
  }
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  std::atomic<std::uint64_t> response_ids{0};

  std::string host;
  std::uint16_t port = 0;
  asio::io_context ioc;
  tcp::acceptor acceptor{ioc};
  std::vector<std::thread> threads;

  asio::awaitable<void> accept_loop();
  asio::awaitable<void> serve_connection(tcp::socket socket);
  // Each returns false when the connection must not be used again.
  asio::awaitable<bool> handle(tcp::socket& socket, http::request<http::string_body>& request);
  asio::awaitable<bool> chat(tcp::socket& socket, const http::request<http::string_body>& request,
                             bool keep_alive);
  std::optional<FaultSpec> draw_fault(const std::string& item, std::uint64_t attempt) const;
};

namespace {

asio::awaitable<boost::system::error_code> write_all(tcp::socket& socket, std::string_view bytes) {
  auto [ec, n] = co_await asio::async_write(socket, asio::buffer(bytes.data(), bytes.size()),
                                            use_tuple);
  (void)n;
  co_return ec;
}

asio::awaitable<void> sleep_ms(int ms) {
  if (ms <= 0) co_return;
  asio::steady_timer timer(co_await asio::this_coro::executor, std::chrono::milliseconds(ms));
  co_await timer.async_wait(use_tuple);
}

// Closing with SO_LINGER 0 makes the kernel send RST instead of FIN: the peer sees
// "connection reset by peer", as when a proxy or server dies mid-response.
void reset_connection(tcp::socket& socket) {
  boost::system::error_code ec;
  socket.set_option(asio::socket_base::linger(true, 0), ec);
  socket.close(ec);
}

// `data` in the gzip format (RFC 1952) without compression: its deflate stream is stored blocks
// (RFC 1951 3.2.4), which any gzip decoder reads.
std::string gzip_stored(std::string_view data) {
  std::uint32_t crc = 0xFFFFFFFFu;
  for (const char c : data) {
    crc ^= static_cast<unsigned char>(c);
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  crc ^= 0xFFFFFFFFu;
  const auto le32 = [](std::string& out, std::uint32_t v) {
    for (int k = 0; k < 4; ++k) out += static_cast<char>((v >> (8 * k)) & 0xFF);
  };
  std::string out("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff", 10);
  std::size_t at = 0;
  do {
    const std::size_t n = std::min<std::size_t>(data.size() - at, 65535);
    const bool last = at + n == data.size();
    out += static_cast<char>(last ? 1 : 0);
    out += static_cast<char>(n & 0xFF);
    out += static_cast<char>(n >> 8);
    out += static_cast<char>(~n & 0xFF);
    out += static_cast<char>((~n >> 8) & 0xFF);
    out.append(data.substr(at, n));
    at += n;
  } while (at < data.size());
  le32(out, crc);
  le32(out, static_cast<std::uint32_t>(data.size()));
  return out;
}

std::string simple_response(int status, std::string_view content_type, std::string_view body,
                            bool keep_alive, std::string_view extra_headers = {}) {
  std::string out = status_line(status);
  out += "Content-Type: ";
  out += content_type;
  out += "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  out += extra_headers;
  if (!keep_alive) out += "Connection: close\r\n";
  out += "\r\n";
  out += body;
  return out;
}

std::string error_body(std::string_view message, std::string_view type, std::string_view code) {
  json err = {{"message", message}, {"type", type}, {"param", nullptr}};
  err["code"] = code.empty() ? json(nullptr) : json(code);
  return json{{"error", err}}.dump();
}

// Writes SSE events as HTTP chunks, with the line ends and chunking a fault asks for.
class EventStream {
 public:
  EventStream(tcp::socket& socket, const FaultSpec& fault)
      : socket_(socket), eol_(fault.cr ? "\r" : fault.crlf ? "\r\n" : "\n"),
        byte_chunks_(fault.byte_chunks) {}

  asio::awaitable<boost::system::error_code> data(std::string_view payload) {
    std::string text = "data: ";
    text += payload;
    text += eol_;
    text += eol_;
    co_return co_await chunk(text);
  }

  asio::awaitable<boost::system::error_code> typed(std::string_view type, std::string_view payload) {
    std::string text = "event: ";
    text += type;
    text += eol_;
    text += "data: ";
    text += payload;
    text += eol_;
    text += eol_;
    co_return co_await chunk(text);
  }

  asio::awaitable<boost::system::error_code> chunk(std::string_view text) {
    if (text.empty()) co_return boost::system::error_code{};
    if (byte_chunks_) {
      for (char c : text) {
        std::string one = "1\r\n";
        one += c;
        one += "\r\n";
        if (auto ec = co_await write_all(socket_, one)) co_return ec;
      }
      co_return boost::system::error_code{};
    }
    char size[32];
    auto [end, ec] = std::to_chars(size, size + sizeof size, text.size(), 16);
    (void)ec;
    std::string framed(size, end);
    framed += "\r\n";
    framed += text;
    framed += "\r\n";
    co_return co_await write_all(socket_, framed);
  }

  // One chunk of `total` bytes: prefix, filler, suffix, written in pieces to keep memory flat.
  asio::awaitable<boost::system::error_code> giant_chunk(std::string_view prefix, std::size_t total,
                                                         std::string_view suffix) {
    char size[32];
    auto [end, ec0] = std::to_chars(size, size + sizeof size, total, 16);
    (void)ec0;
    std::string head(size, end);
    head += "\r\n";
    head += prefix;
    if (auto ec = co_await write_all(socket_, head)) co_return ec;
    std::size_t fill = total - prefix.size() - suffix.size();
    while (fill > 0) {
      std::size_t n = std::min(fill, filler().size());
      if (auto ec = co_await write_all(socket_, std::string_view(filler()).substr(0, n))) co_return ec;
      fill -= n;
    }
    std::string tail(suffix);
    tail += "\r\n";
    co_return co_await write_all(socket_, tail);
  }

  asio::awaitable<boost::system::error_code> end() {
    co_return co_await write_all(socket_, "0\r\n\r\n");
  }

  std::string_view eol() const { return eol_; }

 private:
  tcp::socket& socket_;
  std::string eol_;
  bool byte_chunks_;
};

}  // namespace

asio::awaitable<void> FakeOpenAIServer::Impl::accept_loop() {
  for (;;) {
    auto [ec, socket] = co_await acceptor.async_accept(use_tuple);
    if (ec) {
      if (ec == asio::error::operation_aborted || !acceptor.is_open()) co_return;
      // Out of descriptors under a benchmark's load: back off instead of spinning.
      co_await sleep_ms(10);
      continue;
    }
    {
      std::lock_guard lock(mutex);
      ++stats.connections;
    }
    auto executor = socket.get_executor();
    asio::co_spawn(executor, serve_connection(std::move(socket)),
                   [](std::exception_ptr) { /* a broken connection ends only itself */ });
  }
}

asio::awaitable<void> FakeOpenAIServer::Impl::serve_connection(tcp::socket socket) {
  boost::system::error_code ec;
  // Every chunk must leave at once: tests count on chunk boundaries and on timing.
  socket.set_option(tcp::no_delay(true), ec);
  boost::beast::flat_buffer buffer;
  for (;;) {
    http::request_parser<http::string_body> parser;
    parser.body_limit(64 << 20);
    auto [header_ec, header_bytes] = co_await http::async_read_header(socket, buffer, parser, use_tuple);
    (void)header_bytes;
    if (header_ec) break;
    // Clients hold back large bodies until told to go on; without this they wait a second.
    if (auto expect = parser.get().find(http::field::expect);
        expect != parser.get().end() && boost::beast::iequals(expect->value(), "100-continue")) {
      if (co_await write_all(socket, "HTTP/1.1 100 Continue\r\n\r\n")) break;
    }
    auto [read_ec, n] = co_await http::async_read(socket, buffer, parser, use_tuple);
    (void)n;
    if (read_ec) break;
    auto request = parser.release();
    bool keep_alive = request.keep_alive();
    bool usable = co_await handle(socket, request);
    if (!usable || !keep_alive || !socket.is_open()) break;
  }
  if (socket.is_open()) {
    socket.shutdown(tcp::socket::shutdown_send, ec);
    socket.close(ec);
  }
}

asio::awaitable<bool> FakeOpenAIServer::Impl::handle(tcp::socket& socket,
                                                     http::request<http::string_body>& request) {
  bool keep_alive = request.keep_alive();
  std::string_view target(request.target().data(), request.target().size());
  target = target.substr(0, target.find('?'));
  auto method = request.method();

  if (target == "/v1/chat/completions" && method == http::verb::post) {
    co_return co_await chat(socket, request, keep_alive);
  }
  std::string reply;
  if (target == "/v1/models" && method == http::verb::get) {
    json models = {{"object", "list"},
                   {"data", json::array({{{"id", "fake-model"},
                                          {"object", "model"},
                                          {"created", 0},
                                          {"owned_by", "batchlm"}}})}};
    reply = simple_response(200, "application/json", models.dump(), keep_alive);
  } else if (target == "/_stats" && method == http::verb::get) {
    json out;
    {
      std::lock_guard lock(mutex);
      out = {{"requests", stats.requests},
             {"connections", stats.connections},
             {"authorized", stats.authorized},
             {"per_item", stats.per_item},
             {"arrival_ms", stats.arrival_ms},
             {"last_body", stats.last_body}};
    }
    reply = simple_response(200, "application/json", out.dump(), keep_alive);
  } else if (target == "/_reset" && method == http::verb::post) {
    reset_stats();
    reply = simple_response(200, "application/json", R"({"ok":true})", keep_alive);
  } else {
    reply = simple_response(404, "application/json",
                            error_body("no such route", "invalid_request_error", "not_found"),
                            keep_alive);
  }
  co_return !co_await write_all(socket, reply);
}

std::optional<FaultSpec> FakeOpenAIServer::Impl::draw_fault(const std::string& item,
                                                            std::uint64_t attempt) const {
  std::lock_guard lock(mutex);
  std::uint64_t item_hash = fnv1a(item);
  for (std::size_t i = 0; i < rules.size(); ++i) {
    const FaultRule& rule = rules[i];
    if (rule.faults.empty()) continue;
    if (!rule.only_item.empty() && item.find(rule.only_item) == std::string::npos) continue;
    if (rule.first_attempts_only > 0 &&
        attempt > static_cast<std::uint64_t>(rule.first_attempts_only)) {
      continue;
    }
    std::uint64_t h = splitmix(rule.seed ^ splitmix(item_hash ^ splitmix(attempt * 31 + i)));
    double u = static_cast<double>(h >> 11) * 0x1.0p-53;
    if (u < rule.probability) {
      return rule.faults[splitmix(h) % rule.faults.size()];
    }
  }
  return std::nullopt;
}

asio::awaitable<bool> FakeOpenAIServer::Impl::chat(tcp::socket& socket,
                                                   const http::request<http::string_body>& request,
                                                   bool keep_alive) {
  json body = json::parse(request.body(), nullptr, false);
  if (!body.is_object()) {
    co_return !co_await write_all(
        socket, simple_response(400, "application/json",
                                error_body("body is not a JSON object", "invalid_request_error", ""),
                                keep_alive));
  }
  const std::string item = last_user_message(body);
  const bool stream = body.value("stream", false);
  bool include_usage = false;
  if (auto so = body.find("stream_options"); so != body.end() && so->is_object()) {
    include_usage = so->value("include_usage", false);
  }
  std::optional<std::int64_t> max_tokens;
  if (auto it = body.find("max_completion_tokens"); it != body.end() && it->is_number_integer()) {
    max_tokens = it->get<std::int64_t>();
  }
  if (auto it = body.find("max_tokens"); it != body.end() && it->is_number_integer()) {
    max_tokens = it->get<std::int64_t>();
  }
  const std::string model = body.contains("model") && body["model"].is_string()
                                ? body["model"].get<std::string>()
                                : std::string("fake-model");

  FakeOpenAIOptions opts;
  std::shared_ptr<const GsmScript> script;
  std::uint64_t attempt = 0;
  {
    std::lock_guard lock(mutex);
    ++stats.requests;
    stats.arrival_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count());
    if (request.find(http::field::authorization) != request.end()) ++stats.authorized;
    const auto values = [&](http::field name) {
      std::string all;
      const auto [first, last] = request.equal_range(name);
      for (auto it = first; it != last; ++it) all += std::string(it->value()) + "\n";
      return all;
    };
    stats.last_authorization = values(http::field::authorization);
    stats.last_content_type = values(http::field::content_type);
    stats.last_body = request.body();
    attempt = ++stats.per_item[item];
    opts = options;
    script = gsm8k;
  }

  std::optional<FaultSpec> fault;
  if (auto it = request.find("x-fake-fault"); it != request.end()) {
    std::string bad_spec;
    try {
      fault = FaultSpec::parse(std::string_view(it->value().data(), it->value().size()));
    } catch (const std::invalid_argument& e) {
      bad_spec = e.what();
    }
    if (!bad_spec.empty()) {
      co_return !co_await write_all(
          socket, simple_response(400, "application/json",
                                  error_body(bad_spec, "invalid_request_error", "bad_fault"),
                                  keep_alive));
    }
  } else {
    fault = draw_fault(item, attempt);
  }
  const FaultSpec f = fault.value_or(FaultSpec{});

  co_await sleep_ms(f.slow_first_byte_ms);

  if (f.redirect != 0) {
    co_return !co_await write_all(socket, simple_response(f.redirect, "text/plain", "", keep_alive,
                                                          "Location: " + f.location + "\r\n"));
  }
  if (f.html) {
    co_return !co_await write_all(
        socket, simple_response(200, "text/html; charset=utf-8",
                                "<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>"
                                "<p>Please sign in to continue to the network.</p></body></html>\n",
                                keep_alive));
  }
  if (f.status != 0) {
    std::string headers;
    if (f.retry_after) headers += "Retry-After: " + *f.retry_after + "\r\n";
    if (f.retry_after_date_s) {
      headers += "Retry-After: " +
                 http_date(std::chrono::system_clock::now() +
                           std::chrono::seconds(*f.retry_after_date_s)) +
                 "\r\n";
    }
    if (f.retry_after_ms) headers += "retry-after-ms: " + std::to_string(*f.retry_after_ms) + "\r\n";
    if (f.should_retry) headers += std::string("x-should-retry: ") + (*f.should_retry ? "true" : "false") + "\r\n";
    std::string type = f.status == 429 ? "rate_limit_error"
                       : f.status >= 500 ? "server_error"
                                         : "invalid_request_error";
    if (f.code == "insufficient_quota") type = "insufficient_quota";
    std::string payload = f.no_body ? std::string() : error_body(f.message, type, f.code);
    co_return !co_await write_all(
        socket, simple_response(f.status, "application/json", payload, keep_alive, headers));
  }

  if (const std::string problem = tool_message_problem(body); !problem.empty()) {
    co_return !co_await write_all(
        socket, simple_response(400, "application/json", error_body(problem, "invalid_request_error", ""), keep_alive));
  }
  const std::string id = "chatcmpl-fake-" + std::to_string(++response_ids);
  // With tools and no tool result yet, the answer calls them; after a tool's result it quotes
  // it; else a scripted GSM8K solution when the prompt holds a known question, else words.
  const json calls = tool_calls_for(body, item, id);
  const json* tool_result = last_tool_result(body);
  const GsmQuestion* question = script ? script->find(item) : nullptr;
  std::vector<std::string> tokens = split_words(
      tool_result ? "The tool said: " + tool_result->get<std::string>()
      : question  ? gsm_reasoning(question->answer)
                  : FakeOpenAIServer::generated_text(opts.tokens));
  std::string finish_reason = "stop";
  if (max_tokens && *max_tokens >= 0 && static_cast<std::size_t>(*max_tokens) < tokens.size()) {
    tokens.resize(static_cast<std::size_t>(*max_tokens));
    finish_reason = "length";
  }
  // A model named as a reasoner (DeepSeek's "deepseek-reasoner") reasons first, and gives its
  // reasoning apart from the content, as `reasoning_content`.
  const std::vector<std::string> reasoning =
      model.find("reasoner") != std::string::npos ? split_words("First I read the question, then I answer it.")
                                                  : std::vector<std::string>();
  // What the stream sends, one delta per chunk.
  std::vector<json> deltas;
  for (const auto& t : reasoning) deltas.push_back({{"reasoning_content", t}});
  if (calls.empty()) {
    for (const auto& t : tokens) deltas.push_back({{"content", t}});
  } else {
    for (json& d : tool_call_deltas(calls)) deltas.push_back(std::move(d));
    finish_reason = "tool_calls";
  }
  const std::int64_t prompt_tokens = prompt_words(body);
  const auto completion_tokens = static_cast<std::int64_t>(deltas.size());
  const std::int64_t created = std::time(nullptr);
  const json usage = {{"prompt_tokens", prompt_tokens},
                      {"completion_tokens", completion_tokens},
                      {"total_tokens", prompt_tokens + completion_tokens}};

  if (!stream || f.ignore_stream) {
    if (f.reset_after) {
      reset_connection(socket);
      co_return false;
    }
    if (f.oversize_bytes) {
      std::string prefix = R"({"id":")" + id +
                           R"(","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":")";
      std::string suffix = R"("},"finish_reason":"stop"}]})";
      std::size_t total = std::max(*f.oversize_bytes, prefix.size() + suffix.size());
      std::string head = status_line(200) + "Content-Type: application/json\r\nContent-Length: " +
                         std::to_string(total) + "\r\n\r\n" + prefix;
      if (co_await write_all(socket, head)) co_return false;
      std::size_t fill = total - prefix.size() - suffix.size();
      while (fill > 0) {
        std::size_t n = std::min(fill, filler().size());
        if (co_await write_all(socket, std::string_view(filler()).substr(0, n))) co_return false;
        fill -= n;
      }
      co_return !co_await write_all(socket, suffix);
    }
    co_await sleep_ms(opts.ttft_ms);
    std::string text;
    for (const auto& t : tokens) text += t;
    json message = {{"role", "assistant"}, {"content", text}};
    if (!calls.empty()) message = {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", calls}};
    if (!reasoning.empty()) {
      std::string thought;
      for (const auto& t : reasoning) thought += t;
      message["reasoning_content"] = thought;
    }
    json reply = {{"id", id},
                  {"object", "chat.completion"},
                  {"created", created},
                  {"model", model},
                  {"choices", json::array({{{"index", 0},
                                            {"message", std::move(message)},
                                            {"finish_reason", finish_reason}}})},
                  {"usage", usage}};
    if (f.no_usage) reply.erase("usage");
    std::string response =
        f.gzip ? simple_response(200, "application/json", gzip_stored(reply.dump()), keep_alive, "Content-Encoding: gzip\r\n")
        : f.content_encoding
            ? simple_response(200, "application/json", reply.dump(), keep_alive, "Content-Encoding: " + *f.content_encoding + "\r\n")
            : simple_response(200, "application/json", reply.dump(), keep_alive);
    if (f.truncate) {
      // Fewer bytes than Content-Length promised, then the connection closes.
      co_await write_all(socket, std::string_view(response).substr(0, response.size() - reply.dump().size() / 2));
      boost::system::error_code ec;
      socket.shutdown(tcp::socket::shutdown_send, ec);
      socket.close(ec);
      co_return false;
    }
    co_return !co_await write_all(socket, response);
  }

  // Streaming.
  std::string head = status_line(200) +
                     "Content-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     "Transfer-Encoding: chunked\r\n";
  if (!keep_alive) head += "Connection: close\r\n";
  head += "\r\n";
  if (co_await write_all(socket, head)) co_return false;

  EventStream events(socket, f);
  auto chunk_json = [&](json delta, json finish, int index = 0) {
    return json{{"id", id},
                {"object", "chat.completion.chunk"},
                {"created", created},
                {"model", model},
                {"choices", json::array({{{"index", index},
                                          {"delta", std::move(delta)},
                                          {"finish_reason", std::move(finish)}}})}}
        .dump();
  };
  // "n": several answers, their chunks interleaved as OpenAI sends them; choice k > 0 says
  // "alt<k>-" before each word.
  const int choices = calls.empty() && reasoning.empty() && body.contains("n") && body["n"].is_number_integer()
                          ? std::clamp(body["n"].get<int>(), 1, 8)
                          : 1;

  co_await sleep_ms(opts.ttft_ms);
  // Built before the co_await: a braced initialiser list alive across a suspension point is
  // more than some compilers' coroutine frames can hold.
  const std::string role_chunk = chunk_json({{"role", "assistant"}, {"content", ""}}, nullptr);
  if (co_await events.data(role_chunk)) co_return false;

  if (f.oversize_bytes) {
    std::string prefix = "data: " + json{{"id", id}, {"object", "chat.completion.chunk"}}.dump();
    prefix.pop_back();  // reopen the object to append the giant content
    prefix += R"(,"choices":[{"index":0,"delta":{"content":")";
    std::string suffix = R"("},"finish_reason":null}]})";
    suffix += events.eol();
    suffix += events.eol();
    std::size_t total = std::max(*f.oversize_bytes, prefix.size() + suffix.size());
    if (co_await events.giant_chunk(prefix, total, suffix)) co_return false;
    if (co_await events.data("[DONE]")) co_return false;
    co_return !co_await events.end();
  }

  const bool mid_stream_fault = !f.at_end && (f.reset_after || f.stall_ms > 0 || f.truncate || f.error_event ||
                                               f.event_error || f.malformed);
  const std::size_t fault_at =
      std::min<std::size_t>(static_cast<std::size_t>(f.reset_after.value_or(f.after)), deltas.size());

  for (std::size_t i = 0; i <= deltas.size(); ++i) {
    if (mid_stream_fault && i == fault_at) {
      if (f.reset_after) {
        reset_connection(socket);
        co_return false;
      }
      if (f.stall_ms > 0) co_await sleep_ms(f.stall_ms);
      if (f.truncate) co_return !co_await events.end();
      if (f.error_event || f.event_error) {
        std::string err = error_body(f.message, "server_error", f.code.empty() ? "server_error" : f.code);
        auto ec = f.event_error ? co_await events.typed("error", err) : co_await events.data(err);
        if (ec) co_return false;
        co_return !co_await events.end();
      }
      if (f.malformed) {
        if (co_await events.data(R"({"id":")" + id + R"(","choices":[{"index":0,"delta":{"content":"oops")")) {
          co_return false;
        }
      }
    }
    if (i == deltas.size()) break;
    if (i > 0) co_await sleep_ms(opts.token_delay_ms);
    const std::string content_chunk = chunk_json(deltas[i], nullptr);
    if (co_await events.data(content_chunk)) co_return false;
    for (int k = 1; k < choices; ++k) {
      const std::string other = chunk_json({{"content", "alt" + std::to_string(k) + "-" + tokens[i]}}, nullptr, k);
      if (co_await events.data(other)) co_return false;
    }
  }

  for (int k = choices - 1; k >= 1; --k) {
    const std::string other_end = chunk_json(json::object(), finish_reason, k);
    if (co_await events.data(other_end)) co_return false;
  }
  if (co_await events.data(chunk_json(json::object(), finish_reason))) co_return false;
  if (f.late_text) {
    const std::string late = chunk_json({{"content", *f.late_text}}, nullptr);
    if (co_await events.data(late)) co_return false;
  }
  if (include_usage && !f.no_usage) {
    json usage_chunk = {{"id", id},
                        {"object", "chat.completion.chunk"},
                        {"created", created},
                        {"model", model},
                        {"choices", json::array()},
                        {"usage", usage}};
    if (co_await events.data(usage_chunk.dump())) co_return false;
  }
  for (int i = 0; i < f.pings; ++i) {
    co_await sleep_ms(f.ping_ms);
    std::string comment = ": ping";
    comment += events.eol();
    comment += events.eol();
    if (co_await events.chunk(comment)) co_return false;
  }
  if (f.at_end) {
    if (f.reset_after) {
      // Long enough for the chunks to reach the client before the reset does.
      co_await sleep_ms(50);
      reset_connection(socket);
      co_return false;
    }
    if (f.stall_ms > 0) co_await sleep_ms(f.stall_ms);
    if (f.truncate) co_return !co_await events.end();
  }
  if (co_await events.data("[DONE]")) co_return false;
  co_return !co_await events.end();
}

// ---------------------------------------------------------------------------------------------

FakeOpenAIServer::FakeOpenAIServer(FakeOpenAIOptions options, int threads, std::string host,
                                   std::uint16_t port)
    : impl_(std::make_shared<Impl>()) {
  impl_->host = std::move(host);
  set_options(std::move(options));
  tcp::endpoint endpoint(asio::ip::make_address(impl_->host), port);
  impl_->acceptor.open(endpoint.protocol());
  impl_->acceptor.set_option(asio::socket_base::reuse_address(true));
  impl_->acceptor.bind(endpoint);
  // Benchmarks open thousands of connections at once.
  impl_->acceptor.listen(asio::socket_base::max_listen_connections);
  impl_->port = impl_->acceptor.local_endpoint().port();
  asio::co_spawn(impl_->ioc, impl_->accept_loop(), asio::detached);
  for (int i = 0; i < std::max(threads, 1); ++i) {
    impl_->threads.emplace_back([impl = impl_.get()] { impl->ioc.run(); });
  }
}

FakeOpenAIServer::~FakeOpenAIServer() {
  // Stopping the io_context abandons every connection; its destruction (with Impl) frees them.
  impl_->ioc.stop();
  for (auto& t : impl_->threads) t.join();
}

std::uint16_t FakeOpenAIServer::port() const { return impl_->port; }
std::string FakeOpenAIServer::host() const { return impl_->host; }

std::string FakeOpenAIServer::base_url() const {
  std::string host = impl_->host.find(':') != std::string::npos ? "[" + impl_->host + "]" : impl_->host;
  return "http://" + host + ":" + std::to_string(impl_->port) + "/v1";
}

FakeOpenAIStats FakeOpenAIServer::stats() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->stats;
}

std::uint64_t FakeOpenAIServer::requests() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->stats.requests;
}

std::uint64_t FakeOpenAIServer::connections() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->stats.connections;
}

std::uint64_t FakeOpenAIServer::requests_for(const std::string& item) const {
  std::lock_guard lock(impl_->mutex);
  auto it = impl_->stats.per_item.find(item);
  return it == impl_->stats.per_item.end() ? 0 : it->second;
}

void FakeOpenAIServer::reset_stats() { impl_->reset_stats(); }

void FakeOpenAIServer::set_options(FakeOpenAIOptions options) {
  std::shared_ptr<const GsmScript> script;
  bool reload = false;
  {
    std::lock_guard lock(impl_->mutex);
    reload = options.gsm8k_path != impl_->options.gsm8k_path ||
             options.wrong_every != impl_->options.wrong_every || !impl_->gsm8k;
  }
  if (!options.gsm8k_path.empty() && reload) {
    script = load_gsm8k(options.gsm8k_path, options.wrong_every);  // outside the lock: it is slow
  }
  std::lock_guard lock(impl_->mutex);
  if (options.gsm8k_path.empty()) {
    impl_->gsm8k.reset();
  } else if (script) {
    impl_->gsm8k = std::move(script);
  }
  impl_->options = std::move(options);
}

void FakeOpenAIServer::set_rules(std::vector<FaultRule> rules) {
  std::lock_guard lock(impl_->mutex);
  impl_->rules = std::move(rules);
}

void FakeOpenAIServer::clear_rules() { set_rules({}); }

std::string FakeOpenAIServer::generated_text(int tokens) {
  static constexpr std::string_view words[] = {
      "the",  "quick", "brown", "fox",   "jumps", "over",  "a",     "lazy",
      "dog",  "while", "seven", "small", "birds", "sing",  "in",    "tall",
      "green", "trees", "near", "the",   "old",   "stone", "bridge", "today"};
  std::string out;
  for (int i = 0; i < tokens; ++i) {
    if (i > 0) out += ' ';
    out += words[static_cast<std::size_t>(i) % std::size(words)];
  }
  return out;
}

}  // namespace batchlm::testing
