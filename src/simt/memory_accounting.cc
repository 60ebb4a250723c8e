// The accounting of memory_accounting.h: the access checks, the grouping of a warp's
// accesses into requests and their sector counts; and simt.h's ScopedBuffers and
// cuda_runtime.h's RecordGlobalAccess, through which every global access of a kernel goes.
#include "memory_accounting.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "peer_signals.h"
#include "sanitizers.h"
#include "scheduler.h"

namespace simt {
namespace internal {
namespace {

constexpr unsigned kSectorShift = 5;  // 32-byte sectors

// The widest access a GPU thread makes in one instruction; wider ones are split in pieces
// of this size, each a request of its own, as nvcc compiles them.
constexpr uint32_t kWidestAccess = 16;

// The kernel line, the buffer, load or store, and which 16-byte piece of a wider access.
int64_t RequestKey(int site, int buffer, bool write, uint32_t piece) {
  return ((int64_t{site} * 1024 + (buffer + 1)) * 2 + (write ? 1 : 0)) * 64 + piece;
}

}  // namespace

void MemoryAccounting::AddBuffer(const char* name, const void* base, size_t bytes) {
  buffers_.push_back({name, reinterpret_cast<uintptr_t>(base), bytes});
}

void MemoryAccounting::ForgetBuffersAfter(size_t count) {
  if (buffers_.size() > count) buffers_.resize(count);
}

std::string MemoryAccounting::Describe(const void* address) const {
  const int found = FindBuffer(reinterpret_cast<uintptr_t>(address), 1);
  if (found < 0) return "an unregistered address";
  return "byte " + std::to_string(reinterpret_cast<uintptr_t>(address) - buffers_[found].base) +
         " of " + buffers_[found].name;
}

int MemoryAccounting::FindBuffer(uintptr_t at, size_t bytes) const {
  for (size_t i = buffers_.size(); i-- > 0;) {
    if (at >= buffers_[i].base && at + bytes <= buffers_[i].base + buffers_[i].bytes) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

std::vector<BufferStats> MemoryAccounting::ZeroStats() const {
  std::vector<BufferStats> stats;
  for (const Buffer& b : buffers_) {
    BufferStats s;
    s.name = b.name;
    s.bytes = b.bytes;
    stats.push_back(s);
  }
  return stats;
}

void MemoryAccounting::BeginLaunch(unsigned threads) {
  stats_ = ZeroStats();
  if (logs_.size() < threads) logs_.resize(threads);
}

std::vector<BufferStats> MemoryAccounting::EndLaunch() {
  std::vector<BufferStats> stats = std::move(stats_);
  stats_.clear();
  return stats;
}

void MemoryAccounting::BeginBlock(unsigned threads) {
  for (unsigned t = 0; t < threads; ++t) logs_[t].clear();
}

bool MemoryAccounting::Record(Scheduler& scheduler, const void* address, size_t bytes,
                              size_t alignment, bool write, int site) {
  const auto at = reinterpret_cast<uintptr_t>(address);
  if (at % alignment != 0) {
    char text[160];
    std::snprintf(text, sizeof(text), "%s %s %zu bytes at %p, misaligned for a %zu-byte access",
                  scheduler.Where().c_str(), write ? "writes" : "reads", bytes, address, alignment);
    scheduler.Fail(text);
    return false;
  }
  const int found = FindBuffer(at, bytes);
  if (found < 0 && !buffers_.empty()) {
    char text[160];
    std::snprintf(text, sizeof(text), "%s %s %zu bytes at %p, outside every buffer of the launch",
                  scheduler.Where().c_str(), write ? "writes" : "reads", bytes, address);
    std::string message = text;
    for (const Buffer& b : buffers_) {
      std::snprintf(text, sizeof(text), "; %s is [%p, +%zu)", b.name.c_str(),
                    reinterpret_cast<void*>(b.base), b.bytes);
      message += text;
    }
    scheduler.Fail(message);
    return false;
  }
  if (found >= 0) {
    BufferStats& stats = stats_[found];
    (write ? stats.bytes_written : stats.bytes_read) += bytes;
    stats.widest_access = std::max<uint32_t>(stats.widest_access, static_cast<uint32_t>(bytes));
  }
  std::vector<Access>& log = logs_[scheduler.CurrentThread()];
  for (uint32_t piece = 0; piece * kWidestAccess < bytes; ++piece) {
    const uint32_t offset = piece * kWidestAccess;
    log.push_back({RequestKey(site, found, write, piece),
                   std::min<uint32_t>(kWidestAccess, bytes - offset), at + offset, found});
  }
  return true;
}

void MemoryAccounting::CloseRequests(unsigned first_thread, unsigned end_thread) {
  struct Item {
    int64_t key;
    uint32_t occurrence;
    uintptr_t address;
    uint32_t bytes;
    int buffer;
  };
  std::vector<Item> items;
  std::vector<std::pair<int64_t, uint32_t>> counts;
  for (unsigned t = first_thread; t < end_thread; ++t) {
    std::vector<Access>& log = logs_[t];
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
      BufferStats& stats = stats_[items[i].buffer];
      const uintptr_t lo = items[i].address;
      stats.requests += 1;
      stats.sectors += sectors;
      stats.min_sectors += ((lo + union_bytes - 1) >> kSectorShift) - (lo >> kSectorShift) + 1;
    }
    i = j;
  }
}

}  // namespace internal

bool RecordGlobalAccess(const void* address, size_t bytes, size_t alignment, bool write, int site) {
  internal::Scheduler& scheduler = internal::Scheduler::OfThisThread();
  if (!scheduler.InKernel()) return true;  // not inside a launch
  Bookkeeping hidden;
  return internal::MemoryAccounting::OfThisThread().Record(scheduler, address, bytes, alignment,
                                                           write, site);
}

uint32_t LoadAcquire(const uint32_t* flag, int site) {
  if (!RecordGlobalAccess(flag, sizeof(uint32_t), alignof(uint32_t), false, site)) return 0;
  return __atomic_load_n(flag, __ATOMIC_ACQUIRE);
}

void StoreRelease(uint32_t* flag, uint32_t value, int site) {
  if (!RecordGlobalAccess(flag, sizeof(uint32_t), alignof(uint32_t), true, site)) return;
  __atomic_store_n(flag, value, __ATOMIC_RELEASE);
  internal::FlagStored();
}

uint32_t LoadRelaxed(const uint32_t* flag, int site) {
  if (!RecordGlobalAccess(flag, sizeof(uint32_t), alignof(uint32_t), false, site)) return 0;
  return __atomic_load_n(flag, __ATOMIC_RELAXED);
}

void StoreRelaxed(uint32_t* flag, uint32_t value, int site) {
  if (!RecordGlobalAccess(flag, sizeof(uint32_t), alignof(uint32_t), true, site)) return;
  __atomic_store_n(flag, value, __ATOMIC_RELAXED);
  internal::FlagStored();
}

ScopedBuffers::ScopedBuffers()
    : outer_count_(internal::MemoryAccounting::OfThisThread().BufferCount()) {}

ScopedBuffers::~ScopedBuffers() {
  internal::MemoryAccounting::OfThisThread().ForgetBuffersAfter(outer_count_);
}

void ScopedBuffers::Add(const char* name, const void* base, size_t bytes) {
  internal::MemoryAccounting::OfThisThread().AddBuffer(name, base, bytes);
}

}  // namespace simt
