#include "offload/group_offload.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "offload/compression.h"
#include "offload/device_backend.h"
#include "offload/host_weights.h"
#include "base/out_of_memory.h"
#include "offload/safetensors.h"
#include "tests/offload/stack_model.h"

namespace stowage {
namespace {

// One model on one simulated device, with its resident reference output.
struct Fixture {
  Fixture() : backend(CreateSimulatedBackend({})) {
    weights = *HostWeights::Capture(model);
    input = at::randn({3, 5, 16}, at::TensorOptions().dtype(at::kFloat));
    c10::InferenceMode guard;
    weights->PointAtHost();
    reference = model.Forward(input);
    reverse_reference = Run(StackOrder::kReverse);
    skip_reference = Run(StackOrder::kSkipOdd);
    repeat_reference = Run(StackOrder::kRepeatFirst);
    twice_reference = Run(StackOrder::kFirstTwice);
    weights->OffloadAll();
  }
  at::Tensor Run(StackOrder order) {
    c10::InferenceMode guard;
    model.order = order;
    at::Tensor out = model.Forward(input);
    model.order = StackOrder::kForward;
    return out;
  }
  // Peak device bytes of one forward in `order`.
  int64_t PeakOfForward(StackOrder order, at::Tensor* out) {
    backend->Synchronize();
    backend->ResetPeakStats();
    *out = Run(order);
    backend->Synchronize();
    return backend->GetMemoryStats().peak_allocated_bytes;
  }

