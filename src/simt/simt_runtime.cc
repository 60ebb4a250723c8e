// The SIMT emulation's runtime: runs a CUDA launch of the kernels in src/cuda on the CPU,
// and implements the part of the CUDA runtime API those kernels and their launch use.
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
#include <cuda_runtime.h>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "fiber.h"
#include "sanitizers.h"
#include "simt.h"

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace simt {
namespace {

#if SIMT_ASAN || SIMT_TSAN
constexpr size_t kStackBytes = 512 * 1024;  // instrumented frames are several times larger
#else
constexpr size_t kStackBytes = 64 * 1024;
#endif
constexpr unsigned kWarpSize = 32;
constexpr unsigned kSectorShift = 5;  // 32-byte sectors

enum class Wait { kNone, kBarrier, kShuffle, kDone, kAborted };

// The widest access a GPU thread makes in one instruction; wider ones are split in pieces
// of this size, each a request of its own, as nvcc compiles them.
constexpr uint32_t kWidestAccess = 16;

struct Access {
  int64_t key;  // what makes two lanes' accesses one request: see RequestKey
  uint32_t bytes;
  uintptr_t address;
  int buffer;  // index into the launch's buffers, or -1
};

// The kernel line, the buffer, load or store, and which 16-byte piece of a wider access.
int64_t RequestKey(int site, int buffer, bool write, uint32_t piece) {
  return ((int64_t{site} * 1024 + (buffer + 1)) * 2 + (write ? 1 : 0)) * 64 + piece;
}

struct Buffer {
  std::string name;
  uintptr_t base;
  size_t bytes;
};

struct ThreadState {
  std::unique_ptr<Fiber> fiber;
  unsigned index = 0;
  Wait wait = Wait::kNone;
  uint64_t shuffles = 0;    // shuffles this thread has entered in this block
  uint64_t barriers = 0;    // barriers this thread has entered in this block
  std::vector<Access> log;  // global accesses since its warp last met
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

struct Shared {
  std::mutex mutex;
  DeviceLimits limits;
  uint64_t seed = 0x9e3779b97f4a7c15ull;
  std::unordered_map<const void*, int> max_dynamic_shared;                // per kernel, as last set
  std::unordered_map<const void*, size_t> static_shared;                  // per kernel, as declared
  std::unordered_map<const void*, std::string> names;                     // per kernel, as declared
  std::unordered_map<const void*, int> max_threads;                       // per kernel, as declared
  std::unordered_map<std::string, std::pair<cudaError_t, int>> injected;  // error, calls left
  std::deque<LaunchRecord> launches;
};

Shared& Global() {
  static Shared* shared = new Shared;  // never destroyed: launches may run at exit
  return *shared;
}

void Keep(LaunchRecord record) {
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  g.launches.push_back(std::move(record));
  if (g.launches.size() > 4096) g.launches.pop_front();
}

void ThreadMain(void* argument);

thread_local bool capturing = false;

cudaError_t SetError(cudaError_t error);

// The error injected for this call of `function`, or cudaSuccess.
cudaError_t Injected(const char* function) {
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  auto it = g.injected.find(function);
  if (it == g.injected.end()) return cudaSuccess;
  const cudaError_t error = it->second.first;
  if (--it->second.second <= 0) g.injected.erase(it);
  return error;
}

// A call that loads a module or changes a kernel: refused inside capture, or injected.
cudaError_t Refusal(const char* function, bool loads_module) {
  if (loads_module && capturing) return cudaErrorStreamCaptureUnsupported;
  return Injected(function);
}

size_t PaddedStatic(size_t bytes) { return (bytes + 15) / 16 * 16; }

// One per OS thread: the fibers of the block it runs, and the launch in progress.
struct Executor {
  Fiber main;
  std::vector<std::unique_ptr<ThreadState>> threads;
  std::vector<WarpState> warps;
  std::vector<Buffer> buffers;
  // The blocks a launch runs: [first_block, last_block) of its grid (ScopedBlockWindow).
  unsigned first_block = 0;
  unsigned last_block = ~0u;

  // The launch in progress.
  ThreadBody body = nullptr;
  const void* bound = nullptr;
  unsigned num_threads = 0;
  unsigned barrier_arrived = 0;
  std::unique_ptr<unsigned char[]> dynamic_shared;
  std::unique_ptr<unsigned char[]> static_shared;
  size_t static_bytes = 0;  // the running kernel's declared static shared memory
  ThreadState* current = nullptr;
  std::string error;
  LaunchRecord record;
  uint64_t rng = 0;
  uint64_t launches = 0;  // on this OS thread
  // The launching thread's SSE mode, which the kernel's threads run with: whether
  // subnormals are flushed follows the caller (XLA's CPU threads flush them, as the
  // reference then does; a GPU built without -ftz does not, see docs/simt.md).
  unsigned launching_mxcsr = 0x1f80;

  // Addresses ThreadSanitizer's happens-before annotations name.
  // One per barrier parity: a thread at barrier k + 2 knows every thread has left barrier
  // k, so two suffice, and no barrier orders what comes after the next one.
  char block_start = 0, block_end = 0, barrier[2] = {};

  // The last failed launch's description, for cudaGetErrorString.
  std::string last_failure;
  cudaError_t last_error = cudaSuccess;

  uint64_t Random() {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
  }

  // The registered buffer that holds all of [at, at + bytes), or -1. XLA may pass one
  // buffer as two arguments (x and residual the same array): the later one is reported.
  int FindBuffer(uintptr_t at, size_t bytes) const {
    for (size_t i = buffers.size(); i-- > 0;) {
      if (at >= buffers[i].base && at + bytes <= buffers[i].base + buffers[i].bytes) {
        return static_cast<int>(i);
      }
    }
    return -1;
  }

  void Fail(const std::string& message) {
    if (error.empty()) error = message;
  }

  std::string Where() const {
    char text[96];
    std::snprintf(text, sizeof(text), "thread %u of block %u", current ? current->index : 0u,
                  blockIdx.x);
    return text;
  }

  void EnsureThreads(unsigned count) {
    while (threads.size() < count) {
      auto state = std::make_unique<ThreadState>();
      state->index = static_cast<unsigned>(threads.size());
      state->fiber = std::make_unique<Fiber>(&ThreadMain, state.get(), kStackBytes);
      threads.push_back(std::move(state));
    }
    warps.resize((count + kWarpSize - 1) / kWarpSize);
  }

  // Back to the scheduler. Everything the thread did so far happens before whatever the
  // host does after the block, finished or abandoned (not before other threads).
  void Yield() {
    Release(&block_end);
    Fiber* fiber;
    {
      Bookkeeping hidden;
      fiber = current->fiber.get();
    }
    fiber->SwitchTo(main);
  }

  // The accesses warp `w` made since it last met, grouped into warp-wide requests.
  void CloseWarpEpoch(unsigned w) {
    struct Item {
      int64_t key;
      uint32_t occurrence;
      uintptr_t address;
      uint32_t bytes;
      int buffer;
    };
    std::vector<Item> items;
    std::vector<std::pair<int64_t, uint32_t>> counts;
    const unsigned end = std::min(num_threads, (w + 1) * kWarpSize);
    for (unsigned t = w * kWarpSize; t < end; ++t) {
      std::vector<Access>& log = threads[t]->log;
      counts.clear();
      for (const Access& a : log) {
        auto it = std::find_if(counts.begin(), counts.end(),
                               [&](const auto& c) { return c.first == a.key; });
        if (it == counts.end()) it = counts.insert(counts.end(), {a.key, 0u});
        items.push_back({a.key, it->second++, a.address, a.bytes, a.buffer});
      }
      log.clear();
    }
    std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
      if (a.key != b.key) return a.key < b.key;
      if (a.occurrence != b.occurrence) return a.occurrence < b.occurrence;
      return a.address < b.address;
    });
    for (size_t i = 0; i < items.size();) {
      size_t j = i;
      uint64_t sectors = 0, union_bytes = 0;
      uintptr_t covered_end = 0;              // end of the byte union so far
      uintptr_t last_sector = ~uintptr_t{0};  // last sector counted so far
      for (; j < items.size() && items[j].key == items[i].key &&
             items[j].occurrence == items[i].occurrence;
           ++j) {
        const uintptr_t lo = items[j].address, hi = lo + items[j].bytes;
        uintptr_t first = lo >> kSectorShift;
        const uintptr_t last = (hi - 1) >> kSectorShift;
        if (last_sector != ~uintptr_t{0} && first <= last_sector) first = last_sector + 1;
        if (first <= last) sectors += last - first + 1;
        if (last_sector == ~uintptr_t{0} || last > last_sector) last_sector = last;
        const uintptr_t from = std::max(lo, covered_end);
        if (hi > from) union_bytes += hi - from;
        covered_end = std::max(covered_end, hi);
      }
      if (items[i].buffer >= 0) {
        BufferStats& stats = record.buffers[items[i].buffer];
        const uintptr_t lo = items[i].address;
        stats.requests += 1;
        stats.sectors += sectors;
        stats.min_sectors += ((lo + union_bytes - 1) >> kSectorShift) - (lo >> kSectorShift) + 1;
      }
      i = j;
    }
  }

  void CloseAllWarpEpochs() {
    for (unsigned w = 0; w < warps.size(); ++w) CloseWarpEpoch(w);
  }

  void RestartAll() {
    for (auto& t : threads) t->fiber->Restart();
  }

  // Runs block `b` to completion; false when it failed (error says why).
  bool RunBlock(unsigned b, size_t dynamic_bytes) {
    const bool ok = RunBlockThreads(b, dynamic_bytes);
    Acquire(&block_end);
    return ok;
  }

  bool RunBlockThreads(unsigned b, size_t dynamic_bytes) {
    blockIdx = uint3{b, 0, 0};
    for (unsigned t = 0; t < num_threads; ++t) {
      ThreadState& s = *threads[t];
      s.wait = Wait::kNone;
      s.shuffles = 0;
      s.barriers = 0;
      s.log.clear();
    }
    for (WarpState& w : warps) w = WarpState{};
    barrier_arrived = 0;
    // Exactly the launch's size, so that AddressSanitizer flags one byte past it; filled
    // with NaN bits, as shared memory holds whatever the previous block left.
    dynamic_shared.reset(new unsigned char[dynamic_bytes]);
    std::memset(dynamic_shared.get(), 0xff, dynamic_bytes);
    static_shared.reset(new unsigned char[static_bytes]);
    std::memset(static_shared.get(), 0xff, static_bytes);
    Release(&block_start);

    // Half the blocks resume every ready thread once per round, in random order; the
    // others run one warp, chosen at random, until all its threads wait, as a GPU may
    // run one warp far ahead of the others.
    const bool warp_at_a_time = Random() % 2 == 1;
    std::vector<ThreadState*> ready;
    for (;;) {
      ready.clear();
      bool all_done = true;
      for (unsigned t = 0; t < num_threads; ++t) {
        ThreadState* s = threads[t].get();
        if (s->wait == Wait::kNone) ready.push_back(s);
        if (s->wait != Wait::kDone) all_done = false;
      }
      if (all_done) break;
      if (ready.empty()) {
        Fail(DescribeDeadlock());
        return false;
      }
      if (!warp_at_a_time) {
        if (!RunInRandomOrder(ready)) return false;
        continue;
      }
      const unsigned warp = ready[Random() % ready.size()]->index / kWarpSize;
      const unsigned end = std::min(num_threads, (warp + 1) * kWarpSize);
      for (;;) {
        ready.clear();
        for (unsigned t = warp * kWarpSize; t < end; ++t) {
          if (threads[t]->wait == Wait::kNone) ready.push_back(threads[t].get());
        }
        if (ready.empty()) break;
        if (!RunInRandomOrder(ready)) return false;
      }
    }
    CloseAllWarpEpochs();
    return true;
  }

  // Resumes each of `ready` once, in random order, until it waits again or exits; false
  // when one of them failed the launch.
  bool RunInRandomOrder(std::vector<ThreadState*>& ready) {
    for (size_t i = ready.size(); i > 1; --i) std::swap(ready[i - 1], ready[Random() % i]);
    for (ThreadState* s : ready) {
      {
        Bookkeeping hidden;
        current = s;
        threadIdx = uint3{s->index, 0, 0};
      }
      main.SwitchTo(*s->fiber);
      current = nullptr;
      if (!error.empty()) return false;
    }
    return true;
  }

  std::string DescribeDeadlock() const {
    std::string waiting_barrier, waiting_shuffle, exited;
    auto add = [](std::string& list, unsigned t) {
      if (list.size() > 200) return;
      list += (list.empty() ? "" : ", ") + std::to_string(t);
    };
    for (unsigned t = 0; t < num_threads; ++t) {
      const ThreadState& s = *threads[t];
      if (s.wait == Wait::kBarrier) add(waiting_barrier, t);
      if (s.wait == Wait::kShuffle) add(waiting_shuffle, t);
      if (s.wait == Wait::kDone) add(exited, t);
    }
    std::string message = "deadlock in block " + std::to_string(blockIdx.x) + ":";
    if (!waiting_shuffle.empty()) {
      message += " threads {" + waiting_shuffle +
                 "} wait in __shfl_xor_sync for lanes of their mask that never arrive;";
    }
    if (!waiting_barrier.empty()) {
      message += " threads {" + waiting_barrier + "} wait at __syncthreads;";
    }
    if (!exited.empty()) message += " threads {" + exited + "} have exited;";
    return message;
  }
};

thread_local Executor executor;

void ThreadMain(void* argument) {
  auto* self = static_cast<ThreadState*>(argument);
  Executor& ex = executor;
  Fiber* fiber;
  {
    Bookkeeping hidden;
    fiber = self->fiber.get();
  }
  fiber->Started();
  for (;;) {
    Acquire(&ex.block_start);
    ThreadBody body;
    const void* bound;
    {
      Bookkeeping hidden;
      body = ex.body;
      bound = ex.bound;
#if defined(__SSE__)
      _mm_setcsr(ex.launching_mxcsr);
#endif
    }
    body(bound);
    {
      Bookkeeping hidden;
      self->wait = Wait::kDone;
    }
    ex.Yield();
  }
}

cudaError_t SetError(cudaError_t error) {
  if (error != cudaSuccess) executor.last_error = error;
  return error;
}

}  // namespace

