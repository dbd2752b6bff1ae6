#include "memfit/trainer.h"

#include "compat.h"
#include "memfit/environment.h"
#include "memfit/models.h"
#include "test_util.h"

#include <ATen/record_function.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <numeric>
#include <tuple>

#include <unistd.h>

namespace memfit {
namespace {

// A small slice of the real test split keeps these tests quick.
const ImageDataset& small_real_data() { return testing::fashion_test_head(2048); }

class TrainerTest : public testing::WithFashionMnist {};

std::vector<torch::Tensor> parameters_of(Trainer& t) {
  UntrackedGuard host;  // copies kept by the test are not the trainer's memory
  std::vector<torch::Tensor> out;
  for (const auto& p : t.model()->parameters()) out.push_back(p.detach().clone());
  return out;
}

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
    // an epoch holds the 48 examples left over. Step 1 also made Adam's
    // state, which stays (two moments per parameter).
    const int64_t examples = (s.step % 5 == 0) ? 48 : 500;
    const int64_t state_made = s.step == 1 ? 2 * (784 * 16 + 16 + 16 * 10 + 10) * 4 : 0;
    EXPECT_GE(s.peak_bytes - s.current_bytes + state_made, examples * 784 * 4) << "step " << s.step;
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

// OptimizerKind builds memfit's optimizers on the kernel asked for: kAuto is
// LibTorch's fused kernel where it has one, also for the host step of
// offload_optimizer, within rounding of the loop; the report names it.
TEST_F(TrainerTest, TheOptimizerRunsTheFusedKernelWhereLibTorchHasItAlsoOnTheHostAndTheReportSaysSo) {
  for (auto offload : {Offload::kNone, Offload::kHost}) {
    auto run = [&](optim::Kernel kernel) {
      torch::manual_seed(7);
      Trainer t(make_mlp(ModelOptions().width(16).depth(1)),
                TrainerOptions().batch_size(32).steps(5).optimizer_kernel(kernel).offload_optimizer(offload));
      const auto report = t.fit(small_real_data());
      EXPECT_EQ(nlohmann::json::parse(report.to_json())["summary"]["optimizer_kernel"], report.optimizer_kernel);
      return std::make_pair(parameters_of(t), report.optimizer_kernel);
    };
    const auto [loop, loop_kernel] = run(optim::Kernel::kLoop);
    const auto [fastest, fastest_kernel] = run(optim::Kernel::kAuto);
    EXPECT_EQ(loop_kernel, "loop");
    EXPECT_EQ(fastest_kernel, optim::has_fused_kernels(torch::kCPU) ? "fused" : "loop");
    EXPECT_LT(testing::max_relative_difference(fastest, loop), 1e-6) << "offload " << int(offload);
  }
}

// fp16 on the CPU (LibTorch 2.x): the GradScaler hands its scale to the
// fused kernel, which unscales as it updates, and the run stays within
// rounding of the loop kernel's, which unscales first.
TEST_F(TrainerTest, Fp16StepsUnscaleInsideTheFusedKernelWithinRoundingOfTheLoop) {
  if (!compat::kCpuAutocastHalf || !optim::has_fused_kernels(torch::kCPU)) {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no fp16 CPU autocast or no fused CPU kernels";
  }
  auto run = [&](optim::Kernel kernel) {
    torch::manual_seed(7);
    Trainer t(make_mlp(ModelOptions().width(16).depth(1)),
              TrainerOptions().batch_size(32).steps(6).precision(Precision::kFP16).optimizer_kernel(kernel));
    const auto report = t.fit(small_real_data());
    EXPECT_GT(report.final_scale, 0) << "fp16 runs with a GradScaler";
    return std::make_pair(parameters_of(t), report);
  };
  const auto [loop, loop_report] = run(optim::Kernel::kLoop);
  const auto [fused, fused_report] = run(optim::Kernel::kFused);
  EXPECT_EQ(fused_report.optimizer_kernel, "fused");
  EXPECT_EQ(fused_report.skipped_steps, loop_report.skipped_steps);
  EXPECT_LT(testing::max_relative_difference(fused, loop), 1e-5);
}

// A step reads one value to the host however many micro-batches it has (the
// summed loss, for the record and the non-finite check); clipping reads its
// norm too. The loop kernel: the CPU's fused kernels read their step counts
// on the host, where that is no synchronisation.
TEST_F(TrainerTest, AStepReadsOneValueToTheHostWhateverItsMicroBatches) {
  struct Case {
    const char* name;
    TrainerOptions options;
    int64_t reads;
  };
  const auto base = TrainerOptions().batch_size(32).optimizer_kernel(optim::Kernel::kLoop);
  const std::vector<Case> cases{
      {"whole batch", TrainerOptions(base), 1},
      {"4 micro-batches", TrainerOptions(base).micro_batch_size(8), 1},
      {"4 micro-batches, skipping non-finite losses",
       TrainerOptions(base).micro_batch_size(8).nonfinite_loss(NonfiniteLoss::kSkip), 1},
      {"4 micro-batches, SGD, clipped", TrainerOptions(base).micro_batch_size(8).optimizer(OptimizerKind::kSGD)
                                           .max_grad_norm(1.0), 2},
  };
  const auto& data = small_real_data();
  for (const auto& c : cases) {
    torch::manual_seed(3);
    Trainer t(make_mlp(ModelOptions().width(16).depth(1)), c.options);
    for (int64_t i = 0; i < 3; ++i) {
      const torch::data::Example<> batch(data.images.narrow(0, 32 * i, 32), data.labels.narrow(0, 32 * i, 32));
      testing::HostReads reads;
      const auto record = t.train_step(batch);
      EXPECT_EQ(reads.count(), c.reads) << c.name << ", step " << i + 1;
      EXPECT_TRUE(std::isfinite(record.loss)) << c.name;
    }
  }
}

// NonfiniteLoss::kUnchecked: a step reads nothing back to the host, with
// or without micro-batches; its record keeps the loss on the device, equal
// to what a checked step reads, and the parameters are the checked run's
// bitwise. fit and a process group refuse it, naming what works.
TEST_F(TrainerTest, AnUncheckedStepReadsNothingAndKeepsItsLossOnTheDevice) {
  const auto data = small_real_data();
  for (int64_t micro : {0, 8}) {
    auto run = [&](NonfiniteLoss mode) {
      torch::manual_seed(3);
      Trainer t(make_mlp(ModelOptions().width(16).depth(1)),
                TrainerOptions().batch_size(32).micro_batch_size(micro).nonfinite_loss(mode)
                    .optimizer_kernel(optim::Kernel::kLoop));
      std::vector<double> losses;
      for (int64_t i = 0; i < 3; ++i) {
        const torch::data::Example<> batch(data.images.narrow(0, 32 * i, 32), data.labels.narrow(0, 32 * i, 32));
        int64_t reads = 0;
        StepRecord record;
        {
          testing::HostReads counted;
          record = t.train_step(batch);
          reads = counted.count();
        }
        EXPECT_EQ(reads, mode == NonfiniteLoss::kUnchecked ? 0 : 1) << "micro-batch " << micro << ", step " << i + 1;
        losses.push_back(record.loss_tensor.item<double>());
        if (mode == NonfiniteLoss::kUnchecked) {
          EXPECT_TRUE(std::isnan(record.loss)) << "left unread";
        } else {
          EXPECT_EQ(record.loss, losses.back());
        }
      }
      return std::make_pair(parameters_of(t), losses);
    };
    const auto [checked, checked_losses] = run(NonfiniteLoss::kError);
    const auto [unchecked, unchecked_losses] = run(NonfiniteLoss::kUnchecked);
    EXPECT_EQ(unchecked_losses, checked_losses) << "micro-batch " << micro;
    testing::expect_bitwise(unchecked, checked, "micro-batch " + std::to_string(micro));
  }
  Trainer t(make_mlp(ModelOptions().width(16).depth(1)),
            TrainerOptions().batch_size(32).steps(1).nonfinite_loss(NonfiniteLoss::kUnchecked));
  testing::expect_error([&] { t.fit(small_real_data()); }, "call train_step in a loop of your own");
}

// fp16 on the fused kernel (LibTorch 2.x): the kernel skips by itself, so a
// step reads its loss and then whether it skipped, after the update is
// queued; unchecked, it reads nothing, and the record keeps the kernel's
// decision on the device. Both runs' parameters are the same, bitwise.
TEST_F(TrainerTest, AnFp16StepOnTheFusedKernelDecidesItsSkipOnTheDevice) {
  if (!compat::kCpuAutocastHalf || !optim::has_fused_kernels(torch::kCPU)) {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no fp16 CPU autocast or no fused CPU kernels";
  }
  const auto& data = small_real_data();
  auto run = [&](NonfiniteLoss mode) {
    torch::manual_seed(3);
    Trainer t(make_mlp(ModelOptions().width(16).depth(1)),
              TrainerOptions().batch_size(32).micro_batch_size(8).precision(Precision::kFP16).nonfinite_loss(mode)
                  .grad_scaler(GradScalerOptions().init_scale(std::ldexp(1.0, 24))));  // overflows: skips, then backs off
    int64_t skipped = 0;
    for (int64_t i = 0; i < 8; ++i) {
      const torch::data::Example<> batch(data.images.narrow(0, 32 * i, 32), data.labels.narrow(0, 32 * i, 32));
      testing::HostReads reads;
      const auto record = t.train_step(batch);
      EXPECT_EQ(reads.count(), mode == NonfiniteLoss::kUnchecked ? 0 : 2) << "step " << i + 1;
      EXPECT_TRUE(record.found_inf.defined()) << "step " << i + 1;
      const bool on_device = record.found_inf.item<double>() != 0;
      if (mode != NonfiniteLoss::kUnchecked) EXPECT_EQ(record.skipped, on_device) << "step " << i + 1;
      skipped += on_device ? 1 : 0;
    }
    return std::make_pair(parameters_of(t), skipped);
  };
  const auto [checked, checked_skips] = run(NonfiniteLoss::kError);
  const auto [unchecked, unchecked_skips] = run(NonfiniteLoss::kUnchecked);
  EXPECT_GT(checked_skips, 0) << "a scale of 2^24 overflows fp16";
  EXPECT_LT(checked_skips, 8) << "and backs off until steps are taken";
  EXPECT_EQ(unchecked_skips, checked_skips);
  testing::expect_bitwise(unchecked, checked, "unchecked against checked");
}

TEST_F(TrainerTest, BadOptionsAreRejectedInTheConstructor) {
  auto model = make_mlp(ModelOptions().width(8).depth(1));
  EXPECT_THROW(Trainer(model, TrainerOptions().batch_size(0)), c10::Error);
  EXPECT_THROW(Trainer(model, TrainerOptions().lr(-1)), c10::Error);
  EXPECT_THROW(Trainer(model, TrainerOptions().steps(-3)), c10::Error);
  testing::expect_error([&] { Trainer(model, TrainerOptions().prefetch_factor(-1)); },
                        "prefetch_factor must be >= 0 (0: each batch is read when its step starts), got -1");
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
  // A CPU without native bf16 convolutions holds more for their backward
  // (memfit::cpu_computes_bf16_natively): there the bytes are not halved.
  if (memfit::cpu_computes_bf16_natively()) {
    EXPECT_LT(bf16.step_memory.activations, 0.6 * fp32.step_memory.activations);
  }
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

// A checkpoint folder in the test's temporary folder, removed when the test
// ends, failed or not (unlink and rmdir: std::filesystem::remove_all crashed
// against LibTorch 2.11's build).
struct CheckpointDir {
  explicit CheckpointDir(const std::string& name)
      : path(::testing::TempDir() + "memfit_" + name + "_" + std::to_string(::getpid())) {}
  ~CheckpointDir() {
    ::unlink((path + "/checkpoint.pt").c_str());
    ::rmdir(path.c_str());
  }
  std::string path;
};


TEST_F(TrainerTest, MicroBatchesGiveTheFullBatchParametersAlsoWhenTheyDoNotDivideIt) {
  // 100 examples per step in micro-batches of 32 (32+32+32+4); 2048 examples
  // make the epoch's last batch 48 (32+16): 21 steps cross into epoch 1.
  for (auto optimizer : {OptimizerKind::kSGD, OptimizerKind::kAdam}) {
    auto run = [&](int64_t micro) {
      torch::manual_seed(7);
      Trainer t(make_mlp(ModelOptions().width(64).depth(2)),
                TrainerOptions().batch_size(100).steps(21).lr(1e-2).optimizer(optimizer).micro_batch_size(micro));
      auto report = t.fit(small_real_data());
      return std::make_pair(parameters_of(t), report);
    };
    const auto [full, full_report] = run(0);
    const auto [micro, micro_report] = run(32);
    const double diff = testing::max_relative_difference(micro, full);
    // float32 rounding, within torch.testing.assert_close's float32 rtol
    // (1.3e-6): 21 Adam steps reached 1.08e-6 on a 2-core AMD EPYC's OpenBLAS.
    EXPECT_LT(diff, 1.3e-6) << "optimizer " << int(optimizer);
    EXPECT_GT(diff, 0) << "the sums round differently: a zero would mean no micro-batching";
    EXPECT_NEAR(micro_report.final_loss, full_report.final_loss, 1e-5);
  }
}

TEST_F(TrainerTest, MicroBatchingHoldsOneMicroBatchOfActivationsAtATime) {
  auto run = [](int64_t micro) {
    torch::manual_seed(7);
    Trainer t(make_mlp(ModelOptions().width(128).depth(2)),
              TrainerOptions().batch_size(1024).steps(2).optimizer(OptimizerKind::kSGD).micro_batch_size(micro));
    return t.fit(small_real_data()).step_memory;
  };
  const auto full = run(0), micro = run(128);
  // Activations grow with the examples in flight: 8 times fewer.
  EXPECT_LT(4 * micro.activations, full.activations);
  EXPECT_EQ(micro.parameters, full.parameters);
  EXPECT_EQ(micro.optimizer_state, full.optimizer_state);
  EXPECT_LT(micro.peak, full.peak - (1024 - 128) * 784 * 4) << "at least the images not in flight";
}

TEST_F(TrainerTest, TheLargestStepIsRecordedPhaseByPhase) {
  Trainer t(make_mlp(ModelOptions().width(64).depth(1)),
            TrainerOptions().batch_size(100).steps(2).micro_batch_size(40));
  const auto report = t.fit(small_real_data());
  std::vector<std::string> phases;
  int64_t peak = 0;
  for (const auto& m : report.step_timeline) {
    phases.push_back(m.phase);
    peak = std::max(peak, m.peak_bytes);
    EXPECT_EQ(m.parameters, report.step_memory.parameters);
  }
  EXPECT_EQ(phases, (std::vector<std::string>{"forward 1", "backward 1", "forward 2", "backward 2",
                                              "forward 3", "backward 3", "optimizer step",
                                              "released"}))
      << "40 + 40 + 20 examples";
  EXPECT_EQ(peak, report.step_memory.peak) << "the phases cover the step";
  const auto& released = report.step_timeline.back();
  EXPECT_EQ(released.gradients, 0) << "set to none";
  EXPECT_EQ(released.optimizer_state, 2 * (784 * 64 + 64 + 64 * 10 + 10) * 4);
  EXPECT_EQ(report.step_timeline[1].gradients, (784 * 64 + 64 + 64 * 10 + 10) * 4)
      << "gradients exist after the first backward";
  const auto j = nlohmann::json::parse(report.to_json());
  ASSERT_EQ(j["step_timeline"].size(), 8u);
  EXPECT_TRUE(j["step_timeline"][0].contains("activations"));
}

TEST_F(TrainerTest, MicroBatchingABatchNormModelWarnsOnce) {
  compat::WarningCapture warnings;
  Trainer t(make_resnet(ModelOptions().width(4).depth(1)),
            TrainerOptions().batch_size(32).steps(2).micro_batch_size(8));
  t.fit(small_real_data());
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("BatchNorm layers (the first is 'stem_bn')"), std::string::npos)
      << warnings.messages[0];
  Trainer mlp(make_mlp(ModelOptions().width(8).depth(1)),
              TrainerOptions().batch_size(32).micro_batch_size(8));
  EXPECT_EQ(warnings.messages.size(), 1u) << "no BatchNorm, no warning";
}

TEST_F(TrainerTest, SetToNoneReleasesGradientBytesBetweenSteps) {
  auto run = [](bool set_to_none) {
    torch::manual_seed(1);
    Trainer t(make_mlp(ModelOptions().width(64).depth(1)),
              TrainerOptions().batch_size(32).steps(3).set_to_none(set_to_none));
    return t.fit(small_real_data());
  };
  const auto released = run(true), kept = run(false);
  const int64_t param_bytes = (784 * 64 + 64 + 64 * 10 + 10) * 4;
  for (size_t i = 0; i < released.steps.size(); ++i) {
    EXPECT_EQ(kept.steps[i].current_bytes - released.steps[i].current_bytes, param_bytes)
        << "zeroed gradients keep one gradient per parameter alive";
    EXPECT_EQ(kept.steps[i].loss, released.steps[i].loss) << "the same math";
  }
}

TEST_F(TrainerTest, InPlaceActivationsSaveOneActivationPerLayerAtTheForwardPeak) {
  const int64_t batch = 64, width = 256;
  auto forward_peak = [&](bool inplace) {
    torch::manual_seed(2);
    auto net = make_mlp(ModelOptions().width(width).depth(3).inplace(inplace));
    auto x = small_real_data().images.narrow(0, 0, batch).clone();
    PeakMeter meter;
    auto out = net->forward(x);
    return meter.peak_delta();
  };
  // Out of place, the peak is at the last ReLU, which holds its input and
  // its output at once; in place, it is at the head's [64, 10] output.
  EXPECT_EQ(forward_peak(false) - forward_peak(true), batch * width * 4 - batch * 10 * 4);
}

TEST_F(TrainerTest, OptimizerStateOffloadedToTheHostIsBitwiseTheSameTraining) {
  for (auto optimizer : {OptimizerKind::kSGD, OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    auto run = [&](Offload offload) {
      torch::manual_seed(4);
      Trainer t(make_resnet(ModelOptions().width(4).depth(1)),
                TrainerOptions().batch_size(32).steps(5).optimizer(optimizer).weight_decay(1e-2).offload_optimizer(offload));
      auto report = t.fit(small_real_data());
      return std::make_pair(parameters_of(t), report);
    };
    const auto [resident, resident_report] = run(Offload::kNone);
    const auto [host, host_report] = run(Offload::kHost);
    EXPECT_EQ(testing::max_relative_difference(host, resident), 0.0) << "the same fp32 math on the host";
    EXPECT_GT(resident_report.step_memory.optimizer_state, 0);
    EXPECT_EQ(host_report.step_memory.optimizer_state, 0) << "no optimizer state on the device";
    EXPECT_EQ(host_report.step_memory.parameters, resident_report.step_memory.parameters);
    EXPECT_EQ(resident_report.steps.back().current_bytes - host_report.steps.back().current_bytes,
              resident_report.step_memory.optimizer_state)
        << "between steps the device holds no optimizer state";
    EXPECT_LT(host_report.peak_bytes, resident_report.peak_bytes);
  }
}

TEST_F(TrainerTest, GradientsOffloadedToTheHostTrainBitwiseTheSameWithOneGradientOnTheDevice) {
  // MLP: three Linear layers; micro-batches accumulate on the host.
  auto run = [&](Offload gradients, int64_t micro) {
    torch::manual_seed(4);
    Trainer t(make_mlp(ModelOptions().width(128).depth(2)),
              TrainerOptions().batch_size(64).steps(4).micro_batch_size(micro).offload_optimizer(Offload::kHost)
                  .offload_gradients(gradients));
    auto report = t.fit(small_real_data());
    return std::make_pair(parameters_of(t), report);
  };
  const int64_t weights = (784 * 128 + 128 * 128 + 128 * 10) * 4, biases = (128 + 128 + 10) * 4;
  const int64_t largest = 784 * 128 * 4;
  for (int64_t micro : {int64_t(0), int64_t(16)}) {
    const auto [device, device_report] = run(Offload::kNone, micro);
    const auto [host, host_report] = run(Offload::kHost, micro);
    EXPECT_EQ(testing::max_relative_difference(host, device), 0.0) << "the same fp32 sums, on the host";
    // Without offload every gradient is on the device when backward ends
    // (with micro-batches from the first one on); with it at most one layer's
    // (its backward yields the weight's and the bias's gradients together).
    const int64_t saved = device_report.peak_bytes - host_report.peak_bytes;
    EXPECT_GE(saved, weights + biases - largest - 128 * 4) << "micro-batch " << micro;
    for (const auto& phase : host_report.step_timeline) {
      EXPECT_EQ(phase.gradients, 0) << phase.phase << ": no gradient stays on the device";
    }
  }
  testing::expect_error([] { Trainer(make_mlp(), TrainerOptions().offload_gradients(Offload::kHost)); },
                        "set offload_optimizer to Offload::kHost too");
}

TEST_F(TrainerTest, FrozenParametersGetNoGradientsNorOptimizerState) {
  auto run = [](std::vector<std::string> freeze) {
    torch::manual_seed(3);
    auto net = make_mlp(ModelOptions().width(64).depth(2));
    std::vector<torch::Tensor> before;
    for (const auto& p : net->parameters()) before.push_back(p.detach().clone());
    Trainer t(net, TrainerOptions().batch_size(32).steps(3).freeze(freeze));
    auto report = t.fit(small_real_data());
    const auto named = t.model()->named_parameters();
    for (size_t i = 0; i < named.size(); ++i) {
      const bool frozen = named[i].key().rfind("fc0.", 0) == 0 && !freeze.empty();
      EXPECT_EQ(named[i].value().equal(before[i]), frozen) << named[i].key();
    }
    return report;
  };
  const auto all = run({});
  const auto frozen = run({"fc0.*"});
  const int64_t fc0 = (784 * 64 + 64) * 4;
  EXPECT_EQ(all.step_memory.gradients - frozen.step_memory.gradients, fc0);
  EXPECT_EQ(all.step_memory.optimizer_state - frozen.step_memory.optimizer_state, 2 * fc0)
      << "Adam keeps two moments per trained parameter";
  EXPECT_THROW(Trainer(make_mlp(ModelOptions().width(8).depth(1)), TrainerOptions().freeze({"*"})),
               c10::Error)
      << "nothing left to train";
}

TEST_F(TrainerTest, ResumeContinuesBitIdentically) {
  const CheckpointDir checkpoint("resume");
  const std::string& dir = checkpoint.path;
  auto options = [&](int64_t steps) {
    // 2048 examples in batches of 300: epoch 0 ends at step 7, so the resumed
    // half crosses an epoch and reshuffles.
    return TrainerOptions().batch_size(300).steps(steps).optimizer(OptimizerKind::kAdamW).weight_decay(0.01).seed(9);
  };
  auto make = [] {
    torch::manual_seed(6);
    return make_resnet(ModelOptions().width(4).depth(1));
  };
  Trainer straight(make(), options(10));
  const auto straight_report = straight.fit(small_real_data());

  Trainer first(make(), options(5).save_dir(dir));
  first.fit(small_real_data());
  torch::manual_seed(12345);  // the checkpoint must restore the global RNG
  Trainer second(make_resnet(ModelOptions().width(4).depth(1)), options(10));
  second.resume(dir);
  EXPECT_EQ(second.step(), 5);
  const auto resumed = second.fit(small_real_data());
  ASSERT_EQ(resumed.steps.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(resumed.steps[i].loss, straight_report.steps[5 + i].loss) << "step " << 6 + i;
    EXPECT_EQ(resumed.steps[i].epoch, straight_report.steps[5 + i].epoch);
  }
  const auto a = parameters_of(straight), b = parameters_of(second);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].equal(b[i])) << "parameter " << i;
  const auto ba = straight.model()->buffers(), bb = second.model()->buffers();
  for (size_t i = 0; i < ba.size(); ++i) EXPECT_TRUE(ba[i].equal(bb[i])) << "buffer " << i;
}

TEST_F(TrainerTest, ASaveFolderHoldsOneRunAndANewRunDoesNotReplaceAnothersCheckpoint) {
  const CheckpointDir checkpoint("one_writer");
  const std::string& dir = checkpoint.path;
  const auto options = [&](int64_t steps) { return TrainerOptions().batch_size(32).steps(steps).save_dir(dir); };
  const auto make = [] { return make_mlp(ModelOptions().width(16).depth(1)); };
  {
    Trainer first(make(), options(2));
    try {
      Trainer second(make(), options(2));
      ADD_FAILURE() << "two Trainers saving to one folder";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.msg()).find("TrainerOptions::save_dir " + dir + " is in use by another run"),
                std::string::npos)
          << e.msg();
    }
    first.fit(small_real_data());
  }
  std::ifstream saved_file(dir + "/checkpoint.pt", std::ios::binary);
  const std::string saved((std::istreambuf_iterator<char>(saved_file)), std::istreambuf_iterator<char>());
  Trainer fresh(make(), options(3));
  try {
    fresh.fit(small_real_data());
    ADD_FAILURE() << "a new run replaced another run's checkpoint";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.msg()).find("holds another run's checkpoint.pt"), std::string::npos) << e.msg();
  }
  EXPECT_EQ(fresh.step(), 0) << "refused before any step";
  std::ifstream kept_file(dir + "/checkpoint.pt", std::ios::binary);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(kept_file)), std::istreambuf_iterator<char>()), saved);
  fresh.resume(dir);  // continuing it is what the folder is for
  EXPECT_EQ(fresh.fit(small_real_data()).steps.size(), 1u);
  EXPECT_EQ(fresh.fit(small_real_data()).steps.size(), 3u) << "its own checkpoint: a finished run starts again";
}

