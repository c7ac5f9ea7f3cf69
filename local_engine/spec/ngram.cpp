// N-gram lookup: the sequence's own prompt and output are the draft. Useful wherever the output
// copies its input (rewriting, extraction, code edits) and free everywhere else.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>

#include "batchlm/local_engine/spec.hpp"

namespace batchlm::local_engine {

namespace {

class NgramProposer final : public Proposer {
 public:
  NgramProposer(int ngram_min, int ngram_max) : min_(ngram_min), max_(ngram_max) {}

  void propose(std::span<const DraftRequest> requests, std::span<Draft> drafts) override {
    for (std::size_t i = 0; i < requests.size(); ++i) {
      drafts[i].tokens.clear();
      drafts[i].q.clear();
      drafts[i].evidence = lookup(requests[i].tokens, requests[i].max_tokens, drafts[i].tokens);
    }
  }

  bool runs_model() const override { return false; }

 private:
  // The most recent earlier occurrence of the longest suffix of `tokens` that has one; the
  // tokens that followed it, up to `max_tokens`. Returns the suffix's length (0: none found).
  int lookup(std::span<const Token> tokens, int max_tokens, std::vector<Token>& out) const {
    const auto n = static_cast<std::int64_t>(tokens.size());
    for (std::int64_t len = std::min<std::int64_t>(max_, n - 1); len >= min_; --len) {
      const std::span<const Token> suffix = tokens.subspan(static_cast<std::size_t>(n - len));
      // Occurrences starting at s, s + len <= n - 1, so that a token follows inside `tokens`.
      for (std::int64_t s = n - len - 1; s >= 0; --s) {
        if (tokens[static_cast<std::size_t>(s + len - 1)] != suffix.back()) continue;
        if (!std::equal(suffix.begin(), suffix.end(), tokens.begin() + s)) continue;
        const std::int64_t from = s + len;
        const std::int64_t count = std::min<std::int64_t>(max_tokens, n - from);
        out.assign(tokens.begin() + from, tokens.begin() + from + count);
        return static_cast<int>(len);
      }
    }
    return 0;
  }

  int min_, max_;
};

}  // namespace

std::unique_ptr<Proposer> make_ngram_proposer(int ngram_min, int ngram_max) {
  return std::make_unique<NgramProposer>(ngram_min, ngram_max);
}

}  // namespace batchlm::local_engine
