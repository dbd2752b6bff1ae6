// A step is a transaction: whatever throws inside it leaves the Trainer's
// state bitwise as it was; it starts from its own gradients only; and with
// OnOutOfMemory::kReplan a step that runs out of memory is re-planned and
// run again with the same math.
#include "compat.h"
#include "memfit/memory.h"
#include "memfit/models.h"
#include "memfit/optim.h"
#include "memfit/checkpoint.h"
#include "memfit/schedule.h"
#include "memfit/stream.h"
#include "memfit/trainer.h"
#include "test_util.h"

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <unistd.h>
#include <string>
#include <tuple>
#include <vector>

namespace memfit {
namespace {

using testing::copies;
using testing::expect_bitwise;
using testing::expect_error;

// A user's module with dropout (the RNG) and, optionally, BatchNorm (buffers).
struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool batch_norm = false, double dropout = 0.25)
      : fc1(register_module("fc1", torch::nn::Linear(20, 32))), fc2(register_module("fc2", torch::nn::Linear(32, 5))),
        dropout(dropout) {
    if (batch_norm) norm = register_module("norm", torch::nn::BatchNorm1d(32));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = fc1->forward(x);
    if (norm) h = norm->forward(h);
    h = torch::dropout(torch::relu(h), dropout, is_training());
    return torch::log_softmax(fc2->forward(h), 1);
  }
  torch::nn::Linear fc1, fc2;
  torch::nn::BatchNorm1d norm{nullptr};
  double dropout;
};
TORCH_MODULE(Net);

torch::Tensor nll(NetImpl& net, const torch::data::Example<>& b) {
  return torch::nll_loss(net.forward(b.data), b.target);
}

torch::data::Example<> batch_of(int64_t n, int64_t seed) {
  UntrackedGuard host;  // host memory until staged
  torch::manual_seed(1000 + seed);
  return {torch::randn({n, 20}), torch::randint(5, {n})};
}

// Everything a step may change: parameters, buffers, gradients, masters and
// their gradients, the optimizer's state, the RNG, the scale and the step.
// The run's state; `with_masters` false leaves out the host masters a
// re-plan may have made (copies of the parameters), whose state still counts.
std::vector<torch::Tensor> state_of(Trainer& t, const torch::nn::Module& module, bool with_masters = true) {
  auto params = module.parameters();
  auto out = copies(params);
  for (const auto& b : copies(module.buffers())) out.push_back(b);
  for (const auto& g : testing::grads_of(params)) out.push_back(g);
  std::vector<torch::Tensor> state_params = params;
  if (auto* m = t.master_weights()) {
    state_params = m->master_parameters();
    if (with_masters) {
      for (const auto& x : copies(state_params)) out.push_back(x);
      for (const auto& g : testing::grads_of(state_params)) out.push_back(g);
    }
  }
  for (const auto& x : testing::optimizer_state_of(t.optimizer(), state_params)) out.push_back(x);
  out.push_back(compat::get_rng_state({}).cpu.clone());
  out.push_back(torch::tensor(t.grad_scaler().get_scale()));
  out.push_back(torch::tensor(t.step()));
  return out;
}
std::vector<torch::Tensor> state_of(Trainer& t, Net& net, bool with_masters = true) {
  return state_of(t, *net, with_masters);
}

