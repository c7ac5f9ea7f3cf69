// The `batchlm` executable end to end against the fake OpenAI server: a GSM8K slice killed
// with SIGKILL and resumed, transient faults retried, permanent ones recorded and retried on
// rerun, SIGINT, the output lock, dry runs, configuration errors, the built-in synth recipe.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <set>
#include <sstream>

#include "gguf_writer.hpp"
#include "harness.hpp"

namespace batchlm::e2e {
namespace {

struct JobParams {
  std::string base_url;
  int limit = 60;
  int concurrency = 8;
  int max_attempts = 4;
  std::string extra;  // more YAML lines
};

std::string gsm8k_job(const JobParams& p) {
  return "name: e2e\n"
         "kind: eval\n"
         "input: " + gsm8k_test_file() + "\n"
         "request:\n"
         "  messages:\n"
         "    - {role: system, content: \"Solve the problem. End with '#### <number>'.\"}\n"
         "    - {role: user, content: \"{{question}}\"}\n"
         "  max_tokens: 64\n"
         "  temperature: 0\n"
         "backend: {type: openai, base_url: \"" + p.base_url + "\", model: fake-model}\n"
         "concurrency: " + std::to_string(p.concurrency) + "\n"
         "retry: {max_attempts: " + std::to_string(p.max_attempts) + ", base: 10ms, cap: 100ms}\n"
         "output: {path: out/e2e.jsonl, flush_every: 4, flush_interval: 100ms}\n"
         "scoring: gsm8k\n"
         "limit: " + std::to_string(p.limit) + "\n" + p.extra;
}

// ids 1..n each exactly once, every record successful.
void expect_each_id_once(const std::vector<json>& records, int n) {
  std::map<long long, int> seen;
  for (const auto& r : records) {
    ASSERT_TRUE(r.contains("id"));
    ++seen[r["id"].get<long long>()];
    EXPECT_TRUE(r["error"].is_null()) << r.dump();
  }
  EXPECT_EQ(seen.size(), static_cast<std::size_t>(n));
  for (const auto& [id, count] : seen) {
    EXPECT_GE(id, 1);
    EXPECT_LE(id, n);
    EXPECT_EQ(count, 1) << "id " << id << " appears " << count << " times";
  }
}

// Questions whose line number is divisible by 5 are answered wrong by the fake server.
int expected_correct(int n) { return n - n / 5; }

int count_strict_correct(const std::vector<json>& records) {
  int correct = 0;
  for (const auto& r : records)
    if (r["score"].is_object() && r["score"]["strict"].get<bool>()) ++correct;
  return correct;
}

// A server that reports no usage: the counts are estimates, said to be, and never below a
// token per four bytes of the answer (a whole answer in one piece counted 1).
TEST(BatchlmRun, UsageTheServerDoesNotReportIsEstimatedFromTheAnswer) {
  for (const std::string faults : {"no_usage", "no_usage;ignore_stream"}) {
    SCOPED_TRACE(faults);
    TempDir dir;
    FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--faults", faults, "--fault-rate", "1"});
    write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 4}));
    RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    for (const auto& rec : read_jsonl(dir.path / "out/e2e.jsonl")) {
      EXPECT_EQ(rec["usage"]["estimated"], true) << rec.dump();
      const auto bytes = static_cast<long long>(rec["output"].get<std::string>().size());
      EXPECT_GE(rec["usage"]["completion_tokens"].get<long long>(), (bytes + 3) / 4) << rec.dump();
      EXPECT_GT(rec["usage"]["prompt_tokens"].get<long long>(), 0) << rec.dump();
    }
  }
}

// A Batch-API line with an image reaches the API as written, over HTTP: its content parts and
// its message's other keys; the record keeps the answer under the line's custom_id.
TEST(BatchlmRun, ABatchLineWithAnImageReachesTheApiAsWritten) {
  TempDir dir;
  FakeServer server(dir.path);
  const std::string message =
      R"({"role":"user","content":[{"type":"text","text":"What is in the picture?","cache_control":{"type":"ephemeral"}},)"
      R"({"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgoAAAANSUhEUg==","detail":"low"}}],"prefix":false})";
  write_file(dir.path / "in.jsonl",
             R"({"custom_id":"pic-1","method":"POST","url":"/v1/chat/completions","body":{"messages":[)" + message + "]}}\n");
  write_file(dir.path / "job.yaml", "input: in.jsonl\nbackend: {base_url: \"" + server.base_url() +
                                        "\", model: fake-model}\noutput: out.jsonl\n");
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json sent = json::parse(server.stats()["last_body"].get<std::string>());
  EXPECT_EQ(sent["messages"][0], json::parse(message)) << sent.dump();
  const auto records = read_jsonl(dir.path / "out.jsonl");
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0]["id"], "pic-1");
  EXPECT_TRUE(records[0]["error"].is_null()) << records[0].dump();
}

TEST(BatchlmRun, Gsm8kSliceScoresEveryItemOnce) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--wrong-every", "5"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 40}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto records = read_jsonl(dir.path / "out/e2e.jsonl");
  expect_each_id_once(records, 40);
  EXPECT_EQ(count_strict_correct(records), expected_correct(40));
  for (const auto& rec : records) {
    EXPECT_EQ(rec["finish_reason"], "stop");
    EXPECT_GT(rec["usage"]["completion_tokens"].get<long long>(), 0);
    EXPECT_GE(rec["timings"]["ttft_ms"].get<double>(), 0.0);
    EXPECT_EQ(rec["attempts"], 1);
    EXPECT_TRUE(rec["input"].contains("question"));
  }
  json summary = json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"));
  EXPECT_EQ(summary["accuracy"]["strict"]["correct"], expected_correct(40)) << summary.dump(2);
  EXPECT_EQ(summary["accuracy"]["strict"]["scored"], 40) << summary.dump(2);
  EXPECT_EQ(summary["counts"]["succeeded"], 40) << summary.dump(2);
  EXPECT_NE(r.err.find("strict 80.0% (32/40)"), std::string::npos) << r.err;
}

TEST(BatchlmRun, SurvivesSigkillAndResumesWithoutLossOrDuplicates) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--wrong-every", "5", "--tokens", "30",
                               "--token-delay-ms", "4"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 80}));
  const fs::path out = dir.path / "out/e2e.jsonl";
  {
    Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {}, .cwd = dir.path,
               .out_file = dir.path / "run1.out", .err_file = dir.path / "run1.err"});
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (std::chrono::steady_clock::now() < deadline && (!fs::exists(out) || count_lines(out) < 20))
      std::this_thread::sleep_for(5ms);
    p.signal(SIGKILL);
    ASSERT_EQ(p.wait(10s), 128 + SIGKILL);
  }
  const std::size_t before = count_lines(out);
  ASSERT_GE(before, 20u);
  ASSERT_LT(before, 80u) << "the run finished before it could be killed";
  // Simulate a write torn by the kill, on top of whatever the kill left.
  { std::ofstream f(out, std::ios::app); f << "{\"id\": 999, \"outp"; }

  // A rerun under other settings is refused and names the change, though the killed run left
  // no summary: its settings are in the lock file. The output is left as it was.
  ASSERT_FALSE(fs::exists(dir.path / "out/e2e.jsonl.summary.json"));
  const std::string killed = read_file(out);
  RunResult other = run_batchlm(dir.path, {"run", "job.yaml", "--set", "request.temperature=0.5"});
  EXPECT_EQ(other.exit_code, 2) << other.err;
  EXPECT_NE(other.err.find("made with other settings than this job's (request.temperature: 0.0 -> 0.5)"),
            std::string::npos)
      << other.err;
  EXPECT_EQ(read_file(out), killed);

  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("resum"), std::string::npos) << r.err;
  auto records = read_jsonl(out);
  expect_each_id_once(records, 80);
  EXPECT_EQ(count_strict_correct(records), expected_correct(80));
  // The items finished before the kill were not asked again.
  json stats = server.stats();
  EXPECT_LT(stats["requests"].get<long long>(), 80 + 8 + 8) << stats.dump();
}

TEST(BatchlmRun, RetriesTransientFaultsToSuccess) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--fault-rate", "1", "--faults",
                               "status=500,status=429;retry_after=0,status=503,reset_after=2,truncate",
                               "--fault-first-attempts", "1", "--seed", "7"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 20}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto records = read_jsonl(dir.path / "out/e2e.jsonl");
  expect_each_id_once(records, 20);
  for (const auto& rec : records) EXPECT_EQ(rec["attempts"], 2) << rec.dump();
  EXPECT_EQ(server.stats()["requests"].get<long long>(), 40);
}

TEST(BatchlmRun, RecordsPermanentFailuresAndRetriesThemOnRerun) {
  TempDir dir;
  {
    FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--fault-rate", "1", "--faults",
                                 "status=400", "--fault-first-attempts", "1"});
    write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 10}));
    RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
    ASSERT_EQ(r.exit_code, 1) << r.err;
    auto records = read_jsonl(dir.path / "out/e2e.jsonl");
    ASSERT_EQ(records.size(), 10u);
    for (const auto& rec : records) {
      EXPECT_EQ(rec["attempts"], 1);
      ASSERT_TRUE(rec["error"].is_object()) << rec.dump();
      EXPECT_EQ(rec["error"]["kind"], "http");
      EXPECT_EQ(rec["error"]["status"], 400);
      EXPECT_TRUE(rec["score"].is_null());
    }
    // The same server now answers (only first attempts fail): a rerun retries every item.
    RunResult again = run_batchlm(dir.path, {"run", "job.yaml"});
    ASSERT_EQ(again.exit_code, 0) << again.err;
    expect_each_id_once(read_jsonl(dir.path / "out/e2e.jsonl"), 10);
  }
}

// An API that refuses the client (a wrong key) refuses every item: after ten refusals in a row
// the run sends nothing more, says why, and leaves the rest for the run after the fix.
TEST(BatchlmRun, StopsSendingWhenTheApiRefusesEveryRequest) {
  TempDir dir;
  {
    FakeServer refusing(dir.path, {"--gsm8k", gsm8k_test_file(), "--fault-rate", "1", "--faults",
                                   "status=401;code=invalid_api_key;message=Incorrect API key provided"});
    write_file(dir.path / "job.yaml", gsm8k_job({.base_url = refusing.base_url(), .limit = 200, .concurrency = 4}));
    RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_NE(r.err.find("the API refused the last 10 requests (HTTP 401 invalid_api_key: Incorrect API key"),
              std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find("items were left for the next run"), std::string::npos) << r.err;
    const long long sent = refusing.stats()["requests"].get<long long>();
    EXPECT_GE(sent, 10);
    EXPECT_LE(sent, 10 + 4);
    EXPECT_EQ(read_jsonl(dir.path / "out/e2e.jsonl").size(), static_cast<std::size_t>(sent));
    const json summary = json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"));
    EXPECT_EQ(summary["counts"]["not_run"].get<long long>(), 200 - sent) << summary.dump(2);
    // Why, for a script that reads the summary.
    EXPECT_EQ(summary["stopped"]["reason"].get<std::string>().rfind("the API refused the last 10 requests (HTTP 401", 0),
              0u)
        << summary.dump(2);
    EXPECT_FALSE(summary["stopped"]["advice"].get<std::string>().empty());
  }
  FakeServer answering(dir.path, {"--gsm8k", gsm8k_test_file()});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = answering.base_url(), .limit = 200, .concurrency = 4}));
  RunResult again = run_batchlm(dir.path, {"run", "job.yaml"});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  expect_each_id_once(read_jsonl(dir.path / "out/e2e.jsonl"), 200);
}

// A resume that stops early (here an API that refuses the client) never comes to the items after
// the stop; the records the output holds for them from before count all the same: in the
// summary, its accuracy and the final line, as a finished run counts them.
TEST(BatchlmRun, AResumeThatStopsEarlyCountsEveryEarlierRecord) {
  TempDir dir;
  {
    FakeServer answering(dir.path, {"--gsm8k", gsm8k_test_file()});
    write_file(dir.path / "job.yaml", gsm8k_job({.base_url = answering.base_url(), .limit = 60, .concurrency = 4}));
    ASSERT_EQ(run_batchlm(dir.path, {"run", "job.yaml"}).exit_code, 0);
  }
  // The first 20 items' records gone: the run starts with them, and stops before it comes to
  // the 40 others.
  std::string kept;
  for (const json& record : read_jsonl(dir.path / "out/e2e.jsonl"))
    if (record["id"].get<long long>() > 20) kept += record.dump() + "\n";
  write_file(dir.path / "out/e2e.jsonl", kept);
  FakeServer refusing(dir.path, {"--gsm8k", gsm8k_test_file(), "--fault-rate", "1", "--faults",
                                 "status=401;code=invalid_api_key;message=Incorrect API key provided"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = refusing.base_url(), .limit = 60, .concurrency = 2}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  const long long sent = refusing.stats()["requests"].get<long long>();
  ASSERT_GE(sent, 10);
  ASSERT_LE(sent, 12);
  const json summary = json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"));
  EXPECT_EQ(summary["counts"]["resumed"], 40) << summary.dump(2);
  EXPECT_EQ(summary["counts"]["succeeded"], 40) << summary.dump(2);
  EXPECT_EQ(summary["counts"]["failed"].get<long long>() + summary["counts"]["not_run"].get<long long>(), 20)
      << summary.dump(2);
  EXPECT_NE(r.err.find("60 items: 40 succeeded (40 resumed)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("resuming out/e2e.jsonl: 40 done, 0 failed to retry\n"), std::string::npos) << r.err;
  // Their scores count, as the records hold them.
  EXPECT_EQ(summary["accuracy"]["strict"]["scored"], 40) << summary.dump(2);
  EXPECT_EQ(summary["accuracy"]["strict"]["correct"], 40) << summary.dump(2);
  EXPECT_EQ(summary["accuracy"]["flexible"]["scored"], 40) << summary.dump(2);
  EXPECT_EQ(summary["tokens_in_output"]["completion"].get<long long>() > 0, true) << summary.dump(2);
  EXPECT_EQ(r.err.find("not among this run's"), std::string::npos) << r.err;
  EXPECT_FALSE(summary.contains("earlier_records_outside_the_job")) << summary.dump(2);
  // A lower limit leaves records outside the job: said in the summary as on the console.
  FakeServer answering(dir.path, {"--gsm8k", gsm8k_test_file()});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = answering.base_url(), .limit = 30, .concurrency = 2}));
  r = run_batchlm(dir.path, {"run", "job.yaml"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("note: 30 earlier records in the output are not among this run's 30 items"), std::string::npos)
      << r.err;
  // The resume line counts as done only this run's items (ids 21 to 30), as the summary does.
  EXPECT_NE(r.err.find("resuming out/e2e.jsonl: 10 done (and 30 records of items outside this run, kept), "),
            std::string::npos)
      << r.err;
  EXPECT_EQ(json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"))["earlier_records_outside_the_job"], 30);
}

// A file of the user's at PATH.tmp, where a resume's rewrite goes, is never overwritten: the
// run and its dry run refuse, sending nothing; a rewrite a killed run left there is taken over.
TEST(BatchlmRun, AFileAtTheRewritesPathIsNotOverwritten) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--fault-rate", "0.5", "--faults", "status=500", "--seed", "3"});
  write_file(dir.path / "job.yaml",
             gsm8k_job({.base_url = server.base_url(), .limit = 20, .concurrency = 2, .max_attempts = 1}));
  ASSERT_EQ(run_batchlm(dir.path, {"run", "job.yaml"}).exit_code, 1);
  const std::size_t records = read_jsonl(dir.path / "out/e2e.jsonl").size();
  ASSERT_EQ(records, 20u);
  write_file(dir.path / "out/e2e.jsonl.tmp", "my notes\n");
  for (const bool dry : {true, false}) {
    std::vector<std::string> args = {"run", "job.yaml"};
    if (dry) args.push_back("--dry-run");
    RunResult r = run_batchlm(dir.path, args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find("e2e.jsonl.tmp exists and holds other things than records; it is where a resume rewrites "
                         "the output, and batchlm never deletes what it did not write: move it away, then run again"),
              std::string::npos)
        << r.err;
  }
  EXPECT_EQ(read_file(dir.path / "out/e2e.jsonl.tmp"), "my notes\n");
  EXPECT_EQ(read_jsonl(dir.path / "out/e2e.jsonl").size(), records);
  // With nothing to rewrite (--fresh replaces the output), it is left alone and not in the way.
  RunResult fresh = run_batchlm(dir.path, {"run", "job.yaml", "--dry-run", "--fresh"});
  EXPECT_EQ(fresh.exit_code, 0) << fresh.err;
  // Records there are a rewrite a killed run left: replaced.
  write_file(dir.path / "out/e2e.jsonl.tmp", read_jsonl(dir.path / "out/e2e.jsonl").front().dump() + "\n{\"id\": 3, \"inp");
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  EXPECT_TRUE(r.exit_code == 0 || r.exit_code == 1) << r.exit_code << ": " << r.err;  // ran: some may fail again
  EXPECT_FALSE(fs::exists(dir.path / "out/e2e.jsonl.tmp"));
}

// The dry run shows and counts what the run would send: items finished in the output are left
// out, as the resume skips them (failed ones are redone); --fresh counts them all again.
TEST(BatchlmRun, DryRunLeavesOutTheItemsTheOutputHoldsFinished) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file()});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 10}));
  ASSERT_EQ(run_batchlm(dir.path, {"run", "job.yaml"}).exit_code, 0);
  RunResult all_done = run_batchlm(dir.path, {"run", "job.yaml", "--dry-run"});
  EXPECT_EQ(all_done.exit_code, 0) << all_done.err;
  EXPECT_NE(all_done.out.find("10 items (10 finished in the output, 0 to send)"), std::string::npos) << all_done.out;
  EXPECT_NE(all_done.out.find("nothing to send: every item is finished in the output"), std::string::npos) << all_done.out;
  EXPECT_EQ(all_done.out.find("--- item"), std::string::npos) << all_done.out;
  // Ids 1-4 gone, 5 failed: five to send, the first shown is 1.
  std::string kept;
  for (json record : read_jsonl(dir.path / "out/e2e.jsonl")) {
    const long long id = record["id"];
    if (id <= 4) continue;
    if (id == 5) record["error"] = {{"kind", "http"}, {"status", 500}, {"message", "boom"}};
    kept += record.dump() + "\n";
  }
  write_file(dir.path / "out/e2e.jsonl", kept);
  RunResult some = run_batchlm(dir.path, {"run", "job.yaml", "--dry-run"});
  EXPECT_EQ(some.exit_code, 0) << some.err;
  EXPECT_NE(some.out.find("10 items (5 finished in the output, 5 to send)"), std::string::npos) << some.out;
  EXPECT_NE(some.out.find("--- item 1: POST"), std::string::npos) << some.out;
  EXPECT_EQ(some.out.find("--- item 6:"), std::string::npos) << some.out;
  RunResult fresh = run_batchlm(dir.path, {"run", "job.yaml", "--dry-run", "--fresh"});
  EXPECT_NE(fresh.out.find("job 'e2e' is valid; 10 items to "), std::string::npos) << fresh.out;
}

