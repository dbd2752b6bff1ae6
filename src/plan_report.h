#pragma once
// The planner's report: every line of text a plan, a batch search or an
// error says about the step model's predictions and the choice's timings.

#include "plan_choice.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace memfit {
namespace detail {

// The plan's line on micro-batching: how many, and whether the math changes.
std::string micro_batch_text(const PlanOptions& o, const std::optional<std::string>& layer,
                             int64_t micro, int64_t steps, int64_t batch);

// What each of the chosen settings does, one line each: precision, selective
// recomputation (when it was measured both ways), checkpointing
// (`checkpoint`: the schedules' text, "" for none), and offload.
std::vector<std::string> settings_lines(const StepSettings& s, bool selective_measured,
                                        const std::string& checkpoint);

// What a plan that found nothing could still be allowed: "; ..." clauses naming the
// options, or "".
std::string unlock_text(const PlanOptions& o, const std::optional<std::string>& layer);

// A plan's micro-batch, precision and offload, in a line of text.
std::string settings_text(const StepSettings& s, int64_t batch);

// What the line on the candidates timed says of an edge one (see is_edge).
std::string edge_text(bool edge, int64_t peak_bytes);

// The plan's line on a chosen edge candidate: predicted above the limit, it
// fits by its steps' peak.
std::string edge_chosen_text(int64_t predicted_peak, int64_t limit, const PlanOptions& o,
                             int64_t measured_peak);

// The line on a candidate whose steps ran out of memory under the budget.
std::string out_of_memory_text(const StepTiming& t);

// What a busy machine's plan advises: with `threads` intra-op threads where
// other processes left `free_cores` (-1: unknown), as many threads as free
// cores would stop LibTorch's threads taking turns with them ("": no
// fewer would). With one core of two busy, planning the GPT took 111 s
// with two threads and 18 s with one, its steps 2.5-3.3 s against 0.24 s
// (docs/measurements/plan_busy_threads.txt).
std::string threads_advice(double free_cores, int threads);

// What timed_text says of the band between plans that compute differently
// (tie_between), where it is wider than `tie`.
std::string math_tie_text(double tie);

// What timed_text says of the choice: "chose the fastest measured" only
// where it was; a plan chosen within the tie band over a faster one is
// named, with how far behind it measured and what decided (choose_timed:
// within the tie, what a plan does, as choose() orders it).
std::string choice_text(const std::vector<std::string>& names, const Measured& m);

// The plan's line on the candidates timed: each one's `names` entry with its
// predicted and measured time, in the order timed, and what was chosen.
std::string timed_text(const std::vector<std::string>& names, const std::vector<double>& predicted,
                       const Measured& m);

// Each chain's name and schedule.
std::string schedules_text(const std::vector<std::string>& chains, const std::vector<Schedule>& s);

// What the chains recompute: their schedules, or `none` where none does.
std::string checkpoint_text(const std::vector<std::string>& chains, const std::vector<Schedule>& s,
                            const std::string& none = "none");

// A candidate's settings and each chain's schedule, as the plan's lines name it.
std::string candidate_text(const Candidate& c, int64_t batch, const std::vector<std::string>& chains);

} // namespace detail

// A plan's reasons, one line each, in the order the decision `d` was made:
// what was measured, the plain step, each round of timed candidates, the
// overruns of verification, and what the chosen one does, predicts and ran at.
std::vector<std::string> plan_why(const ModuleStepModel::Impl& im, const Decision& d);

// Why nothing fits `d`'s budget: what was tried, the closest prediction, and
// what the options could still allow.
std::string nothing_fits_text(const ModuleStepModel::Impl& im, const Decision& d);

} // namespace memfit
