#pragma once
// A memory-mapped GGUF file: header, metadata, tensor table. Everything read from the file is
// checked against its size before use; a file that is truncated or corrupt, or that uses a type
// this build does not know, is rejected with a gguf::Error that names the file and the problem.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "batchlm/kernels/dtype.hpp"

namespace batchlm::local_engine::gguf {

// Every message starts with the file's path: "models/x.gguf: tensor 'blk.0.attn_q.weight': ...".
// Its message may quote the file's own strings: they are made terminal-safe (a NUL would cut
// the message short, an escape sequence would reach the terminal).
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what);
};

enum class ValueType : std::uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, Bool = 7,
  String = 8, Array = 9, U64 = 10, I64 = 11, F64 = 12,
};
std::string_view to_string(ValueType t);

// A name or value read from a file, quoted for a message: bytes outside printable ASCII become
// \xNN, and past 96 bytes it is cut short.
std::string quote_name(std::string_view s);

// A size for people: bytes below a KiB, else KiB, MiB or GiB to a tenth ("2.8 GiB").
std::string human_bytes(double bytes);

struct Value;
struct Array {
  ValueType element_type = ValueType::U8;
  std::vector<Value> items;
};

// One metadata value. Integers keep their signedness; the accessors convert where the value
// fits and throw gguf::Error (naming `key`) where it does not or the type is wrong.
struct Value {
  ValueType type = ValueType::U8;
  std::variant<std::uint64_t, std::int64_t, double, bool, std::string, Array> data;

  std::uint64_t as_u64(std::string_view key) const;  // any integer type, >= 0
  std::int64_t as_i64(std::string_view key) const;   // any integer type that fits
  double as_f64(std::string_view key) const;         // F32, F64 or any integer type
  bool as_bool(std::string_view key) const;
  const std::string& as_string(std::string_view key) const;
  const Array& as_array(std::string_view key) const;
};

// A tensor type of GGUF files (ggml's numbering): its name, elements per block and bytes per
// block. The engine runs those kernels::dtype_from_id knows; the others are read so that a file
// holding them can be listed (`inspect`) and refused by name.
struct TensorType {
  std::uint32_t id;
  std::string_view name;
  std::int64_t block;
  std::uint64_t bytes;
};
// nullptr for an id no GGUF type has.
const TensorType* tensor_type(std::uint32_t id);

struct TensorInfo {
  std::string name;
  // The element type: GGUF's id and name ("Q4_K"), and the kernels' type where the engine runs
  // it (F32, F16, BF16, Q4_0, Q4_1, Q8_0). The file's other types (K-quants, i-quants, ...) are
  // read for their sizes and listed, with `type` unset; File::tensor() refuses them.
  std::uint32_t type_id = 0;
  std::optional<kernels::DType> type = kernels::DType::F32;
  std::string_view type_name() const { return tensor_type(type_id)->name; }  // a type open() knows
  std::vector<std::int64_t> shape;   // GGUF order: shape[0] is the innermost (row length)
  std::uint64_t offset = 0;          // from the start of the data section
  std::uint64_t n_elements = 0;
  std::uint64_t n_bytes = 0;
  const std::byte* data = nullptr;   // into the mapping, aligned, n_bytes long

  std::int64_t rows() const;         // product of shape[1..], 1 for a vector
  std::int64_t cols() const { return shape.empty() ? 1 : shape[0]; }
};

class File {
 public:
  // Maps and validates the whole header and tensor table. Throws gguf::Error.
  static File open(const std::filesystem::path& path);

  File(File&&) noexcept;
  File& operator=(File&&) noexcept;
  ~File();

  const std::filesystem::path& path() const { return path_; }
  std::uint32_t version() const { return version_; }
  std::uint64_t file_size() const { return size_; }
  std::uint64_t alignment() const { return alignment_; }

  // Metadata in file order.
  const std::vector<std::pair<std::string, Value>>& metadata() const { return metadata_; }
  const Value* find(std::string_view key) const;
  // Typed lookups; the required forms throw gguf::Error "missing metadata key 'k'" or a type
  // error naming the key. Errors from these (unlike Value's accessors, which do not know the
  // file) start with the path.
  const Value& require(std::string_view key) const;
  std::uint64_t get_u64(std::string_view key) const;
  std::string get_string(std::string_view key) const;
  double get_f64(std::string_view key) const;
  std::optional<std::uint64_t> find_u64(std::string_view key) const;
  std::optional<double> find_f64(std::string_view key) const;
  std::optional<std::string> find_string(std::string_view key) const;
  std::optional<bool> find_bool(std::string_view key) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;
  // Throws "missing tensor 'name'", "tensor 'name' is Q4_K, ..." for a type the engine does
  // not run, or, when `shape` is given, "tensor 'name' has shape [a, b], expected [c, d]".
  // The tensor it returns has `type` set.
  const TensorInfo& tensor(std::string_view name,
                           std::optional<std::vector<std::int64_t>> shape = std::nullopt) const;

  // Throws gguf::Error with the path prefixed: for callers (the model loader) that find a
  // problem the file's structure did not show, such as a shape that contradicts the metadata.
  [[noreturn]] void fail(const std::string& what) const;

 private:
  File() = default;
  std::filesystem::path path_;
  void* map_ = nullptr;
  std::uint64_t size_ = 0;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = 32;
  std::vector<std::pair<std::string, Value>> metadata_;
  std::vector<TensorInfo> tensors_;
};

}  // namespace batchlm::local_engine::gguf
