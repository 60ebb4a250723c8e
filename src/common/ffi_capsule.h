// Wraps an FFI handler in the PyCapsule that jax.ffi.register_ffi_target expects.
#pragma once

#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace fp8norm {

inline nanobind::capsule FfiCapsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  return nanobind::capsule(reinterpret_cast<void*>(handler));
}

// A target with a stage before execution ("initialize" or "instantiate") beside its
// execute stage, as jax.ffi.register_ffi_target takes it.
inline nanobind::dict FfiStages(const char* first_stage,
                                XLA_FFI_Error* (*first)(XLA_FFI_CallFrame*),
                                XLA_FFI_Error* (*execute)(XLA_FFI_CallFrame*)) {
  nanobind::dict stages;
  stages[first_stage] = FfiCapsule(first);
  stages["execute"] = FfiCapsule(execute);
  return stages;
}

}  // namespace fp8norm
