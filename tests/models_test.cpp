#include "memfit/models.h"

#include "memfit/memory.h"

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
    EXPECT_NE(std::string(e.msg()).find("expected mlp, resnet or gpt"), std::string::npos);
  }
  EXPECT_THROW(make_mlp(ModelOptions().num_classes(0)), c10::Error);
  EXPECT_THROW(make_resnet(ModelOptions().width(-1)), c10::Error);
}

ModelOptions small_gpt() { return ModelOptions().num_classes(40).width(32).depth(2).heads(4).context(24); }

TEST_F(Models, GptMapsTokenIdsToNextTokenLogitsAndIsCausal) {
  auto gpt = make_gpt(small_gpt());
  EXPECT_EQ(gpt->size(), 4u) << "embedding, 2 blocks, head";
  auto ids = torch::randint(0, 40, {3, 24});
  auto y = gpt->forward(ids);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, 24, 40}));
  // Changing token 10 changes no logit before position 10.
  auto changed = ids.clone();
  changed.select(1, 10).add_(1).remainder_(40);
  auto z = gpt->forward(changed);
  EXPECT_TRUE(y.narrow(1, 0, 10).equal(z.narrow(1, 0, 10)));
  EXPECT_FALSE(y.narrow(1, 10, 1).equal(z.narrow(1, 10, 1)));
  EXPECT_THROW(gpt->forward(torch::randint(0, 40, {1, 25})), c10::Error) << "longer than the context";
  EXPECT_THROW(make_gpt(small_gpt().heads(5)), c10::Error) << "32 is not a multiple of 5 heads";
}

TEST_F(Models, GptSelectiveRecomputationKeepsGradientsAndDropsTheAttentionScores) {
  // With dropout on the attention weights: recomputation must redraw the same masks.
  auto run = [&](bool selective, int64_t* peak) {
    torch::manual_seed(3);
    auto gpt = make_gpt(small_gpt().dropout(0.1).selective_recompute(selective));
    auto ids = torch::randint(0, 40, {8, 24});
    const int64_t before = memory_allocated(torch::kCPU);
    PeakMeter meter(torch::kCPU);
    auto loss = gpt->forward(ids).logsumexp(-1).mean();
    *peak = meter.peak() - before;  // forward: what is kept for backward, and transients
    loss.backward();
    std::vector<torch::Tensor> grads;
    for (const auto& p : gpt->parameters()) grads.push_back(p.grad().clone());
    return grads;
  };
  int64_t plain_peak = 0, selective_peak = 0;
  const auto plain = run(false, &plain_peak);
  const auto selective = run(true, &selective_peak);
  ASSERT_EQ(plain.size(), selective.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(plain[i].equal(selective[i])) << "parameter " << i;
  // Each block keeps its scores' softmax and dropout mask and output (3 of
  // B·heads·T² floats, the mask as bytes) only without recomputation.
  const int64_t scores = 8 * 4 * 24 * 24;
  EXPECT_GE(plain_peak - selective_peak, 2 * (2 * scores * 4)) << plain_peak << " vs " << selective_peak;
}

} // namespace
} // namespace memfit
