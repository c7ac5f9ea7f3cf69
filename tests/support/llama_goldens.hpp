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
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/kernels/thread_pool.hpp"
#include "batchlm/local_engine/model.hpp"

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

// The prompt through a fresh cache, at most Model::kMaxBatch tokens a pass; the logits are the
// last token's.
inline void prefill(const local_engine::Model& model, std::span<const local_engine::Token> prompt,
                    local_engine::KvCache& cache, std::span<float> logits, kernels::ThreadPool& pool) {
  for (std::size_t at = 0; at < prompt.size(); at += local_engine::Model::kMaxBatch)
    model.forward(prompt.subspan(at, std::min<std::size_t>(local_engine::Model::kMaxBatch, prompt.size() - at)), cache,
                  logits, false, pool);
}

// Case c's top logits after its prompt (a fresh cache), each within `tolerance` of llama.cpp's,
// and the most likely token llama.cpp's unless its top two are closer than `tie`; a note line
// says how close they came.
inline void expect_top_logits(const local_engine::Model& model, const nlohmann::json& c, double tolerance,
                              double tie, kernels::ThreadPool& pool) {
  using local_engine::Token;
  const std::vector<Token> prompt = c["prompt_tokens"];
  local_engine::KvCache cache(model.config(), std::max<std::int64_t>(1024, c["prompt_tokens"].size() + c["tokens"].size() + 1));
  std::vector<float> logits(model.config().n_vocab);
  prefill(model, prompt, cache, logits, pool);
  double worst = 0;
  for (const auto& top : c["top_logits"]) {
    const double theirs = top["logit"];
    const double ours = logits[top["token"].get<int>()];
    worst = std::max(worst, std::fabs(ours - theirs));
    EXPECT_NEAR(ours, theirs, tolerance) << "case " << c["name"] << ", token " << top["token"];
  }
  std::printf("[ note ] case %s (%zu prompt tokens): top-5 logits within %.4f of llama.cpp's "
              "(llama.cpp's own spread %.4f)\n",
              c["name"].get<std::string>().c_str(), prompt.size(), worst, c["self_spread"].get<double>());
  if (c["margins"][0].get<double>() >= tie) {
    EXPECT_EQ(kernels::argmax(logits.data(), logits.size()), c["top_logits"][0]["token"].get<Token>())
        << "case " << c["name"];
  }
}

// Free running: greedy tokens from case c's prompt, each fed back, until one is not llama.cpp's
// or all of its tokens are matched. The first to differ must be at a near-tie (llama.cpp's
// margin below `tie`); a note line says where. Returns whether all matched.
inline bool expect_greedy_continuation(const local_engine::Model& model, const nlohmann::json& c, double tie,
                                       kernels::ThreadPool& pool) {
  using local_engine::Token;
  const std::vector<Token> prompt = c["prompt_tokens"];
  const std::vector<Token> expected = c["tokens"];
  const std::vector<double> margins = c["margins"];
  local_engine::KvCache cache(model.config(), std::max<std::int64_t>(1024, c["prompt_tokens"].size() + c["tokens"].size() + 1));
  std::vector<float> logits(model.config().n_vocab);
  prefill(model, prompt, cache, logits, pool);
  std::vector<Token> got;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const Token t = static_cast<Token>(kernels::argmax(logits.data(), logits.size()));
    got.push_back(t);
    if (t != expected[i]) break;
    const Token one[1] = {t};
    model.forward(one, cache, logits, false, pool);
  }
  if (got == expected) return true;
  const std::size_t at = got.size() - 1;
  EXPECT_LT(margins[at], tie) << "case " << c["name"] << " diverges at token " << at << ": got " << got[at]
                              << ", llama.cpp " << expected[at] << " (llama.cpp's margin " << margins[at] << ")";
  std::printf("[ note ] case %s: identical for %zu tokens, then a near-tie (margin %.4f, bound %.3f)\n",
              c["name"].get<std::string>().c_str(), at, margins[at], tie);
  return false;
}

}  // namespace batchlm::testing
