#pragma once
/// \file plan.h
/// The planner: a cost model of a training step's peak memory and time, and
/// the search for the fastest combination of techniques that fits a budget.
///
/// StepModel profiles the model's chain (profile.h) in each precision it may
/// use, and fits every layer's bytes and times as functions of the batch. A step's peak is then predicted as the larger of
/// two phases:
///   - forward and backward of one micro-batch: parameters and buffers, the
///     optimizer state (unless offloaded), the micro-batch itself, the
///     activation peak that schedule.h's simulator gives for the checkpoint
///     schedule on the scaled costs, and the parameter gradients (with
///     accumulation, the accumulated ones and one more being added);
///   - the optimizer step: parameters, gradients, state and the step's
///     temporaries (Adam: two tensors of the largest parameter's size); with
///     the state offloaded, parameters and gradients only; with the gradients
///     offloaded too, parameters only (and during backward one layer's
///     gradients instead of all of them).
/// Bytes are linear in the batch, through profile_batch and its half; times
/// are fitted piecewise through every measured batch (1, 2, 4, … doubling to
/// profile_batch and, up to PlanOptions::time_batch, 4× steps above it until
/// one takes PlanOptions::saturation_seconds), so that micro-batches are
/// priced from measurements and larger ones extrapolated linearly where the
/// device is busy. Within PlanOptions::profile_budget, profiling runs only
/// the batches whose bytes the smaller ones say fit. Every batch is timed in two passes,
/// the second in reverse order, and each layer keeps its faster time. With
/// streamed parameters (StepSettings::offload_parameters) layers other than
/// Linear are simulated as checkpoints of their own, each Linear adds one
/// weight tile, and each micro-batch two measured copies of every parameter. Time per logical batch is the
/// simulated forward, recomputation and backward time of each micro-batch plus
/// a measured optimizer step (with the host copies when offloaded);
/// recomputation is priced by one measurement of the chain with sqrt(n)
/// checkpoints against the plain chain.
///
/// plan() searches precision (among those allowed), selective recomputation of
/// attention (models with transformer blocks), optimizer-state offload and
/// micro-batch size (the batch, halved down to 1), and for each the
/// schedule: none when it fits, else the optimal checkpoint schedule for the
/// memory left; it keeps the fitting plan with the least predicted time.
/// Plans predicted within 3% of the fastest are a tie (the time model's noise
/// on a shared machine), which the plan without recomputation, then with
/// less offload, then with fewer micro-batches wins: what a plan does settles
/// it, not which of them timing noise put ahead.
///
/// The prediction errs most between micro-batch sizes (large ones are
/// extrapolated; a busy machine skews the small timings), by more than the
/// tie band. So plan(model, make_model, data, ...) and the module planner
/// then choose by measurement, as autotuners do: the closest candidates
/// (PlanOptions::measure_candidates, one per micro-batch and precision) run
/// real steps under the budget in passes, every other one in reverse order
/// (two, and up to five while the contenders' fastest steps disagree by
/// more than 3%), and the measured fastest wins,
/// with the same tie band and rule. Those steps cost a few seconds, need no
/// memory beyond the budget, and also verify that the plan fits.
///
/// Thread safety: a StepModel is a value after construction. Sync points: the
/// profiling runs. Extra memory: profiling runs one layer at a time at the
/// batches above, and the whole chain's step once at profile_batch; with a
/// profile budget, within it beyond the parameters' gradients. The model's
/// buffers and the RNG are restored afterwards.

