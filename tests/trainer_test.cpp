#include "memfit/trainer.h"

#include "memfit/compat.h"
#include "memfit/models.h"
#include "test_util.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <limits>
#include <numeric>
#include <tuple>

namespace memfit {
namespace {

// A small slice of the real test split keeps these tests quick.
const ImageDataset& small_real_data() {
  static const ImageDataset ds = [] {
    auto full = load_fashion_mnist(Split::kTest);
    UntrackedGuard host;
    ImageDataset d;
    d.images = full.images.narrow(0, 0, 2048).clone();
    d.labels = full.labels.narrow(0, 0, 2048).clone();
    return d;
  }();
  return ds;
}

class TrainerTest : public testing::Seeded {
 protected:
  void SetUp() override {
    Seeded::SetUp();
    if (!std::filesystem::exists(FashionMnistOptions().root())) {
      GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed";
    }
  }
};

double mean_loss(const TrainReport& r, size_t from, size_t to) {
  double s = 0;
  for (size_t i = from; i < to; ++i) s += r.steps[i].loss;
  return s / double(to - from);
}

TEST_F(TrainerTest, LossFallsOnRealData) {
  Trainer trainer(make_mlp(ModelOptions().width(128).depth(1)),
                  TrainerOptions().batch_size(64).steps(60).lr(2e-3));
  const auto report = trainer.fit(small_real_data());
  ASSERT_EQ(report.steps.size(), 60u);
  EXPECT_LT(mean_loss(report, 50, 60), 0.7 * mean_loss(report, 0, 10));
  const auto eval = trainer.evaluate(small_real_data());
  EXPECT_GT(eval.accuracy, 0.6) << "ten classes: chance is 0.1";
}

TEST_F(TrainerTest, SameSeedGivesBitwiseSameLosses) {
  auto run = [] {
    torch::manual_seed(3);
    Trainer t(make_resnet(ModelOptions().width(4).depth(1)),
              TrainerOptions().batch_size(16).steps(4).seed(11));
    return t.fit(small_real_data());
  };
  const auto a = run(), b = run();
  for (size_t i = 0; i < a.steps.size(); ++i) EXPECT_EQ(a.steps[i].loss, b.steps[i].loss);
}

TEST_F(TrainerTest, EpochsCoverTheDataAndStepsPeakIsRecorded) {
  Trainer trainer(make_mlp(ModelOptions().width(16).depth(1)),
                  TrainerOptions().batch_size(500).epochs(2));
  EXPECT_EQ(trainer.total_steps(small_real_data()), 10);  // ceil(2048 / 500) × 2
  const auto report = trainer.fit(small_real_data());
  ASSERT_EQ(report.steps.size(), 10u);
  EXPECT_EQ(report.steps.back().epoch, 1);
  for (const auto& s : report.steps) {
    // At least the batch itself was live during each step; the last batch of
    // an epoch holds the 48 examples left over.
    const int64_t examples = (s.step % 5 == 0) ? 48 : 500;
    EXPECT_GE(s.peak_bytes - s.current_bytes, examples * 784 * 4) << "step " << s.step;
  }
  EXPECT_EQ(report.step_memory.parameters, (784 * 16 + 16 + 16 * 10 + 10) * 4);
  EXPECT_EQ(report.step_memory.optimizer_state, 2 * report.step_memory.parameters);
}

TEST_F(TrainerTest, OverBudgetStepThrowsOutOfMemoryAndMemoryIsReleased) {
  Trainer trainer(make_mlp(ModelOptions().width(256).depth(2)),
                  TrainerOptions().batch_size(256).steps(2));
  const int64_t base = memory_allocated();
  set_memory_budget(torch::kCPU, base + 256 * 1024);  // less than one batch's activations
  EXPECT_THROW(trainer.fit(small_real_data()), c10::OutOfMemoryError);
  set_memory_budget(torch::kCPU, 0);
  EXPECT_EQ(memory_allocated(), base) << "a failed step leaves nothing behind";
  EXPECT_NO_THROW(trainer.fit(small_real_data()));
}

TEST_F(TrainerTest, EvaluationUnderNoGradPeaksBelowAForwardWithGrad) {
  auto model = make_mlp(ModelOptions().width(512).depth(6));
  Trainer trainer(model, TrainerOptions().eval_batch_size(512));
  const auto eval = trainer.evaluate(small_real_data());
  PeakMeter with_grad;
  auto x = small_real_data().images.narrow(0, 0, 512).clone();
  auto loss = model->forward(x).sum();
  const int64_t grad_peak = with_grad.peak_delta();
  EXPECT_LT(eval.peak_bytes - with_grad.start(), grad_peak / 2)
      << "no-grad frees each activation once the next layer has it";
}

TEST_F(TrainerTest, ReportJsonHoldsStepsAndSummary) {
  Trainer trainer(make_mlp(ModelOptions().width(8).depth(1)),
                  TrainerOptions().batch_size(32).steps(3));
  auto report = trainer.fit(small_real_data());
  report.test = trainer.evaluate(small_real_data());
  report.evaluated = true;
  const auto j = nlohmann::json::parse(report.to_json());
  ASSERT_EQ(j["steps"].size(), 3u);
  for (const char* key : {"step", "loss", "seconds", "peak_bytes"}) {
    EXPECT_TRUE(j["steps"][0].contains(key)) << key;
  }
  for (const char* key : {"final_loss", "test_accuracy", "peak_bytes", "samples_per_second"}) {
    EXPECT_TRUE(j["summary"].contains(key)) << key;
  }
  EXPECT_EQ(j["summary"]["peak_bytes"].get<int64_t>(), report.peak_bytes);
}

TEST_F(TrainerTest, BadOptionsAreRejectedInTheConstructor) {
  auto model = make_mlp(ModelOptions().width(8).depth(1));
  EXPECT_THROW(Trainer(model, TrainerOptions().batch_size(0)), c10::Error);
  EXPECT_THROW(Trainer(model, TrainerOptions().lr(-1)), c10::Error);
  EXPECT_THROW(Trainer(model, TrainerOptions().steps(-3)), c10::Error);
  EXPECT_THROW(parse_optimizer_kind("lamb"), c10::Error);
}

TEST_F(TrainerTest, Bf16AutocastHalvesActivationBytesAndStillLearns) {
  auto run = [](Precision precision) {
    torch::manual_seed(5);
    Trainer t(make_resnet(ModelOptions().width(8).depth(1)),
              TrainerOptions().batch_size(64).steps(40).lr(3e-3).precision(precision));
    return t.fit(small_real_data());
  };
  const auto fp32 = run(Precision::kFP32);
  const auto bf16 = run(Precision::kBF16);
  EXPECT_EQ(bf16.precision, "bf16");
  EXPECT_EQ(bf16.step_memory.parameters, fp32.step_memory.parameters) << "fp32 parameters";
  // Conv and linear outputs are bf16 (2 of 4 bytes); BatchNorm and ReLU keep
  // their input's dtype, and the fp32 loss is tiny: activations at most 0.6x.
  EXPECT_LT(bf16.step_memory.activations, 0.6 * fp32.step_memory.activations);
  EXPECT_LT(mean_loss(bf16, 30, 40), 0.75 * mean_loss(bf16, 0, 10));
  EXPECT_NEAR(mean_loss(bf16, 30, 40), mean_loss(fp32, 30, 40), 0.1 * mean_loss(fp32, 30, 40));
}

TEST_F(TrainerTest, MasterWeightsHoldLowPrecisionParametersAndHostState) {
  const auto width = 8;
  auto run = [&](MasterWeightsMode mode) {
    torch::manual_seed(5);
    Trainer t(make_resnet(ModelOptions().width(width).depth(1)),
              TrainerOptions().batch_size(32).steps(6).precision(Precision::kBF16).master_weights(mode));
    auto report = t.fit(small_real_data());
    int64_t cast = 0, kept = 0, norm = 0;
    for (const auto& p : t.model()->parameters()) {
      (p.scalar_type() == torch::kBFloat16 ? cast : kept) += p.numel();
    }
    for (const auto& m : t.model()->modules()) {
      if (m->name().find("BatchNorm") == std::string::npos) continue;
      for (const auto& p : m->parameters(false)) norm += p.numel();
    }
    EXPECT_EQ(kept, mode == MasterWeightsMode::kNone ? cast + kept : norm)
        << "exactly the BatchNorm weights and biases stay fp32";
    return std::make_tuple(report, cast, kept);
  };
  const auto [none, none_cast, none_kept] = run(MasterWeightsMode::kNone);
  EXPECT_EQ(none_cast, 0);
  const auto [host, cast, kept] = run(MasterWeightsMode::kHost);
  EXPECT_GT(cast, 0);
  EXPECT_EQ(host.step_memory.parameters, none.step_memory.parameters - 2 * cast)
      << "2 bytes saved per cast parameter";
  EXPECT_EQ(host.step_memory.optimizer_state, 0) << "optimizer state on the host";
  EXPECT_EQ(host.step_memory.gradients, none.step_memory.gradients - 2 * cast);
  const auto [device, dcast, dkept] = run(MasterWeightsMode::kDevice);
  EXPECT_EQ(device.step_memory.parameters, host.step_memory.parameters + 4 * dcast)
      << "fp32 masters of the cast parameters on the device";
  EXPECT_EQ(device.step_memory.optimizer_state, none.step_memory.optimizer_state);
  for (size_t i = 0; i < host.steps.size(); ++i) {
    EXPECT_EQ(host.steps[i].loss, device.steps[i].loss) << "where the masters live changes nothing";
  }
}

TEST_F(TrainerTest, ClippingBoundsTheUpdateNorm) {
  // SGD without momentum, lr 1: the update is the clipped gradient, whose
  // total norm is max_grad_norm (PyTorch's clip coefficient max / (norm + 1e-6)).
  auto model = make_mlp(ModelOptions().width(32).depth(1));
  std::vector<torch::Tensor> before;
  for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
  Trainer t(model, TrainerOptions()
                       .batch_size(64)
                       .steps(1)
                       .lr(1.0)
                       .optimizer(OptimizerKind::kSGD)
                       .momentum(0)
                       .max_grad_norm(1e-3));
  t.fit(small_real_data());
  double sq = 0;
  const auto after = model->parameters();
  for (size_t i = 0; i < after.size(); ++i) sq += (after[i] - before[i]).pow(2).sum().item<double>();
  EXPECT_NEAR(std::sqrt(sq), 1e-3, 1e-6);
}

TEST_F(TrainerTest, NonfiniteLossStopsNamingTheStepOrIsSkipped) {
  ImageDataset bad;
  {
    UntrackedGuard host;
    bad.images = small_real_data().images.narrow(0, 0, 64).clone();
    bad.labels = small_real_data().labels.narrow(0, 0, 64).clone();
    bad.images.fill_(std::numeric_limits<float>::quiet_NaN());
  }
  auto model = make_mlp(ModelOptions().width(8).depth(1));
  Trainer t(model, TrainerOptions().batch_size(32).steps(2));
  try {
    t.fit(bad);
    FAIL() << "a NaN loss must stop the run";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.msg()).find("step 1 (epoch 0): the loss is NaN"), std::string::npos)
        << e.msg();
  }
  std::vector<torch::Tensor> before;
  for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
  Trainer skipping(model, TrainerOptions().batch_size(32).steps(2).nonfinite_loss(NonfiniteLoss::kSkip));
  const auto report = skipping.fit(bad);
  EXPECT_EQ(report.skipped_steps, 2);
  for (const auto& s : report.steps) EXPECT_TRUE(s.skipped);
  const auto after = model->parameters();
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(after[i].equal(before[i]));
}

