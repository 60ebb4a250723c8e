// The CPU kernel of the weight quantiser (src/common/quantize_weight.h), run by the
// quantize_weight target's CPU handler (cpu_handlers.cc).
#pragma once

#include "quantize_weight.h"
#include "rms_norm_fp8.h"

namespace fp8norm {

// Tasks of whole bands of `block` rows (a tile row), which start on a byte of packed FP4
// codes (block * F is even): no two tasks write one byte. NVFP4 first reduces max|w| over
// the bands, then quantises them; the maximum is order-free, so the global scale's bits
// do not depend on how the bands were split among threads. FP8: tasks of strips of
// columns, each over every band of rows. False where the host is out of memory for a
// task's scratch.
bool QuantizeWeightCpu(const QuantizeWeightArgs& args, const ParallelFor& parallel_for);

}  // namespace fp8norm
