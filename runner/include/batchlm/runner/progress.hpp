#pragma once
// Live progress on stderr and the end-of-run summary.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace batchlm::runner {

// What the runner knows at a moment; the Progress display only reads it.
struct ProgressCounters {
  std::int64_t total = 0;        // items in this job (resumed ones included)
  std::int64_t resumed = 0;      // done before this run started
  std::int64_t done = 0;         // finished in this run, succeeded or failed
  std::int64_t failed = 0;       // finished in this run with an error
  std::int64_t in_flight = 0;
  std::int64_t retries = 0;      // retry attempts started
  std::int64_t backing_off = 0;  // between attempts: waiting out a backoff or the retry budget
  std::int64_t output_tokens = 0;  // streamed so far (deltas until usage corrects them)
  std::string engine;              // the embedded engine's state (EngineStats::brief), or ""
  bool stopping = false;           // no new items (a signal, a refusal): no ETA to give
  bool no_connection = false;      // the API server could not be connected to: items wait for it
};

// "42s", "1m24s", "2h05m": precise enough for an estimate, short enough for a status line.
std::string format_duration(double seconds);

// Whether `out` is a terminal a bar can be redrawn on in place: a TTY whose $TERM is not
// "dumb". Elsewhere the progress is plain periodic lines.
bool can_redraw(std::FILE* out);

// Whether the terminal re-wraps its lines when it gets narrower (tmux, VTE, kitty, iTerm2,
// WezTerm, Windows Terminal, Alacritty, VS Code's), as far as the environment tells; xterm,
// GNU screen and unknown terminals cut them instead.
bool terminal_rewraps();

class Progress {
 public:
  // tty: draw a bar redrawn in place at most 10 times a second; otherwise a plain line every
  // `plain_interval`. `width`: terminal columns (0: ask the terminal at every draw, else 80).
  // `rewraps`: whether the terminal re-wraps lines on a resize (default: terminal_rewraps()).
  Progress(std::FILE* out, bool tty, std::chrono::milliseconds plain_interval = std::chrono::seconds(5),
           int width = 0, std::optional<bool> rewraps = std::nullopt);
  // Draws if it is time (tty: 100 ms since the last draw; plain: the interval).
  void update(const ProgressCounters& c,
              std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now());
  // Final draw and newline, before the summary.
  void finish(const ProgressCounters& c,
              std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now());
  // A line of text while the bar may be showing: the bar's line is ended first, and the bar is
  // drawn anew below the text. Control characters in `line` are shown as \xNN (terminal_safe).
  // `after_keypress`: the line answers a key the terminal may have echoed (Ctrl-C's "^C"), which
  // it erases or, on a terminal that cannot, leaves on a line of its own.
  void message(const std::string& line, bool after_keypress = false);
  // As if the terminal were now `width` columns wide (tests; a real one is asked at each draw).
  void resize(int width) { width_ = width; }
  // The bar line for counters (without "\r"), for tests.
  std::string render_bar(const ProgressCounters& c, double elapsed_seconds) const;
  // The line printed when stderr is not a terminal (without "\n").
  std::string render_plain(const ProgressCounters& c, double elapsed_seconds) const;

 private:
  void draw(const ProgressCounters& c, std::chrono::steady_clock::time_point now, bool final);
  // The bytes that take the cursor back to the start of the bar on screen (up the rows a
  // narrowed terminal wrapped it into, clearing them).
  std::string back_to_bar() const;
  int columns() const;
  bool in_background() const;  // of the terminal: another process group has it

  std::FILE* out_;
  bool tty_;
  std::chrono::milliseconds plain_interval_;
  int width_;
  bool rewraps_;
  std::chrono::steady_clock::time_point start_, last_draw_{};
  bool drawn_ = false;
  std::size_t bar_length_ = 0;  // of the bar on the cursor's line, 0 when there is none
  // The bar's cells, kept from one redraw to the next while the terminal's width (less the
  // margin) stays bar_columns_ and the fields fit beside them.
  mutable int bar_cells_ = 0;
  mutable int bar_columns_ = 0;
};

// Per item, what the summary needs.
struct ItemResult {
  bool ok = false;
  std::string error_kind;   // "" when ok; else Error kind name ("http" ...)
  std::string error_message;  // the error's message (the summary shows one per kind)
  int http_status = 0;
  nlohmann::json score;     // null when not scored
  double ttft_ms = 0, tpot_ms = 0, total_ms = 0;
  std::int64_t prompt_tokens = 0, completion_tokens = 0;
  int attempts = 0;
  bool resumed = false;     // from an earlier run
};

class Summary {
 public:
  void add(const ItemResult& r);
  // The attempts of an item this run sent but did not finish (stopped by Ctrl-C or a refusal
  // stop): requests were made, but there is no record to count them by.
  void add_unfinished_attempts(int attempts);
  // Accuracy per metric over scored items only; failures by kind ("http 429": n, "timeout": n);
  // p50/p90/p99 of ttft, tpot, end-to-end over this run's successes; tokens; throughput over
  // wall_seconds; counts (total, succeeded, failed, resumed, interrupted-unfinished).
  nlohmann::json to_json(double wall_seconds, std::int64_t total_items) const;
  // Human-readable, a few lines.
  std::string to_text(double wall_seconds, std::int64_t total_items) const;
  // Finished items the output could not take (a full disk): counted above, not in the file.
  void set_unsaved(std::int64_t n) { unsaved_ = n; }
  std::int64_t failed() const { return failed_; }
  std::int64_t succeeded() const { return succeeded_; }

 private:
  std::int64_t succeeded_ = 0, failed_ = 0, resumed_ = 0;
  std::int64_t resumed_prompt_tokens_ = 0, resumed_completion_tokens_ = 0;
  std::int64_t prompt_tokens_ = 0, completion_tokens_ = 0, attempts_ = 0;
  std::int64_t unfinished_items_ = 0, unfinished_attempts_ = 0, unsaved_ = 0;
  std::map<std::string, std::int64_t> failures_;
  std::map<std::string, std::string> failure_examples_;  // per kind: the first failure's message
  std::map<std::string, std::pair<std::int64_t, std::int64_t>> metrics_;  // name -> (true, scored)
  std::vector<double> ttft_, tpot_, total_;
};

// Nearest-rank percentile of unsorted values (copied); nullopt when empty.
std::optional<double> percentile(std::vector<double> values, double p);

}  // namespace batchlm::runner
