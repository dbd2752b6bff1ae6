#!/usr/bin/env bash
# Installs memfit's Debian 12 packages, skipping those already present; with
# --torch, also PyPI's torch for the LibTorch 2.x build (scripts/install-torch.sh).
# Usage: scripts/install-deps.sh [--torch]   (as root, or with sudo available)
set -euo pipefail

with_torch=0
for arg in "$@"; do
  case "$arg" in
    --torch) with_torch=1 ;;
    *) echo "install-deps: unknown argument '$arg'; use --torch (or nothing)" >&2; exit 2 ;;
  esac
done

packages=(
  build-essential cmake make pkg-config ccache
  libtorch-dev libgloo-dev zlib1g-dev
  libopenblas0-openmp libblas3
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev
  dataset-fashion-mnist jargon-text
  python3-torch python3-torchvision python3-venv python3-dev
  chromium
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

sudo=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then sudo="sudo"; fi

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
else
  echo "install-deps: installing ${missing[*]}"
  if [ "$(id -u)" -ne 0 ] && [ -z "$sudo" ]; then
    echo "install-deps: need root or sudo to install: ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# Debian's LibTorch calls whichever libblas.so.3 (and liblapack.so.3) the
# alternatives select. OpenBLAS's OpenMP variant shares LibTorch's OpenMP
# threads; the netlib reference (libblas3, installed only for memfit's BLAS
# detection test) is hundreds of times slower, and OpenBLAS's pthread variant
# oversubscribes the cores beside LibTorch's threads. Where either of those is
# selected, select the OpenMP variant; any other choice (MKL, BLIS) is left.
arch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
for lib in libblas.so.3 liblapack.so.3 libopenblas.so.0; do
  name="$lib-$arch"
  want="/usr/lib/$arch/openblas-openmp/$lib"
  [ -e "$want" ] || continue
  current=$(update-alternatives --query "$name" 2>/dev/null | sed -n 's/^Value: //p' || true)
  case "$current" in
    "$want") ;;
    ""|*/blas/*|*/lapack/*|*/openblas-pthread/*)
      if [ "$(id -u)" -ne 0 ] && [ -z "$sudo" ]; then
        echo "install-deps: warning: $lib is ${current:-not selected}; as root run: update-alternatives --set $name $want" >&2
      else
        echo "install-deps: selecting $want for $lib (was ${current:-none})"
        $sudo update-alternatives --set "$name" "$want"
      fi ;;
  esac
done

if [ "$with_torch" = 1 ]; then
  bash "$(dirname "$0")/install-torch.sh"
fi
