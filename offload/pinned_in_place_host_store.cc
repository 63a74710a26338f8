#include "offload/pinned_in_place_host_store.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <utility>

namespace stowage {

absl::StatusOr<std::unique_ptr<HostStore>> PinnedInPlaceHostStore::Create(
    const std::vector<PlannedGroup>& groups, HostWeights& weights, DeviceBackend& backend) {
  std::unique_ptr<PinnedInPlaceHostStore> store(
      new PinnedInPlaceHostStore(backend, ResolveGroups(groups, weights)));
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  for (const StoreGroup& g : store->groups_) {
    for (const StoreTensor& t : g.tensors) {
      const at::Tensor& host = t.entry->host;
      if (host.nbytes() == 0) continue;
      const auto begin = reinterpret_cast<uintptr_t>(host.data_ptr());
      const uintptr_t end = begin + host.nbytes();
      ranges.emplace_back(begin / page * page, (end + page - 1) / page * page);
    }
  }
  store->stats_.bytes_per_forward = NonResidentTensorBytes(store->groups_);
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uintptr_t, uintptr_t>> merged;  // Overlapping pages registered once.
  for (const auto& r : ranges) {
    if (!merged.empty() && r.first < merged.back().second) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  for (const auto& [begin, end] : merged) {
    void* ptr = reinterpret_cast<void*>(begin);
    const auto size = static_cast<int64_t>(end - begin);
    absl::Status status = backend.RegisterHostMemory(ptr, size, /*read_only=*/true);
    if (!status.ok()) status = backend.RegisterHostMemory(ptr, size, /*read_only=*/false);
    if (!status.ok()) {
      store->Unregister();  // Nothing was copied from them yet: no need to synchronize.
      return status;
    }
    store->registered_.push_back(ptr);
    store->stats_.pinned_in_place_bytes += size;
  }
  return std::unique_ptr<HostStore>(std::move(store));
}

PinnedInPlaceHostStore::~PinnedInPlaceHostStore() {
  if (registered_.empty()) return;
  backend_->Synchronize();  // No copy may still read the memory.
  Unregister();
}

void PinnedInPlaceHostStore::Unregister() {
  for (void* ptr : registered_) (void)backend_->UnregisterHostMemory(ptr);
  registered_.clear();
}

void PinnedInPlaceHostStore::CopyGroupToSlot(int group, const at::Tensor& slot,
                                              const at::Tensor& /*scratch*/) {
  CopyTensorsDirect(*backend_, groups_[static_cast<size_t>(group)], slot);
}

}  // namespace stowage