// Counts the allocations of `reference`'s step on `batch`, then fails each
// allocation of the same step on `trainer` in turn (after `prepare`): each
// failure frees all it made and leaves the state bitwise as it was, and the
// retry equals the reference's step, parameters and buffers included.
void expect_each_failure_undone(Trainer& reference, const torch::nn::Module& reference_module, Trainer& trainer,
                                const torch::nn::Module& module, const torch::data::Example<>& batch,
                                const std::function<void()>& prepare = nullptr) {
  int64_t allocations = 0;
  double loss = 0;
  {
    AllocationFault count(0);
    loss = reference.train_step(batch).loss;
    allocations = count.allocations();
  }
  ASSERT_GT(allocations, 10);
  if (prepare) prepare();
  for (int64_t k = 1; k <= allocations; ++k) {
    const auto before = state_of(trainer, module);
    const int64_t bytes = memory_allocated();
    {
      AllocationFault fail(k);
      EXPECT_THROW(trainer.train_step(batch), c10::OutOfMemoryError) << "allocation " << k << " of " << allocations;
    }
    EXPECT_EQ(memory_allocated(), bytes) << "the failed step freed all it made (allocation " << k << ")";
    expect_bitwise(state_of(trainer, module), before, "state after failing allocation " + std::to_string(k));
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_EQ(trainer.train_step(batch).loss, loss);
  expect_bitwise(copies(module.parameters()), copies(reference_module.parameters()), "parameters after the retry");
  expect_bitwise(copies(module.buffers()), copies(reference_module.buffers()), "buffers after the retry");
}

struct Combination {
  std::string name;
  TrainerOptions options;
  bool batch_norm = false;
};

std::vector<Combination> combinations() {
  const auto base = TrainerOptions().lr(0.05);
  return {
      {"Adam", TrainerOptions(base)},
      {"SGD with momentum, micro-batches of 8, clipping",
       TrainerOptions(base).optimizer(OptimizerKind::kSGD).micro_batch_size(8).max_grad_norm(0.5)},
      {"AdamW, optimizer and gradients on the host",
       TrainerOptions(base).optimizer(OptimizerKind::kAdamW).weight_decay(0.1).offload_optimizer(Offload::kHost)
           .offload_gradients(Offload::kHost)},
      {"Adam, bf16 with fp32 masters", TrainerOptions(base).precision(Precision::kBF16)
                                            .master_weights(MasterWeightsMode::kDevice)},
      {"SGD, gradients zeroed in place, micro-batches of 12",
       TrainerOptions(base).optimizer(OptimizerKind::kSGD).set_to_none(false).micro_batch_size(12)},
      {"Adam, BatchNorm", TrainerOptions(base), true},
  };
}

// Fails every allocation of a step in turn, in each combination: after each
// failure the state is bitwise what it was (a gradient other code left
// there included), and the retried step equals the uninterrupted step of a
// Trainer that never had that gradient.
TEST(StepTransaction, FailingAnyAllocationOfAStepLeavesTheStateAsItWasAndTheRetryEqualsTheStep) {
  for (const auto& c : combinations()) {
    for (int64_t warm : {0, 2}) {
      SCOPED_TRACE(c.name + ", after " + std::to_string(warm) + " steps");
      auto make = [&] {
        torch::manual_seed(7);
        return Net(c.batch_norm);
      };
      Net ref_net = make(), net = make();
      Trainer reference(ref_net, nll, c.options), trainer(net, nll, c.options);
      for (int64_t i = 0; i < warm; ++i) {
        torch::manual_seed(50 + i);
        reference.train_step(batch_of(24, i));
        torch::manual_seed(50 + i);
        trainer.train_step(batch_of(24, i));
      }
      const auto batch = batch_of(24, warm);  // seeds the generator itself: before the step's seed
      torch::manual_seed(99);
      expect_each_failure_undone(reference, *ref_net, trainer, *net, batch, [&] {
        // Another model's backward left a gradient on the first parameter.
        net->parameters()[0].mutable_grad() = torch::full_like(net->parameters()[0], 3.0);
        torch::manual_seed(99);
      });
      if (::testing::Test::HasFailure()) return;  // one broken combination is enough to read
    }
  }
}

// A user's net with two branches: a backward that fails leaves tasks of the
// other branch in LibTorch's queue, holding its graph (pytorch/pytorch#82218).
struct ForkImpl : torch::nn::Module {
  ForkImpl()
      : a(register_module("a", torch::nn::Linear(20, 64))), b(register_module("b", torch::nn::Linear(20, 64))),
        out(register_module("out", torch::nn::Linear(64, 5))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::log_softmax(out(torch::relu(a(x)) + torch::sigmoid(b(x))), 1);
  }
  torch::nn::Linear a, b, out;
};
TORCH_MODULE(Fork);

// Whichever allocation of a step fails, the failed step holds nothing
// afterwards, and the step retried under a budget of what the uninterrupted
// step needed fits: the graph a failed backward left is freed with the step.
TEST(StepTransaction, AFailedStepOfABranchingModelHoldsNothingAfterwards) {
  const auto fork_nll = [](ForkImpl& n, const torch::data::Example<>& b) {
    return torch::nll_loss(n.forward(b.data), b.target);
  };
  torch::manual_seed(7);
  Fork ref_net;
  torch::manual_seed(7);
  Fork net;
  Trainer reference(ref_net, fork_nll, TrainerOptions().lr(0.05)), trainer(net, fork_nll, TrainerOptions().lr(0.05));
  reference.train_step(batch_of(24, 0));
  trainer.train_step(batch_of(24, 0));
  const auto batch = batch_of(24, 1);
  int64_t allocations = 0, peak = 0;
  {
    AllocationFault count(0);
    PeakMeter meter;
    reference.train_step(batch);
    allocations = count.allocations();
    peak = meter.peak();
  }
  const int64_t bytes = memory_allocated();
  for (int64_t k = 1; k <= allocations; ++k) {
    {
      AllocationFault fail(k);
      EXPECT_THROW(trainer.train_step(batch), c10::OutOfMemoryError) << "allocation " << k << " of " << allocations;
    }
    ASSERT_EQ(memory_allocated(), bytes) << "the failed step freed all it made (allocation " << k << ")";
  }
  BudgetGuard same(torch::kCPU, peak);
  EXPECT_NO_THROW(trainer.train_step(batch)) << "the retry fits where the uninterrupted step did";
}

TEST(StepTransaction, AnErrorInTheUsersLossOrTheNonfiniteCheckLeavesTheStateAsItWas) {
  torch::manual_seed(7);
  Net net(true);
  int calls = 0;
  Trainer trainer(net, [&calls](NetImpl& n, const torch::data::Example<>& b) {
    if (++calls == 3) throw std::runtime_error("the user's loss failed");
    auto loss = torch::nll_loss(n.forward(b.data), b.target);
    return calls == 5 ? loss * std::numeric_limits<double>::quiet_NaN() : loss;
  }, TrainerOptions().micro_batch_size(8));
  trainer.train_step(batch_of(16, 0));  // calls 1 and 2
  const auto batch = batch_of(16, 1);
  const auto before = state_of(trainer, net);
  EXPECT_THROW(trainer.train_step(batch), std::runtime_error);  // call 3: the first micro-batch
  expect_bitwise(state_of(trainer, net), before, "after the loss threw");
  expect_error([&] { trainer.train_step(batch); }, "the loss is NaN");  // calls 4, 5
  expect_bitwise(state_of(trainer, net), before, "after the non-finite check");
}

// A GAN's generator step runs backward through the discriminator; the
// discriminator's Trainer must step on its own loss alone.
TEST(StepTransaction, AStepStartsFromItsOwnGradientsNotWhatOtherCodeLeft) {
  for (bool set_to_none : {true, false}) {
    SCOPED_TRACE(set_to_none ? "set_to_none" : "zeroed in place");
    const auto options = TrainerOptions().optimizer(OptimizerKind::kSGD).lr(0.1).set_to_none(set_to_none);
    torch::manual_seed(7);
    Net clean_net;
    torch::manual_seed(7);
    Net net;
    Trainer clean(clean_net, nll, options), trainer(net, nll, options);
    for (int64_t i = 0; i < 3; ++i) {
      const auto b = batch_of(16, i);
      net->forward(batch_of(16, 10 + i).data).sum().backward();  // the generator's backward through it
      torch::manual_seed(i);
      clean.train_step(b);
      torch::manual_seed(i);
      trainer.train_step(b);
    }
    expect_bitwise(copies(net->parameters()), copies(clean_net->parameters()), "parameters");
  }
}

TEST(StepTransaction, AMutableLossAndAFunctorWithANonConstCallCompile) {
  struct Counting {
    int calls = 0;
    torch::Tensor operator()(NetImpl& n, const torch::data::Example<>& b) {
      ++calls;
      return nll(n, b);
    }
  };
  Net net;
  int seen = 0;
  Trainer a(net, [calls = 0, &seen](NetImpl& n, const torch::data::Example<>& b) mutable {
    seen = ++calls;
    return nll(n, b);
  }, TrainerOptions().micro_batch_size(4));
  a.train_step(batch_of(8, 0));
  EXPECT_EQ(seen, 2);
  Trainer b(net, Counting(), TrainerOptions());
  b.train_step(batch_of(8, 0));
}

// Trains 20 steps of batch 64 whose budget drops to 40% of the plain step's
// peak at step 5: with kReplan every step completes, re-planned to more
// micro-batches, and the losses and parameters equal the uninterrupted run's.
struct BudgetRun {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;
  std::vector<int64_t> replans;
  std::vector<Recovery> recoveries;
  int64_t final_micro_batch = 0;
};

BudgetRun run_with_budget_drop(const TrainerOptions& options, double fraction, int64_t drop_at, int64_t lift_at = 0) {
  torch::manual_seed(7);
  Net net(false, /*dropout=*/0.0);  // micro-batches would draw their own dropout masks
  Trainer trainer(net, nll, options);
  BudgetRun r;
  int64_t base = 0, plain = 0;
  for (int64_t step = 1; step <= 20; ++step) {
    if (step == drop_at) set_memory_budget(torch::kCPU, base + static_cast<int64_t>(fraction * double(plain)));
    if (step == lift_at) set_memory_budget(torch::kCPU, 0);
    const auto b = batch_of(64, step);
    torch::manual_seed(step);
    const int64_t before = memory_allocated();
    const auto rec = trainer.train_step(b);
    if (step == 2) {  // the optimizer's state exists: the plain step's own peak
      base = before;
      plain = rec.peak_bytes - before;
    }
    r.losses.push_back(rec.loss);
    r.replans.push_back(rec.replans);
  }
  set_memory_budget(torch::kCPU, 0);
  r.params = copies(net->parameters());
  r.recoveries = trainer.recoveries();
  r.final_micro_batch = trainer.options().micro_batch_size();
  return r;
}

TEST(Recovery, ABudgetThatDropsTo40PercentAtStep5Of20IsReplannedAndTheRunEqualsTheUninterruptedOne) {
  const auto options = TrainerOptions().lr(0.01).on_out_of_memory(OnOutOfMemory::kReplan);
  const auto plain = run_with_budget_drop(options, 0, 0);
  const auto dropped = run_with_budget_drop(options, 0.4, 5);
  ASSERT_EQ(dropped.losses.size(), 20u);
  EXPECT_GE(dropped.replans[4], 1) << "step 5 ran out of memory and was re-planned";
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(dropped.losses[i], plain.losses[i]) << "step " << i + 1;
  for (size_t i = 5; i < 20; ++i) EXPECT_EQ(dropped.replans[i], 0) << "the re-planned settings stay";
  for (size_t i = 0; i < 20; ++i) EXPECT_NEAR(dropped.losses[i], plain.losses[i], 1e-5) << "step " << i + 1;
  EXPECT_LT(testing::max_relative_difference(dropped.params, plain.params), 1e-5);
  ASSERT_FALSE(dropped.recoveries.empty());
  EXPECT_EQ(dropped.recoveries[0].step, 5);
  EXPECT_EQ(dropped.recoveries[0].before, "no micro-batching");
  EXPECT_EQ(dropped.recoveries[0].after, "micro-batches of 32");
  EXPECT_NE(dropped.recoveries[0].what.find("out of memory"), std::string::npos);
}

TEST(Recovery, ARunReturnsToItsFirstPlanAfterRestoreAfterCleanStepsOnceTheLimitLifts) {
  const auto options = TrainerOptions().lr(0.01).on_out_of_memory(OnOutOfMemory::kReplan);
  // The budget drops at step 3 and lifts at step 8.
  const auto kept = run_with_budget_drop(TrainerOptions(options).restore_after(0), 0.4, 3, 8);
  const auto restored = run_with_budget_drop(TrainerOptions(options).restore_after(4), 0.4, 3, 8);
  const auto plain = run_with_budget_drop(options, 0, 0);
  // restore_after 4: step 7 tries the first plan again under the budget
  // (it fails and is re-planned again), step 11 after the lift, and keeps it.
  EXPECT_GE(restored.replans[2], 1);
  EXPECT_GE(restored.replans[6], 1);
  for (size_t i = 7; i < 20; ++i) EXPECT_EQ(restored.replans[i], 0) << "step " << i + 1;
  EXPECT_EQ(restored.final_micro_batch, 0) << "back to the first plan: no micro-batching";
  EXPECT_GT(kept.final_micro_batch, 0) << "restore_after 0 keeps the re-planned micro-batches";
  EXPECT_GT(restored.recoveries.size(), kept.recoveries.size()) << "restoring under the budget costs a failure";
  for (size_t i = 0; i < 20; ++i) EXPECT_NEAR(restored.losses[i], plain.losses[i], 1e-5) << "step " << i + 1;
}

TEST(Recovery, AStepThatCannotFitGivesUpAfterBoundedAttemptsLeavingTheStateAndSavingIt) {
  const auto dir = (std::filesystem::temp_directory_path() / ("memfit_recovery_" + std::to_string(::getpid()))).string();
  torch::manual_seed(7);
  Net net;
  Trainer trainer(net, nll, TrainerOptions().on_out_of_memory(OnOutOfMemory::kReplan).max_replans(3));
  trainer.train_step(batch_of(64, 0));
  const auto batch = batch_of(64, 1);
  const auto before = state_of(trainer, net);
  int64_t gradients = 0;
  for (const auto& p : net->parameters()) gradients += p.nbytes();
  {  // the parameters, the optimizer's state and the gradients fit, but no micro-batch of 11 or more,
     // even with the state on the host
    BudgetGuard tight(torch::kCPU, memory_allocated() + gradients + 256);
    expect_error([&] { trainer.train_step(batch); },
                 "could not be re-planned after 4 attempts (no micro-batching, optimizer state on the host, "
                 "micro-batches of 22, optimizer state on the host, micro-batches of 11, optimizer state on the "
                 "host); the last reached");
  }
  // The values are as they were; the state stays on the host, where the re-plan moved it.
  expect_bitwise(state_of(trainer, net, false), before, "after giving up");
  ASSERT_EQ(trainer.recoveries().size(), 4u) << "3 re-plans, then the attempt that gave up";
  EXPECT_EQ(trainer.recoveries().back().after, "");
  {  // not even the fixed bytes fit, the optimizer state moved off: no re-plan is tried
    BudgetGuard tiny(torch::kCPU, 64);
    expect_error([&] { trainer.train_step(batch); }, "is smaller than the bytes no re-plan can move");
  }
  expect_bitwise(state_of(trainer, net, false), before, "after refusing");
  EXPECT_EQ(trainer.recoveries().size(), 4u);
  // fit saves the run before it ends.
  ImageDataset data;
  {
    UntrackedGuard host;
    data.images = torch::randn({64, 20});
    data.labels = torch::randint(5, {64});
  }
  torch::manual_seed(7);
  Net other;
  Trainer saving(other, nll, TrainerOptions().batch_size(32).steps(2).save_dir(dir)
                                 .on_out_of_memory(OnOutOfMemory::kReplan).max_replans(1));
  {
    BudgetGuard tiny(torch::kCPU, memory_allocated() + 64);
    EXPECT_THROW(saving.fit(data), c10::OutOfMemoryError);
  }
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(dir) / "checkpoint.pt"));
}

