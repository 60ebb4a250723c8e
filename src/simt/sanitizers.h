// What the SIMT emulation tells the sanitizers it may be built with.
#pragma once

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SIMT_ASAN 1
#endif
#if __has_feature(thread_sanitizer)
#define SIMT_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define SIMT_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define SIMT_TSAN 1
#endif

#if SIMT_TSAN
#include <sanitizer/tsan_interface.h>
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);
extern "C" void AnnotateIgnoreSyncBegin(const char* file, int line);
extern "C" void AnnotateIgnoreSyncEnd(const char* file, int line);
#endif

namespace simt {

#if SIMT_TSAN
// The emulation's own bookkeeping (fiber contexts, the scheduler's state, the shuffle
// exchange) is shared by all fibers of a block and ordered by the scheduler, not by
// anything ThreadSanitizer sees: hidden from it while a guard lives in the current fiber,
// so that it reports only the kernel's own accesses.
struct Bookkeeping {
  Bookkeeping() {
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  }
  ~Bookkeeping() {
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  }
};
// Synchronisation of the emulation's own that must order nothing for ThreadSanitizer (the
// devices' board, peer_signals.cc): its locks create no happens-before edge, and its
// accesses are hidden, while a guard lives.
struct HiddenSync {
  HiddenSync() { AnnotateIgnoreSyncBegin(__FILE__, __LINE__); }
  ~HiddenSync() { AnnotateIgnoreSyncEnd(__FILE__, __LINE__); }
  Bookkeeping hidden;
};
// A happens-before edge from every Release(sync) to every later Acquire(sync).
inline void Release(void* sync) { __tsan_release(sync); }
inline void Acquire(void* sync) { __tsan_acquire(sync); }
#else
struct Bookkeeping {
  Bookkeeping() {}  // user-provided, so that an unused guard draws no warning
};
struct HiddenSync {
  HiddenSync() {}
};
inline void Release(void*) {}
inline void Acquire(void*) {}
#endif

}  // namespace simt
