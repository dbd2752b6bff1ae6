#include "memfit/distributed.h"

#include "compat.h"

#include "memfit/models.h"
#include "memfit/trainer.h"

#include "ranks.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <functional>
#include <optional>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace memfit {
namespace {

class Distributed : public testing::Seeded {
 protected:
  void SetUp() override {
    testing::Seeded::SetUp();
    if (!distributed_available() && std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) !=
                                        "WorldComesFromTorchrunSlurmOrOpenMpiVariables") {
      GTEST_SKIP() << "this build has no c10d Gloo process group (LibTorch's pip wheels ship no gloo "
                      "headers; Debian's libtorch-dev with libgloo-dev has them)";
    }
  }
};

using testing::expect_error;

// Sets environment variables for the scope of a test and restores them.
class EnvGuard {
 public:
  void set(const std::string& name, const char* value) {
    if (saved_.count(name) == 0) {
      const char* old = std::getenv(name.c_str());
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
    }
    if (value != nullptr) {
      ::setenv(name.c_str(), value, 1);
    } else {
      ::unsetenv(name.c_str());
    }
  }
  ~EnvGuard() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        ::setenv(name.c_str(), value->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
  }

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

const char* const kLauncherVariables[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                          "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                                          "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                          "OMPI_COMM_WORLD_LOCAL_RANK"};

TEST_F(Distributed, WorldComesFromTorchrunSlurmOrOpenMpiVariables) {
  EnvGuard env;
  for (const char* v : kLauncherVariables) env.set(v, nullptr);
  auto solo = world_from_env();
  EXPECT_FALSE(solo.distributed());
  EXPECT_EQ(solo.source, "none");

  env.set("RANK", "2");
  env.set("WORLD_SIZE", "4");
  env.set("LOCAL_RANK", "0");
  env.set("MASTER_ADDR", "10.0.0.7");
  env.set("MASTER_PORT", "29555");
  auto torchrun = world_from_env();
  EXPECT_EQ(torchrun.source, "torchrun");
  EXPECT_EQ(torchrun.rank, 2);
  EXPECT_EQ(torchrun.world_size, 4);
  EXPECT_EQ(torchrun.local_rank, 0);
  EXPECT_EQ(torchrun.master_addr, "10.0.0.7");
  EXPECT_EQ(torchrun.master_port, 29555);

  // Slurm's and Open MPI's variables, each alone: rank, size, local rank.
  struct Launcher {
    const char* source;
    const char* rank;
    const char* size;
    const char* local;
  };
  for (const Launcher& l : {Launcher{"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
                            Launcher{"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                     "OMPI_COMM_WORLD_LOCAL_RANK"}}) {
    for (const char* v : kLauncherVariables) env.set(v, nullptr);
    env.set(l.rank, "5");
    env.set(l.size, "8");
    env.set(l.local, "1");
    auto w = world_from_env();
    EXPECT_EQ(w.source, l.source);
    EXPECT_EQ(w.rank, 5) << l.source;
    EXPECT_EQ(w.world_size, 8) << l.source;
    EXPECT_EQ(w.local_rank, 1) << l.source;
    EXPECT_EQ(w.master_addr, "127.0.0.1") << l.source << ": the default without MASTER_ADDR";
    EXPECT_EQ(w.master_port, 29500) << l.source;
  }

  env.set("OMPI_COMM_WORLD_SIZE", "2");
  env.set("OMPI_COMM_WORLD_RANK", "2");  // not below the size
  expect_error([] { world_from_env(); }, "OMPI_COMM_WORLD_RANK='2' is not an integer in [0, 1]");
  env.set("OMPI_COMM_WORLD_RANK", nullptr);
  env.set("OMPI_COMM_WORLD_SIZE", nullptr);
  env.set("RANK", "0");
  expect_error([] { world_from_env(); }, "WORLD_SIZE and RANK must be set together");
  env.set("WORLD_SIZE", "two");
  expect_error([] { world_from_env(); }, "WORLD_SIZE='two' is not an integer");
}

TEST_F(Distributed, AGroupOfOneReducesBroadcastsAndAveragesNothingAway) {
  WorldInfo solo;
  solo.master_port = 0;
  auto group = std::make_shared<ProcessGroup>(solo);
  EXPECT_EQ(group->rank(), 0);
  EXPECT_EQ(group->size(), 1);
  auto t = torch::arange(6, torch::kFloat);
  group->all_reduce_(t);
  EXPECT_TRUE(t.equal(torch::arange(6, torch::kFloat)));
  group->broadcast_(t, 0);
  group->barrier();
  expect_error([&] { group->broadcast_(t, 1); }, "root 1 is not a rank in [0, 1)");

  // One rank: DistributedDataParallel leaves the gradients bitwise as they were.
  torch::nn::Sequential net(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3));
  torch::nn::Sequential twin(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3));
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < net->parameters().size(); ++i) twin->parameters()[i].copy_(net->parameters()[i]);
  }
  DistributedDataParallel ddp(net.ptr(), group, DistributedDataParallelOptions().bucket_cap_mb(0.0001));
  EXPECT_EQ(ddp.buckets().size(), 4u) << "100 bytes per bucket: one parameter each";
  EXPECT_EQ(ddp.buckets().front(), std::vector<size_t>{3}) << "the last parameter first";
  const auto x = torch::randn({5, 8});
  net->forward(x).pow(2).sum().backward();
  twin->forward(x).pow(2).sum().backward();
  EXPECT_EQ(ddp.buckets_launched_in_backward(), 0) << "counted at finalize";
  ddp.finalize();
  EXPECT_EQ(ddp.buckets_launched_in_backward(), 4) << "every bucket went out during backward";
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(net->parameters()[i].grad().equal(twin->parameters()[i].grad())) << i;
  }
  EXPECT_EQ(ddp.bytes_reduced(), (8 * 16 + 16 + 16 * 3 + 3) * 4);
  // prepare() builds the buckets backward did not launch and launches none
  // (under NCCL with recovery the ranks vote between it and finalize()).
  {
    DistributedDataParallel::NoSync no_sync(ddp);
    net->forward(x).sum().backward();
  }
  const int64_t operations = group->operations();
  ddp.prepare();
  EXPECT_EQ(group->operations(), operations) << "prepare launched a bucket";
  ddp.finalize();
  EXPECT_EQ(group->operations(), operations + 4);
}

// --- several processes ------------------------------------------------------

constexpr int64_t kExamples = 96, kBatch = 8, kSteps = 4;  // per-rank batch 8

torch::nn::Sequential make_net(int64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(20, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                               torch::nn::Tanh(), torch::nn::Linear(64, 5));
}

std::pair<torch::Tensor, torch::Tensor> make_data() {
  torch::manual_seed(123);
  return {torch::randn({kExamples, 20}), torch::randint(0, 5, {kExamples})};
}

