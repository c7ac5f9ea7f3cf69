#include "batchlm/runner/writer.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "batchlm/runner/ignored_signal.hpp"

namespace batchlm::runner {

namespace {

[[noreturn]] void throw_io(const std::string& action, const std::string& path, int err) {
  throw std::runtime_error(action + " " + path + ": " + std::strerror(err));
}

// A write, fsync, truncation or rename that failed: the caller reports it as an output that
// cannot be written now (make room, run again), not as a mistake in what it was given.
[[noreturn]] void throw_write_error(const std::string& action, const std::string& path, int err) {
  throw OutputWriteError(action + " " + path + ": " + std::strerror(err));
}

// Owns a descriptor for the few places that open one only for the span of a function.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

int open_or_throw(const std::string& path, int flags, mode_t mode = 0644) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) throw_io("cannot open", path, errno);
  return fd;
}

// Opens `path`, creating it if absent; `created` says whether this call made it (a refused run
// removes what it made, and only that). `what` names it in errors ("output out/x.jsonl").
int open_creating(const std::string& path, int flags, bool& created, const std::string& what) {
  // O_EXCL first, so that a file made meanwhile by another run is not taken for this one's.
  for (int tries = 0;; ++tries) {
    int fd = ::open(path.c_str(), flags | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
      created = true;
      return fd;
    }
    if (errno == EINTR) continue;
    if (errno != EEXIST) throw_io("cannot open", what, errno);
    // There: open it as it is (a dangling symbolic link is there too, and open creates its target).
    fd = ::open(path.c_str(), flags | (tries < 8 ? 0 : O_CREAT) | O_CLOEXEC, 0644);
    if (fd >= 0) {
      created = false;
      return fd;
    }
    if (errno != EINTR && errno != ENOENT) throw_io("cannot open", what, errno);
  }
}

// Writes everything or throws OutputWriteError; `done` tells the caller how far it got, so a
// retry after an error (disk full) continues at the exact byte instead of duplicating a prefix.
void write_all(int fd, std::string_view data, const std::string& path, std::size_t& done) {
  // A write past the file size limit (ulimit -f) fails with EFBIG, and the kernel also sends
  // SIGXFSZ, whose default action kills the process with its buffered records unwritten. Ignored
  // for the span of each write, the limit is an error like a full disk whoever uses the writer
  // and whenever: the resume rewrite runs before the caller could have set anything up (the
  // disposition is the process's; a writer is used from one thread).
  const IgnoredSignal file_size_signal_ignored(SIGXFSZ);
  done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_write_error("cannot write", path, errno);
    }
    done += static_cast<std::size_t>(n);
  }
}

void write_all(int fd, std::string_view data, const std::string& path) {
  std::size_t done = 0;
  write_all(fd, data, path, done);
}

void fsync_or_throw(int fd, const std::string& path) {
  while (::fsync(fd) != 0) {
    if (errno != EINTR) throw_write_error("cannot fsync", path, errno);
  }
}

