#pragma once
/// \file memory.h
/// Memory accounting named after torch.cuda's functions: bytes allocated, the
/// peak, a budget that raises c10::OutOfMemoryError, a scoped peak meter and
/// a breakdown of a training step's peak.
///
/// On the CPU, memfit installs a tracking allocator into LibTorch
/// (c10::SetCPUAllocator) on the first call into this API. From then on it
/// counts the exact requested bytes of every CPU tensor storage; storages
/// allocated before tracking began are freed without touching the count.
/// Memory that kernels obtain without LibTorch's allocator (oneDNN scratch
/// pads, BLAS work space) is not counted. On a CUDA build the same functions
/// read and steer the CUDA caching allocator.
///
/// Thread safety: all functions and the allocator are thread-safe (atomic
/// counters; the allocator's size table in 16 locked shards); UntrackedGuard
/// is thread-local.
/// Sync points: none (the CPU counters are plain atomics; CUDA stats are host
/// side), except set_memory_budget and empty_cache on CUDA, which free the
/// cached segments (cudaFree waits for the device).
/// Extra memory: one entry of a side table (about 40 bytes of host memory)
/// per live tracked CPU allocation, not counted, so counts equal tensor bytes
/// exactly; the data itself is laid out as LibTorch's default allocator lays
/// it out.

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch {
namespace optim {
class Optimizer;
} // namespace optim
} // namespace torch

namespace memfit {

/// Where memfit keeps state that need not live on the device: the inputs a
/// checkpoint saves for recomputation, fp32 master weights, optimizer state.
///
/// On a CPU-only build "host" and "device" are the same memory; host copies
/// are then made under UntrackedGuard, so memory_allocated(kCPU) counts what
/// would stay on a GPU.
enum class Offload {
  kNone,  ///< On the device of the tensors concerned.
  kHost,  ///< In host memory (pinned when CUDA), copied to the device when needed.
};

/// Bytes currently held by tensors on `device`.
///
/// CPU: the exact sum of the sizes of live tensor storages allocated since
/// tracking began. CUDA: the caching allocator's allocated bytes.
///
/// Example:
/// \code
///   auto before = memfit::memory_allocated(torch::kCPU);
///   auto t = torch::empty({256}, torch::kFloat32);
///   assert(memfit::memory_allocated(torch::kCPU) - before == 1024);
/// \endcode
int64_t memory_allocated(torch::Device device = torch::kCPU);

/// The highest value of memory_allocated(device) since tracking began or
/// since the last reset_peak_memory_stats(device).
///
/// Example:
/// \code
///   memfit::reset_peak_memory_stats(torch::kCPU);
///   { auto t = torch::empty({1024}); }
///   auto peak = memfit::max_memory_allocated(torch::kCPU);  // >= 4096 bytes more
/// \endcode
int64_t max_memory_allocated(torch::Device device = torch::kCPU);

/// The highest number of bytes `device`'s allocator held from the system
/// since tracking began or since the last reset_peak_memory_stats(device), as
/// torch.cuda.max_memory_reserved reports it.
///
/// CUDA: the caching allocator's reserved bytes, allocated ones plus what it
/// caches and what fragmentation wastes; a budget (set_memory_budget) caps
/// these, so a step can run out of memory with its allocated peak below the
/// budget. CPU: memfit's allocator caches nothing, so this is
/// max_memory_allocated(device).
///
/// Example:
/// \code
///   memfit::reset_peak_memory_stats(torch::kCPU);
///   assert(memfit::max_memory_reserved() == memfit::max_memory_allocated());
/// \endcode
int64_t max_memory_reserved(torch::Device device = torch::kCPU);

/// Sets the peak of `device` to its current allocated bytes.
///
/// Example:
/// \code
///   memfit::reset_peak_memory_stats(torch::kCPU);
///   assert(memfit::max_memory_allocated() == memfit::memory_allocated());
/// \endcode
void reset_peak_memory_stats(torch::Device device = torch::kCPU);

/// Releases cached, unused memory of `device` to the system.
///
/// CUDA: the caching allocator's emptyCache(). CPU: memfit keeps no cache
/// (freed storages go straight back to the C library), so this is a no-op.
///
/// Example:
/// \code
///   memfit::empty_cache(torch::kCPU);
/// \endcode
void empty_cache(torch::Device device = torch::kCPU);

/// Limits the bytes that tensors on `device` may hold; 0 removes the limit.
///
/// CPU: an allocation that would take memory_allocated above `bytes` throws
/// c10::OutOfMemoryError ("tried to allocate X; budget Y; Z already
/// allocated") and changes nothing, so the caller can free memory and go on.
/// A budget below what is already allocated is allowed: only new allocations
/// fail. CUDA: sets the caching allocator's per-process memory fraction to
/// bytes / total memory (which limits reserved, not allocated, bytes); the
/// first budget also turns on expandable segments (unless
/// PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF is set), so that reserved
/// bytes follow allocated ones within 2 MiB pages and free space split among
/// cached segments does not fail an allocation the budget allows; and each
/// budget first empties the cache (a sync point: cudaFree waits for the
/// device), so that segments cached before it do not count against it.
///
/// Example:
/// \code
///   memfit::set_memory_budget(torch::kCPU, memfit::memory_allocated() + (1 << 20));
///   try { torch::empty({1 << 20}); } catch (const c10::OutOfMemoryError&) { /* 4 MiB > 1 MiB */ }
///   memfit::set_memory_budget(torch::kCPU, 0);
/// \endcode
void set_memory_budget(torch::Device device, int64_t bytes);

/// The budget set by set_memory_budget for `device`, or 0 when none is set.
///
/// Example:
/// \code
///   assert(memfit::memory_budget(torch::kCPU) == 0);
/// \endcode
int64_t memory_budget(torch::Device device = torch::kCPU);

/// An RAII guard that sets `device`'s budget for a scope and puts back the
/// one it found, also when the scope ends by an exception.
///
/// Example:
/// \code
///   {
///     memfit::BudgetGuard budget(torch::kCPU, memfit::memory_allocated() + (1 << 20));
///     try { torch::empty({1 << 20}); } catch (const c10::OutOfMemoryError&) { /* 4 MiB > 1 MiB */ }
///   }
///   assert(memfit::memory_budget(torch::kCPU) == 0);
/// \endcode
class BudgetGuard {
 public:
  BudgetGuard(torch::Device device, int64_t bytes) : device_(device), saved_(memory_budget(device)) {
    set_memory_budget(device_, bytes);
  }
  ~BudgetGuard() { set_memory_budget(device_, saved_); }
  BudgetGuard(const BudgetGuard&) = delete;
  BudgetGuard& operator=(const BudgetGuard&) = delete;

