#pragma once
/// \file pipeline.h
/// Pipeline (model) parallel training: a Sequential split into consecutive
/// stages, one per rank of a process group, each batch cut into micro-batches
/// (chunks) that flow through the stages, activations forward and their
/// gradients back with c10d send/recv (PyTorch's Pipe, torchgpipe; GPipe's or
/// PipeDream-flush's 1F1B schedule).
///
/// Every rank holds only its stage's layers and their optimizer state, so a
/// model that does not fit one device can be trained on several. The
/// gradients are those of the whole batch's mean loss, as in one process
/// (to rounding: micro-batch gradients are summed).
///
/// Thread safety: a Pipeline belongs to one training thread. Sync points:
/// construction (the balance is broadcast from rank 0) and train_step (each
/// stage waits for its neighbours' activations and gradients; the loss is
/// broadcast from the last stage). Extra memory per stage: the inputs and
/// outputs of the chunks in flight (GPipe: all chunks of a batch; 1F1B: at
/// most as many as the stages from this one to the last) with their
/// activations (with PipelineOptions::checkpoint, a checkpointed chunk keeps
/// only its input and output, and one chunk's activations are recomputed at a
/// time), and the host copies of what is sent.

#include "memfit/distributed.h"
#include "memfit/profile.h"

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace memfit {

/// The order in which a stage runs its chunks' forwards and backwards.
enum class PipelineSchedule {
  kGPipe,  ///< Every chunk's forward, then every backward (Huang et al. 2019).
  k1F1B,   ///< After a warm-up, one forward then one backward (PipeDream-flush):
           ///< the same bubble, fewer chunks' activations alive at once.
};

/// Parses "gpipe" or "1f1b"; throws c10::Error naming the accepted names.
PipelineSchedule parse_pipeline_schedule(const std::string& name);

/// Which chunks a stage runs under activation checkpointing (PyTorch Pipe's
/// `checkpoint` argument, GPipe's re-materialisation): such a chunk keeps
/// only its input to the stage until its backward, which recomputes the
/// stage's forward first. Leading in-place layers of a stage (a ReLU(inplace)
/// on what it receives) run outside the checkpoint, which needs its input
/// intact.
enum class PipelineCheckpoint {
  kNever,       ///< Every chunk keeps its activations (the default here).
  kExceptLast,  ///< All chunks but the last (Pipe's default): the last one's
                ///< backward comes first in GPipe, so recomputing it saves nothing.
  kAlways,      ///< Every chunk.
};

/// Parses "never", "except_last" or "always"; throws c10::Error naming the accepted names.
///
/// Example:
/// \code
///   assert(memfit::parse_pipeline_checkpoint("except_last") == memfit::PipelineCheckpoint::kExceptLast);
/// \endcode
PipelineCheckpoint parse_pipeline_checkpoint(const std::string& name);

/// How a Pipeline splits the model and the batch (names from PyTorch's Pipe).
struct PipelineOptions {
  /// Micro-batches per batch.
  TORCH_ARG(int64_t, chunks) = 4;
  /// The schedule.
  TORCH_ARG(PipelineSchedule, schedule) = PipelineSchedule::kGPipe;
  /// Layers per stage, one entry per rank, adding up to the model's length
  /// (see balance_by_time); empty: as even a split by layer count as can be.
  /// Rank 0's balance is used on every rank.
  TORCH_ARG(std::vector<int64_t>, balance) = {};
  /// Which chunks run under activation checkpointing (see PipelineCheckpoint);
  /// gradients are those without it (bitwise in fp32 on the CPU).
  TORCH_ARG(PipelineCheckpoint, checkpoint) = PipelineCheckpoint::kNever;
};

/// The split of a chain of layers with these costs into `stages` consecutive
/// non-empty parts whose largest total cost is the least possible (exact,
/// by dynamic programming); ties go to the earliest split. Returns the number
/// of layers per stage. With `trains` (one flag per layer: whether it has
/// parameters to train), every stage holds at least one flagged layer, since
/// a stage with nothing to train cannot run as a Trainer's stage.
///
/// Example:
/// \code
///   auto b = memfit::balance_by_cost({1, 1, 1, 3}, 2);  // {3, 1}: costs 3 and 3
///   assert(b == std::vector<int64_t>({3, 1}));
///   auto t = memfit::balance_by_cost({5, 1, 1}, 2, {false, true, true});  // not {1, 2}
///   assert(t == std::vector<int64_t>({2, 1}));
/// \endcode
std::vector<int64_t> balance_by_cost(const std::vector<double>& costs, int64_t stages,
                                     const std::vector<bool>& trains = {});

/// A balance for `model` over `stages` stages from a profile of its layers:
/// each layer's forward and backward time is its cost (balance_by_cost), and
/// every stage gets a layer with parameters that require grad.
///
/// Example:
/// \code
///   torch::nn::Sequential net(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8), torch::nn::ReLU());
///   memfit::ChainProfile p;
///   p.layers.resize(3);
///   p.layers[2].forward_seconds = 1.0;  // the slow ReLU gets no stage of its own: nothing to train
///   assert(memfit::balance_by_profile(net, p, 2) == std::vector<int64_t>({1, 2}));
/// \endcode
std::vector<int64_t> balance_by_profile(const torch::nn::Sequential& model, const ChainProfile& profile,
                                        int64_t stages);

/// A balance for `model` over `stages` stages from each layer's forward and
/// backward time on `sample_input` (memfit::profile_chain, then
/// balance_by_profile), as torchgpipe's balance_by_time. Timings vary from
/// run to run; a Pipeline uses rank 0's.
std::vector<int64_t> balance_by_time(const torch::nn::Sequential& model, const torch::Tensor& sample_input,
                                     int64_t stages);

/// What a stage returns from train_step.
struct PipelineStepResult {
  double loss = 0;             ///< The batch's mean loss (on every rank).
  int64_t max_in_flight = 0;   ///< Most chunks whose activations this stage held at once.
};

/// One rank's stage of a pipeline over `group`: rank r keeps the layers
/// balance[0] + ... + balance[r-1] onwards, balance[r] of them, and drops the
/// others (build the same model on every rank, from the same seed, and hand
/// it over). Move-only.
///
/// Example:
/// \code
///   memfit::WorldInfo solo;
///   solo.master_port = 0;
///   auto group = std::make_shared<memfit::ProcessGroup>(solo);
///   torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 3));
///   memfit::Pipeline pipe(net, group, memfit::PipelineOptions().chunks(2));
///   auto r = pipe.train_step(torch::randn({6, 4}), torch::randint(0, 3, {6}),
///                            [](const torch::Tensor& out, const torch::Tensor& y) {
///                              return torch::nn::functional::cross_entropy(out, y);
///                            });
///   // pipe.stage()'s parameters now hold the batch's gradients: step an optimizer over them.
/// \endcode
class Pipeline {
 public:
  /// The loss of one chunk: mean over its examples.
  using LossFn = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

  Pipeline(torch::nn::Sequential model, std::shared_ptr<ProcessGroup> group,
           PipelineOptions options = PipelineOptions());
  ~Pipeline();
  Pipeline(Pipeline&&) noexcept;
  Pipeline& operator=(Pipeline&&) noexcept;
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  /// Forward and backward of one batch through the pipeline: every rank
  /// passes the same `input` and `target` (the first stage reads the input,
  /// the last the target; the others only their batch size). The gradients
  /// of the batch's mean loss accumulate into this stage's parameters.
  PipelineStepResult train_step(const torch::Tensor& input, const torch::Tensor& target, const LossFn& loss);

  /// The whole model's output for `input` without gradients (evaluation):
  /// every rank passes the same input; the last stage gets the output, the
  /// others an undefined tensor.
  torch::Tensor forward(const torch::Tensor& input);

  /// This rank's layers, under their names in the whole model.
  torch::nn::Sequential& stage();
  /// Index in the whole model of this stage's first layer.
  int64_t first_layer() const;
  /// Layers per stage, as used.
  const std::vector<int64_t>& balance() const;
  /// The options, as checked.
  const PipelineOptions& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace memfit
