#include "memfit/freeze.h"

#include "memfit/memory.h"
#include "memfit/models.h"
#include "test_util.h"

#include <torch/torch.h>

namespace memfit {
namespace {

class Freeze : public testing::Seeded {};

// One Adam step on a random batch, so every parameter has a gradient and state.
void train_step(torch::nn::Sequential& net, torch::optim::Optimizer& opt) {
  opt.zero_grad();
  net->forward(torch::randn({16, 1, 28, 28})).pow(2).mean().backward();
  opt.step();
}

TEST_F(Freeze, MatchesWholeNamesByGlob) {
  auto net = make_mlp(ModelOptions().width(8).depth(2));
  EXPECT_EQ(match_parameters(*net, "fc0.*"), (std::vector<std::string>{"fc0.weight", "fc0.bias"}));
  EXPECT_EQ(match_parameters(*net, "*.bias").size(), 3u);
  EXPECT_TRUE(match_parameters(*net, "fc0").empty()) << "the whole name must match";
}

TEST_F(Freeze, ReleasesGradientsAndOptimizerStateAndTheirBytes) {
  auto net = make_mlp(ModelOptions().width(64).depth(2));
  torch::optim::Adam adam(net->parameters());
  train_step(net, adam);
  const int64_t before = memory_allocated();
  EXPECT_EQ(freeze(*net, "fc0.*", &adam), 2);
  const int64_t fc0 = (784 * 64 + 64) * 4;
  EXPECT_EQ(before - memory_allocated(), 3 * fc0) << "gradient and Adam's two moments of fc0";
  EXPECT_FALSE(net->named_parameters()["fc0.weight"].requires_grad());
  EXPECT_FALSE(net->named_parameters()["fc0.weight"].grad().defined());
  const auto frozen = net->named_parameters()["fc0.weight"].clone();
  train_step(net, adam);
  EXPECT_TRUE(net->named_parameters()["fc0.weight"].equal(frozen)) << "a frozen parameter stays";
  EXPECT_EQ(adam.state().size(), 4u) << "state for the 4 trained parameters only";
}

TEST_F(Freeze, UnfreezeTrainsAgainAndJoinsAnOptimizerThatLacksTheParameter) {
  auto net = make_mlp(ModelOptions().width(8).depth(1));
  freeze(*net, "fc0.*");
  std::vector<torch::Tensor> trainable;
  for (const auto& p : net->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  torch::optim::SGD sgd(trainable, torch::optim::SGDOptions(0.1));
  EXPECT_EQ(unfreeze(*net, "fc0.*", &sgd), 2);
  ASSERT_EQ(sgd.param_groups().size(), 2u) << "a new group with the defaults";
  const auto w = net->named_parameters()["fc0.weight"].clone();
  train_step(net, sgd);
  EXPECT_FALSE(net->named_parameters()["fc0.weight"].equal(w));
  EXPECT_EQ(unfreeze(*net, "fc0.*", &sgd), 2);
  EXPECT_EQ(sgd.param_groups().size(), 2u) << "already there: not added twice";
}

TEST_F(Freeze, APatternThatMatchesNothingIsRefusedWithTheNames) {
  auto net = make_mlp(ModelOptions().width(8).depth(1));
  try {
    freeze(*net, "layer1.*");
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.msg()).find("matches no parameter name; names look like: fc0.weight"),
              std::string::npos)
        << e.msg();
  }
  for (const auto& p : net->parameters()) EXPECT_TRUE(p.requires_grad()) << "nothing changed";
}

} // namespace
} // namespace memfit
