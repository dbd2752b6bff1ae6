#include "memfit/data.h"

#include "memfit/memory.h"

#include "compat.h"
#include "test_util.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include <ftw.h>
#include <unistd.h>
#include <zlib.h>

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
    remove_tree(cache_);
    Seeded::TearDown();
  }
  // POSIX calls rather than fs::remove_all, which a LibTorch 2.x build may
  // resolve to libtorch.so's own (incompatible) copy and crash in.
  static void remove_tree(const fs::path& path) {
    ::nftw(path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
           FTW_DEPTH | FTW_PHYS);
  }
  // The cache folder that holds the four unzipped files, if any.
  std::vector<fs::path> cached_folders() const {
    std::vector<fs::path> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(cache_ / "fashion-mnist", ec)) out.push_back(e.path());
    return out;
  }
  // A folder of four .gz files: the real ones, except those given by name.
  fs::path data_folder(const std::map<std::string, std::string>& gz_bytes, bool compress = true) {
    const fs::path root = cache_ / "input";
    fs::create_directories(root);
    for (const char* f : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                          "t10k-labels-idx1-ubyte"}) {
      const fs::path gz = root / (std::string(f) + ".gz");
      const auto it = gz_bytes.find(f);
      if (it == gz_bytes.end()) {
        fs::create_symlink(fs::path(FashionMnistOptions().root()) / gz.filename(), gz);
      } else if (compress) {
        gzFile out = gzopen(gz.c_str(), "wb1");
        gzwrite(out, it->second.data(), static_cast<unsigned>(it->second.size()));
        gzclose(out);
      } else {
        std::ofstream(gz, std::ios::binary) << it->second;
      }
    }
    return root;
  }
  // Loads the training split from `root`, expecting an error naming `file`
  // and holding `what`; then checks that nothing was cached.
  void expect_refused(const fs::path& root, const std::string& file, const std::string& what) {
    try {
      load_fashion_mnist(Split::kTrain, FashionMnistOptions().root(root.string()).cache_dir(cache_.string()));
      ADD_FAILURE() << "expected an error for " << file;
    } catch (const c10::Error& e) {
      const std::string msg = e.msg();
      EXPECT_NE(msg.find((root / file).string()), std::string::npos) << msg;
      EXPECT_NE(msg.find(what), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
    }
    EXPECT_TRUE(cached_folders().empty()) << "a damaged input left a cache folder: " << cached_folders().front();
  }
  fs::path cache_;
};

TEST_F(FashionMnist, WithoutAHomeTheCacheIsTheUsersOwnInTheTemporaryFolderAndSaysSo) {
  // Saved and put back: the variables that choose the cache, and TMPDIR,
  // pointed into this test's folder so that nothing is left in /tmp.
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  for (const char* name : {"MEMFIT_CACHE_DIR", "XDG_CACHE_HOME", "HOME", "TMPDIR"}) {
    const char* v = std::getenv(name);
    saved.emplace_back(name, v ? std::optional<std::string>(v) : std::nullopt);
    ::unsetenv(name);
  }
  fs::create_directories(cache_);
  ::setenv("TMPDIR", cache_.c_str(), 1);
  memfit::compat::WarningCapture warnings;
  const auto ds = load_fashion_mnist(Split::kTest, FashionMnistOptions());
  for (const auto& [name, value] : saved) {
    if (value) ::setenv(name.c_str(), value->c_str(), 1); else ::unsetenv(name.c_str());
  }
  EXPECT_EQ(ds.size(), 10000);
  const fs::path dir = cache_ / ("memfit-" + std::to_string(::getuid()));
  EXPECT_TRUE(fs::is_directory(dir / "fashion-mnist")) << "unzipped into " << dir;
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("nor HOME is set: unzipped data goes to " + dir.string()), std::string::npos)
      << warnings.messages[0];
}

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
  ASSERT_EQ(cached_folders().size(), 1u);
  EXPECT_TRUE(fs::exists(cached_folders().front() / "t10k-images-idx3-ubyte"));
}

