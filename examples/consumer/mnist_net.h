#pragma once
// pytorch/examples' cpp/mnist Net, as a user has it: its own forward,
// Dropout2d, dropout and log-softmax, trained with nll_loss. Used by
// own_model_mnist.cpp and memfit's bench/ (the library tax, the plan).
#include <torch/torch.h>

struct Net : torch::nn::Module {
  Net()
      : conv1(torch::nn::Conv2dOptions(1, 10, /*kernel_size=*/5)),
        conv2(torch::nn::Conv2dOptions(10, 20, /*kernel_size=*/5)),
        fc1(320, 50),
        fc2(50, 10) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv2_drop", conv2_drop);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1->forward(x), 2));
    x = torch::relu(torch::max_pool2d(conv2_drop->forward(conv2->forward(x)), 2));
    x = x.view({-1, 320});
    x = torch::relu(fc1->forward(x));
    x = torch::dropout(x, /*p=*/0.5, /*train=*/is_training());
    return torch::log_softmax(fc2->forward(x), /*dim=*/1);
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Dropout2d conv2_drop;
  torch::nn::Linear fc1, fc2;
};

inline torch::Tensor nll(Net& net, const torch::data::Example<>& batch) {
  return torch::nll_loss(net.forward(batch.data), batch.target);
}
