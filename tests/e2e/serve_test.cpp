// `batchlm serve` end to end: the real executable as a child process on a free loopback port,
// spoken to with the curl command-line tool, raw sockets (to hang up mid-response), the
// official Python `openai` client, and `batchlm run --base-url`. Most tests serve a tiny
// random-weight model written into the test's directory; the few that need real text use the
// default model and are skipped when it is absent.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <regex>

#include "gguf_writer.hpp"
#include "harness.hpp"

namespace batchlm::e2e {
namespace {

const fs::path kRealModel = fs::path(BATCHLM_SOURCE_DIR) / "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const fs::path kPython = fs::path(BATCHLM_SOURCE_DIR) / ".venv/bin/python";
const fs::path kClientCheck = fs::path(BATCHLM_SOURCE_DIR) / "tests/e2e/openai_client_check.py";
const fs::path kMetricsCheck = fs::path(BATCHLM_SOURCE_DIR) / "tests/e2e/metrics_check.py";
constexpr const char* kCurl = "/usr/bin/curl";

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Polls `done` every 20 ms until it holds or `timeout` passes; returns whether it held.
template <typename F>
bool wait_until(F done, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (done()) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
}

// ---- the server as a child process ----------------------------------------------------------

// `batchlm serve ... --port 0` with stdout on a pipe (read for the port) and stderr in a file.
// The destructor kills and reaps it when the test has not.
class ServeProcess {
 public:
  ServeProcess(const fs::path& dir, std::vector<std::string> args, std::map<std::string, std::string> env = {},
               std::chrono::milliseconds startup = 60s)
      : err_file_(dir / ("serve-" + std::to_string(++count_) + ".err")) {
    args.insert(args.begin(), {binary("batchlm"), "serve", "--host", "127.0.0.1", "--port", "0"});
    // Not passed on: the server's limit on open files (RLIMIT_NOFILE), for tests that run out.
    long nofile = 0;
    if (const auto it = env.find(kNofileLimit); it != env.end()) {
      nofile = std::stol(it->second);
      env.erase(it);
    }
    env.emplace("BATCHLM_API_KEY", "");
    env.emplace("BATCHLM_MODEL", "");
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string kv = *e;
      if (!env.contains(kv.substr(0, kv.find('=')))) env_strings.push_back(kv);
    }
    for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);

    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::dup2(fds[1], STDOUT_FILENO);
      const int err = ::open(err_file_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(err, STDERR_FILENO);
      ::dup2(::open("/dev/null", O_RDONLY), STDIN_FILENO);
      if (::chdir(dir.c_str()) != 0) ::_exit(127);
      if (nofile > 0) {
        const rlimit limit{static_cast<rlim_t>(nofile), static_cast<rlim_t>(nofile)};
        if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) ::_exit(126);
      }
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    out_fd_ = fds[0];
    try {
      read_listening_line(startup);
    } catch (...) {
      stop();  // the destructor does not run for an object that was never constructed
      throw;
    }
  }

  ~ServeProcess() { stop(); }

  ServeProcess(const ServeProcess&) = delete;
  ServeProcess& operator=(const ServeProcess&) = delete;

  int port() const { return port_; }
  const std::string& model() const { return model_; }
  const std::string& listening_line() const { return line_; }
  std::string base_url() const { return "http://127.0.0.1:" + std::to_string(port_) + "/v1"; }
  std::string url(const std::string& path) const { return "http://127.0.0.1:" + std::to_string(port_) + path; }
  std::string stderr_text() const { return read_file(err_file_); }
  void signal(int sig) const { ::kill(pid_, sig); }
  static constexpr const char* kNofileLimit = "(test) RLIMIT_NOFILE";

  // CPU seconds the server has used so far (user + system, /proc/PID/stat).
  double cpu_seconds() const {
    const std::string stat = read_file(fs::path("/proc") / std::to_string(pid_) / "stat");
    std::istringstream fields(stat.substr(stat.rfind(')') + 2));
    std::string field;
    long long utime = 0, stime = 0;
    for (int i = 3; fields >> field; ++i) {
      if (i == 14) utime = std::stoll(field);
      if (i == 15) {
        stime = std::stoll(field);
        break;
      }
    }
    return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
  }

  // The server's resident memory (VmRSS in /proc/PID/status), in KiB; -1 when unreadable.
  long long resident_kib() const {
    const std::string status = read_file(fs::path("/proc") / std::to_string(pid_) / "status");
    const std::size_t at = status.find("VmRSS:");
    if (at == std::string::npos) return -1;
    return std::strtoll(status.c_str() + at + 6, nullptr, 10);
  }

  // The exit code (128 + signal for a signal death), or nullopt when it is still running
  // after `timeout`.
  std::optional<int> wait(std::chrono::milliseconds timeout) {
    if (reaped_) return exit_code_;
    const bool done = wait_until([&] {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) != pid_) return false;
      reaped_ = true;
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return true;
    }, timeout);
    return done ? std::optional<int>(exit_code_) : std::nullopt;
  }

 private:
  // Kills and reaps the child unless that happened already.
  void stop() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
      reaped_ = true;
    }
    if (out_fd_ >= 0) ::close(out_fd_);
    out_fd_ = -1;
  }

  void read_listening_line(std::chrono::milliseconds timeout) {
    static const std::regex kLine(R"(batchlm serve: listening on http://127\.0\.0\.1:(\d+)/v1 \(model ([^,]+), .*\))");
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::string text;
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{out_fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) > 0) {
        char buf[1024];
        const ssize_t n = ::read(out_fd_, buf, sizeof buf);
        if (n <= 0) break;  // stdout closed: it exited
        text.append(buf, static_cast<std::size_t>(n));
        const auto nl = text.find('\n');
        if (nl != std::string::npos) {
          line_ = text.substr(0, nl);
          std::smatch m;
          if (!std::regex_match(line_, m, kLine))
            throw std::runtime_error("unexpected first line from batchlm serve: " + line_);
          port_ = std::stoi(m[1]);
          model_ = m[2];
          return;
        }
      }
    }
    throw std::runtime_error("batchlm serve did not start (stdout: " + text + "; stderr: " + stderr_text() + ")");
  }

  static inline int count_ = 0;
  fs::path err_file_;
  pid_t pid_ = -1;
  int out_fd_ = -1;
  bool reaped_ = false;
  int exit_code_ = -1;
  int port_ = 0;
  std::string model_, line_;
};

// ---- curl -------------------------------------------------------------------------------------

struct HttpResponse {
  int status = 0;  // 0: no response (see curl_exit and error)
  std::map<std::string, std::string> headers;  // lower-case names, of the last response
  std::string body;
  int curl_exit = -1;
  std::string error;  // curl's stderr

  json json_body() const {
    try {
      return json::parse(body);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not JSON (" << e.what() << "): " << body;
      return nullptr;
    }
  }
  std::string header(const std::string& name) const {
    auto it = headers.find(name);
    return it == headers.end() ? std::string() : it->second;
  }
};

struct CurlRequest {
  std::string method = "GET";
  std::string url;
  std::optional<std::string> body;     // sent as application/json
  std::vector<std::string> headers;    // "Name: value"
  std::vector<std::string> extra;      // more curl arguments
  int max_seconds = 30;
};

// One curl run in the background; wait() collects it. Files live in `dir`.
class CurlCall {
 public:
  CurlCall(const fs::path& dir, const CurlRequest& r) {
    const std::string stem = (dir / ("curl-" + std::to_string(++count_))).string();
    head_ = stem + ".head";
    body_ = stem + ".body";
    max_seconds_ = r.max_seconds;
    std::vector<std::string> args = {kCurl, "-sS", "-N", "--noproxy", "*", "--max-time", std::to_string(r.max_seconds),
                                     "-X", r.method, "-D", head_.string(), "-o", body_.string(), "-w", "%{http_code}"};
    if (r.body) {
      const fs::path in = stem + ".in";
      write_file(in, *r.body);
      args.insert(args.end(), {"-H", "Content-Type: application/json", "--data-binary", "@" + in.string()});
    }
    for (const auto& h : r.headers) args.insert(args.end(), {"-H", h});
    args.insert(args.end(), r.extra.begin(), r.extra.end());
    args.push_back(r.url);
    process_ = std::make_unique<Process>(Process::Options{
        .args = args, .env = {}, .cwd = dir, .out_file = stem + ".out", .err_file = stem + ".err"});
    out_ = stem + ".out";
    err_ = stem + ".err";
  }

  bool finished() {
    if (result_) return true;
    const auto code = process_->wait(0ms);
    if (!code) return false;
    collect(*code);
    return true;
  }

  HttpResponse wait() {
    if (!result_) {
      const auto code = process_->wait(std::chrono::seconds(max_seconds_ + 10));
      collect(code.value_or(-1));
    }
    return *result_;
  }

  // Ends curl now (it hangs up).
  void kill() { process_->signal(SIGKILL); }
  // The response body received so far.
  std::string body_so_far() const { return read_file(body_); }

 private:
  void collect(int code) {
    HttpResponse r;
    r.curl_exit = code;
    const std::string w = read_file(out_);
    try {
      r.status = w.empty() ? 0 : std::stoi(w);
    } catch (const std::exception&) {
      r.status = 0;
    }
    r.body = read_file(body_);
    r.error = read_file(err_);
    std::istringstream head(read_file(head_));
    for (std::string line; std::getline(head, line);) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.starts_with("HTTP/")) {
        r.headers.clear();
        continue;
      }
      const auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      std::string name = line.substr(0, colon);
      std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
      r.headers[name] = line.substr(line.find_first_not_of(' ', colon + 1));
    }
    result_ = std::move(r);
  }

  static inline int count_ = 0;
  std::unique_ptr<Process> process_;
  fs::path head_, body_, out_, err_;
  int max_seconds_ = 30;
  std::optional<HttpResponse> result_;
};

// ---- raw sockets ------------------------------------------------------------------------------

// A client socket with receive timeouts, for hanging up mid-response.
class RawConnection {
 public:
  // receive_buffer > 0: a small receive window (SO_RCVBUF, set before connecting), so a client
  // that stops reading stalls the server's writes after kilobytes rather than megabytes.
  explicit RawConnection(int port, int receive_buffer = 0) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (receive_buffer > 0) ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      const int e = errno;
      ::close(fd_);
      fd_ = -1;
      throw std::runtime_error(std::string("connect failed: ") + std::strerror(e));
    }
  }
  ~RawConnection() { close(); }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;

  void send_post(const std::string& path, const std::string& body, const std::string& version = "HTTP/1.1") {
    send_raw("POST " + path + " " + version + "\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
  }

  void send_raw(const std::string& req) {
    std::size_t sent = 0;
    while (sent < req.size()) {
      const ssize_t n = ::send(fd_, req.data() + sent, req.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) throw std::runtime_error("send failed");
      sent += static_cast<std::size_t>(n);
    }
  }

  // Sends up to `bytes` of filler without blocking, until the server stops taking them for
  // `stall` in a row (or closes); returns how many bytes it took.
  std::size_t send_until_stalled(std::size_t bytes, std::chrono::milliseconds stall) {
    const std::string block(64 * 1024, 'x');
    std::size_t sent = 0;
    while (sent < bytes) {
      pollfd p{fd_, POLLOUT, 0};
      if (::poll(&p, 1, static_cast<int>(stall.count())) <= 0 || (p.revents & (POLLERR | POLLHUP)) != 0) break;
      const ssize_t n = ::send(fd_, block.data(), std::min(block.size(), bytes - sent), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n <= 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) continue;
        break;
      }
      sent += static_cast<std::size_t>(n);
    }
    return sent;
  }

  // No more bytes from this side (the server sees the end of the stream); reading goes on.
  void shutdown_send() { ::shutdown(fd_, SHUT_WR); }

  // Reads until `needle` has arrived; false on timeout or when the server closed first.
  bool read_until(const std::string& needle, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!contains(received_, needle)) {
      if (read_some(deadline) != Read::kData) return false;
    }
    return true;
  }

  // Reads until the server closes; false on timeout.
  bool read_to_end(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      switch (read_some(deadline)) {
        case Read::kData: continue;
        case Read::kClosed: return true;
        case Read::kTimeout: return false;
      }
    }
  }

  const std::string& received() const { return received_; }

  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  enum class Read { kData, kClosed, kTimeout };
  // One recv() of what has arrived, waiting at most until `deadline`.
  Read read_some(std::chrono::steady_clock::time_point deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return Read::kTimeout;
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return Read::kTimeout;
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n <= 0) return Read::kClosed;
    received_.append(buf, static_cast<std::size_t>(n));
    return Read::kData;
  }

  int fd_ = -1;
  std::string received_;
};

// Whether a TCP connect to the port is refused now.
bool connection_refused(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  const int e = errno;
  ::close(fd);
  return rc != 0 && e == ECONNREFUSED;
}

// ---- SSE --------------------------------------------------------------------------------------

// The events of an SSE body, each "data: ..." payload without the prefix. Fails the test on
// framing errors (an event that is not one data line, a body not ending in a blank line).
std::vector<std::string> sse_events(const std::string& body) {
  std::vector<std::string> out;
  EXPECT_TRUE(body.ends_with("\n\n")) << body;
  std::size_t at = 0;
  while (at < body.size()) {
    const std::size_t end = body.find("\n\n", at);
    if (end == std::string::npos) {
      ADD_FAILURE() << "trailing bytes after the last event: " << body.substr(at);
      break;
    }
    const std::string event = body.substr(at, end - at);
    EXPECT_TRUE(event.starts_with("data: ")) << event;
    EXPECT_FALSE(contains(event, "\n")) << "one data line per event: " << event;
    out.push_back(event.substr(std::min<std::size_t>(6, event.size())));
    at = end + 2;
  }
  return out;
}

// The chunks of an SSE body that ends with [DONE] (which is checked and dropped).
std::vector<json> sse_chunks(const std::string& body) {
  std::vector<std::string> events = sse_events(body);
  std::vector<json> chunks;
  if (events.empty() || events.back() != "[DONE]") {
    ADD_FAILURE() << "the stream does not end with data: [DONE]: " << body;
  } else {
    events.pop_back();
  }
  for (const auto& e : events) {
    try {
      chunks.push_back(json::parse(e));
    } catch (const std::exception& ex) {
      ADD_FAILURE() << "event is not JSON: " << e;
    }
  }
  return chunks;
}

// ---- fixtures ---------------------------------------------------------------------------------

std::string chat_request(const std::string& user, json extra = json::object()) {
  json body = {{"messages", json::array({{{"role", "user"}, {"content", user}}})}};
  body.update(extra);
  return body.dump();
}

// A temporary directory with the tiny model (tiny.gguf, 256 positions) in it.
class Serve : public ::testing::Test {
 protected:
  void SetUp() override { batchlm::testing::write_tiny_llama(dir() / "tiny.gguf"); }
  const fs::path& dir() const { return dir_.path; }

  // A server on the tiny model with one compute thread.
  std::unique_ptr<ServeProcess> serve(std::vector<std::string> extra = {}, std::map<std::string, std::string> env = {},
                                      const std::string& model = "tiny.gguf") {
    std::vector<std::string> args = {"--model", model, "--threads", "1"};
    args.insert(args.end(), extra.begin(), extra.end());
    return std::make_unique<ServeProcess>(dir(), args, env);
  }

  // A slower model: wider, deeper, 4096 positions, so one request can run for seconds (4000
  // tokens take about 4 s on one thread). With these weights (seed 2) greedy decoding never
  // ends the turn on the prompts used here.
  void write_long_model() {
    batchlm::testing::TinyLlamaOptions o;
    o.context_length = 4096;
    o.n_embd = 256;
    o.n_ff = 768;
    o.n_layers = 4;
    o.seed = 2;
    batchlm::testing::write_tiny_llama(dir() / "long.gguf", o);
  }

  HttpResponse request(const CurlRequest& r) { return CurlCall(dir(), r).wait(); }
  HttpResponse get(const ServeProcess& s, const std::string& path, std::vector<std::string> headers = {}) {
    return request({.method = "GET", .url = s.url(path), .body = std::nullopt, .headers = headers});
  }
  HttpResponse post(const ServeProcess& s, const std::string& path, const std::string& body,
                    std::vector<std::string> headers = {}) {
    return request({.method = "POST", .url = s.url(path), .body = body, .headers = headers});
  }
  json health(const ServeProcess& s) {
    HttpResponse r = get(s, "/health");
    EXPECT_EQ(r.status, 200) << r.body << r.error;
    return r.json_body();
  }
  std::string metrics(const ServeProcess& s) {
    HttpResponse r = get(s, "/metrics");
    EXPECT_EQ(r.status, 200) << r.body << r.error;
    return r.body;
  }
  // The body of a greedy chat answer to "Hello world" of at most 24 tokens, with `extra`'s
  // fields in the request.
  json greedy_answer(const ServeProcess& s, json extra) {
    extra["max_tokens"] = 24;
    extra["temperature"] = 0;
    HttpResponse r = post(s, "/v1/chat/completions", chat_request("Hello world", extra));
    EXPECT_EQ(r.status, 200) << r.body;
    return r.json_body();
  }

  TempDir dir_;
};

// A 400/404/... OpenAI error object.
void expect_error(const HttpResponse& r, int status, const std::string& type, const json& param, const json& code) {
  EXPECT_EQ(r.status, status) << r.body;
  EXPECT_EQ(r.header("content-type"), "application/json");
  const json e = r.json_body();
  ASSERT_TRUE(e.is_object() && e.contains("error")) << r.body;
  EXPECT_EQ(e["error"]["type"], type) << r.body;
  EXPECT_EQ(e["error"]["param"], param) << r.body;
  EXPECT_EQ(e["error"]["code"], code) << r.body;
  EXPECT_TRUE(e["error"]["message"].is_string() && !e["error"]["message"].get<std::string>().empty()) << r.body;
}

// The value of one series ("name" or "name{labels}") in a /metrics text; -1 when it is absent.
double series(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.size() > name.size() && line.starts_with(name) && line[name.size()] == ' ')
      return std::stod(line.substr(name.size() + 1));
  return -1;
}

