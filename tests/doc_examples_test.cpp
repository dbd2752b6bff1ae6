// Every `Example:` in the public headers, compiled and run as written
// (assert → EXPECT). When a header's example changes, change it here too.

#include "memfit/checkpoint.h"
#include "memfit/data.h"
#include "memfit/distributed.h"
#include "memfit/environment.h"
#include "memfit/pipeline.h"
#include "memfit/freeze.h"
#include "memfit/state.h"
#include "memfit/memory.h"
#include "memfit/profile.h"
#include "memfit/schedule.h"
#include "memfit/stream.h"
#include "memfit/models.h"
#include "memfit/optim.h"
#include "memfit/module_plan.h"
#include "memfit/plan.h"
#include "memfit/precision.h"
#include "memfit/trainer.h"

#include "test_util.h"

#include <filesystem>
#include <unistd.h>
#include <iostream>
#include <thread>
#include <sstream>

namespace doc_batch {
struct Pair { torch::Tensor tokens, mask; };
} // namespace doc_batch
using doc_batch::Pair;
template <> struct memfit::BatchTraits<Pair> {
  static int64_t size(const Pair& b) { return b.tokens.size(0); }
  static Pair slice(const Pair& b, int64_t start, int64_t length) {
    return {b.tokens.narrow(0, start, length), b.mask.narrow(0, start, length)};
  }
  static Pair to(const Pair& b, const torch::Device& device) {
    return {memfit::to_device(b.tokens, device), memfit::to_device(b.mask, device)};
  }
};

