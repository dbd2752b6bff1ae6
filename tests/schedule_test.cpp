#include "memfit/checkpoint.h"
#include "memfit/schedule.h"

#include "test_util.h"

#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>

namespace memfit {
namespace {

using testing::Seeded;
using testing::grads_of;

TEST(Schedules, StandardKindsSplitLikeCheckpointSequential) {
  EXPECT_EQ(schedule_none(5).to_string(), "[0,5)");
  EXPECT_EQ(schedule_every(10, 4).to_string(), "[0,4)* [4,8)* [8,10)");
  EXPECT_EQ(schedule_every(8, 4).to_string(), "[0,4)* [4,8)");
  EXPECT_EQ(schedule_uniform(10, 2).to_string(), "[0,5)* [5,10)");
  EXPECT_EQ(schedule_uniform(10, 3).to_string(), "[0,3)* [3,6)* [6,10)");
  EXPECT_EQ(schedule_uniform(3, 5).to_string(), "[0,3)") << "more segments than layers: plain";
  EXPECT_EQ(schedule_sqrt(64).segments.size(), 8u);
  EXPECT_EQ(parse_schedule_kind("optimal"), ScheduleKind::kOptimal);
  EXPECT_THROW(parse_schedule_kind("revolve"), c10::Error);
  EXPECT_THROW(schedule_every(4, 0), c10::Error);
  EXPECT_THROW(schedule_uniform(4, 0), c10::Error);
}

TEST(Schedules, ValidateRejectsGapsAndOverlaps) {
  Schedule gap{{Segment{0, 2, false, {}}, Segment{3, 5, false, {}}}};
  EXPECT_THROW(gap.validate(5), c10::Error);
  Schedule short_cover{{Segment{0, 4, false, {}}}};
  EXPECT_THROW(short_cover.validate(5), c10::Error);
  Schedule bad_inner{{Segment{0, 4, true, {Segment{0, 3, false, {}}}}, Segment{4, 5, false, {}}}};
  EXPECT_THROW(bad_inner.validate(5), c10::Error);
  EXPECT_NO_THROW(schedule_every(10, 3).validate(10));
}

TEST(Simulate, MatchesAHandCountedPlainRun) {
  // x = input/output sizes, kept per layer, forward and backward times.
  ChainCosts c{{4, 4, 4}, {8, 8}, {1, 1}, {2, 2}, {false, false}};
  // Forward keeps 8 + 8; the output's gradient arrives (20); backward of
  // layer 1 frees its 8 and the output's gradient and holds its input's (12),
  // and so on.
  const auto cost = simulate(schedule_none(2), c);
  EXPECT_EQ(cost.peak_bytes, 20);
  EXPECT_DOUBLE_EQ(cost.time, 6.0);
  // By phase: forward holds 16 at its end and peaks there; backward starts
  // from those 16 plus the output's gradient.
  EXPECT_EQ(cost.forward_peak_bytes, 16);
  EXPECT_EQ(cost.held_bytes, 16);
  EXPECT_EQ(cost.backward_peak_bytes, 20);
}

TEST(Simulate, ParameterGradientsAppearAtTheirLayersBackwardAndStay) {
  // Two layers of input 4, keeping 8, gradients of 3 and 5 bytes.
  ChainCosts c{{4, 4, 4}, {8, 8}, {1, 1}, {2, 2}, {false, false}};
  const auto without = simulate(schedule_none(2), c);
  c.gradient = {3, 5};
  const auto plain = simulate(schedule_none(2), c);
  // Plain: forward holds 16, then the output's gradient 4: 20. Layer 1's
  // backward adds its 5 bytes of gradients (25), frees what it kept and the
  // output's gradient... its input's gradient (4): 16 + 5 - 8 - 4 + 4 = 17;
  // layer 0 adds 3 (20): the peak stays at the start of backward.
  EXPECT_EQ(without.peak_bytes, 20);
  EXPECT_EQ(plain.peak_bytes, 25);
  // Checkpointing layer 0 moves its backward after layer 1's: its
  // recomputation (8 kept again) now runs beside layer 1's gradients.
  Schedule s;
  s.segments = {{0, 1, true, {{0, 1, false, {}}}}, {1, 2, false, {}}};
  const auto ck = simulate(s, c);
  c.gradient.clear();
  const auto ck_without = simulate(s, c);
  EXPECT_EQ(ck.backward_peak_bytes - ck_without.backward_peak_bytes, 5 + 3)
      << "layer 0's backward peak sees both layers' gradients";
  EXPECT_THROW((simulate(s, ChainCosts{{4, 4, 4}, {8, 8}, {1, 1}, {2, 2}, {false, false}, {}, {}, {1}})),
               c10::Error);
}

TEST(Simulate, ARecomputationThatStartsWhereALayerLetsItsInputGoKeepsThatInput) {
  // Layer 1 lets its input go when run after layer 0 (kept[1] counts it
  // freed: its own output, less its input). A checkpoint that starts at layer
  // 1 holds that input, so its recomputation keeps x[1] more.
  ChainCosts c{{4, 4, 4, 4}, {4, 0, 4}, {1, 1, 1}, {1, 1, 1}, {false, false, false}};
  Schedule s;
  s.segments = {{0, 1, false, {}}, {1, 3, true, {{1, 3, false, {}}}}};
  const auto plain_before = simulate(schedule_none(3), c);
  const auto before = simulate(s, c);
  c.frees_input = {false, true, false};
  EXPECT_EQ(simulate(schedule_none(3), c).peak_bytes, plain_before.peak_bytes) << "kept[1] says it all";
  // Held 8 (x[1], x[3]) and the output's gradient 4; x[3] is let go and the
  // recomputation keeps 4 + 4 (layer 1, its input now held) + 4: 16, not 12.
  EXPECT_EQ(before.peak_bytes, 12);
  EXPECT_EQ(simulate(s, c).peak_bytes, 16);
  EXPECT_FALSE(c.may_start_checkpoint(1)) << "the solver starts no checkpoint there";
  c.frees_input = {true, false, false};
  EXPECT_THROW(simulate(s, c), c10::Error) << "layer 0's input is the caller's";
}

TEST(Simulate, ByPhaseACheckpointHoldsOnlyItsOutputUntilBackward) {
  ChainCosts c{{1, 10, 10, 10, 10}, {10, 10, 10, 10}, {1, 1, 1, 1}, {1, 1, 1, 1},
               {false, false, false, false}};
  const auto plain = simulate(schedule_none(4), c);
  const auto ck = simulate(schedule_uniform(4, 2), c);  // [0,2)* [2,4)
  EXPECT_EQ(plain.held_bytes, 40);
  EXPECT_EQ(ck.held_bytes, 10 + 20) << "the checkpoint's output, then two plain layers";
  EXPECT_EQ(ck.peak_bytes, std::max(ck.forward_peak_bytes, ck.backward_peak_bytes));
  EXPECT_LT(ck.backward_peak_bytes, plain.backward_peak_bytes);
}

TEST(Simulate, CheckpointingTradesRecomputationForMemory) {
  ChainCosts c{{1, 10, 10, 10, 10}, {10, 10, 10, 10}, {1, 1, 1, 1}, {1, 1, 1, 1},
               {false, false, false, false}};
  const auto plain = simulate(schedule_none(4), c);
  const auto ck = simulate(schedule_uniform(4, 2), c);
  EXPECT_LT(ck.peak_bytes, plain.peak_bytes);
  EXPECT_DOUBLE_EQ(ck.time, plain.time + 2.0) << "the first segment's two forwards again";
}

// Every schedule of [s, t) in the solver's family: the first layer plain, or a
// checkpointed segment [s, e) with e < t, recomputed with any schedule of its
// own, then any schedule of the rest.
void enumerate(int64_t s, int64_t t, const ChainCosts& c, std::vector<std::vector<Segment>>& out) {
  if (s == t) {
    out.push_back({});
    return;
  }
  std::vector<std::vector<Segment>> rest;
  enumerate(s + 1, t, c, rest);
  for (auto& r : rest) {
    std::vector<Segment> v{Segment{s, s + 1, false, {}}};
    v.insert(v.end(), r.begin(), r.end());
    out.push_back(std::move(v));
  }
  if (!c.may_start_checkpoint(s)) return;
  for (int64_t e = s + 1; e < t; ++e) {
    std::vector<std::vector<Segment>> inner, tail;
    enumerate(s, e, c, inner);
    enumerate(e, t, c, tail);
    for (const auto& in : inner) {
      for (const auto& tl : tail) {
        std::vector<Segment> v{Segment{s, e, true, in}};
        v.insert(v.end(), tl.begin(), tl.end());
        out.push_back(std::move(v));
      }
    }
  }
}

ChainCosts random_chain(std::mt19937& rng, int64_t n, bool homogeneous) {
  std::uniform_int_distribution<int64_t> size(1, 12), kept(1, 30);
  std::uniform_real_distribution<double> time(0.5, 4.0);
  std::bernoulli_distribution inplace(0.15), frees(0.25);
  ChainCosts c;
  const int64_t hx = size(rng), hk = kept(rng);
  const double hf = time(rng);
  for (int64_t i = 0; i <= n; ++i) c.x.push_back(homogeneous ? hx : size(rng));
  for (int64_t i = 0; i < n; ++i) {
    c.kept.push_back(homogeneous ? hk : kept(rng));
    c.forward.push_back(homogeneous ? hf : time(rng));
    c.backward.push_back(homogeneous ? 2 * hf : time(rng));
    c.in_place.push_back(!homogeneous && inplace(rng));
    c.forward_overhead.push_back(homogeneous ? 0 : size(rng) / 3);
    c.backward_overhead.push_back(homogeneous ? 0 : size(rng) / 2);
    c.gradient.push_back(homogeneous ? 0 : size(rng) / 3);  // some layers without parameters
    c.frees_input.push_back(i > 0 && !homogeneous && frees(rng));
  }
  return c;
}

TEST(OptimalSolver, EqualsBruteForceOnRandomChainsUpToTenLayers) {
  std::mt19937 rng(2024);
  int compared = 0;
  for (int64_t n = 1; n <= 10; ++n) {
    const int trials = n <= 7 ? 8 : (n <= 9 ? 3 : 1);
    for (int trial = 0; trial < trials; ++trial) {
      const auto c = random_chain(rng, n, /*homogeneous=*/trial % 3 == 2);
      std::vector<std::vector<Segment>> all;
      enumerate(0, n, c, all);
      std::vector<ScheduleCost> costs;
      for (const auto& segs : all) costs.push_back(simulate(Schedule{segs}, c));
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
      for (const auto& k : costs) {
        lo = std::min(lo, k.peak_bytes);
        hi = std::max(hi, k.peak_bytes);
      }
      for (int64_t budget = lo - 2; budget <= hi + 1; ++budget) {
        if (budget <= 0) continue;
        double best = std::numeric_limits<double>::infinity();
        for (const auto& k : costs) {
          if (k.peak_bytes <= budget) best = std::min(best, k.time);
        }
        // Budgets of at most `slots` bytes count memory in single bytes: exact.
        const auto options = SolverOptions().slots(budget);
        if (best == std::numeric_limits<double>::infinity()) {
          EXPECT_THROW(solve_optimal(c, budget, options), c10::Error) << "n=" << n << " budget=" << budget;
          continue;
        }
        const auto s = solve_optimal(c, budget, options);
        const auto got = simulate(s, c);
        EXPECT_LE(got.peak_bytes, budget) << "n=" << n << " " << s.to_string();
        EXPECT_NEAR(got.time, best, 1e-9) << "n=" << n << " budget=" << budget << " " << s.to_string();
        ++compared;
      }
      EXPECT_EQ(min_budget(c, SolverOptions().slots(hi)), lo) << "n=" << n;
    }
  }
  EXPECT_GT(compared, 300);
}

TEST(OptimalSolver, NeverSlowerThanAnyUniformSplitAtItsBudget) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t n = 12 + trial;
    auto c = random_chain(rng, n, trial % 2 == 0);
    std::fill(c.in_place.begin(), c.in_place.end(), false);
    std::fill(c.frees_input.begin(), c.frees_input.end(), false);  // uniform splits may start there
    for (int64_t k = 2; k <= n; ++k) {
      const auto uniform = simulate(schedule_uniform(n, k), c);
      const auto best = simulate(solve_optimal(c, uniform.peak_bytes, SolverOptions().slots(uniform.peak_bytes)), c);
      EXPECT_LE(best.time, uniform.time + 1e-9) << "n=" << n << " k=" << k;
      EXPECT_LE(best.peak_bytes, uniform.peak_bytes);
    }
  }
}

