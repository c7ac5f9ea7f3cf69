// Scorers. GSM8K follows the usual two readings of an answer: strict takes only the
// "#### N" line the prompt asks for, flexible takes the last number anywhere, so a model that
// reasons well but ignores the format is visible as the gap between the two.

#include "batchlm/runner/scoring.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "batchlm/runner/pattern.hpp"

namespace batchlm::runner {

namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// U+2212 MINUS SIGN, which typeset text (and a model imitating it) writes for '-'.
constexpr std::string_view kMinusSign = "\xE2\x88\x92";

// The length of the sign at `i` ('-', '+' or U+2212), or 0.
std::size_t sign_at(std::string_view text, std::size_t i) {
  if (i < text.size() && (text[i] == '-' || text[i] == '+')) return 1;
  return text.substr(i, kMinusSign.size()) == kMinusSign ? kMinusSign.size() : 0;
}

// A number starting at `at`: [sign][$]digits[,ddd...][.digits]. Returns its end, or `at` when
// there is none. Commas count only between groups of three digits, so "3,4" is two numbers.
std::size_t scan_number(std::string_view text, std::size_t at) {
  std::size_t i = at;
  i += sign_at(text, i);
  if (i < text.size() && text[i] == '$') {
    ++i;
    i += sign_at(text, i);  // "$-5"
  }
  std::size_t digits = i;
  while (i < text.size() && is_digit(text[i])) ++i;
  if (i == digits) {
    // ".5" has no integer part.
    if (i + 1 < text.size() && text[i] == '.' && is_digit(text[i + 1])) {
      ++i;
      while (i < text.size() && is_digit(text[i])) ++i;
      return i;
    }
    return at;
  }
  while (i + 3 < text.size() && text[i] == ',' && is_digit(text[i + 1]) &&
         is_digit(text[i + 2]) && is_digit(text[i + 3]) &&
         (i + 4 == text.size() || !is_digit(text[i + 4])))
    i += 4;
  if (i + 1 < text.size() && text[i] == '.' && is_digit(text[i + 1])) {
    ++i;
    while (i < text.size() && is_digit(text[i])) ++i;
  }
  return i;
}

// A sign belongs to the number only where it cannot be an operator: "5-3" is 5 and 3.
bool sign_allowed(std::string_view text, std::size_t at) {
  if (at == 0) return true;
  char before = text[at - 1];
  return !std::isalnum(static_cast<unsigned char>(before)) && before != ')' && before != '.';
}

struct Found {
  std::size_t begin, end;
};

// Every number in the text, left to right.
std::vector<Found> numbers(std::string_view text) {
  std::vector<Found> out;
  std::size_t i = 0;
  while (i < text.size()) {
    char c = text[i];
    bool could_start = is_digit(c) || c == '$' || c == '.' || (sign_at(text, i) > 0 && sign_allowed(text, i));
    // A digit inside a word ("x2", "COVID19") is not an answer.
    bool glued = i > 0 && is_digit(c) && std::isalpha(static_cast<unsigned char>(text[i - 1]));
    if (glued) {
      while (i < text.size() && (is_digit(text[i]) || std::isalpha(static_cast<unsigned char>(text[i])))) ++i;
      continue;
    }
    if (could_start) {
      std::size_t end = scan_number(text, i);
      if (end > i) {
        out.push_back({i, end});
        i = end;
        continue;
      }
    }
    ++i;
  }
  return out;
}

std::string trim(std::string_view text) {
  std::size_t begin = 0, end = text.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(text[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(text[end - 1]))) --end;
  return std::string(text.substr(begin, end - begin));
}

// The reference field as text: strings as they are, numbers as JSON writes them.
std::optional<std::string> reference_text(const nlohmann::json& input, const std::string& field) {
  if (!input.is_object()) return std::nullopt;
  auto it = input.find(field);
  if (it == input.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  return it->dump();
}

class Gsm8kScorer : public Scorer {
 public:
  explicit Gsm8kScorer(std::string field) : field_(std::move(field)) {}
  nlohmann::json score(const nlohmann::json& input, std::string_view output) const override {
    std::optional<std::string> reference = reference_text(input, field_);
    if (!reference) return nullptr;
    std::optional<std::string> gold = gsm8k_gold(*reference);
    if (!gold) return nullptr;
    std::optional<std::string> strict = gsm8k_extract_strict(output);
    std::optional<std::string> flexible = gsm8k_extract_flexible(output);
    return {{"strict", strict == gold}, {"flexible", flexible == gold}};
  }
  std::vector<std::string> metrics() const override { return {"strict", "flexible"}; }

 private:
  std::string field_;
};

// The text without the white space around it: ASCII's, and the no-break, narrow, figure,
// ideographic and zero-width spaces and the byte-order mark that copied text carries.
std::string_view trim_spaces(std::string_view text) {
  static constexpr std::string_view kWide[] = {"\xC2\xA0", "\xE2\x80\xAF", "\xE2\x80\x87", "\xE3\x80\x80",
                                               "\xE2\x80\x8B", "\xEF\xBB\xBF"};
  for (bool cut = true; cut && !text.empty();) {
    cut = false;
    if (std::isspace(static_cast<unsigned char>(text.front()))) {
      text.remove_prefix(1);
      cut = true;
    }
    if (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) {
      text.remove_suffix(1);
      cut = true;
    }
    for (std::string_view space : kWide) {
      if (text.starts_with(space)) text.remove_prefix(space.size()), cut = true;
      if (text.ends_with(space)) text.remove_suffix(space.size()), cut = true;
    }
  }
  return text;
}

// `text`, all of it, as a number ("1.10", "-0", "1e2"; no commas, no sign but '-'), or nullopt.
std::optional<double> whole_number(std::string_view text) {
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(value)) return std::nullopt;
  return value;
}

// The trimmed output equals the reference. A reference the input gives as a JSON number is
// compared as one: the file's "1.10" reaches the scorer as 1.1, so the output "1.10" (or "1.1")
// is its number, where a comparison of text would refuse the file's own spelling.
class ExactMatchScorer : public Scorer {
 public:
  explicit ExactMatchScorer(std::string field) : field_(std::move(field)) {}
  nlohmann::json score(const nlohmann::json& input, std::string_view output) const override {
    std::optional<std::string> reference = reference_text(input, field_);
    if (!reference) return nullptr;
    const std::string_view said = trim_spaces(output);
    if (said == trim_spaces(*reference)) return {{"exact", true}};
    const nlohmann::json& value = input[field_];
    if (value.is_number()) {
      const std::optional<double> number = whole_number(said);
      // Integers compared as integers: past 2^53 two doubles can be equal for different numbers.
      if (number && value.is_number_integer() && said.find_first_of(".eE") == std::string_view::npos) {
        const auto same_as = [&](auto whole) {
          const auto [end, ec] = std::from_chars(said.data(), said.data() + said.size(), whole);
          return ec == std::errc() && end == said.data() + said.size() && whole == value.get<decltype(whole)>();
        };
        return {{"exact", value.is_number_unsigned() ? same_as(std::uint64_t{0}) : same_as(std::int64_t{0})}};
      }
      return {{"exact", number.has_value() && *number == value.get<double>()}};
    }
    return {{"exact", false}};
  }
  std::vector<std::string> metrics() const override { return {"exact"}; }

