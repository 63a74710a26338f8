#include "offload/host_store.h"

#include <chrono>
#include <system_error>

#include <ATen/Functions.h>

namespace stowage {
namespace {

TimedAllocation AllocateTimed(DeviceBackend* backend, int64_t bytes) {
  const auto start = std::chrono::steady_clock::now();
  TimedAllocation allocated{backend->AllocatePinnedHost(bytes)};
  allocated.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return allocated;
}

}  // namespace

std::future<TimedAllocation> AllocatePinnedAhead(DeviceBackend& backend, int64_t bytes) {
  try {
    return std::async(std::launch::async, AllocateTimed, &backend, bytes);
  } catch (const std::system_error&) {
    return std::async(std::launch::deferred, AllocateTimed, &backend, bytes);
  }
}

std::vector<StoreGroup> ResolveGroups(const std::vector<PlannedGroup>& planned, HostWeights& weights) {
  std::vector<StoreGroup> groups;
  groups.reserve(planned.size());
  for (const PlannedGroup& p : planned) {
    StoreGroup g;
    g.name = p.name;
    g.bytes = p.bytes;
    g.resident = p.resident;
    g.tensors.reserve(p.tensors.size());
    for (const PlannedTensor& t : p.tensors) {
      g.tensors.push_back(StoreTensor{&weights.entries()[static_cast<size_t>(t.index)], t.offset});
    }
    groups.push_back(std::move(g));
  }
  return groups;
}

int64_t NonResidentTensorBytes(const std::vector<StoreGroup>& groups) {
  int64_t bytes = 0;
  for (const StoreGroup& g : groups) {
    if (g.resident) continue;
    for (const StoreTensor& t : g.tensors) bytes += static_cast<int64_t>(t.entry->host.nbytes());
  }
  return bytes;
}

at::Tensor BytesOf(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), {static_cast<int64_t>(t.nbytes())}, at::TensorOptions().dtype(at::kByte));
}

std::unique_ptr<DeviceEvent> CopyTensorsDirect(DeviceBackend& backend, const StoreGroup& group,
                                               const at::Tensor& slot) {
  for (const StoreTensor& t : group.tensors) {
    const at::Tensor& host = t.entry->host;
    const auto n = static_cast<int64_t>(host.nbytes());
    backend.CopyToDeviceAsync(slot.narrow(0, t.offset, n), BytesOf(host.contiguous()));
  }
  return backend.RecordOnCopyStream();
}

}  // namespace stowage
