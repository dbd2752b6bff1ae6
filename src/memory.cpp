#include "memfit/memory.h"

#include "compat.h"
#include "memory_internal.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <torch/optim.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <regex>
#include <unordered_map>
#include <unordered_set>

namespace memfit {
namespace {

// Tracked allocations are laid out exactly as LibTorch's default CPU
// allocator lays them out (posix_memalign to 64 bytes, nothing in front), and
// their sizes are kept in a side table keyed by the data pointer, so the
// DataPtr's context can equal its data pointer, which Allocator::raw_allocate
// asserts (GELU and other kernels use it). A 64-byte header in front of the
// data had cost the ResNet's training step 2-8% on OpenBLAS
// (docs/allocator.md): the layout of large tensors moves their cache sets.
constexpr std::size_t kAlignment = 64;
constexpr std::size_t kShards = 16;  // side-table locks, by data pointer
constexpr int kMaxMeters = 64;
// SetAllocator replaces an allocator of lower or equal priority.
constexpr uint8_t kAllocatorPriority = 1;

struct Record {
  int64_t bytes = 0;
  bool counted = false;  // true when the bytes were added to the counters
};

// The sizes of live tracked allocations, sharded so threads that allocate
// at once rarely wait on one lock. Deliberately leaked, like the counters.
class SideTable {
 public:
  void insert(void* data, Record r) {
    auto& s = shard(data);
    std::lock_guard<std::mutex> lock(s.mutex);
    s.records.emplace(data, r);
  }
  bool counted(const void* data) {
    auto& s = shard(data);
    std::lock_guard<std::mutex> lock(s.mutex);
    const auto it = s.records.find(const_cast<void*>(data));
    return it != s.records.end() && it->second.counted;
  }
  Record erase(void* data) {
    auto& s = shard(data);
    std::lock_guard<std::mutex> lock(s.mutex);
    const auto it = s.records.find(data);
    if (it == s.records.end()) return {};  // not reachable: only tracked data has this deleter
    const Record r = it->second;
    s.records.erase(it);
    return r;
  }

