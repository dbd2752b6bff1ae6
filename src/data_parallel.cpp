#include "memfit/distributed.h"

#include "compat.h"

#include "memfit/memory.h"
#include "memfit/state.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>

// Data parallelism over a ProcessGroup (distributed.cpp): DDP's gradient
// buckets, ZeRO's sharded optimizer, and the collectives a Trainer's data
// parallelism uses; none of it reaches c10d directly.

namespace memfit {


// ---------------------------------------------------------------------------
// Data parallel

void broadcast_module_state(torch::nn::Module& module, ProcessGroup& group, int64_t root) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.parameters()) group.broadcast_(p, root);
  for (auto& b : module.buffers()) group.broadcast_(b, root);
}

double clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm, ProcessGroup& group) {
  TORCH_CHECK(max_norm > 0 && std::isfinite(max_norm), "clip_grad_norm_: max_norm must be a positive "
              "finite number, got ", max_norm);
  std::vector<torch::Tensor> norms;
  for (const auto& p : parameters) {
    if (p.grad().defined()) norms.push_back(p.grad().detach().norm(2).to(torch::kFloat));
  }
  torch::Tensor squared;
  {
    UntrackedGuard host;
    // As clip_grad_norm_: the norm of the per-parameter norms (in float,
    // then summed over the ranks in double).
    squared = norms.empty() ? torch::zeros({1}, torch::kDouble)
                            : torch::stack(norms).norm(2).pow(2).to(torch::kCPU, torch::kDouble).reshape({1});
  }
  group.all_reduce_(squared);
  const double total = std::sqrt(squared.item<double>());
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) {
    torch::NoGradGuard no_grad;
    for (const auto& p : parameters) {
      if (p.grad().defined()) p.grad().mul_(coef);
    }
  }
  return total;
}

namespace {

// Buckets of gradients, all-reduced in order as they fill.
class BucketedAllReduce : public GradientReducer {
 public:
  // `on_host`: the gradients live in host memory (offloaded), and so do the
  // buckets built from them.
  BucketedAllReduce(std::vector<torch::Tensor> params, std::shared_ptr<ProcessGroup> group,
                    int64_t cap_bytes, bool on_host)
      : params_(std::move(params)), group_(std::move(group)), on_host_(on_host) {
    // Reverse order: backward produces the last layer's gradients first.
    std::vector<size_t> current;
    int64_t bytes = 0;
    for (size_t i = params_.size(); i-- > 0;) {
      const int64_t b = params_[i].numel() * params_[i].element_size();
      if (!current.empty() && bytes + b > cap_bytes) {
        buckets_.push_back(std::move(current));
        current.clear();
        bytes = 0;
      }
      current.push_back(i);
      bytes += b;
    }
    if (!current.empty()) buckets_.push_back(std::move(current));
    bucket_of_.assign(params_.size(), 0);
    for (size_t b = 0; b < buckets_.size(); ++b) {
      for (size_t i : buckets_[b]) bucket_of_[i] = b;
    }
    reset();
  }

  void add(size_t index) override {
    TORCH_INTERNAL_ASSERT(index < params_.size());
    if (ready_[index]) return;  // a parameter used twice reports once
    ready_[index] = true;
    const size_t b = bucket_of_[index];
    if (--missing_[b] == 0) launch_ready();
    in_backward_launches_ = launched_;
  }

  void finalize() override {
    // Parameters without a gradient (unused in this forward) count as zeros,
    // so that every rank launches every bucket, in the same order.
    for (size_t b = launched_; b < buckets_.size(); ++b) {
      for (size_t i : buckets_[b]) {
        if (!ready_[i]) {
          ready_[i] = true;
          --missing_[b];
        }
      }
    }
    launch_ready();
    TORCH_INTERNAL_ASSERT(launched_ == buckets_.size());
    total_in_backward_ += static_cast<int64_t>(in_backward_launches_);
    const double world = static_cast<double>(group_->size());
    for (size_t b = 0; b < buckets_.size(); ++b) {
      pending_[b].wait();
      auto& flat = flats_[b];
      flat.div_(world);
      int64_t offset = 0;
      for (size_t i : buckets_[b]) {
        auto& p = params_[i];
        const int64_t n = p.numel();
        auto slice = flat.narrow(0, offset, n).view(p.sizes());
        torch::NoGradGuard no_grad;
        std::optional<UntrackedGuard> host;
        if (on_host_) host.emplace();
        if (p.grad().defined()) {
          p.mutable_grad().copy_(slice);
        } else {
          p.mutable_grad() = slice.to(p.device()).clone();
        }
        offset += n;
      }
      // Freed now: the process group's worker thread may hold the finished
      // all-reduce (and so this tensor) a little longer, past the optimizer
      // step's allocations on some steps and not on others.
      flat.storage().unsafeGetStorageImpl()->reset();
    }
    reset();
  }