  StackModel model;
  std::unique_ptr<DeviceBackend> backend;
  std::unique_ptr<HostWeights> weights;
  at::Tensor input, reference, reverse_reference, skip_reference, repeat_reference, twice_reference;
};

struct ModeCase {
  std::string name;
  GroupOffloadOptions options;
  int64_t expected_peak;
};

GroupOffloadOptions Opts(OffloadType type, int blocks, bool stream, OffloadTarget target,
                         bool pin_in_place = true) {
  GroupOffloadOptions o;
  o.type = type;
  o.num_blocks_per_group = blocks;
  o.use_stream = stream;
  o.target = target;
  o.pin_in_place = pin_in_place;
  o.staging_buffer_bytes = 1 << 16;  // Small: several staged chunks per group.
  return o;
}

std::string TempDir(const std::string& name) {
  const std::string dir = std::string(::testing::TempDir()) + "/" + name;
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

std::vector<ModeCase> Cases() {
  using T = OffloadTarget;
  const int64_t block = StackModel::kBlockBytes;
  const int64_t outside = StackModel::kOutsideBytes;
  const int64_t leaf = StackModel::kLargestLeafBytes;
  const int64_t root = StackModel::kRootParamBytes;
  std::vector<ModeCase> cases;
  // Pageable: pinned in place; Staged: pageable through the staging ring.
  for (const auto& [t, target, pin] : std::vector<std::tuple<std::string, T, bool>>{
           {"Pinned", T::kPinnedHost, true}, {"Pageable", T::kPageableHost, true},
           {"Staged", T::kPageableHost, false}, {"Disk", T::kDisk, true}}) {
    const OffloadType b = OffloadType::kBlockLevel, l = OffloadType::kLeafLevel;
    cases.push_back({"Block1" + t, Opts(b, 1, false, target, pin), block + outside});
    cases.push_back({"Block1Stream" + t, Opts(b, 1, true, target, pin), 2 * block + outside});
    cases.push_back({"Block3" + t, Opts(b, 3, false, target, pin), 3 * block + outside});
    cases.push_back({"Block3Stream" + t, Opts(b, 3, true, target, pin), 6 * block + outside});
    cases.push_back({"Leaf" + t, Opts(l, 1, false, target, pin), leaf + root});
    cases.push_back({"LeafStream" + t, Opts(l, 1, true, target, pin), 2 * leaf + root});
  }
  GroupOffloadOptions deep = Opts(OffloadType::kBlockLevel, 1, true, T::kPinnedHost);
  deep.prefetch_depth = 3;
  cases.push_back({"Block1Depth3", deep, 4 * block + outside});
  GroupOffloadOptions budget = Opts(OffloadType::kBlockLevel, 1, true, T::kPinnedHost);
  budget.budget_bytes = StackModel::kTotalBytes * 3 / 4;  // Room for 2 slots, outside, 2 blocks.
  cases.push_back({"Budget75", budget, 4 * block + outside});
  GroupOffloadOptions all = Opts(OffloadType::kBlockLevel, 1, true, T::kPageableHost);
  all.budget_bytes = StackModel::kTotalBytes;  // Everything fits: no slots at all.
  cases.push_back({"BudgetAll", all, StackModel::kTotalBytes});
  return cases;
}

void PrintTo(const ModeCase& c, std::ostream* os) { *os << c.name; }

class GroupOffloadModeTest : public ::testing::TestWithParam<ModeCase> {};

// A block a forward runs twice where the recorded order has it once (a model that runs a streamed
// submodule once per sample) is served again where it is: the forwards after wait for no copy and
// prefetch each group once, as ordered forwards do. Searching the order for it used to find its place
// in the next forward: the groups between counted as skipped, the prefetched ones copied again into
// shifted slots (6 groups, 5 slots) and waited for.
TEST(GroupOffloadTest, AGroupReachedTwiceInAForwardKeepsThePrefetchOrder) {
  Fixture f;
  GroupOffloadOptions options;
  options.use_stream = true;
  options.prefetch_depth = 4;
  auto offloader = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend, options);
  ASSERT_TRUE(offloader.ok()) << offloader.status();
  ASSERT_EQ((*offloader)->stats().streamed_groups, StackModel::kBlocks);
  ASSERT_EQ((*offloader)->stats().slots, 5);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
  const GroupOffloadStats before = (*offloader)->stats();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(at::equal(f.Run(StackOrder::kFirstTwice), f.twice_reference)) << i;
  const GroupOffloadStats twice = (*offloader)->stats();
  EXPECT_EQ(twice.onloads - before.onloads, 3 * (StackModel::kBlocks + 1));
  EXPECT_EQ(twice.sync_onloads - before.sync_onloads, 0);
  EXPECT_EQ(twice.prefetches - before.prefetches, 3 * StackModel::kBlocks);
  // Ordered forwards after them go on as before.
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
  const GroupOffloadStats after = (*offloader)->stats();
  EXPECT_EQ(after.sync_onloads - twice.sync_onloads, 0);
  EXPECT_EQ(after.prefetches - twice.prefetches, 2 * StackModel::kBlocks);
  // The repeat once its slot was taken (block 0 again after the last block: the prefetches of the
  // next forward's first groups went ahead of it) stays exact.
  EXPECT_TRUE(at::equal(f.Run(StackOrder::kRepeatFirst), f.repeat_reference));
  EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
}

TEST_P(GroupOffloadModeTest, OutputEqualsResidentExactlyAndPeakIsExact) {
  Fixture f;
  GroupOffloadOptions options = GetParam().options;
  if (options.target == OffloadTarget::kDisk) options.disk_dir = TempDir("disk_" + GetParam().name);
  auto offloader = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend, options);
  ASSERT_TRUE(offloader.ok()) << offloader.status();
  EXPECT_EQ((*offloader)->stats().working_set_bytes, GetParam().expected_peak);
  for (int i = 0; i < 3; ++i) {  // The first forward records the order; later ones prefetch.
    at::Tensor out;
    const int64_t peak = f.PeakOfForward(StackOrder::kForward, &out);
    EXPECT_TRUE(at::equal(out, f.reference)) << "forward " << i;
    EXPECT_EQ(peak, GetParam().expected_peak) << "forward " << i;
  }
  const GroupOffloadStats stats = (*offloader)->stats();
  EXPECT_EQ(stats.forwards, 3);
  if (options.target == OffloadTarget::kPinnedHost) {
    // Pinned chunks hold exactly the packed groups that are not resident: no pinned slack.
    EXPECT_EQ(stats.pinned_host_bytes, stats.streamed_bytes + stats.always_on_bytes);
  } else {
    EXPECT_EQ(stats.pinned_host_bytes, 0);
  }
  if (options.target == OffloadTarget::kPageableHost && options.pin_in_place) {
    // Every byte that is not kept resident (streamed or always-on groups) pinned where it lies
    // (page-rounded), nothing staged.
    EXPECT_GE(stats.pinned_in_place_bytes, StackModel::kTotalBytes - stats.resident_bytes);
    EXPECT_EQ(stats.pin_in_place_error, "");
  } else {
    EXPECT_EQ(stats.pinned_in_place_bytes, 0);
  }
  if (options.use_stream) {
    if (stats.streamed_groups > stats.slots) {
      // The recording forward loads every group synchronously; the next forward's first group too
      // (nothing was prefetched during recording); every later onload was prefetched.
      EXPECT_EQ(stats.sync_onloads, stats.streamed_groups + 1);
      // Forwards 2 and 3 copy every group ahead of need at least once (exactly once at depth 1).
      if (options.prefetch_depth == 1) {
        EXPECT_EQ(stats.prefetches, 2 * stats.streamed_groups);
      } else {
        EXPECT_GE(stats.prefetches, 2 * stats.streamed_groups);
      }
    } else {
      // Every streamed group has a slot of its own: loaded once, never copied again.
      EXPECT_EQ(stats.sync_onloads, stats.streamed_groups);
      EXPECT_EQ(stats.prefetches, 0);
    }
  } else {
    EXPECT_EQ(stats.sync_onloads, stats.onloads);
  }
  // Out of order, conditional and repeated calls stay exact.
  at::Tensor out;
  f.PeakOfForward(StackOrder::kReverse, &out);
  EXPECT_TRUE(at::equal(out, f.reverse_reference));
  f.PeakOfForward(StackOrder::kSkipOdd, &out);
  EXPECT_TRUE(at::equal(out, f.skip_reference));
  f.PeakOfForward(StackOrder::kRepeatFirst, &out);
  EXPECT_TRUE(at::equal(out, f.repeat_reference));
  f.PeakOfForward(StackOrder::kForward, &out);
  EXPECT_TRUE(at::equal(out, f.reference));
}

INSTANTIATE_TEST_SUITE_P(Modes, GroupOffloadModeTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<ModeCase>& info) { return info.param.name; });