 private:
  struct Shard {
    std::mutex mutex;
    std::unordered_map<void*, Record> records;
  };
  Shard& shard(const void* data) { return shards_[(reinterpret_cast<std::uintptr_t>(data) / kAlignment) % kShards]; }
  Shard shards_[kShards];
};

SideTable& side_table() {
  static SideTable* t = new SideTable();
  return *t;
}

struct Counters {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> budget{0};
  std::atomic<uint64_t> meter_mask{0};
  std::atomic<int64_t> meter_peak[kMaxMeters];
  // Per meter: the most a refused allocation asked for (allocated + request).
  std::atomic<int64_t> meter_refused[kMaxMeters];
};

// Deliberately leaked: tensors may be freed by static destructors after main.
Counters& counters() {
  static Counters* c = new Counters();
  return *c;
}

thread_local int untracked_depth = 0;

// AllocationFault: whether a guard lives, the allocations it has numbered,
// and the one to fail (0: none).
struct Fault {
  std::atomic<bool> active{false};
  std::atomic<int64_t> count{0};
  std::atomic<int64_t> fail_at{0};
  std::atomic<bool> failed{false};
};
Fault& fault() {
  static Fault* f = new Fault();
  return *f;
}

void raise_to(std::atomic<int64_t>& target, int64_t value) {
  int64_t seen = target.load(std::memory_order_relaxed);
  while (value > seen &&
         !target.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

[[noreturn]] void throw_over_budget(int64_t bytes, int64_t budget, int64_t allocated) {
  TORCH_CHECK_WITH(
      OutOfMemoryError, false,
      fmt::format("CPU out of memory under memfit's budget: tried to allocate {}; "
                  "budget {}; {} already allocated; {} free. Lower the batch size "
                  "or raise the budget (set_memory_budget / --budget).",
                  format_bytes(bytes), format_bytes(budget), format_bytes(allocated),
                  format_bytes(std::max<int64_t>(0, budget - allocated))));
}

// Tells the live meters that `n` bytes were refused with `allocated` held.
void note_refusal(int64_t allocated, int64_t n) {
  Counters& c = counters();
  uint64_t mask = c.meter_mask.load(std::memory_order_acquire);
  while (mask != 0) {
    const int slot = __builtin_ctzll(mask);
    raise_to(c.meter_refused[slot], allocated + n);
    mask &= mask - 1;
  }
}

// Adds `n` bytes to the counters or throws without changing them.
void reserve(int64_t n) {
  Counters& c = counters();
  if (fault().active.load(std::memory_order_acquire)) {
    Fault& f = fault();
    const int64_t k = f.count.fetch_add(1, std::memory_order_relaxed) + 1;
    if (k == f.fail_at.load(std::memory_order_relaxed)) {
      f.failed.store(true, std::memory_order_relaxed);
      note_refusal(c.allocated.load(std::memory_order_relaxed), n);
      TORCH_CHECK_WITH(OutOfMemoryError, false,
                       fmt::format("CPU out of memory: allocation {} of {} failed on purpose (memfit::AllocationFault)",
                                   k, format_bytes(n)));
    }
  }
  int64_t now;
  const int64_t budget = c.budget.load(std::memory_order_relaxed);
  if (budget <= 0) {
    now = c.allocated.fetch_add(n, std::memory_order_relaxed) + n;
  } else {
    int64_t cur = c.allocated.load(std::memory_order_relaxed);
    do {
      if (cur + n > budget) {
        note_refusal(cur, n);
        throw_over_budget(n, budget, cur);
      }
    } while (!c.allocated.compare_exchange_weak(cur, cur + n, std::memory_order_relaxed));
    now = cur + n;
  }
  raise_to(c.peak, now);
  uint64_t mask = c.meter_mask.load(std::memory_order_acquire);
  while (mask != 0) {
    const int slot = __builtin_ctzll(mask);
    raise_to(c.meter_peak[slot], now);
    mask &= mask - 1;
  }
}

void tracked_delete(void* data) {
  if (data == nullptr) return;
  const Record r = side_table().erase(data);
  if (r.counted) counters().allocated.fetch_sub(r.bytes, std::memory_order_relaxed);
  std::free(data);
}

struct TrackingAllocator final : public c10::Allocator {
  MEMFIT_ALLOCATOR_METHODS(allocate_impl)
  c10::DataPtr allocate_impl(size_t n) const {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) return {nullptr, nullptr, &tracked_delete, cpu};
    TORCH_CHECK(n <= static_cast<size_t>(std::numeric_limits<int64_t>::max()),
                "memfit: cannot allocate ", n, " bytes");
    const int64_t bytes = static_cast<int64_t>(n);
    const bool counted = untracked_depth == 0;
    if (counted) reserve(bytes);
    void* data = nullptr;
    if (posix_memalign(&data, kAlignment, n) != 0) {
      if (counted) counters().allocated.fetch_sub(bytes, std::memory_order_relaxed);
      TORCH_CHECK_WITH(OutOfMemoryError, false,
                       "CPU out of memory: the system refused ", format_bytes(bytes));
    }
    try {
      side_table().insert(data, Record{bytes, counted});
    } catch (...) {  // the table's own node could not be allocated
      std::free(data);
      if (counted) counters().allocated.fetch_sub(bytes, std::memory_order_relaxed);
      throw;
    }
    return {data, data, &tracked_delete, cpu};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &tracked_delete; }
};

TrackingAllocator* tracking_allocator() {
  static TrackingAllocator* a = new TrackingAllocator();
  return a;
}

void ensure_tracking() {
  static std::once_flag once;
  std::call_once(once, [] { c10::SetCPUAllocator(tracking_allocator(), kAllocatorPriority); });
}

enum class Kind { kCpu, kCuda };

Kind kind_of(const torch::Device& device) {
  if (device.is_cpu()) return Kind::kCpu;
  if (device.is_cuda()) {
    TORCH_CHECK(compat::kBuiltWithCuda, "memfit: device ", device.str(),
                " needs a CUDA build of memfit and LibTorch; this build is CPU-only. "
                "Use torch::kCPU.");
    return Kind::kCuda;
  }
  TORCH_CHECK(false, "memfit: memory accounting supports cpu and cuda devices, got ",
              device.str());
}

#if defined(MEMFIT_WITH_CUDA)
// The device's index, with CUDA and its caching allocator initialized: their
// statistics and memory fraction refuse a device before its first tensor
// ("Invalid device argument: did you call init?").
c10::DeviceIndex cuda_index(const torch::Device& device) {
  const c10::DeviceIndex index = device.has_index() ? device.index() : c10::DeviceIndex(0);
  static std::once_flag once[64];
  TORCH_CHECK(index >= 0 && index < 64, "memfit: CUDA device index ", int(index), " out of range");
  const auto count = static_cast<int64_t>(c10::cuda::device_count());
  TORCH_CHECK(index < count, "memfit: device ", device.str(), " is not here: this build has CUDA, but ",
              count == 0 ? std::string("no CUDA device is visible (no GPU or no driver)")
                         : fmt::format("only {} CUDA device{} are visible", count, count == 1 ? "" : "s"),
              ". Use torch::kCPU", count == 0 ? "" : " or a visible device");
  std::call_once(once[index], [&] {
    at::empty({0}, at::TensorOptions().device(torch::Device(torch::kCUDA, index)));
  });
  return index;
}
std::atomic<int64_t> cuda_budgets[64];
#endif

} // namespace

namespace detail {
void install_tracking_allocator() {
  ensure_tracking();
  c10::SetCPUAllocator(tracking_allocator(), kAllocatorPriority);
}
void install_default_allocator() {
  ensure_tracking();
  c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), kAllocatorPriority);
}
} // namespace detail

