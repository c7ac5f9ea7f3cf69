#include "batchlm/server/openai_api.hpp"

#include <cmath>
#include <limits>
#include <optional>
#include <random>

#include "batchlm/core/engine_fields.hpp"
#include "batchlm/core/json_check.hpp"
#include "batchlm/core/json_schema.hpp"

namespace batchlm::server {

using nlohmann::json;
// A request body is read with its keys in order: the tools go into the prompt as written.
using Body = nlohmann::ordered_json;

ApiError::ApiError(int status, std::string type, std::string param, std::string message,
                   std::string code)
    : std::runtime_error(message),
      status_(status),
      type_(std::move(type)),
      param_(std::move(param)),
      code_(std::move(code)),
      message_(std::move(message)) {}

json ApiError::body() const {
  return {{"error",
           {{"message", message_},
            {"type", type_},
            {"param", param_.empty() ? json(nullptr) : json(param_)},
            {"code", code_.empty() ? json(nullptr) : json(code_)}}}};
}

namespace {

[[noreturn]] void invalid(const std::string& param, const std::string& message) {
  throw ApiError(400, "invalid_request_error", param, message);
}

[[noreturn]] void unsupported(const std::string& param, const std::string& what) {
  throw ApiError(400, "invalid_request_error", param,
                 what + " is not supported by this server", "unsupported_parameter");
}

std::string type_name(const Body& v) {
  switch (v.type()) {
    case Body::value_t::null: return "null";
    case Body::value_t::boolean: return "a boolean";
    case Body::value_t::string: return "a string";
    case Body::value_t::array: return "an array";
    case Body::value_t::object: return "an object";
    case Body::value_t::number_float: return "a number";
    case Body::value_t::number_integer:
    case Body::value_t::number_unsigned: return "an integer";
    default: return "an unknown value";
  }
}

// A string from the request as an error message quotes it: at most 64 bytes, cut at a
// character boundary (the message must stay valid UTF-8 to be sent as JSON).
std::string excerpt(std::string_view text) { return utf8_excerpt(text, 64); }

// A value as an error message names it: its type, and a scalar's value ("a string (\"64\")");
// arrays and objects by their type alone.
std::string described(const Body& v) {
  if (v.is_array() || v.is_object()) return type_name(v);
  if (v.is_string()) return type_name(v) + " (" + Body(excerpt(v.get_ref<const std::string&>())).dump() + ")";
  return type_name(v) + " (" + v.dump() + ")";
}

// The field when present and not null.
const Body* field(const Body& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::int64_t integer(const Body& v, const std::string& param, std::int64_t min, std::int64_t max) {
  std::int64_t value = 0;
  if (v.is_number_unsigned()) {  // before is_number_integer(), which is true for these too
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      invalid(param, "'" + param + "' must be between " + std::to_string(min) + " and " +
                         std::to_string(max) + ", not " + v.dump());
    }
    value = static_cast<std::int64_t>(u);
  } else if (v.is_number_integer()) {
    value = v.get<std::int64_t>();
  } else if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() &&
             std::abs(v.get<double>()) < 9e15) {
    value = static_cast<std::int64_t>(v.get<double>());
  } else if (v.is_number_float() && std::isfinite(v.get<double>()) && std::floor(v.get<double>()) == v.get<double>()) {
    // A whole number too large to be taken exactly from its double (1e20, or 2^64 written out).
    const double d = v.get<double>();
    // (2^63 itself is out of range, though it is what INT64_MAX becomes as a double.)
    if (d < static_cast<double>(min) || d > static_cast<double>(max) || d >= 0x1p63)
      invalid(param, "'" + param + "' must be between " + std::to_string(min) + " and " + std::to_string(max) +
                         ", not " + v.dump());
    invalid(param, "'" + param + "' must be written as an integer (digits only) when it is this large, not " +
                       v.dump());
  } else {
    invalid(param, "'" + param + "' must be an integer, not " + described(v));
  }
  if (value < min || value > max) {
    invalid(param, "'" + param + "' must be between " + std::to_string(min) + " and " +
                       std::to_string(max) + ", not " + v.dump());
  }
  return value;
}

double number(const Body& v, const std::string& param, double min, double max) {
  if (!v.is_number()) invalid(param, "'" + param + "' must be a number, not " + type_name(v));
  const double x = v.get<double>();
  if (!(x >= min) || !(x <= max))
    invalid(param, "'" + param + "' must be between " + Body(min).dump() + " and " + Body(max).dump() + ", not " + v.dump());
  return x;
}

bool boolean(const Body& v, const std::string& param) {
  if (!v.is_boolean()) invalid(param, "'" + param + "' must be a boolean, not " + type_name(v));
  return v.get<bool>();
}

// Chat message content: a string, or an array of text parts {"type": "text", "text": ...},
// joined with a line break between them, as vLLM and llama.cpp's server join them.
std::string content_text(const Body& v, const std::string& param) {
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array()) invalid(param, "'" + param + "' must be a string or an array of text parts, not " + type_name(v));
  if (v.empty()) invalid(param, "'" + param + "' must not be an empty array: give at least one text part, or a string");
  std::string text;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const std::string part = param + "[" + std::to_string(i) + "]";
    const Body& p = v[i];
    if (!p.is_object()) invalid(part, "'" + part + "' must be an object, not " + type_name(p));
    const Body* type = field(p, "type");
    if (!type || !type->is_string()) invalid(part + ".type", "'" + part + ".type' is required");
    if (type->get<std::string>() != "text") unsupported(part + ".type", "content of type '" + excerpt(type->get<std::string>()) + "'");
    const Body* t = field(p, "text");
    if (!t || !t->is_string()) invalid(part + ".text", "'" + part + ".text' must be a string");
    if (i > 0) text += '\n';
    text += t->get<std::string>();
  }
  return text;
}

