#include "offload/group_offload.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/out_of_memory.h"
#include "base/status_macros.h"
#include "offload/host_store_factory.h"
#include "offload/slot_ring.h"

namespace stowage {

struct GroupOffloader::Impl {
  // Where one tensor of a group lies in a device buffer holding the group (a ring slot or the
  // group's own buffer), recorded at Apply: the engine never asks the store or the host copy.
  struct SlotTensor {
    TensorSlot* slot;
    int64_t offset;
    int64_t bytes;
    at::ScalarType dtype;
    std::vector<int64_t> sizes;
  };
  struct Group {
    int index = 0;  // In `groups`, plan.groups and the store; the slot ring's owner id.
    std::vector<SlotTensor> tensors;
    std::vector<Module*> members;  // Modules whose forwards use the group.
    int64_t bytes = 0;             // Planned layout size.
    bool always_on = false;        // On the device for its owners' forward, not in the ring.
    bool resident = false;         // Kept on the device (budget).
    at::Tensor device_buffer;      // Resident and always-on groups while onloaded.
    at::Tensor cache_buffer;       // Streamed group held by the spare-room cache (defined: cached).
    // The cache holds the store's device copy of the group's host bytes (HostStore::
    // CopyGroupToSlotVia: compressed, widened into a slot at each onload), not the group as the
    // slot holds it.
    bool cache_is_copy = false;
    // From the store, once at Apply: the bytes an onload moves across the link, and those of the
    // store's device copy of the group (0: it keeps none).
    int64_t link_bytes = 0;
    int64_t copy_bytes = 0;
    int slot = -1;                 // Ring slot holding this group's bytes, -1 if none.
    // Per ring slot, the group's tensors as views of that slot's buffer (made at the first onload into
    // it: an onload then only points the modules at them, instead of three tensor ops per tensor).
    // They reference the ring's buffers: dropped (ForgetSlotViews) before the ring releases them.
    struct SlotViews {
      const void* buffer = nullptr;  // The slot buffer's data they view.
      std::vector<at::Tensor> views;
    };
    std::vector<SlotViews> slot_views;
    bool active = false;
    std::set<Module*> done;        // Members finished since onload.
    // forward_serial when last onloaded from the ring: equal to it, the running forward reached
    // this group before (a model that runs a streamed submodule once per sample).
    int64_t onloaded_in_forward = -1;
  };

  class Hook : public ModuleHook {
   public:
    Hook(Impl* impl, bool is_root) : impl_(impl), is_root_(is_root) {}
    void PreForward(Module& module) override {
      if (is_root_) impl_->BeginForward();
      for (Group* g : groups) {
        if (!g->active) impl_->Onload(*g);
        g->done.erase(&module);
      }
    }
    void PostForward(Module& module) override {
      for (Group* g : groups) {
        g->done.insert(&module);
        if (g->active && g->done.size() == g->members.size()) impl_->Offload(*g);
      }
      if (is_root_) impl_->EndForward();
    }
    std::vector<Group*> groups;

   private:
    Impl* impl_;
    bool is_root_;
  };

  std::string component;
  Module* root = nullptr;
  HostWeights* weights = nullptr;
  DeviceBackend* backend = nullptr;
  GroupOffloadOptions options;
  GroupPlan plan;
  std::vector<std::unique_ptr<Group>> groups;
  std::unique_ptr<HostStore> store;  // Created by Apply after planning; never named by type here.
  std::unique_ptr<SlotRing> ring;    // Created by PrepareDevice.
  std::vector<Module*> hooked;
  std::vector<Group*> order;  // Streamed ring groups in execution order (first forward).
  bool recording = true;
  int64_t cursor = 0;         // Absolute position of the next expected ring onload.
  // The next forward is the last its run needs (SkipPrefetchAfterNextForward): it prefetches no
  // groups of a forward after it. Cleared when that forward ends.
  bool last_forward = false;
  bool in_last_forward = false;
  int64_t forward_serial = 0;  // Forwards begun (BeginForward), those that threw included.
  GroupOffloadStats stats;    // The cache_* fields are kept current here.

