#pragma once
// The planner's parts that its tests reach on their own: how candidates are
// ranked, timed and chosen (choose, to_time, choose_measured), the texts of
// a plan's reasons, the guards that put a module back after measuring, and
// the wire format that broadcast_plan and save_plan carry (plan.cpp).

#include "compat.h"
#include "memfit/environment.h"
#include "memfit/memory.h"
#include "memfit/plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace memfit {
namespace detail {

// v(m) on the line through (b_small, small) and (b_large, large); when that
// line would cross zero above m = 0, the line through 0 and (b_large, large)
// instead, so small batches never look free; when it falls (a step whose time
// is mostly fixed, as a GPU's at small batches or a streamed chain's
// fetches, and timing noise tipped it), the larger of the two, flat, so that
// each micro-batch costs its fixed time. (Through 0 there, every micro-batch
// size of a batch cost the same: the MLP streamed at micro-batches of 1 and 2
// predicted all of them at 45 ms, and the plan took tiles of 24.50 KiB at
// 17.9 ms where tiles of 392 KiB take 5.6 ms.)
inline double line(double small, double large, int64_t b_small, int64_t b_large, int64_t m) {
  const double slope = (large - small) / double(b_large - b_small);
  const double intercept = small - slope * double(b_small);
  if (slope < 0) return std::max({0.0, small, large});
  if (intercept < 0) return std::max(0.0, large) * double(m) / double(b_large);
  return intercept + slope * double(m);
}

// `out`'s layers' byte figures (input, output, kept, forward peak, backward
// overhead), each bytes(a's, b's): from two profiles of one chain at two
// batches, a line through them (each planner draws its own).
template <class Bytes>
void scale_layer_bytes(ChainProfile& out, const ChainProfile& a, const ChainProfile& b, const Bytes& bytes) {
  for (size_t i = 0; i < out.layers.size(); ++i) {
    auto& l = out.layers[i];
    const auto& x = a.layers[i];
    const auto& y = b.layers[i];
    l.input_bytes = bytes(x.input_bytes, y.input_bytes);
    l.output_bytes = bytes(x.output_bytes, y.output_bytes);
    l.kept_bytes = bytes(x.kept_bytes, y.kept_bytes);
    l.forward_peak_bytes = bytes(x.forward_peak_bytes, y.forward_peak_bytes);
    l.backward_overhead_bytes = bytes(x.backward_overhead_bytes, y.backward_overhead_bytes);
  }
}

// The largest b in [1, top] with fits(b), for fits monotone (true up to
// some b, false above); 0 when fits(1) is false.
inline int64_t largest_fitting(int64_t top, const std::function<bool(int64_t)>& fits) {
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = top;
  if (fits(hi)) return hi;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

// Whether a plan may split the batch of a model whose first layer with batch
// statistics is `layer` (nullopt: none).
inline bool may_micro_batch(const PlanOptions& o, const std::optional<std::string>& layer) {
  return o.micro_batching() && (!layer || o.batch_statistics() == BatchStatistics::kPerMicroBatch);
}

// The plan's line on micro-batching: how many, and whether the math changes.
inline std::string micro_batch_text(const PlanOptions& o, const std::optional<std::string>& layer,
                                    int64_t micro, int64_t steps, int64_t batch) {
  if (steps > 1 && layer) {
    return fmt::format("micro-batches of {} ({} per batch of {}): one micro-batch of activations at a time; "
                       "the math changes: BatchNorm layer '{}' (and any other) normalises each micro-batch of {} "
                       "with its own statistics, not the batch of {} (allowed by PlanOptions::batch_statistics(kPerMicroBatch))",
                       micro, steps, batch, *layer, micro, batch);
  }
  if (steps > 1) {
    return fmt::format("micro-batches of {} ({} per batch of {}): one micro-batch of activations at a time, "
                       "the same gradient", micro, steps, batch);
  }
  if (layer && o.micro_batching() && !may_micro_batch(o, layer)) {
    return fmt::format("no micro-batching: the whole batch at once, as BatchNorm layer '{}' needs for the "
                       "batch's statistics (PlanOptions::batch_statistics(kPerMicroBatch) lets micro-batches "
                       "change them)", *layer);
  }
  return "no micro-batching: the whole batch at once";
}

// Figures a planner knows about its chosen settings, for settings_lines ("" where it has none).
struct SettingsDetail {
  std::string optimizer_state;  // e.g. " (1.20 MiB)"
  std::string crossing;         // what one crossing of the parameters costs, e.g. " (0.4 ms each time)"
  std::string tiles;            // what the tiles' smaller products cost, e.g. ", whose ... add 0.1 ms"
};

// What each of the chosen settings does, one line each: precision, selective
// recomputation (when it was measured both ways), checkpointing
// (`checkpoint`: the schedules' text, "" for none), and offload.
inline std::vector<std::string> settings_lines(const StepSettings& s, bool selective_measured,
                                               const std::string& checkpoint, const SettingsDetail& d = {}) {
  std::vector<std::string> out;
  out.push_back(s.precision() == Precision::kFP32
                    ? std::string("precision fp32: the math is unchanged")
                    : fmt::format("precision {}: autocast lowers activation bytes and time (numerics change "
                                  "within autocast's tolerance)", to_string(s.precision())));
  if (selective_measured) {
    out.push_back(s.selective_recompute()
                      ? std::string("selective recomputation: the model's SelectivelyRecomputed parts (make_gpt's "
                                    "blocks: attention scores, softmax and attention dropout) are recomputed in "
                                    "backward instead of kept")
                      : std::string("no selective recomputation: the SelectivelyRecomputed parts keep what they mark"));
  }
  out.push_back(checkpoint.empty() ? std::string("no checkpointing: every activation is kept")
                                   : fmt::format("checkpoint schedule {} (optimal for the memory left): "
                                                 "recomputation instead of storage", checkpoint));
  out.push_back(s.offload_optimizer() == Offload::kHost
                    ? fmt::format("optimizer state{} in host memory, stepped there", d.optimizer_state)
                    : std::string("optimizer state on the device"));
  if (s.offload_gradients() == Offload::kHost) {
    out.push_back("gradients moved to the host as backward produces them (accumulated there): "
                  "the device holds about one parameter's gradient at a time");
  }
  if (s.offload_parameters() == Offload::kHost) {
    out.push_back(fmt::format(
        "parameters in host memory, streamed to the device layer by layer ({}): every parameter crosses twice "
        "per micro-batch{}, layers other than Linear run forward once more",
        s.tile_bytes() > 0 ? fmt::format("Linear weights in tiles of at most {}{}", format_bytes(s.tile_bytes()), d.tiles)
                           : std::string("untiled"),
        d.crossing));
  }
  return out;
}

// What a plan that found nothing could still be allowed: "; ..." clauses naming the
// options, or "".
inline std::string unlock_text(const PlanOptions& o, const std::optional<std::string>& layer) {
  std::string text;
  if (layer && o.micro_batching() && !may_micro_batch(o, layer)) {
    text += fmt::format("; micro-batches were not tried because BatchNorm layer '{}' would normalise each with "
                        "its own statistics: PlanOptions::batch_statistics(kPerMicroBatch) allows them", *layer);
  }
  const bool lower = std::any_of(o.precisions().begin(), o.precisions().end(),
                                 [](Precision p) { return p != Precision::kFP32; });
  std::vector<std::string> more;
  if (!lower) more.push_back("PlanOptions::precisions({kFP32, kBF16}) (bf16 changes the math)");
  if (!o.micro_batching()) more.push_back("PlanOptions::micro_batching(true)");
  if (!o.checkpointing()) more.push_back("PlanOptions::checkpointing(true)");
  if (!o.offload()) more.push_back("PlanOptions::offload(true)");
  if (!more.empty()) text += fmt::format("; less may fit with {}", fmt::join(more, ", "));
  return text;
}

// A plan's micro-batch, precision and offload, in a line of text.
// Selective recomputation's choices for a model that has SelectivelyRecomputed
// modules (`recomputable`) or not, as `options` allow; the first is the plain step's.
inline std::vector<bool> selective_choices(const PlanOptions& options, bool recomputable) {
  switch (options.selective_recompute()) {
    case SelectiveRecompute::kOff:
      return {false};
    case SelectiveRecompute::kChoose:
      return recomputable ? std::vector<bool>{false, true} : std::vector<bool>{false};
    case SelectiveRecompute::kOn:
      break;
  }
  TORCH_CHECK(recomputable, "PlanOptions::selective_recompute(kOn) needs a model with SelectivelyRecomputed "
              "modules (checkpoint.h: make_gpt's blocks, or your own); this one has none: use kChoose or kOff");
  return {true};
}

inline std::string settings_text(const StepSettings& s, int64_t batch) {
  const int64_t m = s.micro_batch() > 0 ? s.micro_batch() : batch;
  return fmt::format("micro-batch {}, {}, offload {}{}{}", m, to_string(s.precision()), offload_text(s),
                     s.tile_bytes() > 0 ? ", tiles of " + format_bytes(s.tile_bytes()) : "",
                     s.selective_recompute() ? ", selective recomputation" : "");
}

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

// Chain schedules as JSON that gives them back exactly (what a ModulePlan
// adds to broadcast_plan's wire), and back.
nlohmann::json schedules_wire(const std::vector<Schedule>& schedules);
std::vector<Schedule> schedules_from_wire(const nlohmann::json& wire);
// Parses JSON from `in`, refusing (c10::Error) nesting deeper than `max_depth`.
nlohmann::json parse_json(std::istream& in, int max_depth = 32);
// A plan as JSON that gives every field back exactly (not Plan::to_json,
// which reports; broadcast_plan and save_plan), and back.
nlohmann::json plan_wire(const Plan& plan);
void plan_from_wire(const nlohmann::json& j, Plan& plan);
// broadcast_plan: rank `root`'s plan as exact JSON, with what `add` puts in it, on
// every rank of `group`; the other ranks read it into `plan` and give it to
// `take`. Every rank's reasons then say whose plan it is.
void broadcast_plan_wire(Plan& plan, ProcessGroup& group, int64_t root,
                         const std::function<void(nlohmann::json&)>& add,
                         const std::function<void(const nlohmann::json&)>& take);

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
inline bool is_edge(const PlanOptions& o, bool can_time, int64_t peak, int64_t limit, int64_t budget) {
  return can_time && o.measure_candidates() > 0 && peak > limit && peak <= budget;
}

// Whether `s` recomputes some segment.
inline bool recomputes(const Schedule& s) {
  return std::any_of(s.segments.begin(), s.segments.end(), [](const Segment& g) { return g.checkpointed; });
}

// How much a plan copies to and from the host: 0 nothing, 1 the optimizer
// state, 2 and the gradients, 3 and the parameters streamed whole, above 3
// streamed in tiles, the smaller the tiles the higher (more, smaller copies).
inline int offload_rank(const StepSettings& s) {
  if (s.offload_parameters() == Offload::kHost) {
    if (s.tile_bytes() <= 0) return 3;
    int log2 = 0;
    while (log2 < 62 && (int64_t{1} << (log2 + 1)) <= s.tile_bytes()) ++log2;
    return 4 + (62 - log2);
  }
  return s.offload_gradients() == Offload::kHost  ? 2
         : s.offload_optimizer() == Offload::kHost ? 1
                                                   : 0;
}

// How the choice sees a plan with `settings` (whose schedules recompute, or
// not: `checkpoints`) and its prediction. Selective recomputation recomputes too.
inline Ranked ranked(const StepSettings& settings, const StepPrediction& predicted, bool checkpoints) {
  Ranked r;
  r.seconds = predicted.seconds;
  r.recomputes = checkpoints || settings.selective_recompute() ? 1 : 0;
  r.offload = offload_rank(settings);
  r.micro_batches = predicted.accumulation_steps;
  r.lower_precision = settings.precision() == Precision::kFP32 ? 0 : 1;
  r.peak_bytes = predicted.peak_bytes;
  return r;
}

// The least predicted (or measured) time among `candidates`, edge ones
// included or not (infinity: none).
inline double fastest_seconds(const std::vector<Ranked>& candidates, bool with_edges) {
  double fastest = std::numeric_limits<double>::infinity();
  for (const auto& c : candidates) {
    if (with_edges || !c.edge) fastest = std::min(fastest, c.seconds);
  }
  return fastest;
}

// What a plan does, in the order a tie is settled: recomputation, then
// offload, then micro-batches (less of each first), then a precision below
// fp32 (fp32 first: it keeps the math; which is faster depends on the device,
// and a tie or a busy machine's choice has no times to say).
inline std::tuple<int, int, int64_t, int> work(const Ranked& c) {
  return std::make_tuple(c.recomputes, c.offload, c.micro_batches, c.lower_precision);
}
// work()'s order, as the plan's lines name it.
constexpr const char* kWorkOrder = "no recomputation, then less offload, then fewer micro-batches, then fp32";

// The index of the plan to choose among `candidates` (-1: none), edge ones
// aside (they have not run): of those within `tie` of the fastest (kTimeTie for predictions; for measured times,
// at least the measurement's own noise), the one without recomputation, then
// with less offload, then with fewer micro-batches, then in fp32, then the
// faster and the smaller. Ties are settled by what a plan does, never by which of them
// timing noise put ahead, and the answer does not depend on their order.
inline int64_t choose(const std::vector<Ranked>& candidates, double tie = kTimeTie) {
  const double fastest = fastest_seconds(candidates, /*with_edges=*/false);
  auto key = [](const Ranked& c) { return std::tuple_cat(work(c), std::make_tuple(c.seconds, c.peak_bytes)); };
  int64_t best = -1;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (candidates[i].edge || candidates[i].seconds > fastest * (1 + tie)) continue;
    if (best < 0 || key(candidates[i]) < key(candidates[static_cast<size_t>(best)])) best = static_cast<int64_t>(i);
  }
  return best;
}

// Whether plans `a` and `b` compute the same: as many micro-batches, in the
// same precision. Plans that differ only in what they recompute or offload
// give the same gradients, bitwise.
inline bool same_math(const Ranked& a, const Ranked& b) {
  return a.micro_batches == b.micro_batches && a.lower_precision == b.lower_precision;
}

// The tie band between measured plans `a` and `b` whose own timing's band is
// `tie`: that band where they compute the same (same_math), at least
// kMathTie where they do not.
inline double tie_between(const Ranked& a, const Ranked& b, double tie) {
  return same_math(a, b) ? tie : std::max(kMathTie, tie);
}

// choose() for measured times `ran`, `tie` their band: of each set of plans
// that compute the same (same_math), the one that does least (choose()'s
// order) among those within `tie` of the set's fastest and within
// max(kMathTie, tie) of the fastest of all; then, of those picks, the one
// that does least. Noise between runs may then change how a plan recomputes
// or offloads, which leaves its gradients as they were, but what it
// computes only where times lie more than kMathTie apart. Every plan within
// `tie` of the fastest is in its set's running, so the choice never does
// more than choose(ran, tie)'s.
inline int64_t choose_timed(const std::vector<Ranked>& ran, double tie) {
  const double fastest = fastest_seconds(ran, /*with_edges=*/false);
  const double band = std::max(kMathTie, tie);
  std::vector<Ranked> picks;
  std::vector<size_t> at;
  std::vector<bool> seen(ran.size(), false);
  for (size_t i = 0; i < ran.size(); ++i) {
    if (seen[i] || ran[i].edge) continue;
    std::vector<size_t> members;
    for (size_t j = i; j < ran.size(); ++j) {
      if (ran[j].edge || !same_math(ran[i], ran[j])) continue;
      seen[j] = true;
      members.push_back(j);
    }
    double set_fastest = std::numeric_limits<double>::infinity();
    for (size_t j : members) set_fastest = std::min(set_fastest, ran[j].seconds);
    std::vector<Ranked> running;
    std::vector<size_t> where;
    for (size_t j : members) {
      if (ran[j].seconds > set_fastest * (1 + tie) || ran[j].seconds > fastest * (1 + band)) continue;
      running.push_back(ran[j]);
      where.push_back(j);
    }
    if (running.empty()) continue;
    const auto pick = static_cast<size_t>(choose(running, std::numeric_limits<double>::infinity()));
    picks.push_back(running[pick]);
    at.push_back(where[pick]);
  }
  const int64_t chosen = choose(picks, std::numeric_limits<double>::infinity());  // each within its band already
  return chosen < 0 ? -1 : static_cast<int64_t>(at[static_cast<size_t>(chosen)]);
}

// What the line on the candidates timed says of an edge one (see is_edge).
inline std::string edge_text(bool edge, int64_t peak_bytes) {
  return edge ? fmt::format(" (predicted peak {}, above PlanOptions::margin of the budget: its steps decide)",
                            format_bytes(peak_bytes))
              : std::string();
}

// The plan's line on a chosen edge candidate: predicted above the limit, it
// fits by its steps' peak.
inline std::string edge_chosen_text(int64_t predicted_peak, int64_t limit, const PlanOptions& o,
                                    int64_t measured_peak) {
  return fmt::format("predicted peak {} is above the limit {} ({:.0f}% of the budget), but its real steps under "
                     "the budget peaked at {}: they, not the margin, say it fits",
                     format_bytes(predicted_peak), format_bytes(limit), 100 * o.margin(), format_bytes(measured_peak));
}

// The members `at` of one timing group other than its `pick` that to_time
// times beside it: those predicted within kTimedVariants of the group's
// `fastest`, one per family (Ranked::family), the one that offloads least,
// the pick counting as its family's: a variant that offloads more than one
// timed already only adds copies to its step (see offload_adds_copies).
inline std::vector<size_t> close_variants(const std::vector<Ranked>& candidates, std::vector<size_t> at, size_t pick,
                                          double fastest) {
  std::stable_sort(at.begin(), at.end(),
                   [&](size_t a, size_t b) { return candidates[a].offload < candidates[b].offload; });
  std::vector<size_t> out;
  std::vector<int64_t> families;
  for (size_t i : at) {
    const int64_t f = candidates[i].family;
    if (i != pick && candidates[i].seconds > fastest * (1 + kTimedVariants)) continue;
    if (f >= 0 && std::find(families.begin(), families.end(), f) != families.end()) continue;
    families.push_back(f);
    if (i != pick) out.push_back(i);
  }
  return out;
}

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
inline std::vector<size_t> to_time(const std::vector<Ranked>& candidates, const std::vector<int64_t>& group,
                                   double within, int64_t count) {
  std::vector<size_t> order;
  if (candidates.empty() || count <= 0) return order;
  const auto by_prediction = [&](size_t a, size_t b) {
    return std::make_pair(candidates[a].seconds, a) < std::make_pair(candidates[b].seconds, b);
  };
  std::map<int64_t, std::vector<size_t>> members;
  for (size_t i = 0; i < candidates.size(); ++i) members[group[i]].push_back(i);
  std::vector<size_t> picks;
  std::map<size_t, std::vector<size_t>> close;  // a group's pick: its group's others within kTimedVariants
  for (const auto& [g, at] : members) {
    std::vector<Ranked> sub;
    for (size_t i : at) {
      sub.push_back(candidates[i]);
      sub.back().edge = false;  // an edge group's own pick is timed like any other
    }
    const size_t pick = at[static_cast<size_t>(choose(sub))];
    picks.push_back(pick);
    close[pick] = close_variants(candidates, at, pick, fastest_seconds(sub, /*with_edges=*/true));
    std::sort(close[pick].begin(), close[pick].end(), by_prediction);
  }
  const double fastest = fastest_seconds(candidates, /*with_edges=*/true);
  picks.erase(std::remove_if(picks.begin(), picks.end(),
                             [&](size_t i) { return candidates[i].seconds > fastest * (1 + within); }),
              picks.end());
  std::sort(picks.begin(), picks.end(), by_prediction);
  const auto add = [&](size_t i) {
    if (std::find(order.begin(), order.end(), i) == order.end()) order.push_back(i);
  };
  if (const int64_t predicted = choose(candidates); predicted >= 0) {
    add(static_cast<size_t>(predicted));
    const auto own = std::find_if(picks.begin(), picks.end(), [&](size_t p) {
      return group[p] == group[static_cast<size_t>(predicted)];
    });
    if (own != picks.end()) {
      add(*own);
      for (size_t i : close[*own]) add(i);
    }
  }
  for (size_t p : picks) add(p);
  for (size_t p : picks) {
    for (size_t i : close[p]) add(i);
  }
  if (static_cast<int64_t>(order.size()) > count) order.resize(static_cast<size_t>(count));
  return order;
}

// The group of a candidate with `s` for to_time: its micro-batch and
// precision, and whether it is an edge candidate (see is_edge()).
inline int64_t timing_group(const StepSettings& s, bool edge) {
  return (s.micro_batch() * 16 + static_cast<int64_t>(s.precision())) * 2 + (edge ? 1 : 0);
}

// Checks PlanOptions::measure_candidates and measure_within (both planners).
inline void check_measure_options(const PlanOptions& o) {
  TORCH_CHECK(o.measure_candidates() >= 0, "PlanOptions::measure_candidates must be >= 0 (0: choose by prediction "
              "alone), got ", o.measure_candidates());
  TORCH_CHECK(o.measure_within() >= 0, "PlanOptions::measure_within must be >= 0, got ", o.measure_within());
  TORCH_CHECK(o.profile_budget() >= 0, "PlanOptions::profile_budget must be >= 0 bytes (0: no limit), got ",
              o.profile_budget());
}

// What real steps of a candidate measured: seconds per logical batch (0: a
// step ran out of memory under the budget) and their peak.
struct StepTiming {
  double seconds = 0;
  int64_t peak_bytes = 0;
  // Where a step ran out of memory on CUDA: the failing phase's allocated
  // peak and the caching allocator's reserved peak, which the budget caps.
  int64_t failed_allocated = 0, failed_reserved = 0;
};

// The line on a candidate whose steps ran out of memory under the budget.
inline std::string out_of_memory_text(const StepTiming& t) {
  return t.failed_reserved > 0
             ? fmt::format("ran out of memory under the budget (allocated bytes peaked at {}; the caching "
                           "allocator's reserved bytes, which the budget caps, at {})",
                           format_bytes(t.failed_allocated), format_bytes(t.failed_reserved))
             : std::string("ran out of memory under the budget");
}

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

// A candidate's timed steps `v` (at least two): how far apart its two
// fastest land, less 1.
inline double two_fastest_gap(std::vector<double> v) {
  std::partial_sort(v.begin(), v.begin() + 2, v.end());
  return v[1] / v[0] - 1;
}

// Whether candidate timings `v` contend for the choice: their fastest is
// within kContender of `best`, the fastest of all.
inline bool contends(const std::vector<double>& v, double best) {
  return !v.empty() && *std::min_element(v.begin(), v.end()) <= best * (1 + kContender);
}

// The fastest of all timings `samples` (infinity: none ran).
inline double fastest_sample(const std::vector<std::vector<double>>& samples) {
  double best = std::numeric_limits<double>::infinity();
  for (const auto& v : samples) {
    for (double x : v) best = std::min(best, x);
  }
  return best;
}

// Whether the timings `samples` (per candidate; empty: ran out of memory)
// settle the choice: every contender's two fastest agree within kTimeTie.
inline bool settled(const std::vector<std::vector<double>>& samples) {
  const double best = fastest_sample(samples);
  for (const auto& v : samples) {
    if (contends(v, best) && (v.size() < 2 || two_fastest_gap(v) > kTimeTie)) return false;
  }
  return true;
}

// Whether the timings `samples` (of candidates `order`; empty: ran out of
// memory or not run) after `passes` may give the choice to a plan that does
// more than another timed one: no candidate that does less (earlier in
// choose()'s order: no recomputation, less offload, fewer micro-batches, fp32) than
// the fastest lost to it beyond their tie band (tie_between), or kConfirmPasses have run. A
// shared machine's slow spell can last a candidate's two steps; a third pass
// confirms the loss before the plan does more work for it.
inline bool confirmed(const std::vector<Ranked>& candidates, const std::vector<size_t>& order,
                      const std::vector<std::vector<double>>& samples, int passes) {
  if (passes >= kConfirmPasses) return true;
  const double best = fastest_sample(samples);
  auto key = [&](size_t k) { return work(candidates[order[k]]); };
  size_t fastest = 0;
  for (size_t k = 0; k < samples.size(); ++k) {
    if (!samples[k].empty() && *std::min_element(samples[k].begin(), samples[k].end()) == best) fastest = k;
  }
  for (size_t k = 0; k < samples.size(); ++k) {
    if (samples[k].empty() || key(k) >= key(fastest)) continue;
    const double tie = tie_between(candidates[order[k]], candidates[order[fastest]], kTimeTie);
    if (*std::min_element(samples[k].begin(), samples[k].end()) > best * (1 + tie)) return false;
  }
  return true;
}

// How far apart a timing's repeats land, where they did not settle: the
// largest two_fastest_gap of a contender (0 when settled, or when none ran
// twice). A slower candidate's noise cannot widen the tie between faster ones.
inline double timing_noise(const std::vector<std::vector<double>>& samples) {
  if (settled(samples)) return 0;
  const double best = fastest_sample(samples);
  double noise = 0;
  for (const auto& v : samples) {
    if (contends(v, best) && v.size() >= 2) noise = std::max(noise, two_fastest_gap(v));
  }
  return noise;
}

// Whether timings ran on a busy machine: other processes left fewer free
// cores (CpuLoad::free_cores, -1: unknown) than LibTorch has threads, so its
// threads took turns with them and every step slowed unevenly; where the load
// is unknown, whether the timings spread by more than kBusy.
inline bool busy_machine(double free_cores, int threads, double noise) {
  return free_cores >= 0 ? free_cores < double(threads) - 0.5 : noise > kBusy;
}

// The one of `candidates` that does least (-1: none): of all predicted to fit,
// edge ones aside, less those whose steps ran out of memory (out_of_memory[k]
// for candidate order[k]), the first in choose()'s order without times (no
// recomputation, less offload, fewer micro-batches, fp32, then fewer bytes):
// the same answer whatever noise made of the times, or of the predictions.
inline int64_t does_least(const std::vector<Ranked>& candidates, const std::vector<size_t>& order,
                          const std::vector<bool>& out_of_memory) {
  std::vector<Ranked> fit;
  std::vector<size_t> at;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const auto k = static_cast<size_t>(std::find(order.begin(), order.end(), i) - order.begin());
    if (candidates[i].edge || (k < order.size() && out_of_memory[k])) continue;
    fit.push_back(candidates[i]);
    fit.back().seconds = 0;
    at.push_back(i);
  }
  const int64_t chosen = choose(fit);
  return chosen < 0 ? -1 : static_cast<int64_t>(at[static_cast<size_t>(chosen)]);
}

