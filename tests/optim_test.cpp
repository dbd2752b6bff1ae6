// memfit::optim: LibTorch's SGD, Adam and AdamW, bitwise, with a step that
// completes or changes nothing when an allocation fails.
#include "memfit/compat.h"
#include "memfit/memory.h"
#include "memfit/optim.h"
#include "memory_internal.h"
#include "test_util.h"

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace memfit {
namespace {

using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

// Parameters of several shapes (a 0-dim one too), with seeded values.
std::vector<torch::Tensor> make_params() {
  torch::manual_seed(3);
  std::vector<torch::Tensor> params;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{17, 9}, {9}, {4, 3, 5}, {}}) {
    params.push_back(torch::randn(shape).requires_grad_());
  }
  return params;
}

// Gradients for step `i` (seeded per step; the last parameter has none on odd steps).
void set_grads(std::vector<torch::Tensor>& params, int64_t i) {
  torch::manual_seed(100 + i);
  for (size_t k = 0; k < params.size(); ++k) {
    params[k].mutable_grad() =
        (k + 1 == params.size() && i % 2 == 1) ? torch::Tensor() : torch::randn(params[k].sizes());
  }
}

using testing::copies;
using testing::expect_bitwise;
using testing::expect_error;
using testing::optimizer_state_of;

struct Case {
  std::string name;
  Factory libtorch, memfit;
};

std::vector<Case> cases() {
  using namespace torch::optim;
  std::vector<Case> out;
  for (double wd : {0.0, 0.1}) {
    for (bool amsgrad : {false, true}) {
      auto adam = AdamOptions(1e-2).weight_decay(wd).amsgrad(amsgrad).betas({0.8, 0.95});
      auto adamw = AdamWOptions(1e-2).weight_decay(wd).amsgrad(amsgrad);
      const std::string suffix = " wd " + std::to_string(wd) + (amsgrad ? " amsgrad" : "");
      out.push_back({"Adam" + suffix, [=](auto p) { return std::make_unique<torch::optim::Adam>(p, adam); },
                     [=](auto p) { return std::make_unique<optim::Adam>(p, adam); }});
      out.push_back({"AdamW" + suffix, [=](auto p) { return std::make_unique<torch::optim::AdamW>(p, adamw); },
                     [=](auto p) { return std::make_unique<optim::AdamW>(p, adamw); }});
    }
    for (double momentum : {0.0, 0.9}) {
      for (bool nesterov : {false, true}) {
        if (nesterov && momentum == 0) continue;
        for (double dampening : {0.0, 0.3}) {
          if (nesterov && dampening != 0) continue;  // LibTorch refuses Nesterov with dampening
          auto sgd = SGDOptions(0.05).weight_decay(wd).momentum(momentum).nesterov(nesterov).dampening(dampening);
          out.push_back({"SGD wd " + std::to_string(wd) + " momentum " + std::to_string(momentum) +
                             (nesterov ? " nesterov" : "") + " dampening " + std::to_string(dampening),
                         [=](auto p) { return std::make_unique<torch::optim::SGD>(p, sgd); },
                         [=](auto p) { return std::make_unique<optim::SGD>(p, sgd); }});
        }
      }
    }
  }
  return out;
}

TEST(Optim, EveryOptionStepsBitwiseAsLibTorchsOptimizerOver100Steps) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    auto a = make_params(), b = make_params();
    auto ours = c.memfit(a);
    auto theirs = c.libtorch(b);
    for (int64_t i = 0; i < 100; ++i) {
      set_grads(a, i);
      set_grads(b, i);
      ours->step();
      theirs->step();
    }
    expect_bitwise(copies(a), copies(b), "parameters");
    expect_bitwise(optimizer_state_of(*ours, a), optimizer_state_of(*theirs, b), "state");
  }
}

