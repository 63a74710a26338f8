// DeviceBackend: what the offload engine and placement need from an accelerator.
//
// Two implementations: CudaBackend (the product: c10 streams, CUDA events, the caching allocator's
// statistics, cudaHostAlloc / cudaHostRegister) and SimulatedBackend (CPU tensors in a separately
// accounted pool with a byte budget, an asynchronous copy worker and an optional bandwidth limit),
// which lets CI test every offload and placement rule with exact byte counts. One conformance
// suite (tests/offload/device_backend_conformance_test.cc) runs against both.
//
// Streams: a backend has a compute stream (where forwards run), a copy stream (truly concurrent if
// supports_streams()) and a transform stream (device-side work on copied bytes). Copies issued with
// CopyToDeviceAsync run on the copy stream in issue order; an event recorded on one stream can be
// waited for by another without blocking the host.
//
// Thread-safety: all methods may be called from any thread; the engine calls them from the
// device's request worker.
#ifndef STOWAGE_OFFLOAD_DEVICE_BACKEND_H_
#define STOWAGE_OFFLOAD_DEVICE_BACKEND_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"

namespace stowage {

// Device memory as the allocator and as the GPU see it. The process holds reserved_bytes (the
// allocator's segments: live allocations and cached free blocks) plus context_bytes (the CUDA
// context, kernels and library workspaces outside the allocator) — what nvidia-smi shows. The
// budget covers both: what new allocations may still take is budget − context − allocated
// (cached blocks are reused before new segments are reserved).
struct DeviceMemoryStats {
  int64_t allocated_bytes = 0;       // Bytes of live device allocations.
  int64_t peak_allocated_bytes = 0;  // Peak of allocated_bytes since the last ResetPeakStats().
  int64_t reserved_bytes = 0;        // Held by the allocator (CUDA: cached segments).
  int64_t peak_reserved_bytes = 0;   // Peak of reserved_bytes since the last ResetPeakStats().
  int64_t context_bytes = 0;         // Held outside the allocator (measured when the backend starts).
  int64_t budget_bytes = 0;          // Usable device memory: the budget, or the card's size.
  int64_t host_to_device_bytes = 0;  // Cumulative bytes copied host to device.
  int64_t device_to_host_bytes = 0;  // Cumulative bytes copied device to host.
  int64_t peer_to_device_bytes = 0;  // Cumulative bytes copied in from other devices (CopyFromPeer).
  // Cumulative times the allocator ran short of room under its cap, though the allocation may then
  // have succeeded. allocator_retries: allocations that succeeded only after the allocator gave back
  // every cached block (CUDA's caching allocator synchronises the device, frees its unused segments
  // and allocates again: the run stalls, the next allocations cost driver calls). allocator_ooms:
  // out-of-memory errors the allocator raised, including those a library caught and recovered from
  // (cuDNN then picks a plan with a smaller workspace, slower) — a run can succeed with them. On
  // the simulated device: its refused AllocateBytes calls, and retries with caching_allocator.
  int64_t allocator_retries = 0;
  int64_t allocator_ooms = 0;
  // The largest allocation the allocator refused since the last ResetPeakStats() or
  // BeginPeakWindow() (0: none): what a shortfall asked for, so placement can tell one that more
  // room would have served from a library's probe for a workspace larger than any room.
  int64_t largest_refused_bytes = 0;

  // What the process holds on the device now and at its peak, as the GPU sees it.
  int64_t process_bytes() const { return reserved_bytes + context_bytes; }
  int64_t peak_process_bytes() const { return peak_reserved_bytes + context_bytes; }
  // Room for new allocations within the budget; INT64_MAX without one.
  int64_t free_bytes() const {
    return budget_bytes <= 0 ? INT64_MAX : budget_bytes - context_bytes - allocated_bytes;
  }
};

// A point in one stream's work. Opaque; created by the backend that records it.
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  // True once all work before the event has finished (non-blocking).
  virtual bool Query() = 0;
  // Blocks the calling host thread until the event has completed.
  virtual void Wait() = 0;
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  // "cuda:0" or "sim:0".
  virtual std::string name() const = 0;
  // Where LibTorch tensors of this device live (CUDA, or CPU for the simulator).
  virtual c10::Device torch_device() const = 0;
  virtual bool supports_streams() const = 0;

