#include "gguf_writer.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numbers>
#include <random>
#include <stdexcept>
#include <utility>

namespace batchlm::testing {

static_assert(std::endian::native == std::endian::little, "GGUF is little-endian");

namespace {

// Appends `value`'s bytes (little-endian, as the host is). resize + memcpy rather than
// insert, which GCC 12 flags with a false -Wstringop-overflow on a fresh vector.
template <class T>
void put(std::vector<std::byte>& out, T value) {
  const std::size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}

void put_string(std::vector<std::byte>& out, std::string_view s) {
  put<std::uint64_t>(out, s.size());
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  out.insert(out.end(), p, p + s.size());
}

template <class T>
GgufValue scalar(GgufType type, T value) {
  GgufValue v;
  v.type = static_cast<std::uint32_t>(type);
  put(v.bytes, value);
  return v;
}

std::uint64_t align_up(std::uint64_t n, std::uint64_t alignment) {
  return (n + alignment - 1) / alignment * alignment;
}

std::int64_t element_count(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

// ---- Quantization: one block of 32 floats at a time, as ggml's reference code does it. -------

kernels::BlockQ8_0 quantize_q8_0(const float* x) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  // d = amax / 127, q = round(x / d); ggml multiplies by the reciprocal, and so do we, so that
  // the blocks match llama.cpp's to the bit.
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  kernels::BlockQ8_0 block{};
  block.d = kernels::fp32_to_fp16(d);
  for (int j = 0; j < 32; ++j) block.qs[j] = static_cast<std::int8_t>(std::round(x[j] * id));
  return block;
}

kernels::BlockQ8_1 quantize_q8_1(const float* x) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  kernels::BlockQ8_1 block{};
  int sum = 0;
  for (int j = 0; j < 32; ++j) {
    block.qs[j] = static_cast<std::int8_t>(std::round(x[j] * id));
    sum += block.qs[j];
  }
  block.d = kernels::fp32_to_fp16(d);
  block.s = kernels::fp32_to_fp16(static_cast<float>(sum) * d);
  return block;
}

kernels::BlockQ4_0 quantize_q4_0(const float* x) {
  // The signed value of largest magnitude maps to q = 0, i.e. -8 after the offset: d = max / -8.
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < 32; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  const float d = max / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  kernels::BlockQ4_0 block{};
  block.d = kernels::fp32_to_fp16(d);
  for (int j = 0; j < 16; ++j) {
    // x * id lies in [-8, 8], so the sum is in [0.5, 16.5] and the truncation is well defined.
    const int lo = std::min(15, static_cast<int>(x[j] * id + 8.5f));
    const int hi = std::min(15, static_cast<int>(x[j + 16] * id + 8.5f));
    block.qs[j] = static_cast<std::uint8_t>(lo | (hi << 4));
  }
  return block;
}

kernels::BlockQ4_1 quantize_q4_1(const float* x) {
  float min = x[0], max = x[0];
  for (int j = 1; j < 32; ++j) {
    min = std::min(min, x[j]);
    max = std::max(max, x[j]);
  }
  const float d = (max - min) / 15.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  kernels::BlockQ4_1 block{};
  block.d = kernels::fp32_to_fp16(d);
  block.m = kernels::fp32_to_fp16(min);
  for (int j = 0; j < 16; ++j) {
    const int lo = std::min(15, static_cast<int>((x[j] - min) * id + 0.5f));
    const int hi = std::min(15, static_cast<int>((x[j + 16] - min) * id + 0.5f));
    block.qs[j] = static_cast<std::uint8_t>(lo | (hi << 4));
  }
  return block;
}

template <class Block, class F>
void quantize_blocks(std::vector<std::byte>& out, std::span<const float> values, F quantize_block) {
  for (std::size_t i = 0; i < values.size(); i += 32) put<Block>(out, quantize_block(&values[i]));
}

template <class Block>
Block block_at(std::span<const std::byte> data, std::int64_t index) {
  Block block;
  std::memcpy(&block, data.data() + static_cast<std::size_t>(index) * sizeof(Block), sizeof block);
  return block;
}

}  // namespace

