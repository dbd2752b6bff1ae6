// Mixed precision: peak memory of a training step (parameter, gradient,
// optimizer-state and activation bytes), step time relative to fp32 measured
// side by side, and the test loss after training relative to fp32.
//
// Variants (memfit::TrainerOptions precision / master_weights):
//   fp32         float32 throughout
//   bf16         bfloat16 autocast, fp32 parameters
//   bf16_master  bfloat16 parameters and gradients, fp32 masters and optimizer state on the device
//   bf16_host    bfloat16 parameters and gradients, fp32 masters and optimizer state on the host
//   fp16, fp16_master: the same with float16 and a GradScaler (CUDA builds with a GPU only)
//
// Models: the ResNet-style CNN of `make run` and the default MLP, batch 64,
// Adam, on Debian's Fashion-MNIST. On the CPU, memory is counted by memfit's
// byte-exact allocator; on CUDA by the caching allocator's statistics.
//
//   build/bench/memfit_precision_bench                       (memory and time)
//   build/bench/memfit_precision_bench --benchmark_filter=quality   (test loss after 300 steps)
//
// MEMFIT_FLUSH_DENORMAL=1 flushes subnormal floats to zero for every variant
// (it showed that the slow fp32 MLP step is not denormal arithmetic).

#include "memfit/data.h"
#include "memfit/memory.h"
#include "memfit/models.h"
#include "memfit/precision.h"
#include "memfit/trainer.h"

#include "bench_util.h"

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>

namespace {

using memfit::MasterWeightsMode;
using memfit::Precision;

struct Config {
  std::string name;
  Precision precision;
  MasterWeightsMode master;
};

std::vector<Config> configs(const torch::Device& device) {
  std::vector<Config> c = {
      {"fp32", Precision::kFP32, MasterWeightsMode::kNone},
      {"bf16", Precision::kBF16, MasterWeightsMode::kNone},
      {"bf16_master", Precision::kBF16, MasterWeightsMode::kDevice},
      {"bf16_host", Precision::kBF16, MasterWeightsMode::kHost},
  };
  if (device.is_cuda()) {
    c.push_back({"fp16", Precision::kFP16, MasterWeightsMode::kNone});
    c.push_back({"fp16_master", Precision::kFP16, MasterWeightsMode::kDevice});
  }
  return c;
}

const memfit::ImageDataset& train_data() { return memfit::bench::fashion_train(); }
const memfit::ImageDataset& test_data() {
  static const auto d = memfit::load_fashion_mnist(memfit::Split::kTest);
  return d;
}

torch::nn::Sequential make(const std::string& model) {
  torch::manual_seed(0);
  return memfit::make_model(memfit::parse_model_kind(model), memfit::ModelOptions());
}

memfit::TrainerOptions options(const Config& c, const torch::Device& device, int64_t steps) {
  return memfit::TrainerOptions()
      .batch_size(64)
      .steps(steps)
      .lr(1e-3)
      .device(device)
      .precision(c.precision)
      .master_weights(c.master);
}

// Memory of one training step per variant, and step times side by side.
void BM_Step(benchmark::State& state, std::string model, torch::Device device) {
  const auto cs = configs(device);
  const auto batch = memfit::bench::fashion_train_head(64 * 4);
  std::vector<std::unique_ptr<memfit::Trainer>> trainers;
  std::vector<memfit::bench::Variant> variants;
  for (const auto& c : cs) {
    // Memory: a fresh trainer's first step (Adam's state appears in it).
    memfit::Trainer probe(make(model), options(c, device, 1));
    const auto report = probe.fit(batch);
    const auto& m = report.step_memory;
    state.counters[c.name + "_peak_MiB"] = double(m.peak) / (1 << 20);
    state.counters[c.name + "_param_KiB"] = double(m.parameters) / 1024;
    state.counters[c.name + "_grad_KiB"] = double(m.gradients) / 1024;
    state.counters[c.name + "_optim_KiB"] = double(m.optimizer_state) / 1024;
    state.counters[c.name + "_act_MiB"] = double(m.activations) / (1 << 20);
    trainers.push_back(std::make_unique<memfit::Trainer>(make(model), options(c, device, 4)));
    auto* t = trainers.back().get();
    variants.push_back({c.name, [t, &batch] { t->fit(batch); }});
  }
  memfit::bench::side_by_side(state, variants);
}

// Test loss and accuracy after 300 steps, relative to fp32.
void BM_Quality(benchmark::State& state, std::string model, torch::Device device) {
  for (auto _ : state) {
    double fp32_loss = 0;
    for (const auto& c : configs(device)) {
      memfit::Trainer t(make(model), options(c, device, 300));
      t.fit(train_data());
      const auto r = t.evaluate(test_data());
      if (c.precision == Precision::kFP32) fp32_loss = r.loss;
      state.counters[c.name + "_test_loss"] = r.loss;
      state.counters[c.name + "_acc_pct"] = 100 * r.accuracy;
      state.counters[c.name + "_loss_vs_fp32"] = fp32_loss > 0 ? r.loss / fp32_loss : 0;
    }
  }
}

void register_all() {
  std::vector<torch::Device> devices = {torch::Device(torch::kCPU)};
  if (torch::cuda::is_available()) devices.emplace_back(torch::kCUDA, 0);
  for (const auto& device : devices) {
    const std::string dev = device.is_cuda() ? "cuda" : "cpu";
    for (const std::string model : {"resnet", "mlp"}) {
      benchmark::RegisterBenchmark(("step/" + dev + "/" + model).c_str(), BM_Step, model, device)
          ->Unit(benchmark::kMillisecond)
          ->MinTime(device.is_cuda() ? 2.0 : 8.0);
    }
    benchmark::RegisterBenchmark(("quality/" + dev + "/resnet").c_str(), BM_Quality,
                                 std::string("resnet"), device)
        ->Unit(benchmark::kSecond)
        ->Iterations(1);
  }
}

} // namespace

int main(int argc, char** argv) {
  memfit::keep_freed_host_memory();  // as the memfit CLI does at start (environment.h)
  const unsigned hw = std::thread::hardware_concurrency();
  at::set_num_threads(hw > 0 ? static_cast<int>(hw) : 1);
  // MEMFIT_FLUSH_DENORMAL=1: flush subnormal floats to zero (to test whether
  // a slow fp32 step is spent in denormal arithmetic).
  if (const char* f = std::getenv("MEMFIT_FLUSH_DENORMAL"); f && *f == '1') {
    at::globalContext().setFlushDenormal(true);
  }
  memfit::memory_allocated(torch::kCPU);  // track from the start
  register_all();
  return memfit::bench::run_benchmarks(argc, argv);
}