std::string parent_directory(const std::string& path) {
  auto parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// A rename or a new file is durable only once its directory entry is; without this a crash
// can bring back the old file or lose the new one.
void fsync_directory(const std::string& path) {
  const std::string dir = parent_directory(path);
  ScopedFd fd(open_or_throw(dir, O_RDONLY | O_DIRECTORY));
  // Some file systems cannot fsync a directory (EINVAL); they give no stronger guarantee to
  // ask for, so that is not an error.
  while (::fsync(fd.get()) != 0) {
    if (errno == EINTR) continue;
    if (errno == EINVAL) return;
    throw_write_error("cannot fsync directory", dir, errno);
  }
}

// Streams the file line by line in blocks, so that resuming a large output keeps memory flat.
// on_line(line, offset of its first byte, whether it ended with '\n').
template <typename OnLine>
void for_each_line(int fd, const std::string& path, OnLine&& on_line) {
  std::vector<char> block(1 << 20);
  std::string partial;
  std::int64_t partial_offset = 0, offset = 0;
  for (;;) {
    const ssize_t n = ::read(fd, block.data(), block.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_io("cannot read", path, errno);
    }
    if (n == 0) break;
    std::string_view chunk(block.data(), static_cast<std::size_t>(n));
    while (!chunk.empty()) {
      const auto newline = chunk.find('\n');
      if (newline == std::string_view::npos) {
        if (partial.empty()) partial_offset = offset;
        partial.append(chunk);
        offset += static_cast<std::int64_t>(chunk.size());
        break;
      }
      const std::string_view piece = chunk.substr(0, newline);
      if (partial.empty()) {
        on_line(piece, offset, true);
      } else {
        partial.append(piece);
        on_line(std::string_view(partial), partial_offset, true);
        partial.clear();
      }
      offset += static_cast<std::int64_t>(newline + 1);
      chunk.remove_prefix(newline + 1);
    }
  }
  if (!partial.empty()) on_line(std::string_view(partial), partial_offset, false);
}

bool blank(std::string_view line) {
  return line.find_first_not_of(" \t\r") == std::string_view::npos;
}

// The file a path names: symbolic links followed (a dangling one to where it points), so that
// every name of one output takes the same lock and a rewrite replaces the file, not the link.
std::string resolve_links(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path p(path);
  std::error_code ec;
  for (int hops = 0; hops < 40 && fs::is_symlink(fs::symlink_status(p, ec)); ++hops) {
    const fs::path target = fs::read_symlink(p, ec);
    if (ec) break;
    p = target.is_absolute() ? target : p.parent_path() / target;
  }
  const fs::path resolved = fs::weakly_canonical(p, ec);
  return ec ? p.string() : resolved.string();
}

// Takes the output file's own lock too: two names for one file (hard links) have two lock files.
void lock_output(int fd, const std::string& path) {
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return;
  const int err = errno;
  if (err != EWOULDBLOCK) throw_io("cannot lock", path, err);
  throw OutputLockedError("output " + path + " is in use by another run (under another name)");
}

// An output is a file the next run can read back and resume from. Anything else at the path
// (a directory, a pipe such as a piped /dev/stdout, a terminal, /dev/null) is refused before a
// lock file is made beside it; opening a pipe nobody reads would even block for good.
void check_can_be_output(const std::string& path) {
  static constexpr const char* kGive = ": batchlm writes its records to a file it can resume from on the next "
                                       "run; give a file path (such as out/NAME.jsonl)";
  if (path == "-") throw std::runtime_error(std::string("output '-' (standard output) is not supported") + kGive);
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0 || S_ISREG(info.st_mode)) return;  // absent: created
  const char* kind = S_ISDIR(info.st_mode)    ? "a directory"
                     : S_ISFIFO(info.st_mode) ? "a pipe"
                     : S_ISCHR(info.st_mode)  ? "a character device"
                     : S_ISBLK(info.st_mode)  ? "a block device"
                     : S_ISSOCK(info.st_mode) ? "a socket"
                                              : "of another kind";
  throw std::runtime_error("output " + path + " is " + kind + ", not a file" + kGive);
}

// 0 when a file can be made in directory `dir`, else why not (an errno). access() alone
// answers for the permission bits: root passes it on /proc, /sys or a directory whose file
// system refuses new names, and an ACL or a network file system can answer otherwise. So a
// file is made there and removed again.
int refuses_new_files(const std::string& dir) {
  if (::access(dir.c_str(), W_OK | X_OK) != 0) return errno;
  std::string name = (std::filesystem::path(dir) / ".batchlm-check-XXXXXX").string();
  const int fd = ::mkstemp(name.data());
  if (fd < 0) return errno;
  ::close(fd);
  ::unlink(name.c_str());
  return 0;
}

// Why directory `dir` takes no new file, for a message: "DIR: ERROR", but where the directory is
// there and the file system answered "no such file" (/proc, /sys), that it takes none.
std::string no_new_files(const std::string& dir, int err) {
  struct stat info {};
  if (err == ENOENT && ::stat(dir.c_str(), &info) == 0 && S_ISDIR(info.st_mode))
    return dir + " takes no new files (its file system refused one: " + std::strerror(err) + ")";
  return dir + ": " + std::strerror(err);
}

// The directories `path`'s parent needs made, outermost first (none when it is there). Throws,
// naming the output, where one on the way is not a directory or cannot be looked into.
std::vector<std::string> missing_directories(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<std::string> missing;
  for (fs::path dir = parent_directory(path);; dir = dir.has_parent_path() ? dir.parent_path() : fs::path(".")) {
    struct stat info {};
    if (::stat(dir.c_str(), &info) == 0) {
      if (!S_ISDIR(info.st_mode))
        throw std::runtime_error("cannot create the directory for output " + path + ": " + dir.string() +
                                 " is not a directory");
      std::reverse(missing.begin(), missing.end());
      return missing;
    }
    if (errno != ENOENT && errno != ENOTDIR)
      throw std::runtime_error("cannot create the directory for output " + path + ": " + dir.string() + ": " +
                               std::strerror(errno));
    missing.push_back(dir.string());
    if (dir == "." || dir == dir.root_path()) return missing;  // cannot happen: "." and "/" are there
  }
}

