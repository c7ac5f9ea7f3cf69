#include "engine_commands.hpp"

#include "cli_checks.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <map>
#include <optional>
#include <memory>
#include <random>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/batch_engine.hpp"
#include "batchlm/local_engine/engine.hpp"
#include "batchlm/local_engine/executor.hpp"
#include "batchlm/local_engine/model.hpp"
#include "batchlm/runner/ignored_signal.hpp"
#include "batchlm/runner/job.hpp"

namespace batchlm::app {

std::string default_model() {
  if (const char* env = std::getenv("BATCHLM_MODEL"); env && *env) return env;
  return std::string(runner::kDefaultLocalModel);
}

std::string model_file_problem(const std::string& path, const std::string& how_to_choose) {
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::file_status status = fs::status(path, error);
  if (fs::is_regular_file(status)) return {};
  // The default model is fetched by a script; a file the user named is theirs to fix.
  const std::string fix = path == runner::kDefaultLocalModel
                              ? "; run scripts/fetch-model.sh for the default model, or " + how_to_choose
                              : std::string();
  if (fs::is_directory(status)) return "model file '" + path + "' is a directory, not a GGUF file" + fix;
  if (fs::exists(status)) return "model file '" + path + "' is not a regular file (a GGUF file is mapped from disk)" + fix;
  if (error && error != std::errc::no_such_file_or_directory && error != std::errc::not_a_directory)
    return "model file '" + path + "' cannot be looked up: " + error.message() + fix;
  std::string where;
  if (fs::path(path).is_relative()) {
    const fs::path cwd = fs::current_path(error);
    if (!error) where = " in " + cwd.string();
  }
  return "model file '" + path + "' not found" + where + fix;
}

namespace {

using namespace batchlm::local_engine;

struct GenerateOptions {
  std::string model;
  std::string prompt;
  std::string file;
  std::string system;
  bool chat = false;
  long long max_tokens = 256;
  float temperature = 0.8f;
  float top_p = 0.95f;
  int top_k = 40;
  std::optional<unsigned long long> seed;
  CLI::Option* prompt_option = nullptr;
  int threads = 0;
  long long context = 0;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  bool timings = false;
  std::string device = "auto";
};

struct InspectOptions {
  std::string model;
  bool tensors = false;
};

GenerateOptions g;
InspectOptions in;
CLI::App* generate_cmd = nullptr;
CLI::App* inspect_cmd = nullptr;


std::string read_prompt() {
  if (!g.prompt.empty() && !g.file.empty()) throw CLI::ValidationError("give --prompt or --file, not both");
  if (!g.file.empty()) {
    if (g.file == "-") return std::string(std::istreambuf_iterator<char>(std::cin), {});
    std::error_code ec;
    if (std::filesystem::is_directory(g.file, ec))
      throw std::runtime_error("--file: " + g.file + " is a directory, not a prompt file");
    std::ifstream f(g.file, std::ios::binary);
    if (!f) throw std::runtime_error("--file: cannot read the prompt file " + g.file + ": " + std::strerror(errno));
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  if (g.prompt_option == nullptr || g.prompt_option->count() == 0)
    throw std::runtime_error("no prompt: give --prompt TEXT or --file PATH (- for stdin)");
  return g.prompt;  // may be empty: a chat's user turn can be
}

// Ctrl-C during generate stops the text where it is; the newline and the timings still come.
// A second Ctrl-C (the handler is reset by the first) ends the process at once.
volatile std::sig_atomic_t g_interrupted = 0;
extern "C" void on_generate_interrupt(int) { g_interrupted = 1; }

int run_generate() {
  if (!g.system.empty() && !g.chat)
    throw std::runtime_error("--system needs --chat (a system message is part of the chat template)");
  const std::string text = read_prompt();
  if (const std::string problem = model_file_problem(g.model, "pass --model"); !problem.empty())
    throw std::runtime_error(problem);
  std::shared_ptr<const Model> model = Model::load(g.model, /*check_only=*/false, g.context);
  // The engine of run and serve, with one sequence and a pool of one context (on a GPU, the
  // default pool would take all of its memory).
  LocalBackendOptions options;
  options.threads = app::usable_threads(g.threads);
  options.context = g.context;
  options.device = parse_device(g.device).value_or(Device::kAuto);
  options.max_sequences = 1;
  options.kv_tokens = choose_context(model->config(), g.context);
  options.split_reasoning = false;
  std::unique_ptr<BatchEngine> made;
  try {
    made = std::make_unique<BatchEngine>(model, options);
  } catch (const DeviceUnavailable& e) {
    throw std::runtime_error(std::string("--device: ") + e.what());
  }
  BatchEngine& engine = *made;
  if (g.context > engine.context())
    std::fprintf(stderr, "batchlm: note: --context %lld is beyond the longest context this model runs at; using %lld\n",
                 static_cast<long long>(g.context), static_cast<long long>(engine.context()));
  std::vector<Token> prompt;
  if (g.chat) {
    // The template still makes a prompt of it, as `run` does of an empty user turn, which it
    // warns about too.
    if (text.empty()) std::fprintf(stderr, "batchlm: warning: the prompt is empty: the user turn says nothing\n");
    std::vector<ChatMessage> messages;
    if (!g.system.empty()) messages.push_back({"system", g.system});
    messages.push_back({"user", text});
    prompt = chat_prompt_tokens(*model, messages);
  } else {
    prompt = text_prompt_tokens(*model, text);
  }
  GenerateParams params;
  params.max_tokens = g.max_tokens;
  params.sampling.temperature = g.temperature;
  params.sampling.top_p = g.top_p;
  params.sampling.top_k = g.top_k;
  params.sampling.seed = g.seed ? *g.seed : std::random_device{}();
  params.stop = g.stop;
  params.ignore_eos = g.ignore_eos;
  struct sigaction stop {}, previous {};
  stop.sa_handler = on_generate_interrupt;
  stop.sa_flags = SA_RESETHAND;
  ::sigemptyset(&stop.sa_mask);
  const bool ignored = runner::ignored_at_start(SIGINT);
  if (!ignored) ::sigaction(SIGINT, &stop, &previous);
  const SequenceId id = engine.add(prompt, params, [](std::string_view piece, std::span<const TokenLogprob>) {
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    return g_interrupted == 0;
  });
  GenerateResult r;
  while (!engine.idle()) {
    engine.step();
    for (auto& [done, result] : engine.take_finished())
      if (done == id) r = std::move(result);
  }
  if (!ignored) ::sigaction(SIGINT, &previous, nullptr);
  // One token comes with the prompt's pass; each later one takes a decode step.
  r.stats.decode_steps = std::max<std::int64_t>(0, static_cast<std::int64_t>(r.tokens.size()) - 1);
  r.stats.cached_prompt_tokens = engine.stats().prompt_tokens_cached;
  if (!r.text.empty() && r.text.back() != '\n') std::fputc('\n', stdout);
  std::fflush(stdout);
  // A forward pass that gave no numbers (NaN or infinite logits) ends the answer as an error:
  // the text written so far stays, and the error is said.
  if (r.finish_reason == "error") throw std::runtime_error(r.error.empty() ? "the answer ended in an error" : r.error);
  // Nothing written and no error: an empty line alone would look like a failure to load or run.
  if (r.text.empty() && r.finish_reason == "stop" && g_interrupted == 0)
    std::fprintf(stderr, "batchlm: note: the model ended the text before writing anything (an end token%s came first)%s\n",
                 g.stop.empty() ? "" : " or a stop string",
                 g.chat ? "" : "; an instruction-tuned model answers a request with --chat");
  // The context, not --max-tokens, ended the answer: said, as `run` records it (cut_at_context).
  const auto generated = static_cast<long long>(r.tokens.size());
  if (r.finish_reason == "length" && generated < g.max_tokens)
    std::fprintf(stderr,
                 "batchlm: note: the context (%lld tokens) ended the answer after %lld of %lld tokens (the prompt "
                 "has %zu); give a larger --context, or a shorter prompt\n",
                 static_cast<long long>(engine.context()), generated, g.max_tokens, prompt.size());
  if (g.timings) {
    const GenerateStats& s = r.stats;
    nlohmann::json j = {
        {"prompt_tokens", s.prompt_tokens},
        {"cached_prompt_tokens", s.cached_prompt_tokens},
        {"prompt_ms", s.prompt_ms},
        {"generated_tokens", s.generated_tokens},
        {"decode_steps", s.decode_steps},
        {"generate_ms", s.generate_ms},
        {"prompt_tok_s", s.prompt_ms > 0 ? s.prompt_tokens * 1000.0 / s.prompt_ms : 0.0},
        // No rate without a decode step (one token comes with the prompt): null, not 0.
        {"generate_tok_s", s.decode_steps > 0 && s.generate_ms > 0 ? nlohmann::json(s.decode_steps * 1000.0 / s.generate_ms)
                                                                  : nlohmann::json(nullptr)},
        {"finish_reason", r.finish_reason},
        {"threads", engine.threads()},
        {"simd", kernels::cpu_simd_name()},
        {"device", engine.device()},
    };
    std::fprintf(stderr, "%s\n", j.dump().c_str());
  }
  return g_interrupted ? 130 : 0;
}

// Text from the model file as a JSON string. A GGUF stores token texts as raw bytes, so one
// that is not UTF-8 is shown with U+FFFD where the bad bytes were, not refused: it describes a
// model that loads and runs.
std::string quoted(const std::string& text) {
  return nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string token_text(const Tokenizer& tok, Token t) {
  if (t < 0 || static_cast<std::size_t>(t) >= tok.size()) return "(none)";
  return std::to_string(t) + " " + quoted(tok.vocab().tokens[t]);
}

int run_inspect() {
  if (const std::string problem = model_file_problem(in.model, "name another file"); !problem.empty())
    throw std::runtime_error(problem);
  const gguf::File file = gguf::File::open(in.model);
  std::printf("file          %s (%s, GGUF v%u)\n", file.path().c_str(),
              gguf::human_bytes(static_cast<double>(file.file_size())).c_str(), file.version());
  const std::string arch = file.find_string("general.architecture").value_or("(unknown)");
  // The file's own strings go through terminal_safe: a name may hold escape sequences or a NUL.
  std::printf("architecture  %s\n", terminal_safe(arch).c_str());
  if (auto name = file.find_string("general.name")) std::printf("name          %s\n", terminal_safe(*name).c_str());

  std::map<std::string, std::pair<std::uint64_t, std::uint64_t>> by_type;  // count, bytes
  std::uint64_t params = 0;
  for (const auto& t : file.tensors()) {
    auto& e = by_type[std::string(t.type_name())];
    ++e.first;
    e.second += t.n_bytes;
    params += t.n_elements;
  }
  std::printf("parameters    %.1f M in %zu tensors\n", static_cast<double>(params) / 1e6, file.tensors().size());
  std::printf("tensor types ");
  if (by_type.empty()) std::printf(" none");
  for (const auto& [type, e] : by_type)
    std::printf(" %s x%llu (%s)", type.c_str(), static_cast<unsigned long long>(e.first),
                gguf::human_bytes(static_cast<double>(e.second)).c_str());
  std::printf("\n");

  // The tokenizer's lines: its kind, special tokens and chat template.
  const auto show_tokenizer = [](const Tokenizer& tok, const std::function<const ChatTemplate&()>& chat) {
    const Vocab& v = tok.vocab();
    std::printf("tokenizer     %s (pre-tokenizer %s), %zu tokens, %zu merges\n", terminal_safe(v.model).c_str(),
                terminal_safe(v.pre).c_str(), tok.size(), v.merges.size());
    std::printf("special       bos %s, eos %s, eot %s%s\n", token_text(tok, v.bos).c_str(),
                token_text(tok, v.eos).c_str(), token_text(tok, v.eot).c_str(),
                v.add_bos ? ", BOS added" : "");
    try {
      const ChatTemplate& ct = chat();
      const char* tools = ct.call_format() == CallFormat::kTagged ? ", tools called in <tool_call> blocks"
                          : ct.call_format() == CallFormat::kJson ? ", tools called as JSON answers"
                                                                   : "";
      // No template in the file: chat prompts are still made, in ChatML, which is said.
      std::printf("chat template %s%s%s%s%s%s%s%s\n", terminal_safe(ct.name()).c_str(),
                  v.chat_template.empty() ? " (the file has none; chat prompts are written in ChatML)" : "",
                  ct.default_system().empty() ? "" : (", default system: " +
                  quoted(ct.default_system())).c_str(),
                  ct.date().empty() ? "" : (", system turn dated " + terminal_safe(ct.date())).c_str(),
                  ct.reasoning_turns() ? ", <think> reasoning kept after the last user turn only" : "",
                  ct.opens_reasoning() ? ", the answer opens with <think>" : "",
                  ct.thinking_off().empty() ? "" : ", thinking switched off by enable_thinking: false", tools);
    } catch (const std::exception& e) {
      std::printf("chat template unsupported (%s)\n", terminal_safe(e.what()).c_str());
    }
  };

  try {
    std::shared_ptr<const Model> model = Model::load(in.model, /*check_only=*/true);  // the checks, not the packed weights
    const ModelConfig& c = model->config();
    std::printf("layers        %lld\n", static_cast<long long>(c.n_layers));
    std::printf("embedding     %lld, feed-forward %lld\n", static_cast<long long>(c.n_embd),
                static_cast<long long>(c.n_ff));
    std::printf("heads         %lld query, %lld key/value, head size %lld\n",
                static_cast<long long>(c.n_heads), static_cast<long long>(c.n_kv_heads),
                static_cast<long long>(c.head_dim));
    if (c.n_ctx_usable() < c.n_ctx_train)
      std::printf("context       %lld (training; past its original %lld with the long rotary factors)\n",
                  static_cast<long long>(c.n_ctx_train), static_cast<long long>(c.n_ctx_orig));
    else
      std::printf("context       %lld (training)\n", static_cast<long long>(c.n_ctx_train));
    char magnitude[48] = "";
    if (c.rope_attn_factor != 1.0f)
      std::snprintf(magnitude, sizeof magnitude, ", magnitude %g", static_cast<double>(c.rope_attn_factor));
    std::printf("rope          base %g, %lld dims, %s%s%s; rms eps %g\n", static_cast<double>(c.rope_base),
                static_cast<long long>(c.rope_dim),
                c.rope_style == batchlm::kernels::RopeStyle::kHalves ? "pairs in halves" : "adjacent pairs",
                !c.rope_freq_factors    ? ""
                : c.rope_long_factors   ? ", frequency factors (rope_factors_short, rope_factors_long)"
                                        : ", frequency factors (rope_freqs)",
                magnitude, static_cast<double>(c.rms_eps));
    if (c.rope_freq_scale != 1.0f)
      std::printf("rope scaling  linear, factor %g%s\n", 1.0 / static_cast<double>(c.rope_freq_scale),
                  c.sliding_window > 0 && c.rope_freq_scale_swa != c.rope_freq_scale ? " (the full-attention layers)" : "");
    if (c.qkv_bias || c.qk_norm)
      std::printf("attention     %s\n", c.qkv_bias ? "query, key and value biases" : "query and key normalized per head");
    if (c.sliding_window > 0) {
      const auto windowed = std::count(c.swa_layers.begin(), c.swa_layers.end(), true);
      std::printf("window        %lld positions in %lld of %lld layers (rope base %g there)\n",
                  static_cast<long long>(c.sliding_window), static_cast<long long>(windowed),
                  static_cast<long long>(c.n_layers), static_cast<double>(c.rope_base_swa));
    }
    if (c.gelu) {
      char caps[64] = "";
      if (c.attn_softcap != 0.0f)
        std::snprintf(caps, sizeof caps, ", scores capped at %g", static_cast<double>(c.attn_softcap));
      if (c.final_softcap != 0.0f)
        std::snprintf(caps + std::strlen(caps), sizeof caps - std::strlen(caps), ", logits capped at %g",
                      static_cast<double>(c.final_softcap));
      std::printf("network       embeddings x %g, GELU MLP, queries x %g%s%s\n", static_cast<double>(c.embd_scale),
                  static_cast<double>(c.q_scale), c.post_norms ? ", post-norms" : "", caps);
    }
    std::printf("output head   %s\n", c.tied_embeddings ? "tied to the embeddings" : "separate");
    show_tokenizer(model->tokenizer(), [&]() -> const ChatTemplate& { return model->chat_template(); });
    std::printf("runs          yes (CPU kernels: %s)\n", kernels::cpu_simd_name());
  } catch (const std::exception& e) {
    // A file that holds a tokenizer and no network (a vocabulary-only GGUF) still shows it.
    const bool vocabulary_only = file.tensors().empty() && file.find("tokenizer.ggml.model") != nullptr;
    if (vocabulary_only) {
      try {
        const Tokenizer tok(Vocab::from_gguf(file));
        std::optional<ChatTemplate> chat_template;  // made when asked; show_tokenizer says why not
        show_tokenizer(tok, [&]() -> const ChatTemplate& { return chat_template.emplace(ChatTemplate::from_vocab(tok.vocab())); });
      } catch (const std::exception& why) {
        std::printf("tokenizer     unsupported (%s)\n", terminal_safe(why.what()).c_str());
      }
      std::printf("runs          no: the file holds no tensors (a vocabulary only)\n");
    } else {
      std::printf("runs          no: %s\n", terminal_safe(e.what()).c_str());
    }
  }
  if (in.tensors) {
    for (const auto& t : file.tensors()) {
      std::string shape;
      for (std::size_t i = 0; i < t.shape.size(); ++i) shape += (i ? " x " : "") + std::to_string(t.shape[i]);
      std::printf("  %-32s %-7s %-16s %s\n", terminal_safe(t.name).c_str(), std::string(t.type_name()).c_str(),
                  shape.c_str(), gguf::human_bytes(static_cast<double>(t.n_bytes)).c_str());
    }
  }
  return 0;
}

}  // namespace

void add_engine_commands(CLI::App& app) {
  generate_cmd = app.add_subcommand("generate", "Stream a completion from a local GGUF model");
  generate_cmd->footer(
      "Examples:\n"
      "  batchlm generate \"Once upon a time\" --max-tokens 64\n"
      "  batchlm generate --chat -p \"What is 17 * 3?\" --temperature 0\n"
      "  echo \"Summarize: ...\" | batchlm generate --chat -f -\n\n"
      "Exit status: 0 done, 130 interrupted (Ctrl-C), 2 bad usage, a model that cannot be loaded, or one\n"
      "whose output is not a number.");
  g.model = default_model();
  generate_cmd->add_option("--model,-m", g.model, "GGUF model file (default: $BATCHLM_MODEL or the default model)")
      ->capture_default_str();
  g.prompt_option = generate_cmd->add_option("prompt,--prompt,-p", g.prompt, "Prompt text (or give it as the one argument)");
  generate_cmd->add_option("--file,-f", g.file, "Read the prompt from a file (- for stdin)");
  generate_cmd->add_flag("--chat", g.chat, "Apply the model's chat template (the prompt is the user turn)");
  generate_cmd->add_option("--system", g.system, "System message (with --chat)");
  generate_cmd->add_option("--max-tokens,-n", g.max_tokens, "Tokens to generate at most")
      ->capture_default_str()->check(app::at_least(1));
  generate_cmd->add_option("--temperature", g.temperature, "Sampling temperature; 0 is greedy")
      ->capture_default_str()->check(app::between(0, 2, false));
  generate_cmd->add_option("--top-p", g.top_p, "Nucleus sampling threshold")
      ->capture_default_str()->check(app::between(0, 1, false));
  generate_cmd->add_option("--top-k", g.top_k, "Sample among the k most likely tokens; 0 or -1: all (as top_k in a request)")
      ->capture_default_str()->check(app::at_least(-1));
  generate_cmd->add_option("--seed", g.seed, "Random seed (default: random)")
      ->check(CLI::Validator(
          [](std::string& text) {
            // Whole digits that fit 64 bits: "-1" must not wrap around, nor 2^64 saturate.
            unsigned long long v = 0;
            const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), v);
            return error == std::errc() && end == text.data() + text.size() && !text.empty() && text[0] != '-'
                       ? std::string()
                       : "must be an integer from 0 to 18446744073709551615, got '" + text + "'";
          },
          "UINT64"));
  generate_cmd->add_option("--threads,-t", g.threads, "Compute threads; 0: one per hardware thread")
      ->capture_default_str()->check(app::at_least(0));
  generate_cmd->add_option("--context", g.context, "Context size in tokens; 0: min(model's, 4096)")
      ->check(app::at_least(0));
  generate_cmd->add_option("--device", g.device, "Where the model runs: auto (CUDA when a GPU can run the model), cuda or cpu")
      ->check(CLI::IsMember({"auto", "cuda", "cpu"}))->capture_default_str();
  generate_cmd->add_option("--stop", g.stop, "Stop before this text (repeatable)")
      ->check(CLI::Validator(
          [](std::string& text) { return text.empty() ? std::string(runner::kEmptyStopString) : std::string(); },
          ""));
  generate_cmd->add_flag("--ignore-eos", g.ignore_eos, "Keep generating past end-of-turn tokens");
  generate_cmd->add_flag("--timings", g.timings,
                         "Print prompt and generation speed as one JSON line on stderr");

