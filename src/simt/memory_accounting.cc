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
  // A request is the n-th access with one key of each lane that made one. The lanes'
  // accesses are bucketed by (key, n) with a counting sort, linear in their number: a
  // warp can make thousands between two meetings. A bucket holds one access per lane.
  keys_.clear();
  max_occurrences_.clear();
  size_t total = 0;
  for (unsigned t = first_thread; t < end_thread; ++t) {
    counts_.assign(keys_.size(), 0);
    size_t slot = 0;
    for (Access& a : logs_[t]) {
      if (slot >= keys_.size() || keys_[slot] != a.key) {
        slot = std::find(keys_.begin(), keys_.end(), a.key) - keys_.begin();
        if (slot == keys_.size()) {
          keys_.push_back(a.key);
          max_occurrences_.push_back(0);
          counts_.push_back(0);
        }
      }
      const uint32_t occurrence = counts_[slot]++;
      max_occurrences_[slot] = std::max(max_occurrences_[slot], occurrence + 1);
      a.key = static_cast<int64_t>(slot) << 32 | occurrence;  // the key is no longer needed
    }
    total += logs_[t].size();
  }
  // Bucket (slot, n) is number first_bucket_[slot] + n.
  first_bucket_.assign(keys_.size(), 0);
  uint32_t buckets = 0;
  for (size_t k = 0; k < keys_.size(); ++k) {
    first_bucket_[k] = buckets;
    buckets += max_occurrences_[k];
  }
  const auto bucket_of = [&](const Access& a) {
    return first_bucket_[static_cast<size_t>(a.key >> 32)] + static_cast<uint32_t>(a.key);
  };
  bucket_start_.assign(buckets + 1, 0);
  for (unsigned t = first_thread; t < end_thread; ++t) {
    for (const Access& a : logs_[t]) ++bucket_start_[bucket_of(a) + 1];
  }
  for (uint32_t b = 0; b < buckets; ++b) bucket_start_[b + 1] += bucket_start_[b];
  sorted_.resize(total);
  fill_.assign(bucket_start_.begin(), bucket_start_.end() - 1);
  for (unsigned t = first_thread; t < end_thread; ++t) {
    for (const Access& a : logs_[t]) sorted_[fill_[bucket_of(a)]++] = a;
    logs_[t].clear();
  }

  for (uint32_t b = 0; b < buckets; ++b) {
    Access* const begin = sorted_.data() + bucket_start_[b];
    Access* const end = sorted_.data() + bucket_start_[b + 1];  // never empty
    // By address: the lanes come in order, so this is mostly sorted already.
    for (Access* i = begin + 1; i < end; ++i) {
      const Access moving = *i;
      Access* j = i;
      for (; j > begin && (j - 1)->address > moving.address; --j) *j = *(j - 1);
      *j = moving;
    }
    uint64_t sectors = 0, union_bytes = 0;
    uintptr_t covered_end = 0;              // end of the byte union so far
    uintptr_t last_sector = ~uintptr_t{0};  // last sector counted so far
    for (const Access* item = begin; item < end; ++item) {
      const uintptr_t lo = item->address, hi = lo + item->bytes;
      uintptr_t first = lo >> kSectorShift;
      const uintptr_t last = (hi - 1) >> kSectorShift;
      if (last_sector != ~uintptr_t{0} && first <= last_sector) first = last_sector + 1;
      if (first <= last) sectors += last - first + 1;
      if (last_sector == ~uintptr_t{0} || last > last_sector) last_sector = last;
      const uintptr_t from = std::max(lo, covered_end);
      if (hi > from) union_bytes += hi - from;
      covered_end = std::max(covered_end, hi);
    }
    if (begin->buffer >= 0) {
      BufferStats& stats = stats_[begin->buffer];
      const uintptr_t lo = begin->address;
      stats.requests += 1;
      stats.sectors += sectors;
      stats.min_sectors += ((lo + union_bytes - 1) >> kSectorShift) - (lo >> kSectorShift) + 1;
    }
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