namespace memfit {
namespace {

class DocExamples : public testing::Seeded {};

TEST_F(DocExamples, PrecisionHeader) {
  EXPECT_EQ(memfit::parse_precision("bf16"), memfit::Precision::kBF16);
  {  // AutocastGuard
    torch::Tensor y;
    {
      memfit::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      y = torch::mm(torch::ones({2, 2}), torch::ones({2, 2}));  // bfloat16
    }
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  }
  {  // GradScaler
    auto model = torch::nn::Linear(4, 1);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    memfit::GradScaler scaler(memfit::GradScalerOptions().init_scale(1024.));
    auto loss = model->forward(torch::ones({2, 4})).sum();
    scaler.scale(loss).backward();
    scaler.unscale_(opt);  // gradients are now unscaled: clip them here
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    scaler.step(opt);
    scaler.update();
  }
  {  // ScaledStep
    memfit::ScaledStep r;
    bool skipped = r.found_inf.defined() ? r.found_inf.item<double>() != 0 : !r.stepped;
    EXPECT_TRUE(skipped);
  }
  {  // GradScaler::step_async
    auto lin = torch::nn::Linear(4, 2);
    memfit::optim::Adam adam(lin->parameters());
    memfit::GradScaler scaler;
    scaler.scale(lin(torch::ones({3, 4})).sum()).backward();
    const auto r = scaler.step_async(adam);  // fused (LibTorch 2.4+): nothing read yet
    scaler.update();
    EXPECT_EQ(r.found_inf.defined(), memfit::optim::has_fused_kernels(torch::kCPU));
    EXPECT_TRUE(r.stepped);
  }
  {  // MasterWeights
    auto model = torch::nn::Linear(4, 2);
    memfit::MasterWeights master(model->parameters());
    torch::optim::SGD opt(master.master_parameters(), torch::optim::SGDOptions(0.1));
    memfit::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
    model->forward(torch::ones({3, 4})).sum().backward();
    master.grads_to_master();
    opt.step();
    master.master_to_model();
    EXPECT_EQ(model->weight.scalar_type(), torch::kBFloat16);
  }
}

TEST_F(DocExamples, OptimHeader) {
  {  // SGD
    auto lin = torch::nn::Linear(4, 2);
    memfit::optim::SGD sgd(lin->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    lin(torch::ones({3, 4})).sum().backward();
    sgd.step();
  }
  {  // Adam
    auto lin = torch::nn::Linear(4, 2);
    memfit::optim::Adam adam(lin->parameters(), torch::optim::AdamOptions(1e-3).amsgrad(true));
    lin(torch::ones({3, 4})).sum().backward();
    adam.step();
  }
  {  // AdamW
    auto lin = torch::nn::Linear(4, 2);
    memfit::optim::AdamW adamw(lin->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
    lin(torch::ones({3, 4})).sum().backward();
    adamw.step();
  }
  {  // is_transactional
    auto lin = torch::nn::Linear(4, 2);
    memfit::optim::Adam adam(lin->parameters());
    torch::optim::Adam plain(lin->parameters());
    EXPECT_TRUE(memfit::optim::is_transactional(adam) && !memfit::optim::is_transactional(plain));
  }
  {  // lazy_state_bytes
    auto lin = torch::nn::Linear(4, 2);  // 10 parameters
    memfit::optim::Adam adam(lin->parameters());
    EXPECT_EQ(memfit::optim::lazy_state_bytes(adam), 2 * 10 * 4);
  }
  {  // state_type_name
    auto lin = torch::nn::Linear(4, 2);
    memfit::optim::Adam adam(lin->parameters());
    EXPECT_EQ(memfit::optim::state_type_name(adam), "torch::optim::Adam");
  }
  {  // kernel_name, parse_kernel, has_fused_kernels
    EXPECT_EQ(std::string(memfit::optim::kernel_name(memfit::optim::Kernel::kFused)), "fused");
    EXPECT_EQ(memfit::optim::parse_kernel("loop"), memfit::optim::Kernel::kLoop);
    bool fused = memfit::optim::has_fused_kernels(torch::kCPU);  // false on LibTorch 1.13
    EXPECT_EQ(fused, TORCH_VERSION_MAJOR >= 2);
  }
  {  // KernelChoice::step_unscaling
    auto lin = torch::nn::Linear(4, 2);
    memfit::optim::SGD sgd(lin->parameters(), torch::optim::SGDOptions(0.1));
    (lin(torch::ones({3, 4})).sum() * 1024).backward();
    if (sgd.can_unscale_in_kernel()) sgd.step_unscaling(torch::full({}, 1024.f), torch::zeros({1}));
    EXPECT_EQ(sgd.can_unscale_in_kernel(), memfit::optim::has_fused_kernels(torch::kCPU));
  }
  {  // KernelChoice::steps_to_host
    auto lin = torch::nn::Linear(4, 2);
    memfit::optim::Adam adam(lin->parameters());
    adam.steps_to_host();  // nothing on the device: a no-op
    EXPECT_TRUE(adam.state().empty());
  }
  {  // KernelChoice
    auto lin = torch::nn::Linear(4, 2);
    memfit::optim::Adam adam(lin->parameters(), torch::optim::AdamOptions(1e-3), memfit::optim::Kernel::kLoop);
    lin(torch::ones({3, 4})).sum().backward();
    adam.step();
    EXPECT_EQ(adam.kernel_ran(), memfit::optim::Kernel::kLoop);
  }
  {  // kernel_ran
    auto lin = torch::nn::Linear(4, 2);
    torch::optim::SGD plain(lin->parameters(), torch::optim::SGDOptions(0.1));
    EXPECT_EQ(memfit::optim::kernel_ran(plain), "libtorch");
  }
}

TEST_F(DocExamples, RecoveryFromOutOfMemory) {
  {  // AllocationFault
    int64_t made = 0;
    {
      memfit::AllocationFault count(0);
      auto a = torch::empty({4}), b = torch::empty({4});
      made = count.allocations();
    }
    memfit::AllocationFault fail(made);  // the last of them throws
    bool thrown = false;
    try { auto a = torch::empty({4}), b = torch::empty({4}); } catch (const c10::OutOfMemoryError&) { thrown = true; }
    EXPECT_TRUE(made == 2 && thrown);
  }
  {  // parse_on_out_of_memory
    EXPECT_EQ(memfit::parse_on_out_of_memory("replan"), memfit::OnOutOfMemory::kReplan);
  }
  {  // more_micro_batches
    auto policy = memfit::more_micro_batches(*memfit::make_mlp(), false);
    memfit::OutOfMemoryEvent e;
    e.examples = 64;
    EXPECT_EQ(policy(e)->micro_batch_size, 32);
  }
  {  // GradScaler::discard_step
    memfit::GradScaler scaler;
    scaler.discard_step();  // nothing recorded yet: a no-op
  }
}

TEST_F(DocExamples, MemoryHeader) {
  {  // memory_allocated
    auto before = memfit::memory_allocated(torch::kCPU);
    auto t = torch::empty({256}, torch::kFloat32);
    EXPECT_EQ(memfit::memory_allocated(torch::kCPU) - before, 1024);
  }
  {  // max_memory_allocated
    memfit::reset_peak_memory_stats(torch::kCPU);
    const auto base = memfit::memory_allocated();
    { auto t = torch::empty({1024}); }
    auto peak = memfit::max_memory_allocated(torch::kCPU);
    EXPECT_GE(peak - base, 4096);
  }
  {  // reset_peak_memory_stats
    memfit::reset_peak_memory_stats(torch::kCPU);
    EXPECT_EQ(memfit::max_memory_allocated(), memfit::memory_allocated());
  }
  memfit::empty_cache(torch::kCPU);
  {  // BudgetGuard
    {
      memfit::BudgetGuard budget(torch::kCPU, memfit::memory_allocated() + (1 << 20));
      bool thrown = false;
      try { torch::empty({1 << 20}); } catch (const c10::OutOfMemoryError&) { thrown = true; }
      EXPECT_TRUE(thrown);
    }
    EXPECT_EQ(memfit::memory_budget(torch::kCPU), 0);
  }
  {  // set_memory_budget
    memfit::set_memory_budget(torch::kCPU, memfit::memory_allocated() + (1 << 20));
    bool thrown = false;
    try { torch::empty({1 << 20}); } catch (const c10::OutOfMemoryError&) { thrown = true; }
    memfit::set_memory_budget(torch::kCPU, 0);
    EXPECT_TRUE(thrown);
  }
  EXPECT_EQ(memfit::memory_budget(torch::kCPU), 0);
  {  // storage_bytes
    auto t = torch::zeros({10});
    EXPECT_EQ(memfit::storage_bytes({t, t.view({2, 5})}), 40);
  }
  {  // UntrackedGuard
    auto before = memfit::memory_allocated();
    torch::Tensor dataset;
    { memfit::UntrackedGuard host; dataset = torch::zeros({1000}); }
    EXPECT_EQ(memfit::memory_allocated(), before);
  }
  {  // PeakMeter
    memfit::PeakMeter meter;
    { auto t = torch::empty({1024}); }
    EXPECT_EQ(meter.peak_delta(), 4096);
  }
  {  // release_failed_backward
    auto w = torch::ones({4, 4}, torch::requires_grad());
    const int64_t before = memfit::memory_allocated();
    try {
      auto x = torch::ones({8, 4});
      auto loss = (x.mm(w).relu() + x.mm(w).sigmoid()).sum();  // two branches
      memfit::AllocationFault fail(2);
      loss.backward();
    } catch (const c10::OutOfMemoryError&) {
    }
    memfit::release_failed_backward();
    w.mutable_grad() = torch::Tensor();
    EXPECT_EQ(memfit::memory_allocated(), before);
  }
  {  // PeakMeter::needed
    memfit::PeakMeter meter;
    try {
      memfit::BudgetGuard tight(torch::kCPU, memfit::memory_allocated() + 1024);
      auto t = torch::empty({1024});  // 4096 bytes: refused
    } catch (const c10::OutOfMemoryError&) {
    }
    EXPECT_EQ(meter.needed(), meter.start() + 4096);
  }
  {  // optimizer_state_bytes
    auto w = torch::ones({4}, torch::requires_grad());
    torch::optim::Adam adam({w});
    w.sum().backward(); adam.step();
    EXPECT_EQ(memfit::optimizer_state_bytes(adam), 2 * 16);
  }
  {  // breakdown_step
    torch::nn::Linear lin(4, 2);
    torch::optim::SGD sgd(lin->parameters(), 0.1);
    memfit::PeakMeter meter;
    lin(torch::ones({8, 4})).sum().backward(); sgd.step();
    auto m = memfit::breakdown_step(meter.peak(), lin->parameters(), lin->buffers(), sgd);
    std::string table = m.table();
    EXPECT_FALSE(table.empty());
  }
  EXPECT_EQ(memfit::parse_memory_size("512MiB"), 512LL << 20);
  EXPECT_EQ(memfit::parse_memory_size("1.5GB"), 1500000000LL);
  EXPECT_EQ(memfit::format_bytes(20 << 20), "20.00 MiB");
}

TEST_F(DocExamples, ModelsHeader) {
  EXPECT_EQ(memfit::parse_model_kind("resnet"), memfit::ModelKind::kResNet);
  EXPECT_EQ(memfit::to_string(memfit::ModelKind::kMlp), "mlp");
  {
    auto mlp = memfit::make_mlp(memfit::ModelOptions().width(64).depth(1));
    auto logits = mlp->forward(torch::zeros({2, 1, 28, 28}));
    EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 10}));
  }
  {
    auto net = memfit::make_resnet(memfit::ModelOptions().width(8).depth(1));
    auto logits = net->forward(torch::zeros({2, 1, 28, 28}));
    EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 10}));
  }
  {
    auto gpt = memfit::make_gpt(memfit::ModelOptions().num_classes(50).width(32).depth(2).heads(2).context(16));
    auto logits = gpt->forward(torch::zeros({2, 16}, torch::kLong));  // [2, 16, 50]
    EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 16, 50}));
  }
  auto net = memfit::make_model(memfit::ModelKind::kMlp);
  EXPECT_FALSE(net.is_empty());
}

