#pragma once
/// \file compat.h
/// Every difference between LibTorch versions, and between CPU and CUDA builds,
/// lives here and nowhere else (internal: not installed; included by memfit's
/// sources, its tests, benchmarks and CLI).
///
/// MEMFIT_WITH_CUDA is defined by the build when LibTorch has CUDA. Code that
/// names a CUDA symbol is guarded by it, so the CPU build (Debian's LibTorch
/// 1.13) compiles; the guarded branches are written against LibTorch 1.13 and
/// 2.x, whose CUDA caching-allocator functions keep the same names.

#include "memfit/precision.h"

#include <torch/version.h>

#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <cstdint>
#include <cstring>

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#endif

#if defined(MEMFIT_WITH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#if defined(MEMFIT_WITH_DISTRIBUTED)
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif
#endif

/// True when the LibTorch being compiled against is at least major.minor.
#define MEMFIT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

/// Declares a c10::Allocator subclass's allocate and copy_data for every
/// LibTorch version. allocate is `const` in 1.x and early 2.x and not `const`
/// later; copy_data became pure virtual in 2.x. Both overloads of allocate are
/// declared (whichever the base has is overridden, the other is an ordinary
/// member), so no version number has to be guessed. `impl` is a const member
/// function `c10::DataPtr impl(size_t) const` of the subclass.
#define MEMFIT_ALLOCATOR_METHODS(impl)                                  \
  c10::DataPtr allocate(size_t n) const { return impl(n); }             \
  c10::DataPtr allocate(size_t n) { return impl(n); }                   \
  void copy_data(void* dest, const void* src, std::size_t count) const { \
    if (count > 0) std::memcpy(dest, src, count);                       \
  }

namespace memfit {
namespace compat {

/// True when this build of memfit was compiled with CUDA support.
constexpr bool kBuiltWithCuda =
#if defined(MEMFIT_WITH_CUDA)
    true;
#else
    false;
#endif

#if defined(MEMFIT_WITH_CUDA)
// Index of the aggregate pool in the caching allocator's Stat arrays. The enum
// moved namespaces between versions (c10::cuda::CUDACachingAllocator::StatType
// in 1.13, c10::CachingAllocator / c10::CachingDeviceAllocator in 2.x); its
// AGGREGATE value is 0 in all of them.
constexpr std::size_t kAggregatePool = 0;

inline int64_t cuda_allocated_bytes(c10::DeviceIndex device) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(device)
      .allocated_bytes[kAggregatePool]
      .current;
}
inline int64_t cuda_peak_allocated_bytes(c10::DeviceIndex device) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(device)
      .allocated_bytes[kAggregatePool]
      .peak;
}
inline int64_t cuda_peak_reserved_bytes(c10::DeviceIndex device) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(device)
      .reserved_bytes[kAggregatePool]
      .peak;
}
inline void cuda_reset_peak(c10::DeviceIndex device) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(device);
}
inline void cuda_empty_cache() {
  c10::cuda::CUDACachingAllocator::emptyCache();
}
/// Frees the cuBLAS workspaces (ATen keeps one per handle and stream, from
/// the first cuBLAS call on); the next call allocates them again. Waits for
/// the device first, so no kernel is still using them.
inline void cuda_clear_blas_workspaces() {
  c10::cuda::device_synchronize();
  at::cuda::clearCublasWorkspaces();
}
inline int64_t cuda_total_memory(c10::DeviceIndex device) {
  return static_cast<int64_t>(
      at::cuda::getDeviceProperties(device)->totalGlobalMem);
}
inline void cuda_set_memory_fraction(double fraction, c10::DeviceIndex device) {
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, device);
}
/// Segments that grow page by page (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True),
/// for the segments made from now on: reserved bytes then follow allocated
/// ones within 2 MiB pages, not whole cached segments.
inline void cuda_use_expandable_segments() {
#if MEMFIT_TORCH_AT_LEAST(2, 1)  // setAllocatorSettings came with PyTorch 2.1
  c10::cuda::CUDACachingAllocator::setAllocatorSettings("expandable_segments:True");
#endif
}
#endif

/// Whether CUDA device `device` computes in bfloat16 natively (compute capability 8.0+).
inline bool cuda_supports_bf16(c10::DeviceIndex device) {
#if defined(MEMFIT_WITH_CUDA)
  return at::cuda::getDeviceProperties(device)->major >= 8;
#else
  (void)device;
  return false;
#endif
}

/// Whether CPU autocast can compute in float16 (LibTorch 2.4 and later; 1.13's
/// CPU autocast knows bfloat16 only).
constexpr bool kCpuAutocastHalf = MEMFIT_TORCH_AT_LEAST(2, 4);

/// Turns CPU autocast on or off (1.13: set_cpu_enabled; 2.4+: device-typed).
inline void set_cpu_autocast_enabled(bool enabled) {
#if MEMFIT_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(at::kCPU, enabled);
#else
  at::autocast::set_cpu_enabled(enabled);
#endif
}

