// HostWeights: the host copy of every tensor of a module tree, and whole-model placement.
//
// Weights are immutable during inference, so the host copy stays the source of truth: onloading
// copies host→device and points each slot at the device copy; offloading just points the slot away
// (the device copy is freed), never copying device→host.
//
// Thread-safety: not thread-safe; owned by one component, used by its device's worker.
#ifndef STOWAGE_OFFLOAD_HOST_WEIGHTS_H_
#define STOWAGE_OFFLOAD_HOST_WEIGHTS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "offload/device_backend.h"
#include "offload/module.h"

namespace stowage {

class HostWeights {
 public:
  struct Entry {
    Module* module;
    TensorSlot* slot;
    at::Tensor host;  // Contiguous CPU tensor.
  };

  // Takes the current tensors of `root` (which must all be defined, contiguous CPU tensors) as
  // the host copies. The slots keep pointing at them until OnloadAll or Offload.
  static absl::StatusOr<std::unique_ptr<HostWeights>> Capture(Module& root);

  std::vector<Entry>& entries() { return entries_; }
  int64_t bytes() const { return bytes_; }
  int64_t parameter_count() const { return parameter_count_; }

  // Copies every tensor to the device and points the slots at the copies. On failure (for example
  // device out of memory) nothing stays on the device and the status is returned.
  absl::Status OnloadAll(DeviceBackend& backend);
  // Copies every tensor from where the slots point now (another device, where the component is
  // resident) to `backend`'s device, device to device, and points the slots at the copies: the
  // component moves between devices without passing through the host. On failure the slots are
  // unchanged. FAILED_PRECONDITION when a slot is not on a device (the component is not resident).
  absl::Status OnloadFromPeer(DeviceBackend& backend);
  // Points every slot away from its device copy (undefined), freeing device memory. No copy.
  void OffloadAll();
  // Points every slot at its host copy (for CPU execution without a device).
  void PointAtHost();
  // Replaces an entry's host tensor (same shape and dtype), e.g. to move it into a pinned arena.
  // Slots that pointed at the old host tensor are repointed.
  void ReplaceHost(Entry& entry, at::Tensor host);

  // OK unless a host copy is still a view of a safetensors file that changed on disk since it was
  // mapped (SafetensorsFile::CheckUnchanged: truncated, rewritten in place, or damaged by a read
  // that faulted); then FAILED_PRECONDITION naming the file. Host copies in RAM (heap, pinned, a
  // converted dtype) are never affected. One stat() per distinct mapped file.
  absl::Status CheckSourceFiles() const;

 private:
  HostWeights() = default;
  std::vector<Entry> entries_;
  int64_t bytes_ = 0;
  int64_t parameter_count_ = 0;
};

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_HOST_WEIGHTS_H_
