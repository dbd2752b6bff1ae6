#include "memfit/environment.h"

#include "test_util.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <dlfcn.h>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <thread>

#include <sys/wait.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace memfit {
namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The BLAS libraries (libblas.so*) mapped into this process, as the kernel
// names them in /proc/self/maps (symbolic links resolved): a source of truth
// independent of the dynamic loader's symbol look-ups.
std::set<std::string> mapped_blas_libraries() {
  std::set<std::string> out;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    if (std::filesystem::path(path).filename().string().rfind("libblas.so", 0) == 0) out.insert(path);
  }
  return out;
}

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_.empty()) unsetenv(name_);
    else setenv(name_, old_.c_str(), 1);
  }

 private:
  const char* name_;
  std::string old_;
};

TEST(Environment, FindsTheLibraryThatLibTorchCallsForSgemm) {
  const auto mapped = mapped_blas_libraries();
  if (mapped.size() != 1) GTEST_SKIP() << "needs exactly one libblas.so mapped, found " << mapped.size();
  const auto blas = blas_info();
  EXPECT_EQ(blas.library, *mapped.begin());
  if (contains(blas.library, "/openblas-openmp/")) {
    EXPECT_EQ(blas.vendor, BlasVendor::kOpenBLAS);
    EXPECT_EQ(blas.threading, BlasThreading::kOpenMP);
    EXPECT_TRUE(contains(blas.name(), "OpenBLAS 0.")) << blas.name();
    EXPECT_EQ(blas.warning(2), "");
  } else if (contains(blas.library, "/blas/")) {
    EXPECT_EQ(blas.vendor, BlasVendor::kReference);
    EXPECT_NE(blas.warning(1), "");
  }
}

// Run by ctest under LD_PRELOAD (tests/CMakeLists.txt: environment.preloaded_*),
// with MEMFIT_EXPECT_BLAS naming what the preloaded library is.
TEST(Environment, DetectsAPreloadedBlas) {
  const char* expected = std::getenv("MEMFIT_EXPECT_BLAS");
  if (!expected) GTEST_SKIP() << "run by ctest's environment.preloaded_* tests with LD_PRELOAD and MEMFIT_EXPECT_BLAS";
  const auto blas = blas_info();
  const std::string preloaded = std::getenv("LD_PRELOAD") ? std::getenv("LD_PRELOAD") : "";
  EXPECT_EQ(blas.library, std::filesystem::canonical(preloaded).string());
  if (std::string(expected) == "reference") {
    EXPECT_EQ(blas.vendor, BlasVendor::kReference);
    EXPECT_EQ(blas.name(), "netlib reference BLAS (sequential)");
    EXPECT_TRUE(contains(check_blas(), "libopenblas0-openmp")) << check_blas();
    ScopedEnv off("MEMFIT_BLAS_CHECK", "0");
    EXPECT_EQ(check_blas(), "") << "MEMFIT_BLAS_CHECK=0 silences the warning";
  } else {
    EXPECT_EQ(blas.vendor, BlasVendor::kOpenBLAS);
    EXPECT_EQ(blas.threading, BlasThreading::kOpenMP);
    EXPECT_EQ(check_blas(), "");
  }
}

TEST(Environment, WarnsOfTheReferenceBlasAndNamesThePackage) {
  BlasInfo blas;
  blas.vendor = BlasVendor::kReference;
  blas.threading = BlasThreading::kSequential;
  blas.library = "/usr/lib/x86_64-linux-gnu/blas/libblas.so.3";
  const auto warning = blas.warning(1);
  EXPECT_TRUE(contains(warning, "reference BLAS (/usr/lib/x86_64-linux-gnu/blas/libblas.so.3)")) << warning;
  EXPECT_TRUE(contains(warning, "install libopenblas0-openmp")) << warning;
  EXPECT_TRUE(contains(warning, "MEMFIT_BLAS_CHECK=0")) << warning;
  EXPECT_EQ(warning.find('\n'), std::string::npos) << "one line";
}

