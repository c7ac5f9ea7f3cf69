#pragma once
// Internal to the runner: finding the quoted YAML string that a missing closing quote let run
// on. YAML lets a quoted string span lines, so `content: "{{question}}` without its closing
// quote takes in the lines after it (`max_tokens: 8`, ...) as text, and the parser either
// accepts the file with those settings gone or fails lines later, far from the cause.

#include <optional>
#include <string>
#include <string_view>

namespace batchlm::runner {

struct RunawayQuote {
  int line = 0;    // where the quote opens, 1-based
  int column = 0;
  int swallowed_line = 0;      // the first line it takes in that reads as a key of its own
  std::string swallowed_text;  // that line, trimmed and shortened
  bool unterminated = false;   // it never closes: it runs to the end of the text
};

// The first quoted string that never closes, or that takes in a line which reads as a
// `key:` less indented than the key (or dash) the string is the value of; with `at_key_too`,
// also one indented as far as that key (YAML wants a string's later lines further in, but
// parsers take them; a file that parsed is judged without it). A lexical scan: comments, block
// scalars (| and >), flow collections and quotes inside plain text are told apart, but it is
// no parser, so a caller confirms a finding against the parsed tree or uses it to explain a
// parse error.
std::optional<RunawayQuote> find_runaway_quote(std::string_view yaml, bool at_key_too);

// "a quoted string opens here and ..." for a ConfigError at the quote's line and column.
std::string describe(const RunawayQuote& runaway);

}  // namespace batchlm::runner
