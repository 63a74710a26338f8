#include "offload/slot_ring.h"

#include <utility>

namespace stowage {

SlotRing::SlotRing(DeviceBackend& backend, int64_t slots, int64_t slot_bytes, int64_t scratch_bytes)
    : backend_(&backend), slot_bytes_(slot_bytes), scratch_bytes_(scratch_bytes), slots_(static_cast<size_t>(slots)) {}

absl::Status SlotRing::Allocate() {
  if (allocated_) return absl::OkStatus();
  for (Slot& slot : slots_) {
    absl::StatusOr<at::Tensor> buffer = backend_->AllocateBytes(slot_bytes_);
    if (!buffer.ok()) {
      for (Slot& s : slots_) s.buffer = at::Tensor();
      return buffer.status();
    }
    slot.buffer = *std::move(buffer);
  }
  if (scratch_bytes_ > 0) {
    absl::StatusOr<at::Tensor> scratch = backend_->AllocateBytes(scratch_bytes_);
    if (!scratch.ok()) {
      for (Slot& s : slots_) s.buffer = at::Tensor();
      return scratch.status();
    }
    scratch_ = *std::move(scratch);
  }
  allocated_ = true;
  return absl::OkStatus();
}

void SlotRing::Release() {
  if (!allocated_) return;
  backend_->Synchronize();  // No copy or compute may still touch the buffers.
  for (Slot& slot : slots_) {
    slot.owner = kNoOwner;
    slot.copied.reset();
    slot.released.reset();
    slot.buffer = at::Tensor();
  }
  scratch_ = at::Tensor();
  allocated_ = false;
}

void SlotRing::CopyStreamWaitReleased(int64_t s) {
  Slot& slot = slots_[static_cast<size_t>(s)];
  if (slot.released) backend_->CopyStreamWait(*slot.released);
}

void SlotRing::TransformStreamWaitReleased(int64_t s) {
  Slot& slot = slots_[static_cast<size_t>(s)];
  if (slot.released) backend_->TransformStreamWait(*slot.released);
}

void SlotRing::SetCopied(int64_t s, std::unique_ptr<DeviceEvent> copied) {
  slots_[static_cast<size_t>(s)].copied = std::move(copied);
}

void SlotRing::ComputeStreamWaitCopied(int64_t s) {
  backend_->ComputeStreamWait(*slots_[static_cast<size_t>(s)].copied);
}

void SlotRing::RecordReleased(int64_t s) {
  slots_[static_cast<size_t>(s)].released = backend_->RecordOnComputeStream();
}

}  // namespace stowage
