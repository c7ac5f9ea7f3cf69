#include "batchlm/local_engine/gguf.hpp"

// Layout of a GGUF file (v2 and v3; all integers little-endian):
//
//   magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
//   kv_count x   { key: string | value_type u32 | value }
//   tensor_count x { name: string | n_dims u32 | dims u64[n_dims] | type u32 | offset u64 }
//   padding to a multiple of general.alignment (default 32)
//   data section: each tensor's bytes at its offset, which is aligned too
//
// string = length u64 + bytes (no NUL); array = element_type u32 + count u64 + items.
//
// The file is mapped read-only and parsed front to back by a Reader that checks every read,
// length and count against the bytes left before it reads or allocates, so a corrupt count
// costs an error message, not a multi-gigabyte allocation.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <signal.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <unordered_set>

#include "batchlm/core/types.hpp"

namespace batchlm::local_engine::gguf {

static_assert(std::endian::native == std::endian::little,
              "GGUF is little-endian and this reader uses the mapped bytes in place");

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (bytes >= 1024 && u < 3) {
    bytes /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buf;
}

std::string_view to_string(ValueType t) {
  switch (t) {
    case ValueType::U8: return "u8";
    case ValueType::I8: return "i8";
    case ValueType::U16: return "u16";
    case ValueType::I16: return "i16";
    case ValueType::U32: return "u32";
    case ValueType::I32: return "i32";
    case ValueType::F32: return "f32";
    case ValueType::Bool: return "bool";
    case ValueType::String: return "string";
    case ValueType::Array: return "array";
    case ValueType::U64: return "u64";
    case ValueType::I64: return "i64";
    case ValueType::F64: return "f64";
  }
  return "?";
}

namespace {

constexpr std::uint32_t kMinVersion = 2;  // v1 used u32 counts and lengths
constexpr std::uint32_t kMaxVersion = 3;  // v3 only added big-endian files, which we reject
constexpr std::uint64_t kDefaultAlignment = 32;
constexpr std::uint32_t kMaxDims = 4;
// Arrays of arrays are legal; a corrupt file could nest them millions deep (12 bytes a level)
// and overflow the stack of the recursive parser. Real files nest at most one level.
constexpr int kMaxArrayDepth = 8;
// Bounds far past any model (the largest vocabularies have a few hundred thousand tokens and
// merges; the largest models some tens of thousands of tensors), so that a corrupt or hostile
// file is refused before its counts cost memory: every array item is held as a Value of some
// 50 bytes, whatever its encoded size.
constexpr std::uint64_t kMaxArrayItems = std::uint64_t{1} << 24;  // in all the metadata's arrays
constexpr std::uint64_t kMaxKeys = std::uint64_t{1} << 20;
constexpr std::uint64_t kMaxTensors = std::uint64_t{1} << 20;
// The GGUF spec limits keys to 65535 bytes.
constexpr std::uint64_t kMaxKeyLength = 65535;

// The smallest encodings, used to reject counts that cannot fit in what is left of the file.
constexpr std::uint64_t kMinKvBytes = 8 + 1 + 4 + 1;                // key length, 1-byte key, type, u8
constexpr std::uint64_t kMinTensorInfoBytes = 8 + 1 + 4 + 8 + 4 + 8;  // 1-byte name, one dim

std::optional<ValueType> value_type_from_id(std::uint32_t id) {
  if (id > static_cast<std::uint32_t>(ValueType::F64)) return std::nullopt;
  return static_cast<ValueType>(id);
}

// Bytes the smallest value of type `t` takes in the file.
std::uint64_t min_encoded_size(ValueType t) {
  switch (t) {
    case ValueType::U8:
    case ValueType::I8:
    case ValueType::Bool: return 1;
    case ValueType::U16:
    case ValueType::I16: return 2;
    case ValueType::U32:
    case ValueType::I32:
    case ValueType::F32: return 4;
    case ValueType::U64:
    case ValueType::I64:
    case ValueType::F64:
    case ValueType::String: return 8;  // the length of an empty string
    case ValueType::Array: return 12;  // element type and count of an empty array
  }
  return 1;
}

bool is_unsigned(ValueType t) {
  return t == ValueType::U8 || t == ValueType::U16 || t == ValueType::U32 || t == ValueType::U64;
}
bool is_signed(ValueType t) {
  return t == ValueType::I8 || t == ValueType::I16 || t == ValueType::I32 || t == ValueType::I64;
}


constexpr TensorType kTensorTypes[] = {
    {0, "F32", 1, 4},          {1, "F16", 1, 2},          {2, "Q4_0", 32, 18},
    {3, "Q4_1", 32, 20},       {6, "Q5_0", 32, 22},       {7, "Q5_1", 32, 24},
    {8, "Q8_0", 32, 34},       {9, "Q8_1", 32, 36},       {10, "Q2_K", 256, 84},
    {11, "Q3_K", 256, 110},    {12, "Q4_K", 256, 144},    {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210},    {15, "Q8_K", 256, 292},    {16, "IQ2_XXS", 256, 66},
    {17, "IQ2_XS", 256, 74},   {18, "IQ3_XXS", 256, 98},  {19, "IQ1_S", 256, 50},
    {20, "IQ4_NL", 32, 18},    {21, "IQ3_S", 256, 110},   {22, "IQ2_S", 256, 82},
    {23, "IQ4_XS", 256, 136},  {24, "I8", 1, 1},          {25, "I16", 1, 2},
    {26, "I32", 1, 4},         {27, "I64", 1, 8},         {28, "F64", 1, 8},
    {29, "IQ1_M", 256, 56},    {30, "BF16", 1, 2},        {34, "TQ1_0", 256, 54},
    {35, "TQ2_0", 256, 66},    {39, "MXFP4", 32, 17},     {40, "NVFP4", 64, 36},
    {41, "Q1_0", 128, 18},     {42, "Q2_0", 64, 18},
};

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

std::uint32_t byte_swapped(std::uint32_t v) {
  return (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
}

Error type_error(std::string_view key, ValueType actual, std::string_view expected) {
  return Error("metadata key " + quote_name(key) + " has type " + std::string(to_string(actual)) +
               ", expected " + std::string(expected));
}

// Closes a file descriptor on every path out of File::open; the mapping outlives it.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// Reads the mapped file front to back. Every read checks the bytes left first and reports a
// short file as "truncated at byte <file size> while reading <context>", where the context is
// what the caller is reading ("the header", "metadata key 'x'", "tensor 'y'").
class Reader {
 public:
  Reader(const std::filesystem::path& path, const std::byte* data, std::uint64_t size)
      : path_(path), data_(data), size_(size) {}

  std::uint64_t position() const { return pos_; }
  std::uint64_t remaining() const { return size_ - pos_; }
  const std::string& context() const { return context_; }
  void set_context(std::string context) { context_ = std::move(context); }

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(path_.string() + ": " + what);
  }

  template <class T>
  T read() {
    need(sizeof(T));
    T value;
    std::memcpy(&value, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }

  std::string read_string() {
    const auto length = read<std::uint64_t>();
    if (length > remaining()) {
      truncated("a string of " + std::to_string(length) + " bytes at byte " + std::to_string(pos_));
    }
    std::string s(reinterpret_cast<const char*>(data_ + pos_), static_cast<std::size_t>(length));
    pos_ += length;
    return s;
  }

  // Rejects `count` items of at least `min_size` bytes each when they cannot all fit in what
  // is left of the file: checked before anything is reserved for them. `items` is plural.
  void check_count(std::uint64_t count, std::uint64_t min_size, std::string_view items) const {
    if (count > remaining() / min_size) {
      truncated(std::to_string(count) + " " + std::string(items) + " of at least " +
                std::to_string(min_size) + " bytes each at byte " + std::to_string(pos_));
    }
  }

  // Counts `count` more array items against kMaxArrayItems.
  void take_items(std::uint64_t count) {
    items_ += count;
    if (count > kMaxArrayItems || items_ > kMaxArrayItems)
      fail(context() + ": the metadata's arrays hold more than " + std::to_string(kMaxArrayItems) +
           " items (no model's vocabulary comes near): the file is corrupt or not a model");
  }

 private:
  void need(std::uint64_t n) const {
    if (n > remaining()) truncated(std::to_string(n) + " bytes needed at byte " + std::to_string(pos_));
  }

  // The file ends before what it says comes next: it was cut short, or a length or count in it
  // is corrupt; from inside the file the two look the same.
  [[noreturn]] void truncated(const std::string& detail) const {
    fail("truncated at byte " + std::to_string(size_) + " while reading " + context_ + " (" +
         detail + ")");
  }

  const std::filesystem::path& path_;
  const std::byte* data_;
  std::uint64_t size_;
  std::uint64_t pos_ = 0;
  std::string context_ = "the header";
  std::uint64_t items_ = 0;  // array items read so far, all arrays together
};

Value read_value(Reader& reader, ValueType type, int depth) {
  Value value;
  value.type = type;
  switch (type) {
    case ValueType::U8: value.data.emplace<std::uint64_t>(reader.read<std::uint8_t>()); break;
    case ValueType::U16: value.data.emplace<std::uint64_t>(reader.read<std::uint16_t>()); break;
    case ValueType::U32: value.data.emplace<std::uint64_t>(reader.read<std::uint32_t>()); break;
    case ValueType::U64: value.data.emplace<std::uint64_t>(reader.read<std::uint64_t>()); break;
    case ValueType::I8: value.data.emplace<std::int64_t>(reader.read<std::int8_t>()); break;
    case ValueType::I16: value.data.emplace<std::int64_t>(reader.read<std::int16_t>()); break;
    case ValueType::I32: value.data.emplace<std::int64_t>(reader.read<std::int32_t>()); break;
    case ValueType::I64: value.data.emplace<std::int64_t>(reader.read<std::int64_t>()); break;
    case ValueType::F32: value.data.emplace<double>(reader.read<float>()); break;
    case ValueType::F64: value.data.emplace<double>(reader.read<double>()); break;
    case ValueType::Bool: {
      const auto byte = reader.read<std::uint8_t>();
      if (byte > 1) {
        reader.fail(reader.context() + ": bool value " + std::to_string(byte) +
                    " is neither 0 nor 1");
      }
      value.data.emplace<bool>(byte == 1);
      break;
    }
    case ValueType::String: value.data.emplace<std::string>(reader.read_string()); break;
    case ValueType::Array: {
      if (depth >= kMaxArrayDepth) {
        reader.fail(reader.context() + ": arrays nested more than " +
                    std::to_string(kMaxArrayDepth) + " deep");
      }
      const auto element_id = reader.read<std::uint32_t>();
      const auto element_type = value_type_from_id(element_id);
      if (!element_type) {
        reader.fail(reader.context() + ": unknown array element type " +
                    std::to_string(element_id));
      }
      const auto count = reader.read<std::uint64_t>();
      reader.check_count(count, min_encoded_size(*element_type), "array items");
      reader.take_items(count);
      Array array;
      array.element_type = *element_type;
      array.items.reserve(static_cast<std::size_t>(count));
      for (std::uint64_t i = 0; i < count; ++i) {
        array.items.push_back(read_value(reader, *element_type, depth + 1));
      }
      value.data.emplace<Array>(std::move(array));
      break;
    }
  }
  return value;
}

// a * b, or nullopt when it does not fit in 64 bits.
std::optional<std::uint64_t> checked_mul(std::uint64_t a, std::uint64_t b) {
  std::uint64_t product;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

}  // namespace

// A name read from the file, quoted for a message: bytes outside printable ASCII (a corrupt
// file is full of them; GGUF keys and tensor names are ASCII) become \xNN, and a very long
// name is cut short.
std::string quote_name(std::string_view s) {
  constexpr std::size_t kMaxShown = 96;
  std::string out = "'";
  for (std::size_t i = 0; i < s.size() && i < kMaxShown; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c >= 0x7f) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xf];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > kMaxShown) out += "...";
  out += "'";
  return out;
}

const TensorType* tensor_type(std::uint32_t id) {
  for (const TensorType& t : kTensorTypes)
    if (t.id == id) return &t;
  return nullptr;
}

// ---- Value ---------------------------------------------------------------------------------

std::uint64_t Value::as_u64(std::string_view key) const {
  if (is_unsigned(type)) return std::get<std::uint64_t>(data);
  if (is_signed(type)) {
    const auto v = std::get<std::int64_t>(data);
    if (v < 0) {
      throw Error("metadata key " + quote_name(key) + " is " + std::to_string(v) + " (" +
                  std::string(to_string(type)) + "), expected a non-negative integer");
    }
    return static_cast<std::uint64_t>(v);
  }
  throw type_error(key, type, "an integer");
}

std::int64_t Value::as_i64(std::string_view key) const {
  if (is_signed(type)) return std::get<std::int64_t>(data);
  if (is_unsigned(type)) {
    const auto v = std::get<std::uint64_t>(data);
    if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      throw Error("metadata key " + quote_name(key) + " is " + std::to_string(v) + " (" +
                  std::string(to_string(type)) + "), which does not fit in i64");
    }
    return static_cast<std::int64_t>(v);
  }
  throw type_error(key, type, "an integer");
}

