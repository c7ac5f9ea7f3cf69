// Job files: YAML -> env expansion -> --set overrides -> validation -> JobSpec.
// One table of known keys (kSections) serves both the validator and the override paths, so a
// typo is reported the same way whether it sits in the file or on the command line.

#include "batchlm/runner/job.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include "batchlm/core/engine_fields.hpp"
#include "batchlm/runner/pattern.hpp"
#include "yaml_quotes.hpp"

namespace batchlm::runner {

namespace {

std::string format_error(const std::string& file, int line, int column, const std::string& field,
                         const std::string& message) {
  std::string out = file;
  if (line > 0) {
    out += ":" + std::to_string(line);
    if (column > 0) out += ":" + std::to_string(column);
  }
  out += ": ";
  if (!field.empty()) out += field + ": ";
  out += message;
  return out;
}

}  // namespace

ConfigError::ConfigError(std::string file, int line, int column, std::string field,
                         std::string message)
    : std::runtime_error(format_error(file, line, column, field, message)),
      file_(std::move(file)),
      field_(std::move(field)),
      message_(std::move(message)),
      line_(line),
      column_(column) {}

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    if (const char* value = std::getenv(name.c_str())) return std::string(value);
    return std::nullopt;
  };
}

namespace {

std::string hex_byte(char c) {
  char hex[8];
  std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned>(static_cast<unsigned char>(c)));
  return hex;
}

// "is not valid UTF-8 (byte 0xE9 at offset 3)" for a value that is not UTF-8, else "".
std::string utf8_flaw(std::string_view value) {
  const std::size_t bad = first_invalid_utf8(value);
  if (bad == std::string_view::npos) return {};
  return "is not valid UTF-8 (byte " + hex_byte(value[bad]) + " at offset " + std::to_string(bad) + ")";
}

}  // namespace

std::string expand_env(std::string_view text, const EnvLookup& env, const std::string& file,
                       int line, const std::string& field) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (c != '$' || i + 1 == text.size()) {
      out += c;
      continue;
    }
    if (text[i + 1] == '$') {
      out += '$';
      ++i;
      continue;
    }
    if (text[i + 1] != '{') {
      out += c;  // a lone '$' (prices in prompts) stays as written
      continue;
    }
    // The matching '}': a default may itself hold ${...} (${A:-${B}}).
    std::size_t close = std::string_view::npos;
    for (std::size_t j = i + 2, depth = 1; j < text.size(); ++j) {
      if (text[j] == '$' && j + 1 < text.size() && text[j + 1] == '{') {
        ++depth;
        ++j;
      } else if (text[j] == '}' && --depth == 0) {
        close = j;
        break;
      }
    }
    if (close == std::string_view::npos)
      throw ConfigError(file, line, 0, field, "unterminated '${' in '" + std::string(text) + "'");
    std::string_view inner = text.substr(i + 2, close - i - 2);
    std::optional<std::string_view> fallback;
    std::size_t sep = inner.find(":-");
    std::string_view name = inner;
    if (sep != std::string_view::npos) {
      name = inner.substr(0, sep);
      fallback = inner.substr(sep + 2);
    }
    bool valid_name = !name.empty() && !std::isdigit(static_cast<unsigned char>(name[0]));
    for (char n : name)
      if (!std::isalnum(static_cast<unsigned char>(n)) && n != '_') valid_name = false;
    if (!valid_name)
      throw ConfigError(file, line, 0, field,
                        "bad variable name '" + std::string(name) + "' in '${" +
                            std::string(inner) + "}'");
    std::optional<std::string> value = env(std::string(name));
    // Like the shell's ${VAR:-x}: an empty value takes the default too.
    if (value && !(value->empty() && fallback)) {
      if (const std::string flaw = utf8_flaw(*value); !flaw.empty())
        throw ConfigError(file, line, 0, field, "environment variable '" + std::string(name) + "' " + flaw);
      out += *value;
    } else if (fallback) {
      out += expand_env(*fallback, env, file, line, field);
    } else {
      throw ConfigError(file, line, 0, field,
                        "environment variable '" + std::string(name) +
                            "' is not set (give a default with ${" + std::string(name) +
                            ":-value})");
    }
    i = close;
  }
  return out;
}

std::string nearest_key(std::string_view key, const std::vector<std::string>& valid) {
  auto distance = [](std::string_view a, std::string_view b) {
    std::vector<std::size_t> row(b.size() + 1);
    for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (std::size_t i = 1; i <= a.size(); ++i) {
      std::size_t diagonal = row[0];
      row[0] = i;
      for (std::size_t j = 1; j <= b.size(); ++j) {
        std::size_t above = row[j];
        std::size_t substitute = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitute});
        diagonal = above;
      }
    }
    return row[b.size()];
  };
  // Allow about one edit per three letters: close enough to be a typo, far enough that an
  // unrelated word gets no suggestion.
  std::size_t limit = std::max<std::size_t>(2, key.size() / 3);
  std::string best;
  std::size_t best_distance = limit + 1;
  for (const std::string& candidate : valid) {
    std::size_t d = distance(key, candidate);
    if (d < best_distance && d < std::max(key.size(), candidate.size())) {
      best = candidate;
      best_distance = d;
    }
  }
  if (!best.empty()) return best;
  // Further off, but the same word begun: `retry_policy` or `retries` for `retry`. The longest
  // shared beginning of at least four letters that misses at most one letter of the shorter.
  std::size_t best_shared = 0;
  for (const std::string& candidate : valid) {
    std::size_t shared = 0;
    while (shared < key.size() && shared < candidate.size() && key[shared] == candidate[shared]) ++shared;
    // And the rest is a word's ending, not words of another key (`limit_per_minute` is not `limit`).
    if (shared >= 4 && shared + 1 >= std::min(key.size(), candidate.size()) && key.size() - shared <= 7 &&
        shared > best_shared) {
      best = candidate;
      best_shared = shared;
    }
  }
  return best;
}

Override parse_override(std::string_view text) {
  std::size_t eq = text.find('=');
  if (eq == std::string_view::npos)
    throw ConfigError("--set", 0, 0, std::string(text), "expected key.path=value");
  std::string path(text.substr(0, eq));
  auto trim = [](std::string& s) {
    s.erase(0, s.find_first_not_of(" \t"));
    s.erase(s.find_last_not_of(" \t") + 1);
  };
  trim(path);
  if (path.empty() || path.front() == '.' || path.back() == '.' ||
      path.find("..") != std::string::npos)
    throw ConfigError("--set", 0, 0, path, "expected key.path=value, got '" + std::string(text) + "'");
  std::string value(text.substr(eq + 1));
  if (value.find_first_not_of(" \t") == std::string::npos)
    throw ConfigError("--set", 0, 0, path,
                      "no value after '=' (write " + path + "=null to unset it, or " + path +
                          "=\"\" for an empty string)");
  return Override{path, std::move(value)};
}

namespace {

namespace fs = std::filesystem;
using Keys = std::vector<std::string>;

// Known keys of each section. Sections named in kFreeMaps take any key.
const std::map<std::string, Keys>& sections() {
  static const std::map<std::string, Keys> table = {
      {"", {"name", "kind", "input", "synth", "request", "few_shot", "backend", "concurrency",
            "rate_limit", "retry", "output", "scoring", "limit", "grace_period"}},
      {"input", {"path", "format"}},
      {"synth", {"count", "seed", "variables"}},
      {"request",
       {"messages", "model", "max_tokens", "temperature", "top_p", "stop", "seed", "extra"}},
      {"request.messages", {"role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content"}},
      {"few_shot", {"path", "count", "seed", "user", "assistant"}},
      {"backend", {"type", "base_url", "model", "api_key_env", "headers", "timeouts", "stream",
                   "threads", "device", "context", "max_sequences", "token_budget", "block_size",
                   "kv_tokens", "kv_memory", "kv_recycle", "step_log", "speculative", "reasoning"}},
      {"backend.speculative", {"method", "model", "layers", "k_max", "k_min", "ngram_max",
                               "ngram_min"}},
      {"backend.timeouts", {"connect", "first_byte", "idle", "total"}},
      {"rate_limit", {"requests_per_minute", "tokens_per_minute"}},
      {"retry",
       {"max_attempts", "base", "cap", "max_retry_after", "reconnect_for", "budget_ratio", "budget_min_per_second"}},
      {"output", {"path", "flush_every", "flush_interval", "input_fields"}},
      {"scoring", {"type", "reference_field", "pattern"}},
  };
  return table;
}

const std::set<std::string> kFreeMaps = {"synth.variables", "request.extra", "backend.headers"};

// Sections that may be written as one scalar: `input: data.jsonl` means {path: data.jsonl}.
const std::map<std::string, std::string> kShorthand = {
    {"input", "path"}, {"output", "path"}, {"scoring", "type"}};

std::string join(const Keys& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "" : ", ") + k;
  return out;
}

std::string describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map: return "a map";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Null: return "nothing";
    case YAML::NodeType::Scalar: return "'" + node.Scalar() + "'";
    default: return "nothing";
  }
}

bool is_unsigned_index(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// A list index in an override path (digits only: from_chars takes no sign or space for an
// unsigned type), when `s` is one below `size`.
std::optional<std::size_t> list_index(const std::string& s, std::size_t size) {
  std::size_t index = 0;
  const auto [end, error] = std::from_chars(s.data(), s.data() + s.size(), index);
  if (error != std::errc() || end != s.data() + s.size() || index >= size)
    return std::nullopt;
  return index;
}

// Dotted field path with list indices: request.messages[1].content.
std::string child_path(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}
std::string index_path(const std::string& parent, std::size_t index) {
  return parent + "[" + std::to_string(index) + "]";
}

// YAML -> JSON for body fields passed through as given. Plain scalars take the type YAML 1.2
// would give them; quoted scalars stay strings. Keys stay in the file's order.
nlohmann::ordered_json yaml_to_json(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map: {
      nlohmann::ordered_json out = nlohmann::ordered_json::object();
      for (auto it = node.begin(); it != node.end(); ++it)
        out[it->first.Scalar()] = yaml_to_json(it->second);
      return out;
    }
    case YAML::NodeType::Sequence: {
      nlohmann::ordered_json out = nlohmann::ordered_json::array();
      for (const auto& child : node) out.push_back(yaml_to_json(child));
      return out;
    }
    case YAML::NodeType::Scalar: {
      const std::string& text = node.Scalar();
      if (node.Tag() == "!") return text;
      if (text == "~" || text == "null" || text == "Null" || text == "NULL") return nullptr;
      if (text == "true" || text == "True" || text == "TRUE") return true;
      if (text == "false" || text == "False" || text == "FALSE") return false;
      const char* end = text.data() + text.size();
      std::int64_t integer = 0;
      if (auto [p, ec] = std::from_chars(text.data(), end, integer); ec == std::errc() && p == end)
        return integer;
      double real = 0;
      if (auto [p, ec] = std::from_chars(text.data(), end, real);
          ec == std::errc() && p == end && !text.empty())
        return real;
      return text;
    }
    default: return nullptr;
  }
}

// A YAML alias repeats the node its anchor names without copying it: `a: &a [*a]` is a list
// that contains itself, and ten lines of aliases of aliases stand for a billion nodes. Every
// walk over the tree (expansion, validation, request.extra to JSON) would run forever or
// overflow the stack on them, so a loaded tree is first measured as those walks see it,
// aliases expanded, and refused beyond these bounds. Real job files have a few hundred nodes
// (a synth job's variable lists maybe a million) and nest a few levels deep.
constexpr std::size_t kMaxYamlNodes = 2'000'000;
constexpr int kMaxYamlDepth = 64;

