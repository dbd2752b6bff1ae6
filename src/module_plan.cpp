#include "memfit/module_plan.h"

#include "compat.h"
#include "memfit/memory.h"
#include "memfit/profile.h"
#include "memfit/state.h"
#include "memfit/stream.h"
#include "plan_internal.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zlib.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace memfit {

namespace {

using Clock = std::chrono::steady_clock;

// The fixed points at which a measured step is cut into windows.
enum class Mark { kBegin, kMicroStart, kChainIn, kChainOut, kForwardEnd, kGradIn, kGradOut, kParameterGrad,
                  kMicroEnd, kOptimizerStart, kOptimizerEnd, kEnd };

// One mark: the window that it closes (since the previous mark) had this peak and took this long.
struct Event {
  Mark mark = Mark::kBegin;
  int chain = -1;
  int64_t micro = 0;
  int64_t window_peak = 0;
  double seconds = 0;
};

// Marks windows while active; records each chain's first input while asked to.
struct Recorder {
  explicit Recorder(torch::Device d, size_t chains) : device(d), inputs(chains), layer_bytes(chains) {}
  torch::Device device;
  bool active = false;
  bool record_inputs = false;
  int64_t micro = 0;
  std::vector<Event> events;
  std::vector<torch::Tensor> inputs;
  // Per chain: memory_allocated at each layer's start in the first measured
  // micro-batch (what the chain holds so far, in the module's own run).
  std::vector<std::vector<int64_t>> layer_bytes;
  std::optional<PeakMeter> meter;
  Clock::time_point last;

  void mark(Mark m, int chain = -1) {
    if (!active) return;
    if (device.is_cuda()) torch::cuda::synchronize();
    const auto now = Clock::now();
    Event e;
    e.mark = m;
    e.chain = chain;
    e.micro = micro;
    e.window_peak = meter ? meter->peak() : memory_allocated(device);
    e.seconds = m == Mark::kBegin ? 0.0 : std::chrono::duration<double>(now - last).count();
    events.push_back(e);
    meter.reset();
    meter.emplace(device);
    last = Clock::now();
  }
};

class RecordStep : public StepComponent {
 public:
  explicit RecordStep(std::shared_ptr<Recorder> r) : r_(std::move(r)) {}
  void begin_step(StepState&) override {
    r_->micro = 0;
    r_->mark(Mark::kBegin);
  }
  void before_forward(StepState& s) override {
    r_->micro = s.micro;
    r_->mark(Mark::kMicroStart);
  }
  void after_forward(StepState&) override { r_->mark(Mark::kForwardEnd); }
  void after_backward(StepState&) override { r_->mark(Mark::kMicroEnd); }
  void before_optimizer_step(StepState&) override { r_->mark(Mark::kOptimizerStart); }
  void after_optimizer_step(StepState&) override { r_->mark(Mark::kOptimizerEnd); }
  void end_step(StepState&) override { r_->mark(Mark::kEnd); }

 private:
  std::shared_ptr<Recorder> r_;
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

// `chains`, after checking that none runs its layers through a runner already.
std::vector<FoundChain> without_runners(std::vector<FoundChain> chains) {
  for (const auto& c : chains) {
    TORCH_CHECK(!c.chain->layer_runner(), "plan: chain '", c.name,
                "' already runs its layers through a layer runner (a ParameterStream?); plan the "
                "module before attaching one");
  }
  return chains;
}

// Runs every chain plainly with marks at its forward's entry and exit and
// hooks for its backward's, through the runner the chain had (a
// ParameterStream's, when the measured Trainer streams); puts schedules and
// runners back on destruction.
class ChainTaps {
 public:
  ChainTaps(std::vector<FoundChain> chains, const std::shared_ptr<Recorder>& rec)
      : chains_(std::move(chains)), plain_(chains_, {}) {
    for (size_t c = 0; c < chains_.size(); ++c) {
      auto chain = chains_[c].chain.ptr();
      const auto n = static_cast<int64_t>(chain->sequential()->size());
      const int index = static_cast<int>(c);
      runners_.push_back(chain->layer_runner());
      LayerRunner inner = runners_.back();
      chain->set_layer_runner([rec, index, n, inner](int64_t i, torch::nn::AnyModule& m, const torch::Tensor& x) {
        const bool grad = torch::autograd::GradMode::is_enabled();
        if (grad && rec->active && rec->micro == 0) {
          auto& bytes = rec->layer_bytes[static_cast<size_t>(index)];
          bytes.resize(static_cast<size_t>(n));
          bytes[static_cast<size_t>(i)] = memory_allocated(rec->device);
        }
        if (i == 0 && grad) {
          if (rec->record_inputs && !rec->inputs[index].defined()) {
            UntrackedGuard host;
            rec->inputs[index] = x.detach().clone();
          }
          rec->mark(Mark::kChainIn, index);
          if (rec->active && x.requires_grad()) {
            x.register_hook([rec, index](const torch::Tensor&) { rec->mark(Mark::kGradOut, index); });
          }
        }
        auto y = inner ? inner(i, m, x) : m.forward(x);
        if (i + 1 == n && grad) {
          rec->mark(Mark::kChainOut, index);
          if (rec->active && y.requires_grad()) {
            y.register_hook([rec, index](const torch::Tensor&) { rec->mark(Mark::kGradIn, index); });
          }
        }
        return y;
      });
    }
  }
  ~ChainTaps() {
    for (size_t c = 0; c < chains_.size(); ++c) chains_[c].chain.ptr()->set_layer_runner(runners_[c]);
  }
  ChainTaps(const ChainTaps&) = delete;
  ChainTaps& operator=(const ChainTaps&) = delete;

 private:
  std::vector<FoundChain> chains_;
  ChainSchedules plain_;
  std::vector<LayerRunner> runners_;
};

// A mark each time backward hands a parameter its gradient: windows inside
// backward as fine as the module's parameters, so that a window's peak is
// one moment's bytes (affine in the micro-batch), not a maximum over moments
// whose largest changes with it. Removed on destruction.
class ParameterMarks {
 public:
  ParameterMarks(const std::vector<torch::Tensor>& parameters, const std::shared_ptr<Recorder>& rec) {
    for (const auto& p : parameters) {
      if (!p.requires_grad()) continue;
      hooks_.emplace_back(p, p.register_hook([rec](const torch::Tensor&) { rec->mark(Mark::kParameterGrad); }));
    }
  }
  ~ParameterMarks() {
    for (auto& [p, h] : hooks_) p.remove_hook(h);
  }
  ParameterMarks(const ParameterMarks&) = delete;
  ParameterMarks& operator=(const ParameterMarks&) = delete;

 private:
  std::vector<std::pair<torch::Tensor, unsigned>> hooks_;
};

// Candidates run for real before one is chosen, at most.
constexpr int kVerifyAttempts = 4;

bool same_marks(const std::vector<Event>& a, const std::vector<Event>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].mark != b[i].mark || a[i].chain != b[i].chain || a[i].micro != b[i].micro) return false;
  }
  return true;
}

// Steps of micro-batches of `ma` and `mb` must pass the same points for
// their windows to be lined up.
void check_same_marks(const std::vector<Event>& a, const std::vector<Event>& b, int64_t ma, int64_t mb) {
  TORCH_CHECK(same_marks(a, b), "plan: steps of micro-batches of ", ma, " and ", mb, " passed different points; the "
              "planner needs a step whose control flow does not depend on the batch size");
}

int64_t affine_bytes(int64_t small, int64_t large, int64_t b_small, int64_t b_large, int64_t m) {
  // Bytes: the exact line (a step's bytes are affine in the batch).
  const double slope = double(large - small) / double(b_large - b_small);
  return std::max<int64_t>(0, std::llround(double(small) + slope * double(m - b_small)));
}

ChainProfile scale_profile(const ChainProfile& a, const ChainProfile& b, int64_t ma, int64_t mb, int64_t m) {
  ChainProfile out = b;
  detail::scale_layer_bytes(out, a, b, [&](int64_t x, int64_t y) { return affine_bytes(x, y, ma, mb, m); });
  for (size_t i = 0; i < out.layers.size(); ++i) {
    auto& l = out.layers[i];
    l.forward_seconds = detail::line(a.layers[i].forward_seconds, b.layers[i].forward_seconds, ma, mb, m);
    l.backward_seconds = detail::line(a.layers[i].backward_seconds, b.layers[i].backward_seconds, ma, mb, m);
  }
  return out;
}

// Whether settings `a` and `b` are measured as one (ModuleStepModel::Impl::measure):
// the same precision, selective recomputation and offload; the micro-batch
// and schedules are the planner's to vary.
bool same_measurement(const StepSettings& a, const StepSettings& b) {
  return a.precision() == b.precision() && a.selective_recompute() == b.selective_recompute() &&
         a.offload_optimizer() == b.offload_optimizer() && a.offload_gradients() == b.offload_gradients() &&
         a.offload_parameters() == b.offload_parameters() && a.tile_bytes() == b.tile_bytes();
}

} // namespace

// What a warm-up and a measured step saw of the chains: each one's input,
// and the bytes at each layer's start.
struct Capture {
  std::vector<torch::Tensor> inputs;
  std::vector<std::vector<int64_t>> layer_bytes;
};

// The profile with each layer's kept bytes as the module's own run kept them:
// the growth from its start to the next layer's. profile_chain reads the
// same in-chain bytes from which tensors autograd holds (profile.h); this
// measures them where the chain really runs. The last layer keeps its
// profiled bytes.
ChainProfile in_context(ChainProfile p, const std::vector<int64_t>& bytes) {
  if (bytes.size() != p.layers.size()) return p;
  for (size_t i = 0; i + 1 < p.layers.size(); ++i) {
    p.layers[i].kept_bytes = std::max<int64_t>(0, bytes[i + 1] - bytes[i]);
  }
  return p;
}

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

