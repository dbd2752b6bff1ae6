#include "memfit/precision.h"

#include "compat.h"
#include "memfit/optim.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/optimizer.h>
#include <torch/torch.h>

#include <cmath>
#include <algorithm>
#include <map>

namespace memfit {

Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::kFP32;
  if (name == "bf16") return Precision::kBF16;
  if (name == "fp16") return Precision::kFP16;
  TORCH_CHECK(false, "unknown precision '", name, "': expected fp32, bf16, fp16 or auto");
}

std::string to_string(Precision precision) {
  switch (precision) {
    case Precision::kFP32: return "fp32";
    case Precision::kBF16: return "bf16";
    case Precision::kFP16: return "fp16";
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled precision");
}

at::ScalarType scalar_type(Precision precision) {
  switch (precision) {
    case Precision::kFP32: return at::kFloat;
    case Precision::kBF16: return at::kBFloat16;
    case Precision::kFP16: return at::kHalf;
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled precision");
}

Precision auto_precision(const torch::Device& device) {
  if (device.is_cuda()) {
    return compat::cuda_supports_bf16(device.has_index() ? device.index() : 0) ? Precision::kBF16
                                                                               : Precision::kFP16;
  }
  return Precision::kBF16;
}

void check_precision_supported(Precision precision, const torch::Device& device) {
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), "mixed precision runs on cpu or cuda, got ",
              device.str());
  if (device.is_cuda()) {
    TORCH_CHECK(compat::kBuiltWithCuda,
                "this build of memfit has no CUDA: run with --device cpu, or rebuild "
                "against a LibTorch with CUDA");
    return;
  }
  TORCH_CHECK(precision != Precision::kFP16 || compat::kCpuAutocastHalf,
              "fp16 compute is not available on the CPU with LibTorch ", TORCH_VERSION,
              " (CPU autocast supports bfloat16 only before LibTorch 2.4): use --precision bf16 "
              "or fp32 on the CPU, or fp16 on a CUDA device");
}

// ---------------------------------------------------------------- AutocastGuard

AutocastGuard::AutocastGuard(c10::DeviceType device_type, c10::optional<at::ScalarType> dtype,
                             bool enabled, bool cache_enabled) {
  TORCH_CHECK(device_type == c10::DeviceType::CPU || device_type == c10::DeviceType::CUDA,
              "autocast supports device types cpu and cuda, got ", device_type);
  const bool cuda = device_type == c10::DeviceType::CUDA;
  const at::ScalarType fast = dtype.value_or(cuda ? at::kHalf : at::kBFloat16);
  TORCH_CHECK(fast == at::kBFloat16 || fast == at::kHalf,
              "autocast computes in bfloat16 or float16, got ", fast);
  if (enabled) {
    check_precision_supported(fast == at::kHalf ? Precision::kFP16 : Precision::kBF16,
                              torch::Device(device_type));
  }
  AutocastState next = compat::get_autocast_state();
  (cuda ? next.cuda_enabled : next.cpu_enabled) = enabled;
  (cuda ? next.cuda_dtype : next.cpu_dtype) = fast;
  prev_cache_enabled_ = at::autocast::is_autocast_cache_enabled();
  prev_ = compat::enter_autocast(next);
  at::autocast::set_autocast_cache_enabled(cache_enabled);
}

AutocastGuard::AutocastGuard(const torch::Device& device, Precision precision)
    : AutocastGuard(device.type(),
                    precision == Precision::kFP32 ? c10::nullopt
                                                  : c10::make_optional(scalar_type(precision)),
                    precision != Precision::kFP32) {}

AutocastGuard::~AutocastGuard() {
  compat::exit_autocast(prev_);
  at::autocast::set_autocast_cache_enabled(prev_cache_enabled_);
}

// ---------------------------------------------------------------- GradScaler

GradScaler::GradScaler(GradScalerOptions options) : options_(std::move(options)) {
  TORCH_CHECK(std::isfinite(options_.init_scale()) && options_.init_scale() > 0,
              "GradScaler init_scale must be a positive finite number, got ",
              options_.init_scale());
  set_growth_factor(options_.growth_factor());
  set_backoff_factor(options_.backoff_factor());
  set_growth_interval(options_.growth_interval());
}

