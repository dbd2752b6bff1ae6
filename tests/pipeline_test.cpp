#include "memfit/pipeline.h"

#include "memfit/memory.h"

#include "ranks.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace memfit {
namespace {

using testing::expect_error;

// The least largest stage cost over every split, by enumeration.
double brute_force(const std::vector<double>& costs, int64_t stages, size_t from = 0) {
  if (stages == 1) {
    double total = 0;
    for (size_t i = from; i < costs.size(); ++i) total += costs[i];
    return total;
  }
  double best = std::numeric_limits<double>::infinity(), head = 0;
  for (size_t end = from + 1; end + (stages - 1) <= costs.size(); ++end) {
    head += costs[end - 1];
    best = std::min(best, std::max(head, brute_force(costs, stages - 1, end)));
  }
  return best;
}

TEST(PipelineBalance, IsTheBestSplitThatEnumerationFinds) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> cost(0.0, 10.0);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t n = 1 + rng() % 9;
    std::vector<double> costs(n);
    for (auto& c : costs) c = cost(rng);
    for (int64_t stages = 1; stages <= static_cast<int64_t>(std::min<size_t>(n, 4)); ++stages) {
      const auto b = balance_by_cost(costs, stages);
      ASSERT_EQ(static_cast<int64_t>(b.size()), stages);
      double largest = 0;
      size_t at = 0;
      for (int64_t layers : b) {
        ASSERT_GE(layers, 1);
        double total = 0;
        for (int64_t i = 0; i < layers; ++i) total += costs[at++];
        largest = std::max(largest, total);
      }
      ASSERT_EQ(at, n) << "the balance covers every layer";
      EXPECT_DOUBLE_EQ(largest, brute_force(costs, stages)) << "trial " << trial << ", " << stages << " stages";
    }
  }
  EXPECT_EQ(balance_by_cost({1, 1, 1, 3}, 2), std::vector<int64_t>({3, 1}));
  expect_error([] { balance_by_cost({1, 2}, 3); }, "cannot split 2 layers into 3 non-empty stages");
  expect_error([] { balance_by_cost({1, -2}, 1); }, "costs must be finite and >= 0");
  // A costly layer without parameters (a Flatten that timing noise made
  // slow) never forms a stage of its own: that stage would have nothing to train.
  EXPECT_EQ(balance_by_cost({5, 1, 1}, 2), std::vector<int64_t>({1, 2}));
  EXPECT_EQ(balance_by_cost({5, 1, 1}, 2, {false, true, true}), std::vector<int64_t>({2, 1}));
  EXPECT_EQ(balance_by_cost({1, 9, 1, 1}, 3, {true, false, true, true}), std::vector<int64_t>({1, 2, 1}));
  expect_error([] { balance_by_cost({1, 1, 1}, 2, {false, true, false}); },
               "only 1 of the 3 layers have parameters to train, so 2 stages would leave one with nothing to train");
  expect_error([] { balance_by_cost({1, 1}, 1, {true}); }, "1 trains flags for 2 layers");
}

TEST(PipelineBalance, ByProfileGivesTheSlowLayersAStageOfTheirOwn) {
  // Layer times as profile_chain gives them: one wide layer costs about 250x
  // the three narrow ones together (as on this machine; times are the
  // machine's, so the test gives them rather than measuring them).
  torch::nn::Sequential net(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8), torch::nn::Linear(8, 2048),
                            torch::nn::Linear(2048, 2048));
  ChainProfile p;
  p.layers.resize(4);
  for (size_t i = 0; i < 3; ++i) p.layers[i].forward_seconds = p.layers[i].backward_seconds = 10e-6;
  p.layers[3].forward_seconds = 5e-3;
  p.layers[3].backward_seconds = 10e-3;
  EXPECT_EQ(balance_by_profile(net, p, 2), std::vector<int64_t>({3, 1}));
  p.layers.resize(3);
  expect_error([&] { balance_by_profile(net, p, 2); },
               "balance_by_profile: the profile has 3 layers but the model 4; profile this model");
}

TEST(PipelineBalance, ByTimeSplitsTheModelAsItsMeasuredProfileDoes) {
  // Times vary from run to run: what holds whatever they are is a split into
  // the stages asked for, each with a layer to train.
  torch::nn::Sequential net(torch::nn::Linear(8, 8), torch::nn::ReLU(), torch::nn::Linear(8, 8), torch::nn::ReLU());
  for (int64_t stages : {1, 2}) {
    const auto b = balance_by_time(net, torch::randn({64, 8}), stages);
    ASSERT_EQ(static_cast<int64_t>(b.size()), stages);
    EXPECT_EQ(std::accumulate(b.begin(), b.end(), int64_t{0}), 4);
    if (stages == 2) EXPECT_LE(b[0], 2) << "the last ReLU, with nothing to train, is never a stage of its own";
  }
}

