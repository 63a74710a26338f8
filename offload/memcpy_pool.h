// MemcpyPool: copies large host buffers with a few dedicated threads.
//
// One core's memcpy (~5-10 GB/s) is far below a host-to-device link, so staging pageable memory
// into pinned buffers (offload/staged_host_store.h) splits each copy into slices of at least 1 MiB
// and runs them in parallel: the caller copies the first slice itself, the pool's threads the rest.
//
// Thread-safety: Copy() is called by one thread at a time (the device worker that owns the store);
// it blocks until every slice is copied. The pool's threads only ever touch the slices handed to
// them by the Copy() in progress.
// Lifetime: the threads start in the constructor and are joined by the destructor, which must not
// run during a Copy().
//
//   MemcpyPool pool(/*threads=*/7);           // With the caller: up to 8 slices at a time.
//   pool.Copy(pinned_dst, pageable_src, n);   // Returns when all n bytes are in pinned_dst.
#ifndef STOWAGE_OFFLOAD_MEMCPY_POOL_H_
#define STOWAGE_OFFLOAD_MEMCPY_POOL_H_

#include <cstdint>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace stowage {

class MemcpyPool {
 public:
  // Starts `threads` (>= 0) copy threads; 0 copies on the caller only.
  explicit MemcpyPool(int threads);
  ~MemcpyPool();
  MemcpyPool(const MemcpyPool&) = delete;
  MemcpyPool& operator=(const MemcpyPool&) = delete;

  // Copies n bytes from src to dst (which must not overlap); returns when done.
  void Copy(uint8_t* dst, const uint8_t* src, int64_t n);

 private:
  void Loop(int index);

  std::vector<std::thread> workers_;
  absl::Mutex mu_;
  absl::CondVar work_cv_;  // A new generation (work or stop) was published.
  absl::CondVar done_cv_;  // pending_ reached 0.
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint8_t* dst_ ABSL_GUARDED_BY(mu_) = nullptr;
  const uint8_t* src_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t n_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t slice_ ABSL_GUARDED_BY(mu_) = 0;
  int active_ ABSL_GUARDED_BY(mu_) = 0;   // Workers 0..active_-1 take part in this generation.
  int pending_ ABSL_GUARDED_BY(mu_) = 0;  // Of those, the ones not finished yet.
};

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_MEMCPY_POOL_H_
