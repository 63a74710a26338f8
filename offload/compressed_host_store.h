// CompressedHostStore (target kPinnedHost with a compress format): the groups that are not resident
// are kept in pinned host memory as 8-bit or 4-bit weights with their scales
// (offload/compression.h), copied compressed into the device scratch and widened there into the
// slot, in the compute dtype, on the transform stream (DeviceBackend::EnqueueOnTransformStream):
//
//   copy stream       [copy g0 → area 0][copy g1 → area 1][wait widen g0][copy g2 → area 0] ...
//   transform stream          [wait][widen g0 → slot]  [wait][widen g1 → slot]
//   compute stream                            [wait][forward g0]        [wait][forward g1]
//
// so copy(n+1) ∥ widen(n) ∥ compute(n−1): with options.scratch_buffers = 2 the scratch holds two
// areas for the groups' packed bytes, used in turn; the copy into an area waits for the
// widening that last read it (an event per area). With one area every copy waits for the last
// widening. The returned event is recorded on the transform stream after the widening.
// For a group with compressed weights only the transform stream writes the slot
// (WritesSlotOnTransformStream): the engine makes it, not the copy stream, wait for the slot's
// release, so a group's bytes cross the link while the compute still reads the slot they will be
// widened into (a copy that waited for the release as well had one compute period for its copy and
// its widening together: with FP8 compute, whose int4 copy takes ~0.87 of the compute's time on an
// H100, the compute stream waited ~14 ms a step). A group with nothing compressed is copied straight
// into its slot on the copy stream, after the release, and needs no area.
//
// Per group, one pinned buffer in the order the device needs it:
//   [ q_0 | scale_0 | q_1 | scale_1 | ... ]  the compressed tensors (rank >= 2, floating), each part
//                                            aligned to 256;
//   [ t_a | t_b | ... ]                      the other tensors (biases, norms) in their compute
//                                            dtype, each aligned to 256;
// in a group with compressed tensors both parts are copied into a scratch area at these offsets (the
// compressed part in one DMA; the others in one too where the planner put them after the compressed
// ones in the slot, laid out there as in the slot) and the other tensors from there to their slot
// offsets on the transform stream beside the widening. (Widening each tensor as soon as its bytes
// landed instead of the whole group at once, and the transform stream at the highest priority,
// changed nothing on an H100 — bench/results/streaming_s34: the compute waited on copies the host
// issued late, not on the widening.)
// A device copy of that buffer (CopyGroupToSlotVia: the spare-room cache keeping a group as it
// crossed the link, at its compressed size) replaces the scratch area and the DMAs: the widening
// reads the compressed part from the copy and the other tensors are copied from it on the transform
// stream, so a cached group costs a widening and no link traffic.
// The scratch is [fp8 tables and int32 index chunk, or int4's nibbles and fp32 table | scratch_buffers
// areas of the largest packed buffer of a group with compressed tensors]; the tables are uploaded by InitScratch whenever the engine
// (re)allocates the scratch. The fixed part is written only by widenings, which the transform
// stream runs one at a time.
//
// Exactness: after the copy the slot holds, for every compressed tensor, Dequantize(q, scale) in
// the compute dtype bit for bit, and every other tensor exactly. Resident groups are copied once
// from the original host copies, uncompressed (exact). The original host copies stay the source
// of truth (HostWeights: for resident groups and for disabling group offload later); pages of a
// safetensors mapping are dropped from RSS after quantizing, so host RAM holds the 8-bit copy plus
// whatever originals live on the heap.
//
// Quantizing runs at Create on the backend's device when it is a GPU (LoadQuantizer: a tensor's
// rows in chunks, read by options.staging_threads threads into pinned staging, quantized on the
// device and written straight into the pinned group, so the device lends well under a GB while it
// runs and the host holds no temporaries), else on the host. Weights already
// quantized (an 8-bit checkpoint, compressed_safetensors.h) are taken from options.prequantized by
// slot path instead of quantizing the host copy.
//
// Thread-safety and lifetime: as HostStore. Work the store enqueued refers to the store: the
// destructor synchronizes the device first.
#ifndef STOWAGE_OFFLOAD_COMPRESSED_HOST_STORE_H_
#define STOWAGE_OFFLOAD_COMPRESSED_HOST_STORE_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "offload/compression.h"
#include "offload/host_store.h"

namespace stowage {

class CompressedHostStore final : public HostStore {
 public:
  // The scratch `format` needs per tensor of `weights` and once (for the planner).
  static StoreScratch PlanScratch(CompressFormat format, HostWeights& weights);

  // Quantizes (or takes from options.prequantized) the tensors of every group that is not
  // resident and packs them into pinned memory. INVALID_ARGUMENT for a prequantized tensor that
  // does not match its host copy (shape, format, scale length); errors of pinned allocation.
  static absl::StatusOr<std::unique_ptr<HostStore>> Create(const HostStoreOptions& options,
                                                           const std::vector<PlannedGroup>& groups,
                                                           HostWeights& weights, DeviceBackend& backend);
  ~CompressedHostStore() override;

