#include "memfit/trainer.h"

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
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kCheckpointFile = "checkpoint.pt";

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The first line of an error's message (c10 appends context on later lines).
std::string first_line(const std::string& message) { return message.substr(0, message.find('\n')); }

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

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainerOptions& o,
                                                        std::vector<torch::Tensor> params) {
  if (o.optimizer_factory()) {
    auto optimizer = o.optimizer_factory()(std::move(params));
    TORCH_CHECK(optimizer != nullptr, "optimizer_factory returned nullptr: return the optimizer it builds, "
                "for example std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1))");
    return optimizer;
  }
  // memfit's optimizers: LibTorch's, with a step that completes or changes nothing (optim.h).
  switch (o.optimizer()) {
    case OptimizerKind::kSGD:
      return std::make_unique<optim::SGD>(
          std::move(params),
          torch::optim::SGDOptions(o.lr()).momentum(o.momentum()).weight_decay(o.weight_decay()),
          o.optimizer_kernel());
    case OptimizerKind::kAdam:
      return std::make_unique<optim::Adam>(
          std::move(params), torch::optim::AdamOptions(o.lr()).weight_decay(o.weight_decay()), o.optimizer_kernel());
    case OptimizerKind::kAdamW:
      return std::make_unique<optim::AdamW>(
          std::move(params), torch::optim::AdamWOptions(o.lr()).weight_decay(o.weight_decay()),
          o.optimizer_kernel());
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled optimizer kind");
}

MasterWeightsMode parse_master_weights_mode(const std::string& name) {
  if (name == "none") return MasterWeightsMode::kNone;
  if (name == "device") return MasterWeightsMode::kDevice;
  if (name == "host") return MasterWeightsMode::kHost;
  TORCH_CHECK(false, "unknown master weights mode '", name, "': expected none, device or host");
}

OnOutOfMemory parse_on_out_of_memory(const std::string& name) {
  if (name == "throw") return OnOutOfMemory::kThrow;
  if (name == "replan") return OnOutOfMemory::kReplan;
  TORCH_CHECK(false, "unknown out-of-memory action '", name, "': expected throw or replan");
}

std::optional<std::string> batch_statistics_layer(const torch::nn::Module& module) {
  for (const auto& item : module.named_modules()) {
    if (item.value()->name().find("BatchNorm") != std::string::npos) return item.key();
  }
  return std::nullopt;
}

namespace {
bool recomputes(const std::vector<Segment>& segments) {
  return std::any_of(segments.begin(), segments.end(), [](const Segment& s) { return s.checkpointed; });
}
} // namespace

OutOfMemoryPolicy more_micro_batches(const torch::nn::Module& module, bool batch_statistics_may_change) {
  const bool keep_micro_batch = !batch_statistics_may_change && batch_statistics_layer(module).has_value();
  const auto chains = find_chains(module);  // the chains' handles, shared with the module
  return [keep_micro_batch, chains](const OutOfMemoryEvent& e) -> std::optional<Replan> {
    const int64_t micro = e.micro_batch_size > 0 ? std::min(e.micro_batch_size, e.examples) : e.examples;
    Replan r;
    if (!keep_micro_batch && micro > 1) {
      r.micro_batch_size = (micro + 1) / 2;
      r.description = "micro-batches of " + std::to_string(r.micro_batch_size);
      return r;
    }
    // Then the chains that recompute nothing recompute sqrt(n) segments.
    std::vector<FoundChain> plain;
    for (const auto& c : chains) {
      if (c.chain->sequential()->size() > 1 && !recomputes(c.chain->schedule().segments)) plain.push_back(c);
    }
    if (plain.empty()) return std::nullopt;
    r.micro_batch_size = e.micro_batch_size;
    std::vector<std::string> what;
    std::vector<Schedule> schedules;
    for (const auto& c : plain) {
      const auto n = static_cast<int64_t>(c.chain->sequential()->size());
      schedules.push_back(avoid_in_place_starts(schedule_sqrt(n), c.chain->in_place()));
      what.push_back("'" + c.name + "' " + schedules.back().to_string());
    }
    r.apply = [plain, schedules]() mutable {
      for (size_t i = 0; i < plain.size(); ++i) plain[i].chain->set_schedule(schedules[i]);
    };
    r.description = (micro < e.examples ? "micro-batches of " + std::to_string(micro) + ", " : std::string()) +
                    "recomputing " + c10::Join(", ", what);
    return r;
  };
}

OptimizerKind parse_optimizer_kind(const std::string& name) {
  if (name == "sgd") return OptimizerKind::kSGD;
  if (name == "adam") return OptimizerKind::kAdam;
  if (name == "adamw") return OptimizerKind::kAdamW;
  TORCH_CHECK(false, "unknown optimizer '", name, "': expected sgd, adam or adamw");
}

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

} // namespace

Trainer::Trainer(torch::nn::Sequential model, TrainerOptions options)
    : Trainer(ErasedLoss{model.is_empty() ? nullptr : model.ptr(), model, std::any()}, std::move(options)) {}