  // --- Building ---------------------------------------------------------------------------------

  // Forms the groups and chooses the resident ones (offload/group_plan.h).
  absl::Status PlanGroups(const HostStoreOptions& store_options) {
    const StoreScratch scratch = PlanStoreScratch(store_options, *weights);
    std::vector<PlanTensor> tensors;
    for (size_t i = 0; i < weights->entries().size(); ++i) {
      HostWeights::Entry& e = weights->entries()[i];
      tensors.push_back(PlanTensor{e.slot, static_cast<int64_t>(e.host.nbytes()), scratch.tensor_bytes[i],
                                   scratch.carried_bytes.empty() ? 0 : scratch.carried_bytes[i]});
    }
    GroupPlanOptions plan_options;
    plan_options.type = options.type;
    plan_options.num_blocks_per_group = options.num_blocks_per_group;
    plan_options.block_modules = options.block_modules;
    plan_options.budget_bytes = options.budget_bytes;
    plan_options.slots = options.use_stream ? options.prefetch_depth + 1 : 1;
    plan_options.fixed_scratch_bytes = scratch.fixed_bytes;
    plan_options.scratch_buffers = store_options.scratch_buffers;
    ASSIGN_OR_RETURN(plan, stowage::PlanGroups(component, *root, tensors, plan_options));
    for (const PlannedGroup& planned : plan.groups) {
      auto g = std::make_unique<Group>();
      g->index = static_cast<int>(groups.size());
      g->members = planned.members;
      g->bytes = planned.bytes;
      g->always_on = planned.always_on;
      g->resident = planned.resident;
      for (const PlannedTensor& t : planned.tensors) {
        HostWeights::Entry& e = weights->entries()[static_cast<size_t>(t.index)];
        g->tensors.push_back(SlotTensor{e.slot, t.offset, t.bytes, e.host.scalar_type(), e.host.sizes().vec()});
      }
      groups.push_back(std::move(g));
    }
    stats.groups = static_cast<int>(plan.groups.size());
    stats.streamed_groups = plan.streamed_groups;
    stats.resident_groups = plan.resident_groups;
    stats.slots = plan.slots;
    stats.slot_bytes = plan.slot_bytes;
    stats.always_on_bytes = plan.always_on_bytes;
    stats.resident_bytes = plan.resident_bytes;
    stats.streamed_bytes = plan.streamed_bytes;
    stats.scratch_bytes = plan.scratch_bytes;
    stats.working_set_bytes = plan.working_set_bytes;
    stats.compress = CompressFormatName(options.compress);
    return absl::OkStatus();
  }

  bool InsideForward() const {
    for (const auto& g : groups) {
      if (g->active) return true;
    }
    return false;
  }

  int64_t ReleaseSlots() {
    if (InsideForward() || !ring->allocated() || ring->bytes() == 0) return 0;
    for (int64_t s = 0; s < ring->size(); ++s) {
      if (ring->owner(s) != SlotRing::kNoOwner) groups[static_cast<size_t>(ring->owner(s))]->slot = -1;
    }
    ForgetSlotViews();
    ring->Release();  // Synchronizes: no copy or compute may still touch the buffers.
    ++stats.slot_releases;
    return ring->bytes();
  }

  // --- Spare-room cache ---------------------------------------------------------------------------

  // Gives back cached groups, the last planned first, until the cache holds at most
  // `keep` bytes. Outside a forward only. Returns the bytes freed.
  int64_t ShrinkCache(int64_t keep) {
    if (stats.cache_bytes <= keep) return 0;
    // Compute work queued before may still read the buffers, and the memory may next be filled from
    // the copy stream (another component's onload): drain the device first.
    backend->Synchronize();
    int64_t freed = 0;
    for (auto it = groups.rbegin(); it != groups.rend() && stats.cache_bytes > keep; ++it) {
      Group& g = **it;
      if (!g.cache_buffer.defined()) continue;
      freed += Uncache(g);
    }
    return freed;
  }

