#include "offload/host_weights.h"

#include <sys/mman.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>

#include <ATen/Functions.h>

#include "absl/strings/str_cat.h"
#include "base/parallel_ranges.h"
#include "base/status_macros.h"
#include "offload/compression.h"
#include "offload/safetensors.h"

namespace stowage {

absl::StatusOr<std::unique_ptr<HostWeights>> HostWeights::Capture(Module& root) {
  std::unique_ptr<HostWeights> weights(new HostWeights());
  weights->root_ = &root;
  absl::Status status;
  // Deferred FP8 weights another capture holds: their bytes are unwritten, and only it writes them.
  root.ForEachModule([&](Module& module) {
    if (status.ok() && module.deferred_fp8_held() > 0) {
      status = absl::FailedPreconditionError(absl::StrCat(
          "'", module.path(), "' has deferred FP8 weights another host copy holds unwritten; capture the tree once"));
    }
  });
  if (!status.ok()) return status;
  root.ForEachSlot([&](Module& module, TensorSlot& slot) {
    if (!status.ok()) return;
    if (!slot.value.defined() || !slot.value.device().is_cpu() || !slot.value.is_contiguous()) {
      status = absl::FailedPreconditionError(absl::StrCat(
          "tensor '", module.SlotPath(slot), "' is not a defined contiguous CPU tensor"));
      return;
    }
    weights->bytes_ += static_cast<int64_t>(slot.value.nbytes());
    if (!slot.is_buffer) weights->parameter_count_ += slot.value.numel();
    weights->entries_.push_back(Entry{&module, &slot, slot.value});
  });
  if (!status.ok()) return status;
  std::map<const TensorSlot*, size_t> index;
  for (size_t i = 0; i < weights->entries_.size(); ++i) index[weights->entries_[i].slot] = i;
  // Deferred FP8 weights: from now on this object writes them (or a compressed store makes its copy
  // from their sources).
  root.ForEachModule([&](Module& module) {
    for (DeferredFp8& d : module.TakeDeferredFp8()) {
      const size_t codes = index.at(&module.slots()[static_cast<size_t>(d.codes)]);
      const size_t scales = index.at(&module.slots()[static_cast<size_t>(d.scales)]);
      const auto at = static_cast<int>(weights->deferred_.size());
      weights->entries_[codes].deferred = at;
      weights->entries_[scales].deferred = at;
      weights->deferred_.push_back(Deferred{codes, scales, std::move(d.source)});
    }
  });
  std::vector<bool> grouped(weights->entries_.size(), false);
  root.ForEachModule([&](Module& module) {
    for (const auto& group : module.adjacent_groups()) {
      std::vector<size_t> members;
      for (const auto& [owner, slot] : group) {
        auto it = index.find(&owner->slots()[static_cast<size_t>(slot)]);
        // Not captured, in an earlier group or named twice: leave the whole group alone.
        if (it == index.end() || grouped[it->second] ||
            std::find(members.begin(), members.end(), it->second) != members.end()) {
          members.clear();
          break;
        }
        members.push_back(it->second);
      }
      if (members.size() < 2) continue;
      for (size_t m : members) grouped[m] = true;
      weights->adjacent_.push_back(std::move(members));
    }
  });
  return weights;
}

void HostWeights::Materialize(const Entry& entry) {
  if (!unwritten(entry)) return;
  Deferred& d = deferred_[static_cast<size_t>(entry.deferred)];
  const at::Tensor& codes = entries_[d.codes].host;
  const at::Tensor& scales = entries_[d.scales].host;
  const int64_t rows = d.source.size(0);
  const int64_t per_row = d.source.numel() / std::max<int64_t>(rows, 1);
  TORCH_CHECK(codes.numel() == d.source.numel() && codes.element_size() == 1 && scales.numel() == rows &&
                  scales.scalar_type() == at::kFloat,
              "deferred FP8 weight: codes of ", codes.numel(), " values and ", scales.numel(),
              " scales do not fit a source of ", d.source.numel(), " values in ", rows, " rows");
  // Row-local: each thread quantizes its own rows in chunks, the same bytes as one Quantize() of the
  // whole weight.
  const int64_t chunk_rows = std::max<int64_t>(1, kQuantizeChunkElements / 8 / std::max<int64_t>(per_row, 1));
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  auto* code_bytes = static_cast<uint8_t*>(codes.data_ptr());
  auto* scale_values = static_cast<float*>(scales.data_ptr());
  ParallelRanges(chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int64_t start = c * chunk_rows, n = std::min(chunk_rows, rows - start);
      const at::Tensor part = d.source.narrow(0, start, n);
      const QuantizedTensor q = Quantize(part, CompressFormat::kFp8E4M3);
      std::memcpy(code_bytes + start * per_row, q.q.data_ptr(), static_cast<size_t>(n * per_row));
      std::memcpy(scale_values + start, q.scale.data_ptr(), static_cast<size_t>(n) * sizeof(float));
      if (part.is_contiguous()) (void)ReleaseMappedPages(part.data_ptr(), static_cast<int64_t>(part.nbytes()));
    }
  });
  d.written = true;
  entry.module->DeferredFp8Written();
}

