#include "step_components.h"

#include "memfit/state.h"
#include "memory_internal.h"

#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>

#include <fmt/format.h>

#include <cmath>
#include <memory>

namespace memfit {
namespace detail {

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target, bool sum) {
  auto l = logits.to(torch::kFloat);
  auto t = target;
  if (l.dim() > 2) {
    TORCH_CHECK(t.dim() == l.dim() - 1, "the model's output is ", l.sizes(), " but the labels are ", t.sizes(),
                ": per-token logits need a label per token");
    l = l.reshape({-1, l.size(-1)});
    t = t.reshape({-1});
  }
  namespace F = torch::nn::functional;
  return sum ? F::cross_entropy(l, t, F::CrossEntropyFuncOptions().reduction(torch::kSum)) : F::cross_entropy(l, t);
}

int64_t read_int(torch::serialize::InputArchive& a, const std::string& key, const std::string& what) {
  c10::IValue v;
  TORCH_CHECK(a.try_read(key, v) && v.isInt(), what, " is damaged: '", key, "' is missing");
  return v.toInt();
}

torch::Tensor read_tensor(torch::serialize::InputArchive& a, const std::string& key, const std::string& what) {
  torch::Tensor t;
  TORCH_CHECK(a.try_read(key, t), what, " is damaged: '", key, "' is missing");
  return t;
}

std::vector<double> RankVote::sum(double extra, double mine) {
  UntrackedGuard host;  // nothing after the all-reduce may fail on one rank only
  auto t = torch::zeros({group_.size() + 1}, torch::kDouble);
  t[0] = extra;
  t[group_.rank() + 1] = mine;
  group_.all_reduce_(t);
  const double* p = t.data_ptr<double>();
  return std::vector<double>(p, p + t.numel());
}

namespace {
// "ranks 1 and 3" for the slots of `flags` (after the first) that are set.
std::string ranks_set(const std::vector<double>& flags) {
  std::vector<std::string> ranks;
  for (size_t r = 1; r < flags.size(); ++r) {
    if (flags[r] != 0) ranks.push_back(std::to_string(r - 1));
  }
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    text += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + ranks[i];
  }
  return text;
}

// Whether any rank's slot is set.
bool any_rank(const std::vector<double>& flags) {
  for (size_t r = 1; r < flags.size(); ++r) {
    if (flags[r] != 0) return true;
  }
  return false;
}
} // namespace

double RankVote::reached(double loss, int64_t step) {
  const auto t = sum(loss, 0);
  if (!any_rank(t)) return t[0];
  announced_ = true;
  peer_failed_ = true;  // this rank voted "reached": another failed
  TORCH_CHECK_WITH(OutOfMemoryError, false, "step ", step, ": ", ranks_set(t), " of ", group_.size(),
                   " ran out of memory; every rank re-plans the step together");
}

void RankVote::failed() {
  if (std::exchange(announced_, true)) return;
  peer_failed_ = false;
  sum(0, 1);
}

std::string RankVote::agree(bool go_on, int64_t micro_batch_size) {
  announced_ = false;  // the next attempt starts with nothing announced
  const auto stop = sum(double(micro_batch_size), go_on ? 0 : 1);
  if (any_rank(stop)) return ranks_set(stop) + " of " + std::to_string(group_.size()) + " could not re-plan";
  if (stop[0] != double(micro_batch_size * group_.size())) {
    return "the ranks re-planned to different micro-batch sizes (options that differ between ranks?)";
  }
  return "";
}

void DataParallelStep::begin_step(StepState&) {
  reducing_ = true;
  ddp_.sync_buffers();
}

void DataParallelStep::before_backward(StepState& s) {
  // All-reduce during the last backward only (under a vote with NCCL, after it).
  if (!overlaps_ || !s.last_micro()) no_sync_.emplace(ddp_);
}

void DataParallelStep::after_backward(StepState&) { no_sync_.reset(); }

