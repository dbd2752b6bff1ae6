// Activation checkpointing: peak activation memory and step time of each
// schedule relative to no checkpointing, and the optimal schedule against
// checkpoint_sequential's best segment count at the same budget.
//
// Chains of n blocks (widths halved at n = 256 to keep the run short):
//   mlp      n × (Linear(256, 256), tanh)                      homogeneous
//   mlp_het  alternating Linear(128, 1024)+ReLU and Linear(1024, 128)+tanh
//            (8× larger activations every other block)          heterogeneous
//   mixed    alternating Linear(256, 256)+tanh and WideGelu (GELU on the
//            input repeated 8×, then the copies' mean): layers heavy in time
//            and light in memory next to light-in-time, heavy-in-memory ones
//            (as a transformer's matrix products next to its softmax)
//   cnn      residual conv blocks, 3 stages (16/32/64 channels, 32→16→8 px)
//   resnet   the built-in ResNet (make_resnet, 3×32×32 input, batch 32) with
//            n blocks per stage: stem, blocks, pooling and classifier as
//            layers (n = 8: 30 layers, in-place ReLUs)
//
// Rows:
//   overhead/checkpoint  what one checkpoint costs beyond recomputing its layers
//   model/CHAIN     the cost model's own comparison, no timing: the optimal
//                   schedule's predicted time against plain and against the
//                   fastest split whose predicted peak fits, at 0.9 … 0.25
//   sqrt/CHAIN      sqrt(n) segments against plain
//   host/CHAIN      sqrt(n) segments and each layer alone with their
//                   checkpoints' inputs on the host, against the same
//                   schedules with them on the device
//   optimal/CHAIN/F the optimal schedule for F × the plain activation peak
//                   against plain and the fastest checkpoint_sequential split
//                   whose measured peak fits F too (optimal_vs_ckseq: the
//                   median of the pairs' ratios); F from 0.9 to 0.25 (the
//                   memory–time curve) at n = 64 and for the ResNet, ½ and ¼
//                   elsewhere
//
// Denormals are flushed to zero (torch.set_flush_denormal(True)) for every
// schedule alike: the gradients of 256 stacked tanh layers vanish into the
// subnormal range, where x86 arithmetic runs ten times slower.
//
// Memory is measured with memfit's byte-exact meter on the activations and
// their gradients (parameters frozen, the input requiring grad); times are a
// training step with parameter gradients, measured side by side in one run.
//
//   make bench   or   build/bench/memfit_checkpoint_bench [--benchmark_filter=mlp_het]

#include "memfit/memory.h"
#include "memfit/models.h"
#include "memfit/checkpoint.h"
#include "memfit/schedule.h"

#include "bench_util.h"

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <map>
#include <memory>

namespace {

using memfit::CheckpointedSequential;
using memfit::CheckpointedSequentialOptions;
using memfit::Schedule;

struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl(int64_t in, int64_t out, bool relu)
      : lin(register_module("lin", torch::nn::Linear(in, out))), relu(relu) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return relu ? torch::relu(lin(x)) : torch::tanh(lin(x));
  }
  torch::nn::Linear lin;
  bool relu;
};
TORCH_MODULE(MlpBlock);

// Cheap in time, heavy in memory: GELU on the input repeated 8 times, then
// the mean of the 8 copies (an expanded elementwise layer, as an attention
// block's softmax and dropout are next to its matrix products).
struct WideGeluImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::gelu(x.repeat({1, 8})).view({x.size(0), 8, x.size(1)}).mean(1);
  }
};
TORCH_MODULE(WideGelu);

