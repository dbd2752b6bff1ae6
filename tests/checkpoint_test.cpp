// Behaviours of torch.utils.checkpoint (test_utils.py TestCheckpoint,
// test_autograd.py test_checkpointing*), ported to memfit::checkpoint.

#include "memfit/checkpoint.h"

#include "compat.h"
#include "memfit/precision.h"
#include "memfit/schedule.h"
#include "test_util.h"

#include <torch/torch.h>

namespace memfit {
namespace {

using testing::Seeded;
using testing::grads_of;
const auto zero_grads = testing::clear_grads;

void expect_bitwise_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << "gradient " << i;
    if (a[i].defined()) EXPECT_TRUE(torch::equal(a[i], b[i])) << "gradient " << i;
  }
}

torch::nn::Sequential mlp_chain(int layers, int width) {
  torch::nn::Sequential seq;
  for (int i = 0; i < layers; ++i) {
    seq->push_back(torch::nn::Linear(width, width));
    seq->push_back(torch::nn::Tanh());
  }
  return seq;
}

class Checkpoint : public Seeded {};

TEST_F(Checkpoint, OutputsAndGradientsEqualThePlainRunBitwise) {
  auto block = mlp_chain(3, 32);
  auto params = block->parameters();
  auto x = torch::randn({16, 32}, torch::requires_grad());

  auto plain = block->forward(x);
  plain.pow(2).sum().backward();
  auto plain_grads = grads_of(params);
  auto plain_x_grad = x.grad().clone();
  zero_grads(params);
  x.mutable_grad() = torch::Tensor();

  auto ck = checkpoint(block, x);
  EXPECT_TRUE(torch::equal(ck, plain));
  ck.pow(2).sum().backward();
  expect_bitwise_equal(grads_of(params), plain_grads);
  EXPECT_TRUE(torch::equal(x.grad(), plain_x_grad));
}

TEST_F(Checkpoint, InputsWithoutRequiresGradStillGiveParameterGradients) {
  auto block = mlp_chain(2, 16);
  auto params = block->parameters();
  auto x = torch::randn({8, 16});  // data: no requires_grad
  block->forward(x).sum().backward();
  auto plain = grads_of(params);
  zero_grads(params);
  checkpoint(block, x).sum().backward();
  expect_bitwise_equal(grads_of(params), plain);
  EXPECT_FALSE(x.grad().defined());
}

