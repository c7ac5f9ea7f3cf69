// The verifier's rejection rule, the adaptive draft length and the speculative options.

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/spec.hpp"

namespace batchlm::local_engine {

std::string_view to_string(SpecMethod method) {
  switch (method) {
    case SpecMethod::kNone: return "none";
    case SpecMethod::kDraft: return "draft";
    case SpecMethod::kSelf: return "self";
    case SpecMethod::kNgram: return "ngram";
  }
  return "unknown";
}

std::optional<SpecMethod> parse_spec_method(std::string_view name) {
  for (SpecMethod m : {SpecMethod::kNone, SpecMethod::kDraft, SpecMethod::kSelf, SpecMethod::kNgram})
    if (name == to_string(m)) return m;
  return std::nullopt;
}

void validate(const SpeculativeOptions& o) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("speculative." + what); };
  if (o.k_max < 1 || o.k_max > 16)
    fail("k_max must be in 1..16, not " + std::to_string(o.k_max));
  if (o.k_min < 0 || o.k_min > o.k_max)
    fail("k_min must be in 0..k_max (" + std::to_string(o.k_max) + "), not " +
         std::to_string(o.k_min));
  if (o.ngram_min < 1 || o.ngram_min > 64)
    fail("ngram_min must be in 1..64, not " + std::to_string(o.ngram_min));
  if (o.ngram_max < o.ngram_min || o.ngram_max > 64)
    fail("ngram_max must be in ngram_min (" + std::to_string(o.ngram_min) + ")..64, not " +
         std::to_string(o.ngram_max));
  if (o.layers < 0) fail("layers must be >= 0, not " + std::to_string(o.layers));
  if (o.method == SpecMethod::kDraft && o.model.empty())
    fail("model: the draft method needs a draft model (speculative.model: PATH)");
}

void check_same_vocabulary(const Model& target, const Model& draft) {
  const auto& a = target.tokenizer().vocab();
  const auto& b = draft.tokenizer().vocab();
  const std::string names = draft.file().path().string() + " cannot draft for " +
                            target.file().path().string() + ": ";
  if (target.config().n_vocab != draft.config().n_vocab || a.tokens.size() != b.tokens.size())
    throw std::invalid_argument(names + "the vocabularies differ in size (" +
                                std::to_string(target.config().n_vocab) + " and " +
                                std::to_string(draft.config().n_vocab) + " tokens)");
  for (std::size_t i = 0; i < a.tokens.size(); ++i) {
    if (a.tokens[i] != b.tokens[i])
      throw std::invalid_argument(names + "token " + std::to_string(i) + " is '" + a.tokens[i] +
                                  "' in one and '" + b.tokens[i] + "' in the other");
  }
}

Verdict verify(Sampler& sampler, std::span<const float> logits, std::int64_t n_vocab,
               const Draft& draft) {
  const std::size_t n = draft.tokens.size();
  if (logits.size() < (n + 1) * static_cast<std::size_t>(n_vocab))
    throw std::invalid_argument("verify: fewer logits rows than drafts + 1");
  if (!draft.q.empty() && draft.q.size() != n)
    throw std::invalid_argument("verify: a draft with some but not all distributions");
  auto row = [&](std::size_t j) {
    return logits.subspan(j * static_cast<std::size_t>(n_vocab), static_cast<std::size_t>(n_vocab));
  };
  Verdict verdict;
  if (sampler.greedy() || draft.q.empty()) {
    // Each position's token is what decoding one token at a time picks there: the argmax, or
    // a draw from p with the request's next number; a draft stands where the pick equals it.
    // For drafts without a distribution (n-gram: q all on the guessed token) that is the
    // rejection rule (x accepted with probability p(x); otherwise a token from p without x),
    // and it gives token for token what sampling without drafts gives from the same seed.
    for (std::size_t j = 0; j <= n; ++j) {
      const Token token = sampler.greedy() ? static_cast<Token>(kernels::argmax(row(j).data(), n_vocab))
                                           : sampler.distribution(row(j)).draw(sampler.uniform());
      verdict.tokens.push_back(token);
      if (j == n || token != draft.tokens[j]) return verdict;
      ++verdict.accepted;
    }
    return verdict;
  }
  std::vector<double> q_of;  // the draft's probabilities by token id, when a rejection needs them
  for (std::size_t j = 0; j < n; ++j) {
    const TokenDistribution p = sampler.distribution(row(j));
    const Token x = draft.tokens[j];
    const double px = p.probability(x);
    const double qx = draft.q[j].probability(x);
    // Accept with probability min(1, p(x) / q(x)).
    if (sampler.uniform() * qx < px) {
      verdict.tokens.push_back(x);
      ++verdict.accepted;
      continue;
    }
    // Rejected: the next token comes from normalize(max(0, p - q)).
    TokenDistribution residual;
    q_of.assign(static_cast<std::size_t>(n_vocab), 0.0);
    const TokenDistribution& q = draft.q[j];
    for (std::size_t t = 0; t < q.tokens.size(); ++t)
      q_of[static_cast<std::size_t>(q.tokens[t])] += q.weights[t] / q.total;
    for (std::size_t t = 0; t < p.tokens.size(); ++t) {
      const double pt = p.weights[t] / p.total;
      const double qt = q_of[static_cast<std::size_t>(p.tokens[t])];
      const double w = pt - qt;
      if (w > 0.0) {
        residual.tokens.push_back(p.tokens[t]);
        residual.weights.push_back(w);
        residual.total += w;
      }
    }
    // p <= q everywhere only when p == q up to rounding, where rejection has probability ~0.
    verdict.tokens.push_back(residual.total > 0.0 ? residual.draw(sampler.uniform())
                                                  : p.draw(sampler.uniform()));
    return verdict;
  }
  verdict.tokens.push_back(sampler.distribution(row(n)).draw(sampler.uniform()));
  return verdict;
}

