// requantize_gguf: writes the default model's rewritten copies (tests/support/requantize.hpp),
// the files llama.cpp's goldens in tests/reference/smollm2-135m-instruct-{kmix,qwen2,ropefreqs,phi3,phi3long,gemma2,gemma3}/
// come from, and prints the sha256 of the one written.

#include <exception>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "gguf_writer.hpp"
#include "requantize.hpp"

int main(int argc, char** argv) {
  CLI::App app{"Copies SmolLM2-135M's GGUF file with its matrices in Q5_0, Q5_1, Q4_K, Q5_K and Q6_K (kmix), "
               "as the qwen2 architecture with biases (qwen2), with rotary frequency factors (ropefreqs), "
               "as a long-context phi3 (phi3; phi3long, with an original context of 1024), or as gemma2 or gemma3 with sliding windows (gemma2, gemma3)"};
  std::string in, out, as = "kmix";
  float bias_scale = batchlm::testing::kSmolLM2Qwen2BiasScale;
  app.add_option("input", in, "The GGUF file to copy (models/SmolLM2-135M-Instruct.Q4_1.gguf)")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("output", out, "The file to write (replaced)")->required();
  app.add_option("--as", as, "Which copy: kmix, qwen2, ropefreqs, phi3, phi3long, gemma2 or gemma3")
      ->check(CLI::IsMember({"kmix", "qwen2", "ropefreqs", "phi3", "phi3long", "gemma2", "gemma3"}));
  app.add_option("--bias-scale", bias_scale, "qwen2: the biases' largest magnitude (0: zeros, the same network)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    namespace t = batchlm::testing;
    const auto file = batchlm::local_engine::gguf::File::open(in);
    const std::vector<std::byte> bytes = as == "qwen2"       ? t::as_qwen2(file, bias_scale)
                                         : as == "ropefreqs" ? t::with_rope_freqs(file, t::kSmolLM2RopeFreqsMax)
                                         : as == "phi3"      ? t::as_phi3(file, t::kSmolLM2Phi3ShortMax, t::kSmolLM2Phi3AttnFactor,
                                                                          t::kSmolLM2Phi3OriginalContext)
                                         : as == "phi3long"  ? t::as_phi3(file, t::kSmolLM2Phi3ShortMax, t::kSmolLM2Phi3AttnFactor,
                                                                          t::kSmolLM2Phi3LongOriginalContext, t::kSmolLM2Phi3LongScale)
                                         : as == "gemma3"    ? t::as_gemma(file, t::smollm2_gemma3())
                                         : as == "gemma2"    ? t::as_gemma(file, t::smollm2_gemma2())
                                                             : t::requantize(file, t::smollm2_kmix());
    t::write_file(out, bytes);
    std::cout << t::sha256_hex(bytes) << "  " << out << "\n";
  } catch (const std::exception& e) {
    std::cerr << "requantize_gguf: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
