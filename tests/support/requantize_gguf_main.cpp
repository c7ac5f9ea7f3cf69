// requantize_gguf: writes the default model's requantized copy (tests/support/requantize.hpp),
// the file llama.cpp's goldens in tests/reference/smollm2-135m-instruct-kmix/ come from, and
// prints its sha256.

#include <exception>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "gguf_writer.hpp"
#include "requantize.hpp"

int main(int argc, char** argv) {
  CLI::App app{"Copies SmolLM2-135M's GGUF file with its matrices in Q5_0, Q5_1, Q4_K, Q5_K and Q6_K"};
  std::string in, out;
  app.add_option("input", in, "The GGUF file to copy (models/SmolLM2-135M-Instruct.Q4_1.gguf)")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("output", out, "The file to write (replaced)")->required();
  CLI11_PARSE(app, argc, argv);

  try {
    const auto file = batchlm::local_engine::gguf::File::open(in);
    const std::vector<std::byte> bytes = batchlm::testing::requantize(file, batchlm::testing::smollm2_kmix());
    batchlm::testing::write_file(out, bytes);
    std::cout << batchlm::testing::sha256_hex(bytes) << "  " << out << "\n";
  } catch (const std::exception& e) {
    std::cerr << "requantize_gguf: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
