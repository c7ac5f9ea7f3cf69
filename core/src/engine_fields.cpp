#include "batchlm/core/engine_fields.hpp"

#include "batchlm/core/json_schema.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

namespace batchlm {

namespace {

using nlohmann::json;
using ojson = nlohmann::ordered_json;

constexpr const char* kElsewhere = "; remove it, or run the job against an API that does (--base-url)";

// Fields with no effect on what is generated: identification, storage, streaming (the backend
// decides that), tiers.
constexpr std::array<std::string_view, 8> kNoEffect = {"user",        "metadata",       "store",
                                                       "service_tier", "stream",         "stream_options",
                                                       "prompt_cache_key", "safety_identifier"};

bool whole_in(const json& v, double least, double most) {
  if (!v.is_number()) return false;
  const double d = v.get<double>();
  return d == std::floor(d) && d >= least && d <= most;
}

// A logit_bias key: a token id written in decimal.
std::optional<std::int64_t> token_id(std::string_view s) {
  if (s.empty() || s.size() > 10) return std::nullopt;
  std::int64_t v = 0;
  for (const char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  return v;
}

}  // namespace

std::optional<bool> requested_thinking(const ojson& extra) {
  if (!extra.is_object()) return std::nullopt;
  const auto kwargs = extra.find("chat_template_kwargs");
  if (kwargs == extra.end() || !kwargs->is_object()) return std::nullopt;
  const auto thinking = kwargs->find("enable_thinking");
  if (thinking == kwargs->end() || !thinking->is_boolean()) return std::nullopt;
  return thinking->get<bool>();
}

bool requested_tools(const ojson& extra) {
  if (!extra.is_object()) return false;
  const auto tools = extra.find("tools");
  if (tools == extra.end() || !tools->is_array() || tools->empty()) return false;
  const auto choice = extra.find("tool_choice");
  return choice == extra.end() || *choice != "none";
}

std::optional<std::string> engine_field_problem(std::string_view key, const json& value) {
  // In the API a null field is one not set.
  if (value.is_null()) return std::nullopt;
  for (const std::string_view k : kNoEffect)
    if (key == k) return std::nullopt;
  if (key == "chat_template_kwargs") {
    // The engine writes its templates itself: of the variables a Jinja template reads, it
    // takes enable_thinking (Qwen 3's switch); any other would be silently ignored.
    if (!value.is_object()) return "expected an object of template variables, not " + value.dump();
    for (const auto& [name, v] : value.items()) {
      if (name != "enable_thinking")
        return "the embedded engine takes only 'enable_thinking' among the template's variables, not '" +
               name.substr(0, 40) + "'" + kElsewhere;
      if (!v.is_boolean() && !v.is_null()) return "'enable_thinking' must be true or false, not " + v.dump();
    }
    return std::nullopt;
  }
  if (key == "top_k") {
    if (value.is_number() && value.get<double>() == std::floor(value.get<double>()) && value.get<double>() >= -1 &&
        value.get<double>() <= std::numeric_limits<int>::max())
      return std::nullopt;
    return std::string("expected an integer from -1 (no limit) to 2147483647, not ") + value.dump();
  }
  if (key == "n") {
    if (value.is_null() || (value.is_number_integer() && value.get<std::int64_t>() == 1)) return std::nullopt;
    return std::string("several answers per item are not supported (one request, one answer)");
  }
  if (key == "presence_penalty" || key == "frequency_penalty") {
    if (value.is_null() || (value.is_number() && value.get<double>() >= -2.0 && value.get<double>() <= 2.0))
      return std::nullopt;
    return "expected a number from -2 to 2, not " + value.dump();
  }
  if (key == "min_p") {
    if (value.is_number() && value.get<double>() >= 0.0 && value.get<double>() <= 1.0) return std::nullopt;
    return "expected a number from 0 (no limit) to 1, not " + value.dump();
  }
  if (key == "ignore_eos") {
    if (value.is_boolean()) return std::nullopt;
    return "expected true (generate past the end-of-turn token, to max_tokens) or false, not " + value.dump();
  }
  if (key == "repetition_penalty") {
    if (value.is_null() || (value.is_number() && value.get<double>() > 0.0 && value.get<double>() <= kMaxRepetitionPenalty))
      return std::nullopt;
    return "expected a number above 0 and at most 100 (1: none), not " + value.dump();
  }
  if (key == "min_tokens") {
    if (whole_in(value, 0, kMaxMinTokens)) return std::nullopt;
    return "expected a whole number of tokens from 0 to " + std::to_string(static_cast<std::int64_t>(kMaxMinTokens)) +
           ", not " + value.dump();
  }
  if (key == "stop_token_ids") {
    if (!value.is_array()) return "expected a list of token ids, not " + value.dump();
    if (value.size() > kMaxStopTokenIds)
      return "names " + std::to_string(value.size()) + " tokens; at most " + std::to_string(kMaxStopTokenIds) +
             " are allowed";
    for (std::size_t i = 0; i < value.size(); ++i)
      if (!whole_in(value[i], 0, std::numeric_limits<std::int32_t>::max()))
        return "[" + std::to_string(i) + "] is not a token id (a whole number from 0): " + value[i].dump();
    return std::nullopt;
  }
  if (key == "bad_words") {
    if (!value.is_array()) return "expected a list of words, not " + value.dump().substr(0, 80);
    if (value.size() > kMaxBadWords)
      return "names " + std::to_string(value.size()) + " words; at most " + std::to_string(kMaxBadWords) + " are allowed";
    for (std::size_t i = 0; i < value.size(); ++i) {
      const json& word = value[i];
      if (!word.is_string() || word.get_ref<const std::string&>().find_first_not_of(" \t\n\r\f\v") == std::string::npos)
        return "[" + std::to_string(i) + "] is not a word (a string with more than whitespace): " + word.dump().substr(0, 80);
      if (word.get_ref<const std::string&>().size() > kMaxBadWordBytes)
        return "[" + std::to_string(i) + "] is " + std::to_string(word.get_ref<const std::string&>().size()) +
               " bytes long; at most " + std::to_string(kMaxBadWordBytes) + " are allowed";
    }
    return std::nullopt;
  }
  if (key == "logit_bias") {
    if (!value.is_object()) return "expected an object of token ids and biases, not " + value.dump();
    if (value.size() > kMaxLogitBias)
      return "names " + std::to_string(value.size()) + " tokens; at most " + std::to_string(kMaxLogitBias) + " are allowed";
    for (const auto& [id, bias] : value.items()) {
      if (!token_id(id))
        return "the key '" + id.substr(0, 40) + "' is not a token id (a whole number written as a string, like \"1234\")";
      if (!bias.is_number() || bias.get<double>() < -100.0 || bias.get<double>() > 100.0)
        return "the bias of token " + id + " must be a number from -100 to 100, not " + bias.dump();
    }
    return std::nullopt;
  }
  if (key == "logprobs") {
    if (value.is_boolean() || whole_in(value, 0, kMaxTopLogprobs)) return std::nullopt;
    return "expected true, false or a number of most likely tokens from 0 to " + std::to_string(kMaxTopLogprobs) +
           ", not " + value.dump();
  }
  if (key == "top_logprobs") {
    if (whole_in(value, 0, kMaxTopLogprobs)) return std::nullopt;
    return "expected a whole number from 0 to " + std::to_string(kMaxTopLogprobs) + ", not " + value.dump();
  }
  if (key == "response_format") {
    const json type = value.is_object() ? value.value("type", json()) : json();
    if (type == "text" || type == "json_object") return std::nullopt;
    if (type == "json_schema") {
      const auto spec = value.find("json_schema");
      if (spec == value.end() || !spec->is_object() || !spec->contains("schema"))
        return std::string("expected {\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}");
      try {
        (void)compile_json_schema(spec->at("schema"));
      } catch (const SchemaError& e) {
        return std::string("json_schema.schema ") + e.what() + kElsewhere;
      }
      return std::nullopt;
    }
    return "expected an object whose type is text, json_object or json_schema, not " + value.dump().substr(0, 80);
  }
  if (key == "functions" || key == "function_call") {
    if (value.is_null() || (value.is_array() && value.empty()) || value == "none" || value == "auto") return std::nullopt;
    return std::string("the embedded engine calls tools given as 'tools', not the older 'functions'") + kElsewhere;
  }
  if (key == "tools") {
    // Function tools, which templates that list tools show the model (its calls are read back
    // from what it writes); whether the model's template does is checked once it is loaded.
    if (value.is_null()) return std::nullopt;
    if (!value.is_array()) return "expected a list of {type: function, function: {name, description, parameters}}";
    for (std::size_t i = 0; i < value.size(); ++i) {
      const json& tool = value[i];
      const std::string at = "tools[" + std::to_string(i) + "]";
      if (!tool.is_object() || tool.value("type", json()) != "function")
        return at + ": expected {type: function, function: {...}} (the embedded engine calls function tools only)";
      const auto function = tool.find("function");
      if (function == tool.end() || !function->is_object()) return at + ".function: required: {name, description, parameters}";
      const auto name = function->find("name");
      if (name == function->end() || !name->is_string() || name->get_ref<const std::string&>().empty())
        return at + ".function.name: required: a non-empty string";
      if (const auto d = function->find("description"); d != function->end() && !d->is_string() && !d->is_null())
        return at + ".function.description: expected a string";
      if (const auto p = function->find("parameters"); p != function->end() && !p->is_object() && !p->is_null())
        return at + ".function.parameters: expected a JSON schema (an object)";
    }
    return std::nullopt;
  }
  if (key == "tool_choice") {
    // The model decides ("auto", the default), is not shown the tools ("none"), or is held to
    // calling one of them ("required") or the one named; tool_choice_problem checks the name.
    if (value.is_null() || value == "auto" || value == "none" || value == "required") return std::nullopt;
    if (value.is_object() && value.value("type", json()) == "function") {
      const auto function = value.find("function");
      if (function != value.end() && function->is_object()) {
        const auto name = function->find("name");
        if (name != function->end() && name->is_string() && !name->get_ref<const std::string&>().empty())
          return std::nullopt;
      }
    }
    return std::string("expected \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}, "
                       "not ") +
           value.dump().substr(0, 80);
  }
  if (key == "parallel_tool_calls") {
    // false: checked with tool_choice (tool_choice_problem).
    if (value.is_null() || value.is_boolean()) return std::nullopt;
    return "expected true or false";
  }
  if (key == "modalities") {
    if (value == json::array({"text"})) return std::nullopt;
    return std::string("the embedded engine generates text only (modalities: [\"text\"])") + kElsewhere;
  }
  if (key == "max_completion_tokens" || key == "max_tokens" || key == "temperature" || key == "top_p" ||
      key == "stop" || key == "seed" || key == "messages" || key == "model")
    return "set it as request." + std::string(key == "max_completion_tokens" ? "max_tokens" : key) +
           " (the embedded engine does not read it from the extra fields)";
  return "the embedded engine does not use '" + std::string(key) +
         "' (of the extra fields it takes top_k, min_p, presence_penalty, frequency_penalty, repetition_penalty, logit_bias, "
         "min_tokens, stop_token_ids, bad_words, logprobs, top_logprobs, response_format, ignore_eos, tools, tool_choice, "
         "parallel_tool_calls and chat_template_kwargs)" +
         kElsewhere;
}

std::optional<std::string> top_logprobs_problem(const ojson& extra) {
  if (!extra.is_object()) return std::nullopt;
  const ojson top = extra.value("top_logprobs", ojson());
  if (top.is_null() || !top.is_number()) return std::nullopt;
  const ojson logprobs = extra.value("logprobs", ojson());
  const bool on = logprobs == true || logprobs.is_number();
  if (!on && top.get<double>() > 0) return std::string("needs logprobs: true");
  if (logprobs.is_number() && logprobs.get<double>() != top.get<double>())
    return "asks for " + top.dump() + " most likely tokens where logprobs asks for " + logprobs.dump();
  return std::nullopt;
}

namespace {

// The tool a forced tool_choice names, or null for "required" (any of them); `forced` is false
// where the model decides.
struct ForcedChoice {
  bool forced = false;
  const ojson* named = nullptr;
};
ForcedChoice forced_choice(const ojson& extra) {
  ForcedChoice out;
  if (!extra.is_object()) return out;
  const auto choice = extra.find("tool_choice");
  if (choice == extra.end()) return out;
  if (*choice == "required") out.forced = true;
  if (choice->is_object()) {
    out.forced = true;
    out.named = &choice->at("function").at("name");
  }
  return out;
}

// The parameters' references, which point into the parameters' own document, made to point
// into the call's schema that holds them at `at` ("/properties/arguments"): "#" and
// "#/properties/..." move under `at`; "#/$defs/..." and "#/definitions/..." stay, the
// definitions being moved up to the call's root.
void move_references(json& schema, const std::string& at) {
  if (schema.is_array()) {
    for (json& item : schema) move_references(item, at);
    return;
  }
  if (!schema.is_object()) return;
  for (auto& [key, value] : schema.items()) {
    if (key == "$ref" && value.is_string()) {
      const std::string& ref = value.get_ref<const std::string&>();
      if (ref.starts_with("#") && !ref.starts_with("#/$defs/") && !ref.starts_with("#/definitions/"))
        value = "#" + at + ref.substr(1);
    } else {
      move_references(value, at);
    }
  }
}

// A call to `tool` as its template's form has the model write it: {"name": its name,
// arguments_key: an object its parameters schema admits (any object without one)}.
json call_schema(const ojson& tool, std::string_view arguments_key) {
  const ojson& function = tool.at("function");
  json parameters = {{"type", "object"}};
  if (const auto p = function.find("parameters"); p != function.end() && p->is_object() && !p->empty()) parameters = json(*p);
  move_references(parameters, "/properties/" + std::string(arguments_key));
  json call = {{"type", "object"},
               {"required", {"name", arguments_key}},
               {"additionalProperties", false}};
  for (const char* definitions : {"$defs", "definitions"}) {
    if (const auto d = parameters.find(definitions); d != parameters.end()) {
      call[definitions] = std::move(*d);
      parameters.erase(definitions);
    }
  }
  call["properties"] = {{"name", {{"const", function.at("name")}}}, {std::string(arguments_key), std::move(parameters)}};
  return call;
}

}  // namespace

std::optional<std::pair<std::string, std::string>> tool_choice_problem(const ojson& extra) {
  if (!extra.is_object()) return std::nullopt;
  const ForcedChoice choice = forced_choice(extra);
  const auto tools = extra.find("tools");
  const bool any = tools != extra.end() && tools->is_array() && !tools->empty();
  if (const auto parallel = extra.find("parallel_tool_calls");
      parallel != extra.end() && *parallel == false && any && !choice.forced && extra.value("tool_choice", ojson()) != "none")
    return std::make_pair(std::string("parallel_tool_calls"),
                          std::string("the embedded engine cannot hold the model to one call where it decides "
                                      "(parallel_tool_calls: false with tool_choice \"auto\"); a forced tool_choice "
                                      "(\"required\" or a named function) makes one call") +
                              kElsewhere);
  if (!choice.forced) return std::nullopt;
  if (!any) return std::make_pair(std::string("tool_choice"), std::string("forces a call, but no tools are given"));
  // The arguments are held to the parameters of the tool named, or of the only tool; among
  // several, the call to one of their names.
  if (!choice.named && tools->size() > 1) {
    if (tools->size() > kMaxSchemaValues)
      return std::make_pair(std::string("tool_choice"),
                            "\"required\" among " + std::to_string(tools->size()) + " tools: the embedded engine holds a "
                            "call to one of at most " + std::to_string(kMaxSchemaValues) +
                                " names; name the function, or give fewer tools");
    return std::nullopt;
  }
  bool found = false;
  for (std::size_t i = 0; i < tools->size(); ++i) {
    const ojson& function = (*tools)[i].at("function");
    if (choice.named && function.at("name") != *choice.named) continue;
    found = true;
    // The call is held to the tool's parameters: they must be a schema the engine can follow.
    try {
      (void)compile_json_schema(call_schema((*tools)[i], "arguments"));
    } catch (const SchemaError& e) {
      // Where in the parameters, and what is wrong there (the error's text after its place).
      constexpr std::string_view kInside = "/properties/arguments";
      const std::string where = e.where().starts_with(kInside) ? e.where().substr(kInside.size()) : e.where();
      const std::string what = std::string(e.what()).substr((e.where().empty() ? std::string("at the root") : "at " + e.where()).size() + 2);
      return std::make_pair(std::string("tools"),
                            "tools[" + std::to_string(i) + "].function.parameters" + (where.empty() ? "" : " at " + where) +
                                ": a forced call is held to its tool's parameters, and " + what + kElsewhere);
    }
  }
  if (!found)
    return std::make_pair(std::string("tool_choice"), "names the function " + choice.named->dump() +
                                                          ", which is not among the tools");
  return std::nullopt;
}

bool forces_call(const ojson& extra) { return forced_choice(extra).forced; }

std::optional<json> forced_call_schema(const ojson& extra, std::string_view arguments_key) {
  const ForcedChoice choice = forced_choice(extra);
  if (!choice.forced) return std::nullopt;
  const ojson& tools = extra.at("tools");
  for (const ojson& tool : tools)
    if (tools.size() == 1 || (choice.named && tool.at("function").at("name") == *choice.named))
      return call_schema(tool, arguments_key);
  // "required" among several: the schema follower tells anyOf's branches apart by the JSON type
  // of the value, and every call is an object, so the call names one of the tools and its
  // arguments are an object.
  json names = json::array();
  for (const ojson& tool : tools) names.push_back(json(tool.at("function").at("name")));
  return json{{"type", "object"},
              {"properties", {{"name", {{"enum", std::move(names)}}}, {std::string(arguments_key), {{"type", "object"}}}}},
              {"required", {"name", arguments_key}},
              {"additionalProperties", false}};
}

const ojson* requested_json_schema(const ojson& extra) {
  if (!extra.is_object()) return nullptr;
  const auto format = extra.find("response_format");
  if (format == extra.end() || !format->is_object() || format->value("type", ojson()) != "json_schema") return nullptr;
  const auto spec = format->find("json_schema");
  if (spec == format->end() || !spec->is_object()) return nullptr;
  const auto schema = spec->find("schema");
  return schema == spec->end() ? nullptr : &*schema;
}

bool requested_json_object(const ojson& extra) {
  if (!extra.is_object()) return false;
  const ojson format = extra.value("response_format", ojson());
  return format.is_object() && format.value("type", ojson()) == "json_object";
}

int requested_logprobs(const ojson& extra) {
  if (!extra.is_object()) return -1;
  const ojson logprobs = extra.value("logprobs", ojson());
  if (logprobs.is_number()) return static_cast<int>(logprobs.get<double>());
  if (logprobs != true) return -1;
  const ojson top = extra.value("top_logprobs", ojson());
  return top.is_number() ? static_cast<int>(top.get<double>()) : 0;
}

std::vector<std::pair<std::int64_t, double>> requested_logit_bias(const ojson& extra) {
  std::vector<std::pair<std::int64_t, double>> out;
  if (!extra.is_object()) return out;
  const auto it = extra.find("logit_bias");
  if (it == extra.end() || !it->is_object()) return out;
  for (const auto& [id, bias] : it->items())
    if (const auto token = token_id(id); token && bias.is_number()) out.emplace_back(*token, bias.get<double>());
  return out;
}

std::int64_t requested_min_tokens(const ojson& extra) {
  if (!extra.is_object()) return 0;
  const auto it = extra.find("min_tokens");
  return it != extra.end() && it->is_number() ? static_cast<std::int64_t>(it->get<double>()) : 0;
}

namespace {

// The extra field `key` where it is a list, else an empty one.
const ojson& list_field(const ojson& extra, const char* key) {
  static const ojson kNone = ojson::array();
  if (!extra.is_object()) return kNone;
  const auto it = extra.find(key);
  return it != extra.end() && it->is_array() ? *it : kNone;
}

}  // namespace

std::vector<std::int64_t> requested_stop_token_ids(const ojson& extra) {
  std::vector<std::int64_t> out;
  for (const ojson& id : list_field(extra, "stop_token_ids"))
    if (id.is_number()) out.push_back(static_cast<std::int64_t>(id.get<double>()));
  return out;
}

std::vector<std::string> requested_bad_words(const ojson& extra) {
  std::vector<std::string> out;
  for (const ojson& word : list_field(extra, "bad_words"))
    if (word.is_string()) out.push_back(word.get<std::string>());
  return out;
}

std::optional<std::string> min_tokens_problem(const ojson& extra, std::optional<int> max_tokens) {
  const std::int64_t least = requested_min_tokens(extra);
  if (!max_tokens || least <= *max_tokens) return std::nullopt;
  return "asks for at least " + std::to_string(least) + " tokens, more than max_tokens (" + std::to_string(*max_tokens) +
         ") lets out";
}

std::optional<std::pair<std::string, std::string>> cpu_only_sampling(const CpuSampling& asked) {
  using Found = std::pair<std::string, std::string>;
  if (!asked.penalty.empty()) return Found(asked.penalty, "penalties are applied");
  if (asked.min_p) return Found("min_p", "min-p is applied");
  if (asked.min_tokens) return Found("min_tokens", "the end of the turn is held back");
  if (asked.bad_words) return Found("bad_words", "bad words are held back");
  if (asked.logit_bias) return Found("logit_bias", "biases are applied");
  if (asked.logprobs) return Found("logprobs", "log-probabilities are computed");
  if (asked.json_object) return Found("response_format", "JSON mode is applied");
  if (asked.forced_call) return Found("tool_choice", "forced calls are held to their tool's schema");
  if (asked.json_schema) return Found("response_format", "JSON schemas are followed");
  return std::nullopt;
}

std::optional<std::pair<std::string, std::string>> cpu_sampling_field(const ojson& extra) {
  if (!extra.is_object()) return std::nullopt;
  // Set to other than what changes nothing (`none`), as the engine reads it.
  const auto set = [&](const char* key, float none = 0.0f) {
    const auto it = extra.find(key);
    return it != extra.end() && it->is_number() && it->get<float>() != none;
  };
  return cpu_only_sampling({.penalty = set("presence_penalty")          ? "presence_penalty"
                                       : set("frequency_penalty")       ? "frequency_penalty"
                                       : set("repetition_penalty", 1.0f) ? "repetition_penalty"
                                                                         : "",
                            .min_p = set("min_p"),
                            .min_tokens = requested_min_tokens(extra) > 0,
                            .bad_words = !requested_bad_words(extra).empty(),
                            .logit_bias = !requested_logit_bias(extra).empty(),
                            .logprobs = requested_logprobs(extra) >= 0,
                            .json_object = requested_json_object(extra),
                            .forced_call = requested_tools(extra) && forces_call(extra),
                            .json_schema = requested_json_schema(extra) != nullptr});
}

}  // namespace batchlm
