#pragma once
// A user's own decoder-only language model: token and position embeddings,
// a stack of hand-written pre-norm transformer blocks, a head. The one
// memfit-specific line: the blocks are held in a memfit::CheckpointedSequential,
// which marks where a plan may recompute. Used by own_transformer.cpp and
// memfit's bench/plan_bench.cpp.
#include <memfit/memory.h>
#include <memfit/checkpoint.h>

#include <torch/torch.h>

#include <cmath>
#include <vector>

struct BlockImpl : torch::nn::Module {  // pre-norm: attention, then an MLP, each with a residual
  BlockImpl(int64_t d, int64_t heads) : heads(heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
    proj = register_module("proj", torch::nn::Linear(d, d));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    up = register_module("up", torch::nn::Linear(d, 4 * d));
    down = register_module("down", torch::nn::Linear(4 * d, d));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2);
    auto q_k_v = qkv->forward(ln1->forward(x)).view({b, t, 3, heads, d / heads}).permute({2, 0, 3, 1, 4});
    auto scores = torch::matmul(q_k_v[0], q_k_v[1].transpose(-2, -1)) / std::sqrt(double(d / heads));
    auto causal = torch::ones({t, t}, torch::kBool).triu(1);
    auto attended = torch::matmul(scores.masked_fill(causal, -1e9).softmax(-1), q_k_v[2]);
    auto h = x + proj->forward(attended.transpose(1, 2).reshape({b, t, d}));
    return h + down->forward(torch::gelu(up->forward(ln2->forward(h))));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, up{nullptr}, down{nullptr};
};
TORCH_MODULE(Block);

struct LanguageModel : torch::nn::Module {
  LanguageModel(int64_t vocab, int64_t context, int64_t d, int64_t layers, int64_t heads) {
    tokens = register_module("tokens", torch::nn::Embedding(vocab, d));
    positions = register_module("positions", torch::nn::Embedding(context, d));
    torch::nn::Sequential stack;
    for (int64_t i = 0; i < layers; ++i) stack->push_back(Block(d, heads));
    blocks = register_module("blocks", memfit::CheckpointedSequential(stack));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    head = register_module("head", torch::nn::Linear(d, vocab));
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    auto x = tokens->forward(ids) + positions->forward(torch::arange(ids.size(1)));
    return head->forward(ln->forward(blocks->forward(x)));
  }
  torch::nn::Embedding tokens{nullptr}, positions{nullptr};
  memfit::CheckpointedSequential blocks{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear head{nullptr};
};

inline torch::Tensor next_token_loss(LanguageModel& lm, const torch::data::Example<>& b) {
  auto logits = lm.forward(b.data);
  return torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}), b.target.view({-1}));
}

// Host copies of a module's parameters, put back by restore() (gradients
// dropped): every run of an example starts from the same weights.
class WeightsSnapshot {
 public:
  explicit WeightsSnapshot(torch::nn::Module& module) : module_(module) {
    memfit::UntrackedGuard host;  // host copies, outside any budget
    for (const auto& p : module.parameters()) saved_.push_back(p.detach().clone());
  }
  void restore() {
    torch::NoGradGuard no_grad;
    auto params = module_.parameters();
    for (size_t i = 0; i < saved_.size(); ++i) params[i].copy_(saved_[i]).mutable_grad() = torch::Tensor();
  }

 private:
  torch::nn::Module& module_;
  std::vector<torch::Tensor> saved_;
};