 private:
  torch::Device device_;
  int64_t saved_;
};

/// Bytes of the distinct storages behind `tensors` (views of one storage count
/// once; undefined tensors count nothing).
///
/// Example:
/// \code
///   auto t = torch::zeros({10});
///   assert(memfit::storage_bytes({t, t.view({2, 5})}) == 40);
/// \endcode
int64_t storage_bytes(const std::vector<torch::Tensor>& tensors);

/// Allocations made on this thread while a guard lives are not counted.
///
/// Models host memory that a GPU run would not hold on the device, such as a
/// data set read into memory before training. Nests; thread-local (kernels
/// that allocate on other threads inside the scope are still counted).
/// Freeing such a tensor later, in any scope, leaves the count unchanged.
///
/// Example:
/// \code
///   auto before = memfit::memory_allocated();
///   torch::Tensor dataset;
///   { memfit::UntrackedGuard host; dataset = torch::zeros({1000}); }
///   assert(memfit::memory_allocated() == before);
/// \endcode
class UntrackedGuard {
 public:
  UntrackedGuard();
  ~UntrackedGuard();
  UntrackedGuard(const UntrackedGuard&) = delete;
  UntrackedGuard& operator=(const UntrackedGuard&) = delete;
};

/// An RAII guard that counts the tracked CPU allocations made while it lives
/// and makes the `fail_at`-th of them throw c10::OutOfMemoryError, as an
/// allocation over the budget would.
///
/// It tests out-of-memory paths deterministically: count a step's
/// allocations with `fail_at` 0 (none fails), then fail each one in turn.
/// Only counted allocations (not those under UntrackedGuard) are numbered,
/// on every thread; guards do not nest. The failed allocation changes no
/// counter. Cost while no guard lives: one atomic load per allocation.
///
/// Example:
/// \code
///   int64_t made = 0;
///   {
///     memfit::AllocationFault count(0);
///     auto a = torch::empty({4}), b = torch::empty({4});
///     made = count.allocations();
///   }
///   memfit::AllocationFault fail(made);  // the last of them throws
///   bool thrown = false;
///   try { auto a = torch::empty({4}), b = torch::empty({4}); } catch (const c10::OutOfMemoryError&) { thrown = true; }
///   assert(made == 2 && thrown);
/// \endcode
class AllocationFault {
 public:
  /// Starts counting; the `fail_at`-th counted allocation (1-based) throws,
  /// none when `fail_at` is 0. Throws c10::Error while another guard lives.
  explicit AllocationFault(int64_t fail_at);
  ~AllocationFault();
  AllocationFault(const AllocationFault&) = delete;
  AllocationFault& operator=(const AllocationFault&) = delete;
  /// Counted allocations attempted since the guard began (the failed one included).
  int64_t allocations() const;
  /// Whether the chosen allocation was reached and failed.
  bool failed() const;
};

/// An RAII meter of the peak memory of `device` during a scope.
///
/// Unlike reset_peak_memory_stats, meters nest and do not disturb the
/// global peak or each other: each meter takes one of 64 slots that the
/// allocator updates on every allocation (cost: one atomic load while no meter
/// lives). On CUDA a meter resets the device's peak statistic when it starts,
/// so CUDA meters do not nest.
///
/// Example:
/// \code
///   memfit::PeakMeter meter;
///   { auto t = torch::empty({1024}); }
///   assert(meter.peak_delta() == 4096);
/// \endcode
class PeakMeter {
 public:
  /// Starts metering `device`; throws when 64 CPU meters are already live.
  explicit PeakMeter(torch::Device device = torch::kCPU);
  ~PeakMeter();
  PeakMeter(PeakMeter&& other) noexcept;
  PeakMeter& operator=(PeakMeter&& other) noexcept;
  PeakMeter(const PeakMeter&) = delete;
  PeakMeter& operator=(const PeakMeter&) = delete;

