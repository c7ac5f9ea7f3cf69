// Scoring patterns on PCRE2. std::regex was the first matcher here; libstdc++'s recurses once
// per character a repeated group consumes, and 20,000 characters of output against (a|b)*c
// overflowed an 8 MB stack and killed the run.

#include "batchlm/runner/pattern.hpp"

#include <array>
#include <cstdint>
#include <stdexcept>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace batchlm::runner {

namespace {

// The JIT matcher's backtracking stack. It is reserved, not committed: pages are touched only
// as deep as a search goes. 64 MiB holds (.|\n)* over about a megabyte of output.
constexpr std::size_t kJitStackStart = 32 * 1024;
constexpr std::size_t kJitStackMax = 64 * 1024 * 1024;
// The interpreter (used where the JIT is unavailable) keeps its frames on the heap; in KiB.
constexpr std::uint32_t kHeapLimitKib = 256 * 1024;
// Steps per starting position before a search gives up; PCRE2's own default.
constexpr std::uint32_t kMatchLimit = 10'000'000;
// Work in all before a search gives up. PCRE2's own limits count per starting position, and a
// search tries every position, so (.|\n)*#### 7 over 60 KB of output without "#### 7" in it ran
// for seconds and over a megabyte for hours. Every pattern item the matcher reaches calls out
// here (PCRE2_AUTO_CALLOUT) and is charged one step plus the characters it moved forward:
// a repeat such as \d+ that PCRE2 makes possessive takes a whole run of digits in one item,
// and \d+ apples over 200,000 digits retried from each of them is quadratic in characters, not
// in items. 50 million steps take about a tenth to a third of a second; a megabyte of output
// searched once costs a few million.
constexpr std::uint64_t kStepBudget = 50'000'000;

struct StepBudget {
  std::uint64_t left = kStepBudget;
  PCRE2_SIZE attempt_start = PCRE2_UNSET;  // where the current match attempt began
  PCRE2_SIZE furthest = 0;                 // the position last charged in it
};

int count_step(pcre2_callout_block* block, void* data) {
  auto& budget = *static_cast<StepBudget*>(data);
  if (block->start_match != budget.attempt_start) {
    budget.attempt_start = block->start_match;
    budget.furthest = block->start_match;
  }
  std::uint64_t cost = 1;
  // Characters moved forward since the last callout; after a backtrack, moving forward over the
  // same characters again costs them again.
  if (block->current_position > budget.furthest) cost += block->current_position - budget.furthest;
  budget.furthest = block->current_position;
  if (cost > budget.left) return PCRE2_ERROR_CALLOUT;  // negative: abandon the whole search
  budget.left -= cost;
  return 0;
}

std::string message(int code) {
  std::array<PCRE2_UCHAR, 256> buffer{};
  if (pcre2_get_error_message(code, buffer.data(), buffer.size()) < 0) return "PCRE2 error " + std::to_string(code);
  return reinterpret_cast<const char*>(buffer.data());
}

struct JitStack {
  JitStack() : stack(pcre2_jit_stack_create(kJitStackStart, kJitStackMax, nullptr)) {}
  ~JitStack() { pcre2_jit_stack_free(stack); }
  JitStack(const JitStack&) = delete;
  JitStack& operator=(const JitStack&) = delete;
  pcre2_jit_stack* stack;
};

}  // namespace

struct Pattern::Compiled {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Compiled() { pcre2_code_free(code); }
};

Pattern::Pattern(std::string_view pattern) : compiled_(std::make_unique<Compiled>()) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  compiled_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                  PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | PCRE2_AUTO_CALLOUT, &error, &offset, nullptr);
  if (compiled_->code == nullptr) {
    if (offset >= pattern.size()) throw std::invalid_argument(message(error) + " at the end");
    // PCRE2 counts bytes; people count characters (UTF-8 lead bytes).
    std::size_t character = 1;
    for (std::size_t i = 0; i < offset; ++i)
      if ((static_cast<unsigned char>(pattern[i]) & 0xC0) != 0x80) ++character;
    throw std::invalid_argument(message(error) + " at character " + std::to_string(character));
  }
  compiled_->jit = pcre2_jit_compile(compiled_->code, PCRE2_JIT_COMPLETE) == 0;
}

Pattern::~Pattern() = default;
Pattern::Pattern(Pattern&&) noexcept = default;
Pattern& Pattern::operator=(Pattern&&) noexcept = default;

bool Pattern::search(std::string_view text) const {
  using MatchData = std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)>;
  using MatchContext = std::unique_ptr<pcre2_match_context, decltype(&pcre2_match_context_free)>;
  MatchData data(pcre2_match_data_create(1, nullptr), &pcre2_match_data_free);
  MatchContext context(pcre2_match_context_create(nullptr), &pcre2_match_context_free);
  if (!data || !context) throw std::runtime_error("the pattern could not get memory for its search");
  pcre2_set_match_limit(context.get(), kMatchLimit);
  pcre2_set_heap_limit(context.get(), kHeapLimitKib);
  StepBudget budget;
  pcre2_set_callout(context.get(), count_step, &budget);
  if (compiled_->jit) {
    // One stack per thread, so concurrent searches never share one.
    thread_local JitStack jit_stack;
    if (jit_stack.stack == nullptr) throw std::runtime_error("the pattern could not get memory for its search");
    pcre2_jit_stack_assign(context.get(), nullptr, jit_stack.stack);
  }
  // PCRE2 10.42 refuses a null subject even when it is empty.
  const char* subject = text.data() != nullptr ? text.data() : "";
  const int rc = pcre2_match(compiled_->code, reinterpret_cast<PCRE2_SPTR>(subject), text.size(), 0, 0,
                             data.get(), context.get());
  if (rc >= 0) return true;
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc == PCRE2_ERROR_CALLOUT)
    throw std::runtime_error("the pattern gave up on this output after " + std::to_string(kStepBudget) + " steps");
  throw std::runtime_error("the pattern gave up on this output: " + message(rc));
}

}  // namespace batchlm::runner
