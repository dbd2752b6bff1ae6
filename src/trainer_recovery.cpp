#include "memfit/trainer.h"

#include "trainer_internal.h"

#include "compat.h"
#include "memfit/optim.h"
#include "memfit/stream.h"
#include "memory_internal.h"
#include "step_components.h"

#include <torch/optim.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

// Recovery from out-of-memory errors: the retried step, the re-plan, and
// moving the optimizer state between the device and the host (docs/recovery.md).

namespace memfit {

using detail::Clock;
using detail::seconds_since;

// One step, retried under a new plan while it runs out of memory and the
// policy finds settings (OnOutOfMemory::kReplan). Every failed attempt has
// left the state as the step found it (the components' abort_step).
StepRecord Trainer::run_step(const detail::StepInput& in) {
  TORCH_CHECK(in.examples > 0, "train_step needs a batch with examples, got an empty one");
  if (replanned_ && options_.restore_after() > 0 && clean_steps_ >= options_.restore_after()) {
    options_.micro_batch_size(first_micro_batch_);  // the limit may have lifted: try the first plan again
    restore_first_schedules_();
    bool state_back = true;
    try {
      move_state(first_offload_, first_offload_gradients_, first_offload_parameters_, first_stream_);
    } catch (const c10::OutOfMemoryError&) {
      state_back = false;  // no room on the device: the move changed nothing, and is tried again later
    }
    replanned_ = false;
    if (!state_back) {
      replanned_settings_ = settings_text() + ", " +
                            detail::on_host_text(options_.offload_gradients() == Offload::kHost,
                                                 options_.offload_parameters() == Offload::kHost);
      replanned_ = true;
    }
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
      const int64_t peak = meter->peak(), needed = detail::needed_bytes(*meter, e.what());
      meter.reset();
      if (!recover(e, in, attempt, peak, needed, seconds_since(start))) throw;
    }
  }
}

std::string Trainer::settings_text() const {
  if (replanned_) return replanned_settings_;
  const int64_t micro = options_.micro_batch_size();
  return micro > 0 ? "micro-batches of " + std::to_string(micro) : "no micro-batching";
}

