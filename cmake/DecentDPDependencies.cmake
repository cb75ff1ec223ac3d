# Third-party dependencies of the build tree.

find_program(DECENT_DP_CCACHE ccache)
if(DECENT_DP_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_C_COMPILER_LAUNCHER ${DECENT_DP_CCACHE})
  set(CMAKE_CXX_COMPILER_LAUNCHER ${DECENT_DP_CCACHE})
endif()

find_package(Threads REQUIRED)
# The C API through the C++ component (no C compiler needed); the deprecated C++ bindings
# are skipped.
set(MPI_CXX_SKIP_MPICXX ON)
find_package(MPI REQUIRED COMPONENTS CXX)

# A CUDA build of LibTorch needs the CUDA toolkit to configure, not a GPU.
if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  set(CUDAToolkit_ROOT /usr/local/cuda)
endif()

# LibTorch: a user's CMAKE_PREFIX_PATH / Torch_DIR is searched first; after it, the CMake
# package of the torch wheel of the project's virtual environment (scripts/bootstrap), or of
# the Python named by DECENT_DP_PYTHON.
set(DECENT_DP_PYTHON "" CACHE FILEPATH "Python whose torch package provides LibTorch")
if(NOT DECENT_DP_PYTHON)
  if(DEFINED ENV{DECENT_DP_VENV})
    set(_venv "$ENV{DECENT_DP_VENV}")
  else()
    set(_venv "$ENV{HOME}/.cache/decent_dp/venv")
  endif()
  if(EXISTS "${_venv}/bin/python")
    set(_python "${_venv}/bin/python")
  else()
    find_program(_python NAMES python3 python)
  endif()
else()
  set(_python "${DECENT_DP_PYTHON}")
endif()
if(_python)
  execute_process(
    COMMAND "${_python}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE _torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _torch_rc ERROR_QUIET)
  if(_torch_rc EQUAL 0)
    list(APPEND CMAKE_PREFIX_PATH "${_torch_prefix}")
    set(DECENT_DP_TORCH_PREFIX "${_torch_prefix}" CACHE INTERNAL "")
    # The Python of the example and sweep tests (it has matplotlib when it is the venv's).
    set(DECENT_DP_PYTHON_EXECUTABLE "${_python}" CACHE INTERNAL "")
  endif()
endif()
find_package(Torch CONFIG)
if(NOT Torch_FOUND)
  message(FATAL_ERROR
    "LibTorch not found. Run scripts/bootstrap, or pass -DCMAKE_PREFIX_PATH=<libtorch>, "
    "or -DDECENT_DP_PYTHON=<python with torch installed> (tried '${_python}').")
endif()
message(STATUS "decent_dp: LibTorch ${Torch_VERSION} from ${Torch_DIR}")

# NCCL (the backend of CUDA tensors, Note [NCCL backend]): >= 2.18 for ncclCommSplit, and a
# CUDA build of LibTorch for its streams, events and caching allocator. AUTO builds it when
# both are found; ON fails the configuration when either is missing.
set(DECENT_DP_HAVE_NCCL OFF)
set(DECENT_DP_NCCL_MIN_VERSION 2.18)
if(NOT DECENT_DP_WITH_NCCL MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "DECENT_DP_WITH_NCCL must be AUTO, ON or OFF, got '${DECENT_DP_WITH_NCCL}'")
endif()
if(NOT DECENT_DP_WITH_NCCL STREQUAL "OFF")
  find_package(NCCL ${DECENT_DP_NCCL_MIN_VERSION})
  if(NCCL_FOUND AND TARGET torch_cuda)
    set(DECENT_DP_HAVE_NCCL ON)
  elseif(DECENT_DP_WITH_NCCL STREQUAL "ON")
    if(NOT TARGET torch_cuda)
      set(_why "LibTorch ${Torch_VERSION} from ${Torch_DIR} is not a CUDA build")
    else()
      set(_why "NCCL >= ${DECENT_DP_NCCL_MIN_VERSION} was not found (NCCL_INCLUDE_DIR="
               "${NCCL_INCLUDE_DIR}, NCCL_LIBRARY=${NCCL_LIBRARY}, version '${NCCL_VERSION}'; "
               "set NCCL_ROOT)")
    endif()
    message(FATAL_ERROR "DECENT_DP_WITH_NCCL=ON, but ${_why}")
  endif()
endif()
message(STATUS "decent_dp: NCCL backend ${DECENT_DP_HAVE_NCCL} (NCCL ${NCCL_VERSION})")

find_path(DECENT_DP_FMT_INCLUDE fmt/format.h)
if(NOT DECENT_DP_FMT_INCLUDE)
  message(FATAL_ERROR "fmt headers not found (Debian: libfmt-dev; run scripts/bootstrap)")
endif()
