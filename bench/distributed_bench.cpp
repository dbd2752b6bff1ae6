// Data parallel training on this machine: one process against two ranks over
// c10d Gloo on 127.0.0.1, with the optimizer state whole and sharded (ZeRO
// stage 1). For each built-in model (MLP, ResNet), the same global batch of 64
// Fashion-MNIST images, Adam, in these configurations:
//
//   1 proc × 2 threads   one process, the machine's two cores to itself
//   1 proc × 1 thread    one process, one core
//   2 ranks              two processes of one thread, 32 images each
//   2 ranks + ZeRO-1     the same, each rank keeping Adam's state for its share
//   2 ranks, recovery on the 2 ranks with OnOutOfMemory::kReplan: they vote once a
//                        step, with the loss, before the optimizer commits
//
// and prints, per configuration: the median step time (steps after the first
// five) and samples per second, the bytes each rank put into collectives per
// step (gradients all-reduced, parameters broadcast by ZeRO, the loss), and per
// rank the optimizer-state bytes and the peak of a step (memfit's byte-exact
// allocator).
//
//   build/bench/memfit_distributed_bench [--steps 40] [--model mlp|resnet|pipeline|all] [--pairs 5]
//
// Then recovery's cost when nothing fails: 2 ranks with OnOutOfMemory::kThrow
// and kReplan run alternately --pairs times, and the median ratio of their
// step times, beside the ratios of kThrow against itself (the noise).
//
// Pipeline parallel (--model pipeline, and in `all`): an MLP of width 1024 and
// depth 4 (15.1 MiB of parameters), Adam, batch 64: one process against two
// stages (GPipe and 1F1B, 4 and 8 chunks): step time, bytes sent and received
// per step, and per rank the parameters, optimizer state and step peak.
//
// The workers are this program started again with torchrun's variables.

#include "memfit/data.h"
#include "memfit/distributed.h"
#include "memfit/environment.h"
#include "memfit/memory.h"
#include "memfit/models.h"
#include "memfit/pipeline.h"
#include "memfit/trainer.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

extern char** environ;

