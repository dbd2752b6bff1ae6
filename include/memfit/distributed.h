#pragma once
/// \file distributed.h
/// Training on several processes with PyTorch's c10d (Gloo): where a process
/// stands in the job (from torchrun's, Slurm's or Open MPI's variables), the
/// process group, data parallel training (DistributedDataParallel, the
/// C++ API LibTorch lacks) and sharded optimizer state (ZeroRedundancyOptimizer).
///
/// Data parallel: every rank holds the whole model, reads its own shard of
/// each batch, and the gradients are averaged with all-reduce in buckets of
/// about bucket_cap_mb, each launched while backward is still running, as soon
/// as its gradients are ready (in the reverse order of the parameters, the
/// order backward produces them), in the same order on every rank.
///
/// Thread safety: a ProcessGroup and a DistributedDataParallel belong to one
/// training thread. NoSync is a scoped guard on one DistributedDataParallel
/// object, not thread-local. Sync points: the process group's set-up (every
/// rank meets through the TCPStore), the broadcasts of parameters and buffers,
/// and finalize() (it waits for every bucket's all-reduce). Extra memory: one
/// flat copy of each bucket's gradients from its launch to finalize().

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace memfit {

/// Whether this build has c10d's Gloo process group (LibTorch's c10d headers
/// and gloo's: Debian's libtorch-dev with libgloo-dev). Without it a
/// ProcessGroup cannot be made (a one-line error says so); the rest of memfit
/// works. PyTorch's pip wheels ship no gloo headers.
///
/// Example:
/// \code
///   if (!memfit::distributed_available()) { /* one process only */ }
/// \endcode
bool distributed_available();

/// Whether this build has c10d's NCCL process group (ProcessGroupBackend::kNccl):
/// memfit built against a CUDA LibTorch with NCCL. It says nothing of GPUs.
///
/// Example:
/// \code
///   auto backend = memfit::nccl_available() && torch::cuda::is_available()
///                      ? memfit::ProcessGroupBackend::kNccl : memfit::ProcessGroupBackend::kGloo;
/// \endcode
bool nccl_available();

/// Where this process stands in a job of several.
struct WorldInfo {
  int64_t rank = 0;        ///< This process's rank, 0..world_size-1.
  int64_t world_size = 1;  ///< Processes in the job.
  int64_t local_rank = 0;  ///< Rank among the processes on this machine.
  std::string master_addr = "127.0.0.1";  ///< Where rank 0's TCPStore listens.
  int64_t master_port = 29500;            ///< Its port.
  std::string source = "none";  ///< Which variables said so: torchrun, slurm, openmpi or none.

  /// Whether there is more than one process.
  bool distributed() const { return world_size > 1; }
};

/// Reads this process's place in the job from the environment: torchrun's
/// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (what `memfit
/// launch` sets); else Slurm's SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID;
/// else Open MPI's OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE and
/// OMPI_COMM_WORLD_LOCAL_RANK (with MASTER_ADDR and MASTER_PORT from the
/// environment, or 127.0.0.1:29500); else a single process. A malformed or
/// inconsistent value is a one-line error naming the variable.
///
/// Example:
/// \code
///   auto world = memfit::world_from_env();
///   if (!world.distributed()) assert(world.rank == 0 && world.world_size == 1);
/// \endcode
WorldInfo world_from_env();

/// Which c10d backend carries a process group's collectives (PyTorch's
/// `init_process_group(backend=...)`).
enum class ProcessGroupBackend {
  /// Gloo: reduces host tensors; CUDA tensors are staged through the host.
  kGloo,
  /// NCCL: reduces CUDA tensors on the current CUDA device (set it per rank
  /// first, as torch.cuda.set_device(local_rank) does); host tensors are
  /// staged through that device. Needs a CUDA build of LibTorch with NCCL
  /// (memfit's MEMFIT_LIBTORCH=pip build) and one GPU per rank.
  kNccl,
};

/// How to set up the process group.
struct ProcessGroupOptions {
  /// The backend: Gloo (CPU, the default) or NCCL (CUDA).
  TORCH_ARG(ProcessGroupBackend, backend) = ProcessGroupBackend::kGloo;
  /// How long a rank waits for the others (rendezvous and each collective)
  /// before it stops with an error naming what it waited for.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::seconds(60);
};

namespace detail {
struct ProcessGroupImpl;
} // namespace detail

/// A c10d process group over Gloo (host tensors; CUDA tensors are staged
/// through the host) or NCCL (CUDA tensors; host tensors are staged through
/// the device), joined through rank 0's TCPStore. Move-only.
///
/// Sync points: every collective but all_reduce_async_ and send waits for
/// its result (with NCCL, for the device too). Extra memory: a staging copy
/// of a tensor that is not on device(), outside memfit's accounting.
class ProcessGroup {
 public:
  /// Joins the job `world` describes; blocks until every rank has joined or
  /// the timeout passes (then a c10::Error naming the address and timeout).
  ///
  /// Example:
  /// \code
  ///   memfit::WorldInfo solo;  // one process: a group of one
  ///   solo.master_port = 0;    // any free port
  ///   memfit::ProcessGroup group(solo);
  ///   auto t = torch::ones({3});
  ///   group.all_reduce_(t);  // the sum over the ranks
  ///   assert(t.equal(torch::ones({3})));
  /// \endcode
  explicit ProcessGroup(const WorldInfo& world, ProcessGroupOptions options = ProcessGroupOptions());
  ~ProcessGroup();
  ProcessGroup(ProcessGroup&&) noexcept;
  ProcessGroup& operator=(ProcessGroup&&) noexcept;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  /// This process's rank.
  int64_t rank() const;
  /// The number of ranks.
  int64_t size() const;
  /// The options, as checked.
  const ProcessGroupOptions& options() const;
  /// Where the backend reduces: the CPU for Gloo, the CUDA device current at
  /// construction for NCCL. all_reduce_async_, send and recv_ take
  /// contiguous tensors on it.
  torch::Device device() const;

  /// Sums `tensor` over the ranks, in place, and waits.
  void all_reduce_(torch::Tensor& tensor);
  /// The largest value of `tensor` over the ranks, in place, and waits.
  void all_reduce_max_(torch::Tensor& tensor);
  /// Overwrites `tensor` with rank `root`'s, and waits.
  void broadcast_(torch::Tensor& tensor, int64_t root = 0);
  /// Every rank's `tensor` (1-D, on the host, the same dtype everywhere, any
  /// length) on rank `root`, in rank order; the other ranks get an empty
  /// list. Every rank must call it.
  std::vector<torch::Tensor> gather(const torch::Tensor& tensor, int64_t root = 0);
  /// Waits until every rank has called it.
  void barrier();
  /// Bytes of the tensors this rank has put into collectives so far (each
  /// all-reduce, broadcast and gather counts its tensor once; what goes over
  /// the wire depends on Gloo's algorithm).
  int64_t payload_bytes() const;
  /// All-reduces, broadcasts, sends and receives this rank has started so
  /// far: each is at least one round trip, whatever its size.
  int64_t operations() const;

  /// Starts summing `tensor` (a contiguous tensor on device()) over the ranks in place
  /// and returns at once; the returned handle's wait() finishes it.
  class Pending;
  Pending all_reduce_async_(torch::Tensor& tensor);
  /// Starts sending `tensor` (a contiguous tensor on device(), kept alive by the
  /// handle) to rank `dst`, matched by `tag` with its recv_; the handle's
  /// wait() finishes it (within the timeout).
  Pending send(const torch::Tensor& tensor, int64_t dst, int64_t tag = 0);
  /// Receives into `tensor` (a contiguous tensor on device(), of the sent size) from
  /// rank `src` what it sent with `tag`; waits at most the timeout.
  void recv_(torch::Tensor& tensor, int64_t src, int64_t tag = 0);

 private:
  std::unique_ptr<detail::ProcessGroupImpl> impl_;
};

/// An all-reduce or send in flight (ProcessGroup::all_reduce_async_, send). Move-only.
class ProcessGroup::Pending {
 public:
  Pending();
  ~Pending();
  Pending(Pending&&) noexcept;
  Pending& operator=(Pending&&) noexcept;
  /// Waits for the operation; throws a c10::Error if it failed or timed out.
  void wait();

 private:
  friend class ProcessGroup;
  struct Work;
  std::unique_ptr<Work> work_;
};

namespace detail {
/// Rank `root`'s `text` on every rank of `group`: its length, then its bytes,
/// in two broadcasts of host tensors outside the budget.
std::string broadcast_text(ProcessGroup& group, const std::string& text, int64_t root);
} // namespace detail

/// Where the gradients of a data-parallel backward go (the seam between the
/// autograd hooks and the communication).
class GradientReducer {
 public:
  virtual ~GradientReducer() = default;
  /// Parameter `index`'s gradient is final for this backward (called from
  /// backward, in the order autograd produces gradients).
  virtual void add(size_t index) = 0;
  /// After backward: every reduction finished and written into the gradients.
  virtual void finalize() = 0;
};

/// How DistributedDataParallel reduces gradients (names from PyTorch's DDP).
struct DistributedDataParallelOptions {
  /// Bucket size in MiB: gradients are all-reduced this many at a time.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Broadcast rank 0's buffers (BatchNorm's running statistics) before every
  /// forward, as PyTorch's DDP does (call sync_buffers()).
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Broadcast rank 0's parameters and buffers at construction (PyTorch's
  /// init_sync); false when the caller did (broadcast_module_state).
  TORCH_ARG(bool, init_sync) = true;
};

/// Overwrites every parameter and buffer of `module` with rank `root`'s,
/// so that every rank starts from the same model.
///
/// Example:
/// \code
///   memfit::WorldInfo solo;
///   solo.master_port = 0;
///   memfit::ProcessGroup group(solo);
///   torch::nn::Linear net(4, 2);
///   memfit::broadcast_module_state(*net, group);  // rank 0's weights everywhere
/// \endcode
void broadcast_module_state(torch::nn::Module& module, ProcessGroup& group, int64_t root = 0);

/// Clips gradients spread over the ranks of `group` to a total 2-norm of
/// `max_norm`, as torch::nn::utils::clip_grad_norm_ would over all of them in
/// one process; returns that total norm.
///
/// For ranks that hold different parameters (a pipeline's stages): each rank
/// passes its own, the squared norms are summed over the ranks, and every
/// rank scales its gradients by min(1, max_norm / (total + 1e-6)).
/// Parameters without a gradient are skipped. With one rank it is
/// clip_grad_norm_ (to rounding). Sync points: one all-reduce of one number
/// (its copy to the host waits for the gradients). Extra memory: one number
/// per parameter.
///
/// Example:
/// \code
///   memfit::WorldInfo solo;
///   solo.master_port = 0;
///   memfit::ProcessGroup group(solo);
///   auto w = torch::ones({4}, torch::requires_grad());
///   (w * 3).sum().backward();                                   // gradient 3, 3, 3, 3: norm 6
///   double norm = memfit::clip_grad_norm_(std::vector<torch::Tensor>{w}, 1.0, group);  // 6; now norm 1
/// \endcode
double clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm, ProcessGroup& group);

