// The registry of peer_workspaces.h. Workspaces live as long as the process: an executable
// XLA still holds may run again, and no stage tells a handler that all are gone.
#include "peer_workspaces.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>

#include "cuda_kernels.h"

namespace fp8norm {
namespace {

// A call site's groups, keyed by the call site, the size of its workspaces (a call site
// of another process, an exported function, may carry the same number) and its devices.
using SiteKey = std::tuple<int64_t, size_t, std::vector<int64_t>>;

struct Registry {
  // Held only to look up or insert: never while a device works, so that an execution's
  // lookup never waits for another call site's set-up (whose cudaMalloc may wait for a
  // kernel that waits for this execution's device).
  std::mutex mutex;
  // Held by one set-up at a time, through its device work.
  std::mutex set_up;
  std::map<SiteKey, std::vector<std::unique_ptr<PeerGroup>>> sites;
};

Registry& TheRegistry() {
  static Registry* registry = new Registry;  // never destroyed: executions may run at exit
  return *registry;
}

// Restores the calling thread's current device.
class DeviceRestorer {
 public:
  DeviceRestorer() { ok_ = cudaGetDevice(&previous_) == cudaSuccess; }
  ~DeviceRestorer() {
    if (ok_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool ok_ = false;
};

void FreeGroups(const std::vector<std::unique_ptr<PeerGroup>>& groups) {
  for (const auto& g : groups) {
    for (size_t p = 0; p < g->devices.size(); ++p) {
      if (g->workspaces[p] == nullptr) continue;
      cudaSetDevice(static_cast<int>(g->devices[p]));
      cudaFree(g->workspaces[p]);
    }
  }
}

cudaError_t SetUpGroup(PeerGroup* g, std::string* error) {
  const int n = static_cast<int>(g->devices.size());
  for (int p = 0; p < n; ++p) {
    const int device = static_cast<int>(g->devices[p]);
    cudaError_t err = cudaSetDevice(device);
    if (err == cudaSuccess) {
      err = cudaMalloc(reinterpret_cast<void**>(&g->workspaces[p]), g->layout.total);
    }
    // Zeroed on a stream of its own that does not wait for the device's other streams:
    // the legacy default stream would wait for a kernel of another call that may itself
    // wait for a device whose set-up this is.
    cudaStream_t stream = nullptr;
    if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (err == cudaSuccess) {
      err = cudaMemsetAsync(g->workspaces[p], 0, g->layout.total, stream);
      const cudaError_t synced = cudaStreamSynchronize(stream);
      if (err == cudaSuccess) err = synced;
      cudaStreamDestroy(stream);
    }
    if (err == cudaSuccess) err = LoadAllReduceKernel();
    int multiprocessors = 0;
    if (err == cudaSuccess) {
      err = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
    }
    g->max_blocks = std::min(g->max_blocks, static_cast<unsigned>(std::max(1, multiprocessors)));
    if (err != cudaSuccess) {
      *error = "allocating the all-reduce workspace of device " + std::to_string(device);
      return err;
    }
    for (int q = 0; q < n; ++q) {
      if (q == p) continue;
      int reachable = 0;
      err = cudaDeviceCanAccessPeer(&reachable, device, static_cast<int>(g->devices[q]));
      if (err == cudaSuccess && !reachable) err = cudaErrorInvalidDevice;
      if (err == cudaSuccess) {
        err = cudaDeviceEnablePeerAccess(static_cast<int>(g->devices[q]), 0);
        if (err == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();
          err = cudaSuccess;
        }
      }
      if (err != cudaSuccess) {
        *error = "device " + std::to_string(device) + " cannot reach the memory of device " +
                 std::to_string(g->devices[q]);
        return err;
      }
    }
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t SetUpPeerGroups(int64_t call_site, const std::vector<int64_t>& devices,
                            int devices_per_group, const PeerWorkspaceLayout& layout,
                            std::string* error) {
  Registry& registry = TheRegistry();
  std::lock_guard<std::mutex> one_set_up(registry.set_up);
  SiteKey key{call_site, layout.total, devices};
  {
    std::lock_guard<std::mutex> lock(registry.mutex);
    if (registry.sites.count(key) != 0) return cudaSuccess;
  }
  DeviceRestorer restore;
  std::vector<std::unique_ptr<PeerGroup>> groups;
  for (size_t first = 0; first + devices_per_group <= devices.size(); first += devices_per_group) {
    auto g = std::make_unique<PeerGroup>();
    g->devices.assign(devices.begin() + first, devices.begin() + first + devices_per_group);
    g->layout = layout;
    g->key = static_cast<uint64_t>(call_site) * 4096 + first / devices_per_group;
    const cudaError_t err = SetUpGroup(g.get(), error);
    groups.push_back(std::move(g));
    if (err != cudaSuccess) {
      cudaGetLastError();
      FreeGroups(groups);
      return err;
    }
  }
  std::lock_guard<std::mutex> lock(registry.mutex);
  registry.sites.emplace(std::move(key), std::move(groups));
  return cudaSuccess;
}

const PeerGroup* FindPeerGroup(int64_t call_site, const std::vector<int64_t>& devices,
                               const PeerWorkspaceLayout& layout, int64_t device, int* position) {
  Registry& registry = TheRegistry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  const auto it = registry.sites.find(SiteKey{call_site, layout.total, devices});
  if (it == registry.sites.end()) return nullptr;
  for (const auto& g : it->second) {
    for (size_t p = 0; p < g->devices.size(); ++p) {
      if (g->devices[p] == device) {
        *position = static_cast<int>(p);
        return g.get();
      }
    }
  }
  return nullptr;
}

void ReleasePeerGroups(int64_t call_site) {
  Registry& registry = TheRegistry();
  std::lock_guard<std::mutex> one_set_up(registry.set_up);
  std::lock_guard<std::mutex> lock(registry.mutex);
  DeviceRestorer restore;
  for (auto it = registry.sites.begin(); it != registry.sites.end();) {
    if (std::get<0>(it->first) == call_site) {
      FreeGroups(it->second);
      it = registry.sites.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace fp8norm
