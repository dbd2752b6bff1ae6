// memfit: the command-line tool. Exit codes: 0 success, 1 a run that failed
// (out of memory under the budget, missing data, I/O), 2 bad usage.

#include "compat.h"
#include "memfit/data.h"
#include "memfit/environment.h"
#include "memfit/freeze.h"
#include "memfit/memory.h"
#include "memfit/models.h"
#include "memfit/module_plan.h"
#include "memfit/plan.h"
#include "memfit/precision.h"
#include "memfit/schedule.h"
#include "memfit/state.h"
#include "memfit/trainer.h"
#include "generate.h"
#include "launch.h"
#include "progress.h"
#include "report.h"
#include "usage.h"

#include <c10/core/DeviceGuard.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <regex>
#include <thread>
#include <unistd.h>

namespace {

constexpr int kExitFailure = 1;
// The signal (SIGINT, SIGTERM or SIGHUP) that asked `memfit train` to stop, 0 if none.
volatile std::sig_atomic_t g_signal = 0;
constexpr int kExitUsage = 2;
// The largest batch and step count a flag accepts: far beyond any run here,
// small enough that no product of them overflows.
constexpr int64_t kMaxBatch = int64_t(1) << 24;
constexpr int64_t kMaxSteps = int64_t(1) << 40;

// The model and its data, shared by train, plan, profile and find-batch.
struct ModelArgs {
  std::string model = "resnet";
  int64_t width = 0;
  int64_t depth = 0;
  int64_t heads = 4;
  int64_t context = 128;
  double dropout = 0.0;
  bool selective_recompute = false;
  std::string batch_statistics = "keep";
  int64_t measure_candidates = memfit::PlanOptions().measure_candidates();
  std::string data = memfit::FashionMnistOptions().root();
  std::string text = memfit::JargonOptions().path();
  std::string torchscript;
};

struct TrainArgs : ModelArgs {
  int64_t batch = 64;
  int64_t steps = 300;
  int64_t epochs = 0;
  double lr = 1e-3;
  std::string optimizer = "adam";
  std::string optimizer_kernel = "auto";
  uint64_t seed = 0;
  std::string budget;
  std::string report;
  int64_t eval_batch = 256;
  bool no_eval = false;
  bool quiet = false;
  int threads = 0;
  std::string checkpoint = "none";
  std::string checkpoint_budget;
  bool offload_checkpoints = false;
  std::string precision = "fp32";
  std::string master_weights = "none";
  std::string device = "cpu";
  double clip_grad_norm = 0;
  bool skip_nonfinite = false;
  std::string on_out_of_memory = "auto";
  int64_t micro_batch = 0;
  int64_t prefetch_factor = 0;
  std::vector<std::string> freeze;
  std::vector<std::string> offload;
  std::string offload_tile;
  std::string save;
  int64_t save_every = 0;
  std::string resume;
  int64_t dist_timeout = 60;
  std::string dist_backend = "gloo";
  int64_t zero_stage = 0;
  std::string parallel = "data";
  int64_t chunks = 4;
  std::string schedule = "gpipe";
  std::string pipeline_checkpoint = "never";
  std::string plan = "auto";
};

// memfit plan / memfit profile.
struct PlanArgs : ModelArgs {
  int64_t batch = 64;
  std::string budget;
  std::string optimizer = "adam";
  std::string precision = "fp32";
  std::string device = "cpu";
  bool json = false;
  int threads = 0;
  bool no_verify = false;
  std::string save;  // plan: also write the plan there (save_plan), for train --plan FILE
};

// Parses --checkpoint's value: none, sqrt, optimal, every:K or uniform:K.
memfit::CheckpointedSequentialOptions parse_checkpoint(const std::string& spec) {
  static const std::regex pattern(R"(^(none|sqrt|optimal)$|^(every|uniform):([1-9][0-9]{0,8})$)");
  std::smatch m;
  TORCH_CHECK(std::regex_match(spec, m, pattern), "invalid checkpoint schedule '",
              spec.size() > 40 ? spec.substr(0, 40) + "..." : spec,
              "': expected none, sqrt, optimal, every:K or uniform:K (K a positive integer below 10^9)");
  memfit::CheckpointedSequentialOptions o;
  if (m[1].matched) {
    o.kind(memfit::parse_schedule_kind(m[1].str()));
  } else {
    o.kind(memfit::parse_schedule_kind(m[2].str())).k(std::stoll(m[3].str()));
  }
  return o;
}

// --model and its shape, --data and --text.
void add_model_shape_options(CLI::App* cmd, ModelArgs& a) {
  cmd->add_option("--model", a.model,
                  "Model: mlp, resnet (a ResNet-style CNN), both on Fashion-MNIST, or gpt (a "
                  "decoder-only transformer on the Jargon File's characters)")
      ->check(CLI::IsMember({"mlp", "resnet", "gpt"}))
      ->capture_default_str();
  cmd->add_option("--width", a.width,
                  "MLP hidden width, ResNet first-stage channels or GPT embedding width (0: "
                  "default, 512 / 16 / 128)")
      ->check(memfit::tools::integer(0, 65536))
      ->capture_default_str();
  cmd->add_option("--depth", a.depth,
                  "MLP hidden layers, ResNet blocks per stage or GPT blocks (0: default, 2 / 2 / 4)")
      ->check(memfit::tools::integer(0, 4096))
      ->capture_default_str();
  cmd->add_option("--heads", a.heads, "GPT: attention heads per block (dividing the width)")
      ->check(memfit::tools::integer(1, 4096))
      ->capture_default_str();
  cmd->add_option("--context", a.context, "GPT: tokens per training sequence")
      ->check(memfit::tools::integer(1, 65536))
      ->capture_default_str();
  cmd->add_option("--dropout", a.dropout, "GPT: dropout probability")
      ->check(memfit::tools::real(0, 0.99))
      ->capture_default_str();
  cmd->add_flag("--selective-recompute", a.selective_recompute,
                "GPT: recompute attention scores, softmax and attention dropout in backward "
                "instead of keeping them (Korthikanti et al. 2022)");
  cmd->add_option("--batch-statistics", a.batch_statistics,
                  "Planning a model with BatchNorm: keep its batch statistics (no micro-batches), or "
                  "let micro-batches change them (per-micro-batch)")
      ->check(CLI::IsMember({"keep", "per-micro-batch"}))
      ->capture_default_str();
  cmd->add_option("--measure-candidates", a.measure_candidates,
                  "Planning: time this many of the closest candidates with real steps under the budget, "
                  "and choose the fastest measured (0: choose by prediction alone)")
      ->check(memfit::tools::integer(0, 64))
      ->capture_default_str();
  cmd->add_option("--data", a.data,
                  "Folder with Fashion-MNIST's *-ubyte.gz files (Debian: dataset-fashion-mnist)")
      ->capture_default_str();
  cmd->add_option("--text", a.text, "The Jargon File for --model gpt (Debian: jargon-text)")
      ->capture_default_str();
  cmd->add_option("--torchscript", a.torchscript,
                  "Instead of --model: a TorchScript nn.Sequential saved from Python "
                  "(torch.jit.script(model).save(FILE)) taking Fashion-MNIST images; its top-level "
                  "children are the chain that checkpointing and the planner work on")
      ->check(CLI::ExistingFile);
}

// The model --model names and its data: Fashion-MNIST for mlp and resnet,
// windows of the Jargon File's bytes for gpt.
struct Workload {
  memfit::ModelKind kind = memfit::ModelKind::kMlp;
  memfit::ModelOptions options;
  memfit::ImageDataset train, test;
  std::string vocab;        // gpt: the bytes, by token id
  std::string torchscript;  // a TorchScript file instead of a built-in model

