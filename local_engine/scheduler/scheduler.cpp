#include "batchlm/local_engine/scheduler.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace batchlm::local_engine {

std::string_view to_string(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "unknown";
}

Scheduler::Scheduler(BlockPool& pool, SchedulerOptions options)
    : pool_(pool), options_(options) {
  if (options.max_sequences < 1)
    throw std::invalid_argument("Scheduler: max_sequences must be >= 1");
  if (options.prefill_chunk < 1)
    throw std::invalid_argument("Scheduler: prefill_chunk must be >= 1");
  // Below max_sequences some running decodes would wait a step for budget, and the newest
  // ones could starve while older ones keep decoding.
  if (options.token_budget < options.max_sequences)
    throw std::invalid_argument("Scheduler: token_budget (" +
                                std::to_string(options.token_budget) +
                                ") must be >= max_sequences (" +
                                std::to_string(options.max_sequences) + ")");
}

SequenceId Scheduler::add(std::vector<Token> prompt, std::int64_t max_new_tokens) {
  if (prompt.empty()) throw std::invalid_argument("Scheduler: empty prompt");
  if (max_new_tokens < 1)
    throw std::invalid_argument("Scheduler: max_new_tokens must be >= 1, got " +
                                std::to_string(max_new_tokens));
  const std::int64_t capacity = pool_.n_blocks() * pool_.block_size();
  if (static_cast<std::int64_t>(prompt.size()) > capacity)
    throw std::invalid_argument("Scheduler: prompt of " + std::to_string(prompt.size()) +
                                " tokens can never fit the KV cache of " +
                                std::to_string(pool_.n_blocks()) + " blocks x " +
                                std::to_string(pool_.block_size()) + " tokens = " +
                                std::to_string(capacity) + " tokens");
  const SequenceId id = next_id_++;
  Sequence sequence{.id = id,
                    .tokens = std::move(prompt),
                    .prompt_tokens = 0,
                    .generated = {},
                    .max_new_tokens = max_new_tokens,
                    .n_computed = 0,
                    .blocks = SequenceBlocks(pool_.block_size()),
                    .running = false};
  sequence.prompt_tokens = static_cast<std::int64_t>(sequence.tokens.size());
  sequences_.emplace(id, std::move(sequence));
  waiting_.push_back(id);
  return id;
}

bool Scheduler::computing_next_block(const Sequence& sequence, std::int64_t cached) const {
  const std::int64_t end = cached + pool_.block_size();
  if (end > std::ssize(sequence.tokens)) return false;
  for (const SequenceId id : running_) {
    const Sequence& other = sequences_.at(id);
    if (other.n_computed >= end || std::ssize(other.tokens) < end) continue;
    if (std::equal(sequence.tokens.begin(), sequence.tokens.begin() + end, other.tokens.begin())) return true;
  }
  return false;
}

void Scheduler::cancel(SequenceId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return;
  finish(it->second, FinishReason::kCancelled);
}

void Scheduler::remove_running(SequenceId id) {
  auto it = std::lower_bound(running_.begin(), running_.end(), id);
  if (it == running_.end() || *it != id)
    throw std::logic_error("Scheduler: sequence " + std::to_string(id) + " is not running");
  running_.erase(it);
}

void Scheduler::finish(Sequence& sequence, FinishReason reason) {
  const SequenceId id = sequence.id;
  sequence.blocks.release_all(pool_);
  if (sequence.running) {
    remove_running(id);
  } else {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), id));
  }
  finished_.push_back({.id = id,
                       .generated = std::move(sequence.generated),
                       .reason = reason,
                       .prompt_tokens = sequence.prompt_tokens});
  ++counters_.finished;
  sequences_.erase(id);  // `sequence` dangles from here
}

void Scheduler::preempt(Sequence& sequence, std::vector<Pick>& picks) {
  // Its tokens of this step are dropped, and its budget goes back to the others.
  std::erase_if(picks, [&](const Pick& pick) { return pick.sequence == &sequence; });
  // Prompt + generated becomes the prompt to recompute; the published blocks stay cached, so
  // readmission usually finds most of them again.
  sequence.blocks.release_all(pool_);
  sequence.n_computed = 0;
  sequence.running = false;
  remove_running(sequence.id);
  waiting_.push_front(sequence.id);
  ++counters_.preemptions;
  preempted_in_step_ = true;
}