void Trainer::check_options() const {
  TORCH_CHECK(options_.batch_size() > 0, "batch_size must be positive, got ",
              options_.batch_size());
  TORCH_CHECK(options_.steps() >= 0, "steps must be >= 0 (0: run `epochs` epochs), got ",
              options_.steps());
  TORCH_CHECK(options_.steps() > 0 || options_.epochs() > 0,
              "epochs must be positive when steps is 0, got ", options_.epochs());
  TORCH_CHECK(std::isfinite(options_.lr()) && options_.lr() > 0, "lr must be a positive finite number, got ",
              options_.lr());
  TORCH_CHECK(options_.max_grad_norm() >= 0 && std::isfinite(options_.max_grad_norm()),
              "max_grad_norm must be >= 0 (0: no clipping), got ", options_.max_grad_norm());
  TORCH_CHECK(options_.eval_batch_size() > 0, "eval_batch_size must be positive, got ",
              options_.eval_batch_size());
  TORCH_CHECK(options_.micro_batch_size() >= 0,
              "micro_batch_size must be >= 0 (0: the whole batch at once), got ",
              options_.micro_batch_size());
  TORCH_CHECK(options_.prefetch_factor() >= 0,
              "prefetch_factor must be >= 0 (0: each batch is read when its step starts), got ",
              options_.prefetch_factor());
  TORCH_CHECK(options_.save_every() >= 0, "save_every must be >= 0 (0: save at the end only), got ",
              options_.save_every());
  if (!options_.save_dir().empty()) {  // a run never fails at its end for its folder
    check_output_folder(options_.save_dir());
    if (std::filesystem::is_directory(options_.save_dir())) {
      check_output_file((std::filesystem::path(options_.save_dir()) / kCheckpointFile).string());
    }
  }
  TORCH_CHECK(options_.master_weights() == MasterWeightsMode::kNone ||
                  options_.precision() != Precision::kFP32,
              "master weights hold parameters in bf16 or fp16: set precision to bf16 or fp16, "
              "or master_weights to none");
  TORCH_CHECK(!(options_.master_weights() == MasterWeightsMode::kDevice &&
                options_.offload_optimizer() == Offload::kHost),
              "master_weights device keeps the fp32 masters and optimizer state on the device, "
              "offload_optimizer host moves them to the host: use master_weights host, or "
              "offload_optimizer none");
  TORCH_CHECK(options_.offload_gradients() == Offload::kNone || options_.offload_optimizer() == Offload::kHost,
              "offload_gradients host moves gradients to the host masters that offload_optimizer "
              "host keeps: set offload_optimizer to Offload::kHost too");
  if (options_.offload_parameters() == Offload::kHost) {
    TORCH_CHECK(options_.offload_optimizer() == Offload::kHost && options_.offload_gradients() == Offload::kHost,
                "offload_parameters host streams the parameters from the host masters that also take the "
                "gradients and the optimizer state: set offload_optimizer and offload_gradients to "
                "Offload::kHost too");
    TORCH_CHECK(options_.precision() == Precision::kFP32 && options_.master_weights() == MasterWeightsMode::kNone,
                "offload_parameters host runs in fp32 (got precision ", to_string(options_.precision()),
                "): set precision fp32 and master_weights none, or keep the parameters on the device");
    TORCH_CHECK(options_.process_group() == nullptr, "offload_parameters host runs in one process: data "
                "and pipeline parallelism are not supported with streamed parameters; drop the process "
                "group, or keep the parameters on the device (offload optimizer and gradients still apply)");
  }
  TORCH_CHECK(options_.nonfinite_loss() != NonfiniteLoss::kUnchecked || options_.process_group() == nullptr,
              "nonfinite_loss kUnchecked leaves each step's loss unread, but the ranks of a process group "
              "average it on the host: use NonfiniteLoss::kError or kSkip with a process group");
  TORCH_CHECK(options_.zero_stage() == 0 || options_.zero_stage() == 1, "zero_stage must be 0 (no "
              "sharding) or 1 (optimizer state sharded over the ranks), got ", options_.zero_stage(),
              "; stages 2 and 3 are not implemented");
  TORCH_CHECK(options_.zero_stage() == 0 || options_.process_group() != nullptr,
              "zero_stage 1 shards the optimizer state over the ranks of a process group: set "
              "process_group (memfit launch), or zero_stage 0");
  if (options_.parallel() == ParallelMode::kPipeline) {
    TORCH_CHECK(options_.process_group() != nullptr, "a pipeline splits the model over the ranks of a "
                "process group: set process_group (memfit launch), or parallel data");
    TORCH_CHECK(classifier_, "a pipeline splits the layers of a torch::nn::Sequential trained with "
                "cross-entropy: construct the Trainer from the Sequential without a loss, or use "
                "ParallelMode::kData");
    TORCH_CHECK(options_.precision() != Precision::kFP16, "pipeline parallel training does not support fp16 "
                "precision yet (its loss scaler would need the stages to agree on the steps to skip): use bf16, "
                "which needs no scaler, or fp32");
    TORCH_CHECK(options_.zero_stage() == 0, "zero_stage 1 shards the optimizer state over data-parallel "
                "ranks, but a pipeline's ranks hold different layers, each stage already keeping only its "
                "own optimizer state: set zero_stage 0 (offload_optimizer host moves that state to the host)");
    TORCH_CHECK(options_.micro_batch_size() == 0, "a pipeline cuts each batch into pipeline().chunks() "
                "chunks: set micro_batch_size 0 and the chunks instead (got micro_batch_size ",
                options_.micro_batch_size(), ")");
  }
  TORCH_CHECK(options_.max_replans() >= 0, "max_replans must be >= 0, got ", options_.max_replans());
  TORCH_CHECK(options_.restore_after() >= 0, "restore_after must be >= 0 (0: keep the re-planned settings), got ",
              options_.restore_after());
  if (options_.on_out_of_memory() == OnOutOfMemory::kReplan) {
    TORCH_CHECK(options_.parallel() != ParallelMode::kPipeline && options_.zero_stage() == 0,
                "on_out_of_memory kReplan re-plans data-parallel ranks together, but not a pipeline's stages or "
                "a sharded optimizer's step (which broadcasts as it steps): use parallel data with zero_stage 0, "
                "or OnOutOfMemory::kThrow");
    TORCH_CHECK(options_.replan() || !batch_statistics_layer(*module_).has_value() || !find_chains(*module_).empty(),
                "on_out_of_memory kReplan re-plans with more micro-batches, which changes the math of a module "
                "with batch statistics (BatchNorm '", batch_statistics_layer(*module_).value_or(""), "'), and the "
                "module has no chain (CheckpointedSequential) to recompute: allow micro-batches with replan("
                "memfit::more_micro_batches(module, true)), hold its repeated blocks in a CheckpointedSequential, "
                "or use OnOutOfMemory::kThrow");
  }
  check_precision_supported(options_.precision(), options_.device());
}