GradScaler::~GradScaler() = default;
GradScaler::GradScaler(GradScaler&&) noexcept = default;
GradScaler& GradScaler::operator=(GradScaler&&) noexcept = default;

void GradScaler::set_growth_factor(double v) {
  TORCH_CHECK(v > 1.0, "GradScaler growth_factor must be > 1.0, got ", v);
  options_.growth_factor(v);
}

void GradScaler::set_backoff_factor(double v) {
  TORCH_CHECK(v > 0.0 && v < 1.0, "GradScaler backoff_factor must be in (0, 1), got ", v);
  options_.backoff_factor(v);
}

void GradScaler::set_growth_interval(int64_t v) {
  TORCH_CHECK(v >= 1 && v <= std::numeric_limits<int32_t>::max(),
              "GradScaler growth_interval must be a positive int32, got ", v);
  options_.growth_interval(v);
}

void GradScaler::lazy_init(const torch::Device& device) {
  if (scale_.defined()) return;
  auto opts = torch::TensorOptions().device(device);
  scale_ = torch::full({}, options_.init_scale(), opts.dtype(torch::kFloat));
  growth_tracker_ = torch::full({}, loaded_tracker_, opts.dtype(torch::kInt));
}

torch::Tensor GradScaler::scale(const torch::Tensor& outputs) {
  if (!options_.enabled()) return outputs;
  TORCH_CHECK(outputs.defined(), "GradScaler::scale got an undefined tensor");
  lazy_init(outputs.device());
  return outputs * scale_.to(outputs.device(), /*non_blocking=*/true);
}

std::vector<torch::Tensor> GradScaler::scale(const std::vector<torch::Tensor>& outputs) {
  std::vector<torch::Tensor> out;
  out.reserve(outputs.size());
  for (const auto& t : outputs) out.push_back(scale(t));
  return out;
}

std::vector<torch::Tensor> GradScaler::unscale_grads(torch::optim::Optimizer& optimizer,
                                                     const torch::Tensor& inv_scale, bool unscale) {
  // Gradients grouped by device and dtype, as in PyTorch's _unscale_grads_.
  std::map<std::pair<std::string, at::ScalarType>, std::vector<torch::Tensor>> groups;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto g = p.grad();
      TORCH_CHECK(!unscale || g.scalar_type() != at::kHalf,
                  "Attempting to unscale FP16 gradients: keep the optimizer's parameters in "
                  "fp32 (memfit::MasterWeights) and unscale their fp32 gradients");
      if (g.is_sparse()) {
        // PyTorch coalesces fp16 sparse gradients so duplicate indices cannot
        // overflow; sparse values are unscaled in place either way.
        g = g._values();
      }
      groups[{g.device().str(), g.scalar_type()}].push_back(g);
    }
  }
  std::map<std::string, std::pair<torch::Tensor, torch::Tensor>> per_device;  // found_inf, inv_scale
  for (auto& kv : groups) {
    auto& grads = kv.second;
    const auto device = grads.front().device();
    auto& dev = per_device[kv.first.first];
    if (!dev.first.defined()) {
      dev.first = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat).device(device));
      dev.second = inv_scale.to(device, /*non_blocking=*/true).reshape({1});
    }
    const auto dtype = kv.first.second;
    if (device.is_cuda() && (dtype == at::kFloat || dtype == at::kHalf)) {
      at::_amp_foreach_non_finite_check_and_unscale_(grads, dev.first, dev.second);
      continue;
    }
    // Where the fused kernel is missing (the CPU in LibTorch 1.13; bfloat16
    // gradients on CUDA): the same check and scaling with ordinary ops, and no sync.
    const auto inv = dev.second.reshape({});  // 0-dim, so that a 0-dim gradient multiplies in place too
    for (auto& g : grads) {
      auto nonfinite = torch::isfinite(g).all().logical_not();
      dev.first.masked_fill_(nonfinite, 1.0);
      if (unscale) g.mul_(inv);
    }
  }
  std::vector<torch::Tensor> found;
  for (auto& kv : per_device) found.push_back(kv.second.first);
  return found;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) return;
  auto& state = per_optimizer_[&optimizer];
  TORCH_CHECK(state.stage != Stage::kUnscaled,
              "unscale_() has already been called on this optimizer since the last update()");
  TORCH_CHECK(state.stage != Stage::kStepped, "unscale_() is being called after step()");
  TORCH_CHECK(scale_.defined(),
              "GradScaler::unscale_ before any scale(): scale the loss with scaler.scale(loss) "
              "before backward");
  // Reciprocal in double, then float, as PyTorch does.
  const auto inv_scale = scale_.to(torch::kDouble).reciprocal().to(torch::kFloat);
  state.found_inf_per_device = unscale_grads(optimizer, inv_scale);
  state.stage = Stage::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  const auto r = step_async(optimizer);
  return r.found_inf.defined() ? r.found_inf.item<double>() == 0 : r.stepped;
}

