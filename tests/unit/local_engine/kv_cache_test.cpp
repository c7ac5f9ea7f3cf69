#include "batchlm/local_engine/kv_cache.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <vector>

namespace batchlm::local_engine {
namespace {

std::vector<std::int32_t> iota_tokens(int n, std::int32_t first = 100) {
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(n));
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

std::vector<BlockId> table_of(const SequenceBlocks& seq) {
  return {seq.table().begin(), seq.table().end()};
}

// ---- BlockPool ------------------------------------------------------------------------------

TEST(BlockPool, RejectsInvalidOptions) {
  EXPECT_THROW(BlockPool({.block_size = 0, .n_blocks = 4}), std::invalid_argument);
  EXPECT_THROW(BlockPool({.block_size = 16, .n_blocks = 0}), std::invalid_argument);
}

TEST(BlockPool, AllocatesEveryBlockOnceThenReportsExhaustion) {
  BlockPool pool({.block_size = 16, .n_blocks = 4});
  std::set<BlockId> ids;
  for (int i = 0; i < 4; ++i) {
    std::optional<BlockId> id = pool.allocate();
    ASSERT_TRUE(id.has_value());
    EXPECT_GE(*id, 0);
    EXPECT_LT(*id, 4);
    EXPECT_EQ(pool.ref_count(*id), 1);
    ids.insert(*id);
    pool.check_invariants();
  }
  EXPECT_EQ(ids.size(), 4u);
  EXPECT_FALSE(pool.allocate().has_value());
  EXPECT_EQ(pool.stats().used, 4);
  EXPECT_EQ(pool.stats().free, 0);

  pool.release(2);
  EXPECT_EQ(pool.ref_count(2), 0);
  EXPECT_EQ(pool.stats().free, 1);
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(2));
  EXPECT_FALSE(pool.allocate().has_value());
  pool.check_invariants();
}

TEST(BlockPool, ReleasingABlockNotInUseThrowsAndKeepsRefcountAtZero) {
  BlockPool pool({.block_size = 4, .n_blocks = 2});
  EXPECT_THROW(pool.release(0), std::logic_error);  // never allocated
  BlockId id = *pool.allocate();
  pool.release(id);
  EXPECT_THROW(pool.release(id), std::logic_error);  // double release
  EXPECT_EQ(pool.ref_count(id), 0);
  EXPECT_THROW(pool.release(-1), std::logic_error);
  EXPECT_THROW(pool.release(2), std::logic_error);
  pool.check_invariants();
  EXPECT_EQ(pool.stats().free, 2);
}

TEST(BlockPool, SharedBlockIsFreedOnlyByItsLastReference) {
  BlockPool pool({.block_size = 4, .n_blocks = 2});
  BlockId id = *pool.allocate();
  ASSERT_TRUE(pool.publish(id, 42));
  EXPECT_EQ(pool.lookup_and_acquire(42), std::optional<BlockId>(id));
  EXPECT_EQ(pool.ref_count(id), 2);
  pool.release(id);
  EXPECT_EQ(pool.ref_count(id), 1);
  EXPECT_EQ(pool.stats().used, 1);
  pool.release(id);
  EXPECT_EQ(pool.ref_count(id), 0);
  EXPECT_EQ(pool.stats().cached_free, 1);
  EXPECT_EQ(pool.stats().used, 0);
  pool.check_invariants();
}

TEST(BlockPool, EvictsCachedBlocksInTheOrderTheyWereReleased) {
  BlockPool pool({.block_size = 4, .n_blocks = 3});
  BlockId a = *pool.allocate(), b = *pool.allocate(), c = *pool.allocate();
  ASSERT_TRUE(pool.publish(a, 1));
  ASSERT_TRUE(pool.publish(b, 2));
  ASSERT_TRUE(pool.publish(c, 3));
  pool.release(b);
  pool.release(a);
  pool.release(c);
  EXPECT_EQ(pool.stats().cached_free, 3);
  pool.check_invariants();

  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(b));  // released first
  EXPECT_EQ(pool.stats().evictions, 1);
  EXPECT_FALSE(pool.lookup_and_acquire(2).has_value());  // its key is forgotten
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(a));
  EXPECT_FALSE(pool.lookup_and_acquire(1).has_value());
  EXPECT_EQ(pool.lookup_and_acquire(3), std::optional<BlockId>(c));  // survived
  EXPECT_EQ(pool.stats().evictions, 2);
  EXPECT_EQ(pool.stats().hits, 1);
  EXPECT_EQ(pool.stats().misses, 2);
  EXPECT_FALSE(pool.allocate().has_value());
  pool.check_invariants();
}

