#include "memfit/models.h"

#include "memfit/memory.h"
#include "memfit/plan.h"
#include "memfit/precision.h"
#include "memfit/checkpoint.h"
#include "memfit/schedule.h"
#include "memfit/trainer.h"

#include "test_util.h"

#include <torch/script.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

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

TEST_F(Models, GptSelectiveRecomputationInsideCheckpointedSegmentsKeepsGradients) {
  // Nested: a block's inner checkpoint recomputed inside an outer segment's backward.
  auto run = [&](bool selective, const Schedule& schedule) {
    torch::manual_seed(3);
    auto gpt = make_gpt(small_gpt().dropout(0.1));
    EXPECT_EQ(set_selective_recompute(gpt, selective), 2);
    EXPECT_EQ(selective_recompute(gpt), selective);
    CheckpointedSequential model(gpt);
    if (!schedule.segments.empty()) model->set_schedule(schedule);
    model->forward(torch::randint(0, 40, {8, 24})).logsumexp(-1).mean().backward();
    std::vector<torch::Tensor> grads;
    for (const auto& p : gpt->parameters()) grads.push_back(p.grad().clone());
    return grads;
  };
  const auto plain = run(false, Schedule());
  for (const auto& schedule : {schedule_every(4, 1), schedule_sqrt(4)}) {
    const auto nested = run(true, schedule);
    ASSERT_EQ(plain.size(), nested.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_TRUE(plain[i].equal(nested[i])) << schedule.to_string() << ", parameter " << i;
    }
  }
  EXPECT_EQ(set_selective_recompute(make_mlp(), true), 0) << "no blocks, nothing to set";
}

// TorchScript modules written by Debian's python3-torch (tests/make_torchscript.py).
class TorchScript : public testing::Seeded {
 protected:
  static void SetUpTestSuite() {
    dir_ = ::testing::TempDir() + "memfit_torchscript_" + std::to_string(::getpid());
    // Beside this file (CMake compiles it by its absolute path).
    const std::string script = (std::filesystem::path(__FILE__).parent_path() / "make_torchscript.py").string();
    const std::string command = "/usr/bin/python3 " + script + " " + dir_ + " > /dev/null 2>&1";
    made_ = std::system(command.c_str()) == 0;
  }
  static void TearDownTestSuite() {
    for (const char* f : {"/resnet18.pt", "/resnet18_whole.pt", "/blocks.pt", "/wrong_input.pt", "/two_only.pt"}) {
      std::remove((dir_ + f).c_str());
    }
    std::remove(dir_.c_str());
  }
  void SetUp() override {
    Seeded::SetUp();
    if (!made_) {
      GTEST_SKIP() << "Debian's python3-torch and python3-torchvision are not installed (/usr/bin/python3 "
                      "cannot script torchvision's resnet18)";
    }
  }
  static std::string dir_;
  static bool made_;
};
std::string TorchScript::dir_;
bool TorchScript::made_ = false;

TEST_F(TorchScript, ResNet18FromPythonRunsAsAChainOfItsChildren) {
  const auto x = torch::randn({4, 1, 28, 28});
  auto chain = load_torchscript(dir_ + "/resnet18.pt", x);
  EXPECT_EQ(chain->size(), 11u) << "conv1 bn1 relu maxpool layer1..4 avgpool flatten fc";
  int64_t params = 0;
  for (const auto& p : chain->parameters()) params += p.numel();
  EXPECT_EQ(params, 11175370) << "resnet18 with one input channel and 10 classes";
  const auto names = chain->named_parameters().keys();
  EXPECT_NE(std::find(names.begin(), names.end(), "4.0.conv1.weight"), names.end()) << "Python's names";
  // Gradients through the chain equal those through a second load of the
  // same file run whole by TorchScript (same kernels, same order).
  auto whole = torch::jit::load(dir_ + "/resnet18.pt");
  chain->forward(x).pow(2).sum().backward();
  whole.forward({x}).toTensor().pow(2).sum().backward();
  std::vector<torch::Tensor> a = chain->parameters(), b;
  for (const auto& p : whole.parameters()) b.push_back(p.grad());
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].grad().equal(b[i])) << "parameter " << i;
  // The optimizer's in-place step reaches the TorchScript module's tensors.
  torch::optim::SGD sgd(chain->parameters(), torch::optim::SGDOptions(0.1));
  sgd.step();
  EXPECT_FALSE(chain->parameters()[0].equal(whole.parameters().begin().operator*()));
  // eval() reaches TorchScript's BatchNorm: running statistics stop moving.
  chain->eval();
  const auto mean = chain->named_buffers()["1.running_mean"].clone();
  chain->forward(x);
  EXPECT_TRUE(chain->named_buffers()["1.running_mean"].equal(mean));
}

