#include "offload/group_offload.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>

#include <malloc.h>

#include <ATen/Functions.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/out_of_memory.h"
#include "base/status_macros.h"
#include "offload/group_plan.h"
#include "offload/memcpy_pool.h"
#include "offload/slot_ring.h"
#include "offload/safetensors.h"

namespace stowage {
namespace {

// Raw bytes of a contiguous CPU tensor, without ownership (the caller keeps `t` alive).
at::Tensor BytesOf(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), {static_cast<int64_t>(t.nbytes())}, at::TensorOptions().dtype(at::kByte));
}

// A fast 64-bit content hash (for disk-file staleness), 8 bytes at a time.
uint64_t HashBytes(const uint8_t* data, int64_t n, uint64_t h) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, data + i, 8);
    h = (h ^ w) * 0x9E3779B97F4A7C15ULL;
    h ^= h >> 29;
  }
  for (; i < n; ++i) h = (h ^ data[i]) * 0x100000001B3ULL;
  return h;
}

}  // namespace

struct GroupOffloader::Impl {
  // An Apply that threw half-way leaves nothing registered (Remove() has unpinned otherwise).
  ~Impl() {
    if (registered.empty()) return;
    backend->Synchronize();  // No copy may still read the memory.
    UnpinInPlace();
  }

  struct TensorRef {
    HostWeights::Entry* entry;
    int64_t offset;  // Within the group's packed layout.
  };
  struct Group {
    int index = 0;  // In `groups`; the slot ring's owner id.
    std::string name;
    std::vector<TensorRef> tensors;
    std::vector<Module*> members;  // Modules whose forwards use the group.
    int64_t bytes = 0;             // Packed, each tensor aligned to kGroupAlign.
    bool ring = true;              // False: always-on for its owner's forward.
    bool resident = false;         // Kept on the device (budget).
    at::Tensor host_packed;        // kPinnedHost: contiguous pinned copy.
    std::shared_ptr<SafetensorsFile> file;  // kDisk.
    at::Tensor device_buffer;      // Resident and always-on groups while onloaded.
    int slot = -1;                 // Ring slot holding this group's bytes, -1 if none.
    bool active = false;
    std::set<Module*> done;        // Members finished since onload.
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
  std::vector<std::unique_ptr<Group>> groups;
  std::unique_ptr<SlotRing> ring;  // Created by PrepareDevice.
  std::vector<Module*> hooked;
  std::vector<at::Tensor> staging;
  std::vector<void*> registered;  // Host ranges pinned in place (kPageableHost).
  std::vector<std::unique_ptr<DeviceEvent>> staging_done;
  std::unique_ptr<MemcpyPool> memcpy_pool;
  size_t next_staging = 0;
  std::vector<Group*> order;  // Streamed ring groups in execution order (first forward).
  bool recording = true;
  int64_t cursor = 0;         // Absolute position of the next expected ring onload.
  GroupOffloadStats stats;

  // --- Building ---------------------------------------------------------------------------------

