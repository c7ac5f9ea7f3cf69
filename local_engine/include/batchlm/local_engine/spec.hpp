#pragma once
// Speculative decoding. A proposer guesses the next few tokens of each decoding sequence
// cheaply; the target model scores the sequence's next token and the guesses in one batched
// pass (StepPlan::add_drafts); verify() keeps the guesses the rejection rule of Leviathan et al.
// (2023) / Chen et al. (2023) accepts and samples one more token, so the output follows the
// target's distribution exactly and, under greedy decoding, is the same token for token.
//
// Proposers:
//   ngram  the longest suffix of the sequence (ngram_max down to ngram_min tokens) found
//          earlier in its prompt or output; proposes what followed it there. No model.
//   draft  a second GGUF model with the target's vocabulary, run ahead with its own paged cache.
//   self   the target's own first `layers` layers, then its final norm and head (early exit).
// A model proposer's draft length adapts to each sequence's recent acceptance (DraftLength).
// N-gram lookup costs nothing, so it proposes while the step is planned and its drafts are cut
// to the length that pays for drafts of the same evidence (AcceptanceCurve).

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "batchlm/local_engine/executor.hpp"
#include "batchlm/local_engine/model.hpp"
#include "batchlm/local_engine/sampling.hpp"
#include "batchlm/local_engine/scheduler.hpp"

namespace batchlm::local_engine {

enum class SpecMethod { kNone, kDraft, kSelf, kNgram };
// "none", "draft", "self", "ngram".
std::string_view to_string(SpecMethod method);
std::optional<SpecMethod> parse_spec_method(std::string_view name);

struct SpeculativeOptions {
  SpecMethod method = SpecMethod::kNone;
  std::filesystem::path model;  // draft: a GGUF file with the target's vocabulary
  int layers = 0;               // self: layers of the target that draft; 0: a quarter of them
  int k_max = 4;                // most tokens drafted for a sequence in one step (1..16)
  int k_min = 0;                // fewest while it drafts; 0 lets a sequence stop drafting
  int ngram_max = 4;            // ngram: the longest suffix looked up
  int ngram_min = 1;            // ngram: the shortest
};

// Throws std::invalid_argument naming the first option out of range ("speculative.k_max ...").
void validate(const SpeculativeOptions& options);

// One decoding sequence to draft for.
struct DraftRequest {
  SequenceId id = 0;
  std::span<const Token> tokens;      // prompt + generated; the last one is not yet computed
  int max_tokens = 0;                 // >= 1
  const SamplingParams* sampling = nullptr;  // the request's; drafts follow the same rules
};

// What a proposer guessed: tokens, and the distribution each was drawn from. q is empty when
// the proposer has no distribution (n-gram lookup, greedy drafting): point masses.
struct Draft {
  std::vector<Token> tokens;
  std::vector<TokenDistribution> q;
  // How strong the guess is, in the proposer's terms (ngram: the length of the suffix it
  // matched); 0 when the proposer does not say.
  int evidence = 0;
};

class Proposer {
 public:
  virtual ~Proposer() = default;
  // Fills drafts[i] (cleared first) with at most requests[i].max_tokens tokens; fewer, or none,
  // when it has no good guess or no room.
  virtual void propose(std::span<const DraftRequest> requests, std::span<Draft> drafts) = 0;
  // The sequence is over: drop what is kept for it.
  virtual void forget(SequenceId /*id*/) {}
  // Whether drafting runs a model. Its time then counts against longer drafts, and it drafts
  // after the step is planned; a proposer without a model drafts while the step is planned,
  // and its drafts are cut by evidence.
  virtual bool runs_model() const = 0;
};

std::unique_ptr<Proposer> make_ngram_proposer(int ngram_min, int ngram_max);

// A proposer running `model` on `executor` (made for that model, with the layers it drafts
// with: all of a draft model's, the first few of the target's for self-drafting). It allocates
// the executor's pool: pool_tokens tokens in blocks of block_size, committed at once with
// commit_pool (Executor::commit_pool).
std::unique_ptr<Proposer> make_model_proposer(std::shared_ptr<const Model> model,
                                              std::unique_ptr<Executor> executor, int block_size,
                                              std::int64_t pool_tokens, bool commit_pool = false);

// Throws std::invalid_argument when `draft` cannot draft for `target`: a different vocabulary
// size, or the first token id whose text differs (both files named).
void check_same_vocabulary(const Model& target, const Model& draft);

// The tokens one verified entry yields: its first `accepted` drafts, then one token sampled
// from the target (the correction at the first rejection, or the bonus after all of them).
struct Verdict {
  std::vector<Token> tokens;
  int accepted = 0;
};

// Applies the rejection rule to `draft` given the target's logits at the entry's 1 + n rows
// (`logits` holds them one after another, n_vocab each), drawing from `sampler`'s generator.
// A greedy sampler accepts a draft exactly when it is the argmax, so the result equals
// decoding one token at a time. So does a sampled one with drafts that have no distribution
// (n-gram), against sampling on the host: each position's token is drawn from the target as
// without drafts (one number from the generator each), and a draft stands where the draw
// equals it.
Verdict verify(Sampler& sampler, std::span<const float> logits, std::int64_t n_vocab,
               const Draft& draft);

// A sequence's draft length. It keeps a moving estimate a of the chance that a draft is
// accepted and picks the k in [k_min, k_max] with the most expected tokens per unit of work,
// (1 - a^(k+1)) / (1 - a) / (1 + cost * k), where cost is the price of one drafted token
// relative to a target pass. When k = 0 wins, one draft is still tried every 16th step so the
// estimate can recover.
class DraftLength {
 public:
  DraftLength(int k_min, int k_max);
  int wanted(double cost);
  void update(int drafted, int accepted);
  double acceptance() const { return acceptance_; }

 private:
  int k_min_, k_max_;
  double successes_ = 1.4, trials_ = 2.0;  // decayed counts; the prior is 0.7
  double acceptance_ = 0.7;
  int idle_steps_ = 0;
};

// How far drafts of one kind get accepted, position by position: p(i) is the chance that
// draft i is accepted once drafts 1..i-1 were, from decayed counts (prior 1/2). Drafts whose
// acceptance is not geometric (an n-gram match either continues for a while or not at all)
// are cut by it: best() picks the k with the most expected tokens per unit of work,
// (1 + S(1) + ... + S(k)) / (1 + cost * k), S(i) = p(1) * ... * p(i). Every 8th choice that
// stops short of the limit drafts one more, so positions past the usual cut stay measured.
class AcceptanceCurve {
 public:
  explicit AcceptanceCurve(int k_max = 16);
  int best(double cost, int k_min, int limit);
  void update(int drafted, int accepted);
  double p(int i) const;  // i in 1..k_max

 private:
  std::vector<double> successes_, trials_;
  int choices_ = 0;
};

}  // namespace batchlm::local_engine
