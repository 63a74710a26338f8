// One conformance suite for every HostStore (through CreateHostStore, the way the engine gets
// them), on the simulated backend: after CopyGroupToSlot, the slot holds every tensor of the group
// at its planned offset, bit for bit, and nothing past the group's bytes; each store moves the bytes
// the way it promises (one DMA of the packed group, or one per tensor). The compressed store is
// lossy: its streamed tensors of rank >= 2 are compared, bit for bit, with the dequantized
// reference (offload/compression.h), everything else with the original.
#include "offload/host_store.h"

#include <malloc.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "base/process_memory.h"
#include "offload/device_backend.h"
#include "offload/group_plan.h"
#include "offload/host_pins.h"
#include "offload/host_store_factory.h"
#include "offload/host_weights.h"
#include "offload/safetensors.h"
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
    tensors.push_back(PlanTensor{e.slot, static_cast<int64_t>(e.host.nbytes()), scratch_plan.tensor_bytes[i],
                                 scratch_plan.carried_bytes.empty() ? 0 : scratch_plan.carried_bytes[i]});
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
      std::unique_ptr<DeviceEvent> copied = (*store)->CopyGroupToSlot(static_cast<int>(gi), *slot, scratch);
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

// A module whose parameters are the given tensors (views of one buffer, say).
class TensorsModule : public Module {
 public:
  explicit TensorsModule(const std::vector<at::Tensor>& tensors) : Module("TensorsModule") {
    for (size_t i = 0; i < tensors.size(); ++i) AddParameter("w" + std::to_string(i), tensors[i]);
  }
};

uintptr_t Page() { return static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE)); }

// Module::AddAdjacentGroup: onloading puts a group's copies side by side in one allocation, in the
// group's order (so one GEMM reads Q, K and V as one matrix); the other tensors get their own. The
// bytes on the device are exactly the weights' either way, and offloading frees them all.
TEST(HostWeightsAdjacencyTest, OnloadPlacesAGroupSideBySideInItsOrder) {
  auto backend = CreateSimulatedBackend({});
  TensorsModule model({at::randn({4, 8}), at::randn({3, 8}), at::randn({5}), at::randn({2, 8})});
  model.AddAdjacentGroup({{&model, 3}, {&model, 0}, {&model, 1}});  // w3, w0, w1: not slot order.
  auto weights = HostWeights::Capture(model);
  ASSERT_TRUE(weights.ok()) << weights.status();
  std::vector<at::Tensor> host;
  for (const TensorSlot& slot : model.slots()) host.push_back(slot.value);
  ASSERT_TRUE((*weights)->OnloadAll(*backend).ok());
  const std::vector<TensorSlot>& s = model.slots();
  for (size_t i = 0; i < s.size(); ++i) {
    EXPECT_TRUE(at::equal(s[i].value, host[i])) << i;
    EXPECT_FALSE(s[i].value.is_same(host[i])) << i;
  }
  auto address = [&](size_t i) { return static_cast<const char*>(s[i].value.data_ptr()); };
  EXPECT_TRUE(s[3].value.storage().is_alias_of(s[0].value.storage()));
  EXPECT_TRUE(s[0].value.storage().is_alias_of(s[1].value.storage()));
  EXPECT_EQ(address(3) + 2 * 8 * 4, address(0));
  EXPECT_EQ(address(0) + 4 * 8 * 4, address(1));
  EXPECT_FALSE(s[2].value.storage().is_alias_of(s[0].value.storage()));
  EXPECT_EQ(backend->GetMemoryStats().allocated_bytes, (*weights)->bytes());
  (*weights)->OffloadAll();
  EXPECT_EQ(backend->GetMemoryStats().allocated_bytes, 0);
}

