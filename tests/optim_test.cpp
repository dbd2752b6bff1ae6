// memfit::optim: LibTorch's SGD, Adam and AdamW, bitwise on the loop kernel
// and within rounding on the fused one, with a step that completes or
// changes nothing when an allocation fails.
#include "compat.h"
#include "memfit/memory.h"
#include "memfit/optim.h"
#include "memfit/precision.h"
#include "memory_internal.h"
#include "test_util.h"

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace memfit {
namespace {

using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;
using KernelFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>, optim::Kernel)>;

// The kernels this LibTorch has for the CPU, the loop first.
std::vector<optim::Kernel> kernels() {
  std::vector<optim::Kernel> out{optim::Kernel::kLoop};
  if (optim::has_fused_kernels(torch::kCPU)) out.push_back(optim::Kernel::kFused);
  return out;
}

std::string kernel_text(optim::Kernel k) { return std::string(", kernel ") + optim::kernel_name(k); }

// Expects every tensor of `a` within `tolerance` of `b`'s, relative to its norm.
void expect_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, double tolerance,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << what << ": tensor " << i << " defined in one only";
    if (!a[i].defined()) continue;
    const double d = testing::relative_difference(a[i].to(torch::kDouble), b[i].to(torch::kDouble));
    EXPECT_LE(d, tolerance) << what << ": tensor " << i;
  }
}

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
  Factory libtorch;
  KernelFactory memfit;
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
                     [=](auto p, optim::Kernel k) { return std::make_unique<optim::Adam>(p, adam, k); }});
      out.push_back({"AdamW" + suffix, [=](auto p) { return std::make_unique<torch::optim::AdamW>(p, adamw); },
                     [=](auto p, optim::Kernel k) { return std::make_unique<optim::AdamW>(p, adamw, k); }});
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
                         [=](auto p, optim::Kernel k) { return std::make_unique<optim::SGD>(p, sgd, k); }});
        }
      }
    }
  }
  return out;
}

// Bitwise on the loop kernel; within 1e-6 relative on the fused one (where
// LibTorch has it), whose kernel rounds in its own order.
TEST(Optim, EveryOptionStepsAsLibTorchsOptimizerOver100StepsBitwiseOnTheLoopWithin1e6Fused) {
  for (const auto kernel : kernels()) {
    for (const auto& c : cases()) {
      SCOPED_TRACE(c.name + kernel_text(kernel));
      auto a = make_params(), b = make_params();
      auto ours = c.memfit(a, kernel);
      auto theirs = c.libtorch(b);
      for (int64_t i = 0; i < 100; ++i) {
        set_grads(a, i);
        set_grads(b, i);
        ours->step();
        theirs->step();
      }
      EXPECT_EQ(optim::kernel_ran(*ours), optim::kernel_name(kernel));
      if (kernel == optim::Kernel::kLoop) {
        expect_bitwise(copies(a), copies(b), "parameters");
        expect_bitwise(optimizer_state_of(*ours, a), optimizer_state_of(*theirs, b), "state");
      } else {
        expect_close(copies(a), copies(b), 1e-6, "parameters");
        expect_close(optimizer_state_of(*ours, a), optimizer_state_of(*theirs, b), 1e-6, "state");
      }
    }
  }
}

TEST(Optim, TheDefaultKernelIsTheFusedOneWhereLibTorchHasItAndTheLoopElsewhere) {
  auto p = make_params();
  optim::Adam adam(p, torch::optim::AdamOptions(1e-3));
  EXPECT_EQ(adam.kernel(), optim::Kernel::kAuto);
  EXPECT_EQ(optim::kernel_ran(adam), "none");
  set_grads(p, 0);
  adam.step();
  EXPECT_EQ(optim::kernel_ran(adam), optim::has_fused_kernels(torch::kCPU) ? "fused" : "loop");
  torch::optim::Adam plain(p);
  EXPECT_EQ(optim::kernel_ran(plain), "libtorch");
  if (!optim::has_fused_kernels(torch::kCPU)) {
    expect_error([&] { optim::SGD sgd(p, torch::optim::SGDOptions(0.1), optim::Kernel::kFused); },
                 "memfit::optim::Kernel::kFused needs LibTorch 2.4 or later, and this is LibTorch");
  }
}

