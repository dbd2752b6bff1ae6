#include "memfit/optim.h"

#include "compat.h"
#include "memfit/memory.h"

#include <ATen/ATen.h>
#include <c10/util/Type.h>

#include <array>
#include <cmath>
#include <functional>
#include <map>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace memfit {
namespace optim {
namespace {

// A scalar operand of `mul_`, `div` or `add_` as LibTorch makes it (a 0-dim
// CPU tensor marked as a wrapped number), already in the parameter's dtype,
// which is what TensorIterator would cast it to. Made ahead, in host memory
// (where a CUDA run holds it too), so that the update allocates nothing.
torch::Tensor wrapped(double value, at::ScalarType dtype) {
  UntrackedGuard host;
  auto t = at::scalar_tensor(value, at::kDouble).to(dtype);
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

// Work buffers as large as the largest parameter of each device and dtype;
// a parameter's work tensor is a view of the first elements.
class Workspace {
 public:
  void need(const torch::Tensor& p, int count) {
    auto& e = entries_[{p.device().str(), p.scalar_type()}];
    e.numel = std::max(e.numel, p.numel());
    e.count = std::max(e.count, count);
    e.options = p.options();
  }
  void allocate() {
    for (auto& kv : entries_) {
      auto& e = kv.second;
      for (int i = 0; i < e.count; ++i) e.buffers.push_back(torch::empty({e.numel}, e.options));
    }
  }
  torch::Tensor view(const torch::Tensor& p, int index) const {
    const auto& e = entries_.at({p.device().str(), p.scalar_type()});
    return e.buffers.at(static_cast<size_t>(index)).narrow(0, 0, p.numel()).view(p.sizes());
  }

 private:
  struct Entry {
    int64_t numel = 0;
    int count = 0;
    torch::TensorOptions options;
    std::vector<torch::Tensor> buffers;
  };
  std::map<std::pair<std::string, at::ScalarType>, Entry> entries_;
};

using DeviceSteps = std::unordered_map<const c10::TensorImpl*, torch::Tensor>;

// Runs `prepare` (which adds state entries and device step counts, whose
// keys it records) and, if it throws, removes those before rethrowing: a
// failed step leaves the state as it found it.
template <class State, class Key, class Prepare>
void prepare_or_undo(State& state, std::vector<Key>& added, Prepare prepare, DeviceSteps* steps = nullptr,
                     const std::vector<const c10::TensorImpl*>& added_steps = {}) {
  try {
    prepare();
    before_commit();  // everything is made: the last point where the step can still change nothing
  } catch (...) {
    for (const auto& k : added) state.erase(k);
    for (const auto* k : added_steps) steps->erase(k);
    throw;
  }
}

torch::Tensor closure_loss(const torch::optim::Optimizer::LossClosure& closure) {
  if (closure == nullptr) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

// Why a parameter cannot take the fused kernel, or "" when it can: the fused
// kernels index the parameter, its gradient and its state as one dense run
// of elements of the parameter's dtype, on the CPU or CUDA.
std::string fused_refusal(const torch::Tensor& p, const torch::Tensor& grad,
                          std::initializer_list<torch::Tensor> state) {
  if (!at::isFloatingType(p.scalar_type())) return std::string("a parameter of dtype ") + c10::toString(p.scalar_type());
  if (grad.is_sparse()) return "a sparse gradient";
  if (grad.scalar_type() != p.scalar_type() || grad.device() != p.device()) {
    return "a gradient of another dtype or device than its parameter";
  }
  bool contiguous = p.is_contiguous() && grad.is_contiguous();
  for (const auto& t : state) contiguous = contiguous && (!t.defined() || t.is_contiguous());
  if (!contiguous) return "a non-contiguous parameter, gradient or state (channels_last, a view)";
  return "";
}

// The float32 step counts the fused kernels read, one per device and step
// value (the kernels only read them, so parameters at the same step share one).
class StepCounts {
 public:
  const torch::Tensor& at(const torch::Device& device, int64_t step) {
    auto& t = counts_[{device.str(), step}];
    if (!t.defined()) {
      t = torch::full({}, static_cast<double>(step), torch::TensorOptions().dtype(torch::kFloat).device(device));
    }
    return t;
  }

 private:
  std::map<std::pair<std::string, int64_t>, torch::Tensor> counts_;
};

// The parameters of one fused call: one group (its options), device and
// dtype (and, for SGD, whether the momentum buffers are new), with the
// parameters' states whose step counts the call advances (Adam's).
template <class Options, class State>
struct FusedBucket {
  const Options* options = nullptr;
  std::vector<torch::Tensor> params, grads, first, second, third, steps;
  std::vector<State*> states;     // whose step counts are on the host
  std::vector<torch::Tensor> device_steps;  // the counts kept on the device (also in `steps`)
  torch::Tensor grad_scale;  // step_unscaling's scale on the bucket's device; undefined otherwise
  torch::Tensor found_inf;   // step_unscaling's found_inf there; undefined otherwise
  torch::Tensor increment;   // what device_steps advance by: 1 - found_inf, or 1
};

// Refuses step_unscaling for a parameter the fused kernel cannot take
// (`fusable`: the kernel choice lets it; `why`: fused_refusal's reason),
// before anything changes.
void check_unscaling(bool fusable, const std::string& why, const torch::Tensor& p, const char* optimizer) {
  if (fusable && why.empty()) return;
  TORCH_CHECK(false, "memfit::optim::", optimizer, "::step_unscaling: the fused kernel cannot take ",
              fusable ? why : "a parameter on " + p.device().str() + " under Kernel::kLoop or a LibTorch without "
                                                                      "fused kernels",
              ", so it cannot unscale its gradient: call GradScaler::unscale_ and then step() (can_unscale_in_kernel "
              "says which applies)");
}

// The loss scale of step_unscaling as float32 on `p`'s device.
torch::Tensor scale_on(const torch::Tensor& grad_scale, const torch::Tensor& p) {
  if (grad_scale.device() == p.device() && grad_scale.scalar_type() == torch::kFloat) return grad_scale.reshape({});
  return grad_scale.to(p.device(), torch::kFloat).reshape({});
}

// Sets the scale and found_inf for the next step and clears them when the
// step returns or throws.
class ScaleForStep {
 public:
  ScaleForStep(torch::Tensor& scale_slot, torch::Tensor& found_slot, const torch::Tensor& scale,
               const torch::Tensor& found_inf)
      : scale_slot_(scale_slot), found_slot_(found_slot) {
    TORCH_CHECK(scale.defined() && scale.numel() == 1, "step_unscaling needs a one-element scale tensor, got ",
                scale.defined() ? std::to_string(scale.numel()) + " elements" : std::string("an undefined tensor"));
    TORCH_CHECK(!found_inf.defined() || (found_inf.numel() == 1 && found_inf.scalar_type() == torch::kFloat),
                "step_unscaling needs found_inf as one float32 element (GradScaler's), got ", found_inf.numel(),
                " elements of ", found_inf.scalar_type());
    scale_slot_ = scale;
    found_slot_ = found_inf;
  }
  ~ScaleForStep() {
    scale_slot_ = torch::Tensor();
    found_slot_ = torch::Tensor();
  }
  ScaleForStep(const ScaleForStep&) = delete;
  ScaleForStep& operator=(const ScaleForStep&) = delete;

 private:
  torch::Tensor& scale_slot_;
  torch::Tensor& found_slot_;
};

// The step count a parameter keeps on the device, read back to the host (a sync).
int64_t read_step(const torch::Tensor& count) { return std::llround(count.item<double>()); }

// Writes the step counts kept on the device back into Adam's or AdamW's
// state and frees them.
template <class Base, class State>
void steps_to_host_of(Base& self, DeviceSteps& steps) {
  if (steps.empty()) return;
  auto& state = self.state();
  for (const auto& group : self.param_groups()) {
    for (const auto& p : group.params()) {
      const auto found = steps.find(p.unsafeGetTensorImpl());
      const auto s = state.find(compat::optimizer_state_key<Base>(p));
      if (found == steps.end() || s == state.end()) continue;
      static_cast<State&>(*s->second).step(read_step(found->second));
    }
  }
  steps.clear();
}

// Whether every parameter of `self` with a gradient would take the fused
// kernel; `state_of` gives a parameter's state tensors (empty before its first step).
template <class Base, class StateTensors>
bool all_fused(const Base& self, const std::function<bool(const torch::Tensor&)>& wants_fused,
               StateTensors state_of) {
  for (const auto& group : self.param_groups()) {
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (!wants_fused(p)) return false;
      const auto state = state_of(p);
      if (!fused_refusal(p, p.grad(), {state[0], state[1], state[2]}).empty()) return false;
    }
  }
  return true;
}

// What gives an Adam or AdamW parameter's state tensors (undefined before its first step).
template <class Base, class State>
auto adam_state_tensors(const Base& self) {
  return [&self](const torch::Tensor& p) -> std::array<torch::Tensor, 3> {
    const auto& st = self.state();
    const auto found = st.find(compat::optimizer_state_key<Base>(p));
    if (found == st.end()) return {};
    const auto& s = static_cast<const State&>(*found->second);
    return {s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()};
  };
}
using BucketKey = std::tuple<size_t, std::string, int, bool>;
BucketKey bucket_key(size_t group, const torch::Tensor& p, bool fresh = false) {
  return {group, p.device().str(), static_cast<int>(p.scalar_type()), fresh};
}

// Adam and AdamW: their update after the weight decay is one (LibTorch's
// adam.cpp and adamw.cpp); `decoupled` is AdamW's decay of the parameter
// itself, Adam's adds weight_decay * p to the gradient.
// Over 80 lines: one pass in LibTorch's order (groups, then parameters,
// each to its bucket and kernel) that pieces would split into a dozen
// shared locals; the kernels themselves are the helpers above.
template <class Base, class Options, class State, bool decoupled>
torch::Tensor adam_step(Base& self, Kernel& ran, const std::function<bool(const torch::Tensor&)>& wants_fused,
                        const std::function<void(const std::string&)>& fell_back,
                        const torch::optim::Optimizer::LossClosure& closure, const torch::Tensor& grad_scale,
                        const torch::Tensor& found_inf, DeviceSteps& device_steps) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss = closure_loss(closure);
  using Key = decltype(compat::optimizer_state_key<Base>(std::declval<torch::Tensor>()));
  struct Item {
    torch::Tensor p, grad;
    State* state = nullptr;
    const Options* options = nullptr;
    torch::Tensor beta1, beta2, eps, decay, bias2_sqrt;
    double step_size = 0;
  };
  std::vector<Item> items;
  std::map<BucketKey, FusedBucket<Options, State>> fused;
  std::vector<Key> added;
  std::vector<const c10::TensorImpl*> added_steps;
  Workspace work;
  StepCounts counts;
  auto& state = self.state();
  prepare_or_undo(state, added, [&] {
    size_t group_index = 0;
    for (auto& group : self.param_groups()) {
      const auto& o = static_cast<const Options&>(group.options());
      const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
      // Scalars by dtype, and sqrt(bias_correction2) by dtype and step.
      std::map<at::ScalarType, std::vector<torch::Tensor>> scalars;
      std::map<std::pair<at::ScalarType, int64_t>, torch::Tensor> bias2;
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        TORCH_CHECK(!p.grad().is_sparse(), decoupled ? "AdamW" : "Adam",
                    " does not support sparse gradients; use a dense gradient");
        const auto key = compat::optimizer_state_key<Base>(p);
        if (state.find(key) == state.end()) {
          auto s = std::make_unique<State>();
          s->step(0);
          s->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
          s->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
          if (o.amsgrad()) s->max_exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
          state[key] = std::move(s);
          added.push_back(key);
        }
        auto* s = static_cast<State*>(state[key].get());
        const bool fusable = wants_fused(p);
        const auto why =
            fusable ? fused_refusal(p, p.grad(), {s->exp_avg(), s->exp_avg_sq(), s->max_exp_avg_sq()}) : std::string();
        if (grad_scale.defined()) check_unscaling(fusable, why, p, decoupled ? "AdamW" : "Adam");
        auto on_device = device_steps.find(p.unsafeGetTensorImpl());
        if (fusable) {
          if (why.empty()) {
            auto& b = fused[bucket_key(group_index, p)];
            b.options = &o;
            if (grad_scale.defined() && !b.grad_scale.defined()) b.grad_scale = scale_on(grad_scale, p);
            if (found_inf.defined() && !b.found_inf.defined()) b.found_inf = scale_on(found_inf, p);
            if (found_inf.defined() && on_device == device_steps.end()) {
              // The kernel may skip on the device: the count moves there, to stay where it skips.
              const auto count = torch::full({}, static_cast<double>(s->step()),
                                             torch::TensorOptions().dtype(torch::kFloat).device(p.device()));
              on_device = device_steps.emplace(p.unsafeGetTensorImpl(), count).first;
              added_steps.push_back(p.unsafeGetTensorImpl());
            }
            if (on_device != device_steps.end()) {
              b.device_steps.push_back(on_device->second);
              b.steps.push_back(on_device->second);
            } else {
              b.states.push_back(s);
              b.steps.push_back(counts.at(p.device(), s->step() + 1));
            }
            b.params.push_back(p);
            b.grads.push_back(p.grad());
            b.first.push_back(s->exp_avg());
            b.second.push_back(s->exp_avg_sq());
            if (o.amsgrad()) b.third.push_back(s->max_exp_avg_sq());
            continue;
          }
          fell_back(why);
        }
        if (on_device != device_steps.end()) {
          // The loop reads the count on the host (a sync, only where a
          // parameter leaves the fused kernel after it skipped on the device).
          s->step(read_step(on_device->second));
          device_steps.erase(on_device);
        }
        const int64_t step = s->step() + 1;
        Item it;
        it.p = p;
        it.grad = p.grad();
        it.state = s;
        it.options = &o;
        const auto dtype = p.scalar_type();
        auto& sc = scalars[dtype];
        if (sc.empty()) {
          sc = {wrapped(beta1, dtype), wrapped(beta2, dtype), wrapped(o.eps(), dtype),
                decoupled ? wrapped(1 - o.lr() * o.weight_decay(), dtype) : torch::Tensor()};
        }
        it.beta1 = sc[0];
        it.beta2 = sc[1];
        it.eps = sc[2];
        it.decay = sc[3];
        const double bias_correction1 = 1 - std::pow(beta1, step);
        const double bias_correction2 = 1 - std::pow(beta2, step);
        auto& b2 = bias2[{dtype, step}];
        if (!b2.defined()) b2 = wrapped(std::sqrt(bias_correction2), dtype);
        it.bias2_sqrt = b2;
        it.step_size = o.lr() / bias_correction1;
        work.need(p, (!decoupled && o.weight_decay() != 0) ? 2 : 1);
        items.push_back(std::move(it));
      }
      ++group_index;
    }
    for (auto& kv : fused) {
      auto& b = kv.second;
      if (b.device_steps.empty()) continue;
      // As PyTorch's fused Adam, which adds 1 and takes found_inf back off: made here, so the update allocates nothing.
      b.increment = b.found_inf.defined() ? 1 - b.found_inf
                                          : torch::ones({}, b.device_steps.front().options());
    }
    work.allocate();
  }, &device_steps, added_steps);
  // Nothing below allocates: parameters and state change only here.
  for (auto& kv : fused) {
    auto& b = kv.second;
    const Options& o = *b.options;
    for (auto* s : b.states) s->step(s->step() + 1);
    if (!b.device_steps.empty()) compat::add_to_steps(b.device_steps, b.increment, 1);
    compat::fused_adam_(decoupled, b.params, b.grads, b.first, b.second, b.third, b.steps, o.lr(),
                        std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(), o.amsgrad(),
                        b.grad_scale, b.found_inf);
  }
  for (auto& it : items) {
    const Options& o = *it.options;
    auto& p = it.p;
    auto& s = *it.state;
    torch::Tensor grad = it.grad;
    if (decoupled && o.weight_decay() != 0) at::mul_out(p, p, it.decay);
    if (!decoupled && o.weight_decay() != 0) {
      auto decayed = work.view(p, 1);
      grad = at::add_out(decayed, grad, p, o.weight_decay());
    }
    s.step(s.step() + 1);
    auto& exp_avg = s.exp_avg();
    auto& exp_avg_sq = s.exp_avg_sq();
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    at::mul_out(exp_avg, exp_avg, it.beta1).add_(grad, 1 - beta1);
    at::mul_out(exp_avg_sq, exp_avg_sq, it.beta2).addcmul_(grad, grad, 1 - beta2);
    torch::Tensor second = exp_avg_sq;
    if (o.amsgrad()) {
      auto& max_exp_avg_sq = s.max_exp_avg_sq();
      torch::max_out(max_exp_avg_sq, exp_avg_sq, max_exp_avg_sq);
      second = max_exp_avg_sq;
    }
    auto denom = work.view(p, 0);
    at::sqrt_out(denom, second);
    at::div_out(denom, denom, it.bias2_sqrt);
    at::add_out(denom, denom, it.eps);
    p.addcdiv_(exp_avg, denom, -it.step_size);
  }
  if (!fused.empty() || !items.empty()) ran = items.empty() ? Kernel::kFused : Kernel::kLoop;
  return loss;
}

} // namespace