TEST(OptimalSolver, TooSmallABudgetNamesTheSmallestThatWorks) {
  ChainCosts c{{100, 100, 100, 100}, {400, 400, 400}, {1, 1, 1}, {1, 1, 1}, {false, false, false}};
  const int64_t least = min_budget(c);
  EXPECT_NO_THROW(solve_optimal(c, least));
  try {
    solve_optimal(c, least - 1);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.msg()).find(std::to_string(least) + " bytes"), std::string::npos)
        << e.msg();
  }
  EXPECT_THROW(solve_optimal(c, 0), c10::Error);
}

TEST(OptimalSolver, CoarseSlotsStayWithinTheBudget) {
  std::mt19937 rng(99);
  auto c = random_chain(rng, 40, false);
  // Sizes without a common factor: memory is counted in coarse units.
  std::uniform_int_distribution<int64_t> jitter(0, 999);
  for (auto& v : c.x) v = v * 1000 + jitter(rng);
  for (auto& v : c.kept) v = v * 1000 + jitter(rng);
  c.x[0] = c.x[0] | 1;  // odd, so the greatest common divisor is small
  const int64_t plain = simulate(schedule_none(40), c).peak_bytes;
  const int64_t least = min_budget(c, SolverOptions().slots(400));
  for (double f : {0.9, 0.6, 0.4}) {
    const int64_t budget = std::max<int64_t>(least, static_cast<int64_t>(f * plain));
    const auto s = solve_optimal(c, budget, SolverOptions().slots(100));
    EXPECT_LE(simulate(s, c).peak_bytes, budget) << s.to_string();
  }
}

