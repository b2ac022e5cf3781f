# CUDA backend switch. Sets SPARSE_ATTN_WITH_CUDA. The native kernels live in src/cuda and are
# compiled for sm_90a (Hopper); SPARSE_ATTN_CUDA_ARCHS may add architectures.
#
#   SPARSE_ATTN_CUDA=AUTO  build the CUDA backend when nvcc is found (the default; CI has nvcc,
#                          so it compiles the CUDA code even without a GPU)
#   SPARSE_ATTN_CUDA=ON    require it
#   SPARSE_ATTN_CUDA=OFF   CPU only
set(SPARSE_ATTN_WITH_CUDA OFF)
string(TOUPPER "${SPARSE_ATTN_CUDA}" _sa_cuda_mode)
if(NOT _sa_cuda_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "SPARSE_ATTN_CUDA must be AUTO, ON or OFF, got '${SPARSE_ATTN_CUDA}'")
endif()

# Extra -gencode targets beyond sm_90a, e.g. "arch=compute_90,code=compute_90" for PTX.
set(SPARSE_ATTN_CUDA_ARCHS "" CACHE STRING
    "Additional nvcc -gencode values (semicolon list); sm_90a is always built")
# Where cute/ and cutlass/ live. Empty: third_party/cutlass-include, else the pip package
# nvidia-cutlass (its cutlass_library/source/include).
set(SPARSE_ATTN_CUTLASS_INCLUDE_DIR "" CACHE PATH "CUTLASS/CuTe include directory")

if(NOT _sa_cuda_mode STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(SPARSE_ATTN_WITH_CUDA ON)
  elseif(_sa_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "SPARSE_ATTN_CUDA=ON but no CUDA compiler (nvcc) was found")
  else()
    message(STATUS "sparse_attn: no nvcc found, building the CPU backend only")
  endif()
endif()

if(NOT SPARSE_ATTN_WITH_CUDA)
  return()
endif()

enable_language(CUDA)
# C++17 for device code: CMake 3.24/3.25 do not know that nvcc 12+ accepts C++20, and CuTe
# needs no more. Host-only sources stay C++20.
find_package(CUDAToolkit REQUIRED)

if(NOT SPARSE_ATTN_CUTLASS_INCLUDE_DIR)
  if(EXISTS ${PROJECT_SOURCE_DIR}/third_party/cutlass-include/cute)
    set(SPARSE_ATTN_CUTLASS_INCLUDE_DIR ${PROJECT_SOURCE_DIR}/third_party/cutlass-include)
  else()
    # The interpreter scripts/build names (the one scripts/install-deps installed into), or
    # under pip the build environment's, which has nvidia-cutlass from pyproject.toml's
    # build requirements (scikit-build-core passes Python_EXECUTABLE; pip's environment
    # variables make the isolated packages importable in this child process too).
    if(Python_EXECUTABLE)
      set(_sa_python ${Python_EXECUTABLE})
    else()
      find_program(_sa_python NAMES python3 python)
    endif()
    if(_sa_python)
      execute_process(
        COMMAND ${_sa_python} -c
                "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
        OUTPUT_VARIABLE _sa_cutlass_dir OUTPUT_STRIP_TRAILING_WHITESPACE
        RESULT_VARIABLE _sa_cutlass_rc ERROR_QUIET)
      if(_sa_cutlass_rc EQUAL 0 AND EXISTS ${_sa_cutlass_dir}/cute)
        set(SPARSE_ATTN_CUTLASS_INCLUDE_DIR ${_sa_cutlass_dir})
      endif()
    endif()
  endif()
endif()
if(NOT EXISTS ${SPARSE_ATTN_CUTLASS_INCLUDE_DIR}/cute/tensor.hpp)
  message(FATAL_ERROR
    "sparse_attn: CUTLASS/CuTe headers not found. Install them with "
    "'pip install nvidia-cutlass==4.2.0.0' (scripts/install-deps does), or pass "
    "-DSPARSE_ATTN_CUTLASS_INCLUDE_DIR=<dir holding cute/ and cutlass/>, or "
    "-DSPARSE_ATTN_CUDA=OFF for a CPU-only build.")
endif()
message(STATUS "sparse_attn: CUDA backend on (nvcc ${CMAKE_CUDA_COMPILER_VERSION}), "
               "CUTLASS headers in ${SPARSE_ATTN_CUTLASS_INCLUDE_DIR}")

file(GLOB_RECURSE SPARSE_ATTN_CUDA_SOURCES CONFIGURE_DEPENDS
     ${PROJECT_SOURCE_DIR}/src/cuda/*.cu ${PROJECT_SOURCE_DIR}/src/cuda/*.cpp)
target_sources(sparse_attn PRIVATE ${SPARSE_ATTN_CUDA_SOURCES})
target_include_directories(sparse_attn SYSTEM PRIVATE ${SPARSE_ATTN_CUTLASS_INCLUDE_DIR})
set(_sa_gencode "-gencode=arch=compute_90a,code=sm_90a")
foreach(arch IN LISTS SPARSE_ATTN_CUDA_ARCHS)
  list(APPEND _sa_gencode "-gencode=${arch}")
endforeach()
# The architectures come from -gencode: CMake 3.24 does not know the "90a" spelling, and
# sm_90a (wgmma, setmaxnreg) must be the 'a' target.
set_target_properties(sparse_attn PROPERTIES CUDA_ARCHITECTURES OFF CUDA_STANDARD 17
                                             CUDA_STANDARD_REQUIRED ON)
target_compile_options(sparse_attn PRIVATE
  "$<$<COMPILE_LANGUAGE:CUDA>:${_sa_gencode};--expt-relaxed-constexpr;-lineinfo;-Xcompiler=-Wall>")
target_compile_definitions(sparse_attn PRIVATE SPARSE_ATTN_WITH_CUDA)
target_link_libraries(sparse_attn PRIVATE CUDA::cudart)