// ---- health and models -----------------------------------------------------------------------

TEST_F(Serve, HealthAndModels) {
  auto s = serve({"--served-model-name", "tiny-served"});
  EXPECT_EQ(s->model(), "tiny-served");

  HttpResponse h = get(*s, "/health");
  ASSERT_EQ(h.status, 200) << h.body << h.error;
  EXPECT_EQ(h.header("content-type"), "application/json");
  const json health = h.json_body();
  EXPECT_EQ(health["status"], "ok") << h.body;
  EXPECT_EQ(health["model"], "tiny-served") << h.body;
  EXPECT_EQ(health["in_flight"], 0) << h.body;
  ASSERT_TRUE(health["engine"].is_object()) << h.body;
  EXPECT_EQ(health["engine"]["running"], 0) << h.body;
  EXPECT_EQ(health["engine"]["waiting"], 0) << h.body;
  EXPECT_EQ(health["engine"]["blocks_used"], 0) << h.body;
  EXPECT_EQ(health["engine"]["block_size"], 16) << h.body;
  EXPECT_GE(health["engine"]["blocks_total"].get<long long>(), 256 / 16) << h.body;

  HttpResponse m = get(*s, "/v1/models");
  ASSERT_EQ(m.status, 200) << m.body;
  const json models = m.json_body();
  ASSERT_EQ(models["object"], "list") << m.body;
  ASSERT_EQ(models["data"].size(), 1u) << m.body;
  const json& model = models["data"][0];
  EXPECT_EQ(model["id"], "tiny-served");
  EXPECT_EQ(model["object"], "model");
  EXPECT_EQ(model["owned_by"], "batchlm");
  EXPECT_EQ(model["max_model_len"], 256);
  const auto now = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  EXPECT_LE(model["created"].get<long long>(), now);
  EXPECT_GT(model["created"].get<long long>(), now - 120);

  HttpResponse one = get(*s, "/v1/models/tiny-served");
  ASSERT_EQ(one.status, 200) << one.body;
  EXPECT_EQ(one.json_body(), model);
  // With a trailing slash the path names no model: the list.
  HttpResponse slash = get(*s, "/v1/models/");
  ASSERT_EQ(slash.status, 200) << slash.body;
  EXPECT_EQ(slash.json_body(), models);

  expect_error(get(*s, "/v1/models/gpt-4o"), 404, "invalid_request_error", "model", "model_not_found");
  EXPECT_EQ(get(*s, "/health?verbose=1").status, 200);
}

// A model id of the form org/name, as vLLM serves a Hugging Face repository's: the official
// client percent-encodes the '/' of models.retrieve("org/name"), which routes to the model all
// the same; elsewhere an encoded '/' is still refused.
TEST_F(Serve, AModelIdWithASlashIsFoundEncodedOrNot) {
  auto s = serve({"--served-model-name", "org/tiny"});
  for (const std::string path : {"/v1/models/org%2Ftiny", "/v1/models/org%2ftiny", "/v1/models/org/tiny"}) {
    HttpResponse one = get(*s, path);
    ASSERT_EQ(one.status, 200) << path << ": " << one.body;
    EXPECT_EQ(one.json_body()["id"], "org/tiny") << path;
  }
  expect_error(get(*s, "/v1/models/org%2Fother"), 404, "invalid_request_error", "model", "model_not_found");
  EXPECT_EQ(get(*s, "/v1%2Fmodels").status, 400);
}

// RFC 9110 9.3.2: HEAD is GET without the body; load balancers probe /health with it.
TEST_F(Serve, HeadIsAnsweredLikeGetWithoutTheBody) {
  auto s = serve();
  const auto head_of = [](const std::string& response) { return response.substr(0, response.find("\r\n\r\n") + 4); };
  const auto content_length = [](const std::string& head) {
    static const std::regex kLength("\r\nContent-Length: (\\d+)\r\n");
    std::smatch m;
    return std::regex_search(head, m, kLength) ? std::stoll(m[1]) : -1LL;
  };
  for (const std::string path : {"/health", "/v1/models", "/v1/models/tiny", "/metrics"}) {
    SCOPED_TRACE(path);
    // HEAD, then GET on the same connection: the GET's answer starts right after the HEAD's header.
    RawConnection c(s->port());
    c.send_raw("HEAD " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET " + path +
               " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    ASSERT_TRUE(c.read_to_end(10s)) << c.received();
    const std::string head = head_of(c.received());
    ASSERT_TRUE(head.starts_with("HTTP/1.1 200 OK\r\n")) << c.received();
    const std::string rest = c.received().substr(head.size());
    ASSERT_TRUE(rest.starts_with("HTTP/1.1 200 OK\r\n")) << c.received();
    const std::string get_head = head_of(rest);
    const std::string get_body = rest.substr(get_head.size());
    EXPECT_EQ(content_length(get_head), static_cast<long long>(get_body.size())) << rest;
    if (path != "/metrics") {  // whose counters move between the two
      EXPECT_EQ(content_length(head), content_length(get_head)) << c.received();
    } else {
      EXPECT_GT(content_length(head), 0) << head;
    }
    const std::string type = path == "/metrics" ? "text/plain" : "application/json";
    EXPECT_TRUE(contains(head, "\r\nContent-Type: " + type)) << head;
  }
  // An error keeps its status and loses its body too.
  RawConnection c(s->port());
  c.send_raw("HEAD /v1/models/gpt-4o HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  ASSERT_TRUE(c.read_to_end(10s)) << c.received();
  EXPECT_TRUE(c.received().starts_with("HTTP/1.1 404 Not Found\r\n")) << c.received();
  EXPECT_TRUE(c.received().ends_with("\r\n\r\n")) << c.received();
  EXPECT_GT(content_length(c.received()), 0) << c.received();
}

// Requests about the server rather than a path: OPTIONS * names the methods, CONNECT is no
// tunnel (a server that is no proxy), and '*' with another method is a bad target.
TEST_F(Serve, OptionsStarListsTheMethodsAndConnectIsRefused) {
  auto s = serve({"--api-key", "k"});
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"OPTIONS * HTTP/1.1", "HTTP/1.1 200 OK\r\n"},
      {"CONNECT 127.0.0.1:443 HTTP/1.1", "HTTP/1.1 405 Method Not Allowed\r\n"},
      {"GET * HTTP/1.1", "HTTP/1.1 400 Bad Request\r\n"},
  };
  for (const auto& [line, status] : cases) {
    SCOPED_TRACE(line);
    RawConnection c(s->port());
    c.send_raw(line + "\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    ASSERT_TRUE(c.read_to_end(10s)) << c.received();
    EXPECT_TRUE(c.received().starts_with(status)) << c.received();
    if (!line.starts_with("GET")) {
      EXPECT_TRUE(contains(c.received(), "\r\nAllow: GET, HEAD, POST, OPTIONS\r\n")) << c.received();
    }
  }
  // The connection goes on after OPTIONS *, as after any request.
  RawConnection c(s->port());
  c.send_raw("OPTIONS * HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
             "Connection: close\r\n\r\n");
  ASSERT_TRUE(c.read_to_end(10s)) << c.received();
  EXPECT_TRUE(contains(c.received(), "HTTP/1.1 200 OK\r\nServer: batchlm\r\nContent-Type: application/json"))
      << c.received();
}

TEST_F(Serve, MetricsCountResponsesCompletionsAndTheEngine) {
  auto s = serve({"--api-key", "k"});
  // Like /health, /metrics needs no key.
  HttpResponse first = get(*s, "/metrics");
  ASSERT_EQ(first.status, 200) << first.body << first.error;
  EXPECT_EQ(first.header("content-type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(series(first.body, R"(batchlm_info{model="tiny"})"), 1) << first.body;
  EXPECT_EQ(series(first.body, "batchlm_request_duration_seconds_count"), 0) << first.body;

  const std::vector<std::string> key = {"Authorization: Bearer k"};
  const json ask = {{"max_tokens", 4}, {"temperature", 0}};
  HttpResponse chat = post(*s, "/v1/chat/completions", chat_request("Hello", ask), key);
  ASSERT_EQ(chat.status, 200) << chat.body;
  json streamed = ask;
  streamed["stream"] = true;
  HttpResponse stream = post(*s, "/v1/chat/completions", chat_request("Hello", streamed), key);
  ASSERT_EQ(stream.status, 200) << stream.body;
  ASSERT_TRUE(contains(stream.body, "data: [DONE]")) << stream.body;
  HttpResponse text = post(*s, "/v1/completions", json({{"prompt", "Once"}, {"max_tokens", 3}}).dump(), key);
  ASSERT_EQ(text.status, 200) << text.body;
  EXPECT_EQ(post(*s, "/v1/chat/completions", chat_request("Hi", {{"temperature", "hot"}}), key).status, 400);
  EXPECT_EQ(post(*s, "/v1/chat/completions", chat_request("Hi")).status, 401);
  EXPECT_EQ(get(*s, "/no/such/path").status, 404);
  EXPECT_EQ(post(*s, "/metrics", "{}").status, 405);

  const std::string m = metrics(*s);
  auto responses = [&](const std::string& route, int code) {
    return series(m, "batchlm_http_responses_total{route=\"" + route + "\",code=\"" + std::to_string(code) + "\"}");
  };
  EXPECT_EQ(responses("/v1/chat/completions", 200), 2) << m;
  EXPECT_EQ(responses("/v1/chat/completions", 400), 1) << m;
  EXPECT_EQ(responses("/v1/chat/completions", 401), 1) << m;
  EXPECT_EQ(responses("/v1/completions", 200), 1) << m;
  EXPECT_EQ(responses("other", 404), 1) << m;
  EXPECT_EQ(responses("/metrics", 405), 1) << m;
  EXPECT_EQ(responses("/metrics", 200), 1) << "the first /metrics; this one is counted after it is rendered\n" << m;

  // Two chat completions and one text completion, each ended by a finish reason; two invalid
  // (a bad request, and one without the API key).
  auto completions = [&](const std::string& endpoint, const std::string& result) {
    return std::max(0.0, series(m, "batchlm_completions_total{endpoint=\"" + endpoint + "\",result=\"" + result + "\"}"));
  };
  const json c = chat.json_body();
  const std::string reason = c["choices"][0]["finish_reason"];
  EXPECT_EQ(completions("chat", reason), 2) << m;
  EXPECT_EQ(completions("chat", "invalid"), 2) << m;
  EXPECT_EQ(completions("completions", text.json_body()["choices"][0]["finish_reason"]), 1) << m;
  EXPECT_EQ(series(m, "batchlm_request_duration_seconds_count"), 3) << m;
  EXPECT_EQ(series(m, R"(batchlm_request_duration_seconds_bucket{le="+Inf"})"), 3) << m;
  EXPECT_EQ(series(m, "batchlm_time_to_first_token_seconds_count"), 3) << m;
  EXPECT_GT(series(m, "batchlm_request_duration_seconds_sum"), 0) << m;

  // Greedy: the streamed request is the whole one again, with the same usage.
  const json t = text.json_body();
  const long long prompt = 2 * c["usage"]["prompt_tokens"].get<long long>() + t["usage"]["prompt_tokens"].get<long long>();
  const long long output =
      2 * c["usage"]["completion_tokens"].get<long long>() + t["usage"]["completion_tokens"].get<long long>();
  EXPECT_EQ(series(m, "batchlm_prompt_tokens_total"), prompt) << m;
  EXPECT_EQ(series(m, "batchlm_completion_tokens_total"), output) << m;

  // The engine's side agrees with /health.
  const json h = health(*s);
  EXPECT_EQ(series(m, "batchlm_engine_generated_tokens_total"), h["engine"]["generated_tokens"]) << m;
  EXPECT_GE(series(m, "batchlm_engine_generated_tokens_total"), output) << m;
  EXPECT_EQ(series(m, "batchlm_engine_prompt_tokens_computed_total") + series(m, "batchlm_engine_prompt_tokens_cached_total"),
            prompt) << m;
  EXPECT_GT(series(m, "batchlm_engine_prompt_tokens_cached_total"), 0) << "the repeated prompt came from the cache\n" << m;
  EXPECT_EQ(series(m, "batchlm_engine_kv_blocks_total"), h["engine"]["blocks_total"]) << m;
  EXPECT_EQ(series(m, "batchlm_engine_kv_block_size_tokens"), 16) << m;
  EXPECT_EQ(series(m, "batchlm_engine_running_sequences"), 0) << m;
  EXPECT_EQ(series(m, "batchlm_requests_in_flight"), 0) << m;
  EXPECT_GE(series(m, "batchlm_open_connections"), 1) << m;

  // The text as Prometheus's own client library reads it.
  if (!fs::exists(kPython)) GTEST_SKIP() << kPython << " is absent: run scripts/setup-python.sh";
  {
    Process probe({.args = {kPython.string(), "-c", "import prometheus_client"}, .env = {}, .cwd = dir(), .out_file = {},
                   .err_file = dir() / "probe.err"});
    if (probe.wait(30s) != 0) GTEST_SKIP() << "the prometheus_client package is missing: run scripts/setup-python.sh";
  }
  {
    std::ofstream(dir() / "metrics.txt") << m;
  }
  Process py({.args = {kPython.string(), kMetricsCheck.string(), (dir() / "metrics.txt").string()},
              .env = {},
              .cwd = dir(),
              .out_file = dir() / "py.out",
              .err_file = dir() / "py.err"});
  ASSERT_EQ(py.wait(30s), 0) << read_file(dir() / "py.err") << m;
  json families;
  ASSERT_NO_THROW(families = json::parse(read_file(dir() / "py.out")));
  EXPECT_EQ(families["batchlm_http_responses"]["type"], "counter");
  EXPECT_EQ(families["batchlm_completions"]["type"], "counter");
  EXPECT_EQ(families["batchlm_request_duration_seconds"]["type"], "histogram");
  EXPECT_EQ(families["batchlm_time_to_first_token_seconds"]["type"], "histogram");
  EXPECT_EQ(families["batchlm_engine_running_sequences"]["type"], "gauge");
  EXPECT_EQ(families["batchlm_info"]["samples"], json::array({json::array({"batchlm_info", {{"model", "tiny"}}, 1.0})}));
  double sum = 0;
  for (const json& sample : families["batchlm_completions"]["samples"]) sum += sample[2].get<double>();
  EXPECT_EQ(sum, 5) << families.dump();
}

TEST_F(Serve, PenaltiesChangeTheGreedyAnswer) {
  auto s = serve();
  auto answer = [&](json extra) {
    return greedy_answer(*s, std::move(extra))["choices"][0]["message"]["content"].get<std::string>();
  };
  const std::string plain = answer(json::object());
  const std::string penalized = answer({{"frequency_penalty", 2.0}, {"presence_penalty", 1.0}});
  EXPECT_NE(penalized, plain);
  EXPECT_EQ(answer({{"frequency_penalty", 2.0}, {"presence_penalty", 1.0}}), penalized);
  EXPECT_EQ(answer({{"frequency_penalty", 0}}), plain);
  // vLLM's repetition_penalty too.
  const std::string repeats = answer({{"repetition_penalty", 1.8}});
  EXPECT_NE(repeats, plain);
  EXPECT_NE(repeats, penalized);
  EXPECT_EQ(answer({{"repetition_penalty", 1.8}}), repeats);
  EXPECT_EQ(answer({{"repetition_penalty", 1}}), plain);
}

// vLLM's stop_token_ids and min_tokens over HTTP: a token forced by its bias ends the answer
// at once as a stop token id (its text the answer), after min_tokens others when they are asked
// for; a stop string from the answer's start is held off by min_tokens.
TEST_F(Serve, StopTokenIdsAndMinTokensEndTheAnswer) {
  auto s = serve();
  auto ask = [&](json extra) { return greedy_answer(*s, std::move(extra)); };
  const json forced = ask({{"logit_bias", {{"100", 100}}}});
  EXPECT_EQ(forced["choices"][0]["finish_reason"], "length");
  const std::string all = forced["choices"][0]["message"]["content"].get<std::string>();
  const json stopped = ask({{"logit_bias", {{"100", 100}}}, {"stop_token_ids", {100}}});
  EXPECT_EQ(stopped["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(stopped["usage"]["completion_tokens"], 1);
  const std::string one = stopped["choices"][0]["message"]["content"].get<std::string>();
  EXPECT_FALSE(one.empty());
  EXPECT_EQ(all.substr(0, one.size()), one);
  const json held = ask({{"logit_bias", {{"100", 100}}}, {"stop_token_ids", {100}}, {"min_tokens", 5}});
  EXPECT_EQ(held["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(held["usage"]["completion_tokens"], 6);
  EXPECT_TRUE(held["choices"][0]["message"]["content"].get<std::string>().ends_with(one)) << held.dump();

  const json plain_answer = ask(json::object());
  ASSERT_EQ(plain_answer["choices"][0]["finish_reason"], "length") << plain_answer.dump();
  const std::string plain = plain_answer["choices"][0]["message"]["content"].get<std::string>();
  ASSERT_GE(plain.size(), 3u);
  EXPECT_EQ(ask({{"stop", {plain.substr(0, 3)}}})["choices"][0]["message"]["content"], "");
  EXPECT_EQ(ask({{"stop", {plain.substr(0, 3)}}, {"min_tokens", 24}})["choices"][0]["message"]["content"], plain);
  HttpResponse over = post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 4}, {"min_tokens", 8}}));
  expect_error(over, 400, "invalid_request_error", "min_tokens", nullptr);
}

TEST_F(Serve, ModelNameDefaultsToTheFileName) {
  auto s = serve();
  EXPECT_EQ(s->model(), "tiny");
  EXPECT_TRUE(contains(s->listening_line(), "local ")) << s->listening_line();
  EXPECT_TRUE(s->listening_line().ends_with("; no API key)")) << s->listening_line();
  EXPECT_EQ(get(*s, "/v1/models").json_body()["data"][0]["id"], "tiny");
  // Requests naming it, or no model, are served.
  EXPECT_EQ(post(*s, "/v1/chat/completions", chat_request("Hi", {{"model", "tiny"}, {"max_tokens", 2}})).status, 200);
  EXPECT_EQ(post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 2}})).status, 200);
}