KernelChoice::KernelChoice(Kernel kernel) : kernel_(kernel) {
  TORCH_CHECK(kernel != Kernel::kFused || compat::kHasFusedOptimizers,
              "memfit::optim::Kernel::kFused needs LibTorch 2.4 or later, and this is LibTorch ", TORCH_VERSION,
              ": use Kernel::kAuto (the fastest kernel there is) or Kernel::kLoop");
}

bool KernelChoice::wants_fused(c10::DeviceType device) const {
  return kernel_ != Kernel::kLoop && has_fused_kernels(device);
}

void KernelChoice::fell_back(const std::string& optimizer, const std::string& why) {
  if (kernel_ == Kernel::kFused && !warned_) {
    warned_ = true;
    TORCH_WARN("memfit::optim::", optimizer, " steps ", why, " with the loop kernel: the fused kernel cannot take it");
  }
}

SGD::SGD(std::vector<torch::Tensor> params, torch::optim::SGDOptions defaults, Kernel kernel)
    : torch::optim::SGD(std::move(params), std::move(defaults)), KernelChoice(kernel) {}

SGD::SGD(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::SGDOptions defaults, Kernel kernel)
    : torch::optim::SGD(std::move(groups), std::move(defaults)), KernelChoice(kernel) {}

Adam::Adam(std::vector<torch::Tensor> params, torch::optim::AdamOptions defaults, Kernel kernel)
    : torch::optim::Adam(std::move(params), std::move(defaults)), KernelChoice(kernel) {}