// A user's net whose Adam state outweighs its activations at small batches.
struct WideImpl : torch::nn::Module {
  WideImpl() : fc1(register_module("fc1", torch::nn::Linear(20, 256))), fc2(register_module("fc2", torch::nn::Linear(256, 5))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::log_softmax(fc2->forward(torch::relu(fc1->forward(x))), 1); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Wide);

torch::Tensor wide_nll(WideImpl& net, const torch::data::Example<>& b) {
  return torch::nll_loss(net.forward(b.data), b.target);
}

struct OffloadRun {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;
  std::vector<Recovery> recoveries;
  std::vector<Offload> placement;  // where each step left the optimizer state
  int64_t calls = 0;               // of a component the user added
  bool same_optimizer = false;     // the one an LR scheduler was given
};

// 10 steps of batch 8 whose budget drops at step 3 below what the Trainer
// holds between steps (the parameters, Adam's state) with a gradient, but
// not below that less half the state; lifted at `lift_at`.
OffloadRun run_offloaded(const TrainerOptions& options, bool drop, int64_t lift_at = 0) {
  struct Counting : StepComponent {
    int64_t calls = 0;
    void begin_step(StepState&) override { ++calls; }
  };
  torch::manual_seed(7);
  Wide net;
  Trainer t(net, wide_nll, options);
  auto counting = std::make_shared<Counting>();
  t.add_component(counting);
  torch::optim::Optimizer* const first = &t.optimizer();
  torch::optim::StepLR schedule(t.optimizer(), /*step_size=*/3, /*gamma=*/0.5);
  OffloadRun r;
  for (int64_t step = 1; step <= 10; ++step) {
    if (drop && step == 3) {
      const int64_t state = optimizer_state_bytes(t.optimizer());
      int64_t grads = 0;
      for (const auto& p : net->parameters()) grads += p.nbytes();
      set_memory_budget(torch::kCPU, memory_allocated() + grads - state / 2);
    }
    if (step == lift_at) set_memory_budget(torch::kCPU, 0);
    r.losses.push_back(t.train_step(batch_of(8, step)).loss);
    r.placement.push_back(t.options().offload_optimizer());
    schedule.step();
  }
  r.same_optimizer = &t.optimizer() == first;
  set_memory_budget(torch::kCPU, 0);
  UntrackedGuard host;  // the copies must not count against the next run's budget
  r.params = copies(net->parameters());
  r.recoveries = t.recoveries();
  r.calls = counting->calls;
  return r;
}

// Where only the optimizer state is too many bytes, the default policy moves
// it to the host first (fp32 host masters, ZeRO-Offload's step): the same
// optimizer on the same values, so the run equals the uninterrupted one
// bitwise; the optimizer stays the object an LR scheduler was given, and a
// component the user added keeps being called.
TEST(Recovery, WhenTheOptimizerStateDoesNotFitItMovesToTheHostAndTrainsBitwiseTheSame) {
  const auto options = TrainerOptions().lr(0.01).on_out_of_memory(OnOutOfMemory::kReplan);
  const auto plain = run_offloaded(options, false);
  const auto dropped = run_offloaded(options, true);
  ASSERT_FALSE(dropped.recoveries.empty());
  EXPECT_EQ(dropped.recoveries[0].step, 3);
  EXPECT_EQ(dropped.recoveries[0].before, "no micro-batching");
  EXPECT_EQ(dropped.recoveries[0].after, "optimizer state on the host");
  EXPECT_EQ(dropped.placement[1], Offload::kNone);
  for (size_t i = 2; i < 10; ++i) EXPECT_EQ(dropped.placement[i], Offload::kHost) << "step " << i + 1;
  EXPECT_TRUE(dropped.same_optimizer);
  EXPECT_EQ(dropped.calls, plain.calls + static_cast<int64_t>(dropped.recoveries.size()))
      << "the user's component is called at every attempt, after the move too";
  if (dropped.recoveries.size() == 1) {
    EXPECT_EQ(dropped.losses, plain.losses);
    expect_bitwise(dropped.params, plain.params, "parameters");
  } else {  // micro-batches were needed as well: the same math within rounding
    for (size_t i = 0; i < 10; ++i) EXPECT_NEAR(dropped.losses[i], plain.losses[i], 1e-5) << "step " << i + 1;
  }
}

// restore_after: once the limit lifts, the state moves back to the device
// (and the run stays the uninterrupted one's).
TEST(Recovery, TheOptimizerStateMovesBackToTheDeviceAfterRestoreAfterOnceTheLimitLifts) {
  const auto options = TrainerOptions().lr(0.01).on_out_of_memory(OnOutOfMemory::kReplan);
  const auto plain = run_offloaded(options, false);
  const auto restored = run_offloaded(TrainerOptions(options).restore_after(2), true, 6);
  EXPECT_EQ(restored.placement[3], Offload::kHost);
  EXPECT_EQ(restored.placement.back(), Offload::kNone);
  for (size_t i = 0; i < 10; ++i) EXPECT_NEAR(restored.losses[i], plain.losses[i], 1e-5) << "step " << i + 1;
  EXPECT_LT(testing::max_relative_difference(restored.params, plain.params), 1e-5);
}

// Bytes the budget drops to at step 3, given the Trainer and its module's parameters.
using BudgetAt = std::function<int64_t(Trainer&, const std::vector<torch::Tensor>&)>;

struct MoveBackRun {
  std::vector<double> losses;
  std::vector<std::tuple<Offload, Offload, Offload>> placement;  // each step's state, gradients, parameters
  std::vector<torch::Tensor> params;  // once the Trainer is gone (streamed ones whole again)
  size_t recoveries = 0;
};

// 6 steps of batch 8 of `Model` with restore_after(1); with `drop`, the
// budget drops to `budget` at step 3 and lifts at step 4, where the move
// back's first copy fails.
template <class Model, class Loss>
MoveBackRun run_failing_move_back(Loss loss, const BudgetAt& budget, bool drop) {
  torch::manual_seed(7);
  Model net;
  MoveBackRun r;
  {
    Trainer t(net, loss, TrainerOptions().lr(0.01).on_out_of_memory(OnOutOfMemory::kReplan).restore_after(1));
    for (int64_t step = 1; step <= 6; ++step) {
      std::optional<BudgetGuard> dropped;
      std::optional<AllocationFault> fault;
      if (drop && step == 3) dropped.emplace(torch::kCPU, budget(t, net->parameters()));
      if (drop && step == 4) fault.emplace(1);  // the move back's first copy
      r.losses.push_back(t.train_step(batch_of(8, step)).loss);
      r.placement.emplace_back(t.options().offload_optimizer(), t.options().offload_gradients(),
                               t.options().offload_parameters());
      if (fault) EXPECT_TRUE(fault->failed()) << "the move back's first copy failed";
    }
    r.recoveries = t.recoveries().size();
  }
  UntrackedGuard host;
  r.params = copies(net->parameters());
  return r;
}

// A move back that runs out of memory (its first copy fails) changes
// nothing: the state stays on the host, the step runs, and the move is
// tried again after restore_after more clean steps; the run equals the
// uninterrupted one bitwise throughout.
TEST(Recovery, AMoveBackThatRunsOutOfMemoryLeavesTheStateOnTheHostAndIsTriedAgain) {
  const BudgetAt below_state = [](Trainer& t, const std::vector<torch::Tensor>& params) {
    int64_t grads = 0;
    for (const auto& p : params) grads += p.nbytes();
    return memory_allocated() + grads - optimizer_state_bytes(t.optimizer()) / 2;
  };
  const auto plain = run_failing_move_back<Wide>(wide_nll, below_state, false);
  const auto run = run_failing_move_back<Wide>(wide_nll, below_state, true);
  EXPECT_EQ(run.recoveries, 1u) << "the failed move back is no recovery";
  EXPECT_EQ(std::get<0>(run.placement[2]), Offload::kHost);
  EXPECT_EQ(std::get<0>(run.placement[3]), Offload::kHost) << "the move back failed: the state stayed";
  EXPECT_EQ(std::get<0>(run.placement[4]), Offload::kNone) << "tried again after a clean step";
  EXPECT_EQ(run.losses, plain.losses);
  expect_bitwise(run.params, plain.params, "parameters");
}

// A run whose state moved to the host saves a checkpoint that a Trainer
// with the run's first options resumes (its fp32 masters are the model's
// values), continuing as the run does; a policy that moves the state where
// the Trainer cannot is refused in one line.
TEST(Recovery, AnOffloadedRunResumesUnderItsFirstOptionsAndAnImpossibleMoveIsRefused) {
  const auto dir = (std::filesystem::temp_directory_path() / ("memfit_offload_" + std::to_string(::getpid()))).string();
  const auto options = TrainerOptions().lr(0.01).on_out_of_memory(OnOutOfMemory::kReplan);
  torch::manual_seed(7);
  Wide net;
  Trainer t(net, wide_nll, options);
  t.train_step(batch_of(8, 1));
  t.train_step(batch_of(8, 2));
  {
    const int64_t state = optimizer_state_bytes(t.optimizer());
    int64_t grads = 0;
    for (const auto& p : net->parameters()) grads += p.nbytes();
    BudgetGuard drop(torch::kCPU, memory_allocated() + grads - state / 2);
    t.train_step(batch_of(8, 3));
  }
  ASSERT_EQ(t.options().offload_optimizer(), Offload::kHost);
  t.save(dir);
  Wide other;
  Trainer resumed(other, wide_nll, options);
  resumed.resume(dir);
  EXPECT_EQ(resumed.options().offload_optimizer(), Offload::kNone);
  EXPECT_EQ(resumed.train_step(batch_of(8, 4)).loss, t.train_step(batch_of(8, 4)).loss);
  expect_bitwise(copies(other->parameters()), copies(net->parameters()), "parameters after the resumed step");
  std::filesystem::remove_all(dir);

  Wide low;
  Trainer masters(low, wide_nll, TrainerOptions(options).precision(Precision::kBF16)
                                     .master_weights(MasterWeightsMode::kDevice)
                                     .replan([](const OutOfMemoryEvent& e) -> std::optional<Replan> {
                                       Replan r;
                                       r.micro_batch_size = e.micro_batch_size;
                                       r.offload_optimizer = Offload::kHost;
                                       return r;
                                     }));
  int64_t grads = 0;
  for (const auto& p : low->parameters()) grads += p.nbytes();
  // Room for what the Trainer holds and the gradients, not for the activations.
  BudgetGuard tight(torch::kCPU, memory_allocated() + optim::lazy_state_bytes(masters.optimizer()) + grads + 1024);
  expect_error([&] { masters.train_step(batch_of(64, 0)); }, "the re-plan moves the optimizer state or gradients, "
                                                              "which this Trainer cannot");
}

// A user's net of four even layers: no one gradient outweighs the others,
// so gradients moved to the host one by one free most of their bytes.
struct EvenImpl : torch::nn::Module {
  EvenImpl()
      : seq(register_module("seq", torch::nn::Sequential(torch::nn::Linear(20, 64), torch::nn::ReLU(),
                                                          torch::nn::Linear(64, 64), torch::nn::ReLU(),
                                                          torch::nn::Linear(64, 64), torch::nn::ReLU(),
                                                          torch::nn::Linear(64, 5)))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::log_softmax(seq->forward(x), 1); }
  torch::nn::Sequential seq;
};
TORCH_MODULE(Even);

torch::Tensor even_nll(EvenImpl& net, const torch::data::Example<>& b) {
  return torch::nll_loss(net.forward(b.data), b.target);
}

// A user's net whose blocks are in a CheckpointedSequential chain, which
// its parameters can be streamed through: eight layers, none large.
struct ChainedImpl : torch::nn::Module {
  ChainedImpl() {
    torch::nn::Sequential seq(torch::nn::Linear(20, 64), torch::nn::ReLU());
    for (int i = 0; i < 6; ++i) {
      seq->push_back(torch::nn::Linear(64, 64));
      seq->push_back(torch::nn::ReLU());
    }
    seq->push_back(torch::nn::Linear(64, 5));
    chain = register_module("chain", CheckpointedSequential(seq));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::log_softmax(chain->forward(x), 1); }
  CheckpointedSequential chain{nullptr};
};
TORCH_MODULE(Chained);

torch::Tensor chained_nll(ChainedImpl& net, const torch::data::Example<>& b) {
  return torch::nll_loss(net.forward(b.data), b.target);
}

struct MovedRun {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;
  std::vector<Recovery> recoveries;
  std::vector<std::tuple<Offload, Offload, Offload>> placement;  // each step's state, gradients, parameters
};

// The budget a run drops to: from the bytes allocated between steps, the
// optimizer state's, the gradients' and the parameters'.
using DropTo = std::function<int64_t(int64_t allocated, int64_t state, int64_t grads, int64_t params)>;

// 8 steps of batch 8 of `Model` whose budget drops at step 3 to `drop_to`;
// lifted at `lift_at`.
// The parameters are compared once the Trainer is gone: streamed ones are
// whole again then.
template <class Model, class Loss>
MovedRun run_moved(const TrainerOptions& options, Loss loss, const DropTo& drop_to, int64_t lift_at = 0) {
  torch::manual_seed(7);
  Model net;
  MovedRun r;
  {
    Trainer t(net, loss, options);
    torch::optim::StepLR schedule(t.optimizer(), /*step_size=*/3, /*gamma=*/0.5);
    for (int64_t step = 1; step <= 8; ++step) {
      if (drop_to && step == 3) {
        int64_t bytes = 0;
        for (const auto& p : net->parameters()) bytes += p.nbytes();
        set_memory_budget(torch::kCPU,
                          drop_to(memory_allocated(), optimizer_state_bytes(t.optimizer()), bytes, bytes));
      }
      if (step == lift_at) set_memory_budget(torch::kCPU, 0);
      r.losses.push_back(t.train_step(batch_of(8, step)).loss);
      r.placement.emplace_back(t.options().offload_optimizer(), t.options().offload_gradients(),
                               t.options().offload_parameters());
      schedule.step();
    }
    set_memory_budget(torch::kCPU, 0);
    r.recoveries = t.recoveries();
  }
  UntrackedGuard host;
  r.params = copies(net->parameters());
  return r;
}

// Below the parameters and their gradients (the state aside), by a fifth of the gradients.
int64_t below_gradients(int64_t allocated, int64_t state, int64_t grads, int64_t) {
  return allocated - state + grads * 4 / 5;
}

constexpr auto kOnDevice = std::make_tuple(Offload::kNone, Offload::kNone, Offload::kNone);
constexpr auto kStateAndGradients = std::make_tuple(Offload::kHost, Offload::kHost, Offload::kNone);
constexpr auto kAllOnHost = std::make_tuple(Offload::kHost, Offload::kHost, Offload::kHost);

// A run of `Model` whose budget drops at step 3 to `drop_to` recovers once,
// to `after`, and keeps everything where `where` says from then on, training
// bitwise as the uninterrupted run; with restore_after(2) and the limit
// lifted at step 5, everything comes back to the device, still bitwise.
// (Parameters are compared once the Trainer is gone: streamed ones are whole again.)
template <class Model, class Loss>
void expect_moved_bitwise(Loss loss, const DropTo& drop_to, const std::string& after,
                          const std::tuple<Offload, Offload, Offload>& where) {
  const auto options = TrainerOptions().lr(0.01).on_out_of_memory(OnOutOfMemory::kReplan);
  const auto plain = run_moved<Model>(options, loss, nullptr);
  const auto moved = run_moved<Model>(options, loss, drop_to);
  ASSERT_EQ(moved.recoveries.size(), 1u);
  EXPECT_EQ(moved.recoveries[0].step, 3);
  EXPECT_EQ(moved.recoveries[0].after, after);
  EXPECT_EQ(moved.placement[1], kOnDevice);
  for (size_t i = 2; i < 8; ++i) EXPECT_EQ(moved.placement[i], where) << "step " << i + 1;
  EXPECT_EQ(moved.losses, plain.losses);
  expect_bitwise(moved.params, plain.params, "parameters");

  const auto restored = run_moved<Model>(TrainerOptions(options).restore_after(2), loss, drop_to, 5);
  EXPECT_EQ(restored.placement[3], where);
  EXPECT_EQ(restored.placement.back(), kOnDevice);
  EXPECT_EQ(restored.losses, plain.losses);
  expect_bitwise(restored.params, plain.params, "parameters after the move back");
}

// Where the parameters and their gradients alone exceed the limit, moving
// the state is not enough: the default policy moves the state and the
// gradients together, at once (each gradient is added into its host master
// as backward makes it), and the run equals the uninterrupted one bitwise.
// With restore_after both come back once the limit lifts.
TEST(Recovery, WhenTheGradientsDoNotFitEitherTheyMoveToTheHostWithTheStateAndTrainBitwiseTheSame) {
  expect_moved_bitwise<Even>(even_nll, below_gradients, "optimizer state and gradients on the host",
                             kStateAndGradients);
}

// Where the parameters alone exceed the limit, a module whose blocks are in
// a CheckpointedSequential chain has them streamed from host masters layer
// by layer, with the state and gradients there too: the same values in the
// same operations, so the run equals the uninterrupted one bitwise, and
// nothing but the stream's placeholders stays on the device between steps.
// With restore_after the parameters come back whole.
TEST(Recovery, WhenTheParametersDoNotFitTheyAreStreamedFromTheHostAndTrainBitwiseTheSame) {
  const auto options = TrainerOptions().lr(0.01).on_out_of_memory(OnOutOfMemory::kReplan);
  // Below the parameters by a fifth: room for the largest weight and its gradient untiled.
  const DropTo below_parameters = [](int64_t allocated, int64_t state, int64_t, int64_t params) {
    return allocated - state - params / 5;
  };
  expect_moved_bitwise<Chained>(chained_nll, below_parameters, "optimizer state, gradients and parameters on the host",
                                kAllOnHost);

  torch::manual_seed(7);
  Chained net;
  Trainer t(net, chained_nll, options);
  t.train_step(batch_of(8, 1));
  int64_t params = 0;
  for (const auto& p : net->parameters()) params += p.nbytes();
  {
    BudgetGuard drop(torch::kCPU, memory_allocated() - optimizer_state_bytes(t.optimizer()) - params / 5);
    t.train_step(batch_of(8, 2));
  }
  EXPECT_LT(memory_allocated(), 1024) << "between steps the device holds the stream's placeholders only";
  // While streamed, the Trainer's save() writes the masters' values: a
  // checkpoint of the whole model, which a Trainer with the first options resumes.
  const auto dir = (std::filesystem::temp_directory_path() / ("memfit_streamed_" + std::to_string(::getpid()))).string();
  t.save(dir);
  Chained other;
  Trainer resumed(other, chained_nll, options);
  resumed.resume(dir);
  EXPECT_EQ(resumed.train_step(batch_of(8, 3)).loss, t.train_step(batch_of(8, 3)).loss);
  std::filesystem::remove_all(dir);
}

// Where the parameters fit but not beside the largest gradient, moving the
// gradients to the host cannot help (backward makes each on the device
// before it goes), nor can micro-batches: the default policy streams the
// parameters at once instead of halving the micro-batch until it gives up.
TEST(Recovery, WhereTheLargestGradientDoesNotFitBesideTheParametersTheyAreStreamedAtOnce) {
  // The parameters and half of the largest weight's (64 x 64) gradient.
  const DropTo beside_half_a_gradient = [](int64_t allocated, int64_t state, int64_t, int64_t) {
    return allocated - state + 64 * 64 * int64_t(sizeof(float)) / 2;
  };
  expect_moved_bitwise<Chained>(chained_nll, beside_half_a_gradient,
                                "optimizer state, gradients and parameters on the host", kAllOnHost);
}

// Where the largest weight and its gradient take over half the limit, the
// streamed parameters come in tiles of a quarter of it: a tile's product
// rounds differently from the whole weight's, so the run stays within 1e-5
// of the uninterrupted one.
TEST(Recovery, WhereTheLargestWeightDoesNotFitWholeTheParametersAreStreamedInTiles) {
  const auto options = TrainerOptions().lr(0.01).on_out_of_memory(OnOutOfMemory::kReplan);
  const DropTo tight = [](int64_t allocated, int64_t state, int64_t, int64_t params) {
    return allocated - state - params * 7 / 10;
  };
  const auto plain = run_moved<Chained>(options, chained_nll, nullptr);
  const auto tiled = run_moved<Chained>(options, chained_nll, tight);
  ASSERT_FALSE(tiled.recoveries.empty());
  EXPECT_NE(tiled.recoveries[0].after.find("optimizer state, gradients and parameters on the host, streamed in "
                                           "tiles of "),
            std::string::npos)
      << tiled.recoveries[0].after;
  for (size_t i = 0; i < 8; ++i) EXPECT_NEAR(tiled.losses[i], plain.losses[i], 1e-5) << "step " << i + 1;
  EXPECT_LT(testing::max_relative_difference(tiled.params, plain.params), 1e-5);
}

// A move back from the stream that runs out of memory (its first copy, a
// parameter's on the device, fails) changes nothing: the parameters stay
// streamed, the step runs, and the move is tried again after restore_after
// more clean steps; the run equals the uninterrupted one bitwise throughout.
TEST(Recovery, AMoveBackFromTheStreamThatRunsOutOfMemoryLeavesTheParametersStreamedAndIsTriedAgain) {
  const BudgetAt below_parameters = [](Trainer& t, const std::vector<torch::Tensor>& params) {
    int64_t bytes = 0;
    for (const auto& p : params) bytes += p.nbytes();
    return memory_allocated() - optimizer_state_bytes(t.optimizer()) - bytes / 5;
  };
  const auto plain = run_failing_move_back<Chained>(chained_nll, below_parameters, false);
  const auto run = run_failing_move_back<Chained>(chained_nll, below_parameters, true);
  EXPECT_EQ(run.recoveries, 1u) << "the failed move back is no recovery";
  EXPECT_EQ(run.placement[2], kAllOnHost);
  EXPECT_EQ(run.placement[3], kAllOnHost) << "the move back failed: the parameters stayed streamed";
  EXPECT_EQ(run.placement[4], kOnDevice) << "tried again after a clean step";
  EXPECT_EQ(run.losses, plain.losses);
  expect_bitwise(run.params, plain.params, "parameters");
}

// A policy's re-plan that the Trainer cannot take ends the step in one line
// that says what would do: tiles for parameters that are not streamed, a
// negative tile, and streaming a module that ParameterStream refuses.
TEST(Recovery, ARePlanTheTrainerCannotTakeIsRefusedInALine) {
  const auto refused = [](auto net, auto loss, const Replan& r, const std::string& text) {
    torch::manual_seed(7);
    Trainer t(net, loss, TrainerOptions().lr(0.01).on_out_of_memory(OnOutOfMemory::kReplan).replan(
                             [r](const OutOfMemoryEvent&) { return std::optional<Replan>(r); }));
    t.train_step(batch_of(8, 1));
    BudgetGuard none_left(torch::kCPU, memory_allocated());
    expect_error([&] { t.train_step(batch_of(8, 2)); }, text);
  };
  Replan tiles;
  tiles.stream = StreamOptions().tile_bytes(1024);
  refused(Chained(), chained_nll, tiles,
          "Replan::stream tiles streamed parameters only: set Replan::offload_parameters to Offload::kHost too, "
          "or leave Replan::stream unset");
  Replan negative;
  negative.offload_optimizer = negative.offload_gradients = negative.offload_parameters = Offload::kHost;
  negative.stream = StreamOptions().tile_bytes(-1);
  refused(Chained(), chained_nll, negative, "Replan::stream: tile_bytes must be >= 0 (0: no tiling), got -1");
  Replan stream_all = negative;
  stream_all.stream.reset();
  refused(Wide(), wide_nll, stream_all,
          "and the re-plan streams the parameters, which this Trainer cannot: " +
              ParameterStream::refusal(*Wide()) + "; return Replan::offload_parameters unset");
}

// The default policy's order for the bytes held between steps: the state
// first where that is enough, the state and gradients together where that
// is, else all three with the parameters streamed; as a last resort, the
// state, then the gradients, then the parameters. A policy that moves the
// gradients without the state is refused in one line.
TEST(Recovery, TheDefaultPolicyMovesTheStateThenTheGradientsThenStreamsAndEachNeedsTheOneBefore) {
  Even net;
  const auto policy = more_micro_batches(*net, false);
  OutOfMemoryEvent e;
  e.examples = 8;
  e.micro_batch_size = 1;  // nothing left to split, and no chain to recompute
  e.may_offload_optimizer = true;
  e.limit_bytes = 1000;
  e.fixed_bytes = 900;
  e.state_bytes = 400;
  e.gradient_bytes = 200;
  auto r = policy(e);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->offload_optimizer, Offload::kHost);
  EXPECT_FALSE(r->offload_gradients.has_value()) << "the last resort moves the state first";
  e.offload_optimizer = Offload::kHost;
  e.state_bytes = 0;
  r = policy(e);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->offload_gradients, Offload::kHost);
  EXPECT_EQ(r->description, "micro-batches of 1, optimizer state and gradients on the host");
  e.offload_gradients = Offload::kHost;
  e.gradient_bytes = 0;
  EXPECT_FALSE(policy(e).has_value()) << "nothing is left where the parameters cannot be streamed";
  e.may_offload_parameters = true;
  e.parameter_bytes = 300;
  e.largest_parameter_bytes = 200;  // with its gradient, under half the limit: whole
  r = policy(e);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->offload_parameters, Offload::kHost);
  EXPECT_FALSE(r->stream.has_value());
  EXPECT_EQ(r->description, "micro-batches of 1, optimizer state, gradients and parameters on the host");
  e.largest_parameter_bytes = 300;  // with its gradient, over half: in tiles of a quarter of the limit
  r = policy(e);
  ASSERT_TRUE(r.has_value() && r->stream.has_value());
  EXPECT_EQ(r->stream->tile_bytes(), 250);
  EXPECT_EQ(r->description, "micro-batches of 1, optimizer state, gradients and parameters on the host, "
                            "streamed in tiles of 250 bytes");
  e.largest_parameter_bytes = 200;
  e.offload_parameters = Offload::kHost;
  e.parameter_bytes = 0;
  EXPECT_FALSE(policy(e).has_value()) << "nothing is left";
  e.largest_parameter_bytes = 300;  // streamed whole, and its largest weight is too large: tiles
  r = policy(e);
  ASSERT_TRUE(r.has_value() && r->stream.has_value());
  EXPECT_EQ(r->stream->tile_bytes(), 250);
  e.stream = *r->stream;
  EXPECT_FALSE(policy(e).has_value()) << "tiled already: nothing is left";

  OutOfMemoryEvent held;  // the bytes held between steps exceed the limit
  held.examples = 8;
  held.may_offload_optimizer = true;
  held.limit_bytes = 1000;
  held.fixed_bytes = 1300;
  held.state_bytes = 400;
  held.gradient_bytes = 300;
  r = policy(held);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->micro_batch_size, 0) << "micro-batches cannot help";
  EXPECT_FALSE(r->offload_gradients.has_value()) << "the state alone is enough";
  held.fixed_bytes = 1500;
  r = policy(held);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->offload_optimizer, Offload::kHost);
  EXPECT_EQ(r->offload_gradients, Offload::kHost) << "the state alone is not enough";
  EXPECT_FALSE(r->offload_parameters.has_value());
  held.may_offload_parameters = true;
  held.parameter_bytes = 700;
  held.fixed_bytes = 1900;
  r = policy(held);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->offload_parameters, Offload::kHost) << "the parameters and gradients alone are too many";
  held.fixed_bytes = 1500;  // the parameters (800) fit, but not beside the largest gradient
  held.largest_gradient_bytes = 250;
  r = policy(held);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->offload_parameters, Offload::kHost) << "gradients sent to the host come to the device first";
  held.may_offload_parameters = false;
  r = policy(held);
  ASSERT_TRUE(r.has_value());
  EXPECT_FALSE(r->offload_parameters.has_value()) << "the parameters cannot be streamed: the gradients move";

  torch::manual_seed(7);
  Trainer t(net, even_nll, TrainerOptions().on_out_of_memory(OnOutOfMemory::kReplan)
                               .replan([](const OutOfMemoryEvent& ev) -> std::optional<Replan> {
                                 Replan x;
                                 x.micro_batch_size = ev.micro_batch_size;
                                 x.offload_gradients = Offload::kHost;
                                 return x;
                               }));
  BudgetGuard tight(torch::kCPU, memory_allocated() + 1024);
  expect_error([&] { t.train_step(batch_of(8, 0)); },
               "Replan::offload_gradients Offload::kHost adds the gradients into host masters, which only a state "
               "on the host has: set Replan::offload_optimizer to Offload::kHost too");
}

