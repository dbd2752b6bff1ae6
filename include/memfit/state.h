#pragma once
/// \file state.h
/// Saving and loading without losing a user's state: atomic writes, and
/// loading through host memory one tensor at a time.
///
/// A save writes a temporary file beside the target, flushes it to disk
/// (fsync), renames it over the target and flushes the folder: a process
/// killed at any moment leaves either the previous file or the new one, never
/// a torn one. A load reads the whole file into host memory (untracked, like
/// a host copy on a GPU machine), checks every tensor's name, shape and dtype
/// against the module before changing anything, then copies the tensors into
/// the module's own storage one by one, so the device never holds two copies
/// of the model. The Trainer's checkpoints (Trainer::save, Trainer::resume)
/// are built from the same pieces.
///
/// Thread safety: functions are reentrant; concurrent saves to one path are
/// not supported. Sync points: each tensor copied to a CUDA device. Extra
/// memory: the file's bytes in host memory while saving or loading.

#include <torch/nn/module.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <functional>
#include <string>

namespace memfit {

/// Writes `bytes` to `path` through a temporary file, fsync and rename.
///
/// What is not a regular file is never replaced: a symbolic link is written
/// through (its target is replaced, the link stays), and a directory, device,
/// FIFO or socket at `path` is refused. Temporary files that an earlier,
/// killed writer left beside the target (`path.tmp.PID` of a process that no
/// longer runs) are removed. Throws c10::Error naming the path when the
/// folder is missing or not writable, or the disk is full; the previous file
/// at `path` is then intact.
///
/// Example:
/// \code
///   memfit::write_file_atomically("/tmp/memfit_example.json", "{}\n");
/// \endcode
void write_file_atomically(const std::string& path, const std::string& bytes);

/// Checks, writing nothing, that write_file_atomically(path, ...) can succeed.
///
/// Throws c10::Error in one line when `path` is empty, names a directory, a
/// device, a FIFO or a socket (directly or through a symbolic link), or lies
/// in a folder that is missing or not writable. Programs call it for every
/// output before any work, so that a run never fails at its end for a path.
///
/// Example:
/// \code
///   memfit::check_output_file("/tmp/memfit_example.json");
/// \endcode
void check_output_file(const std::string& path);

/// Checks, creating nothing, that a folder of outputs can be written at `dir`.
///
/// `dir` may exist (a directory, writable) or not (then its nearest existing
/// ancestor must be a writable directory, where it will be created). Throws
/// c10::Error in one line otherwise.
///
/// Example:
/// \code
///   memfit::check_output_folder("/tmp/memfit_example_run");
/// \endcode
void check_output_folder(const std::string& dir);

/// Holds a folder of outputs for one writer: a run that saves there holds it
/// for its lifetime, and a folder never mixes two runs' files.
///
/// Creates `dir` if needed and takes an exclusive flock(2) on
/// `dir`/.memfit.lock, then writes the holder into it (pid, host, start
/// time). A second FolderLock on the folder, in this process or another,
/// throws c10::Error in one line naming `what`, the folder and the holder.
/// The kernel drops the lock when the holder exits however it ends, so a
/// killed run never leaves the folder held; a release removes the file. Not
/// for network file systems whose flock is local to one machine. Sync points:
/// none. Extra memory: none.
///
/// Example:
/// \code
///   memfit::FolderLock held("/tmp/memfit_example_lock");
///   // memfit::FolderLock("/tmp/memfit_example_lock") throws while `held` lives
/// \endcode
class FolderLock {
 public:
  /// Holds nothing.
  FolderLock() = default;
  /// Holds `dir`; `what` names it in the error (e.g. "TrainerOptions::save_dir").
  explicit FolderLock(const std::string& dir, const std::string& what = "the folder");
  FolderLock(FolderLock&& other) noexcept;
  FolderLock& operator=(FolderLock&& other) noexcept;
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  /// Removes the lock file and drops the lock.
  ~FolderLock();
  /// Whether a folder is held.
  bool held() const { return fd_ >= 0; }

 private:
  void release() noexcept;
  int fd_ = -1;
  std::string path_;
};

/// Saves `module`'s parameters and buffers to `path`, atomically.
///
/// Example:
/// \code
///   auto net = memfit::make_mlp(memfit::ModelOptions().width(8).depth(1));
///   memfit::save_module(*net, "/tmp/memfit_example_mlp.pt");
///   memfit::load_module(*net, "/tmp/memfit_example_mlp.pt");
/// \endcode
void save_module(const torch::nn::Module& module, const std::string& path);

/// Loads what save_module wrote into `module`, through host memory and one
/// tensor at a time (each copied into the module's tensor, on its device).
///
/// Throws c10::Error, changing nothing, when the file is missing or
/// unreadable, or when a tensor does not match: the message names the first
/// tensor whose name, shape or dtype differs.
void load_module(torch::nn::Module& module, const std::string& path);

namespace detail {
/// The tensor that holds a module tensor's values, when another one does (the
/// host master of a streamed parameter, stream.h); undefined: the tensor itself.
using StandIn = std::function<torch::Tensor(const torch::Tensor&)>;
/// Writes `module`'s parameters and buffers into `archive`.
void write_module(torch::serialize::OutputArchive& archive, const torch::nn::Module& module,
                  const StandIn& stand_in = nullptr);
/// Checks that `archive` (from write_module) matches `module`; throws naming
/// the first mismatch, with `what` (the file) in the message.
void check_module(torch::serialize::InputArchive& archive, const torch::nn::Module& module,
                  const std::string& what, const StandIn& stand_in = nullptr);
/// Copies the checked `archive`'s tensors into `module`'s, one at a time.
void copy_into_module(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                      const StandIn& stand_in = nullptr);
/// Reads `path` into host memory; throws naming the path when it cannot, or
/// when the file is sealed (archive_bytes) and its checksum does not match.
torch::serialize::InputArchive read_archive(const std::string& path);
/// The bytes of `archive` as a file, sealed: a CRC-32 of every byte before it
/// in the zip file's comment, where every zip reader leaves it alone.
std::string archive_bytes(torch::serialize::OutputArchive& archive);
/// Checks the seal of the file at `path`, streaming it (no copy in memory):
/// true when sealed and intact, false when unsealed (written before seals);
/// throws c10::Error naming the file when the checksum does not match.
bool check_seal(const std::string& path);
/// `bytes` as a 1-D uint8 host tensor (for collectives and nested archives).
torch::Tensor bytes_tensor(const std::string& bytes);
/// Reads `archive` from what bytes_tensor gave; throws naming `what` when it cannot.
void load_archive(torch::serialize::InputArchive& archive, const torch::Tensor& bytes, const std::string& what);
} // namespace detail

} // namespace memfit