ScaledStep GradScaler::step_async(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return {true, {}};
  }
  auto& state = per_optimizer_[&optimizer];
  TORCH_CHECK(state.stage != Stage::kStepped,
              "step() has already been called since the last update()");
  // memfit's optimizers on the fused kernel divide the scale out as they
  // update and skip where found_inf is 1 (PyTorch's fused=True): only the
  // inf check runs here, and nothing is read.
  auto* in_kernel = dynamic_cast<optim::KernelChoice*>(&optimizer);
  if (state.stage != Stage::kReady || in_kernel == nullptr || !in_kernel->can_unscale_in_kernel()) in_kernel = nullptr;
  if (in_kernel != nullptr) {
    TORCH_CHECK(scale_.defined(), "GradScaler::step before any scale(): scale the loss with scaler.scale(loss) "
                                  "before backward");
    state.found_inf_per_device = unscale_grads(optimizer, torch::ones({}, scale_.options()), /*unscale=*/false);
  }
  if (state.stage == Stage::kReady && in_kernel == nullptr) unscale_(optimizer);
  const auto& found_infs = state.found_inf_per_device;
  TORCH_CHECK(!found_infs.empty(),
              "No inf checks were recorded for this optimizer: none of its parameters has a "
              "gradient; run backward on scaler.scale(loss) first");
  if (in_kernel != nullptr) {
    auto found = found_infs.front();
    if (found_infs.size() > 1) {  // any device's inf skips the whole step, as the host's sum does
      found = torch::zeros({1}, scale_.options());
      for (const auto& f : found_infs) found.add_(f.to(scale_.device(), /*non_blocking=*/true));
      found.clamp_max_(1);
    }
    state.stage = Stage::kStepped;
    in_kernel->step_unscaling(scale_, found);
    return {true, found};
  }
  double found = 0;
  for (const auto& f : found_infs) found += f.item<double>();
  state.stage = Stage::kStepped;
  if (found != 0) return {false, {}};
  optimizer.step();
  return {true, {}};
}

void GradScaler::update() {
  if (!options_.enabled()) return;
  TORCH_CHECK(scale_.defined(), "GradScaler::update before any scale()");
  std::vector<torch::Tensor> found_infs;
  for (auto& kv : per_optimizer_) {
    for (auto& f : kv.second.found_inf_per_device) found_infs.push_back(f.to(scale_.device(), true));
  }
  TORCH_CHECK(!found_infs.empty(),
              "No inf checks were recorded prior to update(): call step() or unscale_() first");
  auto combined = found_infs.front().clone();
  for (size_t i = 1; i < found_infs.size(); ++i) combined.add_(found_infs[i]);
  if (scale_.is_cuda()) {
    at::_amp_update_scale_(scale_, growth_tracker_, combined, options_.growth_factor(),
                           options_.backoff_factor(), options_.growth_interval());
  } else {
    // _amp_update_scale_'s arithmetic with tensor ops (no sync): back off on
    // inf; otherwise count the clean step and grow at growth_interval, keeping
    // the old scale if the grown one is not finite.
    auto found = combined.reshape({}).gt(0);
    auto successful = growth_tracker_ + 1;
    auto at_interval = successful.eq(options_.growth_interval());
    auto grown = scale_ * options_.growth_factor();
    auto grow = at_interval.logical_and(torch::isfinite(grown));
    auto next_scale =
        torch::where(found, scale_ * options_.backoff_factor(), torch::where(grow, grown, scale_));
    auto next_tracker = torch::where(found.logical_or(at_interval),
                                     torch::zeros_like(growth_tracker_), successful);
    scale_.copy_(next_scale);
    growth_tracker_.copy_(next_tracker);
  }
  per_optimizer_.clear();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled()) return;
  TORCH_CHECK(std::isfinite(new_scale) && new_scale > 0,
              "GradScaler::update(new_scale) needs a positive finite scale, got ", new_scale);
  if (!scale_.defined()) {
    options_.init_scale(new_scale);
  } else {
    scale_.fill_(new_scale);
  }
  per_optimizer_.clear();
}

