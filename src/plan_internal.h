#pragma once
// What the two planners share: plan.cpp's StepModel (a Sequential
// classifier) and module_plan.cpp's ModuleStepModel (any module).

#include "memfit/compat.h"
#include "memfit/memory.h"

#include <torch/nn/module.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

namespace memfit {
namespace detail {

// v(m) on the line through (b_small, small) and (b_large, large); when that
// line would cross zero above m = 0 or fall (timing noise), the line through
// 0 and (b_large, large) instead, so small batches never look free.
inline double line(double small, double large, int64_t b_small, int64_t b_large, int64_t m) {
  const double slope = (large - small) / double(b_large - b_small);
  const double intercept = small - slope * double(b_small);
  if (intercept < 0 || slope < 0) return std::max(0.0, large) * double(m) / double(b_large);
  return intercept + slope * double(m);
}

// The largest b in [1, top] with fits(b), for fits monotone (true up to
// some b, false above); 0 when fits(1) is false.
inline int64_t largest_fitting(int64_t top, const std::function<bool(int64_t)>& fits) {
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = top;
  if (fits(hi)) return hi;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

// A module's parameters, buffers and gradients and the CPU RNG, copied to
// the host and put back on destruction: planning trains the module itself.
class ModuleStateGuard {
 public:
  explicit ModuleStateGuard(const torch::nn::Module& module) {
    tensors_ = module.parameters();
    const auto buffers = module.buffers();
    tensors_.insert(tensors_.end(), buffers.begin(), buffers.end());
    UntrackedGuard host;
    for (const auto& t : tensors_) {
      saved_.push_back(t.detach().clone());
      grads_.push_back(t.grad());
    }
    rng_ = compat::get_rng_state({});
  }
  ~ModuleStateGuard() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      tensors_[i].copy_(saved_[i]);
      tensors_[i].mutable_grad() = grads_[i];
    }
    compat::set_rng_state(rng_);
  }
  ModuleStateGuard(const ModuleStateGuard&) = delete;
  ModuleStateGuard& operator=(const ModuleStateGuard&) = delete;

 private:
  std::vector<torch::Tensor> tensors_, saved_, grads_;
  compat::RngState rng_;
};

} // namespace detail
} // namespace memfit
