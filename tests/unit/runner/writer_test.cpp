#include "batchlm/runner/writer.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <vector>

namespace batchlm::runner {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using std::chrono::milliseconds;

// A fresh directory per test, removed afterwards.
class OutputWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "batchlm-writer-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    path_ = (dir_ / "out.jsonl").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  OutputWriter::Options options(int flush_every = 64, milliseconds interval = milliseconds{1000}) const {
    OutputWriter::Options o;
    o.path = path_;
    o.flush_every = flush_every;
    o.flush_interval = interval;
    return o;
  }

  void write_raw(const std::string& text) const {
    std::ofstream out(path_, std::ios::binary | std::ios::trunc);
    out << text;
  }

  // Read through a separate descriptor: what another process would see.
  std::string read_raw() const { return read_file(path_); }
  static std::string read_file(const std::string& path) {
    std::string text;
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) return text;
    char block[4096];
    ssize_t n;
    while ((n = ::read(fd, block, sizeof block)) > 0) text.append(block, static_cast<std::size_t>(n));
    ::close(fd);
    return text;
  }

  std::vector<json> read_records() const {
    std::vector<json> records;
    std::istringstream in(read_raw());
    for (std::string line; std::getline(in, line);) records.push_back(json::parse(line));
    return records;
  }

  fs::path dir_;
  std::string path_;
};

json ok(int id, std::string output = "answer") {
  return {{"id", id}, {"output", std::move(output)}, {"error", nullptr}};
}

json failed(int id) {
  return {{"id", id}, {"output", nullptr}, {"error", {{"kind", "http"}, {"status", 503}, {"message", "busy"}}}};
}

std::string line(const json& record) { return record.dump() + "\n"; }

// Lowers the file size limit (ulimit -f) of this process for its lifetime.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(std::size_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &previous_);
    rlimit lowered = previous_;
    lowered.rlim_cur = static_cast<rlim_t>(bytes);
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &lowered), 0);
  }
  ~FileSizeLimit() { ::setrlimit(RLIMIT_FSIZE, &previous_); }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit previous_{};
};

TEST_F(OutputWriterTest, FreshFileStartsEmptyAndCreatesParentDirectories) {
  path_ = (dir_ / "a" / "b" / "out.jsonl").string();
  {
    OutputWriter writer(options());
    EXPECT_EQ(writer.resume_info().kept, 0);
    EXPECT_TRUE(writer.resume_info().done_ids.empty());
    EXPECT_TRUE(fs::exists(path_));
    writer.append(ok(1));
  }
  EXPECT_EQ(read_raw(), line(ok(1)));
}

TEST_F(OutputWriterTest, ResumeReportsDoneIdsAndAppendsAfterThem) {
  write_raw(line(ok(1)) + line(ok(2)) + line(json{{"id", "x-7"}, {"output", "o"}, {"error", nullptr}}));
  std::vector<json> seen;
  {
    OutputWriter writer(options(), [&](const json& r) { seen.push_back(r); });
    const auto& info = writer.resume_info();
    EXPECT_EQ(info.kept, 3);
    EXPECT_EQ(info.done_ids, (std::unordered_set<std::string>{"1", "2", "\"x-7\""}));
    EXPECT_FALSE(info.dropped_torn_line);
    EXPECT_EQ(info.dropped_failed(), 0);
    writer.append(ok(3));
  }
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0], ok(1));
  const auto records = read_records();
  ASSERT_EQ(records.size(), 4u);
  EXPECT_EQ(records[3], ok(3));
}

