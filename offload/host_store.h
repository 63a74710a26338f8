// HostStore: where an offloaded component's weights live on the host, and how one group of them
// reaches a device buffer.
//
// One class per host-side target, all behind this interface, created once per GroupOffloader::Apply
// for the planned groups (offload/group_plan.h) by CreateHostStore (offload/host_store_factory.h),
// the only place that knows the targets:
//   PinnedHostStore         (pinned_host_store.h)          a packed pinned copy, one DMA per group.
//   PinnedInPlaceHostStore  (pinned_in_place_host_store.h) the pageable copy or the safetensors
//                                                          mapping registered with the device.
//   StagedHostStore         (staged_host_store.h)          pageable, through a ring of pinned
//                                                          staging buffers and the memcpy pool.
//   DiskHostStore           (disk_host_store.h)            one safetensors file per group, staged.
//   CompressedHostStore     (compressed_host_store.h)      8-bit weights + per-channel scales in
//                                                          pinned memory, widened on the device.
// The engine (group planning, the slot ring, prefetch scheduling) never learns which one it has.
//
// Contract of CopyGroupToSlot(group, slot, scratch):
//   - `scratch` is a device byte buffer of device_scratch_bytes() that the engine allocates with
//     the slot ring and counts in the component's working set (undefined when the store needs
//     none); the store owns its contents between calls. After every (re)allocation the engine calls
//     InitScratch(scratch) once, before the first copy that uses it.
//   - `slot` is a device buffer of at least the group's planned bytes (a ring slot, or a resident
//     or always-on group's own buffer). Once the event the call returns has completed, the slot
//     holds every tensor of the group in its compute dtype at its planned offset
//     (PlannedTensor::offset); the bytes between tensors are unspecified.
//   - How the bytes get there is the store's business: how many DMAs, from which host memory,
//     through which intermediate buffers, and how many bytes cross the link. A compressed store can
//     move fewer bytes than the slot holds (8-bit weights and their scales into a device scratch
//     area, widened into the slot by work it enqueues on the transform stream, so that one
//     group's widening overlaps the next group's copy). The store orders its own use of the
//     scratch between the two streams.
//   - Copies go on the backend's copy stream, device-side transforms of copied bytes on its
//     transform stream (after waiting for the copy they read). The engine has already made the stream
//     that writes the slot (the copy stream, or the transform stream where
//     WritesSlotOnTransformStream) wait until the slot may be overwritten; it makes compute wait for
//     the returned event.
//     The call may block the host only on the store's own resources (a staging buffer whose
//     previous DMA has not finished).
//   - One call per group copy: implementations loop over the group's tensors themselves; no
//     virtual call or heap allocation per tensor beyond what the copy itself needs.
//
// Host memory: creating a store may move the host copies (HostWeights::ReplaceHost) into memory it
// owns (pinned chunks, file mappings); the tensors' shapes and dtypes never change. stats() reports
// what the store holds or did; the engine adds it to GroupOffloadStats.
//
// Thread-safety: not thread-safe. A store belongs to one GroupOffloader and is used by its device's
// worker thread only (the memcpy pool's threads are internal to one call).
// Lifetime: the backend and the HostWeights outlive the store. Destroying the store releases what it
// holds on the host (unregisters memory pinned in place, after synchronizing the device; frees
// staging buffers); host copies it moved stay valid, owned by HostWeights.
#ifndef STOWAGE_OFFLOAD_HOST_STORE_H_
#define STOWAGE_OFFLOAD_HOST_STORE_H_

#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "offload/compression.h"
#include "offload/device_backend.h"
#include "offload/group_plan.h"
#include "offload/host_weights.h"