std::vector<ChatMessage> read_messages(const Body& body) {
  const Body* messages = field(body, "messages");
  if (!messages) invalid("messages", "'messages' is required");
  if (!messages->is_array()) invalid("messages", "'messages' must be an array, not " + type_name(*messages));
  if (messages->empty()) invalid("messages", "'messages' must not be empty");
  std::vector<ChatMessage> out;
  for (std::size_t i = 0; i < messages->size(); ++i) {
    const std::string param = "messages[" + std::to_string(i) + "]";
    const Body& m = (*messages)[i];
    if (!m.is_object()) invalid(param, "'" + param + "' must be an object, not " + type_name(m));
    const Body* role = field(m, "role");
    if (!role || !role->is_string()) invalid(param + ".role", "'" + param + ".role' is required and must be a string");
    std::string r = role->get<std::string>();
    if (r == "developer") r = "system";
    if (r != "system" && r != "user" && r != "assistant" && r != "tool") {
      if (r == "function") unsupported(param + ".role", "the role 'function' (give results as 'tool' messages)");
      invalid(param + ".role", "'" + param + ".role' must be one of system, developer, user, assistant, tool, not '" +
                                   excerpt(role->get<std::string>()) + "'");
    }
    if (field(m, "function_call")) unsupported(param + ".function_call", "function calling (give calls as 'tool_calls')");
    const Body* content = field(m, "content");
    std::string text;
    if (content) {
      text = content_text(*content, param + ".content");
    } else if (r != "assistant") {
      invalid(param + ".content", "'" + param + ".content' is required");
    }
    ChatMessage message{std::move(r), std::move(text)};
    // An assistant's calls, a tool message's call id, a name: held to the API's form.
    if (auto problem = read_tool_fields(m, message))
      invalid(param + problem->first, "'" + param + problem->first + "': " + problem->second);
    out.push_back(std::move(message));
  }
  if (auto problem = unanswered_tool_message(out)) {
    const std::string param = "messages[" + std::to_string(problem->first) + "].tool_call_id";
    invalid(param, "'" + param + "' " + problem->second);
  }
  return out;
}