namespace {

// The bytes no micro-batch can move: what the Trainer holds between steps
// (the parameters, their masters and the optimizer's state on the device)
// and one gradient per parameter (the largest only when they go to the
// host); of them, what moving the state, gradients and parameters takes off.
struct HeldBytes {
  int64_t fixed = 0, state = 0, grads = 0, params = 0, largest = 0, largest_grad = 0;
};

HeldBytes held_bytes(const TrainerOptions& o, torch::optim::Optimizer* state_optimizer, bool state_on_host,
                     const std::vector<torch::Tensor>& model_params, const MasterWeights* master) {
  HeldBytes b;
  b.fixed = memory_allocated(o.device());
  if (!state_on_host && state_optimizer != nullptr) {
    const int64_t lazy = optim::lazy_state_bytes(*state_optimizer);
    b.state = optimizer_state_bytes(*state_optimizer) + lazy;
    b.fixed += lazy;
  }
  for (const auto& p : model_params) {
    if (!p.requires_grad()) continue;
    b.largest_grad = std::max(b.largest_grad, int64_t(p.nbytes()));
    if (o.offload_gradients() != Offload::kHost) b.grads += int64_t(p.nbytes());
  }
  b.fixed += b.grads;
  for (const auto& p : (master ? master->master_parameters() : model_params)) {
    b.largest = std::max(b.largest, int64_t(p.nbytes()));
    if (o.offload_parameters() != Offload::kHost) b.params += int64_t(p.nbytes());
  }
  // Gradients that go to the host are made on the device first, one by one:
  // the largest is there beside parameters that are not streamed.
  if (o.offload_gradients() == Offload::kHost && o.offload_parameters() != Offload::kHost) b.fixed += b.largest_grad;
  return b;
}

// An event's bytes and placements: what the Trainer holds (`held`), where,
// and what it can move.
OutOfMemoryEvent placements_of(const TrainerOptions& o, const HeldBytes& held, bool may_offload, bool may_stream) {
  OutOfMemoryEvent e;
  e.micro_batch_size = o.micro_batch_size();
  e.fixed_bytes = held.fixed;
  e.state_bytes = held.state;
  e.gradient_bytes = held.grads;
  e.parameter_bytes = held.params;
  e.largest_parameter_bytes = held.largest;
  e.largest_gradient_bytes = held.largest_grad;
  e.stream = o.stream();
  e.offload_optimizer = o.offload_optimizer();
  e.offload_gradients = o.offload_gradients();
  e.offload_parameters = o.offload_parameters();
  e.may_offload_optimizer = may_offload;
  e.may_offload_parameters = may_stream;
  return e;
}

// Where a re-plan puts the state, gradients and parameters, and with which
// stream options; `moves` or `retiles` when that differs from `o`.
struct Placement {
  Offload state = Offload::kNone, grads = Offload::kNone, params = Offload::kNone;
  StreamOptions stream;
  bool moves = false, retiles = false;
};

// `next`'s placement, checked against what the Trainer can do (`may_offload`,
// `may_stream`, else why not: `refusal`); `failed` opens the errors.
Placement placement_of(const TrainerOptions& o, const std::optional<Replan>& next, bool may_offload,
                       bool may_stream, const std::string& refusal, const std::string& failed) {
  Placement t;
  t.state = next && next->offload_optimizer ? *next->offload_optimizer : o.offload_optimizer();
  t.grads = next && next->offload_gradients ? *next->offload_gradients : o.offload_gradients();
  t.params = next && next->offload_parameters ? *next->offload_parameters : o.offload_parameters();
  t.stream = next && next->stream ? *next->stream : o.stream();
  t.moves = next && (t.state != o.offload_optimizer() || t.grads != o.offload_gradients() ||
                     t.params != o.offload_parameters());
  t.retiles = next && t.stream.tile_bytes() != o.stream().tile_bytes();
  TORCH_CHECK_WITH(OutOfMemoryError, !t.moves || may_offload, failed, " and the re-plan moves the optimizer state "
                   "or gradients, which this Trainer cannot: it needs one process and the model's float32 parameters "
                   "stepped directly; return Replan::offload_optimizer and offload_gradients unset");
  TORCH_CHECK(!t.moves || t.grads == Offload::kNone || t.state == Offload::kHost,
              "Replan::offload_gradients Offload::kHost adds the gradients into host masters, which only a state "
              "on the host has: set Replan::offload_optimizer to Offload::kHost too");
  TORCH_CHECK(!t.moves || t.params == Offload::kNone || (t.grads == Offload::kHost && t.state == Offload::kHost),
              "Replan::offload_parameters Offload::kHost streams the parameters from host masters that also take "
              "the gradients and the optimizer state: set Replan::offload_optimizer and offload_gradients to "
              "Offload::kHost too");
  const bool streams = t.moves && t.params == Offload::kHost && o.offload_parameters() != Offload::kHost;
  TORCH_CHECK_WITH(OutOfMemoryError, !streams || may_stream, failed, " and the re-plan streams the parameters, "
                   "which this Trainer cannot: ", refusal, "; return Replan::offload_parameters unset");
  TORCH_CHECK(t.stream.tile_bytes() >= 0, "Replan::stream: tile_bytes must be >= 0 (0: no tiling), got ",
              t.stream.tile_bytes());
  TORCH_CHECK(!t.retiles || t.params == Offload::kHost, "Replan::stream tiles streamed parameters only: set "
              "Replan::offload_parameters to Offload::kHost too, or leave Replan::stream unset");
  return t;
}

// The recovery's one line: from the rank that failed, or from one that a
// vote told of another's failure.
void warn_recovered(const Recovery& r, const std::string& what, bool peer_failed) {
  if (peer_failed) {
    TORCH_WARN(what, ": re-planned from ", r.before, " to ", r.after, " and run again (",
               fmt::format("{:.3f}", r.seconds), " s lost)");
  } else {
    TORCH_WARN("step ", r.step, " ran out of memory at ", format_bytes(r.peak_bytes), " under ",
               format_bytes(r.limit_bytes), " with ", r.before, "; re-planned to ", r.after, " and run again (",
               fmt::format("{:.3f}", r.seconds), " s lost)");
  }
}

} // namespace

