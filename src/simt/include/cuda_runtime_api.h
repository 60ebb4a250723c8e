// The SIMT emulation's stand-in for <cuda_runtime_api.h>: the same declarations as its
// <cuda_runtime.h>, which is what the host files of the CUDA path include.
#pragma once

#include "cuda_runtime.h"