TEST_F(TrainerTest, PrecisionOptionsAreChecked) {
  auto model = make_mlp(ModelOptions().width(8).depth(1));
  EXPECT_THROW(Trainer(model, TrainerOptions().master_weights(MasterWeightsMode::kHost)), c10::Error)
      << "master weights need bf16 or fp16";
  if (!compat::kCpuAutocastHalf) {
    EXPECT_THROW(Trainer(model, TrainerOptions().precision(Precision::kFP16)), c10::Error);
  }
  EXPECT_THROW(parse_master_weights_mode("gpu"), c10::Error);
  EXPECT_THROW(Trainer(model, TrainerOptions().max_grad_norm(-1)), c10::Error);
}

class CudaTrainer : public testing::OnCuda {
 protected:
  void SetUp() override {
    testing::OnCuda::SetUp();
    if (IsSkipped()) return;
    if (!std::filesystem::exists(FashionMnistOptions().root())) {
      GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed";
    }
  }
};

TEST_F(CudaTrainer, EveryPrecisionLearnsAndLowPrecisionHalvesDeviceBytes) {
  struct Run {
    Precision precision;
    MasterWeightsMode master;
  };
  std::vector<TrainReport> reports;
  for (const auto& r : {Run{Precision::kFP32, MasterWeightsMode::kNone},
                        Run{Precision::kFP16, MasterWeightsMode::kNone},
                        Run{Precision::kBF16, MasterWeightsMode::kNone},
                        Run{Precision::kFP16, MasterWeightsMode::kHost}}) {
    torch::manual_seed(5);
    Trainer t(make_resnet(ModelOptions().width(16).depth(1)),
              TrainerOptions().batch_size(512).steps(30).lr(3e-3).device(cuda).precision(r.precision).master_weights(r.master));
    reports.push_back(t.fit(small_real_data()));
    const auto& rep = reports.back();
    EXPECT_LT(mean_loss(rep, 25, 30), 0.75 * mean_loss(rep, 0, 5)) << rep.precision;
    std::cout << rep.precision << " peak " << rep.step_memory.peak << " parameters "
              << rep.step_memory.parameters << " activations " << rep.step_memory.activations
              << " final loss " << rep.final_loss << "\n";
    if (r.precision == Precision::kFP16) {
      EXPECT_GT(rep.final_scale, 0) << "fp16 runs with a GradScaler";
    }
  }
  // On CUDA "activations" also hold cuBLAS/cuDNN workspaces, which differ by
  // dtype; a batch of 512 makes the activations themselves dominate.
  EXPECT_LT(reports[1].step_memory.peak, 0.75 * reports[0].step_memory.peak);
  EXPECT_LT(reports[3].step_memory.parameters, 0.6 * reports[0].step_memory.parameters);
  EXPECT_EQ(reports[3].step_memory.optimizer_state, 0);
}

} // namespace
} // namespace memfit
