#include "quantize_gradient_ffi.h"

#include <string>

#include "ffi_decode.h"

namespace fp8norm {
namespace {

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_fp8norm: quantize_gradient: " + what);
}

bool HasShape(const ffi::AnyBuffer& b, std::initializer_list<int64_t> shape) {
  const auto dims = b.dimensions();
  if (dims.size() != shape.size()) return false;
  size_t i = 0;
  for (const int64_t d : shape) {
    if (dims[i++] != d) return false;
  }
  return true;
}

}  // namespace

ffi::Error DecodeQuantizeGradient(const ffi::AnyBuffer& g, const ffi::AnyBuffer& key,
                                  ffi::Result<ffi::AnyBuffer>& codes,
                                  ffi::Result<ffi::AnyBuffer>& scales,
                                  ffi::Result<ffi::AnyBuffer>& global_scales,
                                  const QuantizeGradientAttributes& attrs,
                                  QuantizeGradientArgs* args) {
  if (g.element_type() != ffi::DataType::F32 || g.dimensions().size() != 2) {
    return Invalid("g must be float32 [R, F]");
  }
  const int64_t rows = g.dimensions()[0];
  const int64_t cols = g.dimensions()[1];
  const int64_t block = attrs.block;
  if (block != (attrs.nvfp4 ? 16 : 32)) {
    return Invalid("block must be 16 (NVFP4) or 32 (MXFP4)");
  }
  const int64_t blocked = attrs.columns ? rows : cols;
  if (blocked % block != 0) return Invalid("the blocked axis must be a multiple of the block");
  if (attrs.hadamard_mask != -1 &&
      (!attrs.columns || attrs.hadamard_mask < 0 || attrs.hadamard_mask >= (int64_t{1} << block))) {
    return Invalid("a Hadamard mask is the columns copy's, one bit per row of a block");
  }
  if (key.element_type() != ffi::DataType::U32 || !HasShape(key, {2})) {
    return Invalid("key must be uint32[2]");
  }
  if (codes->element_type() != ffi::DataType::F4E2M1FN || !HasShape(*codes, {rows, cols})) {
    return Invalid("codes must be float4_e2m1fn of g's shape");
  }
  const ffi::DataType scale_type = attrs.nvfp4 ? ffi::DataType::F8E4M3FN : ffi::DataType::F8E8M0FNU;
  const bool scales_ok = attrs.columns ? HasShape(*scales, {rows / block, cols})
                                       : HasShape(*scales, {rows, cols / block});
  if (scales->element_type() != scale_type || !scales_ok) {
    return Invalid("scales must be e4m3 (NVFP4) or e8m0 (MXFP4), one per block");
  }
  const int64_t global_count = attrs.nvfp4 ? (attrs.columns ? 1 : rows) : 0;
  const bool global_ok = attrs.columns || !attrs.nvfp4 ? HasShape(*global_scales, {global_count})
                                                       : HasShape(*global_scales, {rows, 1});
  if (global_scales->element_type() != ffi::DataType::F32 || !global_ok) {
    return Invalid(
        "global_scales must be float32 [R, 1] (the rows copy), [1] (the columns "
        "copy) or [0] (MXFP4)");
  }
  bool packed;
  switch (static_cast<Fp4Layout>(attrs.fp4_layout)) {
    case Fp4Layout::kOnePerByte:
      packed = false;
      break;
    case Fp4Layout::kPackedLowFirst:
      packed = true;
      break;
    default:
      return Invalid("fp4_layout " + std::to_string(attrs.fp4_layout) + " is unknown");
  }
  *args = QuantizeGradientArgs{
      static_cast<const float*>(g.untyped_data()),
      static_cast<const uint32_t*>(key.untyped_data()),
      rows,
      cols,
      block,
      attrs.nvfp4,
      attrs.columns,
      attrs.stochastic,
      attrs.hadamard_mask != -1,
      static_cast<uint32_t>(attrs.hadamard_mask != -1 ? attrs.hadamard_mask : 0),
      static_cast<uint8_t*>(codes->untyped_data()),
      packed,
      static_cast<uint8_t*>(scales->untyped_data()),
      attrs.nvfp4 ? static_cast<float*>(global_scales->untyped_data()) : nullptr,
  };
  return ffi::Error::Success();
}

}  // namespace fp8norm
