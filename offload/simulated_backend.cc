// The simulated accelerator: device memory is host memory in a separately accounted pool with a
// byte budget, the copy stream and the transform stream are two in-order queues, each with its own
// worker thread (copies optionally at a fixed bandwidth), and the "compute stream" is the calling
// thread, so waiting on a copy or transform event blocks the caller.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <thread>

#include <ATen/Functions.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "offload/device_backend.h"
#include "base/out_of_memory.h"
#include "base/status_macros.h"

namespace stowage {
namespace {

constexpr size_t kAlignment = 64;

// Accounting shared with the deleters of every device tensor, so it outlives the backend if a
// tensor does.
struct Pool {
  absl::Mutex mu;
  int64_t allocated ABSL_GUARDED_BY(mu) = 0;
  int64_t peak ABSL_GUARDED_BY(mu) = 0;
  int64_t budget ABSL_GUARDED_BY(mu) = 0;
  int64_t h2d ABSL_GUARDED_BY(mu) = 0;
  int64_t p2d ABSL_GUARDED_BY(mu) = 0;
  int64_t d2h ABSL_GUARDED_BY(mu) = 0;
  int64_t ooms ABSL_GUARDED_BY(mu) = 0;  // AllocateBytes calls refused for the budget.
  // SimulatedBackendOptions::caching_allocator: freed allocations kept as cached blocks (sizes), their
  // sum, the allocations that fitted only after every cached block was given back, and the peak of
  // allocated + cached.
  bool caching ABSL_GUARDED_BY(mu) = false;
  std::multiset<int64_t> cached ABSL_GUARDED_BY(mu);
  int64_t cached_total ABSL_GUARDED_BY(mu) = 0;
  int64_t retries ABSL_GUARDED_BY(mu) = 0;
  int64_t peak_reserved ABSL_GUARDED_BY(mu) = 0;

  // An allocation of `bytes` ends (its tensor freed, or its host memory never came): with caching,
  // its room stays reserved as a cached block.
  void Free(int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    allocated -= bytes;
    if (caching && bytes > 0) {
      cached.insert(bytes);
      cached_total += bytes;
    }
  }
  int64_t largest_refused ABSL_GUARDED_BY(mu) = 0;  // Since the peaks were last reset.
  // SetContextReserve: counted in the context, as CUDA's backend counts it.
  int64_t context_reserve ABSL_GUARDED_BY(mu) = 0;
};

// Page-locked host memory as CUDA tracks it: registered ranges and pinned allocations (begin → end,
// disjoint), shared with the pinned allocations' deleters so it outlives the backend if they do.
struct HostLocks {
  struct Range {
    uintptr_t end;
    bool allocated;  // A pinned allocation (AllocatePinnedHost), not a registration.
  };
  absl::Mutex mu;
  std::map<uintptr_t, Range> ranges ABSL_GUARDED_BY(mu);

  // The range holding `at`, or end().
  std::map<uintptr_t, Range>::const_iterator Holding(uintptr_t at) const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    auto next = ranges.upper_bound(at);
    if (next == ranges.begin()) return ranges.end();
    auto held = std::prev(next);
    return held->second.end > at ? held : ranges.end();
  }
  bool Overlaps(uintptr_t begin, uintptr_t end) const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    auto next = ranges.lower_bound(begin);
    if (next != ranges.end() && next->first < end) return true;
    return next != ranges.begin() && std::prev(next)->second.end > begin;
  }
};

// Progress of one simulated stream: work items are numbered in issue order and finish in order.
struct StreamState {
  absl::Mutex mu;
  uint64_t issued ABSL_GUARDED_BY(mu) = 0;     // Sequence number of the last issued item.
  uint64_t completed ABSL_GUARDED_BY(mu) = 0;  // Sequence number of the last finished item.
};

class SimEvent : public DeviceEvent {
 public:
  SimEvent(std::shared_ptr<StreamState> state, uint64_t seq) : state_(std::move(state)), seq_(seq) {}
  bool Query() override {
    if (state_ == nullptr) return true;
    absl::MutexLock lock(&state_->mu);
    return state_->completed >= seq_;
  }
  void Wait() override {
    if (state_ == nullptr) return;
    absl::MutexLock lock(&state_->mu);
    // Await evaluates the condition with the lock held.
    state_->mu.Await(absl::Condition(
        +[](SimEvent* self) ABSL_NO_THREAD_SAFETY_ANALYSIS { return self->state_->completed >= self->seq_; },
        this));
  }
  // Null for a compute-stream event (complete when recorded).
  const std::shared_ptr<StreamState>& state() const { return state_; }
  uint64_t seq() const { return seq_; }

