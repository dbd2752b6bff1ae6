#include "memfit/state.h"

#include "memfit/memory.h"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <fmt/format.h>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

namespace memfit {
namespace {

namespace fs = std::filesystem;

// Parameters, then buffers, by qualified name (a parameter's stand-in in its place).
std::vector<std::pair<std::string, torch::Tensor>> module_tensors(const torch::nn::Module& module,
                                                                  const detail::StandIn& stand_in = nullptr) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const torch::Tensor other = stand_in ? stand_in(item.value()) : torch::Tensor();
    out.emplace_back(item.key(), other.defined() ? other : item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    out.emplace_back(item.key(), item.value());
  }
  return out;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);) out.push_back(line);
  return out;
}

std::string describe(const torch::Tensor& t) {
  std::ostringstream os;
  os << t.sizes() << " " << t.scalar_type();
  return os.str();
}

void write_all(int fd, const std::string& bytes, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "cannot write ", path, ": ", std::strerror(errno),
                " (is the disk full?); the previous file is intact");
    done += static_cast<size_t>(n);
  }
}

// The file a write to `path` replaces: `path`, or the end of its chain of
// symbolic links (a write goes through a link and keeps it).
fs::path write_target(const std::string& path) {
  TORCH_CHECK(!path.empty(), "cannot write to an empty path: give the name of a file");
  fs::path p(path);
  for (int hops = 0; hops < 40; ++hops) {
    std::error_code ec;
    if (fs::symlink_status(p, ec).type() != fs::file_type::symlink) return p;
    const fs::path next = fs::read_symlink(p, ec);
    TORCH_CHECK(!ec, "cannot write ", path, ": cannot read the symbolic link ", p.string(), ": ", ec.message());
    p = next.is_absolute() ? next : p.parent_path() / next;
  }
  TORCH_CHECK(false, "cannot write ", path, ": too many levels of symbolic links");
}

const char* file_kind(fs::file_type type) {
  switch (type) {
    case fs::file_type::directory: return "a directory";
    case fs::file_type::character: return "a character device";
    case fs::file_type::block: return "a block device";
    case fs::file_type::fifo: return "a FIFO";
    case fs::file_type::socket: return "a socket";
    case fs::file_type::regular: return "a regular file";
    default: return "not a regular file";
  }
}

fs::path folder_of(const fs::path& file) { return file.has_parent_path() ? file.parent_path() : fs::path("."); }

// Checks that `folder` is a directory this process may create files in.
void check_writable_folder(const fs::path& folder, const std::string& what) {
  std::error_code ec;
  const auto type = fs::status(folder, ec).type();
  TORCH_CHECK(type != fs::file_type::not_found, "cannot write ", what, ": the folder ", folder.string(),
              " does not exist; create it, or choose a path in an existing folder");
  TORCH_CHECK(type == fs::file_type::directory, "cannot write ", what, ": ", folder.string(), " is ",
              file_kind(type), ", not a folder");
  TORCH_CHECK(::access(folder.c_str(), W_OK | X_OK) == 0, "cannot write ", what, ": the folder ",
              folder.string(), " is not writable (", std::strerror(errno), ")");
}

// Checks the file a write to `path` replaces, and returns it.
fs::path checked_target(const std::string& path) {
  const fs::path target = write_target(path);
  std::error_code ec;
  const auto type = fs::status(target, ec).type();
  TORCH_CHECK(type == fs::file_type::not_found || type == fs::file_type::regular, "cannot write ", path, ": ",
              target.string() == path ? "it" : target.string() + ", where the link points,", " is ",
              file_kind(type), ", and memfit replaces only regular files; give the path of a file");
  check_writable_folder(folder_of(target), path);
  return target;
}

// Removes `target.tmp.PID` files beside `target` whose writer no longer runs
// (POSIX calls, as in data.cpp: a LibTorch 2.x build may bind std::filesystem's
// directory iteration to libtorch.so's own copy).
void remove_stale_temporaries(const fs::path& target) {
  const std::string prefix = target.filename().string() + ".tmp.";
  DIR* d = ::opendir(folder_of(target).c_str());
  if (d == nullptr) return;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string digits = name.substr(prefix.size());
    if (digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    if (pid != ::getpid() && ::kill(pid, 0) != 0 && errno == ESRCH) {
      ::unlink((folder_of(target) / name).c_str());
    }
  }
  ::closedir(d);
}