  // The cache's accounting of a group it takes in, or gives back (returns its device bytes).
  void Cached(Group& g, at::Tensor buffer, bool is_copy) {
    stats.cache_bytes += static_cast<int64_t>(buffer.nbytes());
    stats.cache_link_bytes += g.link_bytes;
    ++stats.cached_groups;
    ++stats.cache_fills;
    g.cache_buffer = std::move(buffer);
    g.cache_is_copy = is_copy;
  }
  int64_t Uncache(Group& g) {
    const auto bytes = static_cast<int64_t>(g.cache_buffer.nbytes());
    g.cache_buffer = at::Tensor();
    g.cache_is_copy = false;
    stats.cache_bytes -= bytes;
    stats.cache_link_bytes -= g.link_bytes;
    --stats.cached_groups;
    return bytes;
  }

  // Held by the cache as the slot holds it: its onload points at the cache, no slot, no copy.
  static bool CachedWidened(const Group& g) { return g.cache_buffer.defined() && !g.cache_is_copy; }

  // Groups are cached as the slot holds them when the allowance has room for every streamed group
  // that way (then a forward copies and widens nothing); else, for a store that keeps device copies
  // (compressed), as they cross the link — fewer bytes a group, so more of them stay, each widened
  // on the device at its onload instead of copied.
  bool CacheWidened(const Group& g) const {
    return g.copy_bytes == 0 || stats.cache_allowance_bytes >= stats.streamed_bytes;
  }

  int64_t SetCacheAllowance(int64_t bytes) {
    stats.cache_allowance_bytes = std::max<int64_t>(bytes, 0);
    if (InsideForward()) return 0;  // EndForward shrinks it.
    return ShrinkCache(stats.cache_allowance_bytes);
  }

  // `g` leaves its slot after its forward: keep a copy in the cache when the allowance has room for
  // it. The copy runs on the compute stream, after the compute that read the slot and before the
  // slot's release is recorded, so the slot is not refilled under it. A refused allocation just
  // leaves the group streamed.
  // A group cached as a device copy is kept widened instead once the allowance has room for every
  // streamed group widened (its copy goes).
  void MaybeCache(Group& g) {
    if (g.slot < 0 || CachedWidened(g) || !CacheWidened(g)) return;
    const int64_t held = g.cache_buffer.defined() ? static_cast<int64_t>(g.cache_buffer.nbytes()) : 0;
    if (stats.cache_bytes - held + g.bytes > stats.cache_allowance_bytes) return;
    absl::StatusOr<at::Tensor> buffer = backend->AllocateBytes(g.bytes);
    if (!buffer.ok()) return;
    buffer->copy_(ring->buffer(g.slot).narrow(0, 0, g.bytes));
    if (held > 0) Uncache(g);  // Its widening, queued before this copy, read the copy already.
    Cached(g, *std::move(buffer), /*is_copy=*/false);
  }

  // Allocates the ring (slots and store scratch) if it is not: the buffers come from the compute
  // stream's pool and may have been freed by work still queued there, so copies into them wait for
  // it; a fresh scratch is initialised by the store.
  absl::Status EnsureRing() {
    if (ring->allocated()) return absl::OkStatus();
    RETURN_IF_ERROR(ring->Allocate());
    std::unique_ptr<DeviceEvent> ready = backend->RecordOnComputeStream();
    backend->CopyStreamWait(*ready);
    if (ring->scratch_bytes() > 0) store->InitScratch(ring->scratch());
    return absl::OkStatus();
  }

  void EnsureRingOrThrow() {
    absl::Status allocated = EnsureRing();
    if (!allocated.ok()) {
      throw DeviceOutOfMemory(backend->name(), ring->bytes(), backend->GetMemoryStats().allocated_bytes,
                              backend->GetMemoryStats().budget_bytes);
    }
  }

