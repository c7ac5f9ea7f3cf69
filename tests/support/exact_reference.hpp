#pragma once
// The default model against its exact reference: tests/reference/exact_forward.py ran the
// network in float64 from the dequantized weights (keys and values rounded to F16, as every
// engine stores them) and wrote, for each prompt of the llama.cpp goldens, the greedy tokens,
// each step's margin (top logit minus the second) and the 64 largest logits after the prompt
// (tests/reference/smollm2-135m-instruct-q4_1/exact.json). llama.cpp's generate.json has the
// same shape (with 5 top logits), so it can be compared the same way.
//
// An executor is run teacher-forced along the exact tokens (the prompt in one batch, then each
// exact token alone), so every step is compared even after a near-tie: how far its logits are
// from the exact ones, and where its argmax is another token. Test programs define
// BATCHLM_SOURCE_DIR.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/executor.hpp"

namespace batchlm::testing {

// The default model's goldens: $BATCHLM_REFERENCE_DIR where set (a build run from another
// place, as on the GPU machine), else the source tree's.
inline std::filesystem::path reference_dir() {
  const char* env = std::getenv("BATCHLM_REFERENCE_DIR");
  if (env != nullptr && *env != '\0') return env;
  return std::filesystem::path(BATCHLM_SOURCE_DIR) / "tests/reference/smollm2-135m-instruct-q4_1";
}

// A golden file of that folder: exact.json, or llama.cpp's generate.json (same shape).
inline nlohmann::json read_reference(const std::string& name) {
  const std::filesystem::path p = reference_dir() / name;
  std::ifstream f(p);
  if (!f) throw std::runtime_error("cannot read " + p.string());
  return nlohmann::json::parse(f);
}

struct ExactAgreement {
  double top_error = 0;          // largest |logit - exact| over each prompt's 64 largest exact logits
  int steps = 0;                 // greedy steps compared
  int differing = 0;             // steps whose argmax is not the exact token
  double differing_margin = 0;   // the largest exact margin among those steps
};

// Every case of `ref` through `ex`, whose pool must hold 32 blocks of 16 positions (the
// longest case is 375 tokens). With `print`, one line per case, headed `what`. Margins are
// the reference's.
inline ExactAgreement compare_with_exact(local_engine::Executor& ex, const nlohmann::json& ref,
                                         std::int64_t n_vocab, bool print, const std::string& what) {
  std::vector<std::int32_t> table(32);
  std::iota(table.rbegin(), table.rend(), 0);  // blocks in reverse order: the table is used
  const std::vector<std::span<const std::int32_t>> tables = {table};
  std::vector<float> logits(static_cast<std::size_t>(n_vocab));
  ExactAgreement all;
  for (const auto& c : ref.at("cases")) {
    const std::vector<local_engine::Token> prompt = c.at("prompt_tokens");
    const std::vector<local_engine::Token> tokens = c.at("tokens");
    const std::vector<double> margins = c.at("margins");
    if (prompt.size() + tokens.size() > table.size() * 16)
      throw std::runtime_error("exact.json: case longer than the test's block table");
    ExactAgreement one;
    std::vector<local_engine::Token> fresh = prompt;
    std::int32_t done = 0;
    for (std::size_t step = 0; step < tokens.size(); ++step) {
      std::vector<std::int32_t> positions(fresh.size()), seq(fresh.size(), 0);
      std::iota(positions.begin(), positions.end(), done);
      const std::vector<std::int32_t> rows = {static_cast<std::int32_t>(fresh.size() - 1)};
      ex.forward(local_engine::Batch{fresh, positions, seq, tables, rows}, logits);
      if (step == 0) {
        for (const auto& top : c.at("top_logits")) {
          const double exact = top.at("logit");
          one.top_error = std::max(one.top_error, std::abs(logits[top.at("token").get<std::size_t>()] - exact));
        }
      }
      ++one.steps;
      if (kernels::argmax(logits.data(), n_vocab) != tokens[step]) {
        ++one.differing;
        one.differing_margin = std::max(one.differing_margin, margins[step]);
      }
      done += static_cast<std::int32_t>(fresh.size());
      fresh = {tokens[step]};
    }
    if (print)
      std::printf("[ case  ] %s, %s: top logits within %.4f; %d of %d steps differ (largest margin among them %.3f)\n",
                  what.c_str(), c.at("name").get<std::string>().c_str(), one.top_error, one.differing, one.steps,
                  one.differing_margin);
    all.top_error = std::max(all.top_error, one.top_error);
    all.steps += one.steps;
    all.differing += one.differing;
    all.differing_margin = std::max(all.differing_margin, one.differing_margin);
  }
  return all;
}

}  // namespace batchlm::testing
