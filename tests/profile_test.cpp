#include "memfit/profile.h"

#include "compat.h"
#include "memfit/models.h"
#include "test_util.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace memfit {
namespace {

class Profile : public testing::Seeded {};

TEST_F(Profile, MeasuresExactBytesPerLayer) {
  torch::nn::Sequential chain(torch::nn::Linear(16, 32), torch::nn::ReLU(),
                              torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)),
                              torch::nn::Linear(32, 4));
  const auto p = profile_chain(chain, torch::randn({8, 16}));
  ASSERT_EQ(p.layers.size(), 4u);
  EXPECT_EQ(p.layers[0].input_bytes, 8 * 16 * 4);
  EXPECT_EQ(p.layers[0].output_bytes, 8 * 32 * 4);
  EXPECT_EQ(p.layers[0].kept_bytes, 8 * 32 * 4) << "its output; the input is not its own";
  EXPECT_EQ(p.layers[0].parameter_bytes, (16 * 32 + 32) * 4);
  EXPECT_EQ(p.layers[1].kept_bytes, 0) << "ReLU keeps its output and lets the Linear's go";
  EXPECT_TRUE(p.layers[1].frees_input);
  EXPECT_FALSE(p.layers[1].in_place);
  EXPECT_EQ(p.layers[2].kept_bytes, 0) << "in-place ReLU allocates nothing";
  EXPECT_TRUE(p.layers[2].in_place);
  EXPECT_FALSE(p.layers[2].frees_input);
  EXPECT_FALSE(p.layers[3].frees_input) << "a Linear keeps its input";
  EXPECT_EQ(p.layers[3].output_bytes, 8 * 4 * 4);
  EXPECT_EQ(p.plain_activation_bytes(), 1024 + 128);
  for (const auto& l : p.layers) {
    EXPECT_GT(l.forward_seconds, 0.0);
    EXPECT_GE(l.forward_peak_bytes, l.kept_bytes);
  }
  EXPECT_GT(p.layers[0].backward_seconds, 0.0);
  EXPECT_NE(p.table().find("in-place"), std::string::npos);
  EXPECT_EQ(nlohmann::json::parse(p.to_json()).size(), 4u);
}

// Layers that do the same work (the same module, as it prints, on the same
// bytes) are timed as one: each takes the median of all their runs, so timing
// noise cannot rank them, and a schedule over them does not follow it.
TEST_F(Profile, LayersThatDoTheSameWorkTakeOneTime) {
  torch::nn::Sequential chain(torch::nn::Linear(32, 32), torch::nn::Tanh(), torch::nn::Linear(32, 32), torch::nn::Tanh(),
                              torch::nn::Linear(32, 32), torch::nn::Tanh(), torch::nn::Linear(32, 8));
  const auto p = profile_chain(chain, torch::randn({64, 32}), ProfileOptions().repeats(5));
  ASSERT_EQ(p.layers.size(), 7u);
  for (size_t i : {2u, 4u}) {
    EXPECT_EQ(p.layers[i].forward_seconds, p.layers[0].forward_seconds) << "Linear(32, 32) " << i;
    EXPECT_EQ(p.layers[i].backward_seconds, p.layers[0].backward_seconds) << "Linear(32, 32) " << i;
  }
  for (size_t i : {3u, 5u}) {
    EXPECT_EQ(p.layers[i].forward_seconds, p.layers[1].forward_seconds) << "Tanh " << i;
    EXPECT_EQ(p.layers[i].backward_seconds, p.layers[1].backward_seconds) << "Tanh " << i;
  }
  for (const auto& l : p.layers) EXPECT_GT(l.forward_seconds, 0.0);
  EXPECT_EQ(p.layers[6].output_bytes, 64 * 8 * 4) << "the head, other work, keeps its own";
}

// The bytes a chain's own forward with grad keeps (its output included).
int64_t kept_by_forward(torch::nn::Sequential& chain, const torch::Tensor& input) {
  const auto leaf = input.detach().requires_grad_(true);
  const auto x = leaf.clone();
  const int64_t before = memory_allocated(x.device());
  auto y = chain->forward(x);
  return memory_allocated(x.device()) - before;
}

