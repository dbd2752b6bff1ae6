#include "memfit/profile.h"

#include "compat.h"
#include "memfit/memory.h"

#include <torch/autograd.h>
#include <torch/cuda.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace memfit {
namespace {

using Clock = std::chrono::steady_clock;
using torch::autograd::variable_list;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int64_t tensor_bytes(const torch::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : 0;
}

// Copies of a module's buffers (host memory), to undo what a profiling run
// does to them (BatchNorm's running statistics).
std::vector<torch::Tensor> snapshot_buffers(const std::shared_ptr<torch::nn::Module>& m) {
  UntrackedGuard host;
  std::vector<torch::Tensor> copies;
  for (const auto& b : m->buffers()) copies.push_back(b.detach().clone());
  return copies;
}

void restore_buffers(const std::shared_ptr<torch::nn::Module>& m,
                     const std::vector<torch::Tensor>& copies) {
  torch::NoGradGuard no_grad;
  auto buffers = m->buffers();
  for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(copies[i]);
}

// Sets the parameters' own gradients aside for the scope of a profiling
// backward (a plain one, which memfit::checkpoint inside a layer needs) and
// puts them back at its end, also when backward throws.
class GradientsSetAside {
 public:
  explicit GradientsSetAside(std::vector<torch::Tensor> params) : params_(std::move(params)) {
    for (auto& p : params_) stashed_.push_back(std::exchange(p.mutable_grad(), torch::Tensor()));
  }
  ~GradientsSetAside() {
    for (size_t k = 0; k < params_.size(); ++k) params_[k].mutable_grad() = std::move(stashed_[k]);
  }
  GradientsSetAside(const GradientsSetAside&) = delete;
  GradientsSetAside& operator=(const GradientsSetAside&) = delete;
  // The gradients the backward left in the parameters.
  std::vector<torch::Tensor> gradients() const {
    std::vector<torch::Tensor> grads;
    for (const auto& p : params_) grads.push_back(p.grad());
    return grads;
  }

 private:
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> stashed_;
};

} // namespace

int64_t ChainProfile::plain_activation_bytes() const {
  int64_t total = 0;
  for (const auto& l : layers) total += l.kept_bytes;
  return total;
}

std::string ChainProfile::table() const {
  std::string out = fmt::format("{:>4} {:<22}{:>12}{:>12}{:>12}{:>10}{:>10}\n", "#", "layer",
                                "input", "kept", "params", "fwd ms", "bwd ms");
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& l = layers[i];
    out += fmt::format("{:>4} {:<22}{:>12}{:>12}{:>12}{:>10.3f}{:>10.3f}{}\n", i,
                       l.name.substr(0, 21), format_bytes(l.input_bytes),
                       format_bytes(l.kept_bytes), format_bytes(l.parameter_bytes),
                       1e3 * l.forward_seconds, 1e3 * l.backward_seconds,
                       l.in_place ? " in-place" : "");
  }
  return out;
}

std::string ChainProfile::to_json() const {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& l : layers) {
    j.push_back({{"name", l.name},
                 {"input_bytes", l.input_bytes},
                 {"output_bytes", l.output_bytes},
                 {"kept_bytes", l.kept_bytes},
                 {"forward_peak_bytes", l.forward_peak_bytes},
                 {"backward_overhead_bytes", l.backward_overhead_bytes},
                 {"parameter_bytes", l.parameter_bytes},
                 {"forward_seconds", l.forward_seconds},
                 {"backward_seconds", l.backward_seconds},
                 {"in_place", l.in_place},
                 {"frees_input", l.frees_input}});
  }
  return j.dump(2);
}

