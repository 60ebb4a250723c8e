// The launch check of launch_check.h. A launch that exceeds several limits is refused for
// the first of them in the order below, the same one every time.
#include "launch_check.h"

#include <algorithm>
#include <cstdint>
#include <utility>

namespace simt::internal {
namespace {

std::optional<LaunchRefusal> Refuse(cudaError_t code, std::string message) {
  return LaunchRefusal{code, std::move(message)};
}

}  // namespace

std::optional<LaunchRefusal> CheckLaunch(const cudaLaunchConfig_t& config,
                                         const KernelRecord& kernel, const DeviceLimits& limits) {
  const dim3 grid = config.gridDim;
  const dim3 block = config.blockDim;
  const size_t dynamic_bytes = config.dynamicSmemBytes;
  const size_t static_bytes = kernel.static_shared;
  if (grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1) {
    return Refuse(cudaErrorInvalidConfiguration, "only 1-D grids and blocks are emulated");
  }
  if (block.x == 0 || block.x > static_cast<unsigned>(limits.max_threads_per_block)) {
    return Refuse(cudaErrorInvalidConfiguration,
                  "block of " + std::to_string(block.x) + " threads (the device allows 1 to " +
                      std::to_string(limits.max_threads_per_block) + ")");
  }
  const int bounds = kernel.max_threads.value_or(0);
  if (bounds > 0 && block.x > static_cast<unsigned>(bounds)) {
    return Refuse(cudaErrorLaunchOutOfResources,
                  "block of " + std::to_string(block.x) + " threads beyond the kernel's " +
                      "__launch_bounds__ of " + std::to_string(bounds));
  }
  if (grid.x == 0 || grid.x > limits.max_grid_x) {
    return Refuse(cudaErrorInvalidConfiguration, "grid of " + std::to_string(grid.x) +
                                                     " blocks (the device allows 1 to " +
                                                     std::to_string(limits.max_grid_x) + ")");
  }
  if (static_bytes + dynamic_bytes > static_cast<size_t>(limits.shared_per_block_optin) ||
      limits.reserved_per_block + static_bytes + dynamic_bytes >
          static_cast<size_t>(limits.shared_per_multiprocessor)) {
    return Refuse(cudaErrorInvalidValue,
                  std::to_string(dynamic_bytes) + " bytes of dynamic and " +
                      std::to_string(static_bytes) + " of static shared memory (the device has " +
                      std::to_string(limits.shared_per_block_optin) + " per block, " +
                      std::to_string(limits.reserved_per_block) + " reserved)");
  }
  // Without the attribute a block may have the default limit, static and dynamic together.
  const std::optional<int> attribute = kernel.max_dynamic_shared;
  const size_t allowed_dynamic =
      attribute ? static_cast<size_t>(*attribute)
                : static_cast<size_t>(std::max<int64_t>(
                      0, int64_t{limits.shared_per_block} - static_cast<int64_t>(static_bytes)));
  if (dynamic_bytes > allowed_dynamic) {
    return Refuse(
        cudaErrorInvalidValue,
        std::to_string(dynamic_bytes) + " bytes of dynamic shared memory beside " +
            std::to_string(static_bytes) + " static, where " +
            (attribute ? "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize) "
                         "last allowed " +
                             std::to_string(*attribute)
                       : "the default limit allows " + std::to_string(allowed_dynamic)));
  }
  return std::nullopt;
}

}  // namespace simt::internal