TEST(OptimalSolver, TheLeastMemoryScheduleExistsWhereParameterGradientsDwarfTheActivations) {
  // 16 layers of 8,195-byte activations, every other one with 263,171 bytes
  // of parameter gradients (a Linear(256, 256) at a batch of 8; odd sizes,
  // counted in coarse units): each rounds up, and before, the plain schedule
  // no longer fitted its own exact peak in units (an internal assert).
  const int64_t n = 16;
  ChainCosts c;
  c.x.assign(n + 1, 8195);
  c.kept.assign(n, 8195);
  c.forward.assign(n, 1.0);
  c.backward.assign(n, 2.0);
  c.in_place.assign(n, false);
  c.gradient.assign(n, 0);
  for (int64_t i = 0; i < n; i += 2) c.gradient[static_cast<size_t>(i)] = 263171;
  const int64_t plain = simulate(schedule_none(n), c).peak_bytes;
  for (int64_t slots : {200, 1000}) {
    const auto least = schedule_least_memory(c, SolverOptions().slots(slots));
    EXPECT_LE(simulate(least, c).peak_bytes, plain) << slots << " slots: " << least.to_string();
    EXPECT_EQ(min_budget(c, SolverOptions().slots(slots)), simulate(least, c).peak_bytes);
  }
}

