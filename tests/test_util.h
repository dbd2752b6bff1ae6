#pragma once
// Shared test helpers: a fixture that seeds every RNG the tests use and
// checks that no budget leaks between tests.

#include "memfit/memory.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace memfit {
namespace testing {

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

} // namespace testing
} // namespace memfit
