#pragma once
// End-to-end harness: runs the real `batchlm` and `fake_openai_server` executables as child
// processes, in a fresh temporary directory, over loopback.

#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <curl/curl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace batchlm::e2e {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace std::chrono_literals;

inline std::string binary(const std::string& name) {
  return std::string(BATCHLM_BINARY_DIR) + "/bin/" + name;
}

inline std::string gsm8k_test_file() {
  return std::string(BATCHLM_SHARED_DATA) + "/gsm8k/test.jsonl";
}

inline std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

inline void write_file(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << text;
}

// A temporary directory removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "batchlm-e2e-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// A child process with stdout and stderr sent to files (or to a pty).
class Process {
 public:
  struct Options {
    std::vector<std::string> args;  // args[0] is the program
    std::map<std::string, std::string> env;  // added to / replacing the parent's
    fs::path cwd;
    fs::path out_file, err_file;    // empty: /dev/null
    bool use_pty = false;           // stdout+stderr on a pseudo-terminal (read with pty_read)
    unsigned short pty_columns = 100;
    std::vector<int> closed_fds;    // left closed in the child, as by `2>&-` (instead of the files)
    int err_fd = -1;                // when >= 0, the child's stderr instead of err_file (a pipe)
    std::vector<int> ignored_signals;  // ignored when the child starts, as under `nohup`
    long long file_size_limit = -1;    // when >= 0, the most bytes any file may reach (`ulimit -f`)
    long long open_files_soft = -1;    // when >= 0, the limits on open files (`ulimit -Sn`, `-Hn`)
    long long open_files_hard = -1;
  };

  explicit Process(const Options& o) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string kv = *e;
      auto name = kv.substr(0, kv.find('='));
      if (!o.env.contains(name)) env_strings.push_back(kv);
    }
    for (const auto& [k, v] : o.env) env_strings.push_back(k + "=" + v);
    std::vector<char*> argv, envp;
    for (const auto& a : o.args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (const auto& e : env_strings) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);

    if (o.use_pty) {
      struct winsize ws {};
      ws.ws_col = o.pty_columns;
      ws.ws_row = 30;
      pid_ = ::forkpty(&pty_fd_, nullptr, nullptr, &ws);
    } else {
      pid_ = ::fork();
    }
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      if (!o.cwd.empty() && ::chdir(o.cwd.c_str()) != 0) ::_exit(127);
      if (!o.use_pty) {
        redirect(STDOUT_FILENO, o.out_file);
        if (o.err_fd >= 0) {
          ::dup2(o.err_fd, STDERR_FILENO);
        } else {
          redirect(STDERR_FILENO, o.err_file);
        }
        int devnull = ::open("/dev/null", O_RDONLY);
        ::dup2(devnull, STDIN_FILENO);
      }
      for (int fd : o.closed_fds) ::close(fd);
      for (int sig : o.ignored_signals) ::signal(sig, SIG_IGN);
      if (o.file_size_limit >= 0) {
        const rlimit limit{static_cast<rlim_t>(o.file_size_limit), static_cast<rlim_t>(o.file_size_limit)};
        ::setrlimit(RLIMIT_FSIZE, &limit);
      }
      if (o.open_files_soft >= 0) {
        const rlimit limit{static_cast<rlim_t>(o.open_files_soft), static_cast<rlim_t>(o.open_files_hard)};
        if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) ::_exit(126);
      }
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
  }
  ~Process() {
    if (pid_ > 0 && !exited_) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
    if (pty_fd_ >= 0) ::close(pty_fd_);
  }

  pid_t pid() const { return pid_; }
  void signal(int sig) { ::kill(pid_, sig); }

  // Exit code (128+signal for a signal death), or nullopt on timeout.
  std::optional<int> wait(std::chrono::milliseconds timeout = 120s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      if (pty_fd_ >= 0) pty_drain();
      int status = 0;
      pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        if (pty_fd_ >= 0) pty_drain();
        if (WIFEXITED(status)) return WEXITSTATUS(status);
        if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
        return -1;
      }
      if (std::chrono::steady_clock::now() > deadline) return std::nullopt;
      std::this_thread::sleep_for(10ms);
    }
  }

  // Typed at the child's terminal: "\x03" is Ctrl-C (the terminal sends SIGINT and echoes ^C).
  void pty_send(const std::string& keys) {
    if (::write(pty_fd_, keys.data(), keys.size()) != static_cast<ssize_t>(keys.size()))
      throw std::runtime_error("cannot write to the pty");
  }

  // Everything the child wrote to its terminal so far.
  const std::string& pty_output() {
    pty_drain();
    return pty_text_;
  }

 private:
  static void redirect(int fd, const fs::path& file) {
    int target = file.empty() ? ::open("/dev/null", O_WRONLY)
                              : ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(target, fd);
  }
  void pty_drain() {
    char buf[4096];
    while (true) {
      pollfd p{pty_fd_, POLLIN, 0};
      if (::poll(&p, 1, 0) <= 0) return;
      ssize_t n = ::read(pty_fd_, buf, sizeof buf);
      if (n <= 0) return;  // EIO once the child's side is closed
      pty_text_.append(buf, static_cast<std::size_t>(n));
    }
  }

  pid_t pid_ = -1;
  int pty_fd_ = -1;
  bool exited_ = false;
  std::string pty_text_;
};

