// Writes the seed inputs of the harnesses that cannot be taken from files as they are: small
// valid GGUF files (tests/support/gguf_writer.hpp), the start of the default model's file, and
// chat-template inputs in the chat_template harness's layout. make_seeds.sh writes the others.
//
//   make_fuzz_seeds OUT_DIR [MODEL.gguf]
//
// Seeds go to OUT_DIR/<harness>/; libFuzzer then minimizes them into corpus/<harness>/.

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gguf_writer.hpp"

namespace fs = std::filesystem;
using namespace batchlm::testing;

namespace {

void write_text(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

std::vector<float> ramp(std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i % 17) * 0.25f - 2.0f;
  return v;
}

// Every metadata type, nested arrays, a non-default alignment, a tensor of each type.
void write_metadata_file(const fs::path& path) {
  GgufWriter w;
  w.add("general.architecture", GgufValue::str("llama"))
      .add("general.name", GgufValue::str("seed"))
      .add("u8", GgufValue::u8(7)).add("i8", GgufValue::i8(-7))
      .add("u16", GgufValue::u16(700)).add("i16", GgufValue::i16(-700))
      .add("u32", GgufValue::u32(70000)).add("i32", GgufValue::i32(-70000))
      .add("f32", GgufValue::f32(0.5f)).add("bool", GgufValue::boolean(true))
      .add("u64", GgufValue::u64(1ull << 40)).add("i64", GgufValue::i64(-(1ll << 40)))
      .add("f64", GgufValue::f64(-2.25))
      .add("strings", GgufValue::str_array({"a", "bc", ""}))
      .add("nested", GgufValue::array(GgufType::Array, {GgufValue::str_array({"x"}),
                                                         GgufValue::array(GgufType::U8, {GgufValue::u8(1)})}));
  w.set_alignment(64);
  const std::vector<float> v = ramp(64);
  w.add_tensor("f32", DType::F32, {4, 2}, std::span<const float>(v.data(), 8));
  w.add_tensor("f16", DType::F16, {8}, std::span<const float>(v.data(), 8));
  w.add_tensor("bf16", DType::BF16, {2, 2, 2}, std::span<const float>(v.data(), 8));
  w.add_tensor("q8_0", DType::Q8_0, {32, 2}, std::span<const float>(v.data(), 64));
  w.add_tensor("q4_0", DType::Q4_0, {32}, std::span<const float>(v.data(), 32));
  w.add_tensor("q4_1", DType::Q4_1, {32, 1, 1, 1}, std::span<const float>(v.data(), 32));
  w.write(path);
}

// A tokenizer and chat template, no tensors: what Vocab::from_gguf and ChatTemplate read.
void write_vocabulary_file(const fs::path& path) {
  const TinyLlamaInfo vocab = tiny_llama_vocab();
  std::vector<std::int32_t> types(vocab.tokens.size(), 1);
  for (std::size_t i = 0; i < vocab.tokens.size(); ++i)
    if (vocab.tokens[i].starts_with("<|")) types[i] = 3;  // control
  GgufWriter w;
  w.add("general.architecture", GgufValue::str("llama"))
      .add("tokenizer.ggml.model", GgufValue::str("gpt2"))
      .add("tokenizer.ggml.pre", GgufValue::str("smollm"))
      .add("tokenizer.ggml.tokens", GgufValue::str_array(vocab.tokens))
      .add("tokenizer.ggml.token_type", GgufValue::i32_array(types))
      .add("tokenizer.ggml.merges", GgufValue::str_array(vocab.merges))
      .add("tokenizer.ggml.bos_token_id", GgufValue::u32(1))
      .add("tokenizer.ggml.eos_token_id", GgufValue::u32(2))
      .add("tokenizer.ggml.add_bos_token", GgufValue::boolean(false))
      .add("tokenizer.chat_template",
           GgufValue::str("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + "
                          "'<|im_end|>\n'}}{% endfor %}"));
  w.write(path);
}

std::string read_prefix(const fs::path& path, std::size_t n) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes(n, '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(n));
  bytes.resize(static_cast<std::size_t>(in.gcount()));
  return bytes;
}

// chat_template layout: flags byte, template, then NUL-separated role/content pairs.
std::string chat_input(bool generation_prompt, const std::string& tmpl,
                       const std::vector<std::pair<std::string, std::string>>& messages) {
  std::string out(1, generation_prompt ? '\x01' : '\x00');
  out += tmpl;
  for (const auto& [role, content] : messages) {
    out += '\0';
    out += role;
    out += '\0';
    out += content;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR [MODEL.gguf]\n", argv[0]);
    return 2;
  }
  const fs::path out = argv[1];
  fs::create_directories(out / "gguf");

  TinyLlamaOptions tiny;
  tiny.n_embd = 16;
  tiny.n_ff = 32;
  tiny.n_heads = 2;
  tiny.n_kv_heads = 1;
  tiny.n_layers = 1;
  tiny.context_length = 64;
  write_tiny_llama(out / "gguf/tiny_llama_f32.gguf", tiny);
  tiny.n_embd = 32;
  tiny.n_ff = 64;
  tiny.weight_dtype = DType::Q8_0;
  tiny.tied = true;
  write_tiny_llama(out / "gguf/tiny_llama_q8_tied.gguf", tiny);
  // The smallest model the loader takes: 4-wide embeddings, so that the file is mostly its
  // header and vocabulary (small inputs keep mutations effective).
  tiny = TinyLlamaOptions{};
  tiny.n_embd = 4;
  tiny.n_ff = 4;
  tiny.n_heads = 1;
  tiny.n_kv_heads = 1;
  tiny.n_layers = 1;
  tiny.context_length = 16;
  write_tiny_llama(out / "gguf/tiny_llama_4.gguf", tiny);
  write_vocabulary_file(out / "gguf/vocabulary_only.gguf");
  write_metadata_file(out / "gguf/metadata_types.gguf");
  GgufWriter().set_version(2).write(out / "gguf/empty_v2.gguf");

  const std::string smollm2_template =
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
      "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
      "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
      "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
      "{{ '<|im_start|>assistant\n' }}{% endif %}";
  const std::string qwen_template =
      "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] "
      "+ '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, it\\'s ' + \"nice.\" + "
      "'<|im_end|>\\n' -}}{%- endif %}{# a comment #}{% for m in messages %}{{'<|im_start|>' + m['role'] }}"
      "{% endfor %}{{ '\\x41\\u00e9\\U0001F600' }}";
  write_text(out / "chat_template/smollm2", chat_input(true, smollm2_template, {{"user", "Hi!"}, {"assistant", "Hello."}}));
  write_text(out / "chat_template/smollm2_system", chat_input(false, smollm2_template, {{"system", "Be brief."}, {"user", "2+2?"}}));
  write_text(out / "chat_template/qwen", chat_input(true, qwen_template, {{"user", "café 😀"}}));
  write_text(out / "chat_template/empty", chat_input(true, "", {{"user", "Hi"}}));

  if (argc > 2 && fs::exists(argv[2])) {
    // The start of a real file: its header and the first metadata, cut off (not valid alone).
    write_text(out / "gguf/model_head_4k.gguf", read_prefix(argv[2], 4096));
  }
  std::printf("seeds written to %s\n", out.c_str());
  return 0;
}
