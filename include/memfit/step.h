#pragma once
/// \file step.h
/// One training step, and the interface through which each technique takes
/// part in it.
///
/// The step (Trainer::train_step) runs, top to bottom:
/// \code
///   begin_step
///   for each micro-batch:  before_forward · loss · after_forward
///                          before_backward · scale_loss · backward · after_backward
///   finish_backward
///   unless skipped:        before_optimizer_step · optimizer_step · after_optimizer_step
///   end_step                (abort_step instead, when anything above throws)
/// \endcode
/// and calls every component at each point, in the order they were added.
/// Micro-batching, precision and loss scaling, master weights and offload,
/// data parallelism, clipping, the non-finite loss check and the memory
/// timeline are such components; a pipeline replaces the micro-batch loop
/// (forward_backward). A user's own component joins through
/// Trainer::add_component.
///
/// A component also keeps its own part of a checkpoint: Trainer::save calls
/// every component's save_state and Trainer::resume every component's
/// load_state, so that neither has a branch per technique.
///
/// Sync points: none of the interface's own; each component states its own.

#include <torch/data/example.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>

namespace memfit {

/// What a step knows while it runs; components read it and may change the
/// fields that say so.
struct StepState {
  int64_t step = 0;           ///< 1-based number of the step being taken.
  int64_t epoch = 0;          ///< 0-based epoch of the step (fit's; 0 in a loop of one's own).
  int64_t examples = 0;       ///< Examples of this rank's batch.
  int64_t global_examples = 0;  ///< Examples of the step over all data-parallel ranks.
  int64_t micro_batches = 1;  ///< Micro-batches the batch is cut into.
  int64_t micro = 0;          ///< 0-based index of the current micro-batch.
  int64_t micro_examples = 0;  ///< Examples in the current micro-batch.
  std::string phase;          ///< Name of the phase just ended ("forward 1", "backward 1", ...).
  torch::Tensor loss;         ///< The current micro-batch's loss, weighted by its share of the step.
  /// Sum of the weighted losses so far, on the loss's device (float64; not
  /// read during the micro-batches, so that they do not synchronise).
  torch::Tensor loss_sum;
  double loss_value = 0;      ///< The step's mean loss, read once after the last micro-batch (the
                              ///< step's sync); components may replace it (data parallelism averages
                              ///< it over ranks).
  /// Whether loss_value is still this rank's own, to be averaged over the
  /// ranks inside the optimizer's step, in the vote before it commits (data
  /// parallel with OnOutOfMemory::kReplan, which then also checks it): a
  /// component that needs the averaged loss before the update waits for it.
  bool loss_pending = false;
  bool read_loss = true;      ///< Whether loss_value is read after the last micro-batch (a component
                              ///< that neither needs nor checks it may clear it: the step reads nothing).
  bool skip = false;          ///< Set to skip the rest of the step (no backward, no optimizer step).
  bool stepped = false;       ///< Whether the optimizer stepped (false when a GradScaler skipped it).
  /// Set by a component whose optimizer decides on the device whether to
  /// skip (a GradScaler on a fused kernel): nonzero where it skipped. The
  /// step reads it at its end, with no other sync between, for the record.
  torch::Tensor found_inf;
  torch::optim::Optimizer* optimizer = nullptr;  ///< The optimizer the step steps.
  const torch::data::Example<>* example = nullptr;  ///< The batch, when it is a torch::data::Example<>.

  /// Whether the current micro-batch is the step's last.
  bool last_micro() const { return micro + 1 == micro_batches; }
};

/// A technique that takes part in every training step at fixed points.
///
/// Every method does nothing by default; a component overrides the points it
/// needs. Components are called in the order they were added, at each point.
///
/// Example:
/// \code
///   struct CountSteps : memfit::StepComponent {
///     int64_t steps = 0;
///     void end_step(memfit::StepState&) override { ++steps; }
///   };
/// \endcode
class StepComponent {
 public:
  virtual ~StepComponent() = default;
  /// Before the first micro-batch.
  virtual void begin_step(StepState&) {}
  /// Takes the whole forward and backward of the step (a pipeline); returns
  /// whether it did. At most one component may.
  virtual bool forward_backward(StepState&) { return false; }
  /// Before a micro-batch's loss is computed (enter scoped state here).
  virtual void before_forward(StepState&) {}
  /// After a micro-batch's loss is computed (state.loss and loss_value hold it).
  virtual void after_forward(StepState&) {}
  /// Before a micro-batch's backward.
  virtual void before_backward(StepState&) {}
  /// The loss backward runs on (a GradScaler scales it).
  virtual torch::Tensor scale_loss(const torch::Tensor& loss) { return loss; }
  /// After a micro-batch's backward.
  virtual void after_backward(StepState&) {}
  /// After the last micro-batch (or the pipeline): gradients are complete.
  virtual void finish_backward(StepState&) {}
  /// Before the optimizer steps (unscaling, clipping, moving gradients).
  virtual void before_optimizer_step(StepState&) {}
  /// Steps the optimizer itself and returns true (a GradScaler), or returns
  /// false to leave it to the next component or to optimizer.step().
  virtual bool optimizer_step(StepState&) { return false; }
  /// After the optimizer step.
  virtual void after_optimizer_step(StepState&) {}
  /// At the end of every step, skipped or not (releasing gradients).
  virtual void end_step(StepState&) {}
  /// Instead of end_step when the step throws (an OutOfMemoryError under a
  /// budget, an error in the loss): leave any scoped state entered (autocast,
  /// no_sync, host allocation), in reverse order of the components.
  virtual void abort_step(StepState&) {}

  /// Writes this component's state into its rank's part of a checkpoint
  /// (Trainer::save), under keys of its own.
  ///
  /// Called on every rank, in the order of the components, so it may call
  /// collectives; the part is the whole checkpoint except with a pipeline,
  /// where each stage has one. The Trainer's own keys ("model", "optimizer",
  /// "format", "step", "rng_*", ...) are taken.
  virtual void save_state(torch::serialize::OutputArchive&) {}
  /// Reads this component's part of the checkpoint at `path` and checks it
  /// against the component, changing nothing; returns what puts it in place,
  /// or an empty function when there is nothing to put.
  ///
  /// Trainer::resume calls every component's load_state first and the
  /// returned functions only when every part has been checked, so a
  /// checkpoint that does not fit changes nothing. A part that does not fit
  /// throws c10::Error naming `path` and what to resume with. A part that is
  /// missing (a checkpoint from before the component saved one) is either
  /// refused or left as the component is, as the component states.
  ///
  /// Example:
  /// \code
  ///   struct CountSteps : memfit::StepComponent {  // its count survives save and resume
  ///     int64_t steps = 0;
  ///     void end_step(memfit::StepState&) override { ++steps; }
  ///     void save_state(torch::serialize::OutputArchive& a) override {
  ///       a.write("count_steps", c10::IValue(steps));
  ///     }
  ///     std::function<void()> load_state(torch::serialize::InputArchive& a, const std::string&) override {
  ///       c10::IValue v;
  ///       if (!a.try_read("count_steps", v)) return {};  // saved without it: keep counting from here
  ///       return [this, n = v.toInt()] { steps = n; };
  ///     }
  ///   };
  /// \endcode
  virtual std::function<void()> load_state(torch::serialize::InputArchive&, const std::string& /*path*/) {
    return {};
  }
};

} // namespace memfit
