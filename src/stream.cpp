#include "memfit/stream.h"

#include "memfit/checkpoint.h"
#include "memfit/compat.h"
#include "memfit/schedule.h"

#include <ATen/ExpandUtils.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>

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

struct ParameterStream::Impl {
  torch::nn::Sequential model;
  CheckpointedSequential checkpointed{nullptr};  // the model's only layer, when it is one
  MasterWeights* master = nullptr;
  StreamOptions options;
  std::vector<torch::nn::AnyModule> layers;
  std::vector<StreamedLayer> kinds;
  std::vector<std::vector<size_t>> params;  // per layer: indices among the masters
  std::vector<c10::intrusive_ptr<LinearState>> linear;  // per layer (kLinear)

  void fetch(size_t layer) {
    for (size_t i : params[layer]) master->set_parameter_data(i, master->fetch(i));
  }
  void release(size_t layer) {
    for (size_t i : params[layer]) master->set_parameter_data(i, torch::Tensor());
  }
};

namespace {

torch::Tensor run_streamed(const std::shared_ptr<ParameterStream::Impl>& impl, int64_t index,
                           const torch::Tensor& x) {
  const auto i = static_cast<size_t>(index);
  switch (impl->kinds[i]) {
    case StreamedLayer::kNone:
      return impl->layers[i].forward(x);
    case StreamedLayer::kLinear:
      if (x.dim() == 2) {
        if (!torch::autograd::GradMode::is_enabled()) return impl->linear[i]->forward(x);
        return StreamedLinearFunction::apply(impl->linear[i], x, torch::empty({0}, torch::requires_grad()))[0];
      }
      break;  // other shapes: as any layer
    case StreamedLayer::kRecompute:
      break;
  }
  // Fetched for the forward (which keeps only x) and released after it; in
  // backward fetched again, recomputed, and released once its backward ends.
  std::weak_ptr<ParameterStream::Impl> weak = impl;
  auto fn = [weak, i](const std::vector<torch::Tensor>& in) {
    auto s = weak.lock();
    TORCH_CHECK(s != nullptr, "ParameterStream: the stream was destroyed before this backward");
    s->fetch(i);
    if (torch::autograd::GradMode::is_enabled()) return std::vector<torch::Tensor>{s->layers[i].forward(in[0])};
    struct Release {
      ParameterStream::Impl& s;
      size_t i;
      ~Release() { s.release(i); }
    } release{*s, i};
    return std::vector<torch::Tensor>{s->layers[i].forward(in[0])};
  };
  auto after = [weak, i] {
    if (auto s = weak.lock()) s->release(i);
  };
  return detail::checkpoint_impl(fn, {x}, CheckpointOptions(), after)[0];
}

} // namespace

ParameterStream::ParameterStream(torch::nn::Sequential model, MasterWeights& master, StreamOptions options)
    : impl_(std::make_shared<Impl>()) {
  TORCH_CHECK(!model.is_empty() && model->size() > 0, "ParameterStream needs a non-empty Sequential");
  TORCH_CHECK(master.streamed(), "ParameterStream streams the parameters that MasterWeights released: "
              "build it with MasterWeightsOptions().dtype(kFloat).offload(kHost).gradients(kHost)"
              ".parameters(kHost)");
  TORCH_CHECK(options.tile_bytes() >= 0, "StreamOptions: tile_bytes must be >= 0 (0: no tiling), got ",
              options.tile_bytes());
  auto& s = *impl_;
  s.model = model;
  s.master = &master;
  s.options = options;
  torch::nn::Sequential chain = model;
  if (model->size() == 1) {
    if (auto ck = model->ptr(0)->as<CheckpointedSequentialImpl>()) {
      s.checkpointed = CheckpointedSequential(std::dynamic_pointer_cast<CheckpointedSequentialImpl>(model->ptr(0)));
      chain = ck->sequential();
    }
  }
  s.layers.assign(chain->begin(), chain->end());
  size_t covered = 0;
  for (size_t l = 0; l < s.layers.size(); ++l) {
    const auto module = s.layers[l].ptr();
    std::vector<size_t> indices;
    for (const auto& p : module->parameters()) {
      const int64_t k = master.index_of(p);
      TORCH_CHECK(k >= 0, "ParameterStream: a parameter of layer ", l, " (", module->name(),
                  ") is not among the MasterWeights' parameters: build them over the same model");
      indices.push_back(static_cast<size_t>(k));
    }
    covered += indices.size();
    s.params.push_back(indices);
    s.linear.emplace_back();
    if (indices.empty()) {
      s.kinds.push_back(StreamedLayer::kNone);
    } else if (auto lin = module->as<torch::nn::LinearImpl>()) {
      auto state = c10::make_intrusive<LinearState>();
      state->master = &master;
      state->weight = static_cast<size_t>(master.index_of(lin->weight));
      state->bias = lin->bias.defined() ? master.index_of(lin->bias) : -1;
      state->out = lin->weight.size(0);
      state->rows = tile_rows(lin->weight, options.tile_bytes());
      s.linear.back() = state;
      s.kinds.push_back(StreamedLayer::kLinear);
    } else {
      s.kinds.push_back(StreamedLayer::kRecompute);
    }
  }
  TORCH_CHECK(covered == master.model_parameters().size(), "ParameterStream: the MasterWeights hold ",
              master.model_parameters().size(), " parameters, but the model's layers have ", covered,
              ": build them over the same model");
  if (s.checkpointed) {
    std::weak_ptr<Impl> weak = impl_;
    s.checkpointed->set_layer_runner([weak](int64_t i, torch::nn::AnyModule& m, const torch::Tensor& x) {
      auto locked = weak.lock();
      return locked ? run_streamed(locked, i, x) : m.forward(x);
    });
  }
}

ParameterStream::~ParameterStream() {
  if (impl_ && impl_->checkpointed) impl_->checkpointed->set_layer_runner(nullptr);
}
ParameterStream::ParameterStream(ParameterStream&&) noexcept = default;
ParameterStream& ParameterStream::operator=(ParameterStream&& other) noexcept {
  if (this != &other) {
    if (impl_ && impl_->checkpointed) impl_->checkpointed->set_layer_runner(nullptr);
    impl_ = std::move(other.impl_);
  }
  return *this;
}

torch::Tensor ParameterStream::forward(const torch::Tensor& input) {
  TORCH_CHECK(impl_ != nullptr, "ParameterStream: used after a move");
  const auto autocast = compat::get_autocast_state();
  TORCH_CHECK(!autocast.cpu_enabled && !autocast.cuda_enabled,
              "ParameterStream runs in fp32: streamed parameters under autocast are not supported; "
              "leave the precision at fp32, or keep the parameters on the device");
  if (impl_->checkpointed) return impl_->model->forward(input);
  torch::Tensor x = input;
  for (size_t i = 0; i < impl_->layers.size(); ++i) x = run_streamed(impl_, static_cast<int64_t>(i), x);
  return x;
}

StreamedLayer ParameterStream::layer_kind(size_t i) const { return impl_->kinds.at(i); }

int64_t ParameterStream::tiles(size_t i) const {
  const auto& state = impl_->linear.at(i);
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