// A block of the kind the benchmarks use: Linear then Tanh, one Sequential element.
struct MlpBlockImpl : torch::nn::Module {
  explicit MlpBlockImpl(int64_t w) : lin(register_module("lin", torch::nn::Linear(w, w))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(lin(x)); }
  torch::nn::Linear lin;
};
TORCH_MODULE(MlpBlock);

torch::nn::Sequential mlp_blocks(int64_t n, int64_t w) {
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < n; ++i) seq->push_back(MlpBlock(w));
  return seq;
}

class CheckpointedSequentialTest : public Seeded {};

TEST_F(CheckpointedSequentialTest, EverySchedulesGradientsEqualThePlainRunBitwise) {
  auto seq = mlp_blocks(12, 32);
  auto params = seq->parameters();
  auto x = torch::randn({16, 32}, torch::requires_grad());
  seq->forward(x).pow(2).sum().backward();
  const auto plain = grads_of(params);
  const auto plain_x = x.grad().clone();
  const int64_t act = 16 * 32 * 4;
  for (auto options : {CheckpointedSequentialOptions().kind(ScheduleKind::kNone),
                       CheckpointedSequentialOptions().kind(ScheduleKind::kEvery).k(3),
                       CheckpointedSequentialOptions().kind(ScheduleKind::kUniform).k(4),
                       CheckpointedSequentialOptions().kind(ScheduleKind::kSqrt),
                       CheckpointedSequentialOptions().kind(ScheduleKind::kOptimal).budget(10 * act)}) {
    testing::clear_grads(params);
    testing::clear_grads({x});
    CheckpointedSequential model(seq, options);
    model->forward(x).pow(2).sum().backward();
    const auto got = grads_of(params);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(torch::equal(got[i], plain[i])) << model->schedule().to_string();
    }
    EXPECT_TRUE(torch::equal(x.grad(), plain_x)) << model->schedule().to_string();
  }
}

