#include "offload/group_offload.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>

#include <malloc.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include <ATen/Functions.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/out_of_memory.h"
#include "offload/safetensors.h"
#include "base/status_macros.h"

namespace stowage {
namespace {

constexpr int64_t kAlign = 256;
int64_t AlignUp(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

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

// Copies large buffers with a few dedicated threads: one core's memcpy (~5-10 GB/s) is far below
// the host-to-device link, so staging pageable memory needs several in parallel.
class MemcpyPool {
 public:
  explicit MemcpyPool(int threads) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this, i] { Loop(i); });
  }
  ~MemcpyPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      ++generation_;
    }
    cv_.notify_all();
    for (std::thread& t : workers_) t.join();
  }
  void Copy(uint8_t* dst, const uint8_t* src, int64_t n) {
    constexpr int64_t kMinSlice = int64_t{1} << 20;
    const int parts = static_cast<int>(std::min<int64_t>(workers_.size() + 1, std::max<int64_t>(1, n / kMinSlice)));
    if (parts <= 1) {
      std::memcpy(dst, src, static_cast<size_t>(n));
      return;
    }
    const int64_t slice = (n + parts - 1) / parts;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dst_ = dst;
      src_ = src;
      n_ = n;
      slice_ = slice;
      active_ = parts - 1;  // Workers 0..parts-2 take slices 1..parts-1; the caller takes slice 0.
      pending_ = parts - 1;
      ++generation_;
    }
    cv_.notify_all();
    std::memcpy(dst, src, static_cast<size_t>(std::min(slice, n)));
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return pending_ == 0; });
  }

 private:
  void Loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      uint8_t* dst;
      const uint8_t* src;
      int64_t begin, end;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (stop_) return;
        if (index >= active_) continue;
        begin = (index + 1) * slice_;
        end = std::min(n_, begin + slice_);
        dst = dst_;
        src = src_;
      }
      if (begin < end) std::memcpy(dst + begin, src + begin, static_cast<size_t>(end - begin));
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  uint8_t* dst_ = nullptr;
  const uint8_t* src_ = nullptr;
  int64_t n_ = 0, slice_ = 0;
  int active_ = 0, pending_ = 0;
};

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
    std::string name;
    std::vector<TensorRef> tensors;
    std::vector<Module*> members;  // Modules whose forwards use the group.
    int64_t bytes = 0;             // Packed, each tensor aligned to kAlign.
    bool ring = true;              // False: always-on for its owner's forward.
    bool resident = false;         // Kept on the device (budget).
    at::Tensor host_packed;        // kPinnedHost: contiguous pinned copy.
    std::shared_ptr<SafetensorsFile> file;  // kDisk.
    at::Tensor device_buffer;      // Resident and always-on groups while onloaded.
    int slot = -1;                 // Ring slot holding this group's bytes, -1 if none.
    bool active = false;
    std::set<Module*> done;        // Members finished since onload.
  };
  struct Slot {
    at::Tensor buffer;
    Group* owner = nullptr;
    std::unique_ptr<DeviceEvent> copied;    // Copy of owner's bytes complete.
    std::unique_ptr<DeviceEvent> released;  // Compute finished reading the slot.
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
  std::vector<Slot> slots;
  std::vector<Module*> hooked;
  std::vector<at::Tensor> staging;
  std::vector<void*> registered;  // Host ranges pinned in place (kPageableHost).
  bool slots_allocated = false;
  std::vector<std::unique_ptr<DeviceEvent>> staging_done;
  std::unique_ptr<MemcpyPool> memcpy_pool;
  size_t next_staging = 0;
  std::vector<Group*> order;  // Streamed ring groups in execution order (first forward).
  bool recording = true;
  int64_t cursor = 0;         // Absolute position of the next expected ring onload.
  GroupOffloadStats stats;

  // --- Building ---------------------------------------------------------------------------------

  absl::Status BuildGroups() {
    std::map<TensorSlot*, HostWeights::Entry*> entry_of;
    for (HostWeights::Entry& e : weights->entries()) entry_of[e.slot] = &e;
    auto add_tensors = [&](Group& g, Module& m, bool subtree) {
      auto take = [&](Module& owner) {
        for (TensorSlot& slot : owner.slots()) {
          auto it = entry_of.find(&slot);
          if (it == entry_of.end()) continue;
          g.tensors.push_back(TensorRef{it->second, g.bytes});
          g.bytes += AlignUp(static_cast<int64_t>(it->second->host.nbytes()));
          entry_of.erase(it);
        }
      };
      if (subtree) {
        m.ForEachModule(take);
      } else {
        take(m);
      }
    };

    if (options.type == OffloadType::kBlockLevel) {
      std::vector<Module*> lists;
      if (options.block_modules.empty()) {
        for (auto& [name, child] : root->children()) {
          if (child->kind() == "ModuleList") lists.push_back(child);
        }
      } else {
        for (const std::string& path : options.block_modules) {
          Module* found = nullptr;
          root->ForEachModule([&](Module& m) {
            if (m.path() == path) found = &m;
          });
          if (found == nullptr || found == root) {
            return absl::InvalidArgumentError(absl::StrCat(
                "component '", component, "': block_modules entry '", path, "' is not a submodule"));
          }
          lists.push_back(found);
        }
      }
      if (lists.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "component '", component, "': block_level found no block list (no ModuleList child of the "
            "root); name one with block_modules, or use leaf_level"));
      }
      for (Module* list : lists) {
        const auto& blocks = list->children();
        for (size_t i = 0; i < blocks.size(); i += static_cast<size_t>(options.num_blocks_per_group)) {
          auto g = std::make_unique<Group>();
          const size_t end = std::min(blocks.size(), i + static_cast<size_t>(options.num_blocks_per_group));
          g->name = absl::StrCat(list->path(), ".", i, "-", end - 1);
          for (size_t b = i; b < end; ++b) {
            add_tensors(*g, *blocks[b].second, /*subtree=*/true);
            g->members.push_back(blocks[b].second);
          }
          if (g->bytes > 0) groups.push_back(std::move(g));
        }
      }
      // Everything outside the blocks: on the device for the whole forward of the root.
      auto rest = std::make_unique<Group>();
      rest->name = "(outside blocks)";
      rest->ring = false;
      rest->members.push_back(root);
      for (HostWeights::Entry& e : weights->entries()) {
        if (entry_of.count(e.slot) == 0) continue;
        rest->tensors.push_back(TensorRef{&e, rest->bytes});
        rest->bytes += AlignUp(static_cast<int64_t>(e.host.nbytes()));
      }
      if (rest->bytes > 0) groups.push_back(std::move(rest));
    } else {
      root->ForEachModule([&](Module& m) {
        auto g = std::make_unique<Group>();
        g->name = m.path().empty() ? "(root)" : m.path();
        g->ring = m.is_leaf();
        g->members.push_back(&m);
        add_tensors(*g, m, /*subtree=*/false);
        if (g->bytes > 0) groups.push_back(std::move(g));
      });
    }
    return absl::OkStatus();
  }

  // Chooses resident groups for the budget; sets slot count and size.
  absl::Status Plan() {
    const int64_t n = options.use_stream ? options.prefetch_depth + 1 : 1;
    int64_t always_on = 0;
    std::vector<Group*> ring;
    for (auto& g : groups) {
      if (g->ring) {
        ring.push_back(g.get());
      } else {
        always_on += g->bytes;
      }
    }
    // Largest first. Among equal sizes, a low-discrepancy order of the construction index, so that
    // the groups the budget keeps resident are spread along the forward: streaming the others then
    // overlaps the resident groups' compute instead of queueing behind one long resident stretch.
    std::vector<double> spread(groups.size());
    for (size_t i = 0; i < groups.size(); ++i) {
      const double x = static_cast<double>(i) * 0.6180339887498949;
      spread[i] = x - static_cast<int64_t>(x);
    }
    std::map<Group*, double> key;
    for (size_t i = 0; i < groups.size(); ++i) key[groups[i].get()] = spread[i];
    std::sort(ring.begin(), ring.end(), [&](Group* a, Group* b) {
      if (a->bytes != b->bytes) return a->bytes > b->bytes;
      return key[a] < key[b];
    });
    if (options.budget_bytes > 0) {
      // Candidate slot sizes: 0 (everything resident) or any group's size. Groups larger than the
      // slot must be resident; the rest fill the remaining budget greedily, largest first.
      std::set<int64_t> sizes = {0};
      for (Group* g : ring) sizes.insert(g->bytes);
      int64_t best_resident = -1;
      int64_t best_slot = 0;
      std::vector<Group*> best;
      for (int64_t s : sizes) {
        int64_t free = options.budget_bytes - always_on - (s > 0 ? n * s : 0);
        std::vector<Group*> chosen;
        int64_t resident = 0;
        for (Group* g : ring) {
          if (g->bytes > s) {
            free -= g->bytes;
            resident += g->bytes;
            chosen.push_back(g);
          }
        }
        if (free < 0) continue;
        for (Group* g : ring) {
          if (g->bytes <= s && g->bytes <= free) {
            free -= g->bytes;
            resident += g->bytes;
            chosen.push_back(g);
          }
        }
        // Slot size is the largest group left streaming (may be below s).
        int64_t slot = 0;
        for (Group* g : ring) {
          if (std::find(chosen.begin(), chosen.end(), g) == chosen.end()) slot = std::max(slot, g->bytes);
        }
        if (resident > best_resident) {
          best_resident = resident;
          best_slot = slot;
          best = chosen;
        }
      }
      if (best_resident < 0) {
        const int64_t smallest = ring.empty() ? 0 : ring.back()->bytes;
        return absl::InvalidArgumentError(absl::StrCat(
            "component '", component, "': budget_bytes ", options.budget_bytes,
            " is smaller than its smallest working set: ", always_on, " always-on bytes + ", n,
            " slot(s) of at least ", smallest, " bytes (one group)"));
      }
      for (Group* g : best) g->resident = true;
      stats.slot_bytes = best_slot;
    } else {
      stats.slot_bytes = ring.empty() ? 0 : ring.front()->bytes;
    }
    stats.groups = static_cast<int>(groups.size());
    for (Group* g : ring) {
      if (g->resident) {
        ++stats.resident_groups;
        stats.resident_bytes += g->bytes;
      } else {
        ++stats.streamed_groups;
        stats.streamed_bytes += g->bytes;
      }
    }
    stats.slots = stats.streamed_groups > 0 ? n : 0;
    if (stats.streamed_groups == 0) stats.slot_bytes = 0;
    stats.always_on_bytes = always_on;
    stats.working_set_bytes = stats.slots * stats.slot_bytes + always_on + stats.resident_bytes;
    return absl::OkStatus();
  }

  // Prepares the host side of the non-resident groups.
  absl::Status PrepareHost() {
    if (options.target == OffloadTarget::kPinnedHost) {
      // Pinned chunks, each group packed contiguously; the pageable originals are released group by
      // group, so RAM holds the weights once. Chunks of about 256 MiB, each sized exactly to the consecutive groups it holds: cudaHostAlloc
      // pins every page it returns, so any slack would be resident RAM that holds nothing.
      const int64_t chunk_target = int64_t{256} << 20;
      // Copying from a mapping of a file that changed on disk would pack zeros or new bytes.
      RETURN_IF_ERROR(weights->CheckSourceFiles());
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

  // Allocates the ring's slots (once, or again after ReleaseSlots). On failure none are kept.
  absl::Status AllocateSlots() {
    if (slots_allocated) return absl::OkStatus();
    for (Slot& slot : slots) {
      absl::StatusOr<at::Tensor> buffer = backend->AllocateBytes(stats.slot_bytes);
      if (!buffer.ok()) {
        for (Slot& s : slots) s.buffer = at::Tensor();
        return buffer.status();
      }
      slot.buffer = *std::move(buffer);
    }
    slots_allocated = true;
    return absl::OkStatus();
  }

  int64_t ReleaseSlots() {
    if (!slots_allocated || slots.empty()) return 0;
    for (auto& g : groups) {
      if (g->active) return 0;  // Inside a forward.
    }
    backend->Synchronize();  // No copy or compute may still touch the buffers.
    for (Slot& slot : slots) {
      if (slot.owner != nullptr) slot.owner->slot = -1;
      slot.owner = nullptr;
      slot.copied.reset();
      slot.released.reset();
      slot.buffer = at::Tensor();
    }
    slots_allocated = false;
    ++stats.slot_releases;
    return stats.slots * stats.slot_bytes;
  }

  absl::Status PrepareDevice() {
    slots.resize(static_cast<size_t>(stats.slots));
    RETURN_IF_ERROR(AllocateSlots());
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

  void LoadIntoSlot(Group& g, int64_t s) {
    Slot& slot = slots[static_cast<size_t>(s)];
    if (slot.owner != nullptr && slot.owner != &g) slot.owner->slot = -1;
    if (g.slot >= 0 && g.slot != s) slots[static_cast<size_t>(g.slot)].owner = nullptr;
    if (slot.released) backend->CopyStreamWait(*slot.released);
    CopyGroup(g, slot.buffer);
    slot.copied = backend->RecordOnCopyStream();
    slot.owner = &g;
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
    if (!slots_allocated) {
      absl::Status allocated = AllocateSlots();
      if (!allocated.ok()) {
        throw DeviceOutOfMemory(backend->name(), stats.slots * stats.slot_bytes,
                                backend->GetMemoryStats().allocated_bytes,
                                backend->GetMemoryStats().budget_bytes);
      }
      // The buffers came from the compute stream's pool and may have been freed by work still
      // queued there: copies into them wait for it.
      std::unique_ptr<DeviceEvent> ready = backend->RecordOnComputeStream();
      backend->CopyStreamWait(*ready);
    }
    const int64_t n = static_cast<int64_t>(slots.size());
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
    if (g.slot >= 0 && slots[static_cast<size_t>(g.slot)].owner == &g) {
      // Prefetched (or still there from its last run).
      backend->ComputeStreamWait(*slots[static_cast<size_t>(g.slot)].copied);
    } else {
      ++stats.sync_onloads;
      LoadIntoSlot(g, slot_index);
      backend->ComputeStreamWait(*slots[static_cast<size_t>(g.slot)].copied);
    }
    PointAt(g, slots[static_cast<size_t>(g.slot)].buffer);
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
      if (next.slot == s && slots[static_cast<size_t>(s)].owner == &next) continue;
      if (next.active) continue;
      // Never overwrite a slot that a running group reads (possible after an out-of-order onload
      // served from a slot other than its position's).
      Group* holder = slots[static_cast<size_t>(s)].owner;
      if (holder != nullptr && holder->active) continue;
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
    if (g.slot >= 0) slots[static_cast<size_t>(g.slot)].released = backend->RecordOnComputeStream();
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
    slots.clear();
    slots_allocated = false;
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
  return (impl_->slots_allocated ? impl_->stats.slots * impl_->stats.slot_bytes : 0) +
         impl_->stats.resident_bytes;
}

bool GroupOffloader::holds_slots() const { return impl_->slots_allocated && !impl_->slots.empty(); }

int64_t GroupOffloader::ReleaseSlots() { return impl_->ReleaseSlots(); }

int64_t GroupOffloader::bytes_needed_to_run() const {
  return (impl_->slots_allocated ? 0 : impl_->stats.slots * impl_->stats.slot_bytes) +
         impl_->stats.always_on_bytes;
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
  RETURN_IF_ERROR(impl->BuildGroups());
  RETURN_IF_ERROR(impl->Plan());
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