// The fake OpenAI server as a child process on a free loopback port.
class FakeServer {
 public:
  explicit FakeServer(const fs::path& dir, std::vector<std::string> extra_args = {}) {
    const fs::path port_file = dir / "fake.port";
    fs::remove(port_file);  // a server started earlier in the same directory left its port
    std::vector<std::string> args = {binary("fake_openai_server"), "--host", "127.0.0.1", "--port-file",
                                     port_file.string()};
    // Any free port, unless the test names one.
    if (std::find(extra_args.begin(), extra_args.end(), "--port") == extra_args.end())
      args.insert(args.end(), {"--port", "0"});
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    process_ = std::make_unique<Process>(Process::Options{
        .args = args, .env = {}, .cwd = dir, .out_file = dir / "fake.out", .err_file = dir / "fake.err"});
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (std::chrono::steady_clock::now() < deadline) {
      std::string text = read_file(port_file);
      if (!text.empty() && text.back() == '\n') {
        port_ = std::stoi(text);
        return;
      }
      if (!text.empty()) {
        try {
          port_ = std::stoi(text);
          if (port_ > 0) return;
        } catch (...) {
        }
      }
      std::this_thread::sleep_for(20ms);
    }
    throw std::runtime_error("fake_openai_server did not start: " + read_file(dir / "fake.err"));
  }

  std::string base_url() const { return "http://127.0.0.1:" + std::to_string(port_) + "/v1"; }
  int port() const { return port_; }
  // Kills the server (SIGKILL): its port refuses connections until another server takes it.
  void kill() { process_.reset(); }

  json stats() const {
    std::string body;
    CURL* curl = curl_easy_init();
    const std::string url = "http://127.0.0.1:" + std::to_string(port_) + "/_stats";
    curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, +[](char* p, size_t s, size_t n, void* ud) {
      static_cast<std::string*>(ud)->append(p, s * n);
      return s * n;
    });
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &body);
    CURLcode rc = curl_easy_perform(curl);
    curl_easy_cleanup(curl);
    if (rc != CURLE_OK) throw std::runtime_error("GET /_stats failed");
    return json::parse(body);
  }

 private:
  std::unique_ptr<Process> process_;
  int port_ = 0;
};

// Waits for `condition`, checking every few milliseconds; false when `timeout` passed first.
template <typename Condition>
bool wait_until(Condition&& condition, std::chrono::milliseconds timeout = 30s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// Runs the batchlm executable in `dir` and waits for it. Variables that would point it at a
// real API key or another model are cleared unless the test sets them.
struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

inline RunResult run_batchlm(const fs::path& dir, std::vector<std::string> args,
                             std::map<std::string, std::string> env = {}) {
  using namespace std::chrono_literals;
  args.insert(args.begin(), binary("batchlm"));
  env.emplace("BATCHLM_MODEL", "");
  env.emplace("OPENAI_API_KEY", "");
  Process p({.args = args, .env = env, .cwd = dir, .out_file = dir / "stdout.txt",
             .err_file = dir / "stderr.txt"});
  auto code = p.wait(180s);
  RunResult r;
  r.exit_code = code.value_or(-1);
  r.out = read_file(dir / "stdout.txt");
  r.err = read_file(dir / "stderr.txt");
  return r;
}

// Parses a JSONL output file; fails the test on a line that does not parse.
inline std::vector<json> read_jsonl(const fs::path& p) {
  std::vector<json> out;
  std::istringstream in(read_file(p));
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    try {
      out.push_back(json::parse(line));
    } catch (const std::exception& e) {
      ADD_FAILURE() << p << ":" << n << " does not parse: " << e.what();
    }
  }
  return out;
}

inline std::size_t count_lines(const fs::path& p) {
  std::string text = read_file(p);
  return static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n'));
}

}  // namespace batchlm::e2e
