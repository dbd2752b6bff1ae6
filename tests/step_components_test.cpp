// The Trainer on a user's own module, loss and batch type: train_step
// against a hand-written LibTorch loop, every allowed combination of the
// step's components against the plain step, and the errors a user's code
// can provoke.
#include "memfit/checkpoint.h"
#include "memfit/trainer.h"

#include "test_util.h"

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <unistd.h>

namespace {

// A pytorch/examples-style network: its own forward, dropout, log-softmax.
struct OwnNetImpl : torch::nn::Module {
  explicit OwnNetImpl(double dropout = 0.25)
      : fc1(register_module("fc1", torch::nn::Linear(20, 32))),
        fc2(register_module("fc2", torch::nn::Linear(32, 5))),
        p(dropout) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(fc1->forward(x));
    h = torch::dropout(h, p, is_training());
    return torch::log_softmax(fc2->forward(h), 1);
  }
  torch::nn::Linear fc1, fc2;
  double p;
};
TORCH_MODULE(OwnNet);

torch::Tensor nll(OwnNetImpl& net, const torch::data::Example<>& b) {
  return torch::nll_loss(net.forward(b.data), b.target);
}

// A map-style data set of the user's own; with `ragged`, example 3 is longer.
struct Rows : torch::data::datasets::Dataset<Rows> {
  Rows(torch::Tensor x, torch::Tensor y, bool ragged = false) : x(std::move(x)), y(std::move(y)), ragged(ragged) {}
  torch::data::Example<> get(size_t i) override {
    if (ragged && i == 3) return {torch::zeros({21}), y[i]};
    return {x[i], y[i]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(x.size(0)); }
  torch::Tensor x, y;
  bool ragged;
};

// A batch type of the user's own, with its BatchTraits below.
struct Pair {
  torch::Tensor x, y;
};

} // namespace

template <>
struct memfit::BatchTraits<Pair> {
  static int64_t size(const Pair& b) { return b.x.size(0); }
  static Pair slice(const Pair& b, int64_t start, int64_t length) {
    return {b.x.narrow(0, start, length), b.y.narrow(0, start, length)};
  }
  static Pair to(const Pair& b, const torch::Device& device) {
    return {memfit::to_device(b.x, device), memfit::to_device(b.y, device)};
  }
};

namespace {
// A batch type that records, as it is staged, whether its host memory was pinned.
struct Staged {
  torch::Tensor x, y;
};
std::vector<bool> staged_from_pinned;
} // namespace

template <>
struct memfit::BatchTraits<Staged> {
  static int64_t size(const Staged& b) { return b.x.size(0); }
  static Staged slice(const Staged& b, int64_t start, int64_t length) {
    return {b.x.narrow(0, start, length), b.y.narrow(0, start, length)};
  }
  static Staged to(const Staged& b, const torch::Device& device) {
    staged_from_pinned.push_back(b.x.is_pinned() && b.y.is_pinned());
    return {memfit::to_device(b.x, device), memfit::to_device(b.y, device)};
  }
  static Staged pin(const Staged& b) { return {b.x.pin_memory(), b.y.pin_memory()}; }
};