  const std::vector<std::vector<size_t>>& buckets() const { return buckets_; }
  int64_t bytes_reduced() const { return bytes_reduced_; }
  int64_t launched_in_backward() const { return total_in_backward_; }

 private:
  void launch_ready() {
    while (launched_ < buckets_.size() && missing_[launched_] == 0) {
      torch::Tensor flat = flats_[launched_].defined() ? flats_[launched_] : build(launched_);
      bytes_reduced_ += flat.numel() * flat.element_size();
      pending_[launched_] = group_->all_reduce_async_(flat);
      flats_[launched_] = std::move(flat);
      ++launched_;
    }
  }

  // One bucket: its gradients (zeros for those without one) in one flat
  // tensor on the group's device.
  torch::Tensor build(size_t b) {
    const auto& bucket = buckets_[b];
    std::optional<UntrackedGuard> host;  // offloaded gradients: the bucket (and zeros) on the host too
    if (on_host_) host.emplace();
    std::vector<torch::Tensor> pieces;
    pieces.reserve(bucket.size());
    for (size_t i : bucket) {
      const auto& p = params_[i];
      const auto& g = p.grad();
      pieces.push_back(g.defined() ? g.detach().reshape({-1})
                                   : torch::zeros({p.numel()}, p.options().requires_grad(false)));
    }
    torch::Tensor flat = torch::cat(pieces);
    if (flat.device() != group_->device()) {
      UntrackedGuard staging;  // a staging copy (on the host for Gloo), not the model's memory
      flat = flat.to(group_->device());
    }
    return flat;
  }

 public:
  void prepare() {
    for (size_t b = launched_; b < buckets_.size(); ++b) {
      if (!flats_[b].defined()) flats_[b] = build(b);
    }
  }

  // Meets the other ranks' all-reduce of every bucket this step has not
  // launched, with a stand-in of its size on the group's device (the host for
  // Gloo), one at a time: the step is abandoned on every rank, so what is
  // summed does not matter.
  void join() {
    for (size_t b = launched_; b < buckets_.size(); ++b) {
      int64_t numel = 0;
      auto dtype = params_[buckets_[b].front()].scalar_type();
      for (size_t i : buckets_[b]) {
        numel += params_[i].numel();
        dtype = c10::promoteTypes(dtype, params_[i].scalar_type());  // as torch::cat's flat
      }
      UntrackedGuard stand_in;  // not the model's memory, as a staging copy is not
      auto t = torch::zeros({numel}, torch::TensorOptions(dtype).device(group_->device()));
      group_->all_reduce_async_(t).wait();
    }
    launched_ = buckets_.size();
  }

  void discard() noexcept {
    for (size_t b = 0; b < launched_; ++b) {
      try {
        pending_[b].wait();  // an all-reduce in flight finishes before its bucket goes
      } catch (...) {
      }
    }
    reset();
  }

 private:
  void reset() {
    ready_.assign(params_.size(), false);
    missing_.clear();
    for (const auto& b : buckets_) missing_.push_back(b.size());
    flats_.assign(buckets_.size(), torch::Tensor());
    pending_.clear();
    pending_.resize(buckets_.size());
    launched_ = 0;
    in_backward_launches_ = 0;
  }

  std::vector<torch::Tensor> params_;
  std::shared_ptr<ProcessGroup> group_;
  bool on_host_ = false;
  std::vector<std::vector<size_t>> buckets_;
  std::vector<size_t> bucket_of_;
  std::vector<bool> ready_;
  std::vector<size_t> missing_;
  std::vector<torch::Tensor> flats_;
  std::vector<ProcessGroup::Pending> pending_;
  size_t launched_ = 0;
  size_t in_backward_launches_ = 0;
  int64_t total_in_backward_ = 0;
  int64_t bytes_reduced_ = 0;
};

// Calls reducer->add(index) after autograd accumulated the parameter's
// gradient, when syncing.
struct ReadyHook : torch::autograd::FunctionPostHook {
  ReadyHook(size_t index, GradientReducer* reducer, const bool* sync)
      : index_(index), reducer_(reducer), sync_(sync) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (*sync_) reducer_->add(index_);
    return outputs;
  }
  size_t index_;
  GradientReducer* reducer_;
  const bool* sync_;
};

} // namespace

struct DistributedDataParallel::Impl {
  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<ProcessGroup> group;
  DistributedDataParallelOptions options;
  std::unique_ptr<BucketedAllReduce> reducer;
  std::vector<compat::NodePtr> accumulators;
  std::vector<uintptr_t> hook_keys;
  std::unique_ptr<bool> sync = std::make_unique<bool>(true);