TEST(BlockPool, ReacquiringACachedBlockRefreshesItsPlaceInTheEvictionOrder) {
  BlockPool pool({.block_size = 4, .n_blocks = 2});
  BlockId a = *pool.allocate(), b = *pool.allocate();
  pool.publish(a, 1);
  pool.publish(b, 2);
  pool.release(a);
  pool.release(b);
  ASSERT_EQ(pool.lookup_and_acquire(1), std::optional<BlockId>(a));
  pool.release(a);  // now a was released after b
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(b));
  EXPECT_EQ(pool.lookup_and_acquire(1), std::optional<BlockId>(a));
  pool.check_invariants();
}

TEST(BlockPool, PrefersFreeBlocksToEvictingCachedOnes) {
  BlockPool pool({.block_size = 4, .n_blocks = 2});
  BlockId a = *pool.allocate(), b = *pool.allocate();
  pool.publish(a, 7);
  pool.release(a);
  pool.release(b);
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(b));
  EXPECT_EQ(pool.stats().evictions, 0);
  EXPECT_EQ(pool.lookup_and_acquire(7), std::optional<BlockId>(a));
  pool.check_invariants();
}

TEST(BlockPool, ReusesBlocksWrittenBeforeAheadOfNeverUsedOnes) {
  BlockPool pool({.block_size = 4, .n_blocks = 4});
  const BlockId a = *pool.allocate(), b = *pool.allocate();
  ASSERT_EQ(a, 0);
  ASSERT_EQ(b, 1);
  pool.release(a);
  pool.release(b);
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(b));  // released last, so most likely cached
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(a));
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(2));  // then memory never used, in order
  pool.check_invariants();
}

// Blocks a (shared: found again by a lookup) and b (unshared) cached; blocks 2 and 3 never used.
BlockPool pool_with_shared_and_unshared_cached(bool recycle, BlockId& a, BlockId& b) {
  BlockPool pool({.block_size = 4, .n_blocks = 4, .recycle = recycle});
  a = *pool.allocate();
  b = *pool.allocate();
  pool.publish(a, 1);
  pool.publish(b, 2);
  EXPECT_EQ(pool.lookup_and_acquire(1), std::optional<BlockId>(a));
  pool.release(a);
  pool.release(a);
  pool.release(b);
  EXPECT_EQ(pool.stats().cached_free, 2);
  pool.check_invariants();
  return pool;
}

TEST(BlockPool, RecyclingEvictsUnsharedCachedBlocksBeforeTouchingNewMemory) {
  BlockId a = -1, b = -1;
  BlockPool pool = pool_with_shared_and_unshared_cached(true, a, b);
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(b));
  EXPECT_EQ(pool.stats().evictions, 1);
  EXPECT_FALSE(pool.lookup_and_acquire(2).has_value());
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(2));  // the shared block is kept
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(3));
  pool.check_invariants();
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(a));  // until nothing else is left
  EXPECT_FALSE(pool.allocate().has_value());
  EXPECT_FALSE(pool.lookup_and_acquire(1).has_value());
  pool.check_invariants();
}

TEST(BlockPool, WithoutRecyclingTheCacheSpreadsOverThePool) {
  BlockId a = -1, b = -1;
  BlockPool pool = pool_with_shared_and_unshared_cached(false, a, b);
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(2));
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(3));
  EXPECT_EQ(pool.stats().evictions, 0);
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(a));  // released longest ago, shared or not
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(b));
  EXPECT_EQ(pool.stats().evictions, 2);
  pool.check_invariants();
}

TEST(BlockPool, ABlockIsSharedOnlyUntilItIsEvicted) {
  BlockPool pool({.block_size = 4, .n_blocks = 1, .recycle = true});
  const BlockId a = *pool.allocate();
  pool.publish(a, 1);
  ASSERT_TRUE(pool.lookup_and_acquire(1).has_value());
  pool.release(a);
  pool.release(a);
  ASSERT_EQ(pool.allocate(), std::optional<BlockId>(a));  // evicted, the only block
  pool.publish(a, 2);
  pool.release(a);  // cached again, and unshared now
  pool.check_invariants();
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(a));
  pool.check_invariants();
}