// After a failed attempt: true to run the step again under the policy's
// settings; false to let the error propagate (kThrow). Gives up with one
// line naming what was tried and the closest peak.
bool Trainer::recover(const c10::OutOfMemoryError& e, const detail::StepInput& in, int64_t attempt, int64_t peak,
                      int64_t needed, double seconds) {
  if (options_.on_out_of_memory() != OnOutOfMemory::kReplan) return false;
  const auto replan_start = Clock::now();
  const std::string what = compat::first_line(e.what_without_backtrace());
  const bool committing = std::exchange(committing_, false), committed = std::exchange(committed_, false);
  TORCH_CHECK_WITH(OutOfMemoryError, !committed, "step ", step_ + 1, " ran out of memory after its optimizer step "
                   "had changed the parameters (", what, "): a step is not run twice; raise the budget");
  TORCH_CHECK_WITH(OutOfMemoryError, !committing || optim::is_transactional(*optimizer_), "step ", step_ + 1,
                   " ran out of memory inside the optimizer's step, which may have changed some parameters "
                   "already (", what, "): recovery needs an optimizer whose step completes or changes nothing "
                   "(OptimizerKind, memfit::optim)");
  if (vote_) vote_->failed();  // the other ranks learn it at their next vote, and recover too
  empty_cache(options_.device());
  const int64_t budget = memory_budget(options_.device());
  const HeldBytes held =
      held_bytes(options_, state_optimizer(), state_on_host(), module_->parameters(), master_.get());
  const int64_t fixed = held.fixed, state = held.state, grads = held.grads, params = held.params;
  const std::string refusal = stream_refusal();  // why the parameters cannot be streamed ("": they can)
  const bool may_offload = may_offload_optimizer(), may_stream = refusal.empty();
  const int64_t movable = (may_offload ? state + grads : 0) + (may_stream ? params : 0);
  const bool fits = budget <= 0 || fixed - movable <= budget;
  if (vote_ && !fits) vote_->agree(false, 0);  // every rank stops
  TORCH_CHECK_WITH(OutOfMemoryError, fits, "step ", step_ + 1, " ran out of memory: ",
                   "the budget ", format_bytes(budget), " is smaller than the bytes no re-plan can move (",
                   format_bytes(fixed - movable),
                   may_stream    ? ": what the Trainer holds with everything streamed from the host"
                   : may_offload ? ": the parameters, the optimizer's state and gradients moved off"
                                 : ": parameters, their gradients and the optimizer's state",
                   "): raise the budget, or ",
                   may_stream    ? "use a smaller model"
                   : may_offload ? "stream the parameters from the host (TrainerOptions::offload_parameters; "
                                   "not here: " + refusal + ")"
                                 : "move the optimizer state and gradients to the host "
                                   "(TrainerOptions::offload_optimizer and offload_gradients)");
  OutOfMemoryEvent event = placements_of(options_, held, may_offload, may_stream);
  event.step = step_ + 1;
  event.attempt = attempt;
  event.examples = in.examples;
  event.peak_bytes = peak;
  // Ranks' needs differ, and their policies must answer alike: none is given.
  event.needed_bytes = vote_ ? 0 : needed;
  event.phase = phase_;
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
  const Placement to = placement_of(options_, next, may_offload, may_stream, refusal,
                                    "step " + std::to_string(step_ + 1) + " ran out of memory (" + what + ") with " +
                                        r.before);
  if (next) {
    if (to.moves || to.retiles) move_state(to.state, to.grads, to.params, to.stream);
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
  warn_recovered(r, what, vote_ && vote_->peer_failed());
  return true;
}

namespace {

// Whether `optimizer`'s state is of a kind whose tensors memfit can move
// (detail::for_each_state_tensor knows them).
bool state_can_move(const torch::optim::Optimizer& optimizer) {
  return dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr ||
         dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr ||
         dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr ||
         dynamic_cast<const torch::optim::Adagrad*>(&optimizer) != nullptr ||
         dynamic_cast<const torch::optim::RMSprop*>(&optimizer) != nullptr;
}

} // namespace

bool Trainer::may_offload_optimizer() const {
  if (options_.process_group() != nullptr || pipeline_ || zero_ != nullptr ||
      options_.master_weights() != MasterWeightsMode::kNone || optimizer_ == nullptr ||
      !state_can_move(*optimizer_)) {
    return false;
  }
  for (const auto& p : module_->parameters()) {
    if (p.scalar_type() != at::kFloat) return false;
  }
  return true;
}

// Why the parameters cannot be streamed at a re-plan ("" when they can, or
// already are): streaming runs in fp32 through the Sequential form or the
// module's chains (ParameterStream::refusal).
std::string Trainer::stream_refusal() const {
  if (stream_) return "";
  if (!may_offload_optimizer()) return "the optimizer state cannot move to the host";
  if (options_.precision() != Precision::kFP32) return "parameters are streamed in fp32 only";
  return classifier_ ? std::string() : ParameterStream::refusal(*module_);
}

bool Trainer::may_offload_parameters() const { return stream_refusal().empty(); }

namespace {

// Points `optimizer` from the tensors `now` to `next` (by model parameter)
// and moves their state with them: to host memory (`to_host`) or next to
// `next`; kept where it is (`keep`) when only the gradients or parameters
// move. All copies are made before the optimizer changes.
void move_optimizer_state(torch::optim::Optimizer& optimizer, const std::vector<torch::Tensor>& now,
                          const std::vector<torch::Tensor>& next, bool to_host, bool keep) {
  std::unordered_map<const c10::TensorImpl*, size_t> index;
  for (size_t i = 0; i < now.size(); ++i) index[now[i].unsafeGetTensorImpl()] = i;
  struct Move {
    torch::Tensor* slot;  // the optimizer's parameter
    torch::Tensor to;
    std::unique_ptr<torch::optim::OptimizerParamState> state;  // its state next to `to`, if it has any
  };
  std::vector<Move> moves;
  auto& state = optimizer.state();
  {
    std::optional<UntrackedGuard> host;
    if (to_host) host.emplace();
    for (auto& group : optimizer.param_groups()) {
      for (auto& p : group.params()) {
        const auto i = index.find(p.unsafeGetTensorImpl());
        TORCH_INTERNAL_ASSERT(i != index.end(), "the optimizer steps a tensor that is not the model's");
        Move m{&p, next[i->second], nullptr};
        const auto found = state.find(compat::optimizer_state_key(p));
        if (found != state.end()) {
          m.state = found->second->clone();
          detail::for_each_state_tensor(*m.state, [&](torch::Tensor& t) {
            if (keep) return;
            auto moved = torch::empty(t.sizes(), t.options().device(m.to.device()).pinned_memory(m.to.is_pinned()));
            moved.copy_(t);
            t = moved;
          });
        }
        moves.push_back(std::move(m));
      }
    }
  }
  for (auto& m : moves) {
    state.erase(compat::optimizer_state_key(*m.slot));
    *m.slot = m.to;
    if (m.state) state[compat::optimizer_state_key(m.to)] = std::move(m.state);
  }
}

} // namespace

// Moves the optimizer's state to the host with float32 host masters
// (Offload::kHost), or back next to the model's parameters (kNone), with
// the gradients (`gradients` kHost: into the host masters as backward makes
// them) and the parameters (`parameters` kHost: streamed from the masters
// with the stream options `tiles`), between steps. The optimizer stays the same object (an LR scheduler holds
// it): its parameters become the masters (or the model's again) and its
// state moves with them. What can run out of memory (the state's copies on
// the device, the parameters' when the stream ends) is made before anything
// changes, so such a failure changes nothing.
void Trainer::move_state(Offload where, Offload gradients, Offload parameters, const StreamOptions& tiles) {
  const bool retiles = parameters == Offload::kHost && tiles.tile_bytes() != options_.stream().tile_bytes();
  if (where == options_.offload_optimizer() && gradients == options_.offload_gradients() &&
      parameters == options_.offload_parameters()) {
    if (retiles) {  // the same masters, streamed in other tiles
      const auto streamed = [&](const StreamOptions& o) {
        return classifier_ ? std::make_shared<ParameterStream>(classifier_, *master_, o)
                           : std::make_shared<ParameterStream>(module_, *master_, o);
      };
      stream_.reset();  // its runners go from the chains before the new stream's come
      try {
        stream_ = streamed(tiles);
      } catch (...) {
        stream_ = streamed(options_.stream());  // the old tiles again, as built before on these masters
        throw;
      }
      options_.stream(tiles);
      rebuild_after_move();
    }
    return;
  }
  TORCH_INTERNAL_ASSERT(may_offload_optimizer());
  TORCH_INTERNAL_ASSERT(gradients == Offload::kNone || where == Offload::kHost);
  TORCH_INTERNAL_ASSERT(parameters == Offload::kNone || gradients == Offload::kHost);
  if (auto* k = dynamic_cast<optim::KernelChoice*>(optimizer_.get())) k->steps_to_host();
  const std::vector<torch::Tensor> model_params = module_->parameters();
  // Leaving the stream: the parameters' values on the device, from their masters.
  std::vector<torch::Tensor> whole;
  if (stream_ && parameters != Offload::kHost) {
    torch::NoGradGuard no_grad;
    for (const auto& m : master_->master_parameters()) {
      whole.push_back(torch::empty(m.sizes(), m.options().device(options_.device()).pinned_memory(false)));
      whole.back().copy_(m);
    }
    if (where == Offload::kHost) {  // the new masters copy the parameters' values
      for (size_t i = 0; i < model_params.size(); ++i) model_params[i].set_data(whole[i]);
    }
  }
  std::unique_ptr<MasterWeights> master;
  std::shared_ptr<ParameterStream> stream;
  if (where == Offload::kHost) {  // the model's fp32 values: the old masters' too (copied after every step)
    master = std::make_unique<MasterWeights>(*module_, MasterWeightsOptions()
                                                           .dtype(at::kFloat)
                                                           .offload(Offload::kHost)
                                                           .gradients(gradients)
                                                           .parameters(parameters)
                                                           .stream_to(options_.device()));
    if (master->streamed()) {
      stream = classifier_ ? std::make_shared<ParameterStream>(classifier_, *master, tiles)
                           : std::make_shared<ParameterStream>(module_, *master, tiles);
    }
  }
  // The state's copies are made before anything changes, then the optimizer
  // steps the new tensors.
  move_optimizer_state(*optimizer_, master_ ? master_->master_parameters() : model_params,
                       master ? master->master_parameters() : model_params, where == Offload::kHost,
                       where == Offload::kHost && options_.offload_optimizer() == Offload::kHost);
  options_.offload_optimizer(where);
  options_.offload_gradients(gradients);
  options_.offload_parameters(parameters);
  options_.stream(tiles);
  stream_ = std::move(stream);  // the old stream goes before its masters
  master_ = std::move(master);
  if (!whole.empty()) {  // the old masters gave the parameters their own storage back: the device's again
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < model_params.size(); ++i) model_params[i].set_data(whole[i]);
  }
  rebuild_after_move();
}

// After a move: the Sequential form's loss through the new stream (or none),
// and the step's components over the new masters, the user's included.
void Trainer::rebuild_after_move() {
  make_classifier_loss();
  components_.clear();
  build_components();
  for (const auto& c : added_components_) components_.insert(components_.end() - 1, c);  // the timeline stays last
}

} // namespace memfit