// ---- chat completions ------------------------------------------------------------------------

TEST_F(Serve, ChatCompletion) {
  auto s = serve();
  const std::string body = chat_request("Hello there", {{"max_tokens", 8}, {"temperature", 0}, {"model", "tiny"}});
  HttpResponse r = post(*s, "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body << r.error;
  EXPECT_EQ(r.header("content-type"), "application/json");
  const json c = r.json_body();
  EXPECT_TRUE(std::regex_match(c["id"].get<std::string>(), std::regex("chatcmpl-[0-9a-f]{24}"))) << r.body;
  EXPECT_EQ(c["object"], "chat.completion");
  EXPECT_EQ(c["model"], "tiny");
  EXPECT_TRUE(c["created"].is_number_integer());
  ASSERT_EQ(c["choices"].size(), 1u) << r.body;
  const json& choice = c["choices"][0];
  EXPECT_EQ(choice["index"], 0);
  EXPECT_EQ(choice["message"]["role"], "assistant");
  ASSERT_TRUE(choice["message"]["content"].is_string()) << r.body;
  // The tiny model does not end its turn this early.
  EXPECT_EQ(choice["finish_reason"], "length") << r.body;
  const json& usage = c["usage"];
  EXPECT_EQ(usage["completion_tokens"], 8) << r.body;
  EXPECT_EQ(usage["total_tokens"].get<long long>(), usage["prompt_tokens"].get<long long>() + 8) << r.body;
  // The same as `batchlm generate --chat` on the same model: text, prompt size (the template).
  RunResult g = run_batchlm(dir(), {"generate", "-m", "tiny.gguf", "--chat", "-p", "Hello there", "-n", "8",
                                    "--temperature", "0", "--timings", "-t", "1"});
  ASSERT_EQ(g.exit_code, 0) << g.err;
  EXPECT_EQ(choice["message"]["content"].get<std::string>() + "\n", g.out);
  EXPECT_TRUE(contains(g.err, "\"prompt_tokens\":" + usage["prompt_tokens"].dump() + ",")) << g.err << r.body;
  EXPECT_GT(usage["prompt_tokens"].get<long long>(), 8) << r.body;

  // Greedy: the same request gives the same text, under a fresh id.
  HttpResponse again = post(*s, "/v1/chat/completions", body);
  ASSERT_EQ(again.status, 200) << again.body;
  EXPECT_EQ(again.json_body()["choices"][0]["message"]["content"], choice["message"]["content"]);
  EXPECT_NE(again.json_body()["id"], c["id"]);
}

// The whitespace the engine takes off the ends of reasoning.
std::string trimmed(std::string s) {
  const char* space = " \n\t\r";
  s.erase(0, std::min(s.size(), s.find_first_not_of(space)));
  s.erase(s.find_last_not_of(space) + 1);
  return s;
}

// A DeepSeek-R1 distill's template opens a <think> block in the prompt, so the answer begins
// inside it: by default its text is the message's reasoning_content, apart from the content,
// whole and streamed; with --reasoning inline it is the content, as the model wrote it. (A tiny
// random model never closes the block, so all of its answer is reasoning.)
TEST_F(Serve, AReasoningModelsThinkBlockGoesOutAsReasoningContent) {
  const std::string r1 =
      read_file(fs::path(BATCHLM_SOURCE_DIR) / "models/vocab/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja");
  if (r1.empty()) GTEST_SKIP() << "the R1 distill's template is absent (scripts/fetch-vocabs.sh fetches it)";
  batchlm::testing::TinyLlamaOptions o;
  o.chat_template = r1;
  batchlm::testing::write_tiny_llama(dir() / "r1.gguf", o);
  const std::string body = chat_request("What is 2+2?", {{"max_tokens", 24}, {"temperature", 0}});
  std::string written;
  {
    auto s = serve({"--reasoning", "inline"}, {}, "r1.gguf");
    HttpResponse r = post(*s, "/v1/chat/completions", body);
    ASSERT_EQ(r.status, 200) << r.body << r.error;
    const json message = r.json_body()["choices"][0]["message"];
    EXPECT_FALSE(message.contains("reasoning_content")) << r.body;
    written = message["content"].get<std::string>();
  }
  ASSERT_FALSE(trimmed(written).empty());
  ASSERT_EQ(written.find("</think>"), std::string::npos) << written;

  auto s = serve({}, {}, "r1.gguf");
  HttpResponse whole = post(*s, "/v1/chat/completions", body);
  ASSERT_EQ(whole.status, 200) << whole.body << whole.error;
  const json message = whole.json_body()["choices"][0]["message"];
  EXPECT_EQ(message["reasoning_content"], trimmed(written)) << whole.body;
  EXPECT_EQ(message["content"], "") << whole.body;
  EXPECT_EQ(whole.json_body()["usage"]["completion_tokens"], 24) << whole.body;

  HttpResponse stream = post(*s, "/v1/chat/completions", chat_request("What is 2+2?", {{"max_tokens", 24}, {"temperature", 0}, {"stream", true}}));
  ASSERT_EQ(stream.status, 200) << stream.body << stream.error;
  std::string reasoning, content;
  const std::vector<json> chunks = sse_chunks(stream.body);
  ASSERT_FALSE(chunks.empty());
  EXPECT_EQ(chunks.front()["choices"][0]["delta"]["role"], "assistant") << stream.body;
  for (const json& chunk : chunks) {
    const json& delta = chunk["choices"][0]["delta"];
    if (delta.contains("reasoning_content")) reasoning += delta["reasoning_content"].get<std::string>();
    if (delta.contains("content")) content += delta["content"].get<std::string>();
  }
  EXPECT_EQ(reasoning, trimmed(written)) << stream.body;
  EXPECT_EQ(content, "") << stream.body;

  // The official Python client reads it as the API's other reasoning servers send it: an
  // attribute of the message and of each delta (which its models take as extra fields), and takes
  // chat_template_kwargs through extra_body.
  if (fs::exists(kPython)) {
    const std::string script = R"PY(
import json, sys
import openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="none", max_retries=0, timeout=60)
ask = dict(model="r1", messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=24, temperature=0)
whole = client.chat.completions.create(**ask).choices[0].message
parts = {"reasoning": "", "content": ""}
for chunk in client.chat.completions.create(stream=True, **ask):
    if chunk.choices:
        delta = chunk.choices[0].delta
        parts["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        parts["content"] += delta.content or ""
off = client.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **ask)
print(json.dumps({"reasoning": whole.reasoning_content, "content": whole.content, "stream": parts,
                  "off_prompt_tokens": off.usage.prompt_tokens}))
)PY";
    write_file(dir() / "reasoning_check.py", script);
    Process py({.args = {kPython.string(), (dir() / "reasoning_check.py").string(), s->base_url()},
                .env = {{"OPENAI_API_KEY", ""}, {"OPENAI_BASE_URL", ""}, {"NO_PROXY", "*"}, {"no_proxy", "*"}},
                .cwd = dir(),
                .out_file = dir() / "py.out",
                .err_file = dir() / "py.err"});
    ASSERT_EQ(py.wait(60s), 0) << read_file(dir() / "py.out") << read_file(dir() / "py.err");
    const json r = json::parse(read_file(dir() / "py.out"));
    EXPECT_EQ(r["reasoning"], trimmed(written)) << r.dump();
    EXPECT_EQ(r["content"], "") << r.dump();
    EXPECT_EQ(r["stream"]["reasoning"], trimmed(written)) << r.dump();
    EXPECT_EQ(r["stream"]["content"], "") << r.dump();
    // An R1 template has no thinking switch: the prompt is as without it.
    EXPECT_EQ(r["off_prompt_tokens"], whole.json_body()["usage"]["prompt_tokens"]) << r.dump();
  }

  // Qwen 3's thinking switch: with enable_thinking false the answer opens with the empty block
  // its template writes (7 more prompt tokens here); true is its default.
  const std::string qwen3 = read_file(fs::path(BATCHLM_SOURCE_DIR) / "models/vocab/templates/Qwen-Qwen3-0.6B.jinja");
  ASSERT_FALSE(qwen3.empty());  // fetched with R1's
  o.chat_template = qwen3;
  batchlm::testing::write_tiny_llama(dir() / "qwen3.gguf", o);
  auto q = serve({}, {}, "qwen3.gguf");
  std::map<std::string, long long> prompt_tokens;
  for (const char* thinking : {"default", "true", "false"}) {
    json extra = {{"max_tokens", 2}};
    if (thinking != std::string("default")) extra["chat_template_kwargs"] = {{"enable_thinking", thinking == std::string("true")}};
    HttpResponse r = post(*q, "/v1/chat/completions", chat_request("What is 2+2?", extra));
    ASSERT_EQ(r.status, 200) << r.body << r.error;
    prompt_tokens[thinking] = r.json_body()["usage"]["prompt_tokens"].get<long long>();
  }
  EXPECT_EQ(prompt_tokens["true"], prompt_tokens["default"]);
  EXPECT_GT(prompt_tokens["false"], prompt_tokens["default"]);
}

// Tools, and a conversation's calls and results, reach a model whose chat template lists them
// (Qwen 2.5's), whole or streamed; a model whose template does not refuses them by name.
TEST_F(Serve, ToolsReachAModelWhoseTemplateListsThem) {
  const std::string qwen = read_file(fs::path(BATCHLM_SOURCE_DIR) / "models/vocab/templates/Qwen-Qwen2.5-7B-Instruct.jinja");
  if (qwen.empty()) GTEST_SKIP() << "Qwen2.5's template is absent (scripts/fetch-vocabs.sh fetches it)";
  batchlm::testing::TinyLlamaOptions o;
  o.chat_template = qwen;
  o.context_length = 2048;
  batchlm::testing::write_tiny_llama(dir() / "qwen.gguf", o);
  const json tools = json::array(
      {{{"type", "function"},
        {"function", {{"name", "get_weather"}, {"description", "Weather in a city"}, {"parameters", {{"type", "object"}}}}}}});
  const json call = {{"id", "call_1"}, {"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Oslo\"}"}}}};
  json body = {{"messages", json::array({{{"role", "user"}, {"content", "Weather in Oslo?"}},
                                          {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", {call}}},
                                          {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "-3 C"}}})},
               {"tools", tools}, {"max_tokens", 4}, {"temperature", 0}};
  auto s = serve({}, {}, "qwen.gguf");
  HttpResponse whole = post(*s, "/v1/chat/completions", body.dump());
  ASSERT_EQ(whole.status, 200) << whole.body << whole.error;
  const json answer = whole.json_body();
  const long long with_tools = answer["usage"]["prompt_tokens"].get<long long>();
  EXPECT_GT(with_tools, 300) << whole.body;  // the tools' instructions, the call and its result
  EXPECT_TRUE(answer["choices"][0]["message"]["content"].is_string()) << whole.body;

  json streamed = body;
  streamed["stream"] = true;
  HttpResponse stream = post(*s, "/v1/chat/completions", streamed.dump());
  ASSERT_EQ(stream.status, 200) << stream.body << stream.error;
  EXPECT_TRUE(contains(stream.body, "data: [DONE]")) << stream.body;

  // tool_choice "none": the tools are not shown.
  json none = body;
  none["tool_choice"] = "none";
  HttpResponse plain = post(*s, "/v1/chat/completions", none.dump());
  ASSERT_EQ(plain.status, 200) << plain.body;
  EXPECT_LT(plain.json_body()["usage"]["prompt_tokens"].get<long long>(), with_tools) << plain.body;
  // A forced tool_choice holds the answer to a call of the tool named, whole and streamed,
  // whatever the model would write (a tiny random model here).
  json forced = body;
  forced["tools"].push_back({{"type", "function"},
                             {"function", {{"name", "set_unit"},
                                           {"parameters", {{"type", "object"},
                                                           {"properties", {{"unit", {{"enum", {"C", "F"}}}}}},
                                                           {"required", {"unit"}},
                                                           {"additionalProperties", false}}}}}});
  forced["tool_choice"] = {{"type", "function"}, {"function", {{"name", "set_unit"}}}};
  forced["max_tokens"] = 1100;
  forced["stop"] = {"}", ","};  // for text; a forced call's JSON is not cut by them
  HttpResponse held = post(*s, "/v1/chat/completions", forced.dump());
  ASSERT_EQ(held.status, 200) << held.body;
  const json held_choice = held.json_body()["choices"][0];
  EXPECT_EQ(held_choice["finish_reason"], "tool_calls") << held.body;
  EXPECT_TRUE(held_choice["message"]["content"].is_null()) << held.body;
  ASSERT_EQ(held_choice["message"]["tool_calls"].size(), 1u) << held.body;
  const json& forced_call = held_choice["message"]["tool_calls"][0];
  EXPECT_EQ(forced_call["function"]["name"], "set_unit") << held.body;
  const json arguments = json::parse(forced_call["function"]["arguments"].get<std::string>());
  EXPECT_TRUE(arguments == json({{"unit", "C"}}) || arguments == json({{"unit", "F"}})) << held.body;
  forced["stream"] = true;
  HttpResponse held_stream = post(*s, "/v1/chat/completions", forced.dump());
  ASSERT_EQ(held_stream.status, 200) << held_stream.body;
  EXPECT_TRUE(contains(held_stream.body, "\"name\":\"set_unit\"")) << held_stream.body;
  EXPECT_TRUE(contains(held_stream.body, "\"finish_reason\":\"tool_calls\"")) << held_stream.body;
  // Asked for, the call's tokens' log-probabilities go out too, once each, before the calls.
  forced["logprobs"] = true;
  forced["stream_options"] = {{"include_usage", true}};
  HttpResponse scored = post(*s, "/v1/chat/completions", forced.dump());
  ASSERT_EQ(scored.status, 200) << scored.body;
  std::size_t streamed_logprobs = 0;
  long long generated = -1;
  for (const json& chunk : sse_chunks(scored.body)) {
    if (chunk.contains("usage") && chunk["usage"].is_object()) generated = chunk["usage"]["completion_tokens"].get<long long>();
    if (chunk["choices"].empty()) continue;
    const json& lp = chunk["choices"][0]["logprobs"];
    if (lp.is_object()) streamed_logprobs += lp["content"].size();
  }
  EXPECT_GT(generated, 0) << scored.body;
  EXPECT_EQ(static_cast<long long>(streamed_logprobs), generated) << scored.body;
  forced.erase("logprobs");
  forced.erase("stream_options");
  // "required": a call of one of the tools; of the only one here, held to its parameters (among
  // several, to one of their names and an object of arguments: engine_fields_test).
  forced["stream"] = false;
  forced["tool_choice"] = "required";
  forced["tools"] = json::array({forced["tools"][1]});
  forced["tools"][0]["function"]["name"] = "set_scale";
  HttpResponse any = post(*s, "/v1/chat/completions", forced.dump());
  ASSERT_EQ(any.status, 200) << any.body;
  const json any_choice = any.json_body()["choices"][0];
  EXPECT_EQ(any_choice["finish_reason"], "tool_calls") << any.body;
  ASSERT_EQ(any_choice["message"]["tool_calls"].size(), 1u) << any.body;
  const std::string name = any_choice["message"]["tool_calls"][0]["function"]["name"].get<std::string>();
  EXPECT_EQ(name, "set_scale") << any.body;
  // A named function that is not among the tools is refused by name.
  forced["tool_choice"] = {{"type", "function"}, {"function", {{"name", "get_time"}}}};
  HttpResponse refused = post(*s, "/v1/chat/completions", forced.dump());
  EXPECT_EQ(refused.status, 400) << refused.body;
  EXPECT_EQ(refused.json_body()["error"]["param"], "tool_choice") << refused.body;
  s.reset();

  // The tiny model's template (ChatML without tools) refuses them.
  auto t = serve();
  HttpResponse no = post(*t, "/v1/chat/completions", body.dump());
  EXPECT_EQ(no.status, 400) << no.body;
  EXPECT_TRUE(contains(no.json_body()["error"]["message"].get<std::string>(), "does not list tools")) << no.body;
  // The field named is the one the message starts with (here the history's call).
  const std::string message = no.json_body()["error"]["message"];
  EXPECT_EQ(no.json_body()["error"]["param"], "messages[1].tool_calls") << no.body;
  EXPECT_EQ(message.rfind("messages[1].tool_calls: ", 0), 0u) << no.body;
}

