// One conformance suite for every HostStore (through CreateHostStore, the way the engine gets
// them), on the simulated backend: after CopyGroupToSlot, the slot holds every tensor of the group
// at its planned offset, bit for bit, and nothing past the group's bytes; each store moves the bytes
// the way it promises (one DMA of the packed group, or one per tensor). The compressed store is
// lossy: its streamed tensors of rank >= 2 are compared, bit for bit, with the dequantized
// reference (offload/compression.h), everything else with the original.
#include "offload/host_store.h"

#include <sys/stat.h>

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "offload/device_backend.h"
#include "offload/group_plan.h"
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