Trainer::Trainer(ErasedLoss loss, TrainerOptions options)
    : module_(std::move(loss.module)),
      classifier_(std::move(loss.classifier)),
      loss_(std::move(loss.loss)),
      options_(std::move(options)) {
  TORCH_CHECK(module_ != nullptr, "Trainer needs a model, got an empty module holder");
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
  if (classifier_) loss_ = classifier_loss(classifier_, stream_, options_.device());
  auto scaler_options = options_.grad_scaler();
  scaler_options.enabled(scaler_options.enabled() && options_.precision() == Precision::kFP16);
  scaler_ = std::make_unique<GradScaler>(scaler_options);
  make_optimizer_over(trainable_of(params, model_params));
  if (options_.process_group() != nullptr && !pipeline_) make_data_parallel(params, model_params);
  generator_ = at::make_generator<at::CPUGeneratorImpl>(options_.seed());
  remember_first_settings();
  build_components();
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
// micro-batch and the chains' first schedules; and its default policy.
void Trainer::remember_first_settings() {
  first_micro_batch_ = options_.micro_batch_size();
  restore_first_schedules_ = [chains = find_chains(*module_)]() mutable {
    std::vector<Schedule> first;
    for (const auto& c : chains) first.push_back(c.chain->schedule());
    return [chains, first]() mutable {
      for (size_t i = 0; i < chains.size(); ++i) chains[i].chain->set_schedule(first[i]);
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
  if (vote_) components_.push_back(std::make_shared<VoteBeforeCommit>(*vote_));
  if (pipeline_) {
    components_.push_back(std::make_shared<PipelineStep>(*pipeline_, options_.device(), options_.precision()));
  }
  components_.push_back(std::make_shared<PrecisionStep>(options_.device(), options_.precision(), *scaler_));
  if (!scaler_->is_enabled() || options_.nonfinite_loss() == NonfiniteLoss::kUnchecked) {
    components_.push_back(std::make_shared<NonfiniteCheck>(options_.nonfinite_loss(), world_size(),
                                                           pipeline_ ? "" : " (summed over the ranks)"));
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

ParallelMode parse_parallel_mode(const std::string& name) {
  if (name == "data") return ParallelMode::kData;
  if (name == "pipeline") return ParallelMode::kPipeline;
  TORCH_CHECK(false, "unknown parallel mode '", name, "': expected data or pipeline");
}

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
  }
  AbortGuard(const AbortGuard&) = delete;
  AbortGuard& operator=(const AbortGuard&) = delete;
  void done() { done_ = true; }

 private:
  const std::vector<std::shared_ptr<StepComponent>>& components_;
  StepState& state_;
  bool done_ = false;
};

} // namespace

// One step, retried under a new plan while it runs out of memory and the
// policy finds settings (OnOutOfMemory::kReplan). Every failed attempt has
// left the state as the step found it (the components' abort_step).
StepRecord Trainer::run_step(const detail::StepInput& in) {
  TORCH_CHECK(in.examples > 0, "train_step needs a batch with examples, got an empty one");
  if (replanned_ && options_.restore_after() > 0 && clean_steps_ >= options_.restore_after()) {
    options_.micro_batch_size(first_micro_batch_);  // the limit may have lifted: try the first plan again
    restore_first_schedules_();
    replanned_ = false;
    clean_steps_ = 0;
  }
  for (int64_t attempt = 1;; ++attempt) {
    const auto start = Clock::now();
    std::optional<PeakMeter> meter(std::in_place, options_.device());
    try {
      StepRecord rec = step_once(in);
      rec.replans = attempt - 1;
      ++clean_steps_;
      return rec;
    } catch (const c10::OutOfMemoryError& e) {
      const int64_t peak = meter->peak();
      meter.reset();
      if (!recover(e, in, attempt, peak, seconds_since(start))) throw;
    }
  }
}

std::string Trainer::settings_text() const {
  if (replanned_) return replanned_settings_;
  const int64_t micro = options_.micro_batch_size();
  return micro > 0 ? "micro-batches of " + std::to_string(micro) : "no micro-batching";
}

// After a failed attempt: true to run the step again under the policy's
// settings; false to let the error propagate (kThrow). Gives up with one
// line naming what was tried and the closest peak.
bool Trainer::recover(const c10::OutOfMemoryError& e, const detail::StepInput& in, int64_t attempt, int64_t peak,
                      double seconds) {
  if (options_.on_out_of_memory() != OnOutOfMemory::kReplan) return false;
  const auto replan_start = Clock::now();
  const std::string what = first_line(e.what_without_backtrace());
  const bool committing = std::exchange(committing_, false), committed = std::exchange(committed_, false);
  TORCH_CHECK_WITH(OutOfMemoryError, !committed, "step ", step_ + 1, " ran out of memory after its optimizer step "
                   "had changed the parameters (", what, "): a step is not run twice; raise the budget");
  TORCH_CHECK_WITH(OutOfMemoryError, !committing || optim::is_transactional(*optimizer_), "step ", step_ + 1,
                   " ran out of memory inside the optimizer's step, which may have changed some parameters "
                   "already (", what, "): recovery needs an optimizer whose step completes or changes nothing "
                   "(OptimizerKind, memfit::optim)");
  if (vote_) vote_->failed();  // the other ranks learn it at their next vote, and recover too
  empty_cache(options_.device());
  // The bytes no re-plan can move: what the Trainer holds between steps (the
  // parameters, their masters and the optimizer's state on the device) and
  // one gradient per parameter (none on the device when they go to the host).
  const int64_t budget = memory_budget(options_.device());
  int64_t fixed = memory_allocated(options_.device());
  if (!state_on_host() && state_optimizer() != nullptr) fixed += optim::lazy_state_bytes(*state_optimizer());
  if (options_.offload_gradients() != Offload::kHost) {
    for (const auto& p : module_->parameters()) fixed += p.requires_grad() ? int64_t(p.nbytes()) : 0;
  }
  const bool fits = budget <= 0 || fixed <= budget;
  if (vote_ && !fits) vote_->agree(false, 0);  // every rank stops
  TORCH_CHECK_WITH(OutOfMemoryError, fits, "step ", step_ + 1, " ran out of memory: ",
                   "the budget ", format_bytes(budget), " is smaller than the bytes no re-plan can move (",
                   format_bytes(fixed), ": parameters, their gradients and the optimizer's state): raise the budget, "
                   "or move the optimizer state and gradients to the host (TrainerOptions::offload_optimizer and "
                   "offload_gradients)");
  OutOfMemoryEvent event;
  event.step = step_ + 1;
  event.attempt = attempt;
  event.examples = in.examples;
  event.micro_batch_size = options_.micro_batch_size();
  event.peak_bytes = peak;
  event.limit_bytes = budget > 0 ? budget : peak;
  event.what = what;
  Recovery r;
  r.step = event.step;
  r.what = what;
  r.peak_bytes = peak;
  r.limit_bytes = event.limit_bytes;
  r.before = settings_text();
  std::optional<Replan> next;
  if (attempt <= options_.max_replans()) next = options_.replan()(event);
  // The ranks go on together, under the same plan, or stop together.
  const std::string ranks_stop = vote_ ? vote_->agree(next.has_value(), next ? next->micro_batch_size : 0) : "";
  TORCH_CHECK_WITH(OutOfMemoryError, ranks_stop.empty(), "step ", step_ + 1, " ran out of memory and ", ranks_stop,
                   ": every rank stops (", what, ")");
  if (next) {
    options_.micro_batch_size(next->micro_batch_size);
    if (next->apply) next->apply();
    replanned_ = false;
    r.after = next->description.empty() ? settings_text() : next->description;
    replanned_settings_ = r.after;
    replanned_ = true;
  }
  r.seconds = seconds + seconds_since(replan_start);
  recoveries_.push_back(r);
  clean_steps_ = 0;
  std::string tried;
  for (const auto& x : recoveries_) {
    if (x.step == r.step) tried += (tried.empty() ? "" : ", ") + x.before;
  }
  TORCH_CHECK_WITH(OutOfMemoryError, next.has_value(), "step ", r.step, " ran out of memory under ",
                   format_bytes(r.limit_bytes), " and could not be re-planned after ", attempt, " attempt",
                   attempt == 1 ? "" : "s", " (", tried, "); the last reached ", format_bytes(peak),
                   " before an allocation failed: raise the budget, or lower the batch size");
  if (vote_ && vote_->peer_failed()) {
    TORCH_WARN(what, ": re-planned from ", r.before, " to ", r.after, " and run again (",
               fmt::format("{:.3f}", r.seconds), " s lost)");
  } else {
    TORCH_WARN("step ", r.step, " ran out of memory at ", format_bytes(peak), " under ",
               format_bytes(r.limit_bytes), " with ", r.before, "; re-planned to ", r.after, " and run again (",
               fmt::format("{:.3f}", r.seconds), " s lost)");
  }
  return true;
}

// One attempt at the step: it completes, or it throws having called every
// component's abort_step, which leaves the state as the step found it.
StepRecord Trainer::step_once(const detail::StepInput& in) {
  committing_ = committed_ = false;
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
    if (s.skip) break;
    call_all(cs, [&](StepComponent& c) { c.before_backward(s); });
    torch::Tensor scaled = loss;
    for (const auto& c : cs) scaled = c->scale_loss(scaled);
    s.loss = torch::Tensor();
    loss = torch::Tensor();
    scaled.backward();
    scaled = torch::Tensor();
    s.phase = "backward " + k;
    call_all(cs, [&](StepComponent& c) { c.after_backward(s); });
  }
  torch::Tensor loss_tensor = taken ? torch::Tensor() : s.loss_sum;
  if (!taken) {
    // The step's one read of a device value, unless no component needs it.
    s.loss_value = s.read_loss ? s.loss_sum.item<double>() : std::numeric_limits<double>::quiet_NaN();
  }
  s.loss_sum = torch::Tensor();
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
    committed_ = true;  // from here a failure is not undone: the parameters have their update
    call_all(cs, [&](StepComponent& c) { c.after_optimizer_step(s); });
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
  rec.peak_bytes = meter.peak();
  for (const auto& m : timeline_->timeline()) rec.peak_bytes = std::max(rec.peak_bytes, m.peak_bytes);
  rec.current_bytes = memory_allocated(options_.device());
  rec.seconds = seconds_since(start_time);
  step_ = s.step;
  return rec;
}

TrainReport Trainer::fit(const ImageDataset& data, const StepCallback& on_step) {
  TORCH_CHECK(loss_.type() == typeid(std::function<torch::Tensor(const torch::data::Example<>&)>),
              "Trainer::fit cuts torch::data::Example<> batches from an ImageDataset, but the Trainer's loss takes ",
              c10::demangle(loss_.type().name()), ": call train_step in a loop of your own");
  const auto* loss = loss_for<torch::data::Example<>>();
  return run_fit(
      data.size(),
      [&data](const std::vector<size_t>& indices, bool pin) -> std::shared_ptr<void> {
        UntrackedGuard host;  // the batch lives on the host until staged
        const auto idx = torch::tensor(std::vector<int64_t>(indices.begin(), indices.end()));
        torch::data::Example<> batch(data.images.index_select(0, idx), data.labels.index_select(0, idx));
        return std::make_shared<torch::data::Example<>>(pin ? pinned(batch) : std::move(batch));
      },
      [this, loss](const std::shared_ptr<void>& batch) {
        return input_of(*static_cast<const torch::data::Example<>*>(batch.get()), loss);
      },
      on_step);
}

namespace {
// Draws a new epoch's order from `generator` when `order` is used up (or
// none is drawn yet); true when it did.
bool next_epoch(torch::Tensor& order, int64_t& cursor, int64_t n, at::Generator& generator) {
  if (order.defined() && cursor < n) return false;
  UntrackedGuard host;  // the sampler's indices live on the host
  order = torch::randperm(n, generator, torch::kInt64);
  cursor = 0;
  return true;
}
} // namespace

std::vector<size_t> Trainer::share_of(const torch::Tensor& order, int64_t cursor, int64_t& global) const {
  UntrackedGuard host;
  // The step's examples: `global` from the permutation (the last batch of an
  // epoch holds what is left, like drop_last=false); with data parallelism
  // this rank takes every world-th of them.
  const int64_t n = order.size(0);
  const int64_t world = data_ranks();
  global = std::min(options_.batch_size() * world, n - cursor);
  auto mine = order.narrow(0, cursor, global);
  if (world > 1) mine = mine.slice(0, rank(), global, world);
  mine = mine.contiguous();
  const int64_t* p = mine.data_ptr<int64_t>();
  return std::vector<size_t>(p, p + mine.numel());
}

namespace {

// What every rank must share, as (setting, value) lines: the model's tensors
// first, then the options.
std::string rank_settings(const torch::nn::Module& model, const TrainerOptions& o) {
  std::vector<std::pair<std::string, std::string>> s;
  const auto describe = [](const torch::Tensor& t) {
    std::ostringstream os;
    os << t.sizes() << " " << t.scalar_type();
    return os.str();
  };
  const auto params = model.named_parameters(/*recurse=*/true);
  const auto buffers = model.named_buffers(/*recurse=*/true);
  s.emplace_back("model's number of tensors", fmt::format("{} parameters and {} buffers", params.size(), buffers.size()));
  int64_t i = 0;
  for (const auto& p : params) {
    s.emplace_back(fmt::format("model tensor {}", i++),
                   fmt::format("'{}' {}{}", p.key(), describe(p.value()), p.value().requires_grad() ? "" : " frozen"));
  }
  for (const auto& b : buffers) s.emplace_back(fmt::format("model tensor {}", i++), fmt::format("'{}' {}", b.key(), describe(b.value())));
  const auto name = [](auto value, std::initializer_list<const char*> names) {
    const auto k = static_cast<size_t>(value);
    return k < names.size() ? std::string(names.begin()[k]) : std::to_string(k);
  };
  const char* const offload_names[] = {"kNone", "kHost"};
  const auto offload = [&](Offload v) { return static_cast<size_t>(v) < 2 ? offload_names[static_cast<size_t>(v)] : "?"; };
  s.emplace_back("TrainerOptions::batch_size", std::to_string(o.batch_size()));
  s.emplace_back("TrainerOptions::steps", std::to_string(o.steps()));
  s.emplace_back("TrainerOptions::epochs", std::to_string(o.epochs()));
  s.emplace_back("TrainerOptions::optimizer", o.optimizer_factory() ? "optimizer_factory" : name(o.optimizer(), {"kSGD", "kAdam", "kAdamW"}));
  s.emplace_back("TrainerOptions::lr", fmt::format("{}", o.lr()));
  s.emplace_back("TrainerOptions::momentum", fmt::format("{}", o.momentum()));
  s.emplace_back("TrainerOptions::weight_decay", fmt::format("{}", o.weight_decay()));
  s.emplace_back("TrainerOptions::seed", std::to_string(o.seed()));
  s.emplace_back("TrainerOptions::device", o.device().is_cuda() ? "a CUDA device" : o.device().str());
  s.emplace_back("TrainerOptions::precision", to_string(o.precision()));
  s.emplace_back("TrainerOptions::master_weights", name(o.master_weights(), {"kNone", "kHost", "kDevice"}));
  s.emplace_back("TrainerOptions::max_grad_norm", fmt::format("{}", o.max_grad_norm()));
  s.emplace_back("TrainerOptions::nonfinite_loss", name(o.nonfinite_loss(), {"kError", "kSkip", "kUnchecked"}));
  s.emplace_back("TrainerOptions::micro_batch_size", std::to_string(o.micro_batch_size()));
  s.emplace_back("TrainerOptions::freeze", c10::Join(", ", o.freeze()));
  s.emplace_back("TrainerOptions::offload_optimizer", offload(o.offload_optimizer()));
  s.emplace_back("TrainerOptions::offload_gradients", offload(o.offload_gradients()));
  s.emplace_back("TrainerOptions::offload_parameters", offload(o.offload_parameters()));
  s.emplace_back("TrainerOptions::zero_stage", std::to_string(o.zero_stage()));
  s.emplace_back("TrainerOptions::parallel", name(o.parallel(), {"kData", "kPipeline"}));
  s.emplace_back("TrainerOptions::on_out_of_memory", name(o.on_out_of_memory(), {"kThrow", "kReplan"}));
  s.emplace_back("TrainerOptions::max_replans", std::to_string(o.max_replans()));
  s.emplace_back("TrainerOptions::bucket_cap_mb", fmt::format("{}", o.bucket_cap_mb()));
  std::string text;
  for (const auto& [key, value] : s) text += key + "\t" + value + "\n";
  return text;
}

std::vector<std::pair<std::string, std::string>> setting_lines(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);) {
    const auto tab = line.find('\t');
    out.emplace_back(line.substr(0, tab), tab == std::string::npos ? "" : line.substr(tab + 1));
  }
  return out;
}

} // namespace

