#include "requantize.hpp"

#include <array>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <regex>
#include <stdexcept>
#include <utility>
#include <variant>

#include "gguf_writer.hpp"

namespace batchlm::testing {

namespace gguf = local_engine::gguf;
using kernels::DType;

namespace {

GgufValue encode(const gguf::Value& v) {
  const auto u = [&] { return std::get<std::uint64_t>(v.data); };
  const auto i = [&] { return std::get<std::int64_t>(v.data); };
  switch (v.type) {
    case gguf::ValueType::U8: return GgufValue::u8(static_cast<std::uint8_t>(u()));
    case gguf::ValueType::U16: return GgufValue::u16(static_cast<std::uint16_t>(u()));
    case gguf::ValueType::U32: return GgufValue::u32(static_cast<std::uint32_t>(u()));
    case gguf::ValueType::U64: return GgufValue::u64(u());
    case gguf::ValueType::I8: return GgufValue::i8(static_cast<std::int8_t>(i()));
    case gguf::ValueType::I16: return GgufValue::i16(static_cast<std::int16_t>(i()));
    case gguf::ValueType::I32: return GgufValue::i32(static_cast<std::int32_t>(i()));
    case gguf::ValueType::I64: return GgufValue::i64(i());
    // The reader widens an F32 to double, which narrows back to the same float.
    case gguf::ValueType::F32: return GgufValue::f32(static_cast<float>(std::get<double>(v.data)));
    case gguf::ValueType::F64: return GgufValue::f64(std::get<double>(v.data));
    case gguf::ValueType::Bool: return GgufValue::boolean(std::get<bool>(v.data));
    case gguf::ValueType::String: return GgufValue::str(std::get<std::string>(v.data));
    case gguf::ValueType::Array: {
      const gguf::Array& a = std::get<gguf::Array>(v.data);
      std::vector<GgufValue> items;
      items.reserve(a.items.size());
      for (const gguf::Value& item : a.items) items.push_back(encode(item));
      return GgufValue::array(static_cast<GgufType>(a.element_type), items);
    }
  }
  throw std::invalid_argument("requantize: unknown metadata type");
}

std::vector<std::byte> reencode(const gguf::TensorInfo& t, DType to) {
  const DType from = *t.type;
  const std::int64_t cols = t.cols(), rows = t.rows();
  if (cols % kernels::block_size(to) != 0) {
    throw std::invalid_argument("requantize: tensor '" + t.name + "' has rows of " +
                                std::to_string(cols) + ", not whole blocks of " +
                                std::string(kernels::to_string(to)));
  }
  std::vector<float> values(static_cast<std::size_t>(cols * rows));
  const std::size_t stride = kernels::row_bytes(from, cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    kernels::dequantize_row(from, t.data + static_cast<std::size_t>(r) * stride, cols,
                            values.data() + r * cols);
  }
  return quantize(to, values);
}

}  // namespace

std::vector<std::byte> requantize(const gguf::File& in, const RequantizeOptions& options) {
  GgufWriter out;
  out.set_version(in.version());
  for (const auto& [key, value] : in.metadata()) {
    if (key == "general.alignment") {
      // Written as u32 at this point, and the data laid out at it (the reader checked both).
      out.set_alignment(static_cast<std::uint32_t>(in.alignment()));
    } else if (key == "general.file_type" && options.file_type) {
      out.add(key, GgufValue::u32(*options.file_type));
    } else {
      out.add(key, encode(value));
    }
  }
  for (const gguf::TensorInfo& t : in.tensors()) {
    const std::optional<DType> to = options.recipe ? options.recipe(t) : std::nullopt;
    if (!t.type) {
      throw std::invalid_argument("requantize: tensor '" + t.name + "' is " +
                                  std::string(t.type_name()) + ", which the engine does not run");
    }
    if (to && *to != *t.type) {
      out.add_tensor(t.name, *to, t.shape, reencode(t, *to));
    } else {
      out.add_tensor(t.name, *t.type, t.shape, std::vector<std::byte>(t.data, t.data + t.n_bytes));
    }
  }
  return out.encode().bytes;
}

RequantizeOptions smollm2_kmix() {
  RequantizeOptions options;
  options.file_type = 15;
  options.recipe = [](const gguf::TensorInfo& t) -> std::optional<DType> {
    static const std::regex name(R"(blk\.(\d+)\.(attn_q|attn_k|attn_output|ffn_gate|ffn_up|ffn_down)\.weight)");
    std::smatch m;
    if (!std::regex_match(t.name, m, name)) return std::nullopt;
    const int layer = std::stoi(m[1].str());
    if (m[2] == "ffn_down") return layer < 10 ? DType::Q4_K : layer < 20 ? DType::Q5_K : DType::Q6_K;
    return layer % 2 == 0 ? DType::Q5_0 : DType::Q5_1;
  };
  return options;
}

namespace {

// The metadata of `in` as the writer takes it, each key through `rename` (which may also
// replace the value), general.alignment kept as a layout setting.
void copy_metadata(const gguf::File& in, GgufWriter& out,
                   const std::function<std::pair<std::string, GgufValue>(const std::string&, const gguf::Value&)>& rename) {
  out.set_version(in.version());
  for (const auto& [key, value] : in.metadata()) {
    if (key == "general.alignment") {
      out.set_alignment(static_cast<std::uint32_t>(in.alignment()));
      continue;
    }
    auto [name, v] = rename(key, value);
    out.add(name, std::move(v));
  }
}

// The metadata of a llama-architecture file as another architecture's: general.architecture
// `arch` and every "llama." key renamed "<arch>.".
void copy_metadata_as(const gguf::File& in, GgufWriter& out, const std::string& arch) {
  copy_metadata(in, out, [&](const std::string& key, const gguf::Value& value) {
    if (key == "general.architecture") return std::pair(key, GgufValue::str(arch));
    if (key.starts_with("llama.")) return std::pair(arch + "." + key.substr(6), encode(value));
    return std::pair(key, encode(value));
  });
}

std::vector<std::byte> bytes_of(const gguf::TensorInfo& t) {
  return std::vector<std::byte>(t.data, t.data + t.n_bytes);
}

void require_llama(const gguf::File& in, const char* what) {
  if (in.get_string("general.architecture") != "llama")
    throw std::invalid_argument(std::string(what) + ": the input is not a llama-architecture file");
}

// The sizes of a llama-architecture file that the copies need.
struct LlamaShape {
  std::int64_t n_embd, n_heads, n_kv_heads, rope_dim;
};
LlamaShape llama_shape(const gguf::File& in) {
  const auto u64 = [&](const char* key) { return static_cast<std::int64_t>(in.get_u64(key)); };
  LlamaShape s{};
  s.n_embd = u64("llama.embedding_length");
  s.n_heads = u64("llama.attention.head_count");
  s.n_kv_heads = in.find("llama.attention.head_count_kv") ? u64("llama.attention.head_count_kv") : s.n_heads;
  s.rope_dim = in.find("llama.rope.dimension_count") ? u64("llama.rope.dimension_count") : s.n_embd / s.n_heads;
  return s;
}

}  // namespace

namespace {

// A fixed pseudo-random sequence: splitmix64 steps from `seed`, the top 24 bits of each as a
// float in [-1, 1).
class Stream {
 public:
  explicit Stream(std::uint64_t seed) : state_(seed) {}
  float next() {
    state_ += 0x9e3779b97f4a7c15ULL;
    std::uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return static_cast<float>(static_cast<std::int64_t>(z >> 40) - (1 << 23)) / static_cast<float>(1 << 23);
  }