void GradScaler::update(const torch::Tensor& new_scale) {
  if (!options_.enabled()) return;
  TORCH_CHECK(new_scale.numel() == 1 && new_scale.scalar_type() == torch::kFloat,
              "GradScaler::update(new_scale) needs a one-element float32 tensor, got ",
              new_scale.numel(), " elements of ", new_scale.scalar_type());
  TORCH_CHECK(!new_scale.requires_grad(), "new_scale should not require grad");
  if (!scale_.defined()) lazy_init(new_scale.device());
  scale_.copy_(new_scale.reshape({}));
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled()) return 1.0;
  return scale_.defined() ? scale_.item<double>() : options_.init_scale();
}

int64_t GradScaler::growth_tracker() const {
  return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : loaded_tracker_;
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  TORCH_CHECK(options_.enabled(), "GradScaler::save on a disabled scaler: it has no state");
  archive.write("scale", c10::IValue(get_scale()));
  archive.write("growth_factor", c10::IValue(options_.growth_factor()));
  archive.write("backoff_factor", c10::IValue(options_.backoff_factor()));
  archive.write("growth_interval", c10::IValue(options_.growth_interval()));
  archive.write("growth_tracker", c10::IValue(growth_tracker()));
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  TORCH_CHECK(options_.enabled(),
              "GradScaler::load on a disabled scaler: enable it (GradScalerOptions().enabled(true))");
  c10::IValue scale, growth, backoff, interval, tracker;
  TORCH_CHECK(archive.try_read("scale", scale) && archive.try_read("growth_factor", growth) &&
                  archive.try_read("backoff_factor", backoff) &&
                  archive.try_read("growth_interval", interval) &&
                  archive.try_read("growth_tracker", tracker),
              "GradScaler::load: the archive holds no GradScaler state (scale, growth_factor, "
              "backoff_factor, growth_interval, growth_tracker); was it saved by "
              "GradScaler::save?");
  set_growth_factor(growth.toDouble());
  set_backoff_factor(backoff.toDouble());
  set_growth_interval(interval.toInt());
  if (scale_.defined()) {
    scale_.fill_(scale.toDouble());
    growth_tracker_.fill_(tracker.toInt());
  } else {
    options_.init_scale(scale.toDouble());
    loaded_tracker_ = tracker.toInt();
  }
}

// ---------------------------------------------------------------- MasterWeights

namespace detail {
void add_to_host_grad(const torch::Tensor& master, const torch::Tensor& g, int64_t begin, bool copy) {
  torch::NoGradGuard no_grad;
  UntrackedGuard host;
  auto& grad = const_cast<torch::Tensor&>(master).mutable_grad();
  if (!grad.defined()) {
    grad = torch::empty(master.sizes(), master.options().pinned_memory(g.is_cuda()));
    copy = true;
  }
  auto part = g.sizes() == master.sizes() ? grad : grad.narrow(0, begin, g.size(0));
  if (copy) {
    part.copy_(g);
  } else {
    part.add_(g.to(part.options()));
  }
}
} // namespace detail

MasterWeights::MasterWeights(std::vector<torch::Tensor> params, MasterWeightsOptions options)
    : params_(std::move(params)), cast_(params_.size(), true), options_(std::move(options)) {
  init();
}

