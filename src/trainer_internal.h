#pragma once
// What the Trainer's sources share (trainer.cpp: construction and the step;
// trainer_options.cpp: checking the options; trainer_fit.cpp: fit and
// evaluate; trainer_state.cpp: save and resume; trainer_recovery.cpp: the
// re-plan).

#include <chrono>
#include <string>

namespace memfit {
namespace detail {

using Clock = std::chrono::steady_clock;

// The file a Trainer's checkpoint directory holds its state in.
constexpr const char* kCheckpointFile = "checkpoint.pt";

// Seconds since `start`.
inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// What a re-plan keeps on the host, in the words of the recovery's line:
// the optimizer state, and the gradients (`gradients`) and the parameters
// (`parameters`) with it.
inline std::string on_host_text(bool gradients, bool parameters) {
  return parameters  ? "optimizer state, gradients and parameters on the host"
         : gradients ? "optimizer state and gradients on the host"
                     : "optimizer state on the host";
}

} // namespace detail
} // namespace memfit
