#pragma once
/// \file data.h
/// Real data sets from Debian packages, read into host memory.
///
/// Fashion-MNIST comes from Debian's `dataset-fashion-mnist`
/// (/usr/share/datasets/fashion-mnist, gzipped IDX files). memfit unzips them
/// once into a cache folder and reads them with torch::data::datasets::MNIST.
/// The tensors are allocated under UntrackedGuard: like a data set in host
/// memory on a GPU machine, they do not count towards the memory budget; the
/// batches cut from them do.
///
/// Thread safety: loading may run on several threads (the cache is written
/// through a temporary file and a rename). Sync points: none. Extra memory:
/// the whole split in host memory (train: 188 MB of float images).

#include <torch/arg.h>
#include <torch/data/datasets/base.h>
#include <torch/data/example.h>
#include <torch/types.h>

#include <cstdint>
#include <string>

namespace memfit {

/// Which part of a data set.
enum class Split { kTrain, kTest };

/// Where and how to read Fashion-MNIST.
struct FashionMnistOptions {
  /// Folder with the four `*-idx?-ubyte.gz` files (or unzipped ones).
  TORCH_ARG(std::string, root) = "/usr/share/datasets/fashion-mnist";
  /// Folder for the unzipped copies; empty: $MEMFIT_CACHE_DIR, else
  /// $XDG_CACHE_HOME/memfit, else $HOME/.cache/memfit, else memfit-UID in the
  /// system's temporary folder (with a warning, once).
  TORCH_ARG(std::string, cache_dir) = "";
  /// Subtract the training set's mean (0.2860) and divide by its standard
  /// deviation (0.3530).
  TORCH_ARG(bool, normalize) = true;
};

/// A labelled data set held in host memory: images and their classes, or
/// (text_windows) windows of token ids and their next tokens.
struct ImageDataset {
  torch::Tensor images;  ///< [N, 1, 28, 28] float32 (text: [N, T] int64 token ids).
  torch::Tensor labels;  ///< [N] int64 class indices (text: [N, T] int64, the next tokens).
  int64_t num_classes = 10;

  /// Number of examples.
  int64_t size() const { return images.defined() ? images.size(0) : 0; }
};

/// The folder holding Fashion-MNIST's four unzipped IDX files, for LibTorch's
/// own torch::data::datasets::MNIST: options.root when it holds them, else
/// `cache_dir/fashion-mnist/KEY`, unzipped there on first use.
///
/// Every file is checked before it is used: an intact gzip stream (its
/// length and checksum), the IDX magic number, 28x28 images, the example
/// count LibTorch's reader expects, and the file's full length. KEY names the
/// .gz files' contents (their sizes and CRC-32), and the cache folder is
/// filled under a temporary name and renamed only once every file passed, so
/// damaged input never leaves a cache that a later run reads.
///
/// Throws c10::Error naming the missing file and the Debian package
/// `dataset-fashion-mnist` when the files are not there, and naming the file
/// and what is wrong with it when one is damaged.
///
/// Example:
/// \code
///   torch::data::datasets::MNIST train(memfit::fashion_mnist_folder());
///   assert(train.size().value() == 60000);
/// \endcode
std::string fashion_mnist_folder(const FashionMnistOptions& options = FashionMnistOptions());

/// Reads one split of Fashion-MNIST.
///
/// Throws c10::Error naming the missing file and the Debian package
/// `dataset-fashion-mnist` when the files are not there.
///
/// Example:
/// \code
///   auto test = memfit::load_fashion_mnist(memfit::Split::kTest);
///   assert(test.size() == 10000);
/// \endcode
ImageDataset load_fashion_mnist(Split split,
                                const FashionMnistOptions& options = FashionMnistOptions());

/// Where to read the Jargon File (Debian's `jargon-text`).
struct JargonOptions {
  /// The gzipped text.
  TORCH_ARG(std::string, path) = "/usr/share/doc/jargon-text/jargon.txt.gz";
};

/// A text as byte-level tokens: every distinct byte of the text is a token,
/// numbered in byte order.
struct TextCorpus {
  std::string vocab;     ///< The bytes, by token id.
  torch::Tensor tokens;  ///< [L] int64: the whole text's token ids (host memory).

  /// Number of distinct tokens.
  int64_t vocab_size() const { return static_cast<int64_t>(vocab.size()); }
  /// The ids of `text`; throws c10::Error naming a byte the corpus lacks.
  torch::Tensor encode(const std::string& text) const;
  /// The text of `ids` (any shape, read in order).
  std::string decode(const torch::Tensor& ids) const;
};

/// Reads the Jargon File as a byte-level corpus (1,681,817 bytes, 146 distinct).
/// Throws c10::Error naming the file and the Debian package `jargon-text`
/// when it is missing.
///
/// Example:
/// \code
///   auto corpus = memfit::load_jargon_file();
///   assert(corpus.decode(corpus.encode("hacker")) == "hacker");
/// \endcode
TextCorpus load_jargon_file(const JargonOptions& options = JargonOptions());

/// Non-overlapping windows of `context` tokens and the tokens that follow
/// each (the labels: the window shifted by one) for next-token training. The
/// first 90% of the text gives the training windows, the rest the test ones.
///
/// Example:
/// \code
///   auto train = memfit::text_windows(corpus, 64, memfit::Split::kTrain);
///   // train.images[i][j + 1] == train.labels[i][j]
/// \endcode
ImageDataset text_windows(const TextCorpus& corpus, int64_t context, Split split);

/// A built-in data set as a torch::data batch data set: a batch of indices
/// reads {images[indices], labels[indices]}, one gather per tensor, as an
/// Example<> (so `Trainer::fit`, LibTorch's DataLoader and `.map(...)`
/// chains take it). The tensors are shared, not copied; the batch is new host memory.
///
/// Example:
/// \code
///   memfit::ExampleDataset data(memfit::load_fashion_mnist(memfit::Split::kTest));
///   auto batch = data.get_batch({0, 5, 7});
///   assert(batch.data.size(0) == 3 && data.size().value() == 10000);
/// \endcode
class ExampleDataset : public torch::data::datasets::BatchDataset<ExampleDataset, torch::data::Example<>> {
 public:
  /// Wraps `data` (its tensors are shared).
  explicit ExampleDataset(ImageDataset data);
  /// The examples at `indices`, in order; throws c10::Error naming an index out of range.
  torch::data::Example<> get_batch(c10::ArrayRef<size_t> indices) override;
  /// Number of examples.
  torch::optional<size_t> size() const override;
  /// The wrapped data.
  const ImageDataset& data() const { return data_; }

 private:
  ImageDataset data_;
};

/// Fashion-MNIST's `split` as a torch::data data set (load_fashion_mnist, then ExampleDataset).
///
/// Example:
/// \code
///   auto test = memfit::fashion_mnist_dataset(memfit::Split::kTest);
///   assert(test.size().value() == 10000);
/// \endcode
ExampleDataset fashion_mnist_dataset(Split split, const FashionMnistOptions& options = FashionMnistOptions());

/// The Jargon File's next-token windows of `context` tokens as a torch::data
/// data set (load_jargon_file, text_windows, then ExampleDataset).
///
/// Example:
/// \code
///   auto train = memfit::jargon_dataset(64, memfit::Split::kTrain);
///   assert(train.get_batch({0}).target.size(1) == 64);
/// \endcode
ExampleDataset jargon_dataset(int64_t context, Split split, const JargonOptions& options = JargonOptions());

} // namespace memfit
