#pragma once
// The Trainer's built-in step components (step.h): one per technique. Not
// installed; the Trainer adds those its options enable, in the order below.

#include "memfit/distributed.h"
#include "memfit/memory.h"
#include "memfit/pipeline.h"
#include "memfit/precision.h"
#include "memfit/step.h"
#include "memfit/stream.h"
#include "memfit/trainer.h"
#include "memfit/compat.h"

#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace memfit {
namespace detail {

// Cross-entropy of class logits [N, C] against [N] labels, or of per-token
// logits [N, T, C] against [N, T] labels (a language model), in fp32: the
// mean, or with `sum` the sum, over every label.
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target, bool sum = false);

// Streamed parameters (offload_parameters host): the parameters outside
// the module's chains on the device for each micro-batch's forward and
// backward; the chains' layers stream themselves. Extra memory: those
// parameters while held.
class StreamStep final : public StepComponent {
 public:
  explicit StreamStep(ParameterStream& stream) : stream_(stream) {}
  void before_forward(StepState&) override { held_ = stream_.hold(); }
  void after_backward(StepState&) override { held_ = ParameterStream::Hold(); }
  void abort_step(StepState&) override { held_ = ParameterStream::Hold(); }

 private:
  ParameterStream& stream_;
  ParameterStream::Hold held_;
};

// Data parallelism: buffers from rank 0 before the step, gradients
// all-reduced during the last micro-batch's backward only, the loss
// averaged over the ranks. Sync points: DDP's.
class DataParallelStep final : public StepComponent {
 public:
  DataParallelStep(DistributedDataParallel& ddp, ProcessGroup& group) : ddp_(ddp), group_(group) {}
  void begin_step(StepState&) override;
  void before_backward(StepState& s) override;
  void after_backward(StepState&) override;
  void finish_backward(StepState& s) override;
  void abort_step(StepState&) override { no_sync_.reset(); }

 private:
  DistributedDataParallel& ddp_;
  ProcessGroup& group_;
  std::optional<DistributedDataParallel::NoSync> no_sync_;
};

// A pipeline's stage: the whole batch in chunks through the stages, under
// autocast, with the classifier's cross-entropy.
class PipelineStep final : public StepComponent {
 public:
  PipelineStep(Pipeline& pipeline, torch::Device device, Precision precision)
      : pipeline_(pipeline), device_(device), precision_(precision) {}
  bool forward_backward(StepState& s) override;

 private:
  Pipeline& pipeline_;
  torch::Device device_;
  Precision precision_;
};

// Autocast around each micro-batch's loss; the GradScaler scales the loss,
// steps the optimizer (or skips the step) and updates its scale. Sync
// points: the GradScaler's inf check with fp16.
class PrecisionStep final : public StepComponent {
 public:
  PrecisionStep(torch::Device device, Precision precision, GradScaler& scaler)
      : device_(device), precision_(precision), scaler_(scaler) {}
  void before_forward(StepState&) override;
  void after_forward(StepState&) override;
  torch::Tensor scale_loss(const torch::Tensor& loss) override { return scaler_.scale(loss); }
  bool optimizer_step(StepState& s) override;
  void after_optimizer_step(StepState&) override { scaler_.update(); }
  void abort_step(StepState&) override {
    autocast_.reset();
    scaler_.discard_step();
  }

 private:
  torch::Device device_;
  Precision precision_;
  GradScaler& scaler_;
  std::optional<AutocastGuard> autocast_;
};

// A NaN or infinite loss (without a GradScaler, which skips such steps
// itself) stops the run or skips the step. With several ranks, the decision
// is taken on the loss averaged over them, after backward.
class NonfiniteCheck final : public StepComponent {
 public:
  // `across` qualifies the loss of several ranks in the message.
  NonfiniteCheck(NonfiniteLoss mode, int64_t ranks, const char* across)
      : mode_(mode), ranks_(ranks), across_(across) {}
  void after_forward(StepState& s) override;
  void finish_backward(StepState& s) override;

 private:
  void check(StepState& s, double value, const char* where) const;
  NonfiniteLoss mode_;
  int64_t ranks_;
  const char* across_;
};

// fp32 masters (on the device or the host): gradients go to the masters
// after backward, the optimizer steps them (in host memory when they live
// there), and the model takes their values after the step.
class MasterWeightsStep final : public StepComponent {
 public:
  MasterWeightsStep(MasterWeights& master, bool on_host) : master_(master), on_host_(on_host) {}
  void finish_backward(StepState& s) override;
  void before_optimizer_step(StepState&) override;
  void after_optimizer_step(StepState&) override { host_.reset(); }
  void end_step(StepState& s) override;
  void abort_step(StepState&) override { host_.reset(); }

 private:
  MasterWeights& master_;
  bool on_host_;
  std::optional<UntrackedGuard> host_;
};

// Clips the optimizer's gradients to a total 2-norm after the GradScaler has
// unscaled them; a pipeline's norm is over every stage (one all-reduce).
class ClipStep final : public StepComponent {
 public:
  ClipStep(double max_norm, GradScaler& scaler, ProcessGroup* stages)
      : max_norm_(max_norm), scaler_(scaler), stages_(stages) {}
  void before_optimizer_step(StepState& s) override;

 private:
  double max_norm_;
  GradScaler& scaler_;
  ProcessGroup* stages_;
};

// What a step changes besides the parameters and the optimizer's state:
// the module's buffers (BatchNorm's running statistics) and the RNG states.
// It copies them before the step (host memory, small) and puts them back
// when the step throws, so a failed step leaves them as they were. First of
// the components: its begin_step sees the buffers before any other changes
// them, its abort_step runs last. Sync points: none (on CUDA the buffers
// are copied to pinned host memory asynchronously).
class StateRollback final : public StepComponent {
 public:
  StateRollback(std::vector<torch::Tensor> buffers, torch::Device device)
      : buffers_(std::move(buffers)), device_(device) {}
  void begin_step(StepState&) override;
  void abort_step(StepState&) override;

 private:
  std::vector<torch::Tensor> buffers_;
  std::vector<torch::Tensor> saved_;  // host copies, made once
  torch::Device device_;
  compat::RngState rng_;
};

// The step's own gradients: it starts from none of its own (gradients that
// other code left on the parameters, a GAN generator's backward through
// this model or a user's own backward, are set aside and never flow into
// the step), releases them at the end (Python's zero_grad(set_to_none)), and
// on a step that throws drops what the step accumulated and puts back what
// it set aside. With set_to_none false a gradient the last step zeroed is
// its own, recognised by its tensor and version counter, and is kept.
class OwnGradients final : public StepComponent {
 public:
  OwnGradients(std::vector<torch::Tensor> params, bool set_to_none)
      : params_(std::move(params)), set_to_none_(set_to_none), zeroed_(params_.size()), kept_(params_.size()) {}
  void begin_step(StepState&) override;
  void end_step(StepState&) override;
  void abort_step(StepState&) override;

 private:
  // A gradient this component zeroed, as it left it.
  struct Zeroed {
    const void* impl = nullptr;
    uint32_t version = 0;
  };
  void release(size_t i);
  std::vector<torch::Tensor> params_;
  bool set_to_none_;
  std::vector<Zeroed> zeroed_;
  std::vector<torch::Tensor> aside_;  // per parameter: what other code left there
  std::vector<char> kept_;            // per parameter: the step began on its own zeroed gradient
};

} // namespace detail
} // namespace memfit
