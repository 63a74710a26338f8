// PinnedHostStore (target kPinnedHost): every group that is not kept resident is packed, in its
// device layout, into pinned host memory, so its copy is one DMA of the group's bytes.
//
// Pinned chunks of about 256 MiB, each sized exactly to the consecutive groups it holds
// (cudaHostAlloc pins every page it returns, so slack would be resident RAM holding nothing). The
// host copies move into the chunks (HostWeights::ReplaceHost) group by group and the pageable
// originals are released as they go, so RAM holds the weights once; pages copied from a safetensors
// mapping are dropped from RSS right away. Resident groups keep their original host copy and are
// copied tensor by tensor, once, at Apply.
//
// Thread-safety and lifetime: as HostStore (offload/host_store.h). The chunks live as long as the
// host copies that view them (HostWeights), not only as long as the store.
#ifndef STOWAGE_OFFLOAD_PINNED_HOST_STORE_H_
#define STOWAGE_OFFLOAD_PINNED_HOST_STORE_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "offload/host_store.h"

namespace stowage {

class PinnedHostStore final : public HostStore {
 public:
  // Fails when the backend cannot allocate pinned memory; host copies already moved stay valid.
  // `copy_threads` (>= 1; CreateHostStore checks) copy the weights into the pinned chunks.
  static absl::StatusOr<std::unique_ptr<HostStore>> Create(const std::vector<PlannedGroup>& groups,
                                                           HostWeights& weights, DeviceBackend& backend,
                                                           int copy_threads);

  std::unique_ptr<DeviceEvent> CopyGroupToSlot(int group, const at::Tensor& slot, const at::Tensor& scratch) override;
  HostStoreStats stats() const override { return stats_; }

 private:
  PinnedHostStore(DeviceBackend& backend, std::vector<StoreGroup> groups)
      : backend_(&backend), groups_(std::move(groups)), packed_(groups_.size()) {}

  DeviceBackend* backend_;
  std::vector<StoreGroup> groups_;
  std::vector<at::Tensor> packed_;  // Per group: its packed pinned bytes; undefined for resident groups.
  HostStoreStats stats_;
};

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_PINNED_HOST_STORE_H_
