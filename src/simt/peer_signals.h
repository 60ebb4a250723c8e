// The SIMT emulation's devices that signal each other (docs/simt.md, "Several devices"):
// the launches of one peer group, one per emulated device, run on their own OS threads and
// wait for flags in each other's memory. One device of a group runs its kernel at a time,
// until all the threads of its block wait for flags (or its launch ends), so a kernel that
// reads a peer's memory without waiting for the peer's flag reads it before the peer
// wrote it, in every run. A block whose threads all wait hands its OS thread to this
// board, which sleeps until some flag it waits for is reached and no other device runs; when
// every launch of the group waits and no flag can change any more (every other device
// waits too, or has finished its launch), the wait can never be met, and every waiting
// launch fails with a report naming each device and the flag it waits for: a deadlock is
// an error, never a hang.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace simt::internal {

// Whether a flag's value `value` has reached `target`, counting modulo 2^32: flags hold
// epochs that only grow.
inline bool FlagReached(uint32_t value, uint32_t target) {
  return static_cast<int32_t>(value - target) >= 0;
}

// The calling OS thread's peer launch, as simt::ScopedPeerLaunch declared it; none
// outside one.
struct PeerLaunch {
  uint64_t group = 0;
  int position = 0;
  int size = 0;
};
std::optional<PeerLaunch> CurrentPeerLaunch();

// Some flag was stored to: waiting launches look again.
void FlagStored();

// Blocks until `reached()` is true (nullopt) or the group deadlocks (the report). `waits`
// describes what the calling launch waits for, for the report. Outside a peer launch the
// calling launch is a group of its own, which deadlocks at once.
std::optional<std::string> AwaitFlags(const std::function<bool()>& reached,
                                      const std::string& waits);

}  // namespace simt::internal
