#include "progress.h"

#include "memfit/memory.h"

#include <fmt/format.h>

#include <algorithm>

namespace memfit {
namespace tools {

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

} // namespace tools
} // namespace memfit
