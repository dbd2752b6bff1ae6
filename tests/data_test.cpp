#include "memfit/data.h"

#include "memfit/memory.h"

#include "test_util.h"

#include <cstdlib>
#include <filesystem>

#include <unistd.h>

namespace memfit {
namespace {

namespace fs = std::filesystem;

bool have_fashion_mnist() {
  return fs::exists(fs::path(FashionMnistOptions().root()) / "t10k-images-idx3-ubyte.gz");
}

class FashionMnist : public testing::Seeded {
 protected:
  void SetUp() override {
    Seeded::SetUp();
    if (!have_fashion_mnist()) {
      GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed "
                      "(scripts/install-deps.sh installs it)";
    }
    cache_ = fs::temp_directory_path() / ("memfit-data-test-" + std::to_string(::getpid()));
  }
  void TearDown() override {
    // POSIX calls rather than fs::remove_all, which a LibTorch 2.x build may
    // resolve to libtorch.so's own (incompatible) copy and crash in.
    for (const char* f : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                          "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
      ::unlink((cache_ / "fashion-mnist" / f).c_str());
    }
    ::rmdir((cache_ / "fashion-mnist").c_str());
    ::rmdir(cache_.c_str());
    Seeded::TearDown();
  }
  fs::path cache_;
};

TEST_F(FashionMnist, ReadsTheRealTestSplitFromDebiansGzippedFiles) {
  const auto ds = load_fashion_mnist(Split::kTest, FashionMnistOptions().cache_dir(cache_.string()));
  ASSERT_EQ(ds.size(), 10000);
  EXPECT_EQ(ds.images.sizes(), (std::vector<int64_t>{10000, 1, 28, 28}));
  EXPECT_EQ(ds.images.scalar_type(), torch::kFloat32);
  EXPECT_EQ(ds.labels.scalar_type(), torch::kInt64);
  // Ten balanced classes: 1000 test images each.
  const auto counts = torch::bincount(ds.labels);
  ASSERT_EQ(counts.size(0), 10);
  EXPECT_TRUE(counts.eq(1000).all().item<bool>());
  // Normalised with the training statistics: the test mean is near 0, std near 1.
  EXPECT_NEAR(ds.images.mean().item<double>(), 0.0, 0.05);
  EXPECT_NEAR(ds.images.std().item<double>(), 1.0, 0.05);
  EXPECT_TRUE(fs::exists(cache_ / "fashion-mnist" / "t10k-images-idx3-ubyte"));
}

TEST_F(FashionMnist, RawPixelsAreInTheUnitIntervalWithoutNormalisation) {
  const auto ds = load_fashion_mnist(
      Split::kTest, FashionMnistOptions().cache_dir(cache_.string()).normalize(false));
  EXPECT_GE(ds.images.min().item<float>(), 0.0f);
  EXPECT_LE(ds.images.max().item<float>(), 1.0f);
  EXPECT_NEAR(ds.images.mean().item<double>(), 0.2860, 0.01);
}

TEST_F(FashionMnist, TheDataSetIsHostMemoryAndNotCounted) {
  const int64_t base = memory_allocated(torch::kCPU);
  const auto ds = load_fashion_mnist(Split::kTest, FashionMnistOptions().cache_dir(cache_.string()));
  EXPECT_EQ(memory_allocated(torch::kCPU), base);
  auto batch = ds.images.narrow(0, 0, 8).clone();
  EXPECT_EQ(memory_allocated(torch::kCPU) - base, 8 * 28 * 28 * 4) << "a batch cut from it is";
}

TEST_F(FashionMnist, MissingFilesNameTheDebianPackage) {
  try {
    load_fashion_mnist(Split::kTrain, FashionMnistOptions().root("/nonexistent/fashion"));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.msg();
    EXPECT_NE(msg.find("dataset-fashion-mnist"), std::string::npos) << msg;
    EXPECT_NE(msg.find("/nonexistent/fashion"), std::string::npos) << msg;
  }
}

class JargonFile : public testing::Seeded {
 protected:
  void SetUp() override {
    Seeded::SetUp();
    if (!fs::exists(JargonOptions().path())) {
      GTEST_SKIP() << "Debian's jargon-text is not installed (scripts/install-deps.sh installs it)";
    }
  }
};

TEST_F(JargonFile, ReadsTheTextAsByteTokens) {
  const int64_t before = memory_allocated(torch::kCPU);
  const auto corpus = load_jargon_file();
  EXPECT_EQ(corpus.tokens.numel(), 1681817);
  EXPECT_EQ(corpus.vocab_size(), 146);
  EXPECT_EQ(corpus.decode(corpus.tokens.narrow(0, 0, 200)).find("The Jargon File"), 32u);
  EXPECT_EQ(corpus.decode(corpus.encode("hax0r")), "hax0r");
  EXPECT_EQ(memory_allocated(torch::kCPU), before) << "a data set in host memory, outside the budget";
  try {
    corpus.encode(std::string("ok\x01"));
    ADD_FAILURE() << "byte 1 is not in the Jargon File";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.msg()).find("byte 1 at position 2"), std::string::npos) << e.msg();
  }
}

TEST_F(JargonFile, WindowsAreFollowedByTheirLabelsAndSplitNinetyTen) {
  const auto corpus = load_jargon_file();
  const auto train = text_windows(corpus, 64, Split::kTrain);
  const auto test = text_windows(corpus, 64, Split::kTest);
  EXPECT_EQ(train.size(), (1681817 * 9 / 10 - 1) / 64);
  EXPECT_EQ(test.size(), (1681817 - 1681817 * 9 / 10 - 1) / 64);
  EXPECT_EQ(train.num_classes, 146);
  EXPECT_TRUE(train.images.narrow(1, 1, 63).equal(train.labels.narrow(1, 0, 63)));
  EXPECT_TRUE(train.images.select(1, 0).narrow(0, 1, 10).equal(train.labels.select(1, 63).narrow(0, 0, 10)))
      << "each window's last label is the next window's first token";
  EXPECT_TRUE(test.images[0].equal(corpus.tokens.narrow(0, 1681817 * 9 / 10, 64)));
}

TEST(JargonFileMissing, NamesTheDebianPackage) {
  try {
    load_jargon_file(JargonOptions().path("/nonexistent/jargon.txt.gz"));
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.msg()).find("apt-get install jargon-text"), std::string::npos) << e.msg();
  }
}

} // namespace
} // namespace memfit