TEST_F(TorchScript, ScriptedLayersAreNamedByTheirPythonClassSoNormalisationIsFound) {
  // The CNN's first BatchNorm is a top-level child; the others sit inside
  // its residual blocks. Micro-batching changes their statistics, so the
  // planners must find them as they find a C++ BatchNorm.
  auto chain = load_torchscript(dir_ + "/blocks.pt");
  EXPECT_EQ(chain[1]->name(), "TorchScript BatchNorm2d");
  EXPECT_EQ(batch_statistics_layer(*chain), std::optional<std::string>("1"));
  auto resnet = load_torchscript(dir_ + "/resnet18.pt");
  EXPECT_EQ(batch_statistics_layer(*resnet), std::optional<std::string>("1"));
  EXPECT_EQ(batch_statistics_layer(*chain[3]), std::optional<std::string>("bn1")) << "inside a residual block";
  // MasterWeights keeps normalisation layers in fp32 (as a C++ BatchNorm's).
  MasterWeights masters(*chain, MasterWeightsOptions().dtype(torch::kBFloat16));
  for (const auto& item : chain->named_parameters()) {
    const auto& k = item.key();
    const bool norm = k.rfind("1.", 0) == 0 || k.find(".bn") != std::string::npos ||
                      k.find(".shortcut.1.") != std::string::npos;
    EXPECT_EQ(item.value().scalar_type(), norm ? torch::kFloat : torch::kBFloat16) << item.key();
  }
}

TEST_F(TorchScript, CheckpointedChainGivesTheSameGradients) {
  const auto x = torch::randn({4, 1, 28, 28});
  auto plain = load_torchscript(dir_ + "/resnet18.pt");
  CheckpointedSequential checkpointed(load_torchscript(dir_ + "/resnet18.pt"),
                                      CheckpointedSequentialOptions().kind(ScheduleKind::kSqrt));
  plain->forward(x).pow(2).sum().backward();
  checkpointed->forward(x).pow(2).sum().backward();
  const auto a = plain->parameters(), b = checkpointed->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].grad().equal(b[i].grad())) << "parameter " << i;
}

TEST_F(TorchScript, AScriptedModelTrainsAsTheSameModelInCppDoes) {
  // TorchScript's profiling executor, once it has optimized a graph,
  // differentiates parts of it itself and saves other tensors than eager
  // autograd: on this CNN at batch 128 its steps peaked 1.24 MiB higher
  // from the second step on (and ran about 6% slower, bench/tax.py).
  // memfit runs the children without the executor's optimizations, so a
  // scripted model's steps are those of the same model built in C++.
  auto scripted = load_torchscript(dir_ + "/blocks.pt");
  auto native = make_resnet(ModelOptions().depth(3).inplace(false));
  const auto from = scripted->parameters(), to = native->parameters();
  ASSERT_EQ(from.size(), to.size());
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
  }
  const auto x = torch::randn({32, 1, 28, 28});
  const auto y = torch::randint(10, {32});
  Trainer a(scripted, TrainerOptions().batch_size(32)), b(native, TrainerOptions().batch_size(32));
  for (int step = 1; step <= 4; ++step) {
    PeakMeter meter_a(torch::kCPU);
    const auto ra = a.train_step(torch::data::Example<>(x, y));
    const int64_t peak_a = meter_a.peak_delta();
    PeakMeter meter_b(torch::kCPU);
    const auto rb = b.train_step(torch::data::Example<>(x, y));
    const int64_t peak_b = meter_b.peak_delta();
    EXPECT_EQ(ra.loss, rb.loss) << "step " << step;
    EXPECT_EQ(peak_a, peak_b) << "step " << step << ": the step's peak above what it started with";
  }
}

TEST_F(TorchScript, AModuleWhoseForwardIsNotItsChildrenIsAClearError) {
  try {
    load_torchscript(dir_ + "/resnet18_whole.pt", torch::randn({2, 1, 28, 28}));
    ADD_FAILURE() << "resnet18's forward flattens between avgpool and fc";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.msg()).find("is not its children run in order"), std::string::npos) << e.msg();
  }
  EXPECT_THROW(load_torchscript(dir_ + "/none.pt"), c10::Error);
}

TEST_F(TorchScript, AnErrorInsideAScriptedLayerIsOneLineAndRunningOutOfMemoryStaysOutOfMemory) {
  // The interpreter rethrows both as a std::runtime_error of 20-odd lines.
  auto two_only = load_torchscript(dir_ + "/two_only.pt");  // its first layer takes batches of 2 only
  try {
    two_only->forward(torch::randn({8, 1, 28, 28}));
    ADD_FAILURE() << "a batch of 8 cannot be expanded from 2";
  } catch (const c10::OutOfMemoryError& e) {
    ADD_FAILURE() << "not out of memory: " << e.msg();
  } catch (const c10::Error& e) {
    const std::string msg = e.msg();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_EQ(msg.rfind("TorchScript TwoOnly failed: ", 0), 0u) << msg;
    EXPECT_NE(msg.find("expanded size"), std::string::npos) << msg;
  }
  try {
    load_torchscript(dir_ + "/wrong_input.pt", torch::randn({2, 1, 28, 28}));
    ADD_FAILURE() << "its Linear takes 100 features, not 784";
  } catch (const c10::Error& e) {
    const std::string msg = e.msg();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_NE(msg.find("wrong_input.pt's forward fails on the check input of shape [2, 1, 28, 28]: "),
              std::string::npos) << msg;
  }
  auto resnet = load_torchscript(dir_ + "/resnet18.pt");
  const auto x = torch::randn({2, 1, 28, 28});
  memory_allocated();  // tracking on
  for (int64_t k : {1, 5, 20}) {
    AllocationFault fault(k);
    EXPECT_THROW(resnet->forward(x), c10::OutOfMemoryError) << "allocation " << k << " failed inside TorchScript";
    EXPECT_TRUE(fault.failed()) << "allocation " << k;
  }
}

} // namespace
} // namespace memfit
