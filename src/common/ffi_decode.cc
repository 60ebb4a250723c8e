#include "ffi_decode.h"

#include <cmath>
#include <optional>
#include <string>

namespace fp8norm {
namespace {

std::optional<FloatType> FloatTypeOf(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32:
      return FloatType::kF32;
    case ffi::DataType::F16:
      return FloatType::kF16;
    case ffi::DataType::BF16:
      return FloatType::kBF16;
    default:
      return std::nullopt;
  }
}

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_fp8norm: " + what);
}

// Whether float4_e2m1fn buffers are packed under `layout`; empty for a layout this build
// does not know.
std::optional<bool> Fp4Packed(int64_t layout) {
  switch (static_cast<Fp4Layout>(layout)) {
    case Fp4Layout::kOnePerByte:
      return false;
    case Fp4Layout::kPackedLowFirst:
      return true;
    default:
      return std::nullopt;
  }
}

// The norm's call (columnwise false) or, read into the same fields, the buffers of its
// columnwise pass (y and scales are y_t and scales_t, group_size the block of rows), which
// DecodeColumnOutputs moves to ColumnOutputs.
ffi::Error DecodeNormCall(const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
                          const ffi::AnyBuffer& gamma,
                          const std::optional<ffi::AnyBuffer>& scale_operand,
                          ffi::Result<ffi::AnyBuffer>& y, ffi::Result<ffi::AnyBuffer>& scales,
                          ffi::Result<ffi::AnyBuffer>* residual_out,
                          const NormAttributes& attributes, bool columnwise, RmsNormFp8Args* args) {
  const float eps = attributes.eps;
  const float weight_offset = attributes.weight_offset;
  const float scale_ub = attributes.scale_ub;
  const auto dims = x.dimensions();
  if (dims.size() < 1) return Invalid("x must have rank >= 1");
  const auto input_type = FloatTypeOf(x.element_type());
  if (!input_type) return Invalid("x must be float32, float16 or bfloat16");
  const int64_t hidden = dims.back();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) rows *= dims[i];

  const auto gamma_type = FloatTypeOf(gamma.element_type());
  if (!gamma_type) return Invalid("gamma must be float32, float16 or bfloat16");
  if (gamma.dimensions().size() != 1 || gamma.dimensions()[0] != hidden) {
    return Invalid("gamma must have shape (hidden,) matching x.shape[-1]");
  }
  if (!columnwise && (residual == nullptr) != (residual_out == nullptr)) {
    return Invalid("residual and residual_out go together");
  }
  FloatType residual_type = *input_type;
  if (residual != nullptr) {
    const auto type = FloatTypeOf(residual->element_type());
    if (!type || (*type != *input_type && *input_type != FloatType::kF32)) {
      return Invalid("residual must have the dtype of x (or x must be float32)");
    }
    residual_type = *type;
    if (!(residual->dimensions() == dims)) return Invalid("residual must have the shape of x");
    if (residual_out != nullptr && ((*residual_out)->element_type() != residual->element_type() ||
                                    !((*residual_out)->dimensions() == dims))) {
      return Invalid("residual_out must have the shape and dtype of residual");
    }
  }

  OutFormat out_format;
  if (y->element_type() == ffi::DataType::F8E4M3FN) {
    out_format = OutFormat::kE4M3FN;
  } else if (y->element_type() == ffi::DataType::F8E4M3FNUZ) {
    out_format = OutFormat::kE4M3FNUZ;
  } else if (y->element_type() == ffi::DataType::F4E2M1FN) {
    out_format = OutFormat::kE2M1;
  } else {
    return Invalid("y must be float8_e4m3fn, float8_e4m3fnuz or float4_e2m1fn");
  }
  const bool fp4 = out_format == OutFormat::kE2M1;
  const std::optional<bool> packed = Fp4Packed(attributes.fp4_layout);
  if (fp4 && !packed) {
    return Invalid("fp4_layout " + std::to_string(attributes.fp4_layout) +
                   " is not a float4_e2m1fn layout this build knows");
  }
  if (columnwise) {
    const auto y_dims = y->dimensions();
    if (y_dims.size() != 2 || y_dims[0] != hidden || y_dims[1] != rows) {
      return Invalid("y_t must have shape (hidden, rows)");
    }
  } else if (!(y->dimensions() == dims)) {
    return Invalid("y must have the shape of x");
  }

  // Rows of a call share a columnwise scale, elements of a row a rowwise one.
  const int64_t blocked = columnwise ? rows : hidden;
  if (attributes.group_size < 0 ||
      (attributes.group_size > 0 && blocked % attributes.group_size != 0)) {
    return Invalid(columnwise
                       ? "group_size must be 0 (a static scale) or a positive divisor of rows"
                       : "group_size must be 0 (one scale per row) or a positive divisor "
                         "of hidden");
  }
  if (fp4 && (attributes.group_size <= 0 || attributes.group_size % 2 != 0)) {
    return Invalid("float4_e2m1fn y needs an even group_size");
  }
  // The attribute's 0 (one scale per row) is the kernels' hidden (RmsNormFp8Args); the
  // columnwise pass keeps 0 (a static scale).
  const int64_t group_size =
      attributes.group_size > 0 || columnwise ? attributes.group_size : hidden;
  const int64_t groups =
      columnwise ? (group_size > 0 ? rows / group_size : 1) : GroupsPerRow(hidden, group_size);
  const bool power_of_two = attributes.power_of_two_scales;
  std::optional<FloatType> scale_type = FloatTypeOf(scales->element_type());
  if (scales->element_type() == ffi::DataType::F8E8M0FNU) scale_type = FloatType::kE8M0;
  if (scales->element_type() == ffi::DataType::F8E4M3FN) scale_type = FloatType::kE4M3;
  if (!scale_type) {
    return Invalid("scales must be float32, float16, bfloat16, float8_e8m0fnu or float8_e4m3fn");
  }
  const bool nvfp4 = *scale_type == FloatType::kE4M3;
  if (fp4 && !nvfp4 && *scale_type != FloatType::kE8M0) {
    return Invalid("float4_e2m1fn y needs float8_e4m3fn (NVFP4) or float8_e8m0fnu (MXFP4) scales");
  }
  if (nvfp4 && !fp4) return Invalid("float8_e4m3fn scales are NVFP4's: y must be float4_e2m1fn");
  if (*scale_type == FloatType::kE8M0 && !power_of_two) {
    return Invalid("float8_e8m0fnu scales are powers of two: power_of_two_scales must be set");
  }
  if (nvfp4 && (power_of_two || !std::isinf(attributes.scale_ub))) {
    return Invalid("NVFP4 scales take neither power_of_two_scales nor scale_ub");
  }
  if (*scale_type == FloatType::kF16 && power_of_two) {
    return Invalid("power-of-two scales need a float32, bfloat16 or float8_e8m0fnu scale dtype");
  }
  const auto scale_dims = scales->dimensions();
  if (columnwise) {
    if (scale_dims.size() != 2 || scale_dims[0] != hidden || scale_dims[1] != groups) {
      return Invalid(
          "scales_t must have shape (hidden, rows / group_size), (hidden, 1) for a "
          "static scale");
    }
  } else {
    bool scale_shape_ok = scale_dims.size() == dims.size() && scale_dims.back() == groups;
    for (size_t i = 0; scale_shape_ok && i + 1 < dims.size(); ++i) {
      scale_shape_ok = scale_dims[i] == dims[i];
    }
    if (!scale_shape_ok)
      return Invalid("scales must have shape x.shape[:-1] + (hidden / group_size,)");
  }

  const float* scale_operand_data = nullptr;
  if (scale_operand.has_value()) {
    if (scale_operand->element_type() != ffi::DataType::F32 ||
        scale_operand->element_count() != 1) {
      return Invalid(nvfp4 ? "global_scale must be one float32"
                           : "static_scale must be one float32");
    }
    if (fp4 && !nvfp4) return Invalid("MXFP4 takes neither static_scale nor global_scale");
    if (!fp4 && (attributes.group_size > 0 || power_of_two)) {
      return Invalid("static_scale excludes group_size and power-of-two scales");
    }
    if (attributes.per_row_global_scale) {
      return Invalid("per_row_global_scale takes no global_scale operand: each row's is computed");
    }
    scale_operand_data = static_cast<const float*>(scale_operand->untyped_data());
  } else if (nvfp4 && !attributes.per_row_global_scale) {
    return Invalid("NVFP4 needs its global_scale operand");
  }
  if (attributes.per_row_global_scale && !nvfp4) {
    return Invalid("per_row_global_scale is NVFP4's: float4_e2m1fn y with float8_e4m3fn scales");
  }
  if (columnwise && group_size == 0 && scale_operand_data == nullptr) {
    return Invalid("columnwise outputs need block scales (group_size) or a static scale");
  }
  if (!(eps >= 0.0f) || !std::isfinite(eps)) return Invalid("eps must be finite and >= 0");
  if (!std::isfinite(weight_offset)) return Invalid("weight_offset must be finite");
  if (!(scale_ub > 0.0f)) return Invalid("scale_ub must be > 0");

  *args = RmsNormFp8Args{
      x.untyped_data(),
      residual != nullptr ? residual->untyped_data() : nullptr,
      gamma.untyped_data(),
      y->untyped_data(),
      scales->untyped_data(),
      nvfp4 ? nullptr : scale_operand_data,
      nvfp4 ? scale_operand_data : nullptr,
      residual_out != nullptr ? (*residual_out)->untyped_data() : nullptr,
      rows,
      hidden,
      group_size,
      *input_type,
      residual_type,
      *gamma_type,
      *scale_type,
      out_format,
      fp4 && *packed,
      RowConstants{eps, weight_offset, scale_ub, power_of_two},
  };
  return ffi::Error::Success();
}

