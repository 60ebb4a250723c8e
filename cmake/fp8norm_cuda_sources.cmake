# The CUDA path's sources by role, for the GPU build (CMakeLists.txt) and for the SIMT
# emulation's builds (CMakeLists.txt's _fp8norm_simt, tests/simt): the kernel families,
# which nvcc compiles, the host code of their launch, and the emulation's runtime.
set(FP8NORM_CUDA_KERNEL_FILES block_shared.cu register_rows.cu round.cu allreduce.cu backward.cu
  columnwise.cu quantize_weight.cu quantize_gradient.cu)
set(FP8NORM_CUDA_LAUNCH_FILES device_setup.cc peer_workspaces.cc)
# The SIMT emulation's runtime (src/simt), which every emulated build links.
set(FP8NORM_SIMT_RUNTIME_FILES
  runtime_api.cc launch_check.cc scheduler.cc memory_accounting.cc peer_signals.cc fiber.cc)

# The emulation's sources for the CUDA files in `cuda_dir`: the launch's .cc files as they
# are, and for each .cu file a generated translation unit that includes it, so that the
# host compiler compiles the .cu file itself, not a copy of it.
function(fp8norm_emulated_cuda_sources out cuda_dir)
  set(_sources)
  foreach(_file IN LISTS FP8NORM_CUDA_KERNEL_FILES)
    get_filename_component(_name "${_file}" NAME_WE)
    set(_unit "${CMAKE_CURRENT_BINARY_DIR}/simt_cuda/${_name}.cc")
    file(CONFIGURE OUTPUT "${_unit}" CONTENT "#include \"${cuda_dir}/${_file}\"\n")
    list(APPEND _sources "${_unit}")
  endforeach()
  foreach(_file IN LISTS FP8NORM_CUDA_LAUNCH_FILES)
    list(APPEND _sources "${cuda_dir}/${_file}")
  endforeach()
  set(${out} ${_sources} PARENT_SCOPE)
endfunction()

# The emulation's runtime sources in `simt_dir`.
function(fp8norm_simt_runtime_sources out simt_dir)
  list(TRANSFORM FP8NORM_SIMT_RUNTIME_FILES PREPEND "${simt_dir}/" OUTPUT_VARIABLE _sources)
  set(${out} ${_sources} PARENT_SCOPE)
endfunction()
