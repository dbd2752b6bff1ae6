#!/usr/bin/env bash
# Builds memfit against the PyTorch (LibTorch 2.x with CUDA) that python3 imports,
# then runs the test suite (CUDA tests included), the CUDA benchmarks and a CUDA
# training run. Logs go to OUTDIR.
#
#   scripts/cuda-check.sh OUTDIR
#
# EXTRA_PREFIX_PATH: where GTest, benchmark, CLI11, fmt and nlohmann_json are,
# when not under /usr (a ;-separated CMake list). BUILD_DIR: default build-cuda.
set -uo pipefail
out=${1:?usage: scripts/cuda-check.sh OUTDIR}
mkdir -p "$out"
build=${BUILD_DIR:-build-cuda}
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') || exit 1
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))' | tee "$out/env.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/env.txt"

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix;${EXTRA_PREFIX_PATH:-}" ${CMAKE_EXTRA:-} >"$out/configure.log" 2>&1 \
  || { tail -30 "$out/configure.log"; exit 1; }
grep "memfit:" "$out/configure.log"
if ! cmake --build "$build" -j "$(nproc)" -- -k 0 >"$out/build.log" 2>&1; then
  grep -E "error|FAILED" "$out/build.log" | head -40; exit 1
fi
echo "build ok"

# One thread per test process: on a 16-core machine, 16 processes of 16
# threads each ran the CPU tests 50x slower than one thread each.
(cd "$build" && OMP_NUM_THREADS=1 ctest -j "$(nproc)" --output-on-failure -E package --timeout 600) >"$out/ctest.log" 2>&1
grep -E "tests passed|tests failed|\*\*\*Failed|Not Run|Timeout" "$out/ctest.log"
"$build/tests/memfit_tests" --gtest_filter='Cuda*' >"$out/cuda_tests.log" 2>&1
grep -E "^\[  (PASSED|FAILED|SKIPPED) |OK \]" "$out/cuda_tests.log"