TEST(BlockPool, PublishingADuplicateKeyKeepsTheFirstBlock) {
  BlockPool pool({.block_size = 4, .n_blocks = 3});
  BlockId a = *pool.allocate(), b = *pool.allocate();
  EXPECT_TRUE(pool.publish(a, 99));
  EXPECT_FALSE(pool.publish(b, 99));
  EXPECT_TRUE(pool.publish(a, 99));                      // again under its own key: no-op
  EXPECT_THROW(pool.publish(a, 100), std::logic_error);  // a second key
  pool.check_invariants();
  pool.release(b);  // unpublished: plainly free, not cached
  EXPECT_EQ(pool.stats().free, 2);
  EXPECT_EQ(pool.stats().cached_free, 0);
  EXPECT_EQ(pool.lookup_and_acquire(99), std::optional<BlockId>(a));
  EXPECT_THROW(pool.publish(b, 5), std::logic_error);  // b is not in use
  pool.check_invariants();
}

TEST(BlockPool, BlockKeyDependsOnParentEveryTokenAndOrder) {
  std::vector<std::int32_t> tokens = iota_tokens(16);
  const std::uint64_t key = BlockPool::block_key(BlockPool::kRootKey, tokens);
  EXPECT_EQ(key, BlockPool::block_key(BlockPool::kRootKey, tokens));
  EXPECT_NE(key, BlockPool::block_key(key, tokens));
  std::set<std::uint64_t> keys{key};
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    std::vector<std::int32_t> changed = tokens;
    changed[i] ^= 1;
    keys.insert(BlockPool::block_key(BlockPool::kRootKey, changed));
  }
  std::vector<std::int32_t> swapped = tokens;
  std::swap(swapped[0], swapped[1]);
  keys.insert(BlockPool::block_key(BlockPool::kRootKey, swapped));
  keys.insert(BlockPool::block_key(BlockPool::kRootKey, std::span(tokens).first(15)));
  EXPECT_EQ(keys.size(), tokens.size() + 3);
}

// ---- SequenceBlocks ---------------------------------------------------------------------------

// Acquires the prompt's cached prefix, room for the prompt, and commits it as computed.
std::int64_t admit(BlockPool& pool, SequenceBlocks& seq, const std::vector<std::int32_t>& prompt) {
  const std::int64_t cached = seq.acquire_prefix(pool, prompt);
  EXPECT_TRUE(seq.ensure_capacity(pool, static_cast<std::int64_t>(prompt.size())));
  seq.commit_full_blocks(pool, prompt);
  pool.check_invariants();
  return cached;
}

TEST(SequenceBlocks, IdenticalPromptsShareTheirFullBlocksAndComputeTheRest) {
  BlockPool pool({.block_size = 16, .n_blocks = 16});
  const std::vector<std::int32_t> prompt = iota_tokens(40);

  SequenceBlocks first(16);
  EXPECT_EQ(admit(pool, first, prompt), 0);
  ASSERT_EQ(first.table().size(), 3u);
  EXPECT_EQ(pool.stats().misses, 1);

  SequenceBlocks second(16);
  EXPECT_EQ(admit(pool, second, prompt), 32);  // 2 full blocks; tokens 32..39 computed
  ASSERT_EQ(second.table().size(), 3u);
  EXPECT_EQ(second.table()[0], first.table()[0]);
  EXPECT_EQ(second.table()[1], first.table()[1]);
  EXPECT_NE(second.table()[2], first.table()[2]);
  EXPECT_EQ(pool.ref_count(first.table()[0]), 2);
  EXPECT_EQ(pool.ref_count(first.table()[2]), 1);
  EXPECT_EQ(pool.stats().hits, 2);
  EXPECT_EQ(pool.stats().used, 4);

  // A different token in the second block: only the first block is shared.
  std::vector<std::int32_t> other = prompt;
  other[20] = 7;
  SequenceBlocks third(16);
  EXPECT_EQ(admit(pool, third, other), 16);
  ASSERT_EQ(third.table().size(), 3u);
  EXPECT_EQ(third.table()[0], first.table()[0]);
  EXPECT_NE(third.table()[1], first.table()[1]);
  EXPECT_EQ(pool.ref_count(first.table()[0]), 3);
  EXPECT_EQ(pool.stats().hits, 3);
  EXPECT_EQ(pool.stats().used, 6);

  for (SequenceBlocks* seq : {&first, &second, &third}) seq->release_all(pool);
  EXPECT_TRUE(first.table().empty());
  EXPECT_EQ(pool.stats().used, 0);
  // Published: first's 2 blocks and third's second block; partial blocks go back free.
  EXPECT_EQ(pool.stats().cached_free, 3);
  pool.check_invariants();
}

