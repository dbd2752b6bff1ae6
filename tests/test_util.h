#pragma once
// Shared test helpers: a fixture that seeds every RNG the tests use and
// checks that no budget leaks between tests.

#include "compat.h"
#include "memfit/data.h"
#include "memfit/memory.h"
#include "memfit/optim.h"
#include "memory_internal.h"

#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace memfit {
namespace testing {

/// Expects `f` to throw a c10::Error whose message holds `text`.
inline void expect_error(const std::function<void()>& f, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one saying: " << text;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(text), std::string::npos)
        << e.what_without_backtrace();
  }
}

/// The relative difference ||a - b|| / ||b|| of two tensors.
inline double relative_difference(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = b.norm().item<double>();
  return (a - b).norm().item<double>() / std::max(scale, 1e-30);
}

/// The largest relative_difference over pairs of tensors.
inline double max_relative_difference(const std::vector<torch::Tensor>& a,
                                      const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, relative_difference(a[i], b[i]));
  return worst;
}

/// Seeds LibTorch's generator and starts with no budget and a fresh peak.
class Seeded : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(1234);
    set_memory_budget(torch::kCPU, 0);
    reset_peak_memory_stats(torch::kCPU);
  }
  void TearDown() override { set_memory_budget(torch::kCPU, 0); }
};

/// Seeded, with Debian's Fashion-MNIST; skips the test where it is not installed.
class WithFashionMnist : public Seeded {
 protected:
  void SetUp() override {
    Seeded::SetUp();
    if (!std::filesystem::exists(FashionMnistOptions().root())) {
      GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed";
    }
  }
};

/// The first `n` examples of Fashion-MNIST's test split, read once (host memory).
inline const ImageDataset& fashion_test_head(int64_t n) {
  static std::map<int64_t, ImageDataset> heads;
  auto it = heads.find(n);
  if (it == heads.end()) {
    const auto full = load_fashion_mnist(Split::kTest);
    UntrackedGuard host;
    ImageDataset d;
    d.images = full.images.narrow(0, 0, n).clone();
    d.labels = full.labels.narrow(0, 0, n).clone();
    it = heads.emplace(n, std::move(d)).first;
  }
  return it->second;
}

/// Seeded, on CUDA device 0; skips the test where this build or machine has no CUDA.
class OnCuda : public Seeded {
 protected:
  void SetUp() override {
    Seeded::SetUp();
    if (!torch::cuda::is_available()) {
      GTEST_SKIP() << "no CUDA device (CPU-only LibTorch or no GPU): run on a GPU machine";
    }
    torch::cuda::manual_seed_all(1234);
  }
  void TearDown() override {
    if (torch::cuda::is_available()) set_memory_budget(cuda, 0);
    Seeded::TearDown();
  }
  const torch::Device cuda{torch::kCUDA, 0};
};

/// Copies of the gradients of `params` (undefined where a gradient is).
inline std::vector<torch::Tensor> grads_of(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> g;
  for (const auto& p : params) g.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return g;
}

/// Sets the gradients of `params` to none.
inline void clear_grads(const std::vector<torch::Tensor>& params) {
  for (const auto& p : params) const_cast<torch::Tensor&>(p).mutable_grad() = torch::Tensor();
}

/// Copies of every state tensor and Adam step count of `o`, in the order of
/// `params`, each parameter's led by whether it has state (1 or 0).
inline std::vector<torch::Tensor> optimizer_state_of(torch::optim::Optimizer& o,
                                                     const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  // memfit's fused optimizers keep step counts on the device after a skip there.
  if (auto* fused = dynamic_cast<optim::KernelChoice*>(&o)) fused->steps_to_host();
  auto& state = o.state();
  for (const auto& p : params) {
    const auto found = state.find(compat::optimizer_state_key(p));
    out.push_back(torch::tensor(found != state.end() ? 1 : 0));
    if (found == state.end()) continue;
    detail::for_each_state_tensor(*found->second, [&](torch::Tensor& t) { out.push_back(t.clone()); });
    if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(found->second.get())) {
      out.push_back(torch::tensor(a->step()));
    }
    if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(found->second.get())) {
      out.push_back(torch::tensor(a->step()));
    }
  }
  return out;
}

/// Copies of `tensors` (undefined stays undefined).
inline std::vector<torch::Tensor> copies(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.defined() ? t.detach().clone() : torch::Tensor());
  return out;
}

/// Expects `a` and `b` bitwise equal, tensor for tensor (undefined where the other is).
inline void expect_bitwise(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                           const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << what << ": tensor " << i << " defined in one only";
    if (a[i].defined()) EXPECT_TRUE(a[i].equal(b[i])) << what << ": tensor " << i << " differs";
  }
}

/// Counts the values read back to the host on this thread while alive:
/// aten::_local_scalar_dense, which item() and every tensor-to-number
/// conversion run (on CUDA, a device synchronisation each), outside
/// LibTorch's fused optimizer kernels (whose CPU versions read their step
/// counts there; on CUDA the kernels read them on the device). One at a time.
class HostReads {
 public:
  HostReads() : handle_(at::addThreadLocalCallback(at::RecordFunctionCallback(&HostReads::enter, &HostReads::leave))) {
    reads() = 0;
    depth() = 0;
  }
  ~HostReads() { at::removeCallback(handle_); }
  HostReads(const HostReads&) = delete;
  HostReads& operator=(const HostReads&) = delete;
  int64_t count() const { return reads(); }

 private:
  static int64_t& reads() {
    static thread_local int64_t n = 0;
    return n;
  }
  static int& depth() {
    static thread_local int d = 0;
    return d;
  }
  static bool fused(const at::RecordFunction& fn) { return std::strncmp(fn.name(), "aten::_fused_", 13) == 0; }
  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    if (fused(fn)) {
      ++depth();
    } else if (depth() == 0 && std::strcmp(fn.name(), "aten::_local_scalar_dense") == 0) {
      ++reads();
    }
    return nullptr;
  }
  static void leave(const at::RecordFunction& fn, at::ObserverContext*) {
    if (fused(fn)) --depth();
  }
  at::CallbackHandle handle_;
};

} // namespace testing
} // namespace memfit
