// What differs between a GPU and the SIMT emulation (docs/simt.md) for the CUDA FFI
// handlers, and nothing else: the one place FP8NORM_SIMT is tested, so that
// cuda_handlers.cc compiles unchanged into the CUDA module and the emulation's.
//  - The stage before execution, where each device's one-time preparation runs. XLA's GPU
//    backend runs the initialize stage with the call's device and stream, before it
//    records any command buffer; its CPU backend, where the emulated kernels run, has no
//    initialize stage, and its instantiate stage stands in.
//  - Where a call's kernels go (GpuTarget), from the handler's context. On a GPU, XLA's
//    stream and DeviceOrdinal. In the emulation XLA's CPU backend has no stream and the
//    emulated device runs each launch to completion on the calling thread: the norms and
//    their preparation run on emulated device 0 (CallGpu); the one-kernel all-reduce
//    (PeerGpu) on the device of XLA's DeviceOrdinal, each of XLA's virtual CPU devices
//    standing for one GPU of the group (its position in the group).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>

#include "xla/ffi/api/ffi.h"

namespace fp8norm {

#if defined(FP8NORM_SIMT)
inline constexpr bool kEmulatedGpu = true;
#else
inline constexpr bool kEmulatedGpu = false;
#endif

inline constexpr xla::ffi::ExecutionStage kPrepareExecutionStage =
    kEmulatedGpu ? xla::ffi::ExecutionStage::kInstantiate : xla::ffi::ExecutionStage::kInitialize;
// Its name, as jax.ffi.register_ffi_target takes it.
inline constexpr const char* kPrepareStage = kEmulatedGpu ? "instantiate" : "initialize";

// A binding for the stage before execution.
inline auto BindPrepareStage() { return xla::ffi::Ffi::Bind<kPrepareExecutionStage>(); }

// Where a call's kernels go: XLA's stream for the call and the GPU it belongs to.
struct GpuTarget {
  cudaStream_t stream;
  int32_t device;
};

// How a handler's context gives its GpuTarget (tags for Ctx<>, as XLA's DeviceOrdinal):
// the call's GPU (CallGpu), or the GPU of the peer group that XLA's DeviceOrdinal names
// (PeerGpu).
template <bool kPeer>
struct GpuOf {};
using CallGpu = GpuOf<false>;
using PeerGpu = GpuOf<true>;

}  // namespace fp8norm

template <bool kPeer>
struct xla::ffi::CtxDecoding<fp8norm::GpuOf<kPeer> > {
  using Type = fp8norm::GpuTarget;
  static std::optional<Type> Decode(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx,
                                    DiagnosticEngine& diagnostic) {
    if constexpr (fp8norm::kEmulatedGpu && !kPeer) return Type{nullptr, 0};
    const auto device = CtxDecoding<DeviceOrdinal>::Decode(api, ctx, diagnostic);
    if (!device.has_value()) return std::nullopt;
    if constexpr (fp8norm::kEmulatedGpu) return Type{nullptr, *device};
    const auto stream = CtxDecoding<PlatformStream<cudaStream_t> >::Decode(api, ctx, diagnostic);
    if (!stream.has_value()) return std::nullopt;
    return Type{*stream, *device};
  }
};
