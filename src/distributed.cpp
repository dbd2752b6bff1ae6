#include "memfit/distributed.h"

#include "compat.h"

#include "memfit/memory.h"
#include "memfit/state.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#if defined(MEMFIT_WITH_DISTRIBUTED)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#if defined(MEMFIT_WITH_NCCL)
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include <unistd.h>

namespace memfit {

// ---------------------------------------------------------------------------
// The environment

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

int64_t env_int(const char* name, int64_t fallback, int64_t low, int64_t high) {
  const char* v = env(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  TORCH_CHECK(errno == 0 && end != v && *end == '\0' && x >= low && x <= high, "environment variable ",
              name, "='", v, "' is not an integer in [", low, ", ", high, "]");
  return x;
}

} // namespace

WorldInfo world_from_env() {
  WorldInfo w;
  const int64_t big = std::numeric_limits<int32_t>::max();
  const char* rank_var = nullptr;
  const char* size_var = nullptr;
  const char* local_var = nullptr;
  if (env("RANK") != nullptr || env("WORLD_SIZE") != nullptr) {
    rank_var = "RANK", size_var = "WORLD_SIZE", local_var = "LOCAL_RANK";
    w.source = "torchrun";
  } else if (env("SLURM_PROCID") != nullptr) {
    rank_var = "SLURM_PROCID", size_var = "SLURM_NTASKS", local_var = "SLURM_LOCALID";
    w.source = "slurm";
  } else if (env("OMPI_COMM_WORLD_RANK") != nullptr) {
    rank_var = "OMPI_COMM_WORLD_RANK", size_var = "OMPI_COMM_WORLD_SIZE",
    local_var = "OMPI_COMM_WORLD_LOCAL_RANK";
    w.source = "openmpi";
  } else {
    return w;
  }
  TORCH_CHECK(env(rank_var) != nullptr && env(size_var) != nullptr, w.source, "'s ", size_var,
              " and ", rank_var, " must be set together (found only ",
              env(rank_var) != nullptr ? rank_var : size_var, ")");
  w.world_size = env_int(size_var, 1, 1, big);
  w.rank = env_int(rank_var, 0, 0, w.world_size - 1);
  w.local_rank = env_int(local_var, w.rank, 0, w.world_size - 1);
  if (const char* a = env("MASTER_ADDR")) w.master_addr = a;
  w.master_port = env_int("MASTER_PORT", w.master_port, 0, 65535);
  return w;
}

bool distributed_available() {
#if defined(MEMFIT_WITH_DISTRIBUTED)
  return true;
#else
  return false;
#endif
}

bool nccl_available() {
#if defined(MEMFIT_WITH_NCCL)
  return true;
#else
  return false;
#endif
}

// ---------------------------------------------------------------------------
// The process group

#if defined(MEMFIT_WITH_DISTRIBUTED)

namespace detail {
struct ProcessGroupImpl {
  WorldInfo world;
  ProcessGroupOptions options;
  c10::intrusive_ptr<c10d::TCPStore> store;
  c10::intrusive_ptr<compat::C10dBackend> backend;  // Gloo or NCCL
  torch::Device device{torch::kCPU};               // where the backend reduces
  int64_t payload = 0;
  int64_t operations = 0;

  void count(const torch::Tensor& t) {
    payload += t.numel() * static_cast<int64_t>(t.element_size());
    ++operations;
  }
};
} // namespace detail

struct ProcessGroup::Pending::Work {
  c10::intrusive_ptr<c10d::Work> work;
  std::string what;
  std::chrono::milliseconds timeout{0};  // 0: the work's own (a collective's)
  torch::Tensor keep;                    // a send's tensor, alive until it is sent
};

namespace {

void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const char* what,
              const detail::ProcessGroupImpl& g) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", g.world.rank, " of ", g.world.world_size, ": ", what,
                " failed (another rank died, hung past the ", g.options.timeout().count(),
                " ms timeout, or called a different collective): ", e.what());
  }
}

