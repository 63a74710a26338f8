// SlotRing: the ring of preallocated device buffers that streamed offload groups are copied into.
//
// (prefetch_depth + 1) slots (1 without a copy stream), each sized for the largest streamed group:
// device memory for streaming is fixed and predictable, and no buffer is allocated or freed per
// onload, so there are no cross-stream allocator hazards. Two events per slot guard its reuse:
// `copied` (completes once a group's bytes are in the slot: recorded by the store on the copy or the
// transform stream; the compute stream waits for it before the group's forward reads the slot) and
// `released` (recorded on the compute stream after the forward that read the slot; the stream that
// writes the slot next — the copy stream, or the transform stream for a store that writes slots only
// there — waits for it first). Which group a slot holds (its owner, an index chosen by the caller) is
// bookkeeping for the engine's prefetch; the ring never looks at group contents.
//
// The ring also holds the host store's device scratch (HostStore::device_scratch_bytes), allocated
// and freed with the slots, so that everything the component needs to stream is one allocation
// decision and one number (bytes()).
//
// The slots can be freed while the component is idle (Release) and allocated again before its
// next forward (Allocate), so that other components can use that memory in between.
//
// Thread-safety: not thread-safe; owned by a GroupOffloader and used by its device's worker only.
// Lifetime: the backend outlives the ring. Destroying the ring frees the buffers without waiting:
// call Release() (which synchronizes the device) first if queued work may still touch them.
//
//   SlotRing ring(backend, /*slots=*/2, /*slot_bytes=*/group_bytes);
//   RETURN_IF_ERROR(ring.Allocate());
//   ring.CopyStreamWaitReleased(s);  ring.SetCopied(s, store.CopyGroupToSlot(g, ring.buffer(s), ...));
//   ring.ComputeStreamWaitCopied(s); ... forward reads ring.buffer(s) ...;       ring.RecordReleased(s);
#ifndef STOWAGE_OFFLOAD_SLOT_RING_H_
#define STOWAGE_OFFLOAD_SLOT_RING_H_

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "offload/device_backend.h"

namespace stowage {

class SlotRing {
 public:
  static constexpr int kNoOwner = -1;

  // `slots` (>= 0) buffers of `slot_bytes` each and a scratch buffer of `scratch_bytes` (>= 0);
  // nothing is allocated until Allocate().
  SlotRing(DeviceBackend& backend, int64_t slots, int64_t slot_bytes, int64_t scratch_bytes = 0);
  SlotRing(const SlotRing&) = delete;
  SlotRing& operator=(const SlotRing&) = delete;

  int64_t size() const { return static_cast<int64_t>(slots_.size()); }
  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t scratch_bytes() const { return scratch_bytes_; }
  // Device bytes of all slots and the scratch (held while allocated()).
  int64_t bytes() const { return size() * slot_bytes_ + scratch_bytes_; }
  bool allocated() const { return allocated_; }

  // Allocates every slot's buffer (from the compute stream's pool: the caller makes the copy stream
  // wait for compute work queued before, which may have freed that memory). All or none: on
  // failure (for example a device out-of-memory status) no slot keeps a buffer. No-op if allocated.
  absl::Status Allocate();
  // Synchronizes the device, then frees the buffers and forgets every owner and event. No-op when
  // not allocated.
  void Release();

  // Slot `s` (0 <= s < size()) while allocated.
  const at::Tensor& buffer(int64_t s) const { return slots_[static_cast<size_t>(s)].buffer; }
  // The store's scratch while allocated (undefined when scratch_bytes() is 0).
  const at::Tensor& scratch() const { return scratch_; }
  int owner(int64_t s) const { return slots_[static_cast<size_t>(s)].owner; }
  void set_owner(int64_t s, int owner) { slots_[static_cast<size_t>(s)].owner = owner; }

  // Copy-stream work issued next waits until the compute that last read slot `s` is done.
  void CopyStreamWaitReleased(int64_t s);
  // The same for transform-stream work (a store that writes slots only there:
  // HostStore::WritesSlotOnTransformStream).
  void TransformStreamWaitReleased(int64_t s);
  // After enqueuing a copy into slot `s`: `copied` completes once the slot holds it (the event
  // HostStore::CopyGroupToSlot returns).
  void SetCopied(int64_t s, std::unique_ptr<DeviceEvent> copied);
  // Compute-stream work issued next waits for the last copy into slot `s` (which must have one).
  void ComputeStreamWaitCopied(int64_t s);
  // After enqueuing the compute that reads slot `s`: marks it on the compute stream.
  void RecordReleased(int64_t s);

 private:
  struct Slot {
    at::Tensor buffer;
    int owner = kNoOwner;
    std::unique_ptr<DeviceEvent> copied;
    std::unique_ptr<DeviceEvent> released;
  };
  DeviceBackend* backend_;
  int64_t slot_bytes_;
  int64_t scratch_bytes_;
  std::vector<Slot> slots_;
  at::Tensor scratch_;
  bool allocated_ = false;
};

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_SLOT_RING_H_