namespace memfit {
namespace {

class OwnModelTest : public testing::Seeded {};

torch::data::Example<> batch_of(int64_t n, int64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({n, 20}), torch::randint(5, {n})};
}

std::vector<torch::Tensor> values(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

// Three steps of a fresh OwnNet (seeded) through train_step with `options`.
std::vector<torch::Tensor> trained_with(const TrainerOptions& options, double dropout = 0.25) {
  torch::manual_seed(7);
  OwnNet net(dropout);
  Trainer trainer(net, nll, options);
  for (int64_t i = 0; i < 3; ++i) {
    const auto b = batch_of(24, i);
    torch::manual_seed(100 + i);  // the same dropout masks in every run
    trainer.train_step(b);
  }
  return values(net->parameters());
}

// On the loop kernel memfit's SGD is bitwise LibTorch's, which the hand loop steps with.
TEST_F(OwnModelTest, TrainStepOnAUsersNetIsBitwiseAHandWrittenLoop) {
  const auto options =
      TrainerOptions().optimizer(OptimizerKind::kSGD).lr(0.1).momentum(0.9).optimizer_kernel(optim::Kernel::kLoop);
  const auto by_trainer = trained_with(options);

  torch::manual_seed(7);
  OwnNet net;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int64_t i = 0; i < 3; ++i) {
    const auto b = batch_of(24, i);
    torch::manual_seed(100 + i);
    sgd.zero_grad();
    nll(*net, b).backward();
    sgd.step();
  }
  const auto by_hand = values(net->parameters());
  ASSERT_EQ(by_trainer.size(), by_hand.size());
  for (size_t i = 0; i < by_hand.size(); ++i) EXPECT_TRUE(by_trainer[i].equal(by_hand[i])) << "parameter " << i;
}

// Every allowed combination of micro-batching, precision, master weights,
// offload and clipping, each against the plain step on `device`: bitwise
// where the math is unchanged (offload moves the same fp32 numbers), within
// rounding for micro-batches (a sum in another order), within bf16's
// resolution for bf16 (autocast changes the math). On CUDA, Adam on the host
// (optimizer offload) rounds as the CPU's kernels do, not as the device's,
// which fuse multiply-adds: within rounding there too. Without dropout: its
// masks are drawn per micro-batch.
void expect_every_combination_like_the_plain_step(const torch::Device& device) {
  const auto base = TrainerOptions().optimizer(OptimizerKind::kAdam).lr(1e-2).device(device);
  const auto plain = trained_with(base, 0.0);
  const auto plain_clipped = trained_with(TrainerOptions(base).max_grad_norm(0.5), 0.0);
  struct Offloads {
    Offload optimizer, gradients;
    const char* name;
  };
  const std::vector<Offloads> offloads = {{Offload::kNone, Offload::kNone, "none"},
                                          {Offload::kHost, Offload::kNone, "optimizer"},
                                          {Offload::kHost, Offload::kHost, "optimizer,gradients"}};
  int combinations = 0;
  for (int64_t micro : {0, 8, 10}) {
    for (auto precision : {Precision::kFP32, Precision::kBF16}) {
      for (auto master : {MasterWeightsMode::kNone, MasterWeightsMode::kDevice, MasterWeightsMode::kHost}) {
        for (const auto& off : offloads) {
          for (double clip : {0.0, 0.5}) {
            if (master != MasterWeightsMode::kNone && precision == Precision::kFP32) continue;
            if (master == MasterWeightsMode::kDevice && off.optimizer == Offload::kHost) continue;
            const auto o = TrainerOptions(base)
                               .micro_batch_size(micro)
                               .precision(precision)
                               .master_weights(master)
                               .offload_optimizer(off.optimizer)
                               .offload_gradients(off.gradients)
                               .max_grad_norm(clip);
            const auto got = trained_with(o, 0.0);
            const auto& want = clip > 0 ? plain_clipped : plain;
            const double diff = testing::max_relative_difference(got, want);
            const std::string what = device.str() + " micro " + std::to_string(micro) + " " +
                                     to_string(precision) + " master " + std::to_string(static_cast<int>(master)) +
                                     " offload " + off.name + " clip " + std::to_string(clip);
            const bool other_kernels = device.is_cuda() && off.optimizer == Offload::kHost;
            if (precision == Precision::kBF16) {
              EXPECT_LT(diff, 3e-2) << what;
            } else if (micro > 0 || other_kernels) {
              EXPECT_LT(diff, 1e-5) << what;
            } else {
              EXPECT_EQ(diff, 0.0) << what;
            }
            ++combinations;
          }
        }
      }
    }
  }
  EXPECT_EQ(combinations, 3 * 2 * (3 + 3 + 1 + 3));  // micro × clip × (fp32 + bf16's three master modes)
}

TEST_F(OwnModelTest, EveryCombinationOfComponentsTrainsLikeThePlainStep) {
  expect_every_combination_like_the_plain_step(torch::kCPU);
}

TEST_F(OwnModelTest, MicroBatchesFitABudgetThePlainStepDoesNot) {
  torch::data::Example<> batch;
  {
    UntrackedGuard host;  // host memory: each micro-batch is staged on the device
    batch = batch_of(512, 1);
  }
  auto peak_of = [&](int64_t micro, int64_t budget) {
    torch::manual_seed(7);
    OwnNet net;
    Trainer trainer(net, nll, TrainerOptions().optimizer(OptimizerKind::kSGD).lr(0.1).micro_batch_size(micro));
    trainer.train_step(batch);  // the optimizer's state exists from here on
    const int64_t base = memory_allocated();
    set_memory_budget(torch::kCPU, budget > 0 ? base + budget : 0);
    int64_t peak = -1;
    try {
      PeakMeter meter;
      trainer.train_step(batch);
      peak = meter.peak() - base;
    } catch (const c10::OutOfMemoryError&) {
    }
    set_memory_budget(torch::kCPU, 0);
    return peak;
  };
  const int64_t plain = peak_of(0, 0);
  ASSERT_GT(plain, 0);
  const int64_t budget = plain * 6 / 10;
  EXPECT_EQ(peak_of(0, budget), -1) << "the plain step must not fit " << budget << " bytes";
  const int64_t micro = peak_of(64, budget);
  EXPECT_GT(micro, 0);
  EXPECT_LE(micro, budget);
}

TEST_F(OwnModelTest, OwnBatchTypesAndUnstackedExamplesTrainLikeExamples) {
  const auto want = trained_with(TrainerOptions().optimizer(OptimizerKind::kSGD).lr(0.1).micro_batch_size(10));
  auto run = [](auto loss, auto make_batch) {
    torch::manual_seed(7);
    OwnNet net;
    Trainer trainer(net, loss, TrainerOptions().optimizer(OptimizerKind::kSGD).lr(0.1).micro_batch_size(10));
    for (int64_t i = 0; i < 3; ++i) {
      const auto b = batch_of(24, i);
      torch::manual_seed(100 + i);
      trainer.train_step(make_batch(b));
    }
    return values(net->parameters());
  };
  const auto pairs = run([](OwnNetImpl& net, const Pair& b) { return torch::nll_loss(net.forward(b.x), b.y); },
                         [](const torch::data::Example<>& b) { return Pair{b.data, b.target}; });
  const auto unstacked = run(
      [](OwnNetImpl& net, const std::vector<torch::data::Example<>>& examples) {
        std::vector<torch::Tensor> xs, ys;
        for (const auto& e : examples) {
          xs.push_back(e.data);
          ys.push_back(e.target);
        }
        return torch::nll_loss(net.forward(torch::stack(xs)), torch::stack(ys));
      },
      [](const torch::data::Example<>& b) {
        std::vector<torch::data::Example<>> out;
        for (int64_t i = 0; i < b.data.size(0); ++i) out.push_back({b.data[i], b.target[i]});
        return out;
      });
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(pairs[i].equal(want[i])) << "parameter " << i;
    EXPECT_TRUE(unstacked[i].equal(want[i])) << "parameter " << i;
  }
}