// A checkpointed segment with nothing that needs a gradient (a Flatten of
// the data, as the MLP of `memfit train` starts) runs as it is: `every:1`
// used to end its backward with "none of output has requires_grad".
TEST_F(CheckpointedSequentialTest, ASegmentThatNeedsNoGradientRunsPlainly) {
  torch::nn::Sequential seq(torch::nn::Flatten(), torch::nn::Linear(16, 8), torch::nn::Tanh(), torch::nn::Linear(8, 4));
  auto params = seq->parameters();
  const auto x = torch::randn({4, 4, 4});
  seq->forward(x).pow(2).sum().backward();
  const auto plain = grads_of(params);
  testing::clear_grads(params);
  CheckpointedSequential model(seq, CheckpointedSequentialOptions().kind(ScheduleKind::kEvery).k(1));
  EXPECT_EQ(model->schedule().to_string(), "[0,1)* [1,2)* [2,3)* [3,4)");
  model->forward(x).pow(2).sum().backward();
  const auto got = grads_of(params);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], plain[i])) << "parameter " << i;
}

// With the checkpoints' inputs on the host, the first checkpoint still keeps
// the chain's input on the device, where its caller holds it: a host copy
// would come back beside it, one input more at that recomputation.
TEST_F(CheckpointedSequentialTest, TheChainsInputStaysOnTheDeviceWithItsCheckpointsInputsOnTheHost) {
  std::vector<int64_t> at_recompute;  // memory when layer 0 runs with grad: only when recomputed
  for (Offload where : {Offload::kNone, Offload::kHost}) {
    torch::manual_seed(3);
    torch::nn::Sequential seq;
    seq->push_back(torch::nn::Functional([&at_recompute](const torch::Tensor& t) {
      if (torch::GradMode::is_enabled()) at_recompute.push_back(memory_allocated());
      return t * 2;
    }));
    for (int i = 0; i < 3; ++i) {
      seq->push_back(torch::nn::Linear(64, 64));
      seq->push_back(torch::nn::Functional(torch::tanh));
    }
    CheckpointedSequential model(seq, CheckpointedSequentialOptions().kind(ScheduleKind::kEvery).k(2).checkpoint(
                                          CheckpointOptions().offload(where)));
    const int64_t before = memory_allocated();
    auto x = torch::randn({256, 64}).requires_grad_();
    model->forward(x).sum().backward();
    at_recompute.back() -= before;
  }
  ASSERT_EQ(at_recompute.size(), 2u);
  EXPECT_EQ(at_recompute[1], at_recompute[0]);
}

