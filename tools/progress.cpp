#include "progress.h"

#include "compat.h"
#include "memfit/memory.h"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>

namespace memfit {
namespace tools {
namespace {
// The signal (SIGINT, SIGTERM or SIGHUP) that asked `memfit train` to stop, 0 if none.
volatile std::sig_atomic_t g_signal = 0;
} // namespace

ProgressBar::ProgressBar(int64_t total, int64_t batch, std::FILE* out, bool interactive)
    : total_(std::max<int64_t>(total, 1)), batch_(batch), out_(out), interactive_(interactive) {}

void ProgressBar::update(int64_t step, double loss, double seconds, int64_t current_bytes,
                         int64_t peak_bytes) {
  const double rate = seconds > 0 ? double(step * batch_) / seconds : 0.0;
  const std::string stats =
      fmt::format("step {:>{}}/{} | loss {:.4f} | {:.0f} samples/s | mem {} | peak {}", step,
                  fmt::formatted_size("{}", total_), total_, loss, rate,
                  format_bytes(current_bytes), format_bytes(peak_bytes));
  if (interactive_) {
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(kWidth * step / total_);
    const std::string bar = std::string(filled, '=') + (filled < kWidth ? ">" : "") +
                            std::string(std::max(0, kWidth - filled - 1), ' ');
    fmt::print(out_, "\r[{}] {}\x1b[K", bar, stats);
    std::fflush(out_);
    open_ = true;
    return;
  }
  const int64_t every = std::max<int64_t>(1, total_ / 10);
  if (step % every == 0 || step == total_ || step == 1) {
    fmt::print(out_, "{}\n", stats);
    std::fflush(out_);
  }
}

void ProgressBar::note(const std::string& line) {
  finish();
  fmt::print(out_, "memfit train: {}\n", line);
  std::fflush(out_);
}

void ProgressBar::finish() {
  if (open_) fmt::print(out_, "\n");
  open_ = false;
  std::fflush(out_);
}

memfit::TrainReport train_with_progress(const TrainArgs& a, memfit::Trainer& trainer,
                                        const memfit::ImageDataset& data, const torch::Device& device,
                                        const std::map<int64_t, int64_t>& budget_changes) {
  ProgressBar bar(trainer.total_steps(data), a.batch, stderr, ::isatty(fileno(stderr)) != 0);
  const auto start = std::chrono::steady_clock::now();
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    std::signal(sig, [](int received) {
      g_signal = received;
      std::signal(received, SIG_DFL);
    });
  }
  memfit::compat::WarningCapture warnings;  // e.g. a step re-planned after running out of memory
  const auto print_warnings = [&warnings, &bar] {
    for (const auto& w : warnings.messages) bar.note(w);
    warnings.messages.clear();
  };
  auto on_step = [&](const memfit::StepRecord& r) {
    print_warnings();
    if (g_signal != 0) trainer.request_stop();
    if (const auto c = budget_changes.find(r.step); c != budget_changes.end()) {
      memfit::set_memory_budget(device, c->second);
      bar.note(fmt::format("after step {} the budget is {} (--budget-change)", r.step,
                           c->second > 0 ? memfit::format_bytes(c->second) : std::string("none")));
    }
    if (a.quiet) return;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    bar.update(r.step, r.loss, secs, r.current_bytes, memfit::max_memory_allocated(device));
  };
  memfit::TrainReport report;
  try {
    if (trainer.step() >= trainer.total_steps(data)) {
      fmt::print("the run is complete at step {}: nothing left to train (raise --steps to go on)\n", trainer.step());
    } else {
      report = trainer.fit(data, on_step);
    }
  } catch (...) {
    print_warnings();
    bar.finish();
    throw;
  }
  bar.finish();
  if (!report.recoveries.empty()) {
    fmt::print("recovered from out of memory {} time{} (--on-out-of-memory replan); the run ended with {}\n",
               report.recoveries.size(), report.recoveries.size() == 1 ? "" : "s", trainer.settings_text());
  }
  if (report.stopped) {
    fmt::print("stopped by signal {} after step {}{}\n", static_cast<int>(g_signal), trainer.step(),
               a.save.empty() ? "" : fmt::format("; checkpoint saved to {}/checkpoint.pt (continue with --resume {})",
                                                 a.save, a.save));
  }
  return report;
}

int stop_signal() { return static_cast<int>(g_signal); }

} // namespace tools
} // namespace memfit
