// memfit: the command-line tool, one command per file (train.cpp, plan.cpp,
// launch.cpp, generate.cpp, report.cpp). Exit codes: 0 success, 1 a run that
// failed (out of memory under the budget, missing data, I/O), 2 bad usage.

#include "compat.h"
#include "memfit/environment.h"
#include "memfit/optim.h"
#include "generate.h"
#include "launch.h"
#include "plan.h"
#include "report.h"
#include "train.h"
#include "usage.h"
#include "workload.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>


using namespace memfit::tools;


int main(int argc, char** argv) {
  // Freed host memory stays in the heap for the next step (environment.h), unless the user configured malloc.
  memfit::keep_freed_host_memory();
  CLI::App app{
      "memfit: train LibTorch models and batches that do not fit in memory.\n"
      "Exit codes: 0 success, 1 failed run (e.g. out of memory under --budget), 2 bad usage.",
      "memfit"};
  app.set_version_flag("--version", [] {  // the BLAS is looked up only when asked for
    return fmt::format("memfit 0.1.0 (LibTorch {}, {}, {}; BLAS: {}; optimizer kernel: {})", TORCH_VERSION,
                       memfit::compat::kBuiltWithCuda ? "CUDA" : "CPU only",
                       memfit::distributed_available() ? (memfit::nccl_available() ? "c10d Gloo and NCCL" : "c10d Gloo") : "no c10d", memfit::blas_info().name(),
                       memfit::optim::has_fused_kernels(torch::kCPU) ? "fused (Adam, AdamW, SGD)" : "loop (no fused kernels before LibTorch 2.4)");
  });
  app.require_subcommand(1);
  TrainArgs train_args;
  add_train_command(app, train_args);
  PlanArgs plan_args;
  add_plan_commands(app, plan_args);
  memfit::tools::LaunchArgs launch_args;
  memfit::tools::add_launch_command(app, launch_args);
  memfit::tools::GenerateArgs generate_args;
  memfit::tools::add_generate_command(app, generate_args);
  ReportArgs report_args;
  add_report_command(app, report_args);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string where = "memfit";
    for (const auto* sub : app.get_subcommands()) where += " " + sub->get_name();
    fmt::print(stderr, "{}: error: {} (see '{} --help')\n", where, memfit::tools::plain_parse_error(e.what()),
               where);
    return kExitUsage;
  }
  std::string where = "memfit";
  for (const auto* sub : app.get_subcommands()) where += " " + sub->get_name();
  try {
    if (app.got_subcommand("train")) {
      const auto given = validate_train(train_args);
      return run_train(train_args, given);
    }
    if (app.got_subcommand("launch")) return memfit::tools::run_launch(launch_args);
    if (app.got_subcommand("generate")) return memfit::tools::run_generate(generate_args);
    for (const auto& [name, command] : {std::pair{"plan", ModelCommand::kPlan},
                                        std::pair{"profile", ModelCommand::kProfile},
                                        std::pair{"find-batch", ModelCommand::kFindBatch}}) {
      if (!app.got_subcommand(name)) continue;
      validate_model_command(plan_args);
      return run_model_command(plan_args, command);
    }
    if (app.got_subcommand("report")) return run_report(report_args);
  } catch (const memfit::tools::UsageError& e) {
    fmt::print(stderr, "{}: error: {} (see '{} --help')\n", where, memfit::tools::with_flag_names(e.what()), where);
    return kExitUsage;
  } catch (const c10::Error& e) {
    fmt::print(stderr, "memfit: error: {}\n", memfit::tools::with_flag_names(e.msg()));
    return kExitFailure;
  } catch (const std::exception& e) {
    fmt::print(stderr, "memfit: error: {}\n", e.what());
    return kExitFailure;
  }
  return kExitUsage;
}