 private:
  std::string field_;
};

// A search that gives up (its step limit) leaves the item unscored, with the reason beside it;
// it is neither a match nor a miss.
class RegexScorer : public Scorer {
 public:
  explicit RegexScorer(const std::string& pattern) : pattern_(pattern) {}
  nlohmann::json score(const nlohmann::json&, std::string_view output) const override {
    try {
      return {{"match", pattern_.search(output)}};
    } catch (const std::runtime_error& e) {
      return {{"match", nullptr}, {"error", e.what()}};
    }
  }
  std::vector<std::string> metrics() const override { return {"match"}; }

 private:
  Pattern pattern_;
};

}  // namespace

std::string normalize_number(std::string_view number) {
  std::string s;
  const std::string text = trim(number);
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text.compare(i, kMinusSign.size(), kMinusSign) == 0) {
      s += '-';
      i += kMinusSign.size() - 1;
    } else if (text[i] != ',' && text[i] != '$' && text[i] != ' ') {
      s += text[i];
    }
  }
  while (!s.empty() && s.back() == '.') s.pop_back();
  bool negative = false;
  if (!s.empty() && (s.front() == '+' || s.front() == '-')) {
    negative = s.front() == '-';
    s.erase(0, 1);
  }
  bool numeric = !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return is_digit(c) || c == '.';
  }) && std::count(s.begin(), s.end(), '.') <= 1;
  if (!numeric) return (negative ? "-" : "") + s;
  if (s.find('.') != std::string::npos) {
    while (s.back() == '0') s.pop_back();  // 42.50 -> 42.5, 42.0 -> 42.
    if (s.back() == '.') s.pop_back();
  }
  std::size_t first = s.find_first_not_of('0');
  if (first == std::string::npos) s = "0";
  else if (s[first] == '.') s = "0" + s.substr(first);
  else s = s.substr(first);
  if (s == "0") negative = false;
  return (negative ? "-" : "") + s;
}

std::optional<std::string> gsm8k_extract_strict(std::string_view output) {
  // The last "####" followed by a number; a later "####" with no number does not hide it.
  std::optional<std::string> found;
  std::size_t at = output.find("####");
  while (at != std::string_view::npos) {
    std::size_t i = at + 4;
    while (i < output.size() && output[i] == '#') ++i;
    while (i < output.size() && (output[i] == ' ' || output[i] == '\t' || output[i] == ':')) ++i;
    std::size_t end = scan_number(output, i);
    if (end > i) found = normalize_number(output.substr(i, end - i));
    at = output.find("####", std::max(i, at + 4));
  }
  return found;
}

std::optional<std::string> gsm8k_extract_flexible(std::string_view output) {
  std::vector<Found> all = numbers(output);
  if (all.empty()) return std::nullopt;
  return normalize_number(output.substr(all.back().begin, all.back().end - all.back().begin));
}

std::optional<std::string> gsm8k_gold(std::string_view reference) {
  if (auto gold = gsm8k_extract_strict(reference)) return gold;
  // A bare number ("42", " $1,000 ", "5.") is its own gold.
  std::string text = trim(reference);
  if (text.size() > 1 && text.back() == '.') text.pop_back();
  if (!text.empty() && scan_number(text, 0) == text.size()) return normalize_number(text);
  return std::nullopt;
}

std::unique_ptr<Scorer> make_scorer(const ScoringSpec& spec) {
  switch (spec.kind) {
    case ScoringKind::None: return nullptr;
    case ScoringKind::Gsm8k: return std::make_unique<Gsm8kScorer>(spec.reference_field);
    case ScoringKind::ExactMatch: return std::make_unique<ExactMatchScorer>(spec.reference_field);
    case ScoringKind::Regex: return std::make_unique<RegexScorer>(spec.pattern);
  }
  return nullptr;
}

}  // namespace batchlm::runner