TEST(GroupOffloadTest, PeakDeviceBytesAreOrderedAcrossModes) {
  auto peak_of = [](GroupOffloadOptions options) {
    Fixture f;
    auto offloader = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend, options);
    EXPECT_TRUE(offloader.ok()) << offloader.status();
    at::Tensor out;
    f.PeakOfForward(StackOrder::kForward, &out);
    return f.PeakOfForward(StackOrder::kForward, &out);
  };
  using T = OffloadTarget;
  const int64_t leaf = peak_of(Opts(OffloadType::kLeafLevel, 1, false, T::kPinnedHost));
  const int64_t leaf_stream = peak_of(Opts(OffloadType::kLeafLevel, 1, true, T::kPinnedHost));
  const int64_t block1 = peak_of(Opts(OffloadType::kBlockLevel, 1, false, T::kPinnedHost));
  const int64_t block1_stream = peak_of(Opts(OffloadType::kBlockLevel, 1, true, T::kPinnedHost));
  const int64_t block3 = peak_of(Opts(OffloadType::kBlockLevel, 3, false, T::kPinnedHost));
  Fixture resident;
  ASSERT_TRUE(resident.weights->OnloadAll(*resident.backend).ok());
  resident.backend->ResetPeakStats();
  const int64_t all = resident.backend->GetMemoryStats().peak_allocated_bytes;
  EXPECT_EQ(all, StackModel::kTotalBytes);
  EXPECT_LE(leaf, leaf_stream);
  EXPECT_LT(leaf_stream, block1);
  EXPECT_LE(block1, block1_stream);
  EXPECT_LT(block1_stream, block3);
  EXPECT_LT(block3, all);
}

// A run's last forward (SkipPrefetchAfterNextForward before it) prefetches its own later groups
// but none of a next forward's; the forward after it, with nothing prefetched, loads its first group
// synchronously and prefetches as before; every output stays exact. At depth 3: the normal forward
// issues every group it needs after its first plus the next forward's first three.
TEST(GroupOffloadTest, TheLastForwardOfARunPrefetchesNothingOfTheNext) {
  Fixture f;
  GroupOffloadOptions options = Opts(OffloadType::kBlockLevel, 1, true, OffloadTarget::kPinnedHost);
  options.prefetch_depth = 3;
  auto offloader = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend, options);
  ASSERT_TRUE(offloader.ok()) << offloader.status();
  GroupOffloader& o = **offloader;
  const int64_t groups = o.stats().streamed_groups;
  ASSERT_GT(groups, o.stats().slots);  // Streamed through the ring, not held.
  const auto forward = [&] {
    at::Tensor out;
    f.PeakOfForward(StackOrder::kForward, &out);
    EXPECT_TRUE(at::equal(out, f.reference));
  };
  forward();  // Records the order.
  forward();  // Prefetches its groups after the first and the next forward's first three.
  GroupOffloadStats before = o.stats();
  o.SkipPrefetchAfterNextForward();
  forward();  // The last of a run: its first three came from the forward before; no wrap.
  GroupOffloadStats after = o.stats();
  EXPECT_EQ(after.prefetches - before.prefetches, groups - 3);
  EXPECT_EQ(after.prefetches_skipped_after_last, 3);
  EXPECT_EQ(after.sync_onloads, before.sync_onloads);
  before = after;
  forward();  // A new run: its first group loads synchronously, then prefetching as usual.
  after = o.stats();
  EXPECT_EQ(after.sync_onloads - before.sync_onloads, 1);
  EXPECT_EQ(after.prefetches - before.prefetches, groups - 1 + 3);
  EXPECT_EQ(after.prefetches_skipped_after_last, 3);  // The hint held for one forward only.
}

