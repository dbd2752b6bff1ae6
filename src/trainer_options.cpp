#include "memfit/trainer.h"

#include "trainer_internal.h"

#include "memfit/checkpoint.h"
#include "memfit/schedule.h"

#include "compat.h"
#include "memfit/freeze.h"
#include "memfit/optim.h"
#include "memfit/state.h"
#include "memory_internal.h"
#include "read_ahead.h"
#include "step_components.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim.h>
#include <torch/torch.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <mutex>
#include <optional>
#include <sstream>

namespace memfit {

using detail::kCheckpointFile;

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainerOptions& o,
                                                        std::vector<torch::Tensor> params) {
  if (o.optimizer_factory()) {
    auto optimizer = o.optimizer_factory()(std::move(params));
    TORCH_CHECK(optimizer != nullptr, "optimizer_factory returned nullptr: return the optimizer it builds, "
                "for example std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1))");
    return optimizer;
  }
  // memfit's optimizers: LibTorch's, with a step that completes or changes nothing (optim.h).
  switch (o.optimizer()) {
    case OptimizerKind::kSGD:
      return std::make_unique<optim::SGD>(
          std::move(params),
          torch::optim::SGDOptions(o.lr()).momentum(o.momentum()).weight_decay(o.weight_decay()),
          o.optimizer_kernel());
    case OptimizerKind::kAdam:
      return std::make_unique<optim::Adam>(
          std::move(params), torch::optim::AdamOptions(o.lr()).weight_decay(o.weight_decay()), o.optimizer_kernel());
    case OptimizerKind::kAdamW:
      return std::make_unique<optim::AdamW>(
          std::move(params), torch::optim::AdamWOptions(o.lr()).weight_decay(o.weight_decay()),
          o.optimizer_kernel());
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled optimizer kind");
}

MasterWeightsMode parse_master_weights_mode(const std::string& name) {
  if (name == "none") return MasterWeightsMode::kNone;
  if (name == "device") return MasterWeightsMode::kDevice;
  if (name == "host") return MasterWeightsMode::kHost;
  TORCH_CHECK(false, "unknown master weights mode '", name, "': expected none, device or host");
}

OnOutOfMemory parse_on_out_of_memory(const std::string& name) {
  if (name == "throw") return OnOutOfMemory::kThrow;
  if (name == "replan") return OnOutOfMemory::kReplan;
  TORCH_CHECK(false, "unknown out-of-memory action '", name, "': expected throw or replan");
}

std::optional<std::string> batch_statistics_layer(const torch::nn::Module& module) {
  for (const auto& item : module.named_modules()) {
    if (item.value()->name().find("BatchNorm") != std::string::npos) return item.key();
  }
  return std::nullopt;
}

namespace {
bool recomputes(const std::vector<Segment>& segments) {
  return std::any_of(segments.begin(), segments.end(), [](const Segment& s) { return s.checkpointed; });
}
// The micro-batch after `micro` failed: half of it, or fewer examples where
// the attempt needed more beyond `floor` (the bytes no micro-batch moves)
// than the limit leaves, as what it needed there grows with the micro-batch;
// split evenly, in as few micro-batches as that allows.
int64_t next_micro_batch(const OutOfMemoryEvent& e, int64_t micro, int64_t floor) {
  int64_t next = (micro + 1) / 2;
  const int64_t beyond = e.needed_bytes - e.fixed_bytes, room = e.limit_bytes - floor;
  if (e.limit_bytes > 0 && e.needed_bytes > e.limit_bytes && beyond > 0 && room >= 0) {
    const int64_t fits = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(micro) * room / beyond));
    if (fits < next) {
      const int64_t count = (e.examples + fits - 1) / fits;
      next = (e.examples + count - 1) / count;
    }
  }
  return next;
}
// What a re-plan that moves nothing keeps, in words: where the last ones
// put the state, gradients and parameters ("" where all are on the device).
std::string host_text(bool grads, bool params, int64_t tile) {
  return detail::on_host_text(grads, params) + (tile > 0 ? ", streamed in tiles of " + format_bytes(tile) : "");
}
std::string kept_placement_text(const OutOfMemoryEvent& e) {
  if (e.offload_optimizer != Offload::kHost) return "";
  return ", " + host_text(e.offload_gradients == Offload::kHost, e.offload_parameters == Offload::kHost,
                          e.stream.tile_bytes());
}