// The training form's result: each row's r, float32 with one element per row.
ffi::Error DecodeInverseRms(ffi::Result<ffi::AnyBuffer>& inverse_rms, RmsNormFp8Args* args) {
  if (inverse_rms->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(inverse_rms->element_count()) != args->rows) {
    return Invalid("inverse_rms must be float32 with one element per row");
  }
  args->inverse_rms = static_cast<float*>(inverse_rms->untyped_data());
  return ffi::Error::Success();
}

// The amax beside a static scale: float32 with one element per row.
ffi::Error DecodeAmax(ffi::Result<ffi::AnyBuffer>& amax, RmsNormFp8Args* args) {
  if (args->static_scale == nullptr) {
    return Invalid("with_amax needs a static scale: a dynamic scale is its row's own amax");
  }
  if (amax->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(amax->element_count()) != args->rows) {
    return Invalid("amax must be float32 with one element per row");
  }
  args->amax = static_cast<float*>(amax->untyped_data());
  return ffi::Error::Success();
}

// NVFP4's global scale of each row (per_row_global_scale), or of each column (columnwise):
// float32 with one element per row (column).
ffi::Error DecodeGlobalScales(ffi::Result<ffi::AnyBuffer>& global_scales, int64_t count,
                              const char* what, float** out) {
  if (global_scales->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(global_scales->element_count()) != count) {
    return Invalid(std::string(what) + " must be float32 with one element per " +
                   (std::string(what) == "global_scales" ? "row" : "column"));
  }
  *out = static_cast<float*>(global_scales->untyped_data());
  return ffi::Error::Success();
}