void Scheduler::count_positions(Sequence& sequence, std::int64_t n_tokens) {
  const std::int64_t first = sequence.n_computed, end = first + n_tokens;
  const std::int64_t again = std::max<std::int64_t>(0, std::min(end, sequence.reached) - first);
  const std::int64_t fresh = n_tokens - again;
  const std::int64_t fresh_prompt =
      std::max<std::int64_t>(0, std::min(end, sequence.prompt_tokens) - std::max(first, sequence.reached));
  counters_.recomputed_tokens += again;
  counters_.prompt_tokens_computed += fresh_prompt;
  counters_.decode_tokens += fresh - fresh_prompt;
  sequence.reached = std::max(sequence.reached, end);
}

std::int64_t Scheduler::tokens_that_fit(const Sequence& sequence) const {
  return sequence.blocks.capacity_tokens() + pool_.available() * pool_.block_size() -
         sequence.n_computed;
}

bool Scheduler::reserve(Sequence& sequence, std::int64_t& n_tokens, bool can_shrink,
                        std::vector<Pick>& picks) {
  for (;;) {
    if (sequence.blocks.ensure_capacity(pool_, sequence.n_computed + n_tokens)) return true;
    if (can_shrink) {
      const std::int64_t fit = tokens_that_fit(sequence);
      if (fit >= 1) {
        n_tokens = std::min(n_tokens, fit);
        if (!sequence.blocks.ensure_capacity(pool_, sequence.n_computed + n_tokens))
          throw std::logic_error("Scheduler: blocks that fit could not be allocated");
        return true;
      }
    }
    Sequence& newest = sequences_.at(running_.back());
    if (&newest != &sequence) {
      preempt(newest, picks);
      continue;
    }
    if (running_.size() == 1) {
      // Alone, with every other block free or cached: the pool is too small for it to grow.
      finish(sequence, FinishReason::kLength);
      return false;
    }
    preempt(sequence, picks);  // the newest gives way to the older ones
    return false;
  }
}