void check_ranks_agree(const torch::nn::Module& model, const TrainerOptions& options) {
  const auto& group = options.process_group();
  if (group == nullptr || group->size() < 2) return;
  const std::string mine = rank_settings(model, options);
  const std::string first = detail::broadcast_text(*group, mine, 0);
  // The lowest rank that differs from rank 0 speaks for all.
  int64_t lowest = 0;
  {
    UntrackedGuard host;
    auto flag = torch::tensor({mine == first ? int64_t{0} : group->size() - group->rank()}, torch::kLong);
    group->all_reduce_max_(flag);
    lowest = flag.item<int64_t>() == 0 ? -1 : group->size() - flag.item<int64_t>();
  }
  if (lowest < 0) return;
  const auto theirs = setting_lines(detail::broadcast_text(*group, mine, lowest));
  const auto ours = setting_lines(first);
  for (size_t i = 0; i < std::max(ours.size(), theirs.size()); ++i) {
    const auto& a = i < ours.size() ? ours[i] : std::pair<std::string, std::string>{"", "nothing"};
    const auto& b = i < theirs.size() ? theirs[i] : std::pair<std::string, std::string>{"", "nothing"};
    if (a == b) continue;
    const std::string what = a.first == b.first ? a.first : a.first.empty() ? b.first : a.first;
    TORCH_CHECK(false, "the ranks disagree before the first step: rank ", lowest, "'s ", what, " is ",
                a.first == b.first ? b.second : b.first + " " + b.second, ", rank 0's is ",
                a.first == b.first ? a.second : a.first + " " + a.second,
                ": start every rank with the same model and options");
  }
  TORCH_INTERNAL_ASSERT(false, "ranks 0 and ", lowest, " differ, in no setting");
}

