#include "batchlm/runner/progress.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <utility>
#include <vector>
#include <string>

namespace batchlm::runner {
namespace {

using nlohmann::json;
using std::chrono::milliseconds;
using std::chrono::seconds;

ProgressCounters counters() {
  ProgressCounters c;
  c.total = 1319;
  c.resumed = 20;
  c.done = 100;  // 120 of 1319 done
  c.failed = 2;
  c.in_flight = 32;
  c.retries = 3;
  c.output_tokens = 8120;
  return c;
}

// Everything written to a tmpfile, read back.
std::string contents(std::FILE* file) {
  std::fflush(file);
  std::rewind(file);
  std::string text;
  char block[1024];
  std::size_t n;
  while ((n = std::fread(block, 1, sizeof block, file)) > 0) text.append(block, n);
  return text;
}

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// --- The bar ------------------------------------------------------------------------------

TEST(ProgressBar, WideTerminalShowsEveryField) {
  Progress progress(nullptr, true, seconds{5}, 160);
  // 100 done in 10 s, 2 of them failed: 9.8 answers a second; 1199 left at 10 a second: 2 minutes.
  const std::string line = progress.render_bar(counters(), 10.0);
  for (const char* field : {"120/1319", "9.1%", "9.8 req/s", "812 tok/s", "eta 2m00s", "in-flight 32",
                            "retries 3", "failed 2"}) {
    EXPECT_NE(line.find(field), std::string::npos) << field << " missing in: " << line;
  }
  EXPECT_NE(line.find("[###."), std::string::npos) << line;  // 9.1% of 40 cells
  EXPECT_LT(line.size(), 160u);
  EXPECT_GT(line.size(), 100u);  // the bar grows to use the room
}

TEST(ProgressBar, EngineStatsShowWhenThereIsRoom) {
  ProgressCounters c = counters();
  c.engine = "12 run 20 wait cache 87% kv 41%";
  Progress wide(nullptr, true, seconds{5}, 200);
  EXPECT_NE(wide.render_bar(c, 10.0).find("engine 12 run 20 wait cache 87% kv 41%"), std::string::npos)
      << wide.render_bar(c, 10.0);
  // Narrower: the engine field goes before the rates and the eta.
  Progress narrow(nullptr, true, seconds{5}, 100);
  const std::string line = narrow.render_bar(c, 10.0);
  EXPECT_EQ(line.find("engine"), std::string::npos) << line;
  EXPECT_NE(line.find("eta 2m00s"), std::string::npos) << line;
  // The plain line always has it; without an engine, nothing is added.
  Progress plain(nullptr, false);
  EXPECT_NE(plain.render_plain(c, 10.0).find(" engine 12 run 20 wait"), std::string::npos);
  EXPECT_EQ(plain.render_plain(counters(), 10.0).find("engine"), std::string::npos);
}

// The engine's field, too long for 80 columns, goes; the shorter fields dropped before it come
// back rather than its room going to the bar.
TEST(ProgressBar, RoomALongFieldLeavesGoesBackToShorterOnes) {
  ProgressCounters c = counters();
  c.engine = "12 run 20 wait cache 87% kv 41%";
  c.retries = c.failed = 0;  // the in-flight count then goes before the engine's field
  Progress progress(nullptr, true, seconds{5}, 80);
  const std::string line = progress.render_bar(c, 10.0);
  EXPECT_EQ(line.find("engine"), std::string::npos) << line;
  for (const char* field : {"120/1319", "eta 2m00s", "in-flight 32"})
    EXPECT_NE(line.find(field), std::string::npos) << field << " missing in: " << line;
}

TEST(ProgressBar, BarFillMatchesTheFractionDone) {
  Progress progress(nullptr, true, seconds{5}, 200);
  ProgressCounters c = counters();
  c.total = 100;
  c.resumed = 0;
  c.done = 50;
  const std::string line = progress.render_bar(c, 10.0);
  const auto open = line.find('['), close = line.find(']');
  ASSERT_NE(open, std::string::npos);
  ASSERT_NE(close, std::string::npos);
  const std::string bar = line.substr(open + 1, close - open - 1);
  EXPECT_EQ(bar.size(), 40u);  // the widest bar
  EXPECT_EQ(count(bar, "#"), 20u);
  EXPECT_EQ(count(bar, "."), 20u);
}

// The last column would make some terminals wrap; and a Ctrl-C echoed as "^C" after the bar
// must fit on its row too.
TEST(ProgressBar, LeavesTheLastColumnsFreeForAnEchoedCtrlC) {
  for (int width : {200, 120, 100, 80, 60, 40, 30, 20, 10, 5, 1}) {
    Progress progress(nullptr, true, seconds{5}, width);
    const std::string line = progress.render_bar(counters(), 10.0);
    EXPECT_LE(static_cast<int>(line.size()), std::max(1, width - 3)) << width << ": " << line;
    EXPECT_FALSE(line.empty()) << width;
  }
}

TEST(ProgressBar, EightyColumnsKeepsTheBarAndTheEssentials) {
  Progress progress(nullptr, true, seconds{5}, 80);
  const std::string line = progress.render_bar(counters(), 10.0);
  for (const char* field : {"120/1319", "9.1%", "[", "req/s", "eta 2m00s", "failed 2"}) {
    EXPECT_NE(line.find(field), std::string::npos) << field << " missing in: " << line;
  }
}

TEST(ProgressBar, NarrowTerminalDropsTheLeastImportantFieldsFirst) {
  Progress progress(nullptr, true, seconds{5}, 40);
  const std::string line = progress.render_bar(counters(), 10.0);
  EXPECT_NE(line.find("120/1319"), std::string::npos) << line;
  EXPECT_NE(line.find("eta"), std::string::npos) << line;
  EXPECT_EQ(line.find("retries"), std::string::npos) << line;
  EXPECT_EQ(line.find("in-flight"), std::string::npos) << line;
  EXPECT_EQ(line.find("tok/s"), std::string::npos) << line;
}

// Retries and failures, once there are any, outrank the rates and the in-flight count: on a
// standard terminal a flaky API shows.
TEST(ProgressBar, RetriesShowAtEightyColumnsOnceThereAreAny) {
  ProgressCounters c = counters();
  c.total = 30;
  c.resumed = 0;
  c.done = 14;
  c.in_flight = 4;
  c.retries = 7;
  Progress progress(nullptr, true, seconds{5}, 80);
  const std::string line = progress.render_bar(c, 1.4);
  for (const char* field : {"14/30", "46.7%", "[", "eta", "retries 7", "failed 2"})
    EXPECT_NE(line.find(field), std::string::npos) << field << " missing in: " << line;
  // None yet: the first to go.
  c.retries = 0;
  c.failed = 0;
  Progress calm(nullptr, true, seconds{5}, 60);
  const std::string quiet = calm.render_bar(c, 1.4);
  EXPECT_EQ(quiet.find("retries"), std::string::npos) << quiet;
  EXPECT_NE(quiet.find("req/s"), std::string::npos) << quiet;
}

// The bar keeps its length from one redraw to the next as the figures beside it grow, so the
// fields after it stay put; a new width lays it out afresh.
TEST(ProgressBar, TheBarKeepsItsLengthAsTheFiguresGrow) {
  const auto bar_length = [](const std::string& line) { return line.find(']') - line.find('['); };
  for (const int width : {80, 100, 120}) {
    Progress progress(nullptr, true, seconds{5}, width);
    ProgressCounters c;
    c.total = 1000;
    std::size_t first = 0;
    for (const std::int64_t done : {0, 1, 9, 10, 99, 100, 999, 1000}) {
      c.done = done;
      c.output_tokens = done * 137;
      c.in_flight = done < 1000 ? 32 : 0;
      const std::string line = progress.render_bar(c, 0.5 + static_cast<double>(done) / 50.0);
      if (done == 0) first = bar_length(line);
      EXPECT_EQ(bar_length(line), first) << width << " at " << done << ": " << line;
      EXPECT_LE(static_cast<int>(line.size()), width - 3) << line;
    }
  }
}

// After Ctrl-C nothing new starts: no time left to estimate.
TEST(ProgressBar, AStoppingRunShowsNoEta) {
  ProgressCounters c = counters();
  c.stopping = true;
  Progress progress(nullptr, true, seconds{5}, 160);
  const std::string line = progress.render_bar(c, 10.0);
  EXPECT_EQ(line.find("eta"), std::string::npos) << line;
  EXPECT_NE(line.find("stopping"), std::string::npos) << line;
}

// Items waiting out a backoff or the retry budget are counted; once all that is left waits to be
// retried (or is in flight), the pace so far gives no ETA.
TEST(ProgressBar, ItemsWaitingToRetryAreCountedAndLeaveNoEta) {
  ProgressCounters c = counters();
  Progress progress(nullptr, true, seconds{5}, 160);
  EXPECT_EQ(progress.render_bar(c, 10.0).find("backoff"), std::string::npos);
  c.backing_off = 40;  // of 1199 left: the others still go at the pace so far
  std::string line = progress.render_bar(c, 10.0);
  EXPECT_NE(line.find("backoff 40"), std::string::npos) << line;
  EXPECT_NE(line.find("eta 2m00s"), std::string::npos) << line;
  c.done = 1319 - 20 - 96;  // 96 left: 90 backing off, 6 in flight
  c.backing_off = 90;
  c.in_flight = 6;
  line = progress.render_bar(c, 10.0);
  EXPECT_NE(line.find("backoff 90"), std::string::npos) << line;
  EXPECT_NE(line.find("eta --"), std::string::npos) << line;
  EXPECT_NE(progress.render_plain(c, 10.0).find(" failed 2 backoff 90"), std::string::npos) << progress.render_plain(c, 10.0);
  // At 80 columns it outranks the rates.
  Progress narrow(nullptr, true, seconds{5}, 80);
  line = narrow.render_bar(c, 10.0);
  EXPECT_NE(line.find("backoff 90"), std::string::npos) << line;
}

// While the API server cannot be connected to, the bar says so first and gives no ETA.
TEST(ProgressBar, NoConnectionIsShownAndLeavesNoEta) {
  ProgressCounters c = counters();
  c.backing_off = 8;
  c.no_connection = true;
  Progress progress(nullptr, true, seconds{5}, 160);
  const std::string line = progress.render_bar(c, 10.0);
  EXPECT_NE(line.find("no connection: backoff 8"), std::string::npos) << line;
  EXPECT_NE(line.find("eta --"), std::string::npos) << line;
  EXPECT_NE(progress.render_plain(c, 10.0).find(" no connection: backoff 8"), std::string::npos);
  c.backing_off = 0;
  EXPECT_NE(progress.render_bar(c, 10.0).find(" no connection"), std::string::npos);
}

// A terminal that reports no size: $COLUMNS, else 80.
TEST(ProgressBar, ColumnsFromTheEnvironmentWhereTheTerminalSaysNone) {
  ::setenv("COLUMNS", "50", 1);
  Progress progress(nullptr, true, seconds{5}, 0);
  EXPECT_LE(progress.render_bar(counters(), 10.0).size(), 47u);
  ::setenv("COLUMNS", "junk", 1);
  EXPECT_GT(progress.render_bar(counters(), 10.0).size(), 60u);
  ::unsetenv("COLUMNS");
}

TEST(ProgressBar, VeryNarrowTerminalKeepsTheCount) {
  Progress progress(nullptr, true, seconds{5}, 12);
  EXPECT_EQ(progress.render_bar(counters(), 10.0), "120/1319");
}

TEST(ProgressBar, EtaIsUnknownBeforeAnythingFinishes) {
  Progress progress(nullptr, true, seconds{5}, 160);
  ProgressCounters c = counters();
  c.done = 0;
  EXPECT_NE(progress.render_bar(c, 0.0).find("eta --"), std::string::npos);
  EXPECT_NE(progress.render_bar(c, 5.0).find("eta --"), std::string::npos);
}

TEST(ProgressBar, UnknownTotalShowsTheCountWithoutABar) {
  Progress progress(nullptr, true, seconds{5}, 160);
  ProgressCounters c = counters();
  c.total = 0;
  const std::string line = progress.render_bar(c, 10.0);
  EXPECT_EQ(line.rfind("120 ", 0), 0u) << line;
  EXPECT_EQ(line.find('['), std::string::npos) << line;
  EXPECT_EQ(line.find('%'), std::string::npos) << line;
}

TEST(ProgressBar, CompleteJobShowsAFullBar) {
  Progress progress(nullptr, true, seconds{5}, 100);
  ProgressCounters c = counters();
  c.done = c.total - c.resumed;
  c.in_flight = 0;
  const std::string line = progress.render_bar(c, 60.0);
  EXPECT_NE(line.find("1319/1319 100.0%"), std::string::npos) << line;
  const auto open = line.find('['), close = line.find(']');
  ASSERT_LT(open, close) << line;
  EXPECT_EQ(count(line.substr(open, close - open), "."), 0u) << line;
  EXPECT_NE(line.find("eta 0s"), std::string::npos) << line;
}

// --- Drawing ----------------------------------------------------------------------------

TEST(Progress, PlainModePrintsALineEveryInterval) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  const auto start = std::chrono::steady_clock::now();
  Progress progress(file, false, seconds{5});
  progress.update(counters(), start + seconds{1});
  progress.update(counters(), start + seconds{4});
  EXPECT_EQ(contents(file), "");
  progress.update(counters(), start + seconds{10});
  progress.update(counters(), start + seconds{11});
  const std::string text = contents(file);
  EXPECT_EQ(count(text, "\n"), 1u) << text;
  EXPECT_EQ(text, "[batchlm] 120/1319 (9.1%) 9.8 req/s 812 tok/s eta 2m00s in-flight 32 retries 3 failed 2\n");
  EXPECT_EQ(text.find('\r'), std::string::npos);
  EXPECT_EQ(text.find('\x1b'), std::string::npos);
  std::fclose(file);
}

TEST(Progress, PlainModeFinishPrintsTheFinalLine) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  const auto start = std::chrono::steady_clock::now();
  Progress progress(file, false, seconds{5});
  ProgressCounters c = counters();
  c.done = c.total - c.resumed;
  c.in_flight = 0;
  progress.finish(c, start + seconds{10});
  const std::string text = contents(file);
  EXPECT_EQ(text.rfind("[batchlm] 1319/1319 (100.0%)", 0), 0u) << text;
  EXPECT_EQ(text.back(), '\n');
  std::fclose(file);
}