  torch::nn::Sequential make() const {
    return torchscript.empty() ? memfit::make_model(kind, options) : memfit::load_torchscript(torchscript);
  }
};

Workload load_workload(const ModelArgs& a, bool with_test) {
  Workload w;
  w.kind = memfit::parse_model_kind(a.model);
  w.options.width(a.width).depth(a.depth);
  if (w.kind == memfit::ModelKind::kGpt) {
    const auto corpus = memfit::load_jargon_file(memfit::JargonOptions().path(a.text));
    w.options.num_classes(corpus.vocab_size())
        .heads(a.heads)
        .context(a.context)
        .dropout(a.dropout)
        .selective_recompute(a.selective_recompute);
    w.vocab = corpus.vocab;
    w.train = memfit::text_windows(corpus, a.context, memfit::Split::kTrain);
    if (with_test) w.test = memfit::text_windows(corpus, a.context, memfit::Split::kTest);
    return w;
  }
  memfit::FashionMnistOptions o;
  o.root(a.data);
  w.train = memfit::load_fashion_mnist(memfit::Split::kTrain, o);
  if (with_test) w.test = memfit::load_fashion_mnist(memfit::Split::kTest, o);
  if (!a.torchscript.empty()) {
    memfit::load_torchscript(a.torchscript, w.train.images.narrow(0, 0, 2));  // checks that it is a chain
    w.torchscript = a.torchscript;
  }
  return w;
}

// A batch larger than the training set is refused before any profiling or training.
void check_batch_within_data(int64_t batch, const Workload& w) {
  memfit::tools::usage_check(batch <= w.train.size(), "--batch ", batch, " is larger than the training set (",
                             w.train.size(),
                             w.kind == memfit::ModelKind::kGpt ? " windows of the Jargon File" : " Fashion-MNIST images",
                             "): use --batch ", w.train.size(), " or less");
}

void add_train_command(CLI::App& app, TrainArgs& a) {
  auto* train = app.add_subcommand(
      "train", "Train a model on Fashion-MNIST or the Jargon File and report loss, test accuracy and peak memory");
  add_model_shape_options(train, a);
  train->add_option("--batch", a.batch, "Examples per optimizer step (positive)")
      ->check(memfit::tools::integer(1, kMaxBatch))
      ->capture_default_str();
  auto* steps = train->add_option("--steps", a.steps, "Optimizer steps to take (positive)")
                    ->check(memfit::tools::integer(1, kMaxSteps))
                    ->capture_default_str();
  auto* epochs = train->add_option("--epochs", a.epochs,
                                   "Full passes over the training set (instead of --steps)")
                     ->check(memfit::tools::integer(1, 1000000));
  steps->excludes(epochs);
  train->add_option("--lr", a.lr, "Learning rate (positive)")
      ->check(memfit::tools::real(0, 3.4e38, /*open_lo=*/true))
      ->capture_default_str();
  train->add_option("--optimizer", a.optimizer, "Optimizer: sgd (momentum 0.9), adam or adamw")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}))
      ->capture_default_str();
  train->add_option("--optimizer-kernel", a.optimizer_kernel,
                    "The optimizer's kernel: auto (fused where LibTorch has it, 2.4 and later; else loop), "
                    "fused, or loop (bitwise LibTorch's torch::optim)")
      ->check(CLI::IsMember({"auto", "fused", "loop"}))
      ->capture_default_str();
  train->add_option("--seed", a.seed, "Seed of the parameter initialisation and data shuffling")
      ->check(memfit::tools::integer(0, std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
  train->add_option("--budget", a.budget,
                    "Memory budget for tensors, e.g. 512MiB, 2GiB, 1.5GB or bytes; "
                    "a step over it fails with an out-of-memory error (exit 1)")
      ->check(memfit::tools::memory_size());
  train->add_option("--report", a.report,
                    "Write per-step loss, seconds and peak bytes and a summary as JSON to FILE")
      ->check(memfit::tools::path("file"));
  train->add_option("--eval-batch", a.eval_batch, "Examples per evaluation forward (positive)")
      ->check(memfit::tools::integer(1, kMaxBatch))
      ->capture_default_str();
  train->add_flag("--no-eval", a.no_eval, "Skip the evaluation on the test set");
  train->add_flag("-q,--quiet", a.quiet, "No progress display");
  train->add_option("--dist-timeout", a.dist_timeout,
                    "Under `memfit launch` (or torchrun, srun, mpirun): seconds a rank waits for "
                    "the others before it stops with an error naming them")
      ->check(memfit::tools::integer(1, 604800))
      ->capture_default_str();
  train->add_option("--dist-backend", a.dist_backend,
                    "Under `memfit launch`: the process group's backend, as in PyTorch's "
                    "init_process_group: gloo (host tensors; CUDA ones staged through the host) or "
                    "nccl (with --device cuda, one GPU per rank: rank r uses cuda:LOCAL_RANK)")
      ->check(CLI::IsMember({"gloo", "nccl"}))
      ->capture_default_str();
  train->add_option("--zero-stage", a.zero_stage,
                    "Under `memfit launch`: 1 shards the optimizer state over the ranks (ZeRO "
                    "stage 1: each rank keeps about 1/N of it), 0 keeps it whole on every rank")
      ->check(CLI::IsMember({0, 1}))
      ->capture_default_str();
  train->add_option("--parallel", a.parallel,
                    "Under `memfit launch`: data (each rank holds the model and a share of the batch) "
                    "or pipeline (each rank holds consecutive layers, balanced by their time, and the "
                    "batch flows through them in --chunks)")
      ->check(CLI::IsMember({"data", "pipeline"}))
      ->capture_default_str();
  train->add_option("--chunks", a.chunks, "With --parallel pipeline: micro-batches per batch")
      ->check(memfit::tools::integer(1, 4096))
      ->capture_default_str();
  train->add_option("--schedule", a.schedule,
                    "With --parallel pipeline: gpipe (all forwards, then all backwards) or 1f1b "
                    "(one forward, one backward: fewer chunks' activations alive)")
      ->check(CLI::IsMember({"gpipe", "1f1b"}))
      ->capture_default_str();
  train->add_option("--pipeline-checkpoint", a.pipeline_checkpoint,
                    "With --parallel pipeline: which chunks each stage recomputes in backward instead "
                    "of keeping their activations: never, except_last (PyTorch Pipe's default) or always")
      ->check(CLI::IsMember({"never", "except_last", "always"}))
      ->capture_default_str();
  train->add_option("--checkpoint", a.checkpoint,
                    "Activation checkpointing: none, sqrt (Chen et al.), every:K layers, "
                    "uniform:K segments (checkpoint_sequential), or optimal (needs "
                    "--checkpoint-budget)")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            try {
              parse_checkpoint(v);
              return {};
            } catch (const c10::Error& e) {
              return e.msg();
            }
          },
          "SCHEDULE"))
      ->capture_default_str();
  train->add_option("--checkpoint-budget", a.checkpoint_budget,
                    "Memory for the model's activations under --checkpoint optimal, e.g. 24MiB: "
                    "the schedule with the least recomputation that fits")
      ->check(memfit::tools::memory_size());
  train->add_flag("--offload-checkpoints", a.offload_checkpoints,
                  "Keep checkpointed segments' inputs in host memory until backward");
  train->add_option("--precision", a.precision,
                    "Compute precision: fp32, bf16 (autocast), fp16 (autocast and a GradScaler), "
                    "auto (bf16 where the device supports it, else fp16), or any (with --budget: the plan "
                    "may choose fp32 or auto's, which changes the math)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16", "auto", "any"}))
      ->capture_default_str();
  train->add_option("--master-weights", a.master_weights,
                    "Hold parameters in the --precision dtype with fp32 master copies: none, "
                    "device, or host (masters and optimizer state in host memory)")
      ->check(CLI::IsMember({"none", "device", "host"}))
      ->capture_default_str();
  train->add_option("--device", a.device, "Device to train on: cpu, cuda or cuda:N")
      ->capture_default_str();
  train->add_option("--clip-grad-norm", a.clip_grad_norm,
                    "Clip the gradients' total 2-norm to this, after unscaling (0: no clipping)")
      ->check(memfit::tools::real(0, 1e12))
      ->capture_default_str();
  train->add_flag("--skip-nonfinite", a.skip_nonfinite,
                  "Skip steps whose loss is NaN or infinite instead of stopping");
  train->add_option("--on-out-of-memory", a.on_out_of_memory,
                    "A step that runs out of memory: replan (undo it, re-plan with more micro-batches, or "
                    "recomputation where micro-batches would change batch statistics, and run it again: the "
                    "same gradients; data-parallel ranks re-plan together), throw (end the run, exit 1), or auto "
                    "(replan, except for a pipeline or --zero-stage 1)")
      ->check(CLI::IsMember({"auto", "replan", "throw"}))
      ->capture_default_str();
  train->add_option("--micro-batch", a.micro_batch,
                    "Examples per forward/backward; gradients accumulate over the --batch "
                    "(0: the whole batch at once)")
      ->check(memfit::tools::integer(0, kMaxBatch))
      ->capture_default_str();
  train->add_option("--prefetch-factor", a.prefetch_factor,
                    "Batches read ahead on a reading thread while the step runs, pinned for a CUDA "
                    "device (0: each batch is read when its step starts)")
      ->check(memfit::tools::integer(0, 64))
      ->capture_default_str();
  train->add_option("--freeze", a.freeze,
                    "Freeze the parameters whose names match this glob, e.g. 'fc0.*' or "
                    "'stem_*' (repeatable)");
  train->add_option("--offload", a.offload,
                    "Keep in host memory: optimizer (fp32 masters and optimizer state, stepped "
                    "there), gradients (moved to the host as backward produces them; needs "
                    "optimizer), parameters (streamed to the device layer by layer; needs "
                    "optimizer,gradients; fp32, one process) and/or checkpoints (like "
                    "--offload-checkpoints); comma-separated")
      ->delimiter(',')
      ->check(CLI::IsMember({"optimizer", "gradients", "parameters", "checkpoints"}));
  train->add_option("--offload-tile", a.offload_tile,
                    "With --offload parameters: run Linear weights larger than SIZE in tiles of at "
                    "most SIZE (e.g. 256KiB), so the device holds one tile instead of the weight; "
                    "default: untiled")
      ->check(memfit::tools::memory_size());
  auto* save = train->add_option("--save", a.save,
                                 "Save a checkpoint (model, optimizer, scaler, RNG, data position) "
                                 "to DIR/checkpoint.pt at the end, atomically")
                   ->check(memfit::tools::path("folder"));
  train->add_option("--save-every", a.save_every, "Also save every N steps (needs --save)")
      ->check(memfit::tools::integer(1, kMaxSteps))
      ->needs(save);
  train->add_option("--resume", a.resume,
                    "Continue the run saved in DIR (same model and options) up to --steps")
      ->check(memfit::tools::path("folder"));
  train->add_option("--plan", a.plan,
                    "With --budget: auto picks micro-batch, checkpoint schedule and optimizer "
                    "offload to fit (unless set by hand); none runs as configured; FILE trains with the "
                    "plan that `memfit plan --save FILE` (or a run's --save, as DIR/plan.json) wrote, "
                    "under its budget")
      ->capture_default_str();
  train->add_option("--threads", a.threads,
                    "CPU threads for LibTorch's kernels (0: OMP_NUM_THREADS if set, else every hardware thread)")
      ->check(memfit::tools::integer(0, 4096))
      ->capture_default_str();
}