void DataParallelStep::finish_backward(StepState& s) {
  no_sync_.reset();
  if (vote_ != nullptr && overlaps_) {
    ddp_.finalize();  // a rank that failed has joined the buckets; the vote before the update averages the loss
    reducing_ = false;
    s.loss_pending = true;
    return;
  }
  double sum = 0;
  if (vote_ != nullptr) {
    ddp_.prepare();  // every bucket built: from here the all-reduce allocates nothing on the device
    sum = vote_->reached(s.loss_value, s.step);
    ddp_.finalize();
  } else {
    ddp_.finalize();
    torch::Tensor t;
    UntrackedGuard host;
    t = torch::tensor(s.loss_value, torch::kDouble);
    group_.all_reduce_(t);
    sum = t.item<double>();
  }
  reducing_ = false;
  s.loss_value = sum / double(group_.size());
}

void DataParallelStep::abort_step(StepState&) {
  no_sync_.reset();
  if (vote_ != nullptr) {
    try {
      // A rank that failed before its vote meets the others' buckets first.
      if (overlaps_ && std::exchange(reducing_, false)) ddp_.join();
    } catch (const std::exception& e) {
      TORCH_WARN("could not join the other ranks' all-reduce after a failed step: ", e.what());
    }
    ddp_.discard();
  }
  reducing_ = false;
}

bool VoteBeforeCommit::reach(StepState& s) {
  const double sum = vote_.reached(s.loss_pending ? s.loss_value : 0, s.step);
  if (!std::exchange(s.loss_pending, false)) return false;
  s.loss_value = sum / double(ranks_);
  return true;
}

void VoteBeforeCommit::vote(StepState& s) {
  voted_ = true;
  if (reach(s) && check_ != NonfiniteLoss::kUnchecked) check_finite_loss(s, check_, kSummedOverRanks);
}

void VoteBeforeCommit::finish_backward(StepState& s) {
  voted_ = false;
  gated_ = s.optimizer != nullptr && optim::is_transactional(*s.optimizer);
  // Skipping needs the averaged loss before the optimizer's step, and so does
  // an optimizer without a gate; a skipped step has no optimizer step to vote
  // in. The vote at the update follows all the same (after an optimizer
  // without a gate, where it catches what failed since).
  if (s.loss_pending && (!gated_ || check_ == NonfiniteLoss::kSkip || s.skip)) reach(s);
}

void VoteBeforeCommit::before_optimizer_step(StepState& s) {
  if (gated_) gate_.emplace([this, &s] { vote(s); });
}

void VoteBeforeCommit::after_optimizer_step(StepState& s) {
  gate_.reset();
  if (!voted_) vote(s);  // the step did not run (fp16's skipped step): the ranks still meet
}

bool PipelineStep::forward_backward(StepState& s) {
  TORCH_CHECK(s.example != nullptr, "a pipeline trains on torch::data::Example<> batches (data and target)");
  // Every stage gets the whole batch; the pipeline cuts it into chunks, and
  // the gradients of its mean loss land in each stage's parameters.
  const auto x = to_device(s.example->data, device_);
  const auto y = to_device(s.example->target, device_);
  // Autocast is thread-local: the stage's forwards (and recomputations) run here.
  AutocastGuard autocast(device_, precision_);
  const auto r = pipeline_.train_step(x, y, [](const torch::Tensor& out, const torch::Tensor& target) {
    return cross_entropy(out, target);  // in fp32, as without a pipeline
  });
  s.loss_value = r.loss;  // the same on every stage
  return true;
}

void PrecisionStep::before_forward(StepState&) { autocast_.emplace(device_, precision_); }

void PrecisionStep::after_forward(StepState&) { autocast_.reset(); }

bool PrecisionStep::optimizer_step(StepState& s) {
  auto r = scaler_.step_async(*s.optimizer);
  s.stepped = r.stepped;
  s.found_inf = std::move(r.found_inf);
  return true;
}

