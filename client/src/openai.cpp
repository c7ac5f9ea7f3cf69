#include "batchlm/client/openai.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>

#include <boost/asio/use_awaitable.hpp>

namespace batchlm::client {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::size_t kMaxRawBodyInMessage = 500;
// What an error about an unexpected body quotes of it: enough to recognise an HTML page or a
// proxy's notice.
constexpr std::size_t kBodyStartInMessage = 100;

double ms_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i])))
      return false;
  }
  return true;
}

// A non-negative decimal number, possibly with a fraction ("1.5"); a leading '-' gives a
// negative value. Anything else (units, trailing text) is not a number.
std::optional<double> parse_number(std::string_view text) {
  text = trim(text);
  if (text.empty()) return std::nullopt;
  bool negative = false;
  if (text.front() == '-') {
    negative = true;
    text.remove_prefix(1);
  }
  double value = 0;
  bool digits = false;
  std::size_t i = 0;
  for (; i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])); ++i) {
    value = value * 10 + (text[i] - '0');
    digits = true;
  }
  if (i < text.size() && text[i] == '.') {
    double scale = 0.1;
    for (++i; i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])); ++i) {
      value += (text[i] - '0') * scale;
      scale /= 10;
      digits = true;
    }
  }
  if (!digits || i != text.size() || !std::isfinite(value)) return std::nullopt;
  return negative ? -value : value;
}

std::chrono::milliseconds clamp_ms(double ms) {
  if (ms <= 0) return std::chrono::milliseconds(0);
  // A day is already far beyond any sensible back-off; larger values are clamped rather
  // than overflowing.
  constexpr double kMax = 24.0 * 3600 * 1000;
  return std::chrono::milliseconds(static_cast<long long>(std::min(ms, kMax)));
}

int month_index(std::string_view name) {
  static constexpr std::string_view kMonths[] = {"jan", "feb", "mar", "apr", "may", "jun",
                                                 "jul", "aug", "sep", "oct", "nov", "dec"};
  for (int i = 0; i < 12; ++i) {
    if (iequals(name, kMonths[i])) return i + 1;
  }
  return 0;
}

std::optional<int> parse_int(std::string_view s) {
  int value = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return value;
}

// HTTP dates in the three forms RFC 9110 accepts: IMF-fixdate ("Sun, 06 Nov 1994 08:49:37
// GMT"), the obsolete RFC 850 form ("Sunday, 06-Nov-94 08:49:37 GMT") and asctime ("Sun Nov  6
// 08:49:37 1994").
std::optional<std::chrono::system_clock::time_point> parse_http_date(std::string_view text) {
  text = trim(text);
  std::vector<std::string_view> parts;
  std::size_t i = 0;
  while (i < text.size()) {
    while (i < text.size() && text[i] == ' ') ++i;
    std::size_t start = i;
    while (i < text.size() && text[i] != ' ') ++i;
    if (i > start) parts.push_back(text.substr(start, i - start));
  }
  std::optional<int> day, year;
  int month = 0;
  std::string_view clock;
  if (parts.size() == 6 && iequals(parts[5], "GMT")) {  // IMF-fixdate
    day = parse_int(parts[1]);
    month = month_index(parts[2]);
    year = parse_int(parts[3]);
    clock = parts[4];
  } else if (parts.size() == 4 && iequals(parts[3], "GMT")) {  // RFC 850
    std::string_view dmy = parts[1];
    if (dmy.size() != 9 || dmy[2] != '-' || dmy[6] != '-') return std::nullopt;
    day = parse_int(dmy.substr(0, 2));
    month = month_index(dmy.substr(3, 3));
    year = parse_int(dmy.substr(7, 2));
    // Two-digit years: a fixed pivot stands in for the RFC's "within 50 years of now".
    if (year) *year += *year < 70 ? 2000 : 1900;
    clock = parts[2];
  } else if (parts.size() == 5) {  // asctime
    month = month_index(parts[1]);
    day = parse_int(parts[2]);
    clock = parts[3];
    year = parse_int(parts[4]);
  } else {
    return std::nullopt;
  }
  if (!day || !year || month == 0 || clock.size() != 8 || clock[2] != ':' || clock[5] != ':')
    return std::nullopt;
  auto hour = parse_int(clock.substr(0, 2));
  auto minute = parse_int(clock.substr(3, 2));
  auto second = parse_int(clock.substr(6, 2));
  if (!hour || !minute || !second || *hour > 23 || *minute > 59 || *second > 60) return std::nullopt;
  const std::chrono::year_month_day date{std::chrono::year(*year),
                                         std::chrono::month(static_cast<unsigned>(month)),
                                         std::chrono::day(static_cast<unsigned>(*day))};
  if (!date.ok()) return std::nullopt;
  // The clock counts nanoseconds since 1970 in 64 bits, which ends in 2262: a date beyond it
  // overflows on the way in. Before 1970 means long past and after 2200 as late as can be,
  // which is all a retry hint needs of them (its wait is clamped to a day anyway).
  if (*year < 1970) return std::chrono::system_clock::time_point{};
  if (*year > 2200) return std::chrono::sys_days(std::chrono::year(2200) / 1 / 1);
  return std::chrono::sys_days(date) + std::chrono::hours(*hour) + std::chrono::minutes(*minute) +
         std::chrono::seconds(*second);
}

