#pragma once
/// \file trainer.h
/// Training any LibTorch module with the user's loss: one optimizer step at a
/// time (train_step, for a loop of one's own) or a whole run (fit), with
/// every memory technique as a component of the step (step.h).
///
/// A step is a transaction: when anything throws inside it, the module's
/// parameters and buffers, the gradients, the optimizer's state (with
/// memfit::optim's optimizers, which OptimizerKind builds), the GradScaler,
/// the RNG states, the step and the data position are left as they were,
/// and OnOutOfMemory::kReplan runs an out-of-memory step again under new
/// settings (docs/recovery.md).
///
/// Thread safety: a Trainer is used from one thread at a time. Sync points:
/// one per step (the micro-batches' losses are summed on the device and read
/// once, after the last backward, for the record and the non-finite check;
/// none with NonfiniteLoss::kUnchecked); one more with fp16 (whether the
/// step was skipped: read after the update is queued where the fused kernel
/// skips by itself, none then with kUnchecked) and with clipping (the norm); recovery adds none in one process unless a step fails, and with a
/// process group none either: its vote replaces the loss's all-reduce (one
/// more under NCCL, NonfiniteLoss::kSkip or an optimizer of one's own;
/// docs/recovery.md). Extra memory:
/// the micro-batch being trained on (copied to the device from host memory,
/// memfit::to_device), and the optimizer's state (none on the device with
/// offload_optimizer kHost); host copies of the buffers and RNG states.

#include "memfit/batch.h"
#include "memfit/data.h"
#include "memfit/distributed.h"
#include "memfit/memory.h"
#include "memfit/optim.h"
#include "memfit/pipeline.h"
#include "memfit/precision.h"
#include "memfit/state.h"
#include "memfit/step.h"
#include "memfit/stream.h"

#include <ATen/core/Generator.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/utils.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <algorithm>
#include <any>
#include <optional>
#include <cstdint>
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <typeindex>
#include <typeinfo>
#include <vector>

namespace memfit {

/// The optimizers the Trainer can build.
enum class OptimizerKind { kSGD, kAdam, kAdamW };

/// Parses "sgd", "adam" or "adamw"; throws c10::Error naming the accepted names.
///
/// Example:
/// \code
///   assert(memfit::parse_optimizer_kind("adamw") == memfit::OptimizerKind::kAdamW);
/// \endcode
OptimizerKind parse_optimizer_kind(const std::string& name);

struct TrainerOptions;

/// Builds a user's optimizer over the parameters it is given (those left to
/// train, or their fp32 masters). LR schedulers take the optimizer from
/// Trainer::optimizer(), as in LibTorch.
using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor> params)>;

/// Builds the optimizer that `options` names (optimizer_factory, else
/// optimizer, lr, momentum, weight_decay) over `params`, as the Trainer does.
/// Throws c10::Error when the factory returns nothing.
///
/// Example:
/// \code
///   auto net = memfit::make_mlp(memfit::ModelOptions().width(8).depth(1));
///   auto sgd = memfit::make_optimizer(
///       memfit::TrainerOptions().optimizer(memfit::OptimizerKind::kSGD).lr(0.1), net->parameters());
/// \endcode
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainerOptions& options,
                                                        std::vector<torch::Tensor> params);

/// How a Trainer holds parameters when its precision is bf16 or fp16.
enum class MasterWeightsMode {
  kNone,    ///< fp32 parameters; autocast alone lowers the compute precision.
  kDevice,  ///< Parameters in the low dtype, fp32 masters and optimizer state on the device.
  kHost,    ///< Parameters in the low dtype, fp32 masters and optimizer state in host memory.
};

/// Parses "none", "device" or "host"; throws c10::Error naming the accepted names.
MasterWeightsMode parse_master_weights_mode(const std::string& name);

/// What a Trainer does with a step whose loss is NaN or infinite (without a
/// GradScaler; with one, the scaler skips such steps and backs off).
enum class NonfiniteLoss {
  kError,  ///< Stop with a c10::Error naming the step.
  kSkip,   ///< Skip the step: no backward, no optimizer step (BatchNorm's running
           ///< statistics keep what the skipped forward put in them, as in PyTorch).
  /// Neither read nor check the loss: a step reads nothing back to the host
  /// (without fp16's GradScaler and clipping, which read their own values).
  /// StepRecord::loss is NaN and StepRecord::loss_tensor holds the step's
  /// loss on its device, for a loop of one's own that logs every N steps, as
  /// PyTorch users do; a NaN loss then updates the parameters, as in a
  /// PyTorch loop without a check. train_step only: fit reports every loss.
  kUnchecked,
};

/// How the ranks of a Trainer's process group share the work.
enum class ParallelMode {
  kData,      ///< Every rank holds the whole model and trains on a share of each
              ///< batch; gradients are averaged (DistributedDataParallel).
  kPipeline,  ///< Every rank holds consecutive layers (a stage) and the whole
              ///< batch flows through the stages in chunks (Pipeline).
};

/// Parses "data" or "pipeline"; throws c10::Error naming the accepted names.
ParallelMode parse_parallel_mode(const std::string& name);

/// What a Trainer does when a step runs out of memory (c10::OutOfMemoryError).
enum class OnOutOfMemory {
  kThrow,   ///< The step is undone and the error propagates (the library's default).
  kReplan,  ///< The step is undone, re-planned under the memory it found, and run again.
};

/// Parses "throw" or "replan"; throws c10::Error naming the accepted names.
///
/// Example:
/// \code
///   assert(memfit::parse_on_out_of_memory("replan") == memfit::OnOutOfMemory::kReplan);
/// \endcode
OnOutOfMemory parse_on_out_of_memory(const std::string& name);

/// The part of a training step that ran out of memory.
enum class StepPhase {
  /// The micro-batches' forward and backward: more micro-batches and
  /// recomputation make it smaller.
  kForwardBackward,
  /// After the last backward: the gradients' reduction, clipping, unscaling
  /// and the optimizer's step. Only moving the optimizer state, gradients or
  /// parameters makes it smaller.
  kUpdate,
};

