// Overhead of memfit's tracking allocator against LibTorch's default CPU
// allocator, measured side by side: each iteration runs the same work once
// under each allocator (alternating which goes first), so machine noise hits
// both alike. overhead_pct is the median over iterations of each pair's
// tracking/default ratio (robust to a noisy neighbour's spikes); allocs is the
// number of allocations the work makes, counted once.
//
//   make bench        or   build/bench/memfit_bench --benchmark_filter=TrainStep

#include "compat.h"
#include "memfit/memory.h"
#include "memfit/models.h"
#include "memory_internal.h"

#include "bench_util.h"

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <vector>

namespace {

// Forwards to LibTorch's default allocator and counts the calls.
struct CountingAllocator final : c10::Allocator {
  mutable std::atomic<int64_t> calls{0};
  MEMFIT_ALLOCATOR_METHODS(allocate_impl)
  c10::DataPtr allocate_impl(size_t n) const {
    calls.fetch_add(1, std::memory_order_relaxed);
    return c10::GetDefaultCPUAllocator()->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return c10::GetDefaultCPUAllocator()->raw_deleter();
  }
};

int64_t count_allocations(const std::function<void()>& work) {
  static CountingAllocator counting;
  counting.calls = 0;
  c10::SetCPUAllocator(&counting, 1);
  work();
  memfit::detail::install_tracking_allocator();
  return counting.calls.load();
}

// Runs `work` under both allocators side by side; overhead_pct is the median
// per-iteration ratio.
void side_by_side(benchmark::State& state, const std::function<void()>& work) {
  memfit::memory_allocated(torch::kCPU);  // installs tracking
  state.counters["allocs"] = double(count_allocations(work));
  memfit::bench::side_by_side(
      state, {{"default", [&] { memfit::detail::install_default_allocator(); work(); }},
              {"tracking", [&] { memfit::detail::install_tracking_allocator(); work(); }}});
  memfit::detail::install_tracking_allocator();
  state.counters["overhead_pct"] = 100.0 * (state.counters["tracking_vs_default"] - 1.0);
}

// The worst case: allocation and free of small tensors and nothing else.
void BM_SmallAllocFree(benchmark::State& state) {
  side_by_side(state, [] {
    for (int i = 0; i < 1000; ++i) benchmark::DoNotOptimize(torch::empty({16}));
  });
}
BENCHMARK(BM_SmallAllocFree)->Unit(benchmark::kMillisecond)->MinTime(1.0);

// Cost of a live PeakMeter on the same small allocations.
void BM_SmallAllocFreeWithMeter(benchmark::State& state) {
  memfit::PeakMeter meter;
  side_by_side(state, [] {
    for (int i = 0; i < 1000; ++i) benchmark::DoNotOptimize(torch::empty({16}));
  });
}
BENCHMARK(BM_SmallAllocFreeWithMeter)->Unit(benchmark::kMillisecond)->MinTime(1.0);

void BM_TrainStep(benchmark::State& state, memfit::ModelKind kind, int64_t batch) {
  torch::manual_seed(0);
  auto model = memfit::make_model(kind);
  torch::optim::Adam adam(model->parameters());
  auto x = torch::randn({batch, 1, 28, 28});
  auto y = torch::randint(10, {batch});
  side_by_side(state, [&] {
    adam.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(x), y).backward();
    adam.step();
  });
}
BENCHMARK_CAPTURE(BM_TrainStep, resnet_b64, memfit::ModelKind::kResNet, 64)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(10.0);
BENCHMARK_CAPTURE(BM_TrainStep, mlp_b64, memfit::ModelKind::kMlp, 64)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(5.0);

} // namespace

int main(int argc, char** argv) {
  memfit::keep_freed_host_memory();  // as the memfit CLI does at start (environment.h)
  return memfit::bench::run_benchmarks(argc, argv);
}
