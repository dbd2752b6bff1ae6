#include "memfit/stream.h"

#include "memfit/checkpoint.h"
#include "compat.h"
#include "memfit/schedule.h"

#include <ATen/ExpandUtils.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <string>
#include <unordered_set>

namespace memfit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t tile_rows(const torch::Tensor& weight, int64_t tile_bytes) {
  return linear_tile_rows(weight.size(0), weight.numel() * static_cast<int64_t>(weight.element_size()), tile_bytes);
}

// One streamed Linear: its weight's and bias' indices among the masters.
struct LinearState : torch::CustomClassHolder {
  MasterWeights* master = nullptr;
  size_t weight = 0;
  int64_t bias = -1;  // -1: none
  int64_t rows = 0;   // per tile
  int64_t out = 0;

  int64_t tiles() const { return (out + rows - 1) / rows; }
  const torch::Tensor& master_of(size_t i) const { return master->master_parameters()[i]; }

  // y = x W^T + b, the weight fetched tile by tile (as at::linear: addmm with a bias, mm without).
  torch::Tensor forward(const torch::Tensor& x) const {
    torch::NoGradGuard no_grad;
    auto tile = [&](int64_t begin, int64_t len) {
      const auto w = master->fetch(weight, begin, tiles() == 1 ? -1 : len);
      if (bias < 0) return x.mm(w.t());
      return at::addmm(master->fetch(static_cast<size_t>(bias), begin, tiles() == 1 ? -1 : len), x, w.t());
    };
    if (tiles() == 1) return tile(0, out);
    auto y = torch::empty({x.size(0), out}, x.options());
    for (int64_t begin = 0; begin < out; begin += rows) {
      const int64_t len = std::min(rows, out - begin);
      y.narrow(1, begin, len).copy_(tile(begin, len));
    }
    return y;
  }
};

struct StreamedLinearFunction : public torch::autograd::Function<StreamedLinearFunction> {
  // `always` is an empty tensor that requires grad, so that backward runs
  // (and the weight gets its gradient) also when x does not require grad.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<LinearState> state,
                               const torch::Tensor& x, const torch::Tensor& always) {
    (void)always;
    auto y = state->forward(x);
    ctx->save_for_backward({x});
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    auto state = c10::static_intrusive_pointer_cast<LinearState>(ctx->saved_data["state"].toCapsule());
    const auto& dy = grad_outputs[0];
    torch::NoGradGuard no_grad;
    const bool need_dx = ctx->needs_input_grad(0);  // edges count tensor inputs only: x
    const auto& weight = state->master_of(state->weight);
    const auto& bias = state->bias >= 0 ? state->master_of(static_cast<size_t>(state->bias)) : torch::Tensor();
    const bool grad_w = weight.requires_grad();
    const bool grad_b = bias.defined() && bias.requires_grad();
    // Tiles of the gradients this backward starts are copied, not added.
    const bool fresh_w = !weight.grad().defined();
    const bool fresh_b = bias.defined() && !bias.grad().defined();
    const bool tiled = state->tiles() > 1;
    torch::Tensor dx;
    for (int64_t begin = 0; begin < state->out; begin += state->rows) {
      const int64_t len = std::min(state->rows, state->out - begin);
      const auto dy_t = tiled ? dy.narrow(1, begin, len) : dy;
      if (need_dx) {  // as LibTorch's mm_mat1_backward: grad.mm(weight)
        const auto w = state->master->fetch(state->weight, begin, tiled ? len : -1);
        if (dx.defined()) {
          dx.addmm_(dy_t, w);
        } else {
          dx = dy_t.mm(w);
        }
      }
      if (grad_w) {  // as mm_mat2_backward for weight.t(): (grad.t().mm(input)), transposed twice
        detail::add_to_host_grad(weight, dy_t.t().mm(x), begin, fresh_w);
      }
      if (grad_b) {  // as addmm's bias gradient: summed to the bias' shape
        detail::add_to_host_grad(bias, at::sum_to(dy_t, c10::IntArrayRef(&len, 1)), begin, fresh_b);
      }
    }
    return {torch::Tensor(), dx, torch::Tensor()};
  }
};

} // namespace

// The layers of one chain (or of the Sequential form itself), as streamed.
struct StreamedChain {
  CheckpointedSequential checkpointed{nullptr};  // the chain whose layer runner streams them
  std::vector<torch::nn::AnyModule> layers;
  std::vector<StreamedLayer> kinds;
  std::vector<std::vector<size_t>> params;  // per layer: indices among the masters
  std::vector<c10::intrusive_ptr<LinearState>> linear;  // per layer (kLinear)
};