// One process over the global batch of world·kBatch: the reference.
std::vector<torch::Tensor> single_process(int64_t world) {
  auto net = make_net(1);
  auto [x, y] = make_data();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const int64_t global = world * kBatch;
  for (int64_t s = 0; s < kSteps; ++s) {
    auto xs = x.narrow(0, s * global, global), ys = y.narrow(0, s * global, global);
    sgd.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(xs), ys).backward();
    sgd.step();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

// 100 random images: with 8 per rank the last batch of an epoch is short
// and, over 3 ranks, unevenly shared (2, 1 and 1 examples).
ImageDataset synthetic_images() {
  torch::manual_seed(7);
  ImageDataset d;
  d.images = torch::randn({100, 1, 28, 28});
  d.labels = torch::randint(0, 10, {100});
  return d;
}

TrainerOptions trainer_options() {
  return TrainerOptions().batch_size(8).steps(7).optimizer(OptimizerKind::kSGD).lr(0.05).seed(3);
}

// Adam, whose state (two moments per parameter) is what ZeRO shards.
TrainerOptions zero_options() {
  return TrainerOptions().batch_size(8).steps(7).optimizer(OptimizerKind::kAdam).lr(1e-3).seed(3);
}

// A pipeline of two stages: flatten and fc0; then relu0 (in place), fc1,
// relu1 and the head. Batch 12 in chunks of 3.
TrainerOptions pipeline_options() {
  return TrainerOptions().batch_size(12).optimizer(OptimizerKind::kAdam).lr(1e-3).seed(3).parallel(
      ParallelMode::kPipeline).pipeline(PipelineOptions().chunks(4).schedule(PipelineSchedule::k1F1B).balance({2, 4}));
}

// The pipeline with clipping to a norm small enough that every step clips,
// and SGD (Adam would undo most of a uniform scaling).
TrainerOptions pipeline_clip_options() {
  return pipeline_options().steps(6).optimizer(OptimizerKind::kSGD).lr(0.1).max_grad_norm(0.05);
}

// The pipeline in bf16 (autocast on each stage).
TrainerOptions pipeline_bf16_options() { return pipeline_options().steps(6).precision(Precision::kBF16); }

// The pipeline with the optimizer's state, the fp32 masters it steps and the
// gradients on the host (ZeRO-Offload on each stage).
TrainerOptions pipeline_offload_options() {
  return pipeline_options().steps(6).offload_optimizer(Offload::kHost).offload_gradients(Offload::kHost);
}

// A small CNN, whose activations dominate its step's peak: `channels`
// feature maps pooled to `pooled` × `pooled`.
torch::nn::Sequential small_cnn(int64_t channels, int64_t pooled) {
  return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, channels, 3)), torch::nn::ReLU(),
                               torch::nn::AdaptiveAvgPool2d(pooled), torch::nn::Flatten(),
                               torch::nn::Linear(channels * pooled * pooled, 10));
}

// Rank `rank`'s share of step `step`'s global batch of 8 of `data`'s first
// 100 images: rows rank, rank + 2, ... (two ranks).
torch::data::Example<> rank_batch(const ImageDataset& data, int64_t step, int64_t rank) {
  const auto rows = torch::arange(step * 8 + rank, step * 8 + 8, 2) % 100;
  return {data.images.index_select(0, rows), data.labels.index_select(0, rows)};
}

// An MLP with dropout: each rank draws its own masks.
torch::nn::Sequential dropout_mlp() {
  return torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(784, 24), torch::nn::ReLU(),
                               torch::nn::Dropout(0.3), torch::nn::Linear(24, 10));
}