// ------------------------------------------------------------------ device side

void* DynamicSharedMemory() { return executor.dynamic_shared.get(); }

void* StaticSharedMemory(size_t bytes) {
  Executor& ex = executor;
  if (bytes <= ex.static_bytes) return ex.static_shared.get();
  {
    Bookkeeping hidden;
    ex.Fail(ex.Where() + " uses " + std::to_string(bytes) +
            " bytes of static shared memory; the kernel's attributes declare " +
            std::to_string(ex.static_bytes));
    ex.current->wait = Wait::kAborted;
  }
  ex.Yield();  // an aborted thread is never resumed
  return nullptr;
}

void DeclareKernel(const void* kernel, const char* name, size_t static_bytes, int max_threads) {
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  g.static_shared[kernel] = PaddedStatic(static_bytes);
  g.names[kernel] = name;
  g.max_threads[kernel] = max_threads;
}

bool RecordGlobalAccess(const void* address, size_t bytes, size_t alignment, bool write, int site) {
  Executor& ex = executor;
  if (ex.current == nullptr) return true;  // not inside a launch
  Bookkeeping hidden;
  const auto at = reinterpret_cast<uintptr_t>(address);
  if (at % alignment != 0) {
    char text[160];
    std::snprintf(text, sizeof(text), "%s %s %zu bytes at %p, misaligned for a %zu-byte access",
                  ex.Where().c_str(), write ? "writes" : "reads", bytes, address, alignment);
    ex.Fail(text);
    return false;
  }
  const int found = ex.FindBuffer(at, bytes);
  if (found < 0 && !ex.buffers.empty()) {
    char text[160];
    std::snprintf(text, sizeof(text), "%s %s %zu bytes at %p, outside every buffer of the launch",
                  ex.Where().c_str(), write ? "writes" : "reads", bytes, address);
    std::string message = text;
    for (const Buffer& b : ex.buffers) {
      std::snprintf(text, sizeof(text), "; %s is [%p, +%zu)", b.name.c_str(),
                    reinterpret_cast<void*>(b.base), b.bytes);
      message += text;
    }
    ex.Fail(message);
    return false;
  }
  if (found >= 0) {
    BufferStats& stats = ex.record.buffers[found];
    (write ? stats.bytes_written : stats.bytes_read) += bytes;
    stats.widest_access = std::max<uint32_t>(stats.widest_access, static_cast<uint32_t>(bytes));
  }
  for (uint32_t piece = 0; piece * kWidestAccess < bytes; ++piece) {
    const uint32_t offset = piece * kWidestAccess;
    ex.current->log.push_back({RequestKey(site, found, write, piece),
                               std::min<uint32_t>(kWidestAccess, bytes - offset), at + offset,
                               found});
  }
  return true;
}