TEST_F(TrainerTest, ResumeOfAnFp16OrMasterWeightsRunRestoresScalerAndMasters) {
  const CheckpointDir checkpoint("resume_bf16");
  const std::string& dir = checkpoint.path;
  auto options = [&](int64_t steps) {
    return TrainerOptions().batch_size(64).steps(steps).precision(Precision::kBF16)
        .master_weights(MasterWeightsMode::kHost).seed(2);
  };
  auto make = [] {
    torch::manual_seed(8);
    return make_resnet(ModelOptions().width(4).depth(1));
  };
  Trainer straight(make(), options(6));
  const auto full = straight.fit(small_real_data());
  Trainer first(make(), options(3).save_dir(dir));
  first.fit(small_real_data());
  Trainer second(make(), options(6));
  second.resume(dir);
  const auto rest = second.fit(small_real_data());
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rest.steps[i].loss, full.steps[3 + i].loss);
  const auto& ma = straight.master_weights()->master_parameters();
  const auto& mb = second.master_weights()->master_parameters();
  for (size_t i = 0; i < ma.size(); ++i) EXPECT_TRUE(ma[i].equal(mb[i])) << "master " << i;
}

TEST_F(TrainerTest, ResumeLoadsThroughTheHostWithoutASecondDeviceCopy) {
  const CheckpointDir checkpoint("resume_host");
  const std::string& dir = checkpoint.path;
  {
    Trainer t(make_mlp(ModelOptions().width(256).depth(2)),
              TrainerOptions().batch_size(32).steps(2).save_dir(dir));
    t.fit(small_real_data());
  }
  Trainer t(make_mlp(ModelOptions().width(256).depth(2)), TrainerOptions().batch_size(32).steps(4));
  const int64_t params = memory_allocated();
  PeakMeter meter;
  t.resume(dir);
  const int64_t state = optimizer_state_bytes(t.optimizer());
  EXPECT_EQ(state, 2 * params) << "Adam's two moments came back to the device";
  EXPECT_EQ(memory_allocated(), params + state);
  EXPECT_EQ(meter.peak(), params + state)
      << "the file is read into host memory; each tensor is copied in place or moved alone";
}