// The worker: rank r of world takes rows r, r+world, ... of each global batch
// (DistributedSampler's striding), with its own initial weights (broadcast
// must replace them by rank 0's).
TEST(DistributedWorker, Run) {
  const char* mode = std::getenv("MEMFIT_TEST_WORKER");
  if (mode == nullptr) GTEST_SKIP() << "run by the Distributed tests as one rank of several";
  const std::string m = mode, out = std::getenv("MEMFIT_TEST_OUT");
  const auto world = world_from_env();
  const auto timeout = m == "hang" ? std::chrono::seconds(2) : std::chrono::seconds(10);
  auto group = std::make_shared<ProcessGroup>(world, ProcessGroupOptions().timeout(timeout));
  if (m == "hang") {
    if (group->rank() == 1) {  // joins, then stops answering for longer than the timeout
      std::this_thread::sleep_for(std::chrono::seconds(6));
      std::_Exit(0);
    }
    auto t = torch::ones({4});
    const auto start = std::chrono::steady_clock::now();
    try {
      group->all_reduce_(t);
    } catch (const c10::Error& e) {
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::ofstream(out + ".rank0.txt") << waited << "\n" << e.what_without_backtrace();
      std::_Exit(7);
    }
    std::_Exit(0);
  }
  if (m == "die") {
    if (group->rank() == 1) std::_Exit(3);  // joins, then dies without a word
    auto t = torch::ones({4});
    try {
      for (int i = 0; i < 50; ++i) group->all_reduce_(t);
    } catch (const c10::Error& e) {
      std::ofstream(out + ".rank0.txt") << e.what_without_backtrace();
      std::_Exit(7);
    }
    std::_Exit(0);
  }
  if (m.rfind("disagree_", 0) == 0) {  // rank 2 (of 3) differs from ranks 0 and 1 in one thing
    const bool odd = world.rank == 2;
    auto options = trainer_options().process_group(group);
    int64_t width = 32;
    if (m == "disagree_batch" && odd) options.batch_size(16);
    if (m == "disagree_width" && odd) width = 24;
    if (m == "disagree_lr" && odd) options.lr(0.5);
    try {
      Trainer trainer(make_mlp(ModelOptions().width(width).depth(1)), options);
      std::_Exit(0);
    } catch (const c10::Error& e) {
      std::ofstream(out + ".rank" + std::to_string(world.rank) + ".txt") << e.what_without_backtrace();
      std::_Exit(7);
    }
  }
  if (m == "trainer" || m == "trainer_offload") {
    auto data = synthetic_images();
    torch::manual_seed(1 + world.rank);  // broadcast must replace these weights by rank 0's
    auto options = trainer_options().micro_batch_size(3).process_group(group);
    if (m == "trainer_offload") options.offload_optimizer(Offload::kHost).offload_gradients(Offload::kHost);
    Trainer trainer(make_mlp(ModelOptions().width(32).depth(1)), options);
    const auto report = trainer.fit(data);
    if (m == "trainer_offload") {
      // Resident, the same run holds the gradients and momentum on the device.
      torch::manual_seed(1 + world.rank);
      Trainer resident(make_mlp(ModelOptions().width(32).depth(1)),
                       trainer_options().micro_batch_size(3).process_group(group));
      const auto plain = resident.fit(data);
      EXPECT_LT(report.step_memory.peak, plain.step_memory.peak) << "rank " << world.rank;
      EXPECT_EQ(report.step_memory.optimizer_state, 0) << "rank " << world.rank;
    }
    std::vector<torch::Tensor> params;
    for (const auto& p : trainer.model()->parameters()) params.push_back(p.detach().clone());
    params.push_back(torch::tensor({report.final_loss}, torch::kDouble));
    torch::save(params, out + ".rank" + std::to_string(world.rank) + ".pt");
    return;
  }
  if (m == "zero") {
    // The same run with the optimizer state sharded (ZeRO stage 1) and whole.
    auto data = synthetic_images();
    auto run = [&](int64_t stage) {
      torch::manual_seed(1 + world.rank);
      Trainer t(make_mlp(ModelOptions().width(32).depth(2)), zero_options().process_group(group).zero_stage(stage));
      t.fit(data);
      return t;
    };
    Trainer sharded = run(1);
    Trainer whole = run(0);
    std::vector<torch::Tensor> result;
    for (const auto& p : sharded.model()->parameters()) result.push_back(p.detach().clone());
    for (const auto& p : whole.model()->parameters()) result.push_back(p.detach().clone());
    auto& zero = dynamic_cast<ZeroRedundancyOptimizer&>(sharded.optimizer());
    const auto owned = zero.owned_bytes();
    result.push_back(torch::tensor({zero.local_optimizer() ? optimizer_state_bytes(*zero.local_optimizer()) : int64_t(0),
                                 optimizer_state_bytes(whole.optimizer()), owned[world.rank]}));
    torch::save(result, out + ".rank" + std::to_string(world.rank) + ".pt");
    return;
  }
  if (m == "recover") {
    // 12 steps of Adam with recovery on, three times: rank 1's budget drops
    // to 40% of its plain step's peak
    // after step 4; nothing drops; and recovery off (gradients all-reduced
    // inside backward).
    auto data = synthetic_images();
    std::vector<torch::Tensor> result;
    std::vector<double> numbers;
    for (const std::string run : {"dropped", "recovery", "throw"}) {
      torch::manual_seed(1 + world.rank);
      auto options = zero_options().steps(12).batch_size(48).process_group(group);
      if (run != "throw") options.on_out_of_memory(OnOutOfMemory::kReplan);
      Trainer t(small_cnn(16, 4), options);
      int64_t base = 0, plain = 0;
      const auto report = t.fit(data, [&](const StepRecord& rec) {
        if (rec.step <= 3) {  // step 2 ends the epoch with a short batch: the largest of the first three
          base = rec.current_bytes;
          plain = std::max(plain, rec.peak_bytes - base);
        }
        if (run == "dropped" && rec.step == 4 && world.rank == 1) {
          set_memory_budget(torch::kCPU, base + static_cast<int64_t>(0.4 * double(plain)));
        }
      });
      set_memory_budget(torch::kCPU, 0);
      for (const auto& p : t.model()->parameters()) result.push_back(p.detach().clone());
      int64_t replans = 0;
      for (const auto& r : report.steps) replans += r.replans;
      numbers.push_back(double(report.steps.size()));
      numbers.push_back(double(replans));
      numbers.push_back(double(t.options().micro_batch_size()));
      for (const auto& r : report.steps) numbers.push_back(r.loss);
    }
    result.push_back(torch::tensor(numbers, torch::kDouble));
    torch::save(result, out + ".rank" + std::to_string(world.rank) + ".pt");
    return;
  }
  if (m == "recover_gives_up") {
    // Rank 1's budget drops after step 4 below what it holds between steps
    // and its gradients: no re-plan can fit, so every rank stops at step 5.
    auto data = synthetic_images();
    torch::manual_seed(1);
    Trainer t(small_cnn(16, 4), zero_options().steps(12).batch_size(48).process_group(group).on_out_of_memory(
                                    OnOutOfMemory::kReplan));
    try {
      t.fit(data, [&](const StepRecord& rec) {
        if (rec.step == 4 && world.rank == 1) set_memory_budget(torch::kCPU, rec.current_bytes + 1024);
      });
    } catch (const c10::Error& e) {
      set_memory_budget(torch::kCPU, 0);
      std::ofstream(out + ".rank" + std::to_string(world.rank) + ".txt")
          << t.step() << "\n" << e.what_without_backtrace();
      std::_Exit(7);
    }
    std::_Exit(0);
  }
  if (m == "recover_fault") {
    // Rank 1 fails the k-th allocation of step k+2, for every k a step
    // makes (the vote's, the buckets', the optimizer's...); rank 0 fails none.
    // A bucket per parameter: some fail after others went out in backward,
    // and rank 1 joins the rest. The retry keeps the settings, so both ranks
    // end bitwise where a run without failures ends.
    auto run = [&](bool faults) {
      torch::manual_seed(1 + world.rank);
      auto options = zero_options().process_group(group).on_out_of_memory(OnOutOfMemory::kReplan).max_grad_norm(1.0)
                         .bucket_cap_mb(0.0001);
      options.replan([](const OutOfMemoryEvent& e) { return Replan{e.micro_batch_size, nullptr, "the same"}; });
      Trainer t(small_cnn(4, 2), options);
      const auto data = synthetic_images();
      auto batch = [&](int64_t step) { return rank_batch(data, step, world.rank); };
      torch::Tensor count = torch::zeros({1}, torch::kDouble);
      t.train_step(batch(0));  // Adam's state exists: every later step allocates alike
      {
        const auto b = batch(1);
        AllocationFault counter(0);
        t.train_step(b);
        if (world.rank == 1) count[0] = double(counter.allocations());
      }
      group->all_reduce_(count);  // rank 1's allocations per step, on every rank
      int64_t failed = 0;
      for (int64_t k = 1; k <= int64_t(count.item<double>()); ++k) {
        const auto b = batch(k + 1);
        std::optional<AllocationFault> fault;
        if (faults && world.rank == 1) fault.emplace(k);
        t.train_step(b);
        failed += fault && fault->failed();
      }
      std::vector<torch::Tensor> result;
      for (const auto& p : t.model()->parameters()) result.push_back(p.detach().clone());
      result.push_back(torch::tensor({double(failed), double(t.recoveries().size()), count.item<double>()},
                                     torch::kDouble));
      return result;
    };
    auto result = run(true);
    for (auto& p : run(false)) result.push_back(p);
    torch::save(result, out + ".rank" + std::to_string(world.rank) + ".pt");
    return;
  }
  if (m == "recover_operations") {
    // The round trips and bytes a step puts into collectives, with recovery
    // off and on, whole and in micro-batches of 2.
    const auto data = synthetic_images();
    auto batch = [&](int64_t step) { return rank_batch(data, step, world.rank); };
    std::vector<double> numbers;
    for (const int64_t micro : {0, 2}) {
      for (const auto on : {OnOutOfMemory::kThrow, OnOutOfMemory::kReplan}) {
        torch::manual_seed(1);
        Trainer t(small_cnn(4, 2),
                  zero_options().process_group(group).on_out_of_memory(on).micro_batch_size(micro).bucket_cap_mb(0.0001));
        t.train_step(batch(0));
        const int64_t operations = group->operations(), payload = group->payload_bytes();
        t.train_step(batch(1));
        numbers.push_back(double(group->operations() - operations));
        numbers.push_back(double(group->payload_bytes() - payload));
      }
    }
    // LibTorch's own Adam calls no BeforeCommit gate: the ranks vote after
    // the backward and again after its step. Rank 1 fails the first
    // allocation of step 2 (its forward): both ranks redo it.
    torch::manual_seed(1);
    Trainer own(small_cnn(4, 2), zero_options().process_group(group).on_out_of_memory(OnOutOfMemory::kReplan)
                                     .bucket_cap_mb(0.0001).optimizer_factory([](std::vector<torch::Tensor> p) {
                                       return std::make_unique<torch::optim::Adam>(std::move(p));
                                     }));
    own.train_step(batch(0));
    const int64_t operations = group->operations();
    own.train_step(batch(1));
    numbers.push_back(double(group->operations() - operations));
    {
      const auto b = batch(2);
      std::optional<AllocationFault> fault;
      if (world.rank == 1) fault.emplace(1);
      own.train_step(b);
    }
    numbers.push_back(double(own.recoveries().size()));
    std::vector<torch::Tensor> result{torch::tensor(numbers, torch::kDouble)};
    for (const auto& p : own.model()->parameters()) result.push_back(p.detach().clone());
    torch::save(result, out + ".rank" + std::to_string(world.rank) + ".pt");
    return;
  }
  if (m == "recover_nonfinite") {
    // Rank 1's batch of step 3 holds a NaN, so the loss averaged over the
    // ranks is NaN there: with kError (checked after the vote inside the
    // optimizer's step) every rank stops at step 3 with its parameters as
    // they were; with kSkip (checked after a vote after the backward) every
    // rank skips step 3 and goes on.
    const auto data = synthetic_images();
    auto batch = [&](int64_t step) {
      auto b = rank_batch(data, step, world.rank);
      if (step == 3 && world.rank == 1) b.data.index_put_({0, 0, 0, 0}, std::numeric_limits<float>::quiet_NaN());
      return b;
    };
    std::vector<torch::Tensor> result;
    std::vector<double> numbers;
    std::string error;
    for (const auto mode : {NonfiniteLoss::kError, NonfiniteLoss::kSkip}) {
      torch::manual_seed(1 + world.rank);
      Trainer t(small_cnn(4, 2),
                zero_options().process_group(group).on_out_of_memory(OnOutOfMemory::kReplan).nonfinite_loss(mode));
      std::vector<torch::Tensor> before;
      int64_t skipped = 0;
      for (int64_t step = 1; step <= 5; ++step) {
        if (step == 3) before = testing::copies(t.model()->parameters());
        try {
          skipped += t.train_step(batch(step)).skipped;
        } catch (const c10::Error& e) {
          error = e.what_without_backtrace();
          break;
        }
      }
      bool unchanged = true;
      for (size_t i = 0; i < before.size(); ++i) unchanged = unchanged && before[i].equal(t.model()->parameters()[i]);
      for (const auto& p : t.model()->parameters()) result.push_back(p.detach().clone());
      numbers.push_back(double(t.step()));
      numbers.push_back(double(skipped));
      numbers.push_back(double(unchanged));
    }
    result.push_back(torch::tensor(numbers, torch::kDouble));
    torch::save(result, out + ".rank" + std::to_string(world.rank) + ".pt");
    std::ofstream(out + ".rank" + std::to_string(world.rank) + ".txt") << error;
    return;
  }
  if (m == "resume") {
    // 6 steps straight, against 3 steps, a save, and 3 more after resuming,
    // with the optimizer state whole and sharded; rank 1 draws dropout masks.
    auto data = synthetic_images();
    auto make = [&](int64_t stage, int64_t steps, const std::string& dir) {
      torch::manual_seed(1 + world.rank);
      return Trainer(dropout_mlp(), zero_options().steps(steps).micro_batch_size(3).save_dir(dir)
                                        .process_group(group).zero_stage(stage));
    };
    std::vector<torch::Tensor> result;
    for (int64_t stage : {0, 1}) {
      const std::string dir = out + ".ckpt" + std::to_string(stage);
      Trainer straight = make(stage, 6, "");
      const auto all = straight.fit(data);
      Trainer first = make(stage, 3, dir);
      first.fit(data);
      group->barrier();  // rank 0 has written the checkpoint
      Trainer second = make(stage, 6, "");
      second.resume(dir);
      const auto rest = second.fit(data);
      for (const auto& p : straight.model()->parameters()) result.push_back(p.detach().clone());
      for (const auto& p : second.model()->parameters()) result.push_back(p.detach().clone());
      std::vector<double> losses;
      for (size_t i = 3; i < all.steps.size(); ++i) losses.push_back(all.steps[i].loss);
      for (const auto& r : rest.steps) losses.push_back(r.loss);
      result.push_back(torch::tensor(losses, torch::kDouble));
    }
    torch::save(result, out + ".rank" + std::to_string(world.rank) + ".pt");
    return;
  }
  if (m == "pipeline_clip" || m == "pipeline_bf16" || m == "pipeline_offload") {
    // A pipeline of 2 Trainers that clips the gradients' total norm, runs in
    // bf16, or keeps optimizer state and gradients on the host: 6 steps.
    torch::manual_seed(1);
    const auto options = m == "pipeline_clip"   ? pipeline_clip_options()
                         : m == "pipeline_bf16" ? pipeline_bf16_options()
                                                : pipeline_offload_options();
    Trainer t(make_mlp(ModelOptions().width(32).depth(2)), TrainerOptions(options).process_group(group));
    const auto report = t.fit(synthetic_images());
    if (m == "pipeline_offload") {
      // The same stage without offload holds its optimizer state and gradients on the device.
      torch::manual_seed(1);
      Trainer resident(make_mlp(ModelOptions().width(32).depth(2)), pipeline_options().steps(6).process_group(group));
      const auto plain = resident.fit(synthetic_images());
      EXPECT_LT(report.step_memory.peak, plain.step_memory.peak) << "rank " << world.rank;
      EXPECT_EQ(report.step_memory.optimizer_state, 0) << "rank " << world.rank;
      EXPECT_GT(plain.step_memory.optimizer_state, 0) << "rank " << world.rank;
    }
    std::vector<torch::Tensor> result;
    for (const auto& p : t.model()->parameters()) result.push_back(p.detach().clone());
    torch::save(result, out + ".rank" + std::to_string(world.rank) + ".pt");
    return;
  }
  if (m == "pipeline") {
    // A pipeline of 2 Trainers (stage 1 begins with an in-place ReLU): 6
    // steps straight, and 3 steps, a save and 3 more after resuming.
    auto data = synthetic_images();
    auto make = [&](int64_t steps, const std::string& dir) {
      torch::manual_seed(1);  // every rank builds the same model
      return Trainer(make_mlp(ModelOptions().width(32).depth(2)),
                     pipeline_options().steps(steps).save_dir(dir).process_group(group));
    };
    Trainer straight = make(6, "");
    const auto all = straight.fit(data);
    const auto eval = straight.evaluate(data);
    Trainer first = make(3, out + ".ckpt_pipe");
    first.fit(data);
    group->barrier();  // rank 0 has written the checkpoint
    Trainer second = make(6, "");
    second.resume(out + ".ckpt_pipe");
    const auto rest = second.fit(data);
    std::vector<torch::Tensor> result;
    for (const auto& p : straight.model()->parameters()) result.push_back(p.detach().clone());
    for (const auto& p : second.model()->parameters()) result.push_back(p.detach().clone());
    std::vector<double> numbers{eval.loss, eval.accuracy};
    for (const auto& r : all.steps) numbers.push_back(r.loss);
    for (const auto& r : rest.steps) numbers.push_back(r.loss);
    result.push_back(torch::tensor(numbers, torch::kDouble));
    torch::save(result, out + ".rank" + std::to_string(world.rank) + ".pt");
    return;
  }
  auto net = make_net(1 + world.rank);
  DistributedDataParallel ddp(net.ptr(), group, DistributedDataParallelOptions().bucket_cap_mb(0.01));
  auto [x, y] = make_data();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const int64_t global = world.world_size * kBatch;
  for (int64_t s = 0; s < kSteps; ++s) {
    auto rows = torch::arange(s * global + world.rank, (s + 1) * global, world.world_size);
    auto xs = x.index_select(0, rows), ys = y.index_select(0, rows);
    sgd.zero_grad();
    if (m == "nosync") {  // two micro-batches of 4, communication on the second only
      {
        DistributedDataParallel::NoSync no_sync(ddp);
        (0.5 * torch::nn::functional::cross_entropy(net->forward(xs.narrow(0, 0, 4)), ys.narrow(0, 0, 4)))
            .backward();
      }
      (0.5 * torch::nn::functional::cross_entropy(net->forward(xs.narrow(0, 4, 4)), ys.narrow(0, 4, 4)))
          .backward();
    } else {
      torch::nn::functional::cross_entropy(net->forward(xs), ys).backward();
    }
    ddp.finalize();
    sgd.step();
  }
  std::vector<torch::Tensor> params;
  for (const auto& p : net->parameters()) params.push_back(p.detach().clone());
  params.push_back(torch::tensor({ddp.bytes_reduced(), ddp.buckets_launched_in_backward(),
                                  static_cast<int64_t>(ddp.buckets().size())}));
  torch::save(params, out + ".rank" + std::to_string(world.rank) + ".pt");
}