std::vector<Event> ModuleStepModel::Impl::measure_at(const StepSettings& s, int64_t m,
                                                     Capture* capture, int64_t* state_bytes) {
  detail::ModuleStateGuard restore(*probe.module);
  auto rec = std::make_shared<Recorder>(base.device(), chains.size());
  compat::WarningCapture quiet;  // micro-batches of a model with batch statistics: the plan says so
  auto trainer = probe.make_trainer(
      trainer_options(StepSettings(s).micro_batch(m), base).batch_size(2 * m).save_dir("").on_out_of_memory(
          OnOutOfMemory::kThrow));  // planning measures the step as it is
  ChainTaps taps(chains, rec);  // after the Trainer: around its stream's runner, and gone before it
  trainer.add_component(std::make_shared<RecordStep>(rec));
  ParameterMarks parameter_marks(probe.module->parameters(), rec);
  rec->record_inputs = capture != nullptr;
  probe.step(trainer, 2 * m);  // warm-up: optimizer state, the chains' inputs
  rec->record_inputs = false;
  std::vector<Event> out;
  for (int k = 0; k < 2; ++k) {  // two measured steps: bytes from either, the faster time
    rec->events.clear();
    rec->active = true;
    probe.step(trainer, 2 * m);
    rec->active = false;
    rec->meter.reset();
    if (k == 0) {
      out = rec->events;
      continue;
    }
    TORCH_CHECK(same_marks(out, rec->events), "plan: two steps of the same micro-batches passed different "
                "points (data-dependent control flow?); the planner needs a step that runs the same way each time");
    for (size_t i = 0; i < out.size(); ++i) {
      out[i].window_peak = std::max(out[i].window_peak, rec->events[i].window_peak);
      out[i].seconds = std::min(out[i].seconds, rec->events[i].seconds);
    }
  }
  if (capture) {
    capture->inputs = rec->inputs;
    capture->layer_bytes = rec->layer_bytes;
  }
  if (state_bytes) {
    *state_bytes = s.offload_optimizer() == Offload::kHost ? 0 : optimizer_state_bytes(trainer.optimizer());
  }
  for (size_t c = 0; c < chains.size(); ++c) {
    const auto entries = std::count_if(out.begin(), out.end(), [&](const Event& e) {
      return e.mark == Mark::kChainIn && e.chain == int(c) && e.micro == 0;
    });
    TORCH_CHECK(entries <= 1, "plan: chain '", chains[c].name, "' runs ", entries,
                " times in one forward; the planner needs each chain to run once per forward (hold a "
                "shared block in one chain, or plan a module whose chains run once)");
  }
  return out;
}

Measurement ModuleStepModel::Impl::measure(const StepSettings& s) {
  Measurement out;
  out.settings = s;
  SelectiveRecomputeGuard selective(*probe.module, s.selective_recompute());
  const auto key = std::make_pair(s.precision(), s.selective_recompute());
  const bool profile_chains = !chains.empty() && profiles.count(key) == 0;
  Capture small, large;
  out.small = measure_at(s, m_small, profile_chains ? &small : nullptr, nullptr);
  out.large = measure_at(s, m_large, profile_chains ? &large : nullptr, &out.state_bytes);
  // Micro-batches of 1, for times; not with batch statistics (BatchNorm1d refuses one example).
  if (m_small > 1 && !batch_statistics) {
    const bool plain = plain_one && same_measurement(s, plain_settings());
    out.one = plain ? *std::exchange(plain_one, std::nullopt) : measure_at(s, 1, nullptr, nullptr);
  }
  check_same_marks(out.small, out.large, m_small, m_large);
  if (profile_chains) {
    // The chains' layers run where their inputs were captured: on the step's
    // device (each measured step's Trainer put the module there, and its guard
    // put it back where the user left it, as this one does).
    detail::ModuleStateGuard restore(*probe.module);
    probe.module->to(base.device());
    auto& p = profiles[key];
    for (size_t c = 0; c < chains.size(); ++c) {
      TORCH_CHECK(small.inputs[c].defined() && large.inputs[c].defined(), "plan: chain '", chains[c].name,
                  "' did not run in a training step of the module; the planner needs every chain "
                  "it finds to run in forward");
      AutocastGuard autocast(base.device(), s.precision());
      const auto& seq = chains[c].chain->sequential();
      auto a = in_context(profile_chain(seq, small.inputs[c]), small.layer_bytes[c]);
      auto b = in_context(profile_chain(seq, large.inputs[c]), large.layer_bytes[c]);
      p.emplace_back(std::move(a), std::move(b));
    }
  }
  return out;
}

namespace {
// Tile sizes for streamed chains: a quarter, a sixteenth and a 64th of the
// largest Linear weight that is a chain's layer (ParameterStream tiles those),
// where a tile is at least 1 KiB.
std::vector<int64_t> tile_choices(const std::vector<FoundChain>& chains) {
  int64_t largest = 0;
  for (const auto& c : chains) {
    const auto& layers = c.chain->sequential();
    for (size_t i = 0; i < layers->size(); ++i) {
      if (const auto* linear = layers->ptr(i)->as<torch::nn::Linear>()) {
        largest = std::max<int64_t>(largest, linear->weight.numel() * static_cast<int64_t>(linear->weight.element_size()));
      }
    }
  }
  std::vector<int64_t> out;
  for (int64_t k : {4, 16, 64}) {
    if (largest >= 1024 * k) out.push_back((largest + k - 1) / k);
  }
  return out;
}
} // namespace

const Measurement& ModuleStepModel::Impl::find(const StepSettings& s) const {
  for (const auto& m : measured) {
    if (same_measurement(m.settings, s)) return m;
  }
  TORCH_CHECK(false, "ModuleStepModel: precision ", to_string(s.precision()), " with offload '",
              offload_text(s), "'", s.selective_recompute() ? " and selective recomputation" : "",
              " was not measured; PlanOptions::precisions, offload and selective_recompute say what is");
}

std::vector<const Measurement*> ModuleStepModel::Impl::offloading_less(const StepSettings& s) const {
  std::vector<const Measurement*> out;
  for (const auto& m : measured) {
    if (m.settings.precision() == s.precision() && m.settings.selective_recompute() == s.selective_recompute() &&
        detail::offload_rank(m.settings) < detail::offload_rank(s)) {
      out.push_back(&m);
    }
  }
  return out;
}

ModuleStepModel::ModuleStepModel(detail::StepProbe probe, PlanOptions options, TrainerOptions base)
    : impl_(std::make_unique<Impl>()) {
  auto& im = *impl_;
  TORCH_CHECK(probe.module, "plan needs a module, got nullptr");
  TORCH_CHECK(probe.examples >= 4, "plan needs a sample batch of at least 4 examples (it measures steps "
              "of two micro-batches at two sizes), got ", probe.examples);
  TORCH_CHECK(options.profile_batch() >= 2, "PlanOptions::profile_batch must be at least 2, got ",
              options.profile_batch());
  TORCH_CHECK(!options.precisions().empty(), "PlanOptions::precisions must name at least one precision");
  TORCH_CHECK(options.margin() > 0 && options.margin() <= 1, "PlanOptions::margin must be in (0, 1], got ",
              options.margin());
  detail::check_measure_options(options);
  TORCH_CHECK(base.process_group() == nullptr, "plan measures one process's step; plan without "
              "TrainerOptions::process_group and give each rank the plan");
  TORCH_CHECK(base.offload_parameters() == Offload::kNone, "plan for a module chooses the optimizer and "
              "gradient offload itself and does not stream parameters; leave TrainerOptions::offload_parameters kNone");
  im.probe = std::move(probe);
  im.options = std::move(options);
  im.base = std::move(base);
  im.chains = without_runners(find_chains(*im.probe.module));
  im.batch_statistics = batch_statistics_layer(*im.probe.module);
  im.m_large = std::min(im.options.profile_batch(), im.probe.examples / 2);
  im.m_small = im.m_large / 2;
  for (const auto& p : im.probe.module->parameters()) {
    if (p.requires_grad()) im.gradient_bytes += p.numel() * static_cast<int64_t>(p.element_size());
  }
  im.parameter_bytes = storage_bytes(im.probe.module->parameters()) + storage_bytes(im.probe.module->buffers());
  std::vector<StepSettings> offloads = {StepSettings()};
  if (im.options.offload()) {
    offloads.push_back(StepSettings().offload_optimizer(Offload::kHost));
    offloads.push_back(StepSettings().offload_optimizer(Offload::kHost).offload_gradients(Offload::kHost));
  }
  for (const auto& c : im.chains) im.chain_parameter_bytes += storage_bytes(c.chain->parameters());
  im.selective_choices =
      detail::selective_choices(im.options, SelectiveRecomputeGuard(*im.probe.module, false).parts() > 0);
  if (im.options.profile_budget() > 0) im.fit_profile_batches();
  // A module the stream refuses (tied weights across a chain's edge) is planned without it, and the plan says why.
  if (im.streams()) im.stream_refused = ParameterStream::refusal(*im.probe.module);
  for (auto precision : im.options.precisions()) {
    for (bool selective : im.selective_choices) {
      for (const auto& o : offloads) {
        im.measured.push_back(im.measure(StepSettings(o).precision(precision).selective_recompute(selective)));
      }
      // Streamed parameters (fp32 only): the chains' layers one at a time, the
      // rest held per micro-batch; the chains' Linear layers also in tiles.
      if (im.streams() && precision == Precision::kFP32 && im.stream_refused.empty()) {
        const auto streamed =
            StepSettings(offloads.back()).offload_parameters(Offload::kHost).selective_recompute(selective);
        im.held_back.push_back(streamed);
        for (int64_t tile : tile_choices(im.chains)) im.held_back.push_back(StepSettings(streamed).tile_bytes(tile));
      }
    }
  }
}

