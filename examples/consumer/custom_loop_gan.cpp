// A GAN in the user's own loop: two models, two optimizers, and memfit's
// pieces where a PyTorch user would put torch.amp and torch.utils.checkpoint:
// autocast, one GradScaler over both optimizers, the generator's wide block
// checkpointed, and memory stats printed per step. Real images: Fashion-MNIST
// through LibTorch's torch::data MNIST reader.
#include <memfit/checkpoint.h>
#include <memfit/data.h>
#include <memfit/environment.h>
#include <memfit/memory.h>
#include <memfit/precision.h>

#include <torch/torch.h>

#include <cstdio>

namespace nn = torch::nn;

struct Generator : nn::Module {
  nn::Linear in{nn::Linear(32, 256)}, out{nn::Linear(256, 784)};
  nn::Sequential block;  // six Linear(256, 256) + ReLU: activations outweigh weights at batch 512
  bool checkpointed = true;
  Generator() {
    for (int i = 0; i < 6; ++i) {
      block->push_back(nn::Linear(256, 256));
      block->push_back(nn::ReLU());
    }
    register_module("in", in);
    register_module("block", block);
    register_module("out", out);
  }
  torch::Tensor forward(const torch::Tensor& z) {
    auto h = torch::relu(in->forward(z));
    auto run = [this](const torch::Tensor& x) { return block->forward(x); };
    h = checkpointed ? memfit::checkpoint(run, h) : run(h);  // torch.utils.checkpoint
    return torch::tanh(out->forward(h));
  }
};

struct Discriminator : nn::Module {
  nn::Sequential net{nn::Linear(784, 512), nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(0.2)),
                     nn::Linear(512, 1)};
  Discriminator() { register_module("net", net); }
  torch::Tensor forward(const torch::Tensor& x) { return net->forward(x.flatten(1)); }
};

int main() {
  torch::manual_seed(0);
  const torch::Device device = torch::cuda::is_available() ? torch::kCUDA : torch::kCPU;
  // fp16 on CUDA; bf16 on a CPU that computes it natively (fp32's range: the scaler's powers of two change
  // nothing); fp32 elsewhere, where LibTorch's fallback bf16 kernels are slower than fp32 (AutocastGuard off).
  const auto precision = device.is_cuda()                       ? memfit::Precision::kFP16
                         : memfit::cpu_computes_bf16_natively() ? memfit::Precision::kBF16
                                                                : memfit::Precision::kFP32;
  std::printf("autocast: %s\n", memfit::to_string(precision).c_str());
  auto data = [] {
    memfit::UntrackedGuard host;  // the data set is host memory, not the device's
    return torch::data::datasets::MNIST(memfit::fashion_mnist_folder())
        .map(torch::data::transforms::Normalize<>(0.5, 0.5))  // [-1, 1], as the generator's tanh
        .map(torch::data::transforms::Stack<>());
  }();
  auto loader = torch::data::make_data_loader<torch::data::samplers::RandomSampler>(std::move(data), 512);
  auto g = std::make_shared<Generator>();
  auto d = std::make_shared<Discriminator>();
  g->to(device);
  d->to(device);
  torch::optim::Adam g_opt(g->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
  torch::optim::Adam d_opt(d->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
  memfit::GradScaler scaler;  // one scaler, two optimizers: step each, update once
  namespace F = nn::functional;
  auto bce = [](const torch::Tensor& logits, double target) {
    return F::binary_cross_entropy_with_logits(logits.to(torch::kFloat), torch::full_like(logits, target).to(torch::kFloat));
  };
  // One iteration: the discriminator on real and generated images, then the generator.
  auto step = [&](const torch::Tensor& real) {
    const auto z = torch::randn({real.size(0), 32}, real.options());
    torch::Tensor d_loss, g_loss;
    {
      memfit::AutocastGuard autocast(device, precision);
      d_loss = bce(d->forward(real), 1.0) + bce(d->forward(g->forward(z).detach()), 0.0);
    }
    d_opt.zero_grad();
    scaler.scale(d_loss).backward();
    scaler.step(d_opt);
    {
      memfit::AutocastGuard autocast(device, precision);
      g_loss = bce(d->forward(g->forward(z)), 1.0);
    }
    g_opt.zero_grad();
    scaler.scale(g_loss).backward();
    scaler.step(g_opt);
    scaler.update();
    return std::make_pair(d_loss.item<double>(), g_loss.item<double>());
  };

  int steps = 0;
  torch::Tensor first;
  for (auto& batch : *loader) {
    const auto real = batch.data.to(device);
    if (!first.defined()) first = real;
    memfit::PeakMeter meter(device);
    const auto [d_loss, g_loss] = step(real);
    if (++steps % 10 == 0) {
      std::printf("step %3d: D loss %.3f, G loss %.3f, peak %s, allocated %s, scale %.0f\n", steps, d_loss, g_loss,
                  memfit::format_bytes(meter.peak_delta()).c_str(),
                  memfit::format_bytes(memfit::memory_allocated(device)).c_str(), scaler.get_scale());
    }
    if (steps == 60) break;
  }
  // What the checkpoint saves: one iteration's peak with and without it.
  auto peak = [&](bool checkpointed) {
    g->checkpointed = checkpointed;
    memfit::PeakMeter meter(device);
    step(first);
    return meter.peak_delta();
  };
  const int64_t plain = peak(false), checkpointed = peak(true);
  std::printf("generator block checkpointed: step peak %s instead of %s (saved %s)\n",
              memfit::format_bytes(checkpointed).c_str(), memfit::format_bytes(plain).c_str(),
              memfit::format_bytes(plain - checkpointed).c_str());
  const bool ok = checkpointed < plain && scaler.get_scale() > 0;
  std::printf("%s\n", ok ? "gan trained with memfit's pieces" : "FAILED");
  return ok ? 0 : 1;
}
