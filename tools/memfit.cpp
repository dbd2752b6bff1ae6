// memfit: the command-line tool. Exit codes: 0 success, 1 a run that failed
// (out of memory under the budget, missing data, I/O), 2 bad usage.

#include "memfit/compat.h"
#include "memfit/data.h"
#include "memfit/freeze.h"
#include "memfit/memory.h"
#include "memfit/models.h"
#include "memfit/precision.h"
#include "memfit/schedule.h"
#include "memfit/state.h"
#include "memfit/trainer.h"
#include "progress.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>
#include <unistd.h>

namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// CLI11 validator for sizes such as 512MiB, 2GiB, 1.5GB or plain bytes.
CLI::Validator memory_size_validator() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        try {
          memfit::parse_memory_size(text);
          return {};
        } catch (const c10::Error& e) {
          return e.msg();
        }
      },
      "SIZE");
}

struct TrainArgs {
  std::string model = "resnet";
  int64_t width = 0;
  int64_t depth = 0;
  int64_t batch = 64;
  int64_t steps = 300;
  int64_t epochs = 0;
  double lr = 1e-3;
  std::string optimizer = "adam";
  uint64_t seed = 0;
  std::string budget;
  std::string data = memfit::FashionMnistOptions().root();
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
  int64_t micro_batch = 0;
  std::vector<std::string> freeze;
  std::vector<std::string> offload;
  std::string save;
  int64_t save_every = 0;
  std::string resume;
};

// Parses --checkpoint's value: none, sqrt, optimal, every:K or uniform:K.
memfit::CheckpointedSequentialOptions parse_checkpoint(const std::string& spec) {
  static const std::regex pattern(R"(^(none|sqrt|optimal)$|^(every|uniform):([1-9][0-9]*)$)");
  std::smatch m;
  TORCH_CHECK(std::regex_match(spec, m, pattern), "invalid checkpoint schedule '", spec,
              "': expected none, sqrt, optimal, every:K or uniform:K (K a positive integer)");
  memfit::CheckpointedSequentialOptions o;
  if (m[1].matched) {
    o.kind(memfit::parse_schedule_kind(m[1].str()));
  } else {
    o.kind(memfit::parse_schedule_kind(m[2].str())).k(std::stoll(m[3].str()));
  }
  return o;
}