// The dry run refuses a resume the run would refuse: results made under other settings.
TEST(BatchlmRun, DryRunRefusesEarlierResultsOfOtherSettings) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file()});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 5}));
  ASSERT_EQ(run_batchlm(dir.path, {"run", "job.yaml"}).exit_code, 0);
  const long long sent = server.stats()["requests"].get<long long>();
  for (const bool dry : {true, false}) {
    std::vector<std::string> args = {"run", "job.yaml", "--set", "request.temperature=0.5"};
    if (dry) args.push_back("--dry-run");
    RunResult r = run_batchlm(dir.path, args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find("5 earlier results were made with other settings than this job's (request.temperature: "),
              std::string::npos)
        << r.err;
  }
  RunResult fresh = run_batchlm(dir.path, {"run", "job.yaml", "--set", "request.temperature=0.5", "--dry-run", "--fresh"});
  EXPECT_EQ(fresh.exit_code, 0) << fresh.err;
  EXPECT_EQ(server.stats()["requests"].get<long long>(), sent);
}

// A base URL without /v1 gets 404 for every item: the run stops after ten and says what to fix.
TEST(BatchlmRun, StopsOnEveryRequestNotFoundAndSuggestsV1) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file()});
  std::string url = server.base_url();
  url.resize(url.size() - 3);  // without "/v1"
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = url, .limit = 100, .concurrency = 2}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("OpenAI-compatible APIs are served under /v1: set the base URL to " + url + "/v1, then run"),
            std::string::npos)
      << r.err;
  EXPECT_LE(read_jsonl(dir.path / "out/e2e.jsonl").size(), 12u);
  // A base URL's query stays after the path the advice adds.
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = url + "?api-version=1", .limit = 100, .concurrency = 2}));
  r = run_batchlm(dir.path, {"run", "job.yaml", "--fresh"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("set the base URL to " + url + "/v1?api-version=1, then run"), std::string::npos) << r.err;
  // An endpoint's URL given as the base URL: the advice takes the endpoint off.
  write_file(dir.path / "job.yaml",
             gsm8k_job({.base_url = server.base_url() + "/chat/completions", .limit = 100, .concurrency = 2}));
  r = run_batchlm(dir.path, {"run", "job.yaml", "--fresh"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("The base URL is the API's root, which the client adds /chat/completions to: set it to " +
                       server.base_url() + ", then run"),
            std::string::npos)
      << r.err;
  // With no path left, the root is under /v1.
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = url + "/chat/completions", .limit = 100, .concurrency = 2}));
  r = run_batchlm(dir.path, {"run", "job.yaml", "--fresh"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("which the client adds /chat/completions to: set it to " + url + "/v1, then run"), std::string::npos)
      << r.err;
}

// A URL's scheme is case-insensitive: HTTP:// is http://.
TEST(BatchlmRun, TakesAnUpperCaseScheme) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file()});
  std::string url = server.base_url();
  url.replace(0, 4, "HTTP");
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = url, .limit = 3}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(read_jsonl(dir.path / "out/e2e.jsonl").size(), 3u);
  EXPECT_EQ(server.stats()["requests"].get<long long>(), 3);
}

// No TLS connection can be made (here https:// to a plain HTTP server; an untrusted, expired or
// misnamed certificate alike): every item meets it, so the run stops after ten attempts, says
// what failed and what to do, rather than spending every item's attempts on it.
TEST(BatchlmRun, StopsWhenNoTlsConnectionCanBeMade) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file()});
  std::string url = server.base_url();
  url.replace(0, 4, "https");
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = url, .limit = 100, .concurrency = 8}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("stopped: cannot make a TLS connection to " + url + " ("), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("if the server speaks plain HTTP, the base URL starts with http://"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("Fix the base URL, or have the server's certificate trusted"), std::string::npos) << r.err;
  const json summary = json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"));
  EXPECT_GE(summary["counts"]["not_run"].get<long long>(), 80) << summary.dump(2);
}

// A run of 60 questions (concurrency 4) at `url`, during which the server is killed (kill -9)
// once 8 records are written and started again on its port 3 s later; `server` is the new one
// then. The run's exit status (none if it did not end within 2 minutes) and its stderr.
struct RunAcrossARestart {
  std::optional<int> code;
  std::string err;
};
RunAcrossARestart run_across_a_restart(const fs::path& dir, std::unique_ptr<FakeServer>& server,
                                       const std::vector<std::string>& args, const std::string& url) {
  const int port = server->port();
  write_file(dir / "job.yaml", gsm8k_job({.base_url = url, .limit = 60, .concurrency = 4}));
  const fs::path out = dir / "out/e2e.jsonl";
  Process run({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {{"OPENAI_API_KEY", ""}, {"BATCHLM_MODEL", ""}},
               .cwd = dir, .out_file = dir / "run.out", .err_file = dir / "run.err"});
  if (!wait_until([&] { return fs::exists(out) && count_lines(out) >= 8; }, 60s))
    return {std::nullopt, "fewer than 8 records after 60 s\n" + read_file(dir / "run.err")};
  server->kill();
  std::this_thread::sleep_for(3s);
  std::vector<std::string> again = args;
  again.insert(again.end(), {"--port", std::to_string(port)});
  server = std::make_unique<FakeServer>(dir, again);
  const std::optional<int> code = run.wait(120s);
  return {code, read_file(dir / "run.err")};
}

// The server dies (kill -9) in the middle of a run and comes back 3 s later on its port: the
// items wait for it without spending their attempts (max_attempts 4, 10-100 ms backoffs, which
// would fail them within half a second), and the run ends with every item answered once.
TEST(BatchlmRun, WaitsForAServerThatRestartsWithoutSpendingAttempts) {
  TempDir dir;
  const std::vector<std::string> args = {"--gsm8k", gsm8k_test_file(), "--tokens", "20", "--token-delay-ms", "12"};
  auto server = std::make_unique<FakeServer>(dir.path, args);
  const fs::path out = dir.path / "out/e2e.jsonl";
  const auto [code, err] = run_across_a_restart(dir.path, server, args, server->base_url());
  ASSERT_EQ(code, 0) << err;
  EXPECT_NE(err.find("batchlm: cannot connect to " + server->base_url() + " ("), std::string::npos) << err;
  EXPECT_NE(err.find("the items wait for it up to 5m00s (retry.reconnect_for), without spending their attempts"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("batchlm: " + server->base_url() + " answers again after "), std::string::npos) << err;
  const auto records = read_jsonl(out);
  expect_each_id_once(records, 60);
  // The attempts that found no server are not counted: those cut by the kill were retried once.
  for (const auto& r : records) EXPECT_LE(r["attempts"].get<int>(), 2) << r.dump();
  // Nor does the progress count them as retries: its last line agrees with the summary.
  const json summary = json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"));
  const std::size_t last = err.rfind("[batchlm] 60/60");
  ASSERT_NE(last, std::string::npos) << err;
  const std::string line = err.substr(last, err.find('\n', last) - last);
  EXPECT_NE(line.find(" retries " + std::to_string(summary["attempts"]["retries"].get<long long>()) + " "),
            std::string::npos)
      << line << "\n" << summary["attempts"].dump();
}

// The same behind a gateway (tests/e2e/gateway.py), which the run reaches all along: while the
// server is gone it answers 502, as a reverse proxy does, or takes each connection and closes it
// without a word, as a container's published port does. The items wait for the server as for a
// refused connection (max_attempts 4 with 10-100 ms backoffs would fail them within half a
// second); only the attempts met before two items had seen it are counted.
class BehindAGateway : public ::testing::TestWithParam<std::string> {};

// tests/e2e/gateway.py in front of the server on `upstream_port`, in `mode` (502 or drop).
class Gateway {
 public:
  Gateway(const fs::path& dir, int upstream_port, const std::string& mode)
      : process_({.args = {"/usr/bin/python3", (fs::path(BATCHLM_SOURCE_DIR) / "tests/e2e/gateway.py").string(),
                           "--upstream-port", std::to_string(upstream_port), "--mode", mode, "--port-file",
                           (dir / "gateway.port").string()},
                  .env = {}, .cwd = dir, .out_file = dir / "gateway.out", .err_file = dir / "gateway.err"}) {
    if (!wait_until([&] { return fs::exists(dir / "gateway.port"); }, 20s))
      throw std::runtime_error("gateway.py did not start: " + read_file(dir / "gateway.err"));
    port_ = std::stoi(read_file(dir / "gateway.port"));
  }
  std::string base_url() const { return "http://127.0.0.1:" + std::to_string(port_) + "/v1"; }

 private:
  Process process_;
  int port_ = 0;
};

TEST_P(BehindAGateway, WaitsForAServerThatRestartsWithoutSpendingAttempts) {
  TempDir dir;
  const std::vector<std::string> args = {"--gsm8k", gsm8k_test_file(), "--tokens", "20", "--token-delay-ms", "12"};
  auto server = std::make_unique<FakeServer>(dir.path, args);
  const Gateway gateway(dir.path, server->port(), GetParam());
  const std::string url = gateway.base_url();
  const fs::path out = dir.path / "out/e2e.jsonl";
  const auto [code, err] = run_across_a_restart(dir.path, server, args, url);
  ASSERT_EQ(code, 0) << err;
  EXPECT_NE(err.find("batchlm: no server answers behind " + url + " ("), std::string::npos) << err;
  if (GetParam() == "502") {
    EXPECT_NE(err.find("(502 Bad Gateway (an HTML page))"), std::string::npos) << err;
  }
  EXPECT_NE(err.find("the items wait for it up to 5m00s (retry.reconnect_for), without spending their attempts"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("batchlm: " + url + " answers again after "), std::string::npos) << err;
  const auto records = read_jsonl(out);
  expect_each_id_once(records, 60);
  // An attempt cut by the kill, one met before the wait began, the answer.
  for (const auto& r : records) EXPECT_LE(r["attempts"].get<int>(), 3) << r.dump();
}

// No server behind the gateway from the start: as for a server that cannot be reached, once ten
// attempts in a row over 5 s met the gateway's word for it, with no success before, the run stops
// sending and says so.
TEST_P(BehindAGateway, StopsWhenNoServerAnswersBehindItFromTheStart) {
  TempDir dir;
  int port = 0;
  {  // a port nothing listens on, for now
    FakeServer gone(dir.path);
    port = gone.port();
  }
  const Gateway gateway(dir.path, port, GetParam());
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = gateway.base_url(), .limit = 100, .concurrency = 8}));
  const auto start = std::chrono::steady_clock::now();
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("stopped: no server answers behind " + gateway.base_url() + " ("), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("Start the server behind it, or fix the base URL"), std::string::npos) << r.err;
  EXPECT_GE(took, 5s);
  const json summary = json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"));
  EXPECT_EQ(summary["counts"]["succeeded"], 0) << summary.dump(2);
  EXPECT_GE(summary["counts"]["not_run"].get<long long>(), 50) << summary.dump(2);
}

INSTANTIATE_TEST_SUITE_P(Modes, BehindAGateway, ::testing::Values("502", "drop"));

// A CDN's word for an origin that is down or silent (Cloudflare's 520 to 524) is a gateway's:
// from the start, the run stops and says so. A 503 is not: a server sends it itself when
// overloaded, so its items spend their attempts.
TEST(BatchlmRun, ACdnsWordForAnOriginGoneStopsTheRunAsAGatewaysDoes) {
  TempDir dir;
  {
    FakeServer server(dir.path, {"--fault-rate", "1", "--faults", "status=520,status=521,status=522,status=523,status=524"});
    write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 40, .concurrency = 4}));
    RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_NE(r.err.find("stopped: no server answers behind " + server.base_url() + " ("), std::string::npos) << r.err;
  }
  {
    FakeServer server(dir.path, {"--fault-rate", "1", "--faults", "status=503"});
    write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 6, .concurrency = 2,
                                                 .max_attempts = 2}));
    RunResult r = run_batchlm(dir.path, {"run", "job.yaml", "-o", "out/503.jsonl"});
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_EQ(r.err.find("no server answers behind"), std::string::npos) << r.err;
    const auto records = read_jsonl(dir.path / "out/503.jsonl");
    ASSERT_EQ(records.size(), 6u) << r.err;
    for (const auto& rec : records) EXPECT_EQ(rec["error"]["status"], 503) << rec.dump();
  }
}

// One item that meets a 502 on every attempt while the others are answered (a request the
// server behind the gateway fails on) is a failure as any other: it spends its attempts and
// fails, and the run does not wait on it.
TEST(BatchlmRun, A502ForOneItemWhileOthersAreAnsweredSpendsItsAttempts) {
  TempDir dir;
  std::ifstream input(gsm8k_test_file());
  std::string line;
  for (int i = 0; i < 5; ++i) std::getline(input, line);
  const std::string question = json::parse(line)["question"].get<std::string>().substr(0, 40);
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--tokens", "20", "--token-delay-ms", "5",
                               "--fault-rate", "1", "--faults", "status=502", "--fault-item", question});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 30, .concurrency = 4}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  const auto records = read_jsonl(dir.path / "out/e2e.jsonl");
  ASSERT_EQ(records.size(), 30u) << r.err;
  EXPECT_EQ(r.err.find("no server answers behind"), std::string::npos) << r.err;
  int failed = 0;
  for (const auto& rec : records) {
    if (rec["error"].is_null()) continue;
    ++failed;
    EXPECT_EQ(rec["id"], 5) << rec.dump();
    EXPECT_EQ(rec["attempts"], 4) << rec.dump();
    EXPECT_EQ(rec["error"]["status"], 502) << rec.dump();
  }
  EXPECT_EQ(failed, 1) << r.err;
}

