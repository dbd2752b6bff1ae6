#include "memfit/trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <optional>
#include <cmath>

namespace memfit {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainerOptions& o,
                                                        std::vector<torch::Tensor> params) {
  switch (o.optimizer()) {
    case OptimizerKind::kSGD:
      return std::make_unique<torch::optim::SGD>(
          std::move(params),
          torch::optim::SGDOptions(o.lr()).momentum(o.momentum()).weight_decay(o.weight_decay()));
    case OptimizerKind::kAdam:
      return std::make_unique<torch::optim::Adam>(
          std::move(params), torch::optim::AdamOptions(o.lr()).weight_decay(o.weight_decay()));
    case OptimizerKind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          std::move(params), torch::optim::AdamWOptions(o.lr()).weight_decay(o.weight_decay()));
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled optimizer kind");
}

void release_gradients(const std::vector<torch::Tensor>& params) {
  for (const auto& p : params) {
    if (p.grad().defined()) const_cast<torch::Tensor&>(p).mutable_grad() = torch::Tensor();
  }
}

} // namespace

MasterWeightsMode parse_master_weights_mode(const std::string& name) {
  if (name == "none") return MasterWeightsMode::kNone;
  if (name == "device") return MasterWeightsMode::kDevice;
  if (name == "host") return MasterWeightsMode::kHost;
  TORCH_CHECK(false, "unknown master weights mode '", name, "': expected none, device or host");
}

OptimizerKind parse_optimizer_kind(const std::string& name) {
  if (name == "sgd") return OptimizerKind::kSGD;
  if (name == "adam") return OptimizerKind::kAdam;
  if (name == "adamw") return OptimizerKind::kAdamW;
  TORCH_CHECK(false, "unknown optimizer '", name, "': expected sgd, adam or adamw");
}

Trainer::Trainer(torch::nn::Sequential model, TrainerOptions options)
    : model_(std::move(model)), options_(std::move(options)) {
  TORCH_CHECK(!model_.is_empty(), "Trainer needs a model, got an empty Sequential holder");
  TORCH_CHECK(options_.batch_size() > 0, "batch_size must be positive, got ",
              options_.batch_size());
  TORCH_CHECK(options_.steps() >= 0, "steps must be >= 0 (0: run `epochs` epochs), got ",
              options_.steps());
  TORCH_CHECK(options_.steps() > 0 || options_.epochs() > 0,
              "epochs must be positive when steps is 0, got ", options_.epochs());
  TORCH_CHECK(options_.lr() > 0, "lr must be positive, got ", options_.lr());
  TORCH_CHECK(options_.max_grad_norm() >= 0 && std::isfinite(options_.max_grad_norm()),
              "max_grad_norm must be >= 0 (0: no clipping), got ", options_.max_grad_norm());
  TORCH_CHECK(options_.eval_batch_size() > 0, "eval_batch_size must be positive, got ",
              options_.eval_batch_size());
  TORCH_CHECK(options_.master_weights() == MasterWeightsMode::kNone ||
                  options_.precision() != Precision::kFP32,
              "master weights hold parameters in bf16 or fp16: set precision to bf16 or fp16, "
              "or master_weights to none");
  check_precision_supported(options_.precision(), options_.device());
  memory_allocated(options_.device());  // starts tracking (and checks the device)
  model_->to(options_.device());
  std::vector<torch::Tensor> params = model_->parameters();
  if (options_.master_weights() != MasterWeightsMode::kNone) {
    master_ = std::make_unique<MasterWeights>(
        *model_, MasterWeightsOptions()
                    .dtype(scalar_type(options_.precision()))
                    .offload(options_.master_weights() == MasterWeightsMode::kHost ? Offload::kHost
                                                                                  : Offload::kNone));
    params = master_->master_parameters();
  }
  auto scaler_options = options_.grad_scaler();
  scaler_options.enabled(scaler_options.enabled() && options_.precision() == Precision::kFP16);
  scaler_ = std::make_unique<GradScaler>(scaler_options);
  std::optional<UntrackedGuard> host;  // optimizer state lives with the masters
  if (options_.master_weights() == MasterWeightsMode::kHost) host.emplace();
  optimizer_ = make_optimizer(options_, params);
}

