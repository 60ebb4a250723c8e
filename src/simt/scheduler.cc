// The scheduler of scheduler.h: the fibers of a block, the order they run in, barriers,
// shuffles and the detection of threads that can never go on; and cuda_runtime.h's
// device functions, the built-in variables and the schedule seed of simt.h.
#include "scheduler.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <tuple>

#include "memory_accounting.h"
#include "peer_signals.h"
#include "sanitizers.h"
#include "simt.h"

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace simt {
namespace internal {
namespace {

#if SIMT_ASAN || SIMT_TSAN
constexpr size_t kStackBytes = 512 * 1024;  // instrumented frames are several times larger
#else
constexpr size_t kStackBytes = 64 * 1024;
#endif

// Relaxed: the seed publishes nothing else, and must add no ordering ThreadSanitizer sees.
std::atomic<uint64_t> schedule_seed{0x9e3779b97f4a7c15ull};

__attribute__((format(printf, 1, 2))) std::string Format(const char* format, ...) {
  va_list arguments;
  va_start(arguments, format);
  va_list measuring;
  va_copy(measuring, arguments);
  const int length = std::vsnprintf(nullptr, 0, format, measuring);
  va_end(measuring);
  std::string text(length > 0 ? static_cast<size_t>(length) : 0, '\0');
  std::vsnprintf(text.data(), text.size() + 1, format, arguments);
  va_end(arguments);
  return text;
}

}  // namespace

uint64_t Scheduler::Random() {
  rng_ ^= rng_ << 13;
  rng_ ^= rng_ >> 7;
  rng_ ^= rng_ << 17;
  return rng_;
}

void Scheduler::Fail(const std::string& message) {
  if (!failure_) failure_ = message;
}

std::string Scheduler::Where() const {
  return Format("thread %u of block %u", current_ ? current_->index : 0u, blockIdx.x);
}

void Scheduler::EnsureThreads(unsigned count) {
  while (threads_.size() < count) {
    auto state = std::make_unique<ThreadState>();
    state->index = static_cast<unsigned>(threads_.size());
    state->fiber = std::make_unique<Fiber>(&ThreadMain, state.get(), kStackBytes);
    threads_.push_back(std::move(state));
  }
  warps_.resize((count + kWarpSize - 1) / kWarpSize);
}

void Scheduler::Yield() {
  Release(&block_end_);
  Fiber* fiber;
  {
    Bookkeeping hidden;
    fiber = current_->fiber.get();
  }
  fiber->SwitchTo(main_);
}

void Scheduler::CloseWarpRequests(unsigned w) {
  MemoryAccounting::OfThisThread().CloseRequests(w * kWarpSize,
                                                 std::min(num_threads_, (w + 1) * kWarpSize));
}

void Scheduler::CloseAllWarpRequests() {
  for (unsigned w = 0; w < warps_.size(); ++w) CloseWarpRequests(w);
}

void Scheduler::RestartAll() {
  for (auto& t : threads_) t->fiber->Restart();
}

RunOutcome Scheduler::Run(const KernelRun& run) {
  EnsureThreads(run.block.x);
  body_ = run.body;
  bound_ = run.kernel_and_args;
#if defined(__SSE__)
  launching_mxcsr_ = _mm_getcsr();
#endif
  num_threads_ = run.block.x;
  static_bytes_ = run.static_shared_bytes;
  failure_.reset();
  barriers_ = 0;
  shuffles_ = 0;
  // The same seed and the same sequence of launches on a thread give the same schedules.
  rng_ = schedule_seed.load(std::memory_order_relaxed) ^ (++launches_ * 0x2545f4914f6cdd1dull);
  if (rng_ == 0) rng_ = 1;
  gridDim = run.grid;
  blockDim = run.block;
  bool ok = true;
  for (unsigned b = run.grid.x; b-- > 0;) {
    if (b < first_block_ || b >= last_block_) continue;
    if (!RunBlock(b, run.dynamic_shared_bytes)) {
      ok = false;
      break;
    }
  }
  dynamic_shared_.reset();
  static_shared_.reset();
  body_ = nullptr;
  bound_ = nullptr;
  if (!ok) RestartAll();
  RunOutcome outcome;
  outcome.failure = std::move(failure_);
  failure_.reset();
  outcome.barriers = barriers_;
  outcome.shuffles = shuffles_;
  return outcome;
}

bool Scheduler::RunBlock(unsigned b, size_t dynamic_bytes) {
  const bool ok = RunBlockThreads(b, dynamic_bytes);
  Acquire(&block_end_);
  return ok;
}

bool Scheduler::RunBlockThreads(unsigned b, size_t dynamic_bytes) {
  blockIdx = uint3{b, 0, 0};
  for (unsigned t = 0; t < num_threads_; ++t) {
    ThreadState& s = *threads_[t];
    s.wait = Wait::kNone;
    s.shuffles = 0;
    s.barriers = 0;
  }
  MemoryAccounting::OfThisThread().BeginBlock(num_threads_);
  for (WarpState& w : warps_) w = WarpState{};
  barrier_arrived_ = 0;
  // Exactly the launch's size, so that AddressSanitizer flags one byte past it; filled
  // with NaN bits, as shared memory holds whatever the previous block left.
  dynamic_shared_.reset(new unsigned char[dynamic_bytes]);
  std::memset(dynamic_shared_.get(), 0xff, dynamic_bytes);
  static_shared_.reset(new unsigned char[static_bytes_]);
  std::memset(static_shared_.get(), 0xff, static_bytes_);
  Release(&block_start_);

  // Half the blocks resume every ready thread once per round, in random order; the
  // others run one warp, chosen at random, until all its threads wait, as a GPU may
  // run one warp far ahead of the others.
  const bool warp_at_a_time = Random() % 2 == 1;
  std::vector<ThreadState*> ready;
  for (;;) {
    ready.clear();
    bool all_done = true;
    for (unsigned t = 0; t < num_threads_; ++t) {
      ThreadState* s = threads_[t].get();
      if (s->wait == Wait::kNone) ready.push_back(s);
      if (s->wait != Wait::kDone) all_done = false;
    }
    if (all_done) break;
    if (ready.empty()) {
      if (ReleaseReachedFlags()) continue;
      if (std::any_of(threads_.begin(), threads_.begin() + num_threads_,
                      [](const auto& t) { return t->wait == Wait::kFlag; })) {
        if (!AwaitPeers()) return false;
        continue;
      }
      Fail(DescribeDeadlock());
      return false;
    }
    if (!warp_at_a_time) {
      if (!RunInRandomOrder(ready)) return false;
      continue;
    }
    const unsigned warp = ready[Random() % ready.size()]->index / kWarpSize;
    const unsigned end = std::min(num_threads_, (warp + 1) * kWarpSize);
    for (;;) {
      ready.clear();
      for (unsigned t = warp * kWarpSize; t < end; ++t) {
        if (threads_[t]->wait == Wait::kNone) ready.push_back(threads_[t].get());
      }
      if (ready.empty()) break;
      if (!RunInRandomOrder(ready)) return false;
    }
  }
  CloseAllWarpRequests();
  return true;
}

bool Scheduler::RunInRandomOrder(std::vector<ThreadState*>& ready) {
  for (size_t i = ready.size(); i > 1; --i) std::swap(ready[i - 1], ready[Random() % i]);
  for (ThreadState* s : ready) {
    {
      Bookkeeping hidden;
      current_ = s;
      threadIdx = uint3{s->index, 0, 0};
    }
    main_.SwitchTo(*s->fiber);
    current_ = nullptr;
    if (failure_) return false;
  }
  return true;
}

bool Scheduler::ReleaseReachedFlags() {
  bool any = false;
  for (unsigned t = 0; t < num_threads_; ++t) {
    ThreadState& s = *threads_[t];
    if (s.wait == Wait::kFlag &&
        FlagReached(__atomic_load_n(s.flag, __ATOMIC_RELAXED), s.flag_target)) {
      s.wait = Wait::kNone;
      any = true;
    }
  }
  return any;
}

bool Scheduler::AwaitPeers() {
  std::string waits;
  int listed = 0;
  for (unsigned t = 0; t < num_threads_ && listed < 4; ++t) {
    const ThreadState& s = *threads_[t];
    if (s.wait != Wait::kFlag) continue;
    waits += Format("%sthread %u of block %u waits for %s to reach %u (it holds %u)",
                    listed++ > 0 ? ", " : "", t, blockIdx.x,
                    MemoryAccounting::OfThisThread().Describe(s.flag).c_str(), s.flag_target,
                    __atomic_load_n(s.flag, __ATOMIC_RELAXED));
  }
  const std::optional<std::string> failure = AwaitFlags(
      [this] {
        for (unsigned t = 0; t < num_threads_; ++t) {
          const ThreadState& s = *threads_[t];
          if (s.wait == Wait::kFlag &&
              FlagReached(__atomic_load_n(s.flag, __ATOMIC_RELAXED), s.flag_target)) {
            return true;
          }
        }
        return false;
      },
      waits);
  if (failure) {
    Fail(*failure);
    return false;
  }
  return ReleaseReachedFlags();
}

std::string Scheduler::DescribeDeadlock() const {
  std::string waiting_barrier, waiting_shuffle, exited;
  auto add = [](std::string& list, unsigned t) {
    if (list.size() > 200) return;
    list += (list.empty() ? "" : ", ") + std::to_string(t);
  };
  for (unsigned t = 0; t < num_threads_; ++t) {
    const ThreadState& s = *threads_[t];
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

void Scheduler::ThreadMain(void* argument) {
  auto* self = static_cast<ThreadState*>(argument);
  Scheduler& scheduler = OfThisThread();
  Fiber* fiber;
  {
    Bookkeeping hidden;
    fiber = self->fiber.get();
  }
  fiber->Started();
  for (;;) {
    Acquire(&scheduler.block_start_);
    ThreadBody body;
    const void* bound;
    {
      Bookkeeping hidden;
      body = scheduler.body_;
      bound = scheduler.bound_;
#if defined(__SSE__)
      _mm_setcsr(scheduler.launching_mxcsr_);
#endif
    }
    body(bound);
    {
      Bookkeeping hidden;
      self->wait = Wait::kDone;
    }
    scheduler.Yield();
  }
}

// ------------------------------------------------------------------ device side

void* Scheduler::StaticSharedMemory(size_t bytes) {
  if (bytes <= static_bytes_) return static_shared_.get();
  {
    Bookkeeping hidden;
    Fail(Where() + " uses " + std::to_string(bytes) +
         " bytes of static shared memory; the kernel's attributes declare " +
         std::to_string(static_bytes_));
    current_->wait = Wait::kAborted;
  }
  Yield();  // an aborted thread is never resumed
  return nullptr;
}

void Scheduler::SyncThreads() {
  char* sync;
  {
    Bookkeeping hidden;
    sync = &barrier_[current_->barriers++ & 1];
  }
  Release(sync);
  {
    Bookkeeping hidden;
    current_->wait = Wait::kBarrier;
    if (++barrier_arrived_ == num_threads_) {
      for (unsigned t = 0; t < num_threads_; ++t) threads_[t]->wait = Wait::kNone;
      barrier_arrived_ = 0;
      barriers_ += 1;
      CloseAllWarpRequests();
    }
  }
  Yield();
  Acquire(sync);
}

void Scheduler::AwaitFlag(const uint32_t* flag, uint32_t target) {
  {
    Bookkeeping hidden;
    current_->wait = Wait::kFlag;
    current_->flag = flag;
    current_->flag_target = target;
  }
  Yield();
}

std::optional<std::string> Scheduler::ShuffleMisuse(uint32_t mask, unsigned lane, unsigned warp,
                                                    unsigned source, int width) const {
  const unsigned lanes = std::min(kWarpSize, num_threads_ - warp * kWarpSize);
  const uint32_t existing = lanes == kWarpSize ? ~0u : (1u << lanes) - 1;
  if (width != static_cast<int>(kWarpSize)) {
    return Format("%s: __shfl_xor_sync with width %d (only 32 is emulated)", Where().c_str(),
                  width);
  }
  if ((mask >> lane & 1u) == 0) {
    return Format("%s: __shfl_xor_sync mask 0x%08x leaves out lane %u itself", Where().c_str(),
                  mask, lane);
  }
  if ((mask & ~existing) != 0) {
    return Format("%s: __shfl_xor_sync mask 0x%08x names lanes beyond the block's %u threads",
                  Where().c_str(), mask, num_threads_);
  }
  if (source >= kWarpSize || (mask >> source & 1u) == 0) {
    return Format("%s: __shfl_xor_sync reads lane %u, which mask 0x%08x leaves out",
                  Where().c_str(), source, mask);
  }
  return std::nullopt;
}

uint32_t Scheduler::ShuffleXor(uint32_t mask, uint32_t value, int lane_mask, int width) {
  ThreadState* self = current_;
  const unsigned lane = self->index % kWarpSize;
  const unsigned warp = self->index / kWarpSize;
  Exchange* exchange = nullptr;
  unsigned source = 0;
  {
    Bookkeeping hidden;
    source = lane ^ static_cast<unsigned>(lane_mask);
    std::optional<std::string> misuse = ShuffleMisuse(mask, lane, warp, source, width);
    if (!misuse) {
      const uint64_t n = self->shuffles++;
      exchange = &warps_[warp].exchange[n & 1];
      if (exchange->generation != n) {
        exchange->generation = n;
        exchange->mask = mask;
        exchange->arrived = 0;
      } else if (exchange->mask != mask) {
        misuse =
            Format("%s: lanes of warp %u meet at a __shfl_xor_sync with masks 0x%08x and 0x%08x",
                   Where().c_str(), warp, exchange->mask, mask);
      }
    }
    if (misuse) {
      Fail(*misuse);
      self->wait = Wait::kAborted;
    } else {
      exchange->values[lane] = value;
      exchange->arrived |= 1u << lane;
      self->wait = Wait::kShuffle;
      if (exchange->arrived == mask) {
        for (unsigned l = 0; l < kWarpSize; ++l) {
          if (mask >> l & 1u) threads_[warp * kWarpSize + l]->wait = Wait::kNone;
        }
        shuffles_ += 1;
        CloseWarpRequests(warp);
      }
    }
  }
  Yield();  // an aborted thread is never resumed
  Bookkeeping hidden;
  return exchange->values[source];
}

}  // namespace internal

void* DynamicSharedMemory() { return internal::Scheduler::OfThisThread().DynamicSharedMemory(); }

void* StaticSharedMemory(size_t bytes) {
  return internal::Scheduler::OfThisThread().StaticSharedMemory(bytes);
}

void SyncThreads() { internal::Scheduler::OfThisThread().SyncThreads(); }

uint32_t ShuffleXor(uint32_t mask, uint32_t value, int lane_mask, int width) {
  return internal::Scheduler::OfThisThread().ShuffleXor(mask, value, lane_mask, width);
}

void AwaitFlag(const uint32_t* flag, uint32_t target) {
  internal::Scheduler::OfThisThread().AwaitFlag(flag, target);
}

// ------------------------------------------------------------------ host side

uint64_t SetScheduleSeed(uint64_t seed) {
  return internal::schedule_seed.exchange(seed, std::memory_order_relaxed);
}

ScopedBlockWindow::ScopedBlockWindow(unsigned first, unsigned last) {
  internal::Scheduler& scheduler = internal::Scheduler::OfThisThread();
  std::tie(previous_first_, previous_last_) = scheduler.block_window();
  scheduler.set_block_window(first, last);
}

ScopedBlockWindow::~ScopedBlockWindow() {
  internal::Scheduler::OfThisThread().set_block_window(previous_first_, previous_last_);
}

}  // namespace simt