  /// The device it meters.
  torch::Device device() const { return device_; }
  /// memory_allocated(device) when the meter started.
  int64_t start() const { return start_; }
  /// The highest memory_allocated(device) since the meter started.
  int64_t peak() const;
  /// peak() - start(): the most extra memory the scope needed at once.
  int64_t peak_delta() const { return peak() - start_; }
  /// The most memory the scope asked for at once: peak(), or more where the
  /// tracking allocator refused an allocation (what was allocated then plus
  /// the request: what the scope would have needed to go on). On CUDA, peak().
  ///
  /// Example:
  /// \code
  ///   memfit::PeakMeter meter;
  ///   try {
  ///     memfit::BudgetGuard tight(torch::kCPU, memfit::memory_allocated() + 1024);
  ///     auto t = torch::empty({1024});  // 4096 bytes: refused
  ///   } catch (const c10::OutOfMemoryError&) {
  ///   }
  ///   assert(meter.needed() == meter.start() + 4096);
  /// \endcode
  int64_t needed() const;

 private:
  torch::Device device_;
  int slot_ = -1;
  int64_t start_ = 0;
};

/// Frees the graph that a backward which threw (an out-of-memory error, an
/// error in a hook) left behind on this thread.
///
/// LibTorch keeps the tasks a failed backward had not run in the calling
/// thread's queue until that thread's next backward, and they hold the rest
/// of the graph and its saved activations (pytorch/pytorch#82218): a retry
/// runs its forward beside them. Call it after catching such an error, before
/// the retry; Trainer does it for every failed step. Runs a backward of one
/// host scalar; no device synchronisation, no tracked memory.
///
/// Example:
/// \code
///   auto w = torch::ones({4, 4}, torch::requires_grad());
///   const int64_t before = memfit::memory_allocated();
///   try {
///     auto x = torch::ones({8, 4});
///     auto loss = (x.mm(w).relu() + x.mm(w).sigmoid()).sum();  // two branches
///     memfit::AllocationFault fail(2);
///     loss.backward();
///   } catch (const c10::OutOfMemoryError&) {
///   }
///   memfit::release_failed_backward();
///   w.mutable_grad() = torch::Tensor();
///   assert(memfit::memory_allocated() == before);
/// \endcode
void release_failed_backward();

/// A training step's peak split into what persists and what the step made.
///
/// parameters, gradients and optimizer_state are the bytes of those tensors
/// (distinct storages) when the breakdown is taken, after the optimizer step;
/// activations is the rest of the peak (activations kept for backward and
/// temporaries). Gradients are counted at their full size, so activations is
/// exact when the peak falls after backward and a lower bound otherwise.
struct StepMemory {
  int64_t peak = 0;              ///< The step's peak bytes.
  int64_t parameters = 0;        ///< Parameter and buffer bytes.
  int64_t gradients = 0;         ///< Gradient bytes.
  int64_t optimizer_state = 0;   ///< Optimizer state bytes (moments, buffers).
  int64_t activations = 0;       ///< peak minus the three above, at least 0.