// A token count: a non-negative integer that fits, else nothing.
std::optional<std::int64_t> token_count(const nlohmann::json& object, const char* key) {
  auto it = object.find(key);
  if (it == object.end()) return std::nullopt;
  if (it->is_number_unsigned()) {
    const auto value = it->get<std::uint64_t>();
    if (value > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
    return static_cast<std::int64_t>(value);
  }
  if (it->is_number_integer() && it->get<std::int64_t>() >= 0) return it->get<std::int64_t>();
  return std::nullopt;
}

// Usage as the API reports it. `reported` stays false when the object is missing or null, and
// when either count is not a non-negative integer: the caller then estimates both, rather than
// summing and rate-limiting on a server's nonsense.
Usage usage_from(const nlohmann::json& body) {
  Usage usage;
  auto it = body.find("usage");
  if (it == body.end() || !it->is_object()) return usage;
  const auto prompt_tokens = token_count(*it, "prompt_tokens");
  const auto completion_tokens = token_count(*it, "completion_tokens");
  if (!prompt_tokens || !completion_tokens) return usage;
  usage.prompt_tokens = *prompt_tokens;
  usage.completion_tokens = *completion_tokens;
  usage.reported = true;
  return usage;
}

// The code and message of an API error object ({"message", "type", "code"}) or string. An
// empty message leaves the one the caller set: an error must say something.
void fill_from_error_object(const nlohmann::json& error_value, Error& error) {
  if (error_value.is_string()) {
    if (!error_value.get_ref<const std::string&>().empty()) error.message = error_value.get<std::string>();
    return;
  }
  if (!error_value.is_object()) return;
  if (auto m = error_value.find("message"); m != error_value.end() && m->is_string() && !m->get_ref<const std::string&>().empty())
    error.message = m->get<std::string>();
  if (auto c = error_value.find("code"); c != error_value.end()) {
    if (c->is_string()) error.code = c->get<std::string>();
    else if (c->is_number()) error.code = c->dump();
  }
  if (error.code.empty()) {
    if (auto t = error_value.find("type"); t != error_value.end() && t->is_string())
      error.code = t->get<std::string>();
  }
}

std::string truncated(std::string_view text) { return utf8_excerpt(text, kMaxRawBodyInMessage); }

Error make_error(ErrorKind kind, std::string message) {
  Error error;
  error.kind = kind;
  error.message = std::move(message);
  return error;
}

// The media type of a Content-Type value, lower-cased and without parameters.
std::string media_type(std::string_view content_type) {
  std::string type(trim(content_type.substr(0, content_type.find(';'))));
  std::transform(type.begin(), type.end(), type.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return type;
}

bool is_json_type(std::string_view content_type) {
  const std::string type = media_type(content_type);
  return type == "application/json" || type.ends_with("+json");
}

bool is_event_stream_type(std::string_view content_type) { return media_type(content_type) == "text/event-stream"; }

// A 2xx whose body is not what was asked for: the HTML page of a web UI or a captive proxy at
// the base URL. The message says what came instead, and how it starts (cut at a character).
Error unexpected_content(int status, std::string_view expected, std::string_view content_type, std::string_view body) {
  std::string message = "expected " + std::string(expected) + ", got " + std::string(trim(content_type));
  if (body.empty()) {
    message += " with an empty body";
  } else {
    message += ": " + utf8_excerpt(body, kBodyStartInMessage);
  }
  Error error = make_error(ErrorKind::Protocol, std::move(message));
  error.http_status = status;
  return error;
}

// Valid JSON where an object belongs.
Error not_an_object(const nlohmann::json& value, std::string_view text) {
  return make_error(ErrorKind::Protocol,
                    std::string("expected a JSON object, got ") + value.type_name() + ": " + truncated(text));
}

// A field of a chunk or answer that has the wrong JSON type, e.g. a number as delta.content.
Error wrong_type(std::string_view field, std::string_view expected, const nlohmann::json& value) {
  return make_error(ErrorKind::Protocol, "expected " + std::string(expected) + " as " + std::string(field) +
                                             ", got " + value.type_name() + ": " +
                                             truncated(value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)));
}

// What is wrong with a `tool_calls` value of an answer or a chunk (`field` names it): it must be
// a list of objects. nullopt when it is one.
std::optional<Error> tool_calls_problem(std::string_view field, const nlohmann::json& calls) {
  if (!calls.is_array()) return wrong_type(field, "a list of tool calls", calls);
  for (std::size_t i = 0; i < calls.size(); ++i)
    if (!calls[i].is_object())
      return wrong_type(std::string(field) + "[" + std::to_string(i) + "]", "an object", calls[i]);
  return std::nullopt;
}

// A streamed fragment of a tool call (or of a `function_call`) added to what came before it:
// the arguments arrive a few characters at a time and are appended; nested objects are merged
// key by key. An id, a name and a type come whole (a server may repeat them with every
// fragment, or send them empty): the first non-empty one is kept. `index` is not kept.
void merge_fragment(nlohmann::json& into, const nlohmann::json& fragment) {
  for (const auto& [key, value] : fragment.items()) {
    if (key == "index" || value.is_null()) continue;
    const bool whole = key == "id" || key == "name" || key == "type";
    if (whole && value.is_string() && value.get_ref<const std::string&>().empty()) continue;
    auto it = into.find(key);
    if (it == into.end() || it->is_null() || (it->is_string() && it->get_ref<const std::string&>().empty())) {
      into[key] = value;
    } else if (whole) {
      continue;
    } else if (it->is_string() && value.is_string()) {
      it->get_ref<std::string&>() += value.get_ref<const std::string&>();
    } else if (it->is_object() && value.is_object()) {
      merge_fragment(*it, value);
    } else {
      *it = value;
    }
  }
}

// A non-empty string field of `object` (`function.name` for "name"), or "".
std::string whole_field(const nlohmann::json& object, const char* key) {
  const nlohmann::json* at = &object;
  if (std::string_view(key) == "name") {
    const auto function = object.find("function");
    if (function == object.end() || !function->is_object()) return {};
    at = &*function;
  }
  const auto it = at->find(key);
  return it != at->end() && it->is_string() ? it->get<std::string>() : std::string();
}

// Calls as a record holds them: each with its type ("function" where the server gave none),
// without the stream's `index`.
void normalise_calls(nlohmann::json& calls) {
  for (auto& call : calls) {
    call.erase("index");
    if (whole_field(call, "type").empty()) call["type"] = "function";
  }
}

// Invalid UTF-8 sequences replaced by U+FFFD (EF BF BD): what a decoder shows for them.
std::string replace_invalid_utf8(std::string_view in) {
  return batchlm::replace_invalid_utf8(in, [](unsigned char) { return std::string("\xEF\xBF\xBD"); });
}

// A token's bytes from an entry's `bytes` (integers 0-255) when it has them, else its text.
std::optional<std::string> logprob_token(const nlohmann::json& entry) {
  if (auto b = entry.find("bytes"); b != entry.end() && b->is_array()) {
    std::string bytes;
    bool ok = true;
    for (const auto& v : *b) {
      ok = ok && v.is_number_integer() && v.get<long long>() >= 0 && v.get<long long>() <= 255;
      if (ok) bytes.push_back(static_cast<char>(v.get<int>()));
    }
    if (ok) return bytes;
  }
  if (auto t = entry.find("token"); t != entry.end() && t->is_string()) return t->get<std::string>();
  return std::nullopt;
}

// A token's text in the completions form, which has no `bytes`: a byte that is not part of a
// character is written \xNN (by batchlm serve, and after "bytes:" by OpenAI). Only bytes from
// 0x80 up are read back, the ones that can stand alone in no UTF-8 text.
std::string escaped_token_bytes(std::string_view text) {
  if (text.starts_with("bytes:\\x")) text.remove_prefix(6);
  std::string out;
  out.reserve(text.size());
  const auto hex = [](char h) {
    return h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
  };
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\\' && i + 3 < text.size() && text[i + 1] == 'x') {
      const int hi = hex(text[i + 2]), lo = hex(text[i + 3]);
      if (hi >= 8 && lo >= 0) {
        out.push_back(static_cast<char>(hi * 16 + lo));
        i += 3;
        continue;
      }
    }
    out.push_back(text[i]);
  }
  return out;
}