  absl::Status PrepareDevice() {
    if (store->device_scratch_bytes() != stats.scratch_bytes) {
      return absl::InternalError(absl::StrCat("component '", component, "': the host store needs ",
                                              store->device_scratch_bytes(), " bytes of device scratch, ",
                                              stats.scratch_bytes, " were planned"));
    }
    ForgetSlotViews();
    ring = std::make_unique<SlotRing>(*backend, stats.slots, stats.slot_bytes, stats.scratch_bytes);
    RETURN_IF_ERROR(EnsureRing());
    for (auto& g : groups) {
      if (!g->resident) continue;
      ASSIGN_OR_RETURN(g->device_buffer, backend->AllocateBytes(g->bytes));
      (void)store->CopyGroupToSlot(g->index, g->device_buffer, at::Tensor());  // Resident: exact, no scratch.
      PointAt(*g, g->device_buffer);
    }
    backend->Synchronize();
    return absl::OkStatus();
  }

  void InstallHooks() {
    std::map<Module*, std::shared_ptr<Hook>> hooks;
    auto hook_for = [&](Module* m) {
      auto& h = hooks[m];
      if (!h) h = std::make_shared<Hook>(this, m == root);
      return h.get();
    };
    hook_for(root);  // The root records forwards even when it owns no group.
    for (auto& g : groups) {
      if (g->resident) continue;
      for (Module* m : g->members) hook_for(m)->groups.push_back(g.get());
    }
    for (auto& [m, h] : hooks) {
      (void)m->AddHook(kHookName, h);  // Checked free by Apply.
      hooked.push_back(m);
    }
  }

  // --- Moving bytes (the store fills a buffer; the engine points the tensors at it) --------------

  void PointAt(Group& g, const at::Tensor& buffer) {
    for (SlotTensor& t : g.tensors) {
      t.slot->value = buffer.narrow(0, t.offset, t.bytes).view(t.dtype).view(t.sizes);
    }
  }

  // PointAt(g, ring->buffer(s)), through the group's views of slot s.
  void PointAtSlot(Group& g, int64_t s) {
    if (g.slot_views.size() != static_cast<size_t>(ring->size())) g.slot_views.assign(ring->size(), {});
    Group::SlotViews& made = g.slot_views[static_cast<size_t>(s)];
    const at::Tensor& buffer = ring->buffer(s);
    if (made.buffer != buffer.data_ptr() || made.views.size() != g.tensors.size()) {
      made.views.clear();
      for (const SlotTensor& t : g.tensors) {
        made.views.push_back(buffer.narrow(0, t.offset, t.bytes).view(t.dtype).view(t.sizes));
      }
      made.buffer = buffer.data_ptr();
    }
    for (size_t i = 0; i < g.tensors.size(); ++i) g.tensors[i].slot->value = made.views[i];
  }

  // Drops every group's slot views: the ring's buffers are about to go.
  void ForgetSlotViews() {
    for (auto& g : groups) g->slot_views.clear();
  }

  void PointAway(Group& g) {
    for (SlotTensor& t : g.tensors) t.slot->value = at::Tensor();
  }

  // Copies `g` into ring slot `s` once the compute that last read the slot is done. Invariant:
  // g.slot >= 0 exactly when the ring's slot g.slot is owned by g.
  void LoadIntoSlot(Group& g, int64_t s, bool may_fill_cache = true) {
    const int holder = ring->owner(s);
    if (holder != SlotRing::kNoOwner && holder != g.index) groups[static_cast<size_t>(holder)]->slot = -1;
    if (g.slot >= 0 && g.slot != s) ring->set_owner(g.slot, SlotRing::kNoOwner);
    // Whichever stream writes the slot waits until the compute that last read it is done.
    if (store->WritesSlotOnTransformStream(g.index)) {
      ring->TransformStreamWaitReleased(s);
    } else {
      ring->CopyStreamWaitReleased(s);
    }
    ring->SetCopied(s, CopyIntoSlot(g, ring->buffer(s), may_fill_cache));
    ring->set_owner(s, g.index);
    g.slot = static_cast<int>(s);
  }

