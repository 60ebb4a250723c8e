// Wraps an FFI handler in the PyCapsule that jax.ffi.register_ffi_target expects.
#pragma once

#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace fp8norm {

inline nanobind::capsule FfiCapsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  return nanobind::capsule(reinterpret_cast<void*>(handler));
}

// A target with an instantiate stage beside its execute stage, as
// jax.ffi.register_ffi_target takes it.
inline nanobind::dict FfiStages(XLA_FFI_Error* (*instantiate)(XLA_FFI_CallFrame*),
                                XLA_FFI_Error* (*execute)(XLA_FFI_CallFrame*)) {
  nanobind::dict stages;
  stages["instantiate"] = FfiCapsule(instantiate);
  stages["execute"] = FfiCapsule(execute);
  return stages;
}

}  // namespace fp8norm
