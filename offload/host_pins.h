// HostPins: page-locking of host memory in place, shared by everything in the process that pins
// (HostWeights::PinInPlace for whole-component moves, PinnedInPlaceHostStore for group offloading).
//
// cudaHostRegister refuses a range that overlaps one already registered, and the host copies of
// different components can share a page (small tensors allocated on one heap page, tensors packed
// back to back in one safetensors file). So every user asks here: pages already locked by another
// user are shared and counted, only the rest is registered, as new segments; a segment is
// unregistered when the last lease holding it is released. Registration is process-wide on CUDA
// (the portable flag), so one registry serves every device.
//
// Thread-safety: thread-safe. Lifetime: a backend that registered a segment must outlive it (the
// server's backends live as long as the process's leases; a lease's holder releases it first).
#ifndef STOWAGE_OFFLOAD_HOST_PINS_H_
#define STOWAGE_OFFLOAD_HOST_PINS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "offload/device_backend.h"

namespace stowage {

class HostPins;

// The pages one user pinned; releasing it (or destroying it) gives them back. Callers make sure no
// copy still reads the memory first (synchronize the device).
class HostPinLease {
 public:
  HostPinLease() = default;
  ~HostPinLease() { Release(); }
  HostPinLease(HostPinLease&& other) noexcept { *this = std::move(other); }
  HostPinLease& operator=(HostPinLease&& other) noexcept;
  HostPinLease(const HostPinLease&) = delete;
  HostPinLease& operator=(const HostPinLease&) = delete;

  void Release();
  // Bytes of the ranges asked for (page-rounded), shared pages included.
  int64_t bytes() const { return bytes_; }
  bool held() const { return registry_ != nullptr; }

 private:
  friend class HostPins;
  HostPins* registry_ = nullptr;
  std::vector<uintptr_t> segments_;  // Begin of each segment this lease holds one reference on.
  int64_t bytes_ = 0;
};

class HostPins {
 public:
  static HostPins& Global();

  // Locks `ranges` ([begin, end), page-aligned, sorted, disjoint: MergedPageRanges) through
  // `backend` (read-only first, as a read-only file mapping needs, then plain). On failure nothing
  // this call registered stays registered and the backend's status is returned.
  absl::StatusOr<HostPinLease> Pin(DeviceBackend& backend, const std::vector<std::pair<uintptr_t, uintptr_t>>& ranges);

  // Bytes registered now (each page once), for tests and diagnostics.
  int64_t registered_bytes() const;

 private:
  friend class HostPinLease;
  struct Segment {
    uintptr_t end = 0;
    int refs = 0;
    DeviceBackend* backend = nullptr;
  };
  void Unref(const std::vector<uintptr_t>& segments);
  void UnrefLocked(const std::vector<uintptr_t>& segments) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<uintptr_t, Segment> segments_ ABSL_GUARDED_BY(mu_);  // By begin; disjoint.
};

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_HOST_PINS_H_
