#include "batchlm/runner/dispatcher.hpp"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unordered_set>
#include <list>
#include <new>
#include <optional>
#include <random>
#include <set>
#include <unordered_map>

#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "batchlm/client/openai.hpp"
#include "batchlm/runner/limits.hpp"
#include "batchlm/runner/progress.hpp"
#include "batchlm/runner/retry.hpp"
#include "batchlm/runner/scoring.hpp"
#include "batchlm/runner/writer.hpp"
#include "batchlm/runner/ignored_signal.hpp"

namespace batchlm::runner {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

// "1 item was", "3 items were".
std::string items_were(std::int64_t n) {
  return std::to_string(n) + (n == 1 ? " item was" : " items were");
}

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// The most output tokens a request asks for: max_tokens, or an API's max_completion_tokens
// passed through as written (a token limit, checked where the job or the line was read).
std::optional<std::int64_t> output_cap(const Request& request) {
  if (request.max_tokens) return *request.max_tokens;
  if (request.extra.is_object())
    if (const auto cap = request.extra.find("max_completion_tokens"); cap != request.extra.end() && is_token_limit(*cap))
      return cap->get<std::int64_t>();
  return std::nullopt;
}

// Tokens an attempt may use, for the tokens/min bucket before the usage is known: its prompt's
// estimate and its output cap, or `uncapped` for a request without one.
std::int64_t estimate_tokens(const Item& item, std::int64_t uncapped = 256) {
  return item.estimated_prompt_tokens + output_cap(item.request).value_or(uncapped);
}

json select_input(const json& input, const std::vector<std::string>& fields) {
  if (fields.empty() || !input.is_object()) return input;
  json out = json::object();
  for (const auto& f : fields)
    if (auto it = input.find(f); it != input.end()) out[f] = *it;
  return out;
}

// What the summary needs from a record already in the output (resumed from an earlier run).
ItemResult item_result_from_record(const json& record) {
  ItemResult r;
  r.resumed = true;
  r.ok = record.value("error", json()).is_null();
  r.score = record.value("score", json());
  const json usage = record.value("usage", json::object());
  if (usage.is_object()) {
    r.prompt_tokens = usage.value("prompt_tokens", std::int64_t{0});
    r.completion_tokens = usage.value("completion_tokens", std::int64_t{0});
  }
  r.attempts = record.value("attempts", 0);
  return r;
}

// The writer a second SIGINT flushes before exiting.
OutputWriter* g_writer_for_hard_exit = nullptr;

// What exit_on_stop_signals' handler writes (only async-signal-safe calls in it).
const char* g_stop_line = "";
std::size_t g_stop_line_size = 0;
extern "C" void exit_on_stop_signal(int) {
  [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, g_stop_line, g_stop_line_size);
  std::_Exit(kExitInterrupted);
}

std::string brief(const json& value) {
  const std::string text = value.is_null() ? "unset" : value.dump();
  return text.size() > 40 ? text.substr(0, 37) + "..." : text;
}

void diff_settings(const json& before, const json& now, const std::string& path,
                          std::vector<std::string>& out) {
  if (before.is_object() && now.is_object() && path != "request.messages") {
    std::set<std::string> keys;
    for (const auto& [k, v] : before.items()) keys.insert(k);
    for (const auto& [k, v] : now.items()) keys.insert(k);
    for (const std::string& k : keys)
      diff_settings(before.contains(k) ? before[k] : json(), now.contains(k) ? now[k] : json(),
                    path.empty() ? k : path + "." + k, out);
  } else if (before != now) {
    out.push_back(path == "request.messages" ? path : path + ": " + brief(before) + " -> " + brief(now));
  }
}

// Earlier records made under other settings than this job's: how many, the first one's hash
// and model.
struct OtherSettings {
  std::int64_t count = 0;
  std::string hash, model;
};

// The error that stops a run (or its dry run) whose output holds results made under other
// settings, saying what changed: from the settings the earlier run kept in the lock file (even
// when it was killed), or else from the summary it left.
ConfigError other_settings_error(const std::string& output, const json& settings, const OtherSettings& other,
                                 const std::string& kept_settings) {
  std::string changed;
  json earlier = json::parse(kept_settings, nullptr, false);
  if (!earlier.is_object() || settings_hash(earlier) != other.hash) {
    std::ifstream previous(output + ".summary.json");
    const json summary = previous ? json::parse(previous, nullptr, false) : json();
    earlier = summary.is_object() && summary.contains("settings") ? summary["settings"] : json();
  }
  if (earlier.is_object() && settings_hash(earlier) == other.hash) {
    std::vector<std::string> differences;
    diff_settings(earlier, settings, "", differences);
    for (std::size_t i = 0; i < differences.size() && i < 3; ++i) changed += (i ? ", " : "") + differences[i];
    if (differences.size() > 3) changed += ", ...";
  } else if (const std::string model = settings["model"]; !other.model.empty() && other.model != model) {
    changed = "model: '" + other.model + "' -> '" + model + "'";
  } else {
    changed = "the model, the request template, the few-shot examples or the scoring";
  }
  return ConfigError(output, 0, 0, "",
                     std::to_string(other.count) + " earlier result" + (other.count == 1 ? " was" : "s were") +
                         " made with other settings than this job's (" + changed +
                         "); --fresh replaces them, or give this run another output with -o");
}

}  // namespace

void exit_on_stop_signals(const char* line) {
  g_stop_line = line;
  g_stop_line_size = std::strlen(line);
  for (const int signo : {SIGINT, SIGTERM, SIGHUP}) {
    if (ignored_at_start(signo)) continue;
    struct sigaction stop {};
    stop.sa_handler = exit_on_stop_signal;
    sigemptyset(&stop.sa_mask);
    ::sigaction(signo, &stop, nullptr);
  }
}

class Dispatcher {
 public:
  Dispatcher(const JobSpec& job, Source& source, Backend& backend, asio::io_context& io,
             const RunOptions& options)
      : job_(job),
        source_(source),
        backend_(backend),
        io_(io),
        options_(options),
        slots_(io.get_executor(), static_cast<std::size_t>(job.concurrency)),
        budget_turn_(io.get_executor(), 1),
        // Items alive at once (in flight, waiting for a slot, or backing off) are bounded so a
        // failing server cannot make the runner read the whole input into memory.
        live_(io.get_executor(), static_cast<std::size_t>(job.concurrency) * 4 + 16),
        requests_(io.get_executor(), job.rate_limit.requests_per_minute / 60.0,
                  std::max(1.0, job.rate_limit.requests_per_minute / 60.0)),
        tokens_(io.get_executor(), job.rate_limit.tokens_per_minute / 60.0,
                std::max(1.0, job.rate_limit.tokens_per_minute / 60.0 * 5)),
        retry_(job.retry),
        budget_(job.retry.budget_ratio, job.retry.budget_min_per_second),
        scorer_(make_scorer(job.scoring)),
        rng_(std::random_device{}()),
        progress_(options.progress_out, options.tty.value_or(can_redraw(options.progress_out))),
        all_done_(io.get_executor()),
        grace_timer_(io.get_executor()) {}