void HostWeights::MaterializeDeferred() {
  for (const Deferred& d : deferred_) {
    if (!d.written) Materialize(entries_[d.codes]);
  }
}

// Page-aligned anonymous memory holding one component's host copies and nothing else.
struct HostWeights::Arena {
  void* base = nullptr;
  size_t bytes = 0;
  ~Arena() {
    if (base != nullptr) ::munmap(base, bytes);
  }
  uintptr_t begin() const { return reinterpret_cast<uintptr_t>(base); }
  uintptr_t end() const { return begin() + bytes; }
};

namespace {

constexpr uintptr_t kArenaAlignment = 64;

uintptr_t PageSize() { return static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE)); }
uintptr_t RoundUp(uintptr_t value, uintptr_t to) { return (value + to - 1) / to * to; }

}  // namespace

absl::Status HostWeights::MoveIntoArena(const std::vector<Entry*>& entries) {
  // Host copies that share a storage (tied weights, views of one buffer) move together: one span
  // per storage, from its first used byte to its last, so they keep sharing it.
  struct Span {
    uintptr_t begin = UINTPTR_MAX;
    uintptr_t end = 0;
    uintptr_t offset = 0;  // In the arena.
    std::vector<Entry*> entries;
  };
  std::map<const void*, Span> spans;
  for (Entry* e : entries) {
    Span& span = spans[e->host.storage().data()];
    const auto begin = reinterpret_cast<uintptr_t>(e->host.data_ptr());
    span.begin = std::min(span.begin, begin);
    span.end = std::max(span.end, begin + e->host.nbytes());
    span.entries.push_back(e);
  }
  uintptr_t total = 0;
  for (auto& [storage, span] : spans) {
    span.offset = total;
    total = RoundUp(total + (span.end - span.begin), kArenaAlignment);
  }
  auto arena = std::make_shared<Arena>();
  arena->bytes = RoundUp(std::max<uintptr_t>(total, 1), PageSize());
  void* base = ::mmap(nullptr, arena->bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mapping an arena of ", arena->bytes,
                                                     " bytes for host copies failed: ", std::strerror(errno)));
  }
  arena->base = base;
  // One storage over the arena; every moved host copy is a view of it, so the arena lives as long
  // as any of them (or a slot pointing at one).
  std::shared_ptr<Arena> owner = arena;
  at::Tensor whole = at::from_blob(
      base, {static_cast<int64_t>(arena->bytes)}, [owner](void*) mutable { owner.reset(); },
      at::TensorOptions().dtype(at::kByte));
  // Storage by storage: copy, then point its host copies at the arena, so its heap memory is freed
  // before the next one is copied (RAM grows by about one storage, not by the component).
  for (auto& [storage, span] : spans) {
    std::memcpy(static_cast<uint8_t*>(base) + span.offset, reinterpret_cast<const void*>(span.begin),
                span.end - span.begin);
    for (Entry* e : span.entries) {
      const auto begin = reinterpret_cast<uintptr_t>(e->host.data_ptr());
      const auto offset = static_cast<int64_t>(span.offset + (begin - span.begin));
      at::Tensor view = whole.narrow(0, offset, static_cast<int64_t>(e->host.nbytes()))
                            .view(e->host.scalar_type())
                            .view(e->host.sizes());
      ReplaceHost(*e, std::move(view));  // The heap copy is freed once nothing else holds it.
    }
  }
  arenas_.push_back(arena);
  return absl::OkStatus();
}

