#pragma once
/// \file module_plan.h
/// Planning any module: the user's own torch::nn::Module, loss and batch
/// type, with memfit's chains (CheckpointedSequential) anywhere inside it
/// marking where the plan may trade memory for time.
///
/// ModuleStepModel measures the user's real training step (Trainer::train_step
/// over the module and loss, on slices of a sample batch) in each precision
/// and offload setting the plan may use, at micro-batches of
/// PlanOptions::profile_batch and half of it (and of 1, for times), and fits
/// every byte figure as an affine function of the micro-batch. The step is
/// cut into windows at fixed points: each micro-batch's start, its loss,
/// each parameter's gradient and its end, the optimizer step, each chain's
/// forward entry and exit and backward entry and exit (hooks on the chain's
/// output and input), and each of its layers' forward start and backward
/// end, so that a window holds one layer's moments. The rest of the model is measured as a whole
/// inside those windows; each chain's layers are profiled one by one
/// (profile_chain, on the input the chain received), with the bytes each
/// keeps read from the module's own run.
///
/// A step with checkpoint schedules is predicted from the plain step's
/// windows: schedule.h's simulator gives, for each chain, how much the
/// schedule changes its forward peak, the bytes it holds until backward, and
/// its backward peak, and each window's measured peak moves by the changes of
/// the chains that are in that state during it. Times: each micro-batch's
/// measured forward and backward, plus the simulated recomputation of the
/// chains' checkpointed segments, plus the measured optimizer step. Each
/// offload is measured in its own steps, but offloading only adds copies: a
/// setting's time is at least that of the same setting offloading less (or
/// streaming in larger tiles), so timing noise cannot put more copies ahead.
///
/// plan() searches precision × offload (none; the optimizer state; the state
/// and the gradients) × micro-batch (the batch, halved down to 1), and for
/// each solves every chain's optimal schedule for the memory its windows
/// leave; it times the closest plans predicted to fit with real steps under
/// the budget and keeps the fastest by docs/planner.md's "The tie rule"
/// (PlanOptions::verify, PlanOptions::measure_candidates). find_batch() bisects
/// the same predictions for the largest batch one pass fits, and profile()
/// reports the plain step, predicted and measured. In fp32, with the
/// optimizer state and gradients on the host, the chains' parameters may also
/// be streamed (stream.h), their Linear layers whole or in tiles of a
/// quarter, a 16th and a 64th of the largest weight. These settings cost as
/// many measuring steps as the others together, so they are held back until
/// a plan needs them: where nothing resident fits, or where the fastest
/// resident fit already holds the optimizer state and gradients on the host.
///
/// The module is the user's with their loss (plan(module, loss, sample, ...)),
/// or a torch::nn::Sequential classifier as the Trainer trains it without a
/// loss (plan(sequential, sample, ...)): cross-entropy, pipelines allowed.
/// `memfit plan`, `profile`, `find-batch` and `train --budget` plan their
/// built-in and TorchScript models the second way.
///
/// Thread safety: one model or plan at a time per module. Sync points: every
/// measured step (it reads the loss) and each window mark (on CUDA, timing).
/// Extra memory: steps of two micro-batches of at most
/// PlanOptions::profile_batch examples (fewer within
/// PlanOptions::profile_budget), one chain layer at a time while profiling,
/// and (verify) the candidates' own steps under the budget. The module's
/// parameters, buffers, gradients, its chains' schedules and the CPU RNG are
/// put back afterwards.