// Before any connection: whether the backend asked for can run here.
void check_backend(ProcessGroupBackend backend) {
  if (backend != ProcessGroupBackend::kNccl) return;
  TORCH_CHECK(nccl_available(), "ProcessGroup: the NCCL backend needs memfit built against a CUDA LibTorch with "
              "NCCL (MEMFIT_LIBTORCH=pip, with the CUDA toolkit's nccl.h); this build has ",
              compat::kBuiltWithCuda ? "CUDA but not NCCL" : "no CUDA",
              "; use ProcessGroupOptions().backend(ProcessGroupBackend::kGloo)");
  TORCH_CHECK(torch::cuda::is_available(), "ProcessGroup: the NCCL backend needs a CUDA device and none is "
              "visible; use ProcessGroupOptions().backend(ProcessGroupBackend::kGloo)");
}

void join_gloo(detail::ProcessGroupImpl& g) {
  auto o = c10d::ProcessGroupGloo::Options::create(g.options.timeout());
  const bool local = g.world.master_addr == "127.0.0.1" || g.world.master_addr == "localhost";
  o->devices.push_back(local ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                             : c10d::ProcessGroupGloo::createDefaultDevice());
  o->threads = 2;
  g.backend = c10::make_intrusive<c10d::ProcessGroupGloo>(g.store, static_cast<int>(g.world.rank),
                                                          static_cast<int>(g.world.world_size), o);
  g.device = torch::kCPU;
}

void join_nccl(detail::ProcessGroupImpl& g) {
#if defined(MEMFIT_WITH_NCCL)
  g.device = torch::Device(torch::kCUDA, c10::cuda::current_device());
  auto o = c10d::ProcessGroupNCCL::Options::create();
  o->timeout = g.options.timeout();
  g.backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(g.store, static_cast<int>(g.world.rank),
                                                          static_cast<int>(g.world.world_size), o);
#else
  TORCH_INTERNAL_ASSERT(false, "check_backend lets kNccl through only in builds with NCCL");
#endif
}

// A tensor that is not a contiguous tensor on the backend's device is staged
// through a copy there (Gloo: the host; NCCL: the CUDA device).
template <typename Launch>
void staged(const detail::ProcessGroupImpl& g, torch::Tensor& tensor, Launch&& launch) {
  if (tensor.device() == g.device && tensor.is_contiguous()) {
    launch(tensor);
    return;
  }
  torch::Tensor copy;
  {
    UntrackedGuard untracked;  // a staging copy, not the model's memory
    copy = tensor.to(g.device).contiguous();
  }
  launch(copy);
  tensor.copy_(copy);
}

// An exception's message without a backtrace, in one line.
std::string first_line(const std::exception& e) { return compat::first_line(compat::message_of(e)); }

// Holds what the process writes to stderr (fd 2) in a temporary file until
// release: c10d logs a failed bind or connect there (glog's lines, 1.13)
// before the TCPStore throws, and the failure is said in memfit's one line
// instead. What is held is written out unless dropped.
class StderrHeld {
 public:
  StderrHeld() {
    std::fflush(stderr);
    file_ = std::tmpfile();
    if (file_ == nullptr) return;
    saved_ = ::dup(2);
    if (saved_ >= 0 && ::dup2(::fileno(file_), 2) < 0) {
      ::close(saved_);
      saved_ = -1;
    }
  }
  ~StderrHeld() {
    release(/*drop=*/false);
    if (file_ != nullptr) std::fclose(file_);
  }
  StderrHeld(const StderrHeld&) = delete;
  StderrHeld& operator=(const StderrHeld&) = delete;

  // Puts stderr back, and writes what was held there unless `drop`.
  void release(bool drop) {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
    if (drop) return;
    std::rewind(file_);
    char buffer[4096];
    for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, file_)) > 0;) std::fwrite(buffer, 1, n, stderr);
    std::fflush(stderr);
  }

 private:
  std::FILE* file_ = nullptr;
  int saved_ = -1;
};