std::string read_prompt(const Body& body) {
  const Body* prompt = field(body, "prompt");
  if (!prompt) invalid("prompt", "'prompt' is required");
  if (prompt->is_string()) return prompt->get<std::string>();
  if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) return (*prompt)[0].get<std::string>();
  if (prompt->is_array() && !prompt->empty() && ((*prompt)[0].is_number() || (*prompt)[0].is_array()))
    unsupported("prompt", (*prompt)[0].is_number() ? "a prompt of token ids" : "a list of prompts of token ids");
  if (prompt->is_array() && prompt->size() > 1) unsupported("prompt", "more than one prompt per request");
  if (prompt->is_array() && prompt->empty()) invalid("prompt", "'prompt' is an empty array: give a string");
  if (prompt->is_array())
    invalid("prompt[0]", "'prompt[0]' must be a string, not " + type_name((*prompt)[0]));
  invalid("prompt", "'prompt' must be a string, not " + type_name(*prompt));
}

std::vector<std::string> read_stop(const Body& v) {
  constexpr std::size_t kMaxStops = 16;
  if (v.is_string()) {
    if (v.get<std::string>().empty()) return {};
    return {v.get<std::string>()};
  }
  if (!v.is_array()) invalid("stop", "'stop' must be a string or an array of strings, not " + type_name(v));
  if (v.size() > kMaxStops) invalid("stop", "'stop' has " + std::to_string(v.size()) + " strings; at most 16 are allowed");
  std::vector<std::string> out;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const std::string param = "stop[" + std::to_string(i) + "]";
    if (!v[i].is_string()) invalid(param, "'" + param + "' must be a string, not " + type_name(v[i]));
    if (!v[i].get<std::string>().empty()) out.push_back(v[i].get<std::string>());
  }
  return out;
}

}  // namespace

