#include "batchlm/local_engine/tokenizer.hpp"
#include "utf8.hpp"

#include "batchlm/core/engine_fields.hpp"
#include "batchlm/core/json_check.hpp"

// The chat template is a Jinja program in the GGUF (tokenizer.chat_template). Rather than run
// Jinja, this recognises the families the engine supports: Llama 3's, DeepSeek-R1's, Phi-3's,
// Mistral's, Llama 2's and Gemma's (tokenizer.hpp) and ChatML,
//
//   <|im_start|>{role}\n{content}<|im_end|>\n   per message, then <|im_start|>assistant\n
//
// and reads from the template text the one thing that varies between ChatML models: a default
// system message written out as a constant that the template emits when the conversation does
// not start with a system message. SmolLM2's template, for instance, has
//
//   {% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a
//   helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}
//
// Such a constant is found by scanning the string literals inside the template's {{ }} and
// {% %} blocks (adjacent literals joined by '+' count as one) for one that holds a whole system
// turn, "<|im_start|>system\n...<|im_end|>". A literal that only opens the system turn, as in
// '<|im_start|>system\n' + message['content'], is not a default.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace batchlm::local_engine {

namespace {

constexpr std::string_view kTurnStart = "<|im_start|>";
constexpr std::string_view kTurnEnd = "<|im_end|>";
constexpr std::string_view kSystemTurnStart = "<|im_start|>system\n";
constexpr std::string_view kHeaderStart = "<|start_header_id|>";
constexpr std::string_view kHeaderEnd = "<|end_header_id|>";
constexpr std::string_view kEndOfTurn = "<|eot_id|>";
constexpr std::string_view kKnowledgeDate = "Cutting Knowledge Date: December 2023\n";
constexpr std::string_view kIpythonEnvironment = "Environment: ipython\n";
constexpr std::string_view kIpythonTurn = "<|start_header_id|>ipython<|end_header_id|>\n\n";
constexpr std::string_view kPythonTag = "<|python_tag|>";
// DeepSeek-R1's turns (its distills of Qwen2.5 and Llama 3 keep its template).
constexpr std::string_view kR1User = "<｜User｜>";
constexpr std::string_view kR1Assistant = "<｜Assistant｜>";
constexpr std::string_view kR1End = "<｜end▁of▁sentence｜>";
constexpr std::string_view kThinkOpen = "<think>\n";
constexpr std::string_view kThinkStart = "<think>";
constexpr std::string_view kThinkEnd = "</think>";
// Phi-3's turns.
constexpr std::string_view kPhiUser = "<|user|>";
constexpr std::string_view kPhiSystem = "<|system|>";
constexpr std::string_view kPhiAssistant = "<|assistant|>";
constexpr std::string_view kPhiEnd = "<|end|>";
// Gemma's turns.
constexpr std::string_view kGemmaStart = "<start_of_turn>";
constexpr std::string_view kGemmaEnd = "<end_of_turn>\n";
constexpr std::string_view kGemmaPrompt = "<start_of_turn>model\n";

// Jinja's trim: whitespace off both ends (Python's str.strip(), for the ASCII whitespace and the
// Unicode spaces a chat message may carry: NBSP, the U+2000 block, line and paragraph separators,
// ideographic space), as Hugging Face's rendering of the template does. llama.cpp's own Jinja
// trims ASCII whitespace only, so a message that ends in such a space renders differently there.
std::string_view trim(std::string_view s) {
  // The whitespace that is not ASCII, in UTF-8: U+0085, NBSP, U+1680, U+2000..U+200A, the line
  // and paragraph separators, U+202F, U+205F, U+3000.
  static constexpr std::string_view kSpaces[] = {
      "\u0085", "\u00a0", "\u1680", "\u2000", "\u2001", "\u2002", "\u2003", "\u2004", "\u2005", "\u2006",
      "\u2007", "\u2008", "\u2009", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000"};
  const auto ascii = [](char ch) {
    const auto c = static_cast<unsigned char>(ch);
    return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
  };
  // The length of the whitespace character at s's front (back), or 0.
  const auto at_front = [&](std::string_view t) -> std::size_t {
    if (!t.empty() && ascii(t.front())) return 1;
    for (std::string_view u : kSpaces)
      if (t.starts_with(u)) return u.size();
    return 0;
  };
  const auto at_back = [&](std::string_view t) -> std::size_t {
    if (!t.empty() && ascii(t.back())) return 1;
    for (std::string_view u : kSpaces)
      if (t.ends_with(u)) return u.size();
    return 0;
  };
  for (std::size_t n; (n = at_front(s)) > 0;) s.remove_prefix(n);
  for (std::size_t n; (n = at_back(s)) > 0;) s.remove_suffix(n);
  return s;
}

// A float as Python's repr writes it: the shortest digits that read back to it, the closest
// of those to its exact value (std::to_chars chooses as Python does; nlohmann's own writer may
// choose another at a tie), positional from 1e-4 to below 1e16 and with an exponent of at least
// two digits outside that.
std::string python_float(double value) {
  if (!std::isfinite(value)) return value != value ? "NaN" : value > 0 ? "Infinity" : "-Infinity";
  char text[64];
  const auto written = std::to_chars(text, text + sizeof text, value, std::chars_format::scientific);
  const std::string_view shortest(text, static_cast<std::size_t>(written.ptr - text));  // -d.ddde+XX
  const std::size_t e = shortest.find('e');
  std::string digits;
  for (const char c : shortest.substr(0, e))
    if (c >= '0' && c <= '9') digits += c;
  int exponent = 0;
  std::from_chars(shortest.data() + e + (shortest[e + 1] == '+' ? 2 : 1), shortest.data() + shortest.size(), exponent);
  const std::string sign = std::signbit(value) ? "-" : "";
  const int n = static_cast<int>(digits.size());
  if (exponent < -4 || exponent >= 16) {
    const std::string mantissa = digits.substr(0, 1) + (n > 1 ? "." + digits.substr(1) : "");
    const int magnitude = exponent < 0 ? -exponent : exponent;
    return sign + mantissa + (exponent < 0 ? "e-" : "e+") + (magnitude < 10 ? "0" : "") + std::to_string(magnitude);
  }
  if (exponent < 0) return sign + "0." + std::string(static_cast<std::size_t>(-exponent - 1), '0') + digits;
  if (n <= exponent + 1) return sign + digits + std::string(static_cast<std::size_t>(exponent + 1 - n), '0') + ".0";
  return sign + digits.substr(0, static_cast<std::size_t>(exponent + 1)) + "." +
         digits.substr(static_cast<std::size_t>(exponent + 1));
}

// A JSON value as the templates' tojson writes it (Python's json.dumps with ensure_ascii off):
// keys in the value's order, ": " after keys; ", " between items, or with `indent` >= 0
// (tojson(indent=4)) each item on its own line, indented by `indent` spaces a level, "," after
// all but the last, and empty objects and arrays as {} and [].
template <class Json>
std::string python_json(const Json& value, int indent = -1, int level = 0) {
  if (value.is_object() || value.is_array()) {
    const bool object = value.is_object();
    if (value.empty()) return object ? "{}" : "[]";
    const std::string inner = indent < 0 ? "" : "\n" + std::string(static_cast<std::size_t>(indent * (level + 1)), ' ');
    std::string out(1, object ? '{' : '[');
    bool first = true;
    for (auto it = value.begin(); it != value.end(); ++it) {
      out += first ? inner : (indent < 0 ? ", " : "," + inner);
      first = false;
      if (object) out += Json(it.key()).dump(-1, ' ', false, Json::error_handler_t::replace) + ": ";
      out += python_json(it.value(), indent, level + 1);
    }
    if (indent >= 0) out += "\n" + std::string(static_cast<std::size_t>(indent * level), ' ');
    out += object ? '}' : ']';
    return out;
  }
  if (value.is_number_float()) return python_float(value.template get<double>());
  return value.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// The deepest a call's arguments may nest to be read as JSON (as a request body's).
constexpr std::size_t kMaxArgumentDepth = 64;

// A call's arguments as the template sees them: the API gives them as JSON text, which clients
// that render these templates (vLLM, llama.cpp's server) parse first; text that is not JSON
// stays text. Keys keep the order they were written in.
nlohmann::ordered_json call_arguments(const nlohmann::json& call) {
  const nlohmann::json& function = call.at("function");
  const auto arguments = function.find("arguments");
  if (arguments == function.end()) return nlohmann::ordered_json::object();
  if (!arguments->is_string()) return nlohmann::ordered_json::parse(arguments->dump());
  // No arguments (empty text): an empty object, as vLLM renders them.
  if (trim(arguments->get_ref<const std::string&>()).empty()) return nlohmann::ordered_json::object();
  // Text nested deeper than a request may be stays text: writing it out recurses per level.
  if (check_json(arguments->get_ref<const std::string&>(), kMaxArgumentDepth)) return arguments->get<std::string>();
  auto parsed = nlohmann::ordered_json::parse(arguments->get_ref<const std::string&>(), nullptr, false);
  if (parsed.is_discarded()) return arguments->get<std::string>();
  return parsed;
}

std::string call_name(const nlohmann::json& call) { return call.at("function").value("name", std::string()); }

// Today's local date as Llama 3.2's template writes it: strftime("%d %b %Y"), "26 Nov 2026".
std::string today() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  static constexpr const char* kMonths[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                           "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
  char text[32];
  std::snprintf(text, sizeof text, "%02d %s %d", local.tm_mday, kMonths[local.tm_mon], local.tm_year + 1900);
  return text;
}

[[noreturn]] void unsupported(const std::string& why) {
  throw std::invalid_argument("chat template: " + why);
}

// Templates that take user and assistant messages in turn, from a user message, raise
// otherwise; this throws, naming the message and the role it must have. `first` is the index of
// the first turn (1 after a system message).
void require_turn(std::span<const ChatMessage> messages, std::size_t i, std::size_t first) {
  const char* expected = (i - first) % 2 == 0 ? "user" : "assistant";
  if (messages[i].role != expected)
    throw std::invalid_argument("messages[" + std::to_string(i) + "]: this model's chat template takes user and "
                                "assistant messages in turn (after an optional first system message), so this one "
                                "must be " + expected + ", not " + messages[i].role);
}

// Reads the Jinja string literal whose opening quote is at text[i]; returns its value and
// leaves i after the closing quote. Escapes are Python's (\n, \t, \\, \', \xHH, \uXXXX, ...);
// an unknown escape keeps its backslash, as Python does.
std::string read_string_literal(std::string_view text, std::size_t& i) {
  const char quote = text[i++];
  std::string value;
  const auto hex_value = [&](std::size_t digits) -> std::optional<char32_t> {
    if (i + digits > text.size()) return std::nullopt;
    char32_t cp = 0;
    for (std::size_t k = 0; k < digits; ++k) {
      const char c = text[i + k];
      int digit = -1;
      if (c >= '0' && c <= '9') digit = c - '0';
      if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
      if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
      if (digit < 0) return std::nullopt;
      cp = cp * 16 + static_cast<char32_t>(digit);
    }
    i += digits;
    return cp;
  };
  while (i < text.size()) {
    const char c = text[i++];
    if (c == quote) return value;
    if (c != '\\' || i == text.size()) {
      value += c;
      continue;
    }
    const char escaped = text[i++];
    switch (escaped) {
      case 'n': value += '\n'; break;
      case 't': value += '\t'; break;
      case 'r': value += '\r'; break;
      case 'f': value += '\f'; break;
      case 'b': value += '\b'; break;
      case 'v': value += '\v'; break;
      case '0': value += '\0'; break;
      case '\\': value += '\\'; break;
      case '\'': value += '\''; break;
      case '"': value += '"'; break;
      case '\n': break;  // a backslash-newline continues the line
      case 'x':
      case 'u':
      case 'U': {
        const std::size_t digits = escaped == 'x' ? 2 : escaped == 'u' ? 4 : 8;
        const std::optional<char32_t> cp = hex_value(digits);
        if (!cp) unsupported("malformed \\" + std::string(1, escaped) + " escape in a string literal");
        // Python refuses these too; UTF-8 has no encoding for them.
        // Built by appending: "literal" + std::string&& trips GCC 12's -Wrestrict at -O3 (a false alarm).
        std::string escape(1, '\\');
        escape.append(1, escaped).append(text.substr(i - digits, digits));
        if (*cp > 0x10FFFF) unsupported(escape + " in a string literal is past U+10FFFF, not a character");
        if (*cp >= 0xD800 && *cp <= 0xDFFF) unsupported(escape + " in a string literal is a surrogate, not a character");
        utf8::append(value, *cp);
        break;
      }
      default:
        value += '\\';
        value += escaped;
    }
  }
  unsupported("unterminated string literal");
}

// The constant strings of the template's {{ }} and {% %} blocks, in order. Literals joined by
// '+' with nothing else between them are joined into one.
std::vector<std::string> constant_strings(std::string_view tmpl) {
  std::vector<std::string> constants;
  std::size_t i = 0;
  while (i < tmpl.size()) {
    const std::size_t open = tmpl.find('{', i);
    if (open == std::string_view::npos || open + 1 >= tmpl.size()) break;
    const char kind = tmpl[open + 1];
    if (kind == '#') {  // a comment
      const std::size_t close = tmpl.find("#}", open + 2);
      if (close == std::string_view::npos) unsupported("unterminated comment");
      i = close + 2;
      continue;
    }
    if (kind != '{' && kind != '%') {
      i = open + 1;  // text outside a block
      continue;
    }
    const std::string_view close = kind == '{' ? "}}" : "%}";
    std::string chain;         // the literal (or literals joined by '+') being read
    bool in_chain = false;     // whether `chain` holds one
    bool after_plus = false;   // the chain so far ends in '+'
    const auto end_chain = [&] {
      if (in_chain) constants.push_back(std::move(chain));
      chain.clear();
      in_chain = false;
      after_plus = false;
    };
    i = open + 2;
    bool closed = false;
    while (i < tmpl.size()) {
      const char c = tmpl[i];
      if (tmpl.substr(i, close.size()) == close) {
        i += close.size();
        closed = true;
        break;
      }
      if (c == '\'' || c == '"') {
        std::string value = read_string_literal(tmpl, i);
        if (in_chain && after_plus) {
          chain += value;
        } else {
          end_chain();
          chain = std::move(value);
          in_chain = true;
        }
        after_plus = false;
      } else if (c == '+') {
        after_plus = in_chain;
        ++i;
      } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '-') {
        ++i;  // spacing, and the '-' of whitespace control ({{- ... -}})
      } else {
        end_chain();  // a name, number or other operator: no longer a constant
        ++i;
      }
    }
    if (!closed) unsupported("unterminated " + std::string(kind == '{' ? "{{ expression" : "{% statement"));
    end_chain();
  }
  return constants;
}

}  // namespace

ChatTemplate ChatTemplate::from_vocab(const Vocab& vocab) {
  ChatTemplate result;
  const std::string& tmpl = vocab.chat_template;
  if (tmpl.empty()) return result;  // no template in the file: plain ChatML
  // GGUF strings are UTF-8, and the default system message found here goes into prompts and
  // into `batchlm inspect`'s JSON.
  if (const std::size_t bad = utf8::first_invalid(tmpl); bad != std::string_view::npos) {
    unsupported("not valid UTF-8 (at byte " + std::to_string(bad + 1) + ")");
  }
  if (tmpl.find(kR1User) != std::string::npos && tmpl.find(kR1Assistant) != std::string::npos) {
    // The generation prompt opens the reasoning where the template writes it so (the distills'
    // later templates); the first ones end with the assistant's tag alone.
    result.name_ = "deepseek-r1";
    const std::string opening = std::string(kR1Assistant) + std::string(kThinkOpen);
    const std::vector<std::string> constants = constant_strings(tmpl);
    result.opens_reasoning_ = std::find(constants.begin(), constants.end(), opening) != constants.end();
    return result;
  }
  if (tmpl.find("[INST]") != std::string::npos && tmpl.find("[/INST]") != std::string::npos) {
    const auto token_text = [&](Token id) {
      return id >= 0 && static_cast<std::size_t>(id) < vocab.tokens.size() ? vocab.tokens[static_cast<std::size_t>(id)]
                                                                             : std::string();
    };
    if (tmpl.find("<<SYS>>") != std::string::npos) {
      // Llama 2's: BOS + "[INST] " + content.strip() + " [/INST]" per user turn (the system
      // message in a <<SYS>> block at the head of the first one), " " + answer.strip() + " " +
      // EOS per answer.
      const std::vector<std::string> constants = constant_strings(tmpl);
      const auto has = [&](std::string_view c) { return std::find(constants.begin(), constants.end(), c) != constants.end(); };
      if (!has("<<SYS>>\n") || !has("\n<</SYS>>\n\n") || !has("[INST] ") || !has(" [/INST]") ||
          tmpl.find("bos_token + '[INST] '") == std::string::npos || tmpl.find(".strip()") == std::string::npos)
        unsupported("an [INST] <<SYS>> template other than Llama 2's");
      result.name_ = "llama2";
      result.bos_text_ = token_text(vocab.bos);
      result.eos_text_ = token_text(vocab.eos);
      return result;
    }
    // Mistral's: the turn's tags as the template's constants spell them (" [INST] ... [/INST]"
    // in v0.1/v0.2, "[INST] ...[/INST]" in v0.3, "[INST]...[/INST]" in Nemo's), whether an
    // answer follows a space and is trimmed, and which user turn the system message joins.
    result.name_ = "mistral";
    for (const std::string& c : constant_strings(tmpl)) {
      if (result.inst_open_.empty() && (c == "[INST] " || c == " [INST] " || c == "[INST]")) result.inst_open_ = c;
      if (result.inst_close_.empty() && (c == " [/INST]" || c == "[/INST]")) result.inst_close_ = c;
    }
    if (result.inst_open_.empty() || result.inst_close_.empty())
      unsupported("a Mistral [INST] template whose turns this build does not recognise");
    const auto has = [&](std::initializer_list<std::string_view> texts) {
      return std::any_of(texts.begin(), texts.end(), [&](std::string_view t) { return tmpl.find(t) != std::string::npos; });
    };
    result.answer_space_ = has({"' ' + message['content']", "\" \" + message[\"content\"]", "' ' + message[\"content\"]",
                                "\" \" + message['content']", "' '  + message['content']"});
    result.answer_trim_ = has({"message[\"content\"]|trim", "message['content']|trim", "message[\"content\"] | trim",
                              "message['content'] | trim"});
    result.system_turn_ = has({"loop.first and system_message"})  ? SystemTurn::kFirst
                          : has({"loop.last and system_message"}) ? SystemTurn::kLast
                                                                  : SystemTurn::kNone;
    result.eos_text_ = token_text(vocab.eos);
    return result;
  }
  if (tmpl.find(kPhiUser) != std::string::npos && tmpl.find(kPhiEnd) != std::string::npos &&
      tmpl.find(kPhiAssistant) != std::string::npos) {
    // Phi-3's first templates leave system messages out; later ones write them as turns, and
    // Phi-3.5's only those with content.
    result.name_ = "phi3";
    result.system_turns_ = tmpl.find(kPhiSystem) != std::string::npos;
    result.skip_empty_system_ = tmpl.find("'system' and message['content']") != std::string::npos;
    return result;
  }
  if ((tmpl.find("'<|' + message['role'] + '|>'") != std::string::npos ||
       tmpl.find("\"<|\" + message[\"role\"] + \"|>\"") != std::string::npos) &&
      tmpl.find(kPhiEnd) != std::string::npos && tmpl.find(kPhiAssistant) != std::string::npos) {
    // Phi-4-mini's: '<|' + role + '|>' + content + '<|end|>' for every message, no newlines.
    result.name_ = "phi3";
    result.system_turns_ = true;
    result.phi_newlines_ = false;
    return result;
  }
  if (tmpl.find(kGemmaStart) != std::string::npos) {
    // Gemma 2's and 3's: '<start_of_turn>' + role + '\n' + content | trim + '<end_of_turn>\n'.
    const std::vector<std::string> constants = constant_strings(tmpl);
    const auto has = [&](std::string_view c) { return std::find(constants.begin(), constants.end(), c) != constants.end(); };
    if (!has(kGemmaStart) || !has(kGemmaEnd) || !has(kGemmaPrompt) ||
        (tmpl.find("| trim") == std::string::npos && tmpl.find("|trim") == std::string::npos))
      unsupported("a <start_of_turn> template other than Gemma 2's and 3's");
    result.name_ = "gemma";
    if (tmpl.find("first_user_prefix") != std::string::npos) {
      // Gemma 3's: {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}, the constant
      // after the system message.
      constexpr std::string_view kPrefix = "first_user_prefix = messages[0]['content'] +";
      const std::size_t at = tmpl.find(kPrefix);
      std::size_t i = at == std::string::npos ? at : tmpl.find_first_of("'\"", at + kPrefix.size());
      if (i == std::string::npos) unsupported("a Gemma 3 template whose first_user_prefix this build does not recognise");
      result.system_separator_ = read_string_literal(tmpl, i);
    }
    return result;
  }
  if (tmpl.find(kHeaderStart) != std::string::npos && tmpl.find(kHeaderEnd) != std::string::npos) {
    result.name_ = "llama3";
    const std::vector<std::string> constants = constant_strings(tmpl);
    const bool dated = std::any_of(constants.begin(), constants.end(),
                                   [](const std::string& c) { return c.find("Cutting Knowledge Date:") != std::string::npos; });
    if (!dated) {
      // Llama 3.0, or a fine-tune's template: a whole system turn written out is its default.
      const std::string system_turn = std::string(kHeaderStart) + "system" + std::string(kHeaderEnd) + "\n\n";
      for (const std::string& constant : constants) {
        if (!constant.starts_with(system_turn)) continue;
        const std::size_t end = constant.find(kEndOfTurn, system_turn.size());
        if (end == std::string::npos) continue;
        result.default_system_ = constant.substr(system_turn.size(), end - system_turn.size());
        break;
      }
      return result;
    }
    if (std::none_of(constants.begin(), constants.end(), [](const std::string& c) { return c.starts_with(kKnowledgeDate); }))
      unsupported("a Llama 3 template whose system turn is dated other than \"Cutting Knowledge Date: December 2023\"");
    if (tmpl.find("strftime_now") != std::string::npos) {
      result.date_ = "today";
    } else {
      // {%- set date_string = "26 Jul 2024" %}: the constant after the name.
      const std::size_t at = tmpl.find("date_string =");
      std::size_t i = at == std::string::npos ? at : tmpl.find_first_of("'\"", at);
      if (i == std::string::npos) unsupported("a Llama 3 template with a dated system turn but no date_string");
      result.date_ = read_string_literal(tmpl, i);
    }
    // Llama 3.1's tool calling, with the tools in the first user turn (tools_in_user_message,
    // the template's default): its instructions, a call's frame and the result's turn must all
    // be there.
    const auto has = [&](std::string_view c) { return std::find(constants.begin(), constants.end(), c) != constants.end(); };
    constexpr std::string_view kInstructions[] = {
        "Given the following functions, please respond with a JSON for a function call ",
        "with its proper arguments that best answers the given prompt.\n\n",
        "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.",
        "Do not use variables.\n\n"};
    if (std::all_of(std::begin(kInstructions), std::end(kInstructions), has) && has(kIpythonEnvironment) &&
        has(kIpythonTurn) && has("{\"name\": \"") && has("\"parameters\": ") && tmpl.find("tools_in_user_message = true") != std::string::npos) {
      result.call_format_ = CallFormat::kJson;
      for (const std::string_view c : kInstructions) result.user_tools_preamble_ += c;
    }
    return result;
  }
  if (tmpl.find(kTurnStart) == std::string::npos) {
    unsupported("only ChatML (<|im_start|>role ... <|im_end|>), Llama 3 (<|start_header_id|>role<|end_header_id|> "
                "... <|eot_id|>), DeepSeek-R1 (<｜User｜> ... <｜Assistant｜>), Phi-3 (<|user|> ... <|end|>), "
                "Mistral and Llama 2 ([INST] ... [/INST]), Gemma (<start_of_turn>role ... <end_of_turn>) "
                "templates are supported; "
                "this one begins '" +
                tmpl.substr(0, 80) + "'");
  }
  result.reasoning_ = tmpl.find("reasoning_content") != std::string::npos && tmpl.find("</think>") != std::string::npos;
  if (tmpl.find("enable_thinking") != std::string::npos) {
    const std::vector<std::string> constants = constant_strings(tmpl);
    const std::string empty_block = std::string(kThinkOpen) + "\n" + std::string(kThinkEnd) + "\n\n";
    if (std::find(constants.begin(), constants.end(), empty_block) != constants.end()) result.thinking_off_ = empty_block;
  }
  {
    // Qwen 2.5's and 3's tool calling: the constants that list the tools, frame a call and a
    // tool's result. All must be there, a call framed one way or the other.
    std::string preamble, postamble;
    bool call_after_newline = false, call_alone = false, call_middle = false, call_end = false, response = false;
    for (const std::string& c : constant_strings(tmpl)) {
      if (preamble.empty() && (c.starts_with("\n\n# Tools\n\n") || c.starts_with("# Tools\n\n")) && c.ends_with("<tools>"))
        preamble = c;
      if (postamble.empty() && c.starts_with("\n</tools>") && c.ends_with("<|im_end|>\n")) postamble = c;
      call_after_newline |= c == "\n<tool_call>\n{\"name\": \"";
      call_alone |= c == "<tool_call>\n{\"name\": \"";
      call_middle |= c == "\", \"arguments\": ";
      call_end |= c == "}\n</tool_call>";
      response |= c == "\n<tool_response>\n";
    }
    if (!preamble.empty() && !postamble.empty() && call_after_newline != call_alone && call_middle && call_end && response) {
      result.call_format_ = CallFormat::kTagged;
      result.tools_preamble_ = std::move(preamble);
      result.tools_postamble_ = std::move(postamble);
      result.newline_before_call_ = call_after_newline;
    }
  }
  for (const std::string& constant : constant_strings(tmpl)) {
    if (constant.compare(0, kSystemTurnStart.size(), kSystemTurnStart) != 0) continue;
    const std::size_t end = constant.find(kTurnEnd, kSystemTurnStart.size());
    if (end == std::string::npos) continue;  // opens the system turn for a message's content
    result.default_system_ = constant.substr(kSystemTurnStart.size(), end - kSystemTurnStart.size());
    break;
  }
  return result;
}

std::string ChatTemplate::apply(std::span<const ChatMessage> messages, bool add_generation_prompt,
                                const nlohmann::ordered_json& tools) const {
  if (tools.is_array() && !tools.empty() && !calls_tools()) throw std::invalid_argument("tools: " + *tools_problem(*this));
  std::string out;
  if (name_ == "mistral" || name_ == "llama2") {
    // An optional system message first, then user and assistant messages in turn, as the
    // template requires (it raises otherwise).
    const bool llama2 = name_ == "llama2";
    std::size_t first = 0;
    std::string_view system;
    if (!messages.empty() && messages.front().role == "system") {
      if (system_turn_ == SystemTurn::kNone && !llama2)
        throw std::invalid_argument("messages[0]: this model's chat template takes no system message");
      system = messages.front().content;
      first = 1;
    }
    for (std::size_t i = first; i < messages.size(); ++i) {
      require_turn(messages, i, first);
      if (llama2) {
        // The first BOS is the tokenizer's (as for the other templates); later turns write it.
        if (messages[i].role == "user") {
          if (i > first) out += bos_text_;
          std::string content = messages[i].content;
          if (i == first && first == 1)
            content = "<<SYS>>\n" + std::string(system) + "\n<</SYS>>\n\n" + content;
          out += "[INST] ";
          out += trim(content);
          out += " [/INST]";
        } else {
          out += ' ';
          out += trim(messages[i].content);
          out += ' ';
          out += eos_text_;
        }
        continue;
      }
      if (messages[i].role == "user") {
        out += inst_open_;
        const bool joins = first == 1 && ((system_turn_ == SystemTurn::kFirst && i == first) ||
                                          (system_turn_ == SystemTurn::kLast && i + 1 == messages.size()));
        if (joins) {
          out += system;
          out += "\n\n";
        }
        out += messages[i].content;
        out += inst_close_;
      } else {
        if (answer_space_) out += ' ';
        out += answer_trim_ ? trim(messages[i].content) : std::string_view(messages[i].content);
        out += eos_text_;
      }
    }
    return out;
  }
  if (name_ == "gemma") {
    // User and model turns in turn from a user turn, as the templates require (they raise
    // otherwise), contents trimmed. Gemma 3's template writes a first system message as it is,
    // and its separator, at the head of the first user turn (an empty one too). Gemma 2's refuses
    // a system message; here it goes there as llama.cpp's own Gemma formatting puts it, trimmed
    // and followed by "\n\n" (nothing when empty), so that a job with a system prompt still runs.
    std::size_t first = 0;
    std::string prefix;
    if (!messages.empty() && messages.front().role == "system") {
      first = 1;
      if (system_separator_) {
        prefix = messages.front().content + *system_separator_;
      } else if (const std::string_view system = trim(messages.front().content); !system.empty()) {
        prefix = std::string(system) + "\n\n";
      }
    }
    for (std::size_t i = first; i < messages.size(); ++i) {
      require_turn(messages, i, first);
      out += kGemmaStart;
      out += messages[i].role == "user" ? "user\n" : "model\n";
      if (i == first) out += prefix;
      out += trim(messages[i].content);
      out += kGemmaEnd;
    }
    if (add_generation_prompt) out += kGemmaPrompt;
    return out;
  }
  if (name_ == "phi3") {
    // <|role|>\ncontent<|end|>\n per turn (Phi-4-mini's without the newlines); a system message
    // adds nothing where the template has no system turn, nor an empty one where the template
    // skips those.
    for (const ChatMessage& m : messages) {
      std::string_view tag;
      if (m.role == "user") tag = kPhiUser;
      if (m.role == "assistant") tag = kPhiAssistant;
      if (m.role == "system" && system_turns_ && !(skip_empty_system_ && m.content.empty())) tag = kPhiSystem;
      if (tag.empty()) continue;
      out += tag;
      if (phi_newlines_) out += '\n';
      out += m.content;
      out += kPhiEnd;
      if (phi_newlines_) out += '\n';
    }
    if (add_generation_prompt) {
      out += kPhiAssistant;
      if (phi_newlines_) out += '\n';
    }
    return out;
  }
  if (name_ == "deepseek-r1") {
    // The last system message's content first, bare; then the turns, an assistant's without
    // the reasoning before its last </think>; system messages in between add nothing.
    for (const ChatMessage& m : messages)
      if (m.role == "system") out = m.content;
    for (const ChatMessage& m : messages) {
      if (m.role == "user") {
        out += kR1User;
        out += m.content;
      } else if (m.role == "assistant") {
        std::string_view content = m.content;
        if (const std::size_t end = content.rfind(kThinkEnd); end != std::string_view::npos)
          content.remove_prefix(end + kThinkEnd.size());
        out += kR1Assistant;
        out += content;
        out += kR1End;
      }
    }
    if (add_generation_prompt) {
      out += kR1Assistant;
      if (opens_reasoning_) out += kThinkOpen;
    }
    return out;
  }
  if (name_ == "llama3") {
    const auto header = [&](std::string_view role) {
      out += kHeaderStart;
      out += role;
      out += kHeaderEnd;
      out += "\n\n";
    };
    const auto append_turn = [&](std::string_view role, std::string_view content) {
      header(role);
      out += trim(content);
      out += kEndOfTurn;
    };
    std::size_t first = 0;
    const bool listing = tools.is_array() && !tools.empty();
    if (date_.empty() && !default_system_.empty() && !messages.empty() && messages.front().role != "system")
      append_turn("system", default_system_);
    if (!date_.empty()) {
      // The system turn is always there; the conversation's own system message goes into it.
      std::string_view system;
      if (!messages.empty() && messages.front().role == "system") {
        system = trim(messages.front().content);
        first = 1;
      }
      header("system");
      if (listing) out += kIpythonEnvironment;
      out += kKnowledgeDate;
      out += "Today Date: ";
      out += date_ == "today" ? today() : date_;
      out += "\n\n";
      out += system;
      out += kEndOfTurn;
    }
    if (listing) {
      // The tools open the first message after the system message, which is written as a
      // user turn whatever its role, as the template does.
      if (first == messages.size())
        throw std::invalid_argument("messages: this model's chat template puts the tools in the first user message, "
                                    "and the conversation has none");
      header("user");
      out += user_tools_preamble_;
      for (const auto& tool : tools) out += python_json(tool, 4) + "\n\n";
      out += trim(messages[first].content);
      out += kEndOfTurn;
      ++first;
    }
    for (std::size_t i = first; i < messages.size(); ++i) {
      const ChatMessage& m = messages[i];
      if (call_format_ == CallFormat::kJson && m.calls_tools()) {
        // The call alone: the message's content is not written. The template takes one call per
        // message (it raises for more); several, as the model may answer them, are written as
        // that many turns, one after another.
        for (const auto& call : m.tool_calls) {
          header("assistant");
          out += "{\"name\": \"" + call_name(call) + "\", \"parameters\": " + python_json(call_arguments(call)) + "}";
          out += kEndOfTurn;
        }
      } else if (call_format_ == CallFormat::kJson && m.role == "tool") {
        out += kIpythonTurn;
        out += python_json(nlohmann::ordered_json(m.content));
        out += kEndOfTurn;
      } else {
        append_turn(m.role, m.content);
      }
    }
    if (add_generation_prompt) header("assistant");
    return out;
  }
  return apply_with_tool_turns(messages, add_generation_prompt, tools);
}

// ChatML: a turn per message, after the default system message where the conversation does not
// start with one (as SmolLM2's template writes it); Qwen 3's reasoning kept only after the last
// user query; and, where the template has them (calls_tools()), Qwen 2.5's or Qwen 3's tool
// turns: the tools listed in the system turn, an assistant's calls after its content,
// consecutive tool results in one user turn.
std::string ChatTemplate::apply_with_tool_turns(std::span<const ChatMessage> messages, bool add_generation_prompt,
                                                const nlohmann::ordered_json& tools) const {
  std::string out;
  const auto append_turn = [&](std::string_view role, std::string_view content) {
    out += kTurnStart;
    out += role;
    out += '\n';
    out += content;
    out += kTurnEnd;
    out += '\n';
  };
  const auto n = messages.size();
  const bool system_first = n > 0 && messages.front().role == "system";
  std::size_t first = 0;
  if (tools.is_array() && !tools.empty()) {
    out += kSystemTurnStart;
    if (tools_preamble_.starts_with("\n\n")) {
      // Qwen 2.5: the system message, or the default one, then the tools.
      out += system_first ? messages.front().content : default_system_;
    } else if (system_first) {
      // Qwen 3: the system message and a blank line, when there is one.
      out += messages.front().content;
      out += "\n\n";
    }
    out += tools_preamble_;
    for (const auto& tool : tools) {
      out += '\n';
      out += python_json(tool);
    }
    out += tools_postamble_;
    first = system_first ? 1 : 0;
  } else if (!default_system_.empty() && n > 0 && !system_first) {
    append_turn("system", default_system_);
  }
  // Qwen 3: assistant turns after the last user query keep their reasoning (see apply).
  std::size_t last_query = n == 0 ? 0 : n - 1;
  for (std::size_t i = n; i-- > 0;) {
    const ChatMessage& m = messages[i];
    if (m.role == "user" && !(m.content.starts_with("<tool_response>") && m.content.ends_with("</tool_response>"))) {
      last_query = i;
      break;
    }
  }
  const auto strip = [](std::string_view s, bool front, bool back) {
    while (front && !s.empty() && s.front() == '\n') s.remove_prefix(1);
    while (back && !s.empty() && s.back() == '\n') s.remove_suffix(1);
    return s;
  };
  for (std::size_t i = first; i < n; ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "tool" && calls_tools()) {
      if (i == 0 || messages[i - 1].role != "tool") out += "<|im_start|>user";
      out += "\n<tool_response>\n";
      out += m.content;
      out += "\n</tool_response>";
      if (i + 1 == n || messages[i + 1].role != "tool") out += "<|im_end|>\n";
      continue;
    }
    if (m.role != "assistant") {
      append_turn(m.role, m.content);
      continue;
    }
    // The turn's text, and the content after any reasoning (what decides the calls' spacing).
    std::string body = m.content;
    std::string_view content = m.content;
    if (reasoning_) {
      // The reasoning given apart (reasoning_content) is taken as it is, the content then
      // whole; else a </think> in the content ends it.
      std::string_view reasoning;
      if (m.reasoning) {
        reasoning = *m.reasoning;
      } else if (const std::size_t end = content.find(kThinkEnd); end != std::string_view::npos) {
        reasoning = strip(content.substr(0, end), false, true);
        if (const std::size_t start = reasoning.rfind(kThinkStart); start != std::string_view::npos)
          reasoning.remove_prefix(start + kThinkStart.size());
        reasoning = strip(reasoning, true, false);
        content = strip(content.substr(content.rfind(kThinkEnd) + kThinkEnd.size()), true, false);
      }
      body = i > last_query && (i == n - 1 || !reasoning.empty())
                 ? "<think>\n" + std::string(strip(reasoning, true, true)) + "\n</think>\n\n" +
                       std::string(strip(content, true, false))
                 : std::string(content);
    }
    if (!m.calls_tools()) {
      append_turn("assistant", body);
      continue;
    }
    if (newline_before_call_) {
      // Qwen 2.5: the content on its own line when there is any, each call on the next.
      out += "<|im_start|>assistant";
      if (!body.empty()) out += "\n" + body;
    } else {
      out += "<|im_start|>assistant\n" + body;
    }
    for (std::size_t k = 0; k < m.tool_calls.size(); ++k) {
      const nlohmann::json& call = m.tool_calls[k];
      if (newline_before_call_ || k > 0 || !content.empty()) out += '\n';
      out += "<tool_call>\n{\"name\": \"";
      out += call_name(call);
      out += "\", \"arguments\": ";
      const nlohmann::ordered_json arguments = call_arguments(call);
      // Qwen 3 writes arguments given as text as they are; Qwen 2.5 writes every value as JSON.
      out += arguments.is_string() && !newline_before_call_ ? arguments.get<std::string>() : python_json(arguments);
      out += "}\n</tool_call>";
    }
    out += "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

namespace {
constexpr std::string_view kCallOpen = "<tool_call>";
constexpr std::string_view kCallClose = "</tool_call>";

std::string new_call_id() {
  static constexpr char kDigits[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += kDigits[rng() % (sizeof kDigits - 1)];
  return id;
}
}  // namespace

namespace {

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

std::size_t skip_space(std::string_view text, std::size_t at) {
  while (at < text.size() && is_space(text[at])) ++at;
  return at;
}

// The length of `text` without the whitespace at its end.
std::size_t trimmed_size(std::string_view text) {
  std::size_t n = text.size();
  while (n > 0 && is_space(text[n - 1])) --n;
  return n;
}

// The length of the longest end of `text` that begins `tag` (a tag that the next piece may
// complete).
std::size_t partial_tag(std::string_view text, std::string_view tag) {
  for (std::size_t n = std::min(text.size(), tag.size() - 1); n > 0; --n)
    if (tag.starts_with(text.substr(text.size() - n))) return n;
  return 0;
}

}  // namespace

std::string answer_prefix(const ChatTemplate& chat_template, const nlohmann::ordered_json& extra) {
  std::string prefix;
  if (requested_thinking(extra) == false) prefix = chat_template.thinking_off();
  if (chat_template.calls_tools() && requested_tools(extra) && forces_call(extra))
    prefix += forced_call_opening(chat_template.call_format());
  return prefix;
}

std::string_view forced_call_opening(CallFormat format) { return format == CallFormat::kTagged ? "<tool_call>\n" : ""; }

std::string_view call_arguments_key(CallFormat format) { return format == CallFormat::kJson ? "parameters" : "arguments"; }

std::optional<std::string> tools_problem(const ChatTemplate& chat_template) {
  if (chat_template.calls_tools()) return std::nullopt;
  return "this model's chat template (" + std::string(chat_template.name()) +
         ") does not list tools; the embedded engine calls tools with templates that do, as Qwen 2.5's and Qwen 3's "
         "(<tool_call> ... </tool_call>) and Llama 3.1's, 3.2's and 3.3's";
}

std::optional<std::size_t> answer_start(std::string_view text) {
  const std::size_t at = skip_space(text, 0);
  if (!text.substr(at).starts_with(kThinkStart)) return std::size_t{0};
  const std::size_t end = text.find(kThinkEnd, at + kThinkStart.size());
  if (end == std::string_view::npos) return std::nullopt;
  return end + kThinkEnd.size();
}

ReasoningSplit::Parts ReasoningSplit::add(std::string_view piece) {
  Parts out;
  held_ += piece;
  for (;;) {
    switch (state_) {
      case State::kStart: {
        // Whitespace, then "<think>" or text that cannot begin it.
        const std::string_view head = std::string_view(held_).substr(skip_space(held_, 0));
        if (head.starts_with(kThinkStart)) {
          held_.erase(0, held_.size() - head.size() + kThinkStart.size());
          state_ = State::kReasoningStart;
          continue;
        }
        if (!head.empty() && !kThinkStart.starts_with(head)) {
          state_ = State::kContent;
          continue;
        }
        return out;
      }
      case State::kReasoningStart:
      case State::kContentStart:
        // The whitespace at the start of the reasoning and of the content is dropped.
        held_.erase(0, skip_space(held_, 0));
        if (held_.empty()) return out;
        state_ = state_ == State::kReasoningStart ? State::kReasoning : State::kContent;
        continue;
      case State::kReasoning: {
        if (const std::size_t end = held_.find(kThinkEnd); end != std::string::npos) {
          out.reasoning.append(held_, 0, trimmed_size(std::string_view(held_).substr(0, end)));
          held_.erase(0, end + kThinkEnd.size());
          state_ = State::kContentStart;
          continue;
        }
        // Out goes all but a tag's possible beginning and the whitespace before it.
        const std::size_t keep = trimmed_size(std::string_view(held_).substr(0, held_.size() - partial_tag(held_, kThinkEnd)));
        out.reasoning.append(held_, 0, keep);
        held_.erase(0, keep);
        return out;
      }
      case State::kContent:
        out.content += held_;
        held_.clear();
        return out;
    }
  }
}

ReasoningSplit::Parts ReasoningSplit::finish() {
  Parts out;
  if (state_ == State::kStart) {
    out.content = std::move(held_);  // the start of a tag, or whitespace, and nothing after it
  } else if (state_ == State::kReasoning) {
    out.reasoning = held_.substr(0, trimmed_size(held_));  // a tag begun and not finished is text
  }
  held_.clear();
  return out;
}

namespace {

// One call as the model wrote it, {"name": ..., "arguments" (or "parameters"): {...}}, as an
// API's call with a new id; nullopt when the text is not one. Without tags around it (kJson) a
// call must give its arguments, so that a JSON answer with a "name" is not taken for one.
std::optional<nlohmann::json> model_call(std::string_view text, bool tagged) {
  if (check_json(text, kMaxArgumentDepth + 1)) return std::nullopt;
  const auto call = nlohmann::ordered_json::parse(text, nullptr, false);
  if (call.is_discarded() || !call.is_object()) return std::nullopt;
  const auto name = call.find("name");
  if (name == call.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) return std::nullopt;
  auto arguments = call.find("arguments");
  if (arguments == call.end()) arguments = call.find("parameters");
  if (arguments == call.end() && !tagged) return std::nullopt;
  std::string arguments_text = "{}";
  if (arguments != call.end()) {
    if (arguments->is_string()) {
      arguments_text = arguments->get<std::string>();
    } else if (arguments->is_object()) {
      arguments_text = arguments->dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
    } else {
      return std::nullopt;
    }
  }
  return nlohmann::json{{"id", new_call_id()},
                        {"type", "function"},
                        {"function", {{"name", name->get<std::string>()}, {"arguments", std::move(arguments_text)}}}};
}

// The end of the JSON object that opens at text[at] ('{'): one past its closing brace, or npos
// when it is not closed.
std::size_t object_end(std::string_view text, std::size_t at) {
  int depth = 0;
  bool quoted = false;
  for (std::size_t i = at; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '\\') ++i;
      else if (c == '"') quoted = false;
    } else if (c == '"') {
      quoted = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if ((c == '}' || c == ']') && --depth == 0) {
      return i + 1;
    }
  }
  return std::string_view::npos;
}

// kJson: the answer from `from` on, when it is nothing but calls separated by ';'.
std::optional<ParsedToolCalls> parse_json_calls(std::string_view text, std::size_t from) {
  std::size_t at = skip_space(text, from);
  const std::size_t before = at;
  if (text.substr(at).starts_with(kPythonTag)) at = skip_space(text, at + kPythonTag.size());
  if (at == text.size() || text[at] != '{') return std::nullopt;
  ParsedToolCalls out;
  out.calls = nlohmann::json::array();
  for (;;) {
    const std::size_t end = object_end(text, at);
    if (end == std::string_view::npos) return std::nullopt;
    auto call = model_call(text.substr(at, end - at), /*tagged=*/false);
    if (!call) return std::nullopt;
    out.calls.push_back(std::move(*call));
    at = skip_space(text, end);
    if (at == text.size()) break;
    if (text[at] != ';') return std::nullopt;
    at = skip_space(text, at + 1);
    if (at == text.size()) break;
    if (text[at] != '{') return std::nullopt;
  }
  out.outside = std::string(text.substr(0, before));
  out.content = std::string(trim(out.outside));
  return out;
}

}  // namespace

std::optional<ParsedToolCalls> parse_tool_calls(std::string_view text, CallFormat format) {
  const std::optional<std::size_t> from = answer_start(text);
  if (!from) return std::nullopt;
  if (format == CallFormat::kJson) return parse_json_calls(text, *from);
  if (text.find(kCallOpen, *from) == std::string_view::npos) return std::nullopt;
  ParsedToolCalls out;
  out.calls = nlohmann::json::array();
  std::string content;
  std::size_t pos = 0;
  for (std::size_t at; (at = text.find(kCallOpen, std::max(pos, *from))) != std::string_view::npos;) {
    content += text.substr(pos, at - pos);
    const std::size_t body = at + kCallOpen.size();
    const std::size_t end = text.find(kCallClose, body);
    if (end == std::string_view::npos) return std::nullopt;
    auto call = model_call(text.substr(body, end - body), /*tagged=*/true);
    if (!call) return std::nullopt;
    out.calls.push_back(std::move(*call));
    pos = end + kCallClose.size();
  }
  content += text.substr(pos);
  out.content = std::string(trim(content));
  out.outside = std::move(content);
  return out;
}

std::size_t tool_call_start(std::string_view text) {
  if (const std::size_t at = text.find(kCallOpen); at != std::string_view::npos) return at;
  return text.size() - partial_tag(text, kCallOpen);
}

std::string ToolCallStream::unsent_content(const ParsedToolCalls& parsed) const {
  // What went out is the text before the first call, which is where `outside` begins.
  const std::string_view rest = std::string_view(parsed.outside).substr(std::min(sent_, parsed.outside.size()));
  return std::string(rest.substr(0, trimmed_size(rest)));
}

std::optional<std::size_t> ToolCallStream::answer_from() {
  // answer_start(text_), without reading a long reasoning again for every piece: once the text
  // is known to open with a <think> block, </think> is looked for only in what came since.
  if (answer_) return answer_;
  const std::size_t at = skip_space(text_, 0);
  const std::string_view head = std::string_view(text_).substr(at);
  if (!head.starts_with(kThinkStart)) {
    if (!head.empty() && !kThinkStart.starts_with(head)) answer_ = 0;  // no reasoning
    return std::size_t{0};
  }
  const std::size_t from = std::max(at + kThinkStart.size(), searched_ < kThinkEnd.size() ? 0 : searched_ - kThinkEnd.size());
  const std::size_t end = text_.find(kThinkEnd, from);
  searched_ = text_.size();
  if (end != std::string::npos) answer_ = end + kThinkEnd.size();
  return answer_;
}

std::string ToolCallStream::add(std::string_view piece) {
  text_ += piece;
  if (holding_) return {};
  // Reasoning goes out as it comes; a call may begin only after it.
  const std::optional<std::size_t> from = answer_from();
  std::size_t start = text_.size();
  const std::size_t look = from ? std::max(sent_, *from) : text_.size();
  if (from && format_ == CallFormat::kTagged) {
    start = look + tool_call_start(std::string_view(text_).substr(look));
    holding_ = std::string_view(text_).substr(start).starts_with(kCallOpen);
  } else if (from && !plain_) {
    // kJson: the answer is calls only when it opens with one, so its first characters decide:
    // held while they may still open a call (or a <think>), and all of it once they do.
    const std::string_view head = std::string_view(text_).substr(skip_space(text_, look));
    holding_ = head.starts_with('{') || head.starts_with(kPythonTag);
    plain_ = !holding_ && !kPythonTag.starts_with(head) && !kThinkStart.starts_with(head);
    if (!plain_) start = look;
  }
  std::string out = text_.substr(sent_, start - sent_);
  sent_ = start;
  return out;
}

}  // namespace batchlm::local_engine