TEST(SequenceBlocks, NeverCoversTheLastPromptToken) {
  BlockPool pool({.block_size = 16, .n_blocks = 8});
  const std::vector<std::int32_t> prompt = iota_tokens(32);
  SequenceBlocks first(16);
  admit(pool, first, prompt);
  EXPECT_EQ(pool.stats().cached_free + pool.stats().used, 2);

  SequenceBlocks second(16);
  EXPECT_EQ(second.acquire_prefix(pool, prompt), 16);  // not 32: token 31 must be computed
  SequenceBlocks third(16);
  EXPECT_EQ(third.acquire_prefix(pool, std::span(prompt).first(16)), 0);
  SequenceBlocks fourth(16);
  EXPECT_EQ(fourth.acquire_prefix(pool, std::span(prompt).first(17)), 16);
  SequenceBlocks empty(16);
  EXPECT_EQ(empty.acquire_prefix(pool, {}), 0);
  pool.check_invariants();
}

TEST(SequenceBlocks, ReleasedPrefixIsFoundAgain) {
  BlockPool pool({.block_size = 16, .n_blocks = 8});
  const std::vector<std::int32_t> prompt = iota_tokens(40);
  SequenceBlocks first(16);
  admit(pool, first, prompt);
  const std::vector<BlockId> first_table = table_of(first);
  first.release_all(pool);
  EXPECT_EQ(pool.stats().cached_free, 2);
  EXPECT_EQ(pool.stats().free, 6);

  SequenceBlocks again(16);
  EXPECT_EQ(again.acquire_prefix(pool, prompt), 32);
  EXPECT_EQ(again.table()[0], first_table[0]);
  EXPECT_EQ(again.table()[1], first_table[1]);
  EXPECT_EQ(pool.stats().hits, 2);
  EXPECT_EQ(pool.stats().cached_free, 0);
  pool.check_invariants();
}

TEST(SequenceBlocks, ReleaseAllLetsTheCacheEvictAChainFromItsTail) {
  BlockPool pool({.block_size = 4, .n_blocks = 3});
  SequenceBlocks chain(4);
  admit(pool, chain, iota_tokens(12));  // 3 full blocks, all published
  EXPECT_EQ(pool.stats().used, 3);
  const std::vector<BlockId> table = table_of(chain);
  chain.release_all(pool);
  EXPECT_EQ(pool.stats().cached_free, 3);
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(table[2]));  // the tail goes first
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(table[1]));
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(table[0]));
  pool.check_invariants();
}

TEST(SequenceBlocks, EnsureCapacityFailureTakesNothingAndEvictsNothing) {
  BlockPool pool({.block_size = 4, .n_blocks = 4});
  SequenceBlocks cached(4);
  admit(pool, cached, iota_tokens(8));  // 2 published blocks
  cached.release_all(pool);
  ASSERT_EQ(pool.stats().cached_free, 2);

  SequenceBlocks seq(4);
  ASSERT_TRUE(seq.ensure_capacity(pool, 1));
  const auto before = pool.stats();
  EXPECT_FALSE(seq.ensure_capacity(pool, 4 * 5));  // needs 4 more, 3 available
  EXPECT_EQ(seq.table().size(), 1u);
  const auto after = pool.stats();
  EXPECT_EQ(after.used, before.used);
  EXPECT_EQ(after.free, before.free);
  EXPECT_EQ(after.cached_free, 2);
  EXPECT_EQ(after.evictions, 0);
  pool.check_invariants();

  EXPECT_TRUE(seq.ensure_capacity(pool, 4 * 4));  // exactly what is left
  EXPECT_EQ(seq.table().size(), 4u);
  EXPECT_EQ(pool.stats().evictions, 2);
  EXPECT_TRUE(seq.ensure_capacity(pool, 4 * 4));  // already covered: a no-op
  EXPECT_FALSE(seq.ensure_capacity(pool, 4 * 4 + 1));
  seq.release_all(pool);
  EXPECT_EQ(pool.stats().free, 4);
  pool.check_invariants();
}

