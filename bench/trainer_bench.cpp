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
// tax/{whole,micro64}: the library's cost on a user's own module
//   (pytorch/examples' MNIST Net, its own forward, dropout, nll_loss; SGD;
//   batch 256 of Fashion-MNIST): Trainer::train_step against a hand-written
//   LibTorch loop doing the same work (each micro-batch's loss weighted by
//   its share and read once, backward, step, gradients set to none), side by
//   side, with each one's step peak above what is held between steps.
//
// prefetch/{in_memory,read_wait}: reading batches ahead
//   (TrainerOptions::prefetch_factor 2) against reading each batch when its
//   step starts, over a fit of 8 steps of the MNIST Net (batch 256, SGD) on a
//   map-style data set of Fashion-MNIST examples: in memory (each read is a
//   gather), and with each read also waiting 20 µs per example (5 ms a
//   batch, a stand-in for a disk or a decoder that waits without computing).
//   Each is timed at the machine's threads and at one fewer (a core left to
//   the reading thread); the step peaks of both are reported, as their
//   largest difference.
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
#include "mnist_net.h"  // examples/consumer: pytorch/examples' cpp/mnist Net

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
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

void BM_Tax(benchmark::State& state, int64_t micro) {
  const int64_t batch = 256;
  const auto data = memfit::bench::fashion_train_head(batch);
  const torch::data::Example<> example(data.images.clone(), data.labels.clone());  // a loader's batch: tracked
  const auto sgd = torch::optim::SGDOptions(0.01).momentum(0.5);
  torch::manual_seed(0);
  auto trainer_net = std::make_shared<Net>();
  memfit::Trainer trainer(trainer_net, nll,
                          memfit::TrainerOptions().micro_batch_size(micro).optimizer_factory(
                              [sgd](std::vector<torch::Tensor> p) {
                                return std::make_unique<torch::optim::SGD>(std::move(p), sgd);
                              }));
  torch::manual_seed(0);
  auto loop_net = std::make_shared<Net>();
  torch::optim::SGD loop_sgd(loop_net->parameters(), sgd);
  const int64_t m = micro > 0 ? micro : batch;
  auto loop_step = [&] {
    double total = 0;
    for (int64_t start = 0; start < batch; start += m) {
      const int64_t len = std::min(m, batch - start);
      auto loss = nll(*loop_net, {example.data.narrow(0, start, len), example.target.narrow(0, start, len)});
      if (len != batch) loss = loss * (double(len) / double(batch));
      total += loss.item<double>();
      loss.backward();
    }
    loop_sgd.step();
    // zero_grad(set_to_none) after the step, as the Trainer does: neither holds gradients between steps.
    for (auto& p : loop_net->parameters()) p.mutable_grad() = torch::Tensor();
    benchmark::DoNotOptimize(total);
  };
  auto peak_of = [&](const std::function<void()>& step) {
    memfit::PeakMeter meter(torch::kCPU);
    step();
    return meter.peak_delta();
  };
  const std::vector<memfit::bench::Variant> variants = {
      {"loop", loop_step},
      {"trainer", [&] { trainer.train_step(example); }},
  };
  for (const auto& v : variants) v.run();  // momentum buffers exist from here on
  const int64_t loop_peak = peak_of(variants[0].run), trainer_peak = peak_of(variants[1].run);
  state.counters["loop_peak_MiB"] = mib(loop_peak);
  state.counters["trainer_minus_loop_peak_bytes"] = double(trainer_peak - loop_peak);
  memfit::bench::side_by_side(state, variants);
}

