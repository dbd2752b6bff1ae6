#include "memfit/data.h"

#include "memfit/memory.h"

#include <torch/data/datasets/mnist.h>

#include <fmt/format.h>
#include <zlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <dirent.h>
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
  // No home (a service, a container): a folder of this user's own in the
  // temporary folder, which other users share, said once.
  const fs::path dir = fs::temp_directory_path() / fmt::format("memfit-{}", ::getuid());
  TORCH_WARN_ONCE("neither MEMFIT_CACHE_DIR, XDG_CACHE_HOME nor HOME is set: unzipped data goes to ", dir.string(),
                  "; set MEMFIT_CACHE_DIR (or FashionMnistOptions::cache_dir) to keep it elsewhere");
  return dir;
}

// Each IDX file: its magic number (2051 images, 2049 labels) and how many
// examples LibTorch's MNIST reader expects (it refuses other counts).
struct IdxFile {
  const char* name;
  uint32_t magic;
  int64_t count;
};
const IdxFile kIdx[] = {{kFiles[0], 2051, 60000}, {kFiles[1], 2049, 60000},
                        {kFiles[2], 2051, 10000}, {kFiles[3], 2049, 10000}};

std::string damaged(const fs::path& file, const std::string& what) {
  return fmt::format("Fashion-MNIST file {} is damaged: {}; reinstall Debian's dataset-fashion-mnist, or give a "
                     "folder with the four intact files", file.string(), what);
}

// Checks an unzipped IDX file's header and length, reading 16 bytes; errors
// name `shown` (the .gz file it came from, or the file itself).
void check_idx(const fs::path& file, const IdxFile& spec, const fs::path& shown) {
  std::ifstream is(file, std::ios::binary);
  TORCH_CHECK(is, "cannot open ", file.string(), " for reading");
  const bool images = spec.magic == 2051;
  unsigned char h[16] = {};
  is.read(reinterpret_cast<char*>(h), images ? 16 : 8);
  TORCH_CHECK(is, damaged(shown, "it is shorter than an IDX header"));
  const auto word = [&](int i) {
    return uint32_t(h[4 * i]) << 24 | uint32_t(h[4 * i + 1]) << 16 | uint32_t(h[4 * i + 2]) << 8 | h[4 * i + 3];
  };
  TORCH_CHECK(word(0) == spec.magic, damaged(shown, fmt::format("its IDX magic number is {}, not {}", word(0), spec.magic)));
  TORCH_CHECK(word(1) == spec.count, damaged(shown, fmt::format("it holds {} examples, not {}", word(1), spec.count)));
  TORCH_CHECK(!images || (word(2) == 28 && word(3) == 28),
              damaged(shown, fmt::format("its images are {}x{}, not 28x28", word(2), word(3))));
  const auto expected = static_cast<uintmax_t>((images ? 16 : 8) + spec.count * (images ? 28 * 28 : 1));
  std::error_code ec;
  const auto size = fs::file_size(file, ec);
  TORCH_CHECK(!ec && size == expected, damaged(shown, fmt::format("it is {} bytes long, not {}", size, expected)));
}

// Unzips `gz` into `out`, refusing what is not an intact gzip stream (a
// truncated file, a failed checksum, or bytes that are not gzip at all).
void gunzip(const fs::path& gz, const fs::path& out) {
  gzFile in = gzopen(gz.c_str(), "rb");
  TORCH_CHECK(in != nullptr, "cannot open ", gz.string(), " for reading");
  std::ofstream os(out, std::ios::binary | std::ios::trunc);
  if (!os) {
    gzclose(in);
    TORCH_CHECK(false, "cannot write ", out.string(), "; set MEMFIT_CACHE_DIR to a writable folder");
  }
  char buf[1 << 16];
  int n;
  while ((n = gzread(in, buf, sizeof buf)) > 0) os.write(buf, n);
  int err = Z_OK;
  const std::string message = gzerror(in, &err);
  const bool direct = gzdirect(in) != 0;
  gzclose(in);
  os.close();
  TORCH_CHECK(!direct, damaged(gz, "it is not a gzip file"));
  TORCH_CHECK(n == 0 && err == Z_OK, damaged(gz, "its gzip stream is broken (" + message + ")"));
  TORCH_CHECK(os, "cannot write ", out.string(), " (is the disk full?)");
}

// Runs the rest of `is` through CRC-32 from `crc`, adding its length to `size`.
uLong crc32_of_rest(std::istream& is, uLong crc, uintmax_t& size) {
  std::vector<char> buf(1 << 20);
  while (is.read(buf.data(), static_cast<std::streamsize>(buf.size())) || is.gcount() > 0) {
    crc = crc32(crc, reinterpret_cast<const Bytef*>(buf.data()), static_cast<uInt>(is.gcount()));
    size += static_cast<uintmax_t>(is.gcount());
  }
  return crc;
}

