// kvbridge/common/thread_annotations.h — lock annotations that clang's -Wthread-safety checks,
// and a Mutex that carries them (libstdc++'s std::mutex is not annotated).
//
//   class Counter {
//    public:
//     void Add(int n) EXCLUDES(mu_) {
//       MutexLock l(&mu_);
//       total_ += n;
//     }
//    private:
//     Mutex mu_;
//     int total_ GUARDED_BY(mu_) = 0;
//   };
//
// Waiting on a condition: a std::condition_variable waits on the lock's native() unique_lock,
// and a predicate lambda that reads guarded members says so after its parameter list:
//   MutexLock l(&mu_);
//   cv_.wait(l.native(), [&]() REQUIRES(mu_) { return total_ > 0; });
//
// GCC ignores the annotations; `scripts/test.sh` runs clang with -Wthread-safety -Werror
// -fsyntax-only over the sources (the "thread-safety" stage), so a member read without its lock
// fails CI. The macros follow clang's documented names
// (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html).
//
// Thread-safety: Mutex and MutexLock are what they say; the macros have no runtime effect.
#pragma once

#include <mutex>

#if defined(__clang__)
#define KVB_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define KVB_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) KVB_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY KVB_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) KVB_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) KVB_THREAD_ANNOTATION(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) KVB_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) KVB_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define REQUIRES(...) KVB_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define ACQUIRE(...) KVB_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) KVB_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) KVB_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define EXCLUDES(...) KVB_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) KVB_THREAD_ANNOTATION(assert_capability(x))
#define RETURN_CAPABILITY(x) KVB_THREAD_ANNOTATION(lock_returned(x))
#define NO_THREAD_SAFETY_ANALYSIS KVB_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace kvbridge {

/// A std::mutex the analysis knows as a capability.
class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  /// Tells the analysis the caller holds the lock (where it cannot see it).
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class MutexLock;
  std::mutex mu_;
};

/// Holds a Mutex for its scope (std::unique_lock's role); Unlock/Lock in between as the
/// analysis sees them.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : lock_(mu->mu_) {}
  ~MutexLock() RELEASE() {}
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() RELEASE() { lock_.unlock(); }
  void Lock() ACQUIRE() { lock_.lock(); }
  /// For std::condition_variable::wait*, which releases and retakes the mutex; the analysis
  /// treats it as held throughout (as it is whenever the caller's code runs).
  std::unique_lock<std::mutex>& native() { return lock_; }

 private:
  std::unique_lock<std::mutex> lock_;
};

}  // namespace kvbridge
