// Sources: a JSONL file, an OpenAI Batch-API file, or N synthesized items. Each reads its
// input once up front to validate it and count items, then streams it again line by line, so
// memory holds one line at a time whatever the input size. The validation pass builds every
// item exactly as next() will, so next() cannot fail on content that passed.

#include "batchlm/runner/source.hpp"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <fstream>
#include <set>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "batchlm/core/engine_fields.hpp"
#include "batchlm/core/json_check.hpp"
#include "batchlm/runner/scoring.hpp"

namespace batchlm::runner {

namespace {

using nlohmann::json;
// Input lines are read with their keys in order: a Batch-API body's fields (its tools) are
// passed on as written.
using ordered = nlohmann::ordered_json;

// A template named a field the item lacks, or one whose value is null (which would be sent
// as the text "null").
class MissingField : public std::out_of_range {
 public:
  MissingField(std::string field, bool null)
      : std::out_of_range(null ? "field '" + field + "' is null" : "no field '" + field + "'"),
        field_(std::move(field)),
        null_(null) {}
  const std::string& field() const { return field_; }
  bool null() const { return null_; }

 private:
  std::string field_;
  bool null_;
};

const json* lookup(const json& fields, std::string_view path) {
  const json* node = &fields;
  while (true) {
    std::size_t dot = path.find('.');
    std::string key(path.substr(0, dot));
    if (node->is_object()) {
      auto it = node->find(key);
      if (it == node->end()) return nullptr;
      node = &*it;
    } else if (node->is_array()) {
      // An index: digits only. One too large for size_t is past the end like any other.
      std::size_t index = 0;
      const auto [end, error] = std::from_chars(key.data(), key.data() + key.size(), index);
      if (key.empty() || error != std::errc() || end != key.data() + key.size() || index >= node->size())
        return nullptr;
      node = &(*node)[index];
    } else {
      return nullptr;
    }
    if (dot == std::string_view::npos) return node;
    path.remove_prefix(dot + 1);
  }
}

// splitmix64: a tiny PRNG whose output is fixed by its definition, so a seed draws the same
// items on every platform and standard library (std::uniform_int_distribution does not).
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n): rejection keeps the draw unbiased for every n.
  std::uint64_t below(std::uint64_t n) {
    std::uint64_t threshold = (0 - n) % n;
    while (true) {
      std::uint64_t r = next();
      if (r >= threshold) return r % n;
    }
  }

 private:
  std::uint64_t state_;
};

std::uint64_t mix(std::uint64_t value) { return Rng(value).next(); }

bool is_blank(const std::string& line) {
  return line.find_first_not_of(" \t\r\n") == std::string::npos;
}

// A line longer than this is refused rather than read into memory whole: a file that is not
// JSONL (a binary, or a JSON array on one line of gigabytes) has no line end to stop at. 16 MiB
// is millions of tokens, beyond any model's context.
constexpr std::size_t kMaxLineBytes = std::size_t{16} << 20;

// Reads lines, counting every line (blank ones too) so errors name the line an editor shows.
class LineReader {
 public:
  explicit LineReader(const std::string& path) : path_(path), in_(path, std::ios::binary) {
    if (!in_) throw ConfigError(path, 0, 0, "", "cannot open input file");
  }
  // The next non-blank line, or false at the end.
  bool next(std::string& line) {
    while (read_line(line)) {
      ++line_number_;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      // A byte-order mark (a Windows editor's) opens the file, not its first item.
      if (line_number_ == 1 && line.starts_with("\xEF\xBB\xBF")) line.erase(0, 3);
      if (!is_blank(line)) return true;
    }
    if (in_.bad()) throw ConfigError(path_, line_number_, 0, "", "read error");
    return false;
  }
  std::int64_t line_number() const { return line_number_; }

 private:
  // std::getline with a bound: the line is read in chunks, and refused past kMaxLineBytes.
  bool read_line(std::string& line) {
    line.clear();
    while (true) {
      in_.getline(chunk_.data(), static_cast<std::streamsize>(chunk_.size()));
      const auto got = static_cast<std::size_t>(in_.gcount());
      if (in_.bad()) throw ConfigError(path_, line_number_ + 1, 0, "", "read error");
      const bool filled = in_.fail() && !in_.eof();  // the chunk filled up before a '\n'
      // gcount counts the '\n' when there was one: a line that the file's end cuts off has none.
      line.append(chunk_.data(), !in_.fail() && !in_.eof() ? got - 1 : got);
      if (line.size() > kMaxLineBytes) {
        throw ConfigError(path_, line_number_ + 1, 0, "",
                          "line longer than " + std::to_string(kMaxLineBytes >> 20) + " MiB (is this a JSONL file?)");
      }
      if (!filled) return !in_.fail() || !line.empty();
      in_.clear();
    }
  }