int64_t memory_allocated(torch::Device device) {
  if (kind_of(device) == Kind::kCpu) {
    ensure_tracking();
    return counters().allocated.load(std::memory_order_relaxed);
  }
#if defined(MEMFIT_WITH_CUDA)
  return compat::cuda_allocated_bytes(cuda_index(device));
#else
  TORCH_INTERNAL_ASSERT(false);
#endif
}

int64_t max_memory_allocated(torch::Device device) {
  if (kind_of(device) == Kind::kCpu) {
    ensure_tracking();
    return counters().peak.load(std::memory_order_relaxed);
  }
#if defined(MEMFIT_WITH_CUDA)
  return compat::cuda_peak_allocated_bytes(cuda_index(device));
#else
  TORCH_INTERNAL_ASSERT(false);
#endif
}

int64_t max_memory_reserved(torch::Device device) {
  if (kind_of(device) == Kind::kCpu) return max_memory_allocated(device);
#if defined(MEMFIT_WITH_CUDA)
  return compat::cuda_peak_reserved_bytes(cuda_index(device));
#else
  TORCH_INTERNAL_ASSERT(false);
#endif
}

void reset_peak_memory_stats(torch::Device device) {
  if (kind_of(device) == Kind::kCpu) {
    ensure_tracking();
    Counters& c = counters();
    c.peak.store(c.allocated.load(std::memory_order_relaxed), std::memory_order_relaxed);
    return;
  }
#if defined(MEMFIT_WITH_CUDA)
  compat::cuda_reset_peak(cuda_index(device));
#endif
}

void empty_cache(torch::Device device) {
  if (kind_of(device) == Kind::kCpu) {
    ensure_tracking();
    return;
  }
#if defined(MEMFIT_WITH_CUDA)
  compat::cuda_empty_cache();
#endif
}

void set_memory_budget(torch::Device device, int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "memfit: memory budget must be >= 0 bytes (0 removes it), got ",
              bytes);
  if (kind_of(device) == Kind::kCpu) {
    ensure_tracking();
    counters().budget.store(bytes, std::memory_order_relaxed);
    return;
  }
