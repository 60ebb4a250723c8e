// The CUDA FFI handlers, compiled by the host compiler against the SIMT emulation's
// runtime (FP8NORM_SIMT is defined for this target): the same decoding, driver check,
// device guard and launch calls, on XLA's CPU backend.
#include "cuda_handlers.cc"