// A sealed archive ends with its zip end-of-central-directory record (22
// bytes, the last 2 the comment's length) and this comment: the CRC-32 of
// every byte before the comment's length, in hex.
constexpr char kSealPrefix[] = "memfit-crc32:";
constexpr size_t kSealSize = sizeof(kSealPrefix) - 1 + 8;
constexpr size_t kEndRecord = 22;

uint32_t crc32_of(uint32_t crc, const char* data, size_t n) {
  while (n > 0) {  // zlib takes 32-bit lengths
    const auto chunk = static_cast<uInt>(std::min<size_t>(n, size_t{1} << 30));
    crc = static_cast<uint32_t>(::crc32(crc, reinterpret_cast<const Bytef*>(data), chunk));
    data += chunk;
    n -= chunk;
  }
  return crc;
}

// The seal's CRC when `tail` (the file's last kEndRecord + kSealSize bytes)
// ends with one; nullopt otherwise. The end record itself is not read: the
// CRC covers it, so damage there is found like damage anywhere else.
std::optional<uint32_t> seal_in(const std::string& tail) {
  if (tail.size() != kEndRecord + kSealSize) return std::nullopt;
  const std::string comment = tail.substr(kEndRecord);
  if (comment.compare(0, sizeof(kSealPrefix) - 1, kSealPrefix) != 0) return std::nullopt;
  const std::string hex = comment.substr(sizeof(kSealPrefix) - 1);
  if (hex.find_first_not_of("0123456789abcdef") != std::string::npos) return std::nullopt;
  return static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
}

void check_crc(uint32_t expected, uint32_t actual, const std::string& what) {
  TORCH_CHECK(expected == actual, what, " is damaged: its bytes have CRC-32 ", fmt::format("{:08x}", actual),
              ", but it was sealed with ", fmt::format("{:08x}", expected),
              " when written; restore it from a copy, or start over without it");
}

// Checks an in-memory archive's seal; false when it has none.
bool check_seal_of(const char* data, size_t size, const std::string& what) {
  if (size < kEndRecord + kSealSize) return false;
  const auto seal = seal_in(std::string(data + size - kEndRecord - kSealSize, kEndRecord + kSealSize));
  if (!seal) return false;
  check_crc(*seal, crc32_of(0, data, size - kSealSize - 2), what);
  return true;
}

// A sealed archive says so inside too: one whose seal was cut off is damaged.
void check_sealed(torch::serialize::InputArchive& archive, bool sealed, const std::string& what) {
  c10::IValue says;
  TORCH_CHECK(sealed || !archive.try_read("sealed", says), what,
              " is damaged: it was sealed with a checksum when written, and the checksum is gone; "
              "restore it from a copy, or start over without it");
}

std::string host_name() {
  char name[256] = {};
  return ::gethostname(name, sizeof(name) - 1) == 0 ? std::string(name) : std::string("this machine");
}

} // namespace

FolderLock::FolderLock(const std::string& dir, const std::string& what) {
  TORCH_CHECK(!dir.empty(), what, " is an empty folder name: give a folder");
  std::error_code ec;
  fs::create_directories(dir, ec);
  TORCH_CHECK(fs::is_directory(dir), "cannot create ", what, " ", dir, ": ", ec ? ec.message() : "not a folder");
  const std::string path = (fs::path(dir) / ".memfit.lock").string();
  // A holder removes the file while it holds the lock: a lock taken on a
  // file that is no longer the folder's is taken again on the new one.
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    TORCH_CHECK(fd >= 0, "cannot hold ", what, " ", dir, ": cannot open ", path, ": ", std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      std::string holder;
      char buf[512];
      const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
      if (n > 0) holder.assign(buf, static_cast<size_t>(n));
      while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
      ::close(fd);
      TORCH_CHECK(err != EWOULDBLOCK, what, " ", dir, " is in use by another run (",
                  holder.empty() ? std::string("starting") : holder,
                  "), and one folder takes one run's files: wait for that run to end, or save to another folder");
      TORCH_CHECK(false, "cannot hold ", what, " ", dir, ": flock on ", path, " failed: ", std::strerror(err));
    }
    struct stat held {}, named {};
    if (::fstat(fd, &held) == 0 && ::stat(path.c_str(), &named) == 0 && held.st_ino == named.st_ino &&
        held.st_dev == named.st_dev) {
      const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
      std::tm utc{};
      ::gmtime_r(&now, &utc);
      char when[32];
      std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S UTC", &utc);
      const std::string text = fmt::format("memfit pid {} on {}, since {}\n", ::getpid(), host_name(), when);
      if (::ftruncate(fd, 0) == 0) write_all(fd, text, path);
      fd_ = fd;
      path_ = path;
      return;
    }
    ::close(fd);  // the holder we waited for removed it: take the new one
  }
  TORCH_CHECK(false, "cannot hold ", what, " ", dir, ": its lock file ", path, " kept changing");
}

