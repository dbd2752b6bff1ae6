#pragma once
// The planner's choice: which candidates are timed with real steps, how
// their times are compared (the tie rule, docs/planner.md "The tie rule"),
// and which one a plan takes. Every tuning constant is in the block below,
// each with its reason; the predictions come from the step model
// (plan_model.h) and every text from the report (plan_report.h).

#include "plan_model.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace memfit {
namespace detail {

// ---- The tuning constants ----

// Predicted times this close to the fastest are a tie: the time model's
// run-to-run noise on a shared machine (ResNet plans at 1/4 of the plain
// peak: micro-batches of 64 with a checkpoint predicted 2% slower than
// micro-batches of 32 without, measured 7.6% slower side by side).
constexpr double kTimeTie = 0.03;
// Variants of one micro-batch size predicted this close to their group's
// fastest are all timed (to_time): twice the tie band, so that whether the
// prediction puts them within kTimeTie of each other does not decide which
// of them runs.
constexpr double kTimedVariants = 2 * kTimeTie;
// Measured times this close to the fastest are a tie between plans that
// compute differently (same_math: another micro-batch size, with batch
// statistics another normalisation, or another precision). One run of the
// planner settles its own passes within kTimeTie, but the same two plans'
// measured gap moves by about 2% more from one run to the next on a quiet
// machine (the ResNet at 15.36 MiB: micro-batches of 16 with a checkpoint
// timed 3.8%, 3.6% and -0.6% ahead of 8 without in three runs,
// tests/data/plan_stability_tight_runs.txt), so what a plan computes
// follows the times only beyond this wider band.
constexpr double kMathTie = 0.05;

// Passes over the candidates when choosing by measurement: at least two, and
// more (up to the most) while a contender's two fastest steps differ by more
// than the tie band (a busy machine's noise).
constexpr int kMinPasses = 2;
constexpr int kMaxPasses = 5;
// Passes before a plan that does less than the fastest measured loses to it
// by its time (see confirmed).
constexpr int kConfirmPasses = 3;
// Candidates measured within this of the fastest contend for the choice.
constexpr double kContender = 0.10;
// Where the machine's load is unknown, timings that spread more than this
// (timing_noise) come from a busy machine (see busy_machine).
constexpr double kBusy = 0.25;

// Candidates run for real before one is chosen, at most.
constexpr int kVerifyAttempts = 4;

// Examples a timed or verifying step of `batch` runs with `settings`: the
// whole batch up to kTimedExamples; above it, whole micro-batches, at least
// two and about kTimedExamples in all. Such a step peaks as the whole one
// does (the second micro-batch accumulates into the gradients the first
// made, as every later one does), and costs the same however large the batch.
// 64: at 128 planning a batch of 4096 cost the ResNet 2.33x what 64 did, and
// 64 chose no worse (docs/planner.md, "What planning costs").
constexpr int64_t kTimedExamples = 64;

// A step time is predicted for micro-batches at most this many times the
// largest one measured; beyond that, the line through small steps (whose
// fixed costs per call dominate) is no prediction: the MLP's, drawn through
// micro-batches of 2 and 3, were 0.8x to 5.9x its runs' times at 21 to 85
// times them (docs/planner.md, "Plans under ½, ¼ and ⅛ of the plain peak").
constexpr int64_t kTimeExtrapolation = 8;
// Where nothing can be timed (a recovery re-plans mid-step: replan_from_model),
// predicted times this close to the fastest are a tie, settled by what a
// plan does: the time model's error on this machine's plans reaches 25%
// (docs/planner.md), and a re-plan chosen at 3% once recomputed the LM's
// blocks at 1.28x the time of the micro-batches it passed over
// (docs/measurements/replan.txt, the second run of 2026-11-29).
constexpr double kPredictionTie = 0.25;

// ---- Ranking and timing ----

// The largest b in [1, top] with fits(b), for fits monotone (true up to
// some b, false above); 0 when fits(1) is false.
int64_t largest_fitting(int64_t top, const std::function<bool(int64_t)>& fits);

// Whether the step model can predict the time of micro-batches of `micro`
// examples (kTimeExtrapolation); the report says so where it cannot.
bool time_predictable(const ModuleStepModel::Impl& im, int64_t micro);

// Whether a plan may split the batch of a model whose first layer with batch
// statistics is `layer` (nullopt: none).
bool may_micro_batch(const PlanOptions& o, const std::optional<std::string>& layer);

// A candidate plan as the choice sees it.
struct Ranked {
  double seconds = 0;     // predicted time per logical batch
  int recomputes = 0;     // 1: some layer is recomputed (checkpointed, or selectively)
  int offload = 0;        // offload_rank: 0 none, 1 optimizer state, 2 and gradients, 3 and parameters, 4+ in tiles
  int64_t micro_batches = 1;
  int lower_precision = 0;  // 1: computes in a precision below fp32 (it changes the math)
  int64_t peak_bytes = 0;
  bool edge = false;      // predicted above the margin's limit but within the budget: it
                          // fits only where its real steps under the budget say so
  int64_t family = -1;    // candidates of one family (>= 0) differ only in what they offload
};

// Whether a candidate predicted at `peak` bytes, above the margin's `limit`,
// is still timed (an edge candidate): where the planner can run real steps
// under the budget (`can_time`, and PlanOptions::measure_candidates > 0),
// those steps, not the margin, say whether it fits. A hand-tuning user who
// tries a setting and sees it fit has the same right.
bool is_edge(const PlanOptions& o, bool can_time, int64_t peak, int64_t limit, int64_t budget);

// How the choice sees a plan with `settings` (whose schedules recompute, or
// not: `checkpoints`) and its prediction. Selective recomputation recomputes too.
Ranked ranked(const StepSettings& settings, const StepPrediction& predicted, bool checkpoints);

// The least predicted (or measured) time among `candidates`, edge ones
// included or not (infinity: none).
double fastest_seconds(const std::vector<Ranked>& candidates, bool with_edges);

// What a plan does, in the order a tie is settled: recomputation, then
// offload, then micro-batches (less of each first), then a precision below
// fp32 (fp32 first: it keeps the math; which is faster depends on the device,
// and a tie or a busy machine's choice has no times to say).
std::tuple<int, int, int64_t, int> work(const Ranked& c);
// work()'s order, as the plan's lines name it.
constexpr const char* kWorkOrder = "no recomputation, then less offload, then fewer micro-batches, then fp32";

// The index of the plan to choose among `candidates` (-1: none), edge ones
// aside (they have not run): of those within `tie` of the fastest (kTimeTie for predictions; for measured times,
// at least the measurement's own noise), the one without recomputation, then
// with less offload, then with fewer micro-batches, then in fp32, then the
// faster and the smaller. Ties are settled by what a plan does, never by which of them
// timing noise put ahead, and the answer does not depend on their order.
int64_t choose(const std::vector<Ranked>& candidates, double tie = kTimeTie);

// Whether plans `a` and `b` compute the same: as many micro-batches, in the
// same precision. Plans that differ only in what they recompute or offload
// give the same gradients, bitwise.
bool same_math(const Ranked& a, const Ranked& b);

// The tie band between measured plans `a` and `b` whose own timing's band is
// `tie`: that band where they compute the same (same_math), at least
// kMathTie where they do not.
double tie_between(const Ranked& a, const Ranked& b, double tie);

// choose() for measured times `ran`, `tie` their band: of each set of plans
// that compute the same (same_math), the one that does least (choose()'s
// order) among those within `tie` of the set's fastest and within
// max(kMathTie, tie) of the fastest of all; then, of those picks, the one
// that does least. Noise between runs may then change how a plan recomputes
// or offloads, which leaves its gradients as they were, but what it
// computes only where times lie more than kMathTie apart. Every plan within
// `tie` of the fastest is in its set's running, so the choice never does
// more than choose(ran, tie)'s.
int64_t choose_timed(const std::vector<Ranked>& ran, double tie);

// The members `at` of one timing group other than its `pick` that to_time
// times beside it: those predicted within kTimedVariants of the group's
// `fastest`, one per family (Ranked::family), the one that offloads least,
// the pick counting as its family's: a variant that offloads more than one
// timed already only adds copies to its step (see offload_adds_copies).
std::vector<size_t> close_variants(const std::vector<Ranked>& candidates, std::vector<size_t> at, size_t pick,
                                   double fastest);

// Which of `candidates` to time with real steps (PlanOptions::measure_candidates),
// at most `count` of them, in this order:
// - choose()'s pick, then the other members of its group (group[i]: candidate
//   i's micro-batch and precision, edge ones apart) predicted within
//   kTimedVariants of the group's fastest (close_variants): the prediction
//   cannot tell them apart, so which of them it puts first would follow the
//   profile's noise;
// - each other group's pick among those predicted within (1 + within) × the
//   fastest prediction, fastest predicted first (predictions err most across
//   micro-batch sizes);
// - then those groups' own close variants, in the same order.
std::vector<size_t> to_time(const std::vector<Ranked>& candidates, const std::vector<int64_t>& group,
                            double within, int64_t count);

// The group of a candidate with `s` for to_time: its micro-batch and
// precision, and whether it is an edge candidate (see is_edge()).
int64_t timing_group(const StepSettings& s, bool edge);

// What real steps of a candidate measured: seconds per logical batch (0: a
// step ran out of memory under the budget) and their peak.
struct StepTiming {
  double seconds = 0;
  int64_t peak_bytes = 0;
  // Where a step ran out of memory on CUDA: the failing phase's allocated
  // peak and the caching allocator's reserved peak, which the budget caps.
  int64_t failed_allocated = 0, failed_reserved = 0;
};

// A candidate's timed steps `v` (at least two): how far apart its two
// fastest land, less 1.
double two_fastest_gap(std::vector<double> v);

// Whether candidate timings `v` contend for the choice: their fastest is
// within kContender of `best`, the fastest of all.
bool contends(const std::vector<double>& v, double best);

// The fastest of all timings `samples` (infinity: none ran).
double fastest_sample(const std::vector<std::vector<double>>& samples);

// Whether the timings `samples` (per candidate; empty: ran out of memory)
// settle the choice: every contender's two fastest agree within kTimeTie.
bool settled(const std::vector<std::vector<double>>& samples);

// Whether the timings `samples` (of candidates `order`; empty: ran out of
// memory or not run) after `passes` may give the choice to a plan that does
// more than another timed one: no candidate that does less (earlier in
// choose()'s order: no recomputation, less offload, fewer micro-batches, fp32) than
// the fastest lost to it beyond their tie band (tie_between), or kConfirmPasses have run. A
// shared machine's slow spell can last a candidate's two steps; a third pass
// confirms the loss before the plan does more work for it.
bool confirmed(const std::vector<Ranked>& candidates, const std::vector<size_t>& order,
               const std::vector<std::vector<double>>& samples, int passes);

// How far apart a timing's repeats land, where they did not settle: the
// largest two_fastest_gap of a contender (0 when settled, or when none ran
// twice). A slower candidate's noise cannot widen the tie between faster ones.
double timing_noise(const std::vector<std::vector<double>>& samples);

// Whether timings ran on a busy machine: other processes left fewer free
// cores (CpuLoad::free_cores, -1: unknown) than LibTorch has threads, so its
// threads took turns with them and every step slowed unevenly; where the load
// is unknown, whether the timings spread by more than kBusy.
bool busy_machine(double free_cores, int threads, double noise);

// The one of `candidates` that does least (-1: none): of all predicted to fit,
// edge ones aside, less those whose steps ran out of memory (out_of_memory[k]
// for candidate order[k]), the first in choose()'s order without times (no
// recomputation, less offload, fewer micro-batches, fp32, then fewer bytes):
// the same answer whatever noise made of the times, or of the predictions.
int64_t does_least(const std::vector<Ranked>& candidates, const std::vector<size_t>& order,
                   const std::vector<bool>& out_of_memory);

// Offloading only adds copies: a candidate's time is at least that of each
// one of its family (Ranked::family) that offloads less, so timing noise
// cannot put a larger offload of the same step ahead, and their tie goes to
// the one that offloads less.
void offload_adds_copies(std::vector<Ranked>& candidates);

// What choose_measured measured and chose.
struct Measured {
  int64_t chosen = -1;              // index into the candidates (-1: none ran)
  int64_t chosen_timed = -1;        // index into timed of the chosen (-1: none ran, or a busy machine's choice)
  std::vector<StepTiming> timed;    // each one's timing, in the order timed
  int passes = 0;                   // passes over the candidates
  double tie = kTimeTie;            // the tie band used: kTimeTie or the noise, the larger (kMathTie at
                                    // least between plans that compute differently: tie_between)
  bool busy = false;                // a busy machine (busy_machine): what the plans do chose
  double free_cores = -1;           // the cores other processes left free while timing (-1: unknown)
};

// Times candidates `order` with `run` in passes, every other one in reverse
// order (drift on a shared machine then weighs on all alike), kMinPasses to
// kMaxPasses of them (see settled and confirmed), and returns choose_timed()'s pick among
// those that ran, with each one's fastest measured time in place of its
// prediction. Times closer than the measurement's noise (timing_noise) are a
// tie too, plans that compute differently tie within kMathTie at least, and a candidate is timed at least as slow as one of its family
// that offloads less (offload_adds_copies). On a busy machine (busy_machine; `free_cores` says how many cores
// other processes left, by default a CpuLoad over the passes) times decide
// nothing: of all the candidates predicted to fit whose steps did not run out
// of memory, the one that does least is chosen (choose()'s order: no
// recomputation, less offload, fewer micro-batches, fp32, then fewer bytes), so the
// plan depends neither on the noise nor on which candidates the noisy
// predictions put forward. A candidate that runs out of memory is not run again.
Measured choose_measured(const std::vector<Ranked>& candidates, const std::vector<size_t>& order,
                         const std::function<StepTiming(size_t)>& run,
                         std::function<double()> free_cores = nullptr);

} // namespace detail

