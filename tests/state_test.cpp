#include "memfit/state.h"

#include "memfit/memory.h"
#include "memfit/models.h"
#include "test_util.h"

#include <torch/torch.h>

#include <fstream>
#include <sstream>
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