// A server that does not come back within retry.reconnect_for: the run stops, keeps what was
// answered, records no failure for what the outage held, and says why; the rerun finishes.
TEST(BatchlmRun, StopsWhenAServerLostMidRunStaysAwayPastReconnectFor) {
  TempDir dir;
  const std::vector<std::string> args = {"--gsm8k", gsm8k_test_file(), "--tokens", "20", "--token-delay-ms", "12"};
  auto server = std::make_unique<FakeServer>(dir.path, args);
  const int port = server->port();
  const std::string url = server->base_url();
  write_file(dir.path / "job.yaml",
             gsm8k_job({.base_url = url, .limit = 60, .concurrency = 4, .extra = "grace_period: 1s\n"}));
  const fs::path out = dir.path / "out/e2e.jsonl";
  Process run({.args = {binary("batchlm"), "run", "job.yaml", "--set", "retry.reconnect_for=2s"},
               .env = {{"OPENAI_API_KEY", ""}, {"BATCHLM_MODEL", ""}}, .cwd = dir.path, .out_file = dir.path / "run.out",
               .err_file = dir.path / "run.err"});
  ASSERT_TRUE(wait_until([&] { return fs::exists(out) && count_lines(out) >= 8; }, 60s));
  server->kill();
  const auto lost = std::chrono::steady_clock::now();
  const std::optional<int> code = run.wait(60s);
  const auto took = std::chrono::steady_clock::now() - lost;
  const std::string err = read_file(dir.path / "run.err");
  ASSERT_EQ(code, 1) << err;
  EXPECT_GE(took, 2s);
  EXPECT_NE(err.find("stopped: could not connect to " + url + " for 2s ("), std::string::npos) << err;
  EXPECT_NE(err.find("Start the server again (or raise retry.reconnect_for)"), std::string::npos) << err;
  const auto first = read_jsonl(out);
  ASSERT_LT(first.size(), 60u);
  for (const auto& r : first) EXPECT_TRUE(r["error"].is_null()) << r.dump();
  std::vector<std::string> again = args;
  again.insert(again.end(), {"--port", std::to_string(port)});
  server = std::make_unique<FakeServer>(dir.path, again);
  RunResult rerun = run_batchlm(dir.path, {"run", "job.yaml"});
  ASSERT_EQ(rerun.exit_code, 0) << rerun.err;
  expect_each_id_once(read_jsonl(out), 60);
}

// Through a proxy that cannot be reached, the stop names the proxy and the variable it came from
// (password left out); a host no_proxy exempts is reached directly, and said so.
TEST(BatchlmRun, AServerUnreachableThroughAProxyNamesTheProxy) {
  TempDir dir;
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = "http://127.0.0.1:1/v1", .limit = 20, .concurrency = 8}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"}, {{"http_proxy", "http://u:pw@127.0.0.1:2"}, {"no_proxy", ""}});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("stopped: cannot reach http://127.0.0.1:1/v1 through the proxy http_proxy=http://u:***@127.0.0.1:2 ("),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("fix or unset the proxy variable"), std::string::npos) << r.err;
  r = run_batchlm(dir.path, {"run", "job.yaml", "--fresh"},
                  {{"http_proxy", "http://127.0.0.1:2"}, {"no_proxy", "example.com, 127.0.0.1"}});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("stopped: cannot reach http://127.0.0.1:1/v1 (Failed to connect to 127.0.0.1 port 1"),
            std::string::npos)
      << r.err;
}

// A password in the base URL is not shown: the stop message writes it as ***.
TEST(BatchlmRun, APasswordInTheBaseUrlIsNotShown) {
  TempDir dir;
  write_file(dir.path / "job.yaml",
             gsm8k_job({.base_url = "http://user:s3cret@127.0.0.1:1/v1", .limit = 20, .concurrency = 8}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("stopped: cannot reach http://user:***@127.0.0.1:1/v1 ("), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("s3cret"), std::string::npos) << r.err;
  const std::string summary = read_file(dir.path / "out/e2e.jsonl.summary.json");
  EXPECT_EQ(summary.find("s3cret"), std::string::npos) << summary;
  RunResult dry = run_batchlm(dir.path, {"run", "job.yaml", "--dry-run"});
  EXPECT_EQ(dry.out.find("s3cret"), std::string::npos) << dry.out;
  EXPECT_EQ(dry.err.find("s3cret"), std::string::npos) << dry.err;
}

// Nothing listens at the base URL: once attempts have failed to connect ten times in a row and
// for 5 s, with no success before, the run stops sending, names the address and the error, and
// the rest waits for the next run. Attempts count, not items: items back off and retry, and
// would otherwise nearly all start before ten of them had spent their six attempts.
TEST(BatchlmRun, StopsWhenTheServerCannotBeReachedFromTheStart) {
  TempDir dir;
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = "http://127.0.0.1:1/v1", .limit = 100, .concurrency = 8}));
  const auto start = std::chrono::steady_clock::now();
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("stopped: cannot reach http://127.0.0.1:1/v1 ("), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("Start the server or fix the base URL"), std::string::npos) << r.err;
  EXPECT_GE(took, 5s);
  const json summary = json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"));
  EXPECT_GE(summary["attempts"]["total"].get<long long>(), 10) << summary.dump(2);
  EXPECT_EQ(summary["counts"]["succeeded"], 0) << summary.dump(2);
  EXPECT_EQ(summary["counts"]["failed"].get<long long>() + summary["counts"]["not_run"].get<long long>(), 100)
      << summary.dump(2);
  EXPECT_GE(summary["counts"]["not_run"].get<long long>(), 80) << summary.dump(2);
  for (const json& rec : read_jsonl(dir.path / "out/e2e.jsonl")) EXPECT_EQ(rec["error"]["kind"], "connection");

  // One item alone spends its attempts, is recorded as failed, and the summary line names the
  // error as well as its kind.
  write_file(dir.path / "one.yaml", gsm8k_job({.base_url = "http://127.0.0.1:1/v1", .limit = 1, .max_attempts = 2}));
  r = run_batchlm(dir.path, {"run", "one.yaml", "-o", "one.jsonl"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("failures: connection: 1 ("), std::string::npos) << r.err;
  const json one = json::parse(read_file(dir.path / "one.jsonl.summary.json"));
  EXPECT_TRUE(one["failure_examples"]["connection"].is_string()) << one.dump(2);
}

// A server started beside the run (`server & batchlm run`) that comes up a second later: the
// failed connections are retried, and the run finishes.
TEST(BatchlmRun, AServerThatComesUpASecondLateIsWaitedFor) {
  TempDir dir;
  int port = 0;
  {  // a port nothing listens on, for now
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    socklen_t len = sizeof addr;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    port = ntohs(addr.sin_port);
    ::close(fd);
  }
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = "http://127.0.0.1:" + std::to_string(port) + "/v1",
                                               .limit = 20, .concurrency = 8}));
  Process run({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {}, .cwd = dir.path,
               .out_file = dir.path / "run.out", .err_file = dir.path / "run.err"});
  std::this_thread::sleep_for(1s);
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--port", std::to_string(port)});
  ASSERT_EQ(run.wait(60s), 0) << read_file(dir.path / "run.err");
  expect_each_id_once(read_jsonl(dir.path / "out/e2e.jsonl"), 20);
}

// Each record names its model and the settings it was made with; a rerun under other settings
// (another model, another temperature) is refused before anything is sent, and says what
// changed; --fresh redoes the items.
TEST(BatchlmRun, ResumeUnderOtherSettingsIsRefusedAndNamesTheChange) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file()});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 6}));
  ASSERT_EQ(run_batchlm(dir.path, {"run", "job.yaml"}).exit_code, 0);
  const auto first = read_jsonl(dir.path / "out/e2e.jsonl");
  ASSERT_EQ(first.size(), 6u);
  EXPECT_EQ(first[0]["model"], "fake-model");
  const std::string settings = first[0]["settings"].get<std::string>();
  EXPECT_EQ(settings.size(), 16u);
  const long long sent = server.stats()["requests"].get<long long>();

  // The same settings resume (a different concurrency is not a different result).
  RunResult same = run_batchlm(dir.path, {"run", "job.yaml", "-c", "3"});
  EXPECT_EQ(same.exit_code, 0) << same.err;

  RunResult other = run_batchlm(dir.path, {"run", "job.yaml", "-m", "other-model", "--set", "request.temperature=0.5"});
  EXPECT_EQ(other.exit_code, 2) << other.err;
  EXPECT_NE(other.err.find("6 earlier results were made with other settings than this job's (model: \"fake-model\" -> "
                           "\"other-model\", request.temperature: 0.0 -> 0.5); --fresh replaces them"),
            std::string::npos)
      << other.err;
  EXPECT_EQ(server.stats()["requests"].get<long long>(), sent);
  EXPECT_EQ(read_jsonl(dir.path / "out/e2e.jsonl").size(), 6u);
  EXPECT_TRUE(fs::exists(dir.path / "out/e2e.jsonl.summary.json"));  // the refused run took nothing

  // Without the summary (a killed run leaves none), the settings kept in the lock file tell.
  fs::remove(dir.path / "out/e2e.jsonl.summary.json");
  other = run_batchlm(dir.path, {"run", "job.yaml", "-m", "other-model", "--set", "request.temperature=0.5"});
  EXPECT_EQ(other.exit_code, 2) << other.err;
  EXPECT_NE(other.err.find("(model: \"fake-model\" -> \"other-model\", request.temperature: 0.0 -> 0.5)"),
            std::string::npos)
      << other.err;
  // Without either, the records' model still does.
  fs::remove(dir.path / "out/e2e.jsonl.lock");
  other = run_batchlm(dir.path, {"run", "job.yaml", "-m", "other-model"});
  EXPECT_EQ(other.exit_code, 2) << other.err;
  EXPECT_NE(other.err.find("(model: 'fake-model' -> 'other-model')"), std::string::npos) << other.err;

  RunResult fresh = run_batchlm(dir.path, {"run", "job.yaml", "-m", "other-model", "--fresh"});
  EXPECT_EQ(fresh.exit_code, 0) << fresh.err;
  const auto redone = read_jsonl(dir.path / "out/e2e.jsonl");
  ASSERT_EQ(redone.size(), 6u);
  EXPECT_EQ(redone[0]["model"], "other-model");
  EXPECT_NE(redone[0]["settings"], settings);
}

// --base-url on the command line selects the API client even where the file says type: local
// (its engine settings are warned about); with --backend local as well, the two disagree.
TEST(BatchlmRun, BaseUrlFlagSelectsTheApiOverTheFilesLocalType) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file()});
  std::string job = gsm8k_job({.base_url = server.base_url(), .limit = 3});
  job.replace(job.find("backend: {type: openai, base_url: \"" + server.base_url() + "\", model: fake-model}"),
              std::string("backend: {type: openai, base_url: \"" + server.base_url() + "\", model: fake-model}").size(),
              "backend: {type: local, model: fake-model, threads: 2}");
  write_file(dir.path / "job.yaml", job);
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml", "--base-url", server.base_url()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("backend.threads: has no effect on an API"), std::string::npos) << r.err;
  EXPECT_EQ(read_jsonl(dir.path / "out/e2e.jsonl").size(), 3u);
  r = run_batchlm(dir.path, {"run", "job.yaml", "--base-url", server.base_url(), "--backend", "local", "--fresh"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--base-url: backend.base_url: is for an API, but backend.type is local"), std::string::npos)
      << r.err;
}

// A 429 that says when to come back holds every item, not just the one it answered: with the
// first attempt of each item refused (Retry-After: 2), the attempts in flight meet it, and no
// other goes out before the two seconds are up, where each item used to try once first.
TEST(BatchlmRun, ARetryAfterHoldsEveryItem) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--faults", "status=429;retry_after=2",
                               "--fault-first-attempts", "1"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 12, .concurrency = 4}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  expect_each_id_once(read_jsonl(dir.path / "out/e2e.jsonl"), 12);
  auto at = server.stats()["arrival_ms"].get<std::vector<double>>();
  std::sort(at.begin(), at.end());
  ASSERT_EQ(at.size(), 24u);
  const auto early = std::count_if(at.begin(), at.end(), [&](double t) { return t - at.front() < 1900; });
  EXPECT_LE(early, 4) << "attempts within the first Retry-After";
}

// Items stopped while they wait out a Retry-After have sent requests: the summary counts them.
TEST(BatchlmRun, InterruptedRunCountsTheRequestsOfItemsItDidNotFinish) {
  TempDir dir;
  FakeServer server(dir.path, {"--fault-rate", "1", "--faults", "status=429;retry_after=600"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 5, .concurrency = 5}));
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {}, .cwd = dir.path,
             .out_file = dir.path / "run.out", .err_file = dir.path / "run.err"});
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (std::chrono::steady_clock::now() < deadline && server.stats()["requests"].get<long long>() < 5)
    std::this_thread::sleep_for(10ms);
  std::this_thread::sleep_for(100ms);
  p.signal(SIGINT);
  ASSERT_EQ(p.wait(20s), 130) << read_file(dir.path / "run.err");
  const json summary = json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"));
  EXPECT_EQ(summary["attempts"], (json{{"total", 5}, {"retries", 0}})) << summary.dump(2);
  EXPECT_EQ(summary["counts"]["not_run"], 5) << summary.dump(2);
}

// An input cut short while the job runs (fewer lines than were validated) stops the sending as
// an API that refuses every request does: the items under way finish and keep their records,
// the run says where the input failed and what to do, exits 1 (sent, not finished) with its
// summary, and a rerun on the whole input again finishes the rest, each item once.
TEST(BatchlmRun, AnInputCutShortWhileTheJobRunsEndsItWithItsRecordsKept) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--tokens", "16", "--token-delay-ms", "20"});
  const std::string whole = read_file(gsm8k_test_file());
  write_file(dir.path / "in.jsonl", whole);
  std::string job = gsm8k_job({.base_url = server.base_url(), .limit = 300, .concurrency = 2});
  job.replace(job.find(gsm8k_test_file()), gsm8k_test_file().size(), "in.jsonl");
  write_file(dir.path / "job.yaml", job);
  const fs::path out = dir.path / "out/e2e.jsonl";
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {}, .cwd = dir.path,
             .out_file = dir.path / "run.out", .err_file = dir.path / "run.err"});
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < deadline && (!fs::exists(out) || count_lines(out) < 4))
    std::this_thread::sleep_for(5ms);
  { std::ofstream cut(dir.path / "in.jsonl", std::ios::trunc); }  // the same file, now empty
  ASSERT_EQ(p.wait(60s), 1) << read_file(dir.path / "run.err");
  const std::string err = read_file(dir.path / "run.out") + read_file(dir.path / "run.err");
  // Where the reading stopped: the end of the file, or a line cut in the middle.
  EXPECT_NE(err.find("stopped: in.jsonl:"), std::string::npos) << err;
  EXPECT_NE(err.find("Put the input back as it was checked"), std::string::npos) << err;
  EXPECT_TRUE(fs::exists(dir.path / "out/e2e.jsonl.summary.json"));
  const std::vector<json> first = read_jsonl(out);
  EXPECT_GE(first.size(), 4u);
  EXPECT_LT(first.size(), 300u);
  write_file(dir.path / "in.jsonl", whole);
  RunResult again = run_batchlm(dir.path, {"run", "job.yaml", "--concurrency", "64"});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  expect_each_id_once(read_jsonl(out), 300);
}