  std::string path_;
  std::ifstream in_;
  std::int64_t line_number_ = 0;
  std::vector<char> chunk_ = std::vector<char>(std::size_t{1} << 16);
};

// Arrays and objects nested deeper than this are refused: far beyond any dataset, and nlohmann's
// copy and dump recurse once per level, so that a line of 200 KB of '[' and ']' (100,000
// levels) overflowed the stack where an item's input is copied or written.
constexpr std::size_t kMaxLineDepth = 256;

ordered parse_object(const std::string& line, const std::string& file, std::int64_t line_number) {
  if (const std::size_t bad = first_invalid_utf8(line); bad != std::string::npos) {
    char byte[8];
    std::snprintf(byte, sizeof byte, "0x%02X", static_cast<unsigned>(static_cast<unsigned char>(line[bad])));
    throw ConfigError(file, static_cast<int>(line_number), 0, "",
                      std::string("not valid UTF-8 (byte ") + byte + " at byte " + std::to_string(bad) +
                          "); JSON Lines are UTF-8");
  }
  // Checked first, so that every way a line can be wrong names the line, and the value built
  // below is never deeper than kMaxLineDepth.
  if (const std::optional<JsonProblem> problem = check_json(line, kMaxLineDepth)) {
    std::string message;
    switch (problem->kind) {
      case JsonProblem::Kind::kSyntax: message = "not valid JSON (" + problem->where() + ")"; break;
      case JsonProblem::Kind::kNumberOutOfRange:
        message = "number out of range, " +
                  (problem->token.size() > 40 ? problem->token.substr(0, 40) + "..." : problem->token) +
                  " (at byte " + std::to_string(problem->byte) + ")";
        break;
      case JsonProblem::Kind::kTooDeep:
        message = "arrays and objects nested more than " + std::to_string(kMaxLineDepth) + " deep";
        break;
    }
    throw ConfigError(file, static_cast<int>(line_number), 0, "", message);
  }
  // A key given twice in one object: a reader keeps one of the values (nlohmann the last, others
  // the first), so which was meant is unknown. Refused, as in job files.
  std::optional<std::string> duplicate;
  std::optional<WideInteger> wide;
  ordered value = parse_ordered_json(line, &duplicate, &wide);
  if (duplicate) throw ConfigError(file, static_cast<int>(line_number), 0, *duplicate, "duplicate key");
  // Held as the nearest double, such a number would reach prompts, references and the output as
  // other digits than the input's (an exact-match score then fails on a right answer).
  if (wide)
    throw ConfigError(file, static_cast<int>(line_number), 0, wide->path,
                      "the integer " + (wide->digits.size() > 40 ? wide->digits.substr(0, 40) + "..." : wide->digits) +
                          " does not fit in 64 bits, and would not keep its digits; write it as a string");
  if (!value.is_object())
    throw ConfigError(file, static_cast<int>(line_number), 0, "",
                      std::string("expected a JSON object, got ") + value.type_name());
  return value;
}

std::string render_or_throw(std::string_view tmpl, const json& fields, const std::string& file,
                            std::int64_t line, const std::string& used_by) {
  try {
    return render_template(tmpl, fields);
  } catch (const MissingField& e) {
    throw ConfigError(file, static_cast<int>(line), 0, e.field(),
                      e.null() ? "null (used by " + used_by + "; give it a value, or leave the item out)"
                               : "missing field (used by " + used_by + ")");
  }
}

// A part of a message's content that is not text (an image, audio, a file) costs tokens its
// JSON's length says nothing of (a data URL's base64 would count thousands): counted as a
// 1024x1024 image in high detail costs on OpenAI's API.
constexpr std::int64_t kTokensPerMediaPart = 765;

std::int64_t estimate_tokens(const std::vector<ChatMessage>& messages) {
  // About four bytes per token for English text, plus the few tokens each message's framing
  // costs; only rate limits and dry runs rely on it.
  std::int64_t bytes = 0, media = 0;
  for (const auto& m : messages) {
    bytes += static_cast<std::int64_t>(m.text_bytes());
    if (m.parts.is_array())
      for (const auto& part : m.parts)
        if (part.value("type", "") != "text") ++media;
  }
  return bytes / 4 + 4 * static_cast<std::int64_t>(messages.size()) + media * kTokensPerMediaPart;
}