 private:
  std::shared_ptr<StreamState> state_;
  uint64_t seq_;
};

// One simulated stream: an in-order queue of copies, work and waits run by its own thread.
class SimStream {
 public:
  // Copies count their bytes in pool->h2d when they finish, taking at least bytes / bandwidth
  // seconds each when `bandwidth_bytes_per_second` > 0.
  SimStream(std::shared_ptr<Pool> pool, int64_t bandwidth_bytes_per_second)
      : pool_(std::move(pool)), bandwidth_(bandwidth_bytes_per_second), state_(std::make_shared<StreamState>()) {
    thread_ = std::thread([this] { Loop(); });
  }
  // Runs what is queued, then stops.
  ~SimStream() {
    {
      absl::MutexLock lock(&state_->mu);
      stopping_ = true;
    }
    thread_.join();
  }

  void Copy(const at::Tensor& dst, const at::Tensor& src) { Push(Item{dst, src, nullptr, nullptr, 0, 0}); }
  void Work(std::function<void()> work) { Push(Item{at::Tensor(), at::Tensor(), std::move(work), nullptr, 0, 0}); }
  // Later items wait until `event` (of any stream) has completed.
  void Wait(const SimEvent& event) {
    if (event.state() == nullptr || event.state() == state_) return;  // Complete, or earlier in this queue.
    Push(Item{at::Tensor(), at::Tensor(), nullptr, event.state(), event.seq(), 0});
  }
  std::unique_ptr<SimEvent> Record() { return std::make_unique<SimEvent>(state_, Issued()); }
  uint64_t Issued() {
    absl::MutexLock lock(&state_->mu);
    return state_->issued;
  }
  const std::shared_ptr<StreamState>& state() const { return state_; }

 private:
  // A copy (src set), work (work set) or a wait for another stream's event (wait_state set).
  struct Item {
    at::Tensor dst;
    at::Tensor src;
    std::function<void()> work;
    std::shared_ptr<StreamState> wait_state;
    uint64_t wait_seq;
    uint64_t seq;
  };

  void Push(Item item) {
    absl::MutexLock lock(&state_->mu);
    item.seq = ++state_->issued;
    queue_.push_back(std::move(item));
  }

  void Loop() {
    for (;;) {
      Item item;
      {
        absl::MutexLock lock(&state_->mu);
        // Await evaluates the condition with the lock held.
        state_->mu.Await(absl::Condition(
            +[](SimStream* self) ABSL_NO_THREAD_SAFETY_ANALYSIS { return self->stopping_ || !self->queue_.empty(); },
            this));
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      if (item.wait_state != nullptr) {
        SimEvent(item.wait_state, item.wait_seq).Wait();
      } else if (item.work) {
        item.work();
      } else {
        const auto start = std::chrono::steady_clock::now();
        const size_t bytes = item.src.nbytes();
        if (bytes > 0) std::memcpy(item.dst.data_ptr(), item.src.data_ptr(), bytes);
        if (bandwidth_ > 0) {
          std::this_thread::sleep_until(
              start + std::chrono::duration<double>(static_cast<double>(bytes) / static_cast<double>(bandwidth_)));
        }
        absl::MutexLock lock(&pool_->mu);
        pool_->h2d += static_cast<int64_t>(bytes);
      }
      const uint64_t seq = item.seq;
      item = Item{};  // Drop the tensor references before signalling completion.
      absl::MutexLock lock(&state_->mu);
      state_->completed = seq;
    }
  }

  std::shared_ptr<Pool> pool_;
  const int64_t bandwidth_;
  std::shared_ptr<StreamState> state_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(state_->mu);
  bool stopping_ ABSL_GUARDED_BY(state_->mu) = false;
  std::thread thread_;
};

class SimulatedBackend : public DeviceBackend {
 public:
  explicit SimulatedBackend(const SimulatedBackendOptions& options)
      : options_(options),
        pool_(std::make_shared<Pool>()),
        copy_(std::make_unique<SimStream>(pool_, options.bandwidth_bytes_per_second)),
        transform_(std::make_unique<SimStream>(pool_, 0)) {
    absl::MutexLock lock(&pool_->mu);
    pool_->budget = options.budget_bytes;
    pool_->caching = options.caching_allocator;
  }