// The columnwise form's results after r: y_t [hidden, rows] and scales_t [hidden, rows /
// group_size] ([hidden, 1] for a static scale), group_size a block of rows, in the
// dtypes of y and scales, which the kernels write them in.
ffi::Error DecodeColumnOutputs(const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
                               const ffi::AnyBuffer& gamma,
                               const std::optional<ffi::AnyBuffer>& scale_operand,
                               ffi::Result<ffi::AnyBuffer>& y_t,
                               ffi::Result<ffi::AnyBuffer>& scales_t,
                               const NormAttributes& attributes, RmsNormFp8Args* args) {
  RmsNormFp8Args view;
  ffi::Error status = DecodeNormCall(x, residual, gamma, scale_operand, y_t, scales_t, nullptr,
                                     attributes, true, &view);
  if (status.failure()) return status;
  if (view.out_format != args->out_format || view.y_packed != args->y_packed) {
    return Invalid("y_t must have the dtype of y");
  }
  if (view.scale_type != args->scale_type) return Invalid("scales_t must have the dtype of scales");
  args->columns = ColumnOutputs{view.y, view.scales, view.group_size};
  if (attributes.hadamard_mask == -1) return ffi::Error::Success();
  // The transform's blocks are FP4's of 16 or 32 rows (HadamardColumnBlock's), and its
  // mask has a bit per row of one.
  const int64_t d = view.group_size;
  if (view.out_format != OutFormat::kE2M1 || (d != 16 && d != 32)) {
    return Invalid("hadamard_mask needs float4_e2m1fn y_t in blocks of 16 or 32 rows");
  }
  if (attributes.hadamard_mask < 0 || (attributes.hadamard_mask >> d) != 0) {
    return Invalid("hadamard_mask must be -1 (none) or a mask of group_size bits");
  }
  args->columns.hadamard = true;
  args->columns.hadamard_mask = static_cast<uint32_t>(attributes.hadamard_mask);
  return ffi::Error::Success();
}