TEST(Progress, TtyModeRedrawsInPlaceAtMostTenTimesASecond) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  const auto start = std::chrono::steady_clock::now();
  Progress progress(file, true, seconds{5}, 100);
  for (int ms = 0; ms < 1000; ms += 10) progress.update(counters(), start + milliseconds{ms});
  const std::string text = contents(file);
  EXPECT_EQ(count(text, "\r"), 10u);
  EXPECT_EQ(count(text, "\x1b[K"), 10u);
  EXPECT_EQ(text.find('\n'), std::string::npos);
  EXPECT_EQ(text.rfind("\r120/1319", 0), 0u);
  std::fclose(file);
}

TEST(Progress, TtyFinishEndsTheLine) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  const auto start = std::chrono::steady_clock::now();
  Progress progress(file, true, seconds{5}, 100);
  progress.update(counters(), start);
  progress.finish(counters(), start + milliseconds{10});  // drawn even right after an update
  const std::string text = contents(file);
  EXPECT_EQ(count(text, "\r"), 2u);
  EXPECT_EQ(text.substr(text.size() - 4), "\x1b[K\n");
  std::fclose(file);
}

// A terminal that re-wraps its lines on a resize (tmux, most graphical terminals) turns the
// last bar into several rows when it gets narrower, the cursor after them: the next draw goes
// back up to the first of those rows and clears from there, leaving no pieces of the old bar.
TEST(Progress, ShrunkTerminalThatRewrapsLosesTheWholeOldBar) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  const auto start = std::chrono::steady_clock::now();
  Progress progress(file, true, seconds{5}, 120, /*rewraps=*/true);
  progress.update(counters(), start);
  const std::size_t first = contents(file).size();
  const std::size_t length = progress.render_bar(counters(), 0.0).size();  // 117: 3 rows of 40
  ASSERT_GT(length, 80u);
  progress.resize(40);
  progress.update(counters(), start + milliseconds{200});
  const std::string redraw = contents(file).substr(first);
  EXPECT_EQ(redraw.rfind("\r\x1b[" + std::to_string((length - 1) / 40) + "A\x1b[J", 0), 0u) << redraw;
  // Drawn at the new width, the next redraw is in place again.
  const std::size_t second = contents(file).size();
  progress.update(counters(), start + milliseconds{400});
  EXPECT_EQ(contents(file).substr(second).rfind("\r120/1319", 0), 0u);
  std::fclose(file);
}