  RunResult run() {
    start_ = Clock::now();
    writer_ = std::make_unique<OutputWriter>(
        OutputWriter::Options{job_.output.path, job_.output.flush_every, job_.output.flush_interval,
                              options_.fresh, settings_.dump(),
                              [this](const std::string& earlier) { refuse_other_settings(earlier); },
                              redo_cut_answers()},
        [this](const json& record) {
          kept_.emplace(record["id"].dump(), keep(record));
          // Records from before settings were recorded have none, and are taken as they are.
          if (const auto it = record.find("settings"); it != record.end() && *it != settings_hash_) {
            if (other_.count++ == 0) {
              other_.hash = it->is_string() ? it->get<std::string>() : it->dump();
              other_.model = record.value("model", json()).is_string() ? record["model"].get<std::string>() : "";
            }
          }
        });
    const ResumeInfo& resume = writer_->resume_info();
    counters_.total = source_.total();
    // Earlier records count when their item comes up among this run's (produce_items): a
    // lower --limit, or an input that changed, leaves others in the file, outside the counts.
    counters_.resumed = 0;
    // This run holds the output now: a summary an earlier run left beside it would describe
    // a file this run is changing, and outlive a kill -9 of this one.
    {
      std::error_code ec;
      std::filesystem::remove(summary_path(), ec);
    }
    if (resume.kept > 0 || !resume.failed_ids.empty() || resume.dropped_torn_line || resume.dropped_duplicates > 0 ||
        resume.redone > 0) {
      std::string more;
      if (resume.redone > 0)
        more += ", " + std::to_string(resume.redone) + " cut short by a smaller context to redo (the engine's is " +
                std::to_string(backend_.context()) + " tokens now)";
      if (resume.dropped_duplicates > 0)
        more += ", " + std::to_string(resume.dropped_duplicates) + " later records of ids already done dropped";
      if (resume.dropped_torn_line) more += ", a torn last line dropped";
      // Done among this run's items; records of others (a lower --limit, a changed input) stay.
      // Failures are retried only where their item is this run's.
      const std::int64_t own = source_.count_own(resume.done_ids);
      const std::int64_t own_failed = source_.count_own(resume.failed_ids);
      const std::string others =
          own < resume.kept ? " (and " + std::to_string(resume.kept - own) + " record" +
                                  (resume.kept - own == 1 ? "" : "s") + " of items outside this run, kept)"
                            : std::string();
      std::fprintf(options_.progress_out, "batchlm: resuming %s: %lld done%s, %lld failed to retry%s\n",
                   terminal_safe(job_.output.path).c_str(), static_cast<long long>(own), others.c_str(),
                   static_cast<long long>(own_failed), more.c_str());
    }

    std::optional<asio::signal_set> signals;
    if (options_.install_signal_handlers) {
      g_writer_for_hard_exit = writer_.get();
      signals.emplace(io_);
      // A signal ignored from the start stays so: `nohup` ignores SIGHUP for a run that should
      // outlive its terminal, a shell ignores SIGINT for the jobs it starts in the background.
      for (int signo : {SIGINT, SIGTERM, SIGHUP, SIGQUIT})
        if (!ignored_at_start(signo)) signals->add(signo);
      wait_for_signal(*signals);
      // Progress and the summary go to stderr; a reader of it that went away (`2>&1 | head`,
      // a log reader that died) must cost those lines (EPIPE), not the run.
      broken_pipes_.emplace(SIGPIPE);
      // An output past the file size limit (`ulimit -f`) is an error to report (EFBIG) like a
      // full disk, not a signal that kills the run with its records unwritten.
      too_large_files_.emplace(SIGXFSZ);
    }

    asio::co_spawn(io_, produce(), [this](std::exception_ptr e) {
      if (e) {
        producer_error_ = e;
        io_.stop();
      }
    });
    if (counters_.total > 0) asio::co_spawn(io_, tick(), asio::detached);
    io_.run();
    g_writer_for_hard_exit = nullptr;
    if (producer_error_) {
      flush_output(false);  // the items that finished keep their records
      std::rethrow_exception(producer_error_);
    }
    flush_output(false);
    // Counting the earlier records past a stop may read the rest of the input, with no loop
    // left to take a signal: one now ends the process at once, as before the run began (every
    // record is written by now; the summary was removed at the start).
    if (signals) {
      signals->clear();
      exit_on_stop_signals("\nbatchlm: interrupted, exiting now (finished items are saved)\n");
    }
    take_earlier_records_past_the_stop();

    if (auto stats = backend_.engine_stats()) counters_.engine = stats->brief();
    if (counters_.total > 0) {
      progress_.finish(counters_);
    } else {
      // Likely a mistake (the wrong input file, a limit left at 0): say it rather than draw
      // a bar of nothing.
      progress_.message("batchlm: note: the job has no items (its input is empty, or the limit is 0)");
    }
    return finish();
  }

 private:
  // Per live item: the cancellation signal for a stop, and whether an attempt is under way.
  struct LiveItem {
    asio::cancellation_signal cancel;
    bool in_attempt = false;
  };

  // SIGINT, SIGTERM and SIGHUP stop the run gracefully; a second SIGINT or SIGTERM after any of
  // them, or SIGQUIT (Ctrl-\) at any time, exits at once. SIGHUP never does: a closing
  // terminal may send it more than once (the kernel, then the shell to its jobs).
  void wait_for_signal(asio::signal_set& signals) {
    signals.async_wait([this, &signals](boost::system::error_code ec, int signo) {
      if (ec) return;
      if (signo == SIGQUIT) hard_exit("quit (SIGQUIT)");
      const bool again = stop_signals_++ > 0;
      if (again && signo == SIGINT) hard_exit("interrupted twice");
      if (again && signo == SIGTERM) hard_exit("terminated twice");
      if (signo == SIGHUP) {
        begin_stop("hangup (the terminal closed)", true, nullptr);
      } else {
        begin_stop(signo == SIGINT ? "interrupted" : "terminated", true,
                   signo == SIGINT ? " (Ctrl-C again to exit now)" : " (a second SIGTERM, or Ctrl-C, exits now)",
                   /*keypress=*/signo == SIGINT);
      }
      wait_for_signal(signals);
    });
  }

  // Exit now: the output holds only whole records; write what is buffered and go. Items in
  // flight are abandoned (a rerun sends them again); no summary is written.
  [[noreturn]] static void hard_exit(const char* why) {
    if (g_writer_for_hard_exit != nullptr) {
      try {
        g_writer_for_hard_exit->flush();
      } catch (...) {
      }
    }
    std::fprintf(stderr, "\nbatchlm: %s, exiting now (finished items are saved)\n", why);
    std::_Exit(kExitInterrupted);
  }

  // `interrupted`: by a signal (exit 130), not by the run itself; `exit_now`: how to exit at
  // once, said after the signal's message (none where the terminal is gone); `keypress`: the
  // signal came from the terminal's Ctrl-C, whose echo the message must not run into.
  void begin_stop(const char* why, bool interrupted, const char* exit_now = nullptr, bool keypress = false) {
    const std::string hint = exit_now != nullptr ? exit_now : "";
    if (stopping_) {
      // The run was already stopping by itself (the API refused it, the output failed): this
      // signal is the first, so it does not exit yet; say so, or the keypress looks ignored.
      if (interrupted && !hint.empty())
        progress_.message("batchlm: " + std::string(why) + ": already stopping; waiting for " +
                              std::to_string(counters_.in_flight) + " in flight" + hint,
                          keypress);
      return;
    }
    stopping_ = true;
    counters_.stopping = true;
    interrupted_ = interrupted;
    char grace[32];
    const double grace_s = std::chrono::duration<double>(job_.grace_period).count();
    std::snprintf(grace, sizeof grace, grace_s < 10 && grace_s != std::floor(grace_s) ? "%.1fs" : "%.0fs", grace_s);
    // What the grace period waits for: attempts under way (items waiting for a slot or a
    // backoff stop at once, below).
    const auto attempts = std::count_if(items_.begin(), items_.end(), [](const LiveItem& i) { return i.in_attempt; });
    progress_.message("batchlm: " + std::string(why) + ": no new items; " +
                      (attempts == 0 ? std::string("none in flight")
                                     : "waiting up to " + std::string(grace) + " for " + std::to_string(attempts) +
                                           " in flight" + (interrupted ? hint : "")),
                      keypress);
    // Items not inside an attempt (waiting for a slot, a rate limit or a backoff) stop now.
    for (auto& item : items_)
      if (!item.in_attempt) item.cancel.emit(asio::cancellation_type::terminal);
    producer_cancel_.emit(asio::cancellation_type::terminal);
    grace_timer_.expires_after(job_.grace_period);
    grace_timer_.async_wait([this](boost::system::error_code ec) {
      if (ec) return;
      for (auto& item : items_) item.cancel.emit(asio::cancellation_type::terminal);
    });
  }