void expect_ranks_match_one_process(int world, const std::string& mode) {
  const std::string out = ::testing::TempDir() + "memfit_ddp_" + mode + "_" + std::to_string(::getpid());
  const auto statuses = testing::run_ranks("DistributedWorker.Run", world, mode, out);
  for (int r = 0; r < world; ++r) ASSERT_EQ(statuses[r], 0) << "rank " << r;
  const auto reference = single_process(world);
  const auto rank0 = testing::load_rank(out, 0);
  int64_t grad_bytes = 0;
  for (const auto& p : reference) grad_bytes += p.numel() * 4;
  for (int r = 0; r < world; ++r) {
    const auto mine = testing::load_rank(out, r);
    ASSERT_EQ(mine.size(), reference.size() + 1);
    for (size_t i = 0; i < reference.size(); ++i) {
      EXPECT_TRUE(mine[i].equal(rank0[i])) << "rank " << r << " parameter " << i << " differs from rank 0's";
      EXPECT_LT(testing::relative_difference(mine[i], reference[i]), 1e-6) << "rank " << r << " parameter " << i;
    }
    const auto counters = mine.back();
    EXPECT_EQ(counters[0].item<int64_t>(), kSteps * grad_bytes)
        << "each step all-reduces every gradient byte once (none on no-sync micro-batches)";
    EXPECT_EQ(counters[1].item<int64_t>(), kSteps * counters[2].item<int64_t>())
        << "every bucket was launched from inside backward";
    ::unlink((out + ".rank" + std::to_string(r) + ".pt").c_str());
  }
}