// Whether every complete line of the file at `path` is a record with an id (see parse_record).
void check_records(const std::string& path);

// What the lock file holds: the pid of the run that holds (or last held) it, then the settings
// its records are made with.
struct LockText {
  std::string pid, settings;
};
LockText read_lock(int fd) {
  std::string text;
  char block[4096];
  ssize_t n = 0;
  for (off_t at = 0; (n = ::pread(fd, block, sizeof block, at)) > 0; at += n)
    text.append(block, static_cast<std::size_t>(n));
  LockText lock;
  const std::size_t eol = text.find('\n');
  lock.pid = text.substr(0, eol);
  lock.pid.erase(std::remove_if(lock.pid.begin(), lock.pid.end(), [](char c) { return c < '0' || c > '9'; }),
                 lock.pid.end());
  if (eol != std::string::npos) {
    lock.settings = text.substr(eol + 1);
    while (!lock.settings.empty() && lock.settings.back() == '\n') lock.settings.pop_back();
  }
  return lock;
}

OutputLockedError in_use(const std::string& path, const std::string& lock_path, const std::string& pid) {
  return OutputLockedError("output " + path + " is in use by another run (pid " + (pid.empty() ? "unknown" : pid) +
                           ", lock " + lock_path + ")");
}

// The pid holding an flock on the file at `path`, from the kernel's table (/proc/locks: "1:
// FLOCK  ADVISORY  WRITE 15554 fe:00:10952832 0 EOF", device major and minor in hex); nothing
// where none does or the table cannot be read. Looking, unlike trying the lock, cannot make a
// run that starts at the same moment find its output taken.
std::optional<long> flock_holder(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) return std::nullopt;
  std::ifstream table("/proc/locks");
  for (std::string line; std::getline(table, line);) {
    std::istringstream fields(line);
    std::string ordinal, kind, mode, access, pid, where;
    fields >> ordinal >> kind;  // a waiter has "->" here, below the holder: not one
    if (kind != "FLOCK" || !(fields >> mode >> access >> pid >> where)) continue;
    unsigned major = 0, minor = 0;
    unsigned long long inode = 0;
    if (std::sscanf(where.c_str(), "%x:%x:%llu", &major, &minor, &inode) != 3) continue;
    if (major == ::major(info.st_dev) && minor == ::minor(info.st_dev) && inode == info.st_ino)
      return std::strtol(pid.c_str(), nullptr, 10);
  }
  return std::nullopt;
}

}  // namespace