  ~Impl() {
    for (size_t i = 0; i < accumulators.size(); ++i) accumulators[i]->del_post_hook(hook_keys[i]);
  }
};

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 DistributedDataParallelOptions options,
                                                 std::vector<torch::Tensor> gradient_holders)
    : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(module != nullptr, "DistributedDataParallel needs a module");
  TORCH_CHECK(group != nullptr, "DistributedDataParallel needs a process group");
  TORCH_CHECK(options.bucket_cap_mb() > 0, "bucket_cap_mb must be positive, got ",
              options.bucket_cap_mb(), " (PyTorch's default is 25)");
  impl_->module = std::move(module);
  impl_->group = std::move(group);
  impl_->options = options;
  if (options.init_sync()) broadcast_module_state(*impl_->module, *impl_->group);
  std::vector<torch::Tensor> trainable;
  for (const auto& p : impl_->module->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  TORCH_CHECK(!trainable.empty(), "DistributedDataParallel: the module has no parameter that requires grad");
  const auto cap = static_cast<int64_t>(options.bucket_cap_mb() * 1024 * 1024);
  const bool holders = !gradient_holders.empty();
  TORCH_CHECK(!holders || gradient_holders.size() == trainable.size(), "DistributedDataParallel: ",
              gradient_holders.size(), " gradient holders for ", trainable.size(),
              " trainable parameters; give one per trainable parameter, in order, or none");
  for (size_t i = 0; holders && i < trainable.size(); ++i) {
    TORCH_CHECK(gradient_holders[i].sizes() == trainable[i].sizes(), "DistributedDataParallel: gradient holder ",
                i, " is ", gradient_holders[i].sizes(), " but its parameter is ", trainable[i].sizes());
  }
  impl_->reducer = std::make_unique<BucketedAllReduce>(holders ? std::move(gradient_holders) : trainable,
                                                       impl_->group, cap, holders);
  for (size_t i = 0; i < trainable.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(trainable[i]);
    TORCH_INTERNAL_ASSERT(acc != nullptr);
    impl_->hook_keys.push_back(
        acc->add_post_hook(std::make_unique<ReadyHook>(i, impl_->reducer.get(), impl_->sync.get())));
    impl_->accumulators.push_back(std::move(acc));  // kept: autograd holds it weakly
  }
}

DistributedDataParallel::~DistributedDataParallel() = default;
DistributedDataParallel::DistributedDataParallel(DistributedDataParallel&&) noexcept = default;
DistributedDataParallel& DistributedDataParallel::operator=(DistributedDataParallel&&) noexcept = default;

void DistributedDataParallel::finalize() { impl_->reducer->finalize(); }

void DistributedDataParallel::prepare() { impl_->reducer->prepare(); }

void DistributedDataParallel::discard() { impl_->reducer->discard(); }

void DistributedDataParallel::join() { impl_->reducer->join(); }

void DistributedDataParallel::sync_buffers() {
  if (!impl_->options.broadcast_buffers() || impl_->group->size() == 1) return;
  torch::NoGradGuard no_grad;
  for (auto& b : impl_->module->buffers()) impl_->group->broadcast_(b, 0);
}

std::vector<std::vector<size_t>> DistributedDataParallel::buckets() const {
  return impl_->reducer->buckets();
}

int64_t DistributedDataParallel::bytes_reduced() const { return impl_->reducer->bytes_reduced(); }

int64_t DistributedDataParallel::buckets_launched_in_backward() const {
  return impl_->reducer->launched_in_backward();
}

DistributedDataParallel::NoSync::NoSync(DistributedDataParallel& ddp)
    : ddp_(ddp), previous_(*ddp.impl_->sync) {
  *ddp_.impl_->sync = false;
}

DistributedDataParallel::NoSync::~NoSync() { *ddp_.impl_->sync = previous_; }

// ---------------------------------------------------------------------------
// Sharded optimizer state (ZeRO stage 1)