TEST(GroupOffloadTest, BudgetKeepsTheGroupsThatFitResident) {
  Fixture f;
  GroupOffloadOptions options = Opts(OffloadType::kBlockLevel, 1, true, OffloadTarget::kPinnedHost);
  options.budget_bytes = StackModel::kTotalBytes * 3 / 4;
  auto offloader = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend, options);
  ASSERT_TRUE(offloader.ok());
  const GroupOffloadStats stats = (*offloader)->stats();
  EXPECT_EQ(stats.resident_groups, 2);
  EXPECT_EQ(stats.streamed_groups, 4);
  EXPECT_EQ(stats.streamed_bytes, 4 * StackModel::kBlockBytes);
  EXPECT_LE(stats.working_set_bytes, options.budget_bytes);
}

TEST(GroupOffloadTest, RemovalRestoresTheModule) {
  Fixture f;
  std::vector<size_t> hooks_before;
  f.model.ForEachModule([&](Module& m) { hooks_before.push_back(m.hook_count()); });
  {
    auto offloader = GroupOffloader::Apply(
        "stack", f.model, *f.weights, *f.backend, Opts(OffloadType::kLeafLevel, 1, true, OffloadTarget::kPinnedHost));
    ASSERT_TRUE(offloader.ok());
    at::Tensor out;
    f.PeakOfForward(StackOrder::kForward, &out);
  }
  std::vector<size_t> hooks_after;
  f.model.ForEachModule([&](Module& m) { hooks_after.push_back(m.hook_count()); });
  EXPECT_EQ(hooks_before, hooks_after);
  EXPECT_EQ(f.backend->GetMemoryStats().allocated_bytes, 0);
  EXPECT_EQ(f.model.DefinedBytes(), 0);  // Offloaded, like a registered component.
  EXPECT_THROW(f.Run(StackOrder::kForward), OffloadedTensorAccess);
  ASSERT_TRUE(f.weights->OnloadAll(*f.backend).ok());
  EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
}

TEST(GroupOffloadTest, DiskFilesAreWrittenOnceReusedAndReplacedWhenStale) {
  const std::string dir = TempDir("disk_reuse");
  GroupOffloadOptions options = Opts(OffloadType::kBlockLevel, 2, true, OffloadTarget::kDisk);
  options.disk_dir = dir;
  {
    Fixture f;
    auto first = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend, options);
    ASSERT_TRUE(first.ok()) << first.status();
    // 3 block groups and the group outside the blocks.
    EXPECT_EQ((*first)->stats().disk_files_written, 4);
    EXPECT_EQ((*first)->stats().disk_files_reused, 0);
  }
  Fixture f;
  auto second = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend, options);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ((*second)->stats().disk_files_written, 0);
  EXPECT_EQ((*second)->stats().disk_files_reused, 4);
  at::Tensor out;
  f.PeakOfForward(StackOrder::kForward, &out);
  EXPECT_TRUE(at::equal(out, f.reference));
  second->reset();
  // Change one weight of block 3 (group 2-3): only that group's file is rewritten.
  Fixture changed;
  for (HostWeights::Entry& e : changed.weights->entries()) {
    if (e.module->SlotPath(*e.slot) == "blocks.3.fc1.bias") e.host.add_(1.0f);
  }
  auto third = GroupOffloader::Apply("stack", changed.model, *changed.weights, *changed.backend, options);
  ASSERT_TRUE(third.ok());
  EXPECT_EQ((*third)->stats().disk_files_written, 1);
  EXPECT_EQ((*third)->stats().disk_files_reused, 3);
}