Adam::Adam(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::AdamOptions defaults, Kernel kernel)
    : torch::optim::Adam(std::move(groups), std::move(defaults)), KernelChoice(kernel) {}

AdamW::AdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults, Kernel kernel)
    : torch::optim::AdamW(std::move(params), std::move(defaults)), KernelChoice(kernel) {}

AdamW::AdamW(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::AdamWOptions defaults, Kernel kernel)
    : torch::optim::AdamW(std::move(groups), std::move(defaults)), KernelChoice(kernel) {}

namespace {
// Whether `sgd`'s next step makes momentum buffers (a parameter with a
// gradient and momentum has none yet).
bool makes_momentum_buffers(torch::optim::SGD& sgd) {
  for (auto& group : sgd.param_groups()) {
    if (static_cast<const torch::optim::SGDOptions&>(group.options()).momentum() == 0) continue;
    for (auto& p : group.params()) {
      if (p.grad().defined() &&
          sgd.state().find(compat::optimizer_state_key<torch::optim::SGD>(p)) == sgd.state().end()) {
        return true;
      }
    }
  }
  return false;
}
} // namespace

// One function (about 110 lines): its two phases, everything allocated inside
// prepare_or_undo and then the update that allocates nothing, stay in view
// together, since that boundary is what makes the step a transaction.
torch::Tensor SGD::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss = closure_loss(closure);
  torch::Tensor found_inf = found_inf_;
  if (found_inf.defined() && makes_momentum_buffers(*this)) {
    // A skipped first step must leave no buffer (LibTorch's state), which
    // the kernel cannot decide: read found_inf here, once per new buffer set.
    if (found_inf.item<double>() != 0) return loss;
    found_inf = torch::Tensor();
  }
  using Key = decltype(compat::optimizer_state_key<torch::optim::SGD>(std::declval<torch::Tensor>()));
  struct Item {
    torch::Tensor p, grad, buf, momentum;
    const torch::optim::SGDOptions* options = nullptr;
    bool fresh = false;  // the buffer was made for this step: it is the first gradient already
  };
  std::vector<Item> items;
  std::map<BucketKey, FusedBucket<torch::optim::SGDOptions, torch::optim::SGDParamState>> fused;
  std::vector<Key> added;
  Workspace work;
  auto& st = state();
  prepare_or_undo(st, added, [&] {
    size_t group_index = 0;
    for (auto& group : param_groups()) {
      const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
      std::map<at::ScalarType, torch::Tensor> momentum;  // by dtype
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        const auto key = compat::optimizer_state_key<torch::optim::SGD>(p);
        const auto found = o.momentum() != 0 ? st.find(key) : st.end();
        const bool fresh = o.momentum() != 0 && found == st.end();
        const auto buf = o.momentum() != 0 && !fresh
                             ? static_cast<torch::optim::SGDParamState&>(*found->second).momentum_buffer()
                             : torch::Tensor();
        const bool fusable = wants_fused(p.device().type());
        const auto why = fusable ? fused_refusal(p, p.grad(), {buf}) : std::string();
        if (grad_scale_.defined()) check_unscaling(fusable, why, p, "SGD");
        if (fusable) {
          if (why.empty()) {
            auto& b = fused[bucket_key(group_index, p, fresh)];
            b.options = &o;
            if (grad_scale_.defined() && !b.grad_scale.defined()) b.grad_scale = scale_on(grad_scale_, p);
            if (found_inf.defined() && !b.found_inf.defined()) b.found_inf = scale_on(found_inf, p);
            b.params.push_back(p);
            b.grads.push_back(p.grad());
            if (fresh) {
              // The kernel fills a new buffer with the first (decayed) gradient, as LibTorch's clone does.
              auto s = std::make_unique<torch::optim::SGDParamState>();
              s->momentum_buffer(torch::empty_like(p.grad()));
              b.first.push_back(s->momentum_buffer());
              st[key] = std::move(s);
              added.push_back(key);
            } else if (o.momentum() != 0) {
              b.first.push_back(buf);
            }
            continue;
          }
          fell_back("SGD", why);
        }
        Item it;
        it.p = p;
        it.grad = p.grad().data();
        it.options = &o;
        if (o.momentum() != 0) {
          auto& m = momentum[p.scalar_type()];
          if (!m.defined()) m = wrapped(o.momentum(), p.scalar_type());
          it.momentum = m;
          if (fresh) {
            // LibTorch's first buffer: a clone of the (decayed) gradient.
            it.buf = o.weight_decay() != 0 ? it.grad.add(p.data(), o.weight_decay()) : torch::clone(it.grad);
            auto s = std::make_unique<torch::optim::SGDParamState>();
            s->momentum_buffer(it.buf);
            st[key] = std::move(s);
            added.push_back(key);
            it.fresh = true;
          } else {
            it.buf = static_cast<torch::optim::SGDParamState&>(*found->second).momentum_buffer();
          }
        }
        work.need(p, (o.weight_decay() != 0 ? 1 : 0) + (o.momentum() != 0 && o.nesterov() ? 1 : 0));
        items.push_back(std::move(it));
      }
      ++group_index;
    }
    work.allocate();
  });
  // Nothing below allocates: parameters and state change only here.
  for (auto& kv : fused) {
    auto& b = kv.second;
    const auto& o = *b.options;
    compat::fused_sgd_(b.params, b.grads, b.first, o.weight_decay(), o.momentum(), o.lr(), o.dampening(),
                       o.nesterov(), /*is_first_step=*/std::get<3>(kv.first), b.grad_scale, b.found_inf);
  }
  for (auto& it : items) {
    const auto& o = *it.options;
    auto p = it.p.data();
    torch::Tensor d_p = it.grad;
    int next = 0;
    if (o.weight_decay() != 0) {
      auto decayed = work.view(p, next++);
      d_p = at::add_out(decayed, d_p, p, o.weight_decay());
    }
    if (o.momentum() != 0) {
      if (!it.fresh) at::mul_out(it.buf, it.buf, it.momentum).add_(d_p, 1 - o.dampening());
      if (o.nesterov()) {
        auto ahead = work.view(p, next++);
        d_p = at::add_out(ahead, d_p, it.buf, o.momentum());
      } else {
        d_p = it.buf;
      }
    }
    p.add_(d_p, -1 * o.lr());
  }
  if (!fused.empty() || !items.empty()) ran_ = items.empty() ? Kernel::kFused : Kernel::kLoop;
  return loss;
}