ApiRequest parse_request(Endpoint endpoint, const Body& body, std::string_view served_model) {
  if (!body.is_object()) invalid("", "the request body must be a JSON object, not " + type_name(body));
  ApiRequest out;
  out.endpoint = endpoint;
  Request& r = out.request;
  const bool chat = endpoint == Endpoint::kChat;

  if (const Body* model = field(body, "model")) {
    if (!model->is_string()) invalid("model", "'model' must be a string, not " + type_name(*model));
    r.model = model->get<std::string>();
    if (!r.model.empty() && r.model != served_model) {
      throw ApiError(404, "invalid_request_error", "model",
                     "the model '" + excerpt(r.model) + "' does not exist; this server serves '" +
                         std::string(served_model) + "'",
                     "model_not_found");
    }
  }
  if (chat) {
    r.messages = read_messages(body);
  } else {
    r.prompt = read_prompt(body);
  }

  // Chat: max_completion_tokens is the current name, max_tokens the older one. The completions
  // API has only max_tokens; a limit under the chat name is refused there rather than passed
  // over for the default of 16.
  if (!chat && field(body, "max_completion_tokens"))
    invalid("max_completion_tokens",
            "'max_completion_tokens' is a chat completions field; the completions API's limit is 'max_tokens'");
  const Body* max_tokens = chat ? field(body, "max_completion_tokens") : nullptr;
  std::string max_param = "max_completion_tokens";
  if (!max_tokens) {
    max_tokens = field(body, "max_tokens");
    max_param = "max_tokens";
  }
  if (max_tokens) {
    r.max_tokens = static_cast<int>(integer(*max_tokens, max_param, 1, std::numeric_limits<int>::max()));
    r.max_tokens_exact = true;  // as OpenAI: a limit the context cannot hold is refused
    out.max_tokens_param = max_param;
  } else if (!chat) {
    r.max_tokens = 16;  // the completions API's default
  }
  if (const Body* t = field(body, "temperature")) r.temperature = number(*t, "temperature", 0.0, 2.0);
  if (const Body* p = field(body, "top_p")) r.top_p = number(*p, "top_p", 0.0, 1.0);
  if (const Body* k = field(body, "top_k")) {
    r.extra = Body::object();
    r.extra["top_k"] = integer(*k, "top_k", -1, std::numeric_limits<int>::max());
    if (r.extra["top_k"].get<std::int64_t>() < 0) r.extra["top_k"] = 0;  // -1: no limit
  }
  if (const Body* seed = field(body, "seed")) {
    r.seed = integer(*seed, "seed", std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max());
    if (*r.seed == -1) r.seed.reset();  // llama.cpp's server reads -1 as "a random seed"; so does this one
  }
  if (const Body* stop = field(body, "stop")) r.stop = read_stop(*stop);
  if (const Body* n = field(body, "n")) out.n = static_cast<int>(integer(*n, "n", 1, kMaxChoices));
  if (const Body* s = field(body, "stream")) out.stream = boolean(*s, "stream");
  if (const Body* so = field(body, "stream_options")) {
    if (!so->is_object()) invalid("stream_options", "'stream_options' must be an object, not " + type_name(*so));
    if (!out.stream) invalid("stream_options", "'stream_options' is only allowed when 'stream' is true");
    if (const Body* u = field(*so, "include_usage")) out.include_usage = boolean(*u, "stream_options.include_usage");
  }
  r.stream = out.stream;

  for (const char* name : {"presence_penalty", "frequency_penalty"}) {
    if (const Body* v = field(body, name)) {
      if (const double penalty = number(*v, name, -2.0, 2.0); penalty != 0.0) r.extra[name] = penalty;
    }
  }

  if (const Body* v = field(body, "logit_bias")) {
    if (!v->is_object()) invalid("logit_bias", "'logit_bias' must be an object, not " + type_name(*v));
    if (const auto problem = engine_field_problem("logit_bias", *v)) invalid("logit_bias", "'logit_bias' " + *problem);
    if (!v->empty()) r.extra["logit_bias"] = *v;
  }
  // Log-probabilities: the chat API asks with logprobs: true and top_logprobs: N, the
  // completions API with logprobs: N.
  if (chat) {
    const Body* lp = field(body, "logprobs");
    const bool on = lp && boolean(*lp, "logprobs");
    if (const Body* top = field(body, "top_logprobs")) {
      const std::int64_t n = integer(*top, "top_logprobs", 0, kMaxTopLogprobs);
      if (n > 0 && !on) invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true");
      if (on) r.extra["top_logprobs"] = n;
    }
    if (on) {
      r.extra["logprobs"] = true;
      out.logprobs = true;
    }
  } else {
    if (const Body* lp = field(body, "logprobs")) {
      r.extra["logprobs"] = integer(*lp, "logprobs", 0, kMaxTopLogprobs);
      out.logprobs = true;
    }
    if (const Body* top = field(body, "top_logprobs"); top && !(top->is_number() && top->get<double>() == 0))
      invalid("top_logprobs", "'top_logprobs' is a chat completions parameter; text completions take 'logprobs': N");
  }
  // Tools: shown to the model where its chat template lists them (the engine refuses them
  // otherwise); the choices it cannot honour are refused here.
  // The engine's reason, less its advice to a job (to use an API instead): unsupported where
  // the engine cannot do it, else invalid.
  const auto refuse = [](const std::string& key, const std::string& problem) {
    const std::string why = problem.substr(0, problem.find("; remove it"));
    if (!why.starts_with("the embedded engine")) invalid(key, "'" + key + "': " + why);
    throw ApiError(400, "invalid_request_error", key, "'" + key + "': " + why, "unsupported_parameter");
  };
  for (const char* key : {"tools", "tool_choice", "parallel_tool_calls"}) {
    const Body* v = field(body, key);
    if (!v) continue;
    if (!chat) invalid(key, std::string("'") + key + "' is a chat completions parameter");
    if (const auto problem = engine_field_problem(key, *v)) refuse(key, *problem);
    if (!r.extra.is_object()) r.extra = Body::object();
    r.extra[key] = *v;
  }
  if (const auto problem = tool_choice_problem(r.extra)) refuse(problem->first, problem->second);
  // The template's thinking switch (Qwen 3's enable_thinking); other template variables would
  // go unread. A text completion has no template, and ignores them as other servers do.
  if (const Body* v = field(body, "chat_template_kwargs"); v && chat) {
    if (const auto problem = engine_field_problem("chat_template_kwargs", *v)) refuse("chat_template_kwargs", *problem);
    if (!r.extra.is_object()) r.extra = Body::object();
    r.extra["chat_template_kwargs"] = *v;
  }
  if (const Body* v = field(body, "functions"); v && !(v->is_array() && v->empty()))
    unsupported("functions", "'functions' (give them as 'tools')");
  if (chat) {
    // Output in other modalities than text (audio) is not something the engine can produce.
    if (const Body* v = field(body, "modalities")) {
      if (!v->is_array()) invalid("modalities", "'modalities' must be an array of strings, not " + type_name(*v));
      for (std::size_t i = 0; i < v->size(); ++i) {
        const Body& m = (*v)[i];
        if (!m.is_string())
          invalid("modalities", "'modalities[" + std::to_string(i) + "]' must be a string, not " + type_name(m));
        if (m.get<std::string>() != "text")
          unsupported("modalities", "the output modality '" + excerpt(m.get<std::string>()) + "'");
      }
    }
    if (field(body, "audio")) unsupported("audio", "audio output");
  }
  if (const Body* v = field(body, "response_format")) {
    const Body* type = v->is_object() ? field(*v, "type") : nullptr;
    if (!type || !type->is_string()) invalid("response_format", "'response_format' must be an object with a 'type'");
    if (type->get<std::string>() == "json_object") {
      r.extra["response_format"] = {{"type", "json_object"}};
    } else if (type->get<std::string>() == "json_schema") {
      const Body* spec = field(*v, "json_schema");
      const Body* schema = spec && spec->is_object() ? field(*spec, "schema") : nullptr;
      if (!schema) invalid("response_format", "'response_format' of type json_schema needs 'json_schema': {'name': ..., 'schema': {...}}");
      try {
        (void)compile_json_schema(*schema);
      } catch (const SchemaError& e) {
        invalid("response_format", std::string("'response_format.json_schema.schema' ") + e.what());
      }
      r.extra["response_format"] = {{"type", "json_schema"}, {"json_schema", {{"schema", *schema}}}};
    } else if (type->get<std::string>() != "text") {
      unsupported("response_format", "response_format '" + excerpt(type->get<std::string>()) + "'");
    }
  }
  // vLLM's and llama.cpp's extensions: ignore_eos, min_p, repetition_penalty, min_tokens, stop_token_ids and
  // bad_words are honoured; the sampling controls the engine does not have are refused, not silently ignored, unless set to what
  // does nothing.
  if (const Body* v = field(body, "ignore_eos"); v && boolean(*v, "ignore_eos")) r.extra["ignore_eos"] = true;
  if (const Body* v = field(body, "min_p")) {
    if (const double min_p = number(*v, "min_p", 0.0, 1.0); min_p > 0.0) r.extra["min_p"] = min_p;
  }
  if (const Body* v = field(body, "repetition_penalty")) {
    const double penalty = number(*v, "repetition_penalty", 0.0, kMaxRepetitionPenalty);
    if (penalty == 0.0) invalid("repetition_penalty", "'repetition_penalty' must be above 0 (1: none), not 0");
    if (penalty != 1.0) r.extra["repetition_penalty"] = penalty;
  }
  if (const Body* v = field(body, "min_tokens")) {
    if (const std::int64_t least = integer(*v, "min_tokens", 0, static_cast<std::int64_t>(kMaxMinTokens)); least > 0)
      r.extra["min_tokens"] = least;
  }
  if (const Body* v = field(body, "stop_token_ids")) {
    if (!v->is_array()) invalid("stop_token_ids", "'stop_token_ids' must be an array of token ids, not " + type_name(*v));
    if (const auto problem = engine_field_problem("stop_token_ids", *v))
      invalid("stop_token_ids", "'stop_token_ids' " + *problem);
    if (!v->empty()) r.extra["stop_token_ids"] = *v;
  }
  const auto neutral = [&](const char* key, double none) {
    if (const Body* v = field(body, key); v && !(v->is_number() && v->get<double>() == none))
      unsupported(key, std::string("'") + key + "'");
  };
  neutral("typical_p", 1.0);
  neutral("tfs_z", 1.0);
  neutral("mirostat", 0.0);
  neutral("dry_multiplier", 0.0);
  neutral("xtc_probability", 0.0);
  neutral("length_penalty", 1.0);
  if (const Body* v = field(body, "bad_words")) {
    if (!v->is_array()) invalid("bad_words", "'bad_words' must be an array of strings, not " + type_name(*v));
    if (const auto problem = engine_field_problem("bad_words", *v)) invalid("bad_words", "'bad_words' " + *problem);
    if (!v->empty()) r.extra["bad_words"] = *v;
  }
  if (const Body* v = field(body, "use_beam_search"); v && boolean(*v, "use_beam_search"))
    unsupported("use_beam_search", "beam search");
  if (!chat) {
    if (const Body* v = field(body, "echo"); v && boolean(*v, "echo")) unsupported("echo", "'echo'");
    if (const Body* v = field(body, "suffix"); v && !(v->is_string() && v->get<std::string>().empty()))
      unsupported("suffix", "'suffix'");
    if (const Body* v = field(body, "best_of"); v && integer(*v, "best_of", 1, 128) != 1)
      unsupported("best_of", "best_of > 1");
  }
  return out;
}

