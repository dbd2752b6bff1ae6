#include "memfit/state.h"

#include "memfit/memory.h"
#include "memfit/models.h"
#include "test_util.h"

#include <torch/torch.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

namespace memfit {
namespace {

class State : public testing::Seeded {
 protected:
  std::string path(const std::string& name) {
    const std::string p = ::testing::TempDir() + "memfit_state_" + std::to_string(::getpid()) + "_" + name;
    files_.push_back(p);
    return p;
  }
  void TearDown() override {
    for (const auto& f : files_) ::unlink(f.c_str());
  }
  std::vector<std::string> files_;
};

std::string read(const std::string& path) {
  std::ifstream is(path, std::ios::binary);
  std::stringstream ss;
  ss << is.rdbuf();
  return ss.str();
}

TEST_F(State, AtomicWriteReplacesTheFileAndLeavesNoTemporary) {
  const auto p = path("a.txt");
  write_file_atomically(p, "first");
  write_file_atomically(p, "second");
  EXPECT_EQ(read(p), "second");
  EXPECT_NE(::access((p + ".tmp." + std::to_string(::getpid())).c_str(), F_OK), 0);
}

TEST_F(State, AFailedWriteKeepsThePreviousFile) {
  const auto p = path("b.txt");
  write_file_atomically(p, "kept");
  EXPECT_THROW(write_file_atomically("/nonexistent-folder/x", "lost"), c10::Error);
  EXPECT_EQ(read(p), "kept");
}

// Reference: as root, a report written to /dev/full replaced the device node.
TEST_F(State, WhatIsNotARegularFileIsNeverReplaced) {
  // A device node of our own: a regression must not replace the machine's.
  // Making one needs root; without it, only the folder and the FIFO are tried.
  const auto device = path("null");
  const bool have_device = ::mknod(device.c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0;
  std::vector<std::string> targets = {::testing::TempDir()};
  if (have_device) targets.push_back(device);
  for (const auto& target : targets) {
    try {
      write_file_atomically(target, "x");
      ADD_FAILURE() << target << " was written";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.msg()).find("replaces only regular files"), std::string::npos) << e.msg();
    }
    EXPECT_THROW(check_output_file(target), c10::Error);
  }
  struct stat st {};
  if (have_device) {
    ASSERT_EQ(::stat(device.c_str(), &st), 0);
    EXPECT_TRUE(S_ISCHR(st.st_mode)) << device << " is still a device";
  }
  const auto fifo = path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THROW(write_file_atomically(fifo, "x"), c10::Error);
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
}

TEST_F(State, AWriteThroughASymbolicLinkReplacesItsTargetAndKeepsTheLink) {
  const auto target = path("target.txt");
  const auto link = path("link.txt");
  write_file_atomically(target, "old");
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  write_file_atomically(link, "new");
  struct stat st {};
  ASSERT_EQ(::lstat(link.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  EXPECT_EQ(read(target), "new");
}

TEST_F(State, TemporariesOfAKilledWriterAreRemovedByTheNextWrite) {
  const auto p = path("c.txt");
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // a pid that no longer runs
  const auto stale = path("c.txt.tmp." + std::to_string(child));
  std::ofstream(stale) << "torn";
  const auto live = path("c.txt.tmp.1");  // pid 1 runs: its temporary stays
  std::ofstream(live) << "in progress";
  write_file_atomically(p, "whole");
  EXPECT_NE(::access(stale.c_str(), F_OK), 0);
  EXPECT_EQ(::access(live.c_str(), F_OK), 0);
  EXPECT_EQ(read(p), "whole");
}

TEST_F(State, OutputChecksNameWhatIsWrongBeforeAnyWrite) {
  const auto missing = ::testing::TempDir() + "memfit_no_such_folder_" + std::to_string(::getpid());
  try {
    check_output_file(missing + "/r.json");
    ADD_FAILURE() << "a missing folder passed";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.msg()).find("does not exist"), std::string::npos) << e.msg();
  }
  EXPECT_NO_THROW(check_output_folder(missing + "/a/b")) << "created later, in a writable folder";
  EXPECT_NE(::access(missing.c_str(), F_OK), 0) << "checking creates nothing";
  EXPECT_THROW(check_output_folder("/dev/null/ck"), c10::Error);
  EXPECT_THROW(check_output_file(""), c10::Error);
}

TEST_F(State, ModuleRoundTripIsBitwiseAndCopiesInPlace) {
  auto a = make_resnet(ModelOptions().width(4).depth(1));
  const auto p = path("m.pt");
  save_module(*a, p);
  auto b = make_resnet(ModelOptions().width(4).depth(1));
  const auto storage = b->parameters()[0].data_ptr();
  const int64_t before = memory_allocated();
  PeakMeter meter;
  load_module(*b, p);
  EXPECT_EQ(meter.peak(), before) << "the file is read into host memory, not device memory";
  EXPECT_EQ(b->parameters()[0].data_ptr(), storage) << "copied into the module's own storage";
  const auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(pa[i].equal(pb[i]));
  const auto ba = a->buffers(), bb = b->buffers();
  for (size_t i = 0; i < ba.size(); ++i) EXPECT_TRUE(ba[i].equal(bb[i]));
}

TEST_F(State, LoadingIntoAnotherModelNamesTheFirstMismatch) {
  auto a = make_mlp(ModelOptions().width(8).depth(2));
  const auto p = path("mlp.pt");
  save_module(*a, p);
  auto shallower = make_mlp(ModelOptions().width(8).depth(1));
  try {
    load_module(*shallower, p);
    FAIL() << "expected a mismatch";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.msg()).find("tensor 2 is 'fc1.weight' in the checkpoint but 'head.weight'"),
              std::string::npos)
        << e.msg();
  }
  EXPECT_THROW(load_module(*a, path("missing.pt")), c10::Error);
}

