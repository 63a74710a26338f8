// One conformance suite for every HostStore (through CreateHostStore, the way the engine gets
// them), on the simulated backend: after CopyGroupToSlot, the slot holds every tensor of the group
// at its planned offset, bit for bit, and nothing past the group's bytes; each store moves the bytes
// the way it promises (one DMA of the packed group, or one per tensor). The compressed store is
// lossy: its streamed tensors of rank >= 2 are compared, bit for bit, with the dequantized
// reference (offload/compression.h), everything else with the original.
#include "offload/host_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "offload/device_backend.h"
#include "offload/group_plan.h"
#include "offload/host_pins.h"
#include "offload/host_store_factory.h"
#include "offload/host_weights.h"
#include "tests/offload/stack_model.h"

namespace stowage {
namespace {

enum class Kind { kPinned, kPinnedInPlace, kStaged, kStagedAfterRefusal, kDisk, kInt8, kFp8 };

struct StoreCase {
  std::string name;
  Kind kind;
  bool budget;  // Keep some groups resident (the stores treat those differently).
};

void PrintTo(const StoreCase& c, std::ostream* os) { *os << c.name; }

class HostStoreConformanceTest : public ::testing::TestWithParam<StoreCase> {};

TEST_P(HostStoreConformanceTest, SlotHoldsTheGroupsWeightsAfterCopyGroupToSlot) {
  const StoreCase& c = GetParam();
  StackModel model;
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(model);
  std::vector<at::Tensor> reference;
  std::vector<PlanTensor> tensors;
  const CompressFormat format = c.kind == Kind::kInt8  ? CompressFormat::kInt8
                               : c.kind == Kind::kFp8 ? CompressFormat::kFp8E4M3
                                                      : CompressFormat::kNone;
  const bool compressed = format != CompressFormat::kNone;
  HostStoreOptions options;
  options.compress = format;
  const StoreScratch scratch_plan = PlanStoreScratch(options, *weights);
  for (size_t i = 0; i < weights->entries().size(); ++i) {
    HostWeights::Entry& e = weights->entries()[i];
    reference.push_back(e.host.clone());
    tensors.push_back(PlanTensor{e.slot, static_cast<int64_t>(e.host.nbytes()), scratch_plan.tensor_bytes[i]});
  }
  GroupPlanOptions plan_options;
  plan_options.num_blocks_per_group = 2;
  plan_options.slots = 1;
  plan_options.fixed_scratch_bytes = scratch_plan.fixed_bytes;
  // One slot of two blocks and one resident group of two blocks; two groups stream.
  if (c.budget) {
    plan_options.budget_bytes = StackModel::kOutsideBytes + 4 * StackModel::kBlockBytes;
    // Room for the scratch of the largest copied group (two blocks' weights at 8 bits), so that the
    // same groups stay resident as without compression.
    if (compressed) plan_options.budget_bytes += 2 * StackModel::kBlockBytes;
  }
  auto plan = PlanGroups("stack", model, tensors, plan_options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->resident_groups, c.budget ? 1 : 0);

  SimulatedBackendOptions backend_options;
  backend_options.refuse_host_registration = c.kind == Kind::kStagedAfterRefusal;
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend(backend_options);
  options.component = "stack";
  options.target = c.kind == Kind::kPinned || compressed ? OffloadTarget::kPinnedHost
                   : c.kind == Kind::kDisk ? OffloadTarget::kDisk
                                           : OffloadTarget::kPageableHost;
  options.pin_in_place = c.kind != Kind::kStaged;
  options.staging_buffer_bytes = 1 << 16;  // Several chunks per block group.
  options.staging_threads = 3;
  if (c.kind == Kind::kDisk) {
    options.disk_dir = std::string(::testing::TempDir()) + "/host_store_" + c.name;
    ::mkdir(options.disk_dir.c_str(), 0755);
  }
  weights->OffloadAll();
  auto store = CreateHostStore(options, plan->groups, *weights, *backend);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->device_scratch_bytes(), plan->scratch_bytes);
  EXPECT_EQ(plan->scratch_bytes > 0, compressed);