namespace {
// The wrapper's options until the local optimizer's replace them (a rank
// that owns nothing keeps these).
struct NoOptions : torch::optim::OptimizerCloneableOptions<NoOptions> {};
} // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<torch::Tensor> params,
                                                 OptimizerFactory make_local,
                                                 std::shared_ptr<ProcessGroup> group)
    : torch::optim::Optimizer(params, std::make_unique<NoOptions>()),
      group_(std::move(group)) {
  TORCH_CHECK(group_ != nullptr, "ZeroRedundancyOptimizer needs a process group");
  TORCH_CHECK(make_local != nullptr, "ZeroRedundancyOptimizer needs a function that builds the local optimizer");
  TORCH_CHECK(!params.empty(), "ZeroRedundancyOptimizer got an empty parameter list");
  // PyTorch's partition: the largest parameters first, each to the rank with
  // the fewest bytes so far (ties: the lowest rank); a stable sort keeps
  // every rank's result the same.
  std::vector<size_t> by_size(params.size());
  for (size_t i = 0; i < by_size.size(); ++i) by_size[i] = i;
  auto bytes = [&](size_t i) { return params[i].numel() * static_cast<int64_t>(params[i].element_size()); };
  std::stable_sort(by_size.begin(), by_size.end(), [&](size_t a, size_t b) { return bytes(a) > bytes(b); });
  std::vector<int64_t> load(static_cast<size_t>(group_->size()), 0);
  owner_.assign(params.size(), 0);
  for (size_t i : by_size) {
    const auto r = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    owner_[i] = static_cast<int64_t>(r);
    load[r] += bytes(i);
  }
  std::vector<torch::Tensor> mine;
  for (size_t i = 0; i < params.size(); ++i) {
    if (owner_[i] == group_->rank()) mine.push_back(params[i]);
  }
  if (!mine.empty()) {
    local_ = make_local(std::move(mine));
    TORCH_CHECK(local_ != nullptr, "ZeroRedundancyOptimizer: the factory returned no optimizer");
    // The wrapper's options are the local optimizer's (lr and the others).
    defaults_ = local_->defaults().clone();
    param_groups_.front().set_options(local_->defaults().clone());
  }
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

torch::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (local_) loss = local_->step(closure);
  torch::NoGradGuard no_grad;
  const auto& params = param_groups_.front().params();
  for (size_t i = 0; i < params.size(); ++i) {
    auto p = params[i];
    group_->broadcast_(p, owner_[i]);
  }
  return loss;
}

void ZeroRedundancyOptimizer::save(torch::serialize::OutputArchive& archive) const {
  archive.write("zero_rank", c10::IValue(group_->rank()));
  archive.write("zero_world", c10::IValue(group_->size()));
  if (local_) {
    torch::serialize::OutputArchive shard;
    local_->save(shard);
    archive.write("shard", shard);
  }
}

void ZeroRedundancyOptimizer::load(torch::serialize::InputArchive& archive) {
  c10::IValue rank, world;
  TORCH_CHECK(archive.try_read("zero_rank", rank) && archive.try_read("zero_world", world) && rank.isInt() &&
                  world.isInt(),
              "ZeroRedundancyOptimizer::load: not a shard written by ZeroRedundancyOptimizer::save");
  TORCH_CHECK(world.toInt() == group_->size() && rank.toInt() == group_->rank(),
              "ZeroRedundancyOptimizer::load: the shard is rank ", rank.toInt(), "'s of ", world.toInt(),
              ", this is rank ", group_->rank(), " of ", group_->size(),
              ": resume with the world size and rank that saved it");
  torch::serialize::InputArchive shard;
  const bool has = archive.try_read("shard", shard);
  TORCH_CHECK(has == (local_ != nullptr), "ZeroRedundancyOptimizer::load: the shard ",
              has ? "holds" : "lacks", " optimizer state that this rank's partition ",
              has ? "lacks" : "holds");
  if (local_) local_->load(shard);
}

int64_t ZeroRedundancyOptimizer::owner(size_t index) const {
  TORCH_CHECK(index < owner_.size(), "ZeroRedundancyOptimizer::owner: index ", index,
              " is not a parameter index in [0, ", owner_.size(), ")");
  return owner_[index];
}

std::vector<int64_t> ZeroRedundancyOptimizer::owned_bytes() const {
  std::vector<int64_t> out(static_cast<size_t>(group_->size()), 0);
  const auto& params = param_groups_.front().params();
  for (size_t i = 0; i < params.size(); ++i) {
    out[static_cast<size_t>(owner_[i])] += params[i].numel() * static_cast<int64_t>(params[i].element_size());
  }
  return out;
}

torch::optim::Optimizer* ZeroRedundancyOptimizer::local_optimizer() const { return local_.get(); }

std::vector<std::string> ZeroRedundancyOptimizer::consolidate_state_dict(int64_t to) {
  TORCH_CHECK(to >= 0 && to < group_->size(), "consolidate_state_dict: rank ", to, " is not in [0, ",
              group_->size(), ")");
  UntrackedGuard host;  // serialized state is host bytes
  torch::serialize::OutputArchive a;
  save(a);
  std::vector<std::string> out;
  for (const auto& t : group_->gather(detail::bytes_tensor(detail::archive_bytes(a)), to)) {
    out.emplace_back(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()));
  }
  return out;
}

} // namespace memfit
