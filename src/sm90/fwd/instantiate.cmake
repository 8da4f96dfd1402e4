# Generates the Hopper kernel instantiations: one .cu per (head dim, dtype, PV path, K scale
# layout, Q smoothing), so that compile time parallelizes and a build restricted by SAGE_HEAD_DIMS compiles
# only those. The (PV path, K scales) pairs are the ones some preset uses (dispatch.cu maps
# recipes onto them); a custom recipe outside them is refused by name, not approximated.
set(_gen_dir ${CMAKE_CURRENT_BINARY_DIR}/generated)
file(MAKE_DIRECTORY ${_gen_dir}/sm90/fwd)

# The head dims that have a kernel are declared once, in kernel_traits.h.
file(STRINGS ${CMAKE_CURRENT_LIST_DIR}/kernel_traits.h _dims_line
     REGEX "^#define SAGE_SUPPORTED_HEAD_DIMS\\(X\\)")
string(REGEX MATCHALL "X\\(([0-9]+)\\)" _dims_calls "${_dims_line}")
string(REGEX REPLACE "X\\(([0-9]+)\\)" "\\1" _allowed_dims "${_dims_calls}")
if(NOT _allowed_dims)
  message(FATAL_ERROR "instantiate.cmake: no SAGE_SUPPORTED_HEAD_DIMS line in kernel_traits.h")
endif()
if(SAGE_HEAD_DIMS STREQUAL "all")
  set(SAGE_HEAD_DIMS ${_allowed_dims})
endif()
set(_dims_macro "")
set(_kv_dims "")
foreach(d ${SAGE_HEAD_DIMS})
  if(NOT d IN_LIST _allowed_dims)
    message(FATAL_ERROR "SAGE_HEAD_DIMS: ${d} has no kernel (kernel_traits.h lists ${_allowed_dims})")
  endif()
  string(APPEND _dims_macro " X(${d})")
  # The K/V pre-pass runs at the workspace's row size (quant/kv_layout.h, kv_layout_head_dim).
  if(d LESS_EQUAL 64)
    list(APPEND _kv_dims 64)
  elseif(d LESS_EQUAL 128)
    list(APPEND _kv_dims 128)
  else()
    list(APPEND _kv_dims 256)
  endif()
endforeach()
list(REMOVE_DUPLICATES _kv_dims)
set(_kv_dims_macro "")
foreach(d ${_kv_dims})
  string(APPEND _kv_dims_macro " X(${d})")
endforeach()
string(REPLACE ";" ", " _dims_list "${SAGE_HEAD_DIMS}")

# path:kscales:smooth_q, in the names of sm90::PVPath and sm90::KScales, and 0/1.
set(_all_variants
  e4m3_two_level:per_tile:0  # sage2_8b, sage2_8b_vsmooth
  e4m3_two_level:per_tile:1  # sage2_4b
  e4m3_fp16x2:per_tile:0     # sage2pp_8b
  e4m3_fp16x2:per_tile:1     # sage2pp_4b
  fp16:per_token:0           # sage1_t
  fp16:per_tile:0            # sage1_b
  int8:per_token:0           # sage1_vt, int_flash, int_flash_q
  int8:per_tile:0            # sage1_vb
  int8_dynamic:per_tile:0)   # sagebwd (forward)
# A subset for quick experiment builds (gpu_run.sh knobs: sage2_8b only); a recipe whose
# variant is left out is refused by name at run time.
set(SAGE_KERNEL_VARIANTS "all" CACHE STRING
    "Kernel variants to instantiate (all, or a ;-list of path:kscales:smooth_q)")
if(SAGE_KERNEL_VARIANTS STREQUAL "all")
  set(_variants ${_all_variants})
else()
  set(_variants ${SAGE_KERNEL_VARIANTS})
  foreach(v ${_variants})
    if(NOT v IN_LIST _all_variants)
      message(FATAL_ERROR "SAGE_KERNEL_VARIANTS: ${v} is not one of ${_all_variants}")
    endif()
  endforeach()
endif()
# Packed variable-length batches (sage/varlen.h): two more instantiations per file's variant
# (with and without a left window bound; launch.cuh, launch_attention_varlen), in files of
# their own (*_varlen.cu). OFF: none are compiled and attention_varlen refuses by name.
option(SAGE_VARLEN_KERNELS "Instantiate the kernels of packed variable-length batches" ON)
if(SAGE_VARLEN_KERNELS)
  set(_varlen_value 1)