  // Uninitialised device buffer of `bytes` bytes (a uint8 tensor). A device out-of-memory error is
  // a status for which IsDeviceOom() holds.
  virtual absl::StatusOr<at::Tensor> AllocateBytes(int64_t bytes) = 0;
  // A device copy of a host tensor (same dtype and shape), on the compute stream; counts
  // host_to_device_bytes.
  virtual absl::StatusOr<at::Tensor> CopyToDevice(const at::Tensor& host) = 0;
  // Copies a tensor that lives on another device of this process (a peer) onto this device,
  // device to device (CUDA: a peer copy over NVLink or PCIe, never through the host); counted in
  // peer_to_device_bytes. The caller keeps both devices' owners still while it runs.
  virtual absl::StatusOr<at::Tensor> CopyFromPeer(const at::Tensor& src) = 0;

  // Copies `src` (host, same number of bytes) into `dst` (device) on the copy stream, without
  // blocking the host when `src` is pinned or registered. Counts host_to_device_bytes.
  virtual void CopyToDeviceAsync(const at::Tensor& dst, const at::Tensor& src) = 0;
  // The transform stream: device-side transforms of bytes the copy stream brought, e.g. widening
  // 8-bit weights from a scratch area into a slot (offload/compressed_host_store.h). It has its own
  // order, so a transform of one group overlaps the next group's copy and the compute: whoever
  // enqueues makes it wait for the copy it reads (TransformStreamWait on a copy-stream event) and for
  // the compute that last read what it overwrites (on a compute-stream event), and
  // records what waits for it (RecordOnTransformStream). `work` issues LibTorch ops or kernels on
  // this device's tensors only, on the current stream; it must not throw nor block the host.
  //   Simulator: `work` runs on the transform worker thread, in the stream's order.
  //   CUDA: `work` runs on the calling thread, at once, under a stream guard of the transform
  //   stream, so the kernels it launches are queued there (the host does not wait for them).
  // Counts no host_to_device_bytes (what `work` reads is already on the device).
  virtual void EnqueueOnTransformStream(std::function<void()> work) = 0;
  virtual std::unique_ptr<DeviceEvent> RecordOnTransformStream() = 0;
  // Makes future transform-stream work wait for `event` (host does not block).
  virtual void TransformStreamWait(DeviceEvent& event) = 0;
  virtual std::unique_ptr<DeviceEvent> RecordOnCopyStream() = 0;
  virtual std::unique_ptr<DeviceEvent> RecordOnComputeStream() = 0;
  // Makes future compute-stream work wait for `event` (host does not block).
  virtual void ComputeStreamWait(DeviceEvent& event) = 0;
  // Makes future copy-stream work wait for `event` (host does not block).
  virtual void CopyStreamWait(DeviceEvent& event) = 0;
  // Blocks the host until all work on every stream (compute, copy, transform) is done.
  virtual void Synchronize() = 0;

  // Host memory the device can copy from at full speed: a fresh pinned buffer (uint8 CPU tensor)…
  virtual absl::StatusOr<at::Tensor> AllocatePinnedHost(int64_t bytes) = 0;
  // …or existing memory pinned in place (for example a read-only mmap of a safetensors file).
  virtual absl::Status RegisterHostMemory(void* ptr, int64_t bytes, bool read_only) = 0;
  virtual absl::Status UnregisterHostMemory(void* ptr) = 0;
  // True when `ptr` lies in host memory the device already reads at full speed: a pinned buffer
  // (AllocatePinnedHost) or a registered range. Such memory cannot be registered again (CUDA
  // refuses both); pinning code skips it.
  virtual bool IsPageLockedHostMemory(const void* ptr) = 0;