// A chat message list from JSON (a Batch body, or an input line's own "messages"). `api`: the
// job's backend is an API, which gets content parts and message keys this reader does not know
// as given; the embedded engine reads the text alone and refuses what is not text.
std::vector<ChatMessage> parse_messages(const ordered& value, const std::string& file,
                                        std::int64_t line, const std::string& field, bool api) {
  int line_int = static_cast<int>(line);
  if (!value.is_array() || value.empty())
    throw ConfigError(file, line_int, 0, field, "expected a non-empty list of {role, content}");
  std::vector<ChatMessage> out;
  for (std::size_t i = 0; i < value.size(); ++i) {
    const ordered& m = value[i];
    std::string here = field + "[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw ConfigError(file, line_int, 0, here, "expected {role, content} with a string role");
    ChatMessage message{m["role"].get<std::string>(), ""};
    static const std::set<std::string> kRoles = {"system", "developer", "user", "assistant", "tool"};
    if (!kRoles.count(message.role))
      throw ConfigError(file, line_int, 0, here + ".role",
                        "bad value '" + message.role + "' (expected one of: system, developer, user, assistant, tool)");
    const ordered content = m.value("content", ordered());
    if (content.is_string()) {
      message.content = content.get<std::string>();
    } else if (content.is_array()) {
      // Content parts. Their text is joined with a line break between parts, as vLLM and
      // llama.cpp's server join them. An API gets the parts as given where any is more than
      // plain text; the embedded engine reads text only, so anything else is refused rather
      // than dropped (a text part's other keys, such as cache_control, are hints it can leave).
      if (content.empty()) throw ConfigError(file, line_int, 0, here + ".content", "an empty list of parts");
      bool plain = true, first_text = true;
      for (std::size_t k = 0; k < content.size(); ++k) {
        const ordered& part = content[k];
        const std::string at = here + ".content[" + std::to_string(k) + "]";
        if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
          throw ConfigError(file, line_int, 0, at, "expected a content part: {type: text, text: ...}" +
                                                        std::string(api ? " or another type the API takes" : ""));
        const std::string& type = part["type"].get_ref<const std::string&>();
        if (type != "text") {
          if (!api)
            throw ConfigError(file, line_int, 0, at + ".type",
                              "'" + type + "' parts need an API backend (backend.base_url): the embedded engine "
                              "reads text only");
          plain = false;
          continue;
        }
        if (!part.contains("text") || !part["text"].is_string())
          throw ConfigError(file, line_int, 0, at + ".text", "expected a string");
        if (part.size() != 2) plain = false;
        if (!first_text) message.content += '\n';
        first_text = false;
        message.content += part["text"].get<std::string>();
      }
      if (api && !plain) message.parts = content;
    } else if (!content.is_null()) {
      throw ConfigError(file, line_int, 0, here + ".content", "expected a string or a list of content parts");
    }
    if (auto problem = read_tool_fields(json(m), message))
      throw ConfigError(file, line_int, 0, here + problem->first, problem->second);
    // As in a job file: only an assistant message that calls tools may leave its content out.
    if (content.is_null() && !message.calls_tools())
      throw ConfigError(file, line_int, 0, here + ".content", "required (a string or a list of content parts)");
    if (api) {
      static const std::set<std::string> kRead = {"role", "content", "tool_calls", "tool_call_id", "name",
                                                  "reasoning_content", "function_call"};
      for (const auto& [key, v] : m.items())
        if (!kRead.count(key)) message.fields[key] = v;
    }
    out.push_back(std::move(message));
  }
  if (auto problem = unanswered_tool_message(out))
    throw ConfigError(file, line_int, 0, field + "[" + std::to_string(problem->first) + "].tool_call_id", problem->second);
  return out;
}