// Onloading a component whose host copies are views of a safetensors mapping drops each adjacent
// group's mapped pages from RSS once that group's copies are done: the peak holds the device copies
// (host memory here: the simulated device) plus about two groups' pages, not every group's.
TEST(HostWeightsAdjacencyTest, OnloadFromAMappingDropsEachGroupsPagesAsItGoes) {
  constexpr int64_t kTensorBytes = 16 << 20;
  constexpr int kGroups = 8;  // Of two tensors each: 256 MiB in all.
  const std::string path = std::string(::testing::TempDir()) + "/adjacent_groups.safetensors";
  {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (int i = 0; i < 2 * kGroups; ++i) tensors.emplace_back("w" + std::to_string(i), at::rand({kTensorBytes / 4}));
    ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  }
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<at::Tensor> mapped;
  for (int i = 0; i < 2 * kGroups; ++i) mapped.push_back(*(*file)->Get("w" + std::to_string(i)));
  TensorsModule model(mapped);
  for (int g = 0; g < kGroups; ++g) model.AddAdjacentGroup({{&model, 2 * g}, {&model, 2 * g + 1}});
  auto backend = CreateSimulatedBackend({});
  auto weights = HostWeights::Capture(model);
  ASSERT_TRUE(weights.ok()) << weights.status();
  if (!ResetPeakRss().ok()) GTEST_SKIP() << "/proc/self/clear_refs is not writable here";
  const int64_t before = ReadProcessMemory()->rss_bytes;
  ASSERT_TRUE((*weights)->OnloadAll(*backend).ok());
  const ProcessMemory after = *ReadProcessMemory();
  const int64_t total = 2 * kGroups * kTensorBytes, group = 2 * kTensorBytes;
  EXPECT_LT(after.peak_rss_bytes - before, total + 3 * group)
      << "peak RSS grew by " << (after.peak_rss_bytes - before) / (1 << 20) << " MiB: more than the device copies ("
      << total / (1 << 20) << " MiB) and about two groups of mapped pages";
  for (int i = 0; i < 2 * kGroups; ++i) EXPECT_TRUE(at::equal(model.slots()[i].value, mapped[i])) << i;
  (*weights)->OffloadAll();
}

// A tensor in two groups, or a group naming a tensor twice: the later group is ignored (the layout
// stays a hint), and onloading still works.
TEST(HostWeightsAdjacencyTest, OverlappingGroupsKeepTheFirst) {
  auto backend = CreateSimulatedBackend({});
  TensorsModule model({at::randn({4, 8}), at::randn({3, 8}), at::randn({2, 8})});
  model.AddAdjacentGroup({{&model, 0}, {&model, 1}});
  model.AddAdjacentGroup({{&model, 1}, {&model, 2}});
  model.AddAdjacentGroup({{&model, 2}, {&model, 2}});
  auto weights = HostWeights::Capture(model);
  ASSERT_TRUE(weights.ok()) << weights.status();
  ASSERT_TRUE((*weights)->OnloadAll(*backend).ok());
  const std::vector<TensorSlot>& s = model.slots();
  EXPECT_TRUE(s[0].value.storage().is_alias_of(s[1].value.storage()));
  EXPECT_FALSE(s[2].value.storage().is_alias_of(s[1].value.storage()));
  EXPECT_EQ(backend->GetMemoryStats().allocated_bytes, (*weights)->bytes());
}

// Every host copy lies wholly inside page-locked memory, and copies to the device (the simulated
// backend refuses, as CUDA does, a copy that runs across the edge of page-locked memory).
void ExpectEveryHostCopyLockedAndCopyable(HostWeights& weights, DeviceBackend& backend) {
  for (const HostWeights::Entry& e : weights.entries()) {
    const auto* first = static_cast<const uint8_t*>(e.host.data_ptr());
    EXPECT_TRUE(backend.IsPageLockedHostMemory(first)) << e.module->SlotPath(*e.slot);
    EXPECT_TRUE(backend.IsPageLockedHostMemory(first + e.host.nbytes() - 1)) << e.module->SlotPath(*e.slot);
    absl::StatusOr<at::Tensor> copy = backend.CopyToDevice(e.host);
    ASSERT_TRUE(copy.ok()) << e.module->SlotPath(*e.slot) << ": " << copy.status();
    EXPECT_TRUE(at::equal(*copy, e.host));
  }
}