TEST_F(Checkpoint, NoOutputRequiringGradIsAClearError) {
  auto x = torch::randn({4});
  auto y = checkpoint([](const torch::Tensor& t) { return t * 2; }, x);
  try {
    y.sum().backward();
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("none of output has requires_grad=True"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(Checkpoint, DropoutRecomputesTheSameMask) {
  torch::nn::Linear lin(32, 32);
  auto fn = [&](const torch::Tensor& t) {
    return torch::dropout(torch::relu(lin(t)), 0.5, /*train=*/true);
  };
  auto x = torch::randn({64, 32}, torch::requires_grad());

  torch::manual_seed(42);
  auto plain = fn(x);
  plain.sum().backward();
  auto plain_grads = grads_of({lin->weight, lin->bias, x});
  auto after_plain = torch::rand({8});
  zero_grads({lin->weight, lin->bias, x});

  torch::manual_seed(42);
  auto ck = checkpoint(fn, x);
  EXPECT_TRUE(torch::equal(ck, plain));
  ck.sum().backward();
  expect_bitwise_equal(grads_of({lin->weight, lin->bias, x}), plain_grads);
  // The recomputation leaves the generator where the plain run left it.
  EXPECT_TRUE(torch::equal(torch::rand({8}), after_plain));
}

TEST_F(Checkpoint, WithoutPreservingRngStateDropoutDrawsANewMask) {
  torch::nn::Linear lin(32, 32);
  auto fn = [&](const torch::Tensor& t) { return torch::dropout(lin(t), 0.5, true); };
  auto x = torch::randn({64, 32});
  torch::manual_seed(42);
  fn(x).sum().backward();
  auto plain = lin->weight.grad().clone();
  zero_grads({lin->weight, lin->bias});
  torch::manual_seed(42);
  checkpoint(fn, x, CheckpointOptions().preserve_rng_state(false)).sum().backward();
  EXPECT_FALSE(torch::equal(lin->weight.grad(), plain));
}

TEST_F(Checkpoint, AutocastStateIsRestoredForRecomputation) {
  torch::nn::Linear lin(16, 16);
  auto x = torch::randn({8, 16}, torch::requires_grad());
  auto run = [&](bool ck) {
    zero_grads({lin->weight, lin->bias, x});
    torch::Tensor y;
    {
      AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      y = ck ? checkpoint(lin, x) : lin(x);
    }
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16) << "output keeps the reduced dtype";
    y.to(torch::kFloat).pow(2).sum().backward();  // backward outside autocast
    return grads_of({lin->weight, lin->bias, x});
  };
  const auto plain = run(false);
  const auto ck = run(true);
  expect_bitwise_equal(ck, plain);
  EXPECT_FALSE(compat::get_autocast_state().cpu_enabled) << "state restored after backward";
}

// A module that counts its forward calls.
struct CountingImpl : torch::nn::Module {
  explicit CountingImpl(int* count) : lin(register_module("lin", torch::nn::Linear(8, 8))), count(count) {}
  torch::Tensor forward(const torch::Tensor& x) {
    ++*count;
    return torch::relu(lin(x));
  }
  torch::nn::Linear lin;
  int* count;
};
TORCH_MODULE(Counting);

TEST_F(Checkpoint, SequentialTriggerCountsFirstSegmentTwiceLastOnce) {
  int counts[10] = {};
  torch::nn::Sequential seq;
  for (int i = 0; i < 10; ++i) seq->push_back(Counting(&counts[i]));
  auto x = torch::randn({4, 8}, torch::requires_grad());
  auto y = checkpoint_sequential(seq, 2, x);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(counts[i], 1) << "after forward, module " << i;
  y.sum().backward();
  for (int i = 0; i < 5; ++i) EXPECT_EQ(counts[i], 2) << "checkpointed module " << i;
  for (int i = 5; i < 10; ++i) EXPECT_EQ(counts[i], 1) << "last segment module " << i;
}

TEST_F(Checkpoint, CheckpointSequentialEqualsThePlainRunForEverySegmentCount) {
  auto seq = mlp_chain(5, 16);  // 10 modules
  auto params = seq->parameters();
  auto x = torch::randn({8, 16}, torch::requires_grad());
  auto plain_y = seq->forward(x);
  plain_y.sum().backward();
  auto plain = grads_of(params);
  auto plain_x = x.grad().clone();
  for (int64_t segments : {1, 2, 3, 4, 5, 10, 11}) {
    zero_grads(params);
    x.mutable_grad() = torch::Tensor();
    auto y = checkpoint_sequential(seq, segments, x);
    EXPECT_TRUE(torch::equal(y, plain_y)) << segments << " segments";
    y.sum().backward();
    expect_bitwise_equal(grads_of(params), plain);
    EXPECT_TRUE(torch::equal(x.grad(), plain_x)) << segments << " segments";
  }
  EXPECT_THROW(checkpoint_sequential(seq, 0, x), c10::Error);
}

TEST_F(Checkpoint, SecondBackwardThroughAFreedGraphIsAnError) {
  torch::nn::Linear lin(4, 4);
  auto y = checkpoint(lin, torch::randn({2, 4})).sum();
  y.backward();
  try {
    y.backward();
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("second time"), std::string::npos) << e.what();
  }
}

TEST_F(Checkpoint, RetainGraphAllowsASecondBackward) {
  torch::nn::Linear lin(4, 4);
  auto x = torch::randn({2, 4});
  lin(x).sum().backward();
  lin(x).sum().backward();
  auto twice = lin->weight.grad().clone();
  zero_grads({lin->weight, lin->bias});
  auto y = checkpoint(lin, x).sum();
  y.backward({}, /*retain_graph=*/true);
  y.backward();
  EXPECT_TRUE(torch::equal(lin->weight.grad(), twice));
}

TEST_F(Checkpoint, HigherOrderGradientsAndGradWithInputsAreClearErrors) {
  torch::nn::Linear lin(4, 4);
  auto x = torch::randn({2, 4}, torch::requires_grad());
  auto y = checkpoint(lin, x).pow(2).sum();
  try {
    y.backward({}, /*retain_graph=*/true, /*create_graph=*/true);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("higher-order"), std::string::npos) << e.what();
  }
  try {
    torch::autograd::grad({y}, {x});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("autograd::grad()"), std::string::npos) << e.what();
  }
}