torch::Tensor Adam::step(LossClosure closure) {
  return adam_step<torch::optim::Adam, torch::optim::AdamOptions, torch::optim::AdamParamState, false>(
      *this, ran_, [this](const torch::Tensor& p) { return wants_fused(p.device().type()); },
      [this](const std::string& why) { fell_back("Adam", why); }, closure, grad_scale_, found_inf_, device_steps_);
}

bool Adam::can_unscale_in_kernel() const {
  return all_fused(*this, [this](const torch::Tensor& p) { return wants_fused(p.device().type()); },
                   adam_state_tensors<torch::optim::Adam, torch::optim::AdamParamState>(*this));
}

torch::Tensor Adam::step_unscaling(const torch::Tensor& grad_scale, const torch::Tensor& found_inf) {
  ScaleForStep scale(grad_scale_, found_inf_, grad_scale, found_inf);
  return step();
}

void Adam::steps_to_host() { steps_to_host_of<torch::optim::Adam, torch::optim::AdamParamState>(*this, device_steps_); }

void Adam::save(torch::serialize::OutputArchive& archive) const {
  const_cast<Adam*>(this)->steps_to_host();  // the counts the state holds, not those it is behind
  torch::optim::Adam::save(archive);
}

void Adam::load(torch::serialize::InputArchive& archive) {
  torch::optim::Adam::load(archive);
  device_steps_.clear();
}

