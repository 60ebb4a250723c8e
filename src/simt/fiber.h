// Fibers for the SIMT emulation: a stack and saved registers per emulated GPU thread, and
// a switch between them that costs a few nanoseconds on x86-64 (a register save and a
// stack swap, no system call). Sanitizers are told about every switch, so that
// AddressSanitizer knows which stack is live and ThreadSanitizer sees each fiber as a
// thread of its own, with no ordering between fibers beyond what the emulation declares
// (scheduler.cc: barriers and the launch's start and end).
#pragma once

#include <cstddef>

namespace simt {

class Fiber {
 public:
  using Entry = void (*)(void* argument);

  // The fiber of the calling OS thread's own stack.
  Fiber();
  // A fiber that runs entry(argument) on a stack of its own when first switched to.
  // `entry` must never return: it switches away for the last time instead.
  Fiber(Entry entry, void* argument, size_t stack_bytes);
  ~Fiber();
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;

  // Makes the fiber start afresh at its entry, abandoning whatever it was running (the
  // emulation does so after a failed launch; a kernel's frames hold no resources).
  void Restart();

  // Saves the calling fiber (`*this`) and resumes `to`; returns when something switches
  // back to this fiber.
  void SwitchTo(Fiber& to);

  // Called first thing by every entry function.
  void Started();

 private:
  void Prepare();
  // Tells AddressSanitizer the switch to this fiber is done, and records the bounds of the
  // stack just left when that is the OS thread's own (whose bounds nobody else knows).
  void FinishSwitch(void* fake_stack);

  Entry entry_ = nullptr;
  void* argument_ = nullptr;
  char* mapping_ = nullptr;  // guard page + stack
  size_t mapping_bytes_ = 0;
  const void* stack_bottom_ = nullptr;
  size_t stack_bytes_ = 0;
  void* saved_sp_ = nullptr;  // where the registers were saved, while not running
  void* context_ = nullptr;   // ucontext_t, where there is no assembly switch
  void* tsan_fiber_ = nullptr;
  void* asan_fake_stack_ = nullptr;
};

}  // namespace simt