struct ParameterStream::Impl {
  torch::nn::Sequential model{nullptr};  // the Sequential form, or empty
  MasterWeights* master = nullptr;
  StreamOptions options;
  std::vector<StreamedChain> chains;
  std::vector<size_t> rest;  // a module's parameters outside its chains: on the device while held
  int64_t holds = 0;

  void fetch(const std::vector<size_t>& indices) {
    for (size_t i : indices) master->set_parameter_data(i, master->fetch(i));
  }
  void release(const std::vector<size_t>& indices) {
    for (size_t i : indices) master->set_parameter_data(i, torch::Tensor());
  }
};

namespace {

torch::Tensor run_streamed(const std::shared_ptr<ParameterStream::Impl>& impl, size_t c, int64_t index,
                           const torch::Tensor& x) {
  const auto i = static_cast<size_t>(index);
  auto& chain = impl->chains[c];
  TORCH_CHECK(impl->rest.empty() || impl->holds > 0, "ParameterStream: a chain ran while the parameters "
              "outside the chains were released: run the module's forward and backward inside "
              "ParameterStream::hold()");
  switch (chain.kinds[i]) {
    case StreamedLayer::kNone:
      return chain.layers[i].forward(x);
    case StreamedLayer::kLinear:
      if (x.dim() == 2) {
        if (!torch::autograd::GradMode::is_enabled()) return chain.linear[i]->forward(x);
        return StreamedLinearFunction::apply(chain.linear[i], x, torch::empty({0}, torch::requires_grad()))[0];
      }
      break;  // other shapes: as any layer
    case StreamedLayer::kRecompute:
      break;
  }
  // Fetched for the forward (which keeps only x) and released after it; in
  // backward fetched again, recomputed, and released once its backward ends.
  std::weak_ptr<ParameterStream::Impl> weak = impl;
  auto fn = [weak, c, i](const std::vector<torch::Tensor>& in) {
    auto s = weak.lock();
    TORCH_CHECK(s != nullptr, "ParameterStream: the stream was destroyed before this backward");
    auto& layer = s->chains[c];
    s->fetch(layer.params[i]);
    if (torch::autograd::GradMode::is_enabled()) return std::vector<torch::Tensor>{layer.layers[i].forward(in[0])};
    struct Release {
      ParameterStream::Impl& s;
      const std::vector<size_t>& params;
      ~Release() { s.release(params); }
    } release{*s, layer.params[i]};
    return std::vector<torch::Tensor>{layer.layers[i].forward(in[0])};
  };
  auto after = [weak, c, i] {
    if (auto s = weak.lock()) s->release(s->chains[c].params[i]);
  };
  return detail::checkpoint_impl(fn, {x}, CheckpointOptions(), after)[0];
}

// Maps `layers`' parameters to the masters and chooses how each runs.
StreamedChain streamed_chain(const std::vector<torch::nn::AnyModule>& layers, MasterWeights& master,
                             const StreamOptions& options) {
  StreamedChain chain;
  chain.layers = layers;
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto module = layers[l].ptr();
    std::vector<size_t> indices;
    for (const auto& p : module->parameters()) {
      const int64_t k = master.index_of(p);
      TORCH_CHECK(k >= 0, "ParameterStream: a parameter of layer ", l, " (", module->name(),
                  ") is not among the MasterWeights' parameters: build them over the same model");
      indices.push_back(static_cast<size_t>(k));
    }
    chain.params.push_back(indices);
    chain.linear.emplace_back();
    if (indices.empty()) {
      chain.kinds.push_back(StreamedLayer::kNone);
    } else if (auto lin = module->as<torch::nn::LinearImpl>()) {
      auto state = c10::make_intrusive<LinearState>();
      state->master = &master;
      state->weight = static_cast<size_t>(master.index_of(lin->weight));
      state->bias = lin->bias.defined() ? master.index_of(lin->bias) : -1;
      state->out = lin->weight.size(0);
      state->rows = tile_rows(lin->weight, options.tile_bytes());
      chain.linear.back() = state;
      chain.kinds.push_back(StreamedLayer::kLinear);
    } else {
      chain.kinds.push_back(StreamedLayer::kRecompute);
    }
  }
  return chain;
}

// Whether the parameter at path `name` lies inside one of `chains` (a chain
// that is the module itself holds them all).
bool in_a_chain(const std::string& name, const std::vector<FoundChain>& chains) {
  return std::any_of(chains.begin(), chains.end(), [&](const FoundChain& c) {
    return c.name.empty() || name.rfind(c.name + ".", 0) == 0;
  });
}

