#pragma once
// The iteration-level scheduler of continuous batching. It never calls the model: the engine
// thread asks it for a StepPlan, runs one batched forward over the planned tokens, samples one
// token per entry that wants logits, and reports them back with complete():
//
//   while (!idle) {
//     StepPlan plan = scheduler.plan();
//     if (plan.empty()) { wait for requests; continue; }
//     logits = model.forward(plan.tokens, plan.positions, plan.sequence_of, block tables);
//     scheduler.complete(plan, sample(logits rows plan.logits_rows));
//     for (Finished& f : scheduler.take_finished()) reply(f);
//   }
//
// Speculative decoding: plan() may reserve room (budget and blocks) for up to k drafted tokens
// after a decoding sequence's token; the engine asks its proposer for them, adds them with
// StepPlan::add_drafts, has the model score every token of the entry, and reports how many of
// the drafts it accepted (StepResult::accepted). The rejected positions are rolled back: the
// sequence's computed length stops after the accepted ones and blocks past it are freed.
//
// One step: every running sequence in decode gets one token (its last sampled one), oldest
// first, then its draft reservation while the budget lasts; then sequences with prompt left to compute get chunks of at most prefill_chunk tokens
// within what is left of token_budget, running ones first, then waiting ones admitted in FIFO
// order while max_sequences, the budget and the KV blocks allow. A prompt's leading full blocks
// found in the prefix cache are taken instead of computed, and so are the first positions of
// the next block when a cached block under the same prefix starts with the same tokens: the plan
// then asks for that block to be copied (StepPlan::copies) before the forward pass.
//
// When the pool cannot supply a running sequence's blocks, the newest running sequence is
// preempted: its blocks are released and it goes back to the front of the waiting queue with
// prompt + generated tokens as the prompt to recompute (its published blocks usually make that
// a prefix-cache hit). The oldest running sequence therefore always makes progress, and one that
// cannot grow while alone in the pool is finished with FinishReason::kLength: no deadlock, no
// request lost. Every id add() returned comes out of take_finished() exactly once.
//
// Thread-compatible: the engine thread alone uses a scheduler. The scheduler must be the only
// user of its pool (check_invariants() compares the pool's reference counts with its tables).

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "batchlm/local_engine/kv_cache.hpp"

