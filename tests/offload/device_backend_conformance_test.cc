// One suite for every DeviceBackend: the simulator always, CUDA when this build and host have it.
#include "offload/device_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/out_of_memory.h"

namespace stowage {
namespace {

// kCudaHugePinned: CUDA whose pinned allocations are huge-page memory registered in place
// (CudaBackendOptions::pinned_huge_pages), held to the same contract.
enum class Kind { kSimulated, kCuda, kCudaHugePinned };

std::unique_ptr<DeviceBackend> Make(Kind kind) {
  if (kind == Kind::kSimulated) return CreateSimulatedBackend({});
  CudaBackendOptions options;
  options.pinned_huge_pages = kind == Kind::kCudaHugePinned;
  auto backend = CreateCudaBackend(0, options);
  return backend.ok() ? *std::move(backend) : nullptr;
}

class DeviceBackendConformanceTest : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    backend_ = Make(GetParam());
    if (backend_ == nullptr) GTEST_SKIP() << "CUDA is not available in this build or host";
  }
  std::unique_ptr<DeviceBackend> backend_;
};

TEST_P(DeviceBackendConformanceTest, AllocationsAreAccountedAndPeakResets) {
  backend_->Synchronize();
  const int64_t base = backend_->GetMemoryStats().allocated_bytes;
  backend_->ResetPeakStats();
  {
    auto a = backend_->AllocateBytes(1 << 20);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->nbytes(), size_t{1} << 20);
    EXPECT_EQ(a->device().type(), backend_->torch_device().type());
    EXPECT_EQ(backend_->GetMemoryStats().allocated_bytes, base + (1 << 20));
  }
  const DeviceMemoryStats after = backend_->GetMemoryStats();
  EXPECT_EQ(after.allocated_bytes, base);
  EXPECT_EQ(after.peak_allocated_bytes, base + (1 << 20));
  // The allocator holds at least what was allocated; what the GPU sees adds the context.
  EXPECT_GE(after.peak_reserved_bytes, after.peak_allocated_bytes);
  EXPECT_GE(after.reserved_bytes, after.allocated_bytes);
  EXPECT_EQ(after.peak_process_bytes(), after.peak_reserved_bytes + after.context_bytes);
  backend_->ResetPeakStats();
  EXPECT_EQ(backend_->GetMemoryStats().peak_allocated_bytes, base);
}

// Where the allocator's unallocated room lies, from its own segments: on CUDA a 4 MiB block freed
// between two live ones of a 20 MiB segment adds exactly 4 MiB to the room segments hold beside live
// blocks (the allocator's retry cannot give it back); the simulator keeps nothing beyond live
// allocations.
TEST_P(DeviceBackendConformanceTest, TheAllocatorLayoutNoteSaysWhereFreeRoomLies) {
  backend_->Synchronize();
  backend_->ReleaseCachedMemory();  // No free segment of earlier tests to serve the blocks.
  const int64_t MiB = int64_t{1} << 20;
  auto first = backend_->AllocateBytes(4 * MiB);
  auto middle = backend_->AllocateBytes(4 * MiB);
  auto last = backend_->AllocateBytes(4 * MiB);
  ASSERT_TRUE(first.ok() && middle.ok() && last.ok());
  backend_->Synchronize();
  // The bytes the note counts in segments that hold live blocks.
  const auto pinned = [](const std::string& note) -> int64_t {
    const std::string marker = " bytes reserved but unallocated: ";
    const size_t at = note.find(marker);
    if (at == std::string::npos) return -1;
    return std::stoll(note.substr(at + marker.size()));
  };
  const std::string before = backend_->AllocatorLayoutNote();
  middle = absl::InternalError("freed");
  backend_->Synchronize();
  const std::string after = backend_->AllocatorLayoutNote();
  if (GetParam() == Kind::kSimulated) {
    EXPECT_EQ(before, "");
    EXPECT_EQ(after, "");
    return;
  }
  ASSERT_GE(pinned(after), 0) << after;
  // Freed between two live blocks: room the segment holds beside them, exactly its 4 MiB more.
  EXPECT_EQ(pinned(after), std::max<int64_t>(pinned(before), 0) + 4 * MiB) << before << "\n" << after;
}