// An error where the parser marked (1-based line and column; 0 where it has no mark).
ConfigError error_at(const std::string& file, const YAML::Mark& m, const std::string& field,
                     const std::string& message) {
  return ConfigError(file, m.is_null() ? 0 : m.line + 1, m.is_null() ? 0 : m.column + 1, field, message);
}

void check_tree_size(const YAML::Node& root, const std::string& file, const std::string& field) {
  std::size_t nodes = 0;
  const auto fail = [&](const YAML::Node& at, const std::string& message) {
    throw error_at(file, at.Mark(), field, message);
  };
  const auto visit = [&](const auto& self, const YAML::Node& node, int depth) -> void {
    if (++nodes > kMaxYamlNodes)
      fail(node, "more than " + std::to_string(kMaxYamlNodes) +
                     " values (each YAML alias counted as what its anchor names)");
    if (depth > kMaxYamlDepth)
      fail(node, "nested more than " + std::to_string(kMaxYamlDepth) +
                     " levels deep (an alias inside what its own anchor names?)");
    if (node.IsSequence()) {
      for (const YAML::Node& child : node) self(self, child, depth + 1);
    } else if (node.IsMap()) {
      for (auto it = node.begin(); it != node.end(); ++it) {
        self(self, it->first, depth + 1);
        self(self, it->second, depth + 1);
      }
    }
  };
  visit(visit, root, 0);
}

// Every map, at any depth (messages, request.extra, headers, schemas): a key given twice is an
// error at the second, whichever of the two a reader would have kept; so is a key that is a
// list, a map or null, which JSON has no name for (each would be sent as ""). And every node:
// a tag other than YAML's own (`!include file`) would be read as the bare text after it.
void check_duplicate_keys(const YAML::Node& node, const std::string& path, const std::string& file) {
  if (const std::string& tag = node.Tag(); !tag.empty() && tag != "?" && tag != "!" && !tag.starts_with("tag:yaml.org,2002:"))
    throw error_at(file, node.Mark(), path,
                   "the YAML tag '" + tag + "' is not one batchlm reads (it would take the text after it as is); "
                   "remove it, or quote the value");
  if (node.IsSequence()) {
    for (std::size_t i = 0; i < node.size(); ++i) check_duplicate_keys(node[i], index_path(path, i), file);
  } else if (node.IsMap()) {
    std::set<std::string> seen;
    for (auto it = node.begin(); it != node.end(); ++it) {
      const std::string name = it->first.IsScalar() ? it->first.Scalar() : describe(it->first);
      const std::string field = child_path(path, name);
      const bool null_key = it->first.IsNull() || (it->first.IsScalar() && it->first.Tag() == "?" &&
                                                   (name == "~" || name == "null" || name == "Null" || name == "NULL"));
      if (!it->first.IsScalar() || null_key)
        throw error_at(file, it->first.Mark(), path,
                       null_key ? "a null key; quote it ('~') if that is the name"
                                : "a key that is " + describe(it->first) + "; keys are names");
      if (!seen.insert(name).second) {
        throw error_at(file, it->first.Mark(), field, "duplicate key");
      }
      check_duplicate_keys(it->second, field, file);
    }
  }
}

void expand_tree(YAML::Node node, const std::string& path, const std::string& file,
                 const EnvLookup& env) {
  switch (node.Type()) {
    case YAML::NodeType::Scalar:
      if (node.Scalar().find('$') != std::string::npos) {
        int line = node.Mark().is_null() ? 0 : node.Mark().line + 1;
        node = expand_env(node.Scalar(), env, file, line, path);
      }
      break;
    case YAML::NodeType::Sequence:
      for (std::size_t i = 0; i < node.size(); ++i)
        expand_tree(node[i], index_path(path, i), file, env);
      break;
    case YAML::NodeType::Map:
      for (auto it = node.begin(); it != node.end(); ++it)
        expand_tree(it->second, child_path(path, it->first.Scalar()), file, env);
      break;
    default: break;
  }
}

// The schema section a dotted override path walks through, list indices left out.
void check_override_path(const std::vector<std::string>& segments, const std::string& full) {
  std::string section;
  for (const std::string& segment : segments) {
    if (kFreeMaps.count(section)) return;
    if (section == "request.messages") {
      if (is_unsigned_index(segment)) continue;
      // Indices count from 0: a signed one (-1), or one that starts like a number (0x0, 1e2),
      // would otherwise read as an unknown key.
      if (segment.empty() || std::isdigit(static_cast<unsigned char>(segment[0])) != 0 || segment[0] == '-' ||
          segment[0] == '+')
        throw ConfigError("--set", 0, 0, full,
                          "'request.messages' is a list: its entries are 0, 1, 2, ... ('" + segment + "' is no index)");
    }
    auto known = sections().find(section);
    if (known == sections().end())
      throw ConfigError("--set", 0, 0, full,
                        "unknown key ('" + section + "' has no fields)");
    const Keys& keys = known->second;
    if (std::find(keys.begin(), keys.end(), segment) == keys.end()) {
      // As in a job file: the nearest key, else every valid one.
      std::string suggestion = nearest_key(segment, keys);
      throw ConfigError("--set", 0, 0, full,
                        "unknown key" + (suggestion.empty() ? " (valid keys: " + join(keys) + ")"
                                                            : " (did you mean '" + suggestion + "'?)"));
    }
    section = child_path(section, segment);
  }
}

// Where a second YAML document with content begins in `yaml` (after '---', or text after a
// closed quote: 'Don't' reads as 'Don' and a document of its own), or nullopt. Throws
// ConfigError (file `label`) where the parser finds documents without end.
std::optional<YAML::Mark> second_document(std::string_view yaml, const std::string& label);

// `made`: the paths of the maps the override made where the file had none (the flag it came
// from, for errors about them); a one-value section turned into a map keeps its value's place.
void apply_override(YAML::Node& root, const Override& override_value, const EnvLookup& env,
                    std::map<std::string, std::string>& made) {
  std::vector<std::string> segments;
  std::stringstream stream(override_value.path);
  for (std::string segment; std::getline(stream, segment, '.');) segments.push_back(segment);
  check_override_path(segments, override_value.path);

  if (const std::string flaw = utf8_flaw(override_value.value); !flaw.empty())
    throw ConfigError(override_value.flag.empty() ? std::string("--set") : override_value.flag, 0, 0,
                      override_value.path, "value " + flaw);
  YAML::Node value;
  // A value that begins with a placeholder is the template it reads as: YAML would take
  // `{{verb}} now` for a map whose key is a map, which no field of a job takes.
  std::string_view text = override_value.value;
  text.remove_prefix(std::min(text.size(), text.find_first_not_of(" \t")));
  text.remove_suffix(text.size() - (text.find_last_not_of(" \t") + 1));
  if (override_value.literal) {
    value = YAML::Node(override_value.value);
  } else if (text.starts_with("{{")) {
    value = YAML::Node(std::string(text));
    expand_tree(value, override_value.path, "--set", env);
  } else {
    try {
      // yaml-cpp's Load reads the first document and drops the rest: a value that is more than
      // one would lose its tail without a word.
      if (const std::optional<YAML::Mark> second = second_document(override_value.value, "--set")) {
        const std::string rest = override_value.value.substr(static_cast<std::size_t>(std::max(second->pos, 0)));
        const bool separated = override_value.value.find("---") != std::string::npos ||
                               override_value.value.find("...") != std::string::npos;
        throw ConfigError("--set", 0, 0, override_value.path,
                          separated ? "value holds a second YAML document (after '---'); give one value"
                                    : "value ends before '" + (rest.size() > 40 ? rest.substr(0, 40) + "..." : rest) + "'" +
                                          ", which is left over (a quote inside '...' is written '', inside \"...\" \\\")");
      }
      value = YAML::Load(override_value.value);
    } catch (const YAML::DeepRecursion&) {
      throw ConfigError("--set", 0, 0, override_value.path,
                        "value nested more than " + std::to_string(kMaxYamlDepth) + " levels deep");
    } catch (const YAML::Exception& e) {
      throw ConfigError("--set", 0, 0, override_value.path, "value is not valid YAML: " + e.msg);
    }
    check_tree_size(value, "--set", override_value.path);
    check_duplicate_keys(value, override_value.path, "--set");
    expand_tree(value, override_value.path, "--set", env);
  }

  if (!root.IsMap()) root = YAML::Node(YAML::NodeType::Map);
  // A list met on the path, given a segment that is not one of its indices.
  const auto bad_index = [&](const std::string& walked, const std::string& segment, std::size_t size) {
    const std::string entries = std::to_string(size) + (size == 1 ? " entry" : " entries");
    std::string said;
    if (!segment.empty() && segment.find_first_not_of("0123456789") == std::string::npos)
      said = size == 0 ? "'" + walked + "' is an empty list: there is no entry " + segment
                       : "'" + walked + "' has " + entries + " (0 to " + std::to_string(size - 1) +
                             "): there is no entry " + segment;
    else
      said = "'" + walked + "' is a list of " + entries + "; index it, e.g. " + walked + ".0";
    return ConfigError("--set", 0, 0, override_value.path, said);
  };
  // Which nodes the tree holds in more than one place (an anchor and its aliases), by where the
  // file wrote them; the nodes an override makes have no place and are never shared.
  std::map<std::pair<int, int>, int> uses;
  const auto count_uses = [&](const auto& self, const YAML::Node& node) -> void {
    if (!node.Mark().is_null() && ++uses[{node.Mark().pos, static_cast<int>(node.Type())}] > 1) return;
    if (node.IsSequence())
      for (const YAML::Node& child : node) self(self, child);
    else if (node.IsMap())
      for (auto it = node.begin(); it != node.end(); ++it) self(self, it->second);
  };
  count_uses(count_uses, root);
  const auto shared = [&](const YAML::Node& node) {
    if (!node.IsDefined() || node.Mark().is_null()) return false;
    const auto at = uses.find({node.Mark().pos, static_cast<int>(node.Type())});
    return at != uses.end() && at->second > 1;
  };
  // Set in place, a node the file gave an anchor would change at every alias of it too
  // (`max_tokens: &n 5` ... `concurrency: *n`, a message repeated as `*m`). Where the path
  // passes one, every map and list on it is made anew instead, in its order, holding the same
  // nodes as before but the one on the path; elsewhere the value is set in place, where every
  // map and list keeps its place in the file for the messages about it.
  bool copy = false;
  YAML::Node look = root;
  for (const std::string& segment : segments) {
    std::optional<std::size_t> index;
    if (look.IsSequence()) index = list_index(segment, look.size());
    const YAML::Node next = look.IsSequence() ? (index ? look[*index] : YAML::Node()) : look.IsMap() ? look[segment] : YAML::Node();
    if (!next.IsDefined()) break;
    if (shared(next)) copy = true;
    look.reset(next);
  }
  // `node` with the value at segments[i..] below it set.
  const auto set = [&](const auto& self, YAML::Node node, std::size_t i, const std::string& walked) -> YAML::Node {
    if (i == segments.size()) return value;
    const std::string& segment = segments[i];
    const std::string here = child_path(walked, segment);
    if (node.IsSequence()) {
      const std::optional<std::size_t> index = list_index(segment, node.size());
      if (!index) throw bad_index(walked, segment, node.size());
      const YAML::Node child = self(self, node[*index], i + 1, here);
      if (!copy) {
        node[*index] = child;
        return node;
      }
      YAML::Node out(YAML::NodeType::Sequence);
      for (std::size_t k = 0; k < node.size(); ++k) out.push_back(k == *index ? child : node[k]);
      return out;
    }
    // The next level's node as the path finds it, with the value set below it.
    const auto below = [&](const YAML::Node& next) -> YAML::Node {
      if (i + 1 == segments.size()) return value;
      if (next.IsScalar() && kShorthand.count(here)) {
        // Turn `input: x.jsonl` into {path: x.jsonl} so `input.format=batch` can sit beside it.
        // The value itself moves, with its place in the file.
        YAML::Node expanded(YAML::NodeType::Map);
        expanded[kShorthand.at(here)] = next;
        return self(self, expanded, i + 1, here);
      }
      if (!next.IsMap() && !next.IsSequence()) {
        made.emplace(here, override_value.flag.empty() ? std::string("--set") : override_value.flag);
        return self(self, YAML::Node(YAML::NodeType::Map), i + 1, here);
      }
      return self(self, next, i + 1, here);
    };
    if (!copy) {
      node[segment] = below(node[segment]);
      return node;
    }
    YAML::Node out(YAML::NodeType::Map);
    bool found = false;
    if (node.IsMap()) {
      for (auto it = node.begin(); it != node.end(); ++it) {
        if (!found && it->first.IsScalar() && it->first.Scalar() == segment) {
          out.force_insert(it->first, below(it->second));
          found = true;
        } else {
          out.force_insert(it->first, it->second);
        }
      }
    }
    if (!found) out.force_insert(segment, below(YAML::Node()));
    return out;
  };
  const YAML::Node result = set(set, root, 0, "");
  if (copy) root = result;
}

