#include "memfit/checkpoint.h"

#include "compat.h"
#include "memfit/memory.h"
#include "memfit/profile.h"

#include <torch/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/dropout.h>

#include <algorithm>

namespace memfit {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What one checkpoint keeps from forward to backward.
struct CheckpointState : torch::CustomClassHolder {
  TensorsFn fn;
  CheckpointOptions options;
  compat::AutocastState autocast;
  compat::RngState rng;
  std::vector<c10::DeviceIndex> cuda_devices;
  std::vector<bool> requires_grad;
  std::vector<torch::Device> devices;
  std::vector<torch::Tensor> host_inputs;  // Offload::kHost
  std::function<void()> after_backward;     // runs once the recomputed graph is done
};

// Calls a state's after_backward when the backward that recomputed it ends.
struct AfterBackward {
  const std::function<void()>& fn;
  ~AfterBackward() {
    if (fn) fn();
  }
};

// Restores the autocast and RNG state of the forward for a recomputation, and
// this thread's own state afterwards (also when the recomputation throws).
class RecomputeScope {
 public:
  explicit RecomputeScope(const CheckpointState& s) : preserve_(s.options.preserve_rng_state()) {
    if (preserve_) {
      UntrackedGuard host;  // generator states are host memory
      own_rng_ = compat::get_rng_state(s.cuda_devices);
      compat::set_rng_state(s.rng);
    }
    own_autocast_ = compat::enter_autocast(s.autocast);
  }
  ~RecomputeScope() {
    compat::exit_autocast(own_autocast_);
    if (preserve_) compat::set_rng_state(own_rng_);
  }
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;