// A chain's next way to hold less: a finer schedule, or its checkpoints'
// inputs in host memory.
struct Finer {
  FoundChain found;
  Schedule schedule;
  bool to_host = false;
  std::string text() const {
    return "'" + found.name + "' " + schedule.to_string() + (to_host ? " with its checkpoints' inputs on the host" : "");
  }
};

// The chains' next steps: sqrt(n) segments for those that recompute
// nothing; once all recompute, each layer alone for those that can; then,
// for those that recompute, their checkpoints' inputs on the host (the same
// values, copied back for the recomputation).
std::vector<Finer> finer_schedules(const std::vector<FoundChain>& chains) {
  std::vector<Finer> out;
  for (int tier = 0; tier < 3 && out.empty(); ++tier) {
    for (const auto& c : chains) {
      const auto& now = c.chain->schedule();
      const auto n = static_cast<int64_t>(c.chain->sequential()->size());
      const bool plain = !recomputes(now.segments);
      if (tier == 2) {
        if (!plain && c.chain->checkpoint_options().offload() == Offload::kNone) out.push_back({c, now, true});
        continue;
      }
      auto next = avoid_in_place_starts(tier == 0 ? schedule_sqrt(n) : schedule_every(n, 1), c.chain->in_place());
      if (n > 1 && (tier == 0 ? plain : next.to_string() != now.to_string())) out.push_back({c, std::move(next)});
    }
  }
  return out;
}

// The re-plan that takes the chains' next steps, keeping the micro-batch
// and where the state is; `before` and `after` frame its words.
Replan recomputing(std::vector<Finer> finer, int64_t micro_batch, const std::string& before, const std::string& after) {
  Replan r;
  r.micro_batch_size = micro_batch;
  std::vector<std::string> what;
  for (const auto& f : finer) what.push_back(f.text());
  r.description = before + "recomputing " + c10::Join(", ", what) + after;
  r.apply = [finer = std::move(finer)]() mutable {
    for (auto& f : finer) {
      f.found.chain->set_schedule(f.schedule);
      if (!f.to_host) continue;
      auto options = f.found.chain->checkpoint_options();
      f.found.chain->set_checkpoint_options(options.offload(Offload::kHost));
    }
  };
  return r;
}
} // namespace

