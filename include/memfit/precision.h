#pragma once
/// \file precision.h
/// Mixed precision training: an autocast guard, a GradScaler with
/// torch.amp.GradScaler's semantics, and fp32 master weights for models whose
/// parameters are held in bfloat16 or float16.
///
/// Thread safety: autocast state is thread-local, so an AutocastGuard affects
/// only the thread that made it. A GradScaler or MasterWeights is used from one
/// thread at a time.
///
/// Sync points: GradScaler::step reads found_inf once per optimizer step (like
/// PyTorch's), and step_async only where the optimizer cannot skip inside
/// its fused kernel; get_scale() reads the scale. scale(), unscale_() and update()
/// never sync: the inf check and the scale update are tensor ops (the fused
/// `_amp_*` kernels on CUDA, ordinary ops elsewhere).
///
/// Extra memory: GradScaler holds a 4-byte scale, a 4-byte growth tracker and
/// a 4-byte found_inf per device and optimizer; unscale_() makes one bool and
/// one float scalar per gradient while it runs. MasterWeights holds an fp32
/// copy of every parameter and, at step time, its fp32 gradient, on the device
/// or (Offload::kHost) in host memory.

#include "memfit/memory.h"

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace torch {
namespace autograd {
struct Node;
} // namespace autograd
} // namespace torch

namespace memfit {

/// The precision of a training step's compute.
enum class Precision {
  kFP32,  ///< Everything in float32.
  kBF16,  ///< Autocast to bfloat16 (no loss scaling needed: bf16 has fp32's range).
  kFP16,  ///< Autocast to float16, with a GradScaler against gradient underflow.
};

/// Parses "fp32", "bf16" or "fp16" ("auto" is resolved by auto_precision).
///
/// Example:
/// \code
///   assert(memfit::parse_precision("bf16") == memfit::Precision::kBF16);
/// \endcode
Precision parse_precision(const std::string& name);

/// "fp32", "bf16" or "fp16".
std::string to_string(Precision precision);

/// The dtype that autocast computes in: kFloat, kBFloat16 or kHalf.
at::ScalarType scalar_type(Precision precision);

/// The precision `--precision auto` picks on `device`: bf16 on a CUDA device
/// that supports it (compute capability 8.0 and later), fp16 on older CUDA
/// devices, and bf16 on the CPU (it halves activation memory; on CPUs without
/// native bf16 instructions it is slower than fp32).
Precision auto_precision(const torch::Device& device);

/// Throws c10::Error unless this build of LibTorch can autocast to `precision`
/// on `device`: CPU float16 autocast needs LibTorch 2.4 or later, and CUDA
/// needs a CUDA build and device.
void check_precision_supported(Precision precision, const torch::Device& device);

/// The autocast state of a thread: what torch.autocast's context manager
/// saves and restores (the enabled flag and dtype of each device type).
struct AutocastState {
  bool cpu_enabled = false;                  ///< CPU autocast on.
  at::ScalarType cpu_dtype = at::kBFloat16;  ///< The CPU's lower-precision dtype.
  bool cuda_enabled = false;                 ///< CUDA autocast on.
  at::ScalarType cuda_dtype = at::kHalf;     ///< CUDA's lower-precision dtype.
};

/// Enables autocast on one device type for its lifetime, like Python's
/// `with torch.autocast(device_type, dtype):`.
///
/// On entry it saves this thread's autocast state (enabled flag and dtype of
/// every device type, and whether the cast cache is on), sets the new state and
/// increments the autocast nesting count; on exit it restores the saved state,
/// and the outermost guard (nesting count back to 0) clears the cache of
/// casted weights. Guards nest: an inner guard with enabled=false turns
/// autocast off inside an outer one. Thread-local.
///
/// Example:
/// \code
///   torch::Tensor y;
///   {
///     memfit::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
///     y = torch::mm(torch::ones({2, 2}), torch::ones({2, 2}));  // bfloat16
///   }
///   assert(y.scalar_type() == torch::kBFloat16);
/// \endcode
class AutocastGuard {
 public:
  /// Autocast on `device_type` (kCPU or kCUDA) to `dtype` (default: bfloat16
  /// on the CPU, float16 on CUDA). Throws c10::Error for a device type autocast
  /// does not support or a dtype check_precision_supported rejects.
  explicit AutocastGuard(c10::DeviceType device_type,
                         c10::optional<at::ScalarType> dtype = c10::nullopt,
                         bool enabled = true, bool cache_enabled = true);
  /// Autocast on `device`'s type in `precision`; kFP32 disables autocast there.
  AutocastGuard(const torch::Device& device, Precision precision);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard(AutocastGuard&&) = delete;
  AutocastGuard& operator=(AutocastGuard&&) = delete;