// Offloading only adds copies: a candidate's time is at least that of each
// one of its family (Ranked::family) that offloads less, so timing noise
// cannot put a larger offload of the same step ahead, and their tie goes to
// the one that offloads less.
inline void offload_adds_copies(std::vector<Ranked>& candidates) {
  const auto measured = candidates;
  for (auto& c : candidates) {
    for (const auto& less : measured) {
      if (c.family >= 0 && less.family == c.family && less.offload < c.offload) {
        c.seconds = std::max(c.seconds, less.seconds);
      }
    }
  }
}

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
inline Measured choose_measured(const std::vector<Ranked>& candidates, const std::vector<size_t>& order,
                                const std::function<StepTiming(size_t)>& run,
                                std::function<double()> free_cores = nullptr) {
  Measured out;
  const CpuLoad load;
  if (!free_cores) free_cores = [&load] { return load.free_cores(); };
  out.timed.assign(order.size(), StepTiming{});
  std::vector<std::vector<double>> samples(order.size());
  std::vector<bool> out_of_memory(order.size(), false);
  // More passes settle noise, not a busy machine's turns: those stop at kMinPasses.
  const auto busy_now = [&] {
    const double free = free_cores();
    return free >= 0 && busy_machine(free, at::get_num_threads(), 0);
  };
  for (; out.passes < kMaxPasses &&
         (out.passes < kMinPasses ||
          ((!settled(samples) || !confirmed(candidates, order, samples, out.passes)) && !busy_now()));
       ++out.passes) {
    for (size_t n = 0; n < order.size(); ++n) {
      const size_t k = out.passes % 2 == 0 ? n : order.size() - 1 - n;
      if (out_of_memory[k]) continue;
      const auto r = run(order[k]);
      out.timed[k].peak_bytes = std::max(out.timed[k].peak_bytes, r.peak_bytes);
      out_of_memory[k] = r.seconds <= 0;
      if (out_of_memory[k]) {
        out.timed[k].failed_allocated = r.failed_allocated;
        out.timed[k].failed_reserved = r.failed_reserved;
      }
      if (out_of_memory[k]) samples[k].clear();
      else samples[k].push_back(r.seconds);
    }
  }
  std::vector<Ranked> ran;
  std::vector<size_t> at;  // each of ran's index into timed
  for (size_t k = 0; k < order.size(); ++k) {
    if (samples[k].empty()) continue;
    out.timed[k].seconds = *std::min_element(samples[k].begin(), samples[k].end());
    ran.push_back(candidates[order[k]]);
    ran.back().seconds = out.timed[k].seconds;
    ran.back().edge = false;  // its steps ran under the budget: it fits
    at.push_back(k);
  }
  offload_adds_copies(ran);
  out.tie = std::max(kTimeTie, timing_noise(samples));
  out.free_cores = free_cores();
  if (busy_machine(out.free_cores, at::get_num_threads(), out.tie)) {
    out.chosen = does_least(candidates, order, out_of_memory);
    out.busy = out.chosen >= 0;
    if (out.busy) return out;
  }
  const int64_t chosen = choose_timed(ran, out.tie);
  if (chosen < 0) return out;
  out.chosen_timed = static_cast<int64_t>(at[static_cast<size_t>(chosen)]);
  out.chosen = static_cast<int64_t>(order[static_cast<size_t>(out.chosen_timed)]);
  return out;
}

