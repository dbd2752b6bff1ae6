#pragma once
// memfit report: one self-contained HTML page from a `memfit train --report` JSON.

#include "memfit/module_plan.h"
#include "memfit/trainer.h"

#include <CLI/CLI.hpp>

#include <optional>
#include <string>

namespace memfit {
namespace tools {

/// What `memfit report` was asked.
struct ReportArgs {
  std::string run;     ///< The run's JSON report (memfit train --report).
  std::string output;  ///< The HTML file to write.
};

/// Adds the `report` subcommand to `app`.
void add_report_command(CLI::App& app, ReportArgs& args);

/// Writes the page; a file that is not a report memfit wrote is a usage
/// error (before any output). Returns the exit code.
int run_report(const ReportArgs& args);

/// Writes `memfit train --report`'s JSON to `path` (atomically): the run's
/// `report`, the environment, and the `plan` it trained under, if any.
void write_run_report(const std::string& path, const memfit::TrainReport& report,
                      const std::optional<memfit::ModulePlan>& plan);

/// The HTML page for the run report `json_text`: the memory of the largest
/// step phase by phase and by category, the peak of every step with the
/// plan's prediction and the budget, the loss curve, and the plan's reasons.
/// No network access: styles, data and the drawing script are inline.
std::string report_html(const std::string& json_text, const std::string& title);

} // namespace tools
} // namespace memfit
