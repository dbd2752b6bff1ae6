#!/usr/bin/env bash
# Packs the build's Debian dependencies (GoogleTest, Google Benchmark, fmt,
# nlohmann-json, CLI11, zlib, gloo's headers for c10d: headers, libraries, CMake configs) and the data
# the tests and benchmarks read (dataset-fashion-mnist, jargon-text) into one
# relocatable prefix, for a GPU machine that has PyTorch but not these (such
# a machine cannot install them). Then, there (cuda-check.sh puts the data
# where Debian would, if it is missing):
#
#   EXTRA_PREFIX_PATH=$PWD/DIR scripts/cuda-check.sh OUTDIR
#
#   scripts/cuda-deps.sh DIR
set -euo pipefail
dir=${1:?usage: scripts/cuda-deps.sh DIR}
rm -rf "$dir"
mkdir -p "$dir"
for pkg in libgtest-dev libbenchmark-dev libfmt-dev libfmt9 libbenchmark1debian nlohmann-json3-dev libcli11-dev zlib1g-dev libgloo-dev \
           dataset-fashion-mnist jargon-text; do
  dpkg -L "$pkg" >/dev/null 2>&1 || { echo "cuda-deps.sh: Debian package $pkg is not installed" >&2; exit 1; }
  dpkg -L "$pkg" | while read -r f; do
    case "$f" in /usr/include/*|/usr/lib/*|/usr/share/cmake/*|/usr/share/datasets/*|*/jargon.txt.gz) ;; *) continue ;; esac
    [ -d "$f" ] && continue
    [ -e "$f" ] || continue
    dest="$dir/${f#/usr/}"
    mkdir -p "$(dirname "$dest")"
    cp -L "$f" "$dest"  # links as files: a link may not travel
  done
done
du -sh "$dir"