TEST_F(Distributed, TwoRanksTrainLikeOneProcessWithTheDoubleBatch) {
  expect_ranks_match_one_process(2, "plain");
}

TEST_F(Distributed, ThreeRanksWithNoSyncMicroBatchesTrainLikeOneProcess) {
  expect_ranks_match_one_process(3, "nosync");
}

TEST_F(Distributed, ARankThatDiesStopsTheOthersWithAnErrorNamingThem) {
  const std::string out = ::testing::TempDir() + "memfit_ddp_die_" + std::to_string(::getpid());
  const auto statuses = testing::run_ranks("DistributedWorker.Run", 2, "die", out);
  EXPECT_EQ(statuses[1], 3);
  EXPECT_EQ(statuses[0], 7) << "rank 0 must stop with an error, not hang or succeed";
  const std::string message = testing::read_text(out + ".rank0.txt");
  EXPECT_NE(message.find("rank 0 of 2: all-reduce failed"), std::string::npos) << message;
  ::unlink((out + ".rank0.txt").c_str());
}

// Reference: ranks started with another --batch trained replicas that
// differ, and another --width aborted inside Gloo (exit 134).
TEST_F(Distributed, RanksStartedWithAnotherModelOrOptionsAreRefusedOnEveryRankInOneLine) {
  const std::string weight = "'" + make_mlp(ModelOptions().width(32).depth(1))->named_parameters()[0].key() + "'";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"disagree_batch", "rank 2's TrainerOptions::batch_size is 16, rank 0's is 8"},
      {"disagree_width", "rank 2's model tensor 0 is " + weight + " [24, 784] Float, rank 0's is " + weight + " [32, 784] Float"},
      {"disagree_lr", "rank 2's TrainerOptions::lr is 0.5, rank 0's is 0.05"},
  };
  for (const auto& [mode, expected] : cases) {
    const std::string out = ::testing::TempDir() + "memfit_ddp_" + mode + "_" + std::to_string(::getpid());
    const auto statuses = testing::run_ranks("DistributedWorker.Run", 3, mode, out);
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(statuses[r], 7) << mode << ": rank " << r << " must refuse, not abort, hang or train";
      const std::string message = testing::read_text(out + ".rank" + std::to_string(r) + ".txt");
      EXPECT_NE(message.find("the ranks disagree before the first step: " + expected), std::string::npos)
          << mode << ", rank " << r << ": " << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << "one line";
      ::unlink((out + ".rank" + std::to_string(r) + ".txt").c_str());
    }
  }
}

// Runs the worker `mode` (Trainers in micro-batches of 3) on 3 ranks and
// compares them with one Trainer with the triple batch.
void expect_three_ranks_like_one_trainer(const std::string& mode) {
  // 7 steps of 24 examples cross the epoch's end (100 = 4 × 24 + 4), in
  // micro-batches of 3 on each rank (8 = 3 + 3 + 2; the short batch's
  // shares are 2, 1 and 1).
  const std::string out = ::testing::TempDir() + "memfit_ddp_" + mode + "_" + std::to_string(::getpid());
  const auto statuses = testing::run_ranks("DistributedWorker.Run", 3, mode, out);
  for (int r = 0; r < 3; ++r) ASSERT_EQ(statuses[r], 0) << "rank " << r;
  torch::manual_seed(1);
  Trainer single(make_mlp(ModelOptions().width(32).depth(1)), trainer_options().batch_size(24));
  const auto report = single.fit(synthetic_images());
  const auto reference = single.model()->parameters();
  const auto rank0 = testing::load_rank(out, 0);
  for (int r = 0; r < 3; ++r) {
    const auto mine = testing::load_rank(out, r);
    ASSERT_EQ(mine.size(), reference.size() + 1);
    for (size_t i = 0; i < reference.size(); ++i) {
      EXPECT_TRUE(mine[i].equal(rank0[i])) << "rank " << r << " parameter " << i;
      EXPECT_LT(testing::relative_difference(mine[i], reference[i].detach()), 1e-6) << "rank " << r << " parameter " << i;
    }
    EXPECT_NEAR(mine.back().item<double>(), report.final_loss, 1e-6 * std::abs(report.final_loss))
        << "the reported loss is the mean over all ranks' examples";
    ::unlink((out + ".rank" + std::to_string(r) + ".pt").c_str());
  }
}

TEST_F(Distributed, TrainersOnThreeRanksTrainLikeOneTrainerWithTheTripleBatch) {
  expect_three_ranks_like_one_trainer("trainer");
}

TEST_F(Distributed, TrainersWithGradientOffloadReduceOnTheHostLikeOneTrainer) {
  // Micro-batches accumulate on the host masters; the last one's hooks move
  // each gradient there before DDP's hook reduces it.
  expect_three_ranks_like_one_trainer("trainer_offload");
}

TEST_F(Distributed, WhenOneRankRunsOutOfMemoryEveryRankReplansTheStepAndTheyStayEqual) {
  const std::string out = ::testing::TempDir() + "memfit_ddp_recover_" + std::to_string(::getpid());
  const auto statuses = testing::run_ranks("DistributedWorker.Run", 2, "recover", out);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(statuses[r], 0) << "rank " << r;
  const auto rank0 = testing::load_rank(out, 0), rank1 = testing::load_rank(out, 1);
  ASSERT_EQ(rank0.size(), rank1.size());
  const size_t n = (rank0.size() - 1) / 3;  // parameters per run
  for (size_t i = 0; i < rank0.size() - 1; ++i) {
    EXPECT_TRUE(rank0[i].equal(rank1[i])) << "run " << i / n << " parameter " << i % n << ": the ranks differ";
  }
  for (size_t i = 0; i < n; ++i) {
    EXPECT_LT(testing::relative_difference(rank0[i], rank0[n + i]), 1e-5) << "parameter " << i
        << ": the recovered run differs from the uninterrupted one";
    EXPECT_TRUE(rank0[n + i].equal(rank0[2 * n + i])) << "parameter " << i
        << ": all-reducing after backward (recovery on) changed the gradients";
  }
  // Per run: steps, re-plans, final micro-batch, then the 12 losses.
  const auto numbers0 = rank0.back(), numbers1 = rank1.back();
  const int64_t per_run = 3 + 12;
  for (const auto& numbers : {numbers0, numbers1}) {
    EXPECT_EQ(numbers[0].item<double>(), 12) << "the dropped run finished every step";
    EXPECT_GE(numbers[1].item<double>(), 1) << "each rank re-planned, not only the one that failed";
    EXPECT_GT(numbers[2].item<double>(), 0) << "re-planned to micro-batches";
    EXPECT_EQ(numbers[per_run + 1].item<double>(), 0) << "nothing failed without the drop";
    for (int64_t s = 0; s < 12; ++s) {
      EXPECT_NEAR(numbers[3 + s].item<double>(), numbers[per_run + 3 + s].item<double>(), 1e-5) << "step " << s + 1;
      EXPECT_EQ(numbers[per_run + 3 + s].item<double>(), numbers[2 * per_run + 3 + s].item<double>()) << "step " << s + 1;
    }
  }
  EXPECT_EQ(numbers0[2].item<double>(), numbers1[2].item<double>()) << "the ranks re-planned to the same micro-batch";
  for (int r = 0; r < 2; ++r) ::unlink((out + ".rank" + std::to_string(r) + ".pt").c_str());
}

TEST_F(Distributed, WhenOneRankCannotReplanEveryRankStopsAtThatStepNamingIt) {
  const std::string out = ::testing::TempDir() + "memfit_ddp_gives_up_" + std::to_string(::getpid());
  const auto statuses = testing::run_ranks("DistributedWorker.Run", 2, "recover_gives_up", out);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(statuses[r], 7) << "rank " << r << " must stop with an error, not hang or go on";
    const std::string text = testing::read_text(out + ".rank" + std::to_string(r) + ".txt");
    EXPECT_EQ(text.rfind("4\n", 0), 0u) << "rank " << r << " stopped after step 4, its last whole step: " << text;
    ::unlink((out + ".rank" + std::to_string(r) + ".txt").c_str());
    if (r == 0) {
      EXPECT_NE(text.find("step 5 ran out of memory and rank 1 of 2 could not re-plan: every rank stops"),
                std::string::npos) << text;
    } else {
      EXPECT_NE(text.find("step 5 ran out of memory: the budget"), std::string::npos) << text;
    }
  }
}