#if defined(MEMFIT_WITH_CUDA)
  const auto index = cuda_index(device);
  const int64_t total = compat::cuda_total_memory(index);
  TORCH_CHECK(bytes <= total, "memfit: budget ", format_bytes(bytes), " exceeds ",
              device.str(), "'s ", format_bytes(total), "; use at most that or 0");
  // The fraction caps reserved bytes: in segments cached whole, free space
  // split between them would fail an allocation that fits the budget, so
  // segments grow by pages instead, unless the user configured the allocator.
  static const bool user_configured =
      std::getenv("PYTORCH_CUDA_ALLOC_CONF") != nullptr || std::getenv("PYTORCH_ALLOC_CONF") != nullptr;
  if (bytes > 0 && !user_configured) {
    static std::once_flag expandable;
    std::call_once(expandable, compat::cuda_use_expandable_segments);
  }
  // Segments cached before (made whole, before the first budget) would count
  // against it though nothing lives in them: they go back to the driver.
  if (bytes > 0) compat::cuda_empty_cache();
  compat::cuda_set_memory_fraction(bytes == 0 ? 1.0 : double(bytes) / double(total), index);
  cuda_budgets[index].store(bytes);
#endif
}

int64_t memory_budget(torch::Device device) {
  if (kind_of(device) == Kind::kCpu) {
    ensure_tracking();
    return counters().budget.load(std::memory_order_relaxed);
  }
#if defined(MEMFIT_WITH_CUDA)
  return cuda_budgets[cuda_index(device)].load();
#else
  TORCH_INTERNAL_ASSERT(false);
#endif
}

int64_t storage_bytes(const std::vector<torch::Tensor>& tensors) {
  std::unordered_set<const void*> seen;
  int64_t total = 0;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    const void* key = t.storage().unsafeGetStorageImpl();
    if (seen.insert(key).second) total += static_cast<int64_t>(t.storage().nbytes());
  }
  return total;
}

torch::Tensor to_device(const torch::Tensor& tensor, const torch::Device& device) {
  if (!tensor.defined()) return tensor;
  if (kind_of(device) == Kind::kCuda) {
    return tensor.to(device, /*non_blocking=*/tensor.is_pinned());
  }
  ensure_tracking();
  if (!tensor.device().is_cpu()) return tensor.to(device);
  const bool on_device = tensor.has_storage() && side_table().counted(tensor.storage().data());
  return on_device ? tensor : tensor.clone();
}

AllocationFault::AllocationFault(int64_t fail_at) {
  TORCH_CHECK(fail_at >= 0, "AllocationFault: fail_at must be >= 0 (0: count only), got ", fail_at);
  ensure_tracking();
  Fault& f = fault();
  TORCH_CHECK(!f.active.load(), "AllocationFault: another guard is live; guards do not nest");
  f.count.store(0);
  f.fail_at.store(fail_at);
  f.failed.store(false);
  f.active.store(true, std::memory_order_release);
}

AllocationFault::~AllocationFault() { fault().active.store(false, std::memory_order_release); }

int64_t AllocationFault::allocations() const { return fault().count.load(); }

bool AllocationFault::failed() const { return fault().failed.load(); }

UntrackedGuard::UntrackedGuard() {
  ensure_tracking();
  ++untracked_depth;
}
UntrackedGuard::~UntrackedGuard() { --untracked_depth; }

PeakMeter::PeakMeter(torch::Device device) : device_(device) {
  if (kind_of(device) == Kind::kCuda) {
    reset_peak_memory_stats(device);
    start_ = memory_allocated(device);
    return;
  }
  ensure_tracking();
  Counters& c = counters();
  uint64_t mask = c.meter_mask.load(std::memory_order_relaxed);
  int slot;
  do {
    TORCH_CHECK(~mask != 0, "memfit: at most ", kMaxMeters,
                " PeakMeters may be live at once; end some meters first");
    slot = __builtin_ctzll(~mask);
  } while (!c.meter_mask.compare_exchange_weak(mask, mask | (uint64_t{1} << slot),
                                               std::memory_order_acq_rel));
  // The slot is visible to the allocator now; start it at the current count.
  c.meter_peak[slot].store(std::numeric_limits<int64_t>::min(), std::memory_order_relaxed);
  c.meter_refused[slot].store(0, std::memory_order_relaxed);
  start_ = c.allocated.load(std::memory_order_relaxed);
  raise_to(c.meter_peak[slot], start_);
  slot_ = slot;
}

