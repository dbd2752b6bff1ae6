#pragma once
/// \file checkpoint.h
/// Activation checkpointing for LibTorch: torch.utils.checkpoint's reentrant
/// semantics in C++.
///
/// checkpoint(fn, inputs) runs `fn` without keeping its intermediate
/// activations and runs it again during backward to rebuild them. Outputs and
/// every gradient (of the inputs and of the parameters that `fn` uses) equal
/// the plain run's, bitwise in fp32 on the CPU. The RNG state (CPU and, on
/// CUDA builds, the inputs' CUDA devices) and the autocast state at forward are
/// restored for the recomputation, so dropout draws the same mask and outputs
/// keep their reduced dtype.
///
/// Differences from PyTorch, all in the user's favour: parameters inside `fn`
/// receive gradients even when no input requires grad (PyTorch's reentrant
/// checkpoint silently gives them none), and saved inputs can live in host
/// memory (CheckpointOptions::offload).
///
/// Not supported, each with a clear error at backward: higher-order gradients
/// (create_graph) through a checkpoint; torch::autograd::grad() or
/// backward(inputs=...) across one; a second backward once the graph is freed.
/// A function whose first operation modifies its input in place breaks the
/// recomputation (as in PyTorch): CheckpointedSequential keeps its segment
/// boundaries off such layers.
///
/// CheckpointedSequential runs a Sequential with a checkpoint schedule
/// (schedule.h): the chain that the planner, recovery and the parameter
/// stream find inside a module (find_chains).
///
/// Thread safety: reentrant like autograd itself; the function runs again on
/// the thread that runs backward. Sync points: none added (offloading copies
/// are asynchronous on CUDA). Extra memory: the inputs (or, offloaded, host
/// copies of them) until backward; with preserve_rng_state, the RNG state
/// (5 KiB of host memory for the CPU generator, not counted); during backward,
/// the recomputed activations of one checkpoint at a time.

#include "memfit/memory.h"
#include "memfit/schedule.h"

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/any.h>
#include <torch//nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace memfit {

/// Options of checkpoint() and checkpoint_sequential(), named after PyTorch's.
struct CheckpointOptions {
  /// Save the RNG state at forward and restore it for the recomputation, so
  /// that random operations (dropout) recompute the same values.
  TORCH_ARG(bool, preserve_rng_state) = true;
  /// Where the saved inputs live between forward and backward.
  TORCH_ARG(Offload, offload) = Offload::kNone;
};

/// A function from tensors to tensors.
using TensorsFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;
/// A function from one tensor to one tensor.
using TensorFn = std::function<torch::Tensor(const torch::Tensor&)>;

namespace detail {
// LibTorch's ModuleHolder::operator() is not SFINAE-friendly, so the function
// overloads below step aside for module holders before asking whether the
// argument converts to a std::function.
template <typename T>
using is_module_holder =
    std::is_base_of<torch::detail::ModuleHolderIndicator, std::decay_t<T>>;
template <typename Fn, typename Signature>
using enable_if_function_t = std::enable_if_t<
    std::conjunction_v<std::negation<is_module_holder<Fn>>, std::is_constructible<Signature, Fn>>,
    int>;

// after_backward runs when the backward that recomputed `fn` ends (also by
// an exception): a streamed layer releases its parameters there.
std::vector<torch::Tensor> checkpoint_impl(const TensorsFn& fn,
                                           const std::vector<torch::Tensor>& inputs,
                                           const CheckpointOptions& options,
                                           std::function<void()> after_backward = nullptr);
} // namespace detail

/// Runs `fn(inputs)` keeping only `inputs`; recomputes `fn` during backward.
///
/// `fn` is any callable from `const std::vector<torch::Tensor>&` to
/// `std::vector<torch::Tensor>`. Under torch::NoGradGuard this simply runs
/// `fn`. Throws c10::Error at backward when none of the recomputed outputs
/// requires grad ("none of output has requires_grad=True").
///
/// Example:
/// \code
///   torch::nn::Linear lin(8, 8);
///   auto x = torch::randn({4, 8});
///   auto outs = memfit::checkpoint(
///       [&](const std::vector<torch::Tensor>& in) {
///         return std::vector<torch::Tensor>{torch::relu(lin(in[0]))};
///       },
///       {x});
///   outs[0].sum().backward();  // lin's gradients as without checkpointing
/// \endcode
template <typename Fn, detail::enable_if_function_t<Fn, TensorsFn> = 0>
std::vector<torch::Tensor> checkpoint(Fn&& fn, const std::vector<torch::Tensor>& inputs,
                                      const CheckpointOptions& options = CheckpointOptions()) {
  return detail::checkpoint_impl(TensorsFn(std::forward<Fn>(fn)), inputs, options);
}

