#pragma once
// Internal hooks of the tracking allocator, for benchmarks that compare it
// with LibTorch's default allocator side by side. Not installed.

#include "memfit/memory.h"

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <string>

namespace memfit {
namespace detail {
/// Calls `fn` on each defined tensor of an optimizer's per-parameter state
/// (SGD, Adam, AdamW, Adagrad, RMSprop, LBFGS), which it may replace.
void for_each_state_tensor(torch::optim::OptimizerParamState& state,
                           const std::function<void(torch::Tensor&)>& fn);
/// The bytes an out-of-memory message says were asked for ("Tried to
/// allocate 20.00 MiB", CUDA's wording and memfit's), rounded as printed;
/// 0 where it does not say.
int64_t refused_request_bytes(const std::string& what);
/// What a metered scope that ran out of memory (`what`, the error's message)
/// asked for: PeakMeter::needed, or on CUDA the peak plus the request.
int64_t needed_bytes(const PeakMeter& meter, const std::string& what);
/// Makes memfit's tracking allocator LibTorch's CPU allocator (again).
void install_tracking_allocator();
/// Makes LibTorch's default CPU allocator current; tracked storages still
/// free through their own deleter, so counts stay right.
void install_default_allocator();
} // namespace detail
} // namespace memfit