StepMemory Trainer::breakdown(int64_t peak, int64_t model_grad_bytes) const {
  StepMemory m;
  m.peak = peak;
  std::vector<torch::Tensor> persistent = model_->parameters();
  const auto buffers = model_->buffers();
  persistent.insert(persistent.end(), buffers.begin(), buffers.end());
  m.gradients = model_grad_bytes;
  const bool state_on_device = options_.master_weights() != MasterWeightsMode::kHost;
  if (master_ && state_on_device) {
    // One count: parameters kept in fp32 are their own masters.
    const auto& masters = master_->master_parameters();
    persistent.insert(persistent.end(), masters.begin(), masters.end());
    std::vector<torch::Tensor> grads;
    for (const auto& p : master_->master_parameters()) grads.push_back(p.grad());
    m.gradients = std::max(m.gradients, storage_bytes(grads));
  }
  m.parameters = storage_bytes(persistent);
  m.optimizer_state = state_on_device ? optimizer_state_bytes(*optimizer_) : 0;
  m.activations = std::max<int64_t>(0, peak - m.parameters - m.gradients - m.optimizer_state);
  return m;
}

Trainer::~Trainer() = default;
Trainer::Trainer(Trainer&&) noexcept = default;
Trainer& Trainer::operator=(Trainer&&) noexcept = default;

int64_t Trainer::total_steps(const ImageDataset& data) const {
  if (options_.steps() > 0) return options_.steps();
  const int64_t per_epoch = (data.size() + options_.batch_size() - 1) / options_.batch_size();
  return per_epoch * options_.epochs();
}

