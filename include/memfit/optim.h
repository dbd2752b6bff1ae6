#pragma once
/// \file optim.h
/// LibTorch's SGD, Adam and AdamW with a step that either completes or
/// changes nothing, and that runs the fastest kernel LibTorch has.
///
/// Each is a torch::optim optimizer (same options, parameter groups, state
/// and serialization, so it swaps in with one word and LR schedulers work)
/// whose step runs in two phases. The first makes everything the step
/// allocates: the state a parameter gets at its first step, and for the loop
/// kernel one work buffer per device and dtype as large as the largest
/// parameter (two where weight decay or Nesterov momentum need one more) and
/// the step's scalars (host memory); for the fused kernel one float32 step
/// count per device and step value. Only then does the second phase change
/// parameters and state, with operations that allocate nothing. So an
/// allocation that fails (an out-of-memory error under a budget) leaves every
/// parameter and every state tensor as they were, and the state made for the
/// step is dropped again.
///
/// Kernels (Kernel): kLoop runs LibTorch's own operations in its order, one
/// parameter at a time: results are bitwise torch::optim's. kFused runs
/// LibTorch's fused kernels (at::_fused_adam_, _fused_adamw_, _fused_sgd_;
/// LibTorch 2.4 and later, CPU and CUDA), one call per parameter group,
/// device and dtype, with no temporaries: results equal torch::optim's within
/// rounding (1e-6 relative over 100 steps in tests/optim_test.cpp). kAuto, the
/// default, takes kFused where it exists and kLoop elsewhere. LibTorch's
/// `_foreach_*` operations are not used: on the CPU they loop over the
/// tensors as kLoop does, and the CUDA builds memfit supports have kFused
/// (docs/optim.md has the measurement).
///
/// Sync points: none, except that SGD's step_unscaling reads its found_inf
/// once where it makes momentum buffers and steps_to_host reads the step
/// counts kept on the device. Extra memory: kLoop's work buffers during the step
/// (one largest parameter, or two), where LibTorch's loop makes two or three
/// temporaries of each parameter in turn; kFused's step counts (4 bytes each),
/// which stay on the device, one per parameter, once step_unscaling has
/// skipped on the device.

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <string>
#include <unordered_map>

namespace memfit {
namespace optim {

/// The implementation of a memfit optimizer's update.
enum class Kernel {
  kAuto,   ///< kFused where this LibTorch has it for the parameter, else kLoop
  kLoop,   ///< LibTorch's operations one parameter at a time: bitwise torch::optim
  kFused,  ///< one fused kernel per group, device and dtype (LibTorch 2.4 and later)
};

/// The name of `kernel`: "auto", "loop" or "fused".
///
/// Example:
/// \code
///   assert(std::string(memfit::optim::kernel_name(memfit::optim::Kernel::kFused)) == "fused");
/// \endcode
const char* kernel_name(Kernel kernel);

/// The kernel named `name` ("auto", "loop" or "fused"); anything else is
/// refused, naming the three.
///
/// Example:
/// \code
///   assert(memfit::optim::parse_kernel("loop") == memfit::optim::Kernel::kLoop);
/// \endcode
Kernel parse_kernel(const std::string& name);

/// Whether this LibTorch has fused Adam, AdamW and SGD kernels for
/// `device`'s type (LibTorch 2.4 and later, CPU and CUDA).
///
/// Example:
/// \code
///   bool fused = memfit::optim::has_fused_kernels(torch::kCPU);  // false on LibTorch 1.13
/// \endcode
bool has_fused_kernels(c10::DeviceType device);

/// The kernel choice of a memfit optimizer: the one asked for, and the one
/// its last step ran.
///
/// A parameter that kFused cannot take (a dtype or device without a fused
/// kernel, or a non-contiguous parameter, gradient or state) is stepped by
/// the loop instead, with one warning per optimizer naming the reason. Asking
/// for kFused where LibTorch has no fused kernels at all is refused when the
/// optimizer is built.
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);
///   memfit::optim::Adam adam(lin->parameters(), torch::optim::AdamOptions(1e-3), memfit::optim::Kernel::kLoop);
///   lin(torch::ones({3, 4})).sum().backward();
///   adam.step();
///   assert(adam.kernel_ran() == memfit::optim::Kernel::kLoop);
/// \endcode
class KernelChoice {
 public:
  virtual ~KernelChoice() = default;
  /// The kernel asked for.
  Kernel kernel() const { return kernel_; }
  /// The kernel the last step ran: kFused when every parameter it updated
  /// took the fused kernel, kLoop when any took the loop, kAuto before the
  /// first step.
  Kernel kernel_ran() const { return ran_; }

  /// Whether the next step can divide the loss scale out of the gradients
  /// inside the fused kernel (step_unscaling): every parameter with a
  /// gradient takes the fused kernel. GradScaler::step asks this.
  virtual bool can_unscale_in_kernel() const = 0;

