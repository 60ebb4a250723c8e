#include "fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "sanitizers.h"

#if SIMT_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__x86_64__) && defined(__linux__)
#define SIMT_X86_64_SWITCH 1
#else
#include <ucontext.h>
#endif

#if SIMT_X86_64_SWITCH
// switch_stack(save, next): pushes the callee-saved registers (System V x86-64) and the
// floating-point control words, stores the stack pointer in *save, loads `next` and pops
// the same from there. A new fiber's stack is laid out as if it had called switch_stack,
// with fiber_start as the return address and the entry and its argument in r12 and r13.
extern "C" void fp8norm_simt_switch_stack(void** save, void* next);
extern "C" void fp8norm_simt_fiber_start();
asm(R"(
  .text
  .globl fp8norm_simt_switch_stack
  .hidden fp8norm_simt_switch_stack
  .type fp8norm_simt_switch_stack,@function
fp8norm_simt_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size fp8norm_simt_switch_stack, .-fp8norm_simt_switch_stack

  .globl fp8norm_simt_fiber_start
  .hidden fp8norm_simt_fiber_start
  .type fp8norm_simt_fiber_start,@function
fp8norm_simt_fiber_start:
  movq %r13, %rdi
  callq *%r12
  ud2
  .size fp8norm_simt_fiber_start, .-fp8norm_simt_fiber_start
)");
#endif

namespace simt {
namespace {

// Set by SwitchTo before it leaves a fiber, read by the fiber that resumes: AddressSanitizer
// reports the bounds of the stack just left, which is how the OS thread's own stack
// (whose bounds nobody else knows) gets them.
thread_local Fiber* switching_from = nullptr;

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "simt: %s\n", what);
  std::abort();
}

}  // namespace

Fiber::Fiber() {
#if !SIMT_X86_64_SWITCH
  context_ = new ucontext_t;
#endif
#if SIMT_TSAN
  tsan_fiber_ = __tsan_get_current_fiber();
#endif
}

Fiber::Fiber(Entry entry, void* argument, size_t stack_bytes) : entry_(entry), argument_(argument) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  stack_bytes_ = (stack_bytes + page - 1) / page * page;
  mapping_bytes_ = stack_bytes_ + page;
  void* mapping = mmap(nullptr, mapping_bytes_, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mapping == MAP_FAILED) Die("cannot map a fiber stack");
  mapping_ = static_cast<char*>(mapping);
  // Stacks grow down: an overflow hits the guard page and faults instead of corrupting
  // the neighbouring fiber's stack.
  if (mprotect(mapping_, page, PROT_NONE) != 0) Die("cannot protect a fiber stack's guard page");
  stack_bottom_ = mapping_ + page;
#if !SIMT_X86_64_SWITCH
  context_ = new ucontext_t;
#endif
  Prepare();
}

Fiber::~Fiber() {
#if SIMT_TSAN
  if (entry_ != nullptr && tsan_fiber_ != nullptr) __tsan_destroy_fiber(tsan_fiber_);
#endif
#if !SIMT_X86_64_SWITCH
  delete static_cast<ucontext_t*>(context_);
#endif
  if (mapping_ != nullptr) munmap(mapping_, mapping_bytes_);
}

void Fiber::Prepare() {
#if SIMT_TSAN
  if (tsan_fiber_ != nullptr) __tsan_destroy_fiber(tsan_fiber_);
  tsan_fiber_ = __tsan_create_fiber(0);
#endif
#if SIMT_ASAN
  // Frames abandoned by Restart leave their redzones poisoned.
  ASAN_UNPOISON_MEMORY_REGION(stack_bottom_, stack_bytes_);
#endif
  asan_fake_stack_ = nullptr;
#if SIMT_X86_64_SWITCH
  // Top of the stack, 16-byte aligned: fiber_start's call then leaves the callee's stack
  // aligned as the ABI requires.
  auto top = (reinterpret_cast<uintptr_t>(stack_bottom_) + stack_bytes_ - 64) & ~uintptr_t{15};
  auto* slot = reinterpret_cast<uint64_t*>(top);
  *--slot = reinterpret_cast<uint64_t>(&fp8norm_simt_fiber_start);  // return address
  *--slot = 0;                                                      // rbp
  *--slot = 0;                                                      // rbx
  *--slot = reinterpret_cast<uint64_t>(entry_);                     // r12
  *--slot = reinterpret_cast<uint64_t>(argument_);                  // r13
  *--slot = 0;                                                      // r14
  *--slot = 0;                                                      // r15
  // MXCSR and the x87 control word at their reset values; the emulation sets each block's
  // floating-point mode itself (scheduler.cc).
  *--slot = uint64_t{0x1f80u} | uint64_t{0x037fu} << 32;
  saved_sp_ = slot;
#else
  auto* context = static_cast<ucontext_t*>(context_);
  getcontext(context);
  context->uc_stack.ss_sp = const_cast<void*>(stack_bottom_);
  context->uc_stack.ss_size = stack_bytes_;
  context->uc_link = nullptr;
  // makecontext passes int arguments only: the pointer travels in two halves.
  const auto bits = reinterpret_cast<uintptr_t>(this);
  makecontext(context, reinterpret_cast<void (*)()>(+[](unsigned hi, unsigned lo) {
                auto* self = reinterpret_cast<Fiber*>(uintptr_t{hi} << 32 | lo);
                self->entry_(self->argument_);
              }),
              2, static_cast<unsigned>(bits >> 32), static_cast<unsigned>(bits));
#endif
}

void Fiber::Restart() { Prepare(); }

void Fiber::FinishSwitch(void* fake_stack) {
#if SIMT_ASAN
  const void* bottom = nullptr;
  size_t size = 0;
  __sanitizer_finish_switch_fiber(fake_stack, &bottom, &size);
  if (switching_from != nullptr && switching_from->entry_ == nullptr) {
    switching_from->stack_bottom_ = bottom;
    switching_from->stack_bytes_ = size;
  }
#else
  (void)fake_stack;
#endif
}

void Fiber::Started() {
  Bookkeeping hidden;
  FinishSwitch(nullptr);  // a fresh fiber has no fake stack to restore
}

void Fiber::SwitchTo(Fiber& to) {
  void* next_sp;
  void* next_tsan_fiber;
  {
    // Fiber state is the emulation's bookkeeping. The guard ends before ThreadSanitizer's
    // switch, after which accesses count as `to`'s.
    Bookkeeping hidden;
    switching_from = this;
    next_sp = to.saved_sp_;
    next_tsan_fiber = to.tsan_fiber_;
  }
  (void)next_tsan_fiber;
#if SIMT_ASAN
  __sanitizer_start_switch_fiber(&asan_fake_stack_, to.stack_bottom_, to.stack_bytes_);
#endif
#if SIMT_TSAN
  // No happens-before from a switch: the emulation declares every ordering it promises.
  __tsan_switch_to_fiber(next_tsan_fiber, __tsan_switch_to_fiber_no_sync);
#endif
#if SIMT_X86_64_SWITCH
  fp8norm_simt_switch_stack(&saved_sp_, next_sp);
#else
  swapcontext(static_cast<ucontext_t*>(context_), static_cast<ucontext_t*>(to.context_));
#endif
  FinishSwitch(asan_fake_stack_);
}

}  // namespace simt
