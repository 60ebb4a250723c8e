// The CUDA kernels and their launch functions, compiled by the host compiler against the
// SIMT emulation's runtime (src/simt/include): the .cu file itself, not a copy of it.
#include "cuda_kernels.cu"