void SyncThreads() {
  Executor& ex = executor;
  char* sync;
  {
    Bookkeeping hidden;
    sync = &ex.barrier[ex.current->barriers++ & 1];
  }
  Release(sync);
  {
    Bookkeeping hidden;
    ex.current->wait = Wait::kBarrier;
    if (++ex.barrier_arrived == ex.num_threads) {
      for (unsigned t = 0; t < ex.num_threads; ++t) ex.threads[t]->wait = Wait::kNone;
      ex.barrier_arrived = 0;
      ex.record.barriers += 1;
      ex.CloseAllWarpEpochs();
    }
  }
  ex.Yield();
  Acquire(sync);
}

uint32_t ShuffleXor(uint32_t mask, uint32_t value, int lane_mask, int width) {
  Executor& ex = executor;
  ThreadState* self = ex.current;
  const unsigned lane = self->index % kWarpSize;
  const unsigned warp = self->index / kWarpSize;
  Exchange* exchange = nullptr;
  unsigned source = 0;
  {
    Bookkeeping hidden;
    const unsigned lanes = std::min(kWarpSize, ex.num_threads - warp * kWarpSize);
    const uint32_t existing = lanes == kWarpSize ? ~0u : (1u << lanes) - 1;
    source = lane ^ static_cast<unsigned>(lane_mask);
    char text[200];
    text[0] = '\0';
    if (width != static_cast<int>(kWarpSize)) {
      std::snprintf(text, sizeof(text), "%s: __shfl_xor_sync with width %d (only 32 is emulated)",
                    ex.Where().c_str(), width);
    } else if ((mask >> lane & 1u) == 0) {
      std::snprintf(text, sizeof(text), "%s: __shfl_xor_sync mask 0x%08x leaves out lane %u itself",
                    ex.Where().c_str(), mask, lane);
    } else if ((mask & ~existing) != 0) {
      std::snprintf(text, sizeof(text),
                    "%s: __shfl_xor_sync mask 0x%08x names lanes beyond the block's %u threads",
                    ex.Where().c_str(), mask, ex.num_threads);
    } else if (source >= kWarpSize || (mask >> source & 1u) == 0) {
      std::snprintf(text, sizeof(text),
                    "%s: __shfl_xor_sync reads lane %u, which mask 0x%08x leaves out",
                    ex.Where().c_str(), source, mask);
    } else {
      const uint64_t n = self->shuffles++;
      exchange = &ex.warps[warp].exchange[n & 1];
      if (exchange->generation != n) {
        exchange->generation = n;
        exchange->mask = mask;
        exchange->arrived = 0;
      } else if (exchange->mask != mask) {
        std::snprintf(text, sizeof(text),
                      "%s: lanes of warp %u meet at a __shfl_xor_sync with masks 0x%08x and "
                      "0x%08x",
                      ex.Where().c_str(), warp, exchange->mask, mask);
      }
      if (text[0] == '\0') {
        exchange->values[lane] = value;
        exchange->arrived |= 1u << lane;
        self->wait = Wait::kShuffle;
        if (exchange->arrived == mask) {
          for (unsigned l = 0; l < kWarpSize; ++l) {
            if (mask >> l & 1u) ex.threads[warp * kWarpSize + l]->wait = Wait::kNone;
          }
          ex.record.shuffles += 1;
          ex.CloseWarpEpoch(warp);
        }
      }
    }
    if (text[0] != '\0') {
      ex.Fail(text);
      self->wait = Wait::kAborted;
    }
  }
  ex.Yield();  // an aborted thread is never resumed
  Bookkeeping hidden;
  return exchange->values[source];
}