// A stop signal while the job and its input are still being read (before the run takes signals
// itself) ends the process at once, as a stopped run: exit 130 and a line saying nothing was
// sent, not the signal's own death (143) and silence.
TEST(BatchlmRun, SigtermWhileTheInputIsReadExits130) {
  TempDir dir;
  {
    std::ofstream in(dir.path / "in.jsonl");
    for (int i = 0; i < 1'500'000; ++i) in << "{\"question\": \"q " << i << "\"}\n";
  }
  write_file(dir.path / "job.yaml",
             "input: in.jsonl\nrequest:\n  max_tokens: 2\n  messages: [{role: user, content: \"{{question}}\"}]\n"
             "backend: {base_url: \"http://127.0.0.1:1/v1\"}\noutput: {path: out/o.jsonl}\n");
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {{"OPENAI_API_KEY", "sk-test"}}, .cwd = dir.path,
             .out_file = dir.path / "run.out", .err_file = dir.path / "run.err"});
  // Until SIGTERM is caught (its bit in the mask of caught signals), it would kill as before.
  const auto caught = [&] {
    std::ifstream status("/proc/" + std::to_string(p.pid()) + "/status");
    for (std::string line; std::getline(status, line);)
      if (line.starts_with("SigCgt:")) return (std::stoull(line.substr(7), nullptr, 16) >> (SIGTERM - 1)) & 1;
    return 0ull;
  };
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline && !caught()) std::this_thread::sleep_for(2ms);
  p.signal(SIGTERM);
  ASSERT_EQ(p.wait(20s), 130) << read_file(dir.path / "run.err");
  EXPECT_EQ(read_file(dir.path / "run.err"), "\nbatchlm: interrupted before the run began: nothing was sent\n");
  EXPECT_FALSE(fs::exists(dir.path / "out/o.jsonl"));
}

TEST(BatchlmRun, SigintFinishesInFlightItemsAndExits130) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--tokens", "20", "--token-delay-ms", "10"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 100, .concurrency = 4}));
  const fs::path out = dir.path / "out/e2e.jsonl";
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {}, .cwd = dir.path,
             .out_file = dir.path / "run.out", .err_file = dir.path / "run.err"});
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < deadline && (!fs::exists(out) || count_lines(out) < 8))
    std::this_thread::sleep_for(5ms);
  p.signal(SIGINT);
  auto code = p.wait(30s);
  ASSERT_EQ(code, 130) << read_file(dir.path / "run.err");
  const std::string err = read_file(dir.path / "run.err");
  EXPECT_NE(err.find("interrupted"), std::string::npos) << err;
  auto records = read_jsonl(out);
  EXPECT_GE(records.size(), 8u);
  EXPECT_LT(records.size(), 100u);
  for (const auto& rec : records) EXPECT_TRUE(rec["error"].is_null()) << rec.dump();
  EXPECT_TRUE(fs::exists(dir.path / "out/e2e.jsonl.summary.json"));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  expect_each_id_once(read_jsonl(out), 100);
}

// A second run on an output another run is writing is refused, under the output's own name or
// through a symbolic link to it, so no record is written twice.
TEST(BatchlmRun, RefusesASecondRunOnTheSameOutputUnderAnyName) {
  for (const std::string& name : {std::string("out/e2e.jsonl"), std::string("out/link.jsonl")}) {
    TempDir dir;
    FakeServer server(dir.path, {"--tokens", "50", "--token-delay-ms", "20"});
    write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 50, .concurrency = 2}));
    fs::create_directories(dir.path / "out");
    fs::create_symlink("e2e.jsonl", dir.path / "out/link.jsonl");
    Process first({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {}, .cwd = dir.path,
                   .out_file = dir.path / "first.out", .err_file = dir.path / "first.err"});
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (std::chrono::steady_clock::now() < deadline && !fs::exists(dir.path / "out/e2e.jsonl.lock"))
      std::this_thread::sleep_for(5ms);
    std::this_thread::sleep_for(200ms);
    RunResult second = run_batchlm(dir.path, {"run", "job.yaml", "-o", name});
    EXPECT_EQ(second.exit_code, 2) << name;
    EXPECT_NE(second.err.find("out/e2e.jsonl"), std::string::npos) << second.err;
    EXPECT_NE(second.err.find("in use by another run"), std::string::npos) << second.err;
    first.signal(SIGKILL);
    EXPECT_TRUE(fs::is_symlink(fs::symlink_status(dir.path / "out/link.jsonl")));
  }
}

TEST(BatchlmRun, DryRunValidatesAndSendsNothing) {
  TempDir dir;
  FakeServer server(dir.path);
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 5}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml", "--dry-run"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\"messages\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Janet"), std::string::npos) << r.out;  // the first test question
  EXPECT_EQ(server.stats()["requests"].get<long long>(), 0);
  EXPECT_FALSE(fs::exists(dir.path / "out/e2e.jsonl"));
  EXPECT_NE(r.out.find("output tokens: at most 320\n"), std::string::npos) << r.out;  // 5 x 64
  // Without max_tokens there is no bound to tell.
  r = run_batchlm(dir.path, {"run", "job.yaml", "--dry-run", "--set", "request.max_tokens=null"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("output tokens: 5 items without max_tokens, so no bound"), std::string::npos) << r.out;
  // A synth job of billions of items is estimated from its first million, not drawn whole.
  r = run_batchlm(dir.path, {"synth", "--count", "9223372036854775807", "--dry-run", "--base-url", server.base_url()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("9223372036854775807 items to"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("estimated prompt tokens (from the first 1000000): "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("e+20 (about "), std::string::npos) << r.out;
}

// A dry run on the embedded engine checks the model file as far as its header and tensor
// table: a missing or broken model fails there, not after the run has started.
TEST(BatchlmRun, DryRunChecksTheLocalModelFile) {
  TempDir dir;
  write_file(dir.path / "bad.gguf", "not a model at all");
  const std::string job = "input: " + gsm8k_test_file() +
                          "\nrequest: {messages: [{role: user, content: \"{{question}}\"}]}\nlimit: 2\n";
  for (const auto& [model, message] : std::vector<std::pair<std::string, std::string>>{
           {"missing.gguf", "model file 'missing.gguf' not found"}, {"bad.gguf", "bad.gguf: bad magic"}}) {
    write_file(dir.path / "job.yaml", job + "backend: {type: local, model: " + model + "}\n");
    RunResult r = run_batchlm(dir.path, {"run", "job.yaml", "--dry-run"});
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find("backend.model: "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
  }
}

TEST(BatchlmRun, ConfigErrorNamesFileLineFieldAndSuggestion) {
  TempDir dir;
  write_file(dir.path / "job.yaml",
             gsm8k_job({.base_url = "http://127.0.0.1:9/v1", .extra = "retyr: {max_attempts: 3}\n"}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("job.yaml:16:1: retyr"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("'retry'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("did you mean"), std::string::npos) << r.err;
}

TEST(BatchlmRun, SetOverridesAJobField) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file()});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url()}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml", "--set", "limit=3", "--output", "other.jsonl"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  expect_each_id_once(read_jsonl(dir.path / "other.jsonl"), 3);
  RunResult bad = run_batchlm(dir.path, {"run", "job.yaml", "--set", "concurrency=lots"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("concurrency"), std::string::npos) << bad.err;
}

TEST(BatchlmSynth, BuiltInRecipeWritesTheRequestedCount) {
  TempDir dir;
  FakeServer server(dir.path);
  RunResult r = run_batchlm(dir.path, {"synth", "--concurrency", "20", "--count", "25", "--output",
                                       "stories.jsonl", "--base-url", server.base_url()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto records = read_jsonl(dir.path / "stories.jsonl");
  ASSERT_EQ(records.size(), 25u);
  std::set<std::string> prompts;
  for (const auto& rec : records) {
    EXPECT_FALSE(rec["output"].get<std::string>().empty());
    prompts.insert(rec["input"].dump());
  }
  EXPECT_GT(prompts.size(), 20u);  // variables drawn per item
}

// Resuming with another seed would mix two draws in one dataset: the run says so. The same
// seed resumes quietly.
TEST(BatchlmSynth, ResumeNamesRecordsDrawnFromOtherInputs) {
  TempDir dir;
  FakeServer server(dir.path);
  const std::vector<std::string> base = {"synth", "--count", "10", "-o", "s.jsonl", "--base-url", server.base_url()};
  ASSERT_EQ(run_batchlm(dir.path, base).exit_code, 0);
  std::vector<std::string> same = base;
  same[2] = "12";
  RunResult r = run_batchlm(dir.path, same);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err.find("other inputs"), std::string::npos) << r.err;
  std::vector<std::string> reseeded = base;
  reseeded[2] = "14";
  reseeded.insert(reseeded.end(), {"--set", "synth.seed=7"});
  r = run_batchlm(dir.path, reseeded);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // (An item may draw the same words under both seeds, so the count is not checked.)
  EXPECT_NE(r.err.find("earlier records were made from other inputs"), std::string::npos) << r.err;
  EXPECT_EQ(read_jsonl(dir.path / "s.jsonl").size(), 14u);
}

TEST(BatchlmCli, HelpVersionAndUsageErrors) {
  TempDir dir;
  RunResult help = run_batchlm(dir.path, {"--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("Exit codes"), std::string::npos);
  RunResult version = run_batchlm(dir.path, {"--version"});
  EXPECT_EQ(version.exit_code, 0);
  EXPECT_NE(version.out.find("batchlm"), std::string::npos);
  RunResult bad = run_batchlm(dir.path, {"run", "missing.yaml"});
  EXPECT_EQ(bad.exit_code, 2);
  // No command: the usage, on stderr, as a usage error.
  RunResult bare = run_batchlm(dir.path, {});
  EXPECT_EQ(bare.exit_code, 2);
  EXPECT_NE(bare.err.find("Usage:"), std::string::npos) << bare.err;
  EXPECT_NE(bare.err.find("Subcommands:"), std::string::npos) << bare.err;
  EXPECT_EQ(bare.err.find("Usage: [OPTIONS]"), std::string::npos) << bare.err;  // the program is named
  EXPECT_NE(bare.err.find("Usage: batchlm "), std::string::npos) << bare.err;
  // `help` and `help COMMAND` are the helps --help gives.
  RunResult help_word = run_batchlm(dir.path, {"help"});
  EXPECT_EQ(help_word.exit_code, 0);
  EXPECT_EQ(help_word.out, help.out);
  RunResult help_serve = run_batchlm(dir.path, {"help", "serve"});
  EXPECT_EQ(help_serve.exit_code, 0);
  EXPECT_NE(help_serve.out.find("--no-kv-commit "), std::string::npos) << help_serve.out;
  RunResult help_bad = run_batchlm(dir.path, {"help", "frobnicate"});
  EXPECT_EQ(help_bad.exit_code, 2);
  EXPECT_EQ(help_bad.err.rfind("batchlm: error: unknown command 'frobnicate'", 0), 0u) << help_bad.err;
  // Each engine command's help is its own: not run's exit codes and resume text.
  for (const char* command : {"generate", "inspect"}) {
    RunResult h = run_batchlm(dir.path, {command, "--help"});
    EXPECT_EQ(h.exit_code, 0) << command;
    EXPECT_EQ(h.out.find("Rerunning the same command resumes"), std::string::npos) << command << ": " << h.out;
    EXPECT_NE(h.out.find("Exit status: 0 "), std::string::npos) << command << ": " << h.out;
  }
  RunResult serve_help = run_batchlm(dir.path, {"serve", "--help"});
  EXPECT_NE(serve_help.out.find("--no-kv-commit "), std::string::npos) << serve_help.out;
  EXPECT_EQ(serve_help.out.find("{false}"), std::string::npos) << serve_help.out;
  RunResult unknown = run_batchlm(dir.path, {"frobnicate"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_EQ(unknown.err.rfind("batchlm: error: unknown command 'frobnicate' (commands: run, synth, generate, inspect, serve)", 0), 0u)
      << unknown.err;
  // Numeric flags say what they take, in the job file's words.
  const std::vector<std::pair<std::vector<std::string>, std::string>> numbers = {
      {{"synth", "--count", "0"}, "batchlm: error: --count: must be >= 1, got 0\n"},
      {{"synth", "-c", "many"}, "batchlm: error: --concurrency: must be >= 1 (an integer), got 'many'\n"},
      // Too large is said to be, with the largest allowed.
      {{"synth", "-c", "99999999999999999999"},
       "batchlm: error: --concurrency: too large: the largest allowed is 2147483647, got 99999999999999999999\n"},
      {{"synth", "-c", "3000000000"}, "batchlm: error: --concurrency: too large: the largest allowed is 2147483647, got 3000000000\n"},
      {{"synth", "-n", "99999999999999999999"},
       "batchlm: error: --limit: too large: the largest allowed is 9223372036854775807, got 99999999999999999999\n"},
      {{"synth", "-n", "-99999999999999999999"}, "batchlm: error: --limit: must be >= 0, got -99999999999999999999\n"},
      {{"serve", "--port", "70000"}, "batchlm: error: --port: must be between 0 and 65535, got 70000\n"},
      {{"generate", "-p", "x", "--top-p", "1.5"}, "batchlm: error: --top-p: must be between 0 and 1, got 1.5\n"},
      // As a request's temperature.
      {{"generate", "-p", "x", "--temperature", "3"}, "batchlm: error: --temperature: must be between 0 and 2, got 3\n"},
      {{"generate", "-p", "x", "--system", "Be brief."}, "batchlm: error: --system needs --chat"},
      {{"generate", "-p", "x", "--stop", ""}, "batchlm: error: --stop: an empty string stops nothing: leave it out\n"},
      // A flag's value that the job refuses is blamed on the flag, not on --set.
      {{"synth", "--count", "3", "--set", "input=" + gsm8k_test_file(), "--set", "request={max_tokens: 5}"},
       "batchlm: error: --count: synth.count: not used by a job with an input"},
  };
  for (const auto& [args, message] : numbers) {
    RunResult r = run_batchlm(dir.path, args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(r.err.rfind(message, 0), 0u) << r.err;
  }
  // A mistyped option gets the nearest one; another command's option, that command.
  RunResult typo = run_batchlm(dir.path, {"synth", "--concurency", "3"});
  EXPECT_EQ(typo.exit_code, 2);
  // The hint first: it is the cause of what the parser says after it.
  EXPECT_EQ(typo.err.rfind("batchlm: error: --concurency: did you mean --concurrency?\n", 0), 0u) << typo.err;
  write_file(dir.path / "job.yaml", "input: " + gsm8k_test_file() + "\n");
  // Said alone: what the parser makes of it ("not expected: 5 --count", the value taken for the
  // job file) would only mislead.
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"run", "job.yaml", "--count", "5"}, {"run", "--count", "5"}, {"run", "job.yaml", "--count=5"}}) {
    RunResult elsewhere = run_batchlm(dir.path, args);
    EXPECT_EQ(elsewhere.exit_code, 2);
    EXPECT_EQ(elsewhere.err,
              "batchlm: error: --count is an option of 'batchlm synth', not of 'run'\nRun with --help for more information.\n");
  }
  // With another mistake beside it, the parser's words stay.
  RunResult both = run_batchlm(dir.path, {"run", "job.yaml", "--count", "5", "--frobnicate"});
  EXPECT_NE(both.err.find("--count is an option of 'batchlm synth', not of 'run'\n"), std::string::npos) << both.err;
  EXPECT_NE(both.err.find("--frobnicate"), std::string::npos) << both.err;
  RunResult twice = run_batchlm(dir.path, {"run", "job.yaml", "-c", "4", "-c", "5"});
  EXPECT_EQ(twice.err.rfind("batchlm: error: --concurrency: given 2 times; give it once\n", 0), 0u) << twice.err;
  RunResult serve_flag = run_batchlm(dir.path, {"serve", "--max-queue", "-1"});
  EXPECT_EQ(serve_flag.err.rfind("batchlm: error: --max-queue: must be between 0 and 1048576, got -1", 0), 0u)
      << serve_flag.err;
}

// The widest row written to a terminal: escape sequences take no columns, a UTF-8 character
// takes one, and "\r" or "\n" start over. Wider than the terminal means the terminal wrapped
// it, and a "\r" redraw would then leave the wrapped part behind.
std::size_t widest_row(const std::string& screen) {
  std::size_t columns = 0, widest = 0;
  for (std::size_t i = 0; i < screen.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(screen[i]);
    if (c == '\r' || c == '\n') {
      columns = 0;
    } else if (c == 0x1b) {
      while (i + 1 < screen.size() && !std::isalpha(static_cast<unsigned char>(screen[i + 1]))) ++i;
      ++i;
    } else if ((c & 0xC0) != 0x80) {
      widest = std::max(widest, ++columns);
    }
  }
  return widest;
}

TEST(BatchlmProgress, DrawsABarOnATerminalAndPrintsTheSummary) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--wrong-every", "5", "--tokens", "20",
                               "--token-delay-ms", "10"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 30, .concurrency = 3}));
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {{"OPENAI_API_KEY", ""}, {"BATCHLM_MODEL", ""}},
             .cwd = dir.path, .out_file = {}, .err_file = {}, .use_pty = true, .pty_columns = 120});
  ASSERT_EQ(p.wait(120s), 0);
  const std::string& screen = p.pty_output();
  // Redrawn in place: several carriage returns, a percentage, the final count.
  EXPECT_GE(std::count(screen.begin(), screen.end(), '\r'), 3) << screen;
  EXPECT_NE(screen.find("30/30"), std::string::npos) << screen;
  EXPECT_NE(screen.find("%"), std::string::npos) << screen;
  EXPECT_NE(screen.find("strict 80.0% (24/30)"), std::string::npos) << screen;  // the summary
  EXPECT_LE(widest_row(screen), 120u) << screen;
}

}  // namespace
}  // namespace batchlm::e2e