void PrecisionStep::save_state(torch::serialize::OutputArchive& a) {
  if (!scaler_.is_enabled()) return;
  torch::serialize::OutputArchive scaler;
  scaler_.save(scaler);
  a.write("grad_scaler", scaler);
}

std::function<void()> PrecisionStep::load_state(torch::serialize::InputArchive& a, const std::string& path) {
  auto scaler = std::make_shared<torch::serialize::InputArchive>();
  TORCH_CHECK(a.try_read("grad_scaler", *scaler) == scaler_.is_enabled(), path,
              scaler_.is_enabled() ? " holds no GradScaler, but this run scales the loss (fp16)"
                                   : " holds a GradScaler (fp16), but this run scales no loss",
              ": resume with the precision of the saved run");
  if (!scaler_.is_enabled()) return {};
  return [this, scaler] { scaler_.load(*scaler); };
}

void check_finite_loss(StepState& s, NonfiniteLoss mode, const char* where) {
  const double value = s.loss_value;
  if (std::isfinite(value)) return;
  TORCH_CHECK(mode == NonfiniteLoss::kSkip, "step ", s.step, " (epoch ", s.epoch, "): the loss", where, " is ",
              std::isnan(value) ? "NaN" : (value > 0 ? "inf" : "-inf"),
              "; lower the learning rate, clip gradients (TrainerOptions::max_grad_norm), "
              "or skip such steps (NonfiniteLoss::kSkip)");
  s.skip = true;
}

void NonfiniteCheck::finish_backward(StepState& s) {
  // A loss still pending is averaged and checked by the ranks' vote before the update.
  if (mode_ != NonfiniteLoss::kUnchecked && !s.loss_pending) check_finite_loss(s, mode_, ranks_ > 1 ? across_ : "");
}

void MasterWeightsStep::finish_backward(StepState& s) {
  if (!s.skip) master_.grads_to_master();
}

void MasterWeightsStep::before_optimizer_step(StepState&) {
  if (on_host_) host_.emplace();  // the optimizer steps on host copies
}

void MasterWeightsStep::end_step(StepState& s) {
  host_.reset();
  if (!s.skip) master_.master_to_model();
}

void MasterWeightsStep::save_state(torch::serialize::OutputArchive& a) {
  torch::serialize::OutputArchive masters;
  const auto& m = master_.master_parameters();
  for (size_t i = 0; i < m.size(); ++i) masters.write(fmt::format("m{}", i), m[i].detach());
  a.write("masters", masters);
}

std::function<void()> MasterWeightsStep::load_state(torch::serialize::InputArchive& a, const std::string& path) {
  torch::serialize::InputArchive masters;
  TORCH_CHECK(a.try_read("masters", masters), path, " holds no fp32 master weights, but this run keeps them: "
              "resume with the master-weights and optimizer-offload options of the saved run");
  const auto& m = master_.master_parameters();
  std::vector<torch::Tensor> saved;
  for (size_t i = 0; i < m.size(); ++i) {
    saved.push_back(read_tensor(masters, fmt::format("m{}", i), path));
    TORCH_CHECK(saved.back().sizes() == m[i].sizes(), path, " does not match the model: master ", i,
                " has another shape");
  }
  return [this, saved = std::move(saved)] {
    torch::NoGradGuard no_grad;
    const auto& m = master_.master_parameters();
    for (size_t i = 0; i < m.size(); ++i) const_cast<torch::Tensor&>(m[i]).copy_(saved[i]);
  };
}

void ClipStep::before_optimizer_step(StepState& s) {
  scaler_.unscale_(*s.optimizer);  // a no-op without fp16
  std::vector<torch::Tensor> params;
  for (const auto& group : s.optimizer->param_groups()) {
    params.insert(params.end(), group.params().begin(), group.params().end());
  }
  if (stages_ != nullptr) {
    clip_grad_norm_(params, max_norm_, *stages_);  // each stage holds its own parameters
  } else {
    torch::nn::utils::clip_grad_norm_(params, max_norm_);
  }
}

