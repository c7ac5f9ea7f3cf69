// fake_openai_server: the fake OpenAI server as a process, for benchmarks and end-to-end tests
// of the CLI. Prints "listening on http://HOST:PORT" once it accepts connections.

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <pthread.h>

#include <CLI/CLI.hpp>

#include "fake_openai_server.hpp"

namespace {

std::vector<std::string> split_commas(const std::string& list) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= list.size()) {
    auto comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    if (comma > start) out.push_back(list.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

// Written to a temporary name and renamed, so that a reader never sees half a port.
void write_port_file(const std::string& path, std::uint16_t port) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << port << "\n";
    if (!out) throw std::runtime_error("cannot write " + tmp);
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fake OpenAI chat-completions server with fault injection"};
  std::string host = "127.0.0.1";
  int port = 0;
  std::string port_file;
  int threads = 1;
  batchlm::testing::FakeOpenAIOptions options;
  double fault_rate = 1.0;
  std::string faults;
  int fault_first_attempts = 0;
  std::string fault_item;
  std::uint64_t seed = 0;

  app.add_option("--host", host, "Address to listen on")->capture_default_str();
  app.add_option("--port", port, "Port (0: any free port)")->capture_default_str()->check(CLI::Range(0, 65535));
  app.add_option("--port-file", port_file, "Write the port to this file once listening");
  app.add_option("--threads", threads, "Threads serving connections")->capture_default_str()->check(CLI::Range(1, 256));
  app.add_option("--ttft-ms", options.ttft_ms, "Delay before the first token")->capture_default_str();
  app.add_option("--tokens", options.tokens, "Words per generated answer")->capture_default_str();
  app.add_option("--token-delay-ms", options.token_delay_ms, "Delay between tokens")->capture_default_str();
  app.add_option("--gsm8k", options.gsm8k_path, "GSM8K JSONL: answer its questions by script");
  app.add_option("--wrong-every", options.wrong_every,
                 "Answer N+1 on questions whose line number is a multiple of this (0: never)")
      ->capture_default_str();
  app.add_option("--fault-rate", fault_rate, "Probability of a fault per request (with --faults)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--faults", faults,
                 "Comma list of fault specs, one chosen per faulted request "
                 "(e.g. status=500,status=429;retry_after=1,reset_after=2,truncate)");
  app.add_option("--fault-first-attempts", fault_first_attempts,
                 "Fault only the first K requests of each item (0: all)")
      ->capture_default_str();
  app.add_option("--fault-item", fault_item, "Fault only items whose last user message contains this text");
  app.add_option("--seed", seed, "Seed of the fault draws")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    std::vector<batchlm::testing::FaultRule> rules;
    if (!faults.empty()) {
      batchlm::testing::FaultRule rule;
      for (const auto& spec : split_commas(faults)) {
        rule.faults.push_back(batchlm::testing::FaultSpec::parse(spec));
      }
      rule.probability = fault_rate;
      rule.first_attempts_only = fault_first_attempts;
      rule.only_item = fault_item;
      rule.seed = seed;
      rules.push_back(std::move(rule));
    }

    // Block the stop signals before any server thread exists, so that they all inherit the
    // mask and only sigwait below receives them.
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

    batchlm::testing::FakeOpenAIServer server(options, threads, host,
                                              static_cast<std::uint16_t>(port));
    server.set_rules(std::move(rules));
    if (!port_file.empty()) write_port_file(port_file, server.port());
    std::string shown_host = host.find(':') != std::string::npos ? "[" + host + "]" : host;
    std::cout << "listening on http://" << shown_host << ":" << server.port() << std::endl;

    int received = 0;
    sigwait(&stop_signals, &received);
  } catch (const std::exception& e) {
    std::cerr << "fake_openai_server: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
