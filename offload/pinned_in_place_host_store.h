// PinnedInPlaceHostStore (target kPageableHost with pin_in_place): the host copy stays where it is
// (heap, or the read-only mapping of a safetensors file) and is registered with the device
// (DeviceBackend::RegisterHostMemory), so each tensor is one full-speed DMA with no second copy in RAM.
//
// The regions of HostWeights::LockableRegions (the safetensors mappings holding the host copies,
// or the component's arena that its heap copies move into first; resident groups included) are
// locked through the process's HostPins (regions another component already locked are shared).
// Create fails with the backend's status when the host refuses (for example a low
// RLIMIT_MEMLOCK); nothing stays registered then, and the factory stages instead.
//
// Thread-safety: as HostStore (offload/host_store.h).
// Lifetime: the destructor synchronizes the device (no copy may still read the memory) and
// unregisters every range.
#ifndef STOWAGE_OFFLOAD_PINNED_IN_PLACE_HOST_STORE_H_
#define STOWAGE_OFFLOAD_PINNED_IN_PLACE_HOST_STORE_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "offload/host_pins.h"
#include "offload/host_store.h"

namespace stowage {

class PinnedInPlaceHostStore final : public HostStore {
 public:
  static absl::StatusOr<std::unique_ptr<HostStore>> Create(const std::vector<PlannedGroup>& groups,
                                                           HostWeights& weights, DeviceBackend& backend);
  ~PinnedInPlaceHostStore() override;

  std::unique_ptr<DeviceEvent> CopyGroupToSlot(int group, const at::Tensor& slot, const at::Tensor& scratch) override;
  HostStoreStats stats() const override { return stats_; }

 private:
  PinnedInPlaceHostStore(DeviceBackend& backend, std::vector<StoreGroup> groups)
      : backend_(&backend), groups_(std::move(groups)) {}

  DeviceBackend* backend_;
  std::vector<StoreGroup> groups_;
  HostPinLease pinned_;
  HostStoreStats stats_;
};

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_PINNED_IN_PLACE_HOST_STORE_H_