torch::Tensor AdamW::step(LossClosure closure) {
  return adam_step<torch::optim::AdamW, torch::optim::AdamWOptions, torch::optim::AdamWParamState, true>(
      *this, ran_, [this](const torch::Tensor& p) { return wants_fused(p.device().type()); },
      [this](const std::string& why) { fell_back("AdamW", why); }, closure, grad_scale_, found_inf_, device_steps_);
}

bool AdamW::can_unscale_in_kernel() const {
  return all_fused(*this, [this](const torch::Tensor& p) { return wants_fused(p.device().type()); },
                   adam_state_tensors<torch::optim::AdamW, torch::optim::AdamWParamState>(*this));
}

torch::Tensor AdamW::step_unscaling(const torch::Tensor& grad_scale, const torch::Tensor& found_inf) {
  ScaleForStep scale(grad_scale_, found_inf_, grad_scale, found_inf);
  return step();
}

void AdamW::steps_to_host() { steps_to_host_of<torch::optim::AdamW, torch::optim::AdamWParamState>(*this, device_steps_); }

void AdamW::save(torch::serialize::OutputArchive& archive) const {
  const_cast<AdamW*>(this)->steps_to_host();  // the counts the state holds, not those it is behind
  torch::optim::AdamW::save(archive);
}

void AdamW::load(torch::serialize::InputArchive& archive) {
  torch::optim::AdamW::load(archive);
  device_steps_.clear();
}