 private:
  bool preserve_;
  compat::RngState own_rng_;
  compat::AutocastState own_autocast_;
};

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // `tensors` holds the user's inputs followed by one empty tensor that
  // requires grad, so that the backward runs (and parameters used inside `fn`
  // get gradients) even when no input requires grad.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<CheckpointState> state,
                               at::TensorList tensors) {
    ctx->set_materialize_grads(false);
    const std::vector<torch::Tensor> inputs(tensors.begin(), tensors.end() - 1);
    state->autocast = compat::get_autocast_state();
    for (const auto& t : inputs) {
      state->requires_grad.push_back(t.defined() && t.requires_grad());
      state->devices.push_back(t.defined() ? t.device() : torch::Device(torch::kCPU));
      if (t.defined() && t.is_cuda()) {
        const auto d = t.device().index();
        if (std::find(state->cuda_devices.begin(), state->cuda_devices.end(), d) ==
            state->cuda_devices.end()) {
          state->cuda_devices.push_back(d);
        }
      }
    }
    if (state->options.preserve_rng_state()) {
      UntrackedGuard host;
      state->rng = compat::get_rng_state(state->cuda_devices);
    }
    std::vector<uint32_t> versions;
    for (const auto& t : inputs) versions.push_back(t.defined() ? t._version() : 0);
    variable_list outputs = state->fn(inputs);  // grad mode is off here
    for (size_t i = 0; i < inputs.size(); ++i) {
      TORCH_CHECK(!inputs[i].defined() || inputs[i]._version() == versions[i],
                  "memfit::checkpoint: the function modified its input ", i,
                  " in place (an in-place activation as its first layer, say); the "
                  "recomputation needs the original input: make that operation out of place "
                  "or start the checkpoint one layer later");
    }
    if (state->options.offload() == Offload::kHost) {
      UntrackedGuard host;
      for (const auto& t : inputs) {
        if (!t.defined()) {
          state->host_inputs.emplace_back();
          continue;
        }
        auto copy = torch::empty(t.sizes(), t.options().device(torch::kCPU).pinned_memory(t.is_cuda()));
        copy.copy_(t, /*non_blocking=*/true);
        state->host_inputs.push_back(copy);
      }
      ctx->save_for_backward({});
    } else {
      ctx->save_for_backward(inputs);
    }
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
                "memfit::checkpoint is not compatible with torch::autograd::grad() or with "
                "backward(inputs=...): call .backward() on the loss without inputs");
    TORCH_CHECK(!torch::autograd::GradMode::is_enabled(),
                "memfit::checkpoint does not support higher-order gradients (create_graph=true) "
                "through a checkpoint; run that part of the model without checkpointing");
    // Throws PyTorch's "Trying to backward through the graph a second time"
    // once the graph's buffers are freed.
    const variable_list saved = ctx->get_saved_variables();
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(
        ctx->saved_data["state"].toCapsule());

    std::vector<torch::Tensor> inputs;
    const size_t n = state->requires_grad.size();
    inputs.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      torch::Tensor t;
      if (state->options.offload() == Offload::kHost) {
        const auto& h = state->host_inputs[i];
        // Back to the device: a fresh (counted) copy, as a GPU would need.
        if (h.defined()) t = h.to(state->devices[i], /*non_blocking=*/true, /*copy=*/true);
      } else {
        t = saved[i];
      }
      if (t.defined()) t = t.detach().requires_grad_(state->requires_grad[i]);
      inputs.push_back(t);
    }

    AfterBackward after{state->after_backward};
    variable_list outputs;
    {
      RecomputeScope scope(*state);
      torch::autograd::AutoGradMode grad_mode(true);
      outputs = state->fn(inputs);
    }
    TORCH_CHECK(outputs.size() == grad_outputs.size(), "memfit::checkpoint: the function returned ",
                grad_outputs.size(), " tensors at forward but ", outputs.size(),
                " when recomputed; it must be deterministic in its structure");
    torch::autograd::edge_list roots;
    variable_list grads;
    bool any_requires_grad = false;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!outputs[i].defined() || !outputs[i].requires_grad()) continue;
      any_requires_grad = true;
      if (!grad_outputs[i].defined()) continue;
      TORCH_CHECK(outputs[i].sizes() == grad_outputs[i].sizes(),
                  "memfit::checkpoint: recomputed output ", i, " has shape ", outputs[i].sizes(),
                  " but its gradient has shape ", grad_outputs[i].sizes());
      roots.push_back(torch::autograd::impl::gradient_edge(outputs[i]));
      grads.push_back(grad_outputs[i]);
    }
    TORCH_CHECK(any_requires_grad,
                "memfit::checkpoint: none of output has requires_grad=True: nothing that the "
                "checkpointed function returns depends on a tensor that requires grad, so this "
                "checkpoint is not necessary; call the function directly");
    // Hold only the graph, not the recomputed outputs: each is freed as soon
    // as the node that saved it has run, as in the plain backward.
    outputs.clear();
    grad_outputs.clear();
    if (!roots.empty()) {
      torch::autograd::Engine::get_default_engine().execute(
          roots, grads, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/true);
    }
    grads.clear();

    variable_list result;
    result.reserve(n + 2);
    result.emplace_back();  // the state argument
    for (const auto& t : inputs) {
      result.push_back(t.defined() && t.requires_grad() ? t.grad() : torch::Tensor());
    }
    result.emplace_back();  // the empty tensor
    return result;
  }
};

} // namespace

namespace detail {
std::vector<torch::Tensor> checkpoint_impl(const TensorsFn& fn,
                                           const std::vector<torch::Tensor>& inputs,
                                           const CheckpointOptions& options,
                                           std::function<void()> after_backward) {
  TORCH_CHECK(static_cast<bool>(fn), "memfit::checkpoint needs a function, got an empty one");
  if (!torch::autograd::GradMode::is_enabled()) return fn(inputs);
  auto state = c10::make_intrusive<CheckpointState>();
  state->fn = fn;
  state->options = options;
  state->after_backward = std::move(after_backward);
  std::vector<torch::Tensor> tensors = inputs;
  tensors.push_back(torch::empty({0}, torch::requires_grad()));
  return CheckpointFunction::apply(state, at::TensorList(tensors));
}
} // namespace detail

torch::Tensor checkpoint_sequential(const torch::nn::Sequential& sequential, int64_t segments,
                                    const torch::Tensor& input, const CheckpointOptions& options) {
  TORCH_CHECK(!sequential.is_empty(), "checkpoint_sequential needs a Sequential, got an empty holder");
  TORCH_CHECK(segments >= 1, "checkpoint_sequential: segments must be at least 1, got ", segments);
  std::vector<torch::nn::AnyModule> modules(sequential->begin(), sequential->end());
  const int64_t n = static_cast<int64_t>(modules.size());
  auto run = [modules](int64_t begin, int64_t end, torch::Tensor x) mutable {
    for (int64_t i = begin; i < end; ++i) x = modules[static_cast<size_t>(i)].forward(x);
    return x;
  };
  // torch.utils.checkpoint.checkpoint_sequential, index for index.
  const int64_t size = n / segments;
  int64_t end = 0;
  torch::Tensor x = input;
  for (int64_t start = 0; start < size * (segments - 1); start += size) {
    end = start + size;
    x = checkpoint([run, start, end](const torch::Tensor& in) mutable { return run(start, end, in); },
                   x, options);
  }
  return run(end, n, x);
}

