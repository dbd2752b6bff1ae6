#include "memfit/stream.h"

#include "memfit/models.h"
#include "memfit/checkpoint.h"
#include "memfit/schedule.h"
#include "memfit/trainer.h"

#include "test_util.h"

#include <filesystem>

namespace memfit {
namespace {

class ParameterStreamTest : public testing::Seeded {};

MasterWeightsOptions streamed() {
  return MasterWeightsOptions()
      .dtype(at::kFloat)
      .offload(Offload::kHost)
      .gradients(Offload::kHost)
      .parameters(Offload::kHost);
}

torch::nn::Sequential copy_of(const torch::nn::Sequential& net) {
  return std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone());
}

// The plain chain's output and parameter gradients on (x, labels).
std::pair<torch::Tensor, std::vector<torch::Tensor>> plain_step(torch::nn::Sequential net,
                                                                const torch::Tensor& x) {
  auto y = net->forward(x);
  (y * y).sum().backward();
  std::vector<torch::Tensor> grads;
  for (const auto& p : net->parameters()) grads.push_back(p.grad().clone());
  return {y.detach(), grads};
}

// The same through a ParameterStream: output and the host masters' gradients.
std::pair<torch::Tensor, std::vector<torch::Tensor>> streamed_step(torch::nn::Sequential net,
                                                                   const torch::Tensor& x,
                                                                   int64_t tile_bytes = 0,
                                                                   ParameterStream** out = nullptr) {
  MasterWeights master(*net, streamed());
  ParameterStream stream(net, master, StreamOptions().tile_bytes(tile_bytes));
  if (out != nullptr) *out = &stream;
  auto y = stream.forward(x);
  (y * y).sum().backward();
  std::vector<torch::Tensor> grads;
  for (const auto& m : master.master_parameters()) grads.push_back(m.grad().clone());
  return {y.detach(), grads};
}

void expect_bitwise(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].equal(b[i])) << "gradient " << i;
}

TEST_F(ParameterStreamTest, UntiledLinearLayersGiveTheResidentGradientsBitwise) {
  auto net = make_mlp(ModelOptions().width(96).depth(2));
  const auto x = torch::randn({16, 1, 28, 28});
  const auto [y_plain, g_plain] = plain_step(copy_of(net), x);
  const auto [y_streamed, g_streamed] = streamed_step(net, x);
  EXPECT_TRUE(y_streamed.equal(y_plain));
  expect_bitwise(g_streamed, g_plain);
}

TEST_F(ParameterStreamTest, TiledLinearLayersMatchWithinRounding) {
  auto net = make_mlp(ModelOptions().width(96).depth(2));
  const auto x = torch::randn({16, 1, 28, 28});
  const auto [y_plain, g_plain] = plain_step(copy_of(net), x);
  // 10 rows of 784 floats per tile of the first layer: 10 tiles of it.
  const auto [y_streamed, g_streamed] = streamed_step(net, x, 10 * 784 * 4);
  // A blocked BLAS (OpenBLAS) rounds a tile's narrower product differently
  // from the whole one, and the input gradient is summed tile by tile.
  EXPECT_LT(testing::relative_difference(y_streamed, y_plain), 1e-6);
  EXPECT_LT(testing::max_relative_difference(g_streamed, g_plain), 1e-6);
  EXPECT_FALSE(g_streamed.front().equal(torch::zeros_like(g_streamed.front()))) << "the gradient reached the master";
}

TEST_F(ParameterStreamTest, OtherLayersAreRecomputedWithTheResidentGradientsBitwise) {
  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)),
                            torch::nn::GroupNorm(2, 4), torch::nn::ReLU(), torch::nn::Flatten(),
                            torch::nn::Linear(4 * 8 * 8, 5));
  const auto x = torch::randn({6, 1, 8, 8});
  const auto [y_plain, g_plain] = plain_step(copy_of(net), x);
  ParameterStream* stream = nullptr;
  const auto [y_streamed, g_streamed] = streamed_step(net, x, 0, &stream);
  EXPECT_TRUE(y_streamed.equal(y_plain));
  expect_bitwise(g_streamed, g_plain);
}