std::optional<double> logprob_value(const nlohmann::json& v) {
  if (v.is_number()) return v.get<double>();
  return std::nullopt;
}

// \uD800-\uDBFF not followed by \uDC00-\uDFFF, and \uDC00-\uDFFF alone, inside JSON strings,
// replaced by \uFFFD (escaped backslashes are left alone).
std::string replace_lone_surrogates(std::string_view in) {
  auto unit = [&](std::size_t at) -> int {  // the code unit of a \uXXXX at `at`, or -1
    if (at + 6 > in.size() || in[at] != '\\' || in[at + 1] != 'u') return -1;
    int v = 0;
    for (std::size_t k = at + 2; k < at + 6; ++k) {
      const char h = in[k];
      const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
      if (d < 0) return -1;
      v = v * 16 + d;
    }
    return v;
  };
  std::string out;
  out.reserve(in.size());
  bool in_string = false;
  for (std::size_t i = 0; i < in.size();) {
    const char c = in[i];
    if (!in_string) {
      in_string = c == '"';
      out.push_back(c);
      ++i;
      continue;
    }
    if (c == '"') {
      in_string = false;
      out.push_back(c);
      ++i;
      continue;
    }
    if (c != '\\' || i + 1 >= in.size()) {
      out.push_back(c);
      ++i;
      continue;
    }
    const int u = unit(i);
    if (u >= 0xD800 && u <= 0xDBFF) {
      const int next = unit(i + 6);
      if (next >= 0xDC00 && next <= 0xDFFF) {
        out.append(in.substr(i, 12));
        i += 12;
      } else {
        out.append("\\uFFFD");
        i += 6;
      }
    } else if (u >= 0xDC00 && u <= 0xDFFF) {
      out.append("\\uFFFD");
      i += 6;
    } else {
      out.append(in.substr(i, 2));  // any other escape, \\ included, is kept whole
      i += 2;
    }
  }
  return out;
}

}  // namespace

nlohmann::json parse_answer_json(std::string_view text) {
  auto value = nlohmann::json::parse(text, nullptr, false);
  if (!value.is_discarded()) return value;
  return nlohmann::json::parse(replace_lone_surrogates(replace_invalid_utf8(text)), nullptr, false);
}