TEST_F(Serve, ChatCompletionStreamsServerSentEvents) {
  auto s = serve();
  const json params = {{"max_tokens", 12}, {"temperature", 0}};
  HttpResponse whole = post(*s, "/v1/chat/completions", chat_request("Tell me a story", params));
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json expected = whole.json_body();

  json stream_params = params;
  stream_params["stream"] = true;
  stream_params["stream_options"] = {{"include_usage", true}};
  HttpResponse r = post(*s, "/v1/chat/completions", chat_request("Tell me a story", stream_params));
  ASSERT_EQ(r.status, 200) << r.body << r.error;
  EXPECT_EQ(r.header("content-type"), "text/event-stream");
  EXPECT_EQ(r.header("cache-control"), "no-cache");
  EXPECT_EQ(r.header("transfer-encoding"), "chunked");
  const std::vector<json> chunks = sse_chunks(r.body);
  // At least one text chunk, the finish chunk, the usage chunk.
  ASSERT_GE(chunks.size(), 3u) << r.body;
  const json& finish = chunks[chunks.size() - 2];
  const json& usage = chunks.back();
  std::string text;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const json& c = chunks[i];
    EXPECT_EQ(c["object"], "chat.completion.chunk") << c.dump();
    EXPECT_EQ(c["id"], chunks[0]["id"]) << c.dump();
    EXPECT_EQ(c["created"], chunks[0]["created"]) << c.dump();
    EXPECT_EQ(c["model"], "tiny") << c.dump();
    if (i + 2 >= chunks.size()) continue;
    // A text chunk: a content delta, no finish reason, usage null (include_usage).
    ASSERT_EQ(c["choices"].size(), 1u) << c.dump();
    EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null()) << c.dump();
    EXPECT_EQ(c["choices"][0]["delta"].contains("role"), i == 0) << c.dump();
    if (i == 0) {
      EXPECT_EQ(c["choices"][0]["delta"]["role"], "assistant") << c.dump();
    }
    ASSERT_TRUE(c.contains("usage")) << c.dump();
    EXPECT_TRUE(c["usage"].is_null()) << c.dump();
    text += c["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_TRUE(std::regex_match(chunks[0]["id"].get<std::string>(), std::regex("chatcmpl-[0-9a-f]{24}")));
  EXPECT_EQ(finish["choices"][0]["delta"], json::object()) << finish.dump();
  EXPECT_EQ(finish["choices"][0]["finish_reason"], expected["choices"][0]["finish_reason"]) << finish.dump();
  EXPECT_TRUE(finish["usage"].is_null()) << finish.dump();
  EXPECT_EQ(usage["choices"], json::array()) << usage.dump();
  EXPECT_EQ(usage["usage"], expected["usage"]) << usage.dump();
  // Greedy: the streamed text is the whole response's text.
  EXPECT_EQ(text, expected["choices"][0]["message"]["content"].get<std::string>());

  // Without stream_options: no usage anywhere; the finish chunk comes last before [DONE].
  stream_params.erase("stream_options");
  HttpResponse plain = post(*s, "/v1/chat/completions", chat_request("Tell me a story", stream_params));
  ASSERT_EQ(plain.status, 200) << plain.body;
  const std::vector<json> plain_chunks = sse_chunks(plain.body);
  ASSERT_GE(plain_chunks.size(), 2u) << plain.body;
  std::string plain_text;
  for (const json& c : plain_chunks) {
    EXPECT_FALSE(c.contains("usage")) << c.dump();
    ASSERT_EQ(c["choices"].size(), 1u) << c.dump();
    plain_text += c["choices"][0]["delta"].value("content", "");
  }
  EXPECT_EQ(plain_chunks.back()["choices"][0]["finish_reason"], expected["choices"][0]["finish_reason"]);
  EXPECT_EQ(plain_text, text);

  // A choice that ends before any text (a stop string at its very start) still gives its role.
  ASSERT_FALSE(text.empty());
  const auto lead = static_cast<unsigned char>(text[0]);
  stream_params["stop"] = text.substr(0, lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4);  // its first character
  HttpResponse empty = post(*s, "/v1/chat/completions", chat_request("Tell me a story", stream_params));
  ASSERT_EQ(empty.status, 200) << empty.body;
  const std::vector<json> empty_chunks = sse_chunks(empty.body);
  ASSERT_EQ(empty_chunks.size(), 2u) << empty.body;
  EXPECT_EQ(empty_chunks[0]["choices"][0]["delta"], json({{"role", "assistant"}, {"content", ""}})) << empty.body;
  EXPECT_EQ(empty_chunks[1]["choices"][0]["finish_reason"], "stop") << empty.body;
}

// ---- text completions ------------------------------------------------------------------------

TEST_F(Serve, TextCompletion) {
  auto s = serve();
  HttpResponse r = post(*s, "/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0})");
  ASSERT_EQ(r.status, 200) << r.body << r.error;
  const json c = r.json_body();
  EXPECT_TRUE(std::regex_match(c["id"].get<std::string>(), std::regex("cmpl-[0-9a-f]{24}"))) << r.body;
  EXPECT_EQ(c["object"], "text_completion");
  EXPECT_EQ(c["model"], "tiny");
  ASSERT_EQ(c["choices"].size(), 1u);
  ASSERT_TRUE(c["choices"][0]["text"].is_string()) << r.body;
  EXPECT_FALSE(c["choices"][0].contains("message")) << r.body;
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length") << r.body;
  EXPECT_EQ(c["usage"]["completion_tokens"], 5) << r.body;
  // No chat template: the prompt's own tokens, as `batchlm generate` without --chat counts them.
  RunResult g = run_batchlm(dir(), {"generate", "-m", "tiny.gguf", "-p", "Once upon a time", "-n", "5",
                                    "--temperature", "0", "--timings", "-t", "1"});
  ASSERT_EQ(g.exit_code, 0) << g.err;
  EXPECT_EQ(c["choices"][0]["text"].get<std::string>() + "\n", g.out);
  EXPECT_TRUE(contains(g.err, "\"prompt_tokens\":" + c["usage"]["prompt_tokens"].dump() + ",")) << g.err << r.body;

  // The completions API's default of 16 tokens.
  HttpResponse d = post(*s, "/v1/completions", R"({"prompt": ["Once upon a time"], "temperature": 0})");
  ASSERT_EQ(d.status, 200) << d.body;
  const json dc = d.json_body();
  EXPECT_EQ(dc["choices"][0]["finish_reason"], "length") << d.body;
  EXPECT_EQ(dc["usage"]["completion_tokens"], 16) << d.body;
  EXPECT_EQ(dc["usage"]["prompt_tokens"], c["usage"]["prompt_tokens"]) << d.body;
  EXPECT_TRUE(dc["choices"][0]["text"].get<std::string>().starts_with(c["choices"][0]["text"].get<std::string>()));

  // Streamed: text chunks of object text_completion that add up to the same text.
  HttpResponse st = post(*s, "/v1/completions",
                         R"({"prompt": "Once upon a time", "temperature": 0, "stream": true,
                             "stream_options": {"include_usage": true}})");
  ASSERT_EQ(st.status, 200) << st.body;
  const std::vector<json> chunks = sse_chunks(st.body);
  ASSERT_GE(chunks.size(), 3u) << st.body;
  std::string text;
  for (std::size_t i = 0; i + 1 < chunks.size(); ++i) {
    EXPECT_EQ(chunks[i]["object"], "text_completion") << chunks[i].dump();
    ASSERT_EQ(chunks[i]["choices"].size(), 1u) << chunks[i].dump();
    EXPECT_FALSE(chunks[i]["choices"][0].contains("delta")) << chunks[i].dump();
    text += chunks[i]["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(text, dc["choices"][0]["text"].get<std::string>());
  EXPECT_EQ(chunks[chunks.size() - 2]["choices"][0]["finish_reason"], dc["choices"][0]["finish_reason"]);
  EXPECT_EQ(chunks.back()["choices"], json::array());
  EXPECT_EQ(chunks.back()["usage"], dc["usage"]);
}

// ---- errors ----------------------------------------------------------------------------------

// ---- several choices (n) ---------------------------------------------------------------------

// A chat template this build does not support: text completions run as on any model, and a
// chat is refused at once (it used to wait, unanswered, for the client to give up).
TEST_F(Serve, AModelWithAnUnsupportedChatTemplateCompletesTextAndRefusesChats) {
  batchlm::testing::TinyLlamaOptions o;
  o.chat_template = "{# a template of its own, never closed";
  batchlm::testing::write_tiny_llama(dir() / "odd.gguf", o);
  auto s = serve({}, {}, "odd.gguf");
  const std::string text = R"({"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0})";
  HttpResponse t = post(*s, "/v1/completions", text);
  ASSERT_EQ(t.status, 200) << t.body << t.error;
  EXPECT_EQ(t.json_body()["usage"]["completion_tokens"], 3) << t.body;
  HttpResponse ts = post(*s, "/v1/completions", R"({"prompt": "Once", "max_tokens": 2, "stream": true})");
  ASSERT_EQ(ts.status, 200) << ts.body << ts.error;
  EXPECT_TRUE(contains(ts.body, "data: [DONE]")) << ts.body;
  const std::string chat = chat_request("Hi", {{"max_tokens", 3}});
  for (const bool stream : {false, true}) {
    json body = json::parse(chat);
    body["stream"] = stream;
    HttpResponse c = post(*s, "/v1/chat/completions", body.dump());
    expect_error(c, 400, "invalid_request_error", "messages", nullptr);
    EXPECT_TRUE(contains(c.body, "chat template is not one this build supports")) << c.body;
  }
  json tools = json::parse(chat);
  tools["tools"] = json::parse(R"([{"type": "function", "function": {"name": "f"}}])");
  expect_error(post(*s, "/v1/chat/completions", tools.dump()), 400, "invalid_request_error", "messages", nullptr);
  EXPECT_EQ(health(*s)["status"], "ok");
}

TEST_F(Serve, SeveralChoicesPerRequest) {
  auto s = serve();
  auto choices_of = [](const HttpResponse& r) {
    std::vector<std::string> texts;
    const json body = r.json_body();
    for (std::size_t i = 0; i < body["choices"].size(); ++i) {
      const json& c = body["choices"][i];
      EXPECT_EQ(c["index"], i) << r.body;
      texts.push_back(c.contains("message") ? c["message"]["content"].get<std::string>() : c["text"].get<std::string>());
    }
    return texts;
  };
  // Greedy: every choice is the one-choice answer; the prompt counts once in the usage.
  HttpResponse one = post(*s, "/v1/chat/completions", chat_request("Hello", {{"max_tokens", 6}, {"temperature", 0}}));
  ASSERT_EQ(one.status, 200) << one.body;
  HttpResponse three =
      post(*s, "/v1/chat/completions", chat_request("Hello", {{"max_tokens", 6}, {"temperature", 0}, {"n", 3}}));
  ASSERT_EQ(three.status, 200) << three.body;
  const std::string alone = choices_of(one).at(0);
  EXPECT_EQ(choices_of(three), std::vector<std::string>(3, alone)) << three.body;
  const json u1 = one.json_body()["usage"], u3 = three.json_body()["usage"];
  EXPECT_EQ(u3["prompt_tokens"], u1["prompt_tokens"]) << three.body;
  EXPECT_EQ(u3["completion_tokens"], 3 * u1["completion_tokens"].get<int>()) << three.body;
  EXPECT_EQ(u3["total_tokens"], u3["prompt_tokens"].get<int>() + u3["completion_tokens"].get<int>()) << three.body;

  // The choices share their prompt: one computes it, the others take its blocks from the cache.
  {
    const json before = health(*s)["engine"];
    std::string words;
    for (int i = 0; words.size() < 150; ++i) words += std::to_string(i * 7919 % 1000) + " ";
    HttpResponse shared = post(*s, "/v1/completions", json({{"prompt", words}, {"max_tokens", 2}, {"n", 4}}).dump());
    ASSERT_EQ(shared.status, 200) << shared.body;
    const long long prompt = shared.json_body()["usage"]["prompt_tokens"];
    ASSERT_GE(prompt, 48) << shared.body;
    const json after = health(*s)["engine"];
    const long long computed =
        after["prompt_tokens_computed"].get<long long>() - before["prompt_tokens_computed"].get<long long>();
    EXPECT_LT(computed, prompt + 3 * 16) << "4 choices of " << prompt << " prompt tokens: " << after.dump();
    EXPECT_GE(after["prompt_tokens_cached"].get<long long>() - before["prompt_tokens_cached"].get<long long>(),
              3 * (prompt - 16))
        << after.dump();
  }

  // Sampled with a seed: choice i is what one choice gives with the seed plus i, every time.
  auto text_request = [](json fields) {
    json body = {{"prompt", "Once"}, {"max_tokens", 12}, {"temperature", 1.0}};
    body.update(fields);
    return body.dump();
  };
  HttpResponse seeded = post(*s, "/v1/completions", text_request({{"seed", 7}, {"n", 3}}));
  ASSERT_EQ(seeded.status, 200) << seeded.body;
  const std::vector<std::string> texts = choices_of(seeded);
  ASSERT_EQ(texts.size(), 3u) << seeded.body;
  EXPECT_EQ(choices_of(post(*s, "/v1/completions", text_request({{"seed", 7}, {"n", 3}}))), texts);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(choices_of(post(*s, "/v1/completions", text_request({{"seed", 7 + i}}))).at(0), texts[i]) << i;

  // Streamed: each choice's chunks carry its index, its first chunk the role, its last the
  // finish reason; one usage chunk for all, then [DONE].
  HttpResponse streamed = post(*s, "/v1/chat/completions",
                               chat_request("Hello", {{"max_tokens", 6}, {"temperature", 0}, {"n", 2}, {"stream", true},
                                                      {"stream_options", {{"include_usage", true}}}}));
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  const std::vector<json> chunks = sse_chunks(streamed.body);
  ASSERT_FALSE(chunks.empty()) << streamed.body;
  std::map<int, std::string> text;
  std::map<int, int> roles, finishes;
  for (std::size_t i = 0; i + 1 < chunks.size(); ++i) {
    const json& c = chunks[i];
    EXPECT_EQ(c["id"], chunks[0]["id"]) << c.dump();
    ASSERT_EQ(c["choices"].size(), 1u) << c.dump();
    const json& choice = c["choices"][0];
    const int index = choice["index"];
    if (choice["delta"].contains("role")) {
      EXPECT_EQ(roles[index]++, 0) << "the role once, first: " << c.dump();
      EXPECT_TRUE(text[index].empty()) << c.dump();
    }
    if (choice["delta"].contains("content")) text[index] += choice["delta"]["content"].get<std::string>();
    if (!choice["finish_reason"].is_null()) ++finishes[index];
    else EXPECT_EQ(finishes[index], 0) << "nothing after the choice's finish: " << c.dump();
  }
  EXPECT_EQ(text, (std::map<int, std::string>{{0, alone}, {1, alone}})) << streamed.body;
  EXPECT_EQ(finishes, (std::map<int, int>{{0, 1}, {1, 1}})) << streamed.body;
  const json& usage = chunks.back();
  EXPECT_TRUE(usage["choices"].empty()) << usage.dump();
  EXPECT_EQ(usage["usage"]["completion_tokens"], 2 * u1["completion_tokens"].get<int>()) << usage.dump();
  EXPECT_EQ(usage["usage"]["prompt_tokens"], u1["prompt_tokens"]) << usage.dump();

  // One request each in the metrics.
  const std::string m = metrics(*s);
  double requests = 0;
  for (const std::string result : {"stop", "length"})
    for (const std::string endpoint : {"chat", "completions"})
      requests += std::max(0.0, series(m, "batchlm_completions_total{endpoint=\"" + endpoint + "\",result=\"" + result + "\"}"));
  EXPECT_EQ(requests, 9) << m;
}

TEST_F(Serve, BadRequestsNameTheField) {
  auto s = serve();
  expect_error(post(*s, "/v1/chat/completions", chat_request("Hi", {{"temperature", 5}})), 400,
               "invalid_request_error", "temperature", nullptr);
  expect_error(post(*s, "/v1/chat/completions", R"({"model": "tiny"})"), 400, "invalid_request_error", "messages",
               nullptr);
  expect_error(post(*s, "/v1/chat/completions", R"({"messages": [{"role": "user"}]})"), 400,
               "invalid_request_error", "messages[0].content", nullptr);
  expect_error(post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 0}})), 400,
               "invalid_request_error", "max_tokens", nullptr);
  expect_error(post(*s, "/v1/chat/completions", chat_request("Hi", {{"n", 129}})), 400, "invalid_request_error", "n",
               nullptr);
  expect_error(post(*s, "/v1/chat/completions", chat_request("Hi", {{"stream_options", {{"include_usage", true}}}})),
               400, "invalid_request_error", "stream_options", nullptr);
  expect_error(post(*s, "/v1/completions", R"({"prompt": "x", "echo": true})"), 400, "invalid_request_error", "echo",
               "unsupported_parameter");
  HttpResponse bad_json = post(*s, "/v1/chat/completions", R"({"messages": [)");
  expect_error(bad_json, 400, "invalid_request_error", nullptr, nullptr);
  EXPECT_TRUE(contains(bad_json.body, "not valid JSON")) << bad_json.body;
  // The message says what was wrong.
  const json e = post(*s, "/v1/chat/completions", chat_request("Hi", {{"top_p", 1.5}})).json_body();
  EXPECT_EQ(e["error"]["message"], "'top_p' must be between 0.0 and 1.0, not 1.5") << e.dump();

  // A prompt longer than the context: the engine's own 400.
  std::string words;
  for (int i = 0; i < 200; ++i) words += "the cat ";
  HttpResponse too_long = post(*s, "/v1/completions", json({{"prompt", words}}).dump());
  expect_error(too_long, 400, "invalid_request_error", "prompt", "context_length_exceeded");
  // ... and as a stream: a plain error response, not an event stream.
  HttpResponse too_long_stream = post(*s, "/v1/completions", json({{"prompt", words}, {"stream", true}}).dump());
  expect_error(too_long_stream, 400, "invalid_request_error", "prompt", "context_length_exceeded");
  // Megabytes of prompt are refused by their size, before they are tokenized (which would hold
  // up every other request meanwhile).
  HttpResponse huge = post(*s, "/v1/chat/completions", chat_request(std::string(4 << 20, 'a')));
  expect_error(huge, 400, "invalid_request_error", "messages", "context_length_exceeded");
  EXPECT_TRUE(contains(huge.body, "the prompt is at least")) << huge.body.substr(0, 300);
  // What the engine refuses names the field like the server's own checks.
  HttpResponse bias = post(*s, "/v1/chat/completions", chat_request("Hi", {{"logit_bias", {{"99999999", 1}}}}));
  expect_error(bias, 400, "invalid_request_error", "logit_bias", nullptr);
  EXPECT_TRUE(contains(bias.body, "outside the vocabulary")) << bias.body;
  expect_error(post(*s, "/v1/completions", R"({"prompt": "", "max_tokens": 2})"), 400, "invalid_request_error",
               "prompt", nullptr);
  // Output the engine cannot make is refused by name.
  expect_error(post(*s, "/v1/chat/completions",
                    chat_request("Hi", {{"modalities", {"text", "audio"}}, {"audio", {{"voice", "alloy"}}}})),
               400, "invalid_request_error", "modalities", "unsupported_parameter");
  // An assistant turn that called no tool.
  const json history = {{"messages",
                         {{{"role", "user"}, {"content", "Hi"}},
                          {{"role", "assistant"}, {"content", "Hello"}, {"tool_calls", json::array()}},
                          {{"role", "user"}, {"content", "And?"}}}},
                        {"max_tokens", 1}};
  EXPECT_EQ(post(*s, "/v1/chat/completions", history.dump()).status, 200);

  // Bodies past 64 KiB are read into requests off the thread that serves the connections: the
  // same answers, a refusal naming its field included.
  const std::string long_user(100'000, 'u');
  expect_error(post(*s, "/v1/chat/completions", chat_request("Hi", {{"user", long_user}, {"temperature", 5}})), 400,
               "invalid_request_error", "temperature", nullptr);
  EXPECT_EQ(post(*s, "/v1/chat/completions", chat_request("Hi", {{"user", long_user}, {"max_tokens", 1}})).status, 200);
  HttpResponse big_bad_json = post(*s, "/v1/chat/completions", chat_request("Hi", {{"user", long_user}}) + ",");
  expect_error(big_bad_json, 400, "invalid_request_error", nullptr, nullptr);
  EXPECT_TRUE(contains(big_bad_json.body, "not valid JSON")) << big_bad_json.body;

  // The server still serves.
  EXPECT_EQ(post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 1}})).status, 200);
}

