// Turns the buffers and attributes XLA hands an FFI handler into RmsNormFp8Args, checking
// every shape, dtype and constant on the way. Shared by the CPU and CUDA handlers; the
// Python wrapper validates first, so these checks only fire for a caller that bypasses it.
#pragma once

#include <cstdint>
#include <optional>

#include "columnwise.h"
#include "named_codes.h"
#include "quantize_weight.h"
#include "rms_norm_backward.h"
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
  // How the platform's float4_e2m1fn buffers hold their elements (a Fp4Layout), as the
  // Python lowering knows it; FP4 outputs refuse any other value.
  int64_t fp4_layout;
  // The form, which decides the results after y, scales[, residual_out]: each row's r
  // (with_inverse_rms, the training form), each row's amax (with_amax, beside a static
  // scale only), then y_t and scales_t (columnwise, which needs r: columnwise without
  // with_inverse_rms is refused).
  bool with_inverse_rms;
  bool columnwise;
  bool with_amax;
  // NVFP4 with each row's own global scale (global_scale="per_row"): no scale operand;
  // each row's global scale is a result after [amax], and with columnwise each column's
  // after scales_t.
  bool per_row_global_scale;
  // The columnwise outputs' Hadamard transform: its sign mask, or -1 for none.
  int64_t hadamard_mask;
};

// The physical layouts of a float4_e2m1fn buffer: one code per byte (in the low nibble),
// or two per byte with element 2k in the low nibble (XLA's CPU backend, docs/spec.md).
// A buffer's size_bytes() cannot tell them apart: the FFI header counts one byte per F4
// element either way.
enum class Fp4Layout : int64_t { kOnePerByte = 0, kPackedLowFirst = 1 };
// Their names, which every compiled module exports (constant_bindings.h) and the Python
// package reads the codes from (jax_fp8norm/_ffi.py).
constexpr NamedCode<Fp4Layout> kFp4LayoutNames[] = {
    {Fp4Layout::kOnePerByte, "one_per_byte"},
    {Fp4Layout::kPackedLowFirst, "packed_low_first"},
};

// `residual` and `residual_out` are null for rms_norm_fp8. `scale_operand` is the
// calibrated scale (FP8 outputs) or NVFP4's global scale (float4_e2m1fn y with
// float8_e4m3fn scales, where it is required); empty otherwise. `form_results`: the
// results after y, scales[, residual_out], which the attributes' form names
// (NormAttributes): [inverse_rms] [amax] [y_t, scales_t], checked in number, dtype and
// shape.
ffi::Error DecodeNormForm(const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
                          const ffi::AnyBuffer& gamma,
                          const std::optional<ffi::AnyBuffer>& scale_operand,
                          ffi::Result<ffi::AnyBuffer>& y, ffi::Result<ffi::AnyBuffer>& scales,
                          ffi::Result<ffi::AnyBuffer>* residual_out,
                          const ffi::RemainingRets& form_results, const NormAttributes& attributes,
                          RmsNormFp8Args* args);

// A call with no results beyond y, scales[, residual_out] (the one-kernel all-reduce's):
// DecodeNormForm's checks, and a form in the attributes is refused.
ffi::Error DecodeRmsNormFp8(const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
                            const ffi::AnyBuffer& gamma,
                            const std::optional<ffi::AnyBuffer>& scale_operand,
                            ffi::Result<ffi::AnyBuffer>& y, ffi::Result<ffi::AnyBuffer>& scales,
                            ffi::Result<ffi::AnyBuffer>* residual_out,
                            const NormAttributes& attributes, RmsNormFp8Args* args);

// The backward of both ops (rms_norm_fp8: residual, d_residual_out and dresidual null).
ffi::Error DecodeRmsNormBackward(const ffi::AnyBuffer& dn, const ffi::AnyBuffer* d_residual_out,
                                 const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
                                 const ffi::AnyBuffer& gamma, const ffi::AnyBuffer& inverse_rms,
                                 ffi::Result<ffi::AnyBuffer>& dx,
                                 ffi::Result<ffi::AnyBuffer>* dresidual,
                                 ffi::Result<ffi::AnyBuffer>& dgamma, float weight_offset,
                                 RmsNormBackwardArgs* args);

// The signatures of the two norm targets, the same on every platform but for the
// context (Ctx: the CPU's thread pool, the GPU's stream and device): x, [residual,]
// gamma, an optional scale operand; y, scales[, residual_out], then the form's results
// (NormAttributes: [inverse_rms] [amax] [y_t, scales_t]); the attributes.
template <typename Ctx>
auto RmsNormFp8Binding() {
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()          // x
      .template Arg<ffi::AnyBuffer>()          // gamma
      .template OptionalArg<ffi::AnyBuffer>()  // a scale operand
      .template Ret<ffi::AnyBuffer>()          // y
      .template Ret<ffi::AnyBuffer>()          // scales
      .RemainingRets()                         // the form's
      .template Attrs<NormAttributes>();
}

