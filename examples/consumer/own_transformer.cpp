// Bring your own model: a decoder-only language model of the user's own
// (embedding, a chain of hand-written transformer blocks, a head) on the
// Jargon File, planned by memfit under 1/2, 1/4 and 1/8 of its plain peak.
// The only memfit-specific line in the model is holding the blocks in a
// memfit::CheckpointedSequential: that marks where the plan may recompute.
#include <memfit/data.h>
#include <memfit/memory.h>
#include <memfit/module_plan.h>

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>

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

torch::Tensor next_token_loss(LanguageModel& lm, const torch::data::Example<>& b) {
  auto logits = lm.forward(b.data);
  return torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}), b.target.view({-1}));
}

struct Run { double loss = 0, seconds = 1e30; int64_t peak = 0; };

// Three steps from the same weights under `budget` bytes (0: none): the
// first step's loss, the steady (third) step's peak and the faster step time.
Run run(const std::shared_ptr<LanguageModel>& lm, const memfit::TrainerOptions& options,
        const torch::data::Example<>& batch, int64_t budget) {
  torch::manual_seed(7);
  memfit::Trainer trainer(lm, next_token_loss, options);
  memfit::set_memory_budget(torch::kCPU, budget);
  Run r;
  for (int i = 0; i < 3; ++i) {
    const auto start = std::chrono::steady_clock::now();
    auto rec = trainer.train_step(batch);
    r.seconds = std::min(r.seconds, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (i == 0) r.loss = rec.loss;
    r.peak = rec.peak_bytes;
  }
  memfit::set_memory_budget(torch::kCPU, 0);
  return r;
}

int main() try {
  torch::manual_seed(1);
  constexpr int64_t kContext = 64, kBatch = 64;
  const auto corpus = memfit::load_jargon_file();
  torch::data::Example<> batch;
  {
    memfit::UntrackedGuard host;  // the data set is host memory, not the device's
    auto windows = memfit::text_windows(corpus, kContext, memfit::Split::kTrain);
    batch = {windows.images.narrow(0, 0, kBatch).clone(), windows.labels.narrow(0, 0, kBatch).clone()};
  }
  auto lm = std::make_shared<LanguageModel>(corpus.vocab_size(), kContext, 128, 6, 4);
  std::vector<torch::Tensor> start;  // every run starts from these weights (host copies)
  {
    memfit::UntrackedGuard host;
    for (const auto& p : lm->parameters()) start.push_back(p.detach().clone());
  }
  auto reset = [&] {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < start.size(); ++i) lm->parameters()[i].copy_(start[i]).mutable_grad() = torch::Tensor();
  };
  const Run plain = run(lm, memfit::TrainerOptions(), batch, 0);
  std::printf("plain step of %lld windows of %lld tokens: peak %s, loss %.6f, %.2f ms per window\n",
              static_cast<long long>(kBatch), static_cast<long long>(kContext),
              memfit::format_bytes(plain.peak).c_str(), plain.loss, 1e3 * plain.seconds / kBatch);
  bool ok = true;
  // The last case forbids micro-batches (as a model with batch statistics
  // would): the plan then recomputes blocks of the chain.
  for (auto [divisor, micro_batching] : {std::pair{2, true}, {4, true}, {8, true}, {3, false}}) {
    reset();
    const int64_t budget = plain.peak / divisor;
    const auto p = memfit::plan(lm, next_token_loss, batch, budget,  // leaves lm as it was
                                memfit::PlanOptions().micro_batching(micro_batching));
    const Run r = run(lm, p.apply(*lm), batch, budget);
    const double error = double(p.predicted.peak_bytes - r.peak) / double(r.peak);
    std::printf("1/%d of plain (%s)%s: %s\n  peak %s (predicted %s, %+.1f%%), loss %.6f (plain %+.1e), "
                "%.2fx plain's time per window\n",
                divisor, memfit::format_bytes(budget).c_str(), micro_batching ? "" : ", no micro-batches",
                p.why[2].c_str(),
                memfit::format_bytes(r.peak).c_str(), memfit::format_bytes(p.predicted.peak_bytes).c_str(),
                100 * error, r.loss, r.loss - plain.loss, r.seconds / plain.seconds);
    ok = ok && r.peak <= budget && std::abs(error) <= 0.05 && std::abs(r.loss - plain.loss) <= 1e-5;
  }
  std::printf("%s\n", ok ? "own transformer planned under 1/2, 1/4 and 1/8 of its peak" : "FAILED");
  return ok ? 0 : 1;
} catch (const c10::Error& e) {
  std::fprintf(stderr, "%s\n", e.what_without_backtrace());
  return 1;
}
