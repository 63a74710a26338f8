// StagedHostStore (target kPageableHost without pinning in place, or when the host refuses it):
// the host copy stays pageable (or mapped from a safetensors file) and every copy goes through a
// fixed ring of pinned staging buffers. Low CPU RAM: nothing is pinned per onload, and the pinned
// memory is the ring only.
//
// Each tensor is cut into chunks of at most staging_buffer_bytes. For each chunk: wait until the
// DMA that last read the next staging buffer has finished, memcpy the chunk into it with the memcpy
// pool (offload/memcpy_pool.h: parallel threads, one core is slower than the link), enqueue its DMA
// on the copy stream. With two or more buffers the memcpy of chunk k+1 overlaps the DMA of chunk k.
// So a copy blocks the calling thread for the memcpys, not for the whole transfer.
//
// DiskHostStore (disk_host_store.h) is this store over per-group safetensors files.
//
// Thread-safety: as HostStore (offload/host_store.h).
// Lifetime: the destructor joins the memcpy pool and frees the staging buffers; the engine has
// synchronized the device before (the buffers may still be DMA sources otherwise).
#ifndef STOWAGE_OFFLOAD_STAGED_HOST_STORE_H_
#define STOWAGE_OFFLOAD_STAGED_HOST_STORE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "offload/host_store.h"
#include "offload/memcpy_pool.h"

namespace stowage {

class StagedHostStore : public HostStore {
 public:
  // `why_staged`: the reason pinning in place was refused, if it was tried (pin_in_place_error in
  // the stats). Fails when the staging buffers cannot be pinned.
  static absl::StatusOr<std::unique_ptr<HostStore>> Create(const HostStoreOptions& options,
                                                           const std::vector<PlannedGroup>& groups,
                                                           HostWeights& weights, DeviceBackend& backend,
                                                           std::string why_staged);

  std::unique_ptr<DeviceEvent> CopyGroupToSlot(int group, const at::Tensor& slot, const at::Tensor& scratch) final;
  HostStoreStats stats() const override { return stats_; }

 protected:
  StagedHostStore(DeviceBackend& backend, std::vector<StoreGroup> groups, HostStoreStats stats)
      : backend_(&backend), groups_(std::move(groups)), stats_(std::move(stats)) {}
  // Starts the memcpy pool and pins the staging ring.
  absl::Status StartStaging(const HostStoreOptions& options);

 private:
  DeviceBackend* backend_;
  std::vector<StoreGroup> groups_;
  HostStoreStats stats_;
  std::unique_ptr<MemcpyPool> memcpy_pool_;
  std::vector<at::Tensor> staging_;                         // Pinned buffers.
  std::vector<std::unique_ptr<DeviceEvent>> staging_done_;  // The last DMA out of each buffer.
  size_t next_staging_ = 0;
};

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_STAGED_HOST_STORE_H_
