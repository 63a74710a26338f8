// Group offloading: a component's weights live on the host; groups of layers are copied to the
// device just before they run and dropped right after, the next groups prefetched on the copy
// stream while the current one computes.
//
// GroupOffloader is the engine; it is composed of parts that each have their own file and contract:
//   offload/group_plan.h    which tensors form which group, each group's device layout, and which
//                           groups a budget keeps resident (pure functions, no device);
//   offload/host_store.h    where the weights live on the host and how one group reaches a device
//                           buffer: one class per `target`, created by CreateHostStore
//                           (offload/host_store_factory.h), the engine never names one;
//   offload/slot_ring.h     the ring of preallocated device slots and the events guarding reuse;
//   offload/memcpy_pool.h   the threads that stage pageable memory (used by the staged stores).
// The engine itself owns the hooks, the recorded execution order, prefetch scheduling and stats.
//
// Groups
//   block_level: every `num_blocks_per_group` consecutive children of each block list (the
//     ModuleLists nearest the root (its ModuleList children, or else those of the first level down
//     that has any: T5's encoder.block, CLIP's text_model.encoder.layers), or the modules named in `block_modules`, e.g. a VAE's
//     "decoder.up_blocks") form a group; everything outside the blocks forms one group that is on
//     the device for the whole forward of the root.
//   leaf_level: every leaf layer is a group; tensors owned by non-leaf modules form
//     parameter-only groups, on the device for the whole forward of their owner.
//
// Device memory is fixed and predictable: streamed groups land in a ring of (prefetch_depth + 1)
// preallocated slots (1 without streams) sized for the largest streamed group; an event guards
// each slot's reuse. Offloading never copies device→host: slots just stop being pointed at.
//
// Host side (`target`): kPinnedHost packs each group contiguously into pinned memory (the pageable
// originals are released, so the weights live once, in pinned RAM; one DMA per group);
// kPageableHost keeps them pageable, pinned in place when the host allows it (one DMA per tensor)
// and otherwise staged through a fixed ring of pinned buffers (low CPU RAM; no pinning per
// onload); kDisk writes one safetensors file per group (reused while the weights are unchanged,
// rewritten when stale), maps it, and stages from the mapping.
//
// Order: the first forward records the order in which groups run; afterwards, when group i
// onloads, groups i+1..i+depth are copied ahead. A group reached out of order (a conditional
// module, a second call) onloads synchronously and stays correct.
//
// Compression (`compress`, target kPinnedHost only): the streamed and always-on groups are kept on
// the host as 8-bit weights with per-output-channel scales (int8, or fp8 e4m3 bits), copied as 8-bit
// into a device scratch area and widened into the slot in the compute dtype on the copy stream
// (offload/compressed_host_store.h): about half the bytes of bf16 per forward, a quarter of fp32,
// at a small, bounded error. Resident groups are copied once and stay exact. The scratch is part of
// the ring (allocated and released with it) and of the working set.
//
// Budget: with budget_bytes > 0 the planner keeps resident the groups that minimise the bytes
// streamed per forward, subject to resident + always-on + slots <= budget, and streams the rest.
//
// Spare-room cache (SetCacheAllowance): device memory the budget has free for now (placement
// grants it before a run, PlacementManager::set_streamed_group_cache) keeps streamed groups on the
// device between forwards. A streamed group leaving its slot after its forward is copied, device
// to device, into a buffer of its own while the cache has room under the allowance; its next
// onloads point at that buffer and copy nothing (prefetch skips it). A compressed component whose
// streamed groups do not all fit widened under the allowance keeps them as they cross the link
// instead (HostStore::CopyGroupToSlotVia: the copy of a group lands in a buffer the cache keeps,
// and its next onloads widen from there into the slot without a copy over the link), so an int4
// component keeps about 1.6× (FP8 compute) to 3× (bf16) as many groups in the same room. The cache
// outlives the slots (ReleaseSlots leaves it) and shrinks to a smaller allowance at once
// (SetCacheAllowance: placement lowers it when another component needs the room). Either way the
// slot holds the same bytes as a copy from the host would, so outputs are the same with or without
// it.
//
// Ownership (thread-safety): a GroupOffloader is device state. Only the device's worker thread
// (runtime/device_worker.h) may Apply, destroy (Remove), ReleaseSlots, or run forwards of the
// module through it, one at a time, and only it calls the accessors (stats(), device_bytes(),
// holds_slots(), bytes_needed_to_run()). Readers on other threads (admin handlers, the metrics
// scrape) never touch it: they read a snapshot of its stats that the worker publishes after each
// change. Nothing in here takes a lock.
// Lifetime: the module tree, its HostWeights and the backend outlive the offloader; destroying it
// removes the hooks and frees its device and pinned memory (see ~GroupOffloader).
//
//   GroupOffloadOptions options;
//   options.use_stream = true;
//   ASSIGN_OR_RETURN(std::unique_ptr<GroupOffloader> offloader,
//                    GroupOffloader::Apply("transformer", model, weights, backend, options));
//   model.Forward(x);  // Groups stream in and out around each block's forward.
#ifndef STOWAGE_OFFLOAD_GROUP_OFFLOAD_H_
#define STOWAGE_OFFLOAD_GROUP_OFFLOAD_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "offload/device_backend.h"
#include "offload/group_plan.h"
#include "offload/host_store.h"
#include "offload/host_weights.h"
#include "offload/module.h"