void add_model_options(CLI::App* cmd, PlanArgs& a) {
  add_model_shape_options(cmd, a);
  cmd->add_option("--batch", a.batch, "Examples per optimizer step (positive)")
      ->check(memfit::tools::integer(1, kMaxBatch))
      ->capture_default_str();
  cmd->add_option("--optimizer", a.optimizer, "Optimizer: sgd (momentum 0.9), adam or adamw")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}))
      ->capture_default_str();
  cmd->add_option("--precision", a.precision,
                  "Precision: fp32, bf16, auto (bf16 where supported), or any (the planner "
                  "may choose fp32 or bf16)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16", "auto", "any"}))
      ->capture_default_str();
  cmd->add_option("--device", a.device, "Device: cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_flag("--json", a.json, "Print JSON instead of a table");
  cmd->add_option("--threads", a.threads, "CPU threads (0: OMP_NUM_THREADS if set, else every hardware thread)")
      ->check(memfit::tools::integer(0, 4096));
}

// --budget, required by plan and find-batch.
void add_budget_option(CLI::App* cmd, PlanArgs& a) {
  cmd->add_option("--budget", a.budget, "Memory budget, e.g. 32MiB")
      ->required()
      ->check(memfit::tools::memory_size());
}

void add_plan_commands(CLI::App& app, PlanArgs& a) {
  auto* plan = app.add_subcommand(
      "plan", "Choose the fastest micro-batch, checkpoint schedule, precision and offload that "
              "fit a memory budget, with the predicted peak and why");
  add_model_options(plan, a);
  add_budget_option(plan, a);
  plan->add_option("--save", a.save, "Also write the plan to FILE, atomically, for `memfit train --plan FILE`")
      ->check(memfit::tools::path("file"));
  auto* profile = app.add_subcommand(
      "profile", "Measure each layer's activation bytes and time, and predict the step's peak");
  add_model_options(profile, a);
  auto* find = app.add_subcommand(
      "find-batch", "The largest batch that fits a budget in one pass, plainly and with memfit's "
                    "techniques, predicted then verified by real steps; and the plan for --batch");
  add_model_options(find, a);
  add_budget_option(find, a);
  find->add_flag("--no-verify", a.no_verify, "Predict only; skip the verifying steps");
}

// Parses --device: cpu, cuda or cuda:N, on a build and machine that has it.
torch::Device parse_device(const std::string& text) {
  static const std::regex pattern(R"(^cpu$|^cuda(:[0-9]+)?$)");
  TORCH_CHECK(std::regex_match(text, pattern), "invalid device '", text,
              "': expected cpu, cuda or cuda:N");
  torch::Device device(text);
  if (device.is_cuda()) {
    TORCH_CHECK(torch::cuda::is_available(),
                "--device ", text, ": no CUDA device is available to this build of memfit "
                "(LibTorch ", TORCH_VERSION, "); use --device cpu");
    TORCH_CHECK(!device.has_index() || device.index() < static_cast<int>(torch::cuda::device_count()),
                "--device ", text, ": there are only ", torch::cuda::device_count(), " CUDA devices");
  }
  return device;
}

// The precisions a plan may use for --precision TEXT.
std::vector<memfit::Precision> plan_precisions(const std::string& text, const torch::Device& device) {
  if (text == "any") {
    std::vector<memfit::Precision> out = {memfit::Precision::kFP32};
    const auto low = memfit::auto_precision(device);
    try {
      memfit::check_precision_supported(low, device);
      out.push_back(low);
    } catch (const c10::Error&) {
    }
    return out;
  }
  return {text == "auto" ? memfit::auto_precision(device) : memfit::parse_precision(text)};
}

// The warning for bf16 alone on a CPU that computes it through LibTorch's
// fallback kernels (no AVX-512 BF16), or empty.
std::string precision_warning(const std::vector<memfit::Precision>& precisions, const torch::Device& device) {
  if (!device.is_cpu() || memfit::cpu_computes_bf16_natively() || precisions.size() != 1 ||
      precisions[0] != memfit::Precision::kBF16) {
    return "";
  }
  return "bf16 on a CPU without AVX-512 BF16: LibTorch's fallback bf16 kernels run slower than fp32 here and may "
         "hold more bytes for backward; --precision any times both, --precision fp32 keeps the math";
}

// Sets LibTorch's intra-op threads: --threads, else OMP_NUM_THREADS as
// LibTorch read it (memfit launch sets it to the cores a worker has), else
// every hardware thread. More threads than hardware threads are capped, with
// a warning: OpenMP threads spin, and oversubscribed cores slow LibTorch down
// many times over (two processes of two threads on two cores: 5x a step).
// Returns the one-line warning of a BLAS that slows LibTorch down, if any
// and `speak`, for the caller to print once its usage checks are done.
std::string set_threads(int threads, bool speak = true) {
  const int hw = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  if (threads > hw && speak) {
    fmt::print(stderr, "memfit: warning: --threads {} is more than this machine's {} hardware threads; using {}\n",
               threads, hw, hw);
  }
  const char* omp = std::getenv("OMP_NUM_THREADS");
  at::set_num_threads(threads > 0            ? std::min(threads, hw)
                      : omp && omp[0] != '\0' ? std::min(at::get_num_threads(), hw)
                                             : hw);
  return speak ? memfit::check_blas() : std::string();
}

