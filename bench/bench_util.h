#pragma once
// Side-by-side timing for benchmarks: each iteration runs every variant once,
// rotating which goes first, so machine noise hits all alike; ratios are the
// median over iterations of each iteration's time ratio.

#include "memfit/data.h"
#include "memfit/environment.h"
#include "memfit/memory.h"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace memfit {
namespace bench {

/// Fashion-MNIST's training split (read once; host memory).
inline const ImageDataset& fashion_train() {
  static const auto d = load_fashion_mnist(Split::kTrain);
  return d;
}

/// The first `n` training examples, copied (host memory).
inline ImageDataset fashion_train_head(int64_t n) {
  UntrackedGuard host;
  ImageDataset d;
  d.images = fashion_train().images.narrow(0, 0, n).clone();
  d.labels = fashion_train().labels.narrow(0, 0, n).clone();
  return d;
}

/// Records LibTorch's version, the thread count and the BLAS in the
/// benchmark's output header (Google Benchmark's context, key
/// "memfit_environment") and prints the BLAS warning, if any, to stderr.
/// Call after setting the thread count, before RunSpecifiedBenchmarks.
inline void record_environment() {
  benchmark::AddCustomContext("memfit_environment", environment().to_string());
  const auto warning = check_blas();
  if (!warning.empty()) std::fprintf(stderr, "memfit: warning: %s\n", warning.c_str());
}

/// A benchmark program's main after its own set-up (threads, registration):
/// records the environment, parses Google Benchmark's flags (an unknown one
/// exits 1), runs the benchmarks chosen and returns main's exit code.
inline int run_benchmarks(int argc, char** argv) {
  record_environment();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

struct Variant {
  std::string name;            ///< Counter prefix: NAME_ms.
  std::function<void()> run;   ///< One unit of work (sets its own state up).
};

/// Times `variants` side by side; reports NAME_ms for each and, for each
/// variant after the first, NAME_vs_FIRST: the median ratio of its time to
/// the first variant's; for each pair (A, B) of `also` (indices into
/// `variants`), NAME_A_vs_NAME_B likewise, from the same iterations.
inline void side_by_side(benchmark::State& state, const std::vector<Variant>& variants,
                         const std::vector<std::pair<size_t, size_t>>& also = {}) {
  using Clock = std::chrono::steady_clock;
  const size_t k = variants.size();
  for (const auto& v : variants) v.run();  // warm up
  std::vector<double> total(k, 0.0);
  std::vector<std::vector<double>> ratios(k);
  std::vector<std::vector<double>> also_ratios(also.size());
  size_t iteration = 0;
  for (auto _ : state) {
    std::vector<double> t(k, 0.0);
    for (size_t j = 0; j < k; ++j) {
      const size_t v = (iteration + j) % k;
      const auto t0 = Clock::now();
      variants[v].run();
      t[v] = std::chrono::duration<double>(Clock::now() - t0).count();
    }
    for (size_t v = 0; v < k; ++v) {
      total[v] += t[v];
      if (v > 0) ratios[v].push_back(t[v] / t[0]);
    }
    for (size_t a = 0; a < also.size(); ++a) also_ratios[a].push_back(t[also[a].first] / t[also[a].second]);
    ++iteration;
  }
  auto median = [](std::vector<double>& r) {
    std::nth_element(r.begin(), r.begin() + r.size() / 2, r.end());
    return r[r.size() / 2];
  };
  for (size_t v = 0; v < k; ++v) {
    state.counters[variants[v].name + "_ms"] = 1e3 * total[v] / double(iteration);
    if (v == 0) continue;
    state.counters[variants[v].name + "_vs_" + variants[0].name] = median(ratios[v]);
  }
  for (size_t a = 0; a < also.size(); ++a) {
    state.counters[variants[also[a].first].name + "_vs_" + variants[also[a].second].name] =
        median(also_ratios[a]);
  }
}

} // namespace bench
} // namespace memfit