namespace doc_selective {
struct BlockImpl : torch::nn::Module, memfit::SelectivelyRecomputed {
  BlockImpl() : fc(register_module("fc", torch::nn::Linear(8, 8))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto core = [](const torch::Tensor& h) { return torch::softmax(h, -1); };
    return fc(selective_ && is_training() ? memfit::checkpoint(core, x) : core(x));
  }
  void set_selective_recompute(bool enabled) override { selective_ = enabled; }
  bool selective_recompute() const override { return selective_; }
  torch::nn::Linear fc;
  bool selective_ = false;
};
} // namespace doc_selective

TEST_F(DocExamples, SelectiveRecomputation) {
  {  // SelectivelyRecomputed
    auto block = std::make_shared<doc_selective::BlockImpl>();
    EXPECT_TRUE(memfit::set_selective_recompute(*block, true) == 1 && memfit::selective_recompute(*block));
    block->forward(torch::randn({2, 8}, torch::requires_grad())).sum().backward();  // the recomputed path runs
  }
  {  // set_selective_recompute, selective_recompute
    auto gpt = memfit::make_gpt(memfit::ModelOptions().num_classes(50).width(32).depth(2).heads(2).context(16));
    EXPECT_TRUE(memfit::set_selective_recompute(*gpt, true) == 2 && memfit::selective_recompute(*gpt));
    EXPECT_FALSE(memfit::selective_recompute(*memfit::make_mlp()));
  }
  {  // SelectiveRecomputeGuard
    auto gpt = memfit::make_gpt(memfit::ModelOptions().num_classes(50).width(32).depth(2).heads(2).context(16));
    {
      memfit::SelectiveRecomputeGuard on(*gpt, true);
      EXPECT_TRUE(on.parts() == 2 && memfit::selective_recompute(*gpt));
    }
    EXPECT_FALSE(memfit::selective_recompute(*gpt));
  }
}

TEST_F(DocExamples, TextData) {
  if (!std::filesystem::exists(memfit::JargonOptions().path())) {
    GTEST_SKIP() << "Debian's jargon-text is not installed";
  }
  auto corpus = memfit::load_jargon_file();
  assert(corpus.decode(corpus.encode("hacker")) == "hacker");
  EXPECT_EQ(corpus.decode(corpus.encode("hacker")), "hacker");
  auto train = memfit::text_windows(corpus, 64, memfit::Split::kTrain);
  // train.images[i][j + 1] == train.labels[i][j]
  EXPECT_EQ(train.images[3][5].item<int64_t>(), train.labels[3][4].item<int64_t>());
}

TEST_F(DocExamples, CheckpointHeader) {
  {
    torch::nn::Linear lin(8, 8);
    auto x = torch::randn({4, 8});
    auto outs = memfit::checkpoint(
        [&](const std::vector<torch::Tensor>& in) {
          return std::vector<torch::Tensor>{torch::relu(lin(in[0]))};
        },
        {x});
    outs[0].sum().backward();
    EXPECT_TRUE(lin->weight.grad().defined());
  }
  {
    torch::nn::Linear lin(8, 8);
    auto y = memfit::checkpoint([&](const torch::Tensor& x) { return torch::tanh(lin(x)); },
                                torch::randn({4, 8}));
    y.sum().backward();
    EXPECT_TRUE(lin->weight.grad().defined());
  }
  {
    torch::nn::Sequential block(torch::nn::Linear(8, 8), torch::nn::ReLU());
    auto y = memfit::checkpoint(block, torch::randn({4, 8}));
    y.sum().backward();
  }
  {
    torch::nn::Sequential seq;
    for (int i = 0; i < 10; ++i) seq->push_back(torch::nn::Linear(8, 8));
    auto y = memfit::checkpoint_sequential(seq, 2, torch::randn({4, 8}));
    y.sum().backward();
  }
}

TEST_F(DocExamples, ProfileAndScheduleHeaders) {
  {  // avoid_in_place_starts
    memfit::Schedule s;
    s.segments.push_back({0, 3, true, {{0, 3, false, {}}}});
    EXPECT_EQ(memfit::avoid_in_place_starts(s, {true, false, false}).to_string(), "[0,1) [1,3)*");
  }
  {
    torch::nn::Sequential chain(torch::nn::Linear(16, 32), torch::nn::ReLU(),
                                torch::nn::Linear(32, 4));
    auto p = memfit::profile_chain(chain, torch::randn({8, 16}));
    EXPECT_EQ(p.layers.size(), 3u);
    EXPECT_EQ(p.layers[0].output_bytes, 8 * 32 * 4);
  }
  EXPECT_EQ(memfit::parse_schedule_kind("sqrt"), memfit::ScheduleKind::kSqrt);
  EXPECT_EQ(memfit::schedule_none(4).to_string(), "[0,4)");
  EXPECT_EQ(memfit::schedule_every(10, 4).to_string(), "[0,4)* [4,8)* [8,10)");
  EXPECT_EQ(memfit::schedule_uniform(10, 3).to_string(), "[0,3)* [3,6)* [6,10)");
  EXPECT_EQ(memfit::schedule_sqrt(16).segments.size(), 4u);
  {
    torch::nn::Sequential chain(torch::nn::Linear(8, 8), torch::nn::Tanh());
    auto costs = memfit::costs_from_profile(memfit::profile_chain(chain, torch::randn({2, 8})));
    EXPECT_EQ(costs.size(), 2);
  }
  {
    memfit::ChainCosts c{{4, 4, 4}, {8, 8}, {1, 1}, {2, 2}, {false, false}};
    auto cost = memfit::simulate(memfit::schedule_none(2), c);
    EXPECT_EQ(cost.time, 6);
    auto least = memfit::min_budget(c);
    EXPECT_GT(least, 0);
  }
  {
    memfit::ChainCosts c{{4, 4, 4, 4}, {8, 8, 8}, {1, 1, 1}, {2, 2, 2}, {false, false, false}};
    auto s = memfit::solve_optimal(c, 40);
    EXPECT_LE(memfit::simulate(s, c).peak_bytes, 40);
  }
  {
    torch::nn::Sequential chain;
    for (int i = 0; i < 16; ++i) chain->push_back(torch::nn::Linear(32, 32));
    memfit::CheckpointedSequential model(
        chain, memfit::CheckpointedSequentialOptions().kind(memfit::ScheduleKind::kSqrt));
    model->forward(torch::randn({8, 32})).sum().backward();
  }
}

TEST_F(DocExamples, FreezeHeader) {
  {
    auto net = memfit::make_mlp(memfit::ModelOptions().width(8).depth(1));
    auto names = memfit::match_parameters(*net, "fc0.*");  // {"fc0.weight", "fc0.bias"}
    EXPECT_EQ(names, (std::vector<std::string>{"fc0.weight", "fc0.bias"}));
  }
  auto net = memfit::make_mlp(memfit::ModelOptions().width(8).depth(1));
  torch::optim::Adam adam(net->parameters());
  EXPECT_EQ(memfit::freeze(*net, "fc0.*", &adam), 2);  // 2 parameters frozen
  EXPECT_EQ(memfit::unfreeze(*net, "fc0.*", &adam), 2);
}