namespace {

// Arrays and objects nested deeper than this are refused: no request needs more (a JSON schema
// in a tool definition rarely reaches 20), and nlohmann's dump and copy recurse once per level:
// 200 KB of '[' and ']' (100,000 levels) overflow the stack.
constexpr std::size_t kMaxBodyDepth = 64;

}  // namespace

ApiRequest parse_request_body(Endpoint endpoint, std::string_view body_text, std::string_view served_model) {
  // Checked first, so that every way the text can be wrong is a 400 that says where, and the
  // value built below is never deeper than kMaxBodyDepth.
  if (const std::optional<JsonProblem> problem = check_json(body_text, kMaxBodyDepth)) {
    switch (problem->kind) {
      case JsonProblem::Kind::kSyntax:
        invalid("", "the request body is not valid JSON (" + problem->where() + ")");
      case JsonProblem::Kind::kNumberOutOfRange:
        invalid("", "the request body has a number out of range, " + excerpt(problem->token) + " (at byte " +
                        std::to_string(problem->byte) + ")");
      case JsonProblem::Kind::kTooDeep:
        invalid("", "the request body nests arrays and objects more than " + std::to_string(kMaxBodyDepth) + " deep");
    }
  }
  return parse_request(endpoint, parse_ordered_json(body_text), served_model);
}

