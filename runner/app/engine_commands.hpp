#pragma once
// `batchlm generate`, `batchlm inspect` and `batchlm serve`: the embedded engine from the
// command line.

#include <string>

#include <CLI/CLI.hpp>

#include "batchlm/local_engine/spec.hpp"
#include "batchlm/runner/job.hpp"

namespace batchlm::app {

// Adds the subcommands to `app`; `run_engine_command` runs whichever was chosen and returns
// the exit code, or -1 when neither was.
void add_engine_commands(CLI::App& app);
int run_engine_command();

// `batchlm serve` (serve_command.cpp), the same way.
void add_serve_command(CLI::App& app);
int run_serve_command();

// The GGUF used when none is named: $BATCHLM_MODEL, else the default model's path.
std::string default_model();

// Why a model path cannot be used, or "" when it is a file: names the path, the working
// directory a relative path was looked up in, how to fetch the default model and
// `how_to_choose` another ("set backend.model, $BATCHLM_MODEL or --model").
std::string model_file_problem(const std::string& path, const std::string& how_to_choose);

// The engine's speculative options from a job's (or serve's flags') validated settings.
// Throws std::runtime_error when the draft method's model file is missing.
local_engine::SpeculativeOptions speculative_options(const runner::BackendSpec::Speculative& spec);

}  // namespace batchlm::app