#include "memfit/memory.h"
#include "memfit/precision.h"
#include "memfit/profile.h"
#include "memfit/schedule.h"
#include "memfit/trainer.h"

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace memfit {

/// What profile() measured on a model.
struct ModelProfile {
  ChainProfile chain;        ///< Per layer at the sample batch: bytes kept, times.
  StepMemory step;           ///< A real training step's peak, by category.
  double step_seconds = 0;   ///< That step's time.
};

/// Profiles a classifier chain on `sample_batch`: each layer (profile_chain),
/// and the whole training step, measured by two real steps (cross-entropy
/// against class 0, `optimizer` with its defaults); the model's parameters,
/// buffers and the CPU RNG are put back afterwards, so `model` is left as it was.
///
/// Example:
/// \code
///   auto net = memfit::make_mlp(memfit::ModelOptions().width(32).depth(1));
///   auto p = memfit::profile(net, torch::zeros({16, 1, 28, 28}));
///   assert(p.chain.layers.size() == net->size() && p.step.peak > 0);
/// \endcode
ModelProfile profile(const torch::nn::Sequential& model, const torch::Tensor& sample_batch,
                     OptimizerKind optimizer = OptimizerKind::kAdam);

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

/// The path of the first layer of `module` that normalises with batch
/// statistics (a BatchNorm; its path as named_modules() gives it, "" for
/// the module itself), or nullopt when none does.
///
/// Example:
/// \code
///   torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4));
///   assert(memfit::batch_statistics_layer(*net) == std::optional<std::string>("1"));
/// \endcode
std::optional<std::string> batch_statistics_layer(const torch::nn::Module& module);

/// What the planner may choose and what the step it plans for looks like.
struct PlanOptions {
  /// The optimizer the step uses (its state and temporaries).
  TORCH_ARG(OptimizerKind, optimizer) = OptimizerKind::kAdam;
  /// SGD momentum (0: no state).
  TORCH_ARG(double, momentum) = 0.9;
  /// Weight decay (one more temporary per parameter in Adam and SGD).
  TORCH_ARG(double, weight_decay) = 0.0;
  /// Precisions the plan may use (each is profiled).
  TORCH_ARG(std::vector<Precision>, precisions) = {Precision::kFP32};
  /// Whether the plan may checkpoint activations.
  TORCH_ARG(bool, checkpointing) = true;
  /// Whether the plan may keep the optimizer state, then the gradients, then
  /// the parameters (streamed, stream.h; fp32 only) on the host.
  TORCH_ARG(bool, offload) = true;
  /// The larger of the two batch sizes profiled (the other is half of it);
  /// halved while profiling it would exceed profile_budget (to 2 at least;
  /// the module planner then profiles 2 and 3 where 3 fits, see profile_budget).
  TORCH_ARG(int64_t, profile_batch) = 32;
  /// Times are measured up to this micro-batch (at 4× steps above
  /// profile_batch and at it), not extrapolated; set it to the batch planned
  /// for. Profiling runs one layer at a time at these batches. Timing stops
  /// early at a batch that would exceed profile_budget, and after the first
  /// that takes saturation_seconds. 0: profile_batch.
  TORCH_ARG(int64_t, time_batch) = 0;
  /// Bytes profiling may allocate on the device (0: no limit); set it to the
  /// budget planned for. Bytes are linear in the batch. StepModel counts
  /// them beyond the parameters and their gradients: it profiles at 1 and 2
  /// examples and doubles while the two largest batches measured say the
  /// next fits; larger batches are extrapolated. The module planner
  /// (module_plan.h) counts its measuring steps' whole peak: it runs the
  /// plain step at micro-batches of 1 and 2 (2 and 4 with batch statistics)
  /// and halves profile_batch until that line says the step fits the margin
  /// of this; where that leaves 1 and 2, it measures 2 and 3 if that line
  /// says a step of 3 fits (a micro-batch of 1 makes views contiguous that
  /// larger ones copy, so a line through it over-predicts them); its plan()
  /// and find_batch() for a module and a budget set it
  /// to that budget when left 0. time_batch and saturation_seconds are
  /// StepModel's only.
  TORCH_ARG(int64_t, profile_budget) = 0;
  /// A timed batch whose forward and backward take this long keeps the device
  /// busy: time grows linearly above it, so larger batches are extrapolated
  /// rather than timed, and planning a large batch costs little more than
  /// planning a small one.
  TORCH_ARG(double, saturation_seconds) = 0.02;
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
  /// Plans for a user's module (module_plan.h): run the best candidates'
  /// real steps under the budget before choosing one. StepModel ignores it.
  TORCH_ARG(bool, verify) = true;
  /// How many candidates plan() times with real steps before choosing, as
  /// autotuners do, where it can run steps (given make_model and data, or
  /// the module planner with verify): the fastest predicted of each
  /// micro-batch and precision, fastest predicted first, and only those
  /// within measure_within of the fastest prediction. The measured fastest
  /// is chosen (times within 3% of it are a tie, settled as predictions'
  /// are). On a busy machine (other processes leave fewer free cores than
  /// LibTorch has threads, CpuLoad) times cannot tell plans apart: of all
  /// the plans predicted to fit, the one that does least is chosen, so the
  /// plan does not follow the noise. 0: choose by prediction alone.
  TORCH_ARG(int64_t, measure_candidates) = 4;
  /// Candidates predicted to take at most (1 + measure_within) times the
  /// fastest prediction are timed (the time model errs most between micro-batch sizes).
  TORCH_ARG(double, measure_within) = 1.0;
};

/// The knobs of one training step.
struct StepSettings {
  /// Examples per forward/backward; 0: the whole batch.
  TORCH_ARG(int64_t, micro_batch) = 0;
  /// Compute precision (autocast).
  TORCH_ARG(Precision, precision) = Precision::kFP32;
  /// The checkpoint schedule; empty: none.
  TORCH_ARG(Schedule, schedule) = Schedule();
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
/// micro-batch, precision, the offloads and the stream's tiles. The schedule
/// and selective recomputation belong to the model
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
/// or "optimizer, gradients, parameters" (the "offload" of Plan::to_json).
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

/// The cost model of a training step for one model (see the file comment).
class StepModel {
 public:
  /// Profiles `chain` on batches of `example` (one example, batch dimension 1)
  /// on `device`, in each of options.precisions() (and with and without
  /// selective recomputation where the model has it and the options allow the
  /// choice; the chain's own setting is put back), and times an optimizer step.
  StepModel(const torch::nn::Sequential& chain, const torch::Tensor& example,
            PlanOptions options = PlanOptions(), torch::Device device = torch::kCPU);

  /// Predicts a step over a logical batch of `batch` examples.
  StepPrediction predict(int64_t batch, const StepSettings& settings) const;
  /// The chain's costs at `micro_batch` examples in `precision`, with or
  /// without selective recomputation.
  ChainCosts costs(Precision precision, int64_t micro_batch, bool selective_recompute = false) const;
  /// The profile at profile_batch() in `precision`.
  const ChainProfile& profile(Precision precision, bool selective_recompute = false) const;
  /// The larger batch profiled: options().profile_batch(), halved while it
  /// exceeded options().profile_budget(). Bytes are linear through it and its half.
  int64_t profile_batch() const { return large_batch_; }
  /// The batches timed, ascending; times of larger micro-batches are extrapolated.
  const std::vector<int64_t>& timed_batches() const { return timed_batches_; }
  /// The selective-recomputation settings profiled: {false}, {true} or
  /// {false, true} (options().selective_recompute() and what the model has).
  const std::vector<bool>& selective_choices() const { return selective_choices_; }
  /// The chain's first layer with batch statistics (batch_statistics_layer).
  const std::optional<std::string>& batch_statistics() const { return batch_statistics_; }
  /// The options, as checked.
  const PlanOptions& options() const { return options_; }
  /// The device profiled on.
  const torch::Device& device() const { return device_; }
  /// Parameter and buffer bytes.
  int64_t parameter_bytes() const { return parameter_bytes_; }
  /// Optimizer state bytes with the state resident.
  int64_t optimizer_state_bytes() const { return state_bytes_; }
  /// Device workspaces held through every step (ChainProfile::workspace_bytes;
  /// CUDA's cuBLAS workspaces, 0 on the CPU); part of every predicted peak,
  /// counted with the activations and temporaries as a measured step counts them.
  int64_t workspace_bytes() const { return workspace_bytes_; }
  /// Measured recomputation time over the simulator's (which prices a no-grad
  /// forward like one with grad); scales predicted recomputation.
  double recompute_factor() const { return recompute_factor_; }
  /// Seconds to bring every parameter from the host to the device once (a
  /// streamed micro-batch does it twice: forward and backward).
  double stream_seconds() const { return stream_seconds_; }
  /// Bytes of the largest Linear weight among the chain's layers (0: none):
  /// the tile sizes the planner tries are fractions of it.
  int64_t largest_linear_bytes() const;
  /// Seconds that cutting the streamed Linear weights into tiles of at most
  /// `tile_bytes` adds to a micro-batch of `micro_batch` examples (0 for
  /// `tile_bytes` 0 or a chain without a Linear that large): each Linear's
  /// products as ParameterStream computes them (forward, input and weight
  /// gradients) timed tile by tile against whole, on the device profiled.
  /// Many small products cost more than one large one on a blocked BLAS
  /// (OpenBLAS: the MLP's 98 KiB tiles at 256 rows, 1.5x the step) and about
  /// the same on the reference BLAS. Measured on first use of each pair and
  /// kept; the temporaries are a micro-batch's inputs and outputs of one
  /// layer, the weight and its gradient. Sync points: on CUDA, one per round.
  double tile_seconds(int64_t micro_batch, int64_t tile_bytes) const;

 private:
  void profile_layers(const torch::nn::Sequential& chain, const torch::Tensor& example);
  double calibrate_recomputation(const torch::nn::Sequential& chain, const torch::Tensor& x,
                                 Precision precision) const;
  // The profile's layers scaled to `micro_batch` examples.
  ChainProfile scaled_profile(Precision precision, int64_t micro_batch, bool selective_recompute) const;

  struct Profiled {
    ChainProfile large, small;               // bytes: linear through these
    std::map<int64_t, ChainProfile> timed;   // times: piecewise through these, by batch
  };
  PlanOptions options_;
  torch::Device device_;
  std::map<std::pair<Precision, bool>, Profiled> profiles_;
  std::vector<bool> selective_choices_;
  std::optional<std::string> batch_statistics_;
  int64_t large_batch_ = 0;
  std::vector<int64_t> timed_batches_;
  int64_t example_bytes_ = 0;
  int64_t parameter_bytes_ = 0;
  int64_t trainable_bytes_ = 0;
  int64_t largest_trainable_ = 0;
  int64_t state_bytes_ = 0;
  int64_t step_temporary_bytes_ = 0;
  int64_t workspace_bytes_ = 0;
  double step_seconds_ = 0;
  double offloaded_step_seconds_ = 0;
  double gradient_offload_seconds_ = 0;  // adding every gradient into host copies once
  double recompute_factor_ = 1.0;
  // Streamed parameters: per layer of the chain.
  struct StreamedLayerCost {
    bool linear = false;       // written out and tiled; else recomputed
    int64_t rows = 0;          // Linear: output rows
    int64_t cols = 0;          // Linear: input features
    int64_t row_bytes = 0;     // Linear: bytes of one weight row plus its bias element
    int64_t bytes = 0;         // all its parameters
    int64_t largest = 0;       // its largest parameter
  };
  std::vector<StreamedLayerCost> stream_layers_;
  int64_t buffer_bytes_ = 0;
  double stream_seconds_ = 0;
  mutable std::map<std::pair<int64_t, int64_t>, double> tile_seconds_;  // by (micro-batch, tile bytes)
};

/// A candidate plan timed with real steps before the choice
/// (PlanOptions::measure_candidates).
struct TimedCandidate {
  StepSettings settings;              ///< Its knobs.
  std::vector<Schedule> schedules;    ///< Module plans: each chain's schedule (StepModel plans keep it in settings).
  double predicted_seconds = 0;       ///< Predicted time per logical batch.
  double measured_seconds = 0;        ///< Its fastest timed step (0: ran out of memory under the budget).
  int64_t measured_peak_bytes = 0;    ///< The timed steps' peak.
};

/// A plan: the knobs, what they are predicted to cost, and why.
struct Plan {
  bool fits = false;                 ///< Whether a combination fits the budget.
  int64_t budget = 0;                ///< The budget planned for.
  int64_t batch = 0;                 ///< The logical batch.
  StepSettings settings;             ///< The chosen knobs.
  StepPrediction predicted;          ///< Its predicted peak and time.
  double plain_seconds = 0;          ///< The plain step's predicted time.
  int64_t plain_peak_bytes = 0;      ///< The plain step's predicted peak.
  int64_t candidates = 0;            ///< Combinations considered.
  std::vector<TimedCandidate> timed; ///< Those timed with real steps, fastest predicted first.
  double measured_seconds = 0;       ///< The chosen plan's measured time (0: not timed).
  int64_t measured_peak_bytes = 0;   ///< The chosen plan's real steps' peak under the budget (0: not run).
  /// Measured times within this fraction of the fastest were a tie, settled by
  /// what the plans do: 0.03, or the timing's own noise where its passes did
  /// not settle; 0 when nothing was timed. On a busy machine (other
  /// processes left fewer free cores than LibTorch has threads, CpuLoad)
  /// times decide nothing: of all the plans predicted to fit, the one that
  /// does least is chosen, and the reasons say so.
  double measured_tie = 0;
  std::vector<std::string> why;      ///< One line per choice.

  /// {"fits", "budget_bytes", "predicted_peak_bytes", "predicted_seconds",
  /// "plain_peak_bytes", "plain_seconds", "batch", "micro_batch",
  /// "accumulation_steps", "precision", "checkpoint", "selective_recompute",
  /// "offload", "tile_bytes", "measured_seconds", "measured_peak_bytes",
  /// "measured_tie", "timed" (each candidate's "micro_batch", "precision",
  /// "offload", "checkpoint", "predicted_seconds", "measured_seconds",
  /// "measured_peak_bytes"), "why"}.
  std::string to_json() const;
  /// The plan and its reasons as text.
  std::string explain() const;
};

/// The offload settings plan() tries (optimizer state, gradients, parameters
/// and tile sizes; the other knobs at their defaults): nothing on the host;
/// the optimizer state; the state and the gradients; and, with those, the
/// parameters streamed, untiled and with the largest Linear weight in 4, 16
/// and 64 tiles (where a tile is at least 1 KiB). With PlanOptions::offload
/// false, nothing on the host only.
///
/// Example:
/// \code
///   auto net = memfit::make_mlp();
///   memfit::StepModel model(net, torch::zeros({1, 1, 28, 28}));
///   auto choices = memfit::offload_choices(model, model.options());
///   assert(choices.size() == 7 && choices.back().tile_bytes() == 784 * 512 * 4 / 64);
/// \endcode
std::vector<StepSettings> offload_choices(const StepModel& model, const PlanOptions& options);

/// The plan with the least predicted time per logical batch of `batch` whose
/// predicted peak fits options.margin() × `budget` (plans within 3% of the
/// fastest are a tie, won by the plan without recomputation, then with less
/// offload, then with fewer micro-batches).
///
/// Throws c10::Error when nothing fits, giving the smallest budget that the
/// most frugal combination needs and the part that dominates it.
///
/// Example:
/// \code
///   auto net = memfit::make_mlp(memfit::ModelOptions().width(64).depth(2));
///   memfit::StepModel model(net, torch::zeros({1, 1, 28, 28}));
///   auto p = memfit::plan(model, 256, 4 << 20);
///   assert(p.fits && p.predicted.peak_bytes <= 4 << 20);
/// \endcode
Plan plan(const StepModel& model, int64_t batch, int64_t budget);

/// plan(), then choosing by measurement where prediction cannot tell: the
/// candidates PlanOptions::measure_candidates names each train a fresh
/// `make_model()` on `data` under `budget` for two steps (a warm-up and a
/// timed one), in passes over them (see the file comment); each one's
/// fastest timed step counts, and the measured fastest is chosen. A candidate that runs out of memory under the
/// budget is dropped; when every one does, the choice is the prediction's.
/// Plan::timed lists what ran; the CPU random generator is put back. Extra
/// time: 4 × measure_candidates steps, up to 10 × on a noisy machine; extra
/// memory: none beyond `budget`. The caller's budget is restored.
///
/// Example:
/// \code
///   auto data = memfit::load_fashion_mnist(memfit::Split::kTest);
///   auto make = [] { return memfit::make_mlp(memfit::ModelOptions().width(64).depth(1)); };
///   memfit::StepModel model(make(), data.images.narrow(0, 0, 1));
///   auto p = memfit::plan(model, make, data, 256, 4 << 20);
///   assert(p.fits && !p.timed.empty() && p.measured_seconds > 0);
/// \endcode
Plan plan(const StepModel& model, const std::function<torch::nn::Sequential()>& make_model,
          const ImageDataset& data, int64_t batch, int64_t budget);

/// Makes `plan` rank `root`'s on every rank of `group`, so that the ranks of
/// a data-parallel job train with one plan.
///
/// A rank that plans times its own candidates, and on a shared machine timing
/// noise can give two ranks different plans: a precision that differs
/// between ranks changes the math, and a micro-batch their speed. Every rank
/// calls it; the others may pass a default Plan (what they held is
/// replaced). Afterwards every field equals root's, and `why` ends with a
/// line saying that the plan is rank `root`'s (in a group of more than one).
/// Data-parallel ranks hold equal shares of the batch, so root's plan fits
/// each of them.
///
/// Sync points: two broadcasts over `group` (the plan's size, then its
/// bytes), each waiting at most the group's timeout, so ranks that do not
/// plan wait for root's planning that long at most. Extra memory: the plan
/// as text (a few KiB) in host tensors outside the budget.
///
/// Example:
/// \code
///   memfit::WorldInfo solo;  // one process: a group of one
///   solo.master_port = 0;
///   memfit::ProcessGroup group(solo);
///   memfit::Plan p;
///   p.settings.micro_batch(16);
///   memfit::broadcast_plan(p, group);  // on every rank: rank 0's plan
///   assert(p.settings.micro_batch() == 16);
/// \endcode
void broadcast_plan(Plan& plan, ProcessGroup& group, int64_t root = 0);

/// How find_batch searches.
struct FindBatchOptions {
  /// The largest batch considered.
  TORCH_ARG(int64_t, max_batch) = 65536;
  /// Verify each answer with real training steps under the budget.
  TORCH_ARG(bool, verify) = true;
  /// Verification attempts: after an out-of-memory error the batch shrinks by 10%.
  TORCH_ARG(int64_t, attempts) = 6;
};

/// A batch size found, how it runs, and how it was checked.
struct BatchFound {
  int64_t batch = 0;                  ///< Examples per pass (0: not even 1 fits).
  StepSettings settings;              ///< The knobs it runs with (no micro-batching).
  int64_t predicted_peak_bytes = 0;   ///< The model's prediction.
  int64_t measured_peak_bytes = 0;    ///< The verification's peak (0 unverified).
  bool verified = false;              ///< Two real steps ran under the budget.
  int64_t attempts = 0;               ///< Verification runs (out-of-memory ones included).
};

/// The largest batches that fit a budget in one pass: plainly, and with
/// memfit's techniques (checkpointing, offload, the allowed precisions).
struct BatchSearch {
  BatchFound plain;       ///< The first allowed precision, nothing else (selective recomputation only if kOn).
  BatchFound techniques;  ///< With checkpointing, offload and precision.
};

/// Finds the largest batch whose predicted step fits `budget`, plainly and
/// with the planner's techniques, by bisection on the cost model; then (with
/// options.verify) trains two real steps of a fresh `make_model()` on `data`
/// under the budget, shrinking the batch by 10% after an out-of-memory error,
/// which is caught and recovered from. Not a blind trial of batch sizes: each
/// verification runs the predicted answer. The caller's budget is restored.
///
/// Example:
/// \code
///   auto data = memfit::load_fashion_mnist(memfit::Split::kTest);
///   auto make = [] { return memfit::make_mlp(memfit::ModelOptions().width(64).depth(1)); };
///   memfit::StepModel model(make(), data.images.narrow(0, 0, 1));
///   auto found = memfit::find_batch(model, make, data, 4 << 20);
///   assert(found.plain.verified && found.plain.measured_peak_bytes <= 4 << 20);
/// \endcode
BatchSearch find_batch(const StepModel& model,
                       const std::function<torch::nn::Sequential()>& make_model,
                       const ImageDataset& data, int64_t budget,
                       const FindBatchOptions& options = FindBatchOptions());

} // namespace memfit
