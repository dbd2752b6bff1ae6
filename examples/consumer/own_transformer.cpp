// Bring your own model: a decoder-only language model of the user's own
// (own_lm.h: embedding, a chain of hand-written transformer blocks, a head)
// on the Jargon File, planned by memfit under 1/2, 1/4 and 1/8 of its plain
// peak, each plan run under its budget beside its prediction; the plan
// saved as a run saves it beside its checkpoint, and read back to resume
// with; then the largest batch that fits 1/4 of it.
#include "own_lm.h"

#include <memfit/data.h>
#include <memfit/memory.h>
#include <memfit/module_plan.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>

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
  WeightsSnapshot start(*lm);  // every run starts from these weights
  auto reset = [&] { start.restore(); };
  const Run plain = run(lm, memfit::TrainerOptions(), batch, 0);
  std::printf("plain step of %lld windows of %lld tokens: peak %s, loss %.6f, %.2f ms per window\n",
              static_cast<long long>(kBatch), static_cast<long long>(kContext),
              memfit::format_bytes(plain.peak).c_str(), plain.loss, 1e3 * plain.seconds / kBatch);
  bool ok = true;
  std::optional<memfit::ModulePlan> quarter;  // the plan under 1/4, saved and resumed below
  // The last case forbids micro-batches (as a model with batch statistics
  // would): the plan then recomputes blocks of the chain or streams their
  // parameters, whichever it measures faster (streaming, on a 2-core CPU).
  for (auto [divisor, micro_batching] : {std::pair{2, true}, {4, true}, {8, true}, {3, false}}) {
    reset();
    const int64_t budget = plain.peak / divisor;
    const auto p = memfit::plan(lm, next_token_loss, batch, budget,  // leaves lm as it was
                                memfit::PlanOptions().micro_batching(micro_batching));
    if (divisor == 4) quarter = p;
    const Run r = run(lm, p.apply(*lm), batch, budget);
    const double error = double(p.predicted.peak_bytes - r.peak) / double(r.peak);
    std::printf("1/%d of plain (%s)%s: %s\n  peak %s (predicted %s, %+.1f%%; the plan's own steps: %s), "
                "loss %.6f (plain %+.1e), %.2fx plain's time per window\n",
                divisor, memfit::format_bytes(budget).c_str(), micro_batching ? "" : ", no micro-batches",
                p.why[2].c_str(), memfit::format_bytes(r.peak).c_str(),
                memfit::format_bytes(p.predicted.peak_bytes).c_str(), 100 * error,
                p.measured_peak_bytes > 0 ? memfit::format_bytes(p.measured_peak_bytes).c_str() : "not run",
                r.loss, r.loss - plain.loss,
                r.seconds / plain.seconds);
    // Where the plan ran its choice under the budget before returning it, the
    // same bytes as this run (on a busy machine it may choose, untimed, the
    // candidate that does least: measured_peak_bytes 0, "not run"; a
    // run 2026-11-26 under ctest's load did so at 1/3). Predictions err on
    // the safe side where they err:
    // under 1/8 the step is measured at micro-batches of 2 and 3 (larger ones
    // exceed the budget), and checkpointed blocks at 8 or 16 are
    // over-predicted (+4.9% and +9.0% measured, docs/planner.md).
    const bool as_run = p.measured_peak_bytes == 0 || r.peak == p.measured_peak_bytes;
    ok = ok && r.peak <= budget && as_run && error >= -0.05 && error <= 0.15 &&
         std::abs(r.loss - plain.loss) <= 1e-5;
  }
  // A run saved under the 1/4 plan resumes with it (planning again may time
  // another near-equal candidate fastest, which its checkpoint may refuse).
  const auto saved = (std::filesystem::temp_directory_path() / "memfit_own_transformer_plan.json").string();
  memfit::save_plan(*quarter, saved);
  const auto resumed = memfit::load_plan(saved);
  const auto mismatch = memfit::plan_mismatch(resumed, *lm, kBatch, plain.peak / 4, memfit::PlanOptions());
  std::remove(saved.c_str());
  std::printf("the 1/4 plan saved and read back: %s\n", mismatch.empty() ? "it suits the resumed run" : mismatch.c_str());
  ok = ok && mismatch.empty() && resumed.apply(*lm).micro_batch_size() == quarter->apply(*lm).micro_batch_size() &&
       resumed.to_json() == quarter->to_json();
  // The largest batch of the data set one step takes under 1/4 of the plain
  // peak, plainly and with memfit's techniques, each run under the budget.
  auto windows = memfit::jargon_dataset(kContext, memfit::Split::kTrain);
  const auto found = memfit::find_batch(lm, next_token_loss, windows, plain.peak / 4);
  std::printf("%s", found.explain().c_str());
  ok = ok && found.plain.verified && found.techniques.verified && found.techniques.batch > found.plain.batch;
  std::printf("%s\n", ok ? "own transformer planned under 1/2, 1/4 and 1/8 of its peak" : "FAILED");
  return ok ? 0 : 1;
} catch (const c10::Error& e) {
  std::fprintf(stderr, "%s\n", e.what_without_backtrace());
  return 1;
}