TEST_F(TrainerTest, ResumeIntoAnotherModelNamesTheFirstMismatchAndChangesNothing) {
  const CheckpointDir checkpoint("resume_bad");
  const std::string& dir = checkpoint.path;
  {
    Trainer t(make_mlp(ModelOptions().width(16).depth(1)), TrainerOptions().batch_size(32).steps(1).save_dir(dir));
    t.fit(small_real_data());
  }
  Trainer other(make_mlp(ModelOptions().width(32).depth(1)), TrainerOptions().batch_size(32).steps(2));
  const auto before = parameters_of(other);
  try {
    other.resume(dir);
    FAIL() << "a checkpoint of another model must be refused";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.msg()).find("tensor 'fc0.weight' is [16, 784] Float in the checkpoint "
                                          "but [32, 784] Float in the model"),
              std::string::npos)
        << e.msg();
  }
  const auto after = parameters_of(other);
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(after[i].equal(before[i]));
  EXPECT_EQ(other.step(), 0);
  EXPECT_THROW(other.resume(dir + "/nothing-here"), c10::Error);
}

// Reference: an Adam checkpoint resumed into SGD reached LibTorch's internal
// assert (sgd.cpp "is_tensor_type"); adam into adamw loaded silently.
TEST_F(TrainerTest, ResumeRefusesAnotherOptimizerPrecisionOrBatchSizeNamingBothValues) {
  const CheckpointDir checkpoint("resume_options");
  const std::string& dir = checkpoint.path;
  const auto base = [] { return TrainerOptions().batch_size(32).steps(2); };
  {
    Trainer t(make_mlp(ModelOptions().width(16).depth(1)), base().steps(1).save_dir(dir));
    t.fit(small_real_data());
  }
  const std::vector<std::pair<TrainerOptions, std::string>> cases = {
      {base().optimizer(OptimizerKind::kSGD), "the optimizer torch::optim::Adam, but this run's is torch::optim::SGD"},
      {base().optimizer(OptimizerKind::kAdamW), "torch::optim::Adam, but this run's is torch::optim::AdamW"},
      {base().precision(Precision::kBF16), "TrainerOptions::precision fp32, but this run's is bf16"},
      {base().batch_size(16), "TrainerOptions::batch_size 32, but this run's is 16"},
  };
  for (const auto& [options, expected] : cases) {
    Trainer other(make_mlp(ModelOptions().width(16).depth(1)), options);
    const auto before = parameters_of(other);
    try {
      other.resume(dir);
      ADD_FAILURE() << "resumed despite: " << expected;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.msg()).find(expected), std::string::npos) << e.msg();
    }
    const auto after = parameters_of(other);
    for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(after[i].equal(before[i])) << "nothing changes";
  }
  Trainer same(make_mlp(ModelOptions().width(16).depth(1)), base().lr(0.5).micro_batch_size(8));
  same.resume(dir);  // lr and micro-batching may change: they do not make the checkpoint another run's
  EXPECT_EQ(same.step(), 1);
}