// Within PlanOptions::profile_budget, the micro-batches measured are halved
// from profile_batch until the largest one's step fits the margin of it.
// Each window's peak is affine in the micro-batch (the planner's own model),
// so the plain step (the most any measured setting holds) at the smallest
// micro-batch and twice it says what each size needs: the highest window.
void ModuleStepModel::Impl::fit_profile_batches() {
  const int64_t lo = batch_statistics ? 2 : 1;  // BatchNorm1d refuses one example
  const int64_t limit = static_cast<int64_t>(std::floor(options.margin() * double(options.profile_budget())));
  if (m_large <= 2 * lo) return;
  const auto s = plain_settings();
  SelectiveRecomputeGuard selective(*probe.module, s.selective_recompute());
  const auto a = measure_at(s, lo, nullptr, nullptr);
  const auto b = measure_at(s, 2 * lo, nullptr, nullptr);
  check_same_marks(a, b, lo, 2 * lo);
  if (lo == 1) plain_one = a;  // measure() times the plain step at 1 too
  auto needs = [&](int64_t m) {
    int64_t most = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      most = std::max(most, affine_bytes(a[i].window_peak, b[i].window_peak, lo, 2 * lo, m));
    }
    return most;
  };
  if (needs(m_large) <= limit) return;
  while (m_large > 2 * lo && needs(m_large) > limit) m_large /= 2;
  m_large = std::max(m_large, 2 * lo);
  m_small = m_large / 2;
  const auto budget = format_bytes(options.profile_budget());
  profile_note = needs(m_large) <= limit
                     ? fmt::format(", the largest whose steps fit PlanOptions::profile_budget {}", budget)
                     : fmt::format(", the smallest, whose plain steps peaked at {}, above PlanOptions::profile_budget "
                                   "{}: the step's fixed bytes alone do not fit it",
                                   format_bytes(needs(2 * lo)), budget);
  // A micro-batch of 1 is a special case of shapes: a dimension of size 1
  // makes more views contiguous, so copies that larger micro-batches make
  // vanish (docs/planner.md: a block of the consumer's LM needs 131072 bytes
  // beside what it keeps at 1, 229376 per example at 2 to 16), and a line
  // through 1 and 2 over-predicts larger ones. Where the line says a step of
  // 3 fits (it over-predicts that too), 2 and 3 are measured instead.
  if (m_small == 1 && probe.examples >= 6 && needs(3) <= limit) {
    m_small = 2;
    m_large = 3;
    profile_note = fmt::format(", not 1 and 2 (a micro-batch of 1 makes views contiguous that larger ones copy); 3 "
                               "is the largest whose steps fit PlanOptions::profile_budget {}", budget);
  }
}

bool ModuleStepModel::Impl::measure_held_back() {
  if (held_back.empty()) return false;
  for (const auto& s : held_back) measured.push_back(measure(s));
  held_back.clear();
  streamed_measured = true;
  return true;
}

bool ModuleStepModel::measure_held_back() { return impl_->measure_held_back(); }

ModuleStepModel::~ModuleStepModel() = default;
ModuleStepModel::ModuleStepModel(ModuleStepModel&&) noexcept = default;
ModuleStepModel& ModuleStepModel::operator=(ModuleStepModel&&) noexcept = default;

const std::vector<FoundChain>& ModuleStepModel::chains() const { return impl_->chains; }
int64_t ModuleStepModel::sample_examples() const { return impl_->probe.examples; }
const PlanOptions& ModuleStepModel::options() const { return impl_->options; }
const TrainerOptions& ModuleStepModel::base() const { return impl_->base; }

std::vector<StepSettings> ModuleStepModel::measured_settings() const {
  std::vector<StepSettings> out;
  for (const auto& m : impl_->measured) out.push_back(m.settings);
  return out;
}

ChainCosts ModuleStepModel::costs(size_t index, Precision precision, int64_t micro_batch,
                                  bool selective_recompute) const {
  const auto& im = *impl_;
  TORCH_CHECK(index < im.chains.size(), "ModuleStepModel::costs: chain ", index, " of ", im.chains.size());
  auto it = im.profiles.find(std::make_pair(precision, selective_recompute));
  TORCH_CHECK(it != im.profiles.end(), "ModuleStepModel::costs: precision ", to_string(precision),
              selective_recompute ? " with selective recomputation" : "", " was not measured");
  const auto& p = it->second[index];
  auto c = costs_from_profile(scale_profile(p.first, p.second, im.m_small, im.m_large, micro_batch));
  const auto& in_place = im.chains[index].chain->in_place();
  for (size_t i = 0; i < in_place.size(); ++i) c.in_place[i] = c.in_place[i] || in_place[i];
  return c;
}

namespace {
// The chain's costs for a step of micro-batches of m, with the parameter
// gradients each layer's backward creates when the step is one micro-batch
// (`single`): then a schedule that moves a layer's backward later meets more
// of them. Later micro-batches find every gradient made (in the measured
// windows); offloaded gradients leave the device.
ChainCosts step_costs(const ModuleStepModel& model, size_t index, const StepSettings& settings, int64_t m,
                      bool single) {
  auto c = model.costs(index, settings.precision(), m, settings.selective_recompute());
  if (!single || settings.offload_gradients() == Offload::kHost) return c;
  const auto& layers = model.chains()[index].chain->sequential();
  c.gradient.assign(layers->size(), 0);
  for (size_t i = 0; i < layers->size(); ++i) {
    for (const auto& p : layers->ptr(i)->parameters()) {
      if (p.requires_grad()) c.gradient[i] += static_cast<int64_t>(p.numel() * p.element_size());
    }
  }
  return c;
}

// How a schedule moves a chain's forward peak, held bytes, backward peak and time against plain.
struct ChainDelta {
  int64_t forward = 0, held = 0, backward = 0;
  double seconds = 0;
};
ChainDelta delta_of(const ChainCosts& costs, const Schedule& s) {
  if (s.segments.empty()) return {};
  const auto plain = simulate(schedule_none(costs.size()), costs);
  const auto with = simulate(s, costs);
  return {with.forward_peak_bytes - plain.forward_peak_bytes, with.held_bytes - plain.held_bytes,
          with.backward_peak_bytes - plain.backward_peak_bytes, with.time - plain.time};
}

enum class ChainState { kIdle, kForward, kHeld, kBackward };

// Whether a window closing at `e` belongs to a step of one micro-batch.
bool in_single_micro_step(const Event& e) {
  switch (e.mark) {
    case Mark::kOptimizerStart:
    case Mark::kOptimizerEnd:
    case Mark::kEnd:
      return true;
    default:
      return e.micro == 0;
  }
}

// The step's windows at micro-batch m with each chain's deltas applied:
// (the window's closing event, its predicted peak).
std::vector<std::pair<const Event*, int64_t>> predicted_windows(const std::vector<Event>& small,
                                                                const std::vector<Event>& large, int64_t ms,
                                                                int64_t ml, int64_t m,
                                                                const std::vector<ChainDelta>& deltas,
                                                                int exclude = -1) {
  std::vector<ChainState> state(deltas.size(), ChainState::kIdle);
  std::vector<std::pair<const Event*, int64_t>> out;
  for (size_t i = 1; i < large.size(); ++i) {
    int64_t peak = affine_bytes(small[i].window_peak, large[i].window_peak, ms, ml, m);
    for (size_t c = 0; c < deltas.size(); ++c) {
      if (int(c) == exclude) continue;
      if (state[c] == ChainState::kForward) peak += deltas[c].forward;
      if (state[c] == ChainState::kHeld) peak += deltas[c].held;
      if (state[c] == ChainState::kBackward) peak += deltas[c].backward;
    }
    out.emplace_back(&large[i], peak);
    const auto& e = large[i];
    if (e.chain >= 0) {
      auto& s = state[static_cast<size_t>(e.chain)];
      if (e.mark == Mark::kChainIn) s = ChainState::kForward;
      if (e.mark == Mark::kChainOut) s = ChainState::kHeld;
      if (e.mark == Mark::kGradIn) s = ChainState::kBackward;
      if (e.mark == Mark::kGradOut) s = ChainState::kIdle;
    }
    if (e.mark == Mark::kMicroEnd) std::fill(state.begin(), state.end(), ChainState::kIdle);
  }
  return out;
}
} // namespace

