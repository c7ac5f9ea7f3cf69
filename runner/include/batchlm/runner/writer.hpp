#pragma once
// The output JSONL: one line per finished item, buffered, flushed by count and by time,
// fsynced on flush. Opening it resumes: a torn last line is dropped, failed records are
// dropped (their items run again), and the ids of the successful records are returned so the
// runner skips them. A file with other lines is refused, not repaired (nor emptied by fresh). A lock file (and a lock
// on the output itself) refuses a second run on the same output under any of its names. A rewrite on resume puts a
// new file under the output's name; the file it replaced stays locked while another name (a hard link) leads to it.

#include <chrono>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_set>

#include <nlohmann/json.hpp>

namespace batchlm::runner {

class OutputLockedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The existing file at the output path has complete lines that are not records (it is some
// other file); it is left untouched.
class NotAnOutputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Writing the output, its lock file or the temporary copy of a rewrite failed (a full disk, the
// file size limit, an I/O error): the output cannot take more now, and what it held is intact.
// Unlike the other errors, which mean the output was not usable at all, this one passes once
// room is made.
class OutputWriteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ResumeInfo {
  std::unordered_set<std::string> done_ids;  // record["id"].dump() of every kept record
  std::int64_t kept = 0;             // successful records kept
  // Ids whose failed records were removed and that have no success (to retry), as done_ids holds them.
  std::unordered_set<std::string> failed_ids;
  std::int64_t dropped_failed() const { return static_cast<std::int64_t>(failed_ids.size()); }
  bool dropped_torn_line = false;    // a partial last line was cut off
  std::int64_t dropped_duplicates = 0;  // later records for an id already kept
  std::int64_t redone = 0;           // successful records removed to be made again (Options::redo)
};

// What OutputWriter checks of its output before it takes it, checked without changing anything
// (for a dry run, and before a run loads its model): the path can be an output (not "-", a
// directory, a pipe or a device), the directories it needs can be made, an existing file and its
// lock file can be written, or the directory a new one goes in takes new entries (a file is made
// there and removed: /proc passes access() as root);
// with read_records, an existing file is read through as a resume would (NotAnOutputError
// where it is not a batchlm output); and no other run holds its lock (OutputLockedError, read
// from the kernel's lock table, not by trying the lock). Throws std::runtime_error naming the
// output's path. Unless `fresh`, a resume's rewrite file (PATH.tmp) that is not batchlm's is
// refused where the resume would rewrite.
void check_output(const std::string& path, bool read_records = true, bool fresh = false);

// Replaces `path` with `content` whole or not at all, durably: written to PATH.tmp, fsynced,
// renamed over `path`, and the directory fsynced (a crash leaves the old file or the new one,
// never an empty one). Throws std::runtime_error naming the file; PATH.tmp is then removed.
void replace_file(const std::string& path, std::string_view content);

class OutputWriter {
 public:
  struct Options {
    std::string path;
    int flush_every = 64;
    std::chrono::milliseconds flush_interval{1000};
    bool fresh = false;  // start over: the existing output (a batchlm output) is emptied
    // What the records are made with (the runner's settings, as JSON text). It is kept in the
    // lock file after the pid once the writer holds the output, so the next run can say what
    // changed even after a kill -9 of this one.
    std::string settings;
    // Called once every kept record has been through on_kept and before the file is changed
    // (failed records dropped, a torn line cut): an exception from it leaves the file as it was.
    // `earlier_settings` are those the last run on this output kept (empty if none).
    std::function<void(const std::string& earlier_settings)> before_changes;
    // Successful records to make again (answers a limit since raised cut short): removed as
    // failed ones are, so that their items run again, and counted in ResumeInfo::redone.
    std::function<bool(const nlohmann::json& record)> redo;
  };

  // Follows symbolic links in the path to the file itself, takes the lock (`<file>.lock` and the
  // file's own, flock; released by the kernel even on kill -9), creates parent directories, then
  // reads and repairs the existing file. `on_kept` sees each kept record (for the summary).
  // Throws OutputLockedError when another run holds the lock, NotAnOutputError when the file
  // has a complete line that is not a record with an id, OutputWriteError when a write fails
  // (a rewrite's temporary file is removed then, the output left as it was), and
  // std::runtime_error (with the path) for other I/O errors. Writes past the file size limit fail
  // with EFBIG rather than raising SIGXFSZ.
  OutputWriter(Options options, const std::function<void(const nlohmann::json&)>& on_kept = {});
  ~OutputWriter();  // flushes
  OutputWriter(const OutputWriter&) = delete;
  OutputWriter& operator=(const OutputWriter&) = delete;

  const ResumeInfo& resume_info() const { return resume_; }

  // Buffers one record (must contain "id"); flushes when flush_every records are buffered.
  void append(const nlohmann::json& record);
  // The same, keeping the record's key order (the runner writes id first).
  void append(const nlohmann::ordered_json& record);
  // Flushes when the interval has passed since the last flush and something is buffered.
  void flush_if_due(std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now());
  // write + fsync of everything buffered. Throws OutputWriteError; what a partial write did not
  // take stays buffered, and the next flush goes on from the byte where it stopped.
  void flush();

  const std::string& path() const { return options_.path; }  // links resolved
  // Records wholly in the file.
  std::int64_t written() const { return written_; }
  // Records appended but not yet wholly in the file: after a partial write, those it did not
  // finish (the first of them may be torn in the file; the next flush completes it).
  std::int64_t buffered() const { return buffered_records_; }

 private:
  void append_line(std::string line);
  // Reads the existing output, fills resume_, and cuts or rewrites it when lines must go;
  // true when it was rewritten (a new file under the same name).
  // Throws NotAnOutputError when a complete line is not a record with an id.
  void check_is_output() const;
  bool resume(const std::function<void(const nlohmann::json&)>& on_kept);
  // The lock file's text: this process's pid, then the settings line.
  void write_lock(const std::string& settings);

  std::string earlier_settings_;  // the settings line the lock file held when taken

  Options options_;
  ResumeInfo resume_;
  int fd_ = -1;
  int lock_fd_ = -1;
  int replaced_fd_ = -1;  // the file a rewrite replaced, locked while another name leads to it
  std::string buffer_;
  std::int64_t buffered_records_ = 0;
  std::int64_t written_ = 0;
  std::chrono::steady_clock::time_point last_flush_;
};

}  // namespace batchlm::runner
