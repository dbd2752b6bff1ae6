#include "memfit/state.h"

#include "memfit/memory.h"
#include "memfit/models.h"
#include "test_util.h"

#include <torch/torch.h>

#include <cstring>
#include <fstream>
#include <sstream>
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

} // namespace
} // namespace memfit