/// checkpoint() for a function of one tensor to one tensor.
///
/// Example:
/// \code
///   torch::nn::Linear lin(8, 8);
///   auto y = memfit::checkpoint([&](const torch::Tensor& x) { return torch::tanh(lin(x)); },
///                               torch::randn({4, 8}));
///   y.sum().backward();
/// \endcode
template <typename Fn, detail::enable_if_function_t<Fn, TensorFn> = 0>
torch::Tensor checkpoint(Fn&& fn, const torch::Tensor& input,
                         const CheckpointOptions& options = CheckpointOptions()) {
  TensorFn one(std::forward<Fn>(fn));
  TORCH_CHECK(static_cast<bool>(one), "memfit::checkpoint needs a function, got an empty one");
  return detail::checkpoint_impl(
      [one](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{one(in[0])}; },
      {input}, options)[0];
}

/// checkpoint() for a module whose forward takes and returns one tensor.
///
/// Example:
/// \code
///   torch::nn::Sequential block(torch::nn::Linear(8, 8), torch::nn::ReLU());
///   auto y = memfit::checkpoint(block, torch::randn({4, 8}));
///   y.sum().backward();
/// \endcode
template <typename ModuleType>
torch::Tensor checkpoint(const torch::nn::ModuleHolder<ModuleType>& module,
                         const torch::Tensor& input,
                         const CheckpointOptions& options = CheckpointOptions()) {
  auto holder = module;
  return checkpoint([holder](const torch::Tensor& x) mutable { return holder->forward(x); }, input,
                    options);
}

/// Runs `sequential` in `segments` segments, each but the last checkpointed.
///
/// PyTorch's torch.utils.checkpoint.checkpoint_sequential: segments of
/// size(sequential) / segments modules; each earlier segment runs forward once
/// without keeping activations and again during backward; the last segment,
/// which also takes the remainder, runs plainly. Throws c10::Error when
/// `segments` < 1.
///
/// Example:
/// \code
///   torch::nn::Sequential seq;
///   for (int i = 0; i < 10; ++i) seq->push_back(torch::nn::Linear(8, 8));
///   auto y = memfit::checkpoint_sequential(seq, 2, torch::randn({4, 8}));
///   y.sum().backward();
/// \endcode
torch::Tensor checkpoint_sequential(const torch::nn::Sequential& sequential, int64_t segments,
                                    const torch::Tensor& input,
                                    const CheckpointOptions& options = CheckpointOptions());

/// A module that can recompute part of its forward during backward instead
/// of keeping what that part saves: selective activation checkpointing (the
/// ops a torch.utils.checkpoint policy would recompute), switched from
/// outside. A module of the user's own derives from it beside
/// torch::nn::Module and runs that part through memfit::checkpoint while it
/// is on; the planner (module_plan.h, PlanOptions::selective_recompute)
/// measures the module's step both ways and chooses. make_gpt's blocks
/// recompute their attention scores, softmax and attention dropout.
///
/// Example:
/// \code
///   struct BlockImpl : torch::nn::Module, memfit::SelectivelyRecomputed {
///     BlockImpl() : fc(register_module("fc", torch::nn::Linear(8, 8))) {}
///     torch::Tensor forward(const torch::Tensor& x) {
///       auto core = [](const torch::Tensor& h) { return torch::softmax(h, -1); };
///       return fc(selective_ && is_training() ? memfit::checkpoint(core, x) : core(x));
///     }
///     void set_selective_recompute(bool enabled) override { selective_ = enabled; }
///     bool selective_recompute() const override { return selective_; }
///     torch::nn::Linear fc;
///     bool selective_ = false;
///   };
///   auto block = std::make_shared<BlockImpl>();
///   assert(memfit::set_selective_recompute(*block, true) == 1 && memfit::selective_recompute(*block));
/// \endcode
class SelectivelyRecomputed {
 public:
  virtual ~SelectivelyRecomputed() = default;
  /// Recompute the part (true) or keep what it saves (false) from the next forward on.
  virtual void set_selective_recompute(bool enabled) = 0;
  /// Whether the part is recomputed.
  virtual bool selective_recompute() const = 0;
};