PeakMeter::~PeakMeter() {
  if (slot_ >= 0) {
    counters().meter_mask.fetch_and(~(uint64_t{1} << slot_), std::memory_order_acq_rel);
  }
}

PeakMeter::PeakMeter(PeakMeter&& other) noexcept
    : device_(other.device_), slot_(other.slot_), start_(other.start_) {
  other.slot_ = -1;
}

PeakMeter& PeakMeter::operator=(PeakMeter&& other) noexcept {
  if (this != &other) {
    if (slot_ >= 0) {
      counters().meter_mask.fetch_and(~(uint64_t{1} << slot_), std::memory_order_acq_rel);
    }
    device_ = other.device_;
    slot_ = other.slot_;
    start_ = other.start_;
    other.slot_ = -1;
  }
  return *this;
}

int64_t PeakMeter::peak() const {
  if (slot_ < 0) return max_memory_allocated(device_);
  return counters().meter_peak[slot_].load(std::memory_order_relaxed);
}

void release_failed_backward() {
  // LibTorch's engine keeps the calling thread's CPU ready queue between
  // backward calls, and a backward that threw leaves its pending tasks in
  // it, each holding its node and so the rest of the graph with its saved
  // activations (pytorch/pytorch#82218), until the thread's next backward
  // pops them: expired tasks go first. A backward of one host scalar does.
  UntrackedGuard host;
  torch::AutoGradMode grad(true);
  auto x = torch::zeros({}, torch::requires_grad());
  (x * 2).backward();
}

int64_t PeakMeter::needed() const {
  if (slot_ < 0) return peak();
  return std::max(peak(), counters().meter_refused[slot_].load(std::memory_order_relaxed));
}

namespace detail {
int64_t refused_request_bytes(const std::string& what) {
  // CUDA's caching allocator: "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; ...)".
  static const std::regex request(R"([Tt]ried to allocate ([0-9.]+) ?([KMGT]i?B|bytes|B))");
  std::smatch m;
  if (!std::regex_search(what, m, request)) return 0;
  try {
    return parse_memory_size(m[1].str() + (m[2].str() == "bytes" ? "B" : m[2].str()));
  } catch (const c10::Error&) {
    return 0;
  }
}

int64_t needed_bytes(const PeakMeter& meter, const std::string& what) {
  if (kind_of(meter.device()) != Kind::kCuda) return meter.needed();
  return meter.peak() + refused_request_bytes(what);
}

void for_each_state_tensor(torch::optim::OptimizerParamState& state,
                           const std::function<void(torch::Tensor&)>& fn) {
  using namespace torch::optim;
  auto each = [&](std::initializer_list<torch::Tensor*> ts) {
    for (auto* t : ts) {
      if (t->defined()) fn(*t);
    }
  };
  if (auto* s = dynamic_cast<AdamParamState*>(&state)) {
    each({&s->exp_avg(), &s->exp_avg_sq(), &s->max_exp_avg_sq()});
  } else if (auto* s = dynamic_cast<AdamWParamState*>(&state)) {
    each({&s->exp_avg(), &s->exp_avg_sq(), &s->max_exp_avg_sq()});
  } else if (auto* s = dynamic_cast<SGDParamState*>(&state)) {
    each({&s->momentum_buffer()});
  } else if (auto* s = dynamic_cast<AdagradParamState*>(&state)) {
    each({&s->sum()});
  } else if (auto* s = dynamic_cast<RMSpropParamState*>(&state)) {
    each({&s->square_avg(), &s->momentum_buffer(), &s->grad_avg()});
  } else if (auto* s = dynamic_cast<LBFGSParamState*>(&state)) {
    each({&s->d(), &s->H_diag(), &s->prev_flat_grad()});
    for (auto* q : {&s->old_dirs(), &s->old_stps(), &s->ro()}) {
      for (auto& t : *q) each({&t});
    }
    if (s->al()) {
      for (auto& t : *s->al()) each({&t});
    }
  }
}
} // namespace detail

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> tensors;
  for (const auto& kv : optimizer.state()) {
    detail::for_each_state_tensor(*kv.second, [&](torch::Tensor& t) { tensors.push_back(t); });
  }
  return storage_bytes(tensors);
}