// A run's saves replace only its own checkpoint: the one it resumed from or wrote.
void Trainer::check_save_dir_is_ours() const {
  if (options_.save_dir().empty() || rank() != 0) return;
  const auto file = std::filesystem::path(options_.save_dir()) / kCheckpointFile;
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) return;
  TORCH_CHECK(!continues_.empty() && std::filesystem::equivalent(file, continues_, ec), "TrainerOptions::save_dir ",
              options_.save_dir(), " holds another run's ", kCheckpointFile, ", which this run's saves would replace: "
              "continue that run with Trainer::resume(\"", options_.save_dir(), "\"), or save to another folder");
}

TrainReport Trainer::run_fit(int64_t n, const BatchReader& read, const BatchView& view, const StepCallback& on_step) {
  TORCH_CHECK(n > 0, "Trainer::fit needs a non-empty data set");
  TORCH_CHECK(options_.nonfinite_loss() != NonfiniteLoss::kUnchecked,
              "Trainer::fit reports every step's loss, but nonfinite_loss kUnchecked leaves it unread: use "
              "NonfiniteLoss::kError or kSkip, or call train_step in a loop of your own");
  check_save_dir_is_ours();
  const int64_t total = total_steps_of(n);
  if (step_ >= total) {  // a finished run: start a new one (the generator goes on)
    step_ = 0;
    epoch_ = -1;
    order_ = torch::Tensor();
    cursor_ = 0;
  }
  TORCH_CHECK(!order_.defined() || order_.size(0) == n, "the run's data position is for ",
              order_.defined() ? order_.size(0) : 0, " examples, but the data set has ", n,
              ": resume with the data the run was saved with");
  TrainReport report;
  const size_t recoveries_before = recoveries_.size();
  report.steps.reserve(static_cast<size_t>(std::min<int64_t>(total - step_, 4096)));  // grows with the steps taken
  PeakMeter run_meter(options_.device());
  module_->train();
  const auto run_start = Clock::now();
  int64_t samples = 0;
  double save_seconds = 0;
  int64_t last_saved = -1;
  // Reading ahead: the sampler's walk is repeated from the run's position
  // with a copy of its generator, so the position itself moves only with
  // the steps taken.
  const bool pin = options_.device().is_cuda();
  std::unique_ptr<detail::ReadAhead> ahead;
  torch::Tensor ahead_order = order_;
  int64_t ahead_cursor = cursor_;
  int64_t ahead_step = step_;
  at::Generator ahead_generator;
  if (options_.prefetch_factor() > 0) {
    ahead = std::make_unique<detail::ReadAhead>(static_cast<size_t>(options_.prefetch_factor()));
    ahead_generator = generator_.clone();
  }
  auto read_ahead = [&] {
    while (ahead && ahead_step < total && ahead->has_room()) {
      next_epoch(ahead_order, ahead_cursor, n, ahead_generator);
      int64_t global = 0;
      auto indices = share_of(ahead_order, ahead_cursor, global);
      ahead_cursor += global;
      ++ahead_step;
      ahead->push(indices, [&read, indices, pin] { return read(indices, pin); });
    }
  };
  while (step_ < total) {
    // The run's position before the step: a step that throws leaves it so.
    const torch::Tensor order_before = order_;
    const int64_t cursor_before = cursor_, epoch_before = epoch_;
    const at::Generator generator_before = !order_.defined() || cursor_ >= n ? generator_.clone() : at::Generator();
    if (next_epoch(order_, cursor_, n, generator_)) ++epoch_;
    int64_t global = 0;
    const auto indices = share_of(order_, cursor_, global);
    read_ahead();
    const std::shared_ptr<void> batch = ahead ? ahead->pop(indices) : read(indices, false);
    read_ahead();  // the next batches are read while this step runs
    detail::StepInput in = view(batch);
    in.global_examples = global;
    StepRecord rec;
    try {
      rec = run_step(in);
    } catch (const std::exception& e) {
      order_ = order_before;
      cursor_ = cursor_before;
      epoch_ = epoch_before;
      if (generator_before.defined()) generator_ = generator_before;
      // The step left the state as it found it: a run that gives up keeps it.
      if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr && !options_.save_dir().empty() &&
          options_.on_out_of_memory() == OnOutOfMemory::kReplan) {
        save(options_.save_dir());
      }
      throw;
    }
    for (size_t i = report.recoveries.size() + recoveries_before; i < recoveries_.size(); ++i) {
      report.recoveries.push_back(recoveries_[i]);
    }
    report.skipped_steps += rec.skipped ? 1 : 0;
    if (!timeline_->skipped() && rec.peak_bytes > report.step_memory.peak) {
      report.step_memory = breakdown(rec.peak_bytes, timeline_->model_grad_bytes());
      report.step_timeline = timeline_->timeline();
      for (auto& m : report.step_timeline) m.parameters = report.step_memory.parameters;
    }
    // The step is done: the position moves on.
    cursor_ += global;
    samples += global;
    report.steps.push_back(rec);
    if (!options_.save_dir().empty() && options_.save_every() > 0 &&
        step_ % options_.save_every() == 0) {
      const auto save_start = Clock::now();
      save(options_.save_dir());
      save_seconds += seconds_since(save_start);
      last_saved = step_;
    }
    if (on_step) on_step(rec);
    if (stop_->exchange(false)) {  // request_stop: end here, as at the last step
      report.stopped = true;
      break;
    }
  }
  stop_->store(false);
  if (!options_.save_dir().empty() && last_saved != step_) {
    const auto save_start = Clock::now();
    save(options_.save_dir());
    save_seconds += seconds_since(save_start);
  }
  report.seconds = seconds_since(run_start) - save_seconds;
  report.samples_per_second = report.seconds > 0 ? double(samples) / report.seconds : 0.0;
  report.final_loss = report.steps.empty() ? 0.0 : report.steps.back().loss;
  // On CUDA each step's meter resets the device's one peak statistic, so the
  // run's peak is also taken as the largest step peak.
  report.peak_bytes = run_meter.peak();
  for (const auto& r : report.steps) report.peak_bytes = std::max(report.peak_bytes, r.peak_bytes);
  report.precision = to_string(options_.precision());
  if (state_optimizer() != nullptr) report.optimizer_kernel = optim::kernel_ran(*state_optimizer());
  report.final_scale = scaler_->is_enabled() ? scaler_->get_scale() : 0.0;
  return report;
}

