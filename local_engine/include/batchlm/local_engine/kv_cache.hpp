#pragma once
// The block allocator of a paged KV cache with prefix caching. BlockPool keeps the bookkeeping
// only (reference counts, prefix keys, free and cached lists) for block ids 0..n_blocks-1; the
// caller maps a block id to its K/V memory, e.g.
//   k_cache; // (n_blocks, block_size, n_kv_heads, head_dim) per layer
// SequenceBlocks is one sequence's block table on top of a pool.
//
// A block is in exactly one state:
//   free    refcount 0, no key; never used or freed without a key.
//   cached  refcount 0, keyed; still findable by lookup_and_acquire until evicted. A cached
//           block that lookup_and_acquire has found at least once is "shared", any other
//           "unshared" (its tokens were one sequence's own so far).
//   used    refcount > 0, keyed (published) or not.
// Memory a block has never held is only touched when the block is first written, and the
// first touch is what costs (the system maps and zeroes the pages), so allocate() reuses
// blocks whose memory has been written before where it can (see BlockPoolOptions::recycle).
// Every operation is O(1) expected (a hash map and three intrusive lists); check_invariants() is
// O(n_blocks) and meant for tests. Thread-compatible: the engine thread alone uses a pool.

#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

namespace batchlm::local_engine {

using BlockId = std::int32_t;

struct BlockPoolOptions {
  int block_size = 16;        // tokens per block
  std::int64_t n_blocks = 0;  // > 0 and <= INT32_MAX
  // false: the prefix cache may spread over the whole pool; a block never used is taken
  // before any cached block is evicted. true: cached blocks never found again (the prompts
  // and outputs of finished sequences that no other sequence shared) are evicted before a
  // block never used is taken, so the pool's memory grows only with the running sequences
  // and reuses what is already paged in; shared cached blocks (a common prompt prefix) are
  // still kept until nothing else is left. Suits batch jobs, whose items share a prefix but
  // do not come back.
  bool recycle = false;
};

struct BlockPoolStats {
  std::int64_t n_blocks = 0;
  std::int64_t used = 0;         // refcount > 0
  std::int64_t free = 0;         // refcount 0, no key
  std::int64_t cached_free = 0;  // refcount 0, keyed, evictable
  std::int64_t hits = 0;         // lookup_and_acquire found the key
  std::int64_t misses = 0;       // lookup_and_acquire did not
  std::int64_t evictions = 0;    // cached blocks handed out by allocate()
  std::int64_t partial_hits = 0;  // acquire_partial found a block
};

// Positions copied from one block to another in every layer before a forward pass reads them
// (SequenceBlocks::acquire_partial). The whole block is copied: past the positions that were
// asked for, the copy holds rows the sequence writes over before it reads them.
struct BlockCopy {
  BlockId from = 0;
  BlockId to = 0;
};

class BlockPool {
 public:
  // The parent key of a sequence's first block.
  static constexpr std::uint64_t kRootKey = 0x6b76'6361'6368'6531ULL;  // "kvcache1"

  // Throws std::invalid_argument when block_size <= 0 or n_blocks is not in 1..INT32_MAX.
  explicit BlockPool(BlockPoolOptions options);

  int block_size() const { return block_size_; }
  std::int64_t n_blocks() const { return static_cast<std::int64_t>(blocks_.size()) - 3; }
  // Blocks allocate() can still hand out: free plus cached (by evicting).
  std::int64_t available() const { return n_free_ + n_cached_; }

  // A block with refcount 1, the first there is of: a free block written before (the most
  // recently released first); with `recycle`, an unshared cached block (released longest ago
  // first); a block never used (lowest id first); the cached block released longest ago. An
  // evicted block's key is forgotten. nullopt when every block is used.
  std::optional<BlockId> allocate();
  // Drops one reference. At 0 a keyed block becomes cached (most recently freed), any other
  // block free. Throws std::logic_error when the block is not used (refcount would go < 0).
  void release(BlockId id);

  // The key of a full block: a 64-bit hash of the parent's key and the block's token ids, so
  // equal keys mean equal prefixes (up to a 2^-64 collision). Chain from kRootKey.
  static std::uint64_t block_key(std::uint64_t parent, std::span<const std::int32_t> tokens);
  // Makes a used, full block findable under `key`. When another block already holds the key
  // the existing one is kept and this one stays unpublished: returns false. Publishing a block
  // again under its own key is a no-op (true). Throws std::logic_error when the block is not
  // used or already holds a different key.
  bool publish(BlockId id, std::uint64_t key);
  // The same, and when the block is published it is also filed under its parent's key with its
  // tokens (block_size of them), for acquire_partial.
  bool publish(BlockId id, std::uint64_t key, std::uint64_t parent, std::span<const std::int32_t> tokens);
  // The block published under `key`, its refcount incremented (out of the cached list when it
  // was cached); nullopt on a miss. Counts a hit or a miss.
  std::optional<BlockId> lookup_and_acquire(std::uint64_t key);
  // Of the blocks filed under `parent`, the one whose tokens begin with the longest run of
  // `tokens` (at least the first; ties go to a block found before, then to the lowest id), its
  // refcount incremented as by lookup_and_acquire, and the length of that run; nullopt when no
  // filed block begins with tokens[0]. Counts a partial hit.
  struct Partial {
    BlockId block;
    std::int64_t tokens;
  };
  std::optional<Partial> acquire_partial(std::uint64_t parent, std::span<const std::int32_t> tokens);

