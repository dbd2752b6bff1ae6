#pragma once
// Internal hooks of the tracking allocator, for benchmarks that compare it
// with LibTorch's default allocator side by side. Not installed.

#include <torch/optim/optimizer.h>

#include <functional>

namespace memfit {
namespace detail {
/// Calls `fn` on each defined tensor of an optimizer's per-parameter state
/// (SGD, Adam, AdamW, Adagrad, RMSprop, LBFGS), which it may replace.
void for_each_state_tensor(torch::optim::OptimizerParamState& state,
                           const std::function<void(torch::Tensor&)>& fn);
/// Makes memfit's tracking allocator LibTorch's CPU allocator (again).
void install_tracking_allocator();
/// Makes LibTorch's default CPU allocator current; tracked storages still
/// free through their own deleter, so counts stay right.
void install_default_allocator();
} // namespace detail
} // namespace memfit