// Once a chain recomputes sqrt(n) segments, the default policy has it
// recompute each layer alone; then nothing is left where nothing can move.
// Evaluation changes nothing, so with kReplan a chunk that runs out of
// memory is read again in halves: every allocation of the first chunk fails
// in turn, and the result is the unfaulted one's up to float32 rounding.
TEST(Recovery, AnEvaluationChunkThatRunsOutOfMemoryIsReadAgainInHalves) {
  const auto& data = testing::fashion_test_head(96);
  auto make = [](OnOutOfMemory on) {
    torch::manual_seed(7);
    return Trainer(make_mlp(ModelOptions().width(32).depth(2)), TrainerOptions().eval_batch_size(64).on_out_of_memory(on));
  };
  Trainer plain = make(OnOutOfMemory::kReplan);
  const auto whole = plain.evaluate(data);
  EXPECT_EQ(whole.batch_size, 64);
  int64_t per_chunk = 0;
  {
    AllocationFault counter(0);
    plain.evaluate(testing::fashion_test_head(64));
    per_chunk = counter.allocations();
  }
  ASSERT_GT(per_chunk, 3);
  for (int64_t k = 1; k <= per_chunk; ++k) {
    Trainer t = make(OnOutOfMemory::kReplan);
    EvalResult r;
    {
      AllocationFault fault(k);
      r = t.evaluate(data);
      EXPECT_TRUE(fault.failed()) << "allocation " << k;
    }
    EXPECT_EQ(r.batch_size, 32) << "allocation " << k << ": the chunk of 64 was halved once";
    EXPECT_NEAR(r.loss, whole.loss, 1e-6 * whole.loss) << "allocation " << k;
    EXPECT_EQ(r.accuracy, whole.accuracy) << "allocation " << k;
  }
  Trainer throws = make(OnOutOfMemory::kThrow);
  AllocationFault fault(1);
  EXPECT_THROW(throws.evaluate(data), c10::OutOfMemoryError) << "kThrow: the error ends the evaluation";
}

