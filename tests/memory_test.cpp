#include "memfit/memory.h"

#include "compat.h"

#include "memory_internal.h"
#include "test_util.h"

#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include <atomic>
#include <iostream>
#include <thread>
#include <vector>

namespace memfit {
namespace {

using testing::Seeded;

int64_t now() { return memory_allocated(torch::kCPU); }

class MemoryAllocated : public Seeded {};

TEST_F(MemoryAllocated, CountsExactTensorBytesForEveryDtype) {
  const int64_t base = now();
  auto f32 = torch::empty({3, 5}, torch::kFloat32);
  EXPECT_EQ(now() - base, 60);
  auto f64 = torch::empty({7}, torch::kFloat64);
  EXPECT_EQ(now() - base, 60 + 56);
  auto u8 = torch::empty({13}, torch::kUInt8);
  EXPECT_EQ(now() - base, 60 + 56 + 13);
  auto bf16 = torch::empty({9}, torch::kBFloat16);
  EXPECT_EQ(now() - base, 60 + 56 + 13 + 18);
  auto i64 = torch::arange(10, torch::kInt64);
  EXPECT_EQ(now() - base, 60 + 56 + 13 + 18 + 80);
}

TEST_F(MemoryAllocated, FreesReturnEveryByte) {
  const int64_t base = now();
  {
    auto a = torch::randn({128, 64});
    auto b = torch::randn({17});
    EXPECT_EQ(now() - base, (128 * 64 + 17) * 4);
  }
  EXPECT_EQ(now(), base);
}

TEST_F(MemoryAllocated, ViewsShareStorageAndCountOnce) {
  const int64_t base = now();
  auto t = torch::zeros({8, 8});
  auto v1 = t.view({64});
  auto v2 = t.narrow(0, 2, 3);
  auto v3 = t.t();
  auto v4 = t[3];
  EXPECT_EQ(now() - base, 256);
  EXPECT_EQ(storage_bytes({t, v1, v2, v3, v4}), 256);
  t = torch::Tensor();
  v1 = v3 = v4 = torch::Tensor();
  EXPECT_EQ(now() - base, 256) << "a live view keeps the whole storage";
  v2 = torch::Tensor();
  EXPECT_EQ(now(), base);
}

TEST_F(MemoryAllocated, InPlaceOpsAllocateNothing) {
  auto t = torch::ones({1000});
  const int64_t base = now();
  t.add_(1).mul_(3).relu_().clamp_(0, 5);
  t.fill_(2);
  EXPECT_EQ(now(), base);
  auto u = t + 1;  // out of place: one new result
  EXPECT_EQ(now() - base, 4000);
}

TEST_F(MemoryAllocated, ZeroSizedTensorsCountNothing) {
  const int64_t base = now();
  auto t = torch::empty({0, 5});
  EXPECT_EQ(now(), base);
  t.resize_({2, 5});
  EXPECT_EQ(now() - base, 40);
}

TEST_F(MemoryAllocated, ResizeCountsTheNewStorage) {
  auto t = torch::empty({10});
  const int64_t base = now();
  t.resize_({100});
  EXPECT_EQ(now() - base, 400 - 40);
  t.resize_({5});  // shrinking keeps the storage
  EXPECT_EQ(now() - base, 400 - 40);
}

TEST_F(MemoryAllocated, FreesOfTensorsFromBeforeTrackingLeaveCountAlone) {
  // Allocate with LibTorch's default allocator, as before tracking began.
  detail::install_default_allocator();
  auto old = torch::ones({4096});
  detail::install_tracking_allocator();
  const int64_t base = now();
  auto fresh = torch::ones({10});
  EXPECT_EQ(now() - base, 40);
  old = torch::Tensor();
  EXPECT_EQ(now() - base, 40);
  fresh = torch::Tensor();
  EXPECT_EQ(now(), base);
}

TEST_F(MemoryAllocated, RawAllocateKeepsContextEqualToData) {
  const int64_t base = now();
  c10::Allocator* a = c10::GetCPUAllocator();
  void* p = a->raw_allocate(100);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u) << "64-byte alignment";
  EXPECT_EQ(now() - base, 100);
  a->raw_deallocate(p);
  EXPECT_EQ(now(), base);
  // GELU's CPU kernel goes through raw_allocate in LibTorch 1.13.
  auto x = torch::randn({64, 33});
  auto y = torch::gelu(x);
  EXPECT_TRUE(torch::allclose(y, 0.5 * x * (1 + torch::erf(x / std::sqrt(2.0))), 1e-5, 1e-6));
}

TEST_F(MemoryAllocated, AutogradTensorsAreCounted) {
  auto w = torch::randn({64, 64}, torch::requires_grad());
  const int64_t base = now();
  {
    auto y = torch::mm(torch::ones({32, 64}), w);  // input 8 KiB + output 8 KiB
    EXPECT_EQ(now() - base, 2 * 32 * 64 * 4);
    y.sum().backward();
  }
  EXPECT_EQ(now() - base, 64 * 64 * 4) << "only w.grad remains";
}

class UntrackedGuardTest : public Seeded {};

TEST_F(UntrackedGuardTest, AllocationsInScopeAreNotCountedNorTheirFrees) {
  const int64_t base = now();
  torch::Tensor host;
  {
    UntrackedGuard guard;
    {
      UntrackedGuard nested;
      host = torch::ones({1000});
    }
    auto also_host = torch::ones({10});
  }
  EXPECT_EQ(now(), base);
  auto device = torch::ones({10});
  EXPECT_EQ(now() - base, 40) << "counting resumes after the outermost guard";
  host = torch::Tensor();
  EXPECT_EQ(now() - base, 40);
}

TEST_F(UntrackedGuardTest, IsThreadLocal) {
  const int64_t base = now();
  UntrackedGuard guard;
  torch::Tensor other;
  std::thread t([&] { other = torch::ones({25}); });
  t.join();
  EXPECT_EQ(now() - base, 100);
}

class PeakStats : public Seeded {};

TEST_F(PeakStats, MaxMemoryAllocatedIsTheHighWaterMark) {
  const int64_t base = now();
  reset_peak_memory_stats(torch::kCPU);
  EXPECT_EQ(max_memory_allocated(torch::kCPU), base);
  {
    auto a = torch::empty({1000});
    auto b = torch::empty({500});
  }
  auto c = torch::empty({100});
  EXPECT_EQ(max_memory_allocated(torch::kCPU) - base, 6000);
  reset_peak_memory_stats(torch::kCPU);
  EXPECT_EQ(max_memory_allocated(torch::kCPU) - base, 400);
}

TEST_F(PeakStats, PeakMeterMeasuresItsScopeAndNests) {
  auto keep = torch::empty({250});  // 1000 bytes before the meters
  PeakMeter outer;
  {
    auto a = torch::empty({1000});
    PeakMeter inner;
    EXPECT_EQ(inner.start() - outer.start(), 4000);
    { auto b = torch::empty({2000}); }
    EXPECT_EQ(inner.peak_delta(), 8000);
  }
  { auto c = torch::empty({500}); }
  EXPECT_EQ(outer.peak_delta(), 12000);
  EXPECT_EQ(outer.peak(), outer.start() + 12000);
  // The global peak was left alone by the meters.
  EXPECT_GE(max_memory_allocated(torch::kCPU), outer.peak());
}

TEST_F(PeakStats, PeakMeterMovesWithoutLosingItsSlot) {
  PeakMeter a;
  { auto t = torch::empty({100}); }
  PeakMeter b(std::move(a));
  { auto t = torch::empty({50}); }
  EXPECT_EQ(b.peak_delta(), 400);
  PeakMeter c;
  c = std::move(b);
  EXPECT_EQ(c.peak_delta(), 400);
}

// What a refused allocation asked for counts in needed(), not in peak():
// the step that failed would have needed it, and a re-plan sizes from it.
TEST_F(PeakStats, NeededCountsTheRefusedAllocationOnTopOfWhatWasHeld) {
  PeakMeter meter;
  auto held = torch::empty({1000});  // 4000 bytes
  {
    BudgetGuard tight(torch::kCPU, now() + 2000);
    EXPECT_THROW(torch::empty({600}), c10::OutOfMemoryError);  // 2400 bytes: refused
    EXPECT_THROW(torch::empty({550}), c10::OutOfMemoryError);  // less: needed() keeps the most
    auto fits = torch::empty({500});
  }
  EXPECT_EQ(meter.peak_delta(), 6000);
  EXPECT_EQ(meter.needed(), meter.start() + 4000 + 2400);
  PeakMeter later;  // a meter started after the refusals saw none
  EXPECT_EQ(later.needed(), later.peak());
  {
    AllocationFault fail(1);  // a failure on purpose asks as much as its allocation
    EXPECT_THROW(torch::empty({100}), c10::OutOfMemoryError);
  }
  EXPECT_EQ(later.needed(), later.start() + 400);
}

// A backward that fails at any of its allocations leaves nothing held once
// release_failed_backward has run: LibTorch's queue kept the tasks it had not
// run, and with them the graph's other branch and its saved activations.
class FailedBackward : public Seeded {};

TEST_F(FailedBackward, LeavesItsGraphUntilReleased) {
  auto w = torch::randn({64, 64}, torch::requires_grad());
  const auto backward_of_two_branches = [&] {
    auto x = torch::randn({32, 64});
    auto loss = (x.mm(w).relu().mm(w) + x.mm(w).sigmoid().mm(w)).sum();
    loss.backward();
  };
  int64_t allocations = 0;
  {
    AllocationFault count(0);
    backward_of_two_branches();
    allocations = count.allocations();
  }
  w.mutable_grad() = torch::Tensor();
  const int64_t before = now();
  int64_t held_most = 0;
  for (int64_t k = 4; k <= allocations; ++k) {  // the first three make the forward's input and outputs
    try {
      AllocationFault fail(k);
      backward_of_two_branches();
    } catch (const c10::OutOfMemoryError&) {
    }
    w.mutable_grad() = torch::Tensor();
    held_most = std::max(held_most, now() - before);
    release_failed_backward();
    EXPECT_EQ(now(), before) << "allocation " << k << " of " << allocations;
  }
  std::cout << "a failed backward held at most " << held_most << " bytes until released\n";
}

// CUDA's out-of-memory messages say what was asked for, rounded as printed.
TEST(RefusedRequest, ReadsTheRequestFromCudaAndMemfitMessages) {
  EXPECT_EQ(detail::refused_request_bytes("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 79.10 GiB "
                                          "total capacity; 1.20 GiB already allocated)"),
            20LL << 20);
  EXPECT_EQ(detail::refused_request_bytes("CPU out of memory under memfit's budget: tried to allocate 1.50 KiB; "
                                          "budget 4.00 KiB"),
            1536);
  EXPECT_EQ(detail::refused_request_bytes("Tried to allocate 512 bytes"), 512);
  EXPECT_EQ(detail::refused_request_bytes("step 3: rank 1 of 2 ran out of memory"), 0);
}

TEST_F(PeakStats, SixtyFiveLiveMetersAreRefused) {
  std::vector<PeakMeter> meters;
  meters.reserve(64);
  for (int i = 0; i < 64; ++i) meters.emplace_back();
  EXPECT_THROW(PeakMeter(), c10::Error);
  meters.pop_back();
  EXPECT_NO_THROW(PeakMeter());
}

class Budget : public Seeded {};

TEST_F(Budget, OverBudgetThrowsOutOfMemoryErrorInCudaStyle) {
  set_memory_budget(torch::kCPU, now() + (1 << 20));
  EXPECT_EQ(memory_budget(torch::kCPU), now() + (1 << 20));
  try {
    torch::empty({1 << 20});  // 4 MiB
    FAIL() << "expected c10::OutOfMemoryError";
  } catch (const c10::OutOfMemoryError& e) {
    const std::string msg = e.msg();
    EXPECT_NE(msg.find("tried to allocate 4.00 MiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("budget"), std::string::npos) << msg;
    EXPECT_NE(msg.find("already allocated"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
  }
}

TEST_F(Budget, ExactlyTheBudgetFitsAndOneByteMoreDoesNot) {
  const int64_t base = now();
  set_memory_budget(torch::kCPU, base + 4000);
  auto a = torch::empty({1000});
  EXPECT_EQ(now(), base + 4000);
  EXPECT_THROW(torch::empty({1}, torch::kUInt8), c10::OutOfMemoryError);
  EXPECT_EQ(now(), base + 4000) << "a refused allocation changes nothing";
}

TEST_F(Budget, CallerRecoversByFreeingMemory) {
  const int64_t base = now();
  set_memory_budget(torch::kCPU, base + 10000);
  auto a = torch::ones({2000});
  EXPECT_THROW(torch::ones({1000}), c10::OutOfMemoryError);
  EXPECT_EQ(now(), base + 8000);
  a = torch::Tensor();
  auto b = torch::ones({1000});
  EXPECT_EQ(now(), base + 4000);
  EXPECT_EQ(b.sum().item<float>(), 1000.0f) << "the new tensor is usable";
}

TEST_F(Budget, OutOfMemoryInBackwardKeepsItsTypeAndCountsStayRight) {
  torch::nn::Linear lin(256, 256);
  auto x = torch::randn({512, 256});
  const int64_t base = now();
  auto y = torch::relu(lin(x)).sum();
  // Forward holds ~1 MiB of activations; backward needs ~1.3 MiB more.
  set_memory_budget(torch::kCPU, now() + 16 * 1024);
  EXPECT_THROW(y.backward(), c10::OutOfMemoryError);
  set_memory_budget(torch::kCPU, 0);
  y = torch::Tensor();
  for (auto& p : lin->parameters()) p.mutable_grad() = torch::Tensor();
  EXPECT_EQ(now(), base) << "everything the failed backward allocated was freed";
  // A fresh step under no budget works.
  torch::relu(lin(x)).sum().backward();
  EXPECT_TRUE(lin->weight.grad().defined());
}

TEST_F(Budget, ZeroRemovesTheBudgetAndNegativeIsRejected) {
  set_memory_budget(torch::kCPU, now() + 8);
  EXPECT_THROW(torch::empty({100}), c10::OutOfMemoryError);
  set_memory_budget(torch::kCPU, 0);
  EXPECT_NO_THROW(torch::empty({100}));
  EXPECT_THROW(set_memory_budget(torch::kCPU, -1), c10::Error);
}

TEST_F(Budget, BudgetBelowCurrentUseOnlyRefusesNewAllocations) {
  auto a = torch::ones({100});
  set_memory_budget(torch::kCPU, 1);
  EXPECT_THROW(torch::empty({1}), c10::OutOfMemoryError);
  a.add_(a);  // tensor-tensor in place: no allocation, still works
  EXPECT_EQ(a[0].item<float>(), 2.0f);
}

TEST_F(Budget, CudaDeviceWithoutOneIsAClearError) {
  // A CPU-only build, or a CUDA build on a machine without a GPU: one line
  // naming the device, why it is not there, and what to use instead.
  if (torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA is available; this checks the error where it is not";
  }
  try {
    memory_allocated(torch::Device(torch::kCUDA, 0));
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string why = compat::kBuiltWithCuda ? "this build has CUDA, but no CUDA device is visible"
                                                    : "needs a CUDA build of memfit and LibTorch";
    EXPECT_NE(std::string(e.msg()).find("memfit: device cuda:0"), std::string::npos) << e.msg();
    EXPECT_NE(std::string(e.msg()).find(why), std::string::npos) << e.msg();
    EXPECT_NE(std::string(e.msg()).find("Use torch::kCPU"), std::string::npos) << e.msg();
  }
}

class Threads : public Seeded {};

TEST_F(Threads, TwoThreadsAllocatingAtOnceCountExactly) {
  const int64_t base = now();
  constexpr int kIters = 2000;
  std::vector<torch::Tensor> kept[2];
  auto work = [&](int id) {
    for (int i = 0; i < kIters; ++i) {
      auto tmp = torch::empty({(i % 17) + 1});
      if (i % 10 == 0) kept[id].push_back(torch::empty({id + 1}));
    }
  };
  std::thread t0(work, 0), t1(work, 1);
  t0.join();
  t1.join();
  EXPECT_EQ(now() - base, (kIters / 10) * (4 + 8));
  kept[0].clear();
  kept[1].clear();
  EXPECT_EQ(now(), base);
}

TEST_F(Threads, BudgetIsExactUnderContention) {
  const int64_t base = now();
  constexpr int kFit = 300;
  set_memory_budget(torch::kCPU, base + kFit * 400);
  std::vector<torch::Tensor> kept[2];
  std::atomic<int> refused{0};
  auto work = [&](int id) {
    for (int i = 0; i < kFit; ++i) {
      try {
        kept[id].push_back(torch::empty({100}));
      } catch (const c10::OutOfMemoryError&) {
        refused.fetch_add(1);
      }
    }
  };
  std::thread t0(work, 0), t1(work, 1);
  t0.join();
  t1.join();
  EXPECT_EQ(kept[0].size() + kept[1].size(), static_cast<size_t>(kFit));
  EXPECT_EQ(refused.load(), kFit);
  EXPECT_EQ(now(), base + kFit * 400);
}

TEST(ParseMemorySize, AcceptsBinaryDecimalAndPlainBytes) {
  EXPECT_EQ(parse_memory_size("512MiB"), 512LL << 20);
  EXPECT_EQ(parse_memory_size("2GiB"), 2LL << 30);
  EXPECT_EQ(parse_memory_size("1.5GB"), 1500000000LL);
  EXPECT_EQ(parse_memory_size("1048576"), 1048576LL);
  EXPECT_EQ(parse_memory_size("64kb"), 64000LL);
  EXPECT_EQ(parse_memory_size("1K"), 1024LL);
  EXPECT_EQ(parse_memory_size(" 3 mib "), 3LL << 20);
  EXPECT_EQ(parse_memory_size("0"), 0);
  EXPECT_EQ(parse_memory_size("1TiB"), 1LL << 40);
  EXPECT_EQ(parse_memory_size(".5KiB"), 512);
}

TEST(ParseMemorySize, RejectsMalformedSizesNamingTheForms) {
  for (const char* bad : {"12XB", "-1GiB", "", "GiB", "1.5.2MB", "1e3", "5 G i B",
                          "99999999999TiB", "12 bytes"}) {
    try {
      parse_memory_size(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const c10::Error& e) {
      const std::string msg = e.msg();
      EXPECT_NE(msg.find(std::string("'") + bad + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("512MiB"), std::string::npos) << msg;
    }
  }
}

TEST(FormatBytes, MatchesCudaMessages) {
  EXPECT_EQ(format_bytes(512), "512 bytes");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(20LL << 20), "20.00 MiB");
  EXPECT_EQ(format_bytes(3LL << 30), "3.00 GiB");
}

class Breakdown : public Seeded {};

TEST_F(Breakdown, SplitsAStepIntoParametersGradientsStateAndActivations) {
  torch::nn::Linear lin(100, 50);  // 5000 + 50 floats
  torch::optim::Adam adam(lin->parameters());
  auto x = torch::randn({32, 100});
  PeakMeter meter;
  lin(x).relu().sum().backward();
  adam.step();
  const auto m = breakdown_step(meter.peak(), lin->parameters(), lin->buffers(), adam);
  EXPECT_EQ(m.parameters, 5050 * 4);
  EXPECT_EQ(m.gradients, 5050 * 4);
  EXPECT_EQ(m.optimizer_state, 2 * 5050 * 4);  // exp_avg and exp_avg_sq
  EXPECT_EQ(optimizer_state_bytes(adam), 2 * 5050 * 4);
  EXPECT_EQ(m.activations, m.peak - m.parameters - m.gradients - m.optimizer_state);
  EXPECT_GE(m.activations, 0);
  EXPECT_NE(m.table().find("optimizer state"), std::string::npos);
  EXPECT_NE(m.to_json().find("\"optimizer_state\":40400"), std::string::npos) << m.to_json();
}

TEST_F(Breakdown, CountsSgdMomentumBuffers) {
  torch::nn::Linear lin(10, 10);
  torch::optim::SGD sgd(lin->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  lin(torch::ones({2, 10})).sum().backward();
  EXPECT_EQ(optimizer_state_bytes(sgd), 0) << "no state before the first step";
  sgd.step();
  EXPECT_EQ(optimizer_state_bytes(sgd), 110 * 4);
}

class CudaMemory : public testing::OnCuda {};

TEST_F(CudaMemory, CountsTensorBytesAndPeakOnTheDevice) {
  empty_cache(cuda);
  const int64_t base = memory_allocated(cuda);
  auto t = torch::empty({1 << 20}, torch::TensorOptions().device(cuda));  // 4 MiB
  EXPECT_EQ(memory_allocated(cuda) - base, 4 << 20);
  reset_peak_memory_stats(cuda);
  { auto u = torch::empty({1 << 18}, torch::TensorOptions().device(cuda)); }  // 1 MiB
  EXPECT_EQ(max_memory_allocated(cuda) - memory_allocated(cuda), 1 << 20);
  {
    PeakMeter meter(cuda);
    auto v = torch::empty({1 << 19}, torch::TensorOptions().device(cuda));  // 2 MiB
    v = torch::Tensor();
    EXPECT_EQ(meter.peak_delta(), 2 << 20);
  }
  t = torch::Tensor();
  EXPECT_EQ(memory_allocated(cuda), base);
  EXPECT_EQ(memory_allocated(torch::kCPU) >= 0, true);
}

TEST_F(CudaMemory, BudgetThrowsOutOfMemoryAndTheCallerRecovers) {
  empty_cache(cuda);
  set_memory_budget(cuda, int64_t(256) << 20);
  EXPECT_EQ(memory_budget(cuda), int64_t(256) << 20);
  EXPECT_THROW(torch::empty({int64_t(256) << 20}, torch::TensorOptions().device(cuda)),
               c10::OutOfMemoryError)
      << "1 GiB under a 256 MiB budget";
  auto fits = torch::empty({1 << 20}, torch::TensorOptions().device(cuda));
  EXPECT_EQ(fits.numel(), 1 << 20);
  set_memory_budget(cuda, 0);
  auto big = torch::empty({int64_t(256) << 20}, torch::TensorOptions().device(cuda));
  EXPECT_EQ(big.numel(), int64_t(256) << 20) << "the budget is lifted";
}

} // namespace
} // namespace memfit
