// A LibTorch training step measured with memfit: peak bytes under a budget.
#include <memfit/memory.h>

#include <torch/torch.h>

#include <iostream>

int main() {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(64, 256), torch::nn::ReLU(),
                              torch::nn::Linear(256, 10));
  torch::optim::SGD sgd(model->parameters(), 0.1);
  memfit::set_memory_budget(torch::kCPU, memfit::memory_allocated() + (16 << 20));

  memfit::PeakMeter meter;
  auto loss = torch::nn::functional::cross_entropy(model->forward(torch::randn({128, 64})),
                                                   torch::randint(10, {128}));
  loss.backward();
  sgd.step();
  const auto m = memfit::breakdown_step(meter.peak(), model->parameters(), model->buffers(), sgd);
  std::cout << "step peak: " << memfit::format_bytes(meter.peak_delta()) << "\n" << m.table();

  try {
    auto too_big = torch::empty({64 << 20});  // 256 MiB > 16 MiB budget
  } catch (const c10::OutOfMemoryError& e) {
    std::cout << "refused as expected: " << e.msg() << "\n";
    return 0;
  }
  std::cerr << "the budget was not enforced\n";
  return 1;
}