  /// One step on gradients still multiplied by `grad_scale` (one float32
  /// element; copied to the parameters' devices where it lies elsewhere),
  /// which the fused kernel divides out as it updates, as PyTorch's fused
  /// optimizers take GradScaler's scale: no separate unscaling pass. Refused
  /// before anything changes unless can_unscale_in_kernel(). The result
  /// equals unscaling by the reciprocal and then step() bitwise where the
  /// scale is a power of two (GradScaler's are, unless set otherwise).
  ///
  /// A defined `found_inf` (one float32 element, 1 where the gradients hold
  /// inf or NaN: GradScaler's check) skips the update inside the kernel where
  /// it is 1, so that skipping needs no read on the host. Adam's and AdamW's
  /// step counts then live on the device, one float32 per parameter, and
  /// stay where the kernel skipped (steps_to_host() writes them back). SGD
  /// reads `found_inf` on the host once where its step would make momentum
  /// buffers, since a skipped first step must leave none.
  ///
  /// Example:
  /// \code
  ///   auto lin = torch::nn::Linear(4, 2);
  ///   memfit::optim::SGD sgd(lin->parameters(), torch::optim::SGDOptions(0.1));
  ///   (lin(torch::ones({3, 4})).sum() * 1024).backward();
  ///   if (sgd.can_unscale_in_kernel()) sgd.step_unscaling(torch::full({}, 1024.f), torch::zeros({1}));
  /// \endcode
  virtual torch::Tensor step_unscaling(const torch::Tensor& grad_scale, const torch::Tensor& found_inf = {}) = 0;

  /// Writes the step counts that step_unscaling with a `found_inf` keeps on
  /// the device back into the LibTorch state (state()'s `step`) and frees
  /// them. save() calls it; call it before reading state() yourself. Sync
  /// points: one read per parameter that has such a count; none when none has.
  ///
  /// Example:
  /// \code
  ///   auto lin = torch::nn::Linear(4, 2);
  ///   memfit::optim::Adam adam(lin->parameters());
  ///   adam.steps_to_host();  // nothing on the device: a no-op
  /// \endcode
  virtual void steps_to_host() {}

 protected:
  explicit KernelChoice(Kernel kernel = Kernel::kAuto);
  /// Whether a parameter of this device type may take the fused kernel.
  bool wants_fused(c10::DeviceType device) const;
  /// Records a parameter that kFused was asked for but the loop steps; warns
  /// once, naming `why`.
  void fell_back(const std::string& optimizer, const std::string& why);
  Kernel kernel_;
  Kernel ran_ = Kernel::kAuto;
  /// The scale step_unscaling hands the next step; undefined otherwise.
  torch::Tensor grad_scale_;
  /// The found_inf step_unscaling hands the next step; undefined otherwise.
  torch::Tensor found_inf_;
  /// Step counts kept on the device by parameter (Adam's and AdamW's, after
  /// a step_unscaling with found_inf); where a parameter has one, it is the
  /// count and the state's `step` is behind.
  std::unordered_map<const c10::TensorImpl*, torch::Tensor> device_steps_;

 private:
  bool warned_ = false;
};

/// torch::optim::SGD whose step completes or changes nothing, on the fastest
/// kernel (see the file comment).
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);
///   memfit::optim::SGD sgd(lin->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
///   lin(torch::ones({3, 4})).sum().backward();
///   sgd.step();
/// \endcode
class SGD : public torch::optim::SGD, public KernelChoice {
 public:
  using torch::optim::SGD::SGD;
  /// LibTorch's constructors, with the kernel to run.
  SGD(std::vector<torch::Tensor> params, torch::optim::SGDOptions defaults, Kernel kernel);
  SGD(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::SGDOptions defaults, Kernel kernel);
  /// One step over every parameter with a gradient; throws before changing
  /// anything when an allocation fails.
  torch::Tensor step(LossClosure closure = nullptr) override;
  bool can_unscale_in_kernel() const override;
  torch::Tensor step_unscaling(const torch::Tensor& grad_scale, const torch::Tensor& found_inf = {}) override;
};

/// torch::optim::Adam whose step completes or changes nothing, on the fastest
/// kernel (see the file comment).
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);
///   memfit::optim::Adam adam(lin->parameters(), torch::optim::AdamOptions(1e-3).amsgrad(true));
///   lin(torch::ones({3, 4})).sum().backward();
///   adam.step();
/// \endcode
class Adam : public torch::optim::Adam, public KernelChoice {
 public:
  using torch::optim::Adam::Adam;
  /// LibTorch's constructors, with the kernel to run.
  Adam(std::vector<torch::Tensor> params, torch::optim::AdamOptions defaults, Kernel kernel);
  Adam(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::AdamOptions defaults, Kernel kernel);
  /// One step over every parameter with a gradient; throws before changing
  /// anything when an allocation fails.
  torch::Tensor step(LossClosure closure = nullptr) override;
  bool can_unscale_in_kernel() const override;
  torch::Tensor step_unscaling(const torch::Tensor& grad_scale, const torch::Tensor& found_inf = {}) override;
  void steps_to_host() override;
  /// LibTorch's save, after steps_to_host().
  void save(torch::serialize::OutputArchive& archive) const override;
  /// LibTorch's load; the step counts on the device are dropped.
  void load(torch::serialize::InputArchive& archive) override;
};