// Heap host copies share their pages with whatever else the process allocated. PinInPlace moves
// them, once, into an arena of the component's own and locks that: the values are unchanged, the
// slots follow, memory beside the old copies stays pageable, a second pin moves nothing, and
// Unpin leaves the arena pageable again.
TEST(HostWeightsPinningTest, HeapCopiesMoveIntoAnArenaThatHoldsNothingElse) {
  auto backend = CreateSimulatedBackend({});  // Outlives the weights it pins.
  StackModel model;
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(model);
  at::Tensor neighbour = at::ones({16});  // Likely on a page beside a host copy.
  std::vector<at::Tensor> before;
  std::vector<const void*> heap;
  for (const HostWeights::Entry& e : weights->entries()) {
    before.push_back(e.host.clone());
    heap.push_back(e.host.data_ptr());
  }
  ASSERT_TRUE(weights->PinInPlace(*backend).ok());
  EXPECT_EQ(weights->last_pin_moved_bytes(), StackModel::kTotalBytes);
  EXPECT_GE(weights->pinned_in_place_bytes(), StackModel::kTotalBytes);
  EXPECT_LT(weights->pinned_in_place_bytes(), StackModel::kTotalBytes + 256 * 64 + static_cast<int64_t>(Page()));
  EXPECT_FALSE(backend->IsPageLockedHostMemory(neighbour.data_ptr()));
  for (size_t i = 0; i < weights->entries().size(); ++i) {
    const HostWeights::Entry& e = weights->entries()[i];
    EXPECT_NE(e.host.data_ptr(), heap[i]);
    EXPECT_TRUE(at::equal(e.host, before[i])) << e.module->SlotPath(*e.slot);
    EXPECT_TRUE(e.slot->value.is_same(e.host)) << "the slot follows its host copy";
  }
  ExpectEveryHostCopyLockedAndCopyable(*weights, *backend);
  at::Tensor out = model.Forward(at::ones({2, 16}));  // The model still runs on its moved copies.
  EXPECT_EQ(out.size(1), 64);

  const void* arena_first = weights->entries().front().host.data_ptr();
  weights->Unpin();
  EXPECT_EQ(weights->pinned_in_place_bytes(), 0);
  EXPECT_FALSE(backend->IsPageLockedHostMemory(arena_first));
  ASSERT_TRUE(weights->PinInPlace(*backend).ok());  // The arena again: nothing moves.
  EXPECT_EQ(weights->last_pin_moved_bytes(), 0);
  EXPECT_EQ(weights->entries().front().host.data_ptr(), arena_first);
  ASSERT_TRUE(weights->PinInPlace(*backend).ok());  // Already pinned: nothing changes.

  // ReplaceHost unpins (the old host tensor may be freed).
  HostWeights::Entry& entry = weights->entries().front();
  weights->ReplaceHost(entry, entry.host.clone());
  EXPECT_EQ(weights->pinned_in_place_bytes(), 0);
  EXPECT_FALSE(backend->IsPageLockedHostMemory(arena_first));
  // The destructor unpins.
  ASSERT_TRUE(weights->PinInPlace(*backend).ok());
  const void* locked = weights->entries().back().host.data_ptr();
  std::vector<at::Tensor> keep;
  for (const HostWeights::Entry& e : weights->entries()) keep.push_back(e.host);
  weights.reset();
  EXPECT_FALSE(backend->IsPageLockedHostMemory(locked));
}

