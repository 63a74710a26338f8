#include "offload/slot_ring.h"

#include <memory>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "base/out_of_memory.h"
#include "offload/device_backend.h"

namespace stowage {
namespace {

TEST(SlotRingTest, AllocatesAllSlotsOrNoneAndReleasesThem) {
  auto backend = CreateSimulatedBackend({});
  SlotRing ring(*backend, 3, 4096);
  EXPECT_FALSE(ring.allocated());
  EXPECT_EQ(ring.bytes(), 3 * 4096);
  EXPECT_EQ(backend->GetMemoryStats().allocated_bytes, 0);
  ASSERT_TRUE(ring.Allocate().ok());
  EXPECT_TRUE(ring.allocated());
  EXPECT_EQ(backend->GetMemoryStats().allocated_bytes, 3 * 4096);
  EXPECT_EQ(static_cast<int64_t>(ring.buffer(2).nbytes()), 4096);
  ring.set_owner(1, 7);
  EXPECT_EQ(ring.owner(1), 7);
  ring.Release();
  EXPECT_FALSE(ring.allocated());
  EXPECT_EQ(backend->GetMemoryStats().allocated_bytes, 0);
  EXPECT_EQ(ring.owner(1), SlotRing::kNoOwner);  // A released ring holds no group.

  // Room for two slots out of three: the allocation fails as device OOM and keeps nothing.
  ASSERT_TRUE(backend->SetMemoryBudget(2 * 4096 + 100).ok());
  absl::Status oom = ring.Allocate();
  EXPECT_TRUE(IsDeviceOom(oom)) << oom;
  EXPECT_FALSE(ring.allocated());
  EXPECT_EQ(backend->GetMemoryStats().allocated_bytes, 0);
}

TEST(SlotRingTest, EventsOrderACopyAfterTheComputeThatReadTheSlot) {
  auto backend = CreateSimulatedBackend({});
  SlotRing ring(*backend, 1, 256);
  ASSERT_TRUE(ring.Allocate().ok());
  auto pinned = backend->AllocatePinnedHost(256);
  ASSERT_TRUE(pinned.ok());
  for (int round = 0; round < 3; ++round) {
    pinned->fill_(round + 1);
    ring.CopyStreamWaitReleased(0);  // No-op the first time: nothing has read the slot yet.
    backend->CopyToDeviceAsync(ring.buffer(0), *pinned);
    ring.SetCopied(0, backend->RecordOnCopyStream());
    ring.ComputeStreamWaitCopied(0);
    backend->Synchronize();
    EXPECT_TRUE(at::equal(ring.buffer(0).to(at::kCPU), *pinned)) << round;
    ring.RecordReleased(0);
  }
  ring.Release();
}

}  // namespace
}  // namespace stowage