TrainReport Trainer::fit(const ImageDataset& data, const StepCallback& on_step) {
  TORCH_CHECK(data.size() > 0, "Trainer::fit needs a non-empty data set");
  const auto device = options_.device();
  const int64_t n = data.size();
  const int64_t total = total_steps(data);
  const auto params = model_->parameters();
  std::vector<torch::Tensor> optimizer_params;
  for (const auto& group : optimizer_->param_groups()) {
    optimizer_params.insert(optimizer_params.end(), group.params().begin(), group.params().end());
  }

  auto generator = at::make_generator<at::CPUGeneratorImpl>(options_.seed());
  torch::Tensor order;
  int64_t cursor = n;  // forces a shuffle before the first step
  int64_t epoch = -1;

  TrainReport report;
  report.steps.reserve(static_cast<size_t>(total));
  PeakMeter run_meter(device);
  model_->train();
  const auto run_start = Clock::now();
  int64_t samples = 0;
  for (int64_t step = 1; step <= total; ++step) {
    if (cursor >= n) {
      UntrackedGuard host;  // the sampler's indices live on the host
      order = torch::randperm(n, generator, torch::kInt64);
      cursor = 0;
      ++epoch;
    }
    const auto step_start = Clock::now();
    PeakMeter meter(device);
    // The last batch of an epoch holds what is left (like drop_last=false).
    const int64_t batch = std::min(options_.batch_size(), n - cursor);
    torch::Tensor idx = order.narrow(0, cursor, batch);
    cursor += batch;
    auto x = data.images.index_select(0, idx).to(device);
    auto y = data.labels.index_select(0, idx).to(device);
    torch::Tensor logits;
    {
      AutocastGuard autocast(device, options_.precision());
      logits = model_->forward(x);
    }
    auto loss = torch::nn::functional::cross_entropy(logits.to(torch::kFloat), y);
    const double loss_value = loss.item<double>();
    // Without a GradScaler a non-finite loss stops the run or skips the step;
    // with one, the scaler finds the non-finite gradients and skips the step.
    const bool skip = !std::isfinite(loss_value) && !scaler_->is_enabled();
    TORCH_CHECK(!skip || options_.nonfinite_loss() == NonfiniteLoss::kSkip, "step ", step,
                " (epoch ", epoch, "): the loss is ",
                std::isnan(loss_value) ? "NaN" : (loss_value > 0 ? "inf" : "-inf"),
                "; lower the learning rate, clip gradients (max_grad_norm, --clip-grad-norm), "
                "or skip such steps (NonfiniteLoss::kSkip, --skip-nonfinite)");
    bool stepped = false;
    int64_t model_grad_bytes = 0;
    if (!skip) {
      scaler_->scale(loss).backward();
      std::vector<torch::Tensor> grads;
      grads.reserve(params.size());
      for (const auto& p : params) grads.push_back(p.grad());
      model_grad_bytes = storage_bytes(grads);
      grads.clear();
      if (master_) master_->grads_to_master();
      {
        std::optional<UntrackedGuard> host;  // the optimizer steps on host copies
        if (options_.master_weights() == MasterWeightsMode::kHost) host.emplace();
        if (options_.max_grad_norm() > 0) {
          scaler_->unscale_(*optimizer_);  // a no-op without fp16
          torch::nn::utils::clip_grad_norm_(optimizer_params, options_.max_grad_norm());
        }
        stepped = scaler_->step(*optimizer_);
      }
      scaler_->update();
    }

    StepRecord rec;
    rec.step = step;
    rec.epoch = epoch;
    rec.loss = loss_value;
    rec.skipped = !stepped;
    report.skipped_steps += stepped ? 0 : 1;
    rec.peak_bytes = meter.peak();
    if (!skip && rec.peak_bytes > report.step_memory.peak) {
      report.step_memory = breakdown(rec.peak_bytes, model_grad_bytes);
    }
    if (master_ && !skip) master_->master_to_model();
    release_gradients(params);
    loss = logits = x = y = torch::Tensor();
    rec.current_bytes = memory_allocated(device);
    rec.seconds = seconds_since(step_start);
    samples += batch;
    report.steps.push_back(rec);
    if (on_step) on_step(rec);
  }
  report.seconds = seconds_since(run_start);
  report.samples_per_second = report.seconds > 0 ? double(samples) / report.seconds : 0.0;
  report.final_loss = report.steps.empty() ? 0.0 : report.steps.back().loss;
  // On CUDA each step's meter resets the device's one peak statistic, so the
  // run's peak is also taken as the largest step peak.
  report.peak_bytes = run_meter.peak();
  for (const auto& r : report.steps) report.peak_bytes = std::max(report.peak_bytes, r.peak_bytes);
  report.precision = to_string(options_.precision());
  report.final_scale = scaler_->is_enabled() ? scaler_->get_scale() : 0.0;
  return report;
}

EvalResult Trainer::evaluate(const ImageDataset& data) {
  TORCH_CHECK(data.size() > 0, "Trainer::evaluate needs a non-empty data set");
  const auto device = options_.device();
  torch::NoGradGuard no_grad;
  PeakMeter meter(device);
  model_->eval();
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
      logits = model_->forward(x).to(torch::kFloat);
    }
    loss_sum += torch::nn::functional::cross_entropy(
                    logits, y,
                    torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                    .item<double>();
    correct += logits.argmax(1).eq(y).sum().item<int64_t>();
  }
  model_->train();
  EvalResult r;
  r.loss = loss_sum / double(n);
  r.accuracy = double(correct) / double(n);
  r.peak_bytes = meter.peak();
  return r;
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
                          {"skipped", s.skipped}});
  }
  nlohmann::json summary = {{"steps", steps.size()},
                            {"final_loss", final_loss},
                            {"seconds", seconds},
                            {"samples_per_second", samples_per_second},
                            {"peak_bytes", peak_bytes},
                            {"precision", precision},
                            {"skipped_steps", skipped_steps},
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