cudaError_t SetMaxDynamicShared(const void* kernel, int bytes) {
  if (const cudaError_t e = Refusal("cudaFuncSetAttribute", true)) return SetError(e);
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  auto it = g.static_shared.find(kernel);
  const size_t static_bytes = it == g.static_shared.end() ? 0 : it->second;
  // The runtime's rule: the attribute plus the kernel's static shared memory may not
  // exceed the opt-in limit.
  if (bytes < 0 || static_cast<size_t>(bytes) + static_bytes >
                       static_cast<size_t>(g.limits.shared_per_block_optin)) {
    executor.last_failure = "cudaFuncSetAttribute: " + std::to_string(bytes) +
                            " bytes of dynamic shared memory beside " +
                            std::to_string(static_bytes) + " static exceed the device's " +
                            std::to_string(g.limits.shared_per_block_optin);
    return SetError(cudaErrorInvalidValue);
  }
  g.max_dynamic_shared[kernel] = bytes;
  return cudaSuccess;
}

cudaError_t GetFuncAttributes(const void* kernel, cudaFuncAttributes* attributes) {
  if (const cudaError_t e = Refusal("cudaFuncGetAttributes", true)) return SetError(e);
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  auto s = g.static_shared.find(kernel);
  const size_t static_bytes = s == g.static_shared.end() ? 0 : s->second;
  auto d = g.max_dynamic_shared.find(kernel);
  attributes->sharedSizeBytes = static_bytes;
  auto t = g.max_threads.find(kernel);
  attributes->maxThreadsPerBlock = t == g.max_threads.end()
                                       ? g.limits.max_threads_per_block
                                       : std::min(t->second, g.limits.max_threads_per_block);
  attributes->maxDynamicSharedSizeBytes =
      d != g.max_dynamic_shared.end()
          ? d->second
          : std::max(0, g.limits.shared_per_block - static_cast<int>(static_bytes));
  return cudaSuccess;
}