  asio::awaitable<void> produce() {
    std::exception_ptr failed;
    try {
      co_await asio::co_spawn(io_, produce_items(),
                              asio::bind_cancellation_slot(producer_cancel_.slot(), asio::use_awaitable));
    } catch (const boost::system::system_error& e) {
      if (e.code() != asio::error::operation_aborted) failed = std::current_exception();
    } catch (...) {
      failed = std::current_exception();
    }
    if (failed) {
      // Anything else that ends the making of items (memory): no new items, and those under
      // way end as in a stop, their records written, before the error is reported. Stopping the
      // loop at once would leave them suspended, holding what the run owns. (An input that
      // changed under the run is a stop of its own, in produce_items.)
      producer_error_ = failed;
      begin_stop("no more items can be made", false);
    }
    // Wait for the live items to finish.
    while (!items_.empty()) {
      all_done_.expires_at(Clock::time_point::max());
      boost::system::error_code ec;
      co_await all_done_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    }
    grace_timer_.cancel();
    io_.stop();
  }

  asio::awaitable<void> produce_items() {
    while (!stopping_) {
      std::optional<Item> item;
      try {
        item = source_.next();
      } catch (const std::bad_alloc&) {
        throw;  // not the input's doing: produce() stops the run with it
      } catch (const std::exception& e) {
        // The input was cut short or broken after it was checked (rewritten while the job ran):
        // the items sent so far finish and are saved, nothing more is sent, and the same
        // command resumes once the input is whole.
        if (!refused_) {
          refused_ = Refusal{e.what(), "Put the input back as it was checked (or wait for what writes it), or start "
                                       "a new output for the new input"};
          begin_stop(refused_->what.c_str(), false);
        }
        break;
      }
      if (!item) break;
      if (take_earlier_record(*item)) continue;
      co_await live_.acquire();
      if (stopping_) {
        live_.release();
        break;
      }
      if (item->request.model.empty()) item->request.model = job_.backend.model;
      item->request.stream = job_.backend.stream;
      items_.emplace_back();
      auto it = std::prev(items_.end());
      asio::co_spawn(io_, serve_item(std::move(*item), it),
                     asio::bind_cancellation_slot(it->cancel.slot(), [this, it](std::exception_ptr) {
                       // Erase after the spawn machinery is done with the slot.
                       asio::post(io_, [this, it] {
                         items_.erase(it);
                         live_.release();
                         all_done_.cancel();
                       });
                     }));
    }
  }

  // Done in an earlier run: the output's record stands for the item, and counts (kept_ holds
  // every id the writer kept from before this run).
  bool take_earlier_record(const Item& item) {
    const auto kept = kept_.find(item.id_key);
    if (kept == kept_.end()) return false;
    summary_.add(result_of(kept->second));
    ++counters_.resumed;
    ++resumed_in_scope_;
    if (input_digest(kept->second.input_keys, item.input) != kept->second.input_digest && changed_inputs_++ == 0)
      first_changed_id_ = item.id.dump();
    return true;
  }

  // An earlier record's part in the summary, until its item comes up: a few dozen bytes for
  // the usual record (a success whose score is booleans), not its input and score as JSON, which
  // made a resume's memory grow with the output (936 MB over 570,000 records).
  struct Kept {
    std::int64_t prompt_tokens = 0, completion_tokens = 0;
    std::uint64_t input_digest = 0;  // of the record's input, over input_keys
    std::uint32_t input_keys = 0;    // the input's keys: an index into key_sets_
    std::int32_t attempts = 0;
    std::uint16_t scored = 0, correct = 0;  // a bit per metric_names_ entry
    bool ok = false;
    std::unique_ptr<ItemResult> other;  // a record the bits cannot say (a failure, another score)
  };
  static constexpr std::uint32_t kNotAnObject = 0xFFFFFFFF;

  Kept keep(const json& record) {
    Kept k;
    ItemResult r = item_result_from_record(record);
    k.prompt_tokens = r.prompt_tokens;
    k.completion_tokens = r.completion_tokens;
    k.attempts = r.attempts;
    k.ok = r.ok;
    bool compact = r.ok;
    const auto bit = [&](const std::string& name) -> int {
      const auto at = std::find(metric_names_.begin(), metric_names_.end(), name);
      if (at != metric_names_.end()) return static_cast<int>(at - metric_names_.begin());
      if (metric_names_.size() >= 16) return -1;
      metric_names_.push_back(name);
      return static_cast<int>(metric_names_.size()) - 1;
    };
    if (compact && !r.score.is_null()) {
      const json scores = r.score.is_object() ? r.score : json{{"score", r.score}};
      for (const auto& [name, value] : scores.items()) {
        const int b = value.is_boolean() ? bit(name) : -1;
        if (b < 0) {
          compact = false;
          break;
        }
        k.scored |= static_cast<std::uint16_t>(1u << b);
        if (value.get<bool>()) k.correct |= static_cast<std::uint16_t>(1u << b);
      }
    }
    if (!compact) k.other = std::make_unique<ItemResult>(std::move(r));
    const json input = record.value("input", json());
    if (!input.is_object()) {
      k.input_keys = kNotAnObject;
    } else {
      // Looked up by the keys joined; listed only the first time a set is seen.
      std::string joined;
      for (const auto& [key, value] : input.items()) joined.append(key).push_back('\0');
      const auto [at, added] = key_set_index_.emplace(std::move(joined), static_cast<std::uint32_t>(key_sets_.size()));
      if (added) {
        std::vector<std::string>& keys = key_sets_.emplace_back();
        for (const auto& [key, value] : input.items()) keys.push_back(key);
      }
      k.input_keys = at->second;
    }
    k.input_digest = input_digest(k.input_keys, input);
    return k;
  }

  ItemResult result_of(const Kept& k) const {
    if (k.other) return *k.other;
    ItemResult r;
    r.resumed = true;
    r.ok = k.ok;
    r.prompt_tokens = k.prompt_tokens;
    r.completion_tokens = k.completion_tokens;
    r.attempts = k.attempts;
    if (k.scored != 0) {
      r.score = json::object();
      for (std::size_t b = 0; b < metric_names_.size(); ++b)
        if ((k.scored >> b) & 1u) r.score[metric_names_[b]] = ((k.correct >> b) & 1u) != 0;
    }
    return r;
  }

  // A digest of an input's fields named by key set `keys` (those the record kept: with
  // output.input_fields, some), so that a record's input and an item's compare on the fields the
  // record kept; the whole input where it is not an object.
  std::uint64_t input_digest(std::uint32_t keys, const json& input) const {
    const auto mix = [](std::uint64_t h, std::uint64_t v) {
      h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
      return h * 0xFF51AFD7ED558CCDull;
    };
    const std::hash<std::string> hash;
    if (keys == kNotAnObject) return input.is_object() ? 1 : mix(2, hash(input.dump()));
    if (!input.is_object()) return 3;
    std::uint64_t h = 4;
    for (const std::string& key : key_sets_[keys]) {
      const auto it = input.find(key);
      if (it == input.end()) return 5;
      h = mix(mix(h, hash(key)), hash(it->dump()));
    }
    return h;
  }

  // A run that stopped early (Ctrl-C, an API that refuses the client, a full disk) never came to
  // the items after the stop; those the output holds from before count all the same, as a
  // finished run counts them, so the summary and its accuracy cover every record in the file.
  void take_earlier_records_past_the_stop() {
    try {
      while (resumed_in_scope_ < static_cast<std::int64_t>(kept_.size())) {
        std::optional<Item> item = source_.next();
        if (!item) break;
        take_earlier_record(*item);
      }
    } catch (const std::exception&) {
      // The input changed under the run: what was counted stands.
    }
  }

  // What one item has been through so far.
  struct ItemRun {
    int attempts = 0;
    std::optional<Clock::time_point> first_attempt_at;
    Outcome outcome;
    std::int64_t streamed = 0;  // deltas of the last attempt
    bool cancelled = false;
    // The last attempt could not connect to a server that had answered before: the next one
    // waits for it (reconnect), not for the retry budget.
    bool waits_for_server = false;
    // Since when its attempts have found no server, without an answer between.
    std::optional<Clock::time_point> unconnected_since;
    std::uint64_t serial = 0;  // this item's number in the run, for the outage's count of items
  };

