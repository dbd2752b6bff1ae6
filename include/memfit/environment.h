#pragma once
/// \file environment.h
/// What a run's speed depends on besides memfit: the LibTorch version, CUDA,
/// the intra-op thread count and, above all on the CPU, which BLAS LibTorch's
/// fp32 matrix products call.
///
/// Debian's LibTorch (BLAS_INFO=generic) calls whichever `libblas.so.3` the
/// system's alternatives select. The netlib reference implementation is
/// hundreds of times slower than OpenBLAS on large fp32 products, and
/// OpenBLAS's pthread variant starts threads of its own beside LibTorch's
/// OpenMP threads, oversubscribing the cores. blas_info() asks the dynamic
/// loader which library provides the `sgemm_` that LibTorch calls (so
/// `LD_PRELOAD` and the alternatives are both seen), and asks that library
/// what it is. check_blas() turns that into one warning line for the tools
/// and benchmarks; it never refuses to run.
///
/// Setting the environment variable `MEMFIT_BLAS_CHECK=0` (or `off`,
/// `false`) turns the warning off; detection and recording go on.
///
/// A CpuLoad says how many cores other processes kept busy while some work
/// ran: the planner times candidate plans only where that leaves LibTorch's
/// threads a core each (plan.h, PlanOptions::measure_candidates).
///
/// Thread safety: the functions are safe to call from any thread. Sync
/// points: none. Extra memory: none (no tensor is allocated).

#include <chrono>
#include <string>

namespace memfit {

/// The implementation behind LibTorch's CPU BLAS calls.
enum class BlasVendor {
  kUnknown,    ///< no `sgemm_` was found, or a library memfit does not know
  kReference,  ///< netlib's reference BLAS (Debian's `libblas3`)
  kOpenBLAS,
  kMKL,
  kBLIS,
  kATLAS,
};

/// How a BLAS runs threads of its own.
enum class BlasThreading {
  kUnknown,
  kSequential,  ///< one thread (the reference BLAS, OpenBLAS's serial variant)
  kPthreads,    ///< a thread pool of its own (OpenBLAS's pthread variant)
  kOpenMP,      ///< OpenMP, shared with LibTorch's intra-op threads
};

/// Which BLAS LibTorch's CPU matrix products run on.
///
/// Example:
/// \code
///   const auto blas = memfit::blas_info();
///   std::cout << blas.name() << " from " << blas.library << "\n";  // OpenBLAS 0.3.21 (OpenMP) from /usr/...
/// \endcode
struct BlasInfo {
  BlasVendor vendor = BlasVendor::kUnknown;
  BlasThreading threading = BlasThreading::kUnknown;
  /// The file that provides `sgemm_`, symbolic links resolved; empty when
  /// none was found.
  std::string library;
  /// The library's own description (`openblas_get_config()`), or LibTorch's
  /// `BLAS_INFO` when the BLAS is built into LibTorch; may be empty.
  std::string config;
  /// The BLAS's own thread count, or -1 when it cannot say.
  int threads = -1;

  /// A short name: "OpenBLAS 0.3.21 (OpenMP)", "netlib reference BLAS".
  std::string name() const;
  /// One line saying why this BLAS slows LibTorch down and what to install or set
  /// instead, or empty when it does not: the reference BLAS, or a BLAS with
  /// threads of its own (more than one) beside `torch_threads` (more than
  /// one) OpenMP threads.
  std::string warning(int torch_threads) const;
};

/// Detects the BLAS behind LibTorch's CPU matrix products (see the file
/// comment). Cheap: a few dynamic-loader look-ups, no product is run.
BlasInfo blas_info();

/// Whether this CPU computes bf16 natively (AVX-512 BF16 on x86-64).
///
/// Where it does not (an AVX2 CPU), LibTorch's CPU bf16 kernels fall back to
/// slower paths: on an AVX2 AMD EPYC, bf16 convolutions took about 10 s a
/// CNN step, bf16 products rounded their partial sums, and autocast's
/// convolutions held more bytes for backward than fp32's (docs/precision.md).
/// Lower precision on such a CPU trades time for nothing: choose fp32 there,
/// or let the planner time both (PlanOptions::precisions). CUDA devices are
/// not concerned. Cheap: one CPUID look-up, cached by the compiler's runtime.
///
/// Example:
/// \code
///   const auto precision = memfit::cpu_computes_bf16_natively() ? memfit::Precision::kBF16
///                                                               : memfit::Precision::kFP32;
/// \endcode
bool cpu_computes_bf16_natively();

/// The LibTorch version, CUDA, threads and BLAS of this process: what a
/// benchmark's header and a run's report record.
///
/// Example:
/// \code
///   const auto env = memfit::environment();
///   std::cout << env.to_string() << "\n";  // LibTorch 1.13.0, CPU only, 2 threads, BLAS: OpenBLAS ...
/// \endcode
struct Environment {
  std::string libtorch;   ///< TORCH_VERSION at build time
  bool cuda = false;      ///< built with CUDA and a device is present
  int threads = 0;        ///< at::get_num_threads()
  BlasInfo blas;
  bool host_memory_kept = false;  ///< keep_freed_host_memory() configured glibc's malloc
  bool cpu_bf16 = false;          ///< cpu_computes_bf16_natively()