DraftLength::DraftLength(int k_min, int k_max) : k_min_(k_min), k_max_(k_max) {}

int DraftLength::wanted(double cost) {
  const double a = std::clamp(acceptance_, 0.0, 0.99);
  int best = k_min_;
  double best_value = -1.0;
  double expected = 0.0, power = 1.0;  // 1 + a + ... + a^k
  for (int k = 0; k <= k_max_; ++k) {
    expected += power;
    power *= a;
    if (k < k_min_) continue;
    const double value = expected / (1.0 + cost * k);
    if (value > best_value * 1.0001) {
      best_value = value;
      best = k;
    }
  }
  if (best > 0) {
    idle_steps_ = 0;
    return best;
  }
  if (++idle_steps_ >= 16) {
    idle_steps_ = 0;
    return 1;
  }
  return 0;
}

void DraftLength::update(int drafted, int accepted) {
  if (drafted <= 0) return;
  // Each draft up to and including the first rejected one was a trial.
  const int trials = accepted + (accepted < drafted ? 1 : 0);
  successes_ = 0.8 * successes_ + accepted;
  trials_ = 0.8 * trials_ + trials;
  acceptance_ = successes_ / trials_;
}

AcceptanceCurve::AcceptanceCurve(int k_max)
    : successes_(static_cast<std::size_t>(std::max(k_max, 1)), 1.0),
      trials_(static_cast<std::size_t>(std::max(k_max, 1)), 2.0) {}

double AcceptanceCurve::p(int i) const {
  const auto at = static_cast<std::size_t>(std::clamp(i, 1, static_cast<int>(trials_.size())) - 1);
  return successes_[at] / trials_[at];
}

int AcceptanceCurve::best(double cost, int k_min, int limit) {
  limit = std::min(limit, static_cast<int>(trials_.size()));
  if (limit <= 0) return 0;
  k_min = std::clamp(k_min, 0, limit);
  int best = k_min;
  double best_value = -1.0, expected = 1.0, survival = 1.0;
  for (int k = 0; k <= limit; ++k) {
    if (k > 0) {
      survival *= p(k);
      expected += survival;
    }
    if (k < k_min) continue;
    const double value = expected / (1.0 + cost * k);
    if (value > best_value * 1.0001) {
      best_value = value;
      best = k;
    }
  }
  if (best < limit && ++choices_ % 8 == 0) ++best;
  return best;
}

void AcceptanceCurve::update(int drafted, int accepted) {
  constexpr double kDecay = 0.97;
  drafted = std::min(drafted, static_cast<int>(trials_.size()));
  accepted = std::clamp(accepted, 0, drafted);
  // Drafts 1..accepted were accepted; draft accepted + 1, when there was one, was rejected.
  for (int i = 0; i < drafted && i <= accepted; ++i) {
    const auto at = static_cast<std::size_t>(i);
    successes_[at] = kDecay * successes_[at] + (i < accepted ? 1.0 : 0.0);
    trials_[at] = kDecay * trials_[at] + 1.0;
  }
}

}  // namespace batchlm::local_engine