// Which terminals are taken to re-wrap, read from what they put in the environment; the
// innermost multiplexer decides. Anything not known to re-wrap is taken to cut lines, where a
// redraw in place at worst leaves pieces of the old bar (going up would erase output).
TEST(Progress, TerminalsThatRewrapAreKnownByTheirEnvironment) {
  const char* names[] = {"TMUX", "STY", "VTE_VERSION", "KITTY_WINDOW_ID", "WT_SESSION", "KONSOLE_VERSION",
                         "TERM_PROGRAM", "TERM"};
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  for (const char* name : names) {
    const char* value = std::getenv(name);
    saved.emplace_back(name, value ? std::optional<std::string>(value) : std::nullopt);
  }
  auto with = [&](std::vector<std::pair<const char*, const char*>> env) {
    for (const char* name : names) ::unsetenv(name);
    for (const auto& [name, value] : env) ::setenv(name, value, 1);
    return terminal_rewraps();
  };
  EXPECT_FALSE(with({}));
  EXPECT_FALSE(with({{"TERM", "xterm-256color"}}));  // xterm, or a terminal behind ssh
  EXPECT_TRUE(with({{"TERM", "xterm-256color"}, {"VTE_VERSION", "7600"}}));
  EXPECT_TRUE(with({{"TERM", "tmux-256color"}, {"TMUX", "/tmp/tmux-1000/default,1,0"}}));
  EXPECT_FALSE(with({{"TERM", "screen"}, {"STY", "1234.pts-0.host"}, {"VTE_VERSION", "7600"}}));
  EXPECT_TRUE(with({{"TERM", "xterm-ghostty"}}));
  EXPECT_TRUE(with({{"TERM", "xterm-256color"}, {"TERM_PROGRAM", "ghostty"}}));
  EXPECT_TRUE(with({{"TERM", "xterm-256color"}, {"TERM_PROGRAM", "Hyper"}}));
  EXPECT_TRUE(with({{"TERM", "xterm-256color"}, {"KONSOLE_VERSION", "230804"}}));
  EXPECT_TRUE(with({{"TERM", "xterm-256color"}, {"KONSOLE_VERSION", "210400"}}));
  EXPECT_FALSE(with({{"TERM", "xterm-256color"}, {"KONSOLE_VERSION", "201203"}}));  // before re-wrapping
  EXPECT_FALSE(with({{"TERM", "xterm-256color"}, {"KONSOLE_VERSION", "22x"}}));
  for (const auto& [name, value] : saved) {
    if (value)
      ::setenv(name.c_str(), value->c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
}

// Elsewhere (xterm cuts lines instead) going up would erase the user's own lines: in place.
TEST(Progress, ShrunkTerminalThatCutsLinesIsRedrawnInPlace) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  const auto start = std::chrono::steady_clock::now();
  Progress progress(file, true, seconds{5}, 120, /*rewraps=*/false);
  progress.update(counters(), start);
  const std::size_t first = contents(file).size();
  progress.resize(40);
  progress.update(counters(), start + milliseconds{200});
  EXPECT_EQ(contents(file).substr(first).rfind("\r120/1319", 0), 0u);
  std::fclose(file);
}

// A message while the bar shows takes the bar's place (no stale bar is left above it); the bar
// then starts anew below it (and a resize does not send it up over the message).
TEST(Progress, MessageTakesTheBarsPlace) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  const auto start = std::chrono::steady_clock::now();
  Progress progress(file, true, seconds{5}, 120, /*rewraps=*/true);
  progress.update(counters(), start);
  progress.message("batchlm: interrupted");
  const std::size_t before = contents(file).size();
  EXPECT_EQ(contents(file).substr(contents(file).size() - 25), "\r\x1b[Kbatchlm: interrupted\n");
  progress.resize(40);
  progress.update(counters(), start + milliseconds{200});
  EXPECT_EQ(contents(file).substr(before).rfind("\r120/1319", 0), 0u);
  // Without a bar on screen (plain lines), no empty line comes first.
  std::FILE* plain_file = std::tmpfile();
  Progress plain(plain_file, false, seconds{5});
  plain.message("batchlm: interrupted");
  EXPECT_EQ(contents(plain_file), "batchlm: interrupted\n");
  std::fclose(plain_file);
  std::fclose(file);
}

