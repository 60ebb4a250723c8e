// The launch of rms_norm_fp8 / add_rms_norm_fp8 on a GPU: each device's one-time setup
// (its limits read, every kernel loaded, block_shared's attribute set), kept per device
// in a process-wide registry; the kernel variant asked for; and the launch of the family
// the call's plan (cuda_launch_plan.h) picks. Host code over the CUDA runtime API: the
// kernels are in the families' .cu files (kernel_families.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cuda_kernels.h"
#include "cuda_launch_plan.h"
#include "kernel_families.h"

namespace fp8norm {
namespace {

// The device's limits the plan needs: attribute reads, answered from the runtime's tables.
cudaError_t QueryDeviceLimits(int device, DeviceLimits* limits) {
  struct Read {
    cudaDeviceAttr attribute;
    int value;
  } reads[] = {{cudaDevAttrMaxSharedMemoryPerBlockOptin, 0},
               {cudaDevAttrMaxSharedMemoryPerBlock, 0},
               {cudaDevAttrMaxGridDimX, 0},
               {cudaDevAttrReservedSharedMemoryPerBlock, 0},
               {cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0},
               {cudaDevAttrMultiProcessorCount, 0}};
  for (Read& r : reads) {
    const cudaError_t err = cudaDeviceGetAttribute(&r.value, r.attribute, device);
    if (err != cudaSuccess) return err;
  }
  limits->optin_shared_bytes = static_cast<size_t>(reads[0].value);
  limits->default_shared_bytes = static_cast<size_t>(reads[1].value);
  limits->max_blocks = std::min<int64_t>(kMaxBlocks, reads[2].value);
  limits->reserved_shared_bytes = static_cast<size_t>(reads[3].value);
  limits->multiprocessor_shared_bytes = static_cast<size_t>(reads[4].value);
  limits->multiprocessors = std::max(1, reads[5].value);
  return cudaSuccess;
}

// What one device needs before its first launch, done once: every kernel loaded (a lazy
// module load inside CUDA graph capture fails on drivers before R545), block_shared's
// real static shared size read and its dynamic-size attribute set, to the most any call
// can use, so that no launch depends on an attribute another call may change.
struct DeviceSetup {
  // block_shared's limits per input type (indexed by FloatType): the device's, with the
  // kernels' static size and their attribute.
  DeviceLimits block_shared[3];
};

cudaError_t SetUpDevice(int device, DeviceSetup* setup) {
  DeviceLimits limits{0, 0};
  cudaError_t err = QueryDeviceLimits(device, &limits);
  for (const FloatType input : {FloatType::kF32, FloatType::kF16, FloatType::kBF16}) {
    if (err == cudaSuccess) err = LoadRegisterRowKernels(input);
    if (err == cudaSuccess) {
      err = SetUpBlockShared(input, limits, &setup->block_shared[static_cast<int>(input)]);
    }
  }
  if (err == cudaSuccess) err = LoadRoundKernel();
  if (err == cudaSuccess) err = LoadBackwardKernels();
  if (err == cudaSuccess) err = LoadColumnwiseKernel();
  if (err == cudaSuccess) err = LoadQuantizeWeightKernels();
  if (err == cudaSuccess) err = LoadQuantizeGradientKernels();
  return err;
}

struct Setups {
  std::mutex mutex;
  std::unordered_map<int, std::unique_ptr<const DeviceSetup>> by_device;
  std::vector<std::unique_ptr<const DeviceSetup>> forgotten;  // may still be read
};

Setups& AllSetups() {
  static Setups* setups = new Setups;  // never destroyed: launches may run at exit
  return *setups;
}

// The device's setup, done now if it was not; a failed setup is not kept, so that a call
// outside capture tries again.
cudaError_t GetDeviceSetup(int device, const DeviceSetup** out) {
  Setups& s = AllSetups();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.by_device.find(device);
  if (it == s.by_device.end()) {
    auto setup = std::make_unique<DeviceSetup>();
    const cudaError_t err = SetUpDevice(device, setup.get());
    if (err != cudaSuccess) return err;
    it = s.by_device.emplace(device, std::move(setup)).first;
  }
  *out = it->second.get();
  return cudaSuccess;
}

std::atomic<int> requested_variant{static_cast<int>(KernelVariant::kAuto)};

cudaError_t LaunchPlanned(cudaStream_t stream, const RmsNormFp8Args& a, const LaunchPlan& p) {
  return p.variant == KernelVariant::kBlockShared ? LaunchBlockShared(stream, a, p)
                                                  : LaunchRegisterRows(stream, a, p);
}

// The rows' kernel of `plan` (with the columns' where plan.both_layouts).
cudaError_t Launch(cudaStream_t stream, const DeviceLimits& limits, const RmsNormFp8Args& a,
                   const LaunchPlan& plan, KernelVariant requested) {
  if (plan.both_layouts) return LaunchBothLayoutsKernel(stream, a, plan);
  const cudaError_t err = LaunchPlanned(stream, a, plan);
  if (err != cudaErrorInvalidValue || !plan.cached) return err;
  // The GPU refused the row cache after all (a limit the plan does not model): nothing
  // was enqueued, so re-read the row instead.
  cudaGetLastError();
  DeviceLimits uncached = limits;
  uncached.max_dynamic_shared_bytes = 0;
  return LaunchPlanned(stream, a, PlanRmsNormFp8Launch(a, uncached, requested));
}

// The rows' outputs where they need no kernel (true, with the status in *err): none for
// no rows; for empty rows, no groups at all, or a row of zeros' scale. That is 0 for a
// dynamic nearest-rounded scale (zero bits in every scale dtype); a power-of-two or
// calibrated one comes from the kernel, whose sweeps are then empty, as does r.
bool RowsWithoutKernel(cudaStream_t stream, const RmsNormFp8Args& a, cudaError_t* err) {
  *err = cudaSuccess;
  if (a.rows == 0) return true;
  // Empty rows' per-row global scales (the floor) come from the kernel, as r does.
  if (a.hidden != 0 || a.inverse_rms != nullptr || PerRowGlobalScales(a)) return false;
  if (!PerRowScale(a)) return true;
  if (a.static_scale != nullptr || a.constants.power_of_two) return false;
  *err = cudaMemsetAsync(a.scales, 0, static_cast<size_t>(a.rows) * FloatTypeBytes(a.scale_type),
                         stream);
  return true;
}

// block_shared's limits for the call's dtypes on a prepared device.
const DeviceLimits& LimitsFor(const DeviceSetup& setup, const RmsNormFp8Args& a) {
  return setup.block_shared[static_cast<int>(a.input_type)];
}

}  // namespace

cudaError_t PrepareDevice(int device) {
  const DeviceSetup* setup = nullptr;
  return GetDeviceSetup(device, &setup);
}

void ForgetDeviceSetups() {
  Setups& s = AllSetups();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (auto& entry : s.by_device) s.forgotten.push_back(std::move(entry.second));
  s.by_device.clear();
}

void SetKernelVariant(KernelVariant variant) {
  requested_variant.store(static_cast<int>(variant), std::memory_order_relaxed);
}

KernelVariant RequestedKernelVariant() {
  return static_cast<KernelVariant>(requested_variant.load(std::memory_order_relaxed));
}

cudaError_t PlanLaunch(int device, const RmsNormFp8Args& a, LaunchPlan* plan) {
  const DeviceSetup* setup = nullptr;
  const cudaError_t err = GetDeviceSetup(device, &setup);
  if (err == cudaSuccess)
    *plan = PlanRmsNormFp8Launch(a, LimitsFor(*setup, a), RequestedKernelVariant());
  return err;
}

cudaError_t LaunchRmsNormFp8(cudaStream_t stream, int device, const RmsNormFp8Args& a) {
  const bool columnwise = a.columns.y_t != nullptr;
  cudaError_t err = cudaSuccess;
  const bool rows_kernel = !RowsWithoutKernel(stream, a, &err);
  if (!columnwise && !rows_kernel) return err;
  const DeviceSetup* setup = nullptr;
  err = GetDeviceSetup(device, &setup);
  if (err != cudaSuccess) return err;
  LaunchPlan plan{};
  if (rows_kernel) {
    const KernelVariant requested = RequestedKernelVariant();
    plan = PlanRmsNormFp8Launch(a, LimitsFor(*setup, a), requested);
    err = Launch(stream, LimitsFor(*setup, a), a, plan, requested);
  }
  if (err != cudaSuccess || !columnwise || plan.both_layouts) return err;
  return LaunchColumnwise(stream, a);
}

}  // namespace fp8norm