// Reads typed values out of the tree; every failure names file, line, column and field.
class Reader {
 public:
  // overrides: as they were applied, each with the flag it came from ("--set", "--count").
  // made: the maps the overrides made, by path, each with its flag.
  Reader(std::string file, std::vector<Override> overrides, std::map<std::string, std::string> made = {})
      : file_(std::move(file)), overrides_(std::move(overrides)), made_(std::move(made)) {}

  const std::string& file() const { return file_; }

  [[noreturn]] void fail(const YAML::Node& at, const std::string& field,
                         const std::string& message) const {
    const SourceMark m = mark(at, field);
    throw ConfigError(m.file, m.line, m.column, field, message);
  }

  // Where a field's value was written: the job file's line and column, or the flag that
  // overrode it.
  SourceMark mark(const YAML::Node& at, const std::string& field) const {
    if (std::optional<std::string> flag = overriding_flag(overrides_, field)) return SourceMark{std::move(*flag), 0, 0};
    // A map no line of the file wrote was made by a --set of a field inside it
    // (backend.timeouts for --set backend.timeouts.connect=1s): that flag is where it came from.
    if (at.IsDefined() && at.Mark().is_null()) {
      for (std::string outer = field; !outer.empty();) {
        if (const auto made = made_.find(outer); made != made_.end()) return SourceMark{made->second, 0, 0};
        const std::size_t dot = outer.find_last_of(".[");
        outer.resize(dot == std::string::npos ? 0 : dot);
      }
    }
    SourceMark m{file_, 0, 0};
    if (at.IsDefined() && !at.Mark().is_null()) {
      m.line = at.Mark().line + 1;
      m.column = at.Mark().column + 1;
    }
    return m;
  }

  // A setting that is valid but has no effect: the run goes on, the warning is printed first.
  void warn(const YAML::Node& at, const std::string& field, const std::string& message) const {
    const SourceMark m = mark(at, field);
    warnings_.push_back(ConfigError(m.file, m.line, m.column, field, message).what());
  }
  std::vector<std::string> take_warnings() const { return std::move(warnings_); }

  // Present and not null.
  static bool has(const YAML::Node& node) { return node.IsDefined() && !node.IsNull(); }

  // Where each key of a map (when `node` is one) was written, as "path.key".
  void mark_keys(const YAML::Node& node, const std::string& path, std::map<std::string, SourceMark>& marks) const {
    if (!has(node) || !node.IsMap()) return;
    for (auto it = node.begin(); it != node.end(); ++it) {
      const std::string field = path + "." + it->first.Scalar();
      marks.emplace(field, mark(it->second, field));
    }
  }

  // Checks a map's keys against kSections; returns the map (or an empty one when absent).
  // `path` names the section whose keys are valid; `field`, where given, the place in the file
  // (request.messages[2] for a section that is a list's entries).
  void check_map(const YAML::Node& node, const std::string& path, const std::string& field = {}) const {
    const std::string& where = field.empty() ? path : field;
    if (!node.IsMap()) fail(node, where.empty() ? "job" : where, "expected a map, got " + describe(node));
    const Keys& keys = sections().at(path);
    // (Keys given twice were refused for the whole tree when it was loaded.)
    std::vector<std::pair<YAML::Node, std::string>> unknown;  // the key and its name
    for (auto it = node.begin(); it != node.end(); ++it) {
      const YAML::Node key = it->first;
      std::string name = key.IsScalar() ? key.Scalar() : describe(key);
      if (std::find(keys.begin(), keys.end(), name) == keys.end()) unknown.emplace_back(key, name);
    }
    if (unknown.empty()) return;
    // The first is the error; the others in the same map are named with it, so that one run
    // shows every typo of a section.
    const auto hint = [&](const std::string& name) {
      const std::string suggestion = nearest_key(name, keys);
      return suggestion.empty() ? std::string() : " (did you mean '" + suggestion + "'?)";
    };
    std::string message = "unknown key";
    const std::string first_hint = hint(unknown.front().second);
    message += first_hint.empty() ? " (valid keys: " + join(keys) + ")" : first_hint;
    for (std::size_t i = 1; i < unknown.size(); ++i) {
      const YAML::Mark m = unknown[i].first.Mark();
      message += std::string(i == 1 ? "; also unknown: " : ", ") + "'" + unknown[i].second + "'" +
                 (m.is_null() ? std::string() : " (line " + std::to_string(m.line + 1) + ")") + hint(unknown[i].second);
    }
    fail(unknown.front().first, child_path(where, unknown.front().second), message);
  }

  std::string string(const YAML::Node& node, const std::string& field) const {
    if (!node.IsScalar()) fail(node, field, "expected a string, got " + describe(node));
    return node.Scalar();
  }

  std::int64_t integer(const YAML::Node& node, const std::string& field, std::int64_t min,
                       std::int64_t max = std::numeric_limits<std::int64_t>::max()) const {
    if (!node.IsScalar()) fail(node, field, "expected an integer, got " + describe(node));
    const std::string& text = node.Scalar();
    std::int64_t value = 0;
    const char* begin = text.data() + (text.starts_with('+') ? 1 : 0);
    auto [end, error] = std::from_chars(begin, text.data() + text.size(), value);
    if (error != std::errc() || end != text.data() + text.size()) {
      double as_double = 0;
      auto [dend, derror] = std::from_chars(begin, text.data() + text.size(), as_double);
      const bool whole =
          derror == std::errc() && dend == text.data() + text.size() && as_double == std::floor(as_double);
      if (whole && std::abs(as_double) < 9.2e18) {
        value = static_cast<std::int64_t>(as_double);  // 1e3 is a fine integer (and exact: a whole double is)
      } else if ((error == std::errc::result_out_of_range && end == text.data() + text.size()) || whole) {
        // Past what 64 bits hold (or 1e300): too large or too small, whatever the bounds.
        fail(node, field, range_message(text, min, max, text.starts_with('-') ? -1 : 1));
      } else {
        fail(node, field, "expected an integer, got '" + text + "'");
      }
    }
    if (value < min || value > max) fail(node, field, range_message(text, min, max, value < min ? -1 : 1));
    return value;
  }

  std::uint64_t unsigned_integer(const YAML::Node& node, const std::string& field) const {
    if (!node.IsScalar()) fail(node, field, "expected an integer, got " + describe(node));
    const std::string& text = node.Scalar();
    std::uint64_t value = 0;
    auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (error == std::errc::result_out_of_range && end == text.data() + text.size())
      fail(node, field, range_message(text, std::uint64_t{0}, std::numeric_limits<std::uint64_t>::max(), 1));
    if (error != std::errc() || end != text.data() + text.size())
      fail(node, field, "expected a non-negative integer, got '" + text + "'");
    return value;
  }

  double number(const YAML::Node& node, const std::string& field, double min, double max) const {
    if (!node.IsScalar()) fail(node, field, "expected a number, got " + describe(node));
    const std::string& text = node.Scalar();
    double value = 0;
    const char* begin = text.data() + (text.starts_with('+') ? 1 : 0);
    auto [end, error] = std::from_chars(begin, text.data() + text.size(), value);
    // A number past a double's range (1e400) is one, too large or too small, as integers say.
    if (error == std::errc::result_out_of_range && end == text.data() + text.size()) {
      const bool negative = text.starts_with('-');
      const bool tiny = text.find_first_of("eE") != std::string::npos &&
                        text.find('-', text.find_first_of("eE")) != std::string::npos;
      if (!tiny) fail(node, field, range_message(text, min, max, negative ? -1 : 1));
      value = 0;
    } else if (error != std::errc() || end != text.data() + text.size() || !std::isfinite(value)) {
      fail(node, field, "expected a number, got '" + text + "'");
    }
    if (value < min || value > max) fail(node, field, range_message(text, min, max, value < min ? -1 : 1));
    return value;
  }

  bool boolean(const YAML::Node& node, const std::string& field) const {
    static const std::set<std::string> yes = {"true", "True", "TRUE", "yes", "on"};
    static const std::set<std::string> no = {"false", "False", "FALSE", "no", "off"};
    if (node.IsScalar()) {
      if (yes.count(node.Scalar())) return true;
      if (no.count(node.Scalar())) return false;
    }
    fail(node, field, "expected true or false, got " + describe(node));
  }

  // 0.5s, 500ms, 2m, 1h, or a bare number of seconds.
  milliseconds duration(const YAML::Node& node, const std::string& field) const {
    if (!node.IsScalar()) fail(node, field, "expected a duration like 500ms, 2s or 1m, got " + describe(node));
    const std::string& text = node.Scalar();
    double value = 0;
    auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    std::string_view unit(end, static_cast<std::size_t>(text.data() + text.size() - end));
    double scale = 0;
    if (unit.empty() || unit == "s") scale = 1000;
    else if (unit == "ms") scale = 1;
    else if (unit == "m") scale = 60'000;
    else if (unit == "h") scale = 3'600'000;
    if (error != std::errc() || scale == 0 || !std::isfinite(value))
      fail(node, field, "expected a duration like 500ms, 2s or 1m, got '" + text + "'");
    if (value < 0) fail(node, field, "must not be negative, got '" + text + "'");
    // A year at most: deadlines add durations to clock readings in nanoseconds, where '1e300s'
    // would overflow (and its conversion to milliseconds is already out of range).
    constexpr double kMaxMs = 365.0 * 24 * 3'600'000;
    if (value * scale > kMaxMs) fail(node, field, "must be at most 8760h (a year), got '" + text + "'");
    return milliseconds(static_cast<std::int64_t>(std::llround(value * scale)));
  }

  template <typename Enum>
  Enum choice(const YAML::Node& node, const std::string& field,
              const std::vector<std::pair<std::string, Enum>>& options) const {
    std::string text = string(node, field);
    Keys names;
    for (const auto& [name, value] : options) {
      if (name == text) return value;
      names.push_back(name);
    }
    std::string message = "bad value '" + text + "' (expected one of: " + join(names) + ")";
    fail(node, field, message);
  }

  std::vector<std::string> string_list(const YAML::Node& node, const std::string& field) const {
    std::vector<std::string> out;
    if (node.IsScalar()) return {node.Scalar()};
    if (!node.IsSequence()) fail(node, field, "expected a string or a list of strings, got " + describe(node));
    for (std::size_t i = 0; i < node.size(); ++i) out.push_back(string(node[i], index_path(field, i)));
    return out;
  }