// --- Summary ----------------------------------------------------------------------------

TEST(Percentile, UsesNearestRank) {
  std::vector<double> values;
  for (int i = 100; i >= 1; --i) values.push_back(i);  // unsorted on purpose
  EXPECT_EQ(percentile(values, 50), 50);
  EXPECT_EQ(percentile(values, 90), 90);
  EXPECT_EQ(percentile(values, 99), 99);
  EXPECT_EQ(percentile(values, 100), 100);
  EXPECT_EQ(percentile(values, 0), 1);
  EXPECT_EQ(percentile({3, 1, 2}, 50), 2);
  EXPECT_EQ(percentile({10, 20, 30, 40}, 50), 20);
  EXPECT_EQ(percentile({10, 20, 30, 40}, 51), 30);
  EXPECT_EQ(percentile({7}, 99), 7);
  EXPECT_FALSE(percentile({}, 50).has_value());
}

ItemResult success(double ttft, double tpot, double total, json score) {
  ItemResult r;
  r.ok = true;
  r.ttft_ms = ttft;
  r.tpot_ms = tpot;
  r.total_ms = total;
  r.prompt_tokens = 100;
  r.completion_tokens = 20;
  r.attempts = 1;
  r.score = std::move(score);
  return r;
}

ItemResult failure(std::string kind, int status, int attempts) {
  ItemResult r;
  r.ok = false;
  r.error_kind = std::move(kind);
  r.http_status = status;
  r.attempts = attempts;
  // A failed item carries no score; one set by mistake must not count either.
  r.score = {{"strict", false}, {"flexible", false}};
  return r;
}