StepPlan Scheduler::plan(const DraftsWanted& drafts_wanted) {
  if (outstanding_)
    throw std::logic_error("Scheduler: plan() before complete() of step " +
                           std::to_string(step_));
  preempted_in_step_ = false;
  std::vector<Pick> picks;
  auto budget_left = [&] {
    std::int64_t planned = 0;
    for (const Pick& pick : picks) planned += pick.n_tokens + pick.drafts;
    return options_.token_budget - planned;
  };

  // 1. Decodes, oldest first: one token each, its last sampled one. A snapshot, since
  // preemption and finishing edit running_.
  const std::vector<SequenceId> decoding = running_;
  for (SequenceId id : decoding) {
    auto it = sequences_.find(id);
    if (it == sequences_.end() || !it->second.running || it->second.uncomputed() != 1)
      continue;
    if (budget_left() < 1) break;  // unreachable while token_budget >= max_sequences
    std::int64_t n_tokens = 1;
    if (reserve(it->second, n_tokens, /*can_shrink=*/false, picks))
      picks.push_back({&it->second, n_tokens, /*decode=*/true});
  }

  // 1b. Room for drafts after the decode tokens, oldest first, from the budget left and the
  // blocks free now: a draft is a guess, never worth preempting anyone. Accepting all of them
  // and sampling one more token must not pass max_new_tokens.
  if (drafts_wanted) {
    for (Pick& pick : picks) {
      Sequence& sequence = *pick.sequence;
      const std::int64_t room_to_max =
          sequence.max_new_tokens - std::ssize(sequence.generated) - 1;
      std::int64_t drafts =
          std::min({static_cast<std::int64_t>(std::max(drafts_wanted(sequence.id), 0)),
                    budget_left(), room_to_max, tokens_that_fit(sequence) - 1});
      if (drafts < 1) continue;
      if (!sequence.blocks.ensure_capacity(pool_, sequence.n_computed + 1 + drafts))
        throw std::logic_error("Scheduler: draft blocks that fit could not be allocated");
      pick.drafts = drafts;
    }
  }

  // 2. Prefill chunks of running sequences, oldest first.
  const std::vector<SequenceId> prefilling = running_;
  for (SequenceId id : prefilling) {
    auto it = sequences_.find(id);
    if (it == sequences_.end() || !it->second.running || it->second.uncomputed() <= 1) continue;
    const std::int64_t left = budget_left();
    if (left < 1) break;
    std::int64_t n_tokens = std::min({it->second.uncomputed(), options_.prefill_chunk, left});
    if (reserve(it->second, n_tokens, /*can_shrink=*/true, picks))
      picks.push_back({&it->second, n_tokens, /*decode=*/false});
  }

  // 3. Admission in FIFO order. Not in a step that preempted: the blocks just freed went to
  // older sequences, and readmitting the victim at once would only thrash.
  while (!preempted_in_step_ && !waiting_.empty() &&
         std::ssize(running_) < options_.max_sequences && budget_left() >= 1) {
    Sequence& sequence = sequences_.at(waiting_.front());
    const std::int64_t whole_blocks = sequence.blocks.acquire_prefix(pool_, sequence.tokens);
    if (computing_next_block(sequence, whole_blocks)) {
      // It waits (a step, or as many as that sequence's prefill takes) and then takes the block
      // from the prefix cache instead of computing it a second time: the n choices of one
      // request, or requests arriving together with a shared prefix. FIFO: the rest wait too.
      sequence.blocks.release_all(pool_);
      break;
    }
    const std::int64_t cached = sequence.blocks.acquire_partial(pool_, sequence.tokens);
    sequence.n_computed = cached;
    std::int64_t n_tokens =
        std::min({sequence.uncomputed(), options_.prefill_chunk, budget_left()});
    if (!sequence.blocks.ensure_capacity(pool_, cached + n_tokens)) {
      n_tokens = std::min(n_tokens, tokens_that_fit(sequence));
      if (n_tokens < 1 || !sequence.blocks.ensure_capacity(pool_, cached + n_tokens)) {
        sequence.blocks.release_all(pool_);
        sequence.n_computed = 0;
        if (running_.empty()) {
          // The whole pool cannot hold even its first uncomputed token (a recomputation of
          // prompt + generated as long as the cache): it would wait forever.
          finish(sequence, FinishReason::kLength);
          continue;
        }
        break;  // FIFO: nobody overtakes the head of the queue
      }
    }
    waiting_.pop_front();
    sequence.running = true;
    running_.insert(std::upper_bound(running_.begin(), running_.end(), sequence.id),
                    sequence.id);
    // Cached positions it held before a preemption are not new hits.
    counters_.prompt_tokens_cached += std::max<std::int64_t>(0, cached - sequence.reached);
    sequence.reached = std::max(sequence.reached, cached);
    if (const std::optional<BlockCopy> copy = sequence.blocks.take_copy()) copies_.push_back(*copy);
    picks.push_back({&sequence, n_tokens, /*decode=*/false});
  }

  StepPlan plan;
  if (picks.empty()) return plan;
  plan.step = ++step_;
  outstanding_ = true;
  plan.copies = copies_;
  ++counters_.steps;
  plan.entries.reserve(picks.size());
  for (const Pick& pick : picks) {
    const Sequence& sequence = *pick.sequence;
    const auto entry_index = static_cast<std::int32_t>(plan.entries.size());
    const auto offset = static_cast<std::int64_t>(plan.tokens.size());
    const bool wants_logits =
        sequence.n_computed + pick.n_tokens == static_cast<std::int64_t>(sequence.tokens.size());
    plan.entries.push_back({.id = sequence.id,
                            .first_position = sequence.n_computed,
                            .token_offset = offset,
                            .n_tokens = pick.n_tokens,
                            .wants_logits = wants_logits,
                            .decode = pick.decode,
                            .max_drafts = static_cast<std::int32_t>(pick.drafts),
                            .n_drafts = 0,
                            .block_table = sequence.blocks.table()});
    for (std::int64_t i = 0; i < pick.n_tokens; ++i) {
      const std::int64_t position = sequence.n_computed + i;
      plan.tokens.push_back(sequence.tokens[static_cast<std::size_t>(position)]);
      plan.positions.push_back(position);
      plan.sequence_of.push_back(entry_index);
    }
    if (wants_logits)
      plan.logits_rows.push_back(static_cast<std::int32_t>(offset + pick.n_tokens - 1));
    count_positions(*pick.sequence, pick.n_tokens);
  }
  return plan;
}