std::string new_response_id(Endpoint endpoint) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id = endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-";
  for (int i = 0; i < 24; ++i) id.push_back(kHex[rng() & 15]);
  return id;
}

json usage_json(const Usage& usage) {
  return {{"prompt_tokens", usage.prompt_tokens},
          {"completion_tokens", usage.completion_tokens},
          {"total_tokens", usage.prompt_tokens + usage.completion_tokens}};
}

namespace {

json envelope(const ResponseContext& ctx, bool chunk) {
  const bool chat = ctx.endpoint == Endpoint::kChat;
  return {{"id", ctx.id},
          {"object", chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
          {"created", ctx.created},
          {"model", ctx.model}};
}

json finish_value(std::string_view reason) {
  return reason.empty() ? json(nullptr) : json(std::string(reason));
}

}  // namespace

json completion_body(const ResponseContext& ctx, const Completion& completion) {
  return completion_body(ctx, std::span<const Completion>(&completion, 1));
}

json completion_body(const ResponseContext& ctx, std::span<const Completion> choices) {
  json body = envelope(ctx, false);
  body["choices"] = json::array();
  for (std::size_t i = 0; i < choices.size(); ++i) {
    const Completion& completion = choices[i];
    json choice = {{"index", i}, {"finish_reason", finish_value(completion.finish_reason)}, {"logprobs", nullptr}};
    if (completion.logprobs) {
      std::int64_t offset = ctx.prompt_chars;
      choice["logprobs"] = choice_logprobs(ctx.endpoint, *completion.logprobs, offset);
    }
    if (ctx.endpoint == Endpoint::kChat) {
      choice["message"] = {{"role", "assistant"}, {"content", completion.text}};
      if (!completion.reasoning.empty()) choice["message"]["reasoning_content"] = completion.reasoning;
      if (!completion.tool_calls.is_null()) {
        // An answer that only calls tools has no content: null, as the API writes it.
        if (completion.text.empty()) choice["message"]["content"] = nullptr;
        choice["message"]["tool_calls"] = completion.tool_calls;
      }
    } else {
      choice["text"] = completion.text;
    }
    body["choices"].push_back(std::move(choice));
  }
  body["usage"] = usage_json(total_usage(choices));
  return body;
}

std::int64_t utf8_chars(std::string_view text) {
  std::int64_t n = 0;
  for (const char c : text)
    if ((static_cast<unsigned char>(c) & 0xC0) != 0x80) ++n;
  return n;
}

json choice_logprobs(Endpoint endpoint, std::span<const TokenLogprob> logprobs, std::int64_t& text_offset) {
  if (endpoint == Endpoint::kChat) return {{"content", logprobs_json(logprobs)}};
  json tokens = json::array(), values = json::array(), top = json::array(), offsets = json::array();
  for (const TokenLogprob& t : logprobs) {
    const std::string text = logprob_token_text(t.token);
    tokens.push_back(text);
    values.push_back(t.logprob);
    // The alternatives, and the chosen token always (so up to logprobs + 1 entries).
    json alternatives = json::object();
    for (const TopLogprob& a : t.top_logprobs) alternatives.emplace(logprob_token_text(a.token), a.logprob);
    alternatives.emplace(text, t.logprob);
    top.push_back(std::move(alternatives));
    offsets.push_back(text_offset);
    // Offsets count characters, as a client's string indexes them (a token's bytes that do
    // not start a character count with the character they belong to).
    text_offset += utf8_chars(t.token);
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(values)},
          {"top_logprobs", std::move(top)},
          {"text_offset", std::move(offsets)}};
}

