#pragma once
// `batchlm generate` and `batchlm inspect`: the embedded engine from the command line.

#include <CLI/CLI.hpp>

namespace batchlm::app {

// Adds the subcommands to `app`; `run_engine_command` runs whichever was chosen and returns
// the exit code, or -1 when neither was.
void add_engine_commands(CLI::App& app);
int run_engine_command();

}  // namespace batchlm::app
