// GGUF files: gguf::File::open on arbitrary bytes, then what `batchlm inspect` and the model
// loader read from a file that opened: every metadata value through every accessor, the
// tensor table, the tokenizer (Vocab::from_gguf, Tokenizer, ChatTemplate) and Model::load.
//
// Promised: a file is opened or refused with gguf::Error (the loader's tokenizer and template
// problems included), never a crash, hang or allocation beyond what the file's size allows.
// Checked on a file that opened: every tensor's bytes lie inside the file and no two overlap;
// element and byte counts agree with shape and type; lookups by key and name find what the
// walk saw.

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include "batchlm/kernels/dtype.hpp"
#include "batchlm/local_engine/gguf.hpp"
#include "batchlm/local_engine/model.hpp"
#include "batchlm/local_engine/tokenizer.hpp"
#include "fuzz_support.hpp"

namespace gguf = batchlm::local_engine::gguf;
namespace kernels = batchlm::kernels;
using batchlm::local_engine::ChatTemplate;
using batchlm::local_engine::Model;
using batchlm::local_engine::Tokenizer;
using batchlm::local_engine::Vocab;

namespace {

std::filesystem::path scratch_file;

// Every accessor of one value; the ones that do not fit its type must throw gguf::Error.
void walk_value(const gguf::Value& value, const std::string& key, int depth) {
  FUZZ_CHECK(depth <= 8, "arrays nested deeper than the reader allows: " + key);
  const auto expect_error_or = [&](auto access) {
    try {
      access();
    } catch (const gguf::Error&) {
    }
  };
  expect_error_or([&] { (void)value.as_u64(key); });
  expect_error_or([&] { (void)value.as_i64(key); });
  expect_error_or([&] { (void)value.as_f64(key); });
  expect_error_or([&] { (void)value.as_bool(key); });
  expect_error_or([&] { (void)value.as_string(key); });
  if (value.type == gguf::ValueType::Array) {
    const gguf::Array& array = value.as_array(key);
    for (const gguf::Value& item : array.items) {
      FUZZ_CHECK(item.type == array.element_type, "array item of another type in " + key);
      walk_value(item, key, depth + 1);
    }
  }
}

void walk(const gguf::File& file) {
  for (const auto& [key, value] : file.metadata()) {
    FUZZ_CHECK(!key.empty(), "an empty metadata key");
    FUZZ_CHECK(file.find(key) == &value, "find() does not return the first value of " + key);
    walk_value(value, key, 0);
  }
  const std::uint64_t alignment = file.alignment();
  FUZZ_CHECK(alignment != 0 && (alignment & (alignment - 1)) == 0, "alignment not a power of two");

  const std::byte* first_data = nullptr;
  std::uint64_t first_offset = 0;
  for (const gguf::TensorInfo& t : file.tensors()) {
    FUZZ_CHECK(file.find_tensor(t.name) == &t, "find_tensor() misses " + t.name);
    FUZZ_CHECK(!t.shape.empty() && t.shape.size() <= 4, "bad dimension count for " + t.name);
    std::uint64_t n = 1;
    for (const std::int64_t d : t.shape) {
      FUZZ_CHECK(d > 0, "non-positive dimension in " + t.name);
      n *= static_cast<std::uint64_t>(d);
    }
    FUZZ_CHECK(n == t.n_elements, "element count does not match the shape of " + t.name);
    const gguf::TensorType* type = gguf::tensor_type(t.type_id);
    FUZZ_CHECK(type != nullptr, "unknown type of " + t.name);
    const auto block = static_cast<std::uint64_t>(type->block);
    FUZZ_CHECK(t.cols() % type->block == 0, "rows not whole blocks in " + t.name);
    FUZZ_CHECK(t.n_bytes == n / block * type->bytes, "byte size does not match " + t.name);
    if (t.type) {  // a type the engine runs: the kernels' sizes are the table's
      FUZZ_CHECK(kernels::block_size(*t.type) == type->block && kernels::block_bytes(*t.type) == type->bytes,
                 "the kernels' block of " + t.name + " is not the table's");
    }
    FUZZ_CHECK(t.offset % alignment == 0, "unaligned offset of " + t.name);
    FUZZ_CHECK(t.offset <= file.file_size() && t.n_bytes <= file.file_size() - t.offset,
               "data past the end of the file: " + t.name);
    // Where the data pointers sit relative to each other must be what the offsets say.
    if (first_data == nullptr) {
      first_data = t.data;
      first_offset = t.offset;
    } else {
      FUZZ_CHECK(t.data - first_data == static_cast<std::ptrdiff_t>(t.offset - first_offset),
                 "data pointer disagrees with the offset of " + t.name);
    }
    if (t.n_bytes > 0) {  // the first and last bytes are readable
      volatile std::byte sink = t.data[0];
      sink = t.data[t.n_bytes - 1];
      (void)sink;
    }
  }
  for (std::size_t i = 0; i < file.tensors().size(); ++i) {
    for (std::size_t j = i + 1; j < file.tensors().size() && j < i + 64; ++j) {
      const gguf::TensorInfo& a = file.tensors()[i];
      const gguf::TensorInfo& b = file.tensors()[j];
      const bool apart = a.offset + a.n_bytes <= b.offset || b.offset + b.n_bytes <= a.offset;
      FUZZ_CHECK(apart || a.n_bytes == 0 || b.n_bytes == 0, "tensors overlap: " + a.name + ", " + b.name);
    }
  }

  // The tokenizer, as the loader and `inspect` read it.
  try {
    const Vocab vocab = Vocab::from_gguf(file);
    try {
      const Tokenizer tokenizer(vocab);
      const auto tokens = tokenizer.encode("Hello <|im_start|>world 123", true);
      for (const auto t : tokens) FUZZ_CHECK(t >= 0 && static_cast<std::size_t>(t) < tokenizer.size(), "token id out of range");
      (void)tokenizer.decode(tokens, true);
    } catch (const std::invalid_argument&) {
    }
    try {
      const ChatTemplate chat = ChatTemplate::from_vocab(vocab);
      (void)chat.apply({}, true);
    } catch (const std::invalid_argument&) {
    }
  } catch (const gguf::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  scratch_file = std::filesystem::temp_directory_path() /
                 ("batchlm_fuzz_gguf_" + std::to_string(::getpid()) + ".gguf");
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove(scratch_file, ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  {
    std::ofstream out(scratch_file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
    if (!out) {
      std::perror("gguf fuzz: cannot write the scratch file");
      std::abort();
    }
  }
  try {
    const gguf::File file = gguf::File::open(scratch_file);
    walk(file);
  } catch (const gguf::Error& e) {
    // A refusal must name the file.
    FUZZ_CHECK(std::string(e.what()).starts_with(scratch_file.string() + ": "),
               std::string("error without the path: ") + e.what());
    return 0;
  }
  // The loader on the same file: the model's configuration against its tensors.
  try {
    (void)Model::load(scratch_file);
  } catch (const gguf::Error& e) {
    FUZZ_CHECK(std::string(e.what()).starts_with(scratch_file.string() + ": "),
               std::string("error without the path: ") + e.what());
  }
  return 0;
}
