// The memfit Trainer's memory techniques on a synthetic image task:
// gradient accumulation (micro-batches) gives the full batch's parameters,
// a frozen layer keeps its weights and costs no gradient or optimizer state,
// the optimizer state can live on the host, and a run saved half-way and
// resumed ends bit-identical to one that never stopped.
#include <memfit/freeze.h>
#include <memfit/models.h>
#include <memfit/trainer.h>

#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <iostream>

namespace {

memfit::ImageDataset synthetic_images(int64_t n) {
  torch::manual_seed(0);
  memfit::ImageDataset d;
  d.labels = torch::randint(10, {n}, torch::kInt64);
  // Each class brightens its own band of rows, plus noise.
  d.images = torch::randn({n, 1, 28, 28}) * 0.5;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = d.labels[i].item<int64_t>();
    d.images[i].narrow(1, c * 2, 3).add_(1.0);
  }
  return d;
}

std::vector<torch::Tensor> trained(memfit::TrainerOptions options, const memfit::ImageDataset& data,
                                   memfit::TrainReport* report = nullptr) {
  torch::manual_seed(1);
  memfit::Trainer trainer(memfit::make_mlp(memfit::ModelOptions().width(64).depth(2)), options);
  auto r = trainer.fit(data);
  if (report) *report = r;
  std::vector<torch::Tensor> out;
  for (const auto& p : trainer.model()->parameters()) out.push_back(p.detach().clone());
  return out;
}

double max_relative_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, (a[i] - b[i]).norm().item<double>() / b[i].norm().item<double>());
  }
  return worst;
}

} // namespace

int main() {
  const auto data = synthetic_images(1000);
  const auto base = memfit::TrainerOptions().batch_size(100).steps(20).lr(1e-2).optimizer(memfit::OptimizerKind::kSGD);

  memfit::TrainReport full_report, micro_report;
  const auto full = trained(base, data, &full_report);
  const auto micro = trained(memfit::TrainerOptions(base).micro_batch_size(30), data, &micro_report);
  std::cout << "micro-batches of 30 (30+30+30+10) vs batches of 100: relative difference "
            << max_relative_difference(micro, full) << ", step peak "
            << micro_report.step_memory.peak << " vs " << full_report.step_memory.peak << " bytes\n";

  memfit::TrainReport frozen_report, offload_report;
  trained(memfit::TrainerOptions(base).freeze({"fc0.*"}), data, &frozen_report);
  trained(memfit::TrainerOptions(base).offload_optimizer(memfit::Offload::kHost), data, &offload_report);
  std::cout << "optimizer state on the device: " << full_report.step_memory.optimizer_state
            << " bytes; fc0 frozen: " << frozen_report.step_memory.optimizer_state
            << "; offloaded to the host: " << offload_report.step_memory.optimizer_state << "\n";

  const auto dir = (std::filesystem::temp_directory_path() / "memfit_trainer_state_example").string();
  // One file and its folder. (Not std::filesystem::remove_all: against pip's
  // LibTorch 2.x it binds to libtorch.so's own incompatible copy and crashes.)
  auto remove_checkpoint = [&dir] {
    std::error_code ignored;
    std::filesystem::remove(dir + "/checkpoint.pt", ignored);
    std::filesystem::remove(dir, ignored);
  };
  remove_checkpoint();
  torch::manual_seed(1);
  memfit::Trainer first(memfit::make_mlp(memfit::ModelOptions().width(64).depth(2)),
                        memfit::TrainerOptions(base).steps(10).save_dir(dir));
  first.fit(data);  // saves dir/checkpoint.pt at its end
  memfit::Trainer second(memfit::make_mlp(memfit::ModelOptions().width(64).depth(2)), base);
  second.resume(dir);
  second.fit(data);  // steps 11 to 20
  bool identical = true;
  const auto resumed = second.model()->parameters();
  for (size_t i = 0; i < full.size(); ++i) identical = identical && resumed[i].equal(full[i]);
  remove_checkpoint();
  std::cout << (identical ? "resume bit-identical" : "resume DIFFERS") << " after 10 + 10 steps\n";
  const bool ok = identical && max_relative_difference(micro, full) < 1e-6 &&
                  offload_report.step_memory.optimizer_state == 0 &&
                  frozen_report.step_memory.optimizer_state < full_report.step_memory.optimizer_state;
  return ok ? 0 : 1;
}
