// The CUDA device backend: LibTorch's caching allocator for device memory (so activations and
// weights share one accounting), two pool streams (copies; transforms of copied bytes), CUDA events
// between the streams, and cudaHostAlloc / cudaHostRegister for host memory. Compiled to a
// FAILED_PRECONDITION stub when the build has no CUDA (STOWAGE_WITH_CUDA unset).
#include "offload/device_backend.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/process_memory.h"
#include "base/status_macros.h"

#ifdef STOWAGE_WITH_CUDA
#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#if __has_include(<c10/cuda/CUDAAllocatorConfig.h>)
#include <c10/cuda/CUDAAllocatorConfig.h>
#endif
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace stowage {

std::string DescribeAllocatorSegments(const std::vector<AllocatorSegment>& segments) {
  int64_t pinned_free = 0, pinned_count = 0, small_free = 0, small_count = 0;
  int64_t free_segments_bytes = 0, free_segments = 0, largest = 0;
  for (const AllocatorSegment& segment : segments) {
    const int64_t unallocated = segment.total_bytes - segment.allocated_bytes;
    if (unallocated <= 0) continue;
    largest = std::max(largest, segment.largest_free_block);
    if (segment.allocated_bytes == 0) {
      free_segments_bytes += unallocated;
      ++free_segments;
      continue;
    }
    pinned_free += unallocated;
    ++pinned_count;
    if (segment.total_bytes <= kSmallAllocatorSegmentBytes) {
      small_free += unallocated;
      ++small_count;
    }
  }
  if (pinned_count == 0 && free_segments == 0) return "allocator: nothing reserved beyond live allocations";
  return absl::StrCat("allocator: ", pinned_free + free_segments_bytes, " bytes reserved but unallocated: ",
                      pinned_free, " in ", pinned_count, " segments that hold live blocks too (", small_free,
                      " of them in ", small_count, " segments of 20 MiB or less), ", free_segments_bytes, " in ",
                      free_segments, " free segments; the largest free block ", largest, " bytes");
}

#ifdef STOWAGE_WITH_CUDA
namespace {

// LibTorch's allocator snapshot: a list of segments (1.13) or a struct holding them (2.x).
[[maybe_unused]] const std::vector<c10::cuda::CUDACachingAllocator::SegmentInfo>& SegmentsOf(
    const std::vector<c10::cuda::CUDACachingAllocator::SegmentInfo>& snapshot) {
  return snapshot;
}
template <typename Snapshot>
const auto& SegmentsOf(const Snapshot& snapshot) {
  return snapshot.segments;
}

// The device memory this process holds as the driver reports it (what nvidia-smi lists per
// process), through NVML loaded at run time: libnvidia-ml ships with the driver, not the toolkit, so
// nothing links it. -1 when NVML or this process's entry is not there (then the caller falls back to
// the device-wide figure). When this process is the device's only compute process, what the device
// uses beyond it counts too: nvidia-smi's memory.used includes it and no process's entry lists it
// (the multi-tenant runs' nvidia-smi peaks read 81–177 MiB above the process's own on the H200). That
// share is NVML's used memory (v2: what nvidia-smi shows, the firmware's reserve excluded) less this
// process's; left out when that call is missing, when other processes share the device (their
// allocations would race the two reads), or when it reads outside 0–1 GiB. NVML's declarations are
// repeated here (its stable C ABI) so that no NVML header is needed to build.
int64_t ProcessDeviceBytesFromNvml(int cuda_index) {
  using NvmlDevice = void*;
  struct NvmlProcess {  // nvmlProcessInfo_t (v2 layout, used by the _v3 call).
    unsigned int pid;
    unsigned long long used_gpu_memory;
    unsigned int gpu_instance_id;
    unsigned int compute_instance_id;
  };
  struct NvmlMemoryV2 {  // nvmlMemory_v2_t.
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
  };
  static void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return -1;
  using Init = int (*)();
  using ByPci = int (*)(const char*, NvmlDevice*);
  using Procs = int (*)(NvmlDevice, unsigned int*, NvmlProcess*);
  using MemoryV2 = int (*)(NvmlDevice, NvmlMemoryV2*);
  static const auto init = reinterpret_cast<Init>(::dlsym(lib, "nvmlInit_v2"));
  static const auto by_pci = reinterpret_cast<ByPci>(::dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
  static const auto procs = reinterpret_cast<Procs>(::dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3"));
  static const auto memory_v2 = reinterpret_cast<MemoryV2>(::dlsym(lib, "nvmlDeviceGetMemoryInfo_v2"));
  if (init == nullptr || by_pci == nullptr || procs == nullptr) return -1;
  static const int initialised = init();
  if (initialised != 0) return -1;
  char bus_id[32] = {0};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), cuda_index) != cudaSuccess) return -1;
  NvmlDevice device = nullptr;
  if (by_pci(bus_id, &device) != 0) return -1;
  std::vector<NvmlProcess> list(64);
  unsigned int count = static_cast<unsigned int>(list.size());
  if (procs(device, &count, list.data()) != 0) return -1;
  const auto self = static_cast<unsigned int>(::getpid());
  int64_t mine = -1;
  for (unsigned int i = 0; i < count && i < list.size(); ++i) {
    if (list[i].pid == self) mine = static_cast<int64_t>(list[i].used_gpu_memory);
  }
  if (mine < 0) return -1;
  if (count == 1 && memory_v2 != nullptr) {
    NvmlMemoryV2 memory{};
    memory.version = static_cast<unsigned int>(sizeof(NvmlMemoryV2)) | (2u << 24);
    if (memory_v2(device, &memory) == 0) {
      const int64_t beyond = static_cast<int64_t>(memory.used) - mine;
      if (beyond > 0 && beyond <= (int64_t{1} << 30)) mine += beyond;
    }
  }
  return mine;
}

absl::Status CudaStatus(cudaError_t err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // Clear the sticky-free error so later calls are not blamed.
  if (err == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
  }
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

// CatchAsStatus for LibTorch calls on the device: a refused call (an out-of-memory allocation, a
// copy CUDA rejects) also clears the thread's last CUDA error, so the next kernel launch's check is
// not blamed for it.
template <typename Fn>
absl::Status CatchCuda(absl::string_view what, Fn&& fn) {
  absl::Status status = CatchAsStatus(what, std::forward<Fn>(fn));
  if (!status.ok()) cudaGetLastError();
  return status;
}

// Per device index, the largest allocation LibTorch's caching allocator refused since that device's
// backend last reset its peaks: written by the allocator's out-of-memory observer (attached once per
// process; the allocator has no way to detach one, so it writes here rather than into a backend),
// read and reset by the backends.
constexpr int kMaxDevices = 64;
std::atomic<int64_t>& LargestRefused(int device) {
  static std::array<std::atomic<int64_t>, kMaxDevices> largest{};
  return largest[static_cast<size_t>(std::clamp(device, 0, kMaxDevices - 1))];
}
void ObserveRefusedAllocations() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::cuda::CUDACachingAllocator::attachOutOfMemoryObserver(
        [](int64_t device, auto allocated, auto /*device_total*/, auto /*device_free*/) {
          if (device < 0 || device >= kMaxDevices) return;
          std::atomic<int64_t>& largest = LargestRefused(static_cast<int>(device));
          const int64_t bytes = static_cast<int64_t>(allocated);
          int64_t seen = largest.load();
          while (seen < bytes && !largest.compare_exchange_weak(seen, bytes)) {
          }
        });
  });
}