/// Whether CPU autocast is on.
inline bool is_cpu_autocast_enabled() {
#if MEMFIT_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(at::kCPU);
#else
  return at::autocast::is_cpu_enabled();
#endif
}

/// The autocast state of a thread (memfit::AutocastState, in precision.h).
using AutocastState = ::memfit::AutocastState;

/// Reads this thread's autocast state.
inline AutocastState get_autocast_state() {
  AutocastState s;
#if MEMFIT_TORCH_AT_LEAST(2, 4)
  s.cpu_enabled = at::autocast::is_autocast_enabled(at::kCPU);
  s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  s.cuda_enabled = at::autocast::is_autocast_enabled(at::kCUDA);
  s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
#else
  s.cpu_enabled = at::autocast::is_cpu_enabled();
  s.cpu_dtype = at::autocast::get_autocast_cpu_dtype();
  s.cuda_enabled = at::autocast::is_enabled();
  s.cuda_dtype = at::autocast::get_autocast_gpu_dtype();
#endif
  return s;
}

/// Sets this thread's autocast state.
inline void set_autocast_state(const AutocastState& s) {
#if MEMFIT_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(at::kCPU, s.cpu_enabled);
  at::autocast::set_autocast_dtype(at::kCPU, s.cpu_dtype);
  at::autocast::set_autocast_enabled(at::kCUDA, s.cuda_enabled);
  at::autocast::set_autocast_dtype(at::kCUDA, s.cuda_dtype);
#else
  at::autocast::set_cpu_enabled(s.cpu_enabled);
  at::autocast::set_autocast_cpu_dtype(s.cpu_dtype);
  at::autocast::set_enabled(s.cuda_enabled);
  at::autocast::set_autocast_gpu_dtype(s.cuda_dtype);
#endif
}

/// Enters an autocast region in state `next`, as torch.autocast.__enter__
/// does (the nesting count goes up); returns the state to restore on exit.
inline AutocastState enter_autocast(const AutocastState& next) {
  const AutocastState prev = get_autocast_state();
  set_autocast_state(next);
  at::autocast::increment_nesting();
  return prev;
}

/// Leaves a region entered with enter_autocast, as torch.autocast.__exit__
/// does: the outermost exit clears the cache of casted weights, then the
/// saved state is restored.
inline void exit_autocast(const AutocastState& prev) {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_autocast_state(prev);
}

/// Random-number-generator states: the default CPU generator and, on CUDA
/// builds, the default generator of each listed CUDA device.
struct RngState {
  at::Tensor cpu;
  std::vector<std::pair<c10::DeviceIndex, at::Tensor>> cuda;
};

/// Saves the CPU generator's state and that of the CUDA devices given.
inline RngState get_rng_state(const std::vector<c10::DeviceIndex>& cuda_devices) {
  RngState s;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.cpu = gen.get_state();
  }
#if defined(MEMFIT_WITH_CUDA)
  for (auto d : cuda_devices) {
    auto gen = at::cuda::detail::getDefaultCUDAGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.cuda.emplace_back(d, gen.get_state());
  }
#else
  (void)cuda_devices;
#endif
  return s;
}

/// Restores states saved by get_rng_state.
inline void set_rng_state(const RngState& s) {
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(s.cpu);
  }
#if defined(MEMFIT_WITH_CUDA)
  for (const auto& kv : s.cuda) {
    auto gen = at::cuda::detail::getDefaultCUDAGenerator(kv.first);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(kv.second);
  }
#endif
}

/// Drops autocast's cache of casted weights (as leaving the outermost
/// autocast region does).
inline void clear_autocast_cache() { at::autocast::clear_cache(); }

/// An exception's message without a C++ backtrace: LibTorch 2's c10::Error
/// appends one to what() (and the TorchScript interpreter's errors carry it).
inline std::string message_of(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error != nullptr ? error->what_without_backtrace() : e.what();
}

/// The first line of a message (c10 appends context on later lines).
inline std::string first_line(const std::string& message) { return message.substr(0, message.find('\n')); }

