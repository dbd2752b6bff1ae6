// libmemfit_meter.so: memfit's byte-exact CPU allocator for another process
// that uses the same LibTorch, such as Debian's python3-torch (the same
// libc10.so and libtorch_cpu.so): loaded with ctypes, it makes the tracking
// allocator LibTorch's CPU allocator, so that Python's peaks are counted by
// the same meter as memfit's (bench/peers.py).
//
//   meter = ctypes.CDLL("build/bench/libmemfit_meter.so")
//   meter.memfit_meter_install()           # tensors allocated from now on are counted
//   meter.memfit_meter_reset_peak()
//   ...                                    # a training step
//   peak = meter.memfit_meter_peak()       # bytes

#include "memfit/memory.h"

#include <cstdint>

extern "C" {

/// Makes memfit's tracking allocator the CPU allocator; returns the bytes it counts now.
int64_t memfit_meter_install() { return memfit::memory_allocated(torch::kCPU); }

/// Bytes of CPU tensors allocated since install and not yet freed.
int64_t memfit_meter_allocated() { return memfit::memory_allocated(torch::kCPU); }

/// The largest memfit_meter_allocated() since install or the last reset.
int64_t memfit_meter_peak() { return memfit::max_memory_allocated(torch::kCPU); }

/// Starts a new peak from what is allocated now.
void memfit_meter_reset_peak() { memfit::reset_peak_memory_stats(torch::kCPU); }

}  // extern "C"
