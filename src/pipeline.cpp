#include "memfit/pipeline.h"

#include "memfit/memory.h"
#include "memfit/profile.h"
#include "memfit/checkpoint.h"
#include "memfit/schedule.h"

#include <torch/autograd.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>

namespace memfit {

PipelineSchedule parse_pipeline_schedule(const std::string& name) {
  if (name == "gpipe") return PipelineSchedule::kGPipe;
  if (name == "1f1b") return PipelineSchedule::k1F1B;
  TORCH_CHECK(false, "unknown pipeline schedule '", name, "': expected gpipe or 1f1b");
}

PipelineCheckpoint parse_pipeline_checkpoint(const std::string& name) {
  if (name == "never") return PipelineCheckpoint::kNever;
  if (name == "except_last") return PipelineCheckpoint::kExceptLast;
  if (name == "always") return PipelineCheckpoint::kAlways;
  TORCH_CHECK(false, "unknown pipeline checkpoint '", name, "': expected never, except_last or always");
}

std::vector<int64_t> balance_by_cost(const std::vector<double>& costs, int64_t stages,
                                     const std::vector<bool>& trains) {
  const auto n = static_cast<int64_t>(costs.size());
  TORCH_CHECK(stages >= 1 && stages <= n, "balance_by_cost: cannot split ", n, " layers into ", stages,
              " non-empty stages; use between 1 and ", n, " stages");
  TORCH_CHECK(trains.empty() || static_cast<int64_t>(trains.size()) == n, "balance_by_cost: ", trains.size(),
              " trains flags for ", n, " layers; give one per layer, or none");
  // trained[i]: layers among the first i that have parameters to train.
  std::vector<int64_t> trained(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) trained[i + 1] = trained[i] + (trains.empty() || trains[i] ? 1 : 0);
  TORCH_CHECK(trained[n] >= stages, "balance_by_cost: only ", trained[n], " of the ", n,
              " layers have parameters to train, so ", stages, " stages would leave one with nothing to train; "
              "use at most ", trained[n], " stages");
  for (double c : costs) TORCH_CHECK(c >= 0 && std::isfinite(c), "balance_by_cost: a cost is ", c, "; costs must be finite and >= 0");
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: the least largest stage cost of the first i layers in k stages.
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int64_t>> cut(stages + 1, std::vector<int64_t>(n + 1, 0));
  best[0][0] = 0;
  for (int64_t k = 1; k <= stages; ++k) {
    for (int64_t i = k; i <= n; ++i) {
      for (int64_t j = k - 1; j < i; ++j) {  // the last stage holds layers j..i-1
        if (trained[i] == trained[j]) continue;  // nothing to train in it
        const double v = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (v < best[k][i]) {
          best[k][i] = v;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<int64_t> balance(stages);
  for (int64_t k = stages, i = n; k >= 1; --k) {
    balance[k - 1] = i - cut[k][i];
    i = cut[k][i];
  }
  return balance;
}

std::vector<int64_t> balance_by_time(const torch::nn::Sequential& model, const torch::Tensor& sample_input,
                                     int64_t stages) {
  return balance_by_profile(model, profile_chain(model, sample_input), stages);
}

std::vector<int64_t> balance_by_profile(const torch::nn::Sequential& model, const ChainProfile& profile,
                                        int64_t stages) {
  TORCH_CHECK(profile.layers.size() == model->size(), "balance_by_profile: the profile has ", profile.layers.size(),
              " layers but the model ", model->size(), "; profile this model (memfit::profile_chain)");
  std::vector<double> costs;
  for (const auto& layer : profile.layers) costs.push_back(layer.forward_seconds + layer.backward_seconds);
  std::vector<bool> trains;
  for (const auto& layer : model->children()) {
    const auto params = layer->parameters();
    trains.push_back(std::any_of(params.begin(), params.end(), [](const torch::Tensor& p) { return p.requires_grad(); }));
  }
  return balance_by_cost(costs, stages, trains);
}

struct Pipeline::Impl {
  std::shared_ptr<ProcessGroup> group;
  PipelineOptions options;
  torch::nn::Sequential stage;
  // The stage with its leading in-place layers plain and the rest checkpointed
  // (empty when the options never checkpoint or every layer is in place).
  CheckpointedSequential checkpointed{nullptr};
  std::vector<int64_t> balance;
  int64_t first = 0;
};

namespace {

constexpr int64_t kMaxDims = 8;

// A forward message: the header (dims, dtype, sizes), then the data.
torch::Tensor header_of(const torch::Tensor& t) {
  TORCH_CHECK(t.dim() <= kMaxDims, "Pipeline: a stage's output has ", t.dim(), " dimensions; at most ",
              kMaxDims, " can be sent");
  auto h = torch::zeros({kMaxDims + 2}, torch::kInt64);
  h[0] = t.dim();
  h[1] = static_cast<int64_t>(t.scalar_type());
  for (int64_t d = 0; d < t.dim(); ++d) h[d + 2] = t.size(d);
  return h;
}

// A host copy of `t` that stays valid while it is sent (its own storage).
torch::Tensor host_copy(const torch::Tensor& t) {
  UntrackedGuard untracked;  // in flight, not the stage's memory
  auto host = t.detach().to(torch::kCPU).contiguous();
  return host.data_ptr() == t.data_ptr() ? host.clone() : host;
}

// Sends `t` to `dst` as an activation: its header with `tag`, its data with
// tag + 1; the handles in `sends` finish them.
void send_activation(ProcessGroup& g, const torch::Tensor& t, int64_t dst, int64_t tag,
                     std::vector<ProcessGroup::Pending>& sends) {
  UntrackedGuard untracked;
  sends.push_back(g.send(header_of(t), dst, tag));
  sends.push_back(g.send(host_copy(t), dst, tag + 1));
}

// Receives what send_activation sent and returns it on `device`, counted as
// the stage's memory.
torch::Tensor recv_activation(ProcessGroup& g, int64_t src, int64_t tag, const torch::Device& device) {
  torch::Tensor host;
  {
    UntrackedGuard untracked;
    auto header = torch::empty({kMaxDims + 2}, torch::kInt64);
    g.recv_(header, src, tag);
    const auto* h = header.data_ptr<int64_t>();
    host = torch::empty(std::vector<int64_t>(h + 2, h + 2 + h[0]),
                        torch::TensorOptions().dtype(static_cast<c10::ScalarType>(h[1])));
    g.recv_(host, src, tag + 1);
  }
  auto x = host.to(device);
  return x.data_ptr() == host.data_ptr() ? x.clone() : x;
}

// Tags: three messages per chunk (header, activation, gradient); forward()'s
// two messages take tags no chunk has.
int64_t tag(int64_t chunk, int64_t kind) { return 3 * chunk + kind; }
constexpr int64_t kForwardTag = int64_t(1) << 30;

// A received activation as the output of an autograd node (not a leaf, so a
// stage may begin with an in-place layer), whose backward stores the
// activation's gradient in a slot: no copy of the activation.
struct ReceivedActivation : torch::autograd::Function<ReceivedActivation> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& anchor,
                               int64_t received, int64_t grad_slot) {
    (void)anchor;  // only links the output into the graph
    ctx->saved_data["slot"] = grad_slot;
    return *reinterpret_cast<const torch::Tensor*>(received);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    *reinterpret_cast<torch::Tensor*>(ctx->saved_data["slot"].toInt()) = grads[0];
    return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

} // namespace

Pipeline::Pipeline(torch::nn::Sequential model, std::shared_ptr<ProcessGroup> group, PipelineOptions options)
    : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(!model.is_empty() && model->size() > 0, "Pipeline needs a non-empty Sequential");
  TORCH_CHECK(group != nullptr, "Pipeline needs a process group");
  TORCH_CHECK(options.chunks() >= 1, "Pipeline: chunks must be >= 1, got ", options.chunks());
  const int64_t stages = group->size(), n = static_cast<int64_t>(model->size());
  TORCH_CHECK(stages <= n, "Pipeline: ", stages, " ranks need at least ", stages, " layers, the model has ", n,
              "; use fewer ranks");
  // Rank 0's balance, everywhere (timings differ between ranks).
  auto balance = options.balance();
  if (group->rank() == 0) {
    if (balance.empty()) {
      for (int64_t s = 0; s < stages; ++s) balance.push_back(n / stages + (s < n % stages ? 1 : 0));
    }
    TORCH_CHECK(static_cast<int64_t>(balance.size()) == stages, "Pipeline: balance has ", balance.size(),
                " entries for ", stages, " ranks; give one per rank");
    int64_t total = 0;
    for (int64_t b : balance) {
      TORCH_CHECK(b >= 1, "Pipeline: every stage needs at least one layer, the balance gives one ", b);
      total += b;
    }
    TORCH_CHECK(total == n, "Pipeline: the balance adds up to ", total, " layers, the model has ", n);
  }
  {
    UntrackedGuard host;
    auto shared = group->rank() == 0 ? torch::tensor(balance, torch::kInt64) : torch::zeros({stages}, torch::kInt64);
    group->broadcast_(shared, 0);
    balance.assign(shared.data_ptr<int64_t>(), shared.data_ptr<int64_t>() + stages);
  }
  impl_->group = std::move(group);
  impl_->options = options;
  impl_->options.balance(balance);
  impl_->balance = balance;
  const int64_t r = impl_->group->rank();
  for (int64_t s = 0; s < r; ++s) impl_->first += balance[s];
  // The stage's layers keep their names in the whole model ("fc1.weight").
  const auto names = model->named_children();
  auto it = model->begin() + impl_->first;
  for (int64_t i = impl_->first; i < impl_->first + balance[r]; ++i, ++it) {
    impl_->stage->push_back(names[i].key(), *it);
  }
  if (options.checkpoint() != PipelineCheckpoint::kNever) {
    CheckpointedSequential ck(impl_->stage);
    const int64_t layers = static_cast<int64_t>(impl_->stage->size());
    Schedule whole;
    whole.segments.push_back(Segment{0, layers, true, {Segment{0, layers, false, {}}}});
    whole = avoid_in_place_starts(whole, ck->in_place());
    if (whole.segments.back().checkpointed) {  // else every layer is in place
      ck->set_schedule(std::move(whole));
      impl_->checkpointed = ck;
    }
  }
}

Pipeline::~Pipeline() = default;
Pipeline::Pipeline(Pipeline&&) noexcept = default;
Pipeline& Pipeline::operator=(Pipeline&&) noexcept = default;

torch::nn::Sequential& Pipeline::stage() { return impl_->stage; }
int64_t Pipeline::first_layer() const { return impl_->first; }
const std::vector<int64_t>& Pipeline::balance() const { return impl_->balance; }
const PipelineOptions& Pipeline::options() const { return impl_->options; }

torch::Tensor Pipeline::forward(const torch::Tensor& input) {
  auto& g = *impl_->group;
  const int64_t s = g.rank(), stages = g.size();
  TORCH_CHECK(input.dim() >= 1 && input.size(0) > 0, "Pipeline::forward needs a non-empty batch");
  torch::NoGradGuard no_grad;
  const auto params = impl_->stage->parameters();
  const torch::Device device = params.empty() ? input.device() : params.front().device();
  const torch::Tensor x = s == 0 ? input.to(device) : recv_activation(g, s - 1, kForwardTag, device);
  torch::Tensor y = impl_->stage->forward(x);
  if (s == stages - 1) return y;
  std::vector<ProcessGroup::Pending> sends;
  send_activation(g, y, s + 1, kForwardTag, sends);
  for (auto& p : sends) p.wait();
  return torch::Tensor();
}

// Over 80 lines: the forward and backward closures share the chunks in
// flight, and the schedule at the end reads as GPipe's and 1F1B's papers
// draw them only with both beside it.
PipelineStepResult Pipeline::train_step(const torch::Tensor& input, const torch::Tensor& target,
                                        const LossFn& loss_fn) {
  auto& g = *impl_->group;
  const int64_t s = g.rank(), stages = g.size();
  const bool first = s == 0, last = s == stages - 1;
  TORCH_CHECK(input.dim() >= 1 && input.size(0) > 0, "Pipeline::train_step needs a non-empty batch");
  TORCH_CHECK(!last || (target.defined() && target.size(0) == input.size(0)), "Pipeline::train_step: the target has ",
              target.defined() ? target.size(0) : 0, " examples, the input ", input.size(0));
  TORCH_CHECK(!last || loss_fn != nullptr, "Pipeline::train_step needs a loss function");
  const int64_t batch = input.size(0);
  const int64_t micro = (batch + impl_->options.chunks() - 1) / impl_->options.chunks();
  const int64_t chunks = (batch + micro - 1) / micro;
  auto params = impl_->stage->parameters();
  const torch::Device device = params.empty() ? input.device() : params.front().device();

  struct Chunk {
    torch::Tensor out;                   // the stage's output (the last stage: the weighted loss)
    std::unique_ptr<torch::Tensor> grad;  // where the received input's gradient lands
    std::vector<int64_t> in_sizes;        // the received input's shape and dtype
    torch::TensorOptions in_options;
  };
  const auto anchor = torch::empty({0}, torch::requires_grad());
  std::vector<Chunk> live(static_cast<size_t>(chunks));
  std::vector<ProcessGroup::Pending> sends;
  int64_t in_flight = 0, max_in_flight = 0;
  double loss_sum = 0;

  auto forward = [&](int64_t m) {
    const int64_t len = std::min(micro, batch - m * micro);
    torch::Tensor x;
    std::unique_ptr<torch::Tensor> grad;
    if (first) {
      x = input.narrow(0, m * micro, len).to(device);
    } else {
      x = recv_activation(g, s - 1, tag(m, 0), device);
      if (torch::is_floating_point(x)) {
        grad = std::make_unique<torch::Tensor>();
        x = ReceivedActivation::apply(anchor, reinterpret_cast<int64_t>(&x), reinterpret_cast<int64_t>(grad.get()));
      }
    }
    const auto mode = impl_->options.checkpoint();
    const bool recompute = impl_->checkpointed &&
                           (mode == PipelineCheckpoint::kAlways || (mode == PipelineCheckpoint::kExceptLast && m < chunks - 1));
    torch::Tensor y = recompute ? impl_->checkpointed->forward(x) : impl_->stage->forward(x);
    if (last) {
      auto l = loss_fn(y, target.narrow(0, m * micro, len).to(device));
      if (len != batch) l = l * (double(len) / double(batch));
      loss_sum += l.item<double>();
      y = l;
    } else {
      send_activation(g, y, s + 1, tag(m, 0), sends);
    }
    live[m] = Chunk{y, std::move(grad), x.sizes().vec(), x.options().requires_grad(false)};
    max_in_flight = std::max(max_in_flight, ++in_flight);
  };

  auto backward = [&](int64_t m) {
    auto& c = live[m];
    if (last) {
      c.out.backward();
    } else {
      torch::Tensor host;
      {
        UntrackedGuard untracked;
        host = torch::empty(c.out.sizes(), c.out.options().device(torch::kCPU).requires_grad(false));
        g.recv_(host, s + 1, tag(m, 2));
      }
      c.out.backward(host.to(device));
    }
    if (c.grad) {
      // An input the stage did not use has a zero gradient.
      if (!c.grad->defined()) *c.grad = torch::zeros(c.in_sizes, c.in_options);
      sends.push_back(g.send(host_copy(*c.grad), s - 1, tag(m, 2)));
    }
    c = Chunk{};
    --in_flight;
  };

  if (impl_->options.schedule() == PipelineSchedule::kGPipe) {
    for (int64_t m = 0; m < chunks; ++m) forward(m);
    for (int64_t m = chunks; m-- > 0;) backward(m);
  } else {
    const int64_t warmup = std::min(stages - s - 1, chunks);
    for (int64_t m = 0; m < warmup; ++m) forward(m);
    for (int64_t m = warmup; m < chunks; ++m) {
      forward(m);
      backward(m - warmup);
    }
    for (int64_t m = chunks - warmup; m < chunks; ++m) backward(m);
  }
  for (auto& p : sends) p.wait();
  // The loss, from the last stage to every rank.
  torch::Tensor loss;
  {
    UntrackedGuard untracked;
    loss = torch::tensor(loss_sum, torch::kDouble);
    g.broadcast_(loss, stages - 1);
  }
  PipelineStepResult r;
  r.loss = loss.item<double>();
  r.max_in_flight = max_in_flight;
  return r;
}

} // namespace memfit