// Placement measures each component's run in a peak window while the request's peak is measured
// around them all: a window sees only its own peak, the request's peak survives the windows.
TEST_P(DeviceBackendConformanceTest, APeakWindowMeasuresItsOwnPeakAndKeepsTheOuterOne) {
  backend_->Synchronize();
  const int64_t base = backend_->GetMemoryStats().allocated_bytes;
  backend_->ResetPeakStats();
  { auto big = backend_->AllocateBytes(4 << 20); ASSERT_TRUE(big.ok()) << big.status(); }
  auto held = backend_->AllocateBytes(1 << 20);  // Stays allocated across the window.
  ASSERT_TRUE(held.ok()) << held.status();
  const int64_t start = backend_->BeginPeakWindow();
  EXPECT_EQ(start, base + (1 << 20));
  EXPECT_EQ(backend_->WindowPeakAllocated(), start);
  { auto run = backend_->AllocateBytes(2 << 20); ASSERT_TRUE(run.ok()) << run.status(); }
  EXPECT_EQ(backend_->WindowPeakAllocated() - start, 2 << 20);
  // The 4 MiB before the window is still the request's peak.
  EXPECT_EQ(backend_->GetMemoryStats().peak_allocated_bytes, base + (4 << 20));
  EXPECT_GE(backend_->GetMemoryStats().peak_reserved_bytes, base + (4 << 20));
  // A later window starts afresh; the outer peak still holds.
  const int64_t second = backend_->BeginPeakWindow();
  EXPECT_EQ(backend_->WindowPeakAllocated(), second);
  EXPECT_EQ(backend_->GetMemoryStats().peak_allocated_bytes, base + (4 << 20));
  *held = at::Tensor();
  // ResetPeakStats forgets the windows' floors too.
  backend_->ResetPeakStats();
  EXPECT_EQ(backend_->GetMemoryStats().peak_allocated_bytes, base);
}

TEST_P(DeviceBackendConformanceTest, CopyToDeviceKeepsValuesAndCountsBytes) {
  const at::Tensor host = at::randn({3, 5});
  const int64_t h2d = backend_->GetMemoryStats().host_to_device_bytes;
  auto device = backend_->CopyToDevice(host);
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_TRUE(at::equal(device->to(at::kCPU), host));
  EXPECT_EQ(backend_->GetMemoryStats().host_to_device_bytes - h2d, 15 * 4);
}

TEST_P(DeviceBackendConformanceTest, AsyncCopyIsVisibleAfterWaitingOnItsEvent) {
  auto pinned = backend_->AllocatePinnedHost(4096);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  pinned->copy_(at::arange(4096, at::kInt).remainder(251).to(at::kByte));
  auto dst = backend_->AllocateBytes(4096);
  ASSERT_TRUE(dst.ok());
  backend_->CopyToDeviceAsync(*dst, *pinned);
  std::unique_ptr<DeviceEvent> event = backend_->RecordOnCopyStream();
  backend_->ComputeStreamWait(*event);
  backend_->Synchronize();
  EXPECT_TRUE(event->Query());
  EXPECT_TRUE(at::equal(dst->to(at::kCPU), *pinned));
}

// Work on the transform stream that waits for a copy sees it, and an event recorded after the work
// completes only once its device effects are done: the contract the compressed store's widening
// relies on.
TEST_P(DeviceBackendConformanceTest, TransformStreamWorkSeesTheCopyItWaitsFor) {
  auto pinned = backend_->AllocatePinnedHost(4096);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  pinned->copy_(at::arange(4096, at::kInt).remainder(100).to(at::kByte));
  auto bytes = backend_->AllocateBytes(4096);
  auto widened = backend_->AllocateBytes(4096 * 4);
  ASSERT_TRUE(bytes.ok() && widened.ok());
  const at::Tensor dst = *bytes;
  const at::Tensor out = widened->view(at::kFloat);
  const int64_t h2d = backend_->GetMemoryStats().host_to_device_bytes;
  backend_->CopyToDeviceAsync(dst, *pinned);
  std::unique_ptr<DeviceEvent> landed = backend_->RecordOnCopyStream();
  backend_->TransformStreamWait(*landed);
  backend_->EnqueueOnTransformStream([dst, out] {
    out.copy_(dst);
    out.mul_(0.5);
  });
  std::unique_ptr<DeviceEvent> done = backend_->RecordOnTransformStream();
  backend_->ComputeStreamWait(*done);
  EXPECT_TRUE(at::equal(out.to(at::kCPU), pinned->to(at::kFloat).mul(0.5)));
  backend_->Synchronize();
  EXPECT_EQ(backend_->GetMemoryStats().host_to_device_bytes - h2d, 4096);  // The work moves nothing.
}