Summary known_summary() {
  Summary s;
  // Ten successes of this run with latencies 10..100 ms.
  for (int i = 1; i <= 10; ++i) {
    json score = {{"strict", i <= 6}, {"flexible", i <= 8}};
    if (i == 10) score = nullptr;  // not scored
    s.add(success(i * 10.0, i * 1.0, i * 100.0, score));
  }
  // Two resumed successes: they count for accuracy, not for latency or tokens.
  ItemResult resumed = success(9999, 9999, 9999, {{"strict", true}, {"flexible", true}});
  resumed.resumed = true;
  s.add(resumed);
  s.add(resumed);
  s.add(failure("http", 429, 6));
  s.add(failure("http", 429, 6));
  s.add(failure("timeout", 0, 3));
  return s;
}

TEST(Summary, CountsSucceededFailedResumedAndNotRun) {
  const json j = known_summary().to_json(10.0, 20);
  EXPECT_EQ(j["counts"]["total"], 20);
  EXPECT_EQ(j["counts"]["succeeded"], 12);
  EXPECT_EQ(j["counts"]["failed"], 3);
  EXPECT_EQ(j["counts"]["resumed"], 2);
  EXPECT_EQ(j["counts"]["not_run"], 5);
}

TEST(Summary, GroupsFailuresByKindAndStatus) {
  const json j = known_summary().to_json(10.0, 20);
  EXPECT_EQ(j["failures"], (json{{"http 429", 2}, {"timeout", 1}}));
  // The status names only HTTP errors: a stream cut short after its 200 is "truncated".
  Summary s;
  s.add(failure("truncated", 200, 2));
  s.add(failure("stream_error", 200, 1));
  s.add(failure("http", 500, 6));
  EXPECT_EQ(s.to_json(1.0, 3)["failures"], (json{{"truncated", 1}, {"stream_error", 1}, {"http 500", 1}}));
}

