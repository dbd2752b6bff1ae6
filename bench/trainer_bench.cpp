// The Trainer's memory techniques on the built-in models: peak memory of a
// training step and step time, measured side by side.
//
// micro/{resnet,mlp}: a logical batch of 256 run whole and in micro-batches of
//   128, 64, 32 and 16 (gradient accumulation, the same gradient): the step's
//   peak and activation bytes, and the step time relative to the whole batch.
// techniques/{resnet,mlp}: batch 64, Adam, each technique alone against the
//   plain step: the step peak, the bytes held between steps, and the time:
//     plain        memfit's defaults (gradients set to none, in-place ReLUs)
//     keep_grads   gradients zeroed in place (set_to_none false)
//     no_inplace   out-of-place ReLUs
//     frozen       the first layers frozen (ResNet: stem and stage 0; MLP: fc0)
//     offload      optimizer state (and fp32 masters) on the host
//     offload_grads  and the gradients, moved there as backward produces them
//     stream       and the parameters, streamed from the host layer by layer
//     stream_tiled and Linear weights in tiles of at most 64 KiB
//   and evaluation: the peak of a no-grad forward against the same forward with grad.
//
//   build/bench/memfit_trainer_bench
//
// Memory is counted by memfit's byte-exact allocator (CPU) or the CUDA caching
// allocator's statistics; times are ratios taken in one run.

#include "memfit/data.h"
#include "memfit/memory.h"
#include "memfit/models.h"
#include "memfit/trainer.h"

#include "bench_util.h"

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <memory>
#include <thread>
#include <string>
#include <vector>

namespace {

torch::nn::Sequential make(const std::string& model, bool inplace = true) {
  torch::manual_seed(0);
  return memfit::make_model(memfit::parse_model_kind(model),
                            memfit::ModelOptions().inplace(inplace));
}

torch::Device device() {
  return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
}

double mib(int64_t bytes) { return double(bytes) / (1 << 20); }

void BM_MicroBatch(benchmark::State& state, std::string model) {
  const int64_t batch = 256;
  const auto data = memfit::bench::fashion_train_head(batch * 2);
  std::vector<std::pair<std::string, memfit::TrainerOptions>> configs;
  for (int64_t micro : {batch, int64_t(128), int64_t(64), int64_t(32), int64_t(16)}) {
    configs.emplace_back(micro == batch ? "whole" : "micro" + std::to_string(micro),
                         memfit::TrainerOptions().batch_size(batch).steps(2).device(device()).micro_batch_size(micro));
  }
  // Memory first, one trainer alive at a time: bytes are the trainer's own.
  for (const auto& [name, options] : configs) {
    memfit::Trainer probe(make(model), options);
    const auto m = probe.fit(data).step_memory;  // step 2 holds Adam's state
    state.counters[name + "_peak_MiB"] = mib(m.peak);
    state.counters[name + "_act_MiB"] = mib(m.activations);
  }
  std::vector<std::unique_ptr<memfit::Trainer>> trainers;
  std::vector<memfit::bench::Variant> variants;
  for (const auto& [name, options] : configs) {
    trainers.push_back(std::make_unique<memfit::Trainer>(make(model), memfit::TrainerOptions(options).steps(1)));
    auto* t = trainers.back().get();
    variants.push_back({name, [t, &data] { t->fit(data); }});
  }
  memfit::bench::side_by_side(state, variants);
}

void BM_Techniques(benchmark::State& state, std::string model) {
  const auto data = memfit::bench::fashion_train_head(64 * 4);
  const std::vector<std::string> freeze =
      model == "mlp" ? std::vector<std::string>{"fc0.*"} : std::vector<std::string>{"stem_*", "stage0_*"};
  struct Config {
    std::string name;
    memfit::TrainerOptions options;
    bool inplace;
  };
  const auto base = memfit::TrainerOptions().batch_size(64).steps(2).device(device());
  const std::vector<Config> configs = {
      {"plain", base, true},
      {"keep_grads", memfit::TrainerOptions(base).set_to_none(false), true},
      {"no_inplace", base, false},
      {"frozen", memfit::TrainerOptions(base).freeze(freeze), true},
      {"offload", memfit::TrainerOptions(base).offload_optimizer(memfit::Offload::kHost), true},
      {"offload_grads",
       memfit::TrainerOptions(base).offload_optimizer(memfit::Offload::kHost).offload_gradients(memfit::Offload::kHost),
       true},
      {"stream",
       memfit::TrainerOptions(base).offload_optimizer(memfit::Offload::kHost).offload_gradients(memfit::Offload::kHost)
           .offload_parameters(memfit::Offload::kHost),
       true},
      {"stream_tiled",
       memfit::TrainerOptions(base).offload_optimizer(memfit::Offload::kHost).offload_gradients(memfit::Offload::kHost)
           .offload_parameters(memfit::Offload::kHost).stream(memfit::StreamOptions().tile_bytes(64 << 10)),
       true},
  };
  // Memory first, one trainer alive at a time: bytes are the trainer's own.
  for (const auto& c : configs) {
    memfit::Trainer probe(make(model, c.inplace), c.options);
    const auto report = probe.fit(data);
    state.counters[c.name + "_peak_MiB"] = mib(report.step_memory.peak);
    state.counters[c.name + "_between_MiB"] = mib(report.steps.back().current_bytes);
  }
  std::vector<std::unique_ptr<memfit::Trainer>> trainers;
  std::vector<memfit::bench::Variant> variants;
  for (const auto& c : configs) {
    trainers.push_back(std::make_unique<memfit::Trainer>(make(model, c.inplace),
                                                         memfit::TrainerOptions(c.options).steps(1)));
    auto* t = trainers.back().get();
    variants.push_back({c.name, [t, &data] { t->fit(data); }});
  }
  {  // Evaluation: a forward of 256 examples under no-grad, and with grad.
    auto net = make(model);
    net->to(device());
    const auto x = data.images.narrow(0, 0, 256).to(device());
    memfit::PeakMeter no_grad_meter(device());
    {
      torch::NoGradGuard no_grad;
      auto y = net->forward(x);
    }
    state.counters["eval_nograd_MiB"] = mib(no_grad_meter.peak_delta());
    memfit::PeakMeter grad_meter(device());
    { auto y = net->forward(x); }
    state.counters["eval_grad_MiB"] = mib(grad_meter.peak_delta());
  }
  memfit::bench::side_by_side(state, variants);
}

void register_all() {
  for (const std::string model : {"resnet", "mlp"}) {
    benchmark::RegisterBenchmark(("micro/" + model).c_str(), BM_MicroBatch, model)
        ->Unit(benchmark::kMillisecond)
        ->Iterations(model == "resnet" ? 5 : 20);
    benchmark::RegisterBenchmark(("techniques/" + model).c_str(), BM_Techniques, model)
        ->Unit(benchmark::kMillisecond)
        ->Iterations(model == "resnet" ? 10 : 40);
  }
}

} // namespace

int main(int argc, char** argv) {
  memfit::memory_allocated(device());  // tracking from the start
  const unsigned hw = std::thread::hardware_concurrency();
  at::set_num_threads(hw > 0 ? static_cast<int>(hw) : 1);
  register_all();
  return memfit::bench::run_benchmarks(argc, argv);
}
