// The one-kernel all-reduce of allreduce_residual_rms_norm_fp8: one launch per device of
// the group, the same grid on every device, in which block b meets the blocks b of its
// peers through flags in device memory (docs/spec.md, "One-kernel all-reduce";
// docs/performance.md has the bytes each method moves).
//
//   one-shot: block b copies its rows of this device's partial x into the device's own
//     workspace and flags every peer; once every peer has flagged it, it sums the rows
//     of every device's workspace in the order of the axis, adds the residual and
//     normalises and quantises them (block_shared_rows.cuh) into the call's outputs.
//   two-shot: each device normalises its slice of the rows into its workspace's results,
//     and flags its peers again; then every device copies every slice's outputs.
//
// Epochs: a block counts its launches in the workspace (the device's, never the host's),
// and stores that count as its flags, so a flag of an earlier call is never taken for
// this one's, in a loop or a CUDA graph's replay alike. The partials and results are
// double-buffered by the count's parity, so no barrier is needed at the end: a peer
// overwrites the partials this call reads only after this device has flagged the next
// call (the results, the call after next), which it does only once this launch has ended.
#include <cuda_runtime.h>

#include <cstdint>

#include "block_shared_rows.cuh"
#include "cuda_kernels.h"
#include "kernel_launch.h"
#include "peer_allreduce.h"
#include "row_blocks.cuh"

