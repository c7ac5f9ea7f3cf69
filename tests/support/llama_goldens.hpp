#pragma once
// How far the engine may be from llama.cpp's goldens (tests/reference/make_goldens.py's
// generate.json), for the tests that compare them: reference_test (the default model) and
// kmix_reference_test (the default model requantized to the K types). Test programs define
// BATCHLM_SOURCE_DIR.
//
// llama.cpp is not bit-for-bit consistent with itself: its batched and token-by-token prompt
// paths add in different orders, and on these small quantized models that moves logits by up to
// a few tenths (the goldens record the spread per case as self_spread; it is 0 where a prompt
// is short enough for both paths to add alike). Any other order moves them as much, because a
// last-bit difference can flip the rounding of an activation when it is quantized to 8 bits for
// the next product. Our quantized dot products add in another order than llama.cpp's (each
// block's exact integer sum, then one FMA per block, where llama.cpp keeps 8 partial float sums
// per row): on the default model's prompts whose self_spread is 0 that moves the top logits by
// up to 0.18, and summing every product in double instead moves them by up to 0.40; our AVX2
// and portable paths, whose matrix products are the same bit for bit and whose attention sums
// differ in the last bits, are up to 0.8 apart on these prompts. So a case's spread is its
// self_spread, but at least the smallest nonzero self_spread of the goldens (what a second order
// does to these logits at the least); the tolerances are twice that plus a small margin, and a
// greedy step may differ only where llama.cpp's top two logits are closer than its largest
// spread plus 0.05 (near_tie).

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

namespace batchlm::testing {

// A golden file: `dir` / `name`.
inline nlohmann::json read_goldens(const std::filesystem::path& dir, const std::string& name) {
  const std::filesystem::path p = dir / name;
  std::ifstream f(p);
  if (!f) throw std::runtime_error("cannot read " + p.string());
  return nlohmann::json::parse(f);
}

// The largest difference allowed between a top logit of case `c` and llama.cpp's.
inline double tolerance(const nlohmann::json& goldens, const nlohmann::json& c) {
  double least = std::numeric_limits<double>::infinity();
  for (const auto& other : goldens["cases"]) {
    const double spread = other["self_spread"];
    if (spread > 0) least = std::min(least, spread);
  }
  if (least == std::numeric_limits<double>::infinity()) {
    throw std::runtime_error("goldens: no case measured a nonzero self_spread");
  }
  return 0.03 + 2.0 * std::max(c["self_spread"].get<double>(), least);
}

// A greedy step whose llama.cpp margin (top logit minus the second) is below this is a near-tie:
// another engine may take the other token there.
inline double near_tie(const nlohmann::json& goldens) {
  double spread = 0;
  for (const auto& c : goldens["cases"]) spread = std::max(spread, c["self_spread"].get<double>());
  return spread + 0.05;
}

}  // namespace batchlm::testing