// Few-shot turns, drawn once and shared by every item.
std::vector<ChatMessage> load_few_shot(const FewShotSpec& spec) {
  if (spec.path.empty() || spec.count <= 0) return {};
  std::int64_t available = 0;
  {
    LineReader reader(spec.path);
    for (std::string line; reader.next(line);) ++available;
  }
  auto count = static_cast<std::int64_t>(spec.count);
  if (count > available)
    throw ConfigError(spec.path, 0, 0, "few_shot.count",
                      "asks for " + std::to_string(count) + " examples but the file has " +
                          std::to_string(available));
  // Floyd's sampling draws `count` distinct examples in O(count) memory, then a shuffle fixes
  // their order, both from the seed alone.
  Rng rng(mix(spec.seed));
  std::vector<std::int64_t> chosen;
  std::unordered_set<std::int64_t> taken;
  for (std::int64_t j = available - count; j < available; ++j) {
    auto t = static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(j + 1)));
    std::int64_t pick = taken.count(t) ? j : t;
    taken.insert(pick);
    chosen.push_back(pick);
  }
  for (std::size_t i = chosen.size(); i > 1; --i)
    std::swap(chosen[i - 1], chosen[rng.below(i)]);

  std::unordered_map<std::int64_t, std::pair<json, std::int64_t>> examples;  // index -> (line, number)
  LineReader reader(spec.path);
  std::int64_t index = 0;
  // Every line is read as JSON, drawn or not: a broken file is refused whatever the seed draws.
  for (std::string line; reader.next(line); ++index) {
    json fields = parse_object(line, spec.path, reader.line_number());
    if (taken.count(index)) examples.emplace(index, std::make_pair(std::move(fields), reader.line_number()));
  }
  std::vector<ChatMessage> turns;
  for (std::int64_t pick : chosen) {
    const auto& [fields, line] = examples.at(pick);
    turns.push_back({"user", render_or_throw(spec.user, fields, spec.path, line, "few_shot.user")});
    turns.push_back({"assistant", render_or_throw(spec.assistant, fields, spec.path, line,
                                                  "few_shot.assistant")});
  }
  return turns;
}

void insert_few_shot(std::vector<ChatMessage>& messages, const std::vector<ChatMessage>& turns) {
  if (turns.empty()) return;
  auto at = messages.empty() ? messages.end() : messages.end() - 1;
  messages.insert(at, turns.begin(), turns.end());
}

// The job's template applied to one item's fields; `file`/`line` name the item in errors.
Request render_request(const JobSpec& job, const json& fields, const std::string& file,
                       std::int64_t line) {
  const RequestTemplate& t = job.request;
  Request request;
  for (std::size_t i = 0; i < t.messages.size(); ++i) {
    // The tool-calling fields go as written; only the content is a template.
    ChatMessage message = t.messages[i];
    message.content = render_or_throw(t.messages[i].content, fields, file, line,
                                      "request.messages[" + std::to_string(i) + "].content");
    request.messages.push_back(std::move(message));
  }
  request.model = render_or_throw(t.model, fields, file, line, "request.model");
  // A placeholder that fills in nothing would send the backend's model in place of the line's.
  if (!t.model.empty() && request.model.find_first_not_of(" \t\r\n") == std::string::npos)
    throw ConfigError(file, static_cast<int>(line), 0, "request.model",
                      "'" + t.model + "' gives this line an empty model; give each line one, or leave request.model "
                      "out for the backend's");
  request.max_tokens = t.max_tokens;
  request.temperature = t.temperature;
  request.top_p = t.top_p;
  request.stop = t.stop;
  request.seed = t.seed;
  request.stream = job.backend.stream;
  request.extra = t.extra.is_object() ? t.extra : ordered::object();
  return request;
}

Item finish(json id, json input, Request request, const std::vector<ChatMessage>& few_shot) {
  insert_few_shot(request.messages, few_shot);
  Item item;
  item.id_key = id.dump();
  item.id = std::move(id);
  item.input = std::move(input);
  item.estimated_prompt_tokens = estimate_tokens(request.messages);
  item.request = std::move(request);
  return item;
}

// One line of a plain JSONL input.
Item jsonl_item(const JobSpec& job, json fields, std::int64_t line,
                const std::vector<ChatMessage>& few_shot) {
  const std::string& file = job.input.path;
  Request request = render_request(job, fields, file, line);
  if (job.request.messages.empty()) {
    // No template: the line carries its own conversation, or a bare prompt.
    if (fields.contains("messages")) {
      request.messages = parse_messages(ordered(fields["messages"]), file, line, "messages", job.backend.type != "local");
    } else if (fields.contains("prompt")) {
      if (!fields["prompt"].is_string())
        throw ConfigError(file, static_cast<int>(line), 0, "prompt",
                          std::string("expected a string, got ") + fields["prompt"].type_name());
      request.messages.push_back({"user", fields["prompt"].get<std::string>()});
    } else {
      throw ConfigError(file, static_cast<int>(line), 0, "prompt",
                        "missing field (the job has no request.messages, so each line needs "
                        "'messages' or 'prompt')");
    }
  }
  return finish(json(line), std::move(fields), std::move(request), few_shot);
}