nlohmann::ordered_json to_openai_body(const Request& request) {
  using Json = nlohmann::ordered_json;
  Json body = Json::object();
  if (!request.model.empty()) body["model"] = request.model;
  const bool extra = request.extra.is_object();
  if (request.prompt) {
    body["prompt"] = *request.prompt;
  } else if (!request.messages.empty() || !extra || !request.extra.contains("messages")) {
    Json messages = Json::array();
    for (const auto& m : request.messages) {
      Json message = {{"role", m.role}, {"content", m.content}};
      // An assistant turn that only called tools has no content: null, as the API writes it.
      if (m.calls_tools()) {
        if (m.content.empty()) message["content"] = nullptr;
        message["tool_calls"] = m.tool_calls;
      }
      if (!m.tool_call_id.empty()) message["tool_call_id"] = m.tool_call_id;
      if (!m.name.empty()) message["name"] = m.name;
      if (m.reasoning) message["reasoning_content"] = *m.reasoning;
      if (m.parts.is_array() && !m.parts.empty()) message["content"] = m.parts;
      if (m.fields.is_object())
        for (const auto& [key, value] : m.fields.items())
          if (!message.contains(key)) message[key] = value;
      messages.push_back(std::move(message));
    }
    body["messages"] = std::move(messages);
  }
  if (request.max_tokens) body["max_tokens"] = *request.max_tokens;
  if (request.temperature) body["temperature"] = *request.temperature;
  if (request.top_p) body["top_p"] = *request.top_p;
  if (!request.stop.empty()) body["stop"] = request.stop;
  if (request.seed) body["seed"] = *request.seed;
  body["stream"] = request.stream;
  // Pass-through fields after them, in the order given (a server that writes tools into a
  // prompt sees them as written); the typed fields above win over them.
  if (extra)
    for (const auto& [key, value] : request.extra.items())
      if (!body.contains(key)) body[key] = value;
  if (request.stream) {
    if (!body.contains("stream_options") || !body["stream_options"].is_object())
      body["stream_options"] = Json::object();
    body["stream_options"]["include_usage"] = true;
  } else {
    // The API rejects stream_options on a request that does not stream.
    body.erase("stream_options");
  }
  return body;
}

std::optional<std::chrono::milliseconds> parse_retry_after(const HttpResponse& response,
                                                           std::chrono::system_clock::time_point now) {
  if (const std::string* ms = response.header("retry-after-ms")) {
    if (auto value = parse_number(*ms)) return clamp_ms(*value);
  }
  if (const std::string* after = response.header("retry-after")) {
    if (auto seconds = parse_number(*after)) return clamp_ms(*seconds * 1000);
    if (auto date = parse_http_date(*after)) {
      return clamp_ms(std::chrono::duration<double, std::milli>(*date - now).count());
    }
  }
  return std::nullopt;
}

std::optional<bool> parse_should_retry(const HttpResponse& response) {
  const std::string* value = response.header("x-should-retry");
  if (value == nullptr) return std::nullopt;
  if (iequals(trim(*value), "true")) return true;
  if (iequals(trim(*value), "false")) return false;
  return std::nullopt;
}

// The title of an HTML page (a proxy's or a load balancer's error page: "502 Bad Gateway"),
// its white space collapsed; nothing where the body is no HTML page or has no title.
std::optional<std::string> html_title(std::string_view body) {
  body = trim(body);
  if (!body.starts_with('<')) return std::nullopt;
  std::string lower(body.substr(0, 4096));
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const std::size_t open = lower.find("<title>");
  if (open == std::string::npos) return std::nullopt;
  const std::size_t close = lower.find("</title>", open);
  if (close == std::string::npos) return std::nullopt;
  std::string title;
  for (const char c : body.substr(open + 7, close - open - 7)) {
    if (std::isspace(static_cast<unsigned char>(c))) {
      if (!title.empty() && title.back() != ' ') title += ' ';
    } else {
      title += c;
    }
  }
  if (!title.empty() && title.back() == ' ') title.pop_back();
  if (title.empty()) return std::nullopt;
  return utf8_excerpt(title, kBodyStartInMessage);
}

Error http_error(const HttpResponse& response) {
  Error error;
  error.kind = ErrorKind::Http;
  error.http_status = response.status;
  error.retry_after = parse_retry_after(response);
  error.should_retry = parse_should_retry(response);
  auto body = nlohmann::json::parse(response.body, nullptr, false);
  if (!body.is_discarded() && body.is_object()) {
    if (auto e = body.find("error"); e != body.end()) fill_from_error_object(*e, error);
    else if (auto m = body.find("message"); m != body.end() && m->is_string())
      error.message = m->get<std::string>();
  }
  const std::string* location = response.header("location");
  if (location != nullptr && response.status >= 300 && response.status < 400) {
    // A redirect the client does not follow (see HttpClient::perform): where it pointed is what
    // the user needs to fix the base URL.
    error.message = "HTTP " + std::to_string(response.status) + " redirect to " + truncated(*location) + ", not followed";
    // 307 and 308 are followed but to another origin with headers of the caller's own.
    if (response.status == 307 || response.status == 308)
      error.message += ": it leads to another host or port, and the API key and the backend's own headers go to "
                       "the base URL's only (set base_url to where it leads)";
  } else if (error.message.empty()) {
    // An HTML page is said by its title (what a gateway in front of the server has to say),
    // not its markup.
    if (const std::optional<std::string> title = html_title(response.body))
      error.message = *title + " (an HTML page)";
    else
      error.message = response.body.empty() ? "HTTP " + std::to_string(response.status) : truncated(response.body);
  }
  return error;
}

std::string endpoint_url(std::string_view base_url, bool text_prompt) {
  std::string_view query;
  if (const std::size_t q = base_url.find('?'); q != std::string_view::npos) {
    query = base_url.substr(q);
    base_url = base_url.substr(0, q);
  }
  while (base_url.ends_with('/')) base_url.remove_suffix(1);
  std::string url(base_url);
  url += text_prompt ? "/completions" : "/chat/completions";
  url += query;
  return url;
}

