#include "workload.h"

#include "memfit/data.h"
#include "memfit/environment.h"
#include "memfit/memory.h"
#include "memfit/models.h"
#include "memfit/plan.h"
#include "memfit/precision.h"
#include "memfit/trainer.h"
#include "usage.h"


#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <regex>
#include <thread>

namespace memfit::tools {


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
      ->check(memfit::tools::path("folder"))
      ->capture_default_str();
  cmd->add_option("--text", a.text, "The Jargon File for --model gpt (Debian: jargon-text)")
      ->check(memfit::tools::path("file"))
      ->capture_default_str();
  cmd->add_option("--torchscript", a.torchscript,
                  "Instead of --model: a TorchScript nn.Sequential saved from Python "
                  "(torch.jit.script(model).save(FILE)) taking Fashion-MNIST images; its top-level "
                  "children are the chain that checkpointing and the planner work on")
      ->check(CLI::ExistingFile);
}

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

// Sets LibTorch's intra-op threads: --threads, else OMP_NUM_THREADS as
// LibTorch read it (memfit launch sets it to the cores a worker has), else
// every hardware thread. More threads than hardware threads are capped, with
// a warning: OpenMP threads spin, and oversubscribed cores slow LibTorch down
// many times over (two processes of two threads on two cores: 5x a step).
// Returns the one-line warning of a BLAS that slows LibTorch down, if any
// and `speak`, for the caller to print once its usage checks are done.
std::string set_threads(int threads, bool speak) {
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

void check_omp_num_threads(int threads) {
  const char* omp = std::getenv("OMP_NUM_THREADS");
  if (threads > 0 || omp == nullptr || omp[0] == '\0') return;
  const std::string value = omp;
  bool valid = true;  // "4", or one per nesting level: "4,2"
  size_t start = 0;
  for (size_t comma; start <= value.size(); start = comma + 1) {
    comma = std::min(value.find(',', start), value.size());
    const auto part = value.substr(start, comma - start);
    valid = valid && !part.empty() && part.size() <= 6 &&
            std::all_of(part.begin(), part.end(), [](unsigned char c) { return std::isdigit(c); }) &&
            std::stoi(part) > 0;
  }
  memfit::tools::usage_check(valid, "OMP_NUM_THREADS='", value, "' is not a number of threads: set a positive ",
                             "integer, unset it, or give --threads");
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

memfit::BatchStatistics batch_statistics(const ModelArgs& a) {
  return a.batch_statistics == "per-micro-batch" ? memfit::BatchStatistics::kPerMicroBatch
                                                 : memfit::BatchStatistics::kKeep;
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

} // namespace memfit::tools