void check_on_device(const detail::ProcessGroupImpl& g, const torch::Tensor& tensor, const char* what) {
  TORCH_CHECK(tensor.device() == g.device && tensor.is_contiguous(), what, " needs a contiguous tensor on ",
              g.device, " (the process group's device), got ", tensor.device(),
              tensor.is_contiguous() ? "" : " (not contiguous)");
}

} // namespace

ProcessGroup::ProcessGroup(const WorldInfo& world, ProcessGroupOptions options)
    : impl_(std::make_unique<detail::ProcessGroupImpl>()) {
  TORCH_CHECK(world.world_size >= 1 && world.rank >= 0 && world.rank < world.world_size,
              "ProcessGroup: rank ", world.rank, " is not in [0, ", world.world_size, ")");
  TORCH_CHECK(options.timeout().count() > 0, "ProcessGroup: the timeout must be positive, got ",
              options.timeout().count(), " ms");
  TORCH_CHECK(world.master_port >= 0 && world.master_port <= 65535, "ProcessGroup: master_port ",
              world.master_port, " is not a port (0..65535)");
  TORCH_CHECK(world.world_size == 1 || world.master_port != 0,
              "ProcessGroup: a job of ", world.world_size,
              " processes needs a master_port (MASTER_PORT) other than 0");
  check_backend(options.backend());
  impl_->world = world;
  impl_->options = options;
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(world.master_port);
  store_options.isServer = world.rank == 0;
  store_options.numWorkers = static_cast<std::size_t>(world.world_size);
  store_options.waitWorkers = true;
  store_options.timeout = options.timeout();
  StderrHeld c10d_log;
  try {
    impl_->store = c10::make_intrusive<c10d::TCPStore>(world.master_addr, store_options);
    c10d_log.release(/*drop=*/false);
  } catch (const std::exception& e) {
    const std::string what = first_line(e);
    std::string lower = what;  // 1.13 says "Address already in use", 2.x "EADDRINUSE ... address already in use"
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    c10d_log.release(/*drop=*/true);  // c10d's lines tell the failure that the line below states
    TORCH_CHECK(lower.find("address already in use") == std::string::npos, "rank ", world.rank, " of ",
                world.world_size, ": port ", world.master_port, " of ", world.master_addr,
                " is in use by another process: choose a free port (WorldInfo::master_port, MASTER_PORT)");
    TORCH_CHECK(false, "rank ", world.rank, " of ", world.world_size, ": could not meet the others at ",
                world.master_addr, ":", world.master_port, " within ", options.timeout().count(),
                " ms (is rank 0 running, and MASTER_ADDR/MASTER_PORT the same everywhere?): ", what);
  }
  impl_->world.master_port = impl_->store->getPort();
  try {
    if (options.backend() == ProcessGroupBackend::kNccl) {
      join_nccl(*impl_);
    } else {
      join_gloo(*impl_);
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", world.rank, " of ", world.world_size, ": the ",
                options.backend() == ProcessGroupBackend::kNccl ? "NCCL" : "Gloo",
                " process group could not connect all ranks within ", options.timeout().count(), " ms: ",
                first_line(e));
  }
}

ProcessGroup::~ProcessGroup() = default;
ProcessGroup::ProcessGroup(ProcessGroup&&) noexcept = default;
ProcessGroup& ProcessGroup::operator=(ProcessGroup&&) noexcept = default;

int64_t ProcessGroup::rank() const { return impl_->world.rank; }
int64_t ProcessGroup::size() const { return impl_->world.world_size; }
const ProcessGroupOptions& ProcessGroup::options() const { return impl_->options; }
torch::Device ProcessGroup::device() const { return impl_->device; }


void ProcessGroup::all_reduce_(torch::Tensor& tensor) {
  impl_->count(tensor);
  staged(*impl_, tensor, [&](torch::Tensor& t) {
    std::vector<torch::Tensor> v{t};
    wait_for(impl_->backend->allreduce(v), "all-reduce", *impl_);
  });
}