namespace {

constexpr int64_t kGlobalBatch = 64;

struct Config {
  std::string name;
  int ranks;
  int threads;
  int zero_stage;
  std::string pipeline = "";  // a schedule: pipeline parallel
  int chunks = 1;
  bool recover = false;  // OnOutOfMemory::kReplan: the ranks vote before each update
};

const std::vector<Config>& configs() {
  static const std::vector<Config> c = {{"1 proc × 2 threads", 1, 2, 0},
                                        {"1 proc × 1 thread", 1, 1, 0},
                                        {"2 ranks × 1 thread", 2, 1, 0},
                                        {"2 ranks × 1 thread, ZeRO-1", 2, 1, 1},
                                        {"2 ranks × 1 thread, recovery on", 2, 1, 0, "", 1, true}};
  return c;
}

const std::vector<Config>& pipeline_configs() {
  static const std::vector<Config> c = {{"1 proc × 2 threads", 1, 2, 0, "gpipe", 1},
                                        {"1 proc × 1 thread", 1, 1, 0, "gpipe", 1},
                                        {"2 stages × 1 thread, GPipe, 4 chunks", 2, 1, 0, "gpipe", 4},
                                        {"2 stages × 1 thread, 1F1B, 4 chunks", 2, 1, 0, "1f1b", 4},
                                        {"2 stages × 1 thread, 1F1B, 8 chunks", 2, 1, 0, "1f1b", 8}};
  return c;
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 29500 + static_cast<int>(::getpid() % 1000);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

// One pipeline stage: Adam over its layers, batch 64 in MEMFIT_BENCH_CHUNKS
// chunks; writes its measurements as JSON to MEMFIT_BENCH_OUT.
int pipeline_worker() {
  const std::string out = std::getenv("MEMFIT_BENCH_OUT");
  const int64_t steps = std::atoll(std::getenv("MEMFIT_BENCH_STEPS"));
  const int64_t chunks = std::atoll(std::getenv("MEMFIT_BENCH_CHUNKS"));
  const auto schedule = memfit::parse_pipeline_schedule(std::getenv("MEMFIT_BENCH_PIPELINE"));
  torch::set_num_threads(std::atoi(std::getenv("MEMFIT_BENCH_THREADS")));
  auto world = memfit::world_from_env();
  if (!world.distributed()) world.master_port = 0;
  auto group = std::make_shared<memfit::ProcessGroup>(world);
  memfit::memory_allocated(torch::kCPU);
  const auto data = memfit::load_fashion_mnist(memfit::Split::kTrain);
  torch::manual_seed(0);
  auto model = memfit::make_mlp(memfit::ModelOptions().width(1024).depth(4));
  std::vector<int64_t> balance;
  if (world.rank == 0) balance = memfit::balance_by_time(model, data.images.narrow(0, 0, kGlobalBatch / chunks), world.world_size);
  memfit::Pipeline pipe(model, group, memfit::PipelineOptions().chunks(chunks).schedule(schedule).balance(balance));
  model = nullptr;  // only the stage's layers stay
  torch::optim::Adam adam(pipe.stage()->parameters(), torch::optim::AdamOptions(1e-3));
  auto ce = [](const torch::Tensor& o, const torch::Tensor& y) { return torch::nn::functional::cross_entropy(o, y); };
  std::vector<double> seconds;
  int64_t peak = 0, payload = 0;
  double loss = 0;
  for (int64_t step = 0; step < steps; ++step) {
    const auto x = data.images.narrow(0, step * kGlobalBatch, kGlobalBatch);
    const auto y = data.labels.narrow(0, step * kGlobalBatch, kGlobalBatch);
    const int64_t sent = group->payload_bytes();
    memfit::PeakMeter meter(torch::kCPU);
    const auto start = std::chrono::steady_clock::now();
    loss = pipe.train_step(x, y, ce).loss;
    adam.step();
    adam.zero_grad();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    peak = std::max(peak, meter.peak());
    payload = group->payload_bytes() - sent;
  }
  seconds.erase(seconds.begin(), seconds.begin() + 5);
  std::sort(seconds.begin(), seconds.end());
  int64_t param_bytes = 0;
  for (const auto& p : pipe.stage()->parameters()) param_bytes += p.numel() * p.element_size();
  std::string layers;
  for (int64_t b : pipe.balance()) layers += fmt::format("{}{}", layers.empty() ? "" : "+", b);
  nlohmann::json j = {{"rank", world.rank},
                      {"median_step_s", seconds[seconds.size() / 2]},
                      {"payload_per_step", double(payload)},
                      {"optimizer_state", memfit::optimizer_state_bytes(adam)},
                      {"param_bytes", param_bytes},
                      {"peak", peak},
                      {"balance", layers},
                      {"final_loss", loss}};
  std::ofstream(out) << j.dump();
  return 0;
}

// One rank: trains and writes its measurements as JSON to MEMFIT_BENCH_OUT.
int worker() {
  if (std::getenv("MEMFIT_BENCH_PIPELINE") != nullptr) return pipeline_worker();
  const std::string model = std::getenv("MEMFIT_BENCH_MODEL");
  const std::string out = std::getenv("MEMFIT_BENCH_OUT");
  const int64_t steps = std::atoll(std::getenv("MEMFIT_BENCH_STEPS"));
  const int zero = std::atoi(std::getenv("MEMFIT_BENCH_ZERO"));
  torch::set_num_threads(std::atoi(std::getenv("MEMFIT_BENCH_THREADS")));
  const auto world = memfit::world_from_env();
  std::shared_ptr<memfit::ProcessGroup> group;
  if (world.distributed()) group = std::make_shared<memfit::ProcessGroup>(world);
  memfit::memory_allocated(torch::kCPU);
  const auto data = memfit::load_fashion_mnist(memfit::Split::kTrain);
  torch::manual_seed(0);
  auto net = memfit::make_model(memfit::parse_model_kind(model));
  // Nothing runs out of memory here; the ResNet's BatchNorm would refuse the default policy.
  auto policy = memfit::more_micro_batches(*net, true);
  memfit::Trainer trainer(net,
                          memfit::TrainerOptions()
                              .batch_size(kGlobalBatch / world.world_size)
                              .steps(steps)
                              .optimizer(memfit::OptimizerKind::kAdam)
                              .process_group(group)
                              .zero_stage(zero)
                              .on_out_of_memory(std::getenv("MEMFIT_BENCH_RECOVER") != nullptr
                                                    ? memfit::OnOutOfMemory::kReplan
                                                    : memfit::OnOutOfMemory::kThrow)
                              .replan(policy));
  const int64_t payload_before = group ? group->payload_bytes() : 0;
  const auto report = trainer.fit(data);
  const int64_t payload = group ? group->payload_bytes() - payload_before : 0;
  std::vector<double> seconds;
  for (size_t i = 5; i < report.steps.size(); ++i) seconds.push_back(report.steps[i].seconds);
  std::sort(seconds.begin(), seconds.end());
  int64_t param_bytes = 0;
  for (const auto& p : trainer.model()->parameters()) param_bytes += p.numel() * p.element_size();
  nlohmann::json j = {{"rank", world.rank},
                      {"median_step_s", seconds.empty() ? 0.0 : seconds[seconds.size() / 2]},
                      {"payload_per_step", double(payload) / double(steps)},
                      {"optimizer_state", report.step_memory.optimizer_state},
                      {"peak", report.peak_bytes},
                      {"param_bytes", param_bytes},
                      {"final_loss", report.final_loss}};
  std::ofstream(out) << j.dump();
  return 0;
}

std::vector<nlohmann::json> run(const Config& c, const std::string& model, int64_t steps) {
  const std::string port = std::to_string(free_port());
  const std::string base = fmt::format("/tmp/memfit_distributed_bench_{}", ::getpid());
  std::vector<pid_t> pids;
  for (int r = 0; r < c.ranks; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    const std::map<std::string, std::string> vars = {
        {"MEMFIT_BENCH_WORKER", "1"}, {"MEMFIT_BENCH_MODEL", model},
        {"MEMFIT_BENCH_OUT", base + ".rank" + std::to_string(r) + ".json"},
        {"MEMFIT_BENCH_STEPS", std::to_string(steps)}, {"MEMFIT_BENCH_ZERO", std::to_string(c.zero_stage)},
        {"MEMFIT_BENCH_THREADS", std::to_string(c.threads)}, {"OMP_NUM_THREADS", std::to_string(c.threads)},
        {"RANK", std::to_string(r)}, {"WORLD_SIZE", std::to_string(c.ranks)},
        {"LOCAL_RANK", std::to_string(r)}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}};
    for (const auto& [k, v] : vars) env.push_back(k + "=" + v);
    if (c.recover) env.push_back("MEMFIT_BENCH_RECOVER=1");
    if (!c.pipeline.empty()) {
      env.push_back("MEMFIT_BENCH_PIPELINE=" + c.pipeline);
      env.push_back("MEMFIT_BENCH_CHUNKS=" + std::to_string(c.chunks));
    }
    std::vector<char*> envp;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string exe = "/proc/self/exe";
    char* argv[] = {exe.data(), nullptr};
    pid_t pid = 0;
    if (::posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data()) != 0) {
      throw std::runtime_error("cannot start a worker");
    }
    pids.push_back(pid);
  }
  std::vector<nlohmann::json> results;
  for (int r = 0; r < c.ranks; ++r) {
    int status = 0;
    ::waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      throw std::runtime_error(fmt::format("{}: rank {} failed", c.name, r));
    }
    const std::string file = base + ".rank" + std::to_string(r) + ".json";
    std::ifstream in(file);
    results.push_back(nlohmann::json::parse(in));
    ::unlink(file.c_str());
  }
  return results;
}