namespace {

// Runs the chain forward and backward once (gradients computed, not
// accumulated; buffers restored; autocast's cast cache dropped) and returns
// the device bytes the run left allocated: workspaces allocated on first use
// (cuBLAS's are freed first, so they are counted even if they existed).
int64_t warm_up(const torch::nn::Sequential& chain, std::vector<torch::nn::AnyModule>& modules,
                const torch::Tensor& sample_input) {
  const auto device = sample_input.device();
  std::vector<std::vector<torch::Tensor>> buffers;
  for (auto& m : modules) buffers.push_back(snapshot_buffers(m.ptr()));
#if defined(MEMFIT_WITH_CUDA)
  // Workspaces that exist already (an earlier run made them) are freed, so
  // that this run allocates and measures them whatever ran before.
  compat::cuda_clear_blas_workspaces();
#endif
  const int64_t before = memory_allocated(device);
  {
    const bool floating = sample_input.is_floating_point();
    auto leaf = floating ? sample_input.detach().requires_grad_(true) : sample_input.detach();
    torch::Tensor y = floating ? leaf.clone() : leaf;
    for (auto& m : modules) y = m.forward(y);
    std::vector<torch::Tensor> wrt;
    if (floating) wrt.push_back(leaf);
    for (const auto& p : chain->parameters()) {
      if (p.requires_grad()) wrt.push_back(p);
    }
    if (y.requires_grad() && !wrt.empty()) {
      GradientsSetAside aside({wrt.begin() + (floating ? 1 : 0), wrt.end()});
      y.to(torch::kFloat).sum().backward();
    }
  }
  compat::clear_autocast_cache();
  for (size_t i = 0; i < modules.size(); ++i) restore_buffers(modules[i].ptr(), buffers[i]);
  torch::cuda::synchronize();
  return std::max<int64_t>(0, memory_allocated(device) - before);
}

// Each layer's kept bytes as the chain keeps them. Profiled alone, a layer
// counts its output as kept; in the chain, the tensor between layers i-1 and
// i is let go of once layer i has run unless autograd holds it for one of
// them: a Linear's output before a Tanh, which saves its result, is freed.
// Layer i's growth then counts that tensor freed.
void in_chain(ChainProfile& p, const std::vector<bool>& keeps_input, const std::vector<bool>& keeps_output) {
  for (size_t i = 1; i < p.layers.size(); ++i) {
    auto& l = p.layers[i];
    l.frees_input = !keeps_output[i - 1] && !keeps_input[i] && !p.layers[i - 1].in_place;
    if (l.frees_input) l.kept_bytes = std::max<int64_t>(0, l.kept_bytes - l.input_bytes);
  }
}

// What a layer does, as far as its time goes: the module as it prints (its
// type, its options, its children's), with its bytes in, out, kept and at
// its peaks. Layers with one key do the same work on the same shapes.
std::string work_key(const torch::nn::Module& module, const LayerProfile& l) {
  std::ostringstream key;
  key << module << ' ' << l.input_bytes << ' ' << l.output_bytes << ' ' << l.parameter_bytes << ' ' << l.kept_bytes
      << ' ' << l.forward_peak_bytes << ' ' << l.backward_overhead_bytes << ' ' << l.in_place;
  return key.str();
}

// Each layer's times are the median of its timed runs and those of every
// layer that does the same work (work_key): timing noise cannot set apart
// layers that do the same (a ResNet stage's blocks, a GPT's), so what a
// schedule recomputes among them does not follow the noise.
void same_work_same_time(ChainProfile& p, const std::vector<std::string>& work,
                         const std::vector<std::vector<double>>& fwds, const std::vector<std::vector<double>>& bwds) {
  TORCH_INTERNAL_ASSERT(work.size() == p.layers.size() && fwds.size() == work.size() && bwds.size() == work.size());
  std::map<std::string, std::pair<std::vector<double>, std::vector<double>>> runs;  // each key's forward, backward runs
  for (size_t i = 0; i < work.size(); ++i) {
    auto& [fwd, bwd] = runs[work[i]];
    fwd.insert(fwd.end(), fwds[i].begin(), fwds[i].end());
    bwd.insert(bwd.end(), bwds[i].begin(), bwds[i].end());
  }
  std::map<std::string, std::pair<double, double>> medians;
  for (const auto& [key, run] : runs) medians[key] = {median(run.first), median(run.second)};
  for (size_t i = 0; i < work.size(); ++i) {
    std::tie(p.layers[i].forward_seconds, p.layers[i].backward_seconds) = medians.at(work[i]);
  }
}

} // namespace

