// Bring your own model: pytorch/examples' cpp/mnist Net (its own forward,
// dropout, nll_loss) on LibTorch's torch::data MNIST reader over the
// Fashion-MNIST files, planned by memfit for a memory budget below the
// plain step's peak and trained by memfit's Trainer in the user's own loop.
#include "mnist_net.h"

#include <memfit/data.h>
#include <memfit/memory.h>
#include <memfit/module_plan.h>
#include <memfit/trainer.h>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>

int main() {
  torch::manual_seed(1);
  constexpr int64_t kBatch = 256;
  auto data = [](torch::data::datasets::MNIST::Mode mode) {
    memfit::UntrackedGuard host;  // the data set is host memory, not the device's
    return torch::data::datasets::MNIST(memfit::fashion_mnist_folder(), mode)
        .map(torch::data::transforms::Normalize<>(0.2860, 0.3530))
        .map(torch::data::transforms::Stack<>());
  };
  auto train = torch::data::make_data_loader<torch::data::samplers::RandomSampler>(
      data(torch::data::datasets::MNIST::Mode::kTrain), kBatch);
  auto test = torch::data::make_data_loader(data(torch::data::datasets::MNIST::Mode::kTest), 1000);
  // The loader's batches live in host memory, as they do beside a GPU (it reads on comparison and *).
  auto it = [&] { memfit::UntrackedGuard host; return train->begin(); }();
  auto next = [&](torch::data::Example<>& batch) {
    memfit::UntrackedGuard host;
    if (it == train->end()) return false;
    batch = *it;
    ++it;
    return true;
  };
  torch::data::Example<> first;
  next(first);

  // The plain step's peak, then a budget of 60% of it: the plain step no longer fits.
  auto options = memfit::TrainerOptions().optimizer(memfit::OptimizerKind::kSGD).lr(0.03).momentum(0.5);
  int64_t plain_peak = 0, budget = 0;
  bool plain_fits = true;
  {
    memfit::Trainer plain(std::make_shared<Net>(), nll, options);
    plain.train_step(first);  // the optimizer's state exists from here on
    plain_peak = plain.train_step(first).peak_bytes;
    budget = plain_peak * 6 / 10;
    memfit::set_memory_budget(torch::kCPU, budget);
    try {
      plain.train_step(first);
    } catch (const c10::OutOfMemoryError&) {
      plain_fits = false;
    }
    memfit::set_memory_budget(torch::kCPU, 0);
  }

  // memfit plans the step for the budget; the plan sets the Trainer's options.
  auto net = std::make_shared<Net>();
  const auto p = memfit::plan(net, nll, first, budget, memfit::PlanOptions(), options);
  // The loop reads the loss only when it logs it, so its steps read nothing
  // back to the host (on a GPU, no synchronisation per step).
  memfit::Trainer trainer(net, nll, p.apply(*net, options).nonfinite_loss(memfit::NonfiniteLoss::kUnchecked));
  int64_t peak = 0, steps = 0;
  double last_loss = 0;
  memfit::set_memory_budget(torch::kCPU, budget);  // over it: c10::OutOfMemoryError
  for (torch::data::Example<> batch = first; steps < 300;) {
    const auto record = trainer.train_step(batch);
    peak = std::max(peak, record.peak_bytes);
    const bool more = (++steps, next(batch));
    if (steps % 100 == 0 || !more) last_loss = record.loss_tensor.item<double>();  // the loop's only reads
    if (!more) break;
  }
  memfit::set_memory_budget(torch::kCPU, 0);
  int64_t correct = 0, seen = 0;
  for (const auto& b : *test) {
    correct += trainer.eval_step(b, [&](const torch::data::Example<>& e) {
      return net->forward(e.data).argmax(1).eq(e.target).sum().item<int64_t>();
    });
    seen += b.data.size(0);
  }
  const double error = double(p.predicted.peak_bytes - peak) / double(peak);
  std::printf("plain step of %lld examples: peak %s; budget %s: the plain step %s\n",
              static_cast<long long>(kBatch), memfit::format_bytes(plain_peak).c_str(),
              memfit::format_bytes(budget).c_str(), plain_fits ? "fits" : "does not fit");
  std::printf("plan: %s\npeak %s (predicted %s, %+.1f%%; saved %s, %.0f%%) over %lld steps, last loss %.3f, "
              "test accuracy %.3f\n",
              p.why[2].c_str(), memfit::format_bytes(peak).c_str(),
              memfit::format_bytes(p.predicted.peak_bytes).c_str(), 100 * error,
              memfit::format_bytes(plain_peak - peak).c_str(), 100.0 * double(plain_peak - peak) / double(plain_peak),
              static_cast<long long>(steps), last_loss, double(correct) / double(seen));
  const bool ok = !plain_fits && peak <= budget && std::abs(error) <= 0.05 && double(correct) / double(seen) > 0.6;
  std::printf("%s\n", ok ? "own model trained under the budget" : "FAILED");
  return ok ? 0 : 1;
}
