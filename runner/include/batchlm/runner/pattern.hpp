#pragma once
// A regular expression from a job file (scoring.pattern), matched with PCRE2: Perl syntax, the
// dialect of Python's `re` for everything a scoring pattern uses. Its matcher keeps backtracking
// state on a heap stack of its own, so a pattern such as (.|\n)*#### searches a megabyte of
// output without touching the thread's stack, and a search that would run away — (a+)+b
// against a long run of a's, or (.|\n)*x over a long output without an x, which is quadratic —
// stops at a step budget and says so instead of hanging or crashing.

#include <memory>
#include <string>
#include <string_view>

namespace batchlm::runner {

class Pattern {
 public:
  // Throws std::invalid_argument with PCRE2's reason and the character it stopped at
  // ("missing closing parenthesis at character 4"). The pattern and the text are UTF-8; `.`
  // is one character, and bytes that are not UTF-8 in a text never match a character class.
  explicit Pattern(std::string_view pattern);
  ~Pattern();
  Pattern(Pattern&&) noexcept;
  Pattern& operator=(Pattern&&) noexcept;

  // Whether the pattern occurs anywhere in `text`. Safe to call from several threads at once.
  // Throws std::runtime_error when the matcher gives up (its step or memory limit).
  bool search(std::string_view text) const;

 private:
  struct Compiled;
  std::unique_ptr<Compiled> compiled_;
};

}  // namespace batchlm::runner