OutOfMemoryPolicy more_micro_batches(const torch::nn::Module& module, bool batch_statistics_may_change) {
  const bool keep_micro_batch = !batch_statistics_may_change && batch_statistics_layer(module).has_value();
  const auto chains = find_chains(module);  // the chains' handles, shared with the module
  return [keep_micro_batch, chains](const OutOfMemoryEvent& e) -> std::optional<Replan> {
    const int64_t micro = e.micro_batch_size > 0 ? std::min(e.micro_batch_size, e.examples) : e.examples;
    const std::string micro_text = micro < e.examples ? "micro-batches of " + std::to_string(micro) : "";
    const std::string kept_text = kept_placement_text(e);
    // The last resorts, or the first where the bytes no micro-batch can move
    // are too many: the state to the host, then the gradients too, then the
    // parameters streamed from there.
    const bool may_state = e.may_offload_optimizer && e.offload_optimizer != Offload::kHost && e.state_bytes > 0;
    const bool may_grads = e.may_offload_optimizer && e.offload_gradients != Offload::kHost && e.gradient_bytes > 0;
    const bool may_params =
        e.may_offload_parameters && e.offload_parameters != Offload::kHost && e.parameter_bytes > 0;
    // Streamed parameters come in tiles where the largest weight and its
    // gradient, together on the device untiled, take over half the limit.
    const int64_t tile = e.limit_bytes / 4;
    const bool wants_tiles = e.stream.tile_bytes() == 0 && e.limit_bytes > 0 &&
                             2 * e.largest_parameter_bytes > e.limit_bytes / 2 && tile > 0;
    const auto to_host = [&](int level) {  // 1: the state, 2: and the gradients, 3: and the parameters
      Replan r;
      r.micro_batch_size = e.micro_batch_size;
      r.offload_optimizer = Offload::kHost;
      if (level >= 2) r.offload_gradients = Offload::kHost;
      if (level >= 3) r.offload_parameters = Offload::kHost;
      if (level >= 3 && wants_tiles) r.stream = StreamOptions().tile_bytes(tile);
      r.description = (micro_text.empty() ? std::string() : micro_text + ", ") +
                      host_text(level >= 2, level >= 3, r.stream ? tile : 0);
      return r;
    };
    if (e.offload_parameters == Offload::kHost && wants_tiles) return to_host(3);  // streamed untiled: tiles first
    const bool limited = e.limit_bytes > 0, movable = may_state || may_grads || may_params;
    // Gradients sent to the host are still made on the device one at a time:
    // the largest stays beside the parameters.
    const bool grads_on_device = e.offload_gradients != Offload::kHost;
    const int64_t without_grads =
        e.fixed_bytes - e.state_bytes - e.gradient_bytes + (grads_on_device ? e.largest_gradient_bytes : 0);
    // The fewest moves, in order, that bring `floor` (what no micro-batch
    // moves) under the limit; the next move where none does.
    const auto fewest_moves = [&](int64_t floor) -> std::optional<Replan> {
      if (may_state && (!limited || floor - e.state_bytes <= e.limit_bytes || !(may_grads || may_params))) {
        return to_host(1);
      }
      if (may_grads && (!limited || without_grads <= e.limit_bytes || !may_params)) return to_host(2);
      if (may_params) return to_host(3);
      return std::nullopt;
    };
    if (limited && movable && e.fixed_bytes > e.limit_bytes) return fewest_moves(e.fixed_bytes);
    // The update needs what it asked for whatever the micro-batch.
    if (limited && movable && e.phase == StepPhase::kUpdate) {
      return fewest_moves(std::max(e.fixed_bytes, e.needed_bytes));
    }
    // Each micro-batch after the first makes its gradients beside the sums
    // of the ones before: micro-batches need room for the largest there.
    const int64_t accumulating = e.fixed_bytes + (grads_on_device ? e.largest_gradient_bytes : 0);
    const bool may_accumulate = !limited || !movable || accumulating <= e.limit_bytes;
    Replan r;
    if (!keep_micro_batch && micro > 1 && may_accumulate) {
      r.micro_batch_size = next_micro_batch(e, micro, accumulating);
      r.description = "micro-batches of " + std::to_string(r.micro_batch_size) + kept_text;
      return r;
    }
    if (!may_accumulate && micro < e.examples) return fewest_moves(accumulating);  // no recomputation helps
    // Then recomputation, finer each time, and its inputs on the host; not
    // where the request that failed (at least what the attempt needed beyond
    // its peak), made under any schedule, takes more than the bytes no
    // recomputation moves leave.
    const int64_t unmoved = micro < e.examples ? accumulating : e.fixed_bytes;
    const int64_t refused = std::max<int64_t>(0, e.needed_bytes - e.peak_bytes);
    if (limited && movable && unmoved + refused > e.limit_bytes) return fewest_moves(unmoved + refused);
    auto finer = finer_schedules(chains);
    if (finer.empty()) return fewest_moves(unmoved);
    return recomputing(std::move(finer), e.micro_batch_size, micro_text.empty() ? "" : micro_text + ", ", kept_text);
  };
}

OptimizerKind parse_optimizer_kind(const std::string& name) {
  if (name == "sgd") return OptimizerKind::kSGD;
  if (name == "adam") return OptimizerKind::kAdam;
  if (name == "adamw") return OptimizerKind::kAdamW;
  TORCH_CHECK(false, "unknown optimizer '", name, "': expected sgd, adam or adamw");
}