namespace batchlm::e2e {
namespace {

TEST(BatchlmRun, ShippedJobsAndExamplesValidate) {
  TempDir dir;
  std::vector<fs::path> files;
  for (const char* folder : {"jobs", "examples"})
    for (const auto& entry : fs::directory_iterator(fs::path(BATCHLM_SOURCE_DIR) / folder))
      if (entry.path().extension() == ".yaml") files.push_back(entry.path());
  ASSERT_GE(files.size(), 4u);
  for (const auto& file : files) {
    // Relative inputs in the examples are relative to the checkout.
    Process p({.args = {binary("batchlm"), "run", file.string(), "--dry-run"},
               .env = {{"BATCHLM_DATA", BATCHLM_SHARED_DATA}, {"OPENAI_API_KEY", "unused"}, {"OPENROUTER_API_KEY", "unused"}},
               .cwd = BATCHLM_SOURCE_DIR, .out_file = dir.path / "out.txt", .err_file = dir.path / "err.txt"});
    EXPECT_EQ(p.wait(60s), 0) << file << ": " << read_file(dir.path / "err.txt");
    EXPECT_NE(read_file(dir.path / "out.txt").find("nothing was sent"), std::string::npos) << file;
  }
}

// A key variable the job names is one it means to send: unset or empty, the run and its dry run
// refuse, naming it where the job does, before anything is sent. The default variable may be
// unset for a server that needs no key.
TEST(BatchlmRun, AKeyVariableTheJobNamesMustBeSet) {
  TempDir dir;
  FakeServer server(dir.path);
  std::string job = gsm8k_job({.base_url = server.base_url(), .limit = 2});
  job.replace(job.find("model: fake-model}"), 18, "model: fake-model, api_key_env: MY_PROVIDER_KEY}");
  write_file(dir.path / "job.yaml", job);
  for (const bool dry : {true, false}) {
    std::vector<std::string> args = {"run", "job.yaml"};
    if (dry) args.push_back("--dry-run");
    RunResult r = run_batchlm(dir.path, args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find("job.yaml:10:"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("backend.api_key_env: $MY_PROVIDER_KEY is not set; export the API key in it, or leave "
                         "backend.api_key_env out for a server that needs no key"),
              std::string::npos)
        << r.err;
  }
  EXPECT_NE(run_batchlm(dir.path, {"run", "job.yaml"}, {{"MY_PROVIDER_KEY", ""}}).err.find("$MY_PROVIDER_KEY is empty"),
            std::string::npos);
  EXPECT_EQ(server.stats()["requests"].get<long long>(), 0);
  EXPECT_EQ(run_batchlm(dir.path, {"run", "job.yaml"}, {{"MY_PROVIDER_KEY", "sk-1"}}).exit_code, 0);
}

// An API key with a line break (a Windows .env file's carriage return) would end the header it
// goes in: every request would fail, after minutes of retries. Refused before anything is sent.
TEST(BatchlmRun, ApiKeyWithALineBreakIsRefused) {
  TempDir dir;
  FakeServer server(dir.path);
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 2}));
  for (const bool dry : {true, false}) {
    std::vector<std::string> args = {"run", "job.yaml"};
    if (dry) args.push_back("--dry-run");
    RunResult r = run_batchlm(dir.path, args, {{"OPENAI_API_KEY", "sk-abc\r"}});
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(r.err,
              "batchlm: error: job.yaml: backend.api_key_env: $OPENAI_API_KEY holds a carriage return at character 7 "
              "of 7; an API key is one line of printable characters\n");
  }
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"}, {{"OPENAI_API_KEY", "sk-abc\nX-Evil: 1"}});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("holds a line break at character 7 of 16"), std::string::npos) << r.err;
  // Spaces or quotes around the key would go out as part of it: refused the same way.
  r = run_batchlm(dir.path, {"run", "job.yaml"}, {{"OPENAI_API_KEY", " sk-abc"}});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("$OPENAI_API_KEY has spaces around the key, which would be sent as part of it"), std::string::npos)
      << r.err;
  r = run_batchlm(dir.path, {"run", "job.yaml"}, {{"OPENAI_API_KEY", "\"sk-abc\""}});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("$OPENAI_API_KEY holds the key in quotes"), std::string::npos) << r.err;
  EXPECT_EQ(server.stats()["requests"].get<long long>(), 0);
}

// A base URL with a query (Azure's ?api-version=...): the endpoint's path goes before it.
TEST(BatchlmRun, BaseUrlWithAQueryKeepsItAfterThePath) {
  TempDir dir;
  FakeServer server(dir.path);
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url() + "?api-version=2024-10-21", .limit = 2}));
  RunResult dry = run_batchlm(dir.path, {"run", "job.yaml", "--dry-run"});
  EXPECT_EQ(dry.exit_code, 0) << dry.err;
  EXPECT_NE(dry.out.find("POST " + server.base_url() + "/chat/completions?api-version=2024-10-21\n"), std::string::npos)
      << dry.out;
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(server.stats()["requests"].get<long long>(), 2);
}

// What the run would refuse before sending, the dry run refuses too, creating nothing.
TEST(BatchlmRun, DryRunRefusesWhatTheRunWould) {
  TempDir dir;
  FakeServer server(dir.path);
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 2}));
  write_file(dir.path / "in5.jsonl", "{}\n");
  write_file(dir.path / "notes.txt", "not results\n");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"-o", "/dev/null"}, "batchlm: error: --output: output.path: output /dev/null is a character device, not a file"},
      {{"-o", "in5.jsonl/x.jsonl"},
       "batchlm: error: --output: output.path: cannot create the directory for output " +
           (fs::canonical(dir.path) / "in5.jsonl/x.jsonl").string() + ": " +
           (fs::canonical(dir.path) / "in5.jsonl").string() + " is not a directory\n"},
      {{"-o", "notes.txt"}, "batchlm: error: --output: output.path: " + (fs::canonical(dir.path) / "notes.txt").string() +
                                ":1: not a JSON line, so this is not a batchlm output file"},
      {{"--set", "output=in5.jsonl/deeper/x.jsonl"}, "batchlm: error: --set: output.path: cannot create the directory"},
      {{"--backend", "openai", "--set", "backend.base_url=null"},
       "batchlm: error: job.yaml: backend.api_key_env: $OPENAI_API_KEY is not set"},
      // An option where a value belongs: taken as the value, the run would write to "--fresh".
      {{"-o", "--fresh"}, "batchlm: error: --output: value missing: --fresh is an option, not a value\n"},
      {{"-m", "--backend=local"}, "batchlm: error: --model: value missing: --backend=local is an option, not a value\n"},
      {{"-o", "--version"}, "batchlm: error: --output: value missing: --version is an option, not a value\n"},
      // A name the file system takes, but its summary's temporary file's it would not.
      {{"-o", std::string(239, 'c') + ".jsonl"},
       "batchlm: error: --output: output.path: output name cccccccccccccccccccccccccccccccccccccccc... is 245 bytes: its "
       "summary's temporary file (.summary.json.tmp added) would exceed this file system's limit of 255 bytes per "
       "name; choose a name of at most 238\n"},
  };
  for (const auto& [flags, message] : cases) {
    for (const bool dry : {true, false}) {
      std::vector<std::string> args = {"run", "job.yaml"};
      args.insert(args.end(), flags.begin(), flags.end());
      if (dry) args.push_back("--dry-run");
      RunResult r = run_batchlm(dir.path, args);
      EXPECT_EQ(r.exit_code, 2) << flags[1] << (dry ? " (dry run)" : "") << ": " << r.err;
      if (dry) {
        EXPECT_EQ(r.err.rfind(message, 0), 0u) << r.err;
      }
      EXPECT_TRUE(r.out.find("nothing was sent") == std::string::npos) << r.out;
    }
  }
  EXPECT_EQ(server.stats()["requests"].get<long long>(), 0);
  // Nothing made: no lock file beside a refused output, no directory.
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir.path)) names.insert(entry.path().filename().string());
  for (const std::string& name : names) EXPECT_EQ(name.find(".lock"), std::string::npos) << name;
  EXPECT_EQ(read_file(dir.path / "notes.txt"), "not results\n");
  EXPECT_FALSE(fs::exists(dir.path / "out"));
  // A directory the run cannot write in (not for root, who can write anywhere).
  if (::geteuid() != 0) {
    fs::create_directory(dir.path / "ro");
    fs::permissions(dir.path / "ro", fs::perms::owner_read | fs::perms::owner_exec);
    RunResult r = run_batchlm(dir.path, {"run", "job.yaml", "-o", "ro/x.jsonl", "--dry-run"});
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_NE(r.err.find("--output: output.path: cannot create output "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("Permission denied"), std::string::npos) << r.err;
    fs::permissions(dir.path / "ro", fs::perms::owner_all);
  }
  // And what the run takes, the dry run takes.
  RunResult fine = run_batchlm(dir.path, {"run", "job.yaml", "-o", "new/dir/x.jsonl", "--dry-run"});
  EXPECT_EQ(fine.exit_code, 0) << fine.err;
  EXPECT_FALSE(fs::exists(dir.path / "new"));
}

// $OPENAI_BASE_URL is where the requests go when the job names no URL: checked before anything is
// sent, not retried until the run gives up.
TEST(BatchlmRun, BaseUrlFromTheEnvironmentIsChecked) {
  TempDir dir;
  write_file(dir.path / "job.yaml", "input: " + gsm8k_test_file() +
                                        "\nrequest: {messages: [{role: user, content: \"{{question}}\"}]}\nlimit: 2\n");
  for (const std::string url : {"notaurl", "ftp://x/v1", "http://a b/v1", ""}) {
    for (const bool dry : {true, false}) {
      std::vector<std::string> args = {"run", "job.yaml", "--backend", "openai"};
      if (dry) args.push_back("--dry-run");
      RunResult r = run_batchlm(dir.path, args, {{"OPENAI_BASE_URL", url}, {"OPENAI_API_KEY", "x"}});
      EXPECT_EQ(r.exit_code, 2) << url << ": " << r.err;
      EXPECT_EQ(r.err.rfind("batchlm: error: job.yaml: backend.base_url: $OPENAI_BASE_URL is ", 0), 0u) << r.err;
    }
  }
  EXPECT_FALSE(fs::exists(dir.path / "out"));
}

TEST(BatchlmRun, MissingApiKeyForTheOpenAIHostIsAUsageError) {
  TempDir dir;
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = "https://api.openai.com/v1", .limit = 2}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("OPENAI_API_KEY is not set"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir.path / "out/e2e.jsonl"));
}

}  // namespace
}  // namespace batchlm::e2e

namespace batchlm::e2e {
namespace {

TEST(BatchlmRun, SecondSigintExitsAtOnceWithWholeRecords) {
  TempDir dir;
  // Slow streams and a long grace period: only the second Ctrl-C can end this run quickly.
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--tokens", "200", "--token-delay-ms", "50"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 100, .concurrency = 8,
                                               .extra = "grace_period: 10m\n"}));
  const fs::path out = dir.path / "out/e2e.jsonl";
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {}, .cwd = dir.path,
             .out_file = dir.path / "run.out", .err_file = dir.path / "run.err"});
  ASSERT_TRUE(wait_until([&] { return server.stats()["requests"].get<long long>() >= 8; }));
  p.signal(SIGINT);
  ASSERT_TRUE(wait_until([&] { return read_file(dir.path / "run.err").find("no new items") != std::string::npos; }));
  const auto before = std::chrono::steady_clock::now();
  p.signal(SIGINT);
  ASSERT_EQ(p.wait(20s), 130) << read_file(dir.path / "run.err");
  EXPECT_LT(std::chrono::steady_clock::now() - before, 5s);  // not the 10 minute grace period
  EXPECT_NE(read_file(dir.path / "run.err").find("exiting now"), std::string::npos);
  // Whatever was written is whole records; the rerun completes the job.
  if (fs::exists(out)) {
    const std::string text = read_file(out);
    EXPECT_TRUE(text.empty() || text.back() == '\n');
    for (const auto& rec : read_jsonl(out)) EXPECT_TRUE(rec["error"].is_null());
  }
  FakeServer fast(dir.path, {"--gsm8k", gsm8k_test_file()});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = fast.base_url(), .limit = 100}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  expect_each_id_once(read_jsonl(out), 100);
}

// A file that is not an output (the input, a dataset, a model) given as -o is never emptied or
// rewritten, with --fresh or without; the error says why.
TEST(BatchlmRun, NeverOverwritesAFileThatIsNotAnOutput) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file()});
  std::string five;
  {
    std::istringstream in(read_file(gsm8k_test_file()));
    std::string line;
    for (int i = 0; i < 5 && std::getline(in, line); ++i) five += line + "\n";
  }
  write_file(dir.path / "data.jsonl", five);
  write_file(dir.path / "notes.txt", "not results\n");
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 3}));
  const std::string job = read_file(dir.path / "job.yaml");
  const std::vector<std::vector<std::string>> runs = {
      {"run", "job.yaml", "--set", "input=data.jsonl", "-o", "data.jsonl"},
      {"run", "job.yaml", "--set", "input=data.jsonl", "-o", "data.jsonl", "--fresh"},
      {"run", "job.yaml", "-o", "notes.txt"},
      {"run", "job.yaml", "-o", "notes.txt", "--fresh"},
      {"run", "job.yaml", "-o", "job.yaml", "--fresh"},
  };
  for (const auto& args : runs) {
    RunResult r = run_batchlm(dir.path, args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_TRUE(r.err.find("is the job's") != std::string::npos ||
                r.err.find("not a batchlm output") != std::string::npos)
        << r.err;
  }
  EXPECT_EQ(read_file(dir.path / "data.jsonl"), five);
  EXPECT_EQ(read_file(dir.path / "notes.txt"), "not results\n");
  EXPECT_EQ(read_file(dir.path / "job.yaml"), job);
  EXPECT_EQ(server.stats()["requests"].get<long long>(), 0);
}

// A rerun with a lower --limit counts its own items: the earlier records beyond it stay in
// the file and are named, not added to this run's counts.
TEST(BatchlmRun, LowerLimitOnResumeCountsOnlyItsItems) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--wrong-every", "5"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 10}));
  ASSERT_EQ(run_batchlm(dir.path, {"run", "job.yaml"}).exit_code, 0);
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml", "--limit", "4"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("4 items: 4 succeeded (4 resumed)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("6 earlier records in the output are not among this run's 4 items"), std::string::npos)
      << r.err;
  const json summary = json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"));
  EXPECT_EQ(summary["counts"]["total"], 4) << summary.dump(2);
  EXPECT_EQ(summary["counts"]["succeeded"], 4) << summary.dump(2);
  EXPECT_EQ(summary["accuracy"]["strict"]["scored"], 4) << summary.dump(2);
  // Nothing ran this time; the tokens of the 4 counted records are still reported.
  EXPECT_EQ(summary["tokens"]["completion"], 0) << summary.dump(2);
  EXPECT_GT(summary["tokens_in_output"]["completion"].get<long long>(), 0) << summary.dump(2);
  EXPECT_EQ(read_jsonl(dir.path / "out/e2e.jsonl").size(), 10u);
}