TEST(GroupOffloadTest, ErrorsNameTheComponentAndTheOption) {
  Fixture f;
  auto first = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend,
                                     Opts(OffloadType::kBlockLevel, 1, false, OffloadTarget::kPinnedHost));
  ASSERT_TRUE(first.ok());
  auto twice = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend,
                                     Opts(OffloadType::kLeafLevel, 1, false, OffloadTarget::kPinnedHost));
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(twice.status().message()).find("'stack' already has group offloading"), std::string::npos);
  first->reset();

  SimulatedBackendOptions no_streams;
  no_streams.supports_streams = false;
  auto plain = CreateSimulatedBackend(no_streams);
  auto streams = GroupOffloader::Apply("stack", f.model, *f.weights, *plain,
                                       Opts(OffloadType::kBlockLevel, 1, true, OffloadTarget::kPinnedHost));
  EXPECT_EQ(streams.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(streams.status().message()).find("use_stream"), std::string::npos);

  GroupOffloadOptions tight = Opts(OffloadType::kBlockLevel, 1, true, OffloadTarget::kPinnedHost);
  tight.budget_bytes = StackModel::kBlockBytes;  // Less than outside-blocks + 2 slots.
  auto budget = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend, tight);
  EXPECT_EQ(budget.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(budget.status().message()).find("budget_bytes"), std::string::npos) << budget.status();

  GroupOffloadOptions disk = Opts(OffloadType::kBlockLevel, 1, false, OffloadTarget::kDisk);
  disk.disk_dir = "/proc/stowage-cannot-write-here";
  auto unwritable = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend, disk);
  EXPECT_EQ(unwritable.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(std::string(unwritable.status().message()).find("disk_dir"), std::string::npos);

  GroupOffloadOptions no_blocks = Opts(OffloadType::kBlockLevel, 1, false, OffloadTarget::kPinnedHost);
  no_blocks.block_modules = {"nonexistent"};
  EXPECT_EQ(GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend, no_blocks).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A failed Apply changed nothing: the next one works and computes exactly.
  auto ok = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend,
                                  Opts(OffloadType::kBlockLevel, 2, true, OffloadTarget::kPageableHost));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
}

TEST(GroupOffloadTest, PinInPlaceRegistersOnceAndReleasesOnRemoval) {
  Fixture f;
  const GroupOffloadOptions options = Opts(OffloadType::kLeafLevel, 1, true, OffloadTarget::kPageableHost);
  std::vector<const void*> hosts;
  for (int round = 0; round < 2; ++round) {
    // A second Apply can register the same memory only if the first one's removal unregistered it.
    auto offloader = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend, options);
    ASSERT_TRUE(offloader.ok()) << offloader.status();
    EXPECT_GT((*offloader)->stats().pinned_in_place_bytes, 0) << "round " << round;
    EXPECT_EQ((*offloader)->stats().pin_in_place_error, "") << "round " << round;
    EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
    if (round == 0) {
      for (auto& entry : f.weights->entries()) hosts.push_back(entry.host.data_ptr());
    }
  }
  // Heap host copies moved once, into the component's own arena (offload/host_weights.h), and are
  // pinned there from then on: the second Apply copied nothing.
  size_t i = 0;
  for (auto& entry : f.weights->entries()) EXPECT_EQ(entry.host.data_ptr(), hosts[i++]);
}

TEST(GroupOffloadTest, ReleasedSlotsComeBackOnTheNextForwardOrFailAsOutOfMemory) {
  Fixture f;
  auto applied = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend,
                                       Opts(OffloadType::kBlockLevel, 1, true, OffloadTarget::kPinnedHost));
  ASSERT_TRUE(applied.ok()) << applied.status();
  GroupOffloader& offloader = **applied;
  const GroupOffloadStats stats = offloader.stats();
  const int64_t ring = stats.slots * stats.slot_bytes;
  ASSERT_GT(ring, 0);
  EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
  EXPECT_EQ(offloader.device_bytes(), ring);
  EXPECT_TRUE(offloader.holds_slots());
  EXPECT_EQ(offloader.bytes_needed_to_run(), stats.always_on_bytes);

  const int64_t before = f.backend->GetMemoryStats().allocated_bytes;
  EXPECT_EQ(offloader.ReleaseSlots(), ring);
  EXPECT_EQ(f.backend->GetMemoryStats().allocated_bytes, before - ring);  // Back to the device.
  EXPECT_EQ(offloader.device_bytes(), 0);
  EXPECT_FALSE(offloader.holds_slots());
  EXPECT_EQ(offloader.bytes_needed_to_run(), ring + stats.always_on_bytes);
  EXPECT_EQ(offloader.ReleaseSlots(), 0);  // Nothing left to give back.
  EXPECT_EQ(offloader.stats().slot_releases, 1);

  // The next forward allocates the ring again; its first group is loaded synchronously (nothing
  // was prefetched into the released ring), the rest prefetched as before.
  const int64_t sync_before = offloader.stats().sync_onloads;
  EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
  EXPECT_EQ(offloader.device_bytes(), ring);
  EXPECT_EQ(offloader.stats().sync_onloads, sync_before + 1);

  // With no room for the ring, the forward fails as a device out-of-memory error (which placement
  // recovers from), and works again once there is room.
  EXPECT_EQ(offloader.ReleaseSlots(), ring);
  ASSERT_TRUE(f.backend->SetMemoryBudget(f.backend->GetMemoryStats().allocated_bytes + ring / 2).ok());
  EXPECT_THROW(f.Run(StackOrder::kForward), DeviceOutOfMemory);
  ASSERT_TRUE(f.backend->SetMemoryBudget(0).ok());
  EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
}