#include "memfit/batch.h"
#include "memfit/plan.h"
#include "memfit/checkpoint.h"
#include "memfit/schedule.h"
#include "memfit/trainer.h"

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace memfit {

namespace detail {
/// The planner's handle on a user's step (built by make_probe): a Trainer
/// over the user's module and loss, and a train_step on the first examples
/// of the sample batch.
struct StepProbe {
  std::shared_ptr<torch::nn::Module> module;
  std::function<Trainer(const TrainerOptions&)> make_trainer;
  std::function<StepRecord(Trainer&, int64_t examples)> step;
  int64_t examples = 0;  ///< Examples in the sample batch.
};

template <class M, class Loss>
StepProbe make_probe(std::shared_ptr<M> module, Loss loss,
                     const typename LossTraits<Loss>::Batch& sample) {
  using Batch = typename LossTraits<Loss>::Batch;
  StepProbe probe;
  probe.module = module;
  probe.examples = BatchTraits<Batch>::size(sample);
  probe.make_trainer = [module, loss](const TrainerOptions& options) {
    return Trainer(module, loss, options);
  };
  probe.step = [sample](Trainer& trainer, int64_t examples) {
    return trainer.train_step(BatchTraits<Batch>::slice(sample, 0, examples));
  };
  return probe;
}

/// A probe whose steps read the first examples of a map-style torch::data
/// data set (into host memory, as Trainer::fit reads them), so that steps of
/// up to `examples` examples can run; it keeps a pointer to `dataset`.
template <class M, class Loss, class Dataset>
StepProbe make_dataset_probe(std::shared_ptr<M> module, Loss loss, Dataset& dataset, int64_t examples,
                             int64_t largest = -1) {
  using Batch = typename LossTraits<Loss>::Batch;
  static_assert(std::is_same<Batch, typename Dataset::BatchType>::value,
                "find_batch: the loss must take the data set's BatchType");
  StepProbe probe;
  probe.module = module;
  probe.examples = examples;
  probe.make_trainer = [module, loss](const TrainerOptions& options) {
    return Trainer(module, loss, options);
  };
  probe.step = [data = &dataset, largest](Trainer& trainer, int64_t n) {
    std::vector<size_t> indices(static_cast<size_t>(n));
    for (size_t i = 0; i < indices.size(); ++i) indices[i] = largest >= 0 ? static_cast<size_t>(largest) : i;
    const Batch batch = [&] {
      UntrackedGuard host;  // like the data set, the batch is host memory until staged
      return data->get_batch(indices);
    }();
    return trainer.train_step(batch);
  };
  return probe;
}
/// A probe of the Trainer's Sequential form (a classifier trained with
/// cross-entropy, trainer.h): its steps run Trainer(model, options) on the
/// first examples of `sample`.
StepProbe make_probe(torch::nn::Sequential model, const torch::data::Example<>& sample);
/// `options` with PlanOptions::profile_budget set to `budget` where it is 0
/// (no limit): planning for a budget keeps its own measuring within it. The
/// one-call plan() and find_batch() and `memfit`'s planning commands use it.
inline PlanOptions measuring_within(PlanOptions options, int64_t budget) {
  if (options.profile_budget() == 0) options.profile_budget(budget);
  return options;
}
} // namespace detail

struct ModulePlan;
struct ModuleBatchSearch;
struct ModuleProfile;

/// The cost model of a user's training step (see the file comment).
class ModuleStepModel {
 public:
  /// Measures the step `probe` runs, for `options`' precisions and offloads,
  /// with and without selective recomputation where the module has
  /// SelectivelyRecomputed parts (PlanOptions::selective_recompute);
  /// `base` describes the step (optimizer, learning rate, device, clipping).
  ModuleStepModel(detail::StepProbe probe, PlanOptions options = PlanOptions(),
                  TrainerOptions base = TrainerOptions());
  ~ModuleStepModel();
  ModuleStepModel(ModuleStepModel&&) noexcept;
  ModuleStepModel& operator=(ModuleStepModel&&) noexcept;

  /// Predicts a step over `batch` examples with `settings` (its micro-batch,
  /// precision, offloads and selective recomputation) and one schedule per chain (in chains()' order;
  /// an empty schedule runs the chain plainly).
  StepPrediction predict(int64_t batch, const StepSettings& settings,
                         const std::vector<Schedule>& schedules) const;
  /// The chains found in the module.
  const std::vector<FoundChain>& chains() const;
  /// Chain `index`'s costs at `micro_batch` examples in `precision`, with or
  /// without selective recomputation.
  ChainCosts costs(size_t index, Precision precision, int64_t micro_batch, bool selective_recompute = false) const;
  /// The settings measured so far: the precisions × selective
  /// recomputation × offloads the plan may use. Streamed parameters (whole
  /// and in tiles) are held back until plan() needs them (see the file
  /// comment), find_batch() runs, or measure_held_back() is called.
  std::vector<StepSettings> measured_settings() const;
  /// Measures the settings held back (streamed parameters); returns whether
  /// there were any. Sync points and extra memory: as the constructor's.
  bool measure_held_back();
  /// Examples in the sample batch: the logical batch plan() plans for.
  int64_t sample_examples() const;
  /// The options, as checked.
  const PlanOptions& options() const;
  /// The base TrainerOptions the step was measured with.
  const TrainerOptions& base() const;

  struct Impl;  ///< The measurements (src/plan_model.h).

 private:
  friend ModulePlan plan(const ModuleStepModel& model, int64_t budget, int64_t batch);
  friend ModuleProfile profile(const ModuleStepModel& model);
  friend OutOfMemoryPolicy replan_from_model(std::shared_ptr<const ModuleStepModel> model, const ModulePlan& plan,
                                             OutOfMemoryPolicy fallback);
  friend ModuleBatchSearch find_batch(const ModuleStepModel& model, int64_t budget,
                                      const FindBatchOptions& options);
  std::unique_ptr<Impl> impl_;
};

/// A plan for a user's module: the knobs and each chain's schedule, what
/// they are predicted to cost and measured at, and why.
struct ModulePlan {
  bool fits = false;                 ///< Whether a combination fits the budget.
  int64_t budget = 0;                ///< The budget planned for.
  int64_t batch = 0;                 ///< The logical batch.
  StepSettings settings;             ///< The chosen knobs.
  std::vector<std::string> chains;   ///< The chains' names, in the module's order.
  std::vector<Schedule> schedules;   ///< One per chain (empty: plain).
  StepPrediction predicted;          ///< Its predicted peak and time.
  double plain_seconds = 0;          ///< The plain step's predicted time.
  int64_t plain_peak_bytes = 0;      ///< The plain step's predicted peak.
  int64_t candidates = 0;            ///< Combinations considered.
  std::vector<TimedCandidate> timed; ///< Those timed with real steps, in the order timed.
  double measured_seconds = 0;       ///< The chosen plan's measured time (0: not timed).
  /// The plan's time per logical batch as far as the planner can tell it:
  /// its timed steps' (measured_seconds) where it timed them, else
  /// predicted.seconds where its micro-batches are at most 8 times the
  /// largest the model measured; 0 where neither (`why` says so).
  double step_seconds = 0;
  /// The chosen plan's real steps' peak under the budget on the sample
  /// (PlanOptions::verify; 0: not run).
  int64_t measured_peak_bytes = 0;
  /// The tie band that settled the measured choice (docs/planner.md, "The
  /// tie rule"): 0.03, or the timing's own noise where its passes did not
  /// settle; 0 when nothing was timed (a busy machine's choice, which times
  /// did not decide, records it too).
  double measured_tie = 0;
  std::vector<std::string> why;      ///< One line per choice.
  /// The module it was made for (model_signature); plan_mismatch refuses the
  /// plan for another. Empty in plans saved before it was recorded.
  std::string model;
  /// The optimizer its steps were measured with (optimizer_signature);
  /// plan_mismatch refuses the plan for another. Empty in plans saved before
  /// it was recorded.
  std::string optimizer;

  /// Sets every chain's schedule in `module` (found by name) and its
  /// selective recomputation (set_selective_recompute), and returns `base`
  /// with the plan's micro-batch, precision and offloads.
  TrainerOptions apply(torch::nn::Module& module, TrainerOptions base = TrainerOptions()) const;
  /// {"fits", "budget_bytes", "predicted_peak_bytes", "predicted_seconds",
  /// "predicted_phase", "predicted_memory", "plain_peak_bytes",
  /// "plain_seconds", "candidates", "batch", "micro_batch",
  /// "accumulation_steps", "precision", "checkpoint" (every chain's schedule,
  /// "name: schedule; ...", or "none" where no chain recomputes), "chains"
  /// ([{"name", "checkpoint"}]), "selective_recompute", "offload",
  /// "tile_bytes", "measured_seconds", "step_seconds", "measured_peak_bytes",
  /// "measured_tie", "timed" (each candidate's "micro_batch", "precision",
  /// "offload", "checkpoint", "predicted_seconds", "measured_seconds",
  /// "measured_peak_bytes"), "why"}.
  std::string to_json() const;
  /// The plan and its reasons as text.
  std::string explain() const;
};

/// A short text naming a module's shape: its tensors, their values and a
/// CRC-32 of their shapes and dtypes in order (names left out, so that the
/// module wrapped in another has the same signature).
///
/// Example:
/// \code
///   auto a = memfit::make_mlp(memfit::ModelOptions().width(16).depth(1));
///   auto b = memfit::make_mlp(memfit::ModelOptions().width(24).depth(1));
///   assert(memfit::model_signature(*a) != memfit::model_signature(*b));
/// \endcode
std::string model_signature(const torch::nn::Module& module);

/// The optimizer that `options` build, in the words a plan records: "Adam",
/// "AdamW", "SGD" or "SGD with momentum", or "optimizer_factory's" for an
/// optimizer of the user's own (which a plan cannot tell from another).
///
/// Its state is in every step's bytes (Adam keeps two moments per
/// parameter, SGD without momentum none), so a plan measured with one
/// optimizer does not hold for another.
///
/// Example:
/// \code
///   assert(memfit::optimizer_signature(memfit::TrainerOptions()) == "Adam");
///   assert(memfit::optimizer_signature(memfit::TrainerOptions().optimizer(memfit::OptimizerKind::kSGD).momentum(0)) == "SGD");
/// \endcode
std::string optimizer_signature(const TrainerOptions& options);

/// Makes `plan` rank `root`'s on every rank of `group`, field for field (as
/// save_plan writes it). Every rank calls it, after planning the same module
/// or with a default ModulePlan. Sync points: one broadcast of the plan's
/// JSON over `group`; extra memory: that text.
///
/// Example:
/// \code
///   memfit::WorldInfo solo;  // one process: a group of one
///   solo.master_port = 0;
///   memfit::ProcessGroup group(solo);
///   memfit::ModulePlan p;
///   p.chains = {"blocks"};
///   p.schedules = {memfit::schedule_uniform(4, 2)};
///   memfit::broadcast_plan(p, group);  // on every rank: rank 0's plan
///   assert(p.schedules[0].to_string() == "[0,2)* [2,4)");
/// \endcode
void broadcast_plan(ModulePlan& plan, ProcessGroup& group, int64_t root = 0);

/// Writes `plan` to `path` as JSON that load_plan gives back field for
/// field, atomically (write_file_atomically: what is not a regular file is
/// never replaced).
///
/// A run saved under a plan resumes under the same plan: planning again may
/// choose other micro-batches, offload or precision (candidates within the
/// timing's noise of each other), which the checkpoint refuses
/// (Trainer::resume checks precision and the optimizer's master weights) or
/// which change the math mid-run (micro-batches of a model with batch
/// statistics). `memfit train --save DIR` under a budget writes DIR/plan.json,
/// and `--resume DIR` reads it back. No sync points; extra memory: the
/// file's text in host memory.
///
/// Example:
/// \code
///   memfit::ModulePlan p;
///   p.fits = true;
///   p.budget = 1 << 20;
///   p.batch = 64;
///   p.settings.micro_batch(16);
///   p.chains = {"blocks"};
///   p.schedules = {memfit::schedule_uniform(4, 2)};
///   memfit::save_plan(p, "/tmp/memfit_example_plan.json");
///   const auto q = memfit::load_plan("/tmp/memfit_example_plan.json");
///   assert(q.settings.micro_batch() == 16 && q.schedules[0].to_string() == "[0,2)* [2,4)");
/// \endcode
void save_plan(const ModulePlan& plan, const std::string& path);

/// Reads the plan that save_plan wrote to `path`.
///
/// Throws c10::Error in one line naming the path when the file cannot be
/// read, is not JSON, is not a memfit plan, or lacks a field. The plan is
/// the saved one; whether it suits a run is plan_mismatch's answer.
ModulePlan load_plan(const std::string& path);

/// Why `plan` is not one that plan(module, a sample of `batch` examples,
/// `budget`, `options`) may give ("" when it may): another budget or batch,
/// a precision options.precisions() leaves out, micro-batches of a module
/// with batch statistics under BatchStatistics::kKeep, micro-batches where
/// options forbid them, offload where options.offload() is false, selective
/// recomputation that options.selective_recompute() rules out, a chain
/// the module lacks, or another model or optimizer than the plan was measured
/// with (`base` is the TrainerOptions the run trains with, as plan's).
/// It neither measures nor changes anything.
///
/// Example:
/// \code
///   torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4));
///   memfit::ModulePlan p;
///   p.budget = 1 << 20;
///   p.batch = 64;
///   p.settings.micro_batch(16);
///   assert(!memfit::plan_mismatch(p, *net, 64, 1 << 20, memfit::PlanOptions()).empty());  // BatchNorm: kept
///   assert(memfit::plan_mismatch(p, *net, 64, 1 << 20,
///                                memfit::PlanOptions().batch_statistics(memfit::BatchStatistics::kPerMicroBatch))
///              .empty());
/// \endcode
std::string plan_mismatch(const ModulePlan& plan, const torch::nn::Module& module, int64_t batch, int64_t budget,
                          const PlanOptions& options, const TrainerOptions& base = TrainerOptions());

/// The fastest plan for a step of `model`'s sample batch that fits
/// options.margin() × `budget` (see the file comment). The budget counts
/// every byte allocated on the device, as set_memory_budget and a device's
/// memory do: tensors held outside the module when the model was measured
/// (another model, data already on the device) are in every predicted peak.
/// Where no measured
/// setting fits, or the fastest that fits holds the optimizer state and
/// gradients on the host, it first measures those held back (streamed
/// parameters).
///
/// With PlanOptions::verify, the best candidates are run for real (three
/// steps on the sample, under `budget`, the module put back afterwards)
/// before one is chosen. A candidate whose steps overrun the budget is
/// dropped, and the predictions after it are scaled by how far it was off
/// (at most four are run). A micro-batched step of more than 64 examples
/// runs whole micro-batches, at least two and about 64 examples (it peaks
/// as the whole step does), its time scaled to the batch by the prediction,
/// so planning a large batch costs about what planning 64 examples does.
/// Bytes within a window of the step are a maximum over moments, convex in
/// the micro-batch: the linear fit from small micro-batches can fall short at
/// large ones, and the run catches that. On CUDA the budget caps the caching
/// allocator's reserved bytes, which fragmentation can hold above the
/// allocated ones the planner predicts: where timed candidates ran out of
/// memory so, the grid is searched again within the share of the limit they
/// had allocated (allocated ÷ reserved), and the new candidates are timed
/// against the first choice.
///
/// Throws c10::Error when nothing fits: the message names what was tried and
/// the closest predicted peak, and, for a module with no chain, that holding
/// its repeated blocks in a CheckpointedSequential lets the plan checkpoint them.
ModulePlan plan(const ModuleStepModel& model, int64_t budget);

/// plan(model, budget) for a logical batch of the sample's first `batch`
/// examples (4 to ModuleStepModel::sample_examples()): one model measured on
/// a large sample plans any smaller batch, as find_batch() searches them,
/// without measuring the step again. Its timed steps run those examples.
///
/// Example:
/// \code
///   auto net = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
///                                    torch::nn::Linear(64, 4));
///   torch::data::Example<> sample(torch::randn({256, 32}), torch::zeros({256}, torch::kLong));
///   memfit::ModuleStepModel model(memfit::detail::make_probe(net, sample), memfit::PlanOptions(),
///                                 memfit::TrainerOptions());
///   auto p = memfit::plan(model, 1 << 20, 64);
///   assert(p.batch == 64 && p.fits);
/// \endcode
ModulePlan plan(const ModuleStepModel& model, int64_t budget, int64_t batch);

/// Measures `module`'s step with `loss` on `sample` (the batch the plan is
/// for) and plans it under `budget` bytes; `base` describes the step as the
/// Trainer will run it. Leaves the module as it was (apply the plan to it).
/// Unless PlanOptions::profile_budget is set, the measuring steps keep
/// within `budget` too (their micro-batches are halved until they fit).
///
/// Example:
/// \code
///   auto net = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
///                                    torch::nn::Linear(64, 4));
///   auto loss = [](torch::nn::SequentialImpl& m, const torch::data::Example<>& b) {
///     return torch::nn::functional::cross_entropy(m.forward(b.data), b.target);
///   };
///   torch::data::Example<> sample(torch::randn({64, 32}), torch::zeros({64}, torch::kLong));
///   auto p = memfit::plan(net.ptr(), loss, sample, 1 << 20);
///   memfit::Trainer trainer(net, loss, p.apply(*net));
///   trainer.train_step(sample);
/// \endcode
template <class M, class Loss>
ModulePlan plan(std::shared_ptr<M> module, Loss loss, const typename detail::LossTraits<Loss>::Batch& sample,
                int64_t budget, PlanOptions options = PlanOptions(), TrainerOptions base = TrainerOptions()) {
  ModuleStepModel model(detail::make_probe(std::move(module), std::move(loss), sample),
                        detail::measuring_within(std::move(options), budget), std::move(base));
  return plan(model, budget);
}

/// Plans `model` as Trainer(model, options) trains it, a classifier with
/// cross-entropy (trainer.h), for a step of `sample`; otherwise as
/// plan(module, loss, sample, ...) above. Leaves the model as it was.
///
/// Example:
/// \code
///   auto chain = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
///                                      torch::nn::Linear(64, 4));
///   auto net = torch::nn::Sequential(memfit::CheckpointedSequential(chain));
///   torch::data::Example<> sample(torch::randn({64, 32}), torch::zeros({64}, torch::kLong));
///   auto p = memfit::plan(net, sample, 1 << 20);
///   memfit::Trainer trainer(net, p.apply(*net, memfit::TrainerOptions().batch_size(64)));
///   trainer.train_step(sample);
/// \endcode
ModulePlan plan(torch::nn::Sequential model, const torch::data::Example<>& sample, int64_t budget,
                PlanOptions options = PlanOptions(), TrainerOptions base = TrainerOptions());

/// Re-plans a step that ran out of memory (TrainerOptions::replan) from the
/// step model that planned the run: settings chosen by prediction under the
/// memory the step found, in one attempt where the prediction holds, rather
/// than by the default policy's fixed order (more_micro_batches).
///
/// The failed step's own settings (the event's micro-batch, offloads and
/// tiles, `plan`'s precision, the chains' schedules and selective
/// recomputation as the module has them now) are predicted first. The new
/// settings must be predicted within PlanOptions::margin of the lesser of
/// the limit and that prediction: where the step ran out of memory although
/// the model said it fits (a longer batch, fragmentation), each attempt then
/// asks for less than the one before. Among the grid's settings that keep
/// the math (`plan`'s precision, the same selective recomputation,
/// micro-batches only where PlanOptions::batch_statistics lets the module
/// have them) and that the Trainer can take (nothing moves back to the
/// device; offload and streaming where the event's may_offload_optimizer
/// and may_offload_parameters say so), the fastest predicted wins. Nothing is
/// timed, so predictions within 25% of the fastest (the time model's error)
/// tie, and the tie goes to the one that does least: no recomputation, then
/// less offload, then fewer micro-batches (docs/planner.md, "The tie rule").
/// Each chain's schedule is solved for the memory left, as plan() solves it.
/// Where the module may be split, an answer of the whole batch keeps
/// micro-batches of the event's examples: after an epoch's short last batch,
/// the next full batch runs in micro-batches no larger than the step that
/// fitted. Nothing is measured: streamed settings that plan() held back
/// (ModuleStepModel::measure_held_back) are not among them. Where none fits, `fallback`
/// answers (empty: more_micro_batches over the module, with micro-batches
/// where PlanOptions::batch_statistics allows them), as it does for an
/// event whose settings the model did not measure.
///
/// Every rank must get the same answer, so with a process group use it only
/// where the ranks' limits agree; `memfit train` installs it in one process.
/// Sync points: none. Extra memory: none on the device; the model and `plan`
/// are kept, and the policy holds the module through the model.
///
/// Example:
/// \code
///   auto chain = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
///                                      torch::nn::Linear(64, 4));
///   auto net = torch::nn::Sequential(memfit::CheckpointedSequential(chain));
///   torch::data::Example<> sample(torch::randn({64, 32}), torch::zeros({64}, torch::kLong));
///   auto model = std::make_shared<memfit::ModuleStepModel>(memfit::detail::make_probe(net, sample));
///   auto p = memfit::plan(*model, 1 << 20);
///   memfit::Trainer trainer(net, p.apply(*net, memfit::TrainerOptions()
///                                                  .on_out_of_memory(memfit::OnOutOfMemory::kReplan)
///                                                  .replan(memfit::replan_from_model(model, p))));
///   trainer.train_step(sample);
/// \endcode
OutOfMemoryPolicy replan_from_model(std::shared_ptr<const ModuleStepModel> model, const ModulePlan& plan,
                                    OutOfMemoryPolicy fallback = nullptr);

/// What profile() measured on a user's module: its plain training step as
/// the Trainer runs it, and each chain's layers.
struct ModuleProfile {
  int64_t batch = 0;                 ///< Examples in the step: the sample's.
  Precision precision = Precision::kFP32;  ///< The precision profiled (PlanOptions::precisions' first).
  std::vector<std::string> chains;   ///< The chains' names, in the module's order.
  /// Each chain's layers at `batch` examples: bytes kept and times, scaled
  /// linearly from PlanOptions::profile_batch and half of it.
  std::vector<ChainProfile> layers;
  StepPrediction predicted;          ///< The plain step as ModuleStepModel predicts it.
  StepMemory step;                   ///< The real plain step's peak by category (the third of three).
  std::vector<PhaseMemory> timeline; ///< That step, phase by phase.
  double step_seconds = 0;           ///< The faster of the second and third steps.

  /// Each chain's layer table, then the predicted and the measured step.
  std::string table() const;
  /// {"batch", "precision", "chains": [{"name", "layers"}], "predicted_step_peak_bytes",
  /// "predicted_step_seconds", "predicted_memory", "measured_step_peak_bytes",
  /// "measured_memory", "measured_step_seconds"}.
  std::string to_json() const;
};

/// Profiles the plain step of `model`'s sample: each chain's layers as the
/// model measured them, scaled to the sample's batch, the model's
/// prediction, and three real steps of the Trainer (the module put back
/// afterwards). Sync points: those steps.
ModuleProfile profile(const ModuleStepModel& model);

/// Profiles `module`'s plain training step with `loss` on `sample`: what
/// each chain's layers keep and cost, and the step's peak by category,
/// predicted and measured. Leaves the module as it was. `options` says
/// which precision (its first) and what else to measure; by default only
/// the plain step.
///
/// Example:
/// \code
///   auto net = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
///                                    torch::nn::Linear(64, 4));
///   auto loss = [](torch::nn::SequentialImpl& m, const torch::data::Example<>& b) {
///     return torch::nn::functional::cross_entropy(m.forward(b.data), b.target);
///   };
///   torch::data::Example<> sample(torch::randn({64, 32}), torch::zeros({64}, torch::kLong));
///   auto p = memfit::profile(net.ptr(), loss, sample);
///   assert(p.batch == 64 && p.step.peak > 0 && p.predicted.peak_bytes > 0);
/// \endcode
template <class M, class Loss>
ModuleProfile profile(std::shared_ptr<M> module, Loss loss, const typename detail::LossTraits<Loss>::Batch& sample,
                      PlanOptions options = PlanOptions().offload(false), TrainerOptions base = TrainerOptions()) {
  ModuleStepModel model(detail::make_probe(std::move(module), std::move(loss), sample), std::move(options),
                        std::move(base));
  return profile(model);
}

/// Profiles `model`'s plain step as Trainer(model, options) trains it, a
/// classifier with cross-entropy, on `sample`; otherwise as
/// profile(module, loss, sample, ...) above.
///
/// Example:
/// \code
///   auto net = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
///                                    torch::nn::Linear(64, 4));
///   torch::data::Example<> sample(torch::randn({16, 32}), torch::zeros({16}, torch::kLong));
///   auto p = memfit::profile(net, sample);
///   assert(p.batch == 16 && p.step.peak > 0);
/// \endcode
ModuleProfile profile(torch::nn::Sequential model, const torch::data::Example<>& sample,
                      PlanOptions options = PlanOptions().offload(false), TrainerOptions base = TrainerOptions());

/// A batch size found for a user's module, how it runs, and how it was checked.
struct ModuleBatchFound {
  int64_t batch = 0;                  ///< Examples per pass (0: not even 1 fits).
  StepSettings settings;              ///< The knobs it runs with (no micro-batching).
  std::vector<Schedule> schedules;    ///< One per chain (empty: plain).
  int64_t predicted_peak_bytes = 0;   ///< The model's prediction.
  int64_t measured_peak_bytes = 0;    ///< The verification's peak (0 unverified).
  bool verified = false;              ///< Two real steps ran under the budget.
  int64_t attempts = 0;               ///< Verification runs (out-of-memory ones included).
};

/// The largest batches of a user's module that fit a budget in one pass
/// (no micro-batching): plainly, and with checkpointing, offload and the
/// allowed precisions.
struct ModuleBatchSearch {
  std::vector<std::string> chains;  ///< The chains' names, in the module's order.
  ModuleBatchFound plain;           ///< The first allowed precision, nothing else.
  ModuleBatchFound techniques;      ///< With the chains' schedules, offload and precision.

  /// Sets every chain's schedule in `module` to `found`'s and returns `base`
  /// with its batch size, precision and offloads.
  TrainerOptions apply(const ModuleBatchFound& found, torch::nn::Module& module,
                       TrainerOptions base = TrainerOptions()) const;
  /// {"budget_bytes", "chains", "plain", "with_techniques"}: each found batch
  /// with its precision, offload, selective recomputation, checkpoint (all
  /// chains, and per chain), predicted and measured peaks.
  std::string to_json() const;
  /// One line for each search.
  std::string explain() const;
  int64_t budget = 0;  ///< The budget searched for.
};

/// Finds the largest batches whose predicted step fits options.margin() ×
/// `budget` in one pass, plainly and with the chains' schedules, offload and
/// precision, by bisection on `model`'s predictions up to
/// FindBatchOptions::max_batch (and, to verify, the examples `model`'s probe
/// can read); then (FindBatchOptions::verify) runs three real steps of each
/// answer under the budget, shrinking the batch by 10% after an
/// out-of-memory error, which is caught. The module is left as it was.
ModuleBatchSearch find_batch(const ModuleStepModel& model, int64_t budget,
                             const FindBatchOptions& options = FindBatchOptions());

/// Finds the largest batch of `dataset` (a map-style torch::data data set
/// whose BatchType the loss takes) that `module` trains on in one pass under
/// `budget` bytes, plainly and with memfit's techniques: the step is measured
/// on the data set's first examples, and each answer is run on its first
/// examples. Leaves the module as it was (apply a result to it). Sync
/// points and extra memory: as plan()'s, and the verification's steps under
/// the budget.
///
/// Example:
/// \code
///   struct Points : torch::data::datasets::Dataset<Points> {  // the user's data set
///     torch::data::Example<> get(size_t i) override {
///       return {torch::randn({32}), torch::tensor(static_cast<int64_t>(i % 4))};
///     }
///     torch::optional<size_t> size() const override { return 1000; }
///   };
///   auto data = Points().map(torch::data::transforms::Stack<>());
///   auto net = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
///                                    torch::nn::Linear(64, 4));
///   auto loss = [](torch::nn::SequentialImpl& m, const torch::data::Example<>& b) {
///     return torch::nn::functional::cross_entropy(m.forward(b.data), b.target);
///   };
///   auto found = memfit::find_batch(net.ptr(), loss, data, 1 << 20);
///   assert(found.plain.verified && found.plain.measured_peak_bytes <= 1 << 20);
///   memfit::Trainer trainer(net, loss, found.apply(found.plain, *net));
/// \endcode
template <class M, class Loss, class Dataset>
ModuleBatchSearch find_batch(std::shared_ptr<M> module, Loss loss, Dataset& dataset, int64_t budget,
                             FindBatchOptions options = FindBatchOptions(),
                             PlanOptions plan_options = PlanOptions(), TrainerOptions base = TrainerOptions()) {
  const auto size = dataset.size();
  TORCH_CHECK(size.has_value() && *size >= 4, "find_batch reads a map-style data set of at least 4 examples "
              "(it measures steps of two micro-batches at two sizes), got ",
              size.has_value() ? std::to_string(*size) + " examples" : std::string("one without a size"));
  TORCH_CHECK(options.max_batch() > 0, "FindBatchOptions::max_batch must be positive, got ", options.max_batch());
  const auto examples = std::min<int64_t>(static_cast<int64_t>(*size), std::max<int64_t>(options.max_batch(), 4));
  TORCH_CHECK(options.largest_example() < static_cast<int64_t>(*size), "FindBatchOptions::largest_example ",
              options.largest_example(), " is not an index of the data set's ", *size, " examples");
  if (options.largest_example() < 0) {
    options.max_batch(std::min<int64_t>(options.max_batch(), static_cast<int64_t>(*size)));  // verified or not
  }
  ModuleStepModel model(detail::make_dataset_probe(std::move(module), std::move(loss), dataset, examples,
                                                   options.largest_example()),
                        detail::measuring_within(std::move(plan_options), budget), std::move(base));
  return find_batch(model, budget, options);
}

/// The index of the largest example of `dataset` (a map-style torch::data
/// data set) by `size_of`, which takes a batch of that one example (the
/// data set's BatchType) and returns its size (a sequence's length, an
/// image's pixels); the first of equal ones. Reads every example once.
/// Plan for it: plan() with a sample batch of it repeated, or find_batch
/// with FindBatchOptions::largest_example.
///
/// Example:
/// \code
///   struct Lines : torch::data::datasets::Dataset<Lines> {  // lengths 3, 5, 4, 2
///     torch::data::Example<> get(size_t i) override {
///       const int64_t n = std::vector<int64_t>{3, 5, 4, 2}[i];
///       return {torch::zeros({n}), torch::zeros({n})};
///     }
///     torch::optional<size_t> size() const override { return 4; }
///   };
///   auto data = Lines();
///   auto longest = memfit::largest_example(data, [](const std::vector<torch::data::Example<>>& b) {
///     return b.front().data.size(0);
///   });
///   assert(longest == 1);
/// \endcode
template <class Dataset, class SizeOf>
size_t largest_example(Dataset& dataset, SizeOf size_of) {
  const auto size = dataset.size();
  TORCH_CHECK(size.has_value() && *size > 0, "largest_example reads a map-style data set with a size and "
              "examples, got ", size.has_value() ? "an empty one" : "one without a size");
  UntrackedGuard host;  // the examples are host memory, read one at a time
  size_t best = 0;
  int64_t best_size = -1;
  for (size_t i = 0; i < *size; ++i) {
    const int64_t n = static_cast<int64_t>(size_of(dataset.get_batch(std::vector<size_t>{i})));
    if (n > best_size) {
      best = i;
      best_size = n;
    }
  }
  return best;
}

} // namespace memfit