TEST(SequenceBlocks, CommitPublishesOnlyNewlyFilledBlocks) {
  BlockPool pool({.block_size = 4, .n_blocks = 4});
  SequenceBlocks seq(4);
  std::vector<std::int32_t> tokens = iota_tokens(3);
  ASSERT_TRUE(seq.ensure_capacity(pool, 3));
  seq.commit_full_blocks(pool, tokens);  // no full block yet
  seq.release_all(pool);
  EXPECT_EQ(pool.stats().cached_free, 0);

  // Grow token by token, committing after each, as decoding does.
  tokens.clear();
  for (int i = 0; i < 10; ++i) {
    tokens.push_back(100 + i);
    ASSERT_TRUE(seq.ensure_capacity(pool, static_cast<std::int64_t>(tokens.size())));
    seq.commit_full_blocks(pool, tokens);
    pool.check_invariants();
  }
  seq.release_all(pool);
  EXPECT_EQ(pool.stats().cached_free, 2);  // tokens 0..7; 8..9 were a partial block

  SequenceBlocks reader(4);
  EXPECT_EQ(reader.acquire_prefix(pool, tokens), 8);
  EXPECT_THROW(reader.acquire_prefix(pool, tokens), std::logic_error);  // table not empty
  SequenceBlocks wrong_size(8);
  EXPECT_THROW(wrong_size.acquire_prefix(pool, tokens), std::logic_error);
}

// ---- Part of a block from the cache -----------------------------------------------------------

// A prompt with `shared` leading tokens of iota_tokens(40), then its own.
std::vector<std::int32_t> sharing(int shared, int total) {
  std::vector<std::int32_t> prompt = iota_tokens(shared);
  for (int i = shared; i < total; ++i) prompt.push_back(5000 + i);
  return prompt;
}

TEST(SequenceBlocks, BorrowsTheFirstPositionsOfACachedBlockUnderTheSamePrefix) {
  BlockPool pool({.block_size = 16, .n_blocks = 16});
  SequenceBlocks first(16);
  admit(pool, first, iota_tokens(40));  // blocks [0,16) and [16,32) published

  SequenceBlocks second(16);
  const std::vector<std::int32_t> prompt = sharing(21, 30);
  EXPECT_EQ(second.acquire_prefix(pool, prompt), 16);
  EXPECT_EQ(second.acquire_partial(pool, prompt), 21);  // 16 + the 5 tokens block 1 also has
  ASSERT_EQ(second.table().size(), 2u);
  EXPECT_EQ(second.table()[0], first.table()[0]);
  EXPECT_NE(second.table()[1], first.table()[1]);
  EXPECT_EQ(pool.ref_count(first.table()[1]), 2);  // first's, and borrowed
  EXPECT_EQ(pool.ref_count(second.table()[1]), 1);
  EXPECT_EQ(pool.stats().partial_hits, 1);
  pool.check_invariants();

  const std::optional<BlockCopy> copy = second.take_copy();
  ASSERT_TRUE(copy.has_value());
  EXPECT_EQ(copy->from, first.table()[1]);
  EXPECT_EQ(copy->to, second.table()[1]);
  EXPECT_FALSE(second.take_copy().has_value());  // handed over once
  pool.release(copy->from);                       // the rows are copied
  EXPECT_EQ(pool.ref_count(first.table()[1]), 1);

  // The block fills up with the sequence's own tokens and is published under its own key.
  ASSERT_TRUE(second.ensure_capacity(pool, 30));
  second.commit_full_blocks(pool, sharing(21, 32));
  pool.check_invariants();
  for (SequenceBlocks* seq : {&first, &second}) seq->release_all(pool);
  EXPECT_EQ(pool.stats().used, 0);
  pool.check_invariants();
}