  asio::awaitable<void> serve_item(Item item, std::list<LiveItem>::iterator live) {
    const auto spawned = Clock::now();
    ItemRun run;
    run.serial = ++items_started_;
    try {
      for (;;) {
        const std::optional<std::chrono::milliseconds> backoff = co_await attempt(item, *live, run);
        if (!backoff) break;
        // The backoff is waited out without a concurrency slot; the progress counts the items
        // doing so, which no rate or ETA shows.
        ++counters_.backing_off;
        struct BackingOff {
          std::int64_t& count;
          ~BackingOff() { --count; }
        } backing_off{counters_.backing_off};
        asio::steady_timer timer(io_);
        timer.expires_after(*backoff);
        co_await timer.async_wait(asio::use_awaitable);
        // A failing server gets retries at the budget's pace, not at the items' pace. One item
        // at a time watches the budget, first come first served; the others queue behind it
        // (all of them waking at each retry cost a thread's worth at 100,000 waiting). A server
        // that cannot be connected to sees none of these attempts: they go at the reconnect's
        // pace instead.
        if (!run.waits_for_server) {
          co_await budget_turn_.acquire();
          struct TurnGuard {
            AsyncSemaphore& turn;
            ~TurnGuard() { turn.release(); }
          } turn{budget_turn_};
          while (!stopping_ && !budget_.try_spend()) {
            timer.expires_after(budget_.time_until_refill());
            co_await timer.async_wait(asio::use_awaitable);
          }
        }
        if (stopping_) {
          run.cancelled = true;  // stopped during its backoff; a rerun redoes it
          break;
        }
      }
    } catch (const boost::system::system_error& e) {
      if (e.code() != asio::error::operation_aborted)
        run.outcome = Outcome::failure(Error{ErrorKind::Internal, 0, "", e.what()});
      else
        run.cancelled = true;  // stopped; a rerun redoes it
    } catch (const std::exception& e) {
      run.outcome = Outcome::failure(Error{ErrorKind::Internal, 0, "", e.what()});
    }
    if (run.cancelled) {
      summary_.add_unfinished_attempts(run.attempts);
      co_return;
    }
    record(item, run, spawned);
  }

  // One attempt, holding a concurrency slot. Returns the backoff before the next attempt, or
  // nothing when the item is finished (run.outcome) or cancelled (run.cancelled).
  asio::awaitable<std::optional<std::chrono::milliseconds>> attempt(const Item& item, LiveItem& live,
                                                                    ItemRun& run) {
    co_await slots_.acquire();
    struct SlotGuard {
      AsyncSemaphore& slots;
      ~SlotGuard() { slots.release(); }
    } guard{slots_};
    // The API said when to come back (below): no attempt of any item goes out before then.
    while (Clock::now() < come_back_at_ && !stopping_) {
      asio::steady_timer timer(io_);
      timer.expires_at(come_back_at_);
      co_await timer.async_wait(asio::use_awaitable);
    }
    // Without an output cap, an answer is first taken as 256 tokens, then as long as the
    // answers reported so far are on average.
    const std::int64_t uncapped =
        answers_reported_ > 0 ? std::max<std::int64_t>(1, (answer_tokens_reported_ + answers_reported_ - 1) / answers_reported_)
                              : 256;
    const std::int64_t estimate = estimate_tokens(item, uncapped);
    const std::int64_t output_estimate = estimate - item.estimated_prompt_tokens;
    // Tokens first: requests waiting for tokens/min must not hold requests/min permits, or a
    // large give-back of tokens would send them all at once, past the requests/min rate.
    co_await tokens_.acquire(static_cast<double>(estimate));
    co_await requests_.acquire(1);
    if (stopping_) {
      run.cancelled = true;
      co_return std::nullopt;
    }
    ++run.attempts;
    const auto sent_at = Clock::now();
    if (!run.first_attempt_at) {
      run.first_attempt_at = sent_at;
      budget_.on_first_attempt();
    }
    // As the records count them: an attempt the server never saw (watch_connection) is none.
    if (run.attempts > 1) ++counters_.retries;
    live.in_attempt = true;
    ++counters_.in_flight;
    run.streamed = 0;
    // Output streamed past the estimate is taken from the tokens/min bucket as it comes, not
    // when the answer ends: long answers (no max_tokens) put the bucket in debt while they run,
    // so the requests after them wait then, rather than all going out on the estimate first.
    std::int64_t charged_past_estimate = 0;
    // Reasoning pieces are output tokens as well.
    run.outcome = co_await backend_.complete(
        item.request, [this, &run, &charged_past_estimate, output_estimate, sent_at](
                          std::string_view text, std::span<const TokenLogprob>, TextPart) {
          if (text.empty()) return;
          // The first text of a stream is the server back, though its answer has yet to end.
          if (run.streamed == 0) server_back(sent_at);
          ++run.streamed;
          ++counters_.output_tokens;
          if (run.streamed > output_estimate && !tokens_.unlimited()) {
            tokens_.adjust(1.0);
            ++charged_past_estimate;
          }
        });
    --counters_.in_flight;
    live.in_attempt = false;
    watch_refusals(run.outcome, item);
    run.waits_for_server = false;
    if (const std::optional<std::chrono::milliseconds> wait = watch_connection(run.outcome, sent_at, run)) {
      // Not an attempt the server saw: the item's attempts are not spent on the outage.
      if (run.attempts > 1) --counters_.retries;
      --run.attempts;
      if (stopping_) {
        run.cancelled = true;  // sent on the next run
        co_return std::nullopt;
      }
      run.waits_for_server = true;
      co_return *wait;
    }

    if (run.outcome.ok()) {
      const Usage& usage = run.outcome.completion->usage;
      if (usage.reported) {
        // The estimate taken from the bucket is replaced by what the server counted.
        tokens_.adjust(static_cast<double>(usage.prompt_tokens + usage.completion_tokens - estimate -
                                           charged_past_estimate));
        counters_.output_tokens += usage.completion_tokens - run.streamed;
        if (!output_cap(item.request)) {
          answer_tokens_reported_ += usage.completion_tokens;
          ++answers_reported_;
        }
      }
      co_return std::nullopt;
    }
    counters_.output_tokens -= run.streamed;
    Error& error = *run.outcome.error;
    if (error.kind == ErrorKind::Cancelled) {
      run.cancelled = true;
      co_return std::nullopt;
    }
    // A rate limit (429) or an overloaded server (503) that says when to come back says it to
    // the client, not to one request: every item waits until then (up to retry.max_retry_after),
    // rather than the next ones meeting it too, a storm of refusals against an API's quota.
    if (error.retry_after && (error.http_status == 429 || error.http_status == 503)) {
      const auto wait = std::clamp(*error.retry_after, std::chrono::milliseconds{0}, job_.retry.max_retry_after);
      come_back_at_ = std::max(come_back_at_, Clock::now() + wait);
    }
    if (!retry_.retryable(error) || run.attempts >= retry_.max_attempts()) co_return std::nullopt;
    if (stopping_) {
      // The retry it would have had comes with the next run: unfinished, not failed.
      run.cancelled = true;
      co_return std::nullopt;
    }
    co_return retry_.delay(run.attempts + 1, error, rng_);
  }