// A parameter the fused kernel cannot take (here a non-contiguous one) is
// stepped by the loop, bitwise LibTorch's, with one warning when kFused was asked for.
TEST(Optim, AParameterTheFusedKernelCannotTakeIsSteppedByTheLoopWithOneWarning) {
  if (!optim::has_fused_kernels(torch::kCPU)) GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no fused kernels";
  auto make = [] {
    torch::manual_seed(5);
    return std::vector<torch::Tensor>{torch::randn({6, 4}).t().requires_grad_()};
  };
  auto a = make(), b = make();
  ASSERT_FALSE(a[0].is_contiguous());
  optim::Adam ours(a, torch::optim::AdamOptions(1e-2), optim::Kernel::kFused);
  torch::optim::Adam theirs(b, torch::optim::AdamOptions(1e-2));
  compat::WarningCapture warnings;
  for (int64_t i = 0; i < 3; ++i) {
    set_grads(a, 2 * i);
    set_grads(b, 2 * i);
    ours.step();
    theirs.step();
  }
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("memfit::optim::Adam steps a non-contiguous parameter, gradient or state"),
            std::string::npos)
      << warnings.messages[0];
  EXPECT_EQ(optim::kernel_ran(ours), "loop");
  expect_bitwise(copies(a), copies(b), "parameters");
}