  bool WritesSlotOnTransformStream(int group) const override;
  std::unique_ptr<DeviceEvent> CopyGroupToSlot(int group, const at::Tensor& slot, const at::Tensor& scratch) override;
  // A streamed group's packed pinned buffer, as it is ([compressed part | other tensors]).
  int64_t device_copy_bytes(int group) const override;
  int64_t link_bytes(int group) const override;
  std::unique_ptr<DeviceEvent> CopyGroupToSlotVia(int group, const at::Tensor& slot, const at::Tensor& scratch,
                                                  const at::Tensor& copy, bool fill) override;
  HostStoreStats stats() const override { return stats_; }
  int64_t device_scratch_bytes() const override { return scratch_bytes_; }
  void InitScratch(const at::Tensor& scratch) override;

 private:
  struct Tensor8 {
    bool compressed = false;
    int64_t slot_offset = 0;  // In the group's planned layout.
    int64_t bytes = 0;        // In the compute dtype (in the slot).
    at::ScalarType dtype = at::kFloat;
    std::vector<int64_t> sizes;
    int64_t q_offset = 0;      // Compressed: in the group's compressed part (= scratch region).
    int64_t scale_offset = 0;
    QuantLayout layout;        // Compressed: how q and the scales are stored.
    int64_t host_offset = 0;   // Uncompressed: in the packed buffer.
  };
  struct Group8 {
    at::Tensor packed;               // Pinned; undefined for resident groups.
    int64_t compressed_bytes = 0;    // The compressed part (0: nothing to widen, no area).
    int64_t packed_bytes = 0;        // Of `packed`: the compressed part, then the other tensors.
    std::vector<Tensor8> tensors;
    // > 0: the other tensors lie in the slot as one run from others_slot_offset, with no compressed
    // tensor among them, and the packed buffer holds that run as the slot does, right after the
    // compressed part (one DMA, one device copy); 0: each at its own host_offset.
    int64_t others_slot_offset = 0;
    int64_t others_bytes = 0;
    int64_t link_bytes = 0;  // What a copy of the group moves over the link (the bytes its DMAs carry).
    // The widenings' views (a target per tensor, undefined for the others; the others' run in the slot
    // and in the source), made once per (slot, source) address pair the group is widened between and
    // kept, so that a widening makes no tensors (nine tensor ops a weight otherwise). They do not own
    // their memory (ViewsOf says why that is safe). At most kViewSets (then all are dropped).
    struct ViewSet {
      const void* slot = nullptr;
      const void* source = nullptr;
      std::vector<WidenTarget> targets;
      at::Tensor others_to, others_from;
    };
    mutable std::vector<ViewSet> view_sets;  // Mutable: kept by the (const) widenings.
  };
  // Enough for every (slot, area) pair of a deep ring (5 slots x 2 areas) and a few device buffers.
  static constexpr size_t kViewSets = 16;
  // Group `group`'s views between `slot` and `source` (made on first use).
  const Group8::ViewSet& ViewsOf(int group, const at::Tensor& slot, const at::Tensor& source) const;

  CompressedHostStore(DeviceBackend& backend, CompressFormat format, std::vector<StoreGroup> groups)
      : backend_(&backend), format_(format), groups_(std::move(groups)), groups8_(groups_.size()) {}
  // Enqueues on the copy stream the DMAs of group `group`'s other tensors into `to` (a scratch area or
  // device copy holding the packed buffer's layout), at their packed offsets.
  void CopyOthers(int group, const at::Tensor& to);
  // Enqueues the DMAs that put group `group`'s packed buffer (it has compressed tensors) at the start
  // of `to` (a scratch area or a device copy of the buffer's size) and, on the transform stream, the
  // wait for them and the widening from `to` into `slot`.
  void CopyAndWiden(int group, const at::Tensor& slot, const at::Tensor& scratch, const at::Tensor& to);
  // Runs on the transform stream: widens group `group`'s compressed tensors from `area` (a scratch
  // area or a device copy holding its packed buffer) into `slot` and copies its other tensors from it.
  void Widen(int group, const at::Tensor& slot, const at::Tensor& scratch, const at::Tensor& area) const;
  WidenScratch WidenViews(const at::Tensor& scratch) const;

  DeviceBackend* backend_;
  CompressFormat format_;
  std::vector<StoreGroup> groups_;
  std::vector<Group8> groups8_;
  int64_t fixed_bytes_ = 0;     // Start of the group areas in the scratch.
  int64_t area_bytes_ = 0;      // One area: the largest packed buffer of a group with compressed tensors.
  int areas_ = 1;               // options.scratch_buffers.
  bool widen_per_group_ = false;  // options.widen_per_group.
  int next_area_ = 0;           // The area the next copy uses.
  std::unique_ptr<DeviceEvent> area_free_[2];  // Transform stream: the last widening from each area.
  int64_t scratch_bytes_ = 0;   // 0 when no copied group has a compressed tensor.
  // fp8: offsets of the tables in the scratch (-1: dtype absent), the index chunk, and the tables
  // packed in pinned memory as InitScratch uploads them.
  int64_t table_offset_[3] = {-1, -1, -1};  // fp32, bf16, fp16.
  int64_t index_offset_ = 0;
  int64_t index_elements_ = 0;
  // int4: the nibble buffer at the start of the scratch (the fixed part), bytes; its fp32 table of
  // the scale codes follows (table_offset_[0]).
  int64_t nibble_bytes_ = 0;
  at::Tensor tables_;
  int64_t tables_at_ = 0;  // Where tables_ goes in the scratch.
  HostStoreStats stats_;
};

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_COMPRESSED_HOST_STORE_H_
