#include "memfit/trainer.h"

#include "trainer_internal.h"

#include "memfit/checkpoint.h"
#include "memfit/schedule.h"

#include "compat.h"
#include "memfit/freeze.h"
#include "memfit/optim.h"
#include "memfit/state.h"
#include "memory_internal.h"
#include "read_ahead.h"
#include "step_components.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/MemoryOverlap.h>
#include <torch/optim.h>
#include <torch/torch.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <mutex>
#include <optional>
#include <sstream>

namespace memfit {

using detail::Clock;
using detail::seconds_since;

namespace {

// What a loss function must return: the batch's mean loss, a floating
// scalar with grad.
void check_loss(const torch::Tensor& loss) {
  TORCH_CHECK(loss.defined(), "the loss function returned an undefined tensor: return the batch's mean loss, "
              "a scalar computed from the module's output");
  TORCH_CHECK(loss.numel() == 1, "the loss function returned a tensor of shape ", loss.sizes(),
              ": return a scalar, the batch's mean loss (reduction mean, or .mean())");
  TORCH_CHECK(at::isFloatingType(loss.scalar_type()), "the loss function returned a ", loss.scalar_type(),
              " scalar: return a floating-point loss");
  TORCH_CHECK(loss.requires_grad(), "the loss function returned a ", loss.scalar_type(),
              " scalar without grad (made under no-grad, detached, or from frozen parameters only): "
              "return the loss computed from the module's output");
}

} // namespace

namespace detail {

EvalScope::EvalScope(torch::nn::Module& module, const torch::Device& device, Precision precision)
    : module_(module), was_training_(module.is_training()), autocast_(device, precision) {
  module_.eval();
}

EvalScope::~EvalScope() { module_.train(was_training_); }

} // namespace detail


namespace {

// The Sequential form: the classifier's cross-entropy, with the forward
// through the parameter stream when there is one. Autocast covers the
// forward; the loss is taken in fp32.
std::function<torch::Tensor(const torch::data::Example<>&)> classifier_loss(
    torch::nn::Sequential model, std::shared_ptr<ParameterStream> stream, torch::Device device) {
  return [model, stream, device](const torch::data::Example<>& b) mutable {
    const auto logits = stream ? stream->forward(b.data) : model->forward(b.data);
    AutocastGuard fp32(device, Precision::kFP32);
    return detail::cross_entropy(logits, b.target);
  };
}

// Refuses a module whose parameter shares one element over its shape: the
// placeholders a live Trainer that streams the parameters leaves there
// (MasterWeights), which no step, plan or in-place write can use.
void check_own_storage(const torch::nn::Module& module) {
  for (const auto& p : module.named_parameters()) {
    TORCH_CHECK(p.value().numel() <= 1 || at::has_internal_overlap(p.value()) != at::MemOverlap::Yes,
                "Trainer: parameter '", p.key(), "' of shape ", p.value().sizes(), " has no values of its own: "
                "another Trainer streams this module's parameters (TrainerOptions::offload_parameters) and leaves "
                "placeholders there until it ends; end that Trainer before building another, planning or writing "
                "into the module");
  }
}

} // namespace

Trainer::Trainer(torch::nn::Sequential model, TrainerOptions options)
    : Trainer(ErasedLoss{model.is_empty() ? nullptr : model.ptr(), model, std::any()}, std::move(options)) {}


Trainer::Trainer(ErasedLoss loss, TrainerOptions options)
    : module_(std::move(loss.module)),
      classifier_(std::move(loss.classifier)),
      loss_(std::move(loss.loss)),
      options_(std::move(options)) {
  TORCH_CHECK(module_ != nullptr, "Trainer needs a model, got an empty module holder");
  check_own_storage(*module_);
  check_options();
  check_ranks_agree(*module_, options_);  // before any other collective
  if (!options_.save_dir().empty() && rank() == 0) save_lock_ = FolderLock(options_.save_dir(), "TrainerOptions::save_dir");
  memory_allocated(options_.device());  // starts tracking (and checks the device)
  for (const auto& pattern : options_.freeze()) freeze(*module_, pattern);
  if (options_.parallel() == ParallelMode::kPipeline) split_into_stages();
  warn_if_micro_batches_change_statistics();
  place_model();
  const std::vector<torch::Tensor> model_params = module_->parameters();
  const std::vector<torch::Tensor> params = make_masters(model_params);  // what the optimizer steps
  make_classifier_loss();
  auto scaler_options = options_.grad_scaler();
  scaler_options.enabled(scaler_options.enabled() && options_.precision() == Precision::kFP16);
  scaler_ = std::make_unique<GradScaler>(scaler_options);
  make_optimizer_over(trainable_of(params, model_params));
  if (options_.process_group() != nullptr && !pipeline_) make_data_parallel(params, model_params);
  generator_ = at::make_generator<at::CPUGeneratorImpl>(options_.seed());
  remember_first_settings();
  build_components();
}

// The Sequential form's loss, through the parameter stream when there is
// one. A step in progress holds the function (a recovery's new stream), so
// it is replaced in place.
void Trainer::make_classifier_loss() {
  if (!classifier_) return;
  auto fn = classifier_loss(classifier_, stream_, options_.device());
  if (auto* held = std::any_cast<decltype(fn)>(&loss_)) {
    *held = std::move(fn);
  } else {
    loss_ = std::move(fn);
  }
}

// This rank keeps its stage; the other layers go when the caller drops the model.
void Trainer::split_into_stages() {
  pipeline_ = std::make_unique<Pipeline>(classifier_, options_.process_group(), options_.pipeline());
  classifier_ = pipeline_->stage();
  module_ = classifier_.ptr();
  options_.pipeline(pipeline_->options());
}

void Trainer::warn_if_micro_batches_change_statistics() const {
  if (options_.micro_batch_size() == 0 || options_.micro_batch_size() >= options_.batch_size()) return;
  if (const auto layer = batch_statistics_layer(*module_)) {
    TORCH_WARN("micro-batching: BatchNorm layers (the first is '", *layer,
               "') normalise each micro-batch of ", options_.micro_batch_size(),
               " examples with its own statistics, not the batch of ", options_.batch_size(),
               "; gradients equal the full batch's only without batch statistics "
               "(GroupNorm or LayerNorm do)");
  }
}

// The model on its device, and every rank's equal to rank 0's.
void Trainer::place_model() {
  if (options_.offload_parameters() == Offload::kHost) {
    // Streamed parameters go from where the model was built to their host
    // masters (MasterWeights::stream_to); only the buffers move now.
    torch::NoGradGuard no_grad;
    for (auto& b : module_->buffers()) b.set_data(b.to(options_.device()));
  } else {
    module_->to(options_.device());
  }
  if (options_.process_group() != nullptr && !pipeline_) {
    // Every rank starts from rank 0's parameters and buffers, before fp32
    // masters are copied from them (so DistributedDataParallel, made after
    // the masters, skips its own broadcast).
    broadcast_module_state(*module_, *options_.process_group());
  }
}

// fp32 (or host) masters and the parameter stream, when the options keep
// them; returns the tensors the optimizer steps (the model's parameters
// when there are no masters).
std::vector<torch::Tensor> Trainer::make_masters(const std::vector<torch::Tensor>& model_params) {
  if (options_.master_weights() == MasterWeightsMode::kNone && options_.offload_optimizer() != Offload::kHost) {
    return model_params;
  }
  const auto dtype = options_.master_weights() != MasterWeightsMode::kNone ? scalar_type(options_.precision())
                                                                            : at::kFloat;
  master_ = std::make_unique<MasterWeights>(*module_, MasterWeightsOptions()
                                                          .dtype(dtype)
                                                          .offload(state_on_host() ? Offload::kHost : Offload::kNone)
                                                          .gradients(options_.offload_gradients())
                                                          .parameters(options_.offload_parameters())
                                                          .stream_to(options_.device()));
  if (master_->streamed()) {
    stream_ = classifier_ ? std::make_shared<ParameterStream>(classifier_, *master_, options_.stream())
                          : std::make_shared<ParameterStream>(module_, *master_, options_.stream());
  }
  return master_->master_parameters();
}

// The optimizer's tensors of the parameters that are not frozen.
std::vector<torch::Tensor> Trainer::trainable_of(const std::vector<torch::Tensor>& params,
                                                 const std::vector<torch::Tensor>& model_params) const {
  std::vector<torch::Tensor> trainable;
  for (size_t i = 0; i < params.size(); ++i) {
    if (model_params[i].requires_grad()) trainable.push_back(params[i]);
  }
  TORCH_CHECK(!trainable.empty() || !pipeline_, "pipeline stage ", rank(), " (layers ",
              pipeline_ ? pipeline_->first_layer() : 0, " to ",
              pipeline_ ? pipeline_->first_layer() + pipeline_->balance()[rank()] - 1 : 0,
              ") has no parameter to train: give it other layers (PipelineOptions().balance)");
  TORCH_CHECK(!trainable.empty(), "every parameter is frozen (patterns: ",
              c10::Join(", ", options_.freeze()), "): nothing to train; freeze fewer parameters");
  return trainable;
}

// The optimizer (sharded with zero_stage 1), its state in host memory when
// it lives with host masters.
void Trainer::make_optimizer_over(const std::vector<torch::Tensor>& trainable) {
  std::optional<UntrackedGuard> host;
  if (state_on_host()) host.emplace();
  if (options_.zero_stage() != 1) {
    optimizer_ = make_optimizer(options_, trainable);
    return;
  }
  const auto o = options_;
  auto zero = std::make_unique<ZeroRedundancyOptimizer>(
      trainable, [o](std::vector<torch::Tensor> p) { return make_optimizer(o, std::move(p)); },
      options_.process_group());
  zero_ = zero.get();
  optimizer_ = std::move(zero);
}

// What recovery restores after restore_after clean steps: the first
// micro-batch and the chains' first schedules and checkpoint options; and
// its default policy.
void Trainer::remember_first_settings() {
  first_micro_batch_ = options_.micro_batch_size();
  first_offload_ = options_.offload_optimizer();
  first_offload_gradients_ = options_.offload_gradients();
  first_offload_parameters_ = options_.offload_parameters();
  first_stream_ = options_.stream();
  restore_first_schedules_ = [chains = find_chains(*module_)]() mutable {
    std::vector<std::pair<Schedule, CheckpointOptions>> first;
    for (const auto& c : chains) first.emplace_back(c.chain->schedule(), c.chain->checkpoint_options());
    return [chains, first]() mutable {
      for (size_t i = 0; i < chains.size(); ++i) {
        chains[i].chain->set_schedule(first[i].first);
        chains[i].chain->set_checkpoint_options(first[i].second);
      }
    };
  }();
  if (options_.on_out_of_memory() == OnOutOfMemory::kReplan && !options_.replan()) {
    options_.replan(more_micro_batches(*module_, false));
  }
}

void Trainer::make_data_parallel(const std::vector<torch::Tensor>& params,
                                 const std::vector<torch::Tensor>& model_params) {
  // With gradient offload, the masters' hooks (registered first) have
  // moved each gradient to the host by the time DDP's hook sees it: the
  // host masters' gradients are reduced.
  std::vector<torch::Tensor> holders;
  if (options_.offload_gradients() == Offload::kHost) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (model_params[i].requires_grad()) holders.push_back(params[i]);
    }
  }
  ddp_ = std::make_unique<DistributedDataParallel>(
      module_, options_.process_group(),
      DistributedDataParallelOptions().bucket_cap_mb(options_.bucket_cap_mb()).init_sync(false), std::move(holders));
}