// A dataset whose lines have ids of their own is no output: neither resumed into (its items
// taken as done) nor emptied by a fresh run; the file is left as it is.
TEST_F(OutputWriterTest, ADatasetWithIdsIsNotTakenForAnOutput) {
  const std::string data = "{\"id\": 1, \"question\": \"keep me\"}\n{\"id\": 2, \"question\": \"me too\"}\n";
  write_raw(data);
  for (const bool fresh : {false, true}) {
    try {
      OutputWriter writer([&] {
        auto o = options();
        o.fresh = fresh;
        return o;
      }());
      ADD_FAILURE() << "the dataset was taken as an output (fresh " << fresh << ")";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(":1: a JSON object without an \"error\" (every record has one), so this "
                                           "is not a batchlm output file; it was left as it is"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(read_raw(), data);
  }
}

TEST_F(OutputWriterTest, UntouchedFileIsNotRewritten) {
  write_raw(line(ok(1)));
  struct stat before {}, after {};
  ASSERT_EQ(::stat(path_.c_str(), &before), 0);
  { OutputWriter writer(options()); }
  ASSERT_EQ(::stat(path_.c_str(), &after), 0);
  EXPECT_EQ(before.st_ino, after.st_ino);
  EXPECT_EQ(read_raw(), line(ok(1)));
}

TEST_F(OutputWriterTest, TornLastLineIsDropped) {
  const std::string torn = line(ok(3)).substr(0, 9);  // a kill in the middle of a write
  write_raw(line(ok(1)) + line(ok(2)) + torn);
  {
    OutputWriter writer(options());
    EXPECT_TRUE(writer.resume_info().dropped_torn_line);
    EXPECT_EQ(writer.resume_info().kept, 2);
    EXPECT_EQ(writer.resume_info().done_ids.count("3"), 0u);
    writer.append(ok(3));
  }
  EXPECT_EQ(read_raw(), line(ok(1)) + line(ok(2)) + line(ok(3)));
}

TEST_F(OutputWriterTest, LastLineMissingOnlyItsNewlineIsDropped) {
  const std::string whole = line(ok(2));
  write_raw(line(ok(1)) + whole.substr(0, whole.size() - 1));
  OutputWriter writer(options());
  EXPECT_TRUE(writer.resume_info().dropped_torn_line);
  EXPECT_EQ(writer.resume_info().done_ids, (std::unordered_set<std::string>{"1"}));
  EXPECT_EQ(read_raw(), line(ok(1)));
}

// A file with lines no run writes (an input passed as -o by mistake, a job file, notes) is not
// "repaired" by deleting them: the writer refuses it, names the first such line, and leaves
// every byte where it was.
TEST_F(OutputWriterTest, FileWithLinesThatAreNotRecordsIsRefusedAndLeftUntouched) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {line(ok(1)) + "{\"id\": 2, \"outp\n" + line(ok(3)), ":2: not a JSON line"},
      {line(ok(1)) + line(ok(2)) + "[1,2]\n", ":3: not a JSON object"},
      {"{\"question\": \"2+2?\", \"answer\": \"4\"}\n{\"question\": \"3+3?\", \"answer\": \"6\"}\n",
       ":1: a JSON object without an \"id\""},
      {"name: job\ninput: data.jsonl\n", ":1: not a JSON line"},
      {line(failed(1)) + "notes\n" + line(ok(2)) + "torn", ":2: not a JSON line"},
  };
  for (const auto& [text, where] : cases) {
    write_raw(text);
    try {
      OutputWriter writer(options());
      ADD_FAILURE() << "resumed over a file that is not an output:\n" << text;
    } catch (const NotAnOutputError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(where), std::string::npos) << message;
      EXPECT_NE(message.find("another output"), std::string::npos) << message;
      // After records, the line is damaged; the records around it are not to be thrown away.
      const json first = json::parse(text.substr(0, text.find('\n')), nullptr, false);
      const bool after_records = first.is_object() && first.contains("id");
      EXPECT_EQ(message.find("between records: the file was left as it is; repair or delete that line") !=
                    std::string::npos,
                after_records)
          << message;
      EXPECT_EQ(message.find("this is not a batchlm output file") != std::string::npos, !after_records) << message;
    }
    EXPECT_EQ(read_raw(), text);
    EXPECT_FALSE(fs::exists(path_ + ".tmp"));
    // The lock went with the refused writer.
    write_raw("");
    EXPECT_NO_THROW(OutputWriter writer(options()));
  }
}

// The caller may refuse an output once it has seen its records (made under other settings):
// the file is then as it was, failed records and a torn line included.
TEST_F(OutputWriterTest, ARefusalBeforeChangesLeavesTheFileAsItWas) {
  const std::string text = line(ok(1)) + line(failed(2)) + line(ok(3)) + "{\"id\": 4, \"out";
  write_raw(text);
  auto o = options();
  int seen = 0;
  o.before_changes = [](const std::string&) { throw std::runtime_error("other settings"); };
  EXPECT_THROW(OutputWriter writer(o, [&](const json&) { ++seen; }), std::runtime_error);
  EXPECT_EQ(seen, 2);
  EXPECT_EQ(read_raw(), text);
  EXPECT_FALSE(fs::exists(path_ + ".tmp"));
  o.before_changes = {};
  EXPECT_NO_THROW(OutputWriter writer(o));  // the lock went with the refused writer
  EXPECT_EQ(read_raw(), line(ok(1)) + line(ok(3)));
}

// The settings a run's records are made with stay in the lock file after its pid, also after a
// kill (the writer's end does not clear them), and reach the next run's before_changes. They
// are replaced only once that run has passed it: a refused run leaves them as they were.
TEST_F(OutputWriterTest, TheLockKeepsTheSettingsForTheNextRun) {
  write_raw(line(ok(1)) + line(failed(2)));
  auto o = options();
  std::vector<std::string> seen;
  o.before_changes = [&](const std::string& earlier) { seen.push_back(earlier); };
  o.settings = R"({"model":"a"})";
  { OutputWriter writer(o); }
  const std::string pid = std::to_string(::getpid());
  EXPECT_EQ(read_file(path_ + ".lock"), pid + "\n{\"model\":\"a\"}\n");
  o.before_changes = [&](const std::string& earlier) {
    seen.push_back(earlier);
    throw std::runtime_error("other settings");
  };
  o.settings = R"({"model":"b"})";
  EXPECT_THROW(OutputWriter writer(o), std::runtime_error);
  EXPECT_EQ(read_file(path_ + ".lock"), pid + "\n{\"model\":\"a\"}\n");
  o.before_changes = [&](const std::string& earlier) { seen.push_back(earlier); };
  { OutputWriter writer(o); }
  EXPECT_EQ(read_file(path_ + ".lock"), pid + "\n{\"model\":\"b\"}\n");
  EXPECT_EQ(seen, (std::vector<std::string>{"", R"({"model":"a"})", R"({"model":"a"})"}));
  // --fresh starts over and keeps its own; a writer given none keeps the pid alone.
  o.fresh = true;
  o.settings = R"({"model":"c"})";
  { OutputWriter writer(o); }
  EXPECT_EQ(read_file(path_ + ".lock"), pid + "\n{\"model\":\"c\"}\n");
  o.settings.clear();
  { OutputWriter writer(o); }
  EXPECT_EQ(read_file(path_ + ".lock"), pid + "\n");
}

