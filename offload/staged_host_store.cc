#include "offload/staged_host_store.h"

#include <algorithm>
#include <utility>

#include "base/status_macros.h"

namespace stowage {

absl::StatusOr<std::unique_ptr<HostStore>> StagedHostStore::Create(const HostStoreOptions& options,
                                                                   const std::vector<PlannedGroup>& groups,
                                                                   HostWeights& weights,
                                                                   DeviceBackend& backend,
                                                                   std::string why_staged) {
  HostStoreStats stats;
  stats.pin_in_place_error = std::move(why_staged);
  std::unique_ptr<StagedHostStore> store(
      new StagedHostStore(backend, ResolveGroups(groups, weights), std::move(stats)));
  store->stats_.bytes_per_forward = NonResidentTensorBytes(store->groups_);
  RETURN_IF_ERROR(store->StartStaging(options));
  return std::unique_ptr<HostStore>(std::move(store));
}

absl::Status StagedHostStore::StartStaging(const HostStoreOptions& options) {
  memcpy_pool_ = std::make_unique<MemcpyPool>(options.staging_threads - 1);
  for (int i = 0; i < options.staging_buffers; ++i) {
    ASSIGN_OR_RETURN(at::Tensor buffer, backend_->AllocatePinnedHost(options.staging_buffer_bytes));
    staging_.push_back(buffer);
    staging_done_.emplace_back();
  }
  return absl::OkStatus();
}

std::unique_ptr<DeviceEvent> StagedHostStore::CopyGroupToSlot(int group, const at::Tensor& slot,
                                                               const at::Tensor& /*scratch*/) {
  for (const StoreTensor& t : groups_[static_cast<size_t>(group)].tensors) {
    const at::Tensor& host = t.entry->host;
    const auto n = static_cast<int64_t>(host.nbytes());
    const auto* src = static_cast<const uint8_t*>(host.data_ptr());
    for (int64_t done = 0; done < n;) {
      const size_t k = next_staging_;
      next_staging_ = (next_staging_ + 1) % staging_.size();
      if (staging_done_[k]) staging_done_[k]->Wait();  // Its previous DMA has read it.
      const int64_t len = std::min<int64_t>(n - done, staging_[k].numel());
      memcpy_pool_->Copy(staging_[k].data_ptr<uint8_t>(), src + done, len);
      backend_->CopyToDeviceAsync(slot.narrow(0, t.offset + done, len), staging_[k].narrow(0, 0, len));
      staging_done_[k] = backend_->RecordOnCopyStream();
      done += len;
    }
  }
  return backend_->RecordOnCopyStream();
}

}  // namespace stowage