// ---- GgufValue -----------------------------------------------------------------------------

GgufValue GgufValue::u8(std::uint8_t v) { return scalar(GgufType::U8, v); }
GgufValue GgufValue::i8(std::int8_t v) { return scalar(GgufType::I8, v); }
GgufValue GgufValue::u16(std::uint16_t v) { return scalar(GgufType::U16, v); }
GgufValue GgufValue::i16(std::int16_t v) { return scalar(GgufType::I16, v); }
GgufValue GgufValue::u32(std::uint32_t v) { return scalar(GgufType::U32, v); }
GgufValue GgufValue::i32(std::int32_t v) { return scalar(GgufType::I32, v); }
GgufValue GgufValue::f32(float v) { return scalar(GgufType::F32, v); }
GgufValue GgufValue::boolean(bool v) { return scalar(GgufType::Bool, static_cast<std::uint8_t>(v)); }
GgufValue GgufValue::u64(std::uint64_t v) { return scalar(GgufType::U64, v); }
GgufValue GgufValue::i64(std::int64_t v) { return scalar(GgufType::I64, v); }
GgufValue GgufValue::f64(double v) { return scalar(GgufType::F64, v); }

GgufValue GgufValue::str(std::string_view v) {
  GgufValue value;
  value.type = static_cast<std::uint32_t>(GgufType::String);
  put_string(value.bytes, v);
  return value;
}

GgufValue GgufValue::array(GgufType element_type, const std::vector<GgufValue>& items) {
  GgufValue value;
  value.type = static_cast<std::uint32_t>(GgufType::Array);
  put<std::uint32_t>(value.bytes, static_cast<std::uint32_t>(element_type));
  put<std::uint64_t>(value.bytes, items.size());
  for (const GgufValue& item : items) {
    if (item.type != static_cast<std::uint32_t>(element_type)) {
      throw std::invalid_argument("GgufValue::array: an item's type differs from the element type");
    }
    value.bytes.insert(value.bytes.end(), item.bytes.begin(), item.bytes.end());
  }
  return value;
}

GgufValue GgufValue::str_array(const std::vector<std::string>& items) {
  std::vector<GgufValue> values;
  values.reserve(items.size());
  for (const std::string& s : items) values.push_back(str(s));
  return array(GgufType::String, values);
}

GgufValue GgufValue::i32_array(std::span<const std::int32_t> items) {
  std::vector<GgufValue> values;
  for (std::int32_t v : items) values.push_back(i32(v));
  return array(GgufType::I32, values);
}

GgufValue GgufValue::u32_array(std::span<const std::uint32_t> items) {
  std::vector<GgufValue> values;
  for (std::uint32_t v : items) values.push_back(u32(v));
  return array(GgufType::U32, values);
}

GgufValue GgufValue::f32_array(std::span<const float> items) {
  std::vector<GgufValue> values;
  for (float v : items) values.push_back(f32(v));
  return array(GgufType::F32, values);
}

GgufValue GgufValue::raw(std::uint32_t type, std::vector<std::byte> bytes) {
  GgufValue value;
  value.type = type;
  value.bytes = std::move(bytes);
  return value;
}

// ---- Quantization --------------------------------------------------------------------------