// A run that is killed leaves no summary from an earlier run beside an output it changed.
TEST(BatchlmRun, KilledRunLeavesNoStaleSummary) {
  TempDir dir;
  const fs::path summary = dir.path / "out/e2e.jsonl.summary.json";
  {
    FakeServer fast(dir.path, {"--gsm8k", gsm8k_test_file()});
    write_file(dir.path / "job.yaml", gsm8k_job({.base_url = fast.base_url(), .limit = 5}));
    ASSERT_EQ(run_batchlm(dir.path, {"run", "job.yaml"}).exit_code, 0);
    ASSERT_TRUE(fs::exists(summary));
  }
  FakeServer slow(dir.path, {"--gsm8k", gsm8k_test_file(), "--tokens", "200", "--token-delay-ms", "50"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = slow.base_url(), .limit = 5}));
  Process p({.args = {binary("batchlm"), "run", "job.yaml", "--fresh"}, .env = {}, .cwd = dir.path,
             .out_file = dir.path / "run.out", .err_file = dir.path / "run.err"});
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (std::chrono::steady_clock::now() < deadline && fs::exists(summary)) std::this_thread::sleep_for(5ms);
  EXPECT_FALSE(fs::exists(summary));
  p.signal(SIGKILL);
  p.wait(10s);
  EXPECT_FALSE(fs::exists(summary));
}

}  // namespace
}  // namespace batchlm::e2e

namespace batchlm::e2e {
namespace {

// A synth job of `count` items on the tiny random-weight model written into `dir`.
void write_tiny_synth_job(const fs::path& dir, int count, const std::string& backend_extra = "") {
  batchlm::testing::write_tiny_llama(dir / "tiny.gguf");
  write_file(dir / "job.yaml",
             "name: tiny\n"
             "kind: synth\n"
             "synth: {count: " + std::to_string(count) + ", seed: 1, variables: {animal: [cat, dog, owl]}}\n"
             "request:\n"
             "  messages: [{role: user, content: \"A story about a {{animal}}.\"}]\n"
             "  max_tokens: 4\n"
             "backend: {type: local, model: tiny.gguf, threads: 1" + backend_extra + "}\n"
             "output: {path: out/tiny.jsonl}\n");
}

// Started with stderr closed (`2>&-`), a run must not let a file it opens take descriptor 2:
// the progress lines and the summary would go into it.
TEST(BatchlmRun, ClosedStandardStreamsDoNotSendTextIntoItsFiles) {
  TempDir dir;
  write_tiny_synth_job(dir.path, 3, ", step_log: steps.jsonl");
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {{"BATCHLM_MODEL", ""}}, .cwd = dir.path,
             .closed_fds = {STDERR_FILENO}});
  ASSERT_EQ(p.wait(60s), 0);
  const std::vector<json> records = read_jsonl(dir.path / "out/tiny.jsonl");
  EXPECT_EQ(records.size(), 3u);
  const std::string steps = read_file(dir.path / "steps.jsonl");
  EXPECT_FALSE(steps.empty());
  std::istringstream lines(steps);
  for (std::string line; std::getline(lines, line);)
    EXPECT_EQ(line.rfind("{\"step\"", 0), 0u) << "not a step line: " << line;
  // The lock file holds the pid, then the settings: one line of JSON.
  std::istringstream lock(read_file(dir.path / "out/tiny.jsonl.lock"));
  std::string pid, settings, rest;
  std::getline(lock, pid);
  std::getline(lock, settings);
  EXPECT_EQ(pid.find_first_not_of("0123456789"), std::string::npos) << pid;
  EXPECT_TRUE(json::parse(settings, nullptr, false).contains("model")) << settings;
  EXPECT_FALSE(std::getline(lock, rest)) << rest;
}

}  // namespace
}  // namespace batchlm::e2e

namespace batchlm::e2e {
namespace {

long long requests_seen(const FakeServer& server) { return server.stats()["requests"].get<long long>(); }

std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Whole records only (the file ends with a newline), each id once, none failed; their count.
std::size_t expect_whole_records(const fs::path& out) {
  const std::string text = read_file(out);
  EXPECT_TRUE(text.empty() || text.back() == '\n');
  const std::vector<json> records = read_jsonl(out);
  std::set<long long> ids;
  for (const auto& rec : records) {
    EXPECT_TRUE(ids.insert(rec["id"].get<long long>()).second) << "twice: " << rec.dump();
    EXPECT_TRUE(rec["error"].is_null()) << rec.dump();
  }
  return records.size();
}

// A closed terminal (SIGHUP) stops a run the way SIGTERM does: no new items, the ones in
// flight finish, the output is flushed, the summary written; the rerun does the rest.
TEST(BatchlmRun, SighupStopsGracefullyAndTheRerunCompletes) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--tokens", "20", "--token-delay-ms", "10"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 12, .concurrency = 1}));
  const fs::path out = dir.path / "out/e2e.jsonl";
  Process p({.args = {binary("batchlm"), "run", "job.yaml", "--set", "output.flush_every=1000",
                      "--set", "output.flush_interval=10m"},
             .env = {}, .cwd = dir.path, .out_file = dir.path / "run.out", .err_file = dir.path / "run.err"});
  // One item at a time: the fourth request means three items are finished (and buffered).
  ASSERT_TRUE(wait_until([&] { return requests_seen(server) >= 4; }));
  p.signal(SIGHUP);
  ASSERT_EQ(p.wait(30s), 130) << read_file(dir.path / "run.err");
  const std::string err = read_file(dir.path / "run.err");
  EXPECT_NE(err.find("hangup"), std::string::npos) << err;
  const std::size_t saved = expect_whole_records(out);
  EXPECT_GE(saved, 4u) << err;  // the three buffered and the one in flight
  const json summary = json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"));
  EXPECT_EQ(summary["interrupted"], true) << summary.dump(2);
  EXPECT_EQ(summary["counts"]["succeeded"].get<std::size_t>(), saved) << summary.dump(2);
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml", "--concurrency", "8"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  expect_each_id_once(read_jsonl(out), 12);
}

// Under `nohup` SIGHUP is ignored from the start: the run keeps it so and goes on.
TEST(BatchlmRun, SighupIgnoredAtStartStaysIgnored) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--tokens", "10", "--token-delay-ms", "10"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 6, .concurrency = 1}));
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {}, .cwd = dir.path,
             .out_file = dir.path / "run.out", .err_file = dir.path / "run.err", .ignored_signals = {SIGHUP}});
  ASSERT_TRUE(wait_until([&] { return requests_seen(server) >= 2; }));
  p.signal(SIGHUP);
  ASSERT_EQ(p.wait(30s), 0) << read_file(dir.path / "run.err");
  expect_each_id_once(read_jsonl(dir.path / "out/e2e.jsonl"), 6);
}

// Ctrl-\ (SIGQUIT) is "quit now": the finished items still buffered are written first.
TEST(BatchlmRun, SigquitExitsAtOnceKeepingFinishedItems) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--tokens", "20", "--token-delay-ms", "10"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 12, .concurrency = 1,
                                               .extra = "grace_period: 10m\n"}));
  const fs::path out = dir.path / "out/e2e.jsonl";
  Process p({.args = {binary("batchlm"), "run", "job.yaml", "--set", "output.flush_every=1000",
                      "--set", "output.flush_interval=10m"},
             .env = {}, .cwd = dir.path, .out_file = dir.path / "run.out", .err_file = dir.path / "run.err"});
  ASSERT_TRUE(wait_until([&] { return requests_seen(server) >= 4; }));
  p.signal(SIGQUIT);
  ASSERT_EQ(p.wait(20s), 130) << read_file(dir.path / "run.err");
  EXPECT_NE(read_file(dir.path / "run.err").find("exiting now"), std::string::npos);
  EXPECT_GE(expect_whole_records(out), 3u);
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml", "--concurrency", "8"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  expect_each_id_once(read_jsonl(out), 12);
}

// An item whose attempt fails in a way worth retrying while the run is stopping is unfinished,
// not failed: it gets no record (a failure was written after one of six attempts), counts as
// not run, and the next run sends it.
TEST(BatchlmRun, RetryableFailureDuringTheGracePeriodIsLeftForTheNextRun) {
  TempDir dir;
  // Every item's first attempt streams 10 tokens over about a second, then the connection resets.
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--tokens", "40", "--token-delay-ms", "100",
                               "--faults", "reset_after=10", "--fault-first-attempts", "1"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 4, .concurrency = 4,
                                               .extra = "grace_period: 10m\n"}));
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {}, .cwd = dir.path,
             .out_file = dir.path / "run.out", .err_file = dir.path / "run.err"});
  ASSERT_TRUE(wait_until([&] { return requests_seen(server) >= 4; }));
  p.signal(SIGINT);
  ASSERT_EQ(p.wait(30s), 130) << read_file(dir.path / "run.err");
  EXPECT_EQ(requests_seen(server), 4);  // no retry was sent while stopping
  const json summary = json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"));
  EXPECT_EQ(summary["counts"]["failed"], 0) << summary.dump(2);
  EXPECT_EQ(summary["counts"]["not_run"], 4) << summary.dump(2);
  EXPECT_TRUE(read_jsonl(dir.path / "out/e2e.jsonl").empty());

  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto records = read_jsonl(dir.path / "out/e2e.jsonl");
  expect_each_id_once(records, 4);
  for (const json& record : records) EXPECT_TRUE(record["error"].is_null()) << record.dump();
}

// A request waiting for tokens/min holds no requests/min permit: when the unused part of a large
// estimate comes back, the requests queued behind it still go out at the requests/min rate (31
// of them went at once, each holding a permit taken while it waited).
TEST(BatchlmRun, RequestsPerMinuteHoldsWhenTokensPerMinuteReleasesACrowd) {
  TempDir dir;
  // Two seconds an answer: the first request's estimate (100,000 tokens) is owed that long.
  FakeServer server(dir.path, {"--tokens", "20", "--token-delay-ms", "100"});
  std::string lines;
  for (int i = 0; i < 41; ++i) {
    const json body = {{"messages", json::array({{{"role", "user"}, {"content", "say " + std::to_string(i)}}})},
                       {"max_tokens", i == 0 ? 100000 : 16}};
    lines += json{{"custom_id", "r" + std::to_string(i)}, {"body", body}}.dump() + "\n";
  }
  write_file(dir.path / "batch.jsonl", lines);
  write_file(dir.path / "job.yaml", "name: pace\ninput: batch.jsonl\nbackend: {type: openai, base_url: \"" +
                                        server.base_url() + "\", model: fake-model}\nconcurrency: 32\n"
                                        "rate_limit: {requests_per_minute: 600, tokens_per_minute: 60000}\n"
                                        "output: {path: out/pace.jsonl}\n");
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto at = server.stats()["arrival_ms"].get<std::vector<double>>();
  ASSERT_EQ(at.size(), 41u);
  // 600 a minute: 10 a second after a burst of 10; one more for the edges of the window.
  for (const double t : at) {
    const auto in_second = std::count_if(at.begin(), at.end(), [&](double u) { return u >= t && u < t + 1000; });
    EXPECT_LE(in_second, 21) << "from " << t << " ms";
  }
}

// Without max_tokens an answer is estimated at 256 tokens; what streams past that is taken from
// the tokens/min bucket as it comes, not when the answer ends. Answers of 4,000 tokens over 8 s:
// the first burst goes out, then the streams' debt holds every other request back, where before
// requests went on leaving at the estimate's pace until the first answer ended (about 7 more
// from 2 s to 4 s), three times over the limit in the first minute.
TEST(BatchlmRun, TokensPerMinuteCountsOutputAsItStreams) {
  TempDir dir;
  FakeServer server(dir.path, {"--tokens", "4000", "--token-delay-ms", "2"});
  std::string lines;
  for (int i = 0; i < 60; ++i) lines += json{{"q", "say " + std::to_string(i)}}.dump() + "\n";
  write_file(dir.path / "in.jsonl", lines);
  write_file(dir.path / "job.yaml", "name: tpm\ninput: in.jsonl\nbackend: {type: openai, base_url: \"" +
                                        server.base_url() + "\", model: fake-model}\nconcurrency: 64\n"
                                        "request: {messages: [{role: user, content: \"{{q}}\"}]}\n"
                                        "rate_limit: {tokens_per_minute: 60000}\ngrace_period: 1s\n"
                                        "output: {path: out/tpm.jsonl}\n");
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {}, .cwd = dir.path,
             .out_file = dir.path / "run.out", .err_file = dir.path / "run.err"});
  ASSERT_TRUE(wait_until([&] { return requests_seen(server) >= 1; }));
  std::this_thread::sleep_for(4000ms);
  p.signal(SIGTERM);
  p.wait(30s);
  auto at = server.stats()["arrival_ms"].get<std::vector<double>>();
  ASSERT_GE(at.size(), 10u) << read_file(dir.path / "run.err");
  std::sort(at.begin(), at.end());
  // 5 s of tokens at once (5,000: about 19 requests of ~262), then one a quarter second until
  // the streams pass their estimate (0.5 s; later on a busy machine, where the server streams
  // slower); then none. Without the streamed output counted, one goes every quarter second
  // throughout: six or more from 2.5 s to the stop at 4 s.
  const auto late = std::count_if(at.begin(), at.end(), [&](double t) { return t - at.front() >= 2500; });
  EXPECT_LE(late, 2) << "requests started 2.5 s or more after the first";
}

// The retry budget spreads the retries of a crowd that failed at once: with 5 a second
// allowed, one every 200 ms, in the order they queued, and every item still done.
TEST(BatchlmRun, RetriesOfACrowdAreSpreadByTheBudget) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--faults", "status=500", "--fault-first-attempts", "1"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 12, .concurrency = 12}));
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml", "--set", "retry.budget_ratio=0", "--set",
                                       "retry.budget_min_per_second=5"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  expect_each_id_once(read_jsonl(dir.path / "out/e2e.jsonl"), 12);
  auto at = server.stats()["arrival_ms"].get<std::vector<double>>();
  ASSERT_EQ(at.size(), 24u);
  std::sort(at.begin(), at.end());
  // The first 12 are the first attempts, at once; then the retries.
  for (std::size_t i = 13; i < at.size(); ++i) EXPECT_GE(at[i] - at[i - 1], 150.0) << "retry " << i - 12;
}

// A second SIGTERM, like a second Ctrl-C, does not wait out the grace period.
TEST(BatchlmRun, SecondSigtermExitsAtOnce) {
  TempDir dir;
  // Streams of 100 s and a grace period of 10 minutes: only an exit now ends this run soon.
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--tokens", "2000", "--token-delay-ms", "50"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 20, .concurrency = 2,
                                               .extra = "grace_period: 10m\n"}));
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {}, .cwd = dir.path,
             .out_file = dir.path / "run.out", .err_file = dir.path / "run.err"});
  ASSERT_TRUE(wait_until([&] { return requests_seen(server) >= 2; }));
  p.signal(SIGTERM);
  ASSERT_TRUE(wait_until([&] { return read_file(dir.path / "run.err").find("no new items") != std::string::npos; }));
  p.signal(SIGTERM);
  ASSERT_EQ(p.wait(20s), 130) << read_file(dir.path / "run.err");
  EXPECT_NE(read_file(dir.path / "run.err").find("exiting now"), std::string::npos);
}

// A run that is already stopping by itself (here: the API refused ten requests in a row) takes
// the first Ctrl-C as the first: it says so, and the second exits at once.
TEST(BatchlmRun, CtrlCWhileTheRunStopsItselfIsAnsweredAndASecondExits) {
  TempDir dir;
  // With seed 14, the first question is answered (slowly: 2,000 tokens 50 ms apart) and the
  // next ten are refused, so the run stops sending while the first is still streaming.
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--tokens", "2000", "--token-delay-ms", "50",
                               "--fault-rate", "0.9", "--seed", "14", "--faults",
                               "status=401;code=invalid_api_key;message=Incorrect API key provided"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 50, .concurrency = 2,
                                               .max_attempts = 1, .extra = "grace_period: 10m\n"}));
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {}, .cwd = dir.path,
             .out_file = dir.path / "run.out", .err_file = dir.path / "run.err"});
  ASSERT_TRUE(wait_until([&] { return read_file(dir.path / "run.err").find("no new items") != std::string::npos; }, 30s))
      << read_file(dir.path / "run.err");
  EXPECT_NE(read_file(dir.path / "run.err").find("the API refused the last 10 requests"), std::string::npos);
  p.signal(SIGINT);
  ASSERT_TRUE(wait_until([&] {
    return read_file(dir.path / "run.err").find("interrupted: already stopping; waiting for 1 in flight (Ctrl-C again to exit now)") !=
           std::string::npos;
  })) << read_file(dir.path / "run.err");
  p.signal(SIGINT);
  ASSERT_EQ(p.wait(20s), 130) << read_file(dir.path / "run.err");
  EXPECT_NE(read_file(dir.path / "run.err").find("interrupted twice, exiting now"), std::string::npos);
}