namespace {

// Whether `file` is itself an output of some run, which made a lock file beside it: one output's
// companion (its lock, summary or rewrite file) must never be another's records.
bool is_an_output(const std::string& file) {
  struct stat info {};
  return ::lstat((file + ".lock").c_str(), &info) == 0;
}

// The output's lock file and its summary (beside the output as given) are its own: an output
// another job wrote under such a name (out.jsonl.lock, out.jsonl.summary.json) would be
// overwritten, and something else there is not the run's to replace.
void check_companions(const std::string& given, const std::string& path) {
  const auto refuse = [&](const std::string& file, const std::string& role, const std::string& what) {
    throw std::runtime_error(file + " is " + what + ", where output " + given + " keeps its " + role +
                             "; batchlm never deletes what it did not write: give this job another output path, "
                             "or move that file away");
  };
  struct stat info {};
  const std::string lock_path = path + ".lock";
  if (::lstat(lock_path.c_str(), &info) == 0) {
    // A link would be followed, and what it leads to written over.
    if (S_ISLNK(info.st_mode)) refuse(lock_path, "lock", "a symbolic link");
    if (is_an_output(lock_path)) refuse(lock_path, "lock", "another job's output (it has a lock file of its own)");
    // A lock file holds the pid of the run that last held it on its first line, then settings.
    if (S_ISREG(info.st_mode) && info.st_size > 0) {
      std::ifstream in(lock_path);
      std::string first;
      std::getline(in, first);
      if (in && (first.empty() || first.find_first_not_of("0123456789") != std::string::npos))
        refuse(lock_path, "lock", "not a batchlm lock file");
    }
  }
  const std::string summary = given + ".summary.json";
  // Another output there, a directory (empty, it would be removed to make room; else the summary
  // would fail after every request), a FIFO or a device is not the run's to replace. The
  // summary's own name may be a link (the rename replaces the link); its temporary file is
  // opened without following one.
  for (const std::string& file : {summary, summary + ".tmp"}) {
    if (is_an_output(file)) refuse(file, "summary", "another job's output (it has a lock file of its own)");
    if (::lstat(file.c_str(), &info) == 0 && !S_ISREG(info.st_mode) && (!S_ISLNK(info.st_mode) || file != summary))
      refuse(file, "summary",
             S_ISDIR(info.st_mode) ? "a directory" : S_ISLNK(info.st_mode) ? "a symbolic link" : "not a file");
  }
  if (::lstat(summary.c_str(), &info) == 0 && S_ISREG(info.st_mode) && info.st_size > 0) {
    std::ifstream in(summary, std::ios::binary);
    if (!in) refuse(summary, "summary", std::string("a file that cannot be read (") + std::strerror(errno) + ")");
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    const nlohmann::json earlier = nlohmann::json::parse(text, nullptr, false);
    // A summary an older version cut short (it wrote in place) is still one: an object's start
    // that does not parse; records, an object on each line, are not.
    const std::size_t start = text.find_first_not_of(" \t\r\n");
    const nlohmann::json first_line = nlohmann::json::parse(text.substr(0, text.find('\n')), nullptr, false);
    const bool cut_short = earlier.is_discarded() && start != std::string::npos && text[start] == '{' &&
                           !(first_line.is_object() && first_line.contains("id"));
    if (earlier.is_object() ? !earlier.contains("counts") : !cut_short)
      refuse(summary, "summary", "not a batchlm summary");
  }
}

// A resume's rewrite goes to PATH.tmp, made anew: what is there must be a rewrite a killed run
// left (records, or nothing yet), never a file of the user's, nor another job's output.
void check_rewrite_file(const std::string& path) {
  const std::string tmp_path = path + ".tmp";
  struct stat info {};
  if (::lstat(tmp_path.c_str(), &info) != 0) return;
  const std::string reason = "it is where a resume rewrites the output, and batchlm never deletes what it did not "
                             "write: move it away, then run again";
  if (is_an_output(tmp_path)) throw std::runtime_error(tmp_path + " is another job's output (it has a lock file of its own); " + reason);
  if (!S_ISREG(info.st_mode)) throw std::runtime_error(tmp_path + " exists and is not a file; " + reason);
  if (::access(tmp_path.c_str(), R_OK) != 0)
    throw std::runtime_error(tmp_path + " exists and cannot be read (" + std::strerror(errno) + "); " + reason);
  try {
    check_records(tmp_path);
  } catch (const std::exception&) {
    throw std::runtime_error(tmp_path + " exists and holds other things than records; " + reason);
  }
}

// Whether a resume would rewrite the output (PATH.tmp): a failed record, redone, before a line
// that is kept.
bool would_rewrite(const std::string& path) {
  std::ifstream in(path);
  bool failed_before = false;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json record = nlohmann::json::parse(line, nullptr, false);
    if (!record.is_object()) continue;
    const bool failed = !record.value("error", nlohmann::json()).is_null();
    if (!failed && failed_before) return true;
    failed_before = failed_before || failed;
  }
  return false;
}

// The output's companions (its lock, its summary and the summary's temporary file) are named by
// suffixes: a name the file system takes may still be one that makes them too long, found only
// when the summary is written, after every request.
void check_name_length(const std::string& path, const std::string& dir) {
  constexpr std::string_view kLongest = ".summary.json.tmp";
  const std::string name = std::filesystem::path(path).filename().string();
  long most = ::pathconf(dir.c_str(), _PC_NAME_MAX);
  if (most <= 0) most = 255;
  if (static_cast<long>(name.size() + kLongest.size()) > most)
    throw std::runtime_error("output name " + name.substr(0, 40) + "... is " + std::to_string(name.size()) +
                             " bytes: its summary's temporary file (" + std::string(kLongest) +
                             " added) would exceed this file system's limit of " + std::to_string(most) +
                             " bytes per name; choose a name of at most " +
                             std::to_string(most - static_cast<long>(kLongest.size())));
}

}  // namespace