  // What the slot must hold: the original, or for a compressed store's copied tensors of rank >= 2
  // the dequantized weights; and the bytes each tensor moves.
  std::vector<at::Tensor> expected = reference;
  std::vector<int64_t> moved(reference.size());
  for (const PlannedGroup& g : plan->groups) {
    for (const PlannedTensor& t : g.tensors) {
      const at::Tensor& w = reference[static_cast<size_t>(t.index)];
      moved[static_cast<size_t>(t.index)] = t.bytes;
      if (!compressed || g.resident || w.dim() < 2) continue;
      expected[static_cast<size_t>(t.index)] = Dequantize(Quantize(w, format), format, w.scalar_type());
      moved[static_cast<size_t>(t.index)] = AlignScratch(w.numel()) + AlignScratch(w.size(0) * 4);
    }
  }
  at::Tensor scratch;
  if ((*store)->device_scratch_bytes() > 0) {
    scratch = *backend->AllocateBytes((*store)->device_scratch_bytes());
    (*store)->InitScratch(scratch);
  }

  // What each store says it holds.
  const HostStoreStats stats = (*store)->stats();
  int64_t packed_bytes = 0;  // Groups that are not resident.
  int files = 0;
  for (const PlannedGroup& g : plan->groups) {
    if (g.resident) continue;
    packed_bytes += g.bytes;
    ++files;
  }
  if (compressed) {
    EXPECT_EQ(stats.pinned_host_bytes, stats.compressed_host_bytes);
    EXPECT_LT(stats.compressed_host_bytes, packed_bytes / 3);  // fp32 → 8 bits, plus scales and 1-D.
  } else {
    EXPECT_EQ(stats.pinned_host_bytes, c.kind == Kind::kPinned ? packed_bytes : 0);
  }
  int64_t bytes_per_forward = 0;
  for (const PlannedGroup& g : plan->groups) {
    if (g.resident) continue;
    if (c.kind == Kind::kPinned) bytes_per_forward += g.bytes;
    for (const PlannedTensor& t : g.tensors) {
      if (c.kind != Kind::kPinned) bytes_per_forward += moved[static_cast<size_t>(t.index)];
    }
  }
  EXPECT_EQ(stats.bytes_per_forward, bytes_per_forward);
  if (c.kind == Kind::kPinnedInPlace) {
    EXPECT_GE(stats.pinned_in_place_bytes, StackModel::kTotalBytes);  // Resident groups too.
  } else {
    EXPECT_EQ(stats.pinned_in_place_bytes, 0);
  }
  if (c.kind == Kind::kStagedAfterRefusal) {
    EXPECT_NE(stats.pin_in_place_error.find("refused"), std::string::npos) << stats.pin_in_place_error;
  } else {
    EXPECT_EQ(stats.pin_in_place_error, "");
  }
  EXPECT_EQ(stats.disk_files_written + stats.disk_files_reused, c.kind == Kind::kDisk ? files : 0);
  // The host copies may have moved (pinned chunks, file mappings); their contents did not.
  for (size_t i = 0; i < reference.size(); ++i) {
    EXPECT_TRUE(at::equal(weights->entries()[i].host, reference[i])) << i;
  }