// "a number", "an object": what a JSON value is, for messages.
std::string a_kind_of(const json& value) {
  const std::string name = value.type_name();
  return (name.starts_with('a') || name.starts_with('o') ? "an " : "a ") + name;
}

// One line of an OpenAI Batch-API file: {"custom_id", "method", "url", "body"}.
Item batch_item(const JobSpec& job, ordered line_value, std::int64_t line,
                const std::vector<ChatMessage>& few_shot) {
  const std::string& file = job.input.path;
  int line_int = static_cast<int>(line);
  // The Batch API's custom_id is a string: a number would be a second kind of id beside it (5
  // and "5" two items), and an empty one names no item.
  const auto custom_id = line_value.find("custom_id");
  if (custom_id == line_value.end() || custom_id->is_null())
    throw ConfigError(file, line_int, 0, "custom_id", "missing (a string) in a Batch-API line");
  if (!custom_id->is_string())
    throw ConfigError(file, line_int, 0, "custom_id",
                      "must be a string, got " + a_kind_of(*custom_id) +
                          (custom_id->is_number() ? " (write it in quotes: \"" + custom_id->dump() + "\")" : std::string()));
  if (custom_id->get_ref<const std::string&>().empty())
    throw ConfigError(file, line_int, 0, "custom_id", "must not be empty (it names the item in the output)");
  const auto body_value = line_value.find("body");
  if (body_value == line_value.end() || body_value->is_null())
    throw ConfigError(file, line_int, 0, "body", "missing (an object) in a Batch-API line");
  if (!body_value->is_object())
    throw ConfigError(file, line_int, 0, "body", "must be an object (the request's body), got " + a_kind_of(*body_value));
  const ordered& body = line_value["body"];
  // The method and URL are optional; where given they must be what is sent.
  if (const auto m = line_value.find("method"); m != line_value.end() && *m != "POST")
    throw ConfigError(file, line_int, 0, "method", "expected \"POST\", got " + m->dump());
  if (const auto u = line_value.find("url"); u != line_value.end() && *u != "/v1/chat/completions")
    throw ConfigError(file, line_int, 0, "url",
                      "expected \"/v1/chat/completions\" (only chat completions are supported), got " + u->dump());
  if (const auto n = body.find("n"); n != body.end() && !(n->is_number_integer() && *n == 1))
    throw ConfigError(file, line_int, 0, "body.n", kOneAnswerPerItem);

  // The template fills what the body leaves out; its messages are not used, the body's are.
  Request request;
  request.model = job.request.model;
  request.max_tokens = job.request.max_tokens;
  request.temperature = job.request.temperature;
  request.top_p = job.request.top_p;
  request.stop = job.request.stop;
  request.seed = job.request.seed;
  request.stream = job.backend.stream;
  request.extra = job.request.extra.is_object() ? job.request.extra : ordered::object();

  auto wrong = [&](const std::string& key, const char* expected) {
    return ConfigError(file, line_int, 0, "body." + key, std::string("expected ") + expected);
  };
  if (!body.contains("messages"))
    throw ConfigError(file, line_int, 0, "body.messages", "missing (only chat completions are supported)");
  for (const auto& [key, value] : body.items()) {
    if (key == "messages") {
      request.messages = parse_messages(value, file, line, "body.messages", job.backend.type != "local");
    } else if (key == "model") {
      if (!value.is_string()) throw wrong(key, "a string");
      // Empty would fall back to the job's model, one this line never named.
      if (value.get_ref<const std::string&>().empty())
        throw ConfigError(file, line_int, 0, "body.model", "empty; name a model, or leave the key out for the job's");
      request.model = value.get<std::string>();
    } else if (key == "max_tokens" || key == "max_completion_tokens") {
      if (!is_token_limit(value)) throw wrong(key, "an integer from 1 to 2147483647");
      if (body.contains("max_tokens") && body.contains("max_completion_tokens"))
        throw ConfigError(file, line_int, 0, "body.max_completion_tokens",
                          "given with max_tokens: the two are one limit; keep one of them");
      request.max_tokens = value.get<int>();
      // An API gets the key as written: reasoning models refuse max_tokens, and the job's own
      // max_tokens must not go out beside it.
      if (key == "max_completion_tokens" && job.backend.type != "local") {
        request.max_tokens.reset();
        request.extra[key] = value;
      }
    } else if (key == "temperature" || key == "top_p") {
      if (!value.is_number()) throw wrong(key, "a number");
      (key == "temperature" ? request.temperature : request.top_p) = value.get<double>();
    } else if (key == "stop") {
      request.stop.clear();
      if (value.is_string()) {
        request.stop.push_back(value.get<std::string>());
      } else if (value.is_array()) {
        for (const ordered& s : value) {
          if (!s.is_string()) throw wrong(key, "a string or a list of strings");
          request.stop.push_back(s.get<std::string>());
        }
      } else if (!value.is_null()) {
        throw wrong(key, "a string or a list of strings");
      }
      for (const std::string& s : request.stop)
        if (s.empty()) throw ConfigError(file, line_int, 0, "body.stop", kEmptyStopString);
    } else if (key == "seed") {
      if (!value.is_number_integer()) throw wrong(key, "an integer");
      request.seed = value.get<std::int64_t>();
    } else if (key == "stream" || key == "stream_options") {
      // The backend spec decides streaming for the whole job.
    } else {
      // Fields the embedded engine would ignore are refused, not silently dropped.
      if (job.backend.type == "local")
        if (const auto problem = engine_field_problem(key, value))
          throw ConfigError(file, line_int, 0, "body." + key, *problem + " (the backend is the embedded engine)");
      request.extra[key] = value;
    }
  }
  if (job.backend.type == "local") {
    if (const auto problem = top_logprobs_problem(request.extra))
      throw ConfigError(file, line_int, 0, "body.top_logprobs", *problem + " (the backend is the embedded engine)");
    if (const auto problem = tool_choice_problem(request.extra))
      throw ConfigError(file, line_int, 0, "body." + problem->first, problem->second + " (the backend is the embedded engine)");
    if (const auto problem = min_tokens_problem(request.extra, request.max_tokens))
      throw ConfigError(file, line_int, 0, "body.min_tokens", *problem);
  }
  json id = line_value["custom_id"];
  return finish(std::move(id), std::move(line_value), std::move(request), few_shot);
}