/// Data parallel training of `module` over `group` (PyTorch's
/// DistributedDataParallel): broadcasts rank 0's parameters and buffers at
/// construction, then averages the gradients of every backward run while
/// syncing (see NoSync) over the ranks, bucket by bucket as backward
/// produces them. Call finalize() after the backward of the last
/// micro-batch, before the optimizer step. Parameters that got no gradient by
/// finalize() count as zero. Move-only; the hooks are removed on destruction.
///
/// Example:
/// \code
///   memfit::WorldInfo solo;
///   solo.master_port = 0;
///   auto group = std::make_shared<memfit::ProcessGroup>(solo);
///   torch::nn::Linear net(4, 2);
///   memfit::DistributedDataParallel ddp(net.ptr(), group);
///   net->forward(torch::ones({3, 4})).sum().backward();
///   ddp.finalize();  // gradients now averaged over the ranks
///   assert(net->weight.grad().defined());
/// \endcode
class DistributedDataParallel {
 public:
  /// Hooks every trainable parameter of `module` and reduces its gradient.
  ///
  /// `gradient_holders`, when given (one per trainable parameter, in order),
  /// are where each parameter's gradient is once autograd has accumulated it
  /// and the hooks registered before this one have run: the host masters of
  /// a MasterWeights with gradient offload (MasterWeightsOptions::gradients),
  /// whose hooks move each gradient there. Their gradients are then reduced,
  /// on the host (the device keeps none), including what earlier
  /// micro-batches under NoSync accumulated there. Empty: the parameters'
  /// own gradients.
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<ProcessGroup> group,
                          DistributedDataParallelOptions options = DistributedDataParallelOptions(),
                          std::vector<torch::Tensor> gradient_holders = {});
  ~DistributedDataParallel();
  DistributedDataParallel(DistributedDataParallel&&) noexcept;
  DistributedDataParallel& operator=(DistributedDataParallel&&) noexcept;
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// Waits for every bucket, averages, and writes the gradients back.
  void finalize();
  /// Builds every bucket that backward has not launched from the gradients
  /// as they are now, without launching it, so that finalize() then
  /// allocates no device memory: the point after which a step's all-reduce
  /// cannot fail half-way on one rank for want of memory. Extra memory: the
  /// buckets, which finalize() would allocate anyway.
  void prepare();
  /// Drops what prepare() built and any bucket launched, for a step that
  /// ends without finalize() (one that failed); an all-reduce in flight is
  /// waited for first.
  void discard();
  /// For a rank whose step failed while the others' went on: meets their
  /// all-reduce of every bucket this step has not launched, with a stand-in
  /// of zeros, so that every rank's collectives stay matched (the ranks must
  /// then abandon the step together, as memfit's recovery does). Sync
  /// points: each of those all-reduces. Extra memory: one bucket at a time
  /// on the group's device, outside memfit's accounting.
  void join();
  /// Broadcasts rank 0's buffers (a no-op without buffers or with
  /// broadcast_buffers false).
  void sync_buffers();
  /// The buckets: indices into the trainable parameters (those of
  /// module->parameters() that require grad, in that order), last first.
  std::vector<std::vector<size_t>> buckets() const;
  /// Bytes of gradients all-reduced so far by this object.
  int64_t bytes_reduced() const;
  /// Buckets launched from inside backward (before finalize()) so far.
  int64_t buckets_launched_in_backward() const;

  /// While alive, backward accumulates gradients locally and communicates
  /// nothing (PyTorch's no_sync()): for every micro-batch but the last.
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool previous_;
  };

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Builds an optimizer over the parameters it is given (the local optimizer
/// of a ZeroRedundancyOptimizer).
using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

/// Sharded optimizer state, ZeRO stage 1 (PyTorch's ZeroRedundancyOptimizer):
/// each rank keeps optimizer state for, and steps, only the parameters it
/// owns, then every parameter is broadcast from its owner, so every rank
/// ends the step with the same parameters as an unsharded optimizer would
/// give (the same elementwise update on the same values: equal bitwise).
///
/// Ownership follows PyTorch's partition: parameters from the largest down,
/// each to the rank that owns the fewest bytes so far; so each rank holds
/// about 1/N of the optimizer state, unevenly when one tensor dominates
/// (owned_bytes() tells). Gradients are not sharded (stage 1): use it with
/// DistributedDataParallel, which averages them, or any code that leaves
/// every rank with the same gradients. Every rank must call step() together.
///
/// Its param_groups() hold every parameter, so GradScaler::unscale_ and
/// gradient clipping see all the gradients, as without sharding; state()
/// is empty: the state is in local_optimizer(). save() and load() write and
/// read this rank's shard; consolidate_state_dict() gathers every rank's.
///
/// Sync points: step() (one broadcast per parameter) and
/// consolidate_state_dict(). Extra memory: none (the broadcasts write into
/// the parameters in place; CUDA parameters are staged through host copies).
///
/// Example:
/// \code
///   memfit::WorldInfo solo;
///   solo.master_port = 0;
///   auto group = std::make_shared<memfit::ProcessGroup>(solo);
///   torch::nn::Linear net(4, 2);
///   memfit::ZeroRedundancyOptimizer zero(
///       net->parameters(),
///       [](std::vector<torch::Tensor> p) {
///         return std::make_unique<torch::optim::Adam>(std::move(p), torch::optim::AdamOptions(1e-3));
///       },
///       group);
///   net->forward(torch::ones({3, 4})).sum().backward();
///   zero.step();  // steps this rank's share, then broadcasts every parameter from its owner
/// \endcode
class ZeroRedundancyOptimizer : public torch::optim::Optimizer {
 public:
  /// Partitions `params` over `group`'s ranks and builds this rank's local
  /// optimizer with `make_local` over the parameters it owns.
  ZeroRedundancyOptimizer(std::vector<torch::Tensor> params, OptimizerFactory make_local,
                          std::shared_ptr<ProcessGroup> group);
  ~ZeroRedundancyOptimizer() override;

  /// Steps the local optimizer, then broadcasts every parameter from its owner.
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// Writes this rank's shard of the optimizer state.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Reads this rank's shard, as save() wrote it on the same rank of a job of
  /// the same size.
  void load(torch::serialize::InputArchive& archive) override;

  /// The rank that owns parameter `index` (an index into param_groups()[0].params()).
  int64_t owner(size_t index) const;
  /// Parameter bytes each rank owns, by rank.
  std::vector<int64_t> owned_bytes() const;
  /// This rank's optimizer, over the parameters it owns (none may be owned
  /// when there are more ranks than parameters: then it is nullptr).
  torch::optim::Optimizer* local_optimizer() const;
  /// Gathers every rank's shard, serialized as save() writes it, on rank
  /// `to` (PyTorch's consolidate_state_dict); the others get an empty list.
  /// Every rank must call it.
  /// Every rank must call it. Rank r's shard loads back on rank r of a job
  /// of the same size: read the bytes into an InputArchive (load_from) and
  /// call load().
  std::vector<std::string> consolidate_state_dict(int64_t to = 0);

 private:
  std::shared_ptr<ProcessGroup> group_;
  std::vector<int64_t> owner_;
  std::unique_ptr<torch::optim::Optimizer> local_;
};

} // namespace memfit