FolderLock::FolderLock(FolderLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

FolderLock& FolderLock::operator=(FolderLock&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

FolderLock::~FolderLock() { release(); }

void FolderLock::release() noexcept {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());  // while holding it: a waiter that opened it retries
  ::close(fd_);
  fd_ = -1;
}

void check_output_file(const std::string& path) { checked_target(path); }

void check_output_folder(const std::string& dir) {
  TORCH_CHECK(!dir.empty(), "cannot write to an empty folder name: give a folder");
  fs::path p(dir);
  std::error_code ec;
  const auto type = fs::status(p, ec).type();
  if (type != fs::file_type::not_found) {
    check_writable_folder(p, dir);
    return;
  }
  while (p.has_parent_path() && p.parent_path() != p && fs::status(p.parent_path(), ec).type() == fs::file_type::not_found) {
    p = p.parent_path();
  }
  check_writable_folder(folder_of(p), dir);
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  const fs::path target = checked_target(path);
  const fs::path folder = folder_of(target);
  remove_stale_temporaries(target);
  const std::string tmp = target.string() + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "cannot write ", path, ": ", std::strerror(errno),
              " (is the folder ", folder.string(), " writable?)");
  try {
    write_all(fd, bytes, path);
    TORCH_CHECK(::fsync(fd) == 0, "cannot flush ", tmp, " to disk: ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "cannot rename ", tmp, " to ", path, ": ", std::strerror(err));
  }
  const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);  // makes the rename durable; best effort on file systems without it
    ::close(dir);
  }
}

namespace detail {

void write_module(torch::serialize::OutputArchive& archive, const torch::nn::Module& module,
                  const StandIn& stand_in) {
  const auto tensors = module_tensors(module, stand_in);
  std::string names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    names += tensors[i].first + "\n";
    archive.write(fmt::format("t{}", i), tensors[i].second.detach());
  }
  archive.write("names", c10::IValue(names));
}

void check_module(torch::serialize::InputArchive& archive, const torch::nn::Module& module,
                  const std::string& what, const StandIn& stand_in) {
  c10::IValue names_value;
  TORCH_CHECK(archive.try_read("names", names_value) && names_value.isString(), what,
              " holds no model tensors: it was not written by memfit");
  const auto names = split_lines(names_value.toStringRef());
  const auto tensors = module_tensors(module, stand_in);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, tensor] = tensors[i];
    TORCH_CHECK(i < names.size(), what, " does not match the model: the model's tensor '", name,
                "' ", describe(tensor), " is not in the checkpoint (it holds ", names.size(),
                " tensors, the model ", tensors.size(), "); load it into the model that saved it");
    torch::Tensor saved;
    TORCH_CHECK(archive.try_read(fmt::format("t{}", i), saved), what, " is damaged: tensor '",
                names[i], "' is missing");
    TORCH_CHECK(names[i] == name, what, " does not match the model: tensor ", i, " is '",
                names[i], "' in the checkpoint but '", name,
                "' in the model; load it into the model that saved it");
    TORCH_CHECK(saved.sizes() == tensor.sizes() && saved.scalar_type() == tensor.scalar_type(),
                what, " does not match the model: tensor '", name, "' is ", describe(saved),
                " in the checkpoint but ", describe(tensor),
                " in the model; use the same model options (and precision) as the saved run");
  }
  TORCH_CHECK(names.size() == tensors.size(), what,
              " does not match the model: the checkpoint's tensor '", names[tensors.size()],
              "' is not in the model; load it into the model that saved it");
}