bool looks_like_batch(const ordered& first_line) {
  return first_line.contains("custom_id") && first_line.contains("body");
}

class FileSource : public Source {
 public:
  explicit FileSource(const JobSpec& job) : job_(job), few_shot_(load_few_shot(job.few_shot)) {
    std::int64_t limit = job.limit.value_or(std::numeric_limits<std::int64_t>::max());
    LineReader reader(job.input.path);
    std::unordered_map<std::string, std::int64_t> custom_ids;  // id -> line, for duplicates
    std::string line;
    batch_ = job.input.format == InputFormat::Batch;
    std::set<std::string> wanted(job.output.input_fields.begin(), job.output.input_fields.end());
    // A model given on the command line, which Batch-API bodies naming their own leave unused.
    const std::string job_model = job.request.model.empty() ? job.backend.model : job.request.model;
    std::int64_t bodies_with_a_model = 0;
    std::pair<std::string, std::int64_t> first_body_model;
    while (total_ < limit && reader.next(line)) {
      ordered value = parse_object(line, job.input.path, reader.line_number());
      if (total_ == 0 && job.input.format == InputFormat::Auto) batch_ = looks_like_batch(value);
      for (auto it = wanted.begin(); it != wanted.end();) it = value.contains(*it) ? wanted.erase(it) : std::next(it);
      Item item = build(std::move(value), reader.line_number());
      if (batch_ && item.request.model != job_model && !item.request.model.empty()) {
        if (bodies_with_a_model++ == 0) first_body_model = {item.request.model, reader.line_number()};
      }
      id_hashes_.push_back(std::hash<std::string>{}(item.id_key));
      line_hashes_.push_back(std::hash<std::string>{}(line));
      if (batch_) {
        auto [it, fresh] = custom_ids.emplace(item.id_key, reader.line_number());
        if (!fresh)
          throw ConfigError(job.input.path, static_cast<int>(reader.line_number()), 0, "custom_id",
                            "duplicate custom_id " + item.id_key + " (first on line " +
                                std::to_string(it->second) + ")");
      }
      ++total_;
    }
    reader_.emplace(job.input.path);
    std::sort(id_hashes_.begin(), id_hashes_.end());
    if (bodies_with_a_model > 0 && job.backend.type != "local") {
      // The model sent is request.model's when the job sets one, else backend.model's.
      const std::string field = job.request.model.empty() ? "backend.model" : "request.model";
      if (const auto flag = job.marks.find(field); flag != job.marks.end() && flag->second.file != job.file)
        warnings_.push_back(flag->second.file + ": " + field + ": '" + job_model + "' is not sent for the " +
                            std::to_string(bodies_with_a_model) + " Batch-API line" +
                            (bodies_with_a_model == 1 ? "" : "s") + " whose body names its own model ('" +
                            first_body_model.first + "' on line " + std::to_string(first_body_model.second) +
                            "): a body's model wins; take the model out of the bodies to use this one");
    }
    const auto at = job.marks.find("output.input_fields");
    const SourceMark m = at != job.marks.end() ? at->second : SourceMark{job.file, 0, 0};
    for (const std::string& field : wanted)
      warnings_.push_back(ConfigError(m.file, m.line, m.column, "output.input_fields",
                                      "no item of " + job.input.path + " has the field '" + field +
                                          "'; records will not have it")
                              .what());
  }

