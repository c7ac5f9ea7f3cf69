#include "batchlm/core/types.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>

namespace batchlm {

std::string_view to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::Http: return "http";
    case ErrorKind::Timeout: return "timeout";
    case ErrorKind::Connection: return "connection";
    case ErrorKind::Protocol: return "protocol";
    case ErrorKind::Truncated: return "truncated";
    case ErrorKind::TooLarge: return "too_large";
    case ErrorKind::StreamError: return "stream_error";
    case ErrorKind::Cancelled: return "cancelled";
    case ErrorKind::Internal: return "internal";
  }
  return "internal";
}

nlohmann::json Error::to_json() const {
  nlohmann::json j = {{"kind", to_string(kind)}, {"message", message}};
  if (http_status != 0) j["status"] = http_status;
  if (!code.empty()) j["code"] = code;
  return j;
}

std::size_t utf8_char_length(std::string_view s, std::size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const std::size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
  if (len <= 1) return len;
  if (i + len > s.size()) return 0;
  std::uint32_t cp = c & (0x7Fu >> len);
  for (std::size_t k = 1; k < len; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b & 0x3Fu);
  }
  constexpr std::uint32_t kLeast[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kLeast[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return len;
}

std::size_t first_invalid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t len = utf8_char_length(s, i);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

std::string replace_invalid_utf8(std::string_view s, std::string (*replacement)(unsigned char byte)) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    if (const std::size_t len = utf8_char_length(s, i); len > 0) {
      out.append(s.substr(i, len));
      i += len;
    } else {
      out += replacement(static_cast<unsigned char>(s[i]));
      ++i;
    }
  }
  return out;
}

std::string logprob_token_text(std::string_view bytes) {
  return replace_invalid_utf8(bytes, [](unsigned char byte) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "\\x%02x", static_cast<unsigned>(byte));
    return std::string(hex);
  });
}

std::string utf8_excerpt(std::string_view text, std::size_t max) {
  if (text.size() <= max) return std::string(text);
  // Back over continuation bytes (10xxxxxx): a character has at most three.
  std::size_t end = max;
  while (end > 0 && max - end < 3 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return std::string(text.substr(0, end)) + "...";
}

std::string without_password(std::string_view url) {
  const std::size_t scheme = url.find("://");
  const std::size_t start = scheme == std::string_view::npos ? 0 : scheme + 3;
  // The authority ends at the first '/', '?' or '#'; its user information at its last '@'.
  const std::size_t end = std::min(url.find_first_of("/?#", start), url.size());
  const std::size_t at = url.substr(0, end).rfind('@');
  if (at == std::string_view::npos || at < start) return std::string(url);
  const std::size_t colon = url.substr(0, at).find(':', start);
  if (colon == std::string_view::npos) return std::string(url);
  return std::string(url.substr(0, colon + 1)) + "***" + std::string(url.substr(at));
}

namespace {

// The code point of one whole UTF-8 character of two to four bytes.
char32_t utf8_code_point(std::string_view c) {
  const auto b = [&](std::size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(c[k])); };
  if (c.size() == 2) return ((b(0) & 0x1f) << 6) | (b(1) & 0x3f);
  if (c.size() == 3) return ((b(0) & 0x0f) << 12) | ((b(1) & 0x3f) << 6) | (b(2) & 0x3f);
  return ((b(0) & 0x07) << 18) | ((b(1) & 0x3f) << 12) | ((b(2) & 0x3f) << 6) | (b(3) & 0x3f);
}

// Unicode's explicit direction marks, embeddings, overrides and isolates, and its line and
// paragraph separators.
bool is_direction_control(char32_t cp) {
  return cp == 0x061c || cp == 0x200e || cp == 0x200f || (cp >= 0x2028 && cp <= 0x202e) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

}  // namespace

std::string terminal_safe(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  const auto escape = [&](unsigned char byte) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "\\x%02x", static_cast<unsigned>(byte));
    out += hex;
  };
  for (std::size_t i = 0; i < text.size();) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const std::size_t n = utf8_char_length(text, i);
    if (n == 0 || (n == 1 && (byte < 0x20 || byte == 0x7f))) {
      escape(byte);
      ++i;
    } else if (n == 2 && byte == 0xc2 && static_cast<unsigned char>(text[i + 1]) < 0xa0) {  // U+0080-U+009F
      escape(byte);
      escape(static_cast<unsigned char>(text[i + 1]));
      i += 2;
    } else if (const char32_t cp = n >= 2 ? utf8_code_point(text.substr(i, n)) : 0; is_direction_control(cp)) {
      // Characters that reorder or break the text around them where a terminal applies the
      // bidirectional algorithm: a server's message must not reverse the line it is quoted in.
      char code[12];
      std::snprintf(code, sizeof code, "\\u%04x", static_cast<unsigned>(cp));
      out += code;
      i += n;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
  return out;
}