// Why a module with these `chains` (find_chains of it) cannot stream; empty when it can.
std::string refusal_of(const torch::nn::Module& module, const std::vector<FoundChain>& chains) {
  if (chains.empty()) {
    return c10::str("ParameterStream streams a module's chains block by block, but ", module.name(),
                    " holds no CheckpointedSequential: hold its repeated blocks in one, or keep the parameters "
                    "on the device (offload the optimizer state and gradients only)");
  }
  std::unordered_set<const c10::TensorImpl*> chained;
  for (const auto& found : chains) {
    const std::string name = found.name.empty() ? module.name() : found.name;
    if (found.chain->layer_runner()) {
      return c10::str("ParameterStream: chain ", name, " already runs its layers through a layer runner "
                      "(another ParameterStream, or a planner's probe): one at a time");
    }
    for (const auto& p : found.chain->parameters()) chained.insert(p.unsafeGetTensorImpl());
  }
  for (const auto& item : module.named_parameters()) {
    if (!in_a_chain(item.key(), chains) && chained.count(item.value().unsafeGetTensorImpl()) > 0) {
      return c10::str("ParameterStream: parameter ", item.key(), ", outside the chains, is shared with a chain's "
                      "layer (tied weights); streaming would release it under the other: untie it, or keep the "
                      "parameters on the device");
    }
  }
  return "";
}

void check_options(MasterWeights& master, const StreamOptions& options) {
  TORCH_CHECK(master.streamed(), "ParameterStream streams the parameters that MasterWeights released: "
              "build it with MasterWeightsOptions().dtype(kFloat).offload(kHost).gradients(kHost)"
              ".parameters(kHost)");
  TORCH_CHECK(options.tile_bytes() >= 0, "StreamOptions: tile_bytes must be >= 0 (0: no tiling), got ",
              options.tile_bytes());
}

void set_runners(const std::shared_ptr<ParameterStream::Impl>& impl) {
  std::weak_ptr<ParameterStream::Impl> weak = impl;
  for (size_t c = 0; c < impl->chains.size(); ++c) {
    if (!impl->chains[c].checkpointed) continue;
    impl->chains[c].checkpointed->set_layer_runner(
        [weak, c](int64_t i, torch::nn::AnyModule& m, const torch::Tensor& x) {
          auto locked = weak.lock();
          return locked ? run_streamed(locked, c, i, x) : m.forward(x);
        });
  }
}

void clear_runners(ParameterStream::Impl* impl) {
  if (impl == nullptr) return;
  for (auto& c : impl->chains) {
    if (c.checkpointed) c.checkpointed->set_layer_runner(nullptr);
  }
}

} // namespace

ParameterStream::ParameterStream(torch::nn::Sequential model, MasterWeights& master, StreamOptions options)
    : impl_(std::make_shared<Impl>()) {
  TORCH_CHECK(!model.is_empty() && model->size() > 0, "ParameterStream needs a non-empty Sequential");
  check_options(master, options);
  auto& s = *impl_;
  s.model = model;
  s.master = &master;
  s.options = options;
  torch::nn::Sequential layers = model;
  CheckpointedSequential checkpointed{nullptr};
  if (model->size() == 1) {
    if (auto ck = model->ptr(0)->as<CheckpointedSequentialImpl>()) {
      checkpointed = CheckpointedSequential(std::dynamic_pointer_cast<CheckpointedSequentialImpl>(model->ptr(0)));
      layers = ck->sequential();
    }
  }
  s.chains.push_back(streamed_chain({layers->begin(), layers->end()}, master, options));
  s.chains.back().checkpointed = checkpointed;
  size_t covered = 0;
  for (const auto& p : s.chains.back().params) covered += p.size();
  TORCH_CHECK(covered == master.model_parameters().size(), "ParameterStream: the MasterWeights hold ",
              master.model_parameters().size(), " parameters, but the model's layers have ", covered,
              ": build them over the same model");
  set_runners(impl_);
}

ParameterStream::ParameterStream(std::shared_ptr<torch::nn::Module> module, MasterWeights& master,
                                 StreamOptions options)
    : impl_(std::make_shared<Impl>()) {
  TORCH_CHECK(module != nullptr, "ParameterStream needs a module, got nullptr");
  check_options(master, options);
  auto& s = *impl_;
  s.master = &master;
  s.options = options;
  const auto chains = find_chains(*module);
  const std::string refused = refusal_of(*module, chains);
  TORCH_CHECK(refused.empty(), refused);
  std::vector<bool> in_chain(master.model_parameters().size(), false);
  for (const auto& found : chains) {
    const auto& seq = found.chain->sequential();
    s.chains.push_back(streamed_chain({seq->begin(), seq->end()}, master, options));
    s.chains.back().checkpointed = found.chain;
    for (const auto& layer : s.chains.back().params) {
      for (size_t i : layer) in_chain[i] = true;
    }
  }
  std::vector<bool> in_rest(in_chain.size(), false);
  for (const auto& item : module->named_parameters()) {
    if (in_a_chain(item.key(), chains)) continue;
    const int64_t k = master.index_of(item.value());
    TORCH_CHECK(k >= 0, "ParameterStream: parameter ", item.key(), " is not among the MasterWeights' "
                "parameters: build them over the same module");
    TORCH_INTERNAL_ASSERT(!in_chain[static_cast<size_t>(k)], "refusal() let a tied parameter through: ", item.key());
    if (!in_rest[static_cast<size_t>(k)]) {
      in_rest[static_cast<size_t>(k)] = true;
      s.rest.push_back(static_cast<size_t>(k));
    }
  }
  const size_t covered = static_cast<size_t>(std::count(in_chain.begin(), in_chain.end(), true)) + s.rest.size();
  TORCH_CHECK(covered == master.model_parameters().size(), "ParameterStream: the MasterWeights hold ",
              master.model_parameters().size(), " parameters, but the module has ", covered,
              ": build them over the same module");
  set_runners(impl_);
}

