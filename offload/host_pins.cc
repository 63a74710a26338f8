#include "offload/host_pins.h"

#include <algorithm>
#include <iterator>

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

absl::StatusOr<HostPinLease> HostPins::Pin(DeviceBackend& backend,
                                           const std::vector<std::pair<uintptr_t, uintptr_t>>& ranges) {
  HostPinLease lease;
  absl::MutexLock lock(&mu_);
  for (const auto& [begin, end] : ranges) {
    uintptr_t cursor = begin;
    while (cursor < end) {
      // A segment holding `cursor`: share it.
      auto next = segments_.upper_bound(cursor);
      if (next != segments_.begin()) {
        auto held = std::prev(next);
        if (held->second.end > cursor) {
          ++held->second.refs;
          lease.segments_.push_back(held->first);
          cursor = held->second.end;
          continue;
        }
      }
      // Free pages up to the next segment (or the range's end): a new segment.
      const uintptr_t stop = next != segments_.end() ? std::min(end, next->first) : end;
      void* ptr = reinterpret_cast<void*>(cursor);
      const auto size = static_cast<int64_t>(stop - cursor);
      absl::Status status = backend.RegisterHostMemory(ptr, size, /*read_only=*/true);
      if (!status.ok()) status = backend.RegisterHostMemory(ptr, size, /*read_only=*/false);
      if (!status.ok()) {
        UnrefLocked(lease.segments_);  // Nothing of this call stays; no copy read them yet.
        lease.segments_.clear();
        return status;
      }
      segments_[cursor] = Segment{stop, 1, &backend};
      lease.segments_.push_back(cursor);
      cursor = stop;
    }
    lease.bytes_ += static_cast<int64_t>(end - begin);
  }
  lease.registry_ = this;
  return lease;
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