// The step's components, in the order the step calls them at each point.
void Trainer::build_components() {
  using namespace detail;
  components_.push_back(std::make_shared<StateRollback>(module_->buffers(), options_.device()));
  if (stream_) components_.push_back(std::make_shared<StreamStep>(*stream_));
  if (ddp_ && options_.on_out_of_memory() == OnOutOfMemory::kReplan) {
    vote_ = std::make_shared<RankVote>(*options_.process_group());  // the ranks recover together
  }
  if (ddp_) components_.push_back(std::make_shared<DataParallelStep>(*ddp_, *options_.process_group(), vote_.get()));
  const bool checks_loss = !scaler_->is_enabled() || options_.nonfinite_loss() == NonfiniteLoss::kUnchecked;
  if (vote_) {
    components_.push_back(std::make_shared<VoteBeforeCommit>(
        *vote_, world_size(), checks_loss ? options_.nonfinite_loss() : NonfiniteLoss::kUnchecked));
  }
  if (pipeline_) {
    components_.push_back(std::make_shared<PipelineStep>(*pipeline_, options_.device(), options_.precision()));
  }
  components_.push_back(std::make_shared<PrecisionStep>(options_.device(), options_.precision(), *scaler_));
  if (checks_loss) {
    components_.push_back(std::make_shared<NonfiniteCheck>(options_.nonfinite_loss(), world_size(),
                                                           pipeline_ ? "" : kSummedOverRanks));
  }
  if (master_) components_.push_back(std::make_shared<MasterWeightsStep>(*master_, state_on_host()));
  if (options_.max_grad_norm() > 0) {
    components_.push_back(std::make_shared<ClipStep>(options_.max_grad_norm(), *scaler_,
                                                     pipeline_ ? options_.process_group().get() : nullptr));
  }
  const std::vector<torch::Tensor> params = module_->parameters();
  std::vector<torch::Tensor> release = params;
  if (master_) release.insert(release.end(), master_->master_parameters().begin(), master_->master_parameters().end());
  components_.push_back(std::make_shared<OwnGradients>(std::move(release), options_.set_to_none()));
  OptimizerStatePart::Layout layout;
  layout.zero = zero_;
  layout.holder = state_optimizer();
  layout.on_host = state_on_host();
  layout.masters = master_ != nullptr;
  layout.world = world_size();
  layout.rank = rank();
  components_.push_back(std::make_shared<OptimizerStatePart>(*optimizer_, layout));
  timeline_ = std::make_shared<detail::Timeline>(options_.device(), params, state_on_host() ? nullptr : master_.get(),
                                         state_on_host() ? nullptr : state_optimizer());
  components_.push_back(timeline_);
}