struct ConvBlockImpl : torch::nn::Module {
  ConvBlockImpl(int64_t in, int64_t out, int64_t stride)
      : c1(register_module("c1", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)))),
        b1(register_module("b1", torch::nn::BatchNorm2d(out))),
        c2(register_module("c2", torch::nn::Conv2d(torch::nn::Conv2dOptions(out, out, 3).padding(1).bias(false)))),
        b2(register_module("b2", torch::nn::BatchNorm2d(out))) {
    if (stride != 1 || in != out) {
      proj = register_module("proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = b2(c2(torch::relu(b1(c1(x)))));
    return torch::relu(y + (proj ? proj(x) : x));
  }
  torch::nn::Conv2d c1;
  torch::nn::BatchNorm2d b1;
  torch::nn::Conv2d c2;
  torch::nn::BatchNorm2d b2;
  torch::nn::Conv2d proj{nullptr};
};
TORCH_MODULE(ConvBlock);

struct Chain {
  torch::nn::Sequential seq;
  torch::Tensor input;
  torch::Tensor target;
  memfit::ChainCosts costs;
  int64_t plain_peak = 0;  // measured activation bytes of the plain run
};

int64_t width(const std::string& kind, int64_t n) {
  const int64_t w = kind == "mlp" || kind == "mixed" ? 256 : 128;
  return n >= 256 ? w / 2 : w;
}

torch::nn::Sequential build(const std::string& kind, int64_t n) {
  if (kind == "resnet") {
    return memfit::make_resnet(memfit::ModelOptions().in_channels(3).image_size(32).depth(n));
  }
  if (kind == "gpt") {
    return memfit::make_gpt(memfit::ModelOptions().num_classes(256).width(128).depth(n).context(128));
  }
  torch::nn::Sequential seq;
  const int64_t w = width(kind, n);
  for (int64_t i = 0; i < n; ++i) {
    if (kind == "mlp") {
      seq->push_back(MlpBlock(w, w, false));
    } else if (kind == "mlp_het") {
      seq->push_back(i % 2 == 0 ? MlpBlock(w, 8 * w, true) : MlpBlock(8 * w, w, false));
    } else if (kind == "mixed") {
      if (i % 2 == 0) {
        seq->push_back(MlpBlock(w, w, false));
      } else {
        seq->push_back(WideGelu());
      }
    } else {
      const int64_t stage = std::min<int64_t>(2, 3 * i / n);
      const int64_t prev = std::min<int64_t>(2, i == 0 ? 0 : 3 * (i - 1) / n);
      const bool down = i > 0 && stage != prev;
      seq->push_back(ConvBlock(16 << prev, 16 << stage, down ? 2 : 1));
    }
  }
  return seq;
}

// Activation bytes of one forward and backward: parameters frozen, input requires grad.
int64_t activation_peak(const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                        torch::nn::Sequential& seq, const torch::Tensor& input) {
  for (auto& p : seq->parameters()) p.requires_grad_(false);
  auto x = input.is_floating_point() ? input.detach().requires_grad_(true) : input;
  int64_t peak = 0;
  {
    memfit::PeakMeter meter;
    forward(x).sum().backward();
    peak = meter.peak_delta();
  }
  for (auto& p : seq->parameters()) p.requires_grad_(true);
  return peak;
}

Chain& chain(const std::string& kind, int64_t n) {
  static std::map<std::string, std::unique_ptr<Chain>> cache;
  const std::string key = kind + std::to_string(n);
  auto& slot = cache[key];
  if (slot) return *slot;
  torch::manual_seed(0);
  slot = std::make_unique<Chain>();
  Chain& c = *slot;
  c.seq = build(kind, n);
  if (kind == "cnn") {
    c.input = torch::randn({8, 16, 32, 32});
  } else if (kind == "resnet") {
    c.input = torch::randn({32, 3, 32, 32});
  } else if (kind == "gpt") {
    c.input = torch::randint(256, {8, 128});
  } else {
    c.input = torch::randn({64, width(kind, n)});
  }
  c.target = torch::randn_like(c.seq->forward(c.input));
  for (auto& p : c.seq->parameters()) p.requires_grad_(false);
  auto sample = c.input.is_floating_point() ? c.input.detach().requires_grad_(true) : c.input;
  c.costs = memfit::costs_from_profile(memfit::profile_chain(c.seq, sample));
  for (auto& p : c.seq->parameters()) p.requires_grad_(true);
  c.plain_peak = activation_peak([&](const torch::Tensor& x) { return c.seq->forward(x); }, c.seq, c.input);
  return c;
}

std::function<void()> train_step(Chain& c, CheckpointedSequential model) {
  return [&c, model]() mutable {
    for (auto& p : c.seq->parameters()) p.mutable_grad() = torch::Tensor();
    torch::mse_loss(model->forward(c.input), c.target).backward();
  };
}

CheckpointedSequential with_schedule(Chain& c, const Schedule& s) {
  CheckpointedSequential m(c.seq, CheckpointedSequentialOptions());
  m->set_schedule(s);
  return m;
}

// A standard schedule as CheckpointedSequential builds it (a segment does not
// start at an in-place layer, such as the ResNet's ReLU(inplace)).
CheckpointedSequential standard(Chain& c, memfit::ScheduleKind kind, int64_t k = 0) {
  return CheckpointedSequential(c.seq, CheckpointedSequentialOptions().kind(kind).k(k));
}

int64_t peak_of(Chain& c, CheckpointedSequential m) {
  return activation_peak([&](const torch::Tensor& x) { return m->forward(x); }, c.seq, c.input);
}

// sqrt(n) against the plain run.
void BM_Sqrt(benchmark::State& state, std::string kind, int64_t n) {
  Chain& c = chain(kind, n);
  auto plain = standard(c, memfit::ScheduleKind::kNone);
  auto ck = standard(c, memfit::ScheduleKind::kSqrt);
  state.counters["plain_act_MiB"] = double(c.plain_peak) / (1 << 20);
  state.counters["mem_ratio"] = double(peak_of(c, ck)) / double(c.plain_peak);
  state.counters["bound_2.5sqrt(n)/n"] = 2.5 * std::sqrt(double(n)) / double(n);
  memfit::bench::side_by_side(state, {{"plain", train_step(c, plain)}, {"sqrt", train_step(c, ck)}});
}

// sqrt(n) segments and each layer alone, with their checkpoints' inputs on
// the device and on the host (CheckpointOptions::offload, as recovery's last
// way to recompute sets it): the activation bytes left on the device, and
// the time the copies cost against the same schedule without them.
void BM_Host(benchmark::State& state, std::string kind, int64_t n) {
  Chain& c = chain(kind, n);
  auto make = [&](memfit::ScheduleKind k, memfit::Offload where) {
    return CheckpointedSequential(c.seq, CheckpointedSequentialOptions().kind(k).k(1).checkpoint(
                                             memfit::CheckpointOptions().offload(where)));
  };
  auto sqrt_device = make(memfit::ScheduleKind::kSqrt, memfit::Offload::kNone);
  auto sqrt_host = make(memfit::ScheduleKind::kSqrt, memfit::Offload::kHost);
  auto alone_device = make(memfit::ScheduleKind::kEvery, memfit::Offload::kNone);
  auto alone_host = make(memfit::ScheduleKind::kEvery, memfit::Offload::kHost);
  state.counters["plain_act_MiB"] = double(c.plain_peak) / (1 << 20);
  state.counters["sqrt_mem_ratio"] = double(peak_of(c, sqrt_device)) / double(c.plain_peak);
  state.counters["sqrt_host_mem_ratio"] = double(peak_of(c, sqrt_host)) / double(c.plain_peak);
  state.counters["alone_mem_ratio"] = double(peak_of(c, alone_device)) / double(c.plain_peak);
  state.counters["alone_host_mem_ratio"] = double(peak_of(c, alone_host)) / double(c.plain_peak);
  memfit::bench::side_by_side(state,
                              {{"sqrt", train_step(c, sqrt_device)},
                               {"sqrt_host", train_step(c, sqrt_host)},
                               {"alone", train_step(c, alone_device)},
                               {"alone_host", train_step(c, alone_host)}},
                              {{3, 2}});
}

// The optimal schedule at fraction × the plain run's activation peak, against
// the plain run and the fastest checkpoint_sequential split that fits too.
void BM_Optimal(benchmark::State& state, std::string kind, int64_t depth, double fraction) {
  Chain& c = chain(kind, depth);
  const int64_t n = c.costs.size();
  const auto budget = static_cast<int64_t>(fraction * double(c.plain_peak));
  auto plain = standard(c, memfit::ScheduleKind::kNone);
  Schedule best;
  try {
    best = memfit::solve_optimal(c.costs, budget);
  } catch (const c10::Error& e) {
    state.SkipWithError(e.msg().c_str());
    for (auto _ : state) {
    }
    return;
  }
  auto opt = with_schedule(c, best);
  // checkpoint_sequential's segment counts, fastest first (by the model), the
  // first whose measured peak fits.
  // (The model overestimates a split's peak by under two of its largest
  // activations; splits it puts further above the budget are not measured.)
  int64_t largest = 0;
  for (auto v : c.costs.x) largest = std::max(largest, v);
  std::vector<std::pair<double, int64_t>> splits;
  for (int64_t k = 2; k <= n; ++k) {
    const auto cost = memfit::simulate(standard(c, memfit::ScheduleKind::kUniform, k)->schedule(), c.costs);
    if (cost.peak_bytes <= budget + 2 * largest) splits.emplace_back(cost.time, k);
  }
  std::sort(splits.begin(), splits.end());
  int64_t segments = 0;
  for (const auto& s : splits) {
    if (peak_of(c, standard(c, memfit::ScheduleKind::kUniform, s.second)) <= budget) {
      segments = s.second;
      break;
    }
  }
  state.counters["budget_frac"] = fraction;
  state.counters["layers"] = double(n);
  state.counters["opt_mem_ratio"] = double(peak_of(c, opt)) / double(c.plain_peak);
  std::vector<memfit::bench::Variant> variants{{"plain", train_step(c, plain)},
                                               {"optimal", train_step(c, opt)}};
  if (segments > 0) {
    auto uni = standard(c, memfit::ScheduleKind::kUniform, segments);
    state.counters["seq_segments"] = double(segments);
    state.counters["seq_mem_ratio"] = double(peak_of(c, uni)) / double(c.plain_peak);
    variants.push_back({"ckseq", train_step(c, uni)});
  } else {
    state.counters["seq_segments"] = 0;  // no split fits: only the optimal schedule does
  }
  if (segments > 0) {
    memfit::bench::side_by_side(state, variants, {{1, 2}});
  } else {
    memfit::bench::side_by_side(state, variants);
  }
}

// The model's own comparison, no timing: the optimal schedule's predicted time
// against the fastest checkpoint_sequential split whose predicted peak fits,
// at budgets from 0.9 to 0.25 of the plain run's predicted activation peak.
void BM_Model(benchmark::State& state, std::string kind, int64_t depth) {
  Chain& c = chain(kind, depth);
  const int64_t n = c.costs.size();
  const auto plain = memfit::simulate(memfit::schedule_none(n), c.costs);
  for (auto _ : state) {
  }
  for (double f : {0.9, 0.75, 0.6, 0.5, 0.4, 0.33, 0.25}) {
    const auto budget = static_cast<int64_t>(f * double(plain.peak_bytes));
    double best_seq = 0;
    for (int64_t k = 2; k <= n; ++k) {
      const auto cost = memfit::simulate(standard(c, memfit::ScheduleKind::kUniform, k)->schedule(), c.costs);
      if (cost.peak_bytes <= budget && (best_seq == 0 || cost.time < best_seq)) best_seq = cost.time;
    }
    double opt = 0;
    try {
      opt = memfit::simulate(memfit::solve_optimal(c.costs, budget), c.costs).time;
    } catch (const c10::Error&) {
    }
    char key[32];
    std::snprintf(key, sizeof key, "%.2f", f);
    state.counters[std::string("opt/plain@") + key] = opt / plain.time;
    state.counters[std::string("opt/seq@") + key] = best_seq > 0 ? opt / best_seq : 0.0;
  }
}

// What one checkpoint costs beyond its layers: 64 tiny layers (Linear 8→8,
// batch 1) plainly and each in its own checkpoint (63 checkpoints, each layer
// also run once more without grad, then recomputed), side by side.
void BM_Overhead(benchmark::State& state) {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int i = 0; i < 64; ++i) seq->push_back(torch::nn::Linear(8, 8));
  const auto x = torch::randn({1, 8});
  auto step = [x](CheckpointedSequential m) {
    return [x, m]() mutable { m->forward(x.detach().requires_grad_(true)).sum().backward(); };
  };
  CheckpointedSequential plain(seq, CheckpointedSequentialOptions());
  CheckpointedSequential every(seq, CheckpointedSequentialOptions().kind(memfit::ScheduleKind::kEvery).k(1));
  memfit::bench::side_by_side(state, {{"plain", step(plain)}, {"every1", step(every)}});
  state.counters["per_checkpoint_us"] =
      1e3 * (double(state.counters["every1_ms"]) - double(state.counters["plain_ms"])) / 63.0;
}

