// Turns the buffers and attributes XLA hands an FFI handler into RmsNormFp8Args, checking
// every shape, dtype and constant on the way. Shared by the CPU and CUDA handlers; the
// Python wrapper validates first, so these checks only fire for a caller that bypasses it.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>

#include "columnwise.h"
#include "named_codes.h"
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
// float8_e4m3fn scales, where it is required); empty otherwise.
ffi::Error DecodeRmsNormFp8(const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
                            const ffi::AnyBuffer& gamma,
                            const std::optional<ffi::AnyBuffer>& scale_operand,
                            ffi::Result<ffi::AnyBuffer>& y, ffi::Result<ffi::AnyBuffer>& scales,
                            ffi::Result<ffi::AnyBuffer>* residual_out,
                            const NormAttributes& attributes, RmsNormFp8Args* args);

// The columnwise form's extra results (after DecodeInverseRms): y_t [hidden, rows] and
// scales_t [hidden, rows / group_size] ([hidden, 1] for a static scale), group_size a
// block of rows; the other arguments as DecodeRmsNormFp8's.
ffi::Error DecodeColumnOutputs(const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
                               const ffi::AnyBuffer& gamma,
                               const std::optional<ffi::AnyBuffer>& scale_operand,
                               ffi::Result<ffi::AnyBuffer>& y_t,
                               ffi::Result<ffi::AnyBuffer>& scales_t,
                               const NormAttributes& attributes, RmsNormFp8Args* args);

// The results a form adds to the op's: each row's r (the training and columnwise forms),
// then y_t and scales_t (the columnwise form); null where the form has none.
struct FormResults {
  ffi::Result<ffi::AnyBuffer>* inverse_rms = nullptr;
  ffi::Result<ffi::AnyBuffer>* y_t = nullptr;
  ffi::Result<ffi::AnyBuffer>* scales_t = nullptr;
};

// DecodeRmsNormFp8, then the form's results (DecodeInverseRms, DecodeColumnOutputs).
ffi::Error DecodeNormForm(const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
                          const ffi::AnyBuffer& gamma,
                          const std::optional<ffi::AnyBuffer>& scale_operand,
                          ffi::Result<ffi::AnyBuffer>& y, ffi::Result<ffi::AnyBuffer>& scales,
                          ffi::Result<ffi::AnyBuffer>* residual_out, FormResults form,
                          const NormAttributes& attributes, RmsNormFp8Args* args);

// The training form's extra result: each row's r, float32 of shape x.shape[:-1] + (1,).
ffi::Error DecodeInverseRms(ffi::Result<ffi::AnyBuffer>& inverse_rms, RmsNormFp8Args* args);

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
// gamma, an optional scale operand; y, scales[, residual_out]; the attributes.
// The training forms return each row's r next; the columnwise forms then y_t, scales_t.
enum class NormForm { kPlain, kTraining, kColumnwise };

template <NormForm kForm, typename Binding>
auto WithFormResults(Binding binding) {
  if constexpr (kForm == NormForm::kPlain) {
    return std::move(binding).template Attrs<NormAttributes>();
  } else if constexpr (kForm == NormForm::kTraining) {
    return std::move(binding)
        .template Ret<ffi::AnyBuffer>()  // inverse_rms
        .template Attrs<NormAttributes>();
  } else {
    return std::move(binding)
        .template Ret<ffi::AnyBuffer>()  // inverse_rms
        .template Ret<ffi::AnyBuffer>()  // y_t
        .template Ret<ffi::AnyBuffer>()  // scales_t
        .template Attrs<NormAttributes>();
  }
}

template <typename Ctx, NormForm kForm = NormForm::kPlain>
auto RmsNormFp8Binding() {
  return WithFormResults<kForm>(ffi::Ffi::Bind()
                                    .Ctx<Ctx>()
                                    .template Arg<ffi::AnyBuffer>()          // x
                                    .template Arg<ffi::AnyBuffer>()          // gamma
                                    .template OptionalArg<ffi::AnyBuffer>()  // a scale operand
                                    .template Ret<ffi::AnyBuffer>()          // y
                                    .template Ret<ffi::AnyBuffer>());        // scales
}

template <typename Ctx, NormForm kForm = NormForm::kPlain>
auto AddRmsNormFp8Binding() {
  return WithFormResults<kForm>(ffi::Ffi::Bind()
                                    .Ctx<Ctx>()
                                    .template Arg<ffi::AnyBuffer>()          // x
                                    .template Arg<ffi::AnyBuffer>()          // residual
                                    .template Arg<ffi::AnyBuffer>()          // gamma
                                    .template OptionalArg<ffi::AnyBuffer>()  // a scale operand
                                    .template Ret<ffi::AnyBuffer>()          // y
                                    .template Ret<ffi::AnyBuffer>()          // scales
                                    .template Ret<ffi::AnyBuffer>());        // residual_out
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

}  // namespace fp8norm

// The members of NormAttributes by attribute name, in order: also the first members of
// the all-reduce's attributes (src/cuda/cuda_handlers.cc), which carry the norm's.
#define FP8NORM_NORM_ATTRIBUTE_MEMBERS                                                      \
  ::xla::ffi::StructMember<float>("eps"), ::xla::ffi::StructMember<float>("weight_offset"), \
      ::xla::ffi::StructMember<float>("scale_ub"),                                          \
      ::xla::ffi::StructMember<int64_t>("group_size"),                                      \
      ::xla::ffi::StructMember<bool>("power_of_two_scales"),                                \
      ::xla::ffi::StructMember<int64_t>("fp4_layout")

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(fp8norm::NormAttributes, FP8NORM_NORM_ATTRIBUTE_MEMBERS);
