#include "plan.h"

#include "memfit/data.h"
#include "memfit/environment.h"
#include "memfit/memory.h"
#include "memfit/module_plan.h"
#include "memfit/plan.h"
#include "memfit/precision.h"
#include "memfit/checkpoint.h"
#include "memfit/schedule.h"
#include "memfit/state.h"
#include "memfit/trainer.h"
#include "usage.h"


#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <optional>

namespace memfit::tools {
namespace {


void add_model_options(CLI::App* cmd, PlanArgs& a) {
  add_model_shape_options(cmd, a);
  cmd->add_option("--batch", a.batch, "Examples per optimizer step (positive)")
      ->check(memfit::tools::integer(1, kMaxBatch))
      ->capture_default_str();
  cmd->add_option("--optimizer", a.optimizer, "Optimizer: sgd (momentum 0.9), adam or adamw")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}))
      ->capture_default_str();
  cmd->add_option("--precision", a.precision,
                  "Precision: fp32, bf16, auto (bf16 where supported), or any (the planner "
                  "may choose fp32 or bf16)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16", "auto", "any"}))
      ->capture_default_str();
  cmd->add_option("--device", a.device, "Device: cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_flag("--json", a.json, "Print JSON instead of a table");
  cmd->add_option("--threads", a.threads, "CPU threads (0: OMP_NUM_THREADS if set, else every hardware thread)")
      ->check(memfit::tools::integer(0, 4096));
}

// --budget, required by plan and find-batch.
void add_budget_option(CLI::App* cmd, PlanArgs& a) {
  cmd->add_option("--budget", a.budget, "Memory budget, e.g. 32MiB")
      ->required()
      ->check(memfit::tools::memory_size());
}

// The built-in or TorchScript model as `train` trains it: its layers in one
// chain (named "0"), where the plan may checkpoint them.
torch::nn::Sequential planned_model(const Workload& w) {
  return torch::nn::Sequential(memfit::CheckpointedSequential(w.make()));
}

} // namespace


void add_plan_commands(CLI::App& app, PlanArgs& a) {
  auto* plan = app.add_subcommand(
      "plan", "Choose the fastest micro-batch, checkpoint schedule, precision and offload that "
              "fit a memory budget, with the predicted peak and why");
  add_model_options(plan, a);
  add_budget_option(plan, a);
  plan->add_option("--save", a.save, "Also write the plan to FILE, atomically, for `memfit train --plan FILE`")
      ->check(memfit::tools::path("file"));
  auto* profile = app.add_subcommand(
      "profile", "Measure each layer's activation bytes and time, and predict the step's peak");
  add_model_options(profile, a);
  auto* find = app.add_subcommand(
      "find-batch", "The largest batch that fits a budget in one pass, plainly and with memfit's "
                    "techniques, predicted then verified by real steps; and the plan for --batch");
  add_model_options(find, a);
  add_budget_option(find, a);
  find->add_flag("--no-verify", a.no_verify, "Predict only; skip the verifying steps");
}

// Every usage error of `memfit plan`, `profile` and `find-batch`.
void validate_model_command(const PlanArgs& a) {
  check_device_and_precision(a.device, a.precision);
  check_omp_num_threads(a.threads);
  if (!a.save.empty()) memfit::tools::check_output("--save", a.save, {a.torchscript});
  memfit::tools::usage_check(a.batch >= 4, "--batch ", a.batch, ": the planner measures the step in micro-batches of two "
              "sizes, so it plans batches of 4 examples or more; use --batch 4 or more");
  check_model_fits(a);
}


int run_model_command(const PlanArgs& a, ModelCommand command) {
  const torch::Device device = parse_device(a.device);
  memfit::memory_allocated(device);
  const std::string blas_warning = set_threads(a.threads);  // printed once the usage checks pass
  torch::manual_seed(0);
  auto workload = load_workload(a, /*with_test=*/false);
  check_batch_within_data(a.batch, workload);
  print_warning(blas_warning);
  auto model = planned_model(workload);
  auto options = plan_options(a, plan_precisions(a.precision, device));
  const auto base = memfit::TrainerOptions()
                        .optimizer(memfit::parse_optimizer_kind(a.optimizer))
                        .device(device)
                        .batch_size(a.batch);
  if (command == ModelCommand::kProfile) {
    // The model as built (with --selective-recompute, its blocks recompute),
    // in the first precision, nothing else measured.
    options.offload(false).selective_recompute(a.selective_recompute ? memfit::SelectiveRecompute::kOn
                                                                     : memfit::SelectiveRecompute::kOff);
    const auto p = memfit::profile(model, sample_of(workload.train, a.batch), options, base);
    if (a.json) {
      fmt::print("{}\n", p.to_json());
    } else {
      fmt::print("profile of {} at batch {} ({}):\n{}", a.torchscript.empty() ? a.model : a.torchscript, a.batch,
                 memfit::to_string(p.precision), p.table());
    }
    return 0;
  }
  const int64_t budget = memfit::parse_memory_size(a.budget);
  options = memfit::detail::measuring_within(options, budget);  // measuring keeps within the budget it plans for
  if (command == ModelCommand::kPlan) {
    const auto plan = memfit::plan(model, sample_of(workload.train, a.batch), budget, options, base);
    if (!a.save.empty()) memfit::save_plan(plan, a.save);  // memfit train --plan FILE trains with it
    fmt::print("{}", a.json ? plan.to_json() + "\n" : memfit::tools::with_flag_names(plan.explain()));
    return 0;
  }
  // find-batch: the step measured on the data set's first examples, as many
  // as a verified answer may run.
  // One measured model answers both: the largest batches and the plan for --batch.
  const auto find = memfit::FindBatchOptions().verify(!a.no_verify);
  const int64_t examples = std::min(workload.train.size(), std::max(find.max_batch(), a.batch));
  const memfit::ModuleStepModel step(memfit::detail::make_probe(model, sample_of(workload.train, examples)),
                                     memfit::PlanOptions(options).verify(!a.no_verify), base);
  const auto found = memfit::find_batch(step, budget, find);
  std::optional<memfit::ModulePlan> logical;  // micro-batched, for --batch
  try {
    logical = memfit::plan(step, budget, a.batch);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "memfit find-batch: {}\n", memfit::tools::with_flag_names(e.msg()));
  }
  const int rc = found.plain.batch > 0 || found.techniques.batch > 0 ? 0 : 1;
  if (a.json) {
    auto j = nlohmann::json::parse(found.to_json());
    if (logical) j["plan_for_batch"] = nlohmann::json::parse(logical->to_json());
    fmt::print("{}\n", j.dump(2));
    return rc;
  }
  fmt::print("{}{}", memfit::tools::with_flag_names(found.explain()),
             logical ? fmt::format("any logical batch fits with micro-batching; for --batch {}:\n{}", a.batch,
                                   memfit::tools::with_flag_names(logical->explain()))
                     : std::string());
  return rc;
}

} // namespace memfit::tools