// The spare-room cache: under an allowance, streamed groups stay on the device after a forward and
// the next forward copies only the ones that did not fit; outputs stay the reference's; the cache
// counts in device_bytes, shrinks to a lower allowance at once, and goes back with the slots.
TEST(GroupOffloadTest, TheSpareRoomCacheKeepsStreamedGroupsWithinItsAllowance) {
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "with a copy stream" : "without");
    Fixture f;
    auto applied = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend,
                                         Opts(OffloadType::kBlockLevel, 1, stream, OffloadTarget::kPinnedHost));
    ASSERT_TRUE(applied.ok()) << applied.status();
    GroupOffloader& offloader = **applied;
    const GroupOffloadStats planned = offloader.stats();
    ASSERT_GE(planned.streamed_groups, 3);
    const int64_t ring = planned.slots * planned.slot_bytes + planned.scratch_bytes;
    const auto h2d = [&] { return f.backend->GetMemoryStats().host_to_device_bytes; };
    // No allowance (the default): every forward copies every streamed group.
    int64_t copied = h2d();
    EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
    const int64_t per_forward = h2d() - copied;
    ASSERT_GT(per_forward, 0);
    EXPECT_EQ(offloader.cache_bytes(), 0);
    EXPECT_EQ(offloader.stats().cached_groups, 0);

    // Room for two blocks (the stack's streamed groups are equal blocks): two are kept.
    const int64_t block = planned.slot_bytes;
    EXPECT_EQ(offloader.SetCacheAllowance(2 * block + block / 2), 0);
    EXPECT_EQ(offloader.stats().cache_allowance_bytes, 2 * block + block / 2);
    copied = h2d();
    EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
    EXPECT_EQ(h2d() - copied, per_forward);  // The forward that fills the cache still copies all.
    EXPECT_EQ(offloader.stats().cached_groups, 2);
    EXPECT_EQ(offloader.cache_bytes(), 2 * block);
    EXPECT_EQ(offloader.device_bytes(), ring + 2 * block);
    EXPECT_EQ(f.backend->GetMemoryStats().allocated_bytes, ring + 2 * block + planned.resident_bytes);
    copied = h2d();
    const int64_t hits = offloader.stats().cache_hits;
    EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
    EXPECT_EQ(h2d() - copied, per_forward - 2 * block);  // The cached two are not copied.
    EXPECT_EQ(offloader.stats().cache_hits, hits + 2);
    EXPECT_EQ(offloader.stats().cache_hit_bytes, 2 * block);
    // Another order reads cached groups out of order: still exact.
    EXPECT_TRUE(at::equal(f.Run(StackOrder::kReverse), f.reverse_reference));
    EXPECT_TRUE(at::equal(f.Run(StackOrder::kRepeatFirst), f.repeat_reference));

    // A lower allowance gives back what is over it at once.
    const int64_t allocated = f.backend->GetMemoryStats().allocated_bytes;
    EXPECT_EQ(offloader.SetCacheAllowance(block), block);
    EXPECT_EQ(offloader.cache_bytes(), block);
    EXPECT_EQ(f.backend->GetMemoryStats().allocated_bytes, allocated - block);
    // ReleaseSlots frees the ring and leaves the cache: the next forward allocates the ring again and
    // still copies none of the cached block.
    EXPECT_TRUE(offloader.holds_slots());
    EXPECT_EQ(offloader.ReleaseSlots(), ring);
    EXPECT_EQ(offloader.cache_bytes(), block);
    EXPECT_EQ(offloader.device_bytes(), planned.resident_bytes + block);
    EXPECT_FALSE(offloader.holds_slots());
    copied = h2d();
    EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
    EXPECT_EQ(h2d() - copied, per_forward - block);
    // Emptied, the allowance still there: the next forward fills the cache again.
    EXPECT_EQ(offloader.SetCacheAllowance(0), block);
    EXPECT_EQ(offloader.SetCacheAllowance(block), 0);
    EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
    EXPECT_EQ(offloader.cache_bytes(), block);
    // Allowance 0: the cache empties; a budget with no room beyond the ring leaves groups streamed
    // (the allocation is refused, the forward still runs).
    EXPECT_EQ(offloader.SetCacheAllowance(0), block);
    EXPECT_EQ(offloader.cache_bytes(), 0);
    ASSERT_TRUE(f.backend->SetMemoryBudget(f.backend->GetMemoryStats().allocated_bytes + block / 2).ok());
    EXPECT_EQ(offloader.SetCacheAllowance(10 * block), 0);
    f.backend->ResetPeakStats();
    EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
    EXPECT_EQ(offloader.cache_bytes(), 0);
    EXPECT_LE(f.backend->GetMemoryStats().peak_allocated_bytes, f.backend->GetMemoryStats().budget_bytes);
  }
}

