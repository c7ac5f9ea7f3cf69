#pragma once
// Which body fields beyond a Request's own the embedded engine honours. A job's `request.extra`
// and the body of an OpenAI Batch-API line pass fields through to an API as they are; the
// embedded engine reads `top_k`, `min_p`, `presence_penalty`, `frequency_penalty`,
// `repetition_penalty`, `logit_bias`, `min_tokens`, `stop_token_ids`, `bad_words`, `ignore_eos`, `logprobs`,
// `top_logprobs` and `response_format` (text, JSON mode, or a JSON schema it can
// follow: json_schema.hpp) and `tools` with `tool_choice` among them, so any other field that would
// change the output is refused rather than silently ignored. Fields that change nothing (`user`, `metadata`, a zero penalty, `n: 1`, ...)
// pass. The runner checks jobs with it before a run starts; LocalBackend checks each request.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "batchlm/core/types.hpp"

namespace batchlm {

// Why the embedded engine cannot honour body field `key` with this value; nullopt when it
// honours it or the field changes nothing.
std::optional<std::string> engine_field_problem(std::string_view key, const nlohmann::json& value);

// Whether the extra fields give the model tools to call: a non-empty `tools` without
// `tool_choice: "none"`. For fields that passed the checks above.
bool requested_tools(const nlohmann::ordered_json& extra);
// `chat_template_kwargs.enable_thinking` (Qwen 3's switch: false writes an empty <think> block
// after the generation prompt, so the model answers without reasoning); nullopt when not given.
std::optional<bool> requested_thinking(const nlohmann::ordered_json& extra);

// What is wrong with the tool fields together (each already passed engine_field_problem), as
// (the field to name, what is wrong), or nullopt: a forced tool_choice ("required", or
// {"type": "function", "function": {"name": ...}}) without tools, or naming none of them; the
// tool a forced call is held to (the one named, or the only one) with parameters that are a
// schema the engine cannot follow (see compile_json_schema); parallel_tool_calls false where the model decides (it cannot be held to
// one call; a forced choice makes exactly one).
std::optional<std::pair<std::string, std::string>> tool_choice_problem(const nlohmann::ordered_json& extra);
// The schema the answer is held to where tool_choice forces a call: {"name": N, arguments_key:
// an object N's parameters admit} for the tool named (or the only one); for "required" among
// several tools, {"name": one of theirs, arguments_key: an object} (the schema follower cannot
// tell objects apart by a property's value). arguments_key is what the model's template calls
// the arguments ("arguments", or "parameters" for Llama 3.1's). nullopt where the model decides.
// For fields that passed the checks above.
std::optional<nlohmann::json> forced_call_schema(const nlohmann::ordered_json& extra, std::string_view arguments_key);
// Whether tool_choice forces a call ("required" or a named function), as forced_call_schema
// would give a schema for.
bool forces_call(const nlohmann::ordered_json& extra);

// What is wrong with `top_logprobs` next to `logprobs` in the extra fields (each already
// passed engine_field_problem): a count without logprobs turned on, or one that disagrees with
// the count `logprobs` gives. nullopt when they agree.
std::optional<std::string> top_logprobs_problem(const nlohmann::ordered_json& extra);
// The log-probabilities the extra fields ask for: -1 for none, else how many of the most
// likely tokens to list at each position. `logprobs` turns them on, as true (the chat API) or a
// count (the completions API); `top_logprobs` gives the count in the chat API. For fields that
// passed the checks above.
int requested_logprobs(const nlohmann::ordered_json& extra);
// Whether `response_format` asks for JSON mode ({"type": "json_object"}).
bool requested_json_object(const nlohmann::ordered_json& extra);
// The schema `response_format` asks the output to follow ({"type": "json_schema", "json_schema":
// {"schema": ...}}), or null.
const nlohmann::ordered_json* requested_json_schema(const nlohmann::ordered_json& extra);
// `logit_bias` as (token id, bias) pairs; empty without it. For fields that passed the checks.
std::vector<std::pair<std::int64_t, double>> requested_logit_bias(const nlohmann::ordered_json& extra);

// vLLM's `min_tokens` (0 without it) and `stop_token_ids` (empty without them), for fields that
// passed the checks above. Whether each id is in the model's vocabulary is the engine's to check.
std::int64_t requested_min_tokens(const nlohmann::ordered_json& extra);
std::vector<std::int64_t> requested_stop_token_ids(const nlohmann::ordered_json& extra);
// vLLM's `bad_words` (empty without them), for fields that passed the checks above.
std::vector<std::string> requested_bad_words(const nlohmann::ordered_json& extra);
// A min_tokens above the request's max_tokens (nullopt when there is none, or they agree).
std::optional<std::string> min_tokens_problem(const nlohmann::ordered_json& extra, std::optional<int> max_tokens);

// What a request asks of the sampler that only the engine's sampler on the CPU applies.
// `penalty`: the penalty field(s) to name where a penalty is applied, else empty.
struct CpuSampling {
  std::string penalty;
  bool min_p = false, min_tokens = false, bad_words = false, logit_bias = false, logprobs = false, json_object = false, forced_call = false,
       json_schema = false;
};
// The first of them in the order the engine checks (a penalty, min_p, min_tokens, bad_words, logit_bias,
// log-probabilities, JSON mode, a forced call, a JSON schema) as (the field, what is done:
// "min-p is applied"), or nullopt. An engine that samples on a GPU refuses requests with one.
std::optional<std::pair<std::string, std::string>> cpu_only_sampling(const CpuSampling& asked);
// The same of a request's extra fields, naming the one set: the runner refuses such a job
// before it starts. For fields that passed the checks above.
std::optional<std::pair<std::string, std::string>> cpu_sampling_field(const nlohmann::ordered_json& extra);

// The largest repetition_penalty taken (vLLM takes any above 0; past this it is no longer a
// penalty anyone means).
inline constexpr double kMaxRepetitionPenalty = 100.0;
// The largest min_tokens taken (no context holds more).
inline constexpr double kMaxMinTokens = 1 << 24;
// The most words bad_words may name, and the longest of them in bytes.
inline constexpr std::size_t kMaxBadWords = 256;
inline constexpr std::size_t kMaxBadWordBytes = 256;
// The most tokens stop_token_ids may name.
inline constexpr std::size_t kMaxStopTokenIds = 1024;
// The most tokens a logit_bias may name (OpenAI's limit is 300; this one only bounds the work).
inline constexpr std::size_t kMaxLogitBias = 1024;
// The most alternatives per position a request may ask for (OpenAI's limit).
inline constexpr int kMaxTopLogprobs = 20;

}  // namespace batchlm
