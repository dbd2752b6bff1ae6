#include "memfit/plan.h"

#include "memfit/stream.h"
#include "plan_internal.h"

#include "memfit/compat.h"

#include <torch/optim.h>
#include <torch/torch.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <tuple>

namespace memfit {
namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// The median time of `timed` over three rounds after a first one that warms
// up (or creates state); `before` runs ahead of each round, untimed.
double median_round_seconds(const std::function<void()>& timed, const std::function<void()>& before = nullptr) {
  std::vector<double> times;
  for (int r = 0; r < 4; ++r) {
    if (before) before();
    const auto t0 = Clock::now();
    timed();
    if (r > 0) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return median(times);
}

// Those of `params`, taken in order while their bytes together times
// `factor` fit `budget` (all of them for budget 0; the smallest alone where
// none fits), and the factor that scales a time over them to all of `params`.
std::pair<std::vector<torch::Tensor>, double> within_budget(const std::vector<torch::Tensor>& params,
                                                            int64_t budget, int64_t factor) {
  if (budget <= 0 || params.empty()) return {params, 1.0};
  std::vector<torch::Tensor> part;
  int64_t bytes = 0;
  for (const auto& p : params) {
    const int64_t b = p.numel() * static_cast<int64_t>(p.element_size());
    if ((bytes + b) * factor > budget) continue;
    part.push_back(p);
    bytes += b;
  }
  if (part.empty()) {
    part.push_back(*std::min_element(params.begin(), params.end(), [](const auto& a, const auto& b) {
      return a.numel() * a.element_size() < b.numel() * b.element_size();
    }));
    bytes = part.front().numel() * static_cast<int64_t>(part.front().element_size());
  }
  const int64_t total = storage_bytes(params);
  return {part, bytes > 0 ? double(total) / double(bytes) : 1.0};
}

// Times an optimizer step over copies of `params` with random gradients,
// with the state resident or (offload) in host memory behind fp32 masters.
double time_optimizer_step(const PlanOptions& o, const std::vector<torch::Tensor>& params,
                           bool offload) {
  if (params.empty()) return 0.0;
  std::vector<torch::Tensor> copies;
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : params) copies.push_back(p.detach().clone().requires_grad_(true));
  }
  std::unique_ptr<MasterWeights> master;
  std::vector<torch::Tensor> stepped = copies;
  std::optional<UntrackedGuard> host;
  if (offload) {
    master = std::make_unique<MasterWeights>(
        copies, MasterWeightsOptions().dtype(at::kFloat).offload(Offload::kHost));
    stepped = master->master_parameters();
    host.emplace();
  }
  auto optimizer = make_optimizer(TrainerOptions()
                                      .optimizer(o.optimizer())
                                      .momentum(o.momentum())
                                      .weight_decay(o.weight_decay()),
                                  stepped);
  host.reset();
  return median_round_seconds(
      [&] {  // the first round creates the state
        if (master) master->grads_to_master();
        {
          std::optional<UntrackedGuard> on_host;
          if (offload) on_host.emplace();
          optimizer->step();
        }
        if (master) master->master_to_model();
        if (copies.front().is_cuda()) torch::cuda::synchronize();
      },
      [&] {
        for (auto& c : copies) c.mutable_grad() = torch::randn_like(c);
      });
}

// Seconds to add a gradient of each of `params` into a host copy, as
// gradient offload does once per micro-batch.
double time_gradient_offload(const std::vector<torch::Tensor>& params) {
  if (params.empty()) return 0.0;
  std::vector<torch::Tensor> grads, host;
  for (const auto& p : params) {
    grads.push_back(torch::randn_like(p));
    UntrackedGuard untracked;
    host.push_back(torch::zeros(p.sizes(), p.options().device(torch::kCPU).pinned_memory(p.is_cuda())));
  }
  return median_round_seconds([&] {
    UntrackedGuard untracked;
    for (size_t i = 0; i < grads.size(); ++i) host[i].add_(grads[i].to(host[i].options()));
  });
}

// Seconds to copy every parameter from host memory to a fresh device tensor
// once, as a streamed layer fetches its parameters.
double time_stream(const std::vector<torch::Tensor>& params) {
  if (params.empty()) return 0.0;
  std::vector<torch::Tensor> host;
  {
    UntrackedGuard untracked;
    for (const auto& p : params) {
      host.push_back(torch::empty(p.sizes(), p.options().device(torch::kCPU).pinned_memory(p.is_cuda())));
      host.back().copy_(p);
    }
  }
  return median_round_seconds([&] {
    for (size_t i = 0; i < host.size(); ++i) {
      auto fetched = torch::empty(params[i].sizes(), params[i].options());
      fetched.copy_(host[i], /*non_blocking=*/true);
    }
    if (params.front().is_cuda()) torch::cuda::synchronize();
  });
}

// `segments` as a streamed chain runs them: every layer with parameters
// other than a Linear (recomputed[i]) outside a checkpoint becomes a
// checkpoint of its own, also inside recomputations.
std::vector<Segment> as_streamed(const std::vector<Segment>& segments, const std::vector<bool>& recomputed) {
  std::vector<Segment> out;
  for (const auto& s : segments) {
    if (s.checkpointed) {
      Segment c = s;
      c.inner = as_streamed(s.inner, recomputed);
      out.push_back(std::move(c));
      continue;
    }
    int64_t plain_begin = s.begin;
    for (int64_t i = s.begin; i < s.end; ++i) {
      if (!recomputed[static_cast<size_t>(i)]) continue;
      if (plain_begin < i) out.push_back(Segment{plain_begin, i, false, {}});
      out.push_back(Segment{i, i + 1, true, {Segment{i, i + 1, false, {}}}});
      plain_begin = i + 1;
    }
    if (plain_begin < s.end) out.push_back(Segment{plain_begin, s.end, false, {}});
  }
  return out;
}

int64_t line_bytes(int64_t small, int64_t large, int64_t b_small, int64_t b_large, int64_t m) {
  return static_cast<int64_t>(std::llround(detail::line(double(small), double(large), b_small, b_large, m)));
}


// Bytes that profiling a batch allocates beyond the parameters' gradients,
// from its profile: profile_chain's largest layer (its input held twice, its
// forward's peak, its output's gradient and backward's temporaries) or the
// recomputation calibration's plain pass (every layer's kept bytes and the
// last backward's), with the batch itself.
int64_t profiling_bytes(const ChainProfile& p) {
  int64_t layer = 0, kept = 0, backward = 0;
  for (const auto& l : p.layers) {
    layer = std::max(layer, 2 * l.input_bytes + l.forward_peak_bytes + l.output_bytes + l.backward_overhead_bytes);
    kept += l.kept_bytes;
    backward = std::max(backward, l.output_bytes + l.backward_overhead_bytes);
  }
  return p.layers.front().input_bytes + std::max(layer, kept + backward);
}

// A profile's forward and backward seconds, summed over its layers.
double chain_seconds(const ChainProfile& p) {
  double s = 0;
  for (const auto& l : p.layers) s += l.forward_seconds + l.backward_seconds;
  return s;
}

} // namespace