// A user's own metric that adds up over the examples: eval_sum reads a part
// that runs out of memory again in halves, whichever allocation fails.
TEST(Recovery, EvalSumReadsAPartThatRunsOutOfMemoryAgainInHalves) {
  torch::manual_seed(7);
  Net net;
  auto make = [&](OnOutOfMemory on) { return Trainer(net, nll, TrainerOptions().on_out_of_memory(on)); };
  const auto batch = batch_of(64, 3);
  auto metric = [&](const torch::data::Example<>& b) {  // summed loss and correct predictions
    const auto out = net->forward(b.data);
    return torch::stack({torch::nll_loss(out, b.target, {}, at::Reduction::Sum).to(torch::kDouble),
                         out.argmax(1).eq(b.target).sum().to(torch::kDouble)});
  };
  Trainer t = make(OnOutOfMemory::kReplan);
  torch::Tensor whole;
  int64_t allocations = 0;
  {
    AllocationFault counter(0);
    whole = t.eval_sum(batch, metric);
    allocations = counter.allocations();
  }
  ASSERT_GT(allocations, 3);
  for (int64_t k = 1; k <= allocations; ++k) {
    torch::Tensor r;
    {
      AllocationFault fault(k);
      r = t.eval_sum(batch, metric);
      EXPECT_TRUE(fault.failed()) << "allocation " << k;
    }
    EXPECT_NEAR(r[0].item<double>(), whole[0].item<double>(), 1e-5 * whole[0].item<double>()) << "allocation " << k;
    EXPECT_EQ(r[1].item<double>(), whole[1].item<double>()) << "allocation " << k;
  }
  EXPECT_TRUE(net->is_training()) << "the module's mode is put back";
  Trainer throws = make(OnOutOfMemory::kThrow);
  AllocationFault fault(1);
  EXPECT_THROW(throws.eval_sum(batch, metric), c10::OutOfMemoryError) << "kThrow: the error ends it";
}

