#pragma once
/// \file models.h
/// Built-in models, each a torch::nn::Sequential chain so that later
/// techniques (checkpointing, pipeline stages, the planner's per-layer
/// profile) can cut it at any layer.
///
/// Thread safety: construction is thread-safe. Sync points: none. Extra
/// memory: the parameters and buffers themselves.

#include "memfit/checkpoint.h"  // set_selective_recompute, for make_gpt's blocks

#include <torch/arg.h>
#include <torch//nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <string>

namespace memfit {

/// The built-in model families.
enum class ModelKind { kMlp, kResNet, kGpt };

/// Parses "mlp" or "resnet"; throws c10::Error naming the accepted names.
///
/// Example:
/// \code
///   assert(memfit::parse_model_kind("resnet") == memfit::ModelKind::kResNet);
/// \endcode
ModelKind parse_model_kind(const std::string& name);

/// The name parse_model_kind accepts for `kind`.
///
/// Example:
/// \code
///   assert(memfit::to_string(memfit::ModelKind::kMlp) == "mlp");
/// \endcode
std::string to_string(ModelKind kind);

/// Shape of the input images and of the output.
struct ModelOptions {
  /// Input channels.
  TORCH_ARG(int64_t, in_channels) = 1;
  /// Input height and width.
  TORCH_ARG(int64_t, image_size) = 28;
  /// Output classes.
  TORCH_ARG(int64_t, num_classes) = 10;
  /// MLP: width of each hidden layer. ResNet: channels of the first stage
  /// (doubled at each later stage).
  TORCH_ARG(int64_t, width) = 0;  // 0: the family's default (MLP 512, ResNet 16)
  /// MLP: hidden layers. ResNet: residual blocks per stage.
  TORCH_ARG(int64_t, depth) = 0;  // 0: the family's default (MLP 2, ResNet 2)
  /// ResNet: stages, each halving the resolution after the first.
  TORCH_ARG(int64_t, stages) = 3;
  /// ReLUs overwrite their input where autograd allows it (the input is not
  /// saved for backward), so an activation and its ReLU share memory.
  TORCH_ARG(bool, inplace) = true;
  /// GPT: the attention heads of each block (width must be a multiple).
  TORCH_ARG(int64_t, heads) = 4;
  /// GPT: the longest sequence (positions learned); num_classes is the vocabulary.
  TORCH_ARG(int64_t, context) = 128;
  /// GPT: dropout after the embedding, on the attention weights and after
  /// each residual branch (GPT-2's places).
  TORCH_ARG(double, dropout) = 0.0;
  /// GPT: recompute each block's attention scores, softmax and attention
  /// dropout during backward instead of keeping them (selective activation
  /// recomputation, Korthikanti et al. 2022): the B·heads·T² tensors go, the
  /// rest of the block's activations stay.
  TORCH_ARG(bool, selective_recompute) = false;
};

/// A multi-layer perceptron: Flatten, then `depth` × (Linear, ReLU), then Linear.
///
/// Example:
/// \code
///   auto mlp = memfit::make_mlp(memfit::ModelOptions().width(64).depth(1));
///   auto logits = mlp->forward(torch::zeros({2, 1, 28, 28}));  // [2, 10]
/// \endcode
torch::nn::Sequential make_mlp(const ModelOptions& options = ModelOptions());

/// A ResNet-style CNN (He et al. 2016): a 3×3 stem, `stages` stages of
/// `depth` basic blocks (two 3×3 convolutions with batch norm and a shortcut,
/// a 1×1 projection where the shape changes), global average pooling and a
/// linear classifier. Each block is one element of the Sequential.
///
/// Example:
/// \code
///   auto net = memfit::make_resnet(memfit::ModelOptions().width(8).depth(1));
///   auto logits = net->forward(torch::zeros({2, 1, 28, 28}));  // [2, 10]
/// \endcode
torch::nn::Sequential make_resnet(const ModelOptions& options = ModelOptions());

/// A decoder-only transformer (GPT-2's layout with pre-LayerNorm blocks):
/// token and position embeddings, `depth` blocks of causal multi-head
/// self-attention and a 4×width GELU MLP, each a residual branch, then a
/// final LayerNorm and a linear head over the vocabulary (num_classes). Input
/// [B, T] token ids (T ≤ context), output [B, T, num_classes] logits. The
/// embedding, each block and the head are the Sequential's elements, so
/// checkpoint schedules and the planner work on blocks. Width defaults to 128,
/// depth to 4.
///
/// Example:
/// \code
///   auto gpt = memfit::make_gpt(memfit::ModelOptions().num_classes(50).width(32).depth(2).heads(2).context(16));
///   auto logits = gpt->forward(torch::zeros({2, 16}, torch::kLong));  // [2, 16, 50]
/// \endcode
torch::nn::Sequential make_gpt(const ModelOptions& options = ModelOptions());

/// Loads a TorchScript module saved from Python (`torch.jit.script(m).save(path)`)
/// as a Sequential of its top-level children, so that checkpoint schedules,
/// the planner and the Trainer work on it: each element runs one child
/// through TorchScript and holds that child's parameters and buffers under
/// their Python names ("4.0.conv1.weight"); the optimizer updates the
/// TorchScript module's own tensors in place, and train()/eval() reach it.
/// The module's forward must be its children in order, as an nn.Sequential's
/// is (script `nn.Sequential(*list(resnet.children())[:-1], nn.Flatten(),
/// resnet.fc)` rather than the ResNet itself); with `check_input` defined,
/// the chain's output is compared with the module's forward on it (eval
/// mode, no grad) and a mismatch is a c10::Error saying so. The children
/// run without the TorchScript graph executor's optimizations (as under
/// `torch._C._set_graph_executor_optimize(False)`): autograd differentiates
/// them as it does eager code, so a step's peak and time are those of the
/// same model written in C++ (the executor's own differentiable graphs
/// saved 1.24 MiB more and ran about 6% slower on bench/tax.py's CNN).
///
/// Example:
/// \code
///   auto chain = memfit::load_torchscript("resnet18.pt", torch::zeros({1, 1, 28, 28}));
/// \endcode
torch::nn::Sequential load_torchscript(const std::string& path, const torch::Tensor& check_input = torch::Tensor());

/// make_mlp, make_resnet or make_gpt by kind; rejects non-positive sizes with c10::Error.
///
/// Example:
/// \code
///   auto net = memfit::make_model(memfit::ModelKind::kMlp);
/// \endcode
torch::nn::Sequential make_model(ModelKind kind, const ModelOptions& options = ModelOptions());

} // namespace memfit