TEST_F(Distributed, FailingAnyAllocationOfOneRanksStepMakesEveryRankRedoItBitwise) {
  const std::string out = ::testing::TempDir() + "memfit_ddp_recover_fault_" + std::to_string(::getpid());
  const auto statuses = testing::run_ranks("DistributedWorker.Run", 2, "recover_fault", out);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(statuses[r], 0) << "rank " << r;
  const auto rank0 = testing::load_rank(out, 0), rank1 = testing::load_rank(out, 1);
  ASSERT_EQ(rank0.size(), rank1.size());
  const size_t n = rank0.size() / 2 - 1;  // parameters per run
  for (const auto& mine : {rank0, rank1}) {
    for (size_t i = 0; i < n; ++i) {
      EXPECT_TRUE(mine[i].equal(rank0[n + 1 + i])) << "parameter " << i << " differs from the run without failures";
    }
  }
  const auto counts0 = rank0[n], counts1 = rank1[n];
  const double allocations = counts1[2].item<double>();
  EXPECT_GT(allocations, 10) << "a step makes many allocations";
  EXPECT_EQ(counts1[0].item<double>(), allocations) << "rank 1 failed each allocation of a step once";
  EXPECT_EQ(counts0[0].item<double>(), 0) << "rank 0 failed none";
  EXPECT_EQ(counts0[1].item<double>(), allocations) << "rank 0 redid every step that rank 1 failed";
  EXPECT_EQ(counts1[1].item<double>(), allocations);
  for (int r = 0; r < 2; ++r) ::unlink((out + ".rank" + std::to_string(r) + ".pt").c_str());
}

TEST_F(Distributed, RecoveryAddsNoRoundTripToAStepOverGloo) {
  const std::string out = ::testing::TempDir() + "memfit_ddp_operations_" + std::to_string(::getpid());
  const auto statuses = testing::run_ranks("DistributedWorker.Run", 2, "recover_operations", out);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(statuses[r], 0) << "rank " << r;
  const auto rank0 = testing::load_rank(out, 0), rank1 = testing::load_rank(out, 1);
  ASSERT_EQ(rank0.size(), rank1.size());
  for (size_t i = 1; i < rank0.size(); ++i) EXPECT_TRUE(rank0[i].equal(rank1[i])) << "parameter " << i - 1;
  for (int r = 0; r < 2; ++r) {
    const auto n = (r == 0 ? rank0 : rank1).front();
    for (int micro = 0; micro < 2; ++micro) {
      const auto off_ops = n[4 * micro].item<double>(), off_bytes = n[4 * micro + 1].item<double>();
      const auto on_ops = n[4 * micro + 2].item<double>(), on_bytes = n[4 * micro + 3].item<double>();
      EXPECT_GT(off_ops, 3) << "a bucket per parameter, the loss";
      EXPECT_EQ(on_ops, off_ops) << "rank " << r << (micro ? ", micro-batches" : "")
                                 << ": the vote replaces the loss's all-reduce";
      EXPECT_EQ(on_bytes - off_bytes, 2 * 8) << "rank " << r << ": the vote carries a flag per rank beside the loss";
    }
    EXPECT_EQ(n[8].item<double>(), n[0].item<double>() + 1) << "rank " << r << ": LibTorch's Adam, voted on twice";
    EXPECT_EQ(n[9].item<double>(), 1) << "rank " << r << ": rank 1's failure made both ranks redo the step";
    ::unlink((out + ".rank" + std::to_string(r) + ".pt").c_str());
  }
}

TEST_F(Distributed, ANonfiniteLossOnOneRankStopsOrSkipsTheStepOnEveryRankWithRecoveryOn) {
  const std::string out = ::testing::TempDir() + "memfit_ddp_nonfinite_" + std::to_string(::getpid());
  const auto statuses = testing::run_ranks("DistributedWorker.Run", 2, "recover_nonfinite", out);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(statuses[r], 0) << "rank " << r;
  const auto rank0 = testing::load_rank(out, 0), rank1 = testing::load_rank(out, 1);
  ASSERT_EQ(rank0.size(), rank1.size());
  for (size_t i = 0; i + 1 < rank0.size(); ++i) EXPECT_TRUE(rank0[i].equal(rank1[i])) << "tensor " << i;
  for (int r = 0; r < 2; ++r) {
    const auto numbers = (r == 0 ? rank0 : rank1).back();
    EXPECT_EQ(numbers[0].item<double>(), 2) << "rank " << r << ", kError: stopped at step 3, after 2 steps";
    EXPECT_EQ(numbers[2].item<double>(), 1) << "rank " << r << ", kError: step 3 changed no parameter";
    EXPECT_EQ(numbers[3].item<double>(), 5) << "rank " << r << ", kSkip: every step ran";
    EXPECT_EQ(numbers[4].item<double>(), 1) << "rank " << r << ", kSkip: step 3 was skipped";
    const std::string text = testing::read_text(out + ".rank" + std::to_string(r) + ".txt");
    EXPECT_NE(text.find("step 3 (epoch 0): the loss (summed over the ranks) is NaN"), std::string::npos) << text;
    ::unlink((out + ".rank" + std::to_string(r) + ".pt").c_str());
    ::unlink((out + ".rank" + std::to_string(r) + ".txt").c_str());
  }
}

TEST_F(Distributed, ZeroStageOneShardsAdamStateAndTrainsLikeTheWholeState) {
  const std::string out = ::testing::TempDir() + "memfit_ddp_zero_" + std::to_string(::getpid());
  const auto statuses = testing::run_ranks("DistributedWorker.Run", 2, "zero", out);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(statuses[r], 0) << "rank " << r;
  torch::manual_seed(1);
  Trainer single(make_mlp(ModelOptions().width(32).depth(2)), zero_options().batch_size(16));
  single.fit(synthetic_images());
  const auto reference = single.model()->parameters();
  const size_t n = reference.size();
  int64_t param_bytes = 0, largest = 0, state_sum = 0;
  for (const auto& p : reference) {
    param_bytes += p.numel() * 4;
    largest = std::max<int64_t>(largest, p.numel() * 4);
  }
  for (int r = 0; r < 2; ++r) {
    const auto mine = testing::load_rank(out, r);
    ASSERT_EQ(mine.size(), 2 * n + 1);
    for (size_t i = 0; i < n; ++i) {
      EXPECT_TRUE(mine[i].equal(mine[n + i])) << "rank " << r << " parameter " << i
                                              << ": sharded and whole optimizer state differ";
      EXPECT_LT(testing::relative_difference(mine[i], reference[i].detach()), 1e-6) << "rank " << r << " parameter " << i;
    }
    const auto bytes = mine.back();
    const int64_t local = bytes[0].item<int64_t>(), whole = bytes[1].item<int64_t>(), owned = bytes[2].item<int64_t>();
    EXPECT_EQ(whole, 2 * param_bytes) << "unsharded Adam keeps two moments of every parameter";
    EXPECT_EQ(local, 2 * owned) << "rank " << r << " keeps the moments of what it owns, nothing else";
    EXPECT_LE(owned, param_bytes / 2 + largest) << "the greedy partition is within one parameter of even";
    EXPECT_GT(owned, 0) << "rank " << r << " owns a share";
    state_sum += local;
    ::unlink((out + ".rank" + std::to_string(r) + ".pt").c_str());
  }
  EXPECT_EQ(state_sum, 2 * param_bytes) << "the shards add up to the whole state, each parameter once";
}

