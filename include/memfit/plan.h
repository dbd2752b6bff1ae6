#pragma once
/// \file plan.h
/// What the planner (module_plan.h) is asked, what it chooses among, and what
/// it answers: PlanOptions, the knobs of one step (StepSettings), a step's
/// prediction (StepPrediction) and the candidates a plan timed
/// (TimedCandidate), with the few functions that turn them into
/// TrainerOptions and text. The planner itself, which measures any module's
/// step, searches these knobs and answers with a ModulePlan, is module_plan.h.
///
/// How a plan is chosen: the closest candidates predicted to fit run real
/// steps under the budget, and the measured fastest wins, a tie going to the
/// plan that does least. The rule, its bands and its busy-machine case are
/// stated once, in docs/planner.md ("The tie rule"). Those steps cost a few
/// seconds, need no memory beyond the budget, and verify that the plan fits.
///
/// Thread safety: these are values. Sync points and extra memory: none; the
/// functions here compute on the host.

#include "memfit/memory.h"
#include "memfit/precision.h"
#include "memfit/checkpoint.h"
#include "memfit/schedule.h"
#include "memfit/trainer.h"

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace memfit {

/// Whether plans turn on selective recomputation (checkpoint.h's
/// SelectivelyRecomputed: make_gpt's blocks, or modules of the user's own)
/// in models that have it; others have nothing to choose.
enum class SelectiveRecompute {
  kOff,     ///< Never: the modules keep what their recomputable part saves.
  kChoose,  ///< The planner chooses per plan (both are profiled or measured).
  kOn,      ///< Always (the model has such modules, or the planner refuses it).
};

/// Whether plans may micro-batch a model whose layers normalise with batch
/// statistics (BatchNorm): each micro-batch is then normalised with its own
/// statistics, which changes the math as lower precision does.
enum class BatchStatistics {
  kKeep,           ///< Never: such a model runs each batch in one pass.
  kPerMicroBatch,  ///< Micro-batches may change them; the plan's text says so.
};

/// What the planner may choose and what the step it plans for looks like.
struct PlanOptions {
  /// Precisions the plan may use (each is profiled).
  TORCH_ARG(std::vector<Precision>, precisions) = {Precision::kFP32};
  /// Whether the plan may checkpoint activations.
  TORCH_ARG(bool, checkpointing) = true;
  /// Whether the plan may keep the optimizer state, then the gradients, then
  /// the parameters (streamed, stream.h; fp32 only) on the host.
  TORCH_ARG(bool, offload) = true;
  /// The larger of the two batch sizes profiled (the other is half of it);
  /// halved while profiling it would exceed profile_budget (to 2 at least;
  /// then 2 and 3 where 3 fits, see profile_budget).
  TORCH_ARG(int64_t, profile_batch) = 32;
  /// Bytes the measuring steps may allocate on the device (0: no limit); set
  /// it to the budget planned for. Bytes are linear in the batch, and the
  /// planner counts its measuring steps' whole peak: it runs the plain step
  /// at micro-batches of 1 and 2 (2 and 4 with batch statistics) and halves
  /// profile_batch until that line says the step fits the margin of this;
  /// where that leaves 1 and 2, it measures 2 and 3 if that line says a step
  /// of 3 fits (a micro-batch of 1 makes views contiguous that larger ones
  /// copy, so a line through it over-predicts them). plan() and find_batch()
  /// for a module and a budget set it to that budget when left 0.
  TORCH_ARG(int64_t, profile_budget) = 0;
  /// Plans must fit in this fraction of the budget by prediction (room for
  /// what the model does not see: allocator rounding, the data loader's
  /// indices). Where real steps can run (measure_candidates > 0), a plan
  /// predicted above it but within the budget is timed too, and fits if its
  /// steps fit the budget.
  TORCH_ARG(double, margin) = 0.97;
  /// Whether the plan may split the batch into micro-batches.
  TORCH_ARG(bool, micro_batching) = true;
  /// Whether it may also split the batch of a model with batch statistics
  /// (see BatchStatistics): by default it keeps them, as the math is the user's.
  TORCH_ARG(BatchStatistics, batch_statistics) = BatchStatistics::kKeep;
  /// Selective recomputation (see SelectiveRecompute).
  TORCH_ARG(SelectiveRecompute, selective_recompute) = SelectiveRecompute::kChoose;
  /// Run the best candidates' real steps under the budget before choosing
  /// one (see measure_candidates), and the chosen plan's where none was timed.
  TORCH_ARG(bool, verify) = true;
  /// How many candidates plan() times with real steps before choosing, as
  /// autotuners do (with verify); which ones, and how their times decide, is
  /// docs/planner.md's "The tie rule". 0: choose by prediction alone.
  TORCH_ARG(int64_t, measure_candidates) = 4;
  /// Candidates predicted to take at most (1 + measure_within) times the
  /// fastest prediction are timed (the time model errs most between micro-batch sizes).
  TORCH_ARG(double, measure_within) = 1.0;
  /// How many cores other processes leave LibTorch while candidates are
  /// timed (read after each pass and once the passes end; a negative value:
  /// unknown, and the timings' own spread says whether the machine is busy,
  /// see measure_candidates). nullptr: CpuLoad measures it over the timing.
  /// Set it where the machine's share is known better than the process
  /// table shows it (a container's CPU quota), or in a test that must know
  /// which rule chooses.
  TORCH_ARG(std::function<double()>, free_cores) = nullptr;
};

/// The knobs of one training step.
struct StepSettings {
  /// Examples per forward/backward; 0: the whole batch.
  TORCH_ARG(int64_t, micro_batch) = 0;
  /// Compute precision (autocast).
  TORCH_ARG(Precision, precision) = Precision::kFP32;
  /// Where the optimizer state lives.
  TORCH_ARG(Offload, offload_optimizer) = Offload::kNone;
  /// Where gradients accumulate (kHost needs offload_optimizer kHost): moved
  /// to the host as backward produces them (TrainerOptions::offload_gradients).
  TORCH_ARG(Offload, offload_gradients) = Offload::kNone;
  /// Where the parameters live between uses (kHost needs both offloads
  /// above): streamed from the host layer by layer (TrainerOptions::offload_parameters).
  TORCH_ARG(Offload, offload_parameters) = Offload::kNone;
  /// Streamed Linear weights run in tiles of at most this many bytes; 0: untiled.
  TORCH_ARG(int64_t, tile_bytes) = 0;
  /// Whether the model's SelectivelyRecomputed modules recompute their part
  /// in backward (set_selective_recompute): make_gpt's blocks their
  /// attention scores, softmax and attention dropout.
  TORCH_ARG(bool, selective_recompute) = false;
};

/// TrainerOptions that run a step with `settings`' knobs over `base`:
/// micro-batch, precision, the offloads and the stream's tiles. Checkpoint
/// schedules and selective recomputation belong to the model
/// (CheckpointedSequential::set_schedule, set_selective_recompute).
///
/// Example:
/// \code
///   auto options = memfit::trainer_options(memfit::StepSettings().micro_batch(16),
///                                          memfit::TrainerOptions().batch_size(64));
///   assert(options.micro_batch_size() == 16 && options.batch_size() == 64);
/// \endcode
TrainerOptions trainer_options(const StepSettings& settings, TrainerOptions base = TrainerOptions());

/// What a step keeps on the host: "none", "optimizer", "optimizer, gradients"
/// or "optimizer, gradients, parameters" (the "offload" of ModulePlan::to_json).
///
/// Example:
/// \code
///   assert(memfit::offload_text(memfit::StepSettings()) == "none");
/// \endcode
std::string offload_text(const StepSettings& settings);

/// What the model predicts for a step.
struct StepPrediction {
  int64_t peak_bytes = 0;          ///< The larger phase's bytes.
  StepMemory memory;               ///< The peak split by category.
  double seconds = 0;              ///< Time per logical batch.
  int64_t accumulation_steps = 1;  ///< Micro-batches per logical batch.
  std::string phase;               ///< "forward/backward" or "optimizer step".
  int64_t forward_backward_bytes = 0;  ///< Peak of a micro-batch's forward and backward.
  int64_t activation_bytes = 0;        ///< Its part from the schedule's activations.
  int64_t optimizer_step_bytes = 0;    ///< Peak of the optimizer step.
};

/// A candidate plan timed with real steps before the choice
/// (PlanOptions::measure_candidates).
struct TimedCandidate {
  StepSettings settings;              ///< Its knobs.
  std::vector<Schedule> schedules;    ///< Each chain's schedule, in ModulePlan::chains' order.
  double predicted_seconds = 0;       ///< Predicted time per logical batch.
  double measured_seconds = 0;        ///< Its fastest timed step (0: ran out of memory under the budget).
  int64_t measured_peak_bytes = 0;    ///< The timed steps' peak.
};


/// How find_batch searches.
struct FindBatchOptions {
  /// The largest batch considered.
  TORCH_ARG(int64_t, max_batch) = 65536;
  /// Verify each answer with real training steps under the budget.
  TORCH_ARG(bool, verify) = true;
  /// Verification attempts: after an out-of-memory error the batch shrinks by 10%.
  TORCH_ARG(int64_t, attempts) = 6;
  /// For a data set whose examples differ in size (token windows padded per
  /// batch, images of several sizes): the index of its largest example
  /// (memfit::largest_example finds it). Every batch measured and verified
  /// is then that example repeated, the worst batch of its size, so the
  /// answer holds for any batch the data set pads to at most that size.
  /// -1: the data set's first examples.
  TORCH_ARG(int64_t, largest_example) = -1;
};


} // namespace memfit
