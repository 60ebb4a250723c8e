// The FFI side of the gradient's quantiser (quantize_gradient.h): the target's binding,
// which the CPU and CUDA handlers share but for their context, and the decoding of its
// buffers and attributes into QuantizeGradientArgs, every shape and dtype checked (the
// Python wrapper validates first, so these checks only fire for a caller that bypasses
// it).
#pragma once

#include <cstdint>

#include "quantize_gradient.h"
#include "xla/ffi/api/ffi.h"

namespace fp8norm {

namespace ffi = ::xla::ffi;

struct QuantizeGradientAttributes {
  bool nvfp4;
  int64_t block;
  bool columns;
  bool stochastic;
  int64_t hadamard_mask;  // -1: no transform
  int64_t fp4_layout;     // a Fp4Layout (ffi_decode.h)
};

// g float32 [R, F], the stream's key uint32[2]; codes float4_e2m1fn [R, F], scales, and
// the global scales float32 (NVFP4: [R, 1] for the rows copy, [1] for the columns copy;
// [0] for MXFP4).
template <typename Ctx>
auto QuantizeGradientBinding() {
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()  // g
      .template Arg<ffi::AnyBuffer>()  // key
      .template Ret<ffi::AnyBuffer>()  // codes
      .template Ret<ffi::AnyBuffer>()  // scales
      .template Ret<ffi::AnyBuffer>()  // global_scales
      .template Attr<bool>("nvfp4")
      .template Attr<int64_t>("block")
      .template Attr<bool>("columns")
      .template Attr<bool>("stochastic")
      .template Attr<int64_t>("hadamard_mask")
      .template Attr<int64_t>("fp4_layout");
}

ffi::Error DecodeQuantizeGradient(const ffi::AnyBuffer& g, const ffi::AnyBuffer& key,
                                  ffi::Result<ffi::AnyBuffer>& codes,
                                  ffi::Result<ffi::AnyBuffer>& scales,
                                  ffi::Result<ffi::AnyBuffer>& global_scales,
                                  const QuantizeGradientAttributes& attrs,
                                  QuantizeGradientArgs* args);

}  // namespace fp8norm
