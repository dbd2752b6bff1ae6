#!/usr/bin/env bash
# Configuring memfit against a LibTorch it does not support stops at configure
# time, in one line naming what was found and what would work
# (cmake/MemfitLibTorch.cmake).
# Usage: bash tests/configure_test.sh SOURCE_DIR
set -u
src=${1:?usage: configure_test.sh SOURCE_DIR}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=0

# A LibTorch CMake package that says it is version $1 and nothing else.
fake_torch() {
  mkdir -p "$tmp/torch-$1"
  echo 'set(TORCH_FOUND TRUE)' >"$tmp/torch-$1/TorchConfig.cmake"
  printf 'set(PACKAGE_VERSION "%s")\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n' "$1" >"$tmp/torch-$1/TorchConfigVersion.cmake"
  echo "$tmp/torch-$1"
}

# refuses NAME PATTERN CMAKE_ARGS...: configure fails, its error paragraph is
# one line and matches PATTERN.
refuses() {
  local name=$1 pattern=$2
  shift 2
  rm -rf "$tmp/build"
  if cmake -S "$src" -B "$tmp/build" -DMEMFIT_BUILD_TESTS=OFF -DMEMFIT_BUILD_BENCH=OFF -DMEMFIT_BUILD_CLI=OFF \
       "$@" >"$tmp/out" 2>&1; then
    echo "FAIL $name: configure succeeded"; failed=$((failed + 1)); return
  fi
  local line
  line=$(grep -E '^ +memfit: ' "$tmp/out")
  if [ "$(printf '%s\n' "$line" | grep -c .)" -ne 1 ] || ! printf '%s' "$line" | grep -qE -- "$pattern"; then
    echo "FAIL $name: expected one line matching /$pattern/, got:"; sed 's/^/  | /' "$tmp/out" | tail -15
    failed=$((failed + 1)); return
  fi
  echo "ok   $name:$line"
}

refuses too_old "LibTorch 1\.12\.1 found .*supports LibTorch 1\.13 to 2\.15" -DTorch_DIR="$(fake_torch 1.12.1)"
refuses too_new "LibTorch 2\.16\.0 found .*supports LibTorch 1\.13 to 2\.15" -DTorch_DIR="$(fake_torch 2.16.0)"
refuses no_pip_torch "MEMFIT_LIBTORCH=pip needs torch 2\.15\.0 in $tmp/none, which does not exist; install it with scripts/install-torch\.sh" \
  -DMEMFIT_LIBTORCH=pip -DMEMFIT_TORCH_VENV="$tmp/none"
mkdir -p "$tmp/empty-venv/bin" && ln -s /bin/false "$tmp/empty-venv/bin/python"
refuses pip_venv_without_torch "cannot import torch; install torch 2\.15\.0 with scripts/install-torch\.sh" \
  -DMEMFIT_LIBTORCH=pip -DMEMFIT_TORCH_VENV="$tmp/empty-venv"
refuses unknown_choice "MEMFIT_LIBTORCH is 'conda'; use debian .* or pip" -DMEMFIT_LIBTORCH=conda

[ "$failed" -eq 0 ] && echo "configure tests: all passed" || echo "configure tests: $failed failed"
exit $((failed > 0))