TEST(Optim, ParameterGroupsAndAnLRSchedulerWorkAsWithLibTorchs) {
  auto a = make_params(), b = make_params();
  auto groups = [](const std::vector<torch::Tensor>& p) {
    return std::vector<torch::optim::OptimizerParamGroup>{
        torch::optim::OptimizerParamGroup({p[0], p[1]}),
        torch::optim::OptimizerParamGroup({p[2], p[3]}, std::make_unique<torch::optim::AdamOptions>(5e-3))};
  };
  optim::Adam ours(groups(a), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam theirs(groups(b), torch::optim::AdamOptions(1e-2));
  torch::optim::StepLR s1(ours, 2, 0.5), s2(theirs, 2, 0.5);
  for (int64_t i = 0; i < 10; ++i) {
    set_grads(a, i);
    set_grads(b, i);
    ours.step();
    theirs.step();
    s1.step();
    s2.step();
  }
  expect_bitwise(copies(a), copies(b), "parameters");
}

// Fails each allocation of a step in turn: every failure leaves parameters
// and state bitwise as they were (the state a first step makes is dropped
// again), and the step then equals the uninterrupted one.
TEST(Optim, AStepThatFailsAnyAllocationChangesNothingAndThenStepsAsUninterrupted) {
  for (const auto& c : cases()) {
    for (int64_t warm : {0, 2}) {  // 0: the state is made by the failing step
      SCOPED_TRACE(c.name + ", warm steps " + std::to_string(warm));
      auto ref = make_params(), p = make_params();
      auto reference = c.memfit(ref);
      auto o = c.memfit(p);
      for (int64_t i = 0; i < warm; ++i) {
        set_grads(ref, i);
        set_grads(p, i);
        reference->step();
        o->step();
      }
      set_grads(ref, warm);
      set_grads(p, warm);
      int64_t allocations = 0;
      {
        AllocationFault count(0);
        reference->step();
        allocations = count.allocations();
      }
      // Adam's work buffer is always made; SGD without decay or Nesterov momentum allocates nothing
      // once its momentum buffers exist, and then nothing can fail.
      if (c.name.rfind("Adam", 0) == 0) EXPECT_GT(allocations, 0);
      for (int64_t k = 1; k <= allocations; ++k) {
        const auto params_before = copies(p);
        const auto state_before = optimizer_state_of(*o, p);
        {
          AllocationFault fail(k);
          EXPECT_THROW(o->step(), c10::OutOfMemoryError) << "allocation " << k << " of " << allocations;
        }
        expect_bitwise(copies(p), params_before, "parameters after failing allocation " + std::to_string(k));
        expect_bitwise(optimizer_state_of(*o, p), state_before, "state after failing allocation " + std::to_string(k));
      }
      o->step();
      expect_bitwise(copies(p), copies(ref), "parameters after the retried step");
      expect_bitwise(optimizer_state_of(*o, p), optimizer_state_of(*reference, ref), "state after the retried step");
    }
  }
}

TEST(Optim, SavedStateLoadsIntoLibTorchsOptimizerAndBack) {
  auto a = make_params(), b = make_params(), c = make_params();
  const auto options = torch::optim::AdamOptions(1e-2).amsgrad(true);
  optim::Adam ours(a, options);
  for (int64_t i = 0; i < 3; ++i) {
    set_grads(a, i);
    ours.step();
  }
  std::stringstream saved;
  torch::save(ours, saved);
  torch::optim::Adam theirs(b, options);
  torch::load(theirs, saved);
  for (size_t i = 0; i < b.size(); ++i) b[i].detach().copy_(a[i].detach());
  std::stringstream again;
  torch::save(theirs, again);
  optim::Adam back(c, options);
  torch::load(back, again);
  for (size_t i = 0; i < c.size(); ++i) c[i].detach().copy_(a[i].detach());
  for (int64_t i = 3; i < 6; ++i) {
    set_grads(a, i);
    set_grads(b, i);
    set_grads(c, i);
    ours.step();
    theirs.step();
    back.step();
  }
  expect_bitwise(copies(b), copies(a), "LibTorch's optimizer from memfit's state");
  expect_bitwise(copies(c), copies(a), "memfit's optimizer from LibTorch's state");
}

TEST(Optim, TheStepNeedsAtMostTwoLargestParametersOfWorkMemory) {
  // LibTorch's Adam makes two temporaries of each parameter (the square
  // root and the quotient) and a third with weight decay; memfit's one work
  // buffer as large as the largest parameter, two with weight decay.
  for (double wd : {0.0, 0.1}) {
    auto p = make_params();
    optim::Adam adam(p, torch::optim::AdamOptions(1e-3).weight_decay(wd));
    set_grads(p, 0);
    adam.step();  // the state exists
    set_grads(p, 2);
    PeakMeter meter;
    adam.step();
    const int64_t largest = 17 * 9 * 4;
    EXPECT_EQ(meter.peak_delta(), (wd != 0 ? 2 : 1) * largest) << "weight decay " << wd;
  }
}

TEST(Optim, TellsItsStateTypeAndWhetherItsStepIsTransactional) {
  auto p = make_params();
  optim::SGD sgd(p, torch::optim::SGDOptions(0.1));
  optim::AdamW adamw(p, torch::optim::AdamWOptions(0.1));
  torch::optim::RMSprop rmsprop(p, torch::optim::RMSpropOptions(0.1));
  EXPECT_TRUE(optim::is_transactional(sgd));
  EXPECT_TRUE(optim::is_transactional(adamw));
  EXPECT_FALSE(optim::is_transactional(rmsprop));
  EXPECT_EQ(optim::state_type_name(sgd), "torch::optim::SGD");
  EXPECT_EQ(optim::state_type_name(adamw), "torch::optim::AdamW");
  EXPECT_EQ(optim::state_type_name(rmsprop), "torch::optim::RMSprop");
}

TEST(Optim, SparseGradientsAreRefusedBeforeAnythingChanges) {
  auto p = make_params();
  optim::Adam adam(p);
  set_grads(p, 0);
  p[0].mutable_grad() = p[0].grad().to_sparse();
  const auto before = copies(p);
  expect_error([&] { adam.step(); }, "Adam does not support sparse gradients");
  expect_bitwise(copies(p), before, "parameters");
  EXPECT_TRUE(adam.state().empty());
}

TEST(Optim, BeforeCommitRunsAfterEveryAllocationAndWhenItThrowsTheStepChangesNothing) {
  for (const auto& c : cases()) {
    auto p = make_params();
    auto opt = c.memfit(p);
    set_grads(p, 0);
    const auto before = copies(p);
    // Thrown from between the phases (as another rank's failure is): nothing changes.
    {
      optim::BeforeCommit gate([] { TORCH_CHECK_WITH(OutOfMemoryError, false, "another rank failed"); });
      expect_error([&] { opt->step(); }, "another rank failed");
    }
    expect_bitwise(copies(p), before, c.name + " parameters");
    EXPECT_TRUE(opt->state().empty()) << c.name;
    // Called once, with everything the step allocates already made.
    int calls = 0;
    int64_t at_gate = 0;
    {
      optim::BeforeCommit gate([&] {
        ++calls;
        at_gate = memory_allocated(torch::kCPU);
        reset_peak_memory_stats(torch::kCPU);
      });
      opt->step();
    }
    EXPECT_EQ(calls, 1) << c.name;
    EXPECT_EQ(max_memory_allocated(torch::kCPU), at_gate) << c.name << ": the update after the gate allocated";
  }
}

} // namespace
} // namespace memfit