void StateRollback::begin_step(StepState&) {
  UntrackedGuard host;  // host copies, as a GPU run would hold them
  if (saved_.size() != buffers_.size()) {
    saved_.clear();
    for (const auto& b : buffers_) {
      saved_.push_back(torch::empty(b.sizes(), b.options().device(torch::kCPU).pinned_memory(b.is_cuda())));
    }
  }
  for (size_t i = 0; i < buffers_.size(); ++i) saved_[i].copy_(buffers_[i], /*non_blocking=*/true);
  rng_ = compat::get_rng_state(device_.is_cuda() ? std::vector<c10::DeviceIndex>{device_.index() < 0 ? c10::DeviceIndex(0) : device_.index()}
                                                : std::vector<c10::DeviceIndex>{});
}

void StateRollback::abort_step(StepState&) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < buffers_.size() && i < saved_.size(); ++i) {
    const_cast<torch::Tensor&>(buffers_[i]).copy_(saved_[i]);
  }
  compat::set_rng_state(rng_);
}

void OwnGradients::begin_step(StepState&) {
  aside_.assign(params_.size(), torch::Tensor());
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& g = params_[i].grad();
    kept_[i] = 0;
    if (!g.defined()) continue;
    const auto& z = zeroed_[i];
    if (!set_to_none_ && z.impl == g.unsafeGetTensorImpl() && z.version == g._version()) {
      kept_[i] = 1;  // its own
      continue;
    }
    aside_[i] = g;
    const_cast<torch::Tensor&>(params_[i]).mutable_grad() = torch::Tensor();
  }
}

void OwnGradients::release(size_t i) {
  auto& p = const_cast<torch::Tensor&>(params_[i]);
  if (!p.grad().defined()) return;
  if (set_to_none_) {
    p.mutable_grad() = torch::Tensor();
  } else {
    p.mutable_grad().detach_().zero_();
    zeroed_[i] = Zeroed{p.grad().unsafeGetTensorImpl(), p.grad()._version()};
  }
}

void OwnGradients::end_step(StepState&) {
  for (size_t i = 0; i < params_.size(); ++i) release(i);
  aside_.clear();  // other code's gradients took no part in the step
}

void OwnGradients::abort_step(StepState&) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = const_cast<torch::Tensor&>(params_[i]);
    if (kept_[i] != 0) {
      release(i);  // its own gradient is zero again, as the step found it
    } else {
      p.mutable_grad() = i < aside_.size() ? aside_[i] : torch::Tensor();
    }
  }
  aside_.clear();
}

void OptimizerStatePart::save_state(torch::serialize::OutputArchive& a) {
  if (layout_.zero == nullptr) {
    torch::serialize::OutputArchive optimizer;
    optimizer_.save(optimizer);
    a.write("optimizer", optimizer);
    return;
  }
  // Every rank sends rank 0 its shard; only rank 0's archive is written.
  const std::vector<std::string> shards = layout_.zero->consolidate_state_dict(0);
  torch::serialize::OutputArchive sharded;
  sharded.write("world", c10::IValue(static_cast<int64_t>(shards.size())));
  for (size_t r = 0; r < shards.size(); ++r) sharded.write("rank" + std::to_string(r), bytes_tensor(shards[r]));
  a.write("optimizer_shards", sharded);
}