EvalResult Trainer::evaluate(const ImageDataset& data) {
  TORCH_CHECK(data.size() > 0, "Trainer::evaluate needs a non-empty data set");
  TORCH_CHECK(classifier_, "Trainer::evaluate measures the cross-entropy classifier that a Trainer built from "
              "a torch::nn::Sequential without a loss trains: for your own module and loss, call eval_step "
              "with your metric");
  const auto device = options_.device();
  torch::NoGradGuard no_grad;
  PeakMeter meter(device);
  module_->eval();
  const int64_t n = data.size();
  double loss_sum = 0;
  int64_t correct = 0;
  for (int64_t start = 0; start < n; start += options_.eval_batch_size()) {
    const int64_t len = std::min(options_.eval_batch_size(), n - start);
    auto x = data.images.narrow(0, start, len).to(device);
    auto y = data.labels.narrow(0, start, len).to(device);
    torch::Tensor logits;
    {
      AutocastGuard autocast(device, options_.precision());
      logits = pipeline_ ? pipeline_->forward(x) : stream_ ? stream_->forward(x) : classifier_->forward(x);
    }
    if (!logits.defined()) continue;  // a pipeline's output is on its last stage
    loss_sum += detail::cross_entropy(logits, y, /*sum=*/true).item<double>();
    correct += logits.argmax(-1).eq(y).sum().item<int64_t>();
  }
  module_->train();
  if (pipeline_) {  // the last stage's sums, everywhere
    UntrackedGuard host;
    auto sums = torch::tensor({loss_sum, double(correct)}, torch::kDouble);
    options_.process_group()->broadcast_(sums, world_size() - 1);
    loss_sum = sums[0].item<double>();
    correct = static_cast<int64_t>(sums[1].item<double>());
  }
  EvalResult r;
  const double labels = double(data.labels.numel());  // a label per example, or per token
  r.loss = loss_sum / labels;
  r.accuracy = double(correct) / labels;
  r.peak_bytes = meter.peak();
  return r;
}