// A key for the four .gz files' contents: their sizes and CRC-32s.
std::string content_key(const fs::path& root) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (const char* f : kFiles) {
    const fs::path gz = root / (std::string(f) + ".gz");
    std::ifstream is(gz, std::ios::binary);
    TORCH_CHECK(is, "cannot open ", gz.string(), " for reading");
    uintmax_t size = 0;
    crc = crc32_of_rest(is, crc, size);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(&size), sizeof size);
  }
  return fmt::format("{:08x}", static_cast<uint32_t>(crc));
}

// Removes a flat folder and its files (POSIX calls: a LibTorch 2.x build may
// bind std::filesystem::remove_all to libtorch.so's own copy, which crashes).
void remove_flat_folder(const fs::path& folder) {
  if (DIR* d = ::opendir(folder.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") ::unlink((folder / name).c_str());
    }
    ::closedir(d);
  }
  ::rmdir(folder.c_str());
}

// Whether `file` holds what `gz` unzips to: the CRC-32 and length (mod 2^32)
// that the gzip trailer, the file's last 8 bytes, records of it.
bool unzips_to(const fs::path& gz, const fs::path& file) {
  std::ifstream trailer(gz, std::ios::binary);
  unsigned char t[8] = {};
  if (!trailer.seekg(-8, std::ios::end) || !trailer.read(reinterpret_cast<char*>(t), 8)) return false;
  const auto word = [&](int i) {
    return uint32_t(t[4 * i]) | uint32_t(t[4 * i + 1]) << 8 | uint32_t(t[4 * i + 2]) << 16 | uint32_t(t[4 * i + 3]) << 24;
  };
  std::ifstream is(file, std::ios::binary);
  uintmax_t size = 0;
  const uLong crc = crc32_of_rest(is, crc32(0L, Z_NULL, 0), size);
  return static_cast<uint32_t>(crc) == word(0) && static_cast<uint32_t>(size) == word(1);
}

// The cache copy is checked against the .gz files in `root`, not only keyed
// by them: a byte changed at the same size is unzipped again.
bool holds_intact_files(const fs::path& folder, const fs::path& root) {
  try {
    for (const auto& f : kIdx) {
      check_idx(folder / f.name, f, folder / f.name);
      if (!unzips_to(root / (std::string(f.name) + ".gz"), folder / f.name)) return false;
    }
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

// A folder holding the four checked, unzipped IDX files: `root` when it holds
// them, else cache/fashion-mnist/KEY, where KEY names the .gz files' contents.
// The cache folder is filled under a temporary name, checked, then renamed:
// a damaged input never leaves anything that a later run would read.
fs::path unzipped_folder(const FashionMnistOptions& options) {
  const fs::path root(options.root());
  bool plain = true;
  for (const char* f : kFiles) plain = plain && fs::exists(root / f);
  if (plain) {
    for (const auto& f : kIdx) check_idx(root / f.name, f, root / f.name);
    return root;
  }
  for (const char* f : kFiles) {
    const fs::path gz = root / (std::string(f) + ".gz");
    TORCH_CHECK(fs::exists(gz), "Fashion-MNIST file ", gz.string(),
                " is missing: install Debian's package dataset-fashion-mnist "
                "(apt-get install dataset-fashion-mnist) or give a folder with "
                "the four *-ubyte(.gz) files");
  }
  const fs::path cache = cache_root(options.cache_dir()) / "fashion-mnist" / content_key(root);
  if (holds_intact_files(cache, root)) return cache;
  std::error_code ec;
  fs::create_directories(cache.parent_path(), ec);
  TORCH_CHECK(!ec, "cannot create cache folder ", cache.parent_path().string(), ": ", ec.message(),
              "; set MEMFIT_CACHE_DIR to a writable folder");
  const fs::path tmp = cache.string() + fmt::format(".tmp{}", ::getpid());
  remove_flat_folder(tmp);
  fs::create_directory(tmp, ec);
  TORCH_CHECK(!ec, "cannot create ", tmp.string(), ": ", ec.message(), "; set MEMFIT_CACHE_DIR to a writable folder");
  try {
    for (const auto& f : kIdx) {
      const fs::path gz = root / (std::string(f.name) + ".gz");
      gunzip(gz, tmp / f.name);
      check_idx(tmp / f.name, f, gz);
    }
  } catch (...) {
    remove_flat_folder(tmp);
    throw;
  }
  remove_flat_folder(cache);  // a damaged copy (edited by hand); intact ones returned above
  if (::rename(tmp.c_str(), cache.c_str()) != 0) {  // another process renamed its copy first
    remove_flat_folder(tmp);
    TORCH_CHECK(holds_intact_files(cache, root), "cannot fill the cache folder ", cache.string(),
                "; set MEMFIT_CACHE_DIR to a writable folder");
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
  int err = Z_OK;
  const std::string message = gzerror(in, &err);
  gzclose(in);
  TORCH_CHECK(n == 0 && err == Z_OK, "cannot read ", path.string(), ": its gzip stream is broken (", message,
              "); reinstall Debian's jargon-text, or give an intact file");
  TORCH_CHECK(!text.empty(), "cannot read ", path.string(), ": it is empty; give a text of at least a few windows");
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