namespace {

nlohmann::json byte_values(std::string_view bytes) {
  nlohmann::json out = nlohmann::json::array();
  for (const char c : bytes) out.push_back(static_cast<unsigned>(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

nlohmann::json logprobs_json(std::span<const TokenLogprob> logprobs) {
  nlohmann::json out = nlohmann::json::array();
  for (const TokenLogprob& t : logprobs) {
    nlohmann::json top = nlohmann::json::array();
    for (const TopLogprob& alt : t.top_logprobs)
      top.push_back({{"token", logprob_token_text(alt.token)}, {"logprob", alt.logprob}, {"bytes", byte_values(alt.token)}});
    out.push_back({{"token", logprob_token_text(t.token)},
                   {"logprob", t.logprob},
                   {"bytes", byte_values(t.token)},
                   {"top_logprobs", std::move(top)}});
  }
  return out;
}

std::optional<std::pair<std::string, std::string>> read_tool_fields(const nlohmann::json& m, ChatMessage& message) {
  using Problem = std::pair<std::string, std::string>;
  const auto type_of = [](const nlohmann::json& v) { return std::string(v.type_name()); };
  if (auto call = m.find("function_call"); call != m.end() && !call->is_null())
    return Problem{".function_call", "the older single call is not sent; give it as tool_calls: [{id, type: function, "
                                     "function: {name, arguments}}]"};
  if (auto id = m.find("tool_call_id"); id != m.end() && !id->is_null()) {
    if (!id->is_string()) return Problem{".tool_call_id", "expected a string, got " + type_of(*id)};
    if (message.role != "tool")
      return Problem{".tool_call_id", "only a tool message answers a call (this one's role is " + message.role + ")"};
    message.tool_call_id = id->get<std::string>();
  }
  if (message.role == "tool" && message.tool_call_id.empty())
    return Problem{".tool_call_id", "required: the id of the call this tool message answers"};
  if (auto name = m.find("name"); name != m.end() && !name->is_null()) {
    if (!name->is_string()) return Problem{".name", "expected a string, got " + type_of(*name)};
    message.name = name->get<std::string>();
  }
  if (auto reasoning = m.find("reasoning_content"); reasoning != m.end() && !reasoning->is_null()) {
    if (!reasoning->is_string()) return Problem{".reasoning_content", "expected a string, got " + type_of(*reasoning)};
    if (message.role != "assistant")
      return Problem{".reasoning_content", "only an assistant message has reasoning (this one's role is " + message.role + ")"};
    message.reasoning = reasoning->get<std::string>();
  }
  auto calls = m.find("tool_calls");
  if (calls == m.end() || calls->is_null()) return std::nullopt;
  if (!calls->is_array()) return Problem{".tool_calls", "expected a list of {id, type, function}, got " + type_of(*calls)};
  if (calls->empty()) return std::nullopt;
  if (message.role != "assistant")
    return Problem{".tool_calls", "only an assistant message calls tools (this one's role is " + message.role + ")"};
  for (std::size_t i = 0; i < calls->size(); ++i) {
    const nlohmann::json& call = (*calls)[i];
    const std::string at = ".tool_calls[" + std::to_string(i) + "]";
    if (!call.is_object()) return Problem{at, "expected {id, type, function}, got " + type_of(call)};
    const auto id = call.find("id");
    if (id == call.end() || !id->is_string() || id->get_ref<const std::string&>().empty())
      return Problem{at + ".id", "required: a non-empty string (the id a tool message answers with tool_call_id)"};
    if (auto type = call.find("type"); type != call.end() && *type != "function")
      return Problem{at + ".type", "expected \"function\", got " + type->dump()};
    const auto function = call.find("function");
    if (function == call.end() || !function->is_object())
      return Problem{at + ".function", "required: {name, arguments}"};
    const auto name = function->find("name");
    if (name == function->end() || !name->is_string() || name->get_ref<const std::string&>().empty())
      return Problem{at + ".function.name", "required: a non-empty string"};
    const auto arguments = function->find("arguments");
    if (arguments == function->end() || !arguments->is_string())
      return Problem{at + ".function.arguments",
                     "required: a string, the arguments as JSON text (e.g. '{\"city\": \"Paris\"}'), not " +
                         (arguments == function->end() ? std::string("nothing") : type_of(*arguments))};
  }
  message.tool_calls = *calls;
  return std::nullopt;
}

std::optional<std::pair<std::size_t, std::string>> unanswered_tool_message(std::span<const ChatMessage> messages) {
  std::vector<std::string> called;
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.calls_tools())
      for (const auto& call : m.tool_calls)
        if (auto id = call.find("id"); id != call.end() && id->is_string()) called.push_back(id->get<std::string>());
    if (m.role == "tool" && std::find(called.begin(), called.end(), m.tool_call_id) == called.end())
      return std::make_pair(i, "answers the call '" + m.tool_call_id + "', which no earlier assistant message made");
  }
  return std::nullopt;
}

namespace {
std::size_t json_bytes(const nlohmann::json& value) {
  return value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).size();
}
}  // namespace

std::size_t ChatMessage::text_bytes() const {
  return content.size() + (reasoning ? reasoning->size() : 0) + (calls_tools() ? json_bytes(tool_calls) : 0);
}

std::size_t Request::text_bytes() const {
  std::size_t bytes = prompt ? prompt->size() : 0;
  for (const ChatMessage& m : messages) bytes += m.text_bytes();
  // The tools a template lists go into the prompt too.
  if (extra.is_object())
    if (const auto tools = extra.find("tools"); tools != extra.end() && tools->is_array()) bytes += json_bytes(*tools);
  return bytes;
}

double EngineStats::cache_hit_rate() const {
  const std::int64_t total = prompt_tokens_computed + prompt_tokens_cached;
  return total > 0 ? static_cast<double>(prompt_tokens_cached) / static_cast<double>(total) : 0.0;
}

double EngineStats::acceptance_rate() const {
  return drafted_tokens > 0 ? static_cast<double>(accepted_tokens) / static_cast<double>(drafted_tokens)
                            : 0.0;
}

double EngineStats::tokens_per_pass() const {
  return decode_passes > 0
             ? static_cast<double>(decode_passes + accepted_tokens) / static_cast<double>(decode_passes)
             : 0.0;
}

double EngineStats::draft_time_share() const { return step_ms > 0 ? draft_ms / step_ms : 0.0; }

std::string EngineStats::brief() const {
  auto percent = [](double x) { return std::to_string(static_cast<int>(x * 100.0 + 0.5)) + "%"; };
  std::string s = std::to_string(running) + " run " + std::to_string(waiting) + " wait";
  if (preemptions > 0) s.append(" ").append(std::to_string(preemptions)).append(" preempted");  // not " " + ...: GCC 12's -Wrestrict false alarm
  s += " cache " + percent(cache_hit_rate());
  if (blocks_total > 0)
    s += " kv " + percent(static_cast<double>(blocks_used) / static_cast<double>(blocks_total));
  if (!speculative.empty() && drafted_tokens > 0) {
    char pass[16];
    std::snprintf(pass, sizeof pass, "%.1f", tokens_per_pass());
    s += " spec " + percent(acceptance_rate()) + " x" + pass;
  }
  return s;
}

nlohmann::json EngineStats::to_json() const {
  nlohmann::json j = {{"running", running},
          {"waiting", waiting},
          {"preemptions", preemptions},
          {"prompt_tokens_computed", prompt_tokens_computed},
          {"prompt_tokens_cached", prompt_tokens_cached},
          {"recomputed_tokens", recomputed_tokens},
          {"cache_hit_rate", cache_hit_rate()},
          {"generated_tokens", generated_tokens},
          {"steps", steps},
          {"blocks_used", blocks_used},
          {"blocks_total", blocks_total},
          {"block_size", block_size}};
  if (!speculative.empty()) {
    j["speculative"] = {{"method", speculative},
                        {"drafted_tokens", drafted_tokens},
                        {"accepted_tokens", accepted_tokens},
                        {"acceptance_rate", acceptance_rate()},
                        {"decode_passes", decode_passes},
                        {"tokens_per_pass", tokens_per_pass()},
                        {"draft_time_share", draft_time_share()}};
  }
  return j;
}

}  // namespace batchlm