  inspect_cmd = app.add_subcommand("inspect", "Describe a GGUF model: architecture, sizes, types, tokenizer");
  inspect_cmd->footer("Exit status: 0 described, 2 a file that is not a GGUF model it can read.");
  in.model = default_model();
  inspect_cmd->add_option("model", in.model, "GGUF model file (default: $BATCHLM_MODEL or the default model)")->capture_default_str();
  inspect_cmd->add_flag("--tensors", in.tensors, "List every tensor");
}

int run_engine_command() {
  if (generate_cmd && *generate_cmd) return run_generate();
  if (inspect_cmd && *inspect_cmd) return run_inspect();
  return -1;
}

local_engine::SpeculativeOptions speculative_options(const runner::BackendSpec::Speculative& spec) {
  local_engine::SpeculativeOptions o;
  o.method = local_engine::parse_spec_method(spec.method).value_or(local_engine::SpecMethod::kNone);
  if (o.method == local_engine::SpecMethod::kDraft) {
    if (spec.model.empty()) throw std::runtime_error("the draft method needs a draft model");
    if (!std::filesystem::exists(spec.model))
      throw std::runtime_error("draft model file '" + spec.model + "' not found");
  }
  o.model = spec.model;
  o.layers = spec.layers;
  o.k_max = spec.k_max;
  o.k_min = spec.k_min;
  o.ngram_max = spec.ngram_max;
  o.ngram_min = spec.ngram_min;
  return o;
}

}  // namespace batchlm::app