// Many systems start a process with 1024 open files allowed (the soft limit) and let it raise
// that to a far higher hard limit. A run of more streams than the soft limit used to fail their
// connections with "too many open files", retry them until they failed for good, and lose the
// summary; it now raises the limit, and where the hard limit is too low, runs fewer at once.
TEST(BatchlmRun, ConcurrencyBeyondTheOpenFileLimitStillRunsEveryItemOnce) {
  TempDir dir;
  // Each answer streams for about half a second, so all 200 are open at once.
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--tokens", "20", "--token-delay-ms", "25"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 200, .concurrency = 200}));
  const auto run = [&](long long soft, long long hard) {
    Process p({.args = {binary("batchlm"), "run", "job.yaml", "--fresh"}, .env = {}, .cwd = dir.path,
               .out_file = dir.path / "run.out", .err_file = dir.path / "run.err",
               .open_files_soft = soft, .open_files_hard = hard});
    return p.wait(120s);
  };
  // A soft limit of 64 under a hard one of 4096: raised, and all 200 run at once.
  ASSERT_EQ(run(64, 4096), 0) << read_file(dir.path / "run.err");
  json summary = json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"));
  EXPECT_EQ(summary["attempts"]["total"], 200) << summary.dump(2);
  EXPECT_EQ(read_file(dir.path / "run.err").find("ulimit"), std::string::npos) << read_file(dir.path / "run.err");
  expect_each_id_once(read_jsonl(dir.path / "out/e2e.jsonl"), 200);
  // A hard limit of 100: fewer at once, said up front, and still every item once, first time.
  ASSERT_EQ(run(100, 100), 0) << read_file(dir.path / "run.err");
  EXPECT_NE(read_file(dir.path / "run.err")
                .find("concurrency 200 needs a socket per request, but this process may have only 100 files open "
                      "(its hard limit, ulimit -Hn); running 36 at once"),
            std::string::npos)
      << read_file(dir.path / "run.err");
  summary = json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"));
  EXPECT_EQ(summary["attempts"]["total"], 200) << summary.dump(2);
  expect_each_id_once(read_jsonl(dir.path / "out/e2e.jsonl"), 200);
}

// stderr into a pipe nobody reads any more (`2>&1 | head -1`, a log reader that died): the
// progress lines and the summary are lost, but not the run.
TEST(BatchlmRun, ClosedStderrPipeDoesNotKillTheRun) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file()});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 10}));
  int ends[2];
  ASSERT_EQ(::pipe(ends), 0);
  ::close(ends[0]);  // no reader: a write gets SIGPIPE, or EPIPE when that is ignored
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {}, .cwd = dir.path,
             .out_file = dir.path / "run.out", .err_fd = ends[1]});
  ::close(ends[1]);
  ASSERT_EQ(p.wait(30s), 0);
  expect_each_id_once(read_jsonl(dir.path / "out/e2e.jsonl"), 10);
  const json summary = json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"));
  EXPECT_EQ(summary["counts"]["succeeded"], 10) << summary.dump(2);
}

// Ctrl-C typed at the terminal: the terminal echoes "^C" after the bar, which must still fit
// on the bar's row (a wrapped "C" would be left on a row of its own); the run stops gracefully.
TEST(BatchlmProgress, CtrlCAtTheTerminalStopsTheRunAndLeavesNoFragments) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--tokens", "20", "--token-delay-ms", "10"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 60, .concurrency = 2}));
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {{"TERM", "xterm"}}, .cwd = dir.path,
             .out_file = {}, .err_file = {}, .use_pty = true, .pty_columns = 100});
  ASSERT_TRUE(wait_until([&] { return p.pty_output().find("in-flight 2") != std::string::npos; }));
  p.pty_send("\x03");
  ASSERT_EQ(p.wait(30s), 130) << p.pty_output();
  const std::string& screen = p.pty_output();
  EXPECT_NE(screen.find("^C"), std::string::npos) << "the terminal did not echo: " << screen;
  EXPECT_NE(screen.find("batchlm: interrupted: no new items"), std::string::npos) << screen;
  EXPECT_NE(screen.find("run the same command again to resume"), std::string::npos) << screen;
  EXPECT_LE(widest_row(screen), 100u) << screen;
}

// TERM=dumb (an editor's shell buffer) cannot redraw a line in place: plain lines, as in a log.
TEST(BatchlmProgress, DumbTerminalGetsPlainLines) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file()});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 5}));
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {{"TERM", "dumb"}}, .cwd = dir.path,
             .out_file = {}, .err_file = {}, .use_pty = true, .pty_columns = 100});
  ASSERT_EQ(p.wait(30s), 0) << p.pty_output();
  const std::string& screen = p.pty_output();
  EXPECT_EQ(screen.find('\x1b'), std::string::npos) << screen;
  EXPECT_NE(screen.find("[batchlm] 5/5 (100.0%)"), std::string::npos) << screen;
  EXPECT_NE(screen.find("5 items: 5 succeeded"), std::string::npos) << screen;
}

// Ctrl-C on a dumb terminal: its echo ("^C") cannot be erased, so the message starts on the
// next line rather than running on from it.
TEST(BatchlmProgress, CtrlCOnADumbTerminalStartsItsMessageOnALineOfItsOwn) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--tokens", "20", "--token-delay-ms", "10"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 400, .concurrency = 2}));
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {{"TERM", "dumb"}}, .cwd = dir.path,
             .out_file = {}, .err_file = {}, .use_pty = true, .pty_columns = 100});
  // The first plain line comes once the run is under way.
  ASSERT_TRUE(wait_until([&] { return p.pty_output().find("[batchlm] ") != std::string::npos; })) << p.pty_output();
  p.pty_send("\x03");
  ASSERT_EQ(p.wait(30s), 130) << p.pty_output();
  const std::string& screen = p.pty_output();
  EXPECT_EQ(screen.find('\x1b'), std::string::npos) << screen;
  ASSERT_NE(screen.find("^C"), std::string::npos) << "the terminal did not echo: " << screen;
  EXPECT_EQ(screen.find("^Cbatchlm"), std::string::npos) << screen;
  const std::size_t message = screen.find("batchlm: interrupted: no new items");
  ASSERT_NE(message, std::string::npos) << screen;
  ASSERT_GT(message, 0u);
  EXPECT_EQ(screen[message - 1], '\n') << screen;
}

}  // namespace
}  // namespace batchlm::e2e

namespace batchlm::e2e {
namespace {

// `batchlm serve` started in a terminal that closes (SIGHUP) shuts down as on SIGTERM: it
// stops accepting, lets requests in flight finish, says so and exits 0.
TEST(BatchlmServe, SighupShutsDownGracefully) {
  TempDir dir;
  batchlm::testing::write_tiny_llama(dir.path / "tiny.gguf");
  Process p({.args = {binary("batchlm"), "serve", "-m", "tiny.gguf", "--port", "0", "--threads", "1",
                      "--no-kv-commit"},
             .env = {}, .cwd = dir.path, .out_file = dir.path / "serve.out", .err_file = dir.path / "serve.err"});
  ASSERT_TRUE(wait_until([&] { return read_file(dir.path / "serve.out").find("listening on") != std::string::npos; }))
      << read_file(dir.path / "serve.err");
  p.signal(SIGHUP);
  ASSERT_EQ(p.wait(30s), 0) << read_file(dir.path / "serve.err");
  const std::string err = read_file(dir.path / "serve.err");
  EXPECT_NE(err.find("batchlm serve: SIGHUP: finishing 0 choices in flight"), std::string::npos) << err;
  EXPECT_NE(err.find("batchlm serve: stopped"), std::string::npos) << err;
}

}  // namespace
}  // namespace batchlm::e2e

namespace batchlm::e2e {
namespace {

// An output that cannot take more (a full disk, a file size limit): the run says so once,
// sends no new items, keeps the records it could not write for as long as it runs, ends with
// exit 1 and a summary that says how many finished items were not saved; the rerun, once there
// is room, does the rest.
TEST(BatchlmRun, OutputThatCannotBeWrittenStopsTheRunWithOneClearMessage) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file()});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 200, .concurrency = 4}));
  const fs::path out = dir.path / "out/e2e.jsonl";
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {}, .cwd = dir.path,
             .out_file = dir.path / "run.out", .err_file = dir.path / "run.err",
             .file_size_limit = 20000});  // about 20 records; the summary is smaller
  ASSERT_EQ(p.wait(60s), 1) << read_file(dir.path / "run.err");
  const std::string err = read_file(dir.path / "run.err");
  EXPECT_EQ(count_of(err, "cannot write out/e2e.jsonl: File too large"), 2u) << err;  // the stop, the end
  EXPECT_NE(err.find("no new items"), std::string::npos) << err;
  EXPECT_NE(err.find("finished items could not be saved"), std::string::npos) << err;
  EXPECT_LT(requests_seen(server), 100) << "items kept being sent: " << err;
  const json summary = json::parse(read_file(dir.path / "out/e2e.jsonl.summary.json"));
  EXPECT_GT(summary["output_error"]["unsaved"].get<long long>(), 0) << summary.dump(2);
  // The counts say it too, beside the successes that include those items.
  EXPECT_EQ(summary["counts"]["unsaved"], summary["output_error"]["unsaved"]) << summary.dump(2);
  EXPECT_NE(err.find(" of them not saved (the output failed): a rerun does them again"), std::string::npos) << err;
  EXPECT_EQ(summary["interrupted"], false) << summary.dump(2);

  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  expect_each_id_once(read_jsonl(out), 200);
}

// When not even the summary fits, no half-written summary file is left behind.
TEST(BatchlmRun, SummaryThatCannotBeWrittenLeavesNoPartialFile) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file()});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 10}));
  Process p({.args = {binary("batchlm"), "run", "job.yaml"}, .env = {}, .cwd = dir.path,
             .out_file = dir.path / "run.out", .err_file = dir.path / "run.err", .file_size_limit = 600});
  ASSERT_EQ(p.wait(60s), 1) << read_file(dir.path / "run.err");
  EXPECT_NE(read_file(dir.path / "run.err").find("summary not written"), std::string::npos);
  EXPECT_FALSE(fs::exists(dir.path / "out/e2e.jsonl.summary.json"));
  EXPECT_FALSE(fs::exists(dir.path / "out/e2e.jsonl.summary.json.tmp"));
}

// Every item succeeded and is saved, but the summary could not be written (a directory holds its
// name): the run says so and exits 1, so that a script does not go looking for it.
// A directory where the summary (or its temporary file) goes would fail the summary after
// every request was sent: the run refuses it first, sends nothing, and keeps the directory.
TEST(BatchlmRun, ASummaryThatCouldNotBeWrittenIsRefusedBeforeTheRun) {
  for (const std::string name : {"out/e2e.jsonl.summary.json", "out/e2e.jsonl.summary.json.tmp"}) {
    TempDir dir;
    FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file()});
    write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 3}));
    fs::create_directories(dir.path / name);
    write_file(dir.path / name / "keep", "");
    RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(name + " is a directory, where output out/e2e.jsonl keeps its summary"), std::string::npos)
        << r.err;
    EXPECT_EQ(server.stats()["requests"], 0);
    EXPECT_TRUE(fs::exists(dir.path / name / "keep"));
  }
}

}  // namespace
}  // namespace batchlm::e2e

namespace batchlm::e2e {
namespace {

// A job with no items (an empty input, --limit 0) says so instead of drawing a bar of nothing.
TEST(BatchlmRun, JobWithoutItemsSaysSo) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file()});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 5}));
  write_file(dir.path / "empty.jsonl", "");
  for (const std::vector<std::string>& args : {std::vector<std::string>{"run", "job.yaml", "--limit", "0"},
                                               std::vector<std::string>{"run", "job.yaml", "--set", "input=empty.jsonl"}}) {
    Process p({.args = {binary("batchlm"), args[0], args[1], args[2], args[3]}, .env = {}, .cwd = dir.path,
               .out_file = {}, .err_file = {}, .use_pty = true, .pty_columns = 100});
    ASSERT_EQ(p.wait(30s), 0) << p.pty_output();
    const std::string& screen = p.pty_output();
    EXPECT_NE(screen.find("batchlm: note: the job has no items"), std::string::npos) << screen;
    EXPECT_EQ(screen.find("eta"), std::string::npos) << screen;
    EXPECT_NE(screen.find("0 items: 0 succeeded, 0 failed"), std::string::npos) << screen;
  }
  EXPECT_EQ(requests_seen(server), 0);
}

}  // namespace
}  // namespace batchlm::e2e