TEST_F(Serve, UnknownPathsAndModelsAre404) {
  auto s = serve();
  expect_error(get(*s, "/"), 404, "invalid_request_error", nullptr, nullptr);
  expect_error(get(*s, "/v2/models"), 404, "invalid_request_error", nullptr, nullptr);
  expect_error(post(*s, "/v1/embeddings", R"({"input": "x"})"), 404, "invalid_request_error", nullptr, nullptr);
  HttpResponse model = post(*s, "/v1/chat/completions", chat_request("Hi", {{"model", "gpt-4o"}}));
  expect_error(model, 404, "invalid_request_error", "model", "model_not_found");
  EXPECT_TRUE(contains(model.body, "gpt-4o")) << model.body;
  expect_error(post(*s, "/v1/completions", R"({"model": "other", "prompt": "x"})"), 404, "invalid_request_error",
               "model", "model_not_found");
}

TEST_F(Serve, WrongMethodIs405WithAllow) {
  auto s = serve();
  HttpResponse chat = get(*s, "/v1/chat/completions");
  expect_error(chat, 405, "invalid_request_error", nullptr, nullptr);
  EXPECT_EQ(chat.header("allow"), "POST");
  HttpResponse completions = request({.method = "PUT", .url = s->url("/v1/completions"), .body = "{}"});
  expect_error(completions, 405, "invalid_request_error", nullptr, nullptr);
  EXPECT_EQ(completions.header("allow"), "POST");
  HttpResponse health = post(*s, "/health", "{}");
  expect_error(health, 405, "invalid_request_error", nullptr, nullptr);
  EXPECT_EQ(health.header("allow"), "GET, HEAD");
  HttpResponse models = request({.method = "DELETE", .url = s->url("/v1/models/tiny")});
  expect_error(models, 405, "invalid_request_error", nullptr, nullptr);
  EXPECT_EQ(models.header("allow"), "GET, HEAD");
  // A method HTTP does not define is not implemented (501), on any path.
  for (const std::string path : {"/v1/chat/completions", "/health", "/nowhere"}) {
    HttpResponse brew = request({.method = "BREW", .url = s->url(path)});
    expect_error(brew, 501, "invalid_request_error", nullptr, nullptr);
    EXPECT_TRUE(contains(brew.body, "the method 'BREW' is not one this server implements")) << brew.body;
  }
}

TEST_F(Serve, OversizedBodyIs413) {
  auto s = serve();
  // 8 MiB is the limit; the body is refused from its Content-Length.
  std::string big = R"({"prompt": ")" + std::string(9u << 20, 'a') + R"("})";
  HttpResponse r = request({.method = "POST", .url = s->url("/v1/completions"), .body = big, .headers = {"Expect:"}});
  EXPECT_EQ(r.status, 413) << r.error;
  if (r.status == 413) {
    expect_error(r, 413, "invalid_request_error", nullptr, nullptr);
  }
  EXPECT_EQ(post(*s, "/v1/completions", R"({"prompt": "x", "max_tokens": 1})").status, 200);
}

// Bodies held at once over all connections are bounded (--max-body-memory): a request whose
// body would go past it while another client is still uploading gets 503 with Retry-After, and
// the room comes back when that upload ends.
TEST_F(Serve, BodiesHeldAtOnceAreBounded) {
  auto s = serve({"--max-body-memory", "8MiB"});
  auto head = [](std::size_t length) {
    return "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
           std::to_string(length) + "\r\n\r\n";
  };
  auto uploading = std::make_unique<RawConnection>(s->port());
  uploading->send_raw(head(6u << 20) + std::string(5u << 20, 'x'));  // 5 of its 6 MiB
  std::this_thread::sleep_for(500ms);  // the server reads what was sent
  RawConnection second(s->port());
  second.send_raw(head(4u << 20));
  second.send_until_stalled(4u << 20, 2s);
  ASSERT_TRUE(second.read_until("\r\n\r\n{", 10s)) << second.received().substr(0, 400);
  EXPECT_TRUE(second.received().starts_with("HTTP/1.1 503")) << second.received().substr(0, 400);
  EXPECT_TRUE(contains(second.received(), "Retry-After: 1")) << second.received().substr(0, 400);
  EXPECT_TRUE(contains(second.received(), "its limit; retry after 1 s")) << second.received().substr(0, 600);
  // The first upload goes away: the same request is read whole now (and refused for its JSON).
  uploading.reset();
  std::this_thread::sleep_for(200ms);
  RawConnection third(s->port());
  third.send_raw(head(4u << 20) + std::string(4u << 20, 'x'));
  ASSERT_TRUE(third.read_until("\r\n\r\n", 10s)) << third.received().substr(0, 400);
  EXPECT_TRUE(third.received().starts_with("HTTP/1.1 400")) << third.received().substr(0, 400);
  EXPECT_EQ(post(*s, "/v1/completions", R"({"prompt": "x", "max_tokens": 1})").status, 200);
}

TEST_F(Serve, MaxBodyMemoryBelowOneBodyIsAUsageError) {
  RunResult r = run_batchlm(dir(), {"serve", "--model", "tiny.gguf", "--max-body-memory", "1MiB"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "--max-body-memory: 1MiB is less than one request body may be (8MiB)")) << r.err;
}

// HTTP/1.0 has no chunked transfer coding (RFC 9112 6.1: a server must not send
// Transfer-Encoding to a 1.0 client): a stream to a 1.0 client is the raw events, ended by
// closing the connection. Disabled: the server answers chunked today (server.cpp, write_stream).
TEST_F(Serve, StreamingToAnHttp10ClientIsNotChunked) {
  auto s = serve();
  RawConnection c(s->port());
  c.send_post("/v1/completions", R"({"prompt": "Hi", "max_tokens": 2, "temperature": 0, "stream": true})",
              "HTTP/1.0");
  ASSERT_TRUE(c.read_to_end(10s)) << c.received();
  const std::string& text = c.received();
  const std::size_t head_end = text.find("\r\n\r\n");
  ASSERT_NE(head_end, std::string::npos) << text;
  const std::string head = text.substr(0, head_end);
  EXPECT_TRUE(head.starts_with("HTTP/1.0 200")) << head;
  EXPECT_FALSE(contains(head, "Transfer-Encoding")) << head;
  const std::vector<json> chunks = sse_chunks(text.substr(head_end + 4));
  EXPECT_EQ(chunks.size(), 3u);  // two text chunks, the finish chunk
}

TEST_F(Serve, ExpectContinueIsAnsweredBeforeTheBody) {
  auto s = serve();
  RawConnection c(s->port());
  const std::string body = R"({"prompt": "Hi", "max_tokens": 2, "temperature": 0})";
  c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             "Expect: 100-continue\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n");
  // Clients wait for this (curl: up to 1 s) before sending the body.
  ASSERT_TRUE(c.read_until("HTTP/1.1 100 Continue\r\n\r\n", 3s)) << c.received();
  c.send_raw(body);
  ASSERT_TRUE(c.read_until("\"total_tokens\"", 10s)) << c.received();
  EXPECT_TRUE(contains(c.received(), "HTTP/1.1 200 OK")) << c.received();
}

// ---- authentication --------------------------------------------------------------------------

TEST_F(Serve, ApiKeyGuardsV1ButNotHealth) {
  auto s = serve({"--api-key", "s3cret"});
  EXPECT_TRUE(s->listening_line().ends_with("; API key required)")) << s->listening_line();
  HttpResponse none = get(*s, "/v1/models");
  expect_error(none, 401, "invalid_request_error", nullptr, "invalid_api_key");
  EXPECT_EQ(none.header("www-authenticate"), "Bearer");
  HttpResponse wrong = get(*s, "/v1/models", {"Authorization: Bearer s3cre"});
  expect_error(wrong, 401, "invalid_request_error", nullptr, "invalid_api_key");
  EXPECT_EQ(wrong.json_body()["error"]["message"], "incorrect API key");
  expect_error(get(*s, "/v1/models", {"Authorization: Bearer s3cret2"}), 401, "invalid_request_error", nullptr,
               "invalid_api_key");
  expect_error(get(*s, "/v1/models", {"Authorization: s3cret"}), 401, "invalid_request_error", nullptr,
               "invalid_api_key");
  expect_error(post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 1}})), 401,
               "invalid_request_error", nullptr, "invalid_api_key");

  EXPECT_EQ(get(*s, "/v1/models", {"Authorization: Bearer s3cret"}).status, 200);
  EXPECT_EQ(get(*s, "/v1/models", {"Authorization: bearer s3cret"}).status, 200);  // the scheme is case-insensitive
  HttpResponse chat = post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 1}}),
                           {"Authorization: Bearer s3cret"});
  EXPECT_EQ(chat.status, 200) << chat.body;
  EXPECT_EQ(get(*s, "/health").status, 200);
  // The completion refused for its key counts as refused (a 4xx): it went uncounted.
  const std::string m = metrics(*s);
  EXPECT_EQ(series(m, R"(batchlm_completions_total{endpoint="chat",result="invalid"})"), 1) << m;
  EXPECT_EQ(series(m, R"(batchlm_completions_total{endpoint="chat",result="length"})"), 1) << m;
}

TEST_F(Serve, ApiKeyFromTheEnvironment) {
  auto s = serve({}, {{"BATCHLM_API_KEY", "from-env"}});
  EXPECT_EQ(get(*s, "/v1/models").status, 401);
  EXPECT_EQ(get(*s, "/v1/models", {"Authorization: Bearer from-env"}).status, 200);
}

// ---- CORS ------------------------------------------------------------------------------------

// A browser's preflight for a POST from `origin` asking to send these headers.
CurlRequest preflight(const ServeProcess& s, const std::string& path, const std::string& origin) {
  return {.method = "OPTIONS",
          .url = s.url(path),
          .body = std::nullopt,
          .headers = {"Origin: " + origin, "Access-Control-Request-Method: POST",
                      "Access-Control-Request-Headers: content-type,authorization,x-stainless-os"}};
}

TEST_F(Serve, AnyOriginMayCallByDefault) {
  auto s = serve({"--api-key", "k"});
  const std::string origin = "Origin: http://localhost:3000";
  // The preflight carries no credentials, so it is answered before the key is checked.
  for (const std::string path : {"/v1/chat/completions", "/v1/models", "/health"}) {
    SCOPED_TRACE(path);
    HttpResponse p = request(preflight(*s, path, "http://localhost:3000"));
    EXPECT_EQ(p.status, 204) << p.body;
    EXPECT_EQ(p.body, "");
    EXPECT_EQ(p.header("access-control-allow-origin"), "*");
    EXPECT_EQ(p.header("access-control-allow-methods"), "GET, HEAD, POST, OPTIONS");
    EXPECT_EQ(p.header("access-control-allow-headers"),
              "Authorization, Content-Type, content-type,authorization,x-stainless-os");
    EXPECT_EQ(p.header("access-control-max-age"), "600");
    EXPECT_EQ(p.header("vary"), "");
  }
  // Every answer to a page lets it read it: successes, errors, streams.
  const std::string key = "Authorization: Bearer k";
  HttpResponse models = get(*s, "/v1/models", {origin, key});
  EXPECT_EQ(models.status, 200) << models.body;
  EXPECT_EQ(models.header("access-control-allow-origin"), "*");
  HttpResponse unauthorized = get(*s, "/v1/models", {origin});
  EXPECT_EQ(unauthorized.status, 401) << unauthorized.body;
  EXPECT_EQ(unauthorized.header("access-control-allow-origin"), "*");
  HttpResponse invalid = post(*s, "/v1/chat/completions", chat_request("Hi", {{"temperature", 9}}), {origin, key});
  EXPECT_EQ(invalid.status, 400) << invalid.body;
  EXPECT_EQ(invalid.header("access-control-allow-origin"), "*");
  HttpResponse stream = post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 2}, {"stream", true}}),
                             {origin, key});
  EXPECT_EQ(stream.status, 200) << stream.body;
  EXPECT_EQ(stream.header("content-type"), "text/event-stream");
  EXPECT_EQ(stream.header("access-control-allow-origin"), "*");
  // Without an Origin (not a browser) there is nothing to allow.
  EXPECT_EQ(get(*s, "/health").header("access-control-allow-origin"), "");
  // An OPTIONS that is no preflight is a method the endpoints do not serve.
  EXPECT_EQ(request({.method = "OPTIONS", .url = s->url("/health")}).status, 405);
  // A preflight for a path that is no endpoint: there is nothing to allow.
  HttpResponse nowhere = request(preflight(*s, "/v1/nowhere", "http://localhost:3000"));
  expect_error(nowhere, 404, "invalid_request_error", nullptr, nullptr);
}

TEST_F(Serve, AllowedOriginsAreEchoedAndOthersRefused) {
  auto s = serve({"--allowed-origins", "http://localhost:3000, https://app.example.com"});
  for (const std::string origin : {"http://localhost:3000", "https://app.example.com"}) {
    SCOPED_TRACE(origin);
    HttpResponse p = request(preflight(*s, "/v1/chat/completions", origin));
    EXPECT_EQ(p.status, 204) << p.body;
    EXPECT_EQ(p.header("access-control-allow-origin"), origin);
    EXPECT_EQ(p.header("vary"), "Origin");
    HttpResponse chat = post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 1}}), {"Origin: " + origin});
    EXPECT_EQ(chat.status, 200) << chat.body;
    EXPECT_EQ(chat.header("access-control-allow-origin"), origin);
    EXPECT_EQ(chat.header("vary"), "Origin");
  }
  // Another origin's preflight is refused, and its page may not read the answers.
  HttpResponse other = request(preflight(*s, "/v1/chat/completions", "https://evil.example"));
  expect_error(other, 403, "invalid_request_error", nullptr, nullptr);
  EXPECT_EQ(other.header("access-control-allow-origin"), "");
  HttpResponse chat =
      post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 1}}), {"Origin: https://evil.example"});
  EXPECT_EQ(chat.status, 200) << chat.body;
  EXPECT_EQ(chat.header("access-control-allow-origin"), "");
}

TEST_F(Serve, AllowedOriginsNoneTurnsCorsOff) {
  auto s = serve({"--allowed-origins", "none", "--api-key", "k"});
  HttpResponse p = request(preflight(*s, "/v1/chat/completions", "http://localhost:3000"));
  expect_error(p, 401, "invalid_request_error", nullptr, "invalid_api_key");
  EXPECT_EQ(p.header("access-control-allow-origin"), "");
  HttpResponse health = get(*s, "/health", {"Origin: http://localhost:3000"});
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(health.header("access-control-allow-origin"), "");

  // What no browser sends as its Origin is a usage error.
  for (const std::string value : {"http://localhost:3000/", "localhost:3000", "http://a,", "none,http://a"}) {
    SCOPED_TRACE(value);
    RunResult r = run_batchlm(dir(), {"serve", "--model", "tiny.gguf", "--port", "0", "--allowed-origins", value});
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_TRUE(contains(r.err, "--allowed-origins")) << r.err;
  }
}

// ---- load, hang-ups, shutdown ----------------------------------------------------------------

// A long greedy chat on long.gguf: thousands of tokens, seconds of work.
std::string long_chat(bool stream) {
  return chat_request("Write a very long story.", {{"max_tokens", 4000}, {"temperature", 0}, {"stream", stream}});
}

TEST_F(Serve, ConcurrentRequestsAreServedTogether) {
  auto s = serve({"--max-sequences", "4"});
  const std::vector<std::string> prompts = {"Hello", "The weather", "Numbers: 1 2 3", "Why is the sky blue?"};
  std::vector<std::string> alone;
  for (const auto& p : prompts) {
    HttpResponse r = post(*s, "/v1/chat/completions", chat_request(p, {{"max_tokens", 24}, {"temperature", 0}}));
    ASSERT_EQ(r.status, 200) << r.body;
    alone.push_back(r.json_body()["choices"][0]["message"]["content"]);
  }
  const long long steps_before = health(*s)["engine"]["steps"];
  std::vector<std::unique_ptr<CurlCall>> calls;
  for (const auto& p : prompts) {
    calls.push_back(std::make_unique<CurlCall>(
        dir(), CurlRequest{.method = "POST", .url = s->url("/v1/chat/completions"),
                           .body = chat_request(p, {{"max_tokens", 24}, {"temperature", 0}})}));
  }
  for (std::size_t i = 0; i < calls.size(); ++i) {
    HttpResponse r = calls[i]->wait();
    ASSERT_EQ(r.status, 200) << r.body << r.error;
    EXPECT_EQ(r.json_body()["choices"][0]["message"]["content"], alone[i]) << prompts[i];
  }
  const json after = health(*s);
  EXPECT_EQ(after["in_flight"], 0);
  EXPECT_EQ(after["engine"]["running"], 0);
  EXPECT_GT(after["engine"]["steps"].get<long long>(), steps_before);
}

