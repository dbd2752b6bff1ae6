#pragma once
/// \file stream.h
/// Parameter offload: a model's parameters live in host memory and come to
/// the device one layer, or one tile of a layer, at a time (ZeRO-Infinity's
/// parameter offload with its memory-centric tiling; FSDP's CPU offload of
/// parameters). With the optimizer state and the gradients on the host too,
/// the device holds no model state between layers: a model larger than the
/// device trains, at the price of copying every parameter to the device twice
/// per micro-batch (forward and backward).
///
/// A ParameterStream runs a Sequential's top-level layers, or in any module
/// the layers of each chain (CheckpointedSequential) inside it:
///   - torch::nn::Linear on 2-D inputs: forward and backward written out
///     (addmm, mm, sum, as LibTorch's own linear and its derivatives), with
///     the weight fetched tile by tile: rows of at most
///     StreamOptions::tile_bytes (DeepSpeed's TiledLinear). No recomputation.
///     Each tile's weight gradient goes into the host master's gradient as
///     soon as it is computed. Untiled, outputs and gradients equal the
///     resident layer's bitwise; tiled, they agree within rounding (relative
///     1e-6 in the tests): the input's gradient is summed tile by tile, and a
///     blocked BLAS such as OpenBLAS rounds a tile's product, a narrower
///     matrix, differently from the whole (netlib's reference BLAS, one dot
///     product per element, gave outputs and weight gradients bitwise).
///   - any other layer with parameters: fetched for its forward, which keeps
///     only the layer's input (a checkpoint); fetched again in backward, where
///     the layer is recomputed and its gradients go to the host masters
///     (MasterWeights' gradient offload); then released. Bitwise equal
///     gradients, one more forward of the layer.
///   - layers without parameters run as they are.
/// Buffers (BatchNorm's statistics) stay on the device. In a module, the
/// parameters outside its chains (an embedding, a head) come to the device
/// whole while a ParameterStream::Hold lives: hold one around each forward
/// and its backward, as FSDP gathers a unit's parameters; they go again when
/// it ends. The Trainer does this for every micro-batch and eval_step.
///
/// Composes with a CheckpointedSequential's schedule (the layers of a
/// checkpointed segment are streamed in its forward and again in its
/// recomputation), micro-batching and no-grad evaluation. Runs in fp32 only
/// (not under autocast), in one process (not with data or pipeline
/// parallelism).
///
/// Thread safety: one thread at a time; forward and backward mutate the
/// layers' parameters. Sync points: none added on the CPU build; on CUDA each
/// tile's gradient copy to the host waits for it. Extra memory: on the
/// device, one layer's parameters (one tile, for a tiled Linear) and their
/// gradients at a time, instead of the whole model's parameters, gradients
/// and optimizer state; in a module, also the parameters outside its chains
/// while held (copied from the host once per Hold).

#include "memfit/precision.h"

#include <torch/arg.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace memfit {

/// Options of a ParameterStream.
struct StreamOptions {
  /// Linear layers whose weight is larger than this many bytes run in tiles
  /// of whole output rows, each at most this size (at least one row), so the
  /// device holds one tile and its gradient instead of the whole weight and
  /// its gradient. 0: no tiling.
  TORCH_ARG(int64_t, tile_bytes) = 0;
};

/// How a ParameterStream runs one layer.
enum class StreamedLayer {
  kNone,      ///< No parameters: runs as it is.
  kLinear,    ///< A torch::nn::Linear, written out and tiled (no recomputation).
  kRecompute, ///< Any other layer with parameters: fetched again and recomputed in backward.
};

/// Runs a Sequential (or a Sequential holding one CheckpointedSequential)
/// with its parameters streamed from `master`'s host masters.
///
/// `master` must be built over `model`'s parameters with
/// MasterWeightsOptions().dtype(kFloat).offload(kHost).gradients(kHost)
/// .parameters(kHost), and outlive the stream. Build the optimizer over
/// master.master_parameters(). Each step: forward(x), backward on the loss
/// (the gradients land in the masters), step the optimizer on the host,
/// master.master_to_model() (releases the masters' gradients). A
/// CheckpointedSequential's layers are run through its layer runner, set for
/// the stream's lifetime.
///
/// Example:
/// \code
///   auto net = memfit::make_mlp(memfit::ModelOptions().width(32).depth(1));
///   memfit::MasterWeights master(*net, memfit::MasterWeightsOptions()
///                                          .dtype(torch::kFloat)
///                                          .offload(memfit::Offload::kHost)
///                                          .gradients(memfit::Offload::kHost)
///                                          .parameters(memfit::Offload::kHost));
///   memfit::ParameterStream stream(net, master, memfit::StreamOptions().tile_bytes(16 << 10));
///   torch::optim::SGD sgd(master.master_parameters(), torch::optim::SGDOptions(0.1));
///   stream.forward(torch::zeros({4, 1, 28, 28})).sum().backward();
///   sgd.step();
///   master.master_to_model();
/// \endcode
class ParameterStream {
 public:
  /// The parameters outside a module's chains on the device, for as long as
  /// this guard lives (hold()). Move-only; a default-constructed one holds
  /// nothing. Holds nest: the parameters go when the last one ends.
  class Hold {
   public:
    Hold() = default;
    Hold(Hold&&) noexcept = default;
    Hold& operator=(Hold&&) noexcept = default;
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    friend class ParameterStream;
    explicit Hold(std::shared_ptr<void> release) : release_(std::move(release)) {}
    std::shared_ptr<void> release_;  // its deleter lets the parameters go
  };