// HostWeights::OnloadAllAsync, on the simulator and (where this build and host have it) CUDA: it
// needs page-locked host copies; with them it returns at once with a copy-stream event, the slots
// point at device copies (an adjacent group side by side) that hold the weights once the compute
// stream waited for the event, and OffloadAll frees them. The simulated link is slow enough that the
// copies are still running when it returns.
TEST(HostWeightsAsyncOnloadTest, CopiesOnTheCopyStreamFromPageLockedCopiesOnly) {
  for (const bool cuda : {false, true}) {
    SCOPED_TRACE(cuda ? "cuda" : "simulated");
    std::unique_ptr<DeviceBackend> backend;
    if (cuda) {
      auto made = CreateCudaBackend(0);
      if (!made.ok()) continue;  // No CUDA in this build or host.
      backend = *std::move(made);
    } else {
      SimulatedBackendOptions slow;
      slow.bandwidth_bytes_per_second = 4 << 20;  // 4 MiB/s: the 48 KiB below take ~12 ms.
      backend = CreateSimulatedBackend(slow);
    }
    TensorsModule model({at::randn({64, 64}), at::randn({32, 64}), at::randn({5}), at::randn({64, 64})});
    model.AddAdjacentGroup({{&model, 0}, {&model, 1}});
    std::unique_ptr<HostWeights> weights = *HostWeights::Capture(model);
    std::vector<at::Tensor> host;
    for (const TensorSlot& slot : model.slots()) host.push_back(slot.value.clone());
    const absl::StatusOr<std::unique_ptr<DeviceEvent>> refused = weights->OnloadAllAsync(*backend);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_EQ(backend->GetMemoryStats().allocated_bytes, 0);
    ASSERT_TRUE(weights->PinInPlace(*backend).ok());
    absl::StatusOr<std::unique_ptr<DeviceEvent>> copying = weights->OnloadAllAsync(*backend);
    ASSERT_TRUE(copying.ok()) << copying.status();
    if (!cuda) {
      EXPECT_FALSE((*copying)->Query()) << "returned only after the copies";
    }
    EXPECT_GE(backend->GetMemoryStats().allocated_bytes, weights->bytes());
    backend->ComputeStreamWait(**copying);
    const std::vector<TensorSlot>& s = model.slots();
    for (size_t i = 0; i < s.size(); ++i) {
      EXPECT_EQ(s[i].value.device().type(), backend->torch_device().type()) << i;
      EXPECT_TRUE(at::equal(s[i].value.to(at::kCPU), host[i])) << i;
    }
    EXPECT_TRUE(s[0].value.storage().is_alias_of(s[1].value.storage()));
    (*copying)->Wait();
    weights->OffloadAll();
    backend->Synchronize();
    backend->ReleaseCachedMemory();
    EXPECT_EQ(backend->GetMemoryStats().allocated_bytes, 0);
    weights.reset();  // Unpins through the backend, before it goes.
  }
}

// The bug the H200 found: two components whose host copies share a heap page. Pinning each
// one's page ranges registered the shared page for the first and only the rest for the second, so
// a tensor of the second ran across two registrations and CUDA refused to copy it ("invalid
// argument"), as did any request tensor allocated on a locked page. With arenas both pin, every
// copy works, and the buffer they came from stays pageable.
TEST(HostWeightsPinningTest, ComponentsSharingHeapPagesBothPinAndCopy) {
  auto backend = CreateSimulatedBackend({});  // Outlives the weights it pins.
  const auto page = static_cast<int64_t>(Page());
  at::Tensor buffer = at::arange(3 * page / 4, at::kFloat);  // 3 pages of bytes.
  TensorsModule a({buffer.narrow(0, 0, page / 8), buffer.narrow(0, page / 8, 3 * page / 16)});  // Up to 1.25 pages.
  TensorsModule b({buffer.narrow(0, 5 * page / 16, 7 * page / 16)});  // 1.25 .. 3 pages.
  std::unique_ptr<HostWeights> wa = *HostWeights::Capture(a);
  std::unique_ptr<HostWeights> wb = *HostWeights::Capture(b);
  ASSERT_TRUE(wa->PinInPlace(*backend).ok());
  ASSERT_TRUE(wb->PinInPlace(*backend).ok());
  ExpectEveryHostCopyLockedAndCopyable(*wa, *backend);
  ExpectEveryHostCopyLockedAndCopyable(*wb, *backend);
  EXPECT_FALSE(backend->IsPageLockedHostMemory(buffer.data_ptr()));
  EXPECT_TRUE(backend->CopyToDevice(buffer).ok()) << "the old buffer is plain pageable memory";
  EXPECT_TRUE(at::equal(wb->entries()[0].host, buffer.narrow(0, 5 * page / 16, 7 * page / 16)));
  // Views of one storage in one component stay one copy in the arena.
  TensorsModule tied({buffer.narrow(0, 0, 64), buffer.narrow(0, 0, 64)});
  std::unique_ptr<HostWeights> wt = *HostWeights::Capture(tied);
  ASSERT_TRUE(wt->PinInPlace(*backend).ok());
  EXPECT_EQ(wt->entries()[0].host.data_ptr(), wt->entries()[1].host.data_ptr());
}

