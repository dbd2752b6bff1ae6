#include "memfit/trainer.h"

#include "trainer_internal.h"

#include "memfit/checkpoint.h"
#include "memfit/schedule.h"

#include "compat.h"
#include "memfit/freeze.h"
#include "memfit/optim.h"
#include "memfit/state.h"
#include "memory_internal.h"
#include "read_ahead.h"
#include "step_components.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim.h>
#include <torch/torch.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <mutex>
#include <optional>
#include <sstream>

namespace memfit {

using detail::kCheckpointFile;

namespace {

constexpr const char* kCheckpointFormat = "memfit.trainer.v1";

std::string checkpoint_path(const std::string& path) {
  return std::filesystem::is_directory(path) ? (std::filesystem::path(path) / kCheckpointFile).string()
                                             : path;
}

std::vector<c10::DeviceIndex> cuda_devices(const torch::Device& device) {
  if (!device.is_cuda()) return {};
  return {device.has_index() ? device.index() : c10::DeviceIndex(0)};
}

} // namespace

void Trainer::save(const std::string& dir) {
  // This rank's part: the model and each component's state (collectives
  // among them). A pipeline's stages each have one, gathered on rank 0.
  torch::serialize::OutputArchive a, stage;
  torch::serialize::OutputArchive& part = pipeline_ ? stage : a;
  write_part(part);
  std::vector<torch::Tensor> stages;
  if (pipeline_) stages = options_.process_group()->gather(detail::bytes_tensor(detail::archive_bytes(stage)));
  // Each rank's random generators (their dropout masks differ when their
  // shares of a batch do), gathered on rank 0.
  compat::RngState rng;
  std::vector<torch::Tensor> rank_cpu_rng, rank_cuda_rng;
  {
    UntrackedGuard host;  // generator states are host tensors
    rng = compat::get_rng_state(cuda_devices(options_.device()));
    if (world_size() > 1) {
      rank_cpu_rng = options_.process_group()->gather(rng.cpu.reshape({-1}));
      if (!rng.cuda.empty()) rank_cuda_rng = options_.process_group()->gather(rng.cuda.front().second.reshape({-1}));
    }
  }
  if (rank() != 0) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TORCH_CHECK(!ec && std::filesystem::is_directory(dir), "cannot create the checkpoint folder ",
              dir, ": ", ec.message());
  a.write("format", c10::IValue(std::string(kCheckpointFormat)));
  if (pipeline_) {
    torch::serialize::OutputArchive parts;
    parts.write("world", c10::IValue(world_size()));
    for (size_t r = 0; r < stages.size(); ++r) parts.write("rank" + std::to_string(r), stages[r]);
    a.write("stages", parts);
  }
  {
    UntrackedGuard host;  // generator states are host tensors
    a.write("rng_cpu", rng.cpu);
    for (const auto& [index, state] : rng.cuda) a.write("rng_cuda", state);
    if (!rank_cpu_rng.empty()) {
      torch::serialize::OutputArchive ranks;
      ranks.write("world", c10::IValue(world_size()));
      for (size_t r = 0; r < rank_cpu_rng.size(); ++r) ranks.write("cpu" + std::to_string(r), rank_cpu_rng[r]);
      for (size_t r = 0; r < rank_cuda_rng.size(); ++r) ranks.write("cuda" + std::to_string(r), rank_cuda_rng[r]);
      a.write("rank_rng", ranks);
    }
    auto gen = generator_;
    std::lock_guard<std::mutex> lock(gen.mutex());
    a.write("sampler_rng", gen.get_state());
  }
  // The options a resume must share (checked by check_saved_options).
  a.write("optimizer_type", c10::IValue(optimizer_type()));
  a.write("precision", c10::IValue(to_string(options_.precision())));
  a.write("batch_size", c10::IValue(options_.batch_size()));
  a.write("step", c10::IValue(step_));
  a.write("epoch", c10::IValue(epoch_));
  a.write("cursor", c10::IValue(cursor_));
  if (order_.defined()) a.write("order", order_);
  const auto file = (std::filesystem::path(dir) / kCheckpointFile).string();
  write_file_atomically(file, detail::archive_bytes(a));
  continues_ = file;
}

void Trainer::write_part(torch::serialize::OutputArchive& part) {
  torch::serialize::OutputArchive model;
  detail::write_module(model, *module_, [this](const torch::Tensor& p) { return stand_in(p); });
  part.write("model", model);
  for (const auto& c : components_) c->save_state(part);
}

torch::Tensor Trainer::stand_in(const torch::Tensor& param) const {
  if (!stream_) return torch::Tensor();
  const int64_t i = master_->index_of(param);  // streamed: the host master holds its values
  return i >= 0 ? master_->master_parameters()[static_cast<size_t>(i)] : torch::Tensor();
}

std::string Trainer::optimizer_type() const {
  const auto* o = zero_ != nullptr ? zero_->local_optimizer() : optimizer_.get();
  return o != nullptr ? optim::state_type_name(*o) : std::string("none");
}

// A checkpoint resumes only into the optimizer, precision and batch size
// that saved it (checkpoints written before these were saved are not checked).
void Trainer::check_saved_options(torch::serialize::InputArchive& a, const std::string& path) const {
  const auto check = [&](const char* key, const char* option, const std::string& now) {
    c10::IValue v;
    if (!a.try_read(key, v)) return;
    const std::string saved = v.isString() ? v.toStringRef() : v.isInt() ? std::to_string(v.toInt()) : "?";
    TORCH_CHECK(saved == now, path, " was saved with ", option, " ", saved, ", but this run's is ", now,
                ": resume with ", saved, ", or start a new run from the model alone (load_module)");
  };
  check("optimizer_type", "the optimizer", optimizer_type());
  check("precision", "TrainerOptions::precision", to_string(options_.precision()));
  check("batch_size", "TrainerOptions::batch_size", std::to_string(options_.batch_size()));
}

void Trainer::resume(const std::string& path_or_dir) {
  const std::string path = checkpoint_path(path_or_dir);
  auto a = detail::read_archive(path);
  c10::IValue format;
  TORCH_CHECK(a.try_read("format", format) && format.isString() &&
                  format.toStringRef() == kCheckpointFormat,
              path, " is not a memfit Trainer checkpoint (", kCheckpointFormat,
              "): write one with Trainer::save or memfit train --save DIR");
  check_saved_options(a, path);
  // Check everything before changing anything. A pipeline's checkpoint holds
  // each stage's model, masters and optimizer in a part of its own.
  torch::serialize::InputArchive parts, stage;
  const bool has_stages = a.try_read("stages", parts);
  torch::serialize::InputArchive* src = &a;
  if (pipeline_) {
    TORCH_CHECK(has_stages, path, " holds a whole model, but this run is a pipeline: resume with the "
                "parallel mode that saved it");
    const int64_t saved_world = detail::read_int(parts, "world", path);
    TORCH_CHECK(saved_world == world_size(), path, " holds a pipeline of ", saved_world,
                " stages, but this job has ", world_size(), " ranks: resume with the world size that saved it");
    detail::load_archive(stage, detail::read_tensor(parts, "rank" + std::to_string(rank()), path),
                 path + "'s stage " + std::to_string(rank()));
    src = &stage;
  } else {
    TORCH_CHECK(!has_stages, path, " holds a pipeline's stages: resume with parallel pipeline "
                "(--parallel pipeline) and the world size that saved it");
  }
  torch::serialize::InputArchive model;
  TORCH_CHECK(src->try_read("model", model), path, " is damaged: 'model' is missing");
  const auto stand_in = [this](const torch::Tensor& p) { return this->stand_in(p); };
  detail::check_module(model, *module_, path, stand_in);
  std::vector<std::function<void()>> puts;  // each component's part, checked
  for (const auto& c : components_) {
    if (auto put = c->load_state(*src, path)) puts.push_back(std::move(put));
  }
  torch::Tensor rng_cpu = detail::read_tensor(a, "rng_cpu", path);
  torch::Tensor rng_cuda;
  a.try_read("rng_cuda", rng_cuda);
  // A job of the same size: each rank continues its own generators (else
  // every rank takes rank 0's).
  torch::serialize::InputArchive ranks;
  if (a.try_read("rank_rng", ranks) && detail::read_int(ranks, "world", path) == world_size() && world_size() > 1) {
    const std::string r = std::to_string(rank());
    rng_cpu = detail::read_tensor(ranks, "cpu" + r, path);
    torch::Tensor cuda;
    if (ranks.try_read("cuda" + r, cuda)) rng_cuda = cuda;
  }
  const torch::Tensor sampler_rng = detail::read_tensor(a, "sampler_rng", path);
  const int64_t step = detail::read_int(a, "step", path);
  const int64_t epoch = detail::read_int(a, "epoch", path);
  const int64_t cursor = detail::read_int(a, "cursor", path);
  torch::Tensor order;
  a.try_read("order", order);

  // Apply: tensor by tensor into the model's storage.
  detail::copy_into_module(model, *module_, stand_in);
  for (const auto& put : puts) put();
  compat::RngState rng;
  rng.cpu = rng_cpu;
  if (rng_cuda.defined() && options_.device().is_cuda()) {
    rng.cuda.emplace_back(cuda_devices(options_.device()).front(), rng_cuda);
  }
  compat::set_rng_state(rng);
  {
    std::lock_guard<std::mutex> lock(generator_.mutex());
    generator_.set_state(sampler_rng);
  }
  step_ = step;
  epoch_ = epoch;
  cursor_ = cursor;
  order_ = order;
  continues_ = path;
}

void load_trainer_model(torch::nn::Module& module, const std::string& path_or_dir) {
  const std::string path = checkpoint_path(path_or_dir);
  auto a = detail::read_archive(path);
  c10::IValue format;
  TORCH_CHECK(a.try_read("format", format) && format.isString() && format.toStringRef() == kCheckpointFormat,
              path, " is not a memfit Trainer checkpoint (", kCheckpointFormat,
              "): write one with Trainer::save or memfit train --save DIR");
  torch::serialize::InputArchive parts, model;
  TORCH_CHECK(!a.try_read("stages", parts), path, " holds a pipeline's stages, one per rank: load it into a "
              "pipeline (Trainer::resume with parallel pipeline)");
  TORCH_CHECK(a.try_read("model", model), path, " is damaged: 'model' is missing");
  detail::check_module(model, module, path);
  detail::copy_into_module(model, module);
}

} // namespace memfit