TEST(Recovery, TheDefaultPolicyRecomputesEachLayerAloneAfterSqrtSegmentsThenKeepsTheirInputsOnTheHost) {
  torch::manual_seed(7);
  Chained net;
  const auto policy = more_micro_batches(*net, false);
  OutOfMemoryEvent e;
  e.examples = 8;
  e.micro_batch_size = 1;  // nothing left to split
  auto r = policy(e);
  ASSERT_TRUE(r.has_value() && r->apply);
  EXPECT_EQ(r->description, "micro-batches of 1, recomputing 'chain' " + schedule_sqrt(15).to_string());
  r->apply();
  r = policy(e);
  ASSERT_TRUE(r.has_value() && r->apply);
  EXPECT_EQ(r->description, "micro-batches of 1, recomputing 'chain' " + schedule_every(15, 1).to_string());
  r->apply();
  EXPECT_EQ(net->chain->schedule().to_string(), schedule_every(15, 1).to_string());
  r = policy(e);
  ASSERT_TRUE(r.has_value() && r->apply);
  EXPECT_EQ(r->description, "micro-batches of 1, recomputing 'chain' " + schedule_every(15, 1).to_string() +
                                " with its checkpoints' inputs on the host");
  EXPECT_EQ(net->chain->checkpoint_options().offload(), Offload::kNone) << "nothing changes before apply";
  r->apply();
  EXPECT_EQ(net->chain->checkpoint_options().offload(), Offload::kHost);
  EXPECT_EQ(net->chain->schedule().to_string(), schedule_every(15, 1).to_string());
  EXPECT_FALSE(policy(e).has_value()) << "every layer recomputes alone from the host, and nothing can move";
}