void check_output(const std::string& given, bool read_records, bool fresh) {
  if (given.empty()) throw std::runtime_error("output path is empty");
  check_can_be_output(given);
  const std::string path = resolve_links(given);
  const std::string lock_path = path + ".lock";
  const std::string dir = parent_directory(path);
  // The nearest directory there: the output's own, or the one its missing directories go in.
  const std::vector<std::string> missing = missing_directories(path);
  const std::string there =
      missing.empty() ? dir : (std::filesystem::path(missing.front()).has_parent_path()
                                   ? std::filesystem::path(missing.front()).parent_path().string()
                                   : std::string("."));
  check_name_length(given, there);
  check_name_length(path, there);
  check_companions(given, path);
  struct stat info {};
  if (::stat(path.c_str(), &info) == 0) {
    if (::access(path.c_str(), R_OK | W_OK) != 0)
      throw std::runtime_error("cannot open output " + path + " for writing: " + std::strerror(errno));
    if (const std::optional<long> pid = flock_holder(lock_path)) throw in_use(path, lock_path, std::to_string(*pid));
    if (::access(lock_path.c_str(), F_OK) == 0) {
      if (::access(lock_path.c_str(), R_OK | W_OK) != 0)
        throw std::runtime_error("cannot open the lock file " + lock_path + " of output " + path + ": " +
                                 std::strerror(errno));
    } else if (const int err = refuses_new_files(dir); err != 0) {
      throw std::runtime_error("cannot create the lock file " + lock_path + " of output " + path + ": " +
                               no_new_files(dir, err));
    }
    // The summary is made beside the output as given (a link's directory, not its target's)
    // and renamed into place, the earlier one removed at the start: in a directory that takes
    // no new entries, the run would send everything, then leave the earlier run's summary
    // describing a file it no longer does.
    if (const std::string beside = parent_directory(given); const int err = refuses_new_files(beside))
      throw std::runtime_error("cannot write the summary of output " + given + " beside it: " + no_new_files(beside, err));
    if (read_records) {
      check_records(path);
      if (!fresh && would_rewrite(path)) check_rewrite_file(path);
    }
    return;
  }
  // Absent: made in the nearest directory there, which must take new entries.
  if (const int err = refuses_new_files(there); err != 0)
    throw std::runtime_error("cannot create output " + path + ": " + no_new_files(there, err));
}

void replace_file(const std::string& path, std::string_view content) {
  const std::string tmp_path = path + ".tmp";
  try {
    // Not through a link: what one leads to is not this file to empty.
    ScopedFd tmp(open_or_throw(tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW));
    write_all(tmp.get(), content, tmp_path);
    fsync_or_throw(tmp.get(), tmp_path);
    if (::close(tmp.release()) != 0) throw_write_error("cannot close", tmp_path, errno);
    if (::rename(tmp_path.c_str(), path.c_str()) != 0) throw_write_error("cannot rename " + tmp_path + " to", path, errno);
  } catch (...) {
    ::unlink(tmp_path.c_str());  // no half file left behind
    throw;
  }
  // The file is in place: a directory that cannot be opened or synced leaves it so.
  try {
    fsync_directory(path);
  } catch (const std::exception&) {
  }
}

