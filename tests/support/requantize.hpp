#pragma once
// Copies a GGUF file with chosen matrices in other types: every metadata key and value as the
// file has them, in its order (general.file_type may be given a new value), every tensor in
// its order, and the chosen ones dequantized (kernels::dequantize_row) and quantized again with
// the test writer's quantize(). The output is a function of the input alone: the same bytes on
// every run and machine. Used to run the engine on a real model in types its download does
// not come in, and to make the file llama.cpp's goldens for that model come from.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "batchlm/kernels/dtype.hpp"
#include "batchlm/local_engine/gguf.hpp"
#include "gguf_writer.hpp"

namespace batchlm::testing {

// The new type of a tensor, or nullopt to copy its bytes unchanged.
using Recipe = std::function<std::optional<kernels::DType>(const local_engine::gguf::TensorInfo&)>;

struct RequantizeOptions {
  Recipe recipe;
  std::optional<std::uint32_t> file_type;   // general.file_type's new value (u32), where set
};

// The encoded copy of `in`. Throws std::invalid_argument where the recipe asks for a type a
// tensor's rows are not whole blocks of, or re-encodes a tensor of a type the engine does not
// run; the reader's gguf::Error for a file it rejects.
std::vector<std::byte> requantize(const local_engine::gguf::File& in, const RequantizeOptions& options);

// SmolLM2-135M (576 columns, ffn_down 1536) in the types of llama.cpp's K-quant files:
// ffn_down Q4_K in layers 0-9, Q5_K in 10-19 and Q6_K from 20 (its rows are six 256-element
// super-blocks; the other matrices' 576 are not whole super-blocks); attn_q, attn_k,
// attn_output, ffn_gate and ffn_up Q5_0 in even layers and Q5_1 in odd ones; attn_v, the
// embedding and the norms as they are. general.file_type 15 (llama.cpp's "mostly Q4_K_M").
RequantizeOptions smollm2_kmix();

// The requantized default model's file name; its goldens are in
// tests/reference/smollm2-135m-instruct-kmix/.
inline constexpr const char* kSmolLM2KmixFile = "SmolLM2-135M-Instruct.kmix.gguf";

// A llama-architecture file stored as the 'qwen2' architecture, computing the same network
// plus biases: general.architecture "qwen2" and every "llama." key renamed "qwen2.", the rows
// of each attn_q and attn_k head put back in the order of the checkpoint (llama's converter
// interleaves a head's two halves so that adjacent dims form the rotary pairs; qwen2 pairs the
// halves), and attn_q.bias, attn_k.bias and attn_v.bias (F32) added after each layer's
// attn_v.weight: bias_scale times a fixed pseudo-random sequence in [-1, 1), or zeros. With
// zeros it is the same network as the input, rotated in the other layout. Every other key and
// tensor is copied as it is.
std::vector<std::byte> as_qwen2(const local_engine::gguf::File& in, float bias_scale);

// A copy of a llama-architecture file with a rope_freqs.weight tensor (F32, the rotary
// dimension / 2 factors that divide each pair's angle), as Llama 3.1 and later have: factor i
// is 1 + (max_factor - 1) * (i / (n - 1))^2, so the fast pairs stay and the slow ones turn
// up to max_factor times slower.
std::vector<std::byte> with_rope_freqs(const local_engine::gguf::File& in, float max_factor);

// A llama-architecture file stored as the 'phi3' architecture of a long-context Phi-3 (Phi-3.5's
// layout): general.architecture "phi3", every "llama." key renamed "phi3."; each layer's attn_q,
// attn_k and attn_v as one attn_qkv (their rows one after the other; attn_q and attn_k rows in the
// checkpoint's order, as for qwen2, since phi3 pairs the halves) and ffn_gate and ffn_up as one
// ffn_up (the gate's rows first); rope_factors_short.weight (factor i = 1 + (short_max - 1) *
// (i / (n - 1))^2) and rope_factors_long.weight (long_scale times those), phi3.rope.scaling.attn_factor
// and phi3.rope.scaling.original_context_length. Up to the original context the short factors
// run, so the network is the input's with its angles divided by them and every cosine and sine
// times attn_factor; past it, the long ones. The matrices stacked must share a type.
std::vector<std::byte> as_phi3(const local_engine::gguf::File& in, float short_max, float attn_factor,
                               std::int64_t original_context, float long_scale = 10.0f);
inline constexpr float kSmolLM2Phi3ShortMax = 4.0f;
inline constexpr float kSmolLM2Phi3AttnFactor = 1.03f;
inline constexpr std::int64_t kSmolLM2Phi3OriginalContext = 4096;
inline constexpr const char* kSmolLM2Phi3File = "SmolLM2-135M-Instruct.phi3.gguf";
// The same with an original context of 1,024 and long factors twice the short ones, so that
// the goldens' context of 2,048 runs the long factors.
inline constexpr std::int64_t kSmolLM2Phi3LongOriginalContext = 1024;
inline constexpr float kSmolLM2Phi3LongScale = 2.0f;
inline constexpr std::int64_t kSmolLM2Phi3LongContext = 2048;
inline constexpr const char* kSmolLM2Phi3LongFile = "SmolLM2-135M-Instruct.phi3long.gguf";

// A llama-architecture file stored as Gemma 2 or 3 ('gemma2', 'gemma3'): general.architecture
// and every "llama." key renamed; attention.sliding_window = window (Gemma 3: five layers in six
// then see only that many positions and rotate with its window base of 10,000; Gemma 2: every
// other layer, with the model's base); linear rotary scaling by rope_factor (Gemma 3: in the
// other layers; Gemma 2: all); where above 0, attn_logit_softcapping and final_logit_softcapping;
// attn_q and attn_k rows in the checkpoint's order (as for qwen2), Gemma 3's attn_q_norm and
// attn_k_norm after them; post_attention_norm and post_ffw_norm after attn_output and ffn_down.
// The new norms are F32, scale * (1 + 0.1 * a fixed pseudo-random sequence in [-1, 1)), with
// scale qk_norm for the head norms and post_norm for the others. Gemma multiplies the
// embeddings by sqrt(n_embd), so token_embd's Q8_0 block scales are divided by it; Gemma 3's
// output head, tied in the input, becomes output.weight with the original bytes, while Gemma 2's
// is always the embedding matrix (its logits are then the input's / sqrt(n_embd)). llama.cpp's
// Gemma network then runs on it: GELU in place of SiLU, the norms, the windows, the caps.
struct GemmaCopy {
  std::string architecture;
  std::int64_t window = 64;
  float rope_factor = 2.0f;
  float qk_norm = 1.0f;
  float post_norm = 0.1f;
  float attn_softcap = 0.0f, final_softcap = 0.0f;
};
std::vector<std::byte> as_gemma(const local_engine::gguf::File& in, const GemmaCopy& copy);
// The two copies whose goldens are in tests/reference/smollm2-135m-instruct-gemma3/ and -gemma2/.
// A larger post_norm or qk_norm makes this untrained network chaotic (llama.cpp's own two
// paths then differ by more than a logit), so both stay small.
inline GemmaCopy smollm2_gemma3() { return {"gemma3"}; }
inline GemmaCopy smollm2_gemma2() { return {.architecture = "gemma2", .attn_softcap = 5.0f, .final_softcap = 1.0f}; }
inline constexpr const char* kSmolLM2Gemma3File = "SmolLM2-135M-Instruct.gemma3.gguf";
inline constexpr const char* kSmolLM2Gemma2File = "SmolLM2-135M-Instruct.gemma2.gguf";
// A copy of `in` for the loader's tests: the tensors `drop` names left out, the metadata keys
// of `set` given those values (the others as they are), then `add`'s tensors appended.
struct GgufEdit {
  std::function<bool(const std::string&)> drop;
  std::vector<std::pair<std::string, GgufValue>> set;
  std::function<void(GgufWriter&)> add;
};
std::vector<std::byte> edit(const local_engine::gguf::File& in, const GgufEdit& e);

// The files of these two made from the default model, and where their goldens are
// (tests/reference/smollm2-135m-instruct-qwen2/ and -ropefreqs/).
inline constexpr const char* kSmolLM2Qwen2File = "SmolLM2-135M-Instruct.qwen2.gguf";
inline constexpr float kSmolLM2Qwen2BiasScale = 0.1f;
inline constexpr const char* kSmolLM2RopeFreqsFile = "SmolLM2-135M-Instruct.ropefreqs.gguf";
inline constexpr float kSmolLM2RopeFreqsMax = 8.0f;

// SHA-256 of `bytes` as 64 lower-case hex digits (as sha256sum and Python's hashlib print it).
std::string sha256_hex(std::span<const std::byte> bytes);
// The same of a file's contents. Throws std::runtime_error when it cannot be read.
std::string sha256_file(const std::filesystem::path& path);

}  // namespace batchlm::testing
