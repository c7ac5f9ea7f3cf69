// What a server says reaches the user's terminal only as text: escape sequences, control
// characters and NUL bytes in its error messages are written as \xNN, so that a server cannot
// clear or recolour the terminal, or cut a line short. And an address that answers in
// something other than HTTP is named as such, not as a bug of batchlm's.
//
// The servers here are raw sockets in the test process, writing canned replies: the fake
// OpenAI server answers only well-formed HTTP.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>

#include "harness.hpp"

namespace batchlm::e2e {
namespace {

// A loopback listener that answers every connection with the reply `respond` makes, on a
// thread of its own, until destroyed.
class RawServer {
 public:
  enum class When {
    AfterTheRequest,  // reads the request first, as an HTTP server does
    AtOnce,           // speaks first, as an SSH server does with its banner
  };

  RawServer(std::string reply, When when) : reply_(std::move(reply)), when_(when) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (listener_ < 0) throw std::runtime_error("socket failed");
    const int on = 1;
    ::setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = 0;
    socklen_t length = sizeof address;
    if (::bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
        ::listen(listener_, 64) != 0 ||
        ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length) != 0)
      throw std::runtime_error("cannot listen on loopback");
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~RawServer() {
    stop_ = true;
    thread_.join();
    ::close(listener_);
  }

  std::string base_url() const { return "http://127.0.0.1:" + std::to_string(port_) + "/v1"; }
  int connections() const { return connections_; }

 private:
  void serve() {
    while (!stop_) {
      pollfd p{listener_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const int fd = ::accept(listener_, nullptr, nullptr);
      if (fd < 0) continue;
      ++connections_;
      if (when_ == When::AtOnce) send_reply(fd);
      read_request(fd);
      if (when_ == When::AfterTheRequest) send_reply(fd);
      // Closed once the client has read the reply and gone: closing with its bytes unread
      // would reset the connection, and the client would see that instead of the reply.
      ::shutdown(fd, SHUT_WR);
      drain(fd);
      ::close(fd);
    }
  }

  void send_reply(int fd) const {
    (void)!::send(fd, reply_.data(), reply_.size(), MSG_NOSIGNAL);
  }

  // The headers and a Content-Length body, or what came within 2 s.
  static void read_request(int fd) {
    std::string data;
    const auto deadline = std::chrono::steady_clock::now() + 2s;
    while (std::chrono::steady_clock::now() < deadline) {
      if (const auto end = data.find("\r\n\r\n"); end != std::string::npos) {
        std::size_t length = 0;
        if (const auto at = data.find("Content-Length: "); at != std::string::npos && at < end)
          length = std::stoul(data.substr(at + 16));
        if (data.size() >= end + 4 + length) return;
      }
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      char buffer[4096];
      const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
      if (n <= 0) return;
      data.append(buffer, static_cast<std::size_t>(n));
    }
  }

  // Until the client closes, or 2 s.
  static void drain(int fd) {
    const auto deadline = std::chrono::steady_clock::now() + 2s;
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      char buffer[4096];
      if (::recv(fd, buffer, sizeof buffer, 0) <= 0) return;
    }
  }

  std::string reply_;
  When when_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> connections_{0};
  std::thread thread_;
};

std::string http_reply(int status, const std::string& reason, const std::string& body) {
  return "HTTP/1.1 " + std::to_string(status) + " " + reason +
         "\r\nContent-Type: text/plain\r\nConnection: close\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\n\r\n" + body;
}

// A job of `items` one-line questions, at concurrency 4, with retries that wait little.
void write_job(const fs::path& dir, const std::string& base_url, int items) {
  std::string input;
  for (int i = 1; i <= items; ++i) input += "{\"id\": " + std::to_string(i) + ", \"question\": \"q" + std::to_string(i) + "\"}\n";
  write_file(dir / "items.jsonl", input);
  write_file(dir / "job.yaml",
             "name: terminal-safety\n"
             "input: " + (dir / "items.jsonl").string() + "\n"
             "request:\n"
             "  messages:\n"
             "    - {role: user, content: \"{{question}}\"}\n"
             "  max_tokens: 8\n"
             "backend: {type: openai, base_url: \"" + base_url + "\", model: fake-model}\n"
             "concurrency: 4\n"
             "retry: {max_attempts: 2, base: 1ms, cap: 5ms}\n"
             "output: {path: out/results.jsonl}\n");
}

// A string literal's bytes, NULs inside included.
template <std::size_t N>
std::string with_nul(const char (&literal)[N]) {
  return std::string(literal, N - 1);
}

// Bytes that would act on a terminal rather than show on it.
void expect_no_control_bytes(const std::string& text) {
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte == '\n') continue;
    EXPECT_FALSE(byte < 0x20 || byte == 0x7f) << "byte 0x" << std::hex << static_cast<int>(byte) << " at " << std::dec
                                              << i << " in:\n" << text;
  }
}

// The ESC, BEL and CR of the repro, and a NUL that a C-string print would stop at.
const std::string kHostileBody = with_nul("\x1b[2J\x1b[31mRED\x07 bell\rCR\0after NUL");
const std::string kHostileBodyShown = "\\x1b[2J\\x1b[31mRED\\x07 bell\\x0dCR\\x00after NUL";

