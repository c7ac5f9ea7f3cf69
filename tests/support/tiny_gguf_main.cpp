// tiny_gguf: writes the tiny Qwen3 (tests/support/gguf_writer.hpp tiny_qwen3_reference), the
// file llama.cpp's goldens in tests/reference/tiny-qwen3/ come from, and prints its sha256.

#include <exception>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>

#include "gguf_writer.hpp"
#include "requantize.hpp"

int main(int argc, char** argv) {
  CLI::App app{"Writes the tiny Qwen3 model that tests/reference/tiny-qwen3/'s goldens come from"};
  std::string out;
  app.add_option("output", out, "The file to write (replaced)")->required();
  CLI11_PARSE(app, argc, argv);
  try {
    batchlm::testing::write_tiny_llama(out, batchlm::testing::tiny_qwen3_reference());
    std::cout << batchlm::testing::sha256_file(out) << "  " << out << "\n";
  } catch (const std::exception& e) {
    std::cerr << "tiny_gguf: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