OpenAIBackend::OpenAIBackend(boost::asio::any_io_executor executor, OpenAIOptions options)
    : options_(std::move(options)), http_(std::move(executor), options_.http) {
  while (!options_.base_url.empty() && options_.base_url.back() == '/') options_.base_url.pop_back();
}

OpenAIBackend::~OpenAIBackend() = default;

std::string OpenAIBackend::describe() const { return "openai " + without_password(options_.base_url); }

std::optional<std::vector<TokenLogprob>> parse_logprobs(const nlohmann::json& value) {
  if (!value.is_object()) return std::nullopt;
  std::vector<TokenLogprob> out;
  if (auto content = value.find("content"); content != value.end()) {
    if (!content->is_array()) return std::nullopt;
    for (const auto& e : *content) {
      if (!e.is_object()) continue;
      const auto token = logprob_token(e);
      const auto lp = e.contains("logprob") ? logprob_value(e["logprob"]) : std::nullopt;
      if (!token || !lp) continue;
      TokenLogprob t{*token, *lp, {}};
      if (auto top = e.find("top_logprobs"); top != e.end() && top->is_array()) {
        for (const auto& a : *top) {
          if (!a.is_object()) continue;
          const auto alt = logprob_token(a);
          const auto alt_lp = a.contains("logprob") ? logprob_value(a["logprob"]) : std::nullopt;
          if (alt && alt_lp) t.top_logprobs.push_back({*alt, *alt_lp});
        }
      }
      out.push_back(std::move(t));
    }
    return out;
  }
  const auto tokens = value.find("tokens");
  const auto lps = value.find("token_logprobs");
  if (tokens == value.end() || lps == value.end() || !tokens->is_array() || !lps->is_array()) return std::nullopt;
  const auto top = value.find("top_logprobs");
  const bool has_top = top != value.end() && top->is_array();
  for (std::size_t i = 0; i < tokens->size() && i < lps->size(); ++i) {
    const auto lp = logprob_value((*lps)[i]);
    if (!(*tokens)[i].is_string() || !lp) continue;
    TokenLogprob t{escaped_token_bytes((*tokens)[i].get<std::string>()), *lp, {}};
    if (has_top && i < top->size() && (*top)[i].is_object()) {
      for (const auto& [alt, alt_lp] : (*top)[i].items())
        if (const auto v = logprob_value(alt_lp)) t.top_logprobs.push_back({escaped_token_bytes(alt), *v});
      // An object has no order: most likely first.
      std::stable_sort(t.top_logprobs.begin(), t.top_logprobs.end(),
                       [](const TopLogprob& a, const TopLogprob& b) { return a.logprob > b.logprob; });
    }
    out.push_back(std::move(t));
  }
  return out;
}

// The reasoning a message or a delta gives apart from its content: `reasoning_content` (DeepSeek's
// API, vLLM, SGLang, llama.cpp's server), else `reasoning` (later vLLM, OpenRouter); nullptr for
// none. Only text is read, and empty text is none; a server that sends both sends the same text
// twice, so the first is taken.
static const std::string* reasoning_of(const nlohmann::json& object) {
  for (const char* key : {"reasoning_content", "reasoning"})
    if (auto r = object.find(key); r != object.end() && r->is_string() && !r->get_ref<const std::string&>().empty())
      return &r->get_ref<const std::string&>();
  return nullptr;
}

Outcome answer_from_body(int status, std::string_view body_text, Timings timings, const TokenSink& sink) {
  auto body = parse_answer_json(body_text);
  if (body.is_discarded())
    return Outcome::failure(make_error(ErrorKind::Protocol, "malformed JSON body: " + truncated(body_text)), timings);
  if (!body.is_object()) return Outcome::failure(not_an_object(body, body_text), timings);
  if (auto e = body.find("error"); e != body.end() && !e->is_null()) {
    Error error = make_error(ErrorKind::StreamError, "error in response");
    error.http_status = status;
    fill_from_error_object(*e, error);
    return Outcome::failure(std::move(error), timings);
  }
  auto choices = body.find("choices");
  if (choices == body.end() || !choices->is_array() || choices->empty() || !(*choices)[0].is_object())
    return Outcome::failure(make_error(ErrorKind::Protocol, "response has no choices: " + truncated(body_text)), timings);
  const nlohmann::json& choice = (*choices)[0];
  Completion completion;
  // The text: message.content of a chat completion, text of a text completion. Null is no text
  // (a refusal, a tool call); another type is not an answer.
  const nlohmann::json* content = nullptr;
  std::string_view content_field = "text";
  if (auto message = choice.find("message"); message != choice.end() && !message->is_null()) {
    if (!message->is_object()) return Outcome::failure(wrong_type("message", "an object", *message), timings);
    if (auto c = message->find("content"); c != message->end()) content = &*c;
    content_field = "message.content";
    if (const std::string* reasoning = reasoning_of(*message)) completion.reasoning = *reasoning;
    if (auto calls = message->find("tool_calls"); calls != message->end() && !calls->is_null()) {
      if (auto problem = tool_calls_problem("message.tool_calls", *calls)) return Outcome::failure(std::move(*problem), timings);
      if (!calls->empty()) {
        completion.tool_calls = *calls;
        normalise_calls(completion.tool_calls);
      }
    }
    if (auto call = message->find("function_call"); call != message->end() && !call->is_null()) {
      if (!call->is_object()) return Outcome::failure(wrong_type("message.function_call", "an object", *call), timings);
      completion.function_call = *call;
    }
  } else if (auto text = choice.find("text"); text != choice.end()) {
    content = &*text;
  }
  if (content != nullptr && !content->is_null()) {
    if (!content->is_string()) return Outcome::failure(wrong_type(content_field, "a string", *content), timings);
    completion.text = content->get<std::string>();
  }
  if (auto reason = choice.find("finish_reason"); reason != choice.end() && !reason->is_null()) {
    if (!reason->is_string()) return Outcome::failure(wrong_type("finish_reason", "a string", *reason), timings);
    completion.finish_reason = reason->get<std::string>();
  }
  if (completion.finish_reason.empty())
    return Outcome::failure(make_error(ErrorKind::Protocol, "response has no finish reason: " + truncated(body_text)), timings);
  if (auto lp = choice.find("logprobs"); lp != choice.end()) completion.logprobs = parse_logprobs(*lp);
  completion.usage = usage_from(body);
  timings.ttft_ms = timings.total_ms;
  completion.timings = timings;
  if (sink) {
    try {
      if (!completion.reasoning.empty()) sink(completion.reasoning, {}, TextPart::kReasoning);
      if (!completion.text.empty() || (completion.logprobs && !completion.logprobs->empty()))
        sink(completion.text,
             completion.logprobs ? std::span<const TokenLogprob>(*completion.logprobs) : std::span<const TokenLogprob>(),
             TextPart::kContent);
    } catch (const std::exception& e) {
      return Outcome::failure(make_error(ErrorKind::Internal, std::string("token sink threw: ") + e.what()), timings);
    }
  }
  return Outcome::success(std::move(completion));
}

