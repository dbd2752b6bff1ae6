#include "memfit/environment.h"

#include "compat.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <dlfcn.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

namespace memfit {
namespace {

using IntGetter = int (*)();
using TextGetter = char* (*)();

// LibTorch's own BLAS_INFO ("generic", "mkl", "open", ...) from its build settings.
std::string torch_blas_info() {
  const std::string config = at::show_config();
  const std::string key = "BLAS_INFO=";
  const auto at = config.find(key);
  if (at == std::string::npos) return "";
  const auto start = at + key.size();
  return config.substr(start, config.find_first_of(", \n", start) - start);
}

// The vendor and config of a BLAS built into LibTorch, as its BLAS_INFO says.
void from_torch_blas_info(BlasInfo& info) {
  const auto text = torch_blas_info();
  if (!text.empty()) info.config = "BLAS_INFO=" + text;
  info.vendor = text == "mkl"     ? BlasVendor::kMKL
                : text == "open"  ? BlasVendor::kOpenBLAS
                : text == "blis"  ? BlasVendor::kBLIS
                : text == "atlas" ? BlasVendor::kATLAS
                                  : BlasVendor::kUnknown;
}

std::string resolved_path(const char* path) {
  std::error_code error;
  const auto canonical = std::filesystem::canonical(path, error);
  return error ? std::string(path) : canonical.string();
}

// What `library` (the loaded object that provides sgemm_) is, from the
// symbols of it and its dependencies.
void identify(BlasInfo& info, void* handle) {
  const auto symbol = [&](const char* name) { return handle ? dlsym(handle, name) : nullptr; };
  if (auto config = reinterpret_cast<TextGetter>(symbol("openblas_get_config"))) {
    info.vendor = BlasVendor::kOpenBLAS;
    info.config = config();
    if (auto parallel = reinterpret_cast<IntGetter>(symbol("openblas_get_parallel"))) {
      const int kind = parallel();  // OpenBLAS: 0 sequential, 1 pthreads, 2 OpenMP
      info.threading = kind == 0 ? BlasThreading::kSequential
                       : kind == 1 ? BlasThreading::kPthreads
                       : kind == 2 ? BlasThreading::kOpenMP
                                   : BlasThreading::kUnknown;
    }
    if (auto threads = reinterpret_cast<IntGetter>(symbol("openblas_get_num_threads"))) info.threads = threads();
    return;
  }
  if (auto threads = reinterpret_cast<IntGetter>(symbol("mkl_get_max_threads"))) {
    info.vendor = BlasVendor::kMKL;
    info.threads = threads();
    // Without Intel's OpenMP runtime loaded, MKL runs its GNU OpenMP layer
    // (PyPI's torch links it so): LibTorch's own OpenMP threads, nothing more.
    if (!dlsym(RTLD_DEFAULT, "__kmpc_fork_call")) info.threading = BlasThreading::kOpenMP;
    return;
  }
  if (auto version = reinterpret_cast<const char* (*)()>(symbol("bli_info_get_version_str"))) {
    info.vendor = BlasVendor::kBLIS;
    info.config = std::string("BLIS ") + version();
    return;
  }
  if (symbol("ATL_buildinfo")) {
    info.vendor = BlasVendor::kATLAS;
    return;
  }
  const std::filesystem::path path(info.library);
  if (path.filename().string().rfind("libtorch", 0) == 0) {  // built into LibTorch (pip wheels)
    from_torch_blas_info(info);
    return;
  }
  // Debian's netlib reference BLAS (libblas3) is .../blas/libblas.so.3: no
  // vendor symbols, one thread.
  if (path.parent_path().filename() == "blas" && path.filename().string().rfind("libblas.so", 0) == 0) {
    info.vendor = BlasVendor::kReference;
    info.threading = BlasThreading::kSequential;
    info.threads = 1;
  }
}

const char* threading_name(BlasThreading threading) {
  switch (threading) {
    case BlasThreading::kSequential: return "sequential";
    case BlasThreading::kPthreads: return "pthreads";
    case BlasThreading::kOpenMP: return "OpenMP";
    case BlasThreading::kUnknown: break;
  }
  return "unknown";
}

const char* vendor_name(BlasVendor vendor) {
  switch (vendor) {
    case BlasVendor::kReference: return "reference";
    case BlasVendor::kOpenBLAS: return "OpenBLAS";
    case BlasVendor::kMKL: return "MKL";
    case BlasVendor::kBLIS: return "BLIS";
    case BlasVendor::kATLAS: return "ATLAS";
    case BlasVendor::kUnknown: break;
  }
  return "unknown";
}

bool blas_check_disabled() {
  const char* value = std::getenv("MEMFIT_BLAS_CHECK");
  if (!value) return false;
  std::string text(value);
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text == "0" || text == "off" || text == "false";
}

} // namespace

std::string BlasInfo::name() const {
  std::string base;
  switch (vendor) {
    case BlasVendor::kReference:
      base = "netlib reference BLAS";
      break;
    case BlasVendor::kOpenBLAS: {
      // "OpenBLAS 0.3.21 DYNAMIC_ARCH ..." -> "OpenBLAS 0.3.21"
      std::istringstream words(config);
      std::string product, version;
      words >> product >> version;
      base = product == "OpenBLAS" && !version.empty() ? "OpenBLAS " + version : "OpenBLAS";
      break;
    }
    case BlasVendor::kUnknown:
      base = library.empty() ? "no BLAS found" : "unknown BLAS";
      break;
    default:
      base = vendor_name(vendor);
  }
  return threading == BlasThreading::kUnknown ? base : fmt::format("{} ({})", base, threading_name(threading));
}

std::string BlasInfo::warning(int torch_threads) const {
  constexpr const char* kSilence = "; MEMFIT_BLAS_CHECK=0 silences this";
  if (vendor == BlasVendor::kReference) {
    return fmt::format(
        "LibTorch's CPU matrix products run on the netlib reference BLAS ({}), often hundreds of times "
        "slower than OpenBLAS: install libopenblas0-openmp (apt-get install libopenblas0-openmp), which "
        "Debian's LibTorch then uses{}",
        library, kSilence);
  }
  if (threading != BlasThreading::kOpenMP && threads > 1 && torch_threads > 1 && vendor == BlasVendor::kMKL) {
    return fmt::format("{} ({}) runs {} threads of its own beside LibTorch's {} OpenMP threads, oversubscribing the "
                       "cores: set MKL_THREADING_LAYER=GNU, or MKL_NUM_THREADS=1{}",
                       name(), library, threads, torch_threads, kSilence);
  }
  if (threading != BlasThreading::kOpenMP && threads > 1 && torch_threads > 1) {
    return fmt::format(
        "{} ({}) runs {} threads of its own beside LibTorch's {} OpenMP threads, oversubscribing the "
        "cores: install libopenblas0-openmp and select it (update-alternatives --set "
        "libblas.so.3-x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3), or set "
        "OPENBLAS_NUM_THREADS=1{}",
        name(), library, threads, torch_threads, kSilence);
  }
  return "";
}

BlasInfo blas_info() {
  BlasInfo info;
  Dl_info where{};
  void* sgemm = dlsym(RTLD_DEFAULT, "sgemm_");
  if (!sgemm || !dladdr(sgemm, &where) || !where.dli_fname) {
    from_torch_blas_info(info);  // no exported sgemm_: a BLAS linked statically into LibTorch, or none
    return info;
  }
  info.library = resolved_path(where.dli_fname);
  // RTLD_NOLOAD: the object already loaded under that name; dlsym on it
  // searches it and its dependencies (OpenBLAS's libblas.so.3 calls into
  // libopenblas.so.0, which answers openblas_get_config).
  void* handle = dlopen(where.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  identify(info, handle);
  if (handle) dlclose(handle);
  return info;
}

std::string Environment::to_string() const {
  return fmt::format("LibTorch {}, {}, {} thread{}, BLAS: {}{}{}{}", libtorch, cuda ? "CUDA" : "CPU only", threads,
                     threads == 1 ? "" : "s", blas.name(), blas.library.empty() ? "" : " (" + blas.library + ")",
                     host_memory_kept ? ", freed host memory kept" : "",
                     cpu_bf16 ? "" : ", CPU without native bf16");
}

std::string Environment::to_json() const {
  const nlohmann::json j = {
      {"libtorch", libtorch},
      {"cuda", cuda},
      {"threads", threads},
      {"blas",
       {{"name", blas.name()},
        {"vendor", vendor_name(blas.vendor)},
        {"threading", threading_name(blas.threading)},
        {"library", blas.library},
        {"config", blas.config},
        {"threads", blas.threads}}},
      {"host_memory_kept", host_memory_kept},
      {"cpu_bf16", cpu_bf16}};
  return j.dump();
}

namespace {
std::atomic<bool> host_memory_kept{false};
} // namespace

bool keep_freed_host_memory() {
#if defined(__GLIBC__)
  for (const char* set : {"GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}) {
    if (std::getenv(set) != nullptr) return false;  // the user's configuration stands
  }
  if (const char* preload = std::getenv("LD_PRELOAD")) {
    for (const char* other : {"jemalloc", "tcmalloc", "mimalloc"}) {
      if (std::strstr(preload, other) != nullptr) return false;
    }
  }
  constexpr int kLargestMmapThreshold = 32 << 20;  // glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems
  const bool kept = mallopt(M_MMAP_THRESHOLD, sizeof(long) >= 8 ? kLargestMmapThreshold : 512 << 10) == 1 &&
                    mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
  if (kept) host_memory_kept.store(true);
  return kept;
#else
  return false;
#endif
}

bool cpu_computes_bf16_natively() {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;  // other CPUs' bf16 (Arm's BF16 extension) is not detected yet
#endif
}

Environment environment() {
  Environment env;
  env.host_memory_kept = host_memory_kept.load();
  env.cpu_bf16 = cpu_computes_bf16_natively();
  env.libtorch = TORCH_VERSION;
  env.cuda = compat::kBuiltWithCuda && torch::cuda::is_available();
  env.threads = at::get_num_threads();
  env.blas = blas_info();
  return env;
}

std::string check_blas() {
  if (blas_check_disabled()) return "";
  return blas_info().warning(at::get_num_threads());
}

CpuLoad::Sample CpuLoad::sample() {
  Sample out;
  out.at = std::chrono::steady_clock::now();
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  cpu_set_t mask;
  if (tick <= 0 || sched_getaffinity(0, sizeof(mask), &mask) != 0) return out;
  out.cpus = CPU_COUNT(&mask);
  std::ifstream stat("/proc/stat");
  std::string line;
  int listed = 0;
  double busy = 0;
  while (std::getline(stat, line)) {
    if (line.rfind("cpu", 0) != 0) break;
    std::istringstream fields(line);
    std::string name;
    double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
    fields >> name >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
    if (name == "cpu") busy = user + nice + system + irq + softirq + steal;  // guest time is in user already
    else ++listed;
  }
  std::ifstream self("/proc/self/stat");
  std::string text((std::istreambuf_iterator<char>(self)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');  // the command name may hold spaces and parentheses
  if (listed == 0 || listed != out.cpus || close == std::string::npos) return out;
  std::istringstream rest(text.substr(close + 2));
  std::string field;
  double utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {  // fields 3.. after "pid (comm)"
    if (i == 14) utime = std::stod(field);
    if (i == 15) stime = std::stod(field);
  }
  out.machine_seconds = busy / tick;
  out.self_seconds = (utime + stime) / tick;
  out.known = true;
  return out;
}

namespace {
// The most the counters' rounding may misread the others' load by, in cores.
constexpr double kLoadError = 0.25;
} // namespace

CpuLoad::CpuLoad() : start_(sample()) {}

double CpuLoad::others_cores() const {
  const auto now = sample();
  const double wall = std::chrono::duration<double>(now.at - start_.at).count();
  if (!start_.known || !now.known || wall <= 0) return -1;
  // The counters advance in clock ticks: each CPU's and this process's two
  // are rounded down at both samples. Over an interval where that rounding
  // could be more than kLoadError cores (0.32 s with 2 CPUs at 100 Hz), a
  // quiet machine can read as a busy one: unknown.
  const double rounding = (2.0 * now.cpus + 4.0) / static_cast<double>(sysconf(_SC_CLK_TCK));
  if (rounding > kLoadError * wall) return -1;
  const double others = (now.machine_seconds - start_.machine_seconds) - (now.self_seconds - start_.self_seconds);
  return std::clamp(others / wall, 0.0, static_cast<double>(now.cpus));
}

double CpuLoad::free_cores() const {
  const double others = others_cores();
  return others < 0 ? -1 : static_cast<double>(start_.cpus) - others;
}

} // namespace memfit