// The results the attributes' form adds: r with with_inverse_rms, amax with with_amax,
// y_t and scales_t with columnwise, in that order.
ffi::Error CheckFormResults(const NormAttributes& attributes, size_t results) {
  if (attributes.columnwise && !attributes.with_inverse_rms) {
    return Invalid("the columnwise form needs with_inverse_rms: its pass reads each row's r");
  }
  const size_t per_row = attributes.per_row_global_scale ? 1 : 0;
  if (attributes.hadamard_mask != -1 && !attributes.columnwise) {
    return Invalid("hadamard_mask transforms the columnwise outputs: it needs columnwise");
  }
  const size_t expected = (attributes.with_inverse_rms ? 1 : 0) + (attributes.with_amax ? 1 : 0) +
                          per_row + (attributes.columnwise ? 2 + per_row : 0);
  if (results == expected) return ffi::Error::Success();
  return Invalid("with_inverse_rms=" + std::to_string(attributes.with_inverse_rms) +
                 ", with_amax=" + std::to_string(attributes.with_amax) +
                 ", per_row_global_scale=" + std::to_string(attributes.per_row_global_scale) +
                 ", columnwise=" + std::to_string(attributes.columnwise) + ": the form has " +
                 std::to_string(expected) +
                 " results after y, scales[, residual_out] ([inverse_rms] with "
                 "with_inverse_rms, [amax] with with_amax, [global_scales] with "
                 "per_row_global_scale, then [y_t, scales_t[, global_scales_t]] with "
                 "columnwise), the call " +
                 std::to_string(results));
}

}  // namespace

ffi::Error DecodeNormForm(const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
                          const ffi::AnyBuffer& gamma,
                          const std::optional<ffi::AnyBuffer>& scale_operand,
                          ffi::Result<ffi::AnyBuffer>& y, ffi::Result<ffi::AnyBuffer>& scales,
                          ffi::Result<ffi::AnyBuffer>* residual_out,
                          const ffi::RemainingRets& form_results, const NormAttributes& attributes,
                          RmsNormFp8Args* args) {
  ffi::Error status = CheckFormResults(attributes, form_results.size());
  if (status.failure()) return status;
  status = DecodeNormCall(x, residual, gamma, scale_operand, y, scales, residual_out, attributes,
                          false, args);
  if (status.failure() || form_results.size() == 0) return status;
  // The form's results in order: inverse_rms, amax, global_scales, then y_t, scales_t and
  // global_scales_t.
  std::optional<ffi::Result<ffi::AnyBuffer>> results[6];
  for (size_t i = 0; i < form_results.size(); ++i) {
    auto result = form_results.get<ffi::AnyBuffer>(i);
    if (result.has_error()) return Invalid("the form's results must be buffers");
    results[i].emplace(*result);
  }
  size_t next = 0;
  if (attributes.with_inverse_rms) status = DecodeInverseRms(*results[next++], args);
  if (status.failure()) return status;
  if (attributes.with_amax) status = DecodeAmax(*results[next++], args);
  if (status.failure()) return status;
  if (attributes.per_row_global_scale) {
    status =
        DecodeGlobalScales(*results[next++], args->rows, "global_scales", &args->global_scales);
  }
  if (status.failure() || !attributes.columnwise) return status;
  status = DecodeColumnOutputs(x, residual, gamma, scale_operand, *results[next],
                               *results[next + 1], attributes, args);
  if (status.failure() || !attributes.per_row_global_scale) return status;
  return DecodeGlobalScales(*results[next + 2], args->hidden, "global_scales_t",
                            &args->columns.global_scales_t);
}

ffi::Error DecodeRmsNormFp8(const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
                            const ffi::AnyBuffer& gamma,
                            const std::optional<ffi::AnyBuffer>& scale_operand,
                            ffi::Result<ffi::AnyBuffer>& y, ffi::Result<ffi::AnyBuffer>& scales,
                            ffi::Result<ffi::AnyBuffer>* residual_out,
                            const NormAttributes& attributes, RmsNormFp8Args* args) {
  if (attributes.with_inverse_rms || attributes.columnwise || attributes.with_amax ||
      attributes.per_row_global_scale || attributes.hadamard_mask != -1) {
    return Invalid(
        "this target has only the plain form: with_inverse_rms, with_amax, "
        "per_row_global_scale and columnwise unset, hadamard_mask -1");
  }
  return DecodeNormCall(x, residual, gamma, scale_operand, y, scales, residual_out, attributes,
                        false, args);
}