void ProcessGroup::all_reduce_max_(torch::Tensor& tensor) {
  impl_->count(tensor);
  staged(*impl_, tensor, [&](torch::Tensor& t) {
    std::vector<torch::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    wait_for(impl_->backend->allreduce(v, o), "all-reduce (max)", *impl_);
  });
}

void ProcessGroup::broadcast_(torch::Tensor& tensor, int64_t root) {
  TORCH_CHECK(root >= 0 && root < size(), "broadcast_: root ", root, " is not a rank in [0, ", size(), ")");
  impl_->count(tensor);
  staged(*impl_, tensor, [&](torch::Tensor& t) {
    std::vector<torch::Tensor> v{t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    wait_for(impl_->backend->broadcast(v, o), "broadcast", *impl_);
  });
}

void ProcessGroup::barrier() {
  wait_for(impl_->backend->barrier(), "barrier", *impl_);
}

int64_t ProcessGroup::payload_bytes() const { return impl_->payload; }

int64_t ProcessGroup::operations() const { return impl_->operations; }

std::vector<torch::Tensor> ProcessGroup::gather(const torch::Tensor& tensor, int64_t root) {
  TORCH_CHECK(root >= 0 && root < size(), "gather: root ", root, " is not a rank in [0, ", size(), ")");
  TORCH_CHECK(tensor.dim() == 1 && tensor.device().is_cpu(), "gather needs a 1-D host tensor, got ",
              tensor.dim(), "-D on ", tensor.device());
  // Each rank's length, then its elements, broadcast from it; Gloo's gather
  // would need equal lengths. (Only the root keeps them.)
  UntrackedGuard host;
  std::vector<torch::Tensor> out;
  for (int64_t r = 0; r < size(); ++r) {
    auto length = torch::tensor({r == rank() ? tensor.numel() : int64_t(0)});
    broadcast_(length, r);
    torch::Tensor data = r == rank() ? tensor.contiguous().clone() : torch::empty({length.item<int64_t>()}, tensor.options());
    broadcast_(data, r);
    if (rank() == root) out.push_back(std::move(data));
  }
  return out;
}

ProcessGroup::Pending ProcessGroup::all_reduce_async_(torch::Tensor& tensor) {
  check_on_device(*impl_, tensor, "all_reduce_async_");
  impl_->count(tensor);
  std::vector<torch::Tensor> v{tensor};
  Pending p;
  p.work_ = std::make_unique<Pending::Work>();
  p.work_->work = impl_->backend->allreduce(v);
  p.work_->what = "all-reduce";
  return p;
}

ProcessGroup::Pending ProcessGroup::send(const torch::Tensor& tensor, int64_t dst, int64_t tag) {
  TORCH_CHECK(dst >= 0 && dst < size() && dst != rank(), "send: rank ", dst, " is not another rank of [0, ",
              size(), ")");
  check_on_device(*impl_, tensor, "send");
  impl_->count(tensor);
  std::vector<torch::Tensor> v{tensor};
  Pending p;
  p.work_ = std::make_unique<Pending::Work>();
  p.work_->work = impl_->backend->send(v, static_cast<int>(dst), static_cast<int>(tag));
  p.work_->what = fmt::format("rank {} of {}: send to rank {}", rank(), size(), dst);
  p.work_->timeout = impl_->options.timeout();
  p.work_->keep = tensor;
  return p;
}

void ProcessGroup::recv_(torch::Tensor& tensor, int64_t src, int64_t tag) {
  TORCH_CHECK(src >= 0 && src < size() && src != rank(), "recv_: rank ", src, " is not another rank of [0, ",
              size(), ")");
  check_on_device(*impl_, tensor, "recv_");
  impl_->count(tensor);
  std::vector<torch::Tensor> v{tensor};
  auto work = impl_->backend->recv(v, static_cast<int>(src), static_cast<int>(tag));
  try {
    work->wait(impl_->options.timeout());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", rank(), " of ", size(), ": receiving from rank ", src,
                " failed (it died, or sent nothing within the ", impl_->options.timeout().count(),
                " ms timeout): ", e.what());
  }
}

