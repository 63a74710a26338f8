#include "offload/host_weights.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "offload/safetensors.h"

namespace stowage {

absl::StatusOr<std::unique_ptr<HostWeights>> HostWeights::Capture(Module& root) {
  std::unique_ptr<HostWeights> weights(new HostWeights());
  absl::Status status;
  root.ForEachSlot([&](Module& module, TensorSlot& slot) {
    if (!status.ok()) return;
    if (!slot.value.defined() || !slot.value.device().is_cpu() || !slot.value.is_contiguous()) {
      status = absl::FailedPreconditionError(absl::StrCat(
          "tensor '", module.SlotPath(slot), "' is not a defined contiguous CPU tensor"));
      return;
    }
    weights->bytes_ += static_cast<int64_t>(slot.value.nbytes());
    if (!slot.is_buffer) weights->parameter_count_ += slot.value.numel();
    weights->entries_.push_back(Entry{&module, &slot, slot.value});
  });
  if (!status.ok()) return status;
  return weights;
}

std::vector<std::pair<uintptr_t, uintptr_t>> MergedPageRanges(const std::vector<const at::Tensor*>& tensors) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  for (const at::Tensor* t : tensors) {
    if (t->nbytes() == 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(t->data_ptr());
    const uintptr_t end = begin + t->nbytes();
    ranges.emplace_back(begin / page * page, (end + page - 1) / page * page);
  }
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uintptr_t, uintptr_t>> merged;
  for (const auto& r : ranges) {
    if (!merged.empty() && r.first < merged.back().second) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  return merged;
}

// Placement unpins a component on its device's worker before the component can go; this only
// catches weights pinned outside placement (tests, benchmarks).
HostWeights::~HostWeights() { Unpin(); }

absl::Status HostWeights::PinInPlace(DeviceBackend& backend) {
  if (pinned_by_ != nullptr) return absl::OkStatus();
  std::vector<const at::Tensor*> hosts;
  hosts.reserve(entries_.size());
  for (const Entry& e : entries_) hosts.push_back(&e.host);
  auto lease = HostPins::Global().Pin(backend, MergedPageRanges(hosts));
  if (!lease.ok()) {
    return absl::Status(lease.status().code(),
                        absl::StrCat("pinning ", bytes_, " bytes of host copies in place: ", lease.status().message()));
  }
  pinned_ = *std::move(lease);
  pinned_by_ = &backend;
  return absl::OkStatus();
}

void HostWeights::Unpin() {
  if (pinned_by_ == nullptr) return;
  pinned_by_->Synchronize();  // No copy may still read the pages.
  pinned_.Release();
  pinned_by_ = nullptr;
}

absl::Status HostWeights::OnloadAll(DeviceBackend& backend) {
  for (size_t i = 0; i < entries_.size(); ++i) {
    absl::StatusOr<at::Tensor> device = backend.CopyToDevice(entries_[i].host);
    if (!device.ok()) {
      for (size_t j = 0; j < i; ++j) entries_[j].slot->value = at::Tensor();
      return device.status();
    }
    entries_[i].slot->value = *std::move(device);
    // A host copy that is a safetensors mapping stays in the page cache for the next onload; this
    // process's RSS stops counting it (the device copy is what runs). Pinned pages stay put: no
    // system call per tensor that could not release them.
    if (pinned_by_ == nullptr) {
      (void)ReleaseMappedPages(entries_[i].host.data_ptr(), static_cast<int64_t>(entries_[i].host.nbytes()));
    }
  }
  return absl::OkStatus();
}

absl::Status HostWeights::OnloadFromPeer(DeviceBackend& backend) {
  std::vector<at::Tensor> copies;
  copies.reserve(entries_.size());
  for (Entry& entry : entries_) {
    if (!entry.slot->value.defined() || entry.slot->value.is_same(entry.host)) {
      return absl::FailedPreconditionError("OnloadFromPeer: a weight is not on a device (the component is not resident)");
    }
    absl::StatusOr<at::Tensor> copy = backend.CopyFromPeer(entry.slot->value);
    if (!copy.ok()) return copy.status();  // `copies` frees what was copied so far.
    copies.push_back(*std::move(copy));
  }
  for (size_t i = 0; i < entries_.size(); ++i) entries_[i].slot->value = std::move(copies[i]);
  return absl::OkStatus();
}

void HostWeights::OffloadAll() {
  for (Entry& entry : entries_) entry.slot->value = at::Tensor();
}

void HostWeights::PointAtHost() {
  for (Entry& entry : entries_) entry.slot->value = entry.host;
}

absl::Status HostWeights::CheckSourceFiles() const {
  std::vector<const void*> addresses;
  addresses.reserve(entries_.size());
  for (const Entry& entry : entries_) addresses.push_back(entry.host.data_ptr());
  for (const auto& file : MappedFilesContaining(addresses)) {
    absl::Status status = file->CheckUnchanged();
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

void HostWeights::ReplaceHost(Entry& entry, at::Tensor host) {
  Unpin();  // The old host tensor may be freed: nothing of it may stay registered.
  const bool pointed_at_host = entry.slot->value.defined() && entry.slot->value.is_same(entry.host);
  entry.host = std::move(host);
  if (pointed_at_host) entry.slot->value = entry.host;
}

}  // namespace stowage