// Host copies in a safetensors file's mapping lock the whole mapping, read-only, and move nothing;
// two components on one file share the registration. Host copies already in page-locked memory
// (a pinned arena) need no region at all: CUDA would refuse to register them again.
TEST(HostWeightsPinningTest, MappedCopiesLockTheirMappingAndPinnedOnesNothing) {
  auto backend = CreateSimulatedBackend({});  // Outlives the weights it pins.
  const std::string path = ::testing::TempDir() + "/pin_mapped.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, {{"a", at::arange(1000, at::kFloat)}, {"b", at::ones({3000})}}).ok());
  std::shared_ptr<SafetensorsFile> file = *SafetensorsFile::Open(path);
  TensorsModule first({*file->Get("a"), *file->Get("b")});
  TensorsModule second({*file->Get("b")});
  std::unique_ptr<HostWeights> w1 = *HostWeights::Capture(first);
  std::unique_ptr<HostWeights> w2 = *HostWeights::Capture(second);
  absl::StatusOr<HostWeights::Lockable> lockable = w1->LockableRegions(*backend);
  ASSERT_TRUE(lockable.ok()) << lockable.status();
  ASSERT_EQ(lockable->regions.size(), 1u);
  EXPECT_EQ(lockable->regions[0].begin, reinterpret_cast<uintptr_t>(file->mapping()));
  EXPECT_GE(lockable->regions[0].bytes(), file->mapping_bytes());
  EXPECT_TRUE(lockable->regions[0].read_only);
  EXPECT_EQ(lockable->moved_to_arena_bytes, 0);
  const int64_t registered = HostPins::Global().registered_bytes();
  ASSERT_TRUE(w1->PinInPlace(*backend).ok());
  ASSERT_TRUE(w2->PinInPlace(*backend).ok());
  EXPECT_EQ(w1->last_pin_moved_bytes(), 0);
  EXPECT_EQ(HostPins::Global().registered_bytes() - registered, lockable->regions[0].bytes());  // Once.
  ExpectEveryHostCopyLockedAndCopyable(*w2, *backend);
  w1.reset();
  ExpectEveryHostCopyLockedAndCopyable(*w2, *backend);  // Still held by the second.
  w2.reset();
  EXPECT_EQ(HostPins::Global().registered_bytes(), registered);

  StackModel model;
  std::unique_ptr<HostWeights> packed = *HostWeights::Capture(model);
  at::Tensor pinned = *backend->AllocatePinnedHost(StackModel::kTotalBytes);
  int64_t offset = 0;
  for (HostWeights::Entry& e : packed->entries()) {
    const auto n = static_cast<int64_t>(e.host.nbytes());
    at::Tensor view = pinned.narrow(0, offset, n).view(e.host.scalar_type()).view(e.host.sizes());
    view.copy_(e.host);
    packed->ReplaceHost(e, view);
    offset += n;
  }
  EXPECT_FALSE(backend->RegisterHostMemory(pinned.data_ptr(), 64, false).ok());
  lockable = packed->LockableRegions(*backend);
  ASSERT_TRUE(lockable.ok()) << lockable.status();
  EXPECT_TRUE(lockable->regions.empty());
  EXPECT_EQ(lockable->already_locked_bytes, StackModel::kTotalBytes);
  ASSERT_TRUE(packed->PinInPlace(*backend).ok());
  EXPECT_EQ(packed->pinned_in_place_bytes(), 0);
  ExpectEveryHostCopyLockedAndCopyable(*packed, *backend);
}

// Moving heap copies into the arena holds about one copy in RAM: each storage's heap memory is
// freed before the next is copied, so the peak grows by about one tensor, not by the component.
TEST(HostWeightsPinningTest, MovingIntoTheArenaHoldsAboutOneCopyInRam) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "ASan's allocator keeps freed memory in quarantine";
#endif
  constexpr int64_t kTensorBytes = 40 << 20;  // Above glibc's largest mmap threshold: freed at once.
  constexpr int kTensors = 6;
  auto backend = CreateSimulatedBackend({});  // Outlives the weights it pins.
  std::vector<at::Tensor> tensors;
  for (int i = 0; i < kTensors; ++i) tensors.push_back(at::full({kTensorBytes / 4}, static_cast<float>(i)));
  TensorsModule module(tensors);
  tensors.clear();  // The module's slots hold them now.
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(module);
  if (!ResetPeakRss().ok()) GTEST_SKIP() << "/proc/self/clear_refs is not writable here";
  const int64_t before = ReadProcessMemory()->rss_bytes;
  ASSERT_TRUE(weights->PinInPlace(*backend).ok());
  const ProcessMemory after = *ReadProcessMemory();
  EXPECT_EQ(weights->last_pin_moved_bytes(), kTensors * kTensorBytes);
  EXPECT_LT(after.peak_rss_bytes - before, 2 * kTensorBytes) << "peak grew by more than about one tensor";
  EXPECT_LT(after.rss_bytes - before, kTensorBytes) << "the heap copies were not freed";
  for (int i = 0; i < kTensors; ++i) {
    EXPECT_EQ(weights->entries()[i].host[kTensorBytes / 4 - 1].item<float>(), static_cast<float>(i));
  }
}

