#pragma once
// `batchlm generate`, `batchlm inspect` and `batchlm serve`: the embedded engine from the
// command line.

#include <string>

#include <CLI/CLI.hpp>

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

}  // namespace batchlm::app