/// What a step that ran out of memory tells the policy that re-plans it.
struct OutOfMemoryEvent {
  int64_t step = 0;              ///< 1-based number of the step.
  int64_t attempt = 1;           ///< 1 for the step's first failure, 2 for its retry's, ...
  int64_t examples = 0;          ///< Examples of this rank's batch.
  int64_t micro_batch_size = 0;  ///< The failed attempt's micro-batch (0: the whole batch).
  int64_t peak_bytes = 0;        ///< The most memory_allocated(device) the attempt reached.
  /// The most memory the attempt asked for: peak_bytes, or more where an
  /// allocation was refused (what was allocated then plus the request;
  /// PeakMeter::needed). On CUDA, peak_bytes plus the request the error names.
  /// 0 with a process group: each rank's differs, and the ranks' policies
  /// must answer alike.
  int64_t needed_bytes = 0;
  int64_t limit_bytes = 0;       ///< Memory the step may use: the budget, else the peak it reached.
  std::string what;              ///< The error's message, first line.
  StepPhase phase = StepPhase::kForwardBackward;  ///< Where the attempt ran out of memory.
  /// Bytes no micro-batch or recomputation can move: what the Trainer holds
  /// between steps (parameters, optimizer state on the device, its lazy
  /// first-step state included) and one gradient per parameter; where the
  /// gradients go to the host, only the largest (largest_gradient_bytes),
  /// which backward makes on the device before it goes.
  int64_t fixed_bytes = 0;
  /// Of fixed_bytes, the optimizer state's on the device: what moving it to
  /// the host (Replan::offload_optimizer) takes off.
  int64_t state_bytes = 0;
  /// Of fixed_bytes, the gradients' on the device: what moving them to the
  /// host as well (Replan::offload_gradients) takes off.
  int64_t gradient_bytes = 0;
  /// Of fixed_bytes, the parameters' on the device: what streaming them from
  /// the host (Replan::offload_parameters) takes off, less the layer in use.
  int64_t parameter_bytes = 0;
  /// The largest parameter's bytes: streamed untiled, it and its gradient
  /// are on the device together (Replan::stream's tiles split it).
  int64_t largest_parameter_bytes = 0;
  /// The largest gradient's bytes (of the parameters that require one): made
  /// on the device beside the others' sums when micro-batches accumulate,
  /// and beside the parameters when gradients go to the host.
  int64_t largest_gradient_bytes = 0;
  /// The failed attempt's stream options (TrainerOptions::stream).
  StreamOptions stream;
  /// Where the failed attempt kept the optimizer state (TrainerOptions::offload_optimizer).
  Offload offload_optimizer = Offload::kNone;
  /// Where the failed attempt's gradients went (TrainerOptions::offload_gradients).
  Offload offload_gradients = Offload::kNone;
  /// Where the failed attempt kept the parameters (TrainerOptions::offload_parameters).
  Offload offload_parameters = Offload::kNone;
  /// Whether this Trainer can move its optimizer state and gradients at a
  /// re-plan: one process, and the optimizer steps the model's float32
  /// parameters (no low-precision masters, ZeRO or pipeline) with a LibTorch
  /// or memfit SGD, Adam, AdamW, Adagrad or RMSprop.
  bool may_offload_optimizer = false;
  /// Whether it can also stream the parameters from the host: fp32, and the
  /// Sequential form or a module whose blocks are in CheckpointedSequential
  /// chains (ParameterStream::refusal).
  bool may_offload_parameters = false;
};

/// The settings a step is retried with after running out of memory.
struct Replan {
  /// Examples per forward/backward of the retry (TrainerOptions::micro_batch_size).
  int64_t micro_batch_size = 0;
  /// Anything else the retry changes on the module (a chain's schedule);
  /// called before the retry. Must keep the math.
  std::function<void()> apply;
  /// The settings in words, for the recovery's line and the report.
  std::string description;
  /// Where the retry keeps the optimizer state; unset: where it is.
  /// Offload::kHost moves it to host memory with float32 host masters and
  /// steps it there, as TrainerOptions::offload_optimizer does (ZeRO-Offload):
  /// the same optimizer on the same values, so the same math. Only where
  /// OutOfMemoryEvent::may_offload_optimizer; elsewhere the step gives up.
  std::optional<Offload> offload_optimizer;
  /// Where the retry's gradients go; unset: where they go now.
  /// Offload::kHost adds each gradient into its host master as backward
  /// makes it, as TrainerOptions::offload_gradients does: the same sums in
  /// the same order, so the same math. Needs the optimizer state on the host
  /// (offload_optimizer Offload::kHost, now or in this Replan).
  std::optional<Offload> offload_gradients;
  /// Where the retry keeps the parameters; unset: where they are.
  /// Offload::kHost streams them from their host masters layer by layer
  /// (TrainerOptions::offload_parameters, TrainerOptions::stream): the same
  /// values in the same operations. Needs the state and gradients on the
  /// host, and OutOfMemoryEvent::may_offload_parameters. While streamed, the
  /// module's parameters are placeholders: Trainer::save writes their values
  /// (the masters'), and they are whole again when the move back
  /// (TrainerOptions::restore_after) or the Trainer's end puts them back.
  /// Until then another Trainer, or a plan, over the module is refused.
  std::optional<Offload> offload_parameters;
  /// The retry's stream options (TrainerOptions::stream), for streamed
  /// parameters only; unset: as they are. Tiles (StreamOptions::tile_bytes)
  /// split a large weight's product, which rounds within 1e-5 of the whole.
  std::optional<StreamOptions> stream;
};

/// Re-plans a step that ran out of memory: returns the settings to retry
/// with, or nullopt to give up (the error then propagates).
using OutOfMemoryPolicy = std::function<std::optional<Replan>(const OutOfMemoryEvent&)>;

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

/// The Trainer's default re-planning: more micro-batches (half the
/// micro-batch, or fewer examples where the failed attempt needed more than
/// that would leave room for: OutOfMemoryEvent::needed_bytes), down to 1
/// example, which gives the same gradients; then the module's chains
/// (CheckpointedSequential) that recompute nothing recompute sqrt(n)
/// segments, then each layer alone, and then keep their checkpoints' inputs
/// in host memory (CheckpointOptions::offload), copied back for each
/// recomputation: the same values, so the same math. A module with batch
/// statistics (BatchNorm) keeps its micro-batch unless
/// `batch_statistics_may_change`, since micro-batches normalise with their
/// own statistics: its chains recompute first. Then, where the Trainer can
/// (OutOfMemoryEvent::may_offload_optimizer), the optimizer state moves to
/// the host, then the gradients, then (where
/// OutOfMemoryEvent::may_offload_parameters) the parameters are streamed.
/// These move first, as few as bring the bytes under the limit, where
/// nothing else can: the bytes no micro-batch moves exceed it; micro-batches
/// after the first would make the largest gradient beside all the others'
/// sums; the request that failed (at least needed_bytes - peak_bytes) would
/// not fit beside those bytes under any schedule; or the step ran out of
/// memory after its backward (StepPhase::kUpdate). Gradients sent to the
/// host still come to the device one at a time, the largest beside the
/// parameters. Streamed parameters come in tiles of a quarter of the limit
/// where the largest weight and its gradient take more than half of it.
/// Gives up when nothing is left.
///
/// Example:
/// \code
///   auto policy = memfit::more_micro_batches(*memfit::make_mlp(), false);
///   memfit::OutOfMemoryEvent e;
///   e.examples = 64;
///   assert(policy(e)->micro_batch_size == 32);
/// \endcode
OutOfMemoryPolicy more_micro_batches(const torch::nn::Module& module, bool batch_statistics_may_change);

