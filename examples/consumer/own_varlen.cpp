// Examples whose sizes vary: the user's language model (own_lm.h) on lines
// of the Jargon File of 8 to 64 tokens, each batch padded to its longest.
// memfit plans for the worst batch, 32 copies of the longest example, under
// 1/4 of that batch's plain peak; then 20 steps of batches grouped by
// length, each up to a length drawn at random, train under that budget, with recovery on for whatever
// the worst case did not foresee. Also the largest batch that fits, found
// on the worst case (FindBatchOptions::largest_example).
#include "own_lm.h"

#include <memfit/data.h>
#include <memfit/memory.h>
#include <memfit/module_plan.h>

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>

constexpr int64_t kContext = 64, kBatch = 32, kPad = -100;

// Token windows cut to 8..64 tokens; get_batch pads a batch to its longest
// (inputs with token 0, targets with kPad, which the loss ignores).
struct Lines : torch::data::datasets::BatchDataset<Lines, torch::data::Example<>> {
  explicit Lines(const memfit::ImageDataset& windows) : windows_(windows) {}
  static int64_t length(size_t i) { return 8 + static_cast<int64_t>((i * 7919) % 57); }
  torch::data::Example<> get_batch(c10::ArrayRef<size_t> indices) override {
    int64_t longest = 0;
    for (size_t i : indices) longest = std::max(longest, length(i));
    auto data = torch::zeros({static_cast<int64_t>(indices.size()), longest}, torch::kLong);
    auto target = torch::full({static_cast<int64_t>(indices.size()), longest}, kPad, torch::kLong);
    for (size_t k = 0; k < indices.size(); ++k) {
      const auto n = length(indices[k]);
      data[static_cast<int64_t>(k)].narrow(0, 0, n).copy_(windows_.images[static_cast<int64_t>(indices[k])].narrow(0, 0, n));
      target[static_cast<int64_t>(k)].narrow(0, 0, n).copy_(windows_.labels[static_cast<int64_t>(indices[k])].narrow(0, 0, n));
    }
    return {data, target};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(windows_.images.size(0)); }
  memfit::ImageDataset windows_;
};

// The summed token losses over examples × kContext: each example weighs
// the same whatever its length and whichever micro-batch it lands in, so
// micro-batches give the gradients of the whole batch. (A mean over the
// batch's real tokens would change with the micro-batching.)
torch::Tensor line_loss(LanguageModel& lm, const torch::data::Example<>& b) {
  namespace F = torch::nn::functional;
  auto logits = lm.forward(b.data);
  const auto sum = F::cross_entropy(logits.view({-1, logits.size(-1)}), b.target.reshape({-1}),
                                    F::CrossEntropyFuncOptions().ignore_index(kPad).reduction(torch::kSum));
  return sum / double(b.data.size(0) * kContext);
}