namespace stowage {

enum class OffloadTarget { kPinnedHost, kPageableHost, kDisk };

struct HostStoreOptions {
  // Names the model in errors, and its folder under disk_dir.
  std::string component;
  OffloadTarget target = OffloadTarget::kPinnedHost;
  // kPageableHost: register the host copy in place; when refused, stage instead.
  bool pin_in_place = true;
  // kDisk: directory for the per-group safetensors files (created if missing).
  std::string disk_dir;
  // kPageableHost (staged) / kDisk: the staging ring and the memcpy pool's threads (>= 1, the
  // caller included).
  int64_t staging_buffer_bytes = int64_t{64} << 20;
  int staging_buffers = 2;
  int staging_threads = 8;
  // kPinnedHost only: keep the streamed and always-on groups as 8-bit weights with per-channel
  // scales (CompressedHostStore); resident groups stay exact. kNone: uncompressed.
  CompressFormat compress = CompressFormat::kNone;
  // With compress: 8-bit weights already quantized (an 8-bit checkpoint), by full slot path, used
  // instead of quantizing those host copies. Their format must be `compress`.
  std::shared_ptr<const PrequantizedWeights> prequantized;
  // With compress: areas for a group's packed bytes in the device scratch (1 or 2). Two let
  // one group's widening (transform stream) overlap the next group's copy (copy stream).
  int scratch_buffers = 1;
  // With compress: GroupOffloadOptions::widen_per_group.
  bool widen_per_group = false;
  // With compress: GroupOffloadOptions::quantize_chunk_elements.
  int64_t quantize_chunk_elements = kQuantizeChunkElements;
};

// What a store contributes to GroupOffloadStats (same meanings and names there).
struct HostStoreStats {
  int64_t pinned_host_bytes = 0;       // Pinned host memory allocated for the groups.
  int64_t mapped_bytes_released = 0;   // Safetensors pages dropped from RSS after copying them.
  int64_t pinned_in_place_bytes = 0;   // Host memory registered in place (page-rounded).
  std::string pin_in_place_error;      // Why registering in place was refused, if it was.
  int64_t disk_files_written = 0;
  int64_t disk_files_reused = 0;
  // Host→device bytes of one copy of every group that is not resident (what a forward moves when
  // each streamed and always-on group onloads once): packed bytes for the pinned store, tensor
  // bytes for the others, 8-bit data + scales + uncompressed tensors for the compressed store.
  int64_t bytes_per_forward = 0;
  // CompressedHostStore: pinned host bytes of the 8-bit groups (data, scales, 1-D tensors).
  int64_t compressed_host_bytes = 0;
  // CompressedHostStore: weights quantized on the host at load because the device refused them
  // (out of memory under a budget); the rest were quantized on the device (or, CPU, on the host).
  int64_t host_quantized_fallbacks = 0;
  // CompressedHostStore: deferred FP8 weights (HostWeights::deferred) whose compressed copy was made
  // from their source in one pass, their FP8 host copy never written.
  int64_t one_pass_fp8_weights = 0;
  // At Create: seconds the pinned allocations took (on a thread of their own, one group or chunk
  // ahead, so beside the filling: CompressedHostStore and PinnedHostStore), and seconds the
  // building thread spent quantizing (CompressedHostStore: reading the sources, and waiting for the
  // device at the end).
  double prepare_pin_alloc_s = 0;
  double prepare_quantize_s = 0;
};

class HostStore {
 public:
  virtual ~HostStore() = default;

  // Enqueues on the copy stream what makes `slot` hold group `group` (an index into the planned
  // groups the store was created for). See the contract above.
  // Returns the event the group's readers wait for (on the copy stream, or on the transform stream
  // when the store transforms the bytes there).
  virtual std::unique_ptr<DeviceEvent> CopyGroupToSlot(int group, const at::Tensor& slot,
                                                       const at::Tensor& scratch) = 0;

  virtual HostStoreStats stats() const = 0;

  // Whether CopyGroupToSlot and CopyGroupToSlotVia write group `group`'s slot only on the transform
  // stream (their copy-stream work lands elsewhere: the compressed store's scratch, for a group with
  // compressed weights). The engine then makes the transform stream wait for the slot's release
  // instead of the copy stream, so the group's bytes cross the link while the compute still reads the
  // slot. false: the copy stream writes the slot (or orders the work that does) and waits for the release.
  virtual bool WritesSlotOnTransformStream(int group) const {
    (void)group;
    return false;
  }

