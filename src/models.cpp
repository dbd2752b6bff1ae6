#include "memfit/models.h"

#include "memfit/checkpoint.h"

#include "compat.h"

#include <torch/nn.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>

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

// Token and learned position embeddings: [B, T] ids to [B, T, width].
struct GptEmbeddingImpl : nn::Module {
  GptEmbeddingImpl(int64_t vocab, int64_t context, int64_t width, double dropout)
      : tokens(vocab, width), positions(context, width), drop(dropout) {
    register_module("tokens", tokens);
    register_module("positions", positions);
    register_module("drop", drop);
    nn::init::normal_(tokens->weight, 0.0, 0.02);
    nn::init::normal_(positions->weight, 0.0, 0.02);
  }

  torch::Tensor forward(const torch::Tensor& ids) {
    TORCH_CHECK(ids.dim() == 2 && !torch::is_floating_point(ids), "the GPT takes [batch, time] token ids, got ",
                ids.dim(), "-D ", ids.scalar_type());
    const int64_t t = ids.size(1);
    TORCH_CHECK(t <= positions->weight.size(0), "the GPT's context is ", positions->weight.size(0),
                " tokens, got a sequence of ", t, ": cut it, or build the model with a longer context");
    auto pos = torch::arange(t, ids.options().dtype(torch::kLong));
    return drop(tokens(ids) + positions(pos));
  }

  nn::Embedding tokens;
  nn::Embedding positions;
  nn::Dropout drop;
};
TORCH_MODULE(GptEmbedding);

// softmax(q·kᵀ/√d, causal) · v, with dropout on the weights: the part of
// attention whose activations grow with T².
torch::Tensor core_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double dropout,
                             bool training) {
  const int64_t t = q.size(-2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(q.size(-1))));
  auto mask = torch::ones({t, t}, q.options().dtype(torch::kBool)).triu(1);
  auto weights = torch::softmax(scores.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
  weights = torch::dropout(weights, dropout, training);
  return torch::matmul(weights, v);
}

// A pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)).
struct GptBlockImpl : nn::Module, SelectivelyRecomputed {
  GptBlockImpl(int64_t width, int64_t heads, double dropout, bool selective)
      : heads(heads),
        dropout(dropout),
        selective(selective),
        ln1(nn::LayerNormOptions({width})),
        qkv(width, 3 * width),
        proj(width, width),
        ln2(nn::LayerNormOptions({width})),
        fc(width, 4 * width),
        out(4 * width, width),
        drop(dropout) {
    register_module("ln1", ln1);
    register_module("qkv", qkv);
    register_module("proj", proj);
    register_module("ln2", ln2);
    register_module("fc", fc);
    register_module("out", out);
    register_module("drop", drop);
  }

  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), c = x.size(2);
    auto split = qkv(ln1(x)).view({b, t, 3, heads, c / heads}).permute({2, 0, 3, 1, 4});
    auto q = split[0], k = split[1], v = split[2];  // [B, heads, T, c/heads]
    torch::Tensor y;
    if (selective && is_training() && torch::GradMode::is_enabled()) {
      const double p = dropout;
      y = memfit::checkpoint(
          [p](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{core_attention(in[0], in[1], in[2], p, true)}; },
          {q, k, v})[0];
    } else {
      y = core_attention(q, k, v, dropout, is_training());
    }
    y = y.transpose(1, 2).reshape({b, t, c});
    auto h = x + drop(proj(y));
    return h + drop(out(torch::gelu(fc(ln2(h)))));
  }

  void set_selective_recompute(bool enabled) override { selective = enabled; }
  bool selective_recompute() const override { return selective; }

  int64_t heads;
  double dropout;
  bool selective;
  nn::LayerNorm ln1;
  nn::Linear qkv;
  nn::Linear proj;
  nn::LayerNorm ln2;
  nn::Linear fc;
  nn::Linear out;
  nn::Dropout drop;
};
TORCH_MODULE(GptBlock);

