// Bring your own model: pytorch/examples' cpp/mnist Net (its own forward,
// dropout, nll_loss) on LibTorch's torch::data MNIST reader over the
// Fashion-MNIST files, trained by memfit's Trainer in the user's own loop
// under a memory budget below the plain step's peak.
#include <memfit/data.h>
#include <memfit/memory.h>
#include <memfit/trainer.h>

#include <torch/torch.h>

#include <cstdio>

struct Net : torch::nn::Module {
  Net()
      : conv1(torch::nn::Conv2dOptions(1, 10, /*kernel_size=*/5)),
        conv2(torch::nn::Conv2dOptions(10, 20, /*kernel_size=*/5)),
        fc1(320, 50),
        fc2(50, 10) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv2_drop", conv2_drop);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1->forward(x), 2));
    x = torch::relu(torch::max_pool2d(conv2_drop->forward(conv2->forward(x)), 2));
    x = x.view({-1, 320});
    x = torch::relu(fc1->forward(x));
    x = torch::dropout(x, /*p=*/0.5, /*train=*/is_training());
    return torch::log_softmax(fc2->forward(x), /*dim=*/1);
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Dropout2d conv2_drop;
  torch::nn::Linear fc1, fc2;
};

torch::Tensor nll(Net& net, const torch::data::Example<>& batch) {
  return torch::nll_loss(net.forward(batch.data), batch.target);
}

// The peak bytes of one step of `trainer` on `batch` beyond what is held
// now, under `budget` such bytes (0: none); -1 when it does not fit.
int64_t step_peak(memfit::Trainer& trainer, const torch::data::Example<>& batch, int64_t budget) {
  const int64_t base = memfit::memory_allocated();
  memfit::set_memory_budget(torch::kCPU, budget > 0 ? base + budget : 0);
  int64_t peak = -1;
  try {
    memfit::PeakMeter meter;
    trainer.train_step(batch);
    peak = meter.peak() - base;
  } catch (const c10::OutOfMemoryError&) {
  }
  memfit::set_memory_budget(torch::kCPU, 0);
  return peak;
}

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
  auto it = train->begin();
  const torch::data::Example<> first = *it;

  // The plain step's peak, then a budget of 60% of it: the plain step no
  // longer fits, micro-batches of 64 do (the same gradient, to rounding).
  auto net = std::make_shared<Net>();
  auto options = memfit::TrainerOptions().optimizer(memfit::OptimizerKind::kSGD).lr(0.03).momentum(0.5);
  memfit::Trainer plain(net, nll, options);
  step_peak(plain, first, 0);  // the optimizer's state exists from here on
  const int64_t plain_peak = step_peak(plain, first, 0);
  const int64_t budget = plain_peak * 6 / 10;
  const bool plain_fits = step_peak(plain, first, budget) >= 0;

  net = std::make_shared<Net>();
  memfit::Trainer trainer(net, nll, options.micro_batch_size(64));
  int64_t peak = 0, steps = 0;
  double last_loss = 0;
  for (; it != train->end() && steps < 300; ++it, ++steps) {
    const int64_t base = memfit::memory_allocated();
    memfit::set_memory_budget(torch::kCPU, base + budget);
    memfit::PeakMeter meter;
    last_loss = trainer.train_step(*it).loss;
    peak = std::max(peak, meter.peak() - base);
    memfit::set_memory_budget(torch::kCPU, 0);
  }
  int64_t correct = 0, seen = 0;
  for (const auto& b : *test) {
    correct += trainer.eval_step(b, [&](const torch::data::Example<>& e) {
      return net->forward(e.data).argmax(1).eq(e.target).sum().item<int64_t>();
    });
    seen += b.data.size(0);
  }
  std::printf("plain step of %lld examples: peak %s; budget %s: the plain step %s\n",
              static_cast<long long>(kBatch), memfit::format_bytes(plain_peak).c_str(),
              memfit::format_bytes(budget).c_str(), plain_fits ? "fits" : "does not fit");
  std::printf("micro-batches of 64: peak %s (saved %s, %.0f%%) over %lld steps, last loss %.3f, "
              "test accuracy %.3f\n",
              memfit::format_bytes(peak).c_str(), memfit::format_bytes(plain_peak - peak).c_str(),
              100.0 * double(plain_peak - peak) / double(plain_peak), static_cast<long long>(steps), last_loss,
              double(correct) / double(seen));
  const bool ok = !plain_fits && peak <= budget && double(correct) / double(seen) > 0.6;
  std::printf("%s\n", ok ? "own model trained under the budget" : "FAILED");
  return ok ? 0 : 1;
}