TEST_F(ParameterStreamTest, AGptWithDropoutStreamsWithTheResidentGradientsBitwise) {
  // Embedding, blocks (attention, dropout) and a head on 3-D inputs: all recomputed.
  const auto options = ModelOptions().num_classes(50).width(32).depth(2).heads(2).context(16).dropout(0.1);
  const auto tokens = torch::randint(50, {4, 16}, torch::kLong);
  torch::manual_seed(3);
  auto resident = make_gpt(options);
  torch::manual_seed(3);
  auto net = make_gpt(options);
  torch::manual_seed(7);
  const auto [y_plain, g_plain] = plain_step(resident, tokens);
  torch::manual_seed(7);
  const auto [y_streamed, g_streamed] = streamed_step(net, tokens);
  EXPECT_TRUE(y_streamed.equal(y_plain)) << "the same dropout masks";
  expect_bitwise(g_streamed, g_plain);
}

TEST_F(ParameterStreamTest, LayersAreRunByKind) {
  torch::nn::Sequential net(torch::nn::Flatten(), torch::nn::Linear(64, 32), torch::nn::ReLU(),
                            torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})));
  MasterWeights master(*net, streamed());
  ParameterStream stream(net, master, StreamOptions().tile_bytes(8 * 64 * 4));
  EXPECT_EQ(stream.layer_kind(0), StreamedLayer::kNone);
  EXPECT_EQ(stream.layer_kind(1), StreamedLayer::kLinear);
  EXPECT_EQ(stream.tiles(1), 4);
  EXPECT_EQ(stream.layer_kind(3), StreamedLayer::kRecompute);
  EXPECT_EQ(stream.tiles(3), 0);
  EXPECT_EQ(streamed_bytes(*net[1], 8 * 64 * 4), 8 * 64 * 4 + 8 * 4);
  EXPECT_EQ(streamed_bytes(*net[1], 0), 32 * 64 * 4 + 32 * 4);
  EXPECT_EQ(streamed_bytes(*net[3], 0), 2 * 32 * 4);
}

TEST_F(ParameterStreamTest, TheDeviceHoldsOneTileInsteadOfTheModel) {
  auto net = make_mlp(ModelOptions().width(512).depth(2));  // the default MLP: 2.55 MiB of parameters
  int64_t param_bytes = 0;
  for (const auto& p : net->parameters()) param_bytes += p.numel() * 4;
  const int64_t tile = 64 << 10;
  const int64_t resident = memory_allocated(torch::kCPU);
  MasterWeights master(*net, streamed());
  EXPECT_GE(resident - memory_allocated(torch::kCPU), param_bytes - 6 * 128)
      << "the parameters leave the device, each keeping one element";
  ParameterStream stream(net, master, StreamOptions().tile_bytes(tile));
  const auto x = torch::randn({8, 1, 28, 28});
  reset_peak_memory_stats(torch::kCPU);
  const int64_t base = memory_allocated(torch::kCPU);
  {
    auto y = stream.forward(x);
    (y * y).sum().backward();
  }
  const int64_t peak = max_memory_allocated(torch::kCPU) - base;
  // Activations of 8 examples are 8 × (784 + 4 × 512 + 10) floats (×2 for the
  // gradients flowing back); a tile and its gradient, or a tile and a layer's
  // input gradient, are 2 × 64 KiB: far below one untiled weight (1.53 MiB).
  const int64_t activations = 8 * (784 + 4 * 512 + 10) * 4;
  EXPECT_LE(peak, 2 * activations + 2 * tile + 64 * 1024) << "peak " << peak;
  EXPECT_LT(peak, 784 * 512 * 4);
  EXPECT_EQ(memory_allocated(torch::kCPU), base) << "nothing stays on the device after backward";
}

