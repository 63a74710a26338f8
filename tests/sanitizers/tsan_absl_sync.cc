// ThreadSanitizer's view of abseil's synchronisation, for --config=tsan.
//
// Debian's libabsl_synchronization is not built with TSan, so TSan does not see absl::Mutex,
// CondVar, Notification, BlockingCounter or Barrier synchronise anything: every access our code
// makes under an absl::Mutex would be reported as a race. This file, linked into every binary of
// the TSan build (--custom_malloc in .bazelrc, the one hook Bazel has for adding a library to every
// link), interposes those functions: each calls the real one in the Debian library (dlsym
// RTLD_NEXT) and tells TSan the happens-before edge it creates — release on the object before a
// call that unlocks or signals, acquire after one that locks or returns from a wait. That is the
// contract abseil documents, so no race in our code is hidden; only the false ones go away. gRPC's
// own absl::Mutex uses (grpc_core::Mutex) go through these too. absl::Status's reference count is
// the one other abseil synchronisation our code relies on (a status crosses threads); see the end.
//
// Compiled to nothing without TSan. The symbol names are those of Debian's abseil 20220623
// (inline namespace absl::debian3); a missing one aborts the process at first use, naming it.
// BlockingCounter and Barrier are not wrapped: nothing here uses them.
#include "absl/base/config.h"

#ifdef ABSL_HAVE_THREAD_SANITIZER

#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

template <typename Fn>
Fn Real(const char* symbol) {
  void* fn = dlsym(RTLD_NEXT, symbol);
  if (fn == nullptr) {
    std::fprintf(stderr, "tsan_absl_sync: %s not found in the abseil library\n", symbol);
    std::abort();
  }
  return reinterpret_cast<Fn>(fn);
}

void Acquire(const void* p) { __tsan_acquire(const_cast<void*>(p)); }
void Release(const void* p) { __tsan_release(const_cast<void*>(p)); }

// Notification::HasBeenNotified() is inline: an acquire load of the flag that follows the Mutex.
static_assert(sizeof(absl::Notification) == sizeof(absl::Mutex) + sizeof(void*),
              "absl::Notification layout changed: update NotifiedFlag");
const void* NotifiedFlag(const absl::Notification* n) {
  return reinterpret_cast<const char*>(n) + sizeof(absl::Mutex);
}

// A condition is evaluated with the mutex held, inside abseil, by the waiter or by whichever thread
// is unlocking, and a false one lets go of the mutex there again: the wrapped condition acquires
// before and releases after, as a critical section of its own.
struct HeldCondition {
  absl::Mutex* mu;
  const absl::Condition* condition;
};
bool EvalHeld(HeldCondition* held) {
  Acquire(held->mu);
  const bool result = held->condition->Eval();
  Release(held->mu);
  return result;
}

}  // namespace

