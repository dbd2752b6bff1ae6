# Which LibTorch memfit builds against, and the check that it is one memfit
# supports. Included by the top-level CMakeLists.txt before find_package(Torch).
#
#   MEMFIT_LIBTORCH=debian  Debian's libtorch-dev (1.13, CPU) — the default
#   MEMFIT_LIBTORCH=pip     the LibTorch inside the pip torch installed by
#                           scripts/install-torch.sh into MEMFIT_TORCH_VENV
#                           (with CUDA: every CUDA path is compiled)
#
# An explicit Torch_DIR (or CMAKE_PREFIX_PATH) still works with "debian": it is
# the LibTorch a user downloaded; its version is checked all the same.

set(MEMFIT_TORCH_MIN 1.13)
set(MEMFIT_TORCH_MAX 2.15)
set(MEMFIT_TORCH_PIP_VERSION 2.15.0)

if(DEFINED ENV{XDG_CACHE_HOME} AND NOT "$ENV{XDG_CACHE_HOME}" STREQUAL "")
  set(_memfit_cache "$ENV{XDG_CACHE_HOME}")
else()
  set(_memfit_cache "$ENV{HOME}/.cache")
endif()
set(MEMFIT_LIBTORCH "debian" CACHE STRING
    "LibTorch to build against: debian (libtorch-dev 1.13) or pip (torch ${MEMFIT_TORCH_PIP_VERSION} in MEMFIT_TORCH_VENV)")
set_property(CACHE MEMFIT_LIBTORCH PROPERTY STRINGS debian pip)
set(MEMFIT_TORCH_VENV "${_memfit_cache}/memfit/torch-${MEMFIT_TORCH_MAX}" CACHE PATH
    "Virtual environment holding the pip torch (MEMFIT_LIBTORCH=pip)")

if(NOT MEMFIT_LIBTORCH MATCHES "^(debian|pip)$")
  message(FATAL_ERROR " memfit: MEMFIT_LIBTORCH is '${MEMFIT_LIBTORCH}'; use debian (Debian's libtorch-dev) or pip (the torch that scripts/install-torch.sh installs)")
endif()

# Switching MEMFIT_LIBTORCH in an existing build folder: forget the Torch
# (and Caffe2) found for the other one.
if(DEFINED _MEMFIT_LIBTORCH_CONFIGURED AND NOT _MEMFIT_LIBTORCH_CONFIGURED STREQUAL MEMFIT_LIBTORCH)
  unset(Torch_DIR CACHE)
  unset(Caffe2_DIR CACHE)
  unset(TORCH_LIBRARY CACHE)
  unset(C10_LIBRARY CACHE)
endif()
set(_MEMFIT_LIBTORCH_CONFIGURED "${MEMFIT_LIBTORCH}" CACHE INTERNAL "")

if(MEMFIT_LIBTORCH STREQUAL "pip")
  set(_python "${MEMFIT_TORCH_VENV}/bin/python")
  set(_install "scripts/install-torch.sh (or: make deps LIBTORCH=pip)")
  if(NOT EXISTS "${_python}")
    message(FATAL_ERROR " memfit: MEMFIT_LIBTORCH=pip needs torch ${MEMFIT_TORCH_PIP_VERSION} in ${MEMFIT_TORCH_VENV}, which does not exist; install it with ${_install}")
  endif()
  execute_process(
    COMMAND "${_python}" -c "import torch, torch.utils; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE _prefix OUTPUT_STRIP_TRAILING_WHITESPACE
    ERROR_QUIET RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0 OR NOT EXISTS "${_prefix}/Torch/TorchConfig.cmake")
    message(FATAL_ERROR " memfit: MEMFIT_LIBTORCH=pip: ${_python} cannot import torch; install torch ${MEMFIT_TORCH_PIP_VERSION} with ${_install}")
  endif()
  # Torch's package finds its libraries and Caffe2's package through the
  # search paths, where Debian's /usr would otherwise come first.
  set(Torch_DIR "${_prefix}/Torch" CACHE PATH "LibTorch's CMake package" FORCE)
  set(Caffe2_DIR "${_prefix}/Caffe2" CACHE PATH "LibTorch's Caffe2 CMake package" FORCE)
  get_filename_component(_torch_root "${_prefix}/../.." ABSOLUTE)
  set(MEMFIT_TORCH_PREFIXES "${_torch_root};${_prefix}")
  list(PREPEND CMAKE_PREFIX_PATH ${MEMFIT_TORCH_PREFIXES})
  # The wheel's LibTorch is built with CUDA; its CMake package looks for the
  # CUDA toolkit (nvcc, cuDNN, NCCL's header) to compile memfit's CUDA paths.
  if(NOT DEFINED CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDAToolkit_ROOT} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  set(MEMFIT_TORCH_PYTHON "${_python}")
endif()

# (Each message starts with a space: CMake prints such a paragraph as it is,
# one line, instead of wrapping it.)

# Called after add_library(memfit). A LibTorch inside a pip wheel
# (site-packages/torch, whichever way it was found) finds the wheel's CUDA
# libraries, NCCL among them, through an $ORIGIN rpath, which the linker does
# not follow: without -rpath-link it links against an older libnccl.so.2 of
# the toolkit's and misses symbols. Public, so memfit's users link too.
function(memfit_link_wheel_libraries target)
  get_filename_component(_site "${Torch_DIR}/../../../.." ABSOLUTE)
  file(GLOB _nvidia_libs LIST_DIRECTORIES true "${_site}/nvidia/*/lib")
  if(_nvidia_libs)
    list(JOIN _nvidia_libs ":" _nvidia_path)
    target_link_options(${target} INTERFACE "LINKER:-rpath-link,${_nvidia_path}")
  endif()
endfunction()

# Called after find_package(Torch): stop at configure time on a LibTorch
# outside the supported range, naming the version found and the range.
function(memfit_check_torch_version)
  set(_v "${Torch_VERSION}")
  if(_v STREQUAL "")
    set(_v "${TORCH_VERSION}")
  endif()
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" _mm "${_v}")
  if(_mm STREQUAL "" OR _mm VERSION_LESS MEMFIT_TORCH_MIN OR _mm VERSION_GREATER MEMFIT_TORCH_MAX)
    if(_v STREQUAL "")
      set(_v "of unknown version")
    endif()
    message(FATAL_ERROR " memfit: LibTorch ${_v} found (Torch_DIR=${Torch_DIR}); memfit supports LibTorch ${MEMFIT_TORCH_MIN} to ${MEMFIT_TORCH_MAX}: set Torch_DIR to one of those, or -DMEMFIT_LIBTORCH=debian|pip")
  endif()
endfunction()