TEST(Environment, WarnsOfABlasThatOversubscribesTheCores) {
  BlasInfo blas;
  blas.vendor = BlasVendor::kOpenBLAS;
  blas.threading = BlasThreading::kPthreads;
  blas.config = "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64";
  blas.library = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3";
  blas.threads = 2;
  EXPECT_EQ(blas.name(), "OpenBLAS 0.3.21 (pthreads)");
  const auto warning = blas.warning(2);
  EXPECT_TRUE(contains(warning, "runs 2 threads of its own beside LibTorch's 2 OpenMP threads")) << warning;
  EXPECT_TRUE(contains(warning, "openblas-openmp/libblas.so.3")) << warning;
  EXPECT_EQ(blas.warning(1), "") << "one LibTorch thread: nothing to oversubscribe";
  blas.threads = 1;  // OPENBLAS_NUM_THREADS=1
  EXPECT_EQ(blas.warning(2), "");
  blas.threads = 2;
  blas.threading = BlasThreading::kOpenMP;  // shares LibTorch's OpenMP threads
  EXPECT_EQ(blas.warning(2), "");
}

// PyPI's torch links MKL into libtorch_cpu.so with its GNU OpenMP layer: it
// runs on LibTorch's own OpenMP threads and oversubscribes nothing.
TEST(Environment, MklBuiltIntoLibTorchSharesItsOpenMPThreads) {
  const auto blas = blas_info();
  if (blas.vendor != BlasVendor::kMKL) GTEST_SKIP() << "LibTorch's BLAS here is " << blas.name() << ", not MKL";
  if (dlsym(RTLD_DEFAULT, "__kmpc_fork_call")) GTEST_SKIP() << "Intel's OpenMP runtime is loaded: MKL may use it";
  EXPECT_EQ(blas.threading, BlasThreading::kOpenMP) << blas.name();
  EXPECT_EQ(blas.warning(2), "");
  BlasInfo own = blas;  // MKL on Intel's OpenMP runtime: threads of its own
  own.threading = BlasThreading::kUnknown;
  own.threads = 2;
  EXPECT_TRUE(contains(own.warning(2), "MKL_NUM_THREADS=1")) << own.warning(2);
  EXPECT_FALSE(contains(own.warning(2), "openblas")) << "MKL built into LibTorch is not replaced by a libblas.so.3";
}

TEST(Environment, RecordsVersionThreadsAndBlas) {
  at::set_num_threads(1);
  const auto env = environment();
  EXPECT_EQ(env.libtorch, TORCH_VERSION);
  EXPECT_EQ(env.threads, 1);
  EXPECT_TRUE(contains(env.to_string(), std::string("LibTorch ") + TORCH_VERSION + ", ")) << env.to_string();
  EXPECT_TRUE(contains(env.to_string(), "1 thread, BLAS: " + env.blas.name())) << env.to_string();
  const auto j = nlohmann::json::parse(env.to_json());
  EXPECT_EQ(j.at("threads"), 1);
  EXPECT_EQ(j.at("blas").at("name"), env.blas.name());
  EXPECT_EQ(j.at("blas").at("library"), env.blas.library);
  EXPECT_EQ(j.at("host_memory_kept"), env.host_memory_kept);
  EXPECT_EQ(j.at("cpu_bf16"), env.cpu_bf16);
  EXPECT_EQ(contains(env.to_string(), ", CPU without native bf16"), !env.cpu_bf16) << env.to_string();
}

// The kernel's own list of the CPU's features says the same as CPUID.
TEST(Environment, NativeBf16IsWhatProcCpuinfoSays) {
  std::ifstream in("/proc/cpuinfo");
  if (!in) GTEST_SKIP() << "no /proc/cpuinfo to compare with";
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!contains(text, "vendor_id")) GTEST_SKIP() << "/proc/cpuinfo of a CPU other than x86";
  EXPECT_EQ(cpu_computes_bf16_natively(), contains(text, " avx512_bf16")) << "CPUID and /proc/cpuinfo disagree";
  EXPECT_EQ(environment().cpu_bf16, cpu_computes_bf16_natively());
}