// Records the caller wants made again go as failed ones do, and are counted apart: an id
// with a failed record before its redone one is one item to redo, not a failure too.
TEST_F(OutputWriterTest, RecordsToRedoAreDroppedAndCounted) {
  auto cut = [](int id) {
    json record = ok(id, "cut");
    record["cut_at_context"] = 64;
    return record;
  };
  // Id 5 is cut twice (one item to redo), id 6 cut and then made whole (nothing to redo).
  write_raw(line(ok(1)) + line(failed(3)) + line(cut(3)) + line(ok(2)) + line(failed(4)) + line(cut(5)) +
            line(cut(5)) + line(cut(6)) + line(ok(6)));
  auto o = options();
  o.redo = [](const json& record) { return record.contains("cut_at_context"); };
  std::vector<json> kept;
  OutputWriter writer(o, [&](const json& record) { kept.push_back(record); });
  EXPECT_EQ(writer.resume_info().kept, 3);
  EXPECT_EQ(writer.resume_info().redone, 2);
  EXPECT_EQ(writer.resume_info().dropped_failed(), 1);  // id 4
  EXPECT_FALSE(writer.resume_info().done_ids.contains("3"));
  EXPECT_EQ(kept, (std::vector<json>{ok(1), ok(2), ok(6)}));
  EXPECT_EQ(read_raw(), line(ok(1)) + line(ok(2)) + line(ok(6)));
}

TEST_F(OutputWriterTest, FreshDoesNotEmptyAFileThatIsNotAnOutput) {
  auto o = options();
  o.fresh = true;
  // A binary file (a model passed as -o), a dataset without ids.
  const std::string binary = std::string("GGUF\x03\0\0\0", 8) + std::string(100, '\x01') + "\n\x02";
  for (const std::string& text : {binary, std::string("{\"question\": \"2+2?\"}\n")}) {
    write_raw(text);
    EXPECT_THROW(OutputWriter writer(o), NotAnOutputError);
    EXPECT_EQ(read_raw(), text);
  }
  // An earlier output, torn last line and failures included, is emptied.
  write_raw(line(ok(1)) + line(failed(2)) + "{\"id\": 3, \"out");
  {
    OutputWriter writer(o);
    writer.append(ok(7));
  }
  EXPECT_EQ(read_raw(), line(ok(7)));
}

// Two names for one output (a symbolic link, a hard link) are one output: the second run is
// refused, not let in to write every record a second time.
TEST_F(OutputWriterTest, AnotherNameForALockedOutputIsRefused) {
  write_raw(line(ok(1)));
  const std::string symlink = (dir_ / "link.jsonl").string();
  const std::string hardlink = (dir_ / "hard.jsonl").string();
  fs::create_symlink("out.jsonl", symlink);
  fs::create_hard_link(path_, hardlink);
  const std::string real = path_;
  {
    OutputWriter first(options());
    for (const std::string& other : {symlink, hardlink}) {
      path_ = other;
      EXPECT_THROW(OutputWriter second(options()), OutputLockedError) << other;
    }
    path_ = real;
  }
  // And the other way round: the link first, the file's own name refused.
  path_ = symlink;
  OutputWriter first(options());
  path_ = real;
  EXPECT_THROW(OutputWriter second(options()), OutputLockedError);
}

TEST_F(OutputWriterTest, ResumeThroughASymlinkRewritesTheFileAndKeepsTheLink) {
  write_raw(line(ok(1)) + line(failed(2)) + line(ok(3)));
  const std::string real = path_;
  path_ = (dir_ / "link.jsonl").string();
  fs::create_symlink(fs::path(real), path_);
  {
    OutputWriter writer(options());
    EXPECT_EQ(writer.path(), fs::weakly_canonical(real).string());
    EXPECT_EQ(writer.resume_info().kept, 2);
    writer.append(ok(2));
  }
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(path_)));
  path_ = real;
  EXPECT_EQ(read_raw(), line(ok(1)) + line(ok(3)) + line(ok(2)));
  EXPECT_FALSE(fs::exists(dir_ / "link.jsonl.lock"));
}

TEST_F(OutputWriterTest, DanglingSymlinkCreatesItsTarget) {
  const std::string real = (dir_ / "target.jsonl").string();
  path_ = (dir_ / "link.jsonl").string();
  fs::create_symlink("target.jsonl", path_);
  {
    OutputWriter writer(options());
    writer.append(ok(1));
  }
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(path_)));
  path_ = real;
  EXPECT_EQ(read_raw(), line(ok(1)));
  EXPECT_THROW(
      {
        OutputWriter a(options());
        path_ = (dir_ / "link.jsonl").string();
        OutputWriter b(options());
      },
      OutputLockedError);
}

TEST_F(OutputWriterTest, FailedRecordsAreDroppedSoTheyRunAgain) {
  write_raw(line(ok(1)) + line(failed(2)) + line(ok(3)) + line(failed(4)));
  std::vector<json> seen;
  {
    OutputWriter writer(options(), [&](const json& r) { seen.push_back(r); });
    EXPECT_EQ(writer.resume_info().dropped_failed(), 2);
    EXPECT_EQ(writer.resume_info().kept, 2);
    EXPECT_EQ(writer.resume_info().done_ids, (std::unordered_set<std::string>{"1", "3"}));
  }
  EXPECT_EQ(seen, (std::vector<json>{ok(1), ok(3)}));
  EXPECT_EQ(read_raw(), line(ok(1)) + line(ok(3)));
  EXPECT_FALSE(fs::exists(path_ + ".tmp"));
}

TEST_F(OutputWriterTest, DuplicateIdsKeepTheFirstRecord) {
  write_raw(line(ok(1, "first")) + line(ok(2)) + line(ok(1, "second")) + line(failed(2)));
  OutputWriter writer(options());
  EXPECT_EQ(writer.resume_info().kept, 2);
  EXPECT_EQ(writer.resume_info().dropped_duplicates, 1);
  EXPECT_EQ(read_raw(), line(ok(1, "first")) + line(ok(2)));
}

