#pragma once
// `memfit plan`, `profile` and `find-batch`: the commands built on the module
// planner (module_plan.h), which measures the model's real training step as
// `train` runs it.

#include "workload.h"

#include <CLI/CLI.hpp>

#include <string>

namespace memfit::tools {


// memfit plan / memfit profile.
struct PlanArgs : ModelArgs {
  int64_t batch = 64;
  std::string budget;
  std::string optimizer = "adam";
  std::string precision = "fp32";
  std::string device = "cpu";
  bool json = false;
  int threads = 0;
  bool no_verify = false;
  std::string save;  // plan: also write the plan there (save_plan), for train --plan FILE
};

/// Which of the three commands runs.
enum class ModelCommand { kPlan, kProfile, kFindBatch };

/// Adds the `plan`, `profile` and `find-batch` subcommands to `app`.
void add_plan_commands(CLI::App& app, PlanArgs& a);
/// Checks the flags together, before any work (usage errors).
void validate_model_command(const PlanArgs& a);
/// Runs `command`; returns the exit code.
int run_model_command(const PlanArgs& a, ModelCommand command);

} // namespace memfit::tools
