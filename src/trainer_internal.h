#pragma once
// What the Trainer's sources share (trainer.cpp: construction and the step;
// trainer_options.cpp: checking the options; trainer_fit.cpp: fit and
// evaluate; trainer_state.cpp: save and resume).

#include <chrono>

namespace memfit {
namespace detail {

using Clock = std::chrono::steady_clock;

// The file a Trainer's checkpoint directory holds its state in.
constexpr const char* kCheckpointFile = "checkpoint.pt";

// Seconds since `start`.
inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

} // namespace detail
} // namespace memfit