TEST_F(OwnModelTest, AUsersOptimizerFactoryAndComponentTakePart) {
  struct Calls : StepComponent {
    std::vector<std::string> seen;
    void begin_step(StepState&) override { seen.push_back("begin"); }
    void after_forward(StepState& s) override { seen.push_back("forward " + std::to_string(s.micro)); }
    void after_backward(StepState& s) override { seen.push_back("backward " + std::to_string(s.micro)); }
    void after_optimizer_step(StepState& s) override { seen.push_back(s.stepped ? "stepped" : "not stepped"); }
    void end_step(StepState&) override { seen.push_back("end"); }
  };
  OwnNet net;
  int built = 0;
  Trainer trainer(net, nll, TrainerOptions().micro_batch_size(12).optimizer_factory([&](std::vector<torch::Tensor> p) {
    ++built;
    return std::make_unique<torch::optim::RMSprop>(std::move(p), torch::optim::RMSpropOptions(1e-3));
  }));
  auto calls = std::make_shared<Calls>();
  trainer.add_component(calls);
  torch::optim::StepLR schedule(trainer.optimizer(), /*step_size=*/1, /*gamma=*/0.5);
  trainer.train_step(batch_of(24, 0));
  schedule.step();  // LibTorch's StepLR counts its first step as epoch 0
  const auto first = calls->seen;
  trainer.train_step(batch_of(24, 1));
  schedule.step();
  EXPECT_EQ(built, 1);
  EXPECT_NE(dynamic_cast<torch::optim::RMSprop*>(&trainer.optimizer()), nullptr);
  EXPECT_DOUBLE_EQ(trainer.optimizer().param_groups()[0].options().get_lr(), 5e-4);
  EXPECT_EQ(first, (std::vector<std::string>{"begin", "forward 0", "backward 0", "forward 1", "backward 1",
                                                   "stepped", "end"}));
}