/// The key of parameter `p` in torch::optim::Optimizer::state(): the
/// TensorImpl's address as a string in LibTorch 1.x, the address itself in 2.x.
template <typename Optimizer = torch::optim::Optimizer>
auto optimizer_state_key(const at::Tensor& p) {
  using Key = typename std::decay_t<decltype(std::declval<Optimizer&>().state())>::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    // What c10::guts::to_string (gone from LibTorch 2.x) wrote: operator<<.
    std::ostringstream key;
    key << p.unsafeGetTensorImpl();
    return key.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

#if defined(MEMFIT_WITH_DISTRIBUTED)
/// The base class of c10d's Gloo and NCCL process groups, whose virtual
/// collectives memfit calls: c10d::ProcessGroup in 1.x, c10d::Backend in 2.x.
#if TORCH_VERSION_MAJOR >= 2
using C10dBackend = c10d::Backend;
#else
using C10dBackend = c10d::ProcessGroup;
#endif
#endif

/// What autograd hands out for a node such as a parameter's gradient
/// accumulator: std::shared_ptr in LibTorch 1.x and early 2.x,
/// c10::intrusive_ptr in 2.15.
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

/// Keeps `node` alive as long as the returned handle, whose type is the same
/// in every LibTorch (for members of public headers). Autograd holds a
/// parameter's accumulator weakly; hooks on it live only while someone holds it.
inline std::shared_ptr<void> hold_node(NodePtr node) {
  auto* raw = node.get();
  return std::shared_ptr<void>(raw, [held = std::move(node)](void*) mutable { held = nullptr; });
}

/// True where LibTorch has fused Adam, AdamW and SGD kernels for the CPU and
/// CUDA (at::_fused_adam_, _fused_adamw_, _fused_sgd_; the CPU ones came with 2.4).
constexpr bool kHasFusedOptimizers = MEMFIT_TORCH_AT_LEAST(2, 4);

/// at::_fused_adam_ (AdamW's decay when `decoupled`) over one device and
/// dtype; `steps` hold each parameter's step count after this step, as
/// float32 on the parameters' device, and are only read. A defined
/// `grad_scale` (one float32 element on that device) divides the gradients
/// inside the kernel, as PyTorch's fused optimizers take GradScaler's scale;
/// a defined `found_inf` (one float32 element there) skips the update where
/// it is 1, read by the kernel itself. Where kHasFusedOptimizers is false it
/// is never called.
inline void fused_adam_(bool decoupled, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr,
                        double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                        const at::Tensor& grad_scale, const at::Tensor& found_inf) {
#if MEMFIT_TORCH_AT_LEAST(2, 4)
  const auto scale = grad_scale.defined() ? std::optional<at::Tensor>(grad_scale) : std::nullopt;
  const auto found = found_inf.defined() ? std::optional<at::Tensor>(found_inf) : std::nullopt;
  if (decoupled) {
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay,
                      eps, amsgrad, /*maximize=*/false, scale, found);
  } else {
    at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay,
                     eps, amsgrad, /*maximize=*/false, scale, found);
  }
#else
  (void)decoupled, (void)params, (void)grads, (void)exp_avgs, (void)exp_avg_sqs, (void)max_exp_avg_sqs, (void)steps;
  (void)lr, (void)beta1, (void)beta2, (void)weight_decay, (void)eps, (void)amsgrad, (void)grad_scale, (void)found_inf;
  TORCH_INTERNAL_ASSERT(false, "fused optimizer kernels need LibTorch 2.4 or later");
#endif
}

/// Adds `delta` (a one-element tensor on the steps' device) times `alpha` to
/// each of `steps` in place, reading it on the device (at::_foreach_add_'s
/// tensor overload, which 1.13 lacks; only the fused path calls it).
inline void add_to_steps(at::TensorList steps, const at::Tensor& delta, double alpha) {
#if MEMFIT_TORCH_AT_LEAST(2, 4)
  at::_foreach_add_(steps, delta, alpha);
#else
  (void)steps, (void)delta, (void)alpha;
  TORCH_INTERNAL_ASSERT(false, "fused optimizer kernels need LibTorch 2.4 or later");
#endif
}

/// at::_fused_sgd_ over one device and dtype; `is_first_step` fills the
/// (empty) momentum buffers with the first gradient, as LibTorch's SGD does;
/// a defined `grad_scale` divides the gradients inside the kernel, and a
/// defined `found_inf` skips the update where it is 1.
inline void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                       double weight_decay, double momentum, double lr, double dampening, bool nesterov,
                       bool is_first_step, const at::Tensor& grad_scale, const at::Tensor& found_inf) {
#if MEMFIT_TORCH_AT_LEAST(2, 4)
  const auto scale = grad_scale.defined() ? std::optional<at::Tensor>(grad_scale) : std::nullopt;
  const auto found = found_inf.defined() ? std::optional<at::Tensor>(found_inf) : std::nullopt;
  at::_fused_sgd_(params, grads, momentum_buffers, weight_decay, momentum, lr, dampening, nesterov,
                  /*maximize=*/false, is_first_step, scale, found);
#else
  (void)params, (void)grads, (void)momentum_buffers, (void)weight_decay, (void)momentum, (void)lr;
  (void)dampening, (void)nesterov, (void)is_first_step, (void)grad_scale, (void)found_inf;
  TORCH_INTERNAL_ASSERT(false, "fused optimizer kernels need LibTorch 2.4 or later");
#endif
}

/// Collects the messages of c10 warnings (TORCH_WARN) raised on this thread
/// while it is installed; the handler's signature changed in LibTorch 2.0.
class WarningCapture : public c10::WarningHandler {
 public:
  WarningCapture() : guard_(this) {}
#if MEMFIT_TORCH_AT_LEAST(2, 0)
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
#else
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override {
    messages.push_back(msg);
  }
#endif
  /// The messages, oldest first.
  std::vector<std::string> messages;

 private:
#if MEMFIT_TORCH_AT_LEAST(2, 0)
  c10::WarningUtils::WarningHandlerGuard guard_;
#else
  c10::Warning::WarningHandlerGuard guard_;
#endif
};

} // namespace compat
} // namespace memfit