OutputWriter::OutputWriter(Options options, const std::function<void(const nlohmann::json&)>& on_kept)
    : options_(std::move(options)), last_flush_(std::chrono::steady_clock::now()) {
  if (options_.path.empty()) throw std::runtime_error("output path is empty");
  // As given: stat follows every link, /dev/stdout's to a pipe included, which resolve_links
  // cannot name.
  check_can_be_output(options_.path);
  const std::string given = options_.path;
  options_.path = resolve_links(options_.path);
  const std::string& path = options_.path;
  const std::string lock_path = path + ".lock";
  check_companions(given, path);
  // What this constructor made, removed again when it throws: a refused run leaves nothing behind.
  std::vector<std::string> made_directories;
  bool made_lock = false, made_output = false;
  try {
    for (const std::string& dir : missing_directories(path)) {
      if (::mkdir(dir.c_str(), 0777) == 0) {
        made_directories.push_back(dir);
      } else if (errno != EEXIST) {
        throw std::runtime_error("cannot create the directory " + dir + " for output " + path + ": " +
                                 std::strerror(errno));
      }
    }

    // The lock lives in its own file so that rewriting the output (rename over it) does not
    // drop it, and the kernel releases it however this process ends.
    // A run refused at start removes the lock file it made, and a run that opened that file
    // just before would hold a lock on a name that is gone: the lock counts only while the name
    // still leads to the file locked, else it is taken again.
    for (int tries = 0;; ++tries) {
      lock_fd_ = open_creating(lock_path, O_RDWR, made_lock, "the lock file " + lock_path + " of output " + path);
      if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
        const int err = errno;
        if (err != EWOULDBLOCK) throw_io("cannot lock", lock_path, err);
        throw in_use(path, lock_path, read_lock(lock_fd_).pid);
      }
      struct stat held {}, named {};
      if (tries >= 8 || (::fstat(lock_fd_, &held) == 0 && ::stat(lock_path.c_str(), &named) == 0 &&
                         held.st_dev == named.st_dev && held.st_ino == named.st_ino))
        break;
      ::close(std::exchange(lock_fd_, -1));
    }
    // The earlier run's settings stay until this run has passed before_changes.
    earlier_settings_ = read_lock(lock_fd_).settings;
    write_lock(earlier_settings_);

    struct stat info {};
    const bool exists = ::stat(path.c_str(), &info) == 0;
    // Opened without truncating and locked before anything is changed.
    fd_ = open_creating(path, O_WRONLY | O_APPEND, made_output, "output " + path);
    lock_output(fd_, path);
    if (options_.fresh) {
      // Starting over replaces an earlier output, never a file of another kind.
      if (exists) check_is_output();
      if (::ftruncate(fd_, 0) != 0) throw_write_error("cannot truncate", path, errno);
      fsync_or_throw(fd_, path);
      fsync_directory(path);
      write_lock(options_.settings);
      return;
    }
    if (exists && resume(on_kept)) {
      // The output was rewritten under the same name: append to (and lock) the new file. The
      // file it replaced keeps its lock while another name (a hard link) leads to it, so a run
      // through that name is refused while this one lasts; with no name left it is closed, which
      // gives its room back.
      struct stat replaced {};
      if (::fstat(fd_, &replaced) == 0 && replaced.st_nlink > 0) {
        replaced_fd_ = std::exchange(fd_, -1);
      } else {
        ::close(std::exchange(fd_, -1));
      }
      fd_ = open_or_throw(path, O_WRONLY | O_CREAT | O_APPEND);
      lock_output(fd_, path);
    }
    if (!exists) fsync_directory(path);
    write_lock(options_.settings);
  } catch (...) {
    // Removed while still locked: a run that opened the lock file meanwhile finds it held, and
    // the output's own lock guards the output against a run that makes a new one.
    if (made_output) ::unlink(path.c_str());
    if (made_lock) ::unlink(lock_path.c_str());
    for (auto dir = made_directories.rbegin(); dir != made_directories.rend(); ++dir) ::rmdir(dir->c_str());
    if (fd_ >= 0) ::close(fd_);
    if (replaced_fd_ >= 0) ::close(replaced_fd_);
    if (lock_fd_ >= 0) ::close(lock_fd_);
    fd_ = replaced_fd_ = lock_fd_ = -1;
    throw;
  }
}

namespace {

// Every complete line this writer leaves is a record with an id (a kill can only cut the last
// one short). Anything else means the path names a file that is not a batchlm output (an
// input, a job file, a model, notes): resuming would delete those lines and --fresh the whole
// file, so neither touches it.
// `records_before`: lines before this one were records, so the file is an output with a damaged
// line (edited by hand, or two writers), not another kind of file.
nlohmann::json parse_record(std::string_view line, const std::string& path, std::int64_t line_number,
                            bool records_before) {
  auto record = nlohmann::json::parse(line, nullptr, false);
  // Every record has an id and an error (null where it succeeded): a dataset's lines with ids of
  // their own are not records, and such a file is never resumed into, nor emptied by --fresh.
  if (record.is_discarded() || !record.is_object() || !record.contains("id") || !record.contains("error")) {
    const std::string what = record.is_discarded()     ? "not a JSON line"
                             : !record.is_object()     ? "not a JSON object"
                             : !record.contains("id")  ? "a JSON object without an \"id\""
                                                       : "a JSON object without an \"error\" (every record has one)";
    const std::string where = path + ":" + std::to_string(line_number) + ": ";
    if (records_before)
      throw NotAnOutputError(where + what + ", between records: the file was left as it is; repair or delete "
                                     "that line (the records around it are kept), or choose another output");
    throw NotAnOutputError(where + what + ", so this is not a batchlm output file; it was left as it is (remove "
                                          "it or choose another output)");
  }
  return record;
}

}  // namespace