  void record(const Item& item, const ItemRun& run, Clock::time_point spawned) {
    const auto now = Clock::now();
    const Timings& t = run.outcome.timings;
    json timings = {
        {"queued_ms", run.first_attempt_at ? ms_between(spawned, *run.first_attempt_at) : 0.0},
        {"ttft_ms", t.ttft_ms},
        {"tpot_ms", t.tpot_ms},
        {"total_ms", t.total_ms},
        {"elapsed_ms", ms_between(run.first_attempt_at.value_or(spawned), now)}};
    // Keys in the documented order: id first, error last.
    const std::string model = model_label(job_, item.request.model);
    nlohmann::ordered_json record = {{"id", item.id},
                                     {"input", select_input(item.input, job_.output.input_fields)},
                                     {"model", model}};
    ItemResult result;
    result.attempts = run.attempts;
    if (run.outcome.ok()) {
      const Completion& c = *run.outcome.completion;
      json usage = {{"prompt_tokens", c.usage.prompt_tokens},
                    {"completion_tokens", c.usage.completion_tokens}};
      if (!c.usage.reported) {
        // The server did not count: estimate so tokens/s stays meaningful, and say so. A
        // streamed piece is usually a token; a server that sends few large pieces (or no stream)
        // gets the four bytes a token that English text averages.
        std::size_t bytes = c.text.size() + c.reasoning.size();
        if (!c.tool_calls.is_null()) bytes += c.tool_calls.dump(-1, ' ', false, json::error_handler_t::replace).size();
        if (!c.function_call.is_null()) bytes += c.function_call.dump(-1, ' ', false, json::error_handler_t::replace).size();
        const auto by_bytes = static_cast<std::int64_t>((bytes + 3) / 4);
        usage = {{"prompt_tokens", item.estimated_prompt_tokens},
                 {"completion_tokens", std::max<std::int64_t>(run.streamed, by_bytes)},
                 {"estimated", true}};
      }
      json score = scorer_ ? scorer_->score(item.input, c.text) : json();
      record["output"] = c.text;
      if (!c.reasoning.empty()) record["reasoning"] = c.reasoning;
      if (!c.tool_calls.is_null()) record["tool_calls"] = c.tool_calls;
      if (!c.function_call.is_null()) record["function_call"] = c.function_call;
      record["finish_reason"] = c.finish_reason;
      if (c.cut_at_context > 0) record["cut_at_context"] = c.cut_at_context;
      if (c.logprobs) record["logprobs"] = logprobs_json(*c.logprobs);
      record["usage"] = usage;
      record["timings"] = timings;
      record["attempts"] = run.attempts;
      record["score"] = score;
      record["settings"] = settings_hash_;
      record["error"] = nullptr;
      result.ok = true;
      result.score = score;
      result.ttft_ms = t.ttft_ms;
      result.tpot_ms = t.tpot_ms;
      result.total_ms = t.total_ms;
      result.prompt_tokens = usage["prompt_tokens"].get<std::int64_t>();
      result.completion_tokens = usage["completion_tokens"].get<std::int64_t>();
    } else {
      const Error& e = *run.outcome.error;
      record["output"] = nullptr;
      record["finish_reason"] = nullptr;
      record["usage"] = nullptr;
      record["timings"] = timings;
      record["attempts"] = run.attempts;
      record["score"] = nullptr;
      record["settings"] = settings_hash_;
      record["error"] = e.to_json();
      result.ok = false;
      result.error_kind = std::string(to_string(e.kind));
      result.error_message = e.message;
      result.http_status = e.http_status;
      ++counters_.failed;
    }
    ++counters_.done;
    summary_.add(result);
    write_record(record);
  }

  // The output takes every record through these two. The first write that fails (a full disk,
  // a file size limit, an I/O error) stops the run: nothing more is sent, since nothing more
  // could be saved. The writer keeps what it could not write and every later flush (each
  // tick, the end of the run) tries again, so room made meanwhile still saves them.
  void write_record(const nlohmann::ordered_json& record) {
    try {
      writer_->append(record);
    } catch (const std::exception& e) {
      output_failed(e.what());
    }
  }

  void flush_output(bool only_if_due) {
    try {
      if (only_if_due) {
        writer_->flush_if_due();
      } else {
        writer_->flush();
      }
    } catch (const std::exception& e) {
      output_failed(e.what());
    }
  }

  void output_failed(const std::string& what) {
    if (output_error_) return;  // said once; the retries are quiet
    output_error_ = what;
    begin_stop(what.c_str(), false);
  }

  // Failures that every item would meet alike stop the sending: after kRefusalsToStop attempts
  // in a row that meet one, with no success between, no new item is sent, and what was not
  // sent is left for the next run, after the cause is fixed. An API that refuses this client (a
  // wrong key, no quota, no access); a 404 (no such endpoint, as under a base URL without /v1,
  // or no such model); and, while nothing has succeeded yet, a server that cannot be reached
  // (not started, the wrong port) or that does not answer in HTTP (another service's port):
  // each item would otherwise spend all its attempts on it.
  // Attempts are counted, not items: items retry a refused connection, and counting items let
  // nearly every item start and back off before ten had spent all their attempts. Failures to
  // connect must also have lasted kUnreachableFor: a server started beside the run
  // (`server & batchlm run`) gets that long to come up.
  static constexpr int kRefusalsToStop = 10;
  static constexpr std::chrono::seconds kUnreachableFor{5};
  void watch_refusals(const Outcome& outcome, const Item& item) {
    if (outcome.ok()) {
      refusals_in_a_row_ = 0;
      any_success_ = true;
      return;
    }
    const Error& e = *outcome.error;
    const bool denied = (e.kind == ErrorKind::Http && (e.http_status == 401 || e.http_status == 403)) ||
                        e.code == "insufficient_quota" || e.code == "invalid_api_key";
    const bool missing = e.kind == ErrorKind::Http && e.http_status == 404;
    // Only before any success: a server lost after it is waited for (watch_connection). Behind
    // a gateway, the gateway's word for it (no_server_behind).
    const bool behind = no_server_behind(e) && !any_success_;
    const bool unreachable = behind || (never_connected(e) && !any_success_);
    // No TLS connection (a certificate not trusted, expired or for another name; https to a
    // plain HTTP port): the same for every item, and no retry changes it.
    const bool no_tls = e.kind == ErrorKind::Connection && e.code == "tls_failed" && !any_success_;
    // A server that answers in something other than HTTP (an SSH port, a database's): the base
    // URL leads to the wrong service, and every item meets it alike.
    const bool not_http = e.kind == ErrorKind::Protocol && e.code == "not_http" && !any_success_;
    if (!denied && !missing && !unreachable && !not_http && !no_tls) return;
    const auto now = Clock::now();
    if (refusals_in_a_row_++ == 0) refusals_since_ = now;
    if (refusals_in_a_row_ < kRefusalsToStop || stopping_) return;
    if (unreachable && now - refusals_since_ < kUnreachableFor) return;
    const std::string url = without_password(job_.backend.base_url);
    // Cut between characters; shown through terminal_safe, as the server's text it is.
    const std::string said = utf8_excerpt(e.message, 200);
    if (behind) {
      refused_ = Refusal{"no server answers behind " + url + " (" + said + ")",
                         "Start the server behind it, or fix the base URL"};
    } else if (unreachable) {
      const std::string proxy = client::proxy_for(job_.backend.base_url);
      refused_ = Refusal{"cannot reach " + url + (proxy.empty() ? "" : " through the proxy " + proxy) + " (" + said + ")",
                         proxy.empty() ? "Start the server or fix the base URL"
                                       : "Start the server, fix the base URL, or fix or unset the proxy variable"};
    } else if (no_tls) {
      refused_ = Refusal{"cannot make a TLS connection to " + url + " (" + said + ")",
                         "Fix the base URL, or have the server's certificate trusted"};
    } else if (not_http) {
      refused_ = Refusal{url + " does not answer in HTTP (the last " + std::to_string(kRefusalsToStop) +
                             " requests had no HTTP reply)",
                         "Fix the base URL: its host and port must be the API server's"};
    } else {
      Refusal r{"the API refused the last " + std::to_string(kRefusalsToStop) + " requests (HTTP " +
                    std::to_string(e.http_status) + (e.code.empty() ? "" : " " + e.code) + ": " +
                    said + ")",
                "Fix the key, quota or access"};
      if (missing) {
        // The path before the query ("?api-version=..."), which stays after it.
        const std::size_t q = url.find('?');
        std::string trimmed = url.substr(0, q);
        const std::string query = q == std::string::npos ? std::string() : url.substr(q);
        if (trimmed.ends_with('/')) trimmed.pop_back();
        const auto has_path = [](const std::string& base) {
          const std::size_t scheme = base.find("://");
          return base.find('/', scheme == std::string::npos ? 0 : scheme + 3) != std::string::npos;
        };
        const bool bare = !has_path(trimmed);
        // An endpoint's URL given as the base: the client adds the endpoint to it again. Without
        // a path left, the root is under /v1.
        const auto api_root = [&](const std::string& base) { return has_path(base) ? base : base + "/v1"; };
        std::string endpoint;
        for (const char* path : {"/chat/completions", "/completions", "/responses", "/embeddings"})
          if (endpoint.empty() && trimmed.ends_with(path)) endpoint = path;
        r.advice = bare ? "OpenAI-compatible APIs are served under /v1: set the base URL to " + trimmed + "/v1" + query
                   : !endpoint.empty()
                       ? "The base URL is the API's root, which the client adds " + endpoint + " to: set it to " +
                             api_root(trimmed.substr(0, trimmed.size() - endpoint.size())) + query
                       : "Check the base URL, and that the server has the model '" +
                             model_label(job_, item.request.model) + "'";
      }
      refused_ = std::move(r);
    }
    begin_stop(refused_->what.c_str(), false);
  }