// A request that, beside the bytes no recomputation moves, exceeds the limit
// is made under any schedule: the policy moves the state instead.
TEST(Recovery, TheDefaultPolicyMovesWhereTheRefusedRequestCannotFitUnderAnySchedule) {
  Chained net;
  const auto policy = more_micro_batches(*net, false);
  OutOfMemoryEvent e;
  e.examples = 8;
  e.micro_batch_size = 1;
  e.may_offload_optimizer = true;
  e.limit_bytes = 1000;
  e.fixed_bytes = 600;
  e.state_bytes = 400;
  e.peak_bytes = 950;
  e.needed_bytes = 1500;  // a request of at least 550 bytes: 1150 beside the 600
  auto r = policy(e);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->offload_optimizer, Offload::kHost);
  EXPECT_FALSE(r->apply) << "no schedule changes";
  e.needed_bytes = 1300;  // at least 350 bytes: 950 fit, so recomputing may help
  r = policy(e);
  ASSERT_TRUE(r.has_value() && r->apply);
  EXPECT_FALSE(r->offload_optimizer.has_value());
  EXPECT_EQ(r->description, "micro-batches of 1, recomputing 'chain' " + schedule_sqrt(15).to_string());
}

// A chain of `blocks` (BatchNorm, ReLU, Linear) blocks of width 64 between
// Linear(20, 64) and Linear(64, 5), in a Sequential as the Trainer takes it.
torch::nn::Sequential batch_norm_chain(int blocks, const CheckpointedSequentialOptions& options) {
  torch::manual_seed(7);
  torch::nn::Sequential layers;
  layers->push_back(torch::nn::Linear(20, 64));
  for (int i = 0; i < blocks; ++i) {
    layers->push_back(torch::nn::BatchNorm1d(64));
    layers->push_back(torch::nn::Functional(torch::relu));
    layers->push_back(torch::nn::Linear(64, 64));
  }
  layers->push_back(torch::nn::Linear(64, 5));
  return torch::nn::Sequential(CheckpointedSequential(layers, options));
}