// --kv-recycle reuses finished requests' unshared blocks before new pool memory. Prompt A, a
// different prompt B, then A again: without it A's blocks are still cached the third time;
// with it B's blocks were taken from A's, so A finds less of itself, yet every answer is the
// same (a reused block is written afresh).
TEST_F(Serve, RecyclingKvBlocksReusesFinishedRequestsMemory) {
  const std::string a = "Tell me about the sea, the sky and the mountains, and then about rivers.";
  const std::string b = "Numbers and letters: one two three four five six seven eight nine ten eleven.";
  struct Outcome {
    std::vector<std::string> answers;
    long long a_again_cached = 0;  // prompt tokens of the third request found in the cache
  };
  const auto run = [&](std::vector<std::string> flags) {
    auto s = serve(std::move(flags));
    Outcome out;
    long long cached_before = 0;
    for (const std::string* prompt : {&a, &b, &a}) {
      cached_before = health(*s)["engine"]["prompt_tokens_cached"].get<long long>();
      HttpResponse r = post(*s, "/v1/chat/completions", chat_request(*prompt, {{"max_tokens", 24}, {"temperature", 0}}));
      EXPECT_EQ(r.status, 200) << r.body;
      out.answers.push_back(r.status == 200 ? r.json_body()["choices"][0]["message"]["content"].get<std::string>() : "");
    }
    const json engine = health(*s)["engine"];
    out.a_again_cached = engine["prompt_tokens_cached"].get<long long>() - cached_before;
    EXPECT_EQ(engine["blocks_used"], 0) << engine.dump();
    return out;
  };
  const Outcome spread = run({"--kv-tokens", "512"});
  const Outcome recycled = run({"--kv-tokens", "512", "--kv-recycle"});
  EXPECT_EQ(recycled.answers, spread.answers);
  EXPECT_EQ(spread.answers[2], spread.answers[0]);
  EXPECT_GT(spread.a_again_cached, 0);
  EXPECT_LT(recycled.a_again_cached, spread.a_again_cached);
}

// By default the KV pool is written once before the server listens, so its memory is resident
// from the start (a pool too large for the machine shows at start-up, not under load);
// --no-kv-commit leaves pages to be mapped as the cache grows into them. Answers are the same.
TEST_F(Serve, KvPoolIsCommittedAtStartUnlessToldNot) {
  constexpr long long kPoolKib = 96 * 1024;
  const auto run = [&](std::vector<std::string> flags) {
    flags.insert(flags.end(), {"--kv-memory", "96MiB"});
    auto s = serve(std::move(flags));
    const long long resident = s->resident_kib();
    HttpResponse r = post(*s, "/v1/chat/completions", chat_request("Hello there", {{"max_tokens", 16}, {"temperature", 0}}));
    EXPECT_EQ(r.status, 200) << r.body;
    return std::pair(resident, r.status == 200 ? r.json_body()["choices"][0]["message"]["content"].get<std::string>()
                                               : std::string());
  };
  const auto [committed, committed_answer] = run({});
  const auto [lazy, lazy_answer] = run({"--no-kv-commit"});
  ASSERT_GT(committed, 0);
  ASSERT_GT(lazy, 0);
  EXPECT_GT(committed - lazy, kPoolKib * 9 / 10) << "resident KiB: committed " << committed << ", lazy " << lazy;
  EXPECT_LT(lazy, committed - kPoolKib / 2);
  EXPECT_EQ(committed_answer, lazy_answer);
}

// Out of file descriptors, the server keeps serving the connections it has and tries to accept
// again after a pause, rather than at once in a loop that takes a whole core.
TEST_F(Serve, RunningOutOfFileDescriptorsDoesNotSpin) {
  auto s = serve({}, {{ServeProcess::kNofileLimit, "40"}});
  std::vector<std::unique_ptr<RawConnection>> idle;
  for (int i = 0; i < 60; ++i) idle.push_back(std::make_unique<RawConnection>(s->port()));  // queued past the limit
  std::this_thread::sleep_for(300ms);
  const double before = s->cpu_seconds();
  std::this_thread::sleep_for(1500ms);
  const double used = s->cpu_seconds() - before;
  EXPECT_LT(used, 0.5) << "CPU seconds in 1.5 s with the descriptors used up";  // a spin takes about 1.5
  idle.clear();
  EXPECT_TRUE(wait_until([&] { return get(*s, "/health").status == 200; }, 10s)) << s->stderr_text();
}

TEST_F(Serve, OverCapacityIs429WithRetryAfter) {
  write_long_model();
  auto s = serve({"--max-sequences", "1", "--max-queue", "0"}, {}, "long.gguf");
  RawConnection first(s->port());
  first.send_post("/v1/chat/completions", long_chat(true));
  ASSERT_TRUE(first.read_until("data: ", 20s)) << first.received();

  HttpResponse second = post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 4}}));
  expect_error(second, 429, "rate_limit_error", nullptr, "rate_limit_exceeded");
  EXPECT_EQ(second.header("retry-after"), "1");
  EXPECT_EQ(health(*s)["in_flight"], 1);

  // Hanging up frees the place.
  first.close();
  ASSERT_TRUE(wait_until([&] { return health(*s)["in_flight"] == 0; }, 5s)) << health(*s).dump();
  HttpResponse third = post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 4}}));
  EXPECT_EQ(third.status, 200) << third.body;
  const std::string m = metrics(*s);
  EXPECT_EQ(series(m, R"(batchlm_completions_total{endpoint="chat",result="rejected"})"), 1) << m;
  EXPECT_EQ(series(m, R"(batchlm_http_responses_total{route="/v1/chat/completions",code="429"})"), 1) << m;
}

TEST_F(Serve, ChoicesCountAgainstCapacity) {
  write_long_model();
  // Two choices at once at most: one running, one waiting.
  auto s = serve({"--max-sequences", "1", "--max-queue", "1"}, {}, "long.gguf");
  expect_error(post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 2}, {"n", 3}})), 400,
               "invalid_request_error", "n", nullptr);
  for (const bool stream : {true, false}) {
    SCOPED_TRACE(stream ? "streaming" : "whole");
    const json before = health(*s);
    RawConnection first(s->port());
    json ask = json::parse(long_chat(stream));
    ask["n"] = 2;
    first.send_post("/v1/chat/completions", ask.dump());
    if (stream) {
      ASSERT_TRUE(first.read_until("data: ", 20s)) << first.received();
    } else {
      ASSERT_TRUE(wait_until([&] { return health(*s)["engine"]["generated_tokens"] > before["engine"]["generated_tokens"]; }, 20s));
    }
    EXPECT_EQ(health(*s)["in_flight"], 2);
    expect_error(post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 2}})), 429, "rate_limit_error",
                 nullptr, "rate_limit_exceeded");
    // Hanging up cancels both choices and frees their blocks.
    first.close();
    json h;
    EXPECT_TRUE(wait_until([&] {
      h = health(*s);
      return h["in_flight"] == 0 && h["engine"]["running"] == 0 && h["engine"]["waiting"] == 0 &&
             h["engine"]["blocks_used"] == 0;
    }, 5s)) << h.dump();
    // Cancelled, not finished: far fewer than the 2 x 4000 tokens asked for.
    EXPECT_LT(h["engine"]["generated_tokens"].get<long long>() - before["engine"]["generated_tokens"].get<long long>(),
              3000)
        << h.dump();
  }
  EXPECT_EQ(post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 2}, {"n", 2}})).status, 200);
  const std::string m = metrics(*s);
  EXPECT_EQ(series(m, R"(batchlm_completions_total{endpoint="chat",result="disconnected"})"), 2) << m;
}

TEST_F(Serve, APromptTooLongForTheContextIsRefusedOnceForAllItsChoices) {
  auto s = serve();  // 256 positions
  const std::string huge(300'000, 'a');
  for (const int n : {1, 3}) {
    SCOPED_TRACE(n);
    HttpResponse r = post(*s, "/v1/chat/completions", chat_request(huge, {{"max_tokens", 2}, {"n", n}}));
    expect_error(r, 400, "invalid_request_error", "messages", "context_length_exceeded");
    EXPECT_TRUE(contains(r.body, "256")) << r.body;
  }
  const std::string m = metrics(*s);
  EXPECT_EQ(series(m, R"(batchlm_completions_total{endpoint="chat",result="invalid"})"), 2) << m;
  EXPECT_EQ(series(m, "batchlm_requests_in_flight"), 0) << m;
}

// As OpenAI's API: a max_tokens the context has no room for after the prompt is a 400 naming
// the field the client used, not a reply cut short with "length".
TEST_F(Serve, AMaxTokensPastTheContextIsRefused) {
  auto s = serve();  // 256 positions
  HttpResponse r = post(*s, "/v1/chat/completions", chat_request("Hello", {{"max_tokens", 300}}));
  expect_error(r, 400, "invalid_request_error", "max_tokens", "context_length_exceeded");
  EXPECT_TRUE(contains(r.body, "the context holds 256 tokens")) << r.body;
  r = post(*s, "/v1/chat/completions", chat_request("Hello", {{"max_completion_tokens", 300}, {"n", 2}}));
  expect_error(r, 400, "invalid_request_error", "max_completion_tokens", "context_length_exceeded");
  r = post(*s, "/v1/completions", json{{"prompt", "Hello"}, {"max_tokens", 1000}}.dump());
  expect_error(r, 400, "invalid_request_error", "max_tokens", "context_length_exceeded");
  const json h = health(*s);
  EXPECT_EQ(h["in_flight"], 0) << h.dump();
  EXPECT_EQ(h["engine"]["blocks_used"], 0) << h.dump();
  // Within the room, answered.
  r = post(*s, "/v1/chat/completions", chat_request("Hello", {{"max_tokens", 4}}));
  EXPECT_EQ(r.status, 200) << r.body;
}

TEST_F(Serve, ClientHangingUpCancelsItsRequest) {
  write_long_model();
  auto s = serve({}, {}, "long.gguf");
  for (const bool stream : {true, false}) {
    SCOPED_TRACE(stream ? "streaming" : "whole");
    const json before = health(*s);
    RawConnection c(s->port());
    c.send_post("/v1/chat/completions", long_chat(stream));
    if (stream) {
      ASSERT_TRUE(c.read_until("data: ", 20s)) << c.received();
    } else {
      ASSERT_TRUE(wait_until([&] { return health(*s)["engine"]["generated_tokens"] > before["engine"]["generated_tokens"]; }, 20s));
    }
    c.close();
    json h;
    const bool freed = wait_until([&] {
      h = health(*s);
      return h["in_flight"] == 0 && h["engine"]["running"] == 0 && h["engine"]["blocks_used"] == 0;
    }, 5s);
    EXPECT_TRUE(freed) << h.dump();
    // Cancelled, not finished: far fewer than the 4000 tokens asked for.
    const long long generated =
        h["engine"]["generated_tokens"].get<long long>() - before["engine"]["generated_tokens"].get<long long>();
    EXPECT_LT(generated, 2000) << h.dump();
    EXPECT_EQ(h["engine"]["waiting"], 0) << h.dump();
  }
  const std::string m = metrics(*s);
  EXPECT_EQ(series(m, R"(batchlm_completions_total{endpoint="chat",result="disconnected"})"), 2) << m;
  EXPECT_EQ(series(m, "batchlm_request_duration_seconds_count"), 0) << "neither completed\n" << m;
}

TEST_F(Serve, SigtermFinishesRequestsInFlightThenExits) {
  write_long_model();
  auto s = serve({"--shutdown-grace", "30"}, {}, "long.gguf");
  // Long enough to outlast the checks below (about a second), short enough to finish soon.
  constexpr int kTokens = 1500;
  const json params = {{"max_tokens", kTokens}, {"temperature", 0}};
  json stream_params = params;
  stream_params["stream"] = true;
  stream_params["stream_options"] = {{"include_usage", true}};
  CurlCall whole(dir(), {.method = "POST", .url = s->url("/v1/chat/completions"),
                         .body = chat_request("Write a very long story.", params)});
  CurlCall streamed(dir(), {.method = "POST", .url = s->url("/v1/chat/completions"),
                            .body = chat_request("Write a very long story.", stream_params)});
  ASSERT_TRUE(wait_until([&] { return contains(streamed.body_so_far(), "data: "); }, 20s));
  ASSERT_TRUE(wait_until([&] { return health(*s)["in_flight"] == 2; }, 5s));

  s->signal(SIGTERM);
  EXPECT_TRUE(wait_until([&] { return connection_refused(s->port()); }, 3s)) << "still accepting after SIGTERM";
  EXPECT_FALSE(whole.finished()) << "the request ended before the checks; make it longer";
  EXPECT_FALSE(streamed.finished()) << "the request ended before the checks; make it longer";

  HttpResponse w = whole.wait();
  ASSERT_EQ(w.status, 200) << w.body << w.error;
  EXPECT_EQ(w.curl_exit, 0) << w.error;
  EXPECT_EQ(w.header("connection"), "close");
  const json c = w.json_body();
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length") << w.body;
  EXPECT_EQ(c["usage"]["completion_tokens"], kTokens) << w.body;
  const std::string text = c["choices"][0]["message"]["content"];

  HttpResponse st = streamed.wait();
  ASSERT_EQ(st.status, 200) << st.error;
  EXPECT_EQ(st.curl_exit, 0) << st.error;
  const std::vector<json> chunks = sse_chunks(st.body);  // checks the final [DONE]
  ASSERT_GE(chunks.size(), 3u);
  EXPECT_EQ(chunks.back()["usage"]["completion_tokens"], kTokens);
  EXPECT_EQ(chunks[chunks.size() - 2]["choices"][0]["finish_reason"], "length");
  std::string streamed_text;
  for (std::size_t i = 0; i + 2 < chunks.size(); ++i) streamed_text += chunks[i]["choices"][0]["delta"]["content"];
  EXPECT_EQ(streamed_text, text);

  EXPECT_EQ(s->wait(5s), 0) << s->stderr_text();
  const std::string err = s->stderr_text();
  EXPECT_TRUE(contains(err, "SIGTERM: finishing 2 choices in flight")) << err;
  EXPECT_TRUE(contains(err, "batchlm serve: stopped")) << err;
}

// A request whose first bytes came before SIGTERM is received whole and answered (with
// Connection: close), not dropped with the idle connections.
TEST_F(Serve, SigtermLetsARequestBeingSentArriveAndAnswersIt) {
  auto s = serve({"--shutdown-grace", "30"});
  const std::string body = chat_request("Hi", {{"max_tokens", 4}, {"temperature", 0}});
  RawConnection c(s->port());
  c.send_raw("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body.substr(0, 10));
  std::this_thread::sleep_for(300ms);  // the server has the first bytes
  s->signal(SIGTERM);
  std::this_thread::sleep_for(300ms);
  c.send_raw(body.substr(10));
  ASSERT_TRUE(c.read_to_end(20s)) << c.received();
  EXPECT_TRUE(c.received().starts_with("HTTP/1.1 200 OK\r\n")) << c.received();
  EXPECT_TRUE(contains(c.received(), "Connection: close")) << c.received();
  EXPECT_TRUE(contains(c.received(), "\"finish_reason\"")) << c.received();
  EXPECT_EQ(s->wait(10s), 0) << s->stderr_text();
}

TEST_F(Serve, SigtermWhenIdleExitsAtOnce) {
  auto s = serve();
  EXPECT_EQ(get(*s, "/health").status, 200);
  s->signal(SIGINT);
  EXPECT_EQ(s->wait(5s), 0) << s->stderr_text();
  EXPECT_TRUE(contains(s->stderr_text(), "SIGINT: finishing 0 choices in flight")) << s->stderr_text();
}

TEST_F(Serve, ASecondSignalCancelsWhatIsLeft) {
  write_long_model();
  auto s = serve({"--shutdown-grace", "60"}, {}, "long.gguf");
  RawConnection c(s->port());
  c.send_post("/v1/chat/completions", long_chat(true));
  ASSERT_TRUE(c.read_until("data: ", 20s)) << c.received();
  s->signal(SIGTERM);
  ASSERT_TRUE(wait_until([&] { return connection_refused(s->port()); }, 3s));
  EXPECT_FALSE(s->wait(300ms).has_value()) << "exited with a request in flight: " << s->stderr_text();
  s->signal(SIGTERM);
  EXPECT_EQ(s->wait(5s), 0) << s->stderr_text();
  EXPECT_TRUE(contains(s->stderr_text(), "second signal")) << s->stderr_text();
  // The stream was cut, and says so before it ends: an error event, then [DONE].
  c.read_until("[DONE]", 2s);
  EXPECT_TRUE(contains(c.received(), "\"code\":\"server_shutting_down\"")) << c.received();
  EXPECT_TRUE(contains(c.received(), "was told to stop at once")) << c.received();
  EXPECT_LT(c.received().find("server_shutting_down"), c.received().find("data: [DONE]")) << c.received();
  EXPECT_FALSE(contains(c.received(), "\"finish_reason\":\"stop\"")) << c.received();
}

TEST_F(Serve, ShutdownGraceCutsLongRequests) {
  write_long_model();
  auto s = serve({"--shutdown-grace", "0.5"}, {}, "long.gguf");
  RawConnection c(s->port());
  c.send_post("/v1/chat/completions", long_chat(true));
  ASSERT_TRUE(c.read_until("data: ", 20s)) << c.received();
  RawConnection whole(s->port());
  whole.send_post("/v1/chat/completions", long_chat(false));
  ASSERT_TRUE(wait_until([&] { return get(*s, "/health").body.find("\"in_flight\":2") != std::string::npos; }, 10s));
  const auto start = std::chrono::steady_clock::now();
  s->signal(SIGTERM);
  EXPECT_EQ(s->wait(5s), 0) << s->stderr_text();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  // Both requests are answered: the stream with an error event and [DONE], the other with a 503.
  c.read_until("[DONE]", 2s);
  EXPECT_TRUE(contains(c.received(), "server_shutting_down")) << c.received();
  EXPECT_TRUE(contains(c.received(), "grace period for requests in flight ended")) << c.received();
  EXPECT_TRUE(contains(c.received(), "data: [DONE]")) << c.received();
  whole.read_until("server_shutting_down", 2s);
  EXPECT_TRUE(contains(whole.received(), "HTTP/1.1 503")) << whole.received();
  EXPECT_TRUE(contains(whole.received(), "\r\nRetry-After: 1\r\n")) << whole.received();
  EXPECT_TRUE(contains(whole.received(), "\"type\":\"server_error\"")) << whole.received();
  EXPECT_TRUE(contains(s->stderr_text(), "2 requests still running were cancelled")) << s->stderr_text();
}

// ---- clients that misbehave -------------------------------------------------------------------

// A streaming client that stops reading but keeps its socket open: once a write has made no
// progress for --write-timeout, its request is cancelled (its sequence and KV blocks freed) and
// the connection closed; others are served meanwhile.
TEST_F(Serve, StalledStreamingClientIsCutAfterTheWriteTimeout) {
  write_long_model();
  // A long model name makes every event 16 KiB long, so the stream outgrows what the kernel's
  // socket buffers hold (megabytes) within the first few hundred tokens.
  auto s = serve({"--served-model-name", std::string(16384, 'm'), "--write-timeout", "0.5"}, {}, "long.gguf");
  const json before = health(*s);
  RawConnection stalled(s->port(), 4096);
  stalled.send_post("/v1/chat/completions", long_chat(true));
  json h;
  const bool freed = wait_until([&] {
    h = health(*s);
    return h["engine"]["generated_tokens"] > before["engine"]["generated_tokens"] && h["in_flight"] == 0 &&
           h["engine"]["running"] == 0 && h["engine"]["blocks_used"] == 0;
  }, 20s);
  EXPECT_TRUE(freed) << "in flight " << h["in_flight"] << ", engine " << h["engine"].dump();
  // Cancelled, not finished: fewer than the 4000 tokens asked for.
  const long long generated =
      h["engine"]["generated_tokens"].get<long long>() - before["engine"]["generated_tokens"].get<long long>();
  EXPECT_LT(generated, 4000) << h["engine"].dump();
  // The connection was closed: what the server had sent, then the end.
  EXPECT_TRUE(stalled.read_to_end(10s)) << stalled.received().size() << " bytes";
  HttpResponse other = post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 4}}));
  EXPECT_EQ(other.status, 200) << other.body;
}