void print_warning(const std::string& warning) {
  if (!warning.empty()) fmt::print(stderr, "memfit: warning: {}\n", warning);
}

// The model's flags, checked by building it once in host memory under a
// quarter of this machine's memory: a shape the library refuses, or one
// whose training (fp32 parameters, gradients and two optimizer moments: 16
// bytes a parameter) cannot fit this machine, is a usage error.
void check_model_fits(const ModelArgs& a) {
  using memfit::tools::usage_check;
  const auto kind = memfit::parse_model_kind(a.model);
  usage_check(a.torchscript.empty() || kind != memfit::ModelKind::kGpt,
              "--torchscript models take Fashion-MNIST images: leave out --model gpt");
  usage_check(!a.selective_recompute || (kind == memfit::ModelKind::kGpt && a.torchscript.empty()),
              "--selective-recompute recomputes attention, which only --model gpt has: leave it out, "
              "or use --model gpt");
  if (!a.torchscript.empty()) return;
  memfit::ModelOptions o;
  o.width(a.width).depth(a.depth);
  if (kind == memfit::ModelKind::kGpt) {
    o.num_classes(256).heads(a.heads).context(a.context).dropout(a.dropout).selective_recompute(a.selective_recompute);
  }
  const int64_t machine = memfit::tools::physical_memory();
  int64_t params = -1;  // -1: the parameters alone overran the quarter
  try {
    memfit::memory_allocated(torch::kCPU);  // tracking starts before the build
    memfit::BudgetGuard budget(torch::kCPU, memfit::memory_allocated(torch::kCPU) + machine / 4);
    const auto model = memfit::make_model(kind, o);
    params = 0;
    for (const auto& p : model->parameters()) params += p.numel();
  } catch (const c10::OutOfMemoryError&) {
  } catch (const c10::Error& e) {
    throw memfit::tools::UsageError(e.msg());
  }
  const std::string shape = fmt::format("--model {}{}{}", a.model, a.width > 0 ? fmt::format(" --width {}", a.width) : "",
                                        a.depth > 0 ? fmt::format(" --depth {}", a.depth) : "");
  usage_check(params >= 0, shape, ": its parameters alone need more than a quarter of this machine's ",
              memfit::format_bytes(machine), " of memory; choose a smaller --width or --depth");
  usage_check(params <= machine / 16, shape, " has ", params, " parameters: training them (with their gradients and "
              "the optimizer's two moments, 16 bytes each) needs about ", memfit::format_bytes(16 * params),
              ", more than this machine's ", memfit::format_bytes(machine), "; choose a smaller --width or --depth");
}

// The device and precision flags: a device or precision this machine lacks.
torch::Device check_device_and_precision(const std::string& device_text, const std::string& precision) {
  const auto device = memfit::tools::as_usage([&] { return parse_device(device_text); });
  if (precision != "any") {
    memfit::tools::as_usage([&] {
      memfit::check_precision_supported(
          precision == "auto" ? memfit::auto_precision(device) : memfit::parse_precision(precision), device);
    });
  }
  return device;
}

// Whether --offload names `what` (optimizer, gradients, parameters, checkpoints).
bool offloads_to_host(const TrainArgs& a, const char* what) {
  return std::find(a.offload.begin(), a.offload.end(), what) != a.offload.end();
}

// With a budget, train plans the knobs unless one of them was set by hand.
bool knobs_by_hand(const TrainArgs& a) {
  return a.parallel == "pipeline" || a.micro_batch > 0 || a.checkpoint != "none" || !a.offload.empty() ||
         a.offload_checkpoints || a.master_weights != "none";
}

bool plans_knobs(const TrainArgs& a) { return !a.budget.empty() && a.plan == "auto" && !knobs_by_hand(a); }

// Whether --plan names a saved plan's file (not auto or none).
bool plan_file(const TrainArgs& a) { return a.plan != "auto" && a.plan != "none"; }

// Whether a plan sets the knobs: planned now, or read from --plan FILE.
bool planned(const TrainArgs& a) { return plans_knobs(a) || plan_file(a); }

// The checkpoint file that `--resume` names: the folder's checkpoint.pt, or
// the file itself (as Trainer::resume reads it).
std::string resumed_checkpoint(const std::string& dir_or_checkpoint) {
  namespace fs = std::filesystem;
  return fs::is_directory(dir_or_checkpoint) ? (fs::path(dir_or_checkpoint) / "checkpoint.pt").string()
                                             : dir_or_checkpoint;
}

// Where a run saved under a plan keeps it (--save DIR: DIR/plan.json, beside
// its checkpoint), for `--resume` (the folder or the checkpoint file in it).
std::string saved_plan_path(const std::string& dir_or_checkpoint) {
  return (std::filesystem::path(resumed_checkpoint(dir_or_checkpoint)).parent_path() / "plan.json").string();
}

// Every usage error of `memfit train`, found before any work. Returns the
// plan of --plan FILE, read once here, or nullopt.
// A new run does not replace another run's checkpoint in its --save folder:
// checked before any work, and again once its Trainer holds the folder (a run
// that saved in between, while this one started, keeps its files).
void check_save_is_ours(const TrainArgs& a) {
  const auto checkpoint = (std::filesystem::path(a.save) / "checkpoint.pt").string();
  const bool resumed_here = !a.resume.empty() && memfit::tools::same_file(checkpoint, resumed_checkpoint(a.resume));
  memfit::tools::usage_check(!std::filesystem::exists(checkpoint) || resumed_here, "--save ", a.save,
                             " holds another run's checkpoint.pt, which this run would replace: continue that run "
                             "with --resume ", a.save, ", or save to another folder");
}