double Value::as_f64(std::string_view key) const {
  if (type == ValueType::F32 || type == ValueType::F64) return std::get<double>(data);
  if (is_unsigned(type)) return static_cast<double>(std::get<std::uint64_t>(data));
  if (is_signed(type)) return static_cast<double>(std::get<std::int64_t>(data));
  throw type_error(key, type, "a number");
}

bool Value::as_bool(std::string_view key) const {
  if (type != ValueType::Bool) throw type_error(key, type, "bool");
  return std::get<bool>(data);
}

const std::string& Value::as_string(std::string_view key) const {
  if (type != ValueType::String) throw type_error(key, type, "string");
  return std::get<std::string>(data);
}

const Array& Value::as_array(std::string_view key) const {
  if (type != ValueType::Array) throw type_error(key, type, "array");
  return std::get<Array>(data);
}

// ---- TensorInfo ----------------------------------------------------------------------------

std::int64_t TensorInfo::rows() const {
  std::int64_t rows = 1;
  for (std::size_t i = 1; i < shape.size(); ++i) rows *= shape[i];
  return rows;
}

// ---- Mapped files and SIGBUS ---------------------------------------------------------------
//
// A model is read in place from its mapping. When the file is cut short while it is mapped (a
// download written over it in place, `cp` or `curl -o` onto its name), the next read of a page
// past its new end raises SIGBUS, which kills the process with a bare "Bus error". The handler
// below says which file it was and how to replace a model safely, then lets the signal kill the
// process as before (the exit status stays the signal's). A fault anywhere else goes on to the
// handler that was there before, or to the default action.
namespace {

struct MappedRange {
  std::atomic<const std::byte*> begin{nullptr};  // null: the slot is free
  std::size_t size = 0;
  char message[1536] = {};
};

constexpr std::size_t kMappedSlots = 32;  // models open at once (a draft and a target: two)
MappedRange g_mapped[kMappedSlots];
std::mutex g_mapped_mutex;  // guards claiming and freeing slots; the handler only reads
struct sigaction g_previous_sigbus {};

void write_stderr(const char* text, std::size_t n) {
  while (n > 0) {
    const ssize_t written = ::write(STDERR_FILENO, text, n);
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) return;
    text += written;
    n -= static_cast<std::size_t>(written);
  }
}

