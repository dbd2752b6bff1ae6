// Mixed precision with memfit: a small regression trained in fp32, and with
// bfloat16 autocast, bf16 parameters and fp32 master weights (float16 and a
// GradScaler on CUDA); the low-precision run reaches the fp32 loss.
#include <memfit/memory.h>
#include <memfit/precision.h>

#include <torch/torch.h>

#include <cmath>
#include <iostream>
#include <memory>

double train(bool low_precision) {
  torch::manual_seed(0);
  const torch::Device device = torch::cuda::is_available() ? torch::kCUDA : torch::kCPU;
  torch::nn::Sequential model(torch::nn::Linear(16, 64), torch::nn::Tanh(), torch::nn::Linear(64, 1));
  model->to(device);
  const auto x = torch::randn({512, 16}).to(device);
  const auto y = x.sum(1, true).sin();

  // fp16 needs a GradScaler against underflow; bf16 has fp32's range.
  const auto precision = device.is_cuda() ? memfit::Precision::kFP16 : memfit::Precision::kBF16;
  std::unique_ptr<memfit::MasterWeights> master;
  std::vector<torch::Tensor> params = model->parameters();
  if (low_precision) {
    master = std::make_unique<memfit::MasterWeights>(
        *model, memfit::MasterWeightsOptions().dtype(memfit::scalar_type(precision)));
    params = master->master_parameters();
  }
  torch::optim::Adam opt(params, torch::optim::AdamOptions(1e-2));
  memfit::GradScaler scaler(
      memfit::GradScalerOptions().enabled(low_precision && precision == memfit::Precision::kFP16));

  torch::Tensor loss;
  for (int step = 0; step < 300; ++step) {
    {
      memfit::AutocastGuard autocast(device, low_precision ? precision : memfit::Precision::kFP32);
      loss = torch::mse_loss(model->forward(x).to(torch::kFloat), y);
    }
    scaler.scale(loss).backward();
    if (master) master->grads_to_master();
    scaler.unscale_(opt);  // clip the true gradients
    torch::nn::utils::clip_grad_norm_(params, 1.0);
    scaler.step(opt);
    scaler.update();
    if (master) master->master_to_model();
    opt.zero_grad();
  }
  return loss.item<double>();
}

int main() {
  const double fp32 = train(false);
  const double low = train(true);
  std::cout << "final loss fp32 " << fp32 << ", mixed precision " << low << "\n";
  const bool close = std::abs(low - fp32) <= 0.1 * fp32 + 2e-3;
  std::cout << (close ? "mixed precision matches fp32\n" : "mixed precision diverged\n");
  return close ? 0 : 1;
}