std::optional<memfit::ModulePlan> validate_train(const TrainArgs& a) {
  using memfit::tools::usage_check;
  namespace fs = std::filesystem;
  usage_check(a.checkpoint != "optimal" || !a.checkpoint_budget.empty(),
              "--checkpoint optimal needs --checkpoint-budget SIZE, the memory for activations, e.g. "
              "--checkpoint-budget 24MiB");
  usage_check(a.dist_backend != "nccl" || (a.device.rfind("cuda", 0) == 0 && a.parallel != "pipeline"),
              "--dist-backend nccl reduces CUDA tensors in data parallel training: add --device cuda",
              a.parallel == "pipeline" ? " and --parallel data (pipelines run over Gloo)" : "",
              ", or use --dist-backend gloo");
  usage_check(a.master_weights == "none" || a.precision != "fp32", "--master-weights ", a.master_weights,
              " holds parameters in bf16 or fp16: add --precision bf16 (or fp16, auto), or drop --master-weights");
  if (a.parallel == "pipeline") {
    usage_check(a.checkpoint == "none", "--checkpoint schedules one process's chain; a pipeline's stages "
                "checkpoint per chunk: use --pipeline-checkpoint except_last (or always) instead of --checkpoint ",
                a.checkpoint);
  } else {
    usage_check(a.pipeline_checkpoint == "never", "--pipeline-checkpoint needs --parallel pipeline; for one "
                "process or data parallelism use --checkpoint (sqrt, optimal, ...)");
  }
  const auto offloads = [&](const char* what) { return offloads_to_host(a, what); };
  usage_check(a.optimizer_kernel != "fused" || memfit::optim::has_fused_kernels(torch::kCPU),
              "--optimizer-kernel fused needs LibTorch 2.4 or later, and this memfit is built with LibTorch " TORCH_VERSION
              ": use --optimizer-kernel auto or loop");
  usage_check(!offloads("gradients") || offloads("optimizer"), "--offload gradients moves each gradient to "
              "the host masters that the optimizer's offload keeps: use --offload optimizer,gradients");
  usage_check(!offloads("parameters") || (offloads("optimizer") && offloads("gradients")), "--offload "
              "parameters streams the parameters from the host masters that also take the gradients and the "
              "optimizer state: use --offload optimizer,gradients,parameters");
  usage_check(a.offload_tile.empty() || offloads("parameters"), "--offload-tile cuts streamed Linear "
              "weights into tiles: add --offload optimizer,gradients,parameters, or drop --offload-tile");
  usage_check(a.precision != "any" || planned(a), "--precision any lets the plan choose the precision, "
              "and only a --budget with nothing set by hand (--micro-batch, --checkpoint, --offload, "
              "--master-weights, --parallel pipeline, --plan none) is planned: add --budget SIZE, or name one "
              "precision (fp32, bf16, fp16, auto)");
  usage_check(!plans_knobs(a) || a.batch >= 4, "--batch ", a.batch, " under --budget: the planner measures the "
              "step in micro-batches of two sizes, so it plans batches of 4 examples or more; use --batch 4 or "
              "more, or set the knobs by hand (--plan none)");
  check_device_and_precision(a.device, a.precision);
  const std::string resumed = a.resume.empty() ? "" : resumed_checkpoint(a.resume);
  usage_check(resumed.empty() || fs::is_regular_file(resumed), "--resume ", a.resume, ": no checkpoint file at ",
              resumed, "; give the folder that --save wrote");
  std::optional<memfit::ModulePlan> given;
  if (plan_file(a)) {
    usage_check(!knobs_by_hand(a), "--plan ", a.plan, " sets the micro-batch, checkpointing and offload itself: "
                "drop --micro-batch, --checkpoint, --offload, --master-weights and --parallel pipeline, or use "
                "--plan none");
    usage_check(fs::is_regular_file(a.plan), "--plan ", a.plan, ": neither auto, none nor a plan's file; "
                "`memfit plan --save FILE` writes one");
    given = memfit::tools::as_usage([&] { return memfit::load_plan(a.plan); });  // readable, before any work
  }
  if (const auto saved = resumed.empty() ? std::string() : saved_plan_path(a.resume); plans_knobs(a) && fs::exists(saved)) {
    try {  // readable, before any work
      memfit::load_plan(saved);
    } catch (const c10::Error& e) {
      usage_check(false, "--resume ", a.resume, ": ", e.msg(), "; or delete it, and the resumed run plans again");
    }
  }
  // No output replaces an input or another output (compared by resolved path).
  std::vector<std::string> inputs = {a.torchscript, a.text, plan_file(a) ? a.plan : ""};
  std::error_code ec;
  if (fs::is_directory(a.data, ec)) {
    for (const auto& e : fs::directory_iterator(a.data, ec)) {
      if (e.is_regular_file(ec)) inputs.push_back(e.path().string());
    }
  }
  const std::vector<std::string> saved_files =
      a.save.empty() ? std::vector<std::string>{}
                     : std::vector<std::string>{(fs::path(a.save) / "checkpoint.pt").string(),
                                                (fs::path(a.save) / "model.json").string(), saved_plan_path(a.save)};
  if (!a.report.empty()) {
    auto report_inputs = inputs;
    if (!a.resume.empty()) {
      for (const auto& f : {resumed, (fs::path(a.resume) / "model.json").string(), saved_plan_path(a.resume)}) {
        report_inputs.push_back(f);
      }
    }
    memfit::tools::check_output("--report", a.report, report_inputs);
    memfit::tools::check_outputs_apart("--report", a.report, "--save", saved_files);
  }
  if (!a.save.empty()) {
    memfit::tools::as_usage([&] { memfit::check_output_folder(a.save); });
    // A resumed run may save where it resumed from; --plan's own file is written back unchanged.
    auto plan_inputs = inputs;
    plan_inputs[2].clear();
    for (size_t i = 0; i < saved_files.size(); ++i) {
      const auto& from = i == 2 ? plan_inputs : inputs;
      if (i == 2 && !planned(a)) continue;
      if (fs::is_directory(a.save)) {
        memfit::tools::check_output("--save", saved_files[i], from);  // writable, and no input
      } else {
        for (const auto& input : from) {  // the folder is made at the end: compared by path only
          memfit::tools::usage_check(!memfit::tools::same_file(saved_files[i], input), "--save ", a.save, " would write ",
                                     saved_files[i], ", which is also an input of this command: save elsewhere");
        }
      }
    }
  }
  // One run per folder, and a new run does not replace another's checkpoint
  // (the Trainer holds the folder from its start; only rank 0 writes).
  if (!a.save.empty() && fs::is_directory(a.save) && memfit::world_from_env().rank == 0) {
    memfit::tools::as_usage([&] { memfit::FolderLock held(a.save, "--save"); });
    check_save_is_ours(a);
  }
  check_model_fits(a);
  return given;
}

memfit::BatchStatistics batch_statistics(const ModelArgs& a) {
  return a.batch_statistics == "per-micro-batch" ? memfit::BatchStatistics::kPerMicroBatch
                                                 : memfit::BatchStatistics::kKeep;
}

// Every usage error of `memfit plan`, `profile` and `find-batch`.
void validate_model_command(const PlanArgs& a) {
  check_device_and_precision(a.device, a.precision);
  if (!a.save.empty()) memfit::tools::check_output("--save", a.save, {a.torchscript});
  memfit::tools::usage_check(a.batch >= 4, "--batch ", a.batch, ": the planner measures the step in micro-batches of two "
              "sizes, so it plans batches of 4 examples or more; use --batch 4 or more");
  check_model_fits(a);
}

// The first `n` training examples: the batch the planner measures and plans
// for (a view of the data set, in host memory like it).
torch::data::Example<> sample_of(const memfit::ImageDataset& data, int64_t n) {
  return {data.images.narrow(0, 0, n), data.labels.narrow(0, 0, n)};
}

// The planner's options from the model flags: the precisions it may use,
// whether it may micro-batch batch statistics, how many candidates it times.
memfit::PlanOptions plan_options(const ModelArgs& a, const std::vector<memfit::Precision>& precisions) {
  return memfit::PlanOptions()
      .precisions(precisions)
      .batch_statistics(batch_statistics(a))
      .measure_candidates(a.measure_candidates)
      .selective_recompute(a.selective_recompute ? memfit::SelectiveRecompute::kOn
                                                 : memfit::SelectiveRecompute::kChoose);
}

// The built-in or TorchScript model as `train` trains it: its layers in one
// chain (named "0"), where the plan may checkpoint them.
torch::nn::Sequential planned_model(const Workload& w) {
  return torch::nn::Sequential(memfit::CheckpointedSequential(w.make()));
}

// The three commands built on the module planner (module_plan.h), which
// measures the model's real training step as `train` runs it.
enum class ModelCommand { kPlan, kProfile, kFindBatch };