TEST(TerminalSafety, AFailureMessageIsShownWithItsControlBytesEscapedAndWhole) {
  TempDir dir;
  RawServer server(http_reply(500, "Internal Server Error", kHostileBody), RawServer::When::AfterTheRequest);
  write_job(dir.path, server.base_url(), 3);
  const RunResult r = run_batchlm(dir.path, {"run", "job.yaml", "--set", "retry.max_attempts=1"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  expect_no_control_bytes(r.err);
  EXPECT_NE(r.err.find("failures: http 500: 3 (" + kHostileBodyShown + ")\n"), std::string::npos) << r.err;
  // The record and the summary keep the message as it was.
  const auto records = read_jsonl(dir.path / "out/results.jsonl");
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[0]["error"]["message"], kHostileBody);
  const json summary = json::parse(read_file(dir.path / "out/results.jsonl.summary.json"));
  EXPECT_EQ(summary["failure_examples"]["http 500"], kHostileBody) << summary.dump();
}

TEST(TerminalSafety, TheRefusalThatStopsARunIsShownWithItsControlBytesEscaped) {
  TempDir dir;
  const std::string body = "{\"error\": {\"message\": \"bad key \\u001b]0;owned\\u0007\\u001b[2J\", \"code\": \"invalid_api_key\"}}";
  RawServer server(http_reply(401, "Unauthorized", body), RawServer::When::AfterTheRequest);
  write_job(dir.path, server.base_url(), 30);
  const RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  expect_no_control_bytes(r.err);
  const std::string shown = "(HTTP 401 invalid_api_key: bad key \\x1b]0;owned\\x07\\x1b[2J)";
  EXPECT_NE(r.err.find("batchlm: the API refused the last 10 requests " + shown), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("stopped: the API refused the last 10 requests " + shown), std::string::npos) << r.err;
}

// An error body that is not valid UTF-8 (a raw body is quoted as it came), or one that the
// summary's excerpt would cut through a character: the summary file is still written, the bytes
// JSON cannot hold replaced, and the terminal shows them as \xNN.
TEST(TerminalSafety, AFailureMessageThatIsNotUtf8StillLeavesASummary) {
  struct Case {
    std::string body, shown, kept;
  };
  const std::string a116(116, 'a');
  for (const Case& c : {
           Case{"\xff\xfe raw", "\\xff\\xfe raw", "\xef\xbf\xbd\xef\xbf\xbd raw"},  // U+FFFD twice
           // 116 bytes, then a character across the 117th, where the summary cuts its examples.
           Case{a116 + "\xc3\xa9" + std::string(10, 'b'), a116 + "...", a116 + "..."},
       }) {
    SCOPED_TRACE(c.shown);
    TempDir dir;
    RawServer server(http_reply(500, "Internal Server Error", c.body), RawServer::When::AfterTheRequest);
    write_job(dir.path, server.base_url(), 2);
    const RunResult r = run_batchlm(dir.path, {"run", "job.yaml", "--set", "retry.max_attempts=1"});
    EXPECT_EQ(r.exit_code, 1) << r.err;
    expect_no_control_bytes(r.err);
    EXPECT_NE(r.err.find("failures: http 500: 2 (" + c.shown + ")\n"), std::string::npos) << r.err;
    ASSERT_TRUE(fs::exists(dir.path / "out/results.jsonl.summary.json")) << r.err;
    const json summary = json::parse(read_file(dir.path / "out/results.jsonl.summary.json"));
    EXPECT_EQ(summary["counts"]["failed"], 2) << summary.dump();
    EXPECT_EQ(summary["failure_examples"]["http 500"], c.kept) << summary.dump();
  }
}

// An SSH server's banner, or any bytes that are no HTTP status line: curl calls the reply
// HTTP/0.9. The failure names the address as one that does not answer in HTTP, not as an
// internal error; and since every item would meet it alike, the run stops after ten attempts.
TEST(TerminalSafety, AnAddressThatDoesNotAnswerInHttpIsNamedAndStopsTheRun) {
  const std::pair<const char*, std::string> banners[] = {
      {"ssh", "SSH-2.0-OpenSSH_9.6\r\n"},
      {"raw bytes", with_nul("\x00\x01\x02\xff\x1b[2J garbage\n")},
  };
  for (const auto& [name, banner] : banners) {
    for (const int max_attempts : {1, 3}) {
      SCOPED_TRACE(std::string(name) + ", max_attempts " + std::to_string(max_attempts));
      TempDir dir;
      RawServer server(banner, RawServer::When::AtOnce);
      write_job(dir.path, server.base_url(), 40);
      const RunResult r =
          run_batchlm(dir.path, {"run", "job.yaml", "--set", "retry.max_attempts=" + std::to_string(max_attempts)});
      EXPECT_EQ(r.exit_code, 1) << r.err;
      expect_no_control_bytes(r.err);
      EXPECT_EQ(r.err.find("internal"), std::string::npos) << r.err;
      EXPECT_NE(r.err.find("stopped: " + server.base_url() + " does not answer in HTTP"), std::string::npos) << r.err;
      // Ten attempts in a row, and those in flight then; not every item's.
      EXPECT_LE(server.connections(), 10 + 4) << r.err;
      const json summary = json::parse(read_file(dir.path / "out/results.jsonl.summary.json"));
      EXPECT_GT(summary["counts"]["not_run"].get<int>(), 0) << summary.dump();
      EXPECT_FALSE(summary["failures"].contains("internal")) << summary.dump();
      if (max_attempts == 1) {
        // Items that spent their one attempt failed with a protocol error that names the URL.
        const std::string message = server.base_url() + "/chat/completions does not answer in HTTP";
        EXPECT_NE(r.err.find("failures: protocol: "), std::string::npos) << r.err;
        EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
        const auto records = read_jsonl(dir.path / "out/results.jsonl");
        ASSERT_FALSE(records.empty());
        EXPECT_EQ(records[0]["error"]["kind"], "protocol") << records[0].dump();
        EXPECT_EQ(records[0]["error"]["message"].get<std::string>().rfind(message, 0), 0u) << records[0].dump();
      }
    }
  }
}

}  // namespace
}  // namespace batchlm::e2e