cudaError_t Launch(const void* kernel, const cudaLaunchConfig_t& config, ThreadBody thread_body,
                   const void* kernel_and_args) {
  Executor& ex = executor;
  // The kernel's threads see the launch's state through the scheduler, not through
  // anything ThreadSanitizer sees; the block's start and end order the kernel's memory.
  Bookkeeping hidden;
  if (ex.current != nullptr) return SetError(cudaErrorInvalidConfiguration);  // from a kernel
  if (const cudaError_t e = Injected("cudaLaunchKernelEx")) return SetError(e);
  DeviceLimits limits;
  size_t static_bytes = 0;
  uint64_t seed = 0;
  std::optional<int> attribute;
  std::string name;
  int bounds = 0;  // the kernel's __launch_bounds__, when declared
  {
    Shared& g = Global();
    std::lock_guard<std::mutex> lock(g.mutex);
    limits = g.limits;
    auto it = g.max_dynamic_shared.find(kernel);
    if (it != g.max_dynamic_shared.end()) attribute = it->second;
    auto s = g.static_shared.find(kernel);
    static_bytes = s == g.static_shared.end() ? 0 : s->second;
    auto n = g.names.find(kernel);
    if (n != g.names.end()) name = n->second;
    auto t = g.max_threads.find(kernel);
    if (t != g.max_threads.end()) bounds = t->second;
    seed = g.seed;
  }
  // Without the attribute a block may have the default limit, static and dynamic together.
  const size_t allowed_dynamic =
      attribute ? static_cast<size_t>(*attribute)
                : static_cast<size_t>(std::max<int64_t>(
                      0, int64_t{limits.shared_per_block} - static_cast<int64_t>(static_bytes)));
  const dim3 grid = config.gridDim;
  const dim3 block = config.blockDim;
  const size_t dynamic_bytes = config.dynamicSmemBytes;
  std::string refusal;
  cudaError_t code = cudaErrorInvalidConfiguration;
  if (grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1) {
    refusal = "only 1-D grids and blocks are emulated";
  } else if (block.x == 0 || block.x > static_cast<unsigned>(limits.max_threads_per_block)) {
    refusal = "block of " + std::to_string(block.x) + " threads (the device allows 1 to " +
              std::to_string(limits.max_threads_per_block) + ")";
  } else if (bounds > 0 && block.x > static_cast<unsigned>(bounds)) {
    code = cudaErrorLaunchOutOfResources;
    refusal = "block of " + std::to_string(block.x) + " threads beyond the kernel's " +
              "__launch_bounds__ of " + std::to_string(bounds);
  } else if (grid.x == 0 || grid.x > limits.max_grid_x) {
    refusal = "grid of " + std::to_string(grid.x) + " blocks (the device allows 1 to " +
              std::to_string(limits.max_grid_x) + ")";
  } else if (static_bytes + dynamic_bytes > static_cast<size_t>(limits.shared_per_block_optin) ||
             limits.reserved_per_block + static_bytes + dynamic_bytes >
                 static_cast<size_t>(limits.shared_per_multiprocessor)) {
    code = cudaErrorInvalidValue;
    refusal = std::to_string(dynamic_bytes) + " bytes of dynamic and " +
              std::to_string(static_bytes) + " of static shared memory (the device has " +
              std::to_string(limits.shared_per_block_optin) + " per block, " +
              std::to_string(limits.reserved_per_block) + " reserved)";
  } else if (dynamic_bytes > allowed_dynamic) {
    code = cudaErrorInvalidValue;
    refusal = std::to_string(dynamic_bytes) + " bytes of dynamic shared memory beside " +
              std::to_string(static_bytes) + " static, where " +
              (attribute ? "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize) "
                           "last allowed " +
                               std::to_string(*attribute)
                         : "the default limit allows " + std::to_string(allowed_dynamic));
  }
  LaunchRecord record;
  record.blocks = grid.x;
  record.threads = block.x;
  record.dynamic_shared_bytes = dynamic_bytes;
  record.static_shared_bytes = static_bytes;
  record.kernel = name;
  for (const Buffer& b : ex.buffers) {
    BufferStats stats;
    stats.name = b.name;
    stats.bytes = b.bytes;
    record.buffers.push_back(stats);
  }
  if (!refusal.empty()) {
    ex.last_failure = "invalid launch: " + refusal;
    record.error = ex.last_failure;
    Keep(std::move(record));
    return SetError(code);
  }

  ex.EnsureThreads(block.x);
  ex.body = thread_body;
  ex.bound = kernel_and_args;
#if defined(__SSE__)
  ex.launching_mxcsr = _mm_getcsr();
#endif
  ex.num_threads = block.x;
  ex.static_bytes = static_bytes;
  ex.error.clear();
  ex.record = std::move(record);
  // The same seed and the same sequence of launches on a thread give the same schedules.
  ex.rng = seed ^ (++ex.launches * 0x2545f4914f6cdd1dull);
  if (ex.rng == 0) ex.rng = 1;
  gridDim = grid;
  blockDim = block;
  bool ok = true;
  for (unsigned b = grid.x; b-- > 0;) {
    if (b < ex.first_block || b >= ex.last_block) continue;
    if (!ex.RunBlock(b, dynamic_bytes)) {
      ok = false;
      break;
    }
  }
  ex.dynamic_shared.reset();
  ex.static_shared.reset();
  ex.body = nullptr;
  ex.bound = nullptr;
  if (!ok) {
    ex.RestartAll();
    ex.last_failure = "unspecified launch failure (emulated): " + ex.error;
    ex.record.error = ex.last_failure;
  }
  Keep(std::move(ex.record));
  ex.record = LaunchRecord{};
  return ok ? cudaSuccess : SetError(cudaErrorLaunchFailure);
}