  // Device memory now. The peaks cover everything since the last ResetPeakStats(), peak windows
  // (below) included.
  DeviceMemoryStats GetMemoryStats() {
    DeviceMemoryStats stats = ReadMemoryStats();
    stats.peak_allocated_bytes = std::max(stats.peak_allocated_bytes, peak_floor_allocated_.load());
    stats.peak_reserved_bytes = std::max(stats.peak_reserved_bytes, peak_floor_reserved_.load());
    return stats;
  }
  void ResetPeakStats() {
    peak_floor_allocated_.store(0);
    peak_floor_reserved_.store(0);
    ResetAllocatorPeaks();
  }
  // A peak measurement inside the one ResetPeakStats() started (placement measures each
  // component's run with it while the request's peak is measured around them all):
  // BeginPeakWindow() returns the bytes allocated now, and WindowPeakAllocated() is the highest
  // allocated_bytes since — until the next BeginPeakWindow() or ResetPeakStats(). GetMemoryStats()
  // still reports the peaks since ResetPeakStats(). Called by the device's worker.
  int64_t BeginPeakWindow() {
    const DeviceMemoryStats stats = ReadMemoryStats();
    RaiseTo(peak_floor_allocated_, stats.peak_allocated_bytes);
    RaiseTo(peak_floor_reserved_, stats.peak_reserved_bytes);
    ResetAllocatorPeaks();
    return stats.allocated_bytes;
  }
  int64_t WindowPeakAllocated() { return ReadMemoryStats().peak_allocated_bytes; }
  // Usable device memory for this server, context included: 0 restores the whole device. On CUDA
  // this sets the caching allocator's memory fraction to (budget − context) / device size, so the
  // allocator's segments plus the context stay within it and allocations beyond fail as
  // out-of-memory. INVALID_ARGUMENT when the budget does not even hold the context.
  virtual absl::Status SetMemoryBudget(int64_t bytes) = 0;
  // The budget as last set (0: none), unlike DeviceMemoryStats::budget_bytes, which is the card's
  // size on CUDA without one.
  virtual int64_t MemoryBudget() const = 0;
  // Returns cached but unused device memory to the driver (CUDA); no-op elsewhere.
  virtual void ReleaseCachedMemory() = 0;
  // Where the allocator's reserved but unallocated memory lies, for an out-of-memory decision's
  // reason (DescribeAllocatorSegments); "" for a backend without a caching allocator (the default
  // simulator) or where the allocator gives no snapshot. CUDA: LibTorch's segments (one cudaMalloc each) — free room in a segment that also
  // holds a live block is what the allocator's retry after a refusal cannot give back. The
  // simulator with SimulatedBackendOptions::caching_allocator: its cached blocks, each a free
  // segment (its retry gives them all back). Taken after the failed run unwound, so it shows what
  // the long-lived tensors (weights, caches) pin, not the failed run's own activations.
  virtual std::string AllocatorLayoutNote() { return ""; }
  // Measures again what the process holds outside the allocator and, when a budget is set,
  // re-applies it against the new figure. Libraries load kernels and create workspaces at their
  // first use, so on CUDA this grows after start-up (by about 0.8 GB on an H200 running Z-Image);
  // the worker calls it after each warm-up run and each request. A reading less than 64 MiB below the
  // figure counted leaves it (CUDA: NVML's reading swings by tens of MiB between requests; counting
  // a low one would let the allocator fill room a high one then takes); a larger drop is taken.
  // Returns the context bytes before and after. No-op (nothing changes) where there is no such
  // memory to measure.
  struct ContextChange {
    int64_t before = 0;
    int64_t after = 0;
  };
  // The context figure to count after a reading of `measured` bytes when `counted` were counted:
  // a reading at most kContextJitterBytes below keeps `counted` (the allocator stays capped against
  // the higher figure); a larger drop is memory really given back; a rise is taken.
  static constexpr int64_t kContextJitterBytes = int64_t{64} << 20;
  static int64_t CountedContextBytes(int64_t counted, int64_t measured) {
    return measured + kContextJitterBytes < counted ? measured : std::max(counted, measured);
  }
  virtual ContextChange RefreshContextBytes() { return {}; }
  // Memory set aside for the context to grow into while code runs for the first time (a warm-up,
  // the first request after a change on the device): counted in context_bytes and kept out of the
  // allocator's share of the budget until set back to 0. No-op where the context does not grow
  // (the simulator counts it only with SimulatedBackendOptions::count_context_reserve).
  virtual void SetContextReserve(int64_t bytes) { (void)bytes; }

  // Called once on the thread that will issue this device's compute (the device worker), before
  // any: with `high_priority` the compute stream is one of the highest priority (CUDA: that
  // thread's current stream becomes a high-priority stream of LibTorch's pool; the copy and
  // transform streams keep the lowest). Elsewhere, and without it, nothing changes.
  virtual void EnterComputeThread(bool high_priority) { (void)high_priority; }

 protected:
  // The allocator's statistics: peaks since the last ResetAllocatorPeaks(), which sets them to
  // what is allocated (reserved) now.
  virtual DeviceMemoryStats ReadMemoryStats() = 0;
  virtual void ResetAllocatorPeaks() = 0;

 private:
  static void RaiseTo(std::atomic<int64_t>& floor, int64_t value) {
    int64_t seen = floor.load();
    while (seen < value && !floor.compare_exchange_weak(seen, value)) {
    }
  }
  // The peaks reached before the windows since ResetPeakStats() began (the allocator's own peaks
  // restart with each window).
  std::atomic<int64_t> peak_floor_allocated_{0};
  std::atomic<int64_t> peak_floor_reserved_{0};
};