TEST_F(ParameterStreamTest, ComposesWithACheckpointScheduleAndNoGradEvaluation) {
  torch::nn::Sequential chain;
  chain->push_back(torch::nn::Flatten());
  for (int i = 0; i < 6; ++i) {
    chain->push_back(torch::nn::Linear(i == 0 ? 64 : 32, 32));
    chain->push_back(torch::nn::Tanh());
  }
  const auto x = torch::randn({8, 1, 8, 8});
  const auto [y_plain, g_plain] = plain_step(copy_of(chain), x);
  torch::Tensor y_eval_plain;
  {
    torch::NoGradGuard no_grad;
    y_eval_plain = copy_of(chain)->forward(x);
  }
  CheckpointedSequential ck(chain, CheckpointedSequentialOptions().kind(ScheduleKind::kSqrt));
  torch::nn::Sequential model(ck);
  MasterWeights master(*model, streamed());
  {
    ParameterStream stream(model, master);
    auto y = stream.forward(x);
    EXPECT_TRUE(y.equal(y_plain));
    (y * y).sum().backward();
    std::vector<torch::Tensor> grads;
    for (const auto& m : master.master_parameters()) grads.push_back(m.grad());
    expect_bitwise(grads, g_plain);
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(stream.forward(x).equal(y_eval_plain));
  }
  // Without the stream the layer runner is gone: the released parameters read as zeros.
  torch::NoGradGuard no_grad;
  EXPECT_EQ(ck->forward(x).abs().sum().item<double>(), 0.0);
}

TEST_F(ParameterStreamTest, MasterWeightsGiveTheParametersTheirMastersWhenTheyGo) {
  auto net = make_mlp(ModelOptions().width(16).depth(1));
  std::vector<torch::Tensor> before;
  for (const auto& p : net->parameters()) before.push_back(p.detach().clone());
  {
    MasterWeights master(*net, streamed());
    for (const auto& p : net->parameters()) EXPECT_EQ(p.storage().nbytes(), 4u) << "released";
    torch::NoGradGuard no_grad;
    const_cast<torch::Tensor&>(master.master_parameters()[0]).add_(1.0);
  }
  const auto after = net->parameters();
  EXPECT_TRUE(after[0].equal(before[0] + 1.0)) << "the updated master came back";
  for (size_t i = 1; i < after.size(); ++i) EXPECT_TRUE(after[i].equal(before[i]));
}

TEST_F(ParameterStreamTest, StreamedOnTheCpuTheParametersComeBackToTheMemoryTheModelHeldThemIn) {
  // On the CPU the host is the device: the parameters go back to tracked
  // memory, so a later step or plan counts them again (in the masters'
  // untracked storage, memory_allocated() would miss them).
  const int64_t base = memory_allocated();
  auto net = make_mlp(ModelOptions().width(16).depth(1));
  const int64_t held = memory_allocated() - base;
  ASSERT_EQ(held, storage_bytes(net->parameters()));
  { MasterWeights master(*net, streamed()); }
  EXPECT_EQ(memory_allocated() - base, held) << "as the model held them";
  // Under a budget that refuses them the masters' storage stays, and nothing throws.
  {
    MasterWeights master(*net, streamed());
    set_memory_budget(torch::kCPU, memory_allocated() + 1);
    EXPECT_NO_THROW({ MasterWeights gone(std::move(master)); });
    set_memory_budget(torch::kCPU, 0);
  }
  EXPECT_EQ(memory_allocated() - base, 0);
  for (const auto& p : net->parameters()) EXPECT_GT(p.storage().nbytes(), 4u) << "whole again";
}