// A copy that waits for a transform does not overwrite what the transform reads (on the
// simulator the transform is made slow, so a copy that did not wait would land first).
TEST_P(DeviceBackendConformanceTest, ACopyWaitingForATransformLandsAfterIt) {
  auto first = backend_->AllocatePinnedHost(1024);
  auto second = backend_->AllocatePinnedHost(1024);
  auto bytes = backend_->AllocateBytes(1024);
  auto read = backend_->AllocateBytes(1024);
  ASSERT_TRUE(first.ok() && second.ok() && bytes.ok() && read.ok());
  first->fill_(1);
  second->fill_(2);
  const at::Tensor dst = *bytes;
  const at::Tensor out = *read;
  const bool simulated = GetParam() == Kind::kSimulated;
  backend_->CopyToDeviceAsync(dst, *first);
  std::unique_ptr<DeviceEvent> landed = backend_->RecordOnCopyStream();
  backend_->TransformStreamWait(*landed);
  backend_->EnqueueOnTransformStream([dst, out, simulated] {
    if (simulated) ::usleep(50 * 1000);
    out.copy_(dst);
  });
  std::unique_ptr<DeviceEvent> consumed = backend_->RecordOnTransformStream();
  backend_->CopyStreamWait(*consumed);
  backend_->CopyToDeviceAsync(dst, *second);
  backend_->Synchronize();
  EXPECT_TRUE(at::equal(out.to(at::kCPU), *first));
  EXPECT_TRUE(at::equal(dst.to(at::kCPU), *second));
}

TEST_P(DeviceBackendConformanceTest, BudgetTurnsOversizedAllocationIntoDeviceOom) {
  backend_->Synchronize();
  const DeviceMemoryStats stats = backend_->GetMemoryStats();
  const int64_t in_use = stats.allocated_bytes;
  // The budget covers the context too.
  ASSERT_TRUE(backend_->SetMemoryBudget(stats.context_bytes + in_use + (64 << 20)).ok());
  auto too_big = backend_->AllocateBytes(int64_t{1} << 30);
  ASSERT_FALSE(too_big.ok());
  EXPECT_TRUE(IsDeviceOom(too_big.status())) << too_big.status();
  ASSERT_TRUE(backend_->SetMemoryBudget(0).ok());
  EXPECT_FALSE(backend_->SetMemoryBudget(-1).ok());
}

TEST_P(DeviceBackendConformanceTest, HostMemoryCanBeRegisteredOnceInPlace) {
  at::Tensor host = at::empty({1 << 16}, at::kByte);
  ASSERT_TRUE(backend_->RegisterHostMemory(host.data_ptr(), host.nbytes(), /*read_only=*/false).ok());
  EXPECT_FALSE(backend_->RegisterHostMemory(host.data_ptr(), host.nbytes(), false).ok());
  EXPECT_TRUE(backend_->UnregisterHostMemory(host.data_ptr()).ok());
}