// One segment of a caching allocator (one cudaMalloc on CUDA): its size, the bytes its live
// allocations hold, and its largest free block.
struct AllocatorSegment {
  int64_t total_bytes = 0;
  int64_t allocated_bytes = 0;
  int64_t largest_free_block = 0;
};
// Segments of this size or less serve allocations of 1–10 MiB on CUDA (LibTorch's 20 MiB large
// buffer) and small ones (2 MiB segments): many small weights share them.
inline constexpr int64_t kSmallAllocatorSegmentBytes = int64_t{20} << 20;
// What `segments` hold beyond live allocations, e.g. "allocator: 3117457408 bytes reserved but
// unallocated: 2909798400 in 143 segments that hold live blocks too (1288490188 of them in 120
// segments of 20 MiB or less), 207659008 in 3 free segments; the largest free block 429916160
// bytes"; "allocator: nothing reserved beyond live allocations" when nothing is free.
std::string DescribeAllocatorSegments(const std::vector<AllocatorSegment>& segments);

struct SimulatedBackendOptions {
  // Device memory budget in bytes; 0 is unlimited.
  int64_t budget_bytes = 0;
  // Host-to-device bandwidth in bytes per second for asynchronous copies; 0 is unlimited.
  int64_t bandwidth_bytes_per_second = 0;
  // Index in the name ("sim:<index>").
  int index = 0;
  // False emulates a device without a copy stream (CopyToDeviceAsync still works, synchronously).
  bool supports_streams = true;
  // True emulates a host that refuses to page-lock memory (RegisterHostMemory fails, as cudaHostRegister
  // does under a low RLIMIT_MEMLOCK).
  bool refuse_host_registration = false;
  // Device memory held outside the pool, as a CUDA context is: counted against the budget.
  int64_t context_bytes = 0;
  // True: SetContextReserve is counted in context_bytes and against the budget, as on CUDA. Off
  // by default: the simulated context never grows, and a warm-up's reserve would only shrink the
  // exact budgets tests set.
  bool count_context_reserve = false;
  // True: a caching allocator as LibTorch's CUDA one — freed allocations stay reserved as cached
  // blocks (counted in reserved_bytes and against the budget); an allocation takes the smallest cached
  // block that holds it (the rest stays cached), else new room; when the cached blocks leave too
  // little room, they are all given back first and the allocation tried again (allocator_retries),
  // and refused (allocator_ooms) only when it still does not fit. Cached blocks too small for an
  // allocation are the fragments that force a retry; freed pieces of a split block are not merged
  // again (CUDA merges neighbours), and unlike CUDA — whose segments holding a live block stay — a
  // retry gives back every cached byte, so nothing within free_bytes() is refused. Without a budget
  // nothing is given back: reserved only grows. ReleaseCachedMemory gives the cached blocks back. Off
  // by default: reserved is what is allocated.
  bool caching_allocator = false;
};

std::unique_ptr<DeviceBackend> CreateSimulatedBackend(const SimulatedBackendOptions& options);

// True when this build has CUDA support and a CUDA device is visible.
bool CudaAvailable();
// What LibTorch's CUDA caching allocator runs with, for the log ("CUDA allocator: expandable
// segments on"); says so when the build has no CUDA.
std::string CudaAllocatorNote();
struct CudaBackendOptions {
  // AllocatePinnedHost takes anonymous memory on a 2 MiB boundary, advised to transparent huge
  // pages, and registers it in place (cudaHostRegister) instead of calling cudaHostAlloc (4 KiB
  // pages): fewer pages to fault in and lock when a store prepares its groups. Taken only where the
  // kernel runs transparent huge pages ("always" or "madvise"; TransparentHugePageMode). On the
  // H200 (bench/results/compressed_h200/stream_formats_e866b27.jsonl, probes_e866b27.jsonl): pinning
  // 5.39 GB/s against cudaHostAlloc's 2.92, an int4 copy of the 10 GiB stack prepared in 2.6 s
  // against 3.4, the same step. offload_bench --pinned_huge_pages=false for cudaHostAlloc.
  bool pinned_huge_pages = true;
};
// Fails with FAILED_PRECONDITION when the build has no CUDA or the device does not exist.
absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateCudaBackend(int device_index,
                                                                 const CudaBackendOptions& options = {});

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_DEVICE_BACKEND_H_