void Trainer::add_component(std::shared_ptr<StepComponent> component) {
  TORCH_CHECK(component != nullptr, "add_component needs a component, got nullptr");
  added_components_.push_back(component);
  components_.insert(components_.end() - 1, std::move(component));  // the timeline stays last
}

const std::vector<PhaseMemory>& Trainer::last_timeline() const { return timeline_->timeline(); }

StepMemory Trainer::last_step_memory() const {
  int64_t peak = 0;  // the step's peak is its largest phase peak
  for (const auto& m : timeline_->timeline()) peak = std::max(peak, m.peak_bytes);
  return breakdown(peak, timeline_->model_grad_bytes());
}

void Trainer::wrong_batch_type(const char* name) const {
  TORCH_CHECK(false, "train_step got a batch of type ", c10::demangle(name), ", but the Trainer's loss takes ",
              loss_.has_value() ? c10::demangle(loss_.type().name()) : std::string("no batch"),
              ": pass the batch type the loss function takes");
}

bool Trainer::state_on_host() const {
  return options_.master_weights() == MasterWeightsMode::kHost ||
         options_.offload_optimizer() == Offload::kHost;
}

torch::optim::Optimizer* Trainer::state_optimizer() const {
  return zero_ != nullptr ? zero_->local_optimizer() : optimizer_.get();
}