TEST_F(OutputWriterTest, SuccessAfterAFailureForTheSameIdIsKept) {
  write_raw(line(failed(5)) + line(ok(5)));
  OutputWriter writer(options());
  EXPECT_EQ(writer.resume_info().done_ids, (std::unordered_set<std::string>{"5"}));
  EXPECT_EQ(read_raw(), line(ok(5)));
  // Nothing to retry: "1 failed to retry" was said, and nothing was sent.
  EXPECT_EQ(writer.resume_info().dropped_failed(), 0);
}

TEST_F(OutputWriterTest, FailuresToRetryCountIdsWithoutASuccess) {
  write_raw(line(ok(1)) + line(failed(1)) + line(failed(2)) + line(failed(2)) + line(failed(3)));
  OutputWriter writer(options());
  EXPECT_EQ(writer.resume_info().dropped_failed(), 2);  // ids 2 and 3, each once
  EXPECT_EQ(writer.resume_info().kept, 1);
  EXPECT_EQ(read_raw(), line(ok(1)));
}

TEST_F(OutputWriterTest, FreshTruncatesTheExistingOutput) {
  write_raw(line(ok(1)) + line(ok(2)));
  auto o = options();
  o.fresh = true;
  {
    OutputWriter writer(o);
    EXPECT_EQ(writer.resume_info().kept, 0);
    EXPECT_TRUE(writer.resume_info().done_ids.empty());
    EXPECT_EQ(read_raw(), "");
    writer.append(ok(9));
  }
  EXPECT_EQ(read_raw(), line(ok(9)));
}

TEST_F(OutputWriterTest, SecondWriterInTheSameProcessIsRefused) {
  OutputWriter first(options());
  try {
    OutputWriter second(options());
    FAIL() << "a second writer opened a locked output";
  } catch (const OutputLockedError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path_), std::string::npos) << message;
    EXPECT_NE(message.find("pid " + std::to_string(::getpid())), std::string::npos) << message;
  }
}

TEST_F(OutputWriterTest, RefusalLeavesTheOutputUntouched) {
  write_raw(line(ok(1)) + line(failed(2)));
  OutputWriter first(options());
  const std::string after_first = read_raw();
  EXPECT_THROW(OutputWriter second(options()), OutputLockedError);
  EXPECT_EQ(read_raw(), after_first);
}

TEST_F(OutputWriterTest, WriterInAnotherProcessIsRefused) {
  OutputWriter first(options());
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 1;
    try {
      OutputWriter second(options());
    } catch (const OutputLockedError& e) {
      code = std::string(e.what()).find("pid " + std::to_string(::getppid())) != std::string::npos ? 0 : 2;
    } catch (...) {
      code = 3;
    }
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: not refused, 2: message without the holder's pid, 3: other error";
}

TEST_F(OutputWriterTest, LockIsReleasedWhenTheWriterCloses) {
  { OutputWriter first(options()); }
  EXPECT_NO_THROW(OutputWriter second(options()));
}

TEST_F(OutputWriterTest, FlushesAfterFlushEveryRecords) {
  OutputWriter writer(options(3, std::chrono::hours{1}));
  writer.append(ok(1));
  writer.append(ok(2));
  EXPECT_EQ(read_raw(), "");
  EXPECT_EQ(writer.written(), 0);
  writer.append(ok(3));
  EXPECT_EQ(read_raw(), line(ok(1)) + line(ok(2)) + line(ok(3)));
  EXPECT_EQ(writer.written(), 3);
}

TEST_F(OutputWriterTest, FlushIfDueWaitsForTheInterval) {
  OutputWriter writer(options(1000, milliseconds{500}));
  const auto start = std::chrono::steady_clock::now();
  writer.append(ok(1));
  writer.flush_if_due(start);
  EXPECT_EQ(read_raw(), "");
  writer.flush_if_due(start + milliseconds{600});
  EXPECT_EQ(read_raw(), line(ok(1)));
  EXPECT_EQ(writer.written(), 1);
}

TEST_F(OutputWriterTest, FlushIfDueWithNothingBufferedWritesNothing) {
  OutputWriter writer(options(1000, milliseconds{0}));
  writer.flush_if_due(std::chrono::steady_clock::now() + std::chrono::hours{1});
  EXPECT_EQ(read_raw(), "");
  EXPECT_EQ(writer.written(), 0);
}

TEST_F(OutputWriterTest, FlushMakesContentVisibleToOtherReaders) {
  OutputWriter writer(options(1000, std::chrono::hours{1}));
  for (int i = 0; i < 100; ++i) writer.append(ok(i, std::string(100, 'x')));
  EXPECT_EQ(read_raw(), "");
  writer.flush();
  const auto records = read_records();
  ASSERT_EQ(records.size(), 100u);
  EXPECT_EQ(records[99], ok(99, std::string(100, 'x')));
}

TEST_F(OutputWriterTest, DestructorFlushesWhatIsBuffered) {
  {
    OutputWriter writer(options(1000, std::chrono::hours{1}));
    writer.append(ok(1));
  }
  EXPECT_EQ(read_raw(), line(ok(1)));
}

TEST_F(OutputWriterTest, InvalidUtf8InOutputIsReplacedNotFatal) {
  {
    OutputWriter writer(options());
    writer.append(ok(1, std::string("caf\xc3", 4)));
  }
  const auto records = read_records();
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0]["output"], "caf\xef\xbf\xbd");
}

TEST_F(OutputWriterTest, RecordWithoutIdIsRejected) {
  OutputWriter writer(options());
  EXPECT_THROW(writer.append(json{{"output", "x"}}), std::invalid_argument);
}