  /// Maps each top-level layer's parameters to `master`'s; checks the options.
  ParameterStream(torch::nn::Sequential model, MasterWeights& master,
                  StreamOptions options = StreamOptions());
  /// Streams the layers of every chain (CheckpointedSequential, the outermost
  /// where chains nest) inside `module`, block by block; the module's other
  /// parameters come to the device while a Hold lives. Run the module's own
  /// forward, and its backward, inside hold(); a chain that runs without one
  /// is an error, not a step on released parameters. A module without a
  /// chain, a parameter that a chain shares with a layer outside it, and a
  /// chain that already has a layer runner are refused.
  ///
  /// Example:
  /// \code
  ///   struct NetImpl : torch::nn::Module {
  ///     NetImpl() {
  ///       torch::nn::Sequential blocks(torch::nn::Linear(32, 32), torch::nn::Tanh(), torch::nn::Linear(32, 32));
  ///       body = register_module("body", memfit::CheckpointedSequential(blocks));
  ///       head = register_module("head", torch::nn::Linear(32, 4));
  ///     }
  ///     torch::Tensor forward(const torch::Tensor& x) { return head->forward(body->forward(x)); }
  ///     memfit::CheckpointedSequential body{nullptr};
  ///     torch::nn::Linear head{nullptr};
  ///   };
  ///   auto net = std::make_shared<NetImpl>();
  ///   memfit::MasterWeights master(*net, memfit::MasterWeightsOptions()
  ///                                          .dtype(torch::kFloat)
  ///                                          .offload(memfit::Offload::kHost)
  ///                                          .gradients(memfit::Offload::kHost)
  ///                                          .parameters(memfit::Offload::kHost));
  ///   memfit::ParameterStream stream(net, master);
  ///   torch::optim::SGD sgd(master.master_parameters(), torch::optim::SGDOptions(0.1));
  ///   {
  ///     auto held = stream.hold();  // the head, for this forward and backward
  ///     net->forward(torch::randn({8, 32})).sum().backward();
  ///   }
  ///   sgd.step();
  ///   master.master_to_model();
  /// \endcode
  ParameterStream(std::shared_ptr<torch::nn::Module> module, MasterWeights& master,
                  StreamOptions options = StreamOptions());
  /// Why the module form would refuse `module`, as the one line its
  /// constructor throws; empty when its chains can stream. Checks the
  /// module's structure only (chains, tied weights, layer runners), before
  /// any MasterWeights exist.
  ///
  /// Example:
  /// \code
  ///   torch::nn::Sequential flat(torch::nn::Linear(8, 8));
  ///   assert(!memfit::ParameterStream::refusal(*flat).empty());  // no chain to stream
  /// \endcode
  static std::string refusal(const torch::nn::Module& module);
  ~ParameterStream();
  ParameterStream(ParameterStream&&) noexcept;
  ParameterStream& operator=(ParameterStream&&) noexcept;
  ParameterStream(const ParameterStream&) = delete;
  ParameterStream& operator=(const ParameterStream&) = delete;

  /// The Sequential's forward with every layer's parameters streamed (the
  /// Sequential form only: a module runs its own forward inside hold()).
  torch::Tensor forward(const torch::Tensor& input);
  /// Brings the parameters outside the chains to the device until the
  /// returned guard goes (none in the Sequential form). Sync points: none
  /// on the CPU build; on CUDA the copies are queued on the current stream.
  Hold hold();
  /// The chains streamed: 1 in the Sequential form (its own layers).
  size_t chains() const;
  /// How layer i of chain `chain` runs.
  StreamedLayer layer_kind(size_t i, size_t chain = 0) const;
  /// Tiles layer i's weight is cut into (1 untiled; 0 for layers that are not kLinear).
  int64_t tiles(size_t i, size_t chain = 0) const;
  /// Bytes of the parameters outside the chains (on the device while held).
  int64_t held_bytes() const;
  /// The options, as checked.
  const StreamOptions& options() const;

  struct Impl;  ///< (internal)

 private:
  std::shared_ptr<Impl> impl_;
};

/// Output rows per tile of a Linear weight of `rows` rows and `weight_bytes`
/// bytes: all of them when `tile_bytes` is 0 or the weight fits in it, else
/// as many whole rows as fit in `tile_bytes` (at least one).
///
/// Example:
/// \code
///   assert(memfit::linear_tile_rows(64, 64 * 400, 6400) == 16);
/// \endcode
int64_t linear_tile_rows(int64_t rows, int64_t weight_bytes, int64_t tile_bytes);

/// The bytes a layer's streamed parameters take on the device at once: its
/// parameters' bytes, or for a Linear larger than `tile_bytes` (> 0) the
/// largest tile of its weight plus that tile's bias; the planner counts twice
/// this (the tile and its gradient).
///
/// Example:
/// \code
///   torch::nn::Linear lin(100, 64);  // 25.6 KB of weight
///   assert(memfit::streamed_bytes(*lin, 6400) == 16 * 100 * 4 + 16 * 4);
/// \endcode
int64_t streamed_bytes(const torch::nn::Module& layer, int64_t tile_bytes);

} // namespace memfit