/// Options of a training run, named after PyTorch's (lr, weight_decay, momentum).
struct TrainerOptions {
  /// Examples per optimizer step.
  TORCH_ARG(int64_t, batch_size) = 64;
  /// Optimizer steps to take; 0 means `epochs` full passes over the data.
  TORCH_ARG(int64_t, steps) = 0;
  /// Passes over the data when `steps` is 0.
  TORCH_ARG(int64_t, epochs) = 1;
  /// Batches fit reads ahead, on one reading thread of its own, while the
  /// step runs (DataLoader's num_workers=1 with this prefetch_factor); 0:
  /// each batch is read when its step starts. Read ahead on a CUDA device,
  /// a batch is copied into pinned host memory, so that staging it is
  /// asynchronous (DataLoader's pin_memory). The batches, their order and a
  /// resumed run's position are the same either way, and so are the bytes
  /// counted: batches wait in host memory, as the data set does. The data
  /// set is read by one thread at a time, but not by the caller's.
  TORCH_ARG(int64_t, prefetch_factor) = 0;
  /// Learning rate.
  TORCH_ARG(double, lr) = 1e-3;
  /// The optimizer (when optimizer_factory is empty).
  TORCH_ARG(OptimizerKind, optimizer) = OptimizerKind::kAdam;
  /// The kernel of memfit's optimizer (`optimizer`): kAuto runs LibTorch's
  /// fused kernel where it has one (2.4 and later) and the loop elsewhere;
  /// kLoop is bitwise torch::optim's (optim.h).
  TORCH_ARG(optim::Kernel, optimizer_kernel) = optim::Kernel::kAuto;
  /// The user's own optimizer, built over the parameters to train; empty:
  /// `optimizer` with lr, momentum and weight_decay.
  TORCH_ARG(OptimizerFactory, optimizer_factory) = nullptr;
  /// SGD momentum (SGD only).
  TORCH_ARG(double, momentum) = 0.9;
  /// L2 penalty (SGD, Adam) or decoupled decay (AdamW).
  TORCH_ARG(double, weight_decay) = 0.0;
  /// Seeds parameter-independent randomness: the shuffling of the data.
  TORCH_ARG(uint64_t, seed) = 0;
  /// Examples per evaluation forward.
  TORCH_ARG(int64_t, eval_batch_size) = 1000;
  /// Where the model, batches and optimizer state live.
  TORCH_ARG(torch::Device, device) = torch::kCPU;
  /// Compute precision of forward and backward (autocast); fp16 adds a GradScaler.
  TORCH_ARG(Precision, precision) = Precision::kFP32;
  /// Low-precision parameters with fp32 masters (needs precision bf16 or fp16).
  TORCH_ARG(MasterWeightsMode, master_weights) = MasterWeightsMode::kNone;
  /// The GradScaler's options when precision is fp16.
  TORCH_ARG(GradScalerOptions, grad_scaler) = GradScalerOptions();
  /// Clip the gradients' total 2-norm to this (after unscaling); 0: no clipping.
  TORCH_ARG(double, max_grad_norm) = 0.0;
  /// A NaN or infinite loss stops the run or skips the step.
  TORCH_ARG(NonfiniteLoss, nonfinite_loss) = NonfiniteLoss::kError;
  /// Examples per forward/backward (gradient accumulation); 0: the whole batch.
  TORCH_ARG(int64_t, micro_batch_size) = 0;
  /// Release gradients after each step (Python's zero_grad(set_to_none=True));
  /// false zeroes them in place and keeps their memory between steps.
  TORCH_ARG(bool, set_to_none) = true;
  /// Globs of parameter names to freeze before the optimizer is built (see freeze.h).
  TORCH_ARG(std::vector<std::string>, freeze) = {};
  /// Where the optimizer state lives: with the parameters, or on the host
  /// (Offload::kHost: fp32 host masters and state, stepped there, ZeRO-Offload).
  TORCH_ARG(Offload, offload_optimizer) = Offload::kNone;
  /// Where gradients accumulate (with offload_optimizer kHost only):
  /// Offload::kHost moves each parameter's gradient to its host master as
  /// soon as backward has produced it (MasterWeightsOptions::gradients), so
  /// the device holds about one gradient at a time, also across micro-batches.
  /// With data parallelism the gradients are all-reduced from the host
  /// masters (DistributedDataParallel's gradient holders).
  TORCH_ARG(Offload, offload_gradients) = Offload::kNone;
  /// Where the parameters live between uses (with offload_optimizer and
  /// offload_gradients kHost, fp32, one process): Offload::kHost keeps them
  /// in the host masters only and streams each layer's to the device while
  /// it runs (stream.h: ZeRO-Infinity's parameter offload), so the device
  /// holds no parameters, gradients or optimizer state between layers. A
  /// Sequential streams its top-level layers; any other module streams the
  /// layers of its chains (CheckpointedSequential) block by block and holds
  /// its other parameters on the device for each micro-batch. While the
  /// Trainer lives, the module's streamed parameters are one-element
  /// placeholders: load values through Trainer::resume, and build another
  /// Trainer, or plan, over the module once this one has ended.
  TORCH_ARG(Offload, offload_parameters) = Offload::kNone;
  /// How streamed parameters are cut (StreamOptions::tile_bytes tiles large
  /// Linear layers); with offload_parameters kHost.
  TORCH_ARG(StreamOptions, stream) = StreamOptions();
  /// Folder for checkpoints (Trainer::save) during fit; empty: no saving.
  TORCH_ARG(std::string, save_dir) = "";
  /// Save every this many steps (and at the end of fit); 0: only at the end.
  TORCH_ARG(int64_t, save_every) = 0;
  /// Data parallel over this process group (DistributedDataParallel): each of
  /// the group's ranks runs its own Trainer; batch_size is per rank, so a step
  /// takes batch_size × ranks examples, each rank every ranks-th of them
  /// (DistributedSampler's striding, the same permutation on every rank from
  /// the seed). Gradients are averaged, so N ranks with batch B train like one
  /// process with batch N·B. Only rank 0 saves. nullptr: one process.
  TORCH_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;
  /// Data parallel bucket size in MiB (DistributedDataParallelOptions).
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// ZeRO stage: 0 keeps the whole optimizer state on every rank; 1 shards it
  /// over the process group's ranks (ZeroRedundancyOptimizer: each rank holds
  /// the state of about 1/N of the parameters and steps only those). Needs a
  /// process_group. Stages 2 and 3 (sharded gradients and parameters) are not
  /// implemented.
  TORCH_ARG(int64_t, zero_stage) = 0;
  /// How the process group's ranks share the work: data parallel, or a
  /// pipeline of stages (then batch_size is the whole batch, every rank sees
  /// it, and options.pipeline() says how it is cut and split). Pipeline
  /// training runs in fp32 or bf16 (autocast on every stage; fp16's loss
  /// scaler is not supported), with or without optimizer and gradient
  /// offload (per stage), and without ZeRO or micro_batch_size (chunks take
  /// its place). Clipping (max_grad_norm) takes the norm over every stage's
  /// gradients (memfit::clip_grad_norm_ with the group), and
  /// pipeline().checkpoint() recomputes chunks.
  TORCH_ARG(ParallelMode, parallel) = ParallelMode::kData;
  /// The pipeline's chunks, schedule and balance (with ParallelMode::kPipeline).
  TORCH_ARG(PipelineOptions, pipeline) = PipelineOptions();
  /// What a step that runs out of memory does: every step is undone when it
  /// throws; with OnOutOfMemory::kReplan it is re-planned (`replan`) and run
  /// again on the same batch and RNG state, with the same math; with a
  /// process group every rank re-plans and runs the step again together.
  /// Needs memfit's optimizers (OptimizerKind, memfit::optim); not with a
  /// pipeline or zero_stage 1.
  TORCH_ARG(OnOutOfMemory, on_out_of_memory) = OnOutOfMemory::kThrow;
  /// Re-plans one step may make before it gives up (with kReplan).
  TORCH_ARG(int64_t, max_replans) = 10;
  /// How a step is re-planned (with kReplan); empty: more_micro_batches over
  /// the module, without changing batch statistics (a module with BatchNorm
  /// and no chain to recompute is refused).
  TORCH_ARG(OutOfMemoryPolicy, replan) = nullptr;
  /// After this many steps in a row without running out of memory, a
  /// re-planned run tries its first micro-batch size, chain schedules (and
  /// where their checkpoints keep their inputs) and optimizer state placement
  /// again (a limit that lifted gives its speed back; one that did not costs
  /// one failed attempt and re-plans again; state that does not fit back on
  /// the device stays on the host); 0: it keeps the re-planned settings.
  TORCH_ARG(int64_t, restore_after) = 0;
};