bool SGD::can_unscale_in_kernel() const {
  return all_fused(*this, [this](const torch::Tensor& p) { return wants_fused(p.device().type()); },
                   [this](const torch::Tensor& p) -> std::array<torch::Tensor, 3> {
                     const auto& st = state();
                     const auto found = st.find(compat::optimizer_state_key<torch::optim::SGD>(p));
                     if (found == st.end()) return {};
                     return {static_cast<const torch::optim::SGDParamState&>(*found->second).momentum_buffer(),
                             torch::Tensor(), torch::Tensor()};
                   });
}

torch::Tensor SGD::step_unscaling(const torch::Tensor& grad_scale, const torch::Tensor& found_inf) {
  ScaleForStep scale(grad_scale_, found_inf_, grad_scale, found_inf);
  return step();
}

namespace {
thread_local BeforeCommit* innermost_gate = nullptr;
} // namespace

BeforeCommit::BeforeCommit(std::function<void()> fn) : fn_(std::move(fn)), previous_(innermost_gate) {
  innermost_gate = this;
}

BeforeCommit::~BeforeCommit() { innermost_gate = previous_; }

void before_commit() {
  if (innermost_gate != nullptr && innermost_gate->fn_) innermost_gate->fn_();
}

const char* kernel_name(Kernel kernel) {
  switch (kernel) {
    case Kernel::kAuto:
      return "auto";
    case Kernel::kLoop:
      return "loop";
    case Kernel::kFused:
      return "fused";
  }
  return "auto";
}