  // Enqueues what makes `slot` hold `g`: from the cache's device copy of it (no link traffic), into
  // a new device copy the cache takes in while its allowance has room and `may_fill_cache` (the copy
  // the link carries anyway lands there), or straight from the host. A fill waits for the compute
  // queued before (its buffer comes from the compute stream's pool): only a group's first.
  std::unique_ptr<DeviceEvent> CopyIntoSlot(Group& g, const at::Tensor& slot, bool may_fill_cache) {
    if (g.cache_is_copy) {
      ++stats.cache_hits;
      stats.cache_hit_bytes += g.link_bytes;
      return store->CopyGroupToSlotVia(g.index, slot, ring->scratch(), g.cache_buffer, /*fill=*/false);
    }
    if (may_fill_cache && g.copy_bytes > 0 && !g.cache_buffer.defined() && !CacheWidened(g) &&
        stats.cache_bytes + g.copy_bytes <= stats.cache_allowance_bytes) {
      absl::StatusOr<at::Tensor> buffer = backend->AllocateBytes(g.copy_bytes);
      if (buffer.ok()) {
        // From the compute stream's pool: the copy into it waits for compute work queued before.
        std::unique_ptr<DeviceEvent> ready = backend->RecordOnComputeStream();
        backend->CopyStreamWait(*ready);
        std::unique_ptr<DeviceEvent> event =
            store->CopyGroupToSlotVia(g.index, slot, ring->scratch(), *buffer, /*fill=*/true);
        Cached(g, *std::move(buffer), /*is_copy=*/true);
        return event;
      }
    }
    return store->CopyGroupToSlot(g.index, slot, ring->scratch());
  }

  void Onload(Group& g) {
    if (g.resident) return;  // Resident groups are never in `order`: prefetch looks past them.
    if (g.always_on) {
      if (ring->scratch_bytes() > 0) EnsureRingOrThrow();  // The store copies through the scratch.
      absl::StatusOr<at::Tensor> buffer = backend->AllocateBytes(g.bytes);
      if (!buffer.ok()) {
        throw DeviceOutOfMemory(backend->name(), g.bytes, backend->GetMemoryStats().allocated_bytes,
                                backend->GetMemoryStats().budget_bytes);
      }
      g.device_buffer = *buffer;
      // The buffer came from the compute stream's pool: the copy must wait for compute work queued
      // before it, then compute waits for the copy.
      std::unique_ptr<DeviceEvent> ready = backend->RecordOnComputeStream();
      backend->CopyStreamWait(*ready);
      std::unique_ptr<DeviceEvent> copied = store->CopyGroupToSlot(g.index, g.device_buffer, ring->scratch());
      backend->ComputeStreamWait(*copied);
      PointAt(g, g.device_buffer);
      g.active = true;
      g.done.clear();
      return;
    }
    ++stats.onloads;
    EnsureRingOrThrow();
    const int64_t n = ring->size();
    const int64_t length = static_cast<int64_t>(order.size());
    // A group the running forward reached before, reached again (a submodule run once per sample
    // where the recorded order has it once): served where it is, or copied into the slot of the
    // group reached last — the one slot the prefetches ahead leave alone —, without moving the
    // order's cursor or prefetching. Searching the order from the cursor would find it in the next
    // forward's place, as if every group between had been skipped: the prefetched ones would then
    // land in shifted slots and be copied again.
    if (!recording && g.onloaded_in_forward == forward_serial) {
      Serve(g, ((cursor - 1) % n + n) % n, n);
      return;
    }
    g.onloaded_in_forward = forward_serial;
    int64_t pos = -1;
    if (recording) {
      order.push_back(&g);
      pos = cursor;
    } else {
      for (int64_t k = 0; k < length; ++k) {
        if (order[static_cast<size_t>((cursor + k) % length)] == &g) {
          pos = cursor + k;
          break;
        }
      }
    }
    const int64_t slot_index = (pos >= 0 ? pos : cursor) % n;
    Serve(g, slot_index, n);
    if (pos >= 0) cursor = pos + 1;
    if (recording || !options.use_stream || length < 2) return;
    // Prefetch the next groups into the slots their positions map to; never the running one's. The
    // last forward of a run prefetches none of the next forward's (its ring goes back before one).
    const int64_t ahead = std::min<int64_t>(options.prefetch_depth, std::min<int64_t>(length - 1, n - 1));
    for (int64_t k = 1; k <= ahead && pos >= 0; ++k) {
      // Past the end of the recorded order: a group of the next forward.
      if (in_last_forward && pos % length + k >= length) {
        // Each position is first looked at from `ahead` groups before it: count it once, there.
        if (k == ahead) ++stats.prefetches_skipped_after_last;
        continue;
      }
      Group& next = *order[static_cast<size_t>((pos + k) % length)];
      const int64_t s = (pos + k) % n;
      if (&next == &g || next.resident || CachedWidened(next)) continue;
      if (next.slot == s) continue;
      if (next.active) continue;
      // Never overwrite a slot that a running group reads (possible after an out-of-order onload
      // served from a slot other than its position's).
      const int holder = ring->owner(s);
      if (holder != SlotRing::kNoOwner && groups[static_cast<size_t>(holder)]->active) continue;
      LoadIntoSlot(next, s);
      ++stats.prefetches;
    }
  }