// ------------------------------------------------------------------ host side

void SetDeviceLimits(const DeviceLimits& limits) {
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  g.limits = limits;
  g.max_dynamic_shared.clear();  // another device: attributes start over
}

void InjectError(const std::string& function, int error, int count) {
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  if (count <= 0) {
    g.injected.erase(function);
  } else {
    g.injected[function] = {static_cast<cudaError_t>(error), count};
  }
}

ScopedCapture::ScopedCapture() : previous_(capturing) { capturing = true; }
ScopedCapture::~ScopedCapture() { capturing = previous_; }

DeviceLimits GetDeviceLimits() {
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  return g.limits;
}

uint64_t SetScheduleSeed(uint64_t seed) {
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  const uint64_t previous = g.seed;
  g.seed = seed;
  return previous;
}

ScopedBlockWindow::ScopedBlockWindow(unsigned first, unsigned last)
    : previous_first_(executor.first_block), previous_last_(executor.last_block) {
  executor.first_block = first;
  executor.last_block = last;
}

ScopedBlockWindow::~ScopedBlockWindow() {
  executor.first_block = previous_first_;
  executor.last_block = previous_last_;
}

ScopedBuffers::~ScopedBuffers() { executor.buffers.clear(); }

void ScopedBuffers::Add(const char* name, const void* base, size_t bytes) {
  executor.buffers.push_back({name, reinterpret_cast<uintptr_t>(base), bytes});
}

