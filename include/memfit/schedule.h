#pragma once
/// \file schedule.h
/// Checkpoint schedules for a chain of layers, as data: which segments run
/// without keeping activations, and how each is recomputed (nested,
/// multi-level recomputation allowed). Standard schedules (none, every K
/// layers, uniform segments, sqrt(n) of Chen et al. 2016), the optimal one
/// under a memory budget (dynamic programming after Beaumont et al. 2019,
/// "rotor", and Griewank's revolve). CheckpointedSequential, the module that
/// runs a Sequential with a schedule, is in checkpoint.h.
///
/// The cost model (ChainCosts) gives, per layer i: x[i], the bytes of its
/// input (x[n] is the chain's output); kept[i], the bytes it keeps until
/// backward when run with grad, output included; the transient bytes its
/// forward and backward need on top; forward and backward time; where a
/// layer lets its input go (frees_input). A schedule's
/// peak is simulated event by event: a layer run with grad keeps kept[i]; a
/// checkpointed segment's no-grad forward holds one layer's input and output
/// at a time and keeps its output; a layer's backward peaks at what it kept,
/// its output's gradient and its backward overhead, then holds its input's
/// gradient only; a checkpointed segment's backward
/// recomputes it with its inner schedule while autograd holds the gradient of
/// its output. The chain's input is held outside; the gradient of its output
/// appears when the forward is done; the caller holds the chain's output (the
/// logits) until backward is done. Parameter gradients (ChainCosts::gradient,
/// when given) appear at their layer's backward and stay. simulate() and
/// solve_optimal() share this model; tests check the solver against
/// brute-force enumeration of every schedule.
///
/// Thread safety: schedules and costs are values. Sync points: none. Extra memory: the
/// solver's tables, (n + 1)(n + 2) × (units + 1) entries of 12 bytes (host
/// memory), units being the budget in memory units (at most 8 × slots).

