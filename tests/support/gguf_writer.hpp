#pragma once
// Builds GGUF files for tests: metadata of every type (nested arrays included), tensors from
// raw bytes or from floats quantized with ggml's reference formulas, any alignment, and
// deliberate corruption (magic, version, counts, a tensor's type id, dims or offset, truncation,
// byte flips on the encoded bytes). Also writes a complete random-weight Llama model small
// enough for the forward-pass tests, so no test needs a downloaded model.
//
// The writer does not use the reader it helps to test: it encodes the format on its own.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "batchlm/kernels/dtype.hpp"

namespace batchlm::testing {

using kernels::DType;

// Metadata value type ids, numbered as in the file (and as gguf::ValueType).
enum class GgufType : std::uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, Bool = 7,
  String = 8, Array = 9, U64 = 10, I64 = 11, F64 = 12,
};

// One metadata value, already encoded: its type id and the bytes that follow the type id in the
// file. Build it with the named constructors; `raw` writes any type id and payload at all.
struct GgufValue {
  std::uint32_t type = 0;
  std::vector<std::byte> bytes;

  static GgufValue u8(std::uint8_t v);
  static GgufValue i8(std::int8_t v);
  static GgufValue u16(std::uint16_t v);
  static GgufValue i16(std::int16_t v);
  static GgufValue u32(std::uint32_t v);
  static GgufValue i32(std::int32_t v);
  static GgufValue f32(float v);
  static GgufValue boolean(bool v);
  static GgufValue str(std::string_view v);
  static GgufValue u64(std::uint64_t v);
  static GgufValue i64(std::int64_t v);
  static GgufValue f64(double v);
  // An array whose items all have type `element_type` (throws std::invalid_argument otherwise);
  // items may themselves be arrays, of any element type each.
  static GgufValue array(GgufType element_type, const std::vector<GgufValue>& items);
  static GgufValue str_array(const std::vector<std::string>& items);
  static GgufValue i32_array(std::span<const std::int32_t> items);
  static GgufValue u32_array(std::span<const std::uint32_t> items);
  static GgufValue f32_array(std::span<const float> items);
  // Any type id with any payload, for corruption tests.
  static GgufValue raw(std::uint32_t type, std::vector<std::byte> bytes);
};

// Quantizes `values` (a multiple of block_size(type) long) to `type`'s blocks: F32, F16, BF16,
// Q8_0, Q8_1, Q4_0 and Q4_1 with ggml's reference formulas; Q5_0 and Q5_1 likewise with 5 bits;
// Q4_K, Q5_K and Q6_K with plain formulas of their own (each sub-block's range, scales rounded
// to the stored precision; not ggml's search for the best scales). Deterministic.
std::vector<std::byte> quantize(DType type, std::span<const float> values);
// The inverse: `n` elements from `data`, element by element from the layouts (independent of
// kernels::dequantize_row, which it helps to test).
std::vector<float> dequantize(DType type, std::span<const std::byte> data, std::int64_t n);

// Writes `bytes` to `path`, replacing the file. Throws std::runtime_error on failure.
void write_file(const std::filesystem::path& path, std::span<const std::byte> bytes);

// A new empty directory under the system's temporary directory, named prefix-XXXXXX. Throws
// std::runtime_error on failure.
std::filesystem::path fresh_dir(const std::string& prefix);

class GgufWriter {
 public:
  // What the tensor table says about a tensor, replacing what the writer would say. The
  // tensor's data is laid out as usual either way.
  struct TensorOverride {
    std::optional<std::uint32_t> type_id;
    std::optional<std::uint64_t> offset;       // from the start of the data section
    std::optional<std::vector<std::uint64_t>> dims;
    std::optional<std::uint32_t> n_dims;       // default: dims.size()
  };

  // The encoded file and where its parts begin.
  struct Encoded {
    std::vector<std::byte> bytes;
    std::uint64_t data_start = 0;                // first byte of the data section
    std::vector<std::uint64_t> tensor_offsets;   // per tensor, from data_start
  };