void copy_into_module(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                      const StandIn& stand_in) {
  torch::NoGradGuard no_grad;
  const auto tensors = module_tensors(module, stand_in);
  for (size_t i = 0; i < tensors.size(); ++i) {
    torch::Tensor saved;
    archive.try_read(fmt::format("t{}", i), saved);
    auto dst = tensors[i].second;
    dst.copy_(saved);  // into the tensor's own storage, on its device
  }
}

torch::serialize::InputArchive read_archive(const std::string& path) {
  TORCH_CHECK(fs::is_regular_file(path), "no checkpoint file at ", path,
              ": give the folder or file that a save wrote");
  const bool sealed = check_seal(path);  // before LibTorch reads a byte of it
  torch::serialize::InputArchive archive;
  UntrackedGuard host;  // the whole file lands in host memory, not on the device
  try {
    archive.load_from(path, torch::Device(torch::kCPU));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "cannot read checkpoint ", path, ": ", e.what_without_backtrace());
  }
  check_sealed(archive, sealed, path);
  return archive;
}

std::string archive_bytes(torch::serialize::OutputArchive& archive) {
  archive.write("sealed", c10::IValue(true));
  std::string bytes;
  archive.save_to([&bytes](const void* data, size_t n) {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  // LibTorch's zip ends with an end record without a comment; the seal is one.
  TORCH_INTERNAL_ASSERT(bytes.size() >= kEndRecord && bytes.compare(bytes.size() - kEndRecord, 4, "PK\x05\x06") == 0 &&
                            bytes[bytes.size() - 2] == 0 && bytes[bytes.size() - 1] == 0,
                        "LibTorch's archive does not end with a zip end record without a comment");
  const uint32_t crc = crc32_of(0, bytes.data(), bytes.size() - 2);
  bytes[bytes.size() - 2] = static_cast<char>(kSealSize);
  bytes[bytes.size() - 1] = 0;
  bytes += fmt::format("{}{:08x}", kSealPrefix, crc);
  return bytes;
}

bool check_seal(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "cannot read ", path, ": ", std::strerror(errno));
  in.seekg(0, std::ios::end);
  const auto size = static_cast<size_t>(in.tellg());
  if (size < kEndRecord + kSealSize) return false;
  std::string tail(kEndRecord + kSealSize, '\0');
  in.seekg(static_cast<std::streamoff>(size - tail.size()));
  in.read(tail.data(), static_cast<std::streamsize>(tail.size()));
  const auto seal = seal_in(tail);
  if (!seal) return false;
  in.seekg(0);
  std::vector<char> chunk(size_t{1} << 20);
  uint32_t crc = 0;
  for (size_t left = size - kSealSize - 2; left > 0;) {
    const size_t n = std::min(left, chunk.size());
    TORCH_CHECK(in.read(chunk.data(), static_cast<std::streamsize>(n)), "cannot read ", path, ": it ended early");
    crc = crc32_of(crc, chunk.data(), n);
    left -= n;
  }
  check_crc(*seal, crc, path);
  return true;
}

torch::Tensor bytes_tensor(const std::string& bytes) {
  UntrackedGuard host;
  auto t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

void load_archive(torch::serialize::InputArchive& archive, const torch::Tensor& bytes, const std::string& what) {
  UntrackedGuard host;
  const auto* data = static_cast<const char*>(bytes.data_ptr());
  const auto size = static_cast<size_t>(bytes.numel());
  const bool sealed = check_seal_of(data, size, what);
  try {
    archive.load_from(data, size, torch::Device(torch::kCPU));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, what, " cannot be read: ", e.what_without_backtrace());
  }
  check_sealed(archive, sealed, what);
}

} // namespace detail

void save_module(const torch::nn::Module& module, const std::string& path) {
  torch::serialize::OutputArchive archive;
  detail::write_module(archive, module);
  write_file_atomically(path, detail::archive_bytes(archive));
}

void load_module(torch::nn::Module& module, const std::string& path) {
  auto archive = detail::read_archive(path);
  detail::check_module(archive, module, path);
  detail::copy_into_module(archive, module);
}

} // namespace memfit