/// One recovery from an out-of-memory error: the step, what failed, the
/// settings before and after, and the time the failed attempt cost.
struct Recovery {
  int64_t step = 0;          ///< The step that ran out of memory.
  std::string what;          ///< The error's first line.
  int64_t peak_bytes = 0;    ///< The failed attempt's peak.
  int64_t limit_bytes = 0;   ///< The memory it could use.
  std::string before;        ///< The failed attempt's settings.
  std::string after;         ///< The retry's settings ("" when it gave up).
  double seconds = 0;        ///< Wall time of the failed attempt and the re-plan.
};

/// One optimizer step as measured.
struct StepRecord {
  int64_t step = 0;        ///< 1-based step number.
  int64_t epoch = 0;       ///< 0-based epoch of the step.
  double loss = 0;         ///< Mean loss of the batch (NaN where NonfiniteLoss::kUnchecked left it unread).
  /// The same, as a one-element float64 tensor where it was computed (on the
  /// CPU, host memory not counted by the budget): reading it is the sync
  /// NonfiniteLoss::kUnchecked spares the step.
  torch::Tensor loss_tensor;
  double seconds = 0;      ///< Wall time of the step.
  int64_t peak_bytes = 0;  ///< Peak memory_allocated(device) during the step.
  int64_t current_bytes = 0;  ///< memory_allocated(device) after the step.
  bool skipped = false;    ///< The GradScaler skipped the step (inf or NaN gradients).
  /// Where the fused kernel decided on the device whether to skip (fp16 on
  /// memfit's fused optimizers): one float32 element, nonzero where it
  /// skipped. `skipped` is read from it at the step's end, unless the step
  /// reads nothing (NonfiniteLoss::kUnchecked: then `skipped` is false and
  /// reading this is the sync spared). Undefined elsewhere.
  torch::Tensor found_inf;
  int64_t replans = 0;     ///< Times the step ran out of memory and was re-planned (OnOutOfMemory::kReplan).
};

/// Memory at the end of one phase of a step (a micro-batch's forward or
/// backward, the optimizer step, the release of gradients), by category.
struct PhaseMemory {
  std::string phase;            ///< "forward 1", "backward 1", ..., "optimizer step", "released".
  int64_t peak_bytes = 0;       ///< Peak memory_allocated(device) during the phase.
  int64_t current_bytes = 0;    ///< memory_allocated(device) at its end.
  int64_t parameters = 0;       ///< Parameter and buffer bytes (fp32 masters on the device included).
  int64_t gradients = 0;        ///< Gradient bytes at its end.
  int64_t optimizer_state = 0;  ///< Optimizer state bytes on the device at its end.
};

/// Accuracy and loss on a data set.
struct EvalResult {
  double loss = 0;      ///< Mean cross-entropy per label (per example, or per token).
  double accuracy = 0;  ///< Fraction of correct top-1 predictions, per label.
  int64_t peak_bytes = 0;  ///< Peak memory_allocated(device) during evaluation.
  /// Examples per forward at the end: TrainerOptions::eval_batch_size, or
  /// fewer where a chunk ran out of memory and was halved (OnOutOfMemory::kReplan).
  int64_t batch_size = 0;
};

/// What a run did: every step, the test result, peak memory and speed.
struct TrainReport {
  std::vector<StepRecord> steps;   ///< One record per optimizer step.
  double final_loss = 0;           ///< Loss of the last step.
  double seconds = 0;              ///< Wall time of all steps.
  double samples_per_second = 0;   ///< Training examples per second.
  int64_t peak_bytes = 0;          ///< Peak memory_allocated(device) during fit.
  StepMemory step_memory;          ///< Breakdown of the step with the highest peak.
  std::vector<PhaseMemory> step_timeline;  ///< That step's memory, phase by phase.
  std::string precision = "fp32";  ///< Compute precision of the run.
  /// The optimizer's kernel in the last step (optim::kernel_ran): "fused",
  /// "loop", "libtorch" (a user's torch::optim optimizer), or "none".
  std::string optimizer_kernel = "none";
  int64_t skipped_steps = 0;       ///< Steps the GradScaler skipped.
  double final_scale = 0;          ///< The GradScaler's scale at the end (0 without one).
  bool stopped = false;            ///< fit returned early, at Trainer::request_stop.
  bool evaluated = false;          ///< Whether `test` holds a result.
  EvalResult test;                 ///< Test-set result, when evaluated.
  std::vector<Recovery> recoveries;  ///< Steps that ran out of memory and were re-planned.

