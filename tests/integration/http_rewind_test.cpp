// A keep-alive connection the server closes while a request is on it: curl sends the request
// again on a fresh connection, which needs the body from its start. A raw socket server plays
// the part (answer one request, then drop the connection after reading the second).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <string>
#include <thread>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>

#include "batchlm/client/http.hpp"

namespace batchlm::client {
namespace {

namespace asio = boost::asio;

// Reads one request (headers and a Content-Length body) from fd; "" when the peer closed or
// 10 s passed.
std::string read_request(int fd) {
  std::string data;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    if (const auto end = data.find("\r\n\r\n"); end != std::string::npos) {
      std::size_t length = 0;
      if (const auto at = data.find("Content-Length: "); at != std::string::npos && at < end)
        length = std::stoul(data.substr(at + 16));
      if (data.size() >= end + 4 + length) return data.substr(end + 4, length);
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return "";
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return "";
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return "";
    data.append(buf, static_cast<std::size_t>(n));
  }
}

void reply(int fd, const std::string& body) {
  const std::string res = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: " +
                          std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(::send(fd, res.data(), res.size(), MSG_NOSIGNAL), static_cast<ssize_t>(res.size()));
}

int accept_within(int listener, int ms) {
  pollfd p{listener, POLLIN, 0};
  if (::poll(&p, 1, ms) <= 0) return -1;
  return ::accept(listener, nullptr, nullptr);
}

TEST(HttpClientRewind, RequestResentOnAFreshConnectionCarriesItsWholeBody) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(listener, 4), 0);
  socklen_t len = sizeof addr;
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string url = "http://127.0.0.1:" + std::to_string(ntohs(addr.sin_port)) + "/v1/x";

  std::promise<std::string> resent_body;
  std::thread server([&] {
    const int first = accept_within(listener, 10000);
    if (first < 0) return resent_body.set_value("no connection");
    if (read_request(first) != "one") return resent_body.set_value("bad first request");
    reply(first, "ok1");
    (void)read_request(first);  // the second request, on the kept-alive connection...
    ::close(first);             // ...which goes away without an answer
    const int second = accept_within(listener, 10000);
    if (second < 0) return resent_body.set_value("no fresh connection");
    resent_body.set_value(read_request(second));
    reply(second, "ok2");
    ::close(second);
  });

  asio::io_context io;
  HttpClient client(io.get_executor());
  HttpRequest one{url, {{"Content-Type", "text/plain"}}, "one"};
  HttpRequest two{url, {{"Content-Type", "text/plain"}}, std::string(5000, 'b') + "end"};
  auto first = asio::co_spawn(io, client.perform(one), asio::use_future);
  io.run();
  io.restart();
  auto second = asio::co_spawn(io, client.perform(two), asio::use_future);
  io.run();
  server.join();
  ::close(listener);

  const HttpResponse r1 = first.get();
  EXPECT_EQ(r1.status, 200);
  EXPECT_EQ(r1.body, "ok1");
  const HttpResponse r2 = second.get();
  EXPECT_FALSE(r2.error) << r2.error->message;
  EXPECT_EQ(r2.status, 200);
  EXPECT_EQ(r2.body, "ok2");
  EXPECT_EQ(resent_body.get_future().get(), two.body);
}

}  // namespace
}  // namespace batchlm::client