// README.md's "Your own model": the pieces on a module with its own forward.
struct ReadmeNetImpl : torch::nn::Module {
  ReadmeNetImpl()
      : encoder(register_module("encoder", torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::ReLU()))),
        head(register_module("head", torch::nn::Linear(32, 4))) {}
  torch::nn::Sequential encoder;
  torch::nn::Linear head;
};
TORCH_MODULE(ReadmeNet);

TEST_F(DocExamples, PiecesInYourOwnLoop) {
  ReadmeNet net;
  torch::optim::SGD optimizer(net->parameters(), 0.1);
  memfit::GradScaler scaler;
  const auto x = torch::randn({8, 16});
  const auto y = torch::randint(4, {8});
  std::ostringstream out;
  memfit::set_memory_budget(torch::kCPU, memfit::parse_memory_size("512MiB"));  // over it: c10::OutOfMemoryError
  memfit::PeakMeter meter;
  torch::Tensor loss;
  {
    memfit::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);           // torch.autocast
    auto h = memfit::checkpoint(net->encoder, x);                            // torch.utils.checkpoint
    loss = torch::nll_loss(net->head->forward(h).to(torch::kFloat).log_softmax(1), y);
  }
  scaler.scale(loss).backward();                                             // memfit::GradScaler
  scaler.unscale_(optimizer);
  torch::nn::utils::clip_grad_norm_(net->parameters(), 1.0);
  scaler.step(optimizer);
  scaler.update();
  out << memfit::breakdown_step(meter.peak(), net->parameters(), net->buffers(), optimizer).table();
  memfit::set_memory_budget(torch::kCPU, 0);
  EXPECT_TRUE(net->encoder->parameters()[0].grad().defined()) << "the checkpointed encoder got gradients";
  EXPECT_NE(out.str().find("parameters"), std::string::npos) << out.str();
}

TEST_F(DocExamples, EnvironmentHeader) {
  std::ostringstream out, err;
  {
    const auto blas = memfit::blas_info();
    out << blas.name() << " from " << blas.library << "\n";  // OpenBLAS 0.3.21 (OpenMP) from /usr/...
  }
  {
    const auto env = memfit::environment();
    out << env.to_string() << "\n";  // LibTorch 1.13.0, CPU only, 2 threads, BLAS: OpenBLAS ...
    EXPECT_NE(out.str().find("LibTorch " TORCH_VERSION), std::string::npos) << out.str();
  }
  const auto warning = memfit::check_blas();
  if (!warning.empty()) err << "warning: " << warning << "\n";
  EXPECT_EQ(err.str().empty(), warning.empty());
  {
    const auto precision = memfit::cpu_computes_bf16_natively() ? memfit::Precision::kBF16
                                                                : memfit::Precision::kFP32;
    EXPECT_EQ(precision == memfit::Precision::kBF16, memfit::environment().cpu_bf16);
  }
  {
    memfit::CpuLoad load;
    // ... timed work ...
    if (load.free_cores() >= 0 && load.free_cores() < 1.5) std::cerr << "another process shares the cores\n";
    EXPECT_LE(load.free_cores(), double(std::thread::hardware_concurrency()));
  }
}

TEST_F(DocExamples, DistributedHeader) {
  {  // world_from_env (no launcher variables in the test's environment)
    auto world = memfit::world_from_env();
    if (!world.distributed()) assert(world.rank == 0 && world.world_size == 1);
    EXPECT_EQ(world.world_size, 1);
  }
  {  // nccl_available
    auto backend = memfit::nccl_available() && torch::cuda::is_available()
                       ? memfit::ProcessGroupBackend::kNccl : memfit::ProcessGroupBackend::kGloo;
    EXPECT_EQ(backend == memfit::ProcessGroupBackend::kNccl,
              memfit::nccl_available() && torch::cuda::is_available());
  }
  if (!memfit::distributed_available()) GTEST_SKIP() << "this build has no c10d Gloo process group";
  {  // ProcessGroup
    memfit::WorldInfo solo;  // one process: a group of one
    solo.master_port = 0;    // any free port
    memfit::ProcessGroup group(solo);
    auto t = torch::ones({3});
    group.all_reduce_(t);  // the sum over the ranks
    EXPECT_TRUE(t.equal(torch::ones({3})));
  }
  {  // broadcast_module_state
    memfit::WorldInfo solo;
    solo.master_port = 0;
    memfit::ProcessGroup group(solo);
    torch::nn::Linear net(4, 2);
    const auto before = net->weight.detach().clone();
    memfit::broadcast_module_state(*net, group);  // rank 0's weights everywhere
    EXPECT_TRUE(net->weight.equal(before)) << "one rank: its own";
  }
  {  // broadcast_plan (module_plan.h)
    memfit::WorldInfo solo;  // one process: a group of one
    solo.master_port = 0;
    memfit::ProcessGroup group(solo);
    memfit::ModulePlan p;
    p.chains = {"blocks"};
    p.schedules = {memfit::schedule_uniform(4, 2)};
    memfit::broadcast_plan(p, group);  // on every rank: rank 0's plan
    EXPECT_EQ(p.schedules[0].to_string(), "[0,2)* [2,4)");
  }
  {  // save_plan and load_plan (module_plan.h)
    memfit::ModulePlan p;
    p.fits = true;
    p.budget = 1 << 20;
    p.batch = 64;
    p.settings.micro_batch(16);
    p.chains = {"blocks"};
    p.schedules = {memfit::schedule_uniform(4, 2)};
    memfit::save_plan(p, "/tmp/memfit_example_plan.json");
    const auto q = memfit::load_plan("/tmp/memfit_example_plan.json");
    EXPECT_TRUE(q.settings.micro_batch() == 16 && q.schedules[0].to_string() == "[0,2)* [2,4)");
  }
  {  // plan_mismatch (module_plan.h)
    torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4));
    memfit::ModulePlan p;
    p.budget = 1 << 20;
    p.batch = 64;
    p.settings.micro_batch(16);
    EXPECT_TRUE(!memfit::plan_mismatch(p, *net, 64, 1 << 20, memfit::PlanOptions()).empty());  // BatchNorm: kept
    EXPECT_TRUE(memfit::plan_mismatch(p, *net, 64, 1 << 20,
                                      memfit::PlanOptions().batch_statistics(memfit::BatchStatistics::kPerMicroBatch))
                    .empty());
  }
  {  // clip_grad_norm_
    memfit::WorldInfo solo;
    solo.master_port = 0;
    memfit::ProcessGroup group(solo);
    auto w = torch::ones({4}, torch::requires_grad());
    (w * 3).sum().backward();                                   // gradient 3, 3, 3, 3: norm 6
    double norm = memfit::clip_grad_norm_(std::vector<torch::Tensor>{w}, 1.0, group);  // 6; now norm 1
    EXPECT_NEAR(norm, 6.0, 1e-5);
    EXPECT_NEAR(w.grad().norm().item<double>(), 1.0, 1e-5);
  }
  {  // DistributedDataParallel
    memfit::WorldInfo solo;
    solo.master_port = 0;
    auto group = std::make_shared<memfit::ProcessGroup>(solo);
    torch::nn::Linear net(4, 2);
    memfit::DistributedDataParallel ddp(net.ptr(), group);
    net->forward(torch::ones({3, 4})).sum().backward();
    ddp.finalize();  // gradients now averaged over the ranks
    EXPECT_TRUE(net->weight.grad().defined());
  }
  {  // ZeroRedundancyOptimizer
    memfit::WorldInfo solo;
    solo.master_port = 0;
    auto group = std::make_shared<memfit::ProcessGroup>(solo);
    torch::nn::Linear net(4, 2);
    memfit::ZeroRedundancyOptimizer zero(
        net->parameters(),
        [](std::vector<torch::Tensor> p) {
          return std::make_unique<torch::optim::Adam>(std::move(p), torch::optim::AdamOptions(1e-3));
        },
        group);
    net->forward(torch::ones({3, 4})).sum().backward();
    const auto before = net->weight.detach().clone();
    zero.step();  // steps this rank's share, then broadcasts every parameter from its owner
    EXPECT_FALSE(net->weight.equal(before)) << "one rank owns and steps everything";
    EXPECT_EQ(zero.owned_bytes(), std::vector<int64_t>({(8 + 2) * 4}));
  }
}