TEST_F(Checkpoint, AFunctionModifyingItsInputInPlaceIsRefusedAtForward) {
  torch::nn::Linear lin(4, 4);
  auto h = lin(torch::randn({2, 4}));  // a non-leaf activation
  try {
    checkpoint([&](const torch::Tensor& t) { return lin(t.relu_()); }, h);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("in place"), std::string::npos) << e.what();
  }
}

TEST_F(Checkpoint, UnderNoGradItSimplyRuns) {
  torch::nn::Linear lin(4, 4);
  torch::NoGradGuard no_grad;
  auto y = checkpoint(lin, torch::randn({2, 4}));
  EXPECT_FALSE(y.requires_grad());
}

TEST_F(Checkpoint, SeveralInputsAndOutputsWithAnUnusedOutput) {
  auto a = torch::randn({3, 3}, torch::requires_grad());
  auto b = torch::randn({3, 3}, torch::requires_grad());
  auto c = torch::randn({3, 3});  // no grad
  auto fn = [](const std::vector<torch::Tensor>& in) {
    return std::vector<torch::Tensor>{in[0].mm(in[1]) + in[2], in[1].sin()};
  };
  auto plain = fn({a, b, c});
  plain[0].sum().backward();
  auto ga = a.grad().clone(), gb = b.grad().clone();
  a.mutable_grad() = torch::Tensor();
  b.mutable_grad() = torch::Tensor();
  auto outs = checkpoint(fn, {a, b, c});
  ASSERT_EQ(outs.size(), 2u);
  outs[0].sum().backward();  // outs[1] gets no gradient
  EXPECT_TRUE(torch::equal(a.grad(), ga));
  EXPECT_TRUE(torch::equal(b.grad(), gb));
}

TEST_F(Checkpoint, KeepsOnlyItsInputsUntilBackward) {
  auto block = mlp_chain(4, 256);
  auto x = torch::randn({128, 256});  // 128 KiB
  const int64_t base = memory_allocated();
  auto plain = block->forward(x);
  const int64_t plain_kept = memory_allocated() - base;
  plain = torch::Tensor();
  EXPECT_EQ(memory_allocated(), base);
  auto y = checkpoint(block, x);
  // Only the output (128 KiB): the input is the caller's, the activations are gone.
  EXPECT_EQ(memory_allocated() - base, 128 * 256 * 4);
  // Plain keeps the 4 tanh outputs (each also the next Linear's saved input).
  EXPECT_EQ(plain_kept, 4 * 128 * 256 * 4);
  y.sum().backward();
}

TEST_F(Checkpoint, OffloadedInputsLiveInHostMemoryAndGradientsAreUnchanged) {
  auto block = mlp_chain(2, 64);
  auto params = block->parameters();
  auto make_input = [] { torch::manual_seed(5); return torch::randn({32, 64}).mul(2); };
  auto x0 = make_input();
  block->forward(x0).sum().backward();
  auto plain = grads_of(params);
  zero_grads(params);

  const int64_t input_bytes = 32 * 64 * 4;
  for (Offload where : {Offload::kNone, Offload::kHost}) {
    zero_grads(params);
    auto x = make_input();  // counted device memory, owned by nobody else below
    const int64_t base = memory_allocated() - input_bytes;
    auto y = checkpoint(block, x, CheckpointOptions().offload(where));
    x = torch::Tensor();  // the caller lets go of the input
    const int64_t kept = memory_allocated() - base;
    if (where == Offload::kHost) {
      EXPECT_EQ(kept, input_bytes) << "only the output: the saved input is a host copy";
    } else {
      EXPECT_EQ(kept, 2 * input_bytes) << "output and the saved input";
    }
    y.sum().backward();
    expect_bitwise_equal(grads_of(params), plain);
  }
}

