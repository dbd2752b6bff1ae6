#pragma once
// Internal hooks of the tracking allocator, for benchmarks that compare it
// with LibTorch's default allocator side by side. Not installed.

namespace memfit {
namespace detail {
/// Makes memfit's tracking allocator LibTorch's CPU allocator (again).
void install_tracking_allocator();
/// Makes LibTorch's default CPU allocator current; tracked storages still
/// free through their own deleter, so counts stay right.
void install_default_allocator();
} // namespace detail
} // namespace memfit
