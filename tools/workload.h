#pragma once
// The model and its data that `memfit train`, `plan`, `profile` and
// `find-batch` share: their flags, loading them, and the checks and settings
// the commands have in common.

#include "memfit/data.h"
#include "memfit/models.h"
#include "memfit/plan.h"
#include "memfit/precision.h"

#include <CLI/CLI.hpp>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace memfit::tools {

// Exit codes: 1 a run that failed (out of memory under the budget, missing
// data, I/O), 2 bad usage (before any work).
constexpr int kExitFailure = 1;
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

/// Adds the flags of the model's shape and its data to `cmd`.
void add_model_shape_options(CLI::App* cmd, ModelArgs& a);
/// The model --model names and its data (the test split with `with_test`).
Workload load_workload(const ModelArgs& a, bool with_test);
/// A usage error when `batch` exceeds the training set.
void check_batch_within_data(int64_t batch, const Workload& w);
/// --device's value as a device, or a usage error.
torch::Device parse_device(const std::string& text);
/// The precisions --precision allows the planner on `device`.
std::vector<memfit::Precision> plan_precisions(const std::string& text, const torch::Device& device);
/// Sets LibTorch's threads (0: one per free core); returns the line that says so (printed with `speak`).
std::string set_threads(int threads, bool speak = true);

/// A usage error for an OMP_NUM_THREADS that is not OpenMP's list of positive integers, where it sets the threads (no --threads).
void check_omp_num_threads(int threads);
/// Prints a warning line to stderr (nothing for "").
void print_warning(const std::string& warning);
/// A usage error when the model's shape flags cannot build it.
void check_model_fits(const ModelArgs& a);
/// --device and --precision checked together, before any work.
torch::Device check_device_and_precision(const std::string& device_text, const std::string& precision);
/// --batch-statistics as the planner's option.
memfit::BatchStatistics batch_statistics(const ModelArgs& a);
/// The first `n` examples of `data`, for the planner's sample batch.
torch::data::Example<> sample_of(const memfit::ImageDataset& data, int64_t n);
/// The planner's options for these model flags and precisions.
memfit::PlanOptions plan_options(const ModelArgs& a, const std::vector<memfit::Precision>& precisions);

} // namespace memfit::tools