  std::vector<std::string> warnings() const override { return warnings_; }

  std::optional<Item> next() override {
    if (yielded_ >= total_) return std::nullopt;
    std::string line;
    if (!reader_->next(line))
      throw ConfigError(job_.input.path, static_cast<int>(reader_->line_number()), 0, "",
                        "input changed while the job ran (fewer lines than validated)");
    // A line rewritten since it was checked would mix the old input's items with the new one's
    // in one output, unsaid.
    if (std::hash<std::string>{}(line) != line_hashes_[static_cast<std::size_t>(yielded_)])
      throw ConfigError(job_.input.path, static_cast<int>(reader_->line_number()), 0, "",
                        "input changed while the job ran (this line is not the one checked at the start)");
    ++yielded_;
    return build(parse_object(line, job_.input.path, reader_->line_number()),
                 reader_->line_number());
  }

  std::int64_t total() const override { return total_; }

  // By the ids' hashes (8 bytes an item, where the ids themselves can be long): a count shown
  // to the user, which a collision of two 64-bit hashes would be the only way to miscount.
  std::int64_t count_own(const std::unordered_set<std::string>& ids) const override {
    std::int64_t n = 0;
    for (const std::string& id : ids)
      n += std::binary_search(id_hashes_.begin(), id_hashes_.end(), std::hash<std::string>{}(id)) ? 1 : 0;
    return n;
  }

 private:
  Item build(ordered value, std::int64_t line) const {
    Item item = batch_ ? batch_item(job_, std::move(value), line, few_shot_)
                       : jsonl_item(job_, std::move(value), line, few_shot_);
    // A scored job needs each item's reference answer; without it every score would be
    // silently empty.
    if (job_.scoring.reads_references() && item.input.is_object() &&
        !item.input.contains(job_.scoring.reference_field))
      throw ConfigError(job_.input.path, static_cast<int>(line), 0, job_.scoring.reference_field,
                        "missing field (the reference answer scoring reads; set "
                        "scoring.reference_field to the field that holds it)");
    // GSM8K's gold is the reference's "#### N" line or a bare number; any other text would
    // leave every score of the item empty, unsaid.
    // A null or blank reference is an item without one, left unscored; a number is its own gold.
    const auto reference = item.input.is_object() ? item.input.find(job_.scoring.reference_field) : item.input.end();
    if (job_.scoring.kind == ScoringKind::Gsm8k && reference != item.input.end() && reference->is_string()) {
      const std::string& text = reference->get_ref<const std::string&>();
      if (text.find_first_not_of(" \t\r\n") != std::string::npos && !gsm8k_gold(text))
        throw ConfigError(job_.input.path, static_cast<int>(line), 0, job_.scoring.reference_field,
                          "no final answer to score against: gsm8k scoring reads a '#### N' line or a bare number, "
                          "got " + nlohmann::json(utf8_excerpt(text, 80)).dump() +
                          " (set scoring.reference_field to the field that holds it, or use exact or regex scoring)");
    }
    return item;
  }

  const JobSpec job_;
  std::vector<ChatMessage> few_shot_;
  std::vector<std::string> warnings_;
  bool batch_ = false;
  std::int64_t total_ = 0;
  std::int64_t yielded_ = 0;
  std::optional<LineReader> reader_;
  std::vector<std::size_t> id_hashes_;  // sorted
  std::vector<std::size_t> line_hashes_;  // each item's line as checked, in order
};

