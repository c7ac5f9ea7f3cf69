#include "yaml_quotes.hpp"

#include <cctype>
#include <vector>

namespace batchlm::runner {

namespace {

int indent_of(std::string_view line) {
  std::size_t i = 0;
  while (i < line.size() && line[i] == ' ') ++i;
  return static_cast<int>(i);
}

bool blank(char c) { return c == ' ' || c == '\t'; }

// `key:` or `- key:` with a plain key of letters, digits, '_', '.' and '-', then the end of the
// line or a space: what a job file's settings look like.
bool reads_as_key(std::string_view line) {
  std::size_t i = static_cast<std::size_t>(indent_of(line));
  if (line.substr(i, 2) == "- ") {
    i += 2;
    while (i < line.size() && line[i] == ' ') ++i;
  }
  if (i >= line.size() || !(std::isalpha(static_cast<unsigned char>(line[i])) || line[i] == '_')) return false;
  std::size_t k = i;
  while (k < line.size() &&
         (std::isalnum(static_cast<unsigned char>(line[k])) || line[k] == '_' || line[k] == '.' || line[k] == '-'))
    ++k;
  return k < line.size() && line[k] == ':' && (k + 1 == line.size() || blank(line[k + 1]));
}

std::string shortened(std::string_view line) {
  const std::size_t first = line.find_first_not_of(" \t");
  if (first == std::string_view::npos) return "";
  line.remove_prefix(first);
  while (!line.empty() && blank(line.back())) line.remove_suffix(1);
  return line.size() > 40 ? std::string(line.substr(0, 37)) + "..." : std::string(line);
}

}  // namespace

std::optional<RunawayQuote> find_runaway_quote(std::string_view yaml, bool at_key_too) {
  std::vector<std::string_view> lines;
  for (std::size_t start = 0;;) {
    const std::size_t end = yaml.find('\n', start);
    std::string_view line = yaml.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    lines.push_back(line);
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  const auto is_blank_line = [&](std::size_t n) { return lines[n].find_first_not_of(" \t") == std::string_view::npos; };

  int flow = 0;           // depth of [ and { (flow collections may span lines)
  int block_indent = -1;  // inside a | or > block scalar: its content is indented past this
  int plain_indent = -1;  // a plain scalar ran to the end of a line whose key or dash sat here
  for (std::size_t li = 0; li < lines.size(); ++li) {
    std::string_view line = lines[li];
    const int indent = indent_of(line);
    if (is_blank_line(li)) continue;
    if (block_indent >= 0) {
      if (indent > block_indent) continue;
      block_indent = -1;
    }
    // A line indented past a plain scalar's key goes on with that scalar: a quote there is text.
    bool value_start = !(plain_indent >= 0 && indent > plain_indent && flow == 0);
    if (value_start) plain_indent = -1;
    int key_column = -1;   // of this line's last key (`key:`), where a value may follow
    int dash_column = -1;  // of this line's last sequence dash
    int token_column = -1;
    bool in_plain = !value_start;
    // The column a value begun here belongs to: its key's, else its dash's.
    const auto owner_or = [&](int fallback) { return key_column >= 0 ? key_column : dash_column >= 0 ? dash_column : fallback; };
    for (std::size_t j = static_cast<std::size_t>(indent); j < line.size(); ++j) {
      const char c = line[j];
      const bool blank_after = j + 1 >= line.size() || blank(line[j + 1]);
      if (blank(c)) continue;
      if (c == '#' && (j == 0 || blank(line[j - 1]))) break;  // a comment
      if (value_start && (c == '"' || c == '\'')) {
        // To the closing quote: `\x` escapes in double quotes, '' stands for ' in single ones.
        const std::size_t open_line = li;
        const std::size_t open_column = j;
        // Its later lines belong to it while indented past the key (or dash) it is the value
        // of; a line that reads as a key no further in than that is one the quote swallowed.
        // Inside [ ] or { } indentation means nothing, and no such line is judged.
        const int owner = owner_or(static_cast<int>(j) - 1);
        std::size_t k = j + 1;
        bool closed = false;
        RunawayQuote found;
        while (true) {
          const std::string_view text = lines[li];
          for (; k < text.size(); ++k) {
            if (c == '"' && text[k] == '\\') {
              ++k;
            } else if (text[k] == c) {
              if (c == '\'' && k + 1 < text.size() && text[k + 1] == '\'') {
                ++k;
              } else {
                closed = true;
                break;
              }
            }
          }
          if (closed || li + 1 >= lines.size()) break;
          ++li;
          k = 0;
          if (flow == 0 && found.swallowed_line == 0 && !is_blank_line(li) && reads_as_key(lines[li]) &&
              (indent_of(lines[li]) < owner || (at_key_too && indent_of(lines[li]) == owner))) {
            found.swallowed_line = static_cast<int>(li) + 1;
            found.swallowed_text = shortened(lines[li]);
          }
        }
        found.line = static_cast<int>(open_line) + 1;
        found.column = static_cast<int>(open_column) + 1;
        if (!closed) {
          found.unterminated = true;
          if (found.swallowed_line == 0) {
            for (std::size_t n = open_line + 1; n < lines.size(); ++n) {
              if (is_blank_line(n)) continue;
              found.swallowed_line = static_cast<int>(n) + 1;
              found.swallowed_text = shortened(lines[n]);
              break;
            }
          }
          return found;
        }
        if (found.swallowed_line != 0) return found;
        line = lines[li];  // go on after the closing quote, on the line it is on
        j = k;
        token_column = static_cast<int>(open_column);
        value_start = false;
        in_plain = false;
        continue;
      }
      if (value_start && flow == 0 && (c == '|' || c == '>')) {
        block_indent = owner_or(indent);
        in_plain = false;
        break;  // the lines below, indented further, are the scalar's text
      }
      if (value_start && (c == '&' || c == '!')) {  // an anchor or a tag before the value
        while (j + 1 < line.size() && !blank(line[j + 1])) ++j;
        continue;
      }
      if (value_start && (c == '[' || c == '{')) {
        ++flow;
        continue;
      }
      if (flow > 0 && (c == ']' || c == '}')) {
        --flow;
        value_start = false;
        in_plain = false;
        continue;
      }
      if (flow > 0 && c == ',') {
        value_start = true;
        in_plain = false;
        continue;
      }
      if (c == ':' && (blank_after || flow > 0)) {
        key_column = token_column >= 0 ? token_column : static_cast<int>(j);
        value_start = true;
        in_plain = false;
        continue;
      }
      if (value_start && (c == '-' || c == '?') && blank_after) {  // a sequence entry, a complex key
        dash_column = static_cast<int>(j);
        continue;
      }
      if (value_start) {
        token_column = static_cast<int>(j);
        in_plain = true;
      }
      value_start = false;
    }
    // A plain scalar that reached the end of the line may go on on the next ones.
    if (in_plain && flow == 0 && block_indent < 0)
      plain_indent = owner_or(indent);
  }
  return std::nullopt;
}

std::string describe(const RunawayQuote& runaway) {
  const std::string taken =
      runaway.swallowed_line == 0
          ? std::string()
          : "line " + std::to_string(runaway.swallowed_line) + " (" + runaway.swallowed_text + ")";
  if (runaway.unterminated)
    return "a quoted string opens here and is never closed: it runs to the end of the file" +
           (taken.empty() ? std::string() : ", taking in " + taken + " and every line after it as text") +
           "; add the closing quote";
  return "a quoted string opens here and runs on, taking in " + taken +
         " as text, though that line is indented like a key of its own (a string's later lines are indented "
         "past its key): is a closing quote missing?";
}

}  // namespace batchlm::runner