// What a busy machine's plan advises: with `threads` intra-op threads where
// other processes left `free_cores` (-1: unknown), as many threads as free
// cores would stop LibTorch's threads taking turns with them ("": no
// fewer would). With one core of two busy, planning the GPT took 111 s
// with two threads and 18 s with one, its steps 2.5-3.3 s against 0.24 s
// (docs/measurements/plan_busy_threads.txt).
inline std::string threads_advice(double free_cores, int threads) {
  if (free_cores < 0) return {};
  const int fit = std::max(1, static_cast<int>(std::lround(free_cores)));
  return fit < threads ? fmt::format("; at::set_num_threads({}) would give LibTorch's threads cores of their own "
                                     "(threads that take turns with other processes wait on each other, and steps "
                                     "slow many times over)",
                                     fit)
                       : std::string();
}

// What timed_text says of the band between plans that compute differently
// (tie_between), where it is wider than `tie`.
inline std::string math_tie_text(double tie) {
  return kMathTie > tie ? fmt::format(" ({:.0f}% between micro-batch sizes or precisions, which change what a step "
                                      "computes)", 100 * kMathTie)
                        : std::string();
}

// What timed_text says of the choice: "chose the fastest measured" only
// where it was; a plan chosen within the tie band over a faster one is
// named, with how far behind it measured and what decided (choose_timed:
// within the tie, what a plan does, as choose() orders it).
inline std::string choice_text(const std::vector<std::string>& names, const Measured& m) {
  if (m.busy) return "chose by what the plans do";
  if (m.chosen < 0 || m.chosen_timed < 0) return "none ran, so the prediction chooses";
  const auto c = static_cast<size_t>(m.chosen_timed);
  size_t fastest = c;
  for (size_t k = 0; k < m.timed.size(); ++k) {
    if (m.timed[k].seconds > 0 && m.timed[k].seconds < m.timed[fastest].seconds) fastest = k;
  }
  if (fastest == c) return "chose the fastest measured";
  return fmt::format("chose {}, {:.1f}% behind the fastest measured ({}): within the tie, what a plan does "
                     "decides ({})",
                     names[c], 100 * (m.timed[c].seconds / m.timed[fastest].seconds - 1), names[fastest], kWorkOrder);
}