// A combination of the grid with each chain's schedule, and its prediction.
struct Candidate {
  StepSettings settings;
  std::vector<Schedule> schedules;
  StepPrediction predicted;
  bool edge = false;  // predicted above the margin's limit, within the budget (detail::is_edge)
};

// Whether `a` and `b` run the same step: the same settings, and schedules
// that recompute the same (a schedule that recomputes nothing is none).
bool same_candidate(const Candidate& a, const Candidate& b);

// One search of the grid (search()).
struct Search {
  std::vector<Candidate> fitting;  // predicted to fit
  std::optional<Candidate> closest;
  int64_t candidates = 0;
};

// Every combination of the grid for a step of `batch` examples (in one pass
// unless `micro_batching`), with each chain's schedule solved where the plain
// chains do not fit: under PlanOptions::margin of the budget, scaled by `room`
// (the share of reserved bytes that the device's allocator leaves allocated).
// Settings that `allowed` refuses (where given) are not considered.
Search search(const ModuleStepModel& model, const ModuleStepModel::Impl& im, int64_t batch, int64_t budget,
              bool micro_batching, double room = 1.0,
              const std::function<bool(const StepSettings&)>& allowed = nullptr);

// The one of `all[pool]` to choose (detail::choose) among those whose
// prediction, scaled by `correction`, fits `limit`; nullopt when none.
// Predicted times within `tie` of the fastest are a tie (detail::choose).
std::optional<size_t> best_fitting(const std::vector<Candidate>& all, const std::vector<size_t>& pool,
                                   double correction, int64_t limit, double tie = detail::kTimeTie);
