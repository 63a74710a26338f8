// HostWeights: the host copy of every tensor of a module tree, and whole-model placement.
//
// Weights are immutable during inference, so the host copy stays the source of truth: onloading
// copies host→device and points each slot at the device copy; offloading just points the slot away
// (the device copy is freed), never copying device→host.
//
// Thread-safety: not thread-safe; owned by one component, used by its device's worker.
#ifndef STOWAGE_OFFLOAD_HOST_WEIGHTS_H_
#define STOWAGE_OFFLOAD_HOST_WEIGHTS_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "offload/device_backend.h"
#include "offload/host_pins.h"
#include "offload/module.h"

namespace stowage {

class HostWeights {
 public:
  struct Entry {
    Module* module;
    TensorSlot* slot;
    at::Tensor host;  // Contiguous CPU tensor.
    int deferred = -1;  // A deferred FP8 weight's codes or scales: its index in deferred() (else -1).
  };

  // A deferred FP8 weight (Module::DeferFp8) taken over from the captured tree: entries `codes` and
  // `scales` (indices into entries()) hold kFp8E4M3's Quantize(source) once written.
  struct Deferred {
    size_t codes;
    size_t scales;
    at::Tensor source;
    bool written = false;
  };

  // Takes the current tensors of `root` (which must all be defined, contiguous CPU tensors) as
  // the host copies. The slots keep pointing at them until OnloadAll or Offload.
  static absl::StatusOr<std::unique_ptr<HostWeights>> Capture(Module& root);

  // The host copies. A deferred FP8 weight's are not written until MaterializeDeferred (see
  // deferred()): a reader of host bytes other than this class materializes first, or makes what it
  // needs from the deferred source itself (the compressed store).
  std::vector<Entry>& entries() { return entries_; }
  // Deferred FP8 weights of the tree (Module::DeferFp8 at Capture time), written or not.
  const std::vector<Deferred>& deferred() const { return deferred_; }
  // Whether `entry`'s host bytes are not written yet (a deferred FP8 weight's codes or scales).
  bool unwritten(const Entry& entry) const {
    return entry.deferred >= 0 && !deferred_[static_cast<size_t>(entry.deferred)].written;
  }
  // Whether a deferred FP8 weight is not written yet.
  bool has_unwritten() const {
    return std::any_of(deferred_.begin(), deferred_.end(), [](const Deferred& d) { return !d.written; });
  }
  // Writes every deferred FP8 weight's codes and scales on the host (threads over rows, the
  // source's mapped pages released as they are read), so that every host copy holds its bytes.
  // Onloading, pinning and pointing at the host call it first; so do the stores that copy host
  // bytes as they are. Nothing when none is left.
  void MaterializeDeferred();
  // The same for the deferred weight `entry` belongs to (nothing when it holds its bytes).
  void Materialize(const Entry& entry);
  int64_t bytes() const { return bytes_; }
  int64_t parameter_count() const { return parameter_count_; }

  // Copies every tensor to the device and points the slots at the copies. On failure (for example
  // device out of memory) nothing stays on the device and the status is returned.
  absl::Status OnloadAll(DeviceBackend& backend);
  // OnloadAll without waiting: allocates every device copy, enqueues the copies on the backend's
  // copy stream (after the work already on its compute stream, which may still be reading memory the
  // allocator hands out again) and points the slots at the copies, which are complete once the
  // returned copy-stream event is. The caller makes the compute stream wait for that event before
  // anything reads the weights, and waits for it on the host before the device copies are freed
  // (OffloadAll). Needs the host copies page-locked (pinned_in_place): a copy from pageable memory
  // would make the calling thread wait for it. FAILED_PRECONDITION when they are not; on an
  // allocation failure nothing stays on the device and the status is returned.
  absl::StatusOr<std::unique_ptr<DeviceEvent>> OnloadAllAsync(DeviceBackend& backend);
  // Copies every tensor from where the slots point now (another device, where the component is
  // resident) to `backend`'s device, device to device, and points the slots at the copies: the
  // component moves between devices without passing through the host. On failure the slots are
  // unchanged. FAILED_PRECONDITION when a slot is not on a device (the component is not resident).
  absl::Status OnloadFromPeer(DeviceBackend& backend);
  // Points every slot away from its device copy (undefined), freeing device memory. No copy.
  void OffloadAll();
  // Points every slot at its host copy (for CPU execution without a device).
  void PointAtHost();
  // OffloadAll and PointAtHost first drop what the captured tree keeps on the device besides its
  // weights (Module::ReleaseDeviceCaches: captured graphs read the weights leaving). OnloadFromPeer
  // does not: it runs on the peer's worker, and the device's own worker drops them before a peer
  // move (PlacementManager::Offload).
  // Replaces an entry's host tensor (same shape and dtype), e.g. to move it into a pinned arena.
  // Slots that pointed at the old host tensor are repointed. Unpins the weights first if pinned.
  // The entry must hold its bytes (not unwritten(): the replacement is a copy of them).
  void ReplaceHost(Entry& entry, at::Tensor host);

