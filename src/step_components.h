#pragma once
// The Trainer's built-in step components (step.h): one per technique. Not
// installed; the Trainer adds those its options enable, in the order below.

#include "memfit/distributed.h"
#include "memfit/memory.h"
#include "memfit/optim.h"
#include "memfit/pipeline.h"
#include "memfit/precision.h"
#include "memfit/step.h"
#include "memfit/stream.h"
#include "memfit/trainer.h"
#include "compat.h"

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace memfit {

// How the non-finite check's message qualifies a loss that the ranks combined.
inline constexpr const char* kSummedOverRanks = " (summed over the ranks)";

namespace detail {

// Cross-entropy of class logits [N, C] against [N] labels, or of per-token
// logits [N, T, C] against [N, T] labels (a language model), in fp32: the
// mean, or with `sum` the sum, over every label.
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target, bool sum = false);

// A checkpoint's integer or tensor at `key`; throws "<what> is damaged:
// '<key>' is missing" when it is not there.
int64_t read_int(torch::serialize::InputArchive& a, const std::string& key, const std::string& what);
torch::Tensor read_tensor(torch::serialize::InputArchive& a, const std::string& key, const std::string& what);

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

// The ranks' vote that each of them reached a point of the step without an
// out-of-memory error, where otherwise one rank's failure would leave the
// others waiting in a collective: one all-reduce of [loss, a flag per rank].
// A rank that fails votes once, from the Trainer's recovery, and meets the
// others at their next point; from there every rank recovers together.
class RankVote {
 public:
  explicit RankVote(ProcessGroup& group) : group_(group) {}
  // This rank reached a point of step `step` with `loss`: returns the loss
  // summed over the ranks, or throws c10::OutOfMemoryError naming the ranks
  // that failed (after which every rank knows).
  double reached(double loss, int64_t step);
  // Whether this rank recovers from another rank's failure (a vote told it),
  // rather than from its own.
  bool peer_failed() const { return peer_failed_; }
  // This rank failed: votes so, unless a vote has already told every rank.
  void failed();
  // After a failure, every rank's decision: `go_on` (a new plan with
  // `micro_batch_size`). Returns "" when every rank goes on with the same
  // micro-batch size, else why they all stop. Ends the attempt.
  std::string agree(bool go_on, int64_t micro_batch_size);

 private:
  // Sums [extra, a slot per rank holding `mine` on this rank] over the ranks.
  std::vector<double> sum(double extra, double mine);
  ProcessGroup& group_;
  bool announced_ = false;
  bool peer_failed_ = false;
};

// Data parallelism: buffers from rank 0 before the step, gradients
// all-reduced during the last micro-batch's backward only, the loss
// averaged over the ranks. With a vote (recovery), every bucket is launched
// before the ranks vote that each got there, and a rank that failed joins
// the buckets it did not launch before it votes. Sync points: DDP's; the
// vote replaces the loss's all-reduce.
class DataParallelStep final : public StepComponent {
 public:
  DataParallelStep(DistributedDataParallel& ddp, ProcessGroup& group, RankVote* vote)
      : ddp_(ddp), group_(group), vote_(vote), overlaps_(vote == nullptr || group.device().is_cpu()) {}
  void begin_step(StepState&) override;
  void before_backward(StepState& s) override;
  void after_backward(StepState&) override;
  void finish_backward(StepState& s) override;
  void abort_step(StepState&) override;

 private:
  DistributedDataParallel& ddp_;
  ProcessGroup& group_;
  RankVote* vote_;
  // The all-reduce overlaps the last backward. With a vote that needs a
  // failing rank to join the buckets it did not launch, which Gloo does on
  // the host; under NCCL that rank may have no device memory for one, so
  // the ranks vote before any bucket goes out.
  bool overlaps_;
  bool reducing_ = false;  // from the step's start until its gradients are written back
  std::optional<DistributedDataParallel::NoSync> no_sync_;
};

// With a vote: the ranks vote inside the optimizer's step, after it has
// allocated everything and before it changes anything (or after a step that
// did not run), so that either every rank steps or none does. That vote
// carries the loss where DataParallelStep left it pending, and the step's
// non-finite check follows it; one that skips the step, or an optimizer
// that does not call optim::before_commit, needs the averaged loss before
// the optimizer's step, so the ranks vote after the backward too.
// Sync points: the votes.
class VoteBeforeCommit final : public StepComponent {
 public:
  // `check`: the step's non-finite check (kUnchecked where a GradScaler or nothing checks).
  VoteBeforeCommit(RankVote& vote, int64_t ranks, NonfiniteLoss check) : vote_(vote), ranks_(ranks), check_(check) {}
  void finish_backward(StepState& s) override;
  void before_optimizer_step(StepState& s) override;
  void after_optimizer_step(StepState& s) override;
  void abort_step(StepState&) override { gate_.reset(); }

 private:
  bool reach(StepState& s);  // votes with the pending loss, if any, and averages it (then true)
  void vote(StepState& s);   // the vote before the update (with the pending loss, then its check)
  RankVote& vote_;
  int64_t ranks_;
  NonfiniteLoss check_;
  bool gated_ = false;  // this step's optimizer calls optim::before_commit (memfit's)
  std::optional<optim::BeforeCommit> gate_;
  bool voted_ = false;
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
  // "grad_scaler", when the scaler is enabled (fp16); a checkpoint must hold
  // one exactly when this run scales the loss.
  void save_state(torch::serialize::OutputArchive& a) override;
  std::function<void()> load_state(torch::serialize::InputArchive& a, const std::string& path) override;

 private:
  torch::Device device_;
  Precision precision_;
  GradScaler& scaler_;
  std::optional<AutocastGuard> autocast_;
};

// Stops the run (NonfiniteLoss::kError) or skips the step (kSkip) where the
// step's loss `s.loss_value` is NaN or infinite; `where` qualifies it in the message.
void check_finite_loss(StepState& s, NonfiniteLoss mode, const char* where);

// A NaN or infinite loss (without a GradScaler, which skips such steps
// itself) stops the run or skips the step. The decision is taken on the
// step's loss, read once after backward (with several ranks, averaged over
// them; a loss that a vote averages later is checked after that vote).
class NonfiniteCheck final : public StepComponent {
 public:
  // `across` qualifies the loss of several ranks in the message.
  NonfiniteCheck(NonfiniteLoss mode, int64_t ranks, const char* across)
      : mode_(mode), ranks_(ranks), across_(across) {}
  void begin_step(StepState& s) override { s.read_loss = mode_ != NonfiniteLoss::kUnchecked; }
  void finish_backward(StepState& s) override;  // the step's loss, read once after its micro-batches

 private:
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
  // "masters": each fp32 master's values.
  void save_state(torch::serialize::OutputArchive& a) override;
  std::function<void()> load_state(torch::serialize::InputArchive& a, const std::string& path) override;

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
    int64_t version = 0;
  };
  void release(size_t i);
  std::vector<torch::Tensor> params_;
  bool set_to_none_;
  std::vector<Zeroed> zeroed_;
  std::vector<torch::Tensor> aside_;  // per parameter: what other code left there
  std::vector<char> kept_;            // per parameter: the step began on its own zeroed gradient
};

