// The constants every compiled module exports to Python, and the helper that exports an
// enum's table of names (named_codes.h) as {name: code}. For the module .cc files only:
// nanobind, never seen by nvcc.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>

#include "ffi_decode.h"
#include "named_codes.h"

namespace fp8norm {

template <typename Enum, size_t N>
nanobind::dict CodesByName(const NamedCode<Enum> (&table)[N]) {
  nanobind::dict codes;
  for (const NamedCode<Enum>& entry : table) codes[entry.name] = static_cast<int64_t>(entry.code);
  return codes;
}

// Every module's: the fp4_layout codes the handlers know (Fp4Layout).
inline void AddFp4Layouts(nanobind::module_& m) {
  m.def("fp4_layouts", []() { return CodesByName(kFp4LayoutNames); });
}

// Every module's: the format codes of the quantize_weight target (WeightFormat).
inline void AddWeightFormats(nanobind::module_& m) {
  m.def("weight_formats", []() { return CodesByName(kWeightFormatNames); });
}

}  // namespace fp8norm
