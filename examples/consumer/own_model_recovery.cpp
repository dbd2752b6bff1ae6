// A run that does not die of out-of-memory: pytorch/examples' MNIST Net in
// the user's own loop, where another process takes memory mid-run (the
// budget drops to 40% of the plain step's peak at step 5 of 20). With
// OnOutOfMemory::kReplan each step that runs out of memory is undone,
// re-planned and run again on the same batch; the run finishes, and its
// losses follow the uninterrupted run's. Re-planned in the default order
// (more micro-batches, one failed attempt at a time), and from the
// planner's step model of the net (replan_from_model: the fastest settings
// predicted to fit the memory the step found, at once).
#include "mnist_net.h"

#include <memfit/data.h>
#include <memfit/memory.h>
#include <memfit/module_plan.h>
#include <memfit/trainer.h>

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  constexpr int64_t kBatch = 128, kSteps = 20, kDropAt = 5;
  const auto data = [] {
    memfit::UntrackedGuard host;  // the data set is host memory, not the device's
    return memfit::load_fashion_mnist(memfit::Split::kTrain);
  }();
  auto batch = [&](int64_t i) {
    memfit::UntrackedGuard host;
    return torch::data::Example<>(data.images.narrow(0, i * kBatch, kBatch).clone(),
                                  data.labels.narrow(0, i * kBatch, kBatch).clone());
  };
  auto run = [&](bool drop, bool from_model, int64_t& recoveries) {
    torch::manual_seed(1);
    auto net = std::make_shared<Net>();
    net->eval();  // no dropout: micro-batches would draw their own masks
    auto options = memfit::TrainerOptions().lr(1e-3).on_out_of_memory(memfit::OnOutOfMemory::kReplan);
    if (from_model) {  // the planner measures the net's step on a sample batch, and re-plans from that
      auto model = std::make_shared<memfit::ModuleStepModel>(memfit::detail::make_probe(net, nll, batch(0)),
                                                             memfit::PlanOptions(), options);
      const auto plan = memfit::plan(*model, int64_t(1) << 40);  // no budget yet: the plain step
      options = plan.apply(*net, options).replan(memfit::replan_from_model(model, plan));
    }
    memfit::Trainer trainer(net, nll, options);
    std::vector<double> losses;
    int64_t plain_peak = 0;  // the plain step's, once the optimizer's state exists
    for (int64_t i = 0; i < kSteps; ++i) {
      if (drop && i + 1 == kDropAt) memfit::set_memory_budget(torch::kCPU, plain_peak * 4 / 10);
      const auto record = trainer.train_step(batch(i));
      if (i == 1) plain_peak = record.peak_bytes;
      losses.push_back(record.loss);
    }
    memfit::set_memory_budget(torch::kCPU, 0);
    recoveries = static_cast<int64_t>(trainer.recoveries().size());
    for (const auto& r : trainer.recoveries()) {
      std::printf("step %lld: %s -> %s (%.1f ms)\n", static_cast<long long>(r.step), r.before.c_str(),
                  r.after.c_str(), 1e3 * r.seconds);
    }
    return losses;
  };
  int64_t none = 0, in_order = 0, from_model = 0;
  const auto plain = run(false, false, none);
  const auto dropped = run(true, false, in_order);
  const auto replanned = run(true, true, from_model);
  double most = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    most = std::max({most, std::abs(plain[i] - dropped[i]), std::abs(plain[i] - replanned[i])});
  }
  std::printf("%zu and %zu of %lld steps done, %lld recoveries in the default order and %lld from the step model, "
              "losses at most %.2g from the uninterrupted run's\n",
              dropped.size(), replanned.size(), static_cast<long long>(kSteps), static_cast<long long>(in_order),
              static_cast<long long>(from_model), most);
  const bool ok = dropped.size() == static_cast<size_t>(kSteps) && replanned.size() == dropped.size() &&
                  in_order > 0 && from_model > 0 && from_model <= in_order && none == 0 && most <= 1e-5;
  std::printf("%s\n", ok ? "the run recovered from out of memory" : "FAILED");
  return ok ? 0 : 1;
}