namespace {
// The SelectivelyRecomputed modules inside `module`, itself first.
std::vector<SelectivelyRecomputed*> recomputed_parts(const torch::nn::Module& module) {
  std::vector<SelectivelyRecomputed*> out;
  // Itself without shared_from_this (a module need not be held by a shared_ptr), then the rest.
  if (auto* self = dynamic_cast<SelectivelyRecomputed*>(const_cast<torch::nn::Module*>(&module))) out.push_back(self);
  for (const auto& m : module.modules(/*include_self=*/false)) {
    if (auto* part = dynamic_cast<SelectivelyRecomputed*>(m.get())) out.push_back(part);
  }
  return out;
}
} // namespace

int64_t set_selective_recompute(const torch::nn::Module& module, bool enabled) {
  const auto parts = recomputed_parts(module);
  for (auto* part : parts) part->set_selective_recompute(enabled);
  return static_cast<int64_t>(parts.size());
}

SelectiveRecomputeGuard::SelectiveRecomputeGuard(const torch::nn::Module& module, bool enabled) {
  for (auto* part : recomputed_parts(module)) {
    parts_.emplace_back(part, part->selective_recompute());
    part->set_selective_recompute(enabled);
  }
}

SelectiveRecomputeGuard::~SelectiveRecomputeGuard() {
  for (auto& [part, was] : parts_) part->set_selective_recompute(was);
}

bool selective_recompute(const torch::nn::Module& module) {
  const auto parts = recomputed_parts(module);
  return !parts.empty() &&
         std::all_of(parts.begin(), parts.end(), [](const SelectivelyRecomputed* p) { return p->selective_recompute(); });
}

namespace {

// Whether a layer modifies its input in place (a checkpoint must not start at it).
bool module_is_in_place(torch::nn::AnyModule& m) {
  const auto p = m.ptr();
#define MEMFIT_INPLACE(Type) \
  if (auto* q = p->as<torch::nn::Type>()) return q->options.inplace();
  MEMFIT_INPLACE(ReLU)
  MEMFIT_INPLACE(ReLU6)
  MEMFIT_INPLACE(LeakyReLU)
  MEMFIT_INPLACE(ELU)
  MEMFIT_INPLACE(SELU)
  MEMFIT_INPLACE(CELU)
  MEMFIT_INPLACE(RReLU)
  MEMFIT_INPLACE(Hardtanh)
  MEMFIT_INPLACE(Threshold)
  MEMFIT_INPLACE(Dropout)
  MEMFIT_INPLACE(Dropout2d)
  MEMFIT_INPLACE(Dropout3d)
  MEMFIT_INPLACE(AlphaDropout)
  MEMFIT_INPLACE(FeatureAlphaDropout)
#undef MEMFIT_INPLACE
  return false;
}

} // namespace

CheckpointedSequentialImpl::CheckpointedSequentialImpl(torch::nn::Sequential sequential,
                                                       CheckpointedSequentialOptions options)
    : sequential_(std::move(sequential)), options_(std::move(options)) {
  TORCH_CHECK(!sequential_.is_empty() && sequential_->size() > 0,
              "CheckpointedSequential needs a non-empty Sequential");
  reset();
}

void CheckpointedSequentialImpl::reset() {
  register_module("sequential", sequential_);
  modules_.assign(sequential_->begin(), sequential_->end());
  in_place_.clear();
  for (auto& m : modules_) in_place_.push_back(module_is_in_place(m));
  const auto n = static_cast<int64_t>(modules_.size());
  switch (options_.kind()) {
    case ScheduleKind::kNone:
      schedule_ = schedule_none(n);
      break;
    case ScheduleKind::kEvery:
      schedule_ = avoid_in_place_starts(schedule_every(n, options_.k()), in_place_);
      break;
    case ScheduleKind::kUniform:
      schedule_ = avoid_in_place_starts(schedule_uniform(n, options_.k()), in_place_);
      break;
    case ScheduleKind::kSqrt:
      schedule_ = avoid_in_place_starts(schedule_sqrt(n), in_place_);
      break;
    case ScheduleKind::kOptimal:
      TORCH_CHECK(options_.budget() > 0,
                  "CheckpointedSequential with the optimal schedule needs budget(bytes) > 0, got ",
                  options_.budget());
      schedule_ = Schedule{};
      break;
  }
}