StreamedAnswer::StreamedAnswer(SseLimits limits, TokenSink sink) : parser_(limits), sink_(std::move(sink)) {}

bool StreamedAnswer::feed(std::string_view chunk) {
  if (!saw_event_) raw_.append(chunk);  // bounded by max_response_bytes
  // Enough for the message about a body that is not a stream, and one character more.
  if (head_.size() < kBodyStartInMessage + 4) head_.append(chunk.substr(0, kBodyStartInMessage + 4 - head_.size()));
  const auto status = parser_.feed(chunk, [&](const SseEvent& event) { on_event(event); });
  if (status == SseParser::Status::LineTooLong) {
    error_ = make_error(ErrorKind::TooLarge, "SSE line exceeds the size limit");
  } else if (status == SseParser::Status::EventTooLarge) {
    error_ = make_error(ErrorKind::TooLarge, "SSE event exceeds the size limit");
  }
  // Bytes after [DONE] are not read: the answer is complete.
  return !error_;
}

void StreamedAnswer::on_event(const SseEvent& event) {
  if (!saw_event_) {
    saw_event_ = true;
    std::string().swap(raw_);
  }
  if (done_ || error_) return;
  if (event.type == "error") {
    Error e = make_error(ErrorKind::StreamError, event.data.empty() ? "error event in stream" : truncated(event.data));
    if (auto body = parse_answer_json(event.data); !body.is_discarded()) {
      fill_from_error_object(body.is_object() && body.contains("error") ? body["error"] : body, e);
    }
    error_ = std::move(e);
    return;
  }
  if (trim(event.data) == "[DONE]") {
    done_ = true;
    return;
  }
  auto chunk = parse_answer_json(event.data);
  if (chunk.is_discarded()) {
    error_ = make_error(ErrorKind::Protocol, "malformed JSON in stream: " + truncated(event.data));
    return;
  }
  if (!chunk.is_object()) {
    error_ = not_an_object(chunk, event.data);
    return;
  }
  if (auto e = chunk.find("error"); e != chunk.end() && !e->is_null()) {
    Error stream_error = make_error(ErrorKind::StreamError, "error in stream");
    fill_from_error_object(*e, stream_error);
    error_ = std::move(stream_error);
    return;
  }
  // The first choice (index 0): a server asked for several (n > 1) interleaves their chunks.
  const nlohmann::json* first = nullptr;
  if (auto choices = chunk.find("choices"); choices != chunk.end() && choices->is_array()) {
    for (const auto& c : *choices) {
      if (!c.is_object()) continue;
      const auto index = c.find("index");
      if (index == c.end() || (index->is_number_integer() && index->get<long long>() == 0)) {
        first = &c;
        break;
      }
    }
  }
  // Once choice 0 has its finish reason, the answer is whole: what a server sends for that
  // choice afterwards (more text, a second finish reason) is not part of it. A usage chunk
  // still counts.
  if (first != nullptr && finish_reason_.empty()) {
    const nlohmann::json& choice = *first;
    choice_seen_ = true;
    // Chat chunks carry delta.content, text-completion chunks carry text. Null is no text (the
    // role chunk, a tool call); another type is not an answer, and neither is a delta that is
    // no object.
    const nlohmann::json* content = nullptr;
    const std::string* reasoning = nullptr;
    std::string_view content_field = "text";
    if (auto delta = choice.find("delta"); delta != choice.end() && !delta->is_null()) {
      if (!delta->is_object()) {
        error_ = wrong_type("delta", "an object", *delta);
        return;
      }
      if (auto c = delta->find("content"); c != delta->end()) content = &*c;
      content_field = "delta.content";
      reasoning = reasoning_of(*delta);
      if (!add_call_fragments(*delta)) return;
    } else if (auto t = choice.find("text"); t != choice.end()) {
      content = &*t;
    }
    if (content != nullptr && !content->is_null() && !content->is_string()) {
      error_ = wrong_type(content_field, "a string", *content);
      return;
    }
    const nlohmann::json* reason = nullptr;
    if (auto r = choice.find("finish_reason"); r != choice.end() && !r->is_null()) {
      if (!r->is_string()) {
        error_ = wrong_type("finish_reason", "a string", *r);
        return;
      }
      reason = &*r;
    }
    std::optional<std::vector<TokenLogprob>> logprobs;
    if (auto lp = choice.find("logprobs"); lp != choice.end()) logprobs = parse_logprobs(*lp);
    if (logprobs) {
      if (!logprobs_) logprobs_.emplace();
      logprobs_->insert(logprobs_->end(), logprobs->begin(), logprobs->end());
    }
    const std::string empty;
    const std::string& piece = content && content->is_string() ? content->get_ref<const std::string&>() : empty;
    if (reasoning != nullptr || !piece.empty()) note_delta();
    if (reasoning != nullptr) {
      reasoning_ += *reasoning;
      if (sink_) sink_(*reasoning, {}, TextPart::kReasoning);
    }
    text_ += piece;
    if (sink_ && (!piece.empty() || (logprobs && !logprobs->empty())))
      sink_(piece, logprobs ? std::span<const TokenLogprob>(*logprobs) : std::span<const TokenLogprob>(),
            TextPart::kContent);
    // An empty finish reason is read as null: the choice has not finished.
    if (reason != nullptr && !reason->get_ref<const std::string&>().empty())
      finish_reason_ = reason->get<std::string>();
  }
  if (Usage u = usage_from(chunk); u.reported) usage_ = u;
}