TEST_F(DocExamples, PipelineHeader) {
  EXPECT_EQ(memfit::parse_pipeline_checkpoint("except_last"), memfit::PipelineCheckpoint::kExceptLast);
  {  // balance_by_cost
    auto t = memfit::balance_by_cost({5, 1, 1}, 2, {false, true, true});  // not {1, 2}
    EXPECT_EQ(t, std::vector<int64_t>({2, 1}));
    auto b = memfit::balance_by_cost({1, 1, 1, 3}, 2);  // {3, 1}: costs 3 and 3
    assert(b == std::vector<int64_t>({3, 1}));
    EXPECT_EQ(b, std::vector<int64_t>({3, 1}));
  }
  {  // balance_by_profile
    torch::nn::Sequential net(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8), torch::nn::ReLU());
    memfit::ChainProfile p;
    p.layers.resize(3);
    p.layers[2].forward_seconds = 1.0;  // the slow ReLU gets no stage of its own: nothing to train
    EXPECT_EQ(memfit::balance_by_profile(net, p, 2), std::vector<int64_t>({1, 2}));
  }
  if (!memfit::distributed_available()) GTEST_SKIP() << "this build has no c10d Gloo process group";
  {  // Pipeline
    memfit::WorldInfo solo;
    solo.master_port = 0;
    auto group = std::make_shared<memfit::ProcessGroup>(solo);
    torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 3));
    memfit::Pipeline pipe(net, group, memfit::PipelineOptions().chunks(2));
    auto r = pipe.train_step(torch::randn({6, 4}), torch::randint(0, 3, {6}),
                             [](const torch::Tensor& out, const torch::Tensor& y) {
                               return torch::nn::functional::cross_entropy(out, y);
                             });
    // pipe.stage()'s parameters now hold the batch's gradients: step an optimizer over them.
    EXPECT_TRUE(pipe.stage()->parameters().front().grad().defined());
    EXPECT_GT(r.loss, 0);
  }
}

TEST_F(DocExamples, StateHeader) {
  memfit::write_file_atomically("/tmp/memfit_example.json", "{}\n");
  auto net = memfit::make_mlp(memfit::ModelOptions().width(8).depth(1));
  memfit::save_module(*net, "/tmp/memfit_example_mlp.pt");
  memfit::load_module(*net, "/tmp/memfit_example_mlp.pt");
  std::filesystem::remove("/tmp/memfit_example.json");
  std::filesystem::remove("/tmp/memfit_example_mlp.pt");
  {
    memfit::FolderLock held("/tmp/memfit_example_lock");
    // memfit::FolderLock("/tmp/memfit_example_lock") throws while `held` lives
    EXPECT_THROW(memfit::FolderLock("/tmp/memfit_example_lock"), c10::Error);
  }
  std::filesystem::remove("/tmp/memfit_example_lock");  // empty: the lock file went with `held`
}

TEST_F(DocExamples, ModelSignature) {
  auto a = memfit::make_mlp(memfit::ModelOptions().width(16).depth(1));
  auto b = memfit::make_mlp(memfit::ModelOptions().width(24).depth(1));
  EXPECT_TRUE(memfit::model_signature(*a) != memfit::model_signature(*b));
  EXPECT_EQ(memfit::optimizer_signature(memfit::TrainerOptions()), "Adam");  // optimizer_signature
  EXPECT_EQ(memfit::optimizer_signature(memfit::TrainerOptions().optimizer(memfit::OptimizerKind::kSGD).momentum(0)), "SGD");
}

TEST_F(DocExamples, CheckRanksAgree) {
  auto model = memfit::make_mlp();
  memfit::check_ranks_agree(*model, memfit::TrainerOptions());  // one process: nothing to compare
}

TEST_F(DocExamples, PlanHeader) {
  EXPECT_EQ(memfit::offload_text(memfit::StepSettings()), "none");
}

TEST_F(DocExamples, DataAndTrainerHeaders) {
  if (!std::filesystem::exists(memfit::FashionMnistOptions().root())) {
    GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed";
  }
  EXPECT_EQ(memfit::parse_optimizer_kind("adamw"), memfit::OptimizerKind::kAdamW);
  {
    auto net = memfit::make_mlp(memfit::ModelOptions().width(8).depth(1));
    auto sgd = memfit::make_optimizer(
        memfit::TrainerOptions().optimizer(memfit::OptimizerKind::kSGD).lr(0.1), net->parameters());
    EXPECT_NE(dynamic_cast<torch::optim::SGD*>(sgd.get()), nullptr);
  }
  auto test = memfit::load_fashion_mnist(memfit::Split::kTest);
  EXPECT_EQ(test.size(), 10000);
  auto data = memfit::load_fashion_mnist(memfit::Split::kTest);
  memfit::Trainer trainer(memfit::make_mlp(),
                          memfit::TrainerOptions().batch_size(32).steps(5));
  auto report = trainer.fit(data);
  auto result = trainer.evaluate(data);
  EXPECT_EQ(report.steps.size(), 5u);
  EXPECT_GT(result.accuracy, 0.0);
  {  // Trainer::request_stop
    auto report = trainer.fit(data, [&](const memfit::StepRecord& r) {
      if (r.step == 2) trainer.request_stop();
    });
    EXPECT_TRUE(report.stopped);
    EXPECT_EQ(trainer.step(), 2);
  }
  {  // check_output_file
    memfit::check_output_file("/tmp/memfit_example.json");
    memfit::check_output_folder("/tmp/memfit_example_run");
  }
  const std::string dir = "/tmp/memfit_example_run";
  {  // Trainer::resume
    memfit::Trainer first(memfit::make_mlp(), memfit::TrainerOptions().batch_size(32).steps(3).save_dir(dir));
    first.fit(data);  // saves dir/checkpoint.pt at the end
    memfit::Trainer second(memfit::make_mlp(), memfit::TrainerOptions().batch_size(32).steps(6));
    second.resume(dir);
    auto rest = second.fit(data);  // steps 4, 5 and 6
    EXPECT_EQ(rest.steps.front().step, 4);
    auto net = memfit::make_mlp();  // load_trainer_model
    memfit::load_trainer_model(*net, dir);
    EXPECT_TRUE(net->parameters()[0].equal(first.model()->parameters()[0]));
  }  // `first` lets go of the folder (its lock file goes with it)
  // remove(), not remove_all(): with pip's LibTorch 2.x the latter binds
  // to libtorch.so's own incompatible copy and crashes.
  std::filesystem::remove(dir + "/checkpoint.pt");
  std::filesystem::remove(dir);
}