TEST_F(ParameterStreamTest, BadSetUpsAreRefusedWithTheFix) {
  auto net = make_mlp(ModelOptions().width(16).depth(1));
  testing::expect_error(
      [&] { MasterWeights(*net, MasterWeightsOptions().dtype(at::kFloat).offload(Offload::kHost).parameters(Offload::kHost)); },
      "set dtype kFloat, offload and gradients to Offload::kHost");
  MasterWeights plain(*net, MasterWeightsOptions().dtype(at::kFloat).offload(Offload::kHost));
  testing::expect_error([&] { ParameterStream(net, plain); }, "parameters(kHost)");
  auto other = make_mlp(ModelOptions().width(16).depth(1));
  MasterWeights master(*other, streamed());
  testing::expect_error([&] { ParameterStream(net, master); }, "build them over the same model");
  testing::expect_error([&] { ParameterStream(other, master, StreamOptions().tile_bytes(-1)); },
                        "tile_bytes must be >= 0 (0: no tiling), got -1");
  ParameterStream stream(other, master);
  AutocastGuard autocast(torch::kCPU, Precision::kBF16);
  testing::expect_error([&] { stream.forward(torch::zeros({2, 1, 28, 28})); }, "runs in fp32");
}

// A user's own module: an input layer, a chain of blocks (Linear, Tanh,
// LayerNorm: a layer recomputed when streamed), a head.
struct ChainedNetImpl : torch::nn::Module {
  explicit ChainedNetImpl(ScheduleKind kind = ScheduleKind::kNone) {
    in = register_module("in", torch::nn::Linear(12, 32));
    torch::nn::Sequential blocks;
    for (int i = 0; i < 4; ++i) {
      blocks->push_back(torch::nn::Linear(32, 32));
      blocks->push_back(torch::nn::Tanh());
      if (i == 1) blocks->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})));
    }
    body = register_module("body", CheckpointedSequential(blocks, CheckpointedSequentialOptions().kind(kind)));
    head = register_module("head", torch::nn::Linear(32, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head->forward(body->forward(torch::relu(in->forward(x)))); }
  torch::nn::Linear in{nullptr}, head{nullptr};
  CheckpointedSequential body{nullptr};
};

