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

std::string fashion_mnist_folder(const FashionMnistOptions& options) {
  return unzipped_folder(options).string();
}

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

TextCorpus load_jargon_file(const JargonOptions& options) {
  const fs::path path = options.path();
  TORCH_CHECK(fs::exists(path), "the Jargon File is not at ", path.string(),
              ": install Debian's jargon-text (apt-get install jargon-text), or give its path");
  gzFile in = gzopen(path.c_str(), "rb");
  TORCH_CHECK(in != nullptr, "cannot open ", path.string(), " for reading");
  std::string text;
  char buf[1 << 16];
  int n = 0;
  while ((n = gzread(in, buf, sizeof buf)) > 0) text.append(buf, static_cast<size_t>(n));
  const bool failed = n < 0;
  gzclose(in);
  TORCH_CHECK(!failed && !text.empty(), "cannot read ", path.string(), " (a corrupt or empty gzip file)");
  TextCorpus corpus;
  bool seen[256] = {};
  for (unsigned char c : text) seen[c] = true;
  int64_t id_of[256];
  for (int c = 0; c < 256; ++c) {
    id_of[c] = seen[c] ? static_cast<int64_t>(corpus.vocab.size()) : -1;
    if (seen[c]) corpus.vocab.push_back(static_cast<char>(c));
  }
  UntrackedGuard host;  // a data set in host memory
  corpus.tokens = torch::empty({static_cast<int64_t>(text.size())}, torch::kInt64);
  auto* ids = corpus.tokens.data_ptr<int64_t>();
  for (size_t i = 0; i < text.size(); ++i) ids[i] = id_of[static_cast<unsigned char>(text[i])];
  return corpus;
}

torch::Tensor TextCorpus::encode(const std::string& text) const {
  UntrackedGuard host;
  auto out = torch::empty({static_cast<int64_t>(text.size())}, torch::kInt64);
  auto* ids = out.data_ptr<int64_t>();
  for (size_t i = 0; i < text.size(); ++i) {
    const auto at = vocab.find(text[i]);
    TORCH_CHECK(at != std::string::npos, "the text holds byte ", int(static_cast<unsigned char>(text[i])),
                " at position ", i, ", which the corpus never uses: use only its ", vocab.size(), " bytes");
    ids[i] = static_cast<int64_t>(at);
  }
  return out;
}

std::string TextCorpus::decode(const torch::Tensor& ids) const {
  const auto flat = ids.to(torch::kCPU, torch::kInt64).contiguous().reshape({-1});
  std::string out;
  out.reserve(static_cast<size_t>(flat.numel()));
  const auto* p = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < vocab_size(), "token id ", p[i], " is not in [0, ", vocab_size(), ")");
    out.push_back(vocab[static_cast<size_t>(p[i])]);
  }
  return out;
}

ImageDataset text_windows(const TextCorpus& corpus, int64_t context, Split split) {
  TORCH_CHECK(context > 0, "text_windows: context must be positive, got ", context);
  const int64_t length = corpus.tokens.numel();
  const int64_t cut = length * 9 / 10;
  const int64_t begin = split == Split::kTrain ? 0 : cut;
  const int64_t end = split == Split::kTrain ? cut : length;
  // Each window needs its context and one more token (the last label).
  const int64_t windows = (end - begin - 1) / context;
  TORCH_CHECK(windows > 0, "text_windows: the text's ", split == Split::kTrain ? "training" : "test",
              " part holds ", end - begin, " tokens, too few for one window of ", context, " and its label");
  UntrackedGuard host;
  ImageDataset d;
  d.images = corpus.tokens.narrow(0, begin, windows * context).view({windows, context}).clone();
  d.labels = corpus.tokens.narrow(0, begin + 1, windows * context).view({windows, context}).clone();
  d.num_classes = corpus.vocab_size();
  return d;
}

} // namespace memfit

namespace memfit {

ExampleDataset::ExampleDataset(ImageDataset data) : data_(std::move(data)) {
  TORCH_CHECK(data_.images.defined() && data_.labels.defined() && data_.images.size(0) == data_.labels.size(0),
              "ExampleDataset needs images and labels with one row per example, got ",
              data_.images.defined() ? data_.images.size(0) : 0, " and ",
              data_.labels.defined() ? data_.labels.size(0) : 0, " rows");
}

torch::data::Example<> ExampleDataset::get_batch(c10::ArrayRef<size_t> indices) {
  const auto n = static_cast<size_t>(data_.size());
  std::vector<int64_t> rows(indices.begin(), indices.end());
  for (size_t i : indices) {
    TORCH_CHECK(i < n, "ExampleDataset: example ", i, " is out of range: the data set has ", n, " examples");
  }
  const auto index = torch::tensor(rows, torch::kLong);
  return {data_.images.index_select(0, index), data_.labels.index_select(0, index)};
}

torch::optional<size_t> ExampleDataset::size() const { return static_cast<size_t>(data_.size()); }

ExampleDataset fashion_mnist_dataset(Split split, const FashionMnistOptions& options) {
  return ExampleDataset(load_fashion_mnist(split, options));
}

ExampleDataset jargon_dataset(int64_t context, Split split, const JargonOptions& options) {
  return ExampleDataset(text_windows(load_jargon_file(options), context, split));
}

} // namespace memfit