// Recovery from out of memory (OnOutOfMemory::kReplan), on pytorch/examples'
// MNIST Net at batch 256 of Fashion-MNIST with Adam. First a run of 20
// steps whose budget drops to 40% of the plain step's peak at step 5, beside
// the same run uninterrupted (dropout off: micro-batches would draw their
// own masks): its losses, and what one recovery (the failed attempts and the
// re-plan) costs against a step. Then, side by side when nothing fails, the
// Trainer (its transaction, memfit's Adam) with kReplan and with kThrow
// against a hand-written loop with LibTorch's Adam.
void BM_Recovery(benchmark::State& state) {
  const int64_t batch = 256, steps = 20;
  const auto data = memfit::bench::fashion_train_head(batch * steps);
  auto example = [&](int64_t i) {
    memfit::UntrackedGuard host;  // a loader's batch, staged by the step
    return torch::data::Example<>(data.images.narrow(0, i * batch, batch).clone(),
                                  data.labels.narrow(0, i * batch, batch).clone());
  };
  const auto options =
      memfit::TrainerOptions().lr(1e-3).device(device()).on_out_of_memory(memfit::OnOutOfMemory::kReplan);
  auto make = [](bool dropout) {
    torch::manual_seed(0);
    auto net = std::make_shared<Net>();
    net->train(dropout);
    return net;
  };
  auto run = [&](bool drop, std::vector<double>& losses, std::vector<double>& seconds) {
    memfit::Trainer t(make(false), nll, options);
    int64_t plain_peak = 0;  // the plain step's, once the optimizer's state exists
    for (int64_t i = 0; i < steps; ++i) {
      if (drop && i == 4) memfit::set_memory_budget(device(), plain_peak * 4 / 10);
      const auto rec = t.train_step(example(i));
      if (i == 1) plain_peak = rec.peak_bytes;
      losses.push_back(rec.loss);
      seconds.push_back(rec.seconds);
    }
    memfit::set_memory_budget(device(), 0);
    return t.recoveries();
  };
  std::vector<double> plain_losses, dropped_losses, plain_seconds, dropped_seconds;
  run(false, plain_losses, plain_seconds);
  const auto recoveries = run(true, dropped_losses, dropped_seconds);
  double lost = 0, most = 0;
  for (const auto& r : recoveries) lost += r.seconds;
  for (size_t i = 0; i < plain_losses.size(); ++i) most = std::max(most, std::abs(plain_losses[i] - dropped_losses[i]));
  for (size_t i = 0; i < plain_losses.size(); ++i) {
    std::fprintf(stderr, "recovery: step %2zu loss %.7f uninterrupted %.7f%s\n", i + 1, dropped_losses[i],
                 plain_losses[i], i == 4 ? "  (budget 40% of the plain step's peak from here)" : "");
  }
  for (const auto& r : recoveries) {
    std::fprintf(stderr, "recovery: step %lld: %s -> %s, peak %s under %s, %.1f ms\n", static_cast<long long>(r.step),
                 r.before.c_str(), r.after.c_str(), memfit::format_bytes(r.peak_bytes).c_str(),
                 memfit::format_bytes(r.limit_bytes).c_str(), 1e3 * r.seconds);
  }
  std::sort(plain_seconds.begin(), plain_seconds.end());
  state.counters["drop_steps_done"] = double(dropped_losses.size());
  state.counters["drop_recoveries"] = double(recoveries.size());
  state.counters["drop_recovery_ms"] = 1e3 * lost;
  state.counters["drop_recovery_vs_step"] = lost / plain_seconds[plain_seconds.size() / 2];
  state.counters["drop_most_loss_difference"] = most;
  // Nothing fails: the transaction's cost, side by side.
  const auto first = example(0);
  memfit::Trainer replan(make(true), nll, options);
  memfit::Trainer throws(make(true), nll, memfit::TrainerOptions(options).on_out_of_memory(memfit::OnOutOfMemory::kThrow));
  auto loop_net = make(true);
  loop_net->to(device());
  torch::optim::Adam loop_adam(loop_net->parameters(), torch::optim::AdamOptions(1e-3));
  auto loop_step = [&] {
    auto loss = nll(*loop_net, {first.data.to(device()), first.target.to(device())});
    benchmark::DoNotOptimize(loss.item<double>());
    loss.backward();
    loop_adam.step();
    for (auto& p : loop_net->parameters()) p.mutable_grad() = torch::Tensor();
  };
  memfit::bench::side_by_side(state, {{"loop", loop_step},
                                      {"replan", [&] { replan.train_step(first); }},
                                      {"throw", [&] { throws.train_step(first); }}},
                              {{1, 2}});
}