  // Forms the groups and chooses the resident ones (offload/group_plan.h).
  absl::Status PlanGroups() {
    std::vector<PlanTensor> tensors;
    for (HostWeights::Entry& e : weights->entries()) {
      tensors.push_back(PlanTensor{e.slot, static_cast<int64_t>(e.host.nbytes())});
    }
    GroupPlanOptions plan_options;
    plan_options.type = options.type;
    plan_options.num_blocks_per_group = options.num_blocks_per_group;
    plan_options.block_modules = options.block_modules;
    plan_options.budget_bytes = options.budget_bytes;
    plan_options.slots = options.use_stream ? options.prefetch_depth + 1 : 1;
    ASSIGN_OR_RETURN(GroupPlan plan, stowage::PlanGroups(component, *root, tensors, plan_options));
    for (PlannedGroup& planned : plan.groups) {
      auto g = std::make_unique<Group>();
      g->index = static_cast<int>(groups.size());
      g->name = planned.name;
      g->members = planned.members;
      g->bytes = planned.bytes;
      g->ring = !planned.always_on;
      g->resident = planned.resident;
      for (const PlannedTensor& t : planned.tensors) {
        g->tensors.push_back(TensorRef{&weights->entries()[static_cast<size_t>(t.index)], t.offset});
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
    stats.working_set_bytes = plan.working_set_bytes;
    return absl::OkStatus();
  }

  // Prepares the host side of the non-resident groups.
  absl::Status PrepareHost() {
    if (options.target == OffloadTarget::kPinnedHost) {
      // Pinned chunks, each group packed contiguously; the pageable originals are released group by
      // group, so RAM holds the weights once. Chunks of about 256 MiB, each sized exactly to the consecutive groups it holds: cudaHostAlloc
      // pins every page it returns, so any slack would be resident RAM that holds nothing.
      const int64_t chunk_target = int64_t{256} << 20;
      std::vector<std::pair<at::Tensor, int64_t>> chunks;  // (chunk, bytes used)
      std::vector<Group*> pending;
      for (auto& g : groups) {
        if (!g->resident) pending.push_back(g.get());
      }
      size_t next_chunk_start = 0;  // First group of `pending` not yet given a chunk.
      for (size_t i = 0; i < pending.size(); ++i) {
        Group* g = pending[i];
        if (i == next_chunk_start) {
          int64_t bytes = 0;
          size_t j = i;
          do {
            bytes += pending[j]->bytes;
            ++j;
          } while (j < pending.size() && bytes < chunk_target);
          next_chunk_start = j;
          ASSIGN_OR_RETURN(at::Tensor chunk, backend->AllocatePinnedHost(bytes));
          chunks.emplace_back(std::move(chunk), 0);
          stats.pinned_host_bytes += bytes;
        }
        std::pair<at::Tensor, int64_t>* fit = &chunks.back();
        g->host_packed = fit->first.narrow(0, fit->second, g->bytes);
        fit->second += g->bytes;
        uint8_t* base = g->host_packed.data_ptr<uint8_t>();
        for (TensorRef& t : g->tensors) {
          const at::Tensor& host = t.entry->host;
          std::memcpy(base + t.offset, host.data_ptr(), host.nbytes());
          // Copied from a safetensors mapping: drop its pages from RSS now, not when the whole
          // file is unmapped (that would hold the weights twice in RSS until the last group).
          stats.mapped_bytes_released += ReleaseMappedPages(host.data_ptr(), static_cast<int64_t>(host.nbytes()));
          at::Tensor view = g->host_packed.narrow(0, t.offset, static_cast<int64_t>(host.nbytes()))
                                .view(host.scalar_type())
                                .view(host.sizes());
          weights->ReplaceHost(*t.entry, view);
        }
      }
      // The pageable originals are gone; hand their pages back to the kernel (glibc keeps freed
      // blocks below its mmap threshold in the heap otherwise, and RSS would count them twice).
      ::malloc_trim(0);
    } else {
      if (options.target == OffloadTarget::kDisk) {
        RETURN_IF_ERROR(PrepareDisk());
        ::malloc_trim(0);
      }
      if (options.target == OffloadTarget::kPageableHost && options.pin_in_place && PinInPlace()) {
        return absl::OkStatus();
      }
      memcpy_pool = std::make_unique<MemcpyPool>(options.staging_threads - 1);
      for (int i = 0; i < options.staging_buffers; ++i) {
        ASSIGN_OR_RETURN(at::Tensor buffer, backend->AllocatePinnedHost(options.staging_buffer_bytes));
        staging.push_back(buffer);
        staging_done.emplace_back();
      }
    }
    return absl::OkStatus();
  }

  // Registers the page-rounded host ranges of every group with the backend (read-only
  // first, which a read-only file mapping needs; then plain). True when all of them are registered;
  // otherwise nothing stays registered and the reason is kept in the stats.
  bool PinInPlace() {
    const int64_t page = ::sysconf(_SC_PAGESIZE);
    std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
    // Every group, resident ones too: they are copied from the same pages once, and tensors packed
    // back to back in a safetensors file share pages, so a copy must never start inside a
    // registered range and run past its end.
    for (auto& g : groups) {
      for (TensorRef& t : g->tensors) {
        const at::Tensor& host = t.entry->host;
        if (host.nbytes() == 0) continue;
        const auto begin = reinterpret_cast<uintptr_t>(host.data_ptr());
        const uintptr_t end = begin + host.nbytes();
        ranges.emplace_back(begin / page * page, (end + page - 1) / page * page);
      }
    }
    std::sort(ranges.begin(), ranges.end());
    std::vector<std::pair<uintptr_t, uintptr_t>> merged;  // Overlapping pages registered once.
    for (const auto& r : ranges) {
      if (!merged.empty() && r.first < merged.back().second) {
        merged.back().second = std::max(merged.back().second, r.second);
      } else {
        merged.push_back(r);
      }
    }
    int64_t bytes = 0;
    for (const auto& [begin, end] : merged) {
      void* ptr = reinterpret_cast<void*>(begin);
      const auto size = static_cast<int64_t>(end - begin);
      absl::Status status = backend->RegisterHostMemory(ptr, size, /*read_only=*/true);
      if (!status.ok()) status = backend->RegisterHostMemory(ptr, size, /*read_only=*/false);
      if (!status.ok()) {
        UnpinInPlace();
        stats.pin_in_place_error = std::string(status.message());
        return false;
      }
      registered.push_back(ptr);
      bytes += size;
    }
    stats.pinned_in_place_bytes = bytes;
    return true;
  }

  void UnpinInPlace() {
    for (void* ptr : registered) (void)backend->UnregisterHostMemory(ptr);
    registered.clear();
  }

  absl::Status PrepareDisk() {
    if (options.disk_dir.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("component '", component,
                                                     "': offload target disk needs disk_dir"));
    }
    const std::string dir = absl::StrCat(options.disk_dir, "/", component);
    for (const std::string& d : {options.disk_dir, dir}) {
      if (::mkdir(d.c_str(), 0755) != 0 && errno != EEXIST) {
        return absl::PermissionDeniedError(absl::StrCat("component '", component, "': disk_dir '",
                                                        d, "' cannot be created: ", std::strerror(errno)));
      }
    }
    if (::access(dir.c_str(), W_OK) != 0) {
      return absl::PermissionDeniedError(
          absl::StrCat("component '", component, "': disk_dir '", dir, "' is not writable"));
    }
    for (auto& g : groups) {
      if (g->resident) continue;
      std::string file_name = g->name;
      std::replace(file_name.begin(), file_name.end(), '/', '_');
      const std::string path = absl::StrCat(dir, "/", file_name, ".safetensors");
      // Fingerprint: names, dtypes, shapes and contents of the group's tensors.
      uint64_t h = 1469598103934665603ULL;
      std::vector<std::pair<std::string, at::Tensor>> named;
      for (TensorRef& t : g->tensors) {
        const std::string name = t.entry->module->SlotPath(*t.entry->slot);
        h = HashBytes(reinterpret_cast<const uint8_t*>(name.data()), static_cast<int64_t>(name.size()), h);
        std::string meta = SafetensorsDtypeName(t.entry->host.scalar_type());
        for (int64_t d : t.entry->host.sizes()) absl::StrAppend(&meta, ",", d);
        h = HashBytes(reinterpret_cast<const uint8_t*>(meta.data()), static_cast<int64_t>(meta.size()), h);
        h = HashBytes(static_cast<const uint8_t*>(t.entry->host.data_ptr()),
                      static_cast<int64_t>(t.entry->host.nbytes()), h);
        named.emplace_back(name, t.entry->host);
      }
      const std::string fingerprint = absl::StrCat(h);
      auto existing = SafetensorsFile::Open(path);
      bool reuse = existing.ok() && (*existing)->metadata().count("stowage_fingerprint") > 0 &&
                   (*existing)->metadata().at("stowage_fingerprint") == fingerprint;
      if (reuse) {
        ++stats.disk_files_reused;
        g->file = *existing;
      } else {
        RETURN_IF_ERROR(WriteSafetensors(path, named, {{"stowage_fingerprint", fingerprint}}));
        ++stats.disk_files_written;
        ASSIGN_OR_RETURN(g->file, SafetensorsFile::Open(path));
      }
      // The mapping becomes the host copy: the RAM copy is released.
      named.clear();
      for (TensorRef& t : g->tensors) {
        ASSIGN_OR_RETURN(at::Tensor mapped, g->file->Get(t.entry->module->SlotPath(*t.entry->slot)));
        weights->ReplaceHost(*t.entry, mapped);
      }
    }
    return absl::OkStatus();
  }

  int64_t ReleaseSlots() {
    if (!ring->allocated() || ring->size() == 0) return 0;
    for (auto& g : groups) {
      if (g->active) return 0;  // Inside a forward.
    }
    for (int64_t s = 0; s < ring->size(); ++s) {
      if (ring->owner(s) != SlotRing::kNoOwner) groups[static_cast<size_t>(ring->owner(s))]->slot = -1;
    }
    ring->Release();  // Synchronizes: no copy or compute may still touch the buffers.
    ++stats.slot_releases;
    return ring->bytes();
  }

  absl::Status PrepareDevice() {
    ring = std::make_unique<SlotRing>(*backend, stats.slots, stats.slot_bytes);
    RETURN_IF_ERROR(ring->Allocate());
    std::unique_ptr<DeviceEvent> ready = backend->RecordOnComputeStream();  // As in Onload.
    backend->CopyStreamWait(*ready);
    for (auto& g : groups) {
      if (!g->resident) continue;
      ASSIGN_OR_RETURN(g->device_buffer, backend->AllocateBytes(g->bytes));
      CopyGroup(*g, g->device_buffer);
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

  // --- Moving bytes -----------------------------------------------------------------------------

  // Copies the group's bytes into `dst` (device, >= g.bytes) on the copy stream.
  void CopyGroup(Group& g, const at::Tensor& dst) {
    if (g.host_packed.defined()) {
      backend->CopyToDeviceAsync(dst.narrow(0, 0, g.bytes), g.host_packed);
      return;
    }
    for (TensorRef& t : g.tensors) {
      const at::Tensor& host = t.entry->host;
      const int64_t n = static_cast<int64_t>(host.nbytes());
      if (staging.empty()) {  // Pinned in place, or resident groups of the pinned target.
        backend->CopyToDeviceAsync(dst.narrow(0, t.offset, n), BytesOf(host.contiguous()));
        continue;
      }
      const auto* src = static_cast<const uint8_t*>(host.data_ptr());
      for (int64_t done = 0; done < n;) {
        const size_t k = next_staging;
        next_staging = (next_staging + 1) % staging.size();
        if (staging_done[k]) staging_done[k]->Wait();  // Its previous DMA has read it.
        const int64_t len = std::min<int64_t>(n - done, staging[k].numel());
        memcpy_pool->Copy(staging[k].data_ptr<uint8_t>(), src + done, len);
        backend->CopyToDeviceAsync(dst.narrow(0, t.offset + done, len), staging[k].narrow(0, 0, len));
        staging_done[k] = backend->RecordOnCopyStream();
        done += len;
      }
    }
  }

  void PointAt(Group& g, const at::Tensor& buffer) {
    for (TensorRef& t : g.tensors) {
      const at::Tensor& host = t.entry->host;
      t.entry->slot->value = buffer.narrow(0, t.offset, static_cast<int64_t>(host.nbytes()))
                                 .view(host.scalar_type())
                                 .view(host.sizes());
    }
  }

  void PointAway(Group& g) {
    for (TensorRef& t : g.tensors) t.entry->slot->value = at::Tensor();
  }

  // Copies `g` into ring slot `s` once the compute that last read the slot is done. Invariant:
  // g.slot >= 0 exactly when the ring's slot g.slot is owned by g.
  void LoadIntoSlot(Group& g, int64_t s) {
    const int holder = ring->owner(s);
    if (holder != SlotRing::kNoOwner && holder != g.index) groups[static_cast<size_t>(holder)]->slot = -1;
    if (g.slot >= 0 && g.slot != s) ring->set_owner(g.slot, SlotRing::kNoOwner);
    ring->CopyStreamWaitReleased(s);
    CopyGroup(g, ring->buffer(s));
    ring->RecordCopied(s);
    ring->set_owner(s, g.index);
    g.slot = static_cast<int>(s);
  }

  void Onload(Group& g) {
    if (g.resident) return;  // Resident groups are never in `order`: prefetch looks past them.
    if (!g.ring) {
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
      CopyGroup(g, g.device_buffer);
      std::unique_ptr<DeviceEvent> copied = backend->RecordOnCopyStream();
      backend->ComputeStreamWait(*copied);
      PointAt(g, g.device_buffer);
      g.active = true;
      g.done.clear();
      return;
    }
    ++stats.onloads;
    if (!ring->allocated()) {
      absl::Status allocated = ring->Allocate();
      if (!allocated.ok()) {
        throw DeviceOutOfMemory(backend->name(), ring->bytes(),
                                backend->GetMemoryStats().allocated_bytes,
                                backend->GetMemoryStats().budget_bytes);
      }
      // The buffers came from the compute stream's pool and may have been freed by work still
      // queued there: copies into them wait for it.
      std::unique_ptr<DeviceEvent> ready = backend->RecordOnComputeStream();
      backend->CopyStreamWait(*ready);
    }
    const int64_t n = ring->size();
    const int64_t length = static_cast<int64_t>(order.size());
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
    if (g.slot < 0) {  // Not prefetched, nor still there from its last run.
      ++stats.sync_onloads;
      LoadIntoSlot(g, slot_index);
    }
    ring->ComputeStreamWaitCopied(g.slot);
    PointAt(g, ring->buffer(g.slot));
    g.active = true;
    g.done.clear();
    if (pos >= 0) cursor = pos + 1;
    if (recording || !options.use_stream || length < 2) return;
    // Prefetch the next groups into the slots their positions map to; never the running one's.
    const int64_t ahead = std::min<int64_t>(options.prefetch_depth, std::min<int64_t>(length - 1, n - 1));
    for (int64_t k = 1; k <= ahead && pos >= 0; ++k) {
      Group& next = *order[static_cast<size_t>((pos + k) % length)];
      const int64_t s = (pos + k) % n;
      if (&next == &g || next.resident) continue;
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

  void Offload(Group& g) {
    if (g.resident) return;
    PointAway(g);
    g.active = false;
    if (!g.ring) {
      g.device_buffer = at::Tensor();
      return;
    }
    if (g.slot >= 0) ring->RecordReleased(g.slot);
  }

  void BeginForward() {
    // A forward that threw skipped its post hooks: put those groups away first.
    for (auto& g : groups) {
      if (g->active) Offload(*g);
    }
  }

  void EndForward() {
    ++stats.forwards;
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
    }
    if (ring) ring->Release();
    staging.clear();
    staging_done.clear();
    UnpinInPlace();
  }
};

GroupOffloader::GroupOffloader(std::unique_ptr<Impl> impl, GroupOffloadOptions options)
    : impl_(std::move(impl)), options_(std::move(options)) {}

GroupOffloader::~GroupOffloader() {
  if (impl_) impl_->Remove();
}

GroupOffloadStats GroupOffloader::stats() const { return impl_->stats; }

int64_t GroupOffloader::device_bytes() const {
  return (impl_->ring->allocated() ? impl_->ring->bytes() : 0) + impl_->stats.resident_bytes;
}

bool GroupOffloader::holds_slots() const { return impl_->ring->allocated() && impl_->ring->size() > 0; }

int64_t GroupOffloader::ReleaseSlots() { return impl_->ReleaseSlots(); }

int64_t GroupOffloader::bytes_needed_to_run() const {
  return (impl_->ring->allocated() ? 0 : impl_->ring->bytes()) + impl_->stats.always_on_bytes;
}

absl::StatusOr<std::unique_ptr<GroupOffloader>> GroupOffloader::Apply(
    const std::string& component, Module& root, HostWeights& weights, DeviceBackend& backend,
    const GroupOffloadOptions& requested) {
  GroupOffloadOptions options = requested;
  if (options.prefetch_depth == 0) {
    options.prefetch_depth = options.type == OffloadType::kLeafLevel && options.budget_bytes == 0 ? 4 : 1;
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
  if (options.target != OffloadTarget::kPinnedHost &&
      (options.staging_buffers < 1 || options.staging_buffer_bytes < (int64_t{1} << 16))) {
    return invalid("staging needs at least one buffer of at least 64 KiB");
  }
  auto impl = std::make_unique<Impl>();
  impl->component = component;
  impl->root = &root;
  impl->weights = &weights;
  impl->backend = &backend;
  impl->options = options;
  RETURN_IF_ERROR(impl->PlanGroups());
  // The component leaves the device before its groups take their place.
  weights.OffloadAll();
  RETURN_IF_ERROR(impl->PrepareHost());
  absl::Status device = impl->PrepareDevice();
  if (!device.ok()) {
    impl->Remove();
    return device;
  }
  impl->InstallHooks();
  return std::unique_ptr<GroupOffloader>(new GroupOffloader(std::move(impl), options));
}

}  // namespace stowage