  /// One line, as printed at the top of a benchmark's output; it ends in
  /// ", CPU without native bf16" where cpu_bf16 is false.
  std::string to_string() const;
  /// {"libtorch": ..., "cuda": ..., "threads": ..., "blas": {"name", "vendor",
  /// "threading", "library", "config", "threads"}, "host_memory_kept": ...,
  /// "cpu_bf16": ...}.
  std::string to_json() const;
};

/// The environment as it is now (call after setting the thread count).
Environment environment();

/// The BLAS warning for this process (BlasInfo::warning with LibTorch's
/// current thread count), or empty when there is none or when
/// `MEMFIT_BLAS_CHECK` is `0`, `off` or `false`.
///
/// Example:
/// \code
///   const auto warning = memfit::check_blas();
///   if (!warning.empty()) std::cerr << "warning: " << warning << "\n";
/// \endcode
std::string check_blas();

/// Keeps the host memory of freed CPU tensors in this process's heap for the
/// next ones, as PyTorch's CUDA caching allocator keeps device memory: sets
/// glibc malloc's mmap threshold to its largest (32 MiB on 64-bit systems)
/// and its trim threshold to 2 GiB. Returns whether it did.
///
/// By default glibc maps allocations above a threshold, which it raises as it
/// goes from 128 KiB, from the system afresh and unmaps them when freed, so a
/// step whose activations are large page-faults its memory in again on every
/// step. On the ResNet at micro-batches of 64 (CPU, 2 threads) steps took 78
/// to 92 ms, or 64 ms where the threshold had risen, from one planning run to
/// the next, and the plan flipped between micro-batches of 64 and 32; with
/// the memory kept they took 63 to 66 ms in every run (docs/planner.md). The
/// cost: the process's resident memory keeps what the largest step freed
/// (the tensor bytes memfit counts are unchanged). Tensors above 32 MiB are
/// still mapped afresh.
///
/// Does nothing and returns false where the C library is not glibc, where the
/// environment configures malloc already (`GLIBC_TUNABLES`,
/// `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`), or where `LD_PRELOAD`
/// names another allocator (jemalloc, tcmalloc, mimalloc). The `memfit` CLI
/// calls it at start. Call it at the start of main, before other threads
/// allocate.
///
/// Example:
/// \code
///   int main() {
///     memfit::keep_freed_host_memory();
///     // ... train ...
///   }
/// \endcode
bool keep_freed_host_memory();

/// How busy the machine's CPUs were since a point in time: the cores other
/// processes kept busy, from the machine's and this process's CPU time.
///
/// Reads `/proc/stat` and `/proc/self/stat` at construction and at each call.
/// Where they are missing, or where `/proc/stat` counts other CPUs than this
/// process may run on (a container on a larger host), it knows nothing and
/// says -1; so it does over an interval too short for the counters' clock
/// ticks to tell a quarter of a core apart ((2 × CPUs + 4) ticks: 0.32 s with
/// 2 CPUs at 100 Hz). Costs two small file reads per call.
///
/// Example:
/// \code
///   memfit::CpuLoad load;
///   // ... timed work ...
///   if (load.free_cores() >= 0 && load.free_cores() < 1.5) std::cerr << "another process shares the cores\n";
/// \endcode
class CpuLoad {
 public:
  /// Starts the interval now.
  CpuLoad();
  /// Cores other processes kept busy on average since construction (0 to
  /// the CPU count); -1 where unknown.
  double others_cores() const;
  /// The CPUs this process may run on, less others_cores(); -1 where unknown.
  double free_cores() const;

 private:
  struct Sample {
    double machine_seconds = 0;  // CPU time all processes used, summed over CPUs
    double self_seconds = 0;     // this process's user and system time
    std::chrono::steady_clock::time_point at;
    int cpus = 0;                // CPUs this process may run on
    bool known = false;
  };
  static Sample sample();
  Sample start_;
};

} // namespace memfit