TEST(GroupOffloadTest, PinnedCopiesFromASafetensorsMappingDropItsPages) {
  Fixture f;
  // The weights as a loader leaves them: views of a mapped safetensors file.
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (auto& entry : f.weights->entries()) named.emplace_back(entry.module->SlotPath(*entry.slot), entry.host);
  const std::string path = TempDir("mapped") + "/stack.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, named).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  int64_t whole_pages = 0;  // What ReleaseMappedPages can drop: the whole pages inside each tensor.
  for (auto& entry : f.weights->entries()) {
    at::Tensor mapped = *(*file)->Get(entry.module->SlotPath(*entry.slot));
    const auto begin = reinterpret_cast<uintptr_t>(mapped.data_ptr());
    const uintptr_t end = begin + mapped.nbytes();
    whole_pages += std::max<int64_t>(0, static_cast<int64_t>(end / page * page) -
                                            static_cast<int64_t>((begin + page - 1) / page * page));
    f.weights->ReplaceHost(entry, mapped);
  }
  ASSERT_GT(whole_pages, 0);
  auto offloader = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend,
                                         Opts(OffloadType::kBlockLevel, 1, true, OffloadTarget::kPinnedHost));
  ASSERT_TRUE(offloader.ok()) << offloader.status();
  EXPECT_EQ((*offloader)->stats().mapped_bytes_released, whole_pages);
  // The host copies now live in the pinned chunks, not in the mapping.
  const auto* data = (*file)->data();
  for (auto& entry : f.weights->entries()) {
    const auto* host = static_cast<const uint8_t*>(entry.host.data_ptr());
    EXPECT_FALSE(host >= data && host < data + (*file)->data_bytes());
  }
  EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
}

TEST(GroupOffloadTest, DiskGroupFilesTruncatedUnderTheOffloaderAreReportedNotFatal) {
  const std::string dir = TempDir("disk_truncated");
  std::system(("rm -rf '" + dir + "'/stack").c_str());
  GroupOffloadOptions options = Opts(OffloadType::kBlockLevel, 1, false, OffloadTarget::kDisk);
  options.disk_dir = dir;
  Fixture f;
  auto offloader = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend, options);
  ASSERT_TRUE(offloader.ok()) << offloader.status();
  EXPECT_TRUE(f.weights->CheckSourceFiles().ok()) << f.weights->CheckSourceFiles();
  // Someone truncates every group file (a `cp` into the offload directory, a cleanup script).
  ASSERT_EQ(std::system(("for f in '" + dir + "'/stack/*.safetensors; do : > \"$f\"; done").c_str()), 0);
  at::Tensor out;
  f.PeakOfForward(StackOrder::kForward, &out);  // Staged from the mappings: zeros, no SIGBUS.
  const absl::Status status = f.weights->CheckSourceFiles();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_NE(status.message().find("model file '" + dir + "/stack/"), std::string::npos) << status;
}