struct StreamedNetImpl : torch::nn::Module {
  StreamedNetImpl() {
    torch::nn::Sequential blocks(torch::nn::Linear(32, 32), torch::nn::Tanh(), torch::nn::Linear(32, 32));
    body = register_module("body", memfit::CheckpointedSequential(blocks));
    head = register_module("head", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head->forward(body->forward(x)); }
  memfit::CheckpointedSequential body{nullptr};
  torch::nn::Linear head{nullptr};
};

TEST_F(DocExamples, StreamHeader) {
  {  // ParameterStream
    auto net = memfit::make_mlp(memfit::ModelOptions().width(32).depth(1));
    memfit::MasterWeights master(*net, memfit::MasterWeightsOptions()
                                           .dtype(torch::kFloat)
                                           .offload(memfit::Offload::kHost)
                                           .gradients(memfit::Offload::kHost)
                                           .parameters(memfit::Offload::kHost));
    memfit::ParameterStream stream(net, master, memfit::StreamOptions().tile_bytes(16 << 10));
    torch::optim::SGD sgd(master.master_parameters(), torch::optim::SGDOptions(0.1));
    stream.forward(torch::zeros({4, 1, 28, 28})).sum().backward();
    sgd.step();
    master.master_to_model();
  }
  {  // ParameterStream over any module
    auto net = std::make_shared<StreamedNetImpl>();
    memfit::MasterWeights master(*net, memfit::MasterWeightsOptions()
                                           .dtype(torch::kFloat)
                                           .offload(memfit::Offload::kHost)
                                           .gradients(memfit::Offload::kHost)
                                           .parameters(memfit::Offload::kHost));
    memfit::ParameterStream stream(net, master);
    torch::optim::SGD sgd(master.master_parameters(), torch::optim::SGDOptions(0.1));
    {
      auto held = stream.hold();  // the head, for this forward and backward
      net->forward(torch::randn({8, 32})).sum().backward();
    }
    sgd.step();
    master.master_to_model();
    EXPECT_EQ(stream.chains(), 1u);
  }
  {  // ParameterStream::refusal
    torch::nn::Sequential flat(torch::nn::Linear(8, 8));
    EXPECT_FALSE(memfit::ParameterStream::refusal(*flat).empty());  // no chain to stream
    EXPECT_EQ(memfit::ParameterStream::refusal(*std::make_shared<StreamedNetImpl>()), "");
  }
  EXPECT_EQ(memfit::linear_tile_rows(64, 64 * 400, 6400), 16);
  {  // streamed_bytes
    torch::nn::Linear lin(100, 64);  // 25.6 KB of weight
    EXPECT_EQ(memfit::streamed_bytes(*lin, 6400), 16 * 100 * 4 + 16 * 4);
  }
}

TEST_F(DocExamples, TrainerOptionsFromSettings) {
  auto options = memfit::trainer_options(memfit::StepSettings().micro_batch(16),
                                         memfit::TrainerOptions().batch_size(64));
  EXPECT_TRUE(options.micro_batch_size() == 16 && options.batch_size() == 64);
}

TEST_F(DocExamples, BatchTraitsOfAUsersOwnBatch) {
  const Pair b{torch::ones({6, 3}), torch::zeros({6, 3})};
  EXPECT_EQ(memfit::BatchTraits<Pair>::size(b), 6);
  EXPECT_EQ(memfit::BatchTraits<Pair>::slice(b, 2, 3).tokens.size(0), 3);
  // Without a `pin` of its own, the batch is staged as it is.
  EXPECT_TRUE(memfit::pinned(b).tokens.is_same(b.tokens));
}

TEST_F(DocExamples, Pinned) {
  auto batch = torch::data::Example<>(torch::ones({4, 3}), torch::zeros({4}));
  if (torch::cuda::is_available()) EXPECT_TRUE(memfit::pinned(batch).data.is_pinned());
}

TEST_F(DocExamples, ToDevice) {
  torch::Tensor host;
  { memfit::UntrackedGuard untracked; host = torch::ones({256}); }
  const auto before = memfit::memory_allocated(torch::kCPU);
  auto staged = memfit::to_device(host, torch::kCPU);
  EXPECT_EQ(memfit::memory_allocated(torch::kCPU) - before, 1024);
  EXPECT_TRUE(memfit::to_device(staged, torch::kCPU).is_same(staged)) << "already on the device: no copy";
}

TEST_F(DocExamples, StepComponent) {
  struct CountSteps : memfit::StepComponent {
    int64_t steps = 0;
    void end_step(memfit::StepState&) override { ++steps; }
  };
  auto count = std::make_shared<CountSteps>();
  memfit::Trainer trainer(memfit::make_mlp(memfit::ModelOptions().width(8).depth(1)), memfit::TrainerOptions());
  trainer.add_component(count);
  trainer.train_step(torch::data::Example<>(torch::randn({4, 1, 28, 28}), torch::randint(10, {4})));
  EXPECT_EQ(count->steps, 1);
}

TEST_F(DocExamples, StepComponentState) {
  struct CountSteps : memfit::StepComponent {  // its count survives save and resume
    int64_t steps = 0;
    void end_step(memfit::StepState&) override { ++steps; }
    void save_state(torch::serialize::OutputArchive& a) override {
      a.write("count_steps", c10::IValue(steps));
    }
    std::function<void()> load_state(torch::serialize::InputArchive& a, const std::string&) override {
      c10::IValue v;
      if (!a.try_read("count_steps", v)) return {};  // saved without it: keep counting from here
      return [this, n = v.toInt()] { steps = n; };
    }
  };
  const std::string dir = ::testing::TempDir() + "memfit_doc_component_state_" + std::to_string(::getpid());
  const auto batch = torch::data::Example<>(torch::randn({4, 1, 28, 28}), torch::randint(10, {4}));
  const auto options = memfit::TrainerOptions();
  auto count = std::make_shared<CountSteps>();
  memfit::Trainer trainer(memfit::make_mlp(memfit::ModelOptions().width(8).depth(1)), options);
  trainer.add_component(count);
  trainer.train_step(batch);
  trainer.train_step(batch);
  trainer.save(dir);
  auto resumed_count = std::make_shared<CountSteps>();
  memfit::Trainer resumed(memfit::make_mlp(memfit::ModelOptions().width(8).depth(1)), options);
  resumed.add_component(resumed_count);
  resumed.resume(dir);
  EXPECT_EQ(resumed_count->steps, 2);
  auto unsaved_count = std::make_shared<CountSteps>();
  unsaved_count->steps = 7;
  memfit::Trainer without(memfit::make_mlp(memfit::ModelOptions().width(8).depth(1)), options);
  without.save(dir);  // a checkpoint of a run without the component
  without.add_component(unsaved_count);
  without.resume(dir);
  EXPECT_EQ(unsaved_count->steps, 7) << "a part the checkpoint lacks leaves the component as it is";
  std::filesystem::remove(dir + "/checkpoint.pt");
  std::filesystem::remove(dir);
}

struct NetImpl : torch::nn::Module {
  NetImpl() : fc(register_module("fc", torch::nn::Linear(784, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc(x.flatten(1)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Net);

TEST_F(DocExamples, TrainerOfAnyModule) {
  Net net;
  memfit::Trainer trainer(
      net, [](NetImpl& n, const torch::data::Example<>& b) {
        return torch::nn::functional::cross_entropy(n.forward(b.data), b.target);
      },
      memfit::TrainerOptions().micro_batch_size(16).lr(0.01));
  auto record = trainer.train_step(torch::data::Example<>(torch::randn({64, 784}),
                                                          torch::randint(10, {64})));
  EXPECT_EQ(record.step, 1);
  const torch::data::Example<> batch(torch::randn({8, 784}), torch::randint(10, {8}));
  auto correct = trainer.eval_step(batch, [&](const torch::data::Example<>& b) {
    return net->forward(b.data).argmax(1).eq(b.target).sum().item<int64_t>();
  });
  EXPECT_GE(correct, 0);
  int64_t summed = trainer.eval_sum(batch, [&](const torch::data::Example<>& b) {
    return net->forward(b.data).argmax(1).eq(b.target).sum().item<int64_t>();
  });
  EXPECT_EQ(summed, correct);
}

TEST_F(DocExamples, ReadmeTrainerOnYourModel) {
  std::vector<torch::data::Example<>> loader_batches;
  for (int i = 0; i < 3; ++i) loader_batches.emplace_back(torch::randn({64, 784}), torch::randint(10, {64}));
  const auto& loader = &loader_batches;
  int64_t peak = 0;
  {
    auto net = std::make_shared<NetImpl>();
    memfit::Trainer trainer(net,
        [](NetImpl& n, const torch::data::Example<>& b) { return torch::nll_loss(n.forward(b.data).log_softmax(1), b.target); },
        memfit::TrainerOptions()
            .micro_batch_size(32)                       // gradient accumulation: the same gradient
            .precision(memfit::Precision::kBF16)        // autocast (fp16 adds a GradScaler)
            .max_grad_norm(1.0)                         // clipped after unscaling
            .offload_optimizer(memfit::Offload::kHost)  // optimizer state in host memory
            .optimizer_factory([](std::vector<torch::Tensor> p) {
              return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.01).momentum(0.5));
            }));
    memfit::set_memory_budget(torch::kCPU, memfit::parse_memory_size("512MiB"));  // over it: c10::OutOfMemoryError
    for (auto& batch : *loader) {                       // your torch::data loader, your loop
      auto record = trainer.train_step(batch);          // record.loss, .peak_bytes, .seconds
      peak = std::max(peak, record.peak_bytes);
    }
    memfit::set_memory_budget(torch::kCPU, 0);
  }
  EXPECT_GT(peak, 0);
}

TEST_F(DocExamples, TrainerFitOverATorchDataDataSet) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist")) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  Net net;
  auto loss = [](NetImpl& n, const torch::data::Example<>& b) {
    return torch::nn::functional::cross_entropy(n.forward(b.data), b.target);
  };
  auto data = torch::data::datasets::MNIST(memfit::fashion_mnist_folder())
                  .map(torch::data::transforms::Stack<>());
  memfit::Trainer trainer(net, loss, memfit::TrainerOptions().batch_size(64).steps(10));
  auto report = trainer.fit(data);
  EXPECT_EQ(report.steps.size(), 10u);
}

TEST_F(DocExamples, ExampleDataset) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist")) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  memfit::ExampleDataset data(memfit::load_fashion_mnist(memfit::Split::kTest));
  auto batch = data.get_batch({0, 5, 7});
  EXPECT_TRUE(batch.data.size(0) == 3 && data.size().value() == 10000);
  EXPECT_TRUE(batch.data[1].equal(data.data().images[5]));
  memfit::testing::expect_error([&] { data.get_batch({10000}); }, "example 10000 is out of range: the data set has 10000");
}

TEST_F(DocExamples, FashionMnistDataset) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist")) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  auto test = memfit::fashion_mnist_dataset(memfit::Split::kTest);
  EXPECT_EQ(test.size().value(), 10000u);
  // LibTorch's DataLoader takes it as it is.
  auto loader = torch::data::make_data_loader(std::move(test), 1000);
  int64_t seen = 0;
  for (const auto& b : *loader) seen += b.data.size(0);
  EXPECT_EQ(seen, 10000);
}

