#!/usr/bin/env bash
# memfit as a package: `cmake --install` into a prefix, then build and run the
# example consumer with find_package(memfit CONFIG REQUIRED); then build it
# again with add_subdirectory(memfit).
# Usage: package_test.sh BUILD_DIR CONSUMER_SOURCE WORK_DIR [SUBDIR]
# SUBDIR: build (the default: the library and the consumer under
# add_subdirectory) or configure (its CMake only: the other LibTorch's run
# builds it, and the library's sources compile alike under either).
set -euo pipefail
build=$1 consumer=$2 work=$3 subdir_mode=${4:-build}
case $subdir_mode in build|configure) ;; *) echo "package_test.sh: SUBDIR is '$subdir_mode'; use build or configure" >&2; exit 2;; esac
src=$(cd "$consumer/../.." && pwd)
rm -rf "$work"
mkdir -p "$work"
jobs=$(nproc 2>/dev/null || echo 2)

cmake --install "$build" --prefix "$work/prefix" >"$work/install.log"
test -f "$work/prefix/include/memfit/memory.h"
ls "$work"/prefix/lib*/cmake/memfit/memfitConfig.cmake >/dev/null

cmake -S "$consumer" -B "$work/find" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" >"$work/find-configure.log"
cmake --build "$work/find" -j "$jobs" >"$work/find-build.log"
"$work/find/consumer" | tee "$work/find-run.log"
grep -q "refused as expected" "$work/find-run.log"
"$work/find/checkpointing" | tee "$work/checkpointing-run.log"
grep -q "gradients identical" "$work/checkpointing-run.log"
"$work/find/mixed_precision" | tee "$work/mixed-precision-run.log"
grep -q "mixed precision matches fp32" "$work/mixed-precision-run.log"
"$work/find/trainer_state" | tee "$work/trainer-state-run.log"
grep -q "resume bit-identical" "$work/trainer-state-run.log"
"$work/find/parameter_offload" | tee "$work/parameter-offload-run.log"
grep -q "streamed parameters train like resident ones" "$work/parameter-offload-run.log"
"$work/find/own_model_mnist" | tee "$work/own-model-mnist-run.log"
grep -q "own model trained under the budget" "$work/own-model-mnist-run.log"
"$work/find/custom_loop_gan" | tee "$work/custom-loop-gan-run.log"
grep -q "gan trained with memfit's pieces" "$work/custom-loop-gan-run.log"
"$work/find/own_model_recovery" | tee "$work/own-model-recovery-run.log"
grep -q "the run recovered from out of memory" "$work/own-model-recovery-run.log"
"$work/find/fused_optimizer" | tee "$work/fused-optimizer-run.log"
grep -q "memfit's optimizer steps as LibTorch's" "$work/fused-optimizer-run.log"
"$work/find/own_transformer" | tee "$work/own-transformer-run.log"
grep -q "own transformer planned under 1/2, 1/4 and 1/8 of its peak" "$work/own-transformer-run.log"
"$work/find/own_varlen" | tee "$work/own-varlen-run.log"
grep -q "varying lengths trained under 1/4 of the longest batch's plain peak" "$work/own-varlen-run.log"
echo "ok   find_package(memfit CONFIG REQUIRED)"

# The same LibTorch as the build under test (MEMFIT_LIBTORCH=debian or pip).
libtorch=$(sed -n 's/^MEMFIT_LIBTORCH:[A-Z]*=//p' "$build/CMakeCache.txt")
cmake -S "$consumer" -B "$work/subdir" -DCMAKE_BUILD_TYPE=Release \
  -DMEMFIT_SOURCE_DIR="$src" -DMEMFIT_LIBTORCH="${libtorch:-debian}" >"$work/subdir-configure.log"
if [ "$subdir_mode" = configure ]; then
  grep -q "consumer" "$work/subdir/Makefile"
  echo "ok   add_subdirectory(memfit) configures (built by the other LibTorch's run)"
else
  # Only the consumer: the other examples were built and run against the
  # installed package above; here the library's own build is what is tested.
  cmake --build "$work/subdir" -j "$jobs" --target consumer >"$work/subdir-build.log"
  "$work/subdir/consumer" | grep -q "refused as expected"
  echo "ok   add_subdirectory(memfit)"
fi
echo "2 passed, 0 failed"
