#pragma once
// The planner's step model: a user's training step measured in windows at
// fixed points (Mark), each window's peak and time fitted as a line in the
// micro-batch, and ModuleStepModel::predict, which moves the windows by what
// each chain's checkpoint schedule changes. The choice (plan_choice.h) asks
// it for predictions and schedules; the report (plan_report.h) words them.
// docs/planner.md, "How it measures", states the design.

#include "compat.h"
#include "memfit/memory.h"
#include "memfit/module_plan.h"
#include "memfit/plan.h"
#include "memfit/profile.h"
#include "memfit/schedule.h"

#include <torch/nn/module.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace memfit {
namespace detail {

// Selective recomputation's choices for a model that has SelectivelyRecomputed
// modules (`recomputable`) or not, as `options` allow; the first is the plain step's.
std::vector<bool> selective_choices(const PlanOptions& options, bool recomputable);

// Checks PlanOptions::measure_candidates and measure_within (both planners).
void check_measure_options(const PlanOptions& o);

// The CPU random generator's state, put back on destruction: planning's
// real steps draw from it (initialisation, dropout, shuffling).
class RngStateGuard {
 public:
  RngStateGuard() {
    UntrackedGuard host;  // host bookkeeping, not bytes of the step measured
    rng_ = compat::get_rng_state({});
  }
  ~RngStateGuard() { compat::set_rng_state(rng_); }
  RngStateGuard(const RngStateGuard&) = delete;
  RngStateGuard& operator=(const RngStateGuard&) = delete;

 private:
  compat::RngState rng_;
};

// A module's parameters, buffers and gradients and the CPU RNG, copied to
// the host and put back on destruction: planning trains the module itself.
// A parameter that a streamed Trainer left in its host master's storage
// (MasterWeights gives the model back in host memory) gets memory where it
// was, from the allocator it came from, before its values are copied back.
class ModuleStateGuard {
 public:
  explicit ModuleStateGuard(const torch::nn::Module& module) {
    tensors_ = module.parameters();
    const auto buffers = module.buffers();
    tensors_.insert(tensors_.end(), buffers.begin(), buffers.end());
    UntrackedGuard host;
    for (const auto& t : tensors_) {
      saved_.push_back(t.detach().clone());
      grads_.push_back(t.grad());
      places_.push_back(place_of(t));
      options_.push_back(t.options());
    }
  }
  ~ModuleStateGuard() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (place_of(tensors_[i]) != places_[i]) tensors_[i].set_data(torch::empty_like(saved_[i], options_[i]));
      tensors_[i].copy_(saved_[i]);
      tensors_[i].mutable_grad() = grads_[i];
    }
  }
  ModuleStateGuard(const ModuleStateGuard&) = delete;
  ModuleStateGuard& operator=(const ModuleStateGuard&) = delete;

 private:
  using Place = std::pair<const void*, c10::DeleterFnPtr>;  // the storage's memory and its allocator's deleter
  static Place place_of(const torch::Tensor& t) {
    const auto& data = t.storage().data_ptr();
    return {data.get(), data.get_deleter()};
  }
  std::vector<torch::Tensor> tensors_, saved_, grads_;
  std::vector<Place> places_;
  std::vector<torch::TensorOptions> options_;
  RngStateGuard rng_;  // put back after the tensors
};

// Whether `s` recomputes some segment.
bool recomputes(const Schedule& s);

// Whether settings `a` and `b` are measured as one (ModuleStepModel::Impl::measure):
// the same precision, selective recomputation and offload; the micro-batch
// and schedules are the planner's to vary.
bool same_measurement(const StepSettings& a, const StepSettings& b);

// How much a plan copies to and from the host: 0 nothing, 1 the optimizer
// state, 2 and the gradients, 3 and the parameters streamed whole, above 3
// streamed in tiles, the smaller the tiles the higher (more, smaller copies).
int offload_rank(const StepSettings& s);

// The examples in each micro-batch of a step of `batch` with `s` (the whole batch without micro-batches).
inline int64_t micro_batch_of(const StepSettings& s, int64_t batch) {
  return s.micro_batch() > 0 ? std::min(s.micro_batch(), batch) : batch;
}

} // namespace detail

// The fixed points at which a measured step is cut into windows.
// kLayerIn and kLayerGrad: a chain's layer after its first starts forward,
// and its backward ends (its input's gradient is made), so that each window
// of a chain holds one layer's moments (a streamed layer's weights beside
// the activations) and its peak stays a line in the micro-batch, not a
// maximum whose largest term changes with it.
enum class Mark { kBegin, kMicroStart, kChainIn, kLayerIn, kChainOut, kForwardEnd, kGradIn, kLayerGrad, kGradOut,
                  kParameterGrad, kMicroEnd, kOptimizerStart, kOptimizerEnd, kEnd };

// One mark: the window that it closes (since the previous mark) had this peak and took this long.
struct Event {
  Mark mark = Mark::kBegin;
  int chain = -1;
  int64_t micro = 0;
  int64_t window_peak = 0;
  double seconds = 0;
};