StepPrediction ModuleStepModel::predict(int64_t batch, const StepSettings& settings,
                                        const std::vector<Schedule>& schedules) const {
  const auto& im = *impl_;
  TORCH_CHECK(batch > 0, "ModuleStepModel::predict: batch must be positive, got ", batch);
  TORCH_CHECK(schedules.empty() || schedules.size() == im.chains.size(), "ModuleStepModel::predict: ",
              im.chains.size(), " chains need as many schedules (or none), got ", schedules.size());
  const auto& meas = im.find(settings);
  TORCH_CHECK(settings.offload_parameters() != Offload::kHost ||
                  std::none_of(schedules.begin(), schedules.end(), detail::recomputes),
              "ModuleStepModel::predict: streamed parameters are planned with each chain as measured (a "
              "streamed layer is fetched, and recomputed where it is not a Linear, on its own); pass no "
              "checkpoint schedules with offload_parameters kHost");
  const int64_t m = settings.micro_batch() > 0 ? std::min(settings.micro_batch(), batch) : batch;
  const int64_t steps = (batch + m - 1) / m;
  std::vector<ChainDelta> deltas(im.chains.size());
  for (size_t c = 0; c < schedules.size(); ++c) {
    deltas[c] = delta_of(step_costs(*this, c, settings, m, steps == 1), schedules[c]);
  }
  StepPrediction out;
  out.accumulation_steps = steps;
  for (const auto& [e, peak] : predicted_windows(meas.small, meas.large, im.m_small, im.m_large, m, deltas)) {
    if (steps == 1 && !in_single_micro_step(*e)) continue;
    // Resident optimizer state: the measured steps created it in their warm-up, so it is in every window.
    const bool optimizer = e->mark == Mark::kOptimizerEnd || e->mark == Mark::kEnd;
    auto& phase = optimizer ? out.optimizer_step_bytes : out.forward_backward_bytes;
    phase = std::max(phase, peak);
  }
  out.peak_bytes = std::max(out.forward_backward_bytes, out.optimizer_step_bytes);
  out.phase = out.forward_backward_bytes >= out.optimizer_step_bytes ? "forward/backward" : "optimizer step";
  // Time: per micro-batch, everything up to the second micro-batch's end,
  // halved; then the optimizer step (the faster measurement of it).
  const auto split = [](const std::vector<Event>& events) {
    std::pair<double, double> t{0, 0};
    bool in_micro = true;
    for (size_t i = 1; i < events.size(); ++i) {
      (in_micro ? t.first : t.second) += events[i].seconds;
      if (events[i].mark == Mark::kMicroEnd && events[i].micro == 1) in_micro = false;
    }
    t.first /= 2;
    return t;
  };
  const auto measured_seconds = [&](const Measurement& mm) {
    const auto ts = split(mm.small), tl = split(mm.large);
    double per_micro = detail::line(ts.first, tl.first, im.m_small, im.m_large, m);
    if (m < im.m_small && !mm.one.empty()) {  // between the measured micro-batches of 1 and m_small
      const auto t1 = split(mm.one);
      per_micro = t1.first + (ts.first - t1.first) * double(m - 1) / double(im.m_small - 1);
    }
    return double(steps) * per_micro + std::min(ts.second, tl.second);
  };
  // Offloading only adds copies, and smaller tiles more of them: where timing
  // noise measured a setting that copies more as faster, the time of one that
  // copies less stands. Noise then cannot rank offloads of
  // one micro-batch apart, and the choice's tie goes to the one that copies less.
  double seconds = measured_seconds(meas);
  for (const auto* less : im.offloading_less(settings)) seconds = std::max(seconds, measured_seconds(*less));
  double recompute = 0;
  for (const auto& d : deltas) recompute += d.seconds;
  out.seconds = seconds + double(steps) * recompute;
  out.memory.peak = out.peak_bytes;
  out.memory.parameters = im.parameter_bytes -
                          (settings.offload_parameters() == Offload::kHost ? im.chain_parameter_bytes : 0);
  out.memory.gradients = settings.offload_gradients() == Offload::kHost ? 0 : im.gradient_bytes;
  out.memory.optimizer_state = meas.state_bytes;
  out.memory.activations = std::max<int64_t>(
      0, out.peak_bytes - out.memory.parameters - out.memory.gradients - out.memory.optimizer_state);
  out.activation_bytes = out.memory.activations;
  return out;
}

namespace {

struct Candidate {
  StepSettings settings;
  std::vector<Schedule> schedules;
  StepPrediction predicted;
  bool edge = false;  // predicted above the margin's limit, within the budget (detail::is_edge)
};

bool any_recompute(const std::vector<Schedule>& s) { return std::any_of(s.begin(), s.end(), detail::recomputes); }

// The optimal schedule within `bound` bytes, at the solver's default
// resolution or, where its units are too coarse to find one, a finer one.
std::optional<Schedule> solve_within(const ChainCosts& costs, int64_t bound) {
  for (int64_t slots : {200, 1000}) {
    if (bound < min_budget(costs, SolverOptions().slots(slots))) continue;
    try {
      return solve_optimal(costs, bound, SolverOptions().slots(slots));
    } catch (const c10::Error&) {
      // too coarse: try finer units
    }
  }
  auto least = schedule_least_memory(costs, SolverOptions().slots(1000));
  if (simulate(least, costs).peak_bytes <= bound) return least;
  return std::nullopt;
}

// Each chain's schedule for the memory its windows leave under `limit`, the
// others' schedules fixed, for a few rounds; the bounds tighten until the
// prediction fits or a chain cannot go lower. `frugal`: each chain's least-memory schedule instead.
std::optional<std::vector<Schedule>> solve_chains(const ModuleStepModel& model, const Measurement& meas,
                                                  int64_t batch, const StepSettings& settings, int64_t limit,
                                                  int64_t ms, int64_t ml, bool frugal) {
  const auto& chains = model.chains();
  const int64_t m = settings.micro_batch() > 0 ? std::min(settings.micro_batch(), batch) : batch;
  const bool single = (batch + m - 1) / m == 1;
  std::vector<ChainCosts> costs;
  for (size_t c = 0; c < chains.size(); ++c) costs.push_back(step_costs(model, c, settings, m, single));
  std::vector<Schedule> schedules(chains.size());
  std::vector<ChainDelta> deltas(chains.size());
  if (frugal) {
    for (size_t c = 0; c < chains.size(); ++c) {
      schedules[c] = schedule_least_memory(costs[c], SolverOptions().slots(1000));
    }
    return schedules;
  }
  double tighten = 1.0;
  for (int round = 0; round < 12; ++round) {
    for (size_t c = 0; c < chains.size(); ++c) {
      const auto plain = simulate(schedule_none(costs[c].size()), costs[c]);
      int64_t bound = std::numeric_limits<int64_t>::max();
      ChainState st = ChainState::kIdle;
      for (const auto& [e, peak] : predicted_windows(meas.small, meas.large, ms, ml, m, deltas, int(c))) {
        if (!single || in_single_micro_step(*e)) {
          const int64_t room = limit - peak;
          if (st == ChainState::kForward) bound = std::min(bound, room + plain.forward_peak_bytes);
          if (st == ChainState::kHeld) bound = std::min(bound, room + plain.held_bytes);
          if (st == ChainState::kBackward) bound = std::min(bound, room + plain.backward_peak_bytes);
        }
        if (e->chain == int(c)) {
          if (e->mark == Mark::kChainIn) st = ChainState::kForward;
          if (e->mark == Mark::kChainOut) st = ChainState::kHeld;
          if (e->mark == Mark::kGradIn) st = ChainState::kBackward;
          if (e->mark == Mark::kGradOut) st = ChainState::kIdle;
        }
        if (e->mark == Mark::kMicroEnd) st = ChainState::kIdle;
      }
      if (bound == std::numeric_limits<int64_t>::max()) continue;
      bound = static_cast<int64_t>(double(bound) * tighten);
      if (plain.peak_bytes <= bound) {
        schedules[c] = Schedule();
      } else {
        auto solved = solve_within(costs[c], bound);
        if (!solved) return std::nullopt;
        schedules[c] = std::move(*solved);
      }
      deltas[c] = delta_of(costs[c], schedules[c]);
    }
    if (model.predict(batch, settings, schedules).peak_bytes <= limit) return schedules;
    if (round >= 1) tighten *= 0.95;
  }
  return std::nullopt;
}

// Each chain's name and schedule.
std::string schedules_text(const std::vector<std::string>& chains, const std::vector<Schedule>& s) {
  if (chains.empty()) return "none (no chain)";
  std::string out;
  for (size_t c = 0; c < chains.size(); ++c) {
    if (!out.empty()) out += "; ";
    const auto name = chains[c].empty() ? std::string("(the module)") : chains[c];
    out += name + ": " + (c < s.size() && detail::recomputes(s[c]) ? s[c].to_string() : std::string("none"));
  }
  return out;
}

// What the chains recompute: their schedules, or `none` where none does.
std::string checkpoint_text(const std::vector<std::string>& chains, const std::vector<Schedule>& s,
                            const std::string& none = "none") {
  return any_recompute(s) ? schedules_text(chains, s) : none;
}

} // namespace