TEST_F(Distributed, ResumedRanksContinueBitIdenticallyWithWholeAndShardedState) {
  const std::string out = ::testing::TempDir() + "memfit_ddp_resume_" + std::to_string(::getpid());
  const auto statuses = testing::run_ranks("DistributedWorker.Run", 2, "resume", out);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(statuses[r], 0) << "rank " << r;
  const size_t n = dropout_mlp()->parameters().size();
  for (int r = 0; r < 2; ++r) {
    const auto mine = testing::load_rank(out, r);
    ASSERT_EQ(mine.size(), 2 * (2 * n + 1));
    for (int stage = 0; stage < 2; ++stage) {
      const size_t base = stage * (2 * n + 1);
      for (size_t i = 0; i < n; ++i) {
        EXPECT_TRUE(mine[base + i].equal(mine[base + n + i]))
            << "zero_stage " << stage << ", rank " << r << ", parameter " << i << ": the resumed run differs";
      }
      const auto losses = mine[base + 2 * n];
      ASSERT_EQ(losses.numel(), 6);
      EXPECT_TRUE(losses.narrow(0, 0, 3).equal(losses.narrow(0, 3, 3)))
          << "zero_stage " << stage << ": the losses of steps 4 to 6 differ after resuming";
    }
    ::unlink((out + ".rank" + std::to_string(r) + ".pt").c_str());
  }
  // The sharded checkpoint loads only into a job of the size that saved it.
  WorldInfo solo;
  solo.master_port = 0;
  auto group = std::make_shared<ProcessGroup>(solo);
  Trainer one(dropout_mlp(), zero_options().process_group(group).zero_stage(1));
  expect_error([&] { one.resume(out + ".ckpt1"); }, "holds the optimizer state of 2 ranks (zero_stage 1), but this job has 1");
  Trainer unsharded(dropout_mlp(), zero_options().process_group(group));
  expect_error([&] { unsharded.resume(out + ".ckpt1"); }, "resume with zero_stage 1 (--zero-stage 1)");
  for (int stage = 0; stage < 2; ++stage) {
    const std::string dir = out + ".ckpt" + std::to_string(stage);
    std::filesystem::remove(dir + "/checkpoint.pt");
    std::filesystem::remove(dir);
  }
}

TEST_F(Distributed, GradientHoldersMustMatchTheTrainableParameters) {
  WorldInfo solo;
  solo.master_port = 0;
  auto group = std::make_shared<ProcessGroup>(solo);
  torch::nn::Linear net(4, 2);
  expect_error([&] { DistributedDataParallel(net.ptr(), group, DistributedDataParallelOptions(), {torch::zeros({2, 4})}); },
               "1 gradient holders for 2 trainable parameters");
  expect_error([&] {
    DistributedDataParallel(net.ptr(), group, DistributedDataParallelOptions(), {torch::zeros({4, 2}), torch::zeros({2})});
  }, "gradient holder 0 is [4, 2] but its parameter is [2, 4]");
}

TEST_F(Distributed, PipelinedTrainersTrainLikeOneTrainerAndResumeBitIdentically) {
  const std::string out = ::testing::TempDir() + "memfit_pipe_trainer_" + std::to_string(::getpid());
  const auto statuses = testing::run_ranks("DistributedWorker.Run", 2, "pipeline", out);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(statuses[r], 0) << "rank " << r;
  torch::manual_seed(1);
  Trainer single(make_mlp(ModelOptions().width(32).depth(2)),
                 pipeline_options().steps(6).parallel(ParallelMode::kData));
  const auto report = single.fit(synthetic_images());
  const auto eval = single.evaluate(synthetic_images());
  const auto reference = single.model()->parameters();
  const size_t stage_params[2] = {2, 4};
  size_t offset = 0;
  for (int r = 0; r < 2; ++r) {
    const auto mine = testing::load_rank(out, r);
    const size_t n = stage_params[r];
    ASSERT_EQ(mine.size(), 2 * n + 1) << "rank " << r;
    for (size_t i = 0; i < n; ++i) {
      EXPECT_LT(testing::relative_difference(mine[i], reference[offset + i].detach()), 1e-6)
          << "rank " << r << ", parameter " << offset + i << " of the whole model";
      EXPECT_TRUE(mine[i].equal(mine[n + i])) << "rank " << r << ", parameter " << i << ": the resumed run differs";
    }
    const auto numbers = mine.back();
    ASSERT_EQ(numbers.numel(), 2 + 6 + 3);
    EXPECT_NEAR(numbers[0].item<double>(), eval.loss, 1e-6) << "the pipeline's evaluation is the model's";
    EXPECT_EQ(numbers[1].item<double>(), eval.accuracy);
    for (int k = 0; k < 6; ++k) {
      EXPECT_NEAR(numbers[2 + k].item<double>(), report.steps[k].loss, 1e-6) << "step " << k + 1;
    }
    EXPECT_TRUE(numbers.narrow(0, 5, 3).equal(numbers.narrow(0, 8, 3))) << "the losses of steps 4 to 6 after resuming";
    offset += n;
    ::unlink((out + ".rank" + std::to_string(r) + ".pt").c_str());
  }
  std::filesystem::remove(out + ".ckpt_pipe/checkpoint.pt");
  std::filesystem::remove(out + ".ckpt_pipe");
}

TEST_F(Distributed, ClipGradNormOfOneRankIsLibTorchs) {
  WorldInfo solo;
  solo.master_port = 0;
  ProcessGroup group(solo);
  auto make = [] {
    torch::manual_seed(5);
    auto net = torch::nn::Sequential(torch::nn::Linear(6, 5), torch::nn::Tanh(), torch::nn::Linear(5, 2));
    net->forward(torch::randn({4, 6})).pow(2).sum().backward();
    return net;
  };
  auto ours = make(), theirs = make();
  const double expected = torch::nn::utils::clip_grad_norm_(theirs->parameters(), 0.1);
  const double norm = clip_grad_norm_(ours->parameters(), 0.1, group);
  EXPECT_NEAR(norm, expected, 1e-6 * expected);
  ASSERT_GT(norm, 0.1) << "the test must clip";
  for (size_t i = 0; i < ours->parameters().size(); ++i) {
    EXPECT_LT(testing::relative_difference(ours->parameters()[i].grad(), theirs->parameters()[i].grad()), 1e-6) << i;
  }
  // Below the limit nothing changes.
  auto unclipped = make();
  const auto before = unclipped->parameters()[0].grad().clone();
  clip_grad_norm_(unclipped->parameters(), 1e6, group);
  EXPECT_TRUE(unclipped->parameters()[0].grad().equal(before));
  expect_error([&] { clip_grad_norm_(ours->parameters(), 0, group); }, "max_norm must be a positive finite number, got 0");
}

// Runs the worker `mode` on 2 ranks and compares each stage's parameters
// with one Trainer's (relative difference below `tolerance`); returns the
// largest difference.
double expect_pipelined_like_one_trainer(const std::string& mode, const TrainerOptions& one, double tolerance) {
  const std::string out = ::testing::TempDir() + "memfit_" + mode + "_" + std::to_string(::getpid());
  const auto statuses = testing::run_ranks("DistributedWorker.Run", 2, mode, out);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(statuses[r], 0) << "rank " << r;
  torch::manual_seed(1);
  Trainer single(make_mlp(ModelOptions().width(32).depth(2)), one);
  single.fit(synthetic_images());
  const auto reference = single.model()->parameters();
  const size_t stage_params[2] = {2, 4};
  size_t offset = 0;
  double largest = 0;
  for (int r = 0; r < 2; ++r) {
    const auto mine = testing::load_rank(out, r);
    EXPECT_EQ(mine.size(), stage_params[r]) << "rank " << r;
    for (size_t i = 0; i < mine.size() && i < stage_params[r]; ++i) {
      const double d = testing::relative_difference(mine[i], reference[offset + i].detach());
      largest = std::max(largest, d);
      EXPECT_LT(d, tolerance) << mode << ", rank " << r << ", parameter " << offset + i << " of the whole model";
    }
    offset += stage_params[r];
    ::unlink((out + ".rank" + std::to_string(r) + ".pt").c_str());
  }
  return largest;
}

