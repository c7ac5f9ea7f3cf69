// A signal ignored for a scope (SIGPIPE while progress goes to a closed pipe, SIGXFSZ while the
// output is written), with what was there before put back at its end.
#pragma once

#include <signal.h>

namespace batchlm::runner {

// Whether the process started with `signo` ignored (nohup's SIGHUP, a shell's SIGINT for a
// background job): such a signal is left ignored rather than handled.
inline bool ignored_at_start(int signo) {
  struct sigaction current {};
  return ::sigaction(signo, nullptr, &current) == 0 && current.sa_handler == SIG_IGN;
}

class IgnoredSignal {
 public:
  explicit IgnoredSignal(int signo) : signo_(signo) {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    ::sigemptyset(&ignore.sa_mask);
    ::sigaction(signo_, &ignore, &previous_);
  }
  ~IgnoredSignal() { ::sigaction(signo_, &previous_, nullptr); }
  IgnoredSignal(const IgnoredSignal&) = delete;
  IgnoredSignal& operator=(const IgnoredSignal&) = delete;

 private:
  int signo_;
  struct sigaction previous_ {};
};

}  // namespace batchlm::runner
