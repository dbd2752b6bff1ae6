// LibTorch's optimizer swapped for memfit's with one word: pytorch/examples'
// MNIST Net in the user's own loop, stepped by torch::optim::Adam and by
// memfit::optim::Adam from the same start. memfit's runs LibTorch's fused
// kernel where LibTorch has one (2.4 and later) and the loop elsewhere; the
// parameters agree within rounding (bitwise on the loop).
#include "mnist_net.h"

#include <memfit/data.h>
#include <memfit/optim.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

int main() {
  constexpr int64_t kBatch = 64, kSteps = 20;
  const auto data = memfit::load_fashion_mnist(memfit::Split::kTrain);
  auto train = [&](auto make_optimizer, double& optimizer_seconds) {
    torch::manual_seed(1);
    auto net = std::make_shared<Net>();
    net->eval();  // no dropout: both runs see the same function
    auto optimizer = make_optimizer(net->parameters());
    for (int64_t i = 0; i < kSteps; ++i) {
      optimizer.zero_grad();
      nll(*net, torch::data::Example<>(data.images.narrow(0, i * kBatch, kBatch),
                                       data.labels.narrow(0, i * kBatch, kBatch)))
          .backward();
      const auto start = std::chrono::steady_clock::now();
      optimizer.step();
      optimizer_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    return std::make_pair(net, std::string(memfit::optim::kernel_ran(optimizer)));
  };
  double theirs_seconds = 0, ours_seconds = 0;
  const auto options = torch::optim::AdamOptions(1e-3);
  const auto theirs = train([&](auto p) { return torch::optim::Adam(p, options); }, theirs_seconds);
  const auto ours = train([&](auto p) { return memfit::optim::Adam(p, options); }, ours_seconds);
  double worst = 0;
  const auto a = ours.first->parameters(), b = theirs.first->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, ((a[i] - b[i]).norm() / b[i].norm()).item<double>());
  }
  std::printf("torch::optim::Adam: %.2f ms of optimizer steps; memfit::optim::Adam (%s kernel): %.2f ms\n",
              1e3 * theirs_seconds, ours.second.c_str(), 1e3 * ours_seconds);
  std::printf("largest relative difference of a parameter after %lld steps: %.1e\n",
              static_cast<long long>(kSteps), worst);
  if (worst > 1e-5) {
    std::fprintf(stderr, "memfit's optimizer parted from LibTorch's\n");
    return 1;
  }
  std::printf("memfit's optimizer steps as LibTorch's\n");
  return 0;
}