int main() try {
  torch::manual_seed(1);
  const auto corpus = memfit::load_jargon_file();
  memfit::ImageDataset windows;
  {
    memfit::UntrackedGuard host;  // the data set is host memory, not the device's
    windows = memfit::text_windows(corpus, kContext, memfit::Split::kTrain);
  }
  Lines lines(windows);
  const size_t longest = memfit::largest_example(lines, [](const torch::data::Example<>& b) { return b.data.size(1); });
  torch::data::Example<> worst;
  {
    memfit::UntrackedGuard host;
    worst = lines.get_batch(std::vector<size_t>(kBatch, longest));
  }
  auto lm = std::make_shared<LanguageModel>(corpus.vocab_size(), kContext, 64, 4, 4);
  WeightsSnapshot start(*lm);  // every run starts from these weights
  auto reset = [&] { start.restore(); };
  // The plain peak of the worst batch: its second step (Adam's state made).
  int64_t plain_peak = 0;
  {
    memfit::Trainer plain(lm, line_loss, memfit::TrainerOptions());
    plain.train_step(worst);
    plain_peak = plain.train_step(worst).peak_bytes;
  }
  reset();
  const int64_t budget = plain_peak / 4;
  std::printf("%zu lines of %d to %d tokens; the longest, line %zu, %d times: plain peak %s; budget 1/4: %s\n",
              *lines.size(), 8, int(kContext), longest, int(kBatch), memfit::format_bytes(plain_peak).c_str(),
              memfit::format_bytes(budget).c_str());
  const auto p = memfit::plan(lm, line_loss, worst, budget);
  std::printf("planned for the worst batch: %s\n", p.why[2].c_str());
  // Batches grouped by length, as a length-grouping sampler draws them: a
  // longest length at random, then 32 lines at random no longer than it.
  std::vector<std::vector<size_t>> by_length(kContext + 1);
  for (size_t i = 0; i < *lines.size(); ++i) by_length[static_cast<size_t>(Lines::length(i))].push_back(i);
  at::Generator g = at::detail::createCPUGenerator(3);
  auto draw = [&] {
    memfit::UntrackedGuard host;
    const auto longest_line = torch::randint(8, kContext + 1, {1}, g, torch::kLong).item<int64_t>();
    std::vector<size_t> pool;
    for (int64_t n = 8; n <= longest_line; ++n) pool.insert(pool.end(), by_length[n].begin(), by_length[n].end());
    const auto picks = torch::randint(0, static_cast<int64_t>(pool.size()), {kBatch}, g, torch::kLong);
    std::vector<size_t> indices;
    for (int64_t k = 0; k < kBatch; ++k) indices.push_back(pool[static_cast<size_t>(picks[k].item<int64_t>())]);
    return lines.get_batch(indices);
  };
  // The first batch's plain step, for its loss: the plan keeps the math.
  const auto first = draw();
  double plain_loss = 0;
  {
    memfit::Trainer plain(lm, line_loss, memfit::TrainerOptions());
    plain_loss = plain.train_step(first).loss;
  }
  reset();
  int64_t peak = 0, shortest_batch = kContext, longest_batch = 0;
  double first_difference = 0;
  size_t recoveries = 0;
  bool ok = true;
  {  // the Trainer ends before the weights are reset: a plan that streams holds placeholders until then
    memfit::Trainer planned(lm, line_loss, p.apply(*lm).on_out_of_memory(memfit::OnOutOfMemory::kReplan));
    memfit::set_memory_budget(torch::kCPU, budget);
    for (int step = 0; step < 20; ++step) {
      const auto batch = step == 0 ? first : draw();
      shortest_batch = std::min(shortest_batch, batch.data.size(1));
      longest_batch = std::max(longest_batch, batch.data.size(1));
      const auto rec = planned.train_step(batch);
      if (step == 0) first_difference = std::abs(rec.loss - plain_loss);
      peak = std::max(peak, rec.peak_bytes);
    }
    memfit::set_memory_budget(torch::kCPU, 0);
    recoveries = planned.recoveries().size();
  }
  std::printf("20 steps of padded batches %lld to %lld tokens long under %s: peak %s, %zu recoveries, "
              "first step's loss %.1e from the plain step's\n",
              static_cast<long long>(shortest_batch), static_cast<long long>(longest_batch),
              memfit::format_bytes(budget).c_str(), memfit::format_bytes(peak).c_str(), recoveries,
              first_difference);
  ok = ok && peak <= budget && first_difference <= 1e-5 && shortest_batch < longest_batch;
  // The largest batch that fits 1/4, measured and verified on the worst case.
  reset();
  const auto found = memfit::find_batch(lm, line_loss, lines, budget,
                                        memfit::FindBatchOptions().largest_example(static_cast<int64_t>(longest)));
  std::printf("%s", found.explain().c_str());
  ok = ok && found.plain.verified && found.techniques.verified;
  std::printf("%s\n", ok ? "varying lengths trained under 1/4 of the longest batch's plain peak" : "FAILED");
  return ok ? 0 : 1;
} catch (const c10::Error& e) {
  std::fprintf(stderr, "%s\n", e.what_without_backtrace());
  return 1;
}
