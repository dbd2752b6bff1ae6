#pragma once
// `memfit launch`: starts the worker processes of a data-parallel job on this
// machine with torchrun's variables, and ends them all when one fails.

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace memfit::tools {

/// What `memfit launch` was asked.
struct LaunchArgs {
  int64_t nproc = 1;        ///< Workers on this machine.
  int64_t nnodes = 1;       ///< Machines in the job.
  int64_t node_rank = 0;    ///< This machine's index.
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 29500;
  double grace = 10;        ///< Seconds between SIGTERM and SIGKILL for the others.
  std::vector<std::string> command;  ///< The worker's command line.
};

/// Adds the `launch` subcommand to `app`.
void add_launch_command(CLI::App& app, LaunchArgs& args);

/// Runs the workers; returns 0 when all succeed, else the first failing
/// worker's exit status (128 + signal when one was killed).
int run_launch(const LaunchArgs& args);

} // namespace memfit::tools
