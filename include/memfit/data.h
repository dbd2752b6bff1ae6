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
  /// $XDG_CACHE_HOME/memfit, else $HOME/.cache/memfit, else the system's
  /// temporary folder.
  TORCH_ARG(std::string, cache_dir) = "";
  /// Subtract the training set's mean (0.2860) and divide by its standard
  /// deviation (0.3530).
  TORCH_ARG(bool, normalize) = true;
};

/// A labelled image data set held in host memory.
struct ImageDataset {
  torch::Tensor images;  ///< [N, 1, 28, 28] float32.
  torch::Tensor labels;  ///< [N] int64 class indices.
  int64_t num_classes = 10;

  /// Number of examples.
  int64_t size() const { return images.defined() ? images.size(0) : 0; }
};

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

} // namespace memfit