  // The transform stream drains first: its waits refer to copies already queued, which the copy
  // thread still runs; then the copy stream, whose waits on transforms have all completed.
  ~SimulatedBackend() override {
    transform_.reset();
    copy_.reset();
  }

  std::string name() const override { return absl::StrCat("sim:", options_.index); }
  c10::Device torch_device() const override { return c10::Device(c10::kCPU); }
  bool supports_streams() const override { return options_.supports_streams; }

  absl::StatusOr<at::Tensor> AllocateBytes(int64_t bytes) override {
    if (bytes < 0) return absl::InvalidArgumentError("negative allocation");
    {
      absl::MutexLock lock(&pool_->mu);
      const int64_t context = options_.context_bytes + pool_->context_reserve;
      // The smallest cached block that holds it serves it (split: the rest stays cached); else new
      // room, and when the cached blocks leave too little, they all go back first (a retry).
      auto block = pool_->cached.lower_bound(bytes);
      if (block != pool_->cached.end()) {
        const int64_t rest = *block - bytes;
        pool_->cached.erase(block);
        pool_->cached_total -= bytes;
        if (rest > 0) pool_->cached.insert(rest);
      } else {
        const auto over_budget = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool_->mu) {
          return pool_->budget > 0 && context + pool_->allocated + pool_->cached_total + bytes > pool_->budget;
        };
        if (over_budget() && !pool_->cached.empty()) {
          pool_->cached.clear();
          pool_->cached_total = 0;
          ++pool_->retries;
        }
        if (over_budget()) {
          ++pool_->ooms;
          pool_->largest_refused = std::max(pool_->largest_refused, bytes);
          return DeviceOutOfMemory(name(), bytes, context + pool_->allocated, pool_->budget).ToStatus();
        }
      }
      pool_->allocated += bytes;
      pool_->peak = std::max(pool_->peak, pool_->allocated);
      pool_->peak_reserved = std::max(pool_->peak_reserved, pool_->allocated + pool_->cached_total);
    }
    const size_t rounded = ((static_cast<size_t>(bytes) + kAlignment - 1) / kAlignment) * kAlignment;
    void* data = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
    if (data == nullptr) {
      absl::MutexLock lock(&pool_->mu);
      pool_->Free(bytes);
      return absl::ResourceExhaustedError("host allocation for the simulated device failed");
    }
    std::shared_ptr<Pool> pool = pool_;
    return at::from_blob(
        data, {bytes},
        [pool, bytes](void* ptr) {
          std::free(ptr);
          absl::MutexLock lock(&pool->mu);
          pool->Free(bytes);
        },
        at::TensorOptions().dtype(at::kByte));
  }

  absl::StatusOr<at::Tensor> CopyToDevice(const at::Tensor& host) override {
    const at::Tensor src = host.contiguous();
    RETURN_IF_ERROR(CheckCopySource(src));
    absl::StatusOr<at::Tensor> buffer = AllocateBytes(static_cast<int64_t>(src.nbytes()));
    if (!buffer.ok()) return buffer.status();
    at::Tensor dst = buffer->view(src.scalar_type()).view(src.sizes());
    if (src.nbytes() > 0) std::memcpy(dst.data_ptr(), src.data_ptr(), src.nbytes());
    absl::MutexLock lock(&pool_->mu);
    pool_->h2d += static_cast<int64_t>(src.nbytes());
    return dst;
  }

  // A simulated peer's tensors are CPU tensors of its own pool: the same copy, counted apart.
  absl::StatusOr<at::Tensor> CopyFromPeer(const at::Tensor& src_tensor) override {
    const at::Tensor src = src_tensor.contiguous();
    absl::StatusOr<at::Tensor> buffer = AllocateBytes(static_cast<int64_t>(src.nbytes()));
    if (!buffer.ok()) return buffer.status();
    at::Tensor dst = buffer->view(src.scalar_type()).view(src.sizes());
    if (src.nbytes() > 0) std::memcpy(dst.data_ptr(), src.data_ptr(), src.nbytes());
    absl::MutexLock lock(&pool_->mu);
    pool_->p2d += static_cast<int64_t>(src.nbytes());
    return dst;
  }