// A request still waiting for a place in the engine is cancelled too when its client hangs up:
// it leaves the queue at once rather than running when its turn comes.
TEST_F(Serve, ClientHangingUpWhileQueuedLeavesTheQueue) {
  write_long_model();
  auto s = serve({"--max-sequences", "1"}, {}, "long.gguf");
  RawConnection running(s->port());
  running.send_post("/v1/chat/completions", long_chat(true));
  ASSERT_TRUE(running.read_until("data: ", 20s)) << running.received();
  for (const bool stream : {true, false}) {
    SCOPED_TRACE(stream ? "streaming" : "whole");
    RawConnection queued(s->port());
    queued.send_post("/v1/chat/completions", long_chat(stream));
    ASSERT_TRUE(wait_until([&] { return health(*s)["engine"]["waiting"] == 1; }, 10s)) << health(*s).dump();
    queued.close();
    json h;
    EXPECT_TRUE(wait_until([&] {
      h = health(*s);
      return h["engine"]["waiting"] == 0 && h["in_flight"] == 1;
    }, 5s)) << h.dump();
    EXPECT_EQ(h["engine"]["running"], 1) << h.dump();
  }
}

// A stream whose first token is slow to come (here: queued behind another request) gets its
// status and headers after about a second, not only with that token, so that clients and
// proxies waiting for a response see one; the events follow when the engine gets to it.
TEST_F(Serve, AStreamWaitingForItsFirstTokenGetsItsHeadersFirst) {
  write_long_model();
  auto s = serve({"--max-sequences", "1"}, {}, "long.gguf");
  RawConnection running(s->port());
  running.send_post("/v1/chat/completions", long_chat(true));
  ASSERT_TRUE(running.read_until("data: ", 20s)) << running.received();
  RawConnection queued(s->port());
  queued.send_post("/v1/chat/completions", long_chat(true));
  ASSERT_TRUE(queued.read_until("\r\n\r\n", 10s)) << queued.received();
  EXPECT_TRUE(queued.received().starts_with("HTTP/1.1 200 OK\r\n")) << queued.received();
  EXPECT_TRUE(contains(queued.received(), "text/event-stream")) << queued.received();
  const json h = health(*s);
  EXPECT_EQ(h["engine"]["waiting"], 1) << h.dump();  // still queued: no event yet
  EXPECT_FALSE(contains(queued.received(), "data: ")) << queued.received();
  running.close();  // the queued request runs next, and streams its events
  EXPECT_TRUE(queued.read_until("data: ", 20s)) << queued.received();
}

// The same for whole answers: a client that pipelines requests and reads none of the answers
// is cut once they fill the socket buffers, rather than holding the connection for ever.
TEST_F(Serve, PipeliningClientThatNeverReadsIsCutAfterTheWriteTimeout) {
  auto s = serve({"--served-model-name", std::string(16384, 'm'), "--write-timeout", "0.5"});
  RawConnection c(s->port(), 4096);
  std::string requests;
  for (int i = 0; i < 2000; ++i) requests += "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  c.send_raw(requests);  // 2000 answers of 16 KiB: more than the socket buffers hold
  std::this_thread::sleep_for(3s);
  // Closed meanwhile: what was buffered, then the end (reading now would let a server without
  // the timeout go on, and it would keep the connection open after the last answer).
  EXPECT_TRUE(c.read_to_end(20s));
  std::size_t answers = 0;
  for (std::size_t at = c.received().find("HTTP/1.1 200 OK"); at != std::string::npos;
       at = c.received().find("HTTP/1.1 200 OK", at + 1))
    ++answers;
  EXPECT_GT(answers, 0u);
  EXPECT_LT(answers, 2000u);
  EXPECT_EQ(get(*s, "/health").status, 200);
}

// SIGTERM with a streaming client that stopped reading: the grace period ends, the request is
// cancelled, the error event cannot be written, and the server still exits within seconds (well
// before the 30 s write timeout).
TEST_F(Serve, SigtermWithAStalledStreamingClientStillExits) {
  write_long_model();
  auto s = serve({"--served-model-name", std::string(16384, 'm'), "--shutdown-grace", "1"}, {}, "long.gguf");
  const long long before = health(*s)["engine"]["generated_tokens"];
  RawConnection stalled(s->port(), 4096);
  stalled.send_post("/v1/chat/completions", long_chat(true));
  // 2000 events of 16 KiB: more than the socket buffers take, so the server's write is stuck.
  ASSERT_TRUE(wait_until([&] { return health(*s)["engine"]["generated_tokens"].get<long long>() - before >= 2000; }, 20s));
  s->signal(SIGTERM);
  EXPECT_EQ(s->wait(10s), 0) << s->stderr_text();
  EXPECT_TRUE(contains(s->stderr_text(), "1 requests still running were cancelled")) << s->stderr_text();
}

// A request sent a byte at a time is cut off --request-timeout after its first byte, however
// steadily the bytes come (a deadline, not an idle timeout); an idle keep-alive connection waits
// longer than that for its next request and then has the whole time to send it.
TEST_F(Serve, ARequestTrickledByteByByteIsCutAtTheRequestTimeout) {
  auto s = serve({"--request-timeout", "1"});
  RawConnection trickle(s->port());
  const std::string head = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + std::string(1000, 'a');
  const auto start = std::chrono::steady_clock::now();
  std::size_t sent = 0;
  bool closed = false;
  while (!closed && sent < head.size()) {
    try {
      trickle.send_raw(head.substr(sent, 1));
      ++sent;
    } catch (const std::runtime_error&) {
      closed = true;  // reset
    }
    closed = closed || trickle.read_to_end(50ms);
  }
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(closed) << "still open after " << sent << " bytes";
  EXPECT_GT(took, 900ms);
  EXPECT_LT(took, 20s);
  // Told why before the close.
  EXPECT_TRUE(trickle.received().starts_with("HTTP/1.1 408 Request Timeout\r\n")) << trickle.received();
  EXPECT_TRUE(contains(trickle.received(), "Connection: close\r\n")) << trickle.received();
  EXPECT_TRUE(contains(trickle.received(), "the request did not arrive whole within 1 s (the server's --request-timeout)"))
      << trickle.received();

  // A body announced and never sent: the same.
  RawConnection stalled(s->port());
  stalled.send_raw("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   "Content-Length: 100\r\n\r\n{\"prompt\":");
  EXPECT_TRUE(stalled.read_to_end(10s));
  EXPECT_TRUE(stalled.received().starts_with("HTTP/1.1 408 Request Timeout\r\n")) << stalled.received();
  EXPECT_EQ(health(*s)["status"], "ok");

  RawConnection idle(s->port());
  std::this_thread::sleep_for(1500ms);
  idle.send_raw("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  EXPECT_TRUE(idle.read_to_end(10s));
  EXPECT_TRUE(idle.received().starts_with("HTTP/1.1 200 OK\r\n")) << idle.received();
}

// While its request runs the server watches the connection for a hang-up, keeping what the
// client sends meanwhile (a pipelined request) for later. It keeps only so much: beyond that the
// bytes wait in the socket and the client's sends block, rather than the server's memory
// growing with whatever the client sends. Its hang-up then waits behind the bytes it could not
// send, so the server sees it when the answer is written: after the 4,000 tokens, about 12 s
// here, and several times that on a loaded machine.
TEST_F(Serve, AClientSendingAheadOfItsAnswerIsHeldBack) {
  write_long_model();
  auto s = serve({}, {}, "long.gguf");
  const json before = health(*s);
  const long long resident_before = s->resident_kib();
  RawConnection c(s->port());
  c.send_post("/v1/chat/completions", long_chat(false));
  ASSERT_TRUE(wait_until([&] { return health(*s)["engine"]["generated_tokens"] > before["engine"]["generated_tokens"]; }, 20s));
  constexpr std::size_t kMiB = 1 << 20;
  const std::size_t sent = c.send_until_stalled(256 * kMiB, 1s);
  EXPECT_LT(sent, 64 * kMiB) << "the server took all it was sent";
  const long long grown_kib = s->resident_kib() - resident_before;
  EXPECT_LT(grown_kib, 64 * 1024) << "KiB the server grew by";
  c.close();
  EXPECT_TRUE(wait_until([&] { return health(*s)["in_flight"] == 0; }, 120s));
  EXPECT_EQ(post(*s, "/v1/chat/completions", chat_request("Hi", {{"max_tokens", 4}})).status, 200);
}

// Idle connections up to the limit on open files: the one idle the longest is closed to make
// room for a new client, instead of every new client waiting out the keep-alive timeout. A
// connection whose request is being served is not closed.
TEST_F(Serve, AFloodOfIdleConnectionsDoesNotLockOutNewClients) {
  write_long_model();
  auto s = serve({}, {{ServeProcess::kNofileLimit, "40"}}, "long.gguf");
  RawConnection streaming(s->port());
  streaming.send_post("/v1/chat/completions", long_chat(true));
  ASSERT_TRUE(streaming.read_until("data: ", 20s)) << streaming.received();
  std::vector<std::unique_ptr<RawConnection>> idle;
  for (int i = 0; i < 60; ++i) idle.push_back(std::make_unique<RawConnection>(s->port()));
  RawConnection fresh(s->port());
  fresh.send_raw("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  EXPECT_TRUE(fresh.read_until("\"status\":\"ok\"", 10s)) << fresh.received();
  // The stream goes on to its end.
  EXPECT_TRUE(streaming.read_until("data: [DONE]", 30s)) << "the stream stopped";
  EXPECT_FALSE(contains(streaming.received(), "server_error"));
}

// Making room, a connection that has sent nothing yet is closed before one partway through
// sending its request, however long that one has been open.
TEST_F(Serve, MakingRoomSparesAConnectionSendingItsRequest) {
  auto s = serve({}, {{ServeProcess::kNofileLimit, "40"}});
  RawConnection sending(s->port());
  sending.send_raw("GET /health HTTP/1.1\r\n");
  std::this_thread::sleep_for(300ms);  // accepted, its first bytes read
  std::vector<std::unique_ptr<RawConnection>> idle;
  for (int i = 0; i < 60; ++i) idle.push_back(std::make_unique<RawConnection>(s->port()));
  RawConnection fresh(s->port());
  fresh.send_raw("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  ASSERT_TRUE(fresh.read_until("\"status\":\"ok\"", 10s)) << fresh.received();
  try {
    sending.send_raw("Host: 127.0.0.1\r\nConnection: close\r\n\r\n");
  } catch (const std::runtime_error&) {
  }
  EXPECT_TRUE(sending.read_to_end(10s));
  EXPECT_TRUE(sending.received().starts_with("HTTP/1.1 200 OK\r\n")) << sending.received();
}

// Requests that are unusual but valid get their answers; malformed ones a 4xx; none hangs the
// connection or the server.
std::string hex_size(std::size_t n) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%zx", n);
  return buf;
}