StepMemory breakdown_step(int64_t peak, const std::vector<torch::Tensor>& parameters,
                          const std::vector<torch::Tensor>& buffers,
                          const torch::optim::Optimizer& optimizer) {
  StepMemory m;
  m.peak = peak;
  std::vector<torch::Tensor> persistent = parameters;
  persistent.insert(persistent.end(), buffers.begin(), buffers.end());
  m.parameters = storage_bytes(persistent);
  std::vector<torch::Tensor> grads;
  grads.reserve(parameters.size());
  for (const auto& p : parameters) grads.push_back(p.grad());
  m.gradients = storage_bytes(grads);
  m.optimizer_state = optimizer_state_bytes(optimizer);
  m.activations = std::max<int64_t>(0, peak - m.parameters - m.gradients - m.optimizer_state);
  return m;
}

std::string StepMemory::table() const {
  auto row = [&](const char* name, int64_t bytes) {
    const double share = peak > 0 ? 100.0 * double(bytes) / double(peak) : 0.0;
    return fmt::format("{:<24}{:>14}{:>8.1f}%\n", name, format_bytes(bytes), share);
  };
  std::string out = fmt::format("{:<24}{:>14}{:>9}\n", "category", "bytes", "share");
  out += row("parameters", parameters);
  out += row("gradients", gradients);
  out += row("optimizer state", optimizer_state);
  out += row("activations/temporaries", activations);
  out += row("peak", peak);
  return out;
}

std::string StepMemory::to_json() const {
  nlohmann::json j = {{"peak", peak},
                      {"parameters", parameters},
                      {"gradients", gradients},
                      {"optimizer_state", optimizer_state},
                      {"activations", activations}};
  return j.dump();
}

int64_t parse_memory_size(const std::string& text) {
  static const std::regex pattern(R"(^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$)");
  const auto fail = [&]() {
    TORCH_CHECK(false, "invalid memory size '", text,
                "': expected a non-negative number with an optional unit B, KB, MB, GB, TB "
                "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 512MiB, 2GiB, "
                "1.5GB or 1048576");
  };
  std::smatch m;
  if (!std::regex_match(text, m, pattern)) fail();
  std::string unit = m[2].str();
  for (auto& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  double scale = 0;
  const std::pair<const char*, double> units[] = {
      {"", 1},         {"b", 1},           {"kb", 1e3},         {"mb", 1e6},
      {"gb", 1e9},     {"tb", 1e12},       {"k", 1024.0},       {"kib", 1024.0},
      {"m", 1048576.0}, {"mib", 1048576.0}, {"g", 1073741824.0}, {"gib", 1073741824.0},
      {"t", 1099511627776.0}, {"tib", 1099511627776.0}};
  for (const auto& u : units) {
    if (unit == u.first) scale = u.second;
  }
  if (scale == 0) fail();
  const long double bytes = std::stold(m[1].str()) * static_cast<long double>(scale);
  if (!(bytes < 9223372036854775807.0L)) fail();
  return static_cast<int64_t>(std::floor(bytes));
}

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  const double a = std::fabs(b);
  if (a < 1024.0) return fmt::format("{} bytes", bytes);
  if (a < 1048576.0) return fmt::format("{:.2f} KiB", b / 1024.0);
  if (a < 1073741824.0) return fmt::format("{:.2f} MiB", b / 1048576.0);
  return fmt::format("{:.2f} GiB", b / 1073741824.0);
}

} // namespace memfit