  constexpr int64_t kGuard = 512;
  for (int round = 0; round < 2; ++round) {  // The second round reuses staging buffers and files.
    for (size_t gi = 0; gi < plan->groups.size(); ++gi) {
      const PlannedGroup& g = plan->groups[gi];
      auto slot = backend->AllocateBytes(g.bytes + kGuard);
      ASSERT_TRUE(slot.ok());
      slot->fill_(0xEE);  // Simulated device memory is CPU memory.
      backend->Synchronize();  // Earlier asynchronous uploads (the fp8 table) count before the baseline.
      const int64_t h2d = backend->GetMemoryStats().host_to_device_bytes;
      (*store)->CopyGroupToSlot(static_cast<int>(gi), *slot, scratch);
      std::unique_ptr<DeviceEvent> copied = backend->RecordOnCopyStream();
      backend->ComputeStreamWait(*copied);
      backend->Synchronize();
      int64_t tensor_bytes = 0;
      for (const PlannedTensor& t : g.tensors) {
        const at::Tensor& want = expected[static_cast<size_t>(t.index)];
        ASSERT_EQ(t.bytes, static_cast<int64_t>(want.nbytes()));
        at::Tensor got = slot->narrow(0, t.offset, t.bytes).view(want.scalar_type()).view(want.sizes());
        EXPECT_TRUE(at::equal(got, want)) << g.name << " tensor " << t.index << " round " << round;
        tensor_bytes += g.resident ? t.bytes : moved[static_cast<size_t>(t.index)];
      }
      EXPECT_TRUE(at::equal(slot->narrow(0, g.bytes, kGuard), at::full({kGuard}, 0xEE, at::kByte)))
          << g.name << ": wrote past the group's bytes";
      // Pinned: one DMA of the packed group (padding included); every other store, and a pinned
      // store's resident groups, copies the tensors' bytes only.
      const bool packed = c.kind == Kind::kPinned && !g.resident;
      EXPECT_EQ(backend->GetMemoryStats().host_to_device_bytes - h2d, packed ? g.bytes : tensor_bytes)
          << g.name;
    }
  }
  store->reset();
  backend->Synchronize();
}

std::vector<StoreCase> Cases() {
  std::vector<StoreCase> cases;
  for (const auto& [name, kind] : std::vector<std::pair<std::string, Kind>>{
           {"Pinned", Kind::kPinned},
           {"PinnedInPlace", Kind::kPinnedInPlace},
           {"Staged", Kind::kStaged},
           {"StagedAfterRefusal", Kind::kStagedAfterRefusal},
           {"Disk", Kind::kDisk},
           {"CompressedInt8", Kind::kInt8},
           {"CompressedFp8", Kind::kFp8}}) {
    cases.push_back({name, kind, false});
    cases.push_back({name + "WithResidentGroups", kind, true});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Stores, HostStoreConformanceTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<StoreCase>& info) { return info.param.name; });

// HostWeights::PinInPlace registers the host copies' merged page ranges once each: a second
// registration of any of them is refused while pinned (so they really are registered) and succeeds
// after Unpin; onloading from pinned copies gives the same weights; a host that refuses to lock
// memory leaves nothing registered; ReplaceHost and the destructor unpin.
TEST(HostWeightsPinningTest, PinInPlaceRegistersEveryRangeOnceAndUnpinReleasesThem) {
  StackModel model;
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(model);
  std::vector<const at::Tensor*> hosts;
  for (const HostWeights::Entry& e : weights->entries()) hosts.push_back(&e.host);
  const auto ranges = MergedPageRanges(hosts);
  ASSERT_FALSE(ranges.empty());
  int64_t range_bytes = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    EXPECT_LT(ranges[i].first, ranges[i].second);
    if (i > 0) EXPECT_LE(ranges[i - 1].second, ranges[i].first);  // Sorted, disjoint.
    range_bytes += static_cast<int64_t>(ranges[i].second - ranges[i].first);
  }
  EXPECT_GE(range_bytes, weights->bytes());

  auto backend = CreateSimulatedBackend({});
  void* first = reinterpret_cast<void*>(ranges.front().first);
  const auto first_size = static_cast<int64_t>(ranges.front().second - ranges.front().first);
  ASSERT_TRUE(weights->PinInPlace(*backend).ok());
  EXPECT_EQ(weights->pinned_in_place_bytes(), range_bytes);
  ASSERT_TRUE(weights->PinInPlace(*backend).ok());  // Already pinned: nothing changes.
  EXPECT_EQ(weights->pinned_in_place_bytes(), range_bytes);
  EXPECT_EQ(backend->RegisterHostMemory(first, first_size, false).code(), absl::StatusCode::kAlreadyExists);

  ASSERT_TRUE(weights->OnloadAll(*backend).ok());
  for (const HostWeights::Entry& e : weights->entries()) {
    EXPECT_TRUE(at::equal(e.slot->value.cpu(), e.host)) << e.module->SlotPath(*e.slot);
  }
  weights->OffloadAll();

  weights->Unpin();
  EXPECT_EQ(weights->pinned_in_place_bytes(), 0);
  ASSERT_TRUE(backend->RegisterHostMemory(first, first_size, false).ok());
  ASSERT_TRUE(backend->UnregisterHostMemory(first).ok());

  // ReplaceHost unpins (the old host tensor may be freed).
  ASSERT_TRUE(weights->PinInPlace(*backend).ok());
  HostWeights::Entry& entry = weights->entries().front();
  weights->ReplaceHost(entry, entry.host.clone());
  EXPECT_EQ(weights->pinned_in_place_bytes(), 0);
  ASSERT_TRUE(backend->RegisterHostMemory(first, first_size, false).ok());
  ASSERT_TRUE(backend->UnregisterHostMemory(first).ok());