std::string ParameterStream::refusal(const torch::nn::Module& module) {
  return refusal_of(module, find_chains(module));
}

ParameterStream::~ParameterStream() { clear_runners(impl_.get()); }
ParameterStream::ParameterStream(ParameterStream&&) noexcept = default;
ParameterStream& ParameterStream::operator=(ParameterStream&& other) noexcept {
  if (this != &other) {
    clear_runners(impl_.get());
    impl_ = std::move(other.impl_);
  }
  return *this;
}

torch::Tensor ParameterStream::forward(const torch::Tensor& input) {
  TORCH_CHECK(impl_ != nullptr, "ParameterStream: used after a move");
  TORCH_CHECK(!impl_->model.is_empty(), "ParameterStream::forward runs the Sequential form; a stream over "
              "a module runs the module's own forward inside hold()");
  const auto autocast = compat::get_autocast_state();
  TORCH_CHECK(!autocast.cpu_enabled && !autocast.cuda_enabled,
              "ParameterStream runs in fp32: streamed parameters under autocast are not supported; "
              "leave the precision at fp32, or keep the parameters on the device");
  if (impl_->chains[0].checkpointed) return impl_->model->forward(input);
  torch::Tensor x = input;
  for (size_t i = 0; i < impl_->chains[0].layers.size(); ++i) x = run_streamed(impl_, 0, static_cast<int64_t>(i), x);
  return x;
}

ParameterStream::Hold ParameterStream::hold() {
  TORCH_CHECK(impl_ != nullptr, "ParameterStream: used after a move");
  if (impl_->rest.empty()) return Hold();
  if (impl_->holds++ == 0) impl_->fetch(impl_->rest);
  std::weak_ptr<Impl> weak = impl_;
  return Hold(std::shared_ptr<void>(impl_.get(), [weak](void*) {
    auto s = weak.lock();
    if (s && --s->holds == 0) s->release(s->rest);
  }));
}

size_t ParameterStream::chains() const { return impl_->chains.size(); }

int64_t ParameterStream::held_bytes() const {
  int64_t bytes = 0;
  for (size_t i : impl_->rest) {
    const auto& m = impl_->master->master_parameters()[i];
    bytes += m.numel() * static_cast<int64_t>(m.element_size());
  }
  return bytes;
}

StreamedLayer ParameterStream::layer_kind(size_t i, size_t chain) const {
  return impl_->chains.at(chain).kinds.at(i);
}

int64_t ParameterStream::tiles(size_t i, size_t chain) const {
  const auto& state = impl_->chains.at(chain).linear.at(i);
  return state ? state->tiles() : 0;
}

const StreamOptions& ParameterStream::options() const { return impl_->options; }

int64_t linear_tile_rows(int64_t rows, int64_t weight_bytes, int64_t tile_bytes) {
  if (tile_bytes <= 0 || weight_bytes <= tile_bytes || rows <= 0) return std::max<int64_t>(rows, 1);
  const int64_t row_bytes = std::max<int64_t>(weight_bytes / rows, 1);
  return std::clamp<int64_t>(tile_bytes / row_bytes, 1, rows);
}

int64_t streamed_bytes(const torch::nn::Module& layer, int64_t tile_bytes) {
  if (const auto* lin = layer.as<torch::nn::LinearImpl>()) {
    const int64_t rows = tile_rows(lin->weight, tile_bytes);
    const int64_t row_bytes = lin->weight.size(1) * static_cast<int64_t>(lin->weight.element_size());
    return rows * row_bytes + (lin->bias.defined() ? rows * static_cast<int64_t>(lin->bias.element_size()) : 0);
  }
  int64_t bytes = 0;
  for (const auto& p : layer.parameters()) bytes += p.numel() * static_cast<int64_t>(p.element_size());
  return bytes;
}

} // namespace memfit