  /// The report as JSON: {"steps": [{step, epoch, loss, seconds, peak_bytes,
  /// current_bytes}], "summary": {...}}.
  std::string to_json() const;
};

namespace detail {
class Timeline;  // the step component that records each phase's memory (internal)
class RankVote;  // step_components.h

// The batch type a loss function takes: its second parameter, decayed.
template <class F>
struct LossTraits : LossTraits<decltype(&F::operator())> {};
template <class R, class M, class B>
struct LossTraits<R (*)(M, B)> { using Batch = std::decay_t<B>; };
template <class C, class R, class M, class B>
struct LossTraits<R (C::*)(M, B) const> { using Batch = std::decay_t<B>; };
template <class C, class R, class M, class B>
struct LossTraits<R (C::*)(M, B)> { using Batch = std::decay_t<B>; };

// One step's batch, as the step sees it: its examples and the loss of any
// run of them, staged on the device; `staged` keeps that micro-batch alive
// until its backward has run, as a loop's batch variable would.
struct StepInput {
  int64_t examples = 0;
  int64_t global_examples = 0;  // over the data-parallel ranks; 0: examples × ranks
  std::function<torch::Tensor(int64_t start, int64_t length, std::shared_ptr<void>& staged)> loss;
  const torch::data::Example<>* example = nullptr;  // the batch, when it is one (pipelines)
};

// Runs `fn` under no-grad, in eval mode and the Trainer's autocast; puts
// back the training mode it found.
class EvalScope {
 public:
  EvalScope(torch::nn::Module& module, const torch::Device& device, Precision precision);
  ~EvalScope();
  EvalScope(const EvalScope&) = delete;
  EvalScope& operator=(const EvalScope&) = delete;

 private:
  torch::nn::Module& module_;
  bool was_training_;
  torch::NoGradGuard no_grad_;
  AutocastGuard autocast_;
};

// Calls `read(start, length)` over [0, n) in parts of `part` examples. With
// `halve`, a part that runs out of memory is read again in halves, down to
// one example, and the rest in parts that size; `read` must change nothing
// before it has finished. Returns the last part's size.
template <class Read>
int64_t read_in_parts(int64_t n, int64_t part, bool halve, const torch::Device& device, Read&& read) {
  for (int64_t start = 0; start < n;) {
    const int64_t length = std::min(part, n - start);
    try {
      read(start, length);
      start += length;
    } catch (const c10::OutOfMemoryError&) {
      if (!halve || length == 1) throw;
      memfit::empty_cache(device);
      part = (length + 1) / 2;
    }
  }
  return part;
}
} // namespace detail

/// Trains any LibTorch module with the user's loss: one optimizer step per
/// train_step(batch), or a run of them with fit.
///
/// The module is any `std::shared_ptr<M>` (M derived from torch::nn::Module)
/// or module holder. The loss is a function of the module and a batch that
/// returns the batch's mean loss, a scalar with grad:
/// `torch::Tensor loss(Net& net, const Batch& batch)`. Batch is deduced from
/// the loss's second parameter; torch::data::Example<> is the common case, and
/// any type with a BatchTraits specialization works (batch.h). A
/// torch::nn::Sequential given without a loss is a classifier trained with
/// cross-entropy: class logits [N, C] against labels [N], or per-token logits
/// [N, T, C] against next-token labels [N, T] (a language model), the mean
/// over every label, computed in fp32; that form also allows pipelines,
/// parameter streaming and evaluate(ImageDataset).
///
/// A step cuts the batch into micro-batches of micro_batch_size examples (the
/// last one smaller when it does not divide the batch), stages each on the
/// device (to_device), runs the loss and backward on each, weighting each
/// micro-batch's mean loss by its share of the batch, so the accumulated
/// gradient is the whole batch's mean-loss gradient (to rounding); only one
/// micro-batch's activations are live at a time. BatchNorm normalises each
/// micro-batch with that micro-batch's statistics, so a model with BatchNorm
/// no longer computes the full batch's gradient: the constructor warns once
/// (TORCH_WARN) for such a model. The step then steps the optimizer and
/// releases the gradients (set to none). Every technique the options enable
/// is a component of that step (step.h): precision (autocast around the loss;
/// with fp16 a GradScaler that scales the loss, skips steps with inf or NaN
/// gradients and adapts the scale), master weights and optimizer, gradient
/// and parameter offload, data parallelism and ZeRO, clipping after
/// unscaling, the non-finite loss check, the memory timeline.
///
/// Freezing and offload: parameters matching options.freeze are frozen before
/// the optimizer is built over the others, which never get gradients or
/// optimizer state. With offload_optimizer Offload::kHost the optimizer steps
/// fp32 host masters (MasterWeights in float32 with Offload::kHost): gradients
/// go to the host, the updated parameters come back; the device holds no
/// optimizer state. With master weights the parameters are held in the low
/// dtype and the optimizer steps fp32 masters (on the host for
/// MasterWeightsMode::kHost, where the step then runs). Sync points: one per
/// step for the loss (none with NonfiniteLoss::kUnchecked), one more with
/// fp16 (whether the step was skipped; see the class comment).
/// A NaN or infinite loss without a GradScaler stops the run with an error
/// naming the step, or skips the step (NonfiniteLoss::kSkip, recorded as
/// skipped).
///
/// Example:
/// \code
///   struct NetImpl : torch::nn::Module {
///     NetImpl() : fc(register_module("fc", torch::nn::Linear(784, 10))) {}
///     torch::Tensor forward(const torch::Tensor& x) { return fc(x.flatten(1)); }
///     torch::nn::Linear fc;
///   };
///   TORCH_MODULE(Net);
///   Net net;
///   memfit::Trainer trainer(
///       net, [](NetImpl& n, const torch::data::Example<>& b) {
///         return torch::nn::functional::cross_entropy(n.forward(b.data), b.target);
///       },
///       memfit::TrainerOptions().micro_batch_size(16).lr(0.01));
///   auto record = trainer.train_step(torch::data::Example<>(torch::randn({64, 784}),
///                                                           torch::randint(10, {64})));
/// \endcode
class Trainer {
 public:
  /// Called after each step with its record.
  using StepCallback = std::function<void(const StepRecord&)>;