  // The destructor unpins: the memory (kept alive here) can be registered again.
  std::vector<at::Tensor> keep;
  for (const HostWeights::Entry& e : weights->entries()) keep.push_back(e.host);
  std::vector<const at::Tensor*> kept;
  for (const at::Tensor& t : keep) kept.push_back(&t);
  const auto kept_ranges = MergedPageRanges(kept);
  ASSERT_TRUE(weights->PinInPlace(*backend).ok());
  weights.reset();
  for (const auto& r : kept_ranges) {
    void* ptr = reinterpret_cast<void*>(r.first);
    EXPECT_TRUE(backend->RegisterHostMemory(ptr, static_cast<int64_t>(r.second - r.first), false).ok());
    EXPECT_TRUE(backend->UnregisterHostMemory(ptr).ok());
  }

  // A host that refuses to lock memory: the status says so and nothing stays registered.
  SimulatedBackendOptions refusing;
  refusing.refuse_host_registration = true;
  auto strict = CreateSimulatedBackend(refusing);
  StackModel other;
  std::unique_ptr<HostWeights> refused = *HostWeights::Capture(other);
  const absl::Status status = refused->PinInPlace(*strict);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(status.message()).find("pinning"), std::string::npos) << status;
  EXPECT_EQ(refused->pinned_in_place_bytes(), 0);
  ASSERT_TRUE(refused->OnloadAll(*strict).ok());  // Copies still work, from pageable memory.
}

// HostPins shares pages between users: a range overlapping one already locked registers only its
// new pages, and a segment stays registered until its last user releases it.
TEST(HostPinsTest, OverlappingUsersShareSegmentsUntilTheLastReleases) {
  auto backend = CreateSimulatedBackend({});
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  at::Tensor memory = at::empty({static_cast<int64_t>(8 * page)}, at::kByte);
  const uintptr_t base = (reinterpret_cast<uintptr_t>(memory.data_ptr()) + page - 1) / page * page;
  HostPins& pins = HostPins::Global();
  const int64_t before = pins.registered_bytes();
  auto a = pins.Pin(*backend, {{base, base + 3 * page}});
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = pins.Pin(*backend, {{base + 2 * page, base + 5 * page}});  // Shares page 2.
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->bytes(), static_cast<int64_t>(3 * page));
  EXPECT_EQ(pins.registered_bytes() - before, static_cast<int64_t>(5 * page));  // Each page once.
  a->Release();
  // a's segment [0, 3) is still held by b (it shares page 2): nothing unregistered yet.
  EXPECT_EQ(pins.registered_bytes() - before, static_cast<int64_t>(5 * page));
  EXPECT_EQ(backend->RegisterHostMemory(reinterpret_cast<void*>(base), static_cast<int64_t>(page), false).code(),
            absl::StatusCode::kAlreadyExists);
  b->Release();
  EXPECT_EQ(pins.registered_bytes(), before);
  ASSERT_TRUE(backend->RegisterHostMemory(reinterpret_cast<void*>(base), static_cast<int64_t>(5 * page), false).ok());
  ASSERT_TRUE(backend->UnregisterHostMemory(reinterpret_cast<void*>(base)).ok());

  // A refused registration leaves nothing behind, including the shared references it took.
  auto c = pins.Pin(*backend, {{base, base + 2 * page}});
  ASSERT_TRUE(c.ok());
  SimulatedBackendOptions refusing;
  refusing.refuse_host_registration = true;
  auto strict = CreateSimulatedBackend(refusing);
  auto d = pins.Pin(*strict, {{base + page, base + 4 * page}});  // Shares page 1, then must register.
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
  c->Release();
  EXPECT_EQ(pins.registered_bytes(), before);
}

TEST(HostStoreFactoryTest, CompressionNeedsThePinnedTarget) {
  HostStoreOptions options;
  options.compress = CompressFormat::kInt8;
  EXPECT_TRUE(ValidateHostStoreOptions(options).ok());
  for (OffloadTarget target : {OffloadTarget::kPageableHost, OffloadTarget::kDisk}) {
    options.target = target;
    EXPECT_EQ(ValidateHostStoreOptions(options).code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(HostStoreFactoryTest, ValidatesStagingOnlyForTargetsThatStage) {
  HostStoreOptions options;
  options.staging_buffers = 0;
  options.target = OffloadTarget::kPinnedHost;
  EXPECT_TRUE(ValidateHostStoreOptions(options).ok());
  for (OffloadTarget target : {OffloadTarget::kPageableHost, OffloadTarget::kDisk}) {
    options.target = target;
    EXPECT_EQ(ValidateHostStoreOptions(options).code(), absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace stowage