// fit over a map-style torch::data data set (and memfit's ExampleDataset)
// reads the same batches as over tensors in memory, on `device`, and reading
// them ahead (pinned, on a CUDA device) changes neither the model nor the
// bytes of any step.
void expect_data_sets_train_like_tensors_in_memory(const torch::Device& device) {
  ImageDataset whole;
  whole.images = torch::randn({100, 20});
  whole.labels = torch::randint(5, {100});
  struct Run {
    std::vector<torch::Tensor> parameters;
    std::vector<int64_t> peaks;
  };
  auto run = [&](int64_t prefetch, const std::function<TrainReport(Trainer&)>& fit) {
    torch::manual_seed(7);
    OwnNet net;
    Trainer trainer(net, nll,
                    TrainerOptions().batch_size(16).epochs(2).micro_batch_size(5).seed(3).device(device).prefetch_factor(
                        prefetch));
    const int64_t before = memory_allocated(device);  // the earlier runs' parameters stay
    const auto report = fit(trainer);
    EXPECT_EQ(report.steps.size(), 14u);  // ceil(100 / 16) × 2
    EXPECT_GT(report.peak_bytes, 0);
    Run r{values(net->parameters()), {}};
    for (const auto& step : report.steps) r.peaks.push_back(step.peak_bytes - before);
    return r;
  };
  const auto from_tensors = run(0, [&](Trainer& t) { return t.fit(whole); });
  for (int64_t prefetch : {0, 1, 3}) {
    SCOPED_TRACE("prefetch_factor " + std::to_string(prefetch));
    const auto ahead_from_tensors = run(prefetch, [&](Trainer& t) { return t.fit(whole); });
    const auto from_data_set = run(prefetch, [&](Trainer& t) {
      auto data = Rows(whole.images, whole.labels).map(torch::data::transforms::Stack<>());
      return t.fit(data);
    });
    const auto from_example_data_set = run(prefetch, [&](Trainer& t) {
      ExampleDataset data(whole);  // what fashion_mnist_dataset and jargon_dataset return
      return t.fit(data);
    });
    for (const auto* r : {&ahead_from_tensors, &from_data_set, &from_example_data_set}) {
      EXPECT_EQ(r->peaks, from_tensors.peaks);
      for (size_t i = 0; i < from_tensors.parameters.size(); ++i) {
        EXPECT_EQ(r->parameters[i].device(), device);
        EXPECT_TRUE(r->parameters[i].equal(from_tensors.parameters[i])) << "parameter " << i;
      }
    }
  }
}

TEST_F(OwnModelTest, FitReadsAMapStyleDataSetBatchByBatchLikeAnImageDataset) {
  expect_data_sets_train_like_tensors_in_memory(torch::kCPU);
}