// The body of NoRoomForTheArenaMovesNothing, in the child: 0 when every promise holds, else the
// number of the first that broke.
int PinWithoutRoomForTheArena() {
  auto backend = CreateSimulatedBackend({});
  std::vector<at::Tensor> tensors;
  for (int i = 0; i < 4; ++i) tensors.push_back(at::full({16 << 20}, static_cast<float>(i)));  // 64 MiB each.
  TensorsModule module(tensors);
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(module);
  std::vector<const void*> where;
  for (const HostWeights::Entry& e : weights->entries()) where.push_back(e.host.data_ptr());
  const int64_t registered = HostPins::Global().registered_bytes();
  // Room for some small allocations, not for a 256 MiB arena.
  int64_t vm_kib = 0;
  std::FILE* status_file = std::fopen("/proc/self/status", "r");
  char line[256];
  while (status_file != nullptr && std::fgets(line, sizeof line, status_file) != nullptr) {
    if (std::sscanf(line, "VmSize: %ld kB", &vm_kib) == 1) break;
  }
  if (status_file != nullptr) std::fclose(status_file);
  const auto cap = static_cast<rlim_t>((vm_kib << 10) + (64 << 20));
  rlimit limit{};
  if (vm_kib == 0 || ::getrlimit(RLIMIT_AS, &limit) != 0) return 3;
  const rlim_t unlimited = limit.rlim_cur;
  limit.rlim_cur = cap;  // The soft limit only: it goes back up below.
  if (::setrlimit(RLIMIT_AS, &limit) != 0) return 3;
  const absl::Status status = weights->PinInPlace(*backend);
  if (status.code() != absl::StatusCode::kResourceExhausted) return 4;
  if (std::string(status.message()).find("arena") == std::string::npos) return 5;
  if (weights->pinned_in_place_bytes() != 0 || HostPins::Global().registered_bytes() != registered) return 6;
  for (size_t i = 0; i < weights->entries().size(); ++i) {
    const at::Tensor& host = weights->entries()[i].host;
    if (host.data_ptr() != where[i] || host[0].item<float>() != static_cast<float>(i)) return 7;
  }
  limit.rlim_cur = unlimited;  // The simulated device's memory is host memory too.
  if (::setrlimit(RLIMIT_AS, &limit) != 0) return 3;
  if (!weights->OnloadAll(*backend).ok()) return 8;
  return 0;
}

// A host with no address space left for the arena: PinInPlace says so, nothing moved (every host
// copy is where it was, with its values), nothing is registered, and onloading still works. Run in
// a child process whose address-space limit leaves no room for the arena.
TEST(HostWeightsPinningTest, NoRoomForTheArenaMovesNothing) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizers reserve address space that an RLIMIT_AS would starve";
#endif
  // The child runs this test afresh (no thread pool inherited through fork).
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  EXPECT_EXIT(std::_Exit(PinWithoutRoomForTheArena()), ::testing::ExitedWithCode(0), "");
}