TEST_F(Serve, UnusualAndMalformedRequestsGetClearAnswers) {
  auto s = serve();
  const std::string completion = R"({"prompt": "Hi", "max_tokens": 2, "temperature": 0})";
  const std::string streamed = R"({"prompt": "Hi", "max_tokens": 2, "temperature": 0, "stream": true})";
  const auto post_text = [](const std::string& body, const std::string& extra = "") {
    return "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + extra +
           "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  };
  const auto count = [](const std::string& text, const std::string& needle) {
    std::size_t n = 0;
    for (std::size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
    return n;
  };
  {
    SCOPED_TRACE("three requests written back to back are answered in order");
    RawConnection c(s->port());
    c.send_raw(post_text(completion) + post_text(streamed) +
               "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    ASSERT_TRUE(c.read_to_end(20s)) << c.received();
    const std::string& r = c.received();
    EXPECT_EQ(count(r, "HTTP/1.1 200 OK\r\n"), 3u) << r;
    const std::size_t whole = r.find("\"total_tokens\""), stream = r.find("data: [DONE]"), ok = r.find("\"status\":\"ok\"");
    EXPECT_TRUE(whole < stream && stream < ok) << r;
  }
  {
    SCOPED_TRACE("a CRLF after a body (older clients send one) is skipped, not read as a request");
    RawConnection c(s->port());
    c.send_raw(post_text(completion) + "\r\n\r\n" + "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    ASSERT_TRUE(c.read_to_end(20s)) << c.received();
    EXPECT_EQ(count(c.received(), "HTTP/1.1 200 OK\r\n"), 2u) << c.received();
    EXPECT_EQ(c.received().find(" 400 "), std::string::npos) << c.received();
  }
  {
    SCOPED_TRACE("HTTP/1.1 needs one Host field, none two; HTTP/1.0 takes no Transfer-Encoding and no 100 Continue");
    RawConnection no_host(s->port());
    no_host.send_raw("GET /health HTTP/1.1\r\n\r\n");
    ASSERT_TRUE(no_host.read_to_end(10s)) << no_host.received();
    EXPECT_TRUE(no_host.received().starts_with("HTTP/1.1 400 Bad Request\r\n")) << no_host.received();
    EXPECT_NE(no_host.received().find("needs one Host header field"), std::string::npos) << no_host.received();
    for (const char* version : {"1.0", "1.1"}) {
      RawConnection two_hosts(s->port());
      two_hosts.send_raw(std::string("GET /health HTTP/") + version + "\r\nHost: a\r\nHost: b\r\n\r\n");
      ASSERT_TRUE(two_hosts.read_to_end(10s)) << two_hosts.received();
      EXPECT_TRUE(two_hosts.received().starts_with(std::string("HTTP/") + version + " 400 Bad Request\r\n"))
          << two_hosts.received();
      EXPECT_NE(two_hosts.received().find("only one Host header field"), std::string::npos) << two_hosts.received();
    }
    RawConnection chunked(s->port());
    chunked.send_raw("POST /v1/completions HTTP/1.0\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n" +
                     hex_size(completion.size()) + "\r\n" + completion + "\r\n0\r\n\r\n");
    ASSERT_TRUE(chunked.read_to_end(10s)) << chunked.received();
    EXPECT_TRUE(chunked.received().starts_with("HTTP/1.0 400 Bad Request\r\n")) << chunked.received();
    RawConnection expect(s->port());
    expect.send_raw("POST /v1/completions HTTP/1.0\r\nExpect: 100-continue\r\nContent-Type: application/json\r\n"
                    "Content-Length: " + std::to_string(completion.size()) + "\r\n\r\n" + completion);
    ASSERT_TRUE(expect.read_to_end(20s)) << expect.received();
    EXPECT_TRUE(expect.received().starts_with("HTTP/1.0 200 OK\r\n")) << expect.received();
  }
  {
    SCOPED_TRACE("HTTP/1.0 without keep-alive: the answer, then the connection closes");
    RawConnection c(s->port());
    c.send_raw("GET /health HTTP/1.0\r\n\r\n");
    ASSERT_TRUE(c.read_to_end(10s)) << c.received();
    EXPECT_TRUE(c.received().starts_with("HTTP/1.0 200 OK\r\n")) << c.received();
  }
  const auto hex = [](std::size_t n) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%zx", n);
    return std::string(buf);
  };
  {
    SCOPED_TRACE("a chunked request body");
    RawConnection c(s->port());
    const std::string first = completion.substr(0, 10), rest = completion.substr(10);
    c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" +
               hex(first.size()) + "\r\n" + first + "\r\n" + hex(rest.size()) + "\r\n" + rest + "\r\n0\r\n\r\n");
    ASSERT_TRUE(c.read_to_end(10s)) << c.received();
    EXPECT_TRUE(c.received().starts_with("HTTP/1.1 200 OK\r\n")) << c.received();
    EXPECT_TRUE(contains(c.received(), "\"total_tokens\"")) << c.received();
  }
  {
    SCOPED_TRACE("a body shorter than its Content-Length, then the end of the stream");
    RawConnection c(s->port());
    c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               "Content-Length: 1000\r\n\r\n" + completion);
    c.shutdown_send();
    ASSERT_TRUE(c.read_to_end(10s)) << c.received();
    EXPECT_TRUE(c.received().starts_with("HTTP/1.1 400 Bad Request\r\n")) << c.received();
  }
  {
    SCOPED_TRACE("5000 header fields within the 64 KiB for the head");
    RawConnection c(s->port());
    std::string head = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
    for (int i = 0; i < 5000; ++i) head += "X-" + std::to_string(i) + ": v\r\n";
    c.send_raw(head + "\r\n");
    ASSERT_TRUE(c.read_to_end(10s)) << c.received().substr(0, 300);
    EXPECT_TRUE(c.received().starts_with("HTTP/1.1 200 OK\r\n")) << c.received().substr(0, 300);
  }
  for (const bool long_target : {true, false}) {
    SCOPED_TRACE(long_target ? "a 64 KiB request target" : "header fields beyond 64 KiB");
    RawConnection c(s->port());
    std::string head = long_target ? "GET /v1/models/" + std::string(64 * 1024, 'a') + " HTTP/1.1\r\n"
                                   : "GET /health HTTP/1.1\r\n";
    if (!long_target)
      for (int i = 0; i < 10000; ++i) head += "X-" + std::to_string(i) + ": v\r\n";
    c.send_raw(head + "Host: 127.0.0.1\r\n\r\n");
    ASSERT_TRUE(c.read_to_end(10s)) << c.received().substr(0, 300);
    EXPECT_TRUE(c.received().starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n")) << c.received();
    EXPECT_TRUE(contains(c.received(), "65536 bytes")) << c.received();
  }
  {
    // RFC 9112 6.3: its length cannot be known, so the body must not be read as the next request.
    SCOPED_TRACE("a body in a transfer coding other than chunked");
    RawConnection c(s->port());
    c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               "Transfer-Encoding: gzip\r\n\r\nGET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    ASSERT_TRUE(c.read_to_end(10s)) << c.received();
    EXPECT_TRUE(c.received().starts_with("HTTP/1.1 501 Not Implemented\r\n")) << c.received();
    EXPECT_TRUE(contains(c.received(), "Transfer-Encoding")) << c.received();
    EXPECT_EQ(count(c.received(), "HTTP/1.1 "), 1u) << c.received();
  }
  for (const std::string coding : {"gzip, chunked", "foo,chunked", "chunked, gzip"}) {
    // RFC 9112 6.1: a coding the server does not know is a 501, wherever it stands; before
    // chunked, the body is not read as if it had not been applied.
    SCOPED_TRACE("a body in the transfer codings " + coding);
    RawConnection c(s->port());
    c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               "Transfer-Encoding: " + coding + "\r\nConnection: close\r\n\r\n" + hex(completion.size()) + "\r\n" + completion +
               "\r\n0\r\n\r\n");
    ASSERT_TRUE(c.read_to_end(10s)) << c.received();
    EXPECT_TRUE(c.received().starts_with("HTTP/1.1 501 Not Implemented\r\n")) << c.received();
    EXPECT_TRUE(contains(c.received(), "\"type\":\"invalid_request_error\"")) << c.received();
    EXPECT_EQ(count(c.received(), "HTTP/1.1 "), 1u) << c.received();
  }
  // RFC 9110 8.4: a content coding the server does not take, in any Content-Encoding field, is a
  // 415 that names it; "identity" is no coding.
  struct Coding {
    std::string fields, status, says;
  };
  for (const Coding& k : {Coding{"Content-Encoding: gzip\r\n", "415 Unsupported Media Type", "Content-Encoding 'gzip' is not supported"},
                          Coding{"Content-Encoding: identity\r\nContent-Encoding: br\r\n", "415 Unsupported Media Type",
                                 "Content-Encoding 'br' is not supported"},
                          Coding{"Content-Encoding: identity\r\n", "200 OK", "\"choices\""}}) {
    SCOPED_TRACE(k.fields);
    RawConnection c(s->port());
    c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + k.fields +
               "Connection: close\r\nContent-Length: " + std::to_string(completion.size()) + "\r\n\r\n" + completion);
    ASSERT_TRUE(c.read_to_end(30s)) << c.received();
    EXPECT_TRUE(c.received().starts_with("HTTP/1.1 " + k.status + "\r\n")) << c.received();
    EXPECT_TRUE(contains(c.received(), k.says)) << c.received();
    if (k.status.starts_with("415")) {
      EXPECT_TRUE(contains(c.received(), "Accept-Encoding: identity\r\n")) << c.received();
    }
  }
  for (const std::string path : {"/\xff", "/v1/models/\xfe"}) {
    SCOPED_TRACE("a path that is not UTF-8, quoted in the error message");
    RawConnection c(s->port());
    c.send_raw("GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    ASSERT_TRUE(c.read_to_end(10s)) << c.received();
    EXPECT_TRUE(c.received().starts_with("HTTP/1.1 404 Not Found\r\n")) << c.received();
    EXPECT_TRUE(contains(c.received(), "\xef\xbf\xbd")) << c.received();  // U+FFFD
  }
  {
    SCOPED_TRACE("not HTTP");
    RawConnection c(s->port());
    c.send_raw("hello there\r\n\r\n");
    ASSERT_TRUE(c.read_to_end(10s)) << c.received();
    EXPECT_TRUE(c.received().starts_with("HTTP/1.1 400 Bad Request\r\n")) << c.received();
  }
  EXPECT_EQ(health(*s)["in_flight"], 0);
}

// RFC 9112 3.2.2: a server must accept a target in absolute form, which proxies send. A path is
// routed percent-decoded, as clients may encode any character of it.
TEST_F(Serve, AbsoluteFormTargetsAndEncodedPathsAreRouted) {
  auto s = serve();
  {
    SCOPED_TRACE("an absolute-form request target");
    RawConnection c(s->port());
    c.send_raw("GET http://127.0.0.1:" + std::to_string(s->port()) +
               "/v1/models?x=1 HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    ASSERT_TRUE(c.read_to_end(10s)) << c.received();
    EXPECT_TRUE(c.received().starts_with("HTTP/1.1 200 OK\r\n")) << c.received();
    EXPECT_TRUE(contains(c.received(), "\"object\":\"list\"")) << c.received();
  }
  for (const std::string path : {"/v1/mod%65ls", "/v1/models/%74iny", "/%68ealth?a=%2F"}) {
    SCOPED_TRACE("a percent-encoded path, decoded before it is routed: " + path);
    RawConnection c(s->port());
    c.send_raw("GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    ASSERT_TRUE(c.read_to_end(10s)) << c.received();
    EXPECT_TRUE(c.received().starts_with("HTTP/1.1 200 OK\r\n")) << c.received();
  }
  for (const std::string path : {"/v1/models%2Ftiny", "/v1/models%2ftiny", "/v1/mod%6", "/v1/mod%zzls", "/%"}) {
    SCOPED_TRACE("an encoded '/' or a malformed escape: " + path);
    RawConnection c(s->port());
    c.send_raw("GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    ASSERT_TRUE(c.read_to_end(10s)) << c.received();
    EXPECT_TRUE(c.received().starts_with("HTTP/1.1 400 Bad Request\r\n")) << c.received();
    EXPECT_TRUE(contains(c.received(), "percent-escape")) << c.received();
  }
  const std::string m = metrics(*s);
  EXPECT_EQ(series(m, R"(batchlm_http_responses_total{route="/v1/models",code="200"})"), 3) << m;
}

// ---- the real model: the official client, batchlm run -------------------------------------------

class ServeRealModel : public Serve {
 protected:
  void SetUp() override {
    if (!fs::exists(kRealModel)) GTEST_SKIP() << kRealModel << " is absent (scripts/fetch-model.sh fetches it)";
  }
};

TEST_F(ServeRealModel, OfficialOpenAIPythonClient) {
  if (!fs::exists(kPython)) GTEST_SKIP() << kPython << " is absent: run scripts/setup-python.sh";
  {
    Process probe({.args = {kPython.string(), "-c", "import openai"}, .env = {}, .cwd = dir(), .out_file = {},
                   .err_file = dir() / "probe.err"});
    if (probe.wait(30s) != 0) GTEST_SKIP() << "the openai package is missing: run scripts/setup-python.sh";
  }
  auto s = serve({"--api-key", "py-key", "--served-model-name", "smol"}, {}, kRealModel.string());
  Process py({.args = {kPython.string(), kClientCheck.string(), "--base-url", s->base_url(), "--api-key", "py-key",
                       "--model", "smol"},
              .env = {{"OPENAI_API_KEY", ""}, {"OPENAI_BASE_URL", ""}, {"NO_PROXY", "*"}, {"no_proxy", "*"}},
              .cwd = dir(),
              .out_file = dir() / "py.out",
              .err_file = dir() / "py.err"});
  ASSERT_EQ(py.wait(60s), 0) << read_file(dir() / "py.out") << read_file(dir() / "py.err");
  const std::string out = read_file(dir() / "py.out");
  json r;
  ASSERT_NO_THROW(r = json::parse(out)) << out;

  EXPECT_EQ(r["models"], json::array({"smol"})) << out;
  const std::string chat = r["chat"]["text"];
  EXPECT_FALSE(chat.empty()) << out;
  EXPECT_EQ(r["chat"]["model"], "smol") << out;
  EXPECT_EQ(r["chat"]["role"], "assistant") << out;
  EXPECT_EQ(r["stream"]["text"], chat) << "greedy: streamed and whole texts agree\n" << out;
  EXPECT_EQ(r["stream"]["first_role"], "assistant") << out;
  EXPECT_EQ(r["stream"]["usage"], r["chat"]["usage"]) << out;
  EXPECT_EQ(r["stream"]["finish_reason"], r["chat"]["finish_reason"]) << out;
  EXPECT_EQ(r["stream"]["chunks_after_usage"], 0) << out;
  EXPECT_EQ(r["stream"]["ids"], 1) << "one id for all chunks\n" << out;
  EXPECT_TRUE(contains(chat, "Paris")) << out;
  // Two choices, greedy: the answer twice.
  EXPECT_EQ(r["several"]["indexes"], json::array({0, 1})) << out;
  EXPECT_EQ(r["several"]["texts"], json::array({chat, chat})) << out;
  EXPECT_EQ(r["several"]["completion_tokens"], 2 * r["chat"]["usage"]["completion_tokens"].get<int>()) << out;
  EXPECT_EQ(r["completion"]["object"], "text_completion") << out;
  EXPECT_TRUE(r["completion"]["text"].get<std::string>().starts_with(" Paris")) << out;
  // No chat template, so no end of turn: the text runs on to max_tokens.
  EXPECT_EQ(r["completion"]["finish_reason"], "length") << out;
  EXPECT_EQ(r["completion"]["completion_tokens"], 8) << out;
  // Log-probabilities: one entry per token, the greedy choice the most likely, the same whole
  // and streamed; in the completions form with offsets into the text.
  const json& lp = r["logprobs"];
  EXPECT_EQ(lp["text"], chat) << out;
  EXPECT_EQ(lp["joined"], chat) << out;
  EXPECT_EQ(lp["tokens"].get<int>(), lp["completion_tokens"].get<int>() - (lp["finish_reason"] == "stop" ? 1 : 0)) << out;
  EXPECT_EQ(lp["top_sizes"], json::array({3})) << out;
  EXPECT_EQ(lp["chosen_is_best"], true) << out;
  EXPECT_EQ(lp["all_negative"], true) << out;
  EXPECT_EQ(r["logprobs_stream"]["text"], chat) << out;
  EXPECT_EQ(r["logprobs_stream"]["logprobs"], lp["logprobs"]) << out;
  const json& clp = r["completion_logprobs"];
  EXPECT_EQ(clp["joined"], clp["text"]) << out;
  EXPECT_EQ(clp["tokens"], 6) << out;
  EXPECT_EQ(clp["offsets_ok"], true) << out;
  EXPECT_EQ(clp["first_offset"], 24) << out;  // "The capital of France is"
  // Two alternatives and the chosen token, which is one of them when greedy.
  EXPECT_EQ(clp["top_sizes"], json::array({2})) << out;
  EXPECT_EQ(r["logit_bias"]["distinct_tokens"].size(), 1u) << out;
  EXPECT_EQ(r["logit_bias"]["completion_tokens"], 5) << out;
  EXPECT_EQ(r["stop_token_ids"], json({{"finish_reason", "stop"}, {"completion_tokens", 4}})) << out;
  EXPECT_EQ(r["json_mode"]["starts"], "{") << out;
  if (r["json_mode"]["finish_reason"] == "stop") {
    EXPECT_EQ(r["json_mode"]["parsed"], "dict") << out;
  }
  // Structured outputs: the client's own parser took the answer into its pydantic model (it
  // raises when the text does not fit), and the schema's limits hold.
  const json& st = r["structured"];
  EXPECT_EQ(st["finish_reason"], "stop") << out;
  ASSERT_TRUE(st["parsed"].is_object()) << out;
  EXPECT_EQ(json::parse(st["content"].get<std::string>()), st["parsed"]) << out;
  EXPECT_TRUE(st["parsed"]["kind"] == "capital" || st["parsed"]["kind"] == "town") << out;
  EXPECT_LE(st["parsed"]["name"].get<std::string>().size(), 40u) << out;
  EXPECT_LE(st["parsed"]["rivers"].size(), 3u) << out;
  EXPECT_EQ(r["structured_stream"]["text"], st["content"]) << "greedy: streamed and whole agree\n" << out;
  EXPECT_EQ(r["schema_refused"]["status"], 400) << out;
  EXPECT_EQ(r["schema_refused"]["param"], "response_format") << out;
  EXPECT_TRUE(contains(r["schema_refused"]["message"].get<std::string>(), "at /properties/n/minimum: 'minimum' is not supported"))
      << out;
  EXPECT_EQ(r["top_without_logprobs"]["status"], 400) << out;
  EXPECT_EQ(r["top_without_logprobs"]["param"], "top_logprobs") << out;
  EXPECT_EQ(r["bad_request"]["status"], 400) << out;
  EXPECT_EQ(r["bad_request"]["param"], "temperature") << out;
  EXPECT_EQ(r["not_found"]["status"], 404) << out;
  EXPECT_EQ(r["not_found"]["code"], "model_not_found") << out;
  EXPECT_EQ(r["unauthorized"]["status"], 401) << out;

  // The same answer over curl.
  HttpResponse c = post(*s, "/v1/chat/completions", json(r["chat"]["request"]).dump(), {"Authorization: Bearer py-key"});
  ASSERT_EQ(c.status, 200) << c.body;
  EXPECT_EQ(c.json_body()["choices"][0]["message"]["content"], chat);
}

TEST_F(ServeRealModel, BatchlmRunAgainstServeMatchesTheLocalBackend) {
  const std::string job =
      "name: serve-vs-local\n"
      "kind: eval\n"
      "input: " + gsm8k_test_file() + "\n"
      "request:\n"
      "  messages:\n"
      "    - {role: system, content: \"Solve the problem. End with '#### <number>'.\"}\n"
      "    - {role: user, content: \"{{question}}\"}\n"
      "  max_tokens: 256\n"
      "  temperature: 0\n"
      "  extra: {logprobs: true, top_logprobs: 2}\n"
      "concurrency: 4\n"
      "scoring: gsm8k\n";
  write_file(dir() / "job.yaml", job);
  const std::vector<std::string> common = {"run", "job.yaml", "--limit", "4", "--set", "request.max_tokens=48"};

  std::vector<std::string> local = common;
  local.insert(local.end(), {"--model", kRealModel.string(), "--set", "backend.threads=1", "-o", "A.jsonl"});
  RunResult a = run_batchlm(dir(), local);
  ASSERT_EQ(a.exit_code, 0) << a.err;

  auto s = serve({"--max-sequences", "4"}, {}, kRealModel.string());
  std::vector<std::string> remote = common;
  remote.insert(remote.end(), {"--base-url", s->base_url(), "--model", s->model(), "-o", "B.jsonl"});
  RunResult b = run_batchlm(dir(), remote, {{"NO_PROXY", "*"}, {"no_proxy", "*"}});
  ASSERT_EQ(b.exit_code, 0) << b.err;

  std::map<long long, json> local_records, served_records;
  for (const json& rec : read_jsonl(dir() / "A.jsonl")) local_records[rec["id"].get<long long>()] = rec;
  for (const json& rec : read_jsonl(dir() / "B.jsonl")) served_records[rec["id"].get<long long>()] = rec;
  ASSERT_EQ(local_records.size(), 4u);
  ASSERT_EQ(served_records.size(), 4u);
  for (const auto& [id, rec] : local_records) {
    ASSERT_TRUE(served_records.contains(id)) << id;
    const json& other = served_records[id];
    ASSERT_TRUE(rec["output"].is_string()) << rec.dump();
    EXPECT_FALSE(rec["output"].get<std::string>().empty()) << rec.dump();
    EXPECT_EQ(other["output"], rec["output"]) << "id " << id;
    EXPECT_EQ(other["finish_reason"], rec["finish_reason"]) << "id " << id;
    EXPECT_EQ(other["usage"]["prompt_tokens"], rec["usage"]["prompt_tokens"]) << "id " << id;
    EXPECT_EQ(other["usage"]["completion_tokens"], rec["usage"]["completion_tokens"]) << "id " << id;
    // The log-probabilities too, through the server's stream and the client's reading of it.
    ASSERT_TRUE(rec["logprobs"].is_array()) << rec.dump();
    EXPECT_FALSE(rec["logprobs"].empty()) << rec.dump();
    EXPECT_EQ(other["logprobs"], rec["logprobs"]) << "id " << id;
  }
}

}  // namespace
}  // namespace batchlm::e2e