TEST(SequenceBlocks, BorrowsTheCachedBlockThatSharesTheMostTokens) {
  BlockPool pool({.block_size = 8, .n_blocks = 16});
  SequenceBlocks a(8), b(8), c(8);
  admit(pool, a, sharing(10, 17));  // block [8,16) holds 8, 9, then its own
  admit(pool, b, sharing(13, 17));  // block [8,16) holds 8..12, then its own
  admit(pool, c, iota_tokens(17));  // block [8,16) holds 8..15
  for (SequenceBlocks* seq : {&a, &b, &c}) seq->release_all(pool);

  SequenceBlocks seq(8);
  const std::vector<std::int32_t> prompt = sharing(12, 20);
  EXPECT_EQ(seq.acquire_prefix(pool, prompt), 8);
  EXPECT_EQ(seq.acquire_partial(pool, prompt), 12);  // b's block has 8..11 and c's too
  const std::optional<BlockCopy> copy = seq.take_copy();
  ASSERT_TRUE(copy.has_value());
  EXPECT_EQ(pool.ref_count(copy->from), 1);
  pool.release(copy->from);

  // A prompt that leaves the cached prefix at its first token of the block borrows nothing.
  SequenceBlocks other(8);
  const std::vector<std::int32_t> apart = sharing(8, 20);
  EXPECT_EQ(other.acquire_prefix(pool, apart), 8);
  EXPECT_EQ(other.acquire_partial(pool, apart), 8);
  EXPECT_EQ(other.table().size(), 1u);
  EXPECT_FALSE(other.take_copy().has_value());
  // Nor one whose leading blocks differ, though the next block's tokens match.
  SequenceBlocks unrelated(8);
  std::vector<std::int32_t> moved = iota_tokens(20);
  moved[0] = 1;
  EXPECT_EQ(unrelated.acquire_prefix(pool, moved), 0);
  EXPECT_EQ(unrelated.acquire_partial(pool, moved), 0);
  for (SequenceBlocks* s : {&seq, &other, &unrelated}) s->release_all(pool);
  EXPECT_EQ(pool.stats().used, 0);
  pool.check_invariants();
}

TEST(SequenceBlocks, BorrowingNeverCoversTheLastPromptToken) {
  BlockPool pool({.block_size = 16, .n_blocks = 8});
  SequenceBlocks first(16);
  admit(pool, first, iota_tokens(40));
  for (int length : {17, 18, 20, 32, 33}) {
    SequenceBlocks seq(16);
    const std::vector<std::int32_t> prompt = iota_tokens(length);
    const std::int64_t full = seq.acquire_prefix(pool, prompt);
    EXPECT_EQ(seq.acquire_partial(pool, prompt), length - 1) << length << " tokens";
    EXPECT_EQ(full, length == 33 ? 32 : 16);
    seq.release_all(pool);  // releases the borrowed block too, not taken
    pool.check_invariants();
  }
  EXPECT_EQ(pool.stats().used, 3);
  SequenceBlocks one(16);
  EXPECT_EQ(one.acquire_partial(pool, iota_tokens(1)), 0);
  EXPECT_THROW(first.acquire_partial(pool, iota_tokens(40)), std::logic_error);  // has its own
  pool.check_invariants();
}

TEST(SequenceBlocks, BorrowsNothingWhenNoFreshBlockIsLeft) {
  BlockPool pool({.block_size = 4, .n_blocks = 2});
  SequenceBlocks first(4);
  admit(pool, first, iota_tokens(8));  // both blocks, published and in use
  SequenceBlocks seq(4);
  const std::vector<std::int32_t> prompt = sharing(6, 9);
  EXPECT_EQ(seq.acquire_prefix(pool, prompt), 4);
  EXPECT_EQ(seq.acquire_partial(pool, prompt), 4);
  EXPECT_FALSE(seq.take_copy().has_value());
  EXPECT_EQ(pool.ref_count(first.table()[1]), 1);  // not left borrowed
  pool.check_invariants();
}

TEST(BlockPool, EvictedBlocksAreNoLongerBorrowed) {
  BlockPool pool({.block_size = 4, .n_blocks = 2});
  SequenceBlocks first(4);
  admit(pool, first, iota_tokens(8));
  first.release_all(pool);
  ASSERT_EQ(pool.stats().cached_free, 2);
  const BlockId taken = *pool.allocate();  // evicts the tail block, [4, 8)
  pool.check_invariants();
  SequenceBlocks seq(4);
  const std::vector<std::int32_t> prompt = sharing(6, 9);
  EXPECT_EQ(seq.acquire_prefix(pool, prompt), 4);
  EXPECT_EQ(seq.acquire_partial(pool, prompt), 4);
  EXPECT_EQ(pool.stats().partial_hits, 0);
  pool.release(taken);
  seq.release_all(pool);
  pool.check_invariants();
}

