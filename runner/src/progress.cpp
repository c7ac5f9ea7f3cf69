#include "batchlm/runner/progress.hpp"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdarg>
#include <cstdlib>
#include <string_view>

#include "batchlm/core/types.hpp"

namespace batchlm::runner {

namespace {

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char text[256];
  va_list args;
  va_start(args, fmt);
  const int n = std::vsnprintf(text, sizeof text, fmt, args);
  va_end(args);
  return std::string(text, static_cast<std::size_t>(std::clamp(n, 0, static_cast<int>(sizeof text) - 1)));
}

}  // namespace

std::string format_duration(double seconds) {
  const auto s = static_cast<std::int64_t>(std::llround(std::max(0.0, seconds)));
  if (s < 60) return format("%llds", static_cast<long long>(s));
  if (s < 3600) return format("%lldm%02llds", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  return format("%lldh%02lldm", static_cast<long long>(s / 3600), static_cast<long long>(s % 3600 / 60));
}

namespace {

// What both the bar and the plain line show, computed once.
struct Figures {
  std::string count;         // "120/1319", or "120" while the total is unknown
  std::string percent;       // "9.1%", empty while the total is unknown
  double fraction = 0;       // of the whole job, resumed items included
  std::string requests_rate; // "14.2 req/s"
  std::string tokens_rate;   // "812 tok/s"
  std::string eta;           // "eta 1m24s", "eta --" before anything finished
  std::string in_flight, retries, failed;
  std::string backing_off;   // "backoff 96" while items wait to retry, else empty
  std::string engine;        // "engine 12 run 20 wait cache 87% kv 41%", empty for remote APIs
  bool known_total = false;
};

Figures figures(const ProgressCounters& c, double elapsed) {
  Figures f;
  const std::int64_t finished = c.resumed + c.done;
  f.known_total = c.total > 0;
  if (f.known_total) {
    f.fraction = std::clamp(static_cast<double>(finished) / static_cast<double>(c.total), 0.0, 1.0);
    f.count = format("%lld/%lld", static_cast<long long>(finished), static_cast<long long>(c.total));
    f.percent = format("%.1f%%", 100.0 * f.fraction);
  } else {
    f.count = format("%lld", static_cast<long long>(finished));
  }
  // Rates count this run only: resumed items cost no time and would inflate them. The rate
  // shown is of answers, as in the summary (failures at once would read as thousands a
  // second); the ETA goes by every finished item.
  const double requests_per_second = elapsed > 0 ? static_cast<double>(c.done) / elapsed : 0;
  const double answers_per_second = elapsed > 0 ? static_cast<double>(c.done - c.failed) / elapsed : 0;
  const double tokens_per_second = elapsed > 0 ? static_cast<double>(c.output_tokens) / elapsed : 0;
  f.requests_rate = format("%.1f req/s", answers_per_second);
  f.tokens_rate = format("%.0f tok/s", tokens_per_second);
  const std::int64_t remaining = c.total - finished;
  // Where all that is left waits to be retried (or is in flight), the pace so far says nothing
  // of when: the retries go at the backoff's and the retry budget's pace.
  const bool waiting_on_retries = c.backing_off > 0 && remaining <= c.backing_off + c.in_flight;
  if (c.stopping) {
    f.eta = "stopping";  // nothing new starts: the rest waits for the next run
  } else if (!f.known_total || requests_per_second <= 0 || waiting_on_retries || c.no_connection) {
    f.eta = remaining <= 0 && f.known_total ? "eta 0s" : "eta --";
  } else {
    f.eta = "eta " + format_duration(static_cast<double>(std::max<std::int64_t>(0, remaining)) / requests_per_second);
  }
  f.in_flight = format("in-flight %lld", static_cast<long long>(c.in_flight));
  f.retries = format("retries %lld", static_cast<long long>(c.retries));
  f.failed = format("failed %lld", static_cast<long long>(c.failed));
  if (c.backing_off > 0) f.backing_off = format("backoff %lld", static_cast<long long>(c.backing_off));
  // Items wait for the server to come back (their attempts not spent): said first, as the
  // reason nothing moves.
  if (c.no_connection) f.backing_off = "no connection" + (f.backing_off.empty() ? "" : ": " + f.backing_off);
  if (!c.engine.empty()) f.engine = "engine " + c.engine;
  return f;
}

constexpr int kMinBar = 10;  // inner cells; narrower than this a bar says nothing
constexpr int kMaxBar = 40;

std::string bar(double fraction, int cells) {
  const int filled = std::clamp(static_cast<int>(std::floor(fraction * cells)), 0, cells);
  std::string text;
  text.reserve(static_cast<std::size_t>(cells) + 2);
  text.push_back('[');
  text.append(static_cast<std::size_t>(filled), '#');
  text.append(static_cast<std::size_t>(cells - filled), '.');
  text.push_back(']');
  return text;
}

}  // namespace

bool can_redraw(std::FILE* out) {
  if (out == nullptr || ::isatty(::fileno(out)) == 0) return false;
  // A dumb terminal (an editor's shell buffer) has no cursor movement to redraw with.
  const char* term = std::getenv("TERM");
  return term == nullptr || std::string_view(term) != "dumb";
}

bool terminal_rewraps() {
  auto env = [](const char* name) {
    const char* value = std::getenv(name);
    return std::string_view(value == nullptr ? "" : value);
  };
  // The innermost terminal decides: tmux re-wraps its panes, GNU screen does not, whatever
  // holds them.
  if (!env("TMUX").empty()) return true;
  if (!env("STY").empty()) return false;
  if (!env("VTE_VERSION").empty() || !env("KITTY_WINDOW_ID").empty() || !env("WT_SESSION").empty()) return true;
  // Konsole re-wraps since 21.04 (KONSOLE_VERSION 210400).
  if (const std::string_view konsole = env("KONSOLE_VERSION"); !konsole.empty()) {
    long version = 0;
    const auto [end, ec] = std::from_chars(konsole.data(), konsole.data() + konsole.size(), version);
    return ec == std::errc() && end == konsole.data() + konsole.size() && version >= 210400;
  }
  const std::string_view program = env("TERM_PROGRAM"), term = env("TERM");
  return program == "iTerm.app" || program == "Apple_Terminal" || program == "WezTerm" || program == "vscode" ||
         program == "ghostty" || program == "Hyper" || term == "alacritty" || term == "xterm-kitty" ||
         term == "xterm-ghostty" || term == "foot";
}

Progress::Progress(std::FILE* out, bool tty, std::chrono::milliseconds plain_interval, int width,
                   std::optional<bool> rewraps)
    : out_(out), tty_(tty), plain_interval_(plain_interval), width_(width),
      rewraps_(rewraps.value_or(tty && terminal_rewraps())), start_(std::chrono::steady_clock::now()) {
  // The first plain line comes one interval in; a line at zero would say nothing.
  last_draw_ = start_;
}

int Progress::columns() const {
  if (width_ > 0) return width_;
  winsize size{};
  // Asked at every draw so that a resized terminal is followed.
  if (out_ != nullptr && ::ioctl(::fileno(out_), TIOCGWINSZ, &size) == 0 && size.ws_col > 0) {
    return size.ws_col;
  }
  // A terminal that reports no size (a serial console, some containers' ptys): $COLUMNS, as the
  // shell sets it or the user does, else 80.
  if (const char* env = std::getenv("COLUMNS"); env != nullptr) {
    const int value = std::atoi(env);
    if (value > 0 && value < 10'000) return value;
  }
  return 80;
}

std::string Progress::render_bar(const ProgressCounters& c, double elapsed_seconds) const {
  const Figures f = figures(c, elapsed_seconds);
  // Three columns fewer than the terminal: writing the last column makes some terminals wrap,
  // and the next "\r" would then redraw on a new line; and the terminal echoes a Ctrl-C as
  // "^C" after the bar, which must not wrap to a row of its own either.
  const int avail = std::max(1, columns() - 3);

  // Fields in display order; when the line is too narrow the lowest priority goes first.
  // Retries and failures are news once there are any: they outrank the bar and the rates then.
  struct Field {
    std::string text;  // empty: the bar
    int priority;
    bool present = true;
  };
  std::vector<Field> fields{
      {f.count, 100},    {f.percent, 95},
      {"", 70},          {f.requests_rate, 65},
      {f.tokens_rate, 60}, {f.eta, 90},
      {f.in_flight, 50}, {f.retries, c.retries > 0 ? 80 : 40},
      {f.failed, c.failed > 0 ? 85 : 45}, {f.backing_off, 75}, {f.engine, 55}};
  if (!f.known_total) fields[1].present = fields[2].present = false;
  for (auto& field : fields) {
    if (!field.text.empty() || &field == &fields[2]) continue;
    field.present = false;
  }

  auto length = [&](int bar_cells) {
    int total = 0, count = 0;
    for (std::size_t i = 0; i < fields.size(); ++i) {
      if (!fields[i].present) continue;
      total += i == 2 ? bar_cells + 2 : static_cast<int>(fields[i].text.size());
      ++count;
    }
    return total + std::max(0, count - 1);  // one space between fields
  };
  std::vector<std::ptrdiff_t> dropped;
  while (length(kMinBar) > avail) {
    auto lowest = fields.end();
    for (auto it = fields.begin(); it != fields.end(); ++it) {
      if (it->present && it->priority < 100 && (lowest == fields.end() || it->priority < lowest->priority)) {
        lowest = it;
      }
    }
    if (lowest == fields.end()) break;  // only the count is left; cut below
    lowest->present = false;
    dropped.push_back(lowest - fields.begin());
  }
  // A long field dropped late (the engine's) may leave room for shorter ones dropped before
  // it: they come back, the most important first, rather than the room going to the bar.
  std::stable_sort(dropped.begin(), dropped.end(),
                   [&](std::ptrdiff_t a, std::ptrdiff_t b) { return fields[a].priority > fields[b].priority; });
  for (const std::ptrdiff_t i : dropped) {
    fields[i].present = true;
    if (length(kMinBar) > avail) fields[i].present = false;
  }
  // The bar keeps its length as the figures beside it grow, rather than shifting every field
  // after it at each redraw: laid out with room for the count at its final width, the percent
  // at "100.0%" and a few digits more of the rates, and laid out afresh when the terminal's
  // width changes or the fields no longer fit beside it.
  int cells = bar_cells_;
  if (bar_columns_ != avail || cells <= 0 || length(cells) > avail) {
    int growth = 4;
    if (f.known_total) {
      const int final_count = 2 * static_cast<int>(std::to_string(c.total).size()) + 1;
      growth += std::max(0, final_count - static_cast<int>(f.count.size())) +
                std::max(0, 6 - static_cast<int>(f.percent.size()));
    }
    cells = std::clamp(avail - length(0) - growth, kMinBar, kMaxBar);
    if (length(cells) > avail) cells = std::clamp(avail - length(0), kMinBar, kMaxBar);
  }
  bar_columns_ = avail;
  bar_cells_ = cells;

  std::string line;
  for (std::size_t i = 0; i < fields.size(); ++i) {
    if (!fields[i].present) continue;
    if (!line.empty()) line.push_back(' ');
    line += i == 2 ? bar(f.fraction, cells) : fields[i].text;
  }
  if (static_cast<int>(line.size()) > avail) line.resize(static_cast<std::size_t>(avail));
  return line;
}

std::string Progress::render_plain(const ProgressCounters& c, double elapsed_seconds) const {
  const Figures f = figures(c, elapsed_seconds);
  std::string line = "[batchlm] " + f.count;
  if (f.known_total) line += " (" + f.percent + ")";
  line += " " + f.requests_rate + " " + f.tokens_rate + " " + f.eta + " " + f.in_flight + " " +
          f.retries + " " + f.failed;
  if (!f.backing_off.empty()) line += " " + f.backing_off;
  if (!f.engine.empty()) line += " " + f.engine;
  return line;
}

bool Progress::in_background() const {
  // The terminal's foreground process group is not this one: the run was started with `&` or
  // sent there with Ctrl-Z and `bg`, and the user types in a shell on the cursor's line. A
  // stream that is not this process's controlling terminal (ENOTTY) counts as foreground.
  const pid_t foreground = ::tcgetpgrp(::fileno(out_));
  return foreground != -1 && foreground != ::getpgrp();
}

std::string Progress::back_to_bar() const {
  // "\r" returns to the start of the line, ESC[K (after it) clears what a longer earlier line left.
  std::string back = "\r";
  const int width = columns();
  if (rewraps_ && bar_length_ > static_cast<std::size_t>(width)) {
    // The terminal got narrower than the last bar and wrapped it into rows of the new width,
    // the cursor at its end: up to the first of those rows, and clear down from there.
    const std::size_t rows_above = (bar_length_ - 1) / static_cast<std::size_t>(width);
    if (rows_above > 0) back += format("\x1b[%zuA", rows_above);
    back += "\x1b[J";
  }
  return back;
}

void Progress::draw(const ProgressCounters& c, std::chrono::steady_clock::time_point now, bool final) {
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  if (tty_ && in_background()) {
    // No redraw over the user's shell; the last bar alone, on a line of its own (the cursor
    // may be after a prompt). Back in the foreground (`fg`), the bar starts anew.
    if (final) std::fprintf(out_, "\n%s\n", render_bar(c, elapsed).c_str());
    bar_length_ = 0;
  } else if (tty_) {
    const std::string line = render_bar(c, elapsed);
    std::fprintf(out_, "%s%s\x1b[K%s", back_to_bar().c_str(), line.c_str(), final ? "\n" : "");
    bar_length_ = final ? 0 : line.size();
  } else {
    std::fprintf(out_, "%s\n", render_plain(c, elapsed).c_str());
  }
  std::fflush(out_);
  last_draw_ = now;
  drawn_ = true;
}

void Progress::update(const ProgressCounters& c, std::chrono::steady_clock::time_point now) {
  if (tty_) {
    if (drawn_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  } else if (now - last_draw_ < plain_interval_) {
    return;
  }
  draw(c, now, false);
}

void Progress::finish(const ProgressCounters& c, std::chrono::steady_clock::time_point now) {
  draw(c, now, true);
}

void Progress::message(const std::string& line, bool after_keypress) {
  // Messages may quote a server (why the run stops): one line of text, whatever it sent. It
  // takes the bar's place (a bar left above it would show figures already stale); the next
  // draw puts the bar back below it.
  std::string erase;
  if (tty_ && bar_length_ > 0)
    erase = back_to_bar() + "\x1b[K";
  else if (tty_ && after_keypress && !in_background())
    erase = "\r\x1b[K";  // the echo, where no bar is showing (in the background: the shell's line)
  else if (after_keypress && out_ != nullptr && ::isatty(::fileno(out_)) != 0)
    erase = "\n";  // a dumb terminal: the echo stays where it is
  std::fprintf(out_, "%s%s\n", erase.c_str(), terminal_safe(line).c_str());
  std::fflush(out_);
  bar_length_ = 0;
}

// --- Summary ----------------------------------------------------------------------------

std::optional<double> percentile(std::vector<double> values, double p) {
  if (values.empty()) return std::nullopt;
  std::sort(values.begin(), values.end());
  // Nearest rank: the smallest value with at least p% of the values at or below it.
  const double rank = std::ceil(std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(values.size()));
  const auto index = static_cast<std::size_t>(std::max(1.0, rank)) - 1;
  return values[std::min(index, values.size() - 1)];
}

void Summary::add(const ItemResult& r) {
  if (r.resumed) ++resumed_;
  if (!r.ok) {
    ++failed_;
    attempts_ += r.attempts;
    std::string key = r.error_kind.empty() ? std::string("unknown") : r.error_kind;
    // The status says more only for HTTP errors; a stream cut short after a 200 is "truncated".
    if (r.http_status != 0 && key == "http") key += " " + std::to_string(r.http_status);
    ++failures_[key];
    // Cut between characters: a cut through one would leave bytes that are no UTF-8, which the
    // summary file cannot hold and the terminal would show as \xNN.
    if (!r.error_message.empty() && !failure_examples_.count(key))
      failure_examples_[key] = r.error_message.size() > 120 ? utf8_excerpt(r.error_message, 117) : r.error_message;
    return;  // an infrastructure failure says nothing about the model: never scored
  }
  ++succeeded_;
  // Scores count for resumed items too (the accuracy is the job's); everything else describes
  // the work of this run.
  auto count_metric = [&](const std::string& name, const nlohmann::json& value) {
    if (!value.is_boolean()) return;
    auto& [correct, scored] = metrics_[name];
    scored += 1;
    if (value.get<bool>()) correct += 1;
  };
  if (r.score.is_object()) {
    for (const auto& [name, value] : r.score.items()) count_metric(name, value);
  } else {
    count_metric("score", r.score);
  }
  if (r.resumed) {
    resumed_prompt_tokens_ += r.prompt_tokens;
    resumed_completion_tokens_ += r.completion_tokens;
    return;
  }
  attempts_ += r.attempts;
  prompt_tokens_ += r.prompt_tokens;
  completion_tokens_ += r.completion_tokens;
  ttft_.push_back(r.ttft_ms);
  // No per-token time exists for an answer of one token or less.
  if (r.tpot_ms > 0) tpot_.push_back(r.tpot_ms);
  total_.push_back(r.total_ms);
}

void Summary::add_unfinished_attempts(int attempts) {
  if (attempts <= 0) return;
  ++unfinished_items_;
  unfinished_attempts_ += attempts;
}

namespace {

nlohmann::json percentiles_json(const std::vector<double>& values) {
  nlohmann::json out = nlohmann::json::object();
  for (auto [name, p] : {std::pair{"p50", 50.0}, {"p90", 90.0}, {"p99", 99.0}}) {
    auto v = percentile(values, p);
    out[name] = v ? nlohmann::json(*v) : nlohmann::json(nullptr);
  }
  return out;
}

}  // namespace

nlohmann::json Summary::to_json(double wall_seconds, std::int64_t total_items) const {
  const std::int64_t this_run = succeeded_ - resumed_ + failed_;
  const std::int64_t not_run = std::max<std::int64_t>(0, total_items - succeeded_ - failed_);
  nlohmann::json j;
  j["counts"] = {{"total", total_items}, {"succeeded", succeeded_}, {"failed", failed_},
                 {"resumed", resumed_},  {"not_run", not_run}};
  if (unsaved_ > 0) j["counts"]["unsaved"] = unsaved_;
  j["failures"] = nlohmann::json::object();
  for (const auto& [kind, n] : failures_) j["failures"][kind] = n;
  if (!failure_examples_.empty()) j["failure_examples"] = failure_examples_;
  j["accuracy"] = nlohmann::json::object();
  for (const auto& [name, counts] : metrics_) {
    const auto [correct, scored] = counts;
    j["accuracy"][name] = {{"correct", correct},
                           {"scored", scored},
                           {"accuracy", scored > 0 ? static_cast<double>(correct) / static_cast<double>(scored) : 0.0}};
  }
  j["latency_ms"] = {{"ttft", percentiles_json(ttft_)},
                     {"tpot", percentiles_json(tpot_)},
                     {"e2e", percentiles_json(total_)}};
  j["tokens"] = {{"prompt", prompt_tokens_}, {"completion", completion_tokens_}};
  // Every successful record of the job's items in the output, earlier runs' included.
  j["tokens_in_output"] = {{"prompt", prompt_tokens_ + resumed_prompt_tokens_},
                           {"completion", completion_tokens_ + resumed_completion_tokens_}};
  j["wall_seconds"] = wall_seconds;
  const double seconds = wall_seconds > 0 ? wall_seconds : 0;
  j["throughput"] = {
      // Answers, not attempts: a run whose every item failed at once did no work a second.
      {"requests_per_second", seconds > 0 ? static_cast<double>(succeeded_ - resumed_) / seconds : 0.0},
      {"output_tokens_per_second", seconds > 0 ? static_cast<double>(completion_tokens_) / seconds : 0.0}};
  // Every request this run sent, those of items it did not finish included (not the attempts
  // that found no server to connect to while the run waited for it: those sent nothing).
  const std::int64_t attempts = attempts_ + unfinished_attempts_;
  j["attempts"] = {{"total", attempts},
                   {"retries", std::max<std::int64_t>(0, attempts - this_run - unfinished_items_)}};
  return j;
}

std::string Summary::to_text(double wall_seconds, std::int64_t total_items) const {
  const nlohmann::json j = to_json(wall_seconds, total_items);
  const auto& counts = j["counts"];
  std::string text = format("%lld item%s: %lld succeeded", static_cast<long long>(total_items),
                            total_items == 1 ? "" : "s", static_cast<long long>(succeeded_));
  if (resumed_ > 0) text += format(" (%lld resumed)", static_cast<long long>(resumed_));
  text += format(", %lld failed", static_cast<long long>(failed_));
  if (counts["not_run"].get<std::int64_t>() > 0) {
    text += format(", %lld not run", static_cast<long long>(counts["not_run"].get<std::int64_t>()));
  }
  // Short runs show tenths: "in 0s" would read as nothing happened.
  text += " in " + (wall_seconds < 10 ? format("%.1fs", std::max(0.0, wall_seconds)) : format_duration(wall_seconds));
  if (unsaved_ > 0)
    text += format("; %lld of them not saved (the output failed): a rerun does them again",
                   static_cast<long long>(unsaved_));
  text += "\n";

  if (!failures_.empty()) {
    text += "failures:";
    bool first = true;
    for (const auto& [kind, n] : failures_) {
      text += format("%s %s: %lld", first ? "" : ",", kind.c_str(), static_cast<long long>(n));
      // The example is the server's text: its escape sequences and control characters would
      // act on the user's terminal (clear it, recolour it, move the cursor), and a NUL would
      // end the line when printed as a C string. They are shown as \xNN instead.
      if (const auto example = failure_examples_.find(kind); example != failure_examples_.end())
        text += " (" + terminal_safe(example->second) + ")";
      first = false;
    }
    text += "\n";
  }
  if (!metrics_.empty()) {
    text += "accuracy:";
    for (const auto& [name, counts_of] : metrics_) {
      const auto [correct, scored] = counts_of;
      text += format(" %s %.1f%% (%lld/%lld)", name.c_str(),
                     scored > 0 ? 100.0 * static_cast<double>(correct) / static_cast<double>(scored) : 0.0,
                     static_cast<long long>(correct), static_cast<long long>(scored));
    }
    // Failed and unfinished items have no score: the accuracy is over fewer than the job's.
    const std::int64_t scored = metrics_.begin()->second.second;
    if (total_items > scored)
      text += format("; %lld of %lld items not scored",
                     static_cast<long long>(total_items - scored), static_cast<long long>(total_items));
    text += "\n";
  }
  if (!total_.empty()) {
    auto triple = [](const std::vector<double>& values, int decimals) {
      if (values.empty()) return std::string("-");
      return format("%.*f/%.*f/%.*f", decimals, *percentile(values, 50), decimals, *percentile(values, 90),
                    decimals, *percentile(values, 99));
    };
    // Per-token times are a few milliseconds, so they keep a decimal the others do not need.
    text += "latency ms p50/p90/p99: ttft " + triple(ttft_, 0) + "  tpot " + triple(tpot_, 1) + "  e2e " +
            triple(total_, 0) + "\n";
  }
  // Every request this run sent, as in the JSON: those of items it did not finish included.
  const auto attempts = j["attempts"]["total"].get<std::int64_t>();
  text += format("tokens: %lld in, %lld out; %.2f req/s, %.1f out tok/s; %lld attempt%s\n",
                 static_cast<long long>(prompt_tokens_), static_cast<long long>(completion_tokens_),
                 j["throughput"]["requests_per_second"].get<double>(),
                 j["throughput"]["output_tokens_per_second"].get<double>(), static_cast<long long>(attempts),
                 attempts == 1 ? "" : "s");
  return text;
}

}  // namespace batchlm::runner