namespace {

// Sizes and counts, and the folder a run saves to.
void check_counts(const TrainerOptions& o) {
  TORCH_CHECK(o.batch_size() > 0, "batch_size must be positive, got ",
              o.batch_size());
  TORCH_CHECK(o.steps() >= 0, "steps must be >= 0 (0: run `epochs` epochs), got ",
              o.steps());
  TORCH_CHECK(o.steps() > 0 || o.epochs() > 0,
              "epochs must be positive when steps is 0, got ", o.epochs());
  TORCH_CHECK(std::isfinite(o.lr()) && o.lr() > 0, "lr must be a positive finite number, got ",
              o.lr());
  TORCH_CHECK(o.max_grad_norm() >= 0 && std::isfinite(o.max_grad_norm()),
              "max_grad_norm must be >= 0 (0: no clipping), got ", o.max_grad_norm());
  TORCH_CHECK(o.eval_batch_size() > 0, "eval_batch_size must be positive, got ",
              o.eval_batch_size());
  TORCH_CHECK(o.micro_batch_size() >= 0,
              "micro_batch_size must be >= 0 (0: the whole batch at once), got ",
              o.micro_batch_size());
  TORCH_CHECK(o.prefetch_factor() >= 0,
              "prefetch_factor must be >= 0 (0: each batch is read when its step starts), got ",
              o.prefetch_factor());
  TORCH_CHECK(o.save_every() >= 0, "save_every must be >= 0 (0: save at the end only), got ",
              o.save_every());
  if (!o.save_dir().empty()) {  // a run never fails at its end for its folder
    check_output_folder(o.save_dir());
    if (std::filesystem::is_directory(o.save_dir())) {
      check_output_file((std::filesystem::path(o.save_dir()) / kCheckpointFile).string());
    }
  }
}

// Master weights, offloads and precision: which combinations hold together.
void check_placement(const TrainerOptions& o) {
  TORCH_CHECK(o.master_weights() == MasterWeightsMode::kNone ||
                  o.precision() != Precision::kFP32,
              "master weights hold parameters in bf16 or fp16: set precision to bf16 or fp16, "
              "or master_weights to none");
  TORCH_CHECK(!(o.master_weights() == MasterWeightsMode::kDevice &&
                o.offload_optimizer() == Offload::kHost),
              "master_weights device keeps the fp32 masters and optimizer state on the device, "
              "offload_optimizer host moves them to the host: use master_weights host, or "
              "offload_optimizer none");
  TORCH_CHECK(o.offload_gradients() == Offload::kNone || o.offload_optimizer() == Offload::kHost,
              "offload_gradients host moves gradients to the host masters that offload_optimizer "
              "host keeps: set offload_optimizer to Offload::kHost too");
  if (o.offload_parameters() == Offload::kHost) {
    TORCH_CHECK(o.offload_optimizer() == Offload::kHost && o.offload_gradients() == Offload::kHost,
                "offload_parameters host streams the parameters from the host masters that also take the "
                "gradients and the optimizer state: set offload_optimizer and offload_gradients to "
                "Offload::kHost too");
    TORCH_CHECK(o.precision() == Precision::kFP32 && o.master_weights() == MasterWeightsMode::kNone,
                "offload_parameters host runs in fp32 (got precision ", to_string(o.precision()),
                "): set precision fp32 and master_weights none, or keep the parameters on the device");
    TORCH_CHECK(o.process_group() == nullptr, "offload_parameters host runs in one process: data "
                "and pipeline parallelism are not supported with streamed parameters; drop the process "
                "group, or keep the parameters on the device (offload optimizer and gradients still apply)");
  }
}

// A process group's modes: the unchecked loss, ZeRO and a pipeline
// (`sequential`: the Trainer was built from a Sequential without a loss).
void check_parallel(const TrainerOptions& o, bool sequential) {
  TORCH_CHECK(o.nonfinite_loss() != NonfiniteLoss::kUnchecked || o.process_group() == nullptr,
              "nonfinite_loss kUnchecked leaves each step's loss unread, but the ranks of a process group "
              "average it on the host: use NonfiniteLoss::kError or kSkip with a process group");
  TORCH_CHECK(o.zero_stage() == 0 || o.zero_stage() == 1, "zero_stage must be 0 (no "
              "sharding) or 1 (optimizer state sharded over the ranks), got ", o.zero_stage(),
              "; stages 2 and 3 are not implemented");
  TORCH_CHECK(o.zero_stage() == 0 || o.process_group() != nullptr,
              "zero_stage 1 shards the optimizer state over the ranks of a process group: set "
              "process_group (memfit launch), or zero_stage 0");
  if (o.parallel() == ParallelMode::kPipeline) {
    TORCH_CHECK(o.process_group() != nullptr, "a pipeline splits the model over the ranks of a "
                "process group: set process_group (memfit launch), or parallel data");
    TORCH_CHECK(sequential, "a pipeline splits the layers of a torch::nn::Sequential trained with "
                "cross-entropy: construct the Trainer from the Sequential without a loss, or use "
                "ParallelMode::kData");
    TORCH_CHECK(o.precision() != Precision::kFP16, "pipeline parallel training does not support fp16 "
                "precision yet (its loss scaler would need the stages to agree on the steps to skip): use bf16, "
                "which needs no scaler, or fp32");
    TORCH_CHECK(o.zero_stage() == 0, "zero_stage 1 shards the optimizer state over data-parallel "
                "ranks, but a pipeline's ranks hold different layers, each stage already keeping only its "
                "own optimizer state: set zero_stage 0 (offload_optimizer host moves that state to the host)");
    TORCH_CHECK(o.micro_batch_size() == 0, "a pipeline cuts each batch into pipeline().chunks() "
                "chunks: set micro_batch_size 0 and the chunks instead (got micro_batch_size ",
                o.micro_batch_size(), ")");
  }
}

// Out-of-memory recovery: what re-planning can change for `module`.
void check_recovery(const TrainerOptions& o, const torch::nn::Module& module) {
  TORCH_CHECK(o.max_replans() >= 0, "max_replans must be >= 0, got ", o.max_replans());
  TORCH_CHECK(o.restore_after() >= 0, "restore_after must be >= 0 (0: keep the re-planned settings), got ",
              o.restore_after());
  if (o.on_out_of_memory() == OnOutOfMemory::kReplan) {
    TORCH_CHECK(o.parallel() != ParallelMode::kPipeline && o.zero_stage() == 0,
                "on_out_of_memory kReplan re-plans data-parallel ranks together, but not a pipeline's stages or "
                "a sharded optimizer's step (which broadcasts as it steps): use parallel data with zero_stage 0, "
                "or OnOutOfMemory::kThrow");
    TORCH_CHECK(o.replan() || !batch_statistics_layer(module).has_value() || !find_chains(module).empty(),
                "on_out_of_memory kReplan re-plans with more micro-batches, which changes the math of a module "
                "with batch statistics (BatchNorm '", batch_statistics_layer(module).value_or(""), "'), and the "
                "module has no chain (CheckpointedSequential) to recompute: allow micro-batches with replan("
                "memfit::more_micro_batches(module, true)), hold its repeated blocks in a CheckpointedSequential, "
                "or use OnOutOfMemory::kThrow");
  }
}

} // namespace

void Trainer::check_options() const {
  check_counts(options_);
  check_placement(options_);
  check_parallel(options_, !classifier_.is_empty());
  check_recovery(options_, *module_);
  check_precision_supported(options_.precision(), options_.device());
}

ParallelMode parse_parallel_mode(const std::string& name) {
  if (name == "data") return ParallelMode::kData;
  if (name == "pipeline") return ParallelMode::kPipeline;
  TORCH_CHECK(false, "unknown parallel mode '", name, "': expected data or pipeline");
}

} // namespace memfit