int64_t Trainer::device_state_bytes() const {
  if (state_on_host() || state_optimizer() == nullptr) return 0;
  return optimizer_state_bytes(*state_optimizer());
}

StepMemory Trainer::breakdown(int64_t peak, int64_t model_grad_bytes) const {
  StepMemory m;
  m.peak = peak;
  std::vector<torch::Tensor> persistent = module_->parameters();
  const auto buffers = module_->buffers();
  persistent.insert(persistent.end(), buffers.begin(), buffers.end());
  m.gradients = model_grad_bytes;
  const bool state_on_device = !state_on_host();
  if (master_ && state_on_device) {
    // One count: parameters kept in fp32 are their own masters.
    const auto& masters = master_->master_parameters();
    persistent.insert(persistent.end(), masters.begin(), masters.end());
    std::vector<torch::Tensor> grads;
    for (const auto& p : master_->master_parameters()) grads.push_back(p.grad());
    m.gradients = std::max(m.gradients, storage_bytes(grads));
  }
  m.parameters = storage_bytes(persistent);
  m.optimizer_state = device_state_bytes();
  m.activations = std::max<int64_t>(0, peak - m.parameters - m.gradients - m.optimizer_state);
  return m;
}

Trainer::~Trainer() = default;
Trainer::Trainer(Trainer&&) noexcept = default;
Trainer& Trainer::operator=(Trainer&&) noexcept = default;