// The optimizer's part of a checkpoint: "optimizer", or with a sharded
// optimizer (zero_stage 1) "optimizer_shards", every rank's shard gathered
// on rank 0 (save_state is then a collective). On resume the state goes
// where the Trainer keeps it: with the parameters on the device, or in (pinned)
// host memory with the host masters. It takes no part in the step.
class OptimizerStatePart final : public StepComponent {
 public:
  struct Layout {
    ZeroRedundancyOptimizer* zero = nullptr;  // the optimizer, when it is sharded
    torch::optim::Optimizer* holder = nullptr;  // the optimizer that holds this rank's state
    bool on_host = false;  // the state lives in host memory (offload_optimizer host)
    bool masters = false;  // the optimizer steps fp32 masters, not the model's parameters
    int64_t world = 1;
    int64_t rank = 0;
  };
  OptimizerStatePart(torch::optim::Optimizer& optimizer, Layout layout) : optimizer_(optimizer), layout_(layout) {}
  void save_state(torch::serialize::OutputArchive& a) override;
  std::function<void()> load_state(torch::serialize::InputArchive& a, const std::string& path) override;

 private:
  void place_state() const;  // loaded state (host memory) to where this run keeps it
  torch::optim::Optimizer& optimizer_;
  Layout layout_;
};

// The step's memory at the end of each phase, and the model's gradient
// bytes after backward (before they move to any masters). It holds what it
// reads, never the Trainer, which may move; the parameters are listed once,
// not walked from the module at every phase. The Trainer keeps it last.
class Timeline final : public StepComponent {
 public:
  Timeline(torch::Device device, std::vector<torch::Tensor> params, MasterWeights* device_masters,
           torch::optim::Optimizer* device_state)
      : device_(device), params_(std::move(params)), masters_(device_masters), state_(device_state) {}
  void begin_step(StepState&) override;
  void after_forward(StepState& s) override { mark(s.phase); }
  void after_backward(StepState& s) override;
  void after_optimizer_step(StepState&) override { mark("optimizer step"); }
  void end_step(StepState& s) override;
  void abort_step(StepState&) override { meter_.reset(); }
  const std::vector<PhaseMemory>& timeline() const { return timeline_; }
  int64_t model_grad_bytes() const { return model_grad_bytes_; }
  bool skipped() const { return skipped_; }

 private:
  void mark(std::string phase);
  torch::Device device_;
  std::vector<torch::Tensor> params_;  // the module's
  MasterWeights* masters_;             // fp32 masters on the device, or nullptr
  torch::optim::Optimizer* state_;     // the optimizer whose state is on the device, or nullptr
  std::vector<PhaseMemory> timeline_;
  std::optional<PeakMeter> meter_;
  int64_t model_grad_bytes_ = 0;
  bool skipped_ = false;
};

} // namespace detail
} // namespace memfit