namespace batchlm::e2e {
namespace {

// A run in the background of its terminal (`&`, or Ctrl-Z then `bg`) does not redraw its bar
// over the shell the user types in; the last bar and the summary come at the end, on lines of
// their own.
TEST(BatchlmProgress, BackgroundRunDrawsNoBarOverTheShell) {
  TempDir dir;
  FakeServer server(dir.path, {"--gsm8k", gsm8k_test_file(), "--tokens", "10", "--token-delay-ms", "10"});
  write_file(dir.path / "job.yaml", gsm8k_job({.base_url = server.base_url(), .limit = 12, .concurrency = 4}));
  // A shell with job control gives the background job a process group of its own, which is
  // not the terminal's foreground group.
  Process p({.args = {"/bin/bash", "--norc", "-c", "set -m; '" + binary("batchlm") + "' run job.yaml & wait $!"},
             .env = {{"TERM", "xterm"}}, .cwd = dir.path, .out_file = {}, .err_file = {}, .use_pty = true,
             .pty_columns = 100});
  ASSERT_EQ(p.wait(60s), 0) << p.pty_output();
  const std::string& screen = p.pty_output();
  EXPECT_NE(screen.find("12/12 100.0%"), std::string::npos) << screen;
  EXPECT_NE(screen.find("12 items: 12 succeeded"), std::string::npos) << screen;
  // The terminal turns "\n" into "\r\n": any other "\r" is a redraw.
  for (std::size_t at = screen.find('\r'); at != std::string::npos; at = screen.find('\r', at + 1))
    ASSERT_EQ(screen.substr(at, 2), "\r\n") << "a redraw at byte " << at << ": " << screen;
}

// ---- tool calls --------------------------------------------------------------------------------

const char* const kToolsYaml =
    "  extra:\n"
    "    tools:\n"
    "      - {type: function, function: {name: get_weather, parameters: {type: object}}}\n"
    "      - {type: function, function: {name: get_time, parameters: {type: object}}}\n";

// A job over questions.jsonl with this `request` section, against `server`'s `model`, streamed or
// not, retried at once, written to `out`.
std::string retried_api_job(const FakeServer& server, const std::string& request, const std::string& model, bool stream,
                            const std::string& out) {
  return "input: questions.jsonl\n" + request + "backend: {type: openai, base_url: \"" + server.base_url() +
         "\", model: " + model + ", stream: " + (stream ? "true" : "false") +
         "}\n"
         "retry: {max_attempts: 3, base: 10ms, cap: 50ms}\n"
         "output: " + out + "\n";
}

// A tool-calling job against an API: each record holds the calls whole, streamed or not, even
// where every first attempt's stream was cut inside a call.
TEST(BatchlmRun, ToolCallsAreRecordedWholeAndACallCutShortIsRetried) {
  TempDir dir;
  FakeServer server(dir.path, {"--fault-rate", "1", "--faults", "reset_after=3", "--fault-first-attempts", "1"});
  for (const bool stream : {true, false}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    // Questions of their own: the server counts first attempts by question.
    std::string questions;
    for (int i = 1; i <= 6; ++i)
      questions += json{{"question", "Weather in city " + std::to_string(i) + (stream ? "?" : "!")}}.dump() + "\n";
    write_file(dir.path / "questions.jsonl", questions);
    const std::string out = stream ? "out/stream.jsonl" : "out/whole.jsonl";
    write_file(dir.path / "job.yaml",
               retried_api_job(server, "request:\n"
                                       "  messages:\n"
                                       "    - {role: user, content: \"{{question}}\"}\n" +
                                           std::string(kToolsYaml),
                               "fake-model", stream, out));
    RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto records = read_jsonl(dir.path / out);
    ASSERT_EQ(records.size(), 6u);
    for (const auto& rec : records) {
      SCOPED_TRACE(rec.dump());
      EXPECT_TRUE(rec["error"].is_null());
      EXPECT_EQ(rec["finish_reason"], "tool_calls");
      EXPECT_EQ(rec["output"], "");
      EXPECT_EQ(rec["attempts"], 2);  // a stream is cut inside the first call, a whole answer before any byte
      ASSERT_TRUE(rec["tool_calls"].is_array());
      ASSERT_EQ(rec["tool_calls"].size(), 2u);
      for (int k = 0; k < 2; ++k) {
        const json& call = rec["tool_calls"][k];
        EXPECT_EQ(call["type"], "function");
        EXPECT_EQ(call["function"]["name"], k == 0 ? "get_weather" : "get_time");
        EXPECT_FALSE(call.contains("index"));
        const json arguments = json::parse(call["function"]["arguments"].get<std::string>());
        EXPECT_EQ(arguments, (json{{"query", rec["input"]["question"]}, {"call", k}}));
      }
    }
    // The keys in the documented order: the calls right after the output.
    std::istringstream lines(read_file(dir.path / out));
    for (std::string line; std::getline(lines, line);) {
      const auto output = line.find("\"output\":");
      const auto calls = line.find("\"tool_calls\":");
      const auto reason = line.find("\"finish_reason\":");
      ASSERT_NE(calls, std::string::npos) << line;
      EXPECT_TRUE(output < calls && calls < reason) << line;
    }
  }
}

// A Batch-API file of conversations with calls and their results: sent whole, so the API
// accepts them (it refuses a tool message that answers no call made before it).
TEST(BatchlmRun, ToolConversationsOfABatchFileReachTheApiWhole) {
  TempDir dir;
  FakeServer server(dir.path);
  std::string lines;
  for (int i = 1; i <= 3; ++i) {
    const std::string id = "call_" + std::to_string(i);
    const json body = {
        {"model", "fake-model"},
        {"messages",
         {{{"role", "user"}, {"content", "Weather in city " + std::to_string(i) + "?"}},
          {{"role", "assistant"},
           {"content", nullptr},
           {"tool_calls", {{{"id", id}, {"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", "{}"}}}}}}},
          {{"role", "tool"}, {"tool_call_id", id}, {"content", std::to_string(10 + i) + " C"}}}}};
    lines += json{{"custom_id", "c" + std::to_string(i)}, {"method", "POST"}, {"url", "/v1/chat/completions"}, {"body", body}}.dump() + "\n";
  }
  write_file(dir.path / "batch.jsonl", lines);
  write_file(dir.path / "job.yaml", "input: batch.jsonl\nbackend: {type: openai, base_url: \"" + server.base_url() +
                                        "\"}\noutput: out/batch.jsonl\n");
  RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto records = read_jsonl(dir.path / "out/batch.jsonl");
  ASSERT_EQ(records.size(), 3u);
  for (const auto& rec : records) {
    const std::string n = rec["id"].get<std::string>().substr(1);
    EXPECT_EQ(rec["output"], "The tool said: " + std::to_string(10 + std::stoi(n)) + " C") << rec.dump();
    EXPECT_FALSE(rec.contains("tool_calls")) << rec.dump();
  }

  // A call whose arguments are not JSON text is named, with its line, before anything is sent.
  write_file(dir.path / "batch.jsonl",
             lines + R"({"custom_id": "bad", "body": {"messages": [{"role": "user", "content": "hi"}, )"
                     R"({"role": "assistant", "tool_calls": [{"id": "x", "type": "function", "function": )"
                     R"({"name": "f", "arguments": {"a": 1}}}]}]}})" "\n");
  RunResult bad = run_batchlm(dir.path, {"run", "job.yaml", "--output", "out/bad.jsonl"});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("batch.jsonl:4"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("body.messages[1].tool_calls[0].function.arguments"), std::string::npos) << bad.err;
  // And so is a tool message that answers no call made before it, which the API would refuse.
  write_file(dir.path / "batch.jsonl",
             lines + R"({"custom_id": "stray", "body": {"messages": [{"role": "user", "content": "hi"}, )"
                     R"({"role": "tool", "tool_call_id": "call_9", "content": "18 C"}]}})" "\n");
  RunResult stray = run_batchlm(dir.path, {"run", "job.yaml", "--output", "out/stray.jsonl"});
  EXPECT_EQ(stray.exit_code, 2) << stray.err;
  EXPECT_NE(stray.err.find("body.messages[1].tool_call_id: answers the call 'call_9', which no earlier assistant message made"),
            std::string::npos)
      << stray.err;
}

// A reasoning model's reasoning, given apart by an API (reasoning_content) or by the embedded
// engine (the <think> block a DeepSeek-R1 distill's prompt opens), is the record's `reasoning`,
// right after the output, which holds only the answer.
TEST(BatchlmRun, ReasoningIsRecordedApartFromTheOutput) {
  TempDir dir;
  FakeServer server(dir.path, {"--fault-rate", "1", "--faults", "reset_after=2", "--fault-first-attempts", "1"});
  for (const bool stream : {true, false}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    const std::string out = stream ? "out/stream.jsonl" : "out/whole.jsonl";
    // Questions of their own: the server counts first attempts by question.
    std::string questions;
    for (int i = 1; i <= 3; ++i) questions += json{{"question", "Question " + std::to_string(i) + (stream ? "?" : "!")}}.dump() + "\n";
    write_file(dir.path / "questions.jsonl", questions);
    write_file(dir.path / "job.yaml",
               retried_api_job(server, "request: {messages: [{role: user, content: \"{{question}}\"}]}\n", "fake-reasoner",
                               stream, out));
    RunResult r = run_batchlm(dir.path, {"run", "job.yaml"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto records = read_jsonl(dir.path / out);
    ASSERT_EQ(records.size(), 3u);
    for (const auto& rec : records) {
      SCOPED_TRACE(rec.dump());
      EXPECT_TRUE(rec["error"].is_null());
      // The first attempt was cut inside the reasoning; the record holds the second's, once.
      EXPECT_EQ(rec["attempts"], 2);
      EXPECT_EQ(rec["reasoning"], "First I read the question, then I answer it.");
      EXPECT_FALSE(rec["output"].get<std::string>().empty());
      EXPECT_EQ(rec["output"].get<std::string>().find("First I read"), std::string::npos);
    }
    std::istringstream lines(read_file(dir.path / out));
    for (std::string line; std::getline(lines, line);)
      EXPECT_LT(line.find("\"output\":"), line.find("\"reasoning\":")) << line;
  }

  const std::string r1 =
      read_file(fs::path(BATCHLM_SOURCE_DIR) / "models/vocab/templates/deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja");
  ASSERT_FALSE(r1.empty());  // fetched with Qwen's
  batchlm::testing::TinyLlamaOptions o;
  o.chat_template = r1;
  batchlm::testing::write_tiny_llama(dir.path / "r1.gguf", o);
  write_file(dir.path / "local.yaml",
             "synth: {count: 2, seed: 3, variables: {q: [one, two, three]}}\n"
             "request: {messages: [{role: user, content: \"Question {{q}}\"}], max_tokens: 12, temperature: 0}\n"
             "backend: {type: local, threads: 1, model: r1.gguf}\n");
  RunResult apart = run_batchlm(dir.path, {"run", "local.yaml", "--output", "out/apart.jsonl"});
  ASSERT_EQ(apart.exit_code, 0) << apart.err;
  RunResult kept = run_batchlm(dir.path, {"run", "local.yaml", "--output", "out/inline.jsonl", "--set", "backend.reasoning=inline"});
  ASSERT_EQ(kept.exit_code, 0) << kept.err;
  const auto split = read_jsonl(dir.path / "out/apart.jsonl"), whole = read_jsonl(dir.path / "out/inline.jsonl");
  ASSERT_EQ(split.size(), 2u);
  ASSERT_EQ(whole.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    SCOPED_TRACE(split[i].dump() + "\n" + whole[i].dump());
    // A tiny random model never closes the block: its whole answer is reasoning.
    EXPECT_EQ(split[i]["output"], "");
    ASSERT_TRUE(split[i]["reasoning"].is_string());
    EXPECT_FALSE(split[i]["reasoning"].get<std::string>().empty());
    EXPECT_NE(whole[i]["output"].get<std::string>().find(split[i]["reasoning"].get<std::string>()), std::string::npos);
    EXPECT_FALSE(whole[i].contains("reasoning"));
    // Other records: other settings, so neither run resumes the other's output.
    EXPECT_NE(split[i]["settings"], whole[i]["settings"]);
  }
}

// Tools on the embedded engine: a model whose chat template lists tools (Qwen 2.5's) is shown
// them and the conversation's calls and results; one whose template does not refuses them when
// the model is loaded, naming the field, rather than running with them dropped.
TEST(BatchlmRun, TheEmbeddedEngineTakesToolsWhereItsTemplateListsThem) {
  TempDir dir;
  const std::string qwen = read_file(fs::path(BATCHLM_SOURCE_DIR) / "models/vocab/templates/Qwen-Qwen2.5-7B-Instruct.jinja");
  if (qwen.empty()) GTEST_SKIP() << "Qwen2.5's template is absent (scripts/fetch-vocabs.sh fetches it)";
  batchlm::testing::TinyLlamaOptions tools_model;
  tools_model.chat_template = qwen;
  tools_model.context_length = 2048;
  batchlm::testing::write_tiny_llama(dir.path / "qwen.gguf", tools_model);
  batchlm::testing::write_tiny_llama(dir.path / "plain.gguf");
  const std::string job =
      "synth: {count: 2}\n"
      "request:\n"
      "  messages:\n"
      "    - {role: user, content: \"Weather?\"}\n"
      "    - role: assistant\n"
      "      tool_calls: [{id: call_1, type: function, function: {name: get_weather, arguments: '{\"city\": \"Oslo\"}'}}]\n"
      "    - {role: tool, tool_call_id: call_1, content: \"-3 C\"}\n"
      "  max_tokens: 4\n" +
      std::string(kToolsYaml) + "backend: {type: local, threads: 1, model: ";
  // Llama 3.1's template lists them too, in the first user message (fetched with Qwen's).
  const std::string llama =
      read_file(fs::path(BATCHLM_SOURCE_DIR) / "models/vocab/templates/meta-llama-Llama-3.1-8B-Instruct.jinja");
  ASSERT_FALSE(llama.empty());
  batchlm::testing::TinyLlamaOptions llama_model = tools_model;
  llama_model.chat_template = llama;
  batchlm::testing::write_tiny_llama(dir.path / "llama.gguf", llama_model);
  for (const std::string name : {"qwen", "llama"}) {
    SCOPED_TRACE(name);
    write_file(dir.path / "job.yaml", job + name + ".gguf}\n");
    RunResult ok = run_batchlm(dir.path, {"run", "job.yaml", "--output", "out/" + name + ".jsonl"});
    ASSERT_EQ(ok.exit_code, 0) << ok.err;
    const auto records = read_jsonl(dir.path / ("out/" + name + ".jsonl"));
    ASSERT_EQ(records.size(), 2u);
    for (const auto& rec : records) {
      EXPECT_TRUE(rec["error"].is_null()) << rec.dump();
      // The tools, the call and its result are in the prompt: far more than the three messages' words.
      EXPECT_GT(rec["usage"]["prompt_tokens"].get<long long>(), 300) << rec.dump();
    }
  }

  // A forced tool_choice: every record is a call of the tool named, whatever the (random) model.
  const std::string forced_job =
      "synth: {count: 2}\n"
      "request:\n"
      "  messages: [{role: user, content: \"Celsius, please.\"}]\n"
      "  max_tokens: 1100\n"
      "  extra:\n"
      "    tools:\n"
      "      - {type: function, function: {name: get_weather, parameters: {type: object}}}\n"
      "      - {type: function, function: {name: set_unit, parameters: {type: object, properties: {unit: {enum: [C, F]}},\n"
      "                                                                 required: [unit], additionalProperties: false}}}\n"
      "    tool_choice: {type: function, function: {name: set_unit}}\n"
      "backend: {type: local, threads: 1, model: qwen.gguf}\n";
  write_file(dir.path / "job.yaml", forced_job);
  RunResult forced = run_batchlm(dir.path, {"run", "job.yaml", "--output", "out/forced.jsonl"});
  ASSERT_EQ(forced.exit_code, 0) << forced.err;
  const auto forced_records = read_jsonl(dir.path / "out/forced.jsonl");
  ASSERT_EQ(forced_records.size(), 2u);
  for (const auto& rec : forced_records) {
    EXPECT_EQ(rec["finish_reason"], "tool_calls") << rec.dump();
    ASSERT_TRUE(rec["tool_calls"].is_array() && rec["tool_calls"].size() == 1) << rec.dump();
    EXPECT_EQ(rec["tool_calls"][0]["function"]["name"], "set_unit") << rec.dump();
    const auto arguments = nlohmann::json::parse(rec["tool_calls"][0]["function"]["arguments"].get<std::string>());
    EXPECT_TRUE(arguments == nlohmann::json({{"unit", "C"}}) || arguments == nlohmann::json({{"unit", "F"}})) << rec.dump();
  }
  // A function the tools do not have is refused before the run, by line and field.
  std::string missing = forced_job;
  missing.replace(missing.find("name: set_unit}}"), 16, "name: set_mode}}");
  write_file(dir.path / "job.yaml", missing);
  RunResult unknown = run_batchlm(dir.path, {"run", "job.yaml", "--output", "out/unknown.jsonl"});
  EXPECT_EQ(unknown.exit_code, 2) << unknown.err;
  EXPECT_NE(unknown.err.find("job.yaml:10:"), std::string::npos) << unknown.err;
  EXPECT_NE(unknown.err.find("request.extra.tool_choice: names the function \"set_mode\", which is not among the tools"),
            std::string::npos)
      << unknown.err;

  write_file(dir.path / "job.yaml", job + "plain.gguf}\n");
  RunResult refused = run_batchlm(dir.path, {"run", "job.yaml", "--output", "out/plain.jsonl"});
  EXPECT_EQ(refused.exit_code, 2) << refused.err;
  EXPECT_NE(refused.err.find("job.yaml:"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("request.extra.tools: this model's chat template (chatml) does not list tools"),
            std::string::npos)
      << refused.err;
  EXPECT_FALSE(fs::exists(dir.path / "out/plain.jsonl"));
  // Without the tools, the call in the conversation is what it cannot show.
  const std::string without_tools = job.substr(0, job.find("  extra:")) + "backend: {type: local, threads: 1, model: plain.gguf}\n";
  write_file(dir.path / "job.yaml", without_tools);
  RunResult call = run_batchlm(dir.path, {"run", "job.yaml", "--output", "out/plain.jsonl"});
  EXPECT_EQ(call.exit_code, 2) << call.err;
  EXPECT_NE(call.err.find("job.yaml:6:"), std::string::npos) << call.err;
  EXPECT_NE(call.err.find("request.messages[1].tool_calls: this model's chat template (chatml) does not list tools"),
            std::string::npos)
      << call.err;

  // The same fields are held to the API's form in a job file.
  write_file(dir.path / "job.yaml",
             "synth: {count: 2}\n"
             "request:\n"
             "  messages:\n"
             "    - {role: user, content: \"Weather?\"}\n"
             "    - role: assistant\n"
             "      tool_calls: [{id: call_1, type: function, function: {name: get_weather, arguments: {}}}]\n"
             "backend: {type: openai, base_url: \"http://127.0.0.1:9/v1\"}\n");
  RunResult bad = run_batchlm(dir.path, {"run", "job.yaml"});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("job.yaml:6:"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("request.messages[1].tool_calls[0].function.arguments: required: a string"), std::string::npos)
      << bad.err;
}

}  // namespace
}  // namespace batchlm::e2e