TEST(Summary, AccuracyCountsScoredItemsOnly) {
  const json j = known_summary().to_json(10.0, 20);
  // Scored: nine of this run plus two resumed; failures and the null score excluded.
  EXPECT_EQ(j["accuracy"]["strict"]["scored"], 11);
  EXPECT_EQ(j["accuracy"]["strict"]["correct"], 8);
  EXPECT_DOUBLE_EQ(j["accuracy"]["strict"]["accuracy"].get<double>(), 8.0 / 11.0);
  EXPECT_EQ(j["accuracy"]["flexible"]["correct"], 10);
  EXPECT_DOUBLE_EQ(j["accuracy"]["flexible"]["accuracy"].get<double>(), 10.0 / 11.0);
  // The text says how many of the job's items the accuracy leaves out.
  const std::string text = known_summary().to_text(10.0, 20);
  EXPECT_NE(text.find("accuracy: flexible 90.9% (10/11) strict 72.7% (8/11); 9 of 20 items not scored\n"),
            std::string::npos)
      << text;
  EXPECT_EQ(known_summary().to_text(10.0, 11).find("not scored"), std::string::npos);
}

TEST(Summary, LatencyPercentilesCoverThisRunsSuccesses) {
  const json j = known_summary().to_json(10.0, 20);
  EXPECT_EQ(j["latency_ms"]["ttft"], (json{{"p50", 50.0}, {"p90", 90.0}, {"p99", 100.0}}));
  EXPECT_EQ(j["latency_ms"]["tpot"], (json{{"p50", 5.0}, {"p90", 9.0}, {"p99", 10.0}}));
  EXPECT_EQ(j["latency_ms"]["e2e"], (json{{"p50", 500.0}, {"p90", 900.0}, {"p99", 1000.0}}));
}