int run_model_command(const PlanArgs& a, ModelCommand command) {
  const torch::Device device = parse_device(a.device);
  memfit::memory_allocated(device);
  const std::string blas_warning = set_threads(a.threads);  // printed once the usage checks pass
  torch::manual_seed(0);
  auto workload = load_workload(a, /*with_test=*/false);
  check_batch_within_data(a.batch, workload);
  print_warning(blas_warning);
  auto model = planned_model(workload);
  auto options = plan_options(a, plan_precisions(a.precision, device));
  const auto base = memfit::TrainerOptions()
                        .optimizer(memfit::parse_optimizer_kind(a.optimizer))
                        .device(device)
                        .batch_size(a.batch);
  if (command == ModelCommand::kProfile) {
    // The model as built (with --selective-recompute, its blocks recompute),
    // in the first precision, nothing else measured.
    options.offload(false).selective_recompute(a.selective_recompute ? memfit::SelectiveRecompute::kOn
                                                                     : memfit::SelectiveRecompute::kOff);
    const auto p = memfit::profile(model, sample_of(workload.train, a.batch), options, base);
    if (a.json) {
      fmt::print("{}\n", p.to_json());
    } else {
      fmt::print("profile of {} at batch {} ({}):\n{}", a.torchscript.empty() ? a.model : a.torchscript, a.batch,
                 memfit::to_string(p.precision), p.table());
    }
    return 0;
  }
  const int64_t budget = memfit::parse_memory_size(a.budget);
  options = memfit::detail::measuring_within(options, budget);  // measuring keeps within the budget it plans for
  if (command == ModelCommand::kPlan) {
    const auto plan = memfit::plan(model, sample_of(workload.train, a.batch), budget, options, base);
    if (!a.save.empty()) memfit::save_plan(plan, a.save);  // memfit train --plan FILE trains with it
    fmt::print("{}", a.json ? plan.to_json() + "\n" : memfit::tools::with_flag_names(plan.explain()));
    return 0;
  }
  // find-batch: the step measured on the data set's first examples, as many
  // as a verified answer may run.
  // One measured model answers both: the largest batches and the plan for --batch.
  const auto find = memfit::FindBatchOptions().verify(!a.no_verify);
  const int64_t examples = std::min(workload.train.size(), std::max(find.max_batch(), a.batch));
  const memfit::ModuleStepModel step(memfit::detail::make_probe(model, sample_of(workload.train, examples)),
                                     memfit::PlanOptions(options).verify(!a.no_verify), base);
  const auto found = memfit::find_batch(step, budget, find);
  std::optional<memfit::ModulePlan> logical;  // micro-batched, for --batch
  try {
    logical = memfit::plan(step, budget, a.batch);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "memfit find-batch: {}\n", memfit::tools::with_flag_names(e.msg()));
  }
  const int rc = found.plain.batch > 0 || found.techniques.batch > 0 ? 0 : 1;
  if (a.json) {
    auto j = nlohmann::json::parse(found.to_json());
    if (logical) j["plan_for_batch"] = nlohmann::json::parse(logical->to_json());
    fmt::print("{}\n", j.dump(2));
    return rc;
  }
  fmt::print("{}{}", found.explain(),
             logical ? fmt::format("any logical batch fits with micro-batching; for --batch {}:\n{}", a.batch,
                                   memfit::tools::with_flag_names(logical->explain()))
                     : std::string());
  return rc;
}

// The plan that the resumed run saved (saved_plan_path) where it suits this
// run (plan_mismatch): a resumed run keeps its micro-batches, precision,
// offload and schedules, which planning again may not choose (candidates
// within the timing's noise), and which its checkpoint and its math depend
// on. nullopt where there is none, or it does not suit (the line says why).
std::optional<memfit::ModulePlan> resumed_plan(const TrainArgs& a, const torch::nn::Module& model, int64_t budget,
                                               const memfit::PlanOptions& options) {
  const auto path = a.resume.empty() ? std::string() : saved_plan_path(a.resume);
  if (path.empty() || !std::filesystem::exists(path)) return std::nullopt;
  auto saved = memfit::tools::as_usage([&] { return memfit::load_plan(path); });
  if (const auto why = memfit::plan_mismatch(saved, model, a.batch, budget, options); !why.empty()) {
    fmt::print("plan: the saved run's plan ({}) does not suit this run: {}; planning again, and the checkpoint "
               "may refuse what the new plan changes (the saved run's options keep its plan)\n",
               path, memfit::tools::with_flag_names(why));
    return std::nullopt;
  }
  fmt::print("plan: the saved run's, read from {}, not planned again: a resumed run keeps its micro-batches, "
             "precision, offload and schedules\n", path);
  return saved;
}

// The plan of --plan FILE where it suits this run (plan_mismatch); a usage
// error where it does not: the user named it.
memfit::ModulePlan given_plan(const TrainArgs& a, const memfit::ModulePlan& given, const torch::nn::Module& model,
                              int64_t budget, const memfit::PlanOptions& options) {
  const auto why = memfit::plan_mismatch(given, model, a.batch, budget, options);
  memfit::tools::usage_check(why.empty(), "--plan ", a.plan, " does not suit this run: ",
                             memfit::tools::with_flag_names(why), "; train with the flags it was planned with "
                             "(--batch ", given.batch, " and --budget ", given.budget, " or none), or plan again "
                             "with --plan auto");
  fmt::print("plan: read from {}, not planned again\n", a.plan);
  return given;
}