  void require_file(const YAML::Node& node, const std::string& field, const std::string& path,
                    const std::string& what) const {
    std::error_code ec;
    const fs::file_status status = fs::status(path, ec);
    if (!fs::exists(status)) {
      std::string message = what + " not found: '" + path + "'";
      if (fs::path(path).is_relative())
        message += " (relative paths are taken from the current directory, " + fs::current_path(ec).string() + ")";
      fail(node, field, message);
    }
    if (fs::is_directory(status)) fail(node, field, "'" + path + "' is a directory, not a file");
    if (!fs::is_regular_file(status)) fail(node, field, "'" + path + "' is not a regular file");
    std::ifstream probe(path);
    if (!probe) fail(node, field, what + " is not readable: '" + path + "'");
  }

 private:
  // side: -1 for a value below min, 1 above max. Where that side has no bound of its own (only
  // the type's), the message says which way it is out: "must be >= 0" for 10^23 would mislead.
  template <typename T>
  static std::string range_message(const std::string& text, T min, T max, int side) {
    auto show = [](T v) {
      std::ostringstream s;
      s << v;
      return s.str();
    };
    const bool min_is_the_types = min == std::numeric_limits<T>::lowest();
    const bool max_is_the_types = max == std::numeric_limits<T>::max();
    if (side > 0 && max_is_the_types) return "too large: the largest allowed is " + show(max) + ", got " + text;
    if (side < 0 && min_is_the_types) return "too small: the smallest allowed is " + show(min) + ", got " + text;
    if (max_is_the_types) return "must be >= " + show(min) + ", got " + text;
    return "must be between " + show(min) + " and " + show(max) + ", got " + text;
  }

  std::string file_;
  std::vector<Override> overrides_;
  std::map<std::string, std::string> made_;  // maps the overrides made, by path: the flag
  mutable std::vector<std::string> warnings_;
};

std::string file_stem(const std::string& label) {
  std::string stem = fs::path(label).stem().string();
  return stem.empty() ? "job" : stem;
}

void read_input(const Reader& r, const YAML::Node& node, InputSpec& input) {
  if (node.IsScalar()) {
    input.path = node.Scalar();
    if (input.path.empty()) r.fail(node, "input", "empty path");
    r.require_file(node, "input", input.path, "input file");
    return;
  }
  r.check_map(node, "input");
  const YAML::Node path = node["path"];
  if (!Reader::has(path)) r.fail(node, "input.path", "required (the input file)");
  input.path = r.string(path, "input.path");
  if (input.path.empty()) r.fail(path, "input.path", "empty path");
  if (Reader::has(node["format"]))
    input.format = r.choice<InputFormat>(node["format"], "input.format",
                                         {{"auto", InputFormat::Auto},
                                          {"jsonl", InputFormat::Jsonl},
                                          {"batch", InputFormat::Batch}});
  r.require_file(path, "input.path", input.path, "input file");
}

void read_synth(const Reader& r, const YAML::Node& node, SynthSpec& synth) {
  r.check_map(node, "synth");
  if (Reader::has(node["count"])) synth.count = r.integer(node["count"], "synth.count", 1);
  if (Reader::has(node["seed"])) synth.seed = r.unsigned_integer(node["seed"], "synth.seed");
  const YAML::Node variables = node["variables"];
  if (!Reader::has(variables)) return;
  if (!variables.IsMap()) r.fail(variables, "synth.variables", "expected a map of name: [choices], got " + describe(variables));
  for (auto it = variables.begin(); it != variables.end(); ++it) {
    std::string name = it->first.Scalar();
    std::string field = "synth.variables." + name;
    const YAML::Node choices = it->second;
    // {{a.b}} reads field b of a: a name with a dot could never be filled in.
    if (name.empty() || name.find_first_of(". {}") != std::string::npos)
      r.fail(it->first, field,
             "a variable name cannot be empty or hold '.', ' ', '{' or '}' ({{a.b}} reads field b of a); "
             "name it with letters, digits, '_' or '-'");
    if (!choices.IsSequence()) r.fail(choices, field, "expected a list of choices, got " + describe(choices));
    if (choices.size() == 0) r.fail(choices, field, "needs at least one choice");
    synth.variables[name] = r.string_list(choices, field);
  }
}

}  // namespace

const char* const kOneAnswerPerItem =
    "batchlm keeps one answer per item, so n must be 1 (more would pay for answers it drops; for "
    "several samples, run the items again with other seeds)";

bool is_token_limit(const nlohmann::ordered_json& value) {
  if (!value.is_number_integer()) return false;
  if (value.is_number_unsigned()) return value.get<std::uint64_t>() >= 1 && value.get<std::uint64_t>() <= INT_MAX;
  return value.get<std::int64_t>() >= 1 && value.get<std::int64_t>() <= INT_MAX;
}

