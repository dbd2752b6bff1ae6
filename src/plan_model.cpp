#include "plan_model.h"

#include "memfit/state.h"
#include "memfit/stream.h"

#include <fmt/format.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

namespace memfit {
namespace detail {

std::vector<bool> selective_choices(const PlanOptions& options, bool recomputable) {
  switch (options.selective_recompute()) {
    case SelectiveRecompute::kOff:
      return {false};
    case SelectiveRecompute::kChoose:
      return recomputable ? std::vector<bool>{false, true} : std::vector<bool>{false};
    case SelectiveRecompute::kOn:
      break;
  }
  TORCH_CHECK(recomputable, "PlanOptions::selective_recompute(kOn) needs a model with SelectivelyRecomputed "
              "modules (checkpoint.h: make_gpt's blocks, or your own); this one has none: use kChoose or kOff");
  return {true};
}

void check_measure_options(const PlanOptions& o) {
  TORCH_CHECK(o.measure_candidates() >= 0, "PlanOptions::measure_candidates must be >= 0 (0: choose by prediction "
              "alone), got ", o.measure_candidates());
  TORCH_CHECK(o.measure_within() >= 0, "PlanOptions::measure_within must be >= 0, got ", o.measure_within());
  TORCH_CHECK(o.profile_budget() >= 0, "PlanOptions::profile_budget must be >= 0 bytes (0: no limit), got ",
              o.profile_budget());
}

bool recomputes(const Schedule& s) {
  return std::any_of(s.segments.begin(), s.segments.end(), [](const Segment& g) { return g.checkpointed; });
}

int offload_rank(const StepSettings& s) {
  if (s.offload_parameters() == Offload::kHost) {
    if (s.tile_bytes() <= 0) return 3;
    int log2 = 0;
    while (log2 < 62 && (int64_t{1} << (log2 + 1)) <= s.tile_bytes()) ++log2;
    return 4 + (62 - log2);
  }
  return s.offload_gradients() == Offload::kHost  ? 2
         : s.offload_optimizer() == Offload::kHost ? 1
                                                   : 0;
}

} // namespace detail

namespace {

double line(double small, double large, int64_t b_small, int64_t b_large, int64_t m) {
  const double slope = (large - small) / double(b_large - b_small);
  const double intercept = small - slope * double(b_small);
  if (slope < 0) return std::max({0.0, small, large});
  if (intercept < 0) return std::max(0.0, large) * double(m) / double(b_large);
  return intercept + slope * double(m);
}

// `out`'s layers' byte figures (input, output, kept, forward peak, backward
// overhead), each bytes(a's, b's): from two profiles of one chain at two
// batches, a line through them (each planner draws its own).
template <class Bytes>
void scale_layer_bytes(ChainProfile& out, const ChainProfile& a, const ChainProfile& b, const Bytes& bytes) {
  for (size_t i = 0; i < out.layers.size(); ++i) {
    auto& l = out.layers[i];
    const auto& x = a.layers[i];
    const auto& y = b.layers[i];
    l.input_bytes = bytes(x.input_bytes, y.input_bytes);
    l.output_bytes = bytes(x.output_bytes, y.output_bytes);
    l.kept_bytes = bytes(x.kept_bytes, y.kept_bytes);
    l.forward_peak_bytes = bytes(x.forward_peak_bytes, y.forward_peak_bytes);
    l.backward_overhead_bytes = bytes(x.backward_overhead_bytes, y.backward_overhead_bytes);
  }
}

using Clock = std::chrono::steady_clock;

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
        } else if (grad) {
          rec->mark(Mark::kLayerIn, index);
          if (rec->active && x.requires_grad()) {
            x.register_hook([rec, index](const torch::Tensor&) { rec->mark(Mark::kLayerGrad, index); });
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

} // namespace

ChainProfile scale_profile(const ChainProfile& a, const ChainProfile& b, int64_t ma, int64_t mb, int64_t m) {
  ChainProfile out = b;
  scale_layer_bytes(out, a, b, [&](int64_t x, int64_t y) { return affine_bytes(x, y, ma, mb, m); });
  for (size_t i = 0; i < out.layers.size(); ++i) {
    auto& l = out.layers[i];
    l.forward_seconds = line(a.layers[i].forward_seconds, b.layers[i].forward_seconds, ma, mb, m);
    l.backward_seconds = line(a.layers[i].backward_seconds, b.layers[i].backward_seconds, ma, mb, m);
  }
  return out;
}

bool detail::same_measurement(const StepSettings& a, const StepSettings& b) {
  return a.precision() == b.precision() && a.selective_recompute() == b.selective_recompute() &&
         a.offload_optimizer() == b.offload_optimizer() && a.offload_gradients() == b.offload_gradients() &&
         a.offload_parameters() == b.offload_parameters() && a.tile_bytes() == b.tile_bytes();
}

namespace {
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

} // namespace

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
    const bool plain = plain_one && detail::same_measurement(s, plain_settings());
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
    if (detail::same_measurement(m.settings, s)) return m;
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
  const int64_t m = detail::micro_batch_of(settings, batch);
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
    double per_micro = line(ts.first, tl.first, im.m_small, im.m_large, m);
    if (m < im.m_small && !mm.one.empty()) {  // between the measured micro-batches of 1 and m_small
      const auto t1 = split(mm.one);
      const double at_small = line(ts.first, tl.first, im.m_small, im.m_large, im.m_small);
      per_micro = t1.first + (ts.first - t1.first) * double(m - 1) / double(im.m_small - 1);
      // A smaller micro-batch is no faster per example than m_small's: where
      // the measurements' noise says otherwise, 256 steps of one example
      // would be predicted about as fast as one step of 256.
      per_micro = std::max(per_micro, at_small * double(m) / double(im.m_small));
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

bool any_recompute(const std::vector<Schedule>& s) { return std::any_of(s.begin(), s.end(), detail::recomputes); }

namespace {
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

} // namespace

// Each chain's schedule for the memory its windows leave under `limit`, the
// others' schedules fixed, for a few rounds; the bounds tighten until the
// prediction fits or a chain cannot go lower. `frugal`: each chain's least-memory schedule instead.
std::optional<std::vector<Schedule>> solve_chains(const ModuleStepModel& model, const Measurement& meas,
                                                  int64_t batch, const StepSettings& settings, int64_t limit,
                                                  int64_t ms, int64_t ml, bool frugal) {
  const auto& chains = model.chains();
  const int64_t m = detail::micro_batch_of(settings, batch);
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

} // namespace memfit