TEST_F(TrainerTest, RequestStopEndsFitAfterTheStepInProgressAndSavesFirst) {
  const CheckpointDir checkpoint("request_stop");
  torch::manual_seed(3);
  Trainer t(make_mlp(ModelOptions().width(16).depth(1)),
            TrainerOptions().batch_size(32).steps(50).save_dir(checkpoint.path));
  const auto report = t.fit(small_real_data(), [&](const StepRecord& r) {
    if (r.step == 3) t.request_stop();
  });
  EXPECT_TRUE(report.stopped);
  EXPECT_EQ(report.steps.size(), 3u);
  EXPECT_EQ(t.step(), 3);
  Trainer resumed(make_mlp(ModelOptions().width(16).depth(1)), TrainerOptions().batch_size(32).steps(50));
  resumed.resume(checkpoint.path);
  EXPECT_EQ(resumed.step(), 3) << "the stop saved the step it ended at";
  const auto rest = t.fit(small_real_data(), [](const StepRecord&) {});
  EXPECT_FALSE(rest.stopped) << "the request is cleared when fit returns";
  EXPECT_EQ(t.step(), 50);
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

// The GPT on the Jargon File: next-byte cross-entropy over every token.
class TrainerGptTest : public testing::Seeded {
 protected:
  void SetUp() override {
    Seeded::SetUp();
    if (!std::filesystem::exists(JargonOptions().path())) {
      GTEST_SKIP() << "Debian's jargon-text is not installed (scripts/install-deps.sh installs it)";
    }
  }
};

TEST_F(TrainerGptTest, LearnsTheJargonFileAndMicroBatchesGiveTheSameModel) {
  const auto corpus = load_jargon_file();
  const auto train = text_windows(corpus, 32, Split::kTrain);
  const auto test = text_windows(corpus, 32, Split::kTest);
  const auto model = ModelOptions().num_classes(corpus.vocab_size()).width(32).depth(1).heads(2).context(32);
  auto run = [&](int64_t micro, OptimizerKind optimizer, double lr) {
    torch::manual_seed(5);
    Trainer t(make_gpt(model), TrainerOptions().batch_size(16).steps(25).optimizer(optimizer).lr(lr).seed(1)
                                   .micro_batch_size(micro).eval_batch_size(512));
    return std::make_pair(t.fit(train), std::move(t));
  };
  auto [whole, whole_trainer] = run(0, OptimizerKind::kAdam, 3e-3);
  auto [sgd_whole, sgd_whole_trainer] = run(0, OptimizerKind::kSGD, 0.3);
  auto [sgd_micro, micro_trainer] = run(5, OptimizerKind::kSGD, 0.3);  // 16 = 5 + 5 + 5 + 1
  EXPECT_NEAR(whole.steps.front().loss, std::log(double(corpus.vocab_size())), 0.3) << "a fresh model guesses evenly";
  EXPECT_LT(whole.final_loss, 3.6) << "25 steps learn the byte frequencies at least (log 146 = 4.98)";
  const auto eval = whole_trainer.evaluate(test);
  EXPECT_GT(eval.accuracy, 0.15) << "per next byte; the most frequent byte (space) alone scores about 0.15";
  EXPECT_LT(testing::max_relative_difference(sgd_whole_trainer.model()->parameters(), micro_trainer.model()->parameters()),
            1e-5);
}

} // namespace
} // namespace memfit