TEST_F(DocExamples, JargonDataset) {
  if (!std::filesystem::exists("/usr/share/doc/jargon-text/jargon.txt.gz")) GTEST_SKIP() << "jargon-text is not installed";
  auto train = memfit::jargon_dataset(64, memfit::Split::kTrain);
  EXPECT_EQ(train.get_batch({0}).target.size(1), 64);
  EXPECT_TRUE(train.get_batch({3}).data[0].narrow(0, 1, 63).equal(train.get_batch({3}).target[0].narrow(0, 0, 63)));
}

TEST_F(DocExamples, FashionMnistFolder) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist")) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  torch::data::datasets::MNIST train(memfit::fashion_mnist_folder());
  EXPECT_EQ(train.size().value(), 60000u);
}

TEST_F(DocExamples, ScheduleLeastMemory) {
  memfit::ChainCosts c{{1, 10, 10, 10, 10}, {10, 10, 10, 10}, {1, 1, 1, 1}, {1, 1, 1, 1},
                       {false, false, false, false}};
  auto least = memfit::schedule_least_memory(c);
  EXPECT_EQ(memfit::simulate(least, c).peak_bytes, memfit::min_budget(c));
  EXPECT_LT(memfit::min_budget(c), memfit::simulate(memfit::schedule_none(4), c).peak_bytes);
}