// A module with batch statistics keeps its micro-batch: the default policy
// recomputes its chain instead, which gives the same gradients (the BatchNorm
// statistics of each step's batch).
TEST(Recovery, AModuleWithBatchStatisticsRecomputesItsChainInsteadOfMicroBatching) {
  auto make = [](ScheduleKind kind) { return batch_norm_chain(8, CheckpointedSequentialOptions().kind(kind)); };
  auto peak_of = [&](ScheduleKind kind) {
    Trainer t(make(kind), TrainerOptions());
    t.train_step(batch_of(128, 0));
    return t.train_step(batch_of(128, 1)).peak_bytes;
  };
  const int64_t plain_peak = peak_of(ScheduleKind::kNone), recomputed_peak = peak_of(ScheduleKind::kSqrt);
  ASSERT_LT(recomputed_peak, plain_peak);
  auto run = [&](bool drop) {
    auto model = make(ScheduleKind::kNone);
    Trainer t(model, TrainerOptions().on_out_of_memory(OnOutOfMemory::kReplan));
    std::vector<double> losses;
    for (int64_t i = 0; i < 6; ++i) {
      if (drop && i == 2) set_memory_budget(torch::kCPU, (plain_peak + recomputed_peak) / 2);
      losses.push_back(t.train_step(batch_of(128, i)).loss);
    }
    set_memory_budget(torch::kCPU, 0);
    UntrackedGuard host;  // the copies must not count against the next run's budget
    return std::make_tuple(losses, t.recoveries(), t.options().micro_batch_size(), copies(model->parameters()));
  };
  const auto [plain_losses, none, plain_micro, plain_params] = run(false);
  const auto [losses, recoveries, micro, params] = run(true);
  ASSERT_EQ(recoveries.size(), 1u);
  EXPECT_EQ(recoveries[0].step, 3);
  EXPECT_EQ(recoveries[0].after.rfind("recomputing '0' [0,", 0), 0u) << recoveries[0].after;
  EXPECT_EQ(micro, 0) << "the batch statistics stay the whole batch's";
  EXPECT_EQ(losses, plain_losses);
  expect_bitwise(params, plain_params, "parameters");
}

// Where recomputing each layer alone still holds too much, the chain keeps
// its checkpoints' inputs on the host: the same gradients bitwise, and the
// batch statistics still the whole batch's. Once the limit lifts, the run
// returns to its first schedule with its inputs on the device.
TEST(Recovery, AChainWhoseLayersRecomputeAloneKeepsTheirInputsOnTheHostAndTrainsBitwiseTheSame) {
  auto make = [](const CheckpointedSequentialOptions& options) { return batch_norm_chain(6, options); };
  auto peak_of = [&](const CheckpointedSequentialOptions& options) {  // the model's own bytes included
    const int64_t before = memory_allocated();
    Trainer t(make(options), TrainerOptions());
    t.train_step(batch_of(1024, 0));
    return t.train_step(batch_of(1024, 1)).peak_bytes - before;
  };
  // Each layer alone keeps every layer's input, as the plain chain does, and
  // recomputes as well: its peak is the highest. On the host, those inputs
  // leave the device.
  const auto alone = CheckpointedSequentialOptions().kind(ScheduleKind::kEvery).k(1);
  const int64_t sqrt_peak = peak_of(CheckpointedSequentialOptions().kind(ScheduleKind::kSqrt));
  const int64_t host_peak =
      peak_of(CheckpointedSequentialOptions(alone).checkpoint(CheckpointOptions().offload(Offload::kHost)));
  ASSERT_LT(host_peak, sqrt_peak);
  ASSERT_LT(sqrt_peak, peak_of(alone));
  auto run = [&](bool drop) {
    const int64_t before = memory_allocated();
    auto model = make(CheckpointedSequentialOptions());
    Trainer t(model, TrainerOptions().on_out_of_memory(OnOutOfMemory::kReplan).restore_after(2));
    std::vector<double> losses;
    for (int64_t i = 0; i < 8; ++i) {
      // Step 3 re-plans, steps 3 and 4 count as clean, and step 5 tries the
      // first plan again with the limit lifted.
      if (drop && i == 2) set_memory_budget(torch::kCPU, before + (sqrt_peak + host_peak) / 2);
      if (i == 4) set_memory_budget(torch::kCPU, 0);
      losses.push_back(t.train_step(batch_of(1024, i)).loss);
    }
    const auto chain = find_chains(*model)[0].chain;
    UntrackedGuard host;  // the copies must not count against the next run's budget
    return std::make_tuple(losses, t.recoveries(), chain->checkpoint_options().offload(),
                           chain->schedule().to_string(), copies(model->parameters()));
  };
  const auto [plain_losses, none, plain_offload, plain_schedule, plain_params] = run(false);
  const auto [losses, recoveries, offload, schedule, params] = run(true);
  ASSERT_EQ(recoveries.size(), 3u) << "sqrt(n) segments, each layer alone, then their inputs on the host";
  EXPECT_EQ(recoveries.back().step, 3);
  EXPECT_NE(recoveries.back().after.find("with its checkpoints' inputs on the host"), std::string::npos)
      << recoveries.back().after;
  EXPECT_EQ(recoveries.back().after.find("micro-batches"), std::string::npos) << "the batch statistics stay whole";
  EXPECT_EQ(losses, plain_losses);
  expect_bitwise(params, plain_params, "parameters");
  EXPECT_EQ(offload, Offload::kNone) << "restore_after: back to the inputs on the device";
  EXPECT_EQ(schedule, plain_schedule);
}

// With its checkpoints' inputs on the host (as recovery's last way to
// recompute sets them), failing any allocation of a step, the copies back
// included, leaves the state as it was, and the retry equals the step.
TEST(StepTransaction, FailingAnyAllocationWithCheckpointInputsOnTheHostLeavesTheStateAsItWas) {
  const auto options = CheckpointedSequentialOptions().kind(ScheduleKind::kEvery).k(1).checkpoint(
      CheckpointOptions().offload(Offload::kHost));
  auto reference_model = batch_norm_chain(3, options), model = batch_norm_chain(3, options);
  Trainer reference(reference_model, TrainerOptions()), trainer(model, TrainerOptions());
  reference.train_step(batch_of(24, 0));
  trainer.train_step(batch_of(24, 0));
  expect_each_failure_undone(reference, *reference_model, trainer, *model, batch_of(24, 1));
}

// An out-of-memory error after the optimizer step (on a GPU: the copy of
// fp32 masters into bf16 parameters, the fp16 scaler's update) is not undone,
// so the step is never run twice.
TEST(Recovery, AFailureAfterTheOptimizerStepIsNotRunAgain) {
  struct FailsAfterTheStep : StepComponent {
    int calls = 0;
    void after_optimizer_step(StepState&) override {
      ++calls;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory after the step");
    }
  };
  torch::manual_seed(7);
  Net net;
  Trainer trainer(net, nll, TrainerOptions().on_out_of_memory(OnOutOfMemory::kReplan));
  auto fails = std::make_shared<FailsAfterTheStep>();
  trainer.add_component(fails);
  expect_error([&] { trainer.train_step(batch_of(16, 0)); }, "after its optimizer step had changed the parameters");
  EXPECT_EQ(fails->calls, 1);
  EXPECT_TRUE(trainer.recoveries().empty());
}

TEST(Recovery, BadInputIsRefusedWhenTheTrainerIsBuilt) {
  Net bn(true);
  expect_error([&] { Trainer t(bn, nll, TrainerOptions().on_out_of_memory(OnOutOfMemory::kReplan)); },
               "changes the math of a module with batch statistics (BatchNorm 'norm')");
  Trainer allowed(bn, nll, TrainerOptions().on_out_of_memory(OnOutOfMemory::kReplan)
                               .replan(more_micro_batches(*bn, true)));
  Net net;
  expect_error([&] { Trainer t(net, nll, TrainerOptions().max_replans(-1)); }, "max_replans must be >= 0");
  expect_error([] { parse_on_out_of_memory("retry"); }, "expected throw or replan");
}

TEST(Recovery, AnOptimizerWhoseStepIsNotTransactionalIsNotRetriedAfterItBegan) {
  torch::manual_seed(7);
  Net net;
  Trainer trainer(net, nll, TrainerOptions().on_out_of_memory(OnOutOfMemory::kReplan).optimizer_factory(
                                [](std::vector<torch::Tensor> p) {
                                  return std::make_unique<torch::optim::Adam>(std::move(p));
                                }));
  trainer.train_step(batch_of(16, 0));
  // Count the step's allocations, then fail its last: inside the optimizer's step.
  int64_t n = 0;
  {
    Net probe_net;
    Trainer probe(probe_net, nll, TrainerOptions().optimizer_factory([](std::vector<torch::Tensor> p) {
      return std::make_unique<torch::optim::Adam>(std::move(p));
    }));
    probe.train_step(batch_of(16, 0));
    AllocationFault count(0);
    probe.train_step(batch_of(16, 1));
    n = count.allocations();
  }
  AllocationFault fail(n);
  expect_error([&] { trainer.train_step(batch_of(16, 1)); }, "inside the optimizer's step");
}

} // namespace
} // namespace memfit
