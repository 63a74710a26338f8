#include "offload/host_pins.h"

#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"

namespace stowage {

HostPinLease& HostPinLease::operator=(HostPinLease&& other) noexcept {
  if (this != &other) {
    Release();
    registry_ = std::exchange(other.registry_, nullptr);
    segments_ = std::move(other.segments_);
    other.segments_.clear();
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void HostPinLease::Release() {
  if (registry_ == nullptr) return;
  registry_->Unref(segments_);
  registry_ = nullptr;
  segments_.clear();
  bytes_ = 0;
}

HostPins& HostPins::Global() {
  static HostPins* pins = new HostPins();
  return *pins;
}

absl::StatusOr<HostPinLease> HostPins::Pin(DeviceBackend& backend, const std::vector<HostRegion>& regions) {
  HostPinLease lease;
  absl::MutexLock lock(&mu_);
  absl::Status status = PinLocked(backend, regions, lease);
  if (!status.ok()) {
    UnrefLocked(lease.segments_);  // Nothing of this call stays; no copy read them yet.
    lease.segments_.clear();
    return status;
  }
  lease.registry_ = this;
  return lease;
}

absl::Status HostPins::PinLocked(DeviceBackend& backend, const std::vector<HostRegion>& regions,
                                 HostPinLease& lease) {
  for (const HostRegion& region : regions) {
    if (region.end <= region.begin) continue;
    // The locked region holding `begin`, if any: share it when it holds the whole region.
    auto next = segments_.upper_bound(region.begin);
    if (next != segments_.begin()) {
      auto held = std::prev(next);
      if (held->second.end > region.begin) {
        if (held->second.end < region.end) {
          return absl::FailedPreconditionError(absl::StrCat(
              "host region of ", region.bytes(), " bytes runs past the end of a locked region"));
        }
        ++held->second.refs;
        lease.segments_.push_back(held->first);
        lease.bytes_ += region.bytes();
        continue;
      }
    }
    if (next != segments_.end() && next->first < region.end) {
      return absl::FailedPreconditionError(absl::StrCat(
          "host region of ", region.bytes(), " bytes overlaps the start of a locked region"));
    }
    void* ptr = reinterpret_cast<void*>(region.begin);
    absl::Status status = backend.RegisterHostMemory(ptr, region.bytes(), region.read_only);
    // Some hosts lock a read-only mapping only without the flag.
    if (!status.ok() && region.read_only) status = backend.RegisterHostMemory(ptr, region.bytes(), false);
    if (!status.ok()) return status;
    segments_[region.begin] = Segment{region.end, 1, &backend};
    lease.segments_.push_back(region.begin);
    lease.bytes_ += region.bytes();
  }
  return absl::OkStatus();
}

int64_t HostPins::registered_bytes() const {
  absl::MutexLock lock(&mu_);
  int64_t bytes = 0;
  for (const auto& [begin, segment] : segments_) bytes += static_cast<int64_t>(segment.end - begin);
  return bytes;
}

void HostPins::Unref(const std::vector<uintptr_t>& segments) {
  absl::MutexLock lock(&mu_);
  UnrefLocked(segments);
}

void HostPins::UnrefLocked(const std::vector<uintptr_t>& segments) {
  for (uintptr_t begin : segments) {
    auto it = segments_.find(begin);
    if (it == segments_.end()) continue;
    if (--it->second.refs > 0) continue;
    (void)it->second.backend->UnregisterHostMemory(reinterpret_cast<void*>(begin));
    segments_.erase(it);
  }
}

}  // namespace stowage