// Pinned allocations and registered ranges are page-locked; plain heap memory is not; memory that
// is page-locked already cannot be registered again (CUDA refuses a pinned allocation too).
TEST_P(DeviceBackendConformanceTest, PageLockedMemoryIsReportedAndNotRegisteredTwice) {
  at::Tensor pinned = *backend_->AllocatePinnedHost(1 << 20);
  EXPECT_TRUE(backend_->IsPageLockedHostMemory(pinned.data_ptr()));
  EXPECT_TRUE(backend_->IsPageLockedHostMemory(static_cast<uint8_t*>(pinned.data_ptr()) + (1 << 19)));
  EXPECT_FALSE(backend_->RegisterHostMemory(pinned.data_ptr(), pinned.nbytes(), false).ok());
  at::Tensor heap = at::empty({1 << 16}, at::kByte);
  EXPECT_FALSE(backend_->IsPageLockedHostMemory(heap.data_ptr()));
  ASSERT_TRUE(backend_->RegisterHostMemory(heap.data_ptr(), heap.nbytes(), false).ok());
  EXPECT_TRUE(backend_->IsPageLockedHostMemory(heap.data_ptr()));
  EXPECT_TRUE(backend_->UnregisterHostMemory(heap.data_ptr()).ok());
  EXPECT_FALSE(backend_->IsPageLockedHostMemory(heap.data_ptr()));
  // A refused call leaves no error behind for the next copy.
  at::Tensor values = at::arange(1000, at::kFloat);
  absl::StatusOr<at::Tensor> copy = backend_->CopyToDevice(values);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_TRUE(at::equal(copy->cpu(), values));
}

// What the H200 showed (bench/results/two_pipelines_h200/README.md: run 2, and this test in
// conformance_run3.txt and conformance_run4.txt): a copy whose host bytes start in a registered range and run past its end is refused ("invalid
// argument"), while one that starts in pageable memory may run into a registered range. A refused
// copy leaves no error behind. The offload engine therefore registers whole regions that hold
// whole tensors and nothing else (offload/host_pins.h); the simulator refuses the same copies so
// CPU tests catch a registration that splits a tensor or covers a stranger's bytes.
TEST_P(DeviceBackendConformanceTest, ACopyMayNotRunAcrossTheEdgeOfARegisteredRange) {
  const auto page = static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
  at::Tensor memory = at::arange(5 * page, at::kByte);
  auto* base = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(memory.data_ptr()) + page - 1) / page * page);  // 4 aligned pages.
  auto bytes = [&](int64_t begin, int64_t end) {
    return at::from_blob(base + begin, {end - begin}, at::TensorOptions().dtype(at::kByte));
  };
  ASSERT_TRUE(backend_->RegisterHostMemory(base + page, 2 * page, false).ok());  // Pages [1, 3).
  for (const auto& [begin, end] : std::vector<std::pair<int64_t, int64_t>>{
           {page, 3 * page}, {page + 100, 2 * page}, {0, page}, {3 * page, 4 * page}, {page / 2, page + 100},
           {0, 4 * page}}) {
    absl::StatusOr<at::Tensor> copy = backend_->CopyToDevice(bytes(begin, end));
    ASSERT_TRUE(copy.ok()) << "[" << begin << ", " << end << "): " << copy.status();
    EXPECT_TRUE(at::equal(copy->cpu(), bytes(begin, end)));
  }
  for (const auto& [begin, end] : std::vector<std::pair<int64_t, int64_t>>{
           {2 * page, 3 * page + 100}, {page + 100, 4 * page}}) {
    EXPECT_FALSE(backend_->CopyToDevice(bytes(begin, end)).ok()) << "[" << begin << ", " << end << ")";
  }
  absl::StatusOr<at::Tensor> after = backend_->CopyToDevice(bytes(0, page));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(backend_->UnregisterHostMemory(base + page).ok());
  EXPECT_TRUE(backend_->CopyToDevice(bytes(0, 4 * page)).ok());
}