class SynthSource : public Source {
 public:
  explicit SynthSource(const JobSpec& job) : job_(job), few_shot_(load_few_shot(job.few_shot)) {
    total_ = std::min(job.synth.count, job.limit.value_or(job.synth.count));
    // Every item has the same fields, so one item checks the template for all of them.
    json probe = json::object();
    for (const auto& [name, choices] : job.synth.variables) probe[name] = choices.front();
    std::string names;
    for (const auto& [name, choices] : job.synth.variables) names += (names.empty() ? "" : ", ") + name;
    auto check = [&](const std::string& tmpl, const std::string& used_by) {
      try {
        (void)render_template(tmpl, probe);
      } catch (const MissingField& e) {
        const auto at = job.marks.find(used_by);
        const SourceMark m = at != job.marks.end() ? at->second : SourceMark{job.file, 0, 0};
        // Variables a flag replaced are the flag's doing, not the template's.
        const auto vars = job.marks.find("synth.variables");
        const std::string by = vars != job.marks.end() && vars->second.file.starts_with("-")
                                   ? "; synth.variables was set by " + vars->second.file
                                   : std::string();
        throw ConfigError(m.file, m.line, m.column, used_by,
                          "{{" + e.field() + "}} is not a synth variable (variables: " +
                              (names.empty() ? "none" : names) + ")" + by);
      }
    };
    for (std::size_t i = 0; i < job.request.messages.size(); ++i)
      check(job.request.messages[i].content, "request.messages[" + std::to_string(i) + "].content");
    check(job.request.model, "request.model");
  }

  std::optional<Item> next() override {
    if (index_ >= total_) return std::nullopt;
    ++index_;
    return item(index_);
  }

  std::int64_t total() const override { return total_; }

  // Items are numbered 1..total: an id is one of them when it reads back as such a number.
  std::int64_t count_own(const std::unordered_set<std::string>& ids) const override {
    std::int64_t n = 0;
    for (const std::string& id : ids) {
      std::int64_t index = 0;
      const auto [end, ec] = std::from_chars(id.data(), id.data() + id.size(), index);
      // Written as a JSON number writes it: "01" is no item's id.
      n += ec == std::errc() && end == id.data() + id.size() && index >= 1 && index <= total_ && std::to_string(index) == id
               ? 1
               : 0;
    }
    return n;
  }

 private:
  // Item `index` (1-based) depends only on (seed, index), so a resumed run regenerates exactly
  // the items it has not written yet.
  Item item(std::int64_t index) const {
    Rng rng(mix(job_.synth.seed) ^ mix(static_cast<std::uint64_t>(index) + 0x5eed));
    json fields = json::object();
    for (const auto& [name, choices] : job_.synth.variables)
      fields[name] = choices[rng.below(choices.size())];
    Request request = render_request(job_, fields, job_.file, 0);
    return finish(json(index), std::move(fields), std::move(request), few_shot_);
  }

  const JobSpec job_;
  std::vector<ChatMessage> few_shot_;
  std::int64_t total_ = 0;
  std::int64_t index_ = 0;
};

}  // namespace

std::string render_template(std::string_view tmpl, const nlohmann::json& fields) {
  std::string out;
  out.reserve(tmpl.size());
  std::size_t at = 0;
  while (true) {
    std::size_t open = tmpl.find("{{", at);
    std::size_t close = open == std::string_view::npos ? open : tmpl.find("}}", open + 2);
    if (close == std::string_view::npos) {
      out.append(tmpl.substr(at));
      return out;
    }
    out.append(tmpl.substr(at, open - at));
    std::string_view name = tmpl.substr(open + 2, close - open - 2);
    while (!name.empty() && name.front() == ' ') name.remove_prefix(1);
    while (!name.empty() && name.back() == ' ') name.remove_suffix(1);
    const json* value = lookup(fields, name);
    if (!value || value->is_null()) throw MissingField(std::string(name), value != nullptr);
    // Values are inserted once, never rescanned: a question containing "{{" stays as written.
    out += value->is_string() ? value->get_ref<const std::string&>() : value->dump();
    at = close + 2;
  }
}

std::unique_ptr<Source> open_source(const JobSpec& job) {
  if (!job.input.path.empty()) return std::make_unique<FileSource>(job);
  return std::make_unique<SynthSource>(job);
}

}  // namespace batchlm::runner
