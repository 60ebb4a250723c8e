// Wraps an FFI handler in the PyCapsule that jax.ffi.register_ffi_target expects.
#pragma once

#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace fp8norm {

inline nanobind::capsule FfiCapsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  return nanobind::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace fp8norm