  void CopyToDeviceAsync(const at::Tensor& dst, const at::Tensor& src) override {
    TORCH_CHECK(dst.nbytes() == src.nbytes(), "CopyToDeviceAsync: size mismatch (", dst.nbytes(),
                " vs ", src.nbytes(), " bytes)");
    TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "CopyToDeviceAsync needs contiguous tensors");
    const absl::Status source = CheckCopySource(src);
    TORCH_CHECK(source.ok(), "CopyToDeviceAsync: ", source.message());
    copy_->Copy(dst, src);
  }

  void EnqueueOnTransformStream(std::function<void()> work) override { transform_->Work(std::move(work)); }
  std::unique_ptr<DeviceEvent> RecordOnTransformStream() override { return transform_->Record(); }
  void TransformStreamWait(DeviceEvent& event) override { transform_->Wait(static_cast<SimEvent&>(event)); }

  std::unique_ptr<DeviceEvent> RecordOnCopyStream() override { return copy_->Record(); }
  std::unique_ptr<DeviceEvent> RecordOnComputeStream() override {
    return std::make_unique<SimEvent>(nullptr, 0);
  }
  void ComputeStreamWait(DeviceEvent& event) override { static_cast<SimEvent&>(event).Wait(); }
  // Compute runs on the calling thread, so its events are complete by the time anyone waits; a
  // transform event is waited for in the copy stream's order.
  void CopyStreamWait(DeviceEvent& event) override { copy_->Wait(static_cast<SimEvent&>(event)); }
  void Synchronize() override {
    SimEvent copies(copy_->state(), copy_->Issued());
    SimEvent transforms(transform_->state(), transform_->Issued());
    copies.Wait();
    transforms.Wait();
  }

  absl::StatusOr<at::Tensor> AllocatePinnedHost(int64_t bytes) override {
    if (bytes < 0) return absl::InvalidArgumentError("negative pinned allocation");
    const size_t rounded = ((static_cast<size_t>(bytes) + kAlignment - 1) / kAlignment) * kAlignment;
    void* data = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
    if (data == nullptr) return absl::ResourceExhaustedError("pinned host allocation failed");
    const auto begin = reinterpret_cast<uintptr_t>(data);
    {
      absl::MutexLock lock(&locks_->mu);
      locks_->ranges[begin] = HostLocks::Range{begin + rounded, /*allocated=*/true};
    }
    std::shared_ptr<HostLocks> locks = locks_;
    return at::from_blob(
        data, {bytes},
        [locks, begin](void* ptr) {
          {
            absl::MutexLock lock(&locks->mu);
            locks->ranges.erase(begin);
          }
          std::free(ptr);
        },
        at::TensorOptions().dtype(at::kByte));
  }
  absl::Status RegisterHostMemory(void* ptr, int64_t bytes, bool read_only) override {
    (void)read_only;
    if (options_.refuse_host_registration) {
      return absl::ResourceExhaustedError("host memory registration refused (simulated memlock limit)");
    }
    if (bytes <= 0) return absl::InvalidArgumentError("host memory registration needs bytes > 0");
    // Like cudaHostRegister: a range overlapping a registered one or a pinned allocation is refused.
    const auto begin = reinterpret_cast<uintptr_t>(ptr);
    const uintptr_t end = begin + static_cast<uintptr_t>(bytes);
    absl::MutexLock lock(&locks_->mu);
    if (locks_->Overlaps(begin, end)) return absl::AlreadyExistsError("host memory is already page-locked");
    locks_->ranges[begin] = HostLocks::Range{end, /*allocated=*/false};
    return absl::OkStatus();
  }
  absl::Status UnregisterHostMemory(void* ptr) override {
    absl::MutexLock lock(&locks_->mu);
    auto it = locks_->ranges.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == locks_->ranges.end() || it->second.allocated) {
      return absl::NotFoundError("host memory was not registered");
    }
    locks_->ranges.erase(it);
    return absl::OkStatus();
  }
  bool IsPageLockedHostMemory(const void* ptr) override {
    absl::MutexLock lock(&locks_->mu);
    return locks_->Holding(reinterpret_cast<uintptr_t>(ptr)) != locks_->ranges.end();
  }

  DeviceMemoryStats ReadMemoryStats() override {
    absl::MutexLock lock(&pool_->mu);
    DeviceMemoryStats stats;
    stats.allocated_bytes = pool_->allocated;
    stats.peak_allocated_bytes = pool_->peak;
    // Without caching_allocator nothing is cached: reserved is what is allocated.
    stats.reserved_bytes = pool_->allocated + pool_->cached_total;
    stats.peak_reserved_bytes = pool_->peak_reserved;
    stats.context_bytes = options_.context_bytes + pool_->context_reserve;
    stats.budget_bytes = pool_->budget;
    stats.host_to_device_bytes = pool_->h2d;
    stats.peer_to_device_bytes = pool_->p2d;
    stats.device_to_host_bytes = pool_->d2h;
    stats.allocator_retries = pool_->retries;
    stats.allocator_ooms = pool_->ooms;
    stats.largest_refused_bytes = pool_->largest_refused;
    return stats;
  }
  void ResetAllocatorPeaks() override {
    absl::MutexLock lock(&pool_->mu);
    pool_->peak = pool_->allocated;
    pool_->peak_reserved = pool_->allocated + pool_->cached_total;
    pool_->largest_refused = 0;
  }
  absl::Status SetMemoryBudget(int64_t bytes) override {
    if (bytes < 0) return absl::InvalidArgumentError("memory budget must be >= 0");
    if (bytes > 0 && bytes <= options_.context_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("memory budget ", bytes, " does not hold ", name(),
                                                     "'s context of ", options_.context_bytes, " bytes"));
    }
    absl::MutexLock lock(&pool_->mu);
    pool_->budget = bytes;
    return absl::OkStatus();
  }
  int64_t MemoryBudget() const override {
    absl::MutexLock lock(&pool_->mu);
    return pool_->budget;
  }
  void ReleaseCachedMemory() override {
    absl::MutexLock lock(&pool_->mu);
    pool_->cached.clear();
    pool_->cached_total = 0;
  }
  // With caching_allocator: each cached block as a free segment (the retry gives them all back);
  // without, nothing is kept beyond live allocations.
  std::string AllocatorLayoutNote() override {
    std::vector<AllocatorSegment> segments;
    {
      absl::MutexLock lock(&pool_->mu);
      if (!pool_->caching) return "";
      for (const int64_t bytes : pool_->cached) {
        AllocatorSegment segment;
        segment.total_bytes = bytes;
        segment.largest_free_block = bytes;
        segments.push_back(segment);
      }
    }
    return DescribeAllocatorSegments(segments);
  }
  // The simulated context never grows; with count_context_reserve a reserve is accounted as on
  // CUDA (in the context, against the budget).
  void SetContextReserve(int64_t bytes) override {
    if (!options_.count_context_reserve) return;
    absl::MutexLock lock(&pool_->mu);
    pool_->context_reserve = std::max<int64_t>(0, bytes);
  }

 private:
  // Like cudaMemcpy: a host range that starts in page-locked memory must end inside the same
  // registration or allocation (one that starts in pageable memory may run into page-locked
  // memory); tests/offload/device_backend_conformance_test.cc checks CUDA does the same.
  absl::Status CheckCopySource(const at::Tensor& src) {
    if (src.nbytes() == 0) return absl::OkStatus();
    const auto begin = reinterpret_cast<uintptr_t>(src.data_ptr());
    const uintptr_t end = begin + src.nbytes();
    absl::MutexLock lock(&locks_->mu);
    auto held = locks_->Holding(begin);
    if (held != locks_->ranges.end() && held->second.end < end) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a copy of ", src.nbytes(), " host bytes runs across the edge of page-locked host memory "
          "(CUDA refuses it: invalid argument)"));
    }
    return absl::OkStatus();
  }

  const SimulatedBackendOptions options_;
  std::shared_ptr<Pool> pool_;
  std::unique_ptr<SimStream> copy_;
  std::unique_ptr<SimStream> transform_;
  std::shared_ptr<HostLocks> locks_ = std::make_shared<HostLocks>();
};

}  // namespace

std::unique_ptr<DeviceBackend> CreateSimulatedBackend(const SimulatedBackendOptions& options) {
  return std::make_unique<SimulatedBackend>(options);
}

}  // namespace stowage