namespace {

// A template's placeholders are {{field}}: an unclosed or empty one is a typo, not text to
// send as it is with every item.
void check_template(const Reader& r, const YAML::Node& node, const std::string& field,
                    const std::string& text) {
  for (std::size_t at = 0;;) {
    const std::size_t open = text.find("{{", at);
    if (open == std::string::npos) return;
    const std::size_t close = text.find("}}", open + 2);
    if (close == std::string::npos)
      r.fail(node, field,
             "unclosed '{{' at character " + std::to_string(open + 1) + " (a placeholder is {{field}})");
    const std::string name = text.substr(open + 2, close - open - 2);
    if (name.find_first_not_of(' ') == std::string::npos)
      r.fail(node, field, "empty placeholder '" + text.substr(open, close + 2 - open) + "' at character " +
                              std::to_string(open + 1) + " (a placeholder is {{field}})");
    at = close + 2;
  }
}

// Placeholders are filled in the messages and request.model only: a {{field}} elsewhere in the
// request goes to the API as written, which is more likely a mistake than meant.
void warn_placeholders(const Reader& r, const YAML::Node& node, const std::string& field, const nlohmann::json& value) {
  if (value.is_string()) {
    const std::string& text = value.get_ref<const std::string&>();
    const std::size_t open = text.find("{{");
    if (open != std::string::npos && text.find("}}", open + 2) != std::string::npos)
      r.warn(node, field,
             "'" + text + "' is sent as written: placeholders are filled in request.messages and request.model only");
  } else if (value.is_array()) {
    for (std::size_t i = 0; i < value.size(); ++i)
      warn_placeholders(r, node.IsSequence() ? node[i] : node, index_path(field, i), value[i]);
  } else if (value.is_object()) {
    for (const auto& [key, item] : value.items())
      warn_placeholders(r, node.IsMap() && node[key] ? node[key] : node, field + "." + key, item);
  }
}

void read_messages(const Reader& r, const YAML::Node& node, std::vector<ChatMessage>& messages) {
  if (!node.IsSequence()) r.fail(node, "request.messages", "expected a list of {role, content}, got " + describe(node));
  for (std::size_t i = 0; i < node.size(); ++i) {
    const YAML::Node m = node[i];
    std::string field = index_path("request.messages", i);
    if (!m.IsMap()) r.fail(m, field, "expected a map {role, content}, got " + describe(m));
    r.check_map(m, "request.messages", field);
    ChatMessage message;
    if (!Reader::has(m["role"])) r.fail(m, field + ".role", "required");
    message.role = r.choice<std::string>(m["role"], field + ".role",
                                         {{"system", "system"}, {"developer", "developer"},
                                          {"user", "user"}, {"assistant", "assistant"},
                                          {"tool", "tool"}});
    // The tool-calling fields are sent as written (no placeholders), held to the API's form.
    nlohmann::json tool_fields = nlohmann::json::object();
    for (const char* key : {"tool_calls", "tool_call_id", "name", "reasoning_content"})
      if (Reader::has(m[key])) tool_fields[key] = yaml_to_json(m[key]);
    // Ids, names and reasoning are text even where YAML would read a number (id: 12345).
    for (const char* key : {"tool_call_id", "name", "reasoning_content"})
      if (Reader::has(m[key]) && m[key].IsScalar()) tool_fields[key] = m[key].Scalar();
    if (Reader::has(m["tool_calls"]) && m["tool_calls"].IsSequence())
      for (std::size_t k = 0; k < m["tool_calls"].size(); ++k) {
        const YAML::Node call = m["tool_calls"][k];
        if (!call.IsMap()) continue;
        if (Reader::has(call["id"]) && call["id"].IsScalar()) tool_fields["tool_calls"][k]["id"] = call["id"].Scalar();
        if (Reader::has(call["function"]) && call["function"].IsMap() && Reader::has(call["function"]["name"]) &&
            call["function"]["name"].IsScalar())
          tool_fields["tool_calls"][k]["function"]["name"] = call["function"]["name"].Scalar();
      }
    if (auto problem = read_tool_fields(tool_fields, message)) {
      const std::string& at = problem->first;
      const std::string key = at.substr(1, at.find_first_of(".[", 1) - 1);
      r.fail(m[key], field + at, problem->second);
    }
    // An assistant message that calls tools may leave its content out.
    if (Reader::has(m["content"])) {
      message.content = r.string(m["content"], field + ".content");
      check_template(r, m["content"], field + ".content", message.content);
      // Every item would get the same empty turn: most likely a template left unfilled.
      if (message.content.empty() && !message.calls_tools())
        r.warn(m["content"], field + ".content", "empty: every item's " + message.role + " turn says nothing");
    } else if (!message.calls_tools()) {
      r.fail(m, field + ".content", "required");
    }
    messages.push_back(std::move(message));
  }
  if (auto problem = unanswered_tool_message(messages))
    r.fail(node[problem->first]["tool_call_id"], index_path("request.messages", problem->first) + ".tool_call_id",
           problem->second);
}

void read_request(const Reader& r, const YAML::Node& node, RequestTemplate& request) {
  r.check_map(node, "request");
  if (Reader::has(node["messages"])) read_messages(r, node["messages"], request.messages);
  if (Reader::has(node["model"])) {
    request.model = r.string(node["model"], "request.model");
    // Empty would mean "the backend's model": a model the user never named for this request.
    if (request.model.empty())
      r.fail(node["model"], "request.model", "empty; name a model, or leave request.model out for backend.model");
    check_template(r, node["model"], "request.model", request.model);
  }
  if (Reader::has(node["max_tokens"]))
    request.max_tokens = static_cast<int>(r.integer(node["max_tokens"], "request.max_tokens", 1,
                                                    std::numeric_limits<int>::max()));
  if (Reader::has(node["temperature"]))
    request.temperature = r.number(node["temperature"], "request.temperature", 0, 2);
  if (Reader::has(node["top_p"])) request.top_p = r.number(node["top_p"], "request.top_p", 0, 1);
  if (Reader::has(node["stop"])) {
    request.stop = r.string_list(node["stop"], "request.stop");
    for (const std::string& stop : request.stop)
      if (stop.empty()) r.fail(node["stop"], "request.stop", kEmptyStopString);
    warn_placeholders(r, node["stop"], "request.stop", nlohmann::json(request.stop));
  }
  if (Reader::has(node["seed"]))
    request.seed = r.integer(node["seed"], "request.seed", std::numeric_limits<std::int64_t>::min());
  if (Reader::has(node["extra"])) {
    const YAML::Node extra = node["extra"];
    if (!extra.IsMap()) r.fail(extra, "request.extra", "expected a map of body fields, got " + describe(extra));
    request.extra = yaml_to_json(extra);
    warn_placeholders(r, extra, "request.extra", request.extra);
    if (const auto n = request.extra.find("n"); n != request.extra.end() && !(n->is_number_integer() && *n == 1))
      r.fail(extra["n"], "request.extra.n", kOneAnswerPerItem);
    // The body's own fields are typed, checked and win over the extra ones, which would
    // otherwise be sent unchecked when the typed one is unset, or dropped without a word.
    for (const char* key : {"model", "messages", "max_tokens", "temperature", "top_p", "stop", "seed"})
      if (request.extra.contains(key))
        r.fail(extra[key], std::string("request.extra.") + key,
               std::string("set it as ") + (std::string_view(key) == "model" ? "backend.model or request.model"
                                                                             : "request." + std::string(key)) +
                   ", where it is checked");
    if (request.extra.contains("prompt"))
      r.fail(extra["prompt"], "request.extra.prompt", "a job sends chats: write the text as a user message in request.messages");
    if (request.extra.contains("stream"))
      r.fail(extra["stream"], "request.extra.stream", "set it as backend.stream");
    // A limit the rate limiter counts with, so checked as request.max_tokens is.
    if (const auto cap = request.extra.find("max_completion_tokens"); cap != request.extra.end()) {
      if (!is_token_limit(*cap))
        r.fail(extra["max_completion_tokens"], "request.extra.max_completion_tokens",
               "expected an integer from 1 to 2147483647");
      if (request.max_tokens && Reader::has(node["max_tokens"]))
        r.fail(extra["max_completion_tokens"], "request.extra.max_completion_tokens",
               "given with request.max_tokens: the two are one limit; keep one of them (request.max_tokens: null)");
    }
  }
}

void read_few_shot(const Reader& r, const YAML::Node& node, FewShotSpec& few_shot) {
  r.check_map(node, "few_shot");
  const YAML::Node path = node["path"];
  if (Reader::has(path)) few_shot.path = r.string(path, "few_shot.path");
  if (Reader::has(node["count"]))
    few_shot.count = static_cast<int>(r.integer(node["count"], "few_shot.count", 0, 1'000'000));
  if (Reader::has(node["seed"])) few_shot.seed = r.unsigned_integer(node["seed"], "few_shot.seed");
  if (Reader::has(node["user"])) {
    few_shot.user = r.string(node["user"], "few_shot.user");
    check_template(r, node["user"], "few_shot.user", few_shot.user);
  }
  if (Reader::has(node["assistant"])) {
    few_shot.assistant = r.string(node["assistant"], "few_shot.assistant");
    check_template(r, node["assistant"], "few_shot.assistant", few_shot.assistant);
  }
  if (few_shot.path.empty()) {
    if (few_shot.count > 0)
      r.fail(Reader::has(path) ? path : node, "few_shot.path",
             Reader::has(path) ? "empty; give the examples' file" : "required when few_shot.count is set");
    return;
  }
  if (!Reader::has(node["count"]))
    r.fail(node, "few_shot.count", "required when few_shot.path is set (how many examples)");
  r.require_file(path, "few_shot.path", few_shot.path, "few-shot file");
}

// The URL with its scheme in lower case (a scheme is case-insensitive: HTTPS:// is https://), as
// the rest of the program compares it.
std::string with_lowercase_scheme(std::string url) {
  const std::size_t end = url.find("://");
  if (end != std::string::npos)
    std::transform(url.begin(), url.begin() + static_cast<std::ptrdiff_t>(end), url.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return url;
}

// What is wrong with an API's base URL, or "" when nothing is: the same checks for
// backend.base_url, --base-url and $OPENAI_BASE_URL, so that none of them reaches the client
// (which would retry a URL it cannot use until the run gives up).
std::string url_problem(std::string_view url) {
  if (url.empty()) return "empty; give the API's URL, e.g. http://127.0.0.1:8000/v1";
  std::string_view rest;
  const std::string lowered = with_lowercase_scheme(std::string(url.substr(0, url.find("://") + 3)));
  for (std::string_view scheme : {"http://", "https://"})
    if (lowered == scheme) rest = url.substr(scheme.size());
  if (rest.data() == nullptr)
    return "expected an http:// or https:// URL, got '" + std::string(url) + "'";
  if (const auto bad = std::find_if(url.begin(), url.end(),
                                    [](char c) { return static_cast<unsigned char>(c) <= 0x20 || c == 0x7F; });
      bad != url.end())
    return std::string(*bad == ' ' ? "a space" : "a control character") + " at character " +
           std::to_string(bad - url.begin() + 1) + " of '" + std::string(url) +
           "' (a URL holds none; percent-encode it, e.g. %20)";
  const std::string_view authority = rest.substr(0, rest.find_first_of("/?#"));
  const std::string_view host_port = authority.substr(authority.find('@') == std::string_view::npos ? 0 : authority.find('@') + 1);
  // The port follows the last ':' outside an IPv6 address's brackets.
  const std::size_t colon = host_port.rfind(':');
  const bool has_port = colon != std::string_view::npos && host_port.find(']', colon) == std::string_view::npos;
  const std::string_view host = has_port ? host_port.substr(0, colon) : host_port;
  if (host.empty()) return "no host in '" + std::string(url) + "' (e.g. http://127.0.0.1:8000/v1)";
  // An IPv6 address is the whole host, in brackets; brackets anywhere else are no host at all.
  const bool bracketed = host.starts_with('[') && host.ends_with(']') && host.size() > 2;
  if ((host.find_first_of("[]") != std::string_view::npos && !bracketed) ||
      (bracketed && host.substr(1, host.size() - 2).find_first_of("[]") != std::string_view::npos))
    return "bad host '" + std::string(host) + "' in '" + std::string(url) +
           "' (an IPv6 address goes in brackets, e.g. http://[::1]:8000/v1)";
  if (url.find('#') != std::string_view::npos)
    return "a fragment ('#') in '" + std::string(url) + "': it is never sent to a server; leave it out";
  if (has_port) {
    const std::string_view port = host_port.substr(colon + 1);
    unsigned value = 0;
    const auto [end, error] = std::from_chars(port.data(), port.data() + port.size(), value);
    if (port.empty() || error != std::errc() || end != port.data() + port.size() || value == 0 || value > 65535)
      return "bad port '" + std::string(port) + "' in '" + std::string(url) + "' (1 to 65535)";
  }
  return {};
}

std::optional<double> parse_byte_size_unbounded(std::string_view text);

void read_backend(const Reader& r, const YAML::Node& node, BackendSpec& backend) {
  r.check_map(node, "backend");
  if (Reader::has(node["type"]))
    backend.type = r.choice<std::string>(node["type"], "backend.type",
                                         {{"openai", "openai"}, {"local", "local"}});
  if (Reader::has(node["base_url"])) {
    backend.base_url = r.string(node["base_url"], "backend.base_url");
    if (const std::string problem = url_problem(backend.base_url); !problem.empty())
      r.fail(node["base_url"], "backend.base_url", problem);
    backend.base_url = with_lowercase_scheme(std::move(backend.base_url));
  }
  if (Reader::has(node["model"])) {
    backend.model = r.string(node["model"], "backend.model");
    // Empty would fall back to the default model: against a paid API, one the user never chose.
    if (backend.model.empty())
      r.fail(node["model"], "backend.model",
             "empty; name a model (a GGUF path for the embedded engine, a model name for an API), or leave it out "
             "for the default");
  }
  if (Reader::has(node["api_key_env"])) {
    backend.api_key_env = r.string(node["api_key_env"], "backend.api_key_env");
    if (backend.api_key_env.empty())
      r.fail(node["api_key_env"], "backend.api_key_env",
             "empty; name the environment variable that holds the API key (default OPENAI_API_KEY)");
  }
  if (Reader::has(node["headers"])) {
    const YAML::Node headers = node["headers"];
    if (!headers.IsMap()) r.fail(headers, "backend.headers", "expected a map of name: value, got " + describe(headers));
    for (auto it = headers.begin(); it != headers.end(); ++it) {
      std::string name = it->first.Scalar();
      const std::string field = "backend.headers." + name;
      // RFC 9110: a name is a token; a value has no line breaks or other control characters
      // (they would end the header and start another).
      const bool token = !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("!#$%&'*+-.^_`|~", c) != nullptr;
      });
      if (!token) r.fail(it->first, field, "not a valid header name (letters, digits and !#$%&'*+-.^_`|~ only)");
      std::string value = r.string(it->second, field);
      if (std::any_of(value.begin(), value.end(),
                      [](char c) { return (static_cast<unsigned char>(c) < 0x20 && c != '\t') || c == 0x7F; }))
        r.fail(it->second, field, "the value holds a line break or another control character");
      backend.headers.emplace_back(name, std::move(value));
    }
  }
  if (Reader::has(node["timeouts"])) {
    const YAML::Node t = node["timeouts"];
    r.check_map(t, "backend.timeouts");
    auto& out = backend.timeouts;
    if (Reader::has(t["connect"])) out.connect = r.duration(t["connect"], "backend.timeouts.connect");
    if (Reader::has(t["first_byte"])) out.first_byte = r.duration(t["first_byte"], "backend.timeouts.first_byte");
    if (Reader::has(t["idle"])) out.idle = r.duration(t["idle"], "backend.timeouts.idle");
    if (Reader::has(t["total"])) out.total = r.duration(t["total"], "backend.timeouts.total");
  }
  if (Reader::has(node["stream"])) backend.stream = r.boolean(node["stream"], "backend.stream");
  if (Reader::has(node["threads"]))
    backend.threads = static_cast<int>(r.integer(node["threads"], "backend.threads", 0, 1024));
  if (Reader::has(node["device"]))
    backend.device = r.choice<std::string>(node["device"], "backend.device",
                                           {{"auto", "auto"}, {"cuda", "cuda"}, {"cpu", "cpu"}});
  if (Reader::has(node["context"]))
    backend.context = r.integer(node["context"], "backend.context", 0, 1 << 24);
  if (Reader::has(node["max_sequences"]))
    backend.max_sequences = static_cast<int>(r.integer(node["max_sequences"], "backend.max_sequences", 1, 512));
  if (Reader::has(node["token_budget"]))
    backend.token_budget = r.integer(node["token_budget"], "backend.token_budget", 0, 512);
  if (Reader::has(node["block_size"]))
    backend.block_size = static_cast<int>(r.integer(node["block_size"], "backend.block_size", 1, 256));
  if (Reader::has(node["kv_tokens"]))
    backend.kv_tokens = r.integer(node["kv_tokens"], "backend.kv_tokens", 0, std::int64_t{1} << 32);
  if (Reader::has(node["kv_memory"])) {
    const YAML::Node m = node["kv_memory"];
    const std::optional<std::int64_t> bytes = m.IsScalar() ? parse_byte_size(m.Scalar()) : std::nullopt;
    if (!bytes && m.IsScalar() && parse_byte_size_unbounded(m.Scalar()))
      r.fail(m, "backend.kv_memory",
             "too large: the largest allowed is 9000000000000000000 bytes (about 7.8EiB), got '" + m.Scalar() + "'");
    if (!bytes) {
      r.fail(m, "backend.kv_memory",
             "expected a size such as 2GiB, 512MiB or 1073741824, got " +
                 (m.IsScalar() ? "'" + m.Scalar() + "'" : describe(m)));
    }
    backend.kv_bytes = *bytes;
  }
  if (Reader::has(node["kv_recycle"])) backend.kv_recycle = r.boolean(node["kv_recycle"], "backend.kv_recycle");
  if (Reader::has(node["step_log"])) backend.step_log = r.string(node["step_log"], "backend.step_log");
  if (Reader::has(node["reasoning"]))
    backend.reasoning = r.choice<std::string>(node["reasoning"], "backend.reasoning",
                                              {{"separate", "separate"}, {"inline", "inline"}});
  if (Reader::has(node["speculative"])) {
    const YAML::Node n = node["speculative"];
    r.check_map(n, "backend.speculative");
    auto& spec = backend.speculative;
    if (Reader::has(n["method"]))
      spec.method = r.choice<std::string>(n["method"], "backend.speculative.method",
                                          {{"none", "none"}, {"draft", "draft"},
                                           {"self", "self"}, {"ngram", "ngram"}});
    if (Reader::has(n["model"])) spec.model = r.string(n["model"], "backend.speculative.model");
    auto small = [&](const char* key, int min, int max, int& out) {
      if (Reader::has(n[key]))
        out = static_cast<int>(r.integer(n[key], std::string("backend.speculative.") + key, min, max));
    };
    small("layers", 0, 1024, spec.layers);
    small("k_max", 1, 16, spec.k_max);
    small("k_min", 0, 16, spec.k_min);
    small("ngram_max", 1, 64, spec.ngram_max);
    small("ngram_min", 1, 64, spec.ngram_min);
    if (spec.k_min > spec.k_max)
      r.fail(n["k_min"], "backend.speculative.k_min",
             "k_min " + std::to_string(spec.k_min) + " is more than k_max " + std::to_string(spec.k_max));
    if (spec.ngram_min > spec.ngram_max)
      r.fail(Reader::has(n["ngram_min"]) ? n["ngram_min"] : n, "backend.speculative.ngram_min",
             "ngram_min " + std::to_string(spec.ngram_min) + " is more than ngram_max " +
                 std::to_string(spec.ngram_max));
    if (spec.method == "draft" && spec.model.empty())
      r.fail(n, "backend.speculative.model", "required by method draft (a GGUF with the model's vocabulary)");
    if (spec.method != "draft" && !spec.model.empty())
      r.warn(n["model"], "backend.speculative.model",
             "used only by method draft; method " + (spec.method.empty() ? std::string("none") : spec.method) +
                 " leaves it unread");
  }
  if (backend.token_budget > 0 && backend.token_budget < backend.max_sequences) {
    r.fail(node["token_budget"], "backend.token_budget",
           "token_budget " + std::to_string(backend.token_budget) + " is less than max_sequences " +
               std::to_string(backend.max_sequences) + ": every running sequence needs a token each step");
  }
}

}  // namespace