ffi::Error DecodeRmsNormBackward(const ffi::AnyBuffer& dn, const ffi::AnyBuffer* d_residual_out,
                                 const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
                                 const ffi::AnyBuffer& gamma, const ffi::AnyBuffer& inverse_rms,
                                 ffi::Result<ffi::AnyBuffer>& dx,
                                 ffi::Result<ffi::AnyBuffer>* dresidual,
                                 ffi::Result<ffi::AnyBuffer>& dgamma, float weight_offset,
                                 RmsNormBackwardArgs* args) {
  const auto dims = x.dimensions();
  if (dims.size() < 1) return Invalid("x must have rank >= 1");
  const auto input_type = FloatTypeOf(x.element_type());
  if (!input_type) return Invalid("x must be float32, float16 or bfloat16");
  const int64_t hidden = dims.back();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) rows *= dims[i];
  const auto dn_type = FloatTypeOf(dn.element_type());
  if (!dn_type || !(dn.dimensions() == dims)) {
    return Invalid("dn must have the shape of x and a float dtype");
  }
  const auto gamma_type = FloatTypeOf(gamma.element_type());
  if (!gamma_type || gamma.dimensions().size() != 1 || gamma.dimensions()[0] != hidden) {
    return Invalid("gamma must be a float of shape (hidden,)");
  }
  if (inverse_rms.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(inverse_rms.element_count()) != rows) {
    return Invalid("inverse_rms must be float32 with one element per row");
  }
  if (dx->element_type() != x.element_type() || !(dx->dimensions() == dims)) {
    return Invalid("dx must have the shape and dtype of x");
  }
  if (dgamma->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(dgamma->element_count()) != hidden) {
    return Invalid("dgamma must be float32 of shape (hidden,)");
  }
  if ((residual == nullptr) != (d_residual_out == nullptr) ||
      (residual == nullptr) != (dresidual == nullptr)) {
    return Invalid("residual, d_residual_out and dresidual go together");
  }
  FloatType residual_type = *input_type;
  if (residual != nullptr) {
    const auto type = FloatTypeOf(residual->element_type());
    if (!type || (*type != *input_type && *input_type != FloatType::kF32) ||
        !(residual->dimensions() == dims)) {
      return Invalid("residual must have the shape of x and its dtype (or x must be float32)");
    }
    residual_type = *type;
    for (const ffi::AnyBuffer* buffer :
         {d_residual_out, static_cast<const ffi::AnyBuffer*>(&**dresidual)}) {
      if (buffer->element_type() != residual->element_type() || !(buffer->dimensions() == dims)) {
        return Invalid("d_residual_out and dresidual must have the shape and dtype of residual");
      }
    }
  }
  if (!std::isfinite(weight_offset)) return Invalid("weight_offset must be finite");
  *args = RmsNormBackwardArgs{
      dn.untyped_data(),
      x.untyped_data(),
      residual != nullptr ? residual->untyped_data() : nullptr,
      d_residual_out != nullptr ? d_residual_out->untyped_data() : nullptr,
      gamma.untyped_data(),
      static_cast<const float*>(inverse_rms.untyped_data()),
      dx->untyped_data(),
      dresidual != nullptr ? (*dresidual)->untyped_data() : nullptr,
      static_cast<float*>(dgamma->untyped_data()),
      rows,
      hidden,
      *dn_type,
      *input_type,
      residual_type,
      *gamma_type,
      weight_offset,
  };
  return ffi::Error::Success();
}

ffi::Error DecodeRound(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out,
                       int64_t fp4_layout, RoundArgs* args) {
  if (in.element_type() != ffi::DataType::F32) return Invalid("round: input must be float32");
  if (!(in.dimensions() == out->dimensions())) {
    return Invalid("round: output must have the shape of the input");
  }
  RoundTarget target;
  switch (out->element_type()) {
    case ffi::DataType::F16:
      target = RoundTarget::kF16;
      break;
    case ffi::DataType::BF16:
      target = RoundTarget::kBF16;
      break;
    case ffi::DataType::F8E4M3FN:
      target = RoundTarget::kE4M3FN;
      break;
    case ffi::DataType::F8E4M3FNUZ:
      target = RoundTarget::kE4M3FNUZ;
      break;
    case ffi::DataType::F4E2M1FN:
      target = RoundTarget::kE2M1;
      break;
    default:
      return Invalid("round: output must be float16, bfloat16, an FP8 E4M3 type or float4_e2m1fn");
  }
  const std::optional<bool> packed = Fp4Packed(fp4_layout);
  if (target == RoundTarget::kE2M1 && !packed) {
    return Invalid("round: fp4_layout " + std::to_string(fp4_layout) +
                   " is not a float4_e2m1fn layout this build knows");
  }
  *args = RoundArgs{static_cast<const float*>(in.untyped_data()), out->untyped_data(),
                    static_cast<int64_t>(in.element_count()), target,
                    target == RoundTarget::kE2M1 && *packed};
  return ffi::Error::Success();
}