TEST_F(Profile, KeptBytesAddUpToWhatTheChainsOwnForwardKeeps) {
  // Layers that keep their input (Linear, BatchNorm, GELU), their output
  // (Tanh, ReLU), neither (Dropout keeps a mask), in place, and views.
  torch::nn::Sequential tanh_chain;
  for (int i = 0; i < 6; ++i) {
    tanh_chain->push_back(torch::nn::Linear(32, 32));
    tanh_chain->push_back(torch::nn::Tanh());
  }
  torch::nn::Sequential conv_chain(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)), torch::nn::BatchNorm2d(4),
      torch::nn::ReLU(), torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 3).padding(1)),
      torch::nn::BatchNorm2d(4), torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)),
      torch::nn::Flatten(), torch::nn::Linear(4 * 8 * 8, 10));
  torch::nn::Sequential mixed(torch::nn::Linear(32, 32), torch::nn::Dropout(0.5), torch::nn::GELU(),
                              torch::nn::Linear(32, 32), torch::nn::Sigmoid(), torch::nn::Tanh(),
                              torch::nn::Linear(32, 8), torch::nn::ReLU());
  const std::vector<std::pair<torch::nn::Sequential, torch::Tensor>> cases = {
      {tanh_chain, torch::randn({16, 32})},
      {conv_chain, torch::randn({16, 1, 8, 8})},
      {mixed, torch::randn({16, 32})}};
  for (auto [chain, input] : cases) {
    const auto p = profile_chain(chain, input);
    EXPECT_EQ(p.plain_activation_bytes(), kept_by_forward(chain, input)) << chain;
  }
  const auto p = profile_chain(tanh_chain, torch::randn({16, 32}));
  EXPECT_TRUE(p.layers[1].frees_input) << "a Tanh lets the Linear's output go";
  EXPECT_FALSE(p.layers[2].frees_input) << "a Linear keeps the Tanh's output";
}

TEST_F(Profile, LeavesBuffersAndRandomStateAsTheyWere) {
  torch::nn::Sequential chain(torch::nn::Linear(8, 8), torch::nn::BatchNorm1d(8),
                              torch::nn::Dropout(0.5));
  auto running_mean = chain->buffers()[0].clone();
  torch::manual_seed(3);
  profile_chain(chain, torch::randn({16, 8}) + 5);
  auto after = torch::rand({4});
  torch::manual_seed(3);
  torch::randn({16, 8});  // the sample drawn above
  EXPECT_TRUE(torch::equal(after, torch::rand({4}))) << "RNG state restored";
  EXPECT_TRUE(torch::equal(chain->buffers()[0], running_mean)) << "BatchNorm statistics restored";
}

TEST_F(Profile, MeasuresLayersThatCheckpointInside) {
  // memfit::checkpoint inside a layer needs a plain backward (not autograd::grad).
  auto gpt = make_gpt(ModelOptions().num_classes(20).width(16).depth(1).heads(2).context(32));
  const auto ids = torch::randint(0, 20, {4, 32});
  const auto plain = profile_chain(gpt, ids);
  ASSERT_EQ(set_selective_recompute(gpt, true), 1);
  const auto weight = gpt->parameters()[0];
  weight.mutable_grad() = torch::ones_like(weight);
  const auto selective = profile_chain(gpt, ids);
  EXPECT_TRUE(weight.grad().equal(torch::ones_like(weight))) << "a parameter's own gradient is put back";
  // The block no longer keeps the softmax's output (4·2·32² floats, which the
  // product with v saves too) and the causal mask (32² bools); dropout is off.
  EXPECT_EQ(plain.layers[1].kept_bytes - selective.layers[1].kept_bytes, 4 * 2 * 32 * 32 * 4 + 32 * 32);
  EXPECT_GT(selective.layers[1].backward_seconds, 0.0);
}

TEST_F(Profile, BadInputIsAClearError) {
  torch::nn::Sequential empty;
  EXPECT_THROW(profile_chain(empty, torch::randn({2})), c10::Error);
  torch::nn::Sequential chain(torch::nn::Linear(2, 2));
  EXPECT_THROW(profile_chain(chain, torch::randn({2, 2}), ProfileOptions().repeats(0)), c10::Error);
}

} // namespace
} // namespace memfit