TEST_F(CheckpointedSequentialTest, CheckpointsNeverStartAtAnInPlaceLayer) {
  torch::nn::Sequential seq;
  for (int i = 0; i < 4; ++i) {
    seq->push_back(torch::nn::Linear(8, 8));
    seq->push_back(torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)));
  }
  CheckpointedSequential model(seq, CheckpointedSequentialOptions().kind(ScheduleKind::kEvery).k(3));
  // Layers 3 and 5 are in-place ReLUs: [0,3)* [3,6)* [6,8) becomes [0,4)* [4,6)* [6,8).
  EXPECT_EQ(model->schedule().to_string(), "[0,4)* [4,6)* [6,8)");
  auto x = torch::randn({4, 8});
  EXPECT_NO_THROW(model->forward(x).sum().backward());
}

TEST(AvoidInPlaceStarts, MovesCheckpointStartsAndChecksTheFlags) {
  Schedule whole;
  whole.segments.push_back({0, 3, true, {{0, 3, false, {}}}});
  EXPECT_EQ(avoid_in_place_starts(whole, {true, true, false}).to_string(), "[0,2) [2,3)*");
  EXPECT_EQ(avoid_in_place_starts(whole, {true, true, true}).to_string(), "[0,3)") << "no checkpoint left";
  EXPECT_EQ(avoid_in_place_starts(whole, {false, true, true}).to_string(), "[0,3)*") << "only starts move";
  testing::expect_error([&] { avoid_in_place_starts(whole, {true}); },
                        "1 in-place flags for a schedule of 3 layers; give one per layer");
}

// The extra bytes a forward and backward of `model` needs for activations and
// their gradients alone: the parameters are frozen and the input requires grad.
int64_t activation_peak(const std::function<torch::Tensor(const torch::Tensor&)>& model,
                        const std::vector<torch::Tensor>& params, const torch::Tensor& input) {
  for (const auto& p : params) const_cast<torch::Tensor&>(p).requires_grad_(false);
  auto x = input.detach().requires_grad_(true);
  int64_t peak = 0;
  {
    PeakMeter meter;
    model(x).sum().backward();
    peak = meter.peak_delta();
  }
  for (const auto& p : params) const_cast<torch::Tensor&>(p).requires_grad_(true);
  return peak;
}

TEST_F(CheckpointedSequentialTest, SqrtScheduleCutsMeasuredActivationMemoryAsPromised) {
  const int64_t n = 64, w = 128, batch = 64;
  auto seq = mlp_blocks(n, w);
  auto params = seq->parameters();
  auto x = torch::randn({batch, w});
  const int64_t plain = activation_peak([&](const torch::Tensor& in) { return seq->forward(in); }, params, x);
  CheckpointedSequential sqrt_model(seq, CheckpointedSequentialOptions().kind(ScheduleKind::kSqrt));
  const int64_t ck = activation_peak([&](const torch::Tensor& in) { return sqrt_model->forward(in); }, params, x);
  const int64_t act = batch * w * 4;
  EXPECT_GE(plain, n * act) << "plain keeps one activation per block";
  EXPECT_LE(double(ck), 2.5 * std::sqrt(double(n)) / double(n) * double(plain))
      << "sqrt(n): " << ck << " of " << plain;
}