// `given`: the plan of --plan FILE (validate_train), or nullopt.
int run_train(const TrainArgs& a, const std::optional<memfit::ModulePlan>& given) {
  const torch::Device device = parse_device(a.device);
  // Data parallel when started by `memfit launch`, torchrun, srun or mpirun.
  const auto world = memfit::world_from_env();
  memfit::tools::usage_check(a.on_out_of_memory != "replan" || (a.parallel != "pipeline" && a.zero_stage == 0),
                             "--on-out-of-memory replan re-plans data-parallel ranks together, not ",
                             a.parallel == "pipeline" ? "a pipeline's stages" : "a sharded optimizer (--zero-stage 1)",
                             ": use --on-out-of-memory throw (or auto)");
  std::shared_ptr<memfit::ProcessGroup> group;
  std::optional<c10::DeviceGuard> device_guard;
  if (world.distributed()) {
    if (a.dist_backend == "nccl") {
      // One GPU per rank, as torch.cuda.set_device(local_rank) chooses it;
      // NCCL reduces on the current device.
      const auto gpus = static_cast<int64_t>(torch::cuda::device_count());
      TORCH_CHECK(world.local_rank < gpus, "rank ", world.rank, " (local rank ", world.local_rank,
                  ") needs a GPU of its own for NCCL, and this machine has ", gpus,
                  "; start at most that many processes per machine, or use --dist-backend gloo");
      device_guard.emplace(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(world.local_rank)));
    }
    group = std::make_shared<memfit::ProcessGroup>(
        world, memfit::ProcessGroupOptions()
                   .timeout(std::chrono::seconds(a.dist_timeout))
                   .backend(a.dist_backend == "nccl" ? memfit::ProcessGroupBackend::kNccl
                                                     : memfit::ProcessGroupBackend::kGloo));
    // Rank 0 speaks for the job; the others print errors only.
    if (world.rank != 0 && std::freopen("/dev/null", "w", stdout) == nullptr) return kExitFailure;
  }
  memfit::memory_allocated(device);  // begins tracking before anything is allocated
  torch::manual_seed(a.seed);
  const std::string blas_warning = set_threads(a.threads, world.rank == 0);  // printed after the resume check

  const auto workload = load_workload(a, /*with_test=*/!a.no_eval);
  check_batch_within_data(a.batch, workload);
  const auto& train_data = workload.train;
  const auto& test_data = workload.test;

  // --plan FILE (given): the saved plan, checked against this run once the model is built.
  const int64_t budget = !a.budget.empty() ? memfit::parse_memory_size(a.budget) : given ? given->budget : 0;

  auto chain = workload.make();
  auto ck_options = parse_checkpoint(a.checkpoint);
  if (ck_options.kind() == memfit::ScheduleKind::kOptimal) {
    ck_options.budget(memfit::parse_memory_size(a.checkpoint_budget));
  }
  const auto offloads = [&](const char* what) { return offloads_to_host(a, what); };
  for (const auto& pattern : a.freeze) {  // the names exist only once the model is built
    memfit::tools::as_usage([&] { memfit::freeze(*chain, pattern); });
  }
  ck_options.checkpoint(memfit::CheckpointOptions().offload(
      a.offload_checkpoints || offloads("checkpoints") ? memfit::Offload::kHost
                                                       : memfit::Offload::kNone));
  const auto precisions = plan_precisions(a.precision, device);  // "any": the plan's choice of these
  const bool pipelined = a.parallel == "pipeline";
  // A pipeline's stages balance the layers' time, measured on rank 0 (its balance is used everywhere).
  std::vector<int64_t> balance;
  if (pipelined && world.rank == 0 && world.world_size <= static_cast<int64_t>(chain->size())) {
    const int64_t chunk = (a.batch + a.chunks - 1) / a.chunks;
    chain->to(device);
    balance = memfit::balance_by_time(chain, train_data.images.narrow(0, 0, std::min(chunk, train_data.size())).to(device),
                                      world.world_size);
  }
  memfit::CheckpointedSequential checkpointed(chain, ck_options);
  torch::nn::Sequential model = pipelined ? chain : torch::nn::Sequential(checkpointed);
  memfit::TrainerOptions options;
  options.batch_size(a.batch)
      .prefetch_factor(a.prefetch_factor)
      .steps(a.epochs > 0 ? 0 : a.steps)
      .epochs(std::max<int64_t>(a.epochs, 1))
      .lr(a.lr)
      .optimizer(memfit::parse_optimizer_kind(a.optimizer))
      .optimizer_kernel(memfit::optim::parse_kernel(a.optimizer_kernel))
      .seed(a.seed)
      .eval_batch_size(a.eval_batch)
      .device(device)
      .precision(precisions.front())
      .master_weights(memfit::parse_master_weights_mode(a.master_weights))
      .max_grad_norm(a.clip_grad_norm)
      .nonfinite_loss(a.skip_nonfinite ? memfit::NonfiniteLoss::kSkip
                                       : memfit::NonfiniteLoss::kError)
      .micro_batch_size(a.micro_batch)
      .offload_optimizer(offloads("optimizer") ? memfit::Offload::kHost : memfit::Offload::kNone)
      .offload_gradients(offloads("gradients") ? memfit::Offload::kHost : memfit::Offload::kNone)
      .offload_parameters(offloads("parameters") ? memfit::Offload::kHost : memfit::Offload::kNone)
      .stream(memfit::StreamOptions().tile_bytes(a.offload_tile.empty() ? 0 : memfit::parse_memory_size(a.offload_tile)))
      .save_dir(a.save)
      .save_every(a.save_every)
      .process_group(group)
      .zero_stage(a.zero_stage)
      .parallel(memfit::parse_parallel_mode(a.parallel))
      .pipeline(memfit::PipelineOptions()
                    .chunks(a.chunks)
                    .schedule(memfit::parse_pipeline_schedule(a.schedule))
                    .checkpoint(memfit::parse_pipeline_checkpoint(a.pipeline_checkpoint))
                    .balance(balance));
  std::optional<memfit::ModulePlan> plan;
  if (planned(a)) {
    // The planner measures this run's own step (Trainer(model, options)), in
    // one process and saving nothing; the plan then sets its knobs.
    const auto measured = memfit::TrainerOptions(options).process_group(nullptr).zero_stage(0).save_dir("");
    const auto planning = plan_options(a, precisions);
    plan = given ? given_plan(a, *given, *model, budget, planning) : resumed_plan(a, *model, budget, planning);
    if (!plan) plan = memfit::plan(model, sample_of(train_data, a.batch), budget, planning, measured);
    // Data-parallel ranks planned alike but timed apart: they train with rank 0's plan.
    if (group) memfit::broadcast_plan(*plan, *group);
    options = plan->apply(*model, options);
    // Evaluation forwards no more examples at once than a training
    // micro-batch, which the plan fitted with grad.
    options.eval_batch_size(std::min<int64_t>(a.eval_batch, plan->settings.micro_batch() > 0
                                                               ? plan->settings.micro_batch()
                                                               : a.batch));
    fmt::print("{}", memfit::tools::with_flag_names(plan->explain()));
  }
  if (!plan && budget > 0 && a.plan == "auto") {
    fmt::print("plan: none ({})\n", pipelined ? "the planner plans one process; a pipeline splits the model"
                                               : "micro-batch, checkpointing, offload or master weights set by hand");
  }
  memfit::set_memory_budget(device, budget);
  int64_t params = 0, frozen = 0;  // of the whole model
  for (const auto& p : chain->parameters()) {
    params += p.numel();
    frozen += p.requires_grad() ? 0 : p.numel();
  }
  const std::string schedule_text =
      pipelined ? "none (pipeline stages)" : checkpointed->schedule().to_string();
  // Recovery from out of memory (--on-out-of-memory): every model here is a chain, so a model with
  // batch statistics recomputes it rather than micro-batching, unless --batch-statistics allows it.
  if (a.on_out_of_memory == "replan" || (a.on_out_of_memory == "auto" && !pipelined && a.zero_stage == 0)) {
    options.on_out_of_memory(memfit::OnOutOfMemory::kReplan)
        .replan(memfit::more_micro_batches(*model, a.batch_statistics == "per-micro-batch"));
  }
  // Ranks started with other flags are refused, each in the same line, before any step.
  memfit::tools::as_usage([&] { memfit::check_ranks_agree(*model, options); });
  memfit::Trainer trainer(model, options);
  // The run's peak from here: with streamed parameters the model built in
  // (tracked) memory has just gone to its host masters, as on a GPU, where
  // it would have been built in host memory.
  memfit::reset_peak_memory_stats(device);
  if (!a.resume.empty()) {
    // A checkpoint of other options or another model is a usage error,
    // found before anything is written (the model card below included).
    memfit::tools::as_usage([&] { trainer.resume(a.resume); });
    fmt::print("resumed from {} at step {}\n", a.resume, trainer.step());
  }
  print_warning(blas_warning);
  if (world.rank == 0) print_warning(precision_warning(precisions, device));
  if (!a.save.empty() && world.rank == 0) check_save_is_ours(a);  // the folder is this run's now
  if (!a.save.empty() && world.rank == 0) {  // what `memfit generate` needs to build the model again
    nlohmann::json card = {{"model", a.model},     {"width", a.width},     {"depth", a.depth},
                           {"heads", a.heads},     {"context", a.context}, {"dropout", a.dropout},
                           {"num_classes", workload.options.num_classes()}};
    if (workload.kind == memfit::ModelKind::kGpt) {
      std::vector<int> vocab;
      for (char c : workload.vocab) vocab.push_back(static_cast<unsigned char>(c));
      card["vocab"] = vocab;
    }
    memfit::tools::write_model_card(a.save, card);
    if (plan) memfit::save_plan(*plan, saved_plan_path(a.save));  // --resume trains with it again
  }
  if (pipelined) {  // this rank's stage keeps its layers; the others go now
    chain = nullptr;
    model = nullptr;
    checkpointed = nullptr;
  }

  fmt::print("memfit train: model {} ({} parameters{}), {} training examples, batch {}{}, {} "
             "steps, budget {}\n",
             a.torchscript.empty() ? a.model : "TorchScript " + a.torchscript, params,
             frozen > 0 ? fmt::format(", {} frozen", frozen) : std::string(),
             train_data.size(),
             !group ? std::to_string(a.batch)
             : pipelined
                 ? fmt::format("{} in {} chunks through a pipeline of {} stages ({}, layers {}, {}{}, over Gloo)",
                               a.batch, a.chunks, world.world_size, world.source,
                               fmt::join(trainer.options().pipeline().balance(), "+"), a.schedule,
                               a.pipeline_checkpoint == "never" ? ""
                                                                : ", checkpoint " + a.pipeline_checkpoint)
                 : fmt::format("{} per rank × {} ranks ({}, data parallel over {}{})", a.batch,
                               world.world_size, world.source, a.dist_backend == "nccl" ? "NCCL" : "Gloo",
                               a.zero_stage == 1 ? ", optimizer state sharded: ZeRO stage 1" : ""),
             a.micro_batch > 0 && a.micro_batch < a.batch
                 ? fmt::format(" in micro-batches of {}", a.micro_batch)
                 : std::string(),
             trainer.total_steps(train_data),
             budget > 0 ? memfit::format_bytes(budget) : std::string("none"));
  std::fflush(stdout);

  memfit::tools::ProgressBar bar(trainer.total_steps(train_data), a.batch, stderr,
                                 ::isatty(fileno(stderr)) != 0);
  const auto start = std::chrono::steady_clock::now();
  // SIGINT, SIGTERM and SIGHUP (a closed terminal) end the run after the
  // step in progress, saving first with --save; a second one stops at once.
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    std::signal(sig, [](int received) {
      g_signal = received;
      std::signal(received, SIG_DFL);
    });
  }
  // The library's warnings during the run (a step re-planned after running out of memory), a line each.
  memfit::compat::WarningCapture warnings;
  const auto print_warnings = [&warnings, &bar] {
    for (const auto& w : warnings.messages) bar.note(w);
    warnings.messages.clear();
  };
  auto on_step = [&](const memfit::StepRecord& r) {
    print_warnings();
    if (g_signal != 0) trainer.request_stop();
    if (a.quiet) return;
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    bar.update(r.step, r.loss, secs, r.current_bytes, memfit::max_memory_allocated(device));
  };
  memfit::TrainReport report;
  try {
    if (trainer.step() >= trainer.total_steps(train_data)) {
      fmt::print("the run is complete at step {}: nothing left to train (raise --steps to go "
                 "on)\n", trainer.step());
    } else {
      report = trainer.fit(train_data, on_step);
    }
  } catch (...) {
    print_warnings();
    bar.finish();
    throw;
  }
  bar.finish();
  if (!report.recoveries.empty()) {
    fmt::print("recovered from out of memory {} time{} (--on-out-of-memory replan); the run ended with {}\n",
               report.recoveries.size(), report.recoveries.size() == 1 ? "" : "s", report.recoveries.back().after);
  }
  if (report.stopped) {
    fmt::print("stopped by signal {} after step {}{}\n", static_cast<int>(g_signal), trainer.step(),
               a.save.empty() ? "" : fmt::format("; checkpoint saved to {}/checkpoint.pt (continue with --resume {})",
                                                 a.save, a.save));
  }

  if (!a.no_eval && !report.stopped) {
    report.test = trainer.evaluate(test_data);
    report.evaluated = true;
  }
  // The run's peak: fit and evaluate each reset the peak counter (on CUDA
  // the caching allocator has only one), so take the largest they saw.
  int64_t peak = std::max(memfit::max_memory_allocated(device), report.peak_bytes);
  if (report.evaluated) peak = std::max(peak, report.test.peak_bytes);
  fmt::print("final loss {:.4f} | {:.0f} samples/s | {:.1f} s\n", report.final_loss,
             report.samples_per_second, report.seconds);
  if (report.evaluated) {
    const bool text = workload.kind == memfit::ModelKind::kGpt;
    fmt::print("test accuracy {:.2f}% ({}, loss {:.4f}{}, evaluated under no-grad)\n",
               100.0 * report.test.accuracy,
               text ? fmt::format("next byte of {} sequences of {}", test_data.size(), a.context)
                    : fmt::format("{} examples", test_data.size()),
               report.test.loss, text ? fmt::format(", perplexity {:.2f}", std::exp(report.test.loss)) : "");
  }
  fmt::print("precision {}{}{}\n", report.precision,
             a.master_weights != "none"
                 ? fmt::format(", parameters in {} with fp32 master weights on the {}",
                               report.precision, a.master_weights)
                 : std::string(),
             report.final_scale > 0 ? fmt::format(", loss scale {:g}, {} steps skipped",
                                                  report.final_scale, report.skipped_steps)
                                    : std::string());
  fmt::print("checkpoint schedule: {} (layers [begin,end), * recomputed)\n", schedule_text);
  fmt::print("peak memory {} ({} bytes){}{}\n", memfit::format_bytes(peak), peak,
             budget > 0 ? fmt::format(" of budget {}", memfit::format_bytes(budget)) : "",
             plan ? fmt::format("; the plan predicted {} for a step",
                                memfit::format_bytes(plan->predicted.peak_bytes))
                  : std::string());
  fmt::print("peak of the largest training step:\n{}", report.step_memory.table());
  if (!a.save.empty() && !report.stopped) fmt::print("checkpoint saved to {}/checkpoint.pt\n", a.save);
  if (!a.report.empty() && world.rank == 0) {
    auto json = nlohmann::json::parse(report.to_json());
    json["environment"] = nlohmann::json::parse(memfit::environment().to_json());
    if (plan) {
      json["plan"] = nlohmann::json::parse(plan->to_json());
      json["summary"]["predicted_peak_bytes"] = plan->predicted.peak_bytes;
    }
    memfit::write_file_atomically(a.report, json.dump(2) + "\n");
    fmt::print("report written to {}\n", a.report);
  }
  return report.stopped ? 128 + static_cast<int>(g_signal) : 0;  // as a shell reports the signal
}

} // namespace