namespace {

struct Search {
  std::vector<Candidate> fitting;  // predicted to fit
  std::optional<Candidate> closest;
  int64_t candidates = 0;
};

// Every combination of the grid for a step of `batch` examples (in one pass
// unless `micro_batching`), with each chain's schedule solved where the plain
// chains do not fit: under PlanOptions::margin of the budget, scaled by `room`
// (the share of reserved bytes that the device's allocator leaves allocated).
Search search(const ModuleStepModel& model, const ModuleStepModel::Impl& im, int64_t batch, int64_t budget,
              bool micro_batching, double room = 1.0) {
  const auto& o = im.options;
  const auto& chains = im.chains;
  const int64_t limit = static_cast<int64_t>(std::floor(o.margin() * room * double(budget)));
  std::vector<int64_t> micro = {batch};
  const int64_t smallest = im.batch_statistics ? 2 : 1;  // batch statistics need two examples
  while (micro_batching && (micro.back() + 1) / 2 >= smallest && micro.back() > 1) {
    micro.push_back((micro.back() + 1) / 2);
  }
  Search out;
  for (const auto& measured : model.measured_settings()) {
    for (int64_t m : micro) {
      auto s = StepSettings(measured).micro_batch(m == batch ? 0 : m);
      Candidate c{s, std::vector<Schedule>(chains.size()), model.predict(batch, s, {})};
      ++out.candidates;
      if (detail::is_edge(o, o.verify(), c.predicted.peak_bytes, limit, budget)) {
        out.fitting.push_back(c);  // timed, never chosen by prediction (best_fitting keeps to the limit)
        out.fitting.back().edge = true;
      }
      // Streamed chains run as measured: their layers come one at a time, and
      // those recomputed keep only their input already (no schedule on top).
      const bool streamed = s.offload_parameters() == Offload::kHost;
      if (c.predicted.peak_bytes > limit && o.checkpointing() && !chains.empty() && !streamed) {
        const auto& meas = im.find(s);
        auto solved = solve_chains(model, meas, batch, s, limit, im.m_small, im.m_large, false);
        c.schedules = solved ? *solved : *solve_chains(model, meas, batch, s, limit, im.m_small, im.m_large, true);
        c.predicted = model.predict(batch, s, c.schedules);
      }
      if (!out.closest || c.predicted.peak_bytes < out.closest->predicted.peak_bytes) out.closest = c;
      if (c.predicted.peak_bytes <= limit) out.fitting.push_back(c);
    }
  }
  return out;
}

// The one of `fitting` to choose (detail::choose) among those whose
// prediction, scaled by `correction`, fits `limit`; end() when none.
std::vector<Candidate>::iterator best_fitting(std::vector<Candidate>& fitting, double correction, int64_t limit) {
  std::vector<detail::Ranked> ranked;
  std::vector<std::vector<Candidate>::iterator> at;
  for (auto c = fitting.begin(); c != fitting.end(); ++c) {
    if (double(c->predicted.peak_bytes) * correction > double(limit)) continue;
    ranked.push_back(detail::ranked(c->settings, c->predicted, any_recompute(c->schedules)));
    at.push_back(c);
  }
  const int64_t chosen = detail::choose(ranked);
  return chosen < 0 ? fitting.end() : at[static_cast<size_t>(chosen)];
}

// Streaming the chains' parameters is the rung after the optimizer state and
// gradients on the host, so its settings are measured only where nothing
// resident is predicted to fit the limit, or where the fastest resident fit
// already holds both on the host: there a larger micro-batch streamed may be
// faster (the GPU peer table's GPT at 101.96 MiB, docs/workloads.md: streamed
// micro-batches of 4 ran at 19x the plain step on an H200; without streaming
// measured, resident micro-batches of 1 at 46x on an H100).
bool wants_streaming(Search& found, int64_t limit) {
  const auto best = best_fitting(found.fitting, 1.0, limit);
  return best == found.fitting.end() || best->settings.offload_gradients() == Offload::kHost;
}

// Examples a timed or verifying step of `batch` runs with `settings`: the
// whole batch up to kTimedExamples; above it, whole micro-batches, at least
// two and about kTimedExamples in all. Such a step peaks as the whole one
// does (the second micro-batch accumulates into the gradients the first
// made, as every later one does), and costs the same however large the batch.
// 64, the batch the planning cost's target is measured against (docs/planner.md,
// "What planning costs": at 128 the ResNet's plan of 4096 examples cost 2.33x
// that of 64; at 64, 0.80x), and no worse a choice: the peer tables' plans
// at a batch of 128 then stood within noise of the grid's fastest.
constexpr int64_t kTimedExamples = 64;
int64_t timed_examples(const StepSettings& s, int64_t batch) {
  const int64_t m = s.micro_batch() > 0 ? s.micro_batch() : batch;
  if (batch <= kTimedExamples || m >= batch) return batch;
  return std::min(batch, std::max<int64_t>(2, kTimedExamples / m) * m);
}

// `steps` real steps with `settings` and `schedules` under `budget`, of
// `batch` examples or, for a large micro-batched batch, of timed_examples:
// the steady steps' peak and the faster one's time (seconds 0 and peak -1
// when one ran out of memory under it), a shorter step's time scaled to the
// batch by `model`'s prediction of both. The first step creates the
// optimizer's state and is not counted.
detail::StepTiming run_plan(const ModuleStepModel& model, const ModuleStepModel::Impl& im,
                            const StepSettings& settings, const std::vector<Schedule>& schedules, int64_t batch,
                            int64_t budget, int steps = 3) {
  const int64_t examples = timed_examples(settings, batch);
  detail::ModuleStateGuard restore(*im.probe.module);
  compat::WarningCapture quiet;  // the Trainer's warnings repeat what the plan says
  ChainSchedules scheduled(im.chains, schedules);
  SelectiveRecomputeGuard selective(*im.probe.module, settings.selective_recompute());
  auto trainer = im.probe.make_trainer(  // an out-of-memory error is the answer here, not something to recover
      trainer_options(settings, im.base).batch_size(examples).save_dir("").on_out_of_memory(OnOutOfMemory::kThrow));
  const int64_t outer = memory_budget(im.base.device());  // a caller's lower budget stays
  BudgetGuard scope(im.base.device(), outer > 0 ? std::min(outer, budget) : budget);
  detail::StepTiming out;
  try {
    for (int k = 0; k < steps; ++k) {
      const auto rec = im.probe.step(trainer, examples);
      if (k == 0) continue;
      out.peak_bytes = std::max(out.peak_bytes, rec.peak_bytes);
      out.seconds = k == 1 ? rec.seconds : std::min(out.seconds, rec.seconds);
    }
  } catch (const c10::OutOfMemoryError&) {
    detail::StepTiming failed{0, -1};
    const auto device = im.base.device();
    if (device.is_cuda()) {  // the failing phase's peaks: each phase's meter resets the device's
      failed.failed_allocated = max_memory_allocated(device);
      failed.failed_reserved = max_memory_reserved(device);
    }
    return failed;
  }
  if (examples < batch) {
    const double part = model.predict(examples, settings, schedules).seconds;
    if (part > 0) out.seconds *= model.predict(batch, settings, schedules).seconds / part;
  }
  return out;
}

// A candidate's settings and each chain's schedule, as the plan's lines name it.
std::string candidate_text(const StepSettings& s, const std::vector<Schedule>& schedules, int64_t batch,
                           const std::vector<std::string>& chains) {
  return detail::settings_text(s, batch) + "; checkpoint " + schedules_text(chains, schedules);
}

// The fastest measured of the candidates PlanOptions::measure_candidates
// names (detail::to_time), recorded in `out`; nullopt when none ran within
// the budget. `room`: the least allocated ÷ reserved bytes of those whose
// steps ran out of memory on CUDA with the caching allocator holding more
// than they allocated (1: none did).
std::optional<Candidate> measured_choice(const ModuleStepModel& model, const ModuleStepModel::Impl& im,
                                         const std::vector<Candidate>& fitting, int64_t batch, int64_t budget,
                                         ModulePlan& out, double& room) {
  std::vector<detail::Ranked> ranked;
  std::vector<int64_t> group;
  std::map<std::string, int64_t> families;  // all but the offload and its tiles: one step, more or fewer copies
  for (const auto& c : fitting) {
    ranked.push_back(detail::ranked(c.settings, c.predicted, any_recompute(c.schedules)));
    ranked.back().edge = c.edge;
    const auto key = fmt::format("{} {} {} {}", c.settings.micro_batch(), int(c.settings.precision()),
                                 c.settings.selective_recompute(), schedules_text(out.chains, c.schedules));
    ranked.back().family = families.emplace(key, int64_t(families.size())).first->second;
    group.push_back(detail::timing_group(c.settings, c.edge));
  }
  const auto& o = im.options;
  const auto order = detail::to_time(ranked, group, o.measure_within(), o.measure_candidates());
  const auto measured = detail::choose_measured(
      ranked, order, [&](size_t i) { return run_plan(model, im, fitting[i].settings, fitting[i].schedules, batch, budget, 2); },
      o.free_cores());
  const auto& timings = measured.timed;
  const int64_t chosen = measured.chosen;
  std::vector<std::string> names;
  std::vector<double> predictions;
  for (size_t k = 0; k < order.size(); ++k) {
    const auto& c = fitting[order[k]];
    out.timed.push_back({c.settings, c.schedules, c.predicted.seconds, timings[k].seconds,
                         std::max<int64_t>(timings[k].peak_bytes, 0)});
    names.push_back(candidate_text(c.settings, c.schedules, batch, out.chains) +
                    detail::edge_text(c.edge, c.predicted.peak_bytes));
    predictions.push_back(c.predicted.seconds);
    if (timings[k].failed_reserved > timings[k].failed_allocated && timings[k].failed_allocated > 0) {
      room = std::min(room, double(timings[k].failed_allocated) / double(timings[k].failed_reserved));
    }
    if (static_cast<int64_t>(order[k]) != chosen) continue;
    out.measured_seconds = timings[k].seconds;
    out.measured_peak_bytes = timings[k].peak_bytes;
  }
  out.measured_tie = measured.tie;
  out.why.push_back(detail::timed_text(names, predictions, measured));
  if (std::any_of(order.begin(), order.end(),
                  [&](size_t i) { return timed_examples(fitting[i].settings, batch) < batch; })) {
    out.why.push_back(fmt::format("micro-batched candidates ran steps of whole micro-batches, at least two and about "
                                  "{} examples, not all {}: such a step peaks as the whole one does, and its time is "
                                  "scaled to the batch by the prediction", kTimedExamples, batch));
  }
  if (chosen < 0) return std::nullopt;
  return fitting[static_cast<size_t>(chosen)];
}

// On CUDA the budget caps the caching allocator's reserved bytes, and
// fragmentation (recomputation's churn most) can hold more than the step
// allocates: some timed candidates ran out of memory with their allocated
// bytes below the budget (docs/workloads.md: the GPT on the H100 at 323 MiB).
// The grid is searched again with the limit scaled by the `room` they left
// (allocated ÷ reserved), so that schedules are solved for what the allocator
// lets the step allocate, and those not yet timed are timed; the faster of
// their choice and `best` (as detail::choose_timed settles measured times) stands.
std::optional<Candidate> within_reserved(const ModuleStepModel& model, const ModuleStepModel::Impl& im,
                                         int64_t batch, int64_t budget,
                                         bool micro_batching, double room, std::optional<Candidate> best,
                                         ModulePlan& out) {
  auto again = search(model, im, batch, budget, micro_batching, room);
  std::set<std::string> timed;
  for (const auto& t : out.timed) timed.insert(candidate_text(t.settings, t.schedules, batch, out.chains));
  std::vector<Candidate> next;
  for (auto& c : again.fitting) {
    if (!c.edge && !timed.count(candidate_text(c.settings, c.schedules, batch, out.chains))) {
      next.push_back(std::move(c));
    }
  }
  if (next.empty()) return best;
  out.why.push_back(fmt::format("on {} the budget caps the caching allocator's reserved bytes, and candidates ran out "
                                "of memory with {:.0f}% of them allocated: searched again within {:.0f}% of the "
                                "limit, and timed the new candidates against the choice so far",
                                model.base().device().str(), 100 * room, 100 * room));
  const double best_seconds = out.measured_seconds;
  const int64_t best_peak = out.measured_peak_bytes;
  double ignored = 1.0;
  auto chosen = measured_choice(model, im, next, batch, budget, out, ignored);
  if (!chosen) return best;
  if (best && best_seconds > 0) {
    std::vector<detail::Ranked> measured = {
        detail::ranked(best->settings, best->predicted, any_recompute(best->schedules)),
        detail::ranked(chosen->settings, chosen->predicted, any_recompute(chosen->schedules))};
    measured[0].seconds = best_seconds;
    measured[1].seconds = out.measured_seconds;
    if (detail::choose_timed(measured, detail::kTimeTie) == 0) {
      out.measured_seconds = best_seconds;
      out.measured_peak_bytes = best_peak;
      out.why.push_back("the choice so far stays: the new candidates measured no faster");
      return best;
    }
  }
  return chosen;
}

// The plan with its steps run under the budget (PlanOptions::verify): the
// candidate named `first` where there is one (a busy machine's choice that
// was not timed), then the best of `fitting` by prediction. A candidate whose
// steps overrun the budget scales every later prediction by how far it was
// off, and the plan says so; kVerifyAttempts run in all. Without verify the
// first is returned unrun. nullopt: none ran within the budget.
std::optional<Candidate> verified_choice(const ModuleStepModel& model, const ModuleStepModel::Impl& im,
                                         std::vector<Candidate> fitting, const std::optional<std::string>& first,
                                         int64_t batch, int64_t budget, int64_t limit, ModulePlan& out) {
  double correction = 1.0;
  bool first_tried = !first.has_value();
  for (int attempts = 0; !fitting.empty() && attempts < kVerifyAttempts;) {
    auto it = fitting.end();
    if (!first_tried) {
      it = std::find_if(fitting.begin(), fitting.end(), [&](const Candidate& c) {
        return candidate_text(c.settings, c.schedules, batch, out.chains) == *first;
      });
      first_tried = true;
    }
    if (it == fitting.end()) it = best_fitting(fitting, correction, limit);  // still fits after the correction
    if (it == fitting.end()) break;
    const Candidate c = *it;
    fitting.erase(it);
    if (!model.options().verify()) return c;
    ++attempts;
    const int64_t measured = run_plan(model, im, c.settings, c.schedules, batch, budget).peak_bytes;
    if (measured >= 0 && measured <= budget) {
      out.measured_peak_bytes = measured;
      return c;
    }
    correction = std::max(correction * 1.01, double(measured >= 0 ? measured : budget) /
                                                 double(c.predicted.peak_bytes) * (measured >= 0 ? 1.0 : 1.02));
    out.why.push_back(fmt::format("{} with checkpoint {}: predicted {}, but its steps {}",
                                  detail::settings_text(c.settings, batch), schedules_text(out.chains, c.schedules),
                                  format_bytes(c.predicted.peak_bytes),
                                  measured >= 0 ? "peaked at " + format_bytes(measured)
                                                : std::string("ran out of memory under the budget")));
  }
  return std::nullopt;
}

} // namespace