void StepPlan::add_drafts(std::span<const std::vector<Token>> drafts) {
  if (drafts.size() != entries.size())
    throw std::invalid_argument("StepPlan::add_drafts: " + std::to_string(drafts.size()) +
                                " draft lists for " + std::to_string(entries.size()) +
                                " entries");
  for (std::size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].n_drafts != 0)
      throw std::invalid_argument("StepPlan::add_drafts: drafts were already added");
    if (std::ssize(drafts[i]) > entries[i].max_drafts)
      throw std::invalid_argument("StepPlan::add_drafts: " + std::to_string(drafts[i].size()) +
                                  " drafts for sequence " + std::to_string(entries[i].id) +
                                  ", which has room for " +
                                  std::to_string(entries[i].max_drafts));
  }
  std::vector<Token> new_tokens;
  std::vector<std::int64_t> new_positions;
  std::vector<std::int32_t> new_sequence_of, new_rows;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    PlannedSequence& entry = entries[i];
    const auto offset = static_cast<std::int64_t>(new_tokens.size());
    for (std::int64_t j = 0; j < entry.n_tokens; ++j) {
      new_tokens.push_back(tokens[static_cast<std::size_t>(entry.token_offset + j)]);
      new_positions.push_back(positions[static_cast<std::size_t>(entry.token_offset + j)]);
    }
    for (std::size_t j = 0; j < drafts[i].size(); ++j) {
      new_tokens.push_back(drafts[i][j]);
      new_positions.push_back(entry.first_position + entry.n_tokens + static_cast<std::int64_t>(j));
    }
    entry.token_offset = offset;
    entry.n_drafts = static_cast<std::int32_t>(drafts[i].size());
    entry.n_tokens += entry.n_drafts;
    new_sequence_of.insert(new_sequence_of.end(), static_cast<std::size_t>(entry.n_tokens),
                           static_cast<std::int32_t>(i));
    const std::int64_t end = offset + entry.n_tokens;
    for (std::int64_t row = end - entry.n_logits(); row < end; ++row)
      new_rows.push_back(static_cast<std::int32_t>(row));
  }
  tokens = std::move(new_tokens);
  positions = std::move(new_positions);
  sequence_of = std::move(new_sequence_of);
  logits_rows = std::move(new_rows);
}

void Scheduler::complete(const StepPlan& plan, std::span<const StepResult> results) {
  if (!outstanding_ || plan.step != step_)
    throw std::invalid_argument("Scheduler: complete() of step " + std::to_string(plan.step) +
                                ", which is not the outstanding plan");
  // Validate everything before changing anything.
  std::unordered_map<SequenceId, const StepResult*> result_of;
  for (const StepResult& result : results) {
    const bool expected = std::any_of(plan.entries.begin(), plan.entries.end(),
                                      [&](const PlannedSequence& entry) {
                                        return entry.id == result.id && entry.wants_logits;
                                      });
    if (!expected)
      throw std::invalid_argument("Scheduler: result for sequence " + std::to_string(result.id) +
                                  ", which wanted no logits in step " +
                                  std::to_string(plan.step));
    if (!result_of.emplace(result.id, &result).second)
      throw std::invalid_argument("Scheduler: two results for sequence " +
                                  std::to_string(result.id));
    const auto entry = std::find_if(plan.entries.begin(), plan.entries.end(),
                                    [&](const PlannedSequence& e) { return e.id == result.id; });
    if (result.accepted < 0 || result.accepted > entry->n_drafts)
      throw std::invalid_argument("Scheduler: sequence " + std::to_string(result.id) +
                                  " accepted " + std::to_string(result.accepted) + " of " +
                                  std::to_string(entry->n_drafts) + " drafts");
  }
  for (const PlannedSequence& entry : plan.entries) {
    if (entry.wants_logits && sequences_.contains(entry.id) && !result_of.contains(entry.id))
      throw std::invalid_argument("Scheduler: no result for sequence " +
                                  std::to_string(entry.id) + " in step " +
                                  std::to_string(plan.step));
  }

  outstanding_ = false;
  // The copies were made before the forward pass: the blocks they came from are let go.
  for (const BlockCopy& copy : std::exchange(copies_, {})) pool_.release(copy.from);
  for (const PlannedSequence& entry : plan.entries) {
    auto it = sequences_.find(entry.id);
    if (it == sequences_.end()) continue;  // cancelled since plan()
    Sequence& sequence = it->second;
    if (sequence.n_computed != entry.first_position)
      throw std::logic_error("Scheduler: sequence " + std::to_string(entry.id) +
                             " changed between plan() and complete()");
    const StepResult* result = entry.wants_logits ? result_of.at(entry.id) : nullptr;
    // The accepted drafts become tokens of the sequence; the positions of the rejected ones
    // are rolled back (their blocks freed, their keys and values overwritten later).
    const std::int32_t accepted = result ? result->accepted : 0;
    const std::span<const Token> drafts =
        plan.tokens_of(entry).subspan(static_cast<std::size_t>(entry.n_tokens - entry.n_drafts));
    sequence.tokens.insert(sequence.tokens.end(), drafts.begin(), drafts.begin() + accepted);
    sequence.generated.insert(sequence.generated.end(), drafts.begin(),
                              drafts.begin() + accepted);
    sequence.n_computed += entry.n_tokens - entry.n_drafts + accepted;
    sequence.reached = std::max(sequence.reached, sequence.n_computed);  // accepted drafts included
    sequence.blocks.commit_full_blocks(
        pool_, std::span<const Token>(sequence.tokens)
                   .first(static_cast<std::size_t>(sequence.n_computed)));
    if (entry.n_drafts > 0) sequence.blocks.truncate(pool_, sequence.n_computed);
    counters_.drafted_tokens += entry.n_drafts;
    counters_.accepted_tokens += accepted;
    if (!result) continue;
    sequence.tokens.push_back(result->token);
    sequence.generated.push_back(result->token);
    if (result->finished) {
      finish(sequence, FinishReason::kStop);
    } else if (std::ssize(sequence.generated) >= sequence.max_new_tokens) {
      finish(sequence, FinishReason::kLength);
    }
  }
}

