# libjax_fa3_kernels: the sm_90a kernels and their XLA FFI handlers. No Python in here.

set(_sources)
file(GLOB _common_sources CONFIGURE_DEPENDS
     "${PROJECT_SOURCE_DIR}/cuda/common/*.cu" "${PROJECT_SOURCE_DIR}/cuda/common/*.cc"
     "${PROJECT_SOURCE_DIR}/cuda/hadamard/*.cu" "${PROJECT_SOURCE_DIR}/cuda/decode/*.cu"
     "${PROJECT_SOURCE_DIR}/cuda/quantize/*.cu" "${PROJECT_SOURCE_DIR}/cuda/ffi/*.cc"
     "${PROJECT_SOURCE_DIR}/cuda/ffi/*.cu")
list(APPEND _sources ${_common_sources})

# One translation unit per (kernel, head-dim bucket, dtype[, variant]): named
# <kernel>_hdim<D>_<dtype>[_<variant>].cu (e.g. the fp8 d128 kernel with 192-row tiles).
file(GLOB _inst_sources CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/cuda/instantiations/*.cu")
set(_defs)
foreach(_src IN LISTS _inst_sources)
  get_filename_component(_name "${_src}" NAME_WE)
  if(_name MATCHES "_hdim([0-9]+)_(bf16|fp16|e4m3)(_[a-z0-9]+)?$")
    set(_hd "${CMAKE_MATCH_1}")
    set(_dt "${CMAKE_MATCH_2}")
    list(FIND JAX_FA3_HEAD_DIMS "${_hd}" _hd_ok)
    list(FIND JAX_FA3_DTYPES "${_dt}" _dt_ok)
    if(_dt STREQUAL "e4m3")
      set(_dt_ok 0)  # fp8 kernels follow the head-dim list only
    endif()
    if(_hd_ok GREATER -1 AND _dt_ok GREATER -1)
      list(APPEND _sources "${_src}")
    endif()
  else()
    list(APPEND _sources "${_src}")
  endif()
endforeach()
foreach(_hd IN LISTS JAX_FA3_HEAD_DIMS)
  list(APPEND _defs "JAX_FA3_HAS_HDIM${_hd}=1")
endforeach()
foreach(_dt IN LISTS JAX_FA3_DTYPES)
  string(TOUPPER "${_dt}" _DT)
  list(APPEND _defs "JAX_FA3_HAS_${_DT}=1")
endforeach()

add_library(jax_fa3_kernels SHARED ${_sources})
set_target_properties(jax_fa3_kernels PROPERTIES
  CUDA_ARCHITECTURES OFF          # the -gencode below: sm_90a (wgmma, setmaxnreg) needs the 'a' target
  CUDA_STANDARD 17 CXX_STANDARD 17 POSITION_INDEPENDENT_CODE ON
  CUDA_SEPARABLE_COMPILATION OFF CUDA_RUNTIME_LIBRARY Static
  CXX_VISIBILITY_PRESET hidden CUDA_VISIBILITY_PRESET hidden)
target_include_directories(jax_fa3_kernels PUBLIC "${PROJECT_SOURCE_DIR}/cuda")
target_include_directories(jax_fa3_kernels SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}" "${CUTLASS_INCLUDE_DIR}")
target_compile_definitions(jax_fa3_kernels PRIVATE ${_defs})
target_compile_options(jax_fa3_kernels PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr
     --use_fast_math -lineinfo --threads=${JAX_FA3_NVCC_THREADS} -Xptxas=--warn-on-spills>)
# Static cudart: the library then loads on any machine with a driver, whatever CUDA runtime
# (if any) the JAX wheels bring; streams are driver objects shared with XLA's runtime.
target_link_libraries(jax_fa3_kernels PUBLIC CUDA::cudart_static)