std::string mib(double bytes) { return fmt::format("{:.2f} MiB", bytes / (1 << 20)); }

} // namespace

int main(int argc, char** argv) {
  memfit::keep_freed_host_memory();  // as the memfit CLI does at start (environment.h)
  if (std::getenv("MEMFIT_BENCH_WORKER") != nullptr) return worker();
  int64_t steps = 40, pairs = 5;
  std::vector<std::string> models = {"mlp", "resnet"};
  bool pipeline = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--steps") {
      steps = std::max<int64_t>(10, std::atoll(value.c_str()));
    } else if (flag == "--pairs") {
      pairs = std::max<int64_t>(0, std::atoll(value.c_str()));
    } else if (flag == "--model" && (value == "mlp" || value == "resnet" || value == "pipeline")) {
      models = value == "pipeline" ? std::vector<std::string>{} : std::vector<std::string>{value};
      pipeline = value == "pipeline";
    } else if (!(flag == "--model" && value == "all")) {
      fmt::print(stderr, "usage: {} [--steps N (>= 10)] [--model mlp|resnet|pipeline|all] [--pairs N]\n", argv[0]);
      return 2;
    }
  }
  if (!memfit::distributed_available()) {
    fmt::print("this build has no c10d Gloo process group: nothing to measure\n");
    return 0;
  }
  // The workers set their own thread counts (the table's rows); the BLAS is theirs too.
  fmt::print("{}\n", memfit::environment().to_string());
  if (const auto warning = memfit::check_blas(); !warning.empty()) fmt::print(stderr, "memfit: warning: {}\n", warning);
  fmt::print("global batch {}, Adam, {} steps, median step time of steps 6..{}\n\n", kGlobalBatch, steps, steps);
  for (const auto& model : models) {
    fmt::print("### {}\n\n", model);
    fmt::print("| configuration | step time | samples/s | vs 1 proc × 2 threads | collective payload / step / rank "
               "| optimizer state per rank | step peak per rank | final loss |\n");
    fmt::print("|---|---:|---:|---:|---:|---:|---:|---:|\n");
    double baseline = 0;
    for (const auto& c : configs()) {
      const auto results = run(c, model, steps);
      double step = 0, payload = 0;
      std::string state, peak;
      for (const auto& r : results) {
        step = std::max(step, r["median_step_s"].get<double>());
        payload = std::max(payload, r["payload_per_step"].get<double>());
        state += (state.empty() ? "" : " / ") + mib(r["optimizer_state"].get<double>());
        peak += (peak.empty() ? "" : " / ") + mib(r["peak"].get<double>());
      }
      if (baseline == 0) baseline = step;
      fmt::print("| {} | {:.1f} ms | {:.0f} | {:.2f}× | {} | {} | {} | {:.4f} |\n", c.name, step * 1e3,
                 double(kGlobalBatch) / step, baseline / step, c.ranks > 1 ? mib(payload) : std::string("—"),
                 state, peak, results.front()["final_loss"].get<double>());
      std::fflush(stdout);
    }
    fmt::print("\n");
  }
  // Recovery's cost when nothing fails, side by side: 2 ranks with recovery
  // off and on, alternately, `pairs` times; the ratio of each pair's median
  // step times. Then off against off the same way: the ratios that this
  // machine's noise alone gives.
  if (pairs > 0 && !models.empty()) {
    fmt::print("### recovery on ÷ off, 2 ranks × 1 thread, {} alternating pairs\n\n", pairs);
    fmt::print("| model | pair | median ratio | range | step time off (median) |\n|---|---|---:|---:|---:|\n");
    const Config& off = configs()[2];
    const Config& on = configs()[4];
    for (const auto& model : models) {
      for (const Config* first : {&on, &off}) {
        std::vector<double> ratios, offs;
        for (int64_t i = 0; i < pairs; ++i) {
          const bool first_first = i % 2 == 1;  // alternate which runs first
          double t_first = 0, t_off = 0;
          for (int k = 0; k < 2; ++k) {
            const bool is_first = (k == 0) == first_first;
            double step = 0;
            for (const auto& r : run(is_first ? *first : off, model, steps)) {
              step = std::max(step, r["median_step_s"].get<double>());
            }
            (is_first ? t_first : t_off) = step;
          }
          ratios.push_back(t_first / t_off);
          offs.push_back(t_off);
        }
        std::sort(ratios.begin(), ratios.end());
        std::sort(offs.begin(), offs.end());
        fmt::print("| {} | {} | {:.3f} | {:.3f}–{:.3f} | {:.1f} ms |\n", model,
                   first == &on ? "on ÷ off" : "off ÷ off (noise)", ratios[ratios.size() / 2], ratios.front(),
                   ratios.back(), offs[offs.size() / 2] * 1e3);
        std::fflush(stdout);
      }
    }
    fmt::print("\n");
  }
  if (pipeline) {
    fmt::print("### pipeline: MLP of width 1024, depth 4 ({} layers), balanced by time on rank 0\n\n",
               memfit::make_mlp(memfit::ModelOptions().width(1024).depth(4))->size());
    fmt::print("| configuration | layers per stage | step time | samples/s | vs 1 proc × 2 threads | send/recv payload / step / rank "
               "| parameters per rank | optimizer state per rank | step peak per rank | final loss |\n");
    fmt::print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    double baseline = 0;
    for (const auto& c : pipeline_configs()) {
      const auto results = run(c, "mlp", steps);
      double step = 0, payload = 0;
      std::string params, state, peak;
      for (const auto& r : results) {
        step = std::max(step, r["median_step_s"].get<double>());
        payload = std::max(payload, r["payload_per_step"].get<double>());
        params += (params.empty() ? "" : " / ") + mib(r["param_bytes"].get<double>());
        state += (state.empty() ? "" : " / ") + mib(r["optimizer_state"].get<double>());
        peak += (peak.empty() ? "" : " / ") + mib(r["peak"].get<double>());
      }
      if (baseline == 0) baseline = step;
      fmt::print("| {} | {} | {:.1f} ms | {:.0f} | {:.2f}× | {} | {} | {} | {} | {:.4f} |\n", c.name,
                 results.front()["balance"].get<std::string>(), step * 1e3, double(kGlobalBatch) / step,
                 baseline / step, c.ranks > 1 ? mib(payload) : std::string("—"), params, state, peak,
                 results.back()["final_loss"].get<double>());
      std::fflush(stdout);
    }
    fmt::print("\n");
  }
  return 0;
}