// Rows that records which examples were asked for, and can hold a read until released.
struct WatchedRows : torch::data::datasets::Dataset<WatchedRows> {
  WatchedRows(torch::Tensor x, torch::Tensor y) : x(std::move(x)), y(std::move(y)) {}
  torch::data::Example<> get(size_t i) override {
    reads->fetch_add(1);
    return {x[i], y[i]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(x.size(0)); }
  torch::Tensor x, y;
  std::shared_ptr<std::atomic<int64_t>> reads = std::make_shared<std::atomic<int64_t>>(0);
};

TEST_F(OwnModelTest, ReadingAheadReadsTheNextBatchWhileTheStepRuns) {
  // Each step's loss waits (up to 20 s) until the next step's examples have
  // been read: only a reading thread can read them meanwhile.
  WatchedRows rows(torch::randn({64, 20}), torch::randint(5, {64}));
  const auto reads = rows.reads;
  auto data = std::move(rows).map(torch::data::transforms::Stack<>());
  int64_t step = 0;
  bool waited_in_vain = false;
  auto loss = [&](OwnNetImpl& n, const torch::data::Example<>& b) {
    ++step;
    const int64_t wanted = std::min<int64_t>(16 * (step + 1), 64);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (reads->load() < wanted && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    waited_in_vain |= reads->load() < wanted;
    return nll(n, b);
  };
  const int threads = at::get_num_threads();
  Trainer trainer(OwnNet(0.0), loss, TrainerOptions().batch_size(16).steps(4).prefetch_factor(1));
  trainer.fit(data);
  EXPECT_EQ(step, 4);
  EXPECT_FALSE(waited_in_vain) << "a step's loss ran before the next batch was read";
  EXPECT_EQ(reads->load(), 64) << "nothing is read beyond the run's last step";
  // The reading thread's single thread stays its own.
  EXPECT_EQ(at::get_num_threads(), threads);
  int later = 0;
  std::thread([&] { later = at::get_num_threads(); }).join();
  EXPECT_EQ(later, threads) << "a thread started after the run gets the process's count";
}

TEST_F(OwnModelTest, ReadingAheadKeepsTheRunsPositionAcrossAStopAnEpochAndAResume) {
  // 100 examples in batches of 16: epoch 0 ends at step 7. Stopped at step
  // 6, the reading thread has already read steps 7 to 9, two of them from
  // epoch 1's order; the position saved is still step 6's.
  const auto dir = std::filesystem::temp_directory_path() /
                   ("memfit_read_ahead_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  ImageDataset whole;
  whole.images = torch::randn({100, 20});
  whole.labels = torch::randint(5, {100});
  auto options = [](int64_t prefetch) {
    return TrainerOptions().batch_size(16).steps(14).seed(5).optimizer(OptimizerKind::kAdam).prefetch_factor(prefetch);
  };
  auto net = [] {
    torch::manual_seed(7);
    return OwnNet();
  };
  OwnNet straight_net = net();
  Trainer straight(straight_net, nll, options(0));
  const auto all = straight.fit(whole);

  OwnNet stopped_net = net();
  Trainer stopped(stopped_net, nll, options(3));
  const auto first = stopped.fit(whole, [&](const StepRecord& r) {
    if (r.step == 6) stopped.request_stop();
  });
  ASSERT_EQ(first.steps.size(), 6u);
  stopped.save(dir.string());
  const auto continued = stopped.fit(whole);  // dropout draws on from where the straight run's did
  OwnNet resumed_net = net();
  Trainer resumed(resumed_net, nll, options(3));
  resumed.resume(dir.string());  // and the global generator as saved
  const auto rest = resumed.fit(whole);
  ASSERT_EQ(rest.steps.size(), 8u);
  ASSERT_EQ(continued.steps.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(rest.steps[i].loss, all.steps[6 + i].loss) << "resumed, step " << 7 + i;
    EXPECT_EQ(continued.steps[i].loss, all.steps[6 + i].loss) << "continued, step " << 7 + i;
    EXPECT_EQ(rest.steps[i].epoch, all.steps[6 + i].epoch);
  }
  const auto a = values(straight_net->parameters()), b = values(resumed_net->parameters());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].equal(b[i])) << "parameter " << i;
  std::filesystem::remove_all(dir);
}

TEST_F(OwnModelTest, AReadThatFailsEndsFitAtItsStepAsReadingInTheStepDoes) {
  // Example 3 is longer than the others: the batch holding it cannot be stacked.
  auto ended = [](int64_t prefetch) {
    auto data = Rows(torch::randn({64, 20}), torch::randint(5, {64}), /*ragged=*/true)
                    .map(torch::data::transforms::Stack<>());
    torch::manual_seed(7);
    Trainer trainer(OwnNet(0.0), nll, TrainerOptions().batch_size(8).steps(8).seed(2).prefetch_factor(prefetch));
    std::string message;
    try {
      trainer.fit(data);
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
    }
    return std::make_pair(trainer.step(), message);
  };
  const auto in_step = ended(0);
  const auto ahead = ended(2);
  EXPECT_NE(in_step.second.find("the examples of a batch need one shape"), std::string::npos) << in_step.second;
  EXPECT_EQ(ahead.second, in_step.second);
  EXPECT_EQ(ahead.first, in_step.first) << "the steps before the failing read are taken, and no more";
  EXPECT_LT(in_step.first, 8);
}

TEST_F(OwnModelTest, AMovedTrainerTrainsAndMeasuresLikeOneThatStayed) {
  const auto options = TrainerOptions().optimizer(OptimizerKind::kAdam).lr(1e-2).micro_batch_size(10);
  Trainer assigned(OwnNet(0.0), nll, options);
  torch::manual_seed(7);
  OwnNet net(0.0);
  Trainer first(net, nll, options);
  Trainer moved(std::move(first));
  assigned = std::move(moved);
  for (int64_t i = 0; i < 3; ++i) {
    const auto b = batch_of(24, i);
    torch::manual_seed(100 + i);
    assigned.train_step(b);
  }
  ASSERT_FALSE(assigned.last_timeline().empty());
  EXPECT_EQ(assigned.last_timeline().back().phase, "released");
  EXPECT_GT(assigned.last_timeline().back().optimizer_state, 0) << "Adam's state, read through the moved Trainer";
  const auto want = trained_with(options, 0.0);
  const auto got = values(net->parameters());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(got[i].equal(want[i])) << "parameter " << i;
}

TEST_F(OwnModelTest, EvalStepRunsTheMetricUnderNoGradAndKeepsTheMode) {
  OwnNet net;
  Trainer trainer(net, nll, TrainerOptions());
  const auto b = batch_of(16, 0);
  const auto [grad, training] = trainer.eval_step(b, [&](const torch::data::Example<>& e) {
    return std::make_tuple(net->forward(e.data).requires_grad(), net->is_training());
  });
  EXPECT_FALSE(grad);
  EXPECT_FALSE(training);
  EXPECT_TRUE(net->is_training());
}

TEST_F(OwnModelTest, WhatAUsersCodeGetsWrongIsNamed) {
  OwnNet net;
  const auto b = batch_of(8, 0);
  testing::expect_error(
      [&] {
        Trainer t(net, [](OwnNetImpl& n, const torch::data::Example<>& e) { return n.forward(e.data); },
                  TrainerOptions());
        t.train_step(b);
      },
      "the loss function returned a tensor of shape [8, 5]: return a scalar");
  testing::expect_error(
      [&] {
        Trainer t(net, [](OwnNetImpl& n, const torch::data::Example<>& e) { return nll(n, e).detach(); },
                  TrainerOptions());
        t.train_step(b);
      },
      "scalar without grad");
  testing::expect_error(
      [&] {
        Trainer t(net, nll, TrainerOptions().optimizer_factory([](std::vector<torch::Tensor>) {
          return std::unique_ptr<torch::optim::Optimizer>();
        }));
      },
      "optimizer_factory returned nullptr");
  testing::expect_error(
      [&] {
        Trainer t(net, nll, TrainerOptions());
        t.train_step(torch::randn({8, 20}));
      },
      "train_step got a batch of type at::Tensor");
  testing::expect_error([&] { Trainer(net, nll, TrainerOptions().offload_optimizer(Offload::kHost)
                                                    .offload_gradients(Offload::kHost)
                                                    .offload_parameters(Offload::kHost)); },
                        "holds no CheckpointedSequential: hold its repeated blocks in one");
  testing::expect_error(
      [&] {
        auto ragged = Rows(torch::randn({8, 20}), torch::randint(5, {8}), /*ragged=*/true)
                          .map(torch::data::transforms::Stack<>());
        Trainer(net, nll, TrainerOptions().batch_size(8).steps(1).seed(0)).fit(ragged);
      },
      "the examples of a batch need one shape to be stacked");
  ImageDataset data;
  data.images = torch::randn({16, 20});
  data.labels = torch::randint(5, {16});
  testing::expect_error(
      [&] {
        Trainer(net, [](OwnNetImpl& n, const Pair& p) { return torch::nll_loss(n.forward(p.x), p.y); },
                TrainerOptions())
            .fit(data);
      },
      "call train_step in a loop of your own");
}

// The same contracts on the device: the module, its gradients and Adam's
// state in device memory, the batches read on the host and staged per
// micro-batch.
class CudaOwnModelTest : public testing::OnCuda {};

TEST_F(CudaOwnModelTest, TrainStepOnTheDeviceIsBitwiseAHandWrittenDeviceLoop) {
  const auto options = TrainerOptions()
                           .optimizer(OptimizerKind::kSGD)
                           .lr(0.1)
                           .momentum(0.9)
                           .optimizer_kernel(optim::Kernel::kLoop)
                           .device(cuda);
  const auto by_trainer = trained_with(options);  // with dropout: the CUDA generator, seeded alike

  torch::manual_seed(7);
  OwnNet net;
  net->to(cuda);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int64_t i = 0; i < 3; ++i) {
    const auto b = batch_of(24, i);
    torch::manual_seed(100 + i);
    sgd.zero_grad();
    nll(*net, {b.data.to(cuda), b.target.to(cuda)}).backward();
    sgd.step();
  }
  const auto by_hand = values(net->parameters());
  ASSERT_EQ(by_trainer.size(), by_hand.size());
  for (size_t i = 0; i < by_hand.size(); ++i) {
    EXPECT_TRUE(by_trainer[i].is_cuda());
    EXPECT_TRUE(by_trainer[i].equal(by_hand[i])) << "parameter " << i;
  }
}