#include "memfit/profile.h"

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace memfit {

/// A run of consecutive layers [begin, end) of a chain.
///
/// A plain segment runs with grad and keeps its activations. A checkpointed
/// segment runs without keeping them and, during backward, is recomputed with
/// the schedule `inner` (which covers [begin, end) and may checkpoint again).
struct Segment {
  int64_t begin = 0;          ///< First layer.
  int64_t end = 0;            ///< One past the last layer.
  bool checkpointed = false;  ///< Whether activations are dropped and recomputed.
  std::vector<Segment> inner; ///< Checkpointed only: how the recomputation runs.
};

/// A schedule: segments that cover a chain's layers in order.
struct Schedule {
  std::vector<Segment> segments;  ///< In order, covering [0, n).

  /// Number of layers covered.
  int64_t num_layers() const { return segments.empty() ? 0 : segments.back().end; }
  /// Compact text: "[0,4)* [4,8)* [8,10)"; nesting in braces: "[0,8)*{[0,2) [2,8)*}".
  std::string to_string() const;
  /// Checks that the segments cover [0, n) in order, and each inner schedule its
  /// segment; throws c10::Error saying what is wrong.
  void validate(int64_t n) const;
};

/// The standard kinds of schedule.
enum class ScheduleKind {
  kNone,     ///< No checkpointing.
  kEvery,    ///< Segments of K layers, each but the last checkpointed.
  kUniform,  ///< K segments as checkpoint_sequential makes them.
  kSqrt,     ///< round(sqrt(n)) uniform segments (Chen et al. 2016).
  kOptimal,  ///< The least recomputation under a memory budget.
};

/// Parses "none", "every", "uniform", "sqrt" or "optimal".
///
/// Example:
/// \code
///   assert(memfit::parse_schedule_kind("sqrt") == memfit::ScheduleKind::kSqrt);
/// \endcode
ScheduleKind parse_schedule_kind(const std::string& name);

/// A schedule without checkpointing.
///
/// Example:
/// \code
///   assert(memfit::schedule_none(4).to_string() == "[0,4)");
/// \endcode
Schedule schedule_none(int64_t n);

/// Segments of `k` layers, each but the last checkpointed.
///
/// Example:
/// \code
///   assert(memfit::schedule_every(10, 4).to_string() == "[0,4)* [4,8)* [8,10)");
/// \endcode
Schedule schedule_every(int64_t n, int64_t k);

/// checkpoint_sequential's split: `segments` segments of n / segments layers,
/// all but the last checkpointed; the last also takes the remainder.
///
/// Example:
/// \code
///   assert(memfit::schedule_uniform(10, 3).to_string() == "[0,3)* [3,6)* [6,10)");
/// \endcode
Schedule schedule_uniform(int64_t n, int64_t segments);

/// Uniform segments, round(sqrt(n)) of them (Chen et al. 2016).
///
/// Example:
/// \code
///   assert(memfit::schedule_sqrt(16).segments.size() == 4);
/// \endcode
Schedule schedule_sqrt(int64_t n);

/// `schedule` with the start of each one-level checkpointed segment moved past
/// in-place layers (`in_place[i]`: layer i modifies its input), since
/// recomputation needs a segment's original input; the layers passed over
/// join the checkpointed segment before, or a plain one. CheckpointedSequential
/// applies it to the standard kinds.
///
/// Example:
/// \code
///   memfit::Schedule s;
///   s.segments.push_back({0, 3, true, {{0, 3, false, {}}}});
///   assert(memfit::avoid_in_place_starts(s, {true, false, false}).to_string() == "[0,1) [1,3)*");
/// \endcode
Schedule avoid_in_place_starts(const Schedule& schedule, const std::vector<bool>& in_place);

/// Per-layer costs of a chain of n layers: the solver's and simulator's input.
struct ChainCosts {
  std::vector<int64_t> x;          ///< n + 1 sizes: x[i] is layer i's input, x[n] the output.
  std::vector<int64_t> kept;       ///< n: bytes layer i keeps when run with grad.
  std::vector<double> forward;     ///< n: forward time.
  std::vector<double> backward;    ///< n: backward time.
  std::vector<bool> in_place;      ///< n: layer modifies its input (cannot start a checkpoint).
  /// n or empty (zeros): bytes layer i's forward needs briefly beyond kept[i].
  std::vector<int64_t> forward_overhead;
  /// n or empty (zeros): bytes layer i's backward needs at its peak beyond
  /// kept[i] and its output's gradient (its input's gradient and temporaries;
  /// parameter gradients excluded).
  std::vector<int64_t> backward_overhead;

  /// n or empty (zeros): bytes of parameter gradients layer i's backward
  /// creates and that stay until the chain's backward is done, as in a step's
  /// first (or only) micro-batch; later micro-batches find them made. Layers
  /// backpropagate in reverse order whatever the schedule, so while layer i's
  /// backward runs the gradients of layers i..n-1 are held.
  std::vector<int64_t> gradient;
  /// n or empty (all false): layer i lets its input go when it runs with grad
  /// after the layer before it (neither keeps that tensor), and kept[i]
  /// counts it freed. Where a checkpoint holds that input (a recomputation
  /// starting at layer i), the layer keeps x[i] more; the solver starts no
  /// checkpoint there, as at in-place layers. Layer 0's input is the caller's:
  /// frees_input[0] must be false.
  std::vector<bool> frees_input;

  /// Number of layers.
  int64_t size() const { return static_cast<int64_t>(kept.size()); }
  /// Checks the sizes agree and nothing is negative.
  void validate() const;
  /// forward_overhead[i], or 0 when none are given.
  int64_t forward_extra(int64_t i) const {
    return forward_overhead.empty() ? 0 : forward_overhead[static_cast<size_t>(i)];
  }
  /// backward_overhead[i], or 0 when none are given.
  int64_t backward_extra(int64_t i) const {
    return backward_overhead.empty() ? 0 : backward_overhead[static_cast<size_t>(i)];
  }
  /// gradient[i], or 0 when none are given.
  int64_t gradient_bytes(int64_t i) const { return gradient.empty() ? 0 : gradient[static_cast<size_t>(i)]; }
  /// frees_input[i], or false when none are given.
  bool frees(int64_t i) const { return !frees_input.empty() && frees_input[static_cast<size_t>(i)]; }
  /// Whether a checkpointed segment may start at layer i (not in place, not
  /// freeing its input).
  bool may_start_checkpoint(int64_t i) const { return !in_place[static_cast<size_t>(i)] && !frees(i); }
};

/// The costs a profile measured.
///
/// Example:
/// \code
///   torch::nn::Sequential chain(torch::nn::Linear(8, 8), torch::nn::Tanh());
///   auto costs = memfit::costs_from_profile(memfit::profile_chain(chain, torch::randn({2, 8})));
///   assert(costs.size() == 2);
/// \endcode
ChainCosts costs_from_profile(const ChainProfile& profile);

/// A schedule's predicted cost under the model.
struct ScheduleCost {
  double time = 0;         ///< Forward, recomputation and backward time.
  int64_t peak_bytes = 0;  ///< Peak bytes, the chain's input excluded.
  int64_t forward_peak_bytes = 0;   ///< The peak during forward (at most peak_bytes).
  int64_t held_bytes = 0;           ///< Bytes held from the end of forward until backward.
  int64_t backward_peak_bytes = 0;  ///< The peak during backward, the output's gradient included.
};

/// Simulates `schedule` on `costs` event by event.
///
/// Example:
/// \code
///   memfit::ChainCosts c{{4, 4, 4}, {8, 8}, {1, 1}, {2, 2}, {false, false}};
///   auto cost = memfit::simulate(memfit::schedule_none(2), c);
///   assert(cost.time == 6);
/// \endcode
ScheduleCost simulate(const Schedule& schedule, const ChainCosts& costs);

/// How the optimal solver discretises memory.
struct SolverOptions {
  /// Memory is counted in units: the greatest common divisor of all sizes when
  /// the budget is at most 8 × slots of it (exact; tensor sizes usually share
  /// a large factor), else ceil(budget / slots) bytes with each size rounded up
  /// (a solution never exceeds the budget). More slots: closer to the budget,
  /// more time and memory (about n³/3 × units steps).
  TORCH_ARG(int64_t, slots) = 200;
};

/// The schedule with the least time whose simulated peak is at most `budget`
/// bytes (the chain's input excluded).
///
/// Exact for the cost model once sizes are counted in units (a budget of at
/// most `slots` bytes makes units of one byte). Throws c10::Error with the
/// smallest budget the most frugal schedule needs when none fits.
///
/// Example:
/// \code
///   memfit::ChainCosts c{{4, 4, 4, 4}, {8, 8, 8}, {1, 1, 1}, {2, 2, 2}, {false, false, false}};
///   auto s = memfit::solve_optimal(c, 40);
///   assert(memfit::simulate(s, c).peak_bytes <= 40);
/// \endcode
Schedule solve_optimal(const ChainCosts& costs, int64_t budget,
                       const SolverOptions& options = SolverOptions());

/// The schedule that needs the least memory under the model (at the
/// solver's resolution): what min_budget() measures.
///
/// Example:
/// \code
///   memfit::ChainCosts c{{1, 10, 10, 10, 10}, {10, 10, 10, 10}, {1, 1, 1, 1}, {1, 1, 1, 1},
///                        {false, false, false, false}};
///   auto least = memfit::schedule_least_memory(c);
///   assert(memfit::simulate(least, c).peak_bytes == memfit::min_budget(c));
/// \endcode
Schedule schedule_least_memory(const ChainCosts& costs, const SolverOptions& options = SolverOptions());

/// The smallest budget any schedule of the model needs (the peak of the most
/// frugal schedule the solver finds at `options.slots` resolution).
///
/// Example:
/// \code
///   memfit::ChainCosts c{{4, 4, 4}, {8, 8}, {1, 1}, {2, 2}, {false, false}};
///   auto least = memfit::min_budget(c);  // a budget below this throws in solve_optimal
/// \endcode
int64_t min_budget(const ChainCosts& costs, const SolverOptions& options = SolverOptions());

} // namespace memfit