namespace fp8norm {
namespace {

struct AllReduceScratch {
  SharedScratch norm;
  uint32_t epoch;
};

// Whether a flag holding `value` has reached `epoch`: epochs only grow, modulo 2^32.
__device__ __forceinline__ bool FlagReached(uint32_t value, uint32_t epoch) {
  return static_cast<int32_t>(value - epoch) >= 0;
}

// Flag [stage][block][from] of a workspace.
__device__ __forceinline__ uint32_t* FlagOf(const AllReduceArgs& a, unsigned char* workspace,
                                            int stage, unsigned block, int from) {
  return reinterpret_cast<uint32_t*>(workspace + a.layout.flags) +
         (static_cast<size_t>(stage) * kMaxAllReduceBlocks + block) * kMaxPeers + from;
}

// Every peer's flag [stage][this block][this device] becomes `epoch`, after the whole
// block's writes; then the block waits until every peer has stored its own. Thread p
// stores to and waits for device p.
__device__ __forceinline__ void MeetPeers(const AllReduceArgs& a, int stage, uint32_t epoch) {
  __syncthreads();
  const int p = static_cast<int>(threadIdx.x);
  if (p < a.num_devices) {
    StoreReleaseSystem(FlagOf(a, a.workspaces[p], stage, blockIdx.x, a.position), epoch);
    const uint32_t* flag = FlagOf(a, a.workspaces[a.position], stage, blockIdx.x, p);
    while (!FlagReached(LoadAcquireSystem(flag), epoch)) FlagWaitPoint(flag, epoch);
  }
  __syncthreads();
}

// The block copies `bytes` from `from` to `to`: in 16-byte pieces where both are aligned
// and the size divides, else byte by byte.
__device__ __forceinline__ void CopyBytes(void* to, const void* from, int64_t bytes) {
  if (AlignedTo(to, 16) && AlignedTo(from, 16) && bytes % 16 == 0) {
    using Piece = Vec<uint32_t, 4>;
    for (int64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) {
      StoreGlobal(static_cast<Piece*>(to) + i, LoadGlobal(static_cast<const Piece*>(from) + i));
    }
    return;
  }
  for (int64_t i = threadIdx.x; i < bytes; i += blockDim.x) {
    StoreGlobal(static_cast<uint8_t*>(to) + i, LoadGlobal(static_cast<const uint8_t*>(from) + i));
  }
}

// The rows [begin, end) that block b takes: begin + b, then every gridDim.x-th.
template <typename Fn>
__device__ __forceinline__ void ForEachRowOfBlock(int64_t begin, int64_t end, Fn fn) {
  for (int64_t row = begin + blockIdx.x; row < end; row += gridDim.x) fn(row);
}

// For each device's slice (two-shot) or the whole call (one-shot), fn(device, first row,
// end row).
template <typename Fn>
__device__ __forceinline__ void ForEachSlice(const AllReduceArgs& a, Fn fn) {
  const int64_t rows = a.norm.rows;
  if (a.method != AllReduceMethod::kTwoShot) {
    fn(a.position, int64_t{0}, rows);
    return;
  }
  for (int q = 0; q < a.num_devices; ++q) {
    fn(q, SliceBegin(rows, a.num_devices, q), SliceBegin(rows, a.num_devices, q + 1));
  }
}

__device__ __forceinline__ const unsigned char* PartialOf(const AllReduceArgs& a, int device,
                                                          int parity) {
  return a.workspaces[device] + a.layout.partials + parity * a.layout.partial_bytes;
}

// The row's fixed-order sum h = ((f32(x_0) + f32(x_1)) + ...) + f32(x_{n-1}) into
// `reduced`, each vector by the thread that reads it back in sweep 1 (the same kVec).
template <int kVec>
__device__ __forceinline__ void SumRow(const AllReduceArgs& a, int64_t row, int parity) {
  const int64_t hidden = a.norm.hidden;
  const size_t in_bytes = FloatTypeBytes(a.partial_type);
  float* reduced =
      reinterpret_cast<float*>(a.workspaces[a.position] + a.layout.reduced) + row * hidden;
  for (int64_t i = threadIdx.x; i < hidden / kVec; i += blockDim.x) {
    float h[kVec];
    LoadAny<kVec>(PartialOf(a, 0, parity) + row * hidden * in_bytes, a.partial_type, i, h);
    for (int q = 1; q < a.num_devices; ++q) {
      float x[kVec];
      LoadAny<kVec>(PartialOf(a, q, parity) + row * hidden * in_bytes, a.partial_type, i, x);
#pragma unroll
      for (int k = 0; k < kVec; ++k) h[k] += x[k];
    }
    StoreAny<kVec>(reduced, FloatType::kF32, i, h);
  }
}

template <int kVec>
__device__ __forceinline__ void NormalizeRow(const RmsNormFp8Args& norm, int64_t row, float* cache,
                                             SharedScratch& scratch) {
  if (PerRowScale(norm)) {
    ProcessRow<float, kVec>(norm, row, cache, scratch);
  } else {
    ProcessGroupedRow<float, kVec>(norm, row, cache, scratch);
  }
}

// grid: AllReduceBlocks (the same on every device); block: kAllReduceThreads.
// Dynamic shared memory: hidden floats when `cached`, none otherwise.
__global__ void __launch_bounds__(kAllReduceThreads)
    AllReduceNormKernel(const AllReduceArgs a, const bool vectorized, const bool cached) {
  float* const cache = cached ? DynamicShared<float>() : nullptr;
  AllReduceScratch& scratch = StaticShared<AllReduceScratch>();
  const int64_t hidden = a.norm.hidden;
  const size_t in_bytes = FloatTypeBytes(a.partial_type);
  uint32_t* const epochs = reinterpret_cast<uint32_t*>(a.workspaces[a.position] + a.layout.epochs);
  if (threadIdx.x == 0) scratch.epoch = LoadGlobal(epochs + blockIdx.x) + 1;
  __syncthreads();
  const uint32_t epoch = scratch.epoch;
  const int parity = static_cast<int>(epoch & 1);

  // Stage 1: this device's rows of x that the blocks b of every device sum.
  unsigned char* const own_partial =
      a.workspaces[a.position] + a.layout.partials + parity * a.layout.partial_bytes;
  ForEachSlice(a, [&](int, int64_t begin, int64_t end) {
    ForEachRowOfBlock(begin, end, [&](int64_t row) {
      const size_t offset = row * hidden * in_bytes;
      CopyBytes(own_partial + offset, static_cast<const unsigned char*>(a.partial) + offset,
                hidden * in_bytes);
    });
  });
  MeetPeers(a, 0, epoch);

  // Sum, add the residual, normalise and quantise the rows this device owns: into the
  // call's outputs (one-shot), or into this call's parity of the results (two-shot).
  RmsNormFp8Args norm = a.norm;
  if (a.method == AllReduceMethod::kTwoShot) {
    unsigned char* const results =
        a.workspaces[a.position] + a.layout.results + parity * a.layout.result_bytes;
    norm.y = results;
    norm.scales = results + a.layout.result_scales;
    norm.residual_out = results + a.layout.result_residual;
  }
  const int64_t rows = a.norm.rows;
  const int64_t own_begin =
      a.method == AllReduceMethod::kTwoShot ? SliceBegin(rows, a.num_devices, a.position) : 0;
  const int64_t own_end = a.method == AllReduceMethod::kTwoShot
                              ? SliceBegin(rows, a.num_devices, a.position + 1)
                              : rows;
  ForEachRowOfBlock(own_begin, own_end, [&](int64_t row) {
    if (vectorized) {
      SumRow<kVecOf<float>>(a, row, parity);
      NormalizeRow<kVecOf<float>>(norm, row, cache, scratch.norm);
    } else {
      SumRow<1>(a, row, parity);
      NormalizeRow<1>(norm, row, cache, scratch.norm);
    }
  });

  if (a.method == AllReduceMethod::kTwoShot) {
    // Stage 2: every slice's outputs, from the results of the device that computed them.
    MeetPeers(a, 1, epoch);
    ForEachSlice(a, [&](int q, int64_t begin, int64_t end) {
      const unsigned char* results =
          a.workspaces[q] + a.layout.results + parity * a.layout.result_bytes;
      ForEachRowOfBlock(begin, end, [&](int64_t row) {
        CopyBytes(static_cast<uint8_t*>(a.y) + row * a.y_row_bytes, results + row * a.y_row_bytes,
                  a.y_row_bytes);
        CopyBytes(static_cast<uint8_t*>(a.scales) + row * a.scale_row_bytes,
                  results + a.layout.result_scales + row * a.scale_row_bytes, a.scale_row_bytes);
        CopyBytes(static_cast<uint8_t*>(a.residual_out) + row * a.residual_row_bytes,
                  results + a.layout.result_residual + row * a.residual_row_bytes,
                  a.residual_row_bytes);
      });
    });
  }
  if (threadIdx.x == 0) StoreGlobal(epochs + blockIdx.x, epoch);
}

}  // namespace

cudaError_t LoadAllReduceKernel() {
  cudaFuncAttributes attributes{};
  return LoadKernel(AllReduceNormKernel, "allreduce_norm", sizeof(AllReduceScratch),
                    kAllReduceThreads, &attributes);
}

cudaError_t LaunchAllReduceNorm(cudaStream_t stream, const AllReduceArgs& args, uint64_t peer_group,
                                unsigned max_blocks) {
  if (args.norm.rows == 0) return cudaSuccess;  // on every device alike
  PeerLaunchRecord record(peer_group, args.position, args.num_devices);
  static const char* const kNames[kMaxPeers] = {"workspace of device 0", "workspace of device 1",
                                                "workspace of device 2", "workspace of device 3",
                                                "workspace of device 4", "workspace of device 5",
                                                "workspace of device 6", "workspace of device 7"};
  for (int p = 0; p < args.num_devices; ++p) {
    record.AddMemory(kNames[p], args.workspaces[p], args.layout.total);
  }
  // The row cache as block_shared's without opting in: the default limit, less the
  // kernel's static share; longer rows re-read the sum (from L2 on a GPU).
  const size_t cache_bytes = static_cast<size_t>(args.norm.hidden) * sizeof(float);
  const bool cached = cache_bytes + sizeof(AllReduceScratch) + 16 <= kDefaultSharedBytes;
  return LaunchKernel(AllReduceNormKernel,
                      AllReduceBlocks(args.norm.rows, args.num_devices, args.method, max_blocks),
                      kAllReduceThreads, cached ? cache_bytes : 0, stream, args,
                      RowsVectorizable(args.norm), cached);
}

}  // namespace fp8norm