 private:
  AutocastState prev_;
  bool prev_cache_enabled_;
};

/// Options of a GradScaler, named and defaulted as torch.amp.GradScaler's.
struct GradScalerOptions {
  /// The scale factor to start from.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// Multiplies the scale after `growth_interval` steps in a row without inf or NaN gradients (> 1).
  TORCH_ARG(double, growth_factor) = 2.0;
  /// Multiplies the scale after a step with inf or NaN gradients (< 1).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Clean steps in a row before the scale grows (>= 1).
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// When false every method is a no-op: scale() returns its input and step() steps.
  TORCH_ARG(bool, enabled) = true;
};

/// What GradScaler::step_async did with an optimizer's step.
///
/// Where the optimizer's fused kernel decided whether to skip (on the
/// device), `found_inf` holds the decision unread: one float32 element,
/// nonzero where it skipped. Where the scaler decided on the host (LibTorch's
/// optimizers, the loop kernel, after unscale_), `found_inf` is undefined and
/// `stepped` says whether the optimizer stepped.
///
/// Example:
/// \code
///   memfit::ScaledStep r;
///   bool skipped = r.found_inf.defined() ? r.found_inf.item<double>() != 0 : !r.stepped;
/// \endcode
struct ScaledStep {
  bool stepped = false;     ///< The optimizer stepped, or was handed the decision (found_inf).
  torch::Tensor found_inf;  ///< The kernel's skip decision, unread; undefined where the host decided.
};

/// Dynamic loss scaling for float16 training, with the semantics of
/// torch.amp.GradScaler.
///
/// scale() multiplies the loss by the scale factor so that small float16
/// gradients do not flush to zero. unscale_() divides an optimizer's gradients
/// by the scale in place and records whether any holds inf or NaN. step()
/// unscales (if unscale_ was not called) and steps the optimizer only when no
/// gradient was inf or NaN. update() backs the scale off after a skipped step
/// and grows it after `growth_interval` clean steps in a row. One scaler serves
/// several optimizers; call update() once per iteration after all step()s.
///
/// Example:
/// \code
///   auto model = torch::nn::Linear(4, 1);
///   torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
///   memfit::GradScaler scaler(memfit::GradScalerOptions().init_scale(1024.));
///   auto loss = model->forward(torch::ones({2, 4})).sum();
///   scaler.scale(loss).backward();
///   scaler.unscale_(opt);  // gradients are now unscaled: clip them here
///   torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
///   scaler.step(opt);
///   scaler.update();
/// \endcode
class GradScaler {
 public:
  /// Checks the options; the scale tensor is made on the device of the first scaled loss.
  explicit GradScaler(GradScalerOptions options = {});
  ~GradScaler();
  GradScaler(GradScaler&&) noexcept;
  GradScaler& operator=(GradScaler&&) noexcept;
  GradScaler(const GradScaler&) = delete;
  GradScaler& operator=(const GradScaler&) = delete;

  /// `outputs` times the scale factor (in outputs' dtype); `outputs` itself when disabled.
  torch::Tensor scale(const torch::Tensor& outputs);
  /// Each tensor times the scale factor.
  std::vector<torch::Tensor> scale(const std::vector<torch::Tensor>& outputs);

