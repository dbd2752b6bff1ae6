// The optimizer step alone, C++ sides, as a shared library for Python
// (bench/optim_step.py), which times PyTorch's own optimizers beside them in
// one process: one LibTorch, one thread pool, the same parameter shapes.
//
// Sides: "libtorch" (torch::optim, what a C++ user has), "loop" and "fused"
// (memfit::optim's kernels), and "foreach" (LibTorch's _foreach_* Adam as
// PyTorch's foreach=True writes it: the measurement behind optim.h's choice
// not to use it on the CPU).
#include "memfit/memory.h"
#include "memfit/optim.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace {

std::string last_error;

struct Side {
  std::string kernel;
  std::vector<torch::Tensor> params, exp_avgs, exp_avg_sqs;  // exp_*: the foreach side's own state
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  int64_t step = 0;
};

std::vector<std::unique_ptr<Side>> sides;

// LibTorch's Adam (no decay, no amsgrad) with _foreach_* operations, as
// PyTorch's torch.optim.Adam(foreach=True) runs it.
void foreach_adam(Side& s, double lr, double beta1, double beta2, double eps) {
  torch::NoGradGuard no_grad;
  ++s.step;
  std::vector<torch::Tensor> grads;
  for (const auto& p : s.params) grads.push_back(p.grad());
  at::_foreach_mul_(s.exp_avgs, beta1);
  at::_foreach_add_(s.exp_avgs, grads, 1 - beta1);
  at::_foreach_mul_(s.exp_avg_sqs, beta2);
  at::_foreach_addcmul_(s.exp_avg_sqs, grads, grads, 1 - beta2);
  const double bias1 = 1 - std::pow(beta1, s.step), bias2 = 1 - std::pow(beta2, s.step);
  auto denom = at::_foreach_sqrt(s.exp_avg_sqs);
  at::_foreach_div_(denom, std::sqrt(bias2));
  at::_foreach_add_(denom, eps);
  at::_foreach_addcdiv_(s.params, s.exp_avgs, denom, -lr / bias1);
}

}  // namespace

extern "C" {

/// The text of the last failure.
const char* memfit_optim_error() { return last_error.c_str(); }

/// Adds a side: `optimizer` "adam" or "sgd" (momentum 0.9), `kernel`
/// "libtorch", "loop", "fused" or "foreach" (Adam only), over `n` parameters
/// whose shapes are `dims[i]` sizes each in `sizes`, seeded, each with a
/// seeded gradient. Returns the side's index, or -1.
int memfit_optim_add_side(const char* optimizer, const char* kernel, const int64_t* sizes, const int* dims, int n) {
  try {
    auto s = std::make_unique<Side>();
    s->kernel = kernel;
    const std::string opt = optimizer;
    torch::manual_seed(0);
    for (int i = 0, at = 0; i < n; at += dims[i], ++i) {
      auto p = torch::randn(torch::IntArrayRef(sizes + at, size_t(dims[i]))).requires_grad_();
      p.mutable_grad() = torch::randn_like(p);
      s->params.push_back(p);
    }
    const auto adam = torch::optim::AdamOptions(1e-3);
    const auto sgd = torch::optim::SGDOptions(1e-2).momentum(0.9);
    TORCH_CHECK(opt == "adam" || opt == "sgd", "optimizer adam or sgd, got ", opt);
    if (s->kernel == "libtorch") {
      if (opt == "adam") s->optimizer = std::make_unique<torch::optim::Adam>(s->params, adam);
      else s->optimizer = std::make_unique<torch::optim::SGD>(s->params, sgd);
    } else if (s->kernel == "foreach") {
      TORCH_CHECK(opt == "adam", "the foreach side is Adam only");
      for (const auto& p : s->params) {
        s->exp_avgs.push_back(torch::zeros_like(p));
        s->exp_avg_sqs.push_back(torch::zeros_like(p));
      }
    } else {
      const auto k = memfit::optim::parse_kernel(s->kernel);
      if (opt == "adam") s->optimizer = std::make_unique<memfit::optim::Adam>(s->params, adam, k);
      else s->optimizer = std::make_unique<memfit::optim::SGD>(s->params, sgd, k);
    }
    sides.push_back(std::move(s));
    return int(sides.size()) - 1;
  } catch (const std::exception& e) {
    last_error = e.what();
    return -1;
  }
}

/// Runs `steps` steps of side `index`; returns their seconds, or -1.
double memfit_optim_steps(int index, int64_t steps) {
  try {
    auto& s = *sides.at(size_t(index));
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < steps; ++i) {
      if (s.optimizer) s.optimizer->step();
      else foreach_adam(s, 1e-3, 0.9, 0.999, 1e-8);
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } catch (const std::exception& e) {
    last_error = e.what();
    return -1;
  }
}

/// memfit's meter, which is LibTorch's CPU allocator once the library is
/// used: bytes allocated now, the peak since the last reset, and a reset.
int64_t memfit_optim_allocated() { return memfit::memory_allocated(torch::kCPU); }
int64_t memfit_optim_peak() { return memfit::max_memory_allocated(torch::kCPU); }
void memfit_optim_reset_peak() { memfit::reset_peak_memory_stats(torch::kCPU); }

/// The kernel side `index`'s last step ran (memfit::optim::kernel_ran).
const char* memfit_optim_kernel_ran(int index) {
  static std::string ran;
  const auto& s = *sides.at(size_t(index));
  ran = s.optimizer ? memfit::optim::kernel_ran(*s.optimizer) : s.kernel;
  return ran.c_str();
}

}  // extern "C"