StepModel::StepModel(const torch::nn::Sequential& chain, const torch::Tensor& example,
                     PlanOptions options, torch::Device device)
    : options_(std::move(options)), device_(device) {
  TORCH_CHECK(!chain.is_empty() && chain->size() > 0, "StepModel needs a non-empty Sequential");
  TORCH_CHECK(example.defined() && example.dim() >= 1 && example.size(0) == 1,
              "StepModel needs one example with a batch dimension of 1, got ",
              example.defined() ? example.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(options_.time_batch() >= 0, "time_batch must be >= 0 (0: profile_batch), got ",
              options_.time_batch());
  TORCH_CHECK(options_.profile_batch() >= 2, "profile_batch must be at least 2, got ",
              options_.profile_batch());
  TORCH_CHECK(options_.saturation_seconds() >= 0, "saturation_seconds must be >= 0, got ",
              options_.saturation_seconds());
  detail::check_measure_options(options_);
  TORCH_CHECK(options_.margin() > 0 && options_.margin() <= 1,
              "margin must be in (0, 1], got ", options_.margin());
  TORCH_CHECK(!options_.precisions().empty(), "PlanOptions needs at least one precision");
  for (auto p : options_.precisions()) check_precision_supported(p, device_);
  memory_allocated(device_);  // starts tracking

  batch_statistics_ = batch_statistics_layer(*chain);
  example_bytes_ = static_cast<int64_t>(example.numel() * example.element_size()) +
                   static_cast<int64_t>(sizeof(int64_t));  // the label
  std::vector<torch::Tensor> persistent = chain->parameters();
  const auto buffers = chain->buffers();
  persistent.insert(persistent.end(), buffers.begin(), buffers.end());
  parameter_bytes_ = storage_bytes(persistent);
  buffer_bytes_ = storage_bytes(buffers);
  for (const auto& layer : chain->children()) {
    StreamedLayerCost c;
    for (const auto& p : layer->parameters()) {
      const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
      c.bytes += bytes;
      c.largest = std::max(c.largest, bytes);
    }
    if (const auto* lin = layer->as<torch::nn::LinearImpl>()) {
      c.linear = true;
      c.rows = lin->weight.size(0);
      c.cols = lin->weight.size(1);
      c.row_bytes = streamed_bytes(*layer, 1);  // one row per tile: a row and its bias element
    }
    stream_layers_.push_back(c);
  }
  std::vector<torch::Tensor> trainable;
  for (const auto& p : chain->parameters()) {
    if (!p.requires_grad()) continue;
    trainable.push_back(p);
    largest_trainable_ = std::max<int64_t>(largest_trainable_, p.numel() * p.element_size());
  }
  trainable_bytes_ = storage_bytes(trainable);
  switch (options_.optimizer()) {
    case OptimizerKind::kAdam:
      state_bytes_ = 2 * trainable_bytes_;
      step_temporary_bytes_ = (options_.weight_decay() > 0 ? 3 : 2) * largest_trainable_;
      break;
    case OptimizerKind::kAdamW:
      state_bytes_ = 2 * trainable_bytes_;
      step_temporary_bytes_ = 2 * largest_trainable_;
      break;
    case OptimizerKind::kSGD:
      state_bytes_ = options_.momentum() > 0 ? trainable_bytes_ : 0;
      step_temporary_bytes_ = options_.weight_decay() > 0 ? largest_trainable_ : 0;
      break;
  }

  profile_layers(chain, example);
  // The optimizer is timed on copies of the parameters with gradients and
  // state: within a profile budget, on as many of them as fit (6 times their
  // bytes, 3 offloaded, 1 for gradients), its time scaled by bytes.
  const auto resident = within_budget(trainable, options_.profile_budget(), 6);
  step_seconds_ = time_optimizer_step(options_, resident.first, false) * resident.second;
  // Offloading only adds copies: where timing noise says otherwise, the resident step's time stands.
  const auto offloaded = within_budget(trainable, options_.profile_budget(), 3);
  offloaded_step_seconds_ =
      options_.offload()
          ? std::max(step_seconds_, time_optimizer_step(options_, offloaded.first, true) * offloaded.second)
          : 0;
  const auto gradients = within_budget(trainable, options_.profile_budget(), 1);
  gradient_offload_seconds_ = options_.offload() ? time_gradient_offload(gradients.first) * gradients.second : 0;
  stream_seconds_ = options_.offload() ? time_stream(chain->parameters()) : 0;
}

// Profiles the chain's layers (see PlanOptions::profile_batch, time_batch,
// profile_budget and saturation_seconds) and calibrates recomputation.
void StepModel::profile_layers(const torch::nn::Sequential& chain, const torch::Tensor& example) {
  auto batch_of = [&](int64_t n) {
    std::vector<int64_t> sizes(example.sizes().begin(), example.sizes().end());
    sizes[0] = n;
    return example.to(device_).expand(sizes).contiguous();
  };
  // Selective recomputation: the choices the options allow and the model
  // has; each module's own setting comes back however profiling ends.
  SelectiveRecomputeGuard restore(*chain, false);
  selective_choices_ = detail::selective_choices(options_, restore.parts() > 0);
  // The first profile's first pass runs ascending from 1 example, doubling
  // to options.profile_batch() while profiling fits options.profile_budget():
  // bytes are linear in the batch, so the two largest batches measured say
  // what the next one needs.
  std::map<int64_t, ChainProfile> first;
  auto fits = [&](int64_t b) {
    if (options_.profile_budget() <= 0) return true;
    auto hi = std::prev(first.lower_bound(b)), lo = std::prev(hi);
    return line_bytes(profiling_bytes(lo->second), profiling_bytes(hi->second), lo->first, hi->first, b) <=
           options_.profile_budget();
  };
  set_selective_recompute(chain, selective_choices_.front());
  auto profile_at = [&](int64_t b, Precision precision) {
    AutocastGuard autocast(device_, precision);  // one cast cache per profile
    auto profiled = profile_chain(chain, batch_of(b), ProfileOptions().repeats(3));
    workspace_bytes_ = std::max(workspace_bytes_, profiled.workspace_bytes);
    return profiled;
  };
  for (int64_t b : {int64_t{1}, int64_t{2}}) first.emplace(b, profile_at(b, options_.precisions().front()));
  large_batch_ = 2;
  for (int64_t b = 4; large_batch_ < options_.profile_batch(); b *= 2) {
    b = std::min(b, options_.profile_batch());
    if (!fits(b)) break;
    first.emplace(b, profile_at(b, options_.precisions().front()));
    large_batch_ = b;
  }
  const int64_t large = large_batch_, small = large / 2;
  if (first.count(small) == 0) first.emplace(small, profile_at(small, options_.precisions().front()));
  // Times are measured at those batches and, up to options.time_batch(), at
  // 4× steps above `large` while the batch fits the profile budget and the
  // device is not yet busy: a batch whose forward and backward take
  // options.saturation_seconds() is the last timed, and larger ones are
  // extrapolated linearly. Micro-batches are thus priced from measurements
  // (the smallest, where fixed per-call costs dominate, most of all), and
  // planning a large batch costs little more than planning a small one.
  std::vector<int64_t> timed_batches;
  for (const auto& [b, _] : first) timed_batches.push_back(b);
  std::vector<int64_t> above;
  for (int64_t b = 4 * large; b <= options_.time_batch(); b *= 4) above.push_back(b);
  if (options_.time_batch() > large && (above.empty() || above.back() != options_.time_batch())) {
    above.push_back(options_.time_batch());
  }
  bool extended = false;
  for (auto precision : options_.precisions()) {
    for (bool selective : selective_choices_) {
      set_selective_recompute(chain, selective);
      Profiled p;
      // Each layer's time is the faster of two passes over the batches, the
      // second in reverse order: a machine that slows down for a while (a
      // shared one does) then slows no batch size more than another.
      auto time_at = [&](int64_t b) {
        auto profiled = profile_at(b, precision);
        auto it = p.timed.find(b);
        if (it == p.timed.end()) {
          p.timed.emplace(b, std::move(profiled));
          return;
        }
        auto& layers = it->second.layers;
        for (size_t i = 0; i < layers.size(); ++i) {
          layers[i].forward_seconds = std::min(layers[i].forward_seconds, profiled.layers[i].forward_seconds);
          layers[i].backward_seconds = std::min(layers[i].backward_seconds, profiled.layers[i].backward_seconds);
        }
      };
      if (!extended) {  // the first profile: its first pass is done; the batches above `large` are chosen now
        extended = true;
        p.timed = first;
        for (int64_t b : above) {
          if (!fits(b) || chain_seconds(p.timed.rbegin()->second) >= options_.saturation_seconds()) break;
          time_at(b);
          first.emplace(b, p.timed.at(b));
          timed_batches.push_back(b);
        }
      } else {
        for (int64_t b : timed_batches) time_at(b);
      }
      for (auto it = timed_batches.rbegin(); it != timed_batches.rend(); ++it) time_at(*it);
      p.large = p.timed.at(large);
      p.small = p.timed.at(small);
      profiles_.emplace(std::make_pair(precision, selective), std::move(p));
    }
  }
  timed_batches_ = timed_batches;
  std::sort(timed_batches_.begin(), timed_batches_.end());
  set_selective_recompute(chain, selective_choices_.front());
  recompute_factor_ = calibrate_recomputation(chain, batch_of(large), options_.precisions().front());
}

double StepModel::tile_seconds(int64_t micro_batch, int64_t tile_bytes) const {
  TORCH_CHECK(micro_batch > 0, "tile_seconds: micro_batch must be positive, got ", micro_batch);
  if (tile_bytes <= 0) return 0.0;
  // Above the largest timed batch the products' extra time grows linearly
  // with the batch, as the layers' times are extrapolated.
  const int64_t largest = timed_batches_.back();
  if (micro_batch > largest) return tile_seconds(largest, tile_bytes) * double(micro_batch) / double(largest);
  const auto key = std::make_pair(micro_batch, tile_bytes);
  if (const auto it = tile_seconds_.find(key); it != tile_seconds_.end()) return it->second;
  const auto options = torch::TensorOptions().device(device_).dtype(torch::kFloat);
  torch::NoGradGuard no_grad;
  double extra = 0.0;
  for (const auto& c : stream_layers_) {
    if (!c.linear) continue;
    const int64_t rows = linear_tile_rows(c.rows, c.largest, tile_bytes);
    if (rows >= c.rows) continue;  // this weight is not cut
    const auto x = torch::randn({micro_batch, c.cols}, options);
    const auto w = torch::randn({c.rows, c.cols}, options);
    const auto b = torch::randn({c.rows}, options);
    const auto dy = torch::randn({micro_batch, c.rows}, options);
    // ParameterStream's products with `tile` rows a tile (stream.cpp).
    auto products = [&](int64_t tile) {
      auto y = torch::empty({micro_batch, c.rows}, options);
      torch::Tensor dx;
      for (int64_t begin = 0; begin < c.rows; begin += tile) {
        const int64_t len = std::min(tile, c.rows - begin);
        const bool whole = len == c.rows;
        const auto w_t = whole ? w : w.narrow(0, begin, len);
        const auto dy_t = whole ? dy : dy.narrow(1, begin, len);
        const auto y_t = torch::addmm(whole ? b : b.narrow(0, begin, len), x, w_t.t());
        if (!whole) y.narrow(1, begin, len).copy_(y_t);
        dx = dx.defined() ? dx.addmm_(dy_t, w_t) : dy_t.mm(w_t);
        dy_t.t().mm(x);
      }
      if (device_.is_cuda()) torch::cuda::synchronize();
    };
    extra += median_round_seconds([&] { products(rows); }) - median_round_seconds([&] { products(c.rows); });
  }
  extra = std::max(0.0, extra);  // the difference of two medians may dip below 0
  tile_seconds_[key] = extra;
  return extra;
}

int64_t StepModel::largest_linear_bytes() const {
  int64_t largest = 0;
  for (const auto& c : stream_layers_) {
    if (c.linear) largest = std::max(largest, c.largest);
  }
  return largest;
}

namespace {
template <typename Map>
auto find_profile(const Map& profiles, Precision precision, bool selective) {
  auto it = profiles.find(std::make_pair(precision, selective));
  TORCH_CHECK(it != profiles.end(), "the StepModel was not profiled in ", to_string(precision),
              selective ? " with" : " without", " selective recomputation: add the precision to "
              "PlanOptions::precisions, and for selective recomputation use a model with SelectivelyRecomputed "
              "modules and PlanOptions::selective_recompute kChoose or kOn");
  return it;
}
} // namespace

const ChainProfile& StepModel::profile(Precision precision, bool selective_recompute) const {
  return find_profile(profiles_, precision, selective_recompute)->second.large;
}

ChainCosts StepModel::costs(Precision precision, int64_t micro_batch, bool selective_recompute) const {
  TORCH_CHECK(micro_batch > 0, "micro_batch must be positive, got ", micro_batch);
  ChainProfile scaled = scaled_profile(precision, micro_batch, selective_recompute);
  if (selective_recompute && profiles_.count(std::make_pair(precision, false)) > 0) {
    // Recomputation only adds work: where timing noise says otherwise, the
    // plain layer's time stands.
    const ChainProfile plain = scaled_profile(precision, micro_batch, false);
    for (size_t i = 0; i < scaled.layers.size(); ++i) {
      scaled.layers[i].forward_seconds = std::max(scaled.layers[i].forward_seconds, plain.layers[i].forward_seconds);
      scaled.layers[i].backward_seconds = std::max(scaled.layers[i].backward_seconds, plain.layers[i].backward_seconds);
    }
  }
  return costs_from_profile(scaled);
}

ChainProfile StepModel::scaled_profile(Precision precision, int64_t micro_batch, bool selective_recompute) const {
  auto it = find_profile(profiles_, precision, selective_recompute);
  const auto& big = it->second.large;
  const auto& little = it->second.small;
  const int64_t bl = large_batch_, bs = bl / 2;
  ChainProfile scaled = big;
  detail::scale_layer_bytes(scaled, little, big,
                            [&](int64_t a, int64_t b) { return line_bytes(a, b, bs, bl, micro_batch); });
  for (size_t i = 0; i < scaled.layers.size(); ++i) {
    auto& l = scaled.layers[i];
    // Times: between the two measured batches around micro_batch (the
    // lowest two below them, the highest two above them).
    const auto& timed = it->second.timed;
    auto hi = timed.lower_bound(micro_batch);
    if (hi == timed.begin()) ++hi;
    if (hi == timed.end()) --hi;
    auto lo = std::prev(hi);
    const auto& tl = lo->second.layers[i];
    const auto& th = hi->second.layers[i];
    l.forward_seconds = detail::line(tl.forward_seconds, th.forward_seconds, lo->first, hi->first, micro_batch);
    l.backward_seconds = detail::line(tl.backward_seconds, th.backward_seconds, lo->first, hi->first, micro_batch);
    if (micro_batch < lo->first) {  // never below the smallest measured batch's time per example
      l.forward_seconds = std::max(l.forward_seconds, tl.forward_seconds * double(micro_batch) / double(lo->first));
      l.backward_seconds = std::max(l.backward_seconds, tl.backward_seconds * double(micro_batch) / double(lo->first));
    }
  }
  // The chain's input needs no gradient: layers before the first with
  // parameters run no backward, and that layer computes no input gradient
  // (the profile measured one, its input being a leaf that required grad).
  for (auto& l : scaled.layers) {
    if (l.parameter_bytes == 0) {
      l.backward_overhead_bytes = 0;
      continue;
    }
    l.backward_overhead_bytes = std::max<int64_t>(0, l.backward_overhead_bytes - l.input_bytes);
    break;
  }
  return scaled;
}

double StepModel::calibrate_recomputation(const torch::nn::Sequential& chain,
                                          const torch::Tensor& x, Precision precision) const {
  // Times forward and backward of the chain plainly and with sqrt(n)
  // checkpoints, and compares the extra time with what the simulator gives
  // for it (which prices a no-grad forward like a forward with grad).
  const int64_t n = static_cast<int64_t>(chain->size());
  if (n < 4) return 1.0;
  std::vector<torch::Tensor> saved;
  {
    UntrackedGuard host;
    for (const auto& b : chain->buffers()) saved.push_back(b.detach().clone());
  }
  compat::RngState rng;
  {
    UntrackedGuard host;
    rng = compat::get_rng_state({});
  }
  CheckpointedSequential plain(chain), checkpointed(chain);
  checkpointed->set_schedule(schedule_sqrt(n));
  auto time_of = [&](CheckpointedSequential& m) {
    std::vector<double> t;
    for (int r = 0; r < 4; ++r) {  // the first warms up
      const auto t0 = Clock::now();
      {
        AutocastGuard autocast(device_, precision);
        auto y = m->forward(x);
        y.to(torch::kFloat).sum().backward();
      }
      if (x.is_cuda()) torch::cuda::synchronize();
      if (r > 0) t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      for (const auto& p : chain->parameters()) const_cast<torch::Tensor&>(p).mutable_grad() = torch::Tensor();
    }
    return median(t);
  };
  const double measured = time_of(checkpointed) - time_of(plain);
  {
    torch::NoGradGuard no_grad;
    auto buffers = chain->buffers();
    for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(saved[i]);
  }
  compat::set_rng_state(rng);
  const auto costs = this->costs(precision, x.size(0), selective_choices_.front());
  const double simulated =
      simulate(schedule_sqrt(n), costs).time - simulate(schedule_none(n), costs).time;
  if (simulated <= 0) return 1.0;
  return std::clamp(measured / simulated, 0.1, 2.0);
}

StepPrediction StepModel::predict(int64_t batch, const StepSettings& s) const {
  TORCH_CHECK(batch > 0, "batch must be positive, got ", batch);
  TORCH_CHECK(s.micro_batch() >= 0, "micro_batch must be >= 0 (0: the whole batch), got ",
              s.micro_batch());
  const int64_t m = s.micro_batch() > 0 ? std::min(s.micro_batch(), batch) : batch;
  const auto costs = this->costs(s.precision(), m, s.selective_recompute());
  Schedule schedule = s.schedule().segments.empty() ? schedule_none(costs.size()) : s.schedule();
  if (s.offload_parameters() == Offload::kHost) {
    std::vector<bool> recomputed(static_cast<size_t>(costs.size()), false);
    for (size_t i = 0; i < stream_layers_.size() && i < recomputed.size(); ++i) {
      recomputed[i] = !stream_layers_[i].linear && stream_layers_[i].bytes > 0;
    }
    schedule.segments = as_streamed(schedule.segments, recomputed);
  }
  const auto sim = simulate(schedule, costs);
  // Streamed: what layer i's parameters add on the device while it runs. A
  // Linear holds one weight tile (fetched for forward, or for its input's
  // gradient, then the tile's gradient, never both) and, tiled, one tile of
  // its output; any other layer its parameters and one gradient.
  auto streamed_extra = [&](size_t i) -> int64_t {
    if (i >= stream_layers_.size() || stream_layers_[i].bytes == 0) return 0;
    const auto& c = stream_layers_[i];
    if (!c.linear) return c.bytes + c.largest;
    const int64_t rows = linear_tile_rows(c.rows, c.largest, s.tile_bytes());
    return rows * c.row_bytes + (rows < c.rows ? costs.x[i + 1] * rows / c.rows : 0);
  };
  const bool offload = s.offload_optimizer() == Offload::kHost;
  const bool offload_gradients = s.offload_gradients() == Offload::kHost;
  const bool streamed = s.offload_parameters() == Offload::kHost;
  TORCH_CHECK(!offload_gradients || offload, "offload_gradients kHost moves gradients to the host "
              "masters of offload_optimizer kHost: set both");
  TORCH_CHECK(!streamed || (offload_gradients && s.precision() == Precision::kFP32),
              "offload_parameters kHost streams fp32 parameters from the host masters that hold the "
              "gradients and the optimizer state: set offload_optimizer and offload_gradients to kHost "
              "and precision fp32");
  TORCH_CHECK(s.tile_bytes() >= 0, "tile_bytes must be >= 0 (0: untiled), got ", s.tile_bytes());
  const int64_t accumulation = (batch + m - 1) / m;
  const int64_t state_device = offload ? 0 : state_bytes_;
  int64_t gradients_fb = 0;
  if (accumulation > 1 && !offload_gradients) {
    // Every gradient exists from the first micro-batch on, and one more is
    // being added (AccumulateGrad holds the new gradient before adding it).
    gradients_fb = trainable_bytes_ + largest_trainable_;
  } else {
    // Gradients appear as backward reaches each layer, while the activations
    // of the layers before it are still held: at layer i (backward order),
    // at most min(activation peak, what layers 0..i keep plus layer i's
    // backward) plus the gradients of layers i..n-1, or with gradient offload
    // (each leaves for the host once accumulated) layer i's own.
    const auto& layers = profile(s.precision(), s.selective_recompute()).layers;
    int64_t kept_before = 0;
    std::vector<int64_t> grads_from(layers.size() + 1, 0);
    for (size_t i = layers.size(); i-- > 0;) grads_from[i] = grads_from[i + 1] + layers[i].parameter_bytes;
    for (size_t i = 0; i < layers.size(); ++i) {
      kept_before += costs.kept[i];
      const int64_t held = std::min<int64_t>(
          sim.peak_bytes, kept_before + costs.x[i + 1] + costs.backward_extra(static_cast<int64_t>(i)));
      int64_t grads = offload_gradients ? layers[i].parameter_bytes : std::min(grads_from[i], trainable_bytes_);
      if (streamed) grads = streamed_extra(i);
      gradients_fb = std::max(gradients_fb, held + grads - sim.peak_bytes);
    }
  }
  // Workspaces (CUDA's cuBLAS ones) are held through every phase; streamed
  // parameters leave only the buffers (and one element per parameter) resident.
  const int64_t resident = streamed ? buffer_bytes_ : parameter_bytes_;
  const int64_t fb = workspace_bytes_ + resident + state_device + m * example_bytes_ +
                     gradients_fb + sim.peak_bytes;
  const int64_t step = workspace_bytes_ +
                       (offload ? resident + (offload_gradients ? 0 : trainable_bytes_)
                                : parameter_bytes_ + state_bytes_ + trainable_bytes_ + step_temporary_bytes_);
  // Recomputation at the calibrated price (see StepModel::calibrate_recomputation).
  const double plain_time = simulate(schedule_none(costs.size()), costs).time;
  const double chain_time = plain_time + recompute_factor_ * std::max(0.0, sim.time - plain_time);

  StepPrediction r;
  r.peak_bytes = std::max(fb, step);
  r.phase = fb >= step ? "forward/backward" : "optimizer step";
  r.forward_backward_bytes = fb;
  r.activation_bytes = sim.peak_bytes;
  r.optimizer_step_bytes = step;
  // Streamed: every parameter comes over twice per micro-batch, and tiles
  // cost what their smaller products cost more (the recomputation of layers
  // other than Linear is in the simulated schedule).
  const double stream_time = streamed ? 2 * stream_seconds_ + tile_seconds(m, s.tile_bytes()) : 0.0;
  r.seconds = double(accumulation) * (chain_time + stream_time) +
              (offload ? offloaded_step_seconds_ : step_seconds_) +
              (offload_gradients ? double(accumulation - 1) * gradient_offload_seconds_ : 0.0);
  r.accumulation_steps = accumulation;
  r.memory.peak = r.peak_bytes;
  r.memory.parameters = resident;
  r.memory.gradients = fb >= step ? gradients_fb : (offload_gradients ? 0 : trainable_bytes_);
  r.memory.optimizer_state = state_device;
  r.memory.activations =
      std::max<int64_t>(0, r.peak_bytes - r.memory.parameters - r.memory.gradients - r.memory.optimizer_state);
  return r;
}

TrainerOptions trainer_options(const StepSettings& s, TrainerOptions base) {
  return base.micro_batch_size(s.micro_batch())
      .precision(s.precision())
      .offload_optimizer(s.offload_optimizer())
      .offload_gradients(s.offload_gradients())
      .offload_parameters(s.offload_parameters())
      .stream(StreamOptions().tile_bytes(s.tile_bytes()));
}

std::string offload_text(const StepSettings& s) {
  if (s.offload_optimizer() != Offload::kHost) return "none";
  if (s.offload_parameters() == Offload::kHost) return "optimizer, gradients, parameters";
  return s.offload_gradients() == Offload::kHost ? "optimizer, gradients" : "optimizer";
}

namespace {

std::string schedule_text(const StepSettings& s) {
  return s.schedule().segments.empty() ? "none" : s.schedule().to_string();
}

} // namespace

std::optional<std::string> batch_statistics_layer(const torch::nn::Module& module) {
  for (const auto& item : module.named_modules()) {
    if (item.value()->name().find("BatchNorm") != std::string::npos) return item.key();
  }
  return std::nullopt;
}

namespace {
// Real steps of a candidate's settings (plan with make_model and data).
using StepRunner = std::function<detail::StepTiming(const StepSettings&)>;
Plan plan_with(const StepModel& model, const PlanOptions& o, int64_t batch, int64_t budget,
               const StepRunner* run = nullptr);
std::optional<std::vector<StepRecord>> run_steps(const std::function<torch::nn::Sequential()>& make_model,
                                                 const ImageDataset& data, int64_t batch, const StepSettings& s,
                                                 int64_t budget, const PlanOptions& o, const torch::Device& device,
                                                 int64_t steps);
} // namespace

std::vector<StepSettings> offload_choices(const StepModel& model, const PlanOptions& options) {
  std::vector<StepSettings> out = {StepSettings()};
  if (!options.offload()) return out;
  out.push_back(StepSettings().offload_optimizer(Offload::kHost));
  out.push_back(StepSettings().offload_optimizer(Offload::kHost).offload_gradients(Offload::kHost));
  const auto streamed = StepSettings()
                            .offload_optimizer(Offload::kHost)
                            .offload_gradients(Offload::kHost)
                            .offload_parameters(Offload::kHost);
  out.push_back(streamed);
  const int64_t largest = model.largest_linear_bytes();
  for (int64_t k : {4, 16, 64}) {
    if (largest >= 1024 * k) out.push_back(StepSettings(streamed).tile_bytes((largest + k - 1) / k));
  }
  return out;
}

Plan plan(const StepModel& model, int64_t batch, int64_t budget) {
  return plan_with(model, model.options(), batch, budget);
}

Plan plan(const StepModel& model, const std::function<torch::nn::Sequential()>& make_model,
          const ImageDataset& data, int64_t batch, int64_t budget) {
  TORCH_CHECK(make_model, "plan: make_model is empty; pass a function that builds the model planned for");
  TORCH_CHECK(data.size() >= batch, "plan: the data has ", data.size(), " examples, fewer than the batch of ",
              batch, "; plan a batch of ", data.size(), " or less");
  detail::RngStateGuard rng;  // the caller's random stream is untouched by the timed steps
  const StepRunner run = [&](const StepSettings& s) {
    detail::StepTiming out;
    const auto steps = run_steps(make_model, data, batch, s, budget, model.options(), model.device(), 2);
    if (!steps) return out;  // ran out of memory under the budget
    out.seconds = (*steps)[1].seconds;  // the first warms up (and creates the optimizer's state)
    for (const auto& r : *steps) out.peak_bytes = std::max(out.peak_bytes, r.peak_bytes);
    return out;
  };
  return plan_with(model, model.options(), batch, budget, &run);
}

namespace {
// What profiling measured, and what it extrapolates.
std::string profiling_text(const StepModel& model) {
  const auto& timed = model.timed_batches();
  return fmt::format("profiled one layer at a time: bytes at batches {} and {} (linear in the batch), "
                     "times at batches {}{}", model.profile_batch() / 2, model.profile_batch(),
                     fmt::join(timed, ", "),
                     timed.back() < model.options().time_batch()
                         ? ", larger micro-batches extrapolated linearly from the largest two"
                         : "");
}

// A candidate's knobs in a line of text: settings_text, with its checkpoint.
std::string candidate_text(const StepSettings& s, int64_t batch) {
  return detail::settings_text(s, batch) + (detail::recomputes(s.schedule()) ? ", checkpoint " + s.schedule().to_string() : "");
}

// Times the candidates of `fitting` that PlanOptions::measure_candidates
// names with `run`, records them in `plan` and returns the index chosen
// (`predicted`, the prediction's choice, when none ran; -1 when that is none:
// only edge candidates, and none of them fit).
int64_t choose_by_measurement(const std::vector<std::pair<StepSettings, StepPrediction>>& fitting,
                              const std::vector<detail::Ranked>& candidates, int64_t predicted,
                              const PlanOptions& o, const StepRunner& run, Plan& plan) {
  std::vector<int64_t> group;
  for (const auto& [settings, prediction] : fitting) {
    group.push_back(detail::timing_group(settings, candidates[group.size()].edge));
  }
  const auto order = detail::to_time(candidates, group, o.measure_within(), o.measure_candidates());
  const auto measured = detail::choose_measured(candidates, order, [&](size_t i) { return run(fitting[i].first); });
  const auto& timings = measured.timed;
  const int64_t chosen = measured.chosen;
  std::vector<std::string> names;
  std::vector<double> predictions;
  for (size_t k = 0; k < order.size(); ++k) {
    const auto& [settings, prediction] = fitting[order[k]];
    plan.timed.push_back({settings, {}, prediction.seconds, timings[k].seconds, timings[k].peak_bytes});
    if (static_cast<int64_t>(order[k]) == chosen) {
      plan.measured_seconds = timings[k].seconds;
      plan.measured_peak_bytes = timings[k].peak_bytes;
    }
    names.push_back(candidate_text(settings, plan.batch) +
                    detail::edge_text(candidates[order[k]].edge, prediction.peak_bytes));
    predictions.push_back(prediction.seconds);
  }
  plan.measured_tie = measured.tie;
  plan.why.push_back(detail::timed_text(names, predictions, measured));
  return chosen >= 0 ? chosen : predicted;
}

Plan plan_with(const StepModel& model, const PlanOptions& o, int64_t batch, int64_t budget, const StepRunner* run) {
  TORCH_CHECK(batch > 0, "plan: batch must be positive, got ", batch);
  TORCH_CHECK(budget > 0, "plan: budget must be positive, got ", budget);
  const int64_t limit = static_cast<int64_t>(std::floor(o.margin() * double(budget)));
  Plan best;
  best.budget = budget;
  best.batch = batch;
  // Plain: the first precision, and selective recomputation only when it is not a choice.
  const auto plain = StepSettings()
                         .precision(o.precisions().front())
                         .selective_recompute(model.selective_choices().front());
  const auto plain_prediction = model.predict(batch, plain);
  best.plain_peak_bytes = plain_prediction.peak_bytes;
  best.plain_seconds = plain_prediction.seconds;

  std::vector<int64_t> micro;
  for (int64_t m = batch;; m = (m + 1) / 2) {
    micro.push_back(m);
    if (m == 1 || !detail::may_micro_batch(o, model.batch_statistics())) break;
  }
  const auto offloads = offload_choices(model, o);
  // (precision, selective, micro-batch) that fit with coarser tiles: finer ones only add calls.
  std::set<std::tuple<Precision, bool, int64_t>> streamed_fits;

  int64_t frugal_need = std::numeric_limits<int64_t>::max();
  StepPrediction frugal;
  StepSettings frugal_settings;
  std::vector<std::pair<StepSettings, StepPrediction>> fitting;
  std::vector<std::pair<StepSettings, StepPrediction>> edges;  // see detail::is_edge
  for (auto precision : o.precisions()) {
    for (bool selective : model.selective_choices()) {
      for (const auto& offload : offloads) {
        const bool streamed = offload.offload_parameters() == Offload::kHost;
        if (streamed && precision != Precision::kFP32) continue;  // streams fp32 only
        for (int64_t m : micro) {
          if (streamed && streamed_fits.count({precision, selective, m}) > 0) continue;
          auto s = StepSettings(offload)
                       .micro_batch(m == batch ? 0 : m)
                       .precision(precision)
                       .selective_recompute(selective);
          auto p = model.predict(batch, s);
          ++best.candidates;
          const auto costs = model.costs(precision, m, selective);
          // Without checkpointing this combination needs p.peak_bytes; with the
          // most frugal schedule, its fixed part plus min_budget.
          const int64_t fixed = p.forward_backward_bytes - p.activation_bytes;
          const int64_t need = o.checkpointing()
                                   ? std::max(fixed + min_budget(costs), p.optimizer_step_bytes)
                                   : p.peak_bytes;
          if (need < frugal_need) {
            frugal_need = need;
            frugal = p;
            frugal_settings = s;
          }
          if (detail::is_edge(o, run != nullptr, p.peak_bytes, limit, budget)) edges.emplace_back(s, p);
          if (p.peak_bytes > limit && o.checkpointing()) {
            const int64_t room = limit - fixed;
            if (p.optimizer_step_bytes > limit || room <= 0) continue;
            try {
              s.schedule(solve_optimal(costs, room));
            } catch (const c10::Error&) {
              continue;  // even the most frugal schedule needs more than the room left
            }
            p = model.predict(batch, s);
            ++best.candidates;
          }
          if (p.peak_bytes > limit) continue;
          if (streamed) streamed_fits.insert({precision, selective, m});
          fitting.emplace_back(s, p);
        }
      }
    }
  }
  const size_t within_margin = fitting.size();
  fitting.insert(fitting.end(), edges.begin(), edges.end());
  std::vector<detail::Ranked> candidates;
  for (size_t i = 0; i < fitting.size(); ++i) {
    const auto& [settings, prediction] = fitting[i];
    candidates.push_back(detail::ranked(settings, prediction, detail::recomputes(settings.schedule())));
    candidates.back().edge = i >= within_margin;
  }
  int64_t chosen = detail::choose(candidates);
  if (run && o.measure_candidates() > 0 && !candidates.empty()) {
    chosen = choose_by_measurement(fitting, candidates, chosen, o, *run, best);
  }
  if (chosen >= 0) {
    best.fits = true;
    best.settings = fitting[static_cast<size_t>(chosen)].first;
    best.predicted = fitting[static_cast<size_t>(chosen)].second;
    if (candidates[static_cast<size_t>(chosen)].edge) {
      best.why.push_back(detail::edge_chosen_text(best.predicted.peak_bytes, limit, o, best.measured_peak_bytes));
    }
  }
  TORCH_CHECK(best.fits, "no combination of micro-batching",
              o.checkpointing() ? ", checkpointing" : "",
              o.offload() ? ", offload (optimizer state, gradients, parameters)" : "",
              " and precision (", o.precisions().size(), " allowed) fits ", format_bytes(budget),
              " for a batch of ", batch, ": the most frugal (", detail::settings_text(frugal_settings, batch),
              o.checkpointing() ? ", the most frugal checkpoint schedule" : ", no checkpointing", ") needs about ", format_bytes(static_cast<int64_t>(std::ceil(double(frugal_need) / o.margin()))),
              ", of which parameters, gradients and optimizer state take ",
              format_bytes(frugal.memory.parameters + frugal.memory.gradients +
                           frugal.memory.optimizer_state),
              "; raise the budget, or shrink the model", detail::unlock_text(o, model.batch_statistics()));

  const auto& s = best.settings;
  const auto& p = best.predicted;
  best.why.push_back(fmt::format(
      "free savings, always on: gradients released between steps, in-place ReLUs, evaluation "
      "under no-grad"));
  best.why.push_back(fmt::format("plain step ({}, whole batch of {}, no checkpointing): predicted "
                                 "peak {} {} the limit {} ({:.0f}% of the budget {})",
                                 to_string(o.precisions().front()), batch,
                                 format_bytes(best.plain_peak_bytes),
                                 best.plain_peak_bytes <= limit ? "fits" : "exceeds",
                                 format_bytes(limit), 100 * o.margin(), format_bytes(budget)));
  best.why.push_back(profiling_text(model));
  if (model.workspace_bytes() > 0) {
    best.why.push_back(fmt::format("device workspaces (cuBLAS, held by every step): {}",
                                   format_bytes(model.workspace_bytes())));
  }
  best.why.push_back(detail::micro_batch_text(o, model.batch_statistics(), s.micro_batch(), p.accumulation_steps, batch));
  detail::SettingsDetail detail;
  detail.optimizer_state = " (" + format_bytes(model.optimizer_state_bytes()) + ")";
  detail.crossing = fmt::format(" ({:.1f} ms each time)", 1e3 * model.stream_seconds());
  if (s.tile_bytes() > 0) {
    detail.tiles = fmt::format(", whose smaller products add {:.1f} ms a micro-batch",
                               1e3 * model.tile_seconds(s.micro_batch() > 0 ? s.micro_batch() : batch, s.tile_bytes()));
  }
  for (auto& line : detail::settings_lines(s, model.selective_choices().back(),
                                           s.schedule().segments.empty() ? "" : s.schedule().to_string(), detail)) {
    best.why.push_back(std::move(line));
  }
  best.why.push_back(fmt::format("predicted peak {} ({} phase), {:.1f} ms per batch, {:.2f}x the "
                                 "plain step's time{}",
                                 format_bytes(p.peak_bytes), p.phase, 1e3 * p.seconds,
                                 best.plain_seconds > 0 ? p.seconds / best.plain_seconds : 0.0,
                                 best.measured_seconds > 0 ? fmt::format("; measured {:.1f} ms", 1e3 * best.measured_seconds)
                                                           : std::string()));
  return best;
}
} // namespace

namespace {

// `steps` real steps of a fresh `make_model()` with `s` under `budget` bytes
// beyond what is allocated now: their records (peaks beyond that), or
// nullopt when one ran out of memory under it.
std::optional<std::vector<StepRecord>> run_steps(const std::function<torch::nn::Sequential()>& make_model,
                                                 const ImageDataset& data, int64_t batch, const StepSettings& s,
                                                 int64_t budget, const PlanOptions& o, const torch::Device& device,
                                                 int64_t steps) {
  const int64_t base = memory_allocated(device);
  compat::WarningCapture quiet;  // the Trainer's warnings repeat what the plan says
  std::optional<BudgetGuard> budget_scope;  // the caller's budget comes back, also after a throw
  try {
    auto chain = make_model();
    set_selective_recompute(chain, s.selective_recompute());
    CheckpointedSequential model(chain);
    if (!s.schedule().segments.empty()) model->set_schedule(s.schedule());
    Trainer trainer(torch::nn::Sequential(model), trainer_options(s, TrainerOptions()
                                                                         .batch_size(batch)
                                                                         .steps(steps)
                                                                         .optimizer(o.optimizer())
                                                                         .momentum(o.momentum())
                                                                         .weight_decay(o.weight_decay())
                                                                         .device(device)));
    budget_scope.emplace(device, base + budget);
    auto report = trainer.fit(data);
    for (auto& r : report.steps) r.peak_bytes -= base;
    return report.steps;
  } catch (const c10::OutOfMemoryError&) {
    return std::nullopt;
  }
}

// The plan for one pass of `batch` examples, or nothing when none fits.
std::optional<Plan> one_pass_plan(const StepModel& model, const PlanOptions& o, int64_t batch,
                                  int64_t budget) {
  try {
    return plan_with(model, o, batch, budget);
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

} // namespace

BatchSearch find_batch(const StepModel& model,
                       const std::function<torch::nn::Sequential()>& make_model,
                       const ImageDataset& data, int64_t budget, const FindBatchOptions& options) {
  TORCH_CHECK(budget > 0, "find_batch: budget must be positive, got ", budget);
  TORCH_CHECK(options.max_batch() > 0, "find_batch: max_batch must be positive, got ",
              options.max_batch());
  TORCH_CHECK(!options.verify() || data.size() > 0, "find_batch needs data to verify with");
  const auto& o = model.options();
  const int64_t limit = static_cast<int64_t>(std::floor(o.margin() * double(budget)));
  const int64_t top = options.verify() ? std::min(options.max_batch(), data.size()) : options.max_batch();
  BatchSearch out;
  const auto plain_settings =
      StepSettings().precision(o.precisions().front()).selective_recompute(model.selective_choices().front());
  // Each search with its verification; `settings_for` gives the knobs for a batch.
  auto search = [&](BatchFound& found, const std::function<std::optional<StepSettings>(int64_t)>& settings_for) {
    found.batch = detail::largest_fitting(top, [&](int64_t b) { return settings_for(b).has_value(); });
    while (found.batch > 0) {
      found.settings = *settings_for(found.batch);
      found.predicted_peak_bytes = model.predict(found.batch, found.settings).peak_bytes;
      if (!options.verify() || found.attempts >= options.attempts()) return;
      ++found.attempts;
      if (const auto steps = run_steps(make_model, data, found.batch, found.settings, budget, o, model.device(), 2)) {
        found.verified = true;
        for (const auto& r : *steps) found.measured_peak_bytes = std::max(found.measured_peak_bytes, r.peak_bytes);
        return;
      }
      found.batch = std::max<int64_t>(0, static_cast<int64_t>(double(found.batch) * 0.9));
      while (found.batch > 0 && !settings_for(found.batch)) --found.batch;
    }
  };
  search(out.plain, [&](int64_t b) -> std::optional<StepSettings> {
    if (model.predict(b, plain_settings).peak_bytes > limit) return std::nullopt;
    return plain_settings;
  });
  auto one_pass = o;
  one_pass.micro_batching(false);
  search(out.techniques, [&](int64_t b) -> std::optional<StepSettings> {
    // plan() with micro-batching off: checkpointing, offload, precision only.
    const auto p = one_pass_plan(model, one_pass, b, budget);
    if (!p) return std::nullopt;
    return p->settings;
  });
  return out;
}

ModelProfile profile(const torch::nn::Sequential& model, const torch::Tensor& sample_batch,
                     OptimizerKind optimizer) {
  TORCH_CHECK(!model.is_empty() && model->size() > 0, "profile needs a non-empty Sequential");
  TORCH_CHECK(sample_batch.defined() && sample_batch.dim() >= 1 && sample_batch.size(0) > 0,
              "profile needs a sample batch with at least one example");
  ModelProfile out;
  out.chain = profile_chain(model, sample_batch);
  // The steps train the model itself; its parameters, buffers, gradients and
  // the RNG are put back afterwards (modules need not be Cloneable).
  detail::ModuleStateGuard restore(*model);
  ImageDataset batch;
  {
    UntrackedGuard host;  // the sample is host data, as a data set is
    batch.images = sample_batch.detach().to(torch::kCPU).clone();
    // A class per example; for token ids (a language model), one per token.
    batch.labels = torch::is_floating_point(sample_batch) ? torch::zeros({sample_batch.size(0)}, torch::kInt64)
                                                          : torch::zeros_like(sample_batch, torch::kInt64);
  }
  Trainer trainer(model, TrainerOptions()
                             .batch_size(sample_batch.size(0))
                             .steps(2)
                             .optimizer(optimizer)
                             .device(sample_batch.device()));
  const auto report = trainer.fit(batch);
  out.step = report.step_memory;
  out.step_seconds = report.steps.back().seconds;
  return out;
}

namespace {
// Each chain's schedule, "; "-separated ("none" for a plain one).
std::string chains_text(const std::vector<Schedule>& schedules) {
  std::vector<std::string> out;
  for (const auto& s : schedules) out.push_back(detail::recomputes(s) ? s.to_string() : std::string("none"));
  return fmt::format("{}", fmt::join(out, "; "));
}
} // namespace

std::string Plan::to_json() const {
  nlohmann::json timed_json = nlohmann::json::array();
  for (const auto& t : timed) {
    timed_json.push_back({{"micro_batch", t.settings.micro_batch() > 0 ? t.settings.micro_batch() : batch},
                          {"precision", to_string(t.settings.precision())},
                          {"offload", offload_text(t.settings)},
                          {"checkpoint", t.schedules.empty() ? schedule_text(t.settings) : chains_text(t.schedules)},
                          {"predicted_seconds", t.predicted_seconds},
                          {"measured_seconds", t.measured_seconds},
                          {"measured_peak_bytes", t.measured_peak_bytes}});
  }
  nlohmann::json j = {{"fits", fits},
                      {"budget_bytes", budget},
                      {"batch", batch},
                      {"micro_batch", settings.micro_batch() > 0 ? settings.micro_batch() : batch},
                      {"accumulation_steps", predicted.accumulation_steps},
                      {"precision", to_string(settings.precision())},
                      {"checkpoint", schedule_text(settings)},
                      {"selective_recompute", settings.selective_recompute()},
                      {"offload", offload_text(settings)},
                      {"tile_bytes", settings.tile_bytes()},
                      {"predicted_peak_bytes", predicted.peak_bytes},
                      {"predicted_seconds", predicted.seconds},
                      {"predicted_phase", predicted.phase},
                      {"plain_peak_bytes", plain_peak_bytes},
                      {"plain_seconds", plain_seconds},
                      {"candidates", candidates},
                      {"measured_seconds", measured_seconds},
                      {"measured_peak_bytes", measured_peak_bytes},
                      {"measured_tie", measured_tie},
                      {"timed", timed_json},
                      {"predicted_memory", nlohmann::json::parse(predicted.memory.to_json())},
                      {"why", why}};
  return j.dump(2);
}

std::string Plan::explain() const {
  std::string out = fmt::format("plan for a batch of {} under {}: {}\n", batch, format_bytes(budget),
                                fits ? "fits" : "does not fit");
  for (const auto& line : why) out += "  - " + line + "\n";
  return out;
}

// ---------------------------------------------------------------------------
// Broadcasting a plan

namespace {
nlohmann::json segments_wire(const std::vector<Segment>& segments) {
  auto j = nlohmann::json::array();
  for (const auto& s : segments) j.push_back({s.begin, s.end, s.checkpointed, segments_wire(s.inner)});
  return j;
}

std::vector<Segment> segments_from_wire(const nlohmann::json& j) {
  std::vector<Segment> out;
  for (const auto& s : j) out.push_back({s.at(0).get<int64_t>(), s.at(1).get<int64_t>(), s.at(2).get<bool>(),
                                         segments_from_wire(s.at(3))});
  return out;
}

nlohmann::json settings_wire(const StepSettings& s) {
  return {{"micro_batch", s.micro_batch()},
          {"precision", static_cast<int>(s.precision())},
          {"schedule", segments_wire(s.schedule().segments)},
          {"offload_optimizer", static_cast<int>(s.offload_optimizer())},
          {"offload_gradients", static_cast<int>(s.offload_gradients())},
          {"offload_parameters", static_cast<int>(s.offload_parameters())},
          {"tile_bytes", s.tile_bytes()},
          {"selective_recompute", s.selective_recompute()}};
}

StepSettings settings_from_wire(const nlohmann::json& j) {
  return StepSettings()
      .micro_batch(j.at("micro_batch").get<int64_t>())
      .precision(static_cast<Precision>(j.at("precision").get<int>()))
      .schedule(Schedule{segments_from_wire(j.at("schedule"))})
      .offload_optimizer(static_cast<Offload>(j.at("offload_optimizer").get<int>()))
      .offload_gradients(static_cast<Offload>(j.at("offload_gradients").get<int>()))
      .offload_parameters(static_cast<Offload>(j.at("offload_parameters").get<int>()))
      .tile_bytes(j.at("tile_bytes").get<int64_t>())
      .selective_recompute(j.at("selective_recompute").get<bool>());
}

nlohmann::json prediction_wire(const StepPrediction& p) {
  const auto& m = p.memory;
  return {{"peak_bytes", p.peak_bytes},
          {"memory", {m.peak, m.parameters, m.gradients, m.optimizer_state, m.activations}},
          {"seconds", p.seconds},
          {"accumulation_steps", p.accumulation_steps},
          {"phase", p.phase},
          {"forward_backward_bytes", p.forward_backward_bytes},
          {"activation_bytes", p.activation_bytes},
          {"optimizer_step_bytes", p.optimizer_step_bytes}};
}

StepPrediction prediction_from_wire(const nlohmann::json& j) {
  StepPrediction p;
  p.peak_bytes = j.at("peak_bytes").get<int64_t>();
  const auto& m = j.at("memory");
  p.memory = {m.at(0).get<int64_t>(), m.at(1).get<int64_t>(), m.at(2).get<int64_t>(), m.at(3).get<int64_t>(),
              m.at(4).get<int64_t>()};
  p.seconds = j.at("seconds").get<double>();
  p.accumulation_steps = j.at("accumulation_steps").get<int64_t>();
  p.phase = j.at("phase").get<std::string>();
  p.forward_backward_bytes = j.at("forward_backward_bytes").get<int64_t>();
  p.activation_bytes = j.at("activation_bytes").get<int64_t>();
  p.optimizer_step_bytes = j.at("optimizer_step_bytes").get<int64_t>();
  return p;
}
} // namespace

namespace detail {

nlohmann::json schedules_wire(const std::vector<Schedule>& schedules) {
  auto j = nlohmann::json::array();
  for (const auto& s : schedules) j.push_back(segments_wire(s.segments));
  return j;
}

std::vector<Schedule> schedules_from_wire(const nlohmann::json& wire) {
  std::vector<Schedule> out;
  for (const auto& s : wire) out.push_back(Schedule{segments_from_wire(s)});
  return out;
}

// A plan as JSON that gives every field back exactly (not Plan::to_json,
// which reports), and back.
nlohmann::json plan_wire(const Plan& plan) {
  auto timed = nlohmann::json::array();
  for (const auto& t : plan.timed) {
    timed.push_back({{"settings", settings_wire(t.settings)},
                     {"schedules", schedules_wire(t.schedules)},
                     {"predicted_seconds", t.predicted_seconds},
                     {"measured_seconds", t.measured_seconds},
                     {"measured_peak_bytes", t.measured_peak_bytes}});
  }
  return {{"fits", plan.fits},
          {"budget", plan.budget},
          {"batch", plan.batch},
          {"settings", settings_wire(plan.settings)},
          {"predicted", prediction_wire(plan.predicted)},
          {"plain_seconds", plan.plain_seconds},
          {"plain_peak_bytes", plan.plain_peak_bytes},
          {"candidates", plan.candidates},
          {"timed", timed},
          {"measured_seconds", plan.measured_seconds},
          {"measured_peak_bytes", plan.measured_peak_bytes},
          {"measured_tie", plan.measured_tie},
          {"why", plan.why}};
}

void plan_from_wire(const nlohmann::json& j, Plan& plan) {
  plan.fits = j.at("fits").get<bool>();
  plan.budget = j.at("budget").get<int64_t>();
  plan.batch = j.at("batch").get<int64_t>();
  plan.settings = settings_from_wire(j.at("settings"));
  plan.predicted = prediction_from_wire(j.at("predicted"));
  plan.plain_seconds = j.at("plain_seconds").get<double>();
  plan.plain_peak_bytes = j.at("plain_peak_bytes").get<int64_t>();
  plan.candidates = j.at("candidates").get<int64_t>();
  plan.timed.clear();
  for (const auto& t : j.at("timed")) {
    TimedCandidate c;
    c.settings = settings_from_wire(t.at("settings"));
    c.schedules = schedules_from_wire(t.at("schedules"));
    c.predicted_seconds = t.at("predicted_seconds").get<double>();
    c.measured_seconds = t.at("measured_seconds").get<double>();
    c.measured_peak_bytes = t.at("measured_peak_bytes").get<int64_t>();
    plan.timed.push_back(std::move(c));
  }
  plan.measured_seconds = j.at("measured_seconds").get<double>();
  plan.measured_peak_bytes = j.at("measured_peak_bytes").get<int64_t>();
  plan.measured_tie = j.at("measured_tie").get<double>();
  plan.why = j.at("why").get<std::vector<std::string>>();
}

void broadcast_plan_wire(Plan& plan, ProcessGroup& group, int64_t root,
                         const std::function<void(nlohmann::json&)>& add,
                         const std::function<void(const nlohmann::json&)>& take) {
  TORCH_CHECK(root >= 0 && root < group.size(), "broadcast_plan: root ", root, " is not a rank of the group of ",
              group.size(), "; use 0 to ", group.size() - 1);
  const bool mine = group.rank() == root;
  std::string text;
  if (mine) {
    auto wire = plan_wire(plan);
    add(wire);
    text = wire.dump();
  }
  {
    UntrackedGuard host;  // a few KiB of host memory, outside the budget
    auto size = torch::tensor({static_cast<int64_t>(text.size())}, torch::kLong);
    group.broadcast_(size, root);
    auto bytes = torch::zeros({size.item<int64_t>()}, torch::kUInt8);
    if (mine) std::memcpy(bytes.data_ptr<uint8_t>(), text.data(), text.size());
    group.broadcast_(bytes, root);
    text.assign(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<size_t>(bytes.numel()));
  }
  if (!mine) {
    const auto wire = nlohmann::json::parse(text);
    plan_from_wire(wire, plan);
    take(wire);
  }
  const auto line = fmt::format("rank {}'s plan, broadcast to all {} ranks (broadcast_plan): every rank trains "
                                "with it, whatever its own timings said", root, group.size());
  // Once: a plan loaded from a saved run's (save_plan) may say it already.
  if (group.size() > 1 && std::find(plan.why.begin(), plan.why.end(), line) == plan.why.end()) {
    plan.why.push_back(line);
  }
}

} // namespace detail

void broadcast_plan(Plan& plan, ProcessGroup& group, int64_t root) {
  detail::broadcast_plan_wire(plan, group, root, [](nlohmann::json&) {}, [](const nlohmann::json&) {});
}

} // namespace memfit