  std::int32_t ref_count(BlockId id) const;
  BlockPoolStats stats() const;
  // Throws std::logic_error describing the first broken invariant.
  void check_invariants() const;

 private:
  enum class State : std::uint8_t { kFree, kCached, kUsed };
  struct Block {
    std::int32_t ref_count = 0;
    State state = State::kFree;
    bool has_key = false;
    bool shared = false;  // found by lookup_and_acquire since it was last allocated
    bool filed = false;   // in children_ under `parent`, its tokens in tokens_
    std::uint64_t key = 0;
    std::uint64_t parent = 0;
    std::uint64_t released = 0;    // when it last became cached (a release count)
    BlockId prev = -1, next = -1;  // links of the free or cached list this block is on
  };

  // Circular doubly linked lists threaded through blocks_, with sentinels at the end of blocks_:
  // the free blocks (written-before ones at the front, most recent first; then the blocks never
  // used, in id order), and the cached blocks unshared and shared, each released longest ago first.
  BlockId free_head() const { return static_cast<BlockId>(blocks_.size() - 3); }
  BlockId unshared_head() const { return static_cast<BlockId>(blocks_.size() - 2); }
  BlockId shared_head() const { return static_cast<BlockId>(blocks_.size() - 1); }
  BlockId evict(BlockId head);  // the first block of a cached list, made keyless and unlinked
  void acquire(BlockId id);     // one more reference to a published block, used or cached
  std::span<const std::int32_t> tokens_of(BlockId id) const;
  void push_back(BlockId head, BlockId id);
  void push_front(BlockId head, BlockId id);
  void unlink(BlockId id);
  const Block& checked(BlockId id, const char* operation) const;  // throws when out of range
  Block& checked(BlockId id, const char* operation);

  int block_size_;
  bool recycle_;
  std::vector<Block> blocks_;                       // n_blocks + 3 sentinels
  std::unordered_map<std::uint64_t, BlockId> by_key_;  // published blocks, used or cached
  // Published blocks filed with their tokens, by their parent's key.
  std::unordered_multimap<std::uint64_t, BlockId> children_;
  std::vector<std::int32_t> tokens_;  // block_size per block, for the filed ones
  std::int64_t n_free_ = 0, n_cached_ = 0, n_used_ = 0;
  std::int64_t n_unshared_ = 0;  // of n_cached_
  BlockId never_used_ = 0;       // blocks [never_used_, n_blocks) have never been allocated
  std::uint64_t releases_ = 0;
  std::int64_t hits_ = 0, misses_ = 0, evictions_ = 0, partial_hits_ = 0;
};

// One sequence's block table: block i holds positions [i*block_size, (i+1)*block_size).
// The leading full blocks that were taken from the cache or published by this sequence carry
// chained keys; the rest are private to it and written by it alone.
class SequenceBlocks {
 public:
  explicit SequenceBlocks(int block_size);

  int block_size() const { return block_size_; }
  std::span<const BlockId> table() const { return table_; }
  std::int64_t capacity_tokens() const {
    return static_cast<std::int64_t>(table_.size()) * block_size_;
  }

  // On an empty table: takes the longest chain of cached full blocks matching the prompt's
  // prefix and returns the tokens they cover. Stops before the block holding the last prompt
  // token, which must be computed to get logits, so at most (size-1)/block_size blocks.
  std::int64_t acquire_prefix(BlockPool& pool, std::span<const std::int32_t> prompt);
  // Right after acquire_prefix: the positions of the next block that a published block holds
  // already. Of the blocks filed under the last acquired block's key (kRootKey for none), the
  // one that shares the most leading tokens with the rest of the prompt (never its last token)
  // is borrowed and a fresh block is appended to the table. Returns the prompt tokens now
  // covered: acquire_prefix's count, plus the shared length when a block was found and a fresh
  // one could be had. The fresh block's rows come from the borrowed one by a copy the caller
  // makes before they are read: take_copy() hands it over.
  std::int64_t acquire_partial(BlockPool& pool, std::span<const std::int32_t> prompt);
  // The copy acquire_partial left to make, if any; the caller then holds the reference to the
  // borrowed block (`from`) and releases it once the rows are copied. release_all() releases a
  // borrowed block not taken.
  std::optional<BlockCopy> take_copy();
  // Appends blocks until the table covers n_tokens. When the pool cannot supply them all it
  // takes none (and evicts nothing) and returns false.
  bool ensure_capacity(BlockPool& pool, std::int64_t n_tokens);
  // `tokens` are the sequence's tokens whose K/V are now written (a prefix of its table).
  // Publishes every full block not yet keyed, under its chained key, filed with its tokens.
  void commit_full_blocks(BlockPool& pool, std::span<const std::int32_t> tokens);
  // Releases the blocks past those that hold positions [0, n_tokens), the last first: the
  // rollback of positions written speculatively and then rejected. Throws std::logic_error when
  // that would release a keyed block (keys cover only tokens known to be final).
  void truncate(BlockPool& pool, std::int64_t n_tokens);
  // Releases every block, the last first: the cache then evicts a chain from its tail, since a
  // block is useless once its parent is gone.
  void release_all(BlockPool& pool);

 private:
  void check_pool(const BlockPool& pool) const;

  int block_size_;
  std::vector<BlockId> table_;
  std::vector<std::uint64_t> keys_;  // chained keys of the leading keyed blocks
  std::optional<BlockCopy> copy_;    // borrowed by acquire_partial, not yet taken
};

}  // namespace batchlm::local_engine