// The simulator refuses what cudaHostRegister refuses for an overlapping range, so that the
// offload engine's range merging is checked on CPU hosts too.
TEST(SimulatedBackendTest, TheContextCountsAgainstTheBudget) {
  SimulatedBackendOptions options;
  options.context_bytes = 300;
  auto backend = CreateSimulatedBackend(options);
  EXPECT_EQ(backend->SetMemoryBudget(300).code(), absl::StatusCode::kInvalidArgument);  // Holds no more.
  ASSERT_TRUE(backend->SetMemoryBudget(1000).ok());
  EXPECT_EQ(backend->GetMemoryStats().free_bytes(), 700);
  auto too_big = backend->AllocateBytes(701);
  ASSERT_FALSE(too_big.ok());
  EXPECT_TRUE(IsDeviceOom(too_big.status()));
  auto fits = backend->AllocateBytes(700);
  ASSERT_TRUE(fits.ok()) << fits.status();
  const DeviceMemoryStats stats = backend->GetMemoryStats();
  EXPECT_EQ(stats.free_bytes(), 0);
  EXPECT_EQ(stats.context_bytes, 300);
  EXPECT_EQ(stats.process_bytes(), 1000);
  EXPECT_EQ(stats.peak_process_bytes(), 1000);
  ASSERT_TRUE(backend->SetMemoryBudget(0).ok());
  EXPECT_EQ(backend->GetMemoryStats().free_bytes(), INT64_MAX);
}

// With caching_allocator the simulator keeps freed allocations as cached blocks, as LibTorch's CUDA
// allocator does: reserved and counted against the budget, reused by an allocation they hold (split),
// given back — one retry — when an allocation fits only without them, and refused only when it
// does not fit even then (the retry counted too).
TEST(SimulatedBackendTest, ACachingAllocatorReusesSplitsAndGivesBackItsBlocks) {
  SimulatedBackendOptions options;
  options.caching_allocator = true;
  options.context_bytes = 100;
  auto backend = CreateSimulatedBackend(options);
  ASSERT_TRUE(backend->SetMemoryBudget(1100).ok());  // 1000 for allocations.
  { ASSERT_TRUE(backend->AllocateBytes(600).ok()); }
  DeviceMemoryStats stats = backend->GetMemoryStats();
  EXPECT_EQ(stats.allocated_bytes, 0);
  EXPECT_EQ(stats.reserved_bytes, 600);
  EXPECT_EQ(stats.peak_reserved_bytes, 600);
  EXPECT_EQ(stats.free_bytes(), 1000);  // As the allocator's counts say: the cached block is reusable.
  // Served from the cached block: nothing new reserved, the rest (400) stays cached.
  absl::StatusOr<at::Tensor> small = backend->AllocateBytes(200);
  ASSERT_TRUE(small.ok());
  stats = backend->GetMemoryStats();
  EXPECT_EQ(stats.allocated_bytes, 200);
  EXPECT_EQ(stats.reserved_bytes, 600);
  EXPECT_EQ(stats.allocator_retries, 0);
  // 500: no cached block holds it, and 200 + 400 cached + 500 > 1000: the cache goes back first.
  absl::StatusOr<at::Tensor> larger = backend->AllocateBytes(500);
  ASSERT_TRUE(larger.ok()) << larger.status();
  stats = backend->GetMemoryStats();
  EXPECT_EQ(stats.allocator_retries, 1);
  EXPECT_EQ(stats.allocator_ooms, 0);
  EXPECT_EQ(stats.allocated_bytes, 700);
  EXPECT_EQ(stats.reserved_bytes, 700);
  // Fits beside what is cached: no retry.
  { ASSERT_TRUE(backend->AllocateBytes(100).ok()); }
  EXPECT_EQ(backend->GetMemoryStats().reserved_bytes, 800);
  ASSERT_TRUE(backend->AllocateBytes(150).ok());  // Too large for the cached 100, fits beside it.
  EXPECT_EQ(backend->GetMemoryStats().allocator_retries, 1);
  EXPECT_EQ(backend->GetMemoryStats().peak_reserved_bytes, 950);
  // 301 fits only without the cached 250 (100 + 150 just freed), and not even then: a retry and an error.
  absl::StatusOr<at::Tensor> refused = backend->AllocateBytes(301);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(IsDeviceOom(refused.status()));
  stats = backend->GetMemoryStats();
  EXPECT_EQ(stats.allocator_retries, 2);
  EXPECT_EQ(stats.allocator_ooms, 1);
  EXPECT_EQ(stats.largest_refused_bytes, 301);
  EXPECT_EQ(stats.reserved_bytes, 700);
  // ReleaseCachedMemory gives cached blocks back; live ones stay.
  small = absl::InternalError("freed");
  EXPECT_EQ(backend->GetMemoryStats().reserved_bytes, 700);
  backend->ReleaseCachedMemory();
  stats = backend->GetMemoryStats();
  EXPECT_EQ(stats.reserved_bytes, 500);
  EXPECT_EQ(stats.allocated_bytes, 500);
  EXPECT_EQ(stats.peak_reserved_bytes, 950);
}