// 7 layers; with the balances below, rank 1 of 2 and rank 2 of 3 begin with
// an in-place ReLU on what they receive.
torch::nn::Sequential make_chain() {
  torch::manual_seed(11);
  return torch::nn::Sequential(torch::nn::Linear(20, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                               torch::nn::Tanh(), torch::nn::Linear(64, 32),
                               torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)), torch::nn::Linear(32, 5));
}

constexpr int64_t kBatch = 24;

std::pair<torch::Tensor, torch::Tensor> batch() {
  torch::manual_seed(3);
  return {torch::randn({kBatch, 20}), torch::randint(0, 5, {kBatch})};
}

torch::Tensor cross_entropy(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

// One process, the whole batch at once: the gradients a pipeline must give.
std::vector<torch::Tensor> reference_gradients(double* loss = nullptr) {
  auto net = make_chain();
  auto [x, y] = batch();
  auto l = cross_entropy(net->forward(x), y);
  l.backward();
  if (loss) *loss = l.item<double>();
  std::vector<torch::Tensor> g;
  for (const auto& p : net->parameters()) g.push_back(p.grad().clone());
  return g;
}

class PipelineTest : public testing::Seeded {
 protected:
  void SetUp() override {
    testing::Seeded::SetUp();
    if (!distributed_available()) {
      GTEST_SKIP() << "this build has no c10d Gloo process group (LibTorch's pip wheels ship no gloo "
                      "headers; Debian's libtorch-dev with libgloo-dev has them)";
    }
  }
};

TEST_F(PipelineTest, OneStageIsTheWholeBatchInChunks) {
  WorldInfo solo;
  solo.master_port = 0;
  auto group = std::make_shared<ProcessGroup>(solo);
  Pipeline pipe(make_chain(), group, PipelineOptions().chunks(5));
  auto [x, y] = batch();
  const auto r = pipe.train_step(x, y, cross_entropy);
  double loss = 0;
  const auto reference = reference_gradients(&loss);
  const auto params = pipe.stage()->parameters();
  ASSERT_EQ(params.size(), reference.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_LT(testing::relative_difference(params[i].grad(), reference[i]), 1e-6) << "parameter " << i;
  }
  EXPECT_NEAR(r.loss, loss, 1e-6);
  EXPECT_EQ(r.max_in_flight, 5) << "GPipe holds every chunk before the first backward";
  expect_error([&] { Pipeline(make_chain(), group, PipelineOptions().balance({3, 4})); },
               "balance has 2 entries for 1 ranks");
  expect_error([&] { Pipeline(make_chain(), group, PipelineOptions().balance({6})); },
               "the balance adds up to 6 layers, the model has 7");
  expect_error([] { parse_pipeline_schedule("zigzag"); }, "expected gpipe or 1f1b");
  expect_error([] { parse_pipeline_checkpoint("sometimes"); }, "expected never, except_last or always");
}

// What the workers run, in order: GPipe and 1F1B, then GPipe with every
// chunk but the last checkpointed.
const std::pair<PipelineSchedule, PipelineCheckpoint> kRuns[] = {
    {PipelineSchedule::kGPipe, PipelineCheckpoint::kNever},
    {PipelineSchedule::k1F1B, PipelineCheckpoint::kNever},
    {PipelineSchedule::kGPipe, PipelineCheckpoint::kExceptLast}};
constexpr int kNumRuns = 3;

// The worker: one stage of a pipeline, writing its gradients and counters.
TEST(PipelineWorker, Run) {
  const char* mode = std::getenv("MEMFIT_TEST_WORKER");
  if (mode == nullptr) GTEST_SKIP() << "run by the Pipeline tests as one rank of several";
  const std::string m = mode, out = std::getenv("MEMFIT_TEST_OUT");
  const auto world = world_from_env();
  auto group = std::make_shared<ProcessGroup>(
      world, ProcessGroupOptions().timeout(m == "die" ? std::chrono::seconds(2) : std::chrono::seconds(20)));
  auto [x, y] = batch();
  if (m == "die") {
    Pipeline pipe(make_chain(), group, PipelineOptions().chunks(4));
    if (group->rank() == 1) std::_Exit(3);  // joins, then dies without a word
    try {
      pipe.train_step(x, y, cross_entropy);
    } catch (const c10::Error& e) {
      std::ofstream(out + ".rank0.txt") << e.what_without_backtrace();
      std::_Exit(7);
    }
    std::_Exit(0);
  }
  std::vector<torch::Tensor> result;
  for (const auto& [schedule, checkpoint] : kRuns) {
    // Uneven stages on purpose: rank 0's balance, whatever the others pass.
    std::vector<int64_t> balance = world.world_size == 2 ? std::vector<int64_t>{5, 2}
                                                         : std::vector<int64_t>{2, 3, 2};
    if (world.rank != 0) balance = {};
    Pipeline pipe(make_chain(), group,
                  PipelineOptions().chunks(6).schedule(schedule).balance(balance).checkpoint(checkpoint));
    const int64_t before = memory_allocated(torch::kCPU);
    PeakMeter meter(torch::kCPU);
    const auto r = pipe.train_step(x, y, cross_entropy);
    const int64_t peak = meter.peak() - before;
    for (const auto& p : pipe.stage()->parameters()) result.push_back(p.grad().clone());
    result.push_back(torch::tensor({pipe.first_layer(), r.max_in_flight, peak}));
    result.push_back(torch::tensor({r.loss}, torch::kDouble));
  }
  torch::save(result, out + ".rank" + std::to_string(world.rank) + ".pt");
}

// Parameters of layers [first, first + layers) of the chain, by index into
// its parameter list (Linear layers hold two, the others none).
std::vector<size_t> parameter_indices(int64_t first, int64_t layers) {
  auto net = make_chain();
  std::vector<size_t> out;
  size_t index = 0;
  for (int64_t l = 0; l < static_cast<int64_t>(net->size()); ++l) {
    const size_t count = net[l]->parameters().size();
    for (size_t k = 0; k < count; ++k, ++index) {
      if (l >= first && l < first + layers) out.push_back(index);
    }
  }
  return out;
}

void expect_stages_match_one_process(int stages) {
  const std::string out = ::testing::TempDir() + "memfit_pipe_" + std::to_string(stages) + "_" +
                          std::to_string(::getpid());
  const auto statuses = testing::run_ranks("PipelineWorker.Run", stages, "train", out);
  for (int r = 0; r < stages; ++r) ASSERT_EQ(statuses[r], 0) << "rank " << r;
  double loss = 0;
  const auto reference = reference_gradients(&loss);
  const std::vector<int64_t> balance = stages == 2 ? std::vector<int64_t>{5, 2} : std::vector<int64_t>{2, 3, 2};
  std::vector<int64_t> peaks[kNumRuns];
  for (int r = 0; r < stages; ++r) {
    const auto mine = testing::load_rank(out, r);
    ::unlink((out + ".rank" + std::to_string(r) + ".pt").c_str());
    size_t at = 0;
    int64_t first = 0;
    for (int s = 0; s < r; ++s) first += balance[s];
    const auto indices = parameter_indices(first, balance[r]);
    for (int run = 0; run < kNumRuns; ++run) {
      const char* name = run == 0 ? "GPipe" : run == 1 ? "1F1B" : "GPipe, checkpoint except_last";
      for (size_t k = 0; k < indices.size(); ++k) {
        ASSERT_LT(at, mine.size());
        EXPECT_LT(testing::relative_difference(mine[at], reference[indices[k]]), 1e-6)
            << name << ", rank " << r << ", parameter " << indices[k] << " of the whole model";
        if (run == 2) {
          // Recomputation changes nothing: bitwise GPipe's gradients.
          EXPECT_TRUE(mine[at].equal(mine[k])) << name << ", rank " << r << ", parameter " << indices[k];
        }
        ++at;
      }
      const auto counters = mine.at(at++);
      EXPECT_EQ(counters[0].item<int64_t>(), first) << name << ": rank " << r << "'s stage starts at layer " << first;
      const int64_t expected_in_flight = run == 1 ? std::min<int64_t>(6, stages - r) : 6;
      EXPECT_EQ(counters[1].item<int64_t>(), expected_in_flight)
          << name << ", rank " << r << ": chunks alive at once";
      peaks[run].push_back(counters[2].item<int64_t>());
      EXPECT_NEAR(mine.at(at++).item<double>(), loss, 1e-6) << name << ": every rank gets the batch's loss";
    }
    EXPECT_EQ(at, mine.size());
  }
  // 1F1B's first stage holds fewer chunks' activations than GPipe's, and
  // checkpointed chunks keep only their inputs and outputs: less on the stage
  // with activations between those (of 3 stages, rank 0's ReLU output is
  // the stage's output, which it keeps either way).
  EXPECT_LT(peaks[1][0], peaks[0][0]) << "1F1B's peak on rank 0 is not below GPipe's";
  const int deep = stages == 2 ? 0 : 1;
  EXPECT_LT(peaks[2][deep], peaks[0][deep]) << "checkpointing's peak on rank " << deep << " is not below GPipe's";
}

TEST_F(PipelineTest, TwoStagesGiveTheGradientsOfOneProcess) { expect_stages_match_one_process(2); }

TEST_F(PipelineTest, ThreeStagesGiveTheGradientsOfOneProcess) { expect_stages_match_one_process(3); }

TEST_F(PipelineTest, AStageThatDiesStopsItsNeighbourWithAnErrorNamingIt) {
  const std::string out = ::testing::TempDir() + "memfit_pipe_die_" + std::to_string(::getpid());
  const auto statuses = testing::run_ranks("PipelineWorker.Run", 2, "die", out);
  EXPECT_EQ(statuses[1], 3);
  EXPECT_EQ(statuses[0], 7) << "rank 0 must stop with an error, not hang or succeed";
  const std::string message = testing::read_text(out + ".rank0.txt");
  EXPECT_NE(message.find("rank 0 of 2"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 1"), std::string::npos) << message;
  ::unlink((out + ".rank0.txt").c_str());
}

} // namespace
} // namespace memfit
