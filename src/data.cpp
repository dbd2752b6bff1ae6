#include "memfit/data.h"

#include "memfit/memory.h"

#include <torch/data/datasets/mnist.h>

#include <fmt/format.h>
#include <zlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <unistd.h>

namespace fs = std::filesystem;

namespace memfit {
namespace {

constexpr double kFashionMean = 0.2860;
constexpr double kFashionStd = 0.3530;

const char* const kFiles[] = {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                              "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"};

fs::path cache_root(const std::string& configured) {
  if (!configured.empty()) return configured;
  if (const char* d = std::getenv("MEMFIT_CACHE_DIR"); d && *d) return d;
  if (const char* d = std::getenv("XDG_CACHE_HOME"); d && *d) return fs::path(d) / "memfit";
  if (const char* d = std::getenv("HOME"); d && *d) return fs::path(d) / ".cache" / "memfit";
  return fs::temp_directory_path() / "memfit";
}

// Unzips `gz` into `out` through a temporary file and a rename, so a reader
// never sees half a file.
void gunzip(const fs::path& gz, const fs::path& out) {
  gzFile in = gzopen(gz.c_str(), "rb");
  TORCH_CHECK(in != nullptr, "cannot open ", gz.string(), " for reading");
  const fs::path tmp = out.string() + fmt::format(".tmp{}", ::getpid());
  {
    std::ofstream os(tmp, std::ios::binary | std::ios::trunc);
    if (!os) {
      gzclose(in);
      TORCH_CHECK(false, "cannot write ", tmp.string(),
                  "; set MEMFIT_CACHE_DIR to a writable folder");
    }
    char buf[1 << 16];
    int n;
    while ((n = gzread(in, buf, sizeof buf)) > 0) os.write(buf, n);
    const bool failed = n < 0 || !os;
    gzclose(in);
    if (failed) {
      os.close();
      fs::remove(tmp);
      TORCH_CHECK(false, "cannot unzip ", gz.string(), " (corrupt file or full disk)");
    }
  }
  fs::rename(tmp, out);
}

// A folder holding the four unzipped IDX files, unzipping into the cache when
// `root` holds only the .gz files.
fs::path unzipped_folder(const FashionMnistOptions& options) {
  const fs::path root(options.root());
  bool plain = true;
  for (const char* f : kFiles) plain = plain && fs::exists(root / f);
  if (plain) return root;
  for (const char* f : kFiles) {
    const fs::path gz = root / (std::string(f) + ".gz");
    TORCH_CHECK(fs::exists(gz), "Fashion-MNIST file ", gz.string(),
                " is missing: install Debian's package dataset-fashion-mnist "
                "(apt-get install dataset-fashion-mnist) or point --data at a folder with "
                "the four *-ubyte(.gz) files");
  }
  const fs::path cache = cache_root(options.cache_dir()) / "fashion-mnist";
  std::error_code ec;
  fs::create_directories(cache, ec);
  TORCH_CHECK(!ec, "cannot create cache folder ", cache.string(), ": ", ec.message(),
              "; set MEMFIT_CACHE_DIR to a writable folder");
  for (const char* f : kFiles) {
    const fs::path out = cache / f;
    const fs::path gz = root / (std::string(f) + ".gz");
    if (!fs::exists(out) || fs::last_write_time(out) < fs::last_write_time(gz)) gunzip(gz, out);
  }
  return cache;
}

} // namespace

ImageDataset load_fashion_mnist(Split split, const FashionMnistOptions& options) {
  const fs::path folder = unzipped_folder(options);
  UntrackedGuard host;  // a data set in host memory does not count as device memory
  torch::data::datasets::MNIST mnist(folder.string(),
                                     split == Split::kTrain
                                         ? torch::data::datasets::MNIST::Mode::kTrain
                                         : torch::data::datasets::MNIST::Mode::kTest);
  ImageDataset ds;
  ds.images = mnist.images();
  if (options.normalize()) ds.images = ds.images.sub(kFashionMean).div_(kFashionStd);
  ds.labels = mnist.targets().to(torch::kInt64);
  ds.num_classes = 10;
  return ds;
}

} // namespace memfit