  // Metadata in the order added. Duplicate keys are written as given (for corruption tests).
  GgufWriter& add(std::string key, GgufValue value);
  // Writes general.alignment (u32) at this point of the metadata and lays the data out at
  // this alignment; a value that is not a non-zero power of two is written, but the data is
  // then laid out at the default 32.
  GgufWriter& set_alignment(std::uint32_t alignment);

  // A tensor from its encoded bytes, which must be row_bytes(type, shape[0]) * rows long
  // (throws std::invalid_argument otherwise). shape[0] is the row length, as in the file.
  GgufWriter& add_tensor(std::string name, DType type, std::vector<std::int64_t> shape,
                         std::vector<std::byte> data);
  // A tensor from floats (product of shape long), quantized to `type`.
  GgufWriter& add_tensor(std::string name, DType type, std::vector<std::int64_t> shape,
                         std::span<const float> values);

  // Corruption hooks.
  GgufWriter& override_tensor(std::string_view name, TensorOverride override_with);
  GgufWriter& set_magic(std::string magic);   // written as given, any length
  GgufWriter& set_version(std::uint32_t version);
  GgufWriter& set_tensor_count(std::uint64_t count);
  GgufWriter& set_kv_count(std::uint64_t count);
  GgufWriter& append_bytes(std::vector<std::byte> bytes);  // after the data section

  Encoded encode() const;
  void write(const std::filesystem::path& path) const;
  // Only the first `size` bytes of the file.
  void write_truncated(const std::filesystem::path& path, std::size_t size) const;

 private:
  struct Tensor {
    std::string name;
    DType type;
    std::vector<std::int64_t> shape;
    std::vector<std::byte> data;
    TensorOverride override_with;
  };

  std::string magic_ = "GGUF";
  std::uint32_t version_ = 3;
  std::optional<std::uint64_t> tensor_count_, kv_count_;
  std::uint64_t alignment_ = 32;  // for the layout
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  std::vector<Tensor> tensors_;
  std::vector<std::byte> trailer_;
};

// A random-weight Llama in llama.cpp's GGUF layout for the `llama` architecture, with a small
// byte-level GPT-2 BPE vocabulary (ChatML special tokens, as SmolLM2 has).
struct TinyLlamaOptions {
  std::int64_t n_embd = 64;
  std::int64_t n_ff = 128;
  std::int64_t n_heads = 4;
  std::int64_t n_kv_heads = 2;
  std::int64_t n_layers = 2;
  std::int64_t context_length = 256;
  float rope_freq_base = 10000.0f;
  float rms_norm_eps = 1e-5f;
  // The attention and feed-forward matrices. Rows must be whole blocks: n_embd and n_ff
  // multiples of 32 for the 4-, 5- and 8-bit types, of 256 for Q4_K, Q5_K and Q6_K (the same
  // for v_up_dtype and embedding_dtype).
  DType weight_dtype = DType::F32;
  // Where set, attn_v.weight and ffn_up.weight take this type instead (a model whose layers
  // mix types, as many quantizations do).
  std::optional<DType> v_up_dtype;
  DType embedding_dtype = DType::F32;   // token_embd.weight (and output.weight unless tied)
  // The matrix of this name, if any, is written as Q3_K blocks of zeros: a type GGUF files use
  // that the engine does not run. Its rows must be whole 256-element blocks.
  std::string q3_k_tensor;
  std::uint64_t seed = 1;
  bool tied = false;                    // no output.weight: the output reuses token_embd
  // "llama"; "qwen2": its keys, and attn_q/k/v.bias tensors (drawn after each layer's V
  // matrix, with std 0.1); "qwen3": its keys, and attn_q_norm/attn_k_norm (near 1) there.
  // Random weights have no layout to permute for either rotary style.
  std::string architecture = "llama";
  // Where > 0, heads of this many dims (attention.key_length and value_length), however wide
  // n_embd / n_heads is, as Qwen3's are; attn_q then has n_heads * head_dim rows.
  std::int64_t head_dim = 0;
  // Where not empty, a rope_freqs.weight tensor of these factors (head_dim / 2 of them).
  std::vector<float> rope_freqs;
  // Where > 0, the rotary dims (rope.dimension_count) when fewer than the head's.
  std::int64_t rope_dim = 0;
  // "phi3" writes Q, K and V as one attn_qkv matrix and gate and up as one ffn_up of 2 * n_ff
  // rows (v_up_dtype must be unset), and, where these are set, Phi-3's long-context keys and
  // tensors: rope_factors_short and rope_factors_long (rope_dim / 2 factors each),
  // rope.scaling.attn_factor, rope.scaling.original_context_length.
  std::vector<float> rope_factors_short, rope_factors_long;
  float rope_attn_factor = 0.0f;
  std::int64_t original_context_length = 0;
  // "gemma", "gemma2" and "gemma3" write Gemma's tensors: post_attention_norm and post_ffw_norm
  // (Gemma 2 and 3, drawn after attn_output and ffn_down), attn_q_norm and attn_k_norm (Gemma
  // 3, as Qwen3's); Gemma and Gemma 2 are always tied (no output.weight). Where set: attention.sliding_window, attention.sliding_window_pattern
  // (every n-th layer without the window), rope.freq_base_swa, and the soft caps
  // (attn_logit_softcapping, final_logit_softcapping).
  std::int64_t sliding_window = 0;
  std::int64_t sliding_window_pattern = 0;
  float rope_freq_base_swa = 0.0f;
  float attn_softcap = 0.0f, final_softcap = 0.0f;
  // Any architecture: rope.scaling.type "linear" with this factor, where > 0.
  float rope_scaling_factor = 0.0f;
  // tokenizer.chat_template; empty: plain ChatML.
  std::string chat_template;
};