bool StreamedAnswer::add_call_fragments(const nlohmann::json& delta) {
  bool called = false;
  if (auto calls = delta.find("tool_calls"); calls != delta.end() && !calls->is_null()) {
    if (auto problem = tool_calls_problem("delta.tool_calls", *calls)) {
      error_ = std::move(*problem);
      return false;
    }
    for (const auto& fragment : *calls) {
      // Each fragment names its call by `index`; without one (as some servers send them), it
      // continues the last call. Either way, a fragment whose id or name differs from its
      // call's starts a call of its own: two calls are never joined into one.
      long long index = 0;
      if (auto i = fragment.find("index"); i != fragment.end() && !i->is_null()) {
        if (!i->is_number_integer() || i->get<long long>() < 0 || i->get<long long>() > kMaxToolCalls) {
          error_ = wrong_type("delta.tool_calls[].index", "an integer from 0 to " + std::to_string(kMaxToolCalls), *i);
          return false;
        }
        const auto slot = tool_call_slots_.find(i->get<long long>());
        index = slot != tool_call_slots_.end() ? slot->second : i->get<long long>();
      } else if (!tool_calls_.empty()) {
        index = last_tool_call_;
      }
      if (const auto at = tool_calls_.find(index); at != tool_calls_.end()) {
        const auto differs = [&](const char* key) {
          const std::string mine = whole_field(at->second, key), theirs = whole_field(fragment, key);
          return !mine.empty() && !theirs.empty() && mine != theirs;
        };
        if (differs("id") || differs("name")) {
          const long long fresh = std::max(tool_calls_.rbegin()->first + 1, kMaxToolCalls + 1);
          if (auto i = fragment.find("index"); i != fragment.end() && i->is_number_integer())
            tool_call_slots_[i->get<long long>()] = fresh;
          index = fresh;
        }
      }
      if (!tool_calls_.contains(index) && tool_calls_.size() >= static_cast<std::size_t>(kMaxToolCalls)) {
        error_ = make_error(ErrorKind::TooLarge, "more than " + std::to_string(kMaxToolCalls) + " tool calls in one answer");
        return false;
      }
      nlohmann::json& call = tool_calls_[index];
      if (call.is_null()) call = nlohmann::json::object();
      merge_fragment(call, fragment);
      last_tool_call_ = index;
      called = true;
    }
  }
  if (auto call = delta.find("function_call"); call != delta.end() && !call->is_null()) {
    if (!call->is_object()) {
      error_ = wrong_type("delta.function_call", "an object", *call);
      return false;
    }
    if (function_call_.is_null()) function_call_ = nlohmann::json::object();
    merge_fragment(function_call_, *call);
    called = true;
  }
  // A call's fragment is output as a piece of text is: it counts for the time to the first
  // token and the time per token.
  if (called) note_delta();
  return true;
}

void StreamedAnswer::note_delta() {
  const auto now = Clock::now();
  if (deltas_ == 0) first_delta_at_ = now;
  last_delta_at_ = now;
  ++deltas_;
}