else()
  set(_varlen_value 0)
endif()
set(_variants_macro "")
foreach(v ${_variants})
  string(REPLACE ":" ";" _triple "${v}")
  list(GET _triple 0 _path)
  list(GET _triple 1 _ks)
  list(GET _triple 2 _sq)
  string(APPEND _variants_macro " X(${_path}, ${_ks}, ${_sq})")
endforeach()

file(CONFIGURE OUTPUT ${_gen_dir}/built_kernels.h CONTENT
"// GENERATED from SAGE_HEAD_DIMS and SAGE_KERNEL_VARIANTS by src/sm90/fwd/instantiate.cmake:
// the kernels this build has (a subset of what kernel_traits.h supports).
#pragma once
#define SAGE_FOR_EACH_HEAD_DIM(X)${_dims_macro}
#define SAGE_HEAD_DIMS_STRING \"${_dims_list}\"
// The workspace row sizes (quant::kv_layout_head_dim) of those: the K/V pre-pass's instantiations.
#define SAGE_FOR_EACH_KV_LAYOUT_DIM(X)${_kv_dims_macro}
// The (PV path, K scale layout, Q smoothing) triples that have a kernel.
#define SAGE_FOR_EACH_KERNEL_VARIANT(X)${_variants_macro}
// Whether every variant above also has its packed variable-length instantiations.
#define SAGE_VARLEN_KERNELS ${_varlen_value}
")

set(SAGE_SM90_GENERATED_SOURCES "")
foreach(d ${SAGE_HEAD_DIMS})
  foreach(t half bf16)
    if(t STREQUAL "half")
      set(_ctype "__half")
    else()
      set(_ctype "__nv_bfloat16")
    endif()
    foreach(v ${_variants})
      string(REPLACE ":" ";" _triple "${v}")
      list(GET _triple 0 _path)
      list(GET _triple 1 _ks)
      list(GET _triple 2 _sq)
      # kernel_traits.h variant_has_kernel: no fp16 or int8_dynamic PV above d = 128.
      if(d GREATER 128 AND (_path STREQUAL "fp16" OR _path STREQUAL "int8_dynamic"))
        continue()
      endif()
      if(_sq)
        set(_sq_bool true)
        set(_sq_name _smooth_q)
      else()
        set(_sq_bool false)
        set(_sq_name "")
      endif()
      set(_file ${_gen_dir}/sm90/fwd/attention_d${d}_${t}_${_path}_${_ks}${_sq_name}.cu)
      file(CONFIGURE OUTPUT ${_file} CONTENT
"// GENERATED by src/sm90/fwd/instantiate.cmake: the sm90 attention kernel for head_dim ${d}, ${t},
// PV path ${_path}, K scales ${_ks}, Q smoothing ${_sq_bool}.
#include \"sm90/fwd/launch.cuh\"
namespace sage::sm90 {
template void launch_attention<${d}, ${_ctype}, PVPath::${_path}, KScales::${_ks}, ${_sq_bool}>(
    const AttentionParams&, const AttentionMaps&, cudaStream_t);
}  // namespace sage::sm90
")
      list(APPEND SAGE_SM90_GENERATED_SOURCES ${_file})
      if(SAGE_VARLEN_KERNELS)
        set(_file ${_gen_dir}/sm90/fwd/attention_d${d}_${t}_${_path}_${_ks}${_sq_name}_varlen.cu)
        file(CONFIGURE OUTPUT ${_file} CONTENT
"// GENERATED by src/sm90/fwd/instantiate.cmake: the sm90 attention kernels of packed
// variable-length batches for head_dim ${d}, ${t}, PV path ${_path}, K scales ${_ks}, Q smoothing ${_sq_bool}.
#include \"sm90/fwd/launch.cuh\"
namespace sage::sm90 {
template void launch_attention_varlen<${d}, ${_ctype}, PVPath::${_path}, KScales::${_ks}, ${_sq_bool}>(
    const AttentionParams&, const AttentionMaps&, cudaStream_t);
}  // namespace sage::sm90
")
        list(APPEND SAGE_SM90_GENERATED_SOURCES ${_file})
      endif()
    endforeach()
  endforeach()
endforeach()