ModulePlan plan(const ModuleStepModel& model, int64_t budget) { return plan(model, budget, model.sample_examples()); }

ModulePlan plan(const ModuleStepModel& model, int64_t budget, int64_t batch) {
  TORCH_CHECK(budget > 0, "plan: budget must be positive, got ", budget);
  TORCH_CHECK(batch >= 4 && batch <= model.sample_examples(), "plan: batch ", batch, " is not one the measured "
              "sample holds: plan batches of 4 to ", model.sample_examples(), " examples, or measure a larger sample");
  const auto& o = model.options();
  const auto& chains = model.chains();
  const int64_t limit = static_cast<int64_t>(std::floor(o.margin() * double(budget)));
  ModulePlan out;
  out.budget = budget;
  out.batch = batch;
  out.model = model_signature(*model.impl_->probe.module);
  out.optimizer = optimizer_signature(model.impl_->base);
  for (const auto& f : chains) out.chains.push_back(f.name);
  const auto plain = model.predict(batch, model.impl_->plain_settings(), {});
  out.plain_peak_bytes = plain.peak_bytes;
  out.plain_seconds = plain.seconds;
  const bool micro_batching = detail::may_micro_batch(o, model.impl_->batch_statistics);
  auto found = search(model, *model.impl_, batch, budget, micro_batching);
  if (wants_streaming(found, limit) && model.impl_->measure_held_back()) {  // a cache: the model stays logically const
    found = search(model, *model.impl_, batch, budget, micro_batching);
  }
  out.candidates = found.candidates;
  std::string precisions;
  for (auto p : o.precisions()) precisions += (precisions.empty() ? "" : ", ") + to_string(p);
  const bool fp32 = std::find(o.precisions().begin(), o.precisions().end(), Precision::kFP32) != o.precisions().end();
  const std::string offloads =
      !o.offload() ? "none"
      : !model.impl_->streams() || !fp32
          ? "none, optimizer, optimizer and gradients"
          : !model.impl_->stream_refused.empty()
              ? "none, optimizer, optimizer and gradients; parameters not streamed: " + model.impl_->stream_refused
          : model.impl_->streamed_measured
              ? "none, optimizer, optimizer and gradients, and in fp32 also the chains' parameters streamed"
              : "none, optimizer, optimizer and gradients; the chains' parameters streamed are measured only where "
                "nothing resident fits or the fastest that does holds the optimizer state and gradients on the host";
  out.why.push_back(fmt::format("measured the module's step at micro-batches of {} and {}{} ({}; offload {}{}), "
                                "{} chain(s): {}",
                                model.impl_->m_small, model.impl_->m_large,
                                model.impl_->profile_note,
                                precisions, offloads,
                                model.impl_->selective_choices.size() > 1 ? "; with and without selective recomputation"
                                : model.impl_->selective_choices.front() ? "; with selective recomputation"
                                                                         : "",
                                chains.size(), chains.empty() ? "none" : schedules_text(out.chains, {})));
  out.why.push_back(fmt::format("plain step of {}: predicted peak {}, {:.4f} s", batch,
                                format_bytes(plain.peak_bytes), plain.seconds));
  std::optional<Candidate> best;
  if (o.verify() && o.measure_candidates() > 0 && !found.fitting.empty()) {
    double room = 1.0;
    best = measured_choice(model, *model.impl_, found.fitting, batch, budget, out, room);
    if (room < 1.0) best = within_reserved(model, *model.impl_, batch, budget, micro_batching, room, best, out);
  }
  // On a busy machine the choice is what the plans do, among all predicted to
  // fit (detail::choose_measured), and it may not have been timed: its steps
  // run under the budget as those timed did, before any other's.
  if (!best || out.measured_peak_bytes == 0) {
    const auto first = best ? std::optional<std::string>(candidate_text(best->settings, best->schedules, batch, out.chains))
                            : std::nullopt;
    best = verified_choice(model, *model.impl_, std::move(found.fitting), first, batch, budget, limit, out);
  }
  TORCH_CHECK(best.has_value(), "plan: nothing fits ", format_bytes(budget), " (", format_bytes(limit),
              " after PlanOptions::margin) for a batch of ", batch, ": tried micro-batches of ", batch, " down to ",
              micro_batching ? (model.impl_->batch_statistics ? 2 : 1) : batch, ", precision ", precisions, ", offload ", offloads,
              o.checkpointing() && !chains.empty() ? ", checkpoint schedules for every chain" : "",
              "; the closest predicted peak is ", format_bytes(found.closest->predicted.peak_bytes), " (",
              detail::settings_text(found.closest->settings, batch), ")",
              detail::unlock_text(o, model.impl_->batch_statistics),
              chains.empty() ? ". The module has no chain: hold its repeated blocks in a "
                               "memfit::CheckpointedSequential and the plan can checkpoint them"
                             : "");
  out.fits = true;
  out.settings = best->settings;
  out.schedules = best->schedules;
  out.predicted = best->predicted;
  out.why.push_back(fmt::format("chosen: {} ({} step(s)); checkpoint {}", detail::settings_text(best->settings, batch),
                                best->predicted.accumulation_steps, schedules_text(out.chains, best->schedules)));
  if (best->edge) {
    out.why.push_back(detail::edge_chosen_text(best->predicted.peak_bytes, limit, o, out.measured_peak_bytes));
  }
  for (auto& line : detail::settings_lines(best->settings, model.impl_->selective_choices.size() > 1,
                                           checkpoint_text(out.chains, best->schedules, ""))) {
    out.why.push_back(std::move(line));
  }
  // A time is shown as measured where the plan's steps were timed; a
  // prediction alone (extrapolated from small steps) is labelled as one.
  const std::string peak = fmt::format("predicted peak {} of {} ({} phase)", format_bytes(best->predicted.peak_bytes),
                                       format_bytes(budget), best->predicted.phase);
  const std::string ran =
      out.measured_peak_bytes > 0 ? "; its steps peaked at " + format_bytes(out.measured_peak_bytes) : std::string();
  if (out.measured_seconds > 0) {
    out.why.push_back(fmt::format("{}{}{} {:.1f} ms per batch (predicted {:.1f} ms)", peak, ran,
                                  ran.empty() ? "; its steps took" : " and took", 1e3 * out.measured_seconds,
                                  1e3 * best->predicted.seconds));
  } else {
    out.why.push_back(fmt::format("{}{}; its time was not measured: {:.1f} ms per batch by extrapolation from the "
                                  "measured micro-batches ({:.2f}x plain's, likewise), which may be far off",
                                  peak, ran, 1e3 * best->predicted.seconds,
                                  plain.seconds > 0 ? best->predicted.seconds / plain.seconds : 0.0));
  }
  out.why.push_back(detail::micro_batch_text(o, model.impl_->batch_statistics, best->settings.micro_batch(),
                                     best->predicted.accumulation_steps, batch));
  return out;
}