  /// A classifier trained with cross-entropy (see above); builds the
  /// optimizer over `model`'s parameters and checks the options.
  Trainer(torch::nn::Sequential model, TrainerOptions options);
  /// `module` trained with `loss(*module, batch)`; builds the optimizer over
  /// its parameters and checks the options.
  template <class M, class Loss, std::enable_if_t<std::is_base_of<torch::nn::Module, M>::value, int> = 0>
  Trainer(std::shared_ptr<M> module, Loss loss, TrainerOptions options)
      : Trainer(erase_loss<M, typename detail::LossTraits<Loss>::Batch>(module, std::move(loss)),
                std::move(options)) {}
  /// A module holder's module trained with `loss(*module, batch)`.
  template <class M, class Loss>
  Trainer(const torch::nn::ModuleHolder<M>& module, Loss loss, TrainerOptions options)
      : Trainer(module.ptr(), std::move(loss), std::move(options)) {}
  ~Trainer();
  Trainer(Trainer&&) noexcept;
  Trainer& operator=(Trainer&&) noexcept;

  /// Runs one optimizer step on `batch` with every technique the options
  /// enable (micro-batching, precision and scaler, clipping, offload, data
  /// parallelism) and returns its record. The module stays in the mode it is
  /// in (fit puts it in training mode). `batch` may live anywhere: each
  /// micro-batch is staged on options.device(). With a process group, every
  /// rank calls it with its own share of equal size. Throws c10::Error when
  /// the loss returns something other than a scalar with grad.
  template <class Batch>
  StepRecord train_step(const Batch& batch) {
    return run_step(input_of(batch, loss_for<Batch>()));
  }
  /// Runs `metric(batch)` on `batch` staged on the device, under no-grad,
  /// in eval mode and the run's autocast, and returns what it returns; the
  /// module's training mode is put back after.
  ///
  /// Example:
  /// \code
  ///   auto correct = trainer.eval_step(batch, [&](const torch::data::Example<>& b) {
  ///     return net->forward(b.data).argmax(1).eq(b.target).sum().item<int64_t>();
  ///   });
  /// \endcode
  template <class Batch, class Metric>
  auto eval_step(const Batch& batch, Metric metric) {
    detail::EvalScope scope(*module_, options_.device(), options_.precision());
    const auto held = stream_ ? stream_->hold() : ParameterStream::Hold();  // streamed: the rest of the module
    return metric(BatchTraits<Batch>::to(batch, options_.device()));
  }
  /// Runs `metric` as eval_step does, for a metric that adds up over the
  /// examples (a count of correct predictions, a summed loss: its value on
  /// a batch is the sum, with `+`, of its values on the batch's parts). With
  /// OnOutOfMemory::kReplan a part that runs out of memory is evaluated
  /// again in halves, down to one example, and the rest of the batch in
  /// parts of that size; evaluating changes nothing, so nothing is undone.
  /// Each call starts from the whole batch. With kThrow, or a mean, use
  /// eval_step. Sync points and extra memory: the metric's.
  ///
  /// Example:
  /// \code
  ///   int64_t correct = trainer.eval_sum(batch, [&](const torch::data::Example<>& b) {
  ///     return net->forward(b.data).argmax(1).eq(b.target).sum().item<int64_t>();
  ///   });
  /// \endcode
  template <class Batch, class Metric>
  auto eval_sum(const Batch& batch, Metric metric) {
    using Traits = BatchTraits<Batch>;
    using Result = std::decay_t<decltype(metric(Traits::to(batch, options_.device())))>;
    const int64_t n = Traits::size(batch);
    TORCH_CHECK(n > 0, "Trainer::eval_sum needs a batch with examples, got an empty one");
    std::optional<Result> sum;
    detail::read_in_parts(n, n, options_.on_out_of_memory() == OnOutOfMemory::kReplan, options_.device(),
                          [&](int64_t start, int64_t length) {
                            Result r = eval_step(length == n ? batch : Traits::slice(batch, start, length), metric);
                            sum = sum ? Result(*sum + r) : std::move(r);
                          });
    return std::move(*sum);
  }
  /// Adds `component` to every later step, called after the built-in ones
  /// at each point (step.h).
  void add_component(std::shared_ptr<StepComponent> component);

