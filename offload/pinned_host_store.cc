#include "offload/pinned_host_store.h"

#include <malloc.h>

#include <cstring>
#include <future>
#include <utility>
#include <vector>

#include "base/status_macros.h"
#include "offload/memcpy_pool.h"
#include "offload/safetensors.h"

namespace stowage {

absl::StatusOr<std::unique_ptr<HostStore>> PinnedHostStore::Create(const std::vector<PlannedGroup>& groups,
                                                                   HostWeights& weights, DeviceBackend& backend,
                                                                   int copy_threads) {
  // Copying from a mapping of a file that changed on disk would pack zeros or new bytes.
  RETURN_IF_ERROR(weights.CheckSourceFiles());
  std::unique_ptr<PinnedHostStore> store(new PinnedHostStore(backend, ResolveGroups(groups, weights)));
  // The groups to pack, in order, in pinned chunks of about kChunkTarget bytes (whole groups).
  constexpr int64_t kChunkTarget = int64_t{256} << 20;
  std::vector<size_t> pending;
  for (size_t i = 0; i < store->groups_.size(); ++i) {
    if (!store->groups_[i].resident) pending.push_back(i);
  }
  struct Chunk {
    size_t first = 0, end = 0;  // Its groups: pending[first, end).
    int64_t bytes = 0;
  };
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < pending.size();) {
    Chunk c{i, i, 0};
    do {
      c.bytes += store->groups_[pending[c.end]].bytes;
      ++c.end;
    } while (c.end < pending.size() && c.bytes < kChunkTarget);
    i = c.end;
    chunks.push_back(c);
  }
  // The next chunk is allocated on a thread of its own while this one is filled, and the weights
  // are copied by `copy_threads` threads (one core's memcpy from a file's mapping is far below what
  // the host can read).
  MemcpyPool pool(copy_threads - 1);
  constexpr int64_t kTrimEvery = int64_t{64} << 20;
  int64_t heap_freed = 0;  // Bytes of heap originals freed since the last malloc_trim.
  std::future<TimedAllocation> next;
  if (!chunks.empty()) next = AllocatePinnedAhead(backend, chunks[0].bytes);
  for (size_t c = 0; c < chunks.size(); ++c) {
    TimedAllocation allocated = next.get();
    store->stats_.prepare_pin_alloc_s += allocated.seconds;
    if (c + 1 < chunks.size()) next = AllocatePinnedAhead(backend, chunks[c + 1].bytes);
    RETURN_IF_ERROR(allocated.buffer.status());
    const at::Tensor chunk = *std::move(allocated.buffer);
    store->stats_.pinned_host_bytes += chunks[c].bytes;
    int64_t used = 0;  // Bytes of `chunk` given to groups.
    for (size_t i = chunks[c].first; i < chunks[c].end; ++i) {
      StoreGroup& g = store->groups_[pending[i]];
      at::Tensor& packed = store->packed_[pending[i]];
      packed = chunk.narrow(0, used, g.bytes);
      used += g.bytes;
      store->stats_.bytes_per_forward += g.bytes;
      uint8_t* base = packed.data_ptr<uint8_t>();
      for (StoreTensor& t : g.tensors) {
        const at::Tensor& host = t.entry->host;
        const auto bytes = static_cast<int64_t>(host.nbytes());
        pool.Copy(base + t.offset, static_cast<const uint8_t*>(host.data_ptr()), bytes);
        // Copied from a safetensors mapping: drop its pages from RSS now, not when the whole file
        // is unmapped (that would hold the weights twice in RSS until the last group).
        const int64_t released = ReleaseMappedPages(host.data_ptr(), bytes);
        store->stats_.mapped_bytes_released += released;
        at::Tensor view = packed.narrow(0, t.offset, bytes).view(host.scalar_type()).view(host.sizes());
        weights.ReplaceHost(*t.entry, view);  // A heap original is freed here (`host` is the view now).
        heap_freed += bytes - released;
      }
      // glibc keeps freed blocks below its mmap threshold (which rises to 32 MiB as large blocks
      // are freed) in the heap: without handing them back as they go, RSS would hold the freed
      // originals beside the pinned copies until the end — a third of an FP8 transformer's weights
      // (its attention projections, under 32 MiB each).
      if (heap_freed >= kTrimEvery) {
        ::malloc_trim(0);
        heap_freed = 0;
      }
    }
  }
  ::malloc_trim(0);
  return std::unique_ptr<HostStore>(std::move(store));
}

std::unique_ptr<DeviceEvent> PinnedHostStore::CopyGroupToSlot(int group, const at::Tensor& slot,
                                                               const at::Tensor& /*scratch*/) {
  const auto index = static_cast<size_t>(group);
  const at::Tensor& packed = packed_[index];
  if (packed.defined()) {
    backend_->CopyToDeviceAsync(slot.narrow(0, 0, groups_[index].bytes), packed);
    return backend_->RecordOnCopyStream();
  }
  return CopyTensorsDirect(*backend_, groups_[index], slot);  // A resident group, copied once.
}

}  // namespace stowage
