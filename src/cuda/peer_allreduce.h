// The one-kernel all-reduce of allreduce_residual_rms_norm_fp8 (docs/spec.md, "One-kernel
// all-reduce"): the arguments of its kernel (allreduce.cu) and the layout of the workspace
// each device of a group owns, which its peers read and signal in. Plain C++, for the
// host code (peer_workspaces.cc, the handlers) and nvcc alike.
#pragma once

#include <cstddef>
#include <cstdint>

#include "named_codes.h"
#include "rms_norm_fp8.h"

namespace fp8norm {

// The most devices one group may have: the tensor-parallel sizes of one host. The CUDA
// modules export it (cuda_module_bindings.h), for the Python package's refusals.
constexpr int kMaxPeers = 8;
// The most blocks of one launch. A block waits for the blocks of the same index on its
// peers, so every block of every device must be resident at once: the set-up caps the
// grid further at the multiprocessors of the group's smallest device (PeerGroup).
constexpr int kMaxAllReduceBlocks = 64;
// Threads per block: at least one per peer for the flags, and 8 float32 vectors of a
// hidden-8192 row per thread.
constexpr int kAllReduceThreads = 256;

enum class AllReduceMethod : int32_t { kOneShot = 1, kTwoShot = 2 };
// The methods' names, as the all-reduce's `method=` keyword spells them: the CUDA modules
// export the table (cuda_module_bindings.h), and the Python lowering writes the codes
// from it into the call's `method` attribute.
constexpr NamedCode<AllReduceMethod> kAllReduceMethodNames[] = {
    {AllReduceMethod::kOneShot, "one_shot"},
    {AllReduceMethod::kTwoShot, "two_shot"},
};

// Byte offsets in one device's workspace, the same on every device of the group.
struct PeerWorkspaceLayout {
  size_t epochs;    // [kMaxAllReduceBlocks] uint32: the launches each block has begun
  size_t flags;     // [2 stages][kMaxAllReduceBlocks][kMaxPeers] uint32, stored by peers
  size_t partials;  // [2 parities][partial_bytes]: this device's x, for its peers
  size_t partial_bytes;
  size_t reduced;  // [rows, hidden] float32: the fixed-order sum of the rows it normalises
  size_t results;  // two-shot: [2 parities][result_bytes] of its own rows' outputs
  size_t result_bytes;
  // Within one parity of the results: y at 0, the scales at result_scales and
  // residual_out at result_residual, each laid out as the call's output.
  size_t result_scales;
  size_t result_residual;
  size_t total;
};

constexpr size_t AlignUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// For rows of `hidden` elements in any of the dtypes the op takes: partials of up to 4
// bytes per element, y of up to 1 byte, scales of up to 4 bytes per element (groups of
// one) and residual_out of up to 4. Every region starts 256-byte aligned.
inline PeerWorkspaceLayout LayOutPeerWorkspace(int64_t rows, int64_t hidden,
                                               AllReduceMethod method) {
  const size_t elements = static_cast<size_t>(rows) * static_cast<size_t>(hidden);
  PeerWorkspaceLayout l{};
  size_t at = 0;
  const auto take = [&](size_t bytes) {
    const size_t start = at;
    at = AlignUp(at + bytes, 256);
    return start;
  };
  l.epochs = take(sizeof(uint32_t) * kMaxAllReduceBlocks);
  l.flags = take(sizeof(uint32_t) * 2 * kMaxAllReduceBlocks * kMaxPeers);
  l.partial_bytes = AlignUp(elements * 4, 256);
  l.partials = take(2 * l.partial_bytes);
  l.reduced = take(elements * 4);
  l.result_scales = AlignUp(elements, 256);
  l.result_residual = l.result_scales + AlignUp(elements * 4, 256);
  l.result_bytes = method == AllReduceMethod::kTwoShot ? l.result_residual + elements * 4 : 0;
  l.result_bytes = AlignUp(l.result_bytes, 256);
  l.results = take(2 * l.result_bytes);
  l.total = at;
  return l;
}

// One call of the kernel on one device of the group.
struct AllReduceArgs {
  // The norm of the rows this device normalises: x is `reduced` in its workspace (float32),
  // the residual, gamma and scale operand the call's; y, scales and residual_out the
  // call's outputs (one-shot) or its workspace's results (two-shot).
  RmsNormFp8Args norm;
  const void* partial;  // [rows, hidden] this device's partial sum, of partial_type
  FloatType partial_type;
  // The call's outputs, which two-shot fills from every device's results.
  void* y;
  void* scales;
  void* residual_out;
  int64_t y_row_bytes;
  int64_t scale_row_bytes;
  int64_t residual_row_bytes;
  unsigned char* workspaces[kMaxPeers];  // every device's, by position on the axis
  PeerWorkspaceLayout layout;
  int32_t num_devices;
  int32_t position;
  AllReduceMethod method;
};

// The first row of device `position`'s slice under two-shot: slices differ by at most one
// row, so any row count divides.
FP8NORM_HD int64_t SliceBegin(int64_t rows, int32_t num_devices, int32_t position) {
  return rows * position / num_devices;
}

// Blocks of one launch: one per row of the rows a device normalises, at most `max_blocks`
// (they stride over more). The same on every device of the group.
inline unsigned AllReduceBlocks(int64_t rows, int32_t num_devices, AllReduceMethod method,
                                unsigned max_blocks) {
  const int64_t own =
      method == AllReduceMethod::kTwoShot ? (rows + num_devices - 1) / num_devices : rows;
  return static_cast<unsigned>(own < max_blocks ? (own > 0 ? own : 1) : max_blocks);
}

}  // namespace fp8norm