ffi::Error DecodeQuantizeWeight(const ffi::AnyBuffer& w, ffi::Result<ffi::AnyBuffer>& codes,
                                ffi::Result<ffi::AnyBuffer>& scales,
                                ffi::Result<ffi::AnyBuffer>& global_scale, int64_t format,
                                int64_t block, int64_t fp4_layout, QuantizeWeightArgs* args) {
  const std::optional<FloatType> w_type = FloatTypeOf(w.element_type());
  if (!w_type) return Invalid("quantize_weight: w must be float32, float16 or bfloat16");
  const auto dims = w.dimensions();
  if (dims.size() != 2) return Invalid("quantize_weight: w must have rank 2");
  if (format < 0 || format > static_cast<int64_t>(WeightFormat::kFp8Blocks)) {
    return Invalid("quantize_weight: unknown format " + std::to_string(format));
  }
  const auto weight_format = static_cast<WeightFormat>(format);
  const bool fp4 =
      weight_format == WeightFormat::kNvfp4Tiles || weight_format == WeightFormat::kMxfp4Tiles;
  const bool nvfp4 = weight_format == WeightFormat::kNvfp4Tiles;
  const int64_t rows = dims[0];
  const int64_t cols = dims[1];
  // Per channel, one band of every row.
  if (weight_format == WeightFormat::kFp8Channels) block = rows;
  // FP4's even: a band of block rows starts on a byte of packed codes.
  if (block <= 0 || (fp4 && block % 2 != 0)) {
    return Invalid(
        "quantize_weight: block must be positive (even for FP4; K > 0 per channel), "
        "got " +
        std::to_string(block));
  }
  if (rows % block != 0) {
    return Invalid("quantize_weight: K = " + std::to_string(rows) + " is not a multiple of " +
                   std::to_string(block));
  }
  const std::optional<bool> packed = Fp4Packed(fp4_layout);
  if (!packed) {
    return Invalid("quantize_weight: fp4_layout " + std::to_string(fp4_layout) +
                   " is not a float4_e2m1fn layout this build knows");
  }
  const ffi::DataType code_type = fp4 ? ffi::DataType::F4E2M1FN : ffi::DataType::F8E4M3FN;
  if (codes->element_type() != code_type || !(codes->dimensions() == dims)) {
    return Invalid(
        "quantize_weight: codes must be float4_e2m1fn (FP4) or float8_e4m3fn (FP8) "
        "of w's shape");
  }
  const auto scale_dims = scales->dimensions();
  if (weight_format == WeightFormat::kFp8Channels) {
    if (scales->element_type() != ffi::DataType::F32 || scale_dims.size() != 1 ||
        scale_dims[0] != cols) {
      return Invalid("quantize_weight: per channel, scales must be float32 [F]");
    }
  } else {
    const int64_t scale_cols = fp4 ? (cols + block - 1) / block : cols;
    const ffi::DataType scale_type = nvfp4 ? ffi::DataType::F8E4M3FN : ffi::DataType::F8E8M0FNU;
    if (scales->element_type() != scale_type || scale_dims.size() != 2 ||
        scale_dims[0] != rows / block || scale_dims[1] != scale_cols) {
      return Invalid(
          "quantize_weight: scales must be [K / block, ceil(F / block)] (FP4) or "
          "[K / block, F] (FP8 blocks) of the format's scale type");
    }
  }
  if (global_scale->element_type() != ffi::DataType::F32 || global_scale->element_count() != 1) {
    return Invalid("quantize_weight: global_scale must be one float32");
  }
  *args = QuantizeWeightArgs{w.untyped_data(),
                             *w_type,
                             rows,
                             cols,
                             block,
                             weight_format,
                             nvfp4,
                             codes->untyped_data(),
                             *packed,
                             static_cast<uint8_t*>(scales->untyped_data()),
                             static_cast<float*>(global_scale->untyped_data())};
  return ffi::Error::Success();
}

}  // namespace fp8norm