  static std::string lasted(Clock::duration d) { return format_duration(std::chrono::duration<double>(d).count()); }

  // A connection that could not be made: refused (the server is down or restarting), no host,
  // or a connect timeout (a host that drops packets). Not a connection that broke once made.
  static bool never_connected(const Error& e) {
    return (e.kind == ErrorKind::Connection && e.code == "connect_failed") ||
           (e.kind == ErrorKind::Timeout && e.code == "connect_timeout");
  }

  // What stands in front of a server that is gone says so: a gateway's 502 or 504 (and a CDN's
  // 520 to 524, Cloudflare's for an origin that is down, unreachable or silent), or a port that
  // takes the connection and closes it without a word (a container's published port while the
  // container restarts). The server itself may be the cause for one request (a proxy's timeout
  // on a long answer, a request that crashes it), so this counts as the server gone only once
  // two items met it with no answer between (watch_connection). A 503 is left out: servers
  // answer it themselves when overloaded, to some requests and not others.
  static bool no_server_behind(const Error& e) {
    if (e.kind == ErrorKind::Connection) return e.code == "no_reply";
    return e.kind == ErrorKind::Http &&
           (e.http_status == 502 || e.http_status == 504 || (e.http_status >= 520 && e.http_status <= 524));
  }

  // An attempt sent at `sent_at` was answered (an answer begun, or an error other than the
  // server's absence): where that was after the server was found gone, it is back, and the wait
  // ends. Answers to attempts sent before then (a request cut by the server's end) say nothing.
  void server_back(Clock::time_point sent_at) {
    if (!server_down_since_ || sent_at < *server_down_since_) return;
    if (counters_.no_connection)  // the wait was said
      progress_.message("batchlm: " + without_password(job_.backend.base_url) + " answers again after " +
                        lasted(sent_at - *server_down_since_) + "; the items that waited go on");
    server_down_since_.reset();
    items_without_server_.clear();
    counters_.no_connection = false;
  }

  // A server that answered before and now cannot be connected to is restarting, or its host
  // is: the items wait for it, up to retry.reconnect_for, rather than each spending its attempts
  // in a few seconds and failing. Such an attempt never reached a server, so it is not counted
  // and nothing is sent twice. Returns how long the item waits before trying again, or nothing
  // where the outcome is not such a failure (or reconnect_for is 0, or this item has waited that
  // long already: its attempts count again, so no item retries unbounded while others get
  // through). Once the failures have lasted 2 s, the wait is said and every item holds, one round
  // of attempts a second (retry.cap if less); past reconnect_for the run stops, and what was not
  // sent runs on the next run. What a gateway or a published port says for a server gone behind
  // it (no_server_behind) is waited for alike once a second item has met it with no answer
  // between; until then it is a failure as any other, counted and retried.
  std::optional<std::chrono::milliseconds> watch_connection(const Outcome& outcome, Clock::time_point sent_at,
                                                            ItemRun& run) {
    const Error* e = outcome.ok() ? nullptr : &*outcome.error;
    const bool refused = e != nullptr && never_connected(*e);
    const bool behind = e != nullptr && !refused && no_server_behind(*e);
    if (!refused && !behind) {
      // An answer, even an error one, is the server back; a connection that broke before any
      // answer (a proxy's port open while what is behind it restarts) is not, nor a cancel.
      if (e == nullptr || (e->kind != ErrorKind::Connection && e->kind != ErrorKind::Timeout &&
                           e->kind != ErrorKind::Cancelled && e->kind != ErrorKind::Internal)) {
        run.unconnected_since.reset();
        server_back(sent_at);
      }
      return std::nullopt;
    }
    if (!any_success_ || job_.retry.reconnect_for.count() <= 0) return std::nullopt;
    const auto now = Clock::now();
    if (run.unconnected_since && now - *run.unconnected_since >= job_.retry.reconnect_for && !server_down_since_)
      return std::nullopt;
    if (behind) {
      // Counted from the first such answer to an attempt sent since the last answer.
      if (server_down_since_ && sent_at < *server_down_since_) return std::nullopt;
      if (!server_down_since_) server_down_since_ = now;
      items_without_server_.insert(run.serial);
      if (items_without_server_.size() < 2) return std::nullopt;
    }
    if (!run.unconnected_since) run.unconnected_since = now;
    if (!server_down_since_) server_down_since_ = now;
    items_without_server_.insert(run.serial);
    const std::string url = without_password(job_.backend.base_url);
    const std::string said = utf8_excerpt(e->message, 200);
    const std::string what = behind ? "no server answers behind " + url : "cannot connect to " + url;
    // Said, and every item held, once it has lasted a little: a connection refused now and then
    // (a port running short, a full accept queue) is not news, and holds only its own item.
    const bool lasting = now - *server_down_since_ >= std::chrono::seconds(2);
    if (lasting && !counters_.no_connection) {
      counters_.no_connection = true;
      progress_.message("batchlm: " + what + " (" + said + "); the items wait for it up to " +
                        lasted(job_.retry.reconnect_for) + " (retry.reconnect_for), without spending their attempts");
    }
    if (now - *server_down_since_ >= job_.retry.reconnect_for) {
      if (!stopping_) {
        refused_ = Refusal{(behind ? "no server answered behind " + url : "could not connect to " + url) + " for " +
                               lasted(now - *server_down_since_) + " (" + said + ")",
                           "Start the server again (or raise retry.reconnect_for)"};
        begin_stop(refused_->what.c_str(), false);
      }
      return std::chrono::milliseconds{0};
    }
    const auto round = std::clamp(job_.retry.cap, std::chrono::milliseconds{1}, std::chrono::milliseconds{1000});
    if (!lasting) return round;
    if (come_back_at_ <= now) come_back_at_ = now + round;
    return std::chrono::duration_cast<std::chrono::milliseconds>(come_back_at_ - now);
  }

  asio::awaitable<void> tick() {
    asio::steady_timer timer(io_);
    while (!io_.stopped()) {
      if (auto stats = backend_.engine_stats()) counters_.engine = stats->brief();
      progress_.update(counters_);
      flush_output(true);
      timer.expires_after(std::chrono::milliseconds(100));
      co_await timer.async_wait(asio::use_awaitable);
    }
  }

  std::string summary_path() const { return job_.output.path + ".summary.json"; }

  // Answers the embedded engine cut short at a smaller context than it has now: made again,
  // since the context is engine tuning, not one of the settings a resume compares. Only those
  // made under this run's settings: others must reach the settings check, which refuses them.
  std::function<bool(const json&)> redo_cut_answers() const {
    const std::int64_t context = backend_.context();
    if (context <= 0) return {};
    return [context, hash = settings_hash_](const json& record) {
      const auto cut = record.find("cut_at_context");
      const auto settings = record.find("settings");
      return cut != record.end() && cut->is_number_integer() && cut->get<std::int64_t>() < context &&
             settings != record.end() && *settings == hash;
    };
  }

  // Results made under other settings (another model, prompt, sampling, few-shot or scoring)
  // would be counted as this run's: the run stops before sending anything and says what
  // changed (other_settings_error).
  void refuse_other_settings(const std::string& kept_settings) const {
    if (other_.count == 0) return;
    throw other_settings_error(job_.output.path, settings_, other_, kept_settings);
  }