  // `s`, or (when an active group reads it: an out-of-order onload of a group whose members run in
  // turn) the first slot after it that no active group reads. A forward holds fewer active groups
  // than the ring has slots.
  int64_t FreeSlotFrom(int64_t s, int64_t n) const {
    for (int64_t k = 0; k < n; ++k) {
      const int64_t t = (s + k) % n;
      const int holder = ring->owner(t);
      if (holder == SlotRing::kNoOwner || !groups[static_cast<size_t>(holder)]->active) return t;
    }
    return s;
  }

  // Makes `g` usable by the compute stream: from the spare-room cache's widened copy, from the slot
  // it is still (or was prefetched) in, or copied now into `slot` (or the first slot after it that no
  // running group reads), the forward waiting for it.
  void Serve(Group& g, int64_t slot, int64_t n) {
    if (CachedWidened(g)) {  // Kept by the spare-room cache as the slot holds it: nothing to copy.
      ++stats.cache_hits;
      stats.cache_hit_bytes += g.link_bytes;
      PointAt(g, g.cache_buffer);
    } else {
      if (g.slot < 0) {  // Not prefetched, nor still there from its last run.
        ++stats.sync_onloads;
        LoadIntoSlot(g, FreeSlotFrom(slot, n));
      }
      ring->ComputeStreamWaitCopied(g.slot);
      PointAtSlot(g, g.slot);
    }
    g.active = true;
    g.done.clear();
  }

  // Copies the groups the next forward onloads first into the slots they will use, on the copy
  // stream, and returns at once (see GroupOffloader::PrefetchNextForward).
  absl::StatusOr<int64_t> PrefetchNextForward() {
    const int64_t length = static_cast<int64_t>(order.size());
    if (recording || !options.use_stream || length == 0) return 0;
    for (auto& g : groups) {
      if (g->active) return 0;  // Inside a forward: its own prefetch is at work.
    }
    RETURN_IF_ERROR(EnsureRing());
    const int64_t n = ring->size();
    const int64_t ahead = std::min<int64_t>(options.prefetch_depth, std::min<int64_t>(length, n - 1));
    int64_t copied = 0;
    for (int64_t k = 0; k < std::max<int64_t>(ahead, 1); ++k) {
      Group& next = *order[static_cast<size_t>((cursor + k) % length)];
      const int64_t s = (cursor + k) % n;
      if (next.resident || CachedWidened(next) || next.slot == s) continue;
      // Outside its run the allowance is the one its last run was granted: no new cache fills.
      LoadIntoSlot(next, s, /*may_fill_cache=*/false);
      ++stats.prefetches;
      ++stats.early_prefetches;
      copied += next.bytes;
    }
    return copied;
  }

  void Offload(Group& g) {
    if (g.resident) return;
    PointAway(g);
    g.active = false;
    if (g.always_on) {
      g.device_buffer = at::Tensor();
      return;
    }
    MaybeCache(g);
    if (g.slot >= 0) ring->RecordReleased(g.slot);
  }