Outcome StreamedAnswer::finish(const HttpResponse& response, Clock::time_point started) {
  Timings timings;
  timings.total_ms = ms_between(started, Clock::now());
  if (deltas_ > 0) {
    timings.ttft_ms = ms_between(started, first_delta_at_);
    if (deltas_ > 1)
      timings.tpot_ms = ms_between(first_delta_at_, last_delta_at_) / static_cast<double>(deltas_ - 1);
  }
  const bool success = response.status >= 200 && response.status < 300;
  const std::string* type = response.header("content-type");
  const bool cancelled = response.error && response.error->kind == ErrorKind::Cancelled;
  // A 2xx that is neither a stream nor a JSON answer (the HTML page of a web UI or a captive
  // proxy at the base URL): what came says more than whatever reading it as a stream gave. A
  // whole answer under another label (a server that says text/plain) is still an answer.
  if (success && !cancelled && finish_reason_.empty() && type != nullptr && !is_event_stream_type(*type) &&
      !is_json_type(*type)) {
    // Nor is a whole JSON answer under another label (a proxy that says text/plain of a server
    // that ignored "stream"): an object with choices, read as a JSON answer would be.
    if (!saw_event_ && !response.error && !error_) {
      const auto body = parse_answer_json(raw_);
      if (body.is_object() && body.contains("choices")) return answer_from_body(response.status, raw_, timings, sink_);
    }
    return Outcome::failure(unexpected_content(response.status, "text/event-stream", *type, head_), timings);
  }
  // The handler's own error explains an aborted transfer better than the transport does.
  if (error_) {
    Error error = std::move(*error_);
    error.http_status = response.status;
    return Outcome::failure(std::move(error), timings);
  }
  if (response.error) {
    // After [DONE] or choice 0's finish reason the answer is complete: a server that then resets
    // the connection, or keeps it open until the idle timeout, takes nothing from it (the usage
    // chunk may be missing; the caller then estimates).
    const bool transport = response.error->kind == ErrorKind::Connection || response.error->kind == ErrorKind::Timeout;
    if (!(transport && (done_ || !finish_reason_.empty()))) return Outcome::failure(*response.error, timings);
  }
  if (!success) return Outcome::failure(http_error(response), timings);
  if (!saw_event_ && type != nullptr && is_json_type(*type)) return answer_from_body(response.status, raw_, timings, sink_);
  if (finish_reason_.empty()) {
    // An answer is complete only with choice 0's finish reason: [DONE] alone may end a stream
    // that a gateway emptied when its upstream failed.
    Error error = !done_ ? make_error(ErrorKind::Truncated, "stream ended without [DONE] and without a finish reason")
                  : choice_seen_ ? make_error(ErrorKind::Protocol, "stream ended with [DONE] but without a finish reason")
                                 : make_error(ErrorKind::Protocol, "stream has no choices");
    error.http_status = response.status;
    return Outcome::failure(std::move(error), timings);
  }
  Completion completion;
  completion.text = std::move(text_);
  completion.reasoning = std::move(reasoning_);
  completion.finish_reason = std::move(finish_reason_);
  completion.usage = usage_;
  completion.logprobs = std::move(logprobs_);
  if (!tool_calls_.empty()) {
    completion.tool_calls = nlohmann::json::array();
    for (auto& [index, call] : tool_calls_) completion.tool_calls.push_back(std::move(call));
    normalise_calls(completion.tool_calls);
  }
  completion.function_call = std::move(function_call_);
  completion.timings = timings;
  return Outcome::success(std::move(completion));
}

boost::asio::awaitable<Outcome> OpenAIBackend::complete(const Request& request, TokenSink sink) {
  const auto started = Clock::now();
  HttpRequest http_request;
  http_request.url = endpoint_url(options_.base_url, request.prompt.has_value());
  http_request.timeouts = options_.timeouts;
  http_request.max_response_bytes = options_.max_response_bytes;
  // A header the job gives itself replaces ours of that name (an Authorization of its own in
  // place of the key's): sent twice, a server takes the first, or refuses both.
  const auto given = [&](std::string_view name) {
    return std::any_of(options_.extra_headers.begin(), options_.extra_headers.end(),
                       [&](const auto& header) { return iequals(header.first, name); });
  };
  if (!given("Content-Type")) http_request.headers.emplace_back("Content-Type", "application/json");
  if (!given("Accept")) http_request.headers.emplace_back("Accept", request.stream ? "text/event-stream" : "application/json");
  if (!options_.api_key.empty() && !given("Authorization"))
    http_request.headers.emplace_back("Authorization", "Bearer " + options_.api_key);
  for (const auto& header : options_.extra_headers) http_request.headers.push_back(header);
  http_request.same_origin_redirects = !options_.extra_headers.empty() || !options_.api_key.empty();
  try {
    // Invalid UTF-8 in a prompt makes dump() throw; replacing it keeps the request sendable.
    http_request.body = to_openai_body(request).dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  } catch (const std::exception& e) {
    co_return Outcome::failure(make_error(ErrorKind::Internal, std::string("cannot encode request: ") + e.what()));
  }

  auto timings_until = [&](Clock::time_point end) {
    Timings t;
    t.total_ms = ms_between(started, end);
    return t;
  };

  if (!request.stream) {
    HttpResponse response = co_await http_.perform(std::move(http_request));
    const auto finished = Clock::now();
    Timings timings = timings_until(finished);
    if (response.error) co_return Outcome::failure(std::move(*response.error), timings);
    if (response.status < 200 || response.status >= 300) co_return Outcome::failure(http_error(response), timings);
    Outcome outcome = answer_from_body(response.status, response.body, timings, sink);
    // Not an answer, and not labelled JSON either: say what came instead (an HTML page).
    if (const std::string* type = response.header("content-type");
        !outcome.ok() && outcome.error->kind == ErrorKind::Protocol && type != nullptr && !is_json_type(*type))
      co_return Outcome::failure(unexpected_content(response.status, "JSON", *type, response.body), timings);
    co_return outcome;
  }

  StreamedAnswer answer(options_.sse_limits, sink);
  http_request.answered = [&answer] { return answer.answered(); };
  HttpResponse response;
  try {
    response = co_await http_.perform(std::move(http_request), [&answer](std::string_view chunk) { return answer.feed(chunk); });
  } catch (const std::exception& e) {
    co_return Outcome::failure(make_error(ErrorKind::Internal, e.what()), timings_until(Clock::now()));
  }
  co_return answer.finish(response, started);
}

}  // namespace batchlm::client