std::function<void()> OptimizerStatePart::load_state(torch::serialize::InputArchive& a, const std::string& path) {
  torch::serialize::InputArchive unused;
  // (The masters themselves are MasterWeightsStep's part, when this run keeps
  // them.) Masters of float32 parameters, kept with state on the host, hold
  // the model's own values between steps: this run needs nothing of them.
  bool float32 = layout_.holder != nullptr;
  if (float32) {
    for (const auto& group : layout_.holder->param_groups()) {
      for (const auto& p : group.params()) float32 = float32 && p.scalar_type() == at::kFloat;
    }
  }
  TORCH_CHECK(layout_.masters || float32 || !a.try_read("masters", unused), path, " holds fp32 master weights, "
              "but this run keeps none: resume with the master-weights and optimizer-offload options of the saved run");
  auto optimizer = std::make_shared<torch::serialize::InputArchive>();
  torch::serialize::InputArchive sharded;
  const bool was_sharded = a.try_read("optimizer_shards", sharded);
  if (layout_.zero != nullptr) {
    TORCH_CHECK(was_sharded, path, " holds an unsharded optimizer, but this run shards it (zero_stage 1): "
                "resume with zero_stage 0 (no --zero-stage)");
    const int64_t saved_world = read_int(sharded, "world", path);
    TORCH_CHECK(saved_world == layout_.world, path, " holds the optimizer state of ", saved_world,
                " ranks (zero_stage 1), but this job has ", layout_.world,
                ": resume with the world size that saved it");
    const std::string rank = std::to_string(layout_.rank);
    load_archive(*optimizer, read_tensor(sharded, "rank" + rank, path),
                 path + "'s optimizer shard of rank " + rank);
  } else {
    TORCH_CHECK(!was_sharded, path, " holds optimizer state sharded over ranks (zero_stage 1): resume "
                "with zero_stage 1 (--zero-stage 1) and the world size that saved it");
    TORCH_CHECK(a.try_read("optimizer", *optimizer), path, " is damaged: 'optimizer' is missing");
  }
  return [this, optimizer] {
    optimizer_.load(*optimizer);
    place_state();
  };
}

// The loaded optimizer state is host memory; state that lives with the
// parameters moves to their device one tensor at a time. (With sharded
// state: this rank's shard, held by its local optimizer.)
void OptimizerStatePart::place_state() const {
  torch::optim::Optimizer* const holder = layout_.holder;
  for (size_t g = 0; holder != nullptr && g < holder->param_groups().size(); ++g) {
    for (const auto& p : holder->param_groups()[g].params()) {
      auto it = holder->state().find(compat::optimizer_state_key(p));
      if (it == holder->state().end()) continue;
      for_each_state_tensor(*it->second, [&](torch::Tensor& t) {
        if (layout_.on_host) {
          if (p.is_pinned() && !t.is_pinned()) t = t.pin_memory();
          return;
        }
        torch::Tensor moved = torch::empty(t.sizes(), t.options().device(p.device()));
        moved.copy_(t);
        t = moved;
      });
    }
  }
}

void Timeline::begin_step(StepState&) {
  timeline_.clear();
  model_grad_bytes_ = 0;
  meter_.emplace(device_);
}

namespace {
std::vector<torch::Tensor> grads(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  out.reserve(params.size());
  for (const auto& p : params) out.push_back(p.grad());
  return out;
}
} // namespace

void Timeline::after_backward(StepState& s) {
  model_grad_bytes_ = storage_bytes(grads(params_));
  mark(s.phase);
}

void Timeline::end_step(StepState& s) {
  mark("released");
  meter_.reset();
  skipped_ = s.skip;
}

void Timeline::mark(std::string phase) {
  // On CUDA a new meter resets the device's peak statistic, so the step's
  // peak is also the largest phase peak.
  PhaseMemory m;
  m.phase = std::move(phase);
  m.peak_bytes = meter_->peak();
  m.current_bytes = memory_allocated(device_);
  meter_.reset();
  auto g = grads(params_);
  if (masters_ != nullptr) {
    const auto masters = grads(masters_->master_parameters());
    g.insert(g.end(), masters.begin(), masters.end());
  }
  m.gradients = storage_bytes(g);
  m.optimizer_state = state_ != nullptr ? optimizer_state_bytes(*state_) : 0;
  timeline_.push_back(std::move(m));
  meter_.emplace(device_);
}

} // namespace detail
} // namespace memfit