void on_sigbus(int signo, siginfo_t* info, void* context) {
  // A read past the end of a mapped file is BUS_ADRERR at the address read; a signal sent with
  // kill() has no address, and a memory error (BUS_MCEERR_*) is not this.
  const bool past_end = info != nullptr && info->si_code == BUS_ADRERR;
  const auto* at = static_cast<const std::byte*>(past_end ? info->si_addr : nullptr);
  for (const MappedRange& range : g_mapped) {
    if (at == nullptr) break;
    const std::byte* begin = range.begin.load(std::memory_order_acquire);
    if (begin == nullptr || at < begin || at >= begin + range.size) continue;
    write_stderr(range.message, std::strlen(range.message));
    ::signal(SIGBUS, SIG_DFL);  // the read runs again on return, and the signal kills
    return;
  }
  if ((g_previous_sigbus.sa_flags & SA_SIGINFO) != 0 && g_previous_sigbus.sa_sigaction != nullptr) {
    g_previous_sigbus.sa_sigaction(signo, info, context);
  } else if (g_previous_sigbus.sa_handler != SIG_DFL && g_previous_sigbus.sa_handler != SIG_IGN &&
             g_previous_sigbus.sa_handler != nullptr) {
    g_previous_sigbus.sa_handler(signo);
  } else if (g_previous_sigbus.sa_handler != SIG_IGN) {
    // As if this handler had not been there: a fault runs again and kills; a signal sent by
    // another process (no fault to repeat) is raised again, to the default action.
    ::signal(SIGBUS, SIG_DFL);
    if (info == nullptr || info->si_code <= 0) ::raise(SIGBUS);
  }
}

