#include "train.h"

#include "compat.h"
#include "memfit/data.h"
#include "memfit/environment.h"
#include "memfit/freeze.h"
#include "memfit/memory.h"
#include "memfit/models.h"
#include "memfit/module_plan.h"
#include "memfit/plan.h"
#include "memfit/precision.h"
#include "memfit/checkpoint.h"
#include "memfit/schedule.h"
#include "memfit/state.h"
#include "memfit/trainer.h"
#include "generate.h"
#include "workload.h"
#include "progress.h"
#include "report.h"
#include "usage.h"

#include <c10/core/DeviceGuard.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <utility>

namespace memfit::tools {
namespace {

// Parses one --budget-change, STEP:SIZE: the step after which the budget
// becomes SIZE bytes (0 for none).
std::pair<int64_t, int64_t> budget_change_of(const std::string& text) {
  static const std::regex pattern(R"(^([1-9][0-9]{0,11}):(.+)$)");
  std::smatch m;
  TORCH_CHECK(std::regex_match(text, m, pattern), "must be STEP:SIZE, a step from 1 and a memory size or none, "
              "e.g. 5:4MiB, got ", text.size() > 40 ? text.substr(0, 40) + "..." : text);
  const std::string size = m[2].str();
  const int64_t bytes = size == "none" ? 0 : memfit::parse_memory_size(size);
  TORCH_CHECK(size == "none" || bytes > 0, "must be STEP:SIZE with a positive SIZE or none, got ", text);
  return {std::stoll(m[1].str()), bytes};
}

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

// The plan that the resumed run saved (saved_plan_path) where it suits this
// run (plan_mismatch): a resumed run keeps its micro-batches, precision,
// offload and schedules, which planning again may not choose (candidates
// within the timing's noise), and which its checkpoint and its math depend
// on. nullopt where there is none, or it does not suit (the line says why).
std::optional<memfit::ModulePlan> resumed_plan(const TrainArgs& a, const torch::nn::Module& model, int64_t budget,
                                               const memfit::PlanOptions& options, const memfit::TrainerOptions& base) {
  const auto path = a.resume.empty() ? std::string() : saved_plan_path(a.resume);
  if (path.empty() || !std::filesystem::exists(path)) return std::nullopt;
  auto saved = memfit::tools::as_usage([&] { return memfit::load_plan(path); });
  if (const auto why = memfit::plan_mismatch(saved, model, a.batch, budget, options, base); !why.empty()) {
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
                              int64_t budget, const memfit::PlanOptions& options, const memfit::TrainerOptions& base) {
  const auto why = memfit::plan_mismatch(given, model, a.batch, budget, options, base);
  memfit::tools::usage_check(why.empty(), "--plan ", a.plan, " does not suit this run: ",
                             memfit::tools::with_flag_names(why), "; train with the flags it was planned with "
                             "(--batch ", given.batch, " and --budget ", given.budget, " or none), or plan again "
                             "with --plan auto");
  fmt::print("plan: read from {}, not planned again\n", a.plan);
  return given;
}

} // namespace

// Every flag of `memfit train`, in the order --help lists them: one flat list
// (about 170 lines) that a reader scans, rather than pieces to put together.
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
      ->check(memfit::tools::parsed_by([](const std::string& v) { parse_checkpoint(v); }, "SCHEDULE"))
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
                    "A step that runs out of memory: replan (undo it and run it again with the same gradients, "
                    "re-planned by the plan's step model where this run planned itself in one process, else with "
                    "more micro-batches, or recomputation where micro-batches would change batch statistics, then "
                    "the optimizer state, gradients and parameters on the host; data-parallel ranks re-plan "
                    "together), throw (end the run, exit 1), or auto (replan, except for a pipeline or --zero-stage 1)")
      ->check(CLI::IsMember({"auto", "replan", "throw"}))
      ->capture_default_str();
  train->add_option("--budget-change", a.budget_change,
                    "STEP:SIZE: after step STEP the budget becomes SIZE (none lifts it), to rehearse memory that "
                    "another process takes and gives back, e.g. 5:4MiB (repeatable)")
      ->check(memfit::tools::parsed_by([](const std::string& text) { budget_change_of(text); }, "STEP:SIZE"));
  train->add_option("--restore-after", a.restore_after,
                    "After this many steps in a row without running out of memory, a re-planned run tries its "
                    "first settings again (0: it keeps the re-planned ones)")
      ->check(memfit::tools::integer(0, kMaxSteps))
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

namespace {

// The flags' combinations that cannot run together, each refused with what would.
void check_flag_combinations(const TrainArgs& a) {
  using memfit::tools::usage_check;
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
  std::map<int64_t, std::string> changes;
  for (const auto& c : a.budget_change) {
    const int64_t step = budget_change_of(c).first;
    const auto [earlier, first] = changes.emplace(step, c);
    usage_check(first, "--budget-change ", earlier->second, " and ", c, " both change the budget after step ", step,
                ": give each step one SIZE");
  }
  usage_check(a.restore_after == 0 || a.on_out_of_memory != "throw", "--restore-after ", a.restore_after,
              " takes back the first settings of a re-planned run, and --on-out-of-memory throw re-plans none: "
              "use --on-out-of-memory replan (or auto), or drop --restore-after");
  usage_check(!plans_knobs(a) || a.batch >= 4, "--batch ", a.batch, " under --budget: the planner measures the "
              "step in micro-batches of two sizes, so it plans batches of 4 examples or more; use --batch 4 or "
              "more, or set the knobs by hand (--plan none)");
}

// The plan the run is given (--plan FILE), and the one a resumed run saved:
// both read before any work. `resumed`: --resume's checkpoint file, or "".
std::optional<memfit::ModulePlan> given_plan(const TrainArgs& a, const std::string& resumed) {
  using memfit::tools::usage_check;
  namespace fs = std::filesystem;
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
  return given;
}

// No output replaces an input or another output (compared by resolved path).
// `resumed`: --resume's checkpoint file, or "".
void check_outputs(const TrainArgs& a, const std::string& resumed) {
  namespace fs = std::filesystem;
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
}

} // namespace

std::optional<memfit::ModulePlan> validate_train(const TrainArgs& a) {
  using memfit::tools::usage_check;
  namespace fs = std::filesystem;
  check_flag_combinations(a);
  check_device_and_precision(a.device, a.precision);
  // The job's variables (RANK, WORLD_SIZE, MASTER_PORT, ...) and the threads' are the run's input too.
  memfit::tools::as_usage([] { memfit::world_from_env(); });
  check_omp_num_threads(a.threads);
  const std::string resumed = a.resume.empty() ? "" : resumed_checkpoint(a.resume);
  usage_check(resumed.empty() || fs::is_regular_file(resumed), "--resume ", a.resume, ": no checkpoint file at ",
              resumed, "; give the folder that --save wrote");
  auto given = given_plan(a, resumed);
  check_outputs(a, resumed);
  // One run per folder, and a new run does not replace another's checkpoint
  // (the Trainer holds the folder from its start; only rank 0 writes).
  if (!a.save.empty() && fs::is_directory(a.save) && memfit::world_from_env().rank == 0) {
    memfit::tools::as_usage([&] { memfit::FolderLock held(a.save, "--save"); });
    check_save_is_ours(a);
  }
  check_model_fits(a);
  return given;
}

// `given`: the plan of --plan FILE (validate_train), or nullopt.
namespace {

// Joins the job when `memfit launch`, torchrun, srun or mpirun started this
// process (one GPU per rank with NCCL, kept current by `device_guard`);
// returns its process group, or nullptr alone. Rank 0 speaks for the job.
std::shared_ptr<memfit::ProcessGroup> join_job(const TrainArgs& a, const memfit::WorldInfo& world,
                                               std::optional<c10::DeviceGuard>& device_guard) {
  if (!world.distributed()) return nullptr;
  if (a.dist_backend == "nccl") {
    // One GPU per rank, as torch.cuda.set_device(local_rank) chooses it;
    // NCCL reduces on the current device.
    const auto gpus = static_cast<int64_t>(torch::cuda::device_count());
    TORCH_CHECK(world.local_rank < gpus, "rank ", world.rank, " (local rank ", world.local_rank,
                ") needs a GPU of its own for NCCL, and this machine has ", gpus,
                "; start at most that many processes per machine, or use --dist-backend gloo");
    device_guard.emplace(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(world.local_rank)));
  }
  auto group = std::make_shared<memfit::ProcessGroup>(
      world, memfit::ProcessGroupOptions()
                 .timeout(std::chrono::seconds(a.dist_timeout))
                 .backend(a.dist_backend == "nccl" ? memfit::ProcessGroupBackend::kNccl
                                                   : memfit::ProcessGroupBackend::kGloo));
  // The others print errors only.
  TORCH_CHECK(world.rank == 0 || std::freopen("/dev/null", "w", stdout) != nullptr,
              "rank ", world.rank, " cannot send its output to /dev/null");
  return group;
}

// The model --model names, with --freeze applied, as the chain that
// --checkpoint's schedule recomputes.
memfit::CheckpointedSequential checkpointed_model(const TrainArgs& a, torch::nn::Sequential chain) {
  auto ck_options = parse_checkpoint(a.checkpoint);
  if (ck_options.kind() == memfit::ScheduleKind::kOptimal) {
    ck_options.budget(memfit::parse_memory_size(a.checkpoint_budget));
  }
  for (const auto& pattern : a.freeze) {  // the names exist only once the model is built
    memfit::tools::as_usage([&] { memfit::freeze(*chain, pattern); });
  }
  ck_options.checkpoint(memfit::CheckpointOptions().offload(
      a.offload_checkpoints || offloads_to_host(a, "checkpoints") ? memfit::Offload::kHost : memfit::Offload::kNone));
  return memfit::CheckpointedSequential(chain, ck_options);
}

// A pipeline's stages balance the layers' time, measured on rank 0 (its
// balance is used everywhere); empty when there is no pipeline to balance.
std::vector<int64_t> pipeline_balance(const TrainArgs& a, const memfit::WorldInfo& world,
                                      torch::nn::Sequential chain, const memfit::ImageDataset& data,
                                      const torch::Device& device) {
  if (a.parallel != "pipeline" || world.rank != 0 || world.world_size > static_cast<int64_t>(chain->size())) {
    return {};
  }
  const int64_t chunk = (a.batch + a.chunks - 1) / a.chunks;
  chain->to(device);
  return memfit::balance_by_time(chain, data.images.narrow(0, 0, std::min(chunk, data.size())).to(device),
                                 world.world_size);
}

// The TrainerOptions the flags set (a plan may change the knobs after).
memfit::TrainerOptions trainer_options(const TrainArgs& a, const torch::Device& device, memfit::Precision precision,
                                       std::shared_ptr<memfit::ProcessGroup> group, std::vector<int64_t> balance) {
  const auto host = [&](const char* what) {
    return offloads_to_host(a, what) ? memfit::Offload::kHost : memfit::Offload::kNone;
  };
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
      .precision(precision)
      .master_weights(memfit::parse_master_weights_mode(a.master_weights))
      .max_grad_norm(a.clip_grad_norm)
      .nonfinite_loss(a.skip_nonfinite ? memfit::NonfiniteLoss::kSkip : memfit::NonfiniteLoss::kError)
      .restore_after(a.restore_after)
      .micro_batch_size(a.micro_batch)
      .offload_optimizer(host("optimizer"))
      .offload_gradients(host("gradients"))
      .offload_parameters(host("parameters"))
      .stream(memfit::StreamOptions().tile_bytes(a.offload_tile.empty() ? 0 : memfit::parse_memory_size(a.offload_tile)))
      .save_dir(a.save)
      .save_every(a.save_every)
      .process_group(std::move(group))
      .zero_stage(a.zero_stage)
      .parallel(memfit::parse_parallel_mode(a.parallel))
      .pipeline(memfit::PipelineOptions()
                    .chunks(a.chunks)
                    .schedule(memfit::parse_pipeline_schedule(a.schedule))
                    .checkpoint(memfit::parse_pipeline_checkpoint(a.pipeline_checkpoint))
                    .balance(std::move(balance)));
  return options;
}

// The plan for --budget or --plan FILE, applied to `options` and explained;
// nullopt when the knobs are the flags'. Planning measures this run's own
// step (Trainer(model, options)) in one process, saving nothing; a plan
// made here keeps its step model in `step_model`, for recovery to re-plan from.
std::optional<memfit::ModulePlan> plan_run(const TrainArgs& a, const std::optional<memfit::ModulePlan>& given,
                                           torch::nn::Sequential& model, int64_t budget,
                                           const std::vector<memfit::Precision>& precisions,
                                           const memfit::ImageDataset& data, memfit::TrainerOptions& options,
                                           std::shared_ptr<const memfit::ModuleStepModel>& step_model) {
  std::optional<memfit::ModulePlan> plan;
  if (planned(a)) {
    const auto measured = memfit::TrainerOptions(options).process_group(nullptr).zero_stage(0).save_dir("");
    const auto planning = plan_options(a, precisions);
    plan = given ? given_plan(a, *given, *model, budget, planning, measured)
                 : resumed_plan(a, *model, budget, planning, measured);
    if (!plan) step_model = std::make_shared<memfit::ModuleStepModel>(
                   memfit::detail::make_probe(model, sample_of(data, a.batch)),
                   memfit::detail::measuring_within(planning, budget), measured);
    if (!plan) plan = memfit::plan(*step_model, budget);
    // Data-parallel ranks planned alike but timed apart: they train with rank 0's plan.
    if (options.process_group()) memfit::broadcast_plan(*plan, *options.process_group());
    options = plan->apply(*model, options);
    // Evaluation forwards no more examples at once than a training
    // micro-batch, which the plan fitted with grad.
    options.eval_batch_size(std::min<int64_t>(
        a.eval_batch, plan->settings.micro_batch() > 0 ? plan->settings.micro_batch() : a.batch));
    fmt::print("{}", memfit::tools::with_flag_names(plan->explain()));
  }
  if (!plan && budget > 0 && a.plan == "auto") {
    fmt::print("plan: none ({})\n", a.parallel == "pipeline"
                                         ? "the planner plans one process; a pipeline splits the model"
                                         : "micro-batch, checkpointing, offload or master weights set by hand");
  }
  return plan;
}

// What `memfit generate` needs to build the model again (DIR/model.json),
// and the plan that --resume trains with again (DIR/plan.json).
void write_model_card(const TrainArgs& a, const Workload& workload, const std::optional<memfit::ModulePlan>& plan) {
  nlohmann::json card = {{"model", a.model},     {"width", a.width},     {"depth", a.depth},
                         {"heads", a.heads},     {"context", a.context}, {"dropout", a.dropout},
                         {"num_classes", workload.options.num_classes()}};
  if (workload.kind == memfit::ModelKind::kGpt) {
    std::vector<int> vocab;
    for (char c : workload.vocab) vocab.push_back(static_cast<unsigned char>(c));
    card["vocab"] = vocab;
  }
  memfit::tools::write_model_card(a.save, card);
  if (plan) memfit::save_plan(*plan, saved_plan_path(a.save));
}

// The run's first line: the model, the data, how the batch is split, the steps and the budget.
void print_start(const TrainArgs& a, const memfit::WorldInfo& world, const torch::nn::Sequential& chain,
                 const memfit::Trainer& trainer, const memfit::ImageDataset& data, int64_t budget) {
  int64_t params = 0, frozen = 0;  // of the whole model
  for (const auto& p : chain->parameters()) {
    params += p.numel();
    frozen += p.requires_grad() ? 0 : p.numel();
  }
  std::string batch = std::to_string(a.batch);
  if (world.distributed() && a.parallel == "pipeline") {
    batch = fmt::format("{} in {} chunks through a pipeline of {} stages ({}, layers {}, {}{}, over Gloo)", a.batch,
                        a.chunks, world.world_size, world.source, fmt::join(trainer.options().pipeline().balance(), "+"),
                        a.schedule, a.pipeline_checkpoint == "never" ? "" : ", checkpoint " + a.pipeline_checkpoint);
  } else if (world.distributed()) {
    batch = fmt::format("{} per rank × {} ranks ({}, data parallel over {}{})", a.batch, world.world_size,
                        world.source, a.dist_backend == "nccl" ? "NCCL" : "Gloo",
                        a.zero_stage == 1 ? ", optimizer state sharded: ZeRO stage 1" : "");
  }
  fmt::print("memfit train: model {} ({} parameters{}), {} training examples, batch {}{}, {} steps, budget {}\n",
             a.torchscript.empty() ? a.model : "TorchScript " + a.torchscript, params,
             frozen > 0 ? fmt::format(", {} frozen", frozen) : std::string(), data.size(), batch,
             a.micro_batch > 0 && a.micro_batch < a.batch ? fmt::format(" in micro-batches of {}", a.micro_batch)
                                                          : std::string(),
             trainer.total_steps(data), budget > 0 ? memfit::format_bytes(budget) : std::string("none"));
  std::fflush(stdout);
}

// --budget-change's steps and bytes (0: none).
std::map<int64_t, int64_t> budget_changes(const TrainArgs& a) {
  std::map<int64_t, int64_t> changes;
  for (const auto& c : a.budget_change) changes.insert(budget_change_of(c));
  return changes;
}

// The run's results: loss, test accuracy, precision, schedule, peak memory.
void print_results(const TrainArgs& a, const memfit::TrainReport& report, const Workload& workload,
                   const std::string& schedule_text, const torch::Device& device, int64_t budget,
                   const std::optional<memfit::ModulePlan>& plan) {
  // The run's peak: fit and evaluate each reset the peak counter (on CUDA
  // the caching allocator has only one), so take the largest they saw.
  int64_t peak = std::max(memfit::max_memory_allocated(device), report.peak_bytes);
  if (report.evaluated) peak = std::max(peak, report.test.peak_bytes);
  const bool trained = !report.steps.empty();  // a resumed run already complete trains no step
  if (trained) {
    fmt::print("final loss {:.4f} | {:.0f} samples/s | {:.1f} s\n", report.final_loss, report.samples_per_second,
               report.seconds);
  }
  if (report.evaluated) {
    const bool text = workload.kind == memfit::ModelKind::kGpt;
    const auto& test = workload.test;
    fmt::print("test accuracy {:.2f}% ({}, loss {:.4f}{}, evaluated under no-grad{})\n", 100.0 * report.test.accuracy,
               text ? fmt::format("next byte of {} sequences of {}", test.size(), a.context)
                    : fmt::format("{} examples", test.size()),
               report.test.loss, text ? fmt::format(", perplexity {:.2f}", std::exp(report.test.loss)) : "",
               report.test.batch_size < a.eval_batch ? fmt::format(" in batches of {}", report.test.batch_size)
                   : std::string());
  }
  fmt::print("precision {}{}{}\n", report.precision,
             a.master_weights != "none" ? fmt::format(", parameters in {} with fp32 master weights on the {}",
                                                      report.precision, a.master_weights)
                                        : std::string(),
             report.final_scale > 0
                 ? fmt::format(", loss scale {:g}, {} steps skipped", report.final_scale, report.skipped_steps)
                 : std::string());
  fmt::print("checkpoint schedule: {} (layers [begin,end), * recomputed)\n", schedule_text);
  // Above the budget only where the model as built held more than it (the
  // budget refuses new allocations) until a re-plan moved it to the host.
  int64_t step_peak = 0;
  for (const auto& s : report.steps) step_peak = std::max(step_peak, s.peak_bytes);
  const std::string over =
      budget > 0 && peak > budget && trained
          ? fmt::format(" (the model as built, until a re-plan moved it to the host; its steps peaked at {})",
                        memfit::format_bytes(step_peak))
          : std::string();
  fmt::print("peak memory {} ({} bytes){}{}{}\n", memfit::format_bytes(peak), peak,
             budget > 0 ? fmt::format(" of budget {}", memfit::format_bytes(budget)) : "", over,
             plan ? fmt::format("; the plan predicted {} for a step", memfit::format_bytes(plan->predicted.peak_bytes))
                  : std::string());
  if (trained) fmt::print("peak of the largest training step:\n{}", report.step_memory.table());
  if (!a.save.empty() && !report.stopped) fmt::print("checkpoint saved to {}/checkpoint.pt\n", a.save);
}

} // namespace