Usage total_usage(std::span<const Completion> choices) {
  Usage total;
  if (choices.empty()) return total;
  total = choices.front().usage;
  for (std::size_t i = 1; i < choices.size(); ++i) total.completion_tokens += choices[i].usage.completion_tokens;
  return total;
}

json text_chunk(const ResponseContext& ctx, std::string_view text, bool first, bool include_usage, int index,
               json logprobs, TextPart part) {
  json body = envelope(ctx, true);
  json choice = {{"index", index}, {"finish_reason", nullptr}, {"logprobs", std::move(logprobs)}};
  if (ctx.endpoint == Endpoint::kChat) {
    json delta = {{part == TextPart::kReasoning ? "reasoning_content" : "content", std::string(text)}};
    if (first) delta["role"] = "assistant";
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = std::string(text);
  }
  body["choices"] = json::array({choice});
  if (include_usage) body["usage"] = nullptr;
  return body;
}

json tool_calls_chunk(const ResponseContext& ctx, const json& calls, bool first, bool include_usage, int index) {
  json body = envelope(ctx, true);
  json delta = {{"tool_calls", json::array()}};
  if (first) {
    delta["role"] = "assistant";
    delta["content"] = nullptr;
  }
  for (std::size_t k = 0; k < calls.size(); ++k) {
    json call = calls[k];
    call["index"] = k;
    delta["tool_calls"].push_back(std::move(call));
  }
  body["choices"] = json::array({{{"index", index}, {"delta", std::move(delta)}, {"finish_reason", nullptr}, {"logprobs", nullptr}}});
  if (include_usage) body["usage"] = nullptr;
  return body;
}