struct TinyLlamaInfo {
  std::int64_t n_vocab = 0;
  std::int64_t head_dim = 0;
  std::vector<std::string> tokens;      // by id, byte-level encoded as in the file
  std::vector<std::string> merges;      // "a b", by rank
};

// The tiny Qwen3 whose llama.cpp goldens are in tests/reference/tiny-qwen3/ (tiny_gguf writes
// it): F32, 2 layers, n_embd 256, 4 query heads of 128 dims sharing 2 KV heads, n_ff 512, and a
// context of 4096 for the goldens' longest prompt in this vocabulary's tokens.
TinyLlamaOptions tiny_qwen3_reference();

// The vocabulary alone (tokens and merges of write_tiny_llama).
TinyLlamaInfo tiny_llama_vocab();

// A vocabulary in which any two bytes merge: the three special tokens and 256 byte tokens of
// tiny_llama_vocab, then the 65,536 pairs of bytes as tokens, their merges ranked in a fixed
// pseudo-random order. Where two pre-tokenizers split a text differently, the ids mostly
// differ too, since a piece's bytes pair up across the place where the other splits it.
// llama.cpp's pre-tokenizer goldens (tests/reference/pretokenizers/) are made with it.
TinyLlamaInfo byte_pair_vocab();

// Writes a vocabulary-only file, as llama.cpp's ggml-vocab-*.gguf are (no tensors): the keys of
// a small llama-architecture model, then `vocab` as the first three tokens control, bos 1,
// eos 2, unk 0, tokenizer.ggml.pre = pre, and no add_bos_token (the pre-tokenizer's default).
void write_vocab_gguf(const std::filesystem::path& path, const TinyLlamaInfo& vocab, const std::string& pre);

// Writes the model to `path`. Weights are deterministic in options.seed. Throws
// std::invalid_argument for sizes that do not make a model (n_embd not a multiple of
// n_heads, rows not whole blocks of the chosen dtypes, ...).
TinyLlamaInfo write_tiny_llama(const std::filesystem::path& path,
                               const TinyLlamaOptions& options = {});

}  // namespace batchlm::testing