void CheckpointedSequentialImpl::plan(const torch::Tensor& sample_input) {
  if (options_.kind() != ScheduleKind::kOptimal) return;
  auto costs = costs_from_profile(profile_chain(sequential_, sample_input));
  for (size_t i = 0; i < in_place_.size(); ++i) costs.in_place[i] = costs.in_place[i] || in_place_[i];
  schedule_ = solve_optimal(costs, options_.budget(), options_.solver());
}

void CheckpointedSequentialImpl::set_schedule(Schedule schedule) {
  if (schedule.segments.empty() && options_.kind() == ScheduleKind::kOptimal) {
    schedule_ = Schedule{};  // not planned yet: the next forward with grad plans
    return;
  }
  schedule.validate(static_cast<int64_t>(modules_.size()));
  schedule_ = std::move(schedule);
}

torch::Tensor CheckpointedSequentialImpl::forward(const torch::Tensor& input) {
  if (!torch::autograd::GradMode::is_enabled()) {
    torch::Tensor x = input;
    for (size_t i = 0; i < modules_.size(); ++i) x = run_layer(static_cast<int64_t>(i), x);
    return x;
  }
  if (schedule_.segments.empty()) plan(input);
  return run(schedule_.segments, input);
}

torch::Tensor CheckpointedSequentialImpl::run(const std::vector<Segment>& segments,
                                              torch::Tensor x) {
  // The caller holds the input (the chain's, or a recomputation's): a
  // checkpoint that starts there keeps it where it is, since a host copy
  // would only come back beside it.
  const torch::Tensor input = x;
  for (const auto& s : segments) {
    if (!s.checkpointed) {
      for (int64_t i = s.begin; i < s.end; ++i) x = run_layer(i, x);
      continue;
    }
    // Nothing in it needs a gradient (a Flatten on the data, say): no graph
    // to save or recompute, so it runs as it is.
    bool trainable = x.requires_grad();
    for (int64_t i = s.begin; i < s.end && !trainable; ++i) {
      for (const auto& p : modules_[static_cast<size_t>(i)].ptr()->parameters()) {
        trainable = trainable || p.requires_grad();
      }
    }
    if (!trainable) {
      for (int64_t i = s.begin; i < s.end; ++i) x = run_layer(i, x);
      continue;
    }
    // The recomputation may run after the schedule is replaced: keep a copy.
    auto inner = std::make_shared<const std::vector<Segment>>(s.inner);
    auto options = options_.checkpoint();
    if (x.is_same(input)) options.offload(Offload::kNone);
    x = checkpoint([this, inner](const torch::Tensor& in) { return run(*inner, in); }, x, options);
  }
  return x;
}

torch::Tensor CheckpointedSequentialImpl::run_layer(int64_t i, const torch::Tensor& x) {
  auto& m = modules_[static_cast<size_t>(i)];
  return runner_ ? runner_(i, m, x) : m.forward(x);
}

std::vector<FoundChain> find_chains(const torch::nn::Module& module) {
  std::vector<FoundChain> out;
  if (auto* self = dynamic_cast<const CheckpointedSequentialImpl*>(&module)) {
    auto ptr = std::const_pointer_cast<CheckpointedSequentialImpl>(
        std::dynamic_pointer_cast<const CheckpointedSequentialImpl>(self->shared_from_this()));
    out.push_back({"", CheckpointedSequential(ptr)});
    return out;  // every other chain is inside its layers
  }
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    auto chain = std::dynamic_pointer_cast<CheckpointedSequentialImpl>(item.value());
    if (!chain) continue;
    const bool nested = std::any_of(out.begin(), out.end(), [&](const FoundChain& c) {
      return item.key().rfind(c.name + ".", 0) == 0;
    });
    if (!nested) out.push_back({item.key(), CheckpointedSequential(chain)});
  }
  return out;
}

} // namespace memfit