// The fp32 parameters after 6 steps of one Trainer.
std::vector<torch::Tensor> one_trainer_parameters(const TrainerOptions& options) {
  torch::manual_seed(1);
  Trainer t(make_mlp(ModelOptions().width(32).depth(2)), options);
  t.fit(synthetic_images());
  std::vector<torch::Tensor> out;
  for (const auto& p : t.model()->parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST_F(Distributed, PipelinedTrainersClipTheGradientsOfAllStagesLikeOneTrainer) {
  expect_pipelined_like_one_trainer("pipeline_clip", pipeline_clip_options().parallel(ParallelMode::kData), 1e-6);
  // Clipping changed the run (so the comparison above can fail).
  const auto clipped = one_trainer_parameters(pipeline_clip_options().parallel(ParallelMode::kData));
  const auto unclipped = one_trainer_parameters(pipeline_clip_options().max_grad_norm(0).parallel(ParallelMode::kData));
  EXPECT_GT(testing::relative_difference(clipped[0], unclipped[0]), 1e-3);
}

TEST_F(Distributed, PipelinedTrainersInBf16TrainLikeOneTrainerInBf16) {
  // One Trainer in micro-batches of the pipeline's chunks (12 / 4): the same
  // bf16 products; only the order in which the chunks' gradients add differs.
  const double d = expect_pipelined_like_one_trainer(
      "pipeline_bf16", pipeline_bf16_options().micro_batch_size(3).parallel(ParallelMode::kData), 1e-5);
  // bf16 changed the run (so the comparison above can fail).
  const auto fp32 = one_trainer_parameters(pipeline_options().steps(6).parallel(ParallelMode::kData));
  const auto bf16 = one_trainer_parameters(pipeline_bf16_options().parallel(ParallelMode::kData));
  EXPECT_GT(testing::relative_difference(bf16[0], fp32[0]), 100 * std::max(d, 1e-7));
}

TEST_F(Distributed, PipelinedTrainersWithOffloadTrainLikeOneTrainer) {
  // Offload changes no number: the whole batch in one process, as without it.
  expect_pipelined_like_one_trainer("pipeline_offload", pipeline_options().steps(6).parallel(ParallelMode::kData), 1e-6);
}

TEST_F(Distributed, ZeroStageAndPipelineOptionsAreCheckedOnce) {
  expect_error([] { Trainer(dropout_mlp(), zero_options().zero_stage(1)); }, "zero_stage 1 shards the optimizer state over the ranks of a process group");
  expect_error([] { Trainer(dropout_mlp(), zero_options().zero_stage(2)); }, "stages 2 and 3 are not implemented");
  expect_error([] { Trainer(dropout_mlp(), pipeline_options()); }, "a pipeline splits the model over the ranks of a process group");
  WorldInfo solo;
  solo.master_port = 0;
  auto group = std::make_shared<ProcessGroup>(solo);
  expect_error([&] { Trainer(dropout_mlp(), pipeline_options().process_group(group).precision(Precision::kFP16)); },
               "pipeline parallel training does not support fp16 precision yet");
  expect_error([&] { Trainer(dropout_mlp(), pipeline_options().process_group(group).micro_batch_size(4)); },
               "set micro_batch_size 0 and the chunks instead");
  expect_error([&] { Trainer(dropout_mlp(), pipeline_options().process_group(group).zero_stage(1)); },
               "a pipeline's ranks hold different layers");
}

TEST_F(Distributed, ARankThatHangsStopsTheOthersAfterTheTimeout) {
  // Rank 1 stays silent for 6 s; rank 0's all-reduce gives up after its 2 s
  // timeout with an error naming it, well before rank 1 would have answered.
  const std::string out = ::testing::TempDir() + "memfit_ddp_hang_" + std::to_string(::getpid());
  const auto statuses = testing::run_ranks("DistributedWorker.Run", 2, "hang", out);
  EXPECT_EQ(statuses[0], 7) << "rank 0 must stop with an error, not wait for rank 1";
  std::ifstream in(out + ".rank0.txt");
  double waited = 0;
  in >> waited;
  std::string message((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_GE(waited, 1.5) << message;
  EXPECT_LT(waited, 5.0) << "the timeout bounds the wait";
  EXPECT_NE(message.find("rank 0 of 2: all-reduce failed"), std::string::npos) << message;
  EXPECT_NE(message.find("2000 ms timeout"), std::string::npos) << message;
  ::unlink((out + ".rank0.txt").c_str());
}

TEST_F(Distributed, TheNcclBackendNeedsNcclAndAGpuAndSaysSo) {
  // Where NCCL cannot run (no NCCL in this build, or no GPU), asking for it
  // is a one-line error naming what is missing and the Gloo backend.
  if (compat::kBuiltWithCuda && torch::cuda::is_available()) GTEST_SKIP() << "a GPU is here: CudaDistributed runs NCCL";
  WorldInfo solo;
  solo.master_port = 0;
  expect_error([&] { ProcessGroup(solo, ProcessGroupOptions().backend(ProcessGroupBackend::kNccl)); },
               "backend(ProcessGroupBackend::kGloo)");
  EXPECT_EQ(ProcessGroup(solo).device(), torch::Device(torch::kCPU)) << "Gloo reduces on the host";
}

class CudaDistributed : public testing::OnCuda {};

TEST_F(CudaDistributed, ASingleRankNcclGroupReducesBroadcastsAndAveragesOnTheDevice) {
  if (!nccl_available()) {
    GTEST_SKIP() << "this memfit was built without c10d's NCCL process group (its configure step prints "
                    "'memfit: c10d NCCL: OFF': it needs gloo's and nccl.h's headers)";
  }
  WorldInfo solo;
  solo.master_port = 0;
  std::shared_ptr<ProcessGroup> group;
  try {
    group = std::make_shared<ProcessGroup>(solo, ProcessGroupOptions().backend(ProcessGroupBackend::kNccl));
  } catch (const c10::Error& e) {
    if (!compat::kBuiltWithCuda || std::string(e.what()).find("not NCCL") != std::string::npos) {
      GTEST_SKIP() << "this CUDA build has no NCCL: " << e.what_without_backtrace();
    }
    throw;
  }
  const torch::Device cuda(torch::kCUDA, 0);
  EXPECT_EQ(group->device(), cuda);
  auto t = torch::arange(6, torch::TensorOptions().dtype(torch::kFloat).device(cuda));
  group->all_reduce_(t);
  EXPECT_TRUE(t.cpu().equal(torch::arange(6, torch::kFloat))) << "a group of one sums to itself";
  group->all_reduce_max_(t);
  group->broadcast_(t, 0);
  auto host = torch::ones({4});
  group->all_reduce_(host);  // staged through the device and back
  EXPECT_TRUE(host.equal(torch::ones({4})));
  auto pending = group->all_reduce_async_(t);
  pending.wait();
  expect_error([&] { group->all_reduce_async_(host); }, "needs a contiguous tensor on cuda:0");
  group->barrier();

  // DistributedDataParallel over NCCL: the buckets stay on the device and one
  // rank leaves the gradients bitwise as they were.
  torch::nn::Sequential net(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3));
  net->to(cuda);
  torch::nn::Sequential twin(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3));
  twin->to(cuda);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < net->parameters().size(); ++i) twin->parameters()[i].copy_(net->parameters()[i]);
  }
  DistributedDataParallel ddp(net.ptr(), group, DistributedDataParallelOptions().bucket_cap_mb(0.0001));
  const auto x = torch::randn({5, 8}, cuda);
  net->forward(x).pow(2).sum().backward();
  twin->forward(x).pow(2).sum().backward();
  ddp.finalize();
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(net->parameters()[i].grad().equal(twin->parameters()[i].grad())) << i;
  }
}

} // namespace
} // namespace memfit
