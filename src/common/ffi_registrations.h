// What each compiled module hands to jax.ffi.register_ffi_target: the ops' handlers for
// one platform, keyed by op name. The op names are defined here once for every module;
// the Python package makes the target names from them (jax_fp8norm/_ffi.py).
#pragma once

#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace fp8norm {

using FfiHandler = XLA_FFI_Error*(XLA_FFI_CallFrame*);

// The execute stage of each op on one platform. A norm's one handler takes every form
// (its attributes say which: src/common/ffi_decode.h, NormAttributes).
struct OpHandlers {
  FfiHandler* rms_norm_fp8;
  FfiHandler* add_rms_norm_fp8;
  FfiHandler* round;
  FfiHandler* rms_norm_backward;
  FfiHandler* add_rms_norm_backward;
  FfiHandler* quantize_weight;
  // The output gradient's FP4 quantiser (quantize_gradient.h).
  FfiHandler* quantize_gradient;
};

// A stage before execution ("initialize" or "instantiate") that every op of a platform
// shares, or none.
struct FirstStage {
  const char* name = nullptr;
  FfiHandler* handler = nullptr;
};

inline nanobind::capsule FfiCapsule(FfiHandler* handler) {
  return nanobind::capsule(reinterpret_cast<void*>(handler));
}

// The one-kernel all-reduce, which only the CUDA modules (real and emulated) have: its
// execute stage and its own set-up stage (in the stage FirstStage names).
struct PeerOpHandlers {
  FfiHandler* allreduce_rms_norm_fp8 = nullptr;
  FfiHandler* set_up = nullptr;
};

// {op name: the capsule, or {first stage: capsule, "execute": capsule}} as
// jax.ffi.register_ffi_target takes it.
inline nanobind::dict Registrations(const OpHandlers& ops, FirstStage first = {},
                                    PeerOpHandlers peer_ops = {}) {
  const auto entry = [&](FfiHandler* first_stage, FfiHandler* execute) -> nanobind::object {
    if (first_stage == nullptr) return FfiCapsule(execute);
    nanobind::dict stages;
    stages[first.name] = FfiCapsule(first_stage);
    stages["execute"] = FfiCapsule(execute);
    return stages;
  };
  nanobind::dict targets;
  targets["rms_norm_fp8"] = entry(first.handler, ops.rms_norm_fp8);
  targets["add_rms_norm_fp8"] = entry(first.handler, ops.add_rms_norm_fp8);
  targets["round"] = entry(first.handler, ops.round);
  targets["rms_norm_backward"] = entry(first.handler, ops.rms_norm_backward);
  targets["add_rms_norm_backward"] = entry(first.handler, ops.add_rms_norm_backward);
  targets["quantize_weight"] = entry(first.handler, ops.quantize_weight);
  targets["quantize_gradient"] = entry(first.handler, ops.quantize_gradient);
  if (peer_ops.allreduce_rms_norm_fp8 != nullptr) {
    targets["allreduce_rms_norm_fp8"] = entry(peer_ops.set_up, peer_ops.allreduce_rms_norm_fp8);
  }
  return targets;
}

}  // namespace fp8norm