namespace {
// Sets each of `chains`' schedules in `module`, found by name (`who` names the caller).
void set_schedules(torch::nn::Module& module, const std::vector<std::string>& chains,
                   const std::vector<Schedule>& schedules, const char* who) {
  auto found = find_chains(module);
  TORCH_CHECK(found.size() == chains.size(), who, ": the plan has ", chains.size(),
              " chain(s) but the module has ", found.size(), "; apply a plan to the module it was made for");
  for (size_t c = 0; c < found.size(); ++c) {
    TORCH_CHECK(found[c].name == chains[c], who, ": the plan's chain '", chains[c],
                "' is not in the module (found '", found[c].name, "')");
    const auto n = static_cast<int64_t>(found[c].chain->sequential()->size());
    found[c].chain->set_schedule(c < schedules.size() && !schedules[c].segments.empty() ? schedules[c]
                                                                                         : schedule_none(n));
  }
}

std::string checkpoint_json(const std::vector<std::string>& chains, const std::vector<Schedule>& schedules) {
  auto out = nlohmann::json::array();
  for (size_t c = 0; c < chains.size(); ++c) {
    out.push_back({{"name", chains[c]},
                   {"checkpoint", c < schedules.size() && detail::recomputes(schedules[c]) ? schedules[c].to_string()
                                                                                  : std::string("none")}});
  }
  return out.dump();
}
} // namespace

TrainerOptions ModulePlan::apply(torch::nn::Module& module, TrainerOptions base) const {
  set_schedules(module, chains, schedules, "ModulePlan::apply");
  set_selective_recompute(module, settings.selective_recompute());
  return trainer_options(settings, std::move(base));
}

std::string ModulePlan::to_json() const {
  auto j = nlohmann::json::parse(Plan::to_json());
  j["checkpoint"] = checkpoint_text(chains, schedules);
  j["chains"] = nlohmann::json::parse(checkpoint_json(chains, schedules));
  return j.dump(2);
}

std::string ModulePlan::explain() const { return Plan::explain(); }

std::string model_signature(const torch::nn::Module& module) {
  std::string shapes;
  int64_t tensors = 0, values = 0;
  const auto add = [&](const torch::Tensor& t) {
    ++tensors;
    values += t.numel();
    shapes += fmt::format("{} {}\n", fmt::join(t.sizes(), "x"), c10::toString(t.scalar_type()));
  };
  for (const auto& p : module.parameters(/*recurse=*/true)) add(p);
  for (const auto& b : module.buffers(/*recurse=*/true)) add(b);
  const auto crc = ::crc32(0, reinterpret_cast<const Bytef*>(shapes.data()), static_cast<uInt>(shapes.size()));
  return fmt::format("{} tensors of {} values, shapes' CRC-32 {:08x}", tensors, values, crc);
}

std::string optimizer_signature(const TrainerOptions& options) {
  if (options.optimizer_factory()) return "optimizer_factory's";
  switch (options.optimizer()) {
    case OptimizerKind::kAdam:
      return "Adam";
    case OptimizerKind::kAdamW:
      return "AdamW";
    case OptimizerKind::kSGD:
      return options.momentum() != 0 ? "SGD with momentum" : "SGD";
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled optimizer kind");
}

void broadcast_plan(ModulePlan& plan, ProcessGroup& group, int64_t root) {
  detail::broadcast_plan_wire(
      plan, group, root,
      [&](nlohmann::json& wire) {
        wire["chains"] = plan.chains;
        wire["schedules"] = detail::schedules_wire(plan.schedules);
        wire["model"] = plan.model;
        wire["optimizer"] = plan.optimizer;
      },
      [&](const nlohmann::json& wire) {
        plan.chains = wire.at("chains").get<std::vector<std::string>>();
        plan.schedules = detail::schedules_from_wire(wire.at("schedules"));
        plan.model = wire.at("model").get<std::string>();
        plan.optimizer = wire.at("optimizer").get<std::string>();
      });
}

namespace {
constexpr const char* kPlanFormat = "memfit.module_plan.v1";
} // namespace

void save_plan(const ModulePlan& plan, const std::string& path) {
  auto wire = detail::plan_wire(plan);
  wire["format"] = kPlanFormat;
  wire["chains"] = plan.chains;
  wire["schedules"] = detail::schedules_wire(plan.schedules);
  if (!plan.model.empty()) wire["model"] = plan.model;
  if (!plan.optimizer.empty()) wire["optimizer"] = plan.optimizer;
  write_file_atomically(path, wire.dump(2) + "\n");
}

namespace {
// A JSON library's exception as a reader's words: "[json.exception.type_error.302] type must be number,
// but is string" becomes "type must be number, but is string".
std::string json_error_text(const nlohmann::json::exception& e) {
  std::string text = e.what();
  const auto close = text.find("] ");
  return text.rfind("[json.exception.", 0) == 0 && close != std::string::npos ? text.substr(close + 2) : text;
}
} // namespace

ModulePlan load_plan(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good() && !std::filesystem::is_directory(path), "load_plan: cannot read ", path,
              ": give the file that save_plan wrote");
  ModulePlan plan;
  nlohmann::json wire;
  try {
    wire = detail::parse_json(in);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, path, " is not JSON (", json_error_text(e), "): write it again with save_plan");
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, " is damaged: ", e.what_without_backtrace(), "; write it again with save_plan");
  }
  TORCH_CHECK(wire.is_object() && wire.contains("format") && wire["format"].is_string() &&
                  wire["format"].get<std::string>() == kPlanFormat,
              path,
              " is not a memfit plan (", kPlanFormat, "): write one with save_plan");
  try {
    detail::plan_from_wire(wire, plan);
    plan.chains = wire.at("chains").get<std::vector<std::string>>();
    plan.schedules = detail::schedules_from_wire(wire.at("schedules"));
    if (wire.contains("model")) {
      TORCH_CHECK(wire["model"].is_string(), "\"model\" is ", wire["model"].type_name(), ", not a string");
      plan.model = wire["model"].get<std::string>();
    }
    if (wire.contains("optimizer")) {
      TORCH_CHECK(wire["optimizer"].is_string(), "\"optimizer\" is ", wire["optimizer"].type_name(),
                  ", not a string");
      plan.optimizer = wire["optimizer"].get<std::string>();
    }
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, path, " is damaged (", json_error_text(e), "): write it again with save_plan");
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, " is damaged: ", e.what_without_backtrace(), "; write it again with save_plan");
  }
  TORCH_CHECK(plan.chains.size() == plan.schedules.size(), path, " is damaged: ", plan.chains.size(),
              " chain(s) but ", plan.schedules.size(), " schedule(s); write it again with save_plan");
  return plan;
}

std::string plan_mismatch(const ModulePlan& plan, const torch::nn::Module& module, int64_t batch, int64_t budget,
                          const PlanOptions& options, const TrainerOptions& base) {
  const auto& s = plan.settings;
  if (!plan.model.empty() && plan.model != model_signature(module)) {
    return fmt::format("it was made for another model ({}), not this one ({})", plan.model, model_signature(module));
  }
  if (!plan.optimizer.empty() && plan.optimizer != optimizer_signature(base)) {
    return fmt::format("its steps were measured with the optimizer {}, not {}", plan.optimizer,
                       optimizer_signature(base));
  }
  if (plan.budget != budget) {
    return fmt::format("it was made for a budget of {}, not {}", format_bytes(plan.budget), format_bytes(budget));
  }
  if (plan.batch != batch) return fmt::format("it was made for a batch of {}, not {}", plan.batch, batch);
  const auto& allowed = options.precisions();
  if (std::find(allowed.begin(), allowed.end(), s.precision()) == allowed.end()) {
    return fmt::format("it trains in {}, which PlanOptions::precisions leaves out", to_string(s.precision()));
  }
  if (s.micro_batch() > 0 && s.micro_batch() < batch) {
    const auto layer = batch_statistics_layer(module);
    if (!detail::may_micro_batch(options, layer)) {
      return layer ? fmt::format("it micro-batches, which changes the statistics of BatchNorm layer '{}', and "
                                 "PlanOptions::batch_statistics keeps them", *layer)
                   : std::string("it micro-batches, and PlanOptions::micro_batching is false");
    }
  }
  if (detail::offload_rank(s) > 0 && !options.offload()) return "it offloads, and PlanOptions::offload is false";
  if ((s.selective_recompute() && options.selective_recompute() == SelectiveRecompute::kOff) ||
      (!s.selective_recompute() && options.selective_recompute() == SelectiveRecompute::kOn)) {
    return fmt::format("it {} selective recomputation, which PlanOptions::selective_recompute rules out",
                       s.selective_recompute() ? "uses" : "goes without");
  }
  const auto found = find_chains(module);
  for (size_t i = 0; i < plan.chains.size(); ++i) {
    const auto& name = plan.chains[i];
    if (std::none_of(found.begin(), found.end(), [&](const FoundChain& f) { return f.name == name; })) {
      return fmt::format("it schedules chain '{}', which the module lacks", name);
    }
    if (!options.checkpointing() && detail::recomputes(plan.schedules[i])) {
      return fmt::format("it recomputes in chain '{}', and PlanOptions::checkpointing is false", name);
    }
  }
  return "";
}

