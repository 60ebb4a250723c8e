// Turns the buffers and attributes XLA hands an FFI handler into RmsNormFp8Args, checking
// every shape, dtype and constant on the way. Shared by the CPU and CUDA handlers; the
// Python wrapper validates first, so these checks only fire for a caller that bypasses it.
#pragma once

#include <cstdint>
#include <optional>

#include "rms_norm_fp8.h"
#include "xla/ffi/api/ffi.h"

namespace fp8norm {

namespace ffi = ::xla::ffi;

// The attributes of both norm targets, on every platform (jax_fp8norm/_primitives.py
// writes them): the rounded constants and the scale layout.
struct NormAttributes {
  float eps;
  float weight_offset;
  float scale_ub;
  int64_t group_size;  // 0: one scale per row
  bool power_of_two_scales;
};

// `residual` and `residual_out` are null for rms_norm_fp8; `static_scale` is empty unless
// the call has a calibrated scale.
ffi::Error DecodeRmsNormFp8(const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
                            const ffi::AnyBuffer& gamma,
                            const std::optional<ffi::AnyBuffer>& static_scale,
                            ffi::Result<ffi::AnyBuffer>& y, ffi::Result<ffi::AnyBuffer>& scales,
                            ffi::Result<ffi::AnyBuffer>* residual_out,
                            const NormAttributes& attributes, RmsNormFp8Args* args);

// The signatures of the two norm targets, the same on every platform but for the
// context (Ctx: the CPU's thread pool, the GPU's stream and device): x, [residual,]
// gamma, an optional static_scale; y, scales[, residual_out]; the attributes.
template <typename Ctx>
auto RmsNormFp8Binding() {
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()          // x
      .template Arg<ffi::AnyBuffer>()          // gamma
      .template OptionalArg<ffi::AnyBuffer>()  // static_scale
      .template Ret<ffi::AnyBuffer>()          // y
      .template Ret<ffi::AnyBuffer>()          // scales
      .template Attrs<NormAttributes>();
}

template <typename Ctx>
auto AddRmsNormFp8Binding() {
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()          // x
      .template Arg<ffi::AnyBuffer>()          // residual
      .template Arg<ffi::AnyBuffer>()          // gamma
      .template OptionalArg<ffi::AnyBuffer>()  // static_scale
      .template Ret<ffi::AnyBuffer>()          // y
      .template Ret<ffi::AnyBuffer>()          // scales
      .template Ret<ffi::AnyBuffer>()          // residual_out
      .template Attrs<NormAttributes>();
}

ffi::Error DecodeRound(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out, RoundArgs* args);

}  // namespace fp8norm

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(fp8norm::NormAttributes,
                                      ::xla::ffi::StructMember<float>("eps"),
                                      ::xla::ffi::StructMember<float>("weight_offset"),
                                      ::xla::ffi::StructMember<float>("scale_ub"),
                                      ::xla::ffi::StructMember<int64_t>("group_size"),
                                      ::xla::ffi::StructMember<bool>("power_of_two_scales"));
