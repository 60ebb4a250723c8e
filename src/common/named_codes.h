// A name for each value of an enum whose codes cross into Python (an FFI attribute's
// values): the one table from which the compiled modules export {name: code}
// (constant_bindings.h) and the Python package takes the codes it writes. Plain C++, for
// the host compiler and nvcc alike.
#pragma once

namespace fp8norm {

template <typename Enum>
struct NamedCode {
  Enum code;
  const char* name;
};

}  // namespace fp8norm