void register_mapping(const void* map, std::size_t size, const std::filesystem::path& path) {
  static std::once_flag installed;
  std::call_once(installed, [] {
    struct sigaction action {};
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGBUS, &action, &g_previous_sigbus);
  });
  const std::lock_guard lock(g_mapped_mutex);
  for (MappedRange& range : g_mapped) {
    if (range.begin.load(std::memory_order_relaxed) != nullptr) continue;
    range.size = size;
    std::snprintf(range.message, sizeof range.message,
                  "\nbatchlm: error: the model file %s was cut short while in use (written over in place, "
                  "or truncated), and the weights past its new end are gone. Start again once the file is "
                  "whole; to replace a model that a process is using, write the new one under another name "
                  "and rename it over the old.\n",
                  terminal_safe(path.string()).c_str());
    range.begin.store(static_cast<const std::byte*>(map), std::memory_order_release);
    return;
  }
  // More models than slots: this one is read without the message.
}

void unregister_mapping(const void* map) {
  const std::lock_guard lock(g_mapped_mutex);
  for (MappedRange& range : g_mapped) {
    if (range.begin.load(std::memory_order_relaxed) == map) range.begin.store(nullptr, std::memory_order_release);
  }
}

void unmap(void* map, std::size_t size) {
  unregister_mapping(map);
  ::munmap(map, size);
}

}  // namespace