class CudaEvent : public DeviceEvent {
 public:
  at::cuda::CUDAEvent event{cudaEventDisableTiming};
  bool Query() override { return event.query(); }
  void Wait() override { event.synchronize(); }
};

class CudaBackend : public DeviceBackend {
 public:
  CudaBackend(int index, const CudaBackendOptions& options)
      : index_(index),
        options_(options),
        // Huge pages only where the kernel gives them: with transparent huge pages off ("never")
        // registering 4 KiB pages in place is slower than cudaHostAlloc (offload_bench's pin_probe).
        huge_pinned_(options.pinned_huge_pages && TransparentHugePagesOn()),
        device_(c10::kCUDA, static_cast<c10::DeviceIndex>(index)),
        copy_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index())),
        transform_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index())),
        compute_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_.index())) {
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    c10::cuda::CUDAGuard guard(device_);
    // LibTorch initialises CUDA and its caching allocator lazily, at the first allocation; the
    // allocator's statistics calls fail ("Invalid device argument") before that.
    (void)at::empty({1}, at::TensorOptions().dtype(at::kByte).device(device_));
    ObserveRefusedAllocations();
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      total_bytes_ = static_cast<int64_t>(total_bytes);
      // What this process holds outside the caching allocator: the context, module images and
      // libraries' own allocations — this process's memory as the driver reports it (NVML, with
      // the device's share no process lists when it is alone there) less the allocator's segments.
      // Without NVML, the device's used memory less the segments (other processes on the card then
      // count too).
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index());
      int64_t process = ProcessDeviceBytesFromNvml(index);
      if (process < 0) process = static_cast<int64_t>(total_bytes - free_bytes);
      context_bytes_.store(std::max<int64_t>(0, process - stats.reserved_bytes[0].current));
    }
  }

  std::string name() const override { return absl::StrCat("cuda:", index_); }
  c10::Device torch_device() const override { return device_; }
  bool supports_streams() const override { return true; }

  absl::StatusOr<at::Tensor> AllocateBytes(int64_t bytes) override {
    at::Tensor out;
    RETURN_IF_ERROR(CatchCuda(absl::StrCat(name(), " allocation of ", bytes, " bytes"), [&] {
      out = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device_));
    }));
    return out;
  }

  absl::StatusOr<at::Tensor> CopyToDevice(const at::Tensor& host) override {
    at::Tensor out;
    RETURN_IF_ERROR(CatchCuda(absl::StrCat("copy to ", name()), [&] {
      out = host.to(device_, /*non_blocking=*/false, /*copy=*/true);
    }));
    h2d_ += static_cast<int64_t>(host.nbytes());
    return out;
  }

  absl::StatusOr<at::Tensor> CopyFromPeer(const at::Tensor& src) override {
    at::Tensor out;
    RETURN_IF_ERROR(CatchCuda(absl::StrCat("peer copy to ", name()), [&] {
      c10::cuda::CUDAGuard guard(device_);
      out = src.to(device_, /*non_blocking=*/false, /*copy=*/true);
    }));
    p2d_ += static_cast<int64_t>(src.nbytes());
    return out;
  }

  void CopyToDeviceAsync(const at::Tensor& dst, const at::Tensor& src) override {
    TORCH_CHECK(dst.nbytes() == src.nbytes(), "CopyToDeviceAsync: size mismatch");
    TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "CopyToDeviceAsync: not contiguous");
    c10::cuda::CUDAGuard guard(device_);
    const cudaError_t err = cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes(),
                                            cudaMemcpyHostToDevice, copy_stream_.stream());
    TORCH_CHECK(err == cudaSuccess, "cudaMemcpyAsync: ", cudaGetErrorString(err));
    h2d_ += static_cast<int64_t>(src.nbytes());
  }

  void EnqueueOnTransformStream(std::function<void()> work) override {
    c10::cuda::CUDAGuard guard(device_);
    c10::cuda::CUDAStreamGuard stream_guard(transform_stream_);
    work();
  }
  std::unique_ptr<DeviceEvent> RecordOnTransformStream() override {
    auto event = std::make_unique<CudaEvent>();
    event->event.record(transform_stream_);
    return event;
  }
  void TransformStreamWait(DeviceEvent& event) override {
    static_cast<CudaEvent&>(event).event.block(transform_stream_);
  }

  std::unique_ptr<DeviceEvent> RecordOnCopyStream() override {
    auto event = std::make_unique<CudaEvent>();
    event->event.record(copy_stream_);
    return event;
  }
  std::unique_ptr<DeviceEvent> RecordOnComputeStream() override {
    auto event = std::make_unique<CudaEvent>();
    event->event.record(c10::cuda::getCurrentCUDAStream(device_.index()));
    return event;
  }
  void ComputeStreamWait(DeviceEvent& event) override {
    static_cast<CudaEvent&>(event).event.block(c10::cuda::getCurrentCUDAStream(device_.index()));
  }
  void CopyStreamWait(DeviceEvent& event) override {
    static_cast<CudaEvent&>(event).event.block(copy_stream_);
  }
  void Synchronize() override {
    c10::cuda::CUDAGuard guard(device_);
    copy_stream_.synchronize();
    transform_stream_.synchronize();
    c10::cuda::getCurrentCUDAStream(device_.index()).synchronize();
  }

  absl::StatusOr<at::Tensor> AllocatePinnedHost(int64_t bytes) override {
    // Any thread may allocate (a compressed store allocates ahead on a thread of its own): this
    // device current, so no other device gets a context.
    const c10::cuda::CUDAGuard guard(device_);
    if (huge_pinned_ && bytes > 0) return AllocateHugePinned(bytes);
    void* ptr = nullptr;
    RETURN_IF_ERROR(CudaStatus(cudaHostAlloc(&ptr, static_cast<size_t>(bytes), cudaHostAllocDefault),
                               absl::StrCat("cudaHostAlloc of ", bytes, " bytes")));
    return at::from_blob(
        ptr, {bytes}, [](void* p) { cudaFreeHost(p); }, at::TensorOptions().dtype(at::kByte));
  }

  // CudaBackendOptions::pinned_huge_pages: anonymous memory on a 2 MiB boundary, advised to
  // transparent huge pages, registered in place (the registration faults the pages in).
  absl::StatusOr<at::Tensor> AllocateHugePinned(int64_t bytes) {
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    const size_t length = (static_cast<size_t>(bytes) + page - 1) / page * page;
    const size_t mapped = length + kHuge;
    void* base = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("mmap of ", mapped, " bytes for pinned memory failed"));
    }
    const uintptr_t start = reinterpret_cast<uintptr_t>(base);
    const uintptr_t aligned = (start + kHuge - 1) / kHuge * kHuge;
    if (aligned > start) ::munmap(base, aligned - start);
    const uintptr_t end = start + mapped;
    if (end > aligned + length) ::munmap(reinterpret_cast<void*>(aligned + length), end - (aligned + length));
    void* ptr = reinterpret_cast<void*>(aligned);
    (void)::madvise(ptr, length, MADV_HUGEPAGE);
    // Fault the pages in here, before registering: the driver page-locks under locks that other
    // CUDA calls of the process wait on (a compressed store pins the next group on its own thread
    // while the quantizer launches and copies), so the registration should only lock what is there.
    auto* bytes_ptr = static_cast<volatile uint8_t*>(ptr);
    for (size_t offset = 0; offset < length; offset += page) bytes_ptr[offset] = 0;
    if (absl::Status registered = CudaStatus(cudaHostRegister(ptr, length, cudaHostRegisterPortable),
                                             absl::StrCat("cudaHostRegister of ", length, " bytes"));
        !registered.ok()) {
      ::munmap(ptr, length);
      return registered;
    }
    return at::from_blob(
        ptr, {bytes},
        [length](void* p) {
          cudaHostUnregister(p);
          ::munmap(p, length);
        },
        at::TensorOptions().dtype(at::kByte));
  }

  absl::Status RegisterHostMemory(void* ptr, int64_t bytes, bool read_only) override {
    unsigned int flags = cudaHostRegisterPortable;
    // A read-only mapping (mmap'd safetensors) can only be registered with the read-only flag.
    if (read_only) flags |= cudaHostRegisterReadOnly;
    return CudaStatus(cudaHostRegister(ptr, static_cast<size_t>(bytes), flags),
                      absl::StrCat("cudaHostRegister of ", bytes, " bytes"));
  }
  absl::Status UnregisterHostMemory(void* ptr) override {
    return CudaStatus(cudaHostUnregister(ptr), "cudaHostUnregister");
  }
  bool IsPageLockedHostMemory(const void* ptr) override {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
      cudaGetLastError();  // Clear it: later calls must not be blamed.
      return false;
    }
    return attributes.type == cudaMemoryTypeHost;
  }

  DeviceMemoryStats ReadMemoryStats() override {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index());
    DeviceMemoryStats out;
    // Index 0 is the aggregate over small and large pools.
    out.allocated_bytes = stats.allocated_bytes[0].current;
    out.peak_allocated_bytes = stats.allocated_bytes[0].peak;
    out.reserved_bytes = stats.reserved_bytes[0].current;
    out.peak_reserved_bytes = stats.reserved_bytes[0].peak;
    out.context_bytes = context_bytes_.load() + context_reserve_.load();
    out.budget_bytes = budget_bytes_ > 0 ? budget_bytes_ : total_bytes_;
    out.host_to_device_bytes = h2d_.load();
    out.peer_to_device_bytes = p2d_.load();
    out.device_to_host_bytes = d2h_.load();
    out.allocator_retries = stats.num_alloc_retries;
    out.allocator_ooms = stats.num_ooms;
    out.largest_refused_bytes = LargestRefused(device_.index()).load();
    return out;
  }
  void ResetAllocatorPeaks() override {
    c10::cuda::CUDACachingAllocator::resetPeakStats(device_.index());
    LargestRefused(device_.index()).store(0);
  }
  absl::Status SetMemoryBudget(int64_t bytes) override {
    if (bytes < 0) return absl::InvalidArgumentError("memory budget must be >= 0");
    if (bytes > total_bytes_) {
      return absl::InvalidArgumentError(absl::StrCat("memory budget ", bytes, " exceeds ", name(),
                                                     "'s ", total_bytes_, " bytes"));
    }
    if (bytes > 0 && bytes <= context_bytes_.load()) {
      return absl::InvalidArgumentError(absl::StrCat("memory budget ", bytes, " does not hold ", name(),
                                                     "'s context of ", context_bytes_.load(), " bytes"));
    }
    budget_bytes_ = bytes;
    ApplyBudget();
    return absl::OkStatus();
  }
  int64_t MemoryBudget() const override { return budget_bytes_; }
  void ReleaseCachedMemory() override { c10::cuda::CUDACachingAllocator::emptyCache(); }
  // Called on the out-of-memory path: it must not throw (a snapshot is refused under
  // PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync, which the environment may set): "" then.
  std::string AllocatorLayoutNote() override {
    try {
      const auto snapshot = c10::cuda::CUDACachingAllocator::snapshot();
      std::vector<AllocatorSegment> segments;
      for (const auto& info : SegmentsOf(snapshot)) {
        if (static_cast<int>(info.device) != index_) continue;
        AllocatorSegment segment;
        segment.total_bytes = static_cast<int64_t>(info.total_size);
        segment.allocated_bytes = static_cast<int64_t>(info.allocated_size);
        for (const auto& block : info.blocks) {
          if (!block.allocated) {
            segment.largest_free_block = std::max(segment.largest_free_block, static_cast<int64_t>(block.size));
          }
        }
        segments.push_back(segment);
      }
      return DescribeAllocatorSegments(segments);
    } catch (const std::exception&) {
      return "";
    }
  }

  void EnterComputeThread(bool high_priority) override {
    if (!high_priority) return;
    // The calling thread's current stream is this backend's compute stream (RecordOnComputeStream,
    // ComputeStreamWait and every LibTorch op it issues use it). The same stream on every thread the
    // worker goes on on (DeviceWorker's renew_thread): the work queued by the one before stays ahead
    // of the new thread's, and the allocator's blocks keep the stream they were allocated on.
    c10::cuda::setCurrentCUDAStream(compute_stream_);
  }

  void SetContextReserve(int64_t bytes) override {
    context_reserve_.store(std::max<int64_t>(0, bytes));
    ApplyBudget();
  }

  ContextChange RefreshContextBytes() override {
    ContextChange change{context_bytes_.load(), context_bytes_.load()};
    c10::cuda::CUDAGuard guard(device_);
    const int64_t process = ProcessDeviceBytesFromNvml(index_);
    // Without NVML the device-wide figure would count other processes: keep the start-up measure.
    if (process < 0) return change;
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index());
    // NVML's reading of what lies outside the allocator swings by tens of MiB between requests
    // (2118 -> 2144 -> 2120 MiB in multi-tenant run 11, H100), and an allocator capped against a low
    // reading took the budget 7 MiB past its limit once the context read high again: a small drop
    // keeps the figure counted (CountedContextBytes).
    change.after = CountedContextBytes(change.before, std::max<int64_t>(0, process - stats.reserved_bytes[0].current));
    if (change.after == change.before) return change;
    context_bytes_.store(change.after);
    ApplyBudget();
    return change;
  }

 private:
  int index_;
  CudaBackendOptions options_;
  bool huge_pinned_;  // AllocatePinnedHost takes huge-page memory (options_.pinned_huge_pages, THP on).
  c10::Device device_;
  c10::cuda::CUDAStream copy_stream_;
  c10::cuda::CUDAStream transform_stream_;
  c10::cuda::CUDAStream compute_stream_;  // EnterComputeThread(high_priority): every worker thread's stream.
  int64_t total_bytes_ = 0;
  int64_t budget_bytes_ = 0;
  // Written by the worker (construction, RefreshContextBytes); read by stats callers.
  std::atomic<int64_t> context_bytes_{0};

  // Set aside for the context to grow into (SetContextReserve).
  std::atomic<int64_t> context_reserve_{0};

  // The allocator's segments may take what the context (and its reserve) leave of the budget (at
  // least nothing). LibTorch checks the fraction only when it reserves a new segment: when the cap
  // falls below what the allocator already holds (the context grew after the allocator had filled
  // its share — multi-tenant run 11 stayed 7 MiB over its budget for three requests so), its cached
  // free blocks go back to the driver at once, so the process comes back under the budget as far
  // as live allocations allow.
  void ApplyBudget() {
    const int64_t context = context_bytes_.load() + context_reserve_.load();
    const int64_t cap = budget_bytes_ == 0 ? total_bytes_ : std::max<int64_t>(0, budget_bytes_ - context);
    c10::cuda::CUDACachingAllocator::setMemoryFraction(static_cast<double>(cap) / static_cast<double>(total_bytes_),
                                                       device_.index());
    if (budget_bytes_ > 0 &&
        c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index()).reserved_bytes[0].current > cap) {
      ReleaseCachedMemory();
    }
  }
  std::atomic<int64_t> h2d_{0};
  std::atomic<int64_t> p2d_{0};
  std::atomic<int64_t> d2h_{0};
};

}  // namespace

bool CudaAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

std::string CudaAllocatorNote() {
#if __has_include(<c10/cuda/CUDAAllocatorConfig.h>)
  return absl::StrCat("CUDA allocator: expandable segments ",
                      c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig::expandable_segments() ? "on" : "off");
#else
  return "CUDA allocator: this LibTorch does not say whether its segments are expandable";
#endif
}

absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateCudaBackend(int device_index,
                                                                 const CudaBackendOptions& options) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device_index < 0 || device_index >= count) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device_index, " not present (", count, " visible)"));
  }
  return std::unique_ptr<DeviceBackend>(new CudaBackend(device_index, options));
}

#else  // !STOWAGE_WITH_CUDA

bool CudaAvailable() { return false; }

std::string CudaAllocatorNote() { return "CUDA allocator: none (this build has no CUDA)"; }

absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateCudaBackend(int device_index,
                                                                 const CudaBackendOptions& options) {
  (void)options;
  return absl::FailedPreconditionError(absl::StrCat(
      "CUDA device ", device_index,
      " requested, but this build has no CUDA support (build with --config=cuda or the CMake "
      "route in deploy/gpu_host)"));
}

#endif  // STOWAGE_WITH_CUDA

}  // namespace stowage