// An out-of-memory decision says where the reserved but unallocated room lies: in segments that
// also hold live blocks (the allocator's retry cannot give those back; the small ones apart, where many
// small weights share 20 MiB segments) or in free segments, and the largest free block.
TEST(AllocatorLayoutTest, SaysWhereTheReservedButUnallocatedRoomLies) {
  EXPECT_EQ(DescribeAllocatorSegments({}), "allocator: nothing reserved beyond live allocations");
  EXPECT_EQ(DescribeAllocatorSegments({{100, 100, 0}}), "allocator: nothing reserved beyond live allocations");
  const int64_t MiB = int64_t{1} << 20;
  const std::vector<AllocatorSegment> segments = {
      {20 * MiB, 12 * MiB, 4 * MiB},     // Small, pinned by live blocks: 8 MiB free.
      {2 * MiB, 1 * MiB, MiB / 2},       // Small too: 1 MiB free.
      {512 * MiB, 256 * MiB, 200 * MiB}, // Large, pinned: 256 MiB free.
      {300 * MiB, 0, 300 * MiB},         // Free: the retry gives it back.
      {64 * MiB, 64 * MiB, 0},           // Full.
  };
  EXPECT_EQ(DescribeAllocatorSegments(segments),
            absl::StrCat("allocator: ", 565 * MiB, " bytes reserved but unallocated: ", 265 * MiB,
                         " in 3 segments that hold live blocks too (", 9 * MiB,
                         " of them in 2 segments of 20 MiB or less), ", 300 * MiB,
                         " in 1 free segments; the largest free block ", 300 * MiB, " bytes"));
  // The simulator's caching allocator: its cached blocks are free segments; without it, nothing.
  EXPECT_EQ(CreateSimulatedBackend({})->AllocatorLayoutNote(), "");
  SimulatedBackendOptions options;
  options.caching_allocator = true;
  auto backend = CreateSimulatedBackend(options);
  EXPECT_EQ(backend->AllocatorLayoutNote(), "allocator: nothing reserved beyond live allocations");
  { ASSERT_TRUE(backend->AllocateBytes(600).ok()); }
  { ASSERT_TRUE(backend->AllocateBytes(700).ok()); }
  EXPECT_EQ(backend->AllocatorLayoutNote(),
            "allocator: 1300 bytes reserved but unallocated: 0 in 0 segments that hold live blocks too (0 of "
            "them in 0 segments of 20 MiB or less), 1300 in 2 free segments; the largest free block 700 bytes");
}

TEST(SimulatedBackendTest, OverlappingHostRegistrationIsRefused) {
  auto backend = CreateSimulatedBackend({});
  at::Tensor host = at::empty({1 << 16}, at::kByte);
  auto* base = static_cast<uint8_t*>(host.data_ptr());
  ASSERT_TRUE(backend->RegisterHostMemory(base + 4096, 8192, false).ok());
  EXPECT_FALSE(backend->RegisterHostMemory(base + 8192, 4096, false).ok());   // Inside.
  EXPECT_FALSE(backend->RegisterHostMemory(base, 8192, false).ok());          // Overlaps the start.
  EXPECT_FALSE(backend->RegisterHostMemory(base + 12000, 4096, false).ok());  // Overlaps the end.
  EXPECT_TRUE(backend->RegisterHostMemory(base, 4096, false).ok());           // Adjacent before.
  EXPECT_TRUE(backend->RegisterHostMemory(base + 12288, 4096, false).ok());   // Adjacent after.
  EXPECT_FALSE(backend->UnregisterHostMemory(base + 8192).ok());             // Not a start.
  EXPECT_TRUE(backend->UnregisterHostMemory(base + 4096).ok());
  EXPECT_TRUE(backend->RegisterHostMemory(base + 8192, 4096, false).ok());    // Free again.
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceBackendConformanceTest,
                         ::testing::Values(Kind::kSimulated, Kind::kCuda, Kind::kCudaHugePinned),
                         [](const ::testing::TestParamInfo<Kind>& info) {
                           return info.param == Kind::kSimulated ? std::string("Simulated")
                                  : info.param == Kind::kCuda    ? std::string("Cuda")
                                                                 : std::string("CudaHugePinned");
                         });