int main(int argc, char** argv) {
  // Freed host memory stays in the heap for the next step (environment.h), unless the user configured malloc.
  memfit::keep_freed_host_memory();
  CLI::App app{
      "memfit: train LibTorch models and batches that do not fit in memory.\n"
      "Exit codes: 0 success, 1 failed run (e.g. out of memory under --budget), 2 bad usage.",
      "memfit"};
  app.set_version_flag("--version", [] {  // the BLAS is looked up only when asked for
    return fmt::format("memfit 0.1.0 (LibTorch {}, {}, {}; BLAS: {}; optimizer kernel: {})", TORCH_VERSION,
                       memfit::compat::kBuiltWithCuda ? "CUDA" : "CPU only",
                       memfit::distributed_available() ? (memfit::nccl_available() ? "c10d Gloo and NCCL" : "c10d Gloo") : "no c10d", memfit::blas_info().name(),
                       memfit::optim::has_fused_kernels(torch::kCPU) ? "fused (Adam, AdamW, SGD)" : "loop (no fused kernels before LibTorch 2.4)");
  });
  app.require_subcommand(1);
  TrainArgs train_args;
  add_train_command(app, train_args);
  PlanArgs plan_args;
  add_plan_commands(app, plan_args);
  memfit::tools::LaunchArgs launch_args;
  memfit::tools::add_launch_command(app, launch_args);
  memfit::tools::GenerateArgs generate_args;
  memfit::tools::add_generate_command(app, generate_args);
  std::string report_in, report_out;
  auto* report = app.add_subcommand(
      "report", "Write one self-contained HTML page from a `memfit train --report` JSON: the "
                "memory timeline of the largest step by category, each step's peak against the "
                "plan and the budget, the loss curve and the plan");
  report->add_option("run", report_in, "The run's JSON report")->required()->check(CLI::ExistingFile);
  report->add_option("-o,--output", report_out, "The HTML file to write")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string where = "memfit";
    for (const auto* sub : app.get_subcommands()) where += " " + sub->get_name();
    fmt::print(stderr, "{}: error: {} (see '{} --help')\n", where, memfit::tools::plain_parse_error(e.what()),
               where);
    return kExitUsage;
  }
  std::string where = "memfit";
  for (const auto* sub : app.get_subcommands()) where += " " + sub->get_name();
  try {
    if (app.got_subcommand("train")) {
      const auto given = validate_train(train_args);
      return run_train(train_args, given);
    }
    if (app.got_subcommand("launch")) return memfit::tools::run_launch(launch_args);
    if (app.got_subcommand("generate")) return memfit::tools::run_generate(generate_args);
    for (const auto& [name, command] : {std::pair{"plan", ModelCommand::kPlan},
                                        std::pair{"profile", ModelCommand::kProfile},
                                        std::pair{"find-batch", ModelCommand::kFindBatch}}) {
      if (!app.got_subcommand(name)) continue;
      validate_model_command(plan_args);
      return run_model_command(plan_args, command);
    }
    if (app.got_subcommand("report")) {
      memfit::tools::check_output("--output", report_out, {report_in});
      std::ifstream is(report_in);
      std::stringstream text;
      text << is.rdbuf();
      const std::string title = "memfit run " + std::filesystem::path(report_in).filename().string();
      // A file that is not a report memfit wrote is the caller's mistake: a usage error, before any output.
      const std::string html = memfit::tools::as_usage([&] {
        try {
          return memfit::tools::report_html(text.str(), title);
        } catch (const c10::Error& e) {
          TORCH_CHECK(false, report_in, ": ", e.msg());
        }
      });
      memfit::write_file_atomically(report_out, html);
      fmt::print("report written to {}\n", report_out);
      return 0;
    }
  } catch (const memfit::tools::UsageError& e) {
    fmt::print(stderr, "{}: error: {} (see '{} --help')\n", where, memfit::tools::with_flag_names(e.what()), where);
    return kExitUsage;
  } catch (const c10::Error& e) {
    fmt::print(stderr, "memfit: error: {}\n", memfit::tools::with_flag_names(e.msg()));
    return kExitFailure;
  } catch (const std::exception& e) {
    fmt::print(stderr, "memfit: error: {}\n", e.what());
    return kExitFailure;
  }
  return kExitUsage;
}