  // A device copy of a group's host bytes (the spare-room cache of a store whose groups cross the
  // link in another form than the slot holds: the compressed store). Its bytes (0: the store keeps
  // none; the engine then caches the group as the slot holds it).
  virtual int64_t device_copy_bytes(int group) const {
    (void)group;
    return 0;
  }
  // The bytes CopyGroupToSlot moves across the link for `group` (0: the planned group's bytes).
  virtual int64_t link_bytes(int group) const {
    (void)group;
    return 0;
  }
  // As CopyGroupToSlot, through `copy` (a device buffer of device_copy_bytes(group) bytes): with
  // `fill`, the group's host bytes are first copied into `copy` on the copy stream (the same
  // link_bytes the plain call moves); then the slot is made from `copy` on the device, without crossing the link.
  // Without `fill`, `copy` holds what an earlier filling call put there. The work enqueued keeps
  // `copy` referenced until it has run. Only for groups with device_copy_bytes(group) > 0.
  virtual std::unique_ptr<DeviceEvent> CopyGroupToSlotVia(int group, const at::Tensor& slot, const at::Tensor& scratch,
                                                          const at::Tensor& copy, bool fill) {
    (void)copy;
    (void)fill;
    return CopyGroupToSlot(group, slot, scratch);
  }

  // Device bytes of scratch the copies need (0 for every store but the compressed one). Equals the
  // planned scratch (GroupPlan::scratch_bytes) for the groups the store was created for.
  virtual int64_t device_scratch_bytes() const { return 0; }
  // Enqueues on the copy stream what a freshly allocated `scratch` needs before the first copy
  // (e.g. decode tables). Called by the engine after each allocation of the scratch.
  virtual void InitScratch(const at::Tensor& scratch) { (void)scratch; }
};

// --- Building blocks for implementations ---------------------------------------------------------

// A planned group as a store sees it: the host entries of its tensors and their layout.
struct StoreTensor {
  HostWeights::Entry* entry;  // Host copy (entry->host), module and slot (for names).
  int64_t offset;             // Within the group's layout.
};
struct StoreGroup {
  std::string name;
  std::vector<StoreTensor> tensors;
  int64_t bytes = 0;      // Planned (packed) bytes.
  bool resident = false;  // Copied once at Apply and kept on the device.
};
// Device scratch a store needs per host tensor (weights.entries() order) and once (see
// group_plan.h "Store scratch").
struct StoreScratch {
  std::vector<int64_t> tensor_bytes;
  std::vector<int64_t> carried_bytes;  // PlanTensor::carried_scratch_bytes per entry (empty: none).
  int64_t fixed_bytes = 0;
};

// `planned` resolved against `weights` (PlannedTensor::index indexes weights.entries()).
std::vector<StoreGroup> ResolveGroups(const std::vector<PlannedGroup>& planned, HostWeights& weights);

// Bytes of the host copies of the groups that are not resident.
int64_t NonResidentTensorBytes(const std::vector<StoreGroup>& groups);

// A pinned host buffer and the seconds its allocation took.
struct TimedAllocation {
  absl::StatusOr<at::Tensor> buffer;
  double seconds = 0;
};
// backend.AllocatePinnedHost(bytes), started on a thread of its own so that a store fills one
// buffer while the next is allocated (pinning goes page by page); where no thread is to be had,
// get() allocates. The backend must outlive the future.
std::future<TimedAllocation> AllocatePinnedAhead(DeviceBackend& backend, int64_t bytes);

// Raw bytes of a contiguous CPU tensor, without ownership (the caller keeps `t` alive).
at::Tensor BytesOf(const at::Tensor& t);

// One DMA per tensor, straight from its host copy (pinned, registered, or pageable: then the
// backend copies synchronously) to its offset in `slot`; returns the copy-stream event after them.
std::unique_ptr<DeviceEvent> CopyTensorsDirect(DeviceBackend& backend, const StoreGroup& group,
                                               const at::Tensor& slot);

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_HOST_STORE_H_