TEST_F(CheckpointedSequentialTest, OptimalSchedulesMeasuredPeakNeverExceedsTheModel) {
  const int64_t n = 24, w = 128, batch = 64;
  auto seq = mlp_blocks(n, w);
  auto params = seq->parameters();
  auto x = torch::randn({batch, w});
  const int64_t act = batch * w * 4;
  for (const auto& p : params) p.requires_grad_(false);
  auto costs = costs_from_profile(profile_chain(seq, x.detach().requires_grad_(true)));
  for (const auto& p : params) p.requires_grad_(true);
  // Equal blocks take equal times: measured times would let timing noise pick
  // the schedule, and so what this test checks.
  std::fill(costs.forward.begin(), costs.forward.end(), 1e-3);
  std::fill(costs.backward.begin(), costs.backward.end(), 2e-3);
  for (int64_t budget_acts : {16, 12, 10, 8}) {
    CheckpointedSequential model(
        seq, CheckpointedSequentialOptions().kind(ScheduleKind::kOptimal).budget(budget_acts * act));
    model->set_schedule(solve_optimal(costs, budget_acts * act));
    const int64_t predicted = simulate(model->schedule(), costs).peak_bytes;
    EXPECT_LE(predicted, budget_acts * act);
    const int64_t peak = activation_peak([&](const torch::Tensor& in) { return model->forward(in); }, params, x);
    // Never above the model (but for the scalar loss and its gradient), and
    // below it by at most one activation: the model does not see that sum()'s
    // gradient reaches the last layer as a broadcast view of one element.
    EXPECT_LE(peak, predicted + 8) << model->schedule().to_string();
    EXPECT_GE(peak, predicted - act) << model->schedule().to_string();
  }
}

TEST_F(CheckpointedSequentialTest, LayersThatLetTheirInputGoAreModelledAsTheChainRunsThem) {
  // Linear and Tanh as layers of their own: each Tanh lets the Linear's
  // output go, so a pair keeps one activation, not the two that each layer
  // profiled alone returns.
  const int64_t pairs = 12, w = 128, batch = 64, act = batch * w * 4;
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < pairs; ++i) {
    seq->push_back(torch::nn::Linear(w, w));
    seq->push_back(torch::nn::Tanh());
  }
  auto params = seq->parameters();
  auto x = torch::randn({batch, w});
  for (const auto& p : params) p.requires_grad_(false);
  auto costs = costs_from_profile(profile_chain(seq, x.detach().requires_grad_(true)));
  for (const auto& p : params) p.requires_grad_(true);
  std::fill(costs.forward.begin(), costs.forward.end(), 1e-3);
  std::fill(costs.backward.begin(), costs.backward.end(), 2e-3);
  const int64_t plain = activation_peak([&](const torch::Tensor& in) { return seq->forward(in); }, params, x);
  // A budget of the measured plain peak and one activation (the model's
  // margin, as below) fits the plain chain.
  for (int64_t budget : {plain + act, 10 * act, 8 * act}) {
    CheckpointedSequential model(seq, CheckpointedSequentialOptions().kind(ScheduleKind::kOptimal).budget(budget));
    model->set_schedule(solve_optimal(costs, budget));
    if (budget == plain + act) {
      EXPECT_EQ(model->schedule().to_string(), schedule_none(2 * pairs).to_string())
          << "a chain that fits plainly runs plainly";
    }
    const int64_t predicted = simulate(model->schedule(), costs).peak_bytes;
    EXPECT_LE(predicted, budget);
    const int64_t peak = activation_peak([&](const torch::Tensor& in) { return model->forward(in); }, params, x);
    EXPECT_LE(peak, predicted + 8) << model->schedule().to_string();
    EXPECT_GE(peak, predicted - act) << model->schedule().to_string();
  }
}

TEST_F(CheckpointedSequentialTest, OptimalWithAnImpossibleBudgetIsAClearError) {
  auto seq = mlp_blocks(8, 16);
  CheckpointedSequential model(seq, CheckpointedSequentialOptions().kind(ScheduleKind::kOptimal).budget(64));
  try {
    model->forward(torch::randn({8, 16})).sum().backward();
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.msg()).find("the most frugal schedule needs"), std::string::npos) << e.msg();
  }
  EXPECT_THROW(CheckpointedSequential(seq, CheckpointedSequentialOptions().kind(ScheduleKind::kOptimal)),
               c10::Error)
      << "optimal needs a budget";
}

TEST_F(CheckpointedSequentialTest, NoGradForwardRunsPlainly) {
  auto seq = mlp_blocks(4, 8);
  CheckpointedSequential model(seq, CheckpointedSequentialOptions().kind(ScheduleKind::kSqrt));
  torch::NoGradGuard no_grad;
  auto x = torch::randn({2, 8});
  EXPECT_TRUE(torch::equal(model->forward(x), seq->forward(x)));
}

} // namespace
} // namespace memfit