template <typename Ctx>
auto AddRmsNormFp8Binding() {
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()          // x
      .template Arg<ffi::AnyBuffer>()          // residual
      .template Arg<ffi::AnyBuffer>()          // gamma
      .template OptionalArg<ffi::AnyBuffer>()  // a scale operand
      .template Ret<ffi::AnyBuffer>()          // y
      .template Ret<ffi::AnyBuffer>()          // scales
      .template Ret<ffi::AnyBuffer>()          // residual_out
      .RemainingRets()                         // the form's
      .template Attrs<NormAttributes>();
}

// The backward targets: dn, [d_residual_out,] x, [residual,] gamma, inverse_rms; dx,
// [dresidual,] dgamma; the rounded weight_offset.
template <typename Ctx>
auto RmsNormBackwardBinding() {
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()  // dn
      .template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()  // gamma
      .template Arg<ffi::AnyBuffer>()  // inverse_rms
      .template Ret<ffi::AnyBuffer>()  // dx
      .template Ret<ffi::AnyBuffer>()  // dgamma
      .template Attr<float>("weight_offset");
}

template <typename Ctx>
auto AddRmsNormBackwardBinding() {
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()  // dn
      .template Arg<ffi::AnyBuffer>()  // d_residual_out
      .template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()  // residual
      .template Arg<ffi::AnyBuffer>()  // gamma
      .template Arg<ffi::AnyBuffer>()  // inverse_rms
      .template Ret<ffi::AnyBuffer>()  // dx
      .template Ret<ffi::AnyBuffer>()  // dresidual
      .template Ret<ffi::AnyBuffer>()  // dgamma
      .template Attr<float>("weight_offset");
}

// fp4_layout: as NormAttributes::fp4_layout, for a float4_e2m1fn output.
ffi::Error DecodeRound(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out,
                       int64_t fp4_layout, RoundArgs* args);

// The quantize_weight target (src/common/quantize_weight.h): w [K, F] float32, float16 or
// bfloat16; codes [K, F] float4_e2m1fn, tile scales [K / block, ceil(F / block)] (e4m3
// or e8m0 by the format) and the global scale [] float32; the attributes format (a
// WeightFormat), block (the tile's side) and fp4_layout.
template <typename Ctx>
auto QuantizeWeightBinding() {
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()  // w
      .template Ret<ffi::AnyBuffer>()  // codes
      .template Ret<ffi::AnyBuffer>()  // scales
      .template Ret<ffi::AnyBuffer>()  // global_scale
      .template Attr<int64_t>("format")
      .template Attr<int64_t>("block")
      .template Attr<int64_t>("fp4_layout");
}

ffi::Error DecodeQuantizeWeight(const ffi::AnyBuffer& w, ffi::Result<ffi::AnyBuffer>& codes,
                                ffi::Result<ffi::AnyBuffer>& scales,
                                ffi::Result<ffi::AnyBuffer>& global_scale, int64_t format,
                                int64_t block, int64_t fp4_layout, QuantizeWeightArgs* args);

}  // namespace fp8norm

// The members of NormAttributes by attribute name, in order: also the first members of
// the all-reduce's attributes (src/cuda/cuda_handlers.cc), which carry the norm's (its
// form always the plain one).
#define FP8NORM_NORM_ATTRIBUTE_MEMBERS                                                           \
  ::xla::ffi::StructMember<float>("eps"), ::xla::ffi::StructMember<float>("weight_offset"),      \
      ::xla::ffi::StructMember<float>("scale_ub"),                                               \
      ::xla::ffi::StructMember<int64_t>("group_size"),                                           \
      ::xla::ffi::StructMember<bool>("power_of_two_scales"),                                     \
      ::xla::ffi::StructMember<int64_t>("fp4_layout"),                                           \
      ::xla::ffi::StructMember<bool>("with_inverse_rms"),                                        \
      ::xla::ffi::StructMember<bool>("columnwise"), ::xla::ffi::StructMember<bool>("with_amax"), \
      ::xla::ffi::StructMember<bool>("per_row_global_scale"),                                    \
      ::xla::ffi::StructMember<int64_t>("hadamard_mask")

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(fp8norm::NormAttributes, FP8NORM_NORM_ATTRIBUTE_MEMBERS);