// Sets each chain's schedule (empty: plain) and puts the old ones back on destruction.
class ChainSchedules {
 public:
  ChainSchedules(std::vector<FoundChain> chains, const std::vector<Schedule>& schedules)
      : chains_(std::move(chains)) {
    for (size_t c = 0; c < chains_.size(); ++c) {
      auto chain = chains_[c].chain.ptr();
      saved_.push_back(chain->schedule());
      const auto n = static_cast<int64_t>(chain->sequential()->size());
      chain->set_schedule(c < schedules.size() && !schedules[c].segments.empty() ? schedules[c] : schedule_none(n));
    }
  }
  ~ChainSchedules() {
    for (size_t c = 0; c < saved_.size(); ++c) chains_[c].chain.ptr()->set_schedule(saved_[c]);
  }
  ChainSchedules(const ChainSchedules&) = delete;
  ChainSchedules& operator=(const ChainSchedules&) = delete;

 private:
  std::vector<FoundChain> chains_;
  std::vector<Schedule> saved_;
};

// What a warm-up and a measured step saw of the chains: each one's input,
// and the bytes at each layer's start.
struct Capture {
  std::vector<torch::Tensor> inputs;
  std::vector<std::vector<int64_t>> layer_bytes;
};

// One measured setting: the step's windows at the two micro-batch sizes.
struct Measurement {
  StepSettings settings;
  std::vector<Event> small, large;
  std::vector<Event> one;   // micro-batches of 1 (times only), where m_small > 1
  int64_t state_bytes = 0;  // optimizer state resident on the device
};

struct ModuleStepModel::Impl {
  detail::StepProbe probe;
  PlanOptions options;
  TrainerOptions base;
  std::vector<FoundChain> chains;
  std::optional<std::string> batch_statistics;  // the module's first BatchNorm
  int64_t m_small = 0, m_large = 0;
  int64_t parameter_bytes = 0, gradient_bytes = 0;
  int64_t chain_parameter_bytes = 0;  // streamed, these leave the device
  std::string stream_refused;  // why streamed parameters were not measured (ParameterStream's error)
  std::vector<Measurement> measured;
  // Streamed settings (whole and in tiles), measured only once a plan needs
  // them (measure_held_back): they cost as many steps as the rest together.
  std::vector<StepSettings> held_back;
  bool streamed_measured = false;
  std::string profile_note;  // how PlanOptions::profile_budget chose the micro-batches measured, if it did
  // The plain step's events at micro-batches of 1, where fit_profile_batches
  // measured them: measure() reuses them rather than running the same steps again.
  std::optional<std::vector<Event>> plain_one;

  // Selective recomputation's choices: both where the options allow it and
  // the module has SelectivelyRecomputed parts; the first is the plain step's.
  std::vector<bool> selective_choices = {false};

  // The chains' names, in the module's order.
  std::vector<std::string> chain_names() const {
    std::vector<std::string> out;
    for (const auto& c : chains) out.push_back(c.name);
    return out;
  }
  // Whether streamed parameters are a choice: offload allowed, and chains to stream block by block.
  bool streams() const { return options.offload() && !chains.empty(); }
  // By precision and selective recomputation: each chain's profile at the two sizes.
  std::map<std::pair<Precision, bool>, std::vector<std::pair<ChainProfile, ChainProfile>>> profiles;

  // The plain step: the first precision, without offload, selective
  // recomputation only where the options fix it on.
  StepSettings plain_settings() const {
    return StepSettings().precision(options.precisions().front()).selective_recompute(selective_choices.front());
  }
  Measurement measure(const StepSettings& s);
  bool measure_held_back();
  void fit_profile_batches();
  std::vector<Event> measure_at(const StepSettings& s, int64_t m, Capture* capture, int64_t* state_bytes);
  const Measurement& find(const StepSettings& s) const;
  // The measured settings like `s` (precision, selective recomputation) that copy less than it does
  // (detail::offload_rank: less offload, or the parameters streamed whole or in larger tiles).
  std::vector<const Measurement*> offloading_less(const StepSettings& s) const;
};

// Chain profiles `a` and `b`, measured at micro-batches of `ma` and `mb`,
// scaled to a micro-batch of `m` (bytes on the exact line, times by line()).
ChainProfile scale_profile(const ChainProfile& a, const ChainProfile& b, int64_t ma, int64_t mb, int64_t m);

// Whether any of the chains' schedules recomputes.
bool any_recompute(const std::vector<Schedule>& s);

// Each chain's schedule for the memory its windows leave under `limit`, the
// others' schedules fixed, for a few rounds; the bounds tighten until the
// prediction fits or a chain cannot go lower. `frugal`: each chain's least-memory schedule instead.
std::optional<std::vector<Schedule>> solve_chains(const ModuleStepModel& model, const Measurement& meas,
                                                  int64_t batch, const StepSettings& settings, int64_t limit,
                                                  int64_t ms, int64_t ml, bool frugal);

} // namespace memfit