TEST(BlockPool, FilingABlockChecksItsTokens) {
  BlockPool pool({.block_size = 4, .n_blocks = 2});
  const BlockId a = *pool.allocate();
  const std::vector<std::int32_t> tokens = iota_tokens(4);
  EXPECT_THROW(pool.publish(a, 1, BlockPool::kRootKey, std::span(tokens).first(3)), std::logic_error);
  EXPECT_TRUE(pool.publish(a, BlockPool::block_key(BlockPool::kRootKey, tokens), BlockPool::kRootKey, tokens));
  pool.check_invariants();
  const std::optional<BlockPool::Partial> found = pool.acquire_partial(BlockPool::kRootKey, std::span(tokens).first(2));
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->block, a);
  EXPECT_EQ(found->tokens, 2);
  EXPECT_EQ(pool.ref_count(a), 2);
  EXPECT_FALSE(pool.acquire_partial(BlockPool::kRootKey, {}).has_value());
  EXPECT_FALSE(pool.acquire_partial(7, tokens).has_value());  // no block under that parent
}

// ---- Randomized property test ---------------------------------------------------------------

// Arrivals with prompts drawn from a few shared prefixes, decode growth, finishes and
// cancellations at any point, against a shadow of what each block holds: a block a sequence
// writes must be its alone, and a block reused from the cache must hold the prompt's tokens.
class RandomWorkload : public ::testing::TestWithParam<bool> {};