namespace {
// After autograd accumulated a parameter's gradient: adds it into the host
// master's gradient and releases it on the device.
struct GradientToHost : torch::autograd::FunctionPostHook {
  GradientToHost(torch::Tensor param, torch::Tensor master) : param_(std::move(param)), master_(std::move(master)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (!param_.grad().defined()) return outputs;
    detail::add_to_host_grad(master_, param_.grad());
    param_.mutable_grad() = torch::Tensor();
    return outputs;
  }
  torch::Tensor param_, master_;
};

bool is_normalization(const torch::nn::Module& m) {
  const std::string& name = m.name();
  for (const char* norm : {"BatchNorm", "InstanceNorm", "LayerNorm", "GroupNorm"}) {
    if (name.find(norm) != std::string::npos) return true;
  }
  return false;
}
} // namespace

MasterWeights::MasterWeights(torch::nn::Module& module, MasterWeightsOptions options)
    : options_(std::move(options)) {
  std::vector<const c10::TensorImpl*> kept;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (!is_normalization(*m)) continue;
    for (const auto& p : m->parameters(/*recurse=*/false)) kept.push_back(p.unsafeGetTensorImpl());
  }
  params_ = module.parameters();
  for (const auto& p : params_) {
    cast_.push_back(std::find(kept.begin(), kept.end(), p.unsafeGetTensorImpl()) == kept.end());
  }
  init();
}

void MasterWeights::init() {
  TORCH_CHECK(options_.dtype() == at::kBFloat16 || options_.dtype() == at::kHalf ||
                  (options_.dtype() == at::kFloat && options_.offload() == Offload::kHost),
              "MasterWeights holds parameters in bfloat16 or float16 (or in float32 with "
              "Offload::kHost, host masters only), got ", options_.dtype(),
              options_.dtype() == at::kFloat ? " without Offload::kHost" : "");
  if (options_.dtype() == at::kFloat) cast_.assign(params_.size(), false);
  TORCH_CHECK(options_.gradients() == Offload::kNone || options_.offload() == Offload::kHost,
              "MasterWeights: gradients offloaded to the host go to host masters: set offload to "
              "Offload::kHost too, or gradients to Offload::kNone");
  TORCH_CHECK(options_.parameters() == Offload::kNone ||
                  (options_.dtype() == at::kFloat && options_.offload() == Offload::kHost &&
                   options_.gradients() == Offload::kHost),
              "MasterWeights: parameters offloaded to the host are streamed from float32 host masters "
              "that also receive the gradients: set dtype kFloat, offload and gradients to "
              "Offload::kHost (got dtype ", options_.dtype(), "), or parameters to Offload::kNone");
  for (const auto& p : params_) {
    TORCH_CHECK(p.defined() && p.scalar_type() == at::kFloat,
                "MasterWeights needs float32 parameters to copy, got ",
                p.defined() ? c10::toString(p.scalar_type()) : "an undefined tensor");
  }
  masters_.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    if (!cast_[i] && options_.offload() == Offload::kNone) {
      masters_.push_back(p);  // an fp32 parameter on the device is its own master
      continue;
    }
    torch::Tensor master;
    {
      torch::NoGradGuard no_grad;
      if (options_.offload() == Offload::kHost) {
        UntrackedGuard host;
        const bool to_cuda = p.is_cuda() || (streamed() && options_.stream_to() && options_.stream_to()->is_cuda());
        master = torch::empty(p.sizes(), p.options().device(torch::kCPU).pinned_memory(to_cuda));
        master.copy_(p);
      } else {
        master = p.detach().clone();
      }
    }
    master.set_requires_grad(p.requires_grad());
    masters_.push_back(master);
    if (cast_[i]) {
      torch::NoGradGuard no_grad;
      p.set_data(p.to(options_.dtype()));
    }
  }
  // Streamed: each parameter keeps its shape over one element of storage
  // on the device it is streamed to, before its accumulator is made.
  if (streamed()) {
    torch::NoGradGuard no_grad;
    for (auto& p : params_) {
      UntrackedGuard placeholder;  // a few bytes; not part of the model's device memory
      released_.push_back(torch::zeros({1}, p.options().device(options_.stream_to().value_or(p.device())))
                              .expand(p.sizes()));
      p.set_data(released_.back());
    }
  }
  // After the casts: set_data() to another dtype gives a parameter a new accumulator.
  if (options_.gradients() == Offload::kHost) {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].requires_grad()) continue;
      auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
      TORCH_INTERNAL_ASSERT(acc != nullptr);
      hook_keys_.push_back(acc->add_post_hook(std::make_unique<GradientToHost>(params_[i], masters_[i])));
      accumulators_.push_back(compat::hold_node(std::move(acc)));
    }
  }
}