int64_t Trainer::world_size() const {
  return options_.process_group() != nullptr ? options_.process_group()->size() : 1;
}

int64_t Trainer::rank() const {
  return options_.process_group() != nullptr ? options_.process_group()->rank() : 0;
}

int64_t Trainer::data_ranks() const { return pipeline_ ? 1 : world_size(); }


int64_t Trainer::total_steps_of(int64_t examples) const {
  if (options_.steps() > 0) return options_.steps();
  int64_t global = 0, total = 0;
  TORCH_CHECK(!__builtin_mul_overflow(options_.batch_size(), data_ranks(), &global),
              "batch_size ", options_.batch_size(), " times ", data_ranks(), " ranks overflows int64");
  const int64_t per_epoch = examples / global + (examples % global != 0 ? 1 : 0);
  TORCH_CHECK(!__builtin_mul_overflow(per_epoch, options_.epochs(), &total), "epochs ", options_.epochs(),
              " of ", per_epoch, " steps each overflow int64: ask for fewer epochs, or for steps");
  return total;
}

namespace {

template <class Fn>
void call_all(const std::vector<std::shared_ptr<StepComponent>>& components, Fn fn) {
  for (const auto& c : components) fn(*c);
}

// Calls every component's abort_step, in reverse order, unless the step
// got to its end.
class AbortGuard {
 public:
  AbortGuard(const std::vector<std::shared_ptr<StepComponent>>& components, StepState& state)
      : components_(components), state_(state) {}
  ~AbortGuard() {
    if (done_) return;
    for (auto it = components_.rbegin(); it != components_.rend(); ++it) (*it)->abort_step(state_);
    try {
      release_failed_backward();  // the graph a failed backward left in LibTorch's queue
    } catch (const std::exception& e) {
      TORCH_WARN("memfit: could not release a failed backward's graph: ", e.what());
    }
  }
  AbortGuard(const AbortGuard&) = delete;
  AbortGuard& operator=(const AbortGuard&) = delete;
  void done() { done_ = true; }

 private:
  const std::vector<std::shared_ptr<StepComponent>>& components_;
  StepState& state_;
  bool done_ = false;
};

// Micro-batch `s.micro` (of `micro` examples at most) of the step's forward
// and backward, each component called at its points; false when a component
// skipped the step after the forward (no backward ran). `world`: the
// data-parallel ranks whose gradients are averaged.
bool micro_batch(const std::vector<std::shared_ptr<StepComponent>>& cs, StepState& s, const detail::StepInput& in,
                 int64_t micro, int64_t world) {
  const int64_t start = s.micro * micro;
  s.micro_examples = std::min(micro, in.examples - start);
  const std::string k = std::to_string(s.micro + 1);
  call_all(cs, [&](StepComponent& c) { c.before_forward(s); });
  std::shared_ptr<void> staged;  // the micro-batch, alive until its backward has run
  torch::Tensor loss = in.loss(start, s.micro_examples, staged);
  check_loss(loss);
  // Each micro-batch's mean loss weighted by its share of the step's
  // examples (times the ranks, whose gradients are averaged): the
  // gradients add up to the mean-loss gradient over all of them.
  if (s.micro_examples * world != s.global_examples) {
    loss = loss * (double(s.micro_examples * world) / double(s.global_examples));
  }
  s.loss = loss;
  s.loss_sum.add_(loss.detach());
  s.phase = "forward " + k;
  call_all(cs, [&](StepComponent& c) { c.after_forward(s); });
  if (s.skip) return false;
  call_all(cs, [&](StepComponent& c) { c.before_backward(s); });
  torch::Tensor scaled = loss;
  for (const auto& c : cs) scaled = c->scale_loss(scaled);
  s.loss = torch::Tensor();
  loss = torch::Tensor();
  scaled.backward();
  scaled = torch::Tensor();
  s.phase = "backward " + k;
  call_all(cs, [&](StepComponent& c) { c.after_backward(s); });
  return true;
}

} // namespace

