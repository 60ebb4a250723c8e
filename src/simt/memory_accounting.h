// The SIMT emulation's global-memory accounting (docs/simt.md, "Memory accounting"): the
// buffers the calling OS thread's launches may touch, the check of every access against
// them and against its alignment, and what the launch in progress does with each buffer,
// its accesses grouped into warp-wide requests and counted in 32-byte sectors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "simt.h"

namespace simt::internal {

class Scheduler;

// One per OS thread, as the buffers are registered per OS thread (ScopedBuffers).
class MemoryAccounting {
 public:
  static MemoryAccounting& OfThisThread() {
    thread_local MemoryAccounting accounting;
    return accounting;
  }

  void AddBuffer(const char* name, const void* base, size_t bytes);
  size_t BufferCount() const { return buffers_.size(); }
  // Forgets every buffer registered after the first `count`.
  void ForgetBuffersAfter(size_t count);
  // The name of the registered buffer that holds `address` and the offset of `address`
  // in it, for reports; "an unregistered address" when none holds it.
  std::string Describe(const void* address) const;
  // Accesses are checked only while some buffer is registered.
  bool ChecksAccesses() const { return !buffers_.empty(); }
  // The registered buffer that holds all of [at, at + bytes), or -1. XLA may pass one
  // buffer as two arguments (x and residual the same array): the later one is reported.
  int FindBuffer(uintptr_t at, size_t bytes) const;

  // One entry per registered buffer, named and sized, with nothing counted yet.
  std::vector<BufferStats> ZeroStats() const;
  // A launch of `threads` threads per block begins counting from zero...
  void BeginLaunch(unsigned threads);
  // ... and hands over what it counted when it ends, run or failed.
  std::vector<BufferStats> EndLaunch();
  // A block begins: its threads have made no access yet.
  void BeginBlock(unsigned threads);

  // One global access of the scheduler's running thread: checked, then counted. False
  // when it fails the launch (the scheduler has been told why): it must not be made.
  bool Record(Scheduler& scheduler, const void* address, size_t bytes, size_t alignment, bool write,
              int site);
  // Threads [first_thread, end_thread), one warp, have met: the accesses each made since
  // the warp last met become warp-wide requests.
  void CloseRequests(unsigned first_thread, unsigned end_thread);

 private:
  struct Buffer {
    std::string name;
    uintptr_t base;
    size_t bytes;
  };

  struct Access {
    // What makes two lanes' accesses one request (see RequestKey); in CloseRequests, the
    // key's slot and which of the lane's accesses with that key this is.
    int64_t key;
    uint32_t bytes;
    uintptr_t address;
    int buffer;  // index into the launch's buffers, or -1
  };

  std::vector<Buffer> buffers_;
  std::vector<BufferStats> stats_;  // of the launch in progress, one per buffer
  // Per thread of the block: its global accesses since its warp last met.
  std::vector<std::vector<Access>> logs_;
  // CloseRequests' work space, kept between calls so that they do not allocate.
  std::vector<int64_t> keys_;              // the keys met, one slot each
  std::vector<uint32_t> max_occurrences_;  // per slot: the most accesses one lane made
  std::vector<uint32_t> counts_;           // per slot: one lane's accesses so far
  std::vector<uint32_t> first_bucket_;     // per slot: its accesses' first bucket
  std::vector<Access> sorted_;             // the lanes' accesses, bucketed
  std::vector<uint32_t> bucket_start_, fill_;
};

}  // namespace simt::internal