// The same among all of `all`.
std::optional<size_t> best_fitting(const std::vector<Candidate>& all, double correction, int64_t limit,
                                   double tie = detail::kTimeTie);

// `steps` real steps of `c` under `budget`, of `batch` examples or, for a
// large micro-batched batch, of timed_examples: the steady steps' peak and
// the faster one's time (seconds 0 and peak -1 when one ran out of memory
// under it), a shorter step's time scaled to the batch by `model`'s
// prediction of both. The first step creates the optimizer's state and is
// not counted.
detail::StepTiming run_plan(const ModuleStepModel& model, const ModuleStepModel::Impl& im, const Candidate& c,
                            int64_t batch, int64_t budget, int steps = 3);

// One round of real steps (detail::choose_measured) over some candidates.
struct TimedRound {
  std::vector<size_t> order;  // the candidates timed (indices into Decision::candidates), in the order timed
  detail::Measured measured;  // their timings; measured.chosen indexes Decision::candidates (-1: none)
  bool part_batches = false;  // some ran steps of whole micro-batches, not the batch (kTimedExamples)

  // Where in `order` the chosen one is, if it was timed.
  std::optional<size_t> chosen_at() const;
};

// A candidate whose steps, run under the budget to verify it, overran it.
struct Overrun {
  size_t candidate = 0;    // index into Decision::candidates
  int64_t peak_bytes = 0;  // their peak (-1: out of memory)
};