// One attempt at the step: it completes, or it throws having called every
// component's abort_step, which leaves the state as the step found it.
StepRecord Trainer::step_once(const detail::StepInput& in) {
  committing_ = committed_ = false;
  phase_ = StepPhase::kForwardBackward;
  const auto& cs = components_;
  const auto start_time = Clock::now();
  PeakMeter meter(options_.device());
  StepState s;
  s.step = step_ + 1;
  s.epoch = std::max<int64_t>(epoch_, 0);
  s.examples = in.examples;
  s.global_examples = in.global_examples > 0 ? in.global_examples : in.examples * data_ranks();
  const int64_t micro = options_.micro_batch_size() > 0 ? std::min(options_.micro_batch_size(), in.examples)
                                                        : in.examples;
  s.micro_batches = (in.examples + micro - 1) / micro;
  s.optimizer = optimizer_.get();
  s.example = in.example;
  const int64_t world = data_ranks();
  AbortGuard abort(cs, s);
  call_all(cs, [&](StepComponent& c) { c.begin_step(s); });
  bool taken = false;
  for (const auto& c : cs) taken = taken || c->forward_backward(s);
  if (taken) {
    s.phase = "forward and backward";
    call_all(cs, [&](StepComponent& c) { c.after_backward(s); });
  }
  if (!taken) {
    // The losses are summed where they are and read once, after the last
    // micro-batch: one synchronisation per step (on the CPU the sum is host memory).
    std::optional<UntrackedGuard> host;
    if (options_.device().is_cpu()) host.emplace();
    s.loss_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(options_.device()));
  }
  for (s.micro = 0; !taken && s.micro < s.micro_batches && !s.skip; ++s.micro) {
    if (!micro_batch(cs, s, in, micro, world)) break;
  }
  torch::Tensor loss_tensor = taken ? torch::Tensor() : s.loss_sum;
  if (!taken) {
    // The step's one read of a device value, unless no component needs it.
    s.loss_value = s.read_loss ? s.loss_sum.item<double>() : std::numeric_limits<double>::quiet_NaN();
  }
  s.loss_sum = torch::Tensor();
  phase_ = StepPhase::kUpdate;
  call_all(cs, [&](StepComponent& c) { c.finish_backward(s); });
  if (!s.skip) {
    call_all(cs, [&](StepComponent& c) { c.before_optimizer_step(s); });
    committing_ = true;  // an optimizer of memfit's changes nothing until it has all it allocates
    bool stepped_by_component = false;
    for (const auto& c : cs) stepped_by_component = stepped_by_component || c->optimizer_step(s);
    if (!stepped_by_component) {
      optimizer_->step();
      s.stepped = true;
    }
    committing_ = false;
    committed_ = s.stepped;  // the update is not undone; a skipped one (fp16) is, until the ranks' vote after it
    call_all(cs, [&](StepComponent& c) { c.after_optimizer_step(s); });
    committed_ = true;  // the scaler has updated
  }
  abort.done();
  call_all(cs, [&](StepComponent& c) { c.end_step(s); });
  committed_ = false;
  StepRecord rec;
  rec.step = s.step;
  rec.epoch = s.epoch;
  rec.loss = s.loss_value;
  if (!loss_tensor.defined()) {  // a pipeline's loss, read already: host memory the budget does not count
    UntrackedGuard host;
    loss_tensor = torch::tensor(s.loss_value, torch::kDouble);
  }
  rec.loss_tensor = loss_tensor;
  rec.skipped = !s.stepped;
  if (s.found_inf.defined()) {
    // The kernel decided on the device: read it here, after the update is queued, unless nothing is read.
    if (s.read_loss) rec.skipped = s.found_inf.item<double>() != 0;
    rec.found_inf = s.found_inf;
  }
  rec.peak_bytes = meter.peak();
  for (const auto& m : timeline_->timeline()) rec.peak_bytes = std::max(rec.peak_bytes, m.peak_bytes);
  rec.current_bytes = memory_allocated(options_.device());
  rec.seconds = seconds_since(start_time);
  step_ = s.step;
  return rec;
}

} // namespace memfit