// Reference: `head -c 3000` of each .gz trained with exit 0 before the files were checked.
TEST_F(FashionMnist, TruncatedFilesAreRefusedNamingTheFileAndNeverCached) {
  std::map<std::string, std::string> cut;
  for (const char* f : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte"}) {
    std::ifstream is(fs::path(FashionMnistOptions().root()) / (std::string(f) + ".gz"), std::ios::binary);
    std::string bytes(3000, '\0');
    is.read(bytes.data(), 3000);
    cut[f] = bytes;
  }
  expect_refused(data_folder(cut, /*compress=*/false), "train-images-idx3-ubyte.gz", "gzip stream is broken");
}

TEST_F(FashionMnist, BytesThatAreNotGzipAreRefused) {
  expect_refused(data_folder({{"t10k-labels-idx1-ubyte", "not a gzip file at all"}}, /*compress=*/false),
                 "t10k-labels-idx1-ubyte.gz", "not a gzip file");
}

TEST_F(FashionMnist, GzippedGarbageFailsTheIdxMagicNumber) {
  expect_refused(data_folder({{"train-images-idx3-ubyte", std::string(5000, '\x5a')}}),
                 "train-images-idx3-ubyte", "IDX magic number is 1515870810, not 2051");
}

TEST_F(FashionMnist, ALabelCountThatDisagreesWithTheImagesIsRefused) {
  std::string labels = {0, 0, 8, 1, 0, 0, '\xea', '\x5f'};  // magic 2049, 59999 labels
  labels += std::string(59999, '\1');
  expect_refused(data_folder({{"train-labels-idx1-ubyte", labels}}), "train-labels-idx1-ubyte",
                 "holds 59999 examples, not 60000");
}

TEST_F(FashionMnist, ADamagedInputNeverBreaksALaterRunOnGoodData) {
  expect_refused(data_folder({{"t10k-images-idx3-ubyte", std::string(100, '\0')}}), "t10k-images-idx3-ubyte",
                 "IDX magic number is 0");
  const auto ds = load_fashion_mnist(Split::kTest, FashionMnistOptions().cache_dir(cache_.string()));
  EXPECT_EQ(ds.size(), 10000);
}

TEST_F(FashionMnist, ACacheCopyDamagedByHandIsUnzippedAgain) {
  const auto options = FashionMnistOptions().cache_dir(cache_.string());
  const auto first = load_fashion_mnist(Split::kTest, options);
  ASSERT_EQ(cached_folders().size(), 1u);
  fs::resize_file(cached_folders().front() / "t10k-labels-idx1-ubyte", 100);
  const auto again = load_fashion_mnist(Split::kTest, options);
  EXPECT_TRUE(torch::equal(first.labels, again.labels));
}

// Reference: the cache was keyed by the .gz files, and a copy damaged at the
// same size was read as it was.
TEST_F(FashionMnist, ACacheCopyChangedAtTheSameSizeIsUnzippedAgain) {
  const auto options = FashionMnistOptions().cache_dir(cache_.string()).normalize(false);
  const auto first = load_fashion_mnist(Split::kTest, options);
  ASSERT_EQ(cached_folders().size(), 1u);
  const auto images = cached_folders().front() / "t10k-images-idx3-ubyte";
  const auto size = fs::file_size(images);
  {
    const std::streamoff at = 16 + 28 * 14 + 14;  // the middle of the first image
    std::fstream f(images, std::ios::in | std::ios::out | std::ios::binary);
    char pixel = 0;
    f.seekg(at);
    f.get(pixel);
    f.seekp(at);
    f.put(static_cast<char>(pixel ^ 0x5a));
  }
  ASSERT_EQ(fs::file_size(images), size);
  const auto again = load_fashion_mnist(Split::kTest, options);
  EXPECT_TRUE(torch::equal(first.images, again.images)) << "the damaged copy was read";
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
