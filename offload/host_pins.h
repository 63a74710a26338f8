// HostPins: page-locking of host memory in place, shared by everything in the process that pins
// (HostWeights::PinInPlace for whole-component moves, PinnedInPlaceHostStore for group offloading).
//
// What is locked are whole regions (HostRegion): a safetensors file's mapping, or an arena that
// holds nothing but one component's host copies (HostWeights::LockableRegions). Regions, not the
// pages of single tensors, because CUDA refuses a copy that runs across the edge of a registered
// range, and cudaHostRegister refuses a range that overlaps one already registered: a registration
// must hold whole tensors and nothing else. Components whose host copies lie in the same region
// (two pipelines mapping one file) share it here: it is registered once and unregistered when the
// last lease holding it is released. Registration is process-wide on CUDA (the portable flag), so
// one registry serves every device.
//
// Thread-safety: thread-safe. Lifetime: a backend that registered a region must outlive it (the
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

// [begin, end): page-aligned. read_only: a read-only mapping (registered with the read-only flag,
// which such a mapping needs).
struct HostRegion {
  uintptr_t begin = 0;
  uintptr_t end = 0;
  bool read_only = false;
  int64_t bytes() const { return static_cast<int64_t>(end - begin); }
};

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
  // Bytes of the regions asked for, shared ones included.
  int64_t bytes() const { return bytes_; }
  bool held() const { return registry_ != nullptr; }

 private:
  friend class HostPins;

// [begin, end): page-aligned. read_only: a read-only mapping (registered with the read-only flag,
// which such a mapping needs).
struct HostRegion {
  uintptr_t begin = 0;
  uintptr_t end = 0;
  bool read_only = false;
  int64_t bytes() const { return static_cast<int64_t>(end - begin); }
};
  HostPins* registry_ = nullptr;
  std::vector<uintptr_t> segments_;  // Begin of each locked region this lease holds one reference on.
  int64_t bytes_ = 0;
};

class HostPins {
 public:
  static HostPins& Global();

  // Locks `regions` (disjoint) through `backend`. A region equal to or inside one already locked
  // shares it; one that partly overlaps a locked region is refused (FAILED_PRECONDITION: a copy
  // could run across the edge). On failure nothing this call registered stays registered and the
  // status is returned.
  absl::StatusOr<HostPinLease> Pin(DeviceBackend& backend, const std::vector<HostRegion>& regions);

  // Bytes registered now (each page once), for tests and diagnostics.
  int64_t registered_bytes() const;

 private:
  friend class HostPinLease;
  struct Segment {
    uintptr_t end = 0;
    int refs = 0;
    DeviceBackend* backend = nullptr;
  };
  absl::Status PinLocked(DeviceBackend& backend, const std::vector<HostRegion>& regions, HostPinLease& lease)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unref(const std::vector<uintptr_t>& segments);
  void UnrefLocked(const std::vector<uintptr_t>& segments) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<uintptr_t, Segment> segments_ ABSL_GUARDED_BY(mu_);  // By begin; disjoint.
};

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_HOST_PINS_H_