// Final LayerNorm and the projection to the vocabulary.
struct GptHeadImpl : nn::Module {
  GptHeadImpl(int64_t width, int64_t vocab) : ln(nn::LayerNormOptions({width})), logits(nn::LinearOptions(width, vocab).bias(false)) {
    register_module("ln", ln);
    register_module("logits", logits);
  }
  torch::Tensor forward(const torch::Tensor& x) { return logits(ln(x)); }
  nn::LayerNorm ln;
  nn::Linear logits;
};
TORCH_MODULE(GptHead);

// The name of a TorchScript module's class ("TorchScript BatchNorm2d" for
// Python's nn.BatchNorm2d), so that scripted layers are told apart by name as
// C++ ones are: batch_statistics_layer finds a scripted BatchNorm, and
// MasterWeights keeps scripted normalisation layers in fp32.
std::string script_name(const torch::jit::Module& m) {
  const auto& type = m.type()->name();
  return type ? "TorchScript " + type->name() : std::string("TorchScript");
}

// A plain module holding a TorchScript module's own parameters and buffers
// (the same tensors) under their names, recursively.
std::shared_ptr<nn::Module> mirror(const torch::jit::Module& m) {
  auto holder = std::make_shared<nn::Module>(script_name(m));
  for (const auto& p : m.named_parameters(/*recurse=*/false)) holder->register_parameter(p.name, p.value, p.value.requires_grad());
  for (const auto& b : m.named_buffers(/*recurse=*/false)) holder->register_buffer(b.name, b.value);
  for (const auto& c : m.named_children()) holder->register_module(c.name, mirror(c.value));
  return holder;
}

// The line a TorchScript error ends with: the error itself, after the
// interpreter's traceback (and before LibTorch 2's C++ backtrace, left out).
std::string last_line(const std::exception& e) {
  std::string what = compat::message_of(e);
  while (!what.empty() && (what.back() == '\n' || what.back() == ' ')) what.pop_back();
  return what.substr(what.find_last_of('\n') + 1);
}

// One top-level child of a TorchScript module as a Sequential element.
struct ScriptedChildImpl : nn::Module {
  explicit ScriptedChildImpl(torch::jit::Module m) : nn::Module(script_name(m)), module(std::move(m)) {
    for (const auto& p : module.named_parameters(/*recurse=*/false)) register_parameter(p.name, p.value, p.value.requires_grad());
    for (const auto& b : module.named_buffers(/*recurse=*/false)) register_buffer(b.name, b.value);
    for (const auto& c : module.named_children()) register_module(c.name, mirror(c.value));
  }
  // The interpreter rethrows what fails inside as another error (1.13: a
  // std::runtime_error; 2.x: a c10::Error) whose 20-odd lines of traceback end
  // with the error: said here in that one line, and an out-of-memory error
  // stays one (recovery re-plans on it).
  torch::Tensor forward(const torch::Tensor& x) {
    torch::jit::GraphOptimizerEnabledGuard eager(false);
    try {
      return module.forward({x}).toTensor();
    } catch (const c10::OutOfMemoryError&) {
      throw;
    } catch (const std::exception& e) {
      const std::string what = last_line(e);
      TORCH_CHECK_WITH(OutOfMemoryError, what.find("out of memory") == std::string::npos, name(),
                       " ran out of memory: ", what);
      TORCH_CHECK(false, name(), " failed: ", what);
    }
  }
  void train(bool on = true) override {
    nn::Module::train(on);
    module.train(on);
  }
  torch::jit::Module module;
};
TORCH_MODULE(ScriptedChild);

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
  if (name == "gpt") return ModelKind::kGpt;
  TORCH_CHECK(false, "unknown model '", name, "': expected mlp, resnet or gpt");
}