json finish_chunk(const ResponseContext& ctx, std::string_view finish_reason, bool include_usage, int index) {
  json body = envelope(ctx, true);
  json choice = {{"index", index}, {"finish_reason", finish_value(finish_reason)}, {"logprobs", nullptr}};
  if (ctx.endpoint == Endpoint::kChat) {
    choice["delta"] = json::object();
  } else {
    choice["text"] = "";
  }
  body["choices"] = json::array({choice});
  if (include_usage) body["usage"] = nullptr;
  return body;
}

json usage_chunk(const ResponseContext& ctx, const Usage& usage) {
  json body = envelope(ctx, true);
  body["choices"] = json::array();
  body["usage"] = usage_json(usage);
  return body;
}

namespace {

// The field an engine's message names at its start, as in "'logit_bias': token 99999999 is outside
// the vocabulary of 49152" or "'presence_penalty', 'frequency_penalty': ..." (the first); empty
// when it names none.
std::string leading_field(std::string_view message) {
  // Or a path before a colon, as the chat template's checks write them: "tools: this model's
  // chat template ...", "messages[1].tool_calls: ...".
  if (const std::size_t colon = message.find(": "); !message.starts_with('\'') && colon != std::string_view::npos) {
    const std::string_view path = message.substr(0, colon);
    const std::string_view first = path.substr(0, path.find_first_of(".["));
    static constexpr std::string_view kFields[] = {"messages", "tools", "tool_choice", "response_format", "prompt"};
    const bool known = std::find(std::begin(kFields), std::end(kFields), first) != std::end(kFields);
    const bool plain = std::all_of(path.begin(), path.end(), [](char c) {
      return c == '_' || c == '.' || c == '[' || c == ']' || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
    });
    return known && plain ? std::string(path) : std::string();
  }
  if (!message.starts_with('\'')) return {};
  const std::size_t end = message.find('\'', 1);
  if (end == std::string_view::npos || end == 1) return {};
  const std::string_view name = message.substr(1, end - 1);
  for (const char c : name)
    if (!(c == '_' || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'))) return {};
  return std::string(name);
}

}  // namespace

const char* prompt_param(Endpoint endpoint) { return endpoint == Endpoint::kChat ? "messages" : "prompt"; }

ApiError error_from_outcome(const Error& error, Endpoint endpoint, std::string_view max_tokens_param) {
  if (error.kind == ErrorKind::Http && error.http_status >= 400 && error.http_status < 500) {
    // The engine does not say which field it refused, but its messages name it first; what
    // names none is about the prompt (too long, empty, not tokenizable).
    std::string param = leading_field(error.message);
    if (param.empty() && (error.code == "context_length_exceeded" || error.code == "invalid_request"))
      param = prompt_param(endpoint);
    std::string message = error.message;
    if (param == "max_tokens" && max_tokens_param != "max_tokens") {
      // The message names the field as the request did.
      param = max_tokens_param;
      message = "'" + param + "'" + message.substr(std::string_view("'max_tokens'").size());
    }
    // The engine's generic code for a bad value is what the server's own checks leave null.
    const std::string code = error.code == "invalid_request" ? std::string() : error.code;
    return ApiError(error.http_status, "invalid_request_error", std::move(param), message, code);
  }
  return ApiError(500, "server_error", "", "the engine failed: " + error.message, error.code);
}

}  // namespace batchlm::server
