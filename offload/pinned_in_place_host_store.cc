#include "offload/pinned_in_place_host_store.h"

#include <utility>

namespace stowage {

absl::StatusOr<std::unique_ptr<HostStore>> PinnedInPlaceHostStore::Create(
    const std::vector<PlannedGroup>& groups, HostWeights& weights, DeviceBackend& backend) {
  // Before the groups resolve: heap host copies move into the component's arena first.
  absl::StatusOr<HostWeights::Lockable> lockable = weights.LockableRegions(backend);
  if (!lockable.ok()) return lockable.status();
  std::unique_ptr<PinnedInPlaceHostStore> store(
      new PinnedInPlaceHostStore(backend, ResolveGroups(groups, weights)));
  store->stats_.bytes_per_forward = NonResidentTensorBytes(store->groups_);
  auto lease = HostPins::Global().Pin(backend, lockable->regions);
  if (!lease.ok()) return lease.status();  // Nothing stays registered.
  store->pinned_ = *std::move(lease);
  store->stats_.pinned_in_place_bytes = store->pinned_.bytes();
  return std::unique_ptr<HostStore>(std::move(store));
}

PinnedInPlaceHostStore::~PinnedInPlaceHostStore() {
  if (!pinned_.held()) return;
  backend_->Synchronize();  // No copy may still read the memory.
  pinned_.Release();
}

std::unique_ptr<DeviceEvent> PinnedInPlaceHostStore::CopyGroupToSlot(int group, const at::Tensor& slot,
                                                                      const at::Tensor& /*scratch*/) {
  return CopyTensorsDirect(*backend_, groups_[static_cast<size_t>(group)], slot);
}

}  // namespace stowage