ModuleBatchSearch find_batch(const ModuleStepModel& model, int64_t budget, const FindBatchOptions& options) {
  TORCH_CHECK(budget > 0, "find_batch: budget must be positive, got ", budget);
  TORCH_CHECK(options.max_batch() > 0, "FindBatchOptions::max_batch must be positive, got ", options.max_batch());
  TORCH_CHECK(options.attempts() > 0, "FindBatchOptions::attempts must be positive, got ", options.attempts());
  model.impl_->measure_held_back();  // streaming may fit a larger batch
  const auto& im = *model.impl_;
  const auto& o = im.options;
  const int64_t limit = static_cast<int64_t>(std::floor(o.margin() * double(budget)));
  // Verified answers are run, so they are at most the examples the probe reads.
  const int64_t top = options.verify() ? std::min(options.max_batch(), im.probe.examples) : options.max_batch();
  ModuleBatchSearch out;
  out.budget = budget;
  for (const auto& f : im.chains) out.chains.push_back(f.name);
  // Each search, then its verification; `choose` gives the step for a batch, if one fits.
  auto run = [&](ModuleBatchFound& found, const std::function<std::optional<Candidate>(int64_t)>& choose) {
    found.batch = detail::largest_fitting(top, [&](int64_t b) { return choose(b).has_value(); });
    while (found.batch > 0) {
      const auto c = *choose(found.batch);
      found.settings = c.settings;
      found.schedules = c.schedules;
      found.predicted_peak_bytes = c.predicted.peak_bytes;
      if (!options.verify() || found.attempts >= options.attempts()) return;
      ++found.attempts;
      const int64_t peak = run_plan(model, im, c.settings, c.schedules, found.batch, budget).peak_bytes;
      if (peak >= 0 && peak <= budget) {
        found.verified = true;
        found.measured_peak_bytes = peak;
        return;
      }
      found.batch = static_cast<int64_t>(double(found.batch) * 0.9);
      while (found.batch > 0 && !choose(found.batch)) --found.batch;
    }
  };
  const auto plain = im.plain_settings();
  run(out.plain, [&](int64_t b) -> std::optional<Candidate> {
    Candidate c{plain, std::vector<Schedule>(im.chains.size()), model.predict(b, plain, {})};
    if (c.predicted.peak_bytes > limit) return std::nullopt;
    return c;
  });
  run(out.techniques, [&](int64_t b) -> std::optional<Candidate> {
    auto found = search(model, im, b, budget, /*micro_batching=*/false);
    const auto it = best_fitting(found.fitting, 1.0, limit);
    if (it == found.fitting.end()) return std::nullopt;
    return *it;
  });
  return out;
}

namespace detail {
StepProbe make_probe(torch::nn::Sequential model, const torch::data::Example<>& sample) {
  TORCH_CHECK(!model.is_empty(), "plan needs a model, got an empty Sequential holder");
  using Traits = BatchTraits<torch::data::Example<>>;
  StepProbe probe;
  probe.module = model.ptr();
  probe.examples = Traits::size(sample);
  probe.make_trainer = [model](const TrainerOptions& options) { return Trainer(model, options); };
  probe.step = [sample](Trainer& trainer, int64_t examples) {
    return trainer.train_step(Traits::slice(sample, 0, examples));
  };
  return probe;
}
} // namespace detail

ModulePlan plan(torch::nn::Sequential model, const torch::data::Example<>& sample, int64_t budget,
                PlanOptions options, TrainerOptions base) {
  ModuleStepModel m(detail::make_probe(std::move(model), sample), detail::measuring_within(std::move(options), budget),
                    std::move(base));
  return plan(m, budget);
}

ModuleProfile profile(torch::nn::Sequential model, const torch::data::Example<>& sample, PlanOptions options,
                      TrainerOptions base) {
  ModuleStepModel m(detail::make_probe(std::move(model), sample), std::move(options), std::move(base));
  return profile(m);
}

ModuleProfile profile(const ModuleStepModel& model) {
  const auto& im = *model.impl_;
  ModuleProfile out;
  out.batch = im.probe.examples;
  out.precision = im.options.precisions().front();
  const auto plain = im.plain_settings();
  for (size_t c = 0; c < im.chains.size(); ++c) {
    out.chains.push_back(im.chains[c].name);
    const auto& p = im.profiles.at(std::make_pair(out.precision, plain.selective_recompute()))[c];
    out.layers.push_back(scale_profile(p.first, p.second, im.m_small, im.m_large, out.batch));
  }
  out.predicted = model.predict(out.batch, plain, {});
  // Three real steps: the first makes the optimizer's state.
  detail::ModuleStateGuard restore(*im.probe.module);
  SelectiveRecomputeGuard selective(*im.probe.module, plain.selective_recompute());
  auto trainer = im.probe.make_trainer(
      trainer_options(plain, im.base).batch_size(out.batch).save_dir("").on_out_of_memory(OnOutOfMemory::kThrow));
  for (int k = 0; k < 3; ++k) {
    const auto rec = im.probe.step(trainer, out.batch);
    if (k > 0) out.step_seconds = k == 1 ? rec.seconds : std::min(out.step_seconds, rec.seconds);
  }
  out.step = trainer.last_step_memory();
  out.timeline = trainer.last_timeline();
  return out;
}

std::string ModuleProfile::table() const {
  std::string out;
  for (size_t c = 0; c < chains.size(); ++c) {
    out += fmt::format("chain {} at batch {} ({}):\n{}", chains[c].empty() ? "(the module)" : chains[c], batch,
                       to_string(precision), layers[c].table());
  }
  out += fmt::format("predicted plain training step: peak {} in the {} phase, {:.1f} ms\n{}",
                     format_bytes(predicted.peak_bytes), predicted.phase, 1e3 * predicted.seconds,
                     predicted.memory.table());
  out += fmt::format("measured plain training step: peak {}, {:.1f} ms\n{}", format_bytes(step.peak),
                     1e3 * step_seconds, step.table());
  return out;
}

std::string ModuleProfile::to_json() const {
  nlohmann::json j = {{"batch", batch},
                      {"precision", to_string(precision)},
                      {"chains", nlohmann::json::array()},
                      {"predicted_step_peak_bytes", predicted.peak_bytes},
                      {"predicted_step_seconds", predicted.seconds},
                      {"predicted_memory", nlohmann::json::parse(predicted.memory.to_json())},
                      {"measured_step_peak_bytes", step.peak},
                      {"measured_memory", nlohmann::json::parse(step.to_json())},
                      {"measured_step_seconds", step_seconds}};
  for (size_t c = 0; c < chains.size(); ++c) {
    j["chains"].push_back({{"name", chains[c]}, {"layers", nlohmann::json::parse(layers[c].to_json())}});
  }
  return j.dump(2);
}

TrainerOptions ModuleBatchSearch::apply(const ModuleBatchFound& found, torch::nn::Module& module,
                                        TrainerOptions base) const {
  TORCH_CHECK(found.batch > 0, "ModuleBatchSearch::apply: not even a batch of 1 fits ", format_bytes(budget),
              "; nothing to apply");
  set_schedules(module, chains, found.schedules, "ModuleBatchSearch::apply");
  return trainer_options(StepSettings(found.settings).micro_batch(0), std::move(base)).batch_size(found.batch);
}

namespace {
nlohmann::json found_json(const ModuleBatchFound& f, const std::vector<std::string>& chains) {
  return {{"batch", f.batch},
          {"precision", to_string(f.settings.precision())},
          {"offload", offload_text(f.settings)},
          {"selective_recompute", f.settings.selective_recompute()},
          {"checkpoint", checkpoint_text(chains, f.schedules)},
          {"chains", nlohmann::json::parse(checkpoint_json(chains, f.schedules))},
          {"predicted_peak_bytes", f.predicted_peak_bytes},
          {"measured_peak_bytes", f.measured_peak_bytes},
          {"verified", f.verified},
          {"verification_runs", f.attempts}};
}

std::string found_text(const char* what, const ModuleBatchFound& f, const std::vector<std::string>& chains,
                       int64_t budget) {
  if (f.batch == 0) return fmt::format("{}: not even a batch of 1 fits {}\n", what, format_bytes(budget));
  return fmt::format("{}: batch {} ({}, offload {}; checkpoint {}), predicted peak {}{}\n", what, f.batch,
                     to_string(f.settings.precision()), offload_text(f.settings), schedules_text(chains, f.schedules),
                     format_bytes(f.predicted_peak_bytes),
                     f.verified ? fmt::format(", measured {} in {} run(s)", format_bytes(f.measured_peak_bytes),
                                              f.attempts)
                                : std::string(", not verified"));
}
} // namespace

std::string ModuleBatchSearch::to_json() const {
  nlohmann::json j = {{"budget_bytes", budget},
                      {"chains", chains},
                      {"plain", found_json(plain, chains)},
                      {"with_techniques", found_json(techniques, chains)}};
  return j.dump(2);
}

std::string ModuleBatchSearch::explain() const {
  return fmt::format("largest batch in one pass under {}:\n", format_bytes(budget)) +
         found_text("  plainly", plain, chains, budget) +
         found_text("  with checkpointing, offload and precision", techniques, chains, budget);
}

} // namespace memfit