MasterWeights::~MasterWeights() {
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    static_cast<torch::autograd::Node*>(accumulators_[i].get())->del_post_hook(hook_keys_[i]);
  }
  if (!streamed()) return;
  // The model is whole again. Streamed to a GPU: in host memory (the masters'
  // own storage, no copy), where a model too large for the device was built.
  // Streamed on the CPU, the device is the host: its parameters go back into
  // the memory that memory_allocated() counts, as the model held them, so a
  // later step or plan counts them again (in the masters' untracked storage
  // a planner measured the LM of examples/consumer 4.72 MiB low after a
  // streamed plan, docs/planner.md). Where a budget refuses those bytes, the
  // masters' storage stays.
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor data = masters_[i].detach();
    if (i < released_.size() && released_[i].device().is_cpu()) {
      try {
        data = data.clone();
      } catch (const c10::Error&) {  // a budget's out-of-memory error: never thrown from a destructor
      }
    }
    params_[i].set_data(data);
  }
}

torch::Tensor MasterWeights::fetch(size_t i, int64_t begin, int64_t rows) const {
  TORCH_CHECK(i < masters_.size(), "MasterWeights::fetch: no parameter ", i, " (there are ",
              masters_.size(), ")");
  torch::NoGradGuard no_grad;
  const auto& m = masters_[i];
  const auto part = rows < 0 ? m : m.narrow(0, begin, rows);
  auto copy = torch::empty(part.sizes(), params_[i].options());
  copy.copy_(part, /*non_blocking=*/true);
  return copy;
}

void MasterWeights::set_parameter_data(size_t i, const torch::Tensor& data) {
  TORCH_CHECK(streamed(), "MasterWeights::set_parameter_data needs streamed parameters "
              "(MasterWeightsOptions::parameters(Offload::kHost))");
  TORCH_CHECK(i < params_.size(), "MasterWeights::set_parameter_data: no parameter ", i);
  torch::NoGradGuard no_grad;
  params_[i].set_data(data.defined() ? data : released_[i]);
}

int64_t MasterWeights::index_of(const torch::Tensor& param) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) return static_cast<int64_t>(i);
  }
  return -1;
}
MasterWeights::MasterWeights(MasterWeights&&) noexcept = default;
MasterWeights& MasterWeights::operator=(MasterWeights&&) noexcept = default;

void MasterWeights::grads_to_master() {
  if (options_.gradients() == Offload::kHost) return;  // streamed there during backward
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    auto& m = masters_[i];
    if (m.is_same(p)) continue;  // its own master
    if (!p.grad().defined()) {
      m.mutable_grad() = torch::Tensor();
      continue;
    }
    torch::Tensor g;
    if (options_.offload() == Offload::kHost) {
      UntrackedGuard host;
      g = torch::empty(m.sizes(), m.options().pinned_memory(p.is_cuda()));
      g.copy_(p.grad());
    } else {
      g = p.grad().to(at::kFloat);
    }
    m.mutable_grad() = g;
    p.mutable_grad() = torch::Tensor();  // the low-precision gradient is released
  }
}

void MasterWeights::master_to_model() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (masters_[i].is_same(params_[i])) continue;  // updated in place by the optimizer
    if (!streamed()) params_[i].copy_(masters_[i]);  // streamed: fetched from the masters when used
    masters_[i].mutable_grad() = torch::Tensor();
  }
}

} // namespace memfit
