#include "memfit/models.h"

#include <torch/nn.h>

namespace memfit {
namespace {

namespace nn = torch::nn;

// A basic residual block: conv-bn-relu-conv-bn plus a shortcut, then relu.
struct BasicBlockImpl : nn::Module {
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride, bool inplace)
      : inplace(inplace),
        conv1(nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)),
        bn1(out),
        conv2(nn::Conv2dOptions(out, out, 3).stride(1).padding(1).bias(false)),
        bn2(out) {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    register_module("conv2", conv2);
    register_module("bn2", bn2);
    if (stride != 1 || in != out) {
      shortcut = nn::Sequential(
          nn::Conv2d(nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)),
          nn::BatchNorm2d(out));
      register_module("shortcut", shortcut);
    }
  }

  torch::Tensor forward(const torch::Tensor& x) {
    // BatchNorm saves its input, not its output, and the sum saves nothing:
    // both ReLUs may overwrite what they are given.
    auto y = relu(bn1(conv1(x)));
    y = bn2(conv2(y));
    y = y + (shortcut ? shortcut->forward(x) : x);
    return relu(y);
  }

  torch::Tensor relu(torch::Tensor t) const { return inplace ? torch::relu_(t) : torch::relu(t); }

  bool inplace;
  nn::Conv2d conv1;
  nn::BatchNorm2d bn1;
  nn::Conv2d conv2;
  nn::BatchNorm2d bn2;
  nn::Sequential shortcut{nullptr};
};
TORCH_MODULE(BasicBlock);

void check_positive(const char* what, int64_t value) {
  TORCH_CHECK(value > 0, "model option ", what, " must be positive, got ", value);
}

void check_shape(const ModelOptions& o) {
  check_positive("in_channels", o.in_channels());
  check_positive("image_size", o.image_size());
  check_positive("num_classes", o.num_classes());
  TORCH_CHECK(o.width() >= 0, "model option width must be positive (0: default), got ",
              o.width());
  TORCH_CHECK(o.depth() >= 0, "model option depth must be positive (0: default), got ",
              o.depth());
}

} // namespace

ModelKind parse_model_kind(const std::string& name) {
  if (name == "mlp") return ModelKind::kMlp;
  if (name == "resnet") return ModelKind::kResNet;
  TORCH_CHECK(false, "unknown model '", name, "': expected mlp or resnet");
}

std::string to_string(ModelKind kind) {
  return kind == ModelKind::kMlp ? "mlp" : "resnet";
}

torch::nn::Sequential make_mlp(const ModelOptions& o) {
  check_shape(o);
  const int64_t width = o.width() > 0 ? o.width() : 512;
  const int64_t depth = o.depth() > 0 ? o.depth() : 2;
  nn::Sequential seq;
  seq->push_back("flatten", nn::Flatten());
  int64_t in = o.in_channels() * o.image_size() * o.image_size();
  for (int64_t i = 0; i < depth; ++i) {
    seq->push_back("fc" + std::to_string(i), nn::Linear(in, width));
    seq->push_back("relu" + std::to_string(i), nn::ReLU(nn::ReLUOptions().inplace(o.inplace())));
    in = width;
  }
  seq->push_back("head", nn::Linear(in, o.num_classes()));
  return seq;
}

torch::nn::Sequential make_resnet(const ModelOptions& o) {
  check_shape(o);
  check_positive("stages", o.stages());
  const int64_t width = o.width() > 0 ? o.width() : 16;
  const int64_t depth = o.depth() > 0 ? o.depth() : 2;
  nn::Sequential seq;
  seq->push_back("stem_conv", nn::Conv2d(nn::Conv2dOptions(o.in_channels(), width, 3)
                                             .padding(1)
                                             .bias(false)));
  seq->push_back("stem_bn", nn::BatchNorm2d(width));
  seq->push_back("stem_relu", nn::ReLU(nn::ReLUOptions().inplace(o.inplace())));
  int64_t channels = width;
  for (int64_t s = 0; s < o.stages(); ++s) {
    const int64_t out = width << s;
    for (int64_t b = 0; b < depth; ++b) {
      const int64_t stride = (s > 0 && b == 0) ? 2 : 1;
      seq->push_back("stage" + std::to_string(s) + "_block" + std::to_string(b),
                     BasicBlock(channels, out, stride, o.inplace()));
      channels = out;
    }
  }
  seq->push_back("pool", nn::AdaptiveAvgPool2d(nn::AdaptiveAvgPool2dOptions(1)));
  seq->push_back("flatten", nn::Flatten());
  seq->push_back("head", nn::Linear(channels, o.num_classes()));
  return seq;
}

torch::nn::Sequential make_model(ModelKind kind, const ModelOptions& options) {
  return kind == ModelKind::kMlp ? make_mlp(options) : make_resnet(options);
}

} // namespace memfit
