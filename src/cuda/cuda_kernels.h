// Launch functions of the CUDA kernels: plain C++ over the CUDA runtime API, called by
// the FFI handlers (host compiler) and defined in device_setup.cc and allreduce.cu; the
// kernel families' own (LaunchRound, LaunchRmsNormBackward, ...) are in kernel_families.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda_launch_plan.h"
#include "kernel_families.h"
#include "peer_allreduce.h"
#include "rms_norm_fp8.h"

namespace fp8norm {

// Enqueues rms_norm_fp8 (args.residual == null) or add_rms_norm_fp8 on `stream`, which
// belongs to `device`, the current device, with the columnwise outputs where args.columns
// has them (in the one launch or two its plan says). Only stream-ordered work: safe inside
// CUDA graph capture. Returns the launch status.
cudaError_t LaunchRmsNormFp8(cudaStream_t stream, int device, const RmsNormFp8Args& args);

// allreduce.cu. Loads the one-kernel all-reduce's kernel on the current device (its set-up,
// outside graph capture); enqueues one device's share of a call of it on `stream`. Every
// device of the group must launch it for the call, with the same rows, method and
// `max_blocks` (PeerGroup's): its blocks wait for their peers' (`peer_group` names the
// group to the emulation).
cudaError_t LoadAllReduceKernel();
cudaError_t LaunchAllReduceNorm(cudaStream_t stream, const AllReduceArgs& args, uint64_t peer_group,
                                unsigned max_blocks);

// The one-time work for `device`, the current device, before its first launch: loads every
// kernel and sets the attributes launches rely on. Not stream-ordered, so not for inside
// CUDA graph capture: the FFI initialize stage runs it. A launch on a device not yet
// prepared prepares it first; a failed preparation is tried again by the next call.
cudaError_t PrepareDevice(int device);

// Forgets every device's preparation, as a new process would (after a device reset; the
// emulation's "another device").
void ForgetDeviceSetups();

// The kernel variant later launches use (kAuto: the plan's table), process-wide.
void SetKernelVariant(KernelVariant variant);
KernelVariant RequestedKernelVariant();

// The plan LaunchRmsNormFp8 follows for `args` on `device` (preparing it if need be), for
// tests and reports: the launch itself may still fall back (see Launch).
cudaError_t PlanLaunch(int device, const RmsNormFp8Args& args, LaunchPlan* plan);

}  // namespace fp8norm