// One group holding parameters of two dtypes: the fused kernel is called
// per dtype, and each parameter steps as LibTorch's optimizer steps it.
TEST(Optim, AGroupOfSeveralDtypesIsSteppedOneDtypeAtATime) {
  auto make = [] {
    auto p = make_params();
    p[1] = p[1].detach().to(torch::kDouble).requires_grad_();
    p[2] = p[2].detach().to(torch::kDouble).requires_grad_();
    return p;
  };
  for (const auto kernel : kernels()) {
    SCOPED_TRACE(kernel_text(kernel));
    auto a = make(), b = make();
    optim::AdamW ours(a, torch::optim::AdamWOptions(1e-2).weight_decay(0.1), kernel);
    torch::optim::AdamW theirs(b, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    for (int64_t i = 0; i < 20; ++i) {
      set_grads(a, i);
      set_grads(b, i);
      for (size_t k = 1; k < 3; ++k) {
        a[k].mutable_grad() = a[k].grad().to(torch::kDouble);
        b[k].mutable_grad() = b[k].grad().to(torch::kDouble);
      }
      ours.step();
      theirs.step();
    }
    EXPECT_EQ(optim::kernel_ran(ours), optim::kernel_name(kernel));
    EXPECT_EQ(a[1].scalar_type(), torch::kDouble);
    expect_close(copies(a), copies(b), kernel == optim::Kernel::kLoop ? 0.0 : 1e-6, "parameters");
  }
}

TEST(Optim, ParameterGroupsAndAnLRSchedulerWorkAsWithLibTorchs) {
  for (const auto kernel : kernels()) {
    SCOPED_TRACE(kernel_text(kernel));
    auto a = make_params(), b = make_params();
    auto groups = [](const std::vector<torch::Tensor>& p) {
      return std::vector<torch::optim::OptimizerParamGroup>{
          torch::optim::OptimizerParamGroup({p[0], p[1]}),
          torch::optim::OptimizerParamGroup({p[2], p[3]}, std::make_unique<torch::optim::AdamOptions>(5e-3))};
    };
    optim::Adam ours(groups(a), torch::optim::AdamOptions(1e-2), kernel);
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
    if (kernel == optim::Kernel::kLoop) expect_bitwise(copies(a), copies(b), "parameters");
    expect_close(copies(a), copies(b), 1e-6, "parameters");
  }
}

// Fails each allocation of a step in turn: every failure leaves parameters
// and state bitwise as they were (the state a first step makes is dropped
// again), and the step then equals the uninterrupted one.
TEST(Optim, AStepThatFailsAnyAllocationChangesNothingAndThenStepsAsUninterrupted) {
  for (const auto& c : cases()) {
    for (const auto kernel : kernels()) {
    for (int64_t warm : {0, 2}) {  // 0: the state is made by the failing step
      SCOPED_TRACE(c.name + kernel_text(kernel) + ", warm steps " + std::to_string(warm));
      auto ref = make_params(), p = make_params();
      auto reference = c.memfit(ref, kernel);
      auto o = c.memfit(p, kernel);
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
      // Adam's work buffer (loop) or step counts (fused) are always made; SGD without decay or
      // Nesterov momentum allocates nothing once its momentum buffers exist, and then nothing can fail.
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
}

TEST(Optim, SavedStateLoadsIntoLibTorchsOptimizerAndBack) {
  auto a = make_params(), b = make_params(), c = make_params();
  const auto options = torch::optim::AdamOptions(1e-2).amsgrad(true);
  optim::Adam ours(a, options, optim::Kernel::kLoop);
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
  optim::Adam back(c, options, optim::Kernel::kLoop);
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
  // root and the quotient) and a third with weight decay; memfit's loop one
  // work buffer as large as the largest parameter, two with weight decay;
  // the fused kernel none, only its float32 step counts (one per step value).
  for (const auto kernel : kernels()) {
    for (double wd : {0.0, 0.1}) {
      auto p = make_params();
      optim::Adam adam(p, torch::optim::AdamOptions(1e-3).weight_decay(wd), kernel);
      set_grads(p, 0);
      adam.step();
      set_grads(p, 1);
      adam.step();  // the state exists; the last parameter (no gradient at step 1) is a step behind
      set_grads(p, 2);
      PeakMeter meter;
      adam.step();
      const int64_t largest = 17 * 9 * 4;
      const int64_t expected = kernel == optim::Kernel::kFused ? 2 * 4 : (wd != 0 ? 2 : 1) * largest;
      EXPECT_EQ(meter.peak_delta(), expected) << "weight decay " << wd << kernel_text(kernel);
    }
  }
}

// Counts the ATen calls named `name` on this thread while alive.
class OpCount {
 public:
  explicit OpCount(const char* name)
      : handle_(at::addThreadLocalCallback(at::RecordFunctionCallback(&OpCount::seen))) {
    name_ = name;
    count = 0;
  }
  ~OpCount() { at::removeCallback(handle_); }
  static std::atomic<int64_t> count;

 private:
  static std::unique_ptr<at::ObserverContext> seen(const at::RecordFunction& fn) {
    if (std::strcmp(fn.name(), name_) == 0) ++count;
    return nullptr;
  }
  static const char* name_;
  at::CallbackHandle handle_;
};
std::atomic<int64_t> OpCount::count{0};
const char* OpCount::name_ = "";

// GradScaler hands its scale to memfit's fused kernel, which divides it out
// as it updates (PyTorch's fused=True): the parameters, state and scale are
// bitwise those of unscaling first and stepping, with no unscaling multiply
// of its own; a step whose gradients overflow is skipped by both.
TEST(Optim, GradScalerHandsItsScaleToTheFusedKernelWhichStepsAsUnscalingFirstDoes) {
  if (!optim::has_fused_kernels(torch::kCPU)) {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no fused CPU kernels (2.4 and later have)";
  }
  for (const auto& c : cases()) {
    auto in_kernel = make_params();
    auto first = copies(in_kernel);
    for (auto& t : first) t.requires_grad_();
    auto a = c.memfit(in_kernel, optim::Kernel::kFused);
    auto b = c.memfit(first, optim::Kernel::kFused);
    GradScaler scaler_a(GradScalerOptions().init_scale(1024.).growth_interval(2));
    GradScaler scaler_b(GradScalerOptions().init_scale(1024.).growth_interval(2));
    for (int64_t i = 0; i < 6; ++i) {
      const double scale = scaler_a.get_scale();
      scaler_a.scale(torch::ones({}));
      scaler_b.scale(torch::ones({}));
      set_grads(in_kernel, i);
      set_grads(first, i);
      for (auto* params : {&in_kernel, &first}) {
        for (auto& p : *params) {
          if (p.grad().defined()) p.mutable_grad().mul_(scale);  // a power of two: exact
        }
        if (i == 3) (*params)[0].mutable_grad()[0][0] = std::numeric_limits<float>::infinity();
      }
      ASSERT_TRUE(dynamic_cast<optim::KernelChoice&>(*a).can_unscale_in_kernel()) << c.name;
      bool stepped_a = false;
      {
        OpCount muls("aten::mul_");
        stepped_a = scaler_a.step(*a);
        EXPECT_EQ(OpCount::count.load(), 0) << c.name << ": the kernel unscales, not a multiply of its own";
      }
      scaler_b.unscale_(*b);
      const bool stepped_b = scaler_b.step(*b);
      EXPECT_EQ(stepped_a, i != 3) << c.name << " step " << i;
      EXPECT_EQ(stepped_a, stepped_b) << c.name << " step " << i;
      scaler_a.update();
      scaler_b.update();
      expect_bitwise(in_kernel, first, c.name + " step " + std::to_string(i));
      EXPECT_EQ(scaler_a.get_scale(), scaler_b.get_scale()) << c.name;
    }
    expect_bitwise(optimizer_state_of(*a, in_kernel), optimizer_state_of(*b, first), c.name + ": state");
  }
}

// The scaler's step on the fused kernel fails any allocation without a
// trace: parameters, gradients and state stay bitwise as they were, and
// after GradScaler::discard_step (what the Trainer's transaction calls) the
// retried step equals the uninterrupted one.
TEST(Optim, AScaledFusedStepThatFailsAnyAllocationChangesNothing) {
  if (!optim::has_fused_kernels(torch::kCPU)) {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no fused CPU kernels (2.4 and later have)";
  }
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    auto ref = make_params(), p = make_params();
    auto reference = c.memfit(ref, optim::Kernel::kFused);
    auto o = c.memfit(p, optim::Kernel::kFused);
    GradScaler ref_scaler(GradScalerOptions().init_scale(64.)), scaler(GradScalerOptions().init_scale(64.));
    ref_scaler.scale(torch::ones({}));
    scaler.scale(torch::ones({}));
    set_grads(ref, 0);
    set_grads(p, 0);
    int64_t allocations = 0;
    {
      AllocationFault count(0);
      ref_scaler.step(*reference);
      allocations = count.allocations();
    }
    EXPECT_GT(allocations, 0) << "the inf check allocates";
    for (int64_t k = 1; k <= allocations; ++k) {
      const auto params_before = copies(p);
      std::vector<torch::Tensor> grads_before;
      for (const auto& t : p) grads_before.push_back(t.grad().defined() ? t.grad().clone() : torch::Tensor());
      const auto state_before = optimizer_state_of(*o, p);
      {
        AllocationFault fail(k);
        EXPECT_THROW(scaler.step(*o), c10::OutOfMemoryError) << "allocation " << k << " of " << allocations;
      }
      scaler.discard_step();
      std::vector<torch::Tensor> grads_after;
      for (const auto& t : p) grads_after.push_back(t.grad());
      expect_bitwise(copies(p), params_before, "parameters after failing allocation " + std::to_string(k));
      expect_bitwise(grads_after, grads_before, "gradients after failing allocation " + std::to_string(k));
      expect_bitwise(optimizer_state_of(*o, p), state_before, "state after failing allocation " + std::to_string(k));
    }
    EXPECT_TRUE(scaler.step(*o));
    expect_bitwise(copies(p), copies(ref), "parameters after the retried step");
    expect_bitwise(optimizer_state_of(*o, p), optimizer_state_of(*reference, ref), "state after the retried step");
  }
}

// Handed found_inf, the fused kernel skips by itself: Adam and AdamW read
// nothing back to the host, and SGD only where its step would make momentum
// buffers. A skipped step changes no parameter, and the step counts stay:
// parameters and state equal, bitwise, an optimizer that the host skipped,
// and save() writes the counts the state holds.
TEST(Optim, HandedFoundInfTheFusedKernelSkipsWithoutAReadAndItsStepCountsStay) {
  if (!optim::has_fused_kernels(torch::kCPU)) {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no fused CPU kernels (2.4 and later have)";
  }
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    auto p = make_params(), ref = make_params();
    auto o = c.memfit(p, optim::Kernel::kFused);
    auto r = c.memfit(ref, optim::Kernel::kFused);
    auto& kernel = dynamic_cast<optim::KernelChoice&>(*o);
    const bool sgd = dynamic_cast<optim::SGD*>(o.get()) != nullptr;
    for (int64_t i = 0; i < 6; ++i) {
      const bool inf = i == 0 || i == 3;  // the first step too: Adam's state is made, SGD's is not
      set_grads(p, i);
      set_grads(ref, i);
      const int64_t expected_reads = sgd && optim::lazy_state_bytes(*o) > 0 ? 1 : 0;
      {
        testing::HostReads reads;
        kernel.step_unscaling(torch::ones({}), torch::full({1}, inf ? 1.f : 0.f));
        EXPECT_EQ(reads.count(), expected_reads) << "step " << i;
      }
      if (!inf) r->step();
      expect_bitwise(copies(p), copies(ref), "parameters after step " + std::to_string(i));
    }
    std::stringstream saved;
    torch::save(*o, saved);  // before anything reads the counts back
    auto loaded_params = make_params();
    auto loaded = c.libtorch(loaded_params);
    torch::load(*loaded, saved);
    expect_bitwise(optimizer_state_of(*loaded, loaded_params), optimizer_state_of(*r, ref), "saved state");
    expect_bitwise(optimizer_state_of(*o, p), optimizer_state_of(*r, ref), "state");
  }
}

// GradScaler::step_async on the fused kernel reads nothing and hands back
// the kernel's decision; on the loop kernel the host decides, as step() does.
TEST(Optim, GradScalerStepAsyncLeavesTheFusedKernelsDecisionUnread) {
  for (const auto kernel : kernels()) {
    SCOPED_TRACE(kernel_text(kernel));
    auto p = make_params();
    optim::Adam adam(p, torch::optim::AdamOptions(1e-2), kernel);
    GradScaler scaler(GradScalerOptions().init_scale(8.));
    for (int64_t i = 0; i < 4; ++i) {
      scaler.scale(torch::ones({}));
      set_grads(p, i);
      if (i == 2) p[0].mutable_grad()[0][0] = std::numeric_limits<float>::infinity();
      ScaledStep r;
      {
        testing::HostReads reads;
        r = scaler.step_async(adam);
        EXPECT_EQ(reads.count(), kernel == optim::Kernel::kFused ? 0 : 1) << "step " << i;
      }
      EXPECT_EQ(r.found_inf.defined(), kernel == optim::Kernel::kFused);
      const bool skipped = r.found_inf.defined() ? r.found_inf.item<double>() != 0 : !r.stepped;
      EXPECT_EQ(skipped, i == 2) << "step " << i;
      scaler.update();
    }
  }
}

// step_unscaling refuses, before anything changes, a parameter that the
// fused kernel cannot take, and can_unscale_in_kernel says so beforehand.
TEST(Optim, StepUnscalingRefusesWhatTheFusedKernelCannotTakeBeforeAnythingChanges) {
  auto params = make_params();
  set_grads(params, 0);
  optim::Adam loop(params, torch::optim::AdamOptions(1e-2), optim::Kernel::kLoop);
  EXPECT_FALSE(loop.can_unscale_in_kernel());
  const auto before = copies(params);
  expect_error([&] { loop.step_unscaling(torch::full({}, 4.f)); }, "GradScaler::unscale_");
  expect_bitwise(params, before, "a refused step_unscaling");
  EXPECT_TRUE(loop.state().empty()) << "no state made";
  const bool fused = optim::has_fused_kernels(torch::kCPU);
  optim::SGD sgd(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  EXPECT_EQ(sgd.can_unscale_in_kernel(), fused);
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
    for (const auto kernel : kernels()) {
    SCOPED_TRACE(kernel_text(kernel));
    auto p = make_params();
    auto opt = c.memfit(p, kernel);
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
}

} // namespace
} // namespace memfit