int run_train(const TrainArgs& a, const std::optional<memfit::ModulePlan>& given) {
  const torch::Device device = parse_device(a.device);
  const auto world = memfit::world_from_env();
  memfit::tools::usage_check(a.on_out_of_memory != "replan" || (a.parallel != "pipeline" && a.zero_stage == 0),
                             "--on-out-of-memory replan re-plans data-parallel ranks together, not ",
                             a.parallel == "pipeline" ? "a pipeline's stages" : "a sharded optimizer (--zero-stage 1)",
                             ": use --on-out-of-memory throw (or auto)");
  std::optional<c10::DeviceGuard> device_guard;
  auto group = join_job(a, world, device_guard);
  memfit::memory_allocated(device);  // begins tracking before anything is allocated
  torch::manual_seed(a.seed);
  const std::string blas_warning = set_threads(a.threads, world.rank == 0);  // printed after the resume check
  const auto workload = load_workload(a, /*with_test=*/!a.no_eval);
  check_batch_within_data(a.batch, workload);
  // --plan FILE (given): the saved plan, checked against this run once the model is built.
  const int64_t budget = !a.budget.empty() ? memfit::parse_memory_size(a.budget) : given ? given->budget : 0;

  torch::nn::Sequential chain = workload.make();
  auto checkpointed = checkpointed_model(a, chain);
  const bool pipelined = a.parallel == "pipeline";
  const auto precisions = plan_precisions(a.precision, device);  // "any": the plan's choice of these
  auto options = trainer_options(a, device, precisions.front(), group,
                                 pipeline_balance(a, world, chain, workload.train, device));
  torch::nn::Sequential model = pipelined ? chain : torch::nn::Sequential(checkpointed);
  std::shared_ptr<const memfit::ModuleStepModel> step_model;
  const auto plan = plan_run(a, given, model, budget, precisions, workload.train, options, step_model);
  // Recovery (--on-out-of-memory): from the step model of a run planned here
  // in one process (ranks' limits may differ), else in the default order,
  // which recomputes a model with batch statistics (every model here is a chain).
  if (a.on_out_of_memory == "replan" || (a.on_out_of_memory == "auto" && !pipelined && a.zero_stage == 0)) {
    auto in_order = memfit::more_micro_batches(*model, a.batch_statistics == "per-micro-batch");
    options.on_out_of_memory(memfit::OnOutOfMemory::kReplan)
        .replan(step_model && !options.process_group() ? memfit::replan_from_model(step_model, *plan, in_order)
                                                       : in_order);
  }
  memfit::set_memory_budget(device, budget);
  const std::string schedule_text = pipelined ? "none (pipeline stages)" : checkpointed->schedule().to_string();
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
  if (!a.save.empty() && world.rank == 0) {
    check_save_is_ours(a);  // the folder is this run's now
    write_model_card(a, workload, plan);
  }
  print_start(a, world, chain, trainer, workload.train, budget);
  if (pipelined) {  // this rank's stage keeps its layers; the others go now
    chain = nullptr;
    model = nullptr;
    checkpointed = nullptr;
  }
  auto report = train_with_progress(a, trainer, workload.train, device, budget_changes(a));
  if (!a.no_eval && !report.stopped) {
    report.test = trainer.evaluate(workload.test);
    report.evaluated = true;
  }
  print_results(a, report, workload, schedule_text, device, budget, plan);
  if (!a.report.empty() && world.rank == 0) write_run_report(a.report, report, plan);
  return report.stopped ? 128 + stop_signal() : 0;  // as a shell reports the signal
}

} // namespace memfit::tools
