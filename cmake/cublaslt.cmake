# cuBLASLt for the CUDA GEMM backend (cpp/src/gemm/gemm.cu). Included from the top-level
# CMakeLists.txt inside its CUDA branch, after find_package(CUDAToolkit) and add_library(fusible).
#
# Where cuBLASLt comes from, first match wins:
#   1. FUSIBLE_CUBLASLT_ROOT (cache variable or environment variable): a directory holding
#      include/cublasLt.h and lib/libcublasLt.so* (or lib64/).
#   2. The CUDA toolkit: CUDA::cublasLt from find_package(CUDAToolkit), when the toolkit ships the
#      library and its header.
#   3. The nvidia-cublas Python wheel of the Python interpreter CMake finds (find_package(Python);
#      the one scikit-build-core builds with): site-packages/nvidia/<cu13|cu12|cublas>/include and
#      .../lib/libcublasLt.so.<major>. PyTorch's CUDA wheels depend on this wheel, so a CUDA
#      PyTorch environment always has it.
# When found: fusible links the shared library, defines FUSIBLE_WITH_CUBLASLT, and the library's
# directory goes into the RPATH of every target defined afterwards (the _C module, the tests), so
# they load without LD_LIBRARY_PATH; for the wheel, the installed module also gets
# $ORIGIN/../nvidia/<...>/lib, which finds the wheel in whatever environment fusible is installed
# into. When not found: a status message, and gemm.cu compiles without cuBLASLt (CUDA GEMMs return
# FUS_ERROR_UNSUPPORTED).

set(FUSIBLE_CUBLASLT_ROOT "$ENV{FUSIBLE_CUBLASLT_ROOT}" CACHE PATH
    "Directory with include/cublasLt.h and lib/libcublasLt.so (optional override)")

set(_fus_lt_include "")
set(_fus_lt_library "")
set(_fus_lt_origin "")

# 1. Explicit root.
if(FUSIBLE_CUBLASLT_ROOT)
  find_path(_fus_lt_root_inc cublasLt.h PATHS "${FUSIBLE_CUBLASLT_ROOT}/include" NO_DEFAULT_PATH)
  file(GLOB _fus_lt_root_libs "${FUSIBLE_CUBLASLT_ROOT}/lib/libcublasLt.so*"
       "${FUSIBLE_CUBLASLT_ROOT}/lib64/libcublasLt.so*")
  if(_fus_lt_root_inc AND _fus_lt_root_libs)
    list(SORT _fus_lt_root_libs)
    list(GET _fus_lt_root_libs 0 _fus_lt_library)
    set(_fus_lt_include "${_fus_lt_root_inc}")
    set(_fus_lt_source "FUSIBLE_CUBLASLT_ROOT=${FUSIBLE_CUBLASLT_ROOT}")
  else()
    message(WARNING "fusible: FUSIBLE_CUBLASLT_ROOT=${FUSIBLE_CUBLASLT_ROOT} has no "
                    "include/cublasLt.h and lib/libcublasLt.so*; trying the toolkit and the wheel")
  endif()
endif()

# 2. The CUDA toolkit.
if(NOT _fus_lt_library AND TARGET CUDA::cublasLt)
  find_path(_fus_lt_toolkit_inc cublasLt.h PATHS ${CUDAToolkit_INCLUDE_DIRS} NO_DEFAULT_PATH)
  get_target_property(_fus_lt_toolkit_lib CUDA::cublasLt IMPORTED_LOCATION)
  if(_fus_lt_toolkit_inc AND _fus_lt_toolkit_lib AND EXISTS "${_fus_lt_toolkit_lib}")
    set(_fus_lt_include "${_fus_lt_toolkit_inc}")
    set(_fus_lt_library "${_fus_lt_toolkit_lib}")
    set(_fus_lt_source "CUDA toolkit (CUDA::cublasLt)")
  endif()
endif()

# 3. The nvidia-cublas wheel of the build's Python.
if(NOT _fus_lt_library)
  if(NOT Python_EXECUTABLE)
    find_package(Python COMPONENTS Interpreter QUIET)
  endif()
  if(Python_EXECUTABLE)
    # Prints "<include dir>|<library file>|<library dir relative to site-packages>" of the first
    # nvidia/<sub> directory (cu<major of the toolkit> first) that holds both.
    set(_fus_lt_py [=[
import glob, os, sys
try:
    import nvidia
except ImportError:
    sys.exit(0)
major = sys.argv[1] if len(sys.argv) > 1 else ""
subs = ["cu" + major] if major else []
subs += ["cu13", "cu12", "cublas"]
for base in list(nvidia.__path__):
    site = os.path.dirname(os.path.abspath(base))
    for sub in subs:
        inc = os.path.join(base, sub, "include")
        libs = sorted(glob.glob(os.path.join(base, sub, "lib", "libcublasLt.so*")))
        if os.path.isfile(os.path.join(inc, "cublasLt.h")) and libs:
            lib = libs[0]
            rel = os.path.relpath(os.path.dirname(lib), site)
            print(f"{inc}|{lib}|{rel}", end="")
            sys.exit(0)
]=])
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c "${_fus_lt_py}" "${CUDAToolkit_VERSION_MAJOR}"
      OUTPUT_VARIABLE _fus_lt_found
      RESULT_VARIABLE _fus_lt_rc
      ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(_fus_lt_rc EQUAL 0 AND _fus_lt_found)
      string(REPLACE "|" ";" _fus_lt_found "${_fus_lt_found}")
      list(GET _fus_lt_found 0 _fus_lt_include)
      list(GET _fus_lt_found 1 _fus_lt_library)
      list(GET _fus_lt_found 2 _fus_lt_origin)
      set(_fus_lt_source "nvidia-cublas wheel of ${Python_EXECUTABLE}")
    endif()
  endif()
endif()

if(_fus_lt_library)
  get_filename_component(_fus_lt_libdir "${_fus_lt_library}" DIRECTORY)
  add_library(fusible_cublaslt SHARED IMPORTED GLOBAL)
  set_target_properties(fusible_cublaslt PROPERTIES
    IMPORTED_LOCATION "${_fus_lt_library}"
    INTERFACE_INCLUDE_DIRECTORIES "${_fus_lt_include}")
  # PRIVATE: only gemm.cu includes cublasLt.h; a static library still passes the link on.
  target_link_libraries(fusible PRIVATE fusible_cublaslt)
  target_compile_definitions(fusible PUBLIC FUSIBLE_WITH_CUBLASLT)
  # RPATH for every target defined after this point (the _C module, the test executables).
  list(APPEND CMAKE_BUILD_RPATH "${_fus_lt_libdir}")
  if(_fus_lt_origin)
    # Installed module: site-packages/fusible/_C*.so -> site-packages/<nvidia/.../lib>.
    list(APPEND CMAKE_INSTALL_RPATH "$ORIGIN/../${_fus_lt_origin}")
  endif()
  list(APPEND CMAKE_INSTALL_RPATH "${_fus_lt_libdir}")
  set(FUSIBLE_WITH_CUBLASLT ON)
  message(STATUS "fusible: cuBLASLt from ${_fus_lt_source}: ${_fus_lt_library}")
else()
  set(FUSIBLE_WITH_CUBLASLT OFF)
  message(STATUS "fusible: cuBLASLt not found (no FUSIBLE_CUBLASLT_ROOT, no CUDA::cublasLt, no "
                 "nvidia-cublas wheel); CUDA GEMMs will return FUS_ERROR_UNSUPPORTED")
endif()