// What plan() decided, before any of it is put in words (plan_report.h
// renders it): every candidate by index, what was timed and verified, and
// the one chosen.
struct Decision {
  int64_t budget = 0, batch = 0;
  int64_t limit = 0;                  // PlanOptions::margin of the budget
  bool micro_batching = false;        // whether the batch could be split
  StepPrediction plain;               // the plain step's prediction
  std::vector<Candidate> candidates;  // predicted to fit: the search's, then those of a search within `room`
  int64_t considered = 0;             // combinations considered
  std::optional<Candidate> closest;   // the least predicted peak of all (for "nothing fits")
  std::vector<TimedRound> rounds;     // the search's timed candidates, then those within `room`
  double room = 1.0;                  // < 1: searched again within this share of the limit (CUDA's reserved bytes)
  bool kept_earlier = false;          // the second round measured no faster: the first's choice stays
  std::vector<Overrun> overruns;      // candidates whose verifying steps overran the budget
  int64_t chosen = -1;                // index into candidates (-1: nothing fits)
  double measured_seconds = 0;        // the chosen one's timed seconds (0: not timed)
  double step_seconds = 0;            // its time as told: measured, else predicted where predictable, else 0
  int64_t measured_peak_bytes = 0;    // its real steps' peak under the budget (0: not run)
  double measured_tie = 0;            // the last round's tie band (0: nothing timed)
};

// Chooses the step for a batch of `batch` under `budget`: searches the grid,
// times the closest candidates with real steps (PlanOptions::measure_candidates),
// searches again within the caching allocator's room where steps ran out of
// memory with bytes reserved beyond those allocated, and verifies the choice
// under the budget (PlanOptions::verify). `im` may measure the settings it
// held back (streamed parameters) where a plan needs them.
Decision decide(const ModuleStepModel& model, ModuleStepModel::Impl& im, int64_t budget, int64_t batch);

} // namespace memfit