namespace {

constexpr const char* kCheckpointFormat = "memfit.trainer.v1";

std::string checkpoint_path(const std::string& path) {
  return std::filesystem::is_directory(path) ? (std::filesystem::path(path) / kCheckpointFile).string()
                                             : path;
}

std::vector<c10::DeviceIndex> cuda_devices(const torch::Device& device) {
  if (!device.is_cuda()) return {};
  return {device.has_index() ? device.index() : c10::DeviceIndex(0)};
}

} // namespace

void Trainer::save(const std::string& dir) {
  // This rank's part: the model and each component's state (collectives
  // among them). A pipeline's stages each have one, gathered on rank 0.
  torch::serialize::OutputArchive a, stage;
  torch::serialize::OutputArchive& part = pipeline_ ? stage : a;
  write_part(part);
  std::vector<torch::Tensor> stages;
  if (pipeline_) stages = options_.process_group()->gather(detail::bytes_tensor(detail::archive_bytes(stage)));
  // Each rank's random generators (their dropout masks differ when their
  // shares of a batch do), gathered on rank 0.
  compat::RngState rng;
  std::vector<torch::Tensor> rank_cpu_rng, rank_cuda_rng;
  {
    UntrackedGuard host;  // generator states are host tensors
    rng = compat::get_rng_state(cuda_devices(options_.device()));
    if (world_size() > 1) {
      rank_cpu_rng = options_.process_group()->gather(rng.cpu.reshape({-1}));
      if (!rng.cuda.empty()) rank_cuda_rng = options_.process_group()->gather(rng.cuda.front().second.reshape({-1}));
    }
  }
  if (rank() != 0) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TORCH_CHECK(!ec && std::filesystem::is_directory(dir), "cannot create the checkpoint folder ",
              dir, ": ", ec.message());
  a.write("format", c10::IValue(std::string(kCheckpointFormat)));
  if (pipeline_) {
    torch::serialize::OutputArchive parts;
    parts.write("world", c10::IValue(world_size()));
    for (size_t r = 0; r < stages.size(); ++r) parts.write("rank" + std::to_string(r), stages[r]);
    a.write("stages", parts);
  }
  {
    UntrackedGuard host;  // generator states are host tensors
    a.write("rng_cpu", rng.cpu);
    for (const auto& [index, state] : rng.cuda) a.write("rng_cuda", state);
    if (!rank_cpu_rng.empty()) {
      torch::serialize::OutputArchive ranks;
      ranks.write("world", c10::IValue(world_size()));
      for (size_t r = 0; r < rank_cpu_rng.size(); ++r) ranks.write("cpu" + std::to_string(r), rank_cpu_rng[r]);
      for (size_t r = 0; r < rank_cuda_rng.size(); ++r) ranks.write("cuda" + std::to_string(r), rank_cuda_rng[r]);
      a.write("rank_rng", ranks);
    }
    auto gen = generator_;
    std::lock_guard<std::mutex> lock(gen.mutex());
    a.write("sampler_rng", gen.get_state());
  }
  // The options a resume must share (checked by check_saved_options).
  a.write("optimizer_type", c10::IValue(optimizer_type()));
  a.write("precision", c10::IValue(to_string(options_.precision())));
  a.write("batch_size", c10::IValue(options_.batch_size()));
  a.write("step", c10::IValue(step_));
  a.write("epoch", c10::IValue(epoch_));
  a.write("cursor", c10::IValue(cursor_));
  if (order_.defined()) a.write("order", order_);
  const auto file = (std::filesystem::path(dir) / kCheckpointFile).string();
  write_file_atomically(file, detail::archive_bytes(a));
  continues_ = file;
}

void Trainer::write_part(torch::serialize::OutputArchive& part) {
  torch::serialize::OutputArchive model;
  detail::write_module(model, *module_, [this](const torch::Tensor& p) { return stand_in(p); });
  part.write("model", model);
  for (const auto& c : components_) c->save_state(part);
}

torch::Tensor Trainer::stand_in(const torch::Tensor& param) const {
  if (!stream_) return torch::Tensor();
  const int64_t i = master_->index_of(param);  // streamed: the host master holds its values
  return i >= 0 ? master_->master_parameters()[static_cast<size_t>(i)] : torch::Tensor();
}

std::string Trainer::optimizer_type() const {
  const auto* o = zero_ != nullptr ? zero_->local_optimizer() : optimizer_.get();
  return o != nullptr ? optim::state_type_name(*o) : std::string("none");
}

// A checkpoint resumes only into the optimizer, precision and batch size
// that saved it (checkpoints written before these were saved are not checked).
void Trainer::check_saved_options(torch::serialize::InputArchive& a, const std::string& path) const {
  const auto check = [&](const char* key, const char* option, const std::string& now) {
    c10::IValue v;
    if (!a.try_read(key, v)) return;
    const std::string saved = v.isString() ? v.toStringRef() : v.isInt() ? std::to_string(v.toInt()) : "?";
    TORCH_CHECK(saved == now, path, " was saved with ", option, " ", saved, ", but this run's is ", now,
                ": resume with ", saved, ", or start a new run from the model alone (load_module)");
  };
  check("optimizer_type", "the optimizer", optimizer_type());
  check("precision", "TrainerOptions::precision", to_string(options_.precision()));
  check("batch_size", "TrainerOptions::batch_size", std::to_string(options_.batch_size()));
}