// The plan's line on the candidates timed: each one's `names` entry with its
// predicted and measured time, in the order timed, and what was chosen.
inline std::string timed_text(const std::vector<std::string>& names, const std::vector<double>& predicted,
                              const Measured& m) {
  std::vector<std::string> lines;
  for (size_t k = 0; k < names.size(); ++k) {
    lines.push_back(fmt::format("{}: predicted {:.1f} ms, {}", names[k], 1e3 * predicted[k],
                                m.timed[k].seconds > 0
                                    ? fmt::format("measured {:.1f} ms", 1e3 * m.timed[k].seconds)
                                    : out_of_memory_text(m.timed[k])));
  }
  const std::string tie =
      m.busy ? fmt::format("{}: a busy machine's times cannot tell plans apart, so of all those predicted to fit, "
                           "the one that does least ({}, then fewer bytes) is chosen{}",
                           m.free_cores >= 0
                               ? fmt::format("other processes left {:.1f} free cores for LibTorch's {} threads",
                                             m.free_cores, at::get_num_threads())
                               : fmt::format("the timed steps spread by {:.0f}%, more than {:.0f}%", 100 * m.tie,
                                             100 * kBusy),
                           kWorkOrder, threads_advice(m.free_cores, at::get_num_threads()))
      : m.tie > kTimeTie ? fmt::format("times within {:.0f}% are a tie: the timing's own noise, as the passes did "
                                       "not settle{}", 100 * m.tie, math_tie_text(m.tie))
                         : fmt::format("times within {:.0f}% are a tie{}", 100 * kTimeTie, math_tie_text(m.tie));
  return fmt::format("timed the {} closest candidate(s) with real steps under the budget, in {} passes, every "
                     "other one in reverse order (each a warm-up step and a timed one; a candidate's fastest "
                     "timed step counts; {}): {}; {}",
                     names.size(), m.passes, tie, fmt::join(lines, "; "), choice_text(names, m));
}