TEST(GroupOffloadTest, PinnedCopyRefusesASourceFileThatChangedOnDisk) {
  Fixture f;
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (auto& entry : f.weights->entries()) named.emplace_back(entry.module->SlotPath(*entry.slot), entry.host);
  const std::string path = TempDir("mapped_changed") + "/stack.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, named).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  for (auto& entry : f.weights->entries()) f.weights->ReplaceHost(entry, *(*file)->Get(entry.module->SlotPath(*entry.slot)));
  ASSERT_EQ(::truncate(path.c_str(), 8), 0);
  auto offloader = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend,
                                         Opts(OffloadType::kBlockLevel, 1, true, OffloadTarget::kPinnedHost));
  EXPECT_EQ(offloader.status().code(), absl::StatusCode::kFailedPrecondition) << offloader.status();
  EXPECT_NE(offloader.status().message().find(path), std::string::npos) << offloader.status();
}

TEST(GroupOffloadTest, RefusedRegistrationFallsBackToStagingAndSaysWhy) {
  Fixture f;
  SimulatedBackendOptions refusing;
  refusing.refuse_host_registration = true;
  f.backend = CreateSimulatedBackend(refusing);
  auto offloader = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend,
                                         Opts(OffloadType::kBlockLevel, 1, true, OffloadTarget::kPageableHost));
  ASSERT_TRUE(offloader.ok()) << offloader.status();
  EXPECT_EQ((*offloader)->stats().pinned_in_place_bytes, 0);
  EXPECT_NE((*offloader)->stats().pin_in_place_error.find("refused"), std::string::npos)
      << (*offloader)->stats().pin_in_place_error;
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
}

TEST(GroupOffloadTest, DepthZeroIsChosenPerLevel) {
  struct Case {
    OffloadType type;
    int64_t budget;
    int depth;
    CompressFormat compress = CompressFormat::kNone;
    int64_t device_budget = 0;
    int per_group = 1;
  };
  // Leaf groups are small: 4 ahead; block level, or any level under a budget: 1; compressed block
  // level without a budget, or a device budget: 4, when it streams more groups than the slots.
  for (const Case& c :
       {Case{OffloadType::kLeafLevel, 0, 4}, Case{OffloadType::kBlockLevel, 0, 1},
        Case{OffloadType::kLeafLevel, StackModel::kTotalBytes / 2, 1},
        Case{OffloadType::kBlockLevel, 0, 4, CompressFormat::kInt4},
        Case{OffloadType::kBlockLevel, StackModel::kTotalBytes / 2, 1, CompressFormat::kInt4},
        Case{OffloadType::kBlockLevel, 0, 1, CompressFormat::kInt4, int64_t{1} << 30},
        // Three streamed groups: no more than the deeper ring's slots, so it stays 1.
        Case{OffloadType::kBlockLevel, 0, 1, CompressFormat::kInt4, 0, 2}}) {
    SCOPED_TRACE(absl::StrCat(static_cast<int>(c.type), " ", c.budget, " ", CompressFormatName(c.compress), " ",
                              c.device_budget));
    Fixture f;
    if (c.device_budget > 0) ASSERT_TRUE(f.backend->SetMemoryBudget(c.device_budget).ok());
    GroupOffloadOptions options = Opts(c.type, c.per_group, true, OffloadTarget::kPinnedHost);
    options.prefetch_depth = 0;
    options.budget_bytes = c.budget;
    options.compress = c.compress;
    auto offloader = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend, options);
    ASSERT_TRUE(offloader.ok()) << offloader.status();
    EXPECT_EQ((*offloader)->options().prefetch_depth, c.depth);
    if (c.budget == 0) {
      EXPECT_EQ((*offloader)->stats().slots, c.depth + 1);
    }
    if (c.compress == CompressFormat::kNone) EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
  }
  Fixture f;
  GroupOffloadOptions negative = Opts(OffloadType::kLeafLevel, 1, true, OffloadTarget::kPinnedHost);
  negative.prefetch_depth = -1;
  EXPECT_EQ(GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend, negative).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GroupOffloadTest, ExplicitBlockModulesReachNestedBlocks) {
  Fixture f;
  GroupOffloadOptions options = Opts(OffloadType::kBlockLevel, 1, true, OffloadTarget::kPinnedHost);
  options.block_modules = {"blocks"};
  auto offloader = GroupOffloader::Apply("stack", f.model, *f.weights, *f.backend, options);
  ASSERT_TRUE(offloader.ok());
  EXPECT_EQ((*offloader)->stats().streamed_groups, 6);
  EXPECT_TRUE(at::equal(f.Run(StackOrder::kForward), f.reference));
}

}  // namespace
}  // namespace stowage