class CudaCheckpoint : public testing::OnCuda {};

TEST_F(CudaCheckpoint, DropoutRecomputesTheSameMaskWithTheCudaGenerator) {
  torch::nn::Linear lin(64, 64);
  lin->to(cuda);
  auto fn = [&](const torch::Tensor& t) {
    return torch::dropout(torch::relu(lin(t)), 0.5, /*train=*/true);
  };
  auto x = torch::randn({128, 64}, torch::TensorOptions().device(cuda).requires_grad(true));
  torch::cuda::manual_seed(42);
  auto plain = fn(x);
  plain.sum().backward();
  auto plain_grads = grads_of({lin->weight, lin->bias, x});
  auto after_plain = torch::rand({8}, torch::TensorOptions().device(cuda));
  zero_grads({lin->weight, lin->bias, x});

  torch::cuda::manual_seed(42);
  auto ck = checkpoint(fn, x);
  EXPECT_TRUE(torch::equal(ck, plain));
  ck.sum().backward();
  expect_bitwise_equal(grads_of({lin->weight, lin->bias, x}), plain_grads);
  EXPECT_TRUE(torch::equal(torch::rand({8}, torch::TensorOptions().device(cuda)), after_plain))
      << "the recomputation leaves the CUDA generator where the plain run left it";
}

TEST_F(CudaCheckpoint, HostOffloadKeepsTheSavedInputOffTheDevice) {
  auto block = mlp_chain(3, 256);
  block->to(cuda);
  auto params = block->parameters();
  auto make_input = [&] {
    torch::manual_seed(5);
    return torch::randn({512, 256}).to(cuda).mul(2);  // not a leaf the graph would keep
  };
  auto x0 = make_input();
  block->forward(x0).sum().backward();
  const auto plain = grads_of(params);
  const int64_t input_bytes = 512 * 256 * 4;
  for (Offload where : {Offload::kNone, Offload::kHost}) {
    zero_grads(params);
    auto x = make_input();
    const int64_t base = memory_allocated(cuda) - input_bytes;
    auto y = checkpoint(block, x, CheckpointOptions().offload(where));
    x = torch::Tensor();
    const int64_t kept = memory_allocated(cuda) - base;
    EXPECT_EQ(kept, where == Offload::kHost ? input_bytes : 2 * input_bytes);
    y.sum().backward();
    expect_bitwise_equal(grads_of(params), plain);
  }
}

TEST_F(CudaCheckpoint, SqrtScheduleCutsActivationMemoryOnTheDevice) {
  auto chain = mlp_chain(32, 512);
  chain->to(cuda);
  // Frozen parameters: the 32 MiB of weight gradients would otherwise dominate the peak.
  for (auto& p : chain->parameters()) p.set_requires_grad(false);
  auto x = torch::randn({256, 512}, torch::TensorOptions().device(cuda).requires_grad(true));
  auto peak_of = [&](ScheduleKind kind) {
    CheckpointedSequential model(chain, CheckpointedSequentialOptions().kind(kind));
    zero_grads(chain->parameters());
    x.mutable_grad() = torch::Tensor();
    empty_cache(cuda);
    PeakMeter meter(cuda);
    model->forward(x).sum().backward();
    return meter.peak_delta();
  };
  const int64_t none = peak_of(ScheduleKind::kNone);
  const int64_t sqrt_peak = peak_of(ScheduleKind::kSqrt);
  EXPECT_LT(sqrt_peak, none / 2) << "none " << none << " sqrt " << sqrt_peak;
}

} // namespace
} // namespace memfit
