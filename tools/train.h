#pragma once
// `memfit train`: trains a model on its data under the flags' settings, or
// under a plan for --budget, with save, resume and a JSON report.

#include "workload.h"

#include "memfit/module_plan.h"

#include <CLI/CLI.hpp>

#include <optional>
#include <string>
#include <vector>

namespace memfit::tools {


struct TrainArgs : ModelArgs {
  int64_t batch = 64;
  int64_t steps = 300;
  int64_t epochs = 0;
  double lr = 1e-3;
  std::string optimizer = "adam";
  std::string optimizer_kernel = "auto";
  uint64_t seed = 0;
  std::string budget;
  std::string report;
  int64_t eval_batch = 256;
  bool no_eval = false;
  bool quiet = false;
  int threads = 0;
  std::string checkpoint = "none";
  std::string checkpoint_budget;
  bool offload_checkpoints = false;
  std::string precision = "fp32";
  std::string master_weights = "none";
  std::string device = "cpu";
  double clip_grad_norm = 0;
  bool skip_nonfinite = false;
  std::string on_out_of_memory = "auto";
  std::vector<std::string> budget_change;  // STEP:SIZE, each
  int64_t restore_after = 0;
  int64_t micro_batch = 0;
  int64_t prefetch_factor = 0;
  std::vector<std::string> freeze;
  std::vector<std::string> offload;
  std::string offload_tile;
  std::string save;
  int64_t save_every = 0;
  std::string resume;
  int64_t dist_timeout = 60;
  std::string dist_backend = "gloo";
  int64_t zero_stage = 0;
  std::string parallel = "data";
  int64_t chunks = 4;
  std::string schedule = "gpipe";
  std::string pipeline_checkpoint = "never";
  std::string plan = "auto";
};

/// Adds the `train` subcommand to `app`.
void add_train_command(CLI::App& app, TrainArgs& a);
/// Checks every flag of `train` together, before any work (usage errors);
/// returns the plan that --plan FILE names, if any.
std::optional<memfit::ModulePlan> validate_train(const TrainArgs& a);
/// Runs the training; returns the exit code.
int run_train(const TrainArgs& a, const std::optional<memfit::ModulePlan>& given);

} // namespace memfit::tools