Kernel parse_kernel(const std::string& name) {
  for (const auto k : {Kernel::kAuto, Kernel::kLoop, Kernel::kFused}) {
    if (name == kernel_name(k)) return k;
  }
  TORCH_CHECK(false, "unknown optimizer kernel '", name, "': use auto, loop or fused");
}

bool has_fused_kernels(c10::DeviceType device) {
  return compat::kHasFusedOptimizers && (device == c10::DeviceType::CPU || device == c10::DeviceType::CUDA);
}

std::string kernel_ran(const torch::optim::Optimizer& optimizer) {
  const auto* choice = dynamic_cast<const KernelChoice*>(&optimizer);
  if (choice == nullptr) return "libtorch";
  return choice->kernel_ran() == Kernel::kAuto ? "none" : kernel_name(choice->kernel_ran());
}

bool is_transactional(const torch::optim::Optimizer& optimizer) {
  return dynamic_cast<const SGD*>(&optimizer) != nullptr || dynamic_cast<const Adam*>(&optimizer) != nullptr ||
         dynamic_cast<const AdamW*>(&optimizer) != nullptr;
}

std::string state_type_name(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const AdamW*>(&optimizer) != nullptr) return "torch::optim::AdamW";
  if (dynamic_cast<const Adam*>(&optimizer) != nullptr) return "torch::optim::Adam";
  if (dynamic_cast<const SGD*>(&optimizer) != nullptr) return "torch::optim::SGD";
  return c10::demangle(typeid(optimizer).name());
}