/// Turns selective recomputation on or off in every SelectivelyRecomputed
/// module inside `module` (itself included, at any depth) and returns how
/// many there are; 0 leaves the module as it was.
///
/// Example:
/// \code
///   auto gpt = memfit::make_gpt(memfit::ModelOptions().num_classes(50).width(32).depth(2).heads(2).context(16));
///   assert(memfit::set_selective_recompute(*gpt, true) == 2 && memfit::selective_recompute(*gpt));
/// \endcode
int64_t set_selective_recompute(const torch::nn::Module& module, bool enabled);

/// Whether `module` holds SelectivelyRecomputed modules and all of them recompute.
///
/// Example:
/// \code
///   assert(!memfit::selective_recompute(*memfit::make_mlp()));
/// \endcode
bool selective_recompute(const torch::nn::Module& module);

/// Sets selective recomputation in every SelectivelyRecomputed module
/// inside `module` for a scope, and puts each one's own setting back at its
/// end.
///
/// Example:
/// \code
///   auto gpt = memfit::make_gpt(memfit::ModelOptions().num_classes(50).width(32).depth(2).heads(2).context(16));
///   {
///     memfit::SelectiveRecomputeGuard on(*gpt, true);
///     assert(on.parts() == 2 && memfit::selective_recompute(*gpt));
///   }
///   assert(!memfit::selective_recompute(*gpt));
/// \endcode
class SelectiveRecomputeGuard {
 public:
  /// Sets it to `enabled` in each such module inside `module` (itself included).
  SelectiveRecomputeGuard(const torch::nn::Module& module, bool enabled);
  /// Puts each module's own setting back.
  ~SelectiveRecomputeGuard();
  SelectiveRecomputeGuard(const SelectiveRecomputeGuard&) = delete;
  SelectiveRecomputeGuard& operator=(const SelectiveRecomputeGuard&) = delete;
  /// How many SelectivelyRecomputed modules the scope set.
  int64_t parts() const { return static_cast<int64_t>(parts_.size()); }

 private:
  std::vector<std::pair<SelectivelyRecomputed*, bool>> parts_;
};

/// set_selective_recompute on a module holder's module (0 for an empty holder).
template <class M>
int64_t set_selective_recompute(const torch::nn::ModuleHolder<M>& module, bool enabled) {
  return module.is_empty() ? 0 : set_selective_recompute(*module, enabled);
}

/// selective_recompute of a module holder's module (false for an empty holder).
template <class M>
bool selective_recompute(const torch::nn::ModuleHolder<M>& module) {
  return !module.is_empty() && selective_recompute(*module);
}

/// Options of CheckpointedSequential.
struct CheckpointedSequentialOptions {
  /// Which schedule.
  TORCH_ARG(ScheduleKind, kind) = ScheduleKind::kNone;
  /// kEvery: layers per segment; kUniform: number of segments.
  TORCH_ARG(int64_t, k) = 0;
  /// kOptimal: the budget for the chain's activations in bytes (the input and
  /// the parameters excluded).
  TORCH_ARG(int64_t, budget) = 0;
  /// kOptimal: the solver's resolution.
  TORCH_ARG(SolverOptions, solver) = SolverOptions();
  /// Options of each checkpoint (RNG state, offload). A checkpoint that
  /// starts at the chain's input (or a recomputation's) keeps it on the
  /// device whatever the offload: the caller holds it there anyway.
  TORCH_ARG(CheckpointOptions, checkpoint) = CheckpointOptions();
};

/// Runs layer `index` of a CheckpointedSequential on `input` in place of
/// `module.forward(input)`, as a ParameterStream (stream.h) does to bring the
/// layer's parameters to the device around it.
using LayerRunner = std::function<torch::Tensor(int64_t index, torch::nn::AnyModule& module,
                                                const torch::Tensor& input)>;