void Trainer::resume(const std::string& path_or_dir) {
  const std::string path = checkpoint_path(path_or_dir);
  auto a = detail::read_archive(path);
  c10::IValue format;
  TORCH_CHECK(a.try_read("format", format) && format.isString() &&
                  format.toStringRef() == kCheckpointFormat,
              path, " is not a memfit Trainer checkpoint (", kCheckpointFormat,
              "): write one with Trainer::save or memfit train --save DIR");
  check_saved_options(a, path);
  // Check everything before changing anything. A pipeline's checkpoint holds
  // each stage's model, masters and optimizer in a part of its own.
  torch::serialize::InputArchive parts, stage;
  const bool has_stages = a.try_read("stages", parts);
  torch::serialize::InputArchive* src = &a;
  if (pipeline_) {
    TORCH_CHECK(has_stages, path, " holds a whole model, but this run is a pipeline: resume with the "
                "parallel mode that saved it");
    const int64_t saved_world = detail::read_int(parts, "world", path);
    TORCH_CHECK(saved_world == world_size(), path, " holds a pipeline of ", saved_world,
                " stages, but this job has ", world_size(), " ranks: resume with the world size that saved it");
    detail::load_archive(stage, detail::read_tensor(parts, "rank" + std::to_string(rank()), path),
                 path + "'s stage " + std::to_string(rank()));
    src = &stage;
  } else {
    TORCH_CHECK(!has_stages, path, " holds a pipeline's stages: resume with parallel pipeline "
                "(--parallel pipeline) and the world size that saved it");
  }
  torch::serialize::InputArchive model;
  TORCH_CHECK(src->try_read("model", model), path, " is damaged: 'model' is missing");
  const auto stand_in = [this](const torch::Tensor& p) { return this->stand_in(p); };
  detail::check_module(model, *module_, path, stand_in);
  std::vector<std::function<void()>> puts;  // each component's part, checked
  for (const auto& c : components_) {
    if (auto put = c->load_state(*src, path)) puts.push_back(std::move(put));
  }
  torch::Tensor rng_cpu = detail::read_tensor(a, "rng_cpu", path);
  torch::Tensor rng_cuda;
  a.try_read("rng_cuda", rng_cuda);
  // A job of the same size: each rank continues its own generators (else
  // every rank takes rank 0's).
  torch::serialize::InputArchive ranks;
  if (a.try_read("rank_rng", ranks) && detail::read_int(ranks, "world", path) == world_size() && world_size() > 1) {
    const std::string r = std::to_string(rank());
    rng_cpu = detail::read_tensor(ranks, "cpu" + r, path);
    torch::Tensor cuda;
    if (ranks.try_read("cuda" + r, cuda)) rng_cuda = cuda;
  }
  const torch::Tensor sampler_rng = detail::read_tensor(a, "sampler_rng", path);
  const int64_t step = detail::read_int(a, "step", path);
  const int64_t epoch = detail::read_int(a, "epoch", path);
  const int64_t cursor = detail::read_int(a, "cursor", path);
  torch::Tensor order;
  a.try_read("order", order);

  // Apply: tensor by tensor into the model's storage.
  detail::copy_into_module(model, *module_, stand_in);
  for (const auto& put : puts) put();
  compat::RngState rng;
  rng.cpu = rng_cpu;
  if (rng_cuda.defined() && options_.device().is_cuda()) {
    rng.cuda.emplace_back(cuda_devices(options_.device()).front(), rng_cuda);
  }
  compat::set_rng_state(rng);
  {
    std::lock_guard<std::mutex> lock(generator_.mutex());
    generator_.set_state(sampler_rng);
  }
  step_ = step;
  epoch_ = epoch;
  cursor_ = cursor;
  order_ = order;
  continues_ = path;
}

void load_trainer_model(torch::nn::Module& module, const std::string& path_or_dir) {
  const std::string path = checkpoint_path(path_or_dir);
  auto a = detail::read_archive(path);
  c10::IValue format;
  TORCH_CHECK(a.try_read("format", format) && format.isString() && format.toStringRef() == kCheckpointFormat,
              path, " is not a memfit Trainer checkpoint (", kCheckpointFormat,
              "): write one with Trainer::save or memfit train --save DIR");
  torch::serialize::InputArchive parts, model;
  TORCH_CHECK(!a.try_read("stages", parts), path, " holds a pipeline's stages, one per rank: load it into a "
              "pipeline (Trainer::resume with parallel pipeline)");
  TORCH_CHECK(a.try_read("model", model), path, " is damaged: 'model' is missing");
  detail::check_module(model, module, path);
  detail::copy_into_module(model, module);
}

std::string TrainReport::to_json() const {
  nlohmann::json j;
  j["steps"] = nlohmann::json::array();
  for (const auto& s : steps) {
    j["steps"].push_back({{"step", s.step},
                          {"epoch", s.epoch},
                          {"loss", s.loss},
                          {"seconds", s.seconds},
                          {"peak_bytes", s.peak_bytes},
                          {"current_bytes", s.current_bytes},
                          {"skipped", s.skipped},
                          {"replans", s.replans}});
  }
  j["recoveries"] = nlohmann::json::array();
  for (const auto& r : recoveries) {
    j["recoveries"].push_back({{"step", r.step},
                               {"what", r.what},
                               {"peak_bytes", r.peak_bytes},
                               {"limit_bytes", r.limit_bytes},
                               {"before", r.before},
                               {"after", r.after},
                               {"seconds", r.seconds}});
  }
  j["step_timeline"] = nlohmann::json::array();
  for (const auto& m : step_timeline) {
    const int64_t persistent = m.parameters;
    j["step_timeline"].push_back(
        {{"phase", m.phase},
         {"peak_bytes", m.peak_bytes},
         {"current_bytes", m.current_bytes},
         {"parameters", persistent},
         {"gradients", m.gradients},
         {"optimizer_state", m.optimizer_state},
         {"activations",
          std::max<int64_t>(0, m.peak_bytes - persistent - m.gradients - m.optimizer_state)}});
  }
  nlohmann::json summary = {{"steps", steps.size()},
                            {"final_loss", final_loss},
                            {"seconds", seconds},
                            {"samples_per_second", samples_per_second},
                            {"peak_bytes", peak_bytes},
                            {"precision", precision},
                            {"optimizer_kernel", optimizer_kernel},
                            {"skipped_steps", skipped_steps},
                            {"recoveries", recoveries.size()},
                            {"stopped", stopped},
                            {"final_scale", final_scale},
                            {"step_memory", nlohmann::json::parse(step_memory.to_json())}};
  if (evaluated) {
    summary["test_accuracy"] = test.accuracy;
    summary["test_loss"] = test.loss;
    summary["eval_peak_bytes"] = test.peak_bytes;
  }
  j["summary"] = summary;
  return j.dump(2);
}

} // namespace memfit