namespace {
// The state bytes `o` will make for its parameters without state: `per` copies
// of each (the copies a group's options ask for).
template <class Optimizer, class Options>
int64_t lazy_bytes(const Optimizer& o, const std::function<int64_t(const Options&)>& per) {
  int64_t bytes = 0;
  auto& state = const_cast<Optimizer&>(o).state();
  for (const auto& group : o.param_groups()) {
    const auto& options = static_cast<const Options&>(group.options());
    for (const auto& p : group.params()) {
      if (state.find(compat::optimizer_state_key<Optimizer>(p)) == state.end()) {
        bytes += per(options) * static_cast<int64_t>(p.nbytes());
      }
    }
  }
  return bytes;
}
} // namespace

int64_t lazy_state_bytes(const torch::optim::Optimizer& optimizer) {
  if (const auto* a = dynamic_cast<const torch::optim::AdamW*>(&optimizer)) {
    return lazy_bytes<torch::optim::AdamW, torch::optim::AdamWOptions>(
        *a, [](const torch::optim::AdamWOptions& o) { return o.amsgrad() ? 3 : 2; });
  }
  if (const auto* a = dynamic_cast<const torch::optim::Adam*>(&optimizer)) {
    return lazy_bytes<torch::optim::Adam, torch::optim::AdamOptions>(
        *a, [](const torch::optim::AdamOptions& o) { return o.amsgrad() ? 3 : 2; });
  }
  if (const auto* a = dynamic_cast<const torch::optim::SGD*>(&optimizer)) {
    return lazy_bytes<torch::optim::SGD, torch::optim::SGDOptions>(
        *a, [](const torch::optim::SGDOptions& o) { return o.momentum() != 0 ? 1 : 0; });
  }
  return 0;
}

} // namespace optim
} // namespace memfit