  // The regions to page-lock so that every host copy copies at the link's full speed, each host
  // copy wholly inside one region and no region holding anything but host copies (CUDA refuses a
  // copy that runs across the edge of a registered range; see offload/host_pins.h):
  //   - a host copy in a live safetensors mapping: the whole mapping (read-only);
  //   - a host copy on the heap, whose pages it shares with whatever else the process allocated
  //     (a request's tensors, another component's weights): it is first moved, once, into an arena
  //     of this component's own (page-aligned anonymous memory; each copy's heap memory is freed as
  //     it moves, so RAM holds one copy), and the arena is the region;
  //   - a host copy already in page-locked memory (the pinned arena of a group-offload store): no
  //     region; its bytes are counted in already_locked_bytes.
  // RESOURCE_EXHAUSTED when the arena cannot be allocated (nothing moved then).
  struct Lockable {
    std::vector<HostRegion> regions;
    int64_t already_locked_bytes = 0;
    int64_t moved_to_arena_bytes = 0;  // By this call.
  };
  absl::StatusOr<Lockable> LockableRegions(DeviceBackend& backend);

  // Page-locks the host copies where LockableRegions puts them, through `backend` and the
  // process's HostPins, so OnloadAll copies at the link's full speed with no second copy in RAM.
  // Pinned pages stay in RAM (a mapping's pages stay counted in the process's RSS). OK and nothing
  // changes when already pinned. On failure (a host that refuses to lock that much memory:
  // RLIMIT_MEMLOCK) nothing stays registered and the status is returned; copies then run from
  // pageable memory as before.
  absl::Status PinInPlace(DeviceBackend& backend);
  // Synchronizes the backend that pinned them (no copy may still read the pages) and unregisters
  // every range. Nothing when not pinned. Called by the destructor too.
  void Unpin();
  bool pinned_in_place() const { return pinned_by_ != nullptr; }
  // Bytes of the regions pinned by PinInPlace (0 when not pinned).
  int64_t pinned_in_place_bytes() const { return pinned_.bytes(); }
  // Bytes of host copies the last PinInPlace moved off the heap into an arena.
  int64_t last_pin_moved_bytes() const { return last_pin_moved_bytes_; }

  ~HostWeights();
  HostWeights(const HostWeights&) = delete;
  HostWeights& operator=(const HostWeights&) = delete;

  // OK unless a host copy is still a view of a safetensors file that changed on disk since it was
  // mapped (SafetensorsFile::CheckUnchanged: truncated, rewritten in place, or damaged by a read
  // that faulted); then FAILED_PRECONDITION naming the file. Host copies in RAM (heap, pinned, a
  // converted dtype) are never affected. One stat() per distinct mapped file.
  absl::Status CheckSourceFiles() const;

 private:
  HostWeights() = default;
  Module* root_ = nullptr;  // The captured tree.
  std::vector<Entry> entries_;
  std::vector<Deferred> deferred_;
  // Module::AddAdjacentGroup groups of the captured tree as indices into entries_ (each entry in at
  // most one group; groups whose tensors differ in device dtype are kept, the copies just land
  // next to each other).
  std::vector<std::vector<size_t>> adjacent_;
  int64_t bytes_ = 0;
  int64_t parameter_count_ = 0;
  struct Arena;
  // Moves `entries` (heap host copies) into a new arena; RESOURCE_EXHAUSTED if it cannot be mapped.
  absl::Status MoveIntoArena(const std::vector<Entry*>& entries);
  // Allocates one device buffer for the entries of `group` (indices into entries_), enqueues their
  // copies on the copy stream side by side in group order and points their slots at them. On an
  // allocation failure nothing of this group is allocated and the status is returned.
  absl::Status EnqueueGroupCopies(DeviceBackend& backend, const std::vector<size_t>& group);
  // After a failed onload: waits for the copies already enqueued (nothing may still write what is
  // freed) and points every slot away from the device; returns `status`.
  absl::Status UndoOnload(DeviceBackend& backend, const absl::Status& status);

  DeviceBackend* pinned_by_ = nullptr;  // Set while pinned in place.
  HostPinLease pinned_;
  int64_t last_pin_moved_bytes_ = 0;
  std::vector<std::weak_ptr<Arena>> arenas_;  // Alive while a host copy (or a view of one) uses it.
};

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_HOST_WEIGHTS_H_