TEST_P(RandomWorkload, KeepsInvariantsAndLeaksNothing) {
  constexpr int kBlockSize = 8;
  constexpr std::int64_t kBlocks = 40;  // small enough that rejections and preemptions happen
  BlockPool pool({.block_size = kBlockSize, .n_blocks = kBlocks, .recycle = GetParam()});
  std::mt19937_64 rng(20240611);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };

  std::vector<std::vector<std::int32_t>> prefixes;
  for (int p = 0; p < 4; ++p) {
    std::vector<std::int32_t> prefix(static_cast<std::size_t>(uniform(16, 48)));
    for (auto& t : prefix) t = uniform(0, 1000);
    prefixes.push_back(std::move(prefix));
  }
  constexpr std::int32_t kUnwritten = -1;
  std::vector<std::vector<std::int32_t>> contents(
      kBlocks, std::vector<std::int32_t>(kBlockSize, kUnwritten));

  struct Sequence {
    SequenceBlocks blocks{kBlockSize};
    std::vector<std::int32_t> tokens;  // all computed
    std::size_t target = 0;            // finishes at this length
  };
  std::vector<Sequence> active;

  // Writes tokens [from, size) into the sequence's blocks, which must be exclusively its own.
  auto compute = [&](Sequence& seq, std::size_t from) {
    for (std::size_t p = from; p < seq.tokens.size(); ++p) {
      const BlockId id = seq.blocks.table()[p / kBlockSize];
      ASSERT_EQ(pool.ref_count(id), 1) << "writing into a shared block";
      contents[static_cast<std::size_t>(id)][p % kBlockSize] = seq.tokens[p];
    }
    seq.blocks.commit_full_blocks(pool, seq.tokens);
  };
  auto finish = [&](std::size_t i) {
    active[i].blocks.release_all(pool);
    active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
  };

  std::int64_t admitted = 0, rejected = 0, preempted = 0, cached_tokens = 0, borrowed = 0;
  for (int step = 0; step < 20000; ++step) {
    const int action = uniform(0, 99);
    if (action < 25 && active.size() < 12) {  // arrival
      Sequence seq;
      const auto& prefix = prefixes[static_cast<std::size_t>(uniform(0, 3))];
      seq.tokens.assign(prefix.begin(),
                        prefix.begin() + uniform(0, static_cast<int>(prefix.size())));
      for (int n = uniform(0, 20); n > 0; --n) seq.tokens.push_back(uniform(0, 1000));
      if (seq.tokens.empty()) seq.tokens.push_back(1);
      seq.target = seq.tokens.size() + static_cast<std::size_t>(uniform(1, 40));
      const std::int64_t used_before = pool.stats().used;

      const std::int64_t full = seq.blocks.acquire_prefix(pool, seq.tokens);
      ASSERT_EQ(full % kBlockSize, 0);
      // Half the arrivals also borrow the first positions of the next block, copied at once.
      const std::int64_t cached = uniform(0, 1) == 0 ? seq.blocks.acquire_partial(pool, seq.tokens) : full;
      ASSERT_GE(cached, full);
      ASSERT_LT(cached, static_cast<std::int64_t>(seq.tokens.size()));
      if (const std::optional<BlockCopy> copy = seq.blocks.take_copy()) {
        ASSERT_EQ(pool.ref_count(copy->to), 1);
        contents[static_cast<std::size_t>(copy->to)] = contents[static_cast<std::size_t>(copy->from)];
        pool.release(copy->from);
        ++borrowed;
      } else {
        ASSERT_EQ(cached, full);
      }
      for (std::int64_t p = 0; p < cached; ++p) {
        const BlockId id = seq.blocks.table()[static_cast<std::size_t>(p / kBlockSize)];
        ASSERT_EQ(contents[static_cast<std::size_t>(id)][static_cast<std::size_t>(p % kBlockSize)],
                  seq.tokens[static_cast<std::size_t>(p)])
            << "cache hit with other tokens";
      }
      pool.check_invariants();
      if (uniform(0, 19) == 0) {  // cancelled before its prompt ran
        seq.blocks.release_all(pool);
        ASSERT_EQ(pool.stats().used, used_before);
      } else if (!seq.blocks.ensure_capacity(pool,
                                             static_cast<std::int64_t>(seq.tokens.size()))) {
        ++rejected;
        // Nothing kept past the blocks the cache covered.
        ASSERT_EQ(seq.blocks.capacity_tokens(), (cached + kBlockSize - 1) / kBlockSize * kBlockSize);
        seq.blocks.release_all(pool);
        ASSERT_EQ(pool.stats().used, used_before);
      } else {
        ++admitted;
        cached_tokens += cached;
        compute(seq, static_cast<std::size_t>(cached));
        active.push_back(std::move(seq));
      }
    } else if (action < 85 && !active.empty()) {  // one decode step
      const std::size_t i = static_cast<std::size_t>(uniform(0, static_cast<int>(active.size()) - 1));
      Sequence& seq = active[i];
      seq.tokens.push_back(uniform(0, 1000));
      if (!seq.blocks.ensure_capacity(pool, static_cast<std::int64_t>(seq.tokens.size()))) {
        ++preempted;
        finish(i);
      } else {
        compute(seq, seq.tokens.size() - 1);
        if (seq.tokens.size() >= seq.target) finish(i);
      }
    } else if (action < 90 && !active.empty()) {  // cancelled at any time
      finish(static_cast<std::size_t>(uniform(0, static_cast<int>(active.size()) - 1)));
    }
    ASSERT_NO_THROW(pool.check_invariants()) << "step " << step;
    if (HasFatalFailure()) return;
  }

  while (!active.empty()) finish(active.size() - 1);
  pool.check_invariants();
  const BlockPoolStats stats = pool.stats();
  EXPECT_EQ(stats.used, 0);
  EXPECT_EQ(stats.free + stats.cached_free, kBlocks);
  EXPECT_GT(stats.hits, 0);
  EXPECT_GT(stats.evictions, 0);
  EXPECT_GT(admitted, 1000);
  EXPECT_GT(rejected, 0);   // the pool ran out at admission
  EXPECT_GT(preempted, 0);  // and while decoding
  EXPECT_GT(cached_tokens, 0);
  EXPECT_GT(borrowed, 0);
  EXPECT_GE(stats.partial_hits, borrowed);  // a block found, but none fresh to copy it to, borrows nothing
  const double hit_rate = static_cast<double>(stats.hits) /
                          static_cast<double>(stats.hits + stats.misses);
  EXPECT_GT(hit_rate, 0.0);
  RecordProperty("hit_rate_permille", static_cast<int>(hit_rate * 1000));
  RecordProperty("rejected", static_cast<int>(rejected));
  RecordProperty("preempted", static_cast<int>(preempted));
}

INSTANTIATE_TEST_SUITE_P(SequenceBlocks, RandomWorkload, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Recycling" : "SpreadingOverThePool";
                         });

}  // namespace
}  // namespace batchlm::local_engine