  /// Steps a run will take over `data`.
  int64_t total_steps(const ImageDataset& data) const { return total_steps_of(data.size()); }
  /// Trains on a map-style torch::data data set (`get_batch` and `size`, with
  /// any `.map(...)` chain; its BatchType is what the loss takes) as fit on
  /// an ImageDataset does: memfit's sampler shuffles per epoch from
  /// options.seed, gives each data-parallel rank its own share and resumes
  /// at the exact position; only each step's examples are read, into host
  /// memory, and each micro-batch is staged on the device.
  ///
  /// Example:
  /// \code
  ///   auto data = torch::data::datasets::MNIST(memfit::fashion_mnist_folder())
  ///                   .map(torch::data::transforms::Stack<>());
  ///   memfit::Trainer trainer(net, loss, memfit::TrainerOptions().batch_size(64).steps(10));
  ///   auto report = trainer.fit(data);
  /// \endcode
  template <class Dataset, class Batch = typename Dataset::BatchType>
  TrainReport fit(Dataset& dataset, const StepCallback& on_step = nullptr) {
    const auto* loss = loss_for<Batch>();
    const auto size = dataset.size();
    TORCH_CHECK(size.has_value(), "Trainer::fit reads a map-style data set with a size; this one has none: "
                "call train_step in a loop over its batches");
    return run_fit(
        static_cast<int64_t>(*size),
        [&dataset](const std::vector<size_t>& indices, bool pin) -> std::shared_ptr<void> {
          auto batch = read_batch(dataset, indices);
          return std::make_shared<Batch>(pin ? pinned(batch) : std::move(batch));
        },
        [this, loss](const std::shared_ptr<void>& batch) { return input_of(*static_cast<const Batch*>(batch.get()), loss); },
        on_step);
  }
  /// Trains on `data` until step total_steps(data); calls `on_step` after
  /// every step. Each step cuts a batch from a per-epoch shuffle of the data
  /// (seeded by options.seed) as a torch::data::Example<>, so the loss must
  /// take one. A run continues from the Trainer's position (after resume(),
  /// or after a step that threw); a finished run starts a new one, keeping the
  /// model and optimizer. Saves to options.save_dir every save_every steps and
  /// at the end.
  TrainReport fit(const ImageDataset& data, const StepCallback& on_step = nullptr);
  /// Writes a checkpoint to `dir`/checkpoint.pt atomically: the model, the
  /// fp32 masters, the optimizer, the GradScaler, the CPU (and CUDA) RNG
  /// states, the sampler's generator and order, the epoch, data position and step.
  /// With a process group only rank 0 writes; with zero_stage 1 or a
  /// pipeline every rank must call it (rank 0 gathers the optimizer's shards
  /// or the stages, and writes them all).
  void save(const std::string& dir);
  /// Restores what save() wrote (`dir` or the file itself), so fit() continues
  /// bit-identically (with a process group: every rank resumes from the same
  /// file, in a job of the same size). The checkpoint is read into host memory and checked
  /// entirely before anything changes; tensors then move to the device one by
  /// one. Throws c10::Error naming the first tensor that does not match.
  ///
  /// Example:
  /// \code
  ///   memfit::Trainer first(memfit::make_mlp(),
  ///                         memfit::TrainerOptions().batch_size(32).steps(3).save_dir(dir));
  ///   first.fit(data);  // saves dir/checkpoint.pt at the end
  ///   memfit::Trainer second(memfit::make_mlp(), memfit::TrainerOptions().batch_size(32).steps(6));
  ///   second.resume(dir);
  ///   auto rest = second.fit(data);  // steps 4, 5 and 6
  /// \endcode
  void resume(const std::string& path);
  /// Asks fit to return after the step in progress, as if the run had ended:
  /// it saves to options.save_dir first when one is set, and its report says
  /// `stopped`. The request is cleared when fit returns. A program calls it
  /// from its step callback or another thread, e.g. when a signal arrived
  /// (`memfit train` does so on SIGINT and SIGTERM).
  ///
  /// Example:
  /// \code
  ///   auto report = trainer.fit(data, [&](const memfit::StepRecord& r) {
  ///     if (r.step == 2) trainer.request_stop();
  ///   });
  ///   assert(report.stopped && trainer.step() == 2);
  /// \endcode
  void request_stop() noexcept { stop_->store(true); }
  /// Steps taken in the current run (0 before the first).
  int64_t step() const { return step_; }
  /// Loss and accuracy of the cross-entropy classifier on `data` under
  /// torch::NoGradGuard, in eval mode (the Sequential form only; for other
  /// modules, eval_step with your metric). With OnOutOfMemory::kReplan a
  /// chunk of eval_batch_size examples that runs out of memory is evaluated
  /// again in halves (EvalResult::batch_size); the sums are the same up to
  /// float32 rounding.
  EvalResult evaluate(const ImageDataset& data);

  /// The module being trained (with a pipeline: this rank's stage).
  const std::shared_ptr<torch::nn::Module>& model() const { return module_; }
  /// The optimizer.
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  /// The options, as checked.
  const TrainerOptions& options() const { return options_; }
  /// The GradScaler (disabled unless precision is fp16).
  GradScaler& grad_scaler() { return *scaler_; }
  /// The master weights, or nullptr without them.
  MasterWeights* master_weights() { return master_.get(); }
  /// The parameter stream, or nullptr unless offload_parameters is kHost.
  ParameterStream* parameter_stream() { return stream_.get(); }
  /// The last step's memory, phase by phase.
  const std::vector<PhaseMemory>& last_timeline() const;
  /// The last step's peak by category, as TrainReport::step_memory counts it.
  StepMemory last_step_memory() const;
  /// Every recovery from an out-of-memory error so far (OnOutOfMemory::kReplan).
  const std::vector<Recovery>& recoveries() const { return recoveries_; }
  /// The step's settings now, in words: the last recovery's (Recovery::after,
  /// with what it moved to the host) until TrainerOptions::restore_after
  /// takes the first back, else the micro-batching ("micro-batches of 32",
  /// "no micro-batching").
  std::string settings_text() const;

 private:
  // The module and its loss, with the batch type erased.
  struct ErasedLoss {
    std::shared_ptr<torch::nn::Module> module;
    torch::nn::Sequential classifier{nullptr};  // the Sequential form (cross-entropy)
    std::any loss;                              // std::function<torch::Tensor(const Batch&)>
  };
  template <class M, class Batch, class Loss>
  static ErasedLoss erase_loss(const std::shared_ptr<M>& module, Loss loss) {
    TORCH_CHECK(module != nullptr, "Trainer needs a module, got nullptr");
    ErasedLoss e;
    e.module = module;
    e.loss = std::function<torch::Tensor(const Batch&)>(  // mutable: a loss may keep state of its own
        [module, loss = std::move(loss)](const Batch& batch) mutable -> torch::Tensor { return loss(*module, batch); });
    return e;
  }
  Trainer(ErasedLoss loss, TrainerOptions options);
  [[noreturn]] void wrong_batch_type(const char* name) const;
  template <class Batch>
  const std::function<torch::Tensor(const Batch&)>* loss_for() const {
    const auto* loss = std::any_cast<std::function<torch::Tensor(const Batch&)>>(&loss_);
    if (loss == nullptr) wrong_batch_type(typeid(Batch).name());
    return loss;
  }
  // The step's view of `batch`, which must outlive it.
  template <class Batch>
  detail::StepInput input_of(const Batch& batch, const std::function<torch::Tensor(const Batch&)>* loss) const {
    detail::StepInput in;
    in.examples = BatchTraits<Batch>::size(batch);
    const torch::Device device = options_.device();
    in.loss = [&batch, loss, device](int64_t start, int64_t length, std::shared_ptr<void>& staged) {
      auto micro = std::make_shared<Batch>(
          BatchTraits<Batch>::to(BatchTraits<Batch>::slice(batch, start, length), device));
      staged = micro;
      return (*loss)(*micro);
    };
    if constexpr (std::is_same<Batch, torch::data::Example<>>::value) in.example = &batch;
    return in;
  }
  // A data set's examples `indices`, read into host memory.
  template <class Dataset>
  static typename Dataset::BatchType read_batch(Dataset& dataset, const std::vector<size_t>& indices) {
    UntrackedGuard host;  // like the data set, the batch is host memory until staged
    try {
      return dataset.get_batch(indices);
    } catch (const c10::Error& e) {
      const std::vector<size_t> head(indices.begin(), indices.begin() + std::min<size_t>(indices.size(), 8));
      TORCH_CHECK(false, "reading the batch of examples ", c10::Join(", ", head), indices.size() > 8 ? ", ..." : "",
                  " from the data set failed (", e.what_without_backtrace(),
                  "); the examples of a batch need one shape to be stacked");
    }
  }
  // Reads the examples at the given indices of the data set (one rank's
  // share of a step) into host memory, pinned when asked; may run on a
  // thread of its own (prefetch_factor).
  using BatchReader = std::function<std::shared_ptr<void>(const std::vector<size_t>& indices, bool pin)>;
  // The step's view of a batch that a BatchReader returned, which must outlive it.
  using BatchView = std::function<detail::StepInput(const std::shared_ptr<void>& batch)>;
  TrainReport run_fit(int64_t examples, const BatchReader& read, const BatchView& view, const StepCallback& on_step);
  // This rank's share of the step that starts at `cursor` in an epoch's
  // `order`; `global` is set to the whole step's examples (all ranks').
  std::vector<size_t> share_of(const torch::Tensor& order, int64_t cursor, int64_t& global) const;
  int64_t total_steps_of(int64_t examples) const;
  StepRecord run_step(const detail::StepInput& in);
  StepRecord step_once(const detail::StepInput& in);
  // Undoes a failed attempt and re-plans it from its peak and what it needed
  // (PeakMeter::needed); false where the Trainer does not recover.
  bool recover(const c10::OutOfMemoryError& e, const detail::StepInput& in, int64_t attempt, int64_t peak,
               int64_t needed, double seconds);
  void check_options() const;
  // The constructor's steps, in its order.
  void split_into_stages();
  void warn_if_micro_batches_change_statistics() const;
  void place_model();
  std::vector<torch::Tensor> make_masters(const std::vector<torch::Tensor>& model_params);
  std::vector<torch::Tensor> trainable_of(const std::vector<torch::Tensor>& params,
                                          const std::vector<torch::Tensor>& model_params) const;
  void make_optimizer_over(const std::vector<torch::Tensor>& trainable);
  void make_data_parallel(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& model_params);
  void remember_first_settings();
  void build_components();
  // Recovery's offload: whether the optimizer state and gradients can move
  // now, and the move.
  bool may_offload_optimizer() const;
  bool may_offload_parameters() const;
  std::string stream_refusal() const;
  void move_state(Offload optimizer, Offload gradients, Offload parameters, const StreamOptions& stream);
  void make_classifier_loss();
  void rebuild_after_move();
  StepMemory breakdown(int64_t peak, int64_t model_grad_bytes) const;
  bool state_on_host() const;
  int64_t device_state_bytes() const;
  torch::optim::Optimizer* state_optimizer() const;
  int64_t world_size() const;
  int64_t rank() const;
  int64_t data_ranks() const;
  void write_part(torch::serialize::OutputArchive& part);
  torch::Tensor stand_in(const torch::Tensor& param) const;