  /// Divides the gradients of `optimizer`'s parameters by the scale in place
  /// and records inf or NaN among them. At most once per optimizer between
  /// update()s, and not after step(). float16 gradients are rejected, as in
  /// PyTorch (keep fp32 master gradients; see MasterWeights).
  void unscale_(torch::optim::Optimizer& optimizer);

  /// Unscales `optimizer`'s gradients unless unscale_ was called, then steps it
  /// unless a gradient holds inf or NaN. Returns whether it stepped. Reads
  /// found_inf: one sync per call. A memfit::optim optimizer whose parameters
  /// all take the fused kernel (can_unscale_in_kernel) divides the scale out
  /// inside its kernel instead (step_unscaling), as PyTorch's fused
  /// optimizers do: the gradients are only checked, not rewritten.
  bool step(torch::optim::Optimizer& optimizer);

  /// step() without its read where the optimizer can skip inside its fused
  /// kernel (can_unscale_in_kernel, and unscale_ not called): the kernel gets
  /// the scale and found_inf and skips itself where found_inf is 1, as
  /// PyTorch's fused optimizers do, and the decision comes back unread.
  /// Elsewhere it decides on the host as step() does (one sync). No sync
  /// points on the fused path; extra memory: none for one device (found_inf
  /// is the inf check's own), one float per optimizer for several.
  ///
  /// Example:
  /// \code
  ///   auto lin = torch::nn::Linear(4, 2);
  ///   memfit::optim::Adam adam(lin->parameters());
  ///   memfit::GradScaler scaler;
  ///   scaler.scale(lin(torch::ones({3, 4})).sum()).backward();
  ///   const auto r = scaler.step_async(adam);  // fused (LibTorch 2.4+): nothing read yet
  ///   scaler.update();
  /// \endcode
  ScaledStep step_async(torch::optim::Optimizer& optimizer);

  /// Updates the scale from the inf checks of every optimizer stepped since
  /// the last update, and forgets them.
  void update();
  /// Sets the scale to `new_scale` and forgets the inf checks.
  void update(double new_scale);
  /// Sets the scale to a one-element float32 tensor's value and forgets the inf checks.
  void update(const torch::Tensor& new_scale);

  /// Forgets the unscaling and inf checks made since the last update(),
  /// keeping the scale and growth tracker: for a step that threw before its
  /// update (the Trainer's transaction), so that the retried step unscales
  /// again. No sync points.
  ///
  /// Example:
  /// \code
  ///   memfit::GradScaler scaler;
  ///   scaler.discard_step();  // nothing recorded yet: a no-op
  /// \endcode
  void discard_step() { per_optimizer_.clear(); }

  /// The current scale (init_scale before the first scale()); 1.0 when
  /// disabled. Reads the scale tensor: a sync on CUDA.
  double get_scale() const;
  /// The scale tensor itself (undefined before the first scale()).
  const torch::Tensor& scale_tensor() const { return scale_; }
  /// Whether the scaler is enabled.
  bool is_enabled() const { return options_.enabled(); }
  /// Clean steps counted towards the next growth.
  int64_t growth_tracker() const;

  double get_growth_factor() const { return options_.growth_factor(); }
  void set_growth_factor(double v);
  double get_backoff_factor() const { return options_.backoff_factor(); }
  void set_backoff_factor(double v);
  int64_t get_growth_interval() const { return options_.growth_interval(); }
  void set_growth_interval(int64_t v);

  /// Writes scale, growth_factor, backoff_factor, growth_interval and
  /// growth_tracker (PyTorch's state_dict keys) under the archive.
  void save(torch::serialize::OutputArchive& archive) const;
  /// Reads what save() wrote; throws c10::Error for an archive without it or
  /// when this scaler is disabled.
  void load(torch::serialize::InputArchive& archive);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerState {
    Stage stage = Stage::kReady;
    std::vector<torch::Tensor> found_inf_per_device;
  };
  void lazy_init(const torch::Device& device);
  // Records inf and NaN among the gradients per device and, with `unscale`,
  // multiplies them by inv_scale.
  std::vector<torch::Tensor> unscale_grads(torch::optim::Optimizer& optimizer,
                                           const torch::Tensor& inv_scale, bool unscale = true);

