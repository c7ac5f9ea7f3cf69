// The HTTP client against raw loopback sockets that answer in something other than HTTP: what
// the failure is called, and what its message says.

#include "batchlm/client/http.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>

namespace batchlm::client {
namespace {

namespace asio = boost::asio;

// A loopback listener that greets one connection with `greeting` as soon as it is accepted
// (as an SSH server sends its banner), then waits for the client to go.
class GreetingServer {
 public:
  // `hang_up`: close the connection after the greeting: at once, the request unread, where the
  // greeting is empty; else once the whole request (post()'s, whose body is "{}") has come, so
  // that the client is reading the greeting when the connection closes, not still sending.
  explicit GreetingServer(std::string greeting, bool hang_up = false)
      : greeting_(std::move(greeting)), hang_up_(hang_up) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof address;
    if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
        ::listen(listener_, 4) != 0 || ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length) != 0)
      throw std::runtime_error("cannot listen on loopback");
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~GreetingServer() {
    thread_.join();
    ::close(listener_);
  }

  std::string url(const std::string& path) const { return "http://127.0.0.1:" + std::to_string(port_) + path; }

 private:
  void serve() {
    pollfd p{listener_, POLLIN, 0};
    if (::poll(&p, 1, 10'000) <= 0) return;
    const int fd = ::accept(listener_, nullptr, nullptr);
    if (fd < 0) return;
    if (hang_up_ && !greeting_.empty()) {
      std::string request;
      char part[4096];
      while (request.find("\r\n\r\n{}") == std::string::npos) {
        pollfd q{fd, POLLIN, 0};
        if (::poll(&q, 1, 10'000) <= 0) break;
        const ssize_t n = ::recv(fd, part, sizeof part, 0);
        if (n <= 0) break;
        request.append(part, static_cast<std::size_t>(n));
      }
    }
    if (!greeting_.empty()) (void)!::send(fd, greeting_.data(), greeting_.size(), MSG_NOSIGNAL);
    if (hang_up_) {
      ::close(fd);
      return;
    }
    // Read until the client closes (or 10 s): closing with its request unread would reset the
    // connection, and the client would see that instead of the greeting.
    char buffer[4096];
    for (;;) {
      pollfd q{fd, POLLIN, 0};
      if (::poll(&q, 1, 10'000) <= 0 || ::recv(fd, buffer, sizeof buffer, 0) <= 0) break;
    }
    ::close(fd);
  }

  std::string greeting_;
  bool hang_up_ = false;
  int listener_ = -1;
  int port_ = 0;
  std::thread thread_;
};

HttpResponse post(const std::string& url) {
  asio::io_context io;
  HttpClient client(io.get_executor());
  HttpRequest request{url, {{"Content-Type", "application/json"}}, "{}"};
  request.timeouts.first_byte = std::chrono::seconds(10);
  auto response = asio::co_spawn(io, client.perform(request), asio::use_future);
  io.run();
  return response.get();
}

// curl calls a reply without a status line HTTP/0.9 and fails with the code it also gives for
// a scheme it lacks; the address is what is wrong, not batchlm.
// The greetings: an SSH server's banner, and the alert a TLS server sends to plain text.
TEST(HttpClient, AServerThatDoesNotAnswerInHttpIsAProtocolErrorNamingTheUrl) {
  for (const std::string& greeting : {std::string("SSH-2.0-OpenSSH_9.6\r\n"), std::string("\x15\x03\x01\x00\x02\x02\x0a", 7)}) {
    SCOPED_TRACE(greeting.size());
    GreetingServer server(greeting);
    const std::string url = server.url("/v1/chat/completions");
    const HttpResponse response = post(url);
    ASSERT_TRUE(response.error.has_value());
    EXPECT_EQ(response.error->kind, ErrorKind::Protocol) << response.error->message;
    EXPECT_EQ(response.error->code, "not_http");
    EXPECT_EQ(response.error->message,
              url + " does not answer in HTTP: its reply has no HTTP status line");
  }
}

// A reply that starts like HTTP and then breaks its form is the same mistake, not a server that
// cannot be reached.
TEST(HttpClient, AReplyThatIsNotWellFormedHttpIsAProtocolErrorNamingTheUrl) {
  GreetingServer server("HTTP/1.1 200 OK\r\nno colon in this header\r\n\r\n");
  const std::string url = server.url("/v1/chat/completions");
  const HttpResponse response = post(url);
  ASSERT_TRUE(response.error.has_value());
  EXPECT_EQ(response.error->kind, ErrorKind::Protocol) << response.error->message;
  EXPECT_EQ(response.error->code, "not_http");
  EXPECT_TRUE(response.error->message.starts_with(url + " does not answer in HTTP: its reply is not well-formed HTTP ("))
      << response.error->message;
}

// A port that takes the connection and closes it without a word (a container's published port
// while the container is down) is told apart from one that refuses it and from a reply cut
// after its status line.
TEST(HttpClient, AConnectionClosedBeforeAnyReplyIsNoReply) {
  {
    GreetingServer server("", true);
    const HttpResponse response = post(server.url("/v1/chat/completions"));
    ASSERT_TRUE(response.error.has_value());
    EXPECT_EQ(response.error->kind, ErrorKind::Connection) << response.error->message;
    EXPECT_EQ(response.error->code, "no_reply") << response.error->message;
  }
  {
    GreetingServer server("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"a\"", true);
    const HttpResponse response = post(server.url("/v1/chat/completions"));
    ASSERT_TRUE(response.error.has_value());
    EXPECT_EQ(response.error->kind, ErrorKind::Connection) << response.error->message;
    EXPECT_EQ(response.error->code, "") << response.error->message;
  }
}

// A redirect to a scheme curl lacks fails after a connection, with the code of an HTTP/0.9
// reply; the server did answer in HTTP, so it is not called one that does not.
TEST(HttpClient, ARedirectToASchemeCurlLacksIsNotCalledANonHttpReply) {
  GreetingServer server("HTTP/1.1 307 Temporary Redirect\r\nLocation: gopher://127.0.0.1/x\r\nContent-Length: 0\r\n\r\n");
  const HttpResponse response = post(server.url("/v1/chat/completions"));
  ASSERT_TRUE(response.error.has_value());
  EXPECT_NE(response.error->code, "not_http") << response.error->message;
  EXPECT_NE(response.error->kind, ErrorKind::Protocol) << response.error->message;
}

// A scheme curl does not have fails before any connection: that stays an internal error (a
// job's base URL is checked to be http or https before anything is sent).
TEST(HttpClient, ASchemeCurlLacksIsNotCalledAServerThatDoesNotAnswerInHttp) {
  const HttpResponse response = post("nosuchscheme://127.0.0.1:1/v1/chat/completions");
  ASSERT_TRUE(response.error.has_value());
  EXPECT_EQ(response.error->kind, ErrorKind::Internal) << response.error->message;
  EXPECT_TRUE(response.error->code.empty());
}

}  // namespace
}  // namespace batchlm::client
