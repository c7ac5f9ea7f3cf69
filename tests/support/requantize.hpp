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

// SHA-256 of `bytes` as 64 lower-case hex digits (as sha256sum and Python's hashlib print it).
std::string sha256_hex(std::span<const std::byte> bytes);

}  // namespace batchlm::testing