  GradScalerOptions options_;
  torch::Tensor scale_;           // float32, one element, on the device of the first loss
  torch::Tensor growth_tracker_;  // int32, one element
  int64_t loaded_tracker_ = 0;    // tracker before lazy init
  std::unordered_map<const torch::optim::Optimizer*, OptimizerState> per_optimizer_;
};

/// Options of MasterWeights.
struct MasterWeightsOptions {
  /// The dtype the model's parameters are held in: kBFloat16 or kHalf; or
  /// kFloat with Offload::kHost, which keeps fp32 parameters and only moves
  /// the masters, their gradients and the optimizer state to the host
  /// (ZeRO-Offload of an fp32 model).
  TORCH_ARG(at::ScalarType, dtype) = at::kBFloat16;
  /// Where the fp32 master copies, their gradients and hence the optimizer
  /// state live: with the parameters, or in host memory (the optimizer then
  /// steps on the host, ZeRO-Offload style).
  TORCH_ARG(Offload, offload) = Offload::kNone;
  /// Where the model's gradients go during backward (with offload kHost only):
  /// Offload::kHost adds each parameter's gradient into its host master's
  /// gradient as soon as autograd has accumulated it, and releases it on the
  /// device (ZeRO-Offload's gradient offload), so the device holds about one
  /// parameter's gradient at a time instead of all of them, also across
  /// micro-batches, which accumulate on the host. grads_to_master() then has
  /// nothing left to move. Sync points: one device-to-host copy per parameter
  /// and backward (none on the CPU build, where the host copy is an untracked
  /// one). Hooks on the parameters' gradient accumulators do it: they are lost
  /// if a parameter changes dtype or device afterwards (module->to()).
  TORCH_ARG(Offload, gradients) = Offload::kNone;
  /// Where the model's parameters live between uses (float32 dtype, with
  /// offload and gradients kHost only): Offload::kHost releases each
  /// parameter's device memory once its host master is made (the parameter
  /// keeps its shape but shares one element of storage, reading as zeros),
  /// and a ParameterStream (stream.h) brings each layer's parameters back
  /// while it runs (ZeRO-Infinity's parameter offload, FSDP's CPU offload).
  /// master_to_model() then copies nothing; the destructor gives each
  /// parameter its master's storage: the trained model is whole again, in
  /// host memory (move it with ->to(device)). Streamed on the CPU, where the
  /// host is the device, it gives each parameter a copy in the memory
  /// memory_allocated() counts instead, as the model held them (the masters'
  /// storage where a budget refuses that).
  TORCH_ARG(Offload, parameters) = Offload::kNone;
  /// Streamed parameters: the device they are fetched to (nullopt: the one
  /// they are on). A model built in host memory then never lands on the
  /// device whole: each parameter goes from where it was built to its host
  /// master, and its one-element placeholder (not counted by the CPU
  /// tracking allocator) lives on this device.
  TORCH_ARG(c10::optional<torch::Device>, stream_to) = c10::nullopt;
};

namespace detail {
// Adds `g` into rows [begin, begin + g.size(0)) of `master`'s host gradient
// (all of it when g has master's shape), allocating that gradient (pinned
// when g is on CUDA) when it has none; `copy`: the rows hold nothing of this
// step yet, so g is copied rather than added. Gradient offload and streamed
// Linear tiles both land here.
void add_to_host_grad(const torch::Tensor& master, const torch::Tensor& g, int64_t begin = 0, bool copy = false);
} // namespace detail

/// Holds a model's parameters in bfloat16 or float16 with float32 master
/// copies that the optimizer updates, as in mixed precision training
/// (Micikevicius et al. 2018).
///
/// The constructor copies each parameter to an fp32 master and then casts the
/// parameter itself to the low dtype (the same tensor object, so modules see
/// it). Build the optimizer over master_parameters(). Each step:
/// backward on the model, grads_to_master() (fp32 gradients onto the masters,
/// the model's low-precision gradients released), unscale/clip/step the
/// optimizer, then master_to_model() (the updated masters cast back).
/// Buffers (BatchNorm statistics) are left in their dtype.
///
/// Memory: parameters and their gradients on the device take 2 bytes per
/// element instead of 4; the masters take 4 bytes per element and, while the
/// optimizer steps, so do their gradients: on the device (Offload::kNone) or in
/// host memory (Offload::kHost).
///
/// Example:
/// \code
///   auto model = torch::nn::Linear(4, 2);
///   memfit::MasterWeights master(model->parameters());
///   torch::optim::SGD opt(master.master_parameters(), torch::optim::SGDOptions(0.1));
///   memfit::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
///   model->forward(torch::ones({3, 4})).sum().backward();
///   master.grads_to_master();
///   opt.step();
///   master.master_to_model();
///   assert(model->weight.scalar_type() == torch::kBFloat16);
/// \endcode
class MasterWeights {
 public:
  /// Makes fp32 masters of `params` (all fp32) and casts them to options.dtype().
  explicit MasterWeights(std::vector<torch::Tensor> params, MasterWeightsOptions options = {});
  /// Over `module`'s parameters, except that those of normalization layers
  /// (BatchNorm, InstanceNorm, LayerNorm, GroupNorm) stay fp32, as apex's O2
  /// keep_batchnorm_fp32 does: their kernels need weights in the dtype of their
  /// fp32 running statistics. Kept parameters are their own masters (or, with
  /// Offload::kHost, have host masters like the others).
  explicit MasterWeights(torch::nn::Module& module, MasterWeightsOptions options = {});
  ~MasterWeights();
  MasterWeights(MasterWeights&&) noexcept;
  MasterWeights& operator=(MasterWeights&&) noexcept;
  MasterWeights(const MasterWeights&) = delete;
  MasterWeights& operator=(const MasterWeights&) = delete;