void add_train_command(CLI::App& app, TrainArgs& a) {
  auto* train = app.add_subcommand(
      "train", "Train a model on Fashion-MNIST and report loss, test accuracy and peak memory");
  train->add_option("--model", a.model, "Model: mlp or resnet (a ResNet-style CNN)")
      ->check(CLI::IsMember({"mlp", "resnet"}))
      ->capture_default_str();
  train->add_option("--width", a.width,
                    "MLP hidden width or ResNet first-stage channels (0: default, 512 / 16)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  train->add_option("--depth", a.depth,
                    "MLP hidden layers or ResNet blocks per stage (0: default, 2 / 2)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  train->add_option("--batch", a.batch, "Examples per optimizer step (positive)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  auto* steps = train->add_option("--steps", a.steps, "Optimizer steps to take (positive)")
                    ->check(CLI::PositiveNumber)
                    ->capture_default_str();
  auto* epochs = train->add_option("--epochs", a.epochs,
                                   "Full passes over the training set (instead of --steps)")
                     ->check(CLI::PositiveNumber);
  steps->excludes(epochs);
  train->add_option("--lr", a.lr, "Learning rate (positive)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  train->add_option("--optimizer", a.optimizer, "Optimizer: sgd (momentum 0.9), adam or adamw")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}))
      ->capture_default_str();
  train->add_option("--seed", a.seed, "Seed of the parameter initialisation and data shuffling")
      ->capture_default_str();
  train->add_option("--budget", a.budget,
                    "Memory budget for tensors, e.g. 512MiB, 2GiB, 1.5GB or bytes; "
                    "a step over it fails with an out-of-memory error (exit 1)")
      ->check(memory_size_validator());
  train->add_option("--data", a.data,
                    "Folder with Fashion-MNIST's *-ubyte.gz files (Debian: dataset-fashion-mnist)")
      ->capture_default_str();
  train->add_option("--report", a.report,
                    "Write per-step loss, seconds and peak bytes and a summary as JSON to FILE");
  train->add_option("--eval-batch", a.eval_batch, "Examples per evaluation forward (positive)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  train->add_flag("--no-eval", a.no_eval, "Skip the evaluation on the test set");
  train->add_flag("-q,--quiet", a.quiet, "No progress display");
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
      ->check(memory_size_validator());
  train->add_flag("--offload-checkpoints", a.offload_checkpoints,
                  "Keep checkpointed segments' inputs in host memory until backward");
  train->add_option("--precision", a.precision,
                    "Compute precision: fp32, bf16 (autocast), fp16 (autocast and a GradScaler) or "
                    "auto (bf16 where the device supports it, else fp16)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16", "auto"}))
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
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  train->add_flag("--skip-nonfinite", a.skip_nonfinite,
                  "Skip steps whose loss is NaN or infinite instead of stopping");
  train->add_option("--micro-batch", a.micro_batch,
                    "Examples per forward/backward; gradients accumulate over the --batch "
                    "(0: the whole batch at once)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  train->add_option("--freeze", a.freeze,
                    "Freeze the parameters whose names match this glob, e.g. 'fc0.*' or "
                    "'stem_*' (repeatable)");
  train->add_option("--offload", a.offload,
                    "Keep in host memory: optimizer (fp32 masters and optimizer state, stepped "
                    "there) and/or checkpoints (like --offload-checkpoints); comma-separated")
      ->delimiter(',')
      ->check(CLI::IsMember({"optimizer", "checkpoints"}));
  auto* save = train->add_option("--save", a.save,
                                 "Save a checkpoint (model, optimizer, scaler, RNG, data position) "
                                 "to DIR/checkpoint.pt at the end, atomically");
  train->add_option("--save-every", a.save_every, "Also save every N steps (needs --save)")
      ->check(CLI::PositiveNumber)
      ->needs(save);
  train->add_option("--resume", a.resume,
                    "Continue the run saved in DIR (same model and options) up to --steps");
  train->add_option("--threads", a.threads,
                    "CPU threads for LibTorch's kernels (0: every hardware thread)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
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

int run_train(const TrainArgs& a) {
  const torch::Device device = parse_device(a.device);
  memfit::memory_allocated(device);  // begins tracking before anything is allocated
  torch::manual_seed(a.seed);
  const unsigned hw = std::thread::hardware_concurrency();
  at::set_num_threads(a.threads > 0 ? a.threads : static_cast<int>(hw > 0 ? hw : 1));

  memfit::FashionMnistOptions data_options;
  data_options.root(a.data);
  const auto train_data = memfit::load_fashion_mnist(memfit::Split::kTrain, data_options);
  const auto test_data = a.no_eval ? memfit::ImageDataset()
                                   : memfit::load_fashion_mnist(memfit::Split::kTest, data_options);

  const int64_t budget = a.budget.empty() ? 0 : memfit::parse_memory_size(a.budget);
  memfit::set_memory_budget(device, budget);
  memfit::reset_peak_memory_stats(device);

  auto chain = memfit::make_model(memfit::parse_model_kind(a.model),
                                  memfit::ModelOptions().width(a.width).depth(a.depth));
  auto ck_options = parse_checkpoint(a.checkpoint);
  if (ck_options.kind() == memfit::ScheduleKind::kOptimal) {
    ck_options.budget(memfit::parse_memory_size(a.checkpoint_budget));
  }
  const auto offloads = [&](const char* what) {
    return std::find(a.offload.begin(), a.offload.end(), what) != a.offload.end();
  };
  for (const auto& pattern : a.freeze) memfit::freeze(*chain, pattern);
  ck_options.checkpoint(memfit::CheckpointOptions().offload(
      a.offload_checkpoints || offloads("checkpoints") ? memfit::Offload::kHost
                                                       : memfit::Offload::kNone));
  memfit::CheckpointedSequential checkpointed(chain, ck_options);
  torch::nn::Sequential model(checkpointed);
  memfit::TrainerOptions options;
  options.batch_size(a.batch)
      .steps(a.epochs > 0 ? 0 : a.steps)
      .epochs(std::max<int64_t>(a.epochs, 1))
      .lr(a.lr)
      .optimizer(memfit::parse_optimizer_kind(a.optimizer))
      .seed(a.seed)
      .eval_batch_size(a.eval_batch)
      .device(device)
      .precision(a.precision == "auto" ? memfit::auto_precision(device)
                                       : memfit::parse_precision(a.precision))
      .master_weights(memfit::parse_master_weights_mode(a.master_weights))
      .max_grad_norm(a.clip_grad_norm)
      .nonfinite_loss(a.skip_nonfinite ? memfit::NonfiniteLoss::kSkip
                                       : memfit::NonfiniteLoss::kError)
      .micro_batch_size(a.micro_batch)
      .offload_optimizer(offloads("optimizer") ? memfit::Offload::kHost : memfit::Offload::kNone)
      .save_dir(a.save)
      .save_every(a.save_every);
  memfit::Trainer trainer(model, options);
  if (!a.resume.empty()) {
    trainer.resume(a.resume);
    fmt::print("resumed from {} at step {}\n", a.resume, trainer.step());
  }

  int64_t params = 0, frozen = 0;
  for (const auto& p : trainer.model()->parameters()) {
    params += p.numel();
    frozen += p.requires_grad() ? 0 : p.numel();
  }
  fmt::print("memfit train: model {} ({} parameters{}), {} training examples, batch {}{}, {} "
             "steps, budget {}\n",
             a.model, params, frozen > 0 ? fmt::format(", {} frozen", frozen) : std::string(),
             train_data.size(), a.batch,
             a.micro_batch > 0 && a.micro_batch < a.batch
                 ? fmt::format(" in micro-batches of {}", a.micro_batch)
                 : std::string(),
             trainer.total_steps(train_data),
             budget > 0 ? memfit::format_bytes(budget) : std::string("none"));
  std::fflush(stdout);

  memfit::tools::ProgressBar bar(trainer.total_steps(train_data), a.batch, stderr,
                                 ::isatty(fileno(stderr)) != 0);
  const auto start = std::chrono::steady_clock::now();
  auto on_step = [&](const memfit::StepRecord& r) {
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
    bar.finish();
    throw;
  }
  bar.finish();

  if (!a.no_eval) {
    report.test = trainer.evaluate(test_data);
    report.evaluated = true;
  }
  const int64_t peak = memfit::max_memory_allocated(device);
  fmt::print("final loss {:.4f} | {:.0f} samples/s | {:.1f} s\n", report.final_loss,
             report.samples_per_second, report.seconds);
  if (report.evaluated) {
    fmt::print("test accuracy {:.2f}% ({} examples, loss {:.4f}, evaluated under no-grad)\n",
               100.0 * report.test.accuracy, test_data.size(), report.test.loss);
  }
  fmt::print("precision {}{}{}\n", report.precision,
             a.master_weights != "none"
                 ? fmt::format(", parameters in {} with fp32 master weights on the {}",
                               report.precision, a.master_weights)
                 : std::string(),
             report.final_scale > 0 ? fmt::format(", loss scale {:g}, {} steps skipped",
                                                  report.final_scale, report.skipped_steps)
                                    : std::string());
  fmt::print("checkpoint schedule: {} (layers [begin,end), * recomputed)\n",
             checkpointed->schedule().to_string());
  fmt::print("peak memory {} ({} bytes){}\n", memfit::format_bytes(peak), peak,
             budget > 0 ? fmt::format(" of budget {}", memfit::format_bytes(budget)) : "");
  fmt::print("peak of the largest training step:\n{}", report.step_memory.table());
  if (!a.save.empty()) fmt::print("checkpoint saved to {}/checkpoint.pt\n", a.save);
  if (!a.report.empty()) {
    memfit::write_file_atomically(a.report, report.to_json() + "\n");
    fmt::print("report written to {}\n", a.report);
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "memfit: train LibTorch models and batches that do not fit in memory.\n"
      "Exit codes: 0 success, 1 failed run (e.g. out of memory under --budget), 2 bad usage.",
      "memfit"};
  app.set_version_flag("--version", fmt::format("memfit 0.1.0 (LibTorch {}, {})", TORCH_VERSION,
                                                 memfit::compat::kBuiltWithCuda ? "CUDA" : "CPU only"));
  app.require_subcommand(1);
  TrainArgs train_args;
  add_train_command(app, train_args);

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
    fmt::print(stderr, "{}: error: {} (see '{} --help')\n", where, e.what(), where);
    return kExitUsage;
  }
  if (app.got_subcommand("train") && train_args.checkpoint == "optimal" &&
      train_args.checkpoint_budget.empty()) {
    fmt::print(stderr,
               "memfit train: error: --checkpoint optimal needs --checkpoint-budget SIZE, the memory "
               "for activations, e.g. --checkpoint-budget 24MiB (see 'memfit train --help')\n");
    return kExitUsage;
  }

  if (app.got_subcommand("train") && train_args.master_weights != "none" &&
      train_args.precision == "fp32") {
    fmt::print(stderr,
               "memfit train: error: --master-weights {} holds parameters in bf16 or fp16: add "
               "--precision bf16 (or fp16, auto), or drop --master-weights (see 'memfit train "
               "--help')\n",
               train_args.master_weights);
    return kExitUsage;
  }

  try {
    if (app.got_subcommand("train")) return run_train(train_args);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "memfit: error: {}\n", e.msg());
    return kExitFailure;
  } catch (const std::exception& e) {
    fmt::print(stderr, "memfit: error: {}\n", e.what());
    return kExitFailure;
  }
  return kExitUsage;
}