// glibc's malloc maps a large tensor from the system afresh and unmaps it
// when freed, so each step page-faults its activations in again; kept, the
// next step's tensors reuse the heap (keep_freed_host_memory).
TEST(Environment, FreedHostMemoryIsKeptForTheNextTensors) {
#if !defined(__GLIBC__)
  GTEST_SKIP() << "configures glibc's malloc; this C library is another";
#else
  for (const char* set : {"GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD"}) {
    if (std::getenv(set) != nullptr) GTEST_SKIP() << set << " is set: the environment configures the allocator";
  }
  ASSERT_TRUE(keep_freed_host_memory());
  EXPECT_TRUE(environment().host_memory_kept);
  EXPECT_TRUE(contains(environment().to_string(), ", freed host memory kept")) << environment().to_string();
  constexpr int64_t kBytes = 24 << 20;  // above any threshold glibc would have raised itself to in this process
  const auto mapped = [] { return static_cast<int64_t>(mallinfo2().hblkhd); };
  const auto free_in_heap = [] { return static_cast<int64_t>(mallinfo2().fordblks); };
  const int64_t mapped_before = mapped();
  int64_t heap_free_while_alive = 0;
  {
    auto t = torch::ones({kBytes / 4});
    EXPECT_LT(mapped() - mapped_before, kBytes) << "served from the heap, not mapped afresh";
    heap_free_while_alive = free_in_heap();
  }
  EXPECT_GE(free_in_heap() - heap_free_while_alive, kBytes) << "kept in the heap when freed, not given back";
#endif
}

} // namespace
} // namespace memfit

// Another process spinning on a core counts; this process's own work does not.
// The counters advance in clock ticks (100 Hz): over a few milliseconds a
// quiet machine read as 0.0 free cores in 2 of 4 `memfit plan --model mlp`
// runs, whose timed steps take under a millisecond; such an interval is unknown.
TEST(Environment, CpuLoadIsUnknownOverAnIntervalTooShortForItsClockTicks) {
  memfit::CpuLoad load;
  EXPECT_EQ(load.others_cores(), -1) << "microseconds after the start";
  EXPECT_EQ(load.free_cores(), -1);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(load.others_cores(), -1) << "20 ms: the rounding of (2 x CPUs + 4) ticks exceeds a quarter core";
  // Long enough for this machine's CPUs: (2 x CPUs + 4) ticks of 10 ms within a quarter core.
  const double needed = (2.0 * std::thread::hardware_concurrency() + 4.0) * 0.01 / 0.25;
  if (needed > 3.0) GTEST_SKIP() << "this many CPUs need " << needed << " s to tell";
  std::this_thread::sleep_for(std::chrono::duration<double>(needed + 0.05));
  if (load.others_cores() < 0) GTEST_SKIP() << "no /proc/stat for this process's CPUs (not Linux, or a container)";
  EXPECT_GE(load.free_cores(), 0) << "long enough to tell";
}

TEST(Environment, CpuLoadCountsTheCoresOtherProcessesKeepBusy) {
  memfit::CpuLoad load;
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // spins for 0.6 s, then leaves without running the parent's atexit handlers
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(600);
    volatile uint64_t n = 0;
    while (std::chrono::steady_clock::now() < end) n = n + 1;
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  const double others = load.others_cores();
  if (others < 0) GTEST_SKIP() << "no /proc/stat for this process's CPUs (not Linux, or a container)";
  EXPECT_GE(others, 0.6) << "the child kept a core busy all along";
  EXPECT_LE(others, double(std::thread::hardware_concurrency()));
  EXPECT_NEAR(load.free_cores() + others, double(std::thread::hardware_concurrency()), 0.05)
      << "free: the CPUs this process may use, less the others' load (sampled again)";
}