// The body of PinnedStoreHandsTheHeapOriginalsBackAsItPacks, in the child: 0 when the peak holds,
// else the number of the first promise that broke.
int PackHeapCopiesIntoPinnedChunks() {
  // Every 16 MiB tensor on the heap, as glibc does once its dynamic mmap threshold has risen to
  // 32 MiB (the FP8 copies of a transformer's attention projections at load).
  if (::mallopt(M_MMAP_THRESHOLD, 64 << 20) != 1) return 0;  // Not settable here: nothing to measure.
  constexpr int64_t kTensorBytes = 16 << 20;
  constexpr int kTensors = 40;  // 640 MiB: three pinned chunks of about 256 MiB.
  std::vector<at::Tensor> tensors;
  for (int i = 0; i < kTensors; ++i) tensors.push_back(at::full({kTensorBytes / 4}, static_cast<float>(i)));
  TensorsModule module(tensors);
  tensors.clear();  // The module's slots hold them now.
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(module);
  std::vector<PlannedGroup> groups;
  for (int i = 0; i < kTensors; ++i) {
    PlannedGroup g;
    g.name = "blocks." + std::to_string(i);
    g.tensors.push_back(PlannedTensor{i, 0, kTensorBytes});
    g.bytes = kTensorBytes;
    groups.push_back(std::move(g));
  }
  auto backend = CreateSimulatedBackend({});
  HostStoreOptions options;
  options.target = OffloadTarget::kPinnedHost;
  options.pin_in_place = false;
  if (!ResetPeakRss().ok()) return 0;  // Not measurable here (the parent skips the same way).
  const int64_t before = ReadProcessMemory()->rss_bytes;
  auto store = CreateHostStore(options, groups, *weights, *backend);
  if (!store.ok()) return 3;
  const ProcessMemory after = *ReadProcessMemory();
  if (after.rss_bytes - before > kTensorBytes) return 6;  // The originals' pages are all back.
  // `before` holds the heap originals; each is freed once copied and its pages go back as the
  // store goes, so the peak grows by about the trimming period (64 MiB here), not by the copies:
  // before the store trimmed as it went, every freed original stayed beside the chunks (+640 MiB).
  if (after.peak_rss_bytes - before > 16 * kTensorBytes) {
    std::fprintf(stderr, "peak RSS grew by %lld MiB\n", static_cast<long long>((after.peak_rss_bytes - before) >> 20));
    return 4;
  }
  for (int i = 0; i < kTensors; ++i) {
    if (weights->entries()[i].host[kTensorBytes / 4 - 1].item<float>() != static_cast<float>(i)) return 5;
  }
  return 0;
}

// Packing heap copies into pinned chunks holds about the weights once: each original is freed as
// it is copied and glibc hands the freed heap back as the store goes, not only at the end. Run in a
// child process (its own malloc settings: every tensor on the heap).
TEST(PinnedHostStoreTest, PinnedStoreHandsTheHeapOriginalsBackAsItPacks) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizers have their own allocators";
#endif
  if (!ResetPeakRss().ok()) GTEST_SKIP() << "/proc/self/clear_refs is not writable here";
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  EXPECT_EXIT(std::_Exit(PackHeapCopiesIntoPinnedChunks()), ::testing::ExitedWithCode(0), "");
}

// A host that refuses to lock memory: the status says so and nothing stays registered; copies
// still work from pageable memory.
TEST(HostWeightsPinningTest, RefusedPinningLeavesNothingRegistered) {
  SimulatedBackendOptions refusing;
  refusing.refuse_host_registration = true;
  auto strict = CreateSimulatedBackend(refusing);
  StackModel other;
  std::unique_ptr<HostWeights> refused = *HostWeights::Capture(other);
  const int64_t registered = HostPins::Global().registered_bytes();
  const absl::Status status = refused->PinInPlace(*strict);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(status.message()).find("pinning"), std::string::npos) << status;
  EXPECT_EQ(refused->pinned_in_place_bytes(), 0);
  EXPECT_EQ(HostPins::Global().registered_bytes(), registered);
  ASSERT_TRUE(refused->OnloadAll(*strict).ok());
}