TEST(Summary, TokensThroughputAndAttemptsDescribeThisRun) {
  const json j = known_summary().to_json(10.0, 20);
  EXPECT_EQ(j["tokens"]["prompt"], 1000);
  EXPECT_EQ(j["tokens"]["completion"], 200);
  EXPECT_DOUBLE_EQ(j["wall_seconds"].get<double>(), 10.0);
  // The 10 answers of this run in 10 s: neither the failures nor the resumed items.
  EXPECT_DOUBLE_EQ(j["throughput"]["requests_per_second"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(j["throughput"]["output_tokens_per_second"].get<double>(), 20.0);
  EXPECT_EQ(j["attempts"]["total"], 25);  // 10 + 6 + 6 + 3
  EXPECT_EQ(j["attempts"]["retries"], 12);
  // Requests sent for items the run did not finish count as attempts, their first ones not as
  // retries.
  Summary stopped = known_summary();
  stopped.add_unfinished_attempts(3);
  stopped.add_unfinished_attempts(1);
  stopped.add_unfinished_attempts(0);  // never sent: nothing
  EXPECT_EQ(stopped.to_json(10.0, 20)["attempts"], (json{{"total", 29}, {"retries", 14}}));
  // The output's records, the two resumed ones included.
  EXPECT_EQ(j["tokens_in_output"], (json{{"prompt", 1200}, {"completion", 240}}));
}

TEST(Summary, ARunWhoseItemsAllFailedAnsweredNothingASecond) {
  // 50 items refused at once used to read as 5,000 req/s.
  Summary s;
  for (int i = 0; i < 50; ++i) s.add(failure("http", 400, 1));
  const json j = s.to_json(0.01, 50);
  EXPECT_DOUBLE_EQ(j["throughput"]["requests_per_second"].get<double>(), 0.0);
  EXPECT_NE(s.to_text(0.01, 50).find("0.00 req/s"), std::string::npos);
}

TEST(Summary, EmptyRunHasNullPercentilesAndNoAccuracy) {
  const json j = Summary{}.to_json(0.0, 0);
  EXPECT_TRUE(j["latency_ms"]["ttft"]["p50"].is_null());
  EXPECT_TRUE(j["accuracy"].empty());
  EXPECT_TRUE(j["failures"].empty());
  EXPECT_DOUBLE_EQ(j["throughput"]["requests_per_second"].get<double>(), 0.0);
}

TEST(Summary, OneTokenAnswersHaveNoTimePerOutputToken) {
  Summary s;
  s.add(success(10, 0, 10, nullptr));
  s.add(success(10, 4, 50, nullptr));
  EXPECT_EQ(s.to_json(1.0, 2)["latency_ms"]["tpot"]["p50"], 4.0);
}

TEST(Summary, TextNamesTheFiguresThatMatter) {
  const std::string text = known_summary().to_text(92.0, 20);
  for (const char* part : {"20 items", "12 succeeded", "(2 resumed)", "3 failed", "5 not run", "1m32s",
                           "http 429: 2", "timeout: 1", "strict 72.7% (8/11)", "flexible 90.9% (10/11)",
                           "ttft 50/90/100", "tpot 5.0/9.0/10.0", "e2e 500/900/1000", "1000 in", "200 out"}) {
    EXPECT_NE(text.find(part), std::string::npos) << part << " missing in:\n" << text;
  }
  EXPECT_LE(count(text, "\n"), 6u);
}

TEST(Summary, TextSaysOneItemAndOneAttempt) {
  Summary s;
  s.add(success(10, 4, 50, nullptr));
  const std::string text = s.to_text(1.0, 1);
  EXPECT_EQ(text.rfind("1 item: 1 succeeded, 0 failed", 0), 0u) << text;
  EXPECT_NE(text.find("; 1 attempt\n"), std::string::npos) << text;
}

// The text counts the requests of items a stopped run did not finish, as the JSON does.
TEST(Summary, TextCountsTheAttemptsOfUnfinishedItems) {
  Summary s;
  s.add(success(10, 4, 50, nullptr));
  s.add_unfinished_attempts(2);
  EXPECT_EQ(s.to_json(1.0, 3)["attempts"]["total"], 3);
  const std::string text = s.to_text(1.0, 3);
  EXPECT_NE(text.find("; 3 attempts\n"), std::string::npos) << text;
}

// A string literal's bytes, NULs inside included.
template <std::size_t N>
std::string with_nul(const char (&literal)[N]) {
  return std::string(literal, N - 1);
}

// A failure's message is the server's text. The terminal gets its escape sequences, control
// characters and NUL bytes as \xNN, the line whole; the JSON keeps the message as it was.
TEST(Summary, TextShowsAFailureMessagesControlBytesEscaped) {
  Summary s;
  ItemResult r = failure("http", 500, 1);
  r.error_message = with_nul("\x1b[2J\x1b[31mRED\x07 bell\rCR\0after NUL \xc2\x9b");
  s.add(r);
  const std::string text = s.to_text(1.0, 1);
  EXPECT_NE(text.find("failures: http 500: 1 (\\x1b[2J\\x1b[31mRED\\x07 bell\\x0dCR\\x00after NUL \\xc2\\x9b)\n"),
            std::string::npos)
      << text;
  for (const char c : text) EXPECT_TRUE(c == '\n' || static_cast<unsigned char>(c) >= 0x20) << text;
  EXPECT_EQ(s.to_json(1.0, 1)["failure_examples"]["http 500"], r.error_message);
}

// A long message is cut between characters, never through one: the summary file could not
// hold the bytes a cut left (JSON is UTF-8), and the terminal would show them as \xNN.
TEST(Summary, ALongFailureMessageIsCutBetweenCharacters) {
  Summary s;
  ItemResult r = failure("http", 500, 1);
  r.error_message = std::string(116, 'a') + "\xc3\xa9" + std::string(20, 'b');  // é across byte 117
  s.add(r);
  const json j = s.to_json(1.0, 1);
  EXPECT_EQ(j["failure_examples"]["http 500"], std::string(116, 'a') + "...");
  EXPECT_NO_THROW((void)j.dump());
  EXPECT_NE(s.to_text(1.0, 1).find("(" + std::string(116, 'a') + "...)\n"), std::string::npos);
}

// Messages may carry a server's text (why the run stops): they reach the terminal as one line
// of text.
TEST(Progress, MessageShowsControlBytesEscaped) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  Progress progress(file, false, seconds{5});
  progress.message(with_nul("stopped: bad key \x1b]0;owned\x07\0 and more"));
  EXPECT_EQ(contents(file), "stopped: bad key \\x1b]0;owned\\x07\\x00 and more\n");
  std::fclose(file);
}

}  // namespace
}  // namespace batchlm::runner