// Fashion-MNIST examples as a map-style data set whose reads also wait.
struct WaitingRows : torch::data::datasets::BatchDataset<WaitingRows, torch::data::Example<>> {
  WaitingRows(memfit::ImageDataset data, int64_t wait_us) : data(std::move(data)), wait_us(wait_us) {}
  torch::data::Example<> get_batch(c10::ArrayRef<size_t> indices) override {
    std::this_thread::sleep_for(std::chrono::microseconds(wait_us * static_cast<int64_t>(indices.size())));
    return data.get_batch(indices);
  }
  torch::optional<size_t> size() const override { return data.size(); }
  memfit::ExampleDataset data;
  int64_t wait_us;
};

void BM_Prefetch(benchmark::State& state, int64_t wait_us) {
  const int64_t batch = 256, steps = 8;
  WaitingRows data(memfit::bench::fashion_train_head(batch * steps), wait_us);
  auto trainer_with = [&](int64_t prefetch) {
    torch::manual_seed(0);
    return std::make_unique<memfit::Trainer>(
        std::make_shared<Net>(), nll,
        memfit::TrainerOptions().batch_size(batch).steps(steps).prefetch_factor(prefetch).optimizer(
            memfit::OptimizerKind::kSGD).lr(0.01).device(device()));
  };
  auto in_step = trainer_with(0), ahead = trainer_with(2);
  std::vector<int64_t> peaks_in_step, peaks_ahead;
  auto run = [&](memfit::Trainer& t, std::vector<int64_t>& peaks) {
    const auto report = t.fit(data);  // a finished run starts again from step 0
    peaks.clear();
    for (const auto& r : report.steps) peaks.push_back(r.peak_bytes);
  };
  // Each at the machine's threads, and at one fewer, which leaves a core to the reading thread.
  const int threads = at::get_num_threads(), fewer = std::max(threads - 1, 1);
  auto at_threads = [](int n, const std::function<void()>& f) {
    const int was = at::get_num_threads();
    at::set_num_threads(n);
    f();
    at::set_num_threads(was);
  };
  std::vector<int64_t> unused;
  const std::vector<memfit::bench::Variant> variants = {
      {"in_step", [&] { run(*in_step, peaks_in_step); }},
      {"ahead", [&] { run(*ahead, peaks_ahead); }},
      {"in_step_fewer", [&] { at_threads(fewer, [&] { run(*in_step, unused); }); }},
      {"ahead_fewer", [&] { at_threads(fewer, [&] { run(*ahead, unused); }); }},
  };
  memfit::bench::side_by_side(state, variants, {{3, 2}});
  int64_t most = 0;
  for (size_t i = 0; i < std::min(peaks_ahead.size(), peaks_in_step.size()); ++i) {
    most = std::max<int64_t>(most, std::abs(peaks_ahead[i] - peaks_in_step[i]));
  }
  state.counters["step_peak_MiB"] = mib(peaks_in_step.empty() ? 0 : peaks_in_step.back());
  state.counters["most_peak_difference_bytes"] = double(most);
}

void register_all() {
  benchmark::RegisterBenchmark("prefetch/in_memory", BM_Prefetch, int64_t(0))
      ->Unit(benchmark::kMillisecond)
      ->Iterations(10);
  benchmark::RegisterBenchmark("prefetch/read_wait", BM_Prefetch, int64_t(20))
      ->Unit(benchmark::kMillisecond)
      ->Iterations(10);
  benchmark::RegisterBenchmark("recovery/mnist_net", BM_Recovery)->Unit(benchmark::kMillisecond)->Iterations(40);
  benchmark::RegisterBenchmark("tax/whole", BM_Tax, int64_t(0))->Unit(benchmark::kMillisecond)->Iterations(40);
  benchmark::RegisterBenchmark("tax/micro64", BM_Tax, int64_t(64))->Unit(benchmark::kMillisecond)->Iterations(40);
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
  memfit::keep_freed_host_memory();  // as the memfit CLI does at start (environment.h)
  memfit::memory_allocated(device());  // tracking from the start
  const unsigned hw = std::thread::hardware_concurrency();
  at::set_num_threads(hw > 0 ? static_cast<int>(hw) : 1);
  register_all();
  return memfit::bench::run_benchmarks(argc, argv);
}