void OutputWriter::check_is_output() const { check_records(options_.path); }

namespace {

void check_records(const std::string& path) {
  ScopedFd file(open_or_throw(path, O_RDONLY));
  std::int64_t line_number = 0, records = 0;
  for_each_line(file.get(), path, [&](std::string_view line, std::int64_t, bool complete) {
    ++line_number;
    if (complete && !blank(line)) parse_record(line, path, line_number, records++ > 0);
  });
}

}  // namespace

bool OutputWriter::resume(const std::function<void(const nlohmann::json&)>& on_kept) {
  const std::string& path = options_.path;
  ScopedFd file(open_or_throw(path, O_RDWR));

  // Pass 1: decide. Only the positions of dropped lines are remembered, so a rewrite can
  // replay the decisions without parsing again.
  std::vector<std::int64_t> dropped;  // offsets of dropped lines, ascending
  bool kept_after_drop = false;
  // The ids of dropped failures: one that also has a success is not to retry.
  std::unordered_set<std::string> failed_ids;
  std::unordered_set<std::string> redone_ids;  // counted once, not as failed too
  bool any_record = false;
  std::int64_t line_number = 0;
  for_each_line(file.get(), path, [&](std::string_view line, std::int64_t offset, bool complete) {
    ++line_number;
    if (complete && blank(line)) return;
    auto drop = [&] { dropped.push_back(offset); };
    if (!complete) {  // only the last line can lack '\n': the write of it was cut short
      resume_.dropped_torn_line = true;
      return drop();
    }
    auto record = parse_record(line, path, line_number, any_record);
    any_record = true;
    std::string id = record["id"].dump();
    if (auto error = record.find("error"); error != record.end() && !error->is_null()) {
      failed_ids.insert(std::move(id));
      return drop();
    }
    if (options_.redo && options_.redo(record) && !resume_.done_ids.contains(id)) {
      redone_ids.insert(std::move(id));
      return drop();
    }
    if (!resume_.done_ids.insert(std::move(id)).second) {
      ++resume_.dropped_duplicates;
      return drop();
    }
    ++resume_.kept;
    if (!dropped.empty()) kept_after_drop = true;
    if (on_kept) on_kept(record);
  });
  for (const std::string& id : failed_ids)
    if (!resume_.done_ids.contains(id) && !redone_ids.contains(id)) resume_.failed_ids.insert(id);
  // Each id once, and not where a later record of it is kept.
  for (const std::string& id : redone_ids) resume_.redone += resume_.done_ids.contains(id) ? 0 : 1;
  if (options_.before_changes) options_.before_changes(earlier_settings_);
  if (dropped.empty()) return false;

  if (!kept_after_drop) {
    // Everything to drop sits at the end (the usual case after a kill): cutting the file there
    // is one atomic step and costs nothing however large the output is.
    if (::ftruncate(file.get(), dropped.front()) != 0) throw_write_error("cannot truncate", path, errno);
    fsync_or_throw(file.get(), path);
    return false;
  }

  // Pass 2: copy the kept lines to a temporary file and rename it over the output, so a kill
  // during the rewrite leaves either the old file or the new one, never a mix.
  if (::lseek(file.get(), 0, SEEK_SET) != 0) throw_io("cannot seek", path, errno);
  check_rewrite_file(path);
  const std::string tmp_path = path + ".tmp";
  ScopedFd tmp(open_or_throw(tmp_path, O_WRONLY | O_CREAT | O_TRUNC));
  try {
    // The rewrite takes the output's place with its owner, group and permissions, so a private
    // file stays private; best effort, since a file system without them (vfat, some network
    // mounts) refuses them and the rewrite is still wanted.
    if (struct stat original {}; ::fstat(file.get(), &original) == 0) {
      [[maybe_unused]] const int owned = ::fchown(tmp.get(), original.st_uid, original.st_gid);
      [[maybe_unused]] const int moded = ::fchmod(tmp.get(), original.st_mode & 07777);
    }
    std::string out;
    auto next_drop = dropped.begin();
    for_each_line(file.get(), path, [&](std::string_view line, std::int64_t offset, bool complete) {
      if (next_drop != dropped.end() && *next_drop == offset) {
        ++next_drop;
        return;
      }
      if (!complete || blank(line)) return;
      out.append(line);
      out.push_back('\n');
      if (out.size() >= (1u << 20)) {
        write_all(tmp.get(), out, tmp_path);
        out.clear();
      }
    });
    write_all(tmp.get(), out, tmp_path);
    fsync_or_throw(tmp.get(), tmp_path);
    if (::rename(tmp_path.c_str(), path.c_str()) != 0) {
      throw_write_error("cannot rename " + tmp_path + " to", path, errno);
    }
  } catch (...) {
    // The output is as it was. A partial copy left behind (on a full disk, as large as the room
    // that was free) would keep the disk full until the next run.
    ::unlink(tmp_path.c_str());
    throw;
  }
  fsync_directory(path);
  return true;
}