/// A module that runs a Sequential with a checkpoint schedule.
///
/// The standard kinds are built in the constructor. kOptimal profiles the chain
/// on the first forward with grad (or when plan() is called) and solves for
/// the budget. A segment boundary that would start a checkpoint at an in-place
/// layer (ReLU(inplace), Dropout(inplace), ...) moves one layer later, since
/// recomputation needs the segment's original input. Gradients equal the plain
/// Sequential's bitwise (fp32, CPU); BatchNorm layers inside a checkpointed
/// segment update their running statistics again when recomputed (as in
/// PyTorch).
///
/// Example:
/// \code
///   torch::nn::Sequential chain;
///   for (int i = 0; i < 16; ++i) chain->push_back(torch::nn::Linear(32, 32));
///   memfit::CheckpointedSequential model(
///       chain, memfit::CheckpointedSequentialOptions().kind(memfit::ScheduleKind::kSqrt));
///   model->forward(torch::randn({8, 32})).sum().backward();
/// \endcode
class CheckpointedSequentialImpl : public torch::nn::Cloneable<CheckpointedSequentialImpl> {
 public:
  /// Wraps `sequential` (its layers stay shared) and builds the schedule.
  CheckpointedSequentialImpl(torch::nn::Sequential sequential,
                             CheckpointedSequentialOptions options = CheckpointedSequentialOptions());

  /// Re-creates the wrapped Sequential's registration (Cloneable).
  void reset() override;
  /// Runs the layers with the schedule (plainly under no-grad).
  torch::Tensor forward(const torch::Tensor& input);
  /// kOptimal: profiles the chain on `sample_input` and solves; other kinds: no-op.
  void plan(const torch::Tensor& sample_input);
  /// Replaces the schedule (validated against the number of layers; with
  /// kOptimal, an empty one means not planned yet).
  void set_schedule(Schedule schedule);
  /// The schedule in use (empty before kOptimal has been planned).
  const Schedule& schedule() const { return schedule_; }
  /// Replaces the options of each checkpoint (RNG state, where its input is
  /// kept) from the next forward on; a recomputation already saved keeps its own.
  void set_checkpoint_options(CheckpointOptions options) { options_.checkpoint(options); }
  /// The options of each checkpoint.
  const CheckpointOptions& checkpoint_options() const { return options_.checkpoint(); }
  /// The wrapped Sequential.
  const torch::nn::Sequential& sequential() const { return sequential_; }
  /// Whether layer i modifies its input in place (as detected from its type).
  const std::vector<bool>& in_place() const { return in_place_; }
  /// Runs every layer through `runner` from now on, in forward and in
  /// recomputations; nullptr: through the layers' own forward. Not thread-safe
  /// against a running forward or backward.
  void set_layer_runner(LayerRunner runner) { runner_ = std::move(runner); }
  /// The runner set by set_layer_runner (nullptr: none).
  const LayerRunner& layer_runner() const { return runner_; }

 private:
  torch::Tensor run(const std::vector<Segment>& segments, torch::Tensor x);
  torch::Tensor run_layer(int64_t i, const torch::Tensor& x);

  torch::nn::Sequential sequential_;
  CheckpointedSequentialOptions options_;
  std::vector<torch::nn::AnyModule> modules_;
  std::vector<bool> in_place_;
  Schedule schedule_;
  LayerRunner runner_;
};
TORCH_MODULE(CheckpointedSequential);

/// A chain found inside a module.
struct FoundChain {
  std::string name;              ///< Its path inside the module, as named_modules() gives it.
  CheckpointedSequential chain;  ///< The chain (shared with the module).
};

/// Every outermost CheckpointedSequential inside `module` (the module itself
/// included), in registration order; chains inside a chain's layers belong
/// to those layers.
///
/// Example:
/// \code
///   torch::nn::Sequential blocks(torch::nn::Linear(8, 8), torch::nn::ReLU());
///   auto net = std::make_shared<torch::nn::Module>();
///   net->register_module("blocks", memfit::CheckpointedSequential(blocks));
///   auto chains = memfit::find_chains(*net);
///   assert(chains.size() == 1 && chains[0].name == "blocks");
/// \endcode
std::vector<FoundChain> find_chains(const torch::nn::Module& module);

} // namespace memfit
