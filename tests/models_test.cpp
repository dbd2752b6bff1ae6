#include "memfit/models.h"

#include "test_util.h"

namespace memfit {
namespace {

class Models : public testing::Seeded {};

TEST_F(Models, MlpMapsImagesToClassLogits) {
  auto mlp = make_mlp(ModelOptions().width(32).depth(3));
  auto y = mlp->forward(torch::randn({4, 1, 28, 28}));
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{4, 10}));
  // flatten + 3 × (linear, relu) + head
  EXPECT_EQ(mlp->size(), 8u);
  int64_t params = 0;
  for (const auto& p : mlp->parameters()) params += p.numel();
  EXPECT_EQ(params, (784 * 32 + 32) + 2 * (32 * 32 + 32) + (32 * 10 + 10));
}

TEST_F(Models, ResNetHasOneSequentialElementPerBlockAndDownsamples) {
  auto net = make_resnet(ModelOptions().width(8).depth(2).stages(3));
  // stem (3) + 3 stages × 2 blocks + pool, flatten, head
  EXPECT_EQ(net->size(), 3u + 6u + 3u);
  auto y = net->forward(torch::randn({2, 1, 28, 28}));
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 10}));
  y.sum().backward();
  for (const auto& p : net->parameters()) EXPECT_TRUE(p.grad().defined());
}

TEST_F(Models, SameSeedSameParameters) {
  torch::manual_seed(7);
  auto a = make_resnet(ModelOptions().width(4).depth(1));
  torch::manual_seed(7);
  auto b = make_resnet(ModelOptions().width(4).depth(1));
  const auto pa = a->parameters(), pb = b->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(pa[i].equal(pb[i]));
}

TEST_F(Models, BadNamesAndSizesAreClearErrors) {
  EXPECT_EQ(parse_model_kind("mlp"), ModelKind::kMlp);
  EXPECT_EQ(to_string(parse_model_kind("resnet")), "resnet");
  try {
    parse_model_kind("vgg");
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.msg()).find("expected mlp or resnet"), std::string::npos);
  }
  EXPECT_THROW(make_mlp(ModelOptions().num_classes(0)), c10::Error);
  EXPECT_THROW(make_resnet(ModelOptions().width(-1)), c10::Error);
}

} // namespace
} // namespace memfit
