// The workspaces of the one-kernel all-reduce (peer_allreduce.h), per call site and device
// group: allocated, zeroed and made reachable from every peer once, in the set-up stage,
// and found again, without waiting for any peer, by every execution. A process-wide
// registry: one process drives every GPU of its groups (JAX's default on one host).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "peer_allreduce.h"

namespace fp8norm {

// One group's workspaces, by position on the axis.
struct PeerGroup {
  std::vector<int64_t> devices;
  unsigned char* workspaces[kMaxPeers] = {};
  PeerWorkspaceLayout layout{};
  uint64_t key = 0;  // unique per call site and group (the emulation's peer group)
  // The most blocks a launch may have: a block waits for its peers' blocks of the same
  // index, so every block of every device must be resident at once, one per
  // multiprocessor of the group's smallest device, and at most kMaxAllReduceBlocks.
  unsigned max_blocks = kMaxAllReduceBlocks;
};

// For call site `call_site`, whose groups are `devices` (group after group,
// `devices_per_group` devices each, every device at most once): every device's workspace
// of `layout`, zeroed, and peer access enabled between the devices of each group, unless
// already done for the call site. Not stream-ordered: for the set-up stage, never inside graph
// capture. On failure, `error` says what failed (and nothing is kept, so a later set-up tries
// again).
cudaError_t SetUpPeerGroups(int64_t call_site, const std::vector<int64_t>& devices,
                            int devices_per_group, const PeerWorkspaceLayout& layout,
                            std::string* error);

// The group of `device` at call site `call_site` (with workspaces of `layout`) and the
// device's position in it; null when the call site was never set up for it. Waits for no
// set-up in progress.
const PeerGroup* FindPeerGroup(int64_t call_site, const std::vector<int64_t>& devices,
                               const PeerWorkspaceLayout& layout, int64_t device, int* position);

// Frees call site `call_site`'s workspaces, for a caller that knows no execution can use
// them any more (tests/simt's checks).
void ReleasePeerGroups(int64_t call_site);

}  // namespace fp8norm
