// Drafting with a model: a second GGUF with the target's vocabulary, or the target's own first
// layers (early exit). Each sequence keeps its keys and values in the proposer's own paged pool;
// before drafting, the cached tokens are compared with the sequence's tokens, so rejected
// drafts are rolled back and accepted ones (and the target's corrections) caught up in one
// batched pass over every sequence. Full blocks of final tokens are published for prefix reuse,
// so sequences with a common prompt prefix share it here too.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/kv_cache.hpp"
#include "batchlm/local_engine/spec.hpp"

namespace batchlm::local_engine {

namespace {

class ModelProposer final : public Proposer {
 public:
  ModelProposer(std::shared_ptr<const Model> model, std::unique_ptr<Executor> executor,
                int block_size, std::int64_t pool_tokens, bool commit_pool)
      : model_(std::move(model)),
        executor_(std::move(executor)),
        pool_(BlockPoolOptions{block_size, (pool_tokens + block_size - 1) / block_size}) {
    executor_->allocate_pool(block_size, pool_.n_blocks());
    if (commit_pool) executor_->commit_pool();
  }

  bool runs_model() const override { return true; }

  void forget(SequenceId id) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    it->second.blocks.release_all(pool_);
    sequences_.erase(it);
  }

  void propose(std::span<const DraftRequest> requests, std::span<Draft> drafts) override {
    const std::int64_t n_vocab = model_->config().n_vocab;
    struct Work {
      std::size_t index;    // into requests
      State* state;
      std::int64_t next;    // first token of the request not yet computed here
      int drafted = 0;
    };
    std::vector<Work> work;
    for (std::size_t i = 0; i < requests.size(); ++i) {
      drafts[i].tokens.clear();
      drafts[i].q.clear();
      const DraftRequest& r = requests[i];
      if (r.max_tokens < 1 || r.tokens.empty()) continue;
      State& s = sync(r);
      // Room for the request's tokens and every draft but the last (which is never computed).
      const auto needed = static_cast<std::int64_t>(r.tokens.size()) + r.max_tokens - 1;
      if (!s.blocks.ensure_capacity(pool_, needed)) {
        forget(r.id);  // no room now: start afresh next time
        continue;
      }
      work.push_back({i, &sequences_.at(r.id), static_cast<std::int64_t>(s.cached.size())});
    }
    if (work.empty()) return;

    // Catch up: every uncomputed token of every sequence, in passes of at most kMaxBatch tokens;
    // the pass that computes a sequence's last token gives its first draft.
    std::size_t w = 0;
    while (w < work.size()) {
      clear_batch();
      std::int64_t room = Model::kMaxBatch;
      std::vector<std::size_t> finishing;  // work items whose last token is in this pass
      while (w < work.size() && room > 0) {
        Work& item = work[w];
        const DraftRequest& r = requests[item.index];
        const auto end = static_cast<std::int64_t>(r.tokens.size());
        const std::int64_t count = std::min(end - item.next, room);
        add_to_batch(*item.state, r.tokens.subspan(static_cast<std::size_t>(item.next),
                                                   static_cast<std::size_t>(count)),
                     item.next, item.next + count == end);
        item.next += count;
        room -= count;
        if (item.next == end) {
          finishing.push_back(w);
          ++w;
        }
      }
      run_batch();
      for (std::size_t f = 0; f < finishing.size(); ++f) {
        Work& item = work[finishing[f]];
        const DraftRequest& r = requests[item.index];
        item.state->cached.assign(r.tokens.begin(), r.tokens.end());
        item.state->blocks.commit_full_blocks(pool_, r.tokens);
        draw(*item.state, logits_row(f, n_vocab), drafts[item.index]);
        item.drafted = 1;
      }
      // Sequences cut by the end of the pass have their computed part recorded.
      if (w < work.size() && work[w].next > static_cast<std::int64_t>(work[w].state->cached.size())) {
        const DraftRequest& r = requests[work[w].index];
        work[w].state->cached.assign(r.tokens.begin(), r.tokens.begin() + work[w].next);
      }
    }

    // Then one token per round for the sequences that want more drafts.
    for (;;) {
      clear_batch();
      std::vector<std::size_t> drafting;
      for (std::size_t i = 0; i < work.size(); ++i) {
        Work& item = work[i];
        const DraftRequest& r = requests[item.index];
        if (item.drafted == 0 || item.drafted >= r.max_tokens) continue;
        const Token last = drafts[item.index].tokens.back();
        const Token one[1] = {last};
        add_to_batch(*item.state, one, static_cast<std::int64_t>(item.state->cached.size()), true);
        item.state->cached.push_back(last);
        drafting.push_back(i);
      }
      if (drafting.empty()) break;
      run_batch();
      for (std::size_t f = 0; f < drafting.size(); ++f) {
        Work& item = work[drafting[f]];
        draw(*item.state, logits_row(f, n_vocab), drafts[item.index]);
        ++item.drafted;
      }
    }
  }