std::string to_string(ModelKind kind) {
  switch (kind) {
    case ModelKind::kMlp: return "mlp";
    case ModelKind::kResNet: return "resnet";
    case ModelKind::kGpt: return "gpt";
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled model kind");
}

torch::nn::Sequential load_torchscript(const std::string& path, const torch::Tensor& check_input) {
  TORCH_CHECK(std::filesystem::exists(path), "no TorchScript file at ", path,
              ": save one from Python with torch.jit.script(model).save(path)");
  torch::jit::Module script;
  try {
    script = torch::jit::load(path, torch::kCPU);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, " is not a TorchScript module (torch.jit.script(model).save(path) writes one): ",
                e.what_without_backtrace());
  }
  nn::Sequential seq;
  for (const auto& child : script.named_children()) seq->push_back(std::string(child.name), ScriptedChild(child.value));
  TORCH_CHECK(seq->size() > 0, path, " holds a TorchScript module without children: memfit runs modules "
              "whose forward is their children in order (script an nn.Sequential)");
  TORCH_CHECK(script.named_parameters(/*recurse=*/true).size() == seq->parameters().size(), path,
              " holds parameters outside its children: memfit runs modules whose forward is their children "
              "in order (script an nn.Sequential)");
  if (check_input.defined()) {
    torch::NoGradGuard no_grad;
    script.eval();
    seq->eval();
    torch::Tensor whole;
    try {
      whole = script.forward({check_input}).toTensor();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, path, "'s forward fails on the check input of shape ", check_input.sizes(), ": ",
                  last_line(e));
    }
    torch::Tensor chained;
    std::string failure;
    try {
      chained = seq->forward(check_input);
    } catch (const std::exception& e) {
      failure = last_line(e);
    }
    seq->train();
    TORCH_CHECK(failure.empty() && whole.sizes() == chained.sizes() && torch::allclose(whole, chained, 1e-5, 1e-6),
                path, "'s forward is not its children run in order (",
                failure.empty() ? "an input gives other values through the children" : "the children fail: " + failure,
                "): script an nn.Sequential, e.g. nn.Sequential(*list(resnet.children())[:-1], nn.Flatten(), resnet.fc)");
  }
  return seq;
}

torch::nn::Sequential make_gpt(const ModelOptions& o) {
  check_shape(o);
  check_positive("heads", o.heads());
  check_positive("context", o.context());
  TORCH_CHECK(o.dropout() >= 0 && o.dropout() < 1, "model option dropout must be in [0, 1), got ", o.dropout());
  const int64_t width = o.width() > 0 ? o.width() : 128;
  const int64_t depth = o.depth() > 0 ? o.depth() : 4;
  TORCH_CHECK(width % o.heads() == 0, "the GPT's width ", width, " is not a multiple of its ", o.heads(),
              " heads: choose a width that the heads divide");
  nn::Sequential seq;
  seq->push_back("embed", GptEmbedding(o.num_classes(), o.context(), width, o.dropout()));
  for (int64_t i = 0; i < depth; ++i) {
    seq->push_back("block" + std::to_string(i), GptBlock(width, o.heads(), o.dropout(), o.selective_recompute()));
  }
  seq->push_back("head", GptHead(width, o.num_classes()));
  // GPT-2's initialisation: linear weights from N(0, 0.02), biases zero (so a
  // fresh model's loss is about log(vocabulary)).
  torch::NoGradGuard no_grad;
  for (auto& m : seq->modules(false)) {
    if (auto* linear = m->as<nn::Linear>()) {
      nn::init::normal_(linear->weight, 0.0, 0.02);
      if (linear->bias.defined()) nn::init::zeros_(linear->bias);
    }
  }
  return seq;
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
  switch (kind) {
    case ModelKind::kMlp: return make_mlp(options);
    case ModelKind::kResNet: return make_resnet(options);
    case ModelKind::kGpt: return make_gpt(options);
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled model kind");
}

} // namespace memfit