  // The position of the run: steps taken, epoch, the epoch's shuffled order
  // (host) and how much of it is used, and the generator that shuffles.
  int64_t step_ = 0;
  int64_t epoch_ = -1;
  int64_t cursor_ = 0;
  torch::Tensor order_;
  at::Generator generator_;

  std::shared_ptr<torch::nn::Module> module_;
  torch::nn::Sequential classifier_{nullptr};  // the Sequential form, or the pipeline's stage
  std::any loss_;
  TrainerOptions options_;
  std::unique_ptr<MasterWeights> master_;
  std::shared_ptr<ParameterStream> stream_;  // after master_: goes first
  std::unique_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<Pipeline> pipeline_;  // classifier_ is its stage
  std::unique_ptr<GradScaler> scaler_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::string optimizer_type() const;
  void check_saved_options(torch::serialize::InputArchive& a, const std::string& path) const;
  std::unique_ptr<std::atomic<bool>> stop_ = std::make_unique<std::atomic<bool>>(false);  // request_stop
  ZeroRedundancyOptimizer* zero_ = nullptr;  // optimizer_, when it is sharded
  std::vector<std::shared_ptr<StepComponent>> components_;
  std::vector<std::shared_ptr<StepComponent>> added_components_;  // add_component's, kept when components are rebuilt
  std::shared_ptr<detail::Timeline> timeline_;  // also in components_, last
  // Recovery: the events so far, the first settings, steps since the last re-plan, and
  // whether the running step's optimizer has begun changing the parameters.
  std::vector<Recovery> recoveries_;
  int64_t first_micro_batch_ = 0;
  Offload first_offload_ = Offload::kNone;
  Offload first_offload_gradients_ = Offload::kNone;
  Offload first_offload_parameters_ = Offload::kNone;
  StreamOptions first_stream_;
  std::function<void()> restore_first_schedules_;  // the chains' schedules and checkpoint options when built
  bool replanned_ = false;                          // the settings are a recovery's, not the first
  std::string replanned_settings_;                  // a recovery's settings in words
  int64_t clean_steps_ = 0;
  StepPhase phase_ = StepPhase::kForwardBackward;  // where the running step is
  bool committing_ = false;
  bool committed_ = false;  // the running step's optimizer has stepped
  std::shared_ptr<detail::RankVote> vote_;  // with a process group: the ranks agree on each step and re-plan
  FolderLock save_lock_;    // rank 0 holds options.save_dir for the Trainer's lifetime
  std::string continues_;   // the checkpoint this Trainer resumed from or wrote: fit may replace it
  void check_save_dir_is_ours() const;
};

/// Checks that every rank of options.process_group trains the same model with
/// the same options, before any step: a collective call of every rank.
///
/// Each rank's model tensors (names, shapes, dtypes, which are frozen) and
/// the TrainerOptions that must match across ranks (batch size, steps and
/// epochs, optimizer and its settings, seed, precision and master weights,
/// micro-batch, offload, freezing, clipping, zero stage, parallel mode,
/// recovery) are compared with rank 0's. On a mismatch every rank throws the
/// same c10::Error in one line, naming the first setting that differs and
/// both values; otherwise nothing changes. Without a process group it
/// returns at once. The Trainer's constructor calls it before its first
/// collective, so a mismatch never aborts inside Gloo or trains replicas
/// that differ. Sync points: two broadcasts and one all-reduce of a few KiB
/// of host memory (one broadcast more on a mismatch). Extra memory: those KiB.
///
/// Example:
/// \code
///   auto model = memfit::make_mlp();
///   memfit::check_ranks_agree(*model, memfit::TrainerOptions());  // one process: nothing to compare
/// \endcode
void check_ranks_agree(const torch::nn::Module& model, const TrainerOptions& options);

/// Reads only the model's tensors from a checkpoint that Trainer::save wrote
/// (`dir` or the file), into `model` built as the saved one was: for
/// inference, as `memfit generate` does. Throws c10::Error naming the first
/// tensor that does not match.
///
/// Example:
/// \code
///   auto net = memfit::make_mlp();
///   memfit::load_trainer_model(*net, dir);
/// \endcode
void load_trainer_model(torch::nn::Module& model, const std::string& path);

} // namespace memfit