absl::StatusOr<HostWeights::Lockable> HostWeights::LockableRegions(DeviceBackend& backend) {
  MaterializeDeferred();  // The regions hold the bytes the copies read.
  Lockable out;
  std::vector<const void*> addresses;
  addresses.reserve(entries_.size());
  for (const Entry& e : entries_) addresses.push_back(e.host.data_ptr());
  const auto files = MappedFilesContaining(addresses);
  std::set<uintptr_t> regions_seen;
  auto add = [&](uintptr_t begin, uintptr_t end, bool read_only) {
    if (regions_seen.insert(begin).second) {
      out.regions.push_back(HostRegion{begin, RoundUp(end, PageSize()), read_only});
    }
  };
  std::vector<Entry*> heap;
  for (Entry& e : entries_) {
    if (e.host.nbytes() == 0) continue;
    const auto at = reinterpret_cast<uintptr_t>(e.host.data_ptr());
    bool placed = false;
    for (const auto& file : files) {
      const auto begin = reinterpret_cast<uintptr_t>(file->mapping());
      if (at >= begin && at < begin + static_cast<uintptr_t>(file->mapping_bytes())) {
        add(begin, begin + static_cast<uintptr_t>(file->mapping_bytes()), /*read_only=*/true);
        placed = true;
        break;
      }
    }
    for (size_t i = 0; !placed && i < arenas_.size(); ++i) {
      std::shared_ptr<Arena> arena = arenas_[i].lock();
      if (arena != nullptr && at >= arena->begin() && at < arena->end()) {
        add(arena->begin(), arena->end(), /*read_only=*/false);
        placed = true;
      }
    }
    if (placed) continue;
    if (backend.IsPageLockedHostMemory(e.host.data_ptr())) {
      out.already_locked_bytes += static_cast<int64_t>(e.host.nbytes());
      continue;
    }
    heap.push_back(&e);
  }
  // Forget arenas no host copy uses any more.
  arenas_.erase(std::remove_if(arenas_.begin(), arenas_.end(), [](const auto& a) { return a.expired(); }),
                arenas_.end());
  if (!heap.empty()) {
    for (const Entry* e : heap) out.moved_to_arena_bytes += static_cast<int64_t>(e->host.nbytes());
    RETURN_IF_ERROR(MoveIntoArena(heap));
    const std::shared_ptr<Arena> arena = arenas_.back().lock();
    add(arena->begin(), arena->end(), /*read_only=*/false);
#if defined(__GLIBC__)
    ::malloc_trim(0);  // Give the freed heap pages back: RAM holds one copy.
#endif
  }
  std::sort(out.regions.begin(), out.regions.end(),
            [](const HostRegion& a, const HostRegion& b) { return a.begin < b.begin; });
  return out;
}

// Placement unpins a component on its device's worker before the component can go; this only
// catches weights pinned outside placement (tests, benchmarks).
HostWeights::~HostWeights() {
  Unpin();
  // Deferred weights still unwritten go back to their modules: a later capture takes them over.
  for (Deferred& d : deferred_) {
    if (d.written) continue;
    Module& module = *entries_[d.codes].module;
    const auto slot = [&](size_t e) { return static_cast<int>(entries_[e].slot - module.slots().data()); };
    module.DeferFp8(slot(d.codes), slot(d.scales), std::move(d.source), /*returned=*/true);
  }
}