  // The summary beside the output, whole or not at all (a temporary file renamed over it); the
  // reason when it could not be written.
  std::optional<std::string> write_summary(const json& summary) const {
    const std::string path = summary_path();
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) return path + " is a directory";
    try {
      // A server's error message may hold bytes that are no UTF-8 (a raw body): replaced, as in
      // the records, rather than failing the summary.
      replace_file(path, summary.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::nullopt;
  }

  RunResult finish() {
    RunResult r;
    r.total = counters_.total;
    r.resumed = counters_.resumed;
    r.succeeded = summary_.succeeded();
    r.failed = summary_.failed();
    r.interrupted = interrupted_;
    r.unfinished = std::max<std::int64_t>(0, r.total - r.succeeded - r.failed);
    const double wall = std::chrono::duration<double>(Clock::now() - start_).count();
    // Finished items the output could not take: counted, but not in the file.
    const std::int64_t unsaved = writer_->buffered();
    if (output_error_) summary_.set_unsaved(unsaved);
    json summary = summary_.to_json(wall, counters_.total);
    summary["job"] = job_.name;
    summary["settings"] = settings_;
    summary["backend"] = backend_.describe();
    summary["output"] = job_.output.path;
    summary["interrupted"] = interrupted_;
    const std::optional<EngineStats> engine = backend_.engine_stats();
    if (engine) summary["engine"] = engine->to_json();
    if (output_error_) summary["output_error"] = {{"message", *output_error_}, {"unsaved", unsaved}};
    // Why the run stopped sending, and what the console's notes say, for a script that reads
    // the summary rather than the terminal.
    if (refused_) summary["stopped"] = {{"reason", refused_->what}, {"advice", refused_->advice}};
    const auto outside = static_cast<std::int64_t>(kept_.size()) - resumed_in_scope_;
    if (changed_inputs_ > 0)
      summary["earlier_records_of_other_inputs"] = {{"count", changed_inputs_}, {"first_id", json::parse(first_changed_id_)}};
    if (!interrupted_ && outside > 0) summary["earlier_records_outside_the_job"] = outside;
    const std::optional<std::string> summary_error = write_summary(summary);
    if (!summary_error) r.summary_path = summary_path();
    std::fputs(summary_.to_text(wall, counters_.total).c_str(), options_.progress_out);
    if (changed_inputs_ > 0) {
      std::fprintf(options_.progress_out,
                   "note: %lld earlier record%s made from other inputs than this job gives their ids "
                   "now (the first: id %s): the input, the seed or the variables changed since. They were "
                   "kept; --fresh redoes every item\n",
                   static_cast<long long>(changed_inputs_), changed_inputs_ == 1 ? " was" : "s were",
                   first_changed_id_.c_str());
    }
    if (!interrupted_ && outside > 0) {
      std::fprintf(options_.progress_out,
                   "note: %lld earlier record%s in the output %s not among this run's %lld item%s "
                   "(kept in the file, not counted)\n",
                   static_cast<long long>(outside), outside == 1 ? "" : "s", outside == 1 ? "is" : "are",
                   static_cast<long long>(counters_.total), counters_.total == 1 ? "" : "s");
    }
    if (engine) {
      std::fprintf(options_.progress_out,
                   "engine: %lld prompt tokens computed, %lld from the prefix cache (%.0f%%), "
                   "%lld generated in %lld batched steps, %lld preemptions%s\n",
                   static_cast<long long>(engine->prompt_tokens_computed),
                   static_cast<long long>(engine->prompt_tokens_cached), 100.0 * engine->cache_hit_rate(),
                   static_cast<long long>(engine->generated_tokens), static_cast<long long>(engine->steps),
                   static_cast<long long>(engine->preemptions),
                   engine->recomputed_tokens > 0
                       ? (" (" + std::to_string(engine->recomputed_tokens) + " tokens computed again)").c_str()
                       : "");
      if (!engine->speculative.empty()) {
        std::fprintf(options_.progress_out,
                     "speculative (%s): %lld of %lld drafts accepted (%.0f%%), %.2f tokens per "
                     "target pass, %.0f%% of engine time drafting\n",
                     engine->speculative.c_str(), static_cast<long long>(engine->accepted_tokens),
                     static_cast<long long>(engine->drafted_tokens), 100.0 * engine->acceptance_rate(),
                     engine->tokens_per_pass(), 100.0 * engine->draft_time_share());
      }
    }
    std::fprintf(options_.progress_out, "output: %s\n", terminal_safe(job_.output.path).c_str());
    if (summary_error) {
      std::fprintf(stderr, "batchlm: summary not written: %s\n", summary_error->c_str());
    } else {
      std::fprintf(options_.progress_out, "summary: %s\n", terminal_safe(r.summary_path).c_str());
    }
    if (interrupted_ && r.unfinished == 0 && !output_error_) {
      // Stopped while the last items were in flight, and they finished: nothing to resume.
      r.exit_code = r.failed > 0 ? kExitSomeFailed : kExitOk;
      std::fprintf(options_.progress_out, "interrupted, but every item had finished\n");
    } else if (interrupted_) {
      r.exit_code = kExitInterrupted;
      std::fprintf(options_.progress_out,
                   "interrupted: %lld item%s not finished; run the same command again to resume\n",
                   static_cast<long long>(r.unfinished), r.unfinished == 1 ? "" : "s");
    } else if (output_error_) {
      r.exit_code = kExitSomeFailed;
      const std::string not_saved =
          unsaved > 0 ? ", " + std::to_string(unsaved) + " finished items could not be saved" : std::string();
      std::fprintf(options_.progress_out,
                   "stopped: %s; %s left for the next run%s. Make room or fix the output, then run the same "
                   "command again: they run then\n",
                   terminal_safe(*output_error_).c_str(), items_were(r.unfinished).c_str(), not_saved.c_str());
    } else if (refused_) {
      r.exit_code = kExitSomeFailed;
      std::fprintf(options_.progress_out,
                   "stopped: %s; %s left for the next run. %s, then run the same command again\n",
                   terminal_safe(refused_->what).c_str(), items_were(r.unfinished).c_str(),
                   terminal_safe(refused_->advice).c_str());
    } else {
      r.exit_code = r.failed > 0 || r.unfinished > 0 ? kExitSomeFailed : kExitOk;
    }
    // A summary that a script would read and not find is a failed output, whatever the items did.
    if (summary_error && r.exit_code == kExitOk) r.exit_code = kExitSomeFailed;
    return r;
  }

  const JobSpec& job_;
  Source& source_;
  Backend& backend_;
  asio::io_context& io_;
  RunOptions options_;
  AsyncSemaphore slots_, budget_turn_, live_;
  TokenBucket requests_, tokens_;
  RetryPolicy retry_;
  RetryBudget budget_;
  std::unique_ptr<Scorer> scorer_;
  std::mt19937_64 rng_;
  Progress progress_;
  Summary summary_;
  ProgressCounters counters_;
  // Ignored while the run lasts, up to the writer's last flush in its destructor (see run()).
  std::optional<IgnoredSignal> broken_pipes_, too_large_files_;
  std::unique_ptr<OutputWriter> writer_;
  // The records the output already held, by id (see Kept), and how many of them were this
  // run's items.
  std::vector<std::string> metric_names_;            // the scores' names, a bit each in Kept
  std::vector<std::vector<std::string>> key_sets_;   // the kept inputs' keys, most often one set
  std::unordered_map<std::string, std::uint32_t> key_set_index_;  // a key set, joined, to its index
  const json settings_ = result_settings(job_);
  const std::string settings_hash_ = settings_hash(settings_);
  OtherSettings other_;  // kept records made under other settings
  Clock::time_point refusals_since_{};  // the first of refusals_in_a_row_
  std::unordered_map<std::string, Kept> kept_;
  std::int64_t changed_inputs_ = 0;  // kept records whose input is not the item's now
  std::string first_changed_id_;
  std::int64_t resumed_in_scope_ = 0;
  Clock::time_point come_back_at_{};  // the latest time a 429 or 503 said to come back at
  // Completion tokens the server reported for answers without an output cap, and how many.
  std::int64_t answer_tokens_reported_ = 0, answers_reported_ = 0;
  std::list<LiveItem> items_;
  asio::cancellation_signal producer_cancel_;
  asio::steady_timer all_done_, grace_timer_;
  std::exception_ptr producer_error_;
  Clock::time_point start_;
  bool stopping_ = false, interrupted_ = false;
  int refusals_in_a_row_ = 0;
  bool any_success_ = false;  // an item of this run has succeeded
  // Since when the server, which answered before, cannot be connected to (watch_connection);
  // counters_.no_connection says whether the wait was said.
  std::optional<Clock::time_point> server_down_since_;
  // The items whose attempts met the outage since then (no_server_behind counts from two).
  std::set<std::uint64_t> items_without_server_;
  std::uint64_t items_started_ = 0;
  struct Refusal {
    std::string what, advice;  // may quote the server: printed through terminal_safe
  };
  std::optional<Refusal> refused_;  // why the run stopped sending: what every item met
  std::optional<std::string> output_error_;  // why the run stopped sending: the output fails
  int stop_signals_ = 0;  // SIGINT, SIGTERM and SIGHUP received
};

RunResult run_job(const JobSpec& job, Source& source, Backend& backend, asio::io_context& io,
                  const RunOptions& options) {
  Dispatcher dispatcher(job, source, backend, io, options);
  return dispatcher.run();
}

namespace {

// What a resume would take from the output, read once: the ids of the finished records (no
// error), whose items it skips; and those made with other settings than the job's, which it
// refuses (other_settings_error, said from the lock file's settings as the run says it).
std::unordered_set<std::string> take_earlier_records(const JobSpec& job) {
  const std::string& path = job.output.path;
  std::unordered_set<std::string> ids;
  std::ifstream in(path);
  if (!in) return ids;
  const json settings = result_settings(job);
  const std::string hash = settings_hash(settings);
  OtherSettings other;
  for (std::string line; std::getline(in, line);) {
    if (in.eof()) break;  // a last line without its newline is torn: the resume drops it
    const json record = json::parse(line, nullptr, false);
    // Failed records are redone, not kept: they count for nothing.
    if (!record.is_object() || !record.contains("id") || !record.value("error", json()).is_null()) continue;
    ids.insert(record["id"].dump());
    const auto it = record.find("settings");
    if (it == record.end() || *it == hash) continue;
    if (other.count++ == 0) {
      other.hash = it->is_string() ? it->get<std::string>() : it->dump();
      other.model = record.value("model", json()).is_string() ? record["model"].get<std::string>() : "";
    }
  }
  if (other.count == 0) return ids;
  // The settings after the pid in the lock file, as the run reads them.
  std::string kept;
  std::error_code ec;
  const std::filesystem::path real = std::filesystem::canonical(path, ec);
  if (std::ifstream lock(ec ? path + ".lock" : real.string() + ".lock"); lock) {
    std::string pid;
    std::getline(lock, pid);
    std::getline(lock, kept, '\0');
    while (!kept.empty() && kept.back() == '\n') kept.pop_back();
  }
  throw other_settings_error(path, settings, other, kept);
}

}  // namespace

void dry_run(const JobSpec& job, Source& source, std::FILE* out, const DryRunOptions& options) {
  const int show = options.show;
  const PromptTokenCounter& count_prompt_tokens = options.count_prompt_tokens;
  const std::unordered_set<std::string> done = options.fresh ? std::unordered_set<std::string>() : take_earlier_records(job);
  std::int64_t items = 0, prompt_tokens = 0, max_output_tokens = 0, unbounded = 0, skipped = 0;
  std::int64_t past_context = 0;  // of the prompts counted
  std::string first_past;         // the first such item's id and length
  // Counted exactly for the first items, then their counts' ratio to the length estimate
  // scales the estimates of the rest (tokenizing a million long prompts takes minutes).
  constexpr std::int64_t kItemsCounted = 20'000;
  std::int64_t counted = 0, counted_estimate = 0, uncounted_estimate = 0;
  const bool local = job.backend.type == "local";
  const std::string target = local ? job.backend.model : without_password(job.backend.base_url);
  // A synth job of billions of items is estimated from its first million (items differ only in
  // their drawn variables) rather than drawn whole.
  constexpr std::int64_t kItemsLooked = 1'000'000;
  while (items < kItemsLooked) {
    std::optional<Item> item = source.next();
    if (!item) break;
    if (done.contains(item->id_key)) {
      ++skipped;
      continue;
    }
    if (item->request.model.empty()) item->request.model = job.backend.model;
    item->request.stream = job.backend.stream;
    if (items < show) {
      // The engine takes the request, not a body: streaming is the client's business.
      nlohmann::ordered_json body = client::to_openai_body(item->request);
      if (local) {
        body.erase("stream");
        body.erase("stream_options");
      }
      std::fprintf(out, "--- item %s: %s%s\n%s\n", item->id.dump().c_str(),
                   local ? "local engine, model " : "POST ",
                   (local ? target : client::endpoint_url(target, item->request.prompt.has_value())).c_str(),
                   body.dump(2).c_str());
    }
    ++items;
    if (count_prompt_tokens && items <= kItemsCounted) {
      const std::int64_t n = count_prompt_tokens(item->request);
      counted += n;
      counted_estimate += item->estimated_prompt_tokens;
      if (options.context > 0 && n >= options.context && past_context++ == 0)
        first_past = "id " + item->id.dump() + ": " + std::to_string(n) + " tokens";
    } else {
      uncounted_estimate += item->estimated_prompt_tokens;
    }
    if (const auto cap = output_cap(item->request)) {
      max_output_tokens += *cap;
    } else {
      ++unbounded;
    }
  }
  if (count_prompt_tokens) {
    const double ratio = counted_estimate > 0 ? static_cast<double>(counted) / static_cast<double>(counted_estimate) : 1.0;
    prompt_tokens = counted + static_cast<std::int64_t>(std::llround(static_cast<double>(uncounted_estimate) * ratio));
  } else {
    prompt_tokens = uncounted_estimate;
  }
  std::string estimated_from;
  double scale = 1;
  // The items to send: the job's less those finished in the output (counted among the items
  // looked at; a resume's finished items come first).
  const std::int64_t to_send = std::max(items, source.total() - skipped);
  if (to_send > items && items > 0) {
    scale = static_cast<double>(to_send) / static_cast<double>(items);
    estimated_from = " (from the first " + std::to_string(items) + ")";
  }
  // Counts scaled up to every item: whole numbers, in powers of ten past what reads as one.
  const auto count = [&](std::int64_t n) {
    const double v = static_cast<double>(n) * scale;
    char text[40];
    std::snprintf(text, sizeof text, v < 1e15 ? "%.0f" : "%.3g", v);
    return std::string(text);
  };
  // Without max_tokens an answer runs to the model's end of turn or its context: no bound.
  const std::string output_bound =
      unbounded > 0 ? count(unbounded) + (unbounded == 1 && scale == 1.0 ? " item" : " items") +
                          " without max_tokens, so no bound"
                    : "at most " + count(max_output_tokens);
  std::string prompt_label = "estimated prompt tokens" + estimated_from;
  if (count_prompt_tokens)
    prompt_label = items <= kItemsCounted && scale == 1.0
                       ? "prompt tokens (counted with the model's tokenizer)"
                       : "estimated prompt tokens (the first " + std::to_string(std::min(items, kItemsCounted)) +
                             " items counted with the model's tokenizer, the rest scaled" +
                             (scale == 1.0 ? std::string() : "; from the first " + std::to_string(items) + " items") +
                             ")";
  const std::int64_t total = std::max(items + skipped, source.total());
  const std::string resumed =
      skipped > 0 ? " (" + std::to_string(skipped) + " finished in the output, " + std::to_string(to_send) + " to send)"
                  : std::string();
  std::fprintf(out, "--- dry run: job '%s' is valid; %lld item%s%s to %s (%s), concurrency %d\n", job.name.c_str(),
               static_cast<long long>(total), total == 1 ? "" : "s", resumed.c_str(), target.c_str(),
               job.backend.type.c_str(), job.concurrency);
  if (items == 0 && skipped > 0) {
    std::fprintf(out, "nothing to send: every item is finished in the output (--fresh redoes them)\n");
  } else {
    std::fprintf(out, "%s: %s (about %lld per item); output tokens: %s\n", prompt_label.c_str(),
                 count(prompt_tokens).c_str(), static_cast<long long>(items > 0 ? prompt_tokens / items : 0),
                 output_bound.c_str());
  }
  if (past_context > 0)
    std::fprintf(out,
                 "warning: %lld of the prompts counted leave%s no room in the context of %lld tokens (the first, %s): "
                 "the run would fail %s; raise backend.context or shorten the prompts\n",
                 static_cast<long long>(past_context), past_context == 1 ? "s" : "",
                 static_cast<long long>(options.context), first_past.c_str(), past_context == 1 ? "it" : "them");
  std::fprintf(out, "output: %s\nnothing was sent.\n", terminal_safe(job.output.path).c_str());
}

}  // namespace batchlm::runner
