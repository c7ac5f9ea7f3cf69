#include "batchlm/local_engine/scheduler.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "batchlm/local_engine/kv_cache.hpp"

namespace batchlm::local_engine {
namespace {

// The fake model's next token: a function of the sequence and the position alone, so a
// recomputed sequence must produce the same output as one never preempted.
Token fake_token(SequenceId id, std::int64_t position) {
  return static_cast<Token>((position * 31 + id) % 1000);
}

std::vector<Token> iota_tokens(int n, Token first) {
  std::vector<Token> tokens(static_cast<std::size_t>(n));
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

// Drives a Scheduler like the engine would, with a fake forward pass that writes each planned
// token into a simulated KV cache (one token id per slot) and then checks that every position
// an entry attends to holds the right token: that proves block tables, prefix reuse and
// recomputation correct, not only the bookkeeping.
class Driver {
 public:
  Driver(BlockPoolOptions pool_options, SchedulerOptions options)
      : pool(pool_options),
        scheduler(pool, options),
        kv_(static_cast<std::size_t>(pool_options.n_blocks * pool_options.block_size), -1) {}

  // `target`: the fake sampler reports finished when this many tokens were generated.
  SequenceId add(std::vector<Token> prompt, std::int64_t target, std::int64_t max_new_tokens) {
    const SequenceId id = scheduler.add(prompt, max_new_tokens);
    known_[id] = std::move(prompt);
    target_[id] = target;
    generated_[id] = 0;
    return id;
  }

  // plan() then, unless `cancel_before_complete` names an id, the fake forward and complete().
  StepPlan step(SequenceId cancel_before_complete = -1) {
    StepPlan plan = scheduler.plan();
    check_plan(plan);
    std::vector<StepResult> results;
    for (const PlannedSequence& entry : plan.entries) {
      if (!entry.wants_logits) continue;
      const std::int64_t next_position = entry.first_position + entry.n_tokens;
      const bool finished = generated_[entry.id] + 1 >= target_[entry.id];
      results.push_back({entry.id, fake_token(entry.id, next_position), finished});
    }
    if (cancel_before_complete >= 0) scheduler.cancel(cancel_before_complete);
    if (!plan.empty()) scheduler.complete(plan, results);
    for (const StepResult& result : results) {
      if (!scheduler.contains(result.id) && cancel_before_complete == result.id) continue;
      known_[result.id].push_back(result.token);
      ++generated_[result.id];
    }
    scheduler.check_invariants();
    for (Finished& done : scheduler.take_finished()) {
      EXPECT_FALSE(finished.contains(done.id)) << "sequence " << done.id << " finished twice";
      if (done.reason != FinishReason::kCancelled) {
        const std::vector<Token>& known = known_[done.id];
        EXPECT_EQ(std::ssize(known), done.prompt_tokens + std::ssize(done.generated));
        EXPECT_TRUE(std::equal(done.generated.begin(), done.generated.end(),
                               known.begin() + done.prompt_tokens));
      }
      finished[done.id] = std::move(done);
    }
    return plan;
  }

  // Steps until nothing is runnable; returns the steps taken (fails beyond max_steps).
  int run_until_idle(int max_steps = 10000) {
    for (int steps = 0; steps < max_steps; ++steps) {
      if (step().empty()) return steps;
    }
    ADD_FAILURE() << "no idle after " << max_steps << " steps";
    return max_steps;
  }

  BlockPool pool;
  Scheduler scheduler;
  std::map<SequenceId, Finished> finished;
  std::int64_t copies = 0;  // blocks copied so far

 private:
  std::int32_t& slot(std::span<const BlockId> table, std::int64_t position) {
    const std::int64_t bs = pool.block_size();
    const BlockId block = table[static_cast<std::size_t>(position / bs)];
    return kv_[static_cast<std::size_t>(block * bs + position % bs)];
  }

  void check_plan(const StepPlan& plan) {
    ASSERT_EQ(plan.tokens.size(), plan.positions.size());
    ASSERT_EQ(plan.tokens.size(), plan.sequence_of.size());
    EXPECT_LE(std::ssize(plan.tokens), scheduler.options().token_budget);
    EXPECT_LE(std::ssize(plan.entries), scheduler.options().max_sequences);
    std::int64_t offset = 0;
    std::vector<std::int32_t> logits_rows;
    std::set<std::pair<BlockId, std::int64_t>> written;
    std::set<SequenceId> ids;
    // The copies come first, as the engine makes them before the forward pass: the borrowed
    // block is held, the one copied over is a new sequence's own.
    const std::int64_t bs = pool.block_size();
    for (const BlockCopy& copy : plan.copies) {
      EXPECT_GE(pool.ref_count(copy.from), 1) << "copy from a block nobody holds";
      EXPECT_EQ(pool.ref_count(copy.to), 1) << "copy over a shared block";
      std::copy_n(kv_.begin() + copy.from * bs, bs, kv_.begin() + copy.to * bs);
      ++copies;
    }
    for (std::size_t e = 0; e < plan.entries.size(); ++e) {
      const PlannedSequence& entry = plan.entries[e];
      EXPECT_TRUE(ids.insert(entry.id).second) << "sequence planned twice";
      ASSERT_EQ(entry.token_offset, offset);
      ASSERT_GE(entry.n_tokens, 1);
      const std::vector<Token>& known = known_.at(entry.id);
      const std::int64_t end = entry.first_position + entry.n_tokens;
      ASSERT_LE(end, std::ssize(known));
      EXPECT_EQ(entry.wants_logits, end == std::ssize(known));
      ASSERT_GE(std::ssize(entry.block_table) * pool.block_size(), end);
      if (entry.n_tokens > 1) {  // prefill chunks are bounded, decodes are single tokens
        EXPECT_LE(entry.n_tokens, scheduler.options().prefill_chunk);
      }
      for (std::int64_t i = 0; i < entry.n_tokens; ++i) {
        const auto row = static_cast<std::size_t>(offset + i);
        const std::int64_t position = entry.first_position + i;
        EXPECT_EQ(plan.tokens[row], known[static_cast<std::size_t>(position)]);
        EXPECT_EQ(plan.positions[row], position);
        EXPECT_EQ(plan.sequence_of[row], static_cast<std::int32_t>(e));
        const BlockId block =
            entry.block_table[static_cast<std::size_t>(position / pool.block_size())];
        // A written block belongs to this sequence alone; shared prefix blocks are read-only.
        EXPECT_EQ(pool.ref_count(block), 1) << "write into a shared block";
        EXPECT_TRUE(written.insert({block, position % pool.block_size()}).second)
            << "two tokens written to one KV slot";
        slot(entry.block_table, position) = plan.tokens[row];
      }
      if (entry.wants_logits)
        logits_rows.push_back(static_cast<std::int32_t>(offset + entry.n_tokens - 1));
      offset += entry.n_tokens;
    }
    EXPECT_EQ(offset, std::ssize(plan.tokens));
    EXPECT_EQ(plan.logits_rows, logits_rows);
    // The attention of each entry reads every earlier position: all must hold its tokens.
    for (const PlannedSequence& entry : plan.entries) {
      const std::vector<Token>& known = known_.at(entry.id);
      for (std::int64_t p = 0; p < entry.first_position + entry.n_tokens; ++p) {
        if (slot(entry.block_table, p) != known[static_cast<std::size_t>(p)]) {
          ADD_FAILURE() << "sequence " << entry.id << " reads a wrong K/V at position " << p;
          return;
        }
      }
    }
  }

  std::vector<Token> kv_;  // (n_blocks * block_size) the token whose K/V each slot holds
  std::map<SequenceId, std::vector<Token>> known_;
  std::map<SequenceId, std::int64_t> target_, generated_;
};

std::int64_t count_decodes(const StepPlan& plan) {
  return std::count_if(plan.entries.begin(), plan.entries.end(),
                       [](const PlannedSequence& e) { return e.n_tokens == 1 && e.wants_logits; });
}

TEST(Scheduler, RejectsInvalidOptionsAndRequests) {
  BlockPool pool({.block_size = 4, .n_blocks = 8});
  EXPECT_THROW(Scheduler(pool, {.max_sequences = 0}), std::invalid_argument);
  EXPECT_THROW(Scheduler(pool, {.prefill_chunk = 0}), std::invalid_argument);
  EXPECT_THROW(Scheduler(pool, {.max_sequences = 8, .token_budget = 4}), std::invalid_argument);

  Scheduler scheduler(pool, {});
  EXPECT_THROW(scheduler.add({}, 4), std::invalid_argument);
  EXPECT_THROW(scheduler.add({1, 2}, 0), std::invalid_argument);
  EXPECT_NO_THROW(scheduler.add(iota_tokens(32, 1), 4));  // exactly the whole pool
  try {
    scheduler.add(iota_tokens(33, 1), 4);
    ADD_FAILURE() << "a prompt longer than the pool was accepted";
  } catch (const std::invalid_argument& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("33"), std::string::npos) << message;
    EXPECT_NE(message.find("32"), std::string::npos) << message;
  }
  EXPECT_EQ(scheduler.stats().waiting, 1);
}

TEST(Scheduler, EmptyPlanWhenIdleAndPlanTwiceWithoutCompleteThrows) {
  Driver driver({.block_size = 4, .n_blocks = 8}, {.max_sequences = 4, .token_budget = 16});
  EXPECT_TRUE(driver.scheduler.plan().empty());
  driver.add({1, 2, 3}, 2, 10);
  StepPlan plan = driver.scheduler.plan();
  ASSERT_EQ(plan.entries.size(), 1u);
  EXPECT_THROW(driver.scheduler.plan(), std::logic_error);
  EXPECT_THROW(driver.scheduler.complete(plan, {}), std::invalid_argument);  // missing result
  const StepResult wrong{.id = 99, .token = 1, .finished = false};
  EXPECT_THROW(driver.scheduler.complete(plan, std::span(&wrong, 1)), std::invalid_argument);
  const StepResult right{.id = plan.entries[0].id, .token = 7, .finished = false};
  driver.scheduler.complete(plan, std::span(&right, 1));
  EXPECT_EQ(driver.scheduler.generated(right.id), std::vector<Token>{7});
  EXPECT_THROW(driver.scheduler.complete(plan, std::span(&right, 1)), std::invalid_argument);
  driver.scheduler.check_invariants();
}

TEST(Scheduler, AdmissionRespectsMaxSequencesInFifoOrder) {
  Driver driver({.block_size = 4, .n_blocks = 64}, {.max_sequences = 2, .token_budget = 64});
  for (int i = 0; i < 5; ++i) driver.add(iota_tokens(4, 10 * i), 6, 100);
  std::vector<SequenceId> first_seen;
  for (int steps = 0; steps < 200; ++steps) {
    StepPlan plan = driver.step();
    if (plan.empty()) break;
    EXPECT_LE(plan.entries.size(), 2u);
    EXPECT_LE(driver.scheduler.stats().running, 2);
    for (const PlannedSequence& entry : plan.entries) {
      if (std::find(first_seen.begin(), first_seen.end(), entry.id) == first_seen.end())
        first_seen.push_back(entry.id);
    }
  }
  EXPECT_EQ(first_seen, (std::vector<SequenceId>{1, 2, 3, 4, 5}));
  ASSERT_EQ(driver.finished.size(), 5u);
  for (const auto& [id, done] : driver.finished) {
    EXPECT_EQ(done.reason, FinishReason::kStop);
    EXPECT_EQ(done.generated.size(), 6u);
  }
  EXPECT_EQ(driver.pool.stats().used, 0);
}

TEST(Scheduler, AdmissionRespectsTokenBudget) {
  Driver driver({.block_size = 4, .n_blocks = 64},
                {.max_sequences = 4, .token_budget = 8, .prefill_chunk = 8});
  for (int i = 0; i < 3; ++i) driver.add(iota_tokens(5, 10 * i), 3, 100);
  StepPlan plan = driver.step();
  ASSERT_EQ(plan.entries.size(), 2u);  // 5 tokens of the first, the budget's last 3 of the second
  EXPECT_EQ(plan.entries[0].n_tokens, 5);
  EXPECT_TRUE(plan.entries[0].wants_logits);
  EXPECT_EQ(plan.entries[1].n_tokens, 3);
  EXPECT_FALSE(plan.entries[1].wants_logits);
  EXPECT_EQ(plan.tokens.size(), 8u);
  EXPECT_EQ(driver.scheduler.stats().waiting, 1);
  driver.run_until_idle();
  EXPECT_EQ(driver.finished.size(), 3u);
  EXPECT_EQ(driver.scheduler.stats().prompt_tokens_computed, 15);
}

TEST(Scheduler, LongPromptPrefillsInChunksWhileOthersDecodeEveryStep) {
  Driver driver({.block_size = 4, .n_blocks = 256},
                {.max_sequences = 4, .token_budget = 32, .prefill_chunk = 16});
  const SequenceId a = driver.add(iota_tokens(4, 1), 60, 100);
  const SequenceId b = driver.add(iota_tokens(4, 50), 60, 100);
  driver.step();  // both prefill and sample their first token
  const SequenceId long_id = driver.add(iota_tokens(200, 300), 5, 100);
  int chunks = 0;
  for (;;) {
    StepPlan plan = driver.step();
    ASSERT_EQ(plan.entries.size(), 3u);
    // The decodes come first, one token each, every step.
    EXPECT_EQ(plan.entries[0].id, a);
    EXPECT_EQ(plan.entries[1].id, b);
    EXPECT_EQ(count_decodes(plan), 2);
    const PlannedSequence& chunk = plan.entries[2];
    EXPECT_EQ(chunk.id, long_id);
    EXPECT_EQ(chunk.first_position, 16 * chunks);
    ++chunks;
    if (chunk.wants_logits) {
      EXPECT_EQ(chunk.n_tokens, 200 - 16 * 12);
      break;
    }
    EXPECT_EQ(chunk.n_tokens, 16);
  }
  EXPECT_EQ(chunks, 13);  // ceil(200 / 16)
  driver.run_until_idle();
  EXPECT_EQ(driver.finished.size(), 3u);
  EXPECT_EQ(driver.finished[a].generated.size(), 60u);
}

TEST(Scheduler, SharedPrefixIsComputedOnceAndReusedByLaterRequests) {
  Driver driver({.block_size = 16, .n_blocks = 128}, {.max_sequences = 8, .token_budget = 256});
  const std::vector<Token> prefix = iota_tokens(64, 1000);
  auto request = [&](int i) {
    std::vector<Token> prompt = prefix;
    for (int t = 0; t < 10; ++t) prompt.push_back(static_cast<Token>(2000 + 10 * i + t));
    return prompt;
  };
  driver.add(request(0), 8, 100);
  driver.run_until_idle();
  ASSERT_EQ(driver.finished.size(), 1u);
  EXPECT_EQ(driver.scheduler.stats().prompt_tokens_cached, 0);

  // The first request's blocks are cached now (refcount 0, keyed): the next 7 find them.
  for (int i = 1; i < 8; ++i) driver.add(request(i), 8, 100);
  StepPlan plan = driver.step();
  ASSERT_EQ(plan.entries.size(), 7u);
  for (const PlannedSequence& entry : plan.entries) {
    EXPECT_EQ(entry.first_position, 64);
    EXPECT_EQ(entry.n_tokens, 10);
  }
  // All 7 tables start with the same 4 prefix blocks.
  for (const PlannedSequence& entry : plan.entries) {
    EXPECT_TRUE(std::equal(entry.block_table.begin(), entry.block_table.begin() + 4,
                           plan.entries[0].block_table.begin()));
  }
  driver.run_until_idle();
  const SchedulerStats stats = driver.scheduler.stats();
  EXPECT_EQ(stats.prompt_tokens_cached, 7 * 64);
  EXPECT_EQ(stats.prompt_tokens_computed, 74 + 7 * 10);
  EXPECT_EQ(driver.finished.size(), 8u);
  EXPECT_EQ(driver.pool.stats().used, 0);
}

TEST(Scheduler, APrefixEndingInsideABlockIsCopiedNotComputed) {
  Driver driver({.block_size = 16, .n_blocks = 128}, {.max_sequences = 8, .token_budget = 256});
  const std::vector<Token> prefix = iota_tokens(69, 1000);  // 4 blocks and 5 tokens
  auto request = [&](int i) {
    std::vector<Token> prompt = prefix;
    for (int t = 0; t < 10; ++t) prompt.push_back(static_cast<Token>(2000 + 10 * i + t));
    return prompt;
  };
  driver.add(request(0), 8, 100);  // its tokens fill 5 blocks, all published
  driver.run_until_idle();
  EXPECT_EQ(driver.copies, 0);

  for (int i = 1; i < 8; ++i) driver.add(request(i), 8, 100);
  StepPlan plan = driver.step();  // the driver checks every position each entry reads
  ASSERT_EQ(plan.entries.size(), 7u);
  ASSERT_EQ(plan.copies.size(), 7u);
  for (std::size_t e = 0; e < plan.entries.size(); ++e) {
    const PlannedSequence& entry = plan.entries[e];
    EXPECT_EQ(entry.first_position, 69);
    EXPECT_EQ(entry.n_tokens, 10);
    EXPECT_EQ(plan.copies[e].to, entry.block_table[4]);
    EXPECT_EQ(plan.copies[e].from, plan.copies[0].from);  // the first request's fifth block
  }
  driver.run_until_idle();
  const SchedulerStats stats = driver.scheduler.stats();
  EXPECT_EQ(stats.prompt_tokens_cached, 7 * 69);
  EXPECT_EQ(stats.prompt_tokens_computed, 79 + 7 * 10);
  EXPECT_EQ(driver.finished.size(), 8u);
  for (const auto& [id, done] : driver.finished) EXPECT_EQ(done.generated.size(), 8u);
  EXPECT_EQ(driver.pool.stats().used, 0);
}

TEST(Scheduler, ACopyOfASequenceCancelledBeforeCompleteReleasesTheBorrowedBlock) {
  Driver driver({.block_size = 4, .n_blocks = 16}, {.max_sequences = 4, .token_budget = 64});
  driver.add(iota_tokens(10, 100), 3, 10);
  driver.run_until_idle();
  std::vector<Token> prompt = iota_tokens(6, 100);
  prompt.push_back(9);
  const SequenceId id = driver.add(prompt, 3, 10);
  const StepPlan plan = driver.step(id);  // planned with a copy, cancelled before complete()
  ASSERT_EQ(plan.copies.size(), 1u);
  EXPECT_EQ(driver.finished.at(id).reason, FinishReason::kCancelled);
  EXPECT_EQ(driver.pool.stats().used, 0);
}

TEST(Scheduler, PublishedPrefixIsSharedWhileTheFirstRequestStillRuns) {
  Driver driver({.block_size = 16, .n_blocks = 128}, {.max_sequences = 8, .token_budget = 256});
  const std::vector<Token> prefix = iota_tokens(64, 1000);
  std::vector<Token> first = prefix;
  first.push_back(1);
  driver.add(first, 50, 100);
  driver.step();  // its 4 full prefix blocks are published by complete()
  std::vector<Token> second = prefix;
  second.push_back(2);
  const SequenceId id = driver.add(second, 5, 100);
  StepPlan plan = driver.step();
  ASSERT_EQ(plan.entries.size(), 2u);
  EXPECT_EQ(plan.entries[1].id, id);
  EXPECT_EQ(plan.entries[1].first_position, 64);
  EXPECT_EQ(driver.pool.ref_count(plan.entries[1].block_table[0]), 2);
  EXPECT_EQ(driver.scheduler.stats().prompt_tokens_cached, 64);
  driver.run_until_idle();
  EXPECT_EQ(driver.finished.size(), 2u);
}

TEST(Scheduler, RequestsArrivingTogetherWithASharedPrefixComputeItOnce) {
  // The n choices of one request, or few-shot prompts sent at once: the first computes the
  // shared blocks, the rest wait for them and take them from the cache.
  Driver driver({.block_size = 16, .n_blocks = 128}, {.max_sequences = 8, .token_budget = 256});
  const std::vector<Token> prefix = iota_tokens(40, 1000);  // 2 full blocks and 8 tokens
  std::vector<SequenceId> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(driver.add(prefix, 6, 100));
  std::vector<Token> other = iota_tokens(40, 5000);  // shares nothing: waits its turn in FIFO order
  const SequenceId unrelated = driver.add(other, 6, 100);
  StepPlan first = driver.step();
  ASSERT_EQ(first.entries.size(), 1u);
  EXPECT_EQ(first.entries[0].id, ids[0]);
  EXPECT_EQ(first.entries[0].n_tokens, 40);
  StepPlan second = driver.step();
  ASSERT_EQ(second.entries.size(), 5u);
  for (std::size_t e = 1; e < 4; ++e) {
    EXPECT_EQ(second.entries[e].id, ids[e]);
    EXPECT_EQ(second.entries[e].first_position, 32);
    EXPECT_EQ(second.entries[e].n_tokens, 8);
  }
  EXPECT_EQ(second.entries[4].id, unrelated);
  EXPECT_EQ(second.entries[4].first_position, 0);
  driver.run_until_idle();
  const SchedulerStats stats = driver.scheduler.stats();
  EXPECT_EQ(stats.prompt_tokens_cached, 3 * 32);
  EXPECT_EQ(stats.prompt_tokens_computed, 40 + 3 * 8 + 40);
  EXPECT_EQ(driver.finished.size(), 5u);
  for (const SequenceId id : ids) EXPECT_EQ(driver.finished.at(id).generated.size(), 6u);
  EXPECT_EQ(driver.pool.stats().used, 0);
}

TEST(Scheduler, AWaitingPromptTrailsALongSharedPrefillChunkByChunk) {
  Driver driver({.block_size = 16, .n_blocks = 128},
                {.max_sequences = 8, .token_budget = 512, .prefill_chunk = 64});
  std::vector<Token> a = iota_tokens(200, 1000);
  std::vector<Token> b = a;
  a.push_back(1);
  b.push_back(2);
  driver.add(a, 4, 100);
  const SequenceId second = driver.add(b, 4, 100);
  int steps = 0;
  std::int64_t start = -1;
  while (start < 0 && steps < 20) {
    const StepPlan plan = driver.step();
    ++steps;
    for (const PlannedSequence& entry : plan.entries)
      if (entry.id == second && start < 0) start = entry.first_position;
  }
  // Admitted once the first's prefill has passed every shared full block.
  EXPECT_EQ(start, 192);
  driver.run_until_idle();
  EXPECT_EQ(driver.scheduler.stats().prompt_tokens_computed, 201 + 9);
  EXPECT_EQ(driver.finished.size(), 2u);
}

// Runs the same 8 requests on a pool of `n_blocks` and returns what they generated.
std::map<SequenceId, Finished> run_eight_requests(std::int64_t n_blocks,
                                                  std::int64_t* preemptions) {
  Driver driver({.block_size = 4, .n_blocks = n_blocks},
                {.max_sequences = 8, .token_budget = 64, .prefill_chunk = 16});
  for (int i = 0; i < 8; ++i) driver.add(iota_tokens(5 + 3 * i, 100 * i), 20 + 3 * i, 1000);
  const int steps = driver.run_until_idle(5000);
  EXPECT_LT(steps, 5000);
  EXPECT_EQ(driver.pool.stats().used, 0);
  *preemptions = driver.scheduler.stats().preemptions;
  return driver.finished;
}

TEST(Scheduler, PreemptionUnderATinyPoolRecomputesToTheSameOutputs) {
  std::int64_t large_preemptions = 0, small_preemptions = 0;
  const auto large = run_eight_requests(1024, &large_preemptions);
  // The longest request needs 26 + 41 = 67 tokens: 17 blocks; 18 fit it alone, not all 8.
  const auto small = run_eight_requests(18, &small_preemptions);
  EXPECT_EQ(large_preemptions, 0);
  EXPECT_GT(small_preemptions, 0);
  ASSERT_EQ(large.size(), 8u);
  ASSERT_EQ(small.size(), 8u);
  for (const auto& [id, done] : large) {
    EXPECT_EQ(done.reason, FinishReason::kStop);
    EXPECT_EQ(std::ssize(done.generated), 20 + 3 * (id - 1));
    EXPECT_EQ(small.at(id).reason, FinishReason::kStop);
    EXPECT_EQ(small.at(id).generated, done.generated) << "sequence " << id;
  }
}

// A prompt whose chunks leave its last token alone computes it as a decode step would; it is
// still a prompt token in the counts (every prompt token counted once, computed or cached).
TEST(Scheduler, EveryPromptTokenIsCountedOnceHoweverItIsChunked) {
  Driver driver({.block_size = 4, .n_blocks = 16}, {.max_sequences = 2, .token_budget = 4, .prefill_chunk = 4});
  driver.add(iota_tokens(5, 1), 3, 100);
  driver.add(iota_tokens(9, 1), 3, 100);  // shares the first block with the first, once published
  driver.run_until_idle();
  const SchedulerStats s = driver.scheduler.stats();
  EXPECT_EQ(s.prompt_tokens_computed + s.prompt_tokens_cached, 5 + 9);
  EXPECT_EQ(s.recomputed_tokens, 0);
  EXPECT_EQ(driver.finished.size(), 2u);
}

TEST(Scheduler, PreemptsTheNewestAndRequeuesItAtTheFront) {
  // 4 blocks of 4 tokens: two 4-token prompts take a block each, then grow one block per 4
  // tokens; the step that needs a fifth block preempts the newer one. A third request waits
  // for a running slot all along.
  Driver driver({.block_size = 4, .n_blocks = 4}, {.max_sequences = 2, .token_budget = 16});
  const SequenceId old_id = driver.add(iota_tokens(4, 1), 8, 100);
  const SequenceId new_id = driver.add(iota_tokens(4, 50), 8, 100);
  const SequenceId later = driver.add(iota_tokens(2, 90), 2, 100);
  bool preempted = false;
  for (int steps = 0; steps < 100 && !preempted; ++steps) {
    StepPlan plan = driver.step();
    for (const PlannedSequence& entry : plan.entries) EXPECT_NE(entry.id, later);
    if (driver.scheduler.stats().preemptions == 0) continue;
    preempted = true;
    ASSERT_EQ(plan.entries.size(), 1u);
    EXPECT_EQ(plan.entries[0].id, old_id);
    EXPECT_EQ(driver.scheduler.generated(new_id).size(), 5u);  // kept for the recompute
    EXPECT_EQ(driver.scheduler.stats().waiting, 2);
  }
  ASSERT_TRUE(preempted);
  // The preempted sequence is readmitted before the request queued after it.
  for (int steps = 0; steps < 100; ++steps) {
    StepPlan plan = driver.step();
    auto has = [&](SequenceId id) {
      return std::any_of(plan.entries.begin(), plan.entries.end(),
                         [&](const PlannedSequence& e) { return e.id == id; });
    };
    if (has(later) || has(new_id)) {
      EXPECT_TRUE(has(new_id));
      break;
    }
  }
  driver.run_until_idle();
  EXPECT_EQ(driver.scheduler.stats().preemptions, 1);
  // Each prompt token counts once; the recompute found the preempted sequence's own published
  // prompt block, and computed again only what followed it (prompt 4 + 4 of its 5 generated
  // tokens had been computed: positions 4-7).
  EXPECT_EQ(driver.scheduler.stats().prompt_tokens_computed, 10);
  EXPECT_EQ(driver.scheduler.stats().prompt_tokens_cached, 0);
  EXPECT_EQ(driver.scheduler.stats().recomputed_tokens, 4);
  ASSERT_EQ(driver.finished.size(), 3u);
  EXPECT_EQ(driver.finished[old_id].generated.size(), 8u);
  EXPECT_EQ(driver.finished[new_id].generated.size(), 8u);
  EXPECT_EQ(driver.finished[later].generated.size(), 2u);
  EXPECT_EQ(driver.pool.stats().used, 0);
}

TEST(Scheduler, ASequenceTooLongForThePoolAloneFinishesWithLength) {
  Driver driver({.block_size = 4, .n_blocks = 2}, {.max_sequences = 2, .token_budget = 8});
  const SequenceId id = driver.add({1, 2, 3}, 100, 100);
  const int steps = driver.run_until_idle(100);
  EXPECT_LT(steps, 100);
  ASSERT_TRUE(driver.finished.contains(id));
  EXPECT_EQ(driver.finished[id].reason, FinishReason::kLength);
  // 8 slots: positions 0..7 computed, each computed position past the prompt's last samples one.
  EXPECT_EQ(driver.finished[id].generated.size(), 6u);
  EXPECT_EQ(driver.pool.stats().used, 0);
}

TEST(Scheduler, MaxNewTokensFinishesWithLength) {
  Driver driver({.block_size = 4, .n_blocks = 16}, {.max_sequences = 2, .token_budget = 8});
  const SequenceId id = driver.add({1, 2, 3}, 100, 7);
  driver.run_until_idle();
  EXPECT_EQ(driver.finished[id].reason, FinishReason::kLength);
  EXPECT_EQ(driver.finished[id].generated.size(), 7u);
  EXPECT_EQ(to_string(FinishReason::kLength), "length");
  EXPECT_EQ(to_string(FinishReason::kStop), "stop");
  EXPECT_EQ(to_string(FinishReason::kCancelled), "cancelled");
}

TEST(Scheduler, CancelInEveryStateFreesItsBlocks) {
  Driver driver({.block_size = 4, .n_blocks = 12},
                {.max_sequences = 3, .token_budget = 16, .prefill_chunk = 4});
  const SequenceId decoding = driver.add(iota_tokens(3, 1), 100, 100);
  const SequenceId prefilling = driver.add(iota_tokens(30, 100), 100, 100);
  const SequenceId in_flight = driver.add(iota_tokens(3, 200), 100, 100);
  const SequenceId waiting = driver.add(iota_tokens(3, 300), 100, 100);
  driver.step();
  driver.step();
  const SchedulerStats stats = driver.scheduler.stats();
  EXPECT_EQ(stats.running, 3);
  EXPECT_EQ(stats.waiting, 1);
  EXPECT_GT(stats.blocks_used, 0);

  driver.scheduler.cancel(waiting);
  driver.scheduler.cancel(prefilling);
  EXPECT_FALSE(driver.scheduler.contains(prefilling));
  driver.step(/*cancel_before_complete=*/in_flight);
  driver.scheduler.cancel(decoding);
  driver.scheduler.cancel(decoding);  // twice: ignored
  driver.scheduler.cancel(12345);     // unknown: ignored
  driver.scheduler.check_invariants();
  for (Finished& done : driver.scheduler.take_finished()) driver.finished[done.id] = done;
  EXPECT_EQ(driver.pool.stats().used, 0);
  ASSERT_EQ(driver.finished.size(), 4u);
  for (const auto& [id, done] : driver.finished) EXPECT_EQ(done.reason, FinishReason::kCancelled);
  EXPECT_TRUE(driver.scheduler.plan().empty());
}

TEST(Scheduler, CancelOfAPreemptedSequenceFreesEverything) {
  Driver driver({.block_size = 4, .n_blocks = 6}, {.max_sequences = 4, .token_budget = 16});
  std::vector<SequenceId> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(driver.add(iota_tokens(4, 10 * i), 15, 100));
  for (int steps = 0; steps < 100 && driver.scheduler.stats().preemptions == 0; ++steps) {
    driver.step();
  }
  ASSERT_GT(driver.scheduler.stats().preemptions, 0);
  // The preempted one waits with its generated tokens kept.
  const SequenceId preempted = ids.back();
  EXPECT_TRUE(driver.scheduler.contains(preempted));
  EXPECT_FALSE(driver.scheduler.generated(preempted).empty());
  EXPECT_GE(driver.scheduler.stats().waiting, 1);
  driver.scheduler.cancel(preempted);
  driver.scheduler.check_invariants();
  driver.run_until_idle();
  EXPECT_EQ(driver.finished[preempted].reason, FinishReason::kCancelled);
  EXPECT_EQ(driver.finished[ids[0]].reason, FinishReason::kStop);
  EXPECT_EQ(driver.finished[ids[1]].reason, FinishReason::kStop);
  EXPECT_EQ(driver.pool.stats().used, 0);
}

TEST(Scheduler, EarlyLongRequestIsNotStarvedByAStreamOfShortOnes) {
  Driver driver({.block_size = 4, .n_blocks = 512},
                {.max_sequences = 4, .token_budget = 40, .prefill_chunk = 32});
  const SequenceId long_id = driver.add(iota_tokens(300, 1), 20, 100);
  std::map<SequenceId, int> first_step;  // when each request was first planned
  auto record = [&](const StepPlan& plan, int step) {
    for (const PlannedSequence& entry : plan.entries) first_step.emplace(entry.id, step);
  };
  int steps = 0;
  for (; steps < 1000 && !driver.finished.contains(long_id); ++steps) {
    driver.add(iota_tokens(6, 5000 + steps), 3, 100);  // a new short request every step
    StepPlan plan = driver.step();
    record(plan, steps);
    if (steps < 10) {
      // Running prefills come before admissions: the long prompt gets a full chunk each step.
      auto it = std::find_if(plan.entries.begin(), plan.entries.end(),
                             [&](const PlannedSequence& e) { return e.id == long_id; });
      ASSERT_NE(it, plan.entries.end());
      EXPECT_EQ(it->n_tokens, std::min<std::int64_t>(32, 300 - 32 * steps));
    }
  }
  // 10 prefill steps, then one decode per step for the 19 other tokens.
  EXPECT_EQ(steps, 10 + 19);
  EXPECT_EQ(driver.finished[long_id].generated.size(), 20u);
  for (int more = 0; more < 1000; ++more) {
    StepPlan plan = driver.step();
    if (plan.empty()) break;
    record(plan, steps + more);
  }
  // Admission was FIFO: a request was never first planned before one that arrived earlier.
  ASSERT_EQ(first_step.size(), driver.finished.size());
  int previous = 0;
  for (const auto& [id, step] : first_step) {
    EXPECT_GE(step, previous) << "sequence " << id << " overtook an earlier one";
    previous = step;
    EXPECT_EQ(driver.finished[id].reason, FinishReason::kStop);
  }
}

TEST(Scheduler, RandomArrivalsCancelsAndLengthsKeepInvariantsAndFinishEveryRequestOnce) {
  std::int64_t preemptions = 0, cached = 0, copies = 0;
  for (std::uint32_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const int max_sequences = uniform(1, 6);
    // 20 blocks of 4 = 80 tokens: any request alone (prompt <= 40, target <= 30) fits, all
    // together do not.
    Driver driver({.block_size = 4, .n_blocks = 20},
                  {.max_sequences = max_sequences,
                   .token_budget = uniform(max_sequences, 32),
                   .prefill_chunk = uniform(1, 16)});
    const std::vector<std::vector<Token>> prefixes = {iota_tokens(8, 7000), iota_tokens(16, 8000)};
    struct Expected {
      std::int64_t target, max_new;
    };
    std::map<SequenceId, Expected> expected;
    std::set<SequenceId> cancelled;
    std::vector<SequenceId> live;
    for (int step = 0; step < 1500; ++step) {
      if (uniform(0, 2) == 0) {
        std::vector<Token> prompt;
        if (uniform(0, 1) == 0) prompt = prefixes[static_cast<std::size_t>(uniform(0, 1))];
        const int extra = uniform(1, 40 - static_cast<int>(prompt.size()));
        for (int t = 0; t < extra; ++t) prompt.push_back(static_cast<Token>(uniform(0, 3)));
        const Expected e{uniform(1, 30), uniform(1, 40)};
        const SequenceId id = driver.add(prompt, e.target, e.max_new);
        expected[id] = e;
        live.push_back(id);
      }
      std::erase_if(live, [&](SequenceId id) { return !driver.scheduler.contains(id); });
      SequenceId cancel_in_flight = -1;
      if (!live.empty() && uniform(0, 40) == 0) {
        const SequenceId id = live[static_cast<std::size_t>(uniform(0, std::ssize(live) - 1))];
        cancelled.insert(id);
        if (uniform(0, 1) == 0) {
          driver.scheduler.cancel(id);
        } else {
          cancel_in_flight = id;
        }
      }
      driver.step(cancel_in_flight);
      if (testing::Test::HasFailure()) return;
    }
    EXPECT_LT(driver.run_until_idle(20000), 20000);
    preemptions += driver.scheduler.stats().preemptions;
    cached += driver.scheduler.stats().prompt_tokens_cached;
    copies += driver.copies;
    EXPECT_EQ(driver.pool.stats().used, 0);
    ASSERT_EQ(driver.finished.size(), expected.size());
    for (const auto& [id, e] : expected) {
      const Finished& done = driver.finished.at(id);
      if (cancelled.contains(id)) {
        EXPECT_EQ(done.reason, FinishReason::kCancelled);
        continue;
      }
      if (e.target <= e.max_new) {
        EXPECT_EQ(done.reason, FinishReason::kStop) << "sequence " << id;
        EXPECT_EQ(std::ssize(done.generated), e.target) << "sequence " << id;
      } else {
        EXPECT_EQ(done.reason, FinishReason::kLength) << "sequence " << id;
        EXPECT_EQ(std::ssize(done.generated), e.max_new) << "sequence " << id;
      }
      for (std::size_t i = 0; i < done.generated.size(); ++i) {
        EXPECT_EQ(done.generated[i],
                  fake_token(id, done.prompt_tokens + static_cast<std::int64_t>(i)));
      }
    }
  }
  EXPECT_GT(preemptions, 0);
  EXPECT_GT(cached, 0);
  EXPECT_GT(copies, 0);
}

}  // namespace
}  // namespace batchlm::local_engine
