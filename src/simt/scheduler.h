// The SIMT emulation's scheduler: runs the blocks of a launch on the calling OS thread and
// decides which of a block's threads runs when. It implements what makes threads meet
// (__syncthreads, __shfl_xor_sync, a block's end) and holds each block's shared memory.
//
// Threads are fibers, not OS threads. A block's threads meet dozens of times per row
// (every shuffle step, every barrier); with up to 1024 OS threads on a 2-core machine each
// meeting would cost thousands of kernel context switches, where a fiber switch costs a
// few nanoseconds. Fibers also make the interleaving a choice of ours: every thread runs
// until it reaches a shuffle or a barrier, and the threads ready to go on are resumed in a
// seeded random order each time, so a kernel that assumes an order (a missing barrier, a
// result slot read before it is written) computes wrong bits in a test. Under
// ThreadSanitizer each fiber is a thread of its own whose only orderings with the others
// are the ones CUDA promises (a barrier, the start and end of a block), so the same bug
// is also reported as a data race. Blocks run one after another, last block first.
//
// A warp's lanes meet at each shuffle: a shuffle completes when every lane of its mask
// has arrived, and a lane named in the mask that has exited or waits elsewhere is reported
// as an error when nothing can run, never a hang. A barrier completes when every thread
// of the block has arrived.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fiber.h"

namespace simt::internal {

constexpr unsigned kWarpSize = 32;

// A launch that passed its checks (launch_check.h), as the scheduler runs it.
struct KernelRun {
  ThreadBody body = nullptr;
  const void* kernel_and_args = nullptr;
  dim3 grid;
  dim3 block;
  size_t dynamic_shared_bytes = 0;
  size_t static_shared_bytes = 0;  // the kernel's declared static shared memory
};

// How a run ended, and how often its threads met on the way.
struct RunOutcome {
  std::optional<std::string> failure;  // the launch's first error; none when it succeeded
  uint64_t barriers = 0;               // completed __syncthreads, summed over blocks
  uint64_t shuffles = 0;               // completed warp shuffles, summed over warps
};

// One per OS thread: the fibers of the block it runs, and the launch in progress.
class Scheduler {
 public:
  static Scheduler& OfThisThread() {
    thread_local Scheduler scheduler;
    return scheduler;
  }

  // Runs the blocks of `run` that lie in the block window, last block first, until one
  // fails. Global accesses are counted by the calling thread's MemoryAccounting, which
  // the caller has begun the launch in.
  RunOutcome Run(const KernelRun& run);

  // The blocks Run runs: [first, last) of the grid (ScopedBlockWindow).
  std::pair<unsigned, unsigned> block_window() const { return {first_block_, last_block_}; }
  void set_block_window(unsigned first, unsigned last) {
    first_block_ = first;
    last_block_ = last;
  }

  // Whether the calling fiber is a kernel thread, i.e. a launch is running on this OS thread.
  bool InKernel() const { return current_ != nullptr; }
  // The index within its block of the kernel thread that is running.
  unsigned CurrentThread() const { return current_->index; }
  // "thread t of block b": the running thread, for error messages.
  std::string Where() const;
  // Fails the launch in progress with `message`, unless it has failed already: the first
  // error is the one reported.
  void Fail(const std::string& message);

  // The device side of cuda_runtime.h, for the running thread.
  void* DynamicSharedMemory() { return dynamic_shared_.get(); }
  void* StaticSharedMemory(size_t bytes);
  void SyncThreads();
  uint32_t ShuffleXor(uint32_t mask, uint32_t value, int lane_mask, int width);
  void AwaitFlag(const uint32_t* flag, uint32_t target);

 private:
  enum class Wait { kNone, kBarrier, kShuffle, kFlag, kDone, kAborted };

  struct ThreadState {
    std::unique_ptr<Fiber> fiber;
    unsigned index = 0;
    Wait wait = Wait::kNone;
    const uint32_t* flag = nullptr;  // while it waits for a flag: which, and for what value
    uint32_t flag_target = 0;
    uint64_t shuffles = 0;  // shuffles this thread has entered in this block
    uint64_t barriers = 0;  // barriers this thread has entered in this block
  };

  // Double-buffered: a lane at its shuffle n + 2 knows every lane has left shuffle n.
  struct Exchange {
    uint64_t generation = ~uint64_t{0};
    uint32_t mask = 0;
    uint32_t arrived = 0;
    uint32_t values[kWarpSize] = {};
  };

  struct WarpState {
    Exchange exchange[2];
  };

  static void ThreadMain(void* argument);

  uint64_t Random();
  void EnsureThreads(unsigned count);
  // Back to the scheduler. Everything the thread did so far happens before whatever the
  // host does after the block, finished or abandoned (not before other threads).
  void Yield();
  // Warp `w` has met: its accesses since it last met become requests.
  void CloseWarpRequests(unsigned w);
  void CloseAllWarpRequests();
  void RestartAll();
  // Runs block `b` to completion; false when it failed (failure_ says why).
  bool RunBlock(unsigned b, size_t dynamic_bytes);
  bool RunBlockThreads(unsigned b, size_t dynamic_bytes);
  // Resumes each of `ready` once, in random order, until it waits again or exits; false
  // when one of them failed the launch.
  bool RunInRandomOrder(std::vector<ThreadState*>& ready);
  std::string DescribeDeadlock() const;
  // Threads that wait for a flag which has reached its target may go on; true when one
  // may.
  bool ReleaseReachedFlags();
  // No thread of the block can go on, and some wait for flags: hands the OS thread to the
  // devices' board (peer_signals.h) until a flag they wait for is reached; false when it
  // never can be (the launch has failed).
  bool AwaitPeers();
  // Why the running thread, lane `lane` of warp `warp`, may not enter a shuffle with these
  // arguments; none when it may.
  std::optional<std::string> ShuffleMisuse(uint32_t mask, unsigned lane, unsigned warp,
                                           unsigned source, int width) const;

  Fiber main_;
  std::vector<std::unique_ptr<ThreadState>> threads_;
  std::vector<WarpState> warps_;
  unsigned first_block_ = 0;
  unsigned last_block_ = ~0u;

  // The launch in progress.
  ThreadBody body_ = nullptr;
  const void* bound_ = nullptr;
  unsigned num_threads_ = 0;
  unsigned barrier_arrived_ = 0;
  std::unique_ptr<unsigned char[]> dynamic_shared_;
  std::unique_ptr<unsigned char[]> static_shared_;
  size_t static_bytes_ = 0;  // the running kernel's declared static shared memory
  ThreadState* current_ = nullptr;
  std::optional<std::string> failure_;
  uint64_t barriers_ = 0;
  uint64_t shuffles_ = 0;
  uint64_t rng_ = 0;
  uint64_t launches_ = 0;  // on this OS thread
  // The launching thread's SSE mode, which the kernel's threads run with: whether
  // subnormals are flushed follows the caller (XLA's CPU threads flush them, as the
  // reference then does; a GPU built without -ftz does not, see docs/simt.md).
  unsigned launching_mxcsr_ = 0x1f80;

  // Addresses ThreadSanitizer's happens-before annotations name.
  // One per barrier parity: a thread at barrier k + 2 knows every thread has left barrier
  // k, so two suffice, and no barrier orders what comes after the next one.
  char block_start_ = 0, block_end_ = 0, barrier_[2] = {};
};

}  // namespace simt::internal