 private:
  struct State {
    explicit State(int block_size) : blocks(block_size) {}
    SequenceBlocks blocks;
    std::vector<Token> cached;  // the tokens whose keys and values the blocks hold, in order
    std::unique_ptr<Sampler> sampler;
  };

  // The sequence's state, rolled back to the longest prefix its cache shares with the request.
  State& sync(const DraftRequest& r) {
    auto [it, fresh] = sequences_.try_emplace(r.id, pool_.block_size());
    State& s = it->second;
    if (fresh) {
      // Drafts are drawn from the draft's distribution with the request's rules but from a
      // generator of their own, so the target's generator sees the same stream either way.
      SamplingParams params = r.sampling ? *r.sampling : SamplingParams{.temperature = 0.0f};
      params.seed = params.seed * 0x9e3779b97f4a7c15ULL + 0x5bd1e995ULL;
      s.sampler = std::make_unique<Sampler>(params);
    }
    // At least the last token is computed again, for its logits.
    const std::size_t limit = std::min(s.cached.size(), r.tokens.size() - 1);
    std::size_t keep = 0;
    while (keep < limit && s.cached[keep] == r.tokens[keep]) ++keep;
    s.cached.resize(keep);
    s.blocks.truncate(pool_, static_cast<std::int64_t>(keep));
    if (s.blocks.table().empty()) {
      const std::int64_t cached = s.blocks.acquire_prefix(pool_, r.tokens);
      s.cached.assign(r.tokens.begin(), r.tokens.begin() + cached);
    }
    return s;
  }

  void draw(State& s, std::span<const float> logits, Draft& out) {
    if (s.sampler->greedy()) {
      out.tokens.push_back(static_cast<Token>(kernels::argmax(logits.data(), logits.size())));
      return;
    }
    TokenDistribution q = s.sampler->distribution(logits);
    out.tokens.push_back(q.draw(s.sampler->uniform()));
    out.q.push_back(std::move(q));
  }

  void clear_batch() {
    tokens_.clear();
    positions_.clear();
    sequence_of_.clear();
    tables_.clear();
    rows_.clear();
  }

  void add_to_batch(const State& s, std::span<const Token> tokens, std::int64_t first_position,
                    bool wants_logits) {
    const auto index = static_cast<std::int32_t>(tables_.size());
    tables_.push_back(s.blocks.table());
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      tokens_.push_back(tokens[i]);
      positions_.push_back(static_cast<std::int32_t>(first_position + static_cast<std::int64_t>(i)));
      sequence_of_.push_back(index);
    }
    if (wants_logits) rows_.push_back(static_cast<std::int32_t>(tokens_.size() - 1));
  }

  void run_batch() {
    logits_.resize(rows_.size() * static_cast<std::size_t>(model_->config().n_vocab));
    executor_->forward(Batch{tokens_, positions_, sequence_of_, tables_, rows_}, logits_);
  }

  std::span<const float> logits_row(std::size_t row, std::int64_t n_vocab) const {
    return std::span<const float>(logits_).subspan(row * static_cast<std::size_t>(n_vocab),
                                                   static_cast<std::size_t>(n_vocab));
  }

  std::shared_ptr<const Model> model_;
  std::unique_ptr<Executor> executor_;
  BlockPool pool_;
  std::unordered_map<SequenceId, State> sequences_;
  std::vector<Token> tokens_;
  std::vector<std::int32_t> positions_, sequence_of_, rows_;
  std::vector<std::span<const std::int32_t>> tables_;
  std::vector<float> logits_;
};

}  // namespace

std::unique_ptr<Proposer> make_model_proposer(std::shared_ptr<const Model> model,
                                              std::unique_ptr<Executor> executor, int block_size,
                                              std::int64_t pool_tokens, bool commit_pool) {
  return std::make_unique<ModelProposer>(std::move(model), std::move(executor), block_size,
                                         pool_tokens, commit_pool);
}

}  // namespace batchlm::local_engine