  /// The fp32 masters, in the order of the model's parameters: build the optimizer over these.
  const std::vector<torch::Tensor>& master_parameters() const { return masters_; }
  /// The model's (low-precision) parameters.
  const std::vector<torch::Tensor>& model_parameters() const { return params_; }
  /// Sets each master's gradient to its parameter's gradient in fp32 (none
  /// where the parameter has none) and releases the parameter's gradient.
  /// With options().gradients() kHost the masters already hold them: nothing to do.
  void grads_to_master();
  /// Copies every master into its parameter, cast to the low dtype, and
  /// releases the masters' gradients.
  void master_to_model();
  /// The options, as checked.
  const MasterWeightsOptions& options() const { return options_; }
  /// Whether parameter i is held in the low dtype (false: kept in fp32).
  bool is_cast(size_t i) const { return cast_.at(i); }
  /// Whether the parameters are released between uses (options().parameters() kHost).
  bool streamed() const { return options_.parameters() == Offload::kHost; }
  /// A fresh device copy of rows [begin, begin + rows) of master i (dimension
  /// 0; rows -1: all of it), in its parameter's dtype and on its device:
  /// what a streamed layer computes with.
  torch::Tensor fetch(size_t i, int64_t begin = 0, int64_t rows = -1) const;
  /// Streamed parameters: points parameter i at `data` (a fetch()) while its
  /// layer runs, or, with an undefined `data`, releases it again.
  void set_parameter_data(size_t i, const torch::Tensor& data);
  /// The index of `param` among model_parameters(), or -1.
  int64_t index_of(const torch::Tensor& param) const;

 private:
  void init();

  std::vector<torch::Tensor> params_;
  std::vector<bool> cast_;
  std::vector<torch::Tensor> masters_;
  std::vector<torch::Tensor> released_;  // streamed: what each parameter holds between uses
  MasterWeightsOptions options_;
  // Gradient offload: the accumulators (autograd holds them weakly; held
  // through compat::hold_node) and their hooks.
  std::vector<std::shared_ptr<void>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
};

} // namespace memfit