void OutputWriter::write_lock(const std::string& settings) {
  const std::string text = std::to_string(::getpid()) + "\n" + (settings.empty() ? "" : settings + "\n");
  const std::string lock_path = options_.path + ".lock";
  // Written over the old text, then cut to length: a kill between the two never leaves it empty
  // (at worst the old text's end follows the new, which then reads as no settings).
  if (::pwrite(lock_fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    throw_write_error("cannot write", lock_path, errno);
  }
  if (::ftruncate(lock_fd_, static_cast<off_t>(text.size())) != 0) throw_write_error("cannot write", lock_path, errno);
}

OutputWriter::~OutputWriter() {
  try {
    if (fd_ >= 0) flush();
  } catch (...) {
    // A destructor cannot report it; what was not written is rerun on resume.
  }
  if (fd_ >= 0) ::close(fd_);
  if (replaced_fd_ >= 0) ::close(replaced_fd_);
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the lock
}

namespace {
template <typename Json>
void check_record(const Json& record) {
  if (!record.is_object() || !record.contains("id")) {
    throw std::invalid_argument("output record without an id");
  }
}
}  // namespace

void OutputWriter::append(const nlohmann::json& record) {
  check_record(record);
  // Model output cut at an arbitrary byte may not be valid UTF-8; replacing the bad bytes
  // keeps the record instead of failing the item at the last step.
  append_line(record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

void OutputWriter::append(const nlohmann::ordered_json& record) {
  check_record(record);
  append_line(record.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
}

void OutputWriter::append_line(std::string line) {
  buffer_ += line;
  buffer_.push_back('\n');
  ++buffered_records_;
  if (buffered_records_ >= std::max(1, options_.flush_every)) flush();
}

void OutputWriter::flush_if_due(std::chrono::steady_clock::time_point now) {
  if (buffered_records_ > 0 && now - last_flush_ >= options_.flush_interval) flush();
}

void OutputWriter::flush() {
  if (fd_ < 0) throw std::runtime_error("output " + options_.path + " is not open");
  if (!buffer_.empty()) {
    // One write of whole lines: a kill can tear at most the last of them, which resume drops.
    std::size_t done = 0;
    try {
      write_all(fd_, buffer_, options_.path, done);
    } catch (...) {
      // A partial write (the disk filled up, the file size limit) left the records before its
      // last newline whole in the file; the rest stay buffered. The bytes of the first of them
      // that did go in are cut back off, so that the file holds whole lines only, to readers
      // meanwhile and if the run ends before there is room. Where that fails too, they stay, and
      // the next flush continues the record at the byte it stopped at.
      const std::string_view in_file(buffer_.data(), done);
      const std::size_t last_newline = in_file.rfind('\n');
      const std::size_t whole_bytes = last_newline == std::string_view::npos ? 0 : last_newline + 1;
      const auto whole = std::count(in_file.begin(), in_file.end(), '\n');
      written_ += whole;
      buffered_records_ -= whole;
      std::size_t kept = done;
      if (done > whole_bytes) {
        struct stat st {};
        const auto torn = static_cast<off_t>(done - whole_bytes);
        if (::fstat(fd_, &st) == 0 && st.st_size >= torn && ::ftruncate(fd_, st.st_size - torn) == 0)
          kept = whole_bytes;
      }
      buffer_.erase(0, kept);
      throw;
    }
    // In the file now, whatever the fsync says.
    buffer_.clear();
    written_ += buffered_records_;
    buffered_records_ = 0;
    fsync_or_throw(fd_, options_.path);
  }
  last_flush_ = std::chrono::steady_clock::now();
}

}  // namespace batchlm::runner