namespace {

// The largest size taken: below 2^63 with room for a double's rounding.
constexpr double kMaxByteSize = 9e18;

// parse_byte_size without the bound: a size too large for it is still a size.
std::optional<double> parse_byte_size_unbounded(std::string_view text) {
  while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
  while (!text.empty() && text.back() == ' ') text.remove_suffix(1);
  std::size_t digits = 0;
  while (digits < text.size() && (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.'))
    ++digits;
  if (digits == 0) return std::nullopt;
  double value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + digits, value);
  if (error != std::errc() || end != text.data() + digits) return std::nullopt;
  std::string unit;
  for (char c : text.substr(digits)) {
    if (c != ' ') unit += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  static const std::map<std::string, double> units = {
      {"", 1.0},         {"b", 1.0},
      {"k", 0x1p10},     {"kib", 0x1p10}, {"ki", 0x1p10}, {"kb", 1e3},
      {"m", 0x1p20},     {"mib", 0x1p20}, {"mi", 0x1p20}, {"mb", 1e6},
      {"g", 0x1p30},     {"gib", 0x1p30}, {"gi", 0x1p30}, {"gb", 1e9},
      {"t", 0x1p40},     {"tib", 0x1p40}, {"ti", 0x1p40}, {"tb", 1e12},
      {"p", 0x1p50},     {"pib", 0x1p50}, {"pi", 0x1p50}, {"pb", 1e15},
      {"e", 0x1p60},     {"eib", 0x1p60}, {"ei", 0x1p60}, {"eb", 1e18}};
  auto it = units.find(unit);
  if (it == units.end()) return std::nullopt;
  const double bytes = value * it->second;
  if (!(bytes >= 0)) return std::nullopt;
  return bytes;
}

}  // namespace

std::optional<std::int64_t> parse_byte_size(std::string_view text) {
  const std::optional<double> bytes = parse_byte_size_unbounded(text);
  if (!bytes || *bytes > kMaxByteSize) return std::nullopt;
  return static_cast<std::int64_t>(*bytes);
}

namespace {

void read_retry(const Reader& r, const YAML::Node& node, RetrySpec& retry) {
  r.check_map(node, "retry");
  if (Reader::has(node["max_attempts"]))
    retry.max_attempts = static_cast<int>(r.integer(node["max_attempts"], "retry.max_attempts", 1, 1000));
  if (Reader::has(node["base"])) retry.base = r.duration(node["base"], "retry.base");
  if (Reader::has(node["cap"])) retry.cap = r.duration(node["cap"], "retry.cap");
  if (Reader::has(node["max_retry_after"]))
    retry.max_retry_after = r.duration(node["max_retry_after"], "retry.max_retry_after");
  if (Reader::has(node["reconnect_for"]))
    retry.reconnect_for = r.duration(node["reconnect_for"], "retry.reconnect_for");
  if (Reader::has(node["budget_ratio"]))
    retry.budget_ratio = r.number(node["budget_ratio"], "retry.budget_ratio", 0, 1e9);
  if (Reader::has(node["budget_min_per_second"])) {
    retry.budget_min_per_second = r.number(node["budget_min_per_second"], "retry.budget_min_per_second", 0, 1e9);
    // Below one retry in 10 s, a run whose items have all been sent once could never retry.
    if (retry.budget_min_per_second < 0.1)
      r.fail(node["budget_min_per_second"], "retry.budget_min_per_second",
             "must be at least 0.1 (a retry every 10 s): with less, once every item has been sent the budget "
             "would never allow another retry and the run would wait for good");
  }
  if (retry.cap < retry.base)
    r.fail(Reader::has(node["cap"]) ? node["cap"] : node, "retry.cap",
           "must be >= retry.base (" + std::to_string(retry.base.count()) + "ms), got " +
               std::to_string(retry.cap.count()) + "ms");
}

void read_output(const Reader& r, const YAML::Node& node, OutputSpec& output) {
  if (node.IsScalar()) {
    output.path = node.Scalar();
    if (output.path.empty()) r.fail(node, "output", "empty path");
    return;
  }
  r.check_map(node, "output");
  if (Reader::has(node["path"])) {
    output.path = r.string(node["path"], "output.path");
    if (output.path.empty()) r.fail(node["path"], "output.path", "empty path");
  }
  if (Reader::has(node["flush_every"]))
    output.flush_every = static_cast<int>(r.integer(node["flush_every"], "output.flush_every", 1, 1'000'000));
  if (Reader::has(node["flush_interval"]))
    output.flush_interval = r.duration(node["flush_interval"], "output.flush_interval");
  if (Reader::has(node["input_fields"])) {
    const YAML::Node fields = node["input_fields"];
    if (!fields.IsSequence()) r.fail(fields, "output.input_fields", "expected a list of field names, got " + describe(fields));
    output.input_fields = r.string_list(fields, "output.input_fields");
  }
}

// The scoring types by their names in a job file.
const std::vector<std::pair<std::string, ScoringKind>> kScoringKinds = {{"none", ScoringKind::None},
                                                                         {"gsm8k", ScoringKind::Gsm8k},
                                                                         {"exact_match", ScoringKind::ExactMatch},
                                                                         {"regex", ScoringKind::Regex}};

void read_scoring(const Reader& r, const YAML::Node& node, ScoringSpec& scoring) {
  const auto& kinds = kScoringKinds;
  // Not `type_node = node["type"]`: assigning one yaml-cpp handle to another rewrites the
  // node it points at.
  const YAML::Node type_node = node.IsMap() ? node["type"] : node;
  if (node.IsMap()) {
    r.check_map(node, "scoring");
    if (!Reader::has(type_node)) r.fail(node, "scoring.type", "required (none, gsm8k, exact_match, regex)");
    if (Reader::has(node["reference_field"]))
      scoring.reference_field = r.string(node["reference_field"], "scoring.reference_field");
    if (Reader::has(node["pattern"])) scoring.pattern = r.string(node["pattern"], "scoring.pattern");
  }
  std::string field = node.IsMap() ? "scoring.type" : "scoring";
  scoring.kind = r.choice<ScoringKind>(type_node, field, kinds);
  if (scoring.kind == ScoringKind::Regex) {
    if (scoring.pattern.empty()) r.fail(node, "scoring.pattern", "required for regex scoring");
    try {
      Pattern compiled(scoring.pattern);
    } catch (const std::invalid_argument& e) {
      r.fail(node["pattern"], "scoring.pattern", std::string("not a valid regex: ") + e.what());
    }
    // A YAML block (`pattern: |`) keeps its last line break, which the output must then hold.
    if (scoring.pattern.ends_with('\n'))
      r.warn(node["pattern"], "scoring.pattern",
             "ends with a line break, which an output must hold to match (a YAML '|' block keeps it: write '|-', or "
             "quote the pattern)");
  }
}

// Settings of one kind of backend given to the other: a base URL on the embedded engine is an
// error (which was meant?); engine settings on an API, or API settings on the engine, are
// warned about, since one job file may be run both ways (--base-url).
void check_backend_fields(const Reader& r, const YAML::Node& node, const BackendSpec& backend) {
  if (backend.type == "local" && !backend.base_url.empty())
    r.fail(Reader::has(node) ? node["base_url"] : node, "backend.base_url",
           "is for an API, but backend.type is local; remove it, or set backend.type to openai "
           "(--backend openai)");
  if (!Reader::has(node) || !node.IsMap()) return;
  static const Keys engine_only = {"threads", "device", "context", "max_sequences", "token_budget", "block_size",
                                   "kv_tokens", "kv_memory", "kv_recycle", "step_log", "speculative",
                                   "reasoning"};
  static const Keys api_only = {"api_key_env", "headers", "timeouts", "stream"};
  const bool local = backend.type == "local";
  for (const std::string& key : local ? api_only : engine_only) {
    if (Reader::has(node[key]))
      r.warn(node[key], "backend." + key,
             local ? "has no effect on the embedded engine (backend.type is local)"
                   : "has no effect on an API (backend.type is " + backend.type + "); it sets up the embedded engine");
  }
  if (!local && backend.model.ends_with(".gguf") && Reader::has(node["model"]))
    r.warn(node["model"], "backend.model",
           "names a GGUF file, but the backend is an API: it is sent as the model's name");
}

JobSpec validate(const YAML::Node& root, const Reader& r, const EnvLookup& env) {
  JobSpec job;
  job.file = r.file();
  if (root.IsNull() || !root.IsDefined())
    r.fail(root, "input", "required (the job file is empty)");
  if (!root.IsMap()) r.fail(root, "", "expected a map of job settings, got " + describe(root));
  r.check_map(root, "");

  job.name = Reader::has(root["name"]) ? r.string(root["name"], "name") : file_stem(r.file());
  if (job.name.empty()) r.fail(root["name"], "name", "must not be empty");
  bool has_synth = Reader::has(root["synth"]);
  job.kind = has_synth ? JobKind::Synth : JobKind::Eval;
  if (Reader::has(root["kind"]))
    job.kind = r.choice<JobKind>(root["kind"], "kind", {{"eval", JobKind::Eval}, {"synth", JobKind::Synth}});

  if (Reader::has(root["input"])) read_input(r, root["input"], job.input);
  if (has_synth) read_synth(r, root["synth"], job.synth);
  if (job.input.path.empty()) {
    if (job.kind == JobKind::Eval && root["input"].IsDefined()) {
      // "input:" with nothing after it: named at the key (an empty value's mark is where the
      // next thing starts, often the line after).
      for (auto it = root.begin(); it != root.end(); ++it)
        if (it->first.IsScalar() && it->first.Scalar() == "input")
          r.fail(it->first, "input", "is empty: give a JSONL file, or {path, format}");
    }
    if (job.kind == JobKind::Eval) {
      // A synth section with kind: eval (often a --set kind=eval on a synth job): say which
      // setting made this an eval job, since the file alone reads as a synth job.
      if (has_synth && Reader::has(root["kind"])) {
        const SourceMark k = r.mark(root["kind"], "kind");
        const std::string where = k.line > 0 ? "line " + std::to_string(k.line) : k.file;
        r.fail(root, "input",
               "required: kind is eval (" + where +
                   "), and an eval job reads its items from an input (a JSONL file, or {path, format}); "
                   "for a synth job, leave kind out or set it to synth");
      }
      r.fail(root, "input", "required (a JSONL file, or {path, format})");
    }
    if (job.synth.count == 0)
      r.fail(has_synth ? root["synth"] : root, "synth.count",
             "required for a synth job without an input (how many items to generate)");
  } else if (job.synth.count > 0) {
    r.fail(root["synth"]["count"], "synth.count",
           "not used by a job with an input (its lines are the items); use limit to run fewer");
  } else if (has_synth) {
    // Nor are variables drawn for them: the lines' own fields fill the templates.
    for (const char* key : {"variables", "seed"})
      if (Reader::has(root["synth"][key]))
        r.fail(root["synth"][key], std::string("synth.") + key,
               "not used by a job with an input (its lines are the items, and their fields fill the templates); "
               "remove it, or the input");
  }
  if (Reader::has(root["request"])) {
    read_request(r, root["request"], job.request);
    // Templates are checked against the items' fields when the input is read; these say where.
    const YAML::Node messages = root["request"]["messages"];
    for (std::size_t i = 0; i < job.request.messages.size(); ++i) {
      const std::string field = index_path("request.messages", i) + ".content";
      job.marks.emplace(field, r.mark(messages[i]["content"], field));
      for (const char* key : {"tool_calls", "role"}) {
        const std::string at = index_path("request.messages", i) + "." + key;
        job.marks.emplace(at, r.mark(messages[i][key], at));
      }
    }
    if (!job.request.model.empty())
      job.marks.emplace("request.model", r.mark(root["request"]["model"], "request.model"));
    r.mark_keys(root["request"]["extra"], "request.extra", job.marks);
  }
  if (job.kind == JobKind::Synth && job.input.path.empty() && job.request.messages.empty())
    r.fail(Reader::has(root["request"]) ? root["request"] : root, "request.messages",
           "required for a synth job (the prompt to fill with the variables)");
  if (Reader::has(root["few_shot"])) read_few_shot(r, root["few_shot"], job.few_shot);
  if (Reader::has(root["backend"])) {
    read_backend(r, root["backend"], job.backend);
    // The engine checks its options against the model once it has loaded it; these say where
    // each was written.
    r.mark_keys(root["backend"], "backend", job.marks);
    r.mark_keys(root["backend"]["speculative"], "backend.speculative", job.marks);
  }
  // No type: a job that names a base_url talks to that API; any other runs on the embedded
  // engine with the default model.
  if (job.backend.type.empty()) job.backend.type = job.backend.base_url.empty() ? "local" : "openai";
  check_backend_fields(r, root["backend"], job.backend);
  // The environment's defaults are checked as the file's values are (they reach JSON too).
  // empty_is_unset: $BATCHLM_MODEL set but empty is the default GGUF, as for generate, inspect and
  // serve. $BATCHLM_MODEL_NAME set but empty names no model, and an API is not sent the default
  // in its place (a model the user never chose, and maybe paid for).
  const auto from_env = [&](const char* name, std::string fallback, bool empty_is_unset) {
    std::optional<std::string> set = env(name);
    if (set && set->empty() && empty_is_unset) set.reset();
    if (set && set->empty())
      throw ConfigError(r.file(), 0, 0, "backend.model",
                        std::string("$") + name + " is set but empty; name a model in it, give backend.model or "
                        "--model, or unset it for the default (" + fallback + ")");
    std::string value = set.value_or(std::move(fallback));
    if (const std::string flaw = utf8_flaw(value); !flaw.empty())
      throw ConfigError(r.file(), 0, 0, "backend.model", std::string("$") + name + " " + flaw);
    return value;
  };
  if (job.backend.type == "local") {
    if (job.backend.model.empty()) job.backend.model = from_env("BATCHLM_MODEL", std::string(kDefaultLocalModel), true);
    // The engine runs one model, backend.model: a name per request would be shown by a dry run
    // and then go unused.
    if (!job.request.model.empty())
      r.fail(root["request"]["model"], "request.model",
             "the embedded engine runs backend.model (" + job.backend.model +
                 "), one model for every item; a model named per request is for an API (--base-url): leave "
                 "request.model out");
    // Extra body fields the embedded engine would ignore are refused, not silently dropped.
    if (job.request.extra.is_object()) {
      for (const auto& [key, value] : job.request.extra.items())
        if (const auto problem = engine_field_problem(key, value))
          r.fail(root["request"]["extra"][key], "request.extra." + key, *problem + " (the backend is the embedded engine)");
      if (const auto problem = top_logprobs_problem(job.request.extra))
        r.fail(root["request"]["extra"]["top_logprobs"], "request.extra.top_logprobs",
               *problem + " (the backend is the embedded engine)");
      if (const auto problem = tool_choice_problem(job.request.extra))
        r.fail(root["request"]["extra"][problem->first], "request.extra." + problem->first,
               problem->second + " (the backend is the embedded engine)");
      if (const auto problem = min_tokens_problem(job.request.extra, job.request.max_tokens))
        r.fail(root["request"]["extra"]["min_tokens"], "request.extra.min_tokens", *problem);
    }
  } else {
    if (job.backend.base_url.empty()) {
      constexpr const char* kOpenAI = "https://api.openai.com/v1";
      const std::optional<std::string> from_variable = env("OPENAI_BASE_URL");
      job.backend.base_url = with_lowercase_scheme(from_variable.value_or(kOpenAI));
      // Checked as backend.base_url is: the variable is where the requests would go.
      if (from_variable) {
        const std::string problem =
            from_variable->empty() ? std::string("is set but empty; set it to the API's URL, or unset it for ") + kOpenAI
            : !utf8_flaw(*from_variable).empty() ? utf8_flaw(*from_variable)
                                                 : url_problem(*from_variable);
        if (!problem.empty())
          throw ConfigError(r.file(), 0, 0, "backend.base_url",
                            "$OPENAI_BASE_URL " + (problem.starts_with("is ") ? problem : "is not usable: " + problem) +
                                " (or give backend.base_url or --base-url)");
      }
    }
    if (job.backend.model.empty()) job.backend.model = from_env("BATCHLM_MODEL_NAME", "gpt-4o-mini", false);
  }
  if (Reader::has(root["concurrency"]))
    job.concurrency = static_cast<int>(r.integer(root["concurrency"], "concurrency", 1, 100'000));
  if (Reader::has(root["rate_limit"])) {
    const YAML::Node rl = root["rate_limit"];
    r.check_map(rl, "rate_limit");
    if (Reader::has(rl["requests_per_minute"]))
      job.rate_limit.requests_per_minute = r.number(rl["requests_per_minute"], "rate_limit.requests_per_minute", 0, 1e12);
    if (Reader::has(rl["tokens_per_minute"]))
      job.rate_limit.tokens_per_minute = r.number(rl["tokens_per_minute"], "rate_limit.tokens_per_minute", 0, 1e15);
  }
  if (Reader::has(root["retry"])) read_retry(r, root["retry"], job.retry);
  if (Reader::has(root["output"])) read_output(r, root["output"], job.output);
  // A synth item's input is its drawn variables, known now: a name that is none of them would
  // leave every record's input empty.
  if (job.kind == JobKind::Synth && job.input.path.empty()) {
    std::string names;
    for (const auto& [name, choices] : job.synth.variables) names += (names.empty() ? "" : ", ") + name;
    for (std::size_t i = 0; i < job.output.input_fields.size(); ++i)
      if (!job.synth.variables.count(job.output.input_fields[i]))
        r.fail(root["output"]["input_fields"][i], index_path("output.input_fields", i),
               "'" + job.output.input_fields[i] + "' is not a synth variable (variables: " +
                   (names.empty() ? "none" : names) + ")");
  }
  if (job.output.path.empty()) job.output.path = "out/" + job.name + ".jsonl";
  // Where the synth variables were given (a flag that replaced them is named in errors about them).
  if (Reader::has(root["synth"]) && root["synth"].IsMap() && root["synth"]["variables"].IsDefined())
    job.marks.emplace("synth.variables", r.mark(root["synth"]["variables"], "synth.variables"));
  if (Reader::has(root["output"]) && root["output"].IsMap() && Reader::has(root["output"]["input_fields"]))
    job.marks.emplace("output.input_fields", r.mark(root["output"]["input_fields"], "output.input_fields"));
  // The output is checked once the job has loaded (whether it can be written there); this says
  // where its path was given.
  if (Reader::has(root["output"]))
    job.marks.emplace("output.path", r.mark(root["output"].IsMap() ? root["output"]["path"] : root["output"],
                                            "output.path"));
  {
    std::error_code ec;
    if (job.output.path.ends_with('/') || fs::is_directory(job.output.path, ec))
      r.fail(Reader::has(root["output"]) ? root["output"] : root, "output.path",
             "'" + job.output.path + "' names a directory; give a file, e.g. " +
                 (fs::path(job.output.path) / (job.name + ".jsonl")).lexically_normal().string());
  }
  // The output must not be one of the job's own files: --fresh would empty it, and a resume
  // would refuse it only if it holds no records.
  const auto same_file = [](const std::string& a, const std::string& b) {
    std::error_code ec;
    return !b.empty() && fs::equivalent(a, b, ec) && !ec;
  };
  const std::pair<std::string, const char*> own_files[] = {
      {job.input.path, "input file"},
      {job.few_shot.path, "few-shot file"},
      {job.file, "job file"},
      {job.backend.type == "local" ? job.backend.model : std::string(), "model"}};
  for (const auto& [path, what] : own_files)
    if (same_file(job.output.path, path))
      r.fail(Reader::has(root["output"]) ? root["output"] : root, "output.path",
             "'" + job.output.path + "' is the job's " + what + " ('" + path +
                 "'); writing the results there would destroy it");
  if (Reader::has(root["scoring"])) {
    read_scoring(r, root["scoring"], job.scoring);
    // Regex scoring reads the output alone; the others compare it with each item's reference.
    if (job.scoring.reads_references() && job.input.path.empty())
      r.fail(root["scoring"], "scoring",
             "needs reference answers from an input file; a synth job without input has none (regex scoring "
             "needs none)");
    if (!job.scoring.pattern.empty() && job.scoring.kind != ScoringKind::Regex)
      r.fail(root["scoring"]["pattern"], "scoring.pattern", "only used by regex scoring (scoring.type: regex)");
  }
  if (Reader::has(root["limit"])) job.limit = r.integer(root["limit"], "limit", 0);
  if (Reader::has(root["grace_period"]))
    job.grace_period = r.duration(root["grace_period"], "grace_period");
  job.warnings = r.take_warnings();
  return job;
}

}  // namespace

std::optional<std::string> overriding_flag(const std::vector<Override>& overrides, const std::string& field) {
  // A leading index path like request.messages[0] matches the override request.messages.0.
  std::string dotted = field;
  std::replace(dotted.begin(), dotted.end(), '[', '.');
  dotted.erase(std::remove(dotted.begin(), dotted.end(), ']'), dotted.end());
  // The last override of a field is the one that set it.
  for (auto it = overrides.rbegin(); it != overrides.rend(); ++it) {
    const std::string& o = it->path;
    if (field == o || field.starts_with(o + ".") || field.starts_with(o + "[") || dotted == o ||
        dotted.starts_with(o + "."))
      return it->flag.empty() ? std::string("--set") : it->flag;
  }
  return std::nullopt;
}

nlohmann::json result_settings(const JobSpec& job) {
  using nlohmann::json;
  const bool local = job.backend.type == "local";
  json messages = json::array();
  for (const ChatMessage& m : job.request.messages) {
    json message = {{"role", m.role}, {"content", m.content}};
    // Only where given, so that the settings of a job without them read as they always have.
    if (m.calls_tools()) message["tool_calls"] = m.tool_calls;
    if (!m.tool_call_id.empty()) message["tool_call_id"] = m.tool_call_id;
    if (!m.name.empty()) message["name"] = m.name;
    if (m.reasoning) message["reasoning_content"] = *m.reasoning;
    messages.push_back(std::move(message));
  }
  // The extra fields with their keys sorted, as they always were: the order they are written in
  // changes nothing that is sent.
  json request = {{"messages", messages}, {"model", job.request.model}, {"stop", job.request.stop},
                  {"extra", json(job.request.extra)}};
  request["max_tokens"] = job.request.max_tokens ? json(*job.request.max_tokens) : json();
  request["temperature"] = job.request.temperature ? json(*job.request.temperature) : json();
  request["top_p"] = job.request.top_p ? json(*job.request.top_p) : json();
  request["seed"] = job.request.seed ? json(*job.request.seed) : json();
  json few_shot = json();
  if (!job.few_shot.path.empty() && job.few_shot.count > 0)
    few_shot = {{"file", fs::path(job.few_shot.path).filename().string()},
                {"count", job.few_shot.count},
                {"seed", job.few_shot.seed},
                {"user", job.few_shot.user},
                {"assistant", job.few_shot.assistant}};
  const auto kind = std::find_if(kScoringKinds.begin(), kScoringKinds.end(),
                                 [&](const auto& named) { return named.second == job.scoring.kind; });
  json scoring_json = {{"type", kind->first}};
  if (job.scoring.kind != ScoringKind::None) scoring_json["reference_field"] = job.scoring.reference_field;
  if (job.scoring.kind == ScoringKind::Regex) scoring_json["pattern"] = job.scoring.pattern;
  json settings = {{"backend", local ? "local" : "api"},
                   {"model", model_label(job, "")},
                   {"request", request},
                   {"few_shot", few_shot},
                   {"scoring", scoring_json}};
  // The engine's reasoning kept in the output's text: other records. Only then, so that the
  // settings of other jobs read as they always have.
  if (local && job.backend.reasoning == "inline") settings["reasoning"] = "inline";
  // A local model reached through a symbolic link (a "current.gguf", a download cache's
  // snapshot pointing at a blob) is also named by the file the link leads to, so that a link
  // pointed at another model since is another model. Only then: settings made before, without
  // links, stay the same.
  if (local) {
    std::error_code ec;
    const fs::path file = fs::canonical(job.backend.model, ec);
    if (!ec && file.filename() != fs::path(job.backend.model).filename())
      settings["model_file"] = terminal_safe(file.filename().string());  // JSON needs UTF-8
  }
  return settings;
}

std::string settings_hash(const nlohmann::json& settings) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : settings.dump()) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

std::string model_label(const JobSpec& job, const std::string& request_model) {
  // The embedded engine runs its one model whatever a request names (a Batch line's "gpt-4o").
  if (job.backend.type == "local") return fs::path(job.backend.model).filename().string();
  return request_model.empty() ? job.backend.model : request_model;
}

constexpr std::size_t kMaxJobFileBytes = std::size_t{16} << 20;

namespace {

// Parser events of one document at a time: whether it holds anything but a null, and where.
struct DocumentScan : YAML::EventHandler {
  int documents = 0;
  bool content = false;
  YAML::Mark first = YAML::Mark::null_mark();
  int start = -1;  // where the last document started (Mark::pos)
  void seen(const YAML::Mark& mark) {
    if (!content) first = mark;
    content = true;
  }
  void OnDocumentStart(const YAML::Mark& mark) override {
    start = mark.pos;
    ++documents;
    content = false;
    first = YAML::Mark::null_mark();
  }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark& mark, YAML::anchor_t) override { seen(mark); }
  void OnScalar(const YAML::Mark& mark, const std::string&, YAML::anchor_t, const std::string&) override { seen(mark); }
  void OnSequenceStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
    seen(mark);
  }
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
    seen(mark);
  }
  void OnMapEnd() override {}
};

std::optional<YAML::Mark> second_document(std::string_view yaml, const std::string& label) {
  // The documents are counted by their events: YAML::LoadAll builds every one, and some text
  // (a lone ',') makes yaml-cpp find documents without end, each where the last began, until
  // memory runs out.
  std::istringstream stream{std::string(yaml)};
  YAML::Parser parser(stream);
  DocumentScan scan;
  int previous_start = -1;
  for (int document = 0; parser.HandleNextDocument(scan); ++document) {
    if (scan.start == previous_start || document > 100'000) {
      const auto at = std::min(static_cast<std::size_t>(std::max(scan.start, 0)), yaml.size());
      const int line = 1 + static_cast<int>(std::count(yaml.begin(), yaml.begin() + static_cast<std::ptrdiff_t>(at), '\n'));
      throw ConfigError(label, line, 0, "",
                        "the YAML parser reads document after document here (a stray ',' outside brackets?); "
                        "a job file holds one job");
    }
    previous_start = scan.start;
    if (document == 0 || !scan.content) continue;  // '---' or '...' with nothing after it
    return scan.first;
  }
  return std::nullopt;
}

// A quoted string that a missing closing quote let run on parses as valid YAML, with the
// settings it took in gone. Refused where the scan finds one and the tree confirms it: a
// quoted scalar (tag "!") opens at that line and column.
void check_runaway_quote(const YAML::Node& root, std::string_view yaml, const std::string& file) {
  const auto runaway = find_runaway_quote(yaml, /*at_key_too=*/false);
  if (!runaway) return;
  const auto quoted_there = [&](const auto& self, const YAML::Node& node) -> bool {
    if (node.IsScalar())
      return node.Tag() == "!" && !node.Mark().is_null() && node.Mark().line + 1 == runaway->line &&
             node.Mark().column + 1 == runaway->column;
    if (node.IsSequence()) {
      for (const YAML::Node& child : node)
        if (self(self, child)) return true;
    } else if (node.IsMap()) {
      for (auto it = node.begin(); it != node.end(); ++it)
        if (self(self, it->first) || self(self, it->second)) return true;
    }
    return false;
  };
  if (quoted_there(quoted_there, root)) throw ConfigError(file, runaway->line, runaway->column, "", describe(*runaway));
}

}  // namespace

