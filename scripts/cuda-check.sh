#!/usr/bin/env bash
# Builds memfit against the PyTorch (LibTorch 2.x with CUDA) that python3 imports,
# then runs the test suite (CUDA tests included), the CUDA benchmarks and a CUDA
# training run. Logs go to OUTDIR.
#
#   scripts/cuda-check.sh OUTDIR
#
# EXTRA_PREFIX_PATH: where GTest, benchmark, CLI11, fmt and nlohmann_json are,
# when not under /usr (a ;-separated CMake list; scripts/cuda-deps.sh packs
# them, with the data, into one such prefix). BUILD_DIR: default build-cuda.
# TARGETS: what to build (default: everything). TESTS=cuda: only the CUDA
# tests (memfit_tests --gtest_filter='Cuda*'), not the whole suite.
set -uo pipefail
out=${1:?usage: scripts/cuda-check.sh OUTDIR}
mkdir -p "$out"
build=${BUILD_DIR:-build-cuda}
# The data Debian's packages would install, from a prefix cuda-deps.sh packed.
extra=${EXTRA_PREFIX_PATH:-}
for prefix in ${extra//;/ }; do
  [ -d /usr/share/datasets/fashion-mnist ] || [ ! -d "$prefix/share/datasets/fashion-mnist" ] ||
    { mkdir -p /usr/share/datasets && cp -r "$prefix/share/datasets/fashion-mnist" /usr/share/datasets/; }
  [ -f /usr/share/doc/jargon-text/jargon.txt.gz ] || [ ! -f "$prefix/share/doc/jargon-text/jargon.txt.gz" ] ||
    { mkdir -p /usr/share/doc/jargon-text && cp "$prefix/share/doc/jargon-text/jargon.txt.gz" /usr/share/doc/jargon-text/; }
done
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') || exit 1
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))' | tee "$out/env.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/env.txt"

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix;${EXTRA_PREFIX_PATH:-}" ${CMAKE_EXTRA:-} >"$out/configure.log" 2>&1 \
  || { tail -30 "$out/configure.log"; exit 1; }
grep "memfit:" "$out/configure.log"
if ! cmake --build "$build" -j "$(nproc)" ${TARGETS:+--target $TARGETS} -- -k 0 >"$out/build.log" 2>&1; then
  grep -E "error|FAILED" "$out/build.log" | head -40; exit 1
fi
echo "build ok"

# One thread per test process: on a 16-core machine, 16 processes of 16
# threads each ran the CPU tests 50x slower than one thread each.
if [ "${TESTS:-all}" != cuda ]; then
  (cd "$build" && OMP_NUM_THREADS=1 ctest -j "$(nproc)" --output-on-failure -E package --timeout 600) >"$out/ctest.log" 2>&1
  grep -E "tests passed|tests failed|\*\*\*Failed|Not Run|Timeout" "$out/ctest.log"
fi
"$build/tests/memfit_tests" --gtest_filter='Cuda*' >"$out/cuda_tests.log" 2>&1
grep -E "^\[  (PASSED|FAILED|SKIPPED) |OK \]" "$out/cuda_tests.log"
