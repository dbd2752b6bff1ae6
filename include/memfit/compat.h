#pragma once
/// \file compat.h
/// Every difference between LibTorch versions, and between CPU and CUDA builds,
/// lives here and nowhere else (internal; included by memfit's sources).
///
/// MEMFIT_WITH_CUDA is defined by the build when LibTorch has CUDA. Code that
/// names a CUDA symbol is guarded by it, so the CPU build (Debian's LibTorch
/// 1.13) compiles; the guarded branches are written against LibTorch 1.13 and
/// 2.x, whose CUDA caching-allocator functions keep the same names.

#include <torch/version.h>

#include <ATen/autocast_mode.h>
#include <c10/core/Device.h>

#include <cstdint>

#if defined(MEMFIT_WITH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

/// True when the LibTorch being compiled against is at least major.minor.
#define MEMFIT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

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
inline void cuda_reset_peak(c10::DeviceIndex device) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(device);
}
inline void cuda_empty_cache() {
  c10::cuda::CUDACachingAllocator::emptyCache();
}
inline int64_t cuda_total_memory(c10::DeviceIndex device) {
  return static_cast<int64_t>(
      at::cuda::getDeviceProperties(device)->totalGlobalMem);
}
inline void cuda_set_memory_fraction(double fraction, c10::DeviceIndex device) {
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, device);
}
#endif

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

} // namespace compat
} // namespace memfit
