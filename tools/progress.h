#pragma once
// A one-line progress display for `memfit train`: step, loss, samples/s,
// current and peak memory. Redraws in place on a terminal; prints a line every
// tenth of the run otherwise (logs, CI).

#include <cstdint>
#include <cstdio>
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

} // namespace tools
} // namespace memfit