TEST_F(OutputWriterTest, KilledRunResumesWithNothingLostAndNothingTwice) {
  // First run: flushed records, then a kill during the write of the next batch.
  {
    OutputWriter writer(options(2, std::chrono::hours{1}));
    for (int i = 0; i < 4; ++i) writer.append(i == 2 ? failed(i) : ok(i));
  }
  {
    const int fd = ::open(path_.c_str(), O_WRONLY | O_APPEND);
    ASSERT_GE(fd, 0);
    const std::string partial = line(ok(4)) + line(ok(5)).substr(0, 5);
    ASSERT_EQ(::write(fd, partial.data(), partial.size()), static_cast<ssize_t>(partial.size()));
    ::close(fd);
  }
  // Second run: skips 0, 1, 3, 4; reruns 2 (failed) and 5 (torn).
  std::unordered_set<std::string> done;
  {
    OutputWriter writer(options());
    done = writer.resume_info().done_ids;
    EXPECT_TRUE(writer.resume_info().dropped_torn_line);
    EXPECT_EQ(writer.resume_info().dropped_failed(), 1);
    for (int i = 0; i < 6; ++i) {
      if (!done.count(std::to_string(i))) writer.append(ok(i));
    }
  }
  EXPECT_EQ(done, (std::unordered_set<std::string>{"0", "1", "3", "4"}));
  std::vector<int> ids;
  for (const auto& r : read_records()) {
    EXPECT_TRUE(r["error"].is_null());
    ids.push_back(r["id"].get<int>());
  }
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(ids, (std::vector<int>{0, 1, 2, 3, 4, 5}));
  // A third run finds everything done and changes nothing.
  const std::string before = read_raw();
  {
    OutputWriter writer(options());
    EXPECT_EQ(writer.resume_info().kept, 6);
  }
  EXPECT_EQ(read_raw(), before);
}

TEST_F(OutputWriterTest, BlankLinesAreIgnored) {
  write_raw(line(ok(1)) + "\n" + line(ok(2)));
  OutputWriter writer(options());
  EXPECT_EQ(writer.resume_info().kept, 2);
  EXPECT_EQ(read_raw(), line(ok(1)) + "\n" + line(ok(2)));
}