TEST_F(CudaOwnModelTest, EveryCombinationOfComponentsTrainsLikeThePlainStep) {
  expect_every_combination_like_the_plain_step(cuda);
}

TEST_F(CudaOwnModelTest, FitReadsAMapStyleDataSetOntoTheDeviceLikeTensorsInMemory) {
  expect_data_sets_train_like_tensors_in_memory(cuda);
}

// Batches of the user's own type, from a data set of the user's own.
struct StagedRows : torch::data::datasets::BatchDataset<StagedRows, Staged> {
  Staged get_batch(c10::ArrayRef<size_t> indices) override {
    const auto idx = torch::tensor(std::vector<int64_t>(indices.begin(), indices.end()));
    return {x.index_select(0, idx), y.index_select(0, idx)};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(x.size(0)); }
  torch::Tensor x = torch::randn({64, 20}), y = torch::randint(5, {64});
};

TEST_F(CudaOwnModelTest, BatchesReadAheadAreStagedFromPinnedMemory) {
  auto staged_with = [&](int64_t prefetch) {
    staged_from_pinned.clear();
    StagedRows data;
    Trainer trainer(OwnNet(0.0), [](OwnNetImpl& n, const Staged& b) { return torch::nll_loss(n.forward(b.x), b.y); },
                    TrainerOptions().batch_size(16).steps(4).micro_batch_size(8).prefetch_factor(prefetch).device(cuda));
    trainer.fit(data);
    return staged_from_pinned;
  };
  EXPECT_EQ(staged_with(2), std::vector<bool>(8, true)) << "every micro-batch of every step, from pinned memory";
  EXPECT_EQ(staged_with(0), std::vector<bool>(8, false)) << "read in the step, a batch stays as the data set gave it";
}

} // namespace
} // namespace memfit