std::vector<std::byte> quantize(DType type, std::span<const float> values) {
  if (values.size() % static_cast<std::size_t>(kernels::block_size(type)) != 0) {
    throw std::invalid_argument("quantize: " + std::to_string(values.size()) +
                                " values are not whole blocks of " +
                                std::string(kernels::to_string(type)));
  }
  std::vector<std::byte> out;
  out.reserve(kernels::row_bytes(type, static_cast<std::int64_t>(values.size())));
  switch (type) {
    case DType::F32:
      for (float v : values) put(out, v);
      break;
    case DType::F16:
      for (float v : values) put(out, kernels::fp32_to_fp16(v));
      break;
    case DType::BF16:
      for (float v : values) put(out, kernels::fp32_to_bf16(v));
      break;
    case DType::Q8_0: quantize_blocks<kernels::BlockQ8_0>(out, values, quantize_q8_0); break;
    case DType::Q8_1: quantize_blocks<kernels::BlockQ8_1>(out, values, quantize_q8_1); break;
    case DType::Q4_0: quantize_blocks<kernels::BlockQ4_0>(out, values, quantize_q4_0); break;
    case DType::Q4_1: quantize_blocks<kernels::BlockQ4_1>(out, values, quantize_q4_1); break;
    default:
      throw std::invalid_argument("quantize: no quantizer for " + std::string(kernels::to_string(type)));
  }
  return out;
}

std::vector<float> dequantize(DType type, std::span<const std::byte> data, std::int64_t n) {
  if (n % kernels::block_size(type) != 0 || data.size() < kernels::row_bytes(type, n)) {
    throw std::invalid_argument("dequantize: too few bytes or not whole blocks");
  }
  std::vector<float> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const auto index = static_cast<std::size_t>(i);
    switch (type) {
      case DType::F32: std::memcpy(&out[index], data.data() + 4 * index, 4); break;
      case DType::F16:
      case DType::BF16: {
        std::uint16_t h;
        std::memcpy(&h, data.data() + 2 * index, 2);
        out[index] = type == DType::F16 ? kernels::fp16_to_fp32(h) : kernels::bf16_to_fp32(h);
        break;
      }
      case DType::Q8_0: {
        const auto block = block_at<kernels::BlockQ8_0>(data, i / 32);
        out[index] = kernels::fp16_to_fp32(block.d) * static_cast<float>(block.qs[i % 32]);
        break;
      }
      case DType::Q8_1: {
        const auto block = block_at<kernels::BlockQ8_1>(data, i / 32);
        out[index] = kernels::fp16_to_fp32(block.d) * static_cast<float>(block.qs[i % 32]);
        break;
      }
      case DType::Q4_0:
      case DType::Q4_1: {
        // Byte j holds element j in its low nibble and element j + 16 in its high nibble.
        const std::int64_t j = i % 32;
        const auto nibble = [&](const std::uint8_t* qs) {
          return j < 16 ? qs[j] & 0x0f : qs[j - 16] >> 4;
        };
        if (type == DType::Q4_0) {
          const auto block = block_at<kernels::BlockQ4_0>(data, i / 32);
          out[index] = kernels::fp16_to_fp32(block.d) * static_cast<float>(nibble(block.qs) - 8);
        } else {
          const auto block = block_at<kernels::BlockQ4_1>(data, i / 32);
          out[index] = kernels::fp16_to_fp32(block.d) * static_cast<float>(nibble(block.qs)) +
                       kernels::fp16_to_fp32(block.m);
        }
        break;
      }
      default:
        throw std::invalid_argument("dequantize: no dequantizer for " + std::string(kernels::to_string(type)));
    }
  }
  return out;
}

