// Parameter offload with memfit: an MLP whose parameters (4.2 MiB) alone
// exceed a 1 MiB budget trains under it, its parameters streamed from host
// memory layer by layer with the largest weights in 64 KiB tiles, and ends
// with the same parameters as the resident run, bitwise (untiled) or to
// rounding (tiled).
#include <memfit/memory.h>
#include <memfit/precision.h>
#include <memfit/stream.h>

#include <torch/torch.h>

#include <iostream>
#include <optional>

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(256, 1024), torch::nn::ReLU(), torch::nn::Linear(1024, 768),
                               torch::nn::ReLU(), torch::nn::Linear(768, 1));
}

// Trains 20 SGD steps under `budget` bytes (0: none); returns the parameters
// (the host masters when streamed).
std::vector<torch::Tensor> train(std::optional<int64_t> tile_bytes, int64_t budget) {
  auto model = make_model();
  const auto x = torch::randn({32, 256});
  const auto y = x.narrow(1, 0, 8).sum(1, true).tanh();
  std::optional<memfit::MasterWeights> master;
  std::optional<memfit::ParameterStream> stream;
  std::vector<torch::Tensor> params = model->parameters();
  if (tile_bytes) {
    master.emplace(*model, memfit::MasterWeightsOptions()
                               .dtype(torch::kFloat)
                               .offload(memfit::Offload::kHost)
                               .gradients(memfit::Offload::kHost)
                               .parameters(memfit::Offload::kHost));
    stream.emplace(model, *master, memfit::StreamOptions().tile_bytes(*tile_bytes));
    params = master->master_parameters();
  }
  std::optional<memfit::UntrackedGuard> host;  // the optimizer steps the host masters
  if (master) host.emplace();
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.05));
  host.reset();
  if (budget > 0) memfit::set_memory_budget(torch::kCPU, memfit::memory_allocated() + budget);
  for (int step = 0; step < 20; ++step) {
    auto out = stream ? stream->forward(x) : model->forward(x);
    torch::mse_loss(out, y).backward();
    {
      std::optional<memfit::UntrackedGuard> on_host;
      if (master) on_host.emplace();
      opt.step();
      opt.zero_grad();
    }
    if (master) master->master_to_model();
  }
  memfit::set_memory_budget(torch::kCPU, 0);
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

int main() {
  memfit::memory_allocated();  // starts counting
  int64_t param_bytes = 0;
  for (const auto& p : make_model()->parameters()) param_bytes += p.numel() * 4;
  const auto resident = train(std::nullopt, 0);
  bool refused = false;
  try {
    train(std::nullopt, 1 << 20);
  } catch (const c10::OutOfMemoryError&) {
    refused = true;  // the resident model's step needs more than 1 MiB
  }
  const auto streamed = train(int64_t{0}, 0);
  const auto tiled = train(int64_t{64} << 10, 1 << 20);
  double worst = 0;
  bool bitwise = true;
  for (size_t i = 0; i < resident.size(); ++i) {
    bitwise = bitwise && streamed[i].equal(resident[i]);
    worst = std::max(worst, ((tiled[i] - resident[i]).norm() / resident[i].norm()).item<double>());
  }
  std::cout << "parameters " << param_bytes / 1024 << " KiB; resident under 1 MiB: "
            << (refused ? "out of memory" : "fits") << "; streamed untiled: "
            << (bitwise ? "bitwise the resident run" : "DIFFERENT") << "; tiled under 1 MiB: relative difference "
            << worst << "\n";
  const bool ok = refused && bitwise && worst < 1e-5;
  std::cout << (ok ? "streamed parameters train like resident ones\n" : "streaming failed\n");
  return ok ? 0 : 1;
}