void register_all() {
  benchmark::RegisterBenchmark("overhead/checkpoint", BM_Overhead)->Unit(benchmark::kMicrosecond)->Iterations(200);
  for (const auto& [kind, n] : std::vector<std::pair<std::string, int64_t>>{
           {"mlp", 64}, {"mlp_het", 64}, {"mixed", 64}, {"cnn", 64}, {"resnet", 8}}) {
    benchmark::RegisterBenchmark(("model/" + kind + "/" + std::to_string(n)).c_str(), BM_Model, kind, n)
        ->Iterations(1);
  }
  for (const auto& [kind, n] : std::vector<std::pair<std::string, int64_t>>{
           {"mlp", 64}, {"mlp_het", 64}, {"cnn", 16}, {"resnet", 8}}) {
    benchmark::RegisterBenchmark(("host/" + kind + "/" + std::to_string(n)).c_str(), BM_Host, kind, n)
        ->Unit(benchmark::kMillisecond)
        ->Iterations(15);
  }
  // ½ and ¼ of the plain activation peak for every chain; the memory–time
  // curve from 0.9 to 0.25 for the 64-block chains and the built-in ResNet
  // (8 blocks per stage: 27 layers), with a fixed number of timed pairs.
  const std::vector<std::pair<std::string, std::vector<int64_t>>> chains = {
      {"mlp", {16, 64, 256}}, {"mlp_het", {16, 64, 256}}, {"mixed", {64}}, {"cnn", {16, 64}}, {"resnet", {8}}};
  for (const auto& [kind, sizes] : chains) {
    for (int64_t n : sizes) {
      const std::string name = kind + "/" + std::to_string(n);
      const bool curve = n == 64 || kind == "resnet";
      const double min_time = n >= 256 ? 4.0 : 1.5;
      benchmark::RegisterBenchmark(("sqrt/" + name).c_str(), BM_Sqrt, kind, n)
          ->Unit(benchmark::kMillisecond)
          ->MinTime(min_time);
      const std::vector<double> fractions =
          curve ? std::vector<double>{0.9, 0.75, 0.6, 0.5, 0.4, 0.33, 0.25} : std::vector<double>{0.5, 0.25};
      for (double f : fractions) {
        char label[16];
        std::snprintf(label, sizeof label, "%.2f", f);
        auto* b = benchmark::RegisterBenchmark(("optimal/" + name + "/" + label).c_str(), BM_Optimal, kind, n, f)
                      ->Unit(benchmark::kMillisecond);
        if (curve) {
          b->Iterations(15);  // timed pairs: enough for a stable median at every budget
        } else {
          b->MinTime(min_time);
        }
      }
    }
  }
}

} // namespace

int main(int argc, char** argv) {
  memfit::keep_freed_host_memory();  // as the memfit CLI does at start (environment.h)
  at::set_num_threads(1);  // one core per run keeps the pairs comparable on a shared machine
  at::globalContext().setFlushDenormal(true);
  register_all();
  return memfit::bench::run_benchmarks(argc, argv);
}