namespace stowage {


struct GroupOffloadOptions {
  OffloadType type = OffloadType::kBlockLevel;
  // block_level: consecutive blocks per group (>= 1).
  int num_blocks_per_group = 1;
  // block_level: dotted paths of the modules whose children are the blocks. Empty: the ModuleLists
  // nearest the root (its ModuleList children, or else the first level down that has any).
  std::vector<std::string> block_modules;
  OffloadTarget target = OffloadTarget::kPinnedHost;
  // Prefetch on the backend's copy stream (needs a backend with streams).
  bool use_stream = false;
  // Groups copied ahead of the running one when use_stream (>= 1). 0: chosen by Apply — 4 at leaf
  // level without a budget (leaf groups are small: one copy ahead cannot hide its latency; H200:
  // 1.30x the PCIe floor at depth 1, 1.01x at depth 4, bench/results/side_by_side_h200); 4 at block
  // level with `compress` when neither this budget nor the device's (DeviceBackend::MemoryBudget) is
  // set (the first blocks' copies then run during the previous step's last blocks — Z-Image's refiners
  // compute far less than their copies take: FP8 int4 1.109x -> 1.075x resident FP8, bf16 int4 1.060x
  // -> 1.051x on an H100, bench/results/streaming_s34) — unless the component streams no more groups
  // than those slots or the three extra slots would take more than an eighth of the device's free
  // memory; else 1 (a budget sized for depth 1 would not hold the extra slots, and under a device
  // budget they would take the spare-room cache's room).
  int prefetch_depth = 1;
  // kDisk: directory for the per-group safetensors files (created if missing).
  std::string disk_dir;
  // Device bytes this component may use; 0 streams every group.
  int64_t budget_bytes = 0;
  // kPageableHost / kDisk: staging ring of pinned buffers.
  int64_t staging_buffer_bytes = int64_t{64} << 20;
  int staging_buffers = 2;
  // kPageableHost / kDisk: threads copying pageable memory into the staging buffers (>= 1).
  int staging_threads = 8;
  // kPageableHost: pin the host copy where it already is (heap, or the read-only mapping of a
  // safetensors file) with the backend's RegisterHostMemory, so copies run at full pinned speed with
  // no second copy in RAM. When the host refuses (for example a low RLIMIT_MEMLOCK) the groups are
  // staged through the ring instead (stats say which). False: always stage.
  bool pin_in_place = true;
  // 8-bit transfer of the groups that are not resident (see "Compression" above); kNone: off.
  CompressFormat compress = CompressFormat::kNone;
  // Placement chooses `compress` under its host memory budget (PlacementManager::EnableGroupOffload
  // resolves it before Apply; Apply refuses options that still have it set).
  bool choose_compress = false;
  // With compress: weights already quantized (an 8-bit checkpoint, compressed_safetensors.h), by
  // full slot path; the others are quantized at Apply.
  std::shared_ptr<const PrequantizedWeights> prequantized;
  // With compress, on CUDA: widen a group's weights in shared kernel launches (up to 16 weights a
  // launch, WidenAllInto) instead of one launch each; the same bytes. Off until measured
  // (offload_bench's rows ending in "_wg", compute_bench's modes ending in "_wg").
  bool widen_per_group = false;
  // With compress, at Apply: values of a weight quantized at a time (LoadQuantizer's chunk, >= 1024):
  // its two pinned staging halves hold that many bf16 values each, and they, with the chunk of source
  // pages being read, are what preparing holds in RAM beyond the compressed copy (~96 MB at the
  // default 16 Mi values). Smaller chunks hold less, in more launches.
  int64_t quantize_chunk_elements = kQuantizeChunkElements;
};

struct GroupOffloadStats {
  int groups = 0;             // All groups, always-on ones included.
  int streamed_groups = 0;    // Groups that move through the slot ring.
  int resident_groups = 0;    // Kept on the device by the budget planner.
  int64_t slots = 0;          // Ring slots.
  int64_t slot_bytes = 0;     // Bytes of one slot (the largest streamed group).
  int64_t always_on_bytes = 0;  // Groups on the device for their owner's whole forward.
  int64_t resident_bytes = 0;
  int64_t streamed_bytes = 0;   // Bytes of the streamed groups (copied once per forward).
  int64_t scratch_bytes = 0;      // The host store's device scratch (compressed: 8-bit landing area).
  // slots * slot_bytes + always_on_bytes + resident_bytes + scratch_bytes.
  int64_t working_set_bytes = 0;
  // Counters since Apply.
  int64_t forwards = 0;
  int64_t onloads = 0;         // Ring onloads.
  int64_t sync_onloads = 0;    // Ring onloads not satisfied by a prefetch.
  int64_t prefetches = 0;      // Copies issued ahead of need.
  int64_t disk_files_written = 0;
  int64_t disk_files_reused = 0;
  int64_t slot_releases = 0;   // ReleaseSlots calls that freed the ring.
  int64_t early_prefetches = 0;  // Copies issued by PrefetchNextForward (before the forward).
  int64_t prefetches_skipped_after_last = 0;  // Not issued: past a run's last forward (SkipPrefetchAfterNextForward).
  // kPinnedHost: bytes of safetensors mappings dropped from RSS after their copy into pinned memory,
  // and the pinned host bytes allocated for the groups (exactly their packed size: no slack).
  int64_t mapped_bytes_released = 0;
  int64_t pinned_host_bytes = 0;
  // kPageableHost: bytes of host memory pinned in place (page-rounded), 0 when staged; and why the
  // backend refused, if it did.
  int64_t pinned_in_place_bytes = 0;
  std::string pin_in_place_error;
  // Compression: "none", "int8" or "fp8_e4m3"; pinned host bytes of the 8-bit groups; and the
  // host→device bytes of one forward that copies each streamed and always-on group once (every
  // store reports the latter; uncompressed it is about streamed_bytes + always_on_bytes).
  std::string compress = "none";
  int64_t compressed_host_bytes = 0;
  int64_t host_quantized_fallbacks = 0;  // HostStoreStats::host_quantized_fallbacks.
  int64_t one_pass_fp8_weights = 0;      // HostStoreStats::one_pass_fp8_weights.
  double prepare_pin_alloc_s = 0;        // HostStoreStats::prepare_pin_alloc_s.
  double prepare_quantize_s = 0;         // HostStoreStats::prepare_quantize_s.
  int64_t bytes_per_forward = 0;
  // Spare-room cache: its allowance now, the groups and device bytes it holds now, the link bytes
  // of one forward those groups spare (of bytes_per_forward), onloads it served (no copy over the
  // link), the link bytes those onloads did not copy, and groups it took in since Apply.
  int64_t cache_allowance_bytes = 0;
  int cached_groups = 0;
  int64_t cache_bytes = 0;
  int64_t cache_link_bytes = 0;
  int64_t cache_hits = 0;
  int64_t cache_hit_bytes = 0;
  int64_t cache_fills = 0;
};

class GroupOffloader {
 public:
  // Installs group offloading on `root`, whose weights are `weights` (host copies; the slots may
  // point anywhere, they are repointed). `component` names the model in errors. Fails (and changes
  // nothing) when the module already has group offloading, streams are asked of a backend without
  // them, the budget is smaller than the smallest working set, or the disk path is unwritable.
  static absl::StatusOr<std::unique_ptr<GroupOffloader>> Apply(const std::string& component,
                                                               Module& root, HostWeights& weights,
                                                               DeviceBackend& backend,
                                                               const GroupOffloadOptions& options);
  // Removes the hooks, frees the device memory; every tensor slot is left offloaded (undefined),
  // as a registered, non-resident component's are.
  ~GroupOffloader();