// ---- File ----------------------------------------------------------------------------------

File::File(File&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      version_(other.version_),
      alignment_(other.alignment_),
      metadata_(std::move(other.metadata_)),
      tensors_(std::move(other.tensors_)) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (map_ != nullptr) unmap(map_, size_);
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    size_ = std::exchange(other.size_, 0);
    version_ = other.version_;
    alignment_ = other.alignment_;
    metadata_ = std::move(other.metadata_);
    tensors_ = std::move(other.tensors_);
  }
  return *this;
}

File::~File() {
  if (map_ != nullptr) unmap(map_, size_);
}

Error::Error(const std::string& what) : std::runtime_error(terminal_safe(what)) {}

void File::fail(const std::string& what) const { throw Error(path_.string() + ": " + what); }

File File::open(const std::filesystem::path& path) {
  File file;
  file.path_ = path;

  // Non-blocking: a FIFO with no writer would hold open() forever; it opens at once instead and
  // is refused below as not a regular file.
  const FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) file.fail(std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) file.fail(std::string("cannot stat: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) file.fail("not a regular file");
  file.size_ = static_cast<std::uint64_t>(st.st_size);
  if (file.size_ == 0) file.fail("the file is empty (0 bytes), not a GGUF model");
  if (file.size_ > 0) {
    void* map = ::mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (map == MAP_FAILED) file.fail(std::string("cannot map: ") + std::strerror(errno));
    file.map_ = map;  // from here on ~File unmaps it, on success or failure
    register_mapping(map, file.size_, file.path_);
  }
  const auto* base = static_cast<const std::byte*>(file.map_);
  Reader reader(file.path_, base, file.size_);

  try {
    // Header.
    reader.set_context("the magic");
    const auto magic = reader.read<std::array<char, 4>>();
    if (std::string_view(magic.data(), 4) != "GGUF") {
      file.fail("bad magic " + quote_name(std::string_view(magic.data(), 4)) +
                ", expected 'GGUF' (not a GGUF file)");
    }
    reader.set_context("the header");
    file.version_ = reader.read<std::uint32_t>();
    if (file.version_ < kMinVersion || file.version_ > kMaxVersion) {
      std::string hint;
      if (const auto swapped = byte_swapped(file.version_);
          swapped >= kMinVersion && swapped <= kMaxVersion) {
        hint = " (a big-endian file?)";
      }
      file.fail("unsupported GGUF version " + std::to_string(file.version_) + hint +
                ", this reader supports versions 2 and 3");
    }
    const auto tensor_count = reader.read<std::uint64_t>();
    const auto kv_count = reader.read<std::uint64_t>();
    reader.check_count(kv_count, kMinKvBytes, "metadata keys");
    reader.check_count(tensor_count, kMinTensorInfoBytes, "tensors");
    if (kv_count > kMaxKeys)
      file.fail("the header counts " + std::to_string(kv_count) + " metadata keys, more than the " +
                std::to_string(kMaxKeys) + " allowed: the file is corrupt or not a model");
    if (tensor_count > kMaxTensors)
      file.fail("the header counts " + std::to_string(tensor_count) + " tensors, more than the " +
                std::to_string(kMaxTensors) + " allowed: the file is corrupt or not a model");

    // Metadata.
    std::unordered_set<std::string> keys;
    file.metadata_.reserve(static_cast<std::size_t>(kv_count));
    for (std::uint64_t i = 0; i < kv_count; ++i) {
      reader.set_context("metadata key #" + std::to_string(i));
      std::string key = reader.read_string();
      if (key.empty()) file.fail("metadata key #" + std::to_string(i) + " is an empty key");
      if (key.size() > kMaxKeyLength) {
        file.fail("metadata key #" + std::to_string(i) + " is " + std::to_string(key.size()) +
                  " bytes long, more than the " + std::to_string(kMaxKeyLength) + " allowed");
      }
      if (std::any_of(key.begin(), key.end(), [](char c) {
            return static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
          })) {
        file.fail("metadata key #" + std::to_string(i) + " " + quote_name(key) +
                  " contains control characters");
      }
      reader.set_context("metadata key " + quote_name(key));
      if (!keys.insert(key).second) file.fail("duplicate metadata key " + quote_name(key));
      const auto type_id = reader.read<std::uint32_t>();
      const auto type = value_type_from_id(type_id);
      if (!type) {
        file.fail("metadata key " + quote_name(key) + " has unknown value type " +
                  std::to_string(type_id));
      }
      Value value = read_value(reader, *type, 0);
      file.metadata_.emplace_back(std::move(key), std::move(value));
    }

    if (const Value* alignment = file.find("general.alignment")) {
      if (alignment->type != ValueType::U32) {
        file.fail("general.alignment has type " + std::string(to_string(alignment->type)) +
                  ", expected u32");
      }
      file.alignment_ = std::get<std::uint64_t>(alignment->data);
      if (!std::has_single_bit(file.alignment_)) {
        file.fail("general.alignment is " + std::to_string(file.alignment_) +
                  ", expected a non-zero power of two");
      }
    } else {
      file.alignment_ = kDefaultAlignment;
    }

    // Tensor table.
    std::unordered_set<std::string> names;
    file.tensors_.reserve(static_cast<std::size_t>(tensor_count));
    for (std::uint64_t i = 0; i < tensor_count; ++i) {
      TensorInfo info;
      reader.set_context("tensor info #" + std::to_string(i));
      info.name = reader.read_string();
      if (info.name.empty()) file.fail("tensor info #" + std::to_string(i) + " has an empty name");
      const std::string tensor = "tensor " + quote_name(info.name);
      reader.set_context(tensor);
      if (!names.insert(info.name).second) file.fail("duplicate tensor name " + quote_name(info.name));

      const auto n_dims = reader.read<std::uint32_t>();
      if (n_dims == 0 || n_dims > kMaxDims) {
        file.fail(tensor + " has n_dims " + std::to_string(n_dims) + ", expected 1 to " +
                  std::to_string(kMaxDims));
      }
      // Dimensions are u64 in the file; we keep them as i64, so anything above INT64_MAX reads
      // as the negative number a writer with signed dims (ggml) meant.
      std::uint64_t n_elements = 1;
      for (std::uint32_t d = 0; d < n_dims; ++d) {
        const auto dim = static_cast<std::int64_t>(reader.read<std::uint64_t>());
        if (dim <= 0) {
          file.fail(tensor + " dimension " + std::to_string(d) + " is " + std::to_string(dim) +
                    ", expected a positive size");
        }
        info.shape.push_back(dim);
        const auto product = checked_mul(n_elements, static_cast<std::uint64_t>(dim));
        if (!product || *product > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
          file.fail(tensor + " has shape " + shape_text(info.shape) +
                    "..., whose element count overflows 64 bits");
        }
        n_elements = *product;
      }
      info.n_elements = n_elements;

      info.type_id = reader.read<std::uint32_t>();
      const TensorType* file_type = tensor_type(info.type_id);
      if (file_type == nullptr) file.fail(tensor + " has unknown type id " + std::to_string(info.type_id));
      info.type = kernels::dtype_from_id(info.type_id);
      const std::int64_t block = file_type->block;
      if (info.shape[0] % block != 0) {
        file.fail(tensor + " has rows of " + std::to_string(info.shape[0]) +
                  " elements, not a multiple of the " + std::string(info.type_name()) +
                  " block size " + std::to_string(block));
      }
      // Whole blocks, so this cannot round; n_elements < 2^63 keeps the division exact but the
      // product with the block's bytes may still overflow.
      const auto n_bytes = checked_mul(n_elements / static_cast<std::uint64_t>(block), file_type->bytes);
      if (!n_bytes) file.fail(tensor + " has a byte size that overflows 64 bits");
      info.n_bytes = *n_bytes;

      info.offset = reader.read<std::uint64_t>();
      if (info.offset % file.alignment_ != 0) {
        file.fail(tensor + " offset " + std::to_string(info.offset) + " is not aligned to " +
                  std::to_string(file.alignment_) + " bytes");
      }
      file.tensors_.push_back(std::move(info));
    }

    // Data section: from the next multiple of the alignment after the table to the end of the
    // file. alignment <= 2^31 and position <= file size, so this cannot overflow.
    const std::uint64_t data_start =
        (reader.position() + file.alignment_ - 1) / file.alignment_ * file.alignment_;
    const std::uint64_t data_size = file.size_ > data_start ? file.size_ - data_start : 0;
    for (TensorInfo& info : file.tensors_) {
      if (info.offset > data_size || info.n_bytes > data_size - info.offset) {
        file.fail("tensor " + quote_name(info.name) + " data (" + std::to_string(info.n_bytes) +
                  " bytes at offset " + std::to_string(info.offset) + " of the data section at byte " +
                  std::to_string(data_start) + ") extends past the end of the file (" +
                  std::to_string(file.size_) + " bytes)");
      }
      info.data = base + data_start + info.offset;
    }

    // No two tensors may share bytes: sorted by offset (ties in file order), each must end before the next begins.
    std::vector<const TensorInfo*> by_offset;
    by_offset.reserve(file.tensors_.size());
    for (const TensorInfo& info : file.tensors_) by_offset.push_back(&info);
    std::stable_sort(by_offset.begin(), by_offset.end(),
              [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
    // Nor leave bytes between them: the data is packed, each tensor padded to the alignment (as
    // llama.cpp's reader requires). A gap means a tensor's type or shape says fewer bytes than
    // its data has: read as it says, the weights would be garbage.
    for (std::size_t i = 1; i < by_offset.size(); ++i) {
      const TensorInfo& previous = *by_offset[i - 1];
      const TensorInfo& next = *by_offset[i];
      const std::uint64_t end = previous.offset + previous.n_bytes;
      if (end > next.offset) {
        file.fail("tensor " + quote_name(previous.name) + " (bytes " + std::to_string(previous.offset) + " to " +
                  std::to_string(end) + " of the data section) overlaps tensor " + quote_name(next.name) +
                  " (from byte " + std::to_string(next.offset) + ")");
      }
      const std::uint64_t padded = (end + file.alignment_ - 1) / file.alignment_ * file.alignment_;
      if (next.offset > padded) {
        file.fail("tensor " + quote_name(previous.name) + " (" + std::string(previous.type_name()) + ", " +
                  std::to_string(previous.n_bytes) + " bytes at offset " + std::to_string(previous.offset) +
                  " of the data section) is followed by " + std::to_string(next.offset - end) +
                  " bytes no tensor holds before tensor " + quote_name(next.name) +
                  ": a type or shape in the table does not match the data");
      }
    }
    if (!by_offset.empty() && by_offset.front()->offset != 0)
      file.fail("the data section begins with " + std::to_string(by_offset.front()->offset) +
                " bytes no tensor holds (the first, " + quote_name(by_offset.front()->name) + ")");
  } catch (const std::bad_alloc&) {
    // The count checks bound every allocation by the file's size, but a large corrupt file
    // can still ask for more memory than there is.
    file.fail("out of memory while reading " + reader.context());
  } catch (const std::length_error&) {
    file.fail("out of memory while reading " + reader.context());
  }
  return file;
}

const Value* File::find(std::string_view key) const {
  for (const auto& [name, value] : metadata_) {
    if (name == key) return &value;
  }
  return nullptr;
}

const Value& File::require(std::string_view key) const {
  const Value* value = find(key);
  if (value == nullptr) fail("missing metadata key " + quote_name(key));
  return *value;
}

namespace {

// Runs a Value accessor and puts the file's path in front of its error.
template <class F>
auto with_path(const std::filesystem::path& path, F&& access) -> decltype(access()) {
  try {
    return access();
  } catch (const Error& e) {
    throw Error(path.string() + ": " + e.what());
  }
}

}  // namespace

std::uint64_t File::get_u64(std::string_view key) const {
  const Value& value = require(key);
  return with_path(path_, [&] { return value.as_u64(key); });
}

std::string File::get_string(std::string_view key) const {
  const Value& value = require(key);
  return with_path(path_, [&] { return value.as_string(key); });
}

double File::get_f64(std::string_view key) const {
  const Value& value = require(key);
  return with_path(path_, [&] { return value.as_f64(key); });
}

std::optional<std::uint64_t> File::find_u64(std::string_view key) const {
  const Value* value = find(key);
  if (value == nullptr) return std::nullopt;
  return with_path(path_, [&] { return value->as_u64(key); });
}

std::optional<double> File::find_f64(std::string_view key) const {
  const Value* value = find(key);
  if (value == nullptr) return std::nullopt;
  return with_path(path_, [&] { return value->as_f64(key); });
}

std::optional<std::string> File::find_string(std::string_view key) const {
  const Value* value = find(key);
  if (value == nullptr) return std::nullopt;
  return with_path(path_, [&] { return value->as_string(key); });
}

std::optional<bool> File::find_bool(std::string_view key) const {
  const Value* value = find(key);
  if (value == nullptr) return std::nullopt;
  return with_path(path_, [&] { return value->as_bool(key); });
}

const TensorInfo* File::find_tensor(std::string_view name) const {
  for (const TensorInfo& info : tensors_) {
    if (info.name == name) return &info;
  }
  return nullptr;
}

const TensorInfo& File::tensor(std::string_view name,
                               std::optional<std::vector<std::int64_t>> shape) const {
  const TensorInfo* info = find_tensor(name);
  if (info == nullptr) fail("missing tensor " + quote_name(name));
  if (!info->type) {
    fail("tensor " + quote_name(name) + " is " + std::string(info->type_name()) +
         ", which the engine does not run: it runs F32, F16, BF16, Q8_0, Q6_K, Q5_K, Q5_1, Q5_0, "
         "Q4_K, Q4_1 and Q4_0 weights (a Q4_K_M, Q5_K_M, Q6_K, Q8_0 or Q4_0 GGUF of this model will "
         "load)");
  }
  if (shape && info->shape != *shape) {
    fail("tensor " + quote_name(name) + " has shape " + shape_text(info->shape) + ", expected " +
         shape_text(*shape));
  }
  return *info;
}

}  // namespace batchlm::local_engine::gguf