// The CPU random generator's state, put back on destruction: planning's
// real steps draw from it (initialisation, dropout, shuffling).
class RngStateGuard {
 public:
  RngStateGuard() {
    UntrackedGuard host;  // host bookkeeping, not bytes of the step measured
    rng_ = compat::get_rng_state({});
  }
  ~RngStateGuard() { compat::set_rng_state(rng_); }
  RngStateGuard(const RngStateGuard&) = delete;
  RngStateGuard& operator=(const RngStateGuard&) = delete;

 private:
  compat::RngState rng_;
};

// A module's parameters, buffers and gradients and the CPU RNG, copied to
// the host and put back on destruction: planning trains the module itself.
// A parameter that a streamed Trainer left in its host master's storage
// (MasterWeights gives the model back in host memory) gets memory where it
// was, from the allocator it came from, before its values are copied back.
class ModuleStateGuard {
 public:
  explicit ModuleStateGuard(const torch::nn::Module& module) {
    tensors_ = module.parameters();
    const auto buffers = module.buffers();
    tensors_.insert(tensors_.end(), buffers.begin(), buffers.end());
    UntrackedGuard host;
    for (const auto& t : tensors_) {
      saved_.push_back(t.detach().clone());
      grads_.push_back(t.grad());
      places_.push_back(place_of(t));
      options_.push_back(t.options());
    }
  }
  ~ModuleStateGuard() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (place_of(tensors_[i]) != places_[i]) tensors_[i].set_data(torch::empty_like(saved_[i], options_[i]));
      tensors_[i].copy_(saved_[i]);
      tensors_[i].mutable_grad() = grads_[i];
    }
  }
  ModuleStateGuard(const ModuleStateGuard&) = delete;
  ModuleStateGuard& operator=(const ModuleStateGuard&) = delete;

 private:
  using Place = std::pair<const void*, c10::DeleterFnPtr>;  // the storage's memory and its allocator's deleter
  static Place place_of(const torch::Tensor& t) {
    const auto& data = t.storage().data_ptr();
    return {data.get(), data.get_deleter()};
  }
  std::vector<torch::Tensor> tensors_, saved_, grads_;
  std::vector<Place> places_;
  std::vector<torch::TensorOptions> options_;
  RngStateGuard rng_;  // put back after the tensors
};

} // namespace detail
} // namespace memfit
