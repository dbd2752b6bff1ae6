#pragma once
// A one-line progress display for `memfit train`: step, loss, samples/s,
// current and peak memory. Redraws in place on a terminal; prints a line every
// tenth of the run otherwise (logs, CI). And the run under it: signals, the
// library's warnings, and the budget's rehearsed changes.

#include "train.h"

#include "memfit/data.h"
#include "memfit/trainer.h"

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>

namespace memfit {
namespace tools {

class ProgressBar {
 public:
  ProgressBar(int64_t total, int64_t batch, std::FILE* out, bool interactive);
  /// Shows step `step` of the total; `seconds` is the time since the start.
  void update(int64_t step, double loss, double seconds, int64_t current_bytes,
              int64_t peak_bytes);
  /// Ends the line.
  void finish();
  /// Prints `line` on a line of its own (a warning during the run); the bar
  /// goes on below it.
  void note(const std::string& line);

 private:
  int64_t total_;
  int64_t batch_;
  std::FILE* out_;
  bool interactive_;
  bool open_ = false;
};

/// Trains to the end (or to a signal), with a progress bar and the
/// library's warnings a line each. SIGINT, SIGTERM and SIGHUP (a closed
/// terminal) end the run after the step in progress, saving first with
/// --save; a second one stops at once. After each step named in
/// `budget_changes` (step: bytes, 0 for none) the budget becomes its bytes.
memfit::TrainReport train_with_progress(const TrainArgs& a, memfit::Trainer& trainer,
                                        const memfit::ImageDataset& data, const torch::Device& device,
                                        const std::map<int64_t, int64_t>& budget_changes);
/// The signal that stopped the run, 0 if none.
int stop_signal();

} // namespace tools
} // namespace memfit
