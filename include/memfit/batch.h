#pragma once
/// \file batch.h
/// What the Trainer needs to know about a batch: how many examples it holds,
/// how to cut examples [start, start + length) out of it (micro-batching),
/// and how to put it in the device's memory.
///
/// memfit knows `torch::data::Example<>` (data and target, the common case),
/// a bare `torch::Tensor`, and `std::vector<torch::data::Example<>>` (what a
/// LibTorch DataLoader yields without a Stack transform). A user's own batch
/// type works once it specializes BatchTraits with the same three functions;
/// a fourth, `pin`, is optional (without it, a batch read ahead for a CUDA
/// device is staged from pageable memory).
///
/// Sync points: none. Extra memory: to() copies host memory to the device
/// (memfit::to_device); slice() makes views; pin() copies host memory into
/// pinned host memory.

#include "memfit/memory.h"

#include <c10/util/Exception.h>
#include <torch/data/example.h>
#include <torch/types.h>

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace memfit {

/// How memfit counts, cuts and places a batch of type `Batch`; specialize it
/// for a batch type of your own.
///
/// Example:
/// \code
///   struct Pair { torch::Tensor tokens, mask; };
///   template <> struct memfit::BatchTraits<Pair> {
///     static int64_t size(const Pair& b) { return b.tokens.size(0); }
///     static Pair slice(const Pair& b, int64_t start, int64_t length) {
///       return {b.tokens.narrow(0, start, length), b.mask.narrow(0, start, length)};
///     }
///     static Pair to(const Pair& b, const torch::Device& device) {
///       return {memfit::to_device(b.tokens, device), memfit::to_device(b.mask, device)};
///     }
///   };
/// \endcode
template <class Batch>
struct BatchTraits;

/// A tensor whose first dimension indexes the examples.
template <>
struct BatchTraits<torch::Tensor> {
  /// Examples in `batch`: its first dimension.
  static int64_t size(const torch::Tensor& batch) {
    TORCH_CHECK(batch.defined() && batch.dim() > 0, "a batch tensor needs a first dimension that counts "
                "its examples, got ", batch.defined() ? "a scalar" : "an undefined tensor");
    return batch.size(0);
  }
  /// Examples [start, start + length): a view.
  static torch::Tensor slice(const torch::Tensor& batch, int64_t start, int64_t length) {
    return batch.narrow(0, start, length);
  }
  /// The batch in the device's memory (to_device).
  static torch::Tensor to(const torch::Tensor& batch, const torch::Device& device) {
    return to_device(batch, device);
  }
  /// The batch in pinned host memory (as it is when it already is, or is not on the host).
  static torch::Tensor pin(const torch::Tensor& batch) {
    return !batch.defined() || !batch.device().is_cpu() || batch.is_pinned() ? batch : batch.pin_memory();
  }
};

/// Data and target, both indexed by example in their first dimension (the
/// target may be undefined).
template <>
struct BatchTraits<torch::data::Example<>> {
  /// Examples in `batch`; the target, when there is one, must hold as many.
  static int64_t size(const torch::data::Example<>& batch) {
    const int64_t n = BatchTraits<torch::Tensor>::size(batch.data);
    TORCH_CHECK(!batch.target.defined() || (batch.target.dim() > 0 && batch.target.size(0) == n),
                "a batch's data holds ", n, " examples but its target has shape ", batch.target.sizes(),
                ": data and target need the examples in their first dimension");
    return n;
  }
  /// Examples [start, start + length) of data and target: views.
  static torch::data::Example<> slice(const torch::data::Example<>& batch, int64_t start, int64_t length) {
    return {batch.data.narrow(0, start, length),
            batch.target.defined() ? batch.target.narrow(0, start, length) : batch.target};
  }
  /// Data and target in the device's memory (to_device).
  static torch::data::Example<> to(const torch::data::Example<>& batch, const torch::Device& device) {
    return {to_device(batch.data, device), to_device(batch.target, device)};
  }
  /// Data and target in pinned host memory.
  static torch::data::Example<> pin(const torch::data::Example<>& batch) {
    return {BatchTraits<torch::Tensor>::pin(batch.data), BatchTraits<torch::Tensor>::pin(batch.target)};
  }
};

/// The examples a DataLoader yields without a Stack transform; each stays
/// as it is (the loss stacks them, or takes them one by one).
template <>
struct BatchTraits<std::vector<torch::data::Example<>>> {
  /// Examples in `batch`.
  static int64_t size(const std::vector<torch::data::Example<>>& batch) {
    return static_cast<int64_t>(batch.size());
  }
  /// Examples [start, start + length).
  static std::vector<torch::data::Example<>> slice(const std::vector<torch::data::Example<>>& batch,
                                                   int64_t start, int64_t length) {
    return {batch.begin() + start, batch.begin() + start + length};
  }
  /// Every example in the device's memory.
  static std::vector<torch::data::Example<>> to(const std::vector<torch::data::Example<>>& batch,
                                                const torch::Device& device) {
    std::vector<torch::data::Example<>> out;
    out.reserve(batch.size());
    for (const auto& e : batch) out.push_back(BatchTraits<torch::data::Example<>>::to(e, device));
    return out;
  }
  /// Every example in pinned host memory.
  static std::vector<torch::data::Example<>> pin(const std::vector<torch::data::Example<>>& batch) {
    std::vector<torch::data::Example<>> out;
    out.reserve(batch.size());
    for (const auto& e : batch) out.push_back(BatchTraits<torch::data::Example<>>::pin(e));
    return out;
  }
};

namespace detail {
template <class Batch, class = void>
struct HasPin : std::false_type {};
template <class Batch>
struct HasPin<Batch, std::void_t<decltype(BatchTraits<Batch>::pin(std::declval<const Batch&>()))>>
    : std::true_type {};
} // namespace detail

/// `batch` in pinned host memory through BatchTraits<Batch>::pin, or as it
/// is when the traits have no `pin`.
///
/// Example:
/// \code
///   auto batch = torch::data::Example<>(torch::ones({4, 3}), torch::zeros({4}));
///   if (torch::cuda::is_available()) assert(memfit::pinned(batch).data.is_pinned());
/// \endcode
template <class Batch>
Batch pinned(const Batch& batch) {
  if constexpr (detail::HasPin<Batch>::value) {
    return BatchTraits<Batch>::pin(batch);
  } else {
    return batch;
  }
}

} // namespace memfit