std::vector<LaunchRecord> TakeLaunches() {
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  std::vector<LaunchRecord> out(std::make_move_iterator(g.launches.begin()),
                                std::make_move_iterator(g.launches.end()));
  g.launches.clear();
  return out;
}

}  // namespace simt

// ------------------------------------------------------------------ runtime API

cudaError_t cudaGetLastError() {
  const cudaError_t error = simt::executor.last_error;
  simt::executor.last_error = cudaSuccess;
  return error;
}

cudaError_t cudaPeekAtLastError() { return simt::executor.last_error; }

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration:
    case cudaErrorLaunchOutOfResources:
    case cudaErrorLaunchFailure:
      return simt::executor.last_failure.empty() ? "emulated launch error"
                                                 : simt::executor.last_failure.c_str();
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidDeviceFunction:
      return "invalid device function";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    default:
      return "unknown error";
  }
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : simt::SetError(cudaErrorInvalidDevice);
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* version) {
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  if (device != 0) return simt::SetError(cudaErrorInvalidDevice);
  if (const cudaError_t e = simt::Injected("cudaDeviceGetAttribute")) return simt::SetError(e);
  const simt::DeviceLimits limits = simt::GetDeviceLimits();
  switch (attribute) {
    case cudaDevAttrMaxThreadsPerBlock:
      *value = limits.max_threads_per_block;
      return cudaSuccess;
    case cudaDevAttrMaxGridDimX:
      *value = static_cast<int>(std::min<int64_t>(limits.max_grid_x, 2147483647));
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = limits.shared_per_block;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = limits.shared_per_block_optin;
      return cudaSuccess;
    case cudaDevAttrReservedSharedMemoryPerBlock:
      *value = limits.reserved_per_block;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
      *value = limits.shared_per_multiprocessor;
      return cudaSuccess;
    case cudaDevAttrMultiProcessorCount:
      *value = limits.multiprocessors;
      return cudaSuccess;
  }
  return simt::SetError(cudaErrorInvalidValue);
}

cudaError_t cudaMemsetAsync(void* pointer, int value, size_t bytes, cudaStream_t) {
  simt::Executor& ex = simt::executor;
  const auto at = reinterpret_cast<uintptr_t>(pointer);
  if (!ex.buffers.empty() && ex.FindBuffer(at, bytes) < 0) {
    ex.last_failure =
        "cudaMemsetAsync of " + std::to_string(bytes) + " bytes outside every buffer of the launch";
    return simt::SetError(cudaErrorInvalidValue);
  }
  std::memset(pointer, value, bytes);
  return cudaSuccess;
}