std::vector<Finished> Scheduler::take_finished() { return std::exchange(finished_, {}); }

const std::vector<Token>& Scheduler::generated(SequenceId id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end())
    throw std::out_of_range("Scheduler: no live sequence " + std::to_string(id));
  return it->second.generated;
}

const std::vector<Token>& Scheduler::tokens(SequenceId id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end())
    throw std::out_of_range("Scheduler: no live sequence " + std::to_string(id));
  return it->second.tokens;
}

SchedulerStats Scheduler::stats() const {
  SchedulerStats stats = counters_;
  stats.waiting = std::ssize(waiting_);
  stats.running = std::ssize(running_);
  const BlockPoolStats pool = pool_.stats();
  stats.blocks_used = pool.used;
  stats.blocks_total = pool.n_blocks;
  return stats;
}

void Scheduler::check_invariants() const {
  auto fail = [](const std::string& what) {
    throw std::logic_error("Scheduler invariant: " + what);
  };
  if (std::ssize(running_) > options_.max_sequences) fail("more running than max_sequences");
  if (running_.size() + waiting_.size() != sequences_.size())
    fail("live sequences are not exactly the running plus the waiting ones");
  std::vector<std::int32_t> references(static_cast<std::size_t>(pool_.n_blocks()), 0);
  for (std::size_t i = 0; i < running_.size(); ++i) {
    const std::string name = "running sequence " + std::to_string(running_[i]);
    if (i > 0 && running_[i - 1] >= running_[i]) fail("running_ not in arrival order");
    auto it = sequences_.find(running_[i]);
    if (it == sequences_.end()) fail(name + " is unknown");
    const Sequence& sequence = it->second;
    if (!sequence.running) fail(name + " is marked waiting");
    if (sequence.uncomputed() < 1) fail(name + " has no token to compute");
    if (sequence.blocks.capacity_tokens() < sequence.n_computed)
      fail(name + " has computed tokens beyond its blocks");
    for (BlockId block : sequence.blocks.table()) ++references[static_cast<std::size_t>(block)];
  }
  for (SequenceId id : waiting_) {
    const std::string name = "waiting sequence " + std::to_string(id);
    auto it = sequences_.find(id);
    if (it == sequences_.end()) fail(name + " is unknown");
    const Sequence& sequence = it->second;
    if (sequence.running) fail(name + " is marked running");
    if (!sequence.blocks.table().empty() || sequence.n_computed != 0) fail(name + " holds blocks");
    if (std::count(waiting_.begin(), waiting_.end(), id) != 1) fail(name + " is queued twice");
  }
  for (const auto& [id, sequence] : sequences_) {
    if (std::ssize(sequence.generated) >= sequence.max_new_tokens)
      fail("sequence " + std::to_string(id) + " reached max_new_tokens but is live");
    if (std::ssize(sequence.tokens) != sequence.prompt_tokens + std::ssize(sequence.generated))
      fail("sequence " + std::to_string(id) + " tokens are not prompt + generated");
  }
  for (const BlockCopy& copy : copies_) ++references[static_cast<std::size_t>(copy.from)];
  for (std::size_t block = 0; block < references.size(); ++block) {
    if (pool_.ref_count(static_cast<BlockId>(block)) != references[block])
      fail("block " + std::to_string(block) + " has refcount " +
           std::to_string(pool_.ref_count(static_cast<BlockId>(block))) + " but " +
           std::to_string(references[block]) + " table references");
  }
  pool_.check_invariants();
}

}  // namespace batchlm::local_engine