// README's and docs/planner.md's snippet.
TEST_F(DocExamples, PlanYourOwnModule) {
  auto net = std::make_shared<NetImpl>();
  auto loss = [](NetImpl& n, const torch::data::Example<>& b) {
    return torch::nll_loss(n.forward(b.data).log_softmax(1), b.target);
  };
  torch::data::Example<> sample_batch(torch::randn({64, 784}), torch::randint(10, {64}));
  std::ostringstream out;
  auto& cout = out;
  // Your module, your loss, a batch of the size you will train with.
  auto plan = memfit::plan(net, loss, sample_batch, memfit::parse_memory_size("2GiB"));
  memfit::Trainer trainer(net, loss, plan.apply(*net));  // micro-batch, precision, offload, each chain's schedule
  cout << plan.explain();
  EXPECT_NE(out.str().find("fits"), std::string::npos);
  EXPECT_GT(trainer.train_step(sample_batch).loss, 0);
}

TEST_F(DocExamples, FindChains) {
  torch::nn::Sequential blocks(torch::nn::Linear(8, 8), torch::nn::ReLU());
  auto net = std::make_shared<torch::nn::Module>();
  net->register_module("blocks", memfit::CheckpointedSequential(blocks));
  auto chains = memfit::find_chains(*net);
  EXPECT_TRUE(chains.size() == 1 && chains[0].name == "blocks");
}

TEST_F(DocExamples, PlanAnyModule) {
  auto net = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                                   torch::nn::Linear(64, 4));
  auto loss = [](torch::nn::SequentialImpl& m, const torch::data::Example<>& b) {
    return torch::nn::functional::cross_entropy(m.forward(b.data), b.target);
  };
  torch::data::Example<> sample(torch::randn({64, 32}), torch::zeros({64}, torch::kLong));
  auto p = memfit::plan(net.ptr(), loss, sample, 1 << 20);
  memfit::Trainer trainer(net, loss, p.apply(*net));
  trainer.train_step(sample);
  EXPECT_TRUE(p.fits);
}

TEST_F(DocExamples, PlanASmallerBatchOfTheMeasuredSample) {
  auto net = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                                   torch::nn::Linear(64, 4));
  torch::data::Example<> sample(torch::randn({256, 32}), torch::zeros({256}, torch::kLong));
  memfit::ModuleStepModel model(memfit::detail::make_probe(net, sample), memfit::PlanOptions(),
                                memfit::TrainerOptions());
  auto p = memfit::plan(model, 1 << 20, 64);
  EXPECT_TRUE(p.batch == 64 && p.fits);
}

TEST_F(DocExamples, ReplanFromTheStepModel) {
  auto chain = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                                     torch::nn::Linear(64, 4));
  auto net = torch::nn::Sequential(memfit::CheckpointedSequential(chain));
  torch::data::Example<> sample(torch::randn({64, 32}), torch::zeros({64}, torch::kLong));
  auto model = std::make_shared<memfit::ModuleStepModel>(memfit::detail::make_probe(net, sample));
  auto p = memfit::plan(*model, 1 << 20);
  memfit::Trainer trainer(net, p.apply(*net, memfit::TrainerOptions()
                                                 .on_out_of_memory(memfit::OnOutOfMemory::kReplan)
                                                 .replan(memfit::replan_from_model(model, p))));
  trainer.train_step(sample);
}

TEST_F(DocExamples, PlanASequentialClassifier) {
  auto chain = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                                     torch::nn::Linear(64, 4));
  auto net = torch::nn::Sequential(memfit::CheckpointedSequential(chain));
  torch::data::Example<> sample(torch::randn({64, 32}), torch::zeros({64}, torch::kLong));
  auto p = memfit::plan(net, sample, 1 << 20);
  memfit::Trainer trainer(net, p.apply(*net, memfit::TrainerOptions().batch_size(64)));
  trainer.train_step(sample);
  EXPECT_TRUE(p.fits);
}

TEST_F(DocExamples, ProfileASequentialClassifier) {
  auto net = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                                   torch::nn::Linear(64, 4));
  torch::data::Example<> sample(torch::randn({16, 32}), torch::zeros({16}, torch::kLong));
  auto p = memfit::profile(net, sample);
  EXPECT_TRUE(p.batch == 16 && p.step.peak > 0);
}

TEST_F(DocExamples, BatchStatisticsLayer) {
  torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4));
  EXPECT_TRUE(memfit::batch_statistics_layer(*net) == std::optional<std::string>("1"));
}

TEST_F(DocExamples, ProfileAnyModule) {
  auto net = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                                   torch::nn::Linear(64, 4));
  auto loss = [](torch::nn::SequentialImpl& m, const torch::data::Example<>& b) {
    return torch::nn::functional::cross_entropy(m.forward(b.data), b.target);
  };
  torch::data::Example<> sample(torch::randn({64, 32}), torch::zeros({64}, torch::kLong));
  auto p = memfit::profile(net.ptr(), loss, sample);
  EXPECT_TRUE(p.batch == 64 && p.step.peak > 0 && p.predicted.peak_bytes > 0);
}

struct Points : torch::data::datasets::Dataset<Points> {  // the user's data set
  torch::data::Example<> get(size_t i) override {
    return {torch::randn({32}), torch::tensor(static_cast<int64_t>(i % 4))};
  }
  torch::optional<size_t> size() const override { return 1000; }
};

TEST_F(DocExamples, FindTheLargestBatchOfAnyModule) {
  auto data = Points().map(torch::data::transforms::Stack<>());
  auto net = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                                   torch::nn::Linear(64, 4));
  auto loss = [](torch::nn::SequentialImpl& m, const torch::data::Example<>& b) {
    return torch::nn::functional::cross_entropy(m.forward(b.data), b.target);
  };
  auto found = memfit::find_batch(net.ptr(), loss, data, 1 << 20);
  EXPECT_TRUE(found.plain.verified && found.plain.measured_peak_bytes <= 1 << 20);
  memfit::Trainer trainer(net, loss, found.apply(found.plain, *net));
  EXPECT_EQ(trainer.options().batch_size(), found.plain.batch);
}

struct Lines : torch::data::datasets::Dataset<Lines> {  // lengths 3, 5, 4, 2
  torch::data::Example<> get(size_t i) override {
    const int64_t n = std::vector<int64_t>{3, 5, 4, 2}[i];
    return {torch::zeros({n}), torch::zeros({n})};
  }
  torch::optional<size_t> size() const override { return 4; }
};

TEST_F(DocExamples, TheLargestExampleOfADataSet) {
  auto data = Lines();
  auto longest = memfit::largest_example(data, [](const std::vector<torch::data::Example<>>& b) {
    return b.front().data.size(0);
  });
  EXPECT_EQ(longest, 1u);
}

TEST_F(DocExamples, BeforeCommit) {
  auto lin = torch::nn::Linear(4, 2);
  memfit::optim::SGD sgd(lin->parameters(), torch::optim::SGDOptions(0.1));
  lin(torch::ones({3, 4})).sum().backward();
  int calls = 0;
  {
    memfit::optim::BeforeCommit gate([&] { ++calls; });
    sgd.step();
  }
  EXPECT_EQ(calls, 1);
  memfit::optim::before_commit();  // no guard: nothing happens
  EXPECT_EQ(calls, 1);
}

} // namespace
} // namespace memfit
