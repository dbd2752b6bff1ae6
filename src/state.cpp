#include "memfit/state.h"

#include "memfit/memory.h"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <fmt/format.h>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
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

} // namespace

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
  torch::serialize::InputArchive archive;
  UntrackedGuard host;  // the whole file lands in host memory, not on the device
  try {
    archive.load_from(path, torch::Device(torch::kCPU));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "cannot read checkpoint ", path, ": ", e.what_without_backtrace());
  }
  return archive;
}

std::string archive_bytes(torch::serialize::OutputArchive& archive) {
  std::string bytes;
  archive.save_to([&bytes](const void* data, size_t n) {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  return bytes;
}

torch::Tensor bytes_tensor(const std::string& bytes) {
  UntrackedGuard host;
  auto t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

void load_archive(torch::serialize::InputArchive& archive, const torch::Tensor& bytes, const std::string& what) {
  UntrackedGuard host;
  try {
    archive.load_from(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()),
                      torch::Device(torch::kCPU));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, what, " cannot be read: ", e.what_without_backtrace());
  }
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