TEST_F(OutputWriterTest, LongRecordsSpanningReadBlocksResume) {
  std::string text;
  for (int i = 0; i < 5; ++i) text += line(ok(i, std::string(700'000, static_cast<char>('a' + i))));
  write_raw(text + line(failed(5)) + line(ok(6)));
  OutputWriter writer(options());
  EXPECT_EQ(writer.resume_info().kept, 6);
  EXPECT_EQ(writer.resume_info().dropped_failed(), 1);
  const auto records = read_records();
  ASSERT_EQ(records.size(), 6u);
  EXPECT_EQ(records[3], ok(3, std::string(700'000, 'd')));
  EXPECT_EQ(records[5], ok(6));
}

// A flush the disk or the file size limit cuts short leaves some records whole in the file and
// takes back the bytes of the one it tore, so the file holds whole lines; only the others count
// as buffered (the run reports them as not saved), and the next flush with room writes them.
TEST_F(OutputWriterTest, PartialWriteLeavesBufferedOnlyTheRecordsNotWhollyInTheFile) {
  const std::string output(100, 'x');
  const std::size_t size = line(ok(0, output)).size();  // every id has one digit: one size
  OutputWriter writer(options(1000, std::chrono::hours{1}));
  for (int i = 0; i < 10; ++i) writer.append(ok(i, output));
  bool write_error = false;
  {
    // The writer ignores SIGXFSZ while it writes (tested apart below, in a child process).
    const FileSizeLimit limit(size * 3 + size / 2);
    try {
      writer.flush();
    } catch (const OutputWriteError&) {
      write_error = true;
    } catch (...) {
    }
  }
  EXPECT_TRUE(write_error) << "the flush past the limit threw another error, or none";
  EXPECT_EQ(read_raw().size(), size * 3);
  EXPECT_EQ(read_records().size(), 3u);
  EXPECT_EQ(writer.written(), 3);
  EXPECT_EQ(writer.buffered(), 7);
  writer.flush();
  EXPECT_EQ(writer.written(), 10);
  EXPECT_EQ(writer.buffered(), 0);
  const auto records = read_records();
  ASSERT_EQ(records.size(), 10u);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(records[static_cast<std::size_t>(i)], ok(i, output));
}

// Resuming rewrites the output when a failed record sits before good ones, before the caller
// has set anything up. Past the file size limit (as on a full disk) that is a write error, not a
// kill by SIGXFSZ, and the partial copy is removed; the output stays as it was.
TEST_F(OutputWriterTest, RewritePastTheFileSizeLimitIsAWriteErrorAndLeavesNoTemporaryFile) {
  std::string text = line(failed(0));
  for (int i = 1; i <= 20; ++i) text += line(ok(i, std::string(100, 'x')));
  write_raw(text);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::signal(SIGXFSZ, SIG_DFL);  // as a process starts: the signal kills it
    int code = 1;
    {
      const FileSizeLimit limit(text.size() / 2);
      try {
        OutputWriter writer(options());
      } catch (const OutputWriteError& e) {
        code = std::string(e.what()).find("out.jsonl.tmp") != std::string::npos ? 0 : 2;
      } catch (...) {
        code = 3;
      }
    }
    struct sigaction now {};
    ::sigaction(SIGXFSZ, nullptr, &now);
    if (code == 0 && now.sa_handler != SIG_DFL) code = 4;
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  const bool killed = WIFSIGNALED(status);
  ASSERT_FALSE(killed) << "killed by signal " << WTERMSIG(status);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "1: no error, 2: message without the temporary file, 3: another error, 4: SIGXFSZ not put back";
  EXPECT_EQ(read_raw(), text);
  EXPECT_FALSE(fs::exists(path_ + ".tmp"));
  // With room, the same resume goes through.
  OutputWriter writer(options());
  EXPECT_EQ(writer.resume_info().kept, 20);
  EXPECT_EQ(read_raw(), text.substr(line(failed(0)).size()));
  EXPECT_FALSE(fs::exists(path_ + ".tmp"));
}

// The rewrite gives the output's name a new file; a hard link keeps naming the one it replaced.
// While the run lasts, a run through that link is refused all the same; afterwards the link is a
// file of its own, the output as it was before the rewrite.
TEST_F(OutputWriterTest, HardLinkToARewrittenOutputIsRefusedWhileTheRunLasts) {
  const std::string before = line(ok(1)) + line(failed(2)) + line(ok(3));
  write_raw(before);
  const std::string real = path_;
  const std::string hardlink = (dir_ / "hard.jsonl").string();
  fs::create_hard_link(real, hardlink);
  {
    OutputWriter first(options());
    ASSERT_FALSE(fs::equivalent(real, hardlink)) << "not rewritten";
    path_ = hardlink;
    EXPECT_THROW(OutputWriter second(options()), OutputLockedError);
    EXPECT_EQ(read_raw(), before);
    path_ = real;
  }
  path_ = hardlink;
  OutputWriter later(options());
  EXPECT_EQ(later.resume_info().dropped_failed(), 1);
}

// Without another name, the file a rewrite replaced is closed: held open, it would keep the
// room of the whole old output taken for the length of the run.
TEST_F(OutputWriterTest, RewriteDoesNotHoldTheFileItReplaced) {
  write_raw(line(ok(1)) + line(failed(2)) + line(ok(3)));
  OutputWriter writer(options());
  for (const auto& entry : fs::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = fs::read_symlink(entry.path(), ec).string();
    EXPECT_FALSE(target.rfind(dir_.string(), 0) == 0 && target.find("(deleted)") != std::string::npos) << target;
  }
}

TEST_F(OutputWriterTest, UnwritableLocationIsAnErrorNamingThePath) {
  write_raw("");
  path_ = path_ + "/inside-a-file.jsonl";  // the parent is a regular file
  try {
    OutputWriter writer(options());
    FAIL() << "opened an output under a regular file";
  } catch (const OutputLockedError&) {
    FAIL() << "reported as locked";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("out.jsonl"), std::string::npos) << e.what();
  }
}

// An output that is not a file (a directory, a pipe such as a piped /dev/stdout, a device
// such as /dev/null) cannot be resumed from: refused, saying what it is, before a lock file is
// made beside it.
TEST_F(OutputWriterTest, OutputThatIsNotARegularFileIsRefusedBeforeAnythingIsCreated) {
  fs::create_directory(dir_ / "results");
  ASSERT_EQ(::mkfifo((dir_ / "fifo").c_str(), 0644), 0);
  int ends[2];
  ASSERT_EQ(::pipe(ends), 0);
  const std::string piped = "/proc/self/fd/" + std::to_string(ends[1]);  // what /dev/stdout is when piped
  for (const auto& [path, kind] : std::vector<std::pair<std::string, std::string>>{
           {(dir_ / "results").string(), "a directory"},
           {(dir_ / "fifo").string(), "a pipe"},
           {piped, "a pipe"},
           {"/dev/null", "a character device"}}) {
    path_ = path;
    try {
      OutputWriter writer(options());
      ADD_FAILURE() << "opened " << path;
    } catch (const OutputLockedError&) {
      ADD_FAILURE() << "reported as locked";
    } catch (const std::runtime_error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("output " + path + " is " + kind + ", not a file"), std::string::npos) << message;
    }
  }
  ::close(ends[0]);
  ::close(ends[1]);
  EXPECT_FALSE(fs::exists(dir_ / "results.lock"));
  EXPECT_FALSE(fs::exists(dir_ / "fifo.lock"));
}

// A refused run leaves no file it made: not the lock file, not the output, not the directories
// it made for them.
TEST_F(OutputWriterTest, ARefusedWriterRemovesWhatItMade) {
  write_raw("not results\n");
  EXPECT_THROW(OutputWriter writer(options()), NotAnOutputError);
  EXPECT_EQ(read_raw(), "not results\n");
  EXPECT_FALSE(fs::exists(path_ + ".lock"));
  // A lock file that was there before stays.
  std::ofstream(path_ + ".lock") << "1\n";
  EXPECT_THROW(OutputWriter writer(options()), NotAnOutputError);
  EXPECT_TRUE(fs::exists(path_ + ".lock"));
  // Refused once it made directories: they go too (a name whose lock file's name is too long).
  path_ = (dir_ / "a" / "b" / (std::string(248, 'x') + ".jsonl")).string();
  EXPECT_THROW(OutputWriter writer(options()), std::runtime_error);
  EXPECT_FALSE(fs::exists(dir_ / "a"));
  // What it did not make stays: another run's output, lock and directories.
  path_ = (dir_ / "a" / "b" / "out.jsonl").string();
  {
    OutputWriter first(options());
    EXPECT_THROW(OutputWriter second(options()), OutputLockedError);
    EXPECT_TRUE(fs::exists(path_));
    EXPECT_TRUE(fs::exists(path_ + ".lock"));
  }
  // A directory that cannot be made leaves none of those before it.
  fs::remove_all(dir_ / "a");
  fs::create_directories(dir_ / "a");
  std::ofstream(dir_ / "a" / "b") << "a file where a directory is needed";
  path_ = (dir_ / "a" / "b" / "c" / "out.jsonl").string();
  EXPECT_THROW(OutputWriter writer(options()), std::runtime_error);
  EXPECT_EQ(std::vector<fs::path>(fs::directory_iterator(dir_ / "a"), {}), std::vector<fs::path>{dir_ / "a" / "b"});
}

// The checks a dry run makes: what the writer would refuse, refused without creating anything.
TEST_F(OutputWriterTest, CheckOutputRefusesWhatTheWriterWouldAndMakesNothing) {
  const auto message_of = [](const std::string& path, bool read_records = true) -> std::string {
    try {
      check_output(path, read_records);
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    return "";
  };
  // Fine: absent (in directories to be made), or an earlier output.
  EXPECT_EQ(message_of((dir_ / "x" / "y" / "out.jsonl").string()), "");
  EXPECT_FALSE(fs::exists(dir_ / "x"));
  write_raw(line(ok(1)) + "{\"id\": 2, \"torn");
  EXPECT_EQ(message_of(path_), "");
  EXPECT_FALSE(fs::exists(path_ + ".lock"));
  // Not an output: refused when read through, as a resume would.
  write_raw("notes\n");
  EXPECT_NE(message_of(path_).find("not a batchlm output"), std::string::npos) << message_of(path_);
  EXPECT_EQ(message_of(path_, false), "");
  // Under a file; not a file; nothing at all.
  const std::string under = path_ + "/x.jsonl";
  EXPECT_EQ(message_of(under), "cannot create the directory for output " + under + ": " + path_ + " is not a directory");
  EXPECT_NE(message_of((dir_ / "out.jsonl" / "a" / "b.jsonl").string()).find(path_ + " is not a directory"),
            std::string::npos);
  EXPECT_NE(message_of("/dev/null").find("is a character device, not a file"), std::string::npos);
  EXPECT_NE(message_of("-").find("output '-'"), std::string::npos);
  EXPECT_NE(message_of("").find("empty"), std::string::npos);
  EXPECT_FALSE(fs::exists(path_ + ".lock"));
  // Held by a run: said with its pid, read from the kernel's lock table; free again after it.
  write_raw(line(ok(1)));
  {
    OutputWriter holder(options());
    try {
      check_output(path_);
      ADD_FAILURE() << "a held output passed";
    } catch (const OutputLockedError& e) {
      EXPECT_EQ(std::string(e.what()), "output " + path_ + " is in use by another run (pid " +
                                           std::to_string(::getpid()) + ", lock " + path_ + ".lock)");
    }
  }
  EXPECT_EQ(message_of(path_), "");
  // A directory that takes no new entries (root may write anywhere: not checked as root).
  if (::geteuid() != 0) {
    fs::create_directory(dir_ / "ro");
    fs::permissions(dir_ / "ro", fs::perms::owner_read | fs::perms::owner_exec);
    const std::string inside = (dir_ / "ro" / "x.jsonl").string();
    EXPECT_EQ(message_of(inside), "cannot create output " + inside + ": " + (dir_ / "ro").string() + ": Permission denied");
    EXPECT_THROW(OutputWriter writer([&] { auto o = options(); o.path = inside; return o; }()), std::runtime_error);
    fs::permissions(dir_ / "ro", fs::perms::owner_all);
  }
  // A directory whose file system takes no new files, whatever the permission bits say (root
  // passes access() there): the check makes one to see, and leaves nothing.
  if (fs::is_directory("/proc/self")) {  // procfs there
    // As root the file system's "no such file" answers; said as what it means, since /proc is there.
    const std::string said = message_of("/proc/batchlm-x.jsonl");
    EXPECT_EQ(said.find(::geteuid() == 0 ? "cannot create output /proc/batchlm-x.jsonl: /proc takes no new files (its file "
                                           "system refused one: No such file or directory)"
                                         : "cannot create output /proc/batchlm-x.jsonl: /proc: "),
              0u)
        << said;
  }
  EXPECT_EQ(message_of((dir_ / "new.jsonl").string()), "");
  for (const auto& entry : fs::directory_iterator(dir_))
    EXPECT_EQ(entry.path().filename().string().find(".batchlm-check-"), std::string::npos) << entry.path();
}

// "-" usually means stdout; a file named "-" appearing instead would surprise: refused.
TEST_F(OutputWriterTest, DashIsRefusedAsAnOutput) {
  path_ = "-";
  try {
    OutputWriter writer(options());
    ADD_FAILURE() << "opened '-'";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("output '-'"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists("-"));
  EXPECT_FALSE(fs::exists("-.lock"));
}

// An output's companions (its lock, its summary, a resume's rewrite file) are named by suffixes,
// so another job's output can sit where one goes (-o out.jsonl.tmp beside -o out.jsonl): it is
// refused, by the run and by its dry run's check, and left as it is.
TEST_F(OutputWriterTest, AnotherOutputWhereACompanionGoesIsRefusedAndKept) {
  const auto other_output = [&](const std::string& at) {
    const std::string saved = path_;
    path_ = at;
    {
      OutputWriter other(options(1));
      for (int id = 1; id <= 3; ++id) other.append(ok(id));
      other.flush();
    }
    path_ = saved;
    return read_file(at);
  };
  const auto message_of = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    return "";
  };
  // A resume that would rewrite the output (a failed record before a kept one).
  write_raw(line(failed(1)) + line(ok(2)));
  const std::string tmp = path_ + ".tmp", tmp_records = other_output(tmp);
  std::string m = message_of([&] { OutputWriter writer(options()); });
  EXPECT_EQ(m, tmp + " is another job's output (it has a lock file of its own); it is where a resume rewrites the "
                     "output, and batchlm never deletes what it did not write: move it away, then run again");
  EXPECT_EQ(message_of([&] { check_output(path_); }), m);
  EXPECT_EQ(read_file(tmp), tmp_records);
  EXPECT_EQ(read_raw(), line(failed(1)) + line(ok(2)));
  fs::remove(tmp);
  fs::remove(tmp + ".lock");
  // Its summary's name, and its lock's.
  for (const std::string suffix : {".summary.json", ".lock"}) {
    fs::remove(path_ + ".lock");
    const std::string at = path_ + suffix, records = other_output(at);
    m = message_of([&] { OutputWriter writer(options()); });
    EXPECT_EQ(m, at + " is another job's output (it has a lock file of its own), where output " + path_ + " keeps its " +
                     (suffix == ".lock" ? "lock" : "summary") +
                     "; batchlm never deletes what it did not write: give this job another output path, or move that "
                     "file away");
    EXPECT_EQ(message_of([&] { check_output(path_); }), m);
    EXPECT_EQ(read_file(at), records);
    fs::remove(at);
    fs::remove(at + ".lock");
  }
  // Something else at the summary's name or the lock's.
  std::ofstream(path_ + ".summary.json") << "{\"notes\": true}\n";
  EXPECT_NE(message_of([&] { check_output(path_); }).find("is not a batchlm summary"), std::string::npos);
  std::ofstream(path_ + ".summary.json") << "{\"counts\": {\"total\": 0}}\n";
  EXPECT_EQ(message_of([&] { check_output(path_); }), "");
  // A summary an older version cut short, or an empty one, is still the output's.
  std::ofstream(path_ + ".summary.json", std::ios::trunc) << "{\n  \"counts\": {\"tot";
  EXPECT_EQ(message_of([&] { check_output(path_); }), "");
  std::ofstream(path_ + ".summary.json", std::ios::trunc).flush();
  EXPECT_EQ(message_of([&] { check_output(path_); }), "");
  // A directory there, empty (it would be removed to make room) or not, is refused and kept.
  fs::remove(path_ + ".summary.json");
  fs::create_directory(path_ + ".summary.json");
  EXPECT_EQ(message_of([&] { check_output(path_); }),
            path_ + ".summary.json is a directory, where output " + path_ +
                " keeps its summary; batchlm never deletes what it did not write: give this job another output path, "
                "or move that file away");
  EXPECT_TRUE(fs::is_directory(path_ + ".summary.json"));
  fs::remove(path_ + ".summary.json");
  // A link at the summary's temporary name, which is opened without following one.
  fs::create_symlink(dir_, path_ + ".summary.json.tmp");
  EXPECT_NE(message_of([&] { check_output(path_); }).find(".summary.json.tmp is a symbolic link, where output "),
            std::string::npos);
  fs::remove(path_ + ".summary.json.tmp");
  // Records there are not (another output whose lock is gone).
  std::ofstream(path_ + ".summary.json", std::ios::trunc) << line(ok(1)) << line(ok(2));
  EXPECT_NE(message_of([&] { check_output(path_); }).find("is not a batchlm summary"), std::string::npos);
  fs::remove(path_ + ".summary.json");
  std::ofstream(path_ + ".lock") << "my notes\n";
  EXPECT_NE(message_of([&] { OutputWriter writer(options()); }).find("is not a batchlm lock file"), std::string::npos);
  EXPECT_EQ(read_file(path_ + ".lock"), "my notes\n");
  // A lock that is a link would be written through: refused, and what it leads to kept.
  fs::remove(path_ + ".lock");
  const std::string elsewhere = (dir_ / "elsewhere.jsonl").string();
  std::ofstream(elsewhere) << line(ok(9));
  fs::create_symlink(elsewhere, path_ + ".lock");
  EXPECT_NE(message_of([&] { OutputWriter writer(options()); }).find(".lock is a symbolic link, where output"),
            std::string::npos);
  EXPECT_EQ(read_file(elsewhere), line(ok(9)));
}

// A resume that rewrites the output keeps its permissions: a private file stays private.
TEST_F(OutputWriterTest, ARewriteKeepsTheOutputsMode) {
  write_raw(line(failed(1)) + line(ok(2)));
  ASSERT_EQ(::chmod(path_.c_str(), 0640), 0);  // not what a umask gives a new file
  {
    OutputWriter writer(options());
  }
  EXPECT_EQ(read_records().size(), 1u);  // rewritten: the failed record dropped
  struct stat info {};
  ASSERT_EQ(::stat(path_.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 07777, 0640u);
}

// The summary's way to disk: whole or not at all, nothing left beside it.
TEST_F(OutputWriterTest, ReplaceFileWritesWholeAndLeavesNoTemporaryFile) {
  const std::string at = (dir_ / "summary.json").string();
  replace_file(at, "first\n");
  replace_file(at, "second\n");
  EXPECT_EQ(read_file(at), "second\n");
  EXPECT_FALSE(fs::exists(at + ".tmp"));
  fs::create_directory(dir_ / "d");
  EXPECT_THROW(replace_file((dir_ / "d").string(), "x"), std::runtime_error);  // a directory is not replaced
  EXPECT_FALSE(fs::exists(dir_ / "d.tmp"));
  EXPECT_TRUE(fs::is_directory(dir_ / "d"));
}

}  // namespace
}  // namespace batchlm::runner
