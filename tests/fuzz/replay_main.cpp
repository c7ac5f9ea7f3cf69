// Runs one harness's LLVMFuzzerTestOneInput over files, without libFuzzer: the committed
// corpus (tests/fuzz/corpus/<harness>/) in the test suite, or a crash file to reproduce it.
//
//   <harness>_replay DIR_OR_FILE...
//
// Exit status 0 when every input passed; a failing input ends the process as it would under
// libFuzzer (abort, sanitizer report, uncaught exception), after its path is printed. 77 (a
// skipped test) when the harness's LLVMFuzzerInitialize says it cannot run here.

#include <signal.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <unistd.h>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);
// Optional in a harness; the replay calls it when it is there, as libFuzzer does.
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);

namespace {

// The path of the input being run, for the signal handler: set before each input.
char current_input[4096] = "";

constexpr int kSignals[] = {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL};
struct sigaction previous_actions[NSIG];  // what was installed before (a sanitizer's handler)

// Names the input, then puts the previous handler back and returns: abort() raises again, and
// a faulting instruction faults again, into the handler that was there before (a sanitizer's
// report, or the default action). Only async-signal-safe calls here.
void name_failing_input(int signal) {
  static const char kPrefix[] = "\nreplay: input failed: ";
  (void)!::write(STDERR_FILENO, kPrefix, sizeof kPrefix - 1);
  (void)!::write(STDERR_FILENO, current_input, std::strlen(current_input));
  (void)!::write(STDERR_FILENO, "\n", 1);
  ::sigaction(signal, &previous_actions[signal], nullptr);
}

void install_handlers() {
  // Its own stack, so that a stack overflow can still be named.
  static char alternate_stack[1 << 16];
  stack_t stack{};
  stack.ss_sp = alternate_stack;
  stack.ss_size = sizeof alternate_stack;
  ::sigaltstack(&stack, nullptr);
  struct sigaction action {};
  action.sa_handler = name_failing_input;
  action.sa_flags = SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  for (const int signal : kSignals) ::sigaction(signal, &action, &previous_actions[signal]);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR_OR_FILE...\n", argv[0]);
    return 2;
  }
  // Absolute paths: a harness may change directory in its LLVMFuzzerInitialize (job does).
  std::vector<std::filesystem::path> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path arg = std::filesystem::absolute(argv[i]);
    if (std::filesystem::is_directory(arg)) {
      for (const auto& entry : std::filesystem::directory_iterator(arg))
        if (entry.is_regular_file()) inputs.push_back(entry.path());
    } else if (std::filesystem::is_regular_file(arg)) {
      inputs.push_back(arg);
    } else {
      std::fprintf(stderr, "replay: %s: no such file or directory\n", argv[i]);
      return 2;
    }
  }
  std::sort(inputs.begin(), inputs.end());
  if (inputs.empty()) {
    std::fprintf(stderr, "replay: no inputs found\n");
    return 2;
  }
  // Skip-with-77 is the harness's way of saying it has nothing to run against (no model file).
  if (LLVMFuzzerInitialize != nullptr && LLVMFuzzerInitialize(&argc, &argv) == 77) return 77;

  install_handlers();
  const auto started = std::chrono::steady_clock::now();
  // BATCHLM_REPLAY_VERBOSE=1 names each input before it runs (a sanitizer report ends the
  // process without passing through the signal handler).
  const bool verbose = std::getenv("BATCHLM_REPLAY_VERBOSE") != nullptr;
  for (const auto& path : inputs) {
    std::snprintf(current_input, sizeof current_input, "%s", path.c_str());
    if (verbose) std::fprintf(stderr, "replay: %s\n", path.c_str());
    std::ifstream in(path, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
  std::printf("replay: %zu inputs passed in %.0f ms\n", inputs.size(), ms);
  return 0;
}