 private:
  std::uint64_t state_;
};

// Row h*d + s*d/2 + j of the checkpoint is row h*d + 2j + s of llama's layout: `t`'s rows (a
// query or key matrix of n heads) put back in the checkpoint's order.
std::vector<std::byte> unpermuted_rows(const gguf::TensorInfo& t, std::int64_t n) {
  std::vector<std::byte> bytes = bytes_of(t);
  const std::int64_t rows = t.rows();
  const std::int64_t d = rows / n;
  const std::size_t row = t.n_bytes / static_cast<std::size_t>(rows);
  for (std::int64_t h = 0; h < n; ++h)
    for (std::int64_t s = 0; s < 2; ++s)
      for (std::int64_t j = 0; j < d / 2; ++j)
        std::memcpy(bytes.data() + static_cast<std::size_t>(h * d + s * d / 2 + j) * row,
                    t.data + static_cast<std::size_t>(h * d + 2 * j + s) * row, row);
  return bytes;
}

}  // namespace

std::vector<std::byte> as_qwen2(const gguf::File& in, float bias_scale) {
  require_llama(in, "as_qwen2");
  GgufWriter out;
  copy_metadata_as(in, out, "qwen2");
  const auto [n_embd, n_heads, n_kv_heads, rope_dim] = llama_shape(in);
  // One stream for every bias, in tensor order.
  Stream random(0x7177656e32ULL);  // "qwen2"
  static const std::regex qk(R"(blk\.(\d+)\.attn_(q|k|v)\.weight)");
  for (const gguf::TensorInfo& t : in.tensors()) {
    std::smatch m;
    if (!std::regex_match(t.name, m, qk)) {
      out.add_tensor(t.name, *t.type, t.shape, bytes_of(t));
      continue;
    }
    std::vector<std::byte> bytes = m[2] == "v" ? bytes_of(t) : unpermuted_rows(t, m[2] == "q" ? n_heads : n_kv_heads);
    out.add_tensor(t.name, *t.type, t.shape, std::move(bytes));
    if (m[2] != "v") continue;
    // The biases go after attn_v.weight, q, k, v, each as long as its matrix has rows.
    const std::string layer = "blk." + m[1].str() + ".";
    for (const char* which : {"q", "k", "v"}) {
      const gguf::TensorInfo& w = in.tensor(layer + "attn_" + which + ".weight");
      std::vector<float> bias(static_cast<std::size_t>(w.rows()));
      for (float& b : bias) b = bias_scale * random.next();
      out.add_tensor(layer + "attn_" + which + ".bias", DType::F32, {w.rows()}, bias);
    }
  }
  return out.encode().bytes;
}

std::vector<std::byte> as_phi3(const gguf::File& in, float short_max, float attn_factor, std::int64_t original_context,
                               float long_scale) {
  require_llama(in, "as_phi3");
  GgufWriter out;
  copy_metadata_as(in, out, "phi3");
  out.add("phi3.rope.scaling.attn_factor", GgufValue::f32(attn_factor));
  out.add("phi3.rope.scaling.original_context_length", GgufValue::u32(static_cast<std::uint32_t>(original_context)));
  const auto [n_embd, n_heads, n_kv_heads, dim] = llama_shape(in);
  std::vector<float> short_factors(static_cast<std::size_t>(dim / 2)), long_factors(short_factors.size());
  for (std::size_t i = 0; i < short_factors.size(); ++i) {
    const float f = short_factors.size() > 1 ? static_cast<float>(i) / static_cast<float>(short_factors.size() - 1) : 0.0f;
    short_factors[i] = 1.0f + (short_max - 1.0f) * f * f;
    long_factors[i] = long_scale * short_factors[i];
  }
  out.add_tensor("rope_factors_long.weight", DType::F32, {dim / 2}, long_factors);
  out.add_tensor("rope_factors_short.weight", DType::F32, {dim / 2}, short_factors);
  // Rows of several matrices of one type and width, one after the other.
  const auto stack = [&](const std::string& name, std::initializer_list<std::pair<const gguf::TensorInfo*, std::vector<std::byte>>> parts) {
    const gguf::TensorInfo& first = *parts.begin()->first;
    std::vector<std::byte> bytes;
    std::int64_t rows = 0;
    for (const auto& [t, data] : parts) {
      if (*t->type != *first.type || t->shape[0] != first.shape[0])
        throw std::invalid_argument("as_phi3: " + t->name + " differs in type or width from " + first.name);
      bytes.insert(bytes.end(), data.begin(), data.end());
      rows += t->rows();
    }
    out.add_tensor(name, *first.type, {first.shape[0], rows}, std::move(bytes));
  };
  static const std::regex layer_tensor(R"(blk\.(\d+)\.(attn_q|attn_k|attn_v|ffn_gate|ffn_up)\.weight)");
  for (const gguf::TensorInfo& t : in.tensors()) {
    std::smatch m;
    if (!std::regex_match(t.name, m, layer_tensor)) {
      out.add_tensor(t.name, *t.type, t.shape, bytes_of(t));
      continue;
    }
    const std::string p = "blk." + m[1].str() + ".";
    // Written once per layer, where its first part comes.
    if (m[2] == "attn_q") {
      const gguf::TensorInfo& q = in.tensor(p + "attn_q.weight");
      const gguf::TensorInfo& k = in.tensor(p + "attn_k.weight");
      const gguf::TensorInfo& v = in.tensor(p + "attn_v.weight");
      stack(p + "attn_qkv.weight", {{&q, unpermuted_rows(q, n_heads)}, {&k, unpermuted_rows(k, n_kv_heads)}, {&v, bytes_of(v)}});
    } else if (m[2] == "ffn_gate") {
      const gguf::TensorInfo& gate = in.tensor(p + "ffn_gate.weight");
      const gguf::TensorInfo& up = in.tensor(p + "ffn_up.weight");
      stack(p + "ffn_up.weight", {{&gate, bytes_of(gate)}, {&up, bytes_of(up)}});
    }
  }
  return out.encode().bytes;
}

std::vector<std::byte> as_gemma(const gguf::File& in, const GemmaCopy& g) {
  require_llama(in, "as_gemma");
  if (g.architecture != "gemma2" && g.architecture != "gemma3")
    throw std::invalid_argument("as_gemma: architecture " + g.architecture);
  const bool gemma3 = g.architecture == "gemma3";
  const std::string a = g.architecture + ".";
  GgufWriter out;
  copy_metadata_as(in, out, g.architecture);
  out.add(a + "attention.sliding_window", GgufValue::u32(static_cast<std::uint32_t>(g.window)));
  out.add(a + "rope.scaling.type", GgufValue::str("linear"));
  out.add(a + "rope.scaling.factor", GgufValue::f32(g.rope_factor));
  if (g.attn_softcap > 0.0f) out.add(a + "attn_logit_softcapping", GgufValue::f32(g.attn_softcap));
  if (g.final_softcap > 0.0f) out.add(a + "final_logit_softcapping", GgufValue::f32(g.final_softcap));
  const auto [n_embd, n_heads, n_kv_heads, rope_dim] = llama_shape(in);
  const std::int64_t head_dim = n_embd / n_heads;
  // One stream for every new norm, in tensor order.
  Stream random(0x67656d6d6133ULL);  // "gemma3", for both
  const auto norm = [&](const std::string& name, std::int64_t n, float scale) {
    std::vector<float> w(static_cast<std::size_t>(n));
    for (float& e : w) e = scale * (1.0f + 0.1f * random.next());
    out.add_tensor(name, DType::F32, {n}, w);
  };
  static const std::regex layer_tensor(R"(blk\.(\d+)\.(attn_q|attn_k|attn_output|ffn_down)\.weight)");
  for (const gguf::TensorInfo& t : in.tensors()) {
    std::smatch m;
    if (t.name == "token_embd.weight" && !in.find_tensor("output.weight")) {
      // Gemma multiplies the embeddings by sqrt(n_embd): each Q8_0 block's scale divided by it,
      // so that the network's input is the input file's again (to F16's precision). Gemma 3's
      // output head, tied there, becomes a tensor of its own with the original bytes; Gemma 2's
      // stays the (divided) embedding matrix, so its logits are the input's / sqrt(n_embd).
      if (*t.type != DType::Q8_0) throw std::invalid_argument("as_gemma: token_embd.weight is not Q8_0");
      std::vector<std::byte> scaled = bytes_of(t);
      const float root = std::sqrt(static_cast<float>(n_embd));
      for (std::size_t at = 0; at < scaled.size(); at += 34) {
        std::uint16_t d;
        std::memcpy(&d, scaled.data() + at, 2);
        d = kernels::fp32_to_fp16(kernels::fp16_to_fp32(d) / root);
        std::memcpy(scaled.data() + at, &d, 2);
      }
      out.add_tensor(t.name, *t.type, t.shape, std::move(scaled));
      if (gemma3) out.add_tensor("output.weight", *t.type, t.shape, bytes_of(t));
      continue;
    }
    if (!std::regex_match(t.name, m, layer_tensor)) {
      out.add_tensor(t.name, *t.type, t.shape, bytes_of(t));
      continue;
    }
    const std::string p = "blk." + m[1].str() + ".";
    if (m[2] == "attn_q" || m[2] == "attn_k") {
      out.add_tensor(t.name, *t.type, t.shape, unpermuted_rows(t, m[2] == "attn_q" ? n_heads : n_kv_heads));
      if (gemma3) norm(p + m[2].str() + "_norm.weight", head_dim, g.qk_norm);
    } else {
      out.add_tensor(t.name, *t.type, t.shape, bytes_of(t));
      norm(p + (m[2] == "attn_output" ? "post_attention_norm.weight" : "post_ffw_norm.weight"), n_embd, g.post_norm);
    }
  }
  return out.encode().bytes;
}

std::vector<std::byte> edit(const gguf::File& in, const GgufEdit& e) {
  GgufWriter out;
  copy_metadata(in, out, [&](const std::string& key, const gguf::Value& value) {
    for (const auto& [k, v] : e.set)
      if (k == key) return std::pair(key, v);
    return std::pair(key, encode(value));
  });
  for (const gguf::TensorInfo& t : in.tensors())
    if (!e.drop || !e.drop(t.name)) out.add_tensor(t.name, *t.type, t.shape, bytes_of(t));
  if (e.add) e.add(out);
  return out.encode().bytes;
}

std::vector<std::byte> with_rope_freqs(const gguf::File& in, float max_factor) {
  require_llama(in, "with_rope_freqs");
  GgufWriter out;
  copy_metadata(in, out, [](const std::string& key, const gguf::Value& value) { return std::pair(key, encode(value)); });
  const std::int64_t n = llama_shape(in).rope_dim / 2;
  std::vector<float> factors(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const float f = n > 1 ? static_cast<float>(i) / static_cast<float>(n - 1) : 0.0f;
    factors[static_cast<std::size_t>(i)] = 1.0f + (max_factor - 1.0f) * f * f;
  }
  out.add_tensor("rope_freqs.weight", DType::F32, {n}, factors);
  for (const gguf::TensorInfo& t : in.tensors()) out.add_tensor(t.name, *t.type, t.shape, bytes_of(t));
  return out.encode().bytes;
}

// ---- SHA-256 (FIPS 180-4) ------------------------------------------------------------------

namespace {

constexpr std::array<std::uint32_t, 64> kRoundConstants = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

// One 64-byte chunk into the state.
void compress(std::array<std::uint32_t, 8>& h, const std::byte* chunk) {
  std::array<std::uint32_t, 64> w;
  for (int t = 0; t < 16; ++t) {
    w[t] = std::to_integer<std::uint32_t>(chunk[4 * t]) << 24 |
           std::to_integer<std::uint32_t>(chunk[4 * t + 1]) << 16 |
           std::to_integer<std::uint32_t>(chunk[4 * t + 2]) << 8 |
           std::to_integer<std::uint32_t>(chunk[4 * t + 3]);
  }
  for (int t = 16; t < 64; ++t) {
    const std::uint32_t s0 = std::rotr(w[t - 15], 7) ^ std::rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
    const std::uint32_t s1 = std::rotr(w[t - 2], 17) ^ std::rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
    w[t] = w[t - 16] + s0 + w[t - 7] + s1;
  }
  std::uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
  for (int t = 0; t < 64; ++t) {
    const std::uint32_t t1 = k + (std::rotr(e, 6) ^ std::rotr(e, 11) ^ std::rotr(e, 25)) +
                             ((e & f) ^ (~e & g)) + kRoundConstants[t] + w[t];
    const std::uint32_t t2 = (std::rotr(a, 2) ^ std::rotr(a, 13) ^ std::rotr(a, 22)) +
                             ((a & b) ^ (a & c) ^ (b & c));
    k = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}

}  // namespace

std::string sha256_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path.string());
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return sha256_hex(std::as_bytes(std::span(bytes.data(), bytes.size())));
}

std::string sha256_hex(std::span<const std::byte> bytes) {
  std::array<std::uint32_t, 8> h = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  const std::size_t whole = bytes.size() / 64 * 64;
  for (std::size_t at = 0; at < whole; at += 64) compress(h, bytes.data() + at);
  // The tail, a 1 bit, zeros, and the length in bits (big-endian): one or two more chunks.
  std::array<std::byte, 128> last{};
  const std::size_t tail = bytes.size() - whole;
  if (tail > 0) std::memcpy(last.data(), bytes.data() + whole, tail);
  last[tail] = std::byte{0x80};
  const std::size_t n = tail < 56 ? 64 : 128;
  const std::uint64_t bits = static_cast<std::uint64_t>(bytes.size()) * 8;
  for (int i = 0; i < 8; ++i) last[n - 1 - i] = static_cast<std::byte>(bits >> (8 * i));
  for (std::size_t at = 0; at < n; at += 64) compress(h, last.data() + at);
  std::string hex;
  char digits[9];
  for (std::uint32_t word : h) {
    std::snprintf(digits, sizeof digits, "%08x", word);
    hex += digits;
  }
  return hex;
}

}  // namespace batchlm::testing