ProcessGroup::Pending::Pending() = default;
ProcessGroup::Pending::~Pending() = default;
ProcessGroup::Pending::Pending(Pending&&) noexcept = default;
ProcessGroup::Pending& ProcessGroup::Pending::operator=(Pending&&) noexcept = default;

void ProcessGroup::Pending::wait() {
  TORCH_CHECK(work_ != nullptr, "ProcessGroup::Pending::wait: nothing in flight");
  try {
    if (work_->timeout.count() > 0) {
      work_->work->wait(work_->timeout);
    } else {
      work_->work->wait();
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, work_->what, " failed (another rank died, hung past the timeout, or called a "
                "different operation): ", e.what());
  }
  work_.reset();
}

#else  // no c10d Gloo in this LibTorch

namespace detail {
struct ProcessGroupImpl {};
} // namespace detail
struct ProcessGroup::Pending::Work {};

ProcessGroup::ProcessGroup(const WorldInfo&, ProcessGroupOptions) {
  TORCH_CHECK(false, "this memfit was built against a LibTorch without c10d's Gloo process group "
                     "(torch/csrc/distributed/c10d/ProcessGroupGloo.hpp and gloo's headers): install "
                     "libgloo-dev and rebuild");
}
ProcessGroup::~ProcessGroup() = default;
ProcessGroup::ProcessGroup(ProcessGroup&&) noexcept = default;
ProcessGroup& ProcessGroup::operator=(ProcessGroup&&) noexcept = default;
int64_t ProcessGroup::rank() const { return 0; }
int64_t ProcessGroup::size() const { return 1; }
const ProcessGroupOptions& ProcessGroup::options() const {
  static const ProcessGroupOptions o;
  return o;
}
torch::Device ProcessGroup::device() const { return torch::kCPU; }
void ProcessGroup::all_reduce_(torch::Tensor&) {}
void ProcessGroup::all_reduce_max_(torch::Tensor&) {}
void ProcessGroup::broadcast_(torch::Tensor&, int64_t) {}
void ProcessGroup::barrier() {}
std::vector<torch::Tensor> ProcessGroup::gather(const torch::Tensor&, int64_t) { return {}; }
int64_t ProcessGroup::payload_bytes() const { return 0; }
int64_t ProcessGroup::operations() const { return 0; }
ProcessGroup::Pending ProcessGroup::all_reduce_async_(torch::Tensor&) { return Pending(); }
ProcessGroup::Pending ProcessGroup::send(const torch::Tensor&, int64_t, int64_t) { return Pending(); }
void ProcessGroup::recv_(torch::Tensor&, int64_t, int64_t) {}
ProcessGroup::Pending::Pending() = default;
ProcessGroup::Pending::~Pending() = default;
ProcessGroup::Pending::Pending(Pending&&) noexcept = default;
ProcessGroup::Pending& ProcessGroup::Pending::operator=(Pending&&) noexcept = default;
void ProcessGroup::Pending::wait() {}

#endif

namespace detail {
std::string broadcast_text(ProcessGroup& group, const std::string& text, int64_t root) {
  UntrackedGuard host;  // a few KiB of host memory, outside the budget
  auto size = torch::tensor({static_cast<int64_t>(text.size())}, torch::kLong);
  group.broadcast_(size, root);
  auto bytes = torch::zeros({size.item<int64_t>()}, torch::kUInt8);
  if (group.rank() == root) std::memcpy(bytes.data_ptr<uint8_t>(), text.data(), text.size());
  group.broadcast_(bytes, root);
  return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<size_t>(bytes.numel()));
}
} // namespace detail

} // namespace memfit