// HostPins shares a region among its users until the last releases it, and refuses a region that
// partly overlaps a locked one (a copy could run across the edge); a refused call leaves nothing.
TEST(HostPinsTest, UsersShareWholeRegionsAndPartialOverlapsAreRefused) {
  auto backend = CreateSimulatedBackend({});
  const uintptr_t page = Page();
  at::Tensor memory = at::empty({static_cast<int64_t>(8 * page)}, at::kByte);
  const uintptr_t base = (reinterpret_cast<uintptr_t>(memory.data_ptr()) + page - 1) / page * page;
  HostPins& pins = HostPins::Global();
  const int64_t before = pins.registered_bytes();
  auto a = pins.Pin(*backend, {HostRegion{base, base + 3 * page}});
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = pins.Pin(*backend, {HostRegion{base, base + 3 * page}});  // The same region: shared.
  ASSERT_TRUE(b.ok()) << b.status();
  auto inside = pins.Pin(*backend, {HostRegion{base + page, base + 2 * page}});  // Inside: shared.
  ASSERT_TRUE(inside.ok()) << inside.status();
  EXPECT_EQ(pins.registered_bytes() - before, static_cast<int64_t>(3 * page));
  for (uintptr_t begin : {base + 2 * page, base - page}) {  // Past the end; over the start.
    auto partial = pins.Pin(*backend, {HostRegion{base + 5 * page, base + 6 * page}, HostRegion{begin, begin + 2 * page}});
    EXPECT_EQ(partial.status().code(), absl::StatusCode::kFailedPrecondition) << partial.status();
  }
  EXPECT_EQ(pins.registered_bytes() - before, static_cast<int64_t>(3 * page));  // The first region of those calls too.
  a->Release();
  inside->Release();
  EXPECT_TRUE(backend->IsPageLockedHostMemory(reinterpret_cast<void*>(base)));  // b holds it.
  b->Release();
  EXPECT_EQ(pins.registered_bytes(), before);
  EXPECT_FALSE(backend->IsPageLockedHostMemory(reinterpret_cast<void*>(base)));

  SimulatedBackendOptions refusing;
  refusing.refuse_host_registration = true;
  auto strict = CreateSimulatedBackend(refusing);
  auto c = pins.Pin(*backend, {HostRegion{base, base + 2 * page}});
  ASSERT_TRUE(c.ok());
  auto d = pins.Pin(*strict, {HostRegion{base, base + 2 * page}, HostRegion{base + 4 * page, base + 5 * page}});
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);  // Its shared reference dropped too.
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

namespace stowage {
namespace {

// The disk store writes a group's file once and reuses it while its fingerprint (XXH3 of the
// tensors' names, dtypes, shapes and bytes) matches; a group whose weights changed is written again.
TEST(DiskHostStoreTest, ReusesFilesWhoseContentsMatchAndRewritesChangedOnes) {
  const std::string dir = std::string(::testing::TempDir()) + "/disk_reuse";
  ::mkdir(dir.c_str(), 0755);
  // A fresh model each time (its weights come from a fixed seed); `change` bumps one weight of
  // blocks.0 before the store is built.
  auto build = [&](bool change, HostStoreStats* stats) {
    StackModel model;
    std::unique_ptr<HostWeights> weights = *HostWeights::Capture(model);
    std::vector<PlanTensor> tensors;
    bool changed = false;
    for (HostWeights::Entry& e : weights->entries()) {
      tensors.push_back(PlanTensor{e.slot, static_cast<int64_t>(e.host.nbytes()), 0});
      if (change && !changed && e.module->SlotPath(*e.slot).find("blocks.0.") != std::string::npos) {
        e.host.add_(1.0);
        changed = true;
      }
    }
    ASSERT_EQ(changed, change);
    GroupPlanOptions plan_options;
    plan_options.num_blocks_per_group = 2;
    plan_options.slots = 1;
    auto plan = PlanGroups("stack", model, tensors, plan_options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
    HostStoreOptions options;
    options.component = "stack";
    options.target = OffloadTarget::kDisk;
    options.disk_dir = dir;
    weights->OffloadAll();
    auto store = CreateHostStore(options, plan->groups, *weights, *backend);
    ASSERT_TRUE(store.ok()) << store.status();
    *stats = (*store)->stats();
  };
  HostStoreStats first, second, third;
  build(false, &first);
  ASSERT_GT(first.disk_files_written, 1);
  EXPECT_EQ(first.disk_files_reused, 0);
  build(false, &second);
  EXPECT_EQ(second.disk_files_written, 0);
  EXPECT_EQ(second.disk_files_reused, first.disk_files_written);
  build(true, &third);
  EXPECT_EQ(third.disk_files_written, 1);
  EXPECT_EQ(third.disk_files_reused, first.disk_files_written - 1);
}

}  // namespace
}  // namespace stowage