  const GroupOffloadOptions& options() const { return options_; }
  GroupOffloadStats stats() const;

  // Device bytes held now: the ring's slots and the store's scratch while allocated, the resident
  // groups and the spare-room cache.
  int64_t device_bytes() const;
  // True while the ring's slots are allocated (what ReleaseSlots would free).
  bool holds_slots() const;
  // Frees the ring's slots while the component is idle, so that other components can use that
  // memory; its next forward allocates them again (a device out-of-memory error there is thrown as
  // DeviceOutOfMemory, like any onload). The spare-room cache stays. Does nothing during a forward.
  // Returns the bytes freed.
  int64_t ReleaseSlots();
  // The spare-room cache may hold up to `bytes` (>= 0; 0: none, the default) from now on: cached
  // groups beyond it (the last planned first) are given back at once when idle (during a forward, at
  // its end), after the device drained the work that may read them. Returns the bytes freed.
  int64_t SetCacheAllowance(int64_t bytes);
  // The bytes the spare-room cache holds now.
  int64_t cache_bytes() const;
  // Starts the next forward early: allocates the ring if it was released and copies the groups that
  // forward onloads first (prefetch_depth of them, at least one) into their slots on the copy
  // stream, returning at once, so the copies overlap whatever the device computes meanwhile (another
  // component's forward). Does nothing (returns 0) before the first forward has recorded the order,
  // without streams, or inside a forward. Returns the bytes whose copy it issued; a device
  // out-of-memory error for the ring is returned, not thrown.
  absl::StatusOr<int64_t> PrefetchNextForward();
  // The next forward is the last its run needs for now (a request's last denoising step): while it
  // runs, its groups prefetch only its own later groups, none of a forward after it — with the
  // component idle next, its ring goes back (placement's idle release) and such copies would be
  // copied again. Counted in stats().prefetches_skipped_after_last. Changes no output.
  void SkipPrefetchAfterNextForward();
  // Bytes the next forward must allocate before it can run: the slots and scratch if released, the
  // always-on groups.
  int64_t bytes_needed_to_run() const;

  // The hook name on every hooked module.
  static constexpr char kHookName[] = "group_offload";

 private:
  struct Impl;
  explicit GroupOffloader(std::unique_ptr<Impl> impl, GroupOffloadOptions options);
  std::unique_ptr<Impl> impl_;
  GroupOffloadOptions options_;
};

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_GROUP_OFFLOAD_H_