  /// A fixed-width table, one row per category with bytes and share of peak.
  std::string table() const;
  /// A JSON object with the five fields (bytes, integers).
  std::string to_json() const;
};

/// Bytes of the state tensors held by `optimizer` (SGD, Adam, AdamW, Adagrad,
/// RMSprop and LBFGS state; other optimizers' state counts 0).
///
/// Example:
/// \code
///   auto w = torch::ones({4}, torch::requires_grad());
///   torch::optim::Adam adam({w});
///   w.sum().backward(); adam.step();
///   assert(memfit::optimizer_state_bytes(adam) == 2 * 16);  // exp_avg, exp_avg_sq
/// \endcode
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

/// Splits `peak` into parameters (with `buffers`), their gradients, the
/// optimizer's state and the rest.
///
/// Example:
/// \code
///   torch::nn::Linear lin(4, 2);
///   torch::optim::SGD sgd(lin->parameters(), 0.1);
///   memfit::PeakMeter meter;
///   lin(torch::ones({8, 4})).sum().backward(); sgd.step();
///   auto m = memfit::breakdown_step(meter.peak(), lin->parameters(), lin->buffers(), sgd);
///   std::string table = m.table();
/// \endcode
StepMemory breakdown_step(int64_t peak,
                          const std::vector<torch::Tensor>& parameters,
                          const std::vector<torch::Tensor>& buffers,
                          const torch::optim::Optimizer& optimizer);

/// Puts `tensor` in `device`'s memory: a copy when it is in host memory, the
/// tensor itself when it is already there.
///
/// On CUDA this is `tensor.to(device)`, asynchronous from pinned host memory.
/// On the CPU the device's memory is the tracked memory: a tensor allocated
/// under UntrackedGuard, or before tracking began, or not by LibTorch's
/// allocator (from_blob) is host memory and is copied into tracked memory, so
/// memory_allocated counts what a GPU would hold. The Trainer stages each
/// micro-batch this way. Sync points: none. Extra memory: the copy.
///
/// Example:
/// \code
///   torch::Tensor host;
///   { memfit::UntrackedGuard untracked; host = torch::ones({256}); }
///   const auto before = memfit::memory_allocated(torch::kCPU);
///   auto staged = memfit::to_device(host, torch::kCPU);
///   assert(memfit::memory_allocated(torch::kCPU) - before == 1024);
/// \endcode
torch::Tensor to_device(const torch::Tensor& tensor, const torch::Device& device);

/// Parses a memory size: a number with an optional unit, B, KB, MB, GB, TB
/// (powers of 1000) or K/KiB, M/MiB, G/GiB, T/TiB (powers of 1024), any case.
///
/// Throws c10::Error naming the text and the accepted forms on anything else
/// (for example "12XB", "-1GiB", "" or a size above 2^63 - 1).
///
/// Example:
/// \code
///   assert(memfit::parse_memory_size("512MiB") == 512LL << 20);
///   assert(memfit::parse_memory_size("1.5GB") == 1500000000LL);
/// \endcode
int64_t parse_memory_size(const std::string& text);

/// Formats bytes as CUDA's messages do: "512 bytes", "1.50 KiB", "20.00 MiB".
///
/// Example:
/// \code
///   assert(memfit::format_bytes(20 << 20) == "20.00 MiB");
/// \endcode
std::string format_bytes(int64_t bytes);

} // namespace memfit
