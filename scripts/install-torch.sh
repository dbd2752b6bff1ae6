#!/usr/bin/env bash
# Installs PyPI's torch (LibTorch 2.x with CUDA, and the Python peer of
# bench/peers.py) into a virtual environment under the cache folder, never into
# system Python. Idempotent: returns at once when that torch is already there.
#
#   scripts/install-torch.sh            # or: make deps LIBTORCH=pip
#
# MEMFIT_TORCH_VENV: where the environment goes
#   (default ${XDG_CACHE_HOME:-~/.cache}/memfit/torch-2.15; CMake's default too).
# MEMFIT_TORCH_VERSION: the torch to install (default 2.15.0).
set -euo pipefail

version=${MEMFIT_TORCH_VERSION:-2.15.0}
venv=${MEMFIT_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/memfit/torch-${version%.*}}
python=/usr/bin/python3   # Debian's, whose python3-venv install-deps.sh installs

# Already there: pip's record of it, without starting Python (importing torch takes seconds).
if compgen -G "$venv/lib/python3*/site-packages/torch-$version.dist-info/RECORD" >/dev/null; then
  echo "install-torch: torch $version present in $venv"
  exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "install-torch: creating $venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
fi
echo "install-torch: installing torch $version (with its CUDA libraries, about 5 GB) into $venv"
# numpy: torch's Python API wants it for peers.py's data loading.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==$version" numpy
"$venv/bin/python" -c 'import torch; print("install-torch: torch", torch.__version__, "CUDA", torch.version.cuda)'