TEST(SimulatedBackendTest, BandwidthLimitPacesAsyncCopies) {
  SimulatedBackendOptions options;
  options.bandwidth_bytes_per_second = 100 << 20;  // 100 MiB/s: 10 MiB takes >= 100 ms.
  auto backend = CreateSimulatedBackend(options);
  auto src = backend->AllocatePinnedHost(10 << 20);
  auto dst = backend->AllocateBytes(10 << 20);
  ASSERT_TRUE(src.ok() && dst.ok());
  const auto start = std::chrono::steady_clock::now();
  backend->CopyToDeviceAsync(*dst, *src);
  auto event = backend->RecordOnCopyStream();
  EXPECT_FALSE(event->Query());  // Still in flight right after issue.
  backend->ComputeStreamWait(*event);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(95));
  EXPECT_TRUE(event->Query());
}

// The transform stream runs beside the copy stream: work on it sees a copy issued after it finish
// (one shared queue would run that copy only after the work gave up).
TEST(SimulatedBackendTest, TheTransformStreamRunsBesideTheCopyStream) {
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  auto pinned = backend->AllocatePinnedHost(256);
  auto bytes = backend->AllocateBytes(256);
  ASSERT_TRUE(pinned.ok() && bytes.ok());
  pinned->fill_(7);
  struct Shared {
    absl::Mutex mu;
    std::unique_ptr<DeviceEvent> later ABSL_GUARDED_BY(mu);
    bool saw_copy ABSL_GUARDED_BY(mu) = false;
  };
  auto shared = std::make_shared<Shared>();
  backend->EnqueueOnTransformStream([shared] {
    for (int i = 0; i < 5000; ++i) {
      {
        absl::MutexLock lock(&shared->mu);
        if (shared->later != nullptr && shared->later->Query()) {
          shared->saw_copy = true;
          return;
        }
      }
      ::usleep(1000);
    }
  });
  backend->CopyToDeviceAsync(*bytes, *pinned);  // Issued after the work, runs while it waits.
  {
    absl::MutexLock lock(&shared->mu);
    shared->later = backend->RecordOnCopyStream();
  }
  backend->Synchronize();
  absl::MutexLock lock(&shared->mu);
  EXPECT_TRUE(shared->saw_copy);
  EXPECT_TRUE(at::equal(bytes->to(at::kCPU), *pinned));
}

// The context counted against the budget (CUDA's RefreshContextBytes): NVML's reading swings by tens
// of MiB between requests, so a reading less than 64 MiB below the figure counted keeps it; a larger
// drop (memory given back) and any rise are taken.
TEST(ContextBytesTest, ASmallDropKeepsTheFigureALargeOneOrARiseIsTaken) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  EXPECT_EQ(DeviceBackend::CountedContextBytes(2144 * kMiB, 2120 * kMiB), 2144 * kMiB);  // Run 11's swing.
  EXPECT_EQ(DeviceBackend::CountedContextBytes(2144 * kMiB, 2080 * kMiB), 2144 * kMiB);  // 64 MiB: still jitter.
  EXPECT_EQ(DeviceBackend::CountedContextBytes(2144 * kMiB, 2079 * kMiB), 2079 * kMiB);
  EXPECT_EQ(DeviceBackend::CountedContextBytes(2118 * kMiB, 2144 * kMiB), 2144 * kMiB);
  EXPECT_EQ(DeviceBackend::CountedContextBytes(0, 1330 * kMiB), 1330 * kMiB);  // The first reading.
}

}  // namespace
}  // namespace stowage