/// torch::optim::AdamW whose step completes or changes nothing, on the
/// fastest kernel (see the file comment).
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);
///   memfit::optim::AdamW adamw(lin->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
///   lin(torch::ones({3, 4})).sum().backward();
///   adamw.step();
/// \endcode
class AdamW : public torch::optim::AdamW, public KernelChoice {
 public:
  using torch::optim::AdamW::AdamW;
  /// LibTorch's constructors, with the kernel to run.
  AdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults, Kernel kernel);
  AdamW(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::AdamWOptions defaults, Kernel kernel);
  /// One step over every parameter with a gradient; throws before changing
  /// anything when an allocation fails.
  torch::Tensor step(LossClosure closure = nullptr) override;
  bool can_unscale_in_kernel() const override;
  torch::Tensor step_unscaling(const torch::Tensor& grad_scale, const torch::Tensor& found_inf = {}) override;
  void steps_to_host() override;
  /// LibTorch's save, after steps_to_host().
  void save(torch::serialize::OutputArchive& archive) const override;
  /// LibTorch's load; the step counts on the device are dropped.
  void load(torch::serialize::InputArchive& archive) override;
};

/// The kernel `optimizer`'s last step ran, as the report names it: "fused"
/// or "loop" for memfit's optimizers ("none" before their first step), and
/// "libtorch" for any other optimizer (its own implementation).
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);
///   torch::optim::SGD plain(lin->parameters(), torch::optim::SGDOptions(0.1));
///   assert(memfit::optim::kernel_ran(plain) == "libtorch");
/// \endcode
std::string kernel_ran(const torch::optim::Optimizer& optimizer);

/// Whether `optimizer`'s step completes or changes nothing: memfit's SGD,
/// Adam and AdamW (and a ZeroRedundancyOptimizer over them are not: its
/// broadcast follows the step). The Trainer recovers from an out-of-memory
/// error inside such a step; inside another optimizer's it cannot.
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);
///   memfit::optim::Adam adam(lin->parameters());
///   torch::optim::Adam plain(lin->parameters());
///   assert(memfit::optim::is_transactional(adam) && !memfit::optim::is_transactional(plain));
/// \endcode
bool is_transactional(const torch::optim::Optimizer& optimizer);

/// The LibTorch optimizer type whose state `optimizer` keeps, as checkpoints
/// name it: "torch::optim::Adam" for memfit::optim::Adam too (their state and
/// serialization are the same), else the type's own name.
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);
///   memfit::optim::Adam adam(lin->parameters());
///   assert(memfit::optim::state_type_name(adam) == "torch::optim::Adam");
/// \endcode
std::string state_type_name(const torch::optim::Optimizer& optimizer);

/// While alive, the steps of memfit's optimizers on this thread call `fn`
/// between their two phases: after everything the step allocates is made,
/// before any parameter or state changes.
///
/// If `fn` throws, the step changes nothing (the state it made is dropped)
/// and the exception propagates. The Trainer uses it to have the ranks of a
/// process group agree that each of them can step, before any of them does.
/// Guards nest; the innermost is called. Sync points: `fn`'s.
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);
///   memfit::optim::SGD sgd(lin->parameters(), torch::optim::SGDOptions(0.1));
///   lin(torch::ones({3, 4})).sum().backward();
///   int calls = 0;
///   {
///     memfit::optim::BeforeCommit gate([&] { ++calls; });
///     sgd.step();
///   }
///   assert(calls == 1);
/// \endcode
class BeforeCommit {
 public:
  explicit BeforeCommit(std::function<void()> fn);
  ~BeforeCommit();
  BeforeCommit(const BeforeCommit&) = delete;
  BeforeCommit& operator=(const BeforeCommit&) = delete;

 private:
  std::function<void()> fn_;
  BeforeCommit* previous_;
  friend void before_commit();
};

/// Calls the innermost BeforeCommit's function on this thread, if any (what
/// memfit's optimizers call between their phases).
///
/// Example:
/// \code
///   memfit::optim::before_commit();  // no guard: nothing happens
/// \endcode
void before_commit();

/// Bytes of the state that `optimizer`'s next step will create: for SGD
/// (with momentum), Adam and AdamW, LibTorch's or memfit's, the state of each
/// parameter that has none yet (a momentum buffer; two moments, three with
/// amsgrad); 0 for other optimizers, whose state memfit does not know.
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);  // 10 parameters
///   memfit::optim::Adam adam(lin->parameters());
///   assert(memfit::optim::lazy_state_bytes(adam) == 2 * 10 * 4);
/// \endcode
int64_t lazy_state_bytes(const torch::optim::Optimizer& optimizer);

} // namespace optim
} // namespace memfit