absl::Status HostWeights::PinInPlace(DeviceBackend& backend) {
  if (pinned_by_ != nullptr) return absl::OkStatus();
  last_pin_moved_bytes_ = 0;
  absl::StatusOr<Lockable> lockable = LockableRegions(backend);
  if (lockable.ok()) last_pin_moved_bytes_ = lockable->moved_to_arena_bytes;
  absl::StatusOr<HostPinLease> lease =
      lockable.ok() ? HostPins::Global().Pin(backend, lockable->regions) : lockable.status();
  if (!lease.ok()) {
    return absl::Status(lease.status().code(),
                        absl::StrCat("pinning ", bytes_, " bytes of host copies: ", lease.status().message()));
  }
  pinned_ = *std::move(lease);
  pinned_by_ = &backend;
  return absl::OkStatus();
}

void HostWeights::Unpin() {
  if (pinned_by_ == nullptr) return;
  pinned_by_->Synchronize();  // No copy may still read the pages.
  pinned_.Release();
  pinned_by_ = nullptr;
}

absl::Status HostWeights::EnqueueGroupCopies(DeviceBackend& backend, const std::vector<size_t>& group) {
  int64_t total = 0;
  for (size_t m : group) total += static_cast<int64_t>(entries_[m].host.nbytes());
  ASSIGN_OR_RETURN(at::Tensor packed, backend.AllocateBytes(total));
  int64_t offset = 0;
  for (size_t m : group) {
    const at::Tensor& host = entries_[m].host;
    const int64_t bytes = static_cast<int64_t>(host.nbytes());
    at::Tensor dst = packed.narrow(0, offset, bytes).view(host.scalar_type()).view(host.sizes());
    if (bytes > 0) backend.CopyToDeviceAsync(dst, host);
    entries_[m].slot->value = std::move(dst);
    offset += bytes;
  }
  return absl::OkStatus();
}

absl::Status HostWeights::UndoOnload(DeviceBackend& backend, const absl::Status& status) {
  backend.RecordOnCopyStream()->Wait();  // No copy may still write what is freed.
  for (Entry& entry : entries_) entry.slot->value = at::Tensor();
  return status;
}

absl::StatusOr<std::unique_ptr<DeviceEvent>> HostWeights::OnloadAllAsync(DeviceBackend& backend) {
  if (pinned_by_ == nullptr) {
    return absl::FailedPreconditionError(
        "an onload that does not wait needs page-locked host copies (a copy from pageable memory waits)");
  }
  MaterializeDeferred();  // Written when pinned; nothing then.
  // Memory the allocator hands out may have been freed by work still queued on the compute stream.
  backend.CopyStreamWait(*backend.RecordOnComputeStream());
  // The adjacent groups, then every other tensor alone, all on the copy stream.
  std::vector<std::vector<size_t>> groups = adjacent_;
  std::vector<bool> grouped(entries_.size(), false);
  for (const std::vector<size_t>& group : adjacent_) {
    for (size_t m : group) grouped[m] = true;
  }
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (!grouped[i]) groups.push_back({i});
  }
  for (const std::vector<size_t>& group : groups) {
    const absl::Status enqueued = EnqueueGroupCopies(backend, group);
    if (!enqueued.ok()) return UndoOnload(backend, enqueued);
  }
  return backend.RecordOnCopyStream();
}