void write_file(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

// ---- GgufWriter ----------------------------------------------------------------------------

GgufWriter& GgufWriter::add(std::string key, GgufValue value) {
  metadata_.emplace_back(std::move(key), std::move(value));
  return *this;
}

GgufWriter& GgufWriter::set_alignment(std::uint32_t alignment) {
  alignment_ = std::has_single_bit(alignment) ? alignment : 32;
  return add("general.alignment", GgufValue::u32(alignment));
}

GgufWriter& GgufWriter::add_tensor(std::string name, DType type, std::vector<std::int64_t> shape,
                                   std::vector<std::byte> data) {
  if (shape.empty() || shape[0] % kernels::block_size(type) != 0) {
    throw std::invalid_argument("add_tensor " + name + ": rows are not whole blocks");
  }
  const std::int64_t rows = element_count(shape) / shape[0];
  if (data.size() != kernels::row_bytes(type, shape[0]) * static_cast<std::size_t>(rows)) {
    throw std::invalid_argument("add_tensor " + name + ": " + std::to_string(data.size()) +
                                " bytes do not match the shape");
  }
  tensors_.push_back(Tensor{std::move(name), type, std::move(shape), std::move(data), {}});
  return *this;
}

GgufWriter& GgufWriter::add_tensor(std::string name, DType type, std::vector<std::int64_t> shape,
                                   std::span<const float> values) {
  if (static_cast<std::int64_t>(values.size()) != element_count(shape)) {
    throw std::invalid_argument("add_tensor " + name + ": " + std::to_string(values.size()) +
                                " values do not match the shape");
  }
  auto data = quantize(type, values);
  return add_tensor(std::move(name), type, std::move(shape), std::move(data));
}

GgufWriter& GgufWriter::override_tensor(std::string_view name, TensorOverride override_with) {
  for (Tensor& tensor : tensors_) {
    if (tensor.name == name) {
      tensor.override_with = std::move(override_with);
      return *this;
    }
  }
  throw std::invalid_argument("override_tensor: no tensor " + std::string(name));
}

GgufWriter& GgufWriter::set_magic(std::string magic) {
  magic_ = std::move(magic);
  return *this;
}

GgufWriter& GgufWriter::set_version(std::uint32_t version) {
  version_ = version;
  return *this;
}

GgufWriter& GgufWriter::set_tensor_count(std::uint64_t count) {
  tensor_count_ = count;
  return *this;
}

GgufWriter& GgufWriter::set_kv_count(std::uint64_t count) {
  kv_count_ = count;
  return *this;
}

GgufWriter& GgufWriter::append_bytes(std::vector<std::byte> bytes) {
  trailer_.insert(trailer_.end(), bytes.begin(), bytes.end());
  return *this;
}

GgufWriter::Encoded GgufWriter::encode() const {
  Encoded encoded;
  std::vector<std::byte>& out = encoded.bytes;

  // Header.
  const auto* magic = reinterpret_cast<const std::byte*>(magic_.data());
  out.insert(out.end(), magic, magic + magic_.size());
  put<std::uint32_t>(out, version_);
  put<std::uint64_t>(out, tensor_count_.value_or(tensors_.size()));
  put<std::uint64_t>(out, kv_count_.value_or(metadata_.size()));

  for (const auto& [key, value] : metadata_) {
    put_string(out, key);
    put<std::uint32_t>(out, value.type);
    out.insert(out.end(), value.bytes.begin(), value.bytes.end());
  }

  // Tensor table: each tensor's data at the next aligned offset after the previous one's.
  std::uint64_t cursor = 0;
  for (const Tensor& tensor : tensors_) {
    const std::uint64_t offset = align_up(cursor, alignment_);
    encoded.tensor_offsets.push_back(offset);
    cursor = offset + tensor.data.size();

    const TensorOverride& o = tensor.override_with;
    std::vector<std::uint64_t> dims(tensor.shape.begin(), tensor.shape.end());
    if (o.dims) dims = *o.dims;
    put_string(out, tensor.name);
    put<std::uint32_t>(out, o.n_dims.value_or(static_cast<std::uint32_t>(dims.size())));
    for (std::uint64_t d : dims) put<std::uint64_t>(out, d);
    put<std::uint32_t>(out, o.type_id.value_or(static_cast<std::uint32_t>(tensor.type)));
    put<std::uint64_t>(out, o.offset.value_or(offset));
  }

  // Data section. No padding after the last tensor, so any shorter prefix of the file cuts
  // into some tensor's data.
  encoded.data_start = align_up(out.size(), alignment_);
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    out.resize(encoded.data_start + encoded.tensor_offsets[i]);
    out.insert(out.end(), tensors_[i].data.begin(), tensors_[i].data.end());
  }
  if (tensors_.empty()) out.resize(encoded.data_start);
  out.insert(out.end(), trailer_.begin(), trailer_.end());
  return encoded;
}

