#pragma once
/// \file profile.h
/// Per-layer costs of a sequential chain: the bytes each layer keeps for
/// backward, the size of the tensors passed between layers, forward and
/// backward time. The checkpoint solver and the planner build on it.
/// Bytes are as the chain keeps them: a tensor between two layers counts
/// once, and not at all where neither layer keeps it for backward.
///
/// Profiling runs each layer once per repeat on the sample input and restores
/// the module's buffers (BatchNorm's running statistics) and the CPU RNG state
/// afterwards, so a profile leaves the model as it found it.
///
/// On CUDA the whole chain first runs forward and backward once, untimed, so
/// that workspaces allocated on first use (ChainProfile::workspace_bytes) are
/// not counted as some layer's activations.
///
/// Thread safety: one profile at a time per model. Sync points: one per layer
/// and repeat (timing). Extra memory: one layer's activations at a time, plus
/// the chain's inter-layer tensors (computed under no-grad).

#include <torch/arg.h>
#include <torch//nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace memfit {

/// What one layer of a chain costs.
struct LayerProfile {
  std::string name;            ///< The layer's name in the Sequential.
  int64_t input_bytes = 0;     ///< Bytes of the tensor the layer receives.
  int64_t output_bytes = 0;    ///< Bytes of the tensor it returns.
  /// Bytes the chain holds more after its forward with grad than before it,
  /// until its backward: its output and what it saves, less its input where
  /// frees_input.
  int64_t kept_bytes = 0;
  int64_t forward_peak_bytes = 0;  ///< Peak extra bytes during its forward with grad.
  /// Peak bytes during its backward beyond what it kept and its output's
  /// gradient, with those freed as autograd frees them (its input's gradient
  /// and temporaries; parameter gradients excluded).
  int64_t backward_overhead_bytes = 0;
  int64_t parameter_bytes = 0;     ///< Bytes of its parameters.
  /// Median forward time, over its timed runs and those of every layer of
  /// the chain that does the same work (the same module, as it prints, on
  /// the same bytes): noise cannot set such layers apart.
  double forward_seconds = 0;
  double backward_seconds = 0;     ///< Median backward time (input and parameter gradients), likewise.
  bool in_place = false;           ///< Whether its output shares its input's storage.
  /// Whether, in the chain, its input is let go of once it has run: neither
  /// it nor the layer before keeps that tensor for backward (a Linear's
  /// output before a Tanh, which saves its result). kept_bytes counts it
  /// freed; where something else holds the input (a checkpoint that starts
  /// at this layer, the chain's caller), the layer keeps input_bytes more.
  bool frees_input = false;
};

/// The costs of every layer of a chain, in order.
struct ChainProfile {
  std::vector<LayerProfile> layers;  ///< One per layer.
  /// Device bytes the chain's first forward and backward allocated and kept:
  /// on CUDA the cuBLAS workspaces (one per thread, so one for forward and
  /// one for autograd's device thread), allocated on first use and held from
  /// then on. Measured by a warm-up run before the layers are measured
  /// (cuBLAS's workspaces are freed first, so they count even if an earlier
  /// run made them), so they are in no layer's bytes; 0 on the CPU.
  int64_t workspace_bytes = 0;

  /// Bytes a plain run keeps for backward: the sum of kept_bytes.
  int64_t plain_activation_bytes() const;
  /// A table: one row per layer.
  std::string table() const;
  /// The profile as a JSON array of per-layer objects.
  std::string to_json() const;
};

/// How to profile.
struct ProfileOptions {
  /// Timed runs per layer (the median is kept), after one untimed warm-up.
  TORCH_ARG(int64_t, repeats) = 3;
};

/// Measures every layer of `chain` on `sample_input`.
///
/// Example:
/// \code
///   torch::nn::Sequential chain(torch::nn::Linear(16, 32), torch::nn::ReLU(),
///                               torch::nn::Linear(32, 4));
///   auto p = memfit::profile_chain(chain, torch::randn({8, 16}));
///   assert(p.layers.size() == 3);
///   assert(p.layers[0].output_bytes == 8 * 32 * 4);
/// \endcode
ChainProfile profile_chain(const torch::nn::Sequential& chain, const torch::Tensor& sample_input,
                           const ProfileOptions& options = ProfileOptions());

} // namespace memfit