// Over 80 lines: each layer's measured pass takes a dozen readings (bytes,
// peaks, times, what autograd holds) that its record needs together; pieces
// would pass them all.
ChainProfile profile_chain(const torch::nn::Sequential& chain, const torch::Tensor& sample_input,
                           const ProfileOptions& options) {
  TORCH_CHECK(!chain.is_empty() && chain->size() > 0, "profile_chain needs a non-empty Sequential");
  TORCH_CHECK(sample_input.defined(), "profile_chain needs a sample input");
  TORCH_CHECK(options.repeats() >= 1, "profile_chain: repeats must be at least 1, got ",
              options.repeats());
  memory_allocated(sample_input.device());  // starts tracking
  const auto device = sample_input.device();
  std::vector<torch::nn::AnyModule> modules(chain->begin(), chain->end());
  const auto named = chain->named_children();

  compat::RngState rng;
  {
    UntrackedGuard host;
    rng = compat::get_rng_state({});
  }
  ChainProfile profile;
  std::vector<std::string> work;               // what each layer does: its work_key
  std::vector<std::vector<double>> fwds, bwds;  // each layer's timed runs
  if (device.is_cuda()) profile.workspace_bytes = warm_up(chain, modules, sample_input);
  torch::Tensor x = sample_input.detach();
  std::vector<bool> keeps_input, keeps_output;  // autograd holds the layer's input / output
  for (size_t i = 0; i < modules.size(); ++i) {
    auto& module = modules[i];
    const auto ptr = module.ptr();
    const auto buffers = snapshot_buffers(ptr);
    LayerProfile l;
    l.name = i < named.size() ? named[i].key() : std::to_string(i);
    l.input_bytes = tensor_bytes(x);
    l.parameter_bytes = storage_bytes(ptr->parameters());
    std::vector<double> fwd, bwd;
    for (int64_t r = 0; r <= options.repeats(); ++r) {  // r == 0 warms up
      const bool floating = x.is_floating_point();
      // A non-leaf input, so in-place layers may modify it.
      auto leaf = floating ? x.detach().requires_grad_(true) : x.detach();
      auto input = floating ? leaf.clone() : leaf;
      std::vector<torch::Tensor> wrt;
      if (floating) wrt.push_back(input);
      for (const auto& p : ptr->parameters()) {
        if (p.requires_grad()) wrt.push_back(p);
      }
      const int64_t before = memory_allocated(device);
      PeakMeter meter(device);
      const auto t0 = Clock::now();
      torch::Tensor y = module.forward(input);
      const double f = std::chrono::duration<double>(Clock::now() - t0).count();
      const int64_t kept = memory_allocated(device) - before;
      const int64_t fwd_peak = meter.peak() - before;
      // The output and parameter flags are read now: `y` is let go of below.
      const int64_t out_bytes = tensor_bytes(y);
      const bool shares_input = y.has_storage() && input.has_storage() &&
                                y.storage().unsafeGetStorageImpl() == input.storage().unsafeGetStorageImpl();
      // Whether autograd holds the input (its handle beyond `input` and
      // `wrt`'s copy, or its storage under another handle) and the output.
      const bool holds_input = !floating || shares_input || input.use_count() > 2 ||
                               input.storage().use_count() > 1;
      const bool holds_output = shares_input || !y.has_storage() || y.use_count() > 1 ||
                                y.storage().use_count() > 1;
      double b = 0;
      int64_t backward_overhead = 0;
      if (y.requires_grad() && !wrt.empty()) {
        // As in a chain: autograd alone holds the output (through what the
        // layer saved) and the output's gradient. Gradients accumulate into
        // .grad as in training.
        GradientsSetAside aside({wrt.begin() + (floating ? 1 : 0), wrt.end()});
        torch::autograd::edge_list roots{torch::autograd::impl::gradient_edge(y)};
        variable_list grad_out{torch::ones_like(y)};
        y = torch::Tensor();
        const int64_t before_backward = memory_allocated(device);  // kept + output gradient
        PeakMeter backward_meter(device);
        const auto t1 = Clock::now();
        torch::autograd::Engine::get_default_engine().execute(roots, grad_out, /*keep_graph=*/false,
                                                              /*create_graph=*/false,
                                                              /*accumulate_grad=*/true, {});
        b = std::chrono::duration<double>(Clock::now() - t1).count();
        // Parameter gradients belong to the gradients, not to activations.
        backward_overhead = backward_meter.peak() - before_backward - storage_bytes(aside.gradients());
      }
      if (r == 0) {
        l.kept_bytes = kept;
        l.forward_peak_bytes = fwd_peak;
        l.backward_overhead_bytes = std::max<int64_t>(0, backward_overhead);
        l.output_bytes = out_bytes;
        l.in_place = shares_input;
        keeps_input.push_back(holds_input);
        keeps_output.push_back(holds_output);
      } else {
        fwd.push_back(f);
        bwd.push_back(b);
      }
      restore_buffers(ptr, buffers);
    }
    work.push_back(work_key(*ptr, l));
    fwds.push_back(fwd);
    bwds.push_back(bwd);
    {
      torch::NoGradGuard no_grad;  // the next layer's input, without a graph
      x = module.forward(x.clone()).detach();
    }
    restore_buffers(ptr, buffers);
    profile.layers.push_back(l);
  }
  compat::set_rng_state(rng);
  same_work_same_time(profile, work, fwds, bwds);
  in_chain(profile, keeps_input, keeps_output);
  return profile;
}

} // namespace memfit