  void BeginForward() {
    // A forward that threw skipped its post hooks: put those groups away first.
    for (auto& g : groups) {
      if (g->active) Offload(*g);
    }
    ++forward_serial;  // Also for a forward after one that threw (stats.forwards counts completed ones).
    in_last_forward = last_forward;
    last_forward = false;
  }

  void EndForward() {
    ++stats.forwards;
    in_last_forward = false;
    // An allowance lowered during the forward takes effect now (the root's post hook: every group
    // is put away by then).
    if (stats.cache_bytes > stats.cache_allowance_bytes && !InsideForward()) ShrinkCache(stats.cache_allowance_bytes);
    if (recording) {
      recording = false;
      cursor = 0;
    }
  }

  void Remove() {
    backend->Synchronize();
    for (Module* m : hooked) m->RemoveHook(kHookName);
    hooked.clear();
    for (auto& g : groups) {
      PointAway(*g);
      g->device_buffer = at::Tensor();
      g->cache_buffer = at::Tensor();
      g->cache_is_copy = false;
    }
    ForgetSlotViews();
    if (ring) ring->Release();
    store.reset();  // Unregisters memory pinned in place, frees the staging ring.
  }
};

GroupOffloader::GroupOffloader(std::unique_ptr<Impl> impl, GroupOffloadOptions options)
    : impl_(std::move(impl)), options_(std::move(options)) {}

GroupOffloader::~GroupOffloader() {
  if (impl_) impl_->Remove();
}

GroupOffloadStats GroupOffloader::stats() const {
  GroupOffloadStats stats = impl_->stats;
  if (impl_->store != nullptr) {
    HostStoreStats host = impl_->store->stats();
    stats.pinned_host_bytes = host.pinned_host_bytes;
    stats.mapped_bytes_released = host.mapped_bytes_released;
    stats.pinned_in_place_bytes = host.pinned_in_place_bytes;
    stats.pin_in_place_error = std::move(host.pin_in_place_error);
    stats.disk_files_written = host.disk_files_written;
    stats.disk_files_reused = host.disk_files_reused;
    stats.compressed_host_bytes = host.compressed_host_bytes;
    stats.host_quantized_fallbacks = host.host_quantized_fallbacks;
    stats.one_pass_fp8_weights = host.one_pass_fp8_weights;
    stats.prepare_pin_alloc_s = host.prepare_pin_alloc_s;
    stats.prepare_quantize_s = host.prepare_quantize_s;
    stats.bytes_per_forward = host.bytes_per_forward;
  }
  return stats;
}

int64_t GroupOffloader::device_bytes() const {
  return (impl_->ring->allocated() ? impl_->ring->bytes() : 0) + impl_->stats.resident_bytes +
         impl_->stats.cache_bytes;
}

bool GroupOffloader::holds_slots() const { return impl_->ring->allocated() && impl_->ring->bytes() > 0; }

int64_t GroupOffloader::ReleaseSlots() { return impl_->ReleaseSlots(); }

int64_t GroupOffloader::SetCacheAllowance(int64_t bytes) { return impl_->SetCacheAllowance(bytes); }

int64_t GroupOffloader::cache_bytes() const { return impl_->stats.cache_bytes; }

absl::StatusOr<int64_t> GroupOffloader::PrefetchNextForward() { return impl_->PrefetchNextForward(); }
void GroupOffloader::SkipPrefetchAfterNextForward() { impl_->last_forward = true; }

int64_t GroupOffloader::bytes_needed_to_run() const {
  return (impl_->ring->allocated() ? 0 : impl_->ring->bytes()) + impl_->stats.always_on_bytes;
}

absl::StatusOr<std::unique_ptr<GroupOffloader>> GroupOffloader::Apply(
    const std::string& component, Module& root, HostWeights& weights, DeviceBackend& backend,
    const GroupOffloadOptions& requested) {
  GroupOffloadOptions options = requested;
  // Compressed block-level streaming with no group budget and no device budget gets a deeper ring by
  // default: the first blocks' copies then run during the previous step's last blocks. Kept only
  // where it pays and fits (checked once planned, below).
  bool deep_by_default = false;
  if (options.prefetch_depth == 0) {
    deep_by_default = options.type == OffloadType::kBlockLevel && options.compress != CompressFormat::kNone &&
                      !options.choose_compress && options.budget_bytes == 0 && backend.MemoryBudget() <= 0;
    options.prefetch_depth =
        (options.type == OffloadType::kLeafLevel && options.budget_bytes == 0) || deep_by_default ? 4 : 1;
  }
  auto invalid = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("component '", component, "': ", what));
  };
  bool already = false;
  root.ForEachModule([&](Module& m) { already = already || m.FindHook(kHookName) != nullptr; });
  if (already) {
    return absl::FailedPreconditionError(absl::StrCat(
        "component '", component, "' already has group offloading; disable it before changing options"));
  }
  if (options.num_blocks_per_group < 1) return invalid("num_blocks_per_group must be >= 1");
  if (options.use_stream && options.prefetch_depth < 1) {
    return invalid("prefetch_depth must be >= 1 (or 0: chosen for the level)");
  }
  if (options.use_stream && !backend.supports_streams()) {
    return invalid(absl::StrCat("use_stream needs a copy stream, and device ", backend.name(),
                                " has none"));
  }
  if (options.budget_bytes < 0) return invalid("budget_bytes must be >= 0");
  if (options.choose_compress) {
    return invalid("compress AUTO is chosen by placement (PlacementManager::EnableGroupOffload), not here");
  }
  HostStoreOptions store_options;
  store_options.component = component;
  store_options.target = options.target;
  store_options.pin_in_place = options.pin_in_place;
  store_options.disk_dir = options.disk_dir;
  store_options.staging_buffer_bytes = options.staging_buffer_bytes;
  store_options.staging_buffers = options.staging_buffers;
  store_options.staging_threads = options.staging_threads;
  store_options.compress = options.compress;
  store_options.prequantized = options.prequantized;
  store_options.widen_per_group = options.widen_per_group;
  store_options.quantize_chunk_elements = options.quantize_chunk_elements;
  // With a copy stream, a compressed group's widening overlaps the next group's copy: two areas.
  store_options.scratch_buffers = options.use_stream ? 2 : 1;
  if (absl::Status valid = ValidateHostStoreOptions(store_options); !valid.ok()) {
    return invalid(std::string(valid.message()));
  }
  auto planned = [&](const GroupOffloadOptions& o) -> absl::StatusOr<std::unique_ptr<Impl>> {
    auto made = std::make_unique<Impl>();
    made->component = component;
    made->root = &root;
    made->weights = &weights;
    made->backend = &backend;
    made->options = o;
    RETURN_IF_ERROR(made->PlanGroups(store_options));
    return made;
  };
  ASSIGN_OR_RETURN(std::unique_ptr<Impl> impl, planned(options));
  if (deep_by_default && options.use_stream) {
    // The deeper ring pays only with more streamed groups than slots (else groups change slots every
    // forward), and its extra slots must leave the device room: at most an eighth of what is free.
    const int64_t extra = static_cast<int64_t>(options.prefetch_depth - 1) * impl->stats.slot_bytes;
    const int64_t free = backend.GetMemoryStats().free_bytes();
    if (impl->stats.streamed_groups <= options.prefetch_depth + 1 || (free != INT64_MAX && extra > free / 8)) {
      options.prefetch_depth = 1;
      ASSIGN_OR_RETURN(impl, planned(options));
    }
  }
  // The component leaves the device before its groups take their place.
  weights.OffloadAll();
  ASSIGN_OR_RETURN(impl->store, CreateHostStore(store_options, impl->plan.groups, weights, backend));
  for (auto& g : impl->groups) {
    const int64_t link = impl->store->link_bytes(g->index);
    g->link_bytes = link > 0 ? link : g->bytes;
    g->copy_bytes = impl->store->device_copy_bytes(g->index);
  }
  absl::Status device = impl->PrepareDevice();
  if (!device.ok()) {
    impl->Remove();
    return device;
  }
  impl->InstallHooks();
  return std::unique_ptr<GroupOffloader>(new GroupOffloader(std::move(impl), options));
}

}  // namespace stowage