void GgufWriter::write(const std::filesystem::path& path) const { write_file(path, encode().bytes); }

void GgufWriter::write_truncated(const std::filesystem::path& path, std::size_t size) const {
  const Encoded encoded = encode();
  write_file(path, std::span(encoded.bytes).first(std::min(size, encoded.bytes.size())));
}

// ---- Tiny Llama ----------------------------------------------------------------------------

namespace {

std::string utf8(std::uint32_t code_point) {
  std::string out;
  if (code_point < 0x80) {
    out += static_cast<char>(code_point);
  } else if (code_point < 0x800) {
    out += static_cast<char>(0xc0 | (code_point >> 6));
    out += static_cast<char>(0x80 | (code_point & 0x3f));
  } else {
    out += static_cast<char>(0xe0 | (code_point >> 12));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (code_point & 0x3f));
  }
  return out;
}

// GPT-2's byte-level alphabet: a byte that is a printable Latin-1 character stands for itself;
// the other 68 (controls, space, DEL, NBSP, soft hyphen) take the code points 256, 257, ... in
// byte order, so that every token is printable text ("Ġ" is the space, "Ċ" the newline).
std::vector<std::string> byte_level_alphabet() {
  std::vector<std::string> alphabet(256);
  std::uint32_t next = 256;
  for (std::uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    alphabet[b] = utf8(printable ? b : next++);
  }
  return alphabet;
}

// Deterministic in the seed on every platform (std::normal_distribution is not).
class NormalRandom {
 public:
  explicit NormalRandom(std::uint64_t seed) : engine_(seed) {}

  float next() {
    // Box-Muller; u1 in (0, 1] keeps the log finite.
    const double u1 = (static_cast<double>(engine_() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(engine_() >> 11) * 0x1.0p-53;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2));
  }

 private:
  std::mt19937_64 engine_;
};

// llama.cpp's general.file_type (LLAMA_FTYPE_*) for a model whose matrices are `type`.
std::uint32_t file_type(DType type) {
  switch (type) {
    case DType::F32: return 0;
    case DType::F16: return 1;
    case DType::Q4_0: return 2;
    case DType::Q4_1: return 3;
    case DType::Q8_0: return 7;
    case DType::BF16: return 32;
    default: break;
  }
  throw std::invalid_argument("write_tiny_llama: no model file type for " +
                              std::string(kernels::to_string(type)));
}

}  // namespace

TinyLlamaInfo tiny_llama_vocab() {
  TinyLlamaInfo info;
  // Special tokens first, as in SmolLM2: <|endoftext|> = 0, <|im_start|> = 1, <|im_end|> = 2.
  info.tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  const auto alphabet = byte_level_alphabet();
  info.tokens.insert(info.tokens.end(), alphabet.begin(), alphabet.end());
  // Merges by rank, chosen so that common English words ("Hello", " world", " the", " and",
  // "ing") become single tokens. Each merge's result is a token, after the byte tokens.
  info.merges = {
      "Ġ t",   "Ġ a",    "h e",     "i n",    "r e",  "o n",    "Ġt he", "e r",   "Ġ s",
      "a t",   "Ġ w",    "Ġ o",     "e n",    "Ġ c",  "i t",    "i s",   "a n",   "o r",
      "e s",   "Ġ b",    "e d",     "Ġ f",    "in g", "Ġ p",    "o u",   "Ġa n",  "Ġan d",
      "l l",   "H e",    "He ll",   "Hell o", "Ġw or", "Ġwor l", "Ġworl d", "Ġ is", "Ġ m",
      "Ġ d",   "a r",    "Ċ Ċ",     "Ġ Ġ",    "Ġ h",
  };
  for (const std::string& merge : info.merges) {
    const auto space = merge.find(' ');
    info.tokens.push_back(merge.substr(0, space) + merge.substr(space + 1));
  }
  info.n_vocab = static_cast<std::int64_t>(info.tokens.size());
  return info;
}