TEST_F(ParameterStreamTest, AModulesChainsStreamBlockByBlockWithTheResidentGradientsBitwise) {
  const auto x = torch::randn({6, 12});
  for (auto kind : {ScheduleKind::kNone, ScheduleKind::kSqrt}) {
    torch::manual_seed(3);
    auto plain = std::make_shared<ChainedNetImpl>(kind);
    torch::manual_seed(3);
    auto net = std::make_shared<ChainedNetImpl>(kind);
    const auto y_plain = plain->forward(x);
    (y_plain * y_plain).sum().backward();
    MasterWeights master(*net, streamed());
    ParameterStream stream(net, master);
    ASSERT_EQ(stream.chains(), 1u);
    EXPECT_EQ(stream.layer_kind(0), StreamedLayer::kLinear);
    EXPECT_EQ(stream.layer_kind(4), StreamedLayer::kRecompute) << "the LayerNorm";
    const int64_t rest = (12 * 32 + 32 + 32 * 5 + 5) * 4;  // in and head
    EXPECT_EQ(stream.held_bytes(), rest);
    const int64_t released = memory_allocated(torch::kCPU);
    torch::Tensor y;
    {
      auto held = stream.hold();
      EXPECT_EQ(memory_allocated(torch::kCPU) - released, rest) << "the layers outside the chain, whole";
      y = net->forward(x);
      (y * y).sum().backward();
    }
    EXPECT_EQ(memory_allocated(torch::kCPU) - released, y.nbytes()) << "every parameter went again";
    EXPECT_TRUE(y.equal(y_plain));
    const auto want = plain->parameters();
    const auto& masters = master.master_parameters();
    ASSERT_EQ(masters.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(masters[i].grad().equal(want[i].grad())) << "gradient " << i;
    torch::NoGradGuard no_grad;
    auto held = stream.hold();
    EXPECT_TRUE(net->forward(x).equal(y_plain)) << "no-grad evaluation inside a hold";
  }
}

TEST_F(ParameterStreamTest, AModulesStreamRefusesWhatWouldComputeOnReleasedParameters) {
  auto net = std::make_shared<ChainedNetImpl>();
  MasterWeights master(*net, streamed());
  ParameterStream stream(net, master);
  testing::expect_error([&] { net->forward(torch::zeros({2, 12})); }, "inside ParameterStream::hold()");
  testing::expect_error([&] { stream.forward(torch::zeros({2, 12})); }, "runs the module's own forward inside hold()");
  testing::expect_error([&] { ParameterStream(net, master); }, "already runs its layers through a layer runner");

  auto flat = std::make_shared<torch::nn::LinearImpl>(4, 4);
  MasterWeights flat_master(*flat, streamed());
  testing::expect_error([&] { ParameterStream(std::shared_ptr<torch::nn::Module>(flat), flat_master); },
                        "holds no CheckpointedSequential: hold its repeated blocks in one");

  struct TiedImpl : torch::nn::Module {  // the head reuses the chain's first weight
    TiedImpl() {
      body = register_module("body", CheckpointedSequential(torch::nn::Sequential(torch::nn::Linear(4, 4))));
      tied = register_parameter("tied", body->sequential()->ptr(0)->parameters()[0]);
    }
    CheckpointedSequential body{nullptr};
    torch::Tensor tied;
  };
  auto tied = std::make_shared<TiedImpl>();
  MasterWeights tied_master(*tied, streamed());
  testing::expect_error([&] { ParameterStream(tied, tied_master); }, "is shared with a chain's layer (tied weights)");

  // refusal() says the same before any MasterWeights exist, and names the parameter's path.
  EXPECT_NE(ParameterStream::refusal(*tied).find("parameter tied, outside the chains, is shared"), std::string::npos)
      << ParameterStream::refusal(*tied);
  EXPECT_NE(ParameterStream::refusal(*net).find("already runs its layers"), std::string::npos);
  EXPECT_NE(ParameterStream::refusal(*flat).find("holds no CheckpointedSequential"), std::string::npos);
  EXPECT_EQ(ParameterStream::refusal(*std::make_shared<ChainedNetImpl>()), "");
}

class StreamedTrainerTest : public testing::WithFashionMnist {};

std::vector<torch::Tensor> trained_parameters(Trainer& t) {
  UntrackedGuard host;
  std::vector<torch::Tensor> out;
  for (const auto& p : t.master_weights()->master_parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST_F(StreamedTrainerTest, StreamedParametersTrainLikeResidentOnesWithLessMemory) {
  const auto& data = testing::fashion_test_head(512);
  auto run = [&](Offload parameters, int64_t tile_bytes) {
    torch::manual_seed(4);
    Trainer t(make_mlp(ModelOptions().width(128).depth(2)),
              TrainerOptions().batch_size(64).steps(4).micro_batch_size(16).offload_optimizer(Offload::kHost)
                  .offload_gradients(Offload::kHost).offload_parameters(parameters)
                  .stream(StreamOptions().tile_bytes(tile_bytes)));
    auto report = t.fit(data);
    report.test = t.evaluate(data);
    return std::make_pair(trained_parameters(t), report);
  };
  const auto [resident, resident_report] = run(Offload::kNone, 0);
  const auto [streamed, streamed_report] = run(Offload::kHost, 0);
  const auto [tiled, tiled_report] = run(Offload::kHost, 16 * 784 * 4);
  EXPECT_EQ(testing::max_relative_difference(streamed, resident), 0.0) << "the same math, bitwise";
  for (size_t i = 0; i < resident_report.steps.size(); ++i) {
    EXPECT_EQ(streamed_report.steps[i].loss, resident_report.steps[i].loss);
  }
  EXPECT_EQ(streamed_report.test.loss, resident_report.test.loss);
  EXPECT_LT(testing::max_relative_difference(tiled, resident), 1e-5) << "tiles round differently";
  const int64_t params = (784 * 128 + 128 * 128 + 128 * 10 + 128 + 128 + 10) * 4;
  EXPECT_GE(resident_report.peak_bytes - streamed_report.peak_bytes, params - 784 * 128 * 4)
      << "the parameters leave the device; the largest layer comes and goes";
  EXPECT_LT(tiled_report.peak_bytes, streamed_report.peak_bytes);
  EXPECT_LT(streamed_report.step_memory.parameters, 8 * 64) << "six released parameters";
}

TEST_F(StreamedTrainerTest, SavesAndResumesTheStreamedModel) {
  const auto& data = testing::fashion_test_head(512);
  const auto dir = std::filesystem::temp_directory_path() / "memfit_stream_resume";
  std::filesystem::remove_all(dir);
  auto options = [] {
    return TrainerOptions().batch_size(32).offload_optimizer(Offload::kHost).offload_gradients(Offload::kHost)
        .offload_parameters(Offload::kHost).stream(StreamOptions().tile_bytes(32 << 10));
  };
  torch::manual_seed(5);
  Trainer whole(make_mlp(ModelOptions().width(64).depth(1)), options().steps(6));
  const auto all = whole.fit(data);
  torch::manual_seed(5);
  Trainer first(make_mlp(ModelOptions().width(64).depth(1)), options().steps(3).save_dir(dir.string()));
  first.fit(data);
  torch::manual_seed(99);  // other initial values: resume must replace them all
  Trainer second(make_mlp(ModelOptions().width(64).depth(1)), options().steps(6));
  second.resume(dir.string());
  const auto rest = second.fit(data);
  ASSERT_EQ(rest.steps.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rest.steps[i].loss, all.steps[i + 3].loss);
  // The checkpoint's model holds the trained values (for memfit generate), not the released zeros.
  auto loaded = make_mlp(ModelOptions().width(64).depth(1));
  load_trainer_model(*loaded, dir.string());
  const auto masters = first.master_weights()->master_parameters();
  const auto params = loaded->parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(params[i].equal(masters[i]));
  std::filesystem::remove_all(dir);
}

torch::Tensor squared_error(ChainedNetImpl& net, const torch::data::Example<>& b) {
  return (net.forward(b.data) - b.target).pow(2).mean();
}

TEST_F(StreamedTrainerTest, AUsersModuleStreamsItsChainsLikeResidentParametersWithLessMemory) {
  auto run = [](Offload parameters, std::vector<int64_t>* peaks) {
    torch::manual_seed(6);
    auto net = std::make_shared<ChainedNetImpl>(ScheduleKind::kSqrt);
    Trainer t(net, squared_error,
              TrainerOptions().batch_size(16).micro_batch_size(8).optimizer(OptimizerKind::kAdam).lr(1e-2)
                  .offload_optimizer(Offload::kHost).offload_gradients(Offload::kHost).offload_parameters(parameters));
    for (int64_t i = 0; i < 3; ++i) {
      torch::manual_seed(20 + i);
      peaks->push_back(t.train_step(torch::data::Example<>(torch::randn({16, 12}), torch::randn({16, 5}))).peak_bytes);
    }
    torch::manual_seed(30);
    const torch::data::Example<> b(torch::randn({4, 12}), torch::randn({4, 5}));
    const double eval = t.eval_step(b, [&](const torch::data::Example<>& e) { return squared_error(*net, e).item<double>(); });
    return std::make_pair(trained_parameters(t), eval);
  };
  std::vector<int64_t> resident_peaks, streamed_peaks;
  const auto [resident, resident_eval] = run(Offload::kNone, &resident_peaks);
  const auto [streamed, streamed_eval] = run(Offload::kHost, &streamed_peaks);
  EXPECT_EQ(testing::max_relative_difference(streamed, resident), 0.0) << "the same math, bitwise";
  EXPECT_EQ(streamed_eval, resident_eval);
  const int64_t chain = (4 * (32 * 32 + 32) + 2 * 32) * 4;
  for (size_t i = 0; i < resident_peaks.size(); ++i) {
    EXPECT_GE(resident_peaks[i] - streamed_peaks[i], chain - 2 * (32 * 32 + 32) * 4)
        << "step " << i << ": the chain's parameters leave the device; one layer and its gradient come and go";
  }
}

// On the device: the chain's layers come from pinned host masters one at a
// time and their gradients go back; the rest of the module is held per
// micro-batch. The same math as resident parameters, with the optimizer and
// gradients on the host in both runs.
class CudaStreamedTrainer : public testing::OnCuda {};

TEST_F(CudaStreamedTrainer, AUsersModuleStreamsItsChainsOnTheDeviceLikeResidentParameters) {
  auto run = [&](Offload parameters, std::vector<int64_t>* peaks) {
    torch::manual_seed(6);
    auto net = std::make_shared<ChainedNetImpl>(ScheduleKind::kSqrt);
    Trainer t(net, squared_error,
              TrainerOptions().batch_size(16).micro_batch_size(8).optimizer(OptimizerKind::kAdam).lr(1e-2)
                  .device(cuda).offload_optimizer(Offload::kHost).offload_gradients(Offload::kHost)
                  .offload_parameters(parameters));
    for (int64_t i = 0; i < 3; ++i) {
      torch::manual_seed(20 + i);
      peaks->push_back(t.train_step(torch::data::Example<>(torch::randn({16, 12}), torch::randn({16, 5}))).peak_bytes);
    }
    for (const auto& m : t.master_weights()->master_parameters()) {
      EXPECT_TRUE(m.is_pinned()) << "host masters are pinned, so copies to the device are asynchronous";
    }
    return trained_parameters(t);
  };
  std::vector<int64_t> resident_peaks, streamed_peaks;
  const auto resident = run(Offload::kNone, &resident_peaks);
  const auto streamed = run(Offload::kHost, &streamed_peaks);
  EXPECT_EQ(testing::max_relative_difference(streamed, resident), 0.0) << "the same math, bitwise";
  // The caching allocator rounds each block up to 512 bytes, so the device
  // saves at least what the CPU's exact count does (the test above).
  const int64_t chain = (4 * (32 * 32 + 32) + 2 * 32) * 4;
  for (size_t i = 0; i < resident_peaks.size(); ++i) {
    EXPECT_GE(resident_peaks[i] - streamed_peaks[i], chain - 2 * (32 * 32 + 32) * 4) << "step " << i;
  }
}

TEST_F(StreamedTrainerTest, RefusesWhatItCannotStream) {
  testing::expect_error(
      [] { Trainer(make_mlp(), TrainerOptions().offload_optimizer(Offload::kHost).offload_parameters(Offload::kHost)); },
      "set offload_optimizer and offload_gradients to Offload::kHost too");
  testing::expect_error(
      [] {
        Trainer(make_mlp(), TrainerOptions().precision(Precision::kBF16).offload_optimizer(Offload::kHost)
                                .offload_gradients(Offload::kHost).offload_parameters(Offload::kHost));
      },
      "runs in fp32 (got precision bf16)");
}

TEST_F(StreamedTrainerTest, AModuleAnotherTrainerStreamsIsRefusedUntilThatTrainerEnds) {
  // While a Trainer streams them, the module's parameters are one-element
  // placeholders: another Trainer (or a plan's probe) over them is refused
  // in memfit's own line, and once the first Trainer ends the module is
  // whole again and trains.
  auto mlp = make_mlp(ModelOptions().width(16).depth(1));
  const auto streamed = TrainerOptions().offload_optimizer(Offload::kHost).offload_gradients(Offload::kHost)
                            .offload_parameters(Offload::kHost);
  {
    Trainer first(mlp, streamed);
    testing::expect_error([&] { Trainer(mlp, TrainerOptions()); },
                          "Trainer: parameter 'fc0.weight' of shape [16, 784] has no values of its own: another "
                          "Trainer streams this module's parameters (TrainerOptions::offload_parameters)");
  }
  Trainer(mlp, TrainerOptions().batch_size(16).steps(1)).fit(testing::fashion_test_head(64));
}

} // namespace
} // namespace memfit