absl::Status HostWeights::OnloadAll(DeviceBackend& backend) {
  MaterializeDeferred();
  // Memory the allocator hands out may have been freed by work still queued on the compute stream:
  // the copy stream starts after it.
  if (!adjacent_.empty()) backend.CopyStreamWait(*backend.RecordOnComputeStream());
  // Adjacent groups first: one allocation each, the members' copies side by side in group order.
  // The copies run on the copy stream; once a group's copies are done its mapped host pages leave
  // this process's RSS (ReleaseMappedPages), one group behind the copies being enqueued, so a
  // component read from a safetensors mapping holds about two groups of its pages at a time rather
  // than all of its adjacent weights (most of a transformer: Q/K/V, the MLP's input projections).
  std::vector<bool> done(entries_.size(), false);
  const std::vector<size_t>* in_flight = nullptr;  // The group whose copies the event follows.
  std::unique_ptr<DeviceEvent> in_flight_copied;
  auto release_in_flight = [&] {
    if (in_flight == nullptr) return;
    in_flight_copied->Wait();
    if (pinned_by_ == nullptr) {
      for (size_t m : *in_flight) {
        (void)ReleaseMappedPages(entries_[m].host.data_ptr(), static_cast<int64_t>(entries_[m].host.nbytes()));
      }
    }
    in_flight = nullptr;
  };
  for (const std::vector<size_t>& group : adjacent_) {
    const absl::Status enqueued = EnqueueGroupCopies(backend, group);
    if (!enqueued.ok()) return UndoOnload(backend, enqueued);
    for (size_t m : group) done[m] = true;
    if (pinned_by_ != nullptr) continue;  // Pinned pages stay: one wait for every group, below.
    std::unique_ptr<DeviceEvent> copied = backend.RecordOnCopyStream();
    release_in_flight();
    in_flight = &group;
    in_flight_copied = std::move(copied);
  }
  // The last group's copies (every group's: one copy stream): the compute stream (and the pages
  // released) wait for them.
  if (in_flight != nullptr) {
    release_in_flight();
  } else if (!adjacent_.empty()) {
    backend.RecordOnCopyStream()->Wait();
  }
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (done[i]) continue;
    absl::StatusOr<at::Tensor> device = backend.CopyToDevice(entries_[i].host);
    if (!device.ok()) {
      for (size_t j = 0; j < entries_.size(); ++j) entries_[j].slot->value = at::Tensor();
      return device.status();
    }
    entries_[i].slot->value = *std::move(device);
    // A host copy that is a safetensors mapping stays in the page cache for the next onload; this
    // process's RSS stops counting it (the device copy is what runs). Pinned pages stay put: no
    // system call per tensor that could not release them.
    if (pinned_by_ == nullptr) {
      (void)ReleaseMappedPages(entries_[i].host.data_ptr(), static_cast<int64_t>(entries_[i].host.nbytes()));
    }
  }
  return absl::OkStatus();
}

absl::Status HostWeights::OnloadFromPeer(DeviceBackend& backend) {
  std::vector<at::Tensor> copies;
  copies.reserve(entries_.size());
  for (Entry& entry : entries_) {
    if (!entry.slot->value.defined() || entry.slot->value.is_same(entry.host)) {
      return absl::FailedPreconditionError("OnloadFromPeer: a weight is not on a device (the component is not resident)");
    }
    absl::StatusOr<at::Tensor> copy = backend.CopyFromPeer(entry.slot->value);
    if (!copy.ok()) return copy.status();  // `copies` frees what was copied so far.
    copies.push_back(*std::move(copy));
  }
  for (size_t i = 0; i < entries_.size(); ++i) entries_[i].slot->value = std::move(copies[i]);
  return absl::OkStatus();
}

void HostWeights::OffloadAll() {
  root_->ReleaseDeviceCaches();
  for (Entry& entry : entries_) entry.slot->value = at::Tensor();
}

void HostWeights::PointAtHost() {
  MaterializeDeferred();
  root_->ReleaseDeviceCaches();
  for (Entry& entry : entries_) entry.slot->value = entry.host;
}

absl::Status HostWeights::CheckSourceFiles() const {
  std::vector<const void*> addresses;
  addresses.reserve(entries_.size());
  for (const Entry& entry : entries_) addresses.push_back(entry.host.data_ptr());
  for (const Deferred& d : deferred_) {
    if (!d.written) addresses.push_back(d.source.data_ptr());  // Read when written.
  }
  for (const auto& file : MappedFilesContaining(addresses)) {
    absl::Status status = file->CheckUnchanged();
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

void HostWeights::ReplaceHost(Entry& entry, at::Tensor host) {
  // A replacement is a copy of the host bytes: they must have been written before it was made.
  TORCH_CHECK(!unwritten(entry), "ReplaceHost: ", entry.module->SlotPath(*entry.slot),
              " is a deferred FP8 weight not written yet (MaterializeDeferred first)");
  Unpin();  // The old host tensor may be freed: nothing of it may stay registered.
  const bool pointed_at_host = entry.slot->value.defined() && entry.slot->value.is_same(entry.host);
  entry.host = std::move(host);
  if (pointed_at_host) entry.slot->value = entry.host;
}

}  // namespace stowage