TinyLlamaInfo write_tiny_llama(const std::filesystem::path& path, const TinyLlamaOptions& options) {
  const TinyLlamaOptions& o = options;
  if (o.n_heads <= 0 || o.n_kv_heads <= 0 || o.n_embd % o.n_heads != 0 ||
      o.n_heads % o.n_kv_heads != 0 || o.n_layers <= 0 || o.n_ff <= 0) {
    throw std::invalid_argument("write_tiny_llama: inconsistent sizes");
  }
  for (DType type : {o.weight_dtype, o.embedding_dtype, o.v_up_dtype.value_or(o.weight_dtype)}) {
    (void)file_type(type);  // rejects Q8_1
    const std::int64_t block = kernels::block_size(type);
    if (o.n_embd % block != 0 || o.n_ff % block != 0) {
      throw std::invalid_argument("write_tiny_llama: n_embd and n_ff must be multiples of " +
                                  std::to_string(block) + " for " +
                                  std::string(kernels::to_string(type)));
    }
  }

  TinyLlamaInfo info = tiny_llama_vocab();
  info.head_dim = o.n_embd / o.n_heads;
  const std::int64_t n_vocab = info.n_vocab;
  const std::int64_t kv_dim = o.n_kv_heads * info.head_dim;

  GgufWriter writer;
  writer.add("general.architecture", GgufValue::str("llama"))
      .add("general.name", GgufValue::str("tiny-llama"))
      .add("general.file_type", GgufValue::u32(file_type(o.weight_dtype)))
      .add("general.quantization_version", GgufValue::u32(2))
      .add("llama.block_count", GgufValue::u32(static_cast<std::uint32_t>(o.n_layers)))
      .add("llama.context_length", GgufValue::u32(static_cast<std::uint32_t>(o.context_length)))
      .add("llama.embedding_length", GgufValue::u32(static_cast<std::uint32_t>(o.n_embd)))
      .add("llama.feed_forward_length", GgufValue::u32(static_cast<std::uint32_t>(o.n_ff)))
      .add("llama.attention.head_count", GgufValue::u32(static_cast<std::uint32_t>(o.n_heads)))
      .add("llama.attention.head_count_kv", GgufValue::u32(static_cast<std::uint32_t>(o.n_kv_heads)))
      .add("llama.rope.freq_base", GgufValue::f32(o.rope_freq_base))
      .add("llama.attention.layer_norm_rms_epsilon", GgufValue::f32(o.rms_norm_eps))
      .add("llama.vocab_size", GgufValue::u32(static_cast<std::uint32_t>(n_vocab)))
      .add("llama.rope.dimension_count", GgufValue::u32(static_cast<std::uint32_t>(info.head_dim)));

  std::vector<std::int32_t> token_types(static_cast<std::size_t>(n_vocab), 1);  // normal
  for (int special = 0; special < 3; ++special) token_types[static_cast<std::size_t>(special)] = 3;  // control
  writer.add("tokenizer.ggml.model", GgufValue::str("gpt2"))
      .add("tokenizer.ggml.pre", GgufValue::str("smollm"))
      .add("tokenizer.ggml.tokens", GgufValue::str_array(info.tokens))
      .add("tokenizer.ggml.token_type", GgufValue::i32_array(token_types))
      .add("tokenizer.ggml.merges", GgufValue::str_array(info.merges))
      .add("tokenizer.ggml.bos_token_id", GgufValue::u32(1))
      .add("tokenizer.ggml.eos_token_id", GgufValue::u32(2))
      .add("tokenizer.ggml.unknown_token_id", GgufValue::u32(0))
      .add("tokenizer.ggml.padding_token_id", GgufValue::u32(2))
      .add("tokenizer.ggml.add_bos_token", GgufValue::boolean(false))
      .add("tokenizer.chat_template",
           GgufValue::str("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
                          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"));

  // Weights: normal with std 0.5 / sqrt(row length) for matrices, so that a matrix-vector
  // product keeps activations near unit scale (0.04 to 0.06 at the default sizes); the
  // embedding at 0.1; RMSNorm weights near 1. All drawn in tensor order from one stream.
  NormalRandom random(o.seed);
  const auto matrix = [&](const std::string& name, DType type, std::int64_t row_length,
                          std::int64_t rows, float std_dev) {
    std::vector<float> values(static_cast<std::size_t>(row_length * rows));
    for (float& v : values) v = std_dev * random.next();
    if (name != o.q3_k_tensor) {
      writer.add_tensor(name, type, {row_length, rows}, values);
      return;
    }
    // Q3_K: 110 bytes per 256 elements, written as bytes of the same size, then retyped.
    if (row_length % 256 != 0) throw std::invalid_argument("q3_k_tensor " + name + ": rows are not whole blocks");
    const std::int64_t bytes = row_length / 256 * 110 * rows;
    writer.add_tensor(name, DType::F16, {bytes / 2}, std::vector<std::byte>(static_cast<std::size_t>(bytes)));
    writer.override_tensor(name, {.type_id = 11, .dims = std::vector<std::uint64_t>{static_cast<std::uint64_t>(row_length),
                                                                                    static_cast<std::uint64_t>(rows)}});
  };
  const auto norm = [&](const std::string& name) {
    std::vector<float> values(static_cast<std::size_t>(o.n_embd));
    for (float& v : values) v = 1.0f + 0.1f * random.next();
    writer.add_tensor(name, DType::F32, {o.n_embd}, values);
  };
  const auto scale = [](std::int64_t row_length) {
    return 0.5f / std::sqrt(static_cast<float>(row_length));
  };

  matrix("token_embd.weight", o.embedding_dtype, o.n_embd, n_vocab, 0.1f);
  // llama.cpp stores attn_q and attn_k with each head's rows permuted for its rotary mode; with
  // random weights there is nothing to permute.
  for (std::int64_t layer = 0; layer < o.n_layers; ++layer) {
    const std::string prefix = "blk." + std::to_string(layer) + ".";
    norm(prefix + "attn_norm.weight");
    matrix(prefix + "attn_q.weight", o.weight_dtype, o.n_embd, o.n_embd, scale(o.n_embd));
    matrix(prefix + "attn_k.weight", o.weight_dtype, o.n_embd, kv_dim, scale(o.n_embd));
    matrix(prefix + "attn_v.weight", o.v_up_dtype.value_or(o.weight_dtype), o.n_embd, kv_dim, scale(o.n_embd));
    matrix(prefix + "attn_output.weight", o.weight_dtype, o.n_embd, o.n_embd, scale(o.n_embd));
    norm(prefix + "ffn_norm.weight");
    matrix(prefix + "ffn_gate.weight", o.weight_dtype, o.n_embd, o.n_ff, scale(o.n_embd));
    matrix(prefix + "ffn_up.weight", o.v_up_dtype.value_or(o.weight_dtype), o.n_embd, o.n_ff, scale(o.n_embd));
    matrix(prefix + "ffn_down.weight", o.weight_dtype, o.n_ff, o.n_embd, scale(o.n_ff));
  }
  norm("output_norm.weight");
  if (!o.tied) matrix("output.weight", o.embedding_dtype, o.n_embd, n_vocab, scale(o.n_embd));

  writer.write(path);
  return info;
}

}  // namespace batchlm::testing
