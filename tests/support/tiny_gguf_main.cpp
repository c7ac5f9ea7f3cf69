// tiny_gguf: writes the tiny Qwen3 (tests/support/gguf_writer.hpp tiny_qwen3_reference), the
// file llama.cpp's goldens in tests/reference/tiny-qwen3/ come from, or with --vocab PRE the
// vocabulary-only file of tests/reference/pretokenizers/ (byte_pair_vocab, tokenizer.ggml.pre
// PRE), and prints its sha256.

#include <exception>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>

#include "gguf_writer.hpp"
#include "requantize.hpp"

int main(int argc, char** argv) {
  CLI::App app{"Writes the tiny Qwen3 model that tests/reference/tiny-qwen3/'s goldens come from"};
  std::string out, pre;
  app.add_option("output", out, "The file to write (replaced)")->required();
  app.add_option("--vocab", pre,
                 "Write instead the byte-pair vocabulary alone with this tokenizer.ggml.pre "
                 "(tests/reference/pretokenizers/)");
  CLI11_PARSE(app, argc, argv);
  try {
    if (pre.empty()) {
      batchlm::testing::write_tiny_llama(out, batchlm::testing::tiny_qwen3_reference());
    } else {
      batchlm::testing::write_vocab_gguf(out, batchlm::testing::byte_pair_vocab(), pre);
    }
    std::cout << batchlm::testing::sha256_file(out) << "  " << out << "\n";
  } catch (const std::exception& e) {
    std::cerr << "tiny_gguf: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