namespace batchlm::local_engine {

using Token = std::int32_t;  // as in tokenizer.hpp
using SequenceId = std::int64_t;

struct SchedulerOptions {
  int max_sequences = 64;            // running sequences at most (>= 1)
  std::int64_t token_budget = 512;   // tokens per step in all (>= max_sequences, so every
                                     // running decode gets its token each step)
  std::int64_t prefill_chunk = 512;  // prompt tokens of one sequence per step at most (>= 1)
};

enum class FinishReason { kStop, kLength, kCancelled };
// "stop", "length", "cancelled": the OpenAI finish_reason strings.
std::string_view to_string(FinishReason reason);

// One sequence's share of a step: tokens [token_offset, token_offset + n_tokens) of the plan's
// flat arrays, at positions first_position, first_position + 1, ...
struct PlannedSequence {
  SequenceId id = 0;
  std::int64_t first_position = 0;
  std::int64_t token_offset = 0;
  std::int64_t n_tokens = 0;
  // The last token is the sequence's last known token (a decode token or the final prefill
  // chunk): its logits give the next token, and complete() expects a StepResult for it.
  bool wants_logits = false;
  bool decode = false;  // a running sequence's next token (else a prompt chunk)
  // Decode entries: drafted tokens the plan reserved room for (budget and blocks), and those
  // add_drafts() put after the decode token (n_tokens counts them; every one of the entry's
  // tokens then wants logits).
  std::int32_t max_drafts = 0;
  std::int32_t n_drafts = 0;
  // Logits rows this entry owns in the forward's output (consecutive, in entry order).
  std::int64_t n_logits() const { return wants_logits ? 1 + n_drafts : 0; }
  // Block i holds positions [i*block_size, (i+1)*block_size); covers every planned position.
  // Valid until the next plan(), complete() or cancel().
  std::span<const BlockId> block_table;
};

struct StepPlan {
  std::uint64_t step = 0;                // complete() checks it is the latest plan
  std::vector<PlannedSequence> entries;  // decodes first, then prefill chunks
  // Flat arrays for one batched forward, T = total planned tokens.
  std::vector<Token> tokens;                // (T)
  std::vector<std::int64_t> positions;      // (T)
  std::vector<std::int32_t> sequence_of;    // (T) index into entries
  std::vector<std::int32_t> logits_rows;    // rows of tokens whose logits are wanted, in
                                            // entry order (n_logits() per entry)
  // Blocks to copy in every layer before the forward pass: a new sequence's first positions of
  // a block, held by a cached block with the same prefix. The scheduler keeps each `from`
  // block until complete().
  std::vector<BlockCopy> copies;
  bool empty() const { return entries.empty(); }
  // Puts drafts[i] (at most entries[i].max_drafts tokens) after entry i's decode token and
  // rebuilds the flat arrays. Once per plan, before the forward pass. Throws
  // std::invalid_argument when drafts has not one list per entry or one is too long.
  void add_drafts(std::span<const std::vector<Token>> drafts);
  std::span<const Token> tokens_of(const PlannedSequence& entry) const {
    return std::span<const Token>(tokens).subspan(static_cast<std::size_t>(entry.token_offset),
                                                  static_cast<std::size_t>(entry.n_tokens));
  }
};

// The sampled token of one entry that wanted logits, after the first `accepted` of the entry's
// drafts (kept as they were drafted). finished: the sampler saw a stop condition
// (end-of-sequence token, stop string) at `token`; every token reported is kept either way.
struct StepResult {
  SequenceId id = 0;
  Token token = 0;
  bool finished = false;
  std::int32_t accepted = 0;
};

struct Finished {
  SequenceId id = 0;
  std::vector<Token> generated;
  FinishReason reason = FinishReason::kStop;
  std::int64_t prompt_tokens = 0;  // of the original request
};

struct SchedulerStats {
  std::int64_t waiting = 0;
  std::int64_t running = 0;
  std::int64_t steps = 0;        // non-empty plans
  std::int64_t preemptions = 0;
  // Each prompt position counts once, computed or from the prefix cache, whichever came first
  // (the last prompt token computed alone counts as a prompt token too); positions computed
  // again after a preemption, prompt or generated, count as recomputed.
  std::int64_t prompt_tokens_computed = 0;  // prompt positions first computed
  std::int64_t prompt_tokens_cached = 0;    // prompt positions first taken from the prefix cache
  std::int64_t recomputed_tokens = 0;       // positions computed again after a preemption
  std::int64_t decode_tokens = 0;           // one per decoding sequence and step
  std::int64_t drafted_tokens = 0;          // drafts scored by the model
  std::int64_t accepted_tokens = 0;         // drafts accepted
  std::int64_t finished = 0;                // any reason, cancelled included
  std::int64_t blocks_used = 0;
  std::int64_t blocks_total = 0;
};

class Scheduler {
 public:
  // Throws std::invalid_argument on options out of range.
  Scheduler(BlockPool& pool, SchedulerOptions options);

  // Queues a request. Throws std::invalid_argument when the prompt is empty, longer than the
  // whole pool holds, or max_new_tokens < 1.
  SequenceId add(std::vector<Token> prompt, std::int64_t max_new_tokens);
  // Removes a waiting, running or preempted sequence, releasing its blocks at once, and reports
  // it as cancelled. Unknown or already finished ids are ignored. Between plan() and complete()
  // the entry is skipped by complete(); its blocks are only handed out again by the next plan().
  void cancel(SequenceId id);

  // How many tokens the engine would like to draft after a decoding sequence's next token.
  using DraftsWanted = std::function<int(SequenceId)>;