// Each wrapper has the real function's mangled name (asm label) and its ABI: `this` first.
#define STOWAGE_WRAP(ret, sym, params, args, before, after)           \
  ret sym params __asm__(#sym);                                       \
  ret sym params {                                                    \
    static const auto real = Real<ret(*) params>(#sym);               \
    before;                                                           \
    ret result = real args;                                           \
    after;                                                            \
    return result;                                                    \
  }
#define STOWAGE_WRAP_VOID(sym, params, args, before, after)           \
  void sym params __asm__(#sym);                                      \
  void sym params {                                                   \
    static const auto real = Real<void(*) params>(#sym);              \
    before;                                                           \
    real args;                                                        \
    after;                                                            \
  }

// The arguments `m` and `c` of a wrapper taking a condition, as the condition passed on.
#define HOLD                                    \
  HeldCondition held_condition = {m, &c};       \
  const Condition held(&EvalHeld, &held_condition)

using absl::Condition;
using absl::Duration;
using absl::Mutex;
using absl::Time;

// Mutex: acquire once held, release before letting go (Await and the CondVar waits do both).
STOWAGE_WRAP_VOID(_ZN4absl7debian35Mutex4LockEv, (Mutex* m), (m), , Acquire(m))
STOWAGE_WRAP_VOID(_ZN4absl7debian35Mutex10ReaderLockEv, (Mutex* m), (m), , Acquire(m))
STOWAGE_WRAP(bool, _ZN4absl7debian35Mutex7TryLockEv, (Mutex* m), (m), , if (result) Acquire(m))
STOWAGE_WRAP(bool, _ZN4absl7debian35Mutex13ReaderTryLockEv, (Mutex* m), (m), , if (result) Acquire(m))
STOWAGE_WRAP_VOID(_ZN4absl7debian35Mutex6UnlockEv, (Mutex* m), (m), Release(m), )
STOWAGE_WRAP_VOID(_ZN4absl7debian35Mutex12ReaderUnlockEv, (Mutex* m), (m), Release(m), )
STOWAGE_WRAP_VOID(_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE, (Mutex* m, const Condition& c),
                  (m, held), HOLD, Acquire(m))
STOWAGE_WRAP_VOID(_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE,
                  (Mutex* m, const Condition& c), (m, held), HOLD, Acquire(m))
STOWAGE_WRAP(bool, _ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE,
             (Mutex* m, const Condition& c, Duration d), (m, held, d), HOLD, Acquire(m))
STOWAGE_WRAP(bool, _ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE,
             (Mutex* m, const Condition& c, Time t), (m, held, t), HOLD, Acquire(m))
STOWAGE_WRAP(bool, _ZN4absl7debian35Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE,
             (Mutex* m, const Condition& c, Duration d), (m, held, d), HOLD, Acquire(m))
STOWAGE_WRAP(bool, _ZN4absl7debian35Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE,
             (Mutex* m, const Condition& c, Time t), (m, held, t), HOLD, Acquire(m))
STOWAGE_WRAP_VOID(_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE, (Mutex* m, const Condition& c),
                  (m, held), Release(m); HOLD, Acquire(m))
STOWAGE_WRAP(bool, _ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE,
             (Mutex* m, const Condition& c, Duration d), (m, held, d), Release(m); HOLD, Acquire(m))
STOWAGE_WRAP(bool, _ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE,
             (Mutex* m, const Condition& c, Time t), (m, held, t), Release(m); HOLD, Acquire(m))

// CondVar: the wait lets go of the mutex and takes it again.
STOWAGE_WRAP_VOID(_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE, (absl::CondVar* cv, Mutex* m), (cv, m),
                  Release(m), Acquire(m))
STOWAGE_WRAP(bool, _ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE,
             (absl::CondVar* cv, Mutex* m, Duration d), (cv, m, d), Release(m), Acquire(m))
STOWAGE_WRAP(bool, _ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE,
             (absl::CondVar* cv, Mutex* m, Time t), (cv, m, t), Release(m), Acquire(m))

// Notification: Notify releases; a wait that saw the notification acquires (HasBeenNotified is an
// instrumented acquire load of the flag, hence the second release).
STOWAGE_WRAP_VOID(_ZN4absl7debian312Notification6NotifyEv, (absl::Notification* n), (n),
                  Release(n); Release(NotifiedFlag(n)), )
STOWAGE_WRAP_VOID(_ZNK4absl7debian312Notification19WaitForNotificationEv,
                  (const absl::Notification* n), (n), , Acquire(n))
STOWAGE_WRAP(bool, _ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE,
             (const absl::Notification* n, Duration d), (n, d), , if (result) Acquire(n))
STOWAGE_WRAP(bool, _ZNK4absl7debian312Notification31WaitForNotificationWithDeadlineENS0_4TimeE,
             (const absl::Notification* n, Time t), (n, t), , if (result) Acquire(n))

// absl::Status: a status with a message is a reference-counted StatusRep. Ref() is inline (so
// instrumented), but the last Unref and its delete run in Debian's libabsl_status, where TSan sees
// neither the acquire-release decrement nor, when the compiler made the delete a tail call, that
// the free comes from that library. This is abseil 20220623's own UnrefNonInlined (status.cc),
// compiled here so TSan sees its atomics.
void _ZN4absl7debian36Status15UnrefNonInlinedEm(uintptr_t rep) __asm__(
    "_ZN4absl7debian36Status15UnrefNonInlinedEm");
void _ZN4absl7debian36Status15UnrefNonInlinedEm(uintptr_t rep) {
  auto* r = reinterpret_cast<absl::status_internal::StatusRep*>(rep - 1);
  // Fast path: if ref == 1 this is the only reference and no other thread may touch r.
  if (r->ref.load(std::memory_order_acquire) == 1 ||
      r->ref.fetch_sub(1, std::memory_order_acq_rel) - 1 == 0) {
    delete r;
  }
}

#endif  // ABSL_HAVE_THREAD_SANITIZER