JobSpec load_job_text(std::string_view yaml, const std::string& file_label,
                      const std::vector<Override>& overrides, const EnvLookup& env) {
  // yaml-cpp takes any bytes; JSON output and HTTP bodies take only UTF-8. Refused here, where
  // the line and column can still be named, rather than after the items have been sent.
  // A NUL byte too: YAML allows none, and yaml-cpp reads it as the end of its input, then
  // reports whatever follows in words about something else.
  const std::size_t nul = yaml.find('\0');
  if (const std::size_t bad = std::min(first_invalid_utf8(yaml), nul); bad != std::string::npos) {
    const std::size_t line_start = yaml.rfind('\n', bad == 0 ? 0 : bad - 1);
    const std::size_t first = line_start == std::string_view::npos || bad == 0 ? 0 : line_start + 1;
    const auto line = static_cast<int>(std::count(yaml.begin(), yaml.begin() + static_cast<std::ptrdiff_t>(first), '\n')) + 1;
    throw ConfigError(file_label, line, static_cast<int>(bad - first) + 1, "",
                      bad == nul ? std::string("a NUL byte, which YAML text never holds (is this a job file?)")
                                 : "not valid UTF-8 (byte " + hex_byte(yaml[bad]) + "); save the job file as UTF-8");
  }
  YAML::Node root;
  try {
    // The documents are counted by their events: YAML::LoadAll builds every one, and some text
    // (a lone ',') makes yaml-cpp find documents without end, each where the last began, until
    // memory runs out.
    if (const std::optional<YAML::Mark> second = second_document(yaml, file_label))
      throw error_at(file_label, *second, "", "a second YAML document (after '---'); a job file holds one job");
    root = YAML::Load(std::string(yaml));
  } catch (const YAML::DeepRecursion& e) {
    // The parser's own bound (some thousand levels) comes with the words "bad file"; past it the
    // tree is refused as check_tree_size refuses one past kMaxYamlDepth.
    throw error_at(file_label, e.mark, "", "nested more than " + std::to_string(kMaxYamlDepth) + " levels deep");
  } catch (const YAML::ParserException& e) {
    int line = e.mark.is_null() ? 0 : e.mark.line + 1;
    int column = e.mark.is_null() ? 0 : e.mark.column + 1;
    std::string message = "invalid YAML: " + e.msg;
    // A tab in the indentation is the usual cause, and the parser's words do not say so.
    bool tab = false;
    if (line > 0) {
      std::size_t start = 0;
      for (int l = 1; l < line && start != std::string_view::npos; ++l) {
        start = yaml.find('\n', start);
        if (start != std::string_view::npos) ++start;
      }
      if (start != std::string_view::npos) {
        const std::string_view text = yaml.substr(start, yaml.find('\n', start) - start);
        const std::size_t indent_end = text.find_first_not_of(" \t");
        tab = text.substr(0, indent_end).find('\t') != std::string_view::npos;
        if (tab) message += " (this line is indented with a tab; YAML indents with spaces)";
        // `{path: ${DIR:-data}/x.jsonl}`: the variable's braces end the flow map.
        if (!tab && text.find("${") != std::string_view::npos && e.msg.find("flow") != std::string::npos)
          message += " (a ${...} inside {...} or [...] must be quoted: \"${...}\")";
      }
    }
    // Else the parser may fail lines after a quote left open: the quote is what to fix.
    if (const auto runaway = find_runaway_quote(yaml, /*at_key_too=*/true); !tab && runaway && (line == 0 || runaway->line <= line))
      throw ConfigError(file_label, runaway->line, runaway->column, "",
                        describe(*runaway) + " (the YAML parser then stopped" +
                            (line > 0 ? " at line " + std::to_string(line) + ", column " + std::to_string(column) : "") +
                            ": " + e.msg + ")");
    throw ConfigError(file_label, line, column, "", message);
  } catch (const YAML::Exception& e) {
    throw ConfigError(file_label, 0, 0, "", "invalid YAML: " + e.msg);
  }
  check_tree_size(root, file_label, "");
  check_runaway_quote(root, yaml, file_label);
  check_duplicate_keys(root, "", file_label);
  expand_tree(root, "", file_label, env);
  // Overrides go into a map: a file that holds a list or a single value is refused as it is,
  // not replaced by one made of the flags.
  if (root.IsDefined() && !root.IsNull() && !root.IsMap())
    throw error_at(file_label, root.Mark(), "", "expected a map of job settings, got " + describe(root));
  std::map<std::string, std::string> made;
  for (const Override& o : overrides) {
    apply_override(root, o, env, made);
  }
  Reader reader(file_label, overrides, std::move(made));
  return validate(root, reader, env);
}

JobSpec load_job_file(const std::string& path, const std::vector<Override>& overrides,
                      const EnvLookup& env) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw ConfigError(path, 0, 0, "", "is a directory, not a job file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path, 0, 0, "", std::string("cannot read job file: ") + std::strerror(errno));
  // Read at most one byte past the cap: /dev/zero or a runaway pipe must not fill the memory.
  std::string text(kMaxJobFileBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) throw ConfigError(path, 0, 0, "", std::string("cannot read job file: ") + std::strerror(errno));
  text.resize(static_cast<std::size_t>(in.gcount()));
  if (text.size() > kMaxJobFileBytes)
    throw ConfigError(path, 0, 0, "",
                      "larger than " + std::to_string(kMaxJobFileBytes >> 20) +
                          " MiB; a job file names its data (input.path) rather than holding it");
  return load_job_text(text, path, overrides, env);
}

}  // namespace batchlm::runner