  // Plans one step; an empty plan when nothing can run. drafts_wanted (if set) is asked for
  // each decoding sequence; the reservation is capped by the budget left after every decode,
  // by free blocks (drafts never preempt anyone) and by max_new_tokens, so that accepting
  // every draft plus one token never passes it. Throws std::logic_error when the previous
  // non-empty plan has not been completed.
  StepPlan plan(const DraftsWanted& drafts_wanted = {});
  // Reports the step: one StepResult per entry that wanted logits (any order; entries of
  // sequences cancelled meanwhile may be left out). Throws std::invalid_argument when `plan` is
  // not the outstanding plan or a result is missing or unexpected, before changing anything.
  void complete(const StepPlan& plan, std::span<const StepResult> results);
  std::vector<Finished> take_finished();

  bool contains(SequenceId id) const { return sequences_.contains(id); }
  // Tokens generated so far by a live sequence (for streaming); throws std::out_of_range.
  const std::vector<Token>& generated(SequenceId id) const;
  // Prompt + generated tokens of a live sequence; throws std::out_of_range.
  const std::vector<Token>& tokens(SequenceId id) const;
  SchedulerStats stats() const;
  const SchedulerOptions& options() const { return options_; }
  // Throws std::logic_error describing the first broken invariant; O(sequences + blocks).
  void check_invariants() const;

 private:
  struct Sequence {
    SequenceId id = 0;
    std::vector<Token> tokens;  // prompt + generated: every known token
    std::int64_t prompt_tokens = 0;
    std::vector<Token> generated;
    std::int64_t max_new_tokens = 0;
    std::int64_t n_computed = 0;  // tokens whose K/V are in the blocks (0 while waiting)
    std::int64_t reached = 0;     // positions computed or cached before, preemptions included
    SequenceBlocks blocks;
    bool running = false;

    std::int64_t uncomputed() const {
      return static_cast<std::int64_t>(tokens.size()) - n_computed;
    }
  };
  struct Pick {  // a sequence's tokens in the step being planned
    Sequence* sequence;
    std::int64_t n_tokens;
    bool decode;
    std::int64_t drafts = 0;  // reserved after the decode token
  };

  // Counts the positions a planned pick computes: first-time prompt positions, generated ones,
  // or positions computed again after a preemption.
  void count_positions(Sequence& sequence, std::int64_t n_tokens);
  // Makes room for `n_tokens` more tokens of a running sequence, preempting the newest running
  // sequences as needed. With can_shrink, settles for fewer tokens rather than preempting.
  // Returns false when the sequence itself was preempted or finished instead.
  bool reserve(Sequence& sequence, std::int64_t& n_tokens, bool can_shrink,
               std::vector<Pick>& picks);
  std::int64_t tokens_that_fit(const Sequence& sequence) const;
  // Whether a running sequence is still to compute the block `sequence` needs next (the full
  // block after its `cached` tokens), with the same tokens up to its end.
  bool computing_next_block(const Sequence& sequence, std::int64_t cached) const;
  void preempt(Sequence& sequence, std::vector<Pick>& picks);
  void finish(Sequence& sequence, FinishReason reason);  // erases it
  void remove_running(SequenceId id);

  BlockPool& pool_;
  SchedulerOptions options_;
  std::unordered_map<SequenceId, Sequence> sequences_;  // live: waiting or running
  std::deque<SequenceId> waiting_;                       // FIFO, preempted ones at the front
  std::vector<SequenceId> running_;                      // ascending = arrival order
  std::vector<Finished> finished_;                       // until take_finished()
  SequenceId next_id_ = 1;
  std::uint64_t step_ = 0;
  bool outstanding_ = false;        // a non-empty plan awaits complete()
  std::vector<BlockCopy> copies_;   // the outstanding plan's; their `from` blocks are held
  bool preempted_in_step_ = false;  // plan() admits nobody in a step that preempted
  SchedulerStats counters_;   // the cumulative fields
};

}  // namespace batchlm::local_engine
