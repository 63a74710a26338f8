// DiskHostStore (target kDisk): every group that is not kept resident lives in a safetensors file
// of its own, <disk_dir>/<component>/<group name>.safetensors, mapped read-only; the mapping
// becomes the host copy (HostWeights::ReplaceHost) and the RAM copy is released. Copies are staged
// from the mapping exactly as StagedHostStore stages pageable memory (the page cache serves
// repeated reads; a cold page is read from disk by the memcpy).
//
// A file is reused when its "stowage_fingerprint" metadata (a hash of the group's tensor names,
// dtypes, shapes and contents) matches, and rewritten (atomically) when stale; the stats count both.
// Resident groups get no file: they are copied once from their RAM copy.
//
// Thread-safety and lifetime: as StagedHostStore. The files stay on disk for the next Apply; the
// mappings live as long as the host copies that view them.
#ifndef STOWAGE_OFFLOAD_DISK_HOST_STORE_H_
#define STOWAGE_OFFLOAD_DISK_HOST_STORE_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "offload/host_store.h"
#include "offload/safetensors.h"
#include "offload/staged_host_store.h"

namespace stowage {

class DiskHostStore final : public StagedHostStore {
 public:
  // INVALID_ARGUMENT without disk_dir; PERMISSION_DENIED when the folder cannot be created or
  // written; a write or mapping error of a group's file.
  static absl::StatusOr<std::unique_ptr<HostStore>> Create(const HostStoreOptions& options,
                                                           const std::vector<PlannedGroup>& groups,
                                                           HostWeights& weights, DeviceBackend& backend);

 private:
  DiskHostStore(DeviceBackend& backend, std::vector<StoreGroup> groups, HostStoreStats stats,
                std::vector<std::shared_ptr<SafetensorsFile>> files)
      : StagedHostStore(backend, std::move(groups), std::move(stats)), files_(std::move(files)) {}

  std::vector<std::shared_ptr<SafetensorsFile>> files_;  // One per streamed or always-on group.
};

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_DISK_HOST_STORE_H_