std::vector<torch::Tensor> copies(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Reference: a checkpoint overwritten in its middle resumed, then failed later
// on a NaN loss (LibTorch's zip reader skips its CRCs).
TEST_F(State, ADamagedFileIsRefusedByItsSealAndChangesNothing) {
  auto a = make_mlp(ModelOptions().width(8).depth(1));
  const auto p = path("sealed.pt");
  save_module(*a, p);
  const std::string whole = read(p);
  ASSERT_GT(whole.size(), 64u);
  EXPECT_EQ(whole.compare(whole.size() - 21, 13, "memfit-crc32:"), 0) << "sealed in the zip comment";
  auto b = make_mlp(ModelOptions().width(8).depth(1));
  const auto before = copies(*b);
  for (const size_t at : {size_t{40}, whole.size() / 2, whole.size() - 40}) {
    std::string damaged = whole;
    damaged[at] = static_cast<char>(damaged[at] ^ 0x10);
    write_raw(p, damaged);
    try {
      load_module(*b, p);
      ADD_FAILURE() << "a flipped byte at " << at << " of " << whole.size() << " loaded";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.msg()).find(p + " is damaged"), std::string::npos) << at << ": " << e.msg();
    }
  }
  // The seal cut off, the end record mended: a valid zip, which says it was sealed.
  std::string cut = whole.substr(0, whole.size() - 21);
  cut[cut.size() - 2] = cut[cut.size() - 1] = 0;
  write_raw(p, cut);
  try {
    load_module(*b, p);
    ADD_FAILURE() << "a file without its seal loaded";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.msg()).find("the checksum is gone"), std::string::npos) << e.msg();
  }
  write_raw(p, whole.substr(0, whole.size() / 2));  // truncated
  EXPECT_THROW(load_module(*b, p), c10::Error);
  const auto after = copies(*b);
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(after[i].equal(before[i])) << "parameter " << i;
  write_raw(p, whole);
  load_module(*b, p);
  EXPECT_TRUE(b->parameters()[0].equal(a->parameters()[0]));
}

TEST_F(State, AnUnsealedArchiveOfAnEarlierVersionStillLoads) {
  auto a = make_mlp(ModelOptions().width(8).depth(1));
  const auto p = path("unsealed.pt");
  torch::serialize::OutputArchive archive;
  detail::write_module(archive, *a);
  archive.save_to(p);  // LibTorch's own writer: no seal, no "sealed" record
  auto b = make_mlp(ModelOptions().width(8).depth(1));
  EXPECT_FALSE(detail::check_seal(p));
  load_module(*b, p);
  EXPECT_TRUE(b->parameters()[0].equal(a->parameters()[0]));
}

TEST_F(State, AFolderHasOneWriterAndAKilledHolderLeavesItFree) {
  const std::string dir = ::testing::TempDir() + "memfit_lock_" + std::to_string(::getpid());
  const std::string file = dir + "/.memfit.lock";
  {
    FolderLock held(dir, "TrainerOptions::save_dir");
    EXPECT_TRUE(held.held());
    EXPECT_NE(read(file).find("memfit pid " + std::to_string(::getpid()) + " on "), std::string::npos) << read(file);
    try {
      FolderLock second(dir, "TrainerOptions::save_dir");
      ADD_FAILURE() << "two holders of one folder";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.msg()).find("TrainerOptions::save_dir " + dir + " is in use by another run (memfit pid " +
                                          std::to_string(::getpid())),
                std::string::npos)
          << e.msg();
    }
    FolderLock moved = std::move(held);
    EXPECT_TRUE(moved.held());
    EXPECT_FALSE(held.held());  // NOLINT(bugprone-use-after-move): moved-from holds nothing
    EXPECT_THROW(FolderLock{dir}, c10::Error);
  }
  EXPECT_NE(::access(file.c_str(), F_OK), 0) << "a release removes the lock file";
  // A holder killed with its lock leaves the file, and no lock.
  const pid_t child = ::fork();
  if (child == 0) {  // system calls only, after a fork
    const int fd = ::open(file.c_str(), O_RDWR | O_CREAT, 0644);
    if (fd < 0 || ::flock(fd, LOCK_EX | LOCK_NB) != 0) ::_exit(3);
    ::kill(::getpid(), SIGKILL);
  }
  ASSERT_GT(child, 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "the child could not take the lock";
  EXPECT_EQ(::access(file.c_str(), F_OK), 0);
  { FolderLock after_kill(dir); EXPECT_TRUE(after_kill.held()); }
  ::rmdir(dir.c_str());  // empty: the last holder removed its lock file
}

} // namespace
} // namespace memfit
