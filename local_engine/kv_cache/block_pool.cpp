#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

#include "batchlm/local_engine/kv_cache.hpp"

namespace batchlm::local_engine {
namespace {

// The splitmix64 / murmur3 finalizer: a bijection on 64 bits in which every input bit flips
// each output bit with probability ~1/2.
std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

[[noreturn]] void fail(const std::string& what) {
  throw std::logic_error("BlockPool: " + what);
}

}  // namespace

BlockPool::BlockPool(BlockPoolOptions options)
    : block_size_(options.block_size), recycle_(options.recycle) {
  if (options.block_size <= 0) throw std::invalid_argument("BlockPool: block_size must be > 0");
  if (options.n_blocks <= 0 || options.n_blocks > std::numeric_limits<BlockId>::max() - 2)
    throw std::invalid_argument("BlockPool: n_blocks must be in 1..INT32_MAX-2");
  blocks_.resize(static_cast<std::size_t>(options.n_blocks) + 3);
  for (BlockId head : {free_head(), unshared_head(), shared_head()}) {
    blocks_[static_cast<std::size_t>(head)].prev = head;
    blocks_[static_cast<std::size_t>(head)].next = head;
  }
  // Ascending order, so a fresh pool hands out 0, 1, 2, ...
  for (BlockId id = 0; id < options.n_blocks; ++id) push_back(free_head(), id);
  n_free_ = options.n_blocks;
  by_key_.reserve(static_cast<std::size_t>(options.n_blocks));
}

std::span<const std::int32_t> BlockPool::tokens_of(BlockId id) const {
  const auto bs = static_cast<std::size_t>(block_size_);
  return std::span<const std::int32_t>(tokens_).subspan(static_cast<std::size_t>(id) * bs, bs);
}

void BlockPool::push_back(BlockId head, BlockId id) {
  Block& h = blocks_[static_cast<std::size_t>(head)];
  Block& b = blocks_[static_cast<std::size_t>(id)];
  b.prev = h.prev;
  b.next = head;
  blocks_[static_cast<std::size_t>(h.prev)].next = id;
  h.prev = id;
}

void BlockPool::push_front(BlockId head, BlockId id) {
  Block& h = blocks_[static_cast<std::size_t>(head)];
  Block& b = blocks_[static_cast<std::size_t>(id)];
  b.prev = head;
  b.next = h.next;
  blocks_[static_cast<std::size_t>(h.next)].prev = id;
  h.next = id;
}

void BlockPool::unlink(BlockId id) {
  Block& b = blocks_[static_cast<std::size_t>(id)];
  blocks_[static_cast<std::size_t>(b.prev)].next = b.next;
  blocks_[static_cast<std::size_t>(b.next)].prev = b.prev;
  b.prev = b.next = -1;
}

const BlockPool::Block& BlockPool::checked(BlockId id, const char* operation) const {
  if (id < 0 || id >= n_blocks())
    fail(std::string(operation) + " of block " + std::to_string(id) + " out of range");
  return blocks_[static_cast<std::size_t>(id)];
}

BlockPool::Block& BlockPool::checked(BlockId id, const char* operation) {
  return const_cast<Block&>(std::as_const(*this).checked(id, operation));
}

BlockId BlockPool::evict(BlockId head) {
  const BlockId id = blocks_[static_cast<std::size_t>(head)].next;  // released longest ago
  Block& b = blocks_[static_cast<std::size_t>(id)];
  by_key_.erase(b.key);
  if (b.filed) {
    auto [first, last] = children_.equal_range(b.parent);
    while (first->second != id) ++first;  // filed, so it is there
    children_.erase(first);
    b.filed = false;
  }
  b.has_key = false;
  b.key = 0;
  if (!b.shared) --n_unshared_;
  --n_cached_;
  ++evictions_;
  unlink(id);
  return id;
}

std::optional<BlockId> BlockPool::allocate() {
  const BlockId first_free = blocks_[static_cast<std::size_t>(free_head())].next;
  const auto take_free = [&] {
    --n_free_;
    unlink(first_free);
    return first_free;
  };
  BlockId id;
  if (n_free_ > 0 && first_free < never_used_) {  // written before
    id = take_free();
  } else if (recycle_ && n_unshared_ > 0) {
    id = evict(unshared_head());
  } else if (n_free_ > 0) {  // never used
    id = take_free();
  } else if (n_cached_ > 0) {
    // The block released longest ago, of either list.
    const Block& u = blocks_[static_cast<std::size_t>(blocks_[static_cast<std::size_t>(unshared_head())].next)];
    const Block& s = blocks_[static_cast<std::size_t>(blocks_[static_cast<std::size_t>(shared_head())].next)];
    const bool shared_empty = n_cached_ == n_unshared_;
    id = evict(n_unshared_ > 0 && (shared_empty || u.released < s.released) ? unshared_head() : shared_head());
  } else {
    return std::nullopt;
  }
  if (id >= never_used_) never_used_ = id + 1;
  Block& b = blocks_[static_cast<std::size_t>(id)];
  b.state = State::kUsed;
  b.ref_count = 1;
  b.shared = false;
  ++n_used_;
  return id;
}

void BlockPool::release(BlockId id) {
  Block& b = checked(id, "release");
  if (b.state != State::kUsed) fail("release of block " + std::to_string(id) + " not in use");
  if (--b.ref_count > 0) return;
  --n_used_;
  if (b.has_key) {
    b.state = State::kCached;
    b.released = ++releases_;
    push_back(b.shared ? shared_head() : unshared_head(), id);  // most recently freed: evicted last
    ++n_cached_;
    if (!b.shared) ++n_unshared_;
  } else {
    // Reused first: its memory is the most recently touched (in cache, and paged in, where a
    // block never used yet would first be faulted in and zeroed by the system).
    b.state = State::kFree;
    push_front(free_head(), id);
    ++n_free_;
  }
}

std::uint64_t BlockPool::block_key(std::uint64_t parent, std::span<const std::int32_t> tokens) {
  // Each step is a bijection of the state for a fixed token, so two blocks with the same parent
  // that differ in one token never collide; the length is mixed in last.
  std::uint64_t h = mix64(parent ^ 0x9e3779b97f4a7c15ULL);
  for (std::int32_t token : tokens) h = mix64(h + static_cast<std::uint32_t>(token));
  return mix64(h ^ static_cast<std::uint64_t>(tokens.size()));
}

bool BlockPool::publish(BlockId id, std::uint64_t key) {
  Block& b = checked(id, "publish");
  if (b.state != State::kUsed) fail("publish of block " + std::to_string(id) + " not in use");
  if (b.has_key) {
    if (b.key != key) fail("publish of block " + std::to_string(id) + " under a second key");
    return true;
  }
  auto [it, inserted] = by_key_.try_emplace(key, id);
  if (!inserted) return false;  // another block holds the same prefix: keep that one
  b.has_key = true;
  b.key = key;
  return true;
}

bool BlockPool::publish(BlockId id, std::uint64_t key, std::uint64_t parent,
                        std::span<const std::int32_t> tokens) {
  if (std::ssize(tokens) != block_size_)
    fail("publish of block " + std::to_string(id) + " with " + std::to_string(tokens.size()) +
         " tokens");
  const bool keyed_before = checked(id, "publish").has_key;
  if (!publish(id, key)) return false;
  Block& b = blocks_[static_cast<std::size_t>(id)];
  if (keyed_before) return true;
  if (tokens_.empty()) tokens_.resize(static_cast<std::size_t>(n_blocks() * block_size_));
  std::copy(tokens.begin(), tokens.end(), tokens_.begin() + static_cast<std::ptrdiff_t>(id) * block_size_);
  b.parent = parent;
  b.filed = true;
  children_.emplace(parent, id);
  return true;
}

std::optional<BlockPool::Partial> BlockPool::acquire_partial(std::uint64_t parent,
                                                             std::span<const std::int32_t> tokens) {
  if (tokens.empty()) return std::nullopt;
  std::optional<Partial> best;
  auto [first, last] = children_.equal_range(parent);
  for (; first != last; ++first) {
    const BlockId id = first->second;
    const std::span<const std::int32_t> held = tokens_of(id);
    const std::size_t limit = std::min(held.size(), tokens.size());
    std::size_t n = 0;
    while (n < limit && held[n] == tokens[n]) ++n;
    if (n == 0) continue;
    const auto better = [&](const Partial& p) {
      if (static_cast<std::int64_t>(n) != p.tokens) return static_cast<std::int64_t>(n) > p.tokens;
      const bool shared = blocks_[static_cast<std::size_t>(id)].shared;
      const bool best_shared = blocks_[static_cast<std::size_t>(p.block)].shared;
      return shared != best_shared ? shared : id < p.block;
    };
    if (!best || better(*best)) best = Partial{id, static_cast<std::int64_t>(n)};
  }
  if (!best) return std::nullopt;
  ++partial_hits_;
  acquire(best->block);
  return best;
}

std::optional<BlockId> BlockPool::lookup_and_acquire(std::uint64_t key) {
  auto it = by_key_.find(key);
  if (it == by_key_.end()) {
    ++misses_;
    return std::nullopt;
  }
  ++hits_;
  acquire(it->second);
  return it->second;
}

void BlockPool::acquire(BlockId id) {
  Block& b = blocks_[static_cast<std::size_t>(id)];
  if (b.state == State::kCached) {
    unlink(id);
    b.state = State::kUsed;
    --n_cached_;
    if (!b.shared) --n_unshared_;
    ++n_used_;
  }
  b.shared = true;
  ++b.ref_count;
}

std::int32_t BlockPool::ref_count(BlockId id) const {
  return checked(id, "ref_count").ref_count;
}

BlockPoolStats BlockPool::stats() const {
  return {.n_blocks = n_blocks(),
          .used = n_used_,
          .free = n_free_,
          .cached_free = n_cached_,
          .hits = hits_,
          .misses = misses_,
          .evictions = evictions_,
          .partial_hits = partial_hits_};
}

void BlockPool::check_invariants() const {
  const std::int64_t n = n_blocks();
  auto name = [](BlockId id) { return "block " + std::to_string(id); };
  // Walk each list, checking links and that its members are in the list's state.
  auto walk = [&](BlockId head, State state, const char* list) {
    std::int64_t count = 0;
    BlockId prev = head;
    for (BlockId id = blocks_[static_cast<std::size_t>(head)].next; id != head;
         id = blocks_[static_cast<std::size_t>(id)].next) {
      if (id < 0 || id >= n) fail(std::string(list) + " list links out of range");
      if (++count > n) fail(std::string(list) + " list has a cycle");
      const Block& b = blocks_[static_cast<std::size_t>(id)];
      if (b.prev != prev) fail(name(id) + " has a broken prev link");
      if (b.state != state) fail(name(id) + " on the " + list + " list in another state");
      prev = id;
    }
    if (blocks_[static_cast<std::size_t>(head)].prev != prev)
      fail(std::string(list) + " list tail link broken");
    return count;
  };
  const std::int64_t free_listed = walk(free_head(), State::kFree, "free");
  const std::int64_t unshared_listed = walk(unshared_head(), State::kCached, "unshared");
  const std::int64_t cached_listed = unshared_listed + walk(shared_head(), State::kCached, "shared");
  auto check_shared = [&](BlockId head, bool shared, const char* list) {
    std::uint64_t last = 0;
    for (BlockId id = blocks_[static_cast<std::size_t>(head)].next; id != head;
         id = blocks_[static_cast<std::size_t>(id)].next) {
      const Block& b = blocks_[static_cast<std::size_t>(id)];
      if (b.shared != shared) fail(name(id) + " on the " + list + " list is not " + list);
      if (b.released <= last) fail(std::string(list) + " list out of release order");
      last = b.released;
    }
  };
  check_shared(unshared_head(), false, "unshared");
  check_shared(shared_head(), true, "shared");
  if (unshared_listed != n_unshared_) fail("unshared counter disagrees with its list");
  // The free list: blocks written before, then those never used in id order.
  bool in_never_used = false;
  BlockId last_never_used = -1;
  for (BlockId id = blocks_[static_cast<std::size_t>(free_head())].next; id != free_head();
       id = blocks_[static_cast<std::size_t>(id)].next) {
    if (id >= never_used_) {
      in_never_used = true;
      if (id <= last_never_used) fail("never-used blocks out of id order on the free list");
      last_never_used = id;
    } else if (in_never_used) {
      fail(name(id) + " written before follows a never-used block on the free list");
    }
  }

  std::int64_t free = 0, cached = 0, used = 0, keyed = 0, filed = 0;
  for (BlockId id = 0; id < n; ++id) {
    const Block& b = blocks_[static_cast<std::size_t>(id)];
    if (id >= never_used_ && (b.state != State::kFree || b.shared))
      fail(name(id) + " was never allocated but is not free");
    switch (b.state) {
      case State::kFree:
        ++free;
        if (b.ref_count != 0) fail(name(id) + " is free with refcount != 0");
        if (b.has_key) fail(name(id) + " is free but keyed");
        break;
      case State::kCached:
        ++cached;
        if (b.ref_count != 0) fail(name(id) + " is cached with refcount != 0");
        if (!b.has_key) fail(name(id) + " is cached without a key");
        break;
      case State::kUsed:
        ++used;
        if (b.ref_count <= 0) fail(name(id) + " is used with refcount <= 0");
        if (b.prev != -1 || b.next != -1) fail(name(id) + " is used but linked on a list");
        break;
    }
    if (b.has_key) {
      ++keyed;
      auto it = by_key_.find(b.key);
      if (it == by_key_.end() || it->second != id) fail(name(id) + " key missing from the map");
    }
    if (b.filed) {
      ++filed;
      if (!b.has_key) fail(name(id) + " is filed under its parent but not keyed");
      auto [first, last] = children_.equal_range(b.parent);
      if (std::count_if(first, last, [&](const auto& entry) { return entry.second == id; }) != 1)
        fail(name(id) + " is not filed exactly once under its parent");
      if (BlockPool::block_key(b.parent, tokens_of(id)) != b.key)
        fail(name(id) + " holds tokens that do not give its key");
    }
  }
  if (filed != static_cast<std::int64_t>(children_.size()))
    fail("the parent index holds entries for blocks not filed");
  if (free != free_listed || cached != cached_listed)
    fail("list lengths disagree with block states");
  if (free != n_free_ || cached != n_cached_ || used != n_used_)
    fail("counters disagree with block states");
  if (free + cached + used != n) fail("free + cached + used != n_blocks");
  if (keyed != static_cast<std::int64_t>(by_key_.size()))
    fail("key map holds entries for blocks without that key");
  for (const auto& [key, id] : by_key_) {
    if (id < 0 || id >= n) fail("key map points out of range");
    const Block& b = blocks_[static_cast<std::size_t>(id)];
    if (!b.has_key || b.key != key) fail("key map entry disagrees with " + name(id));
  }
}

// ---------------------------------------------------------------------------------------------

SequenceBlocks::SequenceBlocks(int block_size) : block_size_(block_size) {
  if (block_size <= 0) throw std::invalid_argument("SequenceBlocks: block_size must be > 0");
}

void SequenceBlocks::check_pool(const BlockPool& pool) const {
  if (pool.block_size() != block_size_)
    throw std::logic_error("SequenceBlocks: pool has a different block_size");
}

std::int64_t SequenceBlocks::acquire_prefix(BlockPool& pool,
                                            std::span<const std::int32_t> prompt) {
  check_pool(pool);
  if (!table_.empty()) throw std::logic_error("SequenceBlocks: acquire_prefix on a used table");
  if (prompt.empty()) return 0;
  const std::size_t bs = static_cast<std::size_t>(block_size_);
  const std::size_t max_blocks = (prompt.size() - 1) / bs;
  std::uint64_t parent = BlockPool::kRootKey;
  for (std::size_t i = 0; i < max_blocks; ++i) {
    const std::uint64_t key = BlockPool::block_key(parent, prompt.subspan(i * bs, bs));
    std::optional<BlockId> block = pool.lookup_and_acquire(key);
    if (!block) break;
    table_.push_back(*block);
    keys_.push_back(key);
    parent = key;
  }
  return capacity_tokens();
}

std::int64_t SequenceBlocks::acquire_partial(BlockPool& pool, std::span<const std::int32_t> prompt) {
  check_pool(pool);
  if (table_.size() != keys_.size() || copy_)
    throw std::logic_error("SequenceBlocks: acquire_partial after blocks of its own");
  const std::size_t bs = static_cast<std::size_t>(block_size_);
  const std::size_t start = table_.size() * bs;
  // Never the last prompt token, and never a whole block (a whole one would have been found).
  if (prompt.size() < start + 2) return static_cast<std::int64_t>(start);
  const std::size_t n = std::min(bs - 1, prompt.size() - 1 - start);
  const std::uint64_t parent = keys_.empty() ? BlockPool::kRootKey : keys_.back();
  const std::optional<BlockPool::Partial> found = pool.acquire_partial(parent, prompt.subspan(start, n));
  if (!found) return static_cast<std::int64_t>(start);
  const std::optional<BlockId> fresh = pool.allocate();
  if (!fresh) {
    pool.release(found->block);
    return static_cast<std::int64_t>(start);
  }
  table_.push_back(*fresh);
  copy_ = BlockCopy{found->block, *fresh};
  return static_cast<std::int64_t>(start) + found->tokens;
}

std::optional<BlockCopy> SequenceBlocks::take_copy() { return std::exchange(copy_, std::nullopt); }

bool SequenceBlocks::ensure_capacity(BlockPool& pool, std::int64_t n_tokens) {
  check_pool(pool);
  const std::int64_t needed_blocks = (n_tokens + block_size_ - 1) / block_size_;
  const std::int64_t missing = needed_blocks - static_cast<std::int64_t>(table_.size());
  if (missing <= 0) return true;
  // Checked up front so that a failure neither leaks nor evicts cached blocks for nothing.
  if (missing > pool.available()) return false;
  table_.reserve(static_cast<std::size_t>(needed_blocks));
  for (std::int64_t i = 0; i < missing; ++i) table_.push_back(*pool.allocate());
  return true;
}

void SequenceBlocks::commit_full_blocks(BlockPool& pool, std::span<const std::int32_t> tokens) {
  check_pool(pool);
  const std::size_t bs = static_cast<std::size_t>(block_size_);
  const std::size_t full = tokens.size() / bs;
  if (full > table_.size())
    throw std::logic_error("SequenceBlocks: commit of tokens beyond the table");
  for (std::size_t i = keys_.size(); i < full; ++i) {
    const std::uint64_t parent = keys_.empty() ? BlockPool::kRootKey : keys_.back();
    const std::uint64_t key = BlockPool::block_key(parent, tokens.subspan(i * bs, bs));
    // When an identical block is already published this one stays private; the chain goes on
    // from the same key either way, since the key depends on the tokens alone.
    pool.publish(table_[i], key, parent, tokens.subspan(i * bs, bs));
    keys_.push_back(key);
  }
}

void SequenceBlocks::truncate(BlockPool& pool, std::int64_t n_tokens) {
  check_pool(pool);
  if (n_tokens < 0) throw std::logic_error("SequenceBlocks: truncate to a negative length");
  const auto keep = static_cast<std::size_t>((n_tokens + block_size_ - 1) / block_size_);
  if (keep >= table_.size()) return;
  if (keep < keys_.size())
    throw std::logic_error("SequenceBlocks: truncate to " + std::to_string(n_tokens) +
                           " tokens would release a published block");
  while (table_.size() > keep) {
    pool.release(table_.back());
    table_.pop_back();
  }
}

void SequenceBlocks::release_all(BlockPool& pool) {
  check_pool(pool);
  if (copy_) pool.release(std::exchange(copy_, std::nullopt)->from);
  for (auto it = table_.rbegin(); it != table_.rend(); ++it) pool.release(*it);
  table_.clear();
  keys_.clear();
}

}  // namespace batchlm::local_engine
